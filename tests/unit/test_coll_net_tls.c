/* The network collectives (SH_COLL_NET) over tls+tcp:// between fork()ed processes, with
 * certificates the test makes (openssl CLI): sums and gathers equal to their references and
 * bitwise equal on every rank, with the cluster key proved as on tcp:// (a rank with a good
 * certificate and a wrong key does not join); a rank whose certificate another CA signed is
 * refused by every peer, each create failing within its timeout naming the rank and the failed
 * handshakes; groups destroyed right after 16 MiB all-reduces end (no hang in NNG's close); bad
 * TLS options. The parent never touches NNG (its threads would not survive fork): every rank is
 * a child. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>

#include "runtime/coll.h"
#include "runtime/coll_net.h"
#include "sh_test.h"
#include "shoal/transport.h"

#define MAXR 3
#define KEY "a cluster key of some length"

/* Each rank's result hashes (MAP_SHARED before fork). */
typedef struct shared {
    uint64_t hash[8][MAXR];
} shared;

static char dir[64];        /* the certificates */
static char urls[MAXR][64]; /* tls+tcp://127.0.0.1:PORT */
static const char *up[MAXR];
static shared *sh;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int run(const char *cmd)
{
    int rc = system(cmd);
    if (rc != 0)
        fprintf(stderr, "command failed (%d): %s\n", rc, cmd);
    return rc;
}

/* A CA `ca` and a node certificate `ca-node` signed by it, in dir (as test_transport_tls). */
static int make_certs(const char *ca)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout %s.key -out %s.pem "
             "-days 2 -subj /CN=%s >/dev/null 2>&1 && "
             "openssl req -newkey rsa:2048 -nodes -keyout %s-node.key -out %s-node.csr "
             "-subj /CN=localhost >/dev/null 2>&1 && "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > %s-ext.cnf && "
             "openssl x509 -req -in %s-node.csr -CA %s.pem -CAkey %s.key -CAcreateserial "
             "-out %s-node.pem -days 2 -extfile %s-ext.cnf >/dev/null 2>&1",
             dir, ca, ca, ca, ca, ca, ca, ca, ca, ca, ca, ca);
    return run(cmd);
}

/* Free tcp ports on 127.0.0.1 for n ranks (each bound at once, so that they differ). */
static void pick_urls(int n)
{
    int fds[MAXR];
    for (int i = 0; i < n; i++) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
        socklen_t len = sizeof a;
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        CHECK(fds[i] >= 0);
        CHECK(bind(fds[i], (struct sockaddr *)&a, sizeof a) == 0);
        CHECK(getsockname(fds[i], (struct sockaddr *)&a, &len) == 0);
        snprintf(urls[i], sizeof urls[i], "tls+tcp://127.0.0.1:%d", (int)ntohs(a.sin_port));
        up[i] = urls[i];
    }
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

/* The certificate files of CA `ca`'s node (the CA file is always the good one, "ca"). */
typedef struct certs {
    char cert[128], key[128], ca[128];
    sh_transport_tls tls;
} certs;

static void certs_of(certs *t, const char *ca)
{
    snprintf(t->cert, sizeof t->cert, "%s/%s-node.pem", dir, ca);
    snprintf(t->key, sizeof t->key, "%s/%s-node.key", dir, ca);
    snprintf(t->ca, sizeof t->ca, "%s/ca.pem", dir);
    t->tls = (sh_transport_tls){.cert_file = t->cert, .key_file = t->key, .ca_file = t->ca};
}

static size_t max_bytes = (size_t)2 << 20;

static sh_err rank_create_key(int rank, int n, int32_t timeout_ms, const sh_transport_tls *tls,
                              const char *key, sh_coll **c, sh_error *e)
{
    sh_coll_opts o = {.rank = rank,
                      .size = n,
                      .epoch = 3,
                      .timeout_ms = timeout_ms,
                      .max_bytes = max_bytes,
                      .urls = up,
                      .key = (const uint8_t *)key,
                      .key_len = strlen(key),
                      .tls = tls};
    return sh_coll_create(SH_COLL_NET, &o, c, e);
}

static sh_err rank_create(int rank, int n, int32_t timeout_ms, const sh_transport_tls *tls,
                          sh_coll **c, sh_error *e)
{
    return rank_create_key(rank, n, timeout_ms, tls, KEY, c, e);
}

