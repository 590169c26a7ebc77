/* The shared-memory transport of the collectives (SH_COLL_SHM): ranks on one host exchange
 * through one segment, a named POSIX one across processes or this process's memory across
 * threads, synchronised by atomics and futexes with no socket on the per-call path. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "runtime/coll_int.h"

/* Segment layout: a header, one control block per rank, two slots per rank (the data a rank
 * contributes to a call lives in the slot of the call's parity, so that a rank writing call s+1's
 * data never touches what a slower peer may still read of call s), and one result area that the
 * reduce-scatter path fills share by share.
 *
 * Per call s, every rank writes its call descriptor (epoch, sequence, operation, size, root),
 * then copies its data into its slot in chunks of 64 KB, publishing (s, j) in its `pub` word
 * (release) after the j-th. Before reading anything of a peer, a rank waits for every peer's
 * (s, 1) and checks each descriptor against its own. From there:
 * - small all-reduces and two ranks: every rank sums each chunk of all the slots, in rank
 *   order, into its buffer as soon as every rank has published it (one barrier, pipelined);
 * - larger ones with more ranks: once every chunk is published, rank r sums its 1/size share
 *   into the result area, publishes (s, PROG_RESULT), waits for every peer's and copies the
 *   whole result out (two barriers);
 * - all-gather copies each chunk of every slot out in rank order; broadcast copies the root's.
 * Reuse is safe: every call waits for every peer's (s, 1); a rank writes its slot of parity p in
 * call s+2 (or the result area in call s+1) only after every peer published (s+1, 1), which each
 * does only once it has finished call s. Sums are taken in rank order element by element on
 * every path, so every rank gets the same bits. */

#define SEG_MAGIC 0x4745534c4f434853ull /* "SHCOLSEG" in memory order */
#define SEG_VERSION 1u
#define ALIGN 64u
/* Waiting on a peer: spin with a pause instruction this long (a peer on another core usually
 * arrives within it), then yield the CPU this long (a peer that shares our core, as on a small
 * or busy machine, runs in the meantime: on 2 busy vCPUs this took an 8 KB all-reduce from
 * ~30 us, spinning 20 us before sleeping, to ~5 us), then sleep on the futex. */
#define SPIN_NS 1000
#define YIELD_NS 50000
#define SLICE_NS 2000000       /* futex sleeps at most this long between liveness checks */
#define ONE_BARRIER_MAX 32768u /* all-reduces up to this many bytes take the one-barrier path */

enum { STATE_FREE = 0, STATE_JOINED, STATE_CLOSED, STATE_BROKEN };

typedef struct seg_hdr {
    _Atomic uint64_t magic; /* SEG_MAGIC once the creator has initialised the rest */
    uint32_t version;
    uint32_t epoch;
    int32_t size;
    int32_t creator_pid;
    uint64_t max_bytes;
    uint64_t total;
    alignas(ALIGN) _Atomic uint32_t bell; /* the futex word: bumped when a sleeper must wake */
    _Atomic uint32_t waiters;             /* ranks sleeping (or about to) on bell */
} seg_hdr;

typedef struct call_desc {
    uint64_t seq;
    uint64_t bytes;
    uint32_t epoch;
    uint32_t op;
    int32_t root;
} call_desc;

typedef struct rank_ctl {
    alignas(ALIGN) _Atomic uint64_t pub; /* the last step published: step_of(seq, progress) */
    _Atomic uint32_t state;
    int32_t pid;
    uint32_t epoch;
    alignas(ALIGN) call_desc desc[2]; /* by the call's parity */
} rank_ctl;

typedef struct shm_impl {
    unsigned char *base;
    size_t total;
    bool named;  /* a shm_open segment (else the memory of an sh_coll_inproc) */
    bool joined; /* this rank holds its control block */
    char name[256];
    ino_t ino; /* the named segment's inode, so rank 0 unlinks only its own */
    dev_t dev;
    seg_hdr *hdr;
    rank_ctl *ctl;
    unsigned char *slots;
    size_t slot_stride;
    float *result;
} shm_impl;

