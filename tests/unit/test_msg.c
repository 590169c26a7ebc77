/* Unit tests of addresses, the msgpack writer and reader, and the frame envelope. */
#include <msgpack.h>
#include <stdio.h>
#include <string.h>

#include "runtime/mpack_read.h"
#include "runtime/mpack_write.h"
#include "runtime/msg.h"
#include "runtime/proto.h"
#include "sh_test.h"
#include "shoal/addr.h"
#include "shoal/version.h"
#include "test_msg_samples.h"

static void test_addr(void)
{
    sh_addr a = sh_addr_make(0xdeadbeefu, 0x01234567u);
    CHECK_UINT_EQ(a, 0xdeadbeef01234567ull);
    CHECK_UINT_EQ(sh_addr_node(a), 0xdeadbeefu);
    CHECK_UINT_EQ(sh_addr_actor(a), 0x01234567u);
    CHECK_UINT_EQ(sh_addr_make(0, 0), SH_ADDR_NONE);
}

/* Our writer and msgpack-c's packer agree byte for byte on every encoding boundary. */
static void test_writer_matches_msgpack_c(void)
{
    static const uint64_t us[] = {0,     1,     127,        128,         255,       256,
                                  65535, 65536, 0xffffffff, 0x100000000, UINT64_MAX};
    static const int64_t is[] = {
        -1,        -32, -33, -128, -129, -32768, -32769, INT32_MIN, (int64_t)INT32_MIN - 1,
        INT64_MIN, 5,   300};
    static const size_t lens[] = {0, 1, 31, 32, 255, 256, 65535, 65536, 70000};
    static char blob[70000];
    for (size_t i = 0; i < sizeof blob; i++)
        blob[i] = (char)('a' + i % 26);

    sh_buf b;
    sh__buf_init(&b);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    for (size_t i = 0; i < sizeof us / sizeof us[0]; i++) {
        sh__mpack_put_uint(&b, us[i]);
        msgpack_pack_uint64(&pk, us[i]);
    }
    for (size_t i = 0; i < sizeof is / sizeof is[0]; i++) {
        sh__mpack_put_int(&b, is[i]);
        msgpack_pack_int64(&pk, is[i]);
    }
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        sh__mpack_put_str(&b, blob, lens[i]);
        msgpack_pack_str(&pk, lens[i]);
        msgpack_pack_str_body(&pk, blob, lens[i]);
        sh__mpack_put_bin(&b, blob, lens[i]);
        msgpack_pack_bin(&pk, lens[i]);
        msgpack_pack_bin_body(&pk, blob, lens[i]);
        sh__mpack_put_array(&b, lens[i]);
        msgpack_pack_array(&pk, lens[i]);
        sh__mpack_put_map(&b, lens[i]);
        msgpack_pack_map(&pk, lens[i]);
    }
    sh__mpack_put_f32(&b, 1.5f);
    msgpack_pack_float(&pk, 1.5f);
    sh__mpack_put_f64(&b, -2.25);
    msgpack_pack_double(&pk, -2.25);
    sh__mpack_put_bool(&b, true);
    msgpack_pack_true(&pk);
    sh__mpack_put_bool(&b, false);
    msgpack_pack_false(&pk);
    sh__mpack_put_nil(&b);
    msgpack_pack_nil(&pk);
    CHECK(!b.failed);
    CHECK_UINT_EQ(b.len, sb.size);
    CHECK(b.len == sb.size && memcmp(b.data, sb.data, b.len) == 0);
    msgpack_sbuffer_destroy(&sb);
    sh__buf_fini(&b);
}

