/* A minimal msgpack writer into a growable (or fixed) byte buffer, used by the wire codec. */
#ifndef SH_RUNTIME_MPACK_WRITE_H
#define SH_RUNTIME_MPACK_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Why our own writer and not msgpack-c's packer: the packer writes through a callback per item
 * into an sbuffer that may realloc at any call; ours writes straight into one caller-owned buffer
 * with a sticky failure flag, so an encoder checks once at the end and can roll back a half
 * written frame. It always emits the shortest encoding of each value (the same choice msgpack-c
 * makes), so decoding and re-encoding a canonical frame gives the same bytes. The tests use
 * msgpack-c as the independent encoder to prove the two agree.
 *
 * An sh_buf is a byte buffer that one thread owns. A growable buffer reallocates (doubling) only
 * when a frame does not fit, and sh__buf_reset() keeps the capacity, so a sender that reuses one
 * buffer stops allocating once the buffer has reached its largest frame. A fixed buffer wraps
 * caller memory and never allocates; overflowing it sets `failed`.
 *
 * Invariants: len <= cap; data is NULL only when cap is 0. Once `failed` is set every write is a
 * no-op until sh__buf_reset() or the caller rolls back with sh__buf_truncate(). */
typedef struct sh_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
    bool fixed;  /* caller memory: never reallocated or freed */
    bool failed; /* a write did not fit (fixed) or realloc failed (growable) */
} sh_buf;

/* An empty growable buffer; allocates nothing yet. */
void sh__buf_init(sh_buf *b);

/* A buffer over caller memory `mem` of `cap` bytes that never grows; the caller keeps `mem`. */
void sh__buf_init_fixed(sh_buf *b, void *mem, size_t cap);

/* Frees a growable buffer's memory (not a fixed buffer's) and zeroes *b; accepts a zeroed b. */
void sh__buf_fini(sh_buf *b);

/* Empties the buffer and clears `failed`, keeping the capacity. */
void sh__buf_reset(sh_buf *b);

/* Shrinks len back to `len` (<= b->len) and clears `failed`: rolls back a failed frame. */
void sh__buf_truncate(sh_buf *b, size_t len);

/* Makes room for n more bytes and returns a pointer to them (len grows by n), or NULL with
 * `failed` set when the buffer cannot hold them. The bytes are uninitialised. */
uint8_t *sh__buf_append(sh_buf *b, size_t n);

/* Values, each in its shortest msgpack encoding. Lengths above UINT32_MAX cannot be encoded in
 * msgpack and set `failed`. */
void sh__mpack_put_nil(sh_buf *b);
void sh__mpack_put_bool(sh_buf *b, bool v);
void sh__mpack_put_uint(sh_buf *b, uint64_t v);
void sh__mpack_put_int(sh_buf *b, int64_t v); /* non-negative values use the uint forms */
void sh__mpack_put_f32(sh_buf *b, float v);
void sh__mpack_put_f64(sh_buf *b, double v);
void sh__mpack_put_str(sh_buf *b, const char *s, size_t n);
void sh__mpack_put_bin(sh_buf *b, const void *p, size_t n);
void sh__mpack_put_array(sh_buf *b, size_t n); /* header; n values follow */
void sh__mpack_put_map(sh_buf *b, size_t n);   /* header; n key/value pairs follow */

/* Writes a bin header for n bytes and returns where its payload goes (n bytes to fill in
 * place), or NULL with `failed` set. Lets a producer write a tensor straight into the frame. */
uint8_t *sh__mpack_put_bin_reserve(sh_buf *b, size_t n);

#endif
