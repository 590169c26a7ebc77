/* What `shoal cluster manifest` writes (tools/cluster_manifest.h): a cluster script's job copy
 * with every node's address set by a prelude, and Kubernetes manifests for it. */
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
#include "tools/cluster_manifest.h"
#include "tools/cmd_util.h"

#define MIB (1024.0 * 1024.0)
#define KV_GUESS_MIB 512 /* a stage's KV pool when the script leaves kv.memory unset */
#define FRONT_MIB 512    /* the front: tokenizer, gateway, batcher and KV bookkeeping */
#define STARTUP_S 300    /* the front's --join-timeout and startup probe's span */

char *sh__manifest_read_all(const char *path, size_t *len)
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
const char *sh__manifest_scheme(const char *url)
{
    return strncmp(url, "tls+tcp://", 10) == 0 ? "tls+tcp" : "tcp";
}

/* The Lua prelude: node{} and cluster{} (and model{} when model_dir is given) wrapped so that
 * every node gets addr[i], the gateway http and every model model_dir/FILE, then the script's
 * text. Returns a malloc'd string (NULL out of memory). */
char *sh__manifest_job_script(const sh_cluster_config *c, char **addr, const char *http,
                              const char *model_dir, const char *who, const char *script,
                              const char *src, size_t len)
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
int sh__manifest_check_job(const char *text, const char *script, char **addr)
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

/* ---- Kubernetes ----------------------------------------------------------------------------- */

static int64_t file_bytes(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The memory (MiB) the busiest worker needs: its share of each replica's weights (the file split
 * evenly over the replica's stages, a stage's share split over its tensor-parallel ranks), the
 * KV pool of each stage it holds, a drafter's whole file (a self-drafter's: the model's), plus
 * the node's overhead. Every worker pod gets the same request (one pod template), so the
 * largest. */
static int worker_mib(const sh__manifest_opts *o, const sh_cluster_config *c, int64_t *out)
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
        if (rep->drafter_node >= 0 && rep->drafter_path) {
            int64_t d = file_bytes(rep->drafter_path);
            if (d < 0) {
                rc = sh__cmd_fail("%s: drafter file %s: %s", o->script, rep->drafter_path,
                                  strerror(errno));
                break;
            }
            need[rep->drafter_node] += (double)d / MIB;
        } else if (rep->drafter_node >= 0) { /* self: at most the model's whole file is read */
            need[rep->drafter_node] += (double)size / MIB;
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

static void meta(FILE *f, const sh__manifest_opts *o, const char *name, const char *component)
{
    fprintf(f, "metadata:\n  name: %s\n", name);
    if (o->ns)
        fprintf(f, "  namespace: %s\n", o->ns);
    fprintf(f, "  labels:\n");
    labels(f, "    ", o->name, component);
}

/* One StatefulSet: the front (worker == false) or the workers. */
static void statefulset(FILE *f, const sh__manifest_opts *o, bool worker, int32_t replicas,
                        int64_t mem_mib, bool api_keys)
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
    else /* workers may start minutes after the front (image pulls, model reads): the join
          * waits as long as the startup probe does */
        fprintf(f,
                "          command: [\"shoal\", \"serve\", \"-c\", \"/etc/shoal/cluster.lua\", "
                "\"--drain-timeout\", \"%g\", \"--recover-timeout\", \"%g\", "
                "\"--join-timeout\", \"%d\"]\n",
                o->drain_s, o->recover_s, STARTUP_S);
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
        /* A worker has no HTTP endpoint: it is up when its node's port accepts connections,
         * which it opens once its layers are loaded (the startup probe's span). */
        fprintf(f,
                "          startupProbe:\n            tcpSocket:\n              port: cluster\n"
                "            periodSeconds: 5\n            failureThreshold: %d\n"
                "          readinessProbe:\n            tcpSocket:\n              port: cluster\n"
                "            periodSeconds: 5\n"
                "          livenessProbe:\n            tcpSocket:\n              port: cluster\n"
                "            periodSeconds: 10\n            failureThreshold: 3\n",
                STARTUP_S / 5);
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
        fprintf(f,
                "          startupProbe:\n            httpGet:\n              path: /health\n"
                "              port: http\n            periodSeconds: 5\n"
                "            failureThreshold: %d\n"
                "          readinessProbe:\n            httpGet:\n              path: /health\n"
                "              port: http\n            periodSeconds: 5\n"
                "          livenessProbe:\n",
                STARTUP_S / 5);
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

int sh__manifest_k8s(const sh__manifest_opts *o, const sh_cluster_config *c, const char *src,
                     size_t len)
{
    int32_t g = c->gateway.node;
    if (c->n_nodes < 2)
        return sh__cmd_fail("%s has no worker node: run `shoal serve -m` in a Deployment instead",
                            o->script);
    for (int32_t i = 0; i < c->n_nodes; i++)
        if (!strcmp(sh__manifest_scheme(c->nodes[i].listen), "tls+tcp"))
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
        if (!rc && !(key = sh__manifest_read_all(o->key_file, &key_len)))
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
    char *text =
        rc ? NULL
           : sh__manifest_job_script(c, addr, http, o->model_dir, "k8s", o->script, src, len);
    if (!rc && !text)
        rc = sh__cmd_fail("out of memory");
    if (!rc)
        rc = sh__manifest_check_job(text, o->script, addr);
    if (!rc) {
        /* Written, but worth knowing: neither stops the manifests. */
        if (c->gateway.n_api_keys > 0)
            fprintf(stderr,
                    "warning: %s names API keys: they will be readable by anyone who "
                    "can read ConfigMap %s-script\n",
                    o->script, o->name);
        if (!c->kv.memory_bytes)
            fprintf(stderr,
                    "warning: %s leaves kv.memory unset: each worker requests %d MiB "
                    "of KV per stage, but sizes its pool from the machine's free memory\n",
                    o->script, KV_GUESS_MIB);
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
