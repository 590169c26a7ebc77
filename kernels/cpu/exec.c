/* Runs the CPU backend's ops on its worker pool: scratch sizing, the work chunks of each op, and
 * the choice of packed or file-layout kernels. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/quant.h"

/* Output rows per fused-SwiGLU chunk: the gate and up results of a chunk sit in the thread's
 * scratch (2 * n_tok * CHUNK floats) before they are combined. */
#define SWIGLU_CHUNK 16
/* The same for one token (a decode step): longer, so that each kernel call spans enough 16-row
 * groups for the packed matvec's side-by-side streams (ops_avx512_packed.c, MV_STREAMS). */
#define SWIGLU_MV_CHUNK 512
/* The same for a prefill whose kernels compute in BF16 (the AMX level): its kernel call
 * dequantizes the call's weights once per token block and streams the bf16 activations past
 * them, so 16-row calls would stream the activations once per 16 rows (tinyllama's 5632 x 2048
 * gate at 512 tokens, 1 thread, direct kernel calls: 16-row calls 460-485 GFLOP/s, 128-row ones
 * 540-670, one call for all rows 600-690, on a loaded VM). */
#define SWIGLU_BF16_CHUNK 128
/* Row alignment of the work chunks: whole 16-row groups of the packed kernels (and of the
 * file-layout kernels' row groups). */
#define ROW_ALIGN 16

bool sh__cpu_buf_grow(sh__cpu_buf *b, size_t bytes)
{
    if (b->cap >= bytes)
        return true;
    size_t cap = (bytes + bytes / 4 + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, cap);
    if (!p)
        return false;
    free(b->p);
    b->p = p;
    b->cap = cap;
    return true;
}

void sh__cpu_scratch_fini(sh__cpu_ctx *c)
{
    sh__cpu_buf *bufs[] = {&c->xn, &c->qs, &c->qd,     &c->qsum, &c->qk,
                           &c->xt, &c->xb, &c->rowmap, &c->tmp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]->p);
}

/* Per-thread work areas of at least `floats` floats each. */
static bool grow_tmp(sh__cpu_ctx *c, size_t floats)
{
    size_t stride = (floats + 15) & ~(size_t)15; /* 64-byte aligned per thread */
    if (stride <= c->tmp_stride)
        return true;
    if (!sh__cpu_buf_grow(&c->tmp, stride * sizeof(float) * (size_t)sh__cpu_pool_size(c->pool)))
        return false;
    c->tmp_stride = stride;
    return true;
}

static float *thread_tmp(sh__cpu_ctx *c, int tid)
{
    return (float *)c->tmp.p + tid * c->tmp_stride;
}

/* ---- matmul -------------------------------------------------------------------------------- */

/* Work is handed out in chunks from the pool's counters (sh__cpu_pool_claim) rather than split
 * statically: on a shared machine a thread is often preempted for milliseconds, and with a static
 * split the whole op would wait for it, while with chunks the running threads take over its
 * share. CHUNKS_PER_THREAD chunks per thread keep the counter traffic at a few atomics per op.
 * Which thread computes a row does not change its value (every row's sum runs the same
 * instructions), so results stay bit-identical across thread counts. */
#define CHUNKS_PER_THREAD 4
/* Matmul inputs up to this many elements are normalized and quantized by the leader before the
 * job starts (a decode token: well under a microsecond), which saves the helpers a wait. */
#define PREP_INLINE_MAX 32768
/* Matmuls of at most this many multiply-adds run on the leader alone: below it the hand-off to
 * a helper (about a microsecond on this machine type) costs more than the helper saves. */
#define MM_ALONE_MAX 65536

typedef struct mm_job {
    sh__cpu_ctx *c;
    const sh_matmul_args *a;
    const void *const *packed; /* (n_w) packed copies or NULL */
    sh__cpu_glu_fn glu;        /* the gated activation (SWIGLU, GEGLU), else NULL */
    sh__cpu_act act;
    int prep_norm, prep_quant, prep_qk, prep_xt, prep_xb;
    int64_t glu_step; /* gated matmuls of several tokens: output rows per kernel call */
} mm_job;

/* How one weight is read: its kernel, base pointer and stride. A packed weight's stride is one
 * 16-row group; row offsets into it must then be multiples of 16 (ROW_ALIGN and SWIGLU_CHUNK
 * are). */
