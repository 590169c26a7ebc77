/* The envelope codec: [magic, version, type, session, src, dst, trace_id, body] as msgpack. */
#include "runtime/msg.h"

#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "base/version.h"
#include "runtime/crc32c.h"
#include "runtime/mpack_read.h"
#include "shoal/version.h"

#define ENVELOPE_FIELDS 8

void sh__msg_codec_init(sh_msg_codec *c)
{
    memset(c, 0, sizeof *c);
    c->max_frame = SH_MSG_MAX_FRAME_DEFAULT;
    c->max_depth = SH_MSG_MAX_DEPTH_DEFAULT;
}

int sh__msg_type_known(uint64_t t)
{
    switch (t) {
#define CASE_(NAME, id, body) case id:
        SH_PROTO_MESSAGES(CASE_)
#undef CASE_
        return 1;
    default:
        return 0;
    }
}

const char *sh__msg_type_name(uint64_t t)
{
    switch (t) {
#define CASE_(NAME, id, body)                                                                      \
    case id:                                                                                       \
        return #NAME;
        SH_PROTO_MESSAGES(CASE_)
#undef CASE_
    default:
        return "?";
    }
}

const char *sh__msg_reject_name(sh_msg_reject r)
{
    static const char *const names[SH_MSG_REJECT_COUNT_] = {
        [SH_MSG_REJECT_TRUNCATED] = "truncated", [SH_MSG_REJECT_SYNTAX] = "syntax",
        [SH_MSG_REJECT_OVERSIZE] = "oversize",   [SH_MSG_REJECT_DEPTH] = "depth",
        [SH_MSG_REJECT_TRAILING] = "trailing",   [SH_MSG_REJECT_ENVELOPE] = "envelope",
        [SH_MSG_REJECT_MAGIC] = "magic",         [SH_MSG_REJECT_VERSION] = "version",
        [SH_MSG_REJECT_TYPE] = "type",           [SH_MSG_REJECT_FIELD_TYPE] = "field_type",
        [SH_MSG_REJECT_MISSING] = "missing",     [SH_MSG_REJECT_DUPLICATE] = "duplicate",
        [SH_MSG_REJECT_RANGE] = "range",         [SH_MSG_REJECT_SHAPE] = "shape",
        [SH_MSG_REJECT_ARENA] = "arena",         [SH_MSG_REJECT_CHECKSUM] = "checksum",
    };
    return (unsigned)r < SH_MSG_REJECT_COUNT_ ? names[r] : "?";
}

void sh__msg_count_reject(sh_msg_codec *c, sh_msg_reject why)
{
    if ((unsigned)why < SH_MSG_REJECT_COUNT_)
        c->stats.rejected[why]++;
}

void sh__msg_put_header(sh_buf *b, const sh_msg_hdr *h)
{
    sh__mpack_put_array(b, ENVELOPE_FIELDS);
    sh__mpack_put_uint(b, SH_PROTO_MAGIC);
    sh__mpack_put_uint(b, sh__version_proto());
    sh__mpack_put_uint(b, (uint64_t)h->type);
    sh__mpack_put_uint(b, h->session);
    sh__mpack_put_uint(b, h->src);
    sh__mpack_put_uint(b, h->dst);
    sh__mpack_put_uint(b, h->trace_id);
}

sh_err sh__msg_encode_raw(sh_buf *b, const sh_msg_hdr *h, const void *body, size_t body_len,
                          sh_error *e)
{
    if (!sh__msg_type_known((uint64_t)h->type))
        return sh__error_set(e, SH_EINVAL, "unknown message type %d", (int)h->type);
    size_t start = b->len;
    sh__msg_put_header(b, h);
    uint8_t *p = sh__buf_append(b, body_len);
    if (p && body_len)
        memcpy(p, body, body_len);
    if (b->failed) {
        sh__buf_truncate(b, start);
        return b->fixed
                   ? sh__error_set(e, SH_ERANGE, "frame does not fit the %zu-byte buffer", b->cap)
                   : sh__error_set(e, SH_ENOMEM, "cannot grow the frame buffer");
    }
    return SH_OK;
}

/* Counts the rejection and returns the code; the message is already in e. */
static sh_err reject(sh_msg_codec *c, sh_msg_reject why, sh_err code)
{
    sh__msg_count_reject(c, why);
    return code;
}

