/* AVX2 K-quant dot products: per 32 weight codes one maddubs against the Q8_K codes and one madd
 * with the sub-block scales, the minimums from the activation's bsums. The integer kernels (see
 * sh__cpu_k_ints_fn in cpu.h) and the matvec/matmul rows, which keep float sums in vector
 * registers across a row's blocks and reduce once per row; per-function target attributes like
 * ops_avx2.c. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

INL int32_t hsum8i(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Scales of two 16-element sub-blocks as int16 lanes: s0 for the low 128 bits (elements 0..15 of
 * a 32-byte vector), s1 for the high ones. */
INL __m256i scale2(int s0, int s1)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
}

/* sum over 32 codes of u * a scaled by the sub-block scales in sv, as 8 int32 lanes. u is
 * unsigned (at most 63 here), a signed: maddubs pairs reach 2 * 63 * 128 < 2^15, so they never
 * saturate. */
INL __m256i dot_scaled(__m256i u, __m256i a, __m256i sv)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), sv);
}

/* Q4_K/Q5_K scales and minimums as 8 bytes each (sc_j, m_j in byte j): the 6-bit fields of
 * quant_k.c's get_scale_min, four sub-blocks per 32-bit word. */
static inline void scale_min_k4(const uint8_t *q, uint64_t *sc, uint64_t *m)
{
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    *sc = (uint64_t)sc_lo | (uint64_t)sc_hi << 32;
    *m = (uint64_t)m_lo | (uint64_t)m_hi << 32;
}

/* A block's integer sums as vector lanes: iv's lanes add up to ints[0] of sh__cpu_k_ints_fn, mv's
 * (the minimum products; zero where the type has none) to ints[1]. */
typedef struct klanes {
    __m256i iv, mv;
} klanes;

/* Q4_K and (HIGH) Q5_K: byte l of qs group g holds element 64g + l (low nibble) and 64g + 32 + l
 * (high nibble); Q5_K's fifth bits are bits 2g and 2g + 1 of qh[l]. The minimums: m_j in words
 * 2j and 2j + 1, so one madd with the bsums gives m_j (bsums[2j] + bsums[2j + 1]) in lane j. */
INL klanes lanes_q45(const uint8_t *qs, const uint8_t *qh, const uint8_t *scales,
                     const sh_block_q8_k *a, const int high)
{
    uint64_t sc8, m8;
    scale_min_k4(scales, &sc8, &m8);
    const __m256i m4 = _mm256_set1_epi8(0xF), b16 = _mm256_set1_epi8(16);
    const __m256i vqh = high ? _mm256_loadu_si256((const void *)qh) : _mm256_setzero_si256();
    __m256i acc = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        const __m256i q = _mm256_loadu_si256((const void *)(qs + 32 * g));
        __m256i lo = _mm256_and_si256(q, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (high) {
            const __m256i bl = _mm256_set1_epi8((char)(1u << (2 * g)));
            const __m256i bh = _mm256_set1_epi8((char)(2u << (2 * g)));
            lo = _mm256_or_si256(
                lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(vqh, bl), bl), b16));
            hi = _mm256_or_si256(
                hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(vqh, bh), bh), b16));
        }
        const short s0 = (short)((sc8 >> (16 * g)) & 0xFF);
        const short s1 = (short)((sc8 >> (16 * g + 8)) & 0xFF);
        const __m256i a0 = _mm256_loadu_si256((const void *)(a->qs + 64 * g));
        const __m256i a1 = _mm256_loadu_si256((const void *)(a->qs + 64 * g + 32));
        acc = _mm256_add_epi32(acc, dot_scaled(lo, a0, _mm256_set1_epi16(s0)));
        acc = _mm256_add_epi32(acc, dot_scaled(hi, a1, _mm256_set1_epi16(s1)));
    }
    const __m128i mb = _mm_cvtsi64_si128((long long)m8);
    const __m256i mw = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));
    klanes k = {acc, _mm256_madd_epi16(_mm256_loadu_si256((const void *)a->bsums), mw)};
    return k;
}

INL void ints_q45(const uint8_t *qs, const uint8_t *qh, const uint8_t *scales,
                  const sh_block_q8_k *a, int32_t *ints, const int high)
{
    const klanes k = lanes_q45(qs, qh, scales, a, high);
    ints[0] = hsum8i(k.iv);
    ints[1] = hsum8i(k.mv);
}