/* The reader reads back what the writer wrote, values and kinds. */
static void test_reader_values(void)
{
    static const int64_t is[] = {-1, -32, -33, -128, -129, -32768, -32769, INT32_MIN, INT64_MIN};
    sh_buf b;
    sh__buf_init(&b);
    sh__mpack_put_uint(&b, UINT64_MAX);
    sh__mpack_put_uint(&b, 200);
    for (size_t i = 0; i < sizeof is / sizeof is[0]; i++)
        sh__mpack_put_int(&b, is[i]);
    sh__mpack_put_str(&b, "hello", 5);
    sh__mpack_put_bin(&b, "\x01\x02\x03", 3);
    sh__mpack_put_f32(&b, 3.5f);
    sh__mpack_put_f64(&b, 1e300);
    /* A non-negative value in a signed encoding reads as UINT. */
    uint8_t *p = sh__buf_append(&b, 2);
    p[0] = 0xd0;
    p[1] = 0x05;
    sh_mpack_reader r;
    sh__mpack_reader_init(&r, b.data, b.len, 4);
    sh_mpack_item it;
    sh_error e = {0};
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_UINT && it.v.u == UINT64_MAX);
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_UINT && it.v.u == 200);
    for (size_t i = 0; i < sizeof is / sizeof is[0]; i++) {
        CHECK_OK(sh__mpack_next(&r, &it, &e));
        CHECK_INT_EQ(it.kind, SH_MPACK_INT);
        CHECK_INT_EQ(it.v.i, is[i]);
    }
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_STR && it.len == 5 && memcmp(it.ptr, "hello", 5) == 0);
    CHECK(it.ptr > b.data && it.ptr < b.data + b.len); /* a view, not a copy */
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_BIN && it.len == 3 && it.ptr[2] == 3);
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_F32 && it.v.f32 == 3.5f);
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_F64 && it.v.f64 == 1e300);
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_UINT && it.v.u == 5);
    CHECK_UINT_EQ(sh__mpack_left(&r), 0);
    CHECK_INT_EQ(sh__mpack_next(&r, &it, &e), SH_EFORMAT);
    CHECK_INT_EQ(r.fail, SH_MPACK_FAIL_TRUNCATED);
    sh__buf_fini(&b);
}

/* Declared lengths and counts are checked against the bytes left before anything uses them. */
static void test_reader_limits(void)
{
    sh_mpack_reader r;
    sh_mpack_item it;
    sh_error e = {0};
    static const uint8_t huge_array[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0x01};
    sh__mpack_reader_init(&r, huge_array, sizeof huge_array, 8);
    CHECK_INT_EQ(sh__mpack_next(&r, &it, &e), SH_EFORMAT);
    CHECK_INT_EQ(r.fail, SH_MPACK_FAIL_TRUNCATED);
    CHECK(strstr(e.msg, "array") != NULL);
    static const uint8_t huge_bin[] = {0xc6, 0x7f, 0xff, 0xff, 0xff, 0x00};
    sh__mpack_reader_init(&r, huge_bin, sizeof huge_bin, 8);
    CHECK_INT_EQ(sh__mpack_next(&r, &it, &e), SH_EFORMAT);
    static const uint8_t reserved[] = {0xc1};
    sh__mpack_reader_init(&r, reserved, 1, 8);
    CHECK_INT_EQ(sh__mpack_next(&r, &it, &e), SH_EFORMAT);
    CHECK_INT_EQ(r.fail, SH_MPACK_FAIL_INVALID);
    /* [[[[1]]]] is four deep. */
    static const uint8_t deep[] = {0x91, 0x91, 0x91, 0x91, 0x01};
    sh__mpack_reader_init(&r, deep, sizeof deep, 4);
    CHECK_OK(sh__mpack_skip(&r, 1, &e));
    sh__mpack_reader_init(&r, deep, sizeof deep, 3);
    CHECK_INT_EQ(sh__mpack_skip(&r, 1, &e), SH_EFORMAT);
    CHECK_INT_EQ(r.fail, SH_MPACK_FAIL_DEPTH);
    /* ext values are skipped (an unknown key's value may be one). */
    static const uint8_t ext[] = {0xd6, 0x05, 1, 2, 3, 4, 0xc7, 0x02, 0x07, 9, 9};
    sh__mpack_reader_init(&r, ext, sizeof ext, 4);
    CHECK_OK(sh__mpack_skip(&r, 1, &e));
    CHECK_OK(sh__mpack_next(&r, &it, &e));
    CHECK(it.kind == SH_MPACK_EXT && it.ext_type == 7 && it.len == 2);
}

