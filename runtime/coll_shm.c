/* The shared-memory transport of the collectives (SH_COLL_SHM): ranks on one host exchange
 * through one segment (coll_shm_seg.c), a named POSIX one across processes or this process's
 * memory across threads, synchronised by atomics and futexes with no socket on the per-call
 * path. The protocol is described in coll_shm_int.h. */
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "runtime/coll_shm_int.h"

/* Waiting on a peer: spin with a pause instruction this long (a peer on another core usually
 * arrives within it), then yield the CPU this long (a peer that shares our core, as on a small
 * or busy machine, runs in the meantime: on 2 busy vCPUs this took an 8 KB all-reduce from
 * ~30 us, spinning 20 us before sleeping, to ~5 us), then sleep on the futex. */
#define SPIN_NS 1000
#define YIELD_NS 50000
#define SLICE_NS 2000000       /* futex sleeps at most this long between liveness checks */
#define ONE_BARRIER_MAX 32768u /* all-reduces up to this many bytes take the one-barrier path */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *slot(const sh__coll_shm *s, uint64_t seq, int32_t rank, int32_t size)
{
    return s->slots + ((size_t)(seq & 1) * (size_t)size + (size_t)rank) * s->slot_stride;
}

static long futex(_Atomic uint32_t *w, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)w, op, val, ts, NULL, 0);
}

/* Wakes the ranks sleeping on the bell. The caller's store (seq_cst) precedes the load of
 * `waiters`; a sleeper increments `waiters` before it reads the bell and rechecks its
 * condition, so either it sees the store or this sees it and bumps the bell under it. */
static void ring(sh__coll_shm *s)
{
    if (atomic_load(&s->hdr->waiters) == 0)
        return;
    atomic_fetch_add(&s->hdr->bell, 1);
    futex(&s->hdr->bell, s->named ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

/* Waits until cond(s, k, arg) holds (SH_OK), peer k leaves, breaks or its process dies
 * (SH_ECLOSED), or the deadline passes (SH_ETIMEDOUT): spins, yields, then sleeps on the bell
 * in slices, checking k's state and (named segments) its pid between them. *peer_state gets
 * k's state as last seen. The peer's state is read before cond, so a peer that published and
 * then left is seen to have published. */
typedef bool (*cond_fn)(const sh__coll_shm *s, int32_t k, uint64_t arg);

static sh_err wait_cond(sh__coll_shm *s, cond_fn cond, int32_t k, uint64_t arg, uint64_t deadline,
                        uint32_t *peer_state)
{
    if (cond(s, k, arg))
        return SH_OK;
    uint64_t t0 = now_ns();
    for (;;) {
        for (int i = 0; i < 8; i++) {
            cpu_relax();
            if (cond(s, k, arg))
                return SH_OK;
        }
        if (now_ns() - t0 > SPIN_NS)
            break;
    }
    while (now_ns() - t0 < SPIN_NS + YIELD_NS) {
        sched_yield();
        if (cond(s, k, arg))
            return SH_OK;
    }
    sh__coll_shm_ctl *p = &s->ctl[k];
    uint64_t last_pid_check = 0;
    for (;;) {
        atomic_fetch_add(&s->hdr->waiters, 1);
        uint32_t v = atomic_load(&s->hdr->bell);
        uint32_t st = atomic_load(&p->state);
        sh_err rc = SH_OK;
        if (cond(s, k, arg))
            rc = SH_OK;
        else if (st == SH__COLL_SHM_CLOSED || st == SH__COLL_SHM_BROKEN)
            rc = SH_ECLOSED;
        else {
            uint64_t t = now_ns();
            if (t >= deadline)
                rc = SH_ETIMEDOUT;
            else if (s->named && st == SH__COLL_SHM_JOINED && t - last_pid_check >= SLICE_NS) {
                last_pid_check = t;
                if (sh__coll_shm_seg_pid_dead(p->pid)) {
                    st = SH__COLL_SHM_CLOSED;
                    rc = SH_ECLOSED;
                }
            }
            if (rc == SH_OK) {
                uint64_t left = deadline - t < SLICE_NS ? deadline - t : SLICE_NS;
                struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)left};
                futex(&s->hdr->bell, s->named ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, v, &ts);
                atomic_fetch_sub(&s->hdr->waiters, 1);
                continue;
            }
        }
        atomic_fetch_sub(&s->hdr->waiters, 1);
        if (peer_state)
            *peer_state = st;
        return rc;
    }
}

