/* Model drafters for speculative decoding: a draft model or the target's first layers, drafting
 * greedily over a KV cache that follows one sequence (model/spec_draft.h). */
#include "model/spec_draft.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

struct sh_spec_draft {
    sh_llama *own;     /* the draft file's model; NULL for self-speculation */
    const sh_llama *m; /* the model that drafts (own, or the target) */
    sh_llama_ctx *ctx;
    int32_t layers;     /* layers run per drafted token */
    int32_t max_tokens; /* rows per catch-up pass */
    int32_t cap;        /* cache positions */
    int32_t *blocks;    // (n_blocks) the one sequence's block table: 0, 1, 2, ...
    int32_t *hist;      // (cap) the tokens whose keys and values are in the draft cache
    int32_t n_hist;
    int32_t next; /* the greedy pick after hist[n_hist - 1]; -1: none (recompute) */
};

/* At most 24 bytes of a token text, bytes outside printable ASCII as \xNN, into buf. */
static const char *shown(const char *t, size_t len, char *buf, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < len && i < 24 && o + 5 < cap; i++) {
        unsigned char ch = (unsigned char)t[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\'')
            buf[o++] = (char)ch;
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
    buf[o] = '\0';
    return buf;
}

/* The draft's vocabulary against the target's: sizes, every token text, BOS and EOS. */
static sh_err check_vocab(const char *path, const sh_llama *dm, const sh_tokenizer *dt,
                          const sh_llama *tm, const sh_tokenizer *tt, sh_error *e)
{
    if (dm->hp.n_vocab != tm->hp.n_vocab || sh_tokenizer_n_vocab(dt) != sh_tokenizer_n_vocab(tt))
        return sh__error_set(e, SH_EINVAL,
                             "draft %s has a vocabulary of %d tokens (%d in its tokenizer); the "
                             "target's has %d (%d): a draft must share the target's vocabulary",
                             path, (int)dm->hp.n_vocab, (int)sh_tokenizer_n_vocab(dt),
                             (int)tm->hp.n_vocab, (int)sh_tokenizer_n_vocab(tt));
    int32_t n = sh_tokenizer_n_vocab(tt);
    for (int32_t id = 0; id < n; id++) {
        size_t la, lb;
        const char *a = sh_tokenizer_token_text(dt, id, &la);
        const char *b = sh_tokenizer_token_text(tt, id, &lb);
        if (la != lb || (la && memcmp(a, b, la) != 0)) {
            char sa[128], sb[128];
            return sh__error_set(e, SH_EINVAL,
                                 "draft %s: token %d is '%s' where the target's is '%s': a draft "
                                 "must share the target's vocabulary",
                                 path, (int)id, shown(a, la, sa, sizeof sa),
                                 shown(b, lb, sb, sizeof sb));
        }
    }
    if (sh_tokenizer_bos(dt) != sh_tokenizer_bos(tt) ||
        sh_tokenizer_eos(dt) != sh_tokenizer_eos(tt))
        return sh__error_set(e, SH_EINVAL,
                             "draft %s: BOS/EOS ids %d/%d where the target's are %d/%d", path,
                             (int)sh_tokenizer_bos(dt), (int)sh_tokenizer_eos(dt),
                             (int)sh_tokenizer_bos(tt), (int)sh_tokenizer_eos(tt));
    return SH_OK;
}

