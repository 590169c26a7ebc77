/* Transport tests in one process: inproc:// clusters, ordering, back-pressure, errors. */
#include <nng/nng.h>

#include <nng/protocol/pipeline0/pull.h>

#include "test_transport_util.h"

typedef struct node {
    test_rt t;
    sh_transport *tp;
    char url[128];
} node;

static void node_start(node *n, uint32_t id, const char *url, const sh_transport_opts *o)
{
    rt_start(&n->t, id, 2, NULL);
    CHECK_OK(sh_runtime_register(n->t.rt, &echo_vt, NULL));
    CHECK_OK(sh_runtime_register(n->t.rt, &sink_vt, NULL));
    CHECK_OK(sh_runtime_register(n->t.rt, &req_vt, NULL));
    sh_transport_opts def = {0};
    if (!o)
        o = &def;
    sh_transport_opts oo = *o;
    oo.listen_url = url;
    sh_error e = {0};
    n->tp = NULL;
    sh_err err = sh_transport_create(n->t.rt, &oo, &n->tp, &e);
    if (err)
        fprintf(stderr, "transport: %s\n", e.msg);
    CHECK_OK(err);
    if (url)
        CHECK_OK(sh_transport_listen_url(n->tp, n->url, sizeof n->url));
}

static void node_finish(node *n)
{
    sh_transport_close(n->tp);
    rt_finish(&n->t);
    sh_transport_destroy(n->tp);
}

static void mesh(node *ns, int k)
{
    for (int i = 0; i < k; i++)
        for (int j = 0; j < k; j++)
            if (i != j)
                CHECK_OK(sh_transport_peer_add(ns[i].tp, (uint32_t)(j + 1), ns[j].url, NULL));
}

/* Three runtimes in one process: every node asks every other node's echo actor. */
static void test_inproc_request_response(void)
{
    node ns[3];
    char url[64];
    for (int i = 0; i < 3; i++) {
        snprintf(url, sizeof url, "inproc://shoal-rr-%d-%d", (int)getpid(), i);
        node_start(&ns[i], (uint32_t)(i + 1), url, NULL);
    }
    mesh(ns, 3);
    sh_addr echo[3];
    for (int i = 0; i < 3; i++)
        CHECK_OK(sh_actor_spawn(ns[i].t.rt, "echo", NULL, 0, &echo[i], NULL));
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) {
            if (i == j)
                continue;
            req_cfg c;
            long pongs = ping_many(ns[i].t.rt, echo[j], 200, 10000, 20000, &c);
            CHECK_INT_EQ(pongs, 200);
            CHECK_INT_EQ(atomic_load(&c.in_order), 200); /* replies come back in order */
            CHECK_INT_EQ(atomic_load(&c.timeouts), 0);
        }
    }
    sh_transport_link l;
    CHECK_OK(sh_transport_link_get(ns[0].tp, 2, &l));
    CHECK_INT_EQ(l.state, SH_LINK_STATE_UP);
    CHECK(l.sent >= 200);
    CHECK_UINT_EQ(l.queue_msgs, 0);
    for (int i = 0; i < 3; i++)
        node_finish(&ns[i]);
}

/* 5000 one-way messages from two threads' worth of senders arrive in order per sender. */
static void test_inproc_ordering(void)
{
    node a, b;
    char ua[64], ub[64];
    snprintf(ua, sizeof ua, "inproc://shoal-ord-%d-a", (int)getpid());
    snprintf(ub, sizeof ub, "inproc://shoal-ord-%d-b", (int)getpid());
    sh_transport_opts o = {.queue_max_msgs = 64};
    node_start(&a, 1, ua, &o);
    node_start(&b, 2, ub, &o);
    CHECK_OK(sh_transport_peer_add(a.tp, 2, b.url, NULL));
    sink_log log = {0};
    sh_addr sink;
    CHECK_OK(sh_actor_spawn(b.t.rt, "sink", &log, 0, &sink, NULL));
    const uint32_t n = 5000;
    long busy = 0;
    for (uint32_t i = 0; i < n; i++) {
        sh_err err;
        while ((err = send_body(a.t.rt, 0, sink, 0, SH_MSG_PING, 3, i)) == SH_EBUSY) {
            busy++; /* the caller keeps its message and retries */
            sleep_ms(1);
        }
        CHECK_OK(err);
    }
    CHECK(wait_ge(&log.n, (long)n, 20000));
    CHECK_INT_EQ(atomic_load(&log.out_of_order), 0);
    CHECK_UINT_EQ(log.last[3], n);
    sh_transport_stats st;
    sh_transport_stats_get(a.tp, &st);
    CHECK_UINT_EQ(st.busy, (uint64_t)busy);
    CHECK_UINT_EQ(st.frames_sent, n);
    fprintf(stderr, "ordering: %u frames, %ld EBUSY retries\n", n, busy);
    node_finish(&a);
    node_finish(&b);
}

