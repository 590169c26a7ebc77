/* bench_collectives: latency and bus bandwidth of the collectives (runtime/coll.h) for each
 * transport, group size and message size. One JSON object per (transport, ranks, bytes).
 *
 * Usage: bench_collectives [--transport shm|ipc|tcp|tls] [--inproc] [--ranks N] [--op OP]
 *                          [--compress none|f16|int8] [--hosts H] [--min B] [--max B] [--iters N]
 *                          [--bytes B]
 *   --transport T  shm (default): ranks as fork()ed processes over a named shared-memory segment;
 *                  ipc / tcp: fork()ed processes over SH_COLL_NET on ipc:// sockets in /tmp or
 *                  tcp://127.0.0.1 ports; tls: as tcp on tls+tcp:// ports, every rank with a
 *                  certificate made at start by the openssl CLI (in a temporary directory)
 *   --inproc       shm only: ranks as threads of this process (sh_coll_inproc)
 *   --ranks N      group size (default 2)
 *   --op OP        allreduce (default), allgather or broadcast (root 0); p2p: the link's own
 *                  point-to-point figure (shm: one transfer between two processes through
 *                  shared memory, see run_shm_p2p; ipc / tcp: two processes with a push and a
 *                  pull socket each, as SH_COLL_NET has, one sending B bytes as 128 KiB
 *                  messages, the collectives' segments, the other answering 1 byte once it has
 *                  them all, see net_p2p_rank)
 *   --compress C   ipc / tcp / tls: what crosses the links (default none); the mode says it
 *                  ("processes-f16")
 *   --hosts H      ipc / tcp: the two-level collectives (SH_COLL_HIER), the ranks split in H
 *                  pseudo-hosts of consecutive ranks (H divides N): shared memory within each,
 *                  the hosts' leaders over the transport; the mode says it ("processes-hier2")
 *   --min/--max B  message sizes in bytes (default 4096 .. 64 MiB: 4 KiB, 8 KiB, then powers of
 *                  4 from 16 KiB); for all-gather, B is the output (every rank sends B / N)
 *   --bytes B      one size only
 *   --iters N      timed calls per size (default: 5000 up to 64 KiB, then 256 MiB / B, at least
 *                  8), after a tenth as many untimed ones
 * Latency is the time of one call on rank 0 (p50, p99, mean over the timed calls; ranks meet at
 * every call, so one rank's clock is the group's). Bus bandwidth is NCCL's: all-reduce
 * 2(n-1)/n * B / mean, all-gather (n-1)/n * B / mean, broadcast B / mean.
 *
 * Each transport is one run_<transport> function that starts the ranks and calls rank_loop in
 * each; the loop and the figures are shared. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nng/nng.h>

#include <nng/protocol/pipeline0/pull.h>
#include <nng/protocol/pipeline0/push.h>

#include "runtime/coll.h"
#include "shoal/transport.h"

typedef enum bench_op { OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_P2P } bench_op;

typedef struct bench_opts {
    const char *transport;
    bool inproc;
    int32_t ranks;
    bench_op op;
    size_t min_bytes, max_bytes;
    int iters; /* 0: by size */
    sh_coll_compress compress;
    int32_t hosts; /* > 0: SH_COLL_HIER over this many pseudo-hosts */
} bench_opts;

