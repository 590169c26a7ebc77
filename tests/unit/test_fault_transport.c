/* Fault injection over a real transport: two runtimes on ipc:// sockets with the fault layer
 * wrapping node 1's transport. The same seed gives the same frames at the receiver, corrupted
 * frames are refused there while the node keeps serving, delays show in round trips, a
 * partition cuts the link until it heals, and FAULT messages from another node steer it. */
#include "runtime/proto.h"
#include "shoal/fault.h"
#include "test_transport_util.h"

/* Counts, per sequence number, how often each PING reached the receiver. */
typedef struct tally {
    _Atomic long n;
    _Atomic uint32_t seen[1024];
} tally;

static sh_err tally_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    *(tally **)state = arg;
    return SH_OK;
}
static sh_msg_fate tally_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx;
    tally *t = *(tally **)state;
    uint32_t who, seq;
    body_read(m, &who, &seq);
    if (seq < 1024)
        atomic_fetch_add(&t->seen[seq], 1);
    atomic_fetch_add(&t->n, 1);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable tally_vt = {
    .name = "tally", .state_size = sizeof(tally *), .init = tally_init, .handle = tally_handle};

/* Node 1 (with the fault layer, seeded `seed`) and node 2 (a tally actor and the echo) over
 * ipc:// sockets in dir. */
typedef struct pair {
    node a, b;
    sh_fault *f;
    sh_addr tally_at, echo_at;
    char dir[64]; /* the sockets' directory, removed by pair_down */
    tally t;      /* what reached node 2's tally */
} pair;

static void pair_up(pair *p, uint64_t seed)
{
    memset(&p->t, 0, sizeof p->t);
    tmpdir_make(p->dir, sizeof p->dir);
    char ua[128], ub[128];
    snprintf(ua, sizeof ua, "ipc://%s/a", p->dir);
    snprintf(ub, sizeof ub, "ipc://%s/b", p->dir);
    node_start(&p->a, 1, ua, NULL);
    node_start(&p->b, 2, ub, NULL);
    CHECK_OK(sh_transport_peer_add(p->a.tp, 2, ub, NULL));
    CHECK_OK(sh_transport_peer_add(p->b.tp, 1, ua, NULL));
    sh_transport_hooks next;
    sh_transport_hooks_get(p->a.tp, &next);
    sh_fault_opts fo = {.seed = seed, .next = &next};
    CHECK_OK(sh_fault_create(p->a.t.rt, &fo, &p->f, NULL));
    CHECK_OK(sh_runtime_register(p->b.t.rt, &tally_vt, NULL));
    CHECK_OK(sh_actor_spawn(p->b.t.rt, "tally", &p->t, 0, &p->tally_at, NULL));
    CHECK_OK(sh_actor_spawn(p->b.t.rt, "echo", NULL, 0, &p->echo_at, NULL));
    CHECK(wait_link_up(p->a.tp, 2, 1, 5000));
    CHECK(wait_link_up(p->b.tp, 1, 1, 5000));
}

static void pair_down(pair *p)
{
    sh_fault_destroy(p->f);
    node_finish(&p->a);
    node_finish(&p->b);
    tmpdir_remove(p->dir);
}

/* Sends PINGs 0..n-1 (no session) to the tally and waits until `expect` arrived or 300 ms of
 * quiet. */
static void send_seq(pair *p, uint32_t n)
{
    tally *t = &p->t;
    for (uint32_t i = 0; i < n; i++)
        CHECK_OK(send_body(p->a.t.rt, 0, p->tally_at, 0, SH_MSG_PING, 1, i));
    long last = -1;
    while (atomic_load(&t->n) != last) {
        last = atomic_load(&t->n);
        sleep_ms(300);
    }
}

/* One run of 600 PINGs through drop 0.3 and duplicate 0.2 on the real link; `out` gets how many
 * times each arrived. */
