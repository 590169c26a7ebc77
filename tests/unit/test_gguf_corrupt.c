/* GGUF reader on malformed input: crafted absurd values, truncation at every offset, seeded byte
 * flips. Every failure must come back as an error naming the field; nothing may crash or leak. */
#include "model/gguf.h"
#include "sh_test.h"
#include "test_gguf_util.h"

/* Opens buf and checks the outcome: a failure with a message (containing `want` when given), or
 * a success whose walk stays inside the buffer. Returns whether it opened. */
static bool try_open(const uint8_t *buf, size_t n, const char *want, const char *label)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    sh_err err = sh_gguf_open_mem(buf, n, &g, &e);
    if (err) {
        if (g)
            SH_FAIL_("%s: handle set on failure", label);
        if (!e.msg[0] || e.code != err)
            SH_FAIL_("%s: failure without a message", label);
        if (want && !strstr(e.msg, want))
            SH_FAIL_("%s: message \"%s\" lacks \"%s\"", label, e.msg, want);
        return false;
    }
    if (want)
        SH_FAIL_("%s: opened, expected an error with \"%s\"", label, want);
    int bad = gw_file(g, buf, n);
    if (bad)
        SH_FAIL_("%s: %d inconsistencies after a successful open", label, bad);
    sh_gguf_close(g);
    return true;
}

/* Header and one tensor info with the given fields, then alignment and `data` bytes of data. */
static void one_tensor(gb *b, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off,
                       size_t data)
{
    gb_header(b, 3, 1, 0);
    gb_tensor(b, "w", n_dims, ne, type, off);
    gb_align(b, 32);
    gb_fill(b, data, 9);
}

static const uint64_t NE4[4] = {4, 1, 1, 1};

static void c_bad_magic(gb *b) { gb_u32(b, 0x12345678), gb_u32(b, 3), gb_u64(b, 0), gb_u64(b, 0); }
static void c_tiny(gb *b) { gb_bytes(b, "GGU", 3); }
static void c_version1(gb *b) { gb_header(b, 1, 0, 0); }
static void c_version4(gb *b) { gb_header(b, 4, 0, 0); }
static void c_big_endian(gb *b) { gb_header(b, 0x03000000u, 0, 0); }
static void c_no_counts(gb *b) { gb_u32(b, 0x46554747u), gb_u32(b, 3), gb_u32(b, 0); }
static void c_n_tensors(gb *b) { gb_header(b, 3, 1ull << 63, 0), gb_fill(b, 64, 0); }
static void c_n_kv(gb *b) { gb_header(b, 3, 0, 1ull << 40), gb_fill(b, 64, 0); }
static void c_key_len(gb *b) { gb_header(b, 3, 0, 1), gb_u64(b, 1ull << 62), gb_fill(b, 8, 0); }
static void c_str_len(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 8), gb_u64(b, 1ull << 62), gb_fill(b, 8, 0);
}
static void c_arr_count(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 9), gb_u32(b, 4), gb_u64(b, 1ull << 60);
    gb_fill(b, 64, 0);
}
static void c_arr_str_count(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 9), gb_u32(b, 8), gb_u64(b, 1ull << 60);
    gb_fill(b, 64, 0);
}
static void c_arr_arr_count(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 9), gb_u32(b, 9), gb_u64(b, 1ull << 60);
    gb_fill(b, 64, 0);
}
static void c_nested(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "deep", 9);
    for (int i = 0; i < 100; i++)
        gb_u32(b, 9), gb_u64(b, 1);
    gb_u32(b, 0), gb_u64(b, 0);
}
static void c_type13(gb *b) { gb_header(b, 3, 0, 1), gb_key(b, "k", 13), gb_u64(b, 0); }
static void c_elem13(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 9), gb_u32(b, 13), gb_u64(b, 1), gb_u64(b, 0);
}
static void c_bool2(gb *b) { gb_header(b, 3, 0, 1), gb_key(b, "flag", 7), gb_u8(b, 2); }
static void c_truncated_value(gb *b) { gb_header(b, 3, 0, 1), gb_key(b, "k", 4), gb_u16(b, 1); }
static void c_align0(gb *b) { gb_header(b, 3, 0, 1), gb_kv_u32(b, "general.alignment", 0); }
static void c_align3(gb *b) { gb_header(b, 3, 0, 1), gb_kv_u32(b, "general.alignment", 3); }
static void c_align_type(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "general.alignment", 10), gb_u64(b, 32);
}
static void c_dup_key(gb *b)
{
    gb_header(b, 3, 0, 3), gb_kv_u32(b, "a", 1), gb_kv_u32(b, "b", 2), gb_kv_str(b, "a", "x");
}
static void c_n_dims5(gb *b)
{
    static const uint64_t ne[5] = {4, 1, 1, 1, 1};
    one_tensor(b, 5, ne, 0, 0, 32);
}
static void c_n_dims0(gb *b) { one_tensor(b, 0, NE4, 0, 0, 32); }
static void c_dim0(gb *b)
{
    static const uint64_t ne[2] = {4, 0};
    one_tensor(b, 2, ne, 0, 0, 32);
}
static void c_dims_overflow(gb *b)
{
    static const uint64_t ne[3] = {1ull << 32, 1ull << 32, 2};
    one_tensor(b, 3, ne, 0, 0, 32);
}
static void c_bytes_overflow(gb *b)
{
    static const uint64_t ne[1] = {1ull << 62};
    one_tensor(b, 1, ne, 0, 0, 32);
}
static void c_type99(gb *b) { one_tensor(b, 1, NE4, 99, 0, 32); }
static void c_type_retired(gb *b) { one_tensor(b, 1, NE4, 4, 0, 32); }
static void c_block(gb *b)
{
    static const uint64_t ne[1] = {33};
    one_tensor(b, 1, ne, 8, 0, 64);
}
/* The K-quants' 256-element super-blocks and the Q5 blocks: a row that is not whole blocks, and
 * data one byte short of what the type and shape need (a Q6_K 256 x 2 is 420 bytes, a Q5_0 of 64
 * elements 44). */
