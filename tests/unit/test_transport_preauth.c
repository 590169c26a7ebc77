/* Pre-authentication budgets on a tls+tcp:// (NNG) listener (issue 25): real TLS connections
 * that never prove a node are capped at 64 per listener and closed after 5 s, a large frame from
 * one is dropped before the runtime sees it, and a peer that proved its node in HELLO keeps
 * working throughout. */
#include <nng/nng.h>

#include <nng/supplemental/tls/tls.h>

#include "actors/hello.h"
#include "runtime/internal.h"
#include "runtime/peers.h"
#include "runtime/transport.h"
#include "test_transport_util.h"

#define N_IDLE 70 /* idle connections besides the one that sends a large frame */

static int sh_run(const char *cmd)
{
    int rc = system(cmd);
    if (rc != 0)
        fprintf(stderr, "command failed (%d): %s\n", rc, cmd);
    return rc;
}

/* A CA and a node certificate (CN and SAN localhost) signed by it, in dir. */
static int make_certs(const char *dir)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
             "-days 2 -subj /CN=ca >/dev/null 2>&1 && "
             "openssl req -newkey rsa:2048 -nodes -keyout node.key -out node.csr "
             "-subj /CN=localhost >/dev/null 2>&1 && "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > ext.cnf && "
             "openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out node.pem -days 2 -extfile ext.cnf >/dev/null 2>&1",
             dir);
    return sh_run(cmd);
}

/* A client that completes TLS and the SP handshake (as a push0 peer) and never greets: an NNG
 * stream, so that nothing redials it once the node closes it. */
typedef struct client {
    nng_stream *s;
    nng_aio *rx;
    uint8_t buf[64];
} client;

static _Atomic long clients_up, clients_down; /* got the node's SP header; saw the node close */

static void client_rx(void *arg)
{
    client *c = arg;
    int rv = nng_aio_result(c->rx);
    if (rv != 0) {
        if (rv != NNG_ECANCELED)
            atomic_fetch_add(&clients_down, 1);
        return;
    }
    nng_iov iov = {.iov_buf = c->buf, .iov_len = sizeof c->buf};
    nng_aio_set_iov(c->rx, 1, &iov);
    nng_stream_recv(c->s, c->rx);
}

static void stream_write(nng_stream *s, const uint8_t *p, size_t len)
{
    nng_aio *aio = NULL;
    CHECK_INT_EQ(nng_aio_alloc(&aio, NULL, NULL), 0);
    while (len > 0) {
        nng_iov iov = {.iov_buf = (void *)p, .iov_len = len};
        nng_aio_set_iov(aio, 1, &iov);
        nng_stream_send(s, aio);
        nng_aio_wait(aio);
        CHECK_INT_EQ(nng_aio_result(aio), 0);
        if (nng_aio_result(aio) != 0)
            break;
        p += nng_aio_count(aio);
        len -= nng_aio_count(aio);
    }
    nng_aio_free(aio);
}

static void client_open(client *c, const char *url, nng_tls_config *cfg)
{
    static const uint8_t hs[8] = {0, 'S', 'P', 0, 0, 0x50, 0, 0}; /* SP, pipeline0 push */
    nng_stream_dialer *d = NULL;
    nng_aio *aio = NULL;
    CHECK_INT_EQ(nng_stream_dialer_alloc(&d, url), 0);
    CHECK_INT_EQ(nng_stream_dialer_set_ptr(d, NNG_OPT_TLS_CONFIG, cfg), 0);
    CHECK_INT_EQ(nng_aio_alloc(&aio, NULL, NULL), 0);
    nng_stream_dialer_dial(d, aio);
    nng_aio_wait(aio);
    CHECK_INT_EQ(nng_aio_result(aio), 0);
    c->s = nng_aio_get_output(aio, 0);
    nng_aio_free(aio);
    nng_stream_dialer_free(d);
    stream_write(c->s, hs, sizeof hs);
    /* The node's 8-byte SP header. */
    uint8_t got[8];
    size_t have = 0;
    CHECK_INT_EQ(nng_aio_alloc(&aio, NULL, NULL), 0);
    while (have < sizeof got) {
        nng_iov iov = {.iov_buf = got + have, .iov_len = sizeof got - have};
        nng_aio_set_iov(aio, 1, &iov);
        nng_stream_recv(c->s, aio);
        nng_aio_wait(aio);
        CHECK_INT_EQ(nng_aio_result(aio), 0);
        if (nng_aio_result(aio) != 0)
            break;
        have += nng_aio_count(aio);
    }
    nng_aio_free(aio);
    CHECK_INT_EQ(got[1], 'S');
    atomic_fetch_add(&clients_up, 1);
    CHECK_INT_EQ(nng_aio_alloc(&c->rx, client_rx, c), 0);
    nng_iov iov = {.iov_buf = c->buf, .iov_len = sizeof c->buf};
    nng_aio_set_iov(c->rx, 1, &iov);
    nng_stream_recv(c->s, c->rx);
}

