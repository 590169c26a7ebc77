/* The embedding API of include/shoal.h: opening an engine (a model in this process, run by the
 * kvmgr, stage and batcher actors of `shoal serve` on a runtime of its own, without the HTTP
 * gateway), closing it, and what it tells about its model (tokenizer, chat template, info,
 * metrics). Requests and sh_poll are in api/engine_req.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actors/supervisor.h"
#include "api/engine_int.h"
#include "base/dtype.h"
#include "base/error.h"
#include "lua/config.h"
#include "model/gguf.h"

/* The runtime's log lines go to the host's callback (levels are the same numbers). */
void sh__engine_log_sink(void *ud, sh_log_level level, const char *line, size_t len)
{
    (void)len;
    sh_engine *eng = ud;
    if (eng->log)
        eng->log(eng->log_user, (int)level, line);
}

/* The engine's part of the teardown before the transport closes: a cluster front's supervisor
 * (its recovery step in flight uses the transport and the runtime), then the fault layer. */
static void stop_fault(void *ud)
{
    sh_engine *eng = ud;
    sh__supervisor_stop(eng->sup);
    sh_fault_destroy(eng->fault); /* before the runtime: it is installed on it */
    eng->fault = NULL;
}

static void live_remove(sh_engine *eng);

/* The runtime is gone (no event is queued after it) and the model still lives: every request
 * left ends with on_error(SH_ECLOSED), whose callbacks may still call in (they get SH_ECLOSED or
 * ask about the model); then the handle stops being live. */
static void end_requests(void *ud)
{
    sh_engine *eng = ud;
    sh__engine_events_free(eng);
    sh__engine_fail_all(eng);
    live_remove(eng);
}

/* Frees what open built so far, or the whole engine at close (actors/replica.h says the order). */
static void engine_free(sh_engine *eng)
{
    if (!eng)
        return;
    sh__replica_teardown(&(sh_replica_owned){.stop_faults = stop_fault,
                                             .faults_ud = eng,
                                             .front = &eng->front,
                                             .rt = &eng->rt,
                                             .set = &eng->replicas,
                                             .after_runtime = end_requests,
                                             .after_ud = eng,
                                             .ctx = &eng->ctx,
                                             .be = &eng->be,
                                             .tok = &eng->tok,
                                             .m = &eng->m});
    sh__supervisor_destroy(eng->sup);  /* stopped above, before the transport closed */
    sh_config_destroy(eng->front_cfg); /* the front's plan pointed into it */
    if (eng->efd >= 0)
        close(eng->efd);
    pthread_mutex_destroy(&eng->mu);
    free(eng);
}

/* Copies the caller's options over the defaults: a program built against an older header passes
 * a shorter struct. */
static sh_err copy_opts(const sh_engine_opts *in, sh_engine_opts *o, sh_error *e)
{
    *o = sh_engine_opts_default();
    if (in->struct_size == 0)
        return sh__error_set(e, SH_EINVAL,
                             "opts.struct_size is 0: initialise the options with "
                             "sh_engine_opts_default()");
    size_t n = in->struct_size < sizeof *o ? in->struct_size : sizeof *o;
    memcpy(o, in, n);
    o->struct_size = sizeof *o;
    return SH_OK;
}

