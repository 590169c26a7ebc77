/* Runtime core tests: spawn/stop, ping-pong, ordering, producers, fairness, isolation, shutdown. */
#include <pthread.h>

#include "test_runtime_util.h"

/* ---- Actor kinds used below -------------------------------------------------------------- */

/* What the test thread watches; actors get a pointer to it through init's arg. */
typedef struct shared {
    _Atomic long got;     /* messages handled */
    _Atomic long stopped; /* stop members called */
    _Atomic long errors;  /* ERROR messages received */
    _Atomic long bad;     /* out-of-order or unexpected messages */
    _Atomic long done;
    sh_addr peer;
    long rounds;
    uint32_t last[16]; /* per sender: next expected sequence number (sink only) */
} shared;

typedef struct sink_state {
    shared *sh;
} sink_state;

static sh_err sink_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    ((sink_state *)state)->sh = arg;
    return SH_OK;
}

/* Counts messages and checks per-sender order (the body carries sender and sequence). */
static sh_msg_fate sink_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    shared *sh = ((sink_state *)state)->sh;
    if (sh_msg_header(m)->type == SH_MSG_ERROR) {
        atomic_fetch_add(&sh->errors, 1);
        return SH_MSG_FATE_DONE;
    }
    uint32_t who, seq;
    body_read(m, &who, &seq);
    if (who < 16) {
        if (seq != sh->last[who])
            atomic_fetch_add(&sh->bad, 1);
        sh->last[who] = seq + 1;
    }
    atomic_fetch_add(&sh->got, 1);
    return SH_MSG_FATE_DONE;
}

static void sink_stop(sh_actor_ctx *ctx, void *state)
{
    atomic_fetch_add(&((sink_state *)state)->sh->stopped, 1);
}

static const sh_actor_vtable sink_vt = {
    .name = "sink",
    .state_size = sizeof(sink_state),
    .init = sink_init,
    .handle = sink_handle,
    .stop = sink_stop,
};

/* Answers every request with a PONG carrying the same body. */
static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->session != 0 && h->type == SH_MSG_PING) {
        size_t n;
        const void *b = sh_msg_body(m, &n);
        CHECK_OK(sh_reply(ctx, m, SH_MSG_PONG, b, n, NULL));
    }
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

/* Sends `rounds` requests to sh->peer one after another; counts the answers. */
typedef struct pinger_state {
    shared *sh;
    uint64_t session;
    uint32_t seq;
} pinger_state;

static void ping_next(sh_actor_ctx *ctx, pinger_state *st)
{
    uint8_t b[13];
    body_make(b, 0, st->seq);
    CHECK_OK(sh_request(ctx, st->sh->peer, SH_MSG_PING, b, sizeof b, 5000, &st->session, NULL));
}

static sh_err pinger_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    pinger_state *st = state;
    st->sh = arg;
    ping_next(ctx, st);
    return SH_OK;
}

static sh_msg_fate pinger_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    pinger_state *st = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    uint32_t who, seq;
    body_read(m, &who, &seq);
    if (h->type != SH_MSG_PONG || h->session != st->session || seq != st->seq) {
        atomic_fetch_add(&st->sh->bad, 1);
        return SH_MSG_FATE_DONE;
    }
    atomic_fetch_add(&st->sh->got, 1);
    if (++st->seq < st->sh->rounds)
        ping_next(ctx, st);
    else
        atomic_store(&st->sh->done, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable pinger_vt = {
    .name = "pinger",
    .state_size = sizeof(pinger_state),
    .init = pinger_init,
    .handle = pinger_handle,
};

static void register_all(sh_runtime *rt)
{
    CHECK_OK(sh_runtime_register(rt, &sink_vt, NULL));
    CHECK_OK(sh_runtime_register(rt, &echo_vt, NULL));
    CHECK_OK(sh_runtime_register(rt, &pinger_vt, NULL));
}

/* ---- Tests -------------------------------------------------------------------------------- */

static void test_spawn_stop(void)
{
    test_rt t;
    rt_start(&t, 7, 2, NULL);
    register_all(t.rt);
    shared sh = {0};
    sh_addr a[3];
    for (int i = 0; i < 3; i++)
        CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, SH_ACTOR_LOOP_ANY, &a[i], NULL));
    CHECK_UINT_EQ(sh_addr_node(a[0]), 7);
    CHECK(a[0] != a[1] && a[1] != a[2]);
    CHECK_OK(send_body(t.rt, 0, a[1], 0, SH_MSG_PING, 0, 0));
    CHECK(wait_ge(&sh.got, 1, 5000));
    CHECK_OK(sh_actor_stop(t.rt, a[1]));
    CHECK_INT_EQ(sh_actor_stop(t.rt, a[1]), SH_ENOTFOUND);
    CHECK(wait_ge(&sh.stopped, 1, 5000));
    /* A fresh spawn never reuses the stopped actor's id. */
    sh_addr b;
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 0, &b, NULL));
    CHECK(b != a[0] && b != a[1] && b != a[2]);
    /* Init runs before the first message; an actor stopped before its init ran gets neither
     * init nor stop, so make sure every sink got going. */
    for (int i = 0; i < 3; i++)
        if (i != 1)
            CHECK_OK(send_body(t.rt, 0, a[i], 0, SH_MSG_PING, 0, 0));
    CHECK_OK(send_body(t.rt, 0, b, 0, SH_MSG_PING, 1, 0));
    CHECK(wait_ge(&sh.got, 4, 5000));
    CHECK_INT_EQ(sh_actor_stop(t.rt, sh_addr_make(8, 1)), SH_EINVAL);
    CHECK_INT_EQ(sh_actor_stop(t.rt, sh_addr_make(7, 999)), SH_ENOTFOUND);
    rt_finish(&t);
    CHECK_INT_EQ(atomic_load(&sh.stopped), 4); /* destroy stopped the other three */
}

