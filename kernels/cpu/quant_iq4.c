/* Scalar reference (de)quantization of IQ4_NL and IQ4_XS, byte-compatible with llama-quantize.
 *
 * Both types store 4-bit indices into a fixed non-uniform grid of sixteen int8 values. The
 * quantizer follows ggml's quantize_iq4_nl / quantize_iq4_xs without an importance matrix, which
 * is what llama-quantize runs: per 32 elements, weights x^2, a first scale that maps the signed
 * extreme to the grid's end, then 15 trial scales whose weighted least-squares fit is kept when it
 * explains more of the weighted energy. As in quant_k.c, every float operation is written in the
 * order and the types ggml uses, with no contraction into fused multiply-adds, so the bytes are
 * the same for the same input. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_k.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

const int8_t SH_IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                  1,    13,   25,  38,  53,  69,  89,  113};

/* Trial scales on each side of the first one. */
#define IQ4_NTRY 7

/* The grid index whose value is nearest to x; a tie goes to the upper value, outside the grid to
 * its ends. The differences are taken in float, as ggml's best_index_int8 takes them. */
static uint8_t grid_index(float x)
{
    const int8_t *v = SH_IQ4_VALUES;
    if (x <= v[0])
        return 0;
    if (x >= v[15])
        return 15;
    int hi = 1; /* the first value above x: v[hi - 1] <= x < v[hi] */
    while (hi < 15 && !(x < v[hi]))
        hi++;
    return (uint8_t)(x - v[hi - 1] < v[hi] - x ? hi - 1 : hi);
}

/* One group of 32: the scale of the best fit (0 for a group of near-zeros), with codes into L
 * when `L` is not NULL (the caller recomputes them from the stored scale otherwise). */
static float fit_group(const float *x, uint8_t *L)
{
    const int8_t *v = SH_IQ4_VALUES;
    float w[32];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        w[j] = x[j] * x[j];
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (amax < SH_QUANT_GROUP_MAX_EPS)
        return 0.0f;
    /* First scale: the signed extreme lands on the grid's -127 end (its widest side). */
    float d = -max / v[0];
    float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; j++) {
        const uint8_t l = grid_index(id * x[j]);
        if (L)
            L[j] = l;
        const float q = v[l];
        sumqx += w[j] * q * x[j];
        sumq2 += w[j] * q * q;
    }
    d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
    float best = d * sumqx;
    /* Trials: the extreme maps to -127 + t for t in [-7, 7]; keep the least-squares scale of the
     * assignment that maximises sumqx^2 / sumq2 (the weighted energy it explains). */
    for (int t = -IQ4_NTRY; t <= IQ4_NTRY; t++) {
        id = (t + v[0]) / max;
        sumqx = sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            const float q = v[grid_index(id * x[j])];
            sumqx += w[j] * q * x[j];
            sumq2 += w[j] * q * q;
        }
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

/* Element j < 16 of a 32-group in the low nibble of byte j, element j + 16 in its high nibble. */
static void pack_codes(const uint8_t *L, uint8_t *qs)
{
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)(L[j] | (L[j + 16] << 4));
}

void sh__quant_iq4_nl_quantize(const float *src, sh_block_iq4_nl *dst, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *x = src + b * SH_QK_IQ4_NL;
        const float d = fit_group(x, NULL);
        dst[b].d = sh__quant_fp16_from_f32(d);
        /* The codes against the unrounded scale (a zero scale gives code 8, the value 1). */
        const float id = d ? 1 / d : 0.0f;
        uint8_t L[32];
        for (int j = 0; j < 32; j++)
            L[j] = grid_index(id * x[j]);
        pack_codes(L, dst[b].qs);
    }
}

void sh__quant_iq4_xs_quantize(const float *src, sh_block_iq4_xs *dst, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *x = src + b * SH_QK_K;
        sh_block_iq4_xs *y = dst + b;
        float scales[8];
        float max_scale = 0, amax_scale = 0;
        for (int j = 0; j < 8; j++) {
            scales[j] = fit_group(x + 32 * j, NULL);
            if (fabsf(scales[j]) > amax_scale) {
                amax_scale = fabsf(scales[j]);
                max_scale = scales[j];
            }
        }
        /* The signed largest scale maps to -32; d stays unrounded for the codes (as in ggml; an
         * all-zero block stores -0). */
        const float d = -max_scale / 32;
        y->d = sh__quant_fp16_from_f32(d);
        const float id = d ? 1 / d : 0.0f;
        y->scales_h = 0;
        memset(y->scales_l, 0, sizeof y->scales_l);
        for (int j = 0; j < 8; j++) {
            int l = sh__quant_nearest_int(id * scales[j]);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            const float dl = d * l;
            const float idl = dl ? 1 / dl : 0.0f;
            uint8_t L[32];
            for (int i = 0; i < 32; i++)
                L[i] = grid_index(idl * x[32 * j + i]);
            pack_codes(L, y->qs + 16 * j);
            l += 32;
            y->scales_l[j / 2] |= (uint8_t)((l & 0xF) << (4 * (j % 2)));
            y->scales_h |= (uint16_t)((l >> 4) << (2 * j));
        }
    }
}

void sh__quant_iq4_nl_dequantize(const sh_block_iq4_nl *src, float *dst, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++) {
        const float d = sh__quant_f32_from_fp16(src[b].d);
        float *y = dst + b * SH_QK_IQ4_NL;
        for (int j = 0; j < 16; j++) {
            y[j] = d * SH_IQ4_VALUES[src[b].qs[j] & 0xF];
            y[j + 16] = d * SH_IQ4_VALUES[src[b].qs[j] >> 4];
        }
    }
}

void sh__quant_iq4_xs_dequantize(const sh_block_iq4_xs *src, float *dst, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++) {
        const float d = sh__quant_f32_from_fp16(src[b].d);
        for (int j = 0; j < 8; j++) {
            const float dl = d * sh__iq4_xs_scale(src + b, j);
            const uint8_t *qs = src[b].qs + 16 * j;
            float *y = dst + b * SH_QK_K + 32 * j;
            for (int i = 0; i < 16; i++) {
                y[i] = dl * SH_IQ4_VALUES[qs[i] & 0xF];
                y[i + 16] = dl * SH_IQ4_VALUES[qs[i] >> 4];
            }
        }
    }
}
