/* The network collectives (SH_COLL_NET) between fork()ed processes over ipc:// and tcp://: sums,
 * gathers and broadcasts against scalar references and bitwise equal on every rank, compression
 * bounds, dead and stopped peers, a wrong key or epoch, forged frames and bad options. The parent
 * never touches NNG (its threads would not survive fork); every rank, and every injector of
 * forged frames, is a child. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nng/nng.h>

#include <nng/protocol/pipeline0/push.h>

#include "runtime/coll.h"
#include "runtime/coll_net.h"
#include "sh_test.h"

#define MAXR 4
#define MAXCALLS 32

/* Memory every process of a case shares (MAP_SHARED before fork). */
typedef struct shared {
    _Atomic int flag[8];
    uint64_t hash[MAXCALLS][MAXR]; /* each call's result, per rank */
    int ncalls[MAXR];
    double err[2]; /* compression: the largest error seen, relative to sum |x| and to max |sum| */
} shared;

typedef struct group {
    int n;
    char urls[MAXR][128];
    const char *up[MAXR];
    uint32_t epoch[MAXR];
    const char *key[MAXR];
    sh_coll_compress cmp;
    int32_t timeout_ms;
    size_t max_bytes;
    sh_coll_fault_fn fault;
    shared *sh;
} group;

static int case_no;

/* A group of n ranks on ipc:// sockets in /tmp or on free tcp://127.0.0.1 ports. */
static void group_init(group *g, int n, bool tcp)
{
    memset(g, 0, sizeof *g);
    g->n = n;
    g->timeout_ms = 5000;
    g->max_bytes = (size_t)2 << 20;
    case_no++;
    int fds[MAXR];
    for (int i = 0; i < n; i++) {
        if (!tcp) {
            snprintf(g->urls[i], sizeof g->urls[i], "ipc:///tmp/shoal-cn-%d-%d-%d", (int)getpid(),
                     case_no, i);
        } else {
            /* Bind port 0 to learn a free port; keep every socket open until all are known so
             * that the ports differ. */
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
            socklen_t len = sizeof a;
            fds[i] = socket(AF_INET, SOCK_STREAM, 0);
            CHECK(fds[i] >= 0);
            CHECK(bind(fds[i], (struct sockaddr *)&a, sizeof a) == 0);
            CHECK(getsockname(fds[i], (struct sockaddr *)&a, &len) == 0);
            snprintf(g->urls[i], sizeof g->urls[i], "tcp://127.0.0.1:%d", (int)ntohs(a.sin_port));
        }
        g->up[i] = g->urls[i];
    }
    for (int i = 0; tcp && i < n; i++)
        close(fds[i]);
    g->sh = mmap(NULL, sizeof *g->sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(g->sh != MAP_FAILED);
    memset(g->sh, 0, sizeof *g->sh);
}

static void group_fini(group *g)
{
    for (int i = 0; i < g->n; i++)
        if (strncmp(g->urls[i], "ipc://", 6) == 0) {
            char b[160];
            unlink(g->urls[i] + 6);
            snprintf(b, sizeof b, "%sb", g->urls[i] + 6);
            unlink(b);
        }
    munmap(g->sh, sizeof *g->sh);
}

static sh_err rank_create(const group *g, int rank, sh_coll **c, sh_error *e)
{
    sh_coll_opts o = {.rank = rank,
                      .size = g->n,
                      .epoch = g->epoch[rank] ? g->epoch[rank] : 7,
                      .timeout_ms = g->timeout_ms,
                      .max_bytes = g->max_bytes,
                      .urls = g->up,
                      .compress = g->cmp,
                      .key = (const uint8_t *)g->key[rank],
                      .key_len = g->key[rank] ? strlen(g->key[rank]) : 0,
                      .fault = g->fault};
    return sh_coll_create(SH_COLL_NET, &o, c, e);
}
#include "test_coll_util.h"
free(buf);
}

/* ---- Sums, gathers and broadcasts ------------------------------------------------------- */

/* Sizes below, at and above the one-shot threshold (64 KB) and the ring's segments (128 KB). */
static const size_t sizes[] = {1, 1000, 16384, 16385, 100003, 300000};

