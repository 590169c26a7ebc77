/* Unit tests of the synthetic model writer (model/mkmodel.c), read back with the GGUF reader. */
#include <stdint.h>
#include <unistd.h>

#include "kernels/cpu/quant.h"
#include "model/gguf.h"
#include "model/mkmodel.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_mkXXXXXX";

static const char *tmp_path(const char *name)
{
    static char buf[4][256];
    static int k;
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

static void tiny_opts(sh_mkmodel_opts *o, sh_dtype type)
{
    sh__mkmodel_opts_init(o);
    o->shape.n_layers = 2;
    o->shape.dim = 64;
    o->shape.ffn = 128;
    o->shape.n_heads = 4;
    o->shape.n_kv_heads = 2;
    o->shape.vocab = 300;
    o->shape.ctx = 256;
    o->type = type;
    o->seed = 42;
}

static bool same_file(const char *a, const char *b)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

static uint32_t get_u32(const sh_gguf *g, const char *key)
{
    uint32_t v = 0;
    if (sh_gguf_get_u32(g, key, &v) != SH_OK)
        SH_FAIL_("key %s missing or not an integer", key);
    return v;
}

/* Dequantized copy of a whole tensor (caller frees). */
static float *tensor_f32(const sh_gguf_tensor *t)
{
    float *x = malloc((size_t)t->n_elems * sizeof *x);
    uint64_t rb = sh__dtype_row_bytes(t->type, t->ne[0]);
    for (uint64_t r = 0; r < t->n_elems / t->ne[0]; r++)
        if (sh__dequant_row(t->type, (const uint8_t *)t->data + r * rb, x + r * t->ne[0],
                            (int64_t)t->ne[0]))
            SH_FAIL_("cannot dequantize %s", sh__dtype_name(t->type));
    return x;
}

static void check_tensor(const sh_gguf *g, const char *name, sh_dtype type, uint64_t ne0,
                         uint64_t ne1, uint32_t n_dims)
{
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, name);
    if (!t) {
        SH_FAIL_("tensor %s missing", name);
        return;
    }
    if (t->type != type || t->n_dims != n_dims || t->ne[0] != ne0 || t->ne[1] != ne1)
        SH_FAIL_("tensor %s: %s %u dims [%llu, %llu], want %s %u dims [%llu, %llu]", name,
                 sh__dtype_name(t->type), t->n_dims, (unsigned long long)t->ne[0],
                 (unsigned long long)t->ne[1], sh__dtype_name(type), n_dims,
                 (unsigned long long)ne0, (unsigned long long)ne1);
}

