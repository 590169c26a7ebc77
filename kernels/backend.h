/* The backend interface: buffers, streams, events and the ops of the Llama forward pass. */
#ifndef SH_KERNELS_BACKEND_H
#define SH_KERNELS_BACKEND_H

/*
 * A backend is an interface struct of function pointers plus a context pointer (after ggml's
 * backend split). The forward pass (model/llama.c) is written against the inline wrappers at the
 * bottom of this file and never sees which backend it drives.
 *
 * Execution model (the same for every backend, CUDA-like):
 * - Ops are *enqueued* on a stream and return at once; they run in enqueue order. A stream's
 *   `sync` waits until everything enqueued on it so far has run.
 * - Ownership: an op copies its small descriptors (sh_tensor, sh_matmul_args) by value, but every
 *   pointer reachable from its arguments (activations, weights, block tables, position arrays,
 *   the sh_attn_seq array) is borrowed and must stay valid and unmodified by the host until the
 *   stream is synced (or an event recorded after the op has completed).
 * - Enqueue functions check their arguments and return SH_EINVAL (nothing enqueued) on a bad
 *   shape or type; an op that fails while running (a scratch allocation) makes the stream's next
 *   `sync` return the error. After a failed sync the stream's outputs are unspecified.
 * - Memory: buffers come from `buf_alloc`. On the CPU backend they are ordinary host memory, and
 *   any host pointer (an mmapped GGUF, a malloc'd array) may be passed to an op as well; on a
 *   device backend op pointers must be device memory and `copy` moves bytes in and out.
 * - Threads: one stream is used by one thread at a time. Different streams of one backend may be
 *   used from different threads. Nothing here allocates per op on the host hot path.
 *
 * Layout conventions: all float activations are f32, row-major, contiguous; a shape comment
 * (n_tok, n) means n_tok rows of n floats. "n_tok" rows of a step may belong to several
 * sequences (a batch): row-wise ops do not care; attention gets the split in sh_attn_batch.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "shoal/err.h"

/* ---- descriptors ------------------------------------------------------------------------- */

/* A view of a contiguous tensor. ne[0] is the innermost dimension (elements per row; for block
 * types a multiple of the block size), ne[1] the number of rows, ne[2] and ne[3] outer
 * dimensions (1 when unused). Rows are packed: row r starts at
 * data + r * sh__dtype_row_bytes(type, ne[0]). The view does not own `data`. */
typedef struct sh_tensor {
    sh_dtype type;
    int64_t ne[4];
    void *data;
} sh_tensor;

/* Tokens per KV-cache block (page). Fixed so that kernels can unroll on it. */
#define SH_KV_BLOCK_TOKENS 16

/* One layer's paged KV cache. Position p of a sequence whose block table is `bt` lives in block
 * bt[p / SH_KV_BLOCK_TOKENS] at offset p % SH_KV_BLOCK_TOKENS. Blocks are owned by whoever
 * allocated the pools (the KV manager); a block index must be < n_blocks. */
typedef struct sh_kv_cache {
    sh_dtype type; /* SH_DTYPE_F32 or SH_DTYPE_F16 */
    int32_t n_blocks;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t window; /* sliding window: a query at position p attends to keys > p - window (and
                     * block-table entries wholly before that may be -1, released);
                     * 0: to every key <= p */
    void *k;        // (n_blocks, SH_KV_BLOCK_TOKENS, n_kv_heads, head_dim)
    void *v;        // (n_blocks, SH_KV_BLOCK_TOKENS, n_kv_heads, head_dim)
} sh_kv_cache;

/* One sequence of an attention batch. Its new tokens are n_rows consecutive rows of q/k/v/out,
 * at positions pos0, pos0 + 1, ..., pos0 + n_rows - 1; the sequence's context after the step is
 * pos0 + n_rows tokens, positions [0, pos0) already stored in the cache. Prefill (n_rows > 1,
 * possibly a chunk with pos0 > 0) and decode (n_rows == 1) are the same thing. */
typedef struct sh_attn_seq {
    int32_t n_rows;
    int32_t pos0;
    const int32_t *blocks; /* block table: ceil((pos0 + n_rows) / SH_KV_BLOCK_TOKENS) entries */
} sh_attn_seq;

/* A step's split of its rows into sequences: seqs[0] owns rows [0, seqs[0].n_rows), seqs[1] the
 * next ones, and so on; the n_rows sum to the op's n_tok. The array and the block tables are
 * borrowed until sync. */
typedef struct sh_attn_batch {
    int32_t n_seqs;
    const sh_attn_seq *seqs;
} sh_attn_batch;

/* RoPE layouts. NORMAL (GGUF llama, ggml mode 0) rotates adjacent pairs (x[2i], x[2i+1]);
 * NEOX (ggml mode 2) rotates (x[i], x[i + n_rot/2]). Pair i turns by pos * base^(-2i/n_rot). */
