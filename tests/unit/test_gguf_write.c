/* Unit tests of the GGUF writer: every value type and several tensor types, read back with the
 * reader and compared value by value and byte by byte. */
#include <dirent.h>
#include <stdint.h>
#include <unistd.h>

#include "base/error.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_gwXXXXXX";

static const char *tmp_path(const char *name)
{
    static char buf[256];
    snprintf(buf, sizeof buf, "%s/%s", dir, name);
    return buf;
}

/* Number of leftover temporary files in the test directory. */
static int count_tmp_files(void)
{
    int n = 0;
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    for (struct dirent *de; (de = readdir(d));)
        n += strstr(de->d_name, ".tmp.") != NULL;
    closedir(d);
    return n;
}

/* A recognisable byte for every position of every tensor. */
static uint8_t pattern(uint64_t tensor, uint64_t byte)
{
    uint64_t x = (tensor + 1) * 0x9e3779b97f4a7c15ull ^ byte * 0xbf58476d1ce4e5b9ull;
    return (uint8_t)(x >> 56 ^ x >> 29 ^ x);
}

typedef struct fill_log {
    int calls;
    uint64_t rows_seen;
    int fail_tensor; /* fail when asked for this tensor index; -1 never */
} fill_log;

static sh_err fill_pattern(void *user, const sh_gguf_write_tensor *t, uint64_t row0,
                           uint64_t n_rows, void *dst, sh_error *e)
{
    fill_log *log = user;
    if ((int)t->index == log->fail_tensor)
        return sh__error_set(e, SH_EINVAL, "fill refused");
    if (row0 != log->rows_seen % t->n_rows) /* ranges are consecutive */
        return sh__error_set(e, SH_EINVAL, "row %llu out of order", (unsigned long long)row0);
    uint8_t *p = dst;
    for (uint64_t i = 0; i < n_rows * t->row_bytes; i++)
        p[i] = pattern(t->index, row0 * t->row_bytes + i);
    log->calls++;
    log->rows_seen += n_rows;
    if (row0 + n_rows == t->n_rows)
        log->rows_seen = 0;
    return SH_OK;
}

typedef struct tdesc {
    const char *name;
    sh_dtype type;
    uint32_t n_dims;
    uint64_t ne[4];
    bool in_memory;
} tdesc;

static const tdesc tds[] = {
    {"odd.f32", SH_DTYPE_F32, 1, {7}, false},
    {"blk.0.attn_q.weight", SH_DTYPE_F16, 2, {5, 3}, true},
    {"q4_0", SH_DTYPE_Q4_0, 2, {64, 3}, false},
    {"q8_0.3d", SH_DTYPE_Q8_0, 3, {32, 2, 2}, false},
    {"bf16.4d", SH_DTYPE_BF16, 4, {2, 3, 4, 5}, true},
    {"q4_1", SH_DTYPE_Q4_1, 2, {96, 1}, false},
    {"big.f32", SH_DTYPE_F32, 2, {1024, 2100}, false}, /* over 8 MiB: several fill calls */
    {"i32", SH_DTYPE_I32, 1, {3}, false},
};
#define N_TD (sizeof tds / sizeof tds[0])

/* The value of key when it has type t; a failure otherwise. */
static const sh_gguf_value *val_of(const sh_gguf *g, const char *key, sh_gguf_type t)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v || v->type != t) {
        SH_FAIL_("%s: missing or not a %s", key, sh_gguf_type_name(t));
        return NULL;
    }
    return v;
}

