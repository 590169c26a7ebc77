/* The body decoder: one generic walk over the descriptors, zero-copy views, bounded arena. */
#include <float.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include "base/error.h"
#include "runtime/mpack_read.h"
#include "runtime/proto.h"
#include "runtime/proto_desc.h"

typedef struct dec {
    sh_mpack_reader r;
    sh_proto_arena *arena;
    sh_msg_reject why; /* the reason of the first failure */
    sh_error *e;
} dec;

static sh_err bad(dec *d, sh_msg_reject why, sh_err code, const char *fmt, ...) SH_PRINTF(4, 5);
static sh_err bad(dec *d, sh_msg_reject why, sh_err code, const char *fmt, ...)
{
    d->why = why;
    if (d->e) {
        va_list ap;
        va_start(ap, fmt);
        d->e->code = code;
        vsnprintf(d->e->msg, sizeof d->e->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

static sh_err next(dec *d, sh_mpack_item *it)
{
    sh_err err = sh__mpack_next(&d->r, it, d->e);
    if (err)
        d->why = sh__msg_reject_from_mpack((int)d->r.fail);
    return err;
}

static sh_err wrong_type(dec *d, const char *want, const sh_mpack_item *it, size_t off)
{
    return bad(d, SH_MSG_REJECT_FIELD_TYPE, SH_EPROTO, "expected %s, got %s at offset %zu", want,
               sh__mpack_kind_name(it->kind), off);
}

static sh_err too_deep(dec *d, size_t off)
{
    return bad(d, SH_MSG_REJECT_DEPTH, SH_EFORMAT, "container at offset %zu nested deeper than %u",
               off, d->r.max_depth);
}

static sh_err out_of_bounds(dec *d, const sh_proto_field *f, const char *what, long long v,
                            size_t off)
{
    return bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO, "%s %lld at offset %zu outside [%lld, %lld]",
               what, v, off, (long long)f->lo, (long long)f->hi);
}

/* n entries of `size` bytes from the arena, aligned for any type; NULL when they do not fit. */
static void *arena_alloc(sh_proto_arena *a, size_t n, size_t size)
{
    if (!a || !a->mem)
        return NULL;
    size_t align = _Alignof(max_align_t);
    size_t pad = (size_t)(-(uintptr_t)(a->mem + a->used)) & (align - 1);
    if (pad > a->cap - a->used || n > (a->cap - a->used - pad) / size)
        return NULL;
    void *p = a->mem + a->used + pad;
    a->used += pad + n * size;
    return p;
}

static sh_err decode_struct(dec *d, const sh_proto_desc *s, uint8_t *out, uint32_t depth);

/* Reads the next item, which must be a container of `kind` ("what" names it in the error) at
 * nesting depth `depth` within the reader's limit. */
static sh_err container(dec *d, int kind, const char *what, uint32_t depth, sh_mpack_item *it)
{
    size_t off = sh__mpack_offset(&d->r);
    sh_err err = next(d, it);
    if (err)
        return err;
    if ((int)it->kind != kind)
        return wrong_type(d, what, it, off);
    if (depth > d->r.max_depth)
        return too_deep(d, off);
    return SH_OK;
}

/* An array header for a LIST or STRS field at `depth`, with its count checked and its entries
 * allocated. */
static sh_err list_header(dec *d, const sh_proto_field *f, size_t elem, uint32_t depth, uint32_t *n,
                          void **v)
{
    size_t off = sh__mpack_offset(&d->r);
    sh_mpack_item it;
    sh_err err = container(d, SH_MPACK_ARRAY, "array", depth, &it);
    if (err)
        return err;
    if (!sh__proto_in_bounds(f, it.len))
        return out_of_bounds(d, f, "count", it.len, off);
    *n = it.len;
    *v = NULL;
    if (it.len == 0)
        return SH_OK;
    if (!(*v = arena_alloc(d->arena, it.len, elem)))
        return bad(d, SH_MSG_REJECT_ARENA, SH_ERANGE,
                   "%u entries of %zu bytes do not fit the decode arena (%zu of %zu bytes used)",
                   it.len, elem, d->arena ? d->arena->used : 0, d->arena ? d->arena->cap : 0);
    return SH_OK;
}

static sh_err decode_list(dec *d, const sh_proto_field *f, uint8_t *dst, uint32_t depth)
{
    uint32_t n;
    void *v;
    sh_err err = list_header(d, f, f->sub->size, depth, &n, &v);
    if (err) {
        sh__error_prefix(d->e, f->name);
        return err;
    }
    for (uint32_t i = 0; i < n; i++) {
        if ((err = decode_struct(d, f->sub, (uint8_t *)v + (size_t)i * f->sub->size, depth + 1))) {
            char where[64];
            snprintf(where, sizeof where, "%s[%u]", f->name, i);
            sh__error_prefix(d->e, where);
            return err;
        }
    }
    /* sh_proto_<sub>_list is {const T *v; uint32_t n;}; every list type shares that layout. */
    sh_proto_sampling_list l = {v, n};
    memcpy(dst, &l, sizeof l);
    return SH_OK;
}

static sh_err decode_strs(dec *d, const sh_proto_field *f, uint8_t *dst, uint32_t depth)
{
    uint32_t n;
    void *v;
    sh_err err = list_header(d, f, sizeof(sh_strv), depth, &n, &v);
    for (uint32_t i = 0; !err && i < n; i++) {
        size_t off = sh__mpack_offset(&d->r);
        sh_mpack_item it;
        if ((err = next(d, &it)))
            break;
        if (it.kind != SH_MPACK_STR)
            err = wrong_type(d, "str", &it, off);
        else if (it.len > SH_PROTO_MAX_STR_ITEM)
            err = bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO,
                      "entry %u at offset %zu: %u bytes, more than %d", i, off, it.len,
                      SH_PROTO_MAX_STR_ITEM);
        else
            ((sh_strv *)v)[i] = (sh_strv){(const char *)it.ptr, it.len};
    }
    if (err) {
        sh__error_prefix(d->e, f->name);
        return err;
    }
    sh_strv_list l = {v, n};
    memcpy(dst, &l, sizeof l);
    return SH_OK;
}

static sh_err decode_tensor(dec *d, uint8_t *dst, uint32_t depth)
{
    sh_proto_tensor t = {0};
    size_t off = sh__mpack_offset(&d->r);
    sh_mpack_item it;
    sh_err err = container(d, SH_MPACK_MAP, "map", depth, &it);
    if (err)
        return err;
    bool have_dt = false, have_sh = false, have_d = false;
    const uint8_t *data = NULL;
    uint32_t data_len = 0;
    for (uint32_t i = 0, pairs = it.len; i < pairs; i++) {
        sh_mpack_item k, v;
        size_t koff = sh__mpack_offset(&d->r);
        if ((err = next(d, &k)))
            return err;
        if (k.kind != SH_MPACK_STR)
            return wrong_type(d, "str key", &k, koff);
        bool *seen = k.len == 2 && !memcmp(k.ptr, "dt", 2)   ? &have_dt
                     : k.len == 2 && !memcmp(k.ptr, "sh", 2) ? &have_sh
                     : k.len == 1 && k.ptr[0] == 'd'         ? &have_d
                                                             : NULL;
        if (!seen) {
            if (sh__mpack_skip(&d->r, depth + 1, d->e)) {
                d->why = sh__msg_reject_from_mpack((int)d->r.fail);
                return SH_EFORMAT;
            }
            continue;
        }
        if (*seen)
            return bad(d, SH_MSG_REJECT_DUPLICATE, SH_EPROTO,
                       "duplicate key \"%.*s\" at offset %zu", (int)k.len, (const char *)k.ptr,
                       koff);
        *seen = true;
        size_t voff = sh__mpack_offset(&d->r);
        if ((err = next(d, &v)))
            return err;
        if (seen == &have_dt) {
            if (v.kind != SH_MPACK_UINT)
                return wrong_type(d, "uint dtype", &v, voff);
            if (v.v.u > UINT32_MAX || !sh__proto_dtype_size((uint32_t)v.v.u))
                return bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO,
                           "dtype %llu at offset %zu is not f32, f16 or bf16",
                           (unsigned long long)v.v.u, voff);
            t.dtype = (uint32_t)v.v.u;
        } else if (seen == &have_sh) {
            if (v.kind != SH_MPACK_ARRAY)
                return wrong_type(d, "array shape", &v, voff);
            if (depth + 1 > d->r.max_depth)
                return too_deep(d, voff);
            if (v.len < 1 || v.len > SH_PROTO_MAX_DIMS)
                return bad(d, SH_MSG_REJECT_SHAPE, SH_EPROTO,
                           "shape at offset %zu has %u dimensions (1..%d allowed)", voff, v.len,
                           SH_PROTO_MAX_DIMS);
            t.ndim = v.len;
            for (uint32_t j = 0; j < t.ndim; j++) {
                size_t doff = sh__mpack_offset(&d->r);
                sh_mpack_item dim;
                if ((err = next(d, &dim)))
                    return err;
                if (dim.kind != SH_MPACK_UINT)
                    return wrong_type(d, "uint dimension", &dim, doff);
                if (dim.v.u < 1 || dim.v.u > UINT32_MAX)
                    return bad(d, SH_MSG_REJECT_SHAPE, SH_EPROTO,
                               "dimension %u = %llu at offset %zu outside [1, 2^32)", j,
                               (unsigned long long)dim.v.u, doff);
                t.shape[j] = dim.v.u;
            }
        } else {
            if (v.kind != SH_MPACK_BIN)
                return wrong_type(d, "bin data", &v, voff);
            data = v.ptr;
            data_len = v.len;
        }
    }
    if (!have_dt || !have_sh)
        return bad(d, SH_MSG_REJECT_MISSING, SH_EPROTO, "tensor at offset %zu lacks \"%s\"", off,
                   have_dt ? "sh" : "dt");
    uint64_t nbytes;
    if (!sh__proto_tensor_bytes(t.dtype, t.ndim, t.shape, &nbytes))
        return bad(d, SH_MSG_REJECT_SHAPE, SH_EPROTO,
                   "tensor at offset %zu: shape too large for one frame", off);
    if (have_d) {
        if (data_len != nbytes)
            return bad(d, SH_MSG_REJECT_SHAPE, SH_EPROTO,
                       "tensor at offset %zu: %u data bytes, shape and dtype need %llu", off,
                       data_len, (unsigned long long)nbytes);
        t.data = data;
        t.nbytes = nbytes;
    }
    memcpy(dst, &t, sizeof t);
    return SH_OK;
}

