/* `shoal serve`'s command line (tools/serve_opts.h): the flags, the script's settings they meet,
 * and the API keys. */
#include "tools/serve_opts.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "actors/cluster_key.h"
#include "actors/replica.h"
#include "base/error.h"
#include "base/file.h"
#include "tools/cmd_fault.h"
#include "tools/cmd_util.h"
#include "tools/node_identity.h"

#define MAX_KEY_FILE (1 << 20)
#define KEY_ENV "SHOAL_API_KEY"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal serve [-m MODEL | -c CLUSTER.lua] [--host H] [--port P] [options]\n\n"
            "Serves a model over an OpenAI-compatible HTTP API (POST /v1/completions,\n"
            "POST /v1/chat/completions, POST /v1/responses, POST /v1/embeddings, GET\n"
            "/v1/models, /health, /metrics) with continuous\n"
            "batching and a paged KV cache, on the CPU. GET /admin/cluster describes its\n"
            "nodes, stages and load (`shoal cluster status` prints it).\n\n"
            "  -m MODEL            GGUF model (default " SH_SERVE_DEFAULT_MODEL ")\n"
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
            "  --spec ngram|draft:PATH|self:LAYERS|off\n"
            "                      speculative decoding (default off): ngram drafts tokens\n"
            "                      from each request's prompt and output (and the other\n"
            "                      requests'); draft:PATH, a smaller model with the same\n"
            "                      vocabulary, drafts greedily; so do self:LAYERS, the model's\n"
            "                      first LAYERS layers and its head (these two in one process\n"
            "                      only); drafts are verified in the same step; a request\n"
            "                      opts out with \"speculative\": false\n"
            "  --spec-k N          with --spec: most drafted tokens per step, 1 to 16\n"
            "                      (default 8; each sequence adapts its own)\n"
            "  --max-seqs N        sequences per step (default 64)\n"
            "  --step-tokens N     token budget per step (default 4096)\n"
            "  --max-wait-ms N     wait to form a batch when idle (default 50)\n"
            "  --max-queue N       requests waiting beyond those running before 429\n"
            "                      (per replica; default 1024)\n"
            "  --max-tokens N      largest max_tokens a request may ask for (default: --ctx)\n"
            "  --max-n N           largest n (choices per request; default 8)\n"
            "  --temp T, --top-k K, --top-p P, --min-p P, --typical P, --repeat-penalty R,\n"
            "  --repeat-last-n N, --presence-penalty P, --frequency-penalty F\n"
            "                      what a request that leaves the field out gets (a request's\n"
            "                      own value wins); without a flag the model file's\n"
            "                      general.sampling.* value, else temperature 0.8, top_k 40,\n"
            "                      top_p 0.95, min_p 0.05 (llama-server's), the rest off\n"
            "                      (repeat_last_n 64; -1: the whole context)\n"
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
            "  --cors-origin O     let web pages of origin O (https://host[:port]; repeatable;\n"
            "                      * for any) call the API: preflights answered before the\n"
            "                      keys, Access-Control-Allow-Origin on responses (default: off)\n"
            "  --fault-scenario F  with -c: apply fault scenario F to the links leaving the\n"
            "                      front, times counted from the end of the join (testing)\n"
            "  --fault-epoch E     with --fault-scenario: its times from E (UNIX_MS, or @FILE\n"
            "                      holding it; waits for the file; docs/chaos.md)\n"
            "  --join-timeout S    with -c and worker nodes: how long to wait for every\n"
            "                      worker to join (default 60; see docs/cluster.md)\n"
            "  --name-from VAR     with -c: check that environment variable VAR (else\n"
            "                      SHOAL_NODE, when set) names the gateway's node, as for\n"
            "                      `shoal node --name-from` (docs/deploy.md)\n"
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
    fprintf(f, SH_CMD_CONTROL_NICE_HELP);
    fprintf(f, "  --log-level L       error, warn, info, debug (default info)\n\n"
               "Prints `listening on http://HOST:PORT` on stderr when ready. SIGINT or SIGTERM\n"
               "drains and stops it (see --drain-timeout); SIGHUP re-reads --api-key-file and\n"
               "the --policy script. With NOTIFY_SOCKET set (systemd), notifies READY=1 when\n"
               "listening, WATCHDOG=1 and STOPPING=1 (docs/deploy.md).\n"
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
static int add_key(sh_serve_opts *o, const char *v, const char *what)
{
    if (o->n_keys == SH_SERVE_MAX_KEYS)
        return sh__cmd_fail("%s: at most %d API keys", what, SH_SERVE_MAX_KEYS);
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
static int add_env_keys(sh_serve_opts *o)
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
int sh__serve_opts_load_key_file(sh_serve_opts *o)
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
    sh_openai_key old_keys[SH_SERVE_MAX_KEYS];
    char *old_mem[SH_SERVE_MAX_KEYS];
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

/* Parses a number for a sampling flag in [lo, hi]; on failure *want says what was expected. */
static bool samp_f32(const char *v, double lo, double hi, float *out, char *want, size_t cap)
{
    snprintf(want, cap, "a number from %g to %g", lo, hi);
    return sh__cmd_parse_f32(v, (float)lo, (float)hi, out);
}

void sh__serve_opts_sampling(const sh_serve_opts *o, const sh_llama *m, sh_openai_sampling *out,
                             bool log)
{
    sh_openai_sampling d = sh_openai_sampling_builtin();
    uint32_t file = sh__cmd_model_sampling(m, &d.temperature, &d.top_k, &d.top_p, &d.min_p,
                                           &d.repeat_penalty, &d.repeat_last_n);
    uint32_t f = o->samp_set;
    const sh_openai_sampling *g = &o->samp;
    if (f & SH_SERVE_SAMP_TEMP)
        d.temperature = g->temperature;
    if (f & SH_SERVE_SAMP_TOP_K)
        d.top_k = g->top_k;
    if (f & SH_SERVE_SAMP_TOP_P)
        d.top_p = g->top_p;
    if (f & SH_SERVE_SAMP_MIN_P)
        d.min_p = g->min_p;
    if (f & SH_SERVE_SAMP_TYPICAL)
        d.typical_p = g->typical_p;
    if (f & SH_SERVE_SAMP_REPEAT)
        d.repeat_penalty = g->repeat_penalty;
    if (f & SH_SERVE_SAMP_LAST_N)
        d.repeat_last_n = g->repeat_last_n;
    if (f & SH_SERVE_SAMP_PRESENCE)
        d.presence_penalty = g->presence_penalty;
    if (f & SH_SERVE_SAMP_FREQUENCY)
        d.frequency_penalty = g->frequency_penalty;
    *out = d;
    if (!log)
        return;
#define SRC(bit) ((f & (bit)) ? "flag" : (file & (bit)) ? "model file" : "built-in")
    fprintf(stderr,
            "shoal: sampling defaults (for fields a request leaves out): temperature %g (%s), "
            "top_k %d (%s), top_p %g (%s), min_p %g (%s), typical_p %g "
            "(%s), repeat_penalty %g (%s), repeat_last_n %d (%s), presence_penalty %g (%s), "
            "frequency_penalty %g (%s)\n",
            (double)d.temperature, SRC(SH_SERVE_SAMP_TEMP), (int)d.top_k, SRC(SH_SERVE_SAMP_TOP_K),
            (double)d.top_p, SRC(SH_SERVE_SAMP_TOP_P), (double)d.min_p, SRC(SH_SERVE_SAMP_MIN_P),
            (double)d.typical_p, SRC(SH_SERVE_SAMP_TYPICAL), (double)d.repeat_penalty,
            SRC(SH_SERVE_SAMP_REPEAT), (int)d.repeat_last_n, SRC(SH_SERVE_SAMP_LAST_N),
            (double)d.presence_penalty, SRC(SH_SERVE_SAMP_PRESENCE), (double)d.frequency_penalty,
            SRC(SH_SERVE_SAMP_FREQUENCY));
#undef SRC
}

/* The options that take a value, each between spaces. */
#define VALUE_FLAGS                                                                                \
    " -m -c --host --port -t --model-name --ctx --kv-mem --kv-blocks --max-seqs --step-tokens "    \
    "--max-wait-ms --max-queue --max-tokens --max-n --max-body --max-conns --header-timeout-ms "   \
    "--request-timeout --api-key --log-level --idle-timeout-ms --max-conns-per-ip "                \
    "--drain-timeout --api-key-file --join-timeout --step-timeout --router-refresh "               \
    "--redispatch-after --affinity-slack --cluster-key-file --recover-timeout --fault-scenario "   \
    "--fault-epoch --control-nice --spec --spec-k --temp --top-k --top-p --min-p --typical "       \
    "--repeat-penalty --repeat-last-n --presence-penalty --frequency-penalty --cors-origin "       \
    "--name-from "

/* --spec and --spec-k. --spec-k alone waits for the script's batcher.spec (checked in
 * sh__serve_opts_finish); a draft model or layers are checked against the model at load
 * (tools/cmd_serve.c), and refused with worker nodes in sh__serve_opts_finish. Returns 0 or 2
 * (printed). */
static int parse_spec(sh_serve_opts *o)
{
    sh_error e = {0};
    if (!o->spec_text && !o->spec_k_text)
        return 0;
    if (sh_spec_parse(o->spec_text ? o->spec_text : "off", o->spec_k_text, &o->spec, &e))
        return sh__cmd_fail("%s", e.msg);
    if (o->spec.kind == SH_SPEC_OFF && o->spec_k_text && !o->config)
        return sh__cmd_fail("--spec-k needs --spec ngram, draft:PATH or self:LAYERS");
    return 0;
}

/* --cors-origin: "*" or scheme://host[:port] with nothing after it (a browser's Origin header).
 * Returns 0 or 2 (printed). */
static int add_cors(sh_serve_opts *o, const char *v)
{
    const char *host = !strncmp(v, "http://", 7)    ? v + 7
                       : !strncmp(v, "https://", 8) ? v + 8
                                                    : NULL;
    bool ok = !strcmp(v, "*") || (host && *host && strlen(v) < 256);
    for (const char *p = host; ok && p && *p; p++)
        ok = *p > ' ' && *p < 127 && *p != '/' && *p != ',' && *p != '"';
    if (!ok)
        return sh__cmd_fail("--cors-origin %.200s: want an origin such as https://example.com or "
                            "http://localhost:3000 (scheme, host and port only), or *",
                            v);
    if (o->n_cors == SH_SERVE_MAX_CORS)
        return sh__cmd_fail("--cors-origin: at most %d", SH_SERVE_MAX_CORS);
    o->cors[o->n_cors++] = v;
    return 0;
}

/* Returns 0 to go on, 1 after --help, 2 on bad usage (message printed). */
int sh__serve_opts_parse(int argc, char **argv, sh_serve_opts *o)
{
    o->port = 8080;
    o->max_body = 2u << 20; /* with max_conns 1024: at most 2 GiB of bodies in flight */
    o->drain_timeout_ms = 30000;
    o->join_timeout_ms = SH_REPLICA_JOIN_TIMEOUT_MS;
    o->max_queue = 1024;  /* requests waiting per replica beyond those running (actors/replica.h) */
    o->control_nice = -1; /* not given: sh__cmd_prio_apply's default */
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
        else if (!strcmp(a, "--temp"))
            ok = samp_f32(v, 0, 2, &o->samp.temperature, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_TEMP);
        else if (!strcmp(a, "--top-k"))
            ok = num(v, 0, INT32_MAX, &n, want, sizeof want) &&
                 ((o->samp.top_k = (int32_t)n), (o->samp_set |= SH_SERVE_SAMP_TOP_K));
        else if (!strcmp(a, "--top-p"))
            ok = samp_f32(v, 0, 1, &o->samp.top_p, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_TOP_P);
        else if (!strcmp(a, "--min-p"))
            ok = samp_f32(v, 0, 1, &o->samp.min_p, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_MIN_P);
        else if (!strcmp(a, "--typical"))
            ok = samp_f32(v, 0.001, 1, &o->samp.typical_p, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_TYPICAL);
        else if (!strcmp(a, "--repeat-penalty"))
            ok = samp_f32(v, 0.01, 100, &o->samp.repeat_penalty, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_REPEAT);
        else if (!strcmp(a, "--repeat-last-n"))
            ok = num(v, -1, 1 << 20, &n, want, sizeof want) &&
                 ((o->samp.repeat_last_n = (int32_t)n), (o->samp_set |= SH_SERVE_SAMP_LAST_N));
        else if (!strcmp(a, "--presence-penalty"))
            ok = samp_f32(v, -2, 2, &o->samp.presence_penalty, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_PRESENCE);
        else if (!strcmp(a, "--frequency-penalty"))
            ok = samp_f32(v, -2, 2, &o->samp.frequency_penalty, want, sizeof want) &&
                 (o->samp_set |= SH_SERVE_SAMP_FREQUENCY);
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
        } else if (!strcmp(a, "--name-from")) {
            o->name_from = v;
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
        } else if (!strcmp(a, "--control-nice")) {
            ok = num(v, 0, 19, &n, want, sizeof want) && ((o->control_nice = (int32_t)n), true);
        } else if (!strcmp(a, "--affinity-slack")) {
            double d = 0;
            snprintf(want, sizeof want, "load units from 1 to 1e9");
            ok = sh__cmd_parse_f64(v, 1, 1e9, &d) && ((o->affinity_slack = d), true);
        } else if (!strcmp(a, "--cors-origin")) {
            if (add_cors(o, v))
                return 2;
        } else if (!strcmp(a, "--api-key")) {
            if (add_key(o, v, "--api-key"))
                return 2;
        } else if (!strcmp(a, "--api-key-file"))
            o->key_file = v;
        else if (!strcmp(a, "--log-level"))
            o->log_level = v;
        else if (!strcmp(a, "--spec"))
            o->spec_text = v;
        else if (!strcmp(a, "--spec-k"))
            o->spec_k_text = v;
        else
            return sh__cmd_fail("unknown option '%s' (see shoal serve --help)", a);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s: want %s", v, a,
                                *want ? want : "see shoal serve --help");
    }
    if (o->model && o->config)
        return sh__cmd_fail("give -m MODEL or -c CLUSTER.lua, not both");
    return parse_spec(o);
}

