/* The Llama-family models (llama, mistral-style, qwen2, qwen3, gemma3, phi3, and the
 * mixture-of-experts forms mixtral, qwen2moe, qwen3moe, olmoe): weights from a GGUF or a llama2.c
 * checkpoint used in place, and a batched forward pass over a paged KV cache, written against
 * kernels/backend.h. */
#ifndef SH_MODEL_LLAMA_H
#define SH_MODEL_LLAMA_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "shoal/err.h"

/* Shape and constants of a model, from GGUF metadata or a llama2.c header. */
typedef struct sh_llama_hparams {
    char arch[16];          /* "llama", "qwen2", ...; "llama2c" for a .bin checkpoint */
    int32_t n_vocab;        /* rows of the embedding */
    int32_t dim;            /* <arch>.embedding_length */
    int32_t n_layers;       /* <arch>.block_count */
    int32_t n_heads;        /* <arch>.attention.head_count */
    int32_t n_kv_heads;     /* <arch>.attention.head_count_kv (grouped-query when < n_heads) */
    int32_t head_dim;       /* <arch>.attention.key_length, else dim / n_heads */
    int32_t n_ff;           /* <arch>.feed_forward_length */
    int32_t n_ctx_train;    /* <arch>.context_length */
    int32_t sliding_window; /* <arch>.attention.sliding_window: in a sliding layer (see
                             * swa_period) a query at p sees keys > p - w; 0: every layer sees
                             * every earlier key (the default) */
    int32_t swa_period;     /* which layers slide when sliding_window > 0: 0, every layer
                             * (Mistral); p, layer l when l % p < p - 1, the others global
                             * (gemma3: <arch>.attention.sliding_window_pattern, default 6) */
    int32_t n_rot;          /* <arch>.rope.dimension_count, else head_dim */
    float rope_base;        /* <arch>.rope.freq_base, default 10000 */
    float rope_base_swa;    /* RoPE base of the sliding layers: gemma3's <arch>.rope.freq_base_swa
                             * (default 10000); rope_base for other architectures */
    sh_rope_scaling rope_scaling; /* linear / YaRN scaling from <arch>.rope.scaling.* (see
                                   * model/llama_rope.h); freq_factors NULL: the factor tensors
                                   * are sh_llama.rope_freqs / rope_freqs_long */
    float norm_eps;               /* <arch>.attention.layer_norm_rms_epsilon, default 1e-5 */
    sh_rope_mode rope_mode; /* NORMAL for llama (GGUF Q/K are permuted for it), NEOX for qwen2 */
    bool tied_embeddings;   /* no output.weight: the head is token_embd */
    bool qkv_bias;          /* qwen2's attn_{q,k,v}.bias */
    bool qk_norm;           /* qwen3, gemma3: RMSNorm of each q and k head (attn_{q,k}_norm) */
    bool qk_norm_full;      /* olmoe (with qk_norm): one RMSNorm over all of q and one over all
                             * of k, before the split into heads; the norms are n_heads *
                             * head_dim and n_kv_heads * head_dim wide */
    bool post_norms;        /* gemma3: the attention and FFN outputs are RMS-normalized
                             * (post_attention_norm, post_ffw_norm) before the residual adds */
    sh_matmul_act ffn_act;  /* SH_MATMUL_ACT_SWIGLU, or GEGLU for gemma3 */
    float embd_scale;       /* embedding rows are multiplied by this (gemma3: sqrt(dim)); 1 */
    float attn_scale;       /* attention scores are scale * q.k: 1 / sqrt(head_dim) */
    float final_softcap;    /* <arch>.final_logit_softcapping c: logits = c tanh(logits / c) */
    /* Mixture of experts (mixtral-style llama, qwen2moe, qwen3moe, olmoe): every layer's FFN is
     * n_expert experts of which the router picks n_expert_used per token (sh_moe_args). 0: dense */
    int32_t n_expert;      /* <arch>.expert_count */
    int32_t n_expert_used; /* <arch>.expert_used_count */
    int32_t n_ff_exp;      /* <arch>.expert_feed_forward_length, else n_ff */
    int32_t n_ff_shexp;    /* <arch>.expert_shared_feed_forward_length; 0: no shared expert */
    bool expert_norm;      /* the chosen weights renormalised to sum 1 (not qwen2moe, olmoe) */
} sh_llama_hparams;

