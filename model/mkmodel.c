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
    {.name = "smollm2-135m",
     .n_layers = 30,
     .dim = 576,
     .ffn = 1536,
     .n_heads = 9,
     .n_kv_heads = 3,
     .vocab = 49152,
     .ctx = 8192,
     .rope_base = 100000.0f,
     .rms_eps = 1e-5f,
     .tied = true},
    {.name = "tinyllama-1.1b",
     .n_layers = 22,
     .dim = 2048,
     .ffn = 5632,
     .n_heads = 32,
     .n_kv_heads = 4,
     .vocab = 32000,
     .ctx = 2048,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f},
    /* Llama 3 8B's dimensions without its rope scaling (the 8192-token original). */
    {.name = "llama3-8b",
     .n_layers = 32,
     .dim = 4096,
     .ffn = 14336,
     .n_heads = 32,
     .n_kv_heads = 8,
     .vocab = 128256,
     .ctx = 8192,
     .rope_base = 500000.0f,
     .rms_eps = 1e-5f},
    /* Llama 3.2 1B: Llama 3 rope scaling (factor 32 over 8192 positions) as rope_freqs. */
    {.name = "llama3.2-1b",
     .n_layers = 16,
     .dim = 2048,
     .ffn = 8192,
     .n_heads = 32,
     .n_kv_heads = 8,
     .vocab = 128256,
     .ctx = 131072,
     .rope_base = 500000.0f,
     .rms_eps = 1e-5f,
     .tied = true,
     .rope_scaling = SH_MKMODEL_ROPE_SCALING_LLAMA3,
     .rope_factor = 32.0f,
     .rope_orig_ctx = 8192},
    /* Gemma 3 270M: 256-wide heads, one KV head, 5 local (512-token window) layers per global
     * one, global rope base 1e6 and local 10000 (llama.cpp's default, not written). */
    {.name = "gemma3-270m",
     .arch = "gemma3",
     .n_layers = 18,
     .dim = 640,
     .ffn = 2048,
     .n_heads = 4,
     .n_kv_heads = 1,
     .head_dim = 256,
     .vocab = 262144,
     .ctx = 32768,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .tied = true,
     .sliding_window = 512},
    {.name = "qwen3-0.6b",
     .arch = "qwen3",
     .n_layers = 28,
     .dim = 1024,
     .ffn = 3072,
     .n_heads = 16,
     .n_kv_heads = 8,
     .head_dim = 128,
     .vocab = 151936,
     .ctx = 40960,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .tied = true},
    /* A small Qwen3-30B-A3B: 16 experts of width 256, 4 per token. */
    {.name = "qwen3moe-tiny",
     .arch = "qwen3moe",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1536,
     .n_heads = 8,
     .n_kv_heads = 4,
     .head_dim = 64,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .n_experts = 16,
     .n_experts_used = 4,
     .expert_ffn = 256},
    /* Phi-3 mini 4k: fused QKV and gate/up; the converter writes its 2047 window, which
     * llama.cpp ignores for phi3. */
    {.name = "phi3-mini",
     .arch = "phi3",
     .n_layers = 32,
     .dim = 3072,
     .ffn = 8192,
     .n_heads = 32,
     .n_kv_heads = 32,
     .vocab = 32064,
     .ctx = 4096,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f,
     .sliding_window = 2047,
     .rope_orig_ctx = 4096},
    /* A small Qwen1.5-MoE: qwen2 attention with Q/K/V biases, 8 routed experts (4 per token,
     * weights not renormalised) and a sigmoid-gated shared expert. */
    {.name = "qwen2moe-tiny",
     .arch = "qwen2moe",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1024,
     .n_heads = 8,
     .n_kv_heads = 8,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .n_experts = 8,
     .n_experts_used = 4,
     .expert_ffn = 256,
     .shared_ffn = 1024},
    /* A small Mixtral: llama with 8 experts, 2 per token. */
    {.name = "mixtral-tiny",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1536,
     .n_heads = 8,
     .n_kv_heads = 2,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-5f,
     .n_experts = 8,
     .n_experts_used = 2},
};

