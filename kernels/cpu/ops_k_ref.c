/* K-quant row dot products against Q8_K activations: the scalar integer kernels (the reference
 * the SIMD ones are tested against), the float part every ISA shares, and the dispatch. */
#include <string.h>

#include "kernels/cpu/cpu.h"

/* Q4_K/Q5_K 6-bit scale and min of sub-block j (the layout of quant_k.c's get_scale_min). */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K's 6-bit scale j, still biased by 32 (quant_k.c's q3_scale). */
static int scale_q3(const uint8_t *s, int j)
{
    int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    return lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

/* sum_{i < n} q[i] * a[i] */
static int32_t dot_i8(const int *q, const int8_t *a, int n)
{
    int32_t s = 0;
    for (int i = 0; i < n; i++)
        s += q[i] * a[i];
    return s;
}

static int32_t sum_i8(const int8_t *a, int n)
{
    int32_t s = 0;
    for (int i = 0; i < n; i++)
        s += a[i];
    return s;
}

/* Each kernel below first unpacks a super-block's codes into q[256] in element order (the order
 * of quant_k.c's dequantizers), then sums per sub-block. */

static void ints_q2_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q2_k *w = wv;
    int q[SH_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    q[128 * h + 32 * j + l] = (w[b].qs[32 * h + l] >> (2 * j)) & 3;
        int32_t si = 0, sm = 0;
        for (int j = 0; j < 16; j++) {
            si += (w[b].scales[j] & 0xF) * dot_i8(q + 16 * j, a[b].qs + 16 * j, 16);
            sm += (w[b].scales[j] >> 4) * sum_i8(a[b].qs + 16 * j, 16);
        }
        ints[2 * b] = si;
        ints[2 * b + 1] = sm;
    }
}

static void ints_q3_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q3_k *w = wv;
    int q[SH_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const int hi = (w[b].hmask[l] >> (4 * h + j)) & 1;
                    q[128 * h + 32 * j + l] = ((w[b].qs[32 * h + l] >> (2 * j)) & 3) - (hi ? 0 : 4);
                }
        int32_t si = 0;
        for (int j = 0; j < 16; j++)
            si += (scale_q3(w[b].scales, j) - 32) * dot_i8(q + 16 * j, a[b].qs + 16 * j, 16);
        ints[2 * b] = si;
        ints[2 * b + 1] = 0;
    }
}

/* The two integer sums of one Q4_K or Q5_K block whose unpacked codes are q: each 32-code
 * sub-block's dot with the activations times its 6-bit scale, and the activations' sums times
 * the sub-block's 6-bit minimum. */
static void sums_k4(const int *q, const uint8_t *scales, const int8_t *aq, int32_t *ints)
{
    int32_t si = 0, sm = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        si += sc * dot_i8(q + 32 * j, aq + 32 * j, 32);
        sm += m * sum_i8(aq + 32 * j, 32);
    }
    ints[0] = si;
    ints[1] = sm;
}

static void ints_q4_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q4_k *w = wv;
    int q[SH_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                q[64 * g + l] = w[b].qs[32 * g + l] & 0xF;
                q[64 * g + 32 + l] = w[b].qs[32 * g + l] >> 4;
            }
        sums_k4(q, w[b].scales, a[b].qs, ints + 2 * b);
    }
}

static void ints_q5_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q5_k *w = wv;
    int q[SH_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                const uint8_t h = w[b].qh[l];
                q[64 * g + l] = (w[b].qs[32 * g + l] & 0xF) + (((h >> (2 * g)) & 1) << 4);
                q[64 * g + 32 + l] = (w[b].qs[32 * g + l] >> 4) + (((h >> (2 * g + 1)) & 1) << 4);
            }
        sums_k4(q, w[b].scales, a[b].qs, ints + 2 * b);
    }
}

static void ints_q6_k(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_q6_k *w = wv;
    int q[SH_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[b].ql + 64 * h, *qh = w[b].qh + 32 * h;
            int *o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                o[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            }
        }
        int32_t si = 0;
        for (int j = 0; j < 16; j++)
            si += w[b].scales[j] * dot_i8(q + 16 * j, a[b].qs + 16 * j, 16);
        ints[2 * b] = si;
        ints[2 * b + 1] = 0;
    }
}

/* IQ4_XS: eight 32-element sub-blocks, the codes' grid values times the activations, each
 * sub-block's sum times its 6-bit scale minus 32 (no minimums). */
static void ints_iq4_xs(const void *wv, const sh_block_q8_k *a, int64_t nb, int32_t *ints)
{
    const sh_block_iq4_xs *w = wv;
    int q[32];
    for (int64_t b = 0; b < nb; b++) {
        int32_t si = 0;
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = w[b].qs + 16 * j;
            for (int l = 0; l < 16; l++) {
                q[l] = SH_IQ4_VALUES[qs[l] & 0xF];
                q[l + 16] = SH_IQ4_VALUES[qs[l] >> 4];
            }
            si += sh__iq4_xs_scale(w + b, j) * dot_i8(q, a[b].qs + 32 * j, 32);
        }
        ints[2 * b] = si;
        ints[2 * b + 1] = 0;
    }
}

/* Super-blocks per call of the integer kernel (the ints live on the stack). */
#define K_CHUNK 16

/* binary16 -> binary32, exactly: normal numbers and zeros inline (the matvec converts two per
 * super-block), the rest through the reference conversion. */
