/* Golden tests of RoPE scaling and phi3 on tiny seeded models of tests/data/golden (shoal
 * mkmodel, F16 matrices widened exactly) against tests/reference/ref_forward.py: phi3's fused
 * attn_qkv and gate/up ffn_up as row views, its NeoX rope and long rope (short factors for a
 * context within the original one, long ones past it), linear and YaRN scaling and Llama 3's
 * rope_freqs on llama models; bad rope metadata and factor tensors refused with the key or
 * tensor named (load and shoal run). Usage: test_llama_rope [case]. */
#include <sys/wait.h>
#include <unistd.h>

#include "golden_ref.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/llama_rope.h"

#define PHI3 "tests/data/golden/phi3-tiny-f16"
#define PHI3_SHORT "tests/data/golden/phi3-longrope-tiny-f16"
#define PHI3_LONG "tests/data/golden/phi3-longrope128-tiny-f16"
#define LINEAR "tests/data/golden/llama-linear-tiny-f16"
#define YARN "tests/data/golden/llama-yarn-tiny-f16"
#define LLAMA3 "tests/data/golden/llama3rope-tiny-f16"

/* phi3's fused tensors are views of one matrix each: Q, K, V rows in order, gate then up. */
static void test_phi3_hparams(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh_llama_load(golden_model_path(PHI3), NULL, &m, &e));
    if (!m)
        return;
    const sh_llama_hparams *hp = &m->hp;
    CHECK_STR_EQ(hp->arch, "phi3");
    CHECK_INT_EQ(hp->rope_mode, SH_ROPE_MODE_NEOX);
    CHECK_INT_EQ(hp->sliding_window, 0); /* the file says 2047; ignored, as llama.cpp does */
    const sh_llama_layer *L = &m->layers[1];
    size_t row = sh__dtype_row_bytes(L->wq.type, (uint64_t)hp->dim);
    int64_t qd = (int64_t)hp->n_heads * hp->head_dim, kvd = (int64_t)hp->n_kv_heads * hp->head_dim;
    CHECK_INT_EQ(L->wq.ne[1], qd);
    CHECK_INT_EQ(L->wk.ne[1], kvd);
    CHECK(L->wk.data == (const uint8_t *)L->wq.data + row * (size_t)qd);
    CHECK(L->wv.data == (const uint8_t *)L->wk.data + row * (size_t)kvd);
    CHECK_INT_EQ(L->w_gate.ne[1], hp->n_ff);
    CHECK(L->w_up.data == (const uint8_t *)L->w_gate.data + row * (size_t)hp->n_ff);
    CHECK(!m->rope_freqs && !m->rope_freqs_long);
    sh_llama_destroy(m);
}

/* Which scaling each file asks for, and Phi-3's factor choice by context size: llama.cpp's
 * rule (the context rounded up to 256 past the original context takes the long factors). */
static void test_scaling_hparams(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh_llama_load(golden_model_path(LINEAR), NULL, &m, &e));
    if (m) {
        CHECK_NEAR(m->hp.rope_scaling.freq_scale, 0.25, 0);
        CHECK_NEAR(m->hp.rope_scaling.ext_factor, 0, 0);
        CHECK(!m->rope_freqs);
        sh_llama_destroy(m);
    }
    CHECK_OK(sh_llama_load(golden_model_path(YARN), NULL, &m, &e));
    if (m) {
        const sh_rope_scaling *r = &m->hp.rope_scaling;
        CHECK_NEAR(r->freq_scale, 0.25, 0);
        CHECK_NEAR(r->ext_factor, 1, 0);
        CHECK_INT_EQ(r->n_ctx_orig, 64);
        /* mscale(4) / (1 + 0.1 ln 4): the op multiplies the latter back in */
        CHECK_NEAR(r->attn_factor, 1.0, 1e-6);
        sh_llama_destroy(m);
    }
    CHECK_OK(sh_llama_load(golden_model_path(LLAMA3), NULL, &m, &e));
    if (m) {
        CHECK(m->rope_freqs && !m->rope_freqs_long);
        CHECK_NEAR(m->hp.rope_scaling.freq_scale, 1, 0);
        CHECK_NEAR(m->rope_freqs[0], 1, 0);                   /* fast: kept */
        CHECK_NEAR(m->rope_freqs[m->hp.n_rot / 2 - 1], 8, 0); /* slow: divided by the factor */
        sh_llama_destroy(m);
    }
    CHECK_OK(sh_llama_load(golden_model_path(PHI3_SHORT), NULL, &m, &e));
    if (m) {
        CHECK(m->rope_freqs && m->rope_freqs_long && m->rope_freqs != m->rope_freqs_long);
        CHECK_INT_EQ(m->hp.rope_scaling.n_ctx_orig, 4096);
        CHECK(sh__llama_rope_for_ctx(m, 256).freq_factors == m->rope_freqs);
        CHECK(sh__llama_rope_for_ctx(m, 4096).freq_factors == m->rope_freqs);
        CHECK(sh__llama_rope_for_ctx(m, 4097).freq_factors == m->rope_freqs_long); /* 4352 */
        sh_llama_destroy(m);
    }
    CHECK_OK(sh_llama_load(golden_model_path(PHI3_LONG), NULL, &m, &e));
    if (m) {
        CHECK_INT_EQ(m->hp.rope_scaling.n_ctx_orig, 128);
        CHECK(sh__llama_rope_for_ctx(m, 100).freq_factors == m->rope_freqs_long); /* 256 > 128 */
        sh_llama_destroy(m);
    }
}

