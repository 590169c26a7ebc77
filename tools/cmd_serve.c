/* `shoal serve`: serves a model over an OpenAI-compatible HTTP API, with the gateway, batcher,
 * kvmgr and stage actors of one replica in this process. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "actors/cluster_events.h"
#include "actors/cluster_key.h"
#include "actors/node_metrics.h"
#include "actors/replica.h"
#include "actors/serve.h"
#include "actors/supervisor.h"
#include "base/error.h"
#include "kernels/backend.h"
#include "lua/config.h"
#include "model/gguf.h"
#include "model/spec_draft_batch.h"
#include "tools/cluster_status.h"
#include "tools/cmd.h"
#include "tools/cmd_fault.h"
#include "tools/cmd_util.h"
#include "tools/sdnotify.h"
#include "tools/serve_degrade.h"
#include "tools/serve_opts.h"

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
    sh_spec_drafts *drafts;   /* --spec draft:PATH|self:LAYERS: the drafter actor's model */
    sh_openai_sampling samp[SH_CLUSTER_MAX_REPLICAS]; /* absent sampling fields, per model */
    sh_sdnotify sd; /* systemd's notifications (NOTIFY_SOCKET; tools/sdnotify.h) */
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
    sh_spec_drafts_destroy(s->drafts); /* its drafter actor is gone; the target is not yet */
    s->drafts = NULL;
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
    sh__sdnotify_send(&s->sd, "STOPPING=1\nSTATUS=a worker node was lost; stopping");
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
static int drain(sh_serve_opts *o, server *s, const sigset_t *sigs, int sig)
{
    sh_gateway_ctl *ctl = s->ctl;
    char what[768];
    fprintf(stderr,
            "shoal: %s, draining (up to %.1f s for the requests in flight; signal again "
            "to stop now)\n",
            sig == SIGINT ? "interrupted" : "terminated", o->drain_timeout_ms / 1000.0);
    fflush(stderr);
    sh__sdnotify_send(&s->sd, "STOPPING=1\nSTATUS=draining");
    sh__gateway_ctl_drain(ctl);
    // The gateway enforces the deadline; this is the backstop should it not report.
    uint64_t backstop = mono_ms() + o->drain_timeout_ms + 10000;
    while (!sh__gateway_ctl_drained(ctl)) {
        struct timespec ts = {0, 20 * 1000000};
        int got = sigtimedwait(sigs, NULL, &ts);
        if (got == SIGHUP) {
            if (o->key_file || !s->deg)
                sh__serve_opts_reload_keys(o, ctl);
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
static int serve_until_stopped(sh_serve_opts *o, server *s, const sigset_t *sigs)
{
    char what[768];
    for (;;) {
        struct timespec ts = {0, 20 * 1000000};
        int got = sigtimedwait(sigs, NULL, s->front ? &ts : NULL);
        if (got == SIGHUP) {
            if (o->key_file || !s->deg)
                sh__serve_opts_reload_keys(o, s->ctl);
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
static int create_supervisor(sh_serve_opts *o, server *s)
{
    sh_error e = {0};
    sh_supervisor_args a = {.front = s->front,
                            .batchers = s->batcher,
                            .recover_ms = o->recover_ms,
                            .recover_what = "--recover-timeout",
                            .events = &s->events,
                            .note = sup_note,
                            .tick = degrade_tick,
                            .tick_user = s};
    if (sh__supervisor_create(&a, &s->sup, &e))
        return (sh__cmd_fail("%s", e.msg), 1);
    return 0;
}

static int run(sh_serve_opts *o, server *s, const sigset_t *sigs)
{
    sh_error e = {0};
    if (o->cluster && !o->recover_set)
        o->recover_ms = 30000; /* a lost worker is awaited, not fatal */
    if (o->fault_path && !o->cluster)
        return sh__cmd_fail("--fault-scenario needs -c with worker nodes: it acts on the links "
                            "between nodes");
    struct stat sb;
    if (stat(o->model, &sb) != 0)
        return sh__cmd_fail(
            "%s: %s%s", o->model, strerror(errno),
            strcmp(o->model, SH_SERVE_DEFAULT_MODEL) ? "" : " (scripts/get-model.sh fetches it)");
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
    // No thread has started yet: all inherit this priority (compute threads lower theirs).
    char who[96] = "serve";
    if (o->cluster)
        snprintf(who, sizeof who, "front %s", o->cfg->nodes[o->cfg->gateway.node].name);
    sh_cmd_prio prio;
    sh__cmd_prio_apply(o->control_nice, who, !o->cluster, &prio);
    int32_t n_ctx = sz.n_ctx, max_seqs = sz.max_seqs, step_tokens = sz.step_tokens;
    int32_t max_logits = 0; /* the context's rows of logits per step (0: max_seqs) */
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
        sh_backend_cpu_opts bo = {.n_threads = o->threads, .nice = prio.compute_add};
        if (sh_backend_cpu_create(&bo, &s->be, &e))
            return (sh__cmd_fail("backend: %s", e.msg), 1);
        char kern[160];
        sh_backend_cpu_describe(s->be, kern, sizeof kern);
        fprintf(stderr, "shoal: cpu: %s\n", kern);
        // Speculation: rows of logits for drafted tokens (the batcher keeps a step's within).
        max_logits = sh__serve_max_logits(max_seqs, step_tokens, o->spec.kind != SH_SPEC_OFF);
        sh_llama_ctx_opts co = {.max_tokens = step_tokens,
                                .max_seqs = max_seqs,
                                .max_logits = max_logits,
                                .kv_tokens = (int32_t)(n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS),
                                .kv_type = o->kv_f32 ? SH_DTYPE_F32 : SH_DTYPE_F16};
        if (sh_llama_ctx_create(s->m, s->be, &co, &s->ctx, &e))
            return (sh__cmd_fail("%s", e.msg), 1);
        n_blocks = sh_llama_ctx_n_blocks(s->ctx);
        int drc = sh__serve_opts_drafts(o, s->m, s->tok, s->be, n_ctx, max_seqs, step_tokens,
                                        n_blocks, &s->drafts);
        if (drc)
            return drc;
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

    // A kvmgr and a batcher per replica (with its stage), a router per replicated model.
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
                           .drafts = s->drafts,
                           .spec = o->spec.kind,
                           .spec_k = o->spec.k,
                           .max_logits = max_logits,
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
    sh__serve_opts_sampling(o, s->m, &s->samp[0], true);
    sh_gateway_args ga = {.batcher = batcher_addr,
                          .tok = s->tok,
                          .chat = chat,
                          .default_system = has_sys ? s->system : NULL,
                          .model_name = s->name,
                          .n_vocab = hp->n_vocab,
                          .n_ctx = n_ctx,
                          .n_ctx_train = (int32_t)hp->n_ctx_train,
                          .cors_origins = o->cors,
                          .sampling = &s->samp[0],
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
    sh__serve_gateway_embed(&ga, s->m);
    // Several models: the gateway picks one by each request's "model".
    sh_gateway_model gms[SH_CLUSTER_MAX_REPLICAS];
    if (n_slots > 1) {
        for (int32_t j = 0; j < n_slots; j++) {
            int32_t mi = slot_model[j];
            const sh_llama *mm = models[mi];
            bool sys = false;
            char *buf = j == 0 ? s->system : s->xsystem[mi];
            sh_chat_template ch = sh__serve_model_chat(mm, buf, sizeof s->system, &sys);
            if (j > 0)
                sh__serve_opts_sampling(o, mm, &s->samp[j], false);
            gms[j] = (sh_gateway_model){.name = j == 0 ? s->name : o->cfg->models[mi].name,
                                        .batcher = target[j],
                                        .tok = toks[mi],
                                        .chat = ch,
                                        .default_system = sys ? buf : NULL,
                                        .n_vocab = mm->hp.n_vocab,
                                        .n_ctx = plan->rep[rs->ids[j][0]].n_ctx,
                                        .n_ctx_train = (int32_t)mm->hp.n_ctx_train,
                                        .sampling = &s->samp[j],
                                        .embd_dim = mm->hp.dim,
                                        .pooling = sh_llama_pooling(mm)};
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
    // Init reports the bound port (or -1); ga stays on this stack until the runtime is gone.
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
            plan        ? (plan->c->kv.f32 ? "f32 per stage" : "f16 per stage")
            : o->kv_f32 ? "f32"
                        : "f16",
            o->no_prefix_cache ? "off" : "on", (int)max_seqs, (int)step_tokens);
    sh__serve_opts_log_spec(o);
    for (int32_t j = 1; j < n_slots; j++) {
        const sh_cluster_replica_plan *rp = &plan->rep[rs->ids[j][0]];
        fprintf(stderr, "shoal: model %s (%d layers, context %d), %d replica%s\n",
                o->cfg->models[slot_model[j]].name, (int)rp->n_layers, (int)rp->n_ctx,
                (int)slot_n[j], slot_n[j] == 1 ? "" : "s");
    }
    fprintf(stderr, "shoal: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "",
            port, o->n_keys ? " (API keys required)" : "");
    fflush(stderr);
    if (sh__sdnotify_start(&s->sd, s->rt, 0, NULL)) /* WATCHDOG=1 from loop 0 */
        return 1;
    sh__sdnotify_send(&s->sd, "READY=1\nSTATUS=serving on http://%s:%d", host, port);
    return serve_until_stopped(o, s, sigs);
}

int sh__cmd_serve(int argc, char **argv)
{
    sh_serve_opts o;
    memset(&o, 0, sizeof o);
    sh_cluster_config *cfg = NULL;
    int rc = sh__serve_opts_parse(argc, argv, &o);
    bool help = rc == 1;
    if (rc == 0)
        rc = sh__serve_opts_finish(&o, &cfg);
    if (rc == 0) {
        // Signals are taken by sigwait on this thread: block them before any thread starts.
        sigset_t sigs;
        sh__cmd_block_signals(&sigs, 0);
        server s;
        memset(&s, 0, sizeof s);
        sh__sdnotify_open(&s.sd); /* before any thread starts */
        sh__cluster_events_init(&s.events);
        rc = run(&o, &s, &sigs);
        close_all(&s);
        sh__sdnotify_close(&s.sd);
        sh__cluster_events_fini(&s.events);
    }
    sh__serve_opts_free(&o);
    sh_config_destroy(cfg);
    return help ? 0 : rc;
}
