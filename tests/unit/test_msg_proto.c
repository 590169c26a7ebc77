/* Unit tests of the message bodies: round trips, interop with msgpack-c, and every rejection. */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "runtime/mpack_read.h"
#include "runtime/proto.h"
#include "runtime/proto_desc.h"
#include "sh_test.h"
#include "shoal/version.h"
#include "test_msg_samples.h"

#define ARENA_BYTES (1 << 20)
static max_align_t arena_mem[ARENA_BYTES / sizeof(max_align_t)];

/* Encodes a sample of `type` into b (reset first). */
static void encode_sample(sh_buf *b, test_sample *s, sh_msg_type type, uint64_t seed, size_t act)
{
    test_sample_make(s, type, seed, act);
    sh__buf_reset(b);
    sh_error e = {0};
    sh_err err = sh__proto_encode(b, &s->hdr, &s->body, &e);
    if (err)
        SH_FAIL_("encode %s: %s", sh__msg_type_name(type), e.msg);
}

/* Decodes a whole frame; returns the code and fills the reason counted (or -1 when none). */
static sh_err decode(sh_msg_codec *c, const void *f, size_t n, sh_msg_env *env, sh_proto_body *out,
                     sh_proto_arena *a, sh_error *e, int *why)
{
    sh_msg_stats before = c->stats;
    sh_err err = sh__proto_decode(c, f, n, env, out, a, e);
    *why = -1;
    for (int r = 0; r < SH_MSG_REJECT_COUNT_; r++) {
        if (c->stats.rejected[r] != before.rejected[r]) {
            if (*why != -1 || c->stats.rejected[r] != before.rejected[r] + 1)
                SH_FAIL_("more than one rejection counted");
            *why = r;
        }
    }
    if ((err == SH_OK) != (*why == -1))
        SH_FAIL_("outcome %s but reason %d", sh_strerror(err), *why);
    return err;
}

static void expect(sh_msg_codec *c, const void *f, size_t n, sh_err code, int why,
                   const char *label)
{
    sh_msg_env env;
    sh_proto_body body;
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_error e = {0};
    int got;
    sh_err err = decode(c, f, n, &env, &body, &a, &e, &got);
    if (err != code || got != why || (err && !e.msg[0]))
        SH_FAIL_("%s: got %s/%s (%s), want %s/%s", label, sh_strerror(err),
                 got < 0 ? "ok" : sh__msg_reject_name((sh_msg_reject)got), e.msg, sh_strerror(code),
                 why < 0 ? "ok" : sh__msg_reject_name((sh_msg_reject)why));
    if (err && a.used != 0)
        SH_FAIL_("%s: a failed decode left %zu arena bytes used", label, a.used);
}

/* Every type, many seeds: encode, decode, encode the decoded body again: the bytes must agree,
 * which also proves each decoded field equals what was sent (encoding is a function of them). */
static void test_round_trip(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b1, b2;
    sh__buf_init(&b1);
    sh__buf_init(&b2);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    int n = 0;
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        for (uint64_t seed = 1; seed <= 25; seed++) {
            test_sample s;
            encode_sample(&b1, &s, (sh_msg_type)t, seed * 31 + (uint64_t)t, 1000);
            sh_msg_env env;
            sh_proto_body body;
            sh_error e = {0};
            sh__proto_arena_reset(&a);
            sh_err err = sh__proto_decode(&c, b1.data, b1.len, &env, &body, &a, &e);
            if (err) {
                SH_FAIL_("decode %s seed %llu: %s", sh__msg_type_name((uint64_t)t),
                         (unsigned long long)seed, e.msg);
                test_sample_free(&s);
                continue;
            }
            CHECK(memcmp(&env.hdr, &s.hdr, sizeof env.hdr) == 0);
            sh__buf_reset(&b2);
            CHECK_OK(sh__proto_encode(&b2, &env.hdr, &body, &e));
            if (b1.len != b2.len || memcmp(b1.data, b2.data, b1.len) != 0)
                SH_FAIL_("%s seed %llu: re-encoding differs (%zu vs %zu bytes)",
                         sh__msg_type_name((uint64_t)t), (unsigned long long)seed, b1.len, b2.len);
            CHECK(a.used <= sh__proto_arena_bound(env.body_len));
            test_sample_free(&s);
            n++;
        }
    }
    CHECK_UINT_EQ(c.stats.frames_ok, (uint64_t)n);
    CHECK_UINT_EQ(c.stats.bodies_ok, (uint64_t)n);
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++)
        CHECK_UINT_EQ(c.stats.ok_by_type[t], 25);
    sh__buf_fini(&b1);
    sh__buf_fini(&b2);
}

/* A few fields read back explicitly, and the zero-copy promise: views point into the frame. */
static void test_values_and_zero_copy(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_error e = {0};
    sh_msg_env env;
    sh_proto_body body;

    test_sample s;
    encode_sample(&b, &s, SH_MSG_SUBMIT, 5, 0);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    const sh_proto_submit *in = &s.body.submit, *out = &body.submit;
    CHECK_UINT_EQ(out->req, in->req);
    CHECK_UINT_EQ(out->prompt.n, in->prompt.n);
    for (uint32_t i = 0; i < in->prompt.n; i++)
        CHECK_INT_EQ(sh_i32s_at(out->prompt, i), ((const int32_t *)in->prompt.ptr)[i]);
    CHECK((const uint8_t *)out->prompt.ptr > b.data &&
          (const uint8_t *)out->prompt.ptr + 4 * out->prompt.n <= b.data + b.len);
    CHECK(out->sampling.temperature == in->sampling.temperature);
    CHECK(out->sampling.top_p == in->sampling.top_p);
    CHECK_UINT_EQ(out->sampling.seed, in->sampling.seed);
    CHECK_UINT_EQ(out->sampling.stop.n, in->sampling.stop.n);
    for (uint32_t i = 0; i < in->sampling.stop.n; i++)
        CHECK(out->sampling.stop.v[i].len == in->sampling.stop.v[i].len &&
              memcmp(out->sampling.stop.v[i].ptr, in->sampling.stop.v[i].ptr,
                     in->sampling.stop.v[i].len) == 0);
    CHECK_UINT_EQ(out->sampling.bias.n, in->sampling.bias.n);
    for (uint32_t i = 0; i < in->sampling.bias.n; i++)
        CHECK(out->sampling.bias.v[i].id == in->sampling.bias.v[i].id &&
              out->sampling.bias.v[i].bias == in->sampling.bias.v[i].bias);
    CHECK_UINT_EQ(out->reply_to, in->reply_to);
    test_sample_free(&s);

    /* 1 MiB of activations: the decoded tensor is the frame's bytes, not a copy. */
    sh__proto_arena_reset(&a);
    encode_sample(&b, &s, SH_MSG_ACT, 9, 1 << 20);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    const sh_proto_tensor *h = &body.act.hidden;
    CHECK_UINT_EQ(h->nbytes, s.body.act.hidden.nbytes);
    CHECK(h->nbytes >= (1 << 20) - 64 * 4 * 40);
    CHECK((const uint8_t *)h->data >= b.data &&
          (const uint8_t *)h->data + h->nbytes <= b.data + b.len);
    CHECK(memcmp(h->data, s.body.act.hidden.data, h->nbytes) == 0);
    CHECK_UINT_EQ(h->dtype, s.body.act.hidden.dtype);
    CHECK_UINT_EQ(h->shape[0], s.body.act.hidden.shape[0]);
    CHECK_UINT_EQ(h->shape[1], s.body.act.hidden.shape[1]);
    CHECK_UINT_EQ(body.act.seqs.n, s.body.act.seqs.n);
    test_sample_free(&s);
    sh__buf_fini(&b);
}

