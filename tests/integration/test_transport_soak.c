/* A chaos soak of the transport between real processes: for SH_SOAK_SECONDS, two peer processes
 * (one on ipc://, one on tcp://) are killed and restarted at random while this node sends
 * request bursts and large frames through a fault layer whose rules come and go. Every request
 * must be answered within its deadline, no descriptor may leak, and at the end the cluster must
 * serve cleanly again. Skipped (77) unless SH_SOAK_SECONDS is set: `make soak`. */

#include "shoal/fault.h"
#include "test_proc_util.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t roll(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

typedef struct peer_proc {
    uint32_t node;
    char listen[256]; /* what the child listens on (after the first start: the bound URL) */
    child c;
    bool alive;
} peer_proc;

static void peer_start(peer_proc *p, const char *my_url)
{
    char id[16], peer[300];
    snprintf(id, sizeof id, "%u", (unsigned)p->node);
    snprintf(peer, sizeof peer, "1=%s", my_url);
    const char *args[] = {id, p->listen, peer, NULL};
    CHECK_INT_EQ(child_start(&p->c, args), 0);
    snprintf(p->listen, sizeof p->listen, "%s", p->c.url); /* tcp port 0 -> the port it got */
    p->alive = true;
}

static void test_soak(void)
{
    const char *secs = getenv("SH_SOAK_SECONDS");
    double seconds = secs ? atof(secs) : 0;
    char dir[64], u1[128];
    tmpdir_make(dir, sizeof dir);
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    test_rt t;
    rt_start(&t, 1, 2, NULL);
    CHECK_OK(sh_runtime_register(t.rt, &req_vt, NULL));
    sh_transport *tp = NULL;
    sh_transport_opts o = {.listen_url = u1, .reconnect_max_ms = 100, .send_timeout_ms = 1000};
    CHECK_OK(sh_transport_create(t.rt, &o, &tp, NULL));
    sh_transport_hooks next;
    sh_transport_hooks_get(tp, &next);
    sh_fault_opts fo = {.seed = 1234, .next = &next};
    sh_fault *f = NULL;
    CHECK_OK(sh_fault_create(t.rt, &fo, &f, NULL));
    peer_proc peers[2] = {{.node = 2}, {.node = 3}};
    snprintf(peers[0].listen, sizeof peers[0].listen, "ipc://%s/n2", dir);
    snprintf(peers[1].listen, sizeof peers[1].listen, "tcp://127.0.0.1:0");
    for (int i = 0; i < 2; i++) {
        peer_start(&peers[i], u1);
        CHECK_OK(sh_transport_peer_add(tp, peers[i].node, peers[i].listen, NULL));
        CHECK(wait_link_up(tp, peers[i].node, 1, 10000));
    }
    size_t big = (size_t)3 << 20;
    uint8_t *body = calloc(1, big + 8);
    CHECK(body != NULL);
    body[0] = 0x81, body[1] = 0xa1, body[2] = 'd', body[3] = 0xc6, body[5] = 0x30; /* 3 MiB */
    int fds0 = fd_count();
    long bursts = 0, answered = 0, pongs = 0, kills = 0, rules = 0, big_sent = 0;
    uint64_t end = now_ms() + (uint64_t)(seconds * 1000);
    while (now_ms() < end) {
        peer_proc *p = &peers[roll(2)];
        switch (roll(8)) {
        case 0: /* kill, and restart after a while */
            if (p->alive) {
                child_kill(&p->c);
                p->alive = false;
                kills++;
            }
            sleep_ms(roll(200));
            peer_start(p, u1);
            break;
        case 1: { /* a fault rule for half a second */
            sh_fault_rule r = {.action = roll(2) ? SH_FAULT_ACTION_DROP : SH_FAULT_ACTION_DELAY,
                               .p = 0.2,
                               .delay_ms = 30,
                               .lasting_s = 0.5};
            CHECK_OK(sh_fault_rule_add(f, &r, NULL, NULL));
            rules++;
            break;
        }
        case 2: { /* large frames, some of them cut by the next kill */
            sh_msg_hdr h = {.type = SH_MSG_PING, .dst = p->c.echo};
            for (int i = 0; i < 4; i++)
                big_sent += sh_send(t.rt, &h, body, big + 8, NULL) == SH_OK;
            break;
        }
        default: { /* a burst of requests: each is answered, by a pong or an error, in time */
            req_cfg c;
            uint64_t t0 = now_ms();
            pongs += ping_many(t.rt, p->c.echo, 50, 500, 3000, &c);
            CHECK_INT_EQ(atomic_load(&c.answers), 50);
            CHECK(now_ms() - t0 < 3000);
            answered += atomic_load(&c.answers);
            bursts++;
            break;
        }
        }
    }
    /* Back to health: no rules, every peer up, every request answered by its echo. */
    sh_fault_heal(f, NULL, 0, NULL, 0);
    for (int i = 0; i < 2; i++) {
        if (!peers[i].alive)
            peer_start(&peers[i], u1);
        sh_transport_link l;
        CHECK_OK(sh_transport_link_get(tp, peers[i].node, &l));
        CHECK(wait_link_up(tp, peers[i].node, l.ups, 10000));
        req_cfg c;
        CHECK_INT_EQ(ping_many(t.rt, peers[i].c.echo, 200, 5000, 10000, &c), 200);
    }
    fprintf(stderr,
            "soak %.0f s: %ld bursts, %ld requests answered (%ld pongs), %ld kills, %ld rules, "
            "%ld large frames queued; fds %d -> %d\n",
            seconds, bursts, answered, pongs, kills, rules, big_sent, fds0, fd_count());
    CHECK(fd_count() <= fds0 + 2); /* the children's pipes come and go; nothing accumulates */
    for (int i = 0; i < 2; i++)
        CHECK_INT_EQ(child_stop(&peers[i].c), 0);
    free(body);
    sh_fault_destroy(f);
    sh_transport_close(tp);
    rt_finish(&t);
    sh_transport_destroy(tp);
    tmpdir_remove(dir);
}

static const sh_test_case tests[] = {
    {"soak", test_soak},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!getenv("SH_SOAK_SECONDS")) {
        fprintf(stderr, "skipped: set SH_SOAK_SECONDS (make soak) to run the soak\n");
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    return sh_test_main(argc, argv, tests);
}
