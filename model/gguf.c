/* GGUF reader: parses and validates the header, metadata and tensor table of a mapped file. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/file.h"
#include "model/gguf_internal.h"

/* A hash index from names (keys or tensor names) to positions in a table. Open addressing with
 * linear probing; slots hold index + 1 so that 0 means empty. */
typedef struct name_index {
    uint64_t *slots;
    uint64_t mask;
} name_index;

struct sh_gguf {
    sh_file_map map; /* owned when opened from a path; zeroed for open_mem */
    const uint8_t *base;
    uint64_t size;
    uint32_t version, alignment;
    uint64_t data_offset, data_size;
    uint64_t n_kv, n_tensors;
    sh_gguf_kv *kvs;         /* n_kv, malloc'd */
    sh_gguf_tensor *tensors; /* n_tensors, malloc'd */
    name_index kv_index, tensor_index;
    sh__gguf_block *arena;
};

/* The arena holds string and nested-array tables, name indexes and the layout check's extents.
 * Each entry stands for at least 8 bytes of the file already proved present and takes at most
 * 48 bytes plus index slots, so its total is a small multiple of the file size; the budget
 * enforces that bound so that no input can make the reader allocate out of proportion. */
#define ALLOC_PER_FILE_BYTE 16u
#define ALLOC_SLACK (1u << 16)
#define ARENA_BLOCK (64u << 10)

void *sh__gguf_alloc(sh__gguf_reader *r, uint64_t n, size_t size)
{
    uint64_t bytes;
    if (n == 0 || size == 0)
        return NULL;
    if (__builtin_mul_overflow(n, (uint64_t)size, &bytes) || bytes > r->alloc_left) {
        sh__error_set(r->e, SH_ENOMEM, "%s: table of %" PRIu64 " entries exceeds the budget",
                      r->where, n);
        return NULL;
    }
    bytes = (bytes + sizeof(max_align_t) - 1) & ~(uint64_t)(sizeof(max_align_t) - 1);
    sh__gguf_block *b = r->arena;
    if (!b || b->cap - b->used < bytes) {
        size_t cap = bytes > ARENA_BLOCK ? (size_t)bytes : ARENA_BLOCK;
        b = malloc(sizeof *b + cap);
        if (!b) {
            sh__error_set(r->e, SH_ENOMEM, "%s: out of memory for %" PRIu64 " bytes", r->where,
                          bytes);
            return NULL;
        }
        b->used = 0;
        b->cap = cap;
        /* A big allocation gets its own block behind the current one, which stays usable. */
        if (r->arena && bytes > ARENA_BLOCK) {
            b->next = r->arena->next;
            r->arena->next = b;
        } else {
            b->next = r->arena;
            r->arena = b;
        }
    }
    void *p = (char *)b->data + b->used;
    b->used += bytes;
    r->alloc_left -= bytes;
    memset(p, 0, bytes);
    return p;
}

void sh__gguf_arena_free(sh__gguf_block *b)
{
    while (b) {
        sh__gguf_block *next = b->next;
        free(b);
        b = next;
    }
}

sh_err sh__gguf_need(sh__gguf_reader *r, uint64_t n, const char *what)
{
    if (r->size - r->pos >= n)
        return SH_OK;
    return sh__error_set(r->e, SH_EFORMAT,
                         "%s: truncated: %s at offset %" PRIu64 " needs %" PRIu64
                         " bytes, the file ends at %" PRIu64,
                         r->where, what, r->pos, n, r->size);
}

sh_err sh__gguf_read_u32(sh__gguf_reader *r, const char *what, uint32_t *out)
{
    sh_err err = sh__gguf_need(r, 4, what);
    if (err)
        return err;
    memcpy(out, r->base + r->pos, 4);
    r->pos += 4;
    return SH_OK;
}

sh_err sh__gguf_read_u64(sh__gguf_reader *r, const char *what, uint64_t *out)
{
    sh_err err = sh__gguf_need(r, 8, what);
    if (err)
        return err;
    memcpy(out, r->base + r->pos, 8);
    r->pos += 8;
    return SH_OK;
}

