/* Golden tests of the mixture-of-experts path (mixtral-style llama, qwen2moe with its shared
 * expert, qwen3moe, olmoe with its QK-norm over all of q and k) on the tiny seeded mkmodel files,
 * against ref_forward.py: logits, greedy ids and the experts every token is routed to; batched
 * steps equal to each sequence alone; the per-expert load counters; pipeline stages; files whose
 * experts disagree with their metadata refused naming the culprit. */
#include <sys/wait.h>
#include <unistd.h>

#include "golden_ref.h"
#include "model/gguf.h"
#include "model/gguf_write.h"

typedef struct moe_model {
    const char *path, *golden, *arch;
    int32_t n_expert, k, n_ff_exp, n_ff_shexp;
    bool norm;
} moe_model;

static const moe_model models[] = {
    {"tests/data/golden/mixtral-tiny-f16.gguf", "tests/data/golden/mixtral-tiny-f16", "llama", 4, 2,
     64, 0, true},
    {"tests/data/golden/qwen2moe-tiny-f16.gguf", "tests/data/golden/qwen2moe-tiny-f16", "qwen2moe",
     8, 2, 32, 96, false},
    {"tests/data/golden/qwen3moe-tiny-f16.gguf", "tests/data/golden/qwen3moe-tiny-f16", "qwen3moe",
     8, 2, 32, 0, true},
    {"tests/data/golden/olmoe-tiny-f16.gguf", "tests/data/golden/olmoe-tiny-f16", "olmoe", 8, 2, 64,
     0, false},
};
enum { OLMOE = 3 }; /* models[OLMOE] */
#define N_MODELS ((int)(sizeof models / sizeof models[0]))

static void test_hparams(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        sh_llama *m = NULL;
        sh_error e = {0};
        CHECK_OK(sh_llama_load(sh_test_path(models[i].path), NULL, &m, &e));
        if (!m)
            continue;
        CHECK_STR_EQ(m->hp.arch, models[i].arch);
        CHECK_INT_EQ(m->hp.n_expert, models[i].n_expert);
        CHECK_INT_EQ(m->hp.n_expert_used, models[i].k);
        CHECK_INT_EQ(m->hp.n_ff_exp, models[i].n_ff_exp);
        CHECK_INT_EQ(m->hp.n_ff_shexp, models[i].n_ff_shexp);
        CHECK_INT_EQ(m->hp.expert_norm, models[i].norm);
        CHECK_INT_EQ(m->hp.qk_norm_full, i == OLMOE);
        CHECK_INT_EQ(m->hp.rope_mode, i == 0 ? SH_ROPE_MODE_NORMAL : SH_ROPE_MODE_NEOX);
        for (int32_t l = 0; l < m->hp.n_layers; l++) {
            const sh_llama_layer *L = &m->layers[l];
            CHECK(L->ffn_gate_inp.data && L->gate_exps.data && L->up_exps.data &&
                  L->down_exps.data && !L->w_gate.data);
            CHECK_INT_EQ(L->gate_exps.ne[2], models[i].n_expert);
            CHECK_INT_EQ(L->gate_shexp.data != NULL, models[i].n_ff_shexp > 0);
            CHECK_INT_EQ(L->gate_inp_shexp.data != NULL, models[i].n_ff_shexp > 0);
        }
        sh_llama_destroy(m);
    }
}

/* F16 weights are widened exactly and multiplied in f32, as the reference does: the logits
 * agree to float rounding (worst seen 6e-6 of the largest logit). */
static void test_logits(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        CHECK(parse_golden(models[i].golden));
        compare_logits(sh_test_path(models[i].path), models[i].golden, 1e-5, true, 0.0);
    }
}

static void test_greedy(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        CHECK(parse_golden(models[i].golden));
        drv d;
        if (!drv_open(&d, sh_test_path(models[i].path), 1, 64, 1, 256))
            continue;
        for (int p = 0; p < n_gp; p++) {
            int32_t gen[MAX_IDS];
            CHECK_INT_EQ(drv_greedy(&d, gp[p].prompt, gp[p].n_prompt, gp[p].n_gen, gen),
                         gp[p].n_gen);
            for (int j = 0; j < gp[p].n_gen; j++)
                if (gen[j] != gp[p].gen[j]) {
                    SH_FAIL_("%s %s: greedy id %d is %d, reference %d", models[i].arch, gp[p].name,
                             j, (int)gen[j], (int)gp[p].gen[j]);
                    break;
                }
        }
        drv_close(&d);
    }
}

