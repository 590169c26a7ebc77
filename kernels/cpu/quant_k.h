/* The K-quant block layouts (Q2_K..Q6_K weights, Q8_K activations) and their scalar reference
 * (de)quantization, byte-compatible with ggml's. Callers normally go through sh__quant_row and
 * sh__dequant_row (quant.h), which check the type and the row length and then call these. */
#ifndef SH_KERNELS_CPU_QUANT_K_H
#define SH_KERNELS_CPU_QUANT_K_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

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

/* ggml's 4-bit non-linear types: each 4-bit code indexes SH_IQ4_VALUES (the int8 grid
 * kvalues_iq4nl, denser near zero). IQ4_NL is a block of 32 like Q4_0 (element j < 16 in the low
 * nibble of qs[j], element j + 16 in its high nibble), value = d * grid[code]. IQ4_XS is a
 * 256-element super-block of eight such 32-element sub-blocks (the same nibble order within each
 * sub-block's 16 bytes), sub-block j scaled by d * (ls_j - 32), ls_j 6 bits: the low nibble
 * in scales_l[j / 2] (at bit 4 (j % 2)) and the top two bits at bit 2j of scales_h. */
#define SH_QK_IQ4_NL 32
typedef struct sh_block_iq4_nl {
    uint16_t d;                   /* scale (fp16) */
    uint8_t qs[SH_QK_IQ4_NL / 2]; /* codes */
} sh_block_iq4_nl;

typedef struct sh_block_iq4_xs {
    uint16_t d;              /* super-block scale (fp16) */
    uint16_t scales_h;       /* top 2 bits of the eight 6-bit sub-block scales */
    uint8_t scales_l[4];     /* low 4 bits of the scales */
    uint8_t qs[SH_QK_K / 2]; /* codes, 16 bytes per 32-element sub-block */
} sh_block_iq4_xs;

/* The sixteen values the IQ4 codes stand for (ggml's kvalues_iq4nl). */
extern const int8_t SH_IQ4_VALUES[16];

_Static_assert(sizeof(sh_block_q2_k) == 84, "q2_K block");
_Static_assert(sizeof(sh_block_q3_k) == 110, "q3_K block");
_Static_assert(sizeof(sh_block_q4_k) == 144, "q4_K block");
_Static_assert(sizeof(sh_block_q5_k) == 176, "q5_K block");
_Static_assert(sizeof(sh_block_q6_k) == 210, "q6_K block");
_Static_assert(sizeof(sh_block_q8_k) == 292, "q8_K block");
_Static_assert(sizeof(sh_block_iq4_nl) == 18, "iq4_nl block");
_Static_assert(sizeof(sh_block_iq4_xs) == 136, "iq4_xs block");

/* ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this quantizes to zeros (the
 * K-quant and IQ4 quantizers). */
#define SH_QUANT_GROUP_MAX_EPS 1e-15f

/* Round to nearest, ties to even, for |f| <= 2^22 - 1: adding 1.5 * 2^23 leaves the rounded
 * integer in the low 22 bits of the mantissa (ggml's nearest_int; lrintf agrees in range but the
 * trick is what ggml computes, so it is what we compute). Out of range it returns garbage, not
 * undefined behaviour; the callers' arguments are bounded by construction. */
static inline int sh__quant_nearest_int(float f)
{
    float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* True for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K. */
bool sh__quant_k_supported(sh_dtype type);

/* Quantizes nb super-blocks (nb * 256 floats at `src`) of a K type into `dst` (nb blocks, written
 * in full), following ggml's quantize_row_*_K_ref. `type` must satisfy sh__quant_k_supported;
 * src and dst must not overlap. Any thread. */
void sh__quant_k_quantize(sh_dtype type, const float *src, void *dst, int64_t nb);

/* The inverse: nb super-blocks at `src` widened to nb * 256 floats at `dst`, with exactly the
 * float operations of ggml's dequantize_row_*_K (so the results are bit-identical). */
void sh__quant_k_dequantize(sh_dtype type, const void *src, float *dst, int64_t nb);

/* IQ4_NL (nb blocks of 32) and IQ4_XS (nb super-blocks of 256) from floats, byte-identical to
 * what llama.cpp's llama-quantize writes without an importance matrix: ggml's quantize_iq4_nl /
 * quantize_iq4_xs with weights x^2 and the 7-step scale search. (ggml's quantize_row_iq4_nl_ref
 * skips that search; llama-quantize does not, and the files are what matter.) src and dst must
 * not overlap. Any thread. (quant_iq4.c) */
void sh__quant_iq4_nl_quantize(const float *src, sh_block_iq4_nl *dst, int64_t nb);
void sh__quant_iq4_xs_quantize(const float *src, sh_block_iq4_xs *dst, int64_t nb);

/* The inverses, with the float operations of ggml's dequantize_row_iq4_nl / _xs (bit-identical
 * to ggml and to the gguf package's NumPy dequantizer). */
void sh__quant_iq4_nl_dequantize(const sh_block_iq4_nl *src, float *dst, int64_t nb);
void sh__quant_iq4_xs_dequantize(const sh_block_iq4_xs *src, float *dst, int64_t nb);

/* IQ4_XS sub-block j's 6-bit scale minus 32. */
static inline int sh__iq4_xs_scale(const sh_block_iq4_xs *b, int j)
{
    return (((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b->scales_h >> (2 * j)) & 3) << 4)) -
           32;
}

#endif
