/* `shoal quantize`'s library half: llama-quantize --pure's choice of tensors and types, and the
 * streaming rewrite of a GGUF file through the writer, rows converted on a few threads. */
#include "model/quantize.h"

#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/threads.h"
#include "kernels/cpu/quant.h"
#include "model/gguf_write.h"

/* ---- Which tensors, which type ------------------------------------------------------------ */

/* Substrings that exclude a tensor from quantization wherever they appear in its name: llama.cpp's
 * tensor_allows_quantization list (llama-quant.cpp), which keeps small or precision-critical
 * tensors (MoE routers and routing tables, convolution kernels, RWKV mixing vectors, relative
 * position biases, vision and audio tensors) in their original type. */
static const char *const never[] = {
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
};

/* The same, for the glm5-next architecture only. */
static const char *const never_glm5[] = {
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
};

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

/* ggml_n_dims: the dims up to the last one above 1 (at least 1), whatever the file declares. */
static uint32_t effective_dims(uint32_t n_dims, const uint64_t *ne)
{
    uint32_t d = 1;
    for (uint32_t i = 1; i < n_dims && i < SH_GGUF_MAX_DIMS; i++)
        if (ne[i] > 1)
            d = i + 1;
    return d;
}

static bool is_matrix_weight(const char *arch, const char *name, uint32_t n_dims,
                             const uint64_t *ne)
{
    if (effective_dims(n_dims, ne) < 2 || !ends_with(name, "weight"))
        return false;
    if (strcmp(name, "position_embd.weight") == 0 || strcmp(name, "token_types.weight") == 0)
        return false;
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
        if (strstr(name, never[i]))
            return false;
    if (strcmp(arch, "glm5-next") == 0)
        for (size_t i = 0; i < sizeof never_glm5 / sizeof never_glm5[0]; i++)
            if (strstr(name, never_glm5[i]))
                return false;
    return true;
}

/* tensor_type_fallback: a type whose block divides a row of ne0 elements. */
static sh_dtype fallback(sh_dtype target, uint64_t ne0, bool *fell)
{
    const sh_dtype_info *ti = sh__dtype_info(target);
    *fell = false;
    if (ne0 % ti->block_elems == 0)
        return target;
    *fell = true;
    sh_dtype t = target;
    switch (target) {
    case SH_DTYPE_Q2_K:
    case SH_DTYPE_Q3_K:
        t = SH_DTYPE_Q4_0;
        break;
    case SH_DTYPE_Q4_K:
        t = SH_DTYPE_Q5_0;
        break;
    case SH_DTYPE_Q5_K:
        t = SH_DTYPE_Q5_1;
        break;
    case SH_DTYPE_Q6_K:
        t = SH_DTYPE_Q8_0;
        break;
    case SH_DTYPE_IQ4_XS:
        t = SH_DTYPE_IQ4_NL;
        break;
    default: /* a 32-block type has no smaller block to fall back to */
        break;
    }
    return ne0 % sh__dtype_info(t)->block_elems == 0 ? t : SH_DTYPE_F16;
}

sh_dtype sh__quantize_plan_tensor(const char *arch, const char *name, uint32_t n_dims,
                                  const uint64_t *ne, sh_dtype cur, sh_dtype target,
                                  const char *const *keep, size_t n_keep, sh_quantize_why *why)
{
    sh_quantize_why w;
    sh_dtype to = cur;
    bool kept = false;
    for (size_t i = 0; i < n_keep && !kept; i++)
        kept = fnmatch(keep[i], name, 0) == 0;
    if (kept) {
        w = SH_QUANTIZE_KEEP;
    } else if (!is_matrix_weight(arch ? arch : "", name, n_dims, ne)) {
        w = SH_QUANTIZE_NOT_MATRIX;
    } else {
        bool fell = false;
        to = sh__dtype_info(target)->block_elems > 1 ? fallback(target, ne[0], &fell) : target;
        w = to == cur ? SH_QUANTIZE_SAME : fell ? SH_QUANTIZE_FALLBACK : SH_QUANTIZE_CONVERT;
    }
    if (why)
        *why = w;
    return to;
}

bool sh__quantize_target_ok(sh_dtype t) { return sh__quantize_file_type(t) >= 0; }

