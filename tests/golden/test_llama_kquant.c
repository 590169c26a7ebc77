/* Golden test of K-quant and Q5 weights through the whole forward pass: synthetic models written
 * by mkmodel (a dim-256 shape, all matrices Q4_K, all Q6_K, and a mix of eight types assembled
 * tensor by tensor from same-seed files) against tests/reference/ref_forward.py's logits, which
 * dequantize with the gguf package and multiply in float. The models are written again at test
 * time (mkmodel's bytes do not depend on the machine); their FNV-1a hashes are checked against
 * the ones the golden data was made from. `test_llama_kquant write DIR` writes the models and
 * prints those hashes (tests/data/golden/README.md has the commands). */
#include <stdio.h>
#include <unistd.h>

#include "golden_ref.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/mkmodel.h"

#define GOLDEN_DIR "tests/data/golden/"
#define HASHES GOLDEN_DIR "kquant-models.txt"

static const char *const model_names[] = {"kquant-q4_k", "kquant-q6_k", "kquant-mix"};
#define N_MODELS 3

static void shape_opts(sh_mkmodel_opts *o, sh_dtype type)
{
    sh__mkmodel_opts_init(o);
    o->shape.n_layers = 2;
    o->shape.dim = 256;
    o->shape.ffn = 512;
    o->shape.n_heads = 4;
    o->shape.n_kv_heads = 2;
    o->shape.vocab = 512;
    o->shape.ctx = 256;
    o->type = type;
    o->seed = 8;
    o->std = 0.02f;
    o->n_threads = 2;
}

/* The mix: each tensor's type (norms stay F32). Layer 0 puts a 32-block type and a K-quant in
 * one fused Q/K/V and two K-quants in the SwiGLU; layer 1 the other types. */
