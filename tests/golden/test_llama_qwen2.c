/* Golden test of the qwen2 path (NeoX RoPE, Q/K/V biases, tied head, F16 weights) on a tiny
 * seeded model from tests/reference/make_tiny_qwen2.py, against ref_forward.py's logits. */
#include "golden_ref.h"

#define MODEL "tests/data/golden/qwen2-tiny-f16.gguf"
#define GOLDEN "tests/data/golden/qwen2-tiny-f16"

static void test_hparams(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh_llama_load(sh_test_path(MODEL), NULL, &m, &e));
    if (!m)
        return;
    CHECK_STR_EQ(m->hp.arch, "qwen2");
    CHECK_INT_EQ(m->hp.rope_mode, SH_ROPE_MODE_NEOX);
    CHECK(m->hp.qkv_bias && m->hp.tied_embeddings);
    CHECK_INT_EQ(m->hp.head_dim, 16);
    CHECK_INT_EQ(m->hp.n_kv_heads, 2);
    CHECK_NEAR(m->hp.rope_base, 1e6, 1.0);
    CHECK(m->layers[1].bq != NULL && m->output.data == m->tok_embd.data);
    sh_llama_destroy(m);
}

/* F16 weights are widened exactly and multiplied in f32, as the reference does. */
static void test_logits(void) { compare_logits(sh_test_path(MODEL), GOLDEN, 1e-4, true, 0.0); }

static void test_greedy(void)
{
    drv d;
    if (!drv_open(&d, sh_test_path(MODEL), 1, 64, 1, 256))
        return;
    for (int p = 0; p < n_gp; p++) {
        int32_t gen[MAX_IDS];
        CHECK_INT_EQ(drv_greedy(&d, gp[p].prompt, gp[p].n_prompt, gp[p].n_gen, gen), gp[p].n_gen);
        for (int i = 0; i < gp[p].n_gen; i++)
            if (gen[i] != gp[p].gen[i]) {
                SH_FAIL_("%s: greedy id %d is %d, reference %d", gp[p].name, i, (int)gen[i],
                         (int)gp[p].gen[i]);
                break;
            }
    }
    drv_close(&d);
}

/* An F16 KV cache changes the logits only by the rounding of keys and values (about 1e-3). */
static void test_kv_f16(void)
{
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *c[2] = {NULL, NULL};
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 1};
    CHECK_OK(sh_llama_load(sh_test_path(MODEL), NULL, &m, &e));
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    if (!m || !be)
        goto out;
    static float lg[2][64 * 128];
    int32_t blocks[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int k = 0; k < 2; k++) {
        sh_llama_ctx_opts co = {.max_tokens = 64,
                                .max_seqs = 1,
                                .max_logits = 64,
                                .kv_tokens = 256,
                                .kv_type = k ? SH_DTYPE_F16 : SH_DTYPE_F32};
        CHECK_OK(sh_llama_ctx_create(m, be, &co, &c[k], &e));
        if (!c[k])
            goto out;
        sh_llama_seq s = {.tokens = gp[0].prompt, .n_tokens = gp[0].n_prompt, .blocks = blocks};
        sh_llama_batch b = {.n_seqs = 1, .seqs = &s, .all_logits = true};
        sh_llama_out o;
        CHECK_OK(sh_llama_forward(c[k], &b, &o, &e));
        if (o.logits)
            memcpy(lg[k], o.logits, sizeof(float) * (size_t)o.n_logits * 128);
    }
    double worst = 0.0, mx = 0.0;
    for (int i = 0; i < gp[0].n_prompt * 128; i++) {
        worst = fmax(worst, fabs(lg[0][i] - lg[1][i]));
        mx = fmax(mx, fabs(lg[0][i]));
    }
    CHECK(worst > 0.0); // the F16 cache is really used
    CHECK_NEAR(worst / mx, 0.0, 1e-2);
out:
    sh_llama_ctx_destroy(c[0]);
    sh_llama_ctx_destroy(c[1]);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
}

/* The prompt and greedy continuation fed as one chunk, as chunks of 7, or token by token give
 * the same logits: a chunk that starts at pos0 > 0 attends to what earlier chunks stored. */
static void test_chunked_prefill(void)
{
    drv d;
    if (!drv_open(&d, sh_test_path(MODEL), 1, 64, 1, 256))
        return;
    const golden *g = &gp[0];
    int32_t ids[2 * MAX_IDS], n = 0, V = d.m->hp.n_vocab;
    for (int i = 0; i < g->n_prompt; i++)
        ids[n++] = g->prompt[i];
    for (int i = 0; i + 1 < g->n_gen && n < 40; i++)
        ids[n++] = g->gen[i];
    static float whole[64 * 128];
    const float *lg = drv_feed(&d, ids, n, 0, true);
    if (!lg)
        goto out;
    memcpy(whole, lg, sizeof(float) * (size_t)n * V);
    double worst = 0.0;
    for (int32_t p = 0; p < n;) {
        int32_t k = p + 7 <= n && p < 28 ? 7 : 1;
        lg = drv_feed(&d, ids + p, k, p, true);
        if (!lg)
            goto out;
        for (int32_t i = 0; i < k * V; i++)
            worst = fmax(worst, fabs(lg[i] - whole[(size_t)p * V + i]));
        p += k;
    }
    CHECK_NEAR(worst, 0.0, 1e-4);
out:
    drv_close(&d);
}

static const sh_test_case tests[] = {
    {"hparams", test_hparams},
    {"logits", test_logits},
    {"greedy", test_greedy},
    {"kv_f16", test_kv_f16},
    {"chunked_prefill", test_chunked_prefill},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!parse_golden(GOLDEN)) {
        fprintf(stderr, "cannot parse %s.txt\n", GOLDEN);
        return 1;
    }
    return sh_test_main(argc, argv, tests);
}