static void c_block_k(gb *b)
{
    static const uint64_t ne[2] = {576, 2};
    one_tensor(b, 2, ne, SH_DTYPE_Q4_K, 0, 64);
}
static void c_short_q6_k(gb *b)
{
    static const uint64_t ne[2] = {256, 2};
    one_tensor(b, 2, ne, SH_DTYPE_Q6_K, 0, 419);
}
static void c_short_q5_0(gb *b)
{
    static const uint64_t ne[1] = {64};
    one_tensor(b, 1, ne, SH_DTYPE_Q5_0, 0, 43);
}
/* IQ4_XS's 256-element super-blocks and IQ4_NL's 32-element blocks (an IQ4_NL 256 x 2 is 288
 * bytes). */
static void c_block_iq4_xs(gb *b)
{
    static const uint64_t ne[2] = {320, 2};
    one_tensor(b, 2, ne, SH_DTYPE_IQ4_XS, 0, 64);
}
static void c_short_iq4_nl(gb *b)
{
    static const uint64_t ne[2] = {256, 2};
    one_tensor(b, 2, ne, SH_DTYPE_IQ4_NL, 0, 287);
}
static void c_misaligned(gb *b) { one_tensor(b, 1, NE4, 0, 4, 64); }
static void c_past_end(gb *b) { one_tensor(b, 1, NE4, 0, 1024, 64); }
static void c_end_past(gb *b) { one_tensor(b, 1, NE4, 0, 32, 40); }
static void c_offset_overflow(gb *b)
{
    static const uint64_t ne16[1] = {16};
    one_tensor(b, 1, ne16, 0, UINT64_MAX - 31, 64);
}
static void c_no_data(gb *b)
{
    gb_header(b, 3, 1, 0), gb_tensor(b, "w", 1, NE4, 0, 0);
    gb_u8(b, 0); /* the data section would start past the end */
}
static void c_dup_tensor(gb *b)
{
    gb_header(b, 3, 2, 0);
    gb_tensor(b, "x", 1, NE4, 0, 0);
    gb_tensor(b, "x", 1, NE4, 0, 32);
    gb_align(b, 32);
    gb_fill(b, 64, 0);
}
static void c_overlap(gb *b)
{
    static const uint64_t ne16[1] = {16};
    gb_header(b, 3, 2, 0);
    gb_tensor(b, "big", 1, ne16, 0, 0);
    gb_tensor(b, "small", 1, NE4, 0, 32);
    gb_align(b, 32);
    gb_fill(b, 96, 0);
}
static void c_same_offset(gb *b)
{
    gb_header(b, 3, 2, 0);
    gb_tensor(b, "p", 1, NE4, 0, 64);
    gb_tensor(b, "q", 1, NE4, 0, 64);
    gb_align(b, 32);
    gb_fill(b, 96, 0);
}
/* Counts the remaining bytes could hold, but the elements are not there: fails on the first
 * missing element (without allocating for the count first). */
