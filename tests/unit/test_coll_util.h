/* What the collectives' tests between fork()ed ranks share (test_coll_net.c, test_coll_hier.c):
 * running a case's ranks as child processes, their inputs, and the checks of sums, gathers and
 * broadcasts against references, each call's result hashed into memory every rank shares so that
 * the parent can check that all ranks got the same bits. Include it after defining MAXR,
 * MAXCALLS and the test's own `group`, which must have `int n` and `shared *sh`, `shared` having
 * `uint64_t hash[MAXCALLS][MAXR]`, `int ncalls[MAXR]` and `double err[2]`. */
#ifndef SH_TEST_COLL_UTIL_H
#define SH_TEST_COLL_UTIL_H

#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/coll.h"
#include "sh_test.h"

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

typedef void (*rank_fn)(group *g, int rank);

/* Runs fn in n child processes (rank i in child i) and checks that each exits 0 within
 * limit_ms. `victim` (or -1): a rank that stops or kills itself; it is killed and reaped after
 * the others finish. */
static void run_ranks(group *g, rank_fn fn, int victim, unsigned limit_ms)
{
    pid_t pid[MAXR];
    for (int i = 0; i < g->n; i++) {
        pid[i] = fork();
        CHECK(pid[i] >= 0);
        if (pid[i] == 0) {
            sh_test_failures_ = 0;
            fn(g, i);
            fflush(NULL);
            exit(sh_test_failures_ ? 1 : 0);
        }
    }
    uint64_t end = mono_ms() + sh_test_ms(limit_ms);
    int left = g->n - (victim >= 0 ? 1 : 0);
    bool done[MAXR] = {0};
    while (left > 0 && mono_ms() < end) {
        for (int i = 0; i < g->n; i++) {
            int st;
            if (done[i] || i == victim || waitpid(pid[i], &st, WNOHANG) != pid[i])
                continue;
            done[i] = true;
            left--;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                SH_FAIL_("rank %d ended with status %#x", i, st);
        }
        usleep(2000);
    }
    for (int i = 0; i < g->n; i++) {
        if (done[i])
            continue;
        if (i != victim)
            SH_FAIL_("rank %d did not finish within %u ms", i, limit_ms);
        kill(pid[i], SIGKILL);
        waitpid(pid[i], NULL, 0);
    }
}

/* ---- Data and references ---------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Rank r's input of call k: uniform in [-1, 1). */
static void fill(float *x, size_t n, int r, int k)
{
    uint64_t s = 0x9e3779b97f4a7c15ull ^ ((uint64_t)r << 32) ^ (uint64_t)(k + 1) * 0x1234567ull;
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(rng_next(&s) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static uint64_t hash(const void *p, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}

static void record(group *g, int rank, const void *p, size_t len)
{
    int k = g->sh->ncalls[rank]++;
    if (k < MAXCALLS)
        g->sh->hash[k][rank] = hash(p, len);
}

/* Every rank recorded the same results, call by call. */
static void check_same(const group *g)
{
    CHECK(g->sh->ncalls[0] > 0);
    for (int r = 1; r < g->n; r++) {
        CHECK_INT_EQ(g->sh->ncalls[r], g->sh->ncalls[0]);
        for (int k = 0; k < g->sh->ncalls[0] && k < MAXCALLS; k++)
            if (g->sh->hash[k][r] != g->sh->hash[k][0])
                SH_FAIL_("call %d: rank %d's result differs from rank 0's", k, r);
    }
}

/* One all-reduce of n floats, checked against the double-precision sum: |got - sum| <= tol *
 * sum over ranks of |x| (the scale the rounding errors have), element by element, or (global)
 * <= tol * the largest such sum in the buffer (int8's steps scale with a block's largest value). */
static void allreduce_check(group *g, sh_coll *c, int rank, size_t n, int k, double tol,
                            bool global)
{
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    double *ref = calloc(n, sizeof *ref), *mag = calloc(n, sizeof *mag);
    for (int r = 0; r < g->n; r++) {
        fill(y, n, r, k);
        for (size_t i = 0; i < n; i++) {
            ref[i] += y[i];
            mag[i] += fabs(y[i]);
        }
    }
    fill(x, n, rank, k);
    sh_error e = {0};
    sh_err rc = sh_coll_allreduce(c, x, n, &e);
    if (rc)
        SH_FAIL_("rank %d: all-reduce of %zu floats: %s: %s", rank, n, sh_strerror(rc), e.msg);
    double worst = 0, worst_abs = 0, top = 0, mag_max = 0;
    for (size_t i = 0; i < n; i++)
        mag_max = fmax(mag_max, mag[i]);
    size_t at = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        double d = fabs(x[i] - ref[i]) / (global ? mag_max : mag[i]);
        if (d > worst) {
            worst = d;
            at = i;
        }
        worst_abs = fmax(worst_abs, fabs(x[i] - ref[i]));
        top = fmax(top, fabs(ref[i]));
    }
    if (worst > tol)
        SH_FAIL_("rank %d, n %zu: element %zu is %.9g, the sum %.9g: error %.3g of %s > %.3g", rank,
                 n, at, (double)x[at], ref[at], worst, global ? "max sum |x|" : "sum |x|", tol);
    if (global) { /* report the per-element figure too */
        worst = 0;
        for (size_t i = 0; i < n && !rc; i++)
            worst = fmax(worst, fabs(x[i] - ref[i]) / mag[i]);
    }
    if (rank == 0) {
        g->sh->err[0] = fmax(g->sh->err[0], worst);
        g->sh->err[1] = fmax(g->sh->err[1], top > 0 ? worst_abs / top : 0);
    }
    record(g, rank, x, n * sizeof *x);
    free(x);
    free(y);
    free(ref);
    free(mag);
}

static void allgather_check(group *g, sh_coll *c, int rank, size_t bytes, int k)
{
    uint8_t *in = malloc(bytes), *out = malloc(bytes * (size_t)g->n), *want = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        in[i] = (uint8_t)(i * 31 + (size_t)rank * 7 + (size_t)k);
    sh_error e = {0};
    sh_err rc = sh_coll_allgather(c, in, bytes, out, &e);
    if (rc)
        SH_FAIL_("rank %d: all-gather of %zu bytes: %s: %s", rank, bytes, sh_strerror(rc), e.msg);
    for (int r = 0; r < g->n && !rc; r++) {
        for (size_t i = 0; i < bytes; i++)
            want[i] = (uint8_t)(i * 31 + (size_t)r * 7 + (size_t)k);
        if (memcmp(out + (size_t)r * bytes, want, bytes) != 0)
            SH_FAIL_("rank %d: all-gather of %zu bytes: rank %d's part differs", rank, bytes, r);
    }
    record(g, rank, out, bytes * (size_t)g->n);
    free(in);
    free(out);
    free(want);
}

static void broadcast_check(group *g, sh_coll *c, int rank, size_t bytes, int root)
{
    uint8_t *buf = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        buf[i] = rank == root ? (uint8_t)(i * 13 + 5) : 0xee;
    sh_error e = {0};
    sh_err rc = sh_coll_broadcast(c, buf, bytes, root, &e);
    if (rc)
        SH_FAIL_("rank %d: broadcast of %zu bytes: %s: %s", rank, bytes, sh_strerror(rc), e.msg);
    for (size_t i = 0; i < bytes && !rc; i++)
        if (buf[i] != (uint8_t)(i * 13 + 5)) {
            SH_FAIL_("rank %d: broadcast of %zu bytes from %d: byte %zu is %u", rank, bytes, root,
                     i, buf[i]);
            break;
        }
    record(g, rank, buf, bytes);

#endif
