/* Speculative decoding's model drafters on stories260K (a real trained model): a context with an
 * early exit (sh_llama_ctx_opts.exit_layer) gives the head applied to that layer's output, a
 * draft model drafting for itself proposes llama2.c's greedy ids, a drafter's cache follows a
 * history that changes under it (rollback by prefix) exactly as a fresh drafter, and a draft with
 * another vocabulary, a missing file or bad layers are refused with a message. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "llama_driver.h"
#include "model/spec.h"
#include "model/spec_draft.h"
#include "model/tokenizer.h"

#define GGUF "tests/data/stories260K/stories260K.gguf"
#define SMOLLM "models/smollm2-135m-instruct-q4_1.gguf"
#define N 256

static int32_t expected[N + 1]; /* BOS, then llama2.c's greedy ids */

static bool load_expected(void)
{
    expected[0] = 1;
    int32_t n =
        read_ids(sh_test_path("tests/data/stories260K/expected_ids_bos_256.txt"), expected + 1, N);
    CHECK_INT_EQ(n, N);
    return n == N;
}

/* Runs toks[0, n) from position 0 through ctx c with every row's logits (or, for a stage
 * without the head, its hidden rows) and copies them into dst. */
static bool run_rows(sh_llama_ctx *c, const int32_t *toks, int32_t n, float *dst, size_t floats)
{
    static int32_t blocks[64];
    for (int32_t i = 0; i < 64; i++)
        blocks[i] = i;
    sh_llama_seq s = {.tokens = toks, .n_tokens = n, .pos0 = 0, .blocks = blocks};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s, .all_logits = true};
    sh_llama_out out;
    sh_error e = {0};
    if (sh_llama_forward(c, &b, &out, &e)) {
        SH_FAIL_("forward: %s", e.msg);
        return false;
    }
    memcpy(dst, out.logits ? out.logits : out.hidden, floats * sizeof(float));
    return true;
}

/* exit_layer L: the logits equal rmsnorm(hidden after layer L) * out_norm times the (tied, F32)
 * head, with the hidden rows from a stage loaded as layers [0, L); exit_layer n_layers gives the
 * plain context's logits bit for bit; bad exits are refused. */
static void test_exit_layer(void)
{
    const int32_t L = 3, T = 12;
    sh_llama *whole = NULL, *stage = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *cx = NULL, *cs = NULL, *cf = NULL, *cn = NULL, *bad = NULL;
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 1};
    sh_llama_load_opts lo = {.first = 0, .last = L};
    CHECK_OK(sh_llama_load(sh_test_path(GGUF), NULL, &whole, &e));
    CHECK_OK(sh_llama_load(sh_test_path(GGUF), &lo, &stage, &e));
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    if (!whole || !stage || !be)
        goto out;
    const sh_llama_hparams *hp = &whole->hp;
    const int32_t V = hp->n_vocab, D = hp->dim;
    sh_llama_ctx_opts co = {.max_tokens = 32, .max_seqs = 1, .max_logits = 32, .kv_tokens = 256};
    sh_llama_ctx_opts cox = co;
    cox.exit_layer = L;
    CHECK_OK(sh_llama_ctx_create(whole, be, &cox, &cx, &e));
    CHECK_OK(sh_llama_ctx_create(stage, be, &co, &cs, &e));
    if (!cx || !cs)
        goto out;
    static float lg[32 * 512], hid[32 * 64], ref[512];
    CHECK(V <= 512 && D <= 64);
    CHECK_INT_EQ(whole->output.type, SH_DTYPE_F32);
    if (V > 512 || D > 64 || whole->output.type != SH_DTYPE_F32)
        goto out;
    if (!run_rows(cx, expected, T, lg, (size_t)T * V) ||
        !run_rows(cs, expected, T, hid, (size_t)T * D))
        goto out;
    const float *W = whole->output.data; // (V, D)
    double worst = 0.0;
    for (int32_t t = 0; t < T; t++) {
        const float *x = hid + (size_t)t * D;
        double ss = 0.0;
        for (int32_t i = 0; i < D; i++)
            ss += (double)x[i] * x[i];
        double inv = 1.0 / sqrt(ss / D + hp->norm_eps);
        for (int32_t v = 0; v < V; v++) {
            double acc = 0.0;
            for (int32_t i = 0; i < D; i++)
                acc += x[i] * inv * whole->out_norm[i] * W[(size_t)v * D + i];
            ref[v] = (float)acc;
        }
        for (int32_t v = 0; v < V; v++) {
            double d = fabs(ref[v] - lg[(size_t)t * V + v]);
            worst = d > worst ? d : worst;
        }
    }
    CHECK_NEAR(worst, 0.0, 1e-3);
    /* The early exit's greedy picks differ from the whole model's somewhere (else the test
     * could not tell the layers apart). */
    static float full[32 * 512];
    cox.exit_layer = hp->n_layers;
    CHECK_OK(sh_llama_ctx_create(whole, be, &cox, &cf, &e));
    CHECK_OK(sh_llama_ctx_create(whole, be, &co, &cn, &e));
    if (!cf || !cn || !run_rows(cn, expected, T, full, (size_t)T * V))
        goto out;
    int32_t differ = 0;
    for (int32_t t = 0; t < T; t++)
        differ += argmax(full + (size_t)t * V, V) != argmax(lg + (size_t)t * V, V);
    CHECK(differ > 0);
    if (!run_rows(cf, expected, T, lg, (size_t)T * V))
        goto out;
    CHECK(memcmp(lg, full, (size_t)T * V * sizeof(float)) == 0);
    /* Refused: past the last layer, and on a stage that is not the whole model. */
    cox.exit_layer = hp->n_layers + 1;
    CHECK_INT_EQ(sh_llama_ctx_create(whole, be, &cox, &bad, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "early exit") != NULL);
    cox.exit_layer = 1;
    CHECK_INT_EQ(sh_llama_ctx_create(stage, be, &cox, &bad, &e), SH_EINVAL);
    CHECK(bad == NULL);