/* Reads one scalar, string or view field into dst. */
static sh_err decode_scalar(dec *d, const sh_proto_field *f, uint8_t *dst)
{
    size_t off = sh__mpack_offset(&d->r);
    sh_mpack_item it;
    sh_err err = next(d, &it);
    if (err)
        return err;
    switch (f->kind) {
    case SH_PROTO_KIND_BOOL: {
        if (it.kind != SH_MPACK_BOOL)
            return wrong_type(d, "bool", &it, off);
        bool b = it.v.b;
        memcpy(dst, &b, sizeof b);
        return SH_OK;
    }
    case SH_PROTO_KIND_U8:
    case SH_PROTO_KIND_U32:
    case SH_PROTO_KIND_U64:
    case SH_PROTO_KIND_ADDR: {
        if (it.kind != SH_MPACK_UINT)
            return wrong_type(d, "uint", &it, off);
        uint64_t max = f->kind == SH_PROTO_KIND_U8    ? UINT8_MAX
                       : f->kind == SH_PROTO_KIND_U32 ? UINT32_MAX
                                                      : UINT64_MAX;
        if (it.v.u > max ||
            ((f->lo || f->hi) && (it.v.u < (uint64_t)f->lo || it.v.u > (uint64_t)f->hi)))
            return bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO,
                       "value %llu at offset %zu outside [%lld, %llu]", (unsigned long long)it.v.u,
                       off, (long long)f->lo, (unsigned long long)(f->hi ? (uint64_t)f->hi : max));
        if (f->kind == SH_PROTO_KIND_U8) {
            uint8_t v = (uint8_t)it.v.u;
            memcpy(dst, &v, 1);
        } else if (f->kind == SH_PROTO_KIND_U32) {
            uint32_t v = (uint32_t)it.v.u;
            memcpy(dst, &v, 4);
        } else {
            memcpy(dst, &it.v.u, 8);
        }
        return SH_OK;
    }
    case SH_PROTO_KIND_I32:
    case SH_PROTO_KIND_I64: {
        int64_t v;
        if (it.kind == SH_MPACK_UINT && it.v.u <= INT64_MAX)
            v = (int64_t)it.v.u;
        else if (it.kind == SH_MPACK_INT)
            v = it.v.i;
        else if (it.kind == SH_MPACK_UINT)
            return bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO, "value %llu at offset %zu overflows",
                       (unsigned long long)it.v.u, off);
        else
            return wrong_type(d, "int", &it, off);
        if ((f->kind == SH_PROTO_KIND_I32 && (v < INT32_MIN || v > INT32_MAX)) ||
            !sh__proto_in_bounds(f, v))
            return out_of_bounds(d, f, "value", v, off);
        if (f->kind == SH_PROTO_KIND_I32) {
            int32_t x = (int32_t)v;
            memcpy(dst, &x, 4);
        } else {
            memcpy(dst, &v, 8);
        }
        return SH_OK;
    }
    case SH_PROTO_KIND_F32:
    case SH_PROTO_KIND_F64: {
        double v;
        if (it.kind == SH_MPACK_F32)
            v = it.v.f32;
        else if (it.kind == SH_MPACK_F64)
            v = it.v.f64;
        else
            return wrong_type(d, "float", &it, off);
        if (f->kind == SH_PROTO_KIND_F64) {
            memcpy(dst, &v, 8);
            return SH_OK;
        }
        if (it.kind == SH_MPACK_F32) {
            memcpy(dst, &it.v.f32, 4); /* bit-exact, NaN payloads included */
            return SH_OK;
        }
        /* A float64 sent for a float32 field: converting an out-of-range value is undefined. */
        if (v == v && (v > FLT_MAX || v < -FLT_MAX) && v - v == 0)
            return bad(d, SH_MSG_REJECT_RANGE, SH_EPROTO,
                       "value %g at offset %zu overflows float32", v, off);
        float x = (float)v;
        memcpy(dst, &x, 4);
        return SH_OK;
    }
    case SH_PROTO_KIND_STR: {
        if (it.kind != SH_MPACK_STR)
            return wrong_type(d, "str", &it, off);
        if (!sh__proto_in_bounds(f, it.len))
            return out_of_bounds(d, f, "length", it.len, off);
        sh_strv s = {(const char *)it.ptr, it.len};
        memcpy(dst, &s, sizeof s);
        return SH_OK;
    }
    default: { /* the packed views */
        size_t esz = f->kind == SH_PROTO_KIND_U64S || f->kind == SH_PROTO_KIND_F64S ? 8 : 4;
        if (it.kind != SH_MPACK_BIN)
            return wrong_type(d, "bin", &it, off);
        if (it.len % esz)
            return bad(d, SH_MSG_REJECT_SHAPE, SH_EPROTO,
                       "%u bytes at offset %zu are not a whole number of %zu-byte elements", it.len,
                       off, esz);
        if (!sh__proto_in_bounds(f, it.len / esz))
            return out_of_bounds(d, f, "count", (long long)(it.len / esz), off);
        /* Every view type is {const void *ptr; uint32_t n;}. */
        sh_i32s v = {it.ptr, (uint32_t)(it.len / esz)};
        memcpy(dst, &v, sizeof v);
        return SH_OK;
    }
    }
}

