/* The batched model drafter (model/spec_draft_batch.h): per sequence, its recorded tokens and
 * the part of them in a paged draft cache; greedy drafts for a step's sequences in batched
 * forward passes. */
#include "model/spec_draft_batch.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "model/spec.h"

/* A sequence's state. tok[p] is its token at position p where p < n_known (recorded from steps),
 * the drafts of the last call at [n_known, n_avail), and the token whose keys and values the
 * cache holds at p where p < n_cached; where these overlap they agree (recording a different token
 * cuts n_cached), so one array serves all three. A verification accepts a prefix of the drafts
 * and the next step starts at the first position not accepted: tokens [n_known, pos) are then
 * drafts of the last call, which is why they are kept. */
typedef struct dslot {
    uint64_t id;   /* 0: free */
    uint64_t used; /* the call that last named it (least recently used is evicted first) */
    int32_t n_known, n_avail, n_cached;
    int32_t n_blocks; /* blk[0, n_blocks) are this sequence's */
    int32_t *tok;     // (cap)
    int32_t *blk;     // (tab)
} dslot;

struct sh_spec_drafts {
    sh_llama *own;     /* the draft file's model; NULL for self-speculation */
    const sh_llama *m; /* the model that drafts */
    sh_llama_ctx *ctx;
    int32_t layers, max_tokens, max_seqs, cap, tab;
    dslot *slots; // (n_slots)
    int32_t n_slots;
    int32_t *free_blk; // (n_blocks) a stack of free blocks
    int32_t n_free, n_blocks;
    uint64_t tick;
    uint64_t extra_us; /* the last call's catch-up time beyond one row per drafting sequence */
    /* Per call, sized at create: */
    int32_t *act;       // (max_seqs) request i's slot, -1 when it does not draft
    int32_t *at;        // (max_seqs) where its catch-up stands
    int32_t *want;      // (max_seqs) drafts it may still get
    sh_llama_seq *seqs; // (max_seqs)
    int32_t *who;       // (max_seqs) the request of each sequence of a pass
};

