/* `shoal node`: one worker node of a cluster script, serving the pipeline stages (or the replica's
 * drafter) the script places on it until SIGINT/SIGTERM (docs/cluster.md). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "actors/cluster_key.h"
#include "actors/hello.h"
#include "actors/node_metrics.h"
#include "actors/replica.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "lua/config.h"
#include "model/spec_draft_batch.h"
#include "model/tokenizer.h"
#include "runtime/coll.h"
#include "runtime/peers.h"
#include "shoal/transport.h"
#include "tools/cmd.h"
#include "tools/cmd_fault.h"
#include "tools/cmd_util.h"
#include "tools/node_identity.h"
#include "tools/sdnotify.h"
#include "tools/standby.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal node -c CLUSTER.lua (--name NAME | --name-from VAR) [-t THREADS]\n"
            "                  [--log-level L] [--cluster-key-file FILE] [--control-nice N]\n\n"
            "Runs node NAME of a cluster script: listens on the node's URL and serves the\n"
            "pipeline stages the script places on it (only their layers are loaded, with\n"
            "the embedding on the first stage and the output head on the last), or a\n"
            "replica's drafter, until SIGINT or SIGTERM. Start every worker node, then `shoal "
            "serve -c CLUSTER.lua`\n"
            "on the gateway's node; see docs/cluster.md.\n\n"
            "  -c CLUSTER.lua      the cluster script (the same file on every node)\n"
            "  --name NAME         which node of the script this process is\n" SH_NODE_IDENTITY_HELP
                SH_NODE_IDENTITY_JOIN_HELP
            "  -t THREADS          compute threads per stage (default: all CPUs)\n"
            "  --cluster-key-file FILE  the cluster key (else " SH_CLUSTER_KEY_ENV ", else\n"
            "                      the script's cluster.key_file): only nodes that prove\n"
            "                      it in HELLO are served; none anywhere: open\n"
            "%s"
            "  --log-level L       error, warn, info, debug, trace (default info)\n"
            "  --fault-scenario F  apply fault scenario F (lua/examples/scenario-demo.lua)\n"
            "                      to the links leaving this node, for testing: delay,\n"
            "                      drop, duplicate, corrupt, partition, heal, leak\n"
            "  --fault-epoch E     count the scenario's times from E: UNIX_MS, or @FILE\n"
            "                      holding it (waits for the file; see docs/chaos.md)\n\n"
            "Prints `node NAME serving ...` on stderr when ready; with NOTIFY_SOCKET set\n"
            "(systemd), notifies READY=1 once its front greeted it (docs/deploy.md).\n",
            SH_CMD_CONTROL_NICE_HELP);
}

typedef struct node_stage {
    sh_llama *m;
    sh_llama_ctx *ctx; /* NULL for a rank of a group: its stage actor creates it */
    /* A rank of a tensor-parallel group: its collective settings and context options, which the
     * stage actor reads when it creates its group (they outlive it). */
    sh_cluster_group *group;
    sh_coll_opts coll;
    sh_llama_ctx_opts co;
} node_stage;

typedef struct node_state {
    sh_cluster_config *cfg;
    sh_backend *be;
    sh_runtime *rt;
    sh_transport *tp;
    int32_t n;
    node_stage st[SH_CLUSTER_MAX_STAGES];
    const char *key_file;                       /* --cluster-key-file */
    sh_node_identity id;                        /* --name, --name-from, --join-timeout */
    sh_sdnotify sd;                             /* systemd's notifications (NOTIFY_SOCKET) */
    sh_auth_key key;                            /* none: the node serves anyone */
    sh_hello_auth auth;                         /* which nodes proved the key */
    const char *names[SH_HELLO_MAX_NODES];      /* node id -> the script's name, for logs */
    sh_hello_peer peers[SH_CLUSTER_MAX_STAGES]; /* with a key: the nodes whose ACT comes here */
    uint32_t sources[SH_CLUSTER_MAX_STAGES];    /* node ids whose ACT comes here */
    int32_t n_sources;
    sh_hello_ident self;
    /* The front's watchdog asked for a restart (over its memory budget): why, then the flag
     * (release) and a SIGTERM to this process's sigwait. */
    char restart_why[256];
    atomic_int restart;
    const char *fault_path;  /* --fault-scenario */
    const char *fault_epoch; /* --fault-epoch */
    sh_cmd_fault fault;
    sh_standby sb;        /* node{ standby = true }: its stages arrive with a promotion */
    int32_t control_nice; /* --control-nice */
    sh_cmd_prio prio;     /* what it set (tools/cmd_util.h) */
    sh_transport_tls tls; /* this node's certificates for its groups' tls+tcp:// links */
    /* A drafter's node (replica{ drafter = ... }): its replica (-1: none), the target loaded
     * whole (the draft's vocabulary is checked against it), its tokenizer and the drafts. */
    int32_t drafter_of;
    sh_llama *target;
    sh_tokenizer *tok;
    sh_spec_drafts *drafts;
} node_state;

