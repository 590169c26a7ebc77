/* Internal to mkmodel: the architecture-specific parts (checks, ARCH.* keys, tensor layout). */
#ifndef SH_MODEL_MKMODEL_ARCH_H
#define SH_MODEL_MKMODEL_ARCH_H

#include "model/mkmodel.h"

/* SH_OK when the shape's architecture is known and its dimensions, experts and rope scaling are
 * consistent; SH_EINVAL with e saying which otherwise. Weight-type checks are the caller's. */
sh_err sh__mkmodel_arch_check(const sh_mkmodel_shape *s, sh_error *e);

/* Writes the ARCH.* keys of a checked shape (context, widths, heads, rope, window, experts,
 * scaling; llama.vocab_size for llama). */
sh_err sh__mkmodel_arch_metadata(sh_gguf_writer *w, const sh_mkmodel_shape *s, sh_error *e);

/* Adds every tensor of a checked shape in llama.cpp's naming: matrices of `type` and F32 norms,
 * biases and routers produced by fill(user, ...), plus the rope factor tensors computed here into
 * factors_a / factors_b (head_dim / 2 floats each; they must live until the file is written).
 * *n_params receives the element count. */
sh_err sh__mkmodel_arch_tensors(sh_gguf_writer *w, const sh_mkmodel_shape *s, sh_dtype type,
                                sh_gguf_write_fill_fn fill, void *user, float *factors_a,
                                float *factors_b, uint64_t *n_params, sh_error *e);

#endif