const char *sh__mkmodel_arch(const sh_mkmodel_shape *s) { return s->arch ? s->arch : "llama"; }

int64_t sh__mkmodel_head_dim(const sh_mkmodel_shape *s)
{
    return s->head_dim ? s->head_dim : s->n_heads ? s->dim / s->n_heads : 0;
}

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
    /* rope_freqs.weight (Llama 3) or phi3's rope_factors_long/short: head_dim / 2 <= 2048 each */
    float rope_freqs[2048], rope_short[2048];
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
    /* RMSNorm weights are near 1 so activations keep their scale; biases, the shared-expert gate
     * and matrices are centred on 0. */
    const size_t ln = strlen(t->name);
    const bool norm = ln >= 11 && strcmp(t->name + ln - 11, "norm.weight") == 0;
    const float mean = norm ? 1.0f : 0.0f;
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
 * merged tokens, then the control tokens `specials` (BOS and EOS). Merged tokens grow one letter at
 * a time: level 2 is every "Ġx" and "xy" (Ġ is the space byte, x and y in a..z), level k+1 appends
 * a..z to each level-k token in order. So every merge "left right" joins a shorter token and a
 * single byte that both exist already, and every token string has exactly one derivation. */
static sh_err vocab_make(bpe_vocab *v, uint64_t n, const char *const *specials, uint64_t n_special,
                         sh_error *e)
{
    memset(v, 0, sizeof *v);
    if (n < 256 + n_special)
        return sh__error_set(e, SH_EINVAL,
                             "a generated vocabulary needs at least %llu tokens "
                             "(256 bytes and %llu control tokens), got %llu",
                             (unsigned long long)(256 + n_special), (unsigned long long)n_special,
                             (unsigned long long)n);
    v->n = n;
    v->n_merges = n - 256 - n_special;
    const uint64_t end = n - n_special; /* merged tokens are ids 256 .. end - 1 */
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
    for (size_t f = 0; firsts[f] && id < end; f++) {
        for (int s = 'a'; s <= 'z' && id < end; s++) {
            const char *left = v->tokens[(unsigned char)firsts[f]], *right = v->tokens[s];
            if (!(v->tokens[id] = join(left, "", right)) ||
                !(v->merges[id - 256] = join(left, " ", right)))
                goto oom;
            v->types[id++] = 1;
        }
    }
    level_start = 256;
    level_end = id;
    while (id < end) {
        for (uint64_t p = level_start; p < level_end && id < end; p++) {
            for (int s = 'a'; s <= 'z' && id < end; s++) {
                if (!(v->tokens[id] = join(v->tokens[p], "", v->tokens[s])) ||
                    !(v->merges[id - 256] = join(v->tokens[p], " ", v->tokens[s])))
                    goto oom;
                v->types[id++] = 1;
            }
        }
        level_start = level_end;
        level_end = id;
    }
    for (uint64_t k = 0; k < n_special; k++) {
        if (!(v->tokens[end + k] = strdup(specials[k])))
            goto oom;
        v->types[end + k] = 3; /* control */
    }
    return SH_OK;
oom:
    vocab_free(v);
    memset(v, 0, sizeof *v);
    return sh__error_set(e, SH_ENOMEM, "out of memory for a %llu-token vocabulary",
                         (unsigned long long)n);
}

/* Phi-3 files carry SentencePiece's control tokens, and llama.cpp looks <unk>, <s>, </s> and
 * <|endoftext|> up by name when general.name mentions phi3; the others get Llama 3's two. */
static const char *const specials_llama3[] = {"<|begin_of_text|>", "<|end_of_text|>"};
static const char *const specials_phi3[] = {"<unk>", "<s>", "</s>", "<|endoftext|>"};

