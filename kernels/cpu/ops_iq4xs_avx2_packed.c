/* AVX2 matmul kernel on packed IQ4_XS weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h):
 * a 256-bit register holds 8 of a group's 16 rows (half h is bytes 32h .. 32h + 31 of each 64-byte
 * vector of the super-block). The 4-bit codes are looked up in the grid (vpshufb) once per tile;
 * per token, Q8_0's sign trick (vpmaddubsw of |g| against a * sign(g), a pair sum at most
 * 2 * 127 * 127, so two would not fit int16) and a vpmaddwd with the sub-block's scale that widens
 * every step. A decode matvec that walks several row groups side by side without software
 * prefetch, both halves of a super-block sharing each activation broadcast (mv_sb); tiles of NT
 * tokens for a few tokens; for more, a sweep that looks each half super-block up once per block of
 * tokens (xs_sweep). */
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
/* The decode matvec walks MV_STREAMS row groups side by side without software prefetch, the
 * Q4_K and Q5_K kernels' finding on the 2-vCPU Zen 3 EPYC (ops_q4k_avx2_packed.c). */
#ifndef MV_STREAMS
#define MV_STREAMS 3
#endif
/* Activation bytes of a token block: its Q8_K rows stay in L2 while every row group passes
 * (TOK_BLOCK_BYTES for the tiles, XS_BLOCK_BYTES for the sweep: half the 512 KiB L2 of Zen 3, where
 * 1 MiB ran 1.07-1.18x slower at 512 tokens). */
#define TOK_BLOCK_BYTES (1 << 20)
#ifndef XS_BLOCK_BYTES
#define XS_BLOCK_BYTES (1 << 18)
#endif

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
 * matvec. */
INL void sb_half(const uint8_t *pb, const int h, const sh_block_q8_k *const *ab, const int nt,
                 __m256 *acc)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i grid = iq4_grid();
    const __m256i sl = _mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_IQ4XS_SL + 32 * h));
    const __m256i sh =
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_SH + 16 * h)));
    __m256i ia[NT];
    for (int i = 0; i < nt; i++)
        ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i sc = sub_scale(sl, sh, j);
        const uint8_t *pv = pb + SH_CPU_PACK_IQ4XS_CODES + 256 * j + 32 * h;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
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
        sb_half(w + (size_t)b * SH_CPU_PACK_IQ4XS_BYTES, h, ab, nt, acc);
        for (int i = 0; i < nt; i++)
            ab[i]++;
    }
    for (int i = 0; i < nt; i++)
        sh__avx2_store_half(m, g, h, r0, r1, t0 + i, acc[i]);
}

/* One super-block (at pb) of both halves against one token's Q8_K block ab, added to acc[h]:
 * sb_half's integers and float step for each half, the two halves side by side so that each
 * activation broadcast serves both (their code vectors are the two halves of one cache line). The
 * activation pointer is opaque to the compiler at each call (as in ops_q5k_avx2_packed.c: GCC
 * otherwise hoists broadcasts out of the streams' loop into stack copies). */
INL void mv_sb(const uint8_t *pb, const sh_block_q8_k *ab, __m256 *acc)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i grid = iq4_grid();
    const int8_t *qa = ab->qs;
    __asm__ volatile("" : "+r"(qa));
    __m256i ia0 = _mm256_setzero_si256(), ia1 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i sh0 =
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_SH)));
        const __m256i sh1 =
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_SH + 16)));
        const __m256i sc0 =
            sub_scale(_mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_IQ4XS_SL)), sh0, j);
        const __m256i sc1 =
            sub_scale(_mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_IQ4XS_SL + 32)), sh1, j);
        const uint8_t *pv = pb + SH_CPU_PACK_IQ4XS_CODES + 256 * j;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i x0 = _mm256_loadu_si256((const void *)(pv + 64 * k));
            const __m256i x1 = _mm256_loadu_si256((const void *)(pv + 64 * k + 32));
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m256i a = bcast4(qa + 32 * j + 16 * half + 4 * k);
                const __m256i q0 = _mm256_shuffle_epi8(
                    grid, _mm256_and_si256(half ? _mm256_srli_epi16(x0, 4) : x0, m4));
                const __m256i q1 = _mm256_shuffle_epi8(
                    grid, _mm256_and_si256(half ? _mm256_srli_epi16(x1, 4) : x1, m4));
                SH_AVX2_ADD32(ia0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q0),
                                                                          _mm256_sign_epi8(a, q0)),
                                                     sc0));
                SH_AVX2_ADD32(ia1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q1),
                                                                          _mm256_sign_epi8(a, q1)),
                                                     sc1));
            }
        }
    }
    const __m256 da = _mm256_set1_ps(ab->d);
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_D)));
    const __m256 d1 =
        _mm256_cvtph_ps(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_D + 16)));
    acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia0), _mm256_mul_ps(d0, da), acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia1), _mm256_mul_ps(d1, da), acc[1]);
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
        for (int k = 0; k < ns; k++)
            mv_sb(m->w + (size_t)(g0 + k * step) * m->row_bytes +
                      (size_t)b * SH_CPU_PACK_IQ4XS_BYTES,
                  ab, acc[k]);
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

