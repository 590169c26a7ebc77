/* The CPU backend: the interface, the op queue run by a leader thread, streams and events. */
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "kernels/cpu/backend_cpu.h"

/* Ops waiting in the queue; an enqueue into a full queue waits for room. A decode step of a
 * 30-layer model is about 250 ops, so a whole step fits. */
#define RING_CAP 2048
/* Waits for the next op (leader) or for completion (host) poll at most this many times, and for
 * at most SPIN_NS, before sleeping on a condition variable: the first PAUSE_ITERS with a pause,
 * the rest with sched_yield, which returns at once on an idle core but hands the core over when
 * the machine is oversubscribed (a spinning host would otherwise keep the leader it waits for off
 * the core for a time slice). The time bound matters for a host waiting on a whole decode step
 * (milliseconds): without it the host made ~2000 sched_yield calls per step, 5-20% of a -t 1
 * run's profile and a second core kept busy; a wake-up from the condition variable costs tens of
 * microseconds once per step instead. */
#define SPIN_ITERS 2000
#define PAUSE_ITERS 32
#define SPIN_NS 200000

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One step of a wait that began at *t0 (0: not read yet); false when the wait should sleep. */
static bool backoff(int i, uint64_t *t0)
{
    if (i < PAUSE_ITERS) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        return true;
    }
    if (i == PAUSE_ITERS)
        *t0 = now_ns();
    else if ((i & 7) == 0 && now_ns() - *t0 > SPIN_NS)
        return false;
    sched_yield();
    return true;
}

struct sh_backend_stream {
    uint64_t last;   /* ticket of the last op enqueued on this stream (0: none) */
    _Atomic int err; /* first run-time failure since the last sync */
};

struct sh_backend_event {
    _Atomic uint64_t ticket; /* reached when completed >= ticket */
};

static void *leader_main(void *arg);

static int32_t isa_from_opts(const sh_backend_cpu_opts *o)
{
    return o && o->isa ? o->isa : SH_BACKEND_CPU_ISA_AUTO;
}

/* ---- queue ------------------------------------------------------------------------------- */

/* Appends op (kind and payload set by the caller) for stream s; blocks while the ring is full. */
static sh_err push(sh__cpu_ctx *c, sh_backend_stream *s, sh__cpu_op *op)
{
    pthread_mutex_lock(&c->mu);
    while (c->tail - c->head >= RING_CAP)
        pthread_cond_wait(&c->cv_space, &c->mu);
    op->stream = s;
    op->ticket = ++c->next_ticket;
    c->ring[c->tail % RING_CAP] = *op;
    atomic_store_explicit(&c->tail_pub, c->tail + 1, memory_order_release);
    c->tail++;
    if (c->leader_sleeping)
        pthread_cond_signal(&c->cv_work);
    pthread_mutex_unlock(&c->mu);
    if (s)
        s->last = op->ticket;
    return SH_OK;
}

