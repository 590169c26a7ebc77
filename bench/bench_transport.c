/* bench_transport: two processes over ipc:// (message rate, one-way latency, large-frame GB/s)
 * next to a plain Unix-socket copy loop of the same frame sizes and a plain 64-byte ping-pong (the
 * latency floor of the machine). One JSON object per line.
 *
 * Usage: bench_transport [--tcp] [--nng] [--mallopt] [--rounds N] [--window N] [--bulk]
 *   --tcp       tcp:// on loopback instead of ipc:// (the plain loops stay Unix sockets)
 *   --nng       both processes go through NNG's own ipc/tcp transport (sh_transport_opts
 *               .use_nng) instead of the runtime's stream engine, for comparison
 *   --mallopt   set M_MMAP_THRESHOLD (32 MiB, glibc's maximum) and M_TRIM_THRESHOLD (256 MiB) in
 *               both processes, as a deployed node program may: large frames then come from the
 *               heap instead of fresh mmaps that fault on every page. Library code never does.
 *   --rounds N  bulk rounds per size (default 3); each round times the plain loop, then the
 *               transport, then the plain loop again, and reports the transport against the
 *               mean of the two plain runs, so the ratio is measured under the same load.
 *   --window N  large frames in flight (default 4)
 *   --bulk      only the large-frame part (for profiling). */
#include <malloc.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/msg.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Child side: echo small bodies, answer large ones with an empty PONG. */
static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    size_t n = 0;
    const void *b = sh_msg_body(m, &n);
    if (n > 256)
        (void)sh_reply(ctx, m, SH_MSG_PONG, "\x80", 1, NULL);
    else
        (void)sh_reply(ctx, m, SH_MSG_PONG, b, n, NULL);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

/* Driver: keeps `window` requests in flight until `total` answered. */
typedef struct drive {
    sh_addr peer;
    uint32_t total, window, sent;
    uint8_t *body;
    size_t body_len;
    uint64_t *rtt_ns; /* (total) when window == 1 */
    uint64_t t_last;
    _Atomic uint32_t done;
    _Atomic uint32_t failed;
} drive;

static void drive_one(sh_actor_ctx *ctx, drive *d)
{
    uint64_t s;
    d->t_last = now_ns();
    if (sh_request(ctx, d->peer, SH_MSG_PING, d->body, d->body_len, 30000, &s, NULL) != SH_OK)
        atomic_fetch_add(&d->failed, 1);
    d->sent++;
}
static sh_err drive_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    drive *d = arg;
    *(drive **)state = d;
    for (uint32_t i = 0; i < d->window && d->sent < d->total; i++)
        drive_one(ctx, d);
    return SH_OK;
}
static sh_msg_fate drive_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    drive *d = *(drive **)state;
    uint32_t k = atomic_load(&d->done);
    if (d->rtt_ns && k < d->total)
        d->rtt_ns[k] = now_ns() - d->t_last;
    if (sh_msg_header(m)->type != SH_MSG_PONG)
        atomic_fetch_add(&d->failed, 1);
    if (d->sent < d->total)
        drive_one(ctx, d);
    atomic_fetch_add(&d->done, 1);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable drive_vt = {
    .name = "drive", .state_size = sizeof(drive *), .init = drive_init, .handle = drive_handle};

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* A {"d": bin(n)} body of about n bytes. */
static uint8_t *make_body(size_t n, size_t *len)
{
    uint8_t *b = calloc(1, n + 8);
    b[0] = 0x81, b[1] = 0xa1, b[2] = 'd', b[3] = 0xc6;
    uint32_t be = __builtin_bswap32((uint32_t)n);
    memcpy(b + 4, &be, 4);
    *len = n + 8;
    return b;
}

static double run(sh_runtime *rt, sh_addr peer, uint32_t total, uint32_t window, size_t body_n,
                  uint64_t *rtt, uint32_t *failed)
{
    drive d = {.peer = peer, .total = total, .window = window, .rtt_ns = rtt};
    d.body = make_body(body_n, &d.body_len);
    uint64_t t0 = now_ns();
    sh_addr a;
    sh_actor_spawn(rt, "drive", &d, 0, &a, NULL);
    while (atomic_load(&d.done) < total && now_ns() - t0 < 60000000000ull) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    sh_actor_stop(rt, a);
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
    *failed = atomic_load(&d.failed) + (total - atomic_load(&d.done));
    free(d.body);
    return secs;
}

