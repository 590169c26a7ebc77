/* Tensor parallelism of the Llama-family model: which heads, FFN rows, vocabulary rows and
 * experts a rank of a group holds (Megatron's column and row splits, expert placement for MoE),
 * and its slices of the weights: views into the file mapping, copies of row-parallel slices. */
#include "model/llama_tp.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/error.h"
#include "base/file.h"

/* Where rank r's share of n items starts when n is cut into `size` contiguous shares that differ
 * by at most one, the larger ones first (9 over 2: 5 + 4). */
static int32_t share(int32_t n, int32_t r, int32_t size)
{
    return (int32_t)(((int64_t)n * r + size - 1) / size);
}

static void plan_whole(sh_llama *m)
{
    const sh_llama_hparams *hp = &m->hp;
    sh_llama_tp *t = &m->tp;
    memset(t, 0, sizeof *t);
    t->size = 1;
    t->n_parts = 1;
    t->part[0] = (sh_llama_tp_part){0, hp->n_heads, 0, hp->n_kv_heads};
    t->n_heads = hp->n_heads;
    t->n_kv_heads = hp->n_kv_heads;
    t->n_ff = hp->n_ff;
    t->n_vocab = t->vocab_pad = hp->n_vocab;
    t->n_expert = hp->n_expert;
    t->shared_expert = true;
}

sh_err sh__llama_tp_plan(sh_llama *m, int32_t rank, int32_t size, sh_error *e)
{
    const sh_llama_hparams *hp = &m->hp;
    sh_llama_tp *t = &m->tp;
    plan_whole(m);
    if (size < 0 || size > 64)
        return sh__error_set(e, SH_EINVAL, "tensor parallelism: tp_size %d (1 to 64)", (int)size);
    if (rank < 0 || rank >= (size > 1 ? size : 1))
        return sh__error_set(e, SH_EINVAL, "tensor parallelism: tp_rank %d of a group of %d",
                             (int)rank, (int)size);
    if (size <= 1)
        return SH_OK;
    if (size > hp->n_heads)
        return sh__error_set(e, SH_EINVAL,
                             "tensor parallelism: tp_size %d is more than the %d attention heads",
                             (int)size, (int)hp->n_heads);
    if (size > hp->n_vocab)
        return sh__error_set(e, SH_EINVAL,
                             "tensor parallelism: tp_size %d is more than the %d vocabulary rows",
                             (int)size, (int)hp->n_vocab);
    if (hp->qk_norm_full)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "tensor parallelism: %s's QK-norm over all heads (one RMS over the "
                             "whole q and k) would need its sums of squares reduced across the "
                             "ranks; not supported",
                             hp->arch);
    if (hp->n_expert > 0 && hp->n_expert % size != 0)
        return sh__error_set(e, SH_EINVAL,
                             "tensor parallelism: tp_size %d does not divide the %d experts "
                             "(experts are placed whole, n_expert / tp_size per rank)",
                             (int)size, (int)hp->n_expert);
    if (hp->n_kv_heads < 1 || hp->n_heads % hp->n_kv_heads != 0)
        return sh__error_set(e, SH_EINVAL, "tensor parallelism: %d heads over %d KV heads",
                             (int)hp->n_heads, (int)hp->n_kv_heads);
    t->rank = rank;
    t->size = size;
    /* The rank's heads [h, h1), cut where the KV groups of g heads begin: a partial group first,
     * then whole groups, then a partial group; each part reads its KV heads evenly, as the
     * attention op requires (query head i of a part reads KV head i / (n_heads / n_kv_heads)). */
    const int32_t g = hp->n_heads / hp->n_kv_heads;
    int32_t h = share(hp->n_heads, rank, size), h1 = share(hp->n_heads, rank + 1, size);
    t->n_parts = 0;
    t->n_heads = h1 - h;
    t->n_kv_heads = 0;
    while (h < h1) {
        int32_t end = h % g ? (h / g + 1) * g : h + (h1 - h) / g * g;
        if (end > h1 || end == h)
            end = h1;
        int32_t nkv = h % g || end - h < g ? 1 : (end - h) / g;
        t->part[t->n_parts++] = (sh_llama_tp_part){h, end - h, h / g, nkv};
        t->n_kv_heads += nkv;
        h = end;
    }
    t->vocab0 = share(hp->n_vocab, rank, size);
    t->n_vocab = share(hp->n_vocab, rank + 1, size) - t->vocab0;
    t->vocab_pad = share(hp->n_vocab, 1, size);
    if (hp->n_expert > 0) {
        t->n_expert = hp->n_expert / size;
        t->expert0 = rank * t->n_expert;
        t->shared_expert = rank == 0;
    }
    return SH_OK;
}