static sh_dtype mix_type(const char *name)
{
    static const struct {
        const char *name;
        sh_dtype type;
    } plan[] = {
        {"token_embd.weight", SH_DTYPE_Q6_K},        {"output.weight", SH_DTYPE_Q5_K},
        {"blk.0.attn_q.weight", SH_DTYPE_Q5_0},      {"blk.0.attn_k.weight", SH_DTYPE_Q4_K},
        {"blk.0.attn_v.weight", SH_DTYPE_Q8_0},      {"blk.0.attn_output.weight", SH_DTYPE_Q3_K},
        {"blk.0.ffn_gate.weight", SH_DTYPE_Q4_K},    {"blk.0.ffn_up.weight", SH_DTYPE_Q6_K},
        {"blk.0.ffn_down.weight", SH_DTYPE_Q2_K},    {"blk.1.attn_q.weight", SH_DTYPE_Q6_K},
        {"blk.1.attn_k.weight", SH_DTYPE_Q5_1},      {"blk.1.attn_v.weight", SH_DTYPE_Q5_K},
        {"blk.1.attn_output.weight", SH_DTYPE_Q5_0}, {"blk.1.ffn_gate.weight", SH_DTYPE_Q5_1},
        {"blk.1.ffn_up.weight", SH_DTYPE_Q4_K},      {"blk.1.ffn_down.weight", SH_DTYPE_Q6_K},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        if (strcmp(plan[i].name, name) == 0)
            return plan[i].type;
    return SH_DTYPE_F32;
}

static const sh_dtype mix_sources[] = {SH_DTYPE_F32,  SH_DTYPE_Q8_0, SH_DTYPE_Q5_0,
                                       SH_DTYPE_Q5_1, SH_DTYPE_Q2_K, SH_DTYPE_Q3_K,
                                       SH_DTYPE_Q4_K, SH_DTYPE_Q5_K, SH_DTYPE_Q6_K};
#define N_SOURCES (sizeof mix_sources / sizeof mix_sources[0])

/* Writes dir/NAME.gguf for the three models; returns false (after a failed check) on error. */
static bool write_models(const char *dir)
{
    char path[512];
    sh_error e = {0};
    sh_mkmodel_opts o;
    bool ok = true;
    for (int m = 0; m < 2 && ok; m++) {
        shape_opts(&o, m == 0 ? SH_DTYPE_Q4_K : SH_DTYPE_Q6_K);
        snprintf(path, sizeof path, "%s/%s.gguf", dir, model_names[m]);
        ok = sh__mkmodel_write(path, &o, NULL, &e) == SH_OK;
        if (!ok)
            SH_FAIL_("mkmodel %s: %s", path, e.msg);
    }
    /* the mix: the same seed in every source type, each tensor from the file of its type */
    sh_gguf *src[N_SOURCES] = {NULL};
    for (size_t s = 0; s < N_SOURCES && ok; s++) {
        shape_opts(&o, mix_sources[s]);
        snprintf(path, sizeof path, "%s/src-%s.gguf", dir, sh__dtype_name(mix_sources[s]));
        ok = sh__mkmodel_write(path, &o, NULL, &e) == SH_OK &&
             sh_gguf_open(path, NULL, &src[s], &e) == SH_OK;
        unlink(path); /* the mapping stays valid */
        if (!ok)
            SH_FAIL_("source %s: %s", path, e.msg);
    }
    sh_gguf_writer *w = NULL;
    if (ok && sh__gguf_write_create(&w, &e) == SH_OK) {
        const sh_gguf *base = src[0];
        for (uint64_t i = 0; ok && i < sh_gguf_n_kv(base); i++) {
            const sh_gguf_kv *kv = sh_gguf_kv_at(base, i);
            char key[128];
            snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
            ok = sh__gguf_write_set_value(w, key, &kv->value, &e) == SH_OK;
        }
        ok =
            ok && sh__gguf_write_set_str(w, "general.name", "shoal golden kquant mix", &e) == SH_OK;
        for (uint64_t i = 0; ok && i < sh_gguf_n_tensors(base); i++) {
            char name[96];
            const sh_gguf_tensor *bt = sh_gguf_tensor_at(base, i);
            snprintf(name, sizeof name, "%.*s", (int)bt->name.len, bt->name.ptr);
            const sh_dtype want = mix_type(name);
            const sh_gguf_tensor *t = NULL;
            for (size_t s = 0; s < N_SOURCES; s++)
                if (mix_sources[s] == want)
                    t = sh_gguf_find_tensor(src[s], name);
            ok = t && sh__gguf_write_add_tensor_data(w, name, t->type, t->n_dims, t->ne, t->data,
                                                     &e) == SH_OK;
        }
        snprintf(path, sizeof path, "%s/%s.gguf", dir, model_names[2]);
        ok = ok && sh__gguf_write_file(w, path, &e) == SH_OK;
        if (!ok)
            SH_FAIL_("the mix: %s", e.msg);
    }
    sh__gguf_write_destroy(w);
    for (size_t s = 0; s < N_SOURCES; s++)
        sh_gguf_close(src[s]);
    return ok;
}

static uint64_t fnv1a_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    uint64_t h = 0xcbf29ce484222325ull;
    int c;
    if (!f)
        return 0;
    while ((c = fgetc(f)) != EOF)
        h = (h ^ (uint64_t)c) * 0x100000001b3ull;
    fclose(f);
    return h;
}

static char dir[64] = "/tmp/sh-golden-kq-XXXXXX";
static bool models_ok;

static const char *model_path(int m)
{
    static char p[N_MODELS][128];
    snprintf(p[m], sizeof p[m], "%s/%s.gguf", dir, model_names[m]);
    return p[m];
}

/* The models written now are the ones the golden data was made from. */
static void test_models(void)
{
    FILE *f = fopen(sh_test_path(HASHES), "r");
    CHECK(f != NULL);
    if (!f)
        return;
    char name[64];
    unsigned long long want;
    int seen = 0;
    while (fscanf(f, "%63s %llx", name, &want) == 2)
        for (int m = 0; m < N_MODELS; m++)
            if (strcmp(name, model_names[m]) == 0) {
                seen++;
                const uint64_t got = fnv1a_file(model_path(m));
                if (got != want)
                    SH_FAIL_("%s: fnv1a %016llx, golden data made from %016llx: mkmodel's bytes "
                             "changed, regenerate (tests/data/golden/README.md)",
                             name, (unsigned long long)got, want);
            }
    fclose(f);
    CHECK_INT_EQ(seen, N_MODELS);
}

