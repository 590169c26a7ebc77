/* AVX-512 (F/BW) Q4_K and Q6_K: the integer kernels of the dot products (see sh__cpu_k_ints_fn in
 * cpu.h) and the matvec/matmul rows, which keep float sums in vector registers across blocks.
 * The AVX2 kernels' maddubs + madd per sub-block, 64 codes per instruction, with the sub-block
 * scales spread over the 128-bit lanes by one word permute; the other K types keep the AVX2
 * kernels. Per-function target attributes like ops_avx512.c. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Q4_K/Q5_K scales and minimums of a block as 8 bytes each (sc_j, m_j in byte j): the 6-bit
 * fields of quant_k.c's get_scale_min, four sub-blocks per 32-bit word. */
static inline void scale_min_k4(const uint8_t *q, uint64_t *sc, uint64_t *m)
{
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    /* j < 4: sc_j = q[j] & 63, m_j = q[j + 4] & 63; j >= 4: the low (sc) or high (m) nibble of
     * q[j + 4] with the top two bits of q[j - 4] (sc) or q[j] (m) above it */
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    *sc = (uint64_t)sc_lo | (uint64_t)sc_hi << 32;
    *m = (uint64_t)m_lo | (uint64_t)m_hi << 32;
}

/* The word permute that puts int16 scale b + k in every word of 128-bit lane k (k < 4). */
#define LANES4(b)                                                                                  \
    _mm512_set_epi16(b + 3, b + 3, b + 3, b + 3, b + 3, b + 3, b + 3, b + 3, b + 2, b + 2, b + 2,  \
                     b + 2, b + 2, b + 2, b + 2, b + 2, b + 1, b + 1, b + 1, b + 1, b + 1, b + 1,  \
                     b + 1, b + 1, b, b, b, b, b, b, b, b)

/* Two 32-byte halves as one 512-bit vector. */
static inline TGT __m512i join(const void *lo, const void *hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* Q4_K: byte l of qs group g holds element 64g + l (low nibble) and 64g + 32 + l (high nibble), in
 * sub-blocks 2g and 2g + 1. The vector of groups 2h, 2h + 1 gives, masked to its low nibbles,
 * sub-blocks 4h and 4h + 2 (one per 256-bit half) and, shifted, sub-blocks 4h + 1 and 4h + 3; the
 * activations of each are two 32-byte runs. Scales are at most 63 and codes 15, so the maddubs
 * pairs (at most 2 * 15 * 128) and the madd products stay exact. */
/* A Q4_K block unpacked once for all the tokens of a tile: codes split into the low and high
 * nibbles of each half, the sub-block scales spread for madd, the minimums as bytes. */
typedef struct q4k_w {
    __m512i lo[2], hi[2], sv_lo[2], sv_hi[2];
    uint64_t m8;
} q4k_w;

INL void prep_q4_k(const sh_block_q4_k *w, q4k_w *p)
{
    const __m512i m4 = _mm512_set1_epi8(0xF);
    uint64_t sc8;
    scale_min_k4(w->scales, &sc8, &p->m8);
    const __m512i scz =
        _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_loadu_si512((const void *)(w->qs + 64 * h));
        p->lo[h] = _mm512_and_si512(v, m4);
        p->hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        /* words 0-15 take scale j, words 16-31 scale j + 2, for j = 4h (low nibbles), 4h + 1 */
        p->sv_lo[h] =
            _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h)),
                                                        _mm256_set1_epi16((short)(4 * h + 2)), 1),
                                     scz);
        p->sv_hi[h] =
            _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h + 1)),
                                                        _mm256_set1_epi16((short)(4 * h + 3)), 1),
                                     scz);
    }
}

