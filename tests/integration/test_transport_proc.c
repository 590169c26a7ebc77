/* The transport between processes: ipc:// and tcp:// ping-pong, 3 nodes, dead peer, restart,
 * a peer killed in the middle of large frames. */
#include <signal.h>
#include <sys/wait.h>

#include "test_proc_util.h"

typedef struct local {
    test_rt t;
    sh_transport *tp;
    char url[256];
} local;

static void local_start(local *l, const char *url)
{
    rt_start(&l->t, 1, 2, NULL);
    CHECK_OK(sh_runtime_register(l->t.rt, &req_vt, NULL));
    sh_transport_opts o = {.listen_url = url, .reconnect_max_ms = 100, .send_timeout_ms = 2000};
    CHECK_OK(sh_transport_create(l->t.rt, &o, &l->tp, NULL));
    CHECK_OK(sh_transport_listen_url(l->tp, l->url, sizeof l->url));
}

static void local_finish(local *l)
{
    sh_transport_close(l->tp);
    rt_finish(&l->t);
    sh_transport_destroy(l->tp);
}

static void two_nodes(const char *my_url, const char *child_url)
{
    local me;
    local_start(&me, my_url);
    char peer[300];
    snprintf(peer, sizeof peer, "1=%s", me.url);
    child c;
    const char *args[] = {"2", child_url, peer, NULL};
    CHECK_INT_EQ(child_start(&c, args), 0);
    CHECK_OK(sh_transport_peer_add(me.tp, 2, c.url, NULL));
    CHECK(wait_link_up(me.tp, 2, 1, 10000));
    req_cfg r;
    CHECK_INT_EQ(ping_many(me.t.rt, c.echo, 1000, 10000, 30000, &r), 1000);
    CHECK_INT_EQ(atomic_load(&r.in_order), 1000);
    CHECK_INT_EQ(child_stop(&c), 0);
    local_finish(&me);
}

static void test_ipc_two_nodes(void)
{
    char dir[64], u1[128], u2[128];
    tmpdir_make(dir, sizeof dir);
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    snprintf(u2, sizeof u2, "ipc://%s/n2", dir);
    two_nodes(u1, u2);
    unlink(u1 + 6);
    unlink(u2 + 6);
    tmpdir_remove(dir);
}

static void test_tcp_two_nodes(void) { two_nodes("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"); }

static void test_ipc_three_nodes(void)
{
    char dir[64], u[3][128], p[3][160];
    tmpdir_make(dir, sizeof dir);
    for (int i = 0; i < 3; i++) {
        snprintf(u[i], sizeof u[i], "ipc://%s/n%d", dir, i + 1);
        snprintf(p[i], sizeof p[i], "%d=%s", i + 1, u[i]);
    }
    local me;
    local_start(&me, u[0]);
    child c2, c3;
    const char *a2[] = {"2", u[1], p[0], p[2], NULL};
    const char *a3[] = {"3", u[2], p[0], p[1], NULL};
    CHECK_INT_EQ(child_start(&c2, a2), 0);
    CHECK_INT_EQ(child_start(&c3, a3), 0);
    CHECK_OK(sh_transport_peer_add(me.tp, 2, u[1], NULL));
    CHECK_OK(sh_transport_peer_add(me.tp, 3, u[2], NULL));
    req_cfg r;
    CHECK_INT_EQ(ping_many(me.t.rt, c2.echo, 300, 10000, 30000, &r), 300);
    CHECK_INT_EQ(ping_many(me.t.rt, c3.echo, 300, 10000, 30000, &r), 300);
    CHECK_INT_EQ(child_stop(&c2), 0);
    CHECK_INT_EQ(child_stop(&c3), 0);
    local_finish(&me);
    for (int i = 0; i < 3; i++)
        unlink(u[i] + 6);
    tmpdir_remove(dir);
}

/* The peer dies: requests end in a timeout error; it restarts at the same URL and the link
 * comes back by itself. */