typedef enum sh_rope_mode {
    SH_ROPE_MODE_NORMAL = 0,
    SH_ROPE_MODE_NEOX = 2,
} sh_rope_mode;

/* How RoPE angles are scaled beyond the plain pos * base^(-2i/n_rot), as GGUF metadata asks
 * (model/llama_load.c fills it; sh_rope_scaling_none() is "no scaling"). For pair i of n_rot/2:
 *   extrap = pos * base^(-2i/n_rot) / freq_factors[i]      (freq_factors NULL: divisor 1)
 *   interp = freq_scale * extrap                           (linear scaling: 1 / factor)
 *   ext_factor == 0: angle = interp, magnitude m = attn_factor
 *   else (YaRN): r = (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor,
 *        angle = interp * (1 - r) + extrap * r, m = attn_factor * (1 + 0.1 ln(1 / freq_scale)),
 *        where lo = max(0, floor(d(beta_fast))), hi = min(n_rot - 1, ceil(d(beta_slow))),
 *        d(b) = n_rot ln(n_ctx_orig / (2 pi b)) / (2 ln base)
 * and the pair becomes (x0 cos - x1 sin, x0 sin + x1 cos) * m. Llama 3's rope_freqs and Phi-3's
 * rope_factors_short/long are freq_factors. */
typedef struct sh_rope_scaling {
    float freq_scale;  /* > 0; 1: none */
    float ext_factor;  /* YaRN extrapolation mix in [0, 1]; 0: no YaRN */
    float attn_factor; /* multiplies cos and sin; 1: none */
    float beta_fast;   /* YaRN correction range, in rotations over n_ctx_orig */
    float beta_slow;
    int32_t n_ctx_orig;        /* YaRN: the context the model was trained on (> 0 when used) */
    const float *freq_factors; /* n_rot / 2 divisors (> 0) or NULL; borrowed until sync */
} sh_rope_scaling;

static inline sh_rope_scaling sh_rope_scaling_none(void)
{
    sh_rope_scaling r = {1.0f, 0.0f, 1.0f, 32.0f, 1.0f, 0, NULL};
    return r;
}

/* Most weights one fused matmul applies to the same input (Q, K, V). */
#define SH_MATMUL_MAX_W 3

/* What a fused matmul does after the products. */
typedef enum sh_matmul_act {
    SH_MATMUL_ACT_NONE = 0, /* y[i] = x' W[i]^T for each weight (or += with accumulate) */
    SH_MATMUL_ACT_SWIGLU,   /* n_w == 2 (gate, up), same n_out: y[0] = silu(x'Wg^T) * (x'Wu^T);
                               y[1] is unused; silu(g) = g / (1 + exp(-g)) */
    SH_MATMUL_ACT_GEGLU,    /* as SWIGLU (no accumulate either) with gelu(x'Wg^T) (Gemma), the tanh
                               approximation
                               gelu(g) = g / 2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))) */
} sh_matmul_act;

/* A (fused) matmul: for each weight i, y[i](n_tok, n_out_i) = x'(n_tok, n_in) W[i](n_out_i,
 * n_in)^T, where x' = x, or x' = rmsnorm(x) * norm when `norm` is set (so the norm, the
 * activation quantization and up to three products share one pass over x).
 * - w[i]: type F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K, ne[0] = n_in
 *   (a multiple of the type's block: 32, or 256 for the K-quants), ne[1] = n_out_i,
 *   ne[2] = ne[3] = 1. The weights of one call may have different types.
 * - Quantized weights are multiplied with the activations quantized to int8, per 32 elements
 *   (Q8_0..Q5_1) or per 256 (Q8_K, for the K-quants) (relative error about 1e-2 of the row's
 *   scale); float weights use f32 arithmetic.
 * - accumulate: y[i] += instead of = (fuses the residual add after wo / w_down). Not with
 *   SWIGLU. x must not overlap any y.
 * Decode is n_tok == 1 (a matvec); a batched step or a prefill chunk reads each weight once for
 * all its rows. */
typedef struct sh_matmul_args {
    const float *x; // (n_tok, n_in)
    int64_t n_tok;
    const float *norm; // (n_in) or NULL
    float norm_eps;
    int32_t n_w; /* 1 .. SH_MATMUL_MAX_W */
    sh_tensor w[SH_MATMUL_MAX_W];
    float *y[SH_MATMUL_MAX_W]; // each (n_tok, w[i].ne[1])
    sh_matmul_act act;
    bool accumulate;
} sh_matmul_args;

/* How a MoE router turns a token's logits over the experts into weights. */
typedef enum sh_moe_gating {
    SH_MOE_GATING_SOFTMAX = 0, /* p = softmax(logits) over all n_expert experts */
} sh_moe_gating;