/* Rows [r0, r0 + n) of matrix w, a view into w's data. */
static sh_tensor rows_of(const sh_tensor *w, int64_t r0, int64_t n)
{
    sh_tensor v = *w;
    v.ne[1] = n;
    v.data = (uint8_t *)w->data + sh__dtype_row_bytes(w->type, (uint64_t)w->ne[0]) * (uint64_t)r0;
    return v;
}

/* The mapping's pages of w outside its rows [r0, r0 + n) (of a 3-D stack: its matrices [r0, r0 +
 * n)), the other ranks' share, which this rank never reads: dropped and marked no-huge
 * (sh__file_drop), before anything touched them. The page cache may hold the file in 2 MiB
 * folios, which a fault maps whole as far as its mapping allows: without the marks a read of the
 * rank's own rows (the prefault, a step) mapped the neighbouring rows of other ranks too (39 MiB
 * per rank of llama3-8b at tp 2: parts of the other halves of K, V, gate and up). */
static void drop_others(const sh_tensor *w, int64_t r0, int64_t n)
{
    const bool stack = w->ne[2] > 1;
    const size_t unit =
        sh__dtype_row_bytes(w->type, (uint64_t)w->ne[0]) * (size_t)(stack ? w->ne[1] : 1);
    const int64_t all = stack ? w->ne[2] : w->ne[1];
    sh__file_drop(w->data, unit * (size_t)r0);
    sh__file_drop((const uint8_t *)w->data + unit * (size_t)(r0 + n),
                  unit * (size_t)(all - r0 - n));
}

/* Experts [x0, x0 + n) of a 3-D stack, a view. */
static sh_tensor experts_of(const sh_tensor *w, int64_t x0, int64_t n)
{
    sh_tensor v = *w;
    v.ne[2] = n;
    v.data = (uint8_t *)w->data +
             sh__dtype_row_bytes(w->type, (uint64_t)w->ne[0]) * (uint64_t)w->ne[1] * (uint64_t)x0;
    return v;
}

/* One of the rank's copies of a row-parallel slice: anonymous pages, given back (dropped) while
 * no live context reads them, refilled from the slice's rows in the model's weights before one
 * does (a context whose backend keeps no copy of its own, or a prepare that packs from them). */
typedef struct tp_copy {
    sh_tensor t;             /* the slice as the forward reads it; t.data is the copy */
    size_t bytes, map_bytes; /* the slice's bytes; the mapping's (whole pages) */
    const uint8_t *src;      /* row 0's slice in the model's weights */
    size_t src_stride;       /* bytes between rows there */
    int32_t readers;         /* live contexts (or a prepare in progress) reading t.data */
    bool dropped;            /* the pages were given back: zeros until refilled */
} tp_copy;

struct sh__llama_tp_copies {
    pthread_mutex_t mu; /* readers and dropped: contexts of one model may be made on any thread */
    tp_copy *v;
    int32_t n, cap;
};

enum { HOLD_PREPARED = 1, HOLD_READS = 2 };