/* A receiver that never reads: the queue caps at its bound, sends fail fast with SH_EBUSY. */
static void test_backpressure(void)
{
    char dir[64], url[128];
    tmpdir_make(dir, sizeof dir);
    snprintf(url, sizeof url, "ipc://%s/stuck", dir);
    nng_socket stuck;
    CHECK_INT_EQ(nng_pull0_open(&stuck), 0);
    CHECK_INT_EQ(nng_listen(stuck, url, NULL, 0), 0);
    node a;
    sh_transport_opts o = {.queue_max_msgs = 64, .queue_max_bytes = 48 * 1024};
    node_start(&a, 1, NULL, &o);
    CHECK_OK(sh_transport_peer_add(a.tp, 2, url, NULL));
    CHECK(wait_link_up(a.tp, 2, 1, 5000));
    static uint8_t body[1024 + 8];
    body[0] = 0x81, body[1] = 0xa1, body[2] = 'd', body[3] = 0xc5, body[4] = 0x04, body[5] = 0x00;
    sh_msg_hdr h = {.type = SH_MSG_PING, .dst = sh_addr_make(2, 1)};
    long ok = 0, busy = 0;
    uint32_t max_depth = 0;
    uint64_t max_bytes = 0;
    for (int i = 0; i < 20000; i++) {
        sh_err err = sh_send(a.t.rt, &h, body, 6 + 1024, NULL);
        if (err == SH_OK)
            ok++;
        else if (err == SH_EBUSY)
            busy++;
        else
            CHECK_OK(err);
        if (i % 100 == 0) {
            sh_transport_link l;
            sh_transport_link_get(a.tp, 2, &l);
            if (l.queue_msgs > max_depth)
                max_depth = l.queue_msgs;
            if (l.queue_bytes > max_bytes)
                max_bytes = l.queue_bytes;
        }
    }
    sh_transport_link l;
    CHECK_OK(sh_transport_link_get(a.tp, 2, &l));
    fprintf(stderr, "backpressure: ok=%ld busy=%ld depth=%u bytes=%llu max_depth=%u\n", ok, busy,
            l.queue_msgs, (unsigned long long)l.queue_bytes, max_depth);
    CHECK(busy > 15000);    /* almost everything was refused at once */
    CHECK(ok < 2000);       /* what got through is the queue plus the kernel's socket buffer */
    CHECK(max_depth <= 64); /* by count */
    CHECK(max_bytes <= 48 * 1024);
    CHECK_UINT_EQ(l.busy, (uint64_t)busy);
    sh_transport_stats st;
    sh_transport_stats_get(a.tp, &st);
    CHECK_UINT_EQ(st.busy, (uint64_t)busy);
    node_finish(&a);
    nng_close(stuck);
    rmdir(dir);
}

/* Errors at the boundary: unknown peers, duplicates, bad URLs, oversize frames, TLS without
 * certificates. */
static void test_errors(void)
{
    node a;
    char url[64];
    snprintf(url, sizeof url, "inproc://shoal-err-%d", (int)getpid());
    sh_transport_opts o = {.max_frame = 4096};
    node_start(&a, 1, url, &o);
    sh_error e = {0};
    CHECK_INT_EQ(send_body(a.t.rt, 0, sh_addr_make(9, 1), 0, SH_MSG_PING, 1, 1), SH_ENOTFOUND);
    CHECK_INT_EQ(sh_transport_peer_add(a.tp, 1, "inproc://x", &e), SH_EINVAL);
    CHECK_INT_EQ(sh_transport_peer_add(a.tp, 2, "bogus://x", &e), SH_EUNSUPPORTED);
    CHECK(strstr(e.msg, "bogus://x") != NULL);
    CHECK_OK(sh_transport_peer_add(a.tp, 2, "inproc://nobody-listens", &e));
    CHECK_INT_EQ(sh_transport_peer_add(a.tp, 2, "inproc://again", &e), SH_EBUSY);
    CHECK_INT_EQ(sh_transport_peer_add(a.tp, 3, "tls+tcp://127.0.0.1:1", &e), SH_EUNSUPPORTED);
    CHECK(strstr(e.msg, "TLS") != NULL);
    static uint8_t big[8192];
    big[0] = 0x81, big[1] = 0xa1, big[2] = 'd', big[3] = 0xc5, big[4] = 0x1f, big[5] = 0x00;
    sh_msg_hdr h = {.type = SH_MSG_PING, .dst = sh_addr_make(2, 1)};
    CHECK_INT_EQ(sh_send(a.t.rt, &h, big, 6 + 0x1f00, &e), SH_ERANGE);
    sh_transport_link l;
    CHECK_OK(sh_transport_link_get(a.tp, 2, &l));
    CHECK_INT_EQ(l.state, SH_LINK_STATE_CONNECTING);
    CHECK_OK(sh_transport_peer_remove(a.tp, 2));
    CHECK_INT_EQ(sh_transport_peer_remove(a.tp, 2), SH_ENOTFOUND);
    CHECK_INT_EQ(send_body(a.t.rt, 0, sh_addr_make(2, 1), 0, SH_MSG_PING, 1, 1), SH_ENOTFOUND);
    node b;
    sh_transport_opts ob = {0};
    ob.listen_url = url; /* in use */
    rt_start(&b.t, 2, 1, NULL);
    CHECK_INT_EQ(sh_transport_create(b.t.rt, &ob, &b.tp, &e), SH_EBUSY);
    rt_finish(&b.t);
    node_finish(&a);
}

static const sh_test_case tests[] = {
    {"inproc_request_response", test_inproc_request_response},
    {"inproc_ordering", test_inproc_ordering},
    {"backpressure", test_backpressure},
    {"errors", test_errors},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
