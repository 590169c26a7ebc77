/* AVX2 matmul kernels on packed Q4_0, Q4_1, Q8_0 and IQ4_NL weights (F16's: ops_f16_avx2_packed.c;
 * the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h, the one copy the AVX-512 kernels read): a
 * 256-bit register holds 8 of a group's 16 rows (half h is bytes 32h .. 32h + 31 of each 64-byte
 * code vector), so the dot products of 8 rows against a broadcast 4-byte slice of the activation
 * need no horizontal sums, and one unpacked block serves a tile of tokens. For CPUs without AVX-512
 * (AMD Zen 2/3, Intel client parts): there is no dpbusd, so vpmaddubsw makes 16-bit pair sums and a
 * vpmaddwd with ones widens them (Q4: once per block; Q8_0 and IQ4_NL, whose signed codes need the
 * sign trick: every step). */
#include <string.h>

#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per tile. A one-half tile holds per token an int16 block sum and a float accumulator in
 * registers, beside one code vector's two nibble registers, the constants and the temporaries. A
 * two-half tile holds the two halves' int16 sums and four nibble registers; its float accumulators
 * live in L1 (one load and one store per block; 4 measured 2-4% faster than 3 and 13-18% faster
 * than the one-half tile, which shares no broadcast between the halves). */
#define NT 4
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
    sh__avx2_store_half(m, g, h, r0, r1, t, _mm256_fmadd_ps(_mm256_set1_ps(c), acco, acc));
}

/* Rows of group g, half h, against tokens t0 .. t0 + nt - 1. Per block b, token t (da, s: the
 * activation block's scale and scaled sum, sh__cpu_act):
 *   Q4_0: dw (da sum_i q_i a_i - 8 s)      Q4_1: dw da sum_i q_i a_i + m s,
 * i.e. acc = sum_b (dw da) dot_b and acco = sum_b v s_b with v = dw or m, out = acc + c acco.
 * Inside a block the code vectors are outermost: vector j (its low nibbles pair with activation
 * bytes 4j .. 4j + 3, its high ones with 16 + 4j ..) is unpacked once and applied to every token,
 * each token keeping one int16 sum of its 8 pair-sum vectors (at most 8 * 2 * 15 * 127 = 30480 in
 * magnitude, so exact in any order: dot_half's value). Only two code registers are live, so the
 * tile holds NT tokens. The float steps are dot_half's callers': f = cvt(madd(s, 1)), then acc
 * in block order; acco is summed in its own pass, in block order, as the matvec sums it. */
INL void tile_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t0,
                   const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * 256, *wv = kind == K_Q4_1 ? wd + (size_t)nb * 32 : wd;
    const int8_t *qa = a->qs + t0 * a->n_in;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[NT], acco[NT];
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        acc[i] = acco[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 256 + 32 * h;
        const int8_t *ab = qa + b * SH_CPU_QK;
        __m256i s[NT];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i z = _mm256_loadu_si256((const void *)(wb + 64 * j));
            const __m256i lo = _mm256_and_si256(z, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), low4);