static void *leader_main(void *arg)
{
    sh__cpu_ctx *c = arg;
    (void)sh__cpu_thread_apply(&c->topts); /* validated by sh_backend_cpu_create */
    // The pool's thread 0 (cpu.h), named for ps and /proc/PID/task/TID/comm.
    pthread_setname_np(pthread_self(), "shoal-cpu-0");
    atomic_store_explicit(&c->leader_placed, 1, memory_order_release);
    for (;;) {
        /* Spin briefly for the next op so a step's ops run back to back without a wake-up. */
        uint64_t t0 = 0;
        for (int i = 0; i < (c->topts.no_spin ? 0 : SPIN_ITERS); i++) {
            if (atomic_load_explicit(&c->tail_pub, memory_order_acquire) != c->head)
                break;
            if (!backoff(i, &t0))
                break;
        }
        pthread_mutex_lock(&c->mu);
        while (c->head == c->tail && !c->stop) {
            c->leader_sleeping = 1;
            pthread_cond_wait(&c->cv_work, &c->mu);
            c->leader_sleeping = 0;
        }
        if (c->head == c->tail && c->stop) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        sh__cpu_op op = c->ring[c->head % RING_CAP];
        c->head++;
        pthread_cond_signal(&c->cv_space);
        pthread_mutex_unlock(&c->mu);

        sh_err err = sh__cpu_exec(c, &op);
        if (err && op.stream) {
            int expected = SH_OK;
            atomic_compare_exchange_strong(&op.stream->err, &expected, (int)err);
        }
        /* Ops finish in ticket order, so `completed` is a high-water mark. */
        atomic_store_explicit(&c->completed, op.ticket, memory_order_seq_cst);
        if (atomic_load_explicit(&c->waiters, memory_order_seq_cst) > 0 &&
            op.ticket >= atomic_load_explicit(&c->wake_at, memory_order_seq_cst)) {
            /* every blocked host wakes and re-arms wake_at if its ticket is still ahead */
            pthread_mutex_lock(&c->done_mu);
            atomic_store_explicit(&c->wake_at, UINT64_MAX, memory_order_seq_cst);
            pthread_cond_broadcast(&c->done_cv);
            pthread_mutex_unlock(&c->done_mu);
        }
    }
    return NULL;
}

/* Blocks until the op with `ticket` has run (spinning first: a decode step is short). */
static void wait_ticket(sh__cpu_ctx *c, uint64_t ticket)
{
    uint64_t t0 = 0;
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&c->completed, memory_order_acquire) >= ticket)
            return;
        if (!backoff(i, &t0))
            break;
    }
    pthread_mutex_lock(&c->done_mu);
    atomic_fetch_add_explicit(&c->waiters, 1, memory_order_seq_cst);
    /* Arm wake_at before reading completed (both seq_cst, as the leader's store of completed
     * and its loads of waiters and wake_at): either this host sees the op done or the leader
     * sees it waiting and wakes it, under done_mu, after it has gone to sleep. */
    for (;;) {
        if (ticket < atomic_load_explicit(&c->wake_at, memory_order_seq_cst))
            atomic_store_explicit(&c->wake_at, ticket, memory_order_seq_cst);
        if (atomic_load_explicit(&c->completed, memory_order_seq_cst) >= ticket)
            break;
        pthread_cond_wait(&c->done_cv, &c->done_mu);
    }
    atomic_fetch_sub_explicit(&c->waiters, 1, memory_order_seq_cst);
    pthread_mutex_unlock(&c->done_mu);
}

/* ---- memory, streams, events --------------------------------------------------------------- */

static sh_err cpu_buf_alloc(void *ctx, size_t bytes, void **out)
{
    size_t n = (bytes + 63) & ~(size_t)63;
    *out = aligned_alloc(64, n ? n : 64);
    return *out ? SH_OK : SH_ENOMEM;
}

static void cpu_buf_free(void *ctx, void *p) { free(p); }

static sh_err cpu_copy(void *ctx, sh_backend_stream *s, void *dst, const void *src, size_t bytes)
{
    if ((!dst || !src) && bytes)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_COPY, .u.copy = {dst, src, bytes}};
    return push(ctx, s, &op);
}

static sh_err cpu_stream_create(void *ctx, sh_backend_stream **out, sh_error *e)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return sh__error_set(e, SH_ENOMEM, "cpu backend: out of memory for a stream");
    return SH_OK;
}

static sh_err cpu_stream_sync(void *ctx, sh_backend_stream *s)
{
    wait_ticket(ctx, s->last);
    return (sh_err)atomic_exchange(&s->err, SH_OK);
}

static void cpu_stream_destroy(void *ctx, sh_backend_stream *s)
{
    if (!s)
        return;
    cpu_stream_sync(ctx, s);
    free(s);
}

