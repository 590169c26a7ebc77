/* Constrained decoding at the sampling stage: see actors/stage_grammar.h. */
#include "actors/stage_grammar.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/auth.h"
#include "base/error.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

typedef struct sgram_entry {
    sh_grammar *g; /* NULL: free */
    uint64_t hash;
    uint32_t len;
    int32_t refs; /* sequences whose matcher uses it */
} sgram_entry;

struct sh_sgram {
    const sh_llama *model;
    int32_t n_vocab;
    sh_gvocab *vocab;   /* built at the first grammar */
    sgram_entry *cache; /* (n_cache) one more than sequences, so one is always free */
    int32_t n_cache;
    uint64_t *bits[2]; /* (words) the mask, per thread */
    float *row[2];     /* (n_vocab) the masked row, per thread */
    int32_t words;
};

sh_err sh__sgram_create(const sh_llama *model, int32_t n_vocab, int32_t n_seqs, sh_sgram **out,
                        sh_error *e)
{
    *out = NULL;
    sh_sgram *g = calloc(1, sizeof *g);
    if (!g)
        return sh__error_set(e, SH_ENOMEM, "stage: out of memory for grammars");
    g->model = model;
    g->n_vocab = n_vocab;
    g->n_cache = n_seqs + 1;
    g->cache = calloc((size_t)g->n_cache, sizeof *g->cache);
    if (!g->cache) {
        free(g);
        return sh__error_set(e, SH_ENOMEM, "stage: out of memory for grammars");
    }
    *out = g;
    return SH_OK;
}

void sh__sgram_free(sh_sgram *g)
{
    if (!g)
        return;
    for (int32_t i = 0; i < g->n_cache; i++)
        sh_grammar_free(g->cache[i].g);
    free(g->cache);
    sh_gvocab_free(g->vocab);
    for (int i = 0; i < 2; i++) {
        free(g->bits[i]);
        free(g->row[i]);
    }
    free(g);
}

uint64_t sh__sgram_text_hash(sh_strv t)
{
    static const char key[] = "shoal grammar v1";
    uint8_t mac[SH_AUTH_MAC_LEN];
    uint64_t h = 0;
    if (sh__auth_hmac(key, sizeof key - 1, t.ptr ? t.ptr : "", t.len, mac) == SH_OK) {
        memcpy(&h, mac, sizeof h);
        return h;
    }
    h = 0xcbf29ce484222325ull; /* mbedTLS does not fail here; FNV-1a all the same if it did */
    for (uint32_t i = 0; i < t.len; i++)
        h = (h ^ (uint8_t)t.ptr[i]) * 0x100000001b3ull;
    return h ^ t.len;
}

/* The vocabulary's index, from the model file's tokenizer, and the mask scratch. */
static sh_err vocab_build(sh_sgram *g, sh_error *e)
{
    if (g->vocab)
        return SH_OK;
    if (!g->model->gguf)
        return sh__error_set(e, SH_EINVAL,
                             "stage: grammars need a model with its tokenizer in a GGUF file");
    sh_tokenizer *t = NULL;
    sh_error te = {0};
    sh_err err = sh_tokenizer_create_gguf(g->model->gguf, &t, &te);
    if (!err)
        err = sh_gvocab_create_tokenizer(t, &g->vocab, &te);
    sh_tokenizer_destroy(t);
    if (err)
        return sh__error_set(e, err, "stage: the grammar's vocabulary index: %s", te.msg);
    int32_t nv = sh_gvocab_n_vocab(g->vocab);
    g->words = (nv + 63) / 64;
    for (int i = 0; i < 2; i++) {
        g->bits[i] = malloc((size_t)g->words * sizeof *g->bits[i]);
        g->row[i] = malloc((size_t)g->n_vocab * sizeof *g->row[i]);
        if (!g->bits[i] || !g->row[i])
            return sh__error_set(e, SH_ENOMEM, "stage: out of memory for a grammar mask");
    }
    return SH_OK;
}

/* The cache entry of the grammar whose hash is h, parsed from `text` when new (into an entry no
 * sequence uses); SH_ENOTFOUND when it is not there and text is empty (only the hash came). */
static sh_err entry_get(sh_sgram *g, sh_strv text, uint64_t h, int32_t *out, sh_error *e)
{
    int32_t spare = -1;
    for (int32_t i = 0; i < g->n_cache; i++) {
        sgram_entry *c = &g->cache[i];
        if (c->g && c->hash == h && (!text.len || c->len == text.len)) {
            *out = i;
            return SH_OK;
        }
        if (c->refs == 0 && (spare < 0 || !c->g))
            spare = i;
    }
    if (!text.len)
        return sh__error_set(e, SH_ENOTFOUND, "its grammar is not in this stage's cache");
    if (spare < 0)
        return sh__error_set(e, SH_EBUSY, "stage: too many grammars at once");
    sgram_entry *c = &g->cache[spare];
    sh_grammar_free(c->g);
    *c = (sgram_entry){0};
    sh_err err = sh_grammar_parse(text.ptr, text.len, &c->g, e);
    if (err)
        return err;
    c->hash = h;
    c->len = text.len;
    *out = spare;
    return SH_OK;
}