static void test_round_trip(void)
{
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    CHECK_OK(sh__gguf_write_create(&w, &e));
    CHECK_OK(sh__gguf_write_set_u8(w, "t.u8", 250, &e));
    CHECK_OK(sh__gguf_write_set_i8(w, "t.i8", -120, &e));
    CHECK_OK(sh__gguf_write_set_u16(w, "t.u16", 65000, &e));
    CHECK_OK(sh__gguf_write_set_i16(w, "t.i16", -32000, &e));
    CHECK_OK(sh__gguf_write_set_u32(w, "t.u32", 4000000000u, &e));
    CHECK_OK(sh__gguf_write_set_i32(w, "t.i32", -2000000000, &e));
    CHECK_OK(sh__gguf_write_set_u64(w, "t.u64", 0xfedcba9876543210ull, &e));
    CHECK_OK(sh__gguf_write_set_i64(w, "t.i64", INT64_MIN + 5, &e));
    CHECK_OK(sh__gguf_write_set_f32(w, "t.f32", 1.5e-5f, &e));
    CHECK_OK(sh__gguf_write_set_f64(w, "t.f64", -2.718281828459045, &e));
    CHECK_OK(sh__gguf_write_set_bool(w, "t.bool", true, &e));
    CHECK_OK(sh__gguf_write_set_str(w, "t.str", "h\xc3\xa9llo", &e));
    CHECK_OK(sh__gguf_write_set_str(w, "t.empty", "", &e));
    CHECK_OK(sh__gguf_write_set_str(w, "t.replaced", "first", &e));
    CHECK_OK(sh__gguf_write_set_u32(w, "general.alignment", 64, &e));
    /* A string with a NUL inside, through a value. */
    sh_gguf_value sv = {.type = SH_GGUF_STRING, .v.s = {"a\0b", 3}};
    CHECK_OK(sh__gguf_write_set_value(w, "t.nul", &sv, &e));
    const char *strs[] = {"alpha", "", "\xc4\xa0the", "x y"};
    CHECK_OK(sh__gguf_write_set_arr_str(w, "t.strs", strs, 4, &e));
    CHECK_OK(sh__gguf_write_set_arr_str(w, "t.strs0", strs, 0, &e));
    const int32_t i32s[] = {1, -2, 3, INT32_MAX};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.i32s", SH_GGUF_INT32, i32s, 4, &e));
    const float f32s[] = {0.5f, -1e30f, 3.25f};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.f32s", SH_GGUF_FLOAT32, f32s, 3, &e));
    const uint8_t bools[] = {1, 0, 1};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.bools", SH_GGUF_BOOL, bools, 3, &e));
    const uint64_t u64s[] = {0, UINT64_MAX};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.u64s", SH_GGUF_UINT64, u64s, 2, &e));
    const double f64s[] = {1.0 / 3.0};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.f64s", SH_GGUF_FLOAT64, f64s, 1, &e));
    const int16_t i16s[] = {-7, 7};
    CHECK_OK(sh__gguf_write_set_arr(w, "t.i16s", SH_GGUF_INT16, i16s, 2, &e));
    /* Nested: [[1, -2, 3, max], [0.5, -1e30, 3.25] as f32, [["alpha", "", ...]], []]. */
    sh_gguf_value inner_s[1] = {
        {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_STRING, .n = 0, .strs = NULL}}};
    sh_str ss[2] = {{"p", 1}, {"qq", 2}};
    inner_s[0].v.arr.n = 2;
    inner_s[0].v.arr.strs = ss;
    sh_gguf_value inner[4] = {
        {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_INT32, .n = 4, .raw = i32s}},
        {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_FLOAT32, .n = 3, .raw = f32s}},
        {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_ARRAY, .n = 1, .vals = inner_s}},
        {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_UINT8, .n = 0}},
    };
    sh_gguf_value nested = {.type = SH_GGUF_ARRAY,
                            .v.arr = {.type = SH_GGUF_ARRAY, .n = 4, .vals = inner}};
    CHECK_OK(sh__gguf_write_set_value(w, "t.nested", &nested, &e));
    CHECK_OK(sh__gguf_write_set_str(w, "t.replaced", "second, longer", &e));

    /* Tensors: in-memory ones get their pattern up front, the rest through the callback. */
    fill_log log = {.fail_tensor = -1};
    uint8_t *mem[N_TD] = {0};
    for (size_t i = 0; i < N_TD; i++) {
        const tdesc *t = &tds[i];
        if (t->in_memory) {
            uint64_t n = sh__dtype_row_bytes(t->type, t->ne[0]);
            for (uint32_t d = 1; d < t->n_dims; d++)
                n *= t->ne[d];
            mem[i] = malloc(n);
            for (uint64_t b = 0; b < n; b++)
                mem[i][b] = pattern(i, b);
            CHECK_OK(
                sh__gguf_write_add_tensor_data(w, t->name, t->type, t->n_dims, t->ne, mem[i], &e));
        } else {
            CHECK_OK(sh__gguf_write_add_tensor(w, t->name, t->type, t->n_dims, t->ne, fill_pattern,
                                               &log, &e));
        }
    }
    char path[256]; /* tmp_path's buffer is reused */
    snprintf(path, sizeof path, "%s", tmp_path("rt.gguf"));
    CHECK_OK(sh__gguf_write_file(w, path, &e));
    if (e.code)
        fprintf(stderr, "%s\n", e.msg);
    CHECK(log.calls >= 7); /* the big tensor needs at least two calls */
    CHECK_INT_EQ(count_tmp_files(), 0);

    sh_gguf *g = NULL;
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    if (!g) {
        fprintf(stderr, "%s\n", e.msg);
        goto out;
    }
    CHECK_UINT_EQ(sh_gguf_version(g), 3);
    CHECK_UINT_EQ(sh_gguf_alignment(g), 64);
    CHECK_UINT_EQ(sh_gguf_file_size(g), sh__gguf_write_file_size(w));
    CHECK_UINT_EQ(sh_gguf_file_size(g) % 64, 0);
    CHECK_UINT_EQ(sh_gguf_n_kv(g), 25);
    /* Order is the order of first setting. */
    CHECK(sh_str_eq(sh_gguf_kv_at(g, 0)->key, "t.u8"));
    CHECK(sh_str_eq(sh_gguf_kv_at(g, 13)->key, "t.replaced"));
    const sh_gguf_value *v;