/* Opens clients [i0, i1) of an array from a thread of its own (TLS handshakes take a while on a
 * small machine: all of them must be up well within the 5 s deadline). */
typedef struct opener {
    pthread_t th;
    client *cs;
    int i0, i1;
    const char *url;
    nng_tls_config *cfg;
} opener;

static void *opener_main(void *arg)
{
    opener *o = arg;
    for (int i = o->i0; i < o->i1; i++)
        client_open(&o->cs[i], o->url, o->cfg);
    return NULL;
}

static void client_close(client *c)
{
    nng_stream_close(c->s);
    nng_aio_stop(c->rx);
    nng_aio_free(c->rx);
    nng_stream_free(c->s);
}

static uint64_t refused(test_rt *r, sh__peers_reason why)
{
    return sh_counter_value(r->rt->peers.refused[why]);
}

static void wait_count(_Atomic long *v, long want, unsigned ms)
{
    uint64_t end = now_ms() + ms;
    while (atomic_load(v) < want && now_ms() < end)
        sleep_ms(10);
}

static void test_preauth_tls(void)
{
    if (system("openssl version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "skip: no openssl CLI to generate certificates\n");
        exit(SH_TEST_SKIP);
    }
    char dir[64];
    tmpdir_make(dir, sizeof dir);
    CHECK_INT_EQ(make_certs(dir), 0);
    char cert[128], key[128], caf[128];
    snprintf(cert, sizeof cert, "%s/node.pem", dir);
    snprintf(key, sizeof key, "%s/node.key", dir);
    snprintf(caf, sizeof caf, "%s/ca.pem", dir);
    sh_transport_tls tls = {
        .cert_file = cert, .key_file = key, .ca_file = caf, .server_name = "localhost"};

    /* Node 1 closes its gate (a cluster node); node 2 greets it over its link (greet_links), so
     * node 1's hello actor binds node 2's connection. Both hello actors are spawned first, so they
     * have the same actor id on each node. */
    test_rt r1, r2;
    rt_start(&r1, 1, 1, NULL);
    rt_start(&r2, 2, 1, NULL);
    sh__peers_enforce(r1.rt);
    sh_hello_ident id1 = {.node = "n1"}, id2 = {.node = "n2"};
    sh_hello_args h1 = {.self = &id1, .retry_ms = 100};
    sh_hello_args h2 = {.self = &id2, .retry_ms = 100, .greet_links = true};
    sh_addr hello1, hello2, echo;
    CHECK_OK(sh_runtime_register(r1.rt, &sh__hello_vtable, NULL));
    CHECK_OK(sh_runtime_register(r2.rt, &sh__hello_vtable, NULL));
    CHECK_OK(sh_actor_spawn(r1.rt, "hello", &h1, 0, &hello1, NULL));
    CHECK_OK(sh_actor_spawn(r2.rt, "hello", &h2, 0, &hello2, NULL));
    CHECK_UINT_EQ(sh_addr_actor(hello1), sh_addr_actor(hello2));
    CHECK_OK(sh_runtime_register(r1.rt, &echo_vt, NULL));
    CHECK_OK(sh_runtime_register(r2.rt, &req_vt, NULL));
    CHECK_OK(sh_actor_spawn(r1.rt, "echo", NULL, 0, &echo, NULL));

    sh_transport *t1 = NULL, *t2 = NULL;
    sh_transport_opts o = {.listen_url = "tls+tcp://127.0.0.1:0", .tls = &tls};
    sh_error e = {0};
    sh_err err = sh_transport_create(r1.rt, &o, &t1, &e);
    if (err == SH_EUNSUPPORTED) {
        fprintf(stderr, "skip: %s\n", e.msg);
        exit(SH_TEST_SKIP);
    }
    CHECK_OK(err);
    CHECK_OK(sh_transport_create(r2.rt, &o, &t2, &e));
    char u1[256], u2[256];
    CHECK_OK(sh_transport_listen_url(t1, u1, sizeof u1));
    CHECK_OK(sh_transport_listen_url(t2, u2, sizeof u2));
    CHECK_OK(sh_transport_peer_add(t1, 2, u2, NULL));
    CHECK_OK(sh_transport_peer_add(t2, 1, u1, NULL));
    CHECK(wait_link_up(t2, 1, 1, 10000));
    uint64_t end = now_ms() + 10000;
    while (!sh__peers_node_bound(r1.rt, 2) && now_ms() < end)
        sleep_ms(10);
    CHECK(sh__peers_node_bound(r1.rt, 2));
    req_cfg c;
    CHECK_INT_EQ(ping_many(r2.rt, echo, 50, 10000, 20000, &c), 50);

    nng_tls_config *srv = NULL, *cli = NULL;
    CHECK_OK(sh__transport_tls_configs(&tls, &srv, &cli, &e));

    /* A connection that has not proved a node sends a frame over the 64 KiB HELLO budget: it is
     * dropped before the runtime decodes it (no frame_rejected, no message). */
    uint64_t rejected0 = sh_counter_value(r1.rt->m.rejected);
    client big;
    client_open(&big, u1, cli);
    size_t big_len = 100 << 10;
    uint8_t *junk = calloc(1, 8 + big_len);
    CHECK(junk != NULL);
    for (int i = 0; i < 8; i++) /* NNG's tcp and tls framing: the length, 8 bytes big-endian */
        junk[i] = (uint8_t)((uint64_t)big_len >> (56 - 8 * i));
    stream_write(big.s, junk, 8 + big_len);
    free(junk);
    end = now_ms() + 5000;
    while (refused(&r1, SH__PEERS_PREAUTH_FRAME) < 1 && now_ms() < end)
        sleep_ms(10);
    CHECK_UINT_EQ(refused(&r1, SH__PEERS_PREAUTH_FRAME), 1);
    CHECK_UINT_EQ(sh_counter_value(r1.rt->m.rejected), rejected0);

    /* N_IDLE more idle connections: 1 + N_IDLE unproved, the listener keeps the newest 64. */
    uint64_t t_flood = now_ms();
    client idle[N_IDLE];
    opener op[N_IDLE];
    for (int i = 0; i < N_IDLE; i++) {
        op[i] = (opener){.cs = idle, .i0 = i, .i1 = i + 1, .url = u1, .cfg = cli};
        CHECK_INT_EQ(pthread_create(&op[i].th, NULL, opener_main, &op[i]), 0);
    }
    for (int i = 0; i < N_IDLE; i++)
        pthread_join(op[i].th, NULL);
    CHECK_INT_EQ(atomic_load(&clients_up), 1 + N_IDLE);
    wait_count(&clients_down, 1 + N_IDLE - 64, 5000);
    CHECK_UINT_EQ(refused(&r1, SH__PEERS_PREAUTH_CAP), 1 + N_IDLE - 64);
    /* The proved peer is served meanwhile, over its first connection. */
    CHECK_INT_EQ(ping_many(r2.rt, echo, 50, 10000, 20000, &c), 50);

    /* Before the deadline (5 s from each one's start) the 64 stay... */
    if (now_ms() < t_flood + 4000)
        sleep_ms((unsigned)(t_flood + 4000 - now_ms()));
    if (now_ms() < t_flood + 4800) {
        CHECK_INT_EQ(atomic_load(&clients_down), 1 + N_IDLE - 64);
        CHECK_UINT_EQ(refused(&r1, SH__PEERS_PREAUTH_SLOW), 0);
    } else {
        fprintf(stderr, "note: too slow to look before the deadline\n");
    }
    /* ... and after it none is left. */
    wait_count(&clients_down, 1 + N_IDLE, 15000);
    CHECK_INT_EQ(atomic_load(&clients_down), 1 + N_IDLE);
    CHECK_UINT_EQ(refused(&r1, SH__PEERS_PREAUTH_SLOW), 64);
    CHECK_UINT_EQ(refused(&r1, SH__PEERS_PREAUTH_CAP), 1 + N_IDLE - 64);
    CHECK_INT_EQ(ping_many(r2.rt, echo, 50, 10000, 20000, &c), 50);
    sh_transport_link l;
    CHECK_OK(sh_transport_link_get(t2, 1, &l));
    CHECK_UINT_EQ(l.ups, 1); /* node 2's connection was never closed */
    CHECK(sh__peers_node_bound(r1.rt, 2));

    client_close(&big);
    for (int i = 0; i < N_IDLE; i++)
        client_close(&idle[i]);
    nng_tls_config_free(srv);
    nng_tls_config_free(cli);
    sh_transport_close(t1);
    sh_transport_close(t2);
    rt_finish(&r1);
    rt_finish(&r2);
    sh_transport_destroy(t1);
    sh_transport_destroy(t2);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    sh_run(cmd);
}

static const sh_test_case tests[] = {
    {"preauth_tls", test_preauth_tls},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
