/* The Llama-family forward pass (llama, mistral, qwen2, qwen3, gemma3, phi3 and the MoE forms): a
 * batch of sequences' tokens through a stage's layers, against the backend interface, with a
 * paged KV cache and workspace allocated once per context. */
#include "model/llama.h"
#include "model/llama_rope.h"
#include "model/llama_tp.h"
#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/file.h"

/* One all-reduce enqueued on the stream. */
struct llama_ar {
    sh_llama_ctx *c;
    float *buf;
    size_t n;
    int32_t layer;
};

struct sh_llama_ctx {
    const sh_llama *m;
    sh_backend *be;
    sh_backend_stream *st;
    sh_llama_ctx_opts o;
    int32_t last; /* layers [m->first, last) run: m->last, or o.exit_layer (early exit) */
    int32_t n_blocks;
    int32_t kv_window;    /* sh_llama_kv_window: blocks before it may be released (-1) */
    sh_rope_scaling rope; /* the model's RoPE scaling for this context's size */
    sh_kv_cache *kv;      // (n_layers, tp.n_parts); only layers [first, last) allocated
    // Workspace, backend buffers sized for max_tokens rows.
    float *x; // (max_tokens, dim) the residual stream
    /* q, k, v and att hold one (max_tokens, heads * head_dim) block per attention part of the
     * rank (sh_llama_tp; one part for a whole model), at qoff / kvoff floats. */
    float *q;      // (max_tokens, tp.n_heads * head_dim)
    float *k;      // (max_tokens, tp.n_kv_heads * head_dim)
    float *v;      // (max_tokens, tp.n_kv_heads * head_dim)
    float *att;    // (max_tokens, tp.n_heads * head_dim) attention output
    float *ff;     // (max_tokens, tp.n_ff) act(gate) * up
    float *y;      // (max_tokens, dim) a block's output before its post-norm (gemma3) or the
                   // all-reduce (tensor parallel); else NULL
    float *xo;     // (max_logits, dim) the rows whose logits are wanted
    float *logits; // (max_logits, n_vocab)
    // Tensor parallel (tp.size > 1; else NULL):
    sh_llama_comm comm; /* size 0 unless the model is a rank of a group of 2 or more */
    float *lg_local;    // (max_logits, tp.vocab_pad) this rank's rows of the logits
    float *gather;      // (tp.size, max_logits, tp.vocab_pad) every rank's, gathered
    /* top1_only: (max_logits) the rows' picks; a rank's own over its vocabulary share, and
     * (tp.size, max_logits) every rank's, gathered */
    sh_llama_top1 *top1, *top1_part, *top1_all;
    size_t qoff[SH_LLAMA_TP_PARTS], kvoff[SH_LLAMA_TP_PARTS]; /* each part's block */
    sh_error cerr;                                            /* a failed collective's message */
    bool cfailed;
    /* The all-reduces of a forward pass, each run by the backend's thread when its stream
     * reaches it (host_fn): the host enqueues a whole pass without waiting for the backend at
     * every collective, and the backend's thread is never left idle between a collective and
     * the next op. ar_fail: the layer whose all-reduce failed (-1: none this pass). */
    struct llama_ar *ar;
    int32_t n_ar, max_ar, ar_layer, ar_fail;
    sh_err ar_rc;
    int32_t *ids; // (max_tokens) token ids
    int32_t *pos; // (max_tokens) positions
    // MoE layers only (hp.n_expert > 0; else NULL):
    float *hn;               // (max_tokens, dim) the normalized FFN input the experts read
    float *router;           // (max_tokens, n_expert) router logits
    int32_t *moe_cnt;        // (n_layers, n_expert) tokens per expert in this step
    int32_t *moe_ids;        // (n_layers, max_tokens, n_expert_used) chosen experts in this step
    int32_t *h_moe_cnt;      // host copies of the two above
    int32_t *h_moe_ids;      //
    uint64_t *expert_tokens; // (n_layers, n_expert) totals since creation
    // Host-side step description, reused every call.
    int32_t *h_ids;    // (max_tokens)
    int32_t *h_pos;    // (max_tokens)
    sh_attn_seq *seqs; // (max_seqs)
    bool prepared;     /* the stage's matrices were handed to sh_backend_weight_prepare */
    uint8_t *tp_holds; /* what this context does with the rank's own copies (llama_tp.c) */
};

/* Calls fn on every matrix the stage multiplies by (not the embedding table when it only looks
 * rows up); stops at the first error. */
static sh_err each_matrix(const sh_llama *m, int32_t last,
                          sh_err (*fn)(const sh_llama *, sh_backend *, const sh_tensor *),
                          sh_backend *be)
{
    sh_err err = SH_OK;
    for (int32_t l = m->first; l < last && !err; l++) {
        const sh_llama_layer *L = &m->layers[l];
        const sh_tensor *ws[] = {&L->wq,     &L->wk,   &L->wv,     &L->wo,
                                 &L->w_gate, &L->w_up, &L->w_down, &L->ffn_gate_inp};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0] && !err; i++)
            if (ws[i]->data)
                err = fn(m, be, ws[i]);
        for (int32_t p = 0; p + 1 < m->tp.n_parts && !err; p++) {
            const struct sh_llama_attn_w *w = &L->tp_part[p];
            const sh_tensor *ps[] = {&w->wq, &w->wk, &w->wv, &w->wo};
            for (size_t i = 0; i < 4 && !err; i++)
                err = fn(m, be, ps[i]);
        }
        /* A MoE layer's router is an ordinary matmul (above). Its experts (3-D stacks, and the
         * shared expert) are read by the MoE op, which reads float experts in the file layout
         * whatever was prepared (a token's sums must not depend on the tokens beside it), so only
         * quantized experts are handed over. */
        const sh_tensor *xs[] = {&L->gate_exps,  &L->up_exps,  &L->down_exps,
                                 &L->gate_shexp, &L->up_shexp, &L->down_shexp};
        for (size_t i = 0; i < sizeof xs / sizeof xs[0] && !err; i++)
            if (xs[i]->data && sh__dtype_info(xs[i]->type)->block_elems > 1)
                err = fn(m, be, xs[i]);
    }
    if (!err && m->last == m->hp.n_layers && m->output.data)
        err = fn(m, be, &m->output);
    return err;
}

