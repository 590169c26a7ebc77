/* AVX2 matmul kernels on packed F16 weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h,
 * the one copy the AVX-512 kernels read: block b holds 32 steps of the 16 rows' fp16 elements).
 * For CPUs without AVX-512 (AMD Zen 2/3, Intel client parts); the quantized types' AVX2 packed
 * kernels are in ops_avx2_packed.c. */
#include <string.h>

#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* The decode matvec walks MV_STREAMS row groups side by side (as ops_avx2_packed.c's). */
#define MV_STREAMS 4
/* The few-token path takes 2 .. FEW_MAX tokens (a speculative verify step of up to 16 drafts,
 * a small decode batch), as ops_avx2_packed.c's. */
#define FEW_MAX 17

/* F16 (packed block b: 32 steps e of the 16 rows' fp16 element 32b + e, cpu.h): step k of a group
 * is 16 fp16 that widen to two registers (halves h = 0, 1), so acc[t][h] (8 rows) += w[k][h] *
 * x[t][k] with x[t][k] broadcast from the transposed activations (sh__cpu_act.xt): no horizontal
 * sums. Each (row, token) is one FMA chain over k in order, in a tile and in the matvec alike (a
 * partial sum parked in memory between k chunks is exact), so a token's result does not depend on
 * the batch. A prefill tile is the group's 16 rows x NTF tokens: 2 NTF accumulators, the two
 * widened weights and one broadcast fit the 16 registers (15 of them), so per step 2 conversions
 * and NTF broadcasts feed 2 NTF FMAs (12 chains cover Zen 3's 4-cycle FMA latency at 2 per cycle
 * with room; 8-row tiles of 8 tokens needed 9 loads per 8 FMAs and every chain). */
#define NTF 6
/* The F16 matvec walks MV_STREAMS groups side by side (8 independent chains cover the FMA
 * latency) with software prefetch F16_PF_DIST bytes ahead in each. */
#define F16_PF_DIST 4096
/* Bytes of xt per token block (see sh__cpu_avx2_mmp_f16), and the most tokens per block (the
 * partial sums of a group's block, F16_TB_MAX x 16 floats, live on the stack). */
#define F16_TOK_BLOCK_BYTES (1 << 20)
#define F16_TB_MAX 192
/* Steps per k chunk of the prefill tiles: a group's chunk of weights (F16_PP_KC x 32 bytes) stays
 * in L1 while every tile of the token block passes over it, and so does one 16-token tile of xt's
 * chunk (F16_PP_KC x 64 bytes) while the tiles inside it pass. */
#define F16_PP_KC 128

INL __m256 f16_half(const uint16_t *w, int64_t k, int h)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 16 * k + 8 * h)));
}

/* The 16 rows of group g against tokens t0 .. t0 + nt - 1 (anywhere: each token's xt column has
 * its own pointer), steps k0 .. k0 + kc - 1. part holds the tokens' partial sums (16 floats per
 * token, rows in order) between chunks: read unless this is the first chunk, written unless it is
 * the last, when the sums go to y. */
INL void tile_f16(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt,
                  int64_t k0, int64_t kc, float *part, int first, int last)
{
    const int64_t n_in = m->a->n_in;
    const uint16_t *w = (const uint16_t *)(m->w + (size_t)g * m->row_bytes) + 16 * k0;
    const float *xp[NTF];
    __m256 acc[NTF][2];
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++) {
        xp[i] = m->a->xt + (t0 + i) / 16 * n_in * 16 + (t0 + i) % 16 + 16 * k0;
        acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 16 * i);
        acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 16 * i + 8);
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = f16_half(w, k, 0), w1 = f16_half(w, k, 1);
#pragma GCC unroll 16
        for (int i = 0; i < nt; i++) {
            const __m256 xv = _mm256_broadcast_ss(xp[i] + 16 * k);
            acc[i][0] = _mm256_fmadd_ps(w0, xv, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w1, xv, acc[i][1]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nt; i++)
        if (last) {
            sh__avx2_store_half(m, g, 0, r0, r1, t0 + i, acc[i][0]);
            sh__avx2_store_half(m, g, 1, r0, r1, t0 + i, acc[i][1]);
        } else {
            _mm256_storeu_ps(part + 16 * i, acc[i][0]);
            _mm256_storeu_ps(part + 16 * i + 8, acc[i][1]);
        }
}

/* One token (from x: a matvec has no xt), groups g0 + j step (j < ns) side by side, both
 * halves: the chains of tile_f16_half. */
