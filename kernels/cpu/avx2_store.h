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
    int32_t lanes[8];
    for (int r = 0; r < 8; r++)
        lanes[r] = base + r >= r0 && base + r < r1 ? -1 : 0;
    const __m256i k = _mm256_loadu_si256((const void *)lanes);
    float *y = m->y + t * m->ldy + base;
    if (m->accumulate)
        v = _mm256_add_ps(v, _mm256_maskload_ps(y, k));
    _mm256_maskstore_ps(y, k, v);
}
#endif

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

#endif
