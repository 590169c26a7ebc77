/* Tensor element types (the ggml/GGUF type ids) and their block layouts. */
#ifndef SH_BASE_DTYPE_H
#define SH_BASE_DTYPE_H

#include <stdbool.h>
#include <stdint.h>

/* Values are the GGUF on-disk type ids; gaps are ids ggml retired. */
typedef enum sh_dtype {
    SH_DTYPE_F32 = 0,
    SH_DTYPE_F16 = 1,
    SH_DTYPE_Q4_0 = 2,
    SH_DTYPE_Q4_1 = 3,
    SH_DTYPE_Q5_0 = 6,
    SH_DTYPE_Q5_1 = 7,
    SH_DTYPE_Q8_0 = 8,
    SH_DTYPE_Q8_1 = 9,
    SH_DTYPE_Q2_K = 10,
    SH_DTYPE_Q3_K = 11,
    SH_DTYPE_Q4_K = 12,
    SH_DTYPE_Q5_K = 13,
    SH_DTYPE_Q6_K = 14,
    SH_DTYPE_Q8_K = 15,
    SH_DTYPE_IQ2_XXS = 16,
    SH_DTYPE_IQ2_XS = 17,
    SH_DTYPE_IQ3_XXS = 18,
    SH_DTYPE_IQ1_S = 19,
    SH_DTYPE_IQ4_NL = 20,
    SH_DTYPE_IQ3_S = 21,
    SH_DTYPE_IQ2_S = 22,
    SH_DTYPE_IQ4_XS = 23,
    SH_DTYPE_I8 = 24,
    SH_DTYPE_I16 = 25,
    SH_DTYPE_I32 = 26,
    SH_DTYPE_I64 = 27,
    SH_DTYPE_F64 = 28,
    SH_DTYPE_IQ1_M = 29,
    SH_DTYPE_BF16 = 30,
    SH_DTYPE_TQ1_0 = 34,
    SH_DTYPE_TQ2_0 = 35,
    SH_DTYPE_COUNT_ = 36
} sh_dtype;

typedef struct sh_dtype_info {
    const char *name;     /* "Q4_1"; NULL for an id that is not a type */
    uint32_t block_elems; /* elements per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block */
} sh_dtype_info;

/* Layout of a type id, or NULL when the id is unknown (retired or out of range). */
const sh_dtype_info *sh__dtype_info(uint32_t type);

/* Name for printing; "?" for an unknown id. */
const char *sh__dtype_name(uint32_t type);

/* Parses a type name ("q4_1", case-insensitive). Returns false when unknown. */
bool sh__dtype_parse(const char *name, sh_dtype *out);

/* Bytes of one row of n elements, or 0 when n is not a multiple of the block size or the type is
 * unknown. */
uint64_t sh__dtype_row_bytes(uint32_t type, uint64_t n);

/* Block layouts of the types Shoal computes with. `d`/`m` are IEEE half floats. */
#define SH_QK4_0 32
#define SH_QK4_1 32
#define SH_QK8_0 32
typedef struct sh_block_q4_0 {
    uint16_t d;               /* scale */
    uint8_t qs[SH_QK4_0 / 2]; /* element j in low nibble of qs[j], j+16 in the high nibble */
} sh_block_q4_0;
typedef struct sh_block_q4_1 {
    uint16_t d;               /* scale */
    uint16_t m;               /* minimum */
    uint8_t qs[SH_QK4_1 / 2]; /* as q4_0; value = d * q + m */
} sh_block_q4_1;
typedef struct sh_block_q8_0 {
    uint16_t d;          /* scale */
    int8_t qs[SH_QK8_0]; /* value = d * q */
} sh_block_q8_0;

#endif
