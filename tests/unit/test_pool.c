/* Unit tests of the CPU backend's worker pool, its op queue (ordering, sync, events, host
 * callbacks, a full ring), the static split and the pool's chunked work sharing. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "sh_test.h"

static void test_split(void)
{
    /* The parts tile [0, n) in order, are aligned except at n, and differ by one unit at most. */
    const int64_t ns[] = {0, 1, 7, 16, 17, 577, 4096};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
        for (int64_t align = 1; align <= 16; align *= 4)
            for (int nth = 1; nth <= 5; nth++) {
                int64_t expect = 0;
                for (int tid = 0; tid < nth; tid++) {
                    int64_t lo, hi;
                    sh__cpu_split(ns[i], align, tid, nth, &lo, &hi);
                    CHECK_INT_EQ(lo, expect);
                    CHECK(hi >= lo);
                    CHECK(lo % align == 0 || lo == ns[i]);
                    CHECK(hi - lo <= ((ns[i] + align - 1) / align / nth + 1) * align);
                    expect = hi;
                }
                CHECK_INT_EQ(expect, ns[i]);
            }
}

typedef struct job_state {
    sh__cpu_pool *pool;
    _Atomic int calls[8];
    _Atomic int units[2][1000];
    _Atomic int bad;
    int n, n_units, run, slow_tid;
} job_state;

/* Two phases over 1000 units: phase 0 marks units, then (after waiting for all of phase 0)
 * phase 1 checks that every unit of phase 0 is marked and marks its own. A helper sometimes
 * sleeps before it starts, so that the leader finishes without it. */
static void job(void *arg, int tid, int nth)
{
    job_state *s = arg;
    if (nth != s->n || tid < 0 || tid >= nth)
        atomic_fetch_add(&s->bad, 1);
    atomic_fetch_add(&s->calls[tid], 1);
    if (tid == s->slow_tid && s->run % 50 == 0)
        usleep(2000);
    int64_t lo, hi;
    const int64_t per = sh__cpu_pool_chunk(s->pool, s->n_units, 4);
    while (sh__cpu_pool_claim(s->pool, 0, s->n_units, per, &lo, &hi)) {
        for (int64_t i = lo; i < hi; i++)
            atomic_fetch_add(&s->units[0][i], 1);
        sh__cpu_pool_finish(s->pool, 0, hi - lo);
    }
    sh__cpu_pool_wait_finished(s->pool, 0, s->n_units);
    while (sh__cpu_pool_claim(s->pool, 1, s->n_units, 7, &lo, &hi))
        for (int64_t i = lo; i < hi; i++) {
            if (atomic_load(&s->units[0][i]) != s->run + 1)
                atomic_fetch_add(&s->bad, 1);
            atomic_fetch_add(&s->units[1][i], 1);
        }
}

static void test_pool_runs(void)
{
    for (int n = 1; n <= 3; n++) {
        static job_state s;
        memset(&s, 0, sizeof s);
        s.n = n;
        s.n_units = 1000;
        s.slow_tid = n - 1;
        CHECK_OK(sh__cpu_pool_create(n, NULL, &s.pool, NULL));
        CHECK_INT_EQ(sh__cpu_pool_size(s.pool), n);
        const int runs = 2000;
        for (s.run = 0; s.run < runs; s.run++) {
            sh__cpu_pool_run(s.pool, job, &s);
            /* every unit exactly once per run and phase, whoever joined */
            if (atomic_load(&s.units[1][s.run % 1000]) != s.run + 1)
                atomic_fetch_add(&s.bad, 1);
        }
        for (int i = 0; i < 1000; i++) {
            CHECK_INT_EQ(atomic_load(&s.units[0][i]), runs);
            CHECK_INT_EQ(atomic_load(&s.units[1][i]), runs);
        }
        CHECK_INT_EQ(atomic_load(&s.calls[0]), runs); /* the leader runs every job */
        int total = 0;
        for (int t = 0; t < n; t++)
            total += atomic_load(&s.calls[t]);
        CHECK(total >= runs && total <= runs * n);
        CHECK_INT_EQ(atomic_load(&s.bad), 0);
        sh__cpu_pool_destroy(s.pool);
    }
    sh__cpu_pool_destroy(NULL);
}