static void test_tiny_all_types(void)
{
    static const sh_dtype types[] = {SH_DTYPE_F32,  SH_DTYPE_F16,  SH_DTYPE_BF16,
                                     SH_DTYPE_Q8_0, SH_DTYPE_Q4_0, SH_DTYPE_Q4_1};
    float *ref_embd = NULL; /* the F32 file's embedding, to compare the others with */
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        sh_dtype ty = types[ti];
        sh_mkmodel_opts o;
        tiny_opts(&o, ty);
        char name[64];
        snprintf(name, sizeof name, "tiny-%s.gguf", sh__dtype_name(ty));
        const char *path = tmp_path(name);
        sh_mkmodel_result res = {0};
        sh_error e = {0};
        CHECK_OK(sh__mkmodel_write(path, &o, &res, &e));
        if (e.code)
            fprintf(stderr, "%s\n", e.msg);
        /* 300 x 64 embedding and output, 2 x (2 norms, q/o 64x64, k/v 32x64, 3 x 128x64). */
        uint64_t want_params =
            2 * 300 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) + 64;
        CHECK_UINT_EQ(res.n_params, want_params);
        CHECK_INT_EQ(res.vocab, 300);
        sh_gguf *g = NULL;
        CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
        if (!g) {
            fprintf(stderr, "%s\n", e.msg);
            continue;
        }
        CHECK_UINT_EQ(sh_gguf_file_size(g), res.n_bytes);
        sh_str s;
        CHECK_OK(sh_gguf_get_str(g, "general.architecture", &s));
        CHECK(sh_str_eq(s, "llama"));
        CHECK_OK(sh_gguf_get_str(g, "general.name", &s));
        CHECK_UINT_EQ(get_u32(g, "general.file_type"), (uint32_t)sh__mkmodel_file_type(ty));
        CHECK_UINT_EQ(get_u32(g, "llama.context_length"), 256);
        CHECK_UINT_EQ(get_u32(g, "llama.embedding_length"), 64);
        CHECK_UINT_EQ(get_u32(g, "llama.block_count"), 2);
        CHECK_UINT_EQ(get_u32(g, "llama.feed_forward_length"), 128);
        CHECK_UINT_EQ(get_u32(g, "llama.attention.head_count"), 4);
        CHECK_UINT_EQ(get_u32(g, "llama.attention.head_count_kv"), 2);
        CHECK_UINT_EQ(get_u32(g, "llama.rope.dimension_count"), 16);
        CHECK_UINT_EQ(get_u32(g, "llama.vocab_size"), 300);
        float f = 0;
        CHECK_OK(sh_gguf_get_f32(g, "llama.rope.freq_base", &f));
        CHECK_NEAR(f, 10000.0, 0);
        CHECK_OK(sh_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f));
        CHECK_NEAR(f, 1e-5, 1e-12);

        CHECK_UINT_EQ(sh_gguf_n_tensors(g), 1 + 2 * 9 + 2);
        check_tensor(g, "token_embd.weight", ty, 64, 300, 2);
        check_tensor(g, "output_norm.weight", SH_DTYPE_F32, 64, 1, 1);
        check_tensor(g, "output.weight", ty, 64, 300, 2);
        for (int l = 0; l < 2; l++) {
            char n[64];
#define T(suffix, type, a, b, nd)                                                                  \
    snprintf(n, sizeof n, "blk.%d." suffix ".weight", l);                                          \
    check_tensor(g, n, type, a, b, nd)
            T("attn_norm", SH_DTYPE_F32, 64, 1, 1);
            T("attn_q", ty, 64, 64, 2);
            T("attn_k", ty, 64, 32, 2);
            T("attn_v", ty, 64, 32, 2);
            T("attn_output", ty, 64, 64, 2);
            T("ffn_norm", SH_DTYPE_F32, 64, 1, 1);
            T("ffn_gate", ty, 64, 128, 2);
            T("ffn_up", ty, 64, 128, 2);
            T("ffn_down", ty, 128, 64, 2);
#undef T
        }
        /* Weights: mean 0, deviation 0.02; norms near 1. */
        const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "token_embd.weight");
        if (t) {
            float *x = tensor_f32(t);
            double sum = 0, sq = 0;
            for (uint64_t i = 0; i < t->n_elems; i++) {
                sum += x[i];
                sq += (double)x[i] * x[i];
            }
            double mean = sum / (double)t->n_elems;
            CHECK_NEAR(mean, 0.0, 0.001);
            CHECK_NEAR(sqrt(sq / (double)t->n_elems - mean * mean), 0.02, 0.002);
            if (ty == SH_DTYPE_F32) {
                ref_embd = x;
                x = NULL;
            } else if (ref_embd) {
                /* The same values went into every type: the error is the type's rounding. */
                /* |x| < 5.8 std = 0.116: F16 loses 2^-11 of it, BF16 2^-8; Q8_0 half a step
                 * of amax / 127; Q4_0 up to a whole step of amax / 8 (the clamped extreme). */
                double tol = ty == SH_DTYPE_F16    ? 1e-4
                             : ty == SH_DTYPE_BF16 ? 1e-3
                             : ty == SH_DTYPE_Q8_0 ? 0.0012
                                                   : 0.02;
                double worst = 0;
                for (uint64_t i = 0; i < t->n_elems; i++)
                    worst = fmax(worst, fabs(x[i] - ref_embd[i]));
                if (worst > tol)
                    SH_FAIL_("%s: max difference from F32 %.3g > %.3g", sh__dtype_name(ty), worst,
                             tol);
            }
            free(x);
        }
        const sh_gguf_tensor *nt = sh_gguf_find_tensor(g, "blk.1.ffn_norm.weight");
        if (nt) {
            const float *x = nt->data;
            for (int i = 0; i < 64; i++)
                if (fabs(x[i] - 1.0) > 0.15)
                    SH_FAIL_("norm element %d = %g is not near 1", i, x[i]);
        }
        /* The generated vocabulary. */
        CHECK_OK(sh_gguf_get_str(g, "tokenizer.ggml.model", &s));
        CHECK(sh_str_eq(s, "gpt2"));
        CHECK_OK(sh_gguf_get_str(g, "tokenizer.ggml.pre", &s));
        CHECK(sh_str_eq(s, "default"));
        const sh_gguf_value *toks = NULL, *merges = NULL, *types_v = NULL;
        CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &toks));
        CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.merges", SH_GGUF_STRING, &merges));
        CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.token_type", SH_GGUF_INT32, &types_v));
        if (toks && merges && types_v && toks->v.arr.n == 300 && merges->v.arr.n == 42) {
            CHECK(sh_str_eq(toks->v.arr.strs['a'], "a"));
            CHECK(sh_str_eq(toks->v.arr.strs[' '], "\xc4\xa0"));  /* U+0120 */
            CHECK(sh_str_eq(toks->v.arr.strs[0], "\xc4\x80"));    /* U+0100 */
            CHECK(sh_str_eq(toks->v.arr.strs[0xad], "\xc5\x83")); /* soft hyphen: U+0143 */
            CHECK(sh_str_eq(toks->v.arr.strs[256], "\xc4\xa0"
                                                   "a"));
            CHECK(sh_str_eq(merges->v.arr.strs[0], "\xc4\xa0 a"));
            CHECK(sh_str_eq(toks->v.arr.strs[256 + 26], "aa"));
            CHECK(sh_str_eq(merges->v.arr.strs[41], "a p"));
            CHECK(sh_str_eq(toks->v.arr.strs[298], "<|begin_of_text|>"));
            CHECK_INT_EQ(sh_gguf_arr_i64(types_v, 298), 3);
            CHECK_INT_EQ(sh_gguf_arr_i64(types_v, 100), 1);
        } else {
            SH_FAIL_("vocabulary arrays missing or of the wrong size");
        }
        CHECK_UINT_EQ(get_u32(g, "tokenizer.ggml.bos_token_id"), 298);
        CHECK_UINT_EQ(get_u32(g, "tokenizer.ggml.eos_token_id"), 299);
        sh_gguf_close(g);
        unlink(path);
    }
    free(ref_embd);
}

