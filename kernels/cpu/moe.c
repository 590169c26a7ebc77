/* The CPU backend's Mixture-of-Experts FFN (sh_moe_args): routing, tokens grouped per expert,
 * each expert's gate/up and down products over its group with the matmul row kernels, and the
 * per-token combination in a fixed order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/backend_cpu.h"

/* Output rows of the gate/up products per work unit: their results for a group's tokens sit in
 * the thread's scratch (2 * rows * CHUNK floats) before the SwiGLU writes them to h. */
#define CHUNK 16
/* The same for an op of one token (a decode step): longer, so that each kernel call spans enough
 * 16-row groups for the packed matvec's side-by-side streams (ops_avx512_packed.c, MV_STREAMS).
 * A row's value does not depend on the chunk it is computed in. */
#define UP_MV_CHUNK 256
/* Output rows of the down product per work unit. */
#define DOWN_CHUNK 16
/* Work units per thread handed out by the pool's counters (see exec.c for why chunks). */
#define CHUNKS_PER_THREAD 4
/* Ops of at most this many multiply-adds run on the leader alone (the hand-off costs more). */
#define ALONE_MAX 65536
/* Router widths above this are refused (the per-token marks live in scratch). */
#define MAX_EXPERTS 65536

_Static_assert(CHUNK % SH_CPU_PACK_ROWS == 0 && UP_MV_CHUNK % SH_CPU_PACK_ROWS == 0 &&
                   DOWN_CHUNK % SH_CPU_PACK_ROWS == 0,
               "work units are whole row groups of the packed kernels");

/* How a group reads one weight: the packed kernel on its matrix of the prepared copy (stride:
 * the bytes of a 16-row group), or the file layout's row kernel (stride: the bytes of a row). */
typedef struct wref {
    sh_dtype type;
    sh__cpu_mm_fn fn;
    const uint8_t *w;
    size_t stride;
    bool packed;
} wref;

/* One group of gathered rows and the FFN applied to it: a local expert chosen by at least one
 * token, or the shared expert (every token, always last). */
typedef struct group {
    wref gate, up, down; /* this expert's matrices of the 3-D tensors */
    int64_t n_ff;
    int64_t row0, rows; /* gathered rows [row0, row0 + rows), tokens in ascending order */
    int64_t hoff;       /* offset of its first h row in floats (rows of n_ff) */
    int64_t unit0_up;   /* first gate/up work unit (up_chunk rows of n_ff each) */
    int64_t unit0_down; /* first down work unit (DOWN_CHUNK rows of dim each) */
} group;

/* The scratch of the op, grown on demand by the leader and kept (a step's sizes repeat). */
struct sh__cpu_moe_scratch {
    sh__cpu_buf ids, wts, mark, slot, rowtok, groups, gsh, cnt;
    sh__cpu_buf xg, xq, xd, xs, xk; /* gathered input rows (n_rows, dim), their quantizations */
    sh__cpu_buf h, hq, hd, hs, hk;  /* hidden rows (n_rows, n_ff of their group) */
    sh__cpu_buf o;                  /* each row's FFN output (n_rows, dim) */
    sh__cpu_buf tmp;                /* per thread: gate/up chunk results, the combination row */
    size_t tmp_stride;
};

void sh__cpu_moe_fini(sh__cpu_ctx *c)
{
    sh__cpu_moe_scratch *m = c->moe;
    if (!m)
        return;
    sh__cpu_buf *bufs[] = {&m->ids, &m->wts, &m->mark, &m->slot, &m->rowtok, &m->groups, &m->gsh,
                           &m->xg,  &m->xq,  &m->xd,   &m->xs,   &m->xk,     &m->hk,     &m->h,
                           &m->hq,  &m->hd,  &m->hs,   &m->o,    &m->tmp,    &m->cnt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]->p);
    free(m);
    c->moe = NULL;
}

static bool is_float(sh_dtype t)
{
    return t == SH_DTYPE_F32 || t == SH_DTYPE_F16 || t == SH_DTYPE_BF16;
}

/* ---- argument check (enqueue) -------------------------------------------------------------- */

/* A weight (n_in, n_out, n_local) whose rows the row kernels take: n_in a multiple of 32 for
 * the 32-block quantized types and of 256 for the K-quants. */