/* A rank's published word: (call sequence << 24) | progress, where progress 1..k says that the
 * first `progress` chunks of its data for the call are in its slot, and PROG_RESULT that its
 * chunk of the reduce-scatter result is written. Both only grow. */
#define PROG_BITS 24
#define PROG_RESULT ((1u << PROG_BITS) - 1)
/* Data moves in chunks of this many bytes, each published as soon as it is copied, so a peer
 * reads it while it is still in cache and the copy of the next one overlaps the peer's sum
 * (64 KB did best of 32 KB .. 1 MB for 256 KB .. 64 MB messages on a 2-vCPU VM). */
#define CHUNK_BYTES ((size_t)64 << 10)

static uint64_t step_of(uint64_t seq, uint32_t progress) { return seq << PROG_BITS | progress; }

static bool pub_reached(const sh__coll_shm *s, int32_t k, uint64_t step)
{
    return atomic_load_explicit(&s->ctl[k].pub, memory_order_acquire) >= step;
}

static void publish(sh__coll_shm *s, int32_t rank, uint64_t step)
{
    atomic_store(&s->ctl[rank].pub, step); /* seq_cst: ordered before ring's load */
    ring(s);
}

/* Names a step for error texts. */
static void step_name(uint64_t v, char *out, size_t cap)
{
    uint32_t p = (uint32_t)(v & PROG_RESULT);
    if (v == 0)
        snprintf(out, cap, "nothing");
    else if (p == PROG_RESULT)
        snprintf(out, cap, "its result chunk of call #%llu", (unsigned long long)(v >> PROG_BITS));
    else
        snprintf(out, cap, "data chunk %u of call #%llu", (unsigned)p,
                 (unsigned long long)(v >> PROG_BITS));
}

/* Waits for peer k's step (every peer's with k < 0); with d, checks each peer's descriptor of
 * call c->seq against this rank's. */
static sh_err wait_peers(sh_coll *c, int32_t only, uint64_t step, const sh__coll_shm_desc *d,
                         uint64_t deadline, sh_error *e)
{
    sh__coll_shm *s = c->impl;
    for (int32_t k = only < 0 ? 0 : only; k < (only < 0 ? c->size : only + 1); k++) {
        if (k == c->rank)
            continue;
        uint32_t st = SH__COLL_SHM_JOINED;
        sh_err rc = wait_cond(s, pub_reached, k, step, deadline, &st);
        if (rc) {
            char want[80], at[80];
            step_name(step, want, sizeof want);
            step_name(atomic_load(&s->ctl[k].pub), at, sizeof at);
            if (rc == SH_ETIMEDOUT)
                return sh__error_set(e, rc,
                                     "coll: rank %d: call #%llu: rank %d did not publish %s "
                                     "within %d ms (it last published %s)",
                                     (int)c->rank, (unsigned long long)c->seq, (int)k, want,
                                     (int)c->timeout_ms, at);
            return sh__error_set(e, rc,
                                 "coll: rank %d: call #%llu: rank %d %s (it last published %s)",
                                 (int)c->rank, (unsigned long long)c->seq, (int)k,
                                 st == SH__COLL_SHM_BROKEN ? "failed a call and left the group"
                                 : s->named && sh__coll_shm_seg_pid_dead(s->ctl[k].pid)
                                     ? "died (its process is gone)"
                                     : "left the group",
                                 at);
        }
        if (!d)
            continue;
        const sh__coll_shm_desc *pd = &s->ctl[k].desc[c->seq & 1];
        if (pd->seq != d->seq || pd->epoch != d->epoch || pd->op != d->op ||
            pd->bytes != d->bytes || pd->root != d->root)
            return sh__error_set(e, SH_EPROTO,
                                 "coll: rank %d: rank %d sent %s of %llu bytes (root %d) at call "
                                 "#%llu epoch %u; this rank called %s of %llu bytes (root %d) at "
                                 "call #%llu epoch %u",
                                 (int)c->rank, (int)k, sh__coll_op_name(pd->op),
                                 (unsigned long long)pd->bytes, (int)pd->root,
                                 (unsigned long long)pd->seq, (unsigned)pd->epoch,
                                 sh__coll_op_name(d->op), (unsigned long long)d->bytes,
                                 (int)d->root, (unsigned long long)d->seq, (unsigned)d->epoch);
    }
    return SH_OK;
}

