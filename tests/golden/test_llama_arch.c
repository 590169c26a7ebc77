/* Golden tests of the gemma3, qwen3 and phi3 paths on the tiny seeded models of tests/data/golden
 * (shoal mkmodel, F16 matrices widened exactly), against tests/reference/ref_forward.py's
 * logits: gemma3's scaled embedding, QK-norm, post-norms, GELU FFN, soft-capping and its local
 * (8-token window, RoPE base 1e4) and global (base 1e6) layers on prompts longer than the window;
 * qwen3's QK-norm (phi3's views and reference: test_llama_rope). Also: a model
 * split into pipeline stages gives the whole model's logits, two sequences batched give each
 * one's logits alone, and the KV blocks before a window stay required while a global layer reads
 * them. Usage: test_llama_arch [case]. */
#include "golden_ref.h"

#define GEMMA3 "tests/data/golden/gemma3-tiny-f16"
#define QWEN3 "tests/data/golden/qwen3-tiny-f16"
#define PHI3 "tests/data/golden/phi3-tiny-f16"

static void test_gemma3_hparams(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh_llama_load(golden_model_path(GEMMA3), NULL, &m, &e));
    if (!m)
        return;
    const sh_llama_hparams *hp = &m->hp;
    CHECK_STR_EQ(hp->arch, "gemma3");
    CHECK_INT_EQ(hp->rope_mode, SH_ROPE_MODE_NEOX);
    CHECK(hp->qk_norm && hp->post_norms && !hp->qkv_bias && !hp->tied_embeddings);
    CHECK_INT_EQ(hp->ffn_act, SH_MATMUL_ACT_GEGLU);
    CHECK_NEAR(hp->embd_scale, sqrt((double)hp->dim), 1e-5);
    CHECK_NEAR(hp->attn_scale, 1.0 / sqrt((double)hp->head_dim), 1e-7);
    CHECK_INT_EQ(hp->sliding_window, 8);
    CHECK_NEAR(hp->rope_base, 1e6, 1.0);
    CHECK_NEAR(hp->rope_base_swa, 1e4, 1e-2);
    CHECK_NEAR(hp->final_softcap, 30.0, 1e-6);
    // Layers 0 and 2 slide, layer 1 is global: no block may ever be released.
    CHECK(sh_llama_layer_slides(hp, 0) && !sh_llama_layer_slides(hp, 1) &&
          sh_llama_layer_slides(hp, 2));
    CHECK_INT_EQ(sh_llama_kv_window(hp), 0);
    const sh_llama_layer *L = &m->layers[1];
    CHECK(L->q_norm && L->k_norm && L->post_attn_norm && L->post_ffn_norm && !L->bq);
    sh_llama_destroy(m);
}

static void test_qwen3_hparams(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh_llama_load(golden_model_path(QWEN3), NULL, &m, &e));
    if (!m)
        return;
    const sh_llama_hparams *hp = &m->hp;
    CHECK_STR_EQ(hp->arch, "qwen3");
    CHECK_INT_EQ(hp->rope_mode, SH_ROPE_MODE_NEOX);
    CHECK(hp->qk_norm && !hp->post_norms && !hp->qkv_bias);
    CHECK_INT_EQ(hp->ffn_act, SH_MATMUL_ACT_SWIGLU);
    CHECK_INT_EQ(hp->head_dim, 32); /* key_length, not dim / n_heads */
    CHECK_NEAR(hp->embd_scale, 1.0, 0.0);
    CHECK_NEAR(hp->final_softcap, 0.0, 0.0);
    CHECK_INT_EQ(hp->sliding_window, 0);
    CHECK(m->layers[0].q_norm && m->layers[0].k_norm && !m->layers[0].post_attn_norm);
    sh_llama_destroy(m);
}

static void test_gemma3_reference(void) { golden_check_reference(GEMMA3); }
static void test_qwen3_reference(void) { golden_check_reference(QWEN3); }

/* Logits of all n rows of ids through the model loaded with layer ranges cut at `cuts` (stage
 * k runs [cuts[k], cuts[k + 1])), the hidden state handed from stage to stage. */