static sh_err check_opts(const sh_engine_opts *o, sh_error *e)
{
    if (!o->model_path == !o->cluster_script)
        return sh__error_set(e, SH_EINVAL,
                             o->model_path ? "opts: give model_path or cluster_script, not both"
                                           : "opts: give model_path or cluster_script");
    if (o->threads < 0 || o->threads > 256)
        return sh__error_set(e, SH_EINVAL, "opts.threads = %d: must be 0 (one per core) to 256",
                             (int)o->threads);
    if (o->n_ctx < 0 || o->n_ctx > (1 << 20))
        return sh__error_set(e, SH_EINVAL, "opts.n_ctx = %d: must be 0 (the model's) to %d",
                             (int)o->n_ctx, 1 << 20);
    if (o->max_seqs < 0 || o->max_seqs > 1024)
        return sh__error_set(e, SH_EINVAL, "opts.max_seqs = %d: must be 0 (16) to 1024",
                             (int)o->max_seqs);
    if (o->max_queue < 0 || o->max_queue > (1 << 20))
        return sh__error_set(e, SH_EINVAL, "opts.max_queue = %d: must be 0 (256) to %d",
                             (int)o->max_queue, 1 << 20);
    if (o->recover_timeout_ms < -1 || o->recover_timeout_ms > 3600000)
        return sh__error_set(e, SH_EINVAL,
                             "opts.recover_timeout_ms = %d: must be -1 (no wait), 0 (30 s) or "
                             "1 to 3600000 ms",
                             (int)o->recover_timeout_ms);
    if (o->spec != SH_ENGINE_SPEC_OFF && o->spec != SH_ENGINE_SPEC_NGRAM)
        return sh__error_set(e, SH_EINVAL,
                             "opts.spec = %d: must be SH_ENGINE_SPEC_OFF (0) or "
                             "SH_ENGINE_SPEC_NGRAM (1)",
                             (int)o->spec);
    if (o->spec_k < 0 || o->spec_k > SH_SPEC_MAX_K)
        return sh__error_set(e, SH_EINVAL, "opts.spec_k = %d: must be 0 (8) to %d", (int)o->spec_k,
                             SH_SPEC_MAX_K);
    if (o->log_level < 0 || o->log_level > SH_LOG_LEVEL_TRACE)
        return sh__error_set(e, SH_EINVAL, "opts.log_level = %d: must be 0 to %d",
                             (int)o->log_level, SH_LOG_LEVEL_TRACE);
    return SH_OK;
}

/* Compute threads: 0 means one per core, at most 8. */
static int32_t compute_threads(int32_t asked)
{
    if (asked > 0)
        return asked;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (int32_t)n;
}

/* What a cluster script adds to the options (its batcher and kv settings, its model's name);
 * zero for a model path. */
typedef struct script_settings {
    int32_t step_tokens, max_wait_ms;
    bool no_prefix_cache;
    bool kv_f32;          /* kv.type = "f32" */
    bool front;           /* the script has worker nodes: this engine is their front */
    int32_t spec, spec_k; /* batcher.spec (sh_spec_kind) and spec_k */
    char name[128];
} script_settings;

/* A cluster script whose one replica runs in this process (one node, one stage, as `shoal serve
 * -c` runs it without workers): its model becomes o->model_path (pointing into *cfg, which the
 * caller frees after open), its settings fill ss where the options leave them at zero. A script
 * with worker nodes sets ss->front (the engine is their front, api/engine_front.c). */
static sh_err open_script(sh_engine_opts *o, sh_cluster_config **cfg, script_settings *ss,
                          sh_error *e)
{
    sh_err rc = sh_config_load_file(o->cluster_script, NULL, cfg, e);
    if (rc)
        return rc;
    const sh_cluster_config *c = *cfg;
    const sh_config_model *m = &c->models[c->replicas[0].model];
    snprintf(ss->name, sizeof ss->name, "%s", m->name ? m->name : "");
    if ((ss->front = sh_config_has_workers(c)))
        return SH_OK; /* api/engine_front.c */
    if (c->kv.block_tokens && c->kv.block_tokens != SH_KV_DEFAULT_BLOCK_TOKENS)
        return sh__error_set(e, SH_EINVAL,
                             "%s: kv.block_tokens must be %d (the attention kernels' block)",
                             o->cluster_script, SH_KV_DEFAULT_BLOCK_TOKENS);
    o->model_path = m->path;
    if (!o->max_seqs)
        o->max_seqs = c->batcher.max_seqs;
    if (!o->kv_bytes)
        o->kv_bytes = c->kv.memory_bytes;
    ss->step_tokens = c->batcher.max_step_tokens;
    ss->max_wait_ms = c->batcher.max_wait_ms;
    ss->no_prefix_cache = !c->kv.prefix_cache;
    ss->kv_f32 = c->kv.f32;
    ss->spec = c->batcher.spec;
    ss->spec_k = c->batcher.spec_k;
    return SH_OK;
}

/* The context's rows of logits per step: one per sequence, and with speculation rows for drafts
 * (as shoal serve's; the batcher keeps a step's drafts within them). */
static int32_t spec_logits(const sh_serve_size *sz, const script_settings *ss)
{
    return sh__serve_max_logits(sz->max_seqs, sz->step_tokens, ss->spec != SH_SPEC_OFF);
}