/* ---- Frames from msgpack-c, an independent encoder. ---- */

static void pk_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

static void pk_envelope(msgpack_packer *pk, uint64_t type)
{
    msgpack_pack_array(pk, 8);
    msgpack_pack_uint16(pk, SH_PROTO_MAGIC);
    msgpack_pack_uint8(pk, SH_PROTO_VERSION);
    msgpack_pack_uint64(pk, type);
    msgpack_pack_uint64(pk, 1234567);
    msgpack_pack_uint64(pk, sh_addr_make(2, 5));
    msgpack_pack_uint64(pk, sh_addr_make(3, 6));
    msgpack_pack_uint64(pk, 0xabcdef);
}

static void pk_sampling(msgpack_packer *pk, bool reverse)
{
    msgpack_pack_map(pk, reverse ? 14 : 19); /* reverse leaves the OPT "nspec" .. "gram_lp" out */
    /* Keys in an order of our choosing: decoders must not depend on it. */
    if (reverse) {
        pk_str(pk, "bias");
        msgpack_pack_array(pk, 2);
        for (int i = 0; i < 2; i++) {
            msgpack_pack_map(pk, 2);
            pk_str(pk, "b");
            msgpack_pack_float(pk, -1.5f * (float)(i + 1));
            pk_str(pk, "i");
            msgpack_pack_int32(pk, 100 + i);
        }
        pk_str(pk, "stop");
        msgpack_pack_array(pk, 1);
        pk_str(pk, "</s>");
    }
    pk_str(pk, "temp");
    msgpack_pack_double(pk, 0.75); /* float64 for a float32 field: accepted */
    pk_str(pk, "top_k");
    msgpack_pack_int32(pk, 40);
    pk_str(pk, "top_p");
    msgpack_pack_float(pk, 0.9f);
    pk_str(pk, "min_p");
    msgpack_pack_float(pk, 0.05f);
    pk_str(pk, "rep");
    msgpack_pack_float(pk, 1.1f);
    pk_str(pk, "freq");
    msgpack_pack_float(pk, 0.25f);
    pk_str(pk, "pres");
    msgpack_pack_float(pk, -0.5f);
    pk_str(pk, "pen_n");
    msgpack_pack_int32(pk, 64);
    pk_str(pk, "seed");
    msgpack_pack_uint64(pk, 0xfeedfacecafebeefull);
    pk_str(pk, "max");
    msgpack_pack_uint32(pk, 256);
    pk_str(pk, "lp");
    msgpack_pack_int8(pk, 3);
    pk_str(pk, "lp_mode");
    msgpack_pack_uint8(pk, 1);
    if (!reverse) {
        pk_str(pk, "stop");
        msgpack_pack_array(pk, 1);
        pk_str(pk, "</s>");
        pk_str(pk, "bias");
        msgpack_pack_array(pk, 2);
        for (int i = 0; i < 2; i++) {
            msgpack_pack_map(pk, 2);
            pk_str(pk, "i");
            msgpack_pack_int32(pk, 100 + i);
            pk_str(pk, "b");
            msgpack_pack_float(pk, -1.5f * (float)(i + 1));
        }
        pk_str(pk, "nspec");
        msgpack_pack_false(pk);
        pk_str(pk, "nsmax");
        msgpack_pack_uint8(pk, 0);
        pk_str(pk, "typ");
        msgpack_pack_float(pk, 0.0f);
        pk_str(pk, "gram");
        pk_str(pk, "");
        pk_str(pk, "gram_lp");
        msgpack_pack_false(pk);
    }
}

