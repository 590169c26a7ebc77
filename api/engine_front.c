/* The embedding API's engine on a cluster script with worker nodes (include/shoal.h,
 * docs/cluster.md): this process is the front, as `shoal serve -c` is without its HTTP gateway.
 * It loads each model's hyper-parameters and tokenizer, joins the workers (actors/cluster.h),
 * and runs a kvmgr and a batcher per replica, with a router before several (actors/replica.h), on
 * its own runtime. Its watchdog and supervisor (actors/supervisor.h) recover from a lost worker as
 * `shoal serve -c` does: a standby takes its place, or its replicas wait for it to come back (or
 * restart; opts.recover_timeout_ms, 30 s by default) and resume by recompute, or leave routing;
 * when nothing is left, every open request ends with on_error (SH_EIO) and sh_submit refuses new
 * ones. Their lines go to the log. */
#include <stdlib.h>
#include <string.h>

#include "actors/cluster_key.h"
#include "actors/supervisor.h"
#include "api/engine_int.h"
#include "base/error.h"
#include "model/gguf.h"

#define RECOVER_MS 30000 /* opts.recover_timeout_ms 0: as shoal serve -c's --recover-timeout */

/* The join's progress lines go to the log. */
static void front_note(void *ud, const char *line)
{
    sh_engine *eng = ud;
    if (eng->log)
        eng->log(eng->log_user, SH_ENGINE_LOG_INFO, line);
}

/* The supervisor's lines (a promotion, a wait, a replica resumed or removed) go to the log. */
static void sup_note(void *ud, bool error, const char *line)
{
    sh_engine *eng = ud;
    if (eng->log)
        eng->log(eng->log_user, error ? SH_ENGINE_LOG_ERROR : SH_ENGINE_LOG_WARN, line);
}

/* The front must stop: its requests end with on_error (SH_EIO). Supervisor's thread. */
static void sup_stop(void *ud, const char *what)
{
    sh_engine *eng = ud;
    sup_note(eng, true, what);
    sh__engine_front_failed(eng, what);
}

/* cluster.c's 0/1/2 with its line in e, as an sh_err. */
static sh_err front_err(int rc, sh_error *e)
{
    if (!rc)
        return SH_OK;
    if (!e->code)
        e->code = rc == 2 ? SH_EINVAL : SH_EIO;
    return e->code;
}

