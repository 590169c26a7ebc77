/* Sliding-window attention (Mistral-style llama.attention.sliding_window) through the whole
 * forward pass, on synthetic models written by mkmodel: the key is loaded; a token outside the
 * receptive field (layers x (window - 1) positions) cannot change the last logits, while without
 * the window it does; decoding with the blocks before the window released (-1, as the KV manager
 * leaves them) gives bitwise the logits of one full prefill; and a window longer than the
 * context changes nothing. */
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "kernels/backend.h"
#include "model/llama.h"
#include "model/mkmodel.h"
#include "sh_test.h"

enum { LAYERS = 2, WINDOW = 6, N = 40, VOCAB = 300 };

static char dir[64];

static const char *write_model(const char *name, int64_t window)
{
    static char path[2][128];
    static int k;
    char *p = path[k++ & 1];
    snprintf(p, sizeof path[0], "%s/%s", dir, name);
    sh_mkmodel_opts o;
    sh__mkmodel_opts_init(&o);
    o.shape.n_layers = LAYERS;
    o.shape.dim = 64;
    o.shape.ffn = 128;
    o.shape.n_heads = 4;
    o.shape.n_kv_heads = 2;
    o.shape.vocab = VOCAB;
    o.shape.ctx = 256;
    o.shape.sliding_window = window;
    o.type = SH_DTYPE_F32;
    o.seed = 7;
    o.std = 0.3f; /* large weights: every position visibly moves the logits */
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(p, &o, NULL, &e));
    return p;
}

typedef struct runner {
    sh_llama *m;
    sh_backend *be;
    sh_llama_ctx *ctx;
} runner;

static void open_runner(runner *r, const char *path)
{
    sh_error e = {0};
    CHECK_OK(sh_llama_load(path, NULL, &r->m, &e));
    sh_backend_cpu_opts bo = {.n_threads = 2};
    CHECK_OK(sh_backend_cpu_create(&bo, &r->be, &e));
    sh_llama_ctx_opts co = {.max_tokens = 64, .max_seqs = 2, .kv_tokens = 256};
    if (r->m && r->be)
        CHECK_OK(sh_llama_ctx_create(r->m, r->be, &co, &r->ctx, &e));
}

static void close_runner(runner *r)
{
    sh_llama_ctx_destroy(r->ctx);
    sh_backend_destroy(r->be);
    sh_llama_destroy(r->m);
}

/* Logits of the last of n tokens after one prefill (copied to out). */
static void prefill(runner *r, const int32_t *toks, int n, float *out)
{
    int32_t blocks[16];
    for (int i = 0; i < 16; i++)
        blocks[i] = 15 - i;
    sh_llama_seq s = {toks, n, 0, blocks, true, 0};
    sh_llama_batch b = {1, &s, false, NULL, false, false};
    sh_llama_out o;
    sh_error e = {0};
    CHECK_OK(sh_llama_forward(r->ctx, &b, &o, &e));
    if (o.logits)
        memcpy(out, o.logits, VOCAB * sizeof(float));
}

static bool same(const float *a, const float *b) { return memcmp(a, b, VOCAB * sizeof *a) == 0; }

static void make_tokens(int32_t *a, int32_t *b)
{
    for (int i = 0; i < N; i++)
        a[i] = b[i] = 3 + (i * 37) % (VOCAB - 3);
    /* b differs from a only far before the last position's receptive field */
    for (int i = 0; i < 10; i++)
        b[i] = 3 + (i * 11 + 5) % (VOCAB - 3);
}

/* Prefills a[0, N - 10), then decodes the rest one token at a time; out gets the last logits.
 * With release, block-table entries wholly before each row's window are -1. Also checks that a
 * released block inside the window is refused rather than read. */
static void decode_tail(const int32_t *a, bool release, float *out)
{
    runner d = {0};
    open_runner(&d, write_model(release ? "window-rel.gguf" : "window-kept.gguf", WINDOW));
    if (!d.ctx) {
        close_runner(&d);
        return;
    }
    int32_t blocks[16];
    for (int i = 0; i < 16; i++)
        blocks[i] = 15 - i;
    sh_error e = {0};
    sh_llama_out o;
    sh_llama_seq s = {a, N - 10, 0, blocks, false, 0};
    sh_llama_batch bt = {1, &s, false, NULL, false, false};
    CHECK_OK(sh_llama_forward(d.ctx, &bt, &o, &e));
    for (int p = N - 10; p < N; p++) {
        for (int j = 0; release && j < (p - WINDOW + 1) / 16; j++)
            blocks[j] = -1;
        s = (sh_llama_seq){a + p, 1, p, blocks, true, 0};
        CHECK_OK(sh_llama_forward(d.ctx, &bt, &o, &e));
    }
    if (o.logits)
        memcpy(out, o.logits, VOCAB * sizeof(float));
    if (release) {
        blocks[(N - 1) / 16] = -1; /* inside the window */
        s = (sh_llama_seq){a + N - 1, 1, N - 1, blocks, true, 0};
        CHECK_INT_EQ(sh_llama_forward(d.ctx, &bt, &o, &e), SH_EINVAL);
    }
    close_runner(&d);
}

static void test_window(void)
{
    runner w = {0}, full = {0}, wide = {0};
    open_runner(&w, write_model("window.gguf", WINDOW));
    open_runner(&full, write_model("full.gguf", 0));
    open_runner(&wide, write_model("wide.gguf", 1000));
    if (!w.ctx || !full.ctx || !wide.ctx)
        goto out;
    CHECK_INT_EQ(w.m->hp.sliding_window, WINDOW);
    CHECK_INT_EQ(full.m->hp.sliding_window, 0);

    int32_t a[N], b[N];
    make_tokens(a, b);
    static float la[VOCAB], lb[VOCAB], fa[VOCAB], fb[VOCAB], ga[VOCAB];
    /* The last position sees tokens [N - 1 - LAYERS * (WINDOW - 1), N - 1] only. */
    prefill(&w, a, N, la);
    prefill(&w, b, N, lb);
    CHECK(same(la, lb));
    prefill(&full, a, N, fa);
    prefill(&full, b, N, fb);
    CHECK(!same(fa, fb)); /* the sanity half: without the window the early tokens matter */
    CHECK(!same(la, fa));
    /* A window longer than the context is no window. */
    prefill(&wide, a, N, ga);
    CHECK(same(ga, fa));

    /* Decode the last 10 tokens one by one on fresh contexts, once with every block wholly
     * before the window released (as the KV manager leaves them) and once with all of them:
     * bitwise the same logits (released blocks are never read), and the full prefill's up to
     * float rounding (F32 weights take another matmul order for one row than for forty). */
    static float rel[VOCAB], kept[VOCAB];
    decode_tail(a, true, rel);
    decode_tail(a, false, kept);
    CHECK(same(rel, kept));
    float worst = 0;
    for (int i = 0; i < VOCAB; i++)
        worst = fabsf(rel[i] - la[i]) > worst ? fabsf(rel[i] - la[i]) : worst;
    CHECK(worst < 1e-3f);
out:
    close_runner(&w);
    close_runner(&full);
    close_runner(&wide);
}

int main(int argc, char **argv)
{
    snprintf(dir, sizeof dir, "/tmp/shoal-window-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    static const sh_test_case tests[] = {{"window", test_window}, {NULL, NULL}};
    int rc = sh_test_main(argc, argv, tests);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