static void test_msgpack_c_interop(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_error e = {0};
    sh_msg_env env;
    sh_proto_body body;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);

    /* SUBMIT with keys shuffled and unknown keys of every shape (forward compatibility). */
    static const int32_t prompt[] = {1, 15043, 29892, 3186, 151643};
    pk_envelope(&pk, SH_MSG_SUBMIT);
    msgpack_pack_map(&pk, 10);
    pk_str(&pk, "future_map");
    msgpack_pack_map(&pk, 1);
    pk_str(&pk, "x");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_nil(&pk);
    msgpack_pack_bin(&pk, 3);
    msgpack_pack_bin_body(&pk, "abc", 3);
    pk_str(&pk, "samp");
    pk_sampling(&pk, true);
    pk_str(&pk, "to");
    msgpack_pack_uint64(&pk, sh_addr_make(2, 5));
    pk_str(&pk, "dl");
    msgpack_pack_uint64(&pk, 1700000000123ull);
    pk_str(&pk, "future_ext");
    msgpack_pack_ext(&pk, 4, 9);
    msgpack_pack_ext_body(&pk, "\x01\x02\x03\x04", 4);
    pk_str(&pk, "prio");
    msgpack_pack_uint8(&pk, 2);
    pk_str(&pk, "tok");
    msgpack_pack_bin(&pk, sizeof prompt);
    msgpack_pack_bin_body(&pk, prompt, sizeof prompt);
    pk_str(&pk, "future_float");
    msgpack_pack_double(&pk, 3.25);
    pk_str(&pk, "req");
    msgpack_pack_uint64(&pk, 77);
    pk_str(&pk, "future_str");
    pk_str(&pk, "ignored");
    CHECK_OK(sh__proto_decode(&c, sb.data, sb.size, &env, &body, &a, &e));
    if (e.code)
        fprintf(stderr, "  %s\n", e.msg);
    CHECK_INT_EQ(env.hdr.type, SH_MSG_SUBMIT);
    CHECK_UINT_EQ(env.hdr.session, 1234567);
    CHECK_UINT_EQ(env.hdr.src, sh_addr_make(2, 5));
    CHECK_UINT_EQ(env.hdr.trace_id, 0xabcdef);
    const sh_proto_submit *m = &body.submit;
    CHECK_UINT_EQ(m->req, 77);
    CHECK_UINT_EQ(m->prompt.n, 5);
    for (uint32_t i = 0; i < 5; i++)
        CHECK_INT_EQ(sh_i32s_at(m->prompt, i), prompt[i]);
    CHECK_UINT_EQ(m->generated.n, 0); /* OPT, absent */
    CHECK_UINT_EQ(m->priority, 2);
    CHECK_UINT_EQ(m->deadline_ms, 1700000000123ull);
    CHECK_NEAR(m->sampling.temperature, 0.75, 0);
    CHECK_INT_EQ(m->sampling.top_k, 40);
    CHECK_NEAR(m->sampling.presence_penalty, -0.5, 0);
    CHECK_UINT_EQ(m->sampling.seed, 0xfeedfacecafebeefull);
    CHECK_INT_EQ(m->sampling.n_logprobs, 3);
    CHECK_UINT_EQ(m->sampling.stop.n, 1);
    CHECK(m->sampling.stop.n == 1 && m->sampling.stop.v[0].len == 4 &&
          memcmp(m->sampling.stop.v[0].ptr, "</s>", 4) == 0);
    CHECK_UINT_EQ(m->sampling.bias.n, 2);
    CHECK(m->sampling.bias.n == 2 && m->sampling.bias.v[1].id == 101 &&
          m->sampling.bias.v[1].bias == -3.0f);

    /* The same body in table order with canonical types is byte-identical to ours. */
    msgpack_sbuffer_clear(&sb);
    pk_envelope(&pk, SH_MSG_SUBMIT);
    msgpack_pack_map(&pk, 11);
    pk_str(&pk, "req");
    msgpack_pack_uint64(&pk, 77);
    pk_str(&pk, "tok");
    msgpack_pack_bin(&pk, sizeof prompt);
    msgpack_pack_bin_body(&pk, prompt, sizeof prompt);
    pk_str(&pk, "gen");
    msgpack_pack_bin(&pk, 0);
    pk_str(&pk, "samp");
    pk_sampling(&pk, false);
    pk_str(&pk, "prio");
    msgpack_pack_uint8(&pk, 2);
    pk_str(&pk, "dl");
    msgpack_pack_uint64(&pk, 1700000000123ull);
    pk_str(&pk, "to");
    msgpack_pack_uint64(&pk, sh_addr_make(2, 5));
    pk_str(&pk, "n"); /* OPT fields are written too, as zero */
    msgpack_pack_uint64(&pk, 0);
    pk_str(&pk, "min");
    msgpack_pack_uint64(&pk, 0);
    pk_str(&pk, "minm");
    msgpack_pack_uint64(&pk, 0);
    pk_str(&pk, "emb");
    msgpack_pack_uint64(&pk, 0);
    /* Our encoder writes temperature as float32; msgpack-c wrote a float64 above, so patch it to
     * compare: decode it, then encode the decoded body. */
    sh__proto_arena_reset(&a);
    CHECK_OK(sh__proto_decode(&c, sb.data, sb.size, &env, &body, &a, &e));
    sh_buf b;
    sh__buf_init(&b);
    CHECK_OK(sh__proto_encode(&b, &env.hdr, &body, &e));
    CHECK_UINT_EQ(b.len, sb.size - 4); /* float64 -> float32: 4 bytes shorter */

    /* PING, all canonical: msgpack-c's bytes and ours are identical. */
    msgpack_sbuffer_clear(&sb);
    pk_envelope(&pk, SH_MSG_PING);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "n");
    msgpack_pack_uint64(&pk, 300);
    pk_str(&pk, "t");
    msgpack_pack_uint64(&pk, 1ull << 40);
    sh__proto_arena_reset(&a);
    CHECK_OK(sh__proto_decode(&c, sb.data, sb.size, &env, &body, &a, &e));
    sh__buf_reset(&b);
    CHECK_OK(sh__proto_encode(&b, &env.hdr, &body, &e));
    CHECK(b.len == sb.size && memcmp(b.data, sb.data, b.len) == 0);

    /* ACT from msgpack-c: a 3 x 4 f32 tensor, decoded in place. */
    float hidden[12];
    for (int i = 0; i < 12; i++)
        hidden[i] = 0.5f * (float)(i + 1);
    msgpack_sbuffer_clear(&sb);
    pk_envelope(&pk, SH_MSG_ACT);
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "h");
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "d");
    msgpack_pack_bin(&pk, sizeof hidden);
    msgpack_pack_bin_body(&pk, hidden, sizeof hidden);
    pk_str(&pk, "sh");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint8(&pk, 3);
    msgpack_pack_uint8(&pk, 4);
    pk_str(&pk, "dt");
    msgpack_pack_uint8(&pk, SH_PROTO_DTYPE_F32);
    pk_str(&pk, "step");
    msgpack_pack_uint64(&pk, 9);
    pk_str(&pk, "seqs");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 6);
    pk_str(&pk, "id");
    msgpack_pack_uint64(&pk, 5);
    pk_str(&pk, "tok");
    msgpack_pack_bin(&pk, 12);
    msgpack_pack_bin_body(&pk, prompt, 12);
    pk_str(&pk, "pos");
    msgpack_pack_uint32(&pk, 17);
    pk_str(&pk, "blk");
    msgpack_pack_bin(&pk, 8);
    msgpack_pack_bin_body(&pk, prompt, 8);
    pk_str(&pk, "smp");
    msgpack_pack_true(&pk);
    pk_str(&pk, "samp");
    pk_sampling(&pk, false);
    sh__proto_arena_reset(&a);
    CHECK_OK(sh__proto_decode(&c, sb.data, sb.size, &env, &body, &a, &e));
    if (e.code)
        fprintf(stderr, "  %s\n", e.msg);
    CHECK_UINT_EQ(body.act.hidden.nbytes, sizeof hidden);
    CHECK((const char *)body.act.hidden.data > sb.data &&
          (const char *)body.act.hidden.data < sb.data + sb.size);
    CHECK(memcmp(body.act.hidden.data, hidden, sizeof hidden) == 0);
    CHECK_UINT_EQ(body.act.seqs.v[0].pos, 17);
    CHECK_UINT_EQ(body.act.seqs.v[0].tokens.n, 3);
    sh__buf_fini(&b);
    msgpack_sbuffer_destroy(&sb);
}

/* ---- Editing encoded frames: drop, replace, duplicate or add a top-level body key. ---- */

enum { EDIT_DROP, EDIT_REPLACE, EDIT_DUP, EDIT_ADD };

