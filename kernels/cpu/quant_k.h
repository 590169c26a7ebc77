/* The K-quant block layouts (Q2_K..Q6_K weights, Q8_K activations) and their scalar reference
 * (de)quantization, byte-compatible with ggml's. Callers normally go through sh__quant_row and
 * sh__dequant_row (quant.h), which check the type and the row length and then call these. */
#ifndef SH_KERNELS_CPU_QUANT_K_H
#define SH_KERNELS_CPU_QUANT_K_H

#include <stdbool.h>
#include <stdint.h>

#include "base/dtype.h"

/* Elements per super-block of every K-quant. */
#define SH_QK_K 256

/* Layouts, field for field as ggml's block_q*_K (ggml-common.h). `d`/`dmin` are IEEE half floats
 * except Q8_K's `d`, a float. Sub-blocks are 16 elements (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K). */
typedef struct sh_block_q2_k {
    uint8_t scales[SH_QK_K / 16]; /* sub-block j: scale in the low nibble, min in the high one */
    uint8_t qs[SH_QK_K / 4];      /* 2-bit quants, four per byte (see sh__quant_k_dequantize) */
    uint16_t d;                   /* super-block scale of the scales */
    uint16_t dmin;                /* super-block scale of the mins; value = d*sc*q - dmin*m */
} sh_block_q2_k;

typedef struct sh_block_q3_k {
    uint8_t hmask[SH_QK_K / 8]; /* the third bit of each quant; a clear bit means "minus 4" */
    uint8_t qs[SH_QK_K / 4];    /* the low 2 bits */
    uint8_t scales[12];         /* sixteen 6-bit scales, stored with a bias of 32 */
    uint16_t d;                 /* value = d * (scale - 32) * (q - 4) */
} sh_block_q3_k;

typedef struct sh_block_q4_k {
    uint16_t d;         /* super-block scale of the 6-bit scales */
    uint16_t dmin;      /* super-block scale of the 6-bit mins */
    uint8_t scales[12]; /* eight 6-bit scales and eight 6-bit mins (get_scale_min in quant_k.c) */
    uint8_t qs[SH_QK_K / 2]; /* 4-bit quants; value = d*sc*q - dmin*m */
} sh_block_q4_k;

typedef struct sh_block_q5_k {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];      /* as Q4_K */
    uint8_t qh[SH_QK_K / 8]; /* the fifth bit of each quant */
    uint8_t qs[SH_QK_K / 2]; /* the low 4 bits */
} sh_block_q5_k;

typedef struct sh_block_q6_k {
    uint8_t ql[SH_QK_K / 2];     /* the low 4 bits of each quant */
    uint8_t qh[SH_QK_K / 4];     /* the high 2 bits */
    int8_t scales[SH_QK_K / 16]; /* 8-bit signed sub-block scales */
    uint16_t d;                  /* value = d * scale * (q - 32) */
} sh_block_q6_k;

typedef struct sh_block_q8_k {
    float d;                     /* value = d * q (a float, not a half) */
    int8_t qs[SH_QK_K];          /* quants */
    int16_t bsums[SH_QK_K / 16]; /* sum of each 16 quants, for the K dot products' min terms */
} sh_block_q8_k;

_Static_assert(sizeof(sh_block_q2_k) == 84, "q2_K block");
_Static_assert(sizeof(sh_block_q3_k) == 110, "q3_K block");
_Static_assert(sizeof(sh_block_q4_k) == 144, "q4_K block");
_Static_assert(sizeof(sh_block_q5_k) == 176, "q5_K block");
_Static_assert(sizeof(sh_block_q6_k) == 210, "q6_K block");
_Static_assert(sizeof(sh_block_q8_k) == 292, "q8_K block");

/* True for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K. */
bool sh__quant_k_supported(sh_dtype type);

/* Quantizes nb super-blocks (nb * 256 floats at `src`) of a K type into `dst` (nb blocks, written
 * in full), following ggml's quantize_row_*_K_ref. `type` must satisfy sh__quant_k_supported;
 * src and dst must not overlap. Any thread. */
void sh__quant_k_quantize(sh_dtype type, const float *src, void *dst, int64_t nb);

/* The inverse: nb super-blocks at `src` widened to nb * 256 floats at `dst`, with exactly the
 * float operations of ggml's dequantize_row_*_K (so the results are bit-identical). */
void sh__quant_k_dequantize(sh_dtype type, const void *src, float *dst, int64_t nb);

#endif