static uint64_t deadline_of(const sh_coll *c)
{
    return now_ns() + (uint64_t)c->timeout_ms * 1000000u;
}

/* A failed call marks this rank broken in the segment, so peers waiting on it fail at once. */
static sh_err fail(sh_coll *c, sh_err rc)
{
    sh__coll_shm *s = c->impl;
    if (rc) {
        atomic_store(&s->ctl[c->rank].state, SH__COLL_SHM_BROKEN);
        ring(s);
    }
    return rc;
}

/* One call's movement of `bytes` bytes per rank, in chunks. */
typedef struct xfer {
    sh_coll *c;
    sh__coll_shm *s;
    uint64_t deadline;
    sh__coll_shm_desc d;
    size_t bytes, chunk;
    uint32_t nchunks, copied;
} xfer;

static void xfer_init(xfer *x, sh_coll *c, uint32_t op, size_t bytes, int32_t root)
{
    x->c = c;
    x->s = c->impl;
    x->deadline = deadline_of(c);
    x->d = (sh__coll_shm_desc){
        .seq = c->seq, .bytes = bytes, .epoch = c->epoch, .op = op, .root = root};
    x->s->ctl[c->rank].desc[c->seq & 1] = x->d;
    x->bytes = bytes;
    x->chunk = CHUNK_BYTES;
    while (bytes / x->chunk >= PROG_RESULT - 1) /* a slot beyond 1 TB */
        x->chunk *= 2;
    x->nchunks = (uint32_t)((bytes + x->chunk - 1) / x->chunk);
    x->copied = 0;
}

static size_t chunk_len(const xfer *x, uint32_t j)
{
    size_t off = (size_t)j * x->chunk;
    return x->bytes - off < x->chunk ? x->bytes - off : x->chunk;
}

/* Copies this rank's next chunk of src into its slot and publishes it; the first one also
 * publishes the descriptor written by xfer_init. */
static void xfer_put(xfer *x, const void *src)
{
    uint32_t j = x->copied++;
    size_t off = (size_t)j * x->chunk;
    memcpy((unsigned char *)slot(x->s, x->c->seq, x->c->rank, x->c->size) + off,
           (const unsigned char *)src + off, chunk_len(x, j));
    publish(x->s, x->c->rank, step_of(x->c->seq, x->copied));
}

/* Publishes every chunk at once (a rank with no data: broadcast's receivers). */
static void xfer_put_none(xfer *x)
{
    x->copied = x->nchunks;
    publish(x->s, x->c->rank, step_of(x->c->seq, x->copied));
}

/* Waits until chunk j of peer `only` (every peer with -1) is published; the first wait of a
 * call checks the descriptors of every peer. */
static sh_err xfer_wait(xfer *x, int32_t only, uint32_t j, sh_error *e)
{
    sh_err rc = SH_OK;
    if (j == 0)
        rc = wait_peers(x->c, -1, step_of(x->c->seq, 1), &x->d, x->deadline, e);
    if (!rc)
        rc = wait_peers(x->c, only, step_of(x->c->seq, j + 1), NULL, x->deadline, e);
    return rc;
}

/* dst[i] = src[0][i] + src[1][i] + ... + src[n-1][i] for i in [lo, hi), summed left to right,
 * in blocks that stay in L1 so the partial sums are not written back between sources. */
static void sum_rows(float *restrict dst, const float *const *src, int32_t n, size_t lo, size_t hi)
{
    enum { BLK = 2048 };
    for (size_t b = lo; b < hi; b += BLK) {
        size_t end = hi - b < BLK ? hi : b + BLK;
        const float *restrict a = src[0];
        const float *restrict x = src[1];
        for (size_t i = b; i < end; i++)
            dst[i] = a[i] + x[i];
        for (int32_t k = 2; k < n; k++) {
            const float *restrict y = src[k];
            for (size_t i = b; i < end; i++)
                dst[i] += y[i];
        }
    }
}