static void rank_mixed(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    int k = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        allreduce_check(g, c, rank, sizes[i], k++, 1e-6, false);
    allgather_check(g, c, rank, 100, k++);
    allgather_check(g, c, rank, 200003, k++);
    broadcast_check(g, c, rank, 5000, g->n - 1);
    broadcast_check(g, c, rank, 300001, 1);
    allreduce_check(g, c, rank, 1000, k++, 1e-6,
                    false); /* after a broadcast the sequence still agrees */
    sh_coll_stats st;
    sh_coll_stats_get(c, &st);
    CHECK_UINT_EQ(st.calls, 11);
    CHECK_UINT_EQ(st.failures, 0);
    CHECK(st.bytes_wire > 0);
    CHECK_UINT_EQ(sh__coll_net_dropped(c), 0);
    sh_coll_destroy(c);
}

static void mixed(bool tcp, const char *key)
{
    for (int n = 2; n <= 4; n++) {
        group g;
        group_init(&g, n, tcp);
        for (int r = 0; r < n; r++)
            g.key[r] = key;
        uint64_t t0 = mono_ms();
        run_ranks(&g, rank_mixed, -1, 15000);
        check_same(&g);
        fprintf(stderr, "  %d ranks over %s%s: %llu ms\n", n, tcp ? "tcp" : "ipc",
                key ? " (keyed)" : "", (unsigned long long)(mono_ms() - t0));
        group_fini(&g);
    }
}

static void test_ipc(void) { mixed(false, NULL); }

static void test_tcp_keyed(void) { mixed(true, "a cluster key of some length"); }

/* ---- Compression ------------------------------------------------------------------------ */

static double cmp_tol;
static bool cmp_global;

static void rank_compress(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    allreduce_check(g, c, rank, 1000, 0, cmp_tol, cmp_global);   /* one-shot */
    allreduce_check(g, c, rank, 300000, 1, cmp_tol, cmp_global); /* ring */
    sh_coll_stats st;
    sh_coll_stats_get(c, &st);
    /* What crossed the links is smaller than f32 would be: a ring sends about 2 (n - 1) / n of
     * the buffer, one-shot (n - 1) buffers. */
    double f32 = (1000.0 * (g->n - 1) + 300000.0 * 2 * (g->n - 1) / g->n) * 4;
    double want = g->cmp == SH_COLL_COMPRESS_F16 ? 0.5 : 0.27;
    /* Less what a loaded machine made the ranks ask for again (a slow frame looks lost). */
    uint64_t nacks, resent, rbytes;
    sh__coll_net_resends(c, &nacks, &resent, &rbytes);
    st.bytes_wire -= rbytes;
    if (!(st.bytes_wire < f32 * want + 100000))
        SH_FAIL_("rank %d: %llu bytes on the wire, f32 would be %.0f", rank,
                 (unsigned long long)st.bytes_wire, f32);
    sh_coll_destroy(c);
}

static void test_compress(void)
{
    /* Each hop of a value rounds it once, and a ring of n ranks has n hops per value (n - 1
     * partial sums and the final value; one-shot: each contribution once). f16 rounds to 2^-11
     * of the value, so the error is at most n 2^-11 of the element's sum |x| over the ranks;
     * int8 to half a step, max |block| / 254, so at most n / 254 of the buffer's largest sum
     * |x|. */
    const struct {
        sh_coll_compress cmp;
        const char *name;
        double per_hop;
    } kinds[] = {{SH_COLL_COMPRESS_F16, "f16", 0x1p-11},
                 {SH_COLL_COMPRESS_INT8, "int8", 1.0 / 254}};
    for (size_t k = 0; k < 2; k++) {
        group g;
        group_init(&g, 3, false);
        g.cmp = kinds[k].cmp;
        cmp_global = kinds[k].cmp == SH_COLL_COMPRESS_INT8;
        cmp_tol = kinds[k].per_hop * 3 * 1.01;
        run_ranks(&g, rank_compress, -1, 15000);
        check_same(&g);
        fprintf(
            stderr,
            "  %s, 3 ranks: largest error %.3g of the element's sum |x|, %.3g of the buffer's max "
            "|sum| (bound %.3g of %s)\n",
            kinds[k].name, g.sh->err[0], g.sh->err[1], cmp_tol,
            cmp_global ? "the buffer's max sum |x|" : "sum |x|");
        group_fini(&g);
    }
}