sh_msg_reject sh__msg_reject_from_mpack(int fail)
{
    switch (fail) {
    case SH_MPACK_FAIL_INVALID:
        return SH_MSG_REJECT_SYNTAX;
    case SH_MPACK_FAIL_DEPTH:
        return SH_MSG_REJECT_DEPTH;
    default:
        return SH_MSG_REJECT_TRUNCATED;
    }
}

static sh_msg_reject reader_reason(const sh_mpack_reader *r)
{
    return sh__msg_reject_from_mpack((int)r->fail);
}

static const char *const field_names[ENVELOPE_FIELDS] = {
    "magic", "proto_version", "type", "session", "src", "dst", "trace_id", "body"};

sh_err sh__msg_decode(sh_msg_codec *c, const void *frame, size_t len, sh_msg_env *env, sh_error *e)
{
    memset(env, 0, sizeof *env);
    if (len > c->max_frame) {
        sh__error_set(e, SH_EFORMAT, "frame of %zu bytes exceeds the limit of %zu", len,
                      c->max_frame);
        return reject(c, SH_MSG_REJECT_OVERSIZE, SH_EFORMAT);
    }
    sh_mpack_reader r;
    sh__mpack_reader_init(&r, frame, len, c->max_depth);
    sh_mpack_item it;
    if (sh__mpack_next(&r, &it, e))
        return reject(c, reader_reason(&r), SH_EFORMAT);
    if (it.kind != SH_MPACK_ARRAY || it.len != ENVELOPE_FIELDS) {
        if (it.kind == SH_MPACK_ARRAY)
            sh__error_set(e, SH_EFORMAT, "envelope: expected an array of %d, got %u elements",
                          ENVELOPE_FIELDS, it.len);
        else
            sh__error_set(e, SH_EFORMAT, "envelope: expected an array, got %s",
                          sh__mpack_kind_name(it.kind));
        return reject(c, SH_MSG_REJECT_ENVELOPE, SH_EFORMAT);
    }
    uint64_t v[ENVELOPE_FIELDS - 1];
    for (int i = 0; i < ENVELOPE_FIELDS - 1; i++) {
        size_t off = sh__mpack_offset(&r);
        if (sh__mpack_next(&r, &it, e))
            return reject(c, reader_reason(&r), SH_EFORMAT);
        if (it.kind != SH_MPACK_UINT) {
            sh__error_set(e, SH_EFORMAT, "envelope %s at offset %zu: expected uint, got %s",
                          field_names[i], off, sh__mpack_kind_name(it.kind));
            return reject(c, SH_MSG_REJECT_ENVELOPE, SH_EFORMAT);
        }
        v[i] = it.v.u;
        /* Check identity fields as soon as they are read, so that a foreign frame is named as
         * such rather than by whatever breaks first further on. */
        if (i == 0 && v[0] != SH_PROTO_MAGIC) {
            sh__error_set(e, SH_EFORMAT, "bad magic 0x%llx (expected 0x%x)",
                          (unsigned long long)v[0], SH_PROTO_MAGIC);
            return reject(c, SH_MSG_REJECT_MAGIC, SH_EFORMAT);
        }
        if (i == 1 && v[1] != sh__version_proto()) {
            sh__error_set(e, SH_EPROTO, "protocol version %llu not supported (this node speaks %u)",
                          (unsigned long long)v[1], (unsigned)sh__version_proto());
            return reject(c, SH_MSG_REJECT_VERSION, SH_EPROTO);
        }
        if (i == 2 && !sh__msg_type_known(v[2])) {
            sh__error_set(e, SH_EPROTO, "unknown message type %llu", (unsigned long long)v[2]);
            return reject(c, SH_MSG_REJECT_TYPE, SH_EPROTO);
        }
        switch (i) {
        case 2:
            env->hdr.type = (sh_msg_type)v[2];
            break;
        case 3:
            env->hdr.session = v[3];
            break;
        case 4:
            env->hdr.src = v[4];
            break;
        case 5:
            env->hdr.dst = v[5];
            break;
        case 6:
            env->hdr.trace_id = v[6];
            break;
        default:
            break;
        }
        env->n_fields = (uint32_t)i + 1;
    }

    /* The body: a map, walked whole so that its extent is known and every length and the depth
     * are checked once here; the body decoder then trusts only that much. */
    const uint8_t *body = r.p;
    sh_mpack_reader peek = r;
    if (sh__mpack_next(&peek, &it, e))
        return reject(c, reader_reason(&peek), SH_EFORMAT);
    if (it.kind != SH_MPACK_MAP) {
        sh__error_set(e, SH_EFORMAT, "envelope body at offset %zu: expected map, got %s",
                      sh__mpack_offset(&r), sh__mpack_kind_name(it.kind));
        return reject(c, SH_MSG_REJECT_ENVELOPE, SH_EFORMAT);
    }
    if (sh__mpack_skip(&r, 2, e))
        return reject(c, reader_reason(&r), SH_EFORMAT);
    if (r.p != r.end) {
        sh__error_set(e, SH_EFORMAT, "%zu trailing bytes after the envelope at offset %zu",
                      sh__mpack_left(&r), sh__mpack_offset(&r));
        return reject(c, SH_MSG_REJECT_TRAILING, SH_EFORMAT);
    }
    env->body = body;
    env->body_len = (size_t)(r.p - body);
    env->n_fields = ENVELOPE_FIELDS;
    c->stats.frames_ok++;
    c->stats.ok_by_type[env->hdr.type]++;
    return SH_OK;
}

