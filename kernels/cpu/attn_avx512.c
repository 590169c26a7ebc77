/* AVX-512 paged causal attention: the query heads that share a KV head (grouped-query attention)
 * are processed together, so each cached K and V row is read (and widened from F16) once per
 * group instead of once per head, and the softmax exponentials are vectorized. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* exp(x) for x <= 0 (scores minus their maximum), as in ops_avx512.c: x = n ln2 + f, e^f by its
 * degree-6 Taylor polynomial, scaled by 2^n; arguments below -87 give 0. */
INL __m512 exp_neg(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    /* below e^-87 the result would be subnormal: return 0 there instead (subnormal operands
     * cost a microcode assist per instruction on x86, and such terms are below rounding anyway) */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ),
                               _mm512_scalef_ps(p, n));
}

INL __mmask16 tail_mask(int64_t left)
{
    return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
}

/* The cache row of position p, kv head h, as floats: in place for F32, widened into tmp for
 * F16. */
INL const float *kv_row(const sh_kv_cache *c, const void *pool, const int32_t *blocks, int64_t p,
                        int32_t h, float *tmp)
{
    const int64_t blk = blocks[p / SH_KV_BLOCK_TOKENS];
    const int64_t row = (blk * SH_KV_BLOCK_TOKENS + p % SH_KV_BLOCK_TOKENS) * c->n_kv_heads + h;
    if (c->type != SH_DTYPE_F16)
        return (const float *)pool + row * c->head_dim;
    const uint16_t *s = (const uint16_t *)pool + row * c->head_dim;
    for (int32_t d = 0; d < c->head_dim; d += 16) {
        const __mmask16 k = tail_mask(c->head_dim - d);
        _mm512_mask_storeu_ps(tmp + d, k,
                              _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const void *)(s + d))));
    }
    return tmp;
}

/* Keys per step of the lane kernel's score pass: independent FMA chains. */
#define KEYS 8

/* out_l = sum_t P[t][l] V_t for LP lanes from l0, NV vectors of 16 per row held in registers
 * (LP * NV <= 16), scaled by inv[l]. */
INL void pv_regs(const sh__cpu_attn *a, const int32_t *it, const float *st, const float *inv,
                 int64_t t0, int64_t n_ctx, const int32_t *blocks, int32_t kh, int l0, const int LP,
                 const int NV, float *tmp)
{
    const sh_kv_cache *c = &a->cache;
    const int32_t hd = c->head_dim, nh = it[3];
    __m512 acc[16];
    for (int i = 0; i < LP * NV; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t t = t0; t < n_ctx; t++) {
        const float *vt = kv_row(c, c->v, blocks, t, kh, tmp);
        __m512 v[16];
        for (int j = 0; j < NV; j++)
            v[j] = _mm512_loadu_ps(vt + 16 * j);
        for (int l = 0; l < LP; l++) {
            const __m512 p = _mm512_set1_ps(st[(t - t0) * 16 + l0 + l]);
            for (int j = 0; j < NV; j++)
                acc[l * NV + j] = _mm512_fmadd_ps(p, v[j], acc[l * NV + j]);
        }
    }
    for (int l = 0; l < LP; l++) {
        const int lane = l0 + l;
        float *out = a->out + ((it[0] + lane / nh) * a->n_heads + it[2] + lane % nh) * hd;
        for (int j = 0; j < NV; j++)
            _mm512_storeu_ps(out + 16 * j,
                             _mm512_mul_ps(acc[l * NV + j], _mm512_set1_ps(inv[l0 + l])));
    }
}

/* A prefill item: up to 16 (row, head) pairs of one sequence and KV head side by side, one per
 * vector lane. With Q transposed (QT[d] = the lanes' q[d], scale folded in), the scores of key t
 * are sum_d QT[d] K_t[d] (a broadcast K element per FMA, no horizontal sums), stored as ST[t]
 * (16 lanes); the causal mask, max, exp and sums are then lane-wise vector ops, and the V pass
 * broadcasts each lane's weight over V_t. */