/* Loads the model and its tokenizer, sizes the KV pool within the budget and creates the compute
 * context. */
static sh_err open_model(sh_engine *eng, const sh_engine_opts *o, const script_settings *ss,
                         sh_serve_size *sz, sh_error *e)
{
    struct stat sb;
    if (stat(o->model_path, &sb) != 0)
        return sh__error_set(e, errno == ENOENT ? SH_ENOTFOUND : SH_EIO, "%s: %s", o->model_path,
                             strerror(errno));
    sh_llama_load_opts lo = {.prefault = false};
    sh_err rc = sh_llama_load(o->model_path, &lo, &eng->m, e);
    if (rc)
        return rc;
    if (!eng->m->gguf)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "%s: the engine needs a GGUF model (its tokenizer is inside); "
                             "llama2.c checkpoints are not supported",
                             o->model_path);
    if ((rc = sh_tokenizer_create_gguf(eng->m->gguf, &eng->tok, e)))
        return rc;
    const sh_llama_hparams *hp = &eng->m->hp;
    eng->weight_bytes = sh_llama_weight_bytes(eng->m);
    sh_serve_size_opts so = {.n_ctx = o->n_ctx,
                             .max_seqs = o->max_seqs ? o->max_seqs : 16,
                             .step_tokens = ss->step_tokens,
                             .kv_mem = o->kv_bytes,
                             .kv_f32 = ss->kv_f32};
    if (o->memory_budget && !o->kv_bytes) {
        // The KV default fits what the weights leave of the budget.
        uint64_t left =
            o->memory_budget > eng->weight_bytes ? o->memory_budget - eng->weight_bytes : 0;
        uint64_t def = sh__serve_default_kv_mem();
        so.kv_mem = left < def ? left : def;
        if (so.kv_mem == 0)
            return sh__error_set(e, SH_ENOMEM,
                                 "%s: the model's weights take %" PRIu64
                                 " bytes, more than the memory budget of %" PRIu64
                                 " bytes, with no room left for the KV cache",
                                 o->model_path, eng->weight_bytes, o->memory_budget);
    }
    if ((rc = sh__serve_size(hp, &so, sz, e)))
        return rc;
    eng->kv_bytes = (uint64_t)sz->n_blocks * sz->bytes_per_block;
    if (o->memory_budget && eng->weight_bytes + eng->kv_bytes > o->memory_budget)
        return sh__error_set(e, SH_ENOMEM,
                             "%s: the model's weights (%" PRIu64
                             " bytes) plus the KV cache (%" PRIu64
                             " bytes) exceed the memory budget of %" PRIu64 " bytes",
                             o->model_path, eng->weight_bytes, eng->kv_bytes, o->memory_budget);
    sh_backend_cpu_opts bo = {.n_threads = compute_threads(o->threads),
                              .cpu_mask = o->cpu_mask,
                              .sched = o->sched,
                              .nice = o->nice,
                              .no_spin = o->no_spin};
    if ((rc = sh_backend_cpu_create(&bo, &eng->be, e)))
        return rc;
    sh_llama_ctx_opts co = {.max_tokens = sz->step_tokens,
                            .max_seqs = sz->max_seqs,
                            .max_logits = spec_logits(sz, ss),
                            .kv_tokens = (int32_t)(sz->n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS),
                            .kv_type = ss->kv_f32 ? SH_DTYPE_F32 : SH_DTYPE_F16};
    if ((rc = sh_llama_ctx_create(eng->m, eng->be, &co, &eng->ctx, e)))
        return rc;
    sz->n_blocks = sh_llama_ctx_n_blocks(eng->ctx);
    eng->n_blocks = sz->n_blocks;
    eng->n_ctx = sz->n_ctx;
    eng->max_seqs = sz->max_seqs;
    eng->pooling = sh_llama_pooling(eng->m);
    return SH_OK;
}

/* The model's chat template, default system prompt and name (the script's, else the file's
 * general.name, else the file name). */
