/* GGUF reader on well-formed input: the real test files, every value type, getters, lookups. */
#include "model/gguf.h"
#include "sh_test.h"
#include "test_gguf_util.h"

static sh_gguf *open_ok(const char *rel)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    sh_err err = sh_gguf_open(sh_test_path(rel), NULL, &g, &e);
    if (err)
        SH_FAIL_("open %s: %s: %s", rel, sh_strerror(err), e.msg);
    return g;
}

static void test_stories260k(void)
{
    sh_gguf *g = open_ok("tests/data/stories260K/stories260K.gguf");
    if (!g)
        return;
    CHECK_UINT_EQ(sh_gguf_version(g), 3);
    CHECK_UINT_EQ(sh_gguf_alignment(g), 32);
    CHECK_UINT_EQ(sh_gguf_file_size(g), 1185376);
    CHECK_UINT_EQ(sh_gguf_n_kv(g), 19);
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 48);
    CHECK_UINT_EQ(sh_gguf_data_offset(g), 14176);
    uint32_t u;
    CHECK_OK(sh_gguf_get_u32(g, "llama.block_count", &u));
    CHECK_UINT_EQ(u, 5);
    CHECK_OK(sh_gguf_get_u32(g, "llama.embedding_length", &u));
    CHECK_UINT_EQ(u, 64);
    CHECK_OK(sh_gguf_get_u32(g, "llama.attention.head_count_kv", &u));
    CHECK_UINT_EQ(u, 4);
    float eps = 0;
    CHECK_OK(sh_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &eps));
    CHECK_NEAR(eps, 1e-5, 1e-9);
    sh_str s = {0};
    CHECK_OK(sh_gguf_get_str(g, "general.architecture", &s));
    CHECK(sh_str_eq(s, "llama"));
    const sh_gguf_value *tok = NULL;
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &tok));
    if (tok) {
        CHECK_UINT_EQ(tok->v.arr.n, 512);
        CHECK(sh_str_eq(tok->v.arr.strs[1], "<s>"));
        CHECK(sh_str_eq(tok->v.arr.strs[2], "</s>"));
    }
    const sh_gguf_value *tt = NULL;
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.token_type", SH_GGUF_INT32, &tt));
    if (tt)
        CHECK_INT_EQ(sh_gguf_arr_i64(tt, 0), 2);
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "token_embd.weight");
    CHECK(t != NULL);
    if (t) {
        CHECK_UINT_EQ(t->n_dims, 2);
        CHECK_UINT_EQ(t->ne[0], 64);
        CHECK_UINT_EQ(t->ne[1], 512);
        CHECK_UINT_EQ(t->type, SH_DTYPE_F32);
        CHECK_UINT_EQ(t->nbytes, 64 * 512 * 4);
    }
    t = sh_gguf_find_tensor(g, "blk.0.ffn_down.weight");
    CHECK(t && t->ne[0] == 172 && t->ne[1] == 64 && t->ne[2] == 1 && t->offset == 355840);
    t = sh_gguf_find_tensor(g, "blk.4.ffn_norm.weight");
    CHECK(t && t->n_dims == 1 && t->ne[0] == 64);
    CHECK(sh_gguf_find_tensor(g, "blk.5.ffn_norm.weight") == NULL);
    CHECK(sh_gguf_find_tensor(g, "token_embd") == NULL);
    CHECK(sh_gguf_find(g, "llama.block_coun") == NULL);
    sh_gguf_close(g);
}

static void test_tiny_random(void)
{
    sh_gguf *g = open_ok("tests/data/tiny-random/llama-2-tiny-random.gguf");
    if (!g)
        return;
    int n_f16 = 0;
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++)
        n_f16 += sh_gguf_tensor_at(g, i)->type == SH_DTYPE_F16;
    CHECK_INT_EQ(n_f16, 9);
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "output.weight");
    CHECK(t && t->type == SH_DTYPE_F16 && t->ne[0] == 8 && t->ne[1] == 32000 &&
          t->nbytes == 512000);
    const sh_gguf_value *tok = NULL;
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &tok));
    CHECK(tok && tok->v.arr.n == 32000);
    sh_str s;
    CHECK_OK(sh_gguf_get_str(g, "general.name", &s));
    CHECK(sh_str_eq(s, "LLaMA v2"));
    sh_gguf_close(g);
}