/* The baseline: length-prefixed frames over a Unix stream socketpair to a forked reader. */
static double unix_copy(size_t frame, uint32_t n)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 0;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        uint8_t *buf = malloc(frame);
        for (uint32_t i = 0; i < n; i++) {
            uint64_t len = 0;
            if (read(sv[1], &len, 8) != 8)
                _exit(1);
            for (size_t got = 0; got < len;) {
                ssize_t k = read(sv[1], buf, len - got < frame ? len - got : frame);
                if (k <= 0)
                    _exit(1);
                got += (size_t)k;
            }
        }
        (void)write(sv[1], "k", 1);
        _exit(0);
    }
    close(sv[1]);
    uint8_t *buf = calloc(1, frame);
    uint64_t t0 = now_ns();
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = frame;
        (void)write(sv[0], &len, 8);
        for (size_t off = 0; off < frame;) {
            ssize_t k = write(sv[0], buf + off, frame - off);
            if (k <= 0)
                break;
            off += (size_t)k;
        }
    }
    char c;
    (void)read(sv[0], &c, 1);
    double secs = (double)(now_ns() - t0) / 1e9;
    close(sv[0]);
    waitpid(pid, NULL, 0);
    free(buf);
    return (double)frame * n / secs / 1e9;
}

/* The latency floor: 64-byte ping-pong over a Unix socketpair with a forked echo, blocking reads
 * and writes. Returns the median one-way time in microseconds. */
