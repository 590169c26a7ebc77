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

#include "actors/serve.h"
#include "base/error.h"
#include "kernels/backend.h"
#include "lua/config.h"
#include "model/gguf.h"
#include "tools/cmd.h"
#include "tools/cmd_util.h"

#define DEFAULT_MODEL "models/smollm2-135m-instruct-q4_1.gguf"
#define DEFAULT_KV_MEM ((uint64_t)1 << 30)
#define MAX_KEYS 64

typedef struct serve_opts {
    const char *model, *config, *host, *model_name, *log_level;
    char host_buf[256];
    int port;
    int32_t threads, max_seqs, step_tokens, max_wait_ms, ctx, max_tokens, max_queue, max_n;
    int64_t kv_blocks;
    uint64_t kv_mem, max_body;
    uint32_t max_conns, header_timeout_ms, request_timeout_ms;
    bool no_prefix_cache, kv_f16;
    bool port_set; /* --port given: it wins over the port of the config's gateway.http */
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
            "batching and a paged KV cache, on the CPU.\n\n"
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
            "  --kv-f16            keep the KV cache in F16 (half the memory)\n"
            "  --no-prefix-cache   do not reuse the KV of shared prompt prefixes\n"
            "  --max-seqs N        sequences per step (default 64)\n"
            "  --step-tokens N     token budget per step (default 4096)\n"
            "  --max-wait-ms N     wait to form a batch when idle (default 50)\n"
            "  --max-queue N       requests queued before 429 (default 1024)\n"
            "  --max-tokens N      largest max_tokens a request may ask for (default: --ctx)\n"
            "  --max-n N           largest n (choices per request; default 8)\n"
            "  --max-body BYTES    largest request body (default 2M; a full 8k-token prompt\n"
            "                      as JSON is under 100K)\n"
            "  --max-conns N       open connections (default 1024)\n"
            "  --header-timeout-ms N  time a client has to send its headers (default 10000)\n"
            "  --request-timeout S  a request still generating after S seconds ends with\n"
            "                      finish_reason \"timeout\" (default: none)\n"
            "  --api-key KEY[:P]   require this bearer key (repeatable); P is its priority\n"
            "                      class (lower runs first; default 0)\n"
            "  --log-level L       error, warn, info, debug (default info)\n\n"
            "Prints `listening on http://HOST:PORT` on stderr when ready; SIGINT or SIGTERM\n"
            "stops it.\n");
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

static int add_key(serve_opts *o, const char *v)
{
    if (o->n_keys == MAX_KEYS)
        return sh__cmd_fail("at most %d API keys", MAX_KEYS);
    char *k = strdup(v);
    if (!k)
        return sh__cmd_fail("out of memory");
    int64_t prio = 0;
    char *colon = strrchr(k, ':');
    if (colon && sh__cmd_parse_i64(colon + 1, 0, 255, &prio))
        *colon = '\0';
    if (!*k) {
        free(k);
        return sh__cmd_fail("--api-key: empty key");
    }
    o->key_mem[o->n_keys] = k;
    o->keys[o->n_keys++] = (sh_openai_key){k, (int32_t)prio};
    return 0;
}

/* The options that take a value, each between spaces. */
#define VALUE_FLAGS                                                                                \
    " -m -c --host --port -t --model-name --ctx --kv-mem --kv-blocks --max-seqs --step-tokens "    \
    "--max-wait-ms --max-queue --max-tokens --max-n --max-body --max-conns --header-timeout-ms "   \
    "--request-timeout --api-key --log-level "