static bool weight_ok(const sh_tensor *w, int64_t n_in, int64_t n_out, int64_t n_local)
{
    const bool type_ok = is_float(w->type) || (sh__cpu_type_q8(w->type) && n_in % SH_CPU_QK == 0) ||
                         (sh__cpu_type_k(w->type) && n_in % SH_QK_K == 0);
    return w->data && type_ok && sh__cpu_mm_for(&sh__cpu_kernels_ref, w->type) &&
           w->ne[0] == n_in && w->ne[1] == n_out && w->ne[2] == n_local && w->ne[3] == 1;
}

sh_err sh__cpu_moe_check(const sh_moe_args *a)
{
    if (!a || !a->x || !a->logits || !a->y || a->n_tok < 1 || a->k < 1 ||
        a->gating != SH_MOE_GATING_SOFTMAX || !isfinite(a->w_scale))
        return SH_EINVAL;
    const int64_t dim = a->gate.ne[0], n_ff = a->gate.ne[1], n_local = a->gate.ne[2];
    if (dim < 1 || n_ff < 1 || n_local < 1 || !weight_ok(&a->gate, dim, n_ff, n_local) ||
        !weight_ok(&a->up, dim, n_ff, n_local) || !weight_ok(&a->down, n_ff, dim, n_local))
        return SH_EINVAL;
    const int64_t n_expert = a->n_expert ? a->n_expert : a->expert0 + n_local;
    if (a->expert0 < 0 || a->expert0 + n_local > n_expert || n_expert > MAX_EXPERTS ||
        a->k > n_expert)
        return SH_EINVAL;
    if (a->gate_sh.data || a->up_sh.data || a->down_sh.data) {
        const int64_t n_ff_sh = a->gate_sh.ne[1];
        if (n_ff_sh < 1 || !weight_ok(&a->gate_sh, dim, n_ff_sh, 1) ||
            !weight_ok(&a->up_sh, dim, n_ff_sh, 1) || !weight_ok(&a->down_sh, n_ff_sh, dim, 1))
            return SH_EINVAL;
        const sh_tensor *g = &a->gate_inp_sh;
        if (g->data && (!sh__quant_supported(g->type) || g->ne[0] != dim || g->ne[1] != 1 ||
                        g->ne[2] != 1 || g->ne[3] != 1 || (!is_float(g->type) && dim % SH_CPU_QK)))
            return SH_EINVAL;
    } else if (a->gate_inp_sh.data) {
        return SH_EINVAL;
    }
    return SH_OK;
}

/* ---- routing (leader) ---------------------------------------------------------------------- */

/* Token t's k experts (largest logits first, ties to the lower index) and their weights. */
static void route_token(const sh_moe_args *a, int64_t n_expert, const float *l, uint8_t *mark,
                        int32_t *ids, float *w)
{
    memset(mark, 0, (size_t)n_expert);
    for (int32_t j = 0; j < a->k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_expert; e++)
            if (!mark[e] && (best < 0 || l[e] > l[best]))
                best = e;
        mark[best] = 1;
        ids[j] = (int32_t)best;
    }
    /* softmax over every expert (max-subtracted; the first choice holds the max), then the
     * chosen ones' probabilities */
    const float mx = l[ids[0]];
    float sum = 0.0f;
    for (int64_t e = 0; e < n_expert; e++)
        sum += expf(l[e] - mx);
    float wsum = 0.0f;
    for (int32_t j = 0; j < a->k; j++) {
        w[j] = expf(l[ids[j]] - mx) / sum;
        wsum += w[j];
    }
    for (int32_t j = 0; j < a->k; j++) {
        if (a->norm_topk)
            w[j] /= wsum;
        if (a->w_scale != 0.0f && a->w_scale != 1.0f)
            w[j] *= a->w_scale;
    }
}

static bool is_quantized(sh_dtype t) { return sh__cpu_type_q8(t) || sh__cpu_type_k(t); }

/* The row kernel for a weight type. The AVX-512 float kernels compute a lone token with four
 * accumulators and tiles of tokens with one each, so a token's sum would round differently
 * alone than inside its group; the AVX2 float kernels treat every token of a tile alike, so
 * float experts use those there and a token's result does not depend on the group it is in. */
static sh__cpu_mm_fn kernel_for(const sh__cpu_kernels *k, sh_dtype type)
{
    if (is_float(type) && k->isa == SH_BACKEND_CPU_ISA_AVX512)
        return sh__cpu_mm_for(&sh__cpu_kernels_avx2, type);
    return sh__cpu_mm_for(k, type);
}

