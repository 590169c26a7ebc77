/* Fault injection: reproducible decisions, delays, partitions that heal, scenarios from Lua. */
#include <pthread.h>

#include "lua/config.h"
#include "runtime/fault_agent.h"
#include "runtime/fault_scenario.h"
#include "runtime/msg.h"
#include "shoal/fault.h"
#include "test_runtime_util.h"

/* Stands in for the transport: records what reaches send_frame. */
typedef struct capture {
    pthread_mutex_t mu;
    uint32_t n;
    uint32_t node[4096];
    uint32_t seq[4096];
    uint64_t at_ms[4096];
    uint32_t corrupt; /* frames whose seal fails (runtime/msg.h) */
} capture;

static sh_err cap_send(void *ctx, uint32_t node, const uint8_t *frame, size_t len, sh_error *e)
{
    capture *c = ctx;
    pthread_mutex_lock(&c->mu);
    if (c->n < 4096) {
        uint32_t seq = UINT32_MAX;
        sh_msg_codec mc;
        sh__msg_codec_init(&mc);
        size_t n = 0; /* every frame to another node comes sealed */
        if (sh__msg_unseal(&mc, frame, len, &n, NULL) == SH_OK && n >= 13 &&
            frame[n - 13] == 0x81 && frame[n - 9] == 8)
            memcpy(&seq, frame + n - 4, 4);
        else
            c->corrupt++;
        c->node[c->n] = node;
        c->seq[c->n] = seq;
        c->at_ms[c->n] = now_ms();
        c->n++;
    }
    pthread_mutex_unlock(&c->mu);
    return SH_OK;
}

typedef struct dlog {
    size_t n;
    sh_fault_decision d[4096];
} dlog;

static void dlog_fn(void *ud, const sh_fault_decision *d)
{
    dlog *l = ud;
    if (l->n < 4096)
        l->d[l->n++] = *d;
}

/* Decisions of one link, in order, as text (to compare runs exactly). */
static size_t link_log(const dlog *l, uint32_t to, char *out, size_t cap)
{
    size_t w = 0;
    out[0] = '\0';
    for (size_t i = 0; i < l->n && w + 128 < cap; i++) {
        const sh_fault_decision *d = &l->d[i];
        if (d->to != to)
            continue;
        w += (size_t)snprintf(out + w, cap - w, "%llu:%x:%u", (unsigned long long)d->seq,
                              d->actions, d->delay_ms);
        for (uint32_t k = 0; k < d->n_flips; k++)
            w += (size_t)snprintf(out + w, cap - w, ",%u", d->flip_pos[k]);
        w += (size_t)snprintf(out + w, cap - w, ";");
    }
    return w;
}

/* One run: 400 messages to node 2 and 400 to node 3, interleaved as `order` says. */
static void run_once(uint64_t seed, int order, dlog *l, capture *c, sh_fault_stats *st)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_transport_hooks next = {.ctx = c, .send_frame = cap_send};
    sh_fault_opts o = {.seed = seed, .next = &next, .log_fn = dlog_fn, .log_ud = l};
    sh_fault *f = NULL;
    CHECK_OK(sh_fault_create(t.rt, &o, &f, NULL));
    sh_fault_rule drop = {.action = SH_FAULT_ACTION_DROP, .p = 0.2};
    sh_fault_rule dup = {.action = SH_FAULT_ACTION_DUPLICATE, .p = 0.1};
    sh_fault_rule cor = {.action = SH_FAULT_ACTION_CORRUPT, .p = 0.1, .bytes = 3};
    sh_fault_rule drop3 = {.action = SH_FAULT_ACTION_DROP, .p = 0.3, .to = {3}, .n_to = 1};
    CHECK_OK(sh_fault_rule_add(f, &drop, NULL, NULL));
    CHECK_OK(sh_fault_rule_add(f, &dup, NULL, NULL));
    CHECK_OK(sh_fault_rule_add(f, &cor, NULL, NULL));
    CHECK_OK(sh_fault_rule_add(f, &drop3, NULL, NULL));
    for (uint32_t i = 0; i < 400; i++) {
        if (order == 0) {
            CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, i));
            CHECK_OK(send_body(t.rt, 0, sh_addr_make(3, 1), 0, SH_MSG_PING, 1, i));
        } else {
            CHECK_OK(send_body(t.rt, 0, sh_addr_make(3, 1), 0, SH_MSG_PING, 1, i));
        }
    }
    if (order == 1)
        for (uint32_t i = 0; i < 400; i++)
            CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, i));
    sh_fault_stats_get(f, st);
    sh_fault_destroy(f);
    rt_finish(&t);
}

