/* Scalar reference kernels of the CPU backend: the definition every fast path is tested against. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

/* ggml's Q8 rule: d = max|x| / 127, q = round(x / d); a zero block keeps d = 0 and q = 0. */
void sh__cpu_quant_act_ref(const float *x, int64_t n, int8_t *qs, float *d, float *s)
{
    for (int64_t b = 0; b < n / SH_CPU_QK; b++) {
        const float *xb = x + b * SH_CPU_QK;
        float amax = 0.0f;
        for (int i = 0; i < SH_CPU_QK; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < SH_CPU_QK; i++) {
            int q = (int)nearbyintf(xb[i] * id);
            qs[b * SH_CPU_QK + i] = (int8_t)q;
            sum += q;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

static void store(const sh__cpu_mm *m, int64_t t, int64_t r, float v)
{
    float *y = m->y + t * m->ldy + r;
    *y = m->accumulate ? *y + v : v;
}

/* Float weights (kind 0 F32, 1 F16, 2 BF16): plain dot products in f32. */
static void mm_float(const sh__cpu_mm *m, int64_t r0, int64_t r1, int kind)
{
    const sh__cpu_act *a = m->a;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = m->w + r * m->row_bytes;
        for (int64_t t = 0; t < a->n_tok; t++) {
            const float *x = a->x + t * a->n_in;
            float acc = 0.0f;
            for (int64_t k = 0; k < a->n_in; k++)
                acc += sh__cpu_wf32(w, k, kind) * x[k];
            store(m, t, r, acc);
        }
    }
}

static void mm_f32(const sh__cpu_mm *m, int64_t r0, int64_t r1) { mm_float(m, r0, r1, 0); }
static void mm_f16(const sh__cpu_mm *m, int64_t r0, int64_t r1) { mm_float(m, r0, r1, 1); }
static void mm_bf16(const sh__cpu_mm *m, int64_t r0, int64_t r1) { mm_float(m, r0, r1, 2); }

/* Quantized weights: per 32-block b, the integer dot product of the weight's and the
 * activation's codes, scaled by both block scales (see the identities in each function). */
static void mm_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_q8_0 *w = (const sh_block_q8_0 *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += w[b].qs[i] * q[b * SH_CPU_QK + i];
                /* sum_i (dw qw_i)(da qa_i) = dw da sum_i qw_i qa_i */
                acc += sh__quant_f32_from_fp16(w[b].d) * d[b] * (float)dot;
            }
            store(m, t, r, acc);
        }
    }
}

/* Element i of a Q4 block: the low nibble of qs[i] for i < 16, the high nibble of qs[i-16]. */
static int nib(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

static void mm_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_q4_0 *w = (const sh_block_q4_0 *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb, *s = a->s + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += nib(w[b].qs, i) * q[b * SH_CPU_QK + i];
                /* sum_i dw (n_i - 8) da qa_i = dw (da sum n_i qa_i - 8 s), s = da sum qa_i */
                acc += sh__quant_f32_from_fp16(w[b].d) * (d[b] * (float)dot - 8.0f * s[b]);
            }
            store(m, t, r, acc);
        }
    }
}

static void mm_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_q4_1 *w = (const sh_block_q4_1 *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb, *s = a->s + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += nib(w[b].qs, i) * q[b * SH_CPU_QK + i];
                /* sum_i (dw n_i + mw) da qa_i = dw da sum n_i qa_i + mw s */
                acc += sh__quant_f32_from_fp16(w[b].d) * d[b] * (float)dot +
                       sh__quant_f32_from_fp16(w[b].m) * s[b];
            }
            store(m, t, r, acc);
        }
    }
}

/* Element i of a Q5 block: its nibble plus the fifth bit, bit i of qh (little-endian). */
static int q5(const uint8_t *qs, const uint8_t *qh, int i)
{
    return nib(qs, i) | ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

static void mm_q5_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_q5_0 *w = (const sh_block_q5_0 *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb, *s = a->s + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += q5(w[b].qs, w[b].qh, i) * q[b * SH_CPU_QK + i];
                /* sum_i dw (q_i - 16) da qa_i = dw (da sum q_i qa_i - 16 s) */
                acc += sh__quant_f32_from_fp16(w[b].d) * (d[b] * (float)dot - 16.0f * s[b]);
            }
            store(m, t, r, acc);
        }
    }
}

static void mm_q5_1(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_q5_1 *w = (const sh_block_q5_1 *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb, *s = a->s + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += q5(w[b].qs, w[b].qh, i) * q[b * SH_CPU_QK + i];
                /* sum_i (dw q_i + mw) da qa_i = dw da sum q_i qa_i + mw s */
                acc += sh__quant_f32_from_fp16(w[b].d) * d[b] * (float)dot +
                       sh__quant_f32_from_fp16(w[b].m) * s[b];
            }
            store(m, t, r, acc);
        }
    }
}