static const char *op_names[] = {"allreduce", "allgather", "broadcast", "p2p"};
static const char *compress_names[] = {"none", "f16", "int8"};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The sizes of the run: 4 KiB, 8 KiB (issue 26's latency figure), then powers of 4. */
static size_t next_size(size_t b) { return b < 16384 ? b * 2 : b * 4; }

static int iters_for(const bench_opts *o, size_t bytes)
{
    if (o->iters > 0)
        return o->iters;
    if (bytes <= 65536)
        return 5000;
    size_t n = ((size_t)256 << 20) / bytes;
    return n < 8 ? 8 : (int)n;
}

static double busbw_factor(bench_op op, int32_t n)
{
    if (op == OP_ALLREDUCE)
        return 2.0 * (n - 1) / n;
    if (op == OP_ALLGATHER)
        return (double)(n - 1) / n;
    return 1.0;
}

static sh_err one_call(sh_coll *c, const bench_opts *o, float *buf, float *out, size_t bytes,
                       sh_error *e)
{
    switch (o->op) {
    case OP_ALLREDUCE:
        return sh_coll_allreduce(c, buf, bytes / sizeof(float), e);
    case OP_ALLGATHER:
        return sh_coll_allgather(c, buf, bytes / (size_t)o->ranks, out, e);
    default:
        return sh_coll_broadcast(c, buf, bytes, 0, e);
    }
}

/* Prints one line from the timed calls t (sorted here): p50, p99, mean, and the bandwidth
 * factor * bytes / mean under the name bw_name. */
static void report(const bench_opts *o, const char *mode, const char *op, size_t bytes, uint64_t *t,
                   int iters, const char *bw_name, double factor)
{
    double sum = 0;
    for (int i = 0; i < iters; i++)
        sum += (double)t[i];
    qsort(t, (size_t)iters, sizeof *t, cmp_u64);
    double mean = sum / iters;
    double load = 0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1)
            load = 0;
        fclose(f);
    }
    printf("{\"bench\":\"collectives\",\"transport\":\"%s\",\"mode\":\"%s\",\"op\":\"%s\","
           "\"ranks\":%d,\"bytes\":%zu,\"iters\":%d,\"p50_us\":%.2f,\"p99_us\":%.2f,"
           "\"mean_us\":%.2f,\"%s\":%.2f,\"load1\":%.2f}\n",
           o->transport, mode, op, (int)o->ranks, bytes, iters, (double)t[iters / 2] / 1e3,
           (double)t[(size_t)iters * 99 / 100] / 1e3, mean / 1e3, bw_name,
           factor * (double)bytes / mean, load);
    fflush(stdout);
}

/* Every rank runs every size; rank 0 prints one line per size. Returns 0 or 1. */
static int rank_loop(sh_coll *c, const bench_opts *o, const char *mode)
{
    float *buf = malloc(o->max_bytes), *out = malloc(o->max_bytes);
    int iters_max = iters_for(o, o->min_bytes);
    uint64_t *t = malloc(sizeof *t * (size_t)(o->iters > iters_max ? o->iters : iters_max));
    if (!buf || !out || !t) {
        fprintf(stderr, "bench_collectives: out of memory\n");
        return 1;
    }
    /* Ones: an in-place all-reduce multiplies them by the group size each call, which reaches
     * infinity without passing through denormals (no slow path in the adds). */
    for (size_t i = 0; i < o->max_bytes / sizeof(float); i++)
        buf[i] = 1.0f;
    memset(out, 0, o->max_bytes);
    int rc = 0;
    for (size_t bytes = o->min_bytes; bytes <= o->max_bytes; bytes = next_size(bytes)) {
        int iters = iters_for(o, bytes);
        sh_error e = {0};
        for (int i = -(iters / 10 + 2); i < iters && !rc; i++) {
            uint64_t t0 = now_ns();
            if (one_call(c, o, buf, out, bytes, &e)) {
                fprintf(stderr, "bench_collectives: rank %d: %s of %zu bytes: %s\n",
                        (int)sh_coll_rank(c), op_names[o->op], bytes, e.msg);
                rc = 1;
            }
            if (i >= 0)
                t[i] = now_ns() - t0;
        }
        if (rc)
            break;
        if (sh_coll_rank(c) != 0)
            continue;
        report(o, mode, op_names[o->op], bytes, t, iters, "busbw_gbs",
               busbw_factor(o->op, o->ranks));
    }
    free(buf);
    free(out);
    free(t);
    return rc;
}

/* ---- transport: shm ---- */

typedef struct shm_thread {
    const bench_opts *o;
    sh_coll_opts co;
    int rc;
} shm_thread;

static int shm_rank(const bench_opts *o, sh_coll_opts *co, const char *mode)
{
    sh_coll *c = NULL;
    sh_error e = {0};
    if (sh_coll_create(SH_COLL_SHM, co, &c, &e)) {
        fprintf(stderr, "bench_collectives: rank %d: %s\n", (int)co->rank, e.msg);
        return 1;
    }
    int rc = rank_loop(c, o, mode);
    sh_coll_destroy(c);
    return rc;
}

