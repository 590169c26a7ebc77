/* `shoal serve`: serves a model over an OpenAI-compatible HTTP API, with the gateway, batcher,
 * kvmgr and stage actors of one replica in this process. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "actors/cluster.h"
#include "actors/cluster_events.h"
#include "actors/cluster_key.h"
#include "actors/node_metrics.h"
#include "actors/replica.h"
#include "actors/serve.h"
#include "actors/supervisor.h"
#include "base/error.h"
#include "base/file.h"
#include "kernels/backend.h"
#include "lua/config.h"
#include "model/gguf.h"
#include "tools/cluster_status.h"
#include "tools/cmd.h"
#include "tools/cmd_fault.h"
#include "tools/cmd_util.h"
#include "tools/serve_degrade.h"

#define DEFAULT_MODEL "models/smollm2-135m-instruct-q4_1.gguf"
#define MAX_KEYS 1024
#define MAX_KEY_FILE (1 << 20)
#define KEY_ENV "SHOAL_API_KEY"

typedef struct serve_opts {
    const char *model, *config, *host, *model_name, *log_level;
    char host_buf[256];
    int port;
    int32_t threads, max_seqs, step_tokens, max_wait_ms, ctx, max_tokens, max_queue, max_n;
    int64_t kv_blocks;
    uint64_t kv_mem, max_body;
    uint32_t max_conns, header_timeout_ms, request_timeout_ms;
    uint32_t idle_timeout_ms, max_conns_per_ip, drain_timeout_ms;
    bool metrics_public;
    const char *key_file; /* --api-key-file: read at start and on SIGHUP */
    int32_t n_fixed_keys; /* keys[0, n_fixed_keys) come from flags, script and environment; the
                             key file's follow and are replaced on reload */
    bool no_prefix_cache, kv_f16, kv_f32; /* the KV type flags given; F16 unless --kv-f32 */
    bool port_set; /* --port given: it wins over the port of the config's gateway.http */
    const sh_cluster_config *cfg; /* -c's script */
    bool cluster;                 /* the script's stages run on worker nodes */
    uint32_t join_timeout_ms;     /* --join-timeout */
    const char *fault_path;       /* --fault-scenario: a scenario against the front's links */
    const char *fault_epoch;      /* --fault-epoch: its times from this instant (UNIX_MS, @FILE) */
    const char *cluster_key_file; /* --cluster-key-file */
    uint32_t step_timeout_ms;     /* --step-timeout; 0: none */
    bool step_timeout_set;        /* --step-timeout given (else: 30 s with worker nodes only) */
    uint32_t router_refresh_ms;   /* --router-refresh (default 5 s) */
    uint32_t redispatch_ms;       /* --redispatch-after (default 0.5 s; UINT32_MAX: never) */
    double affinity_slack;        /* --affinity-slack (default 4096; -1: --no-affinity) */
    sh_serve_degrade deg;         /* --policy and its settings (tools/serve_degrade.h) */
    bool recover_set;             /* --recover-timeout given */
    uint32_t recover_ms;          /* --recover-timeout: wait this long for a lost worker to come
                                   * back (0: fail stop at once) */
    sh_openai_key keys[MAX_KEYS];
    int32_t n_keys;
    char *key_mem[MAX_KEYS];
} serve_opts;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal serve [-m MODEL | -c CLUSTER.lua] [--host H] [--port P] [options]\n\n"
            "Serves a model over an OpenAI-compatible HTTP API (POST /v1/completions,\n"
            "POST /v1/chat/completions, GET /v1/models, /health, /metrics) with continuous\n"
            "batching and a paged KV cache, on the CPU. GET /admin/cluster describes its\n"
            "nodes, stages and load (`shoal cluster status` prints it).\n\n"
            "  -m MODEL            GGUF model (default " DEFAULT_MODEL ")\n"
            "  -c CLUSTER.lua      read model, listen address, batcher and KV settings from a\n"
            "                      cluster script (one node; see lua/examples/single-node.lua);\n"
            "                      its relative model paths are relative to the script\n"
            "  --host H            address to listen on (default 127.0.0.1, or the script's)\n"
            "  --port P            port (default 8080, or the script's; 0 picks a free one)\n"
            "  -t THREADS          compute threads (default: all CPUs)\n"
            "  --model-name NAME   the model id clients name (default: file name without .gguf)\n"
            "  --ctx N             context window per sequence (default: the model's, max 8192)\n"
            "  --kv-mem BYTES      KV cache memory budget, e.g. 512M, 2G (default 1G, or a\n"
            "                      quarter of the available memory when that is less)\n"
            "  --kv-blocks N       KV cache size in 16-token blocks (overrides --kv-mem)\n"
            "  --kv-f16            keep the KV cache in F16 (the default: half the memory)\n"
            "  --kv-f32            keep the KV cache in F32\n"
            "  --no-prefix-cache   do not reuse the KV of shared prompt prefixes\n"
            "  --max-seqs N        sequences per step (default 64)\n"
            "  --step-tokens N     token budget per step (default 4096)\n"
            "  --max-wait-ms N     wait to form a batch when idle (default 50)\n"
            "  --max-queue N       requests waiting beyond those running before 429\n"
            "                      (per replica; default 1024)\n"
            "  --max-tokens N      largest max_tokens a request may ask for (default: --ctx)\n"
            "  --max-n N           largest n (choices per request; default 8)\n"
            "  --max-body BYTES    largest request body (default 2M; a full 8k-token prompt\n"
            "                      as JSON is under 100K)\n"
            "  --max-conns N       open connections (default 1024); at the limit the\n"
            "                      longest-idle connection is closed for a new one\n"
            "  --max-conns-per-ip N  open connections per client address (default: no limit)\n"
            "  --header-timeout-ms N  time a new connection has, from accept, to send its\n"
            "                      request headers (default 10000)\n"
            "  --idle-timeout-ms N  keep-alive wait for a connection's next request\n"
            "                      (default 60000)\n"
            "  --request-timeout S  a request still generating after S seconds ends with\n"
            "                      finish_reason \"timeout\" (default: none)\n"
            "  --drain-timeout S   on SIGTERM/SIGINT, how long requests in flight may finish\n"
            "                      (default 30; a second signal stops at once)\n"
            "  --api-key KEY[:P][:admin]  require this bearer key (repeatable); P is its\n"
            "                      priority class, 0-255 (lower runs first; default 0);\n"
            "                      :admin lets it change the server too (POST /admin/*,\n"
            "                      which any other key is refused with 403). Visible to\n"
            "                      other users in ps: prefer --api-key-file or " KEY_ENV "\n"
            "  --api-key-file PATH  keys, one KEY[:P][:admin] per line (# comments and blank\n"
            "                      lines skipped); re-read on SIGHUP\n"
            "  env " KEY_ENV "   keys, KEY[:P][:admin] separated by commas\n"
            "  --metrics-public    serve /metrics without a key even when keys are required\n"
            "  --fault-scenario F  with -c: apply fault scenario F to the links leaving the\n"
            "                      front, times counted from the end of the join (testing)\n"
            "  --fault-epoch E     with --fault-scenario: its times from E (UNIX_MS, or @FILE\n"
            "                      holding it; waits for the file; docs/chaos.md)\n"
            "  --join-timeout S    with -c and worker nodes: how long to wait for every\n"
            "                      worker to join (default 60; see docs/cluster.md)\n"
            "  --cluster-key-file FILE  with -c and worker nodes: the cluster key the\n"
            "                      workers must prove in HELLO (else " SH_CLUSTER_KEY_ENV ",\n"
            "                      else the script's cluster.key_file; none: open)\n"
            "  --step-timeout S    a batched step not answered within S seconds fails its\n"
            "                      requests with 503 (default: 30 with worker nodes, else\n"
            "                      none; 0: none)\n"
            "  --router-refresh S  with several replicas: how often the router re-weighs them\n"
            "                      from their measured throughput (default 5)\n"
            "  --redispatch-after S  move a request still queued on one replica after S\n"
            "                      seconds to another with room (default 0.5; 0: never)\n"
            "  --affinity-slack N  prefer the replica that holds a prompt's prefix while its\n"
            "                      load is within N estimated tokens of the least loaded\n"
            "                      (default 4096); --no-affinity: never\n"
            "  --recover-timeout S  with worker nodes: when one is lost, pause its replica and\n"
            "                      wait up to S seconds for it to come back (stopped, cut off,\n"
            "                      or restarted, e.g. by `shoal cluster up`), then resume every\n"
            "                      request by recompute (default 30; 0: fail stop at once,\n"
            "                      exit 3)\n");
    sh__serve_degrade_usage(f);
    fprintf(f, "  --log-level L       error, warn, info, debug (default info)\n\n"
               "Prints `listening on http://HOST:PORT` on stderr when ready. SIGINT or SIGTERM\n"
               "drains and stops it (see --drain-timeout); SIGHUP re-reads --api-key-file and\n"
               "the --policy script.\n"
               "Exit status: 0 after a signal, 2 on bad usage or a bad script, 1 on other start\n"
               "failures, 3 when a worker node of -c's cluster was lost (every open request was\n"
               "ended with an error; restart the cluster).\n");
}

