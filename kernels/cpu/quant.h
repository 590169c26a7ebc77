/* Scalar reference conversions: fp16/bf16 <-> fp32 and row (de)quantization, byte-compatible with
 * ggml's reference quantizers so that the files Shoal writes load in llama.cpp and back. */
#ifndef SH_KERNELS_CPU_QUANT_H
#define SH_KERNELS_CPU_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "base/dtype.h"
#include "shoal/err.h"

/* IEEE binary16 from binary32, rounding to nearest even. Values from 65520 up become infinity,
 * values that fall below half the smallest subnormal become (signed) zero, NaN stays NaN (quiet,
 * keeping the top payload bits). Pure function; any thread. */
uint16_t sh__quant_fp16_from_f32(float f);

/* Exact widening of a binary16 (subnormals, infinities and NaN included). */
float sh__quant_f32_from_fp16(uint16_t h);

/* bfloat16 (the top half of a binary32) from binary32, rounding to nearest even; NaN is kept
 * and made quiet; subnormals are not flushed. Identical to ggml's GGML_FP32_TO_BF16. */
uint16_t sh__quant_bf16_from_f32(float f);

/* Exact widening of a bfloat16. */
float sh__quant_f32_from_bf16(uint16_t h);

/* ggml's 5-bit legacy blocks of 32 (block_q5_0 / block_q5_1). Element j < 16 keeps its low four
 * bits in the low nibble of qs[j], element j + 16 in the high nibble; the fifth bit of element j
 * is bit j of qh read as a little-endian uint32. Q5_0: value = d * (q - 16); Q5_1: d * q + m. */
#define SH_QK5_0 32
#define SH_QK5_1 32
typedef struct sh_block_q5_0 {
    uint16_t d;               /* scale (fp16) */
    uint8_t qh[4];            /* fifth bits, little-endian */
    uint8_t qs[SH_QK5_0 / 2]; /* low nibbles */
} sh_block_q5_0;
typedef struct sh_block_q5_1 {
    uint16_t d;               /* scale (fp16) */
    uint16_t m;               /* minimum (fp16) */
    uint8_t qh[4];            /* as q5_0 */
    uint8_t qs[SH_QK5_1 / 2]; /* as q5_0 */
} sh_block_q5_1;
_Static_assert(sizeof(sh_block_q5_0) == 22, "block_q5_0 is 22 bytes");
_Static_assert(sizeof(sh_block_q5_1) == 24, "block_q5_1 is 24 bytes");

/* True for the types sh__quant_row / sh__dequant_row handle: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K (quant_k.h; 256-element
 * blocks), IQ4_NL (32) and IQ4_XS (256; quant_iq4.c). */
bool sh__quant_supported(sh_dtype type);

/* Converts n floats from `src` to one row of `type` at `dst` (sh__dtype_row_bytes(type, n) bytes,
 * written in full), with the block semantics and rounding of ggml's quantize_row_*_ref. Returns
 * SH_EINVAL, writing nothing, when the type is not supported, n is negative or n is not a
 * multiple of the type's block size. Any thread; src and dst must not overlap. */
sh_err sh__quant_row(sh_dtype type, const float *src, void *dst, int64_t n);

/* The inverse: n elements of one row of `type` at `src` widened to floats at `dst`. Same errors
 * as sh__quant_row. */
sh_err sh__dequant_row(sh_dtype type, const void *src, float *dst, int64_t n);

#endif