static void c_backed_count(gb *b)
{
    gb_header(b, 3, 0, 1), gb_key(b, "k", 9), gb_u32(b, 8), gb_u64(b, 100000);
    for (int i = 0; i < 100000; i++)
        gb_u64(b, UINT64_MAX);
}
static void c_backed_kv(gb *b)
{
    gb_header(b, 3, 0, 60000), gb_kv_u32(b, "a", 1), gb_key(b, "b", 77);
    gb_fill(b, 13 * 60000, 0);
}
/* A tensor name holding control bytes must come back escaped in the message. */
static void c_ugly_name(gb *b)
{
    gb_header(b, 3, 1, 0);
    gb_u64(b, 3), gb_bytes(b, "a\n'", 3), gb_u32(b, 6), gb_fill(b, 32, 0);
}

static const struct crafted {
    const char *name;
    void (*build)(gb *b);
    sh_err code;
    const char *want;
} crafted[] = {
    {"bad magic", c_bad_magic, SH_EFORMAT, "bad magic 0x12345678 (not a GGUF file)"},
    {"tiny", c_tiny, SH_EFORMAT, "too short"},
    {"version 1", c_version1, SH_EUNSUPPORTED, "version 1 is not supported"},
    {"version 4", c_version4, SH_EUNSUPPORTED, "version 4 is not supported"},
    {"big-endian", c_big_endian, SH_EUNSUPPORTED, "big-endian"},
    {"no counts", c_no_counts, SH_EFORMAT, "truncated: n_tensors"},
    {"n_tensors 2^63", c_n_tensors, SH_EFORMAT, "n_tensors 9223372036854775808"},
    {"n_kv 2^40", c_n_kv, SH_EFORMAT, "n_kv 1099511627776"},
    {"key length 2^62", c_key_len, SH_EFORMAT, "kv 0: key length 4611686018427387904"},
    {"string length 2^62", c_str_len, SH_EFORMAT, "kv 0 'k': string length 4611686018427387904"},
    {"array count 2^60", c_arr_count, SH_EFORMAT, "kv 0 'k': array count 1152921504606846976"},
    {"string array count", c_arr_str_count, SH_EFORMAT,
     "array count 1152921504606846976 of string"},
    {"array array count", c_arr_arr_count, SH_EFORMAT, "array count 1152921504606846976 of array"},
    {"nested 100 deep", c_nested, SH_EFORMAT, "kv 0 'deep': arrays nested deeper than 16"},
    {"value type 13", c_type13, SH_EFORMAT, "kv 0 'k': unknown value type 13"},
    {"element type 13", c_elem13, SH_EFORMAT, "unknown array element type 13"},
    {"bool 2", c_bool2, SH_EFORMAT, "kv 0 'flag': bool value 2"},
    {"truncated value", c_truncated_value, SH_EFORMAT, "kv 0 'k': truncated: uint32"},
    {"alignment 0", c_align0, SH_EFORMAT, "general.alignment 0 is not"},
    {"alignment 3", c_align3, SH_EFORMAT, "general.alignment 3 is not"},
    {"alignment type", c_align_type, SH_EFORMAT, "general.alignment has type uint64"},
    {"duplicate key", c_dup_key, SH_EFORMAT, "kv 2: duplicate key 'a' (also kv 0)"},
    {"n_dims 5", c_n_dims5, SH_EFORMAT, "tensor 0 'w': n_dims 5"},
    {"n_dims 0", c_n_dims0, SH_EFORMAT, "tensor 0 'w': n_dims 0"},
    {"dim 0", c_dim0, SH_EFORMAT, "tensor 0 'w': ne[1] is 0"},
    {"dims overflow", c_dims_overflow, SH_EFORMAT, "'w': element count overflows"},
    {"bytes overflow", c_bytes_overflow, SH_EFORMAT, "'w': byte size overflows"},
    {"tensor type 99", c_type99, SH_EUNSUPPORTED, "tensor 0 'w': unknown tensor type 99"},
    {"retired type 4", c_type_retired, SH_EUNSUPPORTED, "unknown tensor type 4"},
    {"block multiple", c_block, SH_EFORMAT, "ne[0] 33 is not a multiple of the Q8_0 block size 32"},
    {"Q4_K block multiple", c_block_k, SH_EFORMAT,
     "ne[0] 576 is not a multiple of the Q4_K block size 256"},
    {"Q6_K short", c_short_q6_k, SH_EFORMAT, "'w': data [0, 420) beyond the data section (419"},
    {"Q5_0 short", c_short_q5_0, SH_EFORMAT, "'w': data [0, 44) beyond the data section (43"},
    {"IQ4_XS block multiple", c_block_iq4_xs, SH_EFORMAT,
     "ne[0] 320 is not a multiple of the IQ4_XS block size 256"},
    {"IQ4_NL short", c_short_iq4_nl, SH_EFORMAT, "'w': data [0, 288) beyond the data section (287"},
    {"misaligned", c_misaligned, SH_EFORMAT, "'w': offset 4 is not a multiple of the alignment 32"},
    {"offset past end", c_past_end, SH_EFORMAT, "'w': data [1024, 1040) beyond the data section"},
    {"end past end", c_end_past, SH_EFORMAT, "data [32, 48) beyond the data section (40 bytes)"},
    {"offset overflow", c_offset_overflow, SH_EFORMAT,
     "'w': offset 18446744073709551584 + 64 bytes overflows"},
    {"no data section", c_no_data, SH_EFORMAT, "data section"},
    {"duplicate tensor", c_dup_tensor, SH_EFORMAT, "tensor 1 'x': duplicate name (also tensor 0)"},
    {"overlap", c_overlap, SH_EFORMAT, "tensor 1 'small': data [32, 48) overlaps tensor 0 'big'"},
    {"same offset", c_same_offset, SH_EFORMAT, "overlaps tensor"},
    {"backed count", c_backed_count, SH_EFORMAT,
     "kv 0 'k': array string length 18446744073709551615"},
    {"backed n_kv", c_backed_kv, SH_EFORMAT, "kv 1 'b': unknown value type 77"},
    {"ugly name", c_ugly_name, SH_EFORMAT, "tensor 0 'a\\x0a\\x27': n_dims 6"},
};

