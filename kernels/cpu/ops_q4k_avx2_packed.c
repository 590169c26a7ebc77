/* AVX2 matmul kernel on packed Q4_K weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h,
 * the copy the AVX-512 kernel reads): a 256-bit register holds 8 of a group's 16 rows (half h is
 * bytes 32h .. 32h + 31 of each 64-byte vector of the super-block), vpmaddubsw pair sums against a
 * broadcast 4-byte slice of the token's Q8_K codes, one vpmaddwd per sub-block that widens them
 * and applies the 6-bit scale, the minimums from the Q8_K block sums; prefill through k4_sweep
 * (avx2_k4.h: each half super-block unpacked once into L1 for a block of tokens, tiles of K4_NT),
 * and a decode matvec that walks several row groups side by side. */
#include <string.h>

#include "kernels/cpu/avx2_k4.h"
#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* The decode matvec walks MV_STREAMS row groups side by side (as ops_avx2_packed.c), without
 * software prefetch, as the Q5_K kernel: on the 2-vCPU AVX2-only AMD EPYC (Zen 3), `bench_kernels
 * --only mv --layout packed --isa 2 --threads 1 --types Q4_K` (tinyllama's three shapes, weights
 * cycled from DRAM, GB/s; 2 rounds alternated, load 1.1) read 5.7-8.8 with the settings tuned on
 * Sapphire Rapids (2 streams, T1 prefetches 8 KiB ahead; there they had measured 0.88-1.44 of
 * the file layout's rate), 7.2-8.7 with those settings and each broadcast shared by both halves
 * (mv_groups), and 8.7-11.0 with 3 streams and no prefetch. */
#ifndef MV_STREAMS
#define MV_STREAMS 3
#endif
/* Activation bytes of a token block: its Q8_K rows stay in L2 while every row group passes. */
#define TOK_BLOCK_BYTES (1 << 20)

INL __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
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

/* One token, groups g0 + k step (k < ns) side by side, super-block by super-block, both halves of
 * each. Per sub-block j and 4-byte activation slice v, the broadcast slice is loaded once and
 * used by all 2 ns (group, half) code vectors, each with its own 16-bit and 32-bit sums (walking
 * the halves one after another instead kept 64 broadcasts per super-block for the next half,
 * spilled to the stack: 19% more instructions in callgrind). A sub-block's 16-bit sums add 8
 * vpmaddubsw pairs, each at most 2 * 15 * 128 in magnitude, so at most 30720: no saturation. The
 * integer sums are exact in any order and the float steps are the tiles' (k4_finish), so each
 * (row, token) gets the tiles' result, bit for bit (isum < 8 * 63 * 32 * 15 * 128 < 2^25 and
 * |msum| < 2^21). */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[MV_STREAMS][2];
    for (int k = 0; k < ns; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        const uint8_t *pb[MV_STREAMS];
        q4k_half s[MV_STREAMS][2];
        __m256i ia[MV_STREAMS][2];
        for (int k = 0; k < ns; k++) {
            pb[k] =
                m->w + (size_t)(g0 + k * step) * m->row_bytes + (size_t)b * SH_CPU_PACK_Q4K_BYTES;
            decode_half(pb[k], 0, &s[k][0]);
            decode_half(pb[k], 1, &s[k][1]);
            ia[k][0] = ia[k][1] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i s16[MV_STREAMS][2];
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                const __m256i a = bcast4(ab->qs + 32 * j + 4 * v);
                for (int k = 0; k < ns; k++) {
                    const uint8_t *pv = pb[k] + SH_CPU_PACK_Q4K_CODES + 512 * (j / 2) + 64 * v;
                    for (int h = 0; h < 2; h++) {
                        const __m256i x = _mm256_loadu_si256((const void *)(pv + 32 * h));
                        const __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(x, 4) : x, m4);
                        const __m256i p = _mm256_maddubs_epi16(q, a);
                        if (v)
                            ADD16(s16[k][h], p);
                        else
                            s16[k][h] = p;
                    }
                }
            }
            for (int k = 0; k < ns; k++)
                for (int h = 0; h < 2; h++) {
                    ia[k][h] =
                        _mm256_add_epi32(ia[k][h], _mm256_madd_epi16(s16[k][h], s[k][h].sc[j]));
                    PIN(ia[k][h]);
                }
        }
        for (int k = 0; k < ns; k++)
            for (int h = 0; h < 2; h++)
                acc[k][h] = k4_finish(&s[k][h], ab, ia[k][h], acc[k][h]);
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