static sh_err shm_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e)
{
    sh__coll_shm *s = c->impl;
    size_t bytes = n * sizeof(float);
    const float *src[SH_COLL_MAX_RANKS];
    for (int32_t k = 0; k < c->size; k++)
        src[k] = slot(s, c->seq, k, c->size);
    xfer x;
    xfer_init(&x, c, SH__COLL_OP_ALLREDUCE, bytes, -1);
    xfer_put(&x, buf);
    sh_err rc = SH_OK;
    if (c->size == 2 || bytes <= ONE_BARRIER_MAX) {
        /* Every rank sums everything, chunk by chunk, one chunk behind its own copy. */
        for (uint32_t j = 0; j < x.nchunks && !rc; j++) {
            if (x.copied < x.nchunks)
                xfer_put(&x, buf);
            rc = xfer_wait(&x, -1, j, e);
            if (!rc) {
                size_t lo = (size_t)j * (x.chunk / sizeof(float));
                sum_rows(buf, src, c->size, lo, lo + chunk_len(&x, j) / sizeof(float));
            }
        }
        return fail(c, rc);
    }
    while (x.copied < x.nchunks)
        xfer_put(&x, buf);
    rc = xfer_wait(&x, -1, 0, e);
    if (!rc)
        rc = xfer_wait(&x, -1, x.nchunks - 1, e);
    if (rc)
        return fail(c, rc);
    /* Reduce-scatter: rank r sums its share, in chunks of whole cache lines (no two ranks write
     * one line), into the result area; then every rank copies the whole result out. */
    size_t share = sh__coll_shm_round_up((n + (size_t)c->size - 1) / (size_t)c->size,
                                         SH__COLL_SHM_ALIGN / sizeof(float));
    size_t lo = (size_t)c->rank * share;
    size_t hi = lo + share < n ? lo + share : n;
    if (lo < hi)
        sum_rows(s->result, src, c->size, lo, hi);
    publish(s, c->rank, step_of(c->seq, PROG_RESULT));
    rc = wait_peers(c, -1, step_of(c->seq, PROG_RESULT), NULL, x.deadline, e);
    if (rc)
        return fail(c, rc);
    memcpy(buf, s->result, bytes);
    return SH_OK;
}

static sh_err shm_allgather(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e)
{
    sh__coll_shm *s = c->impl;
    xfer x;
    xfer_init(&x, c, SH__COLL_OP_ALLGATHER, bytes, -1);
    xfer_put(&x, in);
    sh_err rc = SH_OK;
    for (uint32_t j = 0; j < x.nchunks && !rc; j++) {
        if (x.copied < x.nchunks)
            xfer_put(&x, in);
        rc = xfer_wait(&x, -1, j, e);
        size_t off = (size_t)j * x.chunk;
        for (int32_t k = 0; k < c->size && !rc; k++)
            memcpy((unsigned char *)out + (size_t)k * bytes + off,
                   (const unsigned char *)slot(s, c->seq, k, c->size) + off, chunk_len(&x, j));
    }
    return fail(c, rc);
}

static sh_err shm_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e)
{
    sh__coll_shm *s = c->impl;
    xfer x;
    xfer_init(&x, c, SH__COLL_OP_BROADCAST, bytes, root);
    if (c->rank == root) {
        while (x.copied < x.nchunks)
            xfer_put(&x, buf);
        /* the root waits only to check every peer's descriptor */
        return fail(c, xfer_wait(&x, -1, 0, e));
    }
    xfer_put_none(&x);
    sh_err rc = SH_OK;
    for (uint32_t j = 0; j < x.nchunks && !rc; j++) {
        rc = xfer_wait(&x, root, j, e);
        size_t off = (size_t)j * x.chunk;
        if (!rc)
            memcpy((unsigned char *)buf + off,
                   (const unsigned char *)slot(s, c->seq, root, c->size) + off, chunk_len(&x, j));
    }
    return fail(c, rc);
}

static void shm_destroy(sh_coll *c)
{
    sh__coll_shm *s = c->impl;
    if (!s)
        return;
    if (s->joined) {
        uint32_t st = SH__COLL_SHM_JOINED;
        atomic_compare_exchange_strong(&s->ctl[c->rank].state, &st, SH__COLL_SHM_CLOSED);
        ring(s);
    }
    if (s->named)
        sh__coll_shm_seg_close(s, c->rank == 0);
    free(s);
    c->impl = NULL;
}

static const sh__coll_ops shm_ops = {
    .allreduce = shm_allreduce,
    .allgather = shm_allgather,
    .broadcast = shm_broadcast,
    .destroy = shm_destroy,
};

static bool joined(const sh__coll_shm *s, int32_t k, uint64_t arg)
{
    (void)arg;
    return atomic_load_explicit(&s->ctl[k].state, memory_order_acquire) != SH__COLL_SHM_FREE;
}