/* Loads the draft file and checks its vocabulary; d->own on success. */
static sh_err load_file(sh_spec_draft *d, const sh_llama *target, const sh_tokenizer *tt,
                        const sh_spec_draft_opts *o, sh_error *e)
{
    if (!o->path || !*o->path)
        return sh__error_set(e, SH_EINVAL, "draft: no draft model file given");
    sh_llama_load_opts lo = {.prefault = o->prefault};
    sh_error le = {0};
    sh_err err = sh_llama_load(o->path, &lo, &d->own, &le);
    if (err)
        return sh__error_set(e, err, "draft model: %s", le.msg);
    sh_tokenizer *dt = NULL;
    if (d->own->gguf) {
        err = sh_tokenizer_create_gguf(d->own->gguf, &dt, &le);
        if (err)
            return sh__error_set(e, err, "draft %s: tokenizer: %s", o->path, le.msg);
    } else if (target->l2c && o->l2c_tokenizer) {
        /* Two llama2.c checkpoints: the draft has no vocabulary of its own but the sizes must
         * agree; read with the draft's size, the target's tokenizer.bin then compares equal
         * except for a size mismatch, which check_vocab reports first. */
        if (d->own->hp.n_vocab != target->hp.n_vocab)
            return sh__error_set(e, SH_EINVAL,
                                 "draft %s has a vocabulary of %d tokens; the target's has %d: a "
                                 "draft must share the target's vocabulary",
                                 o->path, (int)d->own->hp.n_vocab, (int)target->hp.n_vocab);
        err = sh_tokenizer_create_llama2c(o->l2c_tokenizer, d->own->hp.n_vocab, &dt, &le);
        if (err)
            return sh__error_set(e, err, "draft %s: tokenizer: %s", o->path, le.msg);
    } else {
        return sh__error_set(e, SH_EINVAL,
                             "draft %s is a llama2.c checkpoint: it carries no vocabulary to "
                             "check against the target's (use a GGUF draft)",
                             o->path);
    }
    err = check_vocab(o->path, d->own, dt, target, tt, e);
    sh_tokenizer_destroy(dt);
    return err;
}

sh_err sh__spec_draft_model(const sh_llama *target, const sh_tokenizer *target_tok,
                            const sh_spec_draft_opts *o, sh_llama **own, int32_t *layers,
                            sh_error *e)
{
    *own = NULL;
    *layers = 0;
    const int32_t nl = target->hp.n_layers;
    if (o->self_layers != 0 && nl < 2)
        return sh__error_set(e, SH_EINVAL,
                             "--spec self:%d: the target has 1 layer; self-speculation needs 2 or "
                             "more",
                             (int)o->self_layers);
    if (o->self_layers != 0 && (o->self_layers < 1 || o->self_layers >= nl))
        return sh__error_set(e, SH_EINVAL,
                             "--spec self:%d: the draft's layers must be from 1 to %d (the "
                             "target has %d)",
                             (int)o->self_layers, (int)(nl - 1), (int)nl);
    if (target->first != 0 || target->last != nl || target->tp.size > 1)
        return sh__error_set(e, SH_EINVAL, "draft: the target must be a model loaded whole");
    if (o->self_layers) {
        *layers = o->self_layers;
        return SH_OK;
    }
    sh_spec_draft tmp = {0};
    sh_err err = load_file(&tmp, target, target_tok, o, e);
    if (err) {
        sh_llama_destroy(tmp.own);
        return err;
    }
    *own = tmp.own;
    *layers = tmp.own->hp.n_layers;
    return SH_OK;
}

sh_err sh_spec_draft_create(const sh_llama *target, const sh_tokenizer *target_tok, sh_backend *be,
                            const sh_spec_draft_opts *o, sh_spec_draft **out, sh_error *e)
{
    *out = NULL;
    if (o->kv_tokens < 1 || o->max_tokens < 1)
        return sh__error_set(e, SH_EINVAL, "draft: kv_tokens %d, max_tokens %d", (int)o->kv_tokens,
                             (int)o->max_tokens);
    sh_spec_draft *d = calloc(1, sizeof *d);
    if (!d)
        return sh__error_set(e, SH_ENOMEM, "draft: out of memory");
    d->next = -1;
    d->max_tokens = o->max_tokens;
    sh_err err = sh__spec_draft_model(target, target_tok, o, &d->own, &d->layers, e);
    if (err)
        goto fail;
    d->m = d->own ? d->own : target;
    sh_llama_ctx_opts co = {.max_tokens = o->max_tokens,
                            .max_seqs = 1,
                            .max_logits = 1,
                            .kv_tokens = o->kv_tokens,
                            .kv_type = o->kv_type,
                            .exit_layer = o->self_layers};
    sh_error ce = {0};
    if ((err = sh_llama_ctx_create(d->m, be, &co, &d->ctx, &ce))) {
        sh__error_set(e, err, "draft: %s", ce.msg);
        goto fail;
    }
    int32_t nb = sh_llama_ctx_n_blocks(d->ctx);
    d->cap = o->kv_tokens;
    d->blocks = malloc((size_t)nb * sizeof *d->blocks);
    d->hist = malloc((size_t)d->cap * sizeof *d->hist);
    if (!d->blocks || !d->hist) {
        err = sh__error_set(e, SH_ENOMEM, "draft: out of memory");
        goto fail;
    }
    for (int32_t i = 0; i < nb; i++)
        d->blocks[i] = i;
    *out = d;
    return SH_OK;
fail:
    sh_spec_draft_destroy(d);
    return err;
}