/* Prepares one matrix; when the backend now holds its own copy and reads the file's bytes no
 * more, drops the mapping's pages of them right away, so that the model is resident once (and
 * the load never holds much more than the file: one matrix in both forms at a time). */
static sh_err prepare_one(const sh_llama *m, sh_backend *be, const sh_tensor *w)
{
    if (sh__llama_tp_owns(m, w->data))
        return SH_OK; /* a tensor-parallel rank's own copy: sh__llama_tp_hold prepares it */
    sh_err err = sh_backend_weight_prepare(be, w);
    if (err == SH_EUNSUPPORTED)
        return SH_OK; /* a backend without it reads w as it is */
    if (!err && m->file_mapped && sh_backend_weight_copied(be, w))
        sh__file_drop(w->data, sh__dtype_row_bytes(w->type, (uint64_t)w->ne[0]) * (size_t)w->ne[1] *
                                   (size_t)w->ne[2]);
    return err;
}

static sh_err release_one(const sh_llama *m, sh_backend *be, const sh_tensor *w)
{
    if (!sh__llama_tp_owns(m, w->data)) /* (sh__llama_tp_let_go releases those) */
        sh_backend_weight_release(be, w->data);
    return SH_OK;
}

/* A backend buffer, or NULL with *err set (and nothing done when *err is already set), so that
 * a run of allocations needs one check at the end. */
static void *alloc(sh_llama_ctx *c, size_t bytes, sh_err *err, sh_error *e)
{
    void *p = NULL;
    if (*err)
        return NULL;
    if ((*err = sh_backend_buf_alloc(c->be, bytes ? bytes : 1, &p)))
        sh__error_set(e, *err, "llama: cannot allocate %zu bytes of workspace", bytes);
    return p;
}

