/* AVX-512 VNNI matmul on packed Q6_K weights (16 rows interleaved, see SH_CPU_PACK_Q6K_BLOCK in
 * cpu.h): a decode matvec that streams the weights once with software prefetch, and register
 * tiles of up to NT tokens for prefill that unpack each weight unit once per tile. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per tile: NT super-block sums in registers, plus the four unpacked code vectors, the
 * scales and the masks, within the 32 zmm registers; the running float sums, touched once per
 * super-block, live in memory. 16 measured 1.13x the throughput of 8 held in registers (2048 x 256
 * Q6_K, 64 tokens, one thread), the unpacking being shared by twice the tokens. */
#define NT 16

/* Bytes of activations (Q8_K) per token block: see sh__cpu_avx512_mmp_q6_k. */
#define TOK_BLOCK_BYTES (1 << 20)

/* Bit select with a constant: (a & 0x0f) | (b & 0xf0) per byte (ternary-logic table 0xe4 reads
 * a where the third operand has a 1, b elsewhere). */
#define SEL(a, b, m) _mm512_ternarylogic_epi32((a), (b), (m), 0xe4)

INL __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The pieces of a group's sums, shared by the tiles and the matvec so that a token's sums run the
 * same instructions either way. Per super-block b, row r, token t (q codes 0..63, a the token's
 * Q8_K codes, sc_s the row's sub-block scales):
 *   D_s = sum_{i in s} q_i a_i - 32 bsum_s,   S = sum_s sc_s D_s,   y += (d_r da) S.
 * D_s is exact in int32 (|q - 32| <= 32 and |a| <= 128: |D_s| <= 2^16); the -32 offset does not
 * depend on the row, so it is each sub-block dpbusd chain's starting value. S is summed in float
 * by FMA: every product sc_s D_s (at most 2^23) is exact, and so is the sum while it stays below
 * 2^24 (only activations and scales near their extremes in most sub-blocks pass it, by at most a
 * factor 8; an addition past it rounds by at most 2^-24 of the sum). The float multiply-add saves a
 * third of the per sub-block work of vpmulld + add (it measured 1.11x the tile's throughput).
 * Everything runs in a fixed order per token, so a token's output is the same in a matvec and in
 * any tile and does not depend on the row split. */

/* -32 bsum_s of a token's super-block, the starting values of its sub-block chains. */
INL void offsets(const sh_block_q8_k *ab, int32_t off[16])
{
    const __m512i bs = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const void *)ab->bsums));
    _mm512_store_si512((void *)off,
                       _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(bs, 5)));
}

/* Unit s of the packed super-block at wb: its four code vectors and the 16 rows' scales. */
INL void unpack(const uint8_t *wb, int s, __m512i c[4], __m512 *sc)
{
    const __m512i m0f = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const uint8_t *u = wb + SH_CPU_PACK_Q6K_UNITS + s * SH_CPU_PACK_Q6K_UNIT;
    const __m512i z0 = _mm512_loadu_si512((const void *)u);
    const __m512i z1 = _mm512_loadu_si512((const void *)(u + 64));
    const __m512i h = _mm512_loadu_si512((const void *)(u + 128));
    /* code vector v: its nibble, with its two top bits moved to bits 4-5 (16-bit shifts; the
     * masks drop what crossed from the neighbouring byte) */
    c[0] = SEL(z0, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), m0f);
    c[1] = SEL(_mm512_srli_epi16(z0, 4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), m0f);
    c[2] = SEL(z1, _mm512_and_si512(h, m30), m0f);
    c[3] = SEL(_mm512_srli_epi16(z1, 4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), m0f);
    *sc = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(wb + SH_CPU_PACK_Q6K_SC + 16 * s))));
}

