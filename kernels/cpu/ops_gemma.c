/* Elementwise ops of the Gemma forward pass on the CPU: the GELU-gated FFN activation (GEGLU) with
 * AVX2 / AVX-512 paths, the scale op and logit soft-capping. */
#include <math.h>

#include "kernels/cpu/cpu.h"

/* gelu(g) with the tanh approximation, written as g * sigmoid(2z) (0.5 (1 + tanh z) equals
 * 1 / (1 + exp(-2z))): one exponential, and no cancellation in 1 + tanh(z) for very negative z,
 * where the tanh form loses most of its digits. z = sqrt(2/pi) (g + 0.044715 g^3), so
 * 2z = g (C1 + C3 g^2). */
#define GELU_C1 1.5957691216057308f /* 2 sqrt(2/pi) */
#define GELU_C3 0.0713548162726009f /* 2 sqrt(2/pi) 0.044715 */

float sh__cpu_gelu(float g) { return g / (1.0f + expf(-g * (GELU_C1 + GELU_C3 * g * g))); }

void sh__cpu_geglu_ref(const float *g, const float *u, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = sh__cpu_gelu(g[i]) * u[i];
}

void sh__cpu_scale_range(const float *x, float s, float *y, int64_t i0, int64_t i1)
{
    for (int64_t i = i0; i < i1; i++)
        y[i] = s * x[i];
}

void sh__cpu_softcap_range(const float *x, float cap, float *y, int64_t i0, int64_t i1)
{
    const float inv = 1.0f / cap;
    for (int64_t i = i0; i < i1; i++)
        y[i] = cap * tanhf(x[i] * inv);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* exp(x) after Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts so that
 * r is exact), exp(r) by a degree-5 polynomial (relative error a few 1e-8), times 2^n made in the
 * exponent bits. x is clamped to [-87, 88] so that 2^n stays a normal float; exp(-87) = 1.6e-38
 * is already far below what 1 + e can hold, the only use here. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f

#define TGT2 __attribute__((target("avx2,fma")))
#define TGT512 __attribute__((target("avx512f")))

TGT2 static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

TGT512 static inline __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

TGT2 static void geglu_avx2(const float *g, const float *u, float *y, int64_t n)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 vg = _mm256_loadu_ps(g + i);
        __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(vg, vg), _mm256_set1_ps(GELU_C3),
                                   _mm256_set1_ps(GELU_C1));
        __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), vg), t));
        __m256 gel = _mm256_div_ps(vg, _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(gel, _mm256_loadu_ps(u + i)));
    }
    sh__cpu_geglu_ref(g + i, u + i, y + i, n - i);
}

TGT512 static void geglu_avx512(const float *g, const float *u, float *y, int64_t n)
{
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 vg = _mm512_loadu_ps(g + i);
        __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(vg, vg), _mm512_set1_ps(GELU_C3),
                                   _mm512_set1_ps(GELU_C1));
        __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), vg), t));
        __m512 gel = _mm512_div_ps(vg, _mm512_add_ps(one, e));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(gel, _mm512_loadu_ps(u + i)));
    }
    if (i < n) { /* the tail as one masked vector, so short rows use the same arithmetic */
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 vg = _mm512_maskz_loadu_ps(k, g + i);
        __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(vg, vg), _mm512_set1_ps(GELU_C3),
                                   _mm512_set1_ps(GELU_C1));
        __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), vg), t));
        __m512 gel = _mm512_div_ps(vg, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(gel, _mm512_maskz_loadu_ps(k, u + i)));
    }
}
#endif

sh__cpu_glu_fn sh__cpu_geglu_for(int32_t isa)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == SH_BACKEND_CPU_ISA_AVX512)
        return geglu_avx512;
    if (isa == SH_BACKEND_CPU_ISA_AVX2)
        return geglu_avx2;
#endif
    (void)isa;
    return sh__cpu_geglu_ref;
}