/* Rewrites the frame's body; returns the new length in a malloc'd *out. */
static size_t edit(const uint8_t *f, size_t n, int mode, uint32_t key, const void *raw,
                   size_t raw_len, uint8_t **out)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_msg_env env;
    sh_error e = {0};
    if (sh__msg_decode(&c, f, n, &env, &e))
        abort();
    sh_mpack_reader r;
    sh__mpack_reader_init(&r, env.body, env.body_len, 16);
    sh_mpack_item it;
    sh__mpack_next(&r, &it, &e);
    uint32_t pairs = it.len;
    const uint8_t *ks[64], *ve[64];
    const uint8_t *vs[64];
    for (uint32_t i = 0; i < pairs; i++) {
        ks[i] = r.p;
        sh__mpack_skip(&r, 3, &e);
        vs[i] = r.p;
        sh__mpack_skip(&r, 3, &e);
        ve[i] = r.p;
    }
    sh_buf b;
    sh__buf_init(&b);
    memcpy(sh__buf_append(&b, (size_t)(env.body - f)), f, (size_t)(env.body - f));
    uint32_t np = pairs + (mode == EDIT_DROP ? -1u : mode == EDIT_REPLACE ? 0 : 1);
    sh__mpack_put_map(&b, np);
    for (uint32_t i = 0; i < pairs; i++) {
        if (i == key && mode == EDIT_DROP)
            continue;
        if (i == key && mode == EDIT_REPLACE) {
            memcpy(sh__buf_append(&b, (size_t)(vs[i] - ks[i])), ks[i], (size_t)(vs[i] - ks[i]));
            memcpy(sh__buf_append(&b, raw_len), raw, raw_len);
            continue;
        }
        memcpy(sh__buf_append(&b, (size_t)(ve[i] - ks[i])), ks[i], (size_t)(ve[i] - ks[i]));
        if (i == key && mode == EDIT_DUP)
            memcpy(sh__buf_append(&b, (size_t)(ve[i] - ks[i])), ks[i], (size_t)(ve[i] - ks[i]));
    }
    if (mode == EDIT_ADD)
        memcpy(sh__buf_append(&b, raw_len), raw, raw_len);
    *out = b.data;
    return b.len;
}

/* Each REQ field missing is refused; each OPT field missing is fine. */
static void test_missing_fields(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        test_sample s;
        encode_sample(&b, &s, (sh_msg_type)t, 7, 64);
        const sh_proto_desc *d = sh__proto_body_desc((uint64_t)t);
        for (uint32_t i = 0; i < d->n_fields; i++) {
            uint8_t *g;
            size_t n = edit(b.data, b.len, EDIT_DROP, i, NULL, 0, &g);
            char label[96];
            snprintf(label, sizeof label, "%s without %s", d->name, d->fields[i].name);
            /* Optional fields that a cross-field rule ties to others: dropping one alone breaks
             * the rule (TOKEN's top_* lists and top_n must agree; an I8 ACT needs its scales). */
            bool tied = (t == SH_MSG_TOKEN && !strncmp(d->fields[i].name, "top_", 4)) ||
                        (t == SH_MSG_ACT && !strcmp(d->fields[i].name, "scales") &&
                         s.body.act.hidden.dtype == SH_PROTO_DTYPE_I8);
            if (d->fields[i].required)
                expect(&c, g, n, SH_EPROTO, SH_MSG_REJECT_MISSING, label);
            else if (tied)
                expect(&c, g, n, SH_EPROTO, SH_MSG_REJECT_SHAPE, label);
            else
                expect(&c, g, n, SH_OK, -1, label);
            free(g);
        }
        test_sample_free(&s);
    }
    sh__buf_fini(&b);
}

/* Each field given a value of the wrong msgpack type is refused as such. */
static void test_wrong_types(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        test_sample s;
        encode_sample(&b, &s, (sh_msg_type)t, 8, 64);
        const sh_proto_desc *d = sh__proto_body_desc((uint64_t)t);
        for (uint32_t i = 0; i < d->n_fields; i++) {
            static const uint8_t str[] = {0xa1, 'z'}, uint[] = {0x05}, nil[] = {0xc0};
            bool is_str = d->fields[i].kind == SH_PROTO_KIND_STR;
            const uint8_t *vals[2] = {is_str ? uint : str, nil};
            size_t lens[2] = {is_str ? 1 : 2, 1};
            for (int k = 0; k < 2; k++) {
                uint8_t *g;
                size_t n = edit(b.data, b.len, EDIT_REPLACE, i, vals[k], lens[k], &g);
                char label[96];
                snprintf(label, sizeof label, "%s.%s as %s", d->name, d->fields[i].name,
                         k        ? "nil"
                         : is_str ? "uint"
                                  : "str");
                expect(&c, g, n, SH_EPROTO, SH_MSG_REJECT_FIELD_TYPE, label);
                free(g);
            }
        }
        test_sample_free(&s);
    }
    sh__buf_fini(&b);
}

/* Unknown keys are skipped (and dropped on re-encode); duplicated keys are refused. */
static void test_unknown_and_duplicate_keys(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b, b2;
    sh__buf_init(&b);
    sh__buf_init(&b2);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    /* "zz_v2": {"a": [1, -2, {"b": bin(2)}], "c": 1.5} */
    static const uint8_t extra[] = {0xa5, 'z',  'z',  '_',  'v', '2',  0x82, 0xa1, 'a',  0x93,
                                    0x01, 0xfe, 0x81, 0xa1, 'b', 0xc4, 0x02, 0x00, 0x01, 0xa1,
                                    'c',  0xcb, 0x3f, 0xf8, 0,   0,    0,    0,    0,    0};
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        test_sample s;
        encode_sample(&b, &s, (sh_msg_type)t, 11, 64);
        uint8_t *g;
        size_t n = edit(b.data, b.len, EDIT_ADD, 0, extra, sizeof extra, &g);
        sh_msg_env env;
        sh_proto_body body;
        sh_error e = {0};
        sh__proto_arena_reset(&a);
        CHECK_OK(sh__proto_decode(&c, g, n, &env, &body, &a, &e));
        sh__buf_reset(&b2);
        CHECK_OK(sh__proto_encode(&b2, &env.hdr, &body, &e));
        CHECK(b2.len == b.len && memcmp(b2.data, b.data, b.len) == 0);
        free(g);
        n = edit(b.data, b.len, EDIT_DUP, 0, NULL, 0, &g);
        expect(&c, g, n, SH_EPROTO, SH_MSG_REJECT_DUPLICATE, "duplicate");
        free(g);
        test_sample_free(&s);
    }
    sh__buf_fini(&b);
    sh__buf_fini(&b2);
}

/* Replaces field `name` of a sample of `type` with raw bytes and expects the outcome. */
static void expect_field(sh_msg_type type, const char *name, const void *raw, size_t len,
                         sh_err code, int why)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    test_sample s;
    encode_sample(&b, &s, type, 13, 64);
    const sh_proto_desc *d = sh__proto_body_desc((uint64_t)type);
    uint32_t i = 0;
    while (i < d->n_fields && strcmp(d->fields[i].name, name) != 0)
        i++;
    if (i == d->n_fields) {
        SH_FAIL_("no field %s", name);
    } else {
        uint8_t *g;
        size_t n = edit(b.data, b.len, EDIT_REPLACE, i, raw, len, &g);
        char label[96];
        snprintf(label, sizeof label, "%s.%s", d->name, name);
        expect(&c, g, n, code, why, label);
        free(g);
    }
    test_sample_free(&s);
    sh__buf_fini(&b);
}