static void model_meta(sh_engine *eng, const char *path, const char *name)
{
    eng->chat = sh__serve_model_chat(eng->m, eng->system, sizeof eng->system, &eng->has_system);
    sh_str st;
    eng->has_template = sh_gguf_get_str(eng->m->gguf, "tokenizer.chat_template", &st) == SH_OK ||
                        !strcmp(eng->m->hp.arch, "gemma3");
    if (name && name[0])
        snprintf(eng->name, sizeof eng->name, "%s", name);
    else if (sh_gguf_get_str(eng->m->gguf, "general.name", &st) == SH_OK && st.len > 0)
        snprintf(eng->name, sizeof eng->name, "%.*s", (int)st.len, st.ptr);
    else
        sh__serve_base_name(path, eng->name, sizeof eng->name);
}

/* The replica (actors/replica.h: kvmgr, stage and batcher on the one loop) and the engine's "api"
 * actor. */
static sh_err start_actors(sh_engine *eng, const sh_serve_size *sz, const script_settings *ss,
                           int32_t max_queue, sh_error *e)
{
    sh_err rc;
    if ((rc = sh__serve_register(eng->rt, e)) ||
        (rc = sh_runtime_register(eng->rt, &sh__engine_api_vtable, e)))
        return rc;
    sh_replica_opts ro = {.model = eng->m,
                          .ctx = eng->ctx,
                          .tok = eng->tok,
                          .n_ctx = sz->n_ctx,
                          .max_seqs = sz->max_seqs,
                          .step_tokens = sz->step_tokens,
                          .n_blocks = sz->n_blocks,
                          .max_wait_ms = ss->max_wait_ms,
                          .max_queue = max_queue,
                          .no_prefix_cache = ss->no_prefix_cache,
                          .spec = (sh_spec_kind)ss->spec,
                          .spec_k = ss->spec_k,
                          .max_logits = spec_logits(sz, ss)};
    if ((rc = sh__replica_start(eng->rt, &ro, &eng->replicas, e)))
        return rc;
    eng->batcher = eng->replicas->target[0];
    return sh_actor_spawn(eng->rt, "api", eng, 0, &eng->self, e);
}

/* Waits until every actor spawned on the loop has run its init (the api actor's, last, sets
 * started), so the engine is ready when open returns. */
sh_err sh__engine_wait_started(sh_engine *eng, sh_error *e)
{
    for (int i = 0; i < 60000; i++) {
        if (atomic_load(&eng->started))
            return SH_OK;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return sh__error_set(e, SH_ETIMEDOUT, "the engine's actors did not start within 12 s");
}

/* The engines open in this process, so that a call on a closed (or never opened) handle answers
 * SH_EINVAL instead of touching freed memory. A handful at most: a list under a lock. A handle
 * whose address a later engine reuses refers to that engine; calls that race with the close of
 * their own engine stay the caller's error (shoal.h). */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static sh_engine **live;
static size_t n_live, cap_live;

static sh_err live_add(sh_engine *eng, sh_error *e)
{
    pthread_mutex_lock(&live_mu);
    if (n_live == cap_live) {
        size_t cap = cap_live ? 2 * cap_live : 8;
        sh_engine **p = realloc(live, cap * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&live_mu);
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        }
        live = p;
        cap_live = cap;
    }
    live[n_live++] = eng;
    pthread_mutex_unlock(&live_mu);
    return SH_OK;
}

static void live_remove(sh_engine *eng)
{
    pthread_mutex_lock(&live_mu);
    for (size_t i = 0; i < n_live; i++)
        if (live[i] == eng) {
            live[i] = live[--n_live];
            break;
        }
    if (!n_live) { /* nothing open: nothing kept (a leak check at exit sees no list) */
        free(live);
        live = NULL;
        cap_live = 0;
    }
    pthread_mutex_unlock(&live_mu);
}

bool sh__engine_live(const sh_engine *eng)
{
    bool found = false;
    if (!eng)
        return false;
    pthread_mutex_lock(&live_mu);
    for (size_t i = 0; i < n_live && !found; i++)
        found = live[i] == eng;
    pthread_mutex_unlock(&live_mu);
    return found;
}

void sh__engine_thread_start(void *ud)
{
    /* The backend's create already tried these settings on a thread of its own and failed the
     * open if the OS refused one (a cluster front has no backend: its settings were checked by
     * check_opts' ranges only, and a refusal here leaves the thread as it was). */
    (void)sh__cpu_thread_apply(&((sh_engine *)ud)->place);
}