static void lossy_run(uint64_t seed, uint32_t *out)
{
    static pair p;
    pair_up(&p, seed);
    sh_fault_rule drop = {.action = SH_FAULT_ACTION_DROP, .p = 0.3};
    sh_fault_rule dup = {.action = SH_FAULT_ACTION_DUPLICATE, .p = 0.2};
    CHECK_OK(sh_fault_rule_add(p.f, &drop, NULL, NULL));
    CHECK_OK(sh_fault_rule_add(p.f, &dup, NULL, NULL));
    send_seq(&p, 600);
    for (int i = 0; i < 600; i++)
        out[i] = atomic_load(&p.t.seen[i]);
    pair_down(&p);
}

static void test_same_seed_same_frames(void)
{
    static uint32_t r1[600], r2[600], r3[600];
    lossy_run(42, r1);
    lossy_run(42, r2);
    lossy_run(43, r3);
    uint32_t got = 0, lost = 0, twice = 0;
    for (int i = 0; i < 600; i++) {
        got += r1[i];
        lost += r1[i] == 0;
        twice += r1[i] == 2;
    }
    fprintf(stderr, "lossy link: %u frames arrived, %u lost, %u twice\n", got, lost, twice);
    CHECK(lost > 120 && lost < 240);       /* drop 0.3 of 600 */
    CHECK(twice > 50 && twice < 130);      /* duplicate 0.2 of the rest */
    CHECK(memcmp(r1, r2, sizeof r1) == 0); /* the same seed: the same frames, frame for frame */
    CHECK(memcmp(r1, r3, sizeof r1) != 0); /* another seed: others */
}

/* Corrupted frames cross the real socket; the receiver's checksum refuses every one of them
 * (not only those that no longer decode), counts it, delivers none, and keeps serving; once
 * healed the link is clean again. */
static void test_corrupt_then_heal(void)
{
    static pair p;
    pair_up(&p, 9);
    sh_fault_rule cor = {.action = SH_FAULT_ACTION_CORRUPT, .p = 1, .bytes = 8};
    CHECK_OK(sh_fault_rule_add(p.f, &cor, NULL, NULL));
    send_seq(&p, 200);
    sh_transport_stats st;
    for (int i = 0; i < 100; i++) { /* received frames are counted before they are checked */
        sh_transport_stats_get(p.b.tp, &st);
        if (st.rejected >= 200)
            break;
        sleep_ms(50);
    }
    fprintf(stderr, "corrupt: %llu of 200 refused by the receiver, %ld delivered\n",
            (unsigned long long)st.rejected, atomic_load(&p.t.n));
    CHECK_UINT_EQ(st.rejected, 200);
    CHECK_INT_EQ(atomic_load(&p.t.n), 0);
    CHECK_UINT_EQ(st.frames_recv, 200); /* the framing itself was never broken */
    sh_runtime_stats rs;
    sh_runtime_stats_get(p.b.t.rt, &rs);
    CHECK_UINT_EQ(rs.corrupt, 200);
    CHECK_UINT_EQ(sh_fault_heal(p.f, NULL, 0, NULL, 0), 1);
    req_cfg c;
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 200, 5000, 10000, &c), 200);
    CHECK_INT_EQ(atomic_load(&c.in_order), 200);
    pair_down(&p);
}

static uint64_t rtt_ms(pair *p)
{
    req_cfg c;
    uint64_t t0 = now_ms();
    CHECK_INT_EQ(ping_many(p->a.t.rt, p->echo_at, 1, 5000, 10000, &c), 1);
    return now_ms() - t0;
}

/* A delay rule on the real link shows in the round trip; a partition cuts it (requests time
 * out) until it heals. */