/* "512M", "2G", "1048576" */
static bool parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return false;
    double mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm')
        mul = 1024.0 * 1024, end++;
    else if (*end == 'G' || *end == 'g')
        mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'i' || *end == 'B')
        end++;
    if (*end == 'B')
        end++;
    if (*end || v * mul > 1e15)
        return false;
    *out = (uint64_t)(v * mul);
    return true;
}

/* Adds KEY, KEY:PRIORITY, KEY:admin or KEY:PRIORITY:admin from `what` (a flag, the environment,
 * FILE:LINE; named in errors, which never print the key). A final ":admin" makes an admin key
 * (the POST routes under /admin/ too). A ':' suffix must then be a priority 0-255: "k:abc" is
 * refused, not taken as the key "k:abc" (a key containing ':' is written with its priority,
 * "a:b:0"). */
static int add_key(serve_opts *o, const char *v, const char *what)
{
    if (o->n_keys == MAX_KEYS)
        return sh__cmd_fail("%s: at most %d API keys", what, MAX_KEYS);
    char *k = strdup(v);
    if (!k)
        return sh__cmd_fail("out of memory");
    int64_t prio = 0;
    bool admin = false;
    char *colon = strrchr(k, ':');
    if (colon && !strcmp(colon + 1, "admin")) {
        admin = true;
        *colon = '\0';
        colon = strrchr(k, ':');
    }
    if (colon) {
        bool digits = colon[1] != '\0';
        for (const char *p = colon + 1; *p; p++)
            digits = digits && *p >= '0' && *p <= '9';
        if (!digits || !sh__cmd_parse_i64(colon + 1, 0, 255, &prio)) {
            free(k);
            return sh__cmd_fail("%s: the text after the last ':' of an API key must be its "
                                "priority, a whole number from 0 to 255, or 'admin'; write "
                                "KEY, KEY:PRIORITY or KEY:PRIORITY:admin (a key that contains "
                                "':' needs a priority after it, e.g. KEY:0)",
                                what);
        }
        *colon = '\0';
    }
    const char *why = !*k ? "an API key is empty" : NULL;
    for (const char *p = k; *p && !why; p++)
        if ((unsigned char)*p <= ' ' || *p == 0x7f)
            why = "an API key contains a space or control character";
    if (why) {
        free(k);
        return sh__cmd_fail("%s: %s", what, why);
    }
    o->key_mem[o->n_keys] = k;
    o->keys[o->n_keys++] = (sh_openai_key){k, (int32_t)prio, admin};
    return 0;
}

/* Trims blanks (and a CR) from both ends of s in place. */
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t l = strlen(s);
    while (l && (s[l - 1] == ' ' || s[l - 1] == '\t' || s[l - 1] == '\r' || s[l - 1] == '\n'))
        s[--l] = '\0';
    return s;
}

/* Keys from the environment variable: KEY[:P] items separated by commas. */
static int add_env_keys(serve_opts *o)
{
    const char *env = getenv(KEY_ENV);
    if (!env || !*env)
        return 0;
    char *buf = strdup(env);
    if (!buf)
        return sh__cmd_fail("out of memory");
    int rc = 0, item = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && !rc;
         tok = strtok_r(NULL, ",", &save)) {
        char what[64];
        snprintf(what, sizeof what, KEY_ENV " (item %d)", ++item);
        char *t = trim(tok);
        if (*t)
            rc = add_key(o, t, what);
    }
    free(buf);
    return rc;
}

/* Reads the key file into keys[n_fixed_keys...] (replacing what the file gave before). Every
 * line is KEY or KEY:PRIORITY; blank lines and lines starting with '#' are skipped. A file that
 * cannot be read, has a bad line or holds no key is an error, and the keys stay as they were. */
