/* The one replica builder and the one teardown (actors/replica.h): `shoal serve` and the
 * embedding API assemble their replicas and free what serves them here, written once. */
#include <stdio.h>
#include <stdlib.h>

#include "actors/actor_util.h"
#include "actors/replica.h"
#include "base/error.h"

/* lua/config.h spells batcher.spec's values and spec_k's bounds without model/spec.h. */
_Static_assert(SH_CONFIG_SPEC_OFF == SH_SPEC_OFF && SH_CONFIG_SPEC_NGRAM == SH_SPEC_NGRAM &&
                   SH_CONFIG_SPEC_DEFAULT_K == SH_SPEC_DEFAULT_K &&
                   SH_CONFIG_SPEC_MAX_K == SH_SPEC_MAX_K,
               "lua/config.h's speculation constants differ from model/spec.h's");

/* Groups the replicas by the model they serve, in the order each model's first replica comes. */
static void group_models(sh_replica_set *r, const sh_cluster_plan *plan)
{
    for (int32_t k = 0; k < r->n_replicas; k++) {
        int32_t mi = plan ? plan->rep[k].model : 0, j = 0;
        while (j < r->n_models && r->model[j] != mi)
            j++;
        if (j == r->n_models)
            r->model[r->n_models++] = mi;
        r->ids[j][r->n_of[j]++] = k;
    }
}

/* A router before model j's replicas when it has several, or when there are several models. */
static sh_err spawn_routers(sh_runtime *rt, const sh_replica_opts *o, sh_replica_set *r,
                            sh_error *e)
{
    bool registered = false;
    for (int32_t j = 0; j < r->n_models; j++) {
        if (r->n_of[j] < 2 && r->n_models < 2)
            continue;
        const sh_cluster_plan *plan = o->front ? &o->front->plan : NULL;
        for (int32_t i = 0; plan && i < r->n_of[j]; i++) {
            const sh_config_replica *cr = &plan->c->replicas[r->ids[j][i]];
            r->tp[j][i] = cr->tp;
            r->n_stages[j][i] = cr->n_stages;
        }
        r->ra[j] = (sh_router_args){.n_replicas = r->n_of[j],
                                    .tp = plan ? r->tp[j] : NULL,
                                    .stages = plan ? r->n_stages[j] : NULL,
                                    .routing = plan ? &plan->c->routing : NULL,
                                    .model = plan ? plan->c->models[r->model[j]].name : NULL,
                                    .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS,
                                    .weight_refresh_ms = o->router_refresh_ms,
                                    .redispatch_ms = o->redispatch_ms,
                                    .affinity_slack = o->affinity_slack,
                                    .down = o->front ? o->front->down : NULL,
                                    .ids = r->ids[j]};
        sh_err rc;
        if ((!registered && (rc = sh_runtime_register(rt, &sh__router_vtable, e))) ||
            (rc = sh_actor_spawn(rt, "router", &r->ra[j], 0, &r->router[j], e)))
            return rc;
        registered = true;
    }
    return SH_OK;
}

/* Fills the kvmgr and batcher arguments of replica k (and, in one process, the stage's; the
 * batcher's stage is then the caller's to set once it is spawned). */
static void replica_args(const sh_replica_opts *o, sh_replica_set *r, int32_t k, int32_t max_queue)
{
    const sh_cluster_plan *plan = o->front ? &o->front->plan : NULL;
    uint32_t step_timeout = o->step_timeout_ms;
    if (step_timeout == SH_REPLICA_STEP_TIMEOUT_NONE)
        step_timeout = 0; /* the batcher's "none" */
    else if (!step_timeout && plan)
        step_timeout = SH_REPLICA_STEP_TIMEOUT_MS;
    const sh_llama_hparams *hp;
    const sh_tokenizer *tok;
    int32_t n_ctx, max_seqs, step_tokens, n_blocks, seq_blocks, n_stages = 0;
    if (plan) {
        const sh_cluster_replica_plan *rp = &plan->rep[k];
        hp = &o->models[rp->model]->hp;
        tok = o->toks[rp->model];
        n_ctx = rp->n_ctx;
        max_seqs = plan->max_seqs;
        step_tokens = plan->step_tokens;
        n_blocks = rp->n_blocks;
        seq_blocks = rp->seq_blocks;
        n_stages = rp->n_stages;
    } else {
        hp = &o->model->hp;
        tok = o->tok;
        n_ctx = o->n_ctx;
        max_seqs = o->max_seqs;
        step_tokens = o->step_tokens;
        n_blocks = (int32_t)o->n_blocks;
        seq_blocks = sh__serve_seq_blocks(hp, n_ctx, n_blocks);
        r->sa = (sh_stage_args){.model = o->model,
                                .ctx = o->ctx,
                                .max_seqs = max_seqs,
                                .max_blocks_per_seq = seq_blocks};
    }
    int32_t window = sh_llama_kv_window(hp);
    r->ka[k] = (sh_kvmgr_args){.cfg = {.n_blocks = n_blocks,
                                       .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS,
                                       .max_seqs = max_seqs,
                                       .window = window,
                                       .max_blocks_per_seq = seq_blocks},
                               .prefix_cache = !o->no_prefix_cache};
    // A replica's drafter on its own node (replica{ drafter = ... }) takes the batcher's STEPs
    // in front of the first stage, and the replica drafts with it whatever batcher.spec says.
    sh_addr drafter = plan ? plan->rep[k].drafter : SH_ADDR_NONE;
    sh_addr first = plan ? plan->stage_addr[plan->rep[k].stage0] : SH_ADDR_NONE;
    bool spec_rows = plan && sh__cluster_spec_rows(plan->c);
    r->ba[k] = (sh_batcher_args){
        .stage = drafter ? drafter : first,
        .tok = tok,
        .n_vocab = hp->n_vocab,
        .n_ctx = n_ctx,
        .max_step_tokens = step_tokens,
        .max_seqs = max_seqs,
        .max_wait_ms = o->max_wait_ms,
        .max_queue = max_queue + max_seqs, /* those waiting and those running */
        .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS,
        .n_blocks = n_blocks,
        .seq_blocks = window > 0 ? 0 : seq_blocks,
        .step_timeout_ms = step_timeout,
        .max_inflight = n_stages, /* one step in flight per stage */
        .spec = drafter ? SH_SPEC_DRAFT : o->spec,
        .spec_k = o->spec_k,
        // Worker nodes size their contexts' rows of logits by the script's batcher.spec and
        // drafters.
        .max_logits =
            plan ? sh__serve_max_logits(max_seqs, step_tokens, spec_rows) : o->max_logits};
    if (r->n_replicas > 1) {
        snprintf(r->labels[k], sizeof r->labels[k], "replica=\"%d\"", (int)k);
        r->ka[k].metric_labels = r->labels[k];
        r->ba[k].metric_labels = r->labels[k];
    }
}