static void fill(tp_copy *c)
{
    const size_t sb = c->bytes / (size_t)c->t.ne[1];
    for (int64_t r = 0; r < c->t.ne[1]; r++)
        memcpy((uint8_t *)c->t.data + (size_t)r * sb, c->src + (size_t)r * c->src_stride, sb);
}

/* Gives the copy's pages back to the system (its address stays mapped: zeros until refilled). */
static void drop(tp_copy *c)
{
    (void)madvise(c->t.data, c->map_bytes, MADV_DONTNEED);
    c->dropped = true;
}

/* Columns [c0, c0 + n) of every row of w (row parallel), copied into memory of the rank's own;
 * only the slice's bytes of each row are read, and the mapping's pages of w are dropped after
 * (the rank reads the copy from now on; sh__file_drop). */
static sh_err columns_of(sh_llama *m, const sh_tensor *w, int64_t c0, int64_t n, const char *name,
                         sh_tensor *out, sh_error *e)
{
    const uint32_t blk = sh__dtype_info(w->type)->block_elems;
    if (c0 % blk || n % blk || n < 1)
        return sh__error_set(e, SH_EINVAL,
                             "tensor parallelism: tensor '%s' (width %lld, %s in blocks of %u): "
                             "rank %d's slice [%lld, %lld) does not start and end on a block",
                             name, (long long)w->ne[0], sh__dtype_name(w->type), (unsigned)blk,
                             (int)m->tp.rank, (long long)c0, (long long)(c0 + n));
    struct sh__llama_tp_copies *cs = m->tp.copies;
    if (!cs) {
        if (!(cs = calloc(1, sizeof *cs)))
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        pthread_mutex_init(&cs->mu, NULL);
        m->tp.copies = cs;
    }
    if (cs->n == cs->cap) {
        int32_t cap = cs->cap ? 2 * cs->cap : 64;
        tp_copy *v = realloc(cs->v, (size_t)cap * sizeof *v);
        if (!v)
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        cs->v = v;
        cs->cap = cap;
    }
    const size_t rb = sh__dtype_row_bytes(w->type, (uint64_t)w->ne[0]);
    const size_t sb = sh__dtype_row_bytes(w->type, (uint64_t)n);
    const size_t ob = sh__dtype_row_bytes(w->type, (uint64_t)c0);
    const size_t bytes = sb * (size_t)w->ne[1];
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t map_bytes = (bytes + page - 1) / page * page;
    void *p = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return sh__error_set(e, SH_ENOMEM, "out of memory for a %zu-byte slice of '%s'", bytes,
                             name);
    tp_copy *c = &cs->v[cs->n++];
    *c = (tp_copy){.t = *w,
                   .bytes = bytes,
                   .map_bytes = map_bytes,
                   .src = (const uint8_t *)w->data + ob,
                   .src_stride = rb};
    c->t.ne[0] = n;
    c->t.data = p;
    fill(c);
    sh__file_drop(w->data, rb * (size_t)w->ne[1]);
    *out = c->t;
    return SH_OK;
}

