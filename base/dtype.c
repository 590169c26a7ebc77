/* Tensor element types: names and block layouts of every GGUF type id. */
#include "base/dtype.h"

#include <stddef.h>
#include <strings.h>

/* Block sizes follow ggml: 256-element super-blocks for the K-quants and most IQ types. */
static const sh_dtype_info infos[SH_DTYPE_COUNT_] = {
    [SH_DTYPE_F32] = {"F32", 1, 4},
    [SH_DTYPE_F16] = {"F16", 1, 2},
    [SH_DTYPE_Q4_0] = {"Q4_0", 32, 18},
    [SH_DTYPE_Q4_1] = {"Q4_1", 32, 20},
    [SH_DTYPE_Q5_0] = {"Q5_0", 32, 22},
    [SH_DTYPE_Q5_1] = {"Q5_1", 32, 24},
    [SH_DTYPE_Q8_0] = {"Q8_0", 32, 34},
    [SH_DTYPE_Q8_1] = {"Q8_1", 32, 36},
    [SH_DTYPE_Q2_K] = {"Q2_K", 256, 84},
    [SH_DTYPE_Q3_K] = {"Q3_K", 256, 110},
    [SH_DTYPE_Q4_K] = {"Q4_K", 256, 144},
    [SH_DTYPE_Q5_K] = {"Q5_K", 256, 176},
    [SH_DTYPE_Q6_K] = {"Q6_K", 256, 210},
    [SH_DTYPE_Q8_K] = {"Q8_K", 256, 292},
    [SH_DTYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66},
    [SH_DTYPE_IQ2_XS] = {"IQ2_XS", 256, 74},
    [SH_DTYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98},
    [SH_DTYPE_IQ1_S] = {"IQ1_S", 256, 50},
    [SH_DTYPE_IQ4_NL] = {"IQ4_NL", 32, 18},
    [SH_DTYPE_IQ3_S] = {"IQ3_S", 256, 110},
    [SH_DTYPE_IQ2_S] = {"IQ2_S", 256, 82},
    [SH_DTYPE_IQ4_XS] = {"IQ4_XS", 256, 136},
    [SH_DTYPE_I8] = {"I8", 1, 1},
    [SH_DTYPE_I16] = {"I16", 1, 2},
    [SH_DTYPE_I32] = {"I32", 1, 4},
    [SH_DTYPE_I64] = {"I64", 1, 8},
    [SH_DTYPE_F64] = {"F64", 1, 8},
    [SH_DTYPE_IQ1_M] = {"IQ1_M", 256, 56},
    [SH_DTYPE_BF16] = {"BF16", 1, 2},
    [SH_DTYPE_TQ1_0] = {"TQ1_0", 256, 54},
    [SH_DTYPE_TQ2_0] = {"TQ2_0", 256, 66},
};

const sh_dtype_info *sh__dtype_info(uint32_t type)
{
    if (type >= SH_DTYPE_COUNT_ || !infos[type].name)
        return NULL;
    return &infos[type];
}

const char *sh__dtype_name(uint32_t type)
{
    const sh_dtype_info *i = sh__dtype_info(type);
    return i ? i->name : "?";
}

bool sh__dtype_parse(const char *name, sh_dtype *out)
{
    for (uint32_t t = 0; t < SH_DTYPE_COUNT_; t++) {
        if (infos[t].name && strcasecmp(infos[t].name, name) == 0) {
            *out = (sh_dtype)t;
            return true;
        }
    }
    return false;
}

uint64_t sh__dtype_row_bytes(uint32_t type, uint64_t n)
{
    const sh_dtype_info *i = sh__dtype_info(type);
    if (!i || n % i->block_elems)
        return 0;
    return n / i->block_elems * i->block_bytes;
}
