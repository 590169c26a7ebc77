/* The two-level collectives (SH_COLL_HIER) between fork()ed processes: 4 ranks as 2 "hosts" of 2
 * (and 3 + 1 with the hosts' ranks interleaved), the host ids passed explicitly so one machine
 * plays several; real segments in /dev/shm, real NNG sockets on ipc://. Sums against scalar
 * references and bitwise equal on every rank, gathers, broadcasts from every root, compression,
 * lost frames between the leaders, a killed leader and a killed non-leader, a stopped rank, a
 * mismatched call, a wrong epoch and bad options. The parent never touches NNG (its threads would
 * not survive fork): every rank is a child. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/coll.h"
#include "sh_test.h"

#define MAXR 4
#define MAXCALLS 40

/* Memory every process of a case shares (MAP_SHARED before fork). */
typedef struct shared {
    uint64_t hash[MAXCALLS][MAXR]; /* each call's result, per rank */
    _Atomic int asked[MAXR][MAXR]; /* lossy: [rank][peer] frames the fault hook was asked about */
    int ncalls[MAXR];
    double err[2];
} shared;

typedef struct group {
    int n;
    char urls[MAXR][128];
    const char *up[MAXR];
    int32_t hosts[MAXR];
    uint32_t epoch[MAXR];
    char shm[64];
    sh_coll_compress cmp;
    sh_coll_fault_fn fault;
    int32_t timeout_ms;
    size_t max_bytes;
    shared *sh;
} group;

static int case_no;

/* A group of n ranks on ipc:// sockets in /tmp, rank r on host hosts[r]. */
static void group_init(group *g, int n, const int32_t *hosts)
{
    memset(g, 0, sizeof *g);
    g->n = n;
    g->timeout_ms = 5000;
    g->max_bytes = (size_t)2 << 20;
    case_no++;
    snprintf(g->shm, sizeof g->shm, "/shoal-ch-%d-%d", (int)getpid(), case_no);
    for (int i = 0; i < n; i++) {
        snprintf(g->urls[i], sizeof g->urls[i], "ipc:///tmp/shoal-ch-%d-%d-%d", (int)getpid(),
                 case_no, i);
        g->up[i] = g->urls[i];
        g->hosts[i] = hosts[i];
    }
    g->sh = mmap(NULL, sizeof *g->sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(g->sh != MAP_FAILED);
    memset(g->sh, 0, sizeof *g->sh);
}

static void group_fini(group *g)
{
    for (int i = 0; i < g->n; i++) {
        char b[160];
        unlink(g->urls[i] + 6);
        snprintf(b, sizeof b, "%sb", g->urls[i] + 6);
        unlink(b);
        /* a killed leader leaves its host's segment behind */
        snprintf(b, sizeof b, "%s-h%d", g->shm, i);
        shm_unlink(b);
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
                      .shm_name = g->shm,
                      .urls = g->up,
                      .hosts = g->hosts,
                      .compress = g->cmp,
                      .fault = g->fault,
                      .fault_ud = (void *)g};
    return sh_coll_create(SH_COLL_HIER, &o, c, e);
}
#include "test_coll_util.h"
free(buf);
}

/* An all-reduce of small integers (exact in f32 whatever the order): equal to the plain sum. */
static void allreduce_exact(group *g, sh_coll *c, int rank, size_t n)
{
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((int)((i * 7 + (size_t)rank * 13) % 41) - 20);
    sh_error e = {0};
    sh_err rc = sh_coll_allreduce(c, x, n, &e);
    if (rc)
        SH_FAIL_("rank %d: all-reduce of %zu floats: %s: %s", rank, n, sh_strerror(rc), e.msg);
    for (size_t i = 0; i < n && !rc; i++) {
        float want = 0;
        for (int r = 0; r < g->n; r++)
            want += (float)((int)((i * 7 + (size_t)r * 13) % 41) - 20);
        if (x[i] != want) {
            SH_FAIL_("rank %d, n %zu: element %zu is %g, the plain sum %g", rank, n, i,
                     (double)x[i], (double)want);
            break;
        }
    }
    record(g, rank, x, n * sizeof *x);
    free(x);
}

/* ---- Sums, gathers and broadcasts ------------------------------------------------------- */

/* Sizes below and above the network's one-shot threshold (64 KB) and ring segments (128 KB). */
static const size_t sizes[] = {1, 1000, 16385, 100003, 300000};