sh_err sh__gguf_read_str(sh__gguf_reader *r, const char *what, sh_str *out)
{
    uint64_t len;
    sh_err err = sh__gguf_read_u64(r, what, &len);
    if (err)
        return err;
    if (len > r->size - r->pos)
        return sh__error_set(r->e, SH_EFORMAT,
                             "%s: %s length %" PRIu64 " at offset %" PRIu64
                             " runs past the end of the file (%" PRIu64 " bytes left)",
                             r->where, what, len, r->pos - 8, r->size - r->pos);
    out->ptr = (const char *)r->base + r->pos;
    out->len = len;
    r->pos += len;
    return SH_OK;
}

const char *sh__gguf_escape(sh_str s, char *buf, size_t cap)
{
    size_t o = 0, max = cap > 70 ? 64 : cap / 2;
    for (uint64_t i = 0; i < s.len && o + 8 < cap; i++) {
        if (o >= max) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        unsigned char c = (unsigned char)s.ptr[i];
        if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\')
            buf[o++] = (char)c;
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
    }
    buf[o] = '\0';
    return buf;
}

static uint64_t hash_name(const char *p, uint64_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

static bool str_same(sh_str a, sh_str b)
{
    return a.len == b.len && (a.len == 0 || memcmp(a.ptr, b.ptr, a.len) == 0);
}

/* Builds the index over n names, read through name_at; on a duplicate, *dup_first and
 * *dup_second are the two positions and SH_EFORMAT is returned for the caller to describe. */
static sh_err index_build(sh__gguf_reader *r, name_index *ix, uint64_t n,
                          sh_str (*name_at)(const void *, uint64_t), const void *table,
                          uint64_t *dup_first, uint64_t *dup_second)
{
    uint64_t cap = 8;
    while (cap < 2 * n)
        cap *= 2; /* n is bounded by the file size, so this cannot overflow */
    ix->slots = sh__gguf_alloc(r, cap, sizeof *ix->slots);
    if (!ix->slots)
        return SH_ENOMEM;
    ix->mask = cap - 1;
    for (uint64_t i = 0; i < n; i++) {
        sh_str s = name_at(table, i);
        uint64_t h = hash_name(s.ptr, s.len) & ix->mask;
        while (ix->slots[h]) {
            if (str_same(name_at(table, ix->slots[h] - 1), s)) {
                *dup_first = ix->slots[h] - 1;
                *dup_second = i;
                return SH_EFORMAT;
            }
            h = (h + 1) & ix->mask;
        }
        ix->slots[h] = i + 1;
    }
    return SH_OK;
}

/* Position of the NUL-terminated name in the index, or UINT64_MAX. */
static uint64_t index_find(const name_index *ix, const char *name,
                           sh_str (*name_at)(const void *, uint64_t), const void *table)
{
    if (!ix->slots)
        return UINT64_MAX;
    uint64_t n = strlen(name), h = hash_name(name, n) & ix->mask;
    for (; ix->slots[h]; h = (h + 1) & ix->mask)
        if (sh_str_eq(name_at(table, ix->slots[h] - 1), name))
            return ix->slots[h] - 1;
    return UINT64_MAX;
}

static sh_str kv_name(const void *t, uint64_t i) { return ((const sh_gguf_kv *)t)[i].key; }
static sh_str tensor_name(const void *t, uint64_t i) { return ((const sh_gguf_tensor *)t)[i].name; }

/* Makes room for entry i of a table of at most n entries that grows as entries are parsed:
 * a count the file cannot back then fails on the missing entries, not on a huge allocation.
 * Returns the (possibly moved) table, or NULL with SH_ENOMEM set and the old table intact. */
static void *table_grow(sh__gguf_reader *r, void *table, uint64_t *cap, uint64_t i, uint64_t n,
                        size_t elem)
{
    if (i < *cap)
        return table;
    uint64_t ncap = *cap ? *cap * 2 : 64, bytes;
    ncap = ncap < n ? ncap : n;
    void *p = NULL;
    if (!__builtin_mul_overflow(ncap, (uint64_t)elem, &bytes) && bytes <= SIZE_MAX)
        p = realloc(table, (size_t)bytes);
    if (!p) {
        sh__error_set(r->e, SH_ENOMEM, "%s: out of memory for %" PRIu64 " entries", r->where, ncap);
        return NULL;
    }
    memset((char *)p + *cap * elem, 0, (size_t)(ncap - *cap) * elem);
    *cap = ncap;
    return p;
}

static sh_err parse_header(sh__gguf_reader *r, sh_gguf *g)
{
    uint32_t magic;
    snprintf(r->where, sizeof r->where, "header");
    if (r->size < 4)
        return sh__error_set(r->e, SH_EFORMAT, "file is %" PRIu64 " bytes, too short for GGUF",
                             r->size);
    memcpy(&magic, r->base, 4);
    if (magic != SH_GGUF_MAGIC)
        return sh__error_set(r->e, SH_EFORMAT, "bad magic 0x%08" PRIx32 " (not a GGUF file)",
                             magic);
    r->pos = 4;
    sh_err err = sh__gguf_read_u32(r, "version", &g->version);
    if (err)
        return err;
    if (g->version == 1)
        return sh__error_set(r->e, SH_EUNSUPPORTED,
                             "GGUF version 1 is not supported (32-bit counts; convert the file "
                             "to version 3)");
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return sh__error_set(
            r->e, SH_EUNSUPPORTED,
            "big-endian GGUF files are not supported (version field 0x%08" PRIx32 ")", g->version);
    if (g->version != 2 && g->version != 3)
        return sh__error_set(r->e, SH_EUNSUPPORTED,
                             "GGUF version %" PRIu32 " is not supported (only 2 and 3)",
                             g->version);
    if ((err = sh__gguf_read_u64(r, "n_tensors", &g->n_tensors)) != SH_OK ||
        (err = sh__gguf_read_u64(r, "n_kv", &g->n_kv)) != SH_OK)
        return err;
    /* A key/value takes at least 13 bytes (key length, type, a one-byte value) and a tensor info
     * at least 32 (name length, n_dims, one dim, type, offset). */
    uint64_t left = r->size - r->pos;
    if (g->n_kv > left / 13)
        return sh__error_set(r->e, SH_EFORMAT,
                             "n_kv %" PRIu64 " cannot fit in the %" PRIu64
                             " bytes left in the file (truncated or corrupt)",
                             g->n_kv, left);
    if (g->n_tensors > left / 32 || g->n_tensors > (left - g->n_kv * 13) / 32)
        return sh__error_set(r->e, SH_EFORMAT,
                             "n_tensors %" PRIu64 " cannot fit in the %" PRIu64
                             " bytes left in the file (truncated or corrupt)",
                             g->n_tensors, left);
    return SH_OK;
}

static sh_err check_alignment(sh__gguf_reader *r, sh_gguf *g, const sh_gguf_kv *kv)
{
    if (kv->value.type != SH_GGUF_UINT32)
        return sh__error_set(r->e, SH_EFORMAT, "general.alignment has type %s, expected uint32",
                             sh_gguf_type_name(kv->value.type));
    uint64_t a = kv->value.v.u;
    if (a == 0 || (a & (a - 1)) != 0)
        return sh__error_set(r->e, SH_EFORMAT,
                             "general.alignment %" PRIu64 " is not a nonzero power of two", a);
    g->alignment = (uint32_t)a;
    return SH_OK;
}

static sh_err parse_kvs(sh__gguf_reader *r, sh_gguf *g)
{
    char name[96];
    uint64_t cap = 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        sh_gguf_kv *grown = table_grow(r, g->kvs, &cap, i, g->n_kv, sizeof *g->kvs);
        if (!grown)
            return SH_ENOMEM;
        g->kvs = grown;
        sh_gguf_kv *kv = &g->kvs[i];
        uint32_t type;
        snprintf(r->where, sizeof r->where, "kv %" PRIu64, i);
        sh_err err = sh__gguf_read_str(r, "key", &kv->key);
        if (err)
            return err;
        snprintf(r->where, sizeof r->where, "kv %" PRIu64 " '%s'", i,
                 sh__gguf_escape(kv->key, name, sizeof name));
        if ((err = sh__gguf_read_u32(r, "value type", &type)) != SH_OK ||
            (err = sh__gguf_read_value(r, type, &kv->value)) != SH_OK)
            return err;
        if (sh_str_eq(kv->key, "general.alignment") && (err = check_alignment(r, g, kv)) != SH_OK)
            return err;
    }
    uint64_t a, b;
    snprintf(r->where, sizeof r->where, "metadata");
    sh_err err = index_build(r, &g->kv_index, g->n_kv, kv_name, g->kvs, &a, &b);
    if (err == SH_EFORMAT)
        return sh__error_set(r->e, err, "kv %" PRIu64 ": duplicate key '%s' (also kv %" PRIu64 ")",
                             b, sh__gguf_escape(g->kvs[b].key, name, sizeof name), a);
    return err;
}