static void test_vocab_files(void)
{
    static const char *const names[] = {"deepseek-coder", "deepseek-llm", "falcon",
                                        "gpt-2",          "llama-spm",    "mpt",
                                        "phi-3",          "refact",       "starcoder"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/data/vocab/ggml-vocab-%s.gguf", names[i]);
        sh_gguf *g = open_ok(rel);
        if (!g)
            continue;
        const sh_gguf_value *tok = NULL;
        CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &tok));
        CHECK(tok && tok->v.arr.n > 1000);
        CHECK_UINT_EQ(sh_gguf_n_tensors(g), 0);
        sh_str model;
        CHECK_OK(sh_gguf_get_str(g, "tokenizer.ggml.model", &model));
        CHECK(sh_str_eq(model, "llama") || sh_str_eq(model, "gpt2"));
        sh_gguf_close(g);
    }
    sh_gguf *g = open_ok("tests/data/vocab/ggml-vocab-gpt-2.gguf");
    if (g) {
        const sh_gguf_value *m = NULL;
        CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.merges", SH_GGUF_STRING, &m));
        CHECK(m && m->v.arr.n == 50000 && sh_str_eq(m->v.arr.strs[0], "\xc4\xa0 t"));
        uint32_t bos;
        CHECK_OK(sh_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos));
        CHECK_UINT_EQ(bos, 50256);
        sh_gguf_close(g);
    }
}

/* Every walk of a real file must keep each pointer inside the mapping. */
static void test_walk_real(void)
{
    static const char *const rels[] = {"tests/data/stories260K/stories260K.gguf",
                                       "tests/data/tiny-random/llama-2-tiny-random.gguf",
                                       "tests/data/vocab/ggml-vocab-phi-3.gguf"};
    for (size_t i = 0; i < 3; i++) {
        size_t size;
        uint8_t *buf = gw_read_file(sh_test_path(rels[i]), &size);
        CHECK(buf != NULL);
        sh_gguf *g = NULL;
        sh_error e = {0};
        CHECK_OK(sh_gguf_open_mem(buf, size, &g, &e));
        if (g)
            CHECK_INT_EQ(gw_file(g, buf, size), 0);
        sh_gguf_close(g);
        free(buf);
    }
}

/* A file with one key of every scalar type, strings, arrays of every type, empty arrays and
 * arrays nested three deep; everything must read back exactly. */
static void build_all_types(gb *b)
{
    gb_header(b, 2, 0, 20);
    gb_key(b, "u8", 0), gb_u8(b, 250);
    gb_key(b, "i8", 1), gb_u8(b, (uint8_t)-7);
    gb_key(b, "u16", 2), gb_u16(b, 65000);
    gb_key(b, "i16", 3), gb_u16(b, (uint16_t)-30000);
    gb_key(b, "u32", 4), gb_u32(b, 4000000000u);
    gb_key(b, "i32", 5), gb_u32(b, (uint32_t)-2000000000);
    gb_key(b, "f32", 6), gb_f32(b, 0.15625f);
    gb_key(b, "bool", 7), gb_u8(b, 1);
    gb_key(b, "str", 8), gb_bytes(b, "\x05\0\0\0\0\0\0\0a\0b\xffz", 13);
    gb_key(b, "u64", 10), gb_u64(b, UINT64_MAX - 1);
    gb_key(b, "i64", 11), gb_u64(b, (uint64_t)INT64_MIN);
    gb_key(b, "f64", 12), gb_f64(b, -1.0 / 3.0);
    gb_key(b, "arr.i16", 9), gb_u32(b, 3), gb_u64(b, 3);
    gb_u16(b, 1), gb_u16(b, (uint16_t)-2), gb_u16(b, 32767);
    gb_key(b, "arr.f64", 9), gb_u32(b, 12), gb_u64(b, 2), gb_f64(b, 2.5), gb_f64(b, -1e300);
    gb_key(b, "arr.bool", 9), gb_u32(b, 7), gb_u64(b, 3), gb_u8(b, 1), gb_u8(b, 0), gb_u8(b, 1);
    gb_key(b, "arr.u64", 9), gb_u32(b, 10), gb_u64(b, 1), gb_u64(b, UINT64_MAX);
    gb_key(b, "arr.str", 9), gb_u32(b, 8), gb_u64(b, 2), gb_str(b, ""), gb_str(b, "xy");
    gb_key(b, "arr.empty", 9), gb_u32(b, 4), gb_u64(b, 0);
    /* [[[1, 2]], [], [["s"]]] as array of arrays of arrays */
    gb_key(b, "arr.nested", 9), gb_u32(b, 9), gb_u64(b, 3);
    gb_u32(b, 9), gb_u64(b, 1), gb_u32(b, 0), gb_u64(b, 2), gb_u8(b, 1), gb_u8(b, 2);
    gb_u32(b, 9), gb_u64(b, 0);
    gb_u32(b, 9), gb_u64(b, 1), gb_u32(b, 8), gb_u64(b, 1), gb_str(b, "s");
    gb_key(b, "general.alignment", 4), gb_u32(b, 64);
}

