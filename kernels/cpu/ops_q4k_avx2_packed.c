/* AVX2 matmul kernel on packed Q4_K weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h,
 * the copy the AVX-512 kernel reads): a 256-bit register holds 8 of a group's 16 rows (half h is
 * bytes 32h .. 32h + 31 of each 64-byte vector of the super-block), vpmaddubsw pair sums against a
 * broadcast 4-byte slice of the token's Q8_K codes, one vpmaddwd per sub-block that widens them
 * and applies the 6-bit scale, the minimums from the Q8_K block sums; prefill through k4_sweep
 * (avx2_k4.h: each half super-block unpacked once into L1 for a block of tokens, tiles of K4_NT),
 * and a decode matvec that walks several row groups side by side with software prefetch (as
 * ops_avx2_packed.c does for Q4_0 / Q4_1). */
#include <string.h>

#include "kernels/cpu/avx2_k4.h"
#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens sb_half takes at once: the matvec passes one (the multi-token path is k4_sweep in
 * avx2_k4.h, whose tiles read codes unpacked once per half super-block). */
#ifndef NT
#define NT 1
#endif
/* The decode matvec walks MV_STREAMS row groups side by side (as ops_avx2_packed.c) and
 * prefetches each line it will read MV_PF_DIST bytes ahead into L2. Measured on the kernel alone
 * (1 thread, 80 copies of a 5632 x 2048 weight, 520 MB, variants and the file-layout matvec
 * alternated in one process, best of 6-8 sweeps, shared 2-vCPU Sapphire Rapids VM whose load
 * varied 2x between runs), as a fraction of the file layout's rate in the same run: 4 streams
 * with T0 prefetches 1 KiB ahead (the Q4_0 kernel's) 0.75-0.88, 4 KiB ahead 0.86-0.90; T1 (to L2)
 * 8 KiB ahead 0.88-1.07; at T1 8 KiB, 8 streams 0.91-0.98, 1 stream 1.0-1.2, 2 streams 0.93-1.44
 * (4 runs: 1.29, 1.44, 0.97, 1.02, where 1 stream had 1.01, 1.10, 1.04, 1.02). In cache (one
 * 2048 x 2048 copy) the packed matvec is 1.35-1.45x the file layout's. */
#ifndef MV_STREAMS
#define MV_STREAMS 2
#endif
#ifndef MV_PF_DIST
#define MV_PF_DIST 8192
#endif
#ifndef MV_PF_HINT
#define MV_PF_HINT _MM_HINT_T1
#endif
/* Activation bytes of a token block: its Q8_K rows stay in L2 while every row group passes. */
#define TOK_BLOCK_BYTES (1 << 20)

INL __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One super-block (at pb) of half h against tokens ab[0 .. nt - 1] (their Q8_K blocks), added to
 * acc[i]. Per row and token (q the 4-bit codes, a the Q8_K codes with scale da and 16-element
 * sums bsums):
 *   isum = sum_j sc_j sum_{i in j} q_i a_i        (int32, exact)
 *   msum = sum_j m_j (bsums_2j + bsums_2j+1)      (int32, exact)
 *   acc += float(isum) * (d da);  acc -= float(msum) * (dmin da).
 * A sub-block's 16-bit sums add 8 vpmaddubsw pairs, each at most 2 * 15 * 128 in magnitude, so at
 * most 30720: no saturation. isum < 8 * 63 * 32 * 15 * 128 < 2^25 and |msum| < 2^21. The float
 * steps are the same for a token alone and in any tile, and the integers are exact in any order,
 * so a token's output does not depend on its tile, the row split or the matvec.
 * With pf set (the matvec, half 0), the line MV_PF_DIST bytes past each code line and past the
 * header line of a sub-block pair is prefetched as the pair's low sub-block reads it (each line
 * of the super-block once). */
