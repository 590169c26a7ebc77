/* `shoal cluster manifest k8s|slurm CLUSTER.lua`: writes what an orchestrator needs to run a
 * cluster script's nodes (docs/deploy.md): Kubernetes manifests, or a Slurm job's copy of the
 * script with every node's address on the machine its task runs on. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "actors/cluster.h"
#include "actors/cluster_key.h"
#include "lua/config.h"
#include "tools/cmd_cluster_manifest.h"
#include "tools/cmd_util.h"

#define MIB (1024.0 * 1024.0)
#define NODE_OVERHEAD_MIB 256 /* a node's code, runtime, buffers and activations, beyond weights   \
                               */
#define KV_GUESS_MIB 512      /* a stage's KV pool when the script leaves kv.memory unset */
#define FRONT_MIB 512         /* the front: tokenizer, gateway, batcher and KV bookkeeping */

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

typedef struct opts {
    const char *kind, *script, *image, *ns, *name, *model_dir, *claim, *key_file, *hosts;
    int64_t port, http_port, threads;
    double drain_s, recover_s;
} opts;

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

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *p = realloc(buf, cap);
            if (!p) {
                free(buf);
                fclose(f);
                errno = ENOMEM;
                return NULL;
            }
            buf = p;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0)
            break;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* The scheme a node keeps in its new address: tls+tcp:// stays, the rest becomes tcp://. */
static const char *scheme_of(const char *url)
{
    return strncmp(url, "tls+tcp://", 10) == 0 ? "tls+tcp" : "tcp";
}

/* The Lua prelude: node{} and cluster{} (and model{} when model_dir is given) wrapped so that
 * every node gets addr[i], the gateway http and every model model_dir/FILE, then the script's
 * text. Returns a malloc'd string (NULL out of memory). */
static char *job_script(const sh_cluster_config *c, char **addr, const char *http,
                        const char *model_dir, const char *who, const char *script, const char *src,
                        size_t len)
{
    char *out = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&out, &n);
    if (!f)
        return NULL;
    fprintf(f,
            "-- Written by `shoal cluster manifest %s` from %s: that script, unchanged below\n"
            "-- this prelude, which sets every node's address, the gateway's%s for where the\n"
            "-- nodes run (docs/deploy.md).\n",
            who, base_name(script), model_dir ? " and the model paths" : "");
    fprintf(f, "local shoal_addr = {\n");
    for (int32_t i = 0; i < c->n_nodes; i++)
        fprintf(f, "  [\"%s\"] = \"%s\",\n", c->nodes[i].name, addr[i]);
    fprintf(f, "}\n");
    fprintf(f,
            "local shoal_node, shoal_cluster = node, cluster\n"
            "node = function(t)\n"
            "  if type(t) == \"table\" and shoal_addr[t.name] then t.listen = shoal_addr[t.name] "
            "end\n"
            "  return shoal_node(t)\n"
            "end\n"
            "cluster = function(t)\n"
            "  if type(t) == \"table\" and type(t.gateway) == \"table\" then t.gateway.http = "
            "\"%s\" end\n"
            "  return shoal_cluster(t)\n"
            "end\n",
            http);
    if (model_dir)
        fprintf(f,
                "local shoal_model = model\n"
                "model = function(t)\n"
                "  if type(t) == \"table\" and type(t.path) == \"string\" then\n"
                "    t.path = \"%s/\" .. t.path:match(\"[^/]*$\")\n"
                "  end\n"
                "  return shoal_model(t)\n"
                "end\n",
                model_dir);
    fprintf(f, "-- The cluster script follows.\n");
    fwrite(src, 1, len, f);
    if (len && src[len - 1] != '\n')
        fputc('\n', f);
    if (fclose(f) != 0) {
        free(out);
        return NULL;
    }
    return out;
}

/* Loads the generated text as the nodes will and checks that every node got its address (a
 * script that builds node{} some other way would keep its own). Returns 0 or 2 with a line. */
