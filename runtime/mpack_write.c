/* The msgpack writer: shortest encodings, big-endian lengths, one growable buffer. */
#include "runtime/mpack_write.h"

#include <stdlib.h>
#include <string.h>

void sh__buf_init(sh_buf *b) { memset(b, 0, sizeof *b); }

void sh__buf_init_fixed(sh_buf *b, void *mem, size_t cap)
{
    memset(b, 0, sizeof *b);
    b->data = mem;
    b->cap = mem ? cap : 0;
    b->fixed = true;
}

void sh__buf_fini(sh_buf *b)
{
    if (!b)
        return;
    if (!b->fixed)
        free(b->data);
    memset(b, 0, sizeof *b);
}

void sh__buf_reset(sh_buf *b)
{
    b->len = 0;
    b->failed = false;
}

void sh__buf_truncate(sh_buf *b, size_t len)
{
    if (len < b->len)
        b->len = len;
    b->failed = false;
}

uint8_t *sh__buf_append(sh_buf *b, size_t n)
{
    if (b->failed)
        return NULL;
    if (n > b->cap - b->len) {
        if (b->fixed || n > SIZE_MAX / 2 - b->len) {
            b->failed = true;
            return NULL;
        }
        /* Doubling keeps the number of reallocations logarithmic in the largest frame. */
        size_t need = b->len + n, cap = b->cap ? b->cap : 256;
        while (cap < need)
            cap *= 2;
        uint8_t *p = realloc(b->data, cap);
        if (!p) {
            b->failed = true;
            return NULL;
        }
        b->data = p;
        b->cap = cap;
    }
    uint8_t *p = b->data + b->len;
    b->len += n;
    return p;
}

/* Writes a tag byte followed by the low `n` bytes of v, big-endian. */
static void put_tagged(sh_buf *b, uint8_t tag, uint64_t v, unsigned n)
{
    uint8_t *p = sh__buf_append(b, 1 + n);
    if (!p)
        return;
    p[0] = tag;
    for (unsigned i = 0; i < n; i++)
        p[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
}

void sh__mpack_put_nil(sh_buf *b) { put_tagged(b, 0xc0, 0, 0); }

void sh__mpack_put_bool(sh_buf *b, bool v) { put_tagged(b, v ? 0xc3 : 0xc2, 0, 0); }

void sh__mpack_put_uint(sh_buf *b, uint64_t v)
{
    if (v < 0x80)
        put_tagged(b, (uint8_t)v, 0, 0);
    else if (v <= UINT8_MAX)
        put_tagged(b, 0xcc, v, 1);
    else if (v <= UINT16_MAX)
        put_tagged(b, 0xcd, v, 2);
    else if (v <= UINT32_MAX)
        put_tagged(b, 0xce, v, 4);
    else
        put_tagged(b, 0xcf, v, 8);
}

void sh__mpack_put_int(sh_buf *b, int64_t v)
{
    if (v >= 0)
        sh__mpack_put_uint(b, (uint64_t)v);
    else if (v >= -32)
        put_tagged(b, (uint8_t)(0xe0 | (v + 32)), 0, 0);
    else if (v >= INT8_MIN)
        put_tagged(b, 0xd0, (uint64_t)v, 1);
    else if (v >= INT16_MIN)
        put_tagged(b, 0xd1, (uint64_t)v, 2);
    else if (v >= INT32_MIN)
        put_tagged(b, 0xd2, (uint64_t)v, 4);
    else
        put_tagged(b, 0xd3, (uint64_t)v, 8);
}

void sh__mpack_put_f32(sh_buf *b, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    put_tagged(b, 0xca, u, 4);
}

void sh__mpack_put_f64(sh_buf *b, double v)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    put_tagged(b, 0xcb, u, 8);
}

/* A length header from a family of (fix range, 8-, 16-, 32-bit) tags; tag8 == 0 means the
 * family has no 8-bit form (arrays and maps). */
static void put_len(sh_buf *b, size_t n, uint8_t fix, size_t fix_max, uint8_t tag8, uint8_t tag16,
                    uint8_t tag32)
{
    if (n > UINT32_MAX)
        b->failed = true;
    else if (fix && n <= fix_max)
        put_tagged(b, (uint8_t)(fix | n), 0, 0);
    else if (tag8 && n <= UINT8_MAX)
        put_tagged(b, tag8, n, 1);
    else if (n <= UINT16_MAX)
        put_tagged(b, tag16, n, 2);
    else
        put_tagged(b, tag32, n, 4);
}

void sh__mpack_put_str(sh_buf *b, const char *s, size_t n)
{
    put_len(b, n, 0xa0, 31, 0xd9, 0xda, 0xdb);
    uint8_t *p = sh__buf_append(b, n);
    if (p && n)
        memcpy(p, s, n);
}

uint8_t *sh__mpack_put_bin_reserve(sh_buf *b, size_t n)
{
    put_len(b, n, 0, 0, 0xc4, 0xc5, 0xc6);
    return sh__buf_append(b, n);
}

void sh__mpack_put_bin(sh_buf *b, const void *src, size_t n)
{
    uint8_t *p = sh__mpack_put_bin_reserve(b, n);
    if (p && n)
        memcpy(p, src, n);
}

void sh__mpack_put_array(sh_buf *b, size_t n) { put_len(b, n, 0x90, 15, 0, 0xdc, 0xdd); }

void sh__mpack_put_map(sh_buf *b, size_t n) { put_len(b, n, 0x80, 15, 0, 0xde, 0xdf); }