/* Expert e (local index) of a 3-D expert tensor t, whose prepared copy is `packed` (or NULL).
 * Quantized experts read the copy when there is one (the packed kernels compute each token's
 * sums in the same order whatever the tile, as the file-layout ones do); float experts stay on
 * the file layout (see kernel_for). */
static wref expert_ref(const sh__cpu_kernels *k, const sh_tensor *t, const void *packed, int64_t e)
{
    const sh__cpu_mm_fn pfn = packed && is_quantized(t->type) ? sh__cpu_mmp_for(k, t->type) : NULL;
    if (pfn)
        return (wref){t->type, pfn,
                      (const uint8_t *)packed +
                          (size_t)e * sh__cpu_weights_mat_bytes(t->type, t->ne[1], t->ne[0]),
                      sh__cpu_pack_group_bytes(t->type, t->ne[0]), true};
    const size_t rb = sh__dtype_row_bytes(t->type, (uint64_t)t->ne[0]);
    return (wref){t->type, kernel_for(k, t->type),
                  (const uint8_t *)t->data + (size_t)e * rb * (size_t)t->ne[1], rb, false};
}

/* The weight's rows from r0 on (r0 a multiple of SH_CPU_PACK_ROWS when packed). */
static const uint8_t *rows_from(const wref *w, int64_t r0)
{
    return w->w + (size_t)(w->packed ? r0 / SH_CPU_PACK_ROWS : r0) * w->stride;
}

/* ---- the job --------------------------------------------------------------------------- */

typedef struct moe_job {
    sh__cpu_ctx *c;
    const sh_moe_args *a;
    sh__cpu_moe_scratch *m;
    const group *g;
    int n_groups;
    int64_t dim, n_rows, n_exp_rows, k1; /* k1: slots per token (k, plus 1 with a shared expert) */
    int quant_x, quant_h;                /* some weight reads the 32-block int8 form of x / h */
    int kq_x, kq_h;                      /* some weight reads the Q8_K form */
    int64_t units_up, units_down;
    int64_t up_chunk;     /* rows of a gate/up work unit: CHUNK, or UP_MV_CHUNK for one token */
    const float *gate_sh; /* the shared expert's gate row widened to f32, or NULL */
} moe_job;

/* The activation view of a group's gathered input rows. */
static sh__cpu_act x_act(const moe_job *j, const group *g)
{
    const sh__cpu_moe_scratch *m = j->m;
    const int64_t nb = j->dim / SH_CPU_QK;
    sh__cpu_act act = {
        .x = (const float *)m->xg.p + g->row0 * j->dim, .n_in = j->dim, .n_tok = g->rows};
    if (j->quant_x) {
        act.qs = (const int8_t *)m->xq.p + g->row0 * j->dim;
        act.d = (const float *)m->xd.p + g->row0 * nb;
        act.s = (const float *)m->xs.p + g->row0 * nb;
    }
    if (j->kq_x)
        act.qk = (const sh_block_q8_k *)m->xk.p + g->row0 * (j->dim / SH_QK_K);
    return act;
}

/* The activation view of a group's hidden rows. */
static sh__cpu_act h_act(const moe_job *j, const group *g)
{
    const sh__cpu_moe_scratch *m = j->m;
    sh__cpu_act act = {.x = (const float *)m->h.p + g->hoff, .n_in = g->n_ff, .n_tok = g->rows};
    if (j->quant_h) {
        act.qs = (const int8_t *)m->hq.p + g->hoff;
        act.d = (const float *)m->hd.p + g->hoff / SH_CPU_QK;
        act.s = (const float *)m->hs.p + g->hoff / SH_CPU_QK;
    }
    if (j->kq_h)
        act.qk = (const sh_block_q8_k *)m->hk.p + g->hoff / SH_QK_K;
    return act;
}

/* The group holding work unit u of a phase (unit0 ascending with the group index). */
static const group *group_of(const moe_job *j, int64_t u, int down)
{
    int lo = 0, hi = j->n_groups - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((down ? j->g[mid].unit0_down : j->g[mid].unit0_up) <= u)
            lo = mid;
        else
            hi = mid - 1;
    }
    return &j->g[lo];
}