sh_err sh__engine_front_open(sh_engine *eng, const sh_engine_opts *o, const char *script,
                             const sh_cluster_config *c, sh_error *e)
{
    sh_err rc;
    if ((rc = front_err(sh__cluster_check(c, script, e), e)))
        return rc;
    // The engine's requests carry no model name: every replica must serve one model.
    int32_t mi = c->replicas[0].model;
    for (int32_t k = 1; k < c->n_replicas; k++)
        if (c->replicas[k].model != mi)
            return sh__error_set(e, SH_EUNSUPPORTED,
                                 "%s: the replicas serve several models; an engine serves one "
                                 "(its requests name no model)",
                                 script);
    // The front maps only what it reads: hyper-parameters and the tokenizer.
    sh_llama_load_opts lo = {.last = 1};
    const char *path = c->models[mi].path;
    if ((rc = sh_llama_load(path, &lo, &eng->m, e)))
        return rc;
    if (!eng->m->gguf)
        return sh__error_set(e, SH_EUNSUPPORTED, "%s: a cluster needs a GGUF model", path);
    if ((rc = sh_tokenizer_create_gguf(eng->m->gguf, &eng->tok, e)))
        return rc;
    eng->pooling =
        sh_llama_pooling(eng->m); /* the last stage's node pools, the batcher here sums */
    if (!(eng->front = calloc(1, sizeof *eng->front)))
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    sh_cluster_front *f = eng->front;
    if ((rc = front_err(sh__cluster_key_load(NULL, c, &f->key, e), e)))
        return rc;
    for (int32_t i = 0; f->key.set && i < c->n_nodes; i++)
        if (c->nodes[i].standby)
            return sh__error_set(e, SH_EUNSUPPORTED,
                                 "%s: node '%s' is a standby: standby nodes do not work with a "
                                 "cluster key yet",
                                 script, c->nodes[i].name);
    sh_runtime_opts ro = {
        .node_id = (uint32_t)c->gateway.node + 1,
        .name = c->nodes[c->gateway.node].name,
        .n_loops = 3, /* the third for the watchdog alone */
        .log_level = o->log ? (sh_log_level)(o->log_level ? o->log_level : SH_LOG_LEVEL_WARN)
                            : SH_LOG_LEVEL_ERROR,
        .log_fn = sh__engine_log_sink,
        .log_ud = eng,
        .thread_start = sh__engine_thread_start,
        .thread_start_ud = eng};
    if ((rc = sh_runtime_create(&ro, &eng->rt, e)) || (rc = sh__serve_register(eng->rt, e)) ||
        (rc = sh_runtime_register(eng->rt, &sh__engine_api_vtable, e)))
        return rc;
    const sh_llama *models[SH_CLUSTER_MAX_REPLICAS] = {NULL};
    if (c->n_models > SH_CLUSTER_MAX_REPLICAS)
        return sh__error_set(e, SH_EUNSUPPORTED, "%s: %d models; at most %d are supported", script,
                             (int)c->n_models, SH_CLUSTER_MAX_REPLICAS);
    models[mi] = eng->m;
    f->note = front_note;
    f->note_ud = eng;
    if ((rc = front_err(
             sh__cluster_front_start(f, c, script, models, eng->rt, SH_REPLICA_JOIN_TIMEOUT_MS, e),
             e)))
        return rc;
    const sh_cluster_plan *plan = &f->plan;
    int32_t n_rep = plan->n_replicas;
    eng->n_ctx = plan->rep[0].n_ctx;
    eng->max_seqs = plan->max_seqs;
    // max_queue counts requests waiting: each replica's batcher runs max_seqs of the pending.
    int32_t max_queue = o->max_queue ? o->max_queue : SH_REPLICA_MAX_QUEUE;
    eng->limit = max_queue + plan->max_seqs * n_rep;
    for (int32_t k = 0; k < n_rep; k++)
        eng->n_blocks += plan->rep[k].n_blocks;
    const sh_tokenizer *toks[SH_CLUSTER_MAX_REPLICAS] = {NULL};
    toks[mi] = eng->tok;
    // Every waiting request may sit on one replica (prefix affinity) while the others' running
    // slots are free: each replica lets wait what the engine's limit lets through.
    sh_replica_opts rep = {.front = f,
                           .models = models,
                           .toks = toks,
                           .max_wait_ms = c->batcher.max_wait_ms,
                           .max_queue = max_queue + plan->max_seqs * (n_rep - 1),
                           .no_prefix_cache = !c->kv.prefix_cache,
                           .spec = o->spec ? SH_SPEC_NGRAM : (sh_spec_kind)c->batcher.spec,
                           .spec_k = o->spec_k ? o->spec_k : c->batcher.spec_k,
                           .loop = 1};
    if ((rc = sh__replica_start(eng->rt, &rep, &eng->replicas, e)))
        return rc;
    eng->batcher = eng->replicas->target[0];
    sh_supervisor_args sa = {.front = f,
                             .batchers = eng->replicas->batcher,
                             .recover_ms = o->recover_timeout_ms < 0 ? 0
                                           : o->recover_timeout_ms == 0
                                               ? RECOVER_MS
                                               : (uint32_t)o->recover_timeout_ms,
                             .recover_what = "opts.recover_timeout_ms",
                             .note = sup_note,
                             .note_user = eng,
                             .on_stop = sup_stop,
                             .on_stop_user = eng};
    if ((rc = sh__supervisor_create(&sa, &eng->sup, e)) ||
        (rc = sh__supervisor_start(eng->sup, eng->rt, 2, e)))
        return rc;
    // Weights and KV live on the workers (sh_model_info says 0 for both).
    eng->weight_bytes = eng->kv_bytes = 0;
    if ((rc = sh_actor_spawn(eng->rt, "api", eng, 0, &eng->self, e)))
        return rc;
    return sh__engine_wait_started(eng, e);
}
