/* The CPU backend's context and op records, shared by its queue (backend_cpu.c) and the op
 * execution (exec.c). */
#ifndef SH_KERNELS_CPU_BACKEND_CPU_H
#define SH_KERNELS_CPU_BACKEND_CPU_H

#include <pthread.h>
#include <stdatomic.h>

#include "kernels/cpu/cpu.h"

typedef enum sh__cpu_op_kind {
    SH__CPU_OP_COPY,
    SH__CPU_OP_HOST_FN,
    SH__CPU_OP_MATMUL,
    SH__CPU_OP_RMSNORM,
    SH__CPU_OP_ROPE,
    SH__CPU_OP_KV_STORE,
    SH__CPU_OP_ATTN,
    SH__CPU_OP_SWIGLU,
    SH__CPU_OP_ADD,
    SH__CPU_OP_EMBED,
    SH__CPU_OP_SOFTMAX,
    SH__CPU_OP_ARGMAX,
    SH__CPU_OP_MOE,
    SH__CPU_OP_SCALE,
    SH__CPU_OP_SOFTCAP,
} sh__cpu_op_kind;

/* Packed-copy pointers an op carries: a matmul's weights, or a MoE op's six. */
#define SH__CPU_OP_PACKED 6
_Static_assert(SH__CPU_OP_PACKED >= SH_MATMUL_MAX_W, "a matmul's weights fit");

/* One queued op: its arguments by value (pointers inside are borrowed until sync). */
typedef struct sh__cpu_op {
    sh__cpu_op_kind kind;
    sh_backend_stream *stream;
    uint64_t ticket;
    /* Matmul: the packed copy of each weight, or NULL (looked up at enqueue); embed: packed[0],
     * the table's packed copy when it is a prepared weight (a tied output head); MoE: those of
     * gate, up, down, gate_sh, up_sh, down_sh. */
    const void *packed[SH__CPU_OP_PACKED];
    union {
        struct {
            void *dst;
            const void *src;
            size_t bytes;
        } copy;
        struct {
            void (*fn)(void *);
            void *arg;
        } host;
        sh_matmul_args mm;
        struct {
            const float *x, *w;
            float *y;
            float eps;
            int64_t n_tok, n;
        } norm;
        struct {
            float *x;
            const int32_t *pos;
            int64_t n_tok;
            int32_t n_heads, head_dim, n_rot;
            float base;
            sh_rope_scaling scale; /* by value: the caller's struct may not live until sync */
            sh_rope_mode mode;
        } rope;
        struct {
            sh_kv_cache cache;
            sh_attn_batch b;
            const float *k, *v;
        } kv;
        struct {
            sh_kv_cache cache;
            sh_attn_batch b;
            const float *q;
            float *out;
            int64_t n_rows;
            int32_t n_heads;
            float scale;
        } attn;
        struct {
            const float *a, *b;
            float *y;
            int64_t n;
        } ew;
        struct {
            const float *x;
            float *y;
            int64_t n;
            float s; /* the scale, or the soft cap */
        } ew1;
        struct {
            sh_tensor t;
            const int32_t *ids;
            int64_t n_tok;
            float *y;
        } embed;
        struct {
            float *x;
            int32_t *out;
            int64_t n_rows, n;
            float scale;
        } rows;
        sh_moe_args moe;
    } u;
} sh__cpu_op;

/* A growable buffer owned by the leader; grown (never shrunk) between ops. */
typedef struct sh__cpu_buf {
    void *p;
    size_t cap;
} sh__cpu_buf;

/* Makes b at least `bytes` long, growing by a quarter more and 64-byte aligned (contents are not
 * kept); false (b unchanged) when out of memory. Grow-only, so a steady workload allocates once. */
bool sh__cpu_buf_grow(sh__cpu_buf *b, size_t bytes);

/* A weight prepared by weight_prepare: the caller's data pointer and shape, and the copy (n_mat
 * matrices of n_out x n_in: MoE experts are a stack, every other weight one matrix). */
typedef struct sh__cpu_packed {
    const void *data; /* NULL: free slot */
    sh_dtype type;
    int64_t n_in, n_out, n_mat;
    void *packed;
    int32_t refs; /* prepares not yet released: contexts sharing a model share one copy */
} sh__cpu_packed;

