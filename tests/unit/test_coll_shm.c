/* The shared-memory collectives (SH_COLL_SHM): sums, gathers and broadcasts among threads of one
 * process and among fork()ed processes over a named segment, and every failure a group can meet
 * (a silent peer, a killed one, a peer that left, mismatched calls and epochs, bad options). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/coll.h"
#include "sh_test.h"

#define MAX_RANKS 4

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A deterministic value in [-1, 1) for (seed, rank, i), so every process can build every rank's
 * input. */
static float val(uint32_t seed, int32_t rank, size_t i)
{
    uint64_t x = ((uint64_t)seed << 40) ^ ((uint64_t)rank << 32) ^ i;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)((double)(x >> 40) / (double)(1u << 23)) - 1.0f;
}

/* The scalar sum in rank order, the reference every transport must match. */
static float ref_sum(uint32_t seed, int32_t size, size_t i)
{
    float s = val(seed, 0, i);
    for (int32_t r = 1; r < size; r++)
        s += val(seed, r, i);
    return s;
}

static void shm_name(char *out, size_t cap, const char *what)
{
    snprintf(out, cap, "/shoal-test-coll-%d-%s", (int)getpid(), what);
}

/* One rank run by a thread of an in-process group. */
typedef struct rank_run {
    int32_t rank, size;
    sh_coll_opts o;
    void (*body)(struct rank_run *r);
    sh_coll *c;
    sh_err create_rc;
    sh_error e;
    /* what the body leaves for the main thread to check */
    sh_err rc[4];
    char msg[4][320];
    uint64_t ms[4];
    float *out;
    size_t out_len;
    int bad; /* count of wrong values the body found itself */
    void *arg;
} rank_run;

static void *rank_main(void *p)
{
    rank_run *r = p;
    r->create_rc = sh_coll_create(SH_COLL_SHM, &r->o, &r->c, &r->e);
    if (r->create_rc == SH_OK && r->body)
        r->body(r);
    return NULL;
}

/* Runs body on `size` threads forming an in-process group (or a named one with name != NULL);
 * epochs NULL: every rank epoch 1. */
static void run_group(rank_run *runs, int32_t size, size_t max_bytes, int32_t timeout_ms,
                      const char *name, const uint32_t *epochs, void (*body)(rank_run *), void *arg)
{
    sh_coll_inproc *g = NULL;
    sh_error e = {0};
    if (!name)
        CHECK_OK(sh_coll_inproc_create(size, max_bytes, &g, &e));
    pthread_t th[MAX_RANKS];
    for (int32_t r = 0; r < size; r++) {
        memset(&runs[r], 0, sizeof runs[r]);
        runs[r].rank = r;
        runs[r].size = size;
        runs[r].o = (sh_coll_opts){.rank = r,
                                   .size = size,
                                   .epoch = epochs ? epochs[r] : 1,
                                   .timeout_ms = timeout_ms,
                                   .max_bytes = max_bytes,
                                   .shm_name = name,
                                   .inproc = g};
        runs[r].body = body;
        runs[r].arg = arg;
    }
    for (int32_t r = 0; r < size; r++)
        CHECK_INT_EQ(pthread_create(&th[r], NULL, rank_main, &runs[r]), 0);
    for (int32_t r = 0; r < size; r++)
        pthread_join(th[r], NULL);
    for (int32_t r = 0; r < size; r++)
        sh_coll_destroy(runs[r].c);
    sh_coll_inproc_destroy(g);
}

/* ---- sums ---- */

/* Past the one-barrier threshold with 3 and 4 ranks (8192 floats) and past one 64 KB chunk
 * (16384 floats) by many, with a partial last chunk. */
#define SUM_MAX_FLOATS 200000
static const size_t sum_sizes[] = {1,    3,    16,    17,    1000,   2048,
                                   8191, 8193, 20000, 65536, 131073, SUM_MAX_FLOATS};
#define N_SUM_SIZES (sizeof sum_sizes / sizeof sum_sizes[0])

static void sum_body(rank_run *r)
{
    r->out_len = 0;
    for (size_t i = 0; i < N_SUM_SIZES; i++)
        r->out_len += sum_sizes[i];
    r->out = malloc(r->out_len * sizeof(float));
    float *o = r->out;
    for (size_t k = 0; k < N_SUM_SIZES; k++) {
        size_t n = sum_sizes[k];
        for (size_t i = 0; i < n; i++)
            o[i] = val((uint32_t)k + 1, r->rank, i);
        sh_err rc = sh_coll_allreduce(r->c, o, n, &r->e);
        if (rc && !r->rc[0]) {
            r->rc[0] = rc;
            snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
        }
        o += n;
    }
}