/* Takes the settings of a one-node cluster script; flags given on the command line win. */
static int apply_config(sh_serve_opts *o, sh_cluster_config **cfg_out)
{
    sh_error e = {0};
    sh_cluster_config *c = NULL;
    if (sh_config_load_file(o->config, NULL, &c, &e))
        return sh__cmd_fail("%s", e.msg);
    *cfg_out = c;
    o->cfg = c;
    const char *self = NULL; /* --name-from or SHOAL_NODE must name the gateway's node */
    if (sh__node_identity_check(NULL, o->name_from, false, "shoal serve") ||
        sh__node_identity_resolve(c, o->config, NULL, o->name_from, true, &self))
        return 2;
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
    if (!o->spec_text) { /* batcher.spec and spec_k; --spec-k given wins over spec_k */
        o->spec.kind = (sh_spec_kind)c->batcher.spec;
        if (!o->spec_k_text)
            o->spec.k = c->batcher.spec_k;
    }
    if (o->spec.kind == SH_SPEC_OFF && o->spec_k_text)
        return sh__cmd_fail("--spec-k needs --spec ngram (or batcher.spec = \"ngram\" in %s)",
                            o->config);
    if (!o->kv_mem && c->kv.memory_bytes)
        o->kv_mem = c->kv.memory_bytes;
    if (!o->cluster && !o->kv_f16 && !o->kv_f32 && c->kv.f32)
        o->kv_f32 = true; /* kv.type; --kv-f16 or --kv-f32 given wins */
    if (c->kv.block_tokens && c->kv.block_tokens != SH_KV_DEFAULT_BLOCK_TOKENS)
        return sh__cmd_fail("%s: kv.block_tokens must be %d (the attention kernels' block)",
                            o->config, SH_KV_DEFAULT_BLOCK_TOKENS);
    return 0;
}