sh_err sh_llama_ctx_create(const sh_llama *m, sh_backend *be, const sh_llama_ctx_opts *opts,
                           sh_llama_ctx **out, sh_error *e)
{
    *out = NULL;
    sh_llama_ctx_opts o = *opts;
    if (o.kv_type == 0)
        o.kv_type = SH_DTYPE_F32;
    if (o.max_logits == 0)
        o.max_logits = o.max_seqs;
    if (o.max_tokens <= 0 || o.max_seqs <= 0 || o.max_seqs > o.max_tokens || o.kv_tokens <= 0 ||
        o.max_logits < 0 || o.max_logits > o.max_tokens ||
        (o.kv_type != SH_DTYPE_F32 && o.kv_type != SH_DTYPE_F16))
        return sh__error_set(e, SH_EINVAL,
                             "llama: context options max_tokens %d, max_seqs %d, max_logits %d, "
                             "kv_tokens %d, kv_type %d",
                             (int)o.max_tokens, (int)o.max_seqs, (int)o.max_logits,
                             (int)o.kv_tokens, (int)o.kv_type);
    const sh_llama_tp *tp = &m->tp;
    if (o.exit_layer != 0 && (m->first != 0 || m->last != m->hp.n_layers || tp->size > 1 ||
                              o.exit_layer < 1 || o.exit_layer > m->hp.n_layers))
        return sh__error_set(e, SH_EINVAL,
                             "llama: an early exit after layer %d needs a whole model of at least "
                             "that many layers (this one: layers [%d, %d) of %d, %d ranks)",
                             (int)o.exit_layer, (int)m->first, (int)m->last, (int)m->hp.n_layers,
                             (int)(tp->size > 1 ? tp->size : 1));
    const sh_llama_comm *cm = &o.comm;
    const bool has = cm->size > 0 && cm->allreduce && cm->allgather;
    if ((tp->size > 1 && !has) || (has && (cm->rank != tp->rank || cm->size != tp->size)))
        return sh__error_set(e, SH_EINVAL,
                             "llama: the model is rank %d of a tensor-parallel group of %d; the "
                             "context's collective group is %s",
                             (int)tp->rank, (int)tp->size,
                             !has                   ? "missing"
                             : cm->size != tp->size ? "of another size"
                                                    : "of another rank");
    /* The collectives read and write the workspace from the host. */
    if (tp->size > 1 && strcmp(be->iface->name, "cpu") != 0)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "llama: tensor parallelism runs on the cpu backend only, not %s",
                             be->iface->name);
    sh_llama_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return sh__error_set(e, SH_ENOMEM, "llama: out of memory");
    c->m = m;
    c->be = be;
    c->o = o;
    c->last = o.exit_layer ? o.exit_layer : m->last;
    c->ar_fail = -1;
    if (tp->size > 1) {
        c->comm = o.comm;
        c->max_ar = 2 * (c->last - m->first) + 2; /* attention and FFN (or MoE) per layer */
    }
    const sh_llama_hparams *hp = &m->hp;
    size_t T = (size_t)o.max_tokens, f = sizeof(float);
    size_t qd = (size_t)tp->n_heads * hp->head_dim, kvd = (size_t)tp->n_kv_heads * hp->head_dim;
    size_t np = (size_t)tp->n_parts;
    for (size_t p = 0, hq = 0, hk = 0; p < np; p++) {
        c->qoff[p] = T * hq * (size_t)hp->head_dim;
        c->kvoff[p] = T * hk * (size_t)hp->head_dim;
        hq += (size_t)tp->part[p].n_heads;
        hk += (size_t)tp->part[p].n_kv_heads;
    }
    bool head = m->last == hp->n_layers;
    sh_err err = SH_OK;
    c->n_blocks = (o.kv_tokens + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    c->kv_window = sh_llama_kv_window(hp);
    c->rope = sh__llama_rope_for_ctx(m, o.kv_tokens);
    /* Gemma's embedding scale and logit soft-capping are optional backend ops. */
    if ((hp->embd_scale != 1.0f && m->first == 0 && !be->iface->scale) ||
        (hp->final_softcap > 0.0f && head && !be->iface->softcap)) {
        free(c);
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "llama: the %s backend lacks the scale or "
                             "softcap op that %s needs",
                             be->iface->name, hp->arch);
    }
    c->kv = calloc((size_t)hp->n_layers * np, sizeof *c->kv);
    c->h_ids = malloc(T * sizeof *c->h_ids);
    c->h_pos = malloc(T * sizeof *c->h_pos);
    c->seqs = malloc((size_t)o.max_seqs * sizeof *c->seqs);
    c->ar = c->max_ar ? calloc((size_t)c->max_ar, sizeof *c->ar) : NULL;
    if (!c->kv || !c->h_ids || !c->h_pos || !c->seqs || (c->max_ar && !c->ar)) {
        err = sh__error_set(e, SH_ENOMEM, "llama: out of memory");
        goto fail;
    }
    if ((err = sh_backend_stream_create(be, &c->st, e)))
        goto fail;
    c->x = alloc(c, T * hp->dim * f, &err, e);
    c->q = alloc(c, T * qd * f, &err, e);
    c->k = alloc(c, T * kvd * f, &err, e);
    c->v = alloc(c, T * kvd * f, &err, e);
    c->att = alloc(c, T * qd * f, &err, e);
    c->ff = alloc(c, T * (size_t)tp->n_ff * f, &err, e);
    if (hp->post_norms || tp->size > 1)
        c->y = alloc(c, T * hp->dim * f, &err, e);
    c->ids = alloc(c, T * sizeof(int32_t), &err, e);
    c->pos = alloc(c, T * sizeof(int32_t), &err, e);
    if (hp->n_expert > 0) {
        const size_t ne = (size_t)hp->n_expert, nl = (size_t)hp->n_layers;
        const size_t nid = nl * T * (size_t)hp->n_expert_used;
        c->hn = alloc(c, T * hp->dim * f, &err, e);
        c->router = alloc(c, T * ne * f, &err, e);
        c->moe_cnt = alloc(c, nl * ne * sizeof(int32_t), &err, e);
        c->moe_ids = alloc(c, nid * sizeof(int32_t), &err, e);
        c->h_moe_cnt = calloc(nl * ne, sizeof(int32_t));
        c->h_moe_ids = calloc(nid, sizeof(int32_t));
        c->expert_tokens = calloc(nl * ne, sizeof(uint64_t));
        if (!err && (!c->h_moe_cnt || !c->h_moe_ids || !c->expert_tokens))
            err = sh__error_set(e, SH_ENOMEM, "llama: out of memory");
    }
    if (head) {
        c->xo = alloc(c, (size_t)o.max_logits * hp->dim * f, &err, e);
        c->logits = alloc(c, (size_t)o.max_logits * hp->n_vocab * f, &err, e);
        if (tp->size > 1) {
            size_t share = (size_t)o.max_logits * (size_t)tp->vocab_pad * f;
            c->lg_local = alloc(c, share, &err, e);
            c->gather = alloc(c, (size_t)tp->size * share, &err, e);
        }
        const size_t nt = (size_t)o.max_logits;
        c->top1 = calloc(nt, sizeof *c->top1);
        c->top1_part = calloc(nt, sizeof *c->top1_part);
        c->top1_all = calloc(nt * (size_t)tp->size, sizeof *c->top1_all);
        if (!err && (!c->top1 || !c->top1_part || !c->top1_all))
            err = sh__error_set(e, SH_ENOMEM, "llama: out of memory");
    }
    // The KV pool: per layer (and attention part), n_blocks pages of 16 positions of every KV
    // head this rank reads.
    size_t elt = o.kv_type == SH_DTYPE_F16 ? 2 : 4;
    for (int32_t l = m->first; l < c->last; l++)
        for (size_t p = 0; p < np; p++) {
            sh_kv_cache *kc = &c->kv[(size_t)l * np + p];
            size_t kv_bytes = (size_t)c->n_blocks * SH_KV_BLOCK_TOKENS *
                              (size_t)tp->part[p].n_kv_heads * (size_t)hp->head_dim * elt;
            kc->type = o.kv_type;
            kc->n_blocks = c->n_blocks;
            kc->n_kv_heads = tp->part[p].n_kv_heads;
            kc->head_dim = hp->head_dim;
            kc->window = sh_llama_layer_slides(hp, l) ? hp->sliding_window : 0;
            kc->k = alloc(c, kv_bytes, &err, e);
            kc->v = alloc(c, kv_bytes, &err, e);
        }
    if (err)
        goto fail;
    /* Let the backend repack the matrices for its fast kernels (DESIGN section 6: weights
     * repacked for the SIMD width). Contexts sharing a model and backend share the copies. A
     * failure releases what was prepared so far (destroy does it). */
    if (!o.no_weight_prepare) {
        c->prepared = true;
        if ((err = each_matrix(m, c->last, prepare_one, be))) {
            sh__error_set(e, err, "llama: cannot prepare the weights for the backend: %s",
                          sh_strerror(err));
            goto fail;
        }
    }
    /* A tensor-parallel rank's own copies of row-parallel slices: prepared like the rest, and
     * dropped while every live context's backend holds its own copy of them. */
    if ((err = sh__llama_tp_hold(m, be, !o.no_weight_prepare, &c->tp_holds, e)))
        goto fail;
    *out = c;
    return SH_OK;
fail:
    sh_llama_ctx_destroy(c);
    return err;
}