static void test_all_types(void)
{
    gb b = {0};
    build_all_types(&b);
    sh_gguf *g = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open_mem(b.p, b.n, &g, &e));
    if (!g) {
        fprintf(stderr, "  %s\n", e.msg);
        gb_free(&b);
        return;
    }
    CHECK_UINT_EQ(sh_gguf_version(g), 2);
    CHECK_UINT_EQ(sh_gguf_alignment(g), 64);
    CHECK_UINT_EQ(sh_gguf_n_kv(g), 20);
    CHECK_UINT_EQ(sh_gguf_find(g, "u8")->v.u, 250);
    CHECK_INT_EQ(sh_gguf_find(g, "i8")->v.i, -7);
    CHECK_UINT_EQ(sh_gguf_find(g, "u16")->v.u, 65000);
    CHECK_INT_EQ(sh_gguf_find(g, "i16")->v.i, -30000);
    CHECK_UINT_EQ(sh_gguf_find(g, "u32")->v.u, 4000000000u);
    CHECK_INT_EQ(sh_gguf_find(g, "i32")->v.i, -2000000000);
    CHECK(sh_gguf_find(g, "f32")->v.f == 0.15625);
    CHECK(sh_gguf_find(g, "bool")->v.b == true);
    CHECK(sh_gguf_find(g, "u64")->v.u == UINT64_MAX - 1);
    CHECK(sh_gguf_find(g, "i64")->v.i == INT64_MIN);
    CHECK(sh_gguf_find(g, "f64")->v.f == -1.0 / 3.0);
    const sh_gguf_value *v = sh_gguf_find(g, "str");
    CHECK(v->type == SH_GGUF_STRING && v->v.s.len == 5 && memcmp(v->v.s.ptr, "a\0b\xffz", 5) == 0);
    v = sh_gguf_find(g, "arr.i16");
    CHECK(v->v.arr.type == SH_GGUF_INT16 && v->v.arr.n == 3 && v->v.arr.strs == NULL);
    CHECK_INT_EQ(sh_gguf_arr_i64(v, 1), -2);
    CHECK_INT_EQ(sh_gguf_arr_i64(v, 2), 32767);
    CHECK(sh_gguf_arr_f64(v, 1) == -2.0);
    v = sh_gguf_find(g, "arr.f64");
    CHECK(sh_gguf_arr_f64(v, 0) == 2.5 && sh_gguf_arr_f64(v, 1) == -1e300);
    v = sh_gguf_find(g, "arr.bool");
    CHECK(sh_gguf_arr_u64(v, 0) == 1 && sh_gguf_arr_u64(v, 1) == 0 && sh_gguf_arr_u64(v, 2) == 1);
    CHECK(sh_gguf_arr_u64(sh_gguf_find(g, "arr.u64"), 0) == UINT64_MAX);
    v = sh_gguf_find(g, "arr.str");
    CHECK(v->v.arr.n == 2 && v->v.arr.strs[0].len == 0 && sh_str_eq(v->v.arr.strs[1], "xy"));
    CHECK_UINT_EQ(sh_gguf_find(g, "arr.empty")->v.arr.n, 0);
    v = sh_gguf_find(g, "arr.nested");
    CHECK(v->v.arr.type == SH_GGUF_ARRAY && v->v.arr.n == 3);
    if (v->v.arr.n == 3) {
        const sh_gguf_value *a0 = &v->v.arr.vals[0], *a2 = &v->v.arr.vals[2];
        CHECK(a0->v.arr.type == SH_GGUF_ARRAY && a0->v.arr.n == 1);
        CHECK(a0->v.arr.vals[0].v.arr.type == SH_GGUF_UINT8 && a0->v.arr.vals[0].v.arr.n == 2);
        CHECK_UINT_EQ(sh_gguf_arr_u64(&a0->v.arr.vals[0], 1), 2);
        CHECK_UINT_EQ(v->v.arr.vals[1].v.arr.n, 0);
        CHECK(sh_str_eq(a2->v.arr.vals[0].v.arr.strs[0], "s"));
    }
    CHECK_INT_EQ(gw_file(g, b.p, b.n), 0);
    /* No tensors: the data section is empty and may begin past the end. */
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 0);
    CHECK(sh_gguf_data_offset(g) <= b.n);
    sh_gguf_close(g);
    gb_free(&b);
}