static void test_determinism(void)
{
    static dlog l1, l2, l3;
    static capture c1 = {.mu = PTHREAD_MUTEX_INITIALIZER}, c2 = {.mu = PTHREAD_MUTEX_INITIALIZER},
                   c3 = {.mu = PTHREAD_MUTEX_INITIALIZER};
    sh_fault_stats s1, s2, s3;
    run_once(42, 0, &l1, &c1, &s1);
    run_once(42, 1, &l2, &c2, &s2); /* same seed, other interleaving of the two links */
    run_once(43, 0, &l3, &c3, &s3);
    static char a[1 << 16], b[1 << 16], d[1 << 16];
    for (uint32_t to = 2; to <= 3; to++) {
        link_log(&l1, to, a, sizeof a);
        link_log(&l2, to, b, sizeof b);
        link_log(&l3, to, d, sizeof d);
        CHECK_STR_EQ(a, b);
        CHECK(strcmp(a, d) != 0);
    }
    CHECK_UINT_EQ(s1.seen, 800);
    CHECK_UINT_EQ(s1.dropped, s2.dropped);
    CHECK_UINT_EQ(s1.duplicated, s2.duplicated);
    CHECK_UINT_EQ(s1.corrupted, s2.corrupted);
    CHECK(s1.dropped > 100 && s1.dropped < 350);
    CHECK(s1.duplicated > 10 && s1.corrupted > 10);
    /* What reached the "wire": same frames in both runs, corrupted copies included. */
    CHECK_UINT_EQ(c1.n, c2.n);
    CHECK_UINT_EQ(c1.corrupt, c2.corrupt);
    CHECK_UINT_EQ(c1.corrupt, s1.corrupted); /* the seal catches every corrupted copy */
    CHECK_UINT_EQ(c1.n, 800 - s1.dropped + s1.duplicated);
    fprintf(stderr, "determinism: seen=%llu dropped=%llu dup=%llu corrupt=%llu wire=%u\n",
            (unsigned long long)s1.seen, (unsigned long long)s1.dropped,
            (unsigned long long)s1.duplicated, (unsigned long long)s1.corrupted, c1.n);
}

static void test_delay(void)
{
    static capture c = {.mu = PTHREAD_MUTEX_INITIALIZER};
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_transport_hooks next = {.ctx = &c, .send_frame = cap_send};
    sh_fault_opts o = {.seed = 1, .next = &next};
    sh_fault *f = NULL;
    CHECK_OK(sh_fault_create(t.rt, &o, &f, NULL));
    sh_fault_rule r = {
        .action = SH_FAULT_ACTION_DELAY, .p = 1, .delay_ms = 100, .to = {2}, .n_to = 1};
    CHECK_OK(sh_fault_rule_add(f, &r, NULL, NULL));
    uint64_t sent[20];
    for (uint32_t i = 0; i < 20; i++) {
        sent[i] = now_ms();
        CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, i));
        sleep_ms(2);
    }
    CHECK_OK(send_body(t.rt, 0, sh_addr_make(4, 1), 0, SH_MSG_PING, 1, 99)); /* other link */
    pthread_mutex_lock(&c.mu);
    CHECK_UINT_EQ(c.n, 1); /* only the undelayed link's message went out at once */
    pthread_mutex_unlock(&c.mu);
    uint64_t end = now_ms() + 3000;
    while (now_ms() < end) {
        pthread_mutex_lock(&c.mu);
        uint32_t n = c.n;
        pthread_mutex_unlock(&c.mu);
        if (n >= 21)
            break;
        sleep_ms(5);
    }
    CHECK_UINT_EQ(c.n, 21);
    for (uint32_t k = 1; k < c.n && k < 21; k++) {
        uint32_t i = c.seq[k];
        CHECK_UINT_EQ(i, k - 1); /* held in order */
        if (i < 20) {
            long held = (long)(c.at_ms[k] - sent[i]);
            CHECK(held >= 99 && held < 400);
        }
    }
    sh_fault_stats st;
    sh_fault_stats_get(f, &st);
    CHECK_UINT_EQ(st.delayed, 20);
    CHECK_UINT_EQ(st.held, 0);
    sh_fault_destroy(f);
    rt_finish(&t);
}

/* Two nodes, each with its own layer: a partition blocks both directions, then expires; heal
 * lifts another at once. */
