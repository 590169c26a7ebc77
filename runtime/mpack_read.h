/* A strict, zero-copy msgpack reader over one caller-owned frame, with bounds and depth limits. */
#ifndef SH_RUNTIME_MPACK_READ_H
#define SH_RUNTIME_MPACK_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

/* Why our own reader and not msgpack_unpack(): msgpack-c's unpacker builds a tree of
 * msgpack_object in a zone, copying or referencing every value and allocating per frame; its
 * only limits are the ones we would have to check again afterwards. Frames come from peers we do
 * not trust and carry megabytes of activations, so the decoder must (1) never read outside
 * [base, end), (2) reject a declared length or element count the remaining bytes cannot hold
 * before anything acts on it, (3) bound nesting depth so recursion is bounded, (4) allocate
 * nothing, and (5) hand back `str` and `bin` payloads as pointers into the frame, so a tensor is
 * never copied. A pull reader that yields one item header at a time does all five in ~200 lines.
 *
 * Every function reads only bytes in [p, end) and advances p only past bytes it has checked. On
 * failure it returns SH_EFORMAT, sets r->fail, fills e with a one-line reason that names the
 * offset, and leaves p where the bad item starts. The reader holds no allocation; it is a value
 * that one thread uses for one frame. */

/* Hard cap on nesting so that the recursive skip cannot exhaust the stack whatever a caller
 * configures. */
#define SH_MPACK_DEPTH_MAX 64

typedef enum sh_mpack_kind {
    SH_MPACK_NIL,
    SH_MPACK_BOOL,
    SH_MPACK_UINT, /* any integer encoding holding a value >= 0 */
    SH_MPACK_INT,  /* any integer encoding holding a value < 0 */
    SH_MPACK_F32,
    SH_MPACK_F64,
    SH_MPACK_STR,
    SH_MPACK_BIN,
    SH_MPACK_ARRAY,
    SH_MPACK_MAP,
    SH_MPACK_EXT,
} sh_mpack_kind;

/* Why a read failed. */
typedef enum sh_mpack_fail {
    SH_MPACK_FAIL_NONE = 0,
    SH_MPACK_FAIL_TRUNCATED, /* a header, payload or declared count runs past the end */
    SH_MPACK_FAIL_INVALID,   /* the reserved byte 0xc1 */
    SH_MPACK_FAIL_DEPTH,     /* containers nested deeper than max_depth */
} sh_mpack_fail;

/* One item's header. For STR, BIN and EXT `ptr` points at the `len` payload bytes inside the
 * frame (already skipped by the reader); for ARRAY and MAP `len` counts elements or pairs that
 * follow, and the reader has checked that the remaining bytes could hold them (one byte per
 * element, two per pair). */
typedef struct sh_mpack_item {
    sh_mpack_kind kind;
    uint32_t len;
    const uint8_t *ptr;
    int8_t ext_type;
    union {
        bool b;
        uint64_t u; /* UINT */
        int64_t i;  /* INT */
        float f32;
        double f64;
    } v;
} sh_mpack_item;

typedef struct sh_mpack_reader {
    const uint8_t *base; /* start of the frame, for offsets in messages */
    const uint8_t *p;    /* next unread byte; base <= p <= end */
    const uint8_t *end;
    uint32_t max_depth; /* 1 = a top-level container may hold only scalars */
    sh_mpack_fail fail;
} sh_mpack_reader;

/* A reader over [data, data + len). max_depth is clamped to [1, SH_MPACK_DEPTH_MAX]. */
void sh__mpack_reader_init(sh_mpack_reader *r, const void *data, size_t len, uint32_t max_depth);

/* Reads the next item's header (and skips a str/bin/ext payload). Does not descend: after an
 * ARRAY or MAP header the caller reads (or skips) its elements. */
sh_err sh__mpack_next(sh_mpack_reader *r, sh_mpack_item *it, sh_error *e);

/* Skips one whole value, whose nesting depth is `depth` (the top level is 1): a container deeper
 * than max_depth fails with SH_MPACK_FAIL_DEPTH. */
sh_err sh__mpack_skip(sh_mpack_reader *r, uint32_t depth, sh_error *e);

/* Byte offset of the next unread byte. */
static inline size_t sh__mpack_offset(const sh_mpack_reader *r) { return (size_t)(r->p - r->base); }

/* Bytes left. */
static inline size_t sh__mpack_left(const sh_mpack_reader *r) { return (size_t)(r->end - r->p); }

/* "uint", "str", ...: for error messages. */
const char *sh__mpack_kind_name(sh_mpack_kind k);

#endif
