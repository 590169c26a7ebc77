/* A process's node in a cluster script from --name, --name-from VAR or SHOAL_NODE: a node's name
 * or a rank (tools/node_identity.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cmd_util.h"
#include "tools/node_identity.h"

int sh__node_identity_flag(sh_node_identity *id, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    if (strcmp(a, "--name") && strcmp(a, "--name-from") && strcmp(a, "--join-timeout"))
        return 1;
    if (*i + 1 >= argc)
        return sh__cmd_fail("option '%s' needs a value (see shoal node --help)", a);
    const char *v = argv[++*i];
    double d = 0;
    if (!strcmp(a, "--name"))
        id->name = v;
    else if (!strcmp(a, "--name-from"))
        id->from = v;
    else if (sh__cmd_parse_f64(v, 0.1, 3600, &d))
        id->join_ms = (uint32_t)(d * 1000.0 + 0.5);
    else
        return sh__cmd_fail("bad value '%s' for --join-timeout: want seconds from 0.1 to 3600 "
                            "(decimals allowed)",
                            v);
    return 0;
}

int sh__node_identity_check(const char *name, const char *from, bool required, const char *cmd)
{
    if (name && from)
        return sh__cmd_fail("%s: give --name or --name-from, not both", cmd);
    if (from && !*from)
        return sh__cmd_fail("%s: --name-from needs the name of an environment variable", cmd);
    if (required && !name && !from && !getenv(SH_NODE_IDENTITY_ENV))
        return sh__cmd_fail("%s needs --name NAME, --name-from VAR or " SH_NODE_IDENTITY_ENV
                            " (see %s --help)",
                            cmd, cmd);
    return 0;
}

/* The rank a value gives: all digits, or digits after its last '-'. -1 when it gives none (or
 * one too large to be a rank). */
static int64_t rank_of(const char *v)
{
    const char *dash = strrchr(v, '-');
    const char *d = dash ? dash + 1 : v;
    if (!*d || strlen(d) > 9)
        return -1;
    for (const char *p = d; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    return strtol(d, NULL, 10);
}

int sh__node_identity_resolve(const sh_cluster_config *c, const char *script, const char *name,
                              const char *from, bool front, const char **out)
{
    *out = name;
    if (name)
        return 0;
    if (!from && !getenv(SH_NODE_IDENTITY_ENV))
        return 0;
    if (!from)
        from = SH_NODE_IDENTITY_ENV;
    const char *v = getenv(from);
    if (!v || !*v)
        return sh__cmd_fail("--name-from %s: the environment variable %s is %s", from, from,
                            v ? "empty" : "not set");
    // A fully qualified host name (shoal-2.shoal.default.svc.cluster.local) counts by its first
    // label when the whole value is no node's name; a label of digits alone is not a host's.
    char label[64] = "";
    const char *dot = strchr(v, '.');
    if (dot && dot > v && (size_t)(dot - v) < sizeof label &&
        strspn(v, "0123456789") < (size_t)(dot - v)) {
        memcpy(label, v, (size_t)(dot - v));
        label[dot - v] = '\0';
    }
    int32_t node = sh_config_find_node(c, v);
    if (node < 0 && label[0])
        node = sh_config_find_node(c, label);
    int32_t n_workers = c->n_nodes - (c->gateway.node >= 0 && c->gateway.node < c->n_nodes);
    int64_t k = node < 0 ? rank_of(label[0] ? label : v) : -1;
    if (node < 0 && k < 0)
        return sh__cmd_fail("--name-from %s: '%.100s' is neither a node of %s nor a rank (a "
                            "number, or a name ending in -NUMBER such as shoal-2)",
                            from, v, script);
    if (node < 0 && k >= n_workers)
        return sh__cmd_fail("--name-from %s: rank %lld ('%.100s') has no node: %s has %d worker "
                            "node%s (ranks 0 to %d; the gateway's node '%s' has none)",
                            from, (long long)k, v, script, (int)n_workers,
                            n_workers == 1 ? "" : "s", (int)n_workers - 1,
                            c->nodes[c->gateway.node].name);
    for (int32_t i = 0, w = 0; node < 0 && i < c->n_nodes; i++)
        if (i != c->gateway.node && w++ == k)
            node = i;
    const char *gw = c->nodes[c->gateway.node].name;
    if (front && node != c->gateway.node)
        return sh__cmd_fail("--name-from %s: '%.100s' is node '%s', but the gateway of %s runs on "
                            "node '%s': run `shoal node` for '%s' and `shoal serve -c` on '%s'",
                            from, v, c->nodes[node].name, script, gw, c->nodes[node].name, gw);
    *out = c->nodes[node].name;
    fprintf(stderr, "shoal: node %s (from %s=%s%s)\n", *out, from, v, k >= 0 ? ", a rank" : "");
    return 0;
}