static sh_err cpu_event_create(void *ctx, sh_backend_event **out, sh_error *e)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return sh__error_set(e, SH_ENOMEM, "cpu backend: out of memory for an event");
    return SH_OK;
}

static void cpu_event_destroy(void *ctx, sh_backend_event *ev) { free(ev); }

static sh_err cpu_event_record(void *ctx, sh_backend_event *ev, sh_backend_stream *s)
{
    atomic_store(&ev->ticket, s->last);
    return SH_OK;
}

/* All streams share one queue executed in ticket order, so anything enqueued after a record was
 * already ordered after it: waiting on an event needs no op. */
static sh_err cpu_event_wait(void *ctx, sh_backend_stream *s, sh_backend_event *ev)
{
    return SH_OK;
}

static sh_err cpu_event_sync(void *ctx, sh_backend_event *ev)
{
    wait_ticket(ctx, atomic_load(&ev->ticket));
    return SH_OK;
}

static sh_err cpu_host_fn(void *ctx, sh_backend_stream *s, void (*fn)(void *), void *arg)
{
    if (!fn)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_HOST_FN, .u.host = {fn, arg}};
    return push(ctx, s, &op);
}

/* ---- op validation and enqueue ------------------------------------------------------------- */

/* Block-quantized weights need whole blocks (32 elements, 256 for the K-quants: the activations
 * are quantized per block); float weights (F32, F16, BF16) may have rows of any length. */
static bool weight_ok(const sh_tensor *w, int64_t n_in)
{
    const sh_dtype_info *info = sh__dtype_info(w->type);
    return w->data && w->ne[0] == n_in && w->ne[1] >= 1 && w->ne[2] == 1 && w->ne[3] == 1 &&
           sh__cpu_mm_for(&sh__cpu_kernels_ref, w->type) && info && n_in % info->block_elems == 0;
}

static sh_err cpu_matmul(void *ctx, sh_backend_stream *s, const sh_matmul_args *a)
{
    if (!a || !a->x || a->n_tok < 1 || a->n_w < 1 || a->n_w > SH_MATMUL_MAX_W)
        return SH_EINVAL;
    const int64_t n_in = a->w[0].ne[0];
    for (int i = 0; i < a->n_w; i++)
        if (!weight_ok(&a->w[i], n_in) || (!a->y[i] && a->act == SH_MATMUL_ACT_NONE))
            return SH_EINVAL;
    const bool glu = a->act == SH_MATMUL_ACT_SWIGLU || a->act == SH_MATMUL_ACT_GEGLU;
    if (glu && (a->n_w != 2 || a->accumulate || !a->y[0] || a->w[0].ne[1] != a->w[1].ne[1]))
        return SH_EINVAL;
    if (a->act != SH_MATMUL_ACT_NONE && !glu)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_MATMUL, .u.mm = *a};
    for (int i = 0; i < a->n_w; i++)
        op.packed[i] = sh__cpu_weights_lookup(ctx, &a->w[i]);
    return push(ctx, s, &op);
}

static sh_err cpu_rmsnorm(void *ctx, sh_backend_stream *s, const float *x, const float *w,
                          float eps, int64_t n_tok, int64_t n, float *y)
{
    if (!x || !w || !y || n_tok < 1 || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_RMSNORM, .u.norm = {x, w, y, eps, n_tok, n}};
    return push(ctx, s, &op);
}

