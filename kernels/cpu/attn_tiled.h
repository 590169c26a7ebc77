/* The tiled online-softmax paged attention (FlashAttention-2's loop on a CPU), written once for
 * every ISA: attn.c (scalar), attn_avx2.c and attn_avx512.c each include this file once, after
 * defining the vector type and operations listed below, and get one function
 *   void ATT_FN(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch)
 * that computes the work items [i0, i1) of a->items (see sh__cpu_attn_items).
 *
 * An item is up to 16 (row, query head) pairs of one sequence and one KV head, one per lane, as
 * in the grouped kernel it replaces: Q is transposed (QT[d] holds the lanes' q[d], the scale
 * folded in) so a key's scores for all lanes are sum_d QT[d] K_t[d], a broadcast K element per
 * multiply-add and no horizontal sums. The keys are walked in tiles of ATT_TILE, and each lane
 * keeps a running maximum m, a running sum l and its output row O (the output buffer itself):
 *   m' = max(m, max_t s_t), alpha = e^(m - m'), l' = alpha l + sum_t e^(s_t - m'),
 *   O' = alpha O + sum_t e^(s_t - m') V_t,       and at the end out = O / l.
 * So no score row is kept: the scratch is O(tile) (sh__cpu_attn_scratch), not O(context), and
 * an F16 cache is widened once per tile and item (F16C on x86), then read as floats.
 *
 * Why the results do not depend on how rows are cut into items (a prompt prefilled at once, in
 * chunks, after a prefix-cache hit, or recomputed after preemption gives bitwise the same
 * logits, and a decode row equals the same row computed in a prefill): every lane's arithmetic
 * is independent of the other lanes, and the tiles are aligned to absolute key positions, so a
 * lane meets the same keys in the same tiles whichever item holds it. Keys an item reads that
 * lie outside a lane's causal range or window are masked to -inf for it; they leave its maximum
 * unchanged (alpha is then exactly 1, as e^0 is) and add exact zeros to l and O.
 *
 * Required definitions:
 *   ATT_FN, ATT_TGT     the function's name and its target attribute (may be empty)
 *   VL                  lanes per vector (16, 8 or 1); ATT_LP x ATT_NV: lanes x vectors of the
 *                       output held in registers by the P.V pass
 *   vec, VZERO(), VLOAD(p), VSTORE(p, v), VSET1(x), VADD(a, b), VSUB(a, b), VMUL(a, b),
 *   VMAX(a, b), VFMA(a, b, c) (= a b + c)
 *   VEXPN(x)            e^x for x <= 0; -inf gives 0
 *   VNINF0(x)           lanes equal to -inf become 0
 *   ivec, VILOAD(p)     int32 lanes
 *   VMASK(s, lo, hi, t) lanes whose key range [lo, hi] excludes key t become -inf
 *   WIDEN(dst, src, n)  n F16 values to floats */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define ATT_KEYS (VL == 1 ? 4 : 8) /* keys per step of the score pass: independent chains */
#define ATT_TILE SH_CPU_ATTN_TILE

/* The cache row of position p, KV head h: in place for F32, widened into tmp for F16. */
static inline __attribute__((always_inline)) ATT_TGT const float *
att_row(const sh_kv_cache *c, const void *pool, const int32_t *blocks, int64_t p, int32_t h,
        float *tmp)
{
    const int64_t blk = blocks[p / SH_KV_BLOCK_TOKENS];
    const int64_t row = (blk * SH_KV_BLOCK_TOKENS + p % SH_KV_BLOCK_TOKENS) * c->n_kv_heads + h;
    if (c->type != SH_DTYPE_F16)
        return (const float *)pool + row * c->head_dim;
    WIDEN(tmp, (const uint16_t *)pool + row * c->head_dim, c->head_dim);
    return tmp;
}

/* Scores of lane block b (lanes b VL ..) against the tile's n keys from ts, masked, stored as
 * st[i * 16 + lane]; then the online-softmax update of the block's m, l and alpha, with st
 * turned into the weights e^(s - m'). */