/* The hello actor's on_shutdown: the front's watchdog found this node over its memory budget.
 * The node stops as for SIGTERM and exits SH_NODE_EXIT_RESTART for its supervisor to start it
 * again. Runs on the hello actor's loop thread. */
static void on_shutdown(void *user, const char *why)
{
    node_state *s = user;
    if (atomic_exchange(&s->restart, 2) == 2)
        return; /* asked already */
    snprintf(s->restart_why, sizeof s->restart_why, "%s", why);
    atomic_store_explicit(&s->restart, 1, memory_order_release);
    kill(getpid(), SIGTERM);
}

static void close_all(node_state *s)
{
    sh__cmd_fault_stop(&s->fault);
    sh__standby_join(&s->sb); /* it spawns on the runtime */
    if (s->tp)
        sh_transport_close(s->tp);
    sh_runtime_destroy(s->rt);
    sh__sdnotify_close(&s->sd);
    sh_transport_destroy(s->tp);
    sh__standby_free(&s->sb);
    sh_spec_drafts_destroy(s->drafts); /* its drafter actor is gone; the target is not yet */
    sh_tokenizer_destroy(s->tok);
    sh_llama_destroy(s->target);
    for (int32_t i = 0; i < s->n; i++) {
        sh_llama_ctx_destroy(s->st[i].ctx);
        sh_llama_destroy(s->st[i].m);
        free(s->st[i].group);
    }
    sh_backend_destroy(s->be);
    sh_config_destroy(s->cfg);
}

/* A drafter's node: loads the replica's model (whole for a draft file, only the drafting layers
 * and head for self-speculation) and the drafts, sized like its stages (sh__serve_node_drafts_
 * create). Returns 0, or 2 (a missing or broken file, a draft with another vocabulary: printed)
 * or 1. */
static int drafter_load(node_state *s, const sh_cluster_plan *plan)
{
    sh_error e = {0};
    sh_err err = sh__serve_node_drafts_create(plan, s->drafter_of, s->be, &s->target, &s->tok,
                                              &s->drafts, &e);
    return err ? (sh__cmd_fail("%s", e.msg), err == SH_ENOMEM ? 1 : 2) : 0;
}

