/* Runtime tests of time: request deadlines, late replies, actor timers, stalls, overload, hooks. */
#include <pthread.h>

#include "test_runtime_util.h"

/* Log lines captured from a runtime's callback sink. */
typedef struct logcap {
    pthread_mutex_t mu;
    char text[16384];
    size_t len;
} logcap;

static void log_capture(void *ud, sh_log_level level, const char *line, size_t len)
{
    logcap *c = ud;
    pthread_mutex_lock(&c->mu);
    if (c->len + len + 2 < sizeof c->text) {
        memcpy(c->text + c->len, line, len);
        c->len += len;
        c->text[c->len++] = '\n';
        c->text[c->len] = 0;
    }
    pthread_mutex_unlock(&c->mu);
}

static int log_has(logcap *c, const char *s)
{
    pthread_mutex_lock(&c->mu);
    int r = strstr(c->text, s) != NULL;
    if (!r)
        fprintf(stderr, "log lacks \"%s\"; it holds:\n%s", s, c->text);
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* ---- Requester and repliers ---------------------------------------------------------------- */

typedef struct req_cfg {
    sh_addr peer;
    uint32_t deadline_ms;
    _Atomic long answers;  /* anything delivered to the requester */
    _Atomic long timeouts; /* ERROR SH_ETIMEDOUT with the right session */
    _Atomic long notfound; /* ERROR SH_ENOTFOUND with the right session */
    _Atomic long replies;  /* PONG with the right session */
    _Atomic long elapsed_ms;
    uint64_t t0;
} req_cfg;

typedef struct req_state {
    req_cfg *cfg;
    uint64_t session;
} req_state;

static sh_err req_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    req_state *st = state;
    st->cfg = arg;
    st->cfg->t0 = now_ms();
    return sh_request(ctx, st->cfg->peer, SH_MSG_PING, NULL, 0, st->cfg->deadline_ms, &st->session,
                      NULL);
}

static sh_msg_fate req_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    req_state *st = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    CHECK_UINT_EQ(h->session, st->session);
    CHECK(h->dst == sh_actor_self(ctx));
    if (h->type == SH_MSG_ERROR) {
        sh_err code = sh_msg_error_code(m);
        if (code == SH_ETIMEDOUT)
            atomic_fetch_add(&st->cfg->timeouts, 1);
        else if (code == SH_ENOTFOUND)
            atomic_fetch_add(&st->cfg->notfound, 1);
        CHECK(h->src == st->cfg->peer);
    } else if (h->type == SH_MSG_PONG) {
        atomic_fetch_add(&st->cfg->replies, 1);
    }
    atomic_store(&st->cfg->elapsed_ms, (long)(now_ms() - st->cfg->t0));
    atomic_fetch_add(&st->cfg->answers, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable req_vt = {
    .name = "req", .state_size = sizeof(req_state), .init = req_init, .handle = req_handle};

/* Never answers. */
static sh_msg_fate mute_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable mute_vt = {.name = "mute", .handle = mute_handle};

/* Keeps each request and answers it from a timer 150 ms later (after the requester's deadline). */
typedef struct late_state {
    sh_msg *held;
} late_state;

static sh_msg_fate late_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    late_state *st = state;
    CHECK(st->held == NULL);
    st->held = m;
    CHECK_OK(sh_actor_timer_start(ctx, 150, 0, 1, NULL));
    return SH_MSG_FATE_KEPT;
}

static void late_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    late_state *st = state;
    CHECK_UINT_EQ(tag, 1);
    CHECK_OK(sh_reply(ctx, st->held, SH_MSG_PONG, NULL, 0, NULL));
    sh_msg_free(st->held);
    st->held = NULL;
}

static void late_stop(sh_actor_ctx *ctx, void *state) { sh_msg_free(((late_state *)state)->held); }

static const sh_actor_vtable late_vt = {.name = "late",
                                        .state_size = sizeof(late_state),
                                        .handle = late_handle,
                                        .stop = late_stop,
                                        .timer = late_timer};

