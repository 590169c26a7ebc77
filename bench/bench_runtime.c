/* bench_runtime: actor-to-actor message rate (same loop, cross loop) and request round trips. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/msg.h"
#include "shoal/runtime.h"

/* Prints one JSON object per line. Throughput: a producer keeps a window of WINDOW messages of
 * 64 body bytes in flight to a consumer, which acks every ACK_EVERY; the figure is messages
 * delivered per second of wall time. Latency: one request in flight at a time, echoed back. */

#define WINDOW 4096
#define ACK_EVERY 512
#define BODY_BYTES 64

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint8_t body[BODY_BYTES];

typedef struct cfg {
    long total;
    sh_addr consumer, producer;
    _Atomic int done;
    uint64_t t_end;
    uint64_t *rtt; /* latency samples */
    long n_rtt;
} cfg;

typedef struct prod_state {
    cfg *c;
    long sent;
    uint64_t t0;
} prod_state;

static void send_some(sh_actor_ctx *ctx, prod_state *st, long n)
{
    for (long i = 0; i < n && st->sent < st->c->total; i++, st->sent++) {
        sh_err err = sh_actor_send(ctx, st->c->consumer, SH_MSG_TOKEN, body, sizeof body, NULL);
        if (err) {
            fprintf(stderr, "send: %s\n", sh_strerror(err));
            exit(1);
        }
    }
}

static sh_err prod_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    prod_state *st = state;
    st->c = arg;
    send_some(ctx, st, WINDOW);
    return SH_OK;
}

static sh_msg_fate prod_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    send_some(ctx, state, ACK_EVERY);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable prod_vt = {
    .name = "prod", .state_size = sizeof(prod_state), .init = prod_init, .handle = prod_handle};

typedef struct cons_state {
    cfg *c;
    long got;
} cons_state;

static sh_err cons_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    ((cons_state *)state)->c = arg;
    return SH_OK;
}

static sh_msg_fate cons_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    cons_state *st = state;
    if (++st->got % ACK_EVERY == 0)
        sh_actor_send(ctx, st->c->producer, SH_MSG_CONTROL, NULL, 0, NULL);
    if (st->got == st->c->total) {
        st->c->t_end = now_ns();
        atomic_store(&st->c->done, 1);
    }
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable cons_vt = {
    .name = "cons", .state_size = sizeof(cons_state), .init = cons_init, .handle = cons_handle};

static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    size_t n;
    const void *b = sh_msg_body(m, &n);
    sh_reply(ctx, m, SH_MSG_PONG, b, n, NULL);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

typedef struct ping_state {
    cfg *c;
    long i;
    uint64_t t0;
} ping_state;

static void ping(sh_actor_ctx *ctx, ping_state *st)
{
    st->t0 = now_ns();
    sh_request(ctx, st->c->consumer, SH_MSG_PING, body, sizeof body, 10000, NULL, NULL);
}

static sh_err ping_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    ping_state *st = state;
    st->c = arg;
    ping(ctx, st);
    return SH_OK;
}

static sh_msg_fate ping_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    ping_state *st = state;
    st->c->rtt[st->i++] = now_ns() - st->t0;
    if (st->i < st->c->n_rtt)
        ping(ctx, st);
    else
        atomic_store(&st->c->done, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable ping_vt = {
    .name = "ping", .state_size = sizeof(ping_state), .init = ping_init, .handle = ping_handle};

static sh_runtime *start(uint32_t loops)
{
    sh_runtime_opts o = {.node_id = 1, .n_loops = loops, .mailbox_warn = 1u << 30};
    sh_runtime *rt = NULL;
    sh_error e;
    if (sh_runtime_create(&o, &rt, &e)) {
        fprintf(stderr, "create: %s\n", e.msg);
        exit(1);
    }
    sh_runtime_register(rt, &prod_vt, NULL);
    sh_runtime_register(rt, &cons_vt, NULL);
    sh_runtime_register(rt, &echo_vt, NULL);
    sh_runtime_register(rt, &ping_vt, NULL);
    return rt;
}

static void wait_done(cfg *c)
{
    while (!atomic_load(&c->done)) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

static void throughput(const char *name, int cross, long total)
{
    sh_runtime *rt = start(cross ? 2 : 1);
    cfg c = {.total = total};
    sh_actor_spawn(rt, "cons", &c, cross ? 1 : 0, &c.consumer, NULL);
    /* The producer's address must be known before it starts sending: reserve it by spawning
     * the producer last, after the consumer knows where acks go (ids are sequential). */
    c.producer = sh_addr_make(1, sh_addr_actor(c.consumer) + 1);
    uint64_t t0 = now_ns();
    sh_addr p;
    sh_actor_spawn(rt, "prod", &c, 0, &p, NULL);
    wait_done(&c);
    double s = (double)(c.t_end - t0) / 1e9;
    sh_runtime_stats st;
    sh_runtime_stats_get(rt, &st);
    printf("{\"bench\":\"runtime\",\"case\":\"%s\",\"msgs\":%ld,\"body_bytes\":%d,\"seconds\":%.4f,"
           "\"msgs_per_s\":%.0f,\"pool_hit_ratio\":%.4f}\n",
           name, total, BODY_BYTES, s, (double)total / s,
           (double)st.pool_hits / (double)(st.pool_hits + st.pool_misses));
    fflush(stdout);
    sh_runtime_destroy(rt);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void latency(const char *name, int cross, long n)
{
    sh_runtime *rt = start(cross ? 2 : 1);
    cfg c = {.n_rtt = n, .rtt = calloc((size_t)n, sizeof(uint64_t))};
    sh_actor_spawn(rt, "echo", NULL, cross ? 1 : 0, &c.consumer, NULL);
    sh_addr p;
    sh_actor_spawn(rt, "ping", &c, 0, &p, NULL);
    wait_done(&c);
    qsort(c.rtt, (size_t)n, sizeof(uint64_t), cmp_u64);
    printf("{\"bench\":\"runtime\",\"case\":\"%s\",\"round_trips\":%ld,\"median_us\":%.2f,"
           "\"p99_us\":%.2f,\"max_us\":%.2f}\n",
           name, n, (double)c.rtt[n / 2] / 1e3, (double)c.rtt[n * 99 / 100] / 1e3,
           (double)c.rtt[n - 1] / 1e3);
    fflush(stdout);
    sh_runtime_destroy(rt);
    free(c.rtt);
}

int main(int argc, char **argv)
{
    long total = argc > 1 ? atol(argv[1]) : 2000000;
    long rtts = argc > 2 ? atol(argv[2]) : 20000;
    body[0] = 0x81; /* {"d": bin(59)}: 64 bytes in all */
    body[1] = 0xa1;
    body[2] = 'd';
    body[3] = 0xc4;
    body[4] = BODY_BYTES - 5;
    throughput("msgs_same_loop", 0, total);
    throughput("msgs_cross_loop", 1, total);
    latency("rtt_same_loop", 0, rtts);
    latency("rtt_cross_loop", 1, rtts);
    return 0;
}