/* Values, lengths and counts outside the table's bounds, and absurd declared counts. */
static void test_bounds(void)
{
    expect_field(SH_MSG_DONE, "finish", "\x04", 1, SH_EPROTO, SH_MSG_REJECT_RANGE);
    expect_field(SH_MSG_DONE, "finish", "\x03", 1, SH_OK, -1);
    expect_field(SH_MSG_DONE, "n_prompt", "\xff", 1, SH_EPROTO, SH_MSG_REJECT_FIELD_TYPE); /* -1 */
    expect_field(SH_MSG_DONE, "n_prompt", "\xcf\x00\x00\x00\x01\x00\x00\x00\x00", 9, SH_EPROTO,
                 SH_MSG_REJECT_RANGE); /* 2^32 in a uint32 field */
    expect_field(SH_MSG_FAIL, "code", "\x00", 1, SH_EPROTO, SH_MSG_REJECT_RANGE);
    expect_field(SH_MSG_FAIL, "code", "\xd3\x80\x00\x00\x00\x00\x00\x00\x00", 9, SH_EPROTO,
                 SH_MSG_REJECT_RANGE); /* INT64_MIN */
    expect_field(SH_MSG_FAIL, "code", "\xcf\xff\xff\xff\xff\xff\xff\xff\xff", 9, SH_EPROTO,
                 SH_MSG_REJECT_RANGE);                           /* UINT64_MAX for an int field */
    expect_field(SH_MSG_FAIL, "code", "\xd0\x07", 2, SH_OK, -1); /* 7 as int8 */
    expect_field(SH_MSG_PONG, "health", "\xcd\x01\x2c", 3, SH_EPROTO, SH_MSG_REJECT_RANGE);
    expect_field(SH_MSG_TOKEN, "top_n", "\x15", 1, SH_EPROTO, SH_MSG_REJECT_RANGE);
    /* An array declaring 2^32 - 1 entries in a short frame. */
    expect_field(SH_MSG_STEP, "seqs", "\xdd\xff\xff\xff\xff", 5, SH_EFORMAT,
                 SH_MSG_REJECT_TRUNCATED);
    expect_field(SH_MSG_STEP, "seqs", "\x90", 1, SH_OK, -1);
    /* 257 fault rules (bound 256), refused on the count before any entry is read. */
    {
        uint8_t r[3 + 257];
        r[0] = 0xdc;
        r[1] = 0x01;
        r[2] = 0x01;
        memset(r + 3, 0x80, 257);
        expect_field(SH_MSG_FAULT, "rules", r, sizeof r, SH_EPROTO, SH_MSG_REJECT_RANGE);
    }
    /* 1025 reroute targets (bound 1024). */
    {
        static uint8_t r[3 + 1025 * 8];
        r[0] = 0xc5;
        r[1] = (uint8_t)((1025 * 8) >> 8);
        r[2] = (uint8_t)(1025 * 8);
        expect_field(SH_MSG_CONTROL, "targets", r, sizeof r, SH_EPROTO, SH_MSG_REJECT_RANGE);
        r[2] = (uint8_t)(1024 * 8);
        r[1] = (uint8_t)((1024 * 8) >> 8);
        expect_field(SH_MSG_CONTROL, "targets", r, 3 + 1024 * 8, SH_OK, -1);
    }
    /* A string over its bound. */
    {
        static uint8_t r[3 + SH_PROTO_MAX_MSG + 1];
        r[0] = 0xda;
        r[1] = (uint8_t)((SH_PROTO_MAX_MSG + 1) >> 8);
        r[2] = (uint8_t)(SH_PROTO_MAX_MSG + 1);
        memset(r + 3, 'x', SH_PROTO_MAX_MSG + 1);
        expect_field(SH_MSG_CANCEL, "reason", r, sizeof r, SH_EPROTO, SH_MSG_REJECT_RANGE);
    }
    /* Token ids whose bytes are not a whole number of int32. */
    expect_field(SH_MSG_KV_FREE, "blocks", "\xc4\x07\x01\x02\x03\x04\x05\x06\x07", 9, SH_EPROTO,
                 SH_MSG_REJECT_SHAPE);
    /* A float where an integer belongs. */
    expect_field(SH_MSG_STEP_DONE, "step", "\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00", 9, SH_EPROTO,
                 SH_MSG_REJECT_FIELD_TYPE);
}

/* A body nested deeper than the codec allows; a float64 overflowing a float32 field. */
static void test_depth_and_floats(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    test_sample s;
    encode_sample(&b, &s, SH_MSG_STEP, 3, 0); /* seqs > seq > sampling > bias > entry: depth 7 */
    c.max_depth = 6;
    expect(&c, b.data, b.len, SH_EFORMAT, SH_MSG_REJECT_DEPTH, "STEP at depth 6");
    c.max_depth = 7;
    expect(&c, b.data, b.len, SH_OK, -1, "STEP at depth 7");
    test_sample_free(&s);

    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    pk_envelope(&pk, SH_MSG_STEP_DONE);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "step");
    msgpack_pack_uint8(&pk, 1);
    pk_str(&pk, "seqs");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 4);
    pk_str(&pk, "id");
    msgpack_pack_uint8(&pk, 1);
    pk_str(&pk, "tok");
    msgpack_pack_int32(&pk, -1);
    pk_str(&pk, "lp");
    msgpack_pack_double(&pk, 1e300);
    pk_str(&pk, "lp_raw");
    msgpack_pack_double(&pk, -1.0 / 0.0);
    expect(&c, sb.data, sb.size, SH_EPROTO, SH_MSG_REJECT_RANGE, "float32 overflow");
    msgpack_sbuffer_destroy(&sb);
    sh__buf_fini(&b);
}

/* An ACT whose "h" is replaced by the tensor map `t`. */
static void expect_tensor(void (*build)(sh_buf *, uint64_t rows), sh_err code, int why,
                          const char *label)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b, t;
    sh__buf_init(&b);
    sh__buf_init(&t);
    test_sample s;
    encode_sample(&b, &s, SH_MSG_ACT, 17, 256);
    uint64_t rows = s.body.act.hidden.shape[0];
    build(&t, rows);
    uint8_t *g;
    size_t n = edit(b.data, b.len, EDIT_REPLACE, 3, t.data, t.len, &g);
    expect(&c, g, n, code, why, label);
    free(g);
    test_sample_free(&s);
    sh__buf_fini(&b);
    sh__buf_fini(&t);
}

static void tensor_map(sh_buf *t, int with_dt, uint64_t dt, const uint64_t *shape, uint32_t nd,
                       int64_t data_len)
{
    static uint8_t zeros[4096];
    sh__mpack_put_map(t, (size_t)(with_dt + 1 + (data_len >= 0)));
    if (with_dt) {
        sh__mpack_put_str(t, "dt", 2);
        sh__mpack_put_uint(t, dt);
    }
    sh__mpack_put_str(t, "sh", 2);
    sh__mpack_put_array(t, nd);
    for (uint32_t i = 0; i < nd; i++)
        sh__mpack_put_uint(t, shape[i]);
    if (data_len >= 0) {
        sh__mpack_put_str(t, "d", 1);
        sh__mpack_put_bin(t, zeros, (size_t)data_len);
    }
}