static sh_err cpu_rope(void *ctx, sh_backend_stream *s, float *x, const int32_t *pos, int64_t n_tok,
                       int32_t n_heads, int32_t head_dim, int32_t n_rot, float freq_base,
                       const sh_rope_scaling *sc, sh_rope_mode mode)
{
    if (!x || !pos || !sc || n_tok < 1 || n_heads < 1 || n_rot < 2 || n_rot % 2 ||
        n_rot > head_dim || n_rot > 1024 || !(freq_base > 0.0f) || !isfinite(freq_base) ||
        (mode != SH_ROPE_MODE_NORMAL && mode != SH_ROPE_MODE_NEOX))
        return SH_EINVAL;
    if (!(sc->freq_scale > 0.0f) || !isfinite(sc->freq_scale) || !isfinite(sc->attn_factor) ||
        !isfinite(sc->ext_factor) ||
        (sc->ext_factor != 0.0f &&
         (sc->n_ctx_orig < 1 || !isfinite(sc->beta_fast) || !isfinite(sc->beta_slow) ||
          !(sc->beta_fast > 0.0f) || !(sc->beta_slow > 0.0f))))
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_ROPE,
                     .u.rope = {x, pos, n_tok, n_heads, head_dim, n_rot, freq_base, *sc, mode}};
    return push(ctx, s, &op);
}

static bool cache_ok(const sh_kv_cache *c)
{
    return c && c->k && c->v && c->n_blocks > 0 && c->n_kv_heads > 0 && c->head_dim > 0 &&
           (c->type == SH_DTYPE_F32 || c->type == SH_DTYPE_F16);
}

/* Checks the batch against the cache: block tables in range. Returns the row count or -1. */
static int64_t batch_rows(const sh_kv_cache *c, const sh_attn_batch *b)
{
    if (!b || b->n_seqs < 1 || !b->seqs)
        return -1;
    int64_t rows = 0;
    for (int32_t i = 0; i < b->n_seqs; i++) {
        const sh_attn_seq *q = &b->seqs[i];
        if (q->n_rows < 1 || q->pos0 < 0 || !q->blocks)
            return -1;
        int64_t nblk = ((int64_t)q->pos0 + q->n_rows + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
        /* blocks wholly before the first row's sliding window are never read: -1 is allowed */
        int64_t first = c->window > 0 && q->pos0 + 1 > c->window
                            ? (q->pos0 + 1 - c->window) / SH_KV_BLOCK_TOKENS
                            : 0;
        for (int64_t j = 0; j < nblk; j++)
            if (!(j < first && q->blocks[j] == -1) &&
                (q->blocks[j] < 0 || q->blocks[j] >= c->n_blocks))
                return -1;
        rows += q->n_rows;
    }
    return rows;
}

static sh_err cpu_kv_store(void *ctx, sh_backend_stream *s, const sh_kv_cache *cache,
                           const sh_attn_batch *b, const float *k, const float *v)
{
    if (!cache_ok(cache) || !k || !v || batch_rows(cache, b) < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_KV_STORE, .u.kv = {*cache, *b, k, v}};
    return push(ctx, s, &op);
}

static sh_err cpu_attention(void *ctx, sh_backend_stream *s, const sh_kv_cache *cache,
                            const sh_attn_batch *b, const float *q, int32_t n_heads, float scale,
                            float *out)
{
    int64_t rows = cache_ok(cache) ? batch_rows(cache, b) : -1;
    if (rows < 1 || !q || !out || n_heads < 1 || n_heads % cache->n_kv_heads)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_ATTN, .u.attn = {*cache, *b, q, out, rows, n_heads, scale}};
    return push(ctx, s, &op);
}

static sh_err cpu_swiglu(void *ctx, sh_backend_stream *s, const float *g, const float *u, int64_t n,
                         float *y)
{
    if (!g || !u || !y || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_SWIGLU, .u.ew = {g, u, y, n}};
    return push(ctx, s, &op);
}

static sh_err cpu_add(void *ctx, sh_backend_stream *s, const float *a, const float *b, int64_t n,
                      float *y)
{
    if (!a || !b || !y || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_ADD, .u.ew = {a, b, y, n}};
    return push(ctx, s, &op);
}