INL void dot_q4_k(const q4k_w *p, const sh_block_q8_k *a, int32_t *ints)
{
    const int8_t *aq = a->qs;
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i a_lo = join(aq + 128 * h, aq + 128 * h + 64);
        const __m512i a_hi = join(aq + 128 * h + 32, aq + 128 * h + 96);
        acc = _mm512_add_epi32(
            acc, _mm512_madd_epi16(_mm512_maddubs_epi16(p->lo[h], a_lo), p->sv_lo[h]));
        acc = _mm512_add_epi32(
            acc, _mm512_madd_epi16(_mm512_maddubs_epi16(p->hi[h], a_hi), p->sv_hi[h]));
    }
    /* minimums: sum_j m_j (bsums[2j] + bsums[2j + 1]) */
    const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
    const __m256i pair = _mm256_madd_epi16(bs, _mm256_set1_epi16(1));
    const __m256i mv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)p->m8));
    const __m256i prod = _mm256_mullo_epi32(pair, mv);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(prod), _mm256_extracti128_si256(prod, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    ints[0] = _mm512_reduce_add_epi32(acc);
    ints[1] = _mm_cvtsi128_si32(s4);
}

INL void blk_q4_k(const sh_block_q4_k *w, const sh_block_q8_k *a, int32_t *ints)
{
    q4k_w p;
    prep_q4_k(w, &p);
    dot_q4_k(&p, a, ints);
}

TGT static void ints_q4_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q4_k *w = wv;
    for (int64_t b = 0; b < nb; b++)
        blk_q4_k(w + b, a + b, ints + 2 * b);
}

/* Q6_K: in half h, ql bytes 64h + l (l < 64) hold elements 128h + l (low nibble) and
 * 128h + 64 + l (high); qh byte 32h + l carries the top two bits of elements 128h + l, + 32, + 64
 * and + 96 at bits 0, 2, 4, 6. So with the qh bytes twice (as is, and shifted right by 2, one per
 * 256-bit half) the low nibbles plus bits 0-1 are elements 128h .. 128h + 63 and the high nibbles
 * plus bits 4-5 are elements 128h + 64 .. 128h + 127, each with its activations contiguous. The
 * -32 offset as in the AVX2 kernel: maddubs(q, a) - maddubs(32, a), exact in int16. The 16-element
 * sub-blocks are the 128-bit lanes: scales 8h .. 8h + 3 and 8h + 4 .. 8h + 7. */
/* A Q6_K block unpacked once for a tile: the codes of each half in two vectors and the scales. */
typedef struct q6k_w {
    __m512i qa[2], qb[2], sc[2][2];
} q6k_w;

INL void prep_q6_k(const sh_block_q6_k *w, q6k_w *p)
{
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(3);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const __m512i sc =
        _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)w->scales)));
    p->sc[0][0] = _mm512_permutexvar_epi16(LANES4(0), sc);
    p->sc[0][1] = _mm512_permutexvar_epi16(LANES4(4), sc);
    p->sc[1][0] = _mm512_permutexvar_epi16(LANES4(8), sc);
    p->sc[1][1] = _mm512_permutexvar_epi16(LANES4(12), sc);
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512((const void *)(w->ql + 64 * h));
        const __m256i h32 = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * h));
        const __m512i hh =
            _mm512_inserti64x4(_mm512_castsi256_si512(h32), _mm256_srli_epi16(h32, 2), 1);
        /* 16-bit shifts; the masks drop what crossed from the neighbouring byte */
        p->qa[h] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                   _mm512_slli_epi16(_mm512_and_si512(hh, m3), 4));
        p->qb[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                   _mm512_and_si512(hh, m30));
    }
}

INL void dot_q6_k(const q6k_w *p, const sh_block_q8_k *a, int32_t *ints)
{
    const __m512i c32 = _mm512_set1_epi8(32);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i aa = _mm512_loadu_si512((const void *)(a->qs + 128 * h));
        const __m512i ab = _mm512_loadu_si512((const void *)(a->qs + 128 * h + 64));
        const __m512i pa =
            _mm512_sub_epi16(_mm512_maddubs_epi16(p->qa[h], aa), _mm512_maddubs_epi16(c32, aa));
        const __m512i pb =
            _mm512_sub_epi16(_mm512_maddubs_epi16(p->qb[h], ab), _mm512_maddubs_epi16(c32, ab));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pa, p->sc[h][0]));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pb, p->sc[h][1]));
    }
    ints[0] = _mm512_reduce_add_epi32(acc);
    ints[1] = 0;
}

