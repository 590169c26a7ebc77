/* Speculative decoding's model drafters: a second, smaller model with the target's vocabulary
 * (--spec draft:PATH), or the target's own first layers and output head (--spec self:LAYERS),
 * each drafting greedily with a KV cache of its own that follows one sequence. */
#ifndef SH_MODEL_SPEC_DRAFT_H
#define SH_MODEL_SPEC_DRAFT_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "shoal/err.h"

typedef struct sh_spec_draft sh_spec_draft;

typedef struct sh_spec_draft_opts {
    /* A draft model's file (GGUF, or a llama2.c .bin when the target is one too: its vocabulary
     * is then the target's tokenizer.bin read with the draft's size); NULL with self_layers. */
    const char *path;
    /* > 0: self-speculation, the target's layers [0, self_layers) and its head draft (path is
     * ignored); 1..n_layers - 1. */
    int32_t self_layers;
    const char *l2c_tokenizer; /* the target's tokenizer.bin when both are llama2.c checkpoints */
    int32_t kv_tokens;         /* the draft cache's capacity (the target's, so drafts fit) */
    sh_dtype kv_type;          /* SH_DTYPE_F32 (0) or SH_DTYPE_F16 */
    int32_t max_tokens;        /* most rows of one catch-up forward pass (at least 1) */
    bool prefault;             /* touch a draft file's weights at load (sh_llama_load_opts) */
} sh_spec_draft_opts;

/* Makes a drafter for a target model loaded whole with its tokenizer, on the target's backend
 * (which, with the target and its tokenizer, must outlive the drafter). A draft file must hold a
 * vocabulary equal to the target's: the same number of embedding rows, the same token texts in
 * the same order, the same BOS and EOS ids. Returns, with e naming the file and what differs
 * (both sizes, or the first differing id and both texts) and *out NULL: SH_EINVAL (self_layers
 * outside 1..n_layers - 1, another vocabulary, no file given), the loader's errors for a missing
 * or broken file (SH_EIO, SH_EFORMAT, SH_EUNSUPPORTED), SH_ENOMEM or a backend error. Any
 * thread; the drafter then belongs to one thread at a time. */
sh_err sh_spec_draft_create(const sh_llama *target, const sh_tokenizer *target_tok, sh_backend *be,
                            const sh_spec_draft_opts *o, sh_spec_draft **out, sh_error *e);

/* Frees the drafter, and the draft model it loaded; accepts NULL. */
void sh_spec_draft_destroy(sh_spec_draft *d);

/* Brings the draft cache to hist[0, n): keeps the longest prefix it already holds and computes
 * the rest (rejected drafts of earlier steps are simply overwritten), leaving the draft's
 * greedy pick after hist[n - 1] ready for the next sh_spec_draft_propose. A caller may call it
 * after a prompt so that the catch-up is not counted in the first step. SH_EINVAL when n is 0 or
 * exceeds the cache; a backend error (the cache is then rebuilt from scratch next time). */
sh_err sh_spec_draft_sync(sh_spec_draft *d, const int32_t *hist, int32_t n, sh_error *e);

/* Drafts up to k tokens to follow hist[0, n) greedily, one draft forward pass per token after
 * the first (which sh_spec_draft_sync gives): writes them to out and their count to *n_out
 * (k, or fewer when the cache would overflow). The cache then holds hist and the drafts but the
 * last; the next call keeps whatever prefix the accepted tokens share with it. Errors as
 * sh_spec_draft_sync's (*n_out 0). */
sh_err sh_spec_draft_propose(sh_spec_draft *d, const int32_t *hist, int32_t n, int32_t k,
                             int32_t *out, int32_t *n_out, sh_error *e);

/* What sh_spec_draft_create and the batched drafter (model/spec_draft_batch.h) share: checks
 * o's self_layers against the target (which must be loaded whole) and, for a draft file, loads it
 * and checks its vocabulary against the target's; sets *own to the loaded file (NULL for
 * self-speculation: the target drafts) and *layers to the layers that run per drafted token.
 * Errors as sh_spec_draft_create's (*own NULL). o's kv_tokens and max_tokens are not read. */
sh_err sh__spec_draft_model(const sh_llama *target, const sh_tokenizer *target_tok,
                            const sh_spec_draft_opts *o, sh_llama **own, int32_t *layers,
                            sh_error *e);

/* The draft model's number of layers that run per drafted token (self: self_layers). */
int32_t sh_spec_draft_layers(const sh_spec_draft *d);

#endif