static void *shm_thread_main(void *p)
{
    shm_thread *t = p;
    t->rc = shm_rank(t->o, &t->co, "threads");
    return NULL;
}

/* The link's own point-to-point figure: two processes and one shared mapping; rank 0 copies
 * `bytes` in and raises its flag, rank 1 copies them out, copies them back into its own area
 * and raises its flag, rank 0 copies them out. Half of that round trip is one transfer (copy
 * in, handshake, copy out), timed on rank 0; bandwidth is bytes over its mean. Waiting spins
 * briefly, then yields, like the transport (no futex: nothing here sleeps). */
typedef struct p2p_flags {
    alignas(64) _Atomic uint64_t up;
    alignas(64) _Atomic uint64_t down;
} p2p_flags;

static bool p2p_wait(_Atomic uint64_t *w, uint64_t v)
{
    uint64_t t0 = now_ns();
    while (atomic_load_explicit(w, memory_order_acquire) < v) {
        uint64_t dt = now_ns() - t0;
        if (dt > 10000000000ull)
            return false; /* the peer is gone */
        if (dt > 1000)
            sched_yield();
    }
    return true;
}

static int p2p_rank(const bench_opts *o, int32_t rank, p2p_flags *fl, unsigned char *area)
{
    unsigned char *mine = malloc(o->max_bytes);
    int iters_max = iters_for(o, o->min_bytes);
    uint64_t *t = malloc(sizeof *t * (size_t)(o->iters > iters_max ? o->iters : iters_max));
    if (!mine || !t)
        return 1;
    memset(mine, 1, o->max_bytes);
    unsigned char *to1 = area, *to0 = area + o->max_bytes;
    uint64_t n = 0;
    for (size_t bytes = o->min_bytes; bytes <= o->max_bytes; bytes = next_size(bytes)) {
        int iters = iters_for(o, bytes);
        for (int i = -(iters / 10 + 2); i < iters; i++) {
            n++;
            uint64_t t0 = now_ns();
            if (rank == 0) {
                memcpy(to1, mine, bytes);
                atomic_store_explicit(&fl->up, n, memory_order_release);
                if (!p2p_wait(&fl->down, n))
                    return 1;
                memcpy(mine, to0, bytes);
            } else {
                if (!p2p_wait(&fl->up, n))
                    return 1;
                memcpy(mine, to1, bytes);
                memcpy(to0, mine, bytes);
                atomic_store_explicit(&fl->down, n, memory_order_release);
            }
            if (i >= 0)
                t[i] = (now_ns() - t0) / 2;
        }
        if (rank == 0)
            report(o, "processes", "p2p", bytes, t, iters, "bw_gbs", 1.0);
    }
    free(mine);
    free(t);
    return 0;
}

static int run_shm_p2p(const bench_opts *o)
{
    size_t len = sizeof(p2p_flags) + 2 * o->max_bytes;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        fprintf(stderr, "bench_collectives: mmap of %zu bytes failed\n", len);
        return 1;
    }
    p2p_flags *fl = m;
    unsigned char *area = (unsigned char *)m + sizeof(p2p_flags);
    pid_t pid = fork();
    if (pid == 0)
        _exit(p2p_rank(o, 1, fl, area));
    int rc = pid < 0 ? 1 : p2p_rank(o, 0, fl, area);
    int st = 0;
    if (pid > 0 && (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0))
        rc = 1;
    munmap(m, len);
    return rc;
}

