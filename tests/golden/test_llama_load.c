/* Loader error paths: variants of the tiny qwen2 model with a tensor missing, misshapen or of an
 * unsupported type, a key missing or another architecture must fail cleanly with the right code
 * and a message naming the culprit; a bad layer range is refused. */
#include <unistd.h>

#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/llama.h"
#include "sh_test.h"

#define BASE "tests/data/golden/qwen2-tiny-f16.gguf"

static char out_path[512];

/* Zero-filled rows: the loader checks shapes and types, not values. */
static sh_err fill_zero(void *user, const sh_gguf_write_tensor *t, uint64_t row0, uint64_t n_rows,
                        void *dst, sh_error *e)
{
    (void)user;
    (void)row0;
    memset(dst, 0, n_rows * t->row_bytes);
    return SH_OK;
}

/* Writes the base model to out_path, leaving out key `drop_key` and tensor `drop`, giving tensor
 * `change` the type `type` (when not F32) or swapped dimensions, and setting the architecture to
 * `arch` when given (renaming its keys). */
static bool write_variant(const char *drop_key, const char *drop, const char *change, sh_dtype type,
                          const char *arch)
{
    sh_gguf *g = NULL;
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    bool ok = false;
    if (sh_gguf_open(sh_test_path(BASE), NULL, &g, &e) || sh__gguf_write_create(&w, &e))
        goto out;
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
        if (drop_key && !strcmp(key, drop_key))
            continue;
        if (arch && !strcmp(key, "general.architecture")) {
            if (sh__gguf_write_set_str(w, key, arch, &e))
                goto out;
            continue;
        }
        char renamed[300];
        if (arch && !strncmp(key, "qwen2.", 6))
            snprintf(renamed, sizeof renamed, "%s.%s", arch, key + 6);
        else
            snprintf(renamed, sizeof renamed, "%s", key);
        if (sh__gguf_write_set_value(w, renamed, &kv->value, &e))
            goto out;
    }
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (drop && !strcmp(name, drop))
            continue;
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        sh_dtype ty = t->type;
        if (change && !strcmp(name, change)) {
            if (type != SH_DTYPE_F32) {
                ty = type;
            } else {
                ne[0] = t->ne[1];
                ne[1] = t->ne[0];
            }
        }
        if (sh__gguf_write_add_tensor(w, name, ty, t->n_dims, ne, fill_zero, NULL, &e))
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

/* Loading out_path fails with `code` and a message containing `needle`. */
static void expect_fail(sh_err code, const char *needle)
{
    sh_llama *m = (sh_llama *)1;
    sh_error e = {0};
    CHECK_INT_EQ(sh_llama_load(out_path, NULL, &m, &e), code);
    CHECK(m == NULL);
    if (!strstr(e.msg, needle))
        SH_FAIL_("message \"%s\" does not mention \"%s\"", e.msg, needle);
}

static void test_missing_tensor(void)
{
    if (write_variant(NULL, "blk.1.ffn_up.weight", NULL, SH_DTYPE_F32, NULL))
        expect_fail(SH_EFORMAT, "blk.1.ffn_up.weight");
}

static void test_missing_bias(void)
{
    // blk.0 has biases, so every layer must.
    if (write_variant(NULL, "blk.1.attn_k.bias", NULL, SH_DTYPE_F32, NULL))
        expect_fail(SH_EFORMAT, "blk.1.attn_k.bias");
}

static void test_wrong_shape(void)
{
    if (write_variant(NULL, NULL, "blk.0.ffn_down.weight", SH_DTYPE_F32, NULL))
        expect_fail(SH_EFORMAT, "blk.0.ffn_down.weight");
}

static void test_unsupported_types(void)
{
    if (write_variant(NULL, NULL, "blk.0.attn_q.weight", SH_DTYPE_Q8_1, NULL))
        expect_fail(SH_EUNSUPPORTED, "Q8_1");
    if (write_variant(NULL, NULL, "blk.1.ffn_norm.weight", SH_DTYPE_F16, NULL))
        expect_fail(SH_EUNSUPPORTED, "blk.1.ffn_norm.weight");
}

static void test_missing_key_and_arch(void)
{
    if (write_variant("qwen2.embedding_length", NULL, NULL, SH_DTYPE_F32, NULL))
        expect_fail(SH_EFORMAT, "qwen2.embedding_length");
    if (write_variant(NULL, NULL, NULL, SH_DTYPE_F32, "gpt2"))
        expect_fail(SH_EUNSUPPORTED, "gpt2");
    // The same model under the llama architecture loads, with the interleaved RoPE.
    if (write_variant(NULL, NULL, NULL, SH_DTYPE_F32, "llama")) {
        sh_llama *m = NULL;
        sh_error e = {0};
        CHECK_OK(sh_llama_load(out_path, NULL, &m, &e));
        if (m)
            CHECK_INT_EQ(m->hp.rope_mode, SH_ROPE_MODE_NORMAL);
        sh_llama_destroy(m);
    }
}

static void test_layer_range(void)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    sh_llama_load_opts o = {.first = 2, .last = 0};
    CHECK_INT_EQ(sh_llama_load(sh_test_path(BASE), &o, &m, &e), SH_EINVAL);
    o = (sh_llama_load_opts){.first = 1, .last = 1};
    CHECK_INT_EQ(sh_llama_load(sh_test_path(BASE), &o, &m, &e), SH_EINVAL);
    o = (sh_llama_load_opts){.first = 0, .last = 3};
    CHECK_INT_EQ(sh_llama_load(sh_test_path(BASE), &o, &m, &e), SH_EINVAL);
    // The last stage [1, 2) has the head (here the tied embedding) and only layer 1.
    o = (sh_llama_load_opts){.first = 1, .last = 2, .prefault = true};
    CHECK_OK(sh_llama_load(sh_test_path(BASE), &o, &m, &e));
    if (m) {
        CHECK(m->output.data != NULL && m->out_norm != NULL);
        CHECK(m->layers[0].wq.data == NULL && m->layers[1].wq.data != NULL);
        CHECK(sh_llama_weight_bytes(m) > 0);
    }
    sh_llama_destroy(m);
    // The first stage [0, 1) has the embedding but no head.
    o = (sh_llama_load_opts){.first = 0, .last = 1};
    CHECK_OK(sh_llama_load(sh_test_path(BASE), &o, &m, &e));
    if (m)
        CHECK(m->output.data == NULL && m->out_norm == NULL && m->tok_embd.data != NULL);
    sh_llama_destroy(m);
}

static const sh_test_case tests[] = {
    {"missing_tensor", test_missing_tensor},
    {"missing_bias", test_missing_bias},
    {"wrong_shape", test_wrong_shape},
    {"unsupported_types", test_unsupported_types},
    {"missing_key_and_arch", test_missing_key_and_arch},
    {"layer_range", test_layer_range},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    snprintf(out_path, sizeof out_path, "/tmp/shoal-llama-load-%d.gguf", (int)getpid());
    int rc = sh_test_main(argc, argv, tests);
    remove(out_path);
    return rc;
}