/* Every generated token string is unique and every merge joins two earlier tokens into a later
 * one, at a size where several merge levels appear. */
static void test_vocab_valid(void)
{
    sh_mkmodel_opts o;
    tiny_opts(&o, SH_DTYPE_Q4_0);
    o.shape.vocab = 20000;
    o.shape.n_layers = 1;
    const char *path = tmp_path("vocab.gguf");
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(path, &o, NULL, &e));
    sh_gguf *g = NULL;
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    if (!g)
        return;
    const sh_gguf_value *toks = NULL, *merges = NULL;
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &toks));
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.merges", SH_GGUF_STRING, &merges));
    if (toks && merges && toks->v.arr.n == 20000 && merges->v.arr.n == 20000 - 258) {
        /* Token string -> id by a linear probe table. */
        size_t cap = 1 << 16;
        int64_t *slot = malloc(cap * sizeof *slot);
        for (size_t i = 0; i < cap; i++)
            slot[i] = -1;
        int dups = 0, bad = 0;
        for (uint64_t i = 0; i < 20000; i++) {
            sh_str t = toks->v.arr.strs[i];
            uint64_t h = 1469598103934665603ull;
            for (uint64_t k = 0; k < t.len; k++)
                h = (h ^ (uint8_t)t.ptr[k]) * 1099511628211ull;
            size_t p = h & (cap - 1);
            while (slot[p] >= 0) {
                sh_str u = toks->v.arr.strs[slot[p]];
                dups += u.len == t.len && memcmp(u.ptr, t.ptr, t.len) == 0;
                p = (p + 1) & (cap - 1);
            }
            slot[p] = (int64_t)i;
        }
        for (uint64_t m = 0; m < merges->v.arr.n; m++) {
            sh_str ms = merges->v.arr.strs[m], tok = toks->v.arr.strs[256 + m];
            const char *sp = memchr(ms.ptr, ' ', ms.len);
            /* "left right" must concatenate to the token it creates, with the space removed. */
            if (!sp || ms.len != tok.len + 1 ||
                memcmp(ms.ptr, tok.ptr, (size_t)(sp - ms.ptr)) != 0 ||
                memcmp(sp + 1, tok.ptr + (sp - ms.ptr), ms.len - (size_t)(sp - ms.ptr) - 1) != 0)
                bad++;
        }
        CHECK_INT_EQ(dups, 0);
        CHECK_INT_EQ(bad, 0);
        CHECK_UINT_EQ(toks->v.arr.strs[19997].len, 5); /* reached level 4: "Ġbe?" */
        free(slot);
    }
    sh_gguf_close(g);
    unlink(path);
}

