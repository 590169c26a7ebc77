/* Scalar reference (de)quantization of the K-quants, byte-compatible with ggml's reference.
 *
 * Byte identity with ggml's quantize_row_*_K_ref: every float operation below is written in the
 * order and the types ggml's reference uses (left-to-right products, int-to-float conversions at
 * the same points, the same search grids), rounding is ggml's nearest_int (add 1.5 * 2^23 and
 * read the mantissa: round half to even) and halves are IEEE round-to-nearest-even like F16C.
 * With IEEE single precision and no contraction of a*b+c into fused multiply-adds, the bytes
 * therefore match ggml's for the same input. The build is strict C11, for which gcc does not
 * contract; clang contracts within an expression unless told not to, hence the pragma.
 * Dequantization likewise repeats ggml's dequantize_row_*_K expression by expression, so its
 * floats are bit-identical to ggml's and to the gguf package's NumPy dequantizer. */
#include "kernels/cpu/quant_k.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/quant.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

static int imin(int a, int b) { return a < b ? a : b; }
static int imax(int a, int b) { return a > b ? a : b; }

static float h2f(uint16_t h) { return sh__quant_f32_from_fp16(h); }
static uint16_t f2h(float f) { return sh__quant_fp16_from_f32(f); }

/* ---- The searches -------------------------------------------------------------------------- */

/* Asymmetric n-element group, quants L in [0, nmax], value ~ scale * L - the_min (ggml's
 * make_qkx2_quants): start from the min/max grid, then try nstep + 1 stretched grids
 * (nmax + rmin + rdelta * is) and, for each, the weighted least-squares scale and min for that
 * assignment; keep the one with the smallest weighted error (absolute when use_mad, else
 * squared). The min is clamped to be <= 0 (so -min >= 0 is stored). Returns the scale. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              bool use_mad)
{
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min)
            min = x[i];
        if (x[i] > max)
            max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0)
        min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.0f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        int l = sh__quant_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)imax(0, imin(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    if (nstep < 1) {
        *the_min = -min;
        return scale;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = sh__quant_nearest_int(iscale * (x[i] - min));
            l = imax(0, imin(nmax, l));
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* The element of an n-element group with the largest magnitude, the first of equals, sign kept,
 * into *max; returns its magnitude. */
static float signed_extreme(int n, const float *x, float *max)
{
    float amax = 0;
    *max = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            *max = x[i];
        }
    }
    return amax;
}