/* ---- Mismatched calls ------------------------------------------------------------------- */

static void rank_mismatch(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    float x[2000] = {0};
    /* Call 1: sizes differ (1000 and 2000 floats). */
    rc = sh_coll_allreduce(c, x, rank == 0 ? 1000 : 2000, &e);
    CHECK_INT_EQ(rc, SH_EPROTO);
    char want[128];
    snprintf(want, sizeof want, "rank %d passed %d floats, this rank %d passed %d", 1 - rank,
             rank == 0 ? 2000 : 1000, rank, rank == 0 ? 1000 : 2000);
    if (!strstr(e.msg, want))
        SH_FAIL_("rank %d: \"%s\" does not say \"%s\"", rank, e.msg, want);
    /* The group is broken now: the next call fails at once with the same code. */
    uint64_t t0 = mono_ms();
    CHECK_INT_EQ(sh_coll_allreduce(c, x, 10, &e), SH_EPROTO);
    CHECK(mono_ms() - t0 < 100);
    sh_coll_destroy(c);
    /* A new group (another epoch) where the ops differ, on other URLs (the recreate case covers
     * the same URLs). */
    g->epoch[rank] = 8;
    for (int i = 0; i < g->n; i++)
        strcat(g->urls[i], "b");
    rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    if (rank == 0)
        rc = sh_coll_allreduce(c, x, 100, &e);
    else
        rc = sh_coll_allgather(c, x, 400, x + 1000, &e);
    CHECK_INT_EQ(rc, SH_EPROTO);
    if (!strstr(e.msg, rank == 0 ? "rank 1 called all-gather, this rank 0 all-reduce"
                                 : "rank 0 called all-reduce, this rank 1 all-gather"))
        SH_FAIL_("rank %d: \"%s\" does not name the other op", rank, e.msg);
    sh_coll_destroy(c);
}

static void test_mismatch(void)
{
    group g;
    group_init(&g, 2, false);
    run_ranks(&g, rank_mismatch, -1, 10000);
    group_fini(&g);
}

/* ---- Dead and stopped peers ------------------------------------------------------------- */

static int victim_sig;
static size_t victim_n;

static void rank_victim(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    allreduce_check(g, c, rank, victim_n, 0, 1e-6, false);
    if (rank == g->n - 1) {
        usleep(200000);    /* its last frames of call 1 leave (the others' call 1 needs them) */
        raise(victim_sig); /* SIGKILL ends here; SIGSTOP stops until the parent kills it */
    }
    float *x = calloc(victim_n, sizeof *x);
    uint64_t t0 = mono_ms();
    rc = sh_coll_allreduce(c, x, victim_n, &e);
    uint64_t took = mono_ms() - t0;
    if (victim_sig == SIGKILL) {
        /* Its connections close with it: SH_ECLOSED long before the timeout. */
        CHECK_INT_EQ(rc, SH_ECLOSED);
        if (took > sh_test_ms(1000))
            SH_FAIL_("rank %d: the call failed after %llu ms", rank, (unsigned long long)took);
        if (!strstr(e.msg, "rank 2") || !strstr(e.msg, "closed its connection"))
            SH_FAIL_("rank %d: \"%s\" does not name rank 2", rank, e.msg);
    } else {
        CHECK_INT_EQ(rc, SH_ETIMEDOUT);
        if (took < (uint64_t)g->timeout_ms - 50 ||
            took > (uint64_t)g->timeout_ms + sh_test_ms(1500))
            SH_FAIL_("rank %d: the call failed after %llu ms (timeout %d)", rank,
                     (unsigned long long)took, (int)g->timeout_ms);
        if (!strstr(e.msg, "waited") || !strstr(e.msg, "for rank"))
            SH_FAIL_("rank %d: \"%s\" names no rank", rank, e.msg);
    }
    fprintf(stderr, "  rank %d after %llu ms: %s\n", rank, (unsigned long long)took, e.msg);
    t0 = mono_ms();
    CHECK_INT_EQ(sh_coll_allreduce(c, x, victim_n, &e), rc); /* broken: at once, same code */
    CHECK(mono_ms() - t0 < 100);
    free(x);
    t0 = mono_ms();
    sh_coll_destroy(c);
    CHECK(mono_ms() - t0 < 1000);
}

