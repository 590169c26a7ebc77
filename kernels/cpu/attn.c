/* Paged causal attention and the KV-cache store of the CPU backend. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

/* Address of position p's row for kv head h in a pool (K or V) of the cache. */
static void *slot(const sh_kv_cache *c, void *pool, const int32_t *blocks, int64_t p, int32_t h)
{
    int64_t blk = blocks[p / SH_KV_BLOCK_TOKENS];
    int64_t row = (blk * SH_KV_BLOCK_TOKENS + p % SH_KV_BLOCK_TOKENS) * c->n_kv_heads + h;
    size_t esz = c->type == SH_DTYPE_F16 ? 2 : 4;
    return (uint8_t *)pool + (size_t)row * (size_t)c->head_dim * esz;
}

static void put(const sh_kv_cache *c, void *dst, const float *src)
{
    if (c->type == SH_DTYPE_F16) {
        uint16_t *d = dst;
        for (int32_t i = 0; i < c->head_dim; i++)
            d[i] = sh__quant_fp16_from_f32(src[i]);
    } else {
        memcpy(dst, src, (size_t)c->head_dim * sizeof(float));
    }
}

void sh__cpu_kv_store_rows(const sh_kv_cache *c, const sh_attn_seq *seqs, int32_t n_seqs,
                           const float *k, const float *v)
{
    const int64_t stride = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t row = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        for (int32_t j = 0; j < seqs[s].n_rows; j++, row++) {
            int64_t p = seqs[s].pos0 + j;
            for (int32_t h = 0; h < c->n_kv_heads; h++) {
                put(c, slot(c, c->k, seqs[s].blocks, p, h), k + row * stride + h * c->head_dim);
                put(c, slot(c, c->v, seqs[s].blocks, p, h), v + row * stride + h * c->head_dim);
            }
        }
    }
}

/* The scalar instantiation of the tiled kernel: one lane per "vector", plain float arithmetic
 * (the reference the SIMD paths are tested against). */
#define ATT_FN sh__cpu_ref_attn_range
#define ATT_TGT
#define VL 1
#define ATT_LP 4
#define ATT_NV 4
#define vec float
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VMUL(a, b) ((a) * (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VEXPN(x) expf(x)
#define VNINF0(x) ((x) == -INFINITY ? 0.0f : (x))
#define ivec int32_t
#define VILOAD(p) (*(p))
#define VMASK(s, lo, hi, t) ((t) < (lo) || (t) > (hi) ? -INFINITY : (s))
#define WIDEN(dst, src, n)                                                                         \
    do {                                                                                           \
        for (int32_t d_ = 0; d_ < (n); d_++)                                                       \
            (dst)[d_] = sh__quant_f32_from_fp16((src)[d_]);                                        \
    } while (0)
#include "kernels/cpu/attn_tiled.h"

/* The tiled kernel's scratch: QT, the tile's weights, m / l / alpha and two tiles of widened
 * rows; independent of the context. */
size_t sh__cpu_attn_scratch(int32_t head_dim)
{
    return (size_t)(16 * (int64_t)head_dim + 16 * SH_CPU_ATTN_TILE + 48 +
                    2 * (int64_t)SH_CPU_ATTN_TILE * head_dim + 16);
}