static void test_deterministic(void)
{
    sh_mkmodel_opts o;
    tiny_opts(&o, SH_DTYPE_Q4_1);
    sh_error e = {0};
    const char *a = tmp_path("a.gguf"), *b = tmp_path("b.gguf"), *c = tmp_path("c.gguf");
    o.n_threads = 1;
    CHECK_OK(sh__mkmodel_write(a, &o, NULL, &e));
    o.n_threads = 3;
    CHECK_OK(sh__mkmodel_write(b, &o, NULL, &e));
    CHECK(same_file(a, b));
    o.seed = 43;
    CHECK_OK(sh__mkmodel_write(c, &o, NULL, &e));
    CHECK(!same_file(a, c));
    unlink(a);
    unlink(b);
    unlink(c);
}

static void test_tied_and_named(void)
{
    sh_mkmodel_opts o;
    tiny_opts(&o, SH_DTYPE_Q8_0);
    o.shape.tied = true;
    const char *path = tmp_path("tied.gguf");
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(path, &o, NULL, &e));
    sh_gguf *g = NULL;
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    if (g) {
        CHECK(sh_gguf_find_tensor(g, "output.weight") == NULL);
        CHECK_UINT_EQ(sh_gguf_n_tensors(g), 1 + 2 * 9 + 1);
    }
    sh_gguf_close(g);
    unlink(path);

    const sh_mkmodel_shape *s = sh__mkmodel_shape_find("smollm2-135m");
    CHECK(s && s->n_layers == 30 && s->dim == 576 && s->ffn == 1536 && s->n_heads == 9 &&
          s->n_kv_heads == 3 && s->vocab == 49152 && s->ctx == 8192 && s->tied &&
          s->rope_base == 100000.0f);
    s = sh__mkmodel_shape_find("tinyllama-1.1b");
    CHECK(s && s->n_layers == 22 && s->dim == 2048 && s->ffn == 5632 && s->n_heads == 32 &&
          s->n_kv_heads == 4 && s->vocab == 32000 && s->ctx == 2048 && !s->tied);
    s = sh__mkmodel_shape_find("llama3-8b");
    CHECK(s && s->n_layers == 32 && s->dim == 4096 && s->ffn == 14336 && s->n_kv_heads == 8 &&
          s->vocab == 128256 && s->rope_base == 500000.0f && !s->tied);
    CHECK(sh__mkmodel_shape_find("nope") == NULL);
}

static void test_vocab_from(void)
{
    const char *src_path = sh_test_path("tests/data/vocab/ggml-vocab-gpt-2.gguf");
    sh_mkmodel_opts o;
    tiny_opts(&o, SH_DTYPE_Q4_0);
    o.shape.vocab = 0;
    o.vocab_from = src_path;
    const char *path = tmp_path("gpt2.gguf");
    sh_mkmodel_result res = {0};
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(path, &o, &res, &e));
    if (e.code)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_INT_EQ(res.vocab, 50257);
    sh_gguf *g = NULL, *src = NULL;
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    CHECK_OK(sh_gguf_open(src_path, NULL, &src, &e));
    if (g && src) {
        CHECK_UINT_EQ(get_u32(g, "llama.vocab_size"), 50257);
        check_tensor(g, "token_embd.weight", SH_DTYPE_Q4_0, 64, 50257, 2);
        check_tensor(g, "output.weight", SH_DTYPE_Q4_0, 64, 50257, 2);
        /* Every tokenizer.* key of the source is present with identical content. */
        int n_tok_keys = 0;
        for (uint64_t i = 0; i < sh_gguf_n_kv(src); i++) {
            const sh_gguf_kv *kv = sh_gguf_kv_at(src, i);
            if (kv->key.len < 10 || memcmp(kv->key.ptr, "tokenizer.", 10) != 0)
                continue;
            n_tok_keys++;
            char key[128];
            snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
            const sh_gguf_value *v = sh_gguf_find(g, key);
            if (!v || v->type != kv->value.type) {
                SH_FAIL_("key %s missing or retyped", key);
                continue;
            }
            if (v->type == SH_GGUF_ARRAY && v->v.arr.type == SH_GGUF_STRING) {
                CHECK_UINT_EQ(v->v.arr.n, kv->value.v.arr.n);
                uint64_t bad = 0;
                for (uint64_t k = 0; k < v->v.arr.n && v->v.arr.n == kv->value.v.arr.n; k++) {
                    sh_str x = v->v.arr.strs[k], y = kv->value.v.arr.strs[k];
                    bad += x.len != y.len || memcmp(x.ptr, y.ptr, x.len) != 0;
                }
                CHECK_UINT_EQ(bad, 0);
            } else if (v->type == SH_GGUF_STRING) {
                CHECK(v->v.s.len == kv->value.v.s.len &&
                      memcmp(v->v.s.ptr, kv->value.v.s.ptr, v->v.s.len) == 0);
            } else if (v->type == SH_GGUF_ARRAY) {
                CHECK_UINT_EQ(v->v.arr.n, kv->value.v.arr.n);
                size_t es = sh_gguf_type_size(v->v.arr.type);
                CHECK(es && memcmp(v->v.arr.raw, kv->value.v.arr.raw, es * v->v.arr.n) == 0);
            } else {
                CHECK(v->v.u == kv->value.v.u);
            }
        }
        CHECK(n_tok_keys >= 4);
    }
    sh_gguf_close(g);
    sh_gguf_close(src);
    unlink(path);

    /* An explicit vocabulary size must match the file. */
    o.shape.vocab = 300;
    o.vocab_explicit = true;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "50257") != NULL);
    o.vocab_from = sh_test_path("tests/data/stories260K/stories260K.bin");
    CHECK(sh__mkmodel_write(path, &o, NULL, &e) != SH_OK); /* not a GGUF */
    CHECK(access(path, F_OK) != 0);
}