INL void blk_q6_k(const sh_block_q6_k *w, const sh_block_q8_k *a, int32_t *ints)
{
    q6k_w p;
    prep_q6_k(w, &p);
    dot_q6_k(&p, a, ints);
}

TGT static void ints_q6_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q6_k *w = wv;
    for (int64_t b = 0; b < nb; b++)
        blk_q6_k(w + b, a + b, ints + 2 * b);
}

/* The row kernels keep, per token, running float sums in vector registers across a row's
 * blocks and reduce them once at the row's end (as fast as llama.cpp's, unlike sh__cpu_dot_k's
 * per-block horizontal sums): each block adds da dw * (its 16 int32 lane sums) to one vector and
 * da dm * (its 8 minimum products) to another. The outputs therefore differ from the scalar
 * kernels' in rounding only (the integers are exact; tests/unit/test_kernels_kq.c bounds the
 * difference), and a matvec and a batched token run the same operations, so batched outputs equal
 * unbatched ones bit for bit and no output depends on the thread that computes it. */
/* Tokens per tile of a batched matmul: each unpacked weight block serves this many tokens. */
#define K_TILE 4

/* Q4_K: the scale-weighted integer lanes and the minimum products (m_j (bsums[2j] +
 * bsums[2j + 1]) in lane j) of one block against one token's activations. */
INL void lanes_q4_k(const q4k_w *p, const sh_block_q8_k *a, __m512i *iv, __m256i *mv)
{
    const int8_t *aq = a->qs;
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i a_lo = join(aq + 128 * h, aq + 128 * h + 64);
        const __m512i a_hi = join(aq + 128 * h + 32, aq + 128 * h + 96);
        acc = _mm512_add_epi32(
            acc, _mm512_madd_epi16(_mm512_maddubs_epi16(p->lo[h], a_lo), p->sv_lo[h]));
        acc = _mm512_add_epi32(
            acc, _mm512_madd_epi16(_mm512_maddubs_epi16(p->hi[h], a_hi), p->sv_hi[h]));
    }
    /* m_j in words 2j and 2j + 1: one madd gives m_j (bsums[2j] + bsums[2j + 1]) (the pair
     * sums are at most 4096 in magnitude and the minimums 63, so the words stay exact) */
    const __m128i m8 = _mm_cvtsi64_si128((long long)p->m8);
    const __m256i mw = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    *mv = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), mw);
    *iv = acc;
}

INL __m512i lanes_q6_k(const q6k_w *p, const sh_block_q8_k *a)
{
    const __m512i c32 = _mm512_set1_epi8(32);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i aa = _mm512_loadu_si512((const void *)(a->qs + 128 * h));
        const __m512i ab = _mm512_loadu_si512((const void *)(a->qs + 128 * h + 64));
        const __m512i pa =
            _mm512_sub_epi16(_mm512_maddubs_epi16(p->qa[h], aa), _mm512_maddubs_epi16(c32, aa));
        const __m512i pb =
            _mm512_sub_epi16(_mm512_maddubs_epi16(p->qb[h], ab), _mm512_maddubs_epi16(c32, ab));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pa, p->sc[h][0]));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pb, p->sc[h][1]));
    }
    return acc;
}

/* One token's running sums: the scaled lanes and the scaled minimum products. */
typedef struct kacc {
    __m512 s;
    __m256 m;
} kacc;

/* The block's contribution, the float step every token shares whether matvec or batched. */
INL void add_q4_k(const q4k_w *p, const sh_block_q8_k *a, float dw, float dm, kacc *k)
{
    __m512i iv;
    __m256i mv;
    lanes_q4_k(p, a, &iv, &mv);
    k->s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(a->d * dw), k->s);
    k->m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mv), _mm256_set1_ps(a->d * dm), k->m);
}

INL void add_q6_k(const q6k_w *p, const sh_block_q8_k *a, float dw, kacc *k)
{
    k->s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes_q6_k(p, a)), _mm512_set1_ps(a->d * dw), k->s);
}