#define VAL(key, t) (v = val_of(g, key, t))
    if (VAL("t.u8", SH_GGUF_UINT8))
        CHECK_UINT_EQ(v->v.u, 250);
    if (VAL("t.i8", SH_GGUF_INT8))
        CHECK_INT_EQ(v->v.i, -120);
    if (VAL("t.u16", SH_GGUF_UINT16))
        CHECK_UINT_EQ(v->v.u, 65000);
    if (VAL("t.i16", SH_GGUF_INT16))
        CHECK_INT_EQ(v->v.i, -32000);
    if (VAL("t.u32", SH_GGUF_UINT32))
        CHECK_UINT_EQ(v->v.u, 4000000000u);
    if (VAL("t.i32", SH_GGUF_INT32))
        CHECK_INT_EQ(v->v.i, -2000000000);
    if (VAL("t.u64", SH_GGUF_UINT64))
        CHECK_UINT_EQ(v->v.u, 0xfedcba9876543210ull);
    if (VAL("t.i64", SH_GGUF_INT64))
        CHECK_INT_EQ(v->v.i, INT64_MIN + 5);
    if (VAL("t.f32", SH_GGUF_FLOAT32))
        CHECK(v->v.f == (double)1.5e-5f);
    if (VAL("t.f64", SH_GGUF_FLOAT64))
        CHECK(v->v.f == -2.718281828459045);
    if (VAL("t.bool", SH_GGUF_BOOL))
        CHECK(v->v.b);
    if (VAL("t.str", SH_GGUF_STRING))
        CHECK(sh_str_eq(v->v.s, "h\xc3\xa9llo"));
    if (VAL("t.empty", SH_GGUF_STRING))
        CHECK_UINT_EQ(v->v.s.len, 0);
    if (VAL("t.replaced", SH_GGUF_STRING))
        CHECK(sh_str_eq(v->v.s, "second, longer"));
    if (VAL("t.nul", SH_GGUF_STRING))
        CHECK(v->v.s.len == 3 && memcmp(v->v.s.ptr, "a\0b", 3) == 0);
    if (VAL("t.strs", SH_GGUF_ARRAY)) {
        CHECK(v->v.arr.type == SH_GGUF_STRING && v->v.arr.n == 4);
        for (int i = 0; i < 4 && v->v.arr.n == 4; i++)
            CHECK(sh_str_eq(v->v.arr.strs[i], strs[i]));
    }
    if (VAL("t.strs0", SH_GGUF_ARRAY))
        CHECK(v->v.arr.type == SH_GGUF_STRING && v->v.arr.n == 0);
    if (VAL("t.i32s", SH_GGUF_ARRAY) && v->v.arr.n == 4)
        for (int i = 0; i < 4; i++)
            CHECK_INT_EQ(sh_gguf_arr_i64(v, (uint64_t)i), i32s[i]);
    if (VAL("t.f32s", SH_GGUF_ARRAY) && v->v.arr.n == 3)
        for (int i = 0; i < 3; i++)
            CHECK(sh_gguf_arr_f64(v, (uint64_t)i) == (double)f32s[i]);
    if (VAL("t.bools", SH_GGUF_ARRAY))
        CHECK(v->v.arr.type == SH_GGUF_BOOL && v->v.arr.n == 3 &&
              memcmp(v->v.arr.raw, bools, 3) == 0);
    if (VAL("t.u64s", SH_GGUF_ARRAY) && v->v.arr.n == 2)
        CHECK_UINT_EQ(sh_gguf_arr_u64(v, 1), UINT64_MAX);
    if (VAL("t.f64s", SH_GGUF_ARRAY) && v->v.arr.n == 1)
        CHECK(sh_gguf_arr_f64(v, 0) == 1.0 / 3.0);
    if (VAL("t.i16s", SH_GGUF_ARRAY) && v->v.arr.n == 2)
        CHECK_INT_EQ(sh_gguf_arr_i64(v, 0), -7);
    if (VAL("t.nested", SH_GGUF_ARRAY)) {
        CHECK(v->v.arr.type == SH_GGUF_ARRAY && v->v.arr.n == 4);
        if (v->v.arr.n == 4 && v->v.arr.vals) {
            const sh_gguf_value *a = v->v.arr.vals;
            CHECK(a[0].v.arr.type == SH_GGUF_INT32 && a[0].v.arr.n == 4);
            CHECK_INT_EQ(sh_gguf_arr_i64(&a[0], 3), INT32_MAX);
            CHECK(a[1].v.arr.type == SH_GGUF_FLOAT32 && a[1].v.arr.n == 3);
            CHECK(sh_gguf_arr_f64(&a[1], 1) == (double)-1e30f);
            CHECK(a[2].v.arr.type == SH_GGUF_ARRAY && a[2].v.arr.n == 1);
            if (a[2].v.arr.n == 1) {
                const sh_gguf_value *s = &a[2].v.arr.vals[0];
                CHECK(s->v.arr.type == SH_GGUF_STRING && s->v.arr.n == 2);
                if (s->v.arr.n == 2)
                    CHECK(sh_str_eq(s->v.arr.strs[1], "qq"));
            }
            CHECK(a[3].v.arr.type == SH_GGUF_UINT8 && a[3].v.arr.n == 0);
        }
    }