TGT static void ints_q4_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q4_k *w = wv;
    for (int64_t b = 0; b < nb; b++)
        ints_q45(w[b].qs, NULL, w[b].scales, a + b, ints + 2 * b, 0);
}

TGT static void ints_q5_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q5_k *w = wv;
    for (int64_t b = 0; b < nb; b++)
        ints_q45(w[b].qs, w[b].qh, w[b].scales, a + b, ints + 2 * b, 1);
}

/* Q6_K: in half h, byte l of ql holds elements 128h + l (low nibble) and 128h + 64 + l (high);
 * byte 32 + l elements 128h + 32 + l and 128h + 96 + l; qh[l] bits 2k, 2k + 1 are the top two
 * bits of element 128h + 32k + l. The -32 offset: sum (q - 32) a = maddubs(q, a) - maddubs(32, a),
 * pairs within +-24320 so the int16 difference is exact. */
INL klanes lanes_q6(const sh_block_q6_k *w, const sh_block_q8_k *a)
{
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
    const __m256i m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w->ql + 64 * h, *qh = w->qh + 32 * h;
        const int8_t *sc = w->scales + 8 * h;
        const __m256i l0 = _mm256_loadu_si256((const void *)ql);
        const __m256i l1 = _mm256_loadu_si256((const void *)(ql + 32));
        const __m256i vh = _mm256_loadu_si256((const void *)qh);
        __m256i q[4];
        /* The shifts are 16-bit; the masks drop what crossed from the neighbouring byte. */
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                               _mm256_slli_epi16(_mm256_and_si256(vh, m3), 4));
        q[1] =
            _mm256_or_si256(_mm256_and_si256(l1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2), m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(vh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(vh, 2), m30));
        for (int k = 0; k < 4; k++) {
            const __m256i av = _mm256_loadu_si256((const void *)(a->qs + 128 * h + 32 * k));
            const __m256i p =
                _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], av), _mm256_maddubs_epi16(c32, av));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale2(sc[2 * k], sc[2 * k + 1])));
        }
    }
    klanes r = {acc, _mm256_setzero_si256()};
    return r;
}

TGT static void ints_q6_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q6_k *w = wv;
    for (int64_t b = 0; b < nb; b++) {
        ints[2 * b] = hsum8i(lanes_q6(w + b, a + b).iv);
        ints[2 * b + 1] = 0;
    }
}

/* Q3_K's 6-bit scale j, still biased by 32 (quant_k.c's q3_scale). */
static int scale_q3(const uint8_t *s, int j)
{
    int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    return lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

/* Q3_K: element 128h + 32j + l has low bits (qs[32h + l] >> 2j) & 3 and loses 4 when bit 4h + j
 * of hmask[l] is clear: sum (q2 - 4 [bit clear]) a = maddubs(q2, a) - maddubs(4 [clear], a). */
INL klanes lanes_q3(const sh_block_q3_k *w, const sh_block_q8_k *a)
{
    const __m256i m3 = _mm256_set1_epi8(3), c4 = _mm256_set1_epi8(4);
    int sc[16];
    for (int j = 0; j < 16; j++)
        sc[j] = scale_q3(w->scales, j) - 32;
    const __m256i vhm = _mm256_loadu_si256((const void *)w->hmask);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i vq = _mm256_loadu_si256((const void *)(w->qs + 32 * h));
        for (int j = 0; j < 4; j++) {
            const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(vq, 2 * j), m3);
            const __m256i bit = _mm256_set1_epi8((char)(1u << (4 * h + j)));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(vhm, bit), bit);
            const __m256i sub = _mm256_andnot_si256(set, c4);
            const __m256i av = _mm256_loadu_si256((const void *)(a->qs + 128 * h + 32 * j));
            const __m256i p =
                _mm256_sub_epi16(_mm256_maddubs_epi16(q2, av), _mm256_maddubs_epi16(sub, av));
            const int s = 8 * h + 2 * j;
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale2(sc[s], sc[s + 1])));
        }
    }
    klanes r = {acc, _mm256_setzero_si256()};
    return r;
}

TGT static void ints_q3_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q3_k *w = wv;
    for (int64_t b = 0; b < nb; b++) {
        ints[2 * b] = hsum8i(lanes_q3(w + b, a + b).iv);
        ints[2 * b + 1] = 0;
    }
}