static sh_err set_generated_vocab(sh_gguf_writer *w, uint64_t n, bool phi3, sh_error *e)
{
    bpe_vocab v;
    const char *const *sp = phi3 ? specials_phi3 : specials_llama3;
    const uint64_t n_sp = phi3 ? 4 : 2;
    /* BOS <|begin_of_text|> / <s>, EOS <|end_of_text|> / <|endoftext|>. */
    const uint64_t bos = n - n_sp + (phi3 ? 1 : 0), eos = n - 1;
    sh_err err = vocab_make(&v, n, sp, n_sp, e);
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
        !(err = sh__gguf_write_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos, e)) &&
        !(err = sh__gguf_write_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos, e)))
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

static bool arch_is(const sh_mkmodel_shape *s, const char *name)
{
    return strcmp(sh__mkmodel_arch(s), name) == 0;
}

static sh_err check_shape(const sh_mkmodel_opts *o, const sh_mkmodel_shape *s, sh_error *e)
{
    static const char *const archs[] = {"llama", "gemma3", "qwen3", "qwen3moe", "qwen2moe", "phi3"};
    bool known = false;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        known |= arch_is(s, archs[i]);
    if (!known)
        return sh__error_set(e, SH_EINVAL,
                             "architecture '%s' is not one of llama, gemma3, qwen3, qwen3moe, "
                             "qwen2moe, phi3",
                             sh__mkmodel_arch(s));
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
    if (s->head_dim < 0 || s->head_dim > 4096 || s->n_experts < 0 || s->n_experts > 512 ||
        s->expert_ffn < 0 || s->expert_ffn > (1 << 20) || s->swa_pattern < 0 ||
        s->sliding_window < 0 || s->rope_orig_ctx < 0)
        return sh__error_set(e, SH_EINVAL,
                             "head-dim, experts (<= 512), expert-ffn, swa-pattern, "
                             "sliding-window and rope-orig-ctx cannot be negative "
                             "or that large");
    if (!s->head_dim && s->dim % s->n_heads)
        return sh__error_set(e, SH_EINVAL, "dim %lld is not divisible by heads %lld",
                             (long long)s->dim, (long long)s->n_heads);
    if (s->n_heads % s->n_kv_heads)
        return sh__error_set(e, SH_EINVAL, "heads %lld is not divisible by kv-heads %lld",
                             (long long)s->n_heads, (long long)s->n_kv_heads);
    const int64_t hd = sh__mkmodel_head_dim(s);
    if (hd % 2)
        return sh__error_set(e, SH_EINVAL, "head dim %lld is odd (RoPE rotates pairs)",
                             (long long)hd);
    if ((arch_is(s, "phi3") || arch_is(s, "qwen2moe")) && hd * s->n_heads != s->dim)
        return sh__error_set(e, SH_EINVAL, "%s needs head-dim x heads = dim (%lld x %lld != %lld)",
                             sh__mkmodel_arch(s), (long long)hd, (long long)s->n_heads,
                             (long long)s->dim);
    const bool moe_arch = arch_is(s, "qwen3moe") || arch_is(s, "qwen2moe");
    const bool moe_ok = moe_arch || arch_is(s, "llama");
    if (moe_arch && !s->n_experts)
        return sh__error_set(e, SH_EINVAL, "%s needs --experts", sh__mkmodel_arch(s));
    if (s->n_experts && !moe_ok)
        return sh__error_set(e, SH_EINVAL, "%s has no experts (llama, qwen3moe and qwen2moe do)",
                             sh__mkmodel_arch(s));
    if (s->shared_ffn < 0 || s->shared_ffn > (1 << 20) ||
        (s->shared_ffn && !arch_is(s, "qwen2moe")))
        return sh__error_set(e, SH_EINVAL, "a shared expert (--shared-ffn) is for qwen2moe");
    if (s->n_experts && (s->n_experts_used < 1 || s->n_experts_used > s->n_experts))
        return sh__error_set(e, SH_EINVAL, "experts-used %lld is outside 1..experts %lld",
                             (long long)s->n_experts_used, (long long)s->n_experts);
    if (!(s->rope_base > 0) || !(s->rms_eps > 0) || s->rope_base_swa < 0 || s->softcap < 0)
        return sh__error_set(e, SH_EINVAL, "rope base and rms eps must be positive");
    if (s->rope_scaling != SH_MKMODEL_ROPE_SCALING_NONE && !(s->rope_factor > 0))
        return sh__error_set(e, SH_EINVAL, "rope scaling needs a positive factor");
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LLAMA3 && !arch_is(s, "llama"))
        return sh__error_set(e, SH_EINVAL, "llama3 rope scaling is for the llama architecture");
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE && !arch_is(s, "phi3"))
        return sh__error_set(e, SH_EINVAL, "longrope scaling is for the phi3 architecture");
    if (!(o->std > 0) || !isfinite(o->std))
        return sh__error_set(e, SH_EINVAL, "std %g must be positive", (double)o->std);
    if (sh__mkmodel_file_type(o->type) < 0)
        return sh__error_set(e, SH_EINVAL,
                             "type %s is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                             "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K",
                             sh__dtype_name(o->type));
    /* Rows are whole blocks (256 elements for the K-quants). Every matrix row (ne[0]) is dim,
     * ffn, heads x head-dim or the expert ffn long; the first tensor that breaks it is named. */
    const sh_dtype_info *info = sh__dtype_info(o->type);
    const int64_t eff = s->expert_ffn ? s->expert_ffn : s->ffn;
    const int64_t be = info->block_elems;
    const char *bad = s->dim % be                ? "token_embd.weight"
                      : (hd * s->n_heads) % be   ? "blk.0.attn_output.weight"
                      : s->n_experts && eff % be ? "blk.0.ffn_down_exps.weight"
                      : s->ffn % be              ? "blk.0.ffn_down.weight"
                      : s->shared_ffn % be       ? "blk.0.ffn_down_shexp.weight"
                                                 : NULL;
    if (bad)
        return sh__error_set(e, SH_EINVAL,
                             "tensor '%s': %s needs dim (%lld), ffn (%lld), heads x head-dim "
                             "(%lld) and the expert ffn (%lld) to be multiples of %u",
                             bad, info->name, (long long)s->dim, (long long)s->ffn,
                             (long long)(hd * s->n_heads), (long long)eff, info->block_elems);
    return SH_OK;
}

