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

/* Rows [16g, 16g + 16) against tokens t0 .. t0 + nt - 1, stored for the rows in [r0, r1). Per
 * super-block b, row r, token t (q codes 0..63, a the token's Q8_K codes, sc_s the row's
 * sub-block scales):
 *   D_s = sum_{i in s} q_i a_i - 32 bsum_s,   S = sum_s sc_s D_s,   y += (d_r da) S.
 * D_s is exact in int32 (|q - 32| <= 32 and |a| <= 128: |D_s| <= 2^16); the -32 offset does not
 * depend on the row, so it is each sub-block dpbusd chain's starting value. S is summed in float
 * by FMA: every product sc_s D_s (at most 2^23) is exact, and so is the sum while it stays below
 * 2^24 (only activations and scales near their extremes in most sub-blocks pass it, by at most a
 * factor 8; an addition past it rounds by at most 2^-24 of the sum). The float multiply-add saves a
 * third of the per sub-block work of vpmulld + add (it measured 1.11x the tile's throughput).
 * Everything runs in a fixed order per token, whatever nt is, so a token's output is the same in a
 * matvec and in any tile and does not depend on the row split. */
INL void tile(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const uint8_t *wd = w + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK;
    const __m512i m0f = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    float acc[NT][16] __attribute__((aligned(64)));
    for (int i = 0; i < nt; i++)
        _mm512_store_ps(acc[i], _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
        const sh_block_q8_k *ab = a->qk + t0 * nb + b;
        /* -32 bsum_s of each token, the starting values of its sub-block chains */
        int32_t off[NT][16] __attribute__((aligned(64)));
        __m512 ssum[NT];
        for (int i = 0; i < nt; i++) {
            const __m512i bs =
                _mm512_cvtepi16_epi32(_mm256_loadu_si256((const void *)ab[i * nb].bsums));
            _mm512_store_si512((void *)off[i],
                               _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(bs, 5)));
            ssum[i] = _mm512_setzero_ps();
        }
        for (int s = 0; s < 16; s++) {
            const uint8_t *u = wb + s * SH_CPU_PACK_Q6K_UNIT;
            if (nt == 1) { /* a matvec streams the weights once: keep more misses in flight */
                for (int o = 0; o < SH_CPU_PACK_Q6K_UNIT; o += 64)
                    _mm_prefetch((const char *)u + SH_CPU_K_PF_DIST + o, _MM_HINT_T1);
                if (s < 4) /* the scales, 256 bytes per super-block */
                    _mm_prefetch((const char *)wb + 16 * SH_CPU_PACK_Q6K_UNIT + SH_CPU_K_PF_DIST +
                                     64 * s,
                                 _MM_HINT_T1);
            }
            const __m512i z0 = _mm512_loadu_si512((const void *)u);
            const __m512i z1 = _mm512_loadu_si512((const void *)(u + 64));
            const __m512i h = _mm512_loadu_si512((const void *)(u + 128));
            /* code vector v: its nibble, with its two top bits moved to bits 4-5 (16-bit shifts;
             * the masks drop what crossed from the neighbouring byte) */
            const __m512i c0 = SEL(z0, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), m0f);
            const __m512i c1 =
                SEL(_mm512_srli_epi16(z0, 4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), m0f);
            const __m512i c2 = SEL(z1, _mm512_and_si512(h, m30), m0f);
            const __m512i c3 =
                SEL(_mm512_srli_epi16(z1, 4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), m0f);
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const void *)(wb + 16 * SH_CPU_PACK_Q6K_UNIT + 16 * s))));
            for (int i = 0; i < nt; i++) {
                const int8_t *aq = ab[i * nb].qs + 16 * s;
                __m512i d = _mm512_set1_epi32(off[i][s]);
                d = _mm512_dpbusd_epi32(d, c0, bcast4(aq));
                d = _mm512_dpbusd_epi32(d, c1, bcast4(aq + 4));
                d = _mm512_dpbusd_epi32(d, c2, bcast4(aq + 8));
                d = _mm512_dpbusd_epi32(d, c3, bcast4(aq + 12));
                ssum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, ssum[i]);
            }
        }
        if (nt == 1 && b % 2 == 0) /* the d: 64 bytes per two super-blocks */
            _mm_prefetch((const char *)(wd + b * 32) + 128, _MM_HINT_T1);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(wd + b * 32)));
        for (int i = 0; i < nt; i++)
            _mm512_store_ps(acc[i], _mm512_fmadd_ps(ssum[i],
                                                    _mm512_mul_ps(dw, _mm512_set1_ps(ab[i * nb].d)),
                                                    _mm512_load_ps(acc[i])));
    }
    const int64_t lo = r0 > 16 * g ? r0 - 16 * g : 0, hi = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
    const __mmask16 k = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    for (int i = 0; i < nt; i++) {
        float *y = m->y + (t0 + i) * m->ldy + 16 * g;
        __m512 v = _mm512_load_ps(acc[i]);
        if (m->accumulate)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, y));
        _mm512_mask_storeu_ps(y, k, v);
    }
}

/* Token blocks outermost, then row groups, then token tiles: a group's packed super-blocks stay
 * in L1/L2 while the block's tiles pass over them, and the block's activations stay in L2 across
 * the groups (as the other packed kernels do). */
TGT void sh__cpu_avx512_mmp_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
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