/* S += sc_s D_s for one token (aq: its codes of sub-block s, off: -32 bsum_s). */
INL __m512 dot(const __m512i c[4], __m512 sc, const int8_t *aq, int32_t off, __m512 ssum)
{
    __m512i d = _mm512_set1_epi32(off);
    d = _mm512_dpbusd_epi32(d, c[0], bcast4(aq));
    d = _mm512_dpbusd_epi32(d, c[1], bcast4(aq + 4));
    d = _mm512_dpbusd_epi32(d, c[2], bcast4(aq + 8));
    d = _mm512_dpbusd_epi32(d, c[3], bcast4(aq + 12));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, ssum);
}

/* acc + (d_r da) S for super-block b (wd: the group's d). */
INL __m512 scale_add(const uint8_t *wd, int64_t b, float da, __m512 ssum, __m512 acc)
{
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(wd + b * 32)));
    return _mm512_fmadd_ps(ssum, _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
}

/* Stores (or adds) a token's 16 row sums of group g, rows [r0, r1) only. */
INL void store(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t, __m512 v)
{
    const int64_t lo = r0 > 16 * g ? r0 - 16 * g : 0, hi = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
    const __mmask16 k = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    float *y = m->y + t * m->ldy + 16 * g;
    if (m->accumulate)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, y));
    _mm512_mask_storeu_ps(y, k, v);
}

/* Rows [16g, 16g + 16) against tokens t0 .. t0 + nt - 1. */
INL void tile(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK;
    float acc[NT][16] __attribute__((aligned(64)));
    for (int i = 0; i < nt; i++)
        _mm512_store_ps(acc[i], _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
        const sh_block_q8_k *ab = a->qk + t0 * nb + b;
        int32_t off[NT][16] __attribute__((aligned(64)));
        __m512 ssum[NT];
        for (int i = 0; i < nt; i++) {
            offsets(ab + i * nb, off[i]);
            ssum[i] = _mm512_setzero_ps();
        }
        for (int s = 0; s < 16; s++) {
            __m512i c[4];
            __m512 sc;
            unpack(wb, s, c, &sc);
            for (int i = 0; i < nt; i++)
                ssum[i] = dot(c, sc, ab[i * nb].qs + 16 * s, off[i][s], ssum[i]);
        }
        for (int i = 0; i < nt; i++)
            _mm512_store_ps(acc[i],
                            scale_add(wd, b, ab[i * nb].d, ssum[i], _mm512_load_ps(acc[i])));
    }
    for (int i = 0; i < nt; i++)
        store(m, g, r0, r1, t0 + i, _mm512_load_ps(acc[i]));
}

/* The decode matvec walks MV_STREAMS row-group ranges side by side, a quarter super-block (four
 * units, 768 bytes of codes) of each in turn, each stream software-prefetched MV_PF_DIST bytes
 * ahead into L2, as the other packed kernels' matvec does (ops_avx512_packed.c: one core's single
 * sequential run keeps too few misses in flight). The kernel alone (~400 MB of copies of one
 * weight, 1 thread, variants alternated in one process, mean of 12 rounds with a compile on the
 * other vCPU): tinyllama's 2048 x 5632 / 5632 x 2048 / 2048 x 2048, 8 streams by whole
 * super-blocks one super-block ahead (the kernel before) 9.3 / 7.9 / 8.4 GB/s, 4 streams by
 * quarters 1 KiB ahead 9.5 / 8.6 / 9.8; 2 streams came out alike (9.0 / 8.7 / 9.8), 8 streams,
 * 2 KiB and one super-block ahead lower in a shorter run. Then the scales moved from after the
 * units to before them (cpu.h), so that a super-block is one ascending walk: measured the same way
 * (huge pages, mean of 8 rounds) as a fraction of an 8-stream read of the same memory
 * (bench_model's probe), 0.81 / 0.79 / 0.83 -> 0.87 / 0.83 / 0.85 on 5632 x 2048 / 2048 x 5632 /
 * 2048 x 2048; T0 prefetches, or spreading them over the unit loads as the Q4_K matvec does, came
 * out within noise of that. */
