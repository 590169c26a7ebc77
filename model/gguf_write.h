/* GGUF v3 writer: metadata of every value type, tensors whose bytes a callback produces at write
 * time (so multi-gigabyte files stream to disk), written to a temporary file and renamed. */
#ifndef SH_MODEL_GGUF_WRITE_H
#define SH_MODEL_GGUF_WRITE_H

#include <stdbool.h>
#include <stdint.h>

#include "base/dtype.h"
#include "model/gguf.h"
#include "shoal/err.h"

typedef struct sh_gguf_writer sh_gguf_writer;

/* What a fill callback is told about the tensor it fills. A row is ne[0] elements; rows are
 * numbered 0 .. n_rows-1 over ne[1] * ne[2] * ne[3] in file order. */
typedef struct sh_gguf_write_tensor {
    const char *name;
    uint64_t index; /* position in the tensor table (order of adding) */
    sh_dtype type;
    uint32_t n_dims;
    uint64_t ne[SH_GGUF_MAX_DIMS]; /* unused dims are 1 */
    uint64_t n_rows;
    uint64_t row_bytes;
    uint64_t nbytes; /* n_rows * row_bytes */
} sh_gguf_write_tensor;

/* Produces rows [row0, row0 + n_rows) of tensor t into dst (n_rows * t->row_bytes bytes, written
 * in full). Called from the thread that called sh__gguf_write_file, for each tensor in order and
 * for consecutive row ranges; the writer picks the ranges (whole rows, a few MiB at a time). A
 * non-SH_OK return (with e filled) aborts the write. */
typedef sh_err (*sh_gguf_write_fill_fn)(void *user, const sh_gguf_write_tensor *t, uint64_t row0,
                                        uint64_t n_rows, void *dst, sh_error *e);

/* Progress during sh__gguf_write_file: bytes written so far of the file's total. */
typedef void (*sh_gguf_write_progress_fn)(void *user, uint64_t done, uint64_t total);

/* An empty writer (no metadata, no tensors, alignment 32). SH_ENOMEM on failure. */
sh_err sh__gguf_write_create(sh_gguf_writer **out, sh_error *e);

/* Frees the writer and everything it copied; accepts NULL. Does not touch data that tensors
 * added with sh__gguf_write_add_tensor_data point to. */
void sh__gguf_write_destroy(sh_gguf_writer *w);

/* Metadata setters. Keys and values are copied. Setting an existing key replaces its value in
 * place (the key keeps its position). "general.alignment" must be a UINT32 power of two and sets
 * the data alignment. Each returns SH_EINVAL (empty key, bad type, bad alignment) or SH_ENOMEM,
 * leaving the writer as it was. */
sh_err sh__gguf_write_set_u8(sh_gguf_writer *w, const char *key, uint8_t v, sh_error *e);
sh_err sh__gguf_write_set_i8(sh_gguf_writer *w, const char *key, int8_t v, sh_error *e);
sh_err sh__gguf_write_set_u16(sh_gguf_writer *w, const char *key, uint16_t v, sh_error *e);
sh_err sh__gguf_write_set_i16(sh_gguf_writer *w, const char *key, int16_t v, sh_error *e);
sh_err sh__gguf_write_set_u32(sh_gguf_writer *w, const char *key, uint32_t v, sh_error *e);
sh_err sh__gguf_write_set_i32(sh_gguf_writer *w, const char *key, int32_t v, sh_error *e);
sh_err sh__gguf_write_set_u64(sh_gguf_writer *w, const char *key, uint64_t v, sh_error *e);
sh_err sh__gguf_write_set_i64(sh_gguf_writer *w, const char *key, int64_t v, sh_error *e);
sh_err sh__gguf_write_set_f32(sh_gguf_writer *w, const char *key, float v, sh_error *e);
sh_err sh__gguf_write_set_f64(sh_gguf_writer *w, const char *key, double v, sh_error *e);
sh_err sh__gguf_write_set_bool(sh_gguf_writer *w, const char *key, bool v, sh_error *e);
/* A NUL-terminated string (sh__gguf_write_set_value takes any bytes through an sh_str). */
sh_err sh__gguf_write_set_str(sh_gguf_writer *w, const char *key, const char *v, sh_error *e);
/* An array of n fixed-size elements of elem_type (not STRING or ARRAY), in host layout. */
sh_err sh__gguf_write_set_arr(sh_gguf_writer *w, const char *key, sh_gguf_type elem_type,
                              const void *data, uint64_t n, sh_error *e);
/* An array of n NUL-terminated strings. */
sh_err sh__gguf_write_set_arr_str(sh_gguf_writer *w, const char *key, const char *const *strs,
                                  uint64_t n, sh_error *e);
/* Any value, deep-copied: a value from an open reader (so one file's vocabulary can be copied
 * into another) or one built by hand, including nested arrays (element type ARRAY with `vals`,
 * each of type ARRAY). Scalars are narrowed to their type's width; fixed-size array elements are
 * read from `raw` as little-endian. Nesting deeper than 16 levels is SH_EINVAL. */
sh_err sh__gguf_write_set_value(sh_gguf_writer *w, const char *key, const sh_gguf_value *v,
                                sh_error *e);
/* Copies `key` and its value from reader g; SH_ENOTFOUND when g lacks it. */
sh_err sh__gguf_write_copy_kv(sh_gguf_writer *w, const sh_gguf *g, const char *key, sh_error *e);

/* Adds a tensor of n_dims (1..4) dims ne[0..n_dims-1] whose bytes `fill` produces at write time
 * (fill and user must stay valid until then). Returns SH_EINVAL for an empty name, one over 63
 * bytes, a duplicate name, a bad dim count, a zero dim, an unknown type, ne[0] not a multiple of
 * the type's block or a byte count past 2^62; SH_ENOMEM. */
sh_err sh__gguf_write_add_tensor(sh_gguf_writer *w, const char *name, sh_dtype type,
                                 uint32_t n_dims, const uint64_t *ne, sh_gguf_write_fill_fn fill,
                                 void *user, sh_error *e);
/* The same for bytes already in memory (the tensor's full size); not copied, so `data` must stay
 * valid until the file is written. */
sh_err sh__gguf_write_add_tensor_data(sh_gguf_writer *w, const char *name, sh_dtype type,
                                      uint32_t n_dims, const uint64_t *ne, const void *data,
                                      sh_error *e);

void sh__gguf_write_set_progress(sh_gguf_writer *w, sh_gguf_write_progress_fn fn, void *user);

/* Size in bytes the file will have with the current metadata and tensors. */
uint64_t sh__gguf_write_file_size(const sh_gguf_writer *w);

/* Writes the file: header, metadata, tensor table, then each tensor's data at an offset aligned
 * to general.alignment, the data section padded to the alignment at the end. The bytes go to a
 * temporary file beside `path` that is renamed over `path` only when everything succeeded; on
 * failure it is removed and `path` is untouched. Returns SH_EIO (errno text and the path in e),
 * SH_ENOMEM, or the error a fill callback returned (prefixed with the tensor's name). The writer
 * is unchanged and may write again. Blocks; one thread at a time per writer. */
sh_err sh__gguf_write_file(sh_gguf_writer *w, const char *path, sh_error *e);

#endif