INL void mv_f16_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                       int64_t r1)
{
    const int64_t n_in = m->a->n_in;
    const float *x = m->a->x;
    __m256 acc[MV_STREAMS][2];
    for (int j = 0; j < ns; j++)
        acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n_in; k++) {
        const __m256 xv = _mm256_broadcast_ss(x + k);
        for (int j = 0; j < ns; j++) {
            const uint16_t *w = (const uint16_t *)(m->w + (size_t)(g0 + j * step) * m->row_bytes);
            if (k % 2 == 0)
                _mm_prefetch((const char *)(w + 16 * k) + F16_PF_DIST, _MM_HINT_T0);
            acc[j][0] = _mm256_fmadd_ps(f16_half(w, k, 0), xv, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(f16_half(w, k, 1), xv, acc[j][1]);
        }
    }
    for (int j = 0; j < ns; j++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + j * step, h, r0, r1, 0, acc[j][h]);
}

/* Steps k of a chunk in few_f16_groups: the ns groups' weights widened to f32 (at most
 * F16_KC * MV_STREAMS * 2 * 32 bytes = 16 KiB) stay in L1 while every token passes over them. */
#define F16_KC 64

/* A few tokens (some counts in 2 .. FEW_MAX: a speculative verify step, a small decode batch)
 * through the matvec's walk (groups g0 + j step, j < ns, side by side, with its prefetch), so the
 * weights stream once at the matvec's pace: per chunk of F16_KC steps the groups' halves are
 * widened once into L1, then each token runs its 2 ns chains over the chunk in registers (the tiles
 * of fewer than 8 tokens have too few chains to cover the FMA latency, and read one group at a time
 * without prefetch). Each (row, token) is still one FMA chain over k in order, so a row's result is
 * bit for bit the matvec's (test_kernels_packed: few_tokens). */
INL void few_f16_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                        int64_t r1, const int nt)
{
    const int64_t n_in = m->a->n_in;
    const float *x = m->a->x;
    __m256 acc[FEW_MAX][MV_STREAMS][2];
    __attribute__((aligned(32))) float wf[F16_KC][MV_STREAMS][2][8];
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < ns; j++)
            acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < n_in; k0 += F16_KC) {
        const int64_t kc = n_in - k0 < F16_KC ? n_in - k0 : F16_KC;
        for (int64_t k = 0; k < kc; k++)
            for (int j = 0; j < ns; j++) {
                const uint16_t *w =
                    (const uint16_t *)(m->w + (size_t)(g0 + j * step) * m->row_bytes);
                if (k % 2 == 0)
                    _mm_prefetch((const char *)(w + 16 * (k0 + k)) + F16_PF_DIST, _MM_HINT_T0);
                _mm256_store_ps(wf[k][j][0], f16_half(w, k0 + k, 0));
                _mm256_store_ps(wf[k][j][1], f16_half(w, k0 + k, 1));
            }
        int i = 0;
        if (ns < MV_STREAMS) /* the groups left over: 4 tokens at a time make the 8 chains */
            for (; i + 4 <= nt; i += 4)
                for (int j = 0; j < ns; j++) {
                    __m256 a[4][2];
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++)
                        a[u][0] = acc[i + u][j][0], a[u][1] = acc[i + u][j][1];
                    for (int64_t k = 0; k < kc; k++) {
                        const __m256 w0 = _mm256_load_ps(wf[k][j][0]);
                        const __m256 w1 = _mm256_load_ps(wf[k][j][1]);
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++) {
                            const __m256 xv = _mm256_broadcast_ss(x + (i + u) * n_in + k0 + k);
                            a[u][0] = _mm256_fmadd_ps(w0, xv, a[u][0]);
                            a[u][1] = _mm256_fmadd_ps(w1, xv, a[u][1]);
                        }
                    }
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++)
                        acc[i + u][j][0] = a[u][0], acc[i + u][j][1] = a[u][1];
                }
        for (; i < nt; i++) {
            const float *xi = x + i * n_in + k0;
            if (ns == MV_STREAMS) {
                __m256 a[MV_STREAMS][2];
#pragma GCC unroll 4
                for (int j = 0; j < MV_STREAMS; j++)
                    a[j][0] = acc[i][j][0], a[j][1] = acc[i][j][1];
                for (int64_t k = 0; k < kc; k++) {
                    const __m256 xv = _mm256_broadcast_ss(xi + k);
#pragma GCC unroll 4
                    for (int j = 0; j < MV_STREAMS; j++) {
                        a[j][0] = _mm256_fmadd_ps(_mm256_load_ps(wf[k][j][0]), xv, a[j][0]);
                        a[j][1] = _mm256_fmadd_ps(_mm256_load_ps(wf[k][j][1]), xv, a[j][1]);
                    }
                }
#pragma GCC unroll 4
                for (int j = 0; j < MV_STREAMS; j++)
                    acc[i][j][0] = a[j][0], acc[i][j][1] = a[j][1];
            } else {
                for (int j = 0; j < ns; j++) {
                    __m256 a0 = acc[i][j][0], a1 = acc[i][j][1];
                    for (int64_t k = 0; k < kc; k++) {
                        const __m256 xv = _mm256_broadcast_ss(xi + k);
                        a0 = _mm256_fmadd_ps(_mm256_load_ps(wf[k][j][0]), xv, a0);
                        a1 = _mm256_fmadd_ps(_mm256_load_ps(wf[k][j][1]), xv, a1);
                    }
                    acc[i][j][0] = a0, acc[i][j][1] = a1;
                }
            }
        }
    }
    for (int j = 0; j < ns; j++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < nt; i++)
                sh__avx2_store_half(m, g0 + j * step, h, r0, r1, i, acc[i][j][h]);
}

