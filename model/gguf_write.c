/* GGUF v3 writer: metadata serialized as it is set, tensor data streamed from callbacks. */
#include "model/gguf_write.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"

/* GGUF is little-endian and we write host integers as they are. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF writer supports little-endian hosts only"
#endif

#define GGUF_VERSION 3u
#define MAX_TENSOR_NAME 63 /* ggml's GGML_MAX_NAME is 64 bytes including the NUL */
#define MAX_DEPTH 16
#define CHUNK_BYTES (8u << 20) /* rows are produced and written about this much at a time */
#define HEADER_BUF (1u << 20)

/* A growable byte string; `oom` latches the first allocation failure so puts can be chained. */
typedef struct bytes {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} bytes;

static void put(bytes *b, const void *src, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void put_u32(bytes *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(bytes *b, uint64_t v) { put(b, &v, 8); }
static void put_str(bytes *b, const char *s, uint64_t n)
{
    put_u64(b, n);
    put(b, s, (size_t)n);
}

typedef struct kv {
    char *key;
    bytes val; /* type id (u32) followed by the value, exactly as on disk */
} kv;

typedef struct tensor {
    sh_gguf_write_tensor info; /* info.name points to `name` */
    char name[MAX_TENSOR_NAME + 1];
    sh_gguf_write_fill_fn fill;
    void *user;
    const void *data; /* for add_tensor_data */
} tensor;

struct sh_gguf_writer {
    kv *kvs;
    size_t n_kv, cap_kv;
    tensor *tensors;
    size_t n_tensors, cap_tensors;
    uint32_t alignment;
    sh_gguf_write_progress_fn progress;
    void *progress_user;
};

sh_err sh__gguf_write_create(sh_gguf_writer **out, sh_error *e)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    (*out)->alignment = SH_GGUF_DEFAULT_ALIGNMENT;
    return SH_OK;
}

void sh__gguf_write_destroy(sh_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].val.p);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

/* Takes ownership of `val` (freeing it on failure) and stores it under key. */
static sh_err set_kv(sh_gguf_writer *w, const char *key, bytes *val, sh_error *e)
{
    if (val->oom) {
        free(val->p);
        return sh__error_set(e, SH_ENOMEM, "'%s': out of memory", key);
    }
    uint32_t type;
    memcpy(&type, val->p, 4);
    uint32_t align = 0;
    if (strcmp(key, "general.alignment") == 0) {
        if (type == SH_GGUF_UINT32)
            memcpy(&align, val->p + 4, 4);
        if (type != SH_GGUF_UINT32 || align == 0 || (align & (align - 1))) {
            free(val->p);
            return sh__error_set(e, SH_EINVAL,
                                 "general.alignment must be a uint32 power of two (got %s %u)",
                                 sh_gguf_type_name((sh_gguf_type)type), align);
        }
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].val.p);
            w->kvs[i].val = *val;
            if (align)
                w->alignment = align;
            return SH_OK;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        kv *p = realloc(w->kvs, cap * sizeof *p);
        if (!p) {
            free(val->p);
            return sh__error_set(e, SH_ENOMEM, "'%s': out of memory", key);
        }
        w->kvs = p;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(val->p);
        return sh__error_set(e, SH_ENOMEM, "'%s': out of memory", key);
    }
    w->kvs[w->n_kv++] = (kv){k, *val};
    if (align)
        w->alignment = align;
    return SH_OK;
}

static sh_err check_key(const char *key, sh_error *e)
{
    if (!key || !*key)
        return sh__error_set(e, SH_EINVAL, "metadata key is empty");
    return SH_OK;
}

static sh_err set_scalar(sh_gguf_writer *w, const char *key, sh_gguf_type t, const void *v,
                         sh_error *e)
{
    if (check_key(key, e))
        return SH_EINVAL;
    bytes b = {0};
    put_u32(&b, t);
    put(&b, v, sh_gguf_type_size(t));
    return set_kv(w, key, &b, e);
}

#define SETTER(suffix, ctype, tid)                                                                 \
    sh_err sh__gguf_write_set_##suffix(sh_gguf_writer *w, const char *key, ctype v, sh_error *e)   \
    {                                                                                              \
        return set_scalar(w, key, tid, &v, e);                                                     \
    }