static void test_dead_peer(void)
{
    const struct {
        int sig;
        size_t n;
    } v[] = {{SIGKILL, 1000}, {SIGSTOP, 100003}};
    for (int i = 0; i < 2; i++) {
        group g;
        group_init(&g, 3, i == 1);
        g.timeout_ms = v[i].sig == SIGKILL ? 4000 : 1000;
        victim_sig = v[i].sig;
        victim_n = v[i].n;
        run_ranks(&g, rank_victim, 2, 10000);
        group_fini(&g);
    }
}

/* ---- Join failures ---------------------------------------------------------------------- */

static void rank_wrong_key(group *g, int rank)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/shoal-cn-log-%d-%d", (int)getpid(), rank);
    FILE *log = fopen(path, "w+");
    CHECK(log != NULL);
    int saved = dup(2);
    dup2(fileno(log), 2);
    sh_coll *c = NULL;
    sh_error e = {0};
    uint64_t t0 = mono_ms();
    sh_err rc = rank_create(g, rank, &c, &e);
    uint64_t took = mono_ms() - t0;
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    CHECK(c == NULL);
    CHECK(took < (uint64_t)g->timeout_ms + 1000);
    if (!strstr(e.msg, "failed the cluster key check"))
        SH_FAIL_("rank %d: \"%s\" does not say the key check failed", rank, e.msg);
    char text[4096] = {0};
    rewind(log);
    size_t got = fread(text, 1, sizeof text - 1, log);
    (void)got;
    fclose(log);
    unlink(path);
    if (!strstr(text, g->urls[1 - rank]) || !strstr(text, "cluster key"))
        SH_FAIL_("rank %d: the log does not name the peer %s: %s", rank, g->urls[1 - rank], text);
}

static void test_wrong_key(void)
{
    group g;
    group_init(&g, 2, true);
    g.timeout_ms = 1000;
    g.key[0] = "the right key, long enough";
    g.key[1] = "the wrong key, long enough";
    run_ranks(&g, rank_wrong_key, -1, 8000);
    group_fini(&g);
}

static void rank_wrong_epoch(group *g, int rank)
{
    sh_coll *c = NULL;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    if (!strstr(e.msg, "did not join") || !strstr(e.msg, "another epoch") ||
        !strstr(e.msg, g->urls[1 - rank]))
        SH_FAIL_("rank %d: \"%s\"", rank, e.msg);
}

static void test_wrong_epoch(void)
{
    group g;
    group_init(&g, 2, false);
    g.timeout_ms = 700;
    g.epoch[1] = 9;
    run_ranks(&g, rank_wrong_epoch, -1, 8000);
    group_fini(&g);
}

/* ---- Forged frames ---------------------------------------------------------------------- */

/* flag[0]: ranks created; flag[1]: injector sent the first batch; flag[2]: rank 0 is done with
 * call 1; flag[3]: injector sent the wrong-size frame. */
static void wait_flag(shared *sh, int i, int v)
{
    uint64_t end = mono_ms() + 8000;
    while (atomic_load(&sh->flag[i]) < v && mono_ms() < end)
        usleep(1000);
    CHECK(atomic_load(&sh->flag[i]) >= v);
}

static void forge(nng_socket s, uint8_t type, uint32_t epoch, uint16_t src, uint64_t seq,
                  uint64_t total, uint32_t count, bool bad_crc)
{
    size_t plen = (size_t)count * sizeof(float);
    uint8_t *f = calloc(1, SH__COLL_NET_HDR + plen);
    float big = 1e30f;
    for (uint32_t i = 0; i < count; i++)
        memcpy(f + SH__COLL_NET_HDR + 4 * i, &big, 4);
    sh__coll_net_hdr h = {.type = type,
                          .op = SH__COLL_OP_ALLREDUCE,
                          .epoch = epoch,
                          .src = src,
                          .size = 2,
                          .seq = seq,
                          .total = total,
                          .count = count};
    sh__coll_net_seal(&h, f, plen);
    if (bad_crc)
        f[SH__COLL_NET_HDR + 1] ^= 1;
    CHECK_INT_EQ(nng_send(s, f, SH__COLL_NET_HDR + plen, 0), 0);
    free(f);
}

static bool forged_keyed;