/* Returns 0 to go on, 1 after --help, 2 on bad usage (message printed). */
static int parse(int argc, char **argv, serve_opts *o)
{
    o->port = 8080;
    o->max_body = 2u << 20; /* with max_conns 1024: at most 2 GiB of bodies in flight */
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
        if (!strcmp(a, "--kv-f16")) {
            o->kv_f16 = true;
            continue;
        }
        if (!sh__cmd_is_flag(VALUE_FLAGS, a))
            return sh__cmd_fail("unknown option '%s' (see shoal serve --help)", a);
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value (see shoal serve --help)", a);
        const char *v = argv[++i];
        int64_t n = 0;
        bool ok = true;
        if (!strcmp(a, "-m"))
            o->model = v;
        else if (!strcmp(a, "-c"))
            o->config = v;
        else if (!strcmp(a, "--host"))
            o->host = v;
        else if (!strcmp(a, "--port"))
            ok = sh__cmd_parse_i64(v, 0, 65535, &n) && ((o->port = (int)n), (o->port_set = true));
        else if (!strcmp(a, "-t"))
            ok = sh__cmd_parse_i64(v, 1, 1024, &n) && ((o->threads = (int32_t)n), true);
        else if (!strcmp(a, "--model-name"))
            o->model_name = v;
        else if (!strcmp(a, "--ctx"))
            ok = sh__cmd_parse_i64(v, 16, 1 << 20, &n) && ((o->ctx = (int32_t)n), true);
        else if (!strcmp(a, "--kv-mem"))
            ok = parse_bytes(v, &o->kv_mem) && o->kv_mem > 0;
        else if (!strcmp(a, "--kv-blocks"))
            ok = sh__cmd_parse_i64(v, 1, 1 << 24, &o->kv_blocks);
        else if (!strcmp(a, "--max-seqs"))
            ok = sh__cmd_parse_i64(v, 1, 1024, &n) && ((o->max_seqs = (int32_t)n), true);
        else if (!strcmp(a, "--step-tokens"))
            ok = sh__cmd_parse_i64(v, 16, 65536, &n) && ((o->step_tokens = (int32_t)n), true);
        else if (!strcmp(a, "--max-wait-ms"))
            ok = sh__cmd_parse_i64(v, 1, 10000, &n) && ((o->max_wait_ms = (int32_t)n), true);
        else if (!strcmp(a, "--max-queue"))
            ok = sh__cmd_parse_i64(v, 1, 1 << 20, &n) && ((o->max_queue = (int32_t)n), true);
        else if (!strcmp(a, "--max-tokens"))
            ok = sh__cmd_parse_i64(v, 1, 1 << 20, &n) && ((o->max_tokens = (int32_t)n), true);
        else if (!strcmp(a, "--max-n"))
            ok = sh__cmd_parse_i64(v, 1, 128, &n) && ((o->max_n = (int32_t)n), true);
        else if (!strcmp(a, "--max-body"))
            ok = parse_bytes(v, &o->max_body) && o->max_body >= 1024;
        else if (!strcmp(a, "--max-conns"))
            ok = sh__cmd_parse_i64(v, 1, 1 << 20, &n) && ((o->max_conns = (uint32_t)n), true);
        else if (!strcmp(a, "--header-timeout-ms"))
            ok = sh__cmd_parse_i64(v, 100, 3600000, &n) &&
                 ((o->header_timeout_ms = (uint32_t)n), true);
        else if (!strcmp(a, "--request-timeout"))
            ok = sh__cmd_parse_i64(v, 1, 86400, &n) &&
                 ((o->request_timeout_ms = (uint32_t)n * 1000), true);
        else if (!strcmp(a, "--api-key")) {
            if (add_key(o, v))
                return 2;
        } else if (!strcmp(a, "--log-level"))
            o->log_level = v;
        else
            return sh__cmd_fail("unknown option '%s' (see shoal serve --help)", a);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s", v, a);
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
    // Until nodes can be joined, every script that names more than one node is refused, even
    // one whose single stage would fit: its gateway and stage were meant for other processes.
    if (c->n_nodes != 1 || c->n_replicas != 1 || c->replicas[0].n_stages != 1 ||
        c->replicas[0].tp != 1) {
        int32_t st = c->replicas[0].n_stages;
        return sh__cmd_fail("%s: shoal serve runs one replica of one stage in this process; this "
                            "topology has %d node%s and %d replica%s (the first: %d stage%s, tp "
                            "%d); serving across nodes is not implemented yet",
                            o->config, (int)c->n_nodes, c->n_nodes == 1 ? "" : "s",
                            (int)c->n_replicas, c->n_replicas == 1 ? "" : "s", (int)st,
                            st == 1 ? "" : "s", (int)c->replicas[0].tp);
    }
    const sh_config_model *m = &c->models[c->replicas[0].model];
    o->model = m->path;
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
        if (add_key(o, c->gateway.api_keys[i]))
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

static sh_log_level level_of(const char *s)
{
    if (!s)
        return SH_LOG_LEVEL_INFO;
    if (!strcmp(s, "error"))
        return SH_LOG_LEVEL_ERROR;
    if (!strcmp(s, "warn"))
        return SH_LOG_LEVEL_WARN;
    if (!strcmp(s, "debug"))
        return SH_LOG_LEVEL_DEBUG;
    if (!strcmp(s, "trace"))
        return SH_LOG_LEVEL_TRACE;
    return SH_LOG_LEVEL_INFO;
}

/* The KV budget when none is given: 1 GiB, or a quarter of the memory available now when that is
 * less (a small machine keeps room for the weights and everything else). */
static uint64_t default_kv_mem(void)
{
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    uint64_t quarter = pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size / 4 : 0;
    return quarter && quarter < DEFAULT_KV_MEM ? quarter : DEFAULT_KV_MEM;
}

/* The file's name without directories and without .gguf. */
static void base_name(const char *path, char *buf, size_t cap)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    snprintf(buf, cap, "%s", b);
    size_t l = strlen(buf);
    if (l > 5 && !strcmp(buf + l - 5, ".gguf"))
        buf[l - 5] = '\0';
}