/* Reads one tensor info and checks what it says on its own: dims, type, block multiple, sizes
 * that fit in 64 bits, an aligned offset. Where the data lies is checked once all are read. */
static sh_err parse_tensor_info(sh__gguf_reader *r, sh_gguf *g, uint64_t i, sh_gguf_tensor *t)
{
    char name[96];
    snprintf(r->where, sizeof r->where, "tensor %" PRIu64, i);
    sh_err err = sh__gguf_read_str(r, "name", &t->name);
    if (err)
        return err;
    snprintf(r->where, sizeof r->where, "tensor %" PRIu64 " '%s'", i,
             sh__gguf_escape(t->name, name, sizeof name));
    if ((err = sh__gguf_read_u32(r, "n_dims", &t->n_dims)) != SH_OK)
        return err;
    if (t->n_dims == 0 || t->n_dims > SH_GGUF_MAX_DIMS)
        return sh__error_set(r->e, SH_EFORMAT, "%s: n_dims %" PRIu32 " (must be 1 to %d)", r->where,
                             t->n_dims, SH_GGUF_MAX_DIMS);
    t->n_elems = 1;
    for (uint32_t d = 0; d < SH_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims)
            continue;
        if ((err = sh__gguf_read_u64(r, "dimension", &t->ne[d])) != SH_OK)
            return err;
        /* ggml tolerates empty tensors, but no model has one; a zero is far likelier to be
         * corruption, so it is rejected. */
        if (t->ne[d] == 0)
            return sh__error_set(r->e, SH_EFORMAT, "%s: ne[%" PRIu32 "] is 0", r->where, d);
        if (__builtin_mul_overflow(t->n_elems, t->ne[d], &t->n_elems))
            return sh__error_set(r->e, SH_EFORMAT,
                                 "%s: element count overflows 64 bits at ne[%" PRIu32
                                 "] = %" PRIu64,
                                 r->where, d, t->ne[d]);
    }
    uint32_t type;
    uint64_t offset;
    if ((err = sh__gguf_read_u32(r, "type", &type)) != SH_OK ||
        (err = sh__gguf_read_u64(r, "offset", &offset)) != SH_OK)
        return err;
    const sh_dtype_info *info = sh__dtype_info(type);
    if (!info)
        return sh__error_set(r->e, SH_EUNSUPPORTED, "%s: unknown tensor type %" PRIu32, r->where,
                             type);
    t->type = (sh_dtype)type;
    if (t->ne[0] % info->block_elems != 0)
        return sh__error_set(r->e, SH_EFORMAT,
                             "%s: ne[0] %" PRIu64
                             " is not a multiple of the %s block size %" PRIu32,
                             r->where, t->ne[0], info->name, info->block_elems);
    if (__builtin_mul_overflow(t->n_elems / info->block_elems, (uint64_t)info->block_bytes,
                               &t->nbytes))
        return sh__error_set(r->e, SH_EFORMAT, "%s: byte size overflows 64 bits", r->where);
    if (offset % g->alignment != 0)
        return sh__error_set(r->e, SH_EFORMAT,
                             "%s: offset %" PRIu64 " is not a multiple of the alignment %" PRIu32,
                             r->where, offset, g->alignment);
    t->offset = offset;
    return SH_OK;
}

