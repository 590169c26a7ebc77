/* The strict msgpack reader: one item header at a time, every length checked before use. */
#include "runtime/mpack_read.h"

#include <string.h>

#include "base/error.h"

void sh__mpack_reader_init(sh_mpack_reader *r, const void *data, size_t len, uint32_t max_depth)
{
    r->base = data;
    r->p = r->base;
    r->end = r->base + (data ? len : 0);
    if (max_depth < 1)
        max_depth = 1;
    if (max_depth > SH_MPACK_DEPTH_MAX)
        max_depth = SH_MPACK_DEPTH_MAX;
    r->max_depth = max_depth;
    r->fail = SH_MPACK_FAIL_NONE;
}

const char *sh__mpack_kind_name(sh_mpack_kind k)
{
    static const char *const names[] = {"nil", "bool", "uint",  "int", "float32", "float64",
                                        "str", "bin",  "array", "map", "ext"};
    return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "?";
}

static sh_err fail(sh_mpack_reader *r, sh_mpack_fail why, sh_error *e, const char *what,
                   size_t need)
{
    r->fail = why;
    if (why == SH_MPACK_FAIL_TRUNCATED)
        return sh__error_set(e, SH_EFORMAT, "truncated %s at offset %zu: needs %zu bytes, %zu left",
                             what, sh__mpack_offset(r), need, sh__mpack_left(r));
    if (why == SH_MPACK_FAIL_DEPTH)
        return sh__error_set(e, SH_EFORMAT, "%s at offset %zu nested deeper than %u", what,
                             sh__mpack_offset(r), r->max_depth);
    return sh__error_set(e, SH_EFORMAT, "invalid msgpack byte 0x%02x at offset %zu", *r->p,
                         sh__mpack_offset(r));
}