static void check_sums(rank_run *runs, int32_t size)
{
    for (int32_t r = 0; r < size; r++) {
        CHECK_OK(runs[r].create_rc);
        if (runs[r].rc[0])
            fprintf(stderr, "rank %d: %s\n", (int)r, runs[r].msg[0]);
        CHECK_OK(runs[r].rc[0]);
    }
    size_t off = 0, bad_bits = 0, bad_ref = 0;
    for (size_t k = 0; k < N_SUM_SIZES; k++) {
        size_t n = sum_sizes[k];
        for (size_t i = 0; i < n; i++) {
            float ref = ref_sum((uint32_t)k + 1, size, i);
            float got = runs[0].out[off + i];
            if (!(fabsf(got - ref) <= 1e-6f * fmaxf(1.0f, fabsf(ref))) && bad_ref++ < 3)
                SH_FAIL_("size %d, n %zu, [%zu]: %.9g, reference %.9g", (int)size, n, i, got, ref);
            for (int32_t r = 1; r < size; r++)
                if (memcmp(&runs[r].out[off + i], &got, sizeof got) != 0 && bad_bits++ < 3)
                    SH_FAIL_("size %d, n %zu, [%zu]: rank %d has %.9g, rank 0 %.9g", (int)size, n,
                             i, (int)r, runs[r].out[off + i], got);
        }
        off += n;
    }
    CHECK_UINT_EQ(bad_ref, 0);
    CHECK_UINT_EQ(bad_bits, 0);
    for (int32_t r = 0; r < size; r++) {
        sh_coll_stats st;
        sh_coll_stats_get(runs[r].c, &st);
        CHECK_UINT_EQ(st.calls, N_SUM_SIZES);
        CHECK_UINT_EQ(st.failures, 0);
        free(runs[r].out);
    }
}

static void run_sums(int32_t size)
{
    rank_run runs[MAX_RANKS];
    sh_coll_inproc *g = NULL;
    sh_error e = {0};
    /* run_group destroys the handles; keep them for the stats by running the group by hand */
    CHECK_OK(sh_coll_inproc_create(size, SUM_MAX_FLOATS * sizeof(float), &g, &e));
    pthread_t th[MAX_RANKS];
    for (int32_t r = 0; r < size; r++) {
        memset(&runs[r], 0, sizeof runs[r]);
        runs[r].rank = r;
        runs[r].size = size;
        runs[r].o = (sh_coll_opts){.rank = r,
                                   .size = size,
                                   .epoch = 7,
                                   .timeout_ms = sh_test_ms(5000),
                                   .max_bytes = SUM_MAX_FLOATS * sizeof(float),
                                   .inproc = g};
        runs[r].body = sum_body;
        CHECK_INT_EQ(pthread_create(&th[r], NULL, rank_main, &runs[r]), 0);
    }
    for (int32_t r = 0; r < size; r++)
        pthread_join(th[r], NULL);
    check_sums(runs, size);
    for (int32_t r = 0; r < size; r++)
        sh_coll_destroy(runs[r].c);
    sh_coll_inproc_destroy(g);
}

static void test_allreduce_inproc(void)
{
    for (int32_t size = 2; size <= 4; size++)
        run_sums(size);
}

/* ---- all-gather and broadcast ---- */

/* Sizes that fit one chunk and sizes that span several (chunks are 64 KB). */
#define GATHER_MAX 300000
static const size_t gather_sizes[] = {1, 5, 64, 1000, 4096, 262145, GATHER_MAX};
#define N_GATHER_SIZES (sizeof gather_sizes / sizeof gather_sizes[0])

static void gather_body(rank_run *r)
{
    unsigned char *in = malloc(GATHER_MAX), *out = malloc((size_t)MAX_RANKS * GATHER_MAX);
    unsigned char *buf = malloc(GATHER_MAX);
    for (size_t k = 0; k < N_GATHER_SIZES && !r->rc[0]; k++) {
        size_t b = gather_sizes[k];
        for (size_t i = 0; i < b; i++)
            in[i] = (unsigned char)(r->rank * 31 + i * 7 + k);
        sh_err rc = sh_coll_allgather(r->c, in, b, out, &r->e);
        if (rc) {
            r->rc[0] = rc;
            snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
            break;
        }
        for (int32_t q = 0; q < r->size; q++)
            for (size_t i = 0; i < b; i++)
                if (out[(size_t)q * b + i] != (unsigned char)(q * 31 + i * 7 + k))
                    r->bad++;
    }
    for (int32_t root = 0; root < r->size && !r->rc[0]; root++)
        for (size_t k = 0; k < N_GATHER_SIZES && !r->rc[0]; k++) {
            size_t b = gather_sizes[k];
            for (size_t i = 0; i < b; i++)
                buf[i] = r->rank == root ? (unsigned char)(root * 13 + i * 3 + k) : 0xee;
            sh_err rc = sh_coll_broadcast(r->c, buf, b, root, &r->e);
            if (rc) {
                r->rc[0] = rc;
                snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
                break;
            }
            for (size_t i = 0; i < b; i++)
                if (buf[i] != (unsigned char)(root * 13 + i * 3 + k))
                    r->bad++;
        }
    free(in);
    free(out);
    free(buf);
}