sh_err sh_engine_open(const sh_engine_opts *opts, sh_engine **out, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (out)
        *out = NULL;
    if (!opts || !out)
        return sh__error_set(e, SH_EINVAL, "sh_engine_open: %s is NULL", opts ? "out" : "opts");
    sh_engine_opts o;
    sh_err rc = copy_opts(opts, &o, e);
    if (!rc)
        rc = check_opts(&o, e);
    if (rc)
        return rc;
    sh_cluster_config *cfg = NULL;
    script_settings ss = {0};
    if (o.cluster_script && (rc = open_script(&o, &cfg, &ss, e))) {
        sh_config_destroy(cfg);
        return rc;
    }
    // Speculation: the options' settings win over the script's batcher.spec and spec_k.
    if (o.spec)
        ss.spec = SH_SPEC_NGRAM;
    if (o.spec_k)
        ss.spec_k = o.spec_k;
    sh_engine *eng = calloc(1, sizeof *eng);
    if (!eng) {
        sh_config_destroy(cfg);
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    eng->efd = -1;
    eng->log = o.log;
    eng->log_user = o.log_user;
    eng->place = (sh__cpu_thread_opts){.cpu_mask = o.cpu_mask, .sched = o.sched, .nice = o.nice};
    pthread_mutex_init(&eng->mu, NULL);
    atomic_init(&eng->busy, 0);
    atomic_init(&eng->started, 0);
    eng->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (eng->efd < 0) {
        rc = sh__error_set(e, SH_EIO, "eventfd: %s", strerror(errno));
        goto fail;
    }
    if (ss.front) {
        if ((rc = sh__engine_front_open(eng, &o, o.cluster_script, cfg, e)))
            goto fail;
        model_meta(eng, cfg->models[cfg->replicas[0].model].path, ss.name);
        if ((rc = live_add(eng, e)))
            goto fail;
        eng->front_cfg = cfg; /* the front's plan points into it; freed after the runtime */
        *out = eng;
        return SH_OK;
    }
    sh_serve_size sz;
    if ((rc = open_model(eng, &o, &ss, &sz, e)))
        goto fail;
    model_meta(eng, o.model_path, ss.name);
    // max_queue counts requests waiting: the batcher runs max_seqs of the pending ones.
    int32_t max_queue = o.max_queue ? o.max_queue : SH_REPLICA_MAX_QUEUE;
    eng->limit = max_queue + sz.max_seqs;
    sh_runtime_opts ro = {.node_id = 1,
                          .name = "engine",
                          .n_loops = 1,
                          .log_level =
                              o.log ? (sh_log_level)(o.log_level ? o.log_level : SH_LOG_LEVEL_WARN)
                                    : SH_LOG_LEVEL_ERROR,
                          .log_fn = sh__engine_log_sink,
                          .log_ud = eng,
                          .thread_start = sh__engine_thread_start,
                          .thread_start_ud = eng};
    if ((rc = sh_runtime_create(&ro, &eng->rt, e)))
        goto fail;
    if ((rc = start_actors(eng, &sz, &ss, max_queue, e)) ||
        (rc = sh__engine_wait_started(eng, e)) || (rc = live_add(eng, e)))
        goto fail;
    sh_config_destroy(cfg);
    *out = eng;
    return SH_OK;
fail:
    engine_free(eng);
    sh_config_destroy(cfg);
    e->code = rc;
    return rc;
}

sh_err sh_engine_close(sh_engine *eng)
{
    if (!eng)
        return SH_OK;
    if (!sh__engine_live(eng))
        return SH_EINVAL; /* closed already, or never opened */
    int idle = 0;
    if (!atomic_compare_exchange_strong(&eng->busy, &idle, 1))
        return SH_EBUSY; /* inside a callback, or another thread polls */
    pthread_mutex_lock(&eng->mu);
    eng->closing = true; /* sh_submit answers SH_ECLOSED, sh_cancel sends nothing */
    pthread_mutex_unlock(&eng->mu);
    engine_free(eng);
    return SH_OK;
}

/* ---- model, tokenizer, chat template ------------------------------------------------------ */

sh_err sh_model_info_get(sh_engine *eng, sh_model_info *out)
{
    if (!sh__engine_live(eng) || !out)
        return SH_EINVAL;
    memset(out, 0, sizeof *out);
    const sh_llama *m = eng->m;
    const sh_llama_hparams *hp = &m->hp;
    snprintf(out->name, sizeof out->name, "%s", eng->name);
    snprintf(out->arch, sizeof out->arch, "%s", hp->arch);
    // The main weights' type: the first layer's attention query (embeddings are often kept
    // apart in another type).
    const sh_tensor *w = hp->n_layers > 0 ? &m->layers[0].wq : &m->tok_embd;
    const char *tn = sh__dtype_name((uint32_t)w->type);
    snprintf(out->weight_type, sizeof out->weight_type, "%s", tn ? tn : "?");
    out->n_vocab = hp->n_vocab;
    out->n_ctx = eng->n_ctx;
    out->n_ctx_train = hp->n_ctx_train;
    out->n_layers = hp->n_layers;
    out->dim = hp->dim;
    uint64_t n_params = 0;
    for (uint64_t i = 0; i < sh_gguf_n_tensors(m->gguf); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(m->gguf, i);
        uint64_t n = 1;
        for (uint32_t d = 0; t && d < t->n_dims; d++)
            n *= t->ne[d];
        n_params += t ? n : 0;
    }
    out->n_params = n_params;
    out->weight_bytes = eng->weight_bytes;
    out->kv_bytes = eng->kv_bytes;
    out->bos = sh_tokenizer_bos(eng->tok);
    out->eos = sh_tokenizer_eos(eng->tok);
    out->has_chat_template = eng->has_template;
    return SH_OK;
}

sh_err sh_tokenize(sh_engine *eng, const char *text, size_t len, bool add_special,
                   bool parse_special, int32_t *ids, int32_t cap, int32_t *n, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (n)
        *n = 0;
    if (!sh__engine_live(eng) || !n || (!text && len > 0) || cap < 0 || (cap > 0 && !ids))
        return sh__error_set(e, SH_EINVAL, "sh_tokenize: %s",
                             !sh__engine_live(eng) ? "eng is not an open engine (NULL or closed)"
                             : !n                  ? "n is NULL"
                             : cap < 0             ? "cap is negative"
                             : !ids                ? "ids is NULL with cap > 0"
                                                   : "text is NULL with len > 0");
    if (!sh__engine_utf8_valid(text, len))
        return sh__error_set(e, SH_EINVAL, "sh_tokenize: the text is not valid UTF-8");
    sh_tokenize_opts o = {.flags = parse_special ? SH_TOKENIZE_PARSE_SPECIAL : 0};
    if (add_special && sh_tokenizer_wants_bos(eng->tok) && sh_tokenizer_bos(eng->tok) >= 0)
        o.flags |= SH_TOKENIZE_ADD_BOS;
    int32_t *all = NULL;
    size_t n_all = 0;
    sh_err rc = sh_tokenizer_encode_opts(eng->tok, text ? text : "", len, &o, &all, &n_all, e);
    if (rc)
        return rc;
    if (n_all > INT32_MAX) {
        free(all);
        return sh__error_set(e, SH_ERANGE, "sh_tokenize: more than 2^31 tokens");
    }
    size_t k = n_all < (size_t)cap ? n_all : (size_t)cap;
    if (k)
        memcpy(ids, all, k * sizeof *ids);
    free(all);
    *n = (int32_t)n_all;
    if (n_all > (size_t)cap)
        return sh__error_set(e, SH_ERANGE, "sh_tokenize: %zu ids, room for %d", n_all, (int)cap);
    return SH_OK;
}

sh_err sh_detokenize(sh_engine *eng, const int32_t *ids, int32_t n, char *text, size_t cap,
                     size_t *len, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (len)
        *len = 0;
    if (!sh__engine_live(eng) || !len || n < 0 || (n > 0 && !ids) || (cap > 0 && !text))
        return sh__error_set(e, SH_EINVAL, "sh_detokenize: %s",
                             !sh__engine_live(eng) ? "eng is not an open engine (NULL or closed)"
                             : !len                ? "len is NULL"
                             : n < 0               ? "n is negative"
                             : !ids                ? "ids is NULL with n > 0"
                                                   : "text is NULL with cap > 0");
    int32_t n_vocab = eng->m->hp.n_vocab;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab)
            return sh__error_set(e, SH_EINVAL,
                                 "sh_detokenize: ids[%d] = %d is outside the "
                                 "vocabulary of %d",
                                 (int)i, (int)ids[i], (int)n_vocab);
    return sh_tokenizer_decode(eng->tok, ids, (size_t)n, 0, text, cap, len, e);
}