int sh__serve_opts_finish(sh_serve_opts *o, sh_cluster_config **cfg)
{
    if (o->name_from && !o->config)
        return sh__cmd_fail("--name-from needs -c CLUSTER.lua: it names a node of the script");
    int rc = o->config ? apply_config(o, cfg) : 0;
    if (rc == 0 && o->cluster && (o->spec.kind == SH_SPEC_DRAFT || o->spec.kind == SH_SPEC_SELF))
        rc = sh__cmd_fail("--spec %s: a draft model is served in one process only so far (not "
                          "with the worker nodes of %s)",
                          o->spec_text, o->config);
    if (rc == 0)
        rc = add_env_keys(o);
    o->n_fixed_keys = o->n_keys;
    if (rc == 0 && o->key_file)
        rc = sh__serve_opts_load_key_file(o);
    if (rc == 0 && !o->model)
        o->model = SH_SERVE_DEFAULT_MODEL;
    return rc;
}

void sh__serve_opts_free(sh_serve_opts *o)
{
    for (int32_t i = 0; i < o->n_keys; i++)
        free(o->key_mem[i]);
    o->n_keys = 0;
}

int sh__serve_opts_drafts(const sh_serve_opts *o, const sh_llama *m, const sh_tokenizer *tok,
                          sh_backend *be, int32_t n_ctx, int32_t max_seqs, int32_t step_tokens,
                          int64_t n_blocks, struct sh_spec_drafts **out)
{
    *out = NULL;
    if (o->spec.kind != SH_SPEC_DRAFT && o->spec.kind != SH_SPEC_SELF)
        return 0;
    sh_error e = {0};
    sh_err err = sh__serve_drafts_create(m, tok, be, &o->spec, n_ctx, max_seqs, step_tokens,
                                         n_blocks, o->kv_f32, out, &e);
    if (!err)
        return 0;
    return err == SH_ENOMEM ? (sh__cmd_fail("%s", e.msg), 1) : sh__cmd_fail("%s", e.msg);
}