#undef VAL

    CHECK_UINT_EQ(sh_gguf_n_tensors(g), N_TD);
    for (size_t i = 0; i < N_TD; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        if (!t)
            continue;
        CHECK(sh_str_eq(t->name, tds[i].name));
        CHECK_INT_EQ(t->type, tds[i].type);
        CHECK_UINT_EQ(t->n_dims, tds[i].n_dims);
        for (uint32_t d = 0; d < 4; d++)
            CHECK_UINT_EQ(t->ne[d], d < tds[i].n_dims ? tds[i].ne[d] : 1);
        CHECK_UINT_EQ(t->offset % 64, 0);
        CHECK_UINT_EQ((sh_gguf_data_offset(g) + t->offset) % 64, 0);
        const uint8_t *p = t->data;
        uint64_t bad = 0;
        for (uint64_t b = 0; b < t->nbytes; b++)
            bad += p[b] != pattern(i, b);
        if (bad)
            SH_FAIL_("tensor %s: %llu bytes differ", tds[i].name, (unsigned long long)bad);
    }
    sh_gguf_close(g);

    /* Writing again replaces the file with identical bytes. */
    {
        FILE *f = fopen(path, "rb");
        fseek(f, 0, SEEK_END);
        long size = ftell(f);
        fclose(f);
        const char *path2 = tmp_path("rt2.gguf");
        char p2[256];
        snprintf(p2, sizeof p2, "%s", path2);
        CHECK_OK(sh__gguf_write_file(w, p2, &e));
        char cmd[600];
        snprintf(cmd, sizeof cmd, "cmp -s %s %s", path, p2);
        CHECK_INT_EQ(system(cmd), 0);
        CHECK(size > 8 << 20);
        unlink(p2);
    }
