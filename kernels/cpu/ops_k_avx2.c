/* AVX2 integer kernels of the K-quant dot products (see sh__cpu_k_ints_fn in cpu.h): per 32
 * weight codes one maddubs against the Q8_K codes and one madd with the sub-block scales, the
 * minimums from the activation's bsums; per-function target attributes like ops_avx2.c. */
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

/* Q4_K/Q5_K scales and minimums (quant_k.c's get_scale_min). */
static void scale_min_k4(const uint8_t *q, int *sc, int *m)
{
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* sum_j m_j * (sum of the 32 activation codes of sub-block j), from the bsums of 16 each. */
static int32_t mins_k4(const int *m, const int16_t *bsums)
{
    int32_t s = 0;
    for (int j = 0; j < 8; j++)
        s += m[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* Q4_K and (HIGH) Q5_K: byte l of qs group g holds element 64g + l (low nibble) and 64g + 32 + l
 * (high nibble); Q5_K's fifth bits are bits 2g and 2g + 1 of qh[l]. */
INL void ints_q45(const uint8_t *qs, const uint8_t *qh, const uint8_t *scales,
                  const sh_block_q8_k *a, int32_t *ints, const int high)
{
    int sc[8], m[8];
    scale_min_k4(scales, sc, m);
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
        const __m256i a0 = _mm256_loadu_si256((const void *)(a->qs + 64 * g));
        const __m256i a1 = _mm256_loadu_si256((const void *)(a->qs + 64 * g + 32));
        acc = _mm256_add_epi32(acc, dot_scaled(lo, a0, _mm256_set1_epi16((short)sc[2 * g])));
        acc = _mm256_add_epi32(acc, dot_scaled(hi, a1, _mm256_set1_epi16((short)sc[2 * g + 1])));
    }
    ints[0] = hsum8i(acc);
    ints[1] = mins_k4(m, a->bsums);
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
TGT static void ints_q6_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q6_k *w = wv;
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
    const __m256i m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[b].ql + 64 * h, *qh = w[b].qh + 32 * h;
            const int8_t *sc = w[b].scales + 8 * h;
            const __m256i l0 = _mm256_loadu_si256((const void *)ql);
            const __m256i l1 = _mm256_loadu_si256((const void *)(ql + 32));
            const __m256i vh = _mm256_loadu_si256((const void *)qh);
            __m256i q[4];
            /* The shifts are 16-bit; the masks drop what crossed from the neighbouring byte. */
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(vh, m3), 4));
            q[1] = _mm256_or_si256(
                _mm256_and_si256(l1, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_and_si256(vh, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(vh, 2), m30));
            for (int k = 0; k < 4; k++) {
                const __m256i av = _mm256_loadu_si256((const void *)(a[b].qs + 128 * h + 32 * k));
                const __m256i p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], av), _mm256_maddubs_epi16(c32, av));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale2(sc[2 * k], sc[2 * k + 1])));
            }
        }
        ints[2 * b] = hsum8i(acc);
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
TGT static void ints_q3_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q3_k *w = wv;
    const __m256i m3 = _mm256_set1_epi8(3), c4 = _mm256_set1_epi8(4);
    for (int64_t b = 0; b < nb; b++) {
        int sc[16];
        for (int j = 0; j < 16; j++)
            sc[j] = scale_q3(w[b].scales, j) - 32;
        const __m256i vhm = _mm256_loadu_si256((const void *)w[b].hmask);
        __m256i acc = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i vq = _mm256_loadu_si256((const void *)(w[b].qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(vq, 2 * j), m3);
                const __m256i bit = _mm256_set1_epi8((char)(1u << (4 * h + j)));
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(vhm, bit), bit);
                const __m256i sub = _mm256_andnot_si256(set, c4);
                const __m256i av = _mm256_loadu_si256((const void *)(a[b].qs + 128 * h + 32 * j));
                const __m256i p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(q2, av), _mm256_maddubs_epi16(sub, av));
                const int s = 8 * h + 2 * j;
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale2(sc[s], sc[s + 1])));
            }
        }
        ints[2 * b] = hsum8i(acc);
        ints[2 * b + 1] = 0;
    }
}

/* Q2_K: element 128h + 32j + l is (qs[32h + l] >> 2j) & 3 in sub-block 8h + 2j + l / 16, whose
 * scale is the low nibble of scales[] and minimum the high one. */
TGT static void ints_q2_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q2_k *w = wv;
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sc = w[b].scales;
        __m256i acc = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i vq = _mm256_loadu_si256((const void *)(w[b].qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(vq, 2 * j), m3);
                const __m256i av = _mm256_loadu_si256((const void *)(a[b].qs + 128 * h + 32 * j));
                const int s = 8 * h + 2 * j;
                acc =
                    _mm256_add_epi32(acc, dot_scaled(q2, av, scale2(sc[s] & 0xF, sc[s + 1] & 0xF)));
            }
        }
        int32_t sm = 0;
        for (int j = 0; j < 16; j++)
            sm += (sc[j] >> 4) * a[b].bsums[j];
        ints[2 * b] = hsum8i(acc);
        ints[2 * b + 1] = sm;
    }
}

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
#endif
