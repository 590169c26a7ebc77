/* Scalar reference conversions between fp32 and the weight types Shoal reads and writes. */
#include "kernels/cpu/quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/quant_k.h"

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t sh__quant_fp16_from_f32(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;

    if (a > 0x7f800000u) /* NaN: keep the top 10 payload bits, set the quiet bit */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    /* 65520 is halfway between the largest half (65504, odd mantissa) and 65536; ties go to even,
     * which is the next power of two and so overflows to infinity. */
    if (a >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {
        /* Below 2^-14: a half subnormal, m * 2^-24. A float with biased exponent e and 24-bit
         * significand s is s * 2^(e-150), so m = s * 2^(e-126): shift s right by 126 - e and
         * round the dropped bits to nearest even. Float subnormals (e = 0) are far below 2^-25
         * and become zero. */
        uint32_t e = a >> 23;
        if (e < 102) /* shift > 24: the value is under a quarter of the smallest subnormal */
            return sign;
        uint32_t s = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;
        uint32_t m = s >> shift;
        uint32_t rem = s & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (m & 1)))
            m++; /* may carry into the exponent field: 0x400 is the smallest normal, correctly */
        return (uint16_t)(sign | m);
    }
    /* Normal: rebias the exponent from 127 to 15 (subtract 112 << 23) and drop 13 mantissa bits,
     * rounding to nearest even; a carry out of the mantissa correctly bumps the exponent. */
    uint32_t h = (a - 0x38000000u) >> 13;
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

float sh__quant_f32_from_fp16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) /* infinity or NaN: payload moves to the top of the float mantissa */
        return f32_from_bits(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0)
            return f32_from_bits(sign);
        /* Subnormal m * 2^-24: normalise so the leading one sits at bit 10; each shift lowers
         * the exponent, which starts at that of 2^-14 (127 - 14 = 113). */
        uint32_t fe = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            fe--;
        }
        return f32_from_bits(sign | (fe << 23) | ((m & 0x3ffu) << 13));
    }
    return f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t sh__quant_bf16_from_f32(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: truncate and force the quiet bit */
        return (uint16_t)((u >> 16) | 0x40u);
    /* Adding 0x7fff plus the lowest kept bit rounds to nearest with ties to even; infinity stays
     * infinity and the largest finite values round up into it, as IEEE rounding does. */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float sh__quant_f32_from_bf16(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

bool sh__quant_supported(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_F32:
    case SH_DTYPE_F16:
    case SH_DTYPE_BF16:
    case SH_DTYPE_Q8_0:
    case SH_DTYPE_Q4_0:
    case SH_DTYPE_Q4_1:
    case SH_DTYPE_Q5_0:
    case SH_DTYPE_Q5_1:
    case SH_DTYPE_IQ4_NL:
    case SH_DTYPE_IQ4_XS:
        return true;
    default:
        return sh__quant_k_supported(type);
    }
}

static bool row_ok(sh_dtype type, int64_t n)
{
    if (!sh__quant_supported(type) || n < 0)
        return false;
    const sh_dtype_info *info = sh__dtype_info((uint32_t)type);
    return (uint64_t)n % info->block_elems == 0;
}

/* Q8_0: symmetric, d = amax / 127 so the largest magnitude maps to +-127; q = round(x / d).
 * The scale is stored as fp16 but the quants use the unrounded 1/d, as ggml does. */
static void quant_q8_0(const float *x, sh_block_q8_0 *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += SH_QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < SH_QK8_0; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = sh__quant_fp16_from_f32(d);
        for (int j = 0; j < SH_QK8_0; j++)
            y[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

/* Q4_0: symmetric around the signed value of largest magnitude, which maps to -8 exactly:
 * d = max / -8, q = x / d + 8 in [0, 16], truncated after adding 0.5 (round half up) and clamped
 * to 15 since only the extreme of the other sign can reach 16. */
static void quant_q4_0(const float *x, sh_block_q4_0 *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += SH_QK4_0) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < SH_QK4_0; j++) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = sh__quant_fp16_from_f32(d);
        for (int j = 0; j < SH_QK4_0 / 2; j++) {
            int q0 = (int)(x[j] * id + 8.5f);
            int q1 = (int)(x[j + SH_QK4_0 / 2] * id + 8.5f);
            q0 = q0 > 15 ? 15 : q0;
            q1 = q1 > 15 ? 15 : q1;
            y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* Q4_1: asymmetric, value = d * q + m with m = min and d = (max - min) / 15; q rounds half up and
 * is clamped to 15. Both d and m are stored as fp16; quants use the unrounded 1/d and min. */
static void quant_q4_1(const float *x, sh_block_q4_1 *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += SH_QK4_1) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < SH_QK4_1; j++) {
            if (x[j] < min)
                min = x[j];
            if (x[j] > max)
                max = x[j];
        }
        const float d = (max - min) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = sh__quant_fp16_from_f32(d);
        y[i].m = sh__quant_fp16_from_f32(min);
        for (int j = 0; j < SH_QK4_1 / 2; j++) {
            int q0 = (int)((x[j] - min) * id + 0.5f);
            int q1 = (int)((x[j + SH_QK4_1 / 2] - min) * id + 0.5f);
            q0 = q0 > 15 ? 15 : q0;
            q1 = q1 > 15 ? 15 : q1;
            y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* The fifth bits of a 32-element block travel as one little-endian uint32 (ggml memcpys it on
 * little-endian hosts); writing the bytes keeps the layout on any host. */
static void put_qh(uint8_t qh[4], uint32_t bits)
{
    for (int k = 0; k < 4; k++)
        qh[k] = (uint8_t)(bits >> (8 * k));
}

static uint32_t get_qh(const uint8_t qh[4])
{
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

/* Q5_0: as Q4_0 with 32 levels: the signed extreme maps to -16 exactly, d = max / -16, and
 * q = (int8_t)(x / d + 16.5) (round half up) clamped to 31, as quantize_row_q5_0_ref. */
static void quant_q5_0(const float *x, sh_block_q5_0 *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += SH_QK5_0) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < SH_QK5_0; j++) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = max / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = sh__quant_fp16_from_f32(d);
        uint32_t qh = 0;
        for (int j = 0; j < SH_QK5_0 / 2; j++) {
            int q0 = (int8_t)(x[j] * id + 16.5f);
            int q1 = (int8_t)(x[j + SH_QK5_0 / 2] * id + 16.5f);
            q0 = q0 > 31 ? 31 : q0;
            q1 = q1 > 31 ? 31 : q1;
            y[i].qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + SH_QK5_0 / 2);
        }
        put_qh(y[i].qh, qh);
    }
}