static void test_allgather_broadcast_inproc(void)
{
    rank_run runs[MAX_RANKS];
    for (int32_t size = 2; size <= 4; size++) {
        run_group(runs, size, (size_t)size * GATHER_MAX, sh_test_ms(5000), NULL, NULL, gather_body,
                  NULL);
        for (int32_t r = 0; r < size; r++) {
            CHECK_OK(runs[r].create_rc);
            if (runs[r].rc[0])
                fprintf(stderr, "rank %d: %s\n", (int)r, runs[r].msg[0]);
            CHECK_OK(runs[r].rc[0]);
            CHECK_INT_EQ(runs[r].bad, 0);
        }
    }
}

/* ---- many small calls: every slot reused hundreds of times, operations interleaved ---- */

static void many_body(rank_run *r)
{
    for (int i = 0; i < 1000; i++) {
        float v[8];
        size_t n = 1 + (size_t)i % 8;
        for (size_t j = 0; j < n; j++)
            v[j] = (float)(i * 8 + (int)j + r->rank * 100000);
        sh_err rc = sh_coll_allreduce(r->c, v, n, &r->e);
        if (rc) {
            r->rc[0] = rc;
            snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
            return;
        }
        for (size_t j = 0; j < n; j++) {
            /* integers below 2^24: the sum is exact */
            float want = 0;
            for (int32_t q = 0; q < r->size; q++)
                want += (float)(i * 8 + (int)j + q * 100000);
            if (v[j] != want)
                r->bad++;
        }
        if (i % 7 == 0) {
            int32_t in = r->rank * 1000 + i, out[MAX_RANKS];
            rc = sh_coll_allgather(r->c, &in, sizeof in, out, &r->e);
            if (rc) {
                r->rc[0] = rc;
                snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
                return;
            }
            for (int32_t q = 0; q < r->size; q++)
                if (out[q] != q * 1000 + i)
                    r->bad++;
        }
    }
}

static void test_many_small(void)
{
    rank_run runs[MAX_RANKS];
    for (int32_t size = 2; size <= 3; size++) {
        run_group(runs, size, 256, sh_test_ms(5000), NULL, NULL, many_body, NULL);
        for (int32_t r = 0; r < size; r++) {
            CHECK_OK(runs[r].create_rc);
            if (runs[r].rc[0])
                fprintf(stderr, "rank %d: %s\n", (int)r, runs[r].msg[0]);
            CHECK_OK(runs[r].rc[0]);
            CHECK_INT_EQ(runs[r].bad, 0);
        }
    }
}

/* ---- real processes over a named segment ---- */

/* A child's rank: sums of several sizes (both paths), a gather and a broadcast, checked against
 * the reference it computes itself; exit 0 when everything matched. */
