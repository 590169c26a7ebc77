/* The CPU backend's persistent worker pool: one job at a time, helpers join while the leader
 * works (spin, then futex), work shared in chunks from a counter. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/error.h"
#include "kernels/cpu/cpu.h"

/* Pause-loop iterations before a waiting thread sleeps (a pause is ~10-140 cycles, 140 on recent
 * Intel cores, so 10-100 microseconds). Ops of a decode step follow each other within microseconds,
 * so the helpers stay awake across a step, while an idle or oversubscribed pool soon stops burning
 * a core. */
#define SPIN_ITERS 2000
#define PAUSE_ITERS 32

typedef struct worker {
    sh__cpu_pool *pool;
    int tid;
    pthread_t thread;
} worker;

/* The entry word of the current job: bits 32-63 its sequence number (the low 32 bits of gen
 * when it was published), bit 31 CLOSED (the leader has finished its own call: no more
 * helpers may join), bits 0-30 the helpers inside the job. */
#define ENTRY_CLOSED ((uint64_t)1 << 31)
#define ENTRY_COUNT(e) ((e) & (ENTRY_CLOSED - 1))

/* Fields written by different threads sit on their own cache lines, so a helper spinning on
 * gen or counting units does not keep stealing the line that another thread writes. */
struct sh__cpu_pool {
    int n;
    worker *workers; /* [1, n) are helper threads; [0] is unused (the leader is the caller) */
    sh__cpu_job_fn fn;
    void *arg;
    _Atomic int stop;
    sh__cpu_thread_opts topts; /* applied by each helper as it starts; no_spin: wait by futex */
    _Atomic int placed;        /* helpers that have applied topts (create waits for all) */
    /* Job hand-off. `gen` counts published jobs; the futex word is its low 32 bits. */
    _Alignas(64) _Atomic uint32_t gen;
    _Atomic int sleepers; /* helpers inside futex_wait on gen (the leader wakes only if > 0) */
    _Alignas(64) _Atomic uint64_t entry;
    /* Work sharing of the current job: chunks handed out and units finished, per phase. */
    _Alignas(64) _Atomic int64_t next[2];
    _Alignas(64) _Atomic int64_t done[2];
};

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Waits until *addr != old; spins first, then sleeps. Returns the new value. */
static uint32_t wait_change(sh__cpu_pool *p, _Atomic uint32_t *addr, uint32_t old)
{
    for (int i = 0; i < (p->topts.no_spin ? 0 : SPIN_ITERS); i++) {
        uint32_t v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != old)
            return v;
        /* pause first; then yield, so that an oversubscribed machine runs the leader */
        if (i < PAUSE_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
    for (;;) {
        atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
        uint32_t v = atomic_load_explicit(addr, memory_order_seq_cst);
        if (v == old)
            futex_wait(addr, old);
        atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_seq_cst);
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != old)
            return v;
    }
}

/* Joins job `seq` if it is still open: one CAS on the entry word. */
static bool join(sh__cpu_pool *p, uint32_t seq)
{
    uint64_t e = atomic_load_explicit(&p->entry, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(e >> 32) != seq || (e & ENTRY_CLOSED))
            return false;
        if (atomic_compare_exchange_weak_explicit(&p->entry, &e, e + 1, memory_order_acquire,
                                                  memory_order_acquire))
            return true;
    }
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    sh__cpu_pool *p = w->pool;
    uint32_t seen = 0;
    char name[16]; /* named for ps and /proc/PID/task/TID/comm (docs/cluster.md) */
    snprintf(name, sizeof name, "shoal-cpu-%d", w->tid);
    pthread_setname_np(pthread_self(), name);
    (void)sh__cpu_thread_apply(&p->topts); /* checked by the backend on its own thread first */
    atomic_fetch_add_explicit(&p->placed, 1, memory_order_release);
    for (;;) {
        seen = wait_change(p, &p->gen, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire))
            break;
        if (!join(p, seen))
            continue; /* finished without us (or a newer job is up: gen has moved on) */
        /* fn and arg stay as published while any helper is inside: the leader waits for the
         * count to drop to zero before it returns and publishes the next job. */
        p->fn(p->arg, w->tid, p->n);
        atomic_fetch_sub_explicit(&p->entry, 1, memory_order_release);
    }
    return NULL;
}

int sh__cpu_thread_apply(const sh__cpu_thread_opts *t)
{
    if (!t)
        return 0;
#ifdef __linux__
    const pid_t tid = (pid_t)syscall(SYS_gettid);
    if (t->cpu_mask) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c = 0; c < 64; c++)
            if (t->cpu_mask >> c & 1)
                CPU_SET(c, &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0)
            return errno;
    }
    if (t->sched) {
        struct sched_param sp = {0};
        if (sched_setscheduler(0, t->sched == 1 ? SCHED_BATCH : SCHED_IDLE, &sp) != 0)
            return errno;
    }
    if (t->nice) {
        /* Linux keeps a niceness per thread: PRIO_PROCESS with a thread id sets that thread's */
        errno = 0;
        const int cur = getpriority(PRIO_PROCESS, (id_t)tid);
        if (errno)
            return errno;
        const int want = cur + t->nice > 19 ? 19 : cur + t->nice;
        if (setpriority(PRIO_PROCESS, (id_t)tid, want) != 0)
            return errno;
    }
