/* AVX2 matmul kernel on packed IQ4_XS weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h):
 * a 256-bit register holds 8 of a group's 16 rows (half h is bytes 32h .. 32h + 31 of each 64-byte
 * vector of the super-block). The 4-bit codes are looked up in the grid (vpshufb) once per tile;
 * per token, Q8_0's sign trick (vpmaddubsw of |g| against a * sign(g), a pair sum at most
 * 2 * 127 * 127, so two would not fit int16) and a vpmaddwd with the sub-block's scale that widens
 * every step. Prefill tiles of NT tokens and a decode matvec that walks several row groups side by
 * side with software prefetch, as ops_q4k_avx2_packed.c. */
#include <string.h>

#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per tile: one int32 accumulator per token beside a code vector's nibbles, their grid
 * values and absolute values, the grid, the mask, the scale pair and the broadcast, within the 16
 * YMM registers (the float accumulators are touched once per super-block). Per token and 32-byte
 * step the tile runs a broadcast, vpsignb, vpmaddubsw, vpmaddwd and vpaddd; the lookup (a shift,
 * an and, vpshufb, vpabsb) and the scales are shared by the tile. callgrind, 2048 x 2048 weight,
 * 56 tokens: 47.0M instructions with 5 tokens, 45.5M with 6, 44.1M with 7, 44.8M with 8 (one
 * accumulator spilled). */
#ifndef NT
#define NT 7
#endif
_Static_assert(NT >= 1 && NT <= 8, "tiles of up to 8 tokens (the accumulator arrays, the tail)");
/* The decode matvec: Q4_K's settings (ops_q4k_avx2_packed.c), MV_STREAMS groups side by side,
 * each line prefetched MV_PF_DIST bytes ahead into L2. */
#define MV_STREAMS 2
#define MV_PF_DIST 8192
/* Activation bytes of a token block: its Q8_K rows stay in L2 while every row group passes. */
#define TOK_BLOCK_BYTES (1 << 20)

INL __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The IQ4 grid (SH_IQ4_VALUES) in both 128-bit lanes, for a vpshufb lookup of 4-bit codes. */
INL __m256i iq4_grid(void)
{
    const __m128i g = _mm_loadu_si128((const void *)SH_IQ4_VALUES);
    return _mm256_set_m128i(g, g);
}

/* The 8 rows' scales of sub-block j (ls_j - 32, in [-32, 31]) as int16 pairs (s, s) per 32-bit
 * lane, for vpmaddwd: sl holds each row's scales_l (lane r), sh its scales_h (zero-extended). */
INL __m256i sub_scale(__m256i sl, __m256i sh, const int j)
{
    const __m256i lo =
        _mm256_and_si256(_mm256_srli_epi32(sl, 8 * (j / 2) + 4 * (j % 2)), _mm256_set1_epi32(15));
    const __m256i hi =
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * j), _mm256_set1_epi32(3)), 4);
    const __m256i s = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xffff)),
                           _mm256_slli_epi32(s, 16));
}

/* One super-block (at pb) of half h against tokens ab[0 .. nt - 1] (their Q8_K blocks), added to
 * acc[i]. Per row and token (g the grid values of the codes, a the Q8_K codes with scale da):
 *   isum = sum_j (ls_j - 32) sum_{i in j} g_i a_i    (int32, exact)
 *   acc += float(isum) * (d da).
 * A step's vpmaddwd lane is at most 2 * 2 * 127 * 127 * 32 in magnitude, |isum| <= 256 * 127 *
 * 127 * 32 < 2^28. The float step is the same for a token alone and in any tile, and the integers
 * are exact in any order, so a token's output does not depend on its tile, the row split or the
 * matvec. With pf set (the matvec, half 0) each line of the super-block is prefetched MV_PF_DIST
 * bytes ahead as it is read. */
INL void sb_half(const uint8_t *pb, const int h, const sh_block_q8_k *const *ab, const int nt,
                 __m256 *acc, const int pf)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i grid = iq4_grid();
    const __m256i sl = _mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_IQ4XS_SL + 32 * h));
    const __m256i sh =
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_SH + 16 * h)));
    if (pf) {
        _mm_prefetch((const char *)pb + MV_PF_DIST, _MM_HINT_T1);
        _mm_prefetch((const char *)pb + 64 + MV_PF_DIST, _MM_HINT_T1);
    }
    __m256i ia[NT];
    for (int i = 0; i < nt; i++)
        ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i sc = sub_scale(sl, sh, j);
        const uint8_t *pv = pb + SH_CPU_PACK_IQ4XS_CODES + 256 * j + 32 * h;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            if (pf)
                _mm_prefetch((const char *)pv + 64 * k + MV_PF_DIST, _MM_HINT_T1);
            const __m256i x = _mm256_loadu_si256((const void *)(pv + 64 * k));
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m256i n = _mm256_and_si256(half ? _mm256_srli_epi16(x, 4) : x, m4);
                const __m256i q = _mm256_shuffle_epi8(grid, n);
                const __m256i aq = _mm256_abs_epi8(q);
                for (int i = 0; i < nt; i++) {
                    const __m256i a = bcast4(ab[i]->qs + 32 * j + 16 * half + 4 * k);
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(a, q));
                    SH_AVX2_ADD32(ia[i], _mm256_madd_epi16(p, sc));
                }
            }
        }
    }
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_D + 16 * h)));
    for (int i = 0; i < nt; i++)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]),
                                 _mm256_mul_ps(d, _mm256_set1_ps(ab[i]->d)), acc[i]);
}

/* Rows of group g, half h, against tokens t0 .. t0 + nt - 1, super-block by super-block. */
INL void tile_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t0,
                   const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    __m256 acc[NT];
    const sh_block_q8_k *ab[NT];
    for (int i = 0; i < nt; i++) {
        acc[i] = _mm256_setzero_ps();
        ab[i] = a->qk + (t0 + i) * nb;
    }
    for (int64_t b = 0; b < nb; b++) {
        sb_half(w + (size_t)b * SH_CPU_PACK_IQ4XS_BYTES, h, ab, nt, acc, 0);
        for (int i = 0; i < nt; i++)
            ab[i]++;
    }
    for (int i = 0; i < nt; i++)
        sh__avx2_store_half(m, g, h, r0, r1, t0 + i, acc[i]);
}

/* One token, groups g0 + k step (k < ns) side by side, super-block by super-block, both halves;
 * each (row, token) sees tile_half's operations in tile_half's order. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    __m256 acc[MV_STREAMS][2];
    for (int k = 0; k < ns; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        for (int k = 0; k < ns; k++) {
            const uint8_t *pb =
                m->w + (size_t)(g0 + k * step) * m->row_bytes + (size_t)b * SH_CPU_PACK_IQ4XS_BYTES;
            sb_half(pb, 0, &ab, 1, &acc[k][0], 1);
            sb_half(pb, 1, &ab, 1, &acc[k][1], 0);
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

/* A matvec as above; otherwise token blocks outermost (their Q8_K rows stay in L2), then row
 * groups and halves, then token tiles (a group's packed super-blocks, nb * 2176 bytes, stay in
 * L1/L2 while the block's tiles pass over them). */
TGT void sh__cpu_avx2_mmp_iq4_xs(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1);
        return;
    }
    SH_AVX2_TILE_SWEEP(tile_half, NT, TOK_BLOCK_BYTES,
                       m->a->n_in / SH_QK_K * (int64_t)sizeof(sh_block_q8_k), m, r0, r1);
}

#else
typedef int sh__cpu_iq4xs_avx2_packed_unused; /* not x86-64: the table never names the kernel */
#endif
