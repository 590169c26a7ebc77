/* AVX2 matmul kernels on packed Q4_0 and Q4_1 weights (the 16-row interleave of SH_CPU_PACK_ROWS
 * in cpu.h, the one copy the AVX-512 kernels read): a 256-bit register holds 8 of a group's 16
 * rows (half h is bytes 32h .. 32h + 31 of each 64-byte code vector), so the dot products of 8
 * rows against a broadcast 4-byte slice of the activation need no horizontal sums, and one
 * unpacked block serves a tile of tokens. For CPUs without AVX-512 (AMD Zen 2/3, Intel client
 * parts): there is no dpbusd, so vpmaddubsw makes 16-bit pair sums and a vpmaddwd with ones
 * widens them once per block. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per tile: the 8 unpacked code registers, one accumulator per token and the temporaries
 * fit the 16 YMM registers. */
#define NT 3
/* The decode matvec walks MV_STREAMS row groups side by side with software prefetch MV_PF_DIST
 * bytes ahead (several independent runs keep more reads in flight than one; see
 * ops_avx512_packed.c). */
#define MV_STREAMS 4
#define MV_PF_DIST 1024
/* Activation bytes of a token block: its codes stay in L2 while every row group passes. */
#define TOK_BLOCK_BYTES (1 << 20)

enum { K_Q4_0, K_Q4_1 };

INL __m256i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Half h of block b of a packed Q4 group w: q[k] holds, lane r, the codes of row 8h + r that pair
 * with activation bytes 4k .. 4k + 3 of the block (low nibbles are elements 4j + i, high ones
 * 16 + 4j + i, cpu.h). */
INL void unpack_half(const uint8_t *w, int64_t b, int h, __m256i q[8])
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const uint8_t *wb = w + (size_t)b * 256 + 32 * h;
    for (int j = 0; j < 4; j++) {
        const __m256i z = _mm256_loadu_si256((const void *)(wb + 64 * j));
        q[j] = _mm256_and_si256(z, low4);
        q[4 + j] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low4);
    }
}

/* sum_i q_i a_i over the block for the 8 rows, as floats. The 16-bit pair sums of nibbles
 * (at most 2 * 15 * 127) add four to a chain without saturating. The same instructions for a
 * token alone and inside any tile, so its result does not depend on the path. */
INL __m256 dot_half(const int8_t *ab, const __m256i q[8])
{
    __m256i s0 = _mm256_maddubs_epi16(q[0], bcast4(ab));
    __m256i s1 = _mm256_maddubs_epi16(q[1], bcast4(ab + 4));
    for (int k = 2; k < 8; k += 2) {
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(q[k], bcast4(ab + 4 * k)));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(q[k + 1], bcast4(ab + 4 * k + 4)));
    }
    const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(s);
}

/* The 8 rows' fp16 factors of block b, half h: d (at the group's scales) or Q4_1's minimums. */
INL __m256 half_f16(const uint8_t *p, int64_t b, int h)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p + b * 32 + 16 * h)));
}

/* Stores acc + c acco for token t, rows 16g + 8h + r inside [r0, r1). */
INL void store_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t,
                    const int kind, __m256 acc, __m256 acco)
{
    const float c = kind == K_Q4_0 ? -8.0f : 1.0f;
    const int64_t base = 16 * g + 8 * h;
    int32_t lanes[8];
    for (int r = 0; r < 8; r++)
        lanes[r] = base + r >= r0 && base + r < r1 ? -1 : 0;
    const __m256i k = _mm256_loadu_si256((const void *)lanes);
    float *y = m->y + t * m->ldy + base;
    __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(c), acco, acc);
    if (m->accumulate)
        v = _mm256_add_ps(v, _mm256_maskload_ps(y, k));
    _mm256_maskstore_ps(y, k, v);
}

/* Rows of group g, half h, against tokens t0 .. t0 + nt - 1. Per block b, token t (da, s: the
 * activation block's scale and scaled sum, sh__cpu_act):
 *   Q4_0: dw (da sum_i q_i a_i - 8 s)      Q4_1: dw da sum_i q_i a_i + m s,
 * i.e. acc = sum_b (dw da) dot_b and acco = sum_b v s_b with v = dw or m, out = acc + c acco.
 * acco is summed in its own pass (the registers hold the codes and one accumulator per token),
 * in block order, as the matvec sums it. */
