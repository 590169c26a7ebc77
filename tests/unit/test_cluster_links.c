/* How a tensor-parallel group links, from a cluster script's node URLs (actors/cluster.c's plan,
 * docs/cluster.md "The group's links"): shared memory, the network or two levels under
 * tp_link = "auto", "net" and "hier", and the host of each rank that two levels are given. */
#include <stdio.h>
#include <string.h>

#include "actors/cluster.h"
#include "actors/hello.h"
#include "lua/config.h"
#include "runtime/coll.h"
#include "sh_test.h"

/* Plans one replica of one stage over the ranks at `urls` (n of them) with `link`, and checks
 * its group's kind and hosts (want_hosts: n entries, or NULL). */
static void check_group(const char *const *urls, int n, const char *link, int32_t want_kind,
                        const int32_t *want_hosts)
{
    char src[2048], nodes[1400] = "", ranks[200] = "";
    size_t ln = 0, lr = 0;
    for (int r = 0; r < n; r++) {
        ln += (size_t)snprintf(nodes + ln, sizeof nodes - ln,
                               "node { name = 'w%d', listen = '%s' }, ", r, urls[r]);
        lr += (size_t)snprintf(ranks + lr, sizeof ranks - lr, "%s'w%d'", r ? ", " : "", r);
    }
    snprintf(src, sizeof src,
             "local m = model { path = 'm.gguf', name = 'm', layers = 4 }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'front', listen = 'tcp://127.0.0.1:7000' }, %s },\n"
             "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { { %s } }), "
             "tp_link = '%s' } },\n"
             "}\n",
             nodes, ranks, link);
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    sh_err rc = sh_config_load_string(src, strlen(src), "links.lua", NULL, &c, &e);
    if (rc) {
        SH_FAIL_("%s: %s", link, e.msg);
        return;
    }
    const sh_llama_hparams *hp[1] = {NULL};
    sh_cluster_plan p;
    if (sh__cluster_plan(c, "links.lua", hp, &p, &e)) {
        SH_FAIL_("%s: plan: %s", link, e.msg);
        sh_config_destroy(c);
        return;
    }
    sh_cluster_group g;
    CHECK_INT_EQ(sh__cluster_group(&p, 0, &g, &e), 0);
    if (g.kind != want_kind)
        SH_FAIL_("%s, %s ...: kind %d, want %d", link, urls[0], (int)g.kind, (int)want_kind);
    /* Every node states the same link in its HELLO slice. */
    CHECK_INT_EQ(SH_HELLO_SLICE_LINK(sh__cluster_slice(&p, 0, n - 1)), want_kind);
    for (int r = 0; want_hosts && r < n; r++)
        if (g.hosts[r] != want_hosts[r])
            SH_FAIL_("%s: rank %d (%s): host %d, want %d", link, r, urls[r], (int)g.hosts[r],
                     (int)want_hosts[r]);
    sh_config_destroy(c);
}

static void test_auto(void)
{
    /* Every rank on this host: shared memory. */
    const char *local[] = {"tcp://127.0.0.1:7001", "tcp://127.0.0.2:7002", "tcp://localhost:7003",
                           "tcp://[::1]:7004"};
    check_group(local, 4, "auto", SH_COLL_SHM, NULL);
    /* Two hosts of two ranks: two levels, a rank's host being the host's first rank. */
    const char *two[] = {"tcp://10.0.0.1:7001", "tcp://10.0.0.1:7002", "tcp://10.0.0.2:7001",
                         "tcp://10.0.0.2:7002"};
    const int32_t two_h[] = {0, 0, 2, 2};
    check_group(two, 4, "auto", SH_COLL_HIER, two_h);
    /* Interleaved and uneven: 3 ranks on one host, 1 on another. */
    const char *mix[] = {"tcp://h1:7001", "tcp://h2:7001", "tcp://h1:7002", "tcp://h1:7003"};
    const int32_t mix_h[] = {0, 1, 0, 0};
    check_group(mix, 4, "auto", SH_COLL_HIER, mix_h);
    /* This host's addresses count as one host beside another. */
    const char *here[] = {"tcp://127.0.0.1:7001", "tcp://localhost:7002", "tcp://10.0.0.2:7001",
                          "tcp://10.0.0.2:7002"};
    const int32_t here_h[] = {0, 0, 2, 2};
    check_group(here, 4, "auto", SH_COLL_HIER, here_h);
    /* One rank per host, or every rank on one other host: the network alone. */
    const char *spread[] = {"tcp://10.0.0.1:7001", "tcp://10.0.0.2:7001", "tcp://10.0.0.3:7001"};
    check_group(spread, 3, "auto", SH_COLL_NET, NULL);
    const char *one[] = {"tcp://10.0.0.5:7001", "tcp://10.0.0.5:7002"};
    check_group(one, 2, "auto", SH_COLL_NET, NULL);
}

static void test_explicit(void)
{
    /* "hier" takes each address as written: 127.0.0.1 and 127.0.0.2 are two hosts. */
    const char *pseudo[] = {"tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", "tcp://127.0.0.2:7001",
                            "tcp://127.0.0.2:7002"};
    const int32_t pseudo_h[] = {0, 0, 2, 2};
    check_group(pseudo, 4, "hier", SH_COLL_HIER, pseudo_h);
    /* ipc:// is one host. */
    const char *ipc[] = {"ipc:///tmp/shoal-links-a", "ipc:///tmp/shoal-links-b"};
    const int32_t ipc_h[] = {0, 0};
    check_group(ipc, 2, "hier", SH_COLL_HIER, ipc_h);
    /* "net" and "auto" on the same pseudo-hosts. */
    check_group(pseudo, 4, "net", SH_COLL_NET, NULL);
    check_group(pseudo, 4, "auto", SH_COLL_SHM, NULL);
}

static const sh_test_case tests[] = {
    {"auto", test_auto},
    {"explicit", test_explicit},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