typedef struct wview {
    sh__cpu_mm_fn fn;
    const uint8_t *base;
    size_t stride;
    int64_t rows_per_stride;
} wview;

static wview view_of(const sh__cpu_kernels *k, const sh_tensor *w, const void *packed)
{
    const int64_t n_in = w->ne[0];
    if (packed)
        return (wview){sh__cpu_mmp_for(k, w->type), packed, sh__cpu_pack_group_bytes(w->type, n_in),
                       SH_CPU_PACK_ROWS};
    return (wview){sh__cpu_mm_for(k, w->type), w->data,
                   sh__dtype_row_bytes(w->type, (uint64_t)n_in), 1};
}

/* The view's rows starting at row r0 (a multiple of rows_per_stride). */
static const uint8_t *view_at(const wview *v, int64_t r0)
{
    return v->base + (size_t)(r0 / v->rows_per_stride) * v->stride;
}

static void mm_swiglu_range(mm_job *j, const wview *vg, const wview *vu, float *g, float *u,
                            int64_t lo, int64_t hi);
static void mm_rows_range(mm_job *j, int64_t lo, int64_t hi);

/* Normalizes and/or quantizes input tokens [t0, t1). */
static void mm_prep(const mm_job *j, int64_t t0, int64_t t1)
{
    const sh_matmul_args *a = j->a;
    const sh__cpu_kernels *k = j->c->kern;
    const int64_t n_in = j->act.n_in, nb = n_in / SH_CPU_QK;
    if (j->prep_norm)
        sh__cpu_rmsnorm_rows(k, a->x, a->norm, a->norm_eps, n_in, (float *)j->act.x, t0, t1);
    if (j->prep_quant)
        for (int64_t t = t0; t < t1; t++)
            k->quant_act(j->act.x + t * n_in, n_in, (int8_t *)j->act.qs + t * n_in,
                         (float *)j->act.d + t * nb, (float *)j->act.s + t * nb);
    if (j->prep_qk) /* the scalar Q8_K quantizer on every ISA: the same codes everywhere */
        sh__quant_k_quantize(SH_DTYPE_Q8_K, j->act.x + t0 * n_in,
                             (sh_block_q8_k *)j->act.qk + t0 * (n_in / SH_QK_K),
                             (t1 - t0) * (n_in / SH_QK_K));
    if (j->prep_xt)
        sh__cpu_act_transpose(&j->act, t0, t1);
    if (j->prep_xb)
        k->act_bf16(&j->act, t0, t1);
}

static void mm_run(void *arg, int tid, int nth)
{
    mm_job *j = arg;
    const sh_matmul_args *a = j->a;
    const sh__cpu_kernels *k = j->c->kern;
    sh__cpu_pool *pool = j->c->pool;
    int64_t lo, hi;

    /* Phase 0: normalize and/or quantize the input rows, by token chunks; every thread then
     * waits for all of them (each output row needs every token). */
    if (j->prep_norm || j->prep_quant || j->prep_qk || j->prep_xt || j->prep_xb) {
        /* chunks of whole 16-token tiles (the transposition's unit) */
        const int64_t per = (sh__cpu_pool_chunk(pool, a->n_tok, 2) + 15) & ~(int64_t)15;
        while (sh__cpu_pool_claim(pool, 0, a->n_tok, per, &lo, &hi)) {
            mm_prep(j, lo, hi);
            sh__cpu_pool_finish(pool, 0, hi - lo);
        }
        sh__cpu_pool_wait_finished(pool, 0, a->n_tok);
    }

    /* Phase 1: output rows, in chunks of SWIGLU_CHUNK / ROW_ALIGN (16) rows. */
    if (j->glu) {
        const int64_t n_ff = a->w[0].ne[1];
        const wview vg = view_of(k, &a->w[0], j->packed[0]);
        const wview vu = view_of(k, &a->w[1], j->packed[1]);
        float *g = thread_tmp(j->c, tid);
        const int64_t cs = j->glu_step; /* claimed in these units, a multiple of 16 */
        float *u = g + (a->n_tok == 1 ? SWIGLU_MV_CHUNK : a->n_tok * cs);
        const int64_t units = (n_ff + cs - 1) / cs;
        const int64_t per = sh__cpu_pool_chunk(pool, units, CHUNKS_PER_THREAD);
        while (sh__cpu_pool_claim(pool, 1, units, per, &lo, &hi))
            mm_swiglu_range(j, &vg, &vu, g, u, lo * cs, hi * cs < n_ff ? hi * cs : n_ff);
        return;
    }
    /* The weights' rows are one concatenated range, so Q/K/V of unequal heights balance too. */
    int64_t total = 0;
    for (int i = 0; i < a->n_w; i++)
        total += a->w[i].ne[1];
    const int64_t units = (total + ROW_ALIGN - 1) / ROW_ALIGN;
    const int64_t per = sh__cpu_pool_chunk(pool, units, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(pool, 1, units, per, &lo, &hi))
        mm_rows_range(j, lo * ROW_ALIGN, hi * ROW_ALIGN < total ? hi * ROW_ALIGN : total);
    (void)nth;
}