static void pingpong(uint32_t loops, int ping_loop, int echo_loop)
{
    test_rt t;
    rt_start(&t, 1, loops, NULL);
    register_all(t.rt);
    shared sh = {0};
    sh.rounds = 2000;
    CHECK_OK(sh_actor_spawn(t.rt, "echo", NULL, echo_loop, &sh.peer, NULL));
    sh_addr p;
    CHECK_OK(sh_actor_spawn(t.rt, "pinger", &sh, ping_loop, &p, NULL));
    CHECK(wait_ge(&sh.done, 1, 20000));
    CHECK_INT_EQ(atomic_load(&sh.got), 2000);
    CHECK_INT_EQ(atomic_load(&sh.bad), 0);
    rt_finish(&t);
    CHECK_UINT_EQ(t.fin.msgs_handled, 4000);
    CHECK_UINT_EQ(t.fin.timeouts, 0);
}

static void test_pingpong_same_loop(void) { pingpong(1, 0, 0); }
static void test_pingpong_cross_loop(void) { pingpong(2, 0, 1); }

typedef struct producer {
    sh_runtime *rt;
    sh_addr dst;
    uint32_t who, n;
} producer;

static void *produce(void *arg)
{
    producer *p = arg;
    for (uint32_t i = 0; i < p->n; i++) {
        sh_err err;
        while ((err = send_body(p->rt, 0, p->dst, 0, SH_MSG_PING, p->who, i)) == SH_ENOMEM)
            sleep_ms(1);
        if (err) {
            CHECK_OK(err);
            break;
        }
    }
    return NULL;
}

/* Several threads flood one mailbox; every message arrives, in order per sender. */
static void test_many_producers(void)
{
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    register_all(t.rt);
    shared sh = {0};
    sh_addr dst;
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 1, &dst, NULL));
    enum { N_THREADS = 4, PER = 20000 };
    pthread_t th[N_THREADS];
    producer pr[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        pr[i] = (producer){t.rt, dst, (uint32_t)i, PER};
        pthread_create(&th[i], NULL, produce, &pr[i]);
    }
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    CHECK(wait_ge(&sh.got, N_THREADS * PER, 30000));
    CHECK_INT_EQ(atomic_load(&sh.got), N_THREADS * PER);
    CHECK_INT_EQ(atomic_load(&sh.bad), 0);
    for (int i = 0; i < N_THREADS; i++)
        CHECK_UINT_EQ(sh.last[i], PER);
    rt_finish(&t);
}

/* A flooder keeps 256 messages to itself in flight forever; a second actor on the same loop
 * must still get every message sent to it, promptly. */
static sh_err flood_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    *(shared **)state = arg;
    for (int i = 0; i < 256; i++)
        CHECK_OK(sh_actor_send(ctx, sh_actor_self(ctx), SH_MSG_PING, NULL, 0, NULL));
    return SH_OK;
}

static sh_msg_fate flood_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    atomic_fetch_add(&(*(shared **)state)->got, 1);
    CHECK_OK(sh_actor_send(ctx, sh_actor_self(ctx), SH_MSG_PING, NULL, 0, NULL));
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable flood_vt = {
    .name = "flood", .state_size = sizeof(shared *), .init = flood_init, .handle = flood_handle};