static inline __attribute__((always_inline)) ATT_TGT void
att_scores(const float *qt, int32_t hd, const float *const *kr, int n, int64_t ts,
           const int32_t *lo, const int32_t *hi, float *st, float *mx, float *sum, float *alpha)
{
    const ivec lov = VILOAD(lo), hiv = VILOAD(hi);
    vec m = VSET1(-INFINITY);
    int i = 0;
    for (; i + ATT_KEYS <= n; i += ATT_KEYS) {
        vec s[ATT_KEYS];
        for (int j = 0; j < ATT_KEYS; j++)
            s[j] = VZERO();
        for (int32_t d = 0; d < hd; d++) {
            const vec q = VLOAD(qt + d * 16);
            for (int j = 0; j < ATT_KEYS; j++)
                s[j] = VFMA(q, VSET1(kr[i + j][d]), s[j]);
        }
        for (int j = 0; j < ATT_KEYS; j++) {
            s[j] = VMASK(s[j], lov, hiv, ts + i + j);
            VSTORE(st + (i + j) * 16, s[j]);
            m = VMAX(m, s[j]);
        }
    }
    for (; i < n; i++) {
        vec s = VZERO();
        for (int32_t d = 0; d < hd; d++)
            s = VFMA(VLOAD(qt + d * 16), VSET1(kr[i][d]), s);
        s = VMASK(s, lov, hiv, ts + i);
        VSTORE(st + i * 16, s);
        m = VMAX(m, s);
    }
    /* A lane with no key so far keeps m' = -inf: it subtracts 0 instead, so its weights are
     * e^-inf = 0 and alpha e^(-inf - 0) = 0 (its O and l are still 0): never -inf - -inf. */
    const vec m_old = VLOAD(mx), m_new = VMAX(m_old, m), ms = VNINF0(m_new);
    const vec al = VEXPN(VSUB(m_old, ms));
    vec e_sum = VZERO();
    for (i = 0; i < n; i++) {
        const vec e = VEXPN(VSUB(VLOAD(st + i * 16), ms));
        VSTORE(st + i * 16, e);
        e_sum = VADD(e_sum, e);
    }
    VSTORE(sum, VADD(VMUL(VLOAD(sum), al), e_sum));
    VSTORE(mx, m_new);
    VSTORE(alpha, al);
}

/* O = alpha O + sum_i st[i][l] V_i for LP lanes from l0, output elements [d0, d0 + NV VL),
 * held in registers across the tile. */
static inline __attribute__((always_inline)) ATT_TGT void
att_pv(float *const *out, const float *st, const float *alpha, const float *const *vr, int n,
       int l0, const int LP, int32_t d0, const int NV)
{
    vec acc[ATT_LP * ATT_NV];
    for (int l = 0; l < LP; l++) {
        const vec al = VSET1(alpha[l0 + l]);
        for (int j = 0; j < NV; j++)
            acc[l * NV + j] = VMUL(VLOAD(out[l0 + l] + d0 + j * VL), al);
    }
    for (int i = 0; i < n; i++) {
        vec p[ATT_LP];
        for (int l = 0; l < LP; l++)
            p[l] = VSET1(st[i * 16 + l0 + l]);
        for (int j = 0; j < NV; j++) {
            const vec v = VLOAD(vr[i] + d0 + j * VL);
            for (int l = 0; l < LP; l++)
                acc[l * NV + j] = VFMA(p[l], v, acc[l * NV + j]);
        }
    }
    for (int l = 0; l < LP; l++)
        for (int j = 0; j < NV; j++)
            VSTORE(out[l0 + l] + d0 + j * VL, acc[l * NV + j]);
}

/* att_pv with the lane count lp (1 .. ATT_LP) made a constant, so each case unrolls. */
static inline __attribute__((always_inline)) ATT_TGT void
att_pv_lanes(float *const *out, const float *st, const float *alpha, const float *const *vr, int n,
             int l0, int lp, int32_t d0, const int NV)
{
    switch (lp) {
    case 1:
        att_pv(out, st, alpha, vr, n, l0, 1, d0, NV);
        break;
#if ATT_LP >= 2
    case 2:
        att_pv(out, st, alpha, vr, n, l0, 2, d0, NV);
        break;
#endif
#if ATT_LP >= 3
    case 3:
        att_pv(out, st, alpha, vr, n, l0, 3, d0, NV);
        break;
#endif
#if ATT_LP >= 4
    case 4:
        att_pv(out, st, alpha, vr, n, l0, 4, d0, NV);
        break;
#endif
    default:
        break;
    }
}