static void rank_forged(group *g, int rank)
{
    shared *sh = g->sh;
    if (rank == 2) { /* the injector: a raw push socket to rank 0 */
        nng_socket s;
        wait_flag(sh, 0, 2);
        CHECK_INT_EQ(nng_push0_open(&s), 0);
        CHECK_INT_EQ(nng_dial(s, g->urls[0], NULL, 0), 0);
        uint8_t junk[10] = {1, 2, 3};
        CHECK_INT_EQ(nng_send(s, junk, sizeof junk, 0), 0);
        forge(s, SH__COLL_NET_DATA, 99, 1, 1, 100, 100, false);   /* another epoch */
        forge(s, SH__COLL_NET_DATA, 7, 1, 1, 100, 100, true);     /* a bad CRC */
        forge(s, SH__COLL_NET_DATA, 7, 1, 0, 100, 100, false);    /* an older call */
        forge(s, SH__COLL_NET_DATA, 7, 1, 1000, 100, 100, false); /* too far ahead */
        forge(s, SH__COLL_NET_DATA, 7, 5, 1, 100, 100, false);    /* no such rank */
        if (forged_keyed)                                         /* right but unproved */
            forge(s, SH__COLL_NET_DATA, 7, 1, 1, 100, 100, false);
        usleep(100000);
        atomic_store(&sh->flag[1], 1);
        if (!forged_keyed) {
            wait_flag(sh, 2, 1);
            forge(s, SH__COLL_NET_DATA, 7, 1, 2, 7, 7, false); /* call 2, the wrong size */
            usleep(100000);
            atomic_store(&sh->flag[3], 1);
        }
        nng_close(s);
        return;
    }
    sh_coll *c;
    sh_error e = {0};
    g->n = 2; /* the injector is no rank */
    sh_err rc = rank_create(g, rank, &c, &e);
    g->n = 3;
    atomic_fetch_add(&sh->flag[0], 1);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    wait_flag(sh, 1, 1);
    if (rank == 1)
        usleep(300000); /* rank 0 reads every forged frame while it waits for this one */
    float x[100];
    for (int i = 0; i < 100; i++)
        x[i] = (float)(rank + 1);
    rc = sh_coll_allreduce(c, x, 100, &e);
    if (rc)
        SH_FAIL_("rank %d: call 1: %s: %s", rank, sh_strerror(rc), e.msg);
    CHECK(x[0] == 3.0f && x[99] == 3.0f);
    if (rank == 0)
        CHECK_UINT_EQ(sh__coll_net_dropped(c), forged_keyed ? 7 : 6);
    if (!forged_keyed) {
        if (rank == 0)
            atomic_store(&sh->flag[2], 1);
        wait_flag(sh, 3, 1);
        if (rank == 1)
            usleep(300000);
        rc = sh_coll_allreduce(c, x, 100, &e);
        if (rank == 0) {
            CHECK_INT_EQ(rc, SH_EPROTO);
            if (!strstr(e.msg, "rank 1 passed 7 floats, this rank 0 passed 100"))
                SH_FAIL_("rank 0: \"%s\"", e.msg);
        }
    }
    sh_coll_destroy(c);
}

static void forged(bool keyed)
{
    group g;
    group_init(&g, 3, false);
    g.key[0] = g.key[1] = keyed ? "a cluster key of some length" : NULL;
    forged_keyed = keyed;
    run_ranks(&g, rank_forged, -1, 10000);
    group_fini(&g);
}

static void test_forged(void) { forged(false); }

static void test_forged_keyed(void) { forged(true); }

/* ---- Options ---------------------------------------------------------------------------- */

static void expect_create(const char *const *urls, int size, sh_err want, const char *text)
{
    sh_coll_opts o = {.rank = 0, .size = size, .max_bytes = 1024, .timeout_ms = 300, .urls = urls};
    sh_coll *c = (sh_coll *)1;
    sh_error e = {0};
    CHECK_INT_EQ(sh_coll_create(SH_COLL_NET, &o, &c, &e), want);
    CHECK(c == NULL);
    if (!strstr(e.msg, text))
        SH_FAIL_("\"%s\" does not say \"%s\"", e.msg, text);
}