out:
    sh_llama_ctx_destroy(cx);
    sh_llama_ctx_destroy(cs);
    sh_llama_ctx_destroy(cf);
    sh_llama_ctx_destroy(cn);
    sh_backend_destroy(be);
    sh_llama_destroy(whole);
    sh_llama_destroy(stage);
}

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

static sh_spec_draft *drafter(target *t, const char *path, int32_t self_layers)
{
    sh_spec_draft_opts o = {.path = path ? sh_test_path(path) : NULL,
                            .self_layers = self_layers,
                            .kv_tokens = 512,
                            .max_tokens = 16};
    sh_spec_draft *d = NULL;
    sh_error e = {0};
    sh_err err = sh_spec_draft_create(t->m, t->tok, t->be, &o, &d, &e);
    if (err)
        SH_FAIL_("drafter: %s", e.msg);
    return d;
}

/* A draft model drafting for itself proposes exactly the greedy continuation, from any point of
 * a history that moves forward by accepted runs (its cache catching up by prefix). */
static void test_draft_same_model(void)
{
    target t;
    sh_spec_draft *d = NULL;
    if (!target_open(&t) || !(d = drafter(&t, GGUF, 0)))
        goto out;
    CHECK_INT_EQ(sh_spec_draft_layers(d), t.m->hp.n_layers);
    sh_error e = {0};
    int32_t out[SH_SPEC_MAX_K], n_out = 0;
    for (int32_t n = 1; n + 8 <= N; n += 1 + n % 7) {
        CHECK_OK(sh_spec_draft_propose(d, expected, n, 8, out, &n_out, &e));
        CHECK_INT_EQ(n_out, 8);
        for (int32_t i = 0; i < n_out; i++)
            if (out[i] != expected[n + i]) {
                SH_FAIL_("after %d tokens, draft %d is %d, greedy gives %d", (int)n, (int)i,
                         (int)out[i], (int)expected[n + i]);
                goto out;
            }
    }
out:
    sh_spec_draft_destroy(d);
    target_close(&t);
}

/* A drafter whose history is rewritten (rejected drafts, a chat turn's new text) proposes what a
 * fresh drafter proposes for the new history: nothing of the overwritten positions leaks. */