SETTER(u8, uint8_t, SH_GGUF_UINT8)
SETTER(i8, int8_t, SH_GGUF_INT8)
SETTER(u16, uint16_t, SH_GGUF_UINT16)
SETTER(i16, int16_t, SH_GGUF_INT16)
SETTER(u32, uint32_t, SH_GGUF_UINT32)
SETTER(i32, int32_t, SH_GGUF_INT32)
SETTER(u64, uint64_t, SH_GGUF_UINT64)
SETTER(i64, int64_t, SH_GGUF_INT64)
SETTER(f32, float, SH_GGUF_FLOAT32)
SETTER(f64, double, SH_GGUF_FLOAT64)
#undef SETTER

sh_err sh__gguf_write_set_bool(sh_gguf_writer *w, const char *key, bool v, sh_error *e)
{
    uint8_t b = v ? 1 : 0; /* one byte on disk, whatever sizeof(bool) is */
    return set_scalar(w, key, SH_GGUF_BOOL, &b, e);
}

sh_err sh__gguf_write_set_str(sh_gguf_writer *w, const char *key, const char *v, sh_error *e)
{
    if (check_key(key, e))
        return SH_EINVAL;
    bytes b = {0};
    put_u32(&b, SH_GGUF_STRING);
    put_str(&b, v, strlen(v));
    return set_kv(w, key, &b, e);
}

static bool fixed_type(sh_gguf_type t) { return t < SH_GGUF_TYPE_COUNT_ && sh_gguf_type_size(t); }

sh_err sh__gguf_write_set_arr(sh_gguf_writer *w, const char *key, sh_gguf_type elem_type,
                              const void *data, uint64_t n, sh_error *e)
{
    if (check_key(key, e))
        return SH_EINVAL;
    if (!fixed_type(elem_type))
        return sh__error_set(e, SH_EINVAL, "'%s': array element type %s is not fixed-size", key,
                             sh_gguf_type_name(elem_type));
    size_t size = sh_gguf_type_size(elem_type);
    if (n > SIZE_MAX / size)
        return sh__error_set(e, SH_EINVAL, "'%s': array of %llu elements is too large", key,
                             (unsigned long long)n);
    bytes b = {0};
    put_u32(&b, SH_GGUF_ARRAY);
    put_u32(&b, elem_type);
    put_u64(&b, n);
    put(&b, data, (size_t)n * size);
    return set_kv(w, key, &b, e);
}

sh_err sh__gguf_write_set_arr_str(sh_gguf_writer *w, const char *key, const char *const *strs,
                                  uint64_t n, sh_error *e)
{
    if (check_key(key, e))
        return SH_EINVAL;
    bytes b = {0};
    put_u32(&b, SH_GGUF_ARRAY);
    put_u32(&b, SH_GGUF_STRING);
    put_u64(&b, n);
    for (uint64_t i = 0; i < n; i++)
        put_str(&b, strs[i], strlen(strs[i]));
    return set_kv(w, key, &b, e);
}

/* Serializes the body of value v of type t (without the type tag). */
static sh_err put_value(bytes *b, sh_gguf_type t, const sh_gguf_value *v, int depth, sh_error *e)
{
    switch (t) {
    case SH_GGUF_UINT8:
    case SH_GGUF_UINT16:
    case SH_GGUF_UINT32:
    case SH_GGUF_UINT64:
        put(b, &v->v.u, sh_gguf_type_size(t)); /* little-endian: the low bytes come first */
        return SH_OK;
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        put(b, &v->v.i, sh_gguf_type_size(t));
        return SH_OK;
    case SH_GGUF_FLOAT32: {
        float f = (float)v->v.f;
        put(b, &f, 4);
        return SH_OK;
    }
    case SH_GGUF_FLOAT64:
        put(b, &v->v.f, 8);
        return SH_OK;
    case SH_GGUF_BOOL: {
        uint8_t x = v->v.b ? 1 : 0;
        put(b, &x, 1);
        return SH_OK;
    }
    case SH_GGUF_STRING:
        if (v->v.s.len && !v->v.s.ptr)
            return sh__error_set(e, SH_EINVAL, "string of %llu bytes has no data",
                                 (unsigned long long)v->v.s.len);
        put_str(b, v->v.s.ptr, v->v.s.len);
        return SH_OK;
    case SH_GGUF_ARRAY:
        break;
    default:
        return sh__error_set(e, SH_EINVAL, "unknown value type %d", (int)t);
    }
    if (depth >= MAX_DEPTH)
        return sh__error_set(e, SH_EINVAL, "arrays nested deeper than %d levels", MAX_DEPTH);
    sh_gguf_type et = v->v.arr.type;
    uint64_t n = v->v.arr.n;
    put_u32(b, et);
    put_u64(b, n);
    if (fixed_type(et)) {
        size_t size = sh_gguf_type_size(et);
        if (n && (!v->v.arr.raw || n > SIZE_MAX / size))
            return sh__error_set(e, SH_EINVAL, "array of %llu %s elements has no data",
                                 (unsigned long long)n, sh_gguf_type_name(et));
        put(b, v->v.arr.raw, (size_t)n * size);
    } else if (et == SH_GGUF_STRING) {
        if (n && !v->v.arr.strs)
            return sh__error_set(e, SH_EINVAL, "string array has no elements");
        for (uint64_t i = 0; i < n; i++)
            put_str(b, v->v.arr.strs[i].ptr, v->v.arr.strs[i].len);
    } else if (et == SH_GGUF_ARRAY) {
        if (n && !v->v.arr.vals)
            return sh__error_set(e, SH_EINVAL, "nested array has no elements");
        for (uint64_t i = 0; i < n; i++) {
            if (v->v.arr.vals[i].type != SH_GGUF_ARRAY)
                return sh__error_set(e, SH_EINVAL, "element %llu of a nested array is a %s",
                                     (unsigned long long)i,
                                     sh_gguf_type_name(v->v.arr.vals[i].type));
            sh_err err = put_value(b, SH_GGUF_ARRAY, &v->v.arr.vals[i], depth + 1, e);
            if (err)
                return err;
        }
    } else {
        return sh__error_set(e, SH_EINVAL, "unknown array element type %d", (int)et);
    }
    return SH_OK;
}