/* Q2_K: element 128h + 32j + l is (qs[32h + l] >> 2j) & 3 in sub-block 8h + 2j + l / 16, whose
 * scale is the low nibble of scales[] and minimum the high one. */
INL klanes lanes_q2(const sh_block_q2_k *w, const sh_block_q8_k *a)
{
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0xF);
    const uint8_t *sc = w->scales;
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i vq = _mm256_loadu_si256((const void *)(w->qs + 32 * h));
        for (int j = 0; j < 4; j++) {
            const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(vq, 2 * j), m3);
            const __m256i av = _mm256_loadu_si256((const void *)(a->qs + 128 * h + 32 * j));
            const int s = 8 * h + 2 * j;
            acc = _mm256_add_epi32(acc, dot_scaled(q2, av, scale2(sc[s] & 0xF, sc[s + 1] & 0xF)));
        }
    }
    /* minimums: the high nibbles as words, one madd with the 16 bsums (|bsum| <= 2048) */
    const __m128i s16 = _mm_loadu_si128((const void *)sc);
    const __m256i mw =
        _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s16, 4), _mm256_castsi256_si128(m4)));
    klanes r = {acc, _mm256_madd_epi16(_mm256_loadu_si256((const void *)a->bsums), mw)};
    return r;
}

TGT static void ints_q2_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q2_k *w = wv;
    for (int64_t b = 0; b < nb; b++) {
        const klanes k = lanes_q2(w + b, a + b);
        ints[2 * b] = hsum8i(k.iv);
        ints[2 * b + 1] = hsum8i(k.mv);
    }
}

/* IQ4_XS: sub-block j's 16 code bytes split into 32 nibbles in element order (low nibbles then
 * high), looked up in the grid SH_IQ4_VALUES with one vpshufb, then multiplied as signed bytes:
 * maddubs(|a|, w * sign(a)). |a| read as unsigned is exact for a = -128 too, and w is in
 * [-127, 113], so the pairs reach 2 * 128 * 127 < 2^15 and never saturate. The 6-bit scales
 * minus 32 in the madd. */
INL klanes lanes_iq4xs(const sh_block_iq4_xs *w, const sh_block_q8_k *a)
{
    const __m128i g = _mm_loadu_si128((const void *)SH_IQ4_VALUES);
    const __m256i grid = _mm256_set_m128i(g, g), m4 = _mm256_set1_epi8(0xF);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m128i v = _mm_loadu_si128((const void *)(w->qs + 16 * j));
        const __m256i q = _mm256_shuffle_epi8(
            grid, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4));
        const __m256i aq = _mm256_loadu_si256((const void *)(a->qs + 32 * j));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(aq), _mm256_sign_epi8(q, aq));
        acc = _mm256_add_epi32(
            acc, _mm256_madd_epi16(p, _mm256_set1_epi16((short)sh__iq4_xs_scale(w, j))));
    }
    klanes k = {acc, _mm256_setzero_si256()};
    return k;
}

TGT static void ints_iq4_xs(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_iq4_xs *w = wv;
    for (int64_t b = 0; b < nb; b++) {
        ints[2 * b] = hsum8i(lanes_iq4xs(w + b, a + b).iv);
        ints[2 * b + 1] = 0;
    }
}

/* The row kernels: per token, each block adds da dw * (its integer lanes) to one float vector and
 * da dmin * (its minimum lanes) to another; one reduction at the row's end. Outputs differ from
 * sh__cpu_dot_k's in rounding only (tests/unit/test_kernels_kq.c bounds it), a batched token runs
 * the matvec's operations (batched == unbatched bit for bit) and no output depends on the thread
 * that computes it. */
