/* `shoal cluster manifest k8s|slurm CLUSTER.lua`: writes what an orchestrator needs to run a
 * cluster script's nodes (docs/deploy.md): Kubernetes manifests, or a Slurm job's copy of the
 * script with every node's address on the machine its task runs on. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actors/cluster.h"
#include "lua/config.h"
#include "tools/cluster_manifest.h"
#include "tools/cmd_cluster_manifest.h"
#include "tools/cmd_util.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal cluster manifest k8s CLUSTER.lua [--image IMG] [--namespace NS]\n"
            "                 [--name NAME] [--port P] [--http-port P] [--model-dir DIR]\n"
            "                 [--models-claim PVC] [--drain-timeout S] [--recover-timeout S]\n"
            "                 [-t THREADS] [--cluster-key-file FILE]\n"
            "       shoal cluster manifest slurm CLUSTER.lua --hosts H0,H1,... [--port BASE]\n\n"
            "k8s: writes Kubernetes manifests (YAML) for the script on stdout: a headless\n"
            "Service NAME (every pod's stable DNS name), a Service NAME-http for clients, a\n"
            "ConfigMap NAME-script holding the script, a StatefulSet NAME-front (the gateway's\n"
            "node, `shoal serve -c`) and a StatefulSet NAME (the worker nodes, `shoal node\n"
            "--name-from HOSTNAME`: pod NAME-k runs the k-th worker node of the script, in\n"
            "script order, the gateway's node left out). The ConfigMap's script is this one with\n"
            "a prelude that sets every node's address to its pod's (tcp://NAME-k.NAME:P,\n"
            "the front tcp://NAME-front-0.NAME:P), the gateway's to 0.0.0.0:HTTP_PORT and every\n"
            "model path to DIR/FILE. Memory requests are sized from the model files the script\n"
            "names (each worker's share of the weights, its KV memory and %d MiB). The pods\n"
            "read the cluster key from Secret NAME-cluster-key (key cluster.key), which is\n"
            "written too with --cluster-key-file.\n"
            "  --image IMG          the container image holding `shoal` on PATH (default shoal)\n"
            "  --namespace NS       metadata.namespace of every object (default: none given)\n"
            "  --name NAME          the objects' name and label (default shoal)\n"
            "  --port P             the port every node listens on (default 7000)\n"
            "  --http-port P        the front's HTTP port (default 8080)\n"
            "  --model-dir DIR      where the pods see the model files (default /models)\n"
            "  --models-claim PVC   the PersistentVolumeClaim mounted there read-only\n"
            "                       (default NAME-models)\n"
            "  --drain-timeout S    the front's --drain-timeout (default 30); the pods'\n"
            "                       terminationGracePeriodSeconds is S + 15, and workers wait S\n"
            "                       (preStop) so that the front drains before they stop\n"
            "  --recover-timeout S  the front's --recover-timeout (default 60)\n"
            "  -t THREADS           compute threads (and CPUs requested) per worker (default 2)\n"
            "  --cluster-key-file FILE  also write the Secret, holding FILE's key\n\n"
            "slurm: writes the cluster script for one Slurm job step whose task i runs on host\n"
            "Hi (examples/deploy/slurm/shoal.sbatch runs it): task 0 is the gateway's node,\n"
            "task k + 1 the k-th worker node. Node i listens on HOST:BASE+1+i (the scheme of the\n"
            "script kept, ipc:// becomes tcp://), the gateway on H0:BASE (BASE default 7000).\n"
            "There must be one host per node of the script.\n\n"
            "Exit status: 0 written, 2 bad usage or a script that does not load or cannot be\n"
            "placed (one line saying why).\n",
            NODE_OVERHEAD_MIB);
}

/* A string the generated Lua or YAML quotes as it is: no quote, backslash or control byte. */
static bool plain(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < ' ' || *s == '"' || *s == '\\' || *s == '\'' || *s == 0x7f)
            return false;
    return true;
}