typedef struct extent {
    uint64_t begin, end, idx;
} extent;

static int extent_cmp(const void *a, const void *b)
{
    const extent *x = a, *y = b;
    /* Ties broken by index so that messages do not depend on the sort. */
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Every tensor's data lies inside the data section and no two overlap. */
static sh_err check_layout(sh__gguf_reader *r, sh_gguf *g)
{
    char n1[96], n2[96];
    snprintf(r->where, sizeof r->where, "tensors");
    extent *ex = sh__gguf_alloc(r, g->n_tensors, sizeof *ex);
    if (!ex && g->n_tensors)
        return SH_ENOMEM;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        sh_gguf_tensor *t = &g->tensors[i];
        uint64_t end;
        if (__builtin_add_overflow(t->offset, t->nbytes, &end))
            return sh__error_set(r->e, SH_EFORMAT,
                                 "tensor %" PRIu64 " '%s': offset %" PRIu64 " + %" PRIu64
                                 " bytes overflows 64 bits",
                                 i, sh__gguf_escape(t->name, n1, sizeof n1), t->offset, t->nbytes);
        if (end > g->data_size)
            return sh__error_set(r->e, SH_EFORMAT,
                                 "tensor %" PRIu64 " '%s': data [%" PRIu64 ", %" PRIu64
                                 ") beyond the data section (%" PRIu64 " bytes)",
                                 i, sh__gguf_escape(t->name, n1, sizeof n1), t->offset, end,
                                 g->data_size);
        t->data = r->base + g->data_offset + t->offset;
        ex[i] = (extent){t->offset, end, i};
    }
    if (g->n_tensors > 1)
        qsort(ex, g->n_tensors, sizeof *ex, extent_cmp);
    for (uint64_t k = 1; k < g->n_tensors; k++)
        if (ex[k].begin < ex[k - 1].end) {
            const extent *a = &ex[k - 1], *b = &ex[k];
            return sh__error_set(
                r->e, SH_EFORMAT,
                "tensor %" PRIu64 " '%s': data [%" PRIu64 ", %" PRIu64 ") overlaps tensor %" PRIu64
                " '%s' [%" PRIu64 ", %" PRIu64 ")",
                b->idx, sh__gguf_escape(g->tensors[b->idx].name, n1, sizeof n1), b->begin, b->end,
                a->idx, sh__gguf_escape(g->tensors[a->idx].name, n2, sizeof n2), a->begin, a->end);
        }
    return SH_OK;
}