static int run_shm(const bench_opts *o)
{
    if (o->op == OP_P2P)
        return run_shm_p2p(o);
    sh_coll_opts co = {
        .size = o->ranks, .epoch = 1, .timeout_ms = 60000, .max_bytes = o->max_bytes};
    if (o->inproc) {
        sh_error e = {0};
        if (sh_coll_inproc_create(o->ranks, o->max_bytes, &co.inproc, &e)) {
            fprintf(stderr, "bench_collectives: %s\n", e.msg);
            return 1;
        }
        shm_thread th[SH_COLL_MAX_RANKS];
        pthread_t id[SH_COLL_MAX_RANKS];
        int rc = 0, started = 0;
        for (int32_t r = 0; r < o->ranks && !rc; r++, started++) {
            th[r] = (shm_thread){.o = o, .co = co};
            th[r].co.rank = r;
            if (pthread_create(&id[r], NULL, shm_thread_main, &th[r]) != 0) {
                fprintf(stderr, "bench_collectives: cannot start rank %d\n", (int)r);
                rc = 1; /* the started ranks fail their create at the timeout */
                started--;
            }
        }
        for (int32_t r = 0; r < started; r++) {
            pthread_join(id[r], NULL);
            rc |= th[r].rc;
        }
        sh_coll_inproc_destroy(co.inproc);
        return rc;
    }
    char name[64];
    snprintf(name, sizeof name, "/shoal-bench-coll-%d", (int)getpid());
    co.shm_name = name;
    pid_t pids[SH_COLL_MAX_RANKS];
    for (int32_t r = 0; r < o->ranks; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            co.rank = r;
            _exit(shm_rank(o, &co, "processes"));
        }
    }
    int rc = 0;
    for (int32_t r = 0; r < o->ranks; r++) {
        int st = 0;
        if (pids[r] < 0 || waitpid(pids[r], &st, 0) != pids[r] || !WIFEXITED(st) ||
            WEXITSTATUS(st) != 0)
            rc = 1;
    }
    return rc;
}

/* ---- transport: ipc / tcp (SH_COLL_NET) ---- */

/* --transport tls: the certificates every rank presents (made by make_certs). */
static char tls_dir[64];
static char tls_files[3][128];
static sh_transport_tls tls_opts;

/* A CA and one node certificate signed by it (every rank presents the same), in a new temporary
 * directory. */
static int make_certs(void)
{
    snprintf(tls_dir, sizeof tls_dir, "/tmp/shoal-bench-tls-XXXXXX");
    if (!mkdtemp(tls_dir))
        return 1;
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "(cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
             "-days 1 -subj /CN=bench-ca && openssl req -newkey rsa:2048 -nodes -keyout node.key "
             "-out node.csr -subj /CN=bench && openssl x509 -req -in node.csr -CA ca.pem -CAkey "
             "ca.key -CAcreateserial -out node.pem -days 1) >/dev/null 2>&1",
             tls_dir);
    snprintf(tls_files[0], sizeof tls_files[0], "%s/node.pem", tls_dir);
    snprintf(tls_files[1], sizeof tls_files[1], "%s/node.key", tls_dir);
    snprintf(tls_files[2], sizeof tls_files[2], "%s/ca.pem", tls_dir);
    tls_opts = (sh_transport_tls){
        .cert_file = tls_files[0], .key_file = tls_files[1], .ca_file = tls_files[2]};
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_collectives: --transport tls needs the openssl CLI\n");
        return 1;
    }
    return 0;
}

/* Every rank's URL: ipc:// sockets in /tmp, or tcp://127.0.0.1 (tls+tcp:// for tls) ports the
 * kernel says are free (bound to port 0 together, so they differ, then closed). */
static int net_urls(const bench_opts *o, int32_t n, char (*urls)[128])
{
    int fds[SH_COLL_MAX_RANKS];
    bool tls = !strcmp(o->transport, "tls"), tcp = tls || !strcmp(o->transport, "tcp");
    for (int32_t r = 0; r < n; r++) {
        if (!tcp) {
            snprintf(urls[r], 128, "ipc:///tmp/shoal-bench-coll-%d-%d", (int)getpid(), (int)r);
            continue;
        }
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
        socklen_t len = sizeof a;
        fds[r] = socket(AF_INET, SOCK_STREAM, 0);
        if (fds[r] < 0 || bind(fds[r], (struct sockaddr *)&a, sizeof a) != 0 ||
            getsockname(fds[r], (struct sockaddr *)&a, &len) != 0) {
            fprintf(stderr, "bench_collectives: no free tcp port\n");
            return 1;
        }
        snprintf(urls[r], 128, "%s://127.0.0.1:%d", tls ? "tls+tcp" : "tcp",
                 (int)ntohs(a.sin_port));
    }
    for (int32_t r = 0; tcp && r < n; r++)
        close(fds[r]);
    return 0;
}