/* Big-endian unsigned integer of n bytes at p. */
static uint64_t be(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* Fills it->v for an integer of n payload bytes (two's complement when `sgn`) and normalises the
 * kind: every value >= 0 reads as UINT whatever tag carried it. */
static void set_int(sh_mpack_item *it, uint64_t raw, unsigned n, bool sgn)
{
    uint64_t sign = (uint64_t)1 << (8 * n - 1);
    if (!sgn || !(raw & sign)) {
        it->kind = SH_MPACK_UINT;
        it->v.u = raw;
        return;
    }
    /* raw - 2^(8n), computed without signed overflow: raw - sign >= 0 fits, then subtract sign
     * in two steps that each stay in range. */
    it->kind = SH_MPACK_INT;
    it->v.i = (int64_t)(raw - sign) - (int64_t)(sign - 1) - 1;
}

sh_err sh__mpack_next(sh_mpack_reader *r, sh_mpack_item *it, sh_error *e)
{
    memset(it, 0, sizeof *it);
    if (r->p >= r->end)
        return fail(r, SH_MPACK_FAIL_TRUNCATED, e, "item", 1);
    uint8_t t = r->p[0];
    size_t left = sh__mpack_left(r) - 1;
    unsigned nfix = 0;     /* bytes of the fixed-size value or length after the tag */
    sh_mpack_kind kind;    /* what the tag announces */
    bool sgn = false;      /* integer tags: signed */
    bool ext = false;      /* ext8/16/32: a type byte follows the length */
    uint32_t fixlen = 0;   /* length carried in the tag itself */
    unsigned lenbytes = 0; /* str/bin/ext/array/map: bytes of the length field */

    if (t <= 0x7f) {
        kind = SH_MPACK_UINT;
        it->v.u = t;
    } else if (t <= 0x8f) {
        kind = SH_MPACK_MAP;
        fixlen = t & 0x0f;
    } else if (t <= 0x9f) {
        kind = SH_MPACK_ARRAY;
        fixlen = t & 0x0f;
    } else if (t <= 0xbf) {
        kind = SH_MPACK_STR;
        fixlen = t & 0x1f;
    } else if (t >= 0xe0) {
        kind = SH_MPACK_INT;
        it->v.i = (int64_t)t - 256;
    } else {
        switch (t) {
        case 0xc0:
            kind = SH_MPACK_NIL;
            break;
        case 0xc2:
        case 0xc3:
            kind = SH_MPACK_BOOL;
            it->v.b = t == 0xc3;
            break;
        case 0xc4:
        case 0xc5:
        case 0xc6:
            kind = SH_MPACK_BIN;
            lenbytes = 1u << (t - 0xc4);
            break;
        case 0xc7:
        case 0xc8:
        case 0xc9:
            kind = SH_MPACK_EXT;
            lenbytes = 1u << (t - 0xc7);
            ext = true;
            break;
        case 0xca:
            kind = SH_MPACK_F32;
            nfix = 4;
            break;
        case 0xcb:
            kind = SH_MPACK_F64;
            nfix = 8;
            break;
        case 0xcc:
        case 0xcd:
        case 0xce:
        case 0xcf:
            kind = SH_MPACK_UINT;
            nfix = 1u << (t - 0xcc);
            break;
        case 0xd0:
        case 0xd1:
        case 0xd2:
        case 0xd3:
            kind = SH_MPACK_INT;
            nfix = 1u << (t - 0xd0);
            sgn = true;
            break;
        case 0xd4:
        case 0xd5:
        case 0xd6:
        case 0xd7:
        case 0xd8:
            /* fixext: a type byte and 1..16 data bytes */
            kind = SH_MPACK_EXT;
            fixlen = 1u << (t - 0xd4);
            ext = true;
            break;
        case 0xd9:
        case 0xda:
        case 0xdb:
            kind = SH_MPACK_STR;
            lenbytes = 1u << (t - 0xd9);
            break;
        case 0xdc:
        case 0xdd:
            kind = SH_MPACK_ARRAY;
            lenbytes = 2u << (t - 0xdc);
            break;
        case 0xde:
        case 0xdf:
            kind = SH_MPACK_MAP;
            lenbytes = 2u << (t - 0xde);
            break;
        default:
            return fail(r, SH_MPACK_FAIL_INVALID, e, "", 0); /* 0xc1 */
        }
    }
    it->kind = kind;

    /* Fixed-size scalars. */
    if (nfix) {
        if (left < nfix)
            return fail(r, SH_MPACK_FAIL_TRUNCATED, e, sh__mpack_kind_name(kind), nfix + 1);
        uint64_t raw = be(r->p + 1, nfix);
        if (kind == SH_MPACK_F32) {
            uint32_t u = (uint32_t)raw;
            memcpy(&it->v.f32, &u, 4);
        } else if (kind == SH_MPACK_F64) {
            memcpy(&it->v.f64, &raw, 8);
        } else {
            set_int(it, raw, nfix, sgn);
        }
        r->p += 1 + nfix;
        return SH_OK;
    }
    if (kind == SH_MPACK_UINT || kind == SH_MPACK_INT || kind == SH_MPACK_NIL ||
        kind == SH_MPACK_BOOL) {
        r->p += 1; /* fixints, nil and bools are the tag alone */
        return SH_OK;
    }

    /* Lengths: in the tag, or in 1/2/4 bytes after it (plus an ext type byte). */
    size_t hdr = 1 + lenbytes + (ext ? 1 : 0);
    if (sh__mpack_left(r) < hdr)
        return fail(r, SH_MPACK_FAIL_TRUNCATED, e, sh__mpack_kind_name(kind), hdr);
    uint64_t n = lenbytes ? be(r->p + 1, lenbytes) : fixlen;
    left = sh__mpack_left(r) - hdr;
    it->len = (uint32_t)n;
    if (ext)
        it->ext_type = (int8_t)r->p[1 + lenbytes];
    if (kind == SH_MPACK_STR || kind == SH_MPACK_BIN || kind == SH_MPACK_EXT) {
        if (n > left)
            return fail(r, SH_MPACK_FAIL_TRUNCATED, e, sh__mpack_kind_name(kind), hdr + n);
        it->ptr = r->p + hdr;
        r->p += hdr + n;
        return SH_OK;
    }
    /* Containers: each element takes at least one byte, so a count the rest of the frame cannot
     * hold is refused before anyone loops over it or sizes an allocation by it. */
    uint64_t min_bytes = kind == SH_MPACK_MAP ? 2 * n : n;
    if (min_bytes > left)
        return fail(r, SH_MPACK_FAIL_TRUNCATED, e, sh__mpack_kind_name(kind), hdr + min_bytes);
    r->p += hdr;
    return SH_OK;
}

sh_err sh__mpack_skip(sh_mpack_reader *r, uint32_t depth, sh_error *e)
{
    const uint8_t *at = r->p;
    sh_mpack_item it;
    sh_err err = sh__mpack_next(r, &it, e);
    if (err)
        return err;
    if (it.kind != SH_MPACK_ARRAY && it.kind != SH_MPACK_MAP)
        return SH_OK;
    if (depth > r->max_depth) {
        r->p = at;
        return fail(r, SH_MPACK_FAIL_DEPTH, e, sh__mpack_kind_name(it.kind), 0);
    }
    uint64_t n = it.kind == SH_MPACK_MAP ? 2 * (uint64_t)it.len : it.len;
    for (uint64_t i = 0; i < n; i++) {
        if ((err = sh__mpack_skip(r, depth + 1, e)))
            return err;
    }
    return SH_OK;
}
