/* GGUF metadata values: parsing (nested arrays included), typed getters and array accessors. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/gguf_internal.h"

static const struct {
    const char *name;
    uint8_t size; /* bytes of one fixed-size element; 0 for string and array */
} type_table[SH_GGUF_TYPE_COUNT_] = {
    [SH_GGUF_UINT8] = {"uint8", 1},     [SH_GGUF_INT8] = {"int8", 1},
    [SH_GGUF_UINT16] = {"uint16", 2},   [SH_GGUF_INT16] = {"int16", 2},
    [SH_GGUF_UINT32] = {"uint32", 4},   [SH_GGUF_INT32] = {"int32", 4},
    [SH_GGUF_FLOAT32] = {"float32", 4}, [SH_GGUF_BOOL] = {"bool", 1},
    [SH_GGUF_STRING] = {"string", 0},   [SH_GGUF_ARRAY] = {"array", 0},
    [SH_GGUF_UINT64] = {"uint64", 8},   [SH_GGUF_INT64] = {"int64", 8},
    [SH_GGUF_FLOAT64] = {"float64", 8},
};

size_t sh_gguf_type_size(sh_gguf_type t)
{
    return (unsigned)t < SH_GGUF_TYPE_COUNT_ ? type_table[t].size : 0;
}

const char *sh_gguf_type_name(sh_gguf_type t)
{
    return (unsigned)t < SH_GGUF_TYPE_COUNT_ ? type_table[t].name : "?";
}