sh_err sh__llama_tp_slice(sh_llama *m, sh_error *e)
{
    const sh_llama_hparams *hp = &m->hp;
    sh_llama_tp *t = &m->tp;
    if (t->size <= 1)
        return SH_OK;
    const int64_t hd = hp->head_dim;
    char name[96];
    sh_err err;
    if (hp->n_expert == 0) {
        /* FFN rows in whole blocks of ffn_down's type (the largest block of the stage's layers,
         * since a file may mix types: 32 and 256 are the only sizes above 1). */
        uint32_t blk = 1;
        int32_t at = m->first;
        for (int32_t l = m->first; l < m->last; l++) {
            uint32_t b = sh__dtype_info(m->layers[l].w_down.type)->block_elems;
            if (b > blk) {
                blk = b;
                at = l;
            }
        }
        int32_t units = hp->n_ff / (int32_t)blk;
        if (units < t->size)
            return sh__error_set(e, SH_EINVAL,
                                 "tensor parallelism: feed_forward_length %d is %d blocks of %u "
                                 "(blk.%d.ffn_down.weight is %s): fewer than the %d ranks",
                                 (int)hp->n_ff, (int)units, (unsigned)blk, (int)at,
                                 sh__dtype_name(m->layers[at].w_down.type), (int)t->size);
        t->ff0 = share(units, t->rank, t->size) * (int32_t)blk;
        t->n_ff = share(units, t->rank + 1, t->size) * (int32_t)blk - t->ff0;
    }
    for (int32_t l = m->first; l < m->last; l++) {
        sh_llama_layer *L = &m->layers[l];
        const struct sh_llama_attn_w whole = {L->wq, L->wk, L->wv, L->wo, L->bq, L->bk, L->bv};
        snprintf(name, sizeof name, "blk.%d.attn_output.weight", (int)l);
        /* The parts' rows of wq, wk and wv are one run each: heads [h, h1) and their KV heads. */
        const sh_llama_tp_part *P0 = &t->part[0], *Pn = &t->part[t->n_parts - 1];
        drop_others(&whole.wq, P0->head0 * hd, (Pn->head0 + Pn->n_heads - P0->head0) * hd);
        drop_others(&whole.wk, P0->kv0 * hd, (Pn->kv0 + Pn->n_kv_heads - P0->kv0) * hd);
        drop_others(&whole.wv, P0->kv0 * hd, (Pn->kv0 + Pn->n_kv_heads - P0->kv0) * hd);
        for (int32_t p = 0; p < t->n_parts; p++) {
            const sh_llama_tp_part *P = &t->part[p];
            const int64_t q0 = P->head0 * hd, nq = P->n_heads * hd;
            const int64_t k0 = P->kv0 * hd, nk = P->n_kv_heads * hd;
            struct sh_llama_attn_w w = {
                .wq = rows_of(&whole.wq, q0, nq),
                .wk = rows_of(&whole.wk, k0, nk),
                .wv = rows_of(&whole.wv, k0, nk),
                .bq = whole.bq ? whole.bq + q0 : NULL,
                .bk = whole.bk ? whole.bk + k0 : NULL,
                .bv = whole.bv ? whole.bv + k0 : NULL,
            };
            if ((err = columns_of(m, &whole.wo, q0, nq, name, &w.wo, e)))
                return err;
            if (p == 0) {
                L->wq = w.wq;
                L->wk = w.wk;
                L->wv = w.wv;
                L->wo = w.wo;
                L->bq = w.bq;
                L->bk = w.bk;
                L->bv = w.bv;
            } else {
                L->tp_part[p - 1] = w;
            }
        }
        if (hp->n_expert == 0) {
            drop_others(&L->w_gate, t->ff0, t->n_ff);
            drop_others(&L->w_up, t->ff0, t->n_ff);
            L->w_gate = rows_of(&L->w_gate, t->ff0, t->n_ff);
            L->w_up = rows_of(&L->w_up, t->ff0, t->n_ff);
            snprintf(name, sizeof name, "blk.%d.ffn_down.weight", (int)l);
            if ((err = columns_of(m, &L->w_down, t->ff0, t->n_ff, name, &L->w_down, e)))
                return err;
        } else {
            drop_others(&L->gate_exps, t->expert0, t->n_expert);
            drop_others(&L->up_exps, t->expert0, t->n_expert);
            drop_others(&L->down_exps, t->expert0, t->n_expert);
            L->gate_exps = experts_of(&L->gate_exps, t->expert0, t->n_expert);
            L->up_exps = experts_of(&L->up_exps, t->expert0, t->n_expert);
            L->down_exps = experts_of(&L->down_exps, t->expert0, t->n_expert);
            if (!t->shared_expert) {
                memset(&L->gate_shexp, 0, sizeof L->gate_shexp);
                memset(&L->up_shexp, 0, sizeof L->up_shexp);
                memset(&L->down_shexp, 0, sizeof L->down_shexp);
                memset(&L->gate_inp_shexp, 0, sizeof L->gate_inp_shexp);
            }
        }
    }
    if (m->output.data) {
        /* (A tied table that this stage also looks tokens up in is read whole: its rows are
         * only dropped, which a lookup faults back.) */
        drop_others(&m->output, t->vocab0, t->n_vocab);
        m->output = rows_of(&m->output, t->vocab0, t->n_vocab);
        /* A later stage holds the tied table for its head only: keep just the rank's rows. */
        if (m->first > 0)
            memset(&m->tok_embd, 0, sizeof m->tok_embd);
    }
    return SH_OK;
}