/* Decodes the map at the reader (nesting depth `depth`) into `out`, a struct described by s. */
static sh_err decode_struct(dec *d, const sh_proto_desc *s, uint8_t *out, uint32_t depth)
{
    size_t off = sh__mpack_offset(&d->r);
    sh_mpack_item it;
    sh_err err = container(d, SH_MPACK_MAP, "map", depth, &it);
    if (err)
        return err;
    memset(out, 0, s->size);
    uint64_t seen = 0;
    for (uint32_t i = 0, pairs = it.len; i < pairs; i++) {
        size_t koff = sh__mpack_offset(&d->r);
        sh_mpack_item k;
        if ((err = next(d, &k)))
            return err;
        if (k.kind != SH_MPACK_STR)
            return wrong_type(d, "str key", &k, koff);
        const sh_proto_field *f = NULL;
        for (uint32_t j = 0; j < s->n_fields; j++) {
            const sh_proto_field *c = &s->fields[j];
            if (strlen(c->key) == k.len && !memcmp(c->key, k.ptr, k.len)) {
                f = c;
                break;
            }
        }
        if (!f) { /* a newer peer's field: skipped whole, limits still enforced */
            if (sh__mpack_skip(&d->r, depth + 1, d->e)) {
                d->why = sh__msg_reject_from_mpack((int)d->r.fail);
                return SH_EFORMAT;
            }
            continue;
        }
        uint64_t bit = (uint64_t)1 << (f - s->fields);
        if (seen & bit)
            return bad(d, SH_MSG_REJECT_DUPLICATE, SH_EPROTO, "duplicate key \"%s\" at offset %zu",
                       f->key, koff);
        seen |= bit;
        uint8_t *dst = out + f->offset;
        switch (f->kind) {
        case SH_PROTO_KIND_LIST:
            err = decode_list(d, f, dst, depth + 1);
            break;
        case SH_PROTO_KIND_STRS:
            err = decode_strs(d, f, dst, depth + 1);
            break;
        case SH_PROTO_KIND_STRUCT:
            err = decode_struct(d, f->sub, dst, depth + 1);
            break;
        case SH_PROTO_KIND_TENSOR:
            err = decode_tensor(d, dst, depth + 1);
            break;
        default:
            err = decode_scalar(d, f, dst);
            break;
        }
        if (err) {
            if (f->kind != SH_PROTO_KIND_LIST &&
                f->kind != SH_PROTO_KIND_STRS) /* those name their entry themselves */
                sh__error_prefix(d->e, f->name);
            return err;
        }
    }
    for (uint32_t j = 0; j < s->n_fields; j++) {
        if (s->fields[j].required && !(seen & ((uint64_t)1 << j)))
            return bad(d, SH_MSG_REJECT_MISSING, SH_EPROTO,
                       "missing required field %s (\"%s\") in the map at offset %zu",
                       s->fields[j].name, s->fields[j].key, off);
    }
    if (s->check && !s->check(out, &d->why, d->e))
        return SH_EPROTO;
    return SH_OK;
}