static int child_rank(const char *name, int32_t rank, int32_t size)
{
    sh_coll_opts o = {.rank = rank,
                      .size = size,
                      .epoch = 3,
                      .timeout_ms = (int32_t)sh_test_ms(5000),
                      .max_bytes = SUM_MAX_FLOATS * sizeof(float),
                      .shm_name = name};
    sh_coll *c = NULL;
    sh_error e = {0};
    if (sh_coll_create(SH_COLL_SHM, &o, &c, &e)) {
        fprintf(stderr, "rank %d: create: %s\n", (int)rank, e.msg);
        return 2;
    }
    float *buf = malloc(SUM_MAX_FLOATS * sizeof(float));
    int bad = 0;
    for (size_t k = 0; k < N_SUM_SIZES; k++) {
        size_t n = sum_sizes[k];
        for (size_t i = 0; i < n; i++)
            buf[i] = val((uint32_t)k + 50, rank, i);
        if (sh_coll_allreduce(c, buf, n, &e)) {
            fprintf(stderr, "rank %d: all-reduce: %s\n", (int)rank, e.msg);
            bad++;
            break;
        }
        for (size_t i = 0; i < n; i++) {
            float ref = ref_sum((uint32_t)k + 50, size, i);
            if (memcmp(&buf[i], &ref, sizeof ref) != 0 && bad++ < 3)
                fprintf(stderr, "rank %d: n %zu [%zu]: %.9g, reference %.9g\n", (int)rank, n, i,
                        buf[i], ref);
        }
    }
    int32_t in = rank * 11, out[MAX_RANKS];
    if (!bad && sh_coll_allgather(c, &in, sizeof in, out, &e) == SH_OK) {
        for (int32_t q = 0; q < size; q++)
            bad += out[q] != q * 11;
    } else if (!bad) {
        fprintf(stderr, "rank %d: all-gather: %s\n", (int)rank, e.msg);
        bad++;
    }
    int32_t word = rank == size - 1 ? 0x5eed : 0;
    if (!bad && sh_coll_broadcast(c, &word, sizeof word, size - 1, &e) == SH_OK) {
        bad += word != 0x5eed;
    } else if (!bad) {
        fprintf(stderr, "rank %d: broadcast: %s\n", (int)rank, e.msg);
        bad++;
    }
    free(buf);
    sh_coll_destroy(c);
    return bad ? 1 : 0;
}

/* Waits for pid up to ms; kills it past that. Returns its exit status or -1. */
static int wait_child(pid_t pid, unsigned ms)
{
    uint64_t t0 = now_ms();
    for (;;) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (now_ms() - t0 > ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(2000);
    }
}

static void test_named_processes(void)
{
    for (int32_t size = 2; size <= 3; size++) {
        char name[96];
        shm_name(name, sizeof name, "procs");
        pid_t pids[MAX_RANKS];
        /* the last rank first, so the others wait for the segment */
        for (int32_t r = size - 1; r >= 0; r--) {
            pids[r] = fork();
            if (pids[r] == 0)
                _exit(child_rank(name, r, size));
            CHECK(pids[r] > 0);
        }
        for (int32_t r = 0; r < size; r++)
            CHECK_INT_EQ(wait_child(pids[r], sh_test_ms(20000)), 0);
        /* rank 0 unlinked the segment when it left */
        int fd = shm_open(name, O_RDONLY, 0);
        CHECK_INT_EQ(fd, -1);
        if (fd >= 0)
            close(fd);
    }
}

/* ---- failures ---- */

/* Rank 0 calls; rank 1 never does (it waits for rank 0 to be done with its calls). */
static atomic_int silent_done;

static void silent_body(rank_run *r)
{
    if (r->rank == 1) {
        while (!atomic_load(&silent_done))
            usleep(1000);
        /* rank 0 published call #1 before it gave up, so this rank's call #1 completes with
         * its contribution; rank 0 broke, so call #2 fails at once */
        float v = 1;
        r->rc[0] = sh_coll_allreduce(r->c, &v, 1, &r->e);
        r->bad += v != 2.0f;
        uint64_t t0 = now_ms();
        r->rc[1] = sh_coll_allreduce(r->c, &v, 1, &r->e);
        r->ms[1] = now_ms() - t0;
        snprintf(r->msg[1], sizeof r->msg[1], "%s", r->e.msg);
        return;
    }
    for (int i = 0; i < 2; i++) {
        uint64_t t0 = now_ms();
        float v = 1;
        r->rc[i] = sh_coll_allreduce(r->c, &v, 1, &r->e);
        r->ms[i] = now_ms() - t0;
        snprintf(r->msg[i], sizeof r->msg[i], "%s", r->e.msg);
    }
    atomic_store(&silent_done, 1);
}

static void test_silent_peer_times_out(void)
{
    rank_run runs[2];
    atomic_store(&silent_done, 0);
    run_group(runs, 2, 64, 300, NULL, NULL, silent_body, NULL);
    CHECK_OK(runs[0].create_rc);
    CHECK_OK(runs[1].create_rc);
    CHECK_INT_EQ(runs[0].rc[0], SH_ETIMEDOUT);
    CHECK(runs[0].ms[0] >= 290 && runs[0].ms[0] <= 300 + sh_test_ms(400));
    CHECK(strstr(runs[0].msg[0], "rank 1") && strstr(runs[0].msg[0], "call #1"));
    fprintf(stderr, "  timeout after %llu ms: %s\n", (unsigned long long)runs[0].ms[0],
            runs[0].msg[0]);
    /* broken: the next call fails at once with the same code */
    CHECK_INT_EQ(runs[0].rc[1], SH_ETIMEDOUT);
    CHECK(runs[0].ms[1] <= 50); /* no wait: only a preemption of the test */
    CHECK(strstr(runs[0].msg[1], "broken") != NULL);
    /* the silent rank's call #1 had every contribution; at call #2 it sees rank 0 broken */
    CHECK_OK(runs[1].rc[0]);
    CHECK_INT_EQ(runs[1].bad, 0);
    CHECK_INT_EQ(runs[1].rc[1], SH_ECLOSED);
    CHECK(runs[1].ms[1] <= 100);
    CHECK(strstr(runs[1].msg[1], "rank 0") != NULL);
    fprintf(stderr, "  peer: %s\n", runs[1].msg[1]);
}

