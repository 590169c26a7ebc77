/* Helpers for the GGUF tests: a tiny byte builder (little-endian fields appended to a growing
 * buffer, for valid and deliberately broken files) and a walk that checks an opened file. */
#ifndef SH_TEST_GGUF_UTIL_H
#define SH_TEST_GGUF_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"

typedef struct gb {
    uint8_t *p;
    size_t n, cap;
} gb;

static inline void gb_bytes(gb *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            fprintf(stderr, "gb: out of memory\n");
            exit(1);
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, src, n);
    b->n += n;
}

static inline void gb_u8(gb *b, uint8_t v) { gb_bytes(b, &v, 1); }
static inline void gb_u16(gb *b, uint16_t v) { gb_bytes(b, &v, 2); }
static inline void gb_u32(gb *b, uint32_t v) { gb_bytes(b, &v, 4); }
static inline void gb_u64(gb *b, uint64_t v) { gb_bytes(b, &v, 8); }
static inline void gb_f32(gb *b, float v) { gb_bytes(b, &v, 4); }
static inline void gb_f64(gb *b, double v) { gb_bytes(b, &v, 8); }
static inline void gb_str(gb *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_bytes(b, s, strlen(s));
}
static inline void gb_free(gb *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* Magic, version and the two counts. */
static inline void gb_header(gb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    gb_u32(b, 0x46554747u);
    gb_u32(b, version);
    gb_u64(b, n_tensors);
    gb_u64(b, n_kv);
}

/* Key and value type; the caller appends the value. */
static inline void gb_key(gb *b, const char *key, uint32_t type)
{
    gb_str(b, key);
    gb_u32(b, type);
}
static inline void gb_kv_u32(gb *b, const char *key, uint32_t v)
{
    gb_key(b, key, 4);
    gb_u32(b, v);
}
static inline void gb_kv_str(gb *b, const char *key, const char *v)
{
    gb_key(b, key, 8);
    gb_str(b, v);
}

static inline void gb_tensor(gb *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                             uint32_t type, uint64_t offset)
{
    gb_str(b, name);
    gb_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        gb_u64(b, ne[d]);
    gb_u32(b, type);
    gb_u64(b, offset);
}

/* Zero padding up to a multiple of a. */
static inline void gb_align(gb *b, size_t a)
{
    while (b->n % a)
        gb_u8(b, 0);
}

/* Fills n bytes with a recognisable pattern. */
static inline void gb_fill(gb *b, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        gb_u8(b, (uint8_t)(seed + i * 7));
}

/* A small valid model file: a few keys (alignment 32), three tensors of types F32, F16 and Q8_0,
 * their data in order. */
static inline void gb_small_model(gb *b)
{
    static const uint64_t ne_a[2] = {4, 2}, ne_b[1] = {8}, ne_c[2] = {32, 2};
    gb_header(b, 3, 3, 5);
    gb_kv_str(b, "general.architecture", "llama");
    gb_kv_str(b, "general.name", "tiny");
    gb_kv_u32(b, "general.alignment", 32);
    gb_kv_u32(b, "llama.block_count", 1);
    gb_key(b, "tokenizer.ggml.tokens", 9);
    gb_u32(b, 8);
    gb_u64(b, 3);
    gb_str(b, "<unk>");
    gb_str(b, "<s>");
    gb_str(b, "</s>");
    gb_tensor(b, "a.weight", 2, ne_a, 0, 0);  /* 32 bytes at 0 */
    gb_tensor(b, "b.weight", 1, ne_b, 1, 32); /* 16 bytes at 32 */
    gb_tensor(b, "c.weight", 2, ne_c, 8, 64); /* 2 * 34 bytes at 64 */
    gb_align(b, 32);
    gb_fill(b, 32, 1);
    gb_fill(b, 16, 2);
    gb_fill(b, 16, 0);
    gb_fill(b, 68, 3);
}

/* Touches every value (nested arrays included) and checks the handle's promises: pointers inside
 * [buf, buf + size), counts consistent, lookups finding what the tables hold. Returns the number
 * of broken promises; *sum accumulates the bytes read so the reads are not optimised away. */
static inline int gw_value(const sh_gguf_value *v, const uint8_t *buf, size_t size, unsigned *sum)
{
    int bad = 0;
#define GW_IN(p, n)                                                                                \
    ((const uint8_t *)(p) >= buf && (n) <= size &&                                                 \
     (const uint8_t *)(p)-buf <= (ptrdiff_t)(size - (n)))
    if (v->type == SH_GGUF_STRING) {
        bad += !GW_IN(v->v.s.ptr, v->v.s.len);
        if (v->v.s.len)
            *sum += (unsigned char)v->v.s.ptr[0] + (unsigned char)v->v.s.ptr[v->v.s.len - 1];
        return bad;
    }
    if (v->type != SH_GGUF_ARRAY)
        return (unsigned)v->type >= SH_GGUF_TYPE_COUNT_;
    uint64_t n = v->v.arr.n;
    sh_gguf_type t = v->v.arr.type;
    for (uint64_t i = 0; i < n; i++) {
        if (t == SH_GGUF_STRING) {
            sh_gguf_value s = {.type = SH_GGUF_STRING, .v.s = v->v.arr.strs[i]};
            bad += gw_value(&s, buf, size, sum);
        } else if (t == SH_GGUF_ARRAY) {
            bad += v->v.arr.vals[i].type != SH_GGUF_ARRAY;
            bad += gw_value(&v->v.arr.vals[i], buf, size, sum);
        } else {
            /* the double's bits: converting a negative or huge value to unsigned is undefined
             * (clang's UBSan reports it) */
            const double f = sh_gguf_arr_f64(v, i);
            uint64_t fb;
            memcpy(&fb, &f, sizeof fb);
            *sum += (unsigned)sh_gguf_arr_u64(v, i) + (unsigned)fb;
        }
    }
    if (t != SH_GGUF_STRING && t != SH_GGUF_ARRAY)
        bad += n && !GW_IN(v->v.arr.raw, n * sh_gguf_type_size(t));
    return bad;
}

static inline int gw_file(const sh_gguf *g, const void *buf_, size_t size)
{
    const uint8_t *buf = buf_;
    unsigned sum = 0;
    int bad = 0;
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        bad += gw_value(&kv->value, buf, size, &sum);
        char key[256];
        if (kv->key.len < sizeof key && !memchr(kv->key.ptr, 0, kv->key.len)) {
            memcpy(key, kv->key.ptr, kv->key.len);
            key[kv->key.len] = 0;
            bad += sh_gguf_find(g, key) != &kv->value;
        }
    }
    bad += sh_gguf_kv_at(g, sh_gguf_n_kv(g)) != NULL;
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        uint64_t prod = 1;
        for (int d = 0; d < SH_GGUF_MAX_DIMS; d++)
            prod *= t->ne[d];
        bad += prod != t->n_elems || t->n_dims < 1 || t->n_dims > SH_GGUF_MAX_DIMS;
        bad += t->nbytes == 0 || !GW_IN(t->data, t->nbytes);
        bad += (const uint8_t *)t->data - buf != (ptrdiff_t)(sh_gguf_data_offset(g) + t->offset);
        bad += t->offset % sh_gguf_alignment(g) != 0;
        if (t->nbytes)
            sum += ((const uint8_t *)t->data)[0] + ((const uint8_t *)t->data)[t->nbytes - 1];
        char name[256];
        if (t->name.len < sizeof name && !memchr(t->name.ptr, 0, t->name.len)) {
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = 0;
            bad += sh_gguf_find_tensor(g, name) != t;
        }
    }
    bad += sh_gguf_tensor_at(g, sh_gguf_n_tensors(g)) != NULL;
#undef GW_IN
    volatile unsigned sink = sum; /* keeps the reads */
    (void)sink;
    return bad;
}

/* Reads a whole file into memory; NULL on failure. */
static inline uint8_t *gw_read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = n > 0 ? malloc((size_t)n) : NULL;
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *size = p ? (size_t)n : 0;
    return p;
}

#endif