static void test_dead_peer_restart(void)
{
    char dir[64], u1[128], u2[128], peer[160];
    tmpdir_make(dir, sizeof dir);
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    snprintf(u2, sizeof u2, "ipc://%s/n2", dir);
    snprintf(peer, sizeof peer, "1=%s", u1);
    local me;
    local_start(&me, u1);
    child c;
    const char *args[] = {"2", u2, peer, NULL};
    CHECK_INT_EQ(child_start(&c, args), 0);
    CHECK_OK(sh_transport_peer_add(me.tp, 2, u2, NULL));
    req_cfg r;
    CHECK_INT_EQ(ping_many(me.t.rt, c.echo, 10, 5000, 10000, &r), 10);
    child_kill(&c);
    sh_transport_link l = {0};
    CHECK(wait_link_state(me.tp, 2, SH_LINK_STATE_DOWN, 5000, &l));
    uint64_t t0 = now_ms();
    CHECK_INT_EQ(ping_many(me.t.rt, c.echo, 5, 300, 5000, &r), 0);
    CHECK_INT_EQ(atomic_load(&r.timeouts), 5); /* each caller got its error */
    CHECK(now_ms() - t0 < 2000);
    CHECK_INT_EQ(child_start(&c, args), 0);
    CHECK(wait_link_up(me.tp, 2, 2, 10000));
    CHECK_INT_EQ(ping_many(me.t.rt, c.echo, 10, 5000, 10000, &r), 10);
    sh_transport_link_get(me.tp, 2, &l);
    fprintf(stderr, "restart: ups=%llu expired=%llu last_error='%s'\n", (unsigned long long)l.ups,
            (unsigned long long)l.expired, l.last_error);
    CHECK_INT_EQ(child_stop(&c), 0);
    local_finish(&me);
    unlink(u1 + 6);
    unlink(u2 + 6);
    tmpdir_remove(dir);
}

/* The peer is killed again and again while 2 MiB frames are being written to it: the link goes
 * down each time without losing a descriptor or a buffer, and serves again once the peer is
 * back. */
static void test_killed_mid_frame(void)
{
    char dir[64], u1[128], u2[128], peer[160];
    tmpdir_make(dir, sizeof dir);
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    snprintf(u2, sizeof u2, "ipc://%s/n2", dir);
    snprintf(peer, sizeof peer, "1=%s", u1);
    local me;
    local_start(&me, u1);
    CHECK_OK(sh_transport_peer_add(me.tp, 2, u2, NULL));
    const char *args[] = {"2", u2, peer, NULL};
    size_t n = (size_t)2 << 20;
    uint8_t *body = calloc(1, n + 8);
    CHECK(body != NULL);
    body[0] = 0x81, body[1] = 0xa1, body[2] = 'd', body[3] = 0xc6, body[5] = 0x20; /* 2 MiB */
    int fds0 = -1;
    child c;
    for (int round = 0; round < 6; round++) {
        CHECK_INT_EQ(child_start(&c, args), 0);
        CHECK(wait_link_up(me.tp, 2, (uint64_t)round + 1, 10000));
        sh_msg_hdr h = {.type = SH_MSG_PING, .dst = c.echo};
        long ok = 0;
        for (int i = 0; i < 24; i++)
            ok += sh_send(me.t.rt, &h, body, n + 8, NULL) == SH_OK;
        CHECK(ok > 0);
        child_kill(&c);
        sh_transport_link l = {0};
        CHECK(wait_link_state(me.tp, 2, SH_LINK_STATE_DOWN, 5000, &l));
        sleep_ms(30); /* the child's own connection to us closes on its side's EOF */
        if (round == 1)
            fds0 = fd_count(); /* after a first cycle: every pool exists */
    }
    /* A connection the killed child made to us may still be closing (its EOF is read on the
     * loop): wait for the count to settle rather than compare one instant. */
    uint64_t end = now_ms() + 2000;
    while (fd_count() > fds0 && now_ms() < end)
        sleep_ms(10);
    /* The transport keeps redialling the dead peer, and each attempt holds a socket for a moment,
     * so one reading may be one above the settled count: judge by the lowest of a few. A leak (2
     * per cycle, 8 over the rounds after fds0) stays in every reading. */
    int fds1 = fd_count();
    for (int i = 0; i < 20; i++) {
        sleep_ms(10);
        int v = fd_count();
        fds1 = v < fds1 ? v : fds1;
    }
    fprintf(stderr, "killed mid-frame: fds %d -> %d\n", fds0, fds1);
    CHECK(fds1 <= fds0);
    CHECK_INT_EQ(child_start(&c, args), 0);
    CHECK(wait_link_up(me.tp, 2, 7, 10000));
    req_cfg r;
    CHECK_INT_EQ(ping_many(me.t.rt, c.echo, 50, 5000, 10000, &r), 50);
    CHECK_INT_EQ(child_stop(&c), 0);
    free(body);
    local_finish(&me);
    tmpdir_remove(dir);
}

static const sh_test_case tests[] = {
    {"ipc_two_nodes", test_ipc_two_nodes},       {"tcp_two_nodes", test_tcp_two_nodes},
    {"ipc_three_nodes", test_ipc_three_nodes},   {"dead_peer_restart", test_dead_peer_restart},
    {"killed_mid_frame", test_killed_mid_frame}, {NULL, NULL},
};

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    return sh_test_main(argc, argv, tests);
}