static void test_getters(void)
{
    gb b = {0};
    build_all_types(&b);
    sh_gguf *g = NULL;
    CHECK_OK(sh_gguf_open_mem(b.p, b.n, &g, NULL));
    if (!g) {
        gb_free(&b);
        return;
    }
    uint32_t u32 = 123;
    int32_t i32 = 0;
    uint64_t u64 = 0;
    float f = 0;
    bool bl = false;
    sh_str s;
    const sh_gguf_value *arr;
    CHECK_INT_EQ(sh_gguf_get_u32(g, "missing", &u32), SH_ENOTFOUND);
    CHECK_INT_EQ(sh_gguf_get_u32(g, "i8", &u32), SH_ERANGE);
    CHECK_UINT_EQ(u32, 123); /* untouched on failure */
    CHECK_INT_EQ(sh_gguf_get_u32(g, "u64", &u32), SH_ERANGE);
    CHECK_INT_EQ(sh_gguf_get_u32(g, "str", &u32), SH_EFORMAT);
    CHECK_INT_EQ(sh_gguf_get_u32(g, "f32", &u32), SH_EFORMAT);
    CHECK_OK(sh_gguf_get_u32(g, "u8", &u32));
    CHECK_UINT_EQ(u32, 250);
    CHECK_OK(sh_gguf_get_u32(g, "bool", &u32));
    CHECK_UINT_EQ(u32, 1);
    CHECK_OK(sh_gguf_get_i32(g, "i32", &i32));
    CHECK_INT_EQ(i32, -2000000000);
    CHECK_INT_EQ(sh_gguf_get_i32(g, "u32", &i32), SH_ERANGE);
    CHECK_INT_EQ(sh_gguf_get_i32(g, "i64", &i32), SH_ERANGE);
    CHECK_OK(sh_gguf_get_u64(g, "u64", &u64));
    CHECK(u64 == UINT64_MAX - 1);
    CHECK_INT_EQ(sh_gguf_get_u64(g, "i16", &u64), SH_ERANGE);
    CHECK_OK(sh_gguf_get_f32(g, "f64", &f));
    CHECK_NEAR(f, -1.0 / 3.0, 1e-7);
    CHECK_OK(sh_gguf_get_f32(g, "i16", &f));
    CHECK(f == -30000.0f);
    CHECK_INT_EQ(sh_gguf_get_f32(g, "str", &f), SH_EFORMAT);
    CHECK_OK(sh_gguf_get_bool(g, "bool", &bl));
    CHECK(bl);
    CHECK_INT_EQ(sh_gguf_get_bool(g, "u8", &bl), SH_EFORMAT);
    CHECK_OK(sh_gguf_get_str(g, "str", &s));
    CHECK_UINT_EQ(s.len, 5);
    CHECK_INT_EQ(sh_gguf_get_str(g, "u8", &s), SH_EFORMAT);
    CHECK_OK(sh_gguf_get_arr(g, "arr.str", SH_GGUF_STRING, &arr));
    CHECK_INT_EQ(sh_gguf_get_arr(g, "arr.str", SH_GGUF_INT32, &arr), SH_EFORMAT);
    CHECK_INT_EQ(sh_gguf_get_arr(g, "u8", SH_GGUF_UINT8, &arr), SH_EFORMAT);
    CHECK_INT_EQ(sh_gguf_get_arr(g, "nope", SH_GGUF_UINT8, &arr), SH_ENOTFOUND);
    sh_gguf_close(g);
    gb_free(&b);
}