static void rank_options(group *g, int rank)
{
    (void)rank;
    expect_create(NULL, 2, SH_EINVAL, "urls is NULL");
    const char *one_null[] = {g->urls[0], NULL};
    expect_create(one_null, 2, SH_EINVAL, "urls[1] is NULL");
    const char *tls[] = {g->urls[0], "tls+tcp://127.0.0.1:1"};
    expect_create(tls, 2, SH_EINVAL, "with TLS every rank must listen on tls+tcp://");
    const char *tls_only[] = {"tls+tcp://127.0.0.1:1", "tls+tcp://127.0.0.1:2"};
    expect_create(tls_only, 2, SH_EINVAL, "tls+tcp:// needs sh_coll_opts.tls");
    const char *http[] = {"http://x", g->urls[0]};
    expect_create(http, 2, SH_EINVAL, "not an ipc://, tcp:// or tls+tcp:// URL");
    const char *twice[] = {g->urls[0], g->urls[0]};
    expect_create(twice, 2, SH_EINVAL, "same URL");
    const char *nodir[] = {"ipc:///nonexistent-shoal-dir/x", g->urls[0]};
    expect_create(nodir, 2, SH_EIO, "cannot listen on ipc:///nonexistent-shoal-dir/x");
    const char *foreign[] = {"tcp://192.0.2.1:4000", g->urls[0]};
    expect_create(foreign, 2, SH_EIO, "cannot listen on tcp://192.0.2.1:4000");
    sh_coll_opts o = {.rank = 0, .size = 1, .max_bytes = 64, .urls = g->up};
    sh_coll *c;
    CHECK_OK(sh_coll_create(SH_COLL_NET, &o, &c, NULL));
    float x[4] = {1, 2, 3, 4};
    CHECK_OK(sh_coll_allreduce(c, x, 4, NULL));
    CHECK(x[3] == 4.0f);
    sh_coll_destroy(c);
}

static void test_options(void)
{
    group g;
    group_init(&g, 1, false);
    run_ranks(&g, rank_options, -1, 8000);
    group_fini(&g);
}

/* ---- Lost frames ------------------------------------------------------------------------ */

/* The fault hook of the lossy cases: drops loss_p of the frames and duplicates dup_p, drawn from
 * a generator seeded per rank (called on the calling thread and NNG's, hence the lock). */
static double loss_p, dup_p;
static uint64_t loss_s;
static pthread_mutex_t loss_mu = PTHREAD_MUTEX_INITIALIZER;

static sh_coll_fault lossy(void *ud, int32_t peer)
{
    (void)ud;
    (void)peer;
    pthread_mutex_lock(&loss_mu);
    double u = (double)(rng_next(&loss_s) >> 11) * 0x1p-53;
    pthread_mutex_unlock(&loss_mu);
    return u < loss_p           ? SH_COLL_FAULT_DROP
           : u < loss_p + dup_p ? SH_COLL_FAULT_DUPLICATE
                                : SH_COLL_FAULT_PASS;
}

/* rank_mixed's calls, three times over, none failing, then one lossless all-reduce. */
static void rank_lossy(group *g, int rank)
{
    loss_s = 0x2545f4914f6cdd1dull ^ ((uint64_t)rank << 20) ^ (uint64_t)(loss_p * 1000);
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    int k = 0;
    for (int rep = 0; rep < 3; rep++) {
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            allreduce_check(g, c, rank, sizes[i], k++, 1e-6, false);
        allgather_check(g, c, rank, 100, k++);
        allgather_check(g, c, rank, 200003, k++);
        broadcast_check(g, c, rank, 5000, g->n - 1);
        broadcast_check(g, c, rank, 300001, 1);
    }
    /* A frame lost in a rank's last call before its destroy cannot be asked for again (the rank
     * has gone): the last call is lossless, and a barrier, since every rank needs every other
     * rank's contribution to it, having ended the calls before. */
    pthread_mutex_lock(&loss_mu);
    loss_p = dup_p = 0;
    pthread_mutex_unlock(&loss_mu);
    allreduce_check(g, c, rank, 1000, k++, 1e-6, false);
    sh_coll_stats st;
    sh_coll_stats_get(c, &st);
    CHECK_UINT_EQ(st.calls, 31);
    CHECK_UINT_EQ(st.failures, 0);
    uint64_t nacks, resent, rbytes;
    sh__coll_net_resends(c, &nacks, &resent, &rbytes);
    if (rank == 0)
        fprintf(stderr, "  rank 0: %llu frames asked for again, %llu resent\n",
                (unsigned long long)nacks, (unsigned long long)resent);
    sh_coll_destroy(c);
}

