/* Synthetic GGUF models (llama with or without Mixtral-style experts, gemma3, qwen3, qwen3moe,
 * phi3): named shapes, seeded random weights in any of the weight types, a generated or copied
 * vocabulary. Used by `shoal mkmodel`, tests and benches. */
#ifndef SH_MODEL_MKMODEL_H
#define SH_MODEL_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "model/gguf_write.h"
#include "shoal/err.h"

/* Rope scaling written into the file, as llama.cpp's converter stores it. */
typedef enum sh_mkmodel_rope_scaling {
    SH_MKMODEL_ROPE_SCALING_NONE = 0,
    SH_MKMODEL_ROPE_SCALING_LINEAR, /* rope.scaling.type linear + factor */
    SH_MKMODEL_ROPE_SCALING_YARN,   /* rope.scaling.type yarn + factor + original context */
    /* Llama 3: no scaling keys; a rope_freqs.weight tensor of per-frequency divisors computed
     * from factor, low/high frequency factors 1 and 4 and the original context. */
    SH_MKMODEL_ROPE_SCALING_LLAMA3,
    /* phi3 long context: rope_factors_short/long.weight tensors (a ramp from 1 to factor for the
     * long ones, an eighth of its excess for the short ones) and rope.scaling.attn_factor
     * sqrt(1 + ln factor / ln original context), as the converter writes Phi-3 128k files. */
    SH_MKMODEL_ROPE_SCALING_LONGROPE,
} sh_mkmodel_rope_scaling;

/* The dimensions and hyperparameters of a model. Fields after sliding_window are zero for a
 * plain dense llama. */
typedef struct sh_mkmodel_shape {
    const char *name; /* "smollm2-135m", or "custom" */
    int64_t n_layers;
    int64_t dim;        /* embedding width */
    int64_t ffn;        /* feed-forward width */
    int64_t n_heads;    /* query heads; head_dim = dim / n_heads */
    int64_t n_kv_heads; /* key/value heads (grouped-query attention) */
    int64_t vocab;
    int64_t ctx; /* context length */
    float rope_base;
    float rms_eps;
    bool tied;              /* the output projection is token_embd (no output.weight) */
    int64_t sliding_window; /* ARCH.attention.sliding_window when > 0 (Mistral, Gemma 3 local) */
    const char *arch;       /* general.architecture: NULL or "llama", "gemma3", "qwen3",
                               "qwen3moe", "qwen2moe", "phi3", "olmoe" */
    int64_t head_dim;       /* ARCH.attention.key_length/value_length; 0: dim / n_heads */
    int64_t n_experts;      /* routed experts per layer (ffn_*_exps); 0: a dense FFN */
    int64_t n_experts_used; /* experts chosen per token */
    int64_t shared_ffn;     /* qwen2moe: the shared expert's FFN width; 0: ffn */
    int64_t expert_ffn;     /* each expert's FFN width; 0: ffn */
    int64_t swa_pattern;    /* gemma3: every swa_pattern-th layer is global; 0: not written
                               (llama.cpp's default, 6) */
    float rope_base_swa;    /* gemma3 local layers' rope base; 0: not written (10000) */
    float softcap;          /* ARCH.final_logit_softcapping; 0: not written */
    sh_mkmodel_rope_scaling rope_scaling;
    float rope_factor;     /* the context extension factor of rope_scaling */
    int64_t rope_orig_ctx; /* the original context of YaRN / Llama 3 / phi3; 0: ctx */
} sh_mkmodel_shape;

/* The shape's architecture name ("llama" when shape->arch is NULL). */
const char *sh__mkmodel_arch(const sh_mkmodel_shape *s);

/* head_dim, or dim / n_heads when it is 0. */
int64_t sh__mkmodel_head_dim(const sh_mkmodel_shape *s);

/* The named shapes; *n receives their count. Static storage. */
const sh_mkmodel_shape *sh__mkmodel_shapes(size_t *n);

/* A named shape, or NULL when `name` is not one. */
const sh_mkmodel_shape *sh__mkmodel_shape_find(const char *name);

typedef struct sh_mkmodel_opts {
    sh_mkmodel_shape shape; /* resolved: every field set (vocab may be 0 with vocab_from) */
    sh_dtype type; /* of the 2-D matrices: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
                      IQ4_NL, IQ4_XS */
    uint64_t seed;
    float std;              /* of the normal weights; norms are 1 + N(0, std) */
    const char *vocab_from; /* copy every tokenizer.* key from this GGUF; NULL: generate */
    /* With vocab_from: when set, shape.vocab must equal the file's token count; when clear, the
     * file's count replaces shape.vocab. */
    bool vocab_explicit;
    int n_threads; /* generation and quantization threads; the bytes do not depend on it */
    sh_gguf_write_progress_fn progress; /* optional, called from the writing thread */
    void *progress_user;
} sh_mkmodel_opts;

/* Defaults: the "custom" name with zero dims, F16, seed 1, std 0.02, 2 threads, rope base 10000,
 * rms eps 1e-5. */
void sh__mkmodel_opts_init(sh_mkmodel_opts *o);

typedef struct sh_mkmodel_result {
    uint64_t n_params; /* elements of all tensors */
    uint64_t n_bytes;  /* file size */
    int64_t vocab;     /* the vocabulary size used */
} sh_mkmodel_result;

/* Writes the model to `path` (through a temporary file renamed on success). The same options
 * give a byte-identical file whatever n_threads is. Weights are streamed tensor by tensor, so
 * memory stays small for any size. `res` may be NULL. Returns SH_EINVAL for an inconsistent
 * shape (e.g. dim not divisible by n_heads, a quantized type whose rows are not whole blocks, a
 * vocab_from count that differs from an explicit vocab), SH_EFORMAT / SH_EIO for a vocab_from
 * file that cannot be read or has no tokenizer.ggml.tokens, SH_EIO for write failures, SH_ENOMEM;
 * e says which. Blocks; any thread. */
sh_err sh__mkmodel_write(const char *path, const sh_mkmodel_opts *o, sh_mkmodel_result *res,
                         sh_error *e);

/* llama.cpp's general.file_type for a file whose matrices have type t, or -1 when t is not one
 * mkmodel writes. */
int32_t sh__mkmodel_file_type(sh_dtype t);

#endif