static float *thread_tmp(const moe_job *j, int tid)
{
    return (float *)j->m->tmp.p + (size_t)tid * j->m->tmp_stride;
}

/* Gathers and quantizes input rows [r0, r1). */
static void prep_x(const moe_job *j, int64_t r0, int64_t r1)
{
    const sh__cpu_moe_scratch *m = j->m;
    const int32_t *rowtok = m->rowtok.p;
    const int64_t dim = j->dim, nb = dim / SH_CPU_QK;
    for (int64_t r = r0; r < r1; r++) {
        float *xr = (float *)m->xg.p + r * dim;
        memcpy(xr, j->a->x + (int64_t)rowtok[r] * dim, (size_t)dim * sizeof(float));
        if (j->quant_x)
            j->c->kern->quant_act(xr, dim, (int8_t *)m->xq.p + r * dim, (float *)m->xd.p + r * nb,
                                  (float *)m->xs.p + r * nb);
        if (j->kq_x) /* the scalar Q8_K quantizer on every ISA, as the matmul does */
            sh__quant_k_quantize(SH_DTYPE_Q8_K, xr, (sh_block_q8_k *)m->xk.p + r * (dim / SH_QK_K),
                                 dim / SH_QK_K);
    }
}

/* Quantizes hidden rows [r0, r1): expert rows have n_ff elements, the shared expert's (the rows
 * from n_exp_rows on) n_ff_sh. */
static void prep_h(const moe_job *j, int64_t r0, int64_t r1)
{
    const sh__cpu_moe_scratch *m = j->m;
    const group *sh = &j->g[j->n_groups - 1];
    for (int64_t r = r0; r < r1; r++) {
        const group *g = r < j->n_exp_rows ? &j->g[0] : sh;
        const int64_t n = g->n_ff, off = g->hoff + (r - g->row0) * n;
        const float *hr = (const float *)m->h.p + off;
        if (j->quant_h)
            j->c->kern->quant_act(hr, n, (int8_t *)m->hq.p + off,
                                  (float *)m->hd.p + off / SH_CPU_QK,
                                  (float *)m->hs.p + off / SH_CPU_QK);
        if (j->kq_h)
            sh__quant_k_quantize(SH_DTYPE_Q8_K, hr, (sh_block_q8_k *)m->hk.p + off / SH_QK_K,
                                 n / SH_QK_K);
    }
}

/* Gate/up unit u: up_chunk rows of n_ff for every token of its group, then SwiGLU into h. */
static void unit_up(const moe_job *j, int64_t u, float *tmp)
{
    const group *g = group_of(j, u, 0);
    const int64_t uc = j->up_chunk, c0 = (u - g->unit0_up) * uc;
    const int64_t len = g->n_ff - c0 < uc ? g->n_ff - c0 : uc;
    const sh__cpu_act act = x_act(j, g);
    float *gt = tmp, *ut = tmp + g->rows * uc;
    sh__cpu_mm mg = {&act, rows_from(&g->gate, c0), g->gate.stride, gt, uc, 0};
    sh__cpu_mm mu = {&act, rows_from(&g->up, c0), g->up.stride, ut, uc, 0};
    g->gate.fn(&mg, 0, len);
    g->up.fn(&mu, 0, len);
    float *h = (float *)j->m->h.p + g->hoff + c0;
    for (int64_t t = 0; t < g->rows; t++)
        j->c->kern->swiglu(gt + t * uc, ut + t * uc, h + t * g->n_ff, len);
}

/* Down units [u0, u1) of one group: DOWN_CHUNK rows of dim each, into o. */
static void units_down(const moe_job *j, const group *g, int64_t u0, int64_t u1)
{
    const sh__cpu_act act = h_act(j, g);
    const int64_t r0 = (u0 - g->unit0_down) * DOWN_CHUNK;
    int64_t r1 = (u1 - g->unit0_down) * DOWN_CHUNK;
    r1 = r1 < j->dim ? r1 : j->dim;
    sh__cpu_mm md = {&act,   g->down.w, g->down.stride, (float *)j->m->o.p + g->row0 * j->dim,
                     j->dim, 0};
    g->down.fn(&md, r0, r1);
}

/* Token t's output: its slots' rows weighted in router order, then the shared expert's, then
 * the add to y (one fixed order per token: see sh_moe_args). */
