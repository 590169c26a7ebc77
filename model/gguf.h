/* GGUF reader: validates a GGUF v2/v3 file completely on open and exposes its metadata and
 * tensor table without copying; tensor data is used in place from the mapping. */
#ifndef SH_MODEL_GGUF_H
#define SH_MODEL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "shoal/err.h"

#define SH_GGUF_MAGIC 0x46554747u /* "GGUF" read as a little-endian uint32 */
#define SH_GGUF_DEFAULT_ALIGNMENT 32u
#define SH_GGUF_MAX_DIMS 4

/* Metadata value types, as numbered on disk. */
typedef enum sh_gguf_type {
    SH_GGUF_UINT8 = 0,
    SH_GGUF_INT8 = 1,
    SH_GGUF_UINT16 = 2,
    SH_GGUF_INT16 = 3,
    SH_GGUF_UINT32 = 4,
    SH_GGUF_INT32 = 5,
    SH_GGUF_FLOAT32 = 6,
    SH_GGUF_BOOL = 7,
    SH_GGUF_STRING = 8,
    SH_GGUF_ARRAY = 9,
    SH_GGUF_UINT64 = 10,
    SH_GGUF_INT64 = 11,
    SH_GGUF_FLOAT64 = 12,
    SH_GGUF_TYPE_COUNT_
} sh_gguf_type;

/* A string inside the file: not NUL-terminated, may contain any bytes. */
typedef struct sh_str {
    const char *ptr;
    uint64_t len;
} sh_str;

/* One metadata value. Scalars are widened into u/i/f/b; strings point into the mapping. */
typedef struct sh_gguf_value {
    sh_gguf_type type;
    union {
        uint64_t u; /* UINT8/16/32/64 */
        int64_t i;  /* INT8/16/32/64 */
        double f;   /* FLOAT32/64 */
        bool b;     /* BOOL */
        sh_str s;   /* STRING */
        struct {
            sh_gguf_type type; /* element type */
            uint64_t n;        /* element count */
            /* Fixed-size elements: n little-endian elements in the file, possibly unaligned; read
             * them with sh_gguf_arr_*(). NULL for STRING and ARRAY elements. */
            const void *raw;
            const sh_str *strs;               /* STRING elements, n of them; else NULL */
            const struct sh_gguf_value *vals; /* ARRAY elements (nested arrays); else NULL */
        } arr;
    } v;
} sh_gguf_value;

typedef struct sh_gguf_kv {
    sh_str key;
    sh_gguf_value value;
} sh_gguf_kv;

typedef struct sh_gguf_tensor {
    sh_str name;
    uint32_t n_dims;
    uint64_t ne[SH_GGUF_MAX_DIMS]; /* ne[0] is the contiguous (row) dimension; unused dims are 1 */
    sh_dtype type;
    uint64_t offset;  /* from the start of the data section, aligned */
    uint64_t n_elems; /* product of ne */
    uint64_t nbytes;  /* bytes of data */
    const void *data; /* into the mapping (or memory buffer), nbytes long */
} sh_gguf_tensor;

typedef struct sh_gguf sh_gguf;

typedef struct sh_gguf_open_opts {
    bool populate; /* ask the kernel to read the whole file at open (MAP_POPULATE) */
} sh_gguf_open_opts;

/* Opens and maps `path` and validates all of it: magic, version (2 or 3), counts and string
 * lengths against the file size, value types, nesting, alignment (a power of two), tensor
 * dimensions (no overflow of the element or byte count), known tensor types, rows that are whole
 * blocks, tensor data inside the data section and not overlapping. `opts` may be NULL.
 * On success *out owns the mapping. On failure returns SH_EIO, SH_EFORMAT (malformed),
 * SH_EUNSUPPORTED (version or tensor type) or SH_ENOMEM, fills e with one line naming the
 * offending field (e.g. "tensor 3 'blk.0.attn_q.weight': offset 123 + 4096 bytes beyond data
 * section of 1000 bytes") and leaves *out NULL. Any thread. */
sh_err sh_gguf_open(const char *path, const sh_gguf_open_opts *opts, sh_gguf **out, sh_error *e);

/* The same over a caller's buffer, which must outlive the handle and is not copied (fuzzing,
 * tests). */
sh_err sh_gguf_open_mem(const void *buf, size_t size, sh_gguf **out, sh_error *e);

/* Unmaps and frees; accepts NULL. Every pointer obtained from the handle dies with it. */
void sh_gguf_close(sh_gguf *g);

uint32_t sh_gguf_version(const sh_gguf *g);
uint32_t sh_gguf_alignment(const sh_gguf *g);
uint64_t sh_gguf_file_size(const sh_gguf *g);
uint64_t sh_gguf_data_offset(const sh_gguf *g); /* byte offset of the data section */
/* A 64-bit FNV-1a hash of the bytes before the data section (header, metadata and tensor table):
 * with the file size, the model file's identity that cluster nodes compare in HELLO. Reads the
 * mapping; any thread. */
uint64_t sh_gguf_header_hash(const sh_gguf *g);

uint64_t sh_gguf_n_kv(const sh_gguf *g);
const sh_gguf_kv *sh_gguf_kv_at(const sh_gguf *g, uint64_t i); /* NULL when i >= n_kv */
/* The value of `key` (exact match), or NULL. */
const sh_gguf_value *sh_gguf_find(const sh_gguf *g, const char *key);

uint64_t sh_gguf_n_tensors(const sh_gguf *g);
const sh_gguf_tensor *sh_gguf_tensor_at(const sh_gguf *g, uint64_t i); /* NULL when out of range */
const sh_gguf_tensor *sh_gguf_find_tensor(const sh_gguf *g, const char *name); /* NULL if none */

/* Typed getters. Each returns SH_ENOTFOUND when the key is absent, SH_EFORMAT when the value has
 * an incompatible type, SH_ERANGE when an integer does not fit; *out is untouched on failure.
 * Integer getters accept any integer type (and BOOL) whose value fits; get_f32 accepts floats
 * and integers. get_str returns a view into the mapping. */
sh_err sh_gguf_get_u32(const sh_gguf *g, const char *key, uint32_t *out);
sh_err sh_gguf_get_i32(const sh_gguf *g, const char *key, int32_t *out);
sh_err sh_gguf_get_u64(const sh_gguf *g, const char *key, uint64_t *out);
sh_err sh_gguf_get_f32(const sh_gguf *g, const char *key, float *out);
sh_err sh_gguf_get_bool(const sh_gguf *g, const char *key, bool *out);
sh_err sh_gguf_get_str(const sh_gguf *g, const char *key, sh_str *out);
/* The array under `key` whose element type is `elem_type`; SH_EFORMAT when it is not one. */
sh_err sh_gguf_get_arr(const sh_gguf *g, const char *key, sh_gguf_type elem_type,
                       const sh_gguf_value **out);

/* Element i of a fixed-size array value (caller checks i < arr.n and the element type class):
 * integers of any width widened, floats as double. */
uint64_t sh_gguf_arr_u64(const sh_gguf_value *arr, uint64_t i);
int64_t sh_gguf_arr_i64(const sh_gguf_value *arr, uint64_t i);
double sh_gguf_arr_f64(const sh_gguf_value *arr, uint64_t i);

/* Size in bytes of one element of a fixed-size type; 0 for STRING, ARRAY and unknown types. */
size_t sh_gguf_type_size(sh_gguf_type t);
/* "uint32", "string", ...; "?" when unknown. */
const char *sh_gguf_type_name(sh_gguf_type t);

/* True when s equals the NUL-terminated c. */
bool sh_str_eq(sh_str s, const char *c);

#endif