/* Rank 1 leaves (destroys its handle) after one call; rank 0's next call fails SH_ECLOSED. */
static void leave_body(rank_run *r)
{
    float v = 2;
    r->rc[0] = sh_coll_allreduce(r->c, &v, 1, &r->e);
    r->bad += v != 4.0f;
    if (r->rank == 1) {
        sh_coll_destroy(r->c);
        r->c = NULL;
        return;
    }
    uint64_t t0 = now_ms();
    r->rc[1] = sh_coll_allreduce(r->c, &v, 1, &r->e);
    r->ms[1] = now_ms() - t0;
    snprintf(r->msg[1], sizeof r->msg[1], "%s", r->e.msg);
}

static void test_peer_left(void)
{
    rank_run runs[2];
    run_group(runs, 2, 64, 3000, NULL, NULL, leave_body, NULL);
    CHECK_OK(runs[0].rc[0]);
    CHECK_OK(runs[1].rc[0]);
    CHECK_INT_EQ(runs[0].bad + runs[1].bad, 0);
    CHECK_INT_EQ(runs[0].rc[1], SH_ECLOSED);
    CHECK(runs[0].ms[1] < 1000);
    CHECK(strstr(runs[0].msg[1], "rank 1") && strstr(runs[0].msg[1], "left"));
}

/* A peer process killed with SIGKILL while the group lives: the survivor (this process, which
 * has not reaped it yet) fails well within the timeout, from the pid check. */
static void test_peer_killed(void)
{
    char name[96];
    shm_name(name, sizeof name, "killed");
    pid_t pid = fork();
    if (pid == 0) {
        sh_coll_opts o = {.rank = 1,
                          .size = 2,
                          .epoch = 1,
                          .timeout_ms = 5000,
                          .max_bytes = 64,
                          .shm_name = name};
        sh_coll *c = NULL;
        if (sh_coll_create(SH_COLL_SHM, &o, &c, NULL))
            _exit(2);
        float v = 1;
        if (sh_coll_allreduce(c, &v, 1, NULL))
            _exit(3);
        for (;;)
            pause();
    }
    CHECK(pid > 0);
    sh_coll_opts o = {
        .rank = 0, .size = 2, .epoch = 1, .timeout_ms = 5000, .max_bytes = 64, .shm_name = name};
    sh_coll *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_coll_create(SH_COLL_SHM, &o, &c, &e));
    float v = 1;
    CHECK_OK(sh_coll_allreduce(c, &v, 1, &e));
    CHECK(v == 2.0f);
    usleep(20000);
    kill(pid, SIGKILL);
    uint64_t t0 = now_ms();
    sh_err rc = sh_coll_allreduce(c, &v, 1, &e);
    uint64_t ms = now_ms() - t0;
    CHECK_INT_EQ(rc, SH_ECLOSED);
    CHECK(ms < 1000);
    CHECK(strstr(e.msg, "rank 1") && strstr(e.msg, "died"));
    fprintf(stderr, "  after %llu ms: %s\n", (unsigned long long)ms, e.msg);
    sh_coll_destroy(c);
    int st;
    waitpid(pid, &st, 0);
}

/* A peer process stopped (SIGSTOP) is alive but silent: the call fails SH_ETIMEDOUT at the
 * timeout, naming it. */