#pragma GCC unroll 16
            for (int i = 0; i < nt; i++) {
                const int8_t *ai = ab + i * a->n_in;
                __m256i p = _mm256_maddubs_epi16(lo, bcast4(ai + 4 * j));
                SH_AVX2_ADD16(p, _mm256_maddubs_epi16(hi, bcast4(ai + 16 + 4 * j)));
                if (j == 0)
                    s[i] = p;
                else
                    SH_AVX2_ADD16(s[i], p);
            }
        }
        const __m256 dw = half_f16(wd, b, h);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[i], ones));
            acc[i] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a->d[(t0 + i) * nb + b])),
                                     acc[i]);
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        const __m256 v = half_f16(wv, b, h);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++)
            acco[i] = _mm256_fmadd_ps(v, _mm256_set1_ps(a->s[(t0 + i) * nb + b]), acco[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        store_half(m, g, h, r0, r1, t0 + i, kind, acc[i], acco[i]);
}

/* Both halves of group g against tokens t0 .. t0 + nt - 1: tile_half's steps for each half, with
 * each broadcast activation slice serving both halves' nibbles (half the broadcasts of two
 * tile_half calls). Every (row, token) sees tile_half's operations in tile_half's order. */
INL void tile_group(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0,
                    const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * 256, *wv = kind == K_Q4_1 ? wd + (size_t)nb * 32 : wd;
    const int8_t *qa = a->qs + t0 * a->n_in;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[2][NT], acco[2][NT];
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        acc[0][i] = acc[1][i] = acco[0][i] = acco[1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 256;
        const int8_t *ab = qa + b * SH_CPU_QK;
        __m256i s0[NT], s1[NT];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i z0 = _mm256_loadu_si256((const void *)(wb + 64 * j));
            const __m256i z1 = _mm256_loadu_si256((const void *)(wb + 64 * j + 32));
            const __m256i lo0 = _mm256_and_si256(z0, low4);
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(z0, 4), low4);
            const __m256i lo1 = _mm256_and_si256(z1, low4);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(z1, 4), low4);
#pragma GCC unroll 16
            for (int i = 0; i < nt; i++) {
                const int8_t *ai = ab + i * a->n_in;
                const __m256i x0 = bcast4(ai + 4 * j), x1 = bcast4(ai + 16 + 4 * j);
                __m256i p0 = _mm256_maddubs_epi16(lo0, x0);
                __m256i p1 = _mm256_maddubs_epi16(lo1, x0);
                SH_AVX2_ADD16(p0, _mm256_maddubs_epi16(hi0, x1));
                SH_AVX2_ADD16(p1, _mm256_maddubs_epi16(hi1, x1));
                if (j == 0) {
                    s0[i] = p0;
                    s1[i] = p1;
                } else {
                    SH_AVX2_ADD16(s0[i], p0);
                    SH_AVX2_ADD16(s1[i], p1);
                }
            }
        }
        const __m256 dw0 = half_f16(wd, b, 0), dw1 = half_f16(wd, b, 1);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++) {
            const __m256 da = _mm256_set1_ps(a->d[(t0 + i) * nb + b]);
            acc[0][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[i], ones)),
                                        _mm256_mul_ps(dw0, da), acc[0][i]);
            acc[1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[i], ones)),
                                        _mm256_mul_ps(dw1, da), acc[1][i]);
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        const __m256 v0 = half_f16(wv, b, 0), v1 = half_f16(wv, b, 1);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++) {
            const __m256 sa = _mm256_set1_ps(a->s[(t0 + i) * nb + b]);
            acco[0][i] = _mm256_fmadd_ps(v0, sa, acco[0][i]);
            acco[1][i] = _mm256_fmadd_ps(v1, sa, acco[1][i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        for (int h = 0; h < 2; h++)
            store_half(m, g, h, r0, r1, t0 + i, kind, acc[h][i], acco[h][i]);
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
    SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1, kind);
}

/* A few tokens (2 .. FEW_MAX: a speculative verify step of up to 16 drafts, a small decode
 * batch): the matvec's walk (MV_STREAMS streams side by side, software prefetch) with each
 * unpacked half-block applied to every token, so the weights stream once at the matvec's pace
 * (the tiles read one group at a time without prefetch). Each (row, token) sees tile_half's
 * operations in its order; the accumulators that do not fit the registers live in L1
 * (test_kernels_packed: few_tokens). */
#define FEW_MAX 17

INL void few_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                    int64_t r1, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    __m256 acc[MV_STREAMS][2][FEW_MAX], acco[MV_STREAMS][2][FEW_MAX];
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < nt; i++)
            acc[k][0][i] = acc[k][1][i] = acco[k][0][i] = acco[k][1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 4
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
                const __m256 dw = half_f16(wd, b, h), v = half_f16(wv, b, h);
                for (int i = 0; i < nt; i++) {
                    const __m256 f = dot_half(a->qs + i * a->n_in + b * SH_CPU_QK, q);
                    acc[k][h][i] = _mm256_fmadd_ps(
                        f, _mm256_mul_ps(dw, _mm256_set1_ps(a->d[i * nb + b])), acc[k][h][i]);
                    acco[k][h][i] =
                        _mm256_fmadd_ps(v, _mm256_set1_ps(a->s[i * nb + b]), acco[k][h][i]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < nt; i++)
                store_half(m, g0 + k * step, h, r0, r1, i, kind, acc[k][h][i], acco[k][h][i]);
}

/* With n_tok in 2 .. FEW_MAX: mv (few_groups or few8_groups) over all the tokens (nt a
 * run-time count: one instance per kind, so that builds with sanitizers compile it in
 * reasonable time), then returns from the caller; otherwise does nothing. */
#define FEW_TOK(mv, m, r0, r1, kind)                                                               \
    do {                                                                                           \
        const int nt_ = (int)(m)->a->n_tok;                                                        \
        if (nt_ >= 2 && nt_ <= FEW_MAX) {                                                          \
            SH_AVX2_MATVEC(mv, MV_STREAMS, m, r0, r1, nt_, kind);                                  \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* The tail of a token run: one tile of n_left < nt tokens (nt <= 6) as a compile-time size,
 * tile(..., n, kind) with the caller's kind. */
#define TAIL_TILE(tile, nt, n_left, ...)                                                           \
    do {                                                                                           \
        switch (n_left) {                                                                          \
        case 1:                                                                                    \
            tile(__VA_ARGS__, 1, kind);                                                            \
            break;                                                                                 \
        case 2:                                                                                    \
            tile(__VA_ARGS__, 2 < (nt) ? 2 : 1, kind);                                             \
            break;                                                                                 \
        case 3:                                                                                    \
            tile(__VA_ARGS__, 3 < (nt) ? 3 : 1, kind);                                             \
            break;                                                                                 \
        case 4:                                                                                    \
            tile(__VA_ARGS__, 4 < (nt) ? 4 : 1, kind);                                             \
            break;                                                                                 \
        case 5:                                                                                    \
            tile(__VA_ARGS__, 5 < (nt) ? 5 : 1, kind);                                             \
            break;                                                                                 \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
    } while (0)

/* Token blocks outermost (their codes stay in L2), then row groups, then token tiles (a group's
 * packed blocks stay in L1/L2 while the block's tiles pass over them). A group whose two halves
 * both hold rows of [r0, r1) goes through tile_group; a group at an edge of the range, through
 * tile_half for its one half inside. */
INL void sweep(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        matvec(m, r0, r1, kind);
        return;
    }
    FEW_TOK(few_groups, m, r0, r1, kind);
    int64_t tb = TOK_BLOCK_BYTES / m->a->n_in / NT * NT;
    tb = tb < NT ? NT : tb;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            if (16 * g + 8 > r0 && 16 * g + 8 < r1) {
                int64_t t = t0;
                for (; t + NT <= t1; t += NT)
                    tile_group(m, g, r0, r1, t, NT, kind);
                TAIL_TILE(tile_group, NT, t1 - t, m, g, r0, r1, t);
                continue;
            }
            const int h = 16 * g + 8 <= r0;
            if (h && 16 * g + 8 >= r1)
                continue;
            int64_t t = t0;
            for (; t + NT <= t1; t += NT)
                tile_half(m, g, h, r0, r1, t, NT, kind);
            TAIL_TILE(tile_half, NT, t1 - t, m, g, h, r0, r1, t);
        }
    }
}

/* ---- Q8_0 ---- */

/* Tokens per Q8_0 tile: one int32 accumulator per token beside a step's two code registers, the
 * broadcast and the temporaries (the float accumulators live across the block, spilled once per
 * block). 6 measured at least as fast as 4, 5, 7 and 8 (within this VM's noise).
 * The other exact form, the nibble split of the stored q + 128 (u = 16 hi + lo: two vpmaddubsw
 * chains that may add in int16, and the -128 s correction of the AVX-512 kernel), needs 16
 * code registers per block and a float correction; measured no faster, so not kept. */
#define NT8 6
/* Tokens per two-half Q8_0 / IQ4_NL tile (tile8_group): two int32 sums per token beside both
 * halves' codes; measured 5-11% faster than tile8_half's NT8 = 6 (3 and 5 no faster than 4). */
#define NT8G 4

/* sum_i q_i a_i of 8 rows (lanes) over one block, exact. The codes q are signed and AVX2 has no
 * dpbusd, so vpmaddubsw gets |q| as its unsigned operand and a * sign(q) as its signed one
 * (|a| <= 127, sh__cpu_quant_act_ref; |q| <= 128): a pair sum is at most 2 * 128 * 127 = 32512,
 * which fits int16 but two do not, so every step widens with vpmaddwd. One step: the 4-byte
 * slice 4k .. 4k + 3 of the block against the rows' codes w (signed) and aw = |w|. */
INL __m256i q8_step(const int8_t *ab, int k, __m256i w, __m256i aw)
{
    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(ab + 4 * k), w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

enum { K_Q8_0, K_IQ4_NL };

/* Code bytes per packed block: Q8_0's 8 vectors of 64, IQ4_NL's 4 (Q4_0's nibbles). */
#define CODE_BYTES(kind) ((kind) == K_Q8_0 ? 512 : 256)

/* The IQ4 grid (SH_IQ4_VALUES) in both 128-bit lanes, for a vpshufb lookup of 4-bit codes. */
INL __m256i iq4_grid(void)
{
    const __m128i g = _mm_loadu_si128((const void *)SH_IQ4_VALUES);
    return _mm256_set_m128i(g, g);
}

/* Step k of half h of block b of a packed Q8_0 or IQ4_NL group: the signed codes and their
 * absolute values. Q8_0 stores q + 128; IQ4_NL stores Q4_0's nibbles (step k < 4 the low ones
 * of vector k, else the high ones of vector k - 4), looked up in the grid (vpshufb; |grid| <= 127).
 */
INL void q8_codes(const uint8_t *w, int64_t b, int h, int k, const int kind, __m256i *q,
                  __m256i *aq)
{
    if (kind == K_Q8_0) {
        const __m256i z = _mm256_loadu_si256((const void *)(w + (size_t)b * 512 + 64 * k + 32 * h));
        *q = _mm256_xor_si256(z, _mm256_set1_epi8((char)0x80));
        *aq = _mm256_sign_epi8(*q, *q);
        return;
    }
    const __m256i z =
        _mm256_loadu_si256((const void *)(w + (size_t)b * 256 + 64 * (k % 4) + 32 * h));
    const __m256i n = _mm256_and_si256(k < 4 ? z : _mm256_srli_epi16(z, 4), _mm256_set1_epi8(0x0f));
    *q = _mm256_shuffle_epi8(iq4_grid(), n);
    *aq = _mm256_abs_epi8(*q);
}

/* Rows of group g, half h, against tokens t0 .. t0 + nt - 1: acc = sum_b (dw da) dot_b in block
 * order, dot_b the exact integer sum of the block. Steps outermost inside a block, so that only
 * one step's codes are live and the tile can hold NT8 tokens; the integer sum of a token is the
 * same whatever the order of its exact int32 additions. */
INL void tile8_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t0,
                    const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * CODE_BYTES(kind);
    const int8_t *qa = a->qs + t0 * a->n_in;
    __m256 acc[NT8];
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[NT8], q, aq;
        q8_codes(w, b, h, 0, kind, &q, &aq);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++)
            s[i] = q8_step(qa + i * a->n_in + b * SH_CPU_QK, 0, q, aq);
#pragma GCC unroll 8
        for (int k = 1; k < 8; k++) {
            q8_codes(w, b, h, k, kind, &q, &aq);
#pragma GCC unroll 16
            for (int i = 0; i < nt; i++)
                SH_AVX2_ADD32(s[i], q8_step(qa + i * a->n_in + b * SH_CPU_QK, k, q, aq));
        }
        const __m256 dw = half_f16(wd, b, h);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++)
            acc[i] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),
                                _mm256_mul_ps(dw, _mm256_set1_ps(a->d[(t0 + i) * nb + b])), acc[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        sh__avx2_store_half(m, g, h, r0, r1, t0 + i, acc[i]);
}