static void rank_mixed(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    CHECK_INT_EQ(sh_coll_rank(c), rank);
    CHECK_INT_EQ(sh_coll_size(c), g->n);
    int k = 0, calls = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++, calls++)
        allreduce_check(g, c, rank, sizes[i], k++, 1e-6, false);
    allreduce_exact(g, c, rank, 1000);
    allreduce_exact(g, c, rank, 200000);
    allgather_check(g, c, rank, 1, k++);
    allgather_check(g, c, rank, 100, k++);
    allgather_check(g, c, rank, 120001, k++);
    calls += 5;
    for (int root = 0; root < g->n; root++, calls += 2) {
        broadcast_check(g, c, rank, 5000, root);
        broadcast_check(g, c, rank, 300001, root);
    }
    allreduce_check(g, c, rank, 1000, k++, 1e-6, false); /* the sequences still agree */
    calls++;
    sh_coll_stats st;
    sh_coll_stats_get(c, &st);
    CHECK_UINT_EQ(st.calls, (uint64_t)calls);
    CHECK_UINT_EQ(st.failures, 0);
    /* Only leaders send on the network, when there are several hosts. */
    bool leader = true, hosts = false;
    for (int r = 0; r < g->n; r++) {
        leader = leader && (r >= rank || g->hosts[r] != g->hosts[rank]);
        hosts = hosts || g->hosts[r] != g->hosts[0];
    }
    if (leader && hosts)
        CHECK(st.bytes_wire > 0);
    else
        CHECK_UINT_EQ(st.bytes_wire, 0);
    sh_coll_destroy(c);
}

static void mixed(const int32_t *hosts, const char *what)
{
    group g;
    group_init(&g, 4, hosts);
    uint64_t t0 = mono_ms();
    run_ranks(&g, rank_mixed, -1, 30000);
    check_same(&g);
    fprintf(stderr, "  4 ranks, %s: %llu ms\n", what, (unsigned long long)(mono_ms() - t0));
    group_fini(&g);
}

static void test_two_by_two(void)
{
    static const int32_t hosts[] = {10, 10, 20, 20};
    mixed(hosts, "hosts 2 x 2");
}

/* Host 5 holds ranks 0, 2 and 3, host 9 rank 1 alone (no segment there): rank order differs
 * from host order, and the leaders' all-gather pads host 9. */
static void test_uneven(void)
{
    static const int32_t hosts[] = {5, 9, 5, 5};
    mixed(hosts, "hosts 3 + 1, interleaved");
}

/* One host: the shared-memory group alone, no sockets. */
static void test_one_host(void)
{
    static const int32_t hosts[] = {3, 3, 3, 3};
    mixed(hosts, "one host");
}

static void rank_compress(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    /* f16 rounds a value to 2^-11 at each hop between the 2 leaders (test_coll_net's bound for
     * a ring of n ranks is n hops: n - 1 partial sums and the final value; one more here for
     * margin), each host's sum at most its sum of |x|. */
    allreduce_check(g, c, rank, 1000, 0, 3 * 0x1p-11 * 1.01, false);   /* one-shot */
    allreduce_check(g, c, rank, 300000, 1, 3 * 0x1p-11 * 1.01, false); /* ring */
    sh_coll_destroy(c);
}

static void test_compress(void)
{
    static const int32_t hosts[] = {0, 0, 1, 1};
    group g;
    group_init(&g, 4, hosts);
    g.cmp = SH_COLL_COMPRESS_F16;
    run_ranks(&g, rank_compress, -1, 20000);
    check_same(&g);
    group_fini(&g);
}

/* ---- Lost frames between the leaders -------------------------------------------------- */

static int lossy_rank;
static uint64_t lossy_state;
static bool lossy_off;
static pthread_mutex_t lossy_mu = PTHREAD_MUTEX_INITIALIZER;

/* Drops about 1 frame in 20, and notes the peer it is asked about: a global rank. */
static sh_coll_fault lossy(void *ud, int32_t peer)
{
    group *g = ud;
    if (peer >= 0 && peer < MAXR)
        atomic_fetch_add(&g->sh->asked[lossy_rank][peer], 1);
    pthread_mutex_lock(&lossy_mu); /* asked on the calling thread and on NNG's */
    bool drop = rng_next(&lossy_state) % 20 == 0 && !lossy_off;
    pthread_mutex_unlock(&lossy_mu);
    return drop ? SH_COLL_FAULT_DROP : SH_COLL_FAULT_PASS;
}

static void rank_lossy(group *g, int rank)
{
    lossy_rank = rank;
    lossy_state = 0x5eed0000u + (uint64_t)rank;
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    for (int k = 0; k < 6; k++)
        allreduce_check(g, c, rank, k % 2 ? 100003 : 1000, k, 1e-6, false);
    allgather_check(g, c, rank, 5000, 6);
    broadcast_check(g, c, rank, 70000, 3);
    /* A frame lost in a leader's last call before its destroy cannot be asked for again (the
     * leader has gone; runtime/coll.h): the last call is lossless, and a barrier among the
     * leaders, as test_coll_net's lossy case ends. */
    pthread_mutex_lock(&lossy_mu);
    lossy_off = true;
    pthread_mutex_unlock(&lossy_mu);
    allreduce_check(g, c, rank, 1000, 7, 1e-6, false);
    sh_coll_destroy(c);
}

