/* The AVX-512 instantiation of the tiled online-softmax attention (attn_tiled.h): 16 lanes per
 * vector, so an item's 16 (row, head) pairs are one register; and the item table every ISA's
 * attention shares. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* exp(x) for x <= 0 (scores minus their maximum), as in ops_avx512.c: x = n ln2 + f, e^f by its
 * degree-6 Taylor polynomial, scaled by 2^n; arguments below -87 (-inf included) give 0. */
INL __m512 exp_neg(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    /* below e^-87 the result would be subnormal: return 0 there instead (subnormal operands
     * cost a microcode assist per instruction on x86, and such terms are below rounding anyway) */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ),
                               _mm512_scalef_ps(p, n));
}

INL __m512 mask_keys(__m512 s, __m512i lo, __m512i hi, int64_t t)
{
    const __m512i tv = _mm512_set1_epi32((int)t);
    const __mmask16 out = _mm512_cmpgt_epi32_mask(lo, tv) | _mm512_cmpgt_epi32_mask(tv, hi);
    return _mm512_mask_mov_ps(s, out, _mm512_set1_ps(-INFINITY));
}

INL __m512 ninf_to_zero(__m512 x)
{
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_ps());
}

INL void widen(float *dst, const uint16_t *src, int32_t n)
{
    for (int32_t d = 0; d < n; d += 16) {
        const __mmask16 k = n - d >= 16 ? 0xffff : (__mmask16)((1u << (n - d)) - 1);
        _mm512_mask_storeu_ps(
            dst + d, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const void *)(src + d))));
    }
}

#define ATT_FN sh__cpu_avx512_attn_range
#define ATT_TGT TGT
#define VL 16
#define ATT_LP 4
#define ATT_NV 4
#define vec __m512
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VEXPN(x) exp_neg(x)
#define VNINF0(x) ninf_to_zero(x)
#define ivec __m512i
#define VILOAD(p) _mm512_loadu_si512((const void *)(p))
#define VMASK(s, lo, hi, t) mask_keys((s), (lo), (hi), (t))
#define WIDEN(dst, src, n) widen((dst), (src), (n))
#include "kernels/cpu/attn_tiled.h"

#endif

/* Items: per sequence and KV head, rows in runs of 16 / group (so that rows x heads fill the
 * 16 lanes), all the group's heads; a group wider than 16 heads is cut into runs of 16 heads of
 * single rows. Decode rows (one per sequence) become single-row items. */
int64_t sh__cpu_attn_max_items(int64_t n_rows, int32_t n_seqs, int32_t n_heads)
{
    return (n_rows + n_seqs) * ((int64_t)n_heads + SH_CPU_ATTN_LANES - 1);
}

int64_t sh__cpu_attn_items(const sh_attn_seq *seqs, int32_t n_seqs, int32_t n_heads,
                           int32_t n_kv_heads, int32_t *items)
{
    const int32_t group = n_heads / n_kv_heads;
    const int32_t rows_per = group >= SH_CPU_ATTN_LANES ? 1 : SH_CPU_ATTN_LANES / group;
    const int32_t heads_per = group >= SH_CPU_ATTN_LANES ? SH_CPU_ATTN_LANES : group;
    int64_t n = 0;
    int32_t row0 = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        for (int32_t r = 0; r < seqs[s].n_rows; r += rows_per) {
            const int32_t nr = seqs[s].n_rows - r < rows_per ? seqs[s].n_rows - r : rows_per;
            for (int32_t kh = 0; kh < n_kv_heads; kh++)
                for (int32_t h = 0; h < group; h += heads_per, n++) {
                    items[4 * n] = row0 + r;
                    items[4 * n + 1] = nr;
                    items[4 * n + 2] = kh * group + h;
                    items[4 * n + 3] = group - h < heads_per ? group - h : heads_per;
                }
        }
        row0 += seqs[s].n_rows;
    }
    return n;
}