/* A Mixture-of-Experts FFN (mixtral, qwen3moe, olmoe, qwen2moe): for each token t, the router
 * picks the k experts with the largest logits[t] (ties: the lower index), weighs them
 *   p = softmax(logits[t]);  w_j = p[e_j] (/ sum_j p[e_j] when norm_topk) (* w_scale when set),
 * and computes
 *   y[t] (=|+=) sum_j w_j down_e(silu(gate_e x[t]) * up_e x[t])  +  shared-expert term,
 * the sum over the k chosen experts in the router's order (descending logit, ties: the lower
 * index), then the shared term, then the add to y: one fixed order, so a token's result does not
 * depend on the other tokens of the op, on batching or on the thread count.
 * - Each expert's weights are read once per op for all the tokens routed to it (the tokens are
 *   grouped per expert, not computed per token); an expert no token chose costs nothing.
 * - Expert weights are 3-D GGUF tensors holding the n_local experts [expert0, expert0 + n_local)
 *   of the router's n_expert (expert parallelism: a process may hold a slice; chosen experts it
 *   does not hold contribute nothing here, another holder adds them):
 *     gate, up (ne = dim, n_ff, n_local), down (ne = n_ff, dim, n_local); each of a type the
 *     matmul takes (types may differ), a quantized weight's input width a multiple of its block
 *     (32, or 256 for the K-quants); quantized weights are multiplied with activations quantized
 *     as the matmul quantizes them.
 * - Optional shared expert (gate_sh.data NULL: none), applied to every token (qwen2moe):
 *     gate_sh, up_sh (ne = dim, n_ff_sh), down_sh (ne = n_ff_sh, dim); its output is scaled by
 *     sigmoid(x[t] . gate_inp_sh) when gate_inp_sh.data is set (ne = dim, 1), else by 1.
 * - Outputs: y (accumulate: += , fusing the residual add); optional expert_tokens (n_expert):
 *   the tokens routed to each expert by this op (load figures); optional expert_ids and
 *   expert_w (n_tok, k): each token's chosen experts (global indices) and weights, in the
 *   router's order.
 * x must not overlap y; the arrays are borrowed until sync like every op's. */
typedef struct sh_moe_args {
    const float *x; // (n_tok, dim): the normalized FFN input
    int64_t n_tok;
    const float *logits; // (n_tok, n_expert): the router's output (ffn_gate_inp x)
    int32_t n_expert;    /* router width: 0 means expert0 + n_local */
    int32_t expert0;     /* first expert the tensors hold */
    int32_t k;           /* experts per token, 1 .. n_expert */
    sh_moe_gating gating;
    bool norm_topk; /* divide the k weights by their sum (mixtral, qwen3moe; not olmoe, qwen2moe) */
    float w_scale;  /* multiplies the weights; 0 or 1: none */
    sh_tensor gate, up, down;
    sh_tensor gate_sh, up_sh, down_sh, gate_inp_sh;
    float *y; // (n_tok, dim)
    bool accumulate;
    int32_t *expert_tokens; // (n_expert) or NULL
    int32_t *expert_ids;    // (n_tok, k) or NULL
    float *expert_w;        // (n_tok, k) or NULL
} sh_moe_args;

/* ---- the interface ----------------------------------------------------------------------- */

typedef struct sh_backend_stream sh_backend_stream; /* opaque, backend-defined */
typedef struct sh_backend_event sh_backend_event;   /* opaque, backend-defined */

/* Every member takes the backend's ctx first. Members marked optional may be NULL; the wrapper
 * then returns SH_EUNSUPPORTED. Unless said otherwise a member returns SH_OK or SH_EINVAL. */