/* Gate and up rows [lo, hi) (lo a multiple of glu_step) with SwiGLU, via the thread's scratch
 * g, u (step rows x n_tok each: glu_step, or SWIGLU_MV_CHUNK for one token). */
static void mm_swiglu_range(mm_job *j, const wview *vg, const wview *vu, float *g, float *u,
                            int64_t lo, int64_t hi)
{
    const sh_matmul_args *a = j->a;
    const int64_t n_ff = a->w[0].ne[1], step = a->n_tok == 1 ? SWIGLU_MV_CHUNK : j->glu_step;
    for (int64_t c0 = lo; c0 < hi; c0 += step) {
        int64_t len = hi - c0 < step ? hi - c0 : step;
        sh__cpu_mm mg = {&j->act, view_at(vg, c0), vg->stride, g, step, 0};
        sh__cpu_mm mu = {&j->act, view_at(vu, c0), vu->stride, u, step, 0};
        vg->fn(&mg, 0, len);
        vu->fn(&mu, 0, len);
        for (int64_t t = 0; t < a->n_tok; t++)
            j->glu(g + t * step, u + t * step, a->y[0] + t * n_ff + c0, len);
    }
}

/* Rows [lo, hi) of the concatenation of the op's weights. */
static void mm_rows_range(mm_job *j, int64_t lo, int64_t hi)
{
    const sh_matmul_args *a = j->a;
    const sh__cpu_kernels *k = j->c->kern;
    int64_t base = 0;
    for (int i = 0; i < a->n_w; i++) {
        const int64_t n_out = a->w[i].ne[1];
        int64_t r0 = lo - base, r1 = hi - base;
        r0 = r0 < 0 ? 0 : r0;
        r1 = r1 > n_out ? n_out : r1;
        if (r0 < r1) {
            const wview v = view_of(k, &a->w[i], j->packed[i]);
            sh__cpu_mm m = {&j->act, v.base, v.stride, a->y[i], n_out, a->accumulate};
            v.fn(&m, r0, r1);
        }
        base += n_out;
    }
}