static void test_small_model(void)
{
    gb b = {0};
    gb_small_model(&b);
    sh_gguf *g = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open_mem(b.p, b.n, &g, &e));
    if (g) {
        const sh_gguf_tensor *c = sh_gguf_find_tensor(g, "c.weight");
        CHECK(c && c->type == SH_DTYPE_Q8_0 && c->nbytes == 68 && c->offset == 64);
        CHECK(c && (const uint8_t *)c->data == b.p + sh_gguf_data_offset(g) + 64);
        CHECK_UINT_EQ(sh_gguf_data_offset(g) % 32, 0);
        CHECK_INT_EQ(gw_file(g, b.p, b.n), 0);
    }
    sh_gguf_close(g);
    gb_free(&b);
}

static void test_type_names(void)
{
    CHECK_STR_EQ(sh_gguf_type_name(SH_GGUF_UINT32), "uint32");
    CHECK_STR_EQ(sh_gguf_type_name(SH_GGUF_ARRAY), "array");
    CHECK_STR_EQ(sh_gguf_type_name((sh_gguf_type)13), "?");
    CHECK_UINT_EQ(sh_gguf_type_size(SH_GGUF_FLOAT64), 8);
    CHECK_UINT_EQ(sh_gguf_type_size(SH_GGUF_BOOL), 1);
    CHECK_UINT_EQ(sh_gguf_type_size(SH_GGUF_STRING), 0);
    CHECK_UINT_EQ(sh_gguf_type_size((sh_gguf_type)99), 0);
    CHECK(sh_str_eq((sh_str){"ab", 2}, "ab"));
    CHECK(!sh_str_eq((sh_str){"ab", 2}, "abc"));
    CHECK(sh_str_eq((sh_str){NULL, 0}, ""));
}

static void test_open_errors(void)
{
    sh_gguf *g = (sh_gguf *)&g;
    sh_error e = {0};
    CHECK_INT_EQ(sh_gguf_open("/nonexistent/x.gguf", NULL, &g, &e), SH_EIO);
    CHECK(g == NULL && strstr(e.msg, "/nonexistent/x.gguf") != NULL);
    CHECK(sh_gguf_open(sh_test_path("tests/data"), NULL, &g, &e) != SH_OK);
    CHECK(g == NULL && e.msg[0]);
    CHECK_INT_EQ(sh_gguf_open_mem(NULL, 0, &g, &e), SH_EFORMAT);
    CHECK(strstr(e.msg, "too short") != NULL);
    CHECK_INT_EQ(sh_gguf_open_mem("GGUF", 4, &g, NULL), SH_EFORMAT);
    sh_gguf_open_opts o = {.populate = true};
    CHECK_OK(sh_gguf_open(sh_test_path("tests/data/stories260K/stories260K.gguf"), &o, &g, NULL));
    sh_gguf_close(g);
    sh_gguf_close(NULL);
}

static const sh_test_case tests[] = {
    {"stories260k", test_stories260k}, {"tiny_random", test_tiny_random},
    {"vocab_files", test_vocab_files}, {"walk_real", test_walk_real},
    {"all_types", test_all_types},     {"getters", test_getters},
    {"small_model", test_small_model}, {"type_names", test_type_names},
    {"open_errors", test_open_errors}, {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