typedef struct sh_backend_iface {
    const char *name; /* "cpu", "cuda" */

    /* Memory. buf_alloc returns `bytes` bytes aligned to at least 64, or SH_ENOMEM; buf_free
     * accepts NULL. `copy` is a stream op moving bytes between any two of: host memory, this
     * backend's buffers (a plain memcpy on the CPU). */
    sh_err (*buf_alloc)(void *ctx, size_t bytes, void **out);
    void (*buf_free)(void *ctx, void *p);
    sh_err (*copy)(void *ctx, sh_backend_stream *s, void *dst, const void *src, size_t bytes);

    /* Streams: created empty; destroy syncs first and accepts NULL. sync returns the first error
     * of an op that failed while running since the previous sync (the stream is usable again). */
    sh_err (*stream_create)(void *ctx, sh_backend_stream **out, sh_error *e);
    void (*stream_destroy)(void *ctx, sh_backend_stream *s);
    sh_err (*stream_sync)(void *ctx, sh_backend_stream *s);

    /* Events: record marks "everything enqueued on s so far"; wait makes later ops of s wait
     * for the marked point (possibly of another stream); sync blocks the host until it is
     * reached. An event never recorded counts as reached. destroy accepts NULL. */
    sh_err (*event_create)(void *ctx, sh_backend_event **out, sh_error *e);
    void (*event_destroy)(void *ctx, sh_backend_event *ev);
    sh_err (*event_record)(void *ctx, sh_backend_event *ev, sh_backend_stream *s);
    sh_err (*event_wait)(void *ctx, sh_backend_stream *s, sh_backend_event *ev);
    sh_err (*event_sync)(void *ctx, sh_backend_event *ev);

    /* Optional: runs fn(arg) on a backend thread when the stream reaches this point (to post a
     * completion message without a blocking sync). fn must be short and must not enqueue on s. */
    sh_err (*host_fn)(void *ctx, sh_backend_stream *s, void (*fn)(void *arg), void *arg);

    /* ---- ops (see the wrappers below for shapes) ---- */
    sh_err (*matmul)(void *ctx, sh_backend_stream *s, const sh_matmul_args *a);
    sh_err (*rmsnorm)(void *ctx, sh_backend_stream *s, const float *x, const float *w, float eps,
                      int64_t n_tok, int64_t n, float *y);
    sh_err (*rope)(void *ctx, sh_backend_stream *s, float *x, const int32_t *pos, int64_t n_tok,
                   int32_t n_heads, int32_t head_dim, int32_t n_rot, float freq_base,
                   const sh_rope_scaling *scaling, sh_rope_mode mode);
    sh_err (*kv_store)(void *ctx, sh_backend_stream *s, const sh_kv_cache *cache,
                       const sh_attn_batch *b, const float *k, const float *v);
    sh_err (*attention)(void *ctx, sh_backend_stream *s, const sh_kv_cache *cache,
                        const sh_attn_batch *b, const float *q, int32_t n_heads, float scale,
                        float *out);
    sh_err (*swiglu)(void *ctx, sh_backend_stream *s, const float *g, const float *u, int64_t n,
                     float *y);
    sh_err (*add)(void *ctx, sh_backend_stream *s, const float *a, const float *b, int64_t n,
                  float *y);
    sh_err (*embed)(void *ctx, sh_backend_stream *s, const sh_tensor *table, const int32_t *ids,
                    int64_t n_tok, float *y);
    sh_err (*softmax)(void *ctx, sh_backend_stream *s, float *x, int64_t n_rows, int64_t n,
                      float scale);
    sh_err (*argmax)(void *ctx, sh_backend_stream *s, const float *x, int64_t n_rows, int64_t n,
                     int32_t *out);
    /* Optional (Gemma): y = scale * x, and y = cap * tanh(x / cap) (logit soft-capping). */
    sh_err (*scale)(void *ctx, sh_backend_stream *s, const float *x, int64_t n, float scale,
                    float *y);
    sh_err (*softcap)(void *ctx, sh_backend_stream *s, const float *x, int64_t n, float cap,
                      float *y);
    /* Optional: sum `x` over the ranks of a communicator (tensor parallelism). NULL on the CPU. */
    sh_err (*all_reduce)(void *ctx, sh_backend_stream *s, float *x, int64_t n);

    /* Optional: prepares weight w for this backend's fastest matmul kernels, once at load. The CPU
     * backend with AVX-512 VNNI repacks Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / F16 / Q4_K / Q6_K
     * matrices into a copy with 16 rows interleaved per block or super-block (kernels/cpu/cpu.h,
     * SH_CPU_PACK_ROWS); it does nothing for other types or ISAs. Later matmuls whose w[i] has the
     * same data pointer, type and shape read the copy, and so does an embed whose table is that
     * weight (a tied output head). w may be a stack of ne[2] matrices (a MoE layer's experts; the
     * CPU backend packs quantized ones expert by expert): a moe_ffn whose gate/up/down has the same
     * data pointer, type and shape reads that copy (as for the 2-D shared expert's weights);
     * anything else keeps reading w->data, which must stay valid and unchanged until weight_release
     * or destroy (its pages may be dropped from a file mapping when weight_copied says so: they
     * refault). Memory: the copy is about the size of the weight (so a prepared model holds its
     * weights twice unless the caller drops its own pages, as model/llama.c does through
     * weight_copied), allocated here and owned by the backend. Preparing the same weight (data,
     * type, shape) again takes a reference to the existing copy; each prepare needs one release.
     * Not a stream op: call it while no enqueued op reads the weight, from any host thread. Returns
     * SH_OK (also when there is nothing to do), SH_EINVAL (bad tensor), SH_ENOMEM (the weight stays
     * usable, unprepared). */
    sh_err (*weight_prepare)(void *ctx, const sh_tensor *w);
    /* Optional: drops one reference to the prepared copy of the weight whose data pointer is
     * `data` and frees it with the last (nothing when there is none). Same rule as prepare: no
     * enqueued op may read it. */
    void (*weight_release)(void *ctx, const void *data);
    /* Optional: true when the backend holds its own copy of weight w (a weight_prepare not yet
     * released) and no op of this backend reads w->data while that copy lives (the CPU backend's
     * matmul and embed both read the packed copy), so a caller whose weights lie in a file
     * mapping may drop those pages (they refault from the file if anything reads them later).
     * False when absent. Any host thread. */
    bool (*weight_copied)(void *ctx, const sh_tensor *w);

    /* Optional: a Mixture-of-Experts FFN (see sh_moe_args), routing included. SH_EINVAL for a bad
     * shape, type or k. */
    sh_err (*moe_ffn)(void *ctx, sh_backend_stream *s, const sh_moe_args *a);

    void (*destroy)(void *ctx);
} sh_backend_iface;