int32_t sh__quantize_file_type(sh_dtype t)
{
    switch (t) { /* llama_ftype; the K names are llama-quantize's aliases (Q4_K = Q4_K_M) */
    case SH_DTYPE_F32:
        return 0;
    case SH_DTYPE_F16:
        return 1;
    case SH_DTYPE_Q4_0:
        return 2;
    case SH_DTYPE_Q4_1:
        return 3;
    case SH_DTYPE_Q8_0:
        return 7;
    case SH_DTYPE_Q5_0:
        return 8;
    case SH_DTYPE_Q5_1:
        return 9;
    case SH_DTYPE_Q2_K:
        return 10;
    case SH_DTYPE_Q3_K:
        return 12;
    case SH_DTYPE_Q4_K:
        return 15;
    case SH_DTYPE_Q5_K:
        return 17;
    case SH_DTYPE_Q6_K:
        return 18;
    case SH_DTYPE_IQ4_NL:
        return 25;
    case SH_DTYPE_IQ4_XS:
        return 30;
    case SH_DTYPE_BF16:
        return 32;
    default:
        return -1;
    }
}

void sh__quantize_opts_init(sh_quantize_opts *o)
{
    memset(o, 0, sizeof *o);
    o->type = SH_DTYPE_F16;
    o->n_threads = 1;
}

/* ---- Conversion ---------------------------------------------------------------------------- */

/* One output tensor: where its input is and what it becomes. */
typedef struct job_tensor {
    const sh_gguf_tensor *src;
    sh_dtype to;
    sh_quantize_why why;
    uint64_t src_row_bytes;
    uint64_t out_bytes;
} job_tensor;

typedef struct conv_ctx {
    const sh_quantize_opts *o;
    job_tensor *jt; /* one per tensor, in file order */
    uint64_t n;
    uint64_t out_done, out_total; /* output tensor bytes before the current tensor, in all */
} conv_ctx;

typedef struct row_job {
    const job_tensor *t;
    uint64_t ne0;
    uint64_t row0, n_rows;
    uint64_t dst_row_bytes;
    uint8_t *dst;
    sh_err err;
} row_job;

/* Each row goes through float: widened exactly (sh__dequant_row matches ggml's to_float, and F32
 * rows are copied, which also takes care of rows the file does not align to 4 bytes), then
 * narrowed with the reference quantizer, as llama-quantize does. */
static void *convert_rows(void *arg)
{
    row_job *j = arg;
    float *row = malloc((size_t)j->ne0 * sizeof *row);
    if (!row) {
        j->err = SH_ENOMEM;
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)j->t->src->data + j->row0 * j->t->src_row_bytes;
    for (uint64_t r = 0; r < j->n_rows && !j->err; r++) {
        j->err =
            sh__dequant_row(j->t->src->type, src + r * j->t->src_row_bytes, row, (int64_t)j->ne0);
        if (!j->err)
            j->err = sh__quant_row(j->t->to, row, j->dst + r * j->dst_row_bytes, (int64_t)j->ne0);
    }
    free(row);
    return NULL;
}

/* Each tensor's input is read once, in order: once it is written, its pages of the mapping are
 * dropped so that the resident memory stays about one tensor however large the model (the
 * mapping is read-only, so the kernel only forgets clean pages; reading them again would reload
 * them from the file). */
