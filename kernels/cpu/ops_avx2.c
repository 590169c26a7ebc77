/* AVX2 + FMA + F16C kernels of the CPU backend (for CPUs without AVX-512 VNNI): activation
 * quantization, the matmul row kernels and the float helpers, per-function target attributes. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/avx2_exp.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

#define TOK_TILE 4
#define ROW_GROUP 8

INL float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INL int hsum8i(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

INL float hmax8(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Same float operations as the reference, so the codes match it exactly. */
TGT static void quant_act(const float *x, int64_t n, int8_t *qs, float *d, float *s)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / SH_CPU_QK; b++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        float db = hmax8(mx) / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        /* int32 -> int8 with the lane shuffles packs introduce undone by the permute */
        __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qs + b * 32), p);
        d[b] = db;
        s[b] = db * (float)hsum8i(sum);
    }
}

static void store_out(const sh__cpu_mm *m, int64_t t, int64_t r, float v)
{
    float *y = m->y + t * m->ldy + r;
    *y = m->accumulate ? *y + v : v;
}

/* u8 x s8 dot of 32 codes into 8 int32 lanes (pairs can reach 2 * 255 * 127, below the int16
 * saturation only because one side is a nibble or |q8| <= 128 against |a| <= 127). */
INL __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* The 32 fifth bits of a Q5 block (qh, little-endian) as bytes 0x10 or 0 in element order. */
INL __m256i q5_high(const uint8_t *qh)
{
    uint32_t h;
    memcpy(&h, qh, 4);
    /* byte i of the result takes byte i / 8 of h, then tests bit i % 8 of it */
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                         2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                            _mm256_set1_epi8(0x10));
}

/* The IQ4 grid (SH_IQ4_VALUES) in both 128-bit lanes, for a vpshufb lookup of 4-bit codes. */
INL __m256i iq4_grid(void)
{
    const __m128i g = _mm_loadu_si128((const void *)SH_IQ4_VALUES);
    return _mm256_set_m128i(g, g);
}

/* KIND: 0 = Q4_0, 1 = Q4_1, 2 = Q8_0, 3 = Q5_0, 4 = Q5_1, 5 = IQ4_NL (Q4_0's nibbles looked up in
 * the grid, then Q8_0's signed path). One weight row against nt tokens. */
INL void q_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / 32;
    const size_t bsz = kind == 0   ? sizeof(sh_block_q4_0)
                       : kind == 1 ? sizeof(sh_block_q4_1)
                       : kind == 2 ? sizeof(sh_block_q8_0)
                       : kind == 3 ? sizeof(sh_block_q5_0)
                       : kind == 4 ? sizeof(sh_block_q5_1)
                                   : sizeof(sh_block_iq4_nl);
    const int sgn = kind == 2 || kind == 5; /* signed codes: |w| against a * sign(w) */
    /* Offsets of the min (Q4_1/Q5_1), the fifth bits (Q5) and the codes in a block. */
    const int has_m = kind == 1 || kind == 4;
    const size_t hoff = kind == 3 ? 2 : 4, qoff = kind == 3 ? 6 : kind == 4 ? 8 : has_m ? 4 : 2;
    const uint8_t *w = m->w + r * m->row_bytes;
    __m256 acc[TOK_TILE];
    float accs[TOK_TILE] = {0};
    for (int i = 0; i < nt; i++)
        acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * bsz;
        if (nt == 1 && m->a->n_tok == 1) /* a matvec: the line SH_CPU_K_PF_DIST ahead, into L2 */
            _mm_prefetch((const char *)wb + SH_CPU_K_PF_DIST, _MM_HINT_T1);
        uint16_t dh, mh = 0;
        memcpy(&dh, wb, 2);
        if (has_m)
            memcpy(&mh, wb + 2, 2);
        const float dw = _cvtsh_ss(dh), mw = has_m ? _cvtsh_ss(mh) : dw;
        __m256i wq, wsign = _mm256_setzero_si256();
        if (kind == 2) {
            wsign = _mm256_loadu_si256((const void *)(wb + 2));
            wq = _mm256_sign_epi8(wsign, wsign); /* |w| */
        } else {
            const __m128i v = _mm_loadu_si128((const void *)(wb + qoff));
            wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
            if (kind == 3 || kind == 4)
                wq = _mm256_or_si256(wq, q5_high(wb + hoff));
            if (kind == 5) {
                wsign = _mm256_shuffle_epi8(iq4_grid(), wq);
                wq = _mm256_sign_epi8(wsign, wsign);
            }
        }
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            __m256i aq = _mm256_loadu_si256((const void *)(a->qs + t * a->n_in + b * 32));
            if (sgn)
                aq = _mm256_sign_epi8(aq, wsign); /* a * sign(w), so |w| * that = w * a */
            const __m256 dotf = _mm256_cvtepi32_ps(dot_u8s8(wq, aq));
            acc[i] = _mm256_fmadd_ps(dotf, _mm256_set1_ps(dw * a->d[t * nb + b]), acc[i]);
            if (!sgn)
                accs[i] += mw * a->s[t * nb + b];
        }
    }
    /* Q4_0/Q5_0: sum dw (da dot - 8 s) / (da dot - 16 s); Q4_1/Q5_1: sum dw da dot + m s;
     * Q8_0, IQ4_NL: sum dw da dot */
    const float c = kind == 0 ? -8.0f : kind == 3 ? -16.0f : has_m ? 1.0f : 0.0f;
    for (int i = 0; i < nt; i++)
        store_out(m, t0 + i, r, hsum8(acc[i]) + c * accs[i]);
}