INL void item_lanes(const sh__cpu_attn *a, const int32_t *it, float *scratch)
{
    const sh_kv_cache *c = &a->cache;
    const int32_t hd = c->head_dim, group = a->n_heads / c->n_kv_heads;
    const int32_t kh = it[2] / group, nh = it[3], lanes = it[1] * it[3];
    const int32_t *blocks = a->seqs[a->row_seq[it[0]]].blocks;
    const int64_t n_ctx = (int64_t)a->row_pos[it[0] + it[1] - 1] + 1;
    /* With a sliding window the item's keys start at its first row's window; later rows mask the
     * keys before theirs. */
    const int32_t w = c->window;
    const int64_t p0 = a->row_pos[it[0]];
    const int64_t t0 = w > 0 && p0 + 1 > w ? p0 + 1 - w : 0;
    float *qt = scratch, *st = qt + 16 * (int64_t)hd, *tmp = st + 16 * (n_ctx - t0);
    int32_t pos[16];
    for (int l = 0; l < 16; l++) {
        pos[l] = l < lanes ? a->row_pos[it[0] + l / nh] : -1; /* unused lanes: all masked */
        const float *q = a->q + ((it[0] + (l < lanes ? l / nh : 0)) * a->n_heads + it[2] +
                                 (l < lanes ? l % nh : 0)) *
                                    hd;
        for (int32_t d = 0; d < hd; d++)
            qt[d * 16 + l] = l < lanes ? q[d] * a->scale : 0.0f;
    }
    const __m512i posv = _mm512_loadu_si512((const void *)pos);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    int64_t t = t0;
    for (; t + KEYS <= n_ctx; t += KEYS) {
        const float *k[KEYS];
        for (int i = 0; i < KEYS; i++)
            k[i] = kv_row(c, c->k, blocks, t + i, kh, tmp + i * hd);
        __m512 s[KEYS];
        for (int i = 0; i < KEYS; i++)
            s[i] = _mm512_setzero_ps();
        for (int32_t d = 0; d < hd; d++) {
            const __m512 q = _mm512_loadu_ps(qt + d * 16);
            for (int i = 0; i < KEYS; i++)
                s[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(k[i][d]), s[i]);
        }
        for (int i = 0; i < KEYS; i++) {
            __mmask16 late = _mm512_cmplt_epi32_mask(posv, _mm512_set1_epi32((int)(t + i)));
            if (w > 0) /* key t + i is before lane l's window when pos_l >= t + i + w */
                late |= _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32((int)(t + i + w)));
            s[i] = _mm512_mask_mov_ps(s[i], late, ninf);
            mx = _mm512_max_ps(mx, s[i]);
            _mm512_storeu_ps(st + (t + i - t0) * 16, s[i]);
        }
    }
    for (; t < n_ctx; t++) {
        const float *k = kv_row(c, c->k, blocks, t, kh, tmp);
        __m512 s = _mm512_setzero_ps();
        for (int32_t d = 0; d < hd; d++)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * 16), _mm512_set1_ps(k[d]), s);
        __mmask16 late = _mm512_cmplt_epi32_mask(posv, _mm512_set1_epi32((int)t));
        if (w > 0)
            late |= _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32((int)(t + w)));
        s = _mm512_mask_mov_ps(s, late, ninf);
        mx = _mm512_max_ps(mx, s);
        _mm512_storeu_ps(st + (t - t0) * 16, s);
    }
    /* e^(s - max) per lane (masked keys give 0); unused lanes compute NaN, never stored */
    __m512 sum = _mm512_setzero_ps();
    for (t = t0; t < n_ctx; t++) {
        const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(st + (t - t0) * 16), mx));
        _mm512_storeu_ps(st + (t - t0) * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    if (hd == 64) {
        int l = 0;
        for (; l + 4 <= lanes; l += 4)
            pv_regs(a, it, st, inv, t0, n_ctx, blocks, kh, l, 4, 4, tmp);
        for (; l < lanes; l++)
            pv_regs(a, it, st, inv, t0, n_ctx, blocks, kh, l, 1, 4, tmp);
        return;
    }
    /* other head sizes: accumulate in the output rows (zeroed first) */
    for (int l = 0; l < lanes; l++)
        memset(a->out + ((it[0] + l / nh) * a->n_heads + it[2] + l % nh) * hd, 0,
               (size_t)hd * sizeof(float));
    for (t = t0; t < n_ctx; t++) {
        const float *vt = kv_row(c, c->v, blocks, t, kh, tmp);
        for (int l = 0; l < lanes; l++) {
            float *out = a->out + ((it[0] + l / nh) * a->n_heads + it[2] + l % nh) * hd;
            const __m512 p = _mm512_set1_ps(st[(t - t0) * 16 + l] * inv[l]);
            for (int32_t d = 0; d < hd; d += 16) {
                const __mmask16 k = tail_mask(hd - d);
                _mm512_mask_storeu_ps(out + d, k,
                                      _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, vt + d),
                                                      _mm512_maskz_loadu_ps(k, out + d)));
            }
        }
    }
}