static void test_phi3_reference(void) { golden_check_reference(PHI3); }
static void test_phi3_longrope_short(void) { golden_check_reference(PHI3_SHORT); }
static void test_phi3_longrope_long(void) { golden_check_reference(PHI3_LONG); }
static void test_linear_reference(void) { golden_check_reference(LINEAR); }
static void test_yarn_reference(void) { golden_check_reference(YARN); }
static void test_llama3_reference(void) { golden_check_reference(LLAMA3); }

/* ---- bad files ----------------------------------------------------------------------------- */

static char out_path[512];

static void expect_fail(sh_err code, const char *needle)
{
    golden_expect_load_fail(out_path, code, needle);
}

/* Writes model `src` to out_path with string key `key` set to `sval`, and tensor `tname` cut to
 * its first `keep` values (keep < 0: unchanged). */
static bool write_variant(const char *src, const char *key, const char *sval, const char *tname,
                          int64_t keep)
{
    sh_gguf *g = NULL;
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    bool ok = false;
    if (sh_gguf_open(golden_model_path(src), NULL, &g, &e) || sh__gguf_write_create(&w, &e))
        goto out;
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        char k[256];
        snprintf(k, sizeof k, "%.*s", (int)kv->key.len, kv->key.ptr);
        if (sh__gguf_write_set_value(w, k, &kv->value, &e))
            goto out;
    }
    if (key && sh__gguf_write_set_str(w, key, sval, &e))
        goto out;
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (tname && !strcmp(name, tname) && keep >= 0)
            ne[0] = (uint64_t)keep;
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

static void test_bad_files(void)
{
    snprintf(out_path, sizeof out_path, "/tmp/sh_test_rope_%d.gguf", (int)getpid());
    if (write_variant(LLAMA3, NULL, NULL, "rope_freqs.weight", 5))
        expect_fail(SH_EFORMAT, "rope_freqs.weight");
    if (write_variant(PHI3_LONG, NULL, NULL, "rope_factors_long.weight", 3))
        expect_fail(SH_EFORMAT, "rope_factors_long.weight");
    if (write_variant(LINEAR, "llama.rope.scaling.type", "dynamic", NULL, -1))
        expect_fail(SH_EUNSUPPORTED, "llama.rope.scaling.type");
    if (write_variant(PHI3, "phi3.rope.scaling.type", "su", NULL, -1))
        expect_fail(SH_EUNSUPPORTED, "phi3.rope.scaling.type");
    unlink(out_path);
}

static const sh_test_case tests[] = {
    {"phi3_hparams", test_phi3_hparams},
    {"scaling_hparams", test_scaling_hparams},
    {"phi3_reference", test_phi3_reference},
    {"phi3_longrope_short", test_phi3_longrope_short},
    {"phi3_longrope_long", test_phi3_longrope_long},
    {"linear_reference", test_linear_reference},
    {"yarn_reference", test_yarn_reference},
    {"llama3_reference", test_llama3_reference},
    {"bad_files", test_bad_files},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
