/* GGUF model conversion between weight types (`shoal quantize`): which tensors change type, by
 * llama.cpp's `llama-quantize --pure` rules, and a streaming, multi-threaded rewrite of the file
 * whose quantized bytes equal ggml's reference quantizers'. */
#ifndef SH_MODEL_QUANTIZE_H
#define SH_MODEL_QUANTIZE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "model/gguf.h"
#include "shoal/err.h"

/* Why a tensor gets the type it gets (sh__quantize_plan_tensor). */
typedef enum sh_quantize_why {
    SH_QUANTIZE_CONVERT,   /* a weight matrix: converted to the target type */
    SH_QUANTIZE_FALLBACK,  /* a weight matrix whose rows do not fit the target's blocks */
    SH_QUANTIZE_SAME,      /* a weight matrix already of the target type: copied */
    SH_QUANTIZE_KEEP,      /* matched a --keep pattern: copied */
    SH_QUANTIZE_NOT_MATRIX /* 1-D, a norm, or a name llama.cpp never quantizes: copied */
} sh_quantize_why;

/* The target type of one tensor when the file is converted to `target`, and why (`why` may be
 * NULL). `arch` is general.architecture ("" when absent); `keep`/`n_keep` are fnmatch(3) globs
 * matched against the whole name. The rules, in order (llama.cpp's tensor_allows_quantization,
 * llama_tensor_get_type and tensor_type_fallback with --pure):
 *   - a --keep match keeps its type;
 *   - a tensor with fewer than 2 dims (trailing dims of 1 do not count) keeps its type, as does
 *     one whose name does not end in "weight" or contains "_norm.weight", "ffn_gate_inp.weight",
 *     and the other names in quantize.c's `never` list (position/token-type embeddings, MoE
 *     routing tables, small conv and RWKV/vision tensors);
 *   - every other tensor (token_embd.weight and output.weight included) gets `target`, except a
 *     block type whose block does not divide the row length ne[0]: Q2_K and Q3_K fall back to
 *     Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL, and when that block
 *     (32) does not divide ne[0] either, or the target is itself a 32-block type, to F16.
 * Pure function; any thread. */
sh_dtype sh__quantize_plan_tensor(const char *arch, const char *name, uint32_t n_dims,
                                  const uint64_t *ne, sh_dtype cur, sh_dtype target,
                                  const char *const *keep, size_t n_keep, sh_quantize_why *why);

/* True for the types `shoal quantize --type` accepts: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS. */
bool sh__quantize_target_ok(sh_dtype t);

/* The general.file_type (llama_ftype) llama-quantize writes for target type t given by its
 * plain name: ALL_F32 0, MOSTLY_F16 1, Q4_0 2, Q4_1 3, Q8_0 7, Q5_0 8, Q5_1 9, Q2_K 10, Q3_K 12
 * (its "Q3_K" is Q3_K_M), Q4_K 15 (Q4_K_M), Q5_K 17 (Q5_K_M), Q6_K 18, IQ4_NL 25, IQ4_XS 30,
 * BF16 32; -1 for others. */
int32_t sh__quantize_file_type(sh_dtype t);

/* What a progress callback is told as each tensor starts. */
typedef struct sh_quantize_tensor_info {
    uint64_t index, n_tensors; /* index in file order, of n_tensors */
    const char *name;
    sh_dtype from, to;
    sh_quantize_why why;
    uint32_t n_dims;
    const uint64_t *ne;               /* n_dims dims */
    uint64_t in_bytes, out_bytes;     /* of this tensor */
    uint64_t done_bytes, total_bytes; /* output tensor bytes before this one, and in all */
} sh_quantize_tensor_info;

typedef void (*sh_quantize_progress_fn)(void *user, const sh_quantize_tensor_info *t);

typedef struct sh_quantize_opts {
    sh_dtype type;           /* target; must satisfy sh__quantize_target_ok */
    const char *const *keep; /* globs of tensors to copy as they are; may be NULL */
    size_t n_keep;
    int n_threads; /* conversion threads (1..64); the bytes do not depend on it */
    sh_quantize_progress_fn progress; /* optional; called from the calling thread */
    void *progress_user;
} sh_quantize_opts;

/* Defaults: F16 target, no keep patterns, 1 thread, no progress. */
void sh__quantize_opts_init(sh_quantize_opts *o);

typedef struct sh_quantize_result {
    uint64_t n_tensors;
    uint64_t n_converted; /* tensors whose type changed (fallbacks included) */
    uint64_t n_fallback;  /* of those, tensors that got a fallback type */
    uint64_t n_kept;      /* tensors matched by a --keep pattern */
    uint64_t in_tensor_bytes, out_tensor_bytes; /* tensor data, before and after */
    uint64_t in_file_bytes, out_file_bytes;
    uint64_t n_elems; /* elements of all tensors (for bits per weight) */
} sh_quantize_result;

/* Converts the GGUF at `in` to `out` with options `o`. Every metadata key is copied in order,
 * except split.no / split.count / split.tensors.count, which are dropped (as llama.cpp does);
 * general.quantization_version is set to 2 and general.file_type to
 * sh__quantize_file_type(o->type), each replacing the input's value in place or appended. Tensors
 * keep their order, names and dims; each gets sh__quantize_plan_tensor's type: converted rows are
 * widened to float with sh__dequant_row and narrowed with sh__quant_row, a tensor whose type does
 * not change is copied byte for byte. The file streams through the GGUF writer a few MiB of rows
 * at a time (memory stays small for any model) to a temporary file renamed over `out` at the end;
 * on any failure `out` is untouched and nothing is left beside it. `res` may be NULL.
 * Returns SH_EINVAL (bad options, `out` is the same file as `in`, a name the writer refuses),
 * SH_EIO / SH_EFORMAT / SH_EUNSUPPORTED (the input cannot be opened or parsed, a split file with
 * more than one part, or a tensor to convert whose type cannot be read), SH_EIO (the output
 * cannot be written), SH_ENOMEM; e names the file, tensor or key. Blocks; any thread. */
sh_err sh__quantize_file(const char *in, const char *out, const sh_quantize_opts *o,
                         sh_quantize_result *res, sh_error *e);

#endif