static void test_delay_and_partition(void)
{
    static pair p;
    pair_up(&p, 5);
    sh_fault_rule delay = {.action = SH_FAULT_ACTION_DELAY, .p = 1, .delay_ms = 80};
    uint64_t id;
    CHECK_OK(sh_fault_rule_add(p.f, &delay, &id, NULL));
    uint64_t slow = rtt_ms(&p);
    CHECK_OK(sh_fault_rule_remove(p.f, id));
    uint64_t fast = rtt_ms(&p);
    fprintf(stderr, "delay 80 ms: round trip %llu ms, then %llu ms\n", (unsigned long long)slow,
            (unsigned long long)fast);
    CHECK(slow >= 80);
    CHECK(fast < 80);
    sh_fault_rule cut = {
        .action = SH_FAULT_ACTION_PARTITION, .from = {1}, .n_from = 1, .to = {2}, .n_to = 1};
    CHECK_OK(sh_fault_rule_add(p.f, &cut, NULL, NULL));
    req_cfg c;
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 5, 200, 3000, &c), 0);
    CHECK_INT_EQ(atomic_load(&c.timeouts), 5);
    uint32_t a = 1, b = 2;
    CHECK_UINT_EQ(sh_fault_heal(p.f, &a, 1, &b, 1), 1);
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 50, 5000, 10000, &c), 50);
    pair_down(&p);
}

/* A chaos driver on node 2: sends one request (a FAULT body, or a PING) to `to` and records the
 * answer. */
typedef struct driver {
    sh_addr to;
    uint32_t type;
    sh_proto_fault body;
    _Atomic int done;
    uint32_t reply_type;
    uint64_t active; /* a FAULT answer's rule count */
    sh_err code;     /* an ERROR answer's code */
    char text[256];
} driver;

static sh_err driver_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    driver *d = arg;
    *(driver **)state = d;
    uint64_t s;
    if (d->type == SH_MSG_FAULT)
        return sh_request_with(ctx, d->to, SH_MSG_FAULT, sh__proto_encode, &d->body, 5000, &s,
                               NULL);
    uint8_t b[13];
    body_make(b, 1, 1);
    return sh_request(ctx, d->to, d->type, b, sizeof b, 5000, &s, NULL);
}

