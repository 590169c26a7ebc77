/* A small single-purpose driver for the golden tests: load a model, run greedy decoding through
 * sh_llama_forward with one sequence using KV blocks 0, 1, 2, ... */
#ifndef SH_TEST_LLAMA_DRIVER_H
#define SH_TEST_LLAMA_DRIVER_H

#include "kernels/backend.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "sh_test.h"

typedef struct drv {
    sh_llama *m;
    sh_backend *be;
    sh_llama_ctx *c;
    int32_t blocks[4096];
} drv;

static inline void drv_close(drv *d)
{
    sh_llama_ctx_destroy(d->c);
    sh_backend_destroy(d->be);
    sh_llama_destroy(d->m);
    memset(d, 0, sizeof *d);
}

/* Loads `path` with a CPU backend of n_threads and a context for max_tokens rows of up to
 * max_seqs sequences. Returns false (after a failed check) when anything fails. */
static inline bool drv_open(drv *d, const char *path, int32_t n_threads, int32_t max_tokens,
                            int32_t max_seqs, int32_t kv_tokens)
{
    memset(d, 0, sizeof *d);
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = n_threads};
    sh_llama_ctx_opts co = {.max_tokens = max_tokens,
                            .max_seqs = max_seqs,
                            .max_logits = max_tokens,
                            .kv_tokens = kv_tokens};
    if (sh_llama_load(path, NULL, &d->m, &e) || sh_backend_cpu_create(&bo, &d->be, &e) ||
        sh_llama_ctx_create(d->m, d->be, &co, &d->c, &e)) {
        SH_FAIL_("open %s: %s", path, e.msg);
        drv_close(d);
        return false;
    }
    for (int32_t i = 0; i < 4096; i++)
        d->blocks[i] = i;
    return true;
}

static inline int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Feeds ids[0, n) at positions pos0.. as one chunk; returns the logits of every row (all) or of
 * the last row, or NULL after a failed check. */
static inline const float *drv_feed(drv *d, const int32_t *ids, int32_t n, int32_t pos0, bool all)
{
    sh_llama_seq s = {
        .tokens = ids, .n_tokens = n, .pos0 = pos0, .blocks = d->blocks, .want_logits = true};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s, .all_logits = all};
    sh_llama_out out;
    sh_error e = {0};
    if (sh_llama_forward(d->c, &b, &out, &e)) {
        SH_FAIL_("forward: %s", e.msg);
        return NULL;
    }
    return out.logits;
}

/* Greedy: prefill `prompt`, then n_gen tokens into gen. Returns the count produced. */
static inline int32_t drv_greedy(drv *d, const int32_t *prompt, int32_t n_prompt, int32_t n_gen,
                                 int32_t *gen)
{
    const float *lg = drv_feed(d, prompt, n_prompt, 0, false);
    int32_t V = d->m->hp.n_vocab;
    for (int32_t i = 0; i < n_gen && lg; i++) {
        gen[i] = argmax(lg, V);
        if (i + 1 == n_gen)
            return n_gen;
        lg = drv_feed(d, &gen[i], 1, n_prompt + i, false);
    }
    return 0;
}

/* Reads up to cap whitespace-separated integers from a file; returns the count (-1: missing). */
static inline int32_t read_ids(const char *path, int32_t *ids, int32_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int32_t n = 0;
    while (n < cap && fscanf(f, "%d", &ids[n]) == 1)
        n++;
    fclose(f);
    return n;
}

#endif