/* Every item, decode rows included, goes through the lane kernel: a (row, head) pair's arithmetic
 * is then the same whichever item it shares, so a row's output does not depend on how the rows
 * were cut into chunks. A prompt computed in one step, in chunks, after a prefix-cache hit, or
 * recomputed after preemption gives bitwise the same logits (with quantized weights a last-bit
 * difference in one activation can grow to tenths of a logit over 30 layers and flip a greedy
 * pick). At the contexts measured (32 sequences, 40-120 keys) it is as fast as the per-row
 * kernel it replaced. */
TGT void sh__cpu_avx512_attn_range(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch)
{
    for (int64_t i = i0; i < i1; i++)
        item_lanes(a, a->items + 4 * i, scratch);
}

#endif

/* The lane kernel's needs: QT, ST and KEYS widened rows. */
size_t sh__cpu_attn_scratch(int64_t max_ctx, int32_t head_dim)
{
    return (size_t)(16 * (int64_t)head_dim + 16 * max_ctx + 8 * (int64_t)head_dim + 16);
}

/* Items: per sequence and KV head, rows in runs of 16 / group (so that rows x heads fill the
 * 16 lanes), all the group's heads; a group wider than 16 heads is cut into runs of 16 heads of
 * single rows. Decode rows (one per sequence) become single-row items. */
int64_t sh__cpu_attn_max_items(int64_t n_rows, int32_t n_seqs, int32_t n_heads)
{
    return (n_rows + n_seqs) * ((int64_t)n_heads + SH_CPU_ATTN_LANES - 1);
}

int64_t sh__cpu_attn_items(const sh_attn_seq *seqs, int32_t n_seqs, int32_t n_heads,
                           int32_t n_kv_heads, int32_t *items)
{
    const int32_t group = n_heads / n_kv_heads;
    const int32_t rows_per = group >= SH_CPU_ATTN_LANES ? 1 : SH_CPU_ATTN_LANES / group;
    const int32_t heads_per = group >= SH_CPU_ATTN_LANES ? SH_CPU_ATTN_LANES : group;
    int64_t n = 0;
    int32_t row0 = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        for (int32_t r = 0; r < seqs[s].n_rows; r += rows_per) {
            const int32_t nr = seqs[s].n_rows - r < rows_per ? seqs[s].n_rows - r : rows_per;
            for (int32_t kh = 0; kh < n_kv_heads; kh++)
                for (int32_t h = 0; h < group; h += heads_per, n++) {
                    items[4 * n] = row0 + r;
                    items[4 * n + 1] = nr;
                    items[4 * n + 2] = kh * group + h;
                    items[4 * n + 3] = group - h < heads_per ? group - h : heads_per;
                }
        }
        row0 += seqs[s].n_rows;
    }
    return n;
}
