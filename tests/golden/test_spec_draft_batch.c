/* The batched model drafter (model/spec_draft_batch.h) against the one-sequence drafter
 * (model/spec_draft.h) on stories260K: several sequences stepped as a batcher steps them
 * (prefill chunks, decode steps after accepted runs, a retried step, a sequence joining past
 * position 0 with and without its earlier tokens) get, each, exactly the drafts a one-sequence
 * drafter proposes for its history; a pool too small for all of them evicts and drafts nothing
 * wrong; a draft with another vocabulary is refused. */
#include <stdio.h>
#include <unistd.h>

#include "llama_driver.h"
#include "model/spec.h"
#include "model/spec_draft.h"
#include "model/spec_draft_batch.h"
#include "model/tokenizer.h"

#define GGUF "tests/data/stories260K/stories260K.gguf"
#define SMOLLM "models/smollm2-135m-instruct-q4_1.gguf"
#define NSEQ 6
#define CAP 512

static int32_t expected[257];

typedef struct target {
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
} target;

static bool target_open(target *t)
{
    memset(t, 0, sizeof *t);
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 1};
    CHECK_OK(sh_llama_load(sh_test_path(GGUF), NULL, &t->m, &e));
    if (t->m)
        CHECK_OK(sh_tokenizer_create_gguf(t->m->gguf, &t->tok, &e));
    CHECK_OK(sh_backend_cpu_create(&bo, &t->be, &e));
    return t->m && t->tok && t->be;
}

static void target_close(target *t)
{
    sh_backend_destroy(t->be);
    sh_tokenizer_destroy(t->tok);
    sh_llama_destroy(t->m);
}

static sh_spec_drafts *batch_drafter(target *t, int32_t self_layers, int32_t kv_tokens,
                                     int32_t max_tokens)
{
    sh_spec_drafts_opts o = {.draft = {.path = self_layers ? NULL : sh_test_path(GGUF),
                                       .self_layers = self_layers,
                                       .kv_tokens = kv_tokens,
                                       .max_tokens = max_tokens},
                             .max_seqs = NSEQ + 2,
                             .max_slots = 2 * NSEQ + 4,
                             .seq_tokens = CAP};
    sh_spec_drafts *d = NULL;
    sh_error e = {0};
    if (sh_spec_drafts_create(t->m, t->tok, t->be, &o, &d, &e))
        SH_FAIL_("batched drafter: %s", e.msg);
    return d;
}

