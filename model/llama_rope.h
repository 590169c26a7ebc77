/* RoPE scaling of the Llama-family models: the <arch>.rope.scaling.* metadata and the
 * per-frequency factor tensors (Llama 3's rope_freqs, Phi-3's rope_factors_short/long), read as
 * llama.cpp reads them; shared by the loader (llama_load.c) and the forward pass. */
#ifndef SH_MODEL_LLAMA_ROPE_H
#define SH_MODEL_LLAMA_ROPE_H

#include "model/gguf.h"
#include "model/llama.h"

/* Fills hp->rope_scaling (freq_factors NULL: the tensors are the model's) from
 * <arch>.rope.scaling.type (none, linear, yarn, longrope; absent: linear when a factor is
 * given), .factor (or the older rope.scale_linear), .original_context_length (default
 * context_length), .yarn_ext_factor (default 1 for yarn, else 0), .yarn_attn_factor,
 * .yarn_beta_fast (32), .yarn_beta_slow (1), .yarn_log_multiplier and .attn_factor.
 * hp->arch, n_rot and n_ctx_train must be set. An unknown type or a bad value: SH_EUNSUPPORTED
 * / SH_EFORMAT naming the key. */
sh_err sh__llama_rope_hparams(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e);

/* Binds rope_freqs.weight (Llama 3), or phi3's rope_factors_short.weight and
 * rope_factors_long.weight, when present: F32 vectors of n_rot / 2 positive divisors. A wrong
 * length, type or value: SH_EFORMAT naming the tensor. */
sh_err sh__llama_rope_bind(const sh_gguf *g, sh_llama *m, sh_error *e);

/* The scaling a context holding kv_tokens positions uses: the model's, with its factors. For
 * Phi-3's long rope the long factors when kv_tokens rounded up to 256 exceeds the original
 * context (as llama.cpp chooses by its padded n_ctx), else the short ones; the NumPy reference
 * (tests/reference/ref_forward.py) uses the short ones unless --long-rope. */
sh_rope_scaling sh__llama_rope_for_ctx(const sh_llama *m, int32_t kv_tokens);

#endif