typedef void (*rank_fn)(int rank, int n);

/* Runs fn in n child processes and checks that each exits 0 within limit_ms (a hang fails). */
static void run_ranks(int n, rank_fn fn, unsigned limit_ms)
{
    pid_t pid[MAXR];
    for (int i = 0; i < n; i++) {
        pid[i] = fork();
        CHECK(pid[i] >= 0);
        if (pid[i] == 0) {
            sh_test_failures_ = 0;
            fn(i, n);
            fflush(NULL);
            exit(sh_test_failures_ ? 1 : 0);
        }
    }
    uint64_t end = mono_ms() + sh_test_ms(limit_ms);
    bool done[MAXR] = {0};
    for (int left = n; left > 0 && mono_ms() < end;) {
        for (int i = 0; i < n; i++) {
            int st;
            if (done[i] || waitpid(pid[i], &st, WNOHANG) != pid[i])
                continue;
            done[i] = true;
            left--;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                SH_FAIL_("rank %d ended with status %#x", i, st);
        }
        usleep(2000);
    }
    for (int i = 0; i < n; i++) {
        if (done[i])
            continue;
        SH_FAIL_("rank %d did not finish within %u ms", i, limit_ms);
        kill(pid[i], SIGKILL);
        waitpid(pid[i], NULL, 0);
    }
}

static uint64_t hash(const void *p, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}

/* Rank r's input of call k: small integers, so that every order of summation gives the exact
 * sum and the reference is exact. */
static float value(int r, int k, size_t i)
{
    return (float)((int)((i * 7 + (size_t)r * 13 + (size_t)k) % 201) - 100);
}

/* ---- Sums and gathers ------------------------------------------------------------------- */

/* One-shot (1000 floats) and ring (300000 floats, past the one-shot and segment sizes) sums, and
 * a gather, over mutual TLS with the cluster key. */
static void rank_sums(int rank, int n)
{
    certs t;
    certs_of(&t, "ca");
    sh_coll *c = NULL;
    sh_error e = {0};
    sh_err rc = rank_create(rank, n, 10000, &t.tls, &c, &e);
    if (rc) {
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
        return;
    }
    static const size_t sizes[] = {1000, 16385, 300000};
    int k = 0;
    for (; k < 3; k++) {
        size_t len = sizes[k];
        float *x = malloc(len * sizeof *x);
        for (size_t i = 0; i < len; i++)
            x[i] = value(rank, k, i);
        rc = sh_coll_allreduce(c, x, len, &e);
        if (rc)
            SH_FAIL_("rank %d: all-reduce of %zu floats: %s: %s", rank, len, sh_strerror(rc),
                     e.msg);
        for (size_t i = 0; i < len && !rc; i++) {
            float want = 0;
            for (int r = 0; r < n; r++)
                want += value(r, k, i);
            if (x[i] != want) {
                SH_FAIL_("rank %d: all-reduce of %zu floats: element %zu is %g, not %g", rank, len,
                         i, (double)x[i], (double)want);
                break;
            }
        }
        sh->hash[k][rank] = hash(x, len * sizeof *x);
        free(x);
    }
    size_t bytes = 70000;
    uint8_t *in = malloc(bytes), *out = malloc(bytes * (size_t)n);
    for (size_t i = 0; i < bytes; i++)
        in[i] = (uint8_t)(i * 31 + (size_t)rank * 7);
    rc = sh_coll_allgather(c, in, bytes, out, &e);
    if (rc)
        SH_FAIL_("rank %d: all-gather: %s: %s", rank, sh_strerror(rc), e.msg);
    for (int r = 0; r < n && !rc; r++)
        for (size_t i = 0; i < bytes; i++)
            if (out[(size_t)r * bytes + i] != (uint8_t)(i * 31 + (size_t)r * 7)) {
                SH_FAIL_("rank %d: all-gather: rank %d's byte %zu differs", rank, r, i);
                break;
            }
    sh->hash[k][rank] = hash(out, bytes * (size_t)n);
    free(in);
    free(out);
    sh_coll_stats st;
    sh_coll_stats_get(c, &st);
    CHECK_UINT_EQ(st.calls, 4);
    CHECK_UINT_EQ(st.failures, 0);
    CHECK(st.bytes_wire > 0);
    CHECK_UINT_EQ(sh__coll_net_dropped(c), 0);
    sh_coll_destroy(c);
}