static sh_spec_draft *one_drafter(target *t, int32_t self_layers)
{
    sh_spec_draft_opts o = {.path = self_layers ? NULL : sh_test_path(GGUF),
                            .self_layers = self_layers,
                            .kv_tokens = CAP,
                            .max_tokens = 16};
    sh_spec_draft *d = NULL;
    sh_error e = {0};
    if (sh_spec_draft_create(t->m, t->tok, t->be, &o, &d, &e))
        SH_FAIL_("drafter: %s", e.msg);
    return d;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static int32_t rnd(int32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (int32_t)(rng % (uint64_t)n);
}

typedef struct seq {
    int32_t hist[CAP];
    int32_t n;     /* tokens known */
    int32_t sent;  /* tokens of the prompt the drafter was given */
    bool decoding; /* the whole prompt was given */
    int32_t out[SH_SPEC_MAX_K];
} seq;

/* Steps NSEQ sequences `steps` times through the batched drafter b and checks each one's drafts
 * against a one-sequence drafter's for the same history (exact when `exact`, else the batched
 * one may draft nothing when its pool had no room). Returns the drafts compared equal. */
static int32_t run(target *t, sh_spec_drafts *b, int32_t self_layers, int32_t steps, bool exact)
{
    static seq s[NSEQ];
    sh_spec_draft *one[NSEQ] = {0};
    int32_t equal = 0;
    for (int32_t i = 0; i < NSEQ; i++) {
        if (!(one[i] = one_drafter(t, self_layers)))
            goto out;
        /* Prompts: stories260K's greedy text with one changed token, of different lengths. */
        s[i].n = 6 + 9 * i;
        memcpy(s[i].hist, expected, (size_t)s[i].n * sizeof(int32_t));
        s[i].hist[2 + i] = (s[i].hist[2 + i] + 11 * (i + 1)) % 512;
        s[i].sent = 0;
        s[i].decoding = false;
    }
    sh_error e = {0};
    for (int32_t step = 0; step < steps; step++) {
        sh_spec_drafts_req r[NSEQ];
        int32_t n = 0, who[NSEQ];
        for (int32_t i = 0; i < NSEQ; i++) {
            if (rnd(5) == 0 && step > 0)
                continue; /* not in this step */
            seq *q = &s[i];
            /* A prefill in two chunks (the first drafts nothing), else the last token: after a
             * verification the first position not accepted (the accepted drafts are not sent
             * again), or the same step again (a retry). */
            int32_t pos = q->decoding ? q->n - 1 : q->sent;
            int32_t len = q->n - pos;
            if (q->sent == 0 && q->n > 8 && rnd(2) == 0)
                len = q->n / 2;
            r[n] = (sh_spec_drafts_req){.id = 100 + (uint64_t)i,
                                        .pos = pos,
                                        .tokens = q->hist + pos,
                                        .n_tokens = len,
                                        .k = pos + len == q->n ? 1 + rnd(7) : 0,
                                        .out = q->out};
            who[n++] = i;
        }
        if (sh_spec_drafts_step(b, r, n, &e)) {
            SH_FAIL_("step %d: %s", (int)step, e.msg);
            goto out;
        }
        for (int32_t j = 0; j < n; j++) {
            seq *q = &s[who[j]];
            q->sent = r[j].pos + r[j].n_tokens;
            q->decoding = q->sent == q->n;
            if (r[j].k == 0) {
                CHECK_INT_EQ(r[j].n_out, 0);
                continue;
            }
            int32_t ref[SH_SPEC_MAX_K], nr = 0;
            CHECK_OK(sh_spec_draft_propose(one[who[j]], q->hist, q->n, r[j].k, ref, &nr, &e));
            if (!exact && r[j].n_out == 0)
                continue;
            CHECK_INT_EQ(r[j].n_out, nr);
            if (r[j].n_out != nr || memcmp(r[j].out, ref, (size_t)nr * sizeof(int32_t)) != 0) {
                SH_FAIL_("step %d, sequence %d (%d tokens): the batched drafts differ", (int)step,
                         (int)who[j], (int)q->n);
                goto out;
            }
            equal += nr;
            if (rnd(6) == 0)
                continue; /* the step is lost: it is sent again as it was */
            /* Verification: some drafts accepted, then a token of the target's own. */
            int32_t acc = rnd(nr + 1);
            if (q->n + acc + 1 >= CAP - SH_SPEC_MAX_K)
                continue;
            memcpy(q->hist + q->n, ref, (size_t)acc * sizeof(int32_t));
            q->n += acc;
            q->hist[q->n++] = acc < nr ? (ref[acc] + 1 + rnd(500)) % 512 : rnd(512);
        }
    }
out:
    for (int32_t i = 0; i < NSEQ; i++)
        sh_spec_draft_destroy(one[i]);
    return equal;
}

static void check_same(int32_t self_layers, int32_t max_tokens)
{
    target t;
    sh_spec_drafts *b = NULL;
    if (!target_open(&t) || !(b = batch_drafter(&t, self_layers, NSEQ * CAP, max_tokens)))
        goto out;
    CHECK(run(&t, b, self_layers, 40, true) > 100);
out:
    sh_spec_drafts_destroy(b);
    target_close(&t);
}

/* A draft model drafting for itself, catch-up passes wide enough for every prefill at once, and
 * so narrow that prefills take several. */
static void test_same_draft(void) { check_same(0, 256); }
static void test_same_draft_narrow(void) { check_same(0, NSEQ + 2); }
static void test_same_self(void) { check_same(2, 64); }

/* A pool of 8 blocks for 6 sequences: evictions, and never a wrong draft. */
static void test_small_pool(void)
{
    target t;
    sh_spec_drafts *b = NULL;
    if (!target_open(&t) || !(b = batch_drafter(&t, 0, 8 * SH_KV_BLOCK_TOKENS, 64)))
        goto out;
    CHECK(run(&t, b, 0, 30, false) > 0);
out:
    sh_spec_drafts_destroy(b);
    target_close(&t);
}

/* A sequence first seen past position 0 drafts nothing without its earlier tokens and exactly
 * with them (prior); a forgotten one drafts nothing until it comes whole again. */
static void test_join(void)
{
    target t;
    sh_spec_drafts *b = NULL;
    sh_spec_draft *one = NULL;
    if (!target_open(&t) || !(b = batch_drafter(&t, 0, 1024, 64)) || !(one = one_drafter(&t, 0)))
        goto out;
    int32_t out[SH_SPEC_MAX_K], ref[SH_SPEC_MAX_K], nr = 0;
    sh_error e = {0};
    sh_spec_drafts_req r = {
        .id = 7, .pos = 30, .tokens = expected + 30, .n_tokens = 2, .k = 5, .out = out};
    CHECK_OK(sh_spec_drafts_step(b, &r, 1, &e));
    CHECK_INT_EQ(r.n_out, 0);
    r.prior = expected;
    r.n_prior = 30;
    CHECK_OK(sh_spec_drafts_step(b, &r, 1, &e));
    CHECK_OK(sh_spec_draft_propose(one, expected, 32, 5, ref, &nr, &e));
    CHECK_INT_EQ(r.n_out, 5);
    CHECK_INT_EQ(nr, 5);
    CHECK(memcmp(out, ref, sizeof(int32_t) * 5) == 0);
    CHECK(memcmp(out, expected + 32, sizeof(int32_t) * 5) == 0); /* it drafts for itself */
    /* Its catch-up over 32 tokens was history; a decode step's one row is not. */
    CHECK(sh_spec_drafts_extra_us(b) > 0);
    r = (sh_spec_drafts_req){
        .id = 7, .pos = 32, .tokens = expected + 32, .n_tokens = 1, .k = 2, .out = out};
    CHECK_OK(sh_spec_drafts_step(b, &r, 1, &e));
    CHECK_INT_EQ(r.n_out, 2);
    CHECK_UINT_EQ(sh_spec_drafts_extra_us(b), 0);
    /* A hole in its history (positions 33..39 never given): nothing. */
    r = (sh_spec_drafts_req){
        .id = 7, .pos = 40, .tokens = expected + 40, .n_tokens = 1, .k = 3, .out = out};
    CHECK_OK(sh_spec_drafts_step(b, &r, 1, &e));
    CHECK_INT_EQ(r.n_out, 0);
    sh_spec_drafts_forget(b, 7);
    r = (sh_spec_drafts_req){
        .id = 7, .pos = 0, .tokens = expected, .n_tokens = 41, .k = 3, .out = out};
    CHECK_OK(sh_spec_drafts_step(b, &r, 1, &e));
    CHECK_INT_EQ(r.n_out, 3);
    CHECK(memcmp(out, expected + 41, sizeof(int32_t) * 3) == 0);
    /* Bad requests. */
    r.id = 0;
    CHECK_INT_EQ(sh_spec_drafts_step(b, &r, 1, &e), SH_EINVAL);
    r.id = 7;
    r.k = SH_SPEC_MAX_K + 1;
    CHECK_INT_EQ(sh_spec_drafts_step(b, &r, 1, &e), SH_EINVAL);
out:
    sh_spec_draft_destroy(one);
    sh_spec_drafts_destroy(b);
    target_close(&t);
}

static void test_refusals(void)
{
    target t;
    if (!target_open(&t))
        goto out;
    sh_spec_drafts_opts o = {.draft = {.kv_tokens = 512, .max_tokens = 16},
                             .max_seqs = 4,
                             .max_slots = 8,
                             .seq_tokens = 256};
    sh_spec_drafts *d = NULL;
    sh_error e = {0};
    o.draft.self_layers = t.m->hp.n_layers;
    CHECK_INT_EQ(sh_spec_drafts_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "from 1 to 4") != NULL);
    o.draft.self_layers = 0;
    o.draft.path = "/nonexistent/draft.gguf";
    CHECK(sh_spec_drafts_create(t.m, t.tok, t.be, &o, &d, &e) != SH_OK);
    CHECK(strstr(e.msg, "/nonexistent/draft.gguf") != NULL);
    if (access(sh_test_path(SMOLLM), R_OK) == 0) {
        o.draft.path = sh_test_path(SMOLLM);
        CHECK_INT_EQ(sh_spec_drafts_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "49152") != NULL && strstr(e.msg, "512") != NULL);
    }
    o.draft.path = sh_test_path(GGUF);
    o.max_slots = 2;
    CHECK_INT_EQ(sh_spec_drafts_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    CHECK(d == NULL);
out:
    target_close(&t);
}

static const sh_test_case tests[] = {
    {"same_draft", test_same_draft},
    {"same_draft_narrow", test_same_draft_narrow},
    {"same_self", test_same_self},
    {"small_pool", test_small_pool},
    {"join", test_join},
    {"refusals", test_refusals},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    expected[0] = 1;
    if (read_ids(sh_test_path("tests/data/stories260K/expected_ids_bos_256.txt"), expected + 1,
                 256) != 256)
        return 1;
    return sh_test_main(argc, argv, tests);
}
