/* AVX-512 (F/BW/VL + VNNI) kernels of the CPU backend: activation quantization, the matmul row
 * kernels and the float helpers. Compiled with per-function target attributes so the build needs
 * no -march flag; the backend picks this table only when cpuid reports the features. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tiling of a matmul: TOK_TILE tokens share each unpacked weight block pair; ROW_GROUP rows are
 * swept for one token tile so that the tile's activations stay in L1 across the rows. */
#define TOK_TILE 4
#define ROW_GROUP 8

INL float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Per 32-block: d = max|x| / 127 and q = round-to-nearest-even(x / d) like the reference (the
 * same float operations, so the codes match it exactly). */
TGT static void quant_act(const float *x, int64_t n, int8_t *qs, float *d, float *s)
{
    for (int64_t b = 0; b < n / SH_CPU_QK; b++) {
        __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
        __m512 m = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
        float amax = _mm512_reduce_max_ps(m);
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
        _mm_storeu_si128((__m128i *)(qs + b * 32), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
        d[b] = db;
        s[b] = db * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* Broadcasts the two floats of a pair (blocks b, b+1) to lanes 0-7 and 8-15: the lane order of a
 * dpbusd over two blocks laid out as below. */
INL __m512 pair_bcast(__m128 p)
{
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(p));
}

INL __m128 load_pair(const float *p) { return _mm_castsi128_ps(_mm_loadl_epi64((const void *)p)); }

/* Two fp16 scales -> pair_bcast layout. */
INL __m512 fp16_pair(uint16_t a, uint16_t b)
{
    return pair_bcast(_mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)a | (uint32_t)b << 16))));
}

/* Unpacks the nibbles of two Q4 blocks into 64 codes in element order: bytes 0-15 block b's
 * elements 0-15 (low nibbles), 16-31 its elements 16-31 (high nibbles), 32-63 block b+1. */
INL __m512i q4_pair(const uint8_t *qa, const uint8_t *qb)
{
    __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const void *)qa)),
                                        _mm_loadu_si128((const void *)qb), 1);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1);
    z = _mm512_and_si512(z, _mm512_set1_epi8(0x0f)); /* [b lo, b+1 lo, b hi, b+1 hi] */
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

static void store_out(const sh__cpu_mm *m, int64_t t, int64_t r, float v)
{
    float *y = m->y + t * m->ldy + r;
    *y = m->accumulate ? *y + v : v;
}

/* One weight row against NT tokens (t0..t0+NT-1). KIND: 0 = Q4_0, 1 = Q4_1, 2 = Q5_0, 3 = Q5_1.
 * A Q5 block's fifth bits are a 32-bit mask over its elements, so those of a block pair are one
 * 64-bit mask in the element order of q4_pair: a masked move adds the 16s. */