static void combine(const moe_job *j, int64_t t, float *acc)
{
    const sh__cpu_moe_scratch *m = j->m;
    const sh__cpu_kernels *k = j->c->kern;
    const int64_t dim = j->dim;
    const int32_t *slot = (const int32_t *)m->slot.p + t * j->k1;
    const float *w = (const float *)m->wts.p + t * j->a->k;
    const float *o = m->o.p;
    memset(acc, 0, (size_t)dim * sizeof(float));
    for (int32_t s = 0; s < j->a->k; s++)
        if (slot[s] >= 0)
            k->axpy(w[s], o + (int64_t)slot[s] * dim, acc, dim);
    if (j->k1 > j->a->k) {
        float sc = 1.0f;
        if (j->gate_sh)
            sc = 1.0f / (1.0f + expf(-k->dot(j->a->x + t * dim, j->gate_sh, dim)));
        k->axpy(sc, o + (int64_t)slot[j->a->k] * dim, acc, dim);
    }
    float *y = j->a->y + t * dim;
    if (j->a->accumulate)
        for (int64_t i = 0; i < dim; i++)
            y[i] += acc[i];
    else
        memcpy(y, acc, (size_t)dim * sizeof(float));
}

/* Pass 1: phase 0 gathers and quantizes the input rows, phase 1 the gate/up units. */
static void run_up(void *arg, int tid, int nth)
{
    moe_job *j = arg;
    sh__cpu_pool *pool = j->c->pool;
    int64_t lo, hi;
    const int64_t per0 = sh__cpu_pool_chunk(pool, j->n_rows, 2);
    while (sh__cpu_pool_claim(pool, 0, j->n_rows, per0, &lo, &hi)) {
        prep_x(j, lo, hi);
        sh__cpu_pool_finish(pool, 0, hi - lo);
    }
    sh__cpu_pool_wait_finished(pool, 0, j->n_rows);
    float *tmp = thread_tmp(j, tid);
    const int64_t per = sh__cpu_pool_chunk(pool, j->units_up, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(pool, 1, j->units_up, per, &lo, &hi))
        for (int64_t u = lo; u < hi; u++)
            unit_up(j, u, tmp);
    (void)nth;
}

/* Pass 2: phase 0 quantizes the hidden rows (when a down weight is quantized), phase 1 the down
 * units. */
static void run_down(void *arg, int tid, int nth)
{
    moe_job *j = arg;
    sh__cpu_pool *pool = j->c->pool;
    int64_t lo, hi;
    if (j->quant_h || j->kq_h) {
        const int64_t per0 = sh__cpu_pool_chunk(pool, j->n_rows, 2);
        while (sh__cpu_pool_claim(pool, 0, j->n_rows, per0, &lo, &hi)) {
            prep_h(j, lo, hi);
            sh__cpu_pool_finish(pool, 0, hi - lo);
        }
        sh__cpu_pool_wait_finished(pool, 0, j->n_rows);
    }
    const int64_t per = sh__cpu_pool_chunk(pool, j->units_down, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(pool, 1, j->units_down, per, &lo, &hi))
        while (lo < hi) { /* split the chunk at group boundaries */
            const group *g = group_of(j, lo, 1);
            int64_t end = g->unit0_down + (j->dim + DOWN_CHUNK - 1) / DOWN_CHUNK;
            end = end < hi ? end : hi;
            units_down(j, g, lo, end);
            lo = end;
        }
    (void)tid;
    (void)nth;
}

/* Pass 3: the per-token combination. */
static void run_combine(void *arg, int tid, int nth)
{
    moe_job *j = arg;
    sh__cpu_pool *pool = j->c->pool;
    int64_t lo, hi;
    float *acc = thread_tmp(j, tid);
    const int64_t per = sh__cpu_pool_chunk(pool, j->a->n_tok, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(pool, 0, j->a->n_tok, per, &lo, &hi))
        for (int64_t t = lo; t < hi; t++)
            combine(j, t, acc);
    (void)nth;
}

/* ---- exec ---------------------------------------------------------------------------------- */

#define GROW(buf, n, T)                                                                            \
    do {                                                                                           \
        if (!sh__cpu_buf_grow(&(buf), (size_t)(n) * sizeof(T)))                                    \
            return SH_ENOMEM;                                                                      \
    } while (0)