sh_err sh__replica_start(sh_runtime *rt, const sh_replica_opts *o, sh_replica_set **out,
                         sh_error *e)
{
    *out = NULL;
    const sh_cluster_plan *plan = o->front ? &o->front->plan : NULL;
    if (plan && (plan->n_replicas < 1 || plan->n_replicas > SH_CLUSTER_MAX_REPLICAS))
        return sh__error_set(e, SH_EINVAL, "%d replicas: 1 to %d are supported",
                             (int)plan->n_replicas, SH_CLUSTER_MAX_REPLICAS);
    sh_replica_set *r = calloc(1, sizeof *r);
    if (!r)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    *out = r;
    r->n_replicas = plan ? plan->n_replicas : 1;
    group_models(r, plan);
    sh_err rc = spawn_routers(rt, o, r, e);
    if (rc)
        return rc;
    int32_t max_queue = o->max_queue > 0 ? o->max_queue : SH_REPLICA_MAX_QUEUE;
    for (int32_t j = 0; j < r->n_models; j++)
        for (int32_t i = 0; i < r->n_of[j]; i++) {
            int32_t k = r->ids[j][i];
            replica_args(o, r, k, max_queue);
            if (!plan) {
                if ((rc = sh_actor_spawn(rt, "stage", &r->sa, o->loop, &r->stage, e)))
                    return rc;
                r->ba[k].stage = r->stage;
                if (o->drafts) {
                    r->da = (sh_drafter_args){.drafts = o->drafts,
                                              .stage = r->stage,
                                              .max_seqs = r->ba[k].max_seqs,
                                              .block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS};
                    if ((rc = sh_actor_spawn(rt, "drafter", &r->da, o->loop, &r->drafter, e)))
                        return rc;
                    r->ba[k].stage = r->drafter;
                }
            }
            r->ba[k].router = r->router[j];
            r->ba[k].report_ms = r->router[j] ? SH_REPLICA_REPORT_MS : 0;
            if ((rc = sh_actor_spawn(rt, "kvmgr", &r->ka[k], o->loop, &r->kvmgr[k], e)))
                return rc;
            r->ba[k].kvmgr = r->kvmgr[k];
            if ((rc = sh_actor_spawn(rt, "batcher", &r->ba[k], o->loop, &r->batcher[k], e)))
                return rc;
        }
    // Each model's requests go to its router, which learns its batchers now, before any request.
    for (int32_t j = 0; j < r->n_models; j++) {
        r->target[j] = r->batcher[r->ids[j][0]];
        if (!r->router[j])
            continue;
        uint64_t targets[SH_CLUSTER_MAX_REPLICAS];
        for (int32_t i = 0; i < r->n_of[j]; i++)
            targets[i] = r->batcher[r->ids[j][i]];
        sh_proto_control ctl = {.op = SH_PROTO_CONTROL_OP_REROUTE,
                                .targets = {targets, (uint32_t)r->n_of[j]}};
        if ((rc = sh__act_send(rt, r->router[j], r->router[j], SH_MSG_CONTROL, 0, &ctl, e)))
            return rc;
        r->target[j] = r->router[j];
    }
    return SH_OK;
}

void sh__replica_teardown(const sh_replica_owned *o)
{
    if (o->stop_faults)
        o->stop_faults(o->faults_ud); /* before the transport closes */
    if (o->front && *o->front)
        sh__cluster_front_close(*o->front);
    if (o->rt) {
        sh_runtime_destroy(*o->rt); /* stops the actors first: nothing uses the models after it */
        *o->rt = NULL;
    }
    if (o->front && *o->front) {
        sh__cluster_front_destroy(*o->front);
        free(*o->front);
        *o->front = NULL;
    }
    if (o->set) {
        free(*o->set);
        *o->set = NULL;
    }
    if (o->after_runtime)
        o->after_runtime(o->after_ud);
    if (o->ctx) {
        sh_llama_ctx_destroy(*o->ctx);
        *o->ctx = NULL;
    }
    if (o->be) {
        sh_backend_destroy(*o->be);
        *o->be = NULL;
    }
    if (o->tok) {
        sh_tokenizer_destroy(*o->tok);
        *o->tok = NULL;
    }
    if (o->m) {
        sh_llama_destroy(*o->m);
        *o->m = NULL;
    }
    for (int32_t i = 0; i < o->n_more; i++) {
        sh_tokenizer_destroy(o->more_tok[i]);
        o->more_tok[i] = NULL;
        sh_llama_destroy(o->more_m[i]);
        o->more_m[i] = NULL;
    }
}