/* With 1% and 10% of the frames lost (and 1% duplicated) every call succeeds, and its result is
 * bit for bit the lossless run's (which equals the f32 sums within rounding, checked by
 * allreduce_check); 2 and 3 ranks. */
static void test_lossy(void)
{
    static const double ps[] = {0, 0.01, 0.10};
    for (int n = 2; n <= 3; n++) {
        uint64_t ref[MAXCALLS][MAXR];
        int ref_calls = 0;
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
            group g;
            group_init(&g, n, false);
            g.fault = lossy;
            loss_p = ps[i]; /* before the fork: each rank's copy */
            dup_p = ps[i] > 0 ? 0.01 : 0;
            uint64_t t0 = mono_ms();
            run_ranks(&g, rank_lossy, -1, 30000);
            check_same(&g);
            if (i == 0) {
                memcpy(ref, g.sh->hash, sizeof ref);
                ref_calls = g.sh->ncalls[0];
            } else {
                CHECK_INT_EQ(g.sh->ncalls[0], ref_calls);
                for (int k = 0; k < ref_calls && k < MAXCALLS; k++)
                    if (g.sh->hash[k][0] != ref[k][0])
                        SH_FAIL_("%d ranks, loss %.0f%%: call %d differs from the lossless run", n,
                                 ps[i] * 100, k);
            }
            fprintf(stderr, "  %d ranks, loss %.0f%%: %llu ms\n", n, ps[i] * 100,
                    (unsigned long long)(mono_ms() - t0));
            group_fini(&g);
        }
    }
}

/* Compressed all-reduces (one-shot and ring) with frames lost, then one lossless: a frame sent
 * again is encoded again from the same floats (a ring's first frames are kept without a copy,
 * coll_net_algo.c), so every result is bit for bit the lossless run's. */
static void rank_lossy_compress(group *g, int rank)
{
    loss_s = 0x9e3779b97f4a7c15ull ^ ((uint64_t)rank << 20) ^ (uint64_t)(loss_p * 1000);
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    for (int k = 0; k < 6; k++)
        allreduce_check(g, c, rank, k % 2 ? 300000 : 1000, k, cmp_tol, cmp_global);
    pthread_mutex_lock(&loss_mu);
    loss_p = dup_p = 0;
    pthread_mutex_unlock(&loss_mu);
    allreduce_check(g, c, rank, 1000, 6, cmp_tol, cmp_global);
    sh_coll_destroy(c);
}

static void test_lossy_compress(void)
{
    const struct {
        sh_coll_compress cmp;
        double per_hop; /* see test_compress */
    } kinds[] = {{SH_COLL_COMPRESS_F16, 0x1p-11}, {SH_COLL_COMPRESS_INT8, 1.0 / 254}};
    for (size_t k = 0; k < 2; k++)
        for (int n = 2; n <= 3; n++) {
            uint64_t ref[MAXCALLS][MAXR];
            int ref_calls = 0;
            for (int lossy_run = 0; lossy_run < 2; lossy_run++) {
                group g;
                group_init(&g, n, false);
                g.cmp = kinds[k].cmp;
                g.fault = lossy;
                cmp_global = kinds[k].cmp == SH_COLL_COMPRESS_INT8;
                cmp_tol = kinds[k].per_hop * n * 1.01;
                loss_p = lossy_run ? 0.10 : 0; /* before the fork: each rank's copy */
                dup_p = lossy_run ? 0.01 : 0;
                run_ranks(&g, rank_lossy_compress, -1, 30000);
                check_same(&g);
                if (!lossy_run) {
                    memcpy(ref, g.sh->hash, sizeof ref);
                    ref_calls = g.sh->ncalls[0];
                } else {
                    CHECK_INT_EQ(g.sh->ncalls[0], ref_calls);
                    for (int i = 0; i < ref_calls && i < MAXCALLS; i++)
                        if (g.sh->hash[i][0] != ref[i][0])
                            SH_FAIL_("%s, %d ranks, loss 10%%: call %d differs from the lossless "
                                     "run",
                                     k ? "int8" : "f16", n, i);
                }
                group_fini(&g);
            }
        }
}