static void release_input(const sh_gguf_tensor *t)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        return;
    uintptr_t a = (uintptr_t)t->data, b = a + (uintptr_t)t->nbytes;
    a = (a + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    b &= ~((uintptr_t)page - 1);
    if (b > a)
        (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

static sh_err copy_rows(const job_tensor *t, uint64_t row0, uint64_t n_rows, void *dst);
static sh_err convert(const conv_ctx *c, const job_tensor *t, const sh_gguf_write_tensor *wt,
                      uint64_t row0, uint64_t n_rows, void *dst, sh_error *e);

static sh_err fill(void *user, const sh_gguf_write_tensor *wt, uint64_t row0, uint64_t n_rows,
                   void *dst, sh_error *e)
{
    conv_ctx *c = user;
    const job_tensor *t = &c->jt[wt->index];
    if (row0 == 0 && c->o->progress) {
        sh_quantize_tensor_info info = {wt->index,      c->n,         wt->name,    t->src->type,
                                        t->to,          t->why,       wt->n_dims,  wt->ne,
                                        t->src->nbytes, t->out_bytes, c->out_done, c->out_total};
        c->o->progress(c->o->progress_user, &info);
    }
    sh_err err = t->to == t->src->type ? copy_rows(t, row0, n_rows, dst)
                                       : convert(c, t, wt, row0, n_rows, dst, e);
    if (!err && row0 + n_rows == wt->n_rows) {
        c->out_done += t->out_bytes;
        release_input(t->src);
    }
    return err;
}

static sh_err copy_rows(const job_tensor *t, uint64_t row0, uint64_t n_rows, void *dst)
{
    memcpy(dst, (const uint8_t *)t->src->data + row0 * t->src_row_bytes,
           (size_t)(n_rows * t->src_row_bytes));
    return SH_OK;
}

/* Converts rows [row0, row0 + n_rows) on up to n_threads threads, in contiguous shares. */
static sh_err convert(const conv_ctx *c, const job_tensor *t, const sh_gguf_write_tensor *wt,
                      uint64_t row0, uint64_t n_rows, void *dst, sh_error *e)
{
    int nt = sh__threads_count(c->o->n_threads, n_rows);
    row_job jobs[SH_THREADS_MAX];
    for (int i = 0; i < nt; i++) {
        uint64_t a = n_rows * (uint64_t)i / (uint64_t)nt,
                 b = n_rows * (uint64_t)(i + 1) / (uint64_t)nt;
        jobs[i] = (row_job){t,     wt->ne[0],     row0 + a,
                            b - a, wt->row_bytes, (uint8_t *)dst + a * wt->row_bytes,
                            SH_OK};
    }
    sh__threads_run(nt, convert_rows, jobs, sizeof jobs[0]);
    for (int i = 0; i < nt; i++)
        if (jobs[i].err)
            return sh__error_set(e, jobs[i].err, "cannot convert %s rows to %s: %s",
                                 sh__dtype_name(t->src->type), sh__dtype_name(t->to),
                                 sh_strerror(jobs[i].err));
    return SH_OK;
}

/* A NUL-terminated copy of a key or name from the file; SH_EUNSUPPORTED for one with a NUL byte
 * inside (the writer takes C strings). */
static sh_err cstr(sh_str s, const char *what, char **out, sh_error *e)
{
    if (memchr(s.ptr, 0, (size_t)s.len))
        return sh__error_set(e, SH_EUNSUPPORTED, "%s '%.*s' contains a NUL byte", what,
                             (int)strnlen(s.ptr, (size_t)s.len), s.ptr);
    char *c = malloc((size_t)s.len + 1);
    if (!c)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    memcpy(c, s.ptr, (size_t)s.len);
    c[s.len] = 0;
    *out = c;
    return SH_OK;
}

/* Copies every key but the split ones, then sets the two quantization keys. */
static sh_err copy_metadata(sh_gguf_writer *w, const sh_gguf *g, sh_dtype target, sh_error *e)
{
    uint64_t parts = 1;
    if (sh_gguf_find(g, "split.count") && sh_gguf_get_u64(g, "split.count", &parts) == SH_OK &&
        parts > 1)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "key split.count: a model split in %llu files; merge it first "
                             "(llama-gguf-split --merge)",
                             (unsigned long long)parts);
    sh_err err = SH_OK;
    for (uint64_t i = 0; !err && i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        if (sh_str_eq(kv->key, "split.no") || sh_str_eq(kv->key, "split.count") ||
            sh_str_eq(kv->key, "split.tensors.count"))
            continue;
        char *key = NULL;
        if ((err = cstr(kv->key, "key", &key, e)))
            break;
        err = sh__gguf_write_set_value(w, key, &kv->value, e);
        if (err)
            sh__error_prefix(e, key);
        free(key);
    }
    if (!err)
        err = sh__gguf_write_set_u32(w, "general.quantization_version", 2, e);
    if (!err)
        err = sh__gguf_write_set_u32(w, "general.file_type",
                                     (uint32_t)sh__quantize_file_type(target), e);
    return err;
}

/* Plans every tensor and adds it to the writer. */
static sh_err add_tensors(sh_gguf_writer *w, const sh_gguf *g, conv_ctx *c, sh_quantize_result *r,
                          sh_error *e)
{
    const sh_quantize_opts *o = c->o;
    char arch[64] = "";
    sh_str a;
    if (sh_gguf_get_str(g, "general.architecture", &a) == SH_OK)
        snprintf(arch, sizeof arch, "%.*s", (int)(a.len < 63 ? a.len : 63), a.ptr);
    for (uint64_t i = 0; i < c->n; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        job_tensor *jt = &c->jt[i];
        char *name = NULL;
        sh_err err = cstr(t->name, "tensor", &name, e);
        if (err)
            return err;
        jt->src = t;
        jt->to = sh__quantize_plan_tensor(arch, name, t->n_dims, t->ne, t->type, o->type, o->keep,
                                          o->n_keep, &jt->why);
        jt->src_row_bytes = sh__dtype_row_bytes(t->type, t->ne[0]);
        uint64_t rows = t->n_elems / t->ne[0];
        jt->out_bytes = rows * sh__dtype_row_bytes(jt->to, t->ne[0]);
        if (jt->to != t->type && !sh__quant_supported(t->type))
            err = sh__error_set(e, SH_EUNSUPPORTED,
                                "tensor '%s': cannot convert from type %s (shoal cannot read it; "
                                "--keep '%s' copies it as it is)",
                                name, sh__dtype_name(t->type), name);
        if (!err)
            err = sh__gguf_write_add_tensor(w, name, jt->to, t->n_dims, t->ne, fill, c, e);
        free(name);
        if (err)
            return err;
        r->n_converted += jt->to != t->type;
        r->n_fallback += jt->why == SH_QUANTIZE_FALLBACK;
        r->n_kept += jt->why == SH_QUANTIZE_KEEP;
        r->in_tensor_bytes += t->nbytes;
        r->out_tensor_bytes += jt->out_bytes;
        r->n_elems += t->n_elems;
    }
    c->out_total = r->out_tensor_bytes;
    return SH_OK;
}

sh_err sh__quantize_file(const char *in, const char *out, const sh_quantize_opts *o,
                         sh_quantize_result *res, sh_error *e)
{
    if (!sh__quantize_target_ok(o->type))
        return sh__error_set(e, SH_EINVAL, "cannot quantize to type %s", sh__dtype_name(o->type));
    /* Checked before the long work: the writer would only find out when it renames. */
    struct stat si, so;
    bool have_in = stat(in, &si) == 0, have_out = stat(out, &so) == 0;
    if (have_in && have_out && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
        return sh__error_set(e, SH_EINVAL, "%s: the output is the input file", out);
    if (have_out && S_ISDIR(so.st_mode))
        return sh__error_set(e, SH_EINVAL, "%s: the output is a directory", out);

    sh_gguf *g = NULL;
    sh_err err = sh_gguf_open(in, NULL, &g, e); /* its errors name the file */
    if (err)
        return err;
    sh_quantize_result r = {0};
    r.n_tensors = sh_gguf_n_tensors(g);
    r.in_file_bytes = sh_gguf_file_size(g);
    conv_ctx c = {.o = o, .n = r.n_tensors};
    sh_gguf_writer *w = NULL;
    c.jt = calloc(c.n ? c.n : 1, sizeof *c.jt);
    if (!c.jt)
        err = sh__error_set(e, SH_ENOMEM, "out of memory");
    if (!err)
        err = sh__gguf_write_create(&w, e);
    if (!err && (err = copy_metadata(w, g, o->type, e)))
        sh__error_prefix(e, in);
    if (!err && (err = add_tensors(w, g, &c, &r, e)))
        sh__error_prefix(e, in);
    if (!err) {
        r.out_file_bytes = sh__gguf_write_file_size(w);
        err = sh__gguf_write_file(w, out, e);
    }
    sh__gguf_write_destroy(w);
    free(c.jt);
    sh_gguf_close(g);
    if (!err && res)
        *res = r;
    return err;
}