/* Whether layer l attends through the sliding window (hp->sliding_window > 0 and l is one of the
 * sliding layers of hp->swa_period). */
bool sh_llama_layer_slides(const sh_llama_hparams *hp, int32_t l);

/* The sliding window by which a sequence's early KV blocks may be released (the KV manager's
 * window, sh_kv_cache.window of every layer): hp->sliding_window when every layer slides, 0 when
 * some layer is global (gemma3's interleaved layers), since a global layer reads every position. */
int32_t sh_llama_kv_window(const sh_llama_hparams *hp);

/* One transformer block's weights. Matrices are views of (n_out, n_in) rows of their own type
 * (ne[0] = n_in), pointing into the file mapping; vectors are f32. */
typedef struct sh_llama_layer {
    const float *attn_norm; // (dim)
    sh_tensor wq;           // (n_heads * head_dim, dim)
    sh_tensor wk;           // (n_kv_heads * head_dim, dim)
    sh_tensor wv;           // (n_kv_heads * head_dim, dim)
    sh_tensor wo;           // (dim, n_heads * head_dim)
    const float *bq;        // (n_heads * head_dim) or NULL
    const float *bk;        // (n_kv_heads * head_dim) or NULL
    const float *bv;        // (n_kv_heads * head_dim) or NULL
    const float *ffn_norm;  // (dim)
    sh_tensor w_gate;       // (n_ff, dim)
    sh_tensor w_up;         // (n_ff, dim)
    sh_tensor w_down;       // (dim, n_ff)

    /* qwen3, gemma3 and olmoe (NULL for the others): the RMSNorm of q and k (qk_norm), and
     * gemma3's norms of the attention and FFN outputs (post_norms). */
    const float *q_norm;         // (head_dim), olmoe (qk_norm_full): (n_heads * head_dim)
    const float *k_norm;         // (head_dim), olmoe (qk_norm_full): (n_kv_heads * head_dim)
    const float *post_attn_norm; // (dim) post_attention_norm.weight
    const float *post_ffn_norm;  // (dim) post_ffw_norm.weight

    /* MoE layers (hp.n_expert > 0) instead of w_gate/w_up/w_down: */
    sh_tensor ffn_gate_inp;   // (n_expert, dim) the router
    sh_tensor gate_exps;      // (n_expert, n_ff_exp, dim)
    sh_tensor up_exps;        // (n_expert, n_ff_exp, dim)
    sh_tensor down_exps;      // (n_expert, dim, n_ff_exp)
    sh_tensor gate_shexp;     // (n_ff_shexp, dim) or data NULL
    sh_tensor up_shexp;       // (n_ff_shexp, dim)
    sh_tensor down_shexp;     // (dim, n_ff_shexp)
    sh_tensor gate_inp_shexp; // (dim): the shared expert scaled by sigmoid(x . this), or NULL

    /* A rank of a tensor-parallel group whose query heads do not line up with the KV groups
     * runs its attention in parts (sh_llama_tp): part 0's weights are wq .. bv and wo above,
     * parts 1 .. n_parts - 1 are here. */
    struct sh_llama_attn_w {
        sh_tensor wq, wk, wv, wo;
        const float *bq, *bk, *bv;
    } tp_part[2];
} sh_llama_layer;