static int check_job(const char *text, const char *script, char **addr)
{
    sh_error e = {0};
    sh_cluster_config *c = NULL;
    if (sh_config_load_string(text, strlen(text), script, NULL, &c, &e))
        return sh__cmd_fail("%s: the generated script does not load: %s", script, e.msg);
    int rc = 0;
    for (int32_t i = 0; i < c->n_nodes && !rc; i++)
        if (strcmp(c->nodes[i].listen, addr[i]) != 0)
            rc = sh__cmd_fail("%s: node '%s' kept its address %s: the prelude could not set it "
                              "(does the script call node{} under another name?)",
                              script, c->nodes[i].name, c->nodes[i].listen);
    /* Spread over machines, some layouts no longer work (a tensor-parallel group over shared
     * memory): say so now rather than when the nodes start. */
    if (!rc)
        rc = sh__cmd_report(sh__cluster_check(c, script, &e), &e);
    sh_config_destroy(c);
    return rc;
}

/* ---- Slurm ---------------------------------------------------------------------------------- */

static int gen_slurm(const opts *o, const sh_cluster_config *c, const char *src, size_t len)
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
            snprintf(buf, sizeof buf, "%s://%s:%d", scheme_of(c->nodes[i].listen), host[t],
                     (int)(o->port + 1 + t));
            if (!(addr[i] = strdup(buf)))
                rc = sh__cmd_fail("out of memory");
        }
        snprintf(http, sizeof http, "%s:%d", host[0], (int)o->port);
    }
    char *text = rc ? NULL : job_script(c, addr, http, NULL, "slurm", o->script, src, len);
    if (!rc && !text)
        rc = sh__cmd_fail("out of memory");
    if (!rc)
        rc = check_job(text, o->script, addr);
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

/* ---- Kubernetes ----------------------------------------------------------------------------- */

static int64_t file_bytes(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The memory (MiB) the busiest worker needs: its share of each replica's weights (the file split
 * evenly over the replica's stages, a stage's share split over its tensor-parallel ranks), the
 * KV pool of each stage it holds, a drafter's whole file, plus the node's overhead. Every worker
 * pod gets the same request (one pod template), so the largest. */
static int worker_mib(const opts *o, const sh_cluster_config *c, int64_t *out)
{
    double *need = calloc((size_t)c->n_nodes, sizeof *need);
    if (!need)
        return sh__cmd_fail("out of memory");
    double kv = c->kv.memory_bytes ? (double)c->kv.memory_bytes / MIB : KV_GUESS_MIB;
    int rc = 0;
    for (int32_t r = 0; r < c->n_replicas && !rc; r++) {
        const sh_config_replica *rep = &c->replicas[r];
        const char *path = c->models[rep->model].path;
        int64_t size = file_bytes(path);
        if (size < 0) {
            rc = sh__cmd_fail("%s: model file %s: %s (the requests are sized from it)", o->script,
                              path, strerror(errno));
            break;
        }
        for (int32_t s = 0; s < rep->n_stages; s++) {
            const sh_config_stage *st = &rep->stages[s];
            int32_t tp = st->tp > 1 ? st->tp : 1;
            for (int32_t k = 0; k < tp; k++) {
                int32_t nd = tp > 1 ? st->ranks[k] : st->node;
                need[nd] += (double)size / MIB / rep->n_stages / tp + kv;
            }
        }
        if (rep->drafter_node >= 0) {
            int64_t d = file_bytes(rep->drafter_path);
            if (d < 0) {
                rc = sh__cmd_fail("%s: drafter file %s: %s", o->script, rep->drafter_path,
                                  strerror(errno));
                break;
            }
            need[rep->drafter_node] += (double)d / MIB;
        }
    }
    double most = 0;
    for (int32_t i = 0; i < c->n_nodes; i++)
        if (i != c->gateway.node && need[i] > most)
            most = need[i];
    free(need);
    /* Rounded up to 64 MiB. */
    *out = ((int64_t)(most + NODE_OVERHEAD_MIB) + 63) / 64 * 64;
    return rc;
}