static sh_err exec_matmul(sh__cpu_ctx *c, const sh__cpu_op *op)
{
    const sh_matmul_args *a = &op->u.mm;
    const int64_t n_in = a->w[0].ne[0], n_tok = a->n_tok, nb = n_in / SH_CPU_QK;
    mm_job j = {
        .c = c, .a = a, .packed = op->packed, .act = {.x = a->x, .n_in = n_in, .n_tok = n_tok}};
    /* Each weight type reads one activation form (sh__cpu_type_q8 / _k); a fused matmul over
     * weights of both kinds (a Q5_0 wq beside a Q4_K wv) prepares both. */
    int any_q = 0, any_k = 0;
    for (int i = 0; i < a->n_w; i++) {
        any_q |= sh__cpu_type_q8(a->w[i].type);
        any_k |= sh__cpu_type_k(a->w[i].type);
    }
    const size_t nx = (size_t)(n_tok * n_in);
    if (a->norm) {
        if (!sh__cpu_buf_grow(&c->xn, nx * sizeof(float)))
            return SH_ENOMEM;
        j.act.x = c->xn.p;
        j.prep_norm = 1;
    }
    if (any_q) {
        if (!sh__cpu_buf_grow(&c->qs, nx) ||
            !sh__cpu_buf_grow(&c->qd, (size_t)(n_tok * nb) * sizeof(float)) ||
            !sh__cpu_buf_grow(&c->qsum, (size_t)(n_tok * nb) * sizeof(float)))
            return SH_ENOMEM;
        j.act.qs = c->qs.p;
        j.act.d = c->qd.p;
        j.act.s = c->qsum.p;
        j.prep_quant = 1;
    }
    if (any_k) {
        if (!sh__cpu_buf_grow(&c->qk, (size_t)(n_tok * (n_in / SH_QK_K)) * sizeof(sh_block_q8_k)))
            return SH_ENOMEM;
        j.act.qk = c->qk.p;
        j.prep_qk = 1;
    }
    for (int i = 0; i < a->n_w && n_tok > 1; i++)
        j.prep_xt |= a->w[i].type == SH_DTYPE_F16 && op->packed[i] != NULL;
    if (j.prep_xt) {
        if (!sh__cpu_buf_grow(&c->xt, (size_t)((n_tok + 15) / 16 * 16 * n_in) * sizeof(float)))
            return SH_ENOMEM;
        j.act.xt = c->xt.p;
    }
    /* The AMX level's bf16 activations, for a prefill through packed 32-block weights (their
     * kernels then compute in BF16; the int8 codes are still made, for any other weight of the
     * op and as the kernels' fallback when their panel memory cannot be had). */
    for (int i = 0; i < a->n_w && c->kern->act_bf16 && n_tok >= SH_CPU_BF16_MIN_TOK; i++)
        j.prep_xb |= sh__cpu_type_q8(a->w[i].type) && op->packed[i] != NULL;
    if (j.prep_xb) {
        if (!sh__cpu_buf_grow(&c->xb, (size_t)((n_tok + 15) / 16 * 16 * n_in) * sizeof(uint16_t)))
            return SH_ENOMEM;
        j.act.xb = c->xb.p;
    }
    j.glu = a->act == SH_MATMUL_ACT_SWIGLU  ? c->kern->swiglu
            : a->act == SH_MATMUL_ACT_GEGLU ? sh__cpu_geglu_for(c->kern->isa)
                                            : NULL;
    j.glu_step = j.prep_xb ? SWIGLU_BF16_CHUNK : SWIGLU_CHUNK;
    if (j.glu && !grow_tmp(c, (size_t)(n_tok == 1 ? 2 * SWIGLU_MV_CHUNK : 2 * n_tok * j.glu_step)))
        return SH_ENOMEM;
    if ((j.prep_norm || j.prep_quant || j.prep_qk || j.prep_xt || j.prep_xb) &&
        n_tok * n_in <= PREP_INLINE_MAX) {
        mm_prep(&j, 0, n_tok);
        j.prep_norm = j.prep_quant = j.prep_qk = j.prep_xt = j.prep_xb = 0;
    }
    int64_t rows = 0;
    for (int i = 0; i < a->n_w; i++)
        rows += a->w[i].ne[1];
    if (rows * n_in * n_tok <= MM_ALONE_MAX)
        sh__cpu_pool_run_alone(c->pool, mm_run, &j);
    else
        sh__cpu_pool_run(c->pool, mm_run, &j);
    return SH_OK;
}

/* ---- attention ----------------------------------------------------------------------------- */

typedef struct attn_job {
    sh__cpu_ctx *c;
    sh__cpu_attn a;
    int64_t items;
} attn_job;

static void attn_run(void *arg, int tid, int nth)
{
    attn_job *j = arg;
    int64_t lo, hi;
    const int64_t per = sh__cpu_pool_chunk(j->c->pool, j->items, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(j->c->pool, 0, j->items, per, &lo, &hi))
        j->c->kern->attn_group(&j->a, lo, hi, thread_tmp(j->c, tid));
    (void)nth;
}