/* Tensor parallelism (Megatron splits): what rank `rank` of a group of `size` holds and runs.
 * Query heads are cut into contiguous ranges, balanced (9 heads over 2 ranks: 5 + 4); a range
 * that does not line up with the KV groups (n_heads / n_kv_heads query heads per KV head) is run
 * as up to three parts, each a run of heads sharing KV heads evenly (a partial group, whole
 * groups, a partial group), and a KV head that two ranks' heads read is computed and cached on
 * both. wq/wk/wv (and biases) and w_gate/w_up are views of row ranges of the file (column
 * parallel); wo and w_down are copies of this rank's column slice (row parallel), which must
 * start and end on the type's block; the partial outputs of wo and w_down are summed over the
 * ranks (sh_coll_allreduce). The output head is split by vocabulary rows and the logits
 * gathered (sh_coll_allgather); the embedding, norms and MoE router are replicated; MoE experts
 * are placed whole, n_expert / size per rank, and the shared expert runs on rank 0. size 1: the
 * whole stage, one part. */
#define SH_LLAMA_TP_PARTS 3
typedef struct sh_llama_tp_part {
    int32_t head0, n_heads;  /* query heads [head0, head0 + n_heads) of the model */
    int32_t kv0, n_kv_heads; /* the KV heads they read, [kv0, kv0 + n_kv_heads) */
} sh_llama_tp_part;

typedef struct sh_llama_tp {
    int32_t rank, size;
    int32_t n_parts;
    sh_llama_tp_part part[SH_LLAMA_TP_PARTS];
    int32_t n_heads, n_kv_heads; /* this rank's, summed over the parts */
    int32_t ff0, n_ff;           /* dense FFN rows [ff0, ff0 + n_ff) */
    int32_t vocab0, n_vocab;     /* output rows [vocab0, vocab0 + n_vocab) */
    int32_t vocab_pad;           /* ceil(hp.n_vocab / size): every rank's share in the gather */
    int32_t expert0, n_expert;   /* MoE experts [expert0, expert0 + n_expert) */
    bool shared_expert;          /* this rank runs the MoE shared expert (rank 0) */
    /* The rank's copies of the row-parallel slices (llama_tp.c): anonymous memory whose pages
     * are given back while every live context's backend holds its own copy (sh_llama_ctx_create),
     * refilled from the mapping when a context needs the bytes again. Freed with the model. */
    struct sh__llama_tp_copies *copies;
} sh_llama_tp;

/* A loaded model, or the part of it one pipeline stage runs: layers [first, last), the
 * embedding when first == 0, the final norm and head when last == n_layers. Immutable after
 * load (but for whether a tensor-parallel rank's copies are resident: tp.copies, under its own
 * lock); any number of contexts, made on any threads, may share it. */
typedef struct sh_llama {
    sh_llama_hparams hp;
    int32_t first, last;
    sh_tensor tok_embd;     // (n_vocab, dim); data NULL unless first == 0 or tied head
    const float *out_norm;  // (dim); NULL unless last == n_layers
    sh_tensor output;       // (n_vocab, dim); data NULL unless last == n_layers
    sh_llama_layer *layers; // (n_layers); only [first, last) filled
    /* Per-frequency RoPE divisors (n_rot / 2 floats in the file) or NULL: Llama 3's rope_freqs
     * or Phi-3's rope_factors_short, and Phi-3's rope_factors_long (used when a context's KV
     * capacity exceeds the original context, sh__llama_rope_for_ctx). */
    const float *rope_freqs;
    const float *rope_freqs_long;
    struct sh_gguf *gguf;   /* owned source when loaded from GGUF */
    struct sh_llama2c *l2c; /* owned source when loaded from a llama2.c .bin */
    /* The weights lie in a private read-only file mapping (sh_llama_load): a context whose
     * backend copies a matrix drops the mapping's pages of it (sh__file_drop). */
    bool file_mapped;
    sh_llama_tp tp; /* this rank's share (size 1: the whole stage) */
} sh_llama;

