/* Mixture-of-Experts layers of the Llama-family model: the expert metadata and tensors of a GGUF
 * (mixtral-style llama, qwen2moe), shared by the loader (llama_load.c) and the forward pass. */
#ifndef SH_MODEL_LLAMA_MOE_H
#define SH_MODEL_LLAMA_MOE_H

#include "model/gguf.h"
#include "model/llama.h"

/* Reads <arch>.expert_count (0 or absent: a dense model), expert_used_count,
 * expert_feed_forward_length (default feed_forward_length) and
 * expert_shared_feed_forward_length (qwen2moe's shared expert; absent: none) into hp, and
 * whether the chosen weights are renormalised (every MoE architecture but qwen2moe and olmoe).
 * hp->arch, dim and n_ff must be set. A MoE tensor in a file without an expert count, a count
 * below 1 or k outside [1, count]: SH_EFORMAT naming the key, e filled. */
sh_err sh__llama_moe_hparams(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e);

/* Binds layer l's router (ffn_gate_inp, F32 or a matmul type), its 3-D expert tensors
 * ffn_{gate,up,down}_exps and, when hp->n_ff_shexp > 0, the shared expert ffn_*_shexp with its
 * gate vector ffn_gate_inp_shexp (optional). A missing tensor, a shape that disagrees with the
 * metadata (the expert count included) or a type the MoE op lacks: SH_EFORMAT /
 * SH_EUNSUPPORTED naming the tensor. */
sh_err sh__llama_moe_bind(const sh_gguf *g, const sh_llama_hparams *hp, int32_t l,
                          sh_llama_layer *L, sh_error *e);

#endif