static sh_err cpu_embed(void *ctx, sh_backend_stream *s, const sh_tensor *t, const int32_t *ids,
                        int64_t n_tok, float *y)
{
    if (!t || !t->data || !ids || !y || n_tok < 1 || t->ne[1] < 1 ||
        !sh__cpu_mm_for(&sh__cpu_kernels_ref, t->type) ||
        sh__dtype_row_bytes(t->type, (uint64_t)t->ne[0]) == 0)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_EMBED, .u.embed = {*t, ids, n_tok, y}};
    /* A table that is also a prepared matmul weight (a tied output head) is read from its packed
     * copy: its file pages may have been dropped (weight_copied). */
    op.packed[0] = sh__cpu_weights_lookup(ctx, t);
    return push(ctx, s, &op);
}

static sh_err cpu_softmax(void *ctx, sh_backend_stream *s, float *x, int64_t n_rows, int64_t n,
                          float scale)
{
    if (!x || n_rows < 1 || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_SOFTMAX, .u.rows = {x, NULL, n_rows, n, scale}};
    return push(ctx, s, &op);
}

static sh_err cpu_argmax(void *ctx, sh_backend_stream *s, const float *x, int64_t n_rows, int64_t n,
                         int32_t *out)
{
    if (!x || !out || n_rows < 1 || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_ARGMAX, .u.rows = {(float *)x, out, n_rows, n, 1.0f}};
    return push(ctx, s, &op);
}

static sh_err cpu_scale(void *ctx, sh_backend_stream *s, const float *x, int64_t n, float scale,
                        float *y)
{
    if (!x || !y || n < 1)
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_SCALE, .u.ew1 = {x, y, n, scale}};
    return push(ctx, s, &op);
}

static sh_err cpu_softcap(void *ctx, sh_backend_stream *s, const float *x, int64_t n, float cap,
                          float *y)
{
    if (!x || !y || n < 1 || !(cap > 0.0f) || !isfinite(cap))
        return SH_EINVAL;
    sh__cpu_op op = {.kind = SH__CPU_OP_SOFTCAP, .u.ew1 = {x, y, n, cap}};
    return push(ctx, s, &op);
}

static sh_err cpu_moe_ffn(void *ctx, sh_backend_stream *s, const sh_moe_args *a)
{
    sh_err err = sh__cpu_moe_check(a);
    if (err)
        return err;
    sh__cpu_op op = {.kind = SH__CPU_OP_MOE, .u.moe = *a};
    const sh_tensor *ws[] = {&a->gate, &a->up, &a->down, &a->gate_sh, &a->up_sh, &a->down_sh};
    for (int i = 0; i < SH__CPU_OP_PACKED; i++)
        op.packed[i] = ws[i]->data ? sh__cpu_weights_lookup(ctx, ws[i]) : NULL;
    return push(ctx, s, &op);
}

/* ---- creation ------------------------------------------------------------------------------ */

static sh_err cpu_weight_prepare(void *ctx, const sh_tensor *w)
{
    return sh__cpu_weights_prepare(ctx, w);
}

static void cpu_weight_release(void *ctx, const void *data) { sh__cpu_weights_release(ctx, data); }

static bool cpu_weight_copied(void *ctx, const sh_tensor *w)
{
    return sh__cpu_weights_lookup(ctx, w) != NULL;
}

static void cpu_destroy(void *ctx)
{
    sh__cpu_ctx *c = ctx;
    if (c->leader_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_signal(&c->cv_work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->leader, NULL);
    }
    sh__cpu_pool_destroy(c->pool);
    sh__cpu_scratch_fini(c);
    sh__cpu_weights_fini(c);
    sh__cpu_moe_fini(c);
    pthread_mutex_destroy(&c->pack_mu);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv_work);
    pthread_cond_destroy(&c->cv_space);
    pthread_mutex_destroy(&c->done_mu);
    pthread_cond_destroy(&c->done_cv);
    free(c->ring);
    free(c);
}