static int load_key_file(serve_opts *o)
{
    // The file layer refuses a FIFO or a device before opening it, so a key file cannot hang us.
    int fd = -1;
    uint64_t size = 0;
    sh_error fe = {0};
    if (sh__file_open(o->key_file, &fd, &size, &fe))
        return sh__cmd_fail("--api-key-file %s", fe.msg);
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return sh__cmd_fail("--api-key-file %s: %s", o->key_file, strerror(errno));
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && (sb.st_mode & 077))
        fprintf(stderr,
                "shoal: warning: --api-key-file %s can be read by other users (chmod 600 "
                "it)\n",
                o->key_file);
    char *buf = malloc(MAX_KEY_FILE + 1);
    size_t n = buf ? fread(buf, 1, MAX_KEY_FILE + 1, f) : 0;
    bool err = buf && ferror(f);
    fclose(f);
    if (!buf)
        return sh__cmd_fail("out of memory");
    if (err || n > MAX_KEY_FILE) {
        free(buf);
        return sh__cmd_fail("--api-key-file %s: %s", o->key_file,
                            err ? "read error" : "larger than 1 MiB");
    }
    buf[n] = '\0';
    // Parse into the tail of the list; on failure the old tail is put back.
    int32_t old_n = o->n_keys;
    sh_openai_key old_keys[MAX_KEYS];
    char *old_mem[MAX_KEYS];
    int32_t n_old = old_n - o->n_fixed_keys;
    memcpy(old_keys, o->keys + o->n_fixed_keys, (size_t)n_old * sizeof *old_keys);
    memcpy(old_mem, o->key_mem + o->n_fixed_keys, (size_t)n_old * sizeof *old_mem);
    o->n_keys = o->n_fixed_keys;
    int rc = 0, line = 0;
    for (char *p = buf, *nl; p && !rc; p = nl) {
        nl = strchr(p, '\n');
        if (nl)
            *nl++ = '\0';
        line++;
        char *t = trim(p);
        if (!*t || *t == '#')
            continue;
        char what[300];
        snprintf(what, sizeof what, "--api-key-file %.200s:%d", o->key_file, line);
        rc = add_key(o, t, what);
    }
    free(buf);
    if (!rc && o->n_keys == o->n_fixed_keys)
        rc = sh__cmd_fail("--api-key-file %s: no key in it (one KEY or KEY:PRIORITY per line)",
                          o->key_file);
    if (rc) {
        for (int32_t i = o->n_fixed_keys; i < o->n_keys; i++)
            free(o->key_mem[i]);
        memcpy(o->keys + o->n_fixed_keys, old_keys, (size_t)n_old * sizeof *old_keys);
        memcpy(o->key_mem + o->n_fixed_keys, old_mem, (size_t)n_old * sizeof *old_mem);
        o->n_keys = old_n;
        return rc;
    }
    for (int32_t i = 0; i < n_old; i++)
        free(old_mem[i]);
    return 0;
}

/* Parses a whole number for flag `a` in [lo, hi]; on failure *want says what was expected. */
static bool num(const char *v, int64_t lo, int64_t hi, int64_t *n, char *want, size_t cap)
{
    snprintf(want, cap, "a whole number from %" PRId64 " to %" PRId64, lo, hi);
    return sh__cmd_parse_i64(v, lo, hi, n);
}

/* The options that take a value, each between spaces. */
#define VALUE_FLAGS                                                                                \
    " -m -c --host --port -t --model-name --ctx --kv-mem --kv-blocks --max-seqs --step-tokens "    \
    "--max-wait-ms --max-queue --max-tokens --max-n --max-body --max-conns --header-timeout-ms "   \
    "--request-timeout --api-key --log-level --idle-timeout-ms --max-conns-per-ip "                \
    "--drain-timeout --api-key-file --join-timeout --step-timeout --router-refresh "               \
    "--redispatch-after --affinity-slack --cluster-key-file --recover-timeout --fault-scenario "   \
    "--fault-epoch "

