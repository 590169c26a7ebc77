/* The body codec's descriptors (generated from proto_table.h), cross-field rules and encoder. */
#include "runtime/proto.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include "base/error.h"
#include "runtime/proto_desc.h"

size_t sh__proto_dtype_size(uint32_t dtype)
{
    switch (dtype) {
    case SH_PROTO_DTYPE_F32:
        return 4;
    case SH_PROTO_DTYPE_F16:
        return 2;
    case SH_PROTO_DTYPE_BF16:
        return 2;
    case SH_PROTO_DTYPE_I8:
        return 1;
    default:
        return 0;
    }
}

bool sh__proto_tensor_bytes(uint32_t dtype, uint32_t ndim, const uint64_t *shape, uint64_t *out)
{
    uint64_t n = sh__proto_dtype_size(dtype);
    if (!n || ndim < 1 || ndim > SH_PROTO_MAX_DIMS)
        return false;
    for (uint32_t i = 0; i < ndim; i++) {
        if (shape[i] < 1 || shape[i] > UINT32_MAX || n > UINT32_MAX / shape[i])
            return false;
        n *= shape[i];
    }
    *out = n;
    return true;
}

/* Cross-field rules. */

static bool check_step_out(const void *p, sh_msg_reject *why, sh_error *e)
{
    const sh_proto_step_out *s = p;
    if (s->top_tokens.n == s->top_logprobs.n)
        return true;
    *why = SH_MSG_REJECT_SHAPE;
    sh__error_set(e, SH_EPROTO, "%u top tokens but %u top logprobs", s->top_tokens.n,
                  s->top_logprobs.n);
    return false;
}

static bool check_histogram(const void *p, sh_msg_reject *why, sh_error *e)
{
    const sh_proto_histogram *h = p;
    if (h->counts.n == h->bounds.n + 1)
        return true;
    *why = SH_MSG_REJECT_SHAPE;
    sh__error_set(e, SH_EPROTO, "%u bucket counts for %u bounds (needs bounds + 1)", h->counts.n,
                  h->bounds.n);
    return false;
}

static bool check_token(const void *p, sh_msg_reject *why, sh_error *e)
{
    const sh_proto_token *t = p;
    uint64_t top = (uint64_t)t->tokens.n * t->top_n;
    *why = SH_MSG_REJECT_SHAPE;
    if (t->logprobs.n != 0 && t->logprobs.n != t->tokens.n) {
        sh__error_set(e, SH_EPROTO, "%u logprobs for %u tokens", t->logprobs.n, t->tokens.n);
        return false;
    }
    if (t->top_tokens.n != top || t->top_logprobs.n != top) {
        sh__error_set(e, SH_EPROTO, "%u top tokens and %u top logprobs for %u tokens x top_n %u",
                      t->top_tokens.n, t->top_logprobs.n, t->tokens.n, (unsigned)t->top_n);
        return false;
    }
    return true;
}

static bool check_act(const void *p, sh_msg_reject *why, sh_error *e)
{
    const sh_proto_act *a = p;
    uint64_t rows = 0;
    for (uint32_t i = 0; i < a->seqs.n; i++)
        rows += a->seqs.v[i].tokens.n;
    *why = SH_MSG_REJECT_SHAPE;
    if (a->hidden.ndim != 2) {
        sh__error_set(e, SH_EPROTO, "hidden: expected 2 dimensions (tokens, d_model), got %u",
                      a->hidden.ndim);
        return false;
    }
    if (a->hidden.shape[0] != rows) {
        sh__error_set(e, SH_EPROTO, "hidden: %llu rows for %llu tokens in the sequences",
                      (unsigned long long)a->hidden.shape[0], (unsigned long long)rows);
        return false;
    }
    uint64_t want = a->hidden.dtype == SH_PROTO_DTYPE_I8 ? rows : 0;
    if (a->scales.n != want) {
        sh__error_set(e, SH_EPROTO,
                      "hidden: %u row scales for %llu rows of dtype %u (I8 has one "
                      "per row, other dtypes none)",
                      a->scales.n, (unsigned long long)rows, a->hidden.dtype);
        return false;
    }
    return true;
}