bool sh_str_eq(sh_str s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* Decodes one fixed-size element at p; the caller guarantees the bytes exist. Integers land in
 * u or i (signed types sign-extended), floats in f, bools in b. */
static void decode_fixed(sh_gguf_type t, const uint8_t *p, sh_gguf_value *v)
{
    v->type = t;
    switch (t) {
    case SH_GGUF_UINT8:
        v->v.u = p[0];
        break;
    case SH_GGUF_INT8:
        v->v.i = (int8_t)p[0];
        break;
    case SH_GGUF_BOOL:
        v->v.b = p[0] != 0;
        break;
    case SH_GGUF_UINT16: {
        uint16_t x;
        memcpy(&x, p, 2);
        v->v.u = x;
        break;
    }
    case SH_GGUF_INT16: {
        int16_t x;
        memcpy(&x, p, 2);
        v->v.i = x;
        break;
    }
    case SH_GGUF_UINT32: {
        uint32_t x;
        memcpy(&x, p, 4);
        v->v.u = x;
        break;
    }
    case SH_GGUF_INT32: {
        int32_t x;
        memcpy(&x, p, 4);
        v->v.i = x;
        break;
    }
    case SH_GGUF_FLOAT32: {
        float x;
        memcpy(&x, p, 4);
        v->v.f = x;
        break;
    }
    case SH_GGUF_UINT64:
        memcpy(&v->v.u, p, 8);
        break;
    case SH_GGUF_INT64:
        memcpy(&v->v.i, p, 8);
        break;
    case SH_GGUF_FLOAT64:
        memcpy(&v->v.f, p, 8);
        break;
    default:
        memset(&v->v, 0, sizeof v->v);
        break;
    }
}

/* Smallest number of file bytes one element of type t can take: how absurd counts are caught
 * before anything is allocated. */
static uint64_t min_elem_bytes(uint32_t t)
{
    if (t == SH_GGUF_STRING)
        return 8; /* the length */
    if (t == SH_GGUF_ARRAY)
        return 12; /* element type and count of an empty array */
    return sh_gguf_type_size((sh_gguf_type)t);
}

/* Arrays are read twice: a dry pass that only validates and allocates nothing, then the real
 * one. A corrupt count that the remaining bytes could still hold (a 4 GB file claiming 400M
 * strings) thus fails on the missing elements instead of after a huge allocation. */
static sh_err read_array(sh__gguf_reader *r, sh_gguf_value *out, int depth, bool dry);

sh_err sh__gguf_read_value(sh__gguf_reader *r, uint32_t type, sh_gguf_value *out)
{
    memset(out, 0, sizeof *out);
    if (type >= SH_GGUF_TYPE_COUNT_)
        return sh__error_set(r->e, SH_EFORMAT, "%s: unknown value type %" PRIu32, r->where, type);
    out->type = (sh_gguf_type)type;
    if (type == SH_GGUF_STRING)
        return sh__gguf_read_str(r, "string", &out->v.s);
    if (type == SH_GGUF_ARRAY) {
        uint64_t start = r->pos;
        sh_err err = read_array(r, out, 1, true);
        if (err)
            return err;
        r->pos = start;
        return read_array(r, out, 1, false);
    }
    size_t n = sh_gguf_type_size((sh_gguf_type)type);
    sh_err err = sh__gguf_need(r, n, sh_gguf_type_name((sh_gguf_type)type));
    if (err)
        return err;
    const uint8_t *p = r->base + r->pos;
    if (type == SH_GGUF_BOOL && p[0] > 1)
        return sh__error_set(r->e, SH_EFORMAT,
                             "%s: bool value %u at offset %" PRIu64 " (not 0 or 1)", r->where, p[0],
                             r->pos);
    decode_fixed((sh_gguf_type)type, p, out);
    r->pos += n;
    return SH_OK;
}

/* Elements of a nested array: each is itself an array with its own element type and count. */
static sh_err read_nested(sh__gguf_reader *r, sh_gguf_value *out, int depth, bool dry)
{
    sh_gguf_value scratch, *vals = NULL;
    if (!dry && out->v.arr.n && !(vals = sh__gguf_alloc(r, out->v.arr.n, sizeof *vals)))
        return SH_ENOMEM;
    for (uint64_t i = 0; i < out->v.arr.n; i++) {
        sh_gguf_value *v = dry ? &scratch : &vals[i];
        memset(v, 0, sizeof *v);
        v->type = SH_GGUF_ARRAY;
        sh_err err = read_array(r, v, depth + 1, dry);
        if (err)
            return err;
    }
    out->v.arr.vals = vals;
    return SH_OK;
}

static sh_err read_strings(sh__gguf_reader *r, sh_gguf_value *out, bool dry)
{
    sh_str scratch, *strs = NULL;
    if (!dry && out->v.arr.n && !(strs = sh__gguf_alloc(r, out->v.arr.n, sizeof *strs)))
        return SH_ENOMEM;
    for (uint64_t i = 0; i < out->v.arr.n; i++) {
        sh_err err = sh__gguf_read_str(r, "array string", dry ? &scratch : &strs[i]);
        if (err)
            return err;
    }
    out->v.arr.strs = strs;
    return SH_OK;
}

/* Reads an array's element type, count and elements; out->type is already ARRAY. */
static sh_err read_array(sh__gguf_reader *r, sh_gguf_value *out, int depth, bool dry)
{
    if (depth > SH_GGUF_MAX_DEPTH)
        return sh__error_set(r->e, SH_EFORMAT, "%s: arrays nested deeper than %d levels", r->where,
                             SH_GGUF_MAX_DEPTH);
    uint32_t et;
    uint64_t n;
    sh_err err = sh__gguf_read_u32(r, "array element type", &et);
    if (!err)
        err = sh__gguf_read_u64(r, "array count", &n);
    if (err)
        return err;
    if (et >= SH_GGUF_TYPE_COUNT_)
        return sh__error_set(r->e, SH_EFORMAT, "%s: unknown array element type %" PRIu32, r->where,
                             et);
    uint64_t min = min_elem_bytes(et), left = r->size - r->pos;
    if (n > left / min)
        return sh__error_set(r->e, SH_EFORMAT,
                             "%s: array count %" PRIu64 " of %s at offset %" PRIu64
                             " exceeds the %" PRIu64 " bytes left in the file",
                             r->where, n, sh_gguf_type_name((sh_gguf_type)et), r->pos - 12, left);
    out->v.arr.type = (sh_gguf_type)et;
    out->v.arr.n = n;
    if (et == SH_GGUF_ARRAY)
        return read_nested(r, out, depth, dry);
    if (et == SH_GGUF_STRING)
        return read_strings(r, out, dry);
    const uint8_t *p = r->base + r->pos;
    if (et == SH_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (p[i] > 1)
                return sh__error_set(r->e, SH_EFORMAT,
                                     "%s: bool element %" PRIu64 " is %u (not 0 or 1)", r->where, i,
                                     p[i]);
    out->v.arr.raw = p;
    r->pos += n * min; /* n * min <= left, checked above */
    return SH_OK;
}

uint64_t sh_gguf_arr_u64(const sh_gguf_value *arr, uint64_t i)
{
    sh_gguf_value v;
    size_t sz = sh_gguf_type_size(arr->v.arr.type);
    decode_fixed(arr->v.arr.type, (const uint8_t *)arr->v.arr.raw + i * sz, &v);
    switch (v.type) {
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        return (uint64_t)v.v.i;
    case SH_GGUF_BOOL:
        return v.v.b;
    case SH_GGUF_FLOAT32:
    case SH_GGUF_FLOAT64:
        return 0; /* not an integer array: the caller's mistake */
    default:
        return v.v.u;
    }
}

int64_t sh_gguf_arr_i64(const sh_gguf_value *arr, uint64_t i)
{
    return (int64_t)sh_gguf_arr_u64(arr, i);
}

double sh_gguf_arr_f64(const sh_gguf_value *arr, uint64_t i)
{
    sh_gguf_value v;
    size_t sz = sh_gguf_type_size(arr->v.arr.type);
    decode_fixed(arr->v.arr.type, (const uint8_t *)arr->v.arr.raw + i * sz, &v);
    switch (v.type) {
    case SH_GGUF_FLOAT32:
    case SH_GGUF_FLOAT64:
        return v.v.f;
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        return (double)v.v.i;
    case SH_GGUF_BOOL:
        return v.v.b;
    default:
        return (double)v.v.u;
    }
}

/* Integer value of v for the getters: SH_EFORMAT unless v is an integer or bool. *neg tells a
 * negative signed value apart from a large unsigned one. */
static sh_err int_of(const sh_gguf_value *v, uint64_t *mag, bool *neg)
{
    switch (v->type) {
    case SH_GGUF_UINT8:
    case SH_GGUF_UINT16:
    case SH_GGUF_UINT32:
    case SH_GGUF_UINT64:
        *mag = v->v.u, *neg = false;
        return SH_OK;
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        *neg = v->v.i < 0;
        /* Two's complement magnitude without overflowing on INT64_MIN. */
        *mag = *neg ? (uint64_t)0 - (uint64_t)v->v.i : (uint64_t)v->v.i;
        return SH_OK;
    case SH_GGUF_BOOL:
        *mag = v->v.b, *neg = false;
        return SH_OK;
    default:
        return SH_EFORMAT;
    }
}

static sh_err find_int(const sh_gguf *g, const char *key, uint64_t *mag, bool *neg)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return SH_ENOTFOUND;
    return int_of(v, mag, neg);
}

sh_err sh_gguf_get_u32(const sh_gguf *g, const char *key, uint32_t *out)
{
    uint64_t m;
    bool neg;
    sh_err err = find_int(g, key, &m, &neg);
    if (err)
        return err;
    if (neg || m > UINT32_MAX)
        return SH_ERANGE;
    *out = (uint32_t)m;
    return SH_OK;
}

sh_err sh_gguf_get_i32(const sh_gguf *g, const char *key, int32_t *out)
{
    uint64_t m;
    bool neg;
    sh_err err = find_int(g, key, &m, &neg);
    if (err)
        return err;
    if (neg ? m > (uint64_t)INT32_MAX + 1 : m > INT32_MAX)
        return SH_ERANGE;
    *out = neg ? (int32_t)(-(int64_t)m) : (int32_t)m;
    return SH_OK;
}

sh_err sh_gguf_get_u64(const sh_gguf *g, const char *key, uint64_t *out)
{
    uint64_t m;
    bool neg;
    sh_err err = find_int(g, key, &m, &neg);
    if (err)
        return err;
    if (neg)
        return SH_ERANGE;
    *out = m;
    return SH_OK;
}

sh_err sh_gguf_get_f32(const sh_gguf *g, const char *key, float *out)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return SH_ENOTFOUND;
    if (v->type == SH_GGUF_FLOAT32 || v->type == SH_GGUF_FLOAT64) {
        *out = (float)v->v.f;
        return SH_OK;
    }
    uint64_t m;
    bool neg;
    if (v->type == SH_GGUF_BOOL || int_of(v, &m, &neg) != SH_OK)
        return SH_EFORMAT;
    *out = neg ? -(float)m : (float)m;
    return SH_OK;
}

sh_err sh_gguf_get_bool(const sh_gguf *g, const char *key, bool *out)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return SH_ENOTFOUND;
    if (v->type != SH_GGUF_BOOL)
        return SH_EFORMAT;
    *out = v->v.b;
    return SH_OK;
}

sh_err sh_gguf_get_str(const sh_gguf *g, const char *key, sh_str *out)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return SH_ENOTFOUND;
    if (v->type != SH_GGUF_STRING)
        return SH_EFORMAT;
    *out = v->v.s;
    return SH_OK;
}

sh_err sh_gguf_get_arr(const sh_gguf *g, const char *key, sh_gguf_type elem_type,
                       const sh_gguf_value **out)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return SH_ENOTFOUND;
    if (v->type != SH_GGUF_ARRAY || v->v.arr.type != elem_type)
        return SH_EFORMAT;
    *out = v;
    return SH_OK;
}