out:
    unlink(path);
    sh__gguf_write_destroy(w);
    for (size_t i = 0; i < N_TD; i++)
        free(mem[i]);
}

static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(*n ? *n : 1);
    if (p && fread(p, 1, *n, f) != *n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    return p;
}

/* A vocabulary copied key by key from another GGUF reads back identical. */
static void test_copy_vocab(void)
{
    sh_gguf *src = NULL, *g = NULL;
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open(sh_test_path("tests/data/vocab/ggml-vocab-gpt-2.gguf"), NULL, &src, &e));
    CHECK_OK(sh__gguf_write_create(&w, &e));
    if (!src || !w)
        goto out;
    uint64_t copied = 0;
    for (uint64_t i = 0; i < sh_gguf_n_kv(src); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(src, i);
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
        CHECK_OK(sh__gguf_write_copy_kv(w, src, key, &e));
        copied++;
    }
    CHECK_INT_EQ(sh__gguf_write_copy_kv(w, src, "no.such.key", &e), SH_ENOTFOUND);
    const char *path = tmp_path("vocab.gguf");
    CHECK_OK(sh__gguf_write_file(w, path, &e));
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    if (!g)
        goto out;
    CHECK_UINT_EQ(sh_gguf_n_kv(g), copied);
    const sh_gguf_value *a = sh_gguf_find(src, "tokenizer.ggml.tokens");
    const sh_gguf_value *b = sh_gguf_find(g, "tokenizer.ggml.tokens");
    CHECK(a && b && a->v.arr.n == 50257 && b->v.arr.n == a->v.arr.n);
    if (a && b && a->v.arr.n == b->v.arr.n) {
        uint64_t bad = 0;
        for (uint64_t i = 0; i < a->v.arr.n; i++)
            bad += a->v.arr.strs[i].len != b->v.arr.strs[i].len ||
                   memcmp(a->v.arr.strs[i].ptr, b->v.arr.strs[i].ptr, a->v.arr.strs[i].len) != 0;
        CHECK_UINT_EQ(bad, 0);
    }
    /* The metadata bytes are identical: same keys and values in the same order. */
    if (sh_gguf_n_tensors(src) == 0 && sh_gguf_version(src) == 3) {
        size_t na = 0, nb = 0;
        uint8_t *fa = slurp(sh_test_path("tests/data/vocab/ggml-vocab-gpt-2.gguf"), &na);
        uint8_t *fb = slurp(path, &nb);
        CHECK(fa && fb && na > 1000);
        /* llama.cpp did not pad a file without tensors; we always pad to the alignment. */
        CHECK_UINT_EQ(nb, (na + 31) / 32 * 32);
        if (fa && fb && nb >= na) {
            CHECK(memcmp(fa, fb, na) == 0);
            for (size_t i = na; i < nb; i++)
                CHECK_UINT_EQ(fb[i], 0);
        }
        free(fa);
        free(fb);
    }
    unlink(path);
out:
    sh_gguf_close(g);
    sh_gguf_close(src);
    sh__gguf_write_destroy(w);
}