static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    CHECK_OK(sh_reply(ctx, m, SH_MSG_PONG, NULL, 0, NULL));
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

static void register_all(sh_runtime *rt)
{
    CHECK_OK(sh_runtime_register(rt, &req_vt, NULL));
    CHECK_OK(sh_runtime_register(rt, &mute_vt, NULL));
    CHECK_OK(sh_runtime_register(rt, &late_vt, NULL));
    CHECK_OK(sh_runtime_register(rt, &echo_vt, NULL));
}

static void test_request_reply(void)
{
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    register_all(t.rt);
    req_cfg cfg = {.deadline_ms = 1000};
    sh_addr r;
    CHECK_OK(sh_actor_spawn(t.rt, "echo", NULL, 1, &cfg.peer, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "req", &cfg, 0, &r, NULL));
    CHECK(wait_ge(&cfg.answers, 1, 5000));
    CHECK_INT_EQ(atomic_load(&cfg.replies), 1);
    rt_finish(&t);
    CHECK_UINT_EQ(t.fin.timeouts, 0); /* the answered session's deadline was cancelled */
}

static void test_request_timeout(void)
{
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    register_all(t.rt);
    req_cfg cfg = {.deadline_ms = 50};
    sh_addr r;
    CHECK_OK(sh_actor_spawn(t.rt, "mute", NULL, 1, &cfg.peer, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "req", &cfg, 0, &r, NULL));
    CHECK(wait_ge(&cfg.answers, 1, 5000));
    sleep_ms(50);
    CHECK_INT_EQ(atomic_load(&cfg.answers), 1);
    CHECK_INT_EQ(atomic_load(&cfg.timeouts), 1);
    long el = atomic_load(&cfg.elapsed_ms);
    CHECK(el >= 50 && el < 2000);
    rt_finish(&t);
    CHECK_UINT_EQ(t.fin.timeouts, 1);
}

static void test_request_unknown(void)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    register_all(t.rt);
    req_cfg cfg = {.deadline_ms = 5000, .peer = sh_addr_make(1, 999)};
    sh_addr r;
    CHECK_OK(sh_actor_spawn(t.rt, "req", &cfg, 0, &r, NULL));
    CHECK(wait_ge(&cfg.answers, 1, 5000));
    CHECK_INT_EQ(atomic_load(&cfg.notfound), 1);
    rt_finish(&t);
}

static void test_late_reply(void)
{
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    register_all(t.rt);
    req_cfg cfg = {.deadline_ms = 50};
    sh_addr r;
    CHECK_OK(sh_actor_spawn(t.rt, "late", NULL, 1, &cfg.peer, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "req", &cfg, 0, &r, NULL));
    CHECK(wait_ge(&cfg.answers, 1, 5000));
    uint64_t end = now_ms() + 5000;
    sh_runtime_stats st;
    do {
        sleep_ms(5);
        sh_runtime_stats_get(t.rt, &st);
    } while (st.late_replies == 0 && now_ms() < end);
    CHECK_UINT_EQ(st.late_replies, 1);
    CHECK_INT_EQ(atomic_load(&cfg.answers), 1);
    CHECK_INT_EQ(atomic_load(&cfg.timeouts), 1);
    CHECK_INT_EQ(atomic_load(&cfg.replies), 0);
    rt_finish(&t);
}

/* ---- Timers -------------------------------------------------------------------------------- */

typedef struct tick_state {
    _Atomic long *fired;
    uint64_t id;
} tick_state;

static sh_err tick_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    tick_state *st = state;
    st->fired = arg;
    sh_err err = sh_actor_timer_start(ctx, 5, 5, 42, &st->id);
    if (!err)
        err = sh_actor_timer_start(ctx, 100000, 0, 7, NULL); /* outlived by the actor */
    return err;
}