void sh__llama_tp_rows(int32_t n, int32_t r, int32_t size, int32_t *start, int32_t *count)
{
    *start = share(n, r, size);
    *count = share(n, r + 1, size) - *start;
}

bool sh__llama_tp_owns(const sh_llama *m, const void *p)
{
    const struct sh__llama_tp_copies *cs = m->tp.copies;
    for (int32_t i = 0; cs && i < cs->n; i++)
        if (cs->v[i].t.data == p)
            return true;
    return false;
}

sh_err sh__llama_tp_hold(const sh_llama *m, sh_backend *be, bool prepare, uint8_t **holds,
                         sh_error *e)
{
    struct sh__llama_tp_copies *cs = m->tp.copies;
    *holds = NULL;
    if (!cs || !cs->n)
        return SH_OK;
    uint8_t *h = calloc((size_t)cs->n, 1);
    if (!h)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    *holds = h;
    for (int32_t i = 0; i < cs->n; i++) {
        tp_copy *c = &cs->v[i];
        /* Read from here on (the prepare may pack from it): refilled if it was dropped. */
        pthread_mutex_lock(&cs->mu);
        c->readers++;
        if (c->dropped) {
            fill(c);
            c->dropped = false;
        }
        pthread_mutex_unlock(&cs->mu);
        h[i] = HOLD_READS;
        bool copied = false;
        if (prepare) {
            sh_err err = sh_backend_weight_prepare(be, &c->t);
            if (err && err != SH_EUNSUPPORTED)
                return sh__error_set(e, err,
                                     "llama: cannot prepare the weights for the backend: %s",
                                     sh_strerror(err));
            if (!err) {
                h[i] |= HOLD_PREPARED;
                copied = sh_backend_weight_copied(be, &c->t);
            }
        }
        if (copied) { /* the backend reads its own copy: this context reads c->t.data no more */
            pthread_mutex_lock(&cs->mu);
            h[i] &= (uint8_t)~HOLD_READS;
            if (--c->readers == 0)
                drop(c);
            pthread_mutex_unlock(&cs->mu);
        }
    }
    return SH_OK;
}

void sh__llama_tp_let_go(const sh_llama *m, sh_backend *be, uint8_t *holds)
{
    struct sh__llama_tp_copies *cs = m->tp.copies;
    for (int32_t i = 0; holds && cs && i < cs->n; i++) {
        tp_copy *c = &cs->v[i];
        if (holds[i] & HOLD_PREPARED)
            sh_backend_weight_release(be, c->t.data);
        if (holds[i] & HOLD_READS) {
            pthread_mutex_lock(&cs->mu);
            if (--c->readers == 0)
                drop(c);
            pthread_mutex_unlock(&cs->mu);
        }
    }
    free(holds);
}

void sh__llama_tp_free(sh_llama *m)
{
    struct sh__llama_tp_copies *cs = m->tp.copies;
    if (!cs)
        return;
    for (int32_t i = 0; i < cs->n; i++)
        munmap(cs->v[i].t.data, cs->v[i].map_bytes);
    free(cs->v);
    pthread_mutex_destroy(&cs->mu);
    free(cs);
    m->tp.copies = NULL;
}