/* Symmetric group, L in [0, 2 nmax) meaning L - nmax, weights x^2 (ggml's make_q3_quants with
 * do_rmse): round on the grid that maps the signed extreme to -nmax, then up to 5 passes of
 * coordinate descent, each moving one quant to its best value for the least-squares scale of the
 * others when that raises sumlx^2 / suml2. Returns the scale. */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max;
    if (signed_extreme(n, x, &max) < SH_QUANT_GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = sh__quant_nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = sh__quant_nearest_int(x[i] * sl2 / slx);
                new_l = imax(-nmax, imin(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed)
            break;
    }
    for (int i = 0; i < n; i++)
        L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Symmetric group, L in [0, 2 nmax) meaning L - nmax, weights x^2 (ggml's make_qx_quants with
 * rmse_type 1 and no importance weights): the grid mapping the signed extreme to -nmax, then
 * 18 grids with nmax + 0.1 is (is = -9..9, not 0), keeping the one whose least-squares scale
 * explains most of the weighted energy (largest sumlx^2 / suml2). Returns that scale. */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max;
    if (signed_extreme(n, x, &max) < SH_QUANT_GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = sh__quant_nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = sh__quant_nearest_int(iscale * x[i]);
            l = imax(-nmax, imin(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                int l = sh__quant_nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + imax(-nmax, imin(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* ---- Packing helpers ----------------------------------------------------------------------- */

/* Q4_K/Q5_K scales: sub-blocks 0-3 keep scale and min in the low 6 bits of bytes j and j + 4;
 * sub-blocks 4-7 keep their low nibbles in byte j + 4 and their top 2 bits in the spare top bits
 * of bytes j - 4 (scale) and j (min). */
static void get_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void put_scale_min(int j, uint8_t *q, uint8_t ls, uint8_t lm)
{
    if (j < 4) {
        q[j] = ls;
        q[j + 4] = lm;
    } else {
        q[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
        q[j - 4] |= (uint8_t)((ls >> 4) << 6);
        q[j] |= (uint8_t)((lm >> 4) << 6);
    }
}

/* Q3_K's 6-bit scale j (still biased by 32): low nibble in byte j (j < 8) or the high nibble of
 * byte j - 8, top 2 bits in byte 8 + j % 4 at bit 2 * (j / 4). */
static int q3_scale(const uint8_t *s, int j)
{
    int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    return lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

/* 2-bit packing shared by Q2_K and Q3_K: in each half of 128, byte l holds elements l, l + 32,
 * l + 64 and l + 96 at bits 0, 2, 4 and 6. */
static void pack_2bit(const uint8_t *L, uint8_t *qs)
{
    for (int j = 0; j < SH_QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* ---- Quantization -------------------------------------------------------------------------- */

/* Q2_K: per 16 elements an asymmetric 2-bit grid (make_qkx2_quants on |x| weights, absolute
 * error), then the sixteen scales and mins quantized to 4 bits against their maxima, then every
 * quant recomputed against the scales as stored. */
static void quant_q2_k(const float *x, sh_block_q2_k *y)
{
    uint8_t L[SH_QK_K], Laux[16];
    float weights[16], mins[SH_QK_K / 16], scales[SH_QK_K / 16];
    const float q4scale = 15.0f;

    float max_scale = 0, max_min = 0;
    for (int j = 0; j < SH_QK_K / 16; j++) {
        for (int l = 0; l < 16; l++)
            weights[l] = fabsf(x[16 * j + l]);
        scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f,
                                     0.1f, 15, true);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    if (max_scale > 0) {
        float iscale = q4scale / max_scale;
        for (int j = 0; j < SH_QK_K / 16; j++)
            y->scales[j] = (uint8_t)sh__quant_nearest_int(iscale * scales[j]);
        y->d = f2h(max_scale / q4scale);
    } else {
        memset(y->scales, 0, sizeof y->scales);
        y->d = f2h(0.0f);
    }
    if (max_min > 0) {
        float iscale = q4scale / max_min;
        for (int j = 0; j < SH_QK_K / 16; j++)
            y->scales[j] |= (uint8_t)(sh__quant_nearest_int(iscale * mins[j]) << 4);
        y->dmin = f2h(max_min / q4scale);
    } else {
        y->dmin = f2h(0.0f);
    }
    for (int j = 0; j < SH_QK_K / 16; j++) {
        const float d = h2f(y->d) * (y->scales[j] & 0xF);
        if (!d)
            continue; /* the group keeps make_qkx2_quants' quants, as in ggml */
        const float dm = h2f(y->dmin) * (y->scales[j] >> 4);
        for (int ii = 0; ii < 16; ii++) {
            int l = sh__quant_nearest_int((x[16 * j + ii] + dm) / d);
            L[16 * j + ii] = (uint8_t)imax(0, imin(3, l));
        }
    }
    pack_2bit(L, y->qs);
}

/* Q3_K: per 16 elements a symmetric 3-bit grid (make_q3_quants), the sixteen scales quantized to
 * 6 bits (biased by 32) against the signed largest one, then every quant recomputed against the
 * stored scales; the third bit goes to hmask (bit j / 32 of byte j % 32). */
static void quant_q3_k(const float *x, sh_block_q3_k *y)
{
    int8_t L[SH_QK_K];
    float scales[SH_QK_K / 16];

    float max_scale = 0, amax = 0;
    for (int j = 0; j < SH_QK_K / 16; j++) {
        scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
        float scale = fabsf(scales[j]);
        if (scale > amax) {
            amax = scale;
            max_scale = scales[j];
        }
    }
    memset(y->scales, 0, sizeof y->scales);
    if (max_scale) {
        float iscale = -32.0f / max_scale;
        for (int j = 0; j < SH_QK_K / 16; j++) {
            int8_t l = (int8_t)sh__quant_nearest_int(iscale * scales[j]);
            l = (int8_t)(imax(-32, imin(31, l)) + 32);
            if (j < 8)
                y->scales[j] = (uint8_t)(l & 0xF);
            else
                y->scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
            l = (int8_t)(l >> 4);
            y->scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
        }
        y->d = f2h(1 / iscale);
    } else {
        y->d = f2h(0.0f);
    }
    for (int j = 0; j < SH_QK_K / 16; j++) {
        const int8_t sc = (int8_t)(q3_scale(y->scales, j) - 32);
        const float d = h2f(y->d) * sc;
        if (!d)
            continue;
        for (int ii = 0; ii < 16; ii++) {
            int l = sh__quant_nearest_int(x[16 * j + ii] / d);
            L[16 * j + ii] = (int8_t)(imax(-4, imin(3, l)) + 4);
        }
    }
    memset(y->hmask, 0, sizeof y->hmask);
    uint8_t low[SH_QK_K];
    for (int j = 0; j < SH_QK_K; j++) {
        int l = L[j];
        if (l > 3) {
            y->hmask[j % 32] |= (uint8_t)(1u << (j / 32));
            l -= 4;
        }
        low[j] = (uint8_t)l;
    }
    pack_2bit(low, y->qs);
}

/* Q4_K and Q5_K: per 32 elements an asymmetric grid (make_qkx2_quants, weights |x| + rms of the
 * group, squared error), scales and mins to 6 bits against their maxima, quants recomputed
 * against the stored scales. nmax is 15 or 31, and the searches differ as in ggml. */
static void quant_qk_asym(const float *x, int nmax, float rmin, int nstep, uint8_t *scales12,
                          uint16_t *dd, uint16_t *dmin, uint8_t *L)
{
    uint8_t Laux[32];
    float weights[32], mins[SH_QK_K / 32], scales[SH_QK_K / 32];

    float max_scale = 0, max_min = 0;
    for (int j = 0; j < SH_QK_K / 32; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++)
            sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++)
            weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, false);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < SH_QK_K / 32; j++) {
        uint8_t ls = (uint8_t)sh__quant_nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)sh__quant_nearest_int(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        put_scale_min(j, scales12, ls, lm);
    }
    *dd = f2h(max_scale / 63.0f);
    *dmin = f2h(max_min / 63.0f);
    for (int j = 0; j < SH_QK_K / 32; j++) {
        uint8_t sc, m;
        get_scale_min(j, scales12, &sc, &m);
        const float d = h2f(*dd) * sc;
        if (!d)
            continue;
        const float dm = h2f(*dmin) * m;
        for (int ii = 0; ii < 32; ii++) {
            int l = sh__quant_nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)imax(0, imin(nmax, l));
        }
    }
}

static void quant_q4_k(const float *x, sh_block_q4_k *y)
{
    uint8_t L[SH_QK_K];
    quant_qk_asym(x, 15, -1.0f, 20, y->scales, &y->d, &y->dmin, L);
    /* Each 64 elements: byte l holds element l (low nibble) and l + 32 (high nibble). */
    for (int j = 0; j < SH_QK_K; j += 64)
        for (int l = 0; l < 32; l++)
            y->qs[j / 2 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static void quant_q5_k(const float *x, sh_block_q5_k *y)
{
    uint8_t L[SH_QK_K];
    quant_qk_asym(x, 31, -0.5f, 15, y->scales, &y->d, &y->dmin, L);
    /* As Q4_K for the low 4 bits; the fifth bit of elements 64 g + l and 64 g + 32 + l is bit 2 g
     * and 2 g + 1 of qh[l]. */
    memset(y->qh, 0, sizeof y->qh);
    for (int g = 0; g < SH_QK_K / 64; g++) {
        for (int l = 0; l < 32; l++) {
            int l1 = L[64 * g + l], l2 = L[64 * g + l + 32];
            if (l1 > 15) {
                l1 -= 16;
                y->qh[l] |= (uint8_t)(1u << (2 * g));
            }
            if (l2 > 15) {
                l2 -= 16;
                y->qh[l] |= (uint8_t)(2u << (2 * g));
            }
            y->qs[32 * g + l] = (uint8_t)(l1 | (l2 << 4));
        }
    }
}

/* Q6_K: per 16 elements a symmetric 6-bit grid (make_qx_quants, weights x^2), the scales to
 * signed 8 bits against the signed largest one (which maps to -128, clamped to 127 for the other
 * sign), quants recomputed against the stored scales. */
static void quant_q6_k(const float *x, sh_block_q6_k *y)
{
    int8_t L[SH_QK_K];
    float scales[SH_QK_K / 16];

    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < SH_QK_K / 16; ib++) {
        const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if (max_abs_scale < SH_QUANT_GROUP_MAX_EPS) {
        memset(y, 0, sizeof *y);
        return;
    }
    float iscale = -128.0f / max_scale;
    y->d = f2h(1 / iscale);
    for (int ib = 0; ib < SH_QK_K / 16; ib++)
        y->scales[ib] = (int8_t)imin(127, sh__quant_nearest_int(iscale * scales[ib]));
    for (int j = 0; j < SH_QK_K / 16; j++) {
        float d = h2f(y->d) * y->scales[j];
        if (!d)
            continue;
        for (int ii = 0; ii < 16; ii++) {
            int l = sh__quant_nearest_int(x[16 * j + ii] / d);
            L[16 * j + ii] = (int8_t)(imax(-32, imin(31, l)) + 32);
        }
    }
    /* Each 128 elements h: ql[64 h + l] holds elements l (low) and l + 64 (high nibble),
     * ql[64 h + 32 + l] elements l + 32 and l + 96; qh[32 h + l] their top 2 bits at 0, 2, 4, 6. */
    for (int h = 0; h < SH_QK_K / 128; h++) {
        const int8_t *q = L + 128 * h;
        uint8_t *ql = y->ql + 64 * h, *qh = y->qh + 32 * h;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((q[l] & 0xF) | ((q[l + 64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4));
            qh[l] = (uint8_t)((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) |
                              ((q[l + 96] >> 4) << 6));
        }
    }
}

/* Q8_K: symmetric, the signed extreme maps to -127 (ggml chose 127 over 128 for its IQ kernels);
 * the other sign is clamped to 127. bsums hold each 16 quants' sum. An all-zero block is all
 * zeros (ggml leaves its bsums as they were; we write zeros). */
static void quant_q8_k(const float *x, sh_block_q8_k *y)
{
    float max = 0, amax = 0;
    for (int j = 0; j < SH_QK_K; j++) {
        float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (!amax) {
        memset(y, 0, sizeof *y);
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < SH_QK_K; j++)
        y->qs[j] = (int8_t)imin(127, sh__quant_nearest_int(iscale * x[j]));
    for (int j = 0; j < SH_QK_K / 16; j++) {
        int sum = 0;
        for (int ii = 0; ii < 16; ii++)
            sum += y->qs[16 * j + ii];
        y->bsums[j] = (int16_t)sum;
    }
    y->d = 1 / iscale;
}

bool sh__quant_k_supported(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_Q2_K:
    case SH_DTYPE_Q3_K:
    case SH_DTYPE_Q4_K:
    case SH_DTYPE_Q5_K:
    case SH_DTYPE_Q6_K:
    case SH_DTYPE_Q8_K:
        return true;
    default:
        return false;
    }
}

void sh__quant_k_quantize(sh_dtype type, const float *src, void *dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++) {
        const float *x = src + i * SH_QK_K;
        switch (type) {
        case SH_DTYPE_Q2_K:
            quant_q2_k(x, (sh_block_q2_k *)dst + i);
            break;
        case SH_DTYPE_Q3_K:
            quant_q3_k(x, (sh_block_q3_k *)dst + i);
            break;
        case SH_DTYPE_Q4_K:
            quant_q4_k(x, (sh_block_q4_k *)dst + i);
            break;
        case SH_DTYPE_Q5_K:
            quant_q5_k(x, (sh_block_q5_k *)dst + i);
            break;
        case SH_DTYPE_Q6_K:
            quant_q6_k(x, (sh_block_q6_k *)dst + i);
            break;
        case SH_DTYPE_Q8_K:
            quant_q8_k(x, (sh_block_q8_k *)dst + i);
            break;
        default:
            return;
        }
    }
}

/* ---- Dequantization ------------------------------------------------------------------------ */

/* Element 128 h + 32 j + l of a Q2_K/Q3_K block: bits 2j of qs[32 h + l], sub-block
 * 8 h + 2 j + l / 16 (and for Q3_K, hmask[l] bit 4 h + j). */
static void dequant_q2_k(const sh_block_q2_k *x, float *y)
{
    const float d = h2f(x->d), min = h2f(x->dmin);
    for (int h = 0; h < 2; h++) {
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = x->scales[8 * h + 2 * j + half];
                const float dl = d * (sc & 0xF), ml = min * (sc >> 4);
                const uint8_t *q = x->qs + 32 * h + 16 * half;
                float *o = y + 128 * h + 32 * j + 16 * half;
                for (int l = 0; l < 16; l++)
                    o[l] = dl * ((q[l] >> (2 * j)) & 3) - ml;
            }
        }
    }
}

static void dequant_q3_k(const sh_block_q3_k *x, float *y)
{
    const float d_all = h2f(x->d);
    for (int h = 0; h < 2; h++) {
        for (int j = 0; j < 4; j++) {
            const uint8_t m = (uint8_t)(1u << (4 * h + j));
            for (int half = 0; half < 2; half++) {
                const float dl = d_all * (q3_scale(x->scales, 8 * h + 2 * j + half) - 32);
                const uint8_t *q = x->qs + 32 * h + 16 * half;
                const uint8_t *hm = x->hmask + 16 * half;
                float *o = y + 128 * h + 32 * j + 16 * half;
                for (int l = 0; l < 16; l++)
                    o[l] = dl * (((q[l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4));
            }
        }
    }
}

static void dequant_q4_k(const sh_block_q4_k *x, float *y)
{
    const float d = h2f(x->d), min = h2f(x->dmin);
    for (int g = 0; g < 4; g++) {
        uint8_t sc, m;
        get_scale_min(2 * g, x->scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        get_scale_min(2 * g + 1, x->scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        const uint8_t *q = x->qs + 32 * g;
        for (int l = 0; l < 32; l++)
            y[64 * g + l] = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++)
            y[64 * g + 32 + l] = d2 * (q[l] >> 4) - m2;
    }
}

static void dequant_q5_k(const sh_block_q5_k *x, float *y)
{
    const float d = h2f(x->d), min = h2f(x->dmin);
    for (int g = 0; g < 4; g++) {
        uint8_t sc, m;
        get_scale_min(2 * g, x->scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        get_scale_min(2 * g + 1, x->scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        const uint8_t u1 = (uint8_t)(1u << (2 * g)), u2 = (uint8_t)(2u << (2 * g));
        const uint8_t *ql = x->qs + 32 * g;
        for (int l = 0; l < 32; l++)
            y[64 * g + l] = d1 * ((ql[l] & 0xF) + (x->qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            y[64 * g + 32 + l] = d2 * ((ql[l] >> 4) + (x->qh[l] & u2 ? 16 : 0)) - m2;
    }
}

static void dequant_q6_k(const sh_block_q6_k *x, float *y)
{
    const float d = h2f(x->d);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
        const int8_t *sc = x->scales + 8 * h;
        float *o = y + 128 * h;
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[l] = d * sc[is] * q1;
            o[l + 32] = d * sc[is + 2] * q2;
            o[l + 64] = d * sc[is + 4] * q3;
            o[l + 96] = d * sc[is + 6] * q4;
        }
    }
}

static void dequant_q8_k(const sh_block_q8_k *x, float *y)
{
    for (int j = 0; j < SH_QK_K; j++)
        y[j] = x->d * x->qs[j];
}

void sh__quant_k_dequantize(sh_dtype type, const void *src, float *dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++) {
        float *y = dst + i * SH_QK_K;
        switch (type) {
        case SH_DTYPE_Q2_K:
            dequant_q2_k((const sh_block_q2_k *)src + i, y);
            break;
        case SH_DTYPE_Q3_K:
            dequant_q3_k((const sh_block_q3_k *)src + i, y);
            break;
        case SH_DTYPE_Q4_K:
            dequant_q4_k((const sh_block_q4_k *)src + i, y);
            break;
        case SH_DTYPE_Q5_K:
            dequant_q5_k((const sh_block_q5_k *)src + i, y);
            break;
        case SH_DTYPE_Q6_K:
            dequant_q6_k((const sh_block_q6_k *)src + i, y);
            break;
        case SH_DTYPE_Q8_K:
            dequant_q8_k((const sh_block_q8_k *)src + i, y);
            break;
        default:
            return;
        }
    }
}