sh_err sh__cpu_moe_exec(sh__cpu_ctx *c, const sh__cpu_op *op)
{
    const sh_moe_args *a = &op->u.moe;
    if (!c->moe && !(c->moe = calloc(1, sizeof *c->moe)))
        return SH_ENOMEM;
    sh__cpu_moe_scratch *m = c->moe;
    const int64_t n_tok = a->n_tok, k = a->k, dim = a->gate.ne[0], n_ff = a->gate.ne[1];
    const int64_t n_local = a->gate.ne[2], e0 = a->expert0;
    const int64_t n_expert = a->n_expert ? a->n_expert : e0 + n_local;
    const bool shared = a->gate_sh.data != NULL;
    const int64_t k1 = k + (shared ? 1 : 0);

    /* Route every token; count the tokens per expert. */
    GROW(m->ids, n_tok * k, int32_t);
    GROW(m->wts, n_tok * k, float);
    GROW(m->mark, n_expert, uint8_t);
    GROW(m->slot, n_tok * k1, int32_t);
    GROW(m->groups, n_local + 1, group);
    GROW(m->gsh, dim, float);
    int32_t *ids = m->ids.p, *slot = m->slot.p;
    float *wts = m->wts.p;
    group *g = m->groups.p;
    for (int64_t t = 0; t < n_tok; t++)
        route_token(a, n_expert, a->logits + t * n_expert, m->mark.p, ids + t * k, wts + t * k);
    if (a->expert_tokens)
        memset(a->expert_tokens, 0, (size_t)n_expert * sizeof(int32_t));
    /* local expert e's token count, then its group index, in g[e].rows as scratch */
    GROW(m->cnt, 2 * n_local, int64_t);
    int64_t *cnt = m->cnt.p, *gidx = cnt + n_local;
    memset(cnt, 0, (size_t)n_local * sizeof(int64_t));
    for (int64_t i = 0; i < n_tok * k; i++) {
        if (a->expert_tokens)
            a->expert_tokens[ids[i]]++;
        if (ids[i] >= e0 && ids[i] < e0 + n_local)
            cnt[ids[i] - e0]++;
    }

    /* Groups in expert order, rows assigned in token order within each. */
    int n_groups = 0;
    int64_t rows = 0, hoff = 0, units_up = 0, units_down = 0;
    const int64_t down_units = (dim + DOWN_CHUNK - 1) / DOWN_CHUNK;
    const int64_t up_chunk = n_tok == 1 ? UP_MV_CHUNK : CHUNK;
    for (int64_t e = 0; e < n_local; e++) {
        gidx[e] = -1;
        if (!cnt[e])
            continue;
        gidx[e] = n_groups;
        g[n_groups++] = (group){expert_ref(c->kern, &a->gate, op->packed[0], e),
                                expert_ref(c->kern, &a->up, op->packed[1], e),
                                expert_ref(c->kern, &a->down, op->packed[2], e),
                                n_ff,
                                rows,
                                cnt[e],
                                hoff,
                                units_up,
                                units_down};
        rows += cnt[e];
        hoff += cnt[e] * n_ff;
        units_up += (n_ff + up_chunk - 1) / up_chunk;
        units_down += down_units;
    }
    const int64_t n_exp_rows = rows;
    int64_t max_rows = 0;
    for (int i = 0; i < n_groups; i++)
        max_rows = g[i].rows > max_rows ? g[i].rows : max_rows;
    if (shared) {
        const int64_t n_ff_sh = a->gate_sh.ne[1];
        g[n_groups++] = (group){expert_ref(c->kern, &a->gate_sh, op->packed[3], 0),
                                expert_ref(c->kern, &a->up_sh, op->packed[4], 0),
                                expert_ref(c->kern, &a->down_sh, op->packed[5], 0),
                                n_ff_sh,
                                rows,
                                n_tok,
                                hoff,
                                units_up,
                                units_down};
        rows += n_tok;
        hoff += n_tok * n_ff_sh;
        units_up += (n_ff_sh + up_chunk - 1) / up_chunk;
        units_down += down_units;
        max_rows = n_tok > max_rows ? n_tok : max_rows;
    }
    const int64_t n_rows = rows, h_floats = hoff;
    GROW(m->rowtok, n_rows ? n_rows : 1, int32_t);
    /* slots: each token's gathered row per chosen expert (-1: not held here), the shared last */
    int32_t *rowtok = m->rowtok.p;
    memset(cnt, 0, (size_t)n_local * sizeof(int64_t)); /* now the rows filled so far */
    for (int64_t t = 0; t < n_tok; t++) {
        for (int64_t s = 0; s < k; s++) {
            const int64_t e = ids[t * k + s] - e0;
            int32_t r = -1;
            if (e >= 0 && e < n_local) {
                r = (int32_t)(g[gidx[e]].row0 + cnt[e]++);
                rowtok[r] = (int32_t)t;
            }
            slot[t * k1 + s] = r;
        }
        if (shared) {
            slot[t * k1 + k] = (int32_t)(n_exp_rows + t);
            rowtok[n_exp_rows + t] = (int32_t)t;
        }
    }
    if (a->expert_ids)
        memcpy(a->expert_ids, ids, (size_t)(n_tok * k) * sizeof(int32_t));
    if (a->expert_w)
        memcpy(a->expert_w, wts, (size_t)(n_tok * k) * sizeof(float));

    moe_job j = {.c = c,
                 .a = a,
                 .m = m,
                 .g = g,
                 .n_groups = n_groups,
                 .dim = dim,
                 .n_rows = n_rows,
                 .n_exp_rows = n_exp_rows,
                 .k1 = k1,
                 .units_up = units_up,
                 .up_chunk = up_chunk,
                 .units_down = units_down};
    for (int i = 0; i < n_groups; i++) {
        j.quant_x |= sh__cpu_type_q8(g[i].gate.type) || sh__cpu_type_q8(g[i].up.type);
        j.kq_x |= sh__cpu_type_k(g[i].gate.type) || sh__cpu_type_k(g[i].up.type);
        j.quant_h |= sh__cpu_type_q8(g[i].down.type);
        j.kq_h |= sh__cpu_type_k(g[i].down.type);
    }
    if (shared && a->gate_inp_sh.data) {
        if (sh__dequant_row(a->gate_inp_sh.type, a->gate_inp_sh.data, m->gsh.p, dim) != SH_OK)
            return SH_EINVAL;
        j.gate_sh = m->gsh.p;
    }

    /* Buffers for the gathered rows, the hidden rows and the outputs, and per-thread scratch. */
    const size_t xr = (size_t)(n_rows * dim), nbx = xr / SH_CPU_QK, nbh = h_floats / SH_CPU_QK;
    GROW(m->xg, xr ? xr : 1, float);
    GROW(m->h, h_floats ? h_floats : 1, float);
    GROW(m->o, xr ? xr : 1, float);
    if (j.quant_x) {
        GROW(m->xq, xr, int8_t);
        GROW(m->xd, nbx, float);
        GROW(m->xs, nbx, float);
    }
    if (j.quant_h) {
        GROW(m->hq, h_floats, int8_t);
        GROW(m->hd, nbh, float);
        GROW(m->hs, nbh, float);
    }
    if (j.kq_x)
        GROW(m->xk, xr / SH_QK_K, sh_block_q8_k);
    if (j.kq_h)
        GROW(m->hk, h_floats / SH_QK_K, sh_block_q8_k);
    size_t per_thread = (size_t)(2 * up_chunk * max_rows);
    per_thread = per_thread > (size_t)dim ? per_thread : (size_t)dim;
    per_thread = (per_thread + 15) & ~(size_t)15;
    if (per_thread > m->tmp_stride) {
        GROW(m->tmp, per_thread * (size_t)sh__cpu_pool_size(c->pool), float);
        m->tmp_stride = per_thread;
    }

    /* Three passes (each needs all of the previous one): gate/up, down, combination. */
    if (n_groups) {
        const int64_t macs = (n_exp_rows * n_ff + (shared ? n_tok * a->gate_sh.ne[1] : 0)) * dim;
        void (*run)(sh__cpu_pool *, sh__cpu_job_fn, void *) =
            3 * macs <= ALONE_MAX ? sh__cpu_pool_run_alone : sh__cpu_pool_run;
        run(c->pool, run_up, &j);
        run(c->pool, run_down, &j);
    }
    if (n_tok * k1 * dim <= ALONE_MAX)
        sh__cpu_pool_run_alone(c->pool, run_combine, &j);
    else
        sh__cpu_pool_run(c->pool, run_combine, &j);
    return SH_OK;
}