/* Takes this rank's control block and waits until every rank has taken its own. */
static sh_err join(sh_coll *c, uint64_t deadline, sh_error *e)
{
    sh__coll_shm *s = c->impl;
    sh__coll_shm_ctl *me = &s->ctl[c->rank];
    if (atomic_load(&me->state) != SH__COLL_SHM_FREE)
        return sh__error_set(e, SH_EINVAL, "coll: rank %d has already joined this group%s%s",
                             (int)c->rank, s->named ? " in segment " : "", s->named ? s->name : "");
    atomic_store(&me->pub, 0);
    memset(me->desc, 0, sizeof me->desc);
    me->pid = (int32_t)getpid();
    me->epoch = c->epoch;
    uint32_t st = SH__COLL_SHM_FREE;
    if (!atomic_compare_exchange_strong(&me->state, &st, SH__COLL_SHM_JOINED))
        return sh__error_set(e, SH_EINVAL, "coll: rank %d has already joined this group",
                             (int)c->rank);
    s->joined = true;
    ring(s);
    for (int32_t k = 0; k < c->size; k++) {
        if (k == c->rank)
            continue;
        sh_err rc = wait_cond(s, joined, k, 0, deadline, NULL); /* OK or SH_ETIMEDOUT */
        if (rc)
            return sh__error_set(e, rc, "coll: rank %d: rank %d did not join within %d ms",
                                 (int)c->rank, (int)k, (int)c->timeout_ms);
        /* The epoch first: a peer of another epoch also leaves at once, having seen ours. */
        if (s->ctl[k].epoch != c->epoch)
            return sh__error_set(e, SH_EPROTO,
                                 "coll: rank %d: rank %d joined with epoch %u, this "
                                 "rank's is %u",
                                 (int)c->rank, (int)k, (unsigned)s->ctl[k].epoch,
                                 (unsigned)c->epoch);
        uint32_t st_k = atomic_load(&s->ctl[k].state);
        if (st_k == SH__COLL_SHM_CLOSED || st_k == SH__COLL_SHM_BROKEN)
            return sh__error_set(e, SH_ECLOSED,
                                 "coll: rank %d: rank %d left before the group formed",
                                 (int)c->rank, (int)k);
    }
    return SH_OK;
}

sh_err sh__coll_shm_create(sh_coll *c, const sh_coll_opts *o, sh_error *e)
{
    if (!o->shm_name && !o->inproc)
        return sh__error_set(e, SH_EINVAL,
                             "coll: shm transport needs shm_name (a named segment) or inproc");
    if (o->shm_name && o->inproc)
        return sh__error_set(e, SH_EINVAL,
                             "coll: shm transport takes shm_name or inproc, not both");
    if (o->inproc && (o->inproc->size != c->size || o->inproc->max_bytes != c->max_bytes))
        return sh__error_set(e, SH_EINVAL,
                             "coll: rank %d: the in-process group has %d ranks and max_bytes %zu, "
                             "this rank's options say %d and %zu",
                             (int)c->rank, (int)o->inproc->size, o->inproc->max_bytes, (int)c->size,
                             c->max_bytes);
    if (o->shm_name) {
        size_t len = strlen(o->shm_name);
        if (o->shm_name[0] != '/' || len < 2 || len >= 255 || strchr(o->shm_name + 1, '/'))
            return sh__error_set(e, SH_EINVAL,
                                 "coll: shm_name \"%s\" must be one '/' and up to 254 characters "
                                 "without '/'",
                                 o->shm_name);
    }
    sh__coll_shm *s = calloc(1, sizeof *s);
    if (!s)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    uint64_t deadline = deadline_of(c);
    sh_err rc = SH_OK;
    if (o->shm_name) {
        s->named = true;
        snprintf(s->name, sizeof s->name, "%s", o->shm_name);
        rc = c->rank == 0 ? sh__coll_shm_seg_create(s, c, e)
                          : sh__coll_shm_seg_open(s, c, deadline, e);
    } else {
        s->base = o->inproc->base;
        sh__coll_shm_seg_layout(s, c->size, c->max_bytes);
    }
    if (rc) {
        free(s);
        return rc;
    }
    c->impl = s;
    c->ops = &shm_ops;
    rc = join(c, deadline, e);
    if (rc) {
        shm_destroy(c);
        c->ops = NULL;
        return rc;
    }
    return SH_OK;
}