static const sh_backend_iface cpu_iface = {
    .name = "cpu",
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .copy = cpu_copy,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .stream_sync = cpu_stream_sync,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .event_wait = cpu_event_wait,
    .event_sync = cpu_event_sync,
    .host_fn = cpu_host_fn,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .embed = cpu_embed,
    .softmax = cpu_softmax,
    .argmax = cpu_argmax,
    .scale = cpu_scale,
    .softcap = cpu_softcap,
    .all_reduce = NULL,
    .weight_prepare = cpu_weight_prepare,
    .weight_release = cpu_weight_release,
    .weight_copied = cpu_weight_copied,
    .moe_ffn = cpu_moe_ffn,
    .destroy = cpu_destroy,
};

/* Tries the placement on a short-lived thread, so that what the OS refuses (an affinity to
 * CPUs this process may not use) is an error of sh_backend_cpu_create. */
static void *probe_main(void *arg)
{
    const sh__cpu_thread_opts *t = arg;
    return (void *)(intptr_t)sh__cpu_thread_apply(t);
}

static sh_err probe_thread_opts(const sh__cpu_thread_opts *t)
{
    pthread_t th;
    void *rv = NULL;
    if (pthread_create(&th, NULL, probe_main, (void *)t) != 0)
        return SH_ENOMEM;
    pthread_join(th, &rv);
    return rv ? SH_EINVAL : SH_OK;
}