/* Returns 0 to go on, 1 after --help, 2 on bad usage (message printed). */
static int parse(int argc, char **argv, serve_opts *o)
{
    o->port = 8080;
    o->max_body = 2u << 20; /* with max_conns 1024: at most 2 GiB of bodies in flight */
    o->drain_timeout_ms = 30000;
    o->join_timeout_ms = SH_REPLICA_JOIN_TIMEOUT_MS;
    o->max_queue = 1024; /* requests waiting per replica beyond those running (actors/replica.h) */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            o->no_prefix_cache = true;
            continue;
        }
        if (!strcmp(a, "--kv-f16") || !strcmp(a, "--kv-f32")) {
            o->kv_f32 = !strcmp(a, "--kv-f32"); /* the last one given wins */
            o->kv_f16 = !o->kv_f32;
            continue;
        }
        if (!strcmp(a, "--metrics-public")) {
            o->metrics_public = true;
            continue;
        }
        if (!strcmp(a, "--no-affinity")) {
            o->affinity_slack = -1;
            continue;
        }
        int dr = sh__serve_degrade_flag(&o->deg, argc, argv, &i);
        if (dr != 1) {
            if (dr)
                return 2;
            continue;
        }
        if (!sh__cmd_is_flag(VALUE_FLAGS, a))
            return sh__cmd_fail("unknown option '%s' (see shoal serve --help)", a);
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value (see shoal serve --help)", a);
        const char *v = argv[++i];
        int64_t n = 0;
        bool ok = true;
        char want[160] = "";
        if (!strcmp(a, "-m"))
            o->model = v;
        else if (!strcmp(a, "-c"))
            o->config = v;
        else if (!strcmp(a, "--host"))
            o->host = v;
        else if (!strcmp(a, "--port"))
            ok = num(v, 0, 65535, &n, want, sizeof want) &&
                 ((o->port = (int)n), (o->port_set = true));
        else if (!strcmp(a, "-t"))
            ok = num(v, 1, 1024, &n, want, sizeof want) && ((o->threads = (int32_t)n), true);
        else if (!strcmp(a, "--model-name"))
            o->model_name = v;
        else if (!strcmp(a, "--ctx"))
            ok = num(v, 16, 1 << 20, &n, want, sizeof want) && ((o->ctx = (int32_t)n), true);
        else if (!strcmp(a, "--kv-mem")) {
            snprintf(want, sizeof want, "a size above 0 like 512M or 2G (suffixes K, M, G)");
            ok = parse_bytes(v, &o->kv_mem) && o->kv_mem > 0;
        } else if (!strcmp(a, "--kv-blocks"))
            ok = num(v, 1, 1 << 24, &o->kv_blocks, want, sizeof want);
        else if (!strcmp(a, "--max-seqs"))
            ok = num(v, 1, 1024, &n, want, sizeof want) && ((o->max_seqs = (int32_t)n), true);
        else if (!strcmp(a, "--step-tokens"))
            ok = num(v, 16, 65536, &n, want, sizeof want) && ((o->step_tokens = (int32_t)n), true);
        else if (!strcmp(a, "--max-wait-ms"))
            ok = num(v, 1, 10000, &n, want, sizeof want) && ((o->max_wait_ms = (int32_t)n), true);
        else if (!strcmp(a, "--max-queue"))
            ok = num(v, 1, 1 << 20, &n, want, sizeof want) && ((o->max_queue = (int32_t)n), true);
        else if (!strcmp(a, "--max-tokens"))
            ok = num(v, 1, 1 << 20, &n, want, sizeof want) && ((o->max_tokens = (int32_t)n), true);
        else if (!strcmp(a, "--max-n"))
            ok = num(v, 1, 128, &n, want, sizeof want) && ((o->max_n = (int32_t)n), true);
        else if (!strcmp(a, "--max-body")) {
            snprintf(want, sizeof want,
                     "a size from 1K (1024 bytes) to 1G, like 65536, 512K or 2M (suffixes K, M, "
                     "G)");
            ok = parse_bytes(v, &o->max_body) && o->max_body >= 1024 && o->max_body <= (1u << 30);
        } else if (!strcmp(a, "--max-conns"))
            ok = num(v, 1, 1 << 20, &n, want, sizeof want) && ((o->max_conns = (uint32_t)n), true);
        else if (!strcmp(a, "--max-conns-per-ip"))
            ok = num(v, 1, 1 << 20, &n, want, sizeof want) &&
                 ((o->max_conns_per_ip = (uint32_t)n), true);
        else if (!strcmp(a, "--header-timeout-ms"))
            ok = num(v, 100, 3600000, &n, want, sizeof want) &&
                 ((o->header_timeout_ms = (uint32_t)n), true);
        else if (!strcmp(a, "--idle-timeout-ms"))
            ok = num(v, 100, 86400000, &n, want, sizeof want) &&
                 ((o->idle_timeout_ms = (uint32_t)n), true);
        else if (!strcmp(a, "--request-timeout"))
            ok = num(v, 1, 86400, &n, want, sizeof want) &&
                 ((o->request_timeout_ms = (uint32_t)n * 1000), true);
        else if (!strcmp(a, "--drain-timeout")) {
            double d = 0;
            snprintf(want, sizeof want, "seconds from 0 to 3600 (decimals allowed, e.g. 0.5)");
            ok = sh__cmd_parse_f64(v, 0, 3600, &d) &&
                 ((o->drain_timeout_ms = (uint32_t)(d * 1000.0 + 0.5)), true);
        } else if (!strcmp(a, "--cluster-key-file")) {
            o->cluster_key_file = v;
        } else if (!strcmp(a, "--fault-scenario")) {
            o->fault_path = v;
        } else if (!strcmp(a, "--fault-epoch")) {
            if (sh__cmd_fault_epoch_check(v))
                return 2;
            o->fault_epoch = v;
        } else if (!strcmp(a, "--join-timeout")) {
            double d = 0;
            snprintf(want, sizeof want, "seconds from 0.1 to 3600 (decimals allowed)");
            ok = sh__cmd_parse_f64(v, 0.1, 3600, &d) &&
                 ((o->join_timeout_ms = (uint32_t)(d * 1000.0 + 0.5)), true);
        } else if (!strcmp(a, "--step-timeout")) {
            double d = 0;
            snprintf(want, sizeof want, "seconds from 0 to 3600 (decimals allowed; 0: none)");
            ok = sh__cmd_parse_f64(v, 0, 3600, &d) &&
                 ((o->step_timeout_ms = (uint32_t)(d * 1000.0 + 0.5)), true) &&
                 (o->step_timeout_set = true);
        } else if (!strcmp(a, "--router-refresh") || !strcmp(a, "--redispatch-after")) {
            double d = 0;
            bool re = !strcmp(a, "--router-refresh");
            snprintf(want, sizeof want, "seconds from %s to 3600 (decimals allowed%s)",
                     re ? "0.1" : "0", re ? "" : "; 0: never");
            ok = sh__cmd_parse_f64(v, re ? 0.1 : 0, 3600, &d);
            uint32_t ms = (uint32_t)(d * 1000.0 + 0.5);
            if (ok && re)
                o->router_refresh_ms = ms;
            else if (ok)
                o->redispatch_ms = ms ? ms : UINT32_MAX;
        } else if (!strcmp(a, "--recover-timeout")) {
            double d = 0;
            snprintf(want, sizeof want, "seconds from 0 to 3600 (decimals allowed; 0: none)");
            ok = sh__cmd_parse_f64(v, 0, 3600, &d) &&
                 ((o->recover_ms = (uint32_t)(d * 1000.0 + 0.5)), (o->recover_set = true));
        } else if (!strcmp(a, "--affinity-slack")) {
            double d = 0;
            snprintf(want, sizeof want, "load units from 1 to 1e9");
            ok = sh__cmd_parse_f64(v, 1, 1e9, &d) && ((o->affinity_slack = d), true);
        } else if (!strcmp(a, "--api-key")) {
            if (add_key(o, v, "--api-key"))
                return 2;
        } else if (!strcmp(a, "--api-key-file"))
            o->key_file = v;
        else if (!strcmp(a, "--log-level"))
            o->log_level = v;
        else
            return sh__cmd_fail("unknown option '%s' (see shoal serve --help)", a);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s: want %s", v, a,
                                *want ? want : "see shoal serve --help");
    }
    if (o->model && o->config)
        return sh__cmd_fail("give -m MODEL or -c CLUSTER.lua, not both");
    return 0;
}

/* Takes the settings of a one-node cluster script; flags given on the command line win. */
static int apply_config(serve_opts *o, sh_cluster_config **cfg_out)
{
    sh_error e = {0};
    sh_cluster_config *c = NULL;
    if (sh_config_load_file(o->config, NULL, &c, &e))
        return sh__cmd_fail("%s", e.msg);
    *cfg_out = c;
    o->cfg = c;
    // A script whose stages sit on worker nodes: this process is the front (gateway, batcher,
    // kvmgr) and what is not built yet is refused by name (actors/cluster.h).
    if (sh_config_has_workers(c)) {
        int rc = sh__cmd_report(sh__cluster_check(c, o->config, &e), &e);
        if (rc)
            return rc;
        if (o->ctx || o->max_seqs || o->step_tokens || o->kv_mem || o->kv_blocks || o->kv_f16 ||
            o->kv_f32)
            return sh__cmd_fail("%s: with worker nodes the stage settings come from the script "
                                "(batcher, kv); drop --ctx, --max-seqs, --step-tokens, "
                                "--kv-mem, --kv-blocks, --kv-f16 and --kv-f32",
                                o->config);
        o->cluster = true;
    }
    const sh_config_model *m = &c->models[c->replicas[0].model];
    o->model = m->path;
    for (int32_t k = 1; k < c->n_replicas; k++)
        if (c->replicas[k].model != c->replicas[0].model && o->model_name)
            return sh__cmd_fail("%s: --model-name renames the one model served; this script "
                                "serves several (each by its model{ name = ... })",
                                o->config);
    if (!o->model_name)
        o->model_name = m->name;
    // gateway.http gives the host and the port; --host and --port each replace only their part.
    if (c->gateway.http && (!o->host || !o->port_set)) {
        const char *colon = strrchr(c->gateway.http, ':');
        int64_t port;
        if (!colon || !sh__cmd_parse_i64(colon + 1, 0, 65535, &port) ||
            (size_t)(colon - c->gateway.http) >= sizeof o->host_buf)
            return sh__cmd_fail("%s: gateway.http '%s' is not HOST:PORT", o->config,
                                c->gateway.http);
        if (!o->host) {
            memcpy(o->host_buf, c->gateway.http, (size_t)(colon - c->gateway.http));
            o->host_buf[colon - c->gateway.http] = '\0';
            if (o->host_buf[0] == '[') { /* [::1]:8080 */
                size_t l = strlen(o->host_buf);
                memmove(o->host_buf, o->host_buf + 1, l);
                if (l >= 2 && o->host_buf[l - 2] == ']')
                    o->host_buf[l - 2] = '\0';
            }
            o->host = o->host_buf;
        }
        if (!o->port_set)
            o->port = (int)port;
    }
    for (int32_t i = 0; i < c->gateway.n_api_keys; i++)
        if (add_key(o, c->gateway.api_keys[i], "gateway.api_keys in the cluster script"))
            return 2;
    if (!o->step_tokens)
        o->step_tokens = c->batcher.max_step_tokens;
    if (!o->max_seqs)
        o->max_seqs = c->batcher.max_seqs;
    if (!o->max_wait_ms)
        o->max_wait_ms = c->batcher.max_wait_ms;
    if (!c->kv.prefix_cache)
        o->no_prefix_cache = true;
    if (!o->kv_mem && c->kv.memory_bytes)
        o->kv_mem = c->kv.memory_bytes;
    if (c->kv.block_tokens && c->kv.block_tokens != SH_KV_DEFAULT_BLOCK_TOKENS)
        return sh__cmd_fail("%s: kv.block_tokens must be %d (the attention kernels' block)",
                            o->config, SH_KV_DEFAULT_BLOCK_TOKENS);
    return 0;
}