static double unix_pingpong(uint32_t n)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 0;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        uint8_t b[64];
        while (read(sv[1], b, sizeof b) == (ssize_t)sizeof b)
            if (write(sv[1], b, sizeof b) != (ssize_t)sizeof b)
                break;
        _exit(0);
    }
    close(sv[1]);
    uint64_t *rtt = calloc(n, sizeof *rtt);
    uint8_t b[64] = {0};
    for (uint32_t i = 0; i < n; i++) {
        uint64_t t0 = now_ns();
        if (write(sv[0], b, sizeof b) != (ssize_t)sizeof b ||
            read(sv[0], b, sizeof b) != (ssize_t)sizeof b)
            break;
        rtt[i] = now_ns() - t0;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    qsort(rtt, n, sizeof *rtt, cmp_u64);
    double med = rtt[n / 2] / 2e3;
    free(rtt);
    return med;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    int tuned = 0, rounds = 3, bulk_only = 0, use_nng = 0, use_tcp = 0;
    uint32_t window = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mallopt")) {
            tuned = 1;
        } else if (!strcmp(argv[i], "--nng")) {
            use_nng = 1;
        } else if (!strcmp(argv[i], "--tcp")) {
            use_tcp = 1;
        } else if (!strcmp(argv[i], "--window") && i + 1 < argc) {
            window = (uint32_t)atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--bulk")) {
            bulk_only = 1;
        } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
        } else {
            fprintf(stderr,
                    "usage: %s [--tcp] [--nng] [--mallopt] [--rounds N] [--window N] [--bulk]\n",
                    argv[0]);
            return 2;
        }
    }
    if (rounds < 1 || rounds > 16)
        rounds = 3;
    if (window < 1)
        window = 4;
    if (tuned && (!mallopt(M_MMAP_THRESHOLD, 32 << 20) || !mallopt(M_TRIM_THRESHOLD, 256 << 20)))
        fprintf(stderr, "mallopt failed\n");
    signal(SIGPIPE, SIG_IGN);
    char dir[64] = "/tmp/shoal-bench-XXXXXX", u1[128], u2[128], p1[160];
    if (!mkdtemp(dir))
        return 1;
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    snprintf(u2, sizeof u2, "ipc://%s/n2", dir);
    if (use_tcp) { /* two loopback ports picked from the pid */
        int port = 20000 + (int)(getpid() % 10000) * 2;
        snprintf(u1, sizeof u1, "tcp://127.0.0.1:%d", port);
        snprintf(u2, sizeof u2, "tcp://127.0.0.1:%d", port + 1);
    }
    const char *scheme = use_tcp ? "tcp" : "ipc";
    snprintf(p1, sizeof p1, "%s", u1);
    int ready[2], hold[2]; /* child -> parent: echo address; parent -> child: EOF = stop */
    if (pipe(ready) || pipe(hold))
        return 1;
    pid_t pid = fork(); /* before any runtime or NNG state exists in this process */
    if (pid == 0) {
        sh_runtime_opts ro = {.node_id = 2, .log_level = SH_LOG_LEVEL_ERROR};
        sh_runtime *rt = NULL;
        sh_transport *tp = NULL;
        sh_transport_opts to = {.listen_url = u2, .use_nng = use_nng};
        sh_addr echo;
        if (sh_runtime_create(&ro, &rt, NULL) || sh_transport_create(rt, &to, &tp, NULL) ||
            sh_transport_peer_add(tp, 1, p1, NULL) || sh_runtime_register(rt, &echo_vt, NULL) ||
            sh_actor_spawn(rt, "echo", NULL, 0, &echo, NULL))
            _exit(1);
        (void)write(ready[1], &echo, sizeof echo);
        char c;
        close(hold[1]);
        while (read(hold[0], &c, 1) > 0) {
        }
        sh_transport_close(tp);
        sh_runtime_destroy(rt);
        sh_transport_destroy(tp);
        _exit(0);
    }
    sh_addr echo = 0;
    if (read(ready[0], &echo, sizeof echo) != sizeof echo)
        return 1;
    close(ready[0]);
    close(hold[0]);
    sh_runtime_opts ro = {.node_id = 1, .log_level = SH_LOG_LEVEL_ERROR};
    sh_runtime *rt = NULL;
    sh_transport *tp = NULL;
    sh_transport_opts to = {.listen_url = u1, .queue_max_msgs = 4096, .use_nng = use_nng};
    const char *engine = use_nng ? "nng" : "shoal";
    if (sh_runtime_create(&ro, &rt, NULL) || sh_transport_create(rt, &to, &tp, NULL) ||
        sh_transport_peer_add(tp, 2, u2, NULL) || sh_runtime_register(rt, &drive_vt, NULL))
        return 1;
    uint32_t failed = 0;
    run(rt, echo, 2000, 1, 48, NULL, &failed); /* warm up: connect, fill the pools */

    if (!bulk_only) {
        uint32_t n = 200000;
        double s = run(rt, echo, n, 512, 48, NULL, &failed);
        printf("{\"bench\":\"transport_rate\",\"url\":\"%s\",\"engine\":\"%s\",\"msg_bytes\":64,"
               "\"round_trips\":%u,\"msgs_per_s\":%.0f,\"failed\":%u}\n",
               scheme, engine, n, 2.0 * n / s, failed);

        uint32_t nl = 20000;
        uint64_t *rtt = calloc(nl, sizeof *rtt);
        run(rt, echo, nl, 1, 48, rtt, &failed);
        qsort(rtt, nl, sizeof *rtt, cmp_u64);
        printf("{\"bench\":\"transport_latency\",\"url\":\"%s\",\"engine\":\"%s\",\"msg_bytes\":64,"
               "\"samples\":%u,\"one_way_median_us\":%.2f,\"one_way_p99_us\":%.2f,"
               "\"unix_socket_one_way_median_us\":%.2f,\"failed\":%u}\n",
               scheme, engine, nl, rtt[nl / 2] / 2e3, rtt[nl * 99 / 100] / 2e3, unix_pingpong(nl),
               failed);
        fflush(stdout);
        free(rtt);
    }

    size_t sizes[2] = {1u << 20, 8u << 20};
    for (int i = 0; i < 2; i++) {
        uint32_t frames = i == 0 ? 2000 : 250;
        double ratios[16];
        for (int r = 0; r < rounds; r++) {
            double base0 = unix_copy(sizes[i], frames);
            sh_transport_stats st0, st1;
            sh_transport_stats_get(tp, &st0);
            double secs = run(rt, echo, frames, window, sizes[i], NULL, &failed);
            sh_transport_stats_get(tp, &st1);
            double base1 = unix_copy(sizes[i], frames);
            double gbs = (double)sizes[i] * frames / secs / 1e9;
            double base = (base0 + base1) / 2;
            ratios[r] = base > 0 ? gbs / base : 0;
            /* bytes_sent: what the transport wrote for the run, the proof that it moved the data */
            printf("{\"bench\":\"transport_bulk\",\"url\":\"%s\",\"engine\":\"%s\",\"mallopt\":%d,"
                   "\"round\":%d,\"frame_bytes\":%zu,\"frames\":%u,\"bytes_sent\":%llu,"
                   "\"gb_per_s\":%.3f,\"unix_socket_gb_per_s\":%.3f,\"unix_before\":%.3f,"
                   "\"unix_after\":%.3f,\"ratio\":%.2f,\"failed\":%u}\n",
                   scheme, engine, tuned, r, sizes[i], frames,
                   (unsigned long long)(st1.bytes_sent - st0.bytes_sent), gbs, base, base0, base1,
                   ratios[r], failed);
            fflush(stdout);
        }
        qsort(ratios, (size_t)rounds, sizeof ratios[0], cmp_double);
        printf("{\"bench\":\"transport_bulk_summary\",\"url\":\"%s\",\"engine\":\"%s\","
               "\"mallopt\":%d,\"frame_bytes\":%zu,\"rounds\":%d,\"ratio_min\":%.2f,"
               "\"ratio_median\":%.2f,\"ratio_max\":%.2f}\n",
               scheme, engine, tuned, sizes[i], rounds, ratios[0], ratios[rounds / 2],
               ratios[rounds - 1]);
        fflush(stdout);
    }
    sh_transport_close(tp);
    sh_runtime_destroy(rt);
    sh_transport_destroy(tp);
    close(hold[1]);
    waitpid(pid, NULL, 0);
    char path[160];
    snprintf(path, sizeof path, "%s/n1", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/n2", dir);
    unlink(path);
    rmdir(dir);
    return 0;
}