typedef struct sh_llama_load_opts {
    int32_t first, last; /* layer range; last = 0 means n_layers */
    /* Touch every page of the weights this stage uses at load, so no page fault lands in a
     * token (DESIGN §6). */
    bool prefault;
    /* Called during prefault with the fraction done (0..1), from the loading thread. */
    void (*progress)(float done, void *arg);
    void *progress_arg;
    /* Tensor parallelism: load rank tp_rank's slices of a group of tp_size ranks (sh_llama_tp);
     * 0/0 or 0/1: the whole stage. Refused with SH_EINVAL and one line saying why: tp_size < 0
     * or > 64, tp_rank outside [0, tp_size), tp_size > n_heads or > n_vocab, a feed-forward
     * width of fewer blocks (of ffn_down's type) than ranks, a head boundary inside a block of
     * attn_output's type (named with its width, slice and block), n_expert % tp_size != 0; with
     * SH_EUNSUPPORTED: olmoe's QK-norm over all heads. */
    int32_t tp_rank, tp_size;
    /* With prefault, only layers [first, first + prefault_layers) are touched (besides the
     * embedding and the head): what a context with that exit_layer runs (a self-speculation
     * drafter's, model/spec_draft.h), so the other layers' pages are never read. 0: every layer
     * of the stage. */
    int32_t prefault_layers;
} sh_llama_load_opts;

/* Loads a model from `path`: a GGUF (architectures llama (mixtral-style MoE too), mistral, qwen2,
 * qwen2moe, qwen3, qwen3moe, gemma3, phi3, olmoe) or a llama2.c checkpoint (told apart by the GGUF
 * magic). opts may be NULL (the whole model, no prefault). Weights stay in the read-only mapping;
 * nothing is copied (a context may copy and drop them, sh_llama_ctx_opts.no_weight_prepare),
 * except a tensor-parallel rank's column slices of wo and w_down (sh_llama_tp): copies that a
 * context whose backend copies them gives back too (their pages are dropped while no live
 * context reads them as they are; a context that does refills them from the mapping).
 * Returns, with e filled and *out NULL: SH_EIO (cannot open), SH_EFORMAT (a missing or wrongly
 * shaped tensor or key), SH_EUNSUPPORTED (architecture, a weight type the backend ops lack, a
 * non-f32 norm, olmoe split over ranks), SH_EINVAL (bad layer range, a split the ranks cannot make:
 * see tp_size), SH_ENOMEM. Any thread. The caller owns *out. */
sh_err sh_llama_load(const char *path, const sh_llama_load_opts *opts, sh_llama **out, sh_error *e);

/* Embedding pooling, llama.cpp's values of <arch>.pooling_type: the mean of a sequence's final
 * hidden states (after the output norm), the first token's (CLS) or the last token's. */
enum { SH_LLAMA_POOL_MEAN = 1, SH_LLAMA_POOL_CLS = 2, SH_LLAMA_POOL_LAST = 3 };

/* The model's pooling: <arch>.pooling_type when it is 1, 2 or 3; mean otherwise (absent, 0
 * "none" (per-token vectors, which are not served), unknown, or a llama2.c checkpoint). */
uint8_t sh_llama_pooling(const sh_llama *m);

/* Frees the model and unmaps its file; accepts NULL. No context may still use it. */
void sh_llama_destroy(sh_llama *m);

/* Bytes of weights the stage uses (for logs and memory budgets); a tensor-parallel rank's: its
 * slices, the replicated norms not counted, the embedding table counted whole. */
uint64_t sh_llama_weight_bytes(const sh_llama *m);

/* ---- inference context ------------------------------------------------------------------- */

/* The collectives a tensor-parallel rank's context calls, as function pointers: model/ knows no
 * runtime (docs/ARCHITECTURE.md's layers). runtime/coll.h's sh_coll fills it: rank and size from
 * sh_coll_rank/size, ud the sh_coll, and sh_coll_allreduce_ud / sh_coll_allgather_ud. Both calls
 * have the contract of their sh_coll counterparts. size 0: no group (a model loaded whole). */