sh_err sh__gguf_write_set_value(sh_gguf_writer *w, const char *key, const sh_gguf_value *v,
                                sh_error *e)
{
    if (check_key(key, e))
        return SH_EINVAL;
    bytes b = {0};
    put_u32(&b, v->type);
    sh_err err = put_value(&b, v->type, v, 0, e);
    if (err) {
        free(b.p);
        sh__error_prefix(e, key);
        return err;
    }
    return set_kv(w, key, &b, e);
}

sh_err sh__gguf_write_copy_kv(sh_gguf_writer *w, const sh_gguf *g, const char *key, sh_error *e)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return sh__error_set(e, SH_ENOTFOUND, "key '%s' not found", key);
    return sh__gguf_write_set_value(w, key, v, e);
}

static sh_err add_tensor(sh_gguf_writer *w, const char *name, sh_dtype type, uint32_t n_dims,
                         const uint64_t *ne, sh_gguf_write_fill_fn fill, void *user,
                         const void *data, sh_error *e)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > MAX_TENSOR_NAME)
        return sh__error_set(e, SH_EINVAL, "tensor name '%s' must be 1..%d bytes", name ? name : "",
                             MAX_TENSOR_NAME);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return sh__error_set(e, SH_EINVAL, "tensor '%s' added twice", name);
    const sh_dtype_info *info = sh__dtype_info((uint32_t)type);
    if (!info)
        return sh__error_set(e, SH_EINVAL, "tensor '%s': unknown type %d", name, (int)type);
    if (n_dims < 1 || n_dims > SH_GGUF_MAX_DIMS)
        return sh__error_set(e, SH_EINVAL, "tensor '%s': %u dims, want 1..%d", name, n_dims,
                             SH_GGUF_MAX_DIMS);
    sh_gguf_write_tensor t = {.index = w->n_tensors, .type = type, .n_dims = n_dims};
    uint64_t rows = 1;
    for (uint32_t d = 0; d < SH_GGUF_MAX_DIMS; d++) {
        t.ne[d] = d < n_dims ? ne[d] : 1;
        if (t.ne[d] == 0 || t.ne[d] > (1ull << 62))
            return sh__error_set(e, SH_EINVAL, "tensor '%s': dim %u is %llu", name, d,
                                 (unsigned long long)t.ne[d]);
        if (d > 0 && __builtin_mul_overflow(rows, t.ne[d], &rows))
            return sh__error_set(e, SH_EINVAL, "tensor '%s': too many elements", name);
    }
    if (t.ne[0] % info->block_elems)
        return sh__error_set(e, SH_EINVAL,
                             "tensor '%s': row of %llu elements is not a multiple of the %s "
                             "block of %u",
                             name, (unsigned long long)t.ne[0], info->name, info->block_elems);
    t.n_rows = rows;
    t.row_bytes = t.ne[0] / info->block_elems * info->block_bytes;
    if (__builtin_mul_overflow(t.row_bytes, rows, &t.nbytes) || t.nbytes > (1ull << 62))
        return sh__error_set(e, SH_EINVAL, "tensor '%s': too many bytes", name);
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 64;
        tensor *p = realloc(w->tensors, cap * sizeof *p);
        if (!p)
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        w->tensors = p;
        w->cap_tensors = cap;
    }
    tensor *dst = &w->tensors[w->n_tensors++];
    *dst = (tensor){.info = t, .fill = fill, .user = user, .data = data};
    memcpy(dst->name, name, len + 1);
    return SH_OK;
}