void sh__serve_opts_log_spec(const sh_serve_opts *o)
{
    if (o->spec.kind != SH_SPEC_OFF)
        fprintf(stderr, "shoal: speculative decoding %s, up to %d drafted tokens per step\n",
                sh_spec_kind_name(o->spec.kind), (int)o->spec.k);
}

/* SIGHUP: re-reads --api-key-file and hands the whole key set to the gateway. Without a key
 * file there is nothing to reload and the signal is ignored. A bad file keeps the old keys. */
void sh__serve_opts_reload_keys(sh_serve_opts *o, sh_gateway_ctl *ctl)
{
    if (!o->key_file) {
        fprintf(stderr, "shoal: SIGHUP: nothing to reload (no --api-key-file); ignored\n");
        return;
    }
    if (sh__serve_opts_load_key_file(o)) {
        fprintf(stderr, "shoal: SIGHUP: --api-key-file %s not reloaded; the old keys stay\n",
                o->key_file);
        return;
    }
    sh_err rc = sh__gateway_ctl_set_keys(ctl, o->keys, o->n_keys);
    fprintf(stderr, "shoal: SIGHUP: %d API keys from %s%s\n", (int)(o->n_keys - o->n_fixed_keys),
            o->key_file, rc ? " NOT applied (out of memory)" : " applied");
}