typedef struct sh_llama_comm {
    int32_t rank, size;
    void *ud;
    sh_err (*allreduce)(void *ud, float *buf, size_t n, sh_error *e);
    sh_err (*allgather)(void *ud, const void *in, size_t bytes, void *out, sh_error *e);
} sh_llama_comm;

typedef struct sh_llama_ctx_opts {
    int32_t max_tokens; /* most rows (tokens of all sequences) in one forward call */
    int32_t max_seqs;   /* most sequences in one call */
    int32_t max_logits; /* most rows of logits one call returns (0: max_seqs) */
    int32_t kv_tokens;  /* KV pool capacity in tokens, rounded up to whole blocks */
    sh_dtype kv_type;   /* SH_DTYPE_F32 (default when 0) or SH_DTYPE_F16 */
    /* By default the context hands every matrix to sh_backend_weight_prepare (the CPU backend
     * repacks quantized and F16 weights for its fast kernels into memory of its own, shared by
     * contexts over the same model and backend) and, where the backend says it copied one
     * (sh_backend_weight_copied), drops the file mapping's pages of it: the weights stay
     * resident once. Set to keep only the mapping. */
    bool no_weight_prepare;
    /* The rank's collective group, required when the model was loaded with tp_size > 1 (its rank
     * and size must be the model's: SH_EINVAL otherwise); used from the context's thread during
     * sh_llama_forward. Its buffers may reach sh_llama_tp_coll_bytes. */
    sh_llama_comm comm;
    /* Early exit (self-speculation's draft, model/spec_draft.h): the context runs only layers
     * [0, exit_layer) and applies the model's final norm and output head to their output; its KV
     * pool holds those layers only. Any number of such contexts may share the model with full
     * ones. 0: every layer of the stage. Needs a model loaded whole (layers [0, n_layers), no
     * tensor parallelism) and 1 <= exit_layer <= n_layers, else SH_EINVAL. */
    int32_t exit_layer;
} sh_llama_ctx_opts;

/* The largest buffer one collective of a context over m with these options passes (all-reduce of
 * max_tokens rows of dim floats, all-gather of the logits): what the group's max_bytes must
 * allow. 0 for a model loaded whole. */
size_t sh_llama_tp_coll_bytes(const sh_llama *m, const sh_llama_ctx_opts *o);

typedef struct sh_llama_ctx sh_llama_ctx;

/* Creates a context: one backend stream, the workspace for max_tokens rows and the paged KV pool
 * of this stage's layers, all allocated now (a forward call allocates nothing). The model and
 * the backend must outlive the context. Returns SH_EINVAL (a bad option), SH_ENOMEM, or a
 * backend error; *out NULL on failure. The context belongs to one thread at a time. */
sh_err sh_llama_ctx_create(const sh_llama *m, sh_backend *be, const sh_llama_ctx_opts *opts,
                           sh_llama_ctx **out, sh_error *e);

/* Frees the context and its KV pool; accepts NULL. */
void sh_llama_ctx_destroy(sh_llama_ctx *c);

/* Blocks in the KV pool (block j holds SH_KV_BLOCK_TOKENS positions of one sequence). The caller
 * (the KV manager, or a single-sequence driver using blocks 0, 1, 2, ...) hands them out. */
int32_t sh_llama_ctx_n_blocks(const sh_llama_ctx *c);

/* The most rows of logits one sh_llama_forward of this context returns (its options' max_logits,
 * or max_seqs when that was 0): a step wanting more fails with SH_EINVAL. */
int32_t sh_llama_ctx_max_logits(const sh_llama_ctx *c);

/* One sequence's part of a step: n_tokens new tokens at positions pos0 .. pos0 + n_tokens - 1
 * (a prefill chunk, or a decode step with n_tokens 1); positions [0, pos0) are already in its
 * cache. */