static void test_fairness(void)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    register_all(t.rt);
    CHECK_OK(sh_runtime_register(t.rt, &flood_vt, NULL));
    shared fl = {0}, sh = {0};
    sh_addr f, s;
    CHECK_OK(sh_actor_spawn(t.rt, "flood", &fl, 0, &f, NULL));
    CHECK(wait_ge(&fl.got, 10000, 10000)); /* the flood is running */
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 0, &s, NULL));
    uint64_t t0 = now_ms();
    for (uint32_t i = 0; i < 100; i++)
        CHECK_OK(send_body(t.rt, 0, s, 0, SH_MSG_PING, 0, i));
    CHECK(wait_ge(&sh.got, 100, 10000));
    uint64_t dt = now_ms() - t0;
    CHECK(dt < 5000);
    CHECK_INT_EQ(atomic_load(&sh.bad), 0);
    long before = atomic_load(&fl.got);
    sleep_ms(20);
    CHECK(atomic_load(&fl.got) > before); /* and the flooder was not starved either */
    rt_finish(&t);
}

/* Requests to an unknown actor and to a stopped one come back as ERROR with the session. */
static void test_dead_actor_error(void)
{
    test_rt t;
    rt_start(&t, 3, 2, NULL);
    register_all(t.rt);
    shared sh = {0}, dead = {0};
    sh_addr s, d;
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 0, &s, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &dead, 1, &d, NULL));
    CHECK_OK(send_body(t.rt, 0, d, 0, SH_MSG_PING, 0, 0));
    CHECK(wait_ge(&dead.got, 1, 5000));
    CHECK_OK(sh_actor_stop(t.rt, d));
    CHECK(wait_ge(&dead.stopped, 1, 5000));
    /* From the sink's address: the runtime answers it, as if the sink had asked. */
    CHECK_OK(send_body(t.rt, s, sh_addr_make(3, 4242), 77, SH_MSG_PING, 0, 0));
    CHECK_OK(send_body(t.rt, s, d, 78, SH_MSG_PING, 0, 0));
    /* Not requests: dropped silently (session 0, or an ERROR). */
    CHECK_OK(send_body(t.rt, s, d, 0, SH_MSG_PING, 0, 0));
    CHECK(wait_ge(&sh.errors, 2, 5000));
    sleep_ms(20);
    CHECK_INT_EQ(atomic_load(&sh.errors), 2);
    sh_runtime_stats st;
    sh_runtime_stats_get(t.rt, &st);
    CHECK_UINT_EQ(st.undeliverable, 3);
    CHECK_UINT_EQ(st.errors_sent, 2);
    /* Remote destination without a transport: a clear error, nothing sent. */
    CHECK_INT_EQ(send_body(t.rt, s, sh_addr_make(4, 1), 0, SH_MSG_PING, 0, 0), SH_EUNSUPPORTED);
    CHECK_INT_EQ(send_body(t.rt, s, 0, 0, SH_MSG_PING, 0, 0), SH_EINVAL);
    CHECK_INT_EQ(send_body(t.rt, s, d, 0, 200, 0, 0), SH_EINVAL);
    rt_finish(&t);
}

/* Two or three runtimes in one process, even with the same node id, never see each other. */
static void test_isolation(void)
{
    test_rt t[3];
    shared sh[3] = {{0}};
    sh_addr a[3];
    for (int i = 0; i < 3; i++) {
        rt_start(&t[i], i == 2 ? 2 : 1, 1, NULL);
        register_all(t[i].rt);
        CHECK_OK(sh_actor_spawn(t[i].rt, "sink", &sh[i], 0, &a[i], NULL));
    }
    CHECK(a[0] == a[1]); /* same node id, same first actor id: distinct actors all the same */
    for (int i = 0; i < 3; i++)
        for (uint32_t k = 0; k < (uint32_t)(i + 1) * 10; k++)
            CHECK_OK(send_body(t[i].rt, 0, a[i], 0, SH_MSG_PING, 0, k));
    for (int i = 0; i < 3; i++)
        CHECK(wait_ge(&sh[i].got, (i + 1) * 10, 5000));
    sleep_ms(20);
    for (int i = 0; i < 3; i++)
        CHECK_INT_EQ(atomic_load(&sh[i].got), (i + 1) * 10);
    rt_finish(&t[1]);
    CHECK_OK(send_body(t[0].rt, 0, a[0], 0, SH_MSG_PING, 0, 10));
    CHECK(wait_ge(&sh[0].got, 11, 5000));
    rt_finish(&t[0]);
    rt_finish(&t[2]);
}

/* A slow actor with thousands of queued messages, requests among them, is torn down cleanly;
 * the requester (still alive while the queue drains) gets ERRORs or is itself stopped. */