static void test_sums(void)
{
    for (int n = 2; n <= 3; n++) {
        pick_urls(n);
        memset(sh, 0, sizeof *sh);
        run_ranks(n, rank_sums, 30000);
        for (int k = 0; k < 4; k++)
            for (int r = 1; r < n; r++)
                if (sh->hash[k][r] != sh->hash[k][0] || !sh->hash[k][0])
                    SH_FAIL_("%d ranks: call %d: rank %d's result differs from rank 0's", n, k, r);
    }
}

/* ---- Destroy right after large calls ---------------------------------------------------- */

/* A group formed, loaded with two 16 MiB all-reduces and destroyed at once (four times, on new
 * ports): NNG 1.5.2 closing a TLS link whose last frame is still being written can hang for ever
 * (net_free's pause); run_ranks fails a rank that does not end. */
static void rank_reform_once(int rank, int n)
{
    certs t;
    certs_of(&t, "ca");
    size_t len = (size_t)4 << 20;
    float *x = malloc(len * sizeof *x);
    sh_coll *c = NULL;
    sh_error e = {0};
    sh_err rc = x ? rank_create(rank, n, 20000, &t.tls, &c, &e) : SH_ENOMEM;
    if (rc)
        SH_FAIL_("rank %d: create: %s: %s", rank, sh_strerror(rc), e.msg);
    for (int k = 0; k < 2 && !rc; k++) {
        for (size_t i = 0; i < len; i++)
            x[i] = value(rank, k, i);
        rc = sh_coll_allreduce(c, x, len, &e);
        if (rc)
            SH_FAIL_("rank %d: all-reduce of 16 MiB: %s: %s", rank, sh_strerror(rc), e.msg);
        else if (x[len - 1] != value(0, k, len - 1) + value(1, k, len - 1))
            SH_FAIL_("rank %d: the last element is %g", rank, (double)x[len - 1]);
    }
    sh_coll_destroy(c);
    free(x);
}

static void test_reform(void)
{
    max_bytes = (size_t)16 << 20;
    for (int r = 0; r < 4; r++) {
        pick_urls(2);
        run_ranks(2, rank_reform_once, 30000);
    }
    max_bytes = (size_t)2 << 20;
}

/* ---- A certificate from another CA ------------------------------------------------------ */

/* Rank 1 holds a certificate "other" signed (the CA file is the good one, so rank 1 would accept
 * the others; they refuse it). Every create fails with SH_ETIMEDOUT at its timeout, naming the
 * rank that did not join and the failed handshakes. */
static void rank_wrong_cert(int rank, int n)
{
    certs t;
    certs_of(&t, rank == 1 ? "other" : "ca");
    sh_coll *c = NULL;
    sh_error e = {0};
    uint64_t t0 = mono_ms();
    sh_err rc = rank_create(rank, n, 1500, &t.tls, &c, &e);
    uint64_t took = mono_ms() - t0;
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    CHECK(c == NULL);
    CHECK(took >= 1400 && took < sh_test_ms(4000));
    fprintf(stderr, "rank %d: %s\n", rank, e.msg);
    CHECK(strstr(e.msg, "did not join within 1500 ms") != NULL);
    CHECK(strstr(e.msg, "TLS handshakes failed") != NULL);
    CHECK(strstr(e.msg, "signed by the CA every rank trusts") != NULL);
    if (rank != 1) { /* the good ranks name rank 1 (and only it, with three) */
        char who[96];
        snprintf(who, sizeof who, "rank 1 (%s) did not join", urls[1]);
        CHECK(strstr(e.msg, who) != NULL);
        CHECK(strstr(e.msg, "dialling rank 1") != NULL);
        CHECK(strstr(e.msg, "at this rank's listener") != NULL);
    }
    if (rank == 0 && n == 3) /* ranks 0 and 2 did join each other */
        CHECK(strstr(e.msg, "rank 2 (") == NULL);
}

static void test_wrong_cert(void)
{
    for (int n = 2; n <= 3; n++) {
        pick_urls(n);
        run_ranks(n, rank_wrong_cert, 10000);
    }
}