static void test_peer_stopped(void)
{
    char name[96];
    shm_name(name, sizeof name, "stopped");
    pid_t pid = fork();
    if (pid == 0) {
        sh_coll_opts o = {.rank = 1,
                          .size = 2,
                          .epoch = 1,
                          .timeout_ms = 5000,
                          .max_bytes = 64,
                          .shm_name = name};
        sh_coll *c = NULL;
        if (sh_coll_create(SH_COLL_SHM, &o, &c, NULL))
            _exit(2);
        float v = 1;
        if (sh_coll_allreduce(c, &v, 1, NULL))
            _exit(3);
        for (;;)
            pause();
    }
    CHECK(pid > 0);
    sh_coll_opts o = {
        .rank = 0, .size = 2, .epoch = 1, .timeout_ms = 300, .max_bytes = 64, .shm_name = name};
    sh_coll *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_coll_create(SH_COLL_SHM, &o, &c, &e));
    float v = 1;
    CHECK_OK(sh_coll_allreduce(c, &v, 1, &e));
    kill(pid, SIGSTOP);
    uint64_t t0 = now_ms();
    sh_err rc = sh_coll_allreduce(c, &v, 1, &e);
    uint64_t ms = now_ms() - t0;
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    CHECK(ms >= 290 && ms <= 300 + sh_test_ms(400));
    CHECK(strstr(e.msg, "rank 1") && strstr(e.msg, "call #2"));
    fprintf(stderr, "  after %llu ms: %s\n", (unsigned long long)ms, e.msg);
    sh_coll_destroy(c);
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
}

/* Ranks of two epochs meeting at create. */
static void test_epoch_mismatch(void)
{
    rank_run runs[2];
    /* named: rank 1's epoch is older than the segment's: refused at once */
    char name[96];
    shm_name(name, sizeof name, "epoch");
    sh_coll_opts o0 = {
        .rank = 0, .size = 2, .epoch = 5, .timeout_ms = 300, .max_bytes = 64, .shm_name = name};
    sh_coll_opts o1 = o0;
    o1.rank = 1;
    o1.epoch = 4;
    /* rank 0 in a thread, so rank 1 finds the segment */
    rank_run r0 = {.o = o0};
    pthread_t th;
    CHECK_INT_EQ(pthread_create(&th, NULL, rank_main, &r0), 0);
    sh_coll *c1 = NULL;
    sh_error e = {0};
    sh_err rc = SH_ETIMEDOUT;
    uint64_t t0 = now_ms();
    while (now_ms() - t0 < 1000) {
        rc = sh_coll_create(SH_COLL_SHM, &o1, &c1, &e);
        if (rc != SH_ETIMEDOUT)
            break;
    }
    CHECK_INT_EQ(rc, SH_EPROTO);
    CHECK(strstr(e.msg, "epoch 5") && strstr(e.msg, "epoch 4"));
    fprintf(stderr, "  %s\n", e.msg);
    pthread_join(th, NULL);
    CHECK_INT_EQ(r0.create_rc, SH_ETIMEDOUT);
    CHECK(strstr(r0.e.msg, "rank 1 did not join") != NULL);
    CHECK(c1 == NULL && r0.c == NULL);

    /* named, same epoch: a segment made for another max_bytes or size is refused at once */
    for (int which = 0; which < 2; which++) {
        r0 = (rank_run){.o = o0};
        CHECK_INT_EQ(pthread_create(&th, NULL, rank_main, &r0), 0);
        o1 = o0;
        o1.rank = 1;
        if (which == 0)
            o1.max_bytes = 128;
        else
            o1.size = 3;
        t0 = now_ms();
        rc = SH_ETIMEDOUT;
        while (now_ms() - t0 < 1000 && rc == SH_ETIMEDOUT)
            rc = sh_coll_create(SH_COLL_SHM, &o1, &c1, &e);
        CHECK_INT_EQ(rc, SH_EINVAL);
        CHECK(which == 0 ? strstr(e.msg, "max_bytes 64") && strstr(e.msg, "is 128")
                         : strstr(e.msg, "group of 2 ranks") && strstr(e.msg, "has 3"));
        fprintf(stderr, "  %s\n", e.msg);
        pthread_join(th, NULL);
        CHECK_INT_EQ(r0.create_rc, SH_ETIMEDOUT);
    }

    /* in-process: the ranks' epochs meet at join */
    uint32_t epochs[2] = {2, 3};
    run_group(runs, 2, 64, 300, NULL, epochs, NULL, NULL);
    CHECK_INT_EQ(runs[0].create_rc, SH_EPROTO);
    CHECK_INT_EQ(runs[1].create_rc, SH_EPROTO);
    CHECK(strstr(runs[0].e.msg, "epoch 3") && strstr(runs[0].e.msg, "is 2"));
}

/* A segment left by a dead run (its creator killed before destroy) is replaced: rank 1 opens
 * the stale one first, sees its creator dead, and joins the fresh one rank 0 makes. */
