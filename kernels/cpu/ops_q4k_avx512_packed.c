/* AVX-512 VNNI matmul kernel on packed Q4_K weights (16 rows interleaved per super-block, see
 * SH_CPU_PACK_ROWS in cpu.h): one dpbusd per 64 multiply-adds with the 16 rows in the lanes, a
 * decode matvec that streams the weights with software prefetch, and prefill tiles of up to NT
 * tokens that unpack each weight vector once per tile. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per register tile: an int32 and a float accumulator per token beside the 8 unpacked code
 * vectors and the masks (the decoded scales stay on the stack and are loaded per sub-block). 4, 6
 * and 8 measured alike (43-50 ns per 16-row super-block and token, in L2, on a shared machine):
 * a token's 64 dpbusd bound the tile, not the unpacking it shares. */
#define NT 4
_Static_assert(NT <= 8, "tiles of up to 8 tokens (the accumulator arrays, the tail switch)");

/* A super-block's scales for the 16 rows of a group, decoded once for all tokens of a tile.
 * Sub-block j's codes are the low nibbles (j even) or the high nibbles kept in place, i.e. 16 times
 * the code (j odd; masking with 0xF0 saves the shift). So that both kinds sum into one int32
 * accumulator as 16 * sum_j sc_j dot_j, the even sub-blocks' scales are stored times 16.
 * Bounds (|a| <= 128, codes <= 15, sc <= 63): 16 sc_j dot_j <= 16 * 63 * 32 * 15 * 128 < 2^26,
 * eight of them < 2^29. The minimum pairs (m_j, m_j) as int16 meet the activations' 16-element
 * sums (bsums 2j, 2j + 1, each |.| <= 2048) in one dpwssd: sum_j m_j (b_2j + b_2j+1) < 2^21. */
typedef struct q4k_scales {
    __m512i sc[8]; /* int32 per row: 16 sc_j (j even) or sc_j (j odd) */
    __m512i mp[8]; /* int16 pairs per row: (m_j, m_j) */
    __m512 d, dmin;
} q4k_scales;

/* The byte shuffle that moves byte k of each 32-bit lane to its low byte (pair = 0) or to both of
 * its 16-bit halves (pair = 1), zeroing the rest. */
INL __m512i pick_ctrl(int k, int pair)
{
    const char z = (char)-128; /* 0x80: the shuffle writes zero */
    const __m128i c = pair ? _mm_setr_epi8((char)k, z, (char)k, z, (char)(4 + k), z, (char)(4 + k),
                                           z, (char)(8 + k), z, (char)(8 + k), z, (char)(12 + k), z,
                                           (char)(12 + k), z)
                           : _mm_setr_epi8((char)k, z, z, z, (char)(4 + k), z, z, z, (char)(8 + k),
                                           z, z, z, (char)(12 + k), z, z, z);
    return _mm512_broadcast_i32x4(c);
}

INL void decode_scales(const uint8_t *pb, q4k_scales *s)
{
    const __m512i v0 = _mm512_loadu_si512((const void *)(pb + SH_CPU_PACK_Q4K_SC));
    const __m512i v1 = _mm512_loadu_si512((const void *)(pb + SH_CPU_PACK_Q4K_SC + 64));
    const __m512i v2 = _mm512_loadu_si512((const void *)(pb + SH_CPU_PACK_Q4K_SC + 128));
    const __m512i m6 = _mm512_set1_epi8(0x3f), m4 = _mm512_set1_epi8(0x0f);
    const __m512i t2 = _mm512_set1_epi8(0x30);
    /* quant_k.c's get_scale_min for 16 rows, four sub-blocks per 32-bit lane: j < 4 are the low
     * six bits of bytes j (sc) and 4 + j (m); j >= 4 the low (sc) or high (m) nibble of byte
     * j + 4 with the top two bits of byte j - 4 (sc) or j (m) above it. The 32-bit shifts carry
     * bits across bytes only into the masked-off positions. */
    const __m512i sc_lo = _mm512_and_si512(v0, m6), m_lo = _mm512_and_si512(v1, m6);
    const __m512i sc_hi =
        _mm512_or_si512(_mm512_and_si512(v2, m4), _mm512_and_si512(_mm512_srli_epi32(v0, 2), t2));
    const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi32(v1, 2), t2));
    for (int k = 0; k < 4; k++) {
        const __m512i c1 = pick_ctrl(k, 0), c2 = pick_ctrl(k, 1);
        const __m512i a = _mm512_shuffle_epi8(sc_lo, c1), b = _mm512_shuffle_epi8(sc_hi, c1);
        s->sc[k] = k % 2 ? a : _mm512_slli_epi32(a, 4);
        s->sc[4 + k] = k % 2 ? b : _mm512_slli_epi32(b, 4);
        s->mp[k] = _mm512_shuffle_epi8(m_lo, c2);
        s->mp[4 + k] = _mm512_shuffle_epi8(m_hi, c2);
    }
    s->d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_Q4K_D)));
    s->dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_Q4K_D + 32)));
}

