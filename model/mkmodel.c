/* Synthetic Llama GGUF models: metadata, a byte-level BPE vocabulary, seeded weights streamed
 * through the GGUF writer and quantized on a few threads. */
#include "model/mkmodel.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "kernels/cpu/quant.h"
#include "model/gguf.h"

static const sh_mkmodel_shape shapes[] = {
    {"smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0f, 1e-5f, true, 0},
    {"tinyllama-1.1b", 22, 2048, 5632, 32, 4, 32000, 2048, 10000.0f, 1e-5f, false, 0},
    {"llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0f, 1e-5f, false, 0},
};

const sh_mkmodel_shape *sh__mkmodel_shapes(size_t *n)
{
    *n = sizeof shapes / sizeof shapes[0];
    return shapes;
}

const sh_mkmodel_shape *sh__mkmodel_shape_find(const char *name)
{
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (strcmp(shapes[i].name, name) == 0)
            return &shapes[i];
    return NULL;
}

void sh__mkmodel_opts_init(sh_mkmodel_opts *o)
{
    memset(o, 0, sizeof *o);
    o->shape.name = "custom";
    o->shape.rope_base = 10000.0f;
    o->shape.rms_eps = 1e-5f;
    o->type = SH_DTYPE_F16;
    o->seed = 1;
    o->std = 0.02f;
    o->n_threads = 2;
}

int32_t sh__mkmodel_file_type(sh_dtype t)
{
    switch (t) { /* llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q4_0, ... */
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
    case SH_DTYPE_BF16:
        return 32;
    case SH_DTYPE_Q5_0:
        return 8;
    case SH_DTYPE_Q5_1:
        return 9;
    case SH_DTYPE_Q2_K:
        return 10;
    case SH_DTYPE_Q3_K: /* the K files are one type throughout: the _S variants' numbers */
        return 11;
    case SH_DTYPE_Q4_K:
        return 14;
    case SH_DTYPE_Q5_K:
        return 16;
    case SH_DTYPE_Q6_K:
        return 18;
    default:
        return -1;
    }
}

/* ---- Random numbers ------------------------------------------------------------------------ */

/* splitmix64: seeds xoshiro and mixes the (seed, tensor, row) key. */
static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct xoshiro {
    uint64_t s[4];
} xoshiro;

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256**: fast, and any 4 splitmix64 outputs are a valid (non-zero) state. */
static uint64_t xoshiro_next(xoshiro *x)
{
    uint64_t *s = x->s;
    const uint64_t r = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Each row has its own generator keyed by (seed, tensor, row), so the values do not depend on
 * which thread makes the row or how the writer chunks the tensor. */
static void row_rng(xoshiro *x, uint64_t seed, uint64_t tensor, uint64_t row)
{
    uint64_t k = seed;
    uint64_t a = splitmix64(&k);
    k = a ^ (tensor * 0xd1b54a32d192ed03ull) ^ (row * 0xaef17502108ef2d9ull);
    for (int i = 0; i < 4; i++)
        x->s[i] = splitmix64(&k);
}

/* n normal samples with mean `mean` and deviation `std` by Box-Muller: for u1 in (0, 1] and u2 in
 * [0, 1), r = sqrt(-2 ln u1) and the angle 2 pi u2 give two independent N(0, 1) values as
 * r cos and r sin. 24-bit uniforms bound |z| below 5.8. */
static void normals(xoshiro *x, float *out, uint64_t n, float mean, float std)
{
    const float two_pi = 6.28318530717958647692f, inv24 = 1.0f / 16777216.0f;
    for (uint64_t i = 0; i < n; i += 2) {
        uint64_t bits = xoshiro_next(x);
        float u1 = (float)((bits >> 40) + 1) * inv24;
        float u2 = (float)((bits >> 16) & 0xffffff) * inv24;
        float r = sqrtf(-2.0f * logf(u1)) * std;
        out[i] = mean + r * cosf(two_pi * u2);
        if (i + 1 < n)
            out[i + 1] = mean + r * sinf(two_pi * u2);
    }
}

/* ---- Weights ------------------------------------------------------------------------------- */

typedef struct gen_ctx {
    const sh_mkmodel_opts *o;
} gen_ctx;

typedef struct gen_job {
    const sh_mkmodel_opts *o;
    const sh_gguf_write_tensor *t;
    uint64_t row0, n_rows;
    uint8_t *dst;
    sh_err err;
} gen_job;

static void *gen_rows(void *arg)
{
    gen_job *j = arg;
    const sh_gguf_write_tensor *t = j->t;
    float *row = malloc((size_t)t->ne[0] * sizeof *row);
    if (!row) {
        j->err = SH_ENOMEM;
        return NULL;
    }
    /* 1-D tensors are the RMSNorm weights: near 1 so activations keep their scale. */
    const float mean = t->n_dims == 1 ? 1.0f : 0.0f;
    for (uint64_t r = 0; r < j->n_rows; r++) {
        xoshiro x;
        row_rng(&x, j->o->seed, t->index, j->row0 + r);
        normals(&x, row, t->ne[0], mean, j->o->std);
        j->err = sh__quant_row(t->type, row, j->dst + r * t->row_bytes, (int64_t)t->ne[0]);
        if (j->err)
            break;
    }
    free(row);
    return NULL;
}

#define MAX_THREADS 64

/* The writer's fill callback: splits the rows into contiguous ranges, one per thread. */
static sh_err fill_weights(void *user, const sh_gguf_write_tensor *t, uint64_t row0,
                           uint64_t n_rows, void *dst, sh_error *e)
{
    const gen_ctx *g = user;
    int nt = g->o->n_threads < 1             ? 1
             : g->o->n_threads > MAX_THREADS ? MAX_THREADS
                                             : g->o->n_threads;
    if ((uint64_t)nt > n_rows)
        nt = (int)n_rows;
    gen_job jobs[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    bool started[MAX_THREADS] = {false};
    for (int i = 0; i < nt; i++) {
        uint64_t a = n_rows * (uint64_t)i / (uint64_t)nt,
                 b = n_rows * (uint64_t)(i + 1) / (uint64_t)nt;
        jobs[i] = (gen_job){g->o, t, row0 + a, b - a, (uint8_t *)dst + a * t->row_bytes, SH_OK};
    }
    /* Thread 0's share runs here; a thread that cannot start has its share run here too. */
    for (int i = 1; i < nt; i++)
        started[i] = pthread_create(&th[i], NULL, gen_rows, &jobs[i]) == 0;
    gen_rows(&jobs[0]);
    for (int i = 1; i < nt; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            gen_rows(&jobs[i]);
    }
    for (int i = 0; i < nt; i++)
        if (jobs[i].err)
            return sh__error_set(e, jobs[i].err, "cannot generate rows: %s",
                                 sh_strerror(jobs[i].err));
    return SH_OK;
}

/* ---- Vocabulary ---------------------------------------------------------------------------- */

/* GPT-2's byte-to-unicode map: printable bytes stand for themselves, the other 68 (controls,
 * space, DEL, NBSP, soft hyphen, ...) take code points 256, 257, ... in byte order, so that every
 * byte is a visible character. Writes the UTF-8 form of byte b's character to out (<= 2 bytes +
 * NUL) and returns its length. */
static int byte_char(int b, char *out)
{
    int cp = b;
    bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    if (!printable) {
        int k = 0;
        for (int i = 0; i < b; i++)
            k += !((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || i >= 0xae);
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
        return 1;
    }
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    out[2] = 0;
    return 2;
}

typedef struct bpe_vocab {
    char **tokens;
    int32_t *types;
    char **merges;
    uint64_t n, n_merges;
} bpe_vocab;

static void vocab_free(bpe_vocab *v)
{
    for (uint64_t i = 0; v->tokens && i < v->n; i++)
        free(v->tokens[i]);
    for (uint64_t i = 0; v->merges && i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
}

static char *join(const char *a, const char *sep, const char *b)
{
    size_t la = strlen(a), ls = strlen(sep), lb = strlen(b);
    char *s = malloc(la + ls + lb + 1);
    if (s) {
        memcpy(s, a, la);
        memcpy(s + la, sep, ls);
        memcpy(s + la + ls, b, lb + 1);
    }
    return s;
}

/* A small but valid byte-level BPE vocabulary of n tokens: the 256 byte tokens (id = byte), then
 * merged tokens, then BOS and EOS. Merged tokens grow one letter at a time: level 2 is every
 * "Ġx" and "xy" (Ġ is the space byte, x and y in a..z), level k+1 appends a..z to each level-k
 * token in order. So every merge "left right" joins a shorter token and a single byte that both
 * exist already, and every token string has exactly one derivation. */
static sh_err vocab_make(bpe_vocab *v, uint64_t n, sh_error *e)
{
    memset(v, 0, sizeof *v);
    if (n < 258)
        return sh__error_set(e, SH_EINVAL,
                             "a generated vocabulary needs at least 258 tokens "
                             "(256 bytes, BOS, EOS), got %llu",
                             (unsigned long long)n);
    v->n = n;
    v->n_merges = n - 258;
    v->tokens = calloc(n, sizeof *v->tokens);
    v->types = calloc(n, sizeof *v->types);
    v->merges = calloc(v->n_merges ? v->n_merges : 1, sizeof *v->merges);
    if (!v->tokens || !v->types || !v->merges)
        goto oom;
    char c[4];
    for (int b = 0; b < 256; b++) {
        byte_char(b, c);
        if (!(v->tokens[b] = strdup(c)))
            goto oom;
        v->types[b] = 1; /* normal */
    }
    uint64_t id = 256, level_start = 0, level_end = 0;
    /* Level 2 prefixes: the space byte then a..z, as byte ids. */
    static const char firsts[] = " abcdefghijklmnopqrstuvwxyz";
    for (size_t f = 0; firsts[f] && id < n - 2; f++) {
        for (int s = 'a'; s <= 'z' && id < n - 2; s++) {
            const char *left = v->tokens[(unsigned char)firsts[f]], *right = v->tokens[s];
            if (!(v->tokens[id] = join(left, "", right)) ||
                !(v->merges[id - 256] = join(left, " ", right)))
                goto oom;
            v->types[id++] = 1;
        }
    }
    level_start = 256;
    level_end = id;
    while (id < n - 2) {
        for (uint64_t p = level_start; p < level_end && id < n - 2; p++) {
            for (int s = 'a'; s <= 'z' && id < n - 2; s++) {
                if (!(v->tokens[id] = join(v->tokens[p], "", v->tokens[s])) ||
                    !(v->merges[id - 256] = join(v->tokens[p], " ", v->tokens[s])))
                    goto oom;
                v->types[id++] = 1;
            }
        }
        level_start = level_end;
        level_end = id;
    }
    if (!(v->tokens[n - 2] = strdup("<|begin_of_text|>")) ||
        !(v->tokens[n - 1] = strdup("<|end_of_text|>")))
        goto oom;
    v->types[n - 2] = v->types[n - 1] = 3; /* control */
    return SH_OK;
oom:
    vocab_free(v);
    memset(v, 0, sizeof *v);
    return sh__error_set(e, SH_ENOMEM, "out of memory for a %llu-token vocabulary",
                         (unsigned long long)n);
}

static sh_err set_generated_vocab(sh_gguf_writer *w, uint64_t n, sh_error *e)
{
    bpe_vocab v;
    sh_err err = vocab_make(&v, n, e);
    if (err)
        return err;
    if (!(err = sh__gguf_write_set_str(w, "tokenizer.ggml.model", "gpt2", e)) &&
        !(err = sh__gguf_write_set_str(w, "tokenizer.ggml.pre", "default", e)) &&
        !(err = sh__gguf_write_set_arr_str(w, "tokenizer.ggml.tokens",
                                           (const char *const *)v.tokens, v.n, e)) &&
        !(err = sh__gguf_write_set_arr(w, "tokenizer.ggml.token_type", SH_GGUF_INT32, v.types, v.n,
                                       e)) &&
        !(err = sh__gguf_write_set_arr_str(w, "tokenizer.ggml.merges",
                                           (const char *const *)v.merges, v.n_merges, e)) &&
        !(err = sh__gguf_write_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)(n - 2), e)) &&
        !(err = sh__gguf_write_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)(n - 1), e)))
        err = sh__gguf_write_set_bool(w, "tokenizer.ggml.add_bos_token", true, e);
    vocab_free(&v);
    return err;
}

/* Copies every tokenizer.* key of `path`; *n_tokens receives its token count. */
static sh_err copy_vocab(sh_gguf_writer *w, const char *path, uint64_t *n_tokens, sh_error *e)
{
    sh_gguf *g = NULL;
    sh_err err = sh_gguf_open(path, NULL, &g, e);
    if (err)
        return err;
    const sh_gguf_value *toks = NULL;
    if (sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &toks) != SH_OK) {
        sh_gguf_close(g);
        return sh__error_set(e, SH_EFORMAT, "%s: no string array tokenizer.ggml.tokens", path);
    }
    *n_tokens = toks->v.arr.n;
    for (uint64_t i = 0; !err && i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        if (kv->key.len < 10 || memcmp(kv->key.ptr, "tokenizer.", 10) != 0)
            continue;
        char *key = malloc(kv->key.len + 1);
        if (!key) {
            err = sh__error_set(e, SH_ENOMEM, "out of memory");
            break;
        }
        memcpy(key, kv->key.ptr, kv->key.len);
        key[kv->key.len] = 0;
        err = sh__gguf_write_set_value(w, key, &kv->value, e);
        free(key);
    }
    sh_gguf_close(g);
    return err;
}

/* ---- The model ----------------------------------------------------------------------------- */

static sh_err check_shape(const sh_mkmodel_opts *o, const sh_mkmodel_shape *s, sh_error *e)
{
    struct {
        const char *name;
        int64_t v, max;
    } f[] = {
        {"layers", s->n_layers, 4096},
        {"dim", s->dim, 1 << 16},
        {"ffn", s->ffn, 1 << 20},
        {"heads", s->n_heads, 1 << 12},
        {"kv-heads", s->n_kv_heads, 1 << 12},
        {"vocab", s->vocab, 1 << 24},
        {"ctx", s->ctx, 1 << 24},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < 1 || f[i].v > f[i].max)
            return sh__error_set(e, SH_EINVAL, "%s = %lld is outside 1..%lld", f[i].name,
                                 (long long)f[i].v, (long long)f[i].max);
    if (s->dim % s->n_heads)
        return sh__error_set(e, SH_EINVAL, "dim %lld is not divisible by heads %lld",
                             (long long)s->dim, (long long)s->n_heads);
    if (s->n_heads % s->n_kv_heads)
        return sh__error_set(e, SH_EINVAL, "heads %lld is not divisible by kv-heads %lld",
                             (long long)s->n_heads, (long long)s->n_kv_heads);
    if ((s->dim / s->n_heads) % 2)
        return sh__error_set(e, SH_EINVAL, "head dim %lld is odd (RoPE rotates pairs)",
                             (long long)(s->dim / s->n_heads));
    if (!(s->rope_base > 0) || !(s->rms_eps > 0))
        return sh__error_set(e, SH_EINVAL, "rope base and rms eps must be positive");
    if (!(o->std > 0) || !isfinite(o->std))
        return sh__error_set(e, SH_EINVAL, "std %g must be positive", (double)o->std);
    if (sh__mkmodel_file_type(o->type) < 0)
        return sh__error_set(e, SH_EINVAL,
                             "type %s is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                             "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K",
                             sh__dtype_name(o->type));
    /* Rows are whole blocks (256 elements for the K-quants): the first tensor whose rows are
     * dim (token_embd) or ffn (ffn_down) long is named. */
    const sh_dtype_info *info = sh__dtype_info(o->type);
    if (s->dim % info->block_elems || s->ffn % info->block_elems)
        return sh__error_set(
            e, SH_EINVAL, "tensor '%s': %s needs dim (%lld) and ffn (%lld) to be multiples of %u",
            s->dim % info->block_elems ? "token_embd.weight" : "blk.0.ffn_down.weight", info->name,
            (long long)s->dim, (long long)s->ffn, info->block_elems);
    return SH_OK;
}

static sh_err set_metadata(sh_gguf_writer *w, const sh_mkmodel_opts *o, const sh_mkmodel_shape *s,
                           sh_error *e)
{
    char name[128];
    snprintf(name, sizeof name, "shoal-mkmodel %s %s seed %llu", s->name, sh__dtype_name(o->type),
             (unsigned long long)o->seed);
    sh_err err;
    if ((err = sh__gguf_write_set_str(w, "general.architecture", "llama", e)) ||
        (err = sh__gguf_write_set_str(w, "general.name", name, e)) ||
        (err = sh__gguf_write_set_u32(w, "general.file_type",
                                      (uint32_t)sh__mkmodel_file_type(o->type), e)) ||
        (err = sh__gguf_write_set_u32(w, "general.quantization_version", 2, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.context_length", (uint32_t)s->ctx, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.embedding_length", (uint32_t)s->dim, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.block_count", (uint32_t)s->n_layers, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.feed_forward_length", (uint32_t)s->ffn, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.attention.head_count", (uint32_t)s->n_heads, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.attention.head_count_kv", (uint32_t)s->n_kv_heads,
                                      e)) ||
        (err = sh__gguf_write_set_f32(w, "llama.rope.freq_base", s->rope_base, e)) ||
        (err =
             sh__gguf_write_set_f32(w, "llama.attention.layer_norm_rms_epsilon", s->rms_eps, e)) ||
        (err = sh__gguf_write_set_u32(w, "llama.rope.dimension_count",
                                      (uint32_t)(s->dim / s->n_heads), e)))
        return err;
    if (s->sliding_window > 0 && (err = sh__gguf_write_set_u32(w, "llama.attention.sliding_window",
                                                               (uint32_t)s->sliding_window, e)))
        return err;
    return sh__gguf_write_set_u32(w, "llama.vocab_size", (uint32_t)s->vocab, e);
}

/* Adds the tensors in llama.cpp's naming; ne[0] is the input (contiguous) dimension. */
static sh_err add_tensors(sh_gguf_writer *w, const sh_mkmodel_opts *o, const sh_mkmodel_shape *s,
                          gen_ctx *g, uint64_t *n_params, sh_error *e)
{
    const uint64_t dim = (uint64_t)s->dim, ffn = (uint64_t)s->ffn, vocab = (uint64_t)s->vocab;
    const uint64_t kv = (uint64_t)(s->dim / s->n_heads * s->n_kv_heads);
    sh_err err = SH_OK;
    *n_params = 0;
#define ADD(name, type, nd, d0, d1)                                                                \
    do {                                                                                           \
        uint64_t ne_[2] = {(d0), (d1)};                                                            \
        if ((err = sh__gguf_write_add_tensor(w, name, type, nd, ne_, fill_weights, g, e)))         \
            return err;                                                                            \
        *n_params += ne_[0] * (nd == 2 ? ne_[1] : 1);                                              \
    } while (0)
    ADD("token_embd.weight", o->type, 2, dim, vocab);
    for (int64_t l = 0; l < s->n_layers; l++) {
        char n[64];
#define LAYER(suffix, type, nd, d0, d1)                                                            \
    do {                                                                                           \
        snprintf(n, sizeof n, "blk.%lld.%s.weight", (long long)l, suffix);                         \
        ADD(n, type, nd, d0, d1);                                                                  \
    } while (0)
        LAYER("attn_norm", SH_DTYPE_F32, 1, dim, 1);
        LAYER("attn_q", o->type, 2, dim, dim);
        LAYER("attn_k", o->type, 2, dim, kv);
        LAYER("attn_v", o->type, 2, dim, kv);
        LAYER("attn_output", o->type, 2, dim, dim);
        LAYER("ffn_norm", SH_DTYPE_F32, 1, dim, 1);
        LAYER("ffn_gate", o->type, 2, dim, ffn);
        LAYER("ffn_up", o->type, 2, dim, ffn);
        LAYER("ffn_down", o->type, 2, ffn, dim);
#undef LAYER
    }
    ADD("output_norm.weight", SH_DTYPE_F32, 1, dim, 1);
    if (!s->tied)
        ADD("output.weight", o->type, 2, dim, vocab);
#undef ADD
    return err;
}

sh_err sh__mkmodel_write(const char *path, const sh_mkmodel_opts *o, sh_mkmodel_result *res,
                         sh_error *e)
{
    sh_mkmodel_shape s = o->shape;
    sh_gguf_writer *w = NULL;
    sh_err err = sh__gguf_write_create(&w, e);
    if (err)
        return err;
    /* The model's keys first, then the tokenizer's, as llama.cpp's converters order them. With
     * vocab_from the file decides the vocabulary size; llama.vocab_size is then set again, which
     * replaces the value in place. */
    if ((err = set_metadata(w, o, &s, e)))
        goto out;
    if (o->vocab_from) {
        uint64_t count = 0;
        if ((err = copy_vocab(w, o->vocab_from, &count, e)))
            goto out;
        if (o->vocab_explicit && (uint64_t)s.vocab != count) {
            err = sh__error_set(e, SH_EINVAL, "vocab %lld differs from the %llu tokens of %s",
                                (long long)s.vocab, (unsigned long long)count, o->vocab_from);
            goto out;
        }
        s.vocab = count > (1u << 24) ? 0 : (int64_t)count; /* check_shape rejects 0 */
        if ((err = sh__gguf_write_set_u32(w, "llama.vocab_size", (uint32_t)s.vocab, e)))
            goto out;
    }
    if ((err = check_shape(o, &s, e)))
        goto out;
    if (!o->vocab_from && (err = set_generated_vocab(w, (uint64_t)s.vocab, e)))
        goto out;

    gen_ctx g = {o};
    uint64_t n_params = 0;
    if ((err = add_tensors(w, o, &s, &g, &n_params, e)))
        goto out;
    sh__gguf_write_set_progress(w, o->progress, o->progress_user);
    if ((err = sh__gguf_write_file(w, path, e)))
        goto out;
    if (res) {
        res->n_params = n_params;
        res->n_bytes = sh__gguf_write_file_size(w);
        res->vocab = s.vocab;
    }
out:
    sh__gguf_write_destroy(w);
    return err;
}