static bool staged_logits(const char *path, const int32_t *cuts, int n_stages, const int32_t *ids,
                          int32_t n, float *out)
{
    sh_backend *be = NULL;
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 2};
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    if (!be)
        return false;
    static float hidden[2 * MAX_IDS * 1024];
    int32_t blocks[16] = {3, 1, 4, 0, 5, 9, 2, 6, 8, 7, 10, 11, 12, 13, 14, 15};
    bool ok = true;
    for (int k = 0; k < n_stages && ok; k++) {
        sh_llama *m = NULL;
        sh_llama_ctx *c = NULL;
        sh_llama_load_opts lo = {.first = cuts[k], .last = cuts[k + 1]};
        sh_llama_ctx_opts co = {
            .max_tokens = 2 * MAX_IDS, .max_seqs = 1, .max_logits = 2 * MAX_IDS, .kv_tokens = 256};
        ok = sh_llama_load(path, &lo, &m, &e) == SH_OK &&
             sh_llama_ctx_create(m, be, &co, &c, &e) == SH_OK;
        if (ok) {
            sh_llama_seq s = {.tokens = ids, .n_tokens = n, .blocks = blocks};
            sh_llama_batch b = {
                .n_seqs = 1, .seqs = &s, .all_logits = true, .hidden_in = k ? hidden : NULL};
            sh_llama_out o;
            ok = sh_llama_forward(c, &b, &o, &e) == SH_OK;
            if (ok && o.hidden)
                memcpy(hidden, o.hidden, sizeof(float) * (size_t)n * m->hp.dim);
            if (ok && o.logits)
                memcpy(out, o.logits, sizeof(float) * (size_t)n * m->hp.n_vocab);
        }
        if (!ok)
            SH_FAIL_("stage [%d, %d): %s", (int)cuts[k], (int)cuts[k + 1], e.msg);
        sh_llama_ctx_destroy(c);
        sh_llama_destroy(m);
    }
    sh_backend_destroy(be);
    return ok;
}

/* The whole model and the same model in stages (each layer alone, and an uneven split) give
 * bit-identical logits: every stage applies its own layers' windows and RoPE bases, the
 * embedding scale only on the first and the soft-cap only on the last. */
static void check_stages(const char *prefix, int32_t n_layers)
{
    int32_t ids[40];
    for (int i = 0; i < 40; i++)
        ids[i] = 1 + (i * 37) % 250;
    static float whole[40 * 512], split[40 * 512];
    const int32_t all[2] = {0, n_layers};
    if (!staged_logits(golden_model_path(prefix), all, 1, ids, 40, whole))
        return;
    int32_t each[8];
    for (int32_t l = 0; l <= n_layers; l++)
        each[l] = l;
    const int32_t uneven[3] = {0, n_layers - 1, n_layers};
    const int32_t *splits[2] = {each, uneven};
    const int n_splits[2] = {n_layers, 2};
    for (int s = 0; s < 2; s++) {
        if (!staged_logits(golden_model_path(prefix), splits[s], n_splits[s], ids, 40, split))
            return;
        int bad = 0;
        for (int i = 0; i < 40 * 300; i++)
            bad += split[i] != whole[i];
        if (bad)
            SH_FAIL_("%s in %d stages: %d logits differ from the whole model's", prefix,
                     n_splits[s], bad);
    }
}

static void test_gemma3_stages(void) { check_stages(GEMMA3, 3); }
static void test_qwen3_stages(void) { check_stages(QWEN3, 2); }
static void test_phi3_stages(void) { check_stages(PHI3, 2); }

/* Two sequences of different lengths (one past the window) in one batch step, prefilled then
 * decoded together, give the logits each gives alone. */