typedef struct sh_llama_seq {
    const int32_t *tokens; // (n_tokens) token ids; read on the first stage only
    int32_t n_tokens;
    int32_t pos0;
    const int32_t *blocks; // (ceil((pos0 + n_tokens) / SH_KV_BLOCK_TOKENS)) its block table
    bool want_logits;      /* logits for this sequence's last token */
    /* Logits for the last n_logits tokens instead (1..n_tokens; 0: as want_logits says): a
     * speculative step's verification reads a row for the last accepted token and one for each
     * drafted token. Rows come in token order. */
    int32_t n_logits;
} sh_llama_seq;

typedef struct sh_llama_batch {
    int32_t n_seqs;
    const sh_llama_seq *seqs; // (n_seqs); rows are the sequences' tokens in this order
    bool all_logits;          /* logits for every row instead (max_logits must allow it) */
    const float *hidden_in;   // (n_tok, dim) activations from the previous stage when first > 0
    /* A greedy head's step (sh_sampler_plain_greedy for every sampled sequence): each wanted
     * row's top-1 and log-sum-exp (sh_llama_out.top1) instead of its logits. A tensor-parallel
     * rank then exchanges 16 bytes a row with its peers instead of gathering its share of the
     * vocabulary; every rank returns the same top1. Off (full rows of logits) by default. */
    bool top1_only;
    /* The last stage also returns every row's final hidden state after the output norm
     * (rmsnorm(x) * out_norm, what the head reads) in sh_llama_out.hidden: embeddings pool them.
     * Ignored by the other stages (their hidden rows are returned anyway). */
    bool want_hidden;
} sh_llama_batch;

/* A row's greedy pick: its first largest logit (after the final soft-cap) and the row's
 * log-sum-exp, so that the token's log-probability is logit - lse. id -1 (logit and lse
 * -INFINITY) when every logit is -INFINITY or NaN. */
typedef struct sh_llama_top1 {
    int32_t id;
    float logit;
    double lse;
} sh_llama_top1;

typedef struct sh_llama_out {
    int32_t n_tok;       /* rows in the step */
    const float *hidden; // (n_tok, dim) when this stage is not the last, or want_hidden; else NULL
    int32_t n_logits;    /* rows of logits: wanted sequences in batch order, or every row */
    const float *logits; // (n_logits, n_vocab) when this stage is the last; else NULL
    /* (n_logits) instead of logits (NULL then) when the batch asked for top1_only */
    const sh_llama_top1 *top1;
} sh_llama_out;

/* MoE load figures of layer l (in the stage, hp.n_expert > 0; else NULL): n_expert counters of
 * the tokens the router has sent to each expert since the context was created. Updated by
 * sh_llama_forward; read them from the context's thread. */
const uint64_t *sh_llama_ctx_expert_tokens(const sh_llama_ctx *c, int32_t l);

/* The experts layer l chose in the last sh_llama_forward: (n_tok, n_expert_used) global expert
 * indices, each row in the router's order (for tests and traces); NULL where there are none. */
const int32_t *sh_llama_ctx_expert_ids(const sh_llama_ctx *c, int32_t l);

/* Runs the stage's part of the forward pass for a batch and waits for it. A tensor-parallel rank:
 * every rank of the group calls it with the same batch and returns the same full outputs (full
 * rows of logits, or with top1_only the same picks); a
 * failed collective returns its error (SH_ETIMEDOUT, SH_ECLOSED, SH_EPROTO) naming the layer,
 * after which the step's cache rows are unspecified and the group is broken. The outputs point
 * into the context and stay valid until the next call. Borrowed arrays (tokens, block tables,
 * hidden_in) must stay valid during the call. Returns SH_EINVAL with e filled (too many rows or
 * sequences, a token outside the vocabulary, a negative position, a block outside the pool,
 * a missing hidden_in) leaving the KV cache untouched, or a backend error after which the
 * cache rows of this step are unspecified. */
sh_err sh_llama_forward(sh_llama_ctx *c, const sh_llama_batch *b, sh_llama_out *out, sh_error *e);

#endif