static void tick_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    tick_state *st = state;
    CHECK_UINT_EQ(tag, 42);
    if (atomic_fetch_add(st->fired, 1) + 1 == 5) {
        CHECK_OK(sh_actor_timer_stop(ctx, st->id));
        CHECK_INT_EQ(sh_actor_timer_stop(ctx, st->id), SH_ENOTFOUND);
    }
}

static const sh_actor_vtable tick_vt = {.name = "tick",
                                        .state_size = sizeof(tick_state),
                                        .init = tick_init,
                                        .handle = mute_handle,
                                        .timer = tick_timer};

static sh_err notimer_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    CHECK_INT_EQ(sh_actor_timer_start(ctx, 1, 0, 0, NULL), SH_EINVAL);
    atomic_fetch_add((_Atomic long *)arg, 1);
    return SH_OK;
}
static const sh_actor_vtable notimer_vt = {
    .name = "notimer", .init = notimer_init, .handle = mute_handle};

static void test_actor_timers(void)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    CHECK_OK(sh_runtime_register(t.rt, &tick_vt, NULL));
    CHECK_OK(sh_runtime_register(t.rt, &notimer_vt, NULL));
    _Atomic long fired = 0, ran = 0;
    sh_addr a;
    CHECK_OK(sh_actor_spawn(t.rt, "tick", &fired, 0, &a, NULL));
    CHECK_OK(sh_actor_spawn(t.rt, "notimer", &ran, 0, &a, NULL));
    CHECK(wait_ge(&fired, 5, 5000));
    CHECK(wait_ge(&ran, 1, 5000));
    sleep_ms(40);
    CHECK_INT_EQ(atomic_load(&fired), 5);
    rt_finish(&t);
}

/* ---- Stall detector and overload ------------------------------------------------------------ */

static sh_msg_fate sleepy_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    uint32_t who, seq;
    body_read(m, &who, &seq);
    if (seq == 0)
        sleep_ms(who);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable sleepy_vt = {.name = "sleepy", .handle = sleepy_handle};

static void test_stall_detector(void)
{
    test_rt t;
    logcap cap = {.mu = PTHREAD_MUTEX_INITIALIZER};
    sh_runtime_opts o = {.stall_ms = 50, .log_fn = log_capture, .log_ud = &cap};
    rt_start(&t, 1, 2, &o);
    CHECK_OK(sh_runtime_register(t.rt, &sleepy_vt, NULL));
    sh_addr a;
    CHECK_OK(sh_actor_spawn(t.rt, "sleepy", NULL, 1, &a, NULL));
    CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 10, 1));  /* quick: not a stall */
    CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 250, 0)); /* 250 ms in one handle call */
    uint64_t end = now_ms() + 5000;
    sh_runtime_stats st;
    do {
        sleep_ms(5);
        sh_runtime_stats_get(t.rt, &st);
    } while (st.msgs_handled < 2 && now_ms() < end);
    CHECK_UINT_EQ(st.stalls, 1); /* reported once per stuck call */
    CHECK(log_has(&cap, "level=warn node=node1 actor=sleepy#1 event=actor_stall loop=1"));
    rt_finish(&t);
}