INL __m512i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The pieces of a group's sums. Per super-block b, token t and row r (q codes, a the token's Q8_K
 * codes with scale da and 16-element sums bsums):
 *   16 isum = sum_j 16 sc_j sum_{i in j} q_i a_i   (int32, exact, as ordered in q4k_scales)
 *   msum = sum_j m_j (bsums_2j + bsums_2j+1)       (int32, exact)
 *   acc += float(16 isum) * (d * da / 16);  acc -= float(msum) * (dmin * da)
 * in super-block order. The tiles and the matvec share decode_scales, finish and store; the matvec
 * forms isum in its own order (mv_groups), which in exact int32 is the same value. So a token's
 * output does not depend on its tile, on the row split or on whether a matvec computed it. */

/* The decode matvec walks MV_STREAMS row-group ranges side by side, one 64-byte line of codes of
 * each in turn, and prefetches each line it reads MV_PF_DIST bytes ahead into L1, one prefetch
 * before each load (one core's single sequential run keeps too few misses in flight; the
 * Q4_0..Q8_0 packed matvec, ops_avx512_packed.c, streams side by side too). With the scales
 * first in a super-block (cpu.h), each range is one ascending walk and the prefetches cover every
 * line once: the 4 lines of scales and d ahead of sub-block pair jj by line jj, the codes line by
 * line.
 * Measured on the kernel alone (~400 MB of copies of one weight in huge pages, 1 thread, variants
 * alternated in one process with an 8-stream read of the same memory as bench_model's probe,
 * 2-vCPU Sapphire Rapids VM, mean of 8 rounds in one run), as a fraction of that read, on
 * tinyllama's 5632 x 2048 / 2048 x 5632 / 2048 x 2048, 4 ranges by sub-block pairs (512 bytes):
 *   the scales after the codes, a pair's 9 prefetches T1 (to L2) up front   0.75 / 0.75 / 0.73
 *   the same with T0                                                        0.79 / 0.78 / 0.76
 *   T0 prefetches spread over the loads                                     0.80 / 0.81 / 0.78
 *   the scales first, T0 spread                                             0.84 / 0.83 / 0.79
 *   the scales first, T1 spread                                             0.79 / 0.80 / 0.76
 * and then by single lines (mean of 6 rounds, another run): the 4 ranges by pairs above 0.75 /
 * 0.82 / 0.81; by lines, 2 ranges 0.75 / 0.78 / 0.77, 4 ranges 0.78 / 0.87 / 0.83, 8 ranges (this
 * kernel) 0.89 / 0.93 / 0.90. In a third run 8 ranges 0.96 / 0.94 / 0.91, 6 ranges 0.92 / 0.88 /
 * 0.87, 12 ranges 0.95 / 0.89 / 0.88, 512 bytes or 2 KiB ahead at 8 ranges within 0.04 of 1 KiB.
 * (An earlier series with the scales after the codes: one group at a time with an 8 KiB prefetch
 * ahead 9.5 / 10.0 GB/s, 4 ranges by pairs 11.2 / 11.7; whole super-blocks per range, 2 to 16
 * ranges, no better; no prefetch much worse.) */
#ifndef MV_STREAMS
#define MV_STREAMS 8
#endif
_Static_assert(MV_STREAMS >= 4, "the matvec's remainder runs 4 streams");
#ifndef MV_PF_DIST
#define MV_PF_DIST 1024
#endif

/* Sub-block j's 8 code vectors: the low (j even) or high (j odd) nibbles of vectors 8(j/2) .. +7.
 */