INL __m256 load_w(const uint8_t *w, int64_t k, const int kind)
{
    if (kind == 0)
        return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const void *)((const uint16_t *)w + k));
    if (kind == 1)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INL void fp_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t n = a->n_in;
    const uint8_t *w = m->w + r * m->row_bytes;
    __m256 acc[TOK_TILE], acc2[TOK_TILE];
    for (int i = 0; i < nt; i++)
        acc[i] = acc2[i] = _mm256_setzero_ps();
    const int64_t n16 = n / 16 * 16;
    for (int64_t k = 0; k < n16; k += 16) {
        const __m256 w0 = load_w(w, k, kind), w1 = load_w(w, k + 8, kind);
        for (int i = 0; i < nt; i++) {
            const float *x = a->x + (t0 + i) * n + k;
            acc[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[i]);
            acc2[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc2[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        const float *x = a->x + (t0 + i) * n;
        float v = hsum8(_mm256_add_ps(acc[i], acc2[i]));
        for (int64_t k = n16; k < n; k++)
            v += sh__cpu_wf32(w, k, kind) * x[k];
        store_out(m, t0 + i, r, v);
    }
}

#define DEFINE_MM(name, TILE, K)                                                                   \
    TGT static void name(const sh__cpu_mm *m, int64_t r0, int64_t r1)                              \
    {                                                                                              \
        const int64_t nt = m->a->n_tok;                                                            \
        for (int64_t g = r0; g < r1; g += ROW_GROUP) {                                             \
            const int64_t g1 = g + ROW_GROUP < r1 ? g + ROW_GROUP : r1;                            \
            int64_t t = 0;                                                                         \
            for (; t + TOK_TILE <= nt; t += TOK_TILE)                                              \
                for (int64_t r = g; r < g1; r++)                                                   \
                    TILE(m, r, t, TOK_TILE, K);                                                    \
            for (int64_t r = g; r < g1; r++)                                                       \
                switch (nt - t) {                                                                  \
                case 3:                                                                            \
                    TILE(m, r, t, 3, K);                                                           \
                    break;                                                                         \
                case 2:                                                                            \
                    TILE(m, r, t, 2, K);                                                           \
                    break;                                                                         \
                case 1:                                                                            \
                    TILE(m, r, t, 1, K);                                                           \
                    break;                                                                         \
                default:                                                                           \
                    break;                                                                         \
                }                                                                                  \
        }                                                                                          \
    }

DEFINE_MM(mm_q4_0, q_tile, 0)
DEFINE_MM(mm_q4_1, q_tile, 1)
DEFINE_MM(mm_q8_0, q_tile, 2)
DEFINE_MM(mm_q5_0, q_tile, 3)
DEFINE_MM(mm_q5_1, q_tile, 4)
DEFINE_MM(mm_iq4_nl, q_tile, 5)
DEFINE_MM(mm_f32, fp_tile, 0)
DEFINE_MM(mm_f16, fp_tile, 1)
DEFINE_MM(mm_bf16, fp_tile, 2)

TGT static float dot(const float *a, const float *b, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

TGT static void axpy(float s, const float *x, float *y, int64_t n)
{
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += s * x[i];
}

TGT static float sumsq(const float *x, int64_t n) { return dot(x, x, n); }

/* silu(g) u = g u / (1 + e^-g), as the AVX-512 path computes it: e^-g with -g clamped to [-100,
 * 100] first and taken as +inf past 88 (so g < -88 gives g / inf = -0, as the float formula does
 * when expf overflows); a NaN g stays NaN through the quotient. The tail goes through 8-lane
 * copies, so every element sees the same operations. */
INL __m256 swiglu8(__m256 gv, __m256 uv)
{
    const __m256 x = _mm256_min_ps(
        _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(-100.0f)),
        _mm256_set1_ps(100.0f));
    const __m256 e = _mm256_blendv_ps(sh__avx2_exp(x), _mm256_set1_ps(INFINITY),
                                      _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), uv);
}

TGT static void swiglu(const float *g, const float *u, float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, yt[8];
        memcpy(gt, g + i, (size_t)(n - i) * sizeof *gt);
        memcpy(ut, u + i, (size_t)(n - i) * sizeof *ut);
        _mm256_storeu_ps(yt, swiglu8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(y + i, yt, (size_t)(n - i) * sizeof *yt);
    }
}

const sh__cpu_kernels sh__cpu_kernels_avx2 = {
    .isa = SH_BACKEND_CPU_ISA_AVX2,
    .quant_act = quant_act,
    .mm_f32 = mm_f32,
    .mm_f16 = mm_f16,
    .mm_bf16 = mm_bf16,
    .mm_q8_0 = mm_q8_0,
    .mm_q4_0 = mm_q4_0,
    .mm_q4_1 = mm_q4_1,
    .mm_q5_0 = mm_q5_0,
    .mm_q5_1 = mm_q5_1,
    .mm_q2_k = sh__cpu_mm_avx2_q2_k,
    .mm_q3_k = sh__cpu_mm_avx2_q3_k,
    .mm_q4_k = sh__cpu_mm_avx2_q4_k,
    .mm_q5_k = sh__cpu_mm_avx2_q5_k,
    .mm_q6_k = sh__cpu_mm_avx2_q6_k,
    .mm_iq4_nl = mm_iq4_nl,
    .mm_iq4_xs = sh__cpu_mm_avx2_iq4_xs,
    .dot = dot,
    .axpy = axpy,
    .sumsq = sumsq,
    .swiglu = swiglu,
    .attn_group = sh__cpu_avx2_attn_range,
    .mmp_q4_0 = sh__cpu_avx2_mmp_q4_0,
    .mmp_q4_1 = sh__cpu_avx2_mmp_q4_1,
    .mmp_q8_0 = sh__cpu_avx2_mmp_q8_0,
    .mmp_f16 = sh__cpu_avx2_mmp_f16,
    .mmp_q4_k = sh__cpu_avx2_mmp_q4_k,
    .mmp_q6_k = sh__cpu_avx2_mmp_q6_k,
    .mmp_q5_k = sh__cpu_avx2_mmp_q5_k,
    .mmp_iq4_nl = sh__cpu_avx2_mmp_iq4_nl,
    .mmp_iq4_xs = sh__cpu_avx2_mmp_iq4_xs,
};

#else
const sh__cpu_kernels sh__cpu_kernels_avx2 = {.isa = SH_BACKEND_CPU_ISA_SCALAR};
#endif