/* The link's own figure between ranks 0 and 1 (see --op p2p). */
static int net_p2p_rank(const bench_opts *o, int32_t r, char (*urls)[128])
{
    nng_socket in, out;
    int rv;
    if ((rv = nng_pull0_open(&in)) || (rv = nng_push0_open(&out)) ||
        (rv = nng_socket_set_size(in, NNG_OPT_RECVMAXSZ, 0)) ||
        (rv = nng_listen(in, urls[r], NULL, 0))) {
        fprintf(stderr, "bench_collectives: p2p rank %d: %s\n", (int)r, nng_strerror(rv));
        return 1;
    }
    nng_socket_set_ms(out, NNG_OPT_RECONNMINT, 10);
    nng_dial(out, urls[1 - r], NULL, NNG_FLAG_NONBLOCK);
    const size_t seg = (size_t)128 << 10;
    uint8_t *buf = calloc(1, seg);
    uint64_t *t = malloc(sizeof *t * (size_t)iters_for(o, o->min_bytes));
    int rc = !buf || !t;
    for (size_t bytes = o->min_bytes; bytes <= o->max_bytes && !rc; bytes = next_size(bytes)) {
        int iters = iters_for(o, bytes);
        for (int i = -(iters / 10 + 2); i < iters && !rc; i++) {
            uint64_t t0 = now_ns();
            if (r == 0) {
                for (size_t off = 0; off < bytes && !rc; off += seg)
                    rc = nng_send(out, buf, bytes - off < seg ? bytes - off : seg, 0) != 0;
                void *m;
                size_t len;
                rc = rc || nng_recv(in, &m, &len, NNG_FLAG_ALLOC) != 0;
                if (!rc)
                    nng_free(m, len);
            } else {
                for (size_t got = 0; got < bytes && !rc;) {
                    void *m;
                    size_t len;
                    rc = nng_recv(in, &m, &len, NNG_FLAG_ALLOC) != 0;
                    if (!rc) {
                        got += len;
                        nng_free(m, len);
                    }
                }
                rc = rc || nng_send(out, buf, 1, 0) != 0;
            }
            if (i >= 0)
                t[i] = now_ns() - t0;
        }
        if (!rc && r == 0)
            report(o, "processes", "p2p", bytes, t, iters, "bw_gbs", 1.0);
    }
    if (rc)
        fprintf(stderr, "bench_collectives: p2p rank %d failed\n", (int)r);
    nng_close(in);
    nng_close(out);
    free(buf);
    free(t);
    return rc;
}

static int net_rank(const bench_opts *o, int32_t r, char (*urls)[128])
{
    if (o->op == OP_P2P)
        return net_p2p_rank(o, r, urls);
    const char *up[SH_COLL_MAX_RANKS];
    for (int32_t i = 0; i < o->ranks; i++)
        up[i] = urls[i];
    sh_coll_opts co = {.rank = r,
                       .size = o->ranks,
                       .epoch = 1,
                       .timeout_ms = 60000,
                       .max_bytes = o->max_bytes,
                       .urls = up,
                       .compress = o->compress,
                       .tls = tls_dir[0] ? &tls_opts : NULL};
    int32_t hosts[SH_COLL_MAX_RANKS];
    char shm[64];
    if (o->hosts > 0) {
        for (int32_t i = 0; i < o->ranks; i++)
            hosts[i] = i / (o->ranks / o->hosts);
        snprintf(shm, sizeof shm, "/shoal-bench-hier-%d", (int)getppid());
        co.hosts = hosts;
        co.shm_name = shm;
    }
    sh_coll *c = NULL;
    sh_error e = {0};
    if (sh_coll_create(o->hosts > 0 ? SH_COLL_HIER : SH_COLL_NET, &co, &c, &e)) {
        fprintf(stderr, "bench_collectives: rank %d: %s\n", (int)r, e.msg);
        return 1;
    }
    char mode[48], hier[16] = "";
    if (o->hosts > 0)
        snprintf(hier, sizeof hier, "-hier%d", (int)o->hosts);
    snprintf(mode, sizeof mode, "processes%s%s%s", hier, o->compress ? "-" : "",
             o->compress ? compress_names[o->compress] : "");
    int rc = rank_loop(c, o, mode);
    sh_coll_destroy(c);
    return rc;
}