static inline float f32_from_fp16(uint16_t h)
{
    const uint32_t e = (h >> 10) & 31u, sign = (uint32_t)(h >> 15) << 31;
    uint32_t bits;
    if (e != 0 && e != 31)
        bits = sign | (e + 112u) << 23 | (uint32_t)(h & 1023u) << 13;
    else if ((h & 0x7fffu) == 0)
        bits = sign;
    else
        return sh__quant_f32_from_fp16(h);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float sh__cpu_dot_k(sh__cpu_k_ints_fn ints, sh_dtype type, const void *w, const sh_block_q8_k *a,
                    int64_t nb)
{
    /* Where each type keeps d (and dmin; 0 where it has none), from the layouts in quant_k.h. */
    size_t bsz, doff, moff = 0;
    switch (type) {
    case SH_DTYPE_Q2_K:
        bsz = sizeof(sh_block_q2_k), doff = offsetof(sh_block_q2_k, d);
        moff = offsetof(sh_block_q2_k, dmin);
        break;
    case SH_DTYPE_Q3_K:
        bsz = sizeof(sh_block_q3_k), doff = offsetof(sh_block_q3_k, d);
        break;
    case SH_DTYPE_Q4_K:
        bsz = sizeof(sh_block_q4_k), doff = offsetof(sh_block_q4_k, d);
        moff = offsetof(sh_block_q4_k, dmin);
        break;
    case SH_DTYPE_Q5_K:
        bsz = sizeof(sh_block_q5_k), doff = offsetof(sh_block_q5_k, d);
        moff = offsetof(sh_block_q5_k, dmin);
        break;
    case SH_DTYPE_IQ4_XS:
        bsz = sizeof(sh_block_iq4_xs), doff = offsetof(sh_block_iq4_xs, d);
        break;
    default:
        bsz = sizeof(sh_block_q6_k), doff = offsetof(sh_block_q6_k, d);
        break;
    }
    const uint8_t *wb = w;
    int32_t buf[2 * K_CHUNK];
    float acc = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += K_CHUNK) {
        const int64_t n = nb - b0 < K_CHUNK ? nb - b0 : K_CHUNK;
        ints(wb + b0 * bsz, a + b0, n, buf);
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *blk = wb + (b0 + i) * bsz;
            uint16_t dh, mh = 0;
            memcpy(&dh, blk + doff, 2);
            if (moff)
                memcpy(&mh, blk + moff, 2);
            const float dw = f32_from_fp16(dh), dm = f32_from_fp16(mh);
            /* sum_k (dw sc_j qw_k - dm m_j)(da qa_k) = da (dw ints[0] - dm ints[1]) */
            acc += a[b0 + i].d * (dw * (float)buf[2 * i] - dm * (float)buf[2 * i + 1]);
        }
    }
    return acc;
}

static sh__cpu_k_ints_fn ints_ref(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_Q2_K:
        return ints_q2_k;
    case SH_DTYPE_Q3_K:
        return ints_q3_k;
    case SH_DTYPE_Q4_K:
        return ints_q4_k;
    case SH_DTYPE_Q5_K:
        return ints_q5_k;
    case SH_DTYPE_Q6_K:
        return ints_q6_k;
    case SH_DTYPE_IQ4_XS:
        return ints_iq4_xs;
    default:
        return NULL;
    }
}

void sh__cpu_mm_k(const sh__cpu_mm *m, int64_t r0, int64_t r1, sh_dtype type,
                  sh__cpu_k_ints_fn ints)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = m->w + (size_t)r * m->row_bytes;
        if (a->n_tok == 1) /* prefetch the bytes K_PF_DIST past this row's, into L2 */
            for (size_t o = 0; o < m->row_bytes; o += 64)
                __builtin_prefetch(w + SH_CPU_K_PF_DIST + o, 0, 2);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const float v = sh__cpu_dot_k(ints, type, w, a->qk + t * nb, nb);
            float *y = m->y + t * m->ldy + r;
            *y = m->accumulate ? *y + v : v;
        }
    }
}

#define DEFINE_MM_K(isa, ISA, t, T)                                                                \
    void sh__cpu_mm_##isa##_##t(const sh__cpu_mm *m, int64_t r0, int64_t r1)                       \
    {                                                                                              \
        sh__cpu_mm_k(m, r0, r1, SH_DTYPE_##T,                                                      \
                     sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_##ISA, SH_DTYPE_##T));                  \
    }
DEFINE_MM_K(ref, SCALAR, q2_k, Q2_K)
DEFINE_MM_K(ref, SCALAR, q3_k, Q3_K)
DEFINE_MM_K(ref, SCALAR, q4_k, Q4_K)
DEFINE_MM_K(ref, SCALAR, q5_k, Q5_K)
DEFINE_MM_K(ref, SCALAR, q6_k, Q6_K)
DEFINE_MM_K(ref, SCALAR, iq4_xs, IQ4_XS)
/* The AVX2 row kernels are in ops_k_avx2.c (AVX-512 uses them for Q2_K, Q3_K and Q5_K), the
 * AVX-512 Q4_K and Q6_K ones in ops_k_avx512.c. */

sh__cpu_k_ints_fn sh__cpu_k_ints_for(int32_t isa, sh_dtype type)
{
    if (isa == SH_BACKEND_CPU_ISA_AVX512) {
        sh__cpu_k_ints_fn f = sh__cpu_k_ints_avx512(type);
        if (f)
            return f;
    }
    if (isa == SH_BACKEND_CPU_ISA_AVX2 || isa == SH_BACKEND_CPU_ISA_AVX512) {
        sh__cpu_k_ints_fn f = sh__cpu_k_ints_avx2(type);
        if (f)
            return f;
    }
    return ints_ref(type);
}
