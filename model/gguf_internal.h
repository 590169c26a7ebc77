/* Internals shared by the GGUF reader's files (gguf.c: file structure; gguf_value.c: values). */
#ifndef SH_MODEL_GGUF_INTERNAL_H
#define SH_MODEL_GGUF_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

/* GGUF is little-endian on disk and we read it with plain loads; a big-endian host would need
 * byte swaps everywhere, so refuse to build there rather than misread files. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader supports little-endian hosts only"
#endif

/* Arrays may nest; deeper files are rejected so recursion stays bounded. */
#define SH_GGUF_MAX_DEPTH 16

/* One block of the arena that holds every parsed table; freed all at once on close, so error
 * paths cannot leak. */
typedef struct sh__gguf_block {
    struct sh__gguf_block *next;
    size_t used, cap;
    max_align_t data[]; /* cap bytes */
} sh__gguf_block;

/* A cursor over the file plus the state every parse step needs for errors and allocation. */
typedef struct sh__gguf_reader {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    sh_error *e;
    sh__gguf_block *arena;
    uint64_t alloc_left; /* allocation budget in bytes, proportional to the file size */
    char where[192];     /* the field being parsed, e.g. "kv 3 'general.name'" */
} sh__gguf_reader;

/* Zeroed memory of n * size bytes from the arena, or NULL with SH_ENOMEM set in r->e (also when
 * the product overflows or exceeds the budget). */
void *sh__gguf_alloc(sh__gguf_reader *r, uint64_t n, size_t size);
void sh__gguf_arena_free(sh__gguf_block *b);

/* Fails with SH_EFORMAT naming r->where and `what` unless n more bytes are left. */
sh_err sh__gguf_need(sh__gguf_reader *r, uint64_t n, const char *what);
/* Fixed-size little-endian reads; each checks the bytes are there first. */
sh_err sh__gguf_read_u32(sh__gguf_reader *r, const char *what, uint32_t *out);
sh_err sh__gguf_read_u64(sh__gguf_reader *r, const char *what, uint64_t *out);
/* A length-prefixed string, pointing into the buffer. */
sh_err sh__gguf_read_str(sh__gguf_reader *r, const char *what, sh_str *out);

/* Reads a value of `type` (already read from the file) into *out; arrays recursively. */
sh_err sh__gguf_read_value(sh__gguf_reader *r, uint32_t type, sh_gguf_value *out);

/* Writes s into buf (cap bytes) for an error message: quoted-free, non-printable bytes as \xNN,
 * cut to about 64 bytes with "...". Returns buf. */
const char *sh__gguf_escape(sh_str s, char *buf, size_t cap);

#endif