#ifndef MV_STREAMS
#define MV_STREAMS 4
#endif
#ifndef MV_PF_DIST
#define MV_PF_DIST 1024
#endif

/* The matvec of groups g0 + k * step (k < ns) side by side: per super-block, units 4qq .. 4qq + 3
 * of each group in turn. A token's sums run as in tile. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    const uint8_t *w[MV_STREAMS];
    __m512 acc[MV_STREAMS];
    for (int k = 0; k < ns; k++) {
        w[k] = m->w + (size_t)(g0 + k * step) * m->row_bytes;
        acc[k] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        int32_t off[16] __attribute__((aligned(64)));
        offsets(ab, off);
        __m512 ssum[MV_STREAMS];
        for (int k = 0; k < ns; k++)
            ssum[k] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int qq = 0; qq < 4; qq++) {
#pragma GCC unroll 16
            for (int k = 0; k < ns; k++) {
                const uint8_t *wb = w[k] + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
                /* 12 lines of codes and one of the scales, MV_PF_DIST ahead */
                const char *pf = (const char *)wb + SH_CPU_PACK_Q6K_UNITS +
                                 4 * SH_CPU_PACK_Q6K_UNIT * qq + MV_PF_DIST;
                for (int l = 0; l < 12; l++)
                    _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
                _mm_prefetch((const char *)wb + SH_CPU_PACK_Q6K_SC + 64 * qq + MV_PF_DIST,
                             _MM_HINT_T1);
                for (int s = 4 * qq; s < 4 * qq + 4; s++) {
                    __m512i c[4];
                    __m512 sc;
                    unpack(wb, s, c, &sc);
                    ssum[k] = dot(c, sc, ab->qs + 16 * s, off[s], ssum[k]);
                }
            }
        }
        for (int k = 0; k < ns; k++) {
            const uint8_t *wd = w[k] + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK;
            if (b % 2 == 0) /* the d: 64 bytes per two super-blocks */
                _mm_prefetch((const char *)(wd + b * 32) + 128, _MM_HINT_T1);
            acc[k] = scale_add(wd, b, ab->d, ssum[k], acc[k]);
        }
    }
    for (int k = 0; k < ns; k++)
        store(m, g0 + k * step, r0, r1, 0, acc[k]);
}

/* A matvec as above; otherwise token blocks outermost, then row groups, then token tiles: a group's
 * packed super-blocks stay in L1/L2 while the block's tiles pass over them, and the block's
 * activations stay in L2 across the groups (as the other packed kernels do). */
TGT void sh__cpu_avx512_mmp_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) { /* the groups in MV_STREAMS equal ranges, then the rest one at a time */
        const int64_t g0 = r0 / 16, g1 = (r1 + 15) / 16, part = (g1 - g0) / MV_STREAMS;
        for (int64_t i = 0; i < part; i++)
            mv_groups(m, g0 + i, part, MV_STREAMS, r0, r1);
        for (int64_t g = g0 + MV_STREAMS * part; g < g1; g++)
            mv_groups(m, g, 0, 1, r0, r1);
        return;
    }
    const int64_t tok_bytes = m->a->n_in / SH_QK_K * (int64_t)sizeof(sh_block_q8_k);
    int64_t tb = TOK_BLOCK_BYTES / tok_bytes / NT * NT;
    tb = tb < NT ? NT : tb;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            int64_t t = t0;
            for (; t + NT <= t1; t += NT)
                tile(m, g, r0, r1, t, NT);
            /* the tail in power-of-two tiles, so that each tile size is a compile-time constant */
            if (t1 - t >= 8) {
                tile(m, g, r0, r1, t, 8);
                t += 8;
            }
            if (t1 - t >= 4) {
                tile(m, g, r0, r1, t, 4);
                t += 4;
            }
            if (t1 - t >= 2) {
                tile(m, g, r0, r1, t, 2);
                t += 2;
            }
            if (t1 - t >= 1)
                tile(m, g, r0, r1, t, 1);
        }
    }
}

#endif