/* ARCH.suffix into buf. */
static const char *akey(char *buf, size_t cap, const sh_mkmodel_shape *s, const char *suffix)
{
    snprintf(buf, cap, "%s.%s", sh__mkmodel_arch(s), suffix);
    return buf;
}

static sh_err set_metadata(sh_gguf_writer *w, const sh_mkmodel_opts *o, const sh_mkmodel_shape *s,
                           sh_error *e)
{
    char name[128], k[96];
    snprintf(name, sizeof name, "shoal-mkmodel %s %s seed %llu", s->name, sh__dtype_name(o->type),
             (unsigned long long)o->seed);
    const int64_t hd = sh__mkmodel_head_dim(s);
    const bool llama = arch_is(s, "llama"), phi3 = arch_is(s, "phi3");
    sh_err err;
#define U32(suffix, v)                                                                             \
    if ((err = sh__gguf_write_set_u32(w, akey(k, sizeof k, s, suffix), (uint32_t)(v), e)))         \
    return err
#define F32(suffix, v)                                                                             \
    if ((err = sh__gguf_write_set_f32(w, akey(k, sizeof k, s, suffix), (v), e)))                   \
    return err
    if ((err = sh__gguf_write_set_str(w, "general.architecture", sh__mkmodel_arch(s), e)) ||
        (err = sh__gguf_write_set_str(w, "general.name", name, e)) ||
        (err = sh__gguf_write_set_u32(w, "general.file_type",
                                      (uint32_t)sh__mkmodel_file_type(o->type), e)) ||
        (err = sh__gguf_write_set_u32(w, "general.quantization_version", 2, e)))
        return err;
    U32("context_length", s->ctx);
    U32("embedding_length", s->dim);
    U32("block_count", s->n_layers);
    U32("feed_forward_length", s->ffn);
    U32("attention.head_count", s->n_heads);
    U32("attention.head_count_kv", s->n_kv_heads);
    F32("rope.freq_base", s->rope_base);
    F32("attention.layer_norm_rms_epsilon", s->rms_eps);
    /* llama.cpp's converters write the rotated width for llama and phi3 and the head width
     * (key/value length) where the config names one: always for gemma3 and qwen3. */
    if (llama || phi3) {
        U32("rope.dimension_count", hd);
    }
    if (!llama && !phi3) {
        U32("attention.key_length", hd);
        U32("attention.value_length", hd);
    } else if (s->head_dim && s->head_dim * s->n_heads != s->dim) {
        U32("attention.key_length", hd);
        U32("attention.value_length", hd);
    }
    if (s->sliding_window > 0) {
        U32("attention.sliding_window", s->sliding_window);
    }
    if (s->swa_pattern > 0) {
        U32("attention.sliding_window_pattern", s->swa_pattern);
    }
    if (s->rope_base_swa > 0) {
        F32("rope.freq_base_swa", s->rope_base_swa);
    }
    if (s->softcap > 0) {
        F32("final_logit_softcapping", s->softcap);
    }
    const int64_t orig_ctx = s->rope_orig_ctx ? s->rope_orig_ctx : s->ctx;
    if (phi3) {
        U32("rope.scaling.original_context_length", orig_ctx);
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LINEAR ||
        s->rope_scaling == SH_MKMODEL_ROPE_SCALING_YARN) {
        bool yarn = s->rope_scaling == SH_MKMODEL_ROPE_SCALING_YARN;
        if ((err = sh__gguf_write_set_str(w, akey(k, sizeof k, s, "rope.scaling.type"),
                                          yarn ? "yarn" : "linear", e)))
            return err;
        F32("rope.scaling.factor", s->rope_factor);
        if (yarn && !phi3) {
            U32("rope.scaling.original_context_length", orig_ctx);
        }
    }
    if (s->n_experts) {
        U32("expert_count", s->n_experts);
        U32("expert_used_count", s->n_experts_used);
        /* Mixtral's feed_forward_length is the expert width; qwen3moe names it apart. */
        if (!llama) {
            U32("expert_feed_forward_length", s->expert_ffn ? s->expert_ffn : s->ffn);
        }
        if (arch_is(s, "qwen2moe")) {
            U32("expert_shared_feed_forward_length", s->shared_ffn ? s->shared_ffn : s->ffn);
        }
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE) {
        double f = s->rope_factor > 1 ? s->rope_factor : 1.0;
        F32("rope.scaling.attn_factor", (float)sqrt(1.0 + log(f) / log((double)orig_ctx)));
    }
    if (llama) {
        U32("vocab_size", s->vocab);
    }
#undef U32
#undef F32
    return SH_OK;
}