INL void q4_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / 32;
    const int has_m = kind == 1 || kind == 3, q5 = kind >= 2;
    const size_t bsz = kind == 0   ? sizeof(sh_block_q4_0)
                       : kind == 1 ? sizeof(sh_block_q4_1)
                       : kind == 2 ? sizeof(sh_block_q5_0)
                                   : sizeof(sh_block_q5_1);
    /* offsets of the fifth bits and of the codes */
    const size_t hoff = has_m ? 4 : 2, qoff = hoff + (q5 ? 4 : 0);
    const uint8_t *w = m->w + r * m->row_bytes;
    __m512 acc[TOK_TILE], accs[TOK_TILE];
    for (int i = 0; i < nt; i++)
        acc[i] = accs[i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *w0 = w + b * bsz, *w1 = w0 + bsz;
        uint16_t d0, d1, m0 = 0, m1 = 0;
        memcpy(&d0, w0, 2);
        memcpy(&d1, w1, 2);
        if (has_m) {
            memcpy(&m0, w0 + 2, 2);
            memcpy(&m1, w1 + 2, 2);
        }
        __m512i wq = q4_pair(w0 + qoff, w1 + qoff);
        if (q5) {
            uint32_t h0, h1;
            memcpy(&h0, w0 + hoff, 4);
            memcpy(&h1, w1 + hoff, 4);
            wq = _mm512_or_si512(wq, _mm512_maskz_mov_epi8((__mmask64)h0 | (__mmask64)h1 << 32,
                                                           _mm512_set1_epi8(16)));
        }
        const __m512 dw = fp16_pair(d0, d1);
        const __m512 mw = has_m ? fp16_pair(m0, m1) : dw;
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            const __m512i aq = _mm512_loadu_si512(a->qs + t * a->n_in + b * 32);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, aq);
            const __m512 sc = _mm512_mul_ps(dw, pair_bcast(load_pair(a->d + t * nb + b)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[i]);
            /* each block's s term lands in 8 lanes: the lane sum is 8 * (dw or m) * s */
            accs[i] = _mm512_fmadd_ps(mw, pair_bcast(load_pair(a->s + t * nb + b)), accs[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        const int64_t t = t0 + i;
        /* Q4_0/Q5_0: sum dw (da dot - 8 s) / (da dot - 16 s); Q4_1/Q5_1: sum dw da dot + m s
         * (see ops_ref.c) */
        float v = hsum(acc[i]) + (has_m ? hsum(accs[i]) * 0.125f : -hsum(accs[i]) * (q5 ? 2 : 1));
        for (int64_t bb = b; bb < nb; bb++) { /* odd block count: the last block, scalar */
            const uint8_t *wb = w + bb * bsz;
            uint16_t dh, mh = 0;
            memcpy(&dh, wb, 2);
            if (has_m)
                memcpy(&mh, wb + 2, 2);
            uint32_t qh = 0;
            if (q5)
                memcpy(&qh, wb + hoff, 4);
            const uint8_t *q = wb + qoff;
            const int8_t *aq = a->qs + t * a->n_in + bb * 32;
            int dot = 0;
            for (int k = 0; k < 16; k++)
                dot += (int)((q[k] & 15) | ((qh >> k) & 1) << 4) * aq[k] +
                       (int)((q[k] >> 4) | ((qh >> (k + 16)) & 1) << 4) * aq[k + 16];
            float dwf = _cvtsh_ss(dh);
            float da = a->d[t * nb + bb], sa = a->s[t * nb + bb];
            v += has_m ? dwf * da * (float)dot + _cvtsh_ss(mh) * sa
                       : dwf * (da * (float)dot - (q5 ? 16.0f : 8.0f) * sa);
        }
        store_out(m, t, r, v);
    }
}

/* Q8_0: u8 x s8 products via |w| and the activation negated where w < 0 (exact: codes are in
 * [-127, 127] for activations, and |-128| = 128 fits u8). */
INL void q8_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / 32;
    const sh_block_q8_0 *w = (const sh_block_q8_0 *)(m->w + r * m->row_bytes);
    __m512 acc[TOK_TILE];
    for (int i = 0; i < nt; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i wq =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)w[b].qs)),
                               _mm256_loadu_si256((const void *)w[b + 1].qs), 1);
        const __mmask64 neg = _mm512_movepi8_mask(wq);
        const __m512i wabs = _mm512_abs_epi8(wq);
        const __m512 dw = fp16_pair(w[b].d, w[b + 1].d);
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            __m512i aq = _mm512_loadu_si512(a->qs + t * a->n_in + b * 32);
            aq = _mm512_mask_sub_epi8(aq, neg, _mm512_setzero_si512(), aq);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, aq);
            const __m512 sc = _mm512_mul_ps(dw, pair_bcast(load_pair(a->d + t * nb + b)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        const int64_t t = t0 + i;
        float v = hsum(acc[i]);
        for (int64_t bb = b; bb < nb; bb++) {
            const int8_t *aq = a->qs + t * a->n_in + bb * 32;
            int dot = 0;
            for (int k = 0; k < 32; k++)
                dot += w[bb].qs[k] * aq[k];
            v += _cvtsh_ss(w[bb].d) * a->d[t * nb + bb] * (float)dot;
        }
        store_out(m, t, r, v);
    }
}

/* IQ4_NL: a block pair's nibbles (q4_pair's element order) looked up in the grid SH_IQ4_VALUES
 * with one vpshufb (the grid in each 128-bit lane), then Q8_0's path: |w| against the activation
 * negated where w < 0. */