sh_err sh__gguf_write_add_tensor(sh_gguf_writer *w, const char *name, sh_dtype type,
                                 uint32_t n_dims, const uint64_t *ne, sh_gguf_write_fill_fn fill,
                                 void *user, sh_error *e)
{
    if (!fill)
        return sh__error_set(e, SH_EINVAL, "tensor '%s': no fill callback", name ? name : "");
    return add_tensor(w, name, type, n_dims, ne, fill, user, NULL, e);
}

sh_err sh__gguf_write_add_tensor_data(sh_gguf_writer *w, const char *name, sh_dtype type,
                                      uint32_t n_dims, const uint64_t *ne, const void *data,
                                      sh_error *e)
{
    if (!data)
        return sh__error_set(e, SH_EINVAL, "tensor '%s': no data", name ? name : "");
    return add_tensor(w, name, type, n_dims, ne, NULL, NULL, data, e);
}

void sh__gguf_write_set_progress(sh_gguf_writer *w, sh_gguf_write_progress_fn fn, void *user)
{
    w->progress = fn;
    w->progress_user = user;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The data section's offset and the file size. Tensor i's data starts at the running end of the
 * previous one rounded up to the alignment; write_header and the data loop follow the same rule. */
static void layout(const sh_gguf_writer *w, uint64_t *data_offset, uint64_t *file_size)
{
    uint64_t h = 4 + 4 + 8 + 8;
    for (size_t i = 0; i < w->n_kv; i++)
        h += 8 + strlen(w->kvs[i].key) + w->kvs[i].val.len;
    uint64_t d = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const tensor *t = &w->tensors[i];
        h += 8 + strlen(t->name) + 4 + 8ull * t->info.n_dims + 4 + 8;
        d = align_up(d, w->alignment) + t->info.nbytes;
    }
    *data_offset = align_up(h, w->alignment);
    *file_size = *data_offset + align_up(d, w->alignment);
}

uint64_t sh__gguf_write_file_size(const sh_gguf_writer *w)
{
    uint64_t off, size;
    layout(w, &off, &size);
    return size;
}

/* The output file: a descriptor plus the count of bytes written, for errors and progress. */
typedef struct out_file {
    int fd;
    const char *path;
    uint64_t done, total;
    const sh_gguf_writer *w;
} out_file;

static sh_err write_all(out_file *f, const void *p, size_t n, sh_error *e)
{
    const uint8_t *c = p;
    while (n) {
        ssize_t k = write(f->fd, c, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return sh__error_set(e, SH_EIO, "%s: write failed at byte %llu: %s", f->path,
                                 (unsigned long long)f->done,
                                 k < 0 ? strerror(errno) : "no progress");
        c += k;
        n -= (size_t)k;
        f->done += (uint64_t)k;
    }
    return SH_OK;
}

static sh_err write_zeros(out_file *f, uint64_t n, sh_error *e)
{
    static const uint8_t zeros[256];
    while (n) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        sh_err err = write_all(f, zeros, k, e);
        if (err)
            return err;
        n -= k;
    }
    return SH_OK;
}

static sh_err write_header(sh_gguf_writer *w, out_file *f, uint64_t data_offset, sh_error *e)
{
    bytes b = {0};
    uint64_t d = 0; /* running end of the data section */
    put_u32(&b, SH_GGUF_MAGIC);
    put_u32(&b, GGUF_VERSION);
    put_u64(&b, w->n_tensors);
    put_u64(&b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        put_str(&b, w->kvs[i].key, strlen(w->kvs[i].key));
        put(&b, w->kvs[i].val.p, w->kvs[i].val.len);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        const tensor *t = &w->tensors[i];
        put_str(&b, t->name, strlen(t->name));
        put_u32(&b, t->info.n_dims);
        for (uint32_t k = 0; k < t->info.n_dims; k++)
            put_u64(&b, t->info.ne[k]);
        put_u32(&b, (uint32_t)t->info.type);
        d = align_up(d, w->alignment);
        put_u64(&b, d);
        d += t->info.nbytes;
    }
    sh_err err = b.oom ? sh__error_set(e, SH_ENOMEM, "out of memory for the GGUF header")
                       : write_all(f, b.p, b.len, e);
    free(b.p);
    if (!err)
        err = write_zeros(f, data_offset - f->done, e);
    return err;
}