/* A backend handle. Owned by whoever created it; destroy with sh_backend_destroy. */
typedef struct sh_backend {
    const sh_backend_iface *iface;
    void *ctx;
} sh_backend;

/* ---- creation ---------------------------------------------------------------------------- */

typedef struct sh_backend_cpu_opts {
    int32_t n_threads; /* compute threads (the pool); 0 means the number of online CPUs */
    /* Instruction set: 0 = best the CPU supports, else one of the SH_BACKEND_CPU_ISA_* values
     * (tests force the scalar reference; a value above what the CPU supports is SH_EUNSUPPORTED).
     */
    int32_t isa;
    /* Where and how the compute threads (the pool and its queue thread) run, for hosts that
     * share the CPU with the engine (a game loop): each thread applies them to itself when it
     * starts (Linux; elsewhere they are ignored). */
    uint64_t cpu_mask; /* bit i: the threads may run on CPU i (i < 64); 0: as the creator may */
    int32_t sched;     /* SH_BACKEND_CPU_SCHED_*: 0 normal, 1 batch, 2 idle */
    int32_t nice;      /* 0..19 added to the threads' niceness; 0: unchanged */
    int32_t no_spin;   /* nonzero: a thread waiting for work sleeps at once instead of spinning
                        * 10-100 us between ops (costs a wake-up per op, spares the host's CPU) */
} sh_backend_cpu_opts;

enum {
    SH_BACKEND_CPU_SCHED_NORMAL = 0,
    SH_BACKEND_CPU_SCHED_BATCH = 1, /* SCHED_BATCH: treated as CPU-bound, preempts less */
    SH_BACKEND_CPU_SCHED_IDLE = 2,  /* SCHED_IDLE: runs only when nothing else wants the CPU */
};

enum {
    SH_BACKEND_CPU_ISA_AUTO = 0,
    SH_BACKEND_CPU_ISA_SCALAR = 1, /* the plain reference kernels */
    SH_BACKEND_CPU_ISA_AVX2 = 2,   /* AVX2 + FMA + F16C */
    SH_BACKEND_CPU_ISA_AVX512 = 3, /* AVX-512 F/BW/VL + VNNI */
    /* AVX-512 VNNI plus AMX-INT8 tiles for the multi-token products of packed Q4_0, Q4_1, Q5_0,
     * Q5_1 and Q8_0 weights (bitwise equal to VNNI's), where cpuid reports AMX and the OS grants
     * the tile state (Linux arch_prctl). Only when asked for (this value, or SHOAL_ISA=amx with
     * auto): auto never picks it, as it is not yet faster than VNNI. */
    SH_BACKEND_CPU_ISA_AMX = 4,
};

/* Creates the CPU backend: a persistent pool of n_threads threads that runs every stream's ops
 * (the threads spin briefly between ops, then sleep; see no_spin). opts may be NULL (defaults).
 * With isa 0 (auto) the environment variable SHOAL_ISA, when set to scalar, avx2 or avx512, caps
 * the ISA picked (a value above what the CPU has leaves the best; "auto" or empty: no cap), so that
 * one machine can run and measure its lesser paths; SHOAL_ISA=amx opts in to AMX where it is usable
 * (else the best). The caller owns *out. Errors: SH_EINVAL (bad
 * option (a sched, nice or cpu_mask out of range, or a mask with no online CPU), or a SHOAL_ISA
 * value that is none of those), SH_ENOMEM, SH_EUNSUPPORTED (isa). Any
 * thread. */
sh_err sh_backend_cpu_create(const sh_backend_cpu_opts *opts, sh_backend **out, sh_error *e);

/* The instruction set the CPU backend's kernels use (an SH_BACKEND_CPU_ISA_* value), and its
 * name ("avx512-vnni"). For tests, benchmarks and logs. */