void sh_llama_ctx_destroy(sh_llama_ctx *c)
{
    if (!c)
        return;
    sh_backend *be = c->be;
    if (c->st)
        sh_backend_stream_destroy(be, c->st); // syncs first
    if (c->prepared)
        each_matrix(c->m, c->last, release_one, be);
    sh__llama_tp_let_go(c->m, be, c->tp_holds);
    if (c->kv)
        for (size_t i = (size_t)c->m->first * (size_t)c->m->tp.n_parts;
             i < (size_t)c->last * (size_t)c->m->tp.n_parts; i++) {
            sh_backend_buf_free(be, c->kv[i].k);
            sh_backend_buf_free(be, c->kv[i].v);
        }
    void *bufs[] = {c->x,      c->q,       c->k,       c->v,        c->att,   c->ff,
                    c->y,      c->xo,      c->logits,  c->ids,      c->pos,   c->hn,
                    c->router, c->moe_cnt, c->moe_ids, c->lg_local, c->gather};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        sh_backend_buf_free(be, bufs[i]);
    free(c->kv);
    free(c->h_ids);
    free(c->h_pos);
    free(c->seqs);
    free(c->h_moe_cnt);
    free(c->h_moe_ids);
    free(c->expert_tokens);
    free(c->top1);
    free(c->top1_part);
    free(c->top1_all);
    free(c->ar);
    free(c);
}

int32_t sh_llama_ctx_n_blocks(const sh_llama_ctx *c) { return c->n_blocks; }

int32_t sh_llama_ctx_max_logits(const sh_llama_ctx *c) { return c->o.max_logits; }

size_t sh_llama_tp_coll_bytes(const sh_llama *m, const sh_llama_ctx_opts *o)
{
    const sh_llama_tp *tp = &m->tp;
    if (tp->size <= 1)
        return 0;
    size_t n = (size_t)o->max_tokens * (size_t)m->hp.dim * sizeof(float);
    size_t nl = (size_t)(o->max_logits ? o->max_logits : o->max_seqs);
    size_t g = (size_t)tp->size * nl * (size_t)tp->vocab_pad * sizeof(float);
    return m->last == m->hp.n_layers && g > n ? g : n;
}

const uint64_t *sh_llama_ctx_expert_tokens(const sh_llama_ctx *c, int32_t l)
{
    const sh_llama *m = c->m;
    if (m->hp.n_expert <= 0 || l < m->first || l >= c->last)
        return NULL;
    return c->expert_tokens + (size_t)l * m->hp.n_expert;
}

const int32_t *sh_llama_ctx_expert_ids(const sh_llama_ctx *c, int32_t l)
{
    const sh_llama *m = c->m;
    if (m->hp.n_expert <= 0 || l < m->first || l >= c->last)
        return NULL;
    return c->h_moe_ids + (size_t)l * c->o.max_tokens * m->hp.n_expert_used;
}