static sh_msg_fate slow_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    sleep_ms(1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable slow_vt = {.name = "slow", .handle = slow_handle};

static void test_shutdown_queued(void)
{
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    register_all(t.rt);
    CHECK_OK(sh_runtime_register(t.rt, &slow_vt, NULL));
    shared sh = {0};
    sh_addr slow, s;
    CHECK_OK(sh_actor_spawn(t.rt, "slow", NULL, 0, &slow, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 1, &s, NULL));
    for (uint32_t i = 0; i < 5000; i++)
        CHECK_OK(send_body(t.rt, i % 2 ? s : 0, slow, i % 2 ? i : 0, SH_MSG_PING, 0, i));
    sh_runtime_stats st;
    sh_runtime_stats_get(t.rt, &st);
    CHECK(st.msgs_live > 1000);
    rt_finish(&t);
}

static sh_msg_fate nop_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable no_handle_vt = {.name = "nohandle"};
static const sh_actor_vtable bad_name_vt = {.name = "Bad Name", .handle = nop_handle};
static const sh_actor_vtable no_name_vt = {.handle = nop_handle};
static const sh_actor_vtable sink2_vt = {.name = "sink", .handle = nop_handle};

static void test_bad_vtable(void)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_error e = {0};
    CHECK_INT_EQ(sh_runtime_register(t.rt, NULL, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_runtime_register(t.rt, &no_handle_vt, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "handle") != NULL);
    CHECK_INT_EQ(sh_runtime_register(t.rt, &bad_name_vt, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_runtime_register(t.rt, &no_name_vt, &e), SH_EINVAL);
    CHECK_OK(sh_runtime_register(t.rt, &sink_vt, &e));
    CHECK_OK(sh_runtime_register(t.rt, &sink_vt, &e)); /* the same vtable again is fine */
    CHECK_INT_EQ(sh_runtime_register(t.rt, &sink2_vt, &e), SH_EBUSY);
    sh_addr a = 0;
    CHECK_INT_EQ(sh_actor_spawn(t.rt, "nohandle", NULL, 0, &a, &e), SH_ENOTFOUND);
    CHECK_INT_EQ(sh_actor_spawn(t.rt, "sink", NULL, 1, &a, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_actor_spawn(t.rt, "sink", NULL, -2, &a, &e), SH_EINVAL);
    CHECK(a == 0);
    sh_runtime_opts bad = {0};
    sh_runtime *rt = NULL;
    CHECK_INT_EQ(sh_runtime_create(&bad, &rt, &e), SH_EINVAL); /* node 0 */
    bad.node_id = 1;
    bad.n_loops = 65;
    CHECK_INT_EQ(sh_runtime_create(&bad, &rt, &e), SH_EINVAL);
    CHECK(rt == NULL);
    sh_runtime_destroy(NULL);
    rt_finish(&t);
}

/* init failing: the actor stops without its stop member; its queued requests get ERRORs. */
static sh_err failinit_init(sh_actor_ctx *ctx, void *state, void *arg) { return SH_EINVAL; }
static void failinit_stop(sh_actor_ctx *ctx, void *state) { CHECK(0); }
static const sh_actor_vtable failinit_vt = {
    .name = "failinit", .init = failinit_init, .handle = nop_handle, .stop = failinit_stop};

static void test_init_fails(void)
{
    test_rt t;
    sh_runtime_opts o = {.log_level = SH_LOG_LEVEL_ERROR, .log_file = stdout};
    rt_start(&t, 1, 1, &o);
    register_all(t.rt);
    CHECK_OK(sh_runtime_register(t.rt, &failinit_vt, NULL));
    shared sh = {0};
    sh_addr s, f;
    CHECK_OK(sh_actor_spawn(t.rt, "sink", &sh, 0, &s, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "failinit", NULL, 0, &f, NULL));
    CHECK_OK(send_body(t.rt, s, f, 5, SH_MSG_PING, 0, 0));
    CHECK(wait_ge(&sh.errors, 1, 5000));
    rt_finish(&t);
}

static const sh_test_case tests[] = {
    {"spawn_stop", test_spawn_stop},
    {"pingpong_same_loop", test_pingpong_same_loop},
    {"pingpong_cross_loop", test_pingpong_cross_loop},
    {"many_producers", test_many_producers},
    {"fairness", test_fairness},
    {"dead_actor_error", test_dead_actor_error},
    {"isolation", test_isolation},
    {"shutdown_queued", test_shutdown_queued},
    {"bad_vtable", test_bad_vtable},
    {"init_fails", test_init_fails},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