static void progress(float done, void *arg)
{
    (void)arg;
    int w = 40, k = (int)(done * (float)w + 0.5f);
    fprintf(stderr, "\rloading [%.*s%*s] %3d%%", k, "########################################",
            w - k, "", (int)(done * 100.0f + 0.5f));
    if (done >= 1.0f)
        fprintf(stderr, "\r%*s\r", w + 20, "");
    fflush(stderr);
}

/* Everything a serving process holds; freed by close_all. */
typedef struct server {
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
    sh_llama_ctx *ctx;
    sh_runtime *rt;
    sh_gateway_ctl *ctl;          /* drain and key reloads from the signal thread */
    sh_degrade *deg;              /* the degradation ladder (--policy), or NULL */
    sh_cluster_front *front;      /* -c with worker nodes */
    sh_replica_set *replicas;     /* the kvmgrs, batchers, routers (and stage) serving */
    sh_cmd_fault fault;           /* --fault-scenario on the front's links */
    sh_cluster_status_src status; /* GET /admin/cluster reads it on the gateway's thread */
    char name[256];
    char system[1024];
    /* -c with replicas of several models: each other model than m (the first replica's), by the
     * script's model index; hyper-parameters and tokenizer only, like m on a front. */
    sh_llama *xm[SH_CLUSTER_MAX_REPLICAS];
    sh_tokenizer *xtok[SH_CLUSTER_MAX_REPLICAS];
    char xsystem[SH_CLUSTER_MAX_REPLICAS][1024];
    sh_addr batcher[SH_CLUSTER_MAX_REPLICAS]; /* each replica's */
    /* The watchdog and, with worker nodes, the recovery from their loss (actors/supervisor.h). */
    sh_supervisor *sup;
    sh_cluster_events events; /* faults and recoveries, for /admin/status */
} server;

/* Before the transport closes: the supervisor's recovery step in flight (it uses the transport
 * and the runtime), then the fault layers. */
static void stop_faults(void *ud)
{
    server *s = ud;
    sh__supervisor_stop(s->sup);
    sh__cmd_fault_stop(&s->fault);
}

/* The runtime is gone: what the gateway and the watchdog's ladder used. */
static void free_serving(void *ud)
{
    server *s = ud;
    sh__supervisor_destroy(s->sup); /* stopped before the transport closed */
    s->sup = NULL;
    sh__gateway_ctl_destroy(s->ctl);
    sh__degrade_destroy(s->deg);
}

/* Everything, in the order of actors/replica.h. */
static void close_all(server *s)
{
    sh__replica_teardown(&(sh_replica_owned){.stop_faults = stop_faults,
                                             .faults_ud = s,
                                             .front = &s->front,
                                             .rt = &s->rt,
                                             .set = &s->replicas,
                                             .after_runtime = free_serving,
                                             .after_ud = s,
                                             .ctx = &s->ctx,
                                             .be = &s->be,
                                             .tok = &s->tok,
                                             .m = &s->m,
                                             .more_tok = s->xtok,
                                             .more_m = s->xm,
                                             .n_more = SH_CLUSTER_MAX_REPLICAS});
}

/* A cluster front's other models: every model a replica serves besides the first replica's
 * (s->m), loaded like it (hyper-parameters and tokenizer). Fills models and toks by the script's
 * model index. Returns 0 or 2 with an error line. */
static int load_models(const sh_cluster_config *c, server *s, const sh_llama **models,
                       const sh_tokenizer **toks)
{
    if (c->n_models > SH_CLUSTER_MAX_REPLICAS)
        return sh__cmd_fail("%d models; at most %d are supported", (int)c->n_models,
                            SH_CLUSTER_MAX_REPLICAS);
    int32_t m0 = c->replicas[0].model;
    models[m0] = s->m;
    toks[m0] = s->tok;
    for (int32_t k = 1; k < c->n_replicas; k++) {
        int32_t mi = c->replicas[k].model;
        if (models[mi])
            continue;
        const char *path = c->models[mi].path;
        sh_llama_load_opts lo = {.last = 1};
        sh_error e = {0};
        if (sh_llama_load(path, &lo, &s->xm[mi], &e))
            return sh__cmd_fail("%s", e.msg);
        if (!s->xm[mi]->gguf)
            return sh__cmd_fail("%s: shoal serve needs a GGUF model (its tokenizer is inside)",
                                path);
        if (sh_tokenizer_create_gguf(s->xm[mi]->gguf, &s->xtok[mi], &e))
            return sh__cmd_fail("%s: tokenizer: %s", path, e.msg);
        models[mi] = s->xm[mi];
        toks[mi] = s->xtok[mi];
    }
    return 0;
}

/* SIGHUP: re-reads --api-key-file and hands the whole key set to the gateway. Without a key
 * file there is nothing to reload and the signal is ignored. A bad file keeps the old keys. */