static void test_buffers(void)
{
    sh_buf b;
    sh__buf_init(&b);
    test_sample s;
    test_sample_make(&s, SH_MSG_STEP, 3, 0);
    sh_error e = {0};
    CHECK_OK(sh__proto_encode(&b, &s.hdr, &s.body, &e));
    size_t n = b.len;
    uint8_t *data = b.data;
    size_t cap = b.cap;
    /* Reusing the buffer for frames that fit allocates nothing. */
    for (int i = 0; i < 100; i++) {
        sh__buf_reset(&b);
        CHECK_OK(sh__proto_encode(&b, &s.hdr, &s.body, &e));
    }
    CHECK(b.data == data && b.cap == cap && b.len == n);
    /* A fixed buffer that is too small fails with SH_ERANGE and keeps what it held. */
    uint8_t mem[64];
    sh_buf f;
    sh__buf_init_fixed(&f, mem, sizeof mem);
    sh__mpack_put_uint(&f, 7);
    CHECK_INT_EQ(sh__proto_encode(&f, &s.hdr, &s.body, &e), SH_ERANGE);
    CHECK_UINT_EQ(f.len, 1);
    CHECK(!f.failed && mem[0] == 7);
    sh__buf_fini(&f); /* does not free caller memory */
    test_sample_free(&s);
    sh__buf_fini(&b);
    sh__buf_fini(NULL);
}

/* An envelope with an empty body. */
static size_t frame_with(uint8_t *out, uint64_t magic, uint64_t version, uint64_t type)
{
    sh_buf b;
    sh__buf_init_fixed(&b, out, 256);
    sh__mpack_put_array(&b, 8);
    sh__mpack_put_uint(&b, magic);
    sh__mpack_put_uint(&b, version);
    sh__mpack_put_uint(&b, type);
    sh__mpack_put_uint(&b, 42);
    sh__mpack_put_uint(&b, sh_addr_make(1, 2));
    sh__mpack_put_uint(&b, sh_addr_make(3, 4));
    sh__mpack_put_uint(&b, 99);
    sh__mpack_put_map(&b, 0);
    return b.len;
}

static void test_envelope(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    sh_msg_hdr h = {SH_MSG_PING, 0x1122334455ull, sh_addr_make(7, 8), sh_addr_make(9, 10), 77};
    static const uint8_t body[] = {0x81, 0xa1, 'x', 0x05};
    sh_error e = {0};
    CHECK_OK(sh__msg_encode_raw(&b, &h, body, sizeof body, &e));
    CHECK(b.len > 4 && memcmp(b.data, "\x98\xcd\x53\x48", 4) == 0);
    sh_msg_env env;
    CHECK_OK(sh__msg_decode(&c, b.data, b.len, &env, &e));
    CHECK_INT_EQ(env.hdr.type, SH_MSG_PING);
    CHECK_UINT_EQ(env.hdr.session, h.session);
    CHECK_UINT_EQ(env.hdr.src, h.src);
    CHECK_UINT_EQ(env.hdr.dst, h.dst);
    CHECK_UINT_EQ(env.hdr.trace_id, 77);
    CHECK_UINT_EQ(env.body_len, sizeof body);
    CHECK(env.body == b.data + b.len - sizeof body);
    CHECK_UINT_EQ(env.n_fields, 8);
    CHECK_UINT_EQ(c.stats.frames_ok, 1);
    CHECK_UINT_EQ(c.stats.ok_by_type[SH_MSG_PING], 1);
    h.type = (sh_msg_type)0;
    CHECK_INT_EQ(sh__msg_encode_raw(&b, &h, body, sizeof body, &e), SH_EINVAL);
    CHECK_STR_EQ(sh__msg_type_name(SH_MSG_STEP_DONE), "STEP_DONE");
    CHECK_STR_EQ(sh__msg_type_name(999), "?");
    for (int r = 0; r < SH_MSG_REJECT_COUNT_; r++)
        CHECK(strcmp(sh__msg_reject_name((sh_msg_reject)r), "?") != 0);
    sh__buf_fini(&b);
}

/* Decodes and expects a rejection with `code` counted under `why`. */
static void expect_reject(sh_msg_codec *c, const void *f, size_t n, sh_err code, sh_msg_reject why,
                          const char *label)
{
    sh_msg_stats before = c->stats;
    sh_msg_env env;
    sh_error e = {0};
    sh_err err = sh__msg_decode(c, f, n, &env, &e);
    if (err != code || c->stats.rejected[why] != before.rejected[why] + 1 || !e.msg[0])
        SH_FAIL_("%s: got %s (%s), want %s counted as %s", label, sh_strerror(err), e.msg,
                 sh_strerror(code), sh__msg_reject_name(why));
    CHECK_UINT_EQ(c->stats.frames_ok, before.frames_ok);
}

