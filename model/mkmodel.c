/* Synthetic Llama GGUF models: metadata, a byte-level BPE vocabulary, seeded weights streamed
 * through the GGUF writer and quantized on a few threads. */
#include "model/mkmodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/threads.h"
#include "kernels/cpu/quant.h"
#include "model/gguf.h"
#include "model/mkmodel_arch.h"
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
    case SH_DTYPE_IQ4_NL:
        return 25;
    case SH_DTYPE_IQ4_XS:
        return 30;
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

/* The writer's fill callback: splits the rows into contiguous ranges, one per thread. */
static sh_err fill_weights(void *user, const sh_gguf_write_tensor *t, uint64_t row0,
                           uint64_t n_rows, void *dst, sh_error *e)
{
    const gen_ctx *g = user;
    int nt = sh__threads_count(g->o->n_threads, n_rows);
    gen_job jobs[SH_THREADS_MAX];
    for (int i = 0; i < nt; i++) {
        uint64_t a = n_rows * (uint64_t)i / (uint64_t)nt,
                 b = n_rows * (uint64_t)(i + 1) / (uint64_t)nt;
        jobs[i] = (gen_job){g->o, t, row0 + a, b - a, (uint8_t *)dst + a * t->row_bytes, SH_OK};
    }
    sh__threads_run(nt, gen_rows, jobs, sizeof jobs[0]);
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
    sh_err err = sh__mkmodel_arch_check(s, e);
    if (err)
        return err;
    const int64_t hd = sh__mkmodel_head_dim(s);
    if (!(o->std > 0) || !isfinite(o->std))
        return sh__error_set(e, SH_EINVAL, "std %g must be positive", (double)o->std);
    if (sh__mkmodel_file_type(o->type) < 0)
        return sh__error_set(e, SH_EINVAL,
                             "type %s is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                             "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS",
                             sh__dtype_name(o->type));
    /* Rows are whole blocks (256 elements for the K-quants). Every matrix row (ne[0]) is dim,
     * ffn, heads x head-dim or the expert ffn long; the first tensor that breaks it is named. */
    const sh_dtype_info *info = sh__dtype_info(o->type);
    const int64_t eff = s->expert_ffn ? s->expert_ffn : s->ffn;
    const int64_t be = info->block_elems;
    const struct {
        bool broken;
        const char *tensor, *what;
        int64_t v;
    } dims[] = {
        {s->dim % be != 0, "token_embd.weight", "dim", s->dim},
        {(hd * s->n_heads) % be != 0, "blk.0.attn_output.weight", "heads x head-dim",
         hd * s->n_heads},
        {s->n_experts && eff % be, "blk.0.ffn_down_exps.weight", "the expert ffn", eff},
        {!s->n_experts && s->ffn % be, "blk.0.ffn_down.weight", "ffn", s->ffn},
        {s->shared_ffn % be != 0, "blk.0.ffn_down_shexp.weight", "the shared expert ffn",
         s->shared_ffn},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].broken)
            return sh__error_set(e, SH_EINVAL,
                                 "tensor '%s': %s rows are whole blocks of %u, and %s (%lld) is "
                                 "not a multiple of %u",
                                 dims[i].tensor, info->name, info->block_elems, dims[i].what,
                                 (long long)dims[i].v, info->block_elems);
    return SH_OK;
}

static sh_err set_metadata(sh_gguf_writer *w, const sh_mkmodel_opts *o, const sh_mkmodel_shape *s,
                           sh_error *e)
{
    char name[128];
    snprintf(name, sizeof name, "shoal-mkmodel %s %s seed %llu", s->name, sh__dtype_name(o->type),
             (unsigned long long)o->seed);
    sh_err err;
    if ((err = sh__gguf_write_set_str(w, "general.architecture", sh__mkmodel_arch(s), e)) ||
        (err = sh__gguf_write_set_str(w, "general.name", name, e)) ||
        (err = sh__gguf_write_set_u32(w, "general.file_type",
                                      (uint32_t)sh__mkmodel_file_type(o->type), e)) ||
        (err = sh__gguf_write_set_u32(w, "general.quantization_version", 2, e)))
        return err;
    return sh__mkmodel_arch_metadata(w, s, e);
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
    if ((err = sh__mkmodel_arch_tensors(w, &s, o->type, fill_weights, g, g->rope_freqs,
                                        g->rope_short, &n_params, e))) {
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