static sh_msg_fate driver_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx;
    driver *d = *(driver **)state;
    d->reply_type = sh_msg_header(m)->type;
    size_t len = 0;
    const void *b = sh_msg_body(m, &len);
    static max_align_t mem[1024];
    sh_proto_arena ar;
    sh__proto_arena_init(&ar, mem, sizeof mem);
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_proto_body body;
    if (sh__proto_decode_body(&c, (sh_msg_type)d->reply_type, b, len, &body, &ar, NULL) == SH_OK) {
        if (d->reply_type == SH_MSG_FAULT)
            d->active = body.fault.seed;
        if (d->reply_type == SH_MSG_ERROR) {
            d->code = (sh_err)body.error.code;
            snprintf(d->text, sizeof d->text, "%.*s", (int)body.error.message.len,
                     body.error.message.ptr);
        }
    }
    atomic_store(&d->done, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable driver_vt = {
    .name = "driver", .state_size = sizeof(driver *), .init = driver_init, .handle = driver_handle};

/* Sends d from node 2 and waits for the answer. */
static void drive(pair *p, driver *d)
{
    atomic_store(&d->done, 0);
    sh_addr a;
    CHECK_OK(sh_actor_spawn(p->b.t.rt, "driver", d, 0, &a, NULL));
    uint64_t end = now_ms() + 5000;
    while (!atomic_load(&d->done) && now_ms() < end)
        sleep_ms(2);
    CHECK(atomic_load(&d->done));
    sh_actor_stop(p->b.t.rt, a);
    sleep_ms(10);
}

/* FAULT messages from another node steer node 1's layer through its agent: rules arrive, act and
 * expire by count; a bad rule is refused with a clear error and changes nothing; clear empties
 * the layer; anything but FAULT is answered with an error. */
static void test_fault_messages(void)
{
    static pair p;
    pair_up(&p, 5);
    sh_addr agent;
    CHECK_OK(sh_fault_agent_spawn(p.f, 0, &agent, NULL));
    CHECK_INT_EQ(sh_fault_agent_spawn(p.f, 0, &agent, NULL), SH_EBUSY);
    CHECK_OK(sh_runtime_register(p.b.t.rt, &driver_vt, NULL));
    static driver d;
    /* Drop the next 3 PINGs from node 1 to node 2 (answers to FAULTs are not PINGs). */
    sh_proto_fault_rule drop3 = {.action = SH_PROTO_FAULT_ACTION_DROP,
                                 .src = sh_addr_make(1, 0),
                                 .dst = sh_addr_make(2, 0),
                                 .type = SH_MSG_PING,
                                 .prob = 1.0f,
                                 .count = 3};
    d = (driver){.to = agent, .type = SH_MSG_FAULT};
    d.body = (sh_proto_fault){.seed = 11, .rules = {&drop3, 1}};
    drive(&p, &d);
    CHECK_UINT_EQ(d.reply_type, SH_MSG_FAULT);
    CHECK_UINT_EQ(d.active, 1);
    req_cfg c;
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 10, 400, 5000, &c), 7);
    CHECK_INT_EQ(atomic_load(&c.timeouts), 3);
    CHECK_UINT_EQ(sh_fault_rule_count(p.f), 0); /* expired by count */
    /* A bad rule: refused, named, nothing applied. */
    sh_proto_fault_rule bad[2] = {drop3, drop3};
    bad[1].prob = 2.0f;
    d = (driver){.to = agent, .type = SH_MSG_FAULT};
    d.body = (sh_proto_fault){.seed = 0, .rules = {bad, 2}};
    drive(&p, &d);
    fprintf(stderr, "bad rule: %s: %s\n", sh_strerror(d.code), d.text);
    CHECK_UINT_EQ(d.reply_type, SH_MSG_ERROR);
    CHECK_INT_EQ(d.code, SH_EINVAL);
    CHECK(strstr(d.text, "rule 1") != NULL && strstr(d.text, "p=2") != NULL);
    CHECK_UINT_EQ(sh_fault_rule_count(p.f), 0);
    /* A rule naming an actor instead of a node. */
    bad[0].dst = p.echo_at;
    d = (driver){.to = agent, .type = SH_MSG_FAULT};
    d.body = (sh_proto_fault){.seed = 0, .rules = {bad, 1}};
    drive(&p, &d);
    CHECK_INT_EQ(d.code, SH_EUNSUPPORTED);
    /* Every PING dropped, until a FAULT with clear and no rules. */
    sh_proto_fault_rule all = drop3;
    all.count = 0;
    d = (driver){.to = agent, .type = SH_MSG_FAULT};
    d.body = (sh_proto_fault){.seed = 0, .rules = {&all, 1}};
    drive(&p, &d);
    CHECK_UINT_EQ(d.active, 1);
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 5, 200, 3000, &c), 0);
    d = (driver){.to = agent, .type = SH_MSG_FAULT};
    d.body = (sh_proto_fault){.seed = 0, .clear = true};
    drive(&p, &d);
    CHECK_UINT_EQ(d.reply_type, SH_MSG_FAULT);
    CHECK_UINT_EQ(d.active, 0);
    CHECK_INT_EQ(ping_many(p.a.t.rt, p.echo_at, 20, 5000, 5000, &c), 20);
    /* Not a FAULT. */
    d = (driver){.to = agent, .type = SH_MSG_PING};
    drive(&p, &d);
    CHECK_UINT_EQ(d.reply_type, SH_MSG_ERROR);
    CHECK_INT_EQ(d.code, SH_EPROTO);
    pair_down(&p);
}

static const sh_test_case tests[] = {
    {"same_seed_same_frames", test_same_seed_same_frames},
    {"corrupt_then_heal", test_corrupt_then_heal},
    {"delay_and_partition", test_delay_and_partition},
    {"fault_messages", test_fault_messages},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