void sh_spec_draft_destroy(sh_spec_draft *d)
{
    if (!d)
        return;
    sh_llama_ctx_destroy(d->ctx);
    sh_llama_destroy(d->own);
    free(d->blocks);
    free(d->hist);
    free(d);
}

int32_t sh_spec_draft_layers(const sh_spec_draft *d) { return d->layers; }

/* Runs toks[0, n) at positions d->n_hist.. (in passes of max_tokens rows), appending them to the
 * cached history and leaving the greedy pick after the last in d->next. */
static sh_err run(sh_spec_draft *d, const int32_t *toks, int32_t n, sh_error *e)
{
    for (int32_t i = 0; i < n; i += d->max_tokens) {
        int32_t k = n - i < d->max_tokens ? n - i : d->max_tokens;
        sh_llama_seq s = {.tokens = toks + i,
                          .n_tokens = k,
                          .pos0 = d->n_hist,
                          .blocks = d->blocks,
                          .want_logits = i + k == n};
        sh_llama_batch b = {.n_seqs = 1, .seqs = &s, .top1_only = true};
        sh_llama_out out;
        sh_error fe = {0};
        sh_err err = sh_llama_forward(d->ctx, &b, &out, &fe);
        if (err) {
            d->n_hist = 0; /* what the cache holds is unknown now: start over next time */
            d->next = -1;
            return sh__error_set(e, err, "draft: %s", fe.msg);
        }
        memmove(d->hist + d->n_hist, toks + i, (size_t)k * sizeof *toks);
        d->n_hist += k;
        if (i + k == n)
            d->next = out.top1[0].id;
    }
    return SH_OK;
}

sh_err sh_spec_draft_sync(sh_spec_draft *d, const int32_t *hist, int32_t n, sh_error *e)
{
    if (n < 1 || n > d->cap)
        return sh__error_set(e, SH_EINVAL, "draft: a history of %d tokens (cache %d)", (int)n,
                             (int)d->cap);
    int32_t p = 0;
    while (p < d->n_hist && p < n && d->hist[p] == hist[p])
        p++;
    if (p == n && d->n_hist == n && d->next >= 0)
        return SH_OK; /* already there */
    if (p == n)
        p = n - 1; /* the pick after hist[n - 1] is needed again: recompute that row */
    d->n_hist = p;
    d->next = -1;
    return run(d, hist + p, n - p, e);
}

sh_err sh_spec_draft_propose(sh_spec_draft *d, const int32_t *hist, int32_t n, int32_t k,
                             int32_t *out, int32_t *n_out, sh_error *e)
{
    *n_out = 0;
    sh_err err = sh_spec_draft_sync(d, hist, n, e);
    if (err)
        return err;
    /* Draft i (0-based) needs drafts 0..i-1 in the cache, at positions n..n + i - 1. */
    if (k > d->cap - n + 1)
        k = d->cap - n + 1;
    for (int32_t i = 0; i < k; i++) {
        if (i > 0 && (err = run(d, &out[i - 1], 1, e))) {
            *n_out = 0;
            return err;
        }
        if (d->next < 0)
            break; /* a row of NaN logits: nothing to draft */
        out[i] = d->next;
        *n_out = i + 1;
    }
    return SH_OK;
}