static sh_err write_tensor(sh_gguf_writer *w, out_file *f, tensor *t, uint8_t *buf,
                           uint64_t buf_rows_bytes, sh_error *e)
{
    t->info.name = t->name; /* the table may have moved since the tensor was added */
    const sh_gguf_write_tensor *ti = &t->info;
    uint64_t step = buf_rows_bytes / ti->row_bytes;
    for (uint64_t r = 0; r < ti->n_rows; r += step) {
        uint64_t n = ti->n_rows - r < step ? ti->n_rows - r : step;
        const void *src = buf;
        if (t->data) {
            src = (const uint8_t *)t->data + r * ti->row_bytes;
        } else {
            sh_err err = t->fill(t->user, ti, r, n, buf, e);
            if (err) {
                char what[MAX_TENSOR_NAME + 16];
                snprintf(what, sizeof what, "tensor '%s'", t->name);
                sh__error_prefix(e, what);
                return err;
            }
        }
        sh_err err = write_all(f, src, (size_t)(n * ti->row_bytes), e);
        if (err)
            return err;
        if (w->progress)
            w->progress(w->progress_user, f->done, f->total);
    }
    return SH_OK;
}

sh_err sh__gguf_write_file(sh_gguf_writer *w, const char *path, sh_error *e)
{
    uint64_t data_offset, file_size;
    layout(w, &data_offset, &file_size);

    /* The chunk buffer holds whole rows: at least one row, else about CHUNK_BYTES. */
    uint64_t buf_bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const sh_gguf_write_tensor *t = &w->tensors[i].info;
        if (w->tensors[i].data)
            continue;
        uint64_t want = t->row_bytes > CHUNK_BYTES ? t->row_bytes : CHUNK_BYTES;
        if (want > t->nbytes)
            want = t->nbytes;
        if (want > buf_bytes)
            buf_bytes = want;
    }
    uint8_t *buf = NULL;
    if (buf_bytes && !(buf = malloc((size_t)buf_bytes)))
        return sh__error_set(e, SH_ENOMEM, "out of memory for a %llu-byte write buffer",
                             (unsigned long long)buf_bytes);

    size_t plen = strlen(path);
    char *tmp = malloc(plen + 16);
    if (!tmp) {
        free(buf);
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    out_file f = {.fd = mkstemp(tmp), .path = tmp, .total = file_size, .w = w};
    if (f.fd < 0) {
        sh_err err = sh__error_set(e, SH_EIO, "%s: cannot create a temporary file: %s", path,
                                   strerror(errno));
        free(tmp);
        free(buf);
        return err;
    }
    /* mkstemp creates the file 0600; a model file is ordinary data. */
    (void)fchmod(f.fd, 0644);

    sh_err err = write_header(w, &f, data_offset, e);
    for (size_t i = 0; !err && i < w->n_tensors; i++) {
        tensor *t = &w->tensors[i];
        uint64_t at = data_offset + align_up(f.done - data_offset, w->alignment);
        err = write_zeros(&f, at - f.done, e);
        if (!err) {
            uint64_t chunk =
                t->data ? (t->info.nbytes > CHUNK_BYTES ? CHUNK_BYTES : t->info.nbytes) : buf_bytes;
            if (chunk < t->info.row_bytes)
                chunk = t->info.row_bytes;
            err = write_tensor(w, &f, t, buf, chunk, e);
        }
    }
    if (!err)
        err = write_zeros(&f, file_size - f.done, e);
    if (!err && w->progress)
        w->progress(w->progress_user, f.done, f.total);
    if (close(f.fd) != 0 && !err)
        err = sh__error_set(e, SH_EIO, "%s: close failed: %s", tmp, strerror(errno));
    if (!err && rename(tmp, path) != 0)
        err = sh__error_set(e, SH_EIO, "%s: cannot rename %s into place: %s", path, tmp,
                            strerror(errno));
    if (err)
        unlink(tmp);
    free(tmp);
    free(buf);
    return err;
}