/* Every frame lost: the call fails at the timeout, naming the rank it waited for. */
static void rank_all_lost(group *g, int rank)
{
    loss_s = 0x9e3779b97f4a7c15ull + (uint64_t)rank;
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    float x[100] = {0};
    uint64_t t0 = mono_ms();
    rc = sh_coll_allreduce(c, x, 100, &e);
    uint64_t took = mono_ms() - t0;
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    char want[64];
    snprintf(want, sizeof want, "waited 1000 ms for rank %d", 1 - rank);
    if (!strstr(e.msg, want))
        SH_FAIL_("rank %d: \"%s\" does not say \"%s\"", rank, e.msg, want);
    CHECK(took >= 990 && took < 3000);
    uint64_t nacks, resent, rbytes;
    sh__coll_net_resends(c, &nacks, &resent, &rbytes);
    CHECK(nacks >= 5); /* asked again and again, the gap growing */
    sh_coll_destroy(c);
}

static void test_all_lost(void)
{
    group g;
    group_init(&g, 2, false);
    g.fault = lossy;
    g.timeout_ms = 1000;
    loss_p = 1.0;
    dup_p = 0;
    run_ranks(&g, rank_all_lost, -1, 10000);
    group_fini(&g);
}

/* ---- Re-created on the same URLs ------------------------------------------------------- */

/* 50 groups one after the other on the same URLs, as the stage re-forms its group after a
 * failure (a new epoch each time): every create joins and its all-reduce succeeds. */
static void rank_recreate(group *g, int rank)
{
    int failed = 0;
    for (int k = 0; k < 50 && failed < 3; k++) {
        g->epoch[rank] = 100 + (uint32_t)k;
        sh_coll *c;
        sh_error e = {0};
        uint64_t t0 = mono_ms();
        sh_err rc = rank_create(g, rank, &c, &e);
        if (rc) {
            SH_FAIL_("rank %d, group %d: create: %s: %s", rank, k, sh_strerror(rc), e.msg);
            failed++;
            continue;
        }
        if (mono_ms() - t0 > 1000)
            fprintf(stderr, "  rank %d, group %d: joined after %llu ms\n", rank, k,
                    (unsigned long long)(mono_ms() - t0));
        float x[64];
        for (int i = 0; i < 64; i++)
            x[i] = (float)(rank + k);
        rc = sh_coll_allreduce(c, x, 64, &e);
        if (rc)
            SH_FAIL_("rank %d, group %d: all-reduce: %s: %s", rank, k, sh_strerror(rc), e.msg);
        else if (x[0] != (float)(2 * k + 1))
            SH_FAIL_("rank %d, group %d: sum %g, want %d", rank, k, (double)x[0], 2 * k + 1);
        sh_coll_destroy(c);
    }
}

static void test_recreate(void)
{
#if defined(__SANITIZE_ADDRESS__)
    /* When a join re-opens a stuck listener (the work-around in coll_net.c), NNG 1.5.2 leaks the
     * one it abandons (about 12 KB of its own objects, reported at exit in 1 run of 3 under
     * LeakSanitizer even after nng_fini). The Release run covers this case. */
    printf("skip: recreate under AddressSanitizer (NNG 1.5.2 leaks an abandoned listener)\n");
    return;
#endif
    group g;
    group_init(&g, 2, false);
    g.timeout_ms = 3000;
    uint64_t t0 = mono_ms();
    run_ranks(&g, rank_recreate, -1, 60000);
    fprintf(stderr, "  50 groups on the same URLs: %llu ms\n",
            (unsigned long long)(mono_ms() - t0));
    group_fini(&g);
}

static const sh_test_case tests[] = {
    {"lossy", test_lossy},
    {"lossy_compress", test_lossy_compress},
    {"recreate", test_recreate},
    {"all_lost", test_all_lost},
    {"ipc", test_ipc},
    {"tcp_keyed", test_tcp_keyed},
    {"compress", test_compress},
    {"mismatch", test_mismatch},
    {"dead_peer", test_dead_peer},
    {"wrong_key", test_wrong_key},
    {"wrong_epoch", test_wrong_epoch},
    {"forged", test_forged},
    {"forged_keyed", test_forged_keyed},
    {"options", test_options},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    return sh_test_main(argc, argv, tests);
}