/* Llama 3's rope_freqs.weight: the divisor of each frequency base^(-2i/hd), as llama.cpp's
 * converter derives it from rope_scaling (factor, low_freq_factor 1, high_freq_factor 4,
 * original_max_position_embeddings): wavelengths shorter than orig / 4 keep their frequency,
 * longer than orig / 1 are divided by factor, and the band between is interpolated. */
static void llama3_rope_freqs(const sh_mkmodel_shape *s, float *out)
{
    const int64_t hd = sh__mkmodel_head_dim(s);
    const double lo = 1.0, hi = 4.0, factor = s->rope_factor;
    const double orig = (double)(s->rope_orig_ctx ? s->rope_orig_ctx : 8192);
    for (int64_t i = 0; i < hd / 2; i++) {
        double freq = 1.0 / pow(s->rope_base, (double)(2 * i) / (double)hd);
        double wavelen = 2.0 * 3.14159265358979323846 / freq;
        if (wavelen < orig / hi) {
            out[i] = 1.0f;
        } else if (wavelen > orig / lo) {
            out[i] = (float)factor;
        } else {
            double smooth = (orig / wavelen - lo) / (hi - lo);
            out[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
}

/* Adds the tensors in llama.cpp's naming; ne[0] is the input (contiguous) dimension, expert
 * tensors are (ne[0], ne[1], n_experts) with the expert index slowest. */
static sh_err add_tensors(sh_gguf_writer *w, const sh_mkmodel_opts *o, const sh_mkmodel_shape *s,
                          gen_ctx *g, uint64_t *n_params, sh_error *e)
{
    const uint64_t dim = (uint64_t)s->dim, ffn = (uint64_t)s->ffn, vocab = (uint64_t)s->vocab;
    const uint64_t hd = (uint64_t)sh__mkmodel_head_dim(s);
    const uint64_t qd = hd * (uint64_t)s->n_heads, kv = hd * (uint64_t)s->n_kv_heads;
    const uint64_t nexp = (uint64_t)s->n_experts;
    const uint64_t eff = s->expert_ffn ? (uint64_t)s->expert_ffn : ffn;
    const bool gemma3 = arch_is(s, "gemma3"), phi3 = arch_is(s, "phi3");
    const bool qk_norm = gemma3 || arch_is(s, "qwen3") || arch_is(s, "qwen3moe");
    sh_err err = SH_OK;
    *n_params = 0;
#define ADD3(name, type, nd, d0, d1, d2)                                                           \
    do {                                                                                           \
        uint64_t ne_[3] = {(d0), (d1), (d2)};                                                      \
        if ((err = sh__gguf_write_add_tensor(w, name, type, nd, ne_, fill_weights, g, e)))         \
            return err;                                                                            \
        *n_params += ne_[0] * ne_[1] * ne_[2];                                                     \
    } while (0)
#define ADD(name, type, nd, d0, d1) ADD3(name, type, nd, d0, d1, 1)
    ADD("token_embd.weight", o->type, 2, dim, vocab);
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LLAMA3) {
        uint64_t ne[1] = {hd / 2};
        llama3_rope_freqs(s, g->rope_freqs);
        if ((err = sh__gguf_write_add_tensor_data(w, "rope_freqs.weight", SH_DTYPE_F32, 1, ne,
                                                  g->rope_freqs, e)))
            return err;
        *n_params += hd / 2;
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE) {
        /* Made-up but smooth factors: long ones ramp from 1 (fast dims) to factor (slow ones),
         * short ones carry an eighth of that excess, as Phi-3's do in magnitude. */
        uint64_t ne[1] = {hd / 2};
        for (uint64_t i = 0; i < hd / 2; i++) {
            double r = hd > 2 ? (double)i / (double)(hd / 2 - 1) : 0.0;
            g->rope_freqs[i] = (float)(1.0 + (s->rope_factor - 1.0) * r);
            g->rope_short[i] = (float)(1.0 + (s->rope_factor - 1.0) * r / 8.0);
        }
        if ((err = sh__gguf_write_add_tensor_data(w, "rope_factors_long.weight", SH_DTYPE_F32, 1,
                                                  ne, g->rope_freqs, e)) ||
            (err = sh__gguf_write_add_tensor_data(w, "rope_factors_short.weight", SH_DTYPE_F32, 1,
                                                  ne, g->rope_short, e)))
            return err;
        *n_params += hd;
    }
    const bool qwen2moe = arch_is(s, "qwen2moe");
    const uint64_t sff = s->shared_ffn ? (uint64_t)s->shared_ffn : ffn;
    for (int64_t l = 0; l < s->n_layers; l++) {
        char n[64];
#define LAYER3(suffix, type, nd, d0, d1, d2)                                                       \
    do {                                                                                           \
        snprintf(n, sizeof n, "blk.%lld.%s.weight", (long long)l, suffix);                         \
        ADD3(n, type, nd, d0, d1, d2);                                                             \
    } while (0)
#define LAYER(suffix, type, nd, d0, d1) LAYER3(suffix, type, nd, d0, d1, 1)
        LAYER("attn_norm", SH_DTYPE_F32, 1, dim, 1);
        if (phi3) {
            LAYER("attn_qkv", o->type, 2, dim, qd + 2 * kv);
        } else {
            LAYER("attn_q", o->type, 2, dim, qd);
            LAYER("attn_k", o->type, 2, dim, kv);
            LAYER("attn_v", o->type, 2, dim, kv);
        }
        if (qwen2moe) { /* Q/K/V biases, F32 as every 1-D tensor */
            static const char *const qkv[3] = {"q", "k", "v"};
            for (int b = 0; b < 3; b++) {
                snprintf(n, sizeof n, "blk.%lld.attn_%s.bias", (long long)l, qkv[b]);
                ADD(n, SH_DTYPE_F32, 1, b ? kv : qd, 1);
            }
        }
        if (qk_norm) {
            LAYER("attn_q_norm", SH_DTYPE_F32, 1, hd, 1);
            LAYER("attn_k_norm", SH_DTYPE_F32, 1, hd, 1);
        }
        LAYER("attn_output", o->type, 2, qd, dim);
        if (gemma3)
            LAYER("post_attention_norm", SH_DTYPE_F32, 1, dim, 1);
        LAYER("ffn_norm", SH_DTYPE_F32, 1, dim, 1);
        if (nexp) {
            /* The router stays F32, as llama.cpp's converter and quantizer keep it. */
            LAYER("ffn_gate_inp", SH_DTYPE_F32, 2, dim, nexp);
            LAYER3("ffn_gate_exps", o->type, 3, dim, eff, nexp);
            LAYER3("ffn_up_exps", o->type, 3, dim, eff, nexp);
            LAYER3("ffn_down_exps", o->type, 3, eff, dim, nexp);
            if (qwen2moe) { /* the shared expert and its sigmoid gate (one row, F32) */
                LAYER("ffn_gate_inp_shexp", SH_DTYPE_F32, 1, dim, 1);
                LAYER("ffn_gate_shexp", o->type, 2, dim, sff);
                LAYER("ffn_up_shexp", o->type, 2, dim, sff);
                LAYER("ffn_down_shexp", o->type, 2, sff, dim);
            }
        } else if (phi3) {
            LAYER("ffn_up", o->type, 2, dim, 2 * ffn); /* gate rows, then up rows */
            LAYER("ffn_down", o->type, 2, ffn, dim);
        } else {
            LAYER("ffn_gate", o->type, 2, dim, ffn);
            LAYER("ffn_up", o->type, 2, dim, ffn);
            LAYER("ffn_down", o->type, 2, ffn, dim);
        }
        if (gemma3)
            LAYER("post_ffw_norm", SH_DTYPE_F32, 1, dim, 1);
#undef LAYER
#undef LAYER3
    }
    ADD("output_norm.weight", SH_DTYPE_F32, 1, dim, 1);
    if (!s->tied)
        ADD("output.weight", o->type, 2, dim, vocab);
#undef ADD
#undef ADD3
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
     * vocab_from the file decides the vocabulary size; llama.vocab_size (only llama files have
     * it) is then set again, which replaces the value in place. */
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
        if (arch_is(&s, "llama") &&
            (err = sh__gguf_write_set_u32(w, "llama.vocab_size", (uint32_t)s.vocab, e)))
            goto out;
    }
    if ((err = check_shape(o, &s, e)))
        goto out;
    if (!o->vocab_from && (err = set_generated_vocab(w, (uint64_t)s.vocab, arch_is(&s, "phi3"), e)))
        goto out;

    gen_ctx *g = calloc(1, sizeof *g); /* lives until the file is written */
    if (!g) {
        err = sh__error_set(e, SH_ENOMEM, "out of memory");
        goto out;
    }
    g->o = o;
    uint64_t n_params = 0;
    if ((err = add_tensors(w, o, &s, g, &n_params, e))) {
        free(g);
        goto out;
    }
    sh__gguf_write_set_progress(w, o->progress, o->progress_user);
    err = sh__gguf_write_file(w, path, e);
    free(g);
    if (err)
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