static ATT_TGT void att_item(const sh__cpu_attn *a, const int32_t *it, float *scratch)
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
    float *qt = scratch;                     /* (hd, 16) */
    float *st = qt + 16 * (int64_t)hd;       /* (ATT_TILE, 16) */
    float *mx = st + 16 * ATT_TILE;          /* (16) running maxima */
    float *sum = mx + 16;                    /* (16) running sums */
    float *alpha = sum + 16;                 /* (16) this tile's rescale factors */
    float *kw = alpha + 16;                  /* (ATT_TILE, hd) widened K rows */
    float *vw = kw + ATT_TILE * (int64_t)hd; /* (ATT_TILE, hd) widened V rows */
    int32_t lo[16], hi[16];
    float *out[16];
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    for (int l = 0; l < 16; l++) {
        mx[l] = -INFINITY;
        sum[l] = 0.0f;
        if (l >= lanes) { /* unused lanes: every key masked, zero queries */
            lo[l] = INT32_MAX;
            hi[l] = -1;
            for (int32_t d = 0; d < hd; d++)
                qt[d * 16 + l] = 0.0f;
            continue;
        }
        const int32_t row = it[0] + l / nh, pos = a->row_pos[row];
        lo[l] = w > 0 && pos + 1 > w ? pos + 1 - w : 0;
        hi[l] = pos;
        const float *q = a->q + ((int64_t)row * a->n_heads + it[2] + l % nh) * hd;
        for (int32_t d = 0; d < hd; d++)
            qt[d * 16 + l] = q[d] * a->scale;
        out[l] = a->out + ((int64_t)row * a->n_heads + it[2] + l % nh) * hd;
        memset(out[l], 0, (size_t)hd * sizeof(float));
    }
    const int n_blk = (lanes + VL - 1) / VL;
    for (int64_t tt = t0 - t0 % ATT_TILE; tt < n_ctx; tt += ATT_TILE) {
        const int64_t ts = tt > t0 ? tt : t0;
        const int n = (int)((tt + ATT_TILE < n_ctx ? tt + ATT_TILE : n_ctx) - ts);
        for (int i = 0; i < n; i++) {
            kr[i] = att_row(c, c->k, blocks, ts + i, kh, kw + i * (int64_t)hd);
            vr[i] = att_row(c, c->v, blocks, ts + i, kh, vw + i * (int64_t)hd);
        }
        for (int b = 0; b < n_blk; b++)
            att_scores(qt + b * VL, hd, kr, n, ts, lo + b * VL, hi + b * VL, st + b * VL,
                       mx + b * VL, sum + b * VL, alpha + b * VL);
        for (int l0 = 0; l0 < lanes; l0 += ATT_LP) {
            const int lp = lanes - l0 < ATT_LP ? lanes - l0 : ATT_LP;
            int32_t d0 = 0;
            for (; d0 + ATT_NV * VL <= hd; d0 += ATT_NV * VL)
                att_pv_lanes(out, st, alpha, vr, n, l0, lp, d0, ATT_NV);
            for (; d0 + VL <= hd; d0 += VL)
                att_pv_lanes(out, st, alpha, vr, n, l0, lp, d0, 1);
            for (; d0 < hd; d0++) /* head sizes that are not a multiple of the vector */
                for (int l = l0; l < l0 + lp; l++) {
                    float o = out[l][d0] * alpha[l];
                    for (int i = 0; i < n; i++)
                        o += st[i * 16 + l] * vr[i][d0];
                    out[l][d0] = o;
                }
        }
    }
    for (int l = 0; l < lanes; l++) { /* every lane saw its own key: l >= 1 */
        const float inv = 1.0f / sum[l];
        const vec iv = VSET1(inv);
        int32_t d = 0;
        for (; d + VL <= hd; d += VL)
            VSTORE(out[l] + d, VMUL(VLOAD(out[l] + d), iv));
        for (; d < hd; d++)
            out[l][d] *= inv;
    }
}

ATT_TGT void ATT_FN(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch)
{
    for (int64_t i = i0; i < i1; i++)
        att_item(a, a->items + 4 * i, scratch);
}