void sh__sgram_seq_clear(sh_sgram *g, sh_sgram_seq *s)
{
    if (s->gm) {
        sh_gmatch_free(s->gm);
        g->cache[s->entry].refs--;
    }
    *s = (sh_sgram_seq){0};
}

sh_err sh__sgram_seq_sync(sh_sgram *g, sh_sgram_seq *s, sh_strv text, uint64_t hash, sh_i32s gen,
                          uint32_t n_gen, uint64_t seq, sh_error *e)
{
    // A sequence's grammar never changes (the slot is keyed by the sequence, as its sampler is):
    // a matcher of that grammar at this point is the one. With the text, the length stands for
    // the hash (no hash over the text at every step).
    if (text.len ? s->gm && s->len == text.len && s->n == (int64_t)gen.n
                 : s->gm && s->hash == hash && s->n == (int64_t)n_gen)
        return SH_OK;
    if (!text.len && n_gen > 0)
        return sh__error_set(e, SH_ENOTFOUND,
                             "stage: sequence %" PRIu64 ": its grammar's matcher is not here after "
                             "%u generated tokens (a slot reused, or a stage restarted) and the "
                             "step names the grammar by its hash only",
                             seq, (unsigned)n_gen);
    uint64_t h = text.len ? sh__sgram_text_hash(text) : hash;
    sh__sgram_seq_clear(g, s);
    sh_error ge = {0};
    sh_err err = vocab_build(g, &ge);
    int32_t at = -1;
    if (!err)
        err = entry_get(g, text, h, &at, &ge);
    if (!err)
        err = sh_gmatch_create(g->cache[at].g, &s->gm, &ge);
    if (err)
        return sh__error_set(e, err, "stage: sequence %" PRIu64 ": %s", seq, ge.msg);
    s->entry = at;
    s->hash = h;
    s->len = g->cache[at].len;
    g->cache[at].refs++;
    int32_t nv = sh_gvocab_n_vocab(g->vocab);
    for (uint32_t i = 0; i < gen.n; i++) {
        int32_t tok = sh_i32s_at(gen, i);
        if (tok < 0 || tok >= nv || !sh_gmatch_accept_token(s->gm, g->vocab, tok)) {
            sh_error me = {0};
            err = sh_gmatch_error(s->gm, &me);
            sh__sgram_seq_clear(g, s);
            if (err)
                return sh__error_set(e, err,
                                     "stage: sequence %" PRIu64
                                     ": grammar limit hit replaying generated token %u: %s",
                                     seq, (unsigned)i, me.msg);
            return sh__error_set(e, SH_EINVAL,
                                 "stage: sequence %" PRIu64
                                 ": generated token %d at index %u is outside its grammar",
                                 seq, (int)tok, (unsigned)i);
        }
    }
    s->n = gen.n;
    return SH_OK;
}

static bool token_ok(sh_sgram *g, sh_sgram_seq *s, int32_t tok)
{
    return tok >= 0 && tok < sh_gvocab_n_vocab(g->vocab) &&
           sh_gmatch_token_ok(s->gm, g->vocab, tok);
}

/* Fills e for a failed sample of s: the matcher's bound when it passed one, else no token left. */
static sh_err sample_error(const sh_sgram_seq *s, sh_err err, sh_error *e)
{
    sh_error me = {0};
    sh_err merr = sh_gmatch_error(s->gm, &me);
    if (merr)
        return sh__error_set(e, merr,
                             "grammar limit hit after %lld generated tokens (%s): the grammar is "
                             "too ambiguous or deeply nested for this output",
                             (long long)s->n, me.msg);
    if (err == SH_ERANGE)
        return sh__error_set(e, err,
                             "every token is banned after %lld generated tokens: the grammar "
                             "(with logit_bias and min_tokens) leaves no token to sample",
                             (long long)s->n);
    return sh__error_set(e, err, "sampling with the grammar failed after %lld generated tokens: %s",
                         (long long)s->n, sh_strerror(err));
}

sh_err sh__sgram_sample(sh_sgram *g, sh_sgram_seq *s, sh_sampler *smp, const float *row, int th,
                        bool mask_first, sh_sample *out, sh_error *e)
{
    if (!mask_first) {
        sh_err err = sh_sampler_sample(smp, row, out);
        if (err)
            return sample_error(s, err, e);
        if (token_ok(g, s, out->id))
            return SH_OK;
    }
    sh_err err = sh_gmatch_mask(s->gm, g->vocab, g->bits[th]);
    if (err)
        return sample_error(s, err, e);
    float *r = g->row[th];
    int32_t nv = sh_gvocab_n_vocab(g->vocab);
    for (int32_t i = 0; i < g->n_vocab; i++)
        r[i] = i < nv && (g->bits[th][i >> 6] >> (i & 63)) & 1 ? row[i] : -INFINITY;
    err = sh_sampler_sample(smp, r, out);
    return err ? sample_error(s, err, e) : SH_OK;
}

void sh__sgram_seq_accept(sh_sgram *g, sh_sgram_seq *s, int32_t tok)
{
    if (!s->gm)
        return;
    if (token_ok(g, s, tok) && sh_gmatch_accept_token(s->gm, g->vocab, tok))
        s->n++;
    else
        sh__sgram_seq_clear(g, s); /* the next step replays and names the problem */
}