/* The reference's routing: for prompt p, position pos and layer l, its k chosen experts in
 * order ("experts POS LAYER ids... weights..." lines after the prompt's line). */
enum { MAX_LAYERS = 4, MAX_K = 8 };
static int32_t ref_ids[MAX_P][2 * MAX_IDS][MAX_LAYERS][MAX_K];
static int32_t ref_n_pos[MAX_P];

static bool parse_experts(const char *prefix, int32_t k, int32_t n_layers)
{
    char path[256];
    snprintf(path, sizeof path, "%s.txt", prefix);
    FILE *f = fopen(sh_test_path(path), "r");
    if (!f || k > MAX_K || n_layers > MAX_LAYERS) {
        if (f)
            fclose(f);
        return false;
    }
    memset(ref_n_pos, 0, sizeof ref_n_pos);
    int p = -1;
    char line[4096];
    bool ok = true;
    while (ok && fgets(line, sizeof line, f)) {
        if (!strncmp(line, "prompt ", 7))
            p++;
        if (strncmp(line, "experts ", 8) || p < 0 || p >= MAX_P)
            continue;
        char *s = line + 8, *end;
        long pos = strtol(s, &end, 10), l = strtol(end, &end, 10);
        if (pos < 0 || pos >= 2 * MAX_IDS || l < 0 || l >= n_layers) {
            ok = false;
            break;
        }
        for (int32_t j = 0; j < k; j++)
            ref_ids[p][pos][l][j] = (int32_t)strtol(end, &end, 10);
        if (pos + 1 > ref_n_pos[p])
            ref_n_pos[p] = (int32_t)pos + 1;
    }
    fclose(f);
    return ok && p >= 0;
}

/* Teacher forcing the reference's sequence: every position's experts in every layer are the
 * reference's, in the same order. */
static void test_routing(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        const moe_model *mm = &models[i];
        CHECK(parse_golden(mm->golden));
        drv d;
        if (!drv_open(&d, sh_test_path(mm->path), 1, 2 * MAX_IDS, 1, 256))
            continue;
        const int32_t k = d.m->hp.n_expert_used, L = d.m->hp.n_layers;
        CHECK(parse_experts(mm->golden, k, L));
        int compared = 0;
        for (int p = 0; p < n_gp; p++) {
            int32_t seq[2 * MAX_IDS], n = 0;
            for (int j = 0; j < gp[p].n_prompt; j++)
                seq[n++] = gp[p].prompt[j];
            for (int j = 0; j + 1 < gp[p].n_gen; j++)
                seq[n++] = gp[p].gen[j];
            if (!drv_feed(&d, seq, n, 0, true))
                break;
            CHECK_INT_EQ(ref_n_pos[p], n);
            for (int32_t l = 0; l < L; l++) {
                const int32_t *ids = sh_llama_ctx_expert_ids(d.c, l);
                CHECK(ids != NULL);
                for (int32_t pos = 0; ids && pos < n && pos < ref_n_pos[p]; pos++, compared++)
                    for (int32_t j = 0; j < k; j++)
                        if (ids[pos * k + j] != ref_ids[p][pos][l][j]) {
                            SH_FAIL_("%s %s position %d layer %d slot %d: expert %d, reference %d",
                                     mm->arch, gp[p].name, (int)pos, (int)l, (int)j,
                                     (int)ids[pos * k + j], (int)ref_ids[p][pos][l][j]);
                            pos = n;
                            break;
                        }
            }
        }
        fprintf(stderr, "%s: %d (position, layer) routings compared\n", mm->arch, compared);
        CHECK(compared > 0);
        drv_close(&d);
    }
}

/* Two sequences stepped together (a prefill chunk beside decodes, then decodes) against each run
 * alone: with the scalar kernels the logits and the experts chosen are bit-identical (every
 * kernel computes a row the same way whatever the batch); with the machine's best kernels the
 * dense matmuls may round a lone row differently, so there the greedy ids must agree. The
 * per-expert counters add up to k tokens per row per layer. */