static void test_mailbox_overload(void)
{
    test_rt t;
    logcap cap = {.mu = PTHREAD_MUTEX_INITIALIZER};
    sh_runtime_opts o = {.mailbox_warn = 100, .log_fn = log_capture, .log_ud = &cap};
    rt_start(&t, 1, 1, &o);
    CHECK_OK(sh_runtime_register(t.rt, &sleepy_vt, NULL));
    sh_addr a;
    CHECK_OK(sh_actor_spawn(t.rt, "sleepy", NULL, 0, &a, NULL));
    CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 100, 0)); /* blocks the mailbox 100 ms */
    for (uint32_t i = 1; i <= 1000; i++)
        CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 0, i));
    uint64_t end = now_ms() + 5000;
    sh_runtime_stats st;
    do {
        sleep_ms(5);
        sh_runtime_stats_get(t.rt, &st);
    } while (st.msgs_handled < 1001 && now_ms() < end);
    CHECK_UINT_EQ(st.overloads, 1); /* one crossing, one warning */
    CHECK(log_has(&cap, "actor=sleepy#1 event=mailbox_overload depth=101 threshold=100"));
    /* Drained below half: the next crossing warns again. */
    CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 100, 0));
    for (uint32_t i = 1; i <= 200; i++)
        CHECK_OK(send_body(t.rt, 0, a, 0, SH_MSG_PING, 0, i));
    end = now_ms() + 5000;
    do {
        sleep_ms(5);
        sh_runtime_stats_get(t.rt, &st);
    } while (st.msgs_handled < 1202 && now_ms() < end);
    CHECK_UINT_EQ(st.overloads, 2);
    rt_finish(&t);
}

/* ---- Transport hooks: two runtimes joined by a loopback "transport" ---------------------------
 */

typedef struct loopback {
    sh_runtime *peer[3]; /* by node id */
    _Atomic long frames;
} loopback;

static sh_err lb_send(void *ctx, uint32_t node, const uint8_t *frame, size_t len, sh_error *e)
{
    loopback *lb = ctx;
    if (node >= 3 || !lb->peer[node])
        return SH_ENOTFOUND;
    atomic_fetch_add(&lb->frames, 1);
    /* Delivered on the sender's thread; the receiving runtime copies the frame. */
    return sh_transport_deliver(lb->peer[node], frame, len, e);
}

static sh_send_verdict drop_pongs(void *ctx, sh_msg *m)
{
    return sh_msg_header(m)->type == SH_MSG_CONTROL ? SH_SEND_VERDICT_DROP : SH_SEND_VERDICT_PASS;
}

static void test_transport_hooks(void)
{
    test_rt t1, t2;
    rt_start(&t1, 1, 1, NULL);
    rt_start(&t2, 2, 1, NULL);
    loopback lb = {.peer = {NULL, t1.rt, t2.rt}};
    sh_transport_hooks hooks = {.ctx = &lb, .send_frame = lb_send, .filter = drop_pongs};
    CHECK_OK(sh_transport_set(t1.rt, &hooks));
    CHECK_OK(sh_transport_set(t2.rt, &hooks));
    register_all(t1.rt);
    register_all(t2.rt);
    req_cfg cfg = {.deadline_ms = 2000};
    sh_addr r;
    CHECK_OK(sh_actor_spawn(t2.rt, "echo", NULL, 0, &cfg.peer, NULL));
    CHECK_OK(sh_actor_spawn(t1.rt, "req", &cfg, 0, &r, NULL));
    CHECK(wait_ge(&cfg.answers, 1, 5000));
    CHECK_INT_EQ(atomic_load(&cfg.replies), 1);
    CHECK_INT_EQ(atomic_load(&lb.frames), 2);
    /* The filter drops; the send still succeeds. */
    CHECK_OK(send_body(t1.rt, 0, cfg.peer, 0, SH_MSG_CONTROL, 0, 0));
    CHECK_INT_EQ(atomic_load(&lb.frames), 2);
    /* A corrupt frame is rejected by the receiver. */
    uint8_t junk[4] = {0x98, 0xcd, 0x53, 0x00};
    CHECK_INT_EQ(sh_transport_deliver(t2.rt, junk, sizeof junk, NULL), SH_EFORMAT);
    rt_finish(&t1);
    rt_finish(&t2);
}

static const sh_test_case tests[] = {
    {"request_reply", test_request_reply},
    {"request_timeout", test_request_timeout},
    {"request_unknown", test_request_unknown},
    {"late_reply", test_late_reply},
    {"actor_timers", test_actor_timers},
    {"stall_detector", test_stall_detector},
    {"mailbox_overload", test_mailbox_overload},
    {"transport_hooks", test_transport_hooks},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