static void t_ok(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 8};
    tensor_map(t, 1, SH_PROTO_DTYPE_F16, sh, 2, (int64_t)(rows * 8 * 2));
}
static void t_short(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 8};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 2, (int64_t)(rows * 8 * 4 - 4));
}
static void t_long(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 8};
    tensor_map(t, 1, SH_PROTO_DTYPE_BF16, sh, 2, (int64_t)(rows * 8 * 2 + 2));
}
static void t_external(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 4096};
    tensor_map(t, 1, SH_PROTO_DTYPE_F16, sh, 2, -1);
}
static void t_quant(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 32};
    tensor_map(t, 1, 2 /* Q4_0 */, sh, 2, 18 * (int64_t)rows);
}
static void t_5d(sh_buf *t, uint64_t rows)
{
    uint64_t sh[5] = {rows, 1, 1, 1, 2};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 5, (int64_t)(rows * 8));
}
static void t_zero_dim(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 0};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 2, 0);
}
static void t_rows(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows + 1, 2};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 2, (int64_t)((rows + 1) * 8));
}
static void t_1d(sh_buf *t, uint64_t rows)
{
    uint64_t sh[1] = {rows};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 1, (int64_t)(rows * 4));
}
static void t_huge(sh_buf *t, uint64_t rows)
{
    uint64_t sh[3] = {rows, 0xffffffffu, 0xffffffffu};
    tensor_map(t, 1, SH_PROTO_DTYPE_F32, sh, 3, 16);
}
static void t_no_dt(sh_buf *t, uint64_t rows)
{
    uint64_t sh[2] = {rows, 2};
    tensor_map(t, 0, 0, sh, 2, (int64_t)(rows * 8));
}

static void test_tensors(void)
{
    expect_tensor(t_ok, SH_OK, -1, "f16 tensor");
    expect_tensor(t_external, SH_OK, -1, "out-of-band tensor");
    expect_tensor(t_short, SH_EPROTO, SH_MSG_REJECT_SHAPE, "bin 4 bytes short");
    expect_tensor(t_long, SH_EPROTO, SH_MSG_REJECT_SHAPE, "bin 2 bytes long");
    expect_tensor(t_quant, SH_EPROTO, SH_MSG_REJECT_RANGE, "quantised dtype");
    expect_tensor(t_5d, SH_EPROTO, SH_MSG_REJECT_SHAPE, "5 dimensions");
    expect_tensor(t_zero_dim, SH_EPROTO, SH_MSG_REJECT_SHAPE, "zero dimension");
    expect_tensor(t_rows, SH_EPROTO, SH_MSG_REJECT_SHAPE, "rows disagree with sequences");
    expect_tensor(t_1d, SH_EPROTO, SH_MSG_REJECT_SHAPE, "1-d hidden states");
    expect_tensor(t_huge, SH_EPROTO, SH_MSG_REJECT_SHAPE, "shape overflows");
    expect_tensor(t_no_dt, SH_EPROTO, SH_MSG_REJECT_MISSING, "no dtype");

    /* An out-of-band tensor decodes to a NULL data pointer and re-encodes without "d". */
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    test_sample s;
    test_sample_make(&s, SH_MSG_ACT, 4, 64);
    s.body.act.hidden.data = NULL;
    s.body.act.hidden.nbytes = 0;
    sh_error e = {0};
    CHECK_OK(sh__proto_encode(&b, &s.hdr, &s.body, &e));
    sh_msg_env env;
    sh_proto_body body;
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    CHECK(body.act.hidden.data == NULL && body.act.hidden.nbytes == 0);
    CHECK_UINT_EQ(body.act.hidden.shape[1], s.body.act.hidden.shape[1]);
    test_sample_free(&s);
    sh__buf_fini(&b);
}

/* The arena bounds what lists may take; a failed decode gives back what it took. */
static void test_arena(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    test_sample s;
    encode_sample(&b, &s, SH_MSG_STEP, 21, 0);
    sh_msg_env env;
    sh_proto_body body;
    sh_error e = {0};
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, 256);
    a.used = 16;
    CHECK_INT_EQ(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e), SH_ERANGE);
    CHECK_UINT_EQ(c.stats.rejected[SH_MSG_REJECT_ARENA], 1);
    CHECK_UINT_EQ(a.used, 16);
    CHECK(strstr(e.msg, "arena") != NULL);
    CHECK_INT_EQ(sh__proto_decode(&c, b.data, b.len, &env, &body, NULL, &e), SH_ERANGE);
    /* The documented bound always suffices. */
    size_t need = sh__proto_arena_bound(env.body_len);
    void *mem = malloc(need);
    sh__proto_arena_init(&a, mem, need);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    CHECK(a.used > 0 && a.used <= need);
    /* Bodies without lists need no arena at all. */
    test_sample_free(&s);
    encode_sample(&b, &s, SH_MSG_TOKEN, 2, 0);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, NULL, &e));
    free(mem);
    test_sample_free(&s);
    sh__buf_fini(&b);
}

/* The encoder refuses what the decoder would refuse, and leaves the buffer as it was. */
static void test_encoder_validation(void)
{
    sh_buf b;
    sh__buf_init(&b);
    sh__mpack_put_uint(&b, 1);
    sh_error e = {0};
    test_sample s;

    test_sample_make(&s, SH_MSG_TOKEN, 3, 0);
    s.body.token.top_n++;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "TOKEN") != NULL);
    test_sample_free(&s);

    test_sample_make(&s, SH_MSG_ACT, 3, 256);
    s.body.act.hidden.nbytes -= 2;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    s.body.act.hidden.nbytes += 2;
    s.body.act.hidden.dtype = 8;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    test_sample_free(&s);

    test_sample_make(&s, SH_MSG_SUBMIT, 3, 0);
    s.body.submit.sampling.n_logprobs = 21;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "n_logprobs") != NULL);
    s.body.submit.sampling.n_logprobs = 1;
    s.body.submit.sampling.stop.n = SH_PROTO_MAX_STOP + 1;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    s.body.submit.sampling.stop.n = 1;
    s.body.submit.prompt.ptr = NULL;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    s.hdr.type = (sh_msg_type)0;
    CHECK_INT_EQ(sh__proto_encode(&b, &s.hdr, &s.body, &e), SH_EINVAL);
    test_sample_free(&s);
    CHECK_UINT_EQ(b.len, 1);
    CHECK(!b.failed);

    /* The typed wrappers set the type themselves. */
    sh_proto_ping ping = {3, 4};
    sh_msg_hdr h = {(sh_msg_type)0, 1, 2, 3, 4};
    CHECK_OK(sh__proto_encode_ping(&b, &h, &ping, &e));
    sh__buf_fini(&b);
}

static void test_error_reply(void)
{
    sh_buf b;
    sh__buf_init(&b);
    sh_msg_hdr req = {SH_MSG_SUBMIT, 555, sh_addr_make(1, 2), sh_addr_make(3, 4), 999};
    sh_error e = {0};
    CHECK_OK(sh__proto_encode_error_reply(&b, &req, SH_ENOTFOUND, "no actor 3:4", &e));
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_msg_env env;
    sh_proto_body body;
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, NULL, &e));
    CHECK_INT_EQ(env.hdr.type, SH_MSG_ERROR);
    CHECK_UINT_EQ(env.hdr.session, 555);
    CHECK_UINT_EQ(env.hdr.src, req.dst);
    CHECK_UINT_EQ(env.hdr.dst, req.src);
    CHECK_UINT_EQ(env.hdr.trace_id, 999);
    CHECK_INT_EQ(body.error.code, SH_ENOTFOUND);
    CHECK_UINT_EQ(body.error.type, SH_MSG_SUBMIT);
    CHECK(body.error.message.len == 12 && !memcmp(body.error.message.ptr, "no actor 3:4", 12));
    sh__buf_fini(&b);
}