#endif
    return 0;
}

sh_err sh__cpu_pool_create(int n, const sh__cpu_thread_opts *t, sh__cpu_pool **out, sh_error *e)
{
    *out = NULL;
    if (n < 1 || n > 1024)
        return sh__error_set(e, SH_EINVAL, "cpu pool: bad thread count %d", n);
    sh__cpu_pool *p = aligned_alloc(64, sizeof *p);
    if (p)
        memset(p, 0, sizeof *p);
    if (!p || !(p->workers = calloc((size_t)n, sizeof *p->workers))) {
        free(p);
        return sh__error_set(e, SH_ENOMEM, "cpu pool: out of memory");
    }
    p->n = n;
    if (t)
        p->topts = *t;
    for (int i = 1; i < n; i++) {
        p->workers[i].pool = p;
        p->workers[i].tid = i;
        int rc = pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]);
        if (rc != 0) {
            p->n = i; /* destroy joins the ones started */
            sh__cpu_pool_destroy(p);
            return sh__error_set(e, SH_ENOMEM, "cpu pool: pthread_create failed (%d)", rc);
        }
    }
    /* Each helper runs under its placement before the pool is handed out (startup only). */
    while (atomic_load_explicit(&p->placed, memory_order_acquire) < n - 1)
        sched_yield();
    *out = p;
    return SH_OK;
}

void sh__cpu_pool_destroy(sh__cpu_pool *p)
{
    if (!p)
        return;
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst);
    futex_wake_all(&p->gen);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->workers[i].thread, NULL);
    free(p->workers);
    free(p);
}

int sh__cpu_pool_size(const sh__cpu_pool *p) { return p->n; }

static void reset_counters(sh__cpu_pool *p)
{
    for (int ph = 0; ph < 2; ph++) {
        atomic_store_explicit(&p->next[ph], 0, memory_order_relaxed);
        atomic_store_explicit(&p->done[ph], 0, memory_order_relaxed);
    }
}

void sh__cpu_pool_run_alone(sh__cpu_pool *p, sh__cpu_job_fn fn, void *arg)
{
    reset_counters(p);
    fn(arg, 0, p->n);
}

void sh__cpu_pool_run(sh__cpu_pool *p, sh__cpu_job_fn fn, void *arg)
{
    reset_counters(p);
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    const uint32_t seq = atomic_load_explicit(&p->gen, memory_order_relaxed) + 1;
    /* Open the entry before publishing gen: a helper that sees the new gen (acquire) sees the
     * open entry, fn, arg and the reset counters. seq_cst on gen pairs with the helpers'
     * sleepers increment so a helper about to sleep either sees the new gen or is woken. */
    atomic_store_explicit(&p->entry, (uint64_t)seq << 32, memory_order_release);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0)
        futex_wake_all(&p->gen);
    fn(arg, 0, p->n);
    /* Close the job to latecomers, then wait for the helpers inside: they hold chunks that
     * are being computed now, so this wait is short unless one was preempted mid-chunk. */
    uint64_t e = atomic_fetch_or_explicit(&p->entry, ENTRY_CLOSED, memory_order_acq_rel);
    for (unsigned i = 0; ENTRY_COUNT(e) != 0; i++) {
        if (i < PAUSE_ITERS)
            cpu_relax();
        else
            sched_yield();
        e = atomic_load_explicit(&p->entry, memory_order_acquire);
    }
}

bool sh__cpu_pool_claim(sh__cpu_pool *p, int ph, int64_t n_units, int64_t per, int64_t *lo,
                        int64_t *hi)
{
    if (per < 1)
        per = 1;
    /* Cheap early-out: once the counter is past the end, do not touch the line for writing. */
    int64_t c = atomic_load_explicit(&p->next[ph], memory_order_relaxed);
    if (c * per >= n_units)
        return false;
    c = atomic_fetch_add_explicit(&p->next[ph], 1, memory_order_relaxed);
    if (c * per >= n_units)
        return false;
    *lo = c * per;
    *hi = *lo + per < n_units ? *lo + per : n_units;
    return true;
}

void sh__cpu_pool_finish(sh__cpu_pool *p, int ph, int64_t units)
{
    atomic_fetch_add_explicit(&p->done[ph], units, memory_order_release);
}

void sh__cpu_pool_wait_finished(sh__cpu_pool *p, int ph, int64_t total)
{
    for (unsigned i = 0; atomic_load_explicit(&p->done[ph], memory_order_acquire) < total; i++) {
        if (i < PAUSE_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
}

int64_t sh__cpu_pool_chunk(const sh__cpu_pool *p, int64_t n_units, int per_thread)
{
    const int64_t parts = (int64_t)p->n * (per_thread < 1 ? 1 : per_thread);
    const int64_t per = (n_units + parts - 1) / parts;
    return per < 1 ? 1 : per;
}

void sh__cpu_split(int64_t n, int64_t align, int tid, int nth, int64_t *lo, int64_t *hi)
{
    if (align < 1)
        align = 1;
    int64_t units = (n + align - 1) / align;
    int64_t per = units / nth, extra = units % nth;
    int64_t u0 = tid * per + (tid < extra ? tid : extra);
    int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
    *lo = u0 * align < n ? u0 * align : n;
    *hi = u1 * align < n ? u1 * align : n;
}