sh_err sh_backend_cpu_create(const sh_backend_cpu_opts *opts, sh_backend **out, sh_error *e)
{
    *out = NULL;
    int32_t n = opts && opts->n_threads ? opts->n_threads : (int32_t)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1 || n > 1024)
        return sh__error_set(e, SH_EINVAL, "cpu backend: bad n_threads %d", n);
    sh__cpu_thread_opts topts = {0};
    if (opts) {
        topts = (sh__cpu_thread_opts){opts->cpu_mask, opts->sched, opts->nice, opts->no_spin};
        if (opts->sched < SH_BACKEND_CPU_SCHED_NORMAL || opts->sched > SH_BACKEND_CPU_SCHED_IDLE)
            return sh__error_set(e, SH_EINVAL,
                                 "cpu backend: bad sched %d (0 normal, 1 batch, "
                                 "2 idle)",
                                 (int)opts->sched);
        if (opts->nice < 0 || opts->nice > 19)
            return sh__error_set(e, SH_EINVAL, "cpu backend: nice %d: must be 0 to 19",
                                 (int)opts->nice);
        const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
        if (opts->cpu_mask && n_cpu > 0 && n_cpu < 64 &&
            !(opts->cpu_mask & (((uint64_t)1 << n_cpu) - 1)))
            return sh__error_set(e, SH_EINVAL,
                                 "cpu backend: cpu_mask 0x%llx names none of the %ld online CPUs",
                                 (unsigned long long)opts->cpu_mask, n_cpu);
        /* Settings the OS refuses fail here (tried on a short-lived thread, so the caller's
         * own thread keeps its settings), not silently in the pool's threads later. */
        if (topts.cpu_mask || topts.sched || topts.nice) {
            sh_err rc = probe_thread_opts(&topts);
            if (rc)
                return sh__error_set(e, rc,
                                     "cpu backend: the OS refused the thread placement "
                                     "(cpu_mask 0x%llx, sched %d, nice %d)",
                                     (unsigned long long)topts.cpu_mask, (int)topts.sched,
                                     (int)topts.nice);
        }
    }
    int32_t best = sh__cpu_isa_detect(), isa = isa_from_opts(opts);
    if (isa < SH_BACKEND_CPU_ISA_AUTO || isa > SH_BACKEND_CPU_ISA_AMX)
        return sh__error_set(e, SH_EINVAL, "cpu backend: bad isa %d", isa);
    if (isa == SH_BACKEND_CPU_ISA_AMX ? !sh__cpu_amx_usable() : isa > best)
        return sh__error_set(e, SH_EUNSUPPORTED, "cpu backend: this CPU lacks %s",
                             sh_backend_cpu_isa_name(isa));
    bool capped = false;
    if (isa == SH_BACKEND_CPU_ISA_AUTO) {
        /* SHOAL_ISA caps what AUTO picks, so that any machine can measure and test its lesser
         * paths (an AVX-512 machine running the AVX2 kernels) without a rebuild. */
        const char *env = getenv("SHOAL_ISA");
        int32_t cap = SH_BACKEND_CPU_ISA_AUTO;
        if (env && *env && sh_backend_cpu_isa_parse(env, &cap) != SH_OK)
            return sh__error_set(e, SH_EINVAL,
                                 "cpu backend: SHOAL_ISA=%s: expected scalar, avx2, avx512, amx "
                                 "or auto",
                                 env);
        isa = best;
        if (cap == SH_BACKEND_CPU_ISA_AMX) {
            /* not a cap but an opt-in: AMX is never picked by itself (its prefill computes in
             * BF16, so its results are not the VNNI kernels'; docs/serving.md) */
            if (sh__cpu_amx_usable())
                isa = cap;
        } else if (cap != SH_BACKEND_CPU_ISA_AUTO && cap < best) {
            isa = cap;
            capped = true;
        }
    }

    sh__cpu_ctx *c = calloc(1, sizeof *c);
    if (!c || !(c->ring = calloc(RING_CAP, sizeof *c->ring))) {
        free(c);
        return sh__error_set(e, SH_ENOMEM, "cpu backend: out of memory");
    }
    c->be.iface = &cpu_iface;
    c->be.ctx = c;
    c->kern = isa >= SH_BACKEND_CPU_ISA_AVX512 ? &sh__cpu_kernels_avx512
              : isa == SH_BACKEND_CPU_ISA_AVX2 ? &sh__cpu_kernels_avx2
                                               : &sh__cpu_kernels_ref;
    if (isa == SH_BACKEND_CPU_ISA_AMX) {
        /* AVX-512's table (its isa field stays AVX512: the kernels are AVX-512's but for the
         * multi-token products of the packed 32-block types) */
        c->kern_amx = sh__cpu_kernels_avx512;
        c->kern_amx.mmp_q4_0 = sh__cpu_amx_mmp_q4_0;
        c->kern_amx.mmp_q4_1 = sh__cpu_amx_mmp_q4_1;
        c->kern_amx.mmp_q8_0 = sh__cpu_amx_mmp_q8_0;
        c->kern_amx.mmp_q5_0 = sh__cpu_amx_mmp_q5_0;
        c->kern_amx.mmp_q5_1 = sh__cpu_amx_mmp_q5_1;
        c->kern_amx.act_bf16 = sh__cpu_amx_act_bf16; /* prefill in BF16 (cpu.h) */
        c->kern = &c->kern_amx;
    }
    c->best_isa = best;
    c->isa_capped = capped;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv_work, NULL);
    pthread_cond_init(&c->cv_space, NULL);
    pthread_mutex_init(&c->done_mu, NULL);
    pthread_mutex_init(&c->pack_mu, NULL);
    pthread_cond_init(&c->done_cv, NULL);
    atomic_store(&c->wake_at, UINT64_MAX);
    c->topts = topts;
    sh_err err = sh__cpu_pool_create(n, &topts, &c->pool, e);
    if (!err && pthread_create(&c->leader, NULL, leader_main, c) != 0)
        err = sh__error_set(e, SH_ENOMEM, "cpu backend: cannot start the queue thread");
    else if (!err) {
        c->leader_started = 1;
        while (!atomic_load_explicit(&c->leader_placed, memory_order_acquire))
            sched_yield(); /* the queue thread runs under its placement before create returns */
    }
    if (err) {
        cpu_destroy(c);
        return err;
    }
    *out = &c->be;
    return SH_OK;
}