TGT void sh__cpu_avx2_mmp_f16(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok, n_in = m->a->n_in;
    if (n_tok == 1) {
        SH_AVX2_MATVEC(mv_f16_groups, MV_STREAMS, m, r0, r1);
        return;
    }
    /* Where the earlier 8-row x 8-token tiles ended in a tile of 1..4 tokens (2..4 tokens, 9..12
     * and 17) the few-token walk; measured against those tiles on a 2-vCPU Zen 3 for 2..9 tokens,
     * it was faster at 2 and 9 and even at 3..4, while with 5..8 tokens the tiles were faster
     * (bench/README.md, issue 27); 10..12 and 17 follow the rule unmeasured, and the split has
     * not been measured again against the 16 x NTF tiles below. */
    if (n_tok <= FEW_MAX && n_tok % 8 >= 1 && n_tok % 8 <= 4) {
        SH_AVX2_MATVEC(few_f16_groups, MV_STREAMS, m, r0, r1, (int)n_tok);
        return;
    }
    /* Token blocks of about F16_TOK_BLOCK_BYTES of xt outermost (each group's weights stream
     * once per block), then groups, k chunks (a chunk of the group's weights stays in L1 while the
     * block's tiles pass) and tiles of NTF tokens. A block's tokens end in a tile of 3..5 or none:
     * a remainder of 1 or 2 takes one full tile along as 4 + 3 or 4 + 4 tokens, so every tile has
     * at least 6 chains. */
    int64_t tb = F16_TOK_BLOCK_BYTES / (n_in * 4) / NTF * NTF;
    tb = tb < NTF ? NTF : tb > F16_TB_MAX ? F16_TB_MAX : tb;
    float part[F16_TB_MAX * 16];
    for (int64_t tb0 = 0; tb0 < n_tok; tb0 += tb) {
        const int64_t tb1 = tb0 + tb < n_tok ? tb0 + tb : n_tok, n = tb1 - tb0;
        int64_t full = n / NTF;
        int rest = (int)(n % NTF);
        if (full > 0 && rest > 0 && rest < 3)
            full--, rest += NTF;
        for (int64_t g = r0 / 16; g * 16 < r1; g++)
            for (int64_t k0 = 0; k0 < n_in; k0 += F16_PP_KC) {
                const int64_t kc = n_in - k0 < F16_PP_KC ? n_in - k0 : F16_PP_KC;
                const int first = k0 == 0, last = k0 + kc == n_in;
                int64_t t = tb0;
                for (int64_t j = 0; j < full; j++, t += NTF)
                    tile_f16(m, g, r0, r1, t, NTF, k0, kc, part + 16 * (t - tb0), first, last);
                float *pt = part + 16 * (t - tb0);
                switch (rest) { /* the tail: tiles of compile-time sizes */
                case 1:
                    tile_f16(m, g, r0, r1, t, 1, k0, kc, pt, first, last);
                    break;
                case 2:
                    tile_f16(m, g, r0, r1, t, 2, k0, kc, pt, first, last);
                    break;
                case 3:
                    tile_f16(m, g, r0, r1, t, 3, k0, kc, pt, first, last);
                    break;
                case 4:
                    tile_f16(m, g, r0, r1, t, 4, k0, kc, pt, first, last);
                    break;
                case 5:
                    tile_f16(m, g, r0, r1, t, 5, k0, kc, pt, first, last);
                    break;
                case 7:
                    tile_f16(m, g, r0, r1, t, 4, k0, kc, pt, first, last);
                    tile_f16(m, g, r0, r1, t + 4, 3, k0, kc, pt + 64, first, last);
                    break;
                case 8:
                    tile_f16(m, g, r0, r1, t, 4, k0, kc, pt, first, last);
                    tile_f16(m, g, r0, r1, t + 4, 4, k0, kc, pt + 64, first, last);
                    break;
                default:
                    break;
                }
            }
    }
}

#endif