/* The descriptors, generated from the table. */
#define SUB_BOOL(s) NULL
#define SUB_U8(s) NULL
#define SUB_U32(s) NULL
#define SUB_U64(s) NULL
#define SUB_ADDR(s) NULL
#define SUB_I32(s) NULL
#define SUB_I64(s) NULL
#define SUB_F32(s) NULL
#define SUB_F64(s) NULL
#define SUB_STR(s) NULL
#define SUB_I32S(s) NULL
#define SUB_F32S(s) NULL
#define SUB_U64S(s) NULL
#define SUB_F64S(s) NULL
#define SUB_STRS(s) NULL
#define SUB_TENSOR(s) NULL
#define SUB_STRUCT(s) &desc_##s
#define SUB_LIST(s) &desc_##s
#define REQ_REQ 1
#define REQ_OPT 0
#define CHECK_0(name) NULL
#define CHECK_1(name) check_##name
#define FIELD_(S, m, key, kind, sub, req, lo, hi)                                                  \
    {key, #m, SH_PROTO_KIND_##kind, REQ_##req, (uint32_t)offsetof(S, m), SUB_##kind(sub), lo, hi},
#define DESC_(name, chk)                                                                           \
    static const sh_proto_field fields_##name[] = {                                                \
        SH_PROTO_FIELDS_##name(FIELD_, sh_proto_##name)};                                          \
    _Static_assert(sizeof fields_##name / sizeof(sh_proto_field) <= 64,                            \
                   #name " has over 64 fields");                                                   \
    static const sh_proto_desc desc_##name = {#name, sizeof(sh_proto_##name), fields_##name,       \
                                              sizeof fields_##name / sizeof(sh_proto_field),       \
                                              CHECK_##chk(name)};
SH_PROTO_STRUCTS(DESC_)

const sh_proto_desc *sh__proto_body_desc(uint64_t type)
{
    switch (type) {
#define CASE_(NAME, id, body)                                                                      \
    case id:                                                                                       \
        return &desc_##body;
        SH_PROTO_MESSAGES(CASE_)
#undef CASE_
    default:
        return NULL;
    }
}

size_t sh__proto_arena_bound(size_t body_len)
{
    static const size_t sizes[] = {
#define SIZE_(name, chk) sizeof(sh_proto_##name),
        SH_PROTO_STRUCTS(SIZE_)
#undef SIZE_
            sizeof(sh_strv)};
    size_t m = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        m = sizes[i] > m ? sizes[i] : m;
    return body_len * (m + _Alignof(max_align_t));
}

/* ------------------------------------------------------------------------------------------ */
/* Encoding: the same descriptors, the same bounds, so the encoder refuses what the decoder
 * would. */

static sh_err invalid(sh_error *e, const char *fmt, ...) SH_PRINTF(2, 3);
static sh_err invalid(sh_error *e, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        e->code = SH_EINVAL;
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return SH_EINVAL;
}

static sh_err enc_count(const sh_proto_field *f, uint64_t n, const void *ptr, sh_error *e)
{
    if (n > INT64_MAX || !sh__proto_in_bounds(f, (int64_t)n))
        return invalid(e, "count %llu outside [%lld, %lld]", (unsigned long long)n,
                       (long long)f->lo, (long long)f->hi);
    if (n && !ptr)
        return invalid(e, "NULL data for %llu entries", (unsigned long long)n);
    return SH_OK;
}

static sh_err encode_struct(sh_buf *b, const sh_proto_desc *s, const uint8_t *in, sh_error *e);

static sh_err encode_tensor(sh_buf *b, const sh_proto_tensor *t, sh_error *e)
{
    uint64_t nbytes;
    if (!sh__proto_tensor_bytes(t->dtype, t->ndim, t->shape, &nbytes))
        return invalid(e, "dtype %u with %u dimensions cannot travel", t->dtype, t->ndim);
    if (t->data && t->nbytes != nbytes)
        return invalid(e, "%llu data bytes, shape and dtype need %llu",
                       (unsigned long long)t->nbytes, (unsigned long long)nbytes);
    sh__mpack_put_map(b, t->data ? 3 : 2);
    sh__mpack_put_str(b, "dt", 2);
    sh__mpack_put_uint(b, t->dtype);
    sh__mpack_put_str(b, "sh", 2);
    sh__mpack_put_array(b, t->ndim);
    for (uint32_t i = 0; i < t->ndim; i++)
        sh__mpack_put_uint(b, t->shape[i]);
    if (t->data) {
        sh__mpack_put_str(b, "d", 1);
        sh__mpack_put_bin(b, t->data, nbytes);
    }
    return SH_OK;
}

static sh_err encode_field(sh_buf *b, const sh_proto_field *f, const uint8_t *src, sh_error *e)
{
    switch (f->kind) {
    case SH_PROTO_KIND_BOOL: {
        bool v;
        memcpy(&v, src, sizeof v);
        sh__mpack_put_bool(b, v);
        return SH_OK;
    }
    case SH_PROTO_KIND_U8:
    case SH_PROTO_KIND_U32:
    case SH_PROTO_KIND_U64:
    case SH_PROTO_KIND_ADDR: {
        uint64_t v = 0;
        if (f->kind == SH_PROTO_KIND_U8) {
            uint8_t x;
            memcpy(&x, src, 1);
            v = x;
        } else if (f->kind == SH_PROTO_KIND_U32) {
            uint32_t x;
            memcpy(&x, src, 4);
            v = x;
        } else {
            memcpy(&v, src, 8);
        }
        if ((f->lo || f->hi) && (v < (uint64_t)f->lo || v > (uint64_t)f->hi))
            return invalid(e, "value %llu outside [%lld, %lld]", (unsigned long long)v,
                           (long long)f->lo, (long long)f->hi);
        sh__mpack_put_uint(b, v);
        return SH_OK;
    }
    case SH_PROTO_KIND_I32:
    case SH_PROTO_KIND_I64: {
        int64_t v;
        if (f->kind == SH_PROTO_KIND_I32) {
            int32_t x;
            memcpy(&x, src, 4);
            v = x;
        } else {
            memcpy(&v, src, 8);
        }
        if (!sh__proto_in_bounds(f, v))
            return invalid(e, "value %lld outside [%lld, %lld]", (long long)v, (long long)f->lo,
                           (long long)f->hi);
        sh__mpack_put_int(b, v);
        return SH_OK;
    }
    case SH_PROTO_KIND_F32: {
        float v;
        memcpy(&v, src, 4);
        sh__mpack_put_f32(b, v);
        return SH_OK;
    }
    case SH_PROTO_KIND_F64: {
        double v;
        memcpy(&v, src, 8);
        sh__mpack_put_f64(b, v);
        return SH_OK;
    }
    case SH_PROTO_KIND_STR: {
        sh_strv s;
        memcpy(&s, src, sizeof s);
        sh_err err = enc_count(f, s.len, s.ptr, e);
        if (!err)
            sh__mpack_put_str(b, s.ptr, s.len);
        return err;
    }
    case SH_PROTO_KIND_STRS: {
        sh_strv_list l;
        memcpy(&l, src, sizeof l);
        sh_err err = enc_count(f, l.n, l.v, e);
        if (err)
            return err;
        sh__mpack_put_array(b, l.n);
        for (uint32_t i = 0; i < l.n; i++) {
            if (l.v[i].len > SH_PROTO_MAX_STR_ITEM || (l.v[i].len && !l.v[i].ptr))
                return invalid(e, "entry %u: %u bytes (at most %d, not NULL)", i, l.v[i].len,
                               SH_PROTO_MAX_STR_ITEM);
            sh__mpack_put_str(b, l.v[i].ptr, l.v[i].len);
        }
        return SH_OK;
    }
    case SH_PROTO_KIND_TENSOR:
        return encode_tensor(b, (const sh_proto_tensor *)(const void *)src, e);
    case SH_PROTO_KIND_STRUCT:
        return encode_struct(b, f->sub, src, e);
    case SH_PROTO_KIND_LIST: {
        sh_proto_sampling_list l; /* every list type shares this layout */
        memcpy(&l, src, sizeof l);
        sh_err err = enc_count(f, l.n, l.v, e);
        if (err)
            return err;
        sh__mpack_put_array(b, l.n);
        for (uint32_t i = 0; i < l.n; i++) {
            const uint8_t *el = (const uint8_t *)l.v + (size_t)i * f->sub->size;
            if ((err = encode_struct(b, f->sub, el, e))) {
                char where[32];
                snprintf(where, sizeof where, "[%u]", i);
                sh__error_prefix(e, where);
                return err;
            }
        }
        return SH_OK;
    }
    default: { /* the packed views */
        size_t esz = f->kind == SH_PROTO_KIND_U64S || f->kind == SH_PROTO_KIND_F64S ? 8 : 4;
        sh_i32s v;
        memcpy(&v, src, sizeof v);
        sh_err err = enc_count(f, v.n, v.ptr, e);
        if (!err)
            sh__mpack_put_bin(b, v.ptr, (size_t)v.n * esz);
        return err;
    }
    }
}

static sh_err encode_struct(sh_buf *b, const sh_proto_desc *s, const uint8_t *in, sh_error *e)
{
    sh_msg_reject why;
    if (s->check && !s->check(in, &why, e)) {
        if (e)
            e->code = SH_EINVAL;
        return SH_EINVAL;
    }
    sh__mpack_put_map(b, s->n_fields);
    for (uint32_t i = 0; i < s->n_fields; i++) {
        const sh_proto_field *f = &s->fields[i];
        sh__mpack_put_str(b, f->key, strlen(f->key));
        sh_err err = encode_field(b, f, in + f->offset, e);
        if (err) {
            sh__error_prefix(e, f->name);
            return err;
        }
    }
    return SH_OK;
}

sh_err sh__proto_encode(sh_buf *b, const sh_msg_hdr *h, const void *body, sh_error *e)
{
    const sh_proto_desc *s = sh__proto_body_desc((uint64_t)h->type);
    if (!s)
        return invalid(e, "unknown message type %d", (int)h->type);
    size_t start = b->len;
    sh__msg_put_header(b, h);
    sh_err err = encode_struct(b, s, body, e);
    if (err) {
        sh__buf_truncate(b, start);
        sh__error_prefix(e, sh__msg_type_name((uint64_t)h->type));
        return err;
    }
    if (b->failed) {
        bool fixed = b->fixed;
        sh__buf_truncate(b, start);
        return fixed ? sh__error_set(e, SH_ERANGE, "%s frame does not fit the %zu-byte buffer",
                                     sh__msg_type_name((uint64_t)h->type), b->cap)
                     : sh__error_set(e, SH_ENOMEM, "cannot grow the frame buffer");
    }
    return SH_OK;
}

#define ENCODE_(NAME, id, body)                                                                    \
    sh_err sh__proto_encode_##body(sh_buf *b, const sh_msg_hdr *h, const sh_proto_##body *m,       \
                                   sh_error *e)                                                    \
    {                                                                                              \
        sh_msg_hdr t = *h;                                                                         \
        t.type = SH_MSG_##NAME;                                                                    \
        return sh__proto_encode(b, &t, m, e);                                                      \
    }
SH_PROTO_MESSAGES(ENCODE_)
#undef ENCODE_

sh_err sh__proto_encode_error_reply(sh_buf *b, const sh_msg_hdr *req, sh_err code,
                                    const char *message, sh_error *e)
{
    sh_msg_hdr h = {.type = SH_MSG_ERROR,
                    .session = req->session,
                    .src = req->dst,
                    .dst = req->src,
                    .trace_id = req->trace_id};
    size_t n = message ? strlen(message) : 0;
    sh_proto_error body = {
        .code = (int32_t)code,
        .message = {message, (uint32_t)(n > SH_PROTO_MAX_MSG ? SH_PROTO_MAX_MSG : n)},
        .type = sh__msg_type_known((uint64_t)req->type) ? (uint32_t)req->type : 0,
    };
    return sh__proto_encode(b, &h, &body, e);
}