INL void tile_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t0,
                   const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * 256, *wv = kind == K_Q4_1 ? wd + (size_t)nb * 32 : wd;
    __m256 acc[NT], acco[NT];
    for (int i = 0; i < nt; i++)
        acc[i] = acco[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i q[8];
        unpack_half(w, b, h, q);
        const __m256 dw = half_f16(wd, b, h);
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            const __m256 f = dot_half(a->qs + t * a->n_in + b * SH_CPU_QK, q);
            acc[i] =
                _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a->d[t * nb + b])), acc[i]);
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        const __m256 v = half_f16(wv, b, h);
        for (int i = 0; i < nt; i++)
            acco[i] = _mm256_fmadd_ps(v, _mm256_set1_ps(a->s[(t0 + i) * nb + b]), acco[i]);
    }
    for (int i = 0; i < nt; i++)
        store_half(m, g, h, r0, r1, t0 + i, kind, acc[i], acco[i]);
}

/* One token, groups g0 + k step (k < ns) side by side, block by block, both halves; each
 * (row, token) sees tile_half's operations in tile_half's order. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    __m256 acc[MV_STREAMS][2], acco[MV_STREAMS][2];
    for (int k = 0; k < ns; k++)
        acc[k][0] = acc[k][1] = acco[k][0] = acco[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *ab = a->qs + b * SH_CPU_QK;
        const __m256 da = _mm256_set1_ps(a->d[b]), sa = _mm256_set1_ps(a->s[b]);
        for (int k = 0; k < ns; k++) {
            const uint8_t *w = m->w + (size_t)(g0 + k * step) * m->row_bytes;
            const uint8_t *wd = w + (size_t)nb * 256;
            const uint8_t *wv = kind == K_Q4_1 ? wd + (size_t)nb * 32 : wd;
            for (size_t o = 0; o < 256; o += 64)
                _mm_prefetch((const char *)(w + (size_t)b * 256) + MV_PF_DIST + o, _MM_HINT_T0);
            if (b % 2 == 0) {
                _mm_prefetch((const char *)(wd + b * 32) + MV_PF_DIST / 8, _MM_HINT_T0);
                if (kind == K_Q4_1)
                    _mm_prefetch((const char *)(wv + b * 32) + MV_PF_DIST / 8, _MM_HINT_T0);
            }
            for (int h = 0; h < 2; h++) {
                __m256i q[8];
                unpack_half(w, b, h, q);
                const __m256 f = dot_half(ab, q);
                acc[k][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(half_f16(wd, b, h), da), acc[k][h]);
                acco[k][h] = _mm256_fmadd_ps(half_f16(wv, b, h), sa, acco[k][h]);
            }
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            store_half(m, g0 + k * step, h, r0, r1, 0, kind, acc[k][h], acco[k][h]);
}

INL void matvec(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int64_t g0 = r0 / 16, g1 = (r1 + 15) / 16, part = (g1 - g0) / MV_STREAMS;
    for (int64_t i = 0; i < part; i++)
        mv_groups(m, g0 + i, part, MV_STREAMS, r0, r1, kind);
    for (int64_t g = g0 + MV_STREAMS * part; g < g1; g++)
        mv_groups(m, g, 0, 1, r0, r1, kind);
}

/* Token blocks outermost (their codes stay in L2), then row groups and halves, then token tiles
 * (a half's packed blocks stay in L1/L2 while the block's tiles pass over them). */
INL void sweep(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        matvec(m, r0, r1, kind);
        return;
    }
    int64_t tb = TOK_BLOCK_BYTES / m->a->n_in / NT * NT;
    tb = tb < NT ? NT : tb;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++)
            for (int h = 0; h < 2; h++) {
                if (16 * g + 8 * h >= r1 || 16 * g + 8 * h + 8 <= r0)
                    continue;
                int64_t t = t0;
                for (; t + NT <= t1; t += NT)
                    tile_half(m, g, h, r0, r1, t, NT, kind);
                if (t1 - t == 2)
                    tile_half(m, g, h, r0, r1, t, 2, kind);
                else if (t1 - t == 1)
                    tile_half(m, g, h, r0, r1, t, 1, kind);
            }
    }
}

TGT void sh__cpu_avx2_mmp_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q4_0);
}

TGT void sh__cpu_avx2_mmp_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q4_1);
}

#endif