static void test_crafted(void)
{
    for (size_t i = 0; i < sizeof crafted / sizeof crafted[0]; i++) {
        gb b = {0};
        crafted[i].build(&b);
        sh_gguf *g = NULL;
        sh_error e = {0};
        sh_err err = sh_gguf_open_mem(b.p, b.n, &g, &e);
        if (err != crafted[i].code)
            SH_FAIL_("%s: got %s (%s), expected %s", crafted[i].name, sh_strerror(err), e.msg,
                     sh_strerror(crafted[i].code));
        else if (!strstr(e.msg, crafted[i].want))
            SH_FAIL_("%s: message \"%s\" lacks \"%s\"", crafted[i].name, e.msg, crafted[i].want);
        else if (strchr(e.msg, '\n'))
            SH_FAIL_("%s: message has a newline", crafted[i].name);
        CHECK(g == NULL);
        sh_gguf_close(g);
        gb_free(&b);
    }
}

/* Offset of the first occurrence of a byte string in buf, or SIZE_MAX. */
static size_t find_bytes(const uint8_t *buf, size_t n, const char *s)
{
    size_t k = strlen(s);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(buf + i, s, k) == 0)
            return i;
    return SIZE_MAX;
}

/* Edits to one tensor info of a real file: the message names the tensor and the field. */
static void test_real_edits(void)
{
    size_t n;
    uint8_t *buf = gw_read_file(sh_test_path("tests/data/stories260K/stories260K.gguf"), &n);
    CHECK(buf != NULL);
    if (!buf)
        return;
    size_t at = find_bytes(buf, n, "blk.0.attn_q.weight");
    CHECK(at != SIZE_MAX);
    if (at == SIZE_MAX) {
        free(buf);
        return;
    }
    /* After the 19-byte name: n_dims (4 bytes), ne[0] and ne[1] (8 each), type (4), offset (8). */
    enum { NDIMS = 19, NE0 = 23, TYPE = 39, OFF = 43 };
    uint8_t save[40];
    memcpy(save, buf + at + NDIMS, sizeof save);
    static const struct {
        size_t field;
        uint64_t value;
        int width;
        const char *want;
    } edits[] = {
        {TYPE, 99, 4, "tensor 3 'blk.0.attn_q.weight': unknown tensor type 99"},
        {OFF, 3, 8, "tensor 3 'blk.0.attn_q.weight': offset 3 is not a multiple"},
        {OFF, 1171200, 8, "tensor 3 'blk.0.attn_q.weight': data [1171200, 1187584) beyond"},
        {OFF, 0, 8, "overlaps tensor 0 'token_embd.weight'"},
        {NDIMS, 7, 4, "tensor 3 'blk.0.attn_q.weight': n_dims 7"},
        {NE0, 0, 8, "tensor 3 'blk.0.attn_q.weight': ne[0] is 0"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        memcpy(buf + at + edits[i].field, &edits[i].value, (size_t)edits[i].width);
        char label[64];
        snprintf(label, sizeof label, "edit %zu", i);
        try_open(buf, n, edits[i].want, label);
        memcpy(buf + at + NDIMS, save, sizeof save);
    }
    CHECK(try_open(buf, n, NULL, "restored"));
    free(buf);
}

/* Truncates buf at every offset below `dense`, then at a stride; every cut below the end of the
 * last needed byte must fail. */
static void truncations(const uint8_t *buf, size_t n, size_t dense, size_t stride,
                        const char *label)
{
    char lab[96];
    for (size_t len = 0; len < n; len = len < dense ? len + 1 : len + stride) {
        /* A fresh allocation of exactly len bytes lets ASan catch any read past the cut. */
        uint8_t *cut = malloc(len ? len : 1);
        memcpy(cut, buf, len);
        snprintf(lab, sizeof lab, "%s cut at %zu", label, len);
        if (try_open(cut, len, NULL, lab))
            SH_FAIL_("%s: opened", lab);
        free(cut);
    }
}

static void test_truncate_small(void)
{
    gb b = {0};
    gb_small_model(&b);
    CHECK(try_open(b.p, b.n, NULL, "small model"));
    truncations(b.p, b.n, b.n, 1, "small model");
    gb_free(&b);
}

static void test_truncate_real(void)
{
    static const struct {
        const char *rel;
        size_t dense, stride;
    } files[] = {
        {"tests/data/stories260K/stories260K.gguf", 4096, 997},
        {"tests/data/tiny-random/llama-2-tiny-random.gguf", 1024, 9973},
        {"tests/data/vocab/ggml-vocab-phi-3.gguf", 512, 7919},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        size_t n;
        uint8_t *buf = gw_read_file(sh_test_path(files[i].rel), &n);
        CHECK(buf != NULL);
        if (buf)
            truncations(buf, n, files[i].dense, files[i].stride, files[i].rel);
        free(buf);
    }
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Flips 1 to 4 random bytes within the first `span` bytes, `iters` times, restoring after each. */
static int flips(uint8_t *buf, size_t n, size_t span, int iters, uint64_t seed, const char *label)
{
    int opened = 0;
    char lab[96];
    for (int it = 0; it < iters; it++) {
        size_t pos[4];
        uint8_t old[4];
        int k = 1 + (int)(rng_next(&seed) % 4);
        for (int j = 0; j < k; j++) {
            pos[j] = (size_t)(rng_next(&seed) % span);
            old[j] = buf[pos[j]];
            uint64_t r = rng_next(&seed);
            /* Mostly random bytes, sometimes 0x00 or 0xff, which hit length fields harder. */
            buf[pos[j]] = (r & 3) == 0 ? 0 : (r & 3) == 1 ? 0xff : (uint8_t)(r >> 8);
        }
        snprintf(lab, sizeof lab, "%s flip %d", label, it);
        opened += try_open(buf, n, NULL, lab);
        for (int j = k - 1; j >= 0; j--)
            buf[pos[j]] = old[j];
    }
    return opened;
}

static void test_flips(void)
{
    gb b = {0};
    gb_small_model(&b);
    int ok = flips(b.p, b.n, b.n, 20000, 0x9e3779b97f4a7c15ull, "small model");
    fprintf(stderr, "  small model: %d of 20000 flipped files opened\n", ok);
    gb_free(&b);
    size_t n;
    uint8_t *buf = gw_read_file(sh_test_path("tests/data/stories260K/stories260K.gguf"), &n);
    CHECK(buf != NULL);
    if (buf) {
        /* The header, metadata and tensor infos end at byte 14152. */
        ok = flips(buf, n, 14176, 3000, 12345, "stories260K");
        fprintf(stderr, "  stories260K: %d of 3000 flipped files opened\n", ok);
        CHECK(try_open(buf, n, NULL, "stories260K restored"));
    }
    free(buf);
}

static const sh_test_case tests[] = {
    {"crafted", test_crafted},
    {"real_edits", test_real_edits},
    {"truncate_small", test_truncate_small},
    {"truncate_real", test_truncate_real},
    {"flips", test_flips},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