static sh_backend *make(int threads)
{
    sh_backend *be = NULL;
    sh_backend_cpu_opts o = {.n_threads = threads};
    CHECK_OK(sh_backend_cpu_create(&o, &be, NULL));
    return be;
}

typedef struct host_log {
    int seen[64];
    int n;
    float *watch;
} host_log;

/* Records what the stream had computed when it reached this point. */
static void on_host(void *arg)
{
    host_log *l = arg;
    l->seen[l->n++] = (int)l->watch[0];
}

/* Many small ops on two streams (more than the ring holds), in order: each stream increments
 * its own vector 5000 times; host callbacks observe the in-order progress; events mark points. */
static void test_queue_stress(void)
{
    for (int threads = 1; threads <= 3; threads++) {
        sh_backend *be = make(threads);
        sh_backend_stream *s1, *s2;
        CHECK_OK(sh_backend_stream_create(be, &s1, NULL));
        CHECK_OK(sh_backend_stream_create(be, &s2, NULL));
        sh_backend_event *ev;
        CHECK_OK(sh_backend_event_create(be, &ev, NULL));
        CHECK_OK(sh_backend_event_sync(be, ev)); /* never recorded: reached */
        enum { N = 100 };
        float a[N], b[N], one[N], snap[N];
        for (int i = 0; i < N; i++) {
            a[i] = b[i] = 0.0f;
            one[i] = 1.0f;
        }
        host_log log = {.watch = a};
        const int ops = 5000;
        for (int r = 0; r < ops; r++) {
            CHECK_OK(sh_backend_add(be, s1, a, one, N, a));
            CHECK_OK(sh_backend_add(be, s2, b, one, r % 7 + 1, b));
            if (r % 1000 == 999)
                CHECK_OK(sh_backend_host_fn(be, s1, on_host, &log));
            if (r == 2499) { /* a snapshot of a at this point, then the event after it */
                CHECK_OK(sh_backend_copy(be, s1, snap, a, sizeof snap));
                CHECK_OK(sh_backend_event_record(be, ev, s1));
            }
        }
        CHECK_OK(sh_backend_event_wait(be, s2, ev));
        CHECK_OK(sh_backend_event_sync(be, ev));
        /* (a itself is still being written by the later ops: read the snapshot) */
        CHECK_NEAR(snap[0], 2500.0f, 0);
        CHECK_OK(sh_backend_sync(be, s1));
        CHECK_OK(sh_backend_sync(be, s2));
        for (int i = 0; i < N; i++)
            CHECK_NEAR(a[i], ops, 0);
        CHECK_NEAR(b[0], ops, 0);
        CHECK_NEAR(b[6], ops / 7, 0);
        CHECK_INT_EQ(log.n, 5);
        for (int i = 0; i < log.n; i++)
            CHECK_INT_EQ(log.seen[i], 1000 * (i + 1));
        /* copy is a stream op too */
        float c[N];
        CHECK_OK(sh_backend_copy(be, s1, c, a, sizeof c));
        CHECK_OK(sh_backend_sync(be, s1));
        CHECK_NEAR(c[N - 1], ops, 0);
        sh_backend_event_destroy(be, ev);
        sh_backend_stream_destroy(be, s1);
        sh_backend_stream_destroy(be, s2);
        sh_backend_destroy(be);
    }
}

/* Sync with nothing enqueued returns at once; destroy of a busy stream waits for it. */
static void test_sync_edges(void)
{
    sh_backend *be = make(2);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_sync(be, s));
    float x[4096], one[4096];
    for (int i = 0; i < 4096; i++) {
        x[i] = 0.0f;
        one[i] = 1.0f;
    }
    for (int r = 0; r < 300; r++)
        CHECK_OK(sh_backend_add(be, s, x, one, 4096, x));
    sh_backend_stream_destroy(be, s); /* syncs */
    CHECK_NEAR(x[4095], 300, 0);
    sh_backend_stream_destroy(be, NULL);
    sh_backend_event_destroy(be, NULL);
    sh_backend_destroy(be);
    sh_backend_destroy(NULL);
}

int main(int argc, char **argv)
{
    static const sh_test_case tests[] = {
        {"split", test_split},
        {"pool_runs", test_pool_runs},
        {"queue_stress", test_queue_stress},
        {"sync_edges", test_sync_edges},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