uint64_t sh__msg_peek_foreign(const void *frame, size_t len, sh_msg_env *env)
{
    sh_mpack_reader r;
    sh__mpack_reader_init(&r, frame, len, 2);
    sh_mpack_item it;
    if (sh__mpack_next(&r, &it, NULL) || it.kind != SH_MPACK_ARRAY || it.len < 6)
        return 0;
    uint64_t v[6];
    for (int i = 0; i < 6; i++) {
        if (sh__mpack_next(&r, &it, NULL) || it.kind != SH_MPACK_UINT)
            return 0;
        v[i] = it.v.u;
    }
    if (v[0] != SH_PROTO_MAGIC || v[1] == sh__version_proto() || v[1] == 0)
        return 0;
    memset(env, 0, sizeof *env);
    env->hdr.type = sh__msg_type_known(v[2]) ? (sh_msg_type)v[2] : SH_MSG_ERROR;
    env->hdr.session = v[3];
    env->hdr.src = v[4];
    env->hdr.dst = v[5];
    env->n_fields = 6;
    return v[1];
}

uint32_t sh__msg_foreign_note(const void *frame, size_t len, char *text, size_t cap)
{
    sh_msg_env env;
    uint64_t v = sh__msg_peek_foreign(frame, len, &env);
    if (!v || sh_addr_node(env.hdr.src) == 0)
        return 0;
    snprintf(text, cap, "peer speaks protocol %llu, this build speaks %u", (unsigned long long)v,
             (unsigned)sh__version_proto());
    return sh_addr_node(env.hdr.src);
}

void sh__msg_seal(uint8_t *frame, size_t len)
{
    uint32_t crc = sh__crc32c(0, frame, len);
    uint8_t *t = frame + len;
    t[0] = (uint8_t)crc;
    t[1] = (uint8_t)(crc >> 8);
    t[2] = (uint8_t)(crc >> 16);
    t[3] = (uint8_t)(crc >> 24);
}

sh_err sh__msg_unseal(sh_msg_codec *c, const void *frame, size_t len, size_t *inner_len,
                      sh_error *e)
{
    if (len < SH_MSG_SEAL_BYTES) {
        sh__error_set(e, SH_EFORMAT, "frame of %zu bytes is shorter than its checksum", len);
        return reject(c, SH_MSG_REJECT_CHECKSUM, SH_EFORMAT);
    }
    size_t n = len - SH_MSG_SEAL_BYTES;
    const uint8_t *t = (const uint8_t *)frame + n;
    uint32_t want =
        (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
    uint32_t got = sh__crc32c(0, frame, n);
    if (got != want) {
        sh__error_set(e, SH_EFORMAT,
                      "checksum mismatch: the %zu-byte frame carries 0x%08x, its "
                      "bytes give 0x%08x",
                      len, (unsigned)want, (unsigned)got);
        return reject(c, SH_MSG_REJECT_CHECKSUM, SH_EFORMAT);
    }
    *inner_len = n;
    return SH_OK;
}

int sh__msg_foreign_unsealed(const void *frame, size_t len)
{
    sh_msg_env env;
    if (!sh__msg_peek_foreign(frame, len, &env))
        return 0;
    sh_mpack_reader r;
    sh__mpack_reader_init(&r, frame, len, SH_MSG_MAX_DEPTH_DEFAULT);
    return sh__mpack_skip(&r, 1, NULL) == SH_OK && r.p == r.end;
}