/* Checks the batch and fills the host-side ids, positions and attention split. */
static sh_err prepare(sh_llama_ctx *c, const sh_llama_batch *b, int32_t *n_tok, int32_t *n_out,
                      sh_error *e)
{
    const sh_llama *m = c->m;
    if (b->n_seqs <= 0 || b->n_seqs > c->o.max_seqs)
        return sh__error_set(e, SH_EINVAL, "llama: %d sequences in a step (at most %d)",
                             (int)b->n_seqs, (int)c->o.max_seqs);
    int32_t t = 0, nl = 0;
    for (int32_t s = 0; s < b->n_seqs; s++) {
        const sh_llama_seq *q = &b->seqs[s];
        if (q->n_tokens <= 0 || q->n_tokens > c->o.max_tokens - t)
            return sh__error_set(e, SH_EINVAL, "llama: step of more than %d tokens (sequence %d)",
                                 (int)c->o.max_tokens, (int)s);
        int64_t end = (int64_t)q->pos0 + q->n_tokens;
        // Without a sliding window every position holds a block of the pool; with one in every
        // layer, a sequence may run past the pool (its early blocks released).
        int64_t limit =
            c->kv_window > 0 ? (int64_t)1 << 30 : (int64_t)c->n_blocks * SH_KV_BLOCK_TOKENS;
        if (q->pos0 < 0 || end > limit || !q->blocks)
            return sh__error_set(e, SH_EINVAL, "llama: sequence %d positions [%d, %lld)", (int)s,
                                 (int)q->pos0, (long long)end);
        int32_t nb = (int32_t)((end + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS);
        // With a sliding window in every layer, blocks wholly before the first row's window are
        // never read and may have been released (-1).
        int32_t w = c->kv_window, first = 0;
        if (w > 0 && q->pos0 - w + 1 > 0)
            first = (q->pos0 - w + 1) / SH_KV_BLOCK_TOKENS;
        for (int32_t j = 0; j < nb; j++)
            if (!(j < first && q->blocks[j] == -1) &&
                (q->blocks[j] < 0 || q->blocks[j] >= c->n_blocks))
                return sh__error_set(e, SH_EINVAL, "llama: sequence %d block %d is %d (pool %d)",
                                     (int)s, (int)j, (int)q->blocks[j], (int)c->n_blocks);
        for (int32_t j = 0; j < q->n_tokens; j++) {
            if (m->first == 0) {
                if (!q->tokens || q->tokens[j] < 0 || q->tokens[j] >= m->hp.n_vocab)
                    return sh__error_set(e, SH_EINVAL, "llama: sequence %d token %d is %d", (int)s,
                                         (int)j, q->tokens ? (int)q->tokens[j] : -1);
                c->h_ids[t + j] = q->tokens[j];
            }
            c->h_pos[t + j] = q->pos0 + j;
        }
        c->seqs[s] = (sh_attn_seq){q->n_tokens, q->pos0, q->blocks};
        t += q->n_tokens;
        if (q->n_logits < 0 || q->n_logits > q->n_tokens)
            return sh__error_set(e, SH_EINVAL, "llama: sequence %d wants %d rows of logits of %d",
                                 (int)s, (int)q->n_logits, (int)q->n_tokens);
        nl += q->n_logits ? q->n_logits : q->want_logits;
    }
    if (b->all_logits)
        nl = t;
    if (m->last == m->hp.n_layers && nl > c->o.max_logits)
        return sh__error_set(e, SH_EINVAL, "llama: %d rows of logits wanted (at most %d)", (int)nl,
                             (int)c->o.max_logits);
    if (m->first > 0 && !b->hidden_in)
        return sh__error_set(e, SH_EINVAL, "llama: stage from layer %d needs hidden_in",
                             (int)m->first);
    *n_tok = t;
    *n_out = nl;
    return SH_OK;
}

/* Adds a bias vector to every row (qwen2's Q/K/V biases). */
static sh_err add_rows(sh_llama_ctx *c, float *x, const float *bias, int32_t n_tok, int64_t n)
{
    sh_err err = SH_OK;
    for (int32_t t = 0; t < n_tok && !err; t++)
        err = sh_backend_add(c->be, c->st, x + t * n, bias, n, x + t * n);
    return err;
}

/* Enqueues one op; on failure records which one for the error message. */
#define TRY(name, call)                                                                            \
    do {                                                                                           \
        if ((err = (call))) {                                                                      \
            *what = name;                                                                          \
            return err;                                                                            \
        }                                                                                          \
    } while (0)

/* x += out W^T, or with a post-norm (gemma3) x += rmsnorm(out W^T) * post_norm. */
static sh_err project_add(sh_llama_ctx *c, const sh_tensor *w, const float *in,
                          const float *post_norm, int32_t n_tok)
{
    const sh_llama_hparams *hp = &c->m->hp;
    if (!post_norm)
        return sh_backend_matmul_add(c->be, c->st, w, in, n_tok, c->x);
    sh_err err;
    int64_t n = (int64_t)n_tok * hp->dim;
    if ((err = sh_backend_matmul(c->be, c->st, w, in, n_tok, c->y)) ||
        (err =
             sh_backend_rmsnorm(c->be, c->st, c->y, post_norm, hp->norm_eps, n_tok, hp->dim, c->y)))
        return err;
    return sh_backend_add(c->be, c->st, c->x, c->y, n, c->x);
}

/* Runs on the backend's thread in stream order; after a failure the pass's later all-reduces are
 * skipped (the group is broken) and the host reports the first at its sync. */
static void allreduce_fn(void *arg)
{
    const struct llama_ar *a = arg;
    sh_llama_ctx *c = a->c;
    if (c->ar_fail >= 0)
        return;
    sh_err rc = c->comm.allreduce(c->comm.ud, a->buf, a->n, &c->cerr);
    if (rc) {
        c->ar_rc = rc;
        c->ar_fail = a->layer;
    }
}

/* Sums buf (n floats) over the ranks of a tensor-parallel group, in place, once the ops enqueued
 * so far have run: enqueued for the backend's thread (allreduce_fn; tensor parallelism runs on
 * the cpu backend, which has host functions). A failure keeps the collective's message for the
 * forward call's error. */
static sh_err allreduce(sh_llama_ctx *c, float *buf, size_t n)
{
    if (c->n_ar == c->max_ar)
        return SH_EINVAL; /* more than the two a layer has */
    struct llama_ar *a = &c->ar[c->n_ar++];
    *a = (struct llama_ar){c, buf, n, c->ar_layer};
    return sh_backend_host_fn(c->be, c->st, allreduce_fn, a);
}

/* After a sync: the error of an enqueued all-reduce that failed (SH_OK: none did). */
static sh_err ar_failed(const sh_llama_ctx *c) { return c->ar_fail >= 0 ? c->ar_rc : SH_OK; }

/* A tensor-parallel rank's row-parallel projection: y = sum over its parts in[p] w[p]^T, the
 * partial sums added over the ranks, then x += y, or x += rmsnorm(y) * post_norm (gemma3: the
 * norm needs the whole sum, so it follows the all-reduce). */
static sh_err reduce_add(sh_llama_ctx *c, const sh_tensor *const *w, float *const *in, int32_t n,
                         const float *post_norm, int32_t n_tok, const char *name, const char **what)
{
    const sh_llama_hparams *hp = &c->m->hp;
    sh_backend *be = c->be;
    sh_backend_stream *st = c->st;
    sh_err err;
    TRY(name, sh_backend_matmul(be, st, w[0], in[0], n_tok, c->y));
    for (int32_t i = 1; i < n; i++)
        TRY(name, sh_backend_matmul_add(be, st, w[i], in[i], n_tok, c->y));
    TRY("all-reduce", allreduce(c, c->y, (size_t)n_tok * (size_t)hp->dim));
    if (post_norm)
        TRY("post-norm",
            sh_backend_rmsnorm(be, st, c->y, post_norm, hp->norm_eps, n_tok, hp->dim, c->y));
    TRY("residual add", sh_backend_add(be, st, c->x, c->y, (int64_t)n_tok * hp->dim, c->x));
    return SH_OK;
}

/* A MoE layer's FFN on rows x (n_tok, dim): h = rmsnorm(x) * ffn_norm, the router's logits
 * h W_gate_inp^T, then x += the chosen experts' (and the shared expert's) outputs on h; the
 * step's per-expert counts and choices are copied out for sh_llama_ctx_expert_*. */
static sh_err moe_ffn(sh_llama_ctx *c, int32_t l, int32_t n_tok, const char **what)
{
    const sh_llama_hparams *hp = &c->m->hp;
    const sh_llama_layer *L = &c->m->layers[l];
    sh_backend *be = c->be;
    sh_backend_stream *st = c->st;
    const size_t ne = (size_t)hp->n_expert, k = (size_t)hp->n_expert_used;
    int32_t *cnt = c->moe_cnt + (size_t)l * ne;
    int32_t *ids = c->moe_ids + (size_t)l * c->o.max_tokens * k;
    sh_err err;
    TRY("ffn norm",
        sh_backend_rmsnorm(be, st, c->x, L->ffn_norm, hp->norm_eps, n_tok, hp->dim, c->hn));
    TRY("router matmul", sh_backend_matmul(be, st, &L->ffn_gate_inp, c->hn, n_tok, c->router));
    /* Expert parallelism: the router is replicated, each rank runs the chosen experts it holds
     * (and rank 0 the shared expert) into y, and the sums over the ranks are added to x. */
    const sh_llama_tp *tp = &c->m->tp;
    sh_moe_args a = {.x = c->hn,
                     .n_tok = n_tok,
                     .logits = c->router,
                     .n_expert = hp->n_expert,
                     .expert0 = tp->expert0,
                     .k = hp->n_expert_used,
                     .norm_topk = hp->expert_norm,
                     .gate = L->gate_exps,
                     .up = L->up_exps,
                     .down = L->down_exps,
                     .gate_sh = L->gate_shexp,
                     .up_sh = L->up_shexp,
                     .down_sh = L->down_shexp,
                     .gate_inp_sh = L->gate_inp_shexp,
                     .y = tp->size > 1 ? c->y : c->x,
                     .accumulate = tp->size == 1,
                     .expert_tokens = cnt,
                     .expert_ids = ids};
    TRY("moe ffn", sh_backend_moe_ffn(be, st, &a));
    TRY("copy", sh_backend_copy(be, st, c->h_moe_cnt + (size_t)l * ne, cnt, ne * sizeof(int32_t)));
    TRY("copy", sh_backend_copy(be, st, c->h_moe_ids + (size_t)l * c->o.max_tokens * k, ids,
                                (size_t)n_tok * k * sizeof(int32_t)));
    if (tp->size > 1) {
        TRY("all-reduce", allreduce(c, c->y, (size_t)n_tok * (size_t)hp->dim));
        TRY("residual add", sh_backend_add(be, st, c->x, c->y, (int64_t)n_tok * hp->dim, c->x));
    }
    return SH_OK;
}

/* One transformer block on rows x (n_tok, dim):
 *   h = rmsnorm(x) * attn_norm;  q, k, v = h Wq^T, h Wk^T, h Wv^T;  [qk_norm: each head of q and
 *   k RMS-normalized times q_norm / k_norm; olmoe: all of q and all of k, one norm each];  rotate
 * q, k by position (the layer's RoPE base); store k, v; a = causal attention of q over the cache
 * (the layer's window); x += a Wo^T  [post_norms: x += rmsnorm(a Wo^T) * post_attn_norm]; h =
 * rmsnorm(x) * ffn_norm;   f = act(h Wg^T) * (h Wu^T)  (act silu, or gelu for gemma3); x += f Wd^T
 * [post_norms: x += rmsnorm(f Wd^T) * post_ffn_norm]. */
static sh_err layer(sh_llama_ctx *c, int32_t l, const sh_attn_batch *ab, int32_t n_tok,
                    const char **what)
{
    const sh_llama_hparams *hp = &c->m->hp;
    const sh_llama_tp *tp = &c->m->tp;
    const sh_llama_layer *L = &c->m->layers[l];
    sh_backend *be = c->be;
    sh_backend_stream *st = c->st;
    float base = sh_llama_layer_slides(hp, l) ? hp->rope_base_swa : hp->rope_base;
    /* gemma3's local layers rotate with their own base and no position interpolation, as
     * llama.cpp and the reference do. */
    sh_rope_scaling rope = c->rope;
    if (strcmp(hp->arch, "gemma3") == 0 && sh_llama_layer_slides(hp, l))
        rope.freq_scale = 1.0f;
    const struct sh_llama_attn_w w0 = {L->wq, L->wk, L->wv, L->wo, L->bq, L->bk, L->bv};
    const sh_tensor *wo[SH_LLAMA_TP_PARTS];
    float *att[SH_LLAMA_TP_PARTS];
    sh_err err;
    /* One pass per attention part (a whole model: one, all heads). */
    for (int32_t p = 0; p < tp->n_parts; p++) {
        const sh_llama_tp_part *P = &tp->part[p];
        const struct sh_llama_attn_w *w = p ? &L->tp_part[p - 1] : &w0;
        const int64_t qd = (int64_t)P->n_heads * hp->head_dim;
        const int64_t kvd = (int64_t)P->n_kv_heads * hp->head_dim;
        float *q = c->q + c->qoff[p], *k = c->k + c->kvoff[p], *v = c->v + c->kvoff[p];
        const sh_kv_cache *kv = &c->kv[(size_t)l * (size_t)tp->n_parts + (size_t)p];
        wo[p] = &w->wo;
        att[p] = c->att + c->qoff[p];
        TRY("norm+qkv matmul", sh_backend_norm_qkv(be, st, c->x, L->attn_norm, hp->norm_eps, n_tok,
                                                   &w->wq, &w->wk, &w->wv, q, k, v));
        if (w->bq) {
            TRY("q bias", add_rows(c, q, w->bq, n_tok, qd));
            TRY("k bias", add_rows(c, k, w->bk, n_tok, kvd));
            TRY("v bias", add_rows(c, v, w->bv, n_tok, kvd));
        }
        if (L->q_norm && hp->qk_norm_full) { /* olmoe (whole models only): q, k rows */
            TRY("q norm", sh_backend_rmsnorm(be, st, q, L->q_norm, hp->norm_eps, n_tok, qd, q));
            TRY("k norm", sh_backend_rmsnorm(be, st, k, L->k_norm, hp->norm_eps, n_tok, kvd, k));
        } else if (L->q_norm) { /* the heads are rows of head_dim */
            TRY("q norm", sh_backend_rmsnorm(be, st, q, L->q_norm, hp->norm_eps,
                                             (int64_t)n_tok * P->n_heads, hp->head_dim, q));
            TRY("k norm", sh_backend_rmsnorm(be, st, k, L->k_norm, hp->norm_eps,
                                             (int64_t)n_tok * P->n_kv_heads, hp->head_dim, k));
        }
        TRY("rope q", sh_backend_rope_ext(be, st, q, c->pos, n_tok, P->n_heads, hp->head_dim,
                                          hp->n_rot, base, &rope, hp->rope_mode));
        TRY("rope k", sh_backend_rope_ext(be, st, k, c->pos, n_tok, P->n_kv_heads, hp->head_dim,
                                          hp->n_rot, base, &rope, hp->rope_mode));
        TRY("kv store", sh_backend_kv_store(be, st, kv, ab, k, v));
        TRY("attention",
            sh_backend_attention(be, st, kv, ab, q, P->n_heads, hp->attn_scale, att[p]));
    }
    if (tp->size > 1) {
        if ((err = reduce_add(c, wo, att, tp->n_parts, L->post_attn_norm, n_tok,
                              "attn_output matmul", what)))
            return err;
    } else {
        TRY("attn_output matmul", project_add(c, &L->wo, c->att, L->post_attn_norm, n_tok));
    }
    if (L->ffn_gate_inp.data)
        return moe_ffn(c, l, n_tok, what);
    sh_matmul_args up = {.x = c->x,
                         .n_tok = n_tok,
                         .norm = L->ffn_norm,
                         .norm_eps = hp->norm_eps,
                         .n_w = 2,
                         .w = {L->w_gate, L->w_up},
                         .y = {c->ff, NULL},
                         .act = hp->ffn_act};
    TRY("norm+gate/up matmul", sh_backend_matmul_ex(be, st, &up));
    if (tp->size > 1) {
        const sh_tensor *wd = &L->w_down;
        float *ff = c->ff;
        return reduce_add(c, &wd, &ff, 1, L->post_ffn_norm, n_tok, "ffn_down matmul", what);
    }
    TRY("ffn_down matmul", project_add(c, &L->w_down, c->ff, L->post_ffn_norm, n_tok));
    return SH_OK;
}

/* Every rank's logits (n_out rows of its vocabulary share, padded to vocab_pad) gathered and laid
 * out as full rows in c->logits. */
static sh_err gather_logits(sh_llama_ctx *c, int32_t n_out)
{
    const sh_llama_tp *tp = &c->m->tp;
    const size_t pad = (size_t)n_out * (size_t)tp->vocab_pad, V = (size_t)c->m->hp.n_vocab;
    sh_err err = sh_backend_sync(c->be, c->st);
    if (!err)
        err = ar_failed(c);
    if (!err && (err = c->comm.allgather(c->comm.ud, c->lg_local, pad * sizeof(float), c->gather,
                                         &c->cerr)))
        c->cfailed = true;
    if (err)
        return err;
    for (int32_t r = 0; r < tp->size; r++) {
        int32_t v0, nv;
        sh__llama_tp_rows(c->m->hp.n_vocab, r, tp->size, &v0, &nv);
        const float *src = c->gather + (size_t)r * pad;
        for (int32_t i = 0; i < n_out; i++)
            memcpy(c->logits + (size_t)i * V + (size_t)v0, src + (size_t)i * (size_t)nv,
                   (size_t)nv * sizeof(float));
    }
    return SH_OK;
}

/* top1_only: each of the n_out rows' pick over this rank's vocabulary share (lg: rows of
 * tp.n_vocab), combined across the ranks (an all-gather of 16 bytes a row): the largest logit,
 * the first in vocabulary order on a tie, and lse = M + log(sum_r sum_r * exp(max_r - M)). */
static sh_err top1_of(sh_llama_ctx *c, const float *lg, int32_t n_out)
{
    const sh_llama_tp *tp = &c->m->tp;
    sh_err err = sh_backend_sync(c->be, c->st);
    if (!err)
        err = ar_failed(c);
    if (err)
        return err;
    for (int32_t i = 0; i < n_out; i++) {
        sh_llama_top1 *t = &c->top1_part[i];
        float mx;
        double sum;
        sh_sampler_top1(lg + (size_t)i * (size_t)tp->n_vocab, tp->n_vocab, &t->id, &mx, &sum);
        t->logit = mx;
        t->lse = sum; /* this rank's sum of exp(logit - logit of its pick), combined below */
        if (t->id >= 0)
            t->id += tp->vocab0;
    }
    const sh_llama_top1 *all = c->top1_part;
    if (tp->size > 1) {
        if ((err = c->comm.allgather(c->comm.ud, c->top1_part, (size_t)n_out * sizeof *c->top1_part,
                                     c->top1_all, &c->cerr))) {
            c->cfailed = true;
            return err;
        }
        all = c->top1_all;
    }
    for (int32_t i = 0; i < n_out; i++) {
        sh_llama_top1 best = {-1, -INFINITY, 0.0};
        for (int32_t r = 0; r < tp->size; r++) { /* ranks hold the vocabulary in order */
            const sh_llama_top1 *t = &all[(size_t)r * (size_t)n_out + (size_t)i];
            if (t->id >= 0 && t->logit > best.logit)
                best = (sh_llama_top1){t->id, t->logit, 0.0};
        }
        double sum = 0.0;
        for (int32_t r = 0; r < tp->size && best.id >= 0; r++) {
            const sh_llama_top1 *t = &all[(size_t)r * (size_t)n_out + (size_t)i];
            if (t->id >= 0)
                sum += t->lse * exp((double)t->logit - (double)best.logit);
        }
        best.lse = best.id >= 0 ? (double)best.logit + log(sum) : -INFINITY;
        c->top1[i] = best;
    }
    return SH_OK;
}

sh_err sh_llama_forward(sh_llama_ctx *c, const sh_llama_batch *b, sh_llama_out *out, sh_error *e)
{
    const sh_llama *m = c->m;
    const sh_llama_hparams *hp = &m->hp;
    sh_backend *be = c->be;
    sh_backend_stream *st = c->st;
    memset(out, 0, sizeof *out);
    int32_t n_tok = 0, n_out = 0;
    sh_err err = prepare(c, b, &n_tok, &n_out, e);
    if (err)
        return err;
    sh_attn_batch ab = {b->n_seqs, c->seqs};
    c->n_ar = 0;
    c->ar_fail = -1;
    const char *what = "copy";
    int32_t at = -1; // layer of the failing op, -1 outside the blocks
    size_t row = (size_t)hp->dim * sizeof(float);
    if ((err = sh_backend_copy(be, st, c->pos, c->h_pos, (size_t)n_tok * sizeof(int32_t))))
        goto fail;
    if (m->first == 0) {
        if ((err = sh_backend_copy(be, st, c->ids, c->h_ids, (size_t)n_tok * sizeof(int32_t))))
            goto fail;
        what = "embedding";
        if ((err = sh_backend_embed(be, st, &m->tok_embd, c->ids, n_tok, c->x)))
            goto fail;
        if (hp->embd_scale != 1.0f &&
            (err = sh_backend_scale(be, st, c->x, (int64_t)n_tok * hp->dim, hp->embd_scale, c->x)))
            goto fail;
    } else if ((err = sh_backend_copy(be, st, c->x, b->hidden_in, (size_t)n_tok * row))) {
        goto fail;
    }
    for (int32_t l = m->first; l < c->last; l++) {
        c->ar_layer = l; /* for an all-reduce of this layer that fails on the backend's thread */
        if ((err = layer(c, l, &ab, n_tok, &what))) {
            at = l;
            goto fail;
        }
    }
    if (m->last == hp->n_layers && n_out > 0) {
        // Gather the rows whose logits are wanted, then logits = (rmsnorm(xo) * out_norm) W^T.
        const float *src = c->x;
        if (!b->all_logits) {
            int32_t t = 0, k = 0;
            for (int32_t s = 0; s < b->n_seqs; s++) {
                const sh_llama_seq *q = &b->seqs[s];
                t += q->n_tokens;
                int32_t nr = q->n_logits ? q->n_logits : q->want_logits;
                if (nr > 0 && (err = sh_backend_copy(be, st, c->xo + (size_t)k * hp->dim,
                                                     c->x + (size_t)(t - nr) * hp->dim, row * nr)))
                    goto fail;
                k += nr;
            }
            src = c->xo;
        }
        what = "output norm+matmul";
        /* A tensor-parallel rank computes its vocabulary rows (soft-capped: the cap is per
         * element) and the ranks' rows are gathered into every rank's full rows, or, for a
         * greedy step (top1_only), only each rank's pick and sum are. */
        const sh_llama_tp *tp = &m->tp;
        float *lg = tp->size > 1 ? c->lg_local : c->logits;
        sh_matmul_args a = {.x = src,
                            .n_tok = n_out,
                            .norm = m->out_norm,
                            .norm_eps = hp->norm_eps,
                            .n_w = 1,
                            .w = {m->output},
                            .y = {lg}};
        if ((err = sh_backend_matmul_ex(be, st, &a)))
            goto fail;
        what = "logit soft-capping";
        if (hp->final_softcap > 0.0f &&
            (err = sh_backend_softcap(be, st, lg, (int64_t)n_out * tp->n_vocab, hp->final_softcap,
                                      lg)))
            goto fail;
        if (b->top1_only) {
            what = "top-1 all-gather";
            if ((err = top1_of(c, lg, n_out)))
                goto fail;
        } else if (tp->size > 1 && (err = gather_logits(c, n_out))) {
            what = "logits all-gather";
            goto fail;
        }
    }
    /* Embeddings: the rows after the output norm, in place (the head has read what it needs). */
    if (m->last == hp->n_layers && b->want_hidden) {
        what = "output norm";
        if ((err =
                 sh_backend_rmsnorm(be, st, c->x, m->out_norm, hp->norm_eps, n_tok, hp->dim, c->x)))
            goto fail;
    }
    if ((err = sh_backend_sync(be, st)))
        return sh__error_set(e, err, "llama: backend failed during the forward pass");
    if ((err = ar_failed(c)))
        goto fail;
    c->cfailed = false;
    for (int32_t l = m->first; l < c->last && hp->n_expert > 0; l++)
        for (int32_t x = 0; x < hp->n_expert; x++) {
            const size_t i = (size_t)l * hp->n_expert + x;
            c->expert_tokens[i] += (uint64_t)c->h_moe_cnt[i];
        }
    out->n_tok = n_tok;
    if (m->last == hp->n_layers) {
        out->n_logits = n_out;
        if (b->top1_only)
            out->top1 = c->top1;
        else
            out->logits = c->logits;
        if (b->want_hidden)
            out->hidden = c->x;
    } else {
        out->hidden = c->x;
    }
    return SH_OK;
fail:
    sh_backend_sync(be, st); // drain what was enqueued before the failing op
    if (c->ar_fail >= 0) {   /* an enqueued all-reduce failed first */
        c->cfailed = true;
        at = c->ar_fail;
        what = "all-reduce";
        err = c->ar_rc;
    }
    if (c->cfailed) {
        c->cfailed = false;
        return sh__error_set(e, err, "llama: layer %d: %s failed: %s", (int)at, what, c->cerr.msg);
    }
    return sh__error_set(e, err, "llama: layer %d: the backend refused %s (%s)", (int)at, what,
                         sh_strerror(err));
}