static void test_gemma3_batched(void)
{
    drv d;
    if (!drv_open(&d, golden_model_path(GEMMA3), 2, 64, 2, 512))
        return;
    const int32_t V = d.m->hp.n_vocab, na = 21, nb = 6;
    int32_t a[21], b[6];
    for (int i = 0; i < na; i++)
        a[i] = 2 + (i * 11) % 290;
    for (int i = 0; i < nb; i++)
        b[i] = 5 + (i * 53) % 290;
    static float alone[2][2][300];
    // Alone: sequence a in blocks 0.., b in blocks 8..; prefill then one decode step each.
    int32_t ba[8] = {0, 1, 2, 3, 4, 5, 6, 7}, bb[8] = {8, 9, 10, 11, 12, 13, 14, 15};
    const int32_t *seqs_ids[2] = {a, b}, *seqs_blocks[2] = {ba, bb};
    const int32_t lens[2] = {na, nb}, next[2] = {17, 171};
    sh_error e = {0};
    sh_llama_out o;
    for (int s = 0; s < 2; s++) {
        sh_llama_seq q = {seqs_ids[s], lens[s], 0, seqs_blocks[s], true, 0};
        sh_llama_batch bt = {1, &q, false, NULL, false, false};
        CHECK_OK(sh_llama_forward(d.c, &bt, &o, &e));
        memcpy(alone[s][0], o.logits, sizeof(float) * V);
        q = (sh_llama_seq){&next[s], 1, lens[s], seqs_blocks[s], true, 0};
        CHECK_OK(sh_llama_forward(d.c, &bt, &o, &e));
        memcpy(alone[s][1], o.logits, sizeof(float) * V);
    }
    // Together (fresh positions overwrite the same blocks).
    sh_llama_seq two[2] = {{a, na, 0, ba, true, 0}, {b, nb, 0, bb, true, 0}};
    sh_llama_batch bt = {2, two, false, NULL, false, false};
    double worst = 0.0;
    for (int step = 0; step < 2; step++) {
        if (step == 1) {
            two[0] = (sh_llama_seq){&next[0], 1, na, ba, true, 0};
            two[1] = (sh_llama_seq){&next[1], 1, nb, bb, true, 0};
        }
        CHECK_OK(sh_llama_forward(d.c, &bt, &o, &e));
        CHECK_INT_EQ(o.n_logits, 2);
        for (int s = 0; s < 2 && o.logits; s++)
            for (int32_t v = 0; v < V; v++)
                worst = fmax(worst, fabs(o.logits[s * V + v] - alone[s][step][v]));
    }
    CHECK_NEAR(worst, 0.0, 1e-5);
    drv_close(&d);
}

/* With a global layer among the local ones, a block before the window is still read: a block
 * table with it released (-1, as a KV manager releasing by the local window would leave it) is
 * refused with SH_EINVAL, where a model whose every layer slides accepts it. */
static void test_gemma3_blocks_kept(void)
{
    drv d;
    if (!drv_open(&d, golden_model_path(GEMMA3), 1, 64, 1, 512))
        return;
    int32_t ids[40];
    for (int i = 0; i < 40; i++)
        ids[i] = 1 + i;
    CHECK(drv_feed(&d, ids, 40, 0, false) != NULL);
    int32_t blocks[4] = {-1, 1, 2, 3}; /* position 40's window (8) starts at 33: block 2 */
    sh_llama_seq s = {.tokens = ids, .n_tokens = 1, .pos0 = 40, .blocks = blocks};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
    sh_llama_out o;
    sh_error e = {0};
    CHECK_INT_EQ(sh_llama_forward(d.c, &b, &o, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "block 0 is -1") != NULL);
    drv_close(&d);
}

static const sh_test_case tests[] = {
    {"gemma3_hparams", test_gemma3_hparams},
    {"gemma3_reference", test_gemma3_reference},
    {"gemma3_stages", test_gemma3_stages},
    {"gemma3_batched", test_gemma3_batched},
    {"gemma3_blocks_kept", test_gemma3_blocks_kept},
    {"qwen3_hparams", test_qwen3_hparams},
    {"qwen3_reference", test_qwen3_reference},
    {"qwen3_stages", test_qwen3_stages},
    {"phi3_stages", test_phi3_stages},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