INL float hsum8f(__m256 v)
{
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

INL float row_k(const uint8_t *w, const sh_block_q8_k *a, int64_t nb, const sh_dtype type)
{
    __m256 s = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        klanes k;
        float dw, dm = 0.0f;
        switch (type) {
        case SH_DTYPE_Q2_K: {
            const sh_block_q2_k *wb = (const sh_block_q2_k *)w + b;
            k = lanes_q2(wb, a + b), dw = _cvtsh_ss(wb->d), dm = _cvtsh_ss(wb->dmin);
            break;
        }
        case SH_DTYPE_Q3_K: {
            const sh_block_q3_k *wb = (const sh_block_q3_k *)w + b;
            k = lanes_q3(wb, a + b), dw = _cvtsh_ss(wb->d);
            break;
        }
        case SH_DTYPE_Q4_K: {
            const sh_block_q4_k *wb = (const sh_block_q4_k *)w + b;
            k = lanes_q45(wb->qs, NULL, wb->scales, a + b, 0);
            dw = _cvtsh_ss(wb->d), dm = _cvtsh_ss(wb->dmin);
            break;
        }
        case SH_DTYPE_Q5_K: {
            const sh_block_q5_k *wb = (const sh_block_q5_k *)w + b;
            k = lanes_q45(wb->qs, wb->qh, wb->scales, a + b, 1);
            dw = _cvtsh_ss(wb->d), dm = _cvtsh_ss(wb->dmin);
            break;
        }
        case SH_DTYPE_IQ4_XS: {
            const sh_block_iq4_xs *wb = (const sh_block_iq4_xs *)w + b;
            k = lanes_iq4xs(wb, a + b), dw = _cvtsh_ss(wb->d);
            break;
        }
        default: {
            const sh_block_q6_k *wb = (const sh_block_q6_k *)w + b;
            k = lanes_q6(wb, a + b), dw = _cvtsh_ss(wb->d);
            break;
        }
        }
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k.iv), _mm256_set1_ps(a[b].d * dw), s);
        if (type == SH_DTYPE_Q2_K || type == SH_DTYPE_Q4_K || type == SH_DTYPE_Q5_K)
            mn = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k.mv), _mm256_set1_ps(a[b].d * dm), mn);
    }
    return hsum8f(_mm256_sub_ps(s, mn));
}

/* Q4_K and Q6_K rows take their own path, which unpacks each weight block once for a tile of up
 * to K_TILE tokens (a matvec is a tile of one) and spreads the sub-block scales with byte shuffles
 * instead of one broadcast per scale. Every token of a tile runs the same operations as it would
 * alone, so batched outputs still equal unbatched ones bit for bit. */
#define K_TILE 4

/* Byte-shuffle patterns: K4_PICK[j] puts int16 word j of each 128-bit lane in every word of the
 * vector; K6_PICK[k] word 2k in every word of the low lane and word 2k + 1 in the high lane. Kept
 * in memory (one shuffle with a memory operand each) rather than rebuilt per row. */
#define PICK_(j) (0x0100 + 0x0202 * (j))
#define PICK8_(j) PICK_(j), PICK_(j), PICK_(j), PICK_(j), PICK_(j), PICK_(j), PICK_(j), PICK_(j)
static const _Alignas(32) uint16_t K4_PICK[8][16] = {
    {PICK8_(0), PICK8_(0)}, {PICK8_(1), PICK8_(1)}, {PICK8_(2), PICK8_(2)}, {PICK8_(3), PICK8_(3)},
    {PICK8_(4), PICK8_(4)}, {PICK8_(5), PICK8_(5)}, {PICK8_(6), PICK8_(6)}, {PICK8_(7), PICK8_(7)}};
static const _Alignas(32) uint16_t K6_PICK[4][16] = {
    {PICK8_(0), PICK8_(1)}, {PICK8_(2), PICK8_(3)}, {PICK8_(4), PICK8_(5)}, {PICK8_(6), PICK8_(7)}};

INL __m256i pick(const uint16_t *pattern) { return _mm256_load_si256((const __m256i *)pattern); }

/* One Q4_K block against nt tokens' Q8_K blocks (a, a + nb, ...): adds da dw * (scaled integer
 * lanes) to s[t] and da dmin * (minimum products) to mn[t]. The integer lanes are lanes_q45's. */