static int run(node_state *s, const char *script, const char *name, int32_t threads,
               const char *log_level, const sigset_t *sigs)
{
    sh_error e = {0};
    if (sh_config_load_file(script, NULL, &s->cfg, &e))
        return sh__cmd_fail("%s", e.msg);
    const sh_cluster_config *c = s->cfg;
    if (sh__node_identity_resolve(c, script, name, s->id.from, false, &name))
        return 2;
    int32_t self = sh_config_find_node(c, name);
    if (self < 0)
        return sh__cmd_fail("%s: no node named '%s' in the script", script, name);
    sh_error ce = {0};
    int rc = sh__cmd_report(sh__cluster_check(c, script, &ce), &ce);
    if (rc)
        return rc;
    if (self == c->gateway.node)
        return sh__cmd_fail("%s: node '%s' is the gateway's node: run `shoal serve -c %s` there, "
                            "not `shoal node`",
                            script, name, script);
    rc = sh__cmd_report(sh__cluster_key_load(s->key_file, c, &s->key, &ce), &ce);
    if (rc)
        return rc;
    // A promoted standby's stages would take ACT from nodes that never proved the key to it.
    if (c->nodes[self].standby && s->key.set)
        return sh__cmd_fail("%s: node '%s' is a standby: standby nodes do not work with a cluster "
                            "key yet (docs/cluster.md, \"Standby nodes\")",
                            script, name);
    // The model of this node's stages (sh__cluster_check made sure they share one); the other
    // replicas' models need not be on this node's disk: the plan only places their stages.
    const sh_config_replica *r = NULL;
    for (int32_t k = 0; k < c->n_replicas && !r; k++)
        for (int32_t i = 0; i < c->replicas[k].n_stages && !r; i++)
            for (int32_t j = 0; j < c->replicas[k].stages[i].tp && !r; j++)
                if (c->replicas[k].stages[i].ranks[j] == self)
                    r = &c->replicas[k];
    // A standby holds no stage: it takes the model of the node it preloads, else the first
    // replica's, and only stages of that model can move there.
    bool standby = c->nodes[self].standby;
    int32_t of =
        standby && c->nodes[self].preload ? sh_config_find_node(c, c->nodes[self].preload) : -1;
    for (int32_t k = 0; standby && k < c->n_replicas && !r; k++)
        for (int32_t i = 0; i < c->replicas[k].n_stages && !r; i++)
            for (int32_t j = 0; j < c->replicas[k].stages[i].tp && !r; j++)
                if (of < 0 || c->replicas[k].stages[i].ranks[j] == of)
                    r = &c->replicas[k];
    for (int32_t k = 0; k < c->n_replicas && !r; k++)
        if (c->replicas[k].drafter_node == self) {
            r = &c->replicas[k];
            s->drafter_of = k;
        }
    if (!r)
        return sh__cmd_fail("%s: node '%s' hosts no stage", script, name);
    const sh_config_model *cm = &c->models[r->model];
    struct stat sb;
    if (stat(cm->path, &sb) != 0)
        return sh__cmd_fail("%s: %s", cm->path, strerror(errno));
    // The plan needs the layer count: read it from the file before loading any stage.
    sh_llama *probe = NULL;
    sh_llama_load_opts po = {.first = 0, .last = 1};
    if (sh_llama_load(cm->path, &po, &probe, &e))
        return sh__cmd_fail("%s", e.msg);
    const sh_llama_hparams *hps[SH_CLUSTER_MAX_REPLICAS] = {NULL};
    sh_cluster_plan plan;
    if (c->n_models > SH_CLUSTER_MAX_REPLICAS)
        rc = sh__cmd_fail("%s: %d models; at most %d are supported", script, (int)c->n_models,
                          SH_CLUSTER_MAX_REPLICAS);
    else
        hps[r->model] = &probe->hp;
    if (!rc)
        rc = sh__cmd_report(sh__cluster_plan(c, script, hps, &plan, &ce), &ce);
    if (!rc)
        rc = sh__cmd_report(sh__cluster_model_ident(probe, cm->path, &s->self, &ce), &ce);
    sh_llama_destroy(probe);
    if (rc)
        return rc;
    snprintf(s->self.node, sizeof s->self.node, "%s", name);
    sh__cluster_ident_settings(&plan, self, &s->self);

    // No thread has started yet: every one (the backend's, the runtime's loops, NNG's) inherits
    // the priority set here, and the backend's compute threads lower themselves by compute_add.
    char who[96];
    snprintf(who, sizeof who, "node %s", name);
    sh__cmd_prio_apply(s->control_nice, who, true, &s->prio);
    sh_backend_cpu_opts bo = {.n_threads = threads, .nice = s->prio.compute_add};
    if (sh_backend_cpu_create(&bo, &s->be, &e))
        return (sh__cmd_fail("backend: %s", e.msg), 1);
    char kern[160];
    sh_backend_cpu_describe(s->be, kern, sizeof kern);
    fprintf(stderr, "shoal: node %s: cpu: %s\n", name, kern);
    // This node's stage actors, in plan order: each stage it holds whole, or its rank of the
    // stage's group.
    int32_t mine[SH_CLUSTER_MAX_STAGES], rank_of[SH_CLUSTER_MAX_STAGES];
    int32_t n_mine = 0;
    for (int32_t i = 0; i < plan.n_stages; i++) {
        int32_t rank = sh__cluster_rank_on(&plan, i, self);
        if (rank < 0)
            continue;
        rank_of[n_mine] = rank;
        mine[n_mine++] = i;
        const sh_cluster_replica_plan *rp = &plan.rep[plan.stage_replica[i]];
        node_stage *st = &s->st[s->n];
        // A rank of a group loads only its slices of the stage's layers (model/llama.h).
        sh_llama_load_opts lo = {.first = plan.first[i],
                                 .last = plan.last[i],
                                 .prefault = true,
                                 .tp_rank = plan.stage_tp[i] > 1 ? rank : 0,
                                 .tp_size = plan.stage_tp[i] > 1 ? plan.stage_tp[i] : 0};
        if (sh_llama_load(cm->path, &lo, &st->m, &e)) {
            if (plan.stage_tp[i] > 1)
                return sh__cmd_fail("node '%s': rank %d of stage %d's group of %d: %s", name,
                                    (int)rank, (int)i + 1, (int)plan.stage_tp[i], e.msg);
            return sh__cmd_fail("%s", e.msg);
        }
        s->n++;
        sh_llama_ctx_opts co = {.max_tokens = plan.step_tokens,
                                .max_seqs = plan.max_seqs,
                                // Rows for drafts when the script's batcher speculates.
                                .max_logits = sh__serve_max_logits(plan.max_seqs, plan.step_tokens,
                                                                   sh__cluster_spec_rows(c)),
                                .kv_tokens = rp->n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS,
                                .kv_type = c->kv.f32 ? SH_DTYPE_F32 : SH_DTYPE_F16};
        if (plan.stage_tp[i] > 1) {
            st->group = malloc(sizeof *st->group);
            if (!st->group)
                return (sh__cmd_fail("out of memory"), 1);
            rc = sh__cmd_report(sh__cluster_group(&plan, i, st->group, &ce), &ce);
            if (rc)
                return rc;
            st->co = co;
            // The group's largest call: the forward pass's (an all-reduce of a full step's hidden
            // rows, the logits' all-gather), or the stage's agreement on a step.
            size_t need = sh_llama_tp_coll_bytes(st->m, &co);
            st->coll = (sh_coll_opts){.timeout_ms = st->group->timeout_ms,
                                      .max_bytes = need > 4096 ? need : 4096,
                                      .shm_name = st->group->shm_name,
                                      .urls = st->group->url_of,
                                      .compress = (sh_coll_compress)st->group->compress,
                                      .hosts = st->group->hosts,
                                      .key = s->key.set ? s->key.k : NULL,
                                      .key_len = s->key.set ? sizeof s->key.k : 0,
                                      .tls = sh__cluster_tls(c, self, &s->tls)};
            continue;
        }
        if (sh_llama_ctx_create(st->m, s->be, &co, &st->ctx, &e))
            return (sh__cmd_fail("stage %d: %s", (int)i + 1, e.msg), 1);
        if (sh_llama_ctx_n_blocks(st->ctx) != rp->n_blocks)
            return (sh__cmd_fail("stage %d: the KV pool has %d blocks, the plan %d", (int)i + 1,
                                 (int)sh_llama_ctx_n_blocks(st->ctx), (int)rp->n_blocks),
                    1);
    }
    if (n_mine == 0 && !standby && s->drafter_of < 0)
        return sh__cmd_fail("%s: node '%s' hosts no stage", script, name);
    if (s->drafter_of >= 0 && (rc = drafter_load(s, &plan)) != 0)
        return rc;
    if (standby) {
        s->sb.plan = plan;
        s->sb.self = self;
        s->sb.path = cm->path;
        s->sb.model = r->model;
        s->sb.be = s->be;
        s->sb.ident = &s->self;
        rc = sh__standby_preload(&s->sb);
        if (rc)
            return rc;
    }

    sh_runtime_opts ro = {.node_id = (uint32_t)self + 1,
                          .name = c->nodes[self].name,
                          .n_loops = 2,
                          .log_level = sh__cmd_log_level(log_level)};
    if (sh_runtime_create(&ro, &s->rt, &e) || sh__serve_register(s->rt, &e) ||
        sh_runtime_register(s->rt, &sh__hello_vtable, &e))
        return (sh__cmd_fail("runtime: %s", e.msg), 1);
    // Actor ids follow spawn order: the hello actor, then the stages, all before the transport
    // (which spawns its own), so they land where every other node computes them.
    for (int32_t k = 0; k < n_mine; k++) {
        s->self.stages[k] = plan.rank_addr[mine[k]][rank_of[k]];
        s->self.slices[k] = sh__cluster_slice(&plan, mine[k], rank_of[k]);
    }
    s->self.n_stages = n_mine;
    // With a key, only nodes that proved it are served (the stages check each STEP and ACT),
    // and this node proves it to, and checks, each node that sends its stages ACT (the previous
    // stage's); it answers the front's HELLO only once those answered (actors/hello.h).
    bool keyed = s->key.set;
    s->auth.key = &s->key;
    s->auth.self = (uint32_t)self + 1;
    for (int32_t i = 0; i < c->n_nodes && i + 1 < SH_HELLO_MAX_NODES; i++)
        s->names[i + 1] = c->nodes[i].name;
    s->auth.names = s->names;
    s->auth.n_names = SH_HELLO_MAX_NODES;
    int32_t n_peers = 0;
    // The nodes that send this node's stage actors frames: the previous stage's (its leader's)
    // node, and a group's leader's node for its other ranks.
    int32_t from[SH_CLUSTER_MAX_STAGES];
    for (int32_t k = 0; k < n_mine; k++) {
        int32_t i = mine[k];
        const sh_cluster_replica_plan *rp = &plan.rep[plan.stage_replica[i]];
        // A first stage takes its STEPs from the replica's drafter's node when it has one.
        from[k] = rank_of[k] > 0   ? plan.rank_node[i][0]
                  : i > rp->stage0 ? plan.stage_node[i - 1]
                                   : rp->drafter_node;
    }
    for (int32_t k = 0; k < n_mine; k++) {
        int32_t prev = from[k];
        bool skip = prev < 0 || prev == self;
        for (int32_t j = 0; !skip && j < s->n_sources; j++)
            skip = s->sources[j] == (uint32_t)prev + 1;
        if (!skip)
            s->sources[s->n_sources++] = (uint32_t)prev + 1;
    }
    for (int32_t k = 0; keyed && k < n_mine; k++) {
        int32_t prev = from[k];
        sh_addr at = sh_addr_make((uint32_t)prev + 1, SH_CLUSTER_HELLO_ACTOR);
        bool skip = prev < 0 || prev == self;
        for (int32_t j = 0; !skip && j < n_peers; j++)
            skip = s->peers[j].addr == at;
        if (!skip)
            s->peers[n_peers++].addr = at;
    }
    sh_hello_args ha = {.self = &s->self,
                        .peers = n_peers ? s->peers : NULL,
                        .n_peers = n_peers,
                        .key = &s->key,
                        .auth = &s->auth,
                        .front = (uint32_t)plan.front + 1,
                        .on_shutdown = on_shutdown,
                        .shutdown_user = s,
                        .on_promote = standby ? sh__standby_promote : NULL,
                        .promote_user = &s->sb,
                        .greet_links = true,
                        .sources = s->sources,
                        .n_sources = s->n_sources};
    s->sb.rt = s->rt;
    sh_addr addr = 0;
    if (sh_actor_spawn(s->rt, "hello", &ha, 0, &addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    if (addr != sh_addr_make((uint32_t)self + 1, SH_CLUSTER_HELLO_ACTOR))
        return (sh__cmd_fail("internal: the hello actor got id %" PRIu64, (uint64_t)addr), 1);
    sh_stage_args sa[SH_CLUSTER_MAX_STAGES];
    for (int32_t k = 0; k < n_mine; k++) {
        int32_t i = mine[k];
        const sh_cluster_replica_plan *rp = &plan.rep[plan.stage_replica[i]];
        node_stage *st = &s->st[k];
        sa[k] = (sh_stage_args){.model = st->m,
                                .ctx = st->ctx,
                                .max_seqs = plan.max_seqs,
                                .max_blocks_per_seq = rp->seq_blocks,
                                .link_dtype = rp->link_dtype,
                                .next = sh__cluster_next_stage(&plan, i),
                                .auth = keyed ? &s->auth : NULL,
                                .control_node = (uint32_t)plan.front + 1,
                                .drafter_node = i == rp->stage0 && rp->drafter_node >= 0
                                                    ? (uint32_t)rp->drafter_node + 1
                                                    : 0};
        if (st->group) {
            sa[k].tp_rank = rank_of[k];
            sa[k].tp_size = plan.stage_tp[i];
            sa[k].tp_ranks = plan.rank_addr[i];
            sa[k].coll_kind = st->group->kind;
            sa[k].coll = &st->coll;
            sa[k].be = s->be;
            sa[k].ctx_opts = &st->co;
            sa[k].n_blocks = rp->n_blocks;
        }
        sh_addr want = plan.rank_addr[i][rank_of[k]];
        if (sh_actor_spawn(s->rt, "stage", &sa[k], 1, &addr, &e))
            return (sh__cmd_fail("spawn: %s", e.msg), 1);
        if (addr != want)
            return (sh__cmd_fail("internal: stage %d got address %" PRIu64 ", not %" PRIu64,
                                 (int)i + 1, (uint64_t)addr, (uint64_t)want),
                    1);
    }
    // The metrics reporter follows the stages (actors/cluster.h); it reports to the front.
    sh_node_metrics_reporter_args ra = {
        .collector = sh_addr_make((uint32_t)plan.front + 1, SH_CLUSTER_METRICS_ACTOR)};
    if (sh_actor_spawn(s->rt, "node_metrics_reporter", &ra, 0, &addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    if (addr != sh__cluster_metrics_reporter(&plan, self))
        return (sh__cmd_fail("internal: the metrics reporter got address %" PRIu64, (uint64_t)addr),
                1);
    const sh_cluster_replica_plan *drp = s->drafter_of >= 0 ? &plan.rep[s->drafter_of] : NULL;
    sh_drafter_args da = {.drafts = s->drafts,
                          .stage = drp ? plan.stage_addr[drp->stage0] : SH_ADDR_NONE,
                          .max_seqs = plan.max_seqs,
                          .auth = keyed ? &s->auth : NULL};
    if (drp && sh_actor_spawn(s->rt, "drafter", &da, 1, &addr, &e))
        return (sh__cmd_fail("spawn: %s", e.msg), 1);
    if (drp && addr != drp->drafter)
        return (sh__cmd_fail("internal: the drafter got address %" PRIu64, (uint64_t)addr), 1);
    sh_transport_tls tls;
    sh_transport_opts to = {.listen_url = c->nodes[self].listen,
                            .reconnect_max_ms = 250,
                            .tls = sh__cluster_tls(c, self, &tls),
                            .listen_resolve_ms = s->id.join_ms};
    // Every frame from another node acts only as the node its connection proved in HELLO
    // (runtime/peers.h): the front's greeting binds its connection, and each worker greets this
    // one over its own (greet_links).
    sh__peers_enforce(s->rt);
    if (sh_transport_create(s->rt, &to, &s->tp, &e))
        return (
            sh__cmd_fail("node '%s': cannot listen on %s: %s", name, c->nodes[self].listen, e.msg),
            e.code == SH_EBUSY || e.code == SH_ENOTFOUND ? 2 : 1);
    rc = sh__cmd_report(sh__cluster_add_peers(&plan, self, s->tp, &e), &e);
    if (!rc && s->fault_path)
        rc = sh__cmd_fault_start_epoch(&s->fault, s->fault_path, s->fault_epoch, c, s->rt, s->tp);
    snprintf(who, sizeof who, "node %s joined its front", name); /* READY=1 once it did */
    if (rc || (rc = sh__sdnotify_start(&s->sd, s->rt, (uint32_t)plan.front + 1, who)) != 0)
        return rc;
    char layers[512] = "";
    for (int32_t k = 0; k < n_mine; k++) {
        size_t l = strlen(layers);
        int32_t i = mine[k], rk = plan.stage_replica[i];
        char rep[32] = "";
        if (plan.n_replicas > 1)
            snprintf(rep, sizeof rep, "replica %d ", (int)rk + 1);
        char rank[64] = "";
        static const char *const cmps[3] = {"", ", f16 links", ", int8 links"};
        if (plan.stage_tp[i] > 1)
            snprintf(rank, sizeof rank, " (rank %d of %d, %s%s)", (int)rank_of[k],
                     (int)plan.stage_tp[i],
                     s->st[k].group->kind == SH_COLL_SHM   ? "shared memory"
                     : s->st[k].group->kind == SH_COLL_NET ? "network"
                                                           : "two levels",
                     cmps[s->st[k].group->compress]);
        snprintf(layers + l, sizeof layers - l, "%s%sstage %d layers [%d, %d)%s", k ? ", " : "",
                 rep, (int)(i - plan.rep[rk].stage0) + 1, (int)plan.first[i], (int)plan.last[i],
                 rank);
    }
    const char *dpath = drp ? c->replicas[s->drafter_of].drafter_path : NULL;
    if (drp && !dpath) // self-speculation: a drafter node holds no stage, layers is free
        snprintf(layers, sizeof layers, "its layers [0, %d) and head",
                 (int)c->replicas[s->drafter_of].drafter_self);
    if (drp)
        fprintf(stderr,
                "shoal: node %s serving replica %d's drafter of %s (draft %s, up to %d tokens a "
                "step) on %s\n",
                name, (int)s->drafter_of + 1, cm->name, dpath ? dpath : layers,
                (int)c->batcher.spec_k, c->nodes[self].listen);
    else if (standby)
        fprintf(stderr,
                "shoal: node %s serving nothing yet: a standby for %s's stages on %s (the front's "
                "watchdog promotes it when a stage node dies)\n",
                name, cm->name, c->nodes[self].listen);
    else
        fprintf(stderr,
                "shoal: node %s serving %s of %s on %s (KV %d blocks of %s per stage, %d sequences "
                "x %d tokens per step%s)\n",
                name, layers, cm->name, c->nodes[self].listen,
                (int)plan.rep[plan.stage_replica[mine[0]]].n_blocks, c->kv.f32 ? "f32" : "f16",
                (int)plan.max_seqs, (int)plan.step_tokens, keyed ? "; cluster key set" : "");
    fflush(stderr);
    int sig = 0;
    while (sigwait(sigs, &sig) == 0 && sig == SIGHUP) {
    }
    sh__sdnotify_send(&s->sd, "STOPPING=1\nSTATUS=node %s stopping", name);
    if (atomic_load_explicit(&s->restart, memory_order_acquire) == 1) {
        fprintf(stderr, "shoal: node %s: the front asked for a restart: %s; exiting %d\n", name,
                s->restart_why, SH_NODE_EXIT_RESTART);
        return SH_NODE_EXIT_RESTART;
    }
    fprintf(stderr, "shoal: node %s: %s, stopping\n", name,
            sig == SIGINT ? "interrupted" : "terminated");
    return 0;
}

int sh__cmd_node(int argc, char **argv)
{
    const char *script = NULL, *log_level = NULL, *fault_path = NULL;
    const char *fault_epoch = NULL;
    sh_node_identity id = {.join_ms = SH_REPLICA_JOIN_TIMEOUT_MS};
    int64_t threads = 0, control_nice = -1; /* not given */
    const char *key_file = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        int ir = sh__node_identity_flag(&id, argc, argv, &i);
        if (ir != 1) {
            if (ir)
                return 2;
            continue;
        }
        if (strcmp(a, "-c") && strcmp(a, "-t") && strcmp(a, "--log-level") &&
            strcmp(a, "--fault-scenario") && strcmp(a, "--fault-epoch") &&
            strcmp(a, "--control-nice") && strcmp(a, "--cluster-key-file"))
            return sh__cmd_fail("unknown option '%s' (see shoal node --help)", a);
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value (see shoal node --help)", a);
        const char *v = argv[++i];
        if (!strcmp(a, "-c"))
            script = v;
        else if (!strcmp(a, "--cluster-key-file"))
            key_file = v;
        else if (!strcmp(a, "--log-level"))
            log_level = v;
        else if (!strcmp(a, "--fault-scenario"))
            fault_path = v;
        else if (!strcmp(a, "--fault-epoch"))
            fault_epoch = v;
        else if (!strcmp(a, "--control-nice")) {
            if (!sh__cmd_parse_i64(v, 0, 19, &control_nice))
                return sh__cmd_fail("bad value '%s' for --control-nice: want a whole number from "
                                    "0 to 19",
                                    v);
        } else if (!sh__cmd_parse_i64(v, 1, 1024, &threads))
            return sh__cmd_fail("bad value '%s' for -t: want a whole number from 1 to 1024", v);
    }
    if (!script)
        return sh__cmd_fail("shoal node needs -c CLUSTER.lua (see shoal node --help)");
    if (sh__node_identity_check(id.name, id.from, true, "shoal node"))
        return 2;
    sigset_t sigs;
    sh__cmd_block_signals(&sigs, 0);
    node_state s;
    memset(&s, 0, sizeof s);
    s.drafter_of = -1;
    s.key_file = key_file;
    s.id = id;
    sh__sdnotify_open(&s.sd); /* NOTIFY_SOCKET: before any thread starts */
    if (sh__cmd_fault_epoch_check(fault_epoch))
        return 2;
    s.control_nice = (int32_t)control_nice;
    s.fault_path = fault_path;
    s.fault_epoch = fault_epoch;
    int rc = run(&s, script, id.name, (int32_t)threads, log_level, &sigs);
    close_all(&s);
    return rc;
}