sh_err sh_spec_drafts_create(const sh_llama *target, const sh_tokenizer *target_tok, sh_backend *be,
                             const sh_spec_drafts_opts *o, sh_spec_drafts **out, sh_error *e)
{
    *out = NULL;
    const sh_spec_draft_opts *dop = &o->draft;
    if (dop->kv_tokens < 1 || dop->max_tokens < 1 || o->max_seqs < 1 ||
        o->max_slots < o->max_seqs || o->seq_tokens < 2)
        return sh__error_set(e, SH_EINVAL,
                             "draft: kv_tokens %d, max_tokens %d, max_seqs %d, max_slots %d, "
                             "seq_tokens %d",
                             (int)dop->kv_tokens, (int)dop->max_tokens, (int)o->max_seqs,
                             (int)o->max_slots, (int)o->seq_tokens);
    sh_spec_drafts *d = calloc(1, sizeof *d);
    if (!d)
        return sh__error_set(e, SH_ENOMEM, "draft: out of memory");
    sh_err err = sh__spec_draft_model(target, target_tok, dop, &d->own, &d->layers, e);
    if (err)
        goto fail;
    d->m = d->own ? d->own : target;
    /* A pass of one row per drafting sequence must fit. */
    d->max_tokens = dop->max_tokens > o->max_seqs ? dop->max_tokens : o->max_seqs;
    d->max_seqs = o->max_seqs;
    d->cap = o->seq_tokens;
    d->tab = (o->seq_tokens + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    sh_llama_ctx_opts co = {.max_tokens = d->max_tokens,
                            .max_seqs = o->max_seqs,
                            .max_logits = o->max_seqs,
                            .kv_tokens = dop->kv_tokens,
                            .kv_type = dop->kv_type,
                            .exit_layer = dop->self_layers};
    sh_error ce = {0};
    if ((err = sh_llama_ctx_create(d->m, be, &co, &d->ctx, &ce))) {
        sh__error_set(e, err, "draft: %s", ce.msg);
        goto fail;
    }
    d->n_blocks = sh_llama_ctx_n_blocks(d->ctx);
    d->n_slots = o->max_slots;
    d->slots = calloc((size_t)d->n_slots, sizeof *d->slots);
    d->free_blk = malloc((size_t)d->n_blocks * sizeof *d->free_blk);
    d->act = malloc((size_t)d->max_seqs * sizeof *d->act);
    d->at = malloc((size_t)d->max_seqs * sizeof *d->at);
    d->want = malloc((size_t)d->max_seqs * sizeof *d->want);
    d->who = malloc((size_t)d->max_seqs * sizeof *d->who);
    d->seqs = malloc((size_t)d->max_seqs * sizeof *d->seqs);
    if (!d->slots || !d->free_blk || !d->act || !d->at || !d->want || !d->who || !d->seqs)
        goto nomem;
    for (int32_t i = 0; i < d->n_slots; i++) {
        d->slots[i].tok = malloc((size_t)d->cap * sizeof(int32_t));
        d->slots[i].blk = malloc((size_t)d->tab * sizeof(int32_t));
        if (!d->slots[i].tok || !d->slots[i].blk)
            goto nomem;
    }
    for (int32_t i = 0; i < d->n_blocks; i++)
        d->free_blk[i] = d->n_blocks - 1 - i;
    d->n_free = d->n_blocks;
    *out = d;
    return SH_OK;
nomem:
    err = sh__error_set(e, SH_ENOMEM, "draft: out of memory");
fail:
    sh_spec_drafts_destroy(d);
    return err;
}

void sh_spec_drafts_destroy(sh_spec_drafts *d)
{
    if (!d)
        return;
    sh_llama_ctx_destroy(d->ctx);
    sh_llama_destroy(d->own);
    for (int32_t i = 0; d->slots && i < d->n_slots; i++) {
        free(d->slots[i].tok);
        free(d->slots[i].blk);
    }
    free(d->slots);
    free(d->free_blk);
    free(d->act);
    free(d->at);
    free(d->want);
    free(d->who);
    free(d->seqs);
    free(d);
}

int32_t sh_spec_drafts_layers(const sh_spec_drafts *d) { return d->layers; }

uint64_t sh_spec_drafts_extra_us(const sh_spec_drafts *d) { return d->extra_us; }

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Empties slot s: its blocks go back to the pool. */
static void slot_clear(sh_spec_drafts *d, dslot *s)
{
    for (int32_t i = 0; i < s->n_blocks; i++)
        d->free_blk[d->n_free++] = s->blk[i];
    s->n_blocks = 0;
    s->n_known = s->n_avail = s->n_cached = 0;
    s->id = 0;
}

void sh_spec_drafts_forget(sh_spec_drafts *d, uint64_t id)
{
    for (int32_t i = 0; i < d->n_slots; i++)
        if (d->slots[i].id == id && id)
            slot_clear(d, &d->slots[i]);
}

/* The least recently used slot not named in this call that holds blocks (or any, when `any`),
 * or NULL. */
static dslot *slot_victim(sh_spec_drafts *d, bool any)
{
    dslot *v = NULL;
    for (int32_t i = 0; i < d->n_slots; i++) {
        dslot *s = &d->slots[i];
        if (s->id && s->used != d->tick && (any || s->n_blocks > 0) && (!v || s->used < v->used))
            v = s;
    }
    return v;
}

/* Gives s blocks for positions [0, n); evicts sequences not in this call for room. Returns
 * whether it has them. */
static bool slot_reserve(sh_spec_drafts *d, dslot *s, int32_t n)
{
    int32_t need = (n + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    if (need > d->tab)
        return false;
    while (s->n_blocks < need) {
        if (d->n_free == 0) {
            dslot *v = slot_victim(d, false);
            if (!v)
                return false;
            slot_clear(d, v);
        }
        s->blk[s->n_blocks++] = d->free_blk[--d->n_free];
    }
    return true;
}

/* Writes toks[0, n) as s's tokens at p0 .. p0 + n - 1, cutting the cache at the first change. */
static void slot_record(dslot *s, int32_t p0, const int32_t *toks, int32_t n)
{
    for (int32_t j = 0; j < n; j++) {
        int32_t p = p0 + j;
        if (p < s->n_cached && s->tok[p] != toks[j])
            s->n_cached = p;
        s->tok[p] = toks[j];
    }
}

/* Finds id's slot, or takes a free one (evicting the least recently used) when create. */
static dslot *slot_find(sh_spec_drafts *d, uint64_t id, bool create)
{
    dslot *free_s = NULL;
    for (int32_t i = 0; i < d->n_slots; i++) {
        if (d->slots[i].id == id)
            return &d->slots[i];
        if (!d->slots[i].id && !free_s)
            free_s = &d->slots[i];
    }
    if (!create)
        return NULL;
    if (!free_s) {
        free_s = slot_victim(d, true);
        if (!free_s)
            return NULL;
        slot_clear(d, free_s);
    }
    free_s->id = id;
    free_s->n_known = free_s->n_avail = free_s->n_cached = 0;
    return free_s;
}

/* Records request r; returns its slot when it may draft (-1 otherwise). */
static int32_t take(sh_spec_drafts *d, sh_spec_drafts_req *r)
{
    bool whole = r->pos == 0 || (r->prior && r->n_prior >= r->pos);
    dslot *s = slot_find(d, r->id, whole);
    if (!s || s->used == d->tick)
        return -1; /* none to take, or the id came twice in this call */
    s->used = d->tick;
    if (r->pos + r->n_tokens > d->cap || (r->pos > s->n_avail && !whole)) {
        slot_clear(d, s); /* its history has a hole: forgotten until a whole one comes */
        return -1;
    }
    if (r->pos > s->n_avail || (r->prior && r->n_prior >= r->pos))
        slot_record(s, 0, r->prior, r->pos);
    slot_record(s, r->pos, r->tokens, r->n_tokens);
    s->n_known = s->n_avail = r->pos + r->n_tokens;
    int32_t k = r->k;
    if (k > d->cap - s->n_known)
        k = d->cap - s->n_known; /* every draft's token is kept in tok */
    if (k <= 0 || s->n_known == 0)
        return -1;
    /* The cache will hold the history and every draft but the last. */
    if (!slot_reserve(d, s, s->n_known + k - 1))
        return -1;
    return (int32_t)(s - d->slots);
}

/* Runs one pass over d->seqs[0, n) whose sequences are requests d->who[...]; for each that wants
 * logits, hands the greedy pick to pick(). Returns the forward pass's error. */
static sh_err pass(sh_spec_drafts *d, int32_t n, const sh_llama_top1 **top1, sh_error *e)
{
    sh_llama_batch b = {.n_seqs = n, .seqs = d->seqs, .top1_only = true};
    sh_llama_out out;
    sh_error fe = {0};
    sh_err err = sh_llama_forward(d->ctx, &b, &out, &fe);
    if (err)
        return sh__error_set(e, err, "draft: %s", fe.msg);
    *top1 = out.top1;
    return SH_OK;
}

sh_err sh_spec_drafts_step(sh_spec_drafts *d, sh_spec_drafts_req *r, int32_t n, sh_error *e)
{
    if (n < 0 || n > d->max_seqs)
        return sh__error_set(e, SH_EINVAL, "draft: %d sequences in a step (at most %d)", (int)n,
                             (int)d->max_seqs);
    for (int32_t i = 0; i < n; i++) {
        r[i].n_out = 0;
        if (!r[i].id || r[i].k < 0 || r[i].k > SH_SPEC_MAX_K || r[i].pos < 0 || r[i].n_tokens < 0 ||
            (r[i].n_tokens && !r[i].tokens))
            return sh__error_set(e, SH_EINVAL, "draft: sequence %d: id %llu, k %d, pos %d", (int)i,
                                 (unsigned long long)r[i].id, (int)r[i].k, (int)r[i].pos);
    }
    d->tick++;
    d->extra_us = 0;
    for (int32_t i = 0; i < n; i++) {
        d->act[i] = take(d, &r[i]);
        if (d->act[i] < 0)
            continue;
        dslot *s = &d->slots[d->act[i]];
        /* At least the last known token runs: its row gives the first draft. */
        d->at[i] = s->n_cached < s->n_known ? s->n_cached : s->n_known - 1;
        d->want[i] = r[i].k < d->cap - s->n_known ? r[i].k : d->cap - s->n_known;
    }
    sh_err err = SH_OK;
    const sh_llama_top1 *top1 = NULL;
    /* Catch-up: every drafting sequence's missing tokens, max_tokens rows a pass. */
    for (;;) {
        int32_t ns = 0, rows = 0;
        for (int32_t i = 0; i < n && rows < d->max_tokens; i++) {
            if (d->act[i] < 0)
                continue;
            dslot *s = &d->slots[d->act[i]];
            int32_t t = s->n_known - d->at[i];
            if (t <= 0)
                continue;
            if (t > d->max_tokens - rows)
                t = d->max_tokens - rows;
            d->seqs[ns] = (sh_llama_seq){.tokens = s->tok + d->at[i],
                                         .n_tokens = t,
                                         .pos0 = d->at[i],
                                         .blocks = s->blk,
                                         .want_logits = d->at[i] + t == s->n_known};
            d->who[ns++] = i;
            rows += t;
            d->at[i] += t;
        }
        if (ns == 0)
            break;
        uint64_t t0 = mono_us();
        if ((err = pass(d, ns, &top1, e)))
            goto failed;
        /* Rows beyond one a sequence are history it brought (a prompt), not drafting. */
        d->extra_us += (mono_us() - t0) * (uint64_t)(rows - ns) / (uint64_t)rows;
        for (int32_t j = 0, l = 0; j < ns; j++) {
            int32_t i = d->who[j];
            dslot *s = &d->slots[d->act[i]];
            int32_t end = d->seqs[j].pos0 + d->seqs[j].n_tokens;
            if (end > s->n_cached)
                s->n_cached = end;
            if (!d->seqs[j].want_logits)
                continue;
            int32_t id = top1[l++].id;
            if (id < 0)
                d->want[i] = 0; /* a row of NaN logits: nothing to draft */
            else
                r[i].out[r[i].n_out++] = id;
        }
    }
    /* One row per sequence still drafting: its last draft, at the position after the last. */
    for (;;) {
        int32_t ns = 0;
        for (int32_t i = 0; i < n; i++) {
            if (d->act[i] < 0 || r[i].n_out == 0 || r[i].n_out >= d->want[i])
                continue;
            dslot *s = &d->slots[d->act[i]];
            int32_t p = s->n_known + r[i].n_out - 1;
            slot_record(s, p, &r[i].out[r[i].n_out - 1], 1);
            d->seqs[ns] = (sh_llama_seq){.tokens = s->tok + p,
                                         .n_tokens = 1,
                                         .pos0 = p,
                                         .blocks = s->blk,
                                         .want_logits = true};
            d->who[ns++] = i;
        }
        if (ns == 0)
            break;
        if ((err = pass(d, ns, &top1, e)))
            goto failed;
        for (int32_t j = 0; j < ns; j++) {
            int32_t i = d->who[j];
            dslot *s = &d->slots[d->act[i]];
            if (d->seqs[j].pos0 + 1 > s->n_cached)
                s->n_cached = d->seqs[j].pos0 + 1;
            if (top1[j].id < 0)
                d->want[i] = r[i].n_out; /* stop here */
            else
                r[i].out[r[i].n_out++] = top1[j].id;
        }
    }
    /* Every draft is kept, the last included (its key and value are not cached). */
    for (int32_t i = 0; i < n; i++) {
        if (d->act[i] < 0 || r[i].n_out == 0)
            continue;
        dslot *s = &d->slots[d->act[i]];
        slot_record(s, s->n_known + r[i].n_out - 1, &r[i].out[r[i].n_out - 1], 1);
        s->n_avail = s->n_known + r[i].n_out;
    }
    return SH_OK;
failed:
    /* What the caches of this call's sequences hold is unknown now: recompute them next time. */
    for (int32_t i = 0; i < n; i++) {
        r[i].n_out = 0;
        if (d->act[i] >= 0)
            d->slots[d->act[i]].n_cached = 0;
    }
    return err;
}