static void test_errors(void)
{
    sh_mkmodel_opts o;
    sh_error e = {0};
    const char *path = tmp_path("bad.gguf");
    tiny_opts(&o, SH_DTYPE_F16);
    o.shape.n_heads = 5;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "divisible") != NULL);
    tiny_opts(&o, SH_DTYPE_F16);
    o.shape.n_kv_heads = 3;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    tiny_opts(&o, SH_DTYPE_Q4_0);
    o.shape.dim = 48;
    o.shape.n_heads = 3;
    o.shape.n_kv_heads = 1;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "not a multiple of 32") != NULL);
    tiny_opts(&o, SH_DTYPE_F16);
    o.shape.dim = 48; /* fine for a plain type */
    o.shape.n_heads = 3;
    o.shape.n_kv_heads = 1;
    CHECK_OK(sh__mkmodel_write(path, &o, NULL, &e));
    tiny_opts(&o, SH_DTYPE_F16);
    o.shape.vocab = 100;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    tiny_opts(&o, SH_DTYPE_IQ3_S);
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "IQ3_S is not one of") != NULL);
    /* IQ4_XS: 256-element blocks like the K types; IQ4_NL: 32 */
    tiny_opts(&o, SH_DTYPE_IQ4_XS);
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "IQ4_XS rows are whole blocks of 256") != NULL);
    tiny_opts(&o, SH_DTYPE_IQ4_NL);
    CHECK_OK(sh__mkmodel_write(path, &o, NULL, &e));
    /* K-quant rows are whole 256-element super-blocks: the first tensor that breaks it is named */
    tiny_opts(&o, SH_DTYPE_Q4_K);
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg,
                 "tensor 'token_embd.weight': Q4_K rows are whole blocks of 256, and dim (64)") !=
          NULL);
    o.shape.dim = 256;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "tensor 'blk.0.ffn_down.weight'") != NULL);
    CHECK(strstr(e.msg, "ffn (128) is not a multiple of 256") != NULL);
    o.shape.ffn = 512;
    CHECK_OK(sh__mkmodel_write(path, &o, NULL, &e));
    tiny_opts(&o, SH_DTYPE_F16);
    o.shape.n_layers = 0;
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    tiny_opts(&o, SH_DTYPE_F16);
    CHECK_INT_EQ(sh__mkmodel_write("/nonexistent-dir/m.gguf", &o, NULL, &e), SH_EIO);
    unlink(path);
}

static const sh_test_case tests[] = {
    {"tiny_all_types", test_tiny_all_types},
    {"vocab_valid", test_vocab_valid},
    {"deterministic", test_deterministic},
    {"tied_and_named", test_tied_and_named},
    {"vocab_from", test_vocab_from},
    {"errors", test_errors},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    rmdir(dir);
    return rc;
}