/* A DNS label as Kubernetes names objects: [a-z0-9-], starting and ending alphanumeric. */
static bool dns_label(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n == 0 || n > max || s[0] == '-' || s[n - 1] == '-')
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '-'))
            return false;
    return true;
}

/* ---- Slurm ---------------------------------------------------------------------------------- */

static int gen_slurm(const sh__manifest_opts *o, const sh_cluster_config *c, const char *src,
                     size_t len)
{
    if (!o->hosts)
        return sh__cmd_fail("shoal cluster manifest slurm needs --hosts H0,H1,... (one per task)");
    int32_t g = c->gateway.node;
    char *list = strdup(o->hosts);
    char **host = calloc((size_t)c->n_nodes, sizeof *host);
    char **addr = calloc((size_t)c->n_nodes, sizeof *addr);
    int rc = 0;
    if (!list || !host || !addr)
        rc = sh__cmd_fail("out of memory");
    int32_t n = 0;
    for (char *save = NULL, *h = list ? strtok_r(list, ",", &save) : NULL; h && !rc;
         h = strtok_r(NULL, ",", &save), n++) {
        if (!*h || !plain(h) || strchr(h, ' ') || strchr(h, '/'))
            rc = sh__cmd_fail("--hosts: bad host '%s'", h);
        else if (n < c->n_nodes)
            host[n] = h;
    }
    if (!rc && n != c->n_nodes)
        rc = sh__cmd_fail("%s has %d nodes but --hosts names %d: run the job step with one task "
                          "per node (sbatch --ntasks=%d)",
                          o->script, (int)c->n_nodes, (int)n, (int)c->n_nodes);
    if (!rc && o->port + c->n_nodes > 65535)
        rc = sh__cmd_fail("--port %d leaves no room for %d node ports", (int)o->port,
                          (int)c->n_nodes);
    char http[300] = "";
    if (!rc) {
        /* Task 0 is the gateway's node, task k + 1 the k-th of the others in script order. */
        for (int32_t i = 0, task = 1; i < c->n_nodes && !rc; i++) {
            int32_t t = i == g ? 0 : task++;
            char buf[300];
            snprintf(buf, sizeof buf, "%s://%s:%d", sh__manifest_scheme(c->nodes[i].listen),
                     host[t], (int)(o->port + 1 + t));
            if (!(addr[i] = strdup(buf)))
                rc = sh__cmd_fail("out of memory");
        }
        snprintf(http, sizeof http, "%s:%d", host[0], (int)o->port);
    }
    char *text =
        rc ? NULL : sh__manifest_job_script(c, addr, http, NULL, "slurm", o->script, src, len);
    if (!rc && !text)
        rc = sh__cmd_fail("out of memory");
    if (!rc)
        rc = sh__manifest_check_job(text, o->script, addr);
    if (!rc && fputs(text, stdout) == EOF)
        rc = sh__cmd_fail("writing the script: %s", strerror(errno));
    free(text);
    for (int32_t i = 0; addr && i < c->n_nodes; i++)
        free(addr[i]);
    free(addr);
    free(host);
    free(list);
    return rc;
}

/* ---- flags ---------------------------------------------------------------------------------- */