static void test_partition(void)
{
    static capture c1 = {.mu = PTHREAD_MUTEX_INITIALIZER}, c2 = {.mu = PTHREAD_MUTEX_INITIALIZER};
    test_rt t1, t2;
    rt_start(&t1, 1, 1, NULL);
    rt_start(&t2, 2, 1, NULL);
    sh_transport_hooks n1 = {.ctx = &c1, .send_frame = cap_send};
    sh_transport_hooks n2 = {.ctx = &c2, .send_frame = cap_send};
    sh_fault_opts o1 = {.seed = 7, .next = &n1}, o2 = {.seed = 7, .next = &n2};
    sh_fault *f1 = NULL, *f2 = NULL;
    CHECK_OK(sh_fault_create(t1.rt, &o1, &f1, NULL));
    CHECK_OK(sh_fault_create(t2.rt, &o2, &f2, NULL));
    sh_fault_rule p = {.action = SH_FAULT_ACTION_PARTITION,
                       .from = {1},
                       .n_from = 1,
                       .to = {2},
                       .n_to = 1,
                       .lasting_s = 0.3};
    CHECK_OK(sh_fault_rule_add(f1, &p, NULL, NULL));
    CHECK_OK(sh_fault_rule_add(f2, &p, NULL, NULL));
    for (uint32_t i = 0; i < 10; i++) {
        CHECK_OK(send_body(t1.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, i));
        CHECK_OK(send_body(t2.rt, 0, sh_addr_make(1, 1), 0, SH_MSG_PING, 1, i));
        CHECK_OK(send_body(t1.rt, 0, sh_addr_make(3, 1), 0, SH_MSG_PING, 1, i)); /* not cut */
    }
    CHECK_UINT_EQ(c1.n, 10);
    CHECK_UINT_EQ(c2.n, 0);
    sleep_ms(350);
    CHECK_UINT_EQ(sh_fault_rule_count(f1), 0);
    CHECK_OK(send_body(t1.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, 100));
    CHECK_OK(send_body(t2.rt, 0, sh_addr_make(1, 1), 0, SH_MSG_PING, 1, 100));
    CHECK_UINT_EQ(c1.n, 11);
    CHECK_UINT_EQ(c2.n, 1);
    p.lasting_s = 0;
    CHECK_OK(sh_fault_rule_add(f2, &p, NULL, NULL));
    CHECK_OK(send_body(t2.rt, 0, sh_addr_make(1, 1), 0, SH_MSG_PING, 1, 101));
    CHECK_UINT_EQ(c2.n, 1);
    uint32_t a = 2, b = 1;
    CHECK_UINT_EQ(sh_fault_heal(f2, &a, 1, &b, 1), 1); /* either way round */
    CHECK_OK(send_body(t2.rt, 0, sh_addr_make(1, 1), 0, SH_MSG_PING, 1, 102));
    CHECK_UINT_EQ(c2.n, 2);
    sh_fault_stats st;
    sh_fault_stats_get(f1, &st);
    CHECK_UINT_EQ(st.partitioned, 10);
    sh_fault_destroy(f1);
    sh_fault_destroy(f2);
    rt_finish(&t1);
    rt_finish(&t2);
}

/* A Lua scenario run by the runner: a kill through the host, a timed partition. */
typedef struct host_ctx {
    _Atomic long kills;
    _Atomic long kill_at_ms;
    uint64_t t0;
    char killed[64];
} host_ctx;

static uint32_t host_node(void *ud, const char *name)
{
    return strcmp(name, "n1") == 0 ? 1 : strcmp(name, "n2") == 0 ? 2 : 0;
}
static sh_err host_kill(void *ud, const char *node)
{
    host_ctx *h = ud;
    snprintf(h->killed, sizeof h->killed, "%s", node);
    atomic_store(&h->kill_at_ms, (long)(now_ms() - h->t0));
    atomic_fetch_add(&h->kills, 1);
    return SH_OK;
}