static sh_err exec_attn(sh__cpu_ctx *c, const sh__cpu_op *op)
{
    const sh_attn_batch *b = &op->u.attn.b;
    const int64_t rows = op->u.attn.n_rows;
    /* The tiled kernel's scratch depends on the head size only, so it is allocated on the first
     * call and never grows as sequences lengthen (no allocation per decoded token). */
    const int64_t max_items = sh__cpu_attn_max_items(rows, b->n_seqs, op->u.attn.n_heads);
    if (!sh__cpu_buf_grow(&c->rowmap, (size_t)(2 * rows + 4 * max_items) * sizeof(int32_t)) ||
        !grow_tmp(c, sh__cpu_attn_scratch(op->u.attn.cache.head_dim)))
        return SH_ENOMEM;
    int32_t *row_seq = c->rowmap.p, *row_pos = row_seq + rows;
    for (int32_t s = 0, r = 0; s < b->n_seqs; s++)
        for (int32_t i = 0; i < b->seqs[s].n_rows; i++, r++) {
            row_seq[r] = s;
            row_pos[r] = b->seqs[s].pos0 + i;
        }
    /* The items follow the rows (see sh__cpu_attn_items). */
    int32_t *items = row_pos + rows;
    const int64_t n_items = sh__cpu_attn_items(b->seqs, b->n_seqs, op->u.attn.n_heads,
                                               op->u.attn.cache.n_kv_heads, items);
    attn_job j = {.c = c,
                  .a = {op->u.attn.cache, b->seqs, row_seq, row_pos, op->u.attn.q, op->u.attn.out,
                        op->u.attn.n_heads, op->u.attn.scale, items},
                  .items = n_items};
    sh__cpu_pool_run(c->pool, attn_run, &j);
    return SH_OK;
}

/* ---- row-wise and elementwise ops ---------------------------------------------------------- */

typedef struct simple_job {
    sh__cpu_ctx *c;
    const sh__cpu_op *op;
} simple_job;

static void softmax_row(float *x, int64_t n, float scale)
{
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        mx = scale * x[i] > mx ? scale * x[i] : mx;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(scale * x[i] - mx);
        sum += x[i];
    }
    for (int64_t i = 0; i < n; i++)
        x[i] /= sum;
}

/* The work of a row-wise or elementwise op: n units handed out `align` at a time, and a size
 * estimate in elements. */
static int64_t simple_units(const sh__cpu_op *op, int64_t *align, int64_t *elems)
{
    *align = 1;
    switch (op->kind) {
    case SH__CPU_OP_RMSNORM:
        *elems = op->u.norm.n_tok * op->u.norm.n;
        return op->u.norm.n_tok;
    case SH__CPU_OP_ROPE:
        *elems = op->u.rope.n_tok * op->u.rope.n_heads * op->u.rope.head_dim;
        return op->u.rope.n_tok;
    case SH__CPU_OP_SWIGLU:
    case SH__CPU_OP_ADD:
        *align = 64;
        *elems = op->u.ew.n;
        return op->u.ew.n;
    case SH__CPU_OP_SCALE:
    case SH__CPU_OP_SOFTCAP:
        *align = 64;
        *elems = op->u.ew1.n;
        return op->u.ew1.n;
    case SH__CPU_OP_EMBED:
        *elems = op->u.embed.n_tok * op->u.embed.t.ne[0];
        return op->u.embed.n_tok;
    case SH__CPU_OP_SOFTMAX:
    case SH__CPU_OP_ARGMAX:
        *elems = op->u.rows.n_rows * op->u.rows.n;
        return op->u.rows.n_rows;
    default:
        *elems = 0;
        return 0;
    }
}