static void labels(FILE *f, const char *indent, const char *name, const char *component)
{
    fprintf(f, "%sapp.kubernetes.io/name: shoal\n%sapp.kubernetes.io/instance: %s\n", indent,
            indent, name);
    if (component)
        fprintf(f, "%sapp.kubernetes.io/component: %s\n", indent, component);
}

static void meta(FILE *f, const opts *o, const char *name, const char *component)
{
    fprintf(f, "metadata:\n  name: %s\n", name);
    if (o->ns)
        fprintf(f, "  namespace: %s\n", o->ns);
    fprintf(f, "  labels:\n");
    labels(f, "    ", o->name, component);
}

/* One StatefulSet: the front (worker == false) or the workers. */
static void statefulset(FILE *f, const opts *o, bool worker, int32_t replicas, int64_t mem_mib,
                        bool api_keys)
{
    char name[80];
    snprintf(name, sizeof name, worker ? "%s" : "%s-front", o->name);
    const char *comp = worker ? "worker" : "front";
    int grace = (int)(o->drain_s + 0.999) + 15;
    fprintf(f, "---\napiVersion: apps/v1\nkind: StatefulSet\n");
    meta(f, o, name, comp);
    fprintf(f, "spec:\n  serviceName: %s\n  replicas: %d\n  podManagementPolicy: Parallel\n",
            o->name, (int)replicas);
    fprintf(f, "  selector:\n    matchLabels:\n");
    labels(f, "      ", o->name, comp);
    fprintf(f, "  template:\n    metadata:\n      labels:\n");
    labels(f, "        ", o->name, comp);
    fprintf(f, "    spec:\n      terminationGracePeriodSeconds: %d\n      containers:\n", grace);
    fprintf(f, "        - name: %s\n          image: \"%s\"\n", comp, o->image);
    if (worker)
        fprintf(f,
                "          command: [\"shoal\", \"node\", \"-c\", \"/etc/shoal/cluster.lua\", "
                "\"--name-from\", \"HOSTNAME\", \"-t\", \"%d\"]\n",
                (int)o->threads);
    else
        fprintf(f,
                "          command: [\"shoal\", \"serve\", \"-c\", \"/etc/shoal/cluster.lua\", "
                "\"--drain-timeout\", \"%g\", \"--recover-timeout\", \"%g\"]\n",
                o->drain_s, o->recover_s);
    fprintf(f, "          env:\n");
    if (worker) /* the pod's name, shoal-K: --name-from takes K (set here, not left to the
                 * container runtime) */
        fprintf(f, "            - name: HOSTNAME\n"
                   "              valueFrom:\n"
                   "                fieldRef:\n"
                   "                  fieldPath: metadata.name\n");
    fprintf(f, "            - name: SHOAL_CLUSTER_KEY_FILE\n"
               "              value: /etc/shoal-key/cluster.key\n");
    fprintf(f, "          ports:\n            - name: cluster\n              containerPort: %d\n",
            (int)o->port);
    if (!worker)
        fprintf(f, "            - name: http\n              containerPort: %d\n",
                (int)o->http_port);
    if (worker) {
        /* A worker has no HTTP endpoint: it is up when its node's port accepts connections. */
        fprintf(f,
                "          readinessProbe:\n            tcpSocket:\n              port: cluster\n"
                "            periodSeconds: 5\n"
                "          livenessProbe:\n            tcpSocket:\n              port: cluster\n"
                "            initialDelaySeconds: 30\n            periodSeconds: 10\n"
                "            failureThreshold: 3\n");
        /* Every pod of a deleted cluster gets SIGTERM at once: a worker waits while the front
         * drains, so that the requests in flight can finish. */
        fprintf(f,
                "          lifecycle:\n            preStop:\n              sleep:\n"
                "                seconds: %d\n",
                (int)(o->drain_s + 0.999));
    } else {
        /* The front listens only once every worker has joined (--join-timeout), then answers
         * /health; /admin/status answers while it drains (503 /health takes it out of the
         * Service). With API keys /admin/status needs one: the port stands in. */
        fprintf(f, "          startupProbe:\n            httpGet:\n              path: /health\n"
                   "              port: http\n            periodSeconds: 5\n"
                   "            failureThreshold: 60\n"
                   "          readinessProbe:\n            httpGet:\n              path: /health\n"
                   "              port: http\n            periodSeconds: 5\n"
                   "          livenessProbe:\n");
        if (api_keys)
            fprintf(f, "            tcpSocket:\n              port: http\n");
        else
            fprintf(f, "            httpGet:\n              path: /admin/status\n"
                       "              port: http\n");
        fprintf(f, "            periodSeconds: 10\n            timeoutSeconds: 5\n"
                   "            failureThreshold: 3\n");
    }
    fprintf(f,
            "          resources:\n            requests:\n              cpu: \"%d\"\n"
            "              memory: %dMi\n            limits:\n              memory: %dMi\n",
            worker ? (int)o->threads : 1, (int)mem_mib, (int)(mem_mib * 3 / 2));
    fprintf(f,
            "          volumeMounts:\n"
            "            - name: script\n              mountPath: /etc/shoal\n"
            "              readOnly: true\n"
            "            - name: cluster-key\n              mountPath: /etc/shoal-key\n"
            "              readOnly: true\n"
            "            - name: models\n              mountPath: %s\n"
            "              readOnly: true\n",
            o->model_dir);
    fprintf(f,
            "      volumes:\n"
            "        - name: script\n          configMap:\n            name: %s-script\n"
            "        - name: cluster-key\n          secret:\n            secretName: "
            "%s-cluster-key\n"
            "        - name: models\n          persistentVolumeClaim:\n            claimName: "
            "%s\n            readOnly: true\n",
            o->name, o->name, o->claim);
}