/* Logits along prompt + reference continuation against the reference, then free greedy decoding
 * against the reference's ids. The activations are quantized to int8 (per 256 for the K-quants,
 * per 32 for Q5/Q8_0), which the float reference does not do: on these random 2-layer models
 * that moves the logits by 1-2.5% of the largest (Q8_0 weights move them as much: the weights'
 * own rounding is in both), so the check is the one test_llama_smollm applies: logits within
 * TOL of the largest reference logit, top-1 equal wherever the reference's margin between its
 * first two tokens exceeds twice that, and the greedy ids equal to the reference's up to the
 * first such near tie (after which they may differ). Measured numbers are in
 * tests/data/golden/README.md. */
#define TOL 4e-2

static void check_model(int m)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, GOLDEN_DIR "%s", model_names[m]);
    if (!parse_golden(prefix)) {
        SH_FAIL_("cannot parse %s.txt", prefix);
        return;
    }
    double scale = 0.0;
    for (int p = 0; p < n_gp; p++)
        for (int r = 0; r < gp[p].n_top; r++)
            for (int j = 0; j < TOPK; j++)
                scale = fmax(scale, fabs(gp[p].top_lg[r][j]));
    const double margin = 2.0 * TOL * scale;
    compare_logits(model_path(m), prefix, TOL, false, margin);
    drv d;
    if (!drv_open(&d, model_path(m), 2, 64, 1, 256))
        return;
    for (int p = 0; p < n_gp; p++) {
        const golden *g = &gp[p];
        int32_t gen[MAX_IDS];
        CHECK_INT_EQ(drv_greedy(&d, g->prompt, g->n_prompt, g->n_gen, gen), g->n_gen);
        int same = 0;
        while (same < g->n_gen && gen[same] == g->gen[same])
            same++;
        if (same < g->n_gen) {
            /* row n_prompt - 1 + same predicted the first differing token */
            const int r = g->n_prompt - 1 + same;
            const double gap = g->top_lg[r][0] - g->top_lg[r][1];
            if (gap > margin)
                SH_FAIL_("%s %s: greedy id %d is %d, reference %d by a margin of %.3f (> %.3f)",
                         model_names[m], g->name, same, (int)gen[same], (int)g->gen[same], gap,
                         margin);
            fprintf(stderr, "%s %s: greedy ids equal for %d/%d, then a near tie of %.3f\n",
                    model_names[m], g->name, same, g->n_gen, gap);
        } else {
            fprintf(stderr, "%s %s: greedy ids equal for %d/%d\n", model_names[m], g->name, same,
                    g->n_gen);
        }
    }
    drv_close(&d);
}

static void test_q4_k(void) { check_model(0); }
static void test_q6_k(void) { check_model(1); }
static void test_mix(void) { check_model(2); }

static const sh_test_case tests[] = {
    {"models", test_models}, {"q4_k", test_q4_k}, {"q6_k", test_q6_k},
    {"mix", test_mix},       {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "write") == 0) {
        if (!write_models(argv[2]))
            return 1;
        for (int m = 0; m < N_MODELS; m++) {
            char p[512];
            snprintf(p, sizeof p, "%s/%s.gguf", argv[2], model_names[m]);
            printf("%s %016llx\n", model_names[m], (unsigned long long)fnv1a_file(p));
        }
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "check") == 0) { /* any model against any golden prefix */
        if (!parse_golden(argv[3]))
            return 1;
        compare_logits(argv[2], argv[3], 1.0, false, 1e9);
        return 0;
    }
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    models_ok = write_models(dir);
    int rc = models_ok ? sh_test_main(argc, argv, tests) : 1;
    for (int m = 0; m < N_MODELS; m++)
        unlink(model_path(m));
    rmdir(dir);
    return rc;
}