/* Units [lo, hi) of a row-wise or elementwise op. */
static void simple_range(const sh__cpu_ctx *c, const sh__cpu_op *op, int64_t lo, int64_t hi)
{
    switch (op->kind) {
    case SH__CPU_OP_RMSNORM:
        sh__cpu_rmsnorm_rows(c->kern, op->u.norm.x, op->u.norm.w, op->u.norm.eps, op->u.norm.n,
                             op->u.norm.y, lo, hi);
        break;
    case SH__CPU_OP_ROPE:
        sh__cpu_rope_range(op->u.rope.x, op->u.rope.pos, op->u.rope.n_heads, op->u.rope.head_dim,
                           op->u.rope.n_rot, op->u.rope.base, op->u.rope.scale, op->u.rope.mode, lo,
                           hi);
        break;
    case SH__CPU_OP_SWIGLU:
        c->kern->swiglu(op->u.ew.a + lo, op->u.ew.b + lo, op->u.ew.y + lo, hi - lo);
        break;
    case SH__CPU_OP_ADD:
        for (int64_t i = lo; i < hi; i++)
            op->u.ew.y[i] = op->u.ew.a[i] + op->u.ew.b[i];
        break;
    case SH__CPU_OP_SCALE:
        sh__cpu_scale_range(op->u.ew1.x, op->u.ew1.s, op->u.ew1.y, lo, hi);
        break;
    case SH__CPU_OP_SOFTCAP:
        sh__cpu_softcap_range(op->u.ew1.x, op->u.ew1.s, op->u.ew1.y, lo, hi);
        break;
    case SH__CPU_OP_EMBED: {
        const sh_tensor *t = &op->u.embed.t;
        const int64_t dim = t->ne[0];
        const size_t rb = sh__dtype_row_bytes(t->type, (uint64_t)dim);
        for (int64_t i = lo; i < hi; i++) {
            int32_t id = op->u.embed.ids[i];
            float *y = op->u.embed.y + i * dim;
            if (id < 0 || id >= t->ne[1]) {
                memset(y, 0, (size_t)dim * sizeof(float));
            } else if (op->packed[0]) { /* one block at a time back to the file layout */
                const int64_t bk = sh__cpu_type_k(t->type) ? SH_QK_K : SH_CPU_QK;
                uint8_t blk[256];
                for (int64_t b = 0; b < dim / bk; b++) {
                    sh__cpu_unpack_block(t->type, op->packed[0], dim, id, b, blk);
                    sh__dequant_row(t->type, blk, y + b * bk, bk);
                }
            } else
                sh__dequant_row(t->type, (const uint8_t *)t->data + (size_t)id * rb, y, dim);
        }
        break;
    }
    case SH__CPU_OP_SOFTMAX:
        for (int64_t r = lo; r < hi; r++)
            softmax_row(op->u.rows.x + r * op->u.rows.n, op->u.rows.n, op->u.rows.scale);
        break;
    case SH__CPU_OP_ARGMAX:
        for (int64_t r = lo; r < hi; r++) {
            const float *x = op->u.rows.x + r * op->u.rows.n;
            int64_t best = 0;
            for (int64_t i = 1; i < op->u.rows.n; i++)
                if (x[i] > x[best])
                    best = i;
            op->u.rows.out[r] = (int32_t)best;
        }
        break;
    default:
        break;
    }
}

static void simple_run(void *arg, int tid, int nth)
{
    simple_job *j = arg;
    int64_t align, elems, lo, hi;
    const int64_t n = simple_units(j->op, &align, &elems);
    const int64_t units = (n + align - 1) / align;
    const int64_t per = sh__cpu_pool_chunk(j->c->pool, units, CHUNKS_PER_THREAD);
    while (sh__cpu_pool_claim(j->c->pool, 0, units, per, &lo, &hi))
        simple_range(j->c, j->op, lo * align, hi * align < n ? hi * align : n);
    (void)tid;
    (void)nth;
}

/* Row-wise and elementwise ops this small run on the leader alone: handing them to the pool
 * costs more than the work (a decode step's residual add or norm is a few hundred floats). */
#define SIMPLE_INLINE_MAX 8192

sh_err sh__cpu_exec(sh__cpu_ctx *c, const sh__cpu_op *op)
{
    switch (op->kind) {
    case SH__CPU_OP_COPY:
        if (op->u.copy.bytes)
            memmove(op->u.copy.dst, op->u.copy.src, op->u.copy.bytes);
        return SH_OK;
    case SH__CPU_OP_HOST_FN:
        op->u.host.fn(op->u.host.arg);
        return SH_OK;
    case SH__CPU_OP_MATMUL:
        return exec_matmul(c, op);
    case SH__CPU_OP_KV_STORE:
        sh__cpu_kv_store_rows(&op->u.kv.cache, op->u.kv.b.seqs, op->u.kv.b.n_seqs, op->u.kv.k,
                              op->u.kv.v);
        return SH_OK;
    case SH__CPU_OP_ATTN:
        return exec_attn(c, op);
    case SH__CPU_OP_MOE:
        return sh__cpu_moe_exec(c, op);
    default: {
        int64_t align, elems;
        const int64_t n = simple_units(op, &align, &elems);
        if (elems <= SIMPLE_INLINE_MAX) {
            simple_range(c, op, 0, n);
            return SH_OK;
        }
        simple_job j = {c, op};
        sh__cpu_pool_run(c->pool, simple_run, &j);
        return SH_OK;
    }
    }
}