INL void codes(const uint8_t *pb, int j, __m512i q[8])
{
    const __m512i mask = _mm512_set1_epi8(j % 2 ? (char)0xf0 : 0x0f);
    const uint8_t *pv = pb + SH_CPU_PACK_Q4K_CODES + 64 * 8 * (j / 2);
    for (int v = 0; v < 8; v++)
        q[v] = _mm512_and_si512(_mm512_loadu_si512((const void *)(pv + 64 * v)), mask);
}

/* ia + 16 sc_j (or sc_j) times sub-block j's dot products with the token's codes aq (two chains
 * of four: a token alone would otherwise wait on the dpbusd latency eight times per sub-block). */
INL __m512i sub_dot(const __m512i q[8], const int8_t *aq, __m512i sc, __m512i ia)
{
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4(aq));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], bcast4(aq + 4));
    d0 = _mm512_dpbusd_epi32(d0, q[2], bcast4(aq + 8));
    d1 = _mm512_dpbusd_epi32(d1, q[3], bcast4(aq + 12));
    d0 = _mm512_dpbusd_epi32(d0, q[4], bcast4(aq + 16));
    d1 = _mm512_dpbusd_epi32(d1, q[5], bcast4(aq + 20));
    d0 = _mm512_dpbusd_epi32(d0, q[6], bcast4(aq + 24));
    d1 = _mm512_dpbusd_epi32(d1, q[7], bcast4(aq + 28));
    return _mm512_add_epi32(ia, _mm512_mullo_epi32(_mm512_add_epi32(d0, d1), sc));
}

/* acc plus the super-block's term for one token: its scaled integer sum ia less the minimums. */
INL __m512 finish(const q4k_scales *s, const sh_block_q8_k *ab, __m512i ia, __m512 acc)
{
    const int16_t *bs = ab->bsums;
    __m512i ms = _mm512_dpwssd_epi32(_mm512_setzero_si512(), s->mp[0], bcast4(bs));
    __m512i ms1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), s->mp[1], bcast4(bs + 2));
    for (int k = 2; k < 8; k += 2) {
        ms = _mm512_dpwssd_epi32(ms, s->mp[k], bcast4(bs + 2 * k));
        ms1 = _mm512_dpwssd_epi32(ms1, s->mp[k + 1], bcast4(bs + 2 * k + 2));
    }
    const float da = ab->d;
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s->d, _mm512_set1_ps(da * 0.0625f)),
                          acc);
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ms, ms1)),
                            _mm512_mul_ps(s->dmin, _mm512_set1_ps(da)), acc);
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

/* Rows [16g, 16g + 16) against tokens t0 .. t0 + nt - 1, stored for rows [r0, r1). */
INL void tile(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    __m512 acc[8];
    for (int i = 0; i < nt; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = w + (size_t)b * SH_CPU_PACK_Q4K_BYTES;
        q4k_scales s;
        decode_scales(pb, &s);
        const sh_block_q8_k *ab[8];
        __m512i ia[8];
        for (int i = 0; i < nt; i++) {
            ab[i] = a->qk + (t0 + i) * nb + b;
            ia[i] = _mm512_setzero_si512();
        }
        /* unrolled: GCC otherwise keeps j as a loop counter with a branch on its parity and the
         * scales indexed through memory (a third slower in cache) */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i q[8];
            codes(pb, j, q);
            for (int i = 0; i < nt; i++)
                ia[i] = sub_dot(q, ab[i]->qs + 32 * j, s.sc[j], ia[i]);
        }
        for (int i = 0; i < nt; i++)
            acc[i] = finish(&s, ab[i], ia[i], acc[i]);
    }
    for (int i = 0; i < nt; i++)
        store(m, g, r0, r1, t0 + i, acc[i]);
}