/* With SH_MSG_WRITE_CORPUS=dir set, writes the fuzzers' seed corpora under dir/env and dir/body
 * (run once by hand; the corpus is committed). Otherwise does nothing. */
static void test_write_corpus(void)
{
    const char *dir = getenv("SH_MSG_WRITE_CORPUS");
    if (!dir)
        return;
    char path[1024];
    snprintf(path, sizeof path, "%s/env", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/body", dir);
    mkdir(path, 0755);
    sh_buf b;
    sh__buf_init(&b);
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        for (uint64_t seed = 1; seed <= 2; seed++) {
            test_sample s;
            encode_sample(&b, &s, (sh_msg_type)t, seed, 48);
            sh_msg_env env;
            sh_error e = {0};
            CHECK_OK(sh__msg_decode(&c, b.data, b.len, &env, &e));
            snprintf(path, sizeof path, "%s/env/%s-%llu", dir, sh__msg_type_name((uint64_t)t),
                     (unsigned long long)seed);
            FILE *f = fopen(path, "wb");
            CHECK(f != NULL);
            if (f) {
                fwrite(b.data, 1, b.len, f);
                fclose(f);
            }
            /* The body fuzzer's input: one byte of type, then the body map. */
            snprintf(path, sizeof path, "%s/body/%s-%llu", dir, sh__msg_type_name((uint64_t)t),
                     (unsigned long long)seed);
            f = fopen(path, "wb");
            CHECK(f != NULL);
            if (f) {
                fputc(t, f);
                fwrite(env.body, 1, env.body_len, f);
                fclose(f);
            }
            test_sample_free(&s);
        }
    }
    sh__buf_fini(&b);
}

/* An embedding sequence's pooled part in STEP_DONE (step_out.embd, what a worker's last stage
 * sends the front's batcher): the numbers come back bit for bit beside a sampled sequence
 * without one. */
static void test_step_out_embd(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_error e = {0};
    sh_msg_env env;
    sh_proto_body body;
    float part[576];
    for (int i = 0; i < 576; i++)
        part[i] = (float)(i - 288) * 0.37f + 1e-7f * (float)i;
    sh_proto_step_out outs[2] = {
        {.seq = 21, .token = -1, .embd = {part, 576}},
        {.seq = 22, .token = 7, .logprob = -0.5f},
    };
    sh_proto_step_done d = {.step = 5, .seqs = {outs, 2}};
    sh_msg_hdr h = {.type = SH_MSG_STEP_DONE,
                    .session = 5,
                    .src = sh_addr_make(3, 2),
                    .dst = sh_addr_make(1, 3)};
    CHECK_OK(sh__proto_encode_step_done(&b, &h, &d, &e));
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    const sh_proto_step_done *g = &body.step_done;
    CHECK_UINT_EQ(g->seqs.n, 2);
    CHECK_UINT_EQ(g->seqs.v[0].embd.n, 576);
    for (uint32_t i = 0; i < 576; i++)
        CHECK(sh_f32s_at(g->seqs.v[0].embd, i) == part[i]);
    CHECK_UINT_EQ(g->seqs.v[1].embd.n, 0);
    CHECK_INT_EQ(g->seqs.v[1].token, 7);
    sh__buf_fini(&b);
}

/* sh__proto_peek_u64s, which a stage's loop thread uses to note a STEP's or ACT's epoch before
 * its worker decodes it: the step id and epoch of a STEP and of an ACT (keys after a list and a
 * tensor), a STEP without an epoch (only "step" found), a key whose value is no unsigned integer,
 * and a cut or non-map body (nothing found, nothing read past the end). */
static void test_peek_u64s(void)
{
    static const char *const keys[2] = {"step", "ep"};
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    sh_error e = {0};
    sh_msg_env env;
    int32_t toks[3] = {5, 6, 7}, blocks[1] = {2};
    sh_proto_step_seq q = {.seq = 4, .tokens = {toks, 3}, .blocks = {blocks, 1}};
    sh_proto_step st = {.step = 70, .seqs = {&q, 1}, .epoch = 69, .retry_of = 68};
    sh_msg_hdr h = {.type = SH_MSG_STEP, .src = sh_addr_make(1, 5), .dst = sh_addr_make(2, 2)};
    CHECK_OK(sh__proto_encode_step(&b, &h, &st, &e));
    CHECK_OK(sh__msg_decode(&c, b.data, b.len, &env, &e));
    uint64_t v[2] = {0, 0};
    CHECK_UINT_EQ(sh__proto_peek_u64s(env.body, env.body_len, keys, 2, v), 3);
    CHECK_UINT_EQ(v[0], 70);
    CHECK_UINT_EQ(v[1], 69);
    /* Cut inside "seqs": the step id before it is found, the epoch after it is not. */
    CHECK_UINT_EQ(sh__proto_peek_u64s(env.body, 20, keys, 2, v), 1);
    CHECK_UINT_EQ(sh__proto_peek_u64s(env.body, 0, keys, 2, v), 0);
    static const uint8_t not_map[] = {0x93, 0x01, 0x02, 0x03},
                         str_ep[] = {0x81, 0xa2, 'e', 'p', 0xa1, 'x'};
    CHECK_UINT_EQ(sh__proto_peek_u64s(not_map, sizeof not_map, keys, 2, v), 0);
    CHECK_UINT_EQ(sh__proto_peek_u64s(str_ep, sizeof str_ep, keys, 2, v), 0);
    /* {"step": 5, "seqs": []}: an older batcher's STEP, without an epoch. */
    static const uint8_t old_step[] = {0x82, 0xa4, 's', 't', 'e', 'p', 0x05,
                                       0xa4, 's',  'e', 'q', 's', 0x90};
    CHECK_UINT_EQ(sh__proto_peek_u64s(old_step, sizeof old_step, keys, 2, v), 1);
    CHECK_UINT_EQ(v[0], 5);
    float hid[3 * 4] = {0};
    sh_proto_act a = {.step = 71,
                      .seqs = {&q, 1},
                      .hidden = {.dtype = SH_PROTO_DTYPE_F32,
                                 .ndim = 2,
                                 .shape = {3, 4},
                                 .data = hid,
                                 .nbytes = sizeof hid},
                      .reply_to = sh_addr_make(1, 5),
                      .epoch = 71};
    h.type = SH_MSG_ACT;
    sh__buf_reset(&b);
    CHECK_OK(sh__proto_encode_act(&b, &h, &a, &e));
    CHECK_OK(sh__msg_decode(&c, b.data, b.len, &env, &e));
    v[0] = v[1] = 0;
    CHECK_UINT_EQ(sh__proto_peek_u64s(env.body, env.body_len, keys, 2, v), 3);
    CHECK_UINT_EQ(v[0], 71);
    CHECK_UINT_EQ(v[1], 71);
    sh__buf_fini(&b);
}

