/* Embeddings through the C API (sh_request_opts.embed) on the tiny stories260K model: one unit
 * vector of the model's width in on_done, no tokens, the same alone and among 15 other requests
 * (within 1e-5), text and token-id prompts, and an embedding beside a completion. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sh_test.h"
#include "shoal.h"

#define MODEL "tests/data/stories260K/stories260K.gguf"
#define DIM_MAX 1024

typedef struct got {
    float v[DIM_MAX];
    int32_t n, n_done, n_token, n_error, prompt_tokens;
} got;

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    (void)id;
    (void)ev;
    ((got *)user)->n_token++;
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    (void)id;
    got *g = user;
    g->n_done++;
    g->prompt_tokens = info->prompt_tokens;
    g->n = info->n_embedding;
    if (info->embedding && info->n_embedding <= DIM_MAX)
        memcpy(g->v, info->embedding, (size_t)info->n_embedding * sizeof(float));
}

static void on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    fprintf(stderr, "on_error: %s: %s\n", sh_strerror(code), msg);
    ((got *)user)->n_error++;
}

static const sh_callbacks cb = {on_token, on_done, on_error};

static sh_engine *open_tiny(void)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = 2;
    o.kv_bytes = 8u << 20;
    sh_engine *eng = NULL;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s: %s\n", sh_strerror(rc), e.msg);
    CHECK_OK(rc);
    return eng;
}

static void run_all(sh_engine *eng)
{
    for (int i = 0; i < 12000 && sh_pending(eng) > 0; i++)
        CHECK_OK(sh_poll(eng, 10, NULL));
    CHECK_INT_EQ(sh_pending(eng), 0);
}

static void submit_ids(sh_engine *eng, const int32_t *ids, int32_t n, bool embed, got *g)
{
    sh_request_opts r = sh_request_opts_default();
    r.prompt_tokens = ids;
    r.n_prompt_tokens = n;
    r.embed = embed;
    r.max_tokens = 8;
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, &r, &cb, g, &id, &e);
    if (rc)
        fprintf(stderr, "submit: %s\n", e.msg);
    CHECK_OK(rc);
}

static const int32_t ids_a[] = {1, 403, 289, 30, 61, 109, 7, 250, 33};

static void test_alone_vs_batch(void)
{
    sh_engine *eng = open_tiny();
    got *alone = calloc(1, sizeof *alone);
    got *many = calloc(16, sizeof *many);
    submit_ids(eng, ids_a, 9, true, alone);
    run_all(eng);
    CHECK_INT_EQ(alone->n_done, 1);
    CHECK_INT_EQ(alone->n_token, 0);
    CHECK_INT_EQ(alone->prompt_tokens, 9);
    CHECK(alone->n > 0 && alone->n <= DIM_MAX);
    double norm = 0;
    for (int32_t j = 0; j < alone->n; j++)
        norm += (double)alone->v[j] * alone->v[j];
    CHECK_NEAR(sqrt(norm), 1.0, 1e-5);
    /* 16 at once, ids_a in the middle of others of other lengths, one a completion */
    int32_t other[64];
    for (int32_t i = 0; i < 64; i++)
        other[i] = 1 + (i * 37) % 500;
    for (int32_t k = 0; k < 16; k++) {
        if (k == 7)
            submit_ids(eng, ids_a, 9, true, &many[k]);
        else
            submit_ids(eng, other, 4 + k * 3, k != 3, &many[k]);
    }
    run_all(eng);
    for (int32_t k = 0; k < 16; k++) {
        CHECK_INT_EQ(many[k].n_done, 1);
        CHECK_INT_EQ(many[k].n_error, 0);
        CHECK_INT_EQ(many[k].n, k == 3 ? 0 : alone->n);
    }
    CHECK(many[3].n_token > 0); /* the completion generated */
    float d = 0;
    for (int32_t j = 0; j < alone->n; j++)
        d = fmaxf(d, fabsf(alone->v[j] - many[7].v[j]));
    fprintf(stderr, "alone vs among 16: max |diff| %g\n", (double)d);
    CHECK(d <= 1e-5f);
    float diff01 = 0;
    for (int32_t j = 0; j < alone->n; j++)
        diff01 = fmaxf(diff01, fabsf(many[0].v[j] - many[1].v[j]));
    CHECK(diff01 > 1e-3f);
    free(alone);
    free(many);
    sh_engine_close(eng);
}

static void test_text(void)
{
    sh_engine *eng = open_tiny();
    got *g = calloc(2, sizeof *g);
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.embed = true;
    uint64_t id = 0;
    CHECK_OK(sh_submit(eng, &r, &cb, &g[0], &id, NULL));
    CHECK_OK(sh_submit(eng, &r, &cb, &g[1], &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(g[0].n_done + g[1].n_done, 2);
    CHECK(g[0].n > 0 && g[0].n == g[1].n);
    CHECK(memcmp(g[0].v, g[1].v, (size_t)g[0].n * sizeof(float)) == 0);
    free(g);
    sh_engine_close(eng);
}

static const sh_test_case tests[] = {
    {"alone_vs_batch", test_alone_vs_batch},
    {"text", test_text},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