/* The matvec of groups g0 + k * step (k < ns) side by side: per super-block, each group's scales,
 * then per sub-block pair jj line v (v < 8) of its codes in every group in turn, each load after a
 * prefetch of the line MV_PF_DIST bytes past it. A line's low and high nibbles meet the same
 * activation bytes in every group, so the line's two broadcasts serve all ns groups. A token's
 * integer sums are tile's in another order: exact int32 arithmetic, so the same values, and
 * finish turns them into the same floats. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    const __m512i m_lo = _mm512_set1_epi8(0x0f), m_hi = _mm512_set1_epi8((char)0xf0);
    const uint8_t *w[MV_STREAMS];
    __m512 acc[MV_STREAMS];
    for (int k = 0; k < ns; k++) {
        w[k] = m->w + (size_t)(g0 + k * step) * m->row_bytes;
        acc[k] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        const size_t ob = (size_t)b * SH_CPU_PACK_Q4K_BYTES;
        q4k_scales s[MV_STREAMS];
        __m512i ia[MV_STREAMS];
        for (int k = 0; k < ns; k++) {
            decode_scales(w[k] + ob, &s[k]);
            ia[k] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; jj++) {
            __m512i lo[MV_STREAMS], hi[MV_STREAMS]; /* sub-blocks 2jj and 2jj + 1 */
            for (int k = 0; k < ns; k++) {
                /* line jj of the scales and d (the codes' lines are prefetched as they load) */
                _mm_prefetch((const char *)w[k] + ob + SH_CPU_PACK_Q4K_SC + 64 * jj + MV_PF_DIST,
                             _MM_HINT_T0);
                lo[k] = hi[k] = _mm512_setzero_si512();
            }
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                const __m512i alo = bcast4(ab->qs + 64 * jj + 4 * v);
                const __m512i ahi = bcast4(ab->qs + 64 * jj + 32 + 4 * v);
#pragma GCC unroll 16
                for (int k = 0; k < ns; k++) {
                    const uint8_t *pv = w[k] + ob + SH_CPU_PACK_Q4K_CODES + 512 * jj + 64 * v;
                    _mm_prefetch((const char *)pv + MV_PF_DIST, _MM_HINT_T0);
                    const __m512i x = _mm512_loadu_si512((const void *)pv);
                    lo[k] = _mm512_dpbusd_epi32(lo[k], _mm512_and_si512(x, m_lo), alo);
                    hi[k] = _mm512_dpbusd_epi32(hi[k], _mm512_and_si512(x, m_hi), ahi);
                }
            }
            for (int k = 0; k < ns; k++)
                ia[k] = _mm512_add_epi32(
                    ia[k], _mm512_add_epi32(_mm512_mullo_epi32(lo[k], s[k].sc[2 * jj]),
                                            _mm512_mullo_epi32(hi[k], s[k].sc[2 * jj + 1])));
        }
        for (int k = 0; k < ns; k++)
            acc[k] = finish(&s[k], ab, ia[k], acc[k]);
    }
    for (int k = 0; k < ns; k++)
        store(m, g0 + k * step, r0, r1, 0, acc[k]);
}

/* Activation bytes of a token block: the tokens whose Q8_K rows stay in L2 while every row group
 * of the chunk passes over them. */
#define TOK_BLOCK_BYTES (1 << 20)

/* A matvec as above; otherwise token blocks outermost, then row groups, then token tiles (as the
 * other packed kernels): a group's packed super-blocks (nb * 2304 bytes) stay in L1/L2 while the
 * block's tiles pass over them. */
TGT void sh__cpu_avx512_mmp_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) { /* the groups in MV_STREAMS equal ranges, the rest in 4, then singly */
        const int64_t g1 = (r1 + 15) / 16;
        int64_t g = r0 / 16, part = (g1 - g) / MV_STREAMS;
        for (int64_t i = 0; i < part; i++)
            mv_groups(m, g + i, part, MV_STREAMS, r0, r1);
        g += MV_STREAMS * part;
        part = (g1 - g) / 4;
        for (int64_t i = 0; i < part; i++)
            mv_groups(m, g + i, part, 4, r0, r1);
        for (g += 4 * part; g < g1; g++)
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
            /* the tail: each tile size a compile-time constant */
            switch (t1 - t) {
            case 7:
                tile(m, g, r0, r1, t, 7);
                break;
            case 6:
                tile(m, g, r0, r1, t, 6);
                break;
            case 5:
                tile(m, g, r0, r1, t, 5);
                break;
            case 4:
                tile(m, g, r0, r1, t, 4);
                break;
            case 3:
                tile(m, g, r0, r1, t, 3);
                break;
            case 2:
                tile(m, g, r0, r1, t, 2);
                break;
            case 1:
                tile(m, g, r0, r1, t, 1);
                break;
            default:
                break;
            }
        }
    }
}

#else
typedef int sh__cpu_q4k_packed_unused; /* not x86-64: the table never names the kernel */
#endif