/* Everything a serving process holds; freed by close_all. */
typedef struct server {
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
    sh_llama_ctx *ctx;
    sh_runtime *rt;
    char name[256];
    char system[1024];
} server;

static void close_all(server *s)
{
    sh_runtime_destroy(s->rt); /* stops the actors first: nothing uses the model after it */
    sh_llama_ctx_destroy(s->ctx);
    sh_backend_destroy(s->be);
    sh_tokenizer_destroy(s->tok);
    sh_llama_destroy(s->m);
}

static int run(serve_opts *o, server *s, const sigset_t *sigs)
{
    sh_error e = {0};
    struct stat sb;
    if (stat(o->model, &sb) != 0)
        return sh__cmd_fail("%s: %s%s", o->model, strerror(errno),
                            strcmp(o->model, DEFAULT_MODEL) ? ""
                                                            : " (scripts/get-model.sh fetches it)");
    sh_llama_load_opts lo = {.prefault = true};
    if (isatty(2) && sb.st_size > (64 << 20))
        lo.progress = progress;
    if (sh_llama_load(o->model, &lo, &s->m, &e))
        return sh__cmd_fail("%s", e.msg);
    if (!s->m->gguf)
        return sh__cmd_fail("%s: shoal serve needs a GGUF model (its tokenizer is inside)",
                            o->model);
    if (sh_tokenizer_create_gguf(s->m->gguf, &s->tok, &e))
        return sh__cmd_fail("%s: tokenizer: %s", o->model, e.msg);
    const sh_llama_hparams *hp = &s->m->hp;
    int32_t n_ctx = o->ctx ? o->ctx : (hp->n_ctx_train < 8192 ? hp->n_ctx_train : 8192);
    if (n_ctx < 16)
        n_ctx = 16;
    int32_t max_seqs = o->max_seqs ? o->max_seqs : 64;
    int32_t step_tokens = o->step_tokens ? o->step_tokens : 4096;
    if (step_tokens < max_seqs)
        step_tokens = max_seqs;
    // The KV pool: a block holds K and V of 16 positions in every layer.
    uint64_t bytes_per_block = (uint64_t)2 * (uint64_t)hp->n_layers * (uint64_t)hp->n_kv_heads *
                               (uint64_t)hp->head_dim * SH_KV_DEFAULT_BLOCK_TOKENS *
                               (o->kv_f16 ? 2u : 4u);
    int64_t n_blocks = o->kv_blocks;
    if (!n_blocks)
        n_blocks = (int64_t)((o->kv_mem ? o->kv_mem : default_kv_mem()) / bytes_per_block);
    if (n_blocks < 1)
        return sh__cmd_fail("the KV budget holds no block (one block takes %" PRIu64 " bytes)",
                            bytes_per_block);
    if (n_blocks > (1 << 22))
        n_blocks = 1 << 22;
    sh_backend_cpu_opts bo = {.n_threads = o->threads};
    if (sh_backend_cpu_create(&bo, &s->be, &e))
        return (sh__cmd_fail("backend: %s", e.msg), 1);
    sh_llama_ctx_opts co = {.max_tokens = step_tokens,
                            .max_seqs = max_seqs,
                            .max_logits = max_seqs,
                            .kv_tokens = (int32_t)(n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS),
                            .kv_type = o->kv_f16 ? SH_DTYPE_F16 : SH_DTYPE_F32};
    if (sh_llama_ctx_create(s->m, s->be, &co, &s->ctx, &e))
        return (sh__cmd_fail("%s", e.msg), 1);
    n_blocks = sh_llama_ctx_n_blocks(s->ctx);

    sh_runtime_opts ro = {
        .node_id = 1, .name = "serve", .n_loops = 2, .log_level = level_of(o->log_level)};
    if (sh_runtime_create(&ro, &s->rt, &e) || sh__serve_register(s->rt, &e))
        return (sh__cmd_fail("runtime: %s", e.msg), 1);

    // Chat template and its default system prompt.
    const char *tmpl = NULL;
    size_t tmpl_len = 0;
    sh_str st;
    if (sh_gguf_get_str(s->m->gguf, "tokenizer.chat_template", &st) == SH_OK) {
        tmpl = st.ptr;
        tmpl_len = (size_t)st.len;
    }
    bool has_sys = sh_chat_default_system(tmpl, tmpl_len, s->system, sizeof s->system);
    if (o->model_name)
        snprintf(s->name, sizeof s->name, "%s", o->model_name);
    else
        base_name(o->model, s->name, sizeof s->name);

    sh_addr kv_addr, stage_addr, batcher_addr, gw_addr;
    sh_kvmgr_args ka = {
        .cfg = {.n_blocks = (int32_t)n_blocks,
                .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS,
                .max_seqs = max_seqs,
                .window = hp->sliding_window,
                .max_blocks_per_seq =
                    (n_ctx + SH_KV_DEFAULT_BLOCK_TOKENS - 1) / SH_KV_DEFAULT_BLOCK_TOKENS + 1},
        .prefix_cache = !o->no_prefix_cache};
    // A table never holds more live blocks than the pool; with a sliding window its released
    // entries (-1) do not count, so a sequence may span more positions than the pool holds.
    if (ka.cfg.max_blocks_per_seq > ka.cfg.n_blocks && hp->sliding_window <= 0)
        ka.cfg.max_blocks_per_seq = ka.cfg.n_blocks;
    sh_stage_args sa = {.model = s->m,
                        .ctx = s->ctx,
                        .max_seqs = max_seqs,
                        .max_blocks_per_seq = ka.cfg.max_blocks_per_seq};
    if (sh_actor_spawn(s->rt, "kvmgr", &ka, 1, &kv_addr, &e) ||
        sh_actor_spawn(s->rt, "stage", &sa, 1, &stage_addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    sh_batcher_args ba = {.kvmgr = kv_addr,
                          .stage = stage_addr,
                          .tok = s->tok,
                          .n_vocab = hp->n_vocab,
                          .n_ctx = n_ctx,
                          .max_step_tokens = step_tokens,
                          .max_seqs = max_seqs,
                          .max_wait_ms = o->max_wait_ms,
                          .max_queue = o->max_queue,
                          .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS,
                          .n_blocks = (int32_t)n_blocks};
    if (sh_actor_spawn(s->rt, "batcher", &ba, 1, &batcher_addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    int bound = 0;
    sh_gateway_args ga = {.batcher = batcher_addr,
                          .tok = s->tok,
                          .chat = sh_chat_detect(tmpl, tmpl_len),
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
                          .bound_port = &bound};
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
            " tokens (%.0f MiB %s), prefix cache %s, %d sequences x %d tokens per step\n",
            s->name, (int)hp->n_layers, (int)n_ctx, n_blocks, n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS,
            (double)((uint64_t)n_blocks * bytes_per_block) / (1024.0 * 1024.0),
            o->kv_f16 ? "f16" : "f32", o->no_prefix_cache ? "off" : "on", (int)max_seqs,
            (int)step_tokens);
    fprintf(stderr, "shoal: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "",
            port, o->n_keys ? " (API keys required)" : "");
    fflush(stderr);
    int sig = 0;
    sigwait(sigs, &sig);
    fprintf(stderr, "shoal: %s, shutting down\n", sig == SIGINT ? "interrupted" : "terminated");
    return 0;
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
    if (rc == 0) {
        if (!o.model)
            o.model = DEFAULT_MODEL;
        // Signals are taken by sigwait on this thread: block them before any thread starts.
        sigset_t sigs;
        sigemptyset(&sigs);
        sigaddset(&sigs, SIGINT);
        sigaddset(&sigs, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &sigs, NULL);
        signal(SIGPIPE, SIG_IGN);
        server s;
        memset(&s, 0, sizeof s);
        rc = run(&o, &s, &sigs);
        close_all(&s);
    }
    for (int32_t i = 0; i < o.n_keys; i++)
        free(o.key_mem[i]);
    sh_config_destroy(cfg);
    return help ? 0 : rc;
}