static int parse(int argc, char **argv, sh__manifest_opts *o)
{
    if (argc < 2 || (strcmp(argv[1], "k8s") && strcmp(argv[1], "slurm")))
        return sh__cmd_fail("shoal cluster manifest needs k8s or slurm, then CLUSTER.lua (see "
                            "shoal cluster manifest --help)");
    o->kind = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            if (o->script)
                return sh__cmd_fail("unexpected argument '%s' (one CLUSTER.lua)", a);
            o->script = a;
            continue;
        }
        static const char *const takes[] = {"--image",
                                            "--namespace",
                                            "--name",
                                            "--port",
                                            "--http-port",
                                            "--model-dir",
                                            "--models-claim",
                                            "--drain-timeout",
                                            "--recover-timeout",
                                            "-t",
                                            "--cluster-key-file",
                                            "--hosts",
                                            NULL};
        bool known = false;
        for (int k = 0; takes[k]; k++)
            known |= !strcmp(a, takes[k]);
        if (!known)
            return sh__cmd_fail("unknown option '%s' (see shoal cluster manifest --help)", a);
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value (see shoal cluster manifest --help)", a);
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--image"))
            ok = *v && plain(v) && !strchr(v, ' ') && (o->image = v);
        else if (!strcmp(a, "--namespace"))
            ok = dns_label(v, 63) && (o->ns = v);
        else if (!strcmp(a, "--name"))
            ok = dns_label(v, 40) && (o->name = v);
        else if (!strcmp(a, "--model-dir"))
            ok = v[0] == '/' && plain(v) && !strchr(v, ' ') && (o->model_dir = v);
        else if (!strcmp(a, "--models-claim"))
            ok = dns_label(v, 253) && (o->claim = v);
        else if (!strcmp(a, "--cluster-key-file"))
            o->key_file = v;
        else if (!strcmp(a, "--hosts"))
            o->hosts = v;
        else if (!strcmp(a, "--port"))
            ok = sh__cmd_parse_i64(v, 1, 65535, &o->port);
        else if (!strcmp(a, "--http-port"))
            ok = sh__cmd_parse_i64(v, 1, 65535, &o->http_port);
        else if (!strcmp(a, "-t"))
            ok = sh__cmd_parse_i64(v, 1, 1024, &o->threads);
        else if (!strcmp(a, "--drain-timeout"))
            ok = sh__cmd_parse_f64(v, 0, 3600, &o->drain_s);
        else
            ok = sh__cmd_parse_f64(v, 0, 86400, &o->recover_s);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s (see shoal cluster manifest --help)", v, a);
    }
    if (!o->script)
        return sh__cmd_fail("shoal cluster manifest %s needs CLUSTER.lua", o->kind);
    if (!strcmp(o->kind, "slurm") && (o->image || o->ns || o->model_dir || o->claim || o->key_file))
        return sh__cmd_fail("--image, --namespace, --model-dir, --models-claim and "
                            "--cluster-key-file are for k8s");
    if (!strcmp(o->kind, "k8s") && o->hosts)
        return sh__cmd_fail("--hosts is for slurm");
    if (!strcmp(o->kind, "k8s") && o->http_port == o->port)
        return sh__cmd_fail("--port and --http-port must differ");
    return 0;
}

int sh__cmd_cluster_manifest(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
    char claim[64];
    sh__manifest_opts o = {.image = NULL,
                           .name = "shoal",
                           .port = 7000,
                           .http_port = 8080,
                           .threads = 2,
                           .drain_s = 30,
                           .recover_s = 60};
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    if (!o.image)
        o.image = "shoal";
    if (!o.model_dir)
        o.model_dir = "/models";
    if (!o.claim) {
        snprintf(claim, sizeof claim, "%s-models", o.name);
        o.claim = claim;
    }
    sh_error e = {0};
    sh_cluster_config *c = NULL;
    if (sh_config_load_file(o.script, NULL, &c, &e))
        return sh__cmd_fail("%s", e.msg);
    rc = sh__cmd_report(sh__cluster_check(c, o.script, &e), &e);
    size_t len = 0;
    char *src = NULL;
    if (!rc && !(src = sh__manifest_read_all(o.script, &len)))
        rc = sh__cmd_fail("%s: %s", o.script, strerror(errno));
    if (!rc)
        rc =
            !strcmp(o.kind, "k8s") ? sh__manifest_k8s(&o, c, src, len) : gen_slurm(&o, c, src, len);
    free(src);
    sh_config_destroy(c);
    return rc;
}