static void test_envelope_rejects(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    uint8_t f[256];
    size_t n;
    n = frame_with(f, 0x5349, SH_PROTO_VERSION, SH_MSG_PING);
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_MAGIC, "magic");
    n = frame_with(f, SH_PROTO_MAGIC, SH_PROTO_VERSION + 1, SH_MSG_PING);
    expect_reject(&c, f, n, SH_EPROTO, SH_MSG_REJECT_VERSION, "version");
    n = frame_with(f, SH_PROTO_MAGIC, 0, SH_MSG_PING);
    expect_reject(&c, f, n, SH_EPROTO, SH_MSG_REJECT_VERSION, "version 0");
    static const uint64_t bad_types[] = {0, SH_MSG_TYPE_LIMIT_, 200, UINT64_MAX};
    for (size_t i = 0; i < 4; i++) {
        n = frame_with(f, SH_PROTO_MAGIC, SH_PROTO_VERSION, bad_types[i]);
        expect_reject(&c, f, n, SH_EPROTO, SH_MSG_REJECT_TYPE, "type");
    }
    n = frame_with(f, SH_PROTO_MAGIC, SH_PROTO_VERSION, SH_MSG_PING);
    sh_msg_env env;
    sh_error e = {0};
    CHECK_OK(sh__msg_decode(&c, f, n, &env, &e));
    /* Trailing byte. */
    f[n] = 0x00;
    expect_reject(&c, f, n + 1, SH_EFORMAT, SH_MSG_REJECT_TRAILING, "trailing");
    /* Not an array of 8: 7 and 9 elements, a map. */
    f[0] = 0x97;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_ENVELOPE, "array of 7");
    f[0] = 0x99;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_ENVELOPE, "array of 9");
    f[0] = 0x88;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_ENVELOPE, "map");
    f[0] = 0x98;
    /* Body not a map: replace the empty map by an empty array. */
    f[n - 1] = 0x90;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_ENVELOPE, "body array");
    f[n - 1] = 0xc1;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_SYNTAX, "body 0xc1");
    f[n - 1] = 0x80;
    /* The session as a string: the failure names the field, and n_fields counts those read. */
    {
        uint8_t g[64];
        size_t k = 0;
        memcpy(g, "\x98\xcd\x53\x48\x01\x0d\xa1x", 8);
        g[4] = (uint8_t)SH_PROTO_VERSION;
        k = 8;
        g[k++] = 0x01;
        g[k++] = 0x02;
        g[k++] = 0x03;
        g[k++] = 0x80;
        expect_reject(&c, g, k, SH_EFORMAT, SH_MSG_REJECT_ENVELOPE, "session str");
        CHECK_INT_EQ(sh__msg_decode(&c, g, k, &env, &e), SH_EFORMAT);
        CHECK(strstr(e.msg, "session") != NULL);
        CHECK_UINT_EQ(env.n_fields, 3);
    }
    /* Oversized. */
    c.max_frame = n - 1;
    expect_reject(&c, f, n, SH_EFORMAT, SH_MSG_REJECT_OVERSIZE, "oversize");
    c.max_frame = n;
    CHECK_OK(sh__msg_decode(&c, f, n, &env, &e));
    /* Too deep: a body {"x": [[[[[[[[]]]]]]]]} nests ten containers with the envelope. */
    {
        uint8_t g[64];
        memcpy(g, f, n - 1);
        size_t k = n - 1;
        g[k++] = 0x81;
        g[k++] = 0xa1;
        g[k++] = 'x';
        for (int i = 0; i < 7; i++)
            g[k++] = 0x91;
        g[k++] = 0x90;
        c.max_frame = sizeof g;
        c.max_depth = 9;
        expect_reject(&c, g, k, SH_EFORMAT, SH_MSG_REJECT_DEPTH, "depth");
        c.max_depth = 10;
        CHECK_OK(sh__msg_decode(&c, g, k, &env, &e));
    }
    CHECK_UINT_EQ(c.stats.rejected[SH_MSG_REJECT_TYPE], 4);
    CHECK_UINT_EQ(c.stats.rejected[SH_MSG_REJECT_VERSION], 2);
    CHECK_UINT_EQ(c.stats.rejected[SH_MSG_REJECT_ENVELOPE], 6);
    CHECK_UINT_EQ(c.stats.frames_ok, 3);
}