static void batched_vs_alone(const moe_model *mm, int32_t isa)
{
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *c = NULL;
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 2, .isa = isa};
    sh_llama_ctx_opts co = {.max_tokens = 64, .max_seqs = 2, .max_logits = 64, .kv_tokens = 512};
    if (sh_llama_load(sh_test_path(mm->path), NULL, &m, &e) ||
        sh_backend_cpu_create(&bo, &be, &e) || sh_llama_ctx_create(m, be, &co, &c, &e)) {
        SH_FAIL_("open %s: %s", mm->path, e.msg);
        goto out;
    }
    enum { G = 8, S = 2, NP = 12 };
    const int32_t V = m->hp.n_vocab, k = m->hp.n_expert_used, NL = m->hp.n_layers;
    const int32_t prompts[S][NP] = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
                                    {200, 17, 33, 250, 9, 140, 66, 5, 99, 123, 7, 42}};
    int32_t blocks[S][16];
    for (int s = 0; s < S; s++)
        for (int j = 0; j < 16; j++)
            blocks[s][j] = s * 16 + j;
    /* alone: each sequence's prompt, then G - 1 greedy decodes; last-row logits per step */
    static float alone[S][G][1024], batch[S][G][1024];
    static int32_t ids_alone[S][G][MAX_LAYERS][NP * MAX_K], ids_batch[S][G][MAX_LAYERS][NP * MAX_K];
    int32_t tok[S][G];
    if (V > 1024 || NL > MAX_LAYERS || k > MAX_K) {
        SH_FAIL_("model too large for the test's arrays");
        goto out;
    }
    for (int s = 0; s < S; s++)
        for (int g = 0; g < G; g++) {
            const int32_t n = g ? 1 : NP, pos0 = g ? NP + g - 1 : 0;
            sh_llama_seq q = {g ? &tok[s][g - 1] : prompts[s], n, pos0, blocks[s], true, 0};
            sh_llama_batch b = {.n_seqs = 1, .seqs = &q};
            sh_llama_out out;
            if (sh_llama_forward(c, &b, &out, &e)) {
                SH_FAIL_("forward: %s", e.msg);
                goto out;
            }
            memcpy(alone[s][g], out.logits, (size_t)V * sizeof(float));
            tok[s][g] = argmax(out.logits, V);
            for (int32_t l = 0; l < NL; l++)
                memcpy(ids_alone[s][g][l], sh_llama_ctx_expert_ids(c, l) + (n - 1) * k,
                       (size_t)k * sizeof(int32_t));
        }
    /* together: step 0 prefills sequence 0 while sequence 1 prefills too; then both decode */
    uint64_t before = 0;
    for (int32_t l = 0; l < NL; l++)
        for (int32_t x = 0; x < m->hp.n_expert; x++)
            before += sh_llama_ctx_expert_tokens(c, l)[x];
    int32_t rows = 0;
    for (int g = 0; g < G; g++) {
        sh_llama_seq q[S];
        for (int s = 0; s < S; s++)
            q[s] = (sh_llama_seq){g ? &tok[s][g - 1] : prompts[s],
                                  g ? 1 : NP,
                                  g ? NP + g - 1 : 0,
                                  blocks[s],
                                  true,
                                  0};
        sh_llama_batch b = {.n_seqs = S, .seqs = q};
        sh_llama_out out;
        if (sh_llama_forward(c, &b, &out, &e)) {
            SH_FAIL_("forward: %s", e.msg);
            goto out;
        }
        rows += out.n_tok;
        int32_t row = 0;
        for (int s = 0; s < S; s++) {
            row += q[s].n_tokens;
            memcpy(batch[s][g], out.logits + (size_t)s * V, (size_t)V * sizeof(float));
            for (int32_t l = 0; l < NL; l++)
                memcpy(ids_batch[s][g][l], sh_llama_ctx_expert_ids(c, l) + (row - 1) * k,
                       (size_t)k * sizeof(int32_t));
        }
    }
    uint64_t after = 0;
    for (int32_t l = 0; l < NL; l++)
        for (int32_t x = 0; x < m->hp.n_expert; x++)
            after += sh_llama_ctx_expert_tokens(c, l)[x];
    CHECK_UINT_EQ(after - before, (uint64_t)rows * k * NL);
    const bool exact = isa == SH_BACKEND_CPU_ISA_SCALAR;
    for (int s = 0; s < S; s++)
        for (int g = 0; g < G; g++) {
            if (argmax(batch[s][g], V) != tok[s][g])
                SH_FAIL_("%s isa %d sequence %d step %d: batched greedy %d, alone %d", mm->arch,
                         (int)isa, s, g, (int)argmax(batch[s][g], V), (int)tok[s][g]);
            if (exact && memcmp(batch[s][g], alone[s][g], (size_t)V * sizeof(float)))
                SH_FAIL_("%s sequence %d step %d: batched logits differ from alone", mm->arch, s,
                         g);
            double mx = 0, err = 0;
            for (int32_t v = 0; v < V; v++) {
                mx = fabs(alone[s][g][v]) > mx ? fabs(alone[s][g][v]) : mx;
                err = fabs(batch[s][g][v] - alone[s][g][v]) > err
                          ? fabs(batch[s][g][v] - alone[s][g][v])
                          : err;
            }
            if (!(err <= 1e-5 * mx))
                SH_FAIL_("%s isa %d sequence %d step %d: batched logits %.3g from alone", mm->arch,
                         (int)isa, s, g, err / mx);
            for (int32_t l = 0; l < NL; l++)
                if (memcmp(ids_batch[s][g][l], ids_alone[s][g][l], (size_t)k * sizeof(int32_t)))
                    SH_FAIL_("%s isa %d sequence %d step %d layer %d: batched experts differ",
                             mm->arch, (int)isa, s, g, (int)l);
        }