static void check_rollback(int32_t self_layers)
{
    target t;
    sh_spec_draft *d = NULL, *fresh = NULL;
    if (!target_open(&t) || !(d = drafter(&t, self_layers ? NULL : GGUF, self_layers)))
        goto out;
    int32_t alt[64];
    memcpy(alt, expected, sizeof alt);
    alt[20] = (alt[20] + 7) % 512;
    alt[21] = (alt[21] + 3) % 512;
    const struct {
        const int32_t *h;
        int32_t n;
    } seq[] = {{expected, 40}, {alt, 30}, {alt, 25}, {expected, 22}, {alt, 50}, {expected, 60}};
    sh_error e = {0};
    for (size_t s = 0; s < sizeof seq / sizeof seq[0]; s++) {
        int32_t a[SH_SPEC_MAX_K], b[SH_SPEC_MAX_K], na = 0, nb = 0;
        CHECK_OK(sh_spec_draft_propose(d, seq[s].h, seq[s].n, 6, a, &na, &e));
        fresh = drafter(&t, self_layers ? NULL : GGUF, self_layers);
        if (!fresh)
            goto out;
        CHECK_OK(sh_spec_draft_propose(fresh, seq[s].h, seq[s].n, 6, b, &nb, &e));
        sh_spec_draft_destroy(fresh);
        fresh = NULL;
        CHECK_INT_EQ(na, 6);
        CHECK_INT_EQ(nb, 6);
        CHECK(memcmp(a, b, sizeof a[0] * 6) == 0);
    }
out:
    sh_spec_draft_destroy(d);
    target_close(&t);
}

static void test_rollback_draft(void) { check_rollback(0); }
static void test_rollback_self(void) { check_rollback(3); }

/* Copies stories260K.gguf with the text of one token changed (same length): a vocabulary of the
 * same size that differs in one token. Returns false when the token is not found. */
static bool write_other_vocab(const char *path)
{
    static char buf[2 << 20];
    FILE *f = fopen(sh_test_path(GGUF), "rb");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    static const char tim[] = "\x06\0\0\0\0\0\0\0\xe2\x96\x81Tim";
    for (size_t i = 0; i + sizeof tim - 1 <= n; i++)
        if (memcmp(buf + i, tim, sizeof tim - 1) == 0) {
            memcpy(buf + i + sizeof tim - 4, "Tqz", 3);
            f = fopen(path, "wb");
            if (!f)
                return false;
            bool ok = fwrite(buf, 1, n, f) == n;
            return (fclose(f) == 0) && ok;
        }
    return false;
}

static void test_refusals(void)
{
    target t;
    if (!target_open(&t))
        goto out;
    sh_spec_draft_opts o = {.kv_tokens = 512, .max_tokens = 16};
    sh_spec_draft *d = NULL;
    sh_error e = {0};
    /* self: 1..n_layers - 1 */
    o.self_layers = t.m->hp.n_layers;
    CHECK_INT_EQ(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "from 1 to 4") != NULL);
    o.self_layers = -1;
    CHECK_INT_EQ(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    o.self_layers = 0;
    /* a missing file, and no file */
    o.path = "/nonexistent/draft.gguf";
    CHECK(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e) != SH_OK);
    CHECK(strstr(e.msg, "/nonexistent/draft.gguf") != NULL);
    o.path = NULL;
    CHECK_INT_EQ(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    /* the same size, one token different */
    char other[] = "/tmp/shoal-spec-draft-XXXXXX";
    int fd = mkstemp(other);
    CHECK(fd >= 0);
    if (fd >= 0)
        close(fd);
    CHECK(write_other_vocab(other));
    o.path = other;
    CHECK_INT_EQ(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "Tqz") != NULL && strstr(e.msg, "Tim") != NULL &&
          strstr(e.msg, "token ") != NULL);
    unlink(other);
    /* another vocabulary size */
    if (access(sh_test_path(SMOLLM), R_OK) == 0) {
        o.path = sh_test_path(SMOLLM);
        CHECK_INT_EQ(sh_spec_draft_create(t.m, t.tok, t.be, &o, &d, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "49152") != NULL && strstr(e.msg, "512") != NULL);
    }
    CHECK(d == NULL);
out:
    target_close(&t);
}

static const sh_test_case tests[] = {
    {"exit_layer", test_exit_layer},
    {"draft_same_model", test_draft_same_model},
    {"rollback_draft", test_rollback_draft},
    {"rollback_self", test_rollback_self},
    {"refusals", test_refusals},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!load_expected())
        return 1;
    return sh_test_main(argc, argv, tests);
}