int32_t sh_backend_cpu_isa(const sh_backend *be);
const char *sh_backend_cpu_isa_name(int32_t isa);
/* Parses "auto", "scalar", "avx2", "avx512", "avx512-vnni" or "amx" into an SH_BACKEND_CPU_ISA_*
 * value (auto is 0); SH_EINVAL for anything else, *isa untouched. */
sh_err sh_backend_cpu_isa_parse(const char *name, int32_t *isa);
/* One line for logs saying which kernels the backend picked (ISA, whether SHOAL_ISA capped it,
 * the attention kernel, threads), written as snprintf does; -1 when be is not a CPU backend. */
int sh_backend_cpu_describe(const sh_backend *be, char *buf, size_t n);

/* Destroys any backend (its streams and events must be destroyed first); accepts NULL. */
static inline void sh_backend_destroy(sh_backend *be)
{
    if (be)
        be->iface->destroy(be->ctx); /* frees be too: it lives in the backend's allocation */
}

/* ---- wrappers ---------------------------------------------------------------------------- */

static inline sh_err sh_backend_buf_alloc(sh_backend *be, size_t bytes, void **out)
{
    return be->iface->buf_alloc(be->ctx, bytes, out);
}
static inline void sh_backend_buf_free(sh_backend *be, void *p) { be->iface->buf_free(be->ctx, p); }
static inline sh_err sh_backend_copy(sh_backend *be, sh_backend_stream *s, void *dst,
                                     const void *src, size_t bytes)
{
    return be->iface->copy(be->ctx, s, dst, src, bytes);
}
static inline sh_err sh_backend_stream_create(sh_backend *be, sh_backend_stream **out, sh_error *e)
{
    return be->iface->stream_create(be->ctx, out, e);
}
static inline void sh_backend_stream_destroy(sh_backend *be, sh_backend_stream *s)
{
    be->iface->stream_destroy(be->ctx, s);
}
static inline sh_err sh_backend_sync(sh_backend *be, sh_backend_stream *s)
{
    return be->iface->stream_sync(be->ctx, s);
}
static inline sh_err sh_backend_event_create(sh_backend *be, sh_backend_event **out, sh_error *e)
{
    return be->iface->event_create(be->ctx, out, e);
}
static inline void sh_backend_event_destroy(sh_backend *be, sh_backend_event *ev)
{
    be->iface->event_destroy(be->ctx, ev);
}
static inline sh_err sh_backend_event_record(sh_backend *be, sh_backend_event *ev,
                                             sh_backend_stream *s)
{
    return be->iface->event_record(be->ctx, ev, s);
}
static inline sh_err sh_backend_event_wait(sh_backend *be, sh_backend_stream *s,
                                           sh_backend_event *ev)
{
    return be->iface->event_wait(be->ctx, s, ev);
}
static inline sh_err sh_backend_event_sync(sh_backend *be, sh_backend_event *ev)
{
    return be->iface->event_sync(be->ctx, ev);
}
static inline sh_err sh_backend_host_fn(sh_backend *be, sh_backend_stream *s, void (*fn)(void *arg),
                                        void *arg)
{
    if (!be->iface->host_fn)
        return SH_EUNSUPPORTED;
    return be->iface->host_fn(be->ctx, s, fn, arg);
}

/* The general (fused) matmul; see sh_matmul_args. */
static inline sh_err sh_backend_matmul_ex(sh_backend *be, sh_backend_stream *s,
                                          const sh_matmul_args *a)
{
    return be->iface->matmul(be->ctx, s, a);
}

/* y(n_tok, n_out) = x(n_tok, n_in) W(n_out, n_in)^T. */
static inline sh_err sh_backend_matmul(sh_backend *be, sh_backend_stream *s, const sh_tensor *w,
                                       const float *x, int64_t n_tok, float *y)
{
    sh_matmul_args a = {.x = x, .n_tok = n_tok, .n_w = 1, .w = {*w}, .y = {y}};
    return be->iface->matmul(be->ctx, s, &a);
}

/* y(n_tok, n_out) += x(n_tok, n_in) W(n_out, n_in)^T: the output projection plus the residual. */
static inline sh_err sh_backend_matmul_add(sh_backend *be, sh_backend_stream *s, const sh_tensor *w,
                                           const float *x, int64_t n_tok, float *y)
{
    sh_matmul_args a = {.x = x, .n_tok = n_tok, .n_w = 1, .w = {*w}, .y = {y}, .accumulate = true};
    return be->iface->matmul(be->ctx, s, &a);
}

/* Attention input: h = rmsnorm(x) * norm, then q = h Wq^T, k = h Wk^T, v = h Wv^T in one pass.
 * x (n_tok, dim); q (n_tok, n_heads*head_dim); k, v (n_tok, n_kv_heads*head_dim). */