static void test_errors(void)
{
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    CHECK_OK(sh__gguf_write_create(&w, &e));
    if (!w)
        return;
    CHECK_INT_EQ(sh__gguf_write_set_u32(w, "general.alignment", 48, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_set_u32(w, "general.alignment", 0, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_set_u64(w, "general.alignment", 64, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "general.alignment") != NULL);
    CHECK_INT_EQ(sh__gguf_write_set_u32(w, "", 1, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_set_arr(w, "a", SH_GGUF_STRING, NULL, 0, &e), SH_EINVAL);
    sh_gguf_value bad = {.type = (sh_gguf_type)42};
    CHECK_INT_EQ(sh__gguf_write_set_value(w, "bad", &bad, &e), SH_EINVAL);
    sh_gguf_value notarr = {.type = SH_GGUF_UINT8};
    sh_gguf_value nest = {.type = SH_GGUF_ARRAY, .v.arr = {.type = SH_GGUF_ARRAY, .n = 1}};
    nest.v.arr.vals = &notarr;
    CHECK_INT_EQ(sh__gguf_write_set_value(w, "bad", &nest, &e), SH_EINVAL);
    /* 20 levels of nesting is past the limit. */
    sh_gguf_value chain[20];
    for (int i = 0; i < 20; i++)
        chain[i] = (sh_gguf_value){.type = SH_GGUF_ARRAY,
                                   .v.arr = {.type = i < 19 ? SH_GGUF_ARRAY : SH_GGUF_UINT8,
                                             .n = i < 19 ? 1 : 0,
                                             .vals = i < 19 ? &chain[i + 1] : NULL}};
    CHECK_INT_EQ(sh__gguf_write_set_value(w, "deep", &chain[0], &e), SH_EINVAL);
    CHECK_UINT_EQ(sh__gguf_write_file_size(w), 32); /* nothing was added by the failures */

    float data[64] = {0};
    uint64_t ne[4] = {32, 2, 1, 1};
    CHECK_OK(sh__gguf_write_add_tensor_data(w, "x", SH_DTYPE_F32, 2, ne, data, &e));
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "x", SH_DTYPE_F32, 2, ne, data, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "", SH_DTYPE_F32, 2, ne, data, &e), SH_EINVAL);
    char longname[80];
    memset(longname, 'n', 64);
    longname[64] = 0;
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, longname, SH_DTYPE_F32, 2, ne, data, &e),
                 SH_EINVAL);
    longname[63] = 0; /* 63 bytes is the longest allowed */
    CHECK_OK(sh__gguf_write_add_tensor_data(w, longname, SH_DTYPE_F32, 2, ne, data, &e));
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", SH_DTYPE_F32, 0, ne, data, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", SH_DTYPE_F32, 5, ne, data, &e), SH_EINVAL);
    uint64_t ne0[2] = {32, 0}, ne33[1] = {33};
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", SH_DTYPE_F32, 2, ne0, data, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", SH_DTYPE_Q4_0, 1, ne33, data, &e),
                 SH_EINVAL);
    CHECK(strstr(e.msg, "block") != NULL);
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", (sh_dtype)4, 1, ne, data, &e), SH_EINVAL);
    uint64_t huge[4] = {1ull << 40, 1ull << 40, 1, 1};
    CHECK_INT_EQ(sh__gguf_write_add_tensor_data(w, "y", SH_DTYPE_F32, 2, huge, data, &e),
                 SH_EINVAL);

    /* I/O errors name the path and the errno text; nothing is left behind. */
    CHECK_INT_EQ(sh__gguf_write_file(w, "/nonexistent-dir/x.gguf", &e), SH_EIO);
    CHECK(strstr(e.msg, "/nonexistent-dir/x.gguf") && strstr(e.msg, "No such file"));
    fprintf(stderr, "  (expected) %s\n", e.msg);

    /* A failing fill callback aborts the write, names the tensor and leaves no file. */
    fill_log log = {.fail_tensor = 2};
    CHECK_OK(sh__gguf_write_add_tensor(w, "z", SH_DTYPE_F32, 2, ne, fill_pattern, &log, &e));
    const char *path = tmp_path("fail.gguf");
    CHECK_INT_EQ(sh__gguf_write_file(w, path, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "tensor 'z'") && strstr(e.msg, "fill refused"));
    fprintf(stderr, "  (expected) %s\n", e.msg);
    CHECK(access(path, F_OK) != 0);
    CHECK_INT_EQ(count_tmp_files(), 0);
    sh__gguf_write_destroy(w);
    sh__gguf_write_destroy(NULL);
}

static const sh_test_case tests[] = {
    {"round_trip", test_round_trip},
    {"copy_vocab", test_copy_vocab},
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