/* Both halves of group g against tokens t0 .. t0 + nt - 1: tile8_half's steps for each half, with
 * each step's broadcast activation slice serving both halves' codes. Every (row, token) sees
 * tile8_half's operations in its order (its int32 sum exact in any order). */
INL void tile8_group(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0,
                     const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * CODE_BYTES(kind);
    const int8_t *qa = a->qs + t0 * a->n_in;
    __m256 acc[2][NT8G];
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s0[NT8G], s1[NT8G];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m256i q0, aq0, q1, aq1;
            q8_codes(w, b, 0, k, kind, &q0, &aq0);
            q8_codes(w, b, 1, k, kind, &q1, &aq1);
#pragma GCC unroll 16
            for (int i = 0; i < nt; i++) {
                const int8_t *ab = qa + i * a->n_in + b * SH_CPU_QK;
                const __m256i p0 = q8_step(ab, k, q0, aq0), p1 = q8_step(ab, k, q1, aq1);
                if (k == 0) {
                    s0[i] = p0;
                    s1[i] = p1;
                } else {
                    SH_AVX2_ADD32(s0[i], p0);
                    SH_AVX2_ADD32(s1[i], p1);
                }
            }
        }
        const __m256 dw0 = half_f16(wd, b, 0), dw1 = half_f16(wd, b, 1);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++) {
            const __m256 da = _mm256_set1_ps(a->d[(t0 + i) * nb + b]);
            acc[0][i] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[i]), _mm256_mul_ps(dw0, da), acc[0][i]);
            acc[1][i] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[i]), _mm256_mul_ps(dw1, da), acc[1][i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g, h, r0, r1, t0 + i, acc[h][i]);
}