uint32_t sh__proto_peek_u64s(const void *body, size_t len, const char *const *keys, uint32_t n,
                             uint64_t *vals)
{
    sh_mpack_reader r;
    sh_mpack_item it;
    sh_error e = {0};
    uint32_t found = 0, want = n >= 32 ? UINT32_MAX : ((uint32_t)1 << n) - 1;
    sh__mpack_reader_init(&r, body, len, SH_MPACK_DEPTH_MAX);
    if (sh__mpack_next(&r, &it, &e) || it.kind != SH_MPACK_MAP)
        return 0;
    /* The body map sits inside the envelope array (depth 2): its values are at depth 3. */
    for (uint32_t i = 0, pairs = it.len; i < pairs && found != want; i++) {
        sh_mpack_item k;
        if (sh__mpack_next(&r, &k, &e) || k.kind != SH_MPACK_STR)
            return found;
        uint32_t j = 0;
        while (j < n && (strlen(keys[j]) != k.len || memcmp(keys[j], k.ptr, k.len)))
            j++;
        if (j == n) {
            if (sh__mpack_skip(&r, 3, &e))
                return found;
            continue;
        }
        if (sh__mpack_next(&r, &it, &e))
            return found;
        if (it.kind == SH_MPACK_UINT) {
            vals[j] = it.v.u;
            found |= (uint32_t)1 << j;
        } else if ((it.kind == SH_MPACK_ARRAY || it.kind == SH_MPACK_MAP) && it.len > 0) {
            return found; /* a container under a scalar's key: the full decode refuses it */
        }
    }
    return found;
}