out:
    sh_llama_ctx_destroy(c);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
}

static void test_batched(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        batched_vs_alone(&models[i], SH_BACKEND_CPU_ISA_SCALAR);
        batched_vs_alone(&models[i], SH_BACKEND_CPU_ISA_AUTO);
    }
}

/* Two pipeline stages (layers [0, 1) and [1, 2)) give the whole model's logits bit for bit, and
 * each counts the experts of its own layers. */
static void test_stages(void)
{
    for (int i = 0; i < N_MODELS; i++) {
        sh_llama *m[3] = {NULL, NULL, NULL};
        sh_backend *be = NULL;
        sh_llama_ctx *c[3] = {NULL, NULL, NULL};
        sh_error e = {0};
        sh_backend_cpu_opts bo = {.n_threads = 1};
        sh_llama_ctx_opts co = {.max_tokens = 32, .max_seqs = 1, .max_logits = 32, .kv_tokens = 64};
        const sh_llama_load_opts ranges[3] = {
            {.first = 0, .last = 0}, {.first = 0, .last = 1}, {.first = 1, .last = 2}};
        CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
        for (int s = 0; s < 3 && be; s++)
            if (sh_llama_load(sh_test_path(models[i].path), &ranges[s], &m[s], &e) ||
                sh_llama_ctx_create(m[s], be, &co, &c[s], &e))
                SH_FAIL_("stage %d: %s", s, e.msg);
        if (c[0] && c[1] && c[2]) {
            const int32_t ids[] = {5, 6, 7, 8, 9, 10, 250, 3, 11};
            const int32_t n = (int32_t)(sizeof ids / sizeof ids[0]), V = m[0]->hp.n_vocab;
            int32_t blocks[4] = {0, 1, 2, 3};
            sh_llama_seq q = {ids, n, 0, blocks, true, 0};
            sh_llama_batch b = {.n_seqs = 1, .seqs = &q, .all_logits = true};
            sh_llama_out whole, s0, s1;
            CHECK_OK(sh_llama_forward(c[0], &b, &whole, &e));
            CHECK_OK(sh_llama_forward(c[1], &b, &s0, &e));
            sh_llama_batch b1 = b;
            b1.hidden_in = s0.hidden;
            CHECK_OK(sh_llama_forward(c[2], &b1, &s1, &e));
            CHECK(s0.hidden && s1.logits && whole.logits);
            if (s1.logits && whole.logits)
                CHECK(!memcmp(s1.logits, whole.logits, (size_t)n * V * sizeof(float)));
            CHECK(sh_llama_ctx_expert_tokens(c[1], 0) && !sh_llama_ctx_expert_tokens(c[1], 1));
            CHECK(!sh_llama_ctx_expert_tokens(c[2], 0) && sh_llama_ctx_expert_tokens(c[2], 1));
            for (int32_t l = 0; l < 2; l++) {
                const uint64_t *a = sh_llama_ctx_expert_tokens(c[0], l);
                const uint64_t *p = sh_llama_ctx_expert_tokens(c[1 + l], l);
                for (int32_t x = 0; a && p && x < m[0]->hp.n_expert; x++)
                    CHECK_UINT_EQ(a[x], p[x]);
            }
        }
        for (int s = 0; s < 3; s++) {
            sh_llama_ctx_destroy(c[s]);
            sh_llama_destroy(m[s]);
        }
        sh_backend_destroy(be);
    }
}