/* A sequence's own failure in STEP_DONE (step_out.status and message) and a grammar named by its
 * hash in STEP (step_seq.gram_hash, n_gen): our round trip, an older peer's frame without them
 * (msgpack-c, keys absent: they decode as 0 and empty), and the status's bound. */
static void test_step_out_status(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_error e = {0};
    sh_msg_env env;
    sh_proto_body body;
    static const char why[] = "grammar limit hit after 12 generated tokens (grammar: the "
                              "grammar's parse stacks passed their bound)";
    sh_proto_step_out outs[3] = {
        {.seq = 11, .token = 42, .logprob = -0.5f, .logprob_raw = -0.25f},
        {.seq = 12, .token = -1, .status = SH_ERANGE, .message = {why, sizeof why - 1}},
        {.seq = 13, .token = -1, .status = SH_ENOTFOUND, .message = {"no matcher", 10}},
    };
    sh_proto_step_done d = {.step = 99, .seqs = {outs, 3}};
    sh_msg_hdr h = {.type = SH_MSG_STEP_DONE,
                    .session = 99,
                    .src = sh_addr_make(2, 1),
                    .dst = sh_addr_make(1, 3)};
    CHECK_OK(sh__proto_encode_step_done(&b, &h, &d, &e));
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    const sh_proto_step_done *g = &body.step_done;
    CHECK_UINT_EQ(g->seqs.n, 3);
    CHECK_INT_EQ(g->status, 0); /* the step itself did not fail */
    CHECK_INT_EQ(g->seqs.v[0].status, 0);
    CHECK_UINT_EQ(g->seqs.v[0].message.len, 0);
    CHECK_INT_EQ(g->seqs.v[0].token, 42);
    CHECK_INT_EQ(g->seqs.v[1].status, SH_ERANGE);
    CHECK_INT_EQ(g->seqs.v[1].token, -1);
    CHECK_UINT_EQ(g->seqs.v[1].message.len, sizeof why - 1);
    CHECK(memcmp(g->seqs.v[1].message.ptr, why, sizeof why - 1) == 0);
    CHECK_INT_EQ(g->seqs.v[2].status, SH_ENOTFOUND);
    CHECK_UINT_EQ(g->seqs.v[2].seq, 13);

    /* An older stage's STEP_DONE: step_out without "st" and "msg". */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    pk_envelope(&pk, SH_MSG_STEP_DONE);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "step");
    msgpack_pack_uint64(&pk, 1234567);
    pk_str(&pk, "seqs");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 4);
    pk_str(&pk, "id");
    msgpack_pack_uint64(&pk, 5);
    pk_str(&pk, "tok");
    msgpack_pack_int32(&pk, 17);
    pk_str(&pk, "lp");
    msgpack_pack_float(&pk, -1.0f);
    pk_str(&pk, "lp_raw");
    msgpack_pack_float(&pk, -1.0f);
    sh__proto_arena_reset(&a);
    CHECK_OK(sh__proto_decode(&c, sb.data, sb.size, &env, &body, &a, &e));
    CHECK_UINT_EQ(body.step_done.seqs.n, 1);
    CHECK_INT_EQ(body.step_done.seqs.v[0].token, 17);
    CHECK_INT_EQ(body.step_done.seqs.v[0].status, 0);
    CHECK_UINT_EQ(body.step_done.seqs.v[0].message.len, 0);
    CHECK_UINT_EQ(body.step_done.seqs.v[0].embd.n, 0); /* no "emb": no embedding part */

    /* A status past 255 is refused, in either direction. */
    outs[1].status = 300;
    sh__buf_reset(&b);
    CHECK(sh__proto_encode_step_done(&b, &h, &d, &e) == SH_EINVAL);
    msgpack_sbuffer_clear(&sb);
    pk_envelope(&pk, SH_MSG_STEP_DONE);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "step");
    msgpack_pack_uint64(&pk, 1234567);
    pk_str(&pk, "seqs");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 5);
    pk_str(&pk, "id");
    msgpack_pack_uint64(&pk, 5);
    pk_str(&pk, "tok");
    msgpack_pack_int32(&pk, -1);
    pk_str(&pk, "lp");
    msgpack_pack_float(&pk, 0.0f);
    pk_str(&pk, "lp_raw");
    msgpack_pack_float(&pk, 0.0f);
    pk_str(&pk, "st");
    msgpack_pack_int32(&pk, 300);
    expect(&c, sb.data, sb.size, SH_EPROTO, SH_MSG_REJECT_RANGE, "status 300");

    /* A STEP naming its grammar by hash: the text absent, the hash and count kept. */
    static const int32_t tok[] = {7}, blk[] = {0};
    sh_proto_step_seq q = {
        .seq = 21,
        .tokens = {tok, 1},
        .pos = 30,
        .blocks = {blk, 1},
        .sample = true,
        .sampling = {.temperature = 1.0f, .repeat_penalty = 1.0f, .max_tokens = 8},
        .gram_hash = 0x0123456789abcdefull,
        .n_gen = 12};
    sh_proto_step st = {.step = 5, .seqs = {&q, 1}};
    h.type = SH_MSG_STEP;
    sh__buf_reset(&b);
    CHECK_OK(sh__proto_encode_step(&b, &h, &st, &e));
    sh__proto_arena_reset(&a);
    CHECK_OK(sh__proto_decode(&c, b.data, b.len, &env, &body, &a, &e));
    CHECK_UINT_EQ(body.step.seqs.v[0].gram_hash, 0x0123456789abcdefull);
    CHECK_UINT_EQ(body.step.seqs.v[0].n_gen, 12);
    CHECK_UINT_EQ(body.step.seqs.v[0].sampling.grammar.len, 0);
    CHECK_UINT_EQ(body.step.seqs.v[0].gen.n, 0);
    msgpack_sbuffer_destroy(&sb);
    sh__buf_fini(&b);
}

static const sh_test_case tests[] = {
    {"round_trip", test_round_trip},
    {"values_and_zero_copy", test_values_and_zero_copy},
    {"msgpack_c_interop", test_msgpack_c_interop},
    {"missing_fields", test_missing_fields},
    {"wrong_types", test_wrong_types},
    {"unknown_and_duplicate_keys", test_unknown_and_duplicate_keys},
    {"bounds", test_bounds},
    {"depth_and_floats", test_depth_and_floats},
    {"tensors", test_tensors},
    {"arena", test_arena},
    {"encoder_validation", test_encoder_validation},
    {"error_reply", test_error_reply},
    {"step_out_status", test_step_out_status},
    {"step_out_embd", test_step_out_embd},
    {"peek_u64s", test_peek_u64s},
    {"write_corpus", test_write_corpus},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
