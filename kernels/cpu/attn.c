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

/* Widens an F16 cache row into tmp; an F32 row is used in place. */
static const float *load(const sh_kv_cache *c, const void *src, float *tmp)
{
    if (c->type != SH_DTYPE_F16)
        return src;
    const uint16_t *s = src;
    for (int32_t i = 0; i < c->head_dim; i++)
        tmp[i] = sh__quant_f32_from_fp16(s[i]);
    return tmp;
}

/* Work item i is (row = i / n_heads, head = i % n_heads). scores holds one row's attention
 * weights (its context, or its window: keys t0.. are stored from scores[0]); acc is head_dim floats
 * of output plus head_dim of F16 widening. */
void sh__cpu_attn_range(const sh__cpu_kernels *k, const sh__cpu_attn *a, int64_t i0, int64_t i1,
                        float *scores, float *acc)
{
    const sh_kv_cache *c = &a->cache;
    const int32_t hd = c->head_dim, group = a->n_heads / c->n_kv_heads;
    float *tmp = acc + hd;
    for (int64_t i = i0; i < i1; i++) {
        int64_t row = i / a->n_heads;
        int32_t h = (int32_t)(i % a->n_heads), kh = h / group;
        const int32_t *blocks = a->seqs[a->row_seq[row]].blocks;
        const int64_t n_ctx = (int64_t)a->row_pos[row] + 1; /* causal: positions 0..p */
        /* a sliding window starts at p - window + 1 */
        const int64_t t0 = c->window > 0 && n_ctx > c->window ? n_ctx - c->window : 0;
        const float *q = a->q + (row * a->n_heads + h) * hd;
        /* scores_t = scale * q . K_t, then a max-subtracted softmax */
        float mx = -INFINITY;
        for (int64_t t = t0; t < n_ctx; t++) {
            const float *kt = load(c, slot(c, c->k, blocks, t, kh), tmp);
            float sc = scores[t - t0] = a->scale * k->dot(q, kt, hd);
            mx = sc > mx ? sc : mx;
        }
        float sum = 0.0f;
        for (int64_t t = t0; t < n_ctx; t++) {
            scores[t - t0] = expf(scores[t - t0] - mx);
            sum += scores[t - t0];
        }
        /* out = sum_t (e_t / sum) V_t */
        memset(acc, 0, (size_t)hd * sizeof(float));
        for (int64_t t = t0; t < n_ctx; t++) {
            const float *vt = load(c, slot(c, c->v, blocks, t, kh), tmp);
            k->axpy(scores[t - t0], vt, acc, hd);
        }
        float *out = a->out + (row * a->n_heads + h) * hd;
        const float inv = 1.0f / sum;
        for (int32_t d = 0; d < hd; d++)
            out[d] = acc[d] * inv;
    }
}