static sh_err parse_tensors(sh__gguf_reader *r, sh_gguf *g)
{
    uint64_t cap = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        sh_gguf_tensor *grown = table_grow(r, g->tensors, &cap, i, g->n_tensors, sizeof *grown);
        if (!grown)
            return SH_ENOMEM;
        g->tensors = grown;
        sh_err err = parse_tensor_info(r, g, i, &g->tensors[i]);
        if (err)
            return err;
    }
    uint64_t a, b;
    char name[96];
    snprintf(r->where, sizeof r->where, "tensors");
    sh_err err = index_build(r, &g->tensor_index, g->n_tensors, tensor_name, g->tensors, &a, &b);
    if (err == SH_EFORMAT)
        return sh__error_set(r->e, err,
                             "tensor %" PRIu64 " '%s': duplicate name (also tensor %" PRIu64 ")", b,
                             sh__gguf_escape(g->tensors[b].name, name, sizeof name), a);
    if (err)
        return err;
    /* The data section starts at the next multiple of the alignment. A file without tensors may
     * end before that point (vocabulary-only files do). */
    uint64_t pad = (g->alignment - r->pos % g->alignment) % g->alignment;
    if (pad > r->size - r->pos) {
        if (g->n_tensors)
            return sh__error_set(r->e, SH_EFORMAT,
                                 "truncated: data section at offset %" PRIu64
                                 " starts past the end of the file (%" PRIu64 " bytes)",
                                 r->pos + pad, r->size);
        g->data_offset = r->size;
    } else {
        g->data_offset = r->pos + pad;
    }
    g->data_size = r->size - g->data_offset;
    return check_layout(r, g);
}