/* The leaders' group survives lost frames as SH_COLL_NET does, and the hook hears of each
 * frame with the global rank of the leader it goes to. */
static void test_lossy(void)
{
    static const int32_t hosts[] = {0, 0, 1, 1};
    group g;
    group_init(&g, 4, hosts);
    g.fault = lossy;
    run_ranks(&g, rank_lossy, -1, 30000);
    check_same(&g);
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < 4; p++) {
            int n = atomic_load(&g.sh->asked[r][p]);
            bool leaders = (r == 0 && p == 2) || (r == 2 && p == 0);
            if (leaders ? n == 0 : n != 0)
                SH_FAIL_("rank %d was asked about %d frames to rank %d", r, n, p);
        }
    fprintf(stderr, "  frames asked about: rank 0 -> 2: %d, rank 2 -> 0: %d\n",
            atomic_load(&g.sh->asked[0][2]), atomic_load(&g.sh->asked[2][0]));
    group_fini(&g);
}

/* ---- Dead and stopped ranks ------------------------------------------------------------- */

static int victim;
static int victim_sig;

static void rank_victim(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    allreduce_check(g, c, rank, 1000, 0, 1e-6, false);
    if (rank == victim) {
        usleep(200000);    /* its last frames of call 1 leave (the others' call 1 needs them) */
        raise(victim_sig); /* SIGKILL ends here; SIGSTOP stops until the parent kills it */
    }
    float *x = calloc(100003, sizeof *x);
    uint64_t t0 = mono_ms();
    rc = sh_coll_allreduce(c, x, 100003, &e);
    uint64_t took = mono_ms() - t0;
    fprintf(stderr, "  rank %d after %llu ms: %s: %s\n", rank, (unsigned long long)took,
            sh_strerror(rc), e.msg);
    if (victim_sig == SIGKILL) {
        /* Its segment and connections see it go; the others learn from their leaders. */
        CHECK_INT_EQ(rc, SH_ECLOSED);
        if (took > sh_test_ms(1500))
            SH_FAIL_("rank %d: the call failed after %llu ms", rank, (unsigned long long)took);
    } else {
        if (rc != SH_ETIMEDOUT && rc != SH_ECLOSED)
            SH_FAIL_("rank %d: %s, not SH_ETIMEDOUT or SH_ECLOSED", rank, sh_strerror(rc));
        if (took > (uint64_t)g->timeout_ms + sh_test_ms(1500))
            SH_FAIL_("rank %d: the call failed after %llu ms (timeout %d)", rank,
                     (unsigned long long)took, (int)g->timeout_ms);
    }
    /* The rank's own host names the victim; every message says which level failed. */
    bool same_host = g->hosts[rank] == g->hosts[victim];
    char want[32];
    snprintf(want, sizeof want, "rank %d", rank);
    if (!strstr(e.msg, want) || (!strstr(e.msg, "within the host") && !strstr(e.msg, "leaders")))
        SH_FAIL_("rank %d: \"%s\" names neither this rank nor the level", rank, e.msg);
    if (same_host && !strstr(e.msg, "within the host"))
        SH_FAIL_("rank %d: \"%s\" does not say it failed within the host", rank, e.msg);
    t0 = mono_ms();
    CHECK_INT_EQ(sh_coll_allreduce(c, x, 100003, &e), rc); /* broken: at once, same code */
    CHECK(mono_ms() - t0 < 100);
    free(x);
    t0 = mono_ms();
    sh_coll_destroy(c);
    CHECK(mono_ms() - t0 < 1000);
}

static void test_dead_rank(void)
{
    static const int32_t hosts[] = {0, 0, 1, 1};
    const struct {
        int victim, sig;
    } v[] = {{3, SIGKILL}, {2, SIGKILL}, {1, SIGSTOP}};
    for (int i = 0; i < 3; i++) {
        group g;
        group_init(&g, 4, hosts);
        g.timeout_ms = v[i].sig == SIGKILL ? 4000 : 1000;
        victim = v[i].victim;
        victim_sig = v[i].sig;
        fprintf(stderr, "  rank %d (%s) %s:\n", victim, victim % 2 ? "a non-leader" : "a leader",
                v[i].sig == SIGKILL ? "killed" : "stopped");
        run_ranks(&g, rank_victim, victim, 15000);
        group_fini(&g);
    }
}

/* ---- Mismatched calls ------------------------------------------------------------------- */

/* Rank 3 calls an all-gather where the others call an all-reduce: its host's group sees the
 * other op (SH_EPROTO on ranks 2 and 3, naming both ops), and the other host learns of it when
 * rank 2 leaves the leaders' group. */