static int run_net(const bench_opts *o)
{
    int32_t n = o->op == OP_P2P ? 2 : o->ranks;
    char urls[SH_COLL_MAX_RANKS][128];
    if (net_urls(o, n, urls) || (!strcmp(o->transport, "tls") && make_certs()))
        return 1;
    pid_t pids[SH_COLL_MAX_RANKS];
    for (int32_t r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0)
            _exit(net_rank(o, r, urls));
    }
    int rc = 0;
    for (int32_t r = 0; r < n; r++) {
        int st = 0;
        if (pids[r] < 0 || waitpid(pids[r], &st, 0) != pids[r] || !WIFEXITED(st) ||
            WEXITSTATUS(st) != 0)
            rc = 1;
    }
    for (int32_t r = 0; r < n && !strncmp(urls[r], "ipc://", 6); r++)
        unlink(urls[r] + 6);
    if (tls_dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", tls_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench_collectives: could not remove %s\n", tls_dir);
    }
    return rc;
}

/* ---- options ---- */

static int usage(void)
{
    fprintf(stderr, "usage: bench_collectives [--transport shm|ipc|tcp|tls] [--inproc] [--ranks N] "
                    "[--op allreduce|allgather|broadcast|p2p] [--compress none|f16|int8] "
                    "[--hosts H] [--min B] [--max B] [--bytes B] [--iters N]\n");
    return 2;
}

int main(int argc, char **argv)
{
    bench_opts o = {.transport = "shm",
                    .ranks = 2,
                    .op = OP_ALLREDUCE,
                    .min_bytes = 4096,
                    .max_bytes = (size_t)64 << 20};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--inproc")) {
            o.inproc = true;
            continue;
        }
        if (!v)
            return usage();
        i++;
        if (!strcmp(a, "--transport"))
            o.transport = v;
        else if (!strcmp(a, "--ranks"))
            o.ranks = atoi(v);
        else if (!strcmp(a, "--min"))
            o.min_bytes = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--max"))
            o.max_bytes = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--bytes"))
            o.min_bytes = o.max_bytes = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--hosts"))
            o.hosts = atoi(v);
        else if (!strcmp(a, "--iters"))
            o.iters = atoi(v);
        else if (!strcmp(a, "--op")) {
            int k = -1;
            for (int j = 0; j < 4; j++)
                if (!strcmp(v, op_names[j]))
                    k = j;
            if (k < 0)
                return usage();
            o.op = (bench_op)k;
        } else if (!strcmp(a, "--compress")) {
            int k = -1;
            for (int j = 0; j < 3; j++)
                if (!strcmp(v, compress_names[j]))
                    k = j;
            if (k < 0)
                return usage();
            o.compress = (sh_coll_compress)k;
        } else
            return usage();
    }
    if (o.ranks < 2 || o.ranks > SH_COLL_MAX_RANKS || o.min_bytes < 4 * (size_t)o.ranks ||
        o.min_bytes > o.max_bytes) {
        fprintf(stderr, "bench_collectives: need 2 <= ranks <= %d and 4 * ranks <= min <= max\n",
                SH_COLL_MAX_RANKS);
        return 2;
    }
    if (o.op == OP_P2P && (o.ranks != 2 || o.inproc)) {
        fprintf(stderr, "bench_collectives: p2p is between 2 ranks that are processes\n");
        return 2;
    }
    bool net =
        !strcmp(o.transport, "ipc") || !strcmp(o.transport, "tcp") || !strcmp(o.transport, "tls");
    if (o.compress && !net) {
        fprintf(stderr, "bench_collectives: --compress needs --transport ipc, tcp or tls\n");
        return 2;
    }
    if (o.op == OP_P2P && !strcmp(o.transport, "tls")) {
        fprintf(stderr, "bench_collectives: p2p is measured over shm, ipc and tcp only\n");
        return 2;
    }
    if (o.hosts != 0 && (!net || o.op == OP_P2P || o.hosts < 1 || o.ranks % o.hosts != 0)) {
        fprintf(stderr, "bench_collectives: --hosts H needs --transport ipc or tcp, a collective "
                        "and H dividing the ranks\n");
        return 2;
    }
    if (!strcmp(o.transport, "shm"))
        return run_shm(&o);
    if (net)
        return run_net(&o);
    fprintf(stderr, "bench_collectives: unknown transport %s\n", o.transport);
    return usage();
}