static sh_err parse(const uint8_t *buf, uint64_t size, sh_gguf *g, sh_error *e)
{
    sh__gguf_reader r = {.base = buf, .size = size, .e = e};
    r.alloc_left = size * ALLOC_PER_FILE_BYTE + ALLOC_SLACK; /* size is a mapping: no overflow */
    g->base = buf;
    g->size = size;
    g->alignment = SH_GGUF_DEFAULT_ALIGNMENT;
    sh_err err = parse_header(&r, g);
    if (!err)
        err = parse_kvs(&r, g);
    if (!err)
        err = parse_tensors(&r, g);
    g->arena = r.arena; /* freed by close, also on failure */
    return err;
}

static sh_err open_buffer(const uint8_t *buf, size_t size, sh_file_map map, sh_gguf **out,
                          sh_error *e)
{
    sh_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        sh__file_unmap(&map);
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    g->map = map;
    sh_error local = {0};
    sh_err err = parse(buf, size, g, e ? e : &local);
    if (err) {
        sh_gguf_close(g);
        return err;
    }
    *out = g;
    return SH_OK;
}

sh_err sh_gguf_open_mem(const void *buf, size_t size, sh_gguf **out, sh_error *e)
{
    *out = NULL;
    if (!buf && size)
        return sh__error_set(e, SH_EINVAL, "NULL buffer of %zu bytes", size);
    return open_buffer(buf, size, (sh_file_map){0}, out, e);
}

sh_err sh_gguf_open(const char *path, const sh_gguf_open_opts *opts, sh_gguf **out, sh_error *e)
{
    *out = NULL;
    sh_file_map map;
    sh_err err = sh__file_map(path, opts && opts->populate, &map, e);
    if (err)
        return err;
    err = open_buffer(map.data, map.size, map, out, e);
    if (err)
        sh__error_prefix(e, path);
    return err;
}

void sh_gguf_close(sh_gguf *g)
{
    if (!g)
        return;
    sh__gguf_arena_free(g->arena);
    free(g->kvs);
    free(g->tensors);
    sh__file_unmap(&g->map);
    free(g);
}

uint32_t sh_gguf_version(const sh_gguf *g) { return g->version; }
uint32_t sh_gguf_alignment(const sh_gguf *g) { return g->alignment; }
uint64_t sh_gguf_file_size(const sh_gguf *g) { return g->size; }
uint64_t sh_gguf_data_offset(const sh_gguf *g) { return g->data_offset; }
uint64_t sh_gguf_n_kv(const sh_gguf *g) { return g->n_kv; }

uint64_t sh_gguf_header_hash(const sh_gguf *g)
{
    // FNV-1a over 64 bits: the header pages are read once at start, so speed does not matter and
    // a dependency-free hash keeps every node computing the same value.
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t i = 0; i < g->data_offset && i < g->size; i++) {
        h ^= g->base[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
uint64_t sh_gguf_n_tensors(const sh_gguf *g) { return g->n_tensors; }

const sh_gguf_kv *sh_gguf_kv_at(const sh_gguf *g, uint64_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const sh_gguf_value *sh_gguf_find(const sh_gguf *g, const char *key)
{
    uint64_t i = index_find(&g->kv_index, key, kv_name, g->kvs);
    return i < g->n_kv ? &g->kvs[i].value : NULL;
}

const sh_gguf_tensor *sh_gguf_tensor_at(const sh_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const sh_gguf_tensor *sh_gguf_find_tensor(const sh_gguf *g, const char *name)
{
    uint64_t i = index_find(&g->tensor_index, name, tensor_name, g->tensors);
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}