int32_t sh_backend_cpu_isa(const sh_backend *be)
{
    if (!be || be->iface != &cpu_iface)
        return 0;
    const sh__cpu_ctx *c = be->ctx;
    return c->kern == &c->kern_amx ? SH_BACKEND_CPU_ISA_AMX : c->kern->isa;
}

const char *sh_backend_cpu_isa_name(int32_t isa)
{
    switch (isa) {
    case SH_BACKEND_CPU_ISA_SCALAR:
        return "scalar";
    case SH_BACKEND_CPU_ISA_AVX2:
        return "avx2";
    case SH_BACKEND_CPU_ISA_AVX512:
        return "avx512-vnni";
    case SH_BACKEND_CPU_ISA_AMX:
        return "amx";
    default:
        return "auto";
    }
}

sh_err sh_backend_cpu_isa_parse(const char *name, int32_t *isa)
{
    static const struct {
        const char *name;
        int32_t isa;
    } names[] = {{"auto", SH_BACKEND_CPU_ISA_AUTO},          {"scalar", SH_BACKEND_CPU_ISA_SCALAR},
                 {"avx2", SH_BACKEND_CPU_ISA_AVX2},          {"avx512", SH_BACKEND_CPU_ISA_AVX512},
                 {"avx512-vnni", SH_BACKEND_CPU_ISA_AVX512}, {"amx", SH_BACKEND_CPU_ISA_AMX}};
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *isa = names[i].isa;
            return SH_OK;
        }
    return SH_EINVAL;
}

int sh_backend_cpu_describe(const sh_backend *be, char *buf, size_t n)
{
    if (!be || be->iface != &cpu_iface || !buf || !n)
        return -1;
    const sh__cpu_ctx *c = be->ctx;
    const int32_t isa = sh_backend_cpu_isa(be);
    return snprintf(buf, n, "%s kernels%s%s%s, tiled online-softmax attention, %d thread%s",
                    sh_backend_cpu_isa_name(isa),
                    isa == SH_BACKEND_CPU_ISA_AMX ? " (AVX-512 VNNI + AMX-BF16 tiles for prefill)"
                    : isa == SH_BACKEND_CPU_ISA_AVX512 ? " (AVX-512 F/BW/VL + VNNI, F16C)"
                    : isa == SH_BACKEND_CPU_ISA_AVX2   ? " (AVX2 + FMA + F16C)"
                                                       : "",
                    c->isa_capped ? " capped by SHOAL_ISA; the CPU has " : "",
                    c->isa_capped ? sh_backend_cpu_isa_name(c->best_isa) : "",
                    sh__cpu_pool_size(c->pool), sh__cpu_pool_size(c->pool) == 1 ? "" : "s");
}

/* F16C (CPUID leaf 1, ECX bit 29), asked of cpuid directly: clang's __builtin_cpu_supports does
 * not know the "f16c" feature name. */
static bool cpu_has_f16c(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return false;
    return (c >> 29) & 1u;
#else
    return false;
#endif
}

/* AMX-TILE, AMX-INT8 and AMX-BF16 (CPUID leaf 7, EDX bits 24, 25 and 22) with AVX512-BF16
 * (leaf 7 subleaf 1, EAX bit 5), and Linux's permission to use the
 * tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18), which a process
 * must ask for once before its first tile instruction (without it that instruction faults). */
static bool amx_ask(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> 25) & 1u) ||
        !((d >> 22) & 1u))
        return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1u))
        return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
#else
    return false;
#endif
}

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static bool amx_granted;
static void amx_init(void) { amx_granted = amx_ask(); }

bool sh__cpu_amx_usable(void)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX512)
        return false;
    pthread_once(&amx_once, amx_init);
    return amx_granted;
}

int32_t sh__cpu_isa_detect(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    bool f16c = cpu_has_f16c();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("fma") && f16c) {
        return SH_BACKEND_CPU_ISA_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)
        return SH_BACKEND_CPU_ISA_AVX2;
#endif
    return SH_BACKEND_CPU_ISA_SCALAR;
}