sh_err sh__proto_decode_body(sh_msg_codec *c, sh_msg_type type, const void *body, size_t len,
                             sh_proto_body *out, sh_proto_arena *arena, sh_error *e)
{
    const sh_proto_desc *s = sh__proto_body_desc((uint64_t)type);
    if (!s) {
        sh__error_set(e, SH_EPROTO, "unknown message type %d", (int)type);
        sh__msg_count_reject(c, SH_MSG_REJECT_TYPE);
        return SH_EPROTO;
    }
    if (len > c->max_frame) {
        sh__error_set(e, SH_EFORMAT, "%s body of %zu bytes exceeds the limit of %zu",
                      sh__msg_type_name((uint64_t)type), len, c->max_frame);
        sh__msg_count_reject(c, SH_MSG_REJECT_OVERSIZE);
        return SH_EFORMAT;
    }
    dec d = {.arena = arena, .why = SH_MSG_REJECT_TRUNCATED, .e = e};
    sh__mpack_reader_init(&d.r, body, len, c->max_depth);
    size_t used = arena ? arena->used : 0;
    /* The body map sits inside the envelope array, so it is at depth 2. */
    sh_err err = decode_struct(&d, s, (uint8_t *)out, 2);
    if (!err && d.r.p != d.r.end)
        err = bad(&d, SH_MSG_REJECT_TRAILING, SH_EFORMAT, "%zu trailing bytes after the body",
                  sh__mpack_left(&d.r));
    if (err) {
        if (arena)
            arena->used = used;
        sh__error_prefix(e, sh__msg_type_name((uint64_t)type));
        sh__msg_count_reject(c, d.why);
        return err;
    }
    c->stats.bodies_ok++;
    return SH_OK;
}

sh_err sh__proto_decode(sh_msg_codec *c, const void *frame, size_t len, sh_msg_env *env,
                        sh_proto_body *out, sh_proto_arena *arena, sh_error *e)
{
    sh_err err = sh__msg_decode(c, frame, len, env, e);
    if (err)
        return err;
    return sh__proto_decode_body(c, env->hdr.type, env->body, env->body_len, out, arena, e);
}