/* One token, groups g0 + k step (k < ns) side by side, block by block, both halves; each
 * (row, token) sees tile8_half's operations on the same values in the same order. */
INL void mv8_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                    int64_t r1, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    __m256 acc[MV_STREAMS][2];
    for (int k = 0; k < ns; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *ab = a->qs + b * SH_CPU_QK;
        const __m256 da = _mm256_set1_ps(a->d[b]);
        for (int k = 0; k < ns; k++) {
            const uint8_t *w = m->w + (size_t)(g0 + k * step) * m->row_bytes;
            const size_t cb = CODE_BYTES(kind);
            const uint8_t *wd = w + (size_t)nb * cb;
            /* as far ahead in blocks as the Q4 matvec (a Q8_0 block is twice the bytes) */
            for (size_t o = 0; o < cb; o += 64)
                _mm_prefetch((const char *)(w + (size_t)b * cb) + cb / 256 * MV_PF_DIST + o,
                             _MM_HINT_T0);
            if (b % 2 == 0)
                _mm_prefetch((const char *)(wd + b * 32) + MV_PF_DIST / 8, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m256i q, aq;
                q8_codes(w, b, h, 0, kind, &q, &aq);
                __m256i s = q8_step(ab, 0, q, aq);
                for (int j = 1; j < 8; j++) {
                    q8_codes(w, b, h, j, kind, &q, &aq);
                    s = _mm256_add_epi32(s, q8_step(ab, j, q, aq));
                }
                acc[k][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                            _mm256_mul_ps(half_f16(wd, b, h), da), acc[k][h]);
            }
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

/* A few tokens through Q8_0 or IQ4_NL (see few_groups): each step's codes applied to every
 * token, the exact int32 block sums then tile8_half's float steps in its order. */
INL void few8_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                     int64_t r1, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    __m256 acc[MV_STREAMS][2][FEW_MAX];
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < nt; i++)
            acc[k][0][i] = acc[k][1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 4
        for (int k = 0; k < ns; k++) {
            const uint8_t *w = m->w + (size_t)(g0 + k * step) * m->row_bytes;
            const size_t cb = CODE_BYTES(kind);
            const uint8_t *wd = w + (size_t)nb * cb;
            for (size_t o = 0; o < cb; o += 64)
                _mm_prefetch((const char *)(w + (size_t)b * cb) + cb / 256 * MV_PF_DIST + o,
                             _MM_HINT_T0);
            if (b % 2 == 0)
                _mm_prefetch((const char *)(wd + b * 32) + MV_PF_DIST / 8, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m256i s[FEW_MAX], q, aq;
                q8_codes(w, b, h, 0, kind, &q, &aq);
                for (int i = 0; i < nt; i++)
                    s[i] = q8_step(a->qs + i * a->n_in + b * SH_CPU_QK, 0, q, aq);
#pragma GCC unroll 8
                for (int j = 1; j < 8; j++) {
                    q8_codes(w, b, h, j, kind, &q, &aq);
                    for (int i = 0; i < nt; i++)
                        SH_AVX2_ADD32(s[i], q8_step(a->qs + i * a->n_in + b * SH_CPU_QK, j, q, aq));
                }
                const __m256 dw = half_f16(wd, b, h);
                for (int i = 0; i < nt; i++)
                    acc[k][h][i] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(s[i]),
                        _mm256_mul_ps(dw, _mm256_set1_ps(a->d[i * nb + b])), acc[k][h][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < nt; i++)
                sh__avx2_store_half(m, g0 + k * step, h, r0, r1, i, acc[k][h][i]);
}

INL void sweep8(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        SH_AVX2_MATVEC(mv8_groups, MV_STREAMS, m, r0, r1, kind);
        return;
    }
    FEW_TOK(few8_groups, m, r0, r1, kind);
    int64_t tb = TOK_BLOCK_BYTES / m->a->n_in / NT8 * NT8;
    tb = tb < NT8 ? NT8 : tb;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            /* as sweep: both halves inside [r0, r1) or one */
            if (16 * g + 8 > r0 && 16 * g + 8 < r1) {
                int64_t t = t0;
                for (; t + NT8G <= t1; t += NT8G)
                    tile8_group(m, g, r0, r1, t, NT8G, kind);
                TAIL_TILE(tile8_group, NT8G, t1 - t, m, g, r0, r1, t);
                continue;
            }
            const int h = 16 * g + 8 <= r0;
            if (h && 16 * g + 8 >= r1)
                continue;
            int64_t t = t0;
            for (; t + NT8 <= t1; t += NT8)
                tile8_half(m, g, h, r0, r1, t, NT8, kind);
            TAIL_TILE(tile8_half, NT8, t1 - t, m, g, h, r0, r1, t);
        }
    }
}

TGT void sh__cpu_avx2_mmp_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep8(m, r0, r1, K_Q8_0);
}

/* IQ4_NL: per block, dw da sum_i g(n_i) a_i with the exact integer sum (as the reference). The
 * grid's values are at most 127 in magnitude, so a pair sum of Q8_0's sign trick still fits int16
 * and one vpmaddwd per step widens it. */
TGT void sh__cpu_avx2_mmp_iq4_nl(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep8(m, r0, r1, K_IQ4_NL);
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