/* ---- the sweep of many tokens: each half super-block looked up once per token block ---------- */

/* Tokens per tile of the sweep. The tile reads the grid values and their absolute values from the
 * unpacked copy in L1, so it holds per token only its 32-bit sum, beside the absolute values, the
 * sub-block's scales and two temporaries. */
#ifndef XS_NT
#define XS_NT 10
#endif
_Static_assert(XS_NT >= 8 && XS_NT <= 12, "the tail cases go up to 7, the tile's sums fit 16 YMM");
/* At most this many tokens per block: their float sums (32 bytes each) wait on the stack. */
#define XS_TOK_MAX 256
/* Fewer tokens than this go through the tiles above: the lookup and its stores cost about as much
 * per step as one token's own work (2048 x 2048, the sweep against the tiles: 0.70x at 2 tokens,
 * 0.83x at 4, 1.1x at 8). */
#ifndef XS_SWEEP_MIN
#define XS_SWEEP_MIN 8
#endif

/* One half super-block looked up: step 8j + 2k + n (n the nibble) holds the grid values g of the
 * 8 rows' codes 32j + 16n + 4k .. + 3 (the tiles' order above), sign[] g and abs[] |g|; sc[j]
 * sub-block j's scales as sub_scale makes them, d the rows' fp16 d. */
typedef struct xs_half {
    __m256i sign[64], abs[64], sc[8];
    __m256 d;
} xs_half;

INL void xs_unpack(const uint8_t *pb, const int h, xs_half *u)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i grid = iq4_grid();
    const __m256i sl = _mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_IQ4XS_SL + 32 * h));
    const __m256i sh =
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_SH + 16 * h)));
    for (int j = 0; j < 8; j++) {
        u->sc[j] = sub_scale(sl, sh, j);
        const uint8_t *pv = pb + SH_CPU_PACK_IQ4XS_CODES + 256 * j + 32 * h;
        for (int k = 0; k < 4; k++) {
            const __m256i x = _mm256_loadu_si256((const void *)(pv + 64 * k));
            const __m256i q0 = _mm256_shuffle_epi8(grid, _mm256_and_si256(x, m4));
            const __m256i q1 =
                _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
            u->sign[8 * j + 2 * k] = q0;
            u->sign[8 * j + 2 * k + 1] = q1;
            u->abs[8 * j + 2 * k] = _mm256_abs_epi8(q0);
            u->abs[8 * j + 2 * k + 1] = _mm256_abs_epi8(q1);
        }
    }
    u->d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(pb + SH_CPU_PACK_IQ4XS_D + 16 * h)));
}

/* The unpacked half super-block u against tokens ab[0 .. nt - 1] (their Q8_K blocks), added to
 * acc[i] (on the stack): per token and step a broadcast, vpsignb (g from L1), vpmaddubsw, vpmaddwd
 * and vpaddd, the same integers as sb_half and its float step. */
INL void xs_tile(const xs_half *u, const sh_block_q8_k *const *ab, const int nt, __m256 *acc)
{
    __m256i ia[XS_NT];
    for (int i = 0; i < nt; i++)
        ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; j++) {
        const __m256i sc = u->sc[j];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            const __m256i aq = _mm256_load_si256(u->abs + 8 * j + v);
            const int off = 32 * j + 16 * (v % 2) + 4 * (v / 2);
            for (int i = 0; i < nt; i++) {
                const __m256i s = _mm256_sign_epi8(bcast4(ab[i]->qs + off),
                                                   _mm256_load_si256(u->sign + 8 * j + v));
                SH_AVX2_ADD32(ia[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, s), sc));
            }
        }
    }
    for (int i = 0; i < nt; i++) {
        const __m256 r = _mm256_loadu_ps((const float *)(acc + i));
        _mm256_storeu_ps((float *)(acc + i),
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]),
                                         _mm256_mul_ps(u->d, _mm256_set1_ps(ab[i]->d)), r));
    }
}