INL void sb_half(const uint8_t *pb, const int h, const sh_block_q8_k *const *ab, const int nt,
                 __m256 *acc, const int pf)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    q4k_half s;
    decode_half(pb, h, &s);
    __m256i ia[NT];
    for (int i = 0; i < nt; i++) {
        ia[i] = _mm256_setzero_si256();
    }
    /* unrolled so that j's parity and the scale index are constants */
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const uint8_t *pv = pb + SH_CPU_PACK_Q4K_CODES + 512 * (j / 2) + 32 * h;
        if (pf && j % 2 == 0)
            _mm_prefetch((const char *)pb + 64 * (j / 2) + MV_PF_DIST, MV_PF_HINT);
        __m256i s16[NT];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            if (pf && j % 2 == 0)
                _mm_prefetch((const char *)pv + 64 * v + MV_PF_DIST, MV_PF_HINT);
            const __m256i x = _mm256_loadu_si256((const void *)(pv + 64 * v));
            const __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(x, 4) : x, m4);
            for (int i = 0; i < nt; i++) {
                const __m256i p = _mm256_maddubs_epi16(q, bcast4(ab[i]->qs + 32 * j + 4 * v));
                if (v)
                    ADD16(s16[i], p);
                else
                    s16[i] = p;
            }
        }
        for (int i = 0; i < nt; i++) {
            ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(s16[i], s.sc[j]));
            PIN(ia[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        const int16_t *bs = ab[i]->bsums;
        __m256i ms0 = _mm256_madd_epi16(s.mp[0], bcast4(bs));
        __m256i ms1 = _mm256_madd_epi16(s.mp[1], bcast4(bs + 2));
        for (int k = 2; k < 8; k += 2) {
            ms0 = _mm256_add_epi32(ms0, _mm256_madd_epi16(s.mp[k], bcast4(bs + 2 * k)));
            ms1 = _mm256_add_epi32(ms1, _mm256_madd_epi16(s.mp[k + 1], bcast4(bs + 2 * k + 2)));
        }
        const __m256 da = _mm256_set1_ps(ab[i]->d);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_mul_ps(s.d, da), acc[i]);
        acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ms0, ms1)),
                                  _mm256_mul_ps(s.dmin, da), acc[i]);
    }
}

/* Half h of the super-block at pb as k4_tile's code vectors: sub-block 2k in the low nibbles of
 * code vectors 8k .. 8k + 7, 2k + 1 in their high nibbles. */
INL void unpack_half(const uint8_t *pb, int h, __m256i *q)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < 8; v++) {
            const __m256i x = _mm256_loadu_si256(
                (const void *)(pb + SH_CPU_PACK_Q4K_CODES + 512 * k + 64 * v + 32 * h));
            _mm256_store_si256(q + 16 * k + v, _mm256_and_si256(x, m4));
            _mm256_store_si256(q + 16 * k + 8 + v, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
        }
}

/* One token, groups g0 + k step (k < ns) side by side, super-block by super-block, both halves;
 * each (row, token) sees k4_tile's operations in k4_tile's order. */
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
                m->w + (size_t)(g0 + k * step) * m->row_bytes + (size_t)b * SH_CPU_PACK_Q4K_BYTES;
            sb_half(pb, 0, &ab, 1, &acc[k][0], 1);
            sb_half(pb, 1, &ab, 1, &acc[k][1], 0);
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

INL void matvec(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1);
}

/* A matvec as above; otherwise k4_sweep: token blocks of up to 256 tokens outermost, then row
 * groups and halves, then super-blocks, each half super-block unpacked once for the block's
 * tokens, in tiles of K4_NT. */
TGT void sh__cpu_avx2_mmp_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        matvec(m, r0, r1);
        return;
    }
    k4_sweep(m, r0, r1, SH_CPU_PACK_Q4K_BYTES, 8, TOK_BLOCK_BYTES, unpack_half);
}

#else
typedef int sh__cpu_q4k_avx2_packed_unused; /* not x86-64: the table never names the kernel */
#endif