static void reload_keys(serve_opts *o, sh_gateway_ctl *ctl)
{
    if (!o->key_file) {
        fprintf(stderr, "shoal: SIGHUP: nothing to reload (no --api-key-file); ignored\n");
        return;
    }
    if (load_key_file(o)) {
        fprintf(stderr, "shoal: SIGHUP: --api-key-file %s not reloaded; the old keys stay\n",
                o->key_file);
        return;
    }
    sh_err rc = sh__gateway_ctl_set_keys(ctl, o->keys, o->n_keys);
    fprintf(stderr, "shoal: SIGHUP: %d API keys from %s%s\n", (int)(o->n_keys - o->n_fixed_keys),
            o->key_file, rc ? " NOT applied (out of memory)" : " applied");
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A cluster front that lost a worker node (`what` names it): one error line, then every open
 * request ends at once with an error (the gateway's fail-stop) and the process exits with
 * SH_CLUSTER_EXIT_LOST. The supervisor decided it (actors/supervisor.h): no standby took the
 * node's place, and it did not come back within --recover-timeout or none was given. */
static int stop_lost(server *s, const char *what)
{
    sh__cmd_fail("%s: this replica cannot continue; stopping", what);
    fflush(stderr);
    sh__gateway_ctl_fail(s->ctl, "a stage node of this replica was lost and the server is "
                                 "stopping; retry on another replica");
    uint64_t backstop = mono_ms() + 5000;
    while (!sh__gateway_ctl_drained(s->ctl) && mono_ms() < backstop) {
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
    return SH_CLUSTER_EXIT_LOST;
}

/* The graceful stop after SIGTERM/SIGINT `sig`: the gateway drains (see sh_gateway_ctl) until
 * every request is answered or --drain-timeout passes; a second SIGTERM/SIGINT stops at once.
 * Returns 0, or SH_CLUSTER_EXIT_LOST when a worker node is lost meanwhile. */
static int drain(serve_opts *o, server *s, const sigset_t *sigs, int sig)
{
    sh_gateway_ctl *ctl = s->ctl;
    char what[768];
    fprintf(stderr,
            "shoal: %s, draining (up to %.1f s for the requests in flight; signal again "
            "to stop now)\n",
            sig == SIGINT ? "interrupted" : "terminated", o->drain_timeout_ms / 1000.0);
    fflush(stderr);
    sh__gateway_ctl_drain(ctl);
    // The gateway enforces the deadline; this is the backstop should it not report.
    uint64_t backstop = mono_ms() + o->drain_timeout_ms + 10000;
    while (!sh__gateway_ctl_drained(ctl)) {
        struct timespec ts = {0, 20 * 1000000};
        int got = sigtimedwait(sigs, NULL, &ts);
        if (got == SIGHUP) {
            if (o->key_file || !s->deg)
                reload_keys(o, ctl);
            sh__serve_degrade_reload(s->deg);
        } else if (got == SIGINT || got == SIGTERM) {
            fprintf(stderr, "shoal: second signal, stopping now\n");
            return 0;
        } else if (!sh__gateway_ctl_drained(ctl) &&
                   sh__supervisor_failed(s->sup, what, sizeof what)) {
            return stop_lost(s, what);
        } else if (mono_ms() > backstop) {
            fprintf(stderr, "shoal: the gateway did not finish draining; stopping\n");
            return 0;
        }
    }
    fprintf(stderr, "shoal: drained, shutting down\n");
    return 0;
}

/* Serves until SIGTERM/SIGINT (SIGHUP reloads the keys), then drains. A cluster front also asks
 * its supervisor every 20 ms whether it must stop (a worker node lost for good) and then stops at
 * once. Returns run's status: 0, or SH_CLUSTER_EXIT_LOST. */
static int serve_until_stopped(serve_opts *o, server *s, const sigset_t *sigs)
{
    char what[768];
    for (;;) {
        struct timespec ts = {0, 20 * 1000000};
        int got = sigtimedwait(sigs, NULL, s->front ? &ts : NULL);
        if (got == SIGHUP) {
            if (o->key_file || !s->deg)
                reload_keys(o, s->ctl);
            sh__serve_degrade_reload(s->deg);
        } else if (got == SIGINT || got == SIGTERM)
            return drain(o, s, sigs, got);
        else if (sh__supervisor_failed(s->sup, what, sizeof what))
            return stop_lost(s, what);
    }
}

/* The degradation ladder's events ("level", "policy") into the ring. Any thread. */
static void degrade_note(void *user, const char *kind, const char *msg)
{
    server *s = user;
    sh__cluster_events_add(&s->events, kind, -1, -1, "%s", msg);
}

/* The policy's metrics from the watchdog's view: worker nodes judged dead, and the largest
 * resident memory a worker reported in its last heartbeat (MiB). On the watchdog's thread. */
static size_t degrade_extra(void *user, sh_policy_metric *out, size_t cap)
{
    server *s = user;
    int32_t dead = 0;
    uint64_t rss = 0;
    const sh_watchdog_view *v = sh__supervisor_view(s->sup);
    for (int32_t i = 0; i < v->n_nodes; i++) {
        const sh_watchdog_node *nd = &v->node[i];
        dead += atomic_load_explicit(&nd->health, memory_order_acquire) == SH_WATCHDOG_DEAD;
        uint64_t r = atomic_load_explicit(&nd->rss_bytes, memory_order_relaxed);
        rss = r > rss ? r : rss;
    }
    if (cap < 2)
        return 0;
    out[0] = (sh_policy_metric){"nodes_dead", dead};
    out[1] = (sh_policy_metric){"node_rss_max_mb", (double)rss / (1024.0 * 1024.0)};
    return 2;
}

/* The supervisor's lines to the operator, as "shoal: ..." or "error: ..." on stderr. */
static void sup_note(void *user, bool error, const char *line)
{
    (void)user;
    if (error)
        sh__cmd_fail("%s", line);
    else
        fprintf(stderr, "shoal: %s\n", line);
    fflush(stderr);
}

/* The degradation ladder's tick (--policy), every heartbeat_ms on the watchdog's loop: s->deg is
 * set before the watchdog starts. */
static void degrade_tick(void *user, uint64_t now_ms)
{
    server *s = user;
    if (s->deg)
        sh__degrade_tick_cb(s->deg, now_ms);
}

/* Creates the supervisor (the watchdog's view is read by the status page and the policy from
 * now on). With worker nodes it recovers from their loss (actors/supervisor.h); in every mode its
 * watchdog ticks the degradation ladder. Returns 0, or 1 after an error line. */
static int create_supervisor(serve_opts *o, server *s)
{
    sh_error e = {0};
    sh_supervisor_args a = {.front = s->front,
                            .batchers = s->batcher,
                            .recover_ms = o->recover_ms,
                            .events = &s->events,
                            .note = sup_note,
                            .tick = degrade_tick,
                            .tick_user = s};
    if (sh__supervisor_create(&a, &s->sup, &e))
        return (sh__cmd_fail("%s", e.msg), 1);
    return 0;
}

static int run(serve_opts *o, server *s, const sigset_t *sigs)
{
    sh_error e = {0};
    if (o->cluster && !o->recover_set)
        o->recover_ms = 30000; /* a lost worker is awaited, not fatal */
    if (o->fault_path && !o->cluster)
        return sh__cmd_fail("--fault-scenario needs -c with worker nodes: it acts on the links "
                            "between nodes");
    struct stat sb;
    if (stat(o->model, &sb) != 0)
        return sh__cmd_fail("%s: %s%s", o->model, strerror(errno),
                            strcmp(o->model, DEFAULT_MODEL) ? ""
                                                            : " (scripts/get-model.sh fetches it)");
    // The front of a cluster maps only what it reads: hyper-parameters and the tokenizer.
    sh_llama_load_opts lo = {.prefault = !o->cluster, .last = o->cluster ? 1 : 0};
    if (isatty(2) && sb.st_size > (64 << 20) && !o->cluster)
        lo.progress = progress;
    if (sh_llama_load(o->model, &lo, &s->m, &e))
        return sh__cmd_fail("%s", e.msg);
    if (!s->m->gguf)
        return sh__cmd_fail("%s: shoal serve needs a GGUF model (its tokenizer is inside)",
                            o->model);
    if (sh_tokenizer_create_gguf(s->m->gguf, &s->tok, &e))
        return sh__cmd_fail("%s: tokenizer: %s", o->model, e.msg);
    const sh_llama_hparams *hp = &s->m->hp;
    sh_serve_size_opts so = {.n_ctx = o->ctx,
                             .max_seqs = o->max_seqs,
                             .step_tokens = o->step_tokens,
                             .kv_blocks = o->kv_blocks,
                             .kv_mem = o->kv_mem,
                             .kv_f32 = o->kv_f32};
    sh_serve_size sz;
    if (sh__serve_size(hp, &so, &sz, &e))
        return sh__cmd_fail("%s", e.msg);
    int32_t n_ctx = sz.n_ctx, max_seqs = sz.max_seqs, step_tokens = sz.step_tokens;
    uint64_t bytes_per_block = sz.bytes_per_block;
    int64_t n_blocks = sz.n_blocks;
    sh_runtime_opts ro = {
        .node_id = 1, .name = "serve", .n_loops = 2, .log_level = sh__cmd_log_level(o->log_level)};
    const sh_cluster_plan *plan = NULL;
    const sh_llama *models[SH_CLUSTER_MAX_REPLICAS] = {NULL};
    const sh_tokenizer *toks[SH_CLUSTER_MAX_REPLICAS] = {NULL};
    if (o->cluster) {
        // The front: the stages run on worker nodes; join them before anything is served.
        ro.node_id = (uint32_t)o->cfg->gateway.node + 1;
        ro.n_loops = 3; /* the third for the watchdog alone */
        ro.name = o->cfg->nodes[o->cfg->gateway.node].name;
        if (sh_runtime_create(&ro, &s->rt, &e) || sh__serve_register(s->rt, &e))
            return (sh__cmd_fail("runtime: %s", e.msg), 1);
        if (!(s->front = calloc(1, sizeof *s->front)))
            return (sh__cmd_fail("out of memory"), 1);
        int rc = load_models(o->cfg, s, models, toks);
        if (!rc)
            rc = sh__cmd_report(
                sh__cluster_key_load(o->cluster_key_file, o->cfg, &s->front->key, &e), &e);
        for (int32_t i = 0; !rc && s->front->key.set && i < o->cfg->n_nodes; i++)
            if (o->cfg->nodes[i].standby)
                rc = sh__cmd_fail("%s: node '%s' is a standby: standby nodes do not work with a "
                                  "cluster key yet (docs/cluster.md, \"Standby nodes\")",
                                  o->config, o->cfg->nodes[i].name);
        if (!rc) {
            s->front->note = sh__cmd_note;
            rc = sh__cmd_report(sh__cluster_front_start(s->front, o->cfg, o->config, models, s->rt,
                                                        o->join_timeout_ms, &e),
                                &e);
        }
        if (!rc && o->fault_path)
            rc = sh__cmd_fault_start_epoch(&s->fault, o->fault_path, o->fault_epoch, o->cfg, s->rt,
                                           s->front->tp);
        if (rc)
            return rc;
        plan = &s->front->plan;
        n_ctx = plan->rep[0].n_ctx;
        max_seqs = plan->max_seqs;
        step_tokens = plan->step_tokens;
        n_blocks = plan->rep[0].n_blocks;
    } else {
        sh_backend_cpu_opts bo = {.n_threads = o->threads};
        if (sh_backend_cpu_create(&bo, &s->be, &e))
            return (sh__cmd_fail("backend: %s", e.msg), 1);
        char kern[160];
        sh_backend_cpu_describe(s->be, kern, sizeof kern);
        fprintf(stderr, "shoal: cpu: %s\n", kern);
        sh_llama_ctx_opts co = {.max_tokens = step_tokens,
                                .max_seqs = max_seqs,
                                .max_logits = max_seqs,
                                .kv_tokens = (int32_t)(n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS),
                                .kv_type = o->kv_f32 ? SH_DTYPE_F32 : SH_DTYPE_F16};
        if (sh_llama_ctx_create(s->m, s->be, &co, &s->ctx, &e))
            return (sh__cmd_fail("%s", e.msg), 1);
        n_blocks = sh_llama_ctx_n_blocks(s->ctx);
        if (sh_runtime_create(&ro, &s->rt, &e) || sh__serve_register(s->rt, &e))
            return (sh__cmd_fail("runtime: %s", e.msg), 1);
    }

    // Chat template and its default system prompt.
    bool has_sys = false;
    sh_chat_template chat = sh__serve_model_chat(s->m, s->system, sizeof s->system, &has_sys);
    if (o->model_name)
        snprintf(s->name, sizeof s->name, "%s", o->model_name);
    else
        sh__serve_base_name(o->model, s->name, sizeof s->name);

    // One kvmgr and one batcher per replica (in one process, with its stage), a router before
    // the replicas of each model that has several (actors/replica.h).
    sh_replica_opts rep = {.front = s->front,
                           .models = models,
                           .toks = toks,
                           .model = s->m,
                           .ctx = s->ctx,
                           .tok = s->tok,
                           .n_ctx = n_ctx,
                           .max_seqs = max_seqs,
                           .step_tokens = step_tokens,
                           .n_blocks = n_blocks,
                           .max_wait_ms = o->max_wait_ms,
                           .max_queue = o->max_queue,
                           .no_prefix_cache = o->no_prefix_cache,
                           .step_timeout_ms = !o->step_timeout_set ? 0 /* the default */
                                              : o->step_timeout_ms ? o->step_timeout_ms
                                                                   : SH_REPLICA_STEP_TIMEOUT_NONE,
                           .router_refresh_ms = o->router_refresh_ms,
                           .redispatch_ms = o->redispatch_ms,
                           .affinity_slack = o->affinity_slack,
                           .loop = 1};
    if (sh__replica_start(s->rt, &rep, &s->replicas, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    // The models served ("slots", in the order their first replica comes in the script).
    const sh_replica_set *rs = s->replicas;
    int32_t n_rep = rs->n_replicas, n_slots = rs->n_models;
    const int32_t *slot_model = rs->model, *slot_n = rs->n_of;
    const sh_addr *target = rs->target; /* each model's router, or its only replica's batcher */
    for (int32_t k = 0; k < n_rep; k++)
        s->batcher[k] = rs->batcher[k];
    if (create_supervisor(o, s))
        return 1;
    /* A policy that cannot start is bad input: exit 2, as the help says. */
    int prc = sh__serve_degrade_create(&o->deg, o->cfg, s->rt, degrade_note, s, degrade_extra, s,
                                       &s->deg);
    if (prc)
        return prc;
    if (sh__supervisor_start(s->sup, s->rt, plan ? 2 : 0, &e))
        return (sh__cmd_fail("watchdog: %s", e.msg), 1);
    sh_addr batcher_addr = target[0], gw_addr;
    int bound = 0;
    sh_gateway_args ga = {.batcher = batcher_addr,
                          .tok = s->tok,
                          .chat = chat,
                          .default_system = has_sys ? s->system : NULL,
                          .model_name = s->name,
                          .n_vocab = hp->n_vocab,
                          .n_ctx = n_ctx,
                          .host = o->host,
                          .port = o->port,
                          .max_body_bytes = o->max_body,
                          .max_conns = o->max_conns,
                          .header_timeout_ms = o->header_timeout_ms,
                          .request_timeout_ms = o->request_timeout_ms,
                          .max_tokens = o->max_tokens,
                          .max_n = o->max_n,
                          .keys = o->keys,
                          .n_keys = o->n_keys,
                          .bound_port = &bound,
                          .idle_timeout_ms = o->idle_timeout_ms,
                          .max_conns_per_ip = o->max_conns_per_ip,
                          .metrics_public = o->metrics_public,
                          .drain_timeout_ms = o->drain_timeout_ms};
    // Several models: the gateway picks one by each request's "model".
    sh_gateway_model gms[SH_CLUSTER_MAX_REPLICAS];
    if (n_slots > 1) {
        for (int32_t j = 0; j < n_slots; j++) {
            int32_t mi = slot_model[j];
            const sh_llama *mm = models[mi];
            bool sys = false;
            char *buf = j == 0 ? s->system : s->xsystem[mi];
            sh_chat_template ch = sh__serve_model_chat(mm, buf, sizeof s->system, &sys);
            gms[j] = (sh_gateway_model){.name = j == 0 ? s->name : o->cfg->models[mi].name,
                                        .batcher = target[j],
                                        .tok = toks[mi],
                                        .chat = ch,
                                        .default_system = sys ? buf : NULL,
                                        .n_vocab = mm->hp.n_vocab,
                                        .n_ctx = plan->rep[rs->ids[j][0]].n_ctx};
        }
        ga.models = gms;
        ga.n_models = n_slots;
    }
    if (sh__gateway_ctl_create(&s->ctl))
        return (sh__cmd_fail("out of memory"), 1);
    ga.ctl = s->ctl;
    s->status = (sh_cluster_status_src){.front = s->front,
                                        .rt = s->rt,
                                        .node = ro.name,
                                        .model = s->name,
                                        .n_layers = hp->n_layers,
                                        .events = &s->events,
                                        .watch = sh__supervisor_view(s->sup)};
    if (o->cfg && !o->cluster)
        s->status.node = o->cfg->nodes[o->cfg->gateway.node].name;
    ga.cluster_json = sh__cluster_status_json;
    ga.status_json = sh__cluster_status_full_json; /* and the status page, GET /admin/ */
    ga.cluster_user = &s->status;
    if (s->front && s->front->metrics) { /* every worker's series on /metrics */
        ga.metrics_render = sh__node_metrics_render;
        ga.metrics_user = s->front->metrics;
    }
    if (sh__serve_degrade_check(s->deg, &ga))
        return 1;
    ga.degrade = s->deg;
    if (sh_actor_spawn(s->rt, "gateway", &ga, 0, &gw_addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    // The gateway's init reports the bound port (or -1); the args stay on this stack until run
    // returns, after the runtime is gone.
    for (int i = 0; i < 30000 && __atomic_load_n(&bound, __ATOMIC_ACQUIRE) == 0; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    int port = __atomic_load_n(&bound, __ATOMIC_ACQUIRE);
    if (port <= 0)
        return (sh__cmd_fail("cannot listen on %s:%d (see the log above)",
                             o->host ? o->host : "127.0.0.1", o->port),
                1);
    const char *host = o->host ? o->host : "127.0.0.1";
    bool v6 = strchr(host, ':') != NULL;
    fprintf(stderr,
            "shoal: model %s (%d layers, context %d), KV %" PRId64 " blocks = %" PRId64
            " tokens (%s%.0f MiB %s), prefix cache %s, %d sequences x %d tokens per step\n",
            s->name, (int)hp->n_layers, (int)n_ctx, n_blocks, n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS,
            plan ? "at most " : "",
            (double)((uint64_t)n_blocks * (plan ? plan->rep[0].block_bytes : bytes_per_block)) /
                (1024.0 * 1024.0),
            plan        ? "f16 per stage"
            : o->kv_f32 ? "f32"
                        : "f16",
            o->no_prefix_cache ? "off" : "on", (int)max_seqs, (int)step_tokens);
    for (int32_t j = 1; j < n_slots; j++) {
        const sh_cluster_replica_plan *rp = &plan->rep[rs->ids[j][0]];
        fprintf(stderr, "shoal: model %s (%d layers, context %d), %d replica%s\n",
                o->cfg->models[slot_model[j]].name, (int)rp->n_layers, (int)rp->n_ctx,
                (int)slot_n[j], slot_n[j] == 1 ? "" : "s");
    }
    fprintf(stderr, "shoal: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "",
            port, o->n_keys ? " (API keys required)" : "");
    fflush(stderr);
    return serve_until_stopped(o, s, sigs);
}

int sh__cmd_serve(int argc, char **argv)
{
    serve_opts o;
    memset(&o, 0, sizeof o);
    sh_cluster_config *cfg = NULL;
    int rc = parse(argc, argv, &o);
    bool help = rc == 1;
    if (rc == 0 && o.config)
        rc = apply_config(&o, &cfg);
    if (rc == 0)
        rc = add_env_keys(&o);
    o.n_fixed_keys = o.n_keys;
    if (rc == 0 && o.key_file)
        rc = load_key_file(&o);
    if (rc == 0) {
        if (!o.model)
            o.model = DEFAULT_MODEL;
        // Signals are taken by sigwait on this thread: block them before any thread starts.
        sigset_t sigs;
        sh__cmd_block_signals(&sigs, 0);
        server s;
        memset(&s, 0, sizeof s);
        sh__cluster_events_init(&s.events);
        rc = run(&o, &s, &sigs);
        close_all(&s);
        sh__cluster_events_fini(&s.events);
    }
    for (int32_t i = 0; i < o.n_keys; i++)
        free(o.key_mem[i]);
    sh_config_destroy(cfg);
    return help ? 0 : rc;
}