sh_err sh_chat_apply(sh_engine *eng, const sh_chat_message *messages, int32_t n, char *text,
                     size_t cap, size_t *len, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (len)
        *len = 0;
    if (!sh__engine_live(eng) || !len || n < 1 || !messages || (cap > 0 && !text))
        return sh__error_set(e, SH_EINVAL, "sh_chat_apply: %s",
                             !sh__engine_live(eng) ? "eng is not an open engine (NULL or closed)"
                             : !len                ? "len is NULL"
                             : n < 1               ? "no messages"
                             : !messages           ? "messages is NULL"
                                                   : "text is NULL with cap > 0");
    if (!eng->has_template)
        return sh__error_set(e, SH_EUNSUPPORTED, "%s has no chat template", eng->name);
    sh_chat_msg *msgs = calloc((size_t)n, sizeof *msgs);
    if (!msgs)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    sh_err rc = sh__engine_chat_msgs(messages, n, msgs, "sh_chat_apply", e);
    if (!rc)
        rc = sh_chat_render(eng->chat, msgs, (size_t)n, eng->has_system ? eng->system : NULL, true,
                            text, cap, len, e);
    free(msgs);
    return rc;
}

/* ---- metrics ------------------------------------------------------------------------------ */

typedef struct stats_visit {
    sh_engine_stats *out;
} stats_visit;