INL void q4k_block(const sh_block_q4_k *w, const sh_block_q8_k *a, int64_t nb, const int nt,
                   __m256 *s, __m256 *mn)
{
    uint64_t sc8, m8;
    scale_min_k4(w->scales, &sc8, &m8);
    /* the eight scales as words, in both 128-bit lanes */
    const __m256i scv =
        _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256i acc[K_TILE];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        const __m256i q = _mm256_loadu_si256((const void *)(w->qs + 32 * g));
        const __m256i lo = _mm256_and_si256(q, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i sl = _mm256_shuffle_epi8(scv, pick(K4_PICK[2 * g]));
        const __m256i sh = _mm256_shuffle_epi8(scv, pick(K4_PICK[2 * g + 1]));
        for (int t = 0; t < nt; t++) {
            const int8_t *aq = a[t * nb].qs + 64 * g;
            acc[t] =
                _mm256_add_epi32(acc[t], dot_scaled(lo, _mm256_loadu_si256((const void *)aq), sl));
            acc[t] = _mm256_add_epi32(
                acc[t], dot_scaled(hi, _mm256_loadu_si256((const void *)(aq + 32)), sh));
        }
    }
    const __m128i mb = _mm_cvtsi64_si128((long long)m8);
    const __m256i mw = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));
    const float dw = _cvtsh_ss(w->d), dm = _cvtsh_ss(w->dmin);
    for (int t = 0; t < nt; t++) {
        const sh_block_q8_k *at = a + t * nb;
        const __m256i mv = _mm256_madd_epi16(_mm256_loadu_si256((const void *)at->bsums), mw);
        s[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_set1_ps(at->d * dw), s[t]);
        mn[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mv), _mm256_set1_ps(at->d * dm), mn[t]);
    }
}

/* One Q6_K block against nt tokens' Q8_K blocks: adds da dw * (integer lanes) to s[t]. The codes
 * as lanes_q6 builds them, but without the -32 offset in the products: it is taken off once per
 * block as 32 * sum_j sc_j bsums[j] (Q6_K's sub-blocks are the 16-element runs the bsums sum),
 * one madd instead of a maddubs and a subtraction per 32 codes. Exact in int32. */
INL void q6k_block(const sh_block_q6_k *w, const sh_block_q8_k *a, int64_t nb, const int nt,
                   __m256 *s)
{
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    /* the 16 scales as words; each half's 8 in both 128-bit lanes */
    const __m256i scw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)w->scales));
    const __m256i sc_half[2] = {_mm256_permute4x64_epi64(scw, 0x44),
                                _mm256_permute4x64_epi64(scw, 0xEE)};
    __m256i acc[K_TILE];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i sch = sc_half[h];
        const uint8_t *ql = w->ql + 64 * h, *qh = w->qh + 32 * h;
        const __m256i l0 = _mm256_loadu_si256((const void *)ql);
        const __m256i l1 = _mm256_loadu_si256((const void *)(ql + 32));
        const __m256i vh = _mm256_loadu_si256((const void *)qh);
        const __m256i vh2 = _mm256_srli_epi16(vh, 2);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                               _mm256_slli_epi16(_mm256_and_si256(vh, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(vh2, m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(vh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(vh2, m30));
        for (int k = 0; k < 4; k++) {
            const __m256i sv = _mm256_shuffle_epi8(sch, pick(K6_PICK[k]));
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_add_epi32(
                    acc[t],
                    dot_scaled(q[k],
                               _mm256_loadu_si256((const void *)(a[t * nb].qs + 128 * h + 32 * k)),
                               sv));
        }
    }
    const float dw = _cvtsh_ss(w->d);
    for (int t = 0; t < nt; t++) {
        const sh_block_q8_k *at = a + t * nb;
        const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const void *)at->bsums), scw);
        const __m256i iv = _mm256_sub_epi32(acc[t], _mm256_slli_epi32(off, 5));
        s[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_set1_ps(at->d * dw), s[t]);
    }
}

/* Rows [r0, r1) of a Q4_K (q6 = 0) or Q6_K weight against tokens [t0, t0 + nt). */
INL void tile_q46(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt, const int q6)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    const uint8_t *w = m->w + (size_t)r * m->row_bytes;
    const sh_block_q8_k *ab = a->qk + t0 * nb;
    __m256 s[K_TILE], mn[K_TILE];
    for (int t = 0; t < nt; t++)
        s[t] = _mm256_setzero_ps(), mn[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (nt == 1) { /* a matvec: the lines SH_CPU_K_PF_DIST past this block's, into L2 (each
                        * block's first line plus one per 64 bytes leaves no line out) */
            const char *pf = (const char *)w +
                             (size_t)b * (q6 ? sizeof(sh_block_q6_k) : sizeof(sh_block_q4_k)) +
                             SH_CPU_K_PF_DIST;
            _mm_prefetch(pf, _MM_HINT_T1);
            _mm_prefetch(pf + 64, _MM_HINT_T1);
            _mm_prefetch(pf + 128, _MM_HINT_T1);
            if (q6)
                _mm_prefetch(pf + 192, _MM_HINT_T1);
        }
        if (q6)
            q6k_block((const sh_block_q6_k *)w + b, ab + b, nb, nt, s);
        else
            q4k_block((const sh_block_q4_k *)w + b, ab + b, nb, nt, s, mn);
    }
    for (int t = 0; t < nt; t++) {
        const float v = hsum8f(q6 ? s[t] : _mm256_sub_ps(s[t], mn[t]));
        float *y = m->y + (t0 + t) * m->ldy + r;
        *y = m->accumulate ? *y + v : v;
    }
}

