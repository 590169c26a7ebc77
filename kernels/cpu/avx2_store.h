/* The one output step the AVX2 packed kernels share (ops_avx2_packed.c, ops_q4k_avx2_packed.c,
 * ops_q6k_avx2_packed.c): a YMM register holds 8 rows of a 16-row group, half h. */
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

#endif