/* ---- The cluster key over TLS ---------------------------------------------------------- */

/* Rank 1's certificate is good but its key is not: TLS does not stand in for the key's proof, so
 * rank 0 refuses its join proof and times out naming the key check (rank 1 waits for rank 0's
 * acceptance in vain too), and no handshake failed. */
static void rank_wrong_key(int rank, int n)
{
    certs t;
    certs_of(&t, "ca");
    sh_coll *c = NULL;
    sh_error e = {0};
    sh_err rc = rank_create_key(rank, n, 1500, &t.tls, rank == 1 ? "another key" : KEY, &c, &e);
    CHECK_INT_EQ(rc, SH_ETIMEDOUT);
    CHECK(c == NULL);
    fprintf(stderr, "rank %d: %s\n", rank, e.msg);
    CHECK(strstr(e.msg, "failed the cluster key check") != NULL);
    CHECK(strstr(e.msg, "TLS handshakes failed") == NULL);
}

static void test_wrong_key(void)
{
    pick_urls(2);
    run_ranks(2, rank_wrong_key, 10000);
}

/* ---- Options ---------------------------------------------------------------------------- */

static void rank_options(int rank, int n)
{
    (void)n;
    certs t;
    certs_of(&t, "ca");
    sh_coll *c = NULL;
    sh_error e = {0};
    /* tls+tcp:// without the certificates. */
    CHECK_INT_EQ(rank_create(rank, 2, 300, NULL, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "tls+tcp:// needs sh_coll_opts.tls") != NULL);
    CHECK(c == NULL);
    /* TLS on some ranks only. */
    char plain[160];
    snprintf(plain, sizeof plain, "tcp://%s", urls[1] + 10);
    const char *mixed[2] = {urls[0], plain};
    sh_coll_opts o = {.rank = 0, .size = 2, .max_bytes = 64, .urls = mixed, .tls = &t.tls};
    CHECK_INT_EQ(sh_coll_create(SH_COLL_NET, &o, &c, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "every rank must listen on tls+tcp://") != NULL);
    /* A certificate file that is not there, and PEM that is not PEM. */
    sh_transport_tls gone = t.tls;
    gone.cert_file = "/nonexistent/node.pem";
    CHECK_INT_EQ(rank_create(rank, 2, 300, &gone, &c, &e), SH_EIO);
    CHECK(strstr(e.msg, "/nonexistent/node.pem") != NULL);
    CHECK(strstr(e.msg, "coll: rank 0") != NULL);
    sh_transport_tls junk = {.cert_pem = "junk", .key_pem = "junk", .ca_pem = "junk"};
    CHECK_INT_EQ(rank_create(rank, 2, 300, &junk, &c, &e), SH_EINVAL);
    CHECK(c == NULL);
}

static void test_options(void)
{
    pick_urls(2);
    run_ranks(1, rank_options, 10000);
}

static const sh_test_case tests[] = {
    {"sums", test_sums},     {"wrong_cert", test_wrong_cert}, {"wrong_key", test_wrong_key},
    {"reform", test_reform}, {"options", test_options},       {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (system("openssl version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "skip: no openssl CLI to make certificates\n");
        return SH_TEST_SKIP;
    }
    /* NNG without TLS: a child asks (the parent keeps NNG's threads out of its forks). */
    pid_t probe = fork();
    if (probe == 0) {
        nng_tls_config *cfg = NULL;
        int rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_CLIENT);
        if (cfg)
            nng_tls_config_free(cfg);
        _exit(rv == NNG_ENOTSUP ? SH_TEST_SKIP : 0);
    }
    int st = 0;
    CHECK(probe > 0 && waitpid(probe, &st, 0) == probe);
    if (WIFEXITED(st) && WEXITSTATUS(st) == SH_TEST_SKIP) {
        fprintf(stderr, "skip: NNG is built without TLS\n");
        return SH_TEST_SKIP;
    }
    snprintf(dir, sizeof dir, "/tmp/shoal-cntls-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    if (make_certs("ca") != 0 || make_certs("other") != 0) {
        fprintf(stderr, "cannot make certificates in %s\n", dir);
        return 1;
    }
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(sh != MAP_FAILED);
    int rc = sh_test_main(argc, argv, tests);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    run(cmd);
    return rc;
}
