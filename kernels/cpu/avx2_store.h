/* What the AVX2 packed kernels share (ops_avx2_packed.c, ops_q4k_avx2_packed.c,
 * ops_q6k_avx2_packed.c): the output step (a YMM register holds 8 rows of a 16-row group, half h)
 * and the one-token matvec's walk over the row groups. */
#ifndef SH_KERNELS_CPU_AVX2_STORE_H
#define SH_KERNELS_CPU_AVX2_STORE_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "kernels/cpu/cpu.h"

/* Stores v (or, with m->accumulate, adds it) as token t's rows 16g + 8h + r (r < 8), only those
 * inside [r0, r1): the others, padding rows of the last group included, are not touched. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void
sh__avx2_store_half(const sh__cpu_mm *m, int64_t g, int h, int64_t r0, int64_t r1, int64_t t,
                    __m256 v)
{
    const int64_t base = 16 * g + 8 * h;
    float *y = m->y + t * m->ldy + base;
    if (base >= r0 && base + 8 <= r1) {
        /* all 8 rows inside: plain loads and stores (the masked store is slow on AMD Zen 3, and
         * the lane mask below goes through the stack: 7.7% of the Q6_K tile's perf samples) */
        if (m->accumulate)
            v = _mm256_add_ps(v, _mm256_loadu_ps(y));
        _mm256_storeu_ps(y, v);
        return;
    }
    int32_t lanes[8];
    for (int r = 0; r < 8; r++)
        lanes[r] = base + r >= r0 && base + r < r1 ? -1 : 0;
    const __m256i k = _mm256_loadu_si256((const void *)lanes);
    if (m->accumulate)
        v = _mm256_add_ps(v, _mm256_maskload_ps(y, k));
    _mm256_maskstore_ps(y, k, v);
}
#endif

/* s += p in 32-bit lanes, as one vpaddd at this point of the program. GCC (12) otherwise
 * reassociates a token's integer sums: it computes every product of a block or sub-block first,
 * spilling each to the stack and reloading it for a tree of additions (a store and a load per
 * product; callgrind on the IQ4_XS tile: 7.6 instructions per token and 32-byte step, against
 * 6.1 with this). */
#define SH_AVX2_ADD32(s, p) __asm__("vpaddd %1, %0, %0" : "+x"(s) : "x"(p))
/* The same for 16-bit lanes. */
#define SH_AVX2_ADD16(s, p) __asm__("vpaddw %1, %0, %0" : "+x"(s) : "x"(p))

/* The one-token matvec over the row groups of [r0, r1): `streams` runs of groups walked side by
 * side (mv(m, first group, the stride between the runs, streams, r0, r1, ...): several
 * independent reads keep more memory requests in flight than one), then the groups left over one
 * by one. Extra arguments after r1 go to mv. */
#define SH_AVX2_MATVEC(mv, streams, m, r0, r1, ...)                                                \
    do {                                                                                           \
        const int64_t g0_ = (r0) / 16, g1_ = ((r1) + 15) / 16, part_ = (g1_ - g0_) / (streams);    \
        for (int64_t i_ = 0; i_ < part_; i_++)                                                     \
            mv(m, g0_ + i_, part_, streams, r0, r1, ##__VA_ARGS__);                                \
        for (int64_t g_ = g0_ + (streams)*part_; g_ < g1_; g_++)                                   \
            mv(m, g_, 0, 1, r0, r1, ##__VA_ARGS__);                                                \
    } while (0)

/* The multi-token walk of the IQ4_XS kernel (16-row K-quant layout; 256-element Q8_K
 * activation rows of tok_bytes each): token blocks of about block_bytes of activations outermost
 * (they stay in L2), then the row groups of [r0, r1) and their two 8-row halves (a group's packed
 * super-blocks stay in L1/L2 while the block's tiles pass over them), then tiles of nt tokens and
 * one tail tile. tile(m, group, half, r0, r1, first token, n) takes n as a compile-time constant:
 * each tail size is its own case (a size of nt or more never occurs there and names 1). */
#define SH_AVX2_TILE_SWEEP(tile, nt, block_bytes, tok_bytes, m, r0, r1)                            \
    do {                                                                                           \
        const int64_t n_tok_ = (m)->a->n_tok;                                                      \
        int64_t tb_ = (block_bytes) / (tok_bytes) / (nt) * (nt);                                   \
        tb_ = tb_ < (nt) ? (nt) : tb_;                                                             \
        for (int64_t t0_ = 0; t0_ < n_tok_; t0_ += tb_) {                                          \
            const int64_t t1_ = t0_ + tb_ < n_tok_ ? t0_ + tb_ : n_tok_;                           \
            for (int64_t g_ = (r0) / 16; g_ * 16 < (r1); g_++)                                     \
                for (int h_ = 0; h_ < 2; h_++) {                                                   \
                    if (16 * g_ + 8 * h_ >= (r1) || 16 * g_ + 8 * h_ + 8 <= (r0))                  \
                        continue;                                                                  \
                    int64_t t_ = t0_;                                                              \
                    for (; t_ + (nt) <= t1_; t_ += (nt))                                           \
                        tile(m, g_, h_, r0, r1, t_, nt);                                           \
                    switch (t1_ - t_) {                                                            \
                    case 7:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 7 < (nt) ? 7 : 1);                             \
                        break;                                                                     \
                    case 6:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 6 < (nt) ? 6 : 1);                             \
                        break;                                                                     \
                    case 5:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 5 < (nt) ? 5 : 1);                             \
                        break;                                                                     \
                    case 4:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 4 < (nt) ? 4 : 1);                             \
                        break;                                                                     \
                    case 3:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 3 < (nt) ? 3 : 1);                             \
                        break;                                                                     \
                    case 2:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 2 < (nt) ? 2 : 1);                             \
                        break;                                                                     \
                    case 1:                                                                        \
                        tile(m, g_, h_, r0, r1, t_, 1);                                            \
                        break;                                                                     \
                    default:                                                                       \
                        break;                                                                     \
                    }                                                                              \
                }                                                                                  \
        }                                                                                          \
    } while (0)

#endif
