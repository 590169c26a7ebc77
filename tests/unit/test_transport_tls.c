/* tls+tcp:// between two nodes with certificates the test generates (openssl CLI). */
#include "test_transport_util.h"

static int sh_run(const char *cmd)
{
    int rc = system(cmd);
    if (rc != 0)
        fprintf(stderr, "command failed (%d): %s\n", rc, cmd);
    return rc;
}

/* A CA and a node certificate (CN and SAN localhost) signed by it, in dir. */
static int make_certs(const char *dir, const char *ca)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout %s.key -out %s.pem "
             "-days 2 -subj /CN=%s >/dev/null 2>&1 && "
             "openssl req -newkey rsa:2048 -nodes -keyout %s-node.key -out %s-node.csr "
             "-subj /CN=localhost >/dev/null 2>&1 && "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > %s-ext.cnf && "
             "openssl x509 -req -in %s-node.csr -CA %s.pem -CAkey %s.key -CAcreateserial "
             "-out %s-node.pem -days 2 -extfile %s-ext.cnf >/dev/null 2>&1",
             dir, ca, ca, ca, ca, ca, ca, ca, ca, ca, ca, ca);
    return sh_run(cmd);
}

static void test_tls_ping(void)
{
    if (system("openssl version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "skip: no openssl CLI to generate certificates\n");
        exit(SH_TEST_SKIP);
    }
    char dir[64];
    tmpdir_make(dir, sizeof dir);
    CHECK_INT_EQ(make_certs(dir, "ca"), 0);
    CHECK_INT_EQ(make_certs(dir, "other"), 0);
    char cert[128], key[128], caf[128], ocert[128], okey[128];
    snprintf(cert, sizeof cert, "%s/ca-node.pem", dir);
    snprintf(key, sizeof key, "%s/ca-node.key", dir);
    snprintf(caf, sizeof caf, "%s/ca.pem", dir);
    snprintf(ocert, sizeof ocert, "%s/other-node.pem", dir);
    snprintf(okey, sizeof okey, "%s/other-node.key", dir);
    sh_transport_tls tls = {
        .cert_file = cert, .key_file = key, .ca_file = caf, .server_name = "localhost"};
    test_rt r1, r2, r3;
    rt_start(&r1, 1, 1, NULL);
    rt_start(&r2, 2, 1, NULL);
    rt_start(&r3, 3, 1, NULL);
    CHECK_OK(sh_runtime_register(r1.rt, &req_vt, NULL));
    CHECK_OK(sh_runtime_register(r2.rt, &echo_vt, NULL));
    sh_transport *t1 = NULL, *t2 = NULL, *t3 = NULL;
    sh_transport_opts o = {.listen_url = "tls+tcp://127.0.0.1:0", .tls = &tls};
    sh_error e = {0};
    sh_err err = sh_transport_create(r1.rt, &o, &t1, &e);
    if (err == SH_EUNSUPPORTED) {
        fprintf(stderr, "skip: %s\n", e.msg);
        exit(SH_TEST_SKIP);
    }
    CHECK_OK(err);
    CHECK_OK(sh_transport_create(r2.rt, &o, &t2, &e));
    /* Node 3 has a certificate from another CA: node 2 must refuse it. */
    sh_transport_tls bad = tls;
    bad.cert_file = ocert;
    bad.key_file = okey;
    sh_transport_opts o3 = {.tls = &bad};
    CHECK_OK(sh_transport_create(r3.rt, &o3, &t3, &e));
    char u1[256], u2[256];
    CHECK_OK(sh_transport_listen_url(t1, u1, sizeof u1));
    CHECK_OK(sh_transport_listen_url(t2, u2, sizeof u2));
    CHECK_OK(sh_transport_peer_add(t1, 2, u2, NULL));
    CHECK_OK(sh_transport_peer_add(t2, 1, u1, NULL));
    CHECK_OK(sh_transport_peer_add(t3, 2, u2, NULL));
    sh_addr echo;
    CHECK_OK(sh_actor_spawn(r2.rt, "echo", NULL, 0, &echo, NULL));
    CHECK(wait_link_up(t1, 2, 1, 10000));
    req_cfg c;
    CHECK_INT_EQ(ping_many(r1.rt, echo, 100, 10000, 20000, &c), 100);
    sleep_ms(300);
    sh_transport_link l;
    CHECK_OK(sh_transport_link_get(t3, 2, &l));
    CHECK(l.state != SH_LINK_STATE_UP); /* the handshake fails, the link never comes up */
    CHECK_INT_EQ(sh_transport_peer_add(t3, 1, "tls+tcp://127.0.0.1:1", NULL), SH_OK);
    /* Bad PEM is refused at create. */
    sh_transport_tls junk = {.cert_pem = "junk", .key_pem = "junk", .ca_pem = "junk"};
    sh_transport_opts oj = {.tls = &junk};
    sh_transport *tj = NULL;
    CHECK(sh_transport_create(r3.rt, &oj, &tj, &e) != SH_OK);
    sh_transport_close(t1);
    sh_transport_close(t2);
    sh_transport_close(t3);
    rt_finish(&r1);
    rt_finish(&r2);
    rt_finish(&r3);
    sh_transport_destroy(t1);
    sh_transport_destroy(t2);
    sh_transport_destroy(t3);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    sh_run(cmd);
}

static const sh_test_case tests[] = {
    {"tls_ping", test_tls_ping},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
