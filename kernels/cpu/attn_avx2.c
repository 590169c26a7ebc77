/* The AVX2 instantiation of the tiled online-softmax attention (attn_tiled.h): 8 lanes per
 * vector, F16 cache rows widened with F16C, so an F16 KV cache costs no more than an F32 one. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/avx2_exp.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

INL __m256 mask_keys(__m256 s, __m256i lo, __m256i hi, int64_t t)
{
    const __m256i tv = _mm256_set1_epi32((int)t);
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(lo, tv), _mm256_cmpgt_epi32(tv, hi));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(out));
}

INL __m256 ninf_to_zero(__m256 x)
{
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), x);
}

INL void widen(float *dst, const uint16_t *src, int32_t n)
{
    int32_t d = 0;
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
    for (; d < n; d++) /* exact either way: every fp16 value is a float */
        dst[d] = sh__quant_f32_from_fp16(src[d]);
}

#define ATT_FN sh__cpu_avx2_attn_range
#define ATT_TGT TGT
#define VL 8
#define ATT_LP 2
#define ATT_NV 4
#define vec __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VEXPN(x) sh__avx2_exp(x)
#define VNINF0(x) ninf_to_zero(x)
#define ivec __m256i
#define VILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VMASK(s, lo, hi, t) mask_keys((s), (lo), (hi), (t))
#define WIDEN(dst, src, n) widen((dst), (src), (n))
#include "kernels/cpu/attn_tiled.h"

#endif