INL void iq4nl_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / 32;
    const sh_block_iq4_nl *w = (const sh_block_iq4_nl *)(m->w + r * m->row_bytes);
    const __m512i grid = _mm512_broadcast_i32x4(_mm_loadu_si128((const void *)SH_IQ4_VALUES));
    __m512 acc[TOK_TILE];
    for (int i = 0; i < nt; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i wq = _mm512_shuffle_epi8(grid, q4_pair(w[b].qs, w[b + 1].qs));
        const __mmask64 neg = _mm512_movepi8_mask(wq);
        const __m512i wabs = _mm512_abs_epi8(wq);
        const __m512 dw = fp16_pair(w[b].d, w[b + 1].d);
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            __m512i aq = _mm512_loadu_si512(a->qs + t * a->n_in + b * 32);
            aq = _mm512_mask_sub_epi8(aq, neg, _mm512_setzero_si512(), aq);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, aq);
            const __m512 sc = _mm512_mul_ps(dw, pair_bcast(load_pair(a->d + t * nb + b)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        const int64_t t = t0 + i;
        float v = hsum(acc[i]);
        for (int64_t bb = b; bb < nb; bb++) { /* odd block count: the last block, scalar */
            const int8_t *aq = a->qs + t * a->n_in + bb * 32;
            int dot = 0;
            for (int k = 0; k < 16; k++)
                dot += SH_IQ4_VALUES[w[bb].qs[k] & 15] * aq[k] +
                       SH_IQ4_VALUES[w[bb].qs[k] >> 4] * aq[k + 16];
            v += _cvtsh_ss(w[bb].d) * a->d[t * nb + bb] * (float)dot;
        }
        store_out(m, t, r, v);
    }
}

/* Float weights: 16 elements per step, widened from the stored type. KIND: 0 f32, 1 f16, 2 bf16. */
INL __m512 load_w(const uint8_t *w, int64_t k, const int kind)
{
    if (kind == 0)
        return _mm512_loadu_ps((const float *)w + k);
    const __m256i h = _mm256_loadu_si256((const void *)((const uint16_t *)w + k));
    if (kind == 1)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Every (row, token) sum runs the same instructions whatever the tile's size: four chains over
 * 64-element steps, a fifth step of 16 into the first, then c0 + c1 + c2 + c3 and the scalar tail,
 * so that a token's result does not depend on the batch it is computed in (speculative
 * verification and batched decoding compare it with one-token steps). A tile loads each weight
 * vector once for its nt tokens. */
INL void fp_tile(const sh__cpu_mm *m, int64_t r, int64_t t0, const int nt, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t n = a->n_in;
    const uint8_t *w = m->w + r * m->row_bytes;
    __m512 c[TOK_TILE][4];
    for (int i = 0; i < nt; i++)
        c[i][0] = c[i][1] = c[i][2] = c[i][3] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= n; k += 64) {
        const __m512 w0 = load_w(w, k, kind), w1 = load_w(w, k + 16, kind),
                     w2 = load_w(w, k + 32, kind), w3 = load_w(w, k + 48, kind);
        for (int i = 0; i < nt; i++) {
            const float *x = a->x + (t0 + i) * n + k;
            c[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), c[i][0]);
            c[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), c[i][1]);
            c[i][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 32), c[i][2]);
            c[i][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x + 48), c[i][3]);
        }
    }
    for (; k + 16 <= n; k += 16) {
        const __m512 w0 = load_w(w, k, kind);
        for (int i = 0; i < nt; i++)
            c[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a->x + (t0 + i) * n + k), c[i][0]);
    }
    for (int i = 0; i < nt; i++) {
        const float *x = a->x + (t0 + i) * n;
        float v =
            hsum(_mm512_add_ps(_mm512_add_ps(c[i][0], c[i][1]), _mm512_add_ps(c[i][2], c[i][3])));
        for (int64_t j = k; j < n; j++)
            v += sh__cpu_wf32(w, j, kind) * x[j];
        store_out(m, t0 + i, r, v);
    }
}