/* The MoE op's scratch (moe.c), made on its first run. */
typedef struct sh__cpu_moe_scratch sh__cpu_moe_scratch;

typedef struct sh__cpu_ctx {
    sh_backend be; /* handed out to the caller; be.ctx points back here */
    const sh__cpu_kernels *kern;
    sh__cpu_thread_opts topts; /* the threads' placement (sh_backend_cpu_opts) */
    _Atomic int leader_placed; /* the queue thread has applied topts */
    sh__cpu_kernels kern_amx;  /* with SH_BACKEND_CPU_ISA_AMX: AVX-512's table, AMX products */
    int32_t best_isa;          /* what the CPU has (sh__cpu_isa_detect) */
    bool isa_capped;           /* kern is below best_isa because SHOAL_ISA said so */
    sh__cpu_pool *pool;

    /* The op queue: ring[head % CAP .. tail % CAP), guarded by mu. tail_pub mirrors tail for
     * the leader's lock-free spin. Tickets number ops in enqueue order from 1. */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_space;
    sh__cpu_op *ring;
    uint64_t head, tail, next_ticket;
    _Atomic uint64_t tail_pub;
    int leader_sleeping, stop, leader_started;
    pthread_t leader;

    /* Completion: the ticket of the last op run, and host threads blocked waiting on it;
     * wake_at is the lowest ticket a blocked host waits for (UINT64_MAX: none), so the leader
     * wakes them once, when that op is done, not after every op. */
    _Atomic uint64_t completed;
    _Atomic int waiters;
    _Atomic uint64_t wake_at;
    pthread_mutex_t done_mu;
    pthread_cond_t done_cv;

    /* Scratch, touched only by the leader's current op: the prepared activations of a matmul,
     * the attention row maps, and per-thread work areas (tmp_stride floats each). */
    sh__cpu_buf xn, qs, qd, qsum, qk, xt, xb, rowmap, tmp;
    size_t tmp_stride;

    /* Prepared weights: an open-addressing table keyed by data pointer (pack_cap a power of two,
     * at most half full), read at enqueue and written by prepare/release under pack_mu. */
    pthread_mutex_t pack_mu;
    sh__cpu_packed *packs;
    size_t pack_cap, pack_count;

    sh__cpu_moe_scratch *moe; /* touched only by the leader's current op; NULL until a MoE op */
} sh__cpu_ctx;

/* Runs one op on the pool (called by the leader thread). Returns SH_ENOMEM when scratch could
 * not grow (the op did nothing). */
sh_err sh__cpu_exec(sh__cpu_ctx *c, const sh__cpu_op *op);

/* Prepared weights (weights.c): prepare/release as in sh_backend_iface; lookup returns the
 * packed copy of a weight with w's data pointer, type and shape (ne[2] included), or NULL; fini
 * frees them all. A stack of ne[2] matrices (MoE experts) is packed matrix by matrix, matrix m
 * at m * sh__cpu_weights_mat_bytes(type, ne[1], ne[0]) bytes from the copy's start. */
sh_err sh__cpu_weights_prepare(sh__cpu_ctx *c, const sh_tensor *w);
void sh__cpu_weights_release(sh__cpu_ctx *c, const void *data);
const void *sh__cpu_weights_lookup(sh__cpu_ctx *c, const sh_tensor *w);
size_t sh__cpu_weights_mat_bytes(sh_dtype type, int64_t n_out, int64_t n_in);
void sh__cpu_weights_fini(sh__cpu_ctx *c);

/* Frees the scratch buffers. */
void sh__cpu_scratch_fini(sh__cpu_ctx *c);

/* The MoE FFN (moe.c): check validates sh_moe_args at enqueue (SH_OK or SH_EINVAL); exec runs
 * the op (leader; SH_ENOMEM when scratch could not grow); fini frees its scratch. */
sh_err sh__cpu_moe_check(const sh_moe_args *a);
sh_err sh__cpu_moe_exec(sh__cpu_ctx *c, const sh__cpu_op *op);
void sh__cpu_moe_fini(sh__cpu_ctx *c);

#endif