static void rank_mismatch(group *g, int rank)
{
    sh_coll *c;
    sh_error e = {0};
    sh_err rc = rank_create(g, rank, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    float x[4000] = {0};
    uint64_t t0 = mono_ms();
    if (rank == 3)
        rc = sh_coll_allgather(c, x, 400, x + 1000, &e);
    else
        rc = sh_coll_allreduce(c, x, 100, &e);
    uint64_t took = mono_ms() - t0;
    fprintf(stderr, "  rank %d after %llu ms: %s: %s\n", rank, (unsigned long long)took,
            sh_strerror(rc), e.msg);
    if (rank >= 2) {
        CHECK_INT_EQ(rc, SH_EPROTO);
        if (!strstr(e.msg, "all-gather") || !strstr(e.msg, "all-reduce"))
            SH_FAIL_("rank %d: \"%s\" does not name both ops", rank, e.msg);
    } else {
        CHECK_INT_EQ(rc, SH_ECLOSED);
    }
    if (took > sh_test_ms(1500))
        SH_FAIL_("rank %d: the call failed after %llu ms", rank, (unsigned long long)took);
    sh_coll_destroy(c);
}

static void test_mismatch(void)
{
    static const int32_t hosts[] = {0, 0, 1, 1};
    group g;
    group_init(&g, 4, hosts);
    run_ranks(&g, rank_mismatch, -1, 10000);
    group_fini(&g);
}

/* ---- Join failures and options ---------------------------------------------------------- */

static void rank_wrong_epoch(group *g, int rank)
{
    sh_coll *c = NULL;
    sh_error e = {0};
    uint64_t t0 = mono_ms();
    sh_err rc = rank_create(g, rank, &c, &e);
    uint64_t took = mono_ms() - t0;
    fprintf(stderr, "  rank %d after %llu ms: %s: %s\n", rank, (unsigned long long)took,
            sh_strerror(rc), e.msg);
    CHECK(rc != SH_OK);
    CHECK(c == NULL);
    if (took > (uint64_t)g->timeout_ms * 2 + sh_test_ms(1500))
        SH_FAIL_("rank %d: create failed after %llu ms (timeout %d)", rank,
                 (unsigned long long)took, (int)g->timeout_ms);
    /* Rank 3 (epoch 5) finds its host's segment of epoch 7 and is refused; the others fail as
     * it never joins. */
    if (rank == 3 && (rc != SH_EPROTO || !strstr(e.msg, "epoch 7") || !strstr(e.msg, "epoch 5")))
        SH_FAIL_("rank %d: %s \"%s\" does not name the epoch", rank, sh_strerror(rc), e.msg);
}

static void test_wrong_epoch(void)
{
    static const int32_t hosts[] = {0, 0, 1, 1};
    group g;
    group_init(&g, 4, hosts);
    g.timeout_ms = 700;
    g.epoch[3] = 5;
    run_ranks(&g, rank_wrong_epoch, -1, 10000);
    group_fini(&g);
}

static void rank_options(group *g, int rank)
{
    (void)rank;
    sh_coll *c = NULL;
    sh_error e = {0};
    sh_coll_opts o = {
        .rank = 0, .size = 2, .max_bytes = 1024, .shm_name = g->shm, .urls = g->up, .hosts = NULL};
    CHECK_INT_EQ(sh_coll_create(SH_COLL_HIER, &o, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "needs hosts") != NULL);
    CHECK(c == NULL);
    o.hosts = g->hosts;
    o.shm_name = NULL;
    CHECK_INT_EQ(sh_coll_create(SH_COLL_HIER, &o, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "needs shm_name") != NULL);
    o.shm_name = g->shm;
    o.urls = NULL;
    CHECK_INT_EQ(sh_coll_create(SH_COLL_HIER, &o, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "needs urls") != NULL);
    o.urls = g->up;
    o.shm_name = "no-slash";
    CHECK_INT_EQ(sh_coll_create(SH_COLL_HIER, &o, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "no-slash-h0") != NULL);
    CHECK(c == NULL);
    CHECK_INT_EQ(sh_coll_create(SH_COLL_HIER, &o, &c, NULL), SH_EINVAL); /* no error text */
    CHECK(c == NULL);
}

static void test_options(void)
{
    static const int32_t hosts[] = {0, 0};
    group g;
    group_init(&g, 1, hosts);
    run_ranks(&g, rank_options, -1, 5000);
    group_fini(&g);
}

static const sh_test_case tests[] = {
    {"two_by_two", test_two_by_two}, {"uneven", test_uneven},
    {"one_host", test_one_host},     {"compress", test_compress},
    {"lossy", test_lossy},           {"dead_rank", test_dead_rank},
    {"mismatch", test_mismatch},     {"wrong_epoch", test_wrong_epoch},
    {"options", test_options},       {NULL, NULL},
};

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    return sh_test_main(argc, argv, tests);
}