/* IQ4_NL: the codes index the grid SH_IQ4_VALUES, so the block is Q8_0 with int8 values looked
 * up: sum_i dw g(n_i) da qa_i = dw da sum_i g(n_i) qa_i. */
static void mm_iq4_nl(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        const sh_block_iq4_nl *w = (const sh_block_iq4_nl *)(m->w + r * m->row_bytes);
        for (int64_t t = 0; t < a->n_tok; t++) {
            const int8_t *q = a->qs + t * a->n_in;
            const float *d = a->d + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int i = 0; i < SH_CPU_QK; i++)
                    dot += SH_IQ4_VALUES[nib(w[b].qs, i)] * q[b * SH_CPU_QK + i];
                acc += sh__quant_f32_from_fp16(w[b].d) * d[b] * (float)dot;
            }
            store(m, t, r, acc);
        }
    }
}

static float dot_ref(const float *a, const float *b, int64_t n)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++)
        acc += a[i] * b[i];
    return acc;
}

static void axpy_ref(float a, const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] += a * x[i];
}

static float sumsq_ref(const float *x, int64_t n)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++)
        acc += x[i] * x[i];
    return acc;
}

const sh__cpu_kernels sh__cpu_kernels_ref = {
    .isa = SH_BACKEND_CPU_ISA_SCALAR,
    .quant_act = sh__cpu_quant_act_ref,
    .mm_f32 = mm_f32,
    .mm_f16 = mm_f16,
    .mm_bf16 = mm_bf16,
    .mm_q8_0 = mm_q8_0,
    .mm_q4_0 = mm_q4_0,
    .mm_q4_1 = mm_q4_1,
    .mm_q5_0 = mm_q5_0,
    .mm_q5_1 = mm_q5_1,
    .mm_q2_k = sh__cpu_mm_ref_q2_k,
    .mm_q3_k = sh__cpu_mm_ref_q3_k,
    .mm_q4_k = sh__cpu_mm_ref_q4_k,
    .mm_q5_k = sh__cpu_mm_ref_q5_k,
    .mm_q6_k = sh__cpu_mm_ref_q6_k,
    .mm_iq4_nl = mm_iq4_nl,
    .mm_iq4_xs = sh__cpu_mm_ref_iq4_xs,
    .dot = dot_ref,
    .axpy = axpy_ref,
    .sumsq = sumsq_ref,
    .swiglu = sh__cpu_swiglu_ref,
    .attn_group = sh__cpu_ref_attn_range,
};

sh__cpu_mm_fn sh__cpu_mm_for(const sh__cpu_kernels *k, sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_F32:
        return k->mm_f32;
    case SH_DTYPE_F16:
        return k->mm_f16;
    case SH_DTYPE_BF16:
        return k->mm_bf16;
    case SH_DTYPE_Q8_0:
        return k->mm_q8_0;
    case SH_DTYPE_Q4_0:
        return k->mm_q4_0;
    case SH_DTYPE_Q4_1:
        return k->mm_q4_1;
    case SH_DTYPE_Q5_0:
        return k->mm_q5_0;
    case SH_DTYPE_Q5_1:
        return k->mm_q5_1;
    case SH_DTYPE_Q2_K:
        return k->mm_q2_k;
    case SH_DTYPE_Q3_K:
        return k->mm_q3_k;
    case SH_DTYPE_Q4_K:
        return k->mm_q4_k;
    case SH_DTYPE_Q5_K:
        return k->mm_q5_k;
    case SH_DTYPE_Q6_K:
        return k->mm_q6_k;
    case SH_DTYPE_IQ4_NL:
        return k->mm_iq4_nl;
    case SH_DTYPE_IQ4_XS:
        return k->mm_iq4_xs;
    default:
        return NULL;
    }
}

bool sh__cpu_type_q8(sh_dtype type)
{
    return type == SH_DTYPE_Q8_0 || type == SH_DTYPE_Q4_0 || type == SH_DTYPE_Q4_1 ||
           type == SH_DTYPE_Q5_0 || type == SH_DTYPE_Q5_1 || type == SH_DTYPE_IQ4_NL;
}

bool sh__cpu_type_k(sh_dtype type)
{
    return type == SH_DTYPE_Q2_K || type == SH_DTYPE_Q3_K || type == SH_DTYPE_Q4_K ||
           type == SH_DTYPE_Q5_K || type == SH_DTYPE_Q6_K || type == SH_DTYPE_IQ4_XS;
}