/* Q5_1: as Q4_1 with 32 levels: m = min, d = (max - min) / 31, q = (x - min) / d + 0.5
 * truncated, as quantize_row_q5_1_ref. ggml does not clamp here (q cannot pass 31 but for a
 * rounding ulp); we clamp to 31 as gguf's NumPy quantizer does, which changes no reachable byte. */
static void quant_q5_1(const float *x, sh_block_q5_1 *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += SH_QK5_1) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < SH_QK5_1; j++) {
            if (x[j] < min)
                min = x[j];
            if (x[j] > max)
                max = x[j];
        }
        const float d = (max - min) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = sh__quant_fp16_from_f32(d);
        y[i].m = sh__quant_fp16_from_f32(min);
        uint32_t qh = 0;
        for (int j = 0; j < SH_QK5_1 / 2; j++) {
            int q0 = (uint8_t)((x[j] - min) * id + 0.5f);
            int q1 = (uint8_t)((x[j + SH_QK5_1 / 2] - min) * id + 0.5f);
            q0 = q0 > 31 ? 31 : q0;
            q1 = q1 > 31 ? 31 : q1;
            y[i].qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + SH_QK5_1 / 2);
        }
        put_qh(y[i].qh, qh);
    }
}

/* dequantize_row_q5_0 / q5_1: q = low nibble | fifth bit << 4; Q5_0 centres it on 16. */
static void dequant_q5_0(const sh_block_q5_0 *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, y += SH_QK5_0) {
        const float d = sh__quant_f32_from_fp16(x[i].d);
        const uint32_t qh = get_qh(x[i].qh);
        for (int j = 0; j < SH_QK5_0 / 2; j++) {
            const int q0 = (int)((x[i].qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16;
            const int q1 = (int)((x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            y[j] = (float)q0 * d;
            y[j + SH_QK5_0 / 2] = (float)q1 * d;
        }
    }
}

static void dequant_q5_1(const sh_block_q5_1 *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, y += SH_QK5_1) {
        const float d = sh__quant_f32_from_fp16(x[i].d);
        const float m = sh__quant_f32_from_fp16(x[i].m);
        const uint32_t qh = get_qh(x[i].qh);
        for (int j = 0; j < SH_QK5_1 / 2; j++) {
            const int q0 = (int)((x[i].qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
            const int q1 = (int)((x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
            y[j] = (float)q0 * d + m;
            y[j + SH_QK5_1 / 2] = (float)q1 * d + m;
        }
    }
}

sh_err sh__quant_row(sh_dtype type, const float *src, void *dst, int64_t n)
{
    if (!row_ok(type, n))
        return SH_EINVAL;
    switch (type) {
    case SH_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case SH_DTYPE_F16: {
        uint16_t *y = dst;
        for (int64_t i = 0; i < n; i++)
            y[i] = sh__quant_fp16_from_f32(src[i]);
        break;
    }
    case SH_DTYPE_BF16: {
        uint16_t *y = dst;
        for (int64_t i = 0; i < n; i++)
            y[i] = sh__quant_bf16_from_f32(src[i]);
        break;
    }
    case SH_DTYPE_Q8_0:
        quant_q8_0(src, dst, n / SH_QK8_0);
        break;
    case SH_DTYPE_Q4_0:
        quant_q4_0(src, dst, n / SH_QK4_0);
        break;
    case SH_DTYPE_Q4_1:
        quant_q4_1(src, dst, n / SH_QK4_1);
        break;
    case SH_DTYPE_Q5_0:
        quant_q5_0(src, dst, n / SH_QK5_0);
        break;
    case SH_DTYPE_Q5_1:
        quant_q5_1(src, dst, n / SH_QK5_1);
        break;
    case SH_DTYPE_IQ4_NL:
        sh__quant_iq4_nl_quantize(src, dst, n / SH_QK_IQ4_NL);
        break;
    case SH_DTYPE_IQ4_XS:
        sh__quant_iq4_xs_quantize(src, dst, n / SH_QK_K);
        break;
    default: /* the K-quants (row_ok accepted the type) */
        sh__quant_k_quantize(type, src, dst, n / SH_QK_K);
        break;
    }
    return SH_OK;
}

sh_err sh__dequant_row(sh_dtype type, const void *src, float *dst, int64_t n)
{
    if (!row_ok(type, n))
        return SH_EINVAL;
    switch (type) {
    case SH_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case SH_DTYPE_F16: {
        const uint16_t *x = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = sh__quant_f32_from_fp16(x[i]);
        break;
    }
    case SH_DTYPE_BF16: {
        const uint16_t *x = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = sh__quant_f32_from_bf16(x[i]);
        break;
    }
    case SH_DTYPE_Q8_0: {
        const sh_block_q8_0 *x = src;
        for (int64_t i = 0; i < n / SH_QK8_0; i++) {
            const float d = sh__quant_f32_from_fp16(x[i].d);
            for (int j = 0; j < SH_QK8_0; j++)
                dst[i * SH_QK8_0 + j] = d * (float)x[i].qs[j];
        }
        break;
    }
    case SH_DTYPE_Q4_0: {
        const sh_block_q4_0 *x = src;
        for (int64_t i = 0; i < n / SH_QK4_0; i++) {
            const float d = sh__quant_f32_from_fp16(x[i].d);
            float *y = dst + i * SH_QK4_0;
            for (int j = 0; j < SH_QK4_0 / 2; j++) {
                y[j] = d * (float)((x[i].qs[j] & 0x0f) - 8);
                y[j + SH_QK4_0 / 2] = d * (float)((x[i].qs[j] >> 4) - 8);
            }
        }
        break;
    }
    case SH_DTYPE_Q4_1: {
        const sh_block_q4_1 *x = src;
        for (int64_t i = 0; i < n / SH_QK4_1; i++) {
            const float d = sh__quant_f32_from_fp16(x[i].d);
            const float m = sh__quant_f32_from_fp16(x[i].m);
            float *y = dst + i * SH_QK4_1;
            for (int j = 0; j < SH_QK4_1 / 2; j++) {
                y[j] = d * (float)(x[i].qs[j] & 0x0f) + m;
                y[j + SH_QK4_1 / 2] = d * (float)(x[i].qs[j] >> 4) + m;
            }
        }
        break;
    }
    case SH_DTYPE_Q5_0:
        dequant_q5_0(src, dst, n / SH_QK5_0);
        break;
    case SH_DTYPE_Q5_1:
        dequant_q5_1(src, dst, n / SH_QK5_1);
        break;
    case SH_DTYPE_IQ4_NL:
        sh__quant_iq4_nl_dequantize(src, dst, n / SH_QK_IQ4_NL);
        break;
    case SH_DTYPE_IQ4_XS:
        sh__quant_iq4_xs_dequantize(src, dst, n / SH_QK_K);
        break;
    default: /* the K-quants (row_ok accepted the type) */
        sh__quant_k_dequantize(type, src, dst, n / SH_QK_K);
        break;
    }
    return SH_OK;
}
