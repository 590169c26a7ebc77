/* How a model pools its hidden states into one embedding (model/llama.h, sh_llama_pooling). */
#include <stdio.h>

#include "model/gguf.h"
#include "model/llama.h"

uint8_t sh_llama_pooling(const sh_llama *m)
{
    uint32_t v = 0;
    char key[64];
    if (!m || !m->gguf)
        return SH_LLAMA_POOL_MEAN;
    snprintf(key, sizeof key, "%s.pooling_type", m->hp.arch);
    if (sh_gguf_get_u32(m->gguf, key, &v) || v < SH_LLAMA_POOL_MEAN || v > SH_LLAMA_POOL_LAST)
        return SH_LLAMA_POOL_MEAN;
    return (uint8_t)v;
}