static void b64(FILE *f, const unsigned char *s, size_t n)
{
    static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) |
                     (i + 2 < n ? s[i + 2] : 0);
        fputc(t[v >> 18 & 63], f);
        fputc(t[v >> 12 & 63], f);
        fputc(i + 1 < n ? t[v >> 6 & 63] : '=', f);
        fputc(i + 2 < n ? t[v & 63] : '=', f);
    }
}

static int gen_k8s(const opts *o, const sh_cluster_config *c, const char *src, size_t len)
{
    int32_t g = c->gateway.node;
    if (c->n_nodes < 2)
        return sh__cmd_fail("%s has no worker node: run `shoal serve -m` in a Deployment instead",
                            o->script);
    for (int32_t i = 0; i < c->n_nodes; i++)
        if (!strcmp(scheme_of(c->nodes[i].listen), "tls+tcp"))
            return sh__cmd_fail("%s: node '%s' listens on tls+tcp://: the generator does not "
                                "place certificate files yet (use tcp:// with a cluster key)",
                                o->script, c->nodes[i].name);
    if (c->watchdog.policy_given && strcmp(c->watchdog.policy, "default") != 0 &&
        strcmp(base_name(c->watchdog.policy), "default.lua") != 0)
        return sh__cmd_fail("%s: watchdog.policy names a file of its own: the generator does "
                            "not place it yet",
                            o->script);
    int64_t mem = 0;
    int rc = worker_mib(o, c, &mem);
    if (rc)
        return rc;
    char *key = NULL;
    size_t key_len = 0;
    if (o->key_file) {
        sh_auth_key k;
        sh_error ke = {0};
        rc = sh__cmd_report(sh__cluster_key_load(o->key_file, NULL, &k, &ke), &ke);
        if (!rc && !(key = read_all(o->key_file, &key_len)))
            rc = sh__cmd_fail("--cluster-key-file %s: %s", o->key_file, strerror(errno));
        if (rc)
            return rc;
    }
    char **addr = calloc((size_t)c->n_nodes, sizeof *addr);
    if (!addr) {
        free(key);
        return sh__cmd_fail("out of memory");
    }
    for (int32_t i = 0, k = 0; i < c->n_nodes && !rc; i++) {
        char buf[300];
        if (i == g)
            snprintf(buf, sizeof buf, "tcp://%s-front-0.%s:%d", o->name, o->name, (int)o->port);
        else
            snprintf(buf, sizeof buf, "tcp://%s-%d.%s:%d", o->name, (int)k++, o->name,
                     (int)o->port);
        if (!(addr[i] = strdup(buf)))
            rc = sh__cmd_fail("out of memory");
    }
    char http[64];
    snprintf(http, sizeof http, "0.0.0.0:%d", (int)o->http_port);
    char *text = rc ? NULL : job_script(c, addr, http, o->model_dir, "k8s", o->script, src, len);
    if (!rc && !text)
        rc = sh__cmd_fail("out of memory");
    if (!rc)
        rc = check_job(text, o->script, addr);
    if (!rc) {
        FILE *f = stdout;
        fprintf(f,
                "# Written by `shoal cluster manifest k8s %s` (docs/deploy.md, \"Kubernetes\").\n",
                base_name(o->script));
        fprintf(f, "apiVersion: v1\nkind: Service\n");
        meta(f, o, o->name, NULL);
        fprintf(f, "spec:\n  clusterIP: None\n  publishNotReadyAddresses: true\n  selector:\n");
        labels(f, "    ", o->name, NULL);
        fprintf(f, "  ports:\n    - name: cluster\n      port: %d\n      targetPort: cluster\n",
                (int)o->port);
        char nm[80];
        snprintf(nm, sizeof nm, "%s-http", o->name);
        fprintf(f, "---\napiVersion: v1\nkind: Service\n");
        meta(f, o, nm, "front");
        fprintf(f, "spec:\n  selector:\n");
        labels(f, "    ", o->name, "front");
        fprintf(f, "  ports:\n    - name: http\n      port: %d\n      targetPort: http\n",
                (int)o->http_port);
        snprintf(nm, sizeof nm, "%s-script", o->name);
        fprintf(f, "---\napiVersion: v1\nkind: ConfigMap\n");
        meta(f, o, nm, NULL);
        fprintf(f, "data:\n  cluster.lua: |\n");
        for (const char *p = text; *p;) {
            const char *e = strchr(p, '\n');
            size_t n = e ? (size_t)(e - p) : strlen(p);
            /* Trailing blanks would change how YAML tools print the block; keep lines as they
             * are otherwise. */
            while (n && (p[n - 1] == ' ' || p[n - 1] == '\t'))
                n--;
            if (n)
                fprintf(f, "    %.*s\n", (int)n, p);
            else
                fputc('\n', f);
            p = e ? e + 1 : p + strlen(p);
        }
        if (key) {
            while (key_len && (key[key_len - 1] == '\n' || key[key_len - 1] == '\r' ||
                               key[key_len - 1] == ' ' || key[key_len - 1] == '\t'))
                key_len--;
            snprintf(nm, sizeof nm, "%s-cluster-key", o->name);
            fprintf(f, "---\napiVersion: v1\nkind: Secret\n");
            meta(f, o, nm, NULL);
            fprintf(f, "type: Opaque\ndata:\n  cluster.key: ");
            b64(f, (const unsigned char *)key, key_len);
            fputc('\n', f);
        }
        statefulset(f, o, false, 1, FRONT_MIB, c->gateway.n_api_keys > 0);
        statefulset(f, o, true, c->n_nodes - 1, mem, c->gateway.n_api_keys > 0);
        if (fflush(f) != 0 || ferror(f))
            rc = sh__cmd_fail("writing the manifests: %s", strerror(errno));
    }
    free(text);
    for (int32_t i = 0; i < c->n_nodes; i++)
        free(addr[i]);
    free(addr);
    free(key);
    return rc;
}

/* ---- flags ---------------------------------------------------------------------------------- */

static int parse(int argc, char **argv, opts *o)
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
    opts o = {.image = NULL,
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
    if (!rc && !(src = read_all(o.script, &len)))
        rc = sh__cmd_fail("%s: %s", o.script, strerror(errno));
    if (!rc)
        rc = !strcmp(o.kind, "k8s") ? gen_k8s(&o, c, src, len) : gen_slurm(&o, c, src, len);
    free(src);
    sh_config_destroy(c);
    return rc;
}