/* ---- bad files ----------------------------------------------------------------------------- */

static char out_path[512];

static void expect_fail(sh_err code, const char *needle)
{
    golden_expect_load_fail(out_path, code, needle);
}

/* Writes models[src] to out_path with key `key` set to `val` (or dropped when val < 0) and
 * tensor `drop` left out, or when `shrink` is set, that tensor's first dimension cut to
 * `shrink` elements (its leading bytes). */
static bool write_variant_of(int src, const char *key, int32_t val, const char *drop,
                             uint64_t shrink)
{
    sh_gguf *g = NULL;
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    bool ok = false;
    if (sh_gguf_open(sh_test_path(models[src].path), NULL, &g, &e) || sh__gguf_write_create(&w, &e))
        goto out;
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        char k[256];
        snprintf(k, sizeof k, "%.*s", (int)kv->key.len, kv->key.ptr);
        if (key && !strcmp(k, key)) {
            if (val >= 0 && sh__gguf_write_set_u32(w, k, (uint32_t)val, &e))
                goto out;
        } else if (sh__gguf_write_set_value(w, k, &kv->value, &e)) {
            goto out;
        }
    }
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (drop && !strcmp(name, drop)) {
            if (!shrink)
                continue;
            ne[0] = shrink;
        }
        if (sh__gguf_write_add_tensor_data(w, name, t->type, t->n_dims, ne, t->data, &e))
            goto out;
    }
    ok = sh__gguf_write_file(w, out_path, &e) == SH_OK;
out:
    if (!ok)
        SH_FAIL_("writing a variant: %s", e.msg);
    sh__gguf_write_destroy(w);
    sh_gguf_close(g);
    return ok;
}

static bool write_variant(const char *key, int32_t val, const char *drop)
{
    return write_variant_of(0, key, val, drop, 0);
}

static void test_bad_files(void)
{
    snprintf(out_path, sizeof out_path, "/tmp/sh_test_moe_%d.gguf", (int)getpid());
    if (write_variant("llama.expert_count", 8, NULL))
        expect_fail(SH_EFORMAT, "blk.0.ffn_gate_inp.weight");
    if (write_variant("llama.expert_count", 3, NULL))
        expect_fail(SH_EFORMAT, "blk.0.ffn_gate_inp.weight");
    if (write_variant("llama.expert_count", -1, NULL))
        expect_fail(SH_EFORMAT, "llama.expert_count");
    if (write_variant("llama.expert_used_count", 5, NULL))
        expect_fail(SH_EFORMAT, "llama.expert_used_count");
    if (write_variant("llama.expert_used_count", -1, NULL))
        expect_fail(SH_EFORMAT, "llama.expert_used_count");
    if (write_variant(NULL, 0, "blk.1.ffn_down_exps.weight"))
        expect_fail(SH_EFORMAT, "blk.1.ffn_down_exps.weight");
    if (write_variant(NULL, 0, "blk.0.ffn_gate_inp.weight"))
        expect_fail(SH_EFORMAT, "blk.0.ffn_gate_inp.weight");
    /* olmoe: experts without an expert count, a count the tensors disagree with, a missing
     * QK-norm, a per-head QK-norm (llama.cpp's olmoe norms all of q and k) */
    if (write_variant_of(OLMOE, "olmoe.expert_count", -1, NULL, 0))
        expect_fail(SH_EFORMAT, "olmoe.expert_count");
    if (write_variant_of(OLMOE, "olmoe.expert_count", 6, NULL, 0))
        expect_fail(SH_EFORMAT, "blk.0.ffn_gate_inp.weight");
    if (write_variant_of(OLMOE, NULL, 0, "blk.1.attn_k_norm.weight", 0))
        expect_fail(SH_EFORMAT, "blk.1.attn_k_norm.weight");
    if (write_variant_of(OLMOE, NULL, 0, "blk.0.attn_q_norm.weight", 16))
        expect_fail(SH_EFORMAT, "blk.0.attn_q_norm.weight");
    unlink(out_path);
}

static const sh_test_case tests[] = {
    {"hparams", test_hparams},     {"logits", test_logits},
    {"greedy", test_greedy},       {"routing", test_routing},
    {"batched", test_batched},     {"stages", test_stages},
    {"bad_files", test_bad_files}, {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