/* Super-block b of tokens t .. t1 - 1 (block-relative acc) in tiles of XS_NT and one tail tile. */
INL void xs_tiles(const xs_half *u, const sh__cpu_act *a, int64_t nb, int64_t b, int64_t t,
                  int64_t t1, __m256 *acc)
{
    const sh_block_q8_k *ab[XS_NT];
    for (; t + XS_NT <= t1; t += XS_NT, acc += XS_NT) {
        for (int i = 0; i < XS_NT; i++)
            ab[i] = a->qk + (t + i) * nb + b;
        xs_tile(u, ab, XS_NT, acc);
    }
    const int n = (int)(t1 - t);
    for (int i = 0; i < n; i++)
        ab[i] = a->qk + (t + i) * nb + b;
    switch (n) {
    case 11:
        xs_tile(u, ab, 11 < XS_NT ? 11 : 1, acc);
        break;
    case 10:
        xs_tile(u, ab, 10 < XS_NT ? 10 : 1, acc);
        break;
    case 9:
        xs_tile(u, ab, 9 < XS_NT ? 9 : 1, acc);
        break;
    case 8:
        xs_tile(u, ab, 8 < XS_NT ? 8 : 1, acc);
        break;
    case 7:
        xs_tile(u, ab, 7, acc);
        break;
    case 6:
        xs_tile(u, ab, 6, acc);
        break;
    case 5:
        xs_tile(u, ab, 5, acc);
        break;
    case 4:
        xs_tile(u, ab, 4, acc);
        break;
    case 3:
        xs_tile(u, ab, 3, acc);
        break;
    case 2:
        xs_tile(u, ab, 2, acc);
        break;
    case 1:
        xs_tile(u, ab, 1, acc);
        break;
    default:
        break;
    }
}

/* Token blocks of about XS_BLOCK_BYTES of activations (at most XS_TOK_MAX tokens) outermost, then
 * row groups and halves, then super-blocks: each half super-block is looked up once (4 KiB, in
 * L1) for all the block's tokens, whose float sums wait on the stack. */
INL void xs_sweep(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K, n_tok = a->n_tok;
    int64_t tb = (int64_t)(XS_BLOCK_BYTES / ((size_t)nb * sizeof(sh_block_q8_k)));
    tb = tb < 1 ? 1 : tb > XS_TOK_MAX ? XS_TOK_MAX : tb;
    __m256 acc[XS_TOK_MAX];
    xs_half u;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++)
            for (int h = 0; h < 2; h++) {
                if (16 * g + 8 * h >= r1 || 16 * g + 8 * h + 8 <= r0)
                    continue;
                for (int64_t t = t0; t < t1; t++)
                    acc[t - t0] = _mm256_setzero_ps();
                const uint8_t *w = m->w + (size_t)g * m->row_bytes;
                for (int64_t b = 0; b < nb; b++) {
                    xs_unpack(w + (size_t)b * SH_CPU_PACK_IQ4XS_BYTES, h, &u);
                    xs_tiles(&u, a, nb, b, t0, t1, acc);
                }
                for (int64_t t = t0; t < t1; t++)
                    sh__avx2_store_half(m, g, h, r0, r1, t, acc[t - t0]);
            }
    }
}

/* A matvec as above; a few tokens in the tiles above; more in the sweep. */
TGT void sh__cpu_avx2_mmp_iq4_xs(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1);
        return;
    }
    if (n_tok >= XS_SWEEP_MIN) {
        xs_sweep(m, r0, r1);
        return;
    }
    SH_AVX2_TILE_SWEEP(tile_half, NT, TOK_BLOCK_BYTES,
                       m->a->n_in / SH_QK_K * (int64_t)sizeof(sh_block_q8_k), m, r0, r1);
}

#else
typedef int sh__cpu_iq4xs_avx2_packed_unused; /* not x86-64: the table never names the kernel */
#endif