/* Every proper prefix of a valid frame of every type is rejected as malformed, and never read
 * past (ASan checks the latter: each prefix is copied into its own exact-size allocation). */
static void test_truncation(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        test_sample s;
        test_sample_make(&s, (sh_msg_type)t, (uint64_t)t, 64);
        sh__buf_reset(&b);
        sh_error e = {0};
        CHECK_OK(sh__proto_encode(&b, &s.hdr, &s.body, &e));
        uint64_t rejected = 0;
        for (size_t n = 0; n < b.len; n++) {
            uint8_t *copy = malloc(n ? n : 1);
            memcpy(copy, b.data, n);
            sh_msg_env env;
            sh_err err = sh__msg_decode(&c, copy, n, &env, &e);
            if (err != SH_EFORMAT)
                SH_FAIL_("%s truncated to %zu of %zu bytes: %s", sh__msg_type_name((uint64_t)t), n,
                         b.len, sh_strerror(err));
            rejected += err != SH_OK;
            free(copy);
        }
        CHECK_UINT_EQ(rejected, b.len);
        test_sample_free(&s);
    }
    CHECK_UINT_EQ(c.stats.frames_ok, 0);
    sh__buf_fini(&b);
}

/* A frame of another protocol version: its leading header fields are still read, so the sender
 * can be named (and answered), and the note says which versions met. */
static void test_peek_foreign(void)
{
    uint8_t f[256];
    size_t n = frame_with(f, SH_PROTO_MAGIC, 7, SH_MSG_HELLO);
    sh_msg_env env;
    memset(&env, 0xff, sizeof env);
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, n, &env), 7);
    CHECK_UINT_EQ(env.n_fields, 6);
    CHECK_INT_EQ(env.hdr.type, SH_MSG_HELLO);
    CHECK_UINT_EQ(env.hdr.session, 42);
    CHECK_UINT_EQ(env.hdr.src, sh_addr_make(1, 2));
    CHECK_UINT_EQ(env.hdr.dst, sh_addr_make(3, 4));
    char text[160] = "";
    CHECK_UINT_EQ(sh__msg_foreign_note(f, n, text, sizeof text), 1);
    char want[160];
    snprintf(want, sizeof want, "peer speaks protocol 7, this build speaks %u", SH_PROTO_VERSION);
    CHECK_STR_EQ(text, want);
    n = frame_with(f, SH_PROTO_MAGIC, 9, 250); /* a type this build does not know */
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, n, &env), 9);
    CHECK_INT_EQ(env.hdr.type, SH_MSG_ERROR); /* never answered */
    /* Not foreign: this version, another magic, version 0, a truncated header. */
    n = frame_with(f, SH_PROTO_MAGIC, SH_PROTO_VERSION, SH_MSG_PING);
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, n, &env), 0);
    n = frame_with(f, 0x5349, 7, SH_MSG_PING);
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, n, &env), 0);
    n = frame_with(f, SH_PROTO_MAGIC, 0, SH_MSG_PING);
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, n, &env), 0);
    n = frame_with(f, SH_PROTO_MAGIC, 7, SH_MSG_PING);
    CHECK_UINT_EQ(sh__msg_peek_foreign(f, 5, &env), 0);
    CHECK_UINT_EQ(sh__msg_foreign_note(f, 5, text, sizeof text), 0);
}

static const sh_test_case tests[] = {
    {"addr", test_addr},
    {"writer_matches_msgpack_c", test_writer_matches_msgpack_c},
    {"reader_values", test_reader_values},
    {"reader_limits", test_reader_limits},
    {"buffers", test_buffers},
    {"envelope", test_envelope},
    {"envelope_rejects", test_envelope_rejects},
    {"peek_foreign", test_peek_foreign},
    {"truncation", test_truncation},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