/* The row's dot product from its sums, in one fixed order. */
INL float finish(const kacc *k)
{
    const __m256 s8 =
        _mm256_add_ps(_mm512_castps512_ps256(k->s),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(k->s), 1)));
    __m256 d = _mm256_sub_ps(s8, k->m);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

INL void mm_rows(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int q6)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = m->w + (size_t)r * m->row_bytes;
        if (a->n_tok == 1)
            for (size_t o = 0; o < m->row_bytes; o += 64)
                _mm_prefetch((const char *)w + SH_CPU_K_PF_DIST + o, _MM_HINT_T1);
        if (a->n_tok == 1) { /* a matvec: each block's vectors straight from unpack to use */
            const sh_block_q8_k *ab = a->qk;
            kacc k = {_mm512_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = 0; b < nb; b++) {
                if (q6) {
                    const sh_block_q6_k *wb = (const sh_block_q6_k *)w + b;
                    q6k_w p;
                    prep_q6_k(wb, &p);
                    add_q6_k(&p, ab + b, _cvtsh_ss(wb->d), &k);
                } else {
                    const sh_block_q4_k *wb = (const sh_block_q4_k *)w + b;
                    q4k_w p;
                    prep_q4_k(wb, &p);
                    add_q4_k(&p, ab + b, _cvtsh_ss(wb->d), _cvtsh_ss(wb->dmin), &k);
                }
            }
            const float v = finish(&k);
            m->y[r] = m->accumulate ? m->y[r] + v : v;
            continue;
        }
        for (int64_t t0 = 0; t0 < a->n_tok; t0 += K_TILE) {
            const int nt = a->n_tok - t0 < K_TILE ? (int)(a->n_tok - t0) : K_TILE;
            kacc k[K_TILE];
            for (int i = 0; i < K_TILE; i++)
                k[i].s = _mm512_setzero_ps(), k[i].m = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const sh_block_q8_k *ab = a->qk + t0 * nb + b;
                if (q6) {
                    const sh_block_q6_k *wb = (const sh_block_q6_k *)w + b;
                    q6k_w p;
                    prep_q6_k(wb, &p);
                    const float dw = _cvtsh_ss(wb->d);
                    for (int i = 0; i < nt; i++)
                        add_q6_k(&p, ab + i * nb, dw, &k[i]);
                } else {
                    const sh_block_q4_k *wb = (const sh_block_q4_k *)w + b;
                    q4k_w p;
                    prep_q4_k(wb, &p);
                    const float dw = _cvtsh_ss(wb->d), dm = _cvtsh_ss(wb->dmin);
                    for (int i = 0; i < nt; i++)
                        add_q4_k(&p, ab + i * nb, dw, dm, &k[i]);
                }
            }
            for (int i = 0; i < nt; i++) {
                const float v = finish(&k[i]);
                float *y = m->y + (t0 + i) * m->ldy + r;
                *y = m->accumulate ? *y + v : v;
            }
        }
    }
}

TGT void sh__cpu_mm_avx512_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    mm_rows(m, r0, r1, 0);
}

TGT void sh__cpu_mm_avx512_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    mm_rows(m, r0, r1, 1);
}

sh__cpu_k_ints_fn sh__cpu_k_ints_avx512(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_Q4_K:
        return ints_q4_k;
    case SH_DTYPE_Q6_K:
        return ints_q6_k;
    default:
        return NULL;
    }
}

#else
sh__cpu_k_ints_fn sh__cpu_k_ints_avx512(sh_dtype type)
{
    (void)type;
    return NULL;
}

void sh__cpu_mm_avx512_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sh__cpu_mm_k(m, r0, r1, SH_DTYPE_Q4_K,
                 sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, SH_DTYPE_Q4_K));
}

void sh__cpu_mm_avx512_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sh__cpu_mm_k(m, r0, r1, SH_DTYPE_Q6_K,
                 sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, SH_DTYPE_Q6_K));
}
#endif