static void stats_one(void *arg, const sh_metric_sample *s)
{
    // Summed over their labels: a front with several replicas labels each one's series.
    sh_engine_stats *o = ((stats_visit *)arg)->out;
    int32_t v = s->value > INT32_MAX / 2 ? INT32_MAX / 2 : s->value < 0 ? 0 : (int32_t)s->value;
    if (!strcmp(s->name, "shoal_requests_running"))
        o->running += v;
    else if (!strcmp(s->name, "shoal_requests_waiting"))
        o->queued += v;
    else if (!strcmp(s->name, "shoal_kv_blocks_total"))
        o->kv_blocks_total += v;
    else if (!strcmp(s->name, "shoal_kv_blocks_used"))
        o->kv_blocks_used += v;
}

sh_err sh_engine_stats_get(sh_engine *eng, sh_engine_stats *out)
{
    if (!sh__engine_live(eng) || !out)
        return SH_EINVAL;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&eng->mu);
    out->pending = eng->pending;
    out->requests_total = eng->requests_total;
    out->tokens_generated_total = eng->tokens_total;
    out->prompt_tokens_total = eng->prompt_tokens_total;
    pthread_mutex_unlock(&eng->mu);
    stats_visit v = {out};
    if (eng->rt)
        sh_metrics_foreach(sh_runtime_metrics(eng->rt), stats_one, &v);
    return SH_OK;
}

sh_err sh_metrics_snapshot(sh_engine *eng, char *text, size_t cap, size_t *len)
{
    if (len)
        *len = 0;
    if (!sh__engine_live(eng) || !len || (cap > 0 && !text))
        return SH_EINVAL;
    if (!eng->rt)
        return SH_ECLOSED;
    return sh_metrics_render(sh_runtime_metrics(eng->rt), text, cap, len);
}

/* ---- fault layer -------------------------------------------------------------------------- */

struct sh_fault *sh_engine_fault(sh_engine *eng)
{
    if (!sh__engine_live(eng))
        return NULL;
    // Created on first use: it costs a timer thread, and a model run in this process sends
    // nothing over the network.
    pthread_mutex_lock(&eng->mu);
    if (!eng->fault && eng->rt && !eng->closing) {
        sh_fault_opts fo = {.seed = 1};
        sh_transport_hooks next;
        if (eng->front && eng->front->tp) { /* wrap the transport's hooks: remote sends */
            sh_transport_hooks_get(eng->front->tp, &next);
            fo.next = &next;
        }
        sh_error e = {0};
        if (sh_fault_create(eng->rt, &fo, &eng->fault, &e))
            eng->fault = NULL;
    }
    sh_fault *f = eng->fault;
    pthread_mutex_unlock(&eng->mu);
    return f;
}