/* The sweep shared by every type: row groups x token tiles x rows (see TOK_TILE/ROW_GROUP). */
#define DEFINE_MM(name, TILE, ...)                                                                 \
    TGT static void name(const sh__cpu_mm *m, int64_t r0, int64_t r1)                              \
    {                                                                                              \
        const int64_t nt = m->a->n_tok;                                                            \
        for (int64_t g = r0; g < r1; g += ROW_GROUP) {                                             \
            const int64_t g1 = g + ROW_GROUP < r1 ? g + ROW_GROUP : r1;                            \
            int64_t t = 0;                                                                         \
            for (; t + TOK_TILE <= nt; t += TOK_TILE)                                              \
                for (int64_t r = g; r < g1; r++)                                                   \
                    TILE(m, r, t, TOK_TILE, ##__VA_ARGS__);                                        \
            for (int64_t r = g; r < g1; r++)                                                       \
                switch (nt - t) {                                                                  \
                case 3:                                                                            \
                    TILE(m, r, t, 3, ##__VA_ARGS__);                                               \
                    break;                                                                         \
                case 2:                                                                            \
                    TILE(m, r, t, 2, ##__VA_ARGS__);                                               \
                    break;                                                                         \
                case 1:                                                                            \
                    TILE(m, r, t, 1, ##__VA_ARGS__);                                               \
                    break;                                                                         \
                default:                                                                           \
                    break;                                                                         \
                }                                                                                  \
        }                                                                                          \
    }

DEFINE_MM(mm_q4_0, q4_tile, 0)
DEFINE_MM(mm_q4_1, q4_tile, 1)
DEFINE_MM(mm_q5_0, q4_tile, 2)
DEFINE_MM(mm_q5_1, q4_tile, 3)
DEFINE_MM(mm_q8_0, q8_tile)
DEFINE_MM(mm_iq4_nl, iq4nl_tile)
DEFINE_MM(mm_f32, fp_tile, 0)
DEFINE_MM(mm_f16, fp_tile, 1)
DEFINE_MM(mm_bf16, fp_tile, 2)

TGT static float dot(const float *a, const float *b, int64_t n)
{
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        acc =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
    }
    return hsum(acc);
}

TGT static void axpy(float s, const float *x, float *y, int64_t n)
{
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i,
                         _mm512_fmadd_ps(vs, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(
            y + i, k,
            _mm512_fmadd_ps(vs, _mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
    }
}

TGT static float sumsq(const float *x, int64_t n) { return dot(x, x, n); }

/* exp(x) for x in [-100, 100] (0 below -87): x = n ln2 + f with n = round(x / ln2) and |f| <= ln2 /
 * 2 (ln2 in two parts so n ln2 is exact enough), e^f by its degree-6 Taylor polynomial (error below
 * 2e-7 relative on that interval), then scaled by 2^n with scalef, which gives inf / 0 past the
 * float range. */
INL __m512 exp512(__m512 x)
{
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

/* silu(g) u = g u / (1 + e^-g); e^-g is clamped to the exp512 range first (|g| > 100 gives
 * g / inf = 0 or g / 1 = g, as the float formula does; a NaN g stays NaN through the product). */
TGT static void swiglu(const float *g, const float *u, float *y, int64_t n)
{
    const __m512 lo = _mm512_set1_ps(-100.0f), hi = _mm512_set1_ps(100.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
        const __m512 e =
            exp512(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), lo), hi));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(s, uv));
    }
}

const sh__cpu_kernels sh__cpu_kernels_avx512 = {
    .isa = SH_BACKEND_CPU_ISA_AVX512,
    .quant_act = quant_act,
    .mm_f32 = mm_f32,
    .mm_f16 = mm_f16,
    .mm_bf16 = mm_bf16,
    .mm_q8_0 = mm_q8_0,
    .mm_q4_0 = mm_q4_0,
    .mm_q4_1 = mm_q4_1,
    .mm_q5_0 = mm_q5_0,
    .mm_q5_1 = mm_q5_1,
    .mm_q2_k = sh__cpu_mm_avx2_q2_k, /* the AVX2 row kernels: no AVX-512 ones yet */
    .mm_q3_k = sh__cpu_mm_avx2_q3_k,
    .mm_q4_k = sh__cpu_mm_avx512_q4_k,
    .mm_q5_k = sh__cpu_mm_avx2_q5_k,
    .mm_q6_k = sh__cpu_mm_avx512_q6_k,
    .mm_iq4_nl = mm_iq4_nl,
    .mm_iq4_xs = sh__cpu_mm_avx2_iq4_xs, /* the AVX2 row kernel and integer kernel */
    .mmp_f16 = sh__cpu_avx512_mmp_f16,
    .mmp_q8_0 = sh__cpu_avx512_mmp_q8_0,
    .mmp_q4_0 = sh__cpu_avx512_mmp_q4_0,
    .mmp_q4_1 = sh__cpu_avx512_mmp_q4_1,
    .mmp_q5_0 = sh__cpu_avx512_mmp_q5_0,
    .mmp_q5_1 = sh__cpu_avx512_mmp_q5_1,
    .mmp_q6_k = sh__cpu_avx512_mmp_q6_k,
    .mmp_q4_k = sh__cpu_avx512_mmp_q4_k,
    .dot = dot,
    .axpy = axpy,
    .sumsq = sumsq,
    .swiglu = swiglu,
    .attn_group = sh__cpu_avx512_attn_range,
};

#else
/* Not x86-64: never selected (sh__cpu_isa_detect reports SCALAR). */
const sh__cpu_kernels sh__cpu_kernels_avx512 = {.isa = SH_BACKEND_CPU_ISA_SCALAR};
#endif