struct sh_coll_inproc {
    int32_t size;
    size_t max_bytes;
    unsigned char *base;
    size_t total;
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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

/* The bytes a segment takes for (size, max_bytes), 0 when it does not fit a size_t. */
static size_t seg_bytes(int32_t size, size_t max_bytes, size_t *slot_stride)
{
    *slot_stride = 0;
    if (max_bytes > SIZE_MAX / 4 / SH_COLL_MAX_RANKS)
        return 0;
    size_t stride = round_up(max_bytes, ALIGN);
    *slot_stride = stride;
    return round_up(sizeof(seg_hdr), ALIGN) + (size_t)size * sizeof(rank_ctl) +
           2 * (size_t)size * stride + stride;
}

static void layout(shm_impl *s, int32_t size, size_t max_bytes)
{
    size_t stride;
    s->total = seg_bytes(size, max_bytes, &stride);
    s->slot_stride = stride;
    s->hdr = (seg_hdr *)s->base;
    s->ctl = (rank_ctl *)(s->base + round_up(sizeof(seg_hdr), ALIGN));
    s->slots = (unsigned char *)(s->ctl + size);
    s->result = (float *)(s->slots + 2 * (size_t)size * stride);
}

static void *slot(const shm_impl *s, uint64_t seq, int32_t rank, int32_t size)
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
static void ring(shm_impl *s)
{
    if (atomic_load(&s->hdr->waiters) == 0)
        return;
    atomic_fetch_add(&s->hdr->bell, 1);
    futex(&s->hdr->bell, s->named ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

/* Whether process pid is gone (or a zombie nobody has reaped yet). */
static bool pid_dead(int32_t pid)
{
    if (pid <= 0)
        return false;
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return p && (p[2] == 'Z' || p[2] == 'X');
}

static const char *op_name(uint32_t op)
{
    switch (op) {
    case SH__COLL_OP_ALLREDUCE:
        return "all-reduce";
    case SH__COLL_OP_ALLGATHER:
        return "all-gather";
    case SH__COLL_OP_BROADCAST:
        return "broadcast";
    default:
        return "no call";
    }
}

/* Waits until cond(s, k, arg) holds (SH_OK), peer k leaves, breaks or its process dies
 * (SH_ECLOSED), or the deadline passes (SH_ETIMEDOUT): spins, yields, then sleeps on the bell
 * in slices, checking k's state and (named segments) its pid between them. *peer_state gets
 * k's state as last seen. The peer's state is read before cond, so a peer that published and
 * then left is seen to have published. */
typedef bool (*cond_fn)(const shm_impl *s, int32_t k, uint64_t arg);

static sh_err wait_cond(shm_impl *s, cond_fn cond, int32_t k, uint64_t arg, uint64_t deadline,
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
    rank_ctl *p = &s->ctl[k];
    uint64_t last_pid_check = 0;
    for (;;) {
        atomic_fetch_add(&s->hdr->waiters, 1);
        uint32_t v = atomic_load(&s->hdr->bell);
        uint32_t st = atomic_load(&p->state);
        sh_err rc = SH_OK;
        if (cond(s, k, arg))
            rc = SH_OK;
        else if (st == STATE_CLOSED || st == STATE_BROKEN)
            rc = SH_ECLOSED;
        else {
            uint64_t t = now_ns();
            if (t >= deadline)
                rc = SH_ETIMEDOUT;
            else if (s->named && st == STATE_JOINED && t - last_pid_check >= SLICE_NS) {
                last_pid_check = t;
                if (pid_dead(p->pid)) {
                    st = STATE_CLOSED;
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

static bool pub_reached(const shm_impl *s, int32_t k, uint64_t step)
{
    return atomic_load_explicit(&s->ctl[k].pub, memory_order_acquire) >= step;
}

static void publish(shm_impl *s, int32_t rank, uint64_t step)
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
static sh_err wait_peers(sh_coll *c, int32_t only, uint64_t step, const call_desc *d,
                         uint64_t deadline, sh_error *e)
{
    shm_impl *s = c->impl;
    for (int32_t k = only < 0 ? 0 : only; k < (only < 0 ? c->size : only + 1); k++) {
        if (k == c->rank)
            continue;
        uint32_t st = STATE_JOINED;
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
            return sh__error_set(
                e, rc, "coll: rank %d: call #%llu: rank %d %s (it last published %s)", (int)c->rank,
                (unsigned long long)c->seq, (int)k,
                st == STATE_BROKEN                    ? "failed a call and left the group"
                : s->named && pid_dead(s->ctl[k].pid) ? "died (its process is gone)"
                                                      : "left the group",
                at);
        }
        if (!d)
            continue;
        const call_desc *pd = &s->ctl[k].desc[c->seq & 1];
        if (pd->seq != d->seq || pd->epoch != d->epoch || pd->op != d->op ||
            pd->bytes != d->bytes || pd->root != d->root)
            return sh__error_set(e, SH_EPROTO,
                                 "coll: rank %d: rank %d sent %s of %llu bytes (root %d) at call "
                                 "#%llu epoch %u; this rank called %s of %llu bytes (root %d) at "
                                 "call #%llu epoch %u",
                                 (int)c->rank, (int)k, op_name(pd->op),
                                 (unsigned long long)pd->bytes, (int)pd->root,
                                 (unsigned long long)pd->seq, (unsigned)pd->epoch, op_name(d->op),
                                 (unsigned long long)d->bytes, (int)d->root,
                                 (unsigned long long)d->seq, (unsigned)d->epoch);
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
    shm_impl *s = c->impl;
    if (rc) {
        atomic_store(&s->ctl[c->rank].state, STATE_BROKEN);
        ring(s);
    }
    return rc;
}

/* One call's movement of `bytes` bytes per rank, in chunks. */
typedef struct xfer {
    sh_coll *c;
    shm_impl *s;
    uint64_t deadline;
    call_desc d;
    size_t bytes, chunk;
    uint32_t nchunks, copied;
} xfer;

static void xfer_init(xfer *x, sh_coll *c, uint32_t op, size_t bytes, int32_t root)
{
    x->c = c;
    x->s = c->impl;
    x->deadline = deadline_of(c);
    x->d = (call_desc){.seq = c->seq, .bytes = bytes, .epoch = c->epoch, .op = op, .root = root};
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
    shm_impl *s = c->impl;
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
    size_t share = round_up((n + (size_t)c->size - 1) / (size_t)c->size, ALIGN / sizeof(float));
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
    shm_impl *s = c->impl;
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
    shm_impl *s = c->impl;
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
    shm_impl *s = c->impl;
    if (!s)
        return;
    if (s->joined) {
        uint32_t st = STATE_JOINED;
        atomic_compare_exchange_strong(&s->ctl[c->rank].state, &st, STATE_CLOSED);
        ring(s);
    }
    if (s->named) {
        if (c->rank == 0) {
            /* Unlink the name only while it still names our segment (a new incarnation's rank
             * 0 may already have replaced it). */
            int fd = shm_open(s->name, O_RDONLY, 0);
            if (fd >= 0) {
                struct stat stt;
                if (fstat(fd, &stt) == 0 && stt.st_ino == s->ino && stt.st_dev == s->dev)
                    shm_unlink(s->name);
                close(fd);
            }
        }
        munmap(s->base, s->total);
    }
    free(s);
    c->impl = NULL;
}

static const sh__coll_ops shm_ops = {
    .allreduce = shm_allreduce,
    .allgather = shm_allgather,
    .broadcast = shm_broadcast,
    .destroy = shm_destroy,
};

static void hdr_init(seg_hdr *h, int32_t size, uint32_t epoch, size_t max_bytes, size_t total)
{
    h->version = SEG_VERSION;
    h->epoch = epoch;
    h->size = size;
    h->creator_pid = (int32_t)getpid();
    h->max_bytes = max_bytes;
    h->total = total;
    atomic_store(&h->bell, 0);
    atomic_store(&h->waiters, 0);
    atomic_store_explicit(&h->magic, SEG_MAGIC, memory_order_release);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000};
    nanosleep(&ts, NULL);
}

/* Rank 0: replaces whatever the name held with a fresh segment. */
static sh_err seg_create(shm_impl *s, const sh_coll *c, sh_error *e)
{
    size_t stride;
    size_t total = seg_bytes(c->size, c->max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", c->max_bytes);
    int fd = -1;
    for (int tries = 0; fd < 0; tries++) {
        if (shm_unlink(s->name) != 0 && errno != ENOENT)
            return sh__error_set(e, SH_EIO, "coll: shm_unlink %s: %s", s->name, strerror(errno));
        fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && (errno != EEXIST || tries >= 100))
            return sh__error_set(e, SH_EIO, "coll: shm_open %s: %s", s->name, strerror(errno));
    }
    /* Reserve every page now: a write into a tmpfs page that cannot be allocated later would
     * be a SIGBUS in the middle of a call, not an error. */
    int fa = posix_fallocate(fd, 0, (off_t)total);
    if (fa != 0 && fa != EOPNOTSUPP && fa != EINVAL) {
        close(fd);
        shm_unlink(s->name);
        return sh__error_set(e, SH_EIO, "coll: reserving %zu bytes for %s: %s", total, s->name,
                             strerror(fa));
    }
    struct stat st;
    if (ftruncate(fd, (off_t)total) != 0 || fstat(fd, &st) != 0) {
        sh_err rc = sh__error_set(e, SH_EIO, "coll: sizing %s to %zu bytes: %s", s->name, total,
                                  strerror(errno));
        close(fd);
        shm_unlink(s->name);
        return rc;
    }
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(s->name);
        return sh__error_set(e, SH_EIO, "coll: mmap of %s (%zu bytes): %s", s->name, total,
                             strerror(errno));
    }
    s->base = p;
    s->ino = st.st_ino;
    s->dev = st.st_dev;
    layout(s, c->size, c->max_bytes);
    hdr_init(s->hdr, c->size, c->epoch, c->max_bytes, total);
    return SH_OK;
}

/* Ranks > 0: opens the segment rank 0 created, retrying until the deadline while it is missing,
 * still being set up or left over from another run (older epoch or dead creator). */
static sh_err seg_open(shm_impl *s, const sh_coll *c, uint64_t deadline, sh_error *e)
{
    size_t stride;
    size_t total = seg_bytes(c->size, c->max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", c->max_bytes);
    char why[160] = "it does not exist";
    for (;;) {
        int fd = shm_open(s->name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0 && errno != ENOENT)
            return sh__error_set(e, SH_EIO, "coll: shm_open %s: %s", s->name, strerror(errno));
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(seg_hdr)) {
            seg_hdr *h = mmap(NULL, sizeof(seg_hdr), PROT_READ, MAP_SHARED, fd, 0);
            if (h == MAP_FAILED) {
                close(fd);
                return sh__error_set(e, SH_EIO, "coll: mmap of %s: %s", s->name, strerror(errno));
            }
            uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
            seg_hdr hv;
            memcpy(&hv, h, sizeof hv);
            munmap(h, sizeof(seg_hdr));
            sh_err rc = SH_OK;
            if (magic != SEG_MAGIC)
                snprintf(why, sizeof why, "it is not initialised");
            else if (pid_dead(hv.creator_pid))
                snprintf(why, sizeof why, "it is left over from a dead run (creator pid %d)",
                         (int)hv.creator_pid);
            else if (hv.epoch < c->epoch)
                snprintf(why, sizeof why, "it holds epoch %u, older than this rank's %u",
                         (unsigned)hv.epoch, (unsigned)c->epoch);
            else if (hv.epoch > c->epoch)
                rc = sh__error_set(e, SH_EPROTO,
                                   "coll: rank %d: segment %s holds epoch %u, newer than this "
                                   "rank's epoch %u",
                                   (int)c->rank, s->name, (unsigned)hv.epoch, (unsigned)c->epoch);
            else if (hv.version != SEG_VERSION)
                rc = sh__error_set(e, SH_EPROTO, "coll: segment %s has version %u, not %u", s->name,
                                   (unsigned)hv.version, SEG_VERSION);
            else if (hv.size != c->size)
                rc = sh__error_set(e, SH_EINVAL,
                                   "coll: rank %d: segment %s is for a group of %d ranks, this "
                                   "rank's group has %d",
                                   (int)c->rank, s->name, (int)hv.size, (int)c->size);
            else if (hv.max_bytes != c->max_bytes)
                rc = sh__error_set(e, SH_EINVAL,
                                   "coll: rank %d: segment %s has max_bytes %llu, this rank's "
                                   "is %zu",
                                   (int)c->rank, s->name, (unsigned long long)hv.max_bytes,
                                   c->max_bytes);
            else if ((size_t)st.st_size < total || hv.total != total)
                rc = sh__error_set(e, SH_EPROTO, "coll: segment %s is %lld bytes, expected %zu",
                                   s->name, (long long)st.st_size, total);
            else {
                void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                close(fd);
                if (p == MAP_FAILED)
                    return sh__error_set(e, SH_EIO, "coll: mmap of %s (%zu bytes): %s", s->name,
                                         total, strerror(errno));
                s->base = p;
                s->ino = st.st_ino;
                s->dev = st.st_dev;
                layout(s, c->size, c->max_bytes);
                /* A segment whose rank 0 has left, or where this rank's block is taken, belongs
                 * to a finished incarnation of the same epoch: rank 0 replaces it. */
                uint32_t st0 = atomic_load(&s->ctl[0].state);
                uint32_t mine = atomic_load(&s->ctl[c->rank].state);
                if (st0 != STATE_CLOSED && st0 != STATE_BROKEN && mine == STATE_FREE)
                    return SH_OK;
                if (mine != STATE_FREE)
                    snprintf(why, sizeof why, "rank %d has already joined it", (int)c->rank);
                else
                    snprintf(why, sizeof why,
                             "it is left over from a finished group (its rank 0 "
                             "left)");
                munmap(p, total);
                s->base = NULL;
                fd = -1;
            }
            if (rc) {
                close(fd);
                return rc;
            }
        } else if (fd >= 0) {
            snprintf(why, sizeof why, "it is not sized yet");
        }
        if (fd >= 0)
            close(fd);
        if (now_ns() >= deadline)
            return sh__error_set(e, SH_ETIMEDOUT,
                                 "coll: rank %d: segment %s not ready within %d ms: %s",
                                 (int)c->rank, s->name, (int)c->timeout_ms, why);
        sleep_ms(1);
    }
}

static bool joined(const shm_impl *s, int32_t k, uint64_t arg)
{
    (void)arg;
    return atomic_load_explicit(&s->ctl[k].state, memory_order_acquire) != STATE_FREE;
}

/* Takes this rank's control block and waits until every rank has taken its own. */
static sh_err join(sh_coll *c, uint64_t deadline, sh_error *e)
{
    shm_impl *s = c->impl;
    rank_ctl *me = &s->ctl[c->rank];
    if (atomic_load(&me->state) != STATE_FREE)
        return sh__error_set(e, SH_EINVAL, "coll: rank %d has already joined this group%s%s",
                             (int)c->rank, s->named ? " in segment " : "", s->named ? s->name : "");
    atomic_store(&me->pub, 0);
    memset(me->desc, 0, sizeof me->desc);
    me->pid = (int32_t)getpid();
    me->epoch = c->epoch;
    uint32_t st = STATE_FREE;
    if (!atomic_compare_exchange_strong(&me->state, &st, STATE_JOINED))
        return sh__error_set(e, SH_EINVAL, "coll: rank %d has already joined this group",
                             (int)c->rank);
    s->joined = true;
    ring(s);
    for (int32_t k = 0; k < c->size; k++) {
        if (k == c->rank)
            continue;
        sh_err rc = wait_cond(s, joined, k, 0, deadline, NULL);
        if (rc == SH_ETIMEDOUT)
            return sh__error_set(e, rc, "coll: rank %d: rank %d did not join within %d ms",
                                 (int)c->rank, (int)k, (int)c->timeout_ms);
        if (rc)
            return sh__error_set(e, rc, "coll: rank %d: rank %d left before the group formed",
                                 (int)c->rank, (int)k);
        if (s->ctl[k].epoch != c->epoch)
            return sh__error_set(e, SH_EPROTO,
                                 "coll: rank %d: rank %d joined with epoch %u, this "
                                 "rank's is %u",
                                 (int)c->rank, (int)k, (unsigned)s->ctl[k].epoch,
                                 (unsigned)c->epoch);
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
    shm_impl *s = calloc(1, sizeof *s);
    if (!s)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    uint64_t deadline = deadline_of(c);
    sh_err rc = SH_OK;
    if (o->shm_name) {
        s->named = true;
        snprintf(s->name, sizeof s->name, "%s", o->shm_name);
        rc = c->rank == 0 ? seg_create(s, c, e) : seg_open(s, c, deadline, e);
    } else {
        s->base = o->inproc->base;
        layout(s, c->size, c->max_bytes);
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

sh_err sh_coll_inproc_create(int32_t size, size_t max_bytes, sh_coll_inproc **out, sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "coll: out is NULL");
    *out = NULL;
    if (size < 1 || size > SH_COLL_MAX_RANKS)
        return sh__error_set(e, SH_EINVAL, "coll: group size %d outside 1..%d", (int)size,
                             SH_COLL_MAX_RANKS);
    if (max_bytes == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes is 0");
    size_t stride;
    size_t total = seg_bytes(size, max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", max_bytes);
    sh_coll_inproc *g = calloc(1, sizeof *g);
    if (!g)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        free(g);
        return sh__error_set(e, SH_ENOMEM, "coll: mapping %zu bytes for the group: %s", total,
                             strerror(errno));
    }
    g->size = size;
    g->max_bytes = max_bytes;
    g->base = p;
    g->total = total;
    hdr_init((seg_hdr *)p, size, 0, max_bytes, total);
    *out = g;
    return SH_OK;
}

void sh_coll_inproc_destroy(sh_coll_inproc *g)
{
    if (!g)
        return;
    munmap(g->base, g->total);
    free(g);
}
