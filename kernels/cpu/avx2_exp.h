/* exp on 8 floats for the AVX2 kernels (the tiled attention's softmax in attn_avx2.c and SwiGLU in
 * ops_avx2.c): the AVX-512 path's exp512 (ops_avx512.c) in 8 lanes, so for arguments in
 * [-87, 88] both give the same bits. */
#ifndef SH_KERNELS_CPU_AVX2_EXP_H
#define SH_KERNELS_CPU_AVX2_EXP_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* exp(x) for x <= 88 (larger x, +inf and NaN are taken as 88, 88 and -100): x = n ln2 + f with n
 * = round(x / ln2) (ln2 in two parts, so f is exact to float rounding, |f| <= ln2 / 2), e^f by its
 * degree-6 Taylor polynomial (below 2e-7 relative), times 2^n built in the exponent field.
 * Arguments below -87 (-inf included) give 0, so 2^n is always a normal float (n <= 127). */
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 sh__avx2_exp(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-100.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), f);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
#endif

#endif