static inline sh_err sh_backend_norm_qkv(sh_backend *be, sh_backend_stream *s, const float *x,
                                         const float *norm, float eps, int64_t n_tok,
                                         const sh_tensor *wq, const sh_tensor *wk,
                                         const sh_tensor *wv, float *q, float *k, float *v)
{
    sh_matmul_args a = {.x = x,
                        .n_tok = n_tok,
                        .norm = norm,
                        .norm_eps = eps,
                        .n_w = 3,
                        .w = {*wq, *wk, *wv},
                        .y = {q, k, v}};
    return be->iface->matmul(be->ctx, s, &a);
}

/* FFN input: h = rmsnorm(x) * norm, then y = silu(h Wg^T) * (h Wu^T) in one pass.
 * x (n_tok, dim); y (n_tok, n_ff). norm may be NULL (no norm). */
static inline sh_err sh_backend_norm_ffn_up(sh_backend *be, sh_backend_stream *s, const float *x,
                                            const float *norm, float eps, int64_t n_tok,
                                            const sh_tensor *w_gate, const sh_tensor *w_up,
                                            float *y)
{
    sh_matmul_args a = {.x = x,
                        .n_tok = n_tok,
                        .norm = norm,
                        .norm_eps = eps,
                        .n_w = 2,
                        .w = {*w_gate, *w_up},
                        .y = {y, NULL},
                        .act = SH_MATMUL_ACT_SWIGLU};
    return be->iface->matmul(be->ctx, s, &a);
}

/* y(n_tok, n) = x / sqrt(mean(x^2) + eps) * w, per row; w (n). y may equal x. */
static inline sh_err sh_backend_rmsnorm(sh_backend *be, sh_backend_stream *s, const float *x,
                                        const float *w, float eps, int64_t n_tok, int64_t n,
                                        float *y)
{
    return be->iface->rmsnorm(be->ctx, s, x, w, eps, n_tok, n, y);
}

/* Rotates x(n_tok, n_heads, head_dim) in place: in each head, the first n_rot dims (even,
 * <= head_dim) turn by the angle of sh_rope_scaling for pair i at position pos[t] (see
 * sh_rope_mode for which elements pair up); dims past n_rot are left alone. pos (n_tok).
 * scaling is copied at enqueue (its freq_factors array is borrowed until sync); SH_EINVAL for
 * freq_scale <= 0, ext_factor != 0 without n_ctx_orig > 0, or a non-finite parameter. */
static inline sh_err sh_backend_rope_ext(sh_backend *be, sh_backend_stream *s, float *x,
                                         const int32_t *pos, int64_t n_tok, int32_t n_heads,
                                         int32_t head_dim, int32_t n_rot, float freq_base,
                                         const sh_rope_scaling *scaling, sh_rope_mode mode)
{
    return be->iface->rope(be->ctx, s, x, pos, n_tok, n_heads, head_dim, n_rot, freq_base, scaling,
                           mode);
}

/* sh_backend_rope_ext with linear scaling only: angle pos[t] * freq_scale * base^(-2i/n_rot). */
static inline sh_err sh_backend_rope(sh_backend *be, sh_backend_stream *s, float *x,
                                     const int32_t *pos, int64_t n_tok, int32_t n_heads,
                                     int32_t head_dim, int32_t n_rot, float freq_base,
                                     float freq_scale, sh_rope_mode mode)
{
    sh_rope_scaling r = sh_rope_scaling_none();
    r.freq_scale = freq_scale;
    return sh_backend_rope_ext(be, s, x, pos, n_tok, n_heads, head_dim, n_rot, freq_base, &r, mode);
}

/* Writes the step's new keys and values k, v (n_tok, n_kv_heads, head_dim) into their cache
 * slots: row j of sequence b's rows goes to position pos0 + j via its block table. */
static inline sh_err sh_backend_kv_store(sh_backend *be, sh_backend_stream *s,
                                         const sh_kv_cache *cache, const sh_attn_batch *b,
                                         const float *k, const float *v)
{
    return be->iface->kv_store(be->ctx, s, cache, b, k, v);
}

/* Causal attention over the paged cache (after kv_store of this step): for each sequence and
 * each of its rows j (position p = pos0 + j), each query head h (kv head h / (n_heads /
 * n_kv_heads)) attends to the cached positions 0..p:
 *   out[row, h] = sum_t softmax_t(scale * q[row, h] . K[t]) V[t].
 * q, out (n_tok, n_heads, head_dim); n_heads a multiple of cache->n_kv_heads; scale usually
 * 1/sqrt(head_dim). The cache is copied by value; the batch is borrowed until sync. */
static inline sh_err sh_backend_attention(sh_backend *be, sh_backend_stream *s,
                                          const sh_kv_cache *cache, const sh_attn_batch *b,
                                          const float *q, int32_t n_heads, float scale, float *out)
{
    return be->iface->attention(be->ctx, s, cache, b, q, n_heads, scale, out);
}