static void test_scenario(void)
{
    const char *src = "at(0.05, kill 'n2')\n"
                      "at(0.1, partition { a = 'n1', b = 'n2', lasting = 0.2 })\n"
                      "at(0.1, drop { link = 'n1->*', p = 0.5 })\n"
                      "at(0.2, heal { link = 'n1->*' })\n";
    sh_scenario *s = NULL;
    sh_error e = {0};
    sh_err err = sh_scenario_load_string(src, strlen(src), "test", NULL, &s, &e);
    if (err)
        fprintf(stderr, "scenario: %s\n", e.msg);
    CHECK_OK(err);
    if (!s)
        return;
    static capture c = {.mu = PTHREAD_MUTEX_INITIALIZER};
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_transport_hooks next = {.ctx = &c, .send_frame = cap_send};
    sh_fault_opts o = {.seed = 3, .next = &next};
    sh_fault *f = NULL;
    CHECK_OK(sh_fault_create(t.rt, &o, &f, NULL));
    host_ctx h = {.t0 = now_ms()};
    sh_fault_host host = {.ud = &h, .node_id = host_node, .kill = host_kill};
    sh_fault_runner *r = NULL;
    CHECK_OK(sh_fault_runner_start(s, &f, 1, &host, &r, NULL));
    sleep_ms(150);
    CHECK_INT_EQ(atomic_load(&h.kills), 1);
    CHECK_STR_EQ(h.killed, "n2");
    CHECK(atomic_load(&h.kill_at_ms) >= 45 && atomic_load(&h.kill_at_ms) < 140);
    CHECK_UINT_EQ(sh_fault_rule_count(f), 2);
    CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, 1));
    CHECK_UINT_EQ(c.n, 0); /* partitioned */
    CHECK_OK(sh_fault_runner_wait(r, 2000));
    size_t applied, failed;
    sh_fault_runner_counts(r, &applied, &failed);
    CHECK_UINT_EQ(applied, 4);
    CHECK_UINT_EQ(failed, 0);
    CHECK_UINT_EQ(sh_fault_rule_count(f), 1); /* heal lifted the drop; the partition holds */
    sleep_ms(200);
    CHECK_UINT_EQ(sh_fault_rule_count(f), 0); /* and expired */
    CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, 2));
    CHECK_UINT_EQ(c.n, 1);
    sh_fault_runner_destroy(r);
    sh_fault_destroy(f);
    rt_finish(&t);
    sh_scenario_destroy(s);
}

/* Frames outside the transport (a group's collectives): sh_fault_decide and the per-runtime
 * lookup apply the rules of their type (SH_FAULT_TYPE_COLL) and of type 0, not the others; the
 * nodes' messages are not hit by a SH_FAULT_TYPE_COLL rule. */
static void test_decide(void)
{
    static capture c;
    memset(&c, 0, sizeof c);
    pthread_mutex_init(&c.mu, NULL);
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_transport_hooks next = {.ctx = &c, .send_frame = cap_send};
    sh_fault_opts o = {.seed = 7, .next = &next};
    sh_fault *f = NULL;
    CHECK_OK(sh_fault_create(t.rt, &o, &f, NULL));
    CHECK_UINT_EQ(sh__fault_decide_rt(t.rt, 2, SH_FAULT_TYPE_COLL), 0); /* no rule */
    sh_fault_rule drop = {
        .action = SH_FAULT_ACTION_DROP, .p = 1, .to = {2}, .n_to = 1, .type = SH_FAULT_TYPE_COLL};
    CHECK_OK(sh_fault_rule_add(f, &drop, NULL, NULL));
    const uint32_t D = 1u << SH_FAULT_ACTION_DROP, U = 1u << SH_FAULT_ACTION_DUPLICATE;
    CHECK_UINT_EQ(sh_fault_decide(f, 2, SH_FAULT_TYPE_COLL), D);
    CHECK_UINT_EQ(sh__fault_decide_rt(t.rt, 2, SH_FAULT_TYPE_COLL), D);
    CHECK_UINT_EQ(sh_fault_decide(f, 3, SH_FAULT_TYPE_COLL), 0); /* another link */
    CHECK_UINT_EQ(sh_fault_decide(f, 2, SH_MSG_PING), 0);        /* another type */
    for (uint32_t i = 0; i < 10; i++)                            /* the nodes' messages pass */
        CHECK_OK(send_body(t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, i));
    pthread_mutex_lock(&c.mu);
    CHECK_UINT_EQ(c.n, 10);
    pthread_mutex_unlock(&c.mu);
    sh_fault_rule dup = {.action = SH_FAULT_ACTION_DUPLICATE, .p = 1, .to = {3}, .n_to = 1};
    CHECK_OK(sh_fault_rule_add(f, &dup, NULL, NULL));
    CHECK_UINT_EQ(sh_fault_decide(f, 3, SH_FAULT_TYPE_COLL), U); /* type 0: every frame */
    sh_fault_stats st;
    sh_fault_stats_get(f, &st);
    CHECK_UINT_EQ(st.dropped, 2);
    CHECK_UINT_EQ(st.duplicated, 1);
    sh_fault_destroy(f);
    CHECK_UINT_EQ(sh__fault_decide_rt(t.rt, 2, SH_FAULT_TYPE_COLL), 0); /* unlisted */
    rt_finish(&t);
    pthread_mutex_destroy(&c.mu);
}

static const sh_test_case tests[] = {
    {"determinism", test_determinism}, {"delay", test_delay},   {"partition", test_partition},
    {"scenario", test_scenario},       {"decide", test_decide}, {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