static void test_stale_segment(void)
{
    char name[96];
    shm_name(name, sizeof name, "stale");
    pid_t pid = fork();
    if (pid == 0) {
        /* a header as a killed run's rank 0 leaves it: magic, version 1, epoch 9, size 2, this
         * child's pid as the creator, max_bytes 64 */
        int fd = shm_open(name, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || ftruncate(fd, 1 << 16) != 0)
            _exit(2);
        uint64_t hdr[8] = {0x4745534c4f434853ull, 1 | ((uint64_t)9 << 32),
                           2 | ((uint64_t)getpid() << 32), 64};
        if (write(fd, hdr, sizeof hdr) != sizeof hdr)
            _exit(3);
        _exit(0);
    }
    CHECK_INT_EQ(wait_child(pid, 5000), 0);
    int fd = shm_open(name, O_RDONLY, 0);
    CHECK(fd >= 0); /* the stale segment is there */
    if (fd >= 0)
        close(fd);
    /* rank 1 first: it finds the stale segment and waits; rank 0 replaces it */
    rank_run runs[2] = {0};
    pthread_t th[2];
    for (int32_t r = 1; r >= 0; r--) {
        runs[r].rank = r;
        runs[r].size = 2;
        runs[r].o = (sh_coll_opts){.rank = r,
                                   .size = 2,
                                   .epoch = 9,
                                   .timeout_ms = (int32_t)sh_test_ms(3000),
                                   .max_bytes = 64,
                                   .shm_name = name};
        runs[r].body = leave_body;
        CHECK_INT_EQ(pthread_create(&th[r], NULL, rank_main, &runs[r]), 0);
        usleep(50000);
    }
    for (int32_t r = 0; r < 2; r++) {
        pthread_join(th[r], NULL);
        if (runs[r].create_rc)
            fprintf(stderr, "  rank %d: %s\n", (int)r, runs[r].e.msg);
        CHECK_OK(runs[r].create_rc);
        CHECK_OK(runs[r].rc[0]);
        CHECK_INT_EQ(runs[r].bad, 0);
    }
    /* rank 1 left; another rank 1 of the same epoch does not join the finished group */
    sh_coll_destroy(runs[1].c);
    sh_coll *again = NULL;
    sh_error e = {0};
    sh_coll_opts o1 = runs[1].o;
    o1.timeout_ms = 100;
    CHECK_INT_EQ(sh_coll_create(SH_COLL_SHM, &o1, &again, &e), SH_ETIMEDOUT);
    CHECK(strstr(e.msg, "rank 1 has already joined it") != NULL);
    fprintf(stderr, "  %s\n", e.msg);
    sh_coll_destroy(runs[0].c);
    fd = shm_open(name, O_RDONLY, 0);
    CHECK_INT_EQ(fd, -1); /* rank 0 unlinked the fresh one */
    if (fd >= 0)
        close(fd);
    shm_unlink(name);
}

/* Ranks calling different sizes or operations: SH_EPROTO on both, then broken. */
static void mismatch_body(rank_run *r)
{
    float v[32] = {0};
    int mode = *(int *)r->arg;
    if (mode == 2) /* each rank names itself the root */
        r->rc[0] = sh_coll_broadcast(r->c, v, 16, r->rank, &r->e);
    else if (mode == 0 || r->rank == 0)
        r->rc[0] = sh_coll_allreduce(r->c, v, r->rank == 0 ? 10 : 12, &r->e);
    else
        r->rc[0] = sh_coll_allgather(r->c, v, 20, v + 8, &r->e);
    snprintf(r->msg[0], sizeof r->msg[0], "%s", r->e.msg);
    uint64_t t0 = now_ms();
    r->rc[1] = sh_coll_allreduce(r->c, v, 1, &r->e);
    r->ms[1] = now_ms() - t0;
}

static void test_call_mismatch(void)
{
    rank_run runs[2];
    for (int mode = 0; mode < 3; mode++) {
        run_group(runs, 2, 64, sh_test_ms(3000), NULL, NULL, mismatch_body, &mode);
        for (int32_t r = 0; r < 2; r++) {
            CHECK_OK(runs[r].create_rc);
            CHECK_INT_EQ(runs[r].rc[0], SH_EPROTO);
            CHECK_INT_EQ(runs[r].rc[1], SH_EPROTO);
            CHECK(runs[r].ms[1] <= 50);
            fprintf(stderr, "  rank %d: %s\n", (int)r, runs[r].msg[0]);
        }
        if (mode == 0)
            CHECK(strstr(runs[0].msg[0], "48 bytes") && strstr(runs[0].msg[0], "40 bytes"));
        else if (mode == 1)
            CHECK(strstr(runs[0].msg[0], "all-gather of 20") &&
                  strstr(runs[0].msg[0], "all-reduce of 40"));
        else
            CHECK(strstr(runs[0].msg[0], "(root 1)") && strstr(runs[0].msg[0], "(root 0)"));
    }
}