/* y(n) = silu(g) * u elementwise, silu(g) = g / (1 + exp(-g)). y may equal g or u. */
static inline sh_err sh_backend_swiglu(sh_backend *be, sh_backend_stream *s, const float *g,
                                       const float *u, int64_t n, float *y)
{
    return be->iface->swiglu(be->ctx, s, g, u, n, y);
}

/* y(n) = a + b elementwise. y may equal a or b. */
static inline sh_err sh_backend_add(sh_backend *be, sh_backend_stream *s, const float *a,
                                    const float *b, int64_t n, float *y)
{
    return be->iface->add(be->ctx, s, a, b, n, y);
}

/* y(n_tok, dim) = rows ids[t] of table (n_vocab, dim), any weight type, widened to f32.
 * An id outside [0, n_vocab) gives a zero row (the check belongs to the caller). */
static inline sh_err sh_backend_embed(sh_backend *be, sh_backend_stream *s, const sh_tensor *table,
                                      const int32_t *ids, int64_t n_tok, float *y)
{
    return be->iface->embed(be->ctx, s, table, ids, n_tok, y);
}

/* In place, per row of x(n_rows, n): x = softmax(scale * x) (max-subtracted). */
static inline sh_err sh_backend_softmax(sh_backend *be, sh_backend_stream *s, float *x,
                                        int64_t n_rows, int64_t n, float scale)
{
    return be->iface->softmax(be->ctx, s, x, n_rows, n, scale);
}

/* out(n_rows) = index of the largest element of each row of x(n_rows, n); the first on ties
 * (greedy sampling of logits). */
static inline sh_err sh_backend_argmax(sh_backend *be, sh_backend_stream *s, const float *x,
                                       int64_t n_rows, int64_t n, int32_t *out)
{
    return be->iface->argmax(be->ctx, s, x, n_rows, n, out);
}

/* Optional (SH_EUNSUPPORTED where absent): y(n) = scale * x elementwise. y may equal x. */
static inline sh_err sh_backend_scale(sh_backend *be, sh_backend_stream *s, const float *x,
                                      int64_t n, float scale, float *y)
{
    if (!be->iface->scale)
        return SH_EUNSUPPORTED;
    return be->iface->scale(be->ctx, s, x, n, scale, y);
}

/* Optional (SH_EUNSUPPORTED where absent): y(n) = cap * tanh(x / cap) elementwise, cap > 0 (Gemma's
 * logit soft-capping: values stay inside (-cap, cap), nearly unchanged where |x| << cap). y may
 * equal x. */
static inline sh_err sh_backend_softcap(sh_backend *be, sh_backend_stream *s, const float *x,
                                        int64_t n, float cap, float *y)
{
    if (!be->iface->softcap)
        return SH_EUNSUPPORTED;
    return be->iface->softcap(be->ctx, s, x, n, cap, y);
}

/* Optional (SH_EUNSUPPORTED where absent; the weight then works as is, so a loader may ignore
 * that code): prepares a weight for the backend's fast kernels (see sh_backend_iface). */
static inline sh_err sh_backend_weight_prepare(sh_backend *be, const sh_tensor *w)
{
    if (!be->iface->weight_prepare)
        return SH_EUNSUPPORTED;
    return be->iface->weight_prepare(be->ctx, w);
}

/* Frees what sh_backend_weight_prepare made for the weight at `data` (no-op where absent). */
static inline void sh_backend_weight_release(sh_backend *be, const void *data)
{
    if (be->iface->weight_release)
        be->iface->weight_release(be->ctx, data);
}

/* True when the backend has its own copy of w and reads w->data no more (see sh_backend_iface);
 * false where absent. */
static inline bool sh_backend_weight_copied(sh_backend *be, const sh_tensor *w)
{
    return be->iface->weight_copied && be->iface->weight_copied(be->ctx, w);
}

/* Optional (SH_EUNSUPPORTED where absent): x(n) = sum over ranks of x. */
static inline sh_err sh_backend_all_reduce(sh_backend *be, sh_backend_stream *s, float *x,
                                           int64_t n)
{
    if (!be->iface->all_reduce)
        return SH_EUNSUPPORTED;
    return be->iface->all_reduce(be->ctx, s, x, n);
}

/* Optional (SH_EUNSUPPORTED where absent): the MoE FFN of sh_moe_args. */
static inline sh_err sh_backend_moe_ffn(sh_backend *be, sh_backend_stream *s, const sh_moe_args *a)
{
    if (!be->iface->moe_ffn)
        return SH_EUNSUPPORTED;
    return be->iface->moe_ffn(be->ctx, s, a);
}

#endif