INL void mm_rows_q46(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int q6)
{
    const int64_t n_tok = m->a->n_tok;
    for (int64_t r = r0; r < r1; r++) {
        if (n_tok == 1) {
            tile_q46(m, r, 0, 1, q6);
            continue;
        }
        int64_t t0 = 0;
        for (; t0 + K_TILE <= n_tok; t0 += K_TILE)
            tile_q46(m, r, t0, K_TILE, q6);
        switch (n_tok - t0) {
        case 3:
            tile_q46(m, r, t0, 3, q6);
            break;
        case 2:
            tile_q46(m, r, t0, 2, q6);
            break;
        case 1:
            tile_q46(m, r, t0, 1, q6);
            break;
        default:
            break;
        }
    }
}

INL void mm_rows(const sh__cpu_mm *m, int64_t r0, int64_t r1, const sh_dtype type)
{
    if (type == SH_DTYPE_Q4_K || type == SH_DTYPE_Q6_K) {
        mm_rows_q46(m, r0, r1, type == SH_DTYPE_Q6_K);
        return;
    }
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = m->w + (size_t)r * m->row_bytes;
        if (a->n_tok == 1) /* prefetch the bytes SH_CPU_K_PF_DIST past this row's, into L2 */
            for (size_t o = 0; o < m->row_bytes; o += 64)
                _mm_prefetch((const char *)w + SH_CPU_K_PF_DIST + o, _MM_HINT_T1);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const float v = row_k(w, a->qk + t * nb, nb, type);
            float *y = m->y + t * m->ldy + r;
            *y = m->accumulate ? *y + v : v;
        }
    }
}

#define DEFINE_MM(t, T)                                                                            \
    TGT void sh__cpu_mm_avx2_##t(const sh__cpu_mm *m, int64_t r0, int64_t r1)                      \
    {                                                                                              \
        mm_rows(m, r0, r1, SH_DTYPE_##T);                                                          \
    }
DEFINE_MM(q2_k, Q2_K)
DEFINE_MM(q3_k, Q3_K)
DEFINE_MM(q4_k, Q4_K)
DEFINE_MM(q5_k, Q5_K)
DEFINE_MM(q6_k, Q6_K)
DEFINE_MM(iq4_xs, IQ4_XS)

sh__cpu_k_ints_fn sh__cpu_k_ints_avx2(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_Q2_K:
        return ints_q2_k;
    case SH_DTYPE_Q3_K:
        return ints_q3_k;
    case SH_DTYPE_Q4_K:
        return ints_q4_k;
    case SH_DTYPE_Q5_K:
        return ints_q5_k;
    case SH_DTYPE_Q6_K:
        return ints_q6_k;
    case SH_DTYPE_IQ4_XS:
        return ints_iq4_xs;
    default:
        return NULL;
    }
}

#else
sh__cpu_k_ints_fn sh__cpu_k_ints_avx2(sh_dtype type)
{
    (void)type;
    return NULL;
}

#define DEFINE_MM(t, T)                                                                            \
    void sh__cpu_mm_avx2_##t(const sh__cpu_mm *m, int64_t r0, int64_t r1)                          \
    {                                                                                              \
        sh__cpu_mm_k(m, r0, r1, SH_DTYPE_##T,                                                      \
                     sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, SH_DTYPE_##T));                 \
    }
DEFINE_MM(q2_k, Q2_K)
DEFINE_MM(q3_k, Q3_K)
DEFINE_MM(q4_k, Q4_K)
DEFINE_MM(q5_k, Q5_K)
DEFINE_MM(q6_k, Q6_K)
DEFINE_MM(iq4_xs, IQ4_XS)
#endif