static void expect_einval(sh_err rc, const sh_error *e, const char *word)
{
    CHECK_INT_EQ(rc, SH_EINVAL);
    if (!strstr(e->msg, word))
        SH_FAIL_("\"%s\" does not mention \"%s\"", e->msg, word);
}

static void test_bad_options(void)
{
    sh_coll_inproc *g = NULL;
    sh_error e = {0};
    sh_coll *c = (sh_coll *)1;
    CHECK_OK(sh_coll_inproc_create(2, 64, &g, &e));
    sh_coll_opts o = {.rank = 0, .size = 2, .max_bytes = 64, .inproc = g};
    sh_coll_opts b = o;
    b.size = 0;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "size");
    CHECK(c == NULL);
    b = o;
    b.rank = 2;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "rank 2");
    b.rank = -1;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "rank -1");
    b = o;
    b.max_bytes = 0;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "max_bytes");
    b = o;
    b.inproc = NULL;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "shm_name");
    b = o;
    b.shm_name = "/x";
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "not both");
    b = o;
    b.size = 3;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "3");
    b = o;
    b.max_bytes = 128;
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "128");
    b = o;
    b.inproc = NULL;
    b.shm_name = "no-slash";
    expect_einval(sh_coll_create(SH_COLL_SHM, &b, &c, &e), &e, "no-slash");
    expect_einval(sh_coll_create((sh_coll_kind)9, &o, &c, &e), &e, "kind");
    sh_coll_inproc *g2 = (sh_coll_inproc *)1;
    expect_einval(sh_coll_inproc_create(0, 64, &g2, &e), &e, "size");
    CHECK(g2 == NULL);
    expect_einval(sh_coll_inproc_create(2, 0, &g2, &e), &e, "max_bytes");
    expect_einval(sh_coll_inproc_create(SH_COLL_MAX_RANKS + 1, 64, &g2, &e), &e, "size");
    expect_einval(sh_coll_inproc_create(2, 64, NULL, &e), &e, "out");
    /* the network transport is not built on this branch */
    CHECK_INT_EQ(sh_coll_create(SH_COLL_NET, &o, &c, &e) != SH_OK, 1);
    sh_coll_inproc_destroy(NULL);
    sh_coll_destroy(NULL);

    /* a named rank > 0 whose rank 0 never comes: SH_ETIMEDOUT naming the segment */
    char name[96];
    shm_name(name, sizeof name, "absent");
    b = (sh_coll_opts){.rank = 1, .size = 2, .max_bytes = 64, .timeout_ms = 100, .shm_name = name};
    uint64_t t0 = now_ms();
    CHECK_INT_EQ(sh_coll_create(SH_COLL_SHM, &b, &c, &e), SH_ETIMEDOUT);
    CHECK(now_ms() - t0 < 1000);
    CHECK(strstr(e.msg, name) && strstr(e.msg, "does not exist"));

    /* a call past max_bytes, and a size-1 group */
    sh_coll_inproc *g1 = NULL;
    CHECK_OK(sh_coll_inproc_create(1, 64, &g1, &e));
    b = (sh_coll_opts){.rank = 0, .size = 1, .max_bytes = 64, .inproc = g1};
    CHECK_OK(sh_coll_create(SH_COLL_SHM, &b, &c, &e));
    float v[32] = {3};
    expect_einval(sh_coll_allreduce(c, v, 17, &e), &e, "max_bytes");
    CHECK_OK(sh_coll_allreduce(c, v, 16, &e));
    CHECK(v[0] == 3.0f);
    sh_coll_destroy(c);
    sh_coll_inproc_destroy(g1);
    sh_coll_inproc_destroy(g);
}

static const sh_test_case tests[] = {
    {"allreduce_inproc", test_allreduce_inproc},
    {"allgather_broadcast_inproc", test_allgather_broadcast_inproc},
    {"many_small", test_many_small},
    {"named_processes", test_named_processes},
    {"silent_peer_times_out", test_silent_peer_times_out},
    {"peer_left", test_peer_left},
    {"peer_killed", test_peer_killed},
    {"peer_stopped", test_peer_stopped},
    {"epoch_mismatch", test_epoch_mismatch},
    {"stale_segment", test_stale_segment},
    {"call_mismatch", test_call_mismatch},
    {"bad_options", test_bad_options},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
