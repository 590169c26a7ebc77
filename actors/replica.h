/* The one replica builder and the one teardown (CONVENTIONS.md, "Modules"): what `shoal serve`
 * (tools/cmd_serve.c) and the embedding API (api/engine.c, api/engine_front.c) spawn to serve a
 * model (each replica's kvmgr and batcher, its stage when the replica runs in this process, a
 * router before the replicas of a model that has several, and the REROUTE that tells each router
 * its batchers), the defaults they share, and the order in which whatever serves them is freed.
 * The actors themselves are in actors/serve.h and actors/router.h. */
#ifndef SH_ACTORS_REPLICA_H
#define SH_ACTORS_REPLICA_H

#include <stdbool.h>
#include <stdint.h>

#include "actors/cluster.h"
#include "actors/router.h"
#include "actors/serve.h"
#include "kernels/backend.h"

/* max_queue when 0: requests that may wait on a replica beyond the ones it runs. */
#define SH_REPLICA_MAX_QUEUE 256
/* step_timeout_ms when 0 and the stages are on worker nodes: a step not answered in 30 s fails
 * its requests (a dead node's step is never answered). In one process the default is none. */
#define SH_REPLICA_STEP_TIMEOUT_MS 30000u
/* step_timeout_ms that asks for no step timeout at all (the batcher's 0). */
#define SH_REPLICA_STEP_TIMEOUT_NONE UINT32_MAX
/* How long a front waits for every worker node to join (sh__cluster_front_start) unless told
 * otherwise (`shoal serve --join-timeout`). */
#define SH_REPLICA_JOIN_TIMEOUT_MS 60000u
/* How often a batcher behind a router reports its load to it (sh_batcher_args.report_ms). */
#define SH_REPLICA_REPORT_MS 250u

/* What to build. Zero fields take the defaults above (or the actors' own). */
typedef struct sh_replica_opts {
    /* A cluster front: the replicas of front->plan (joined), their stages on worker nodes; a
     * router watches front->down. models[i] and toks[i] are the script's model i (hyper-parameters
     * and tokenizer; only the models some replica serves need be set). NULL: one replica in this
     * process, below. */
    sh_cluster_front *front;
    const sh_llama *const *models;
    const sh_tokenizer *const *toks;
    /* One replica in this process (front NULL): the whole model on one stage over ctx, sized by
     * sh__serve_size (n_blocks from the context, sh_llama_ctx_n_blocks). */
    const sh_llama *model;
    sh_llama_ctx *ctx;
    const sh_tokenizer *tok;
    int32_t n_ctx, max_seqs, step_tokens;
    int64_t n_blocks;
    /* Optional (speculative decoding with a draft model, one process): the batcher's STEPs go
     * through a drafter actor over drafts (actors/serve.h), which must outlive the runtime. */
    struct sh_spec_drafts *drafts;
    /* Both. */
    int32_t max_wait_ms; /* 0: the batcher's 50 */
    /* Requests that may wait on each replica beyond the ones it runs: its batcher refuses SUBMIT
     * (429, or SH_EBUSY to an engine) once it holds max_queue + max_seqs requests. 0:
     * SH_REPLICA_MAX_QUEUE. */
    int32_t max_queue;
    bool no_prefix_cache;
    /* Speculative decoding in every replica's batcher (sh_batcher_args.spec, spec_k): SH_SPEC_OFF
     * (0) or SH_SPEC_NGRAM; spec_k 0: SH_SPEC_DEFAULT_K. */
    sh_spec_kind spec;
    int32_t spec_k;
    int32_t max_logits; /* the stages' contexts' max_logits (sh_batcher_args.max_logits) */
    /* 0: SH_REPLICA_STEP_TIMEOUT_MS with worker nodes, none in one process;
     * SH_REPLICA_STEP_TIMEOUT_NONE: none; else milliseconds (sh_batcher_args.step_timeout_ms). */
    uint32_t step_timeout_ms;
    /* The routers' settings (sh_router_args; 0: the router's defaults). */
    uint32_t router_refresh_ms, redispatch_ms;
    double affinity_slack;
    uint32_t loop; /* the loop of the kvmgrs, batchers and stage; the routers run on loop 0 */
} sh_replica_opts;

/* What was built. The spawn arguments live here because each must outlive its actor's init
 * (which runs later, on the actor's loop): the set lives until after the runtime is destroyed
 * (sh__replica_teardown frees it then). */
typedef struct sh_replica_set {
    int32_t n_replicas;
    sh_addr kvmgr[SH_CLUSTER_MAX_REPLICAS], batcher[SH_CLUSTER_MAX_REPLICAS];
    sh_addr stage;   /* one process: the replica's stage; SH_ADDR_NONE on a front */
    sh_addr drafter; /* one process with drafts: the drafter before the stage; else NONE */
    /* The models served, in the order their first replica comes in the script (one in one
     * process): model[j] is the script's model index, n_of[j] its replicas, ids[j] their indices;
     * router[j] the router before them (when it has several, or when there are several models: a
     * router answers for a model whose replicas all lost a node; else SH_ADDR_NONE) and target[j]
     * where its requests go (its router, or its only replica's batcher). */
    int32_t n_models;
    int32_t model[SH_CLUSTER_MAX_REPLICAS], n_of[SH_CLUSTER_MAX_REPLICAS];
    int32_t ids[SH_CLUSTER_MAX_REPLICAS][SH_CLUSTER_MAX_REPLICAS];
    /* Their shapes, as the router takes them (sh_router_args.tp, .stages). */
    int32_t tp[SH_CLUSTER_MAX_REPLICAS][SH_CLUSTER_MAX_REPLICAS];
    int32_t n_stages[SH_CLUSTER_MAX_REPLICAS][SH_CLUSTER_MAX_REPLICAS];
    sh_addr router[SH_CLUSTER_MAX_REPLICAS], target[SH_CLUSTER_MAX_REPLICAS];
    /* The spawn arguments (read by the inits). */
    sh_kvmgr_args ka[SH_CLUSTER_MAX_REPLICAS];
    sh_batcher_args ba[SH_CLUSTER_MAX_REPLICAS];
    sh_router_args ra[SH_CLUSTER_MAX_REPLICAS];
    sh_stage_args sa;
    sh_drafter_args da;
    char labels[SH_CLUSTER_MAX_REPLICAS][32]; /* replica="k" with several replicas */
} sh_replica_set;

/* Spawns on rt (which has the kinds of sh__serve_register; the router's is registered here when
 * needed): the routers first (so the batchers report to them from the start), then per replica its
 * stage (one process; with drafts, a drafter before it, which the batcher sends its STEPs to),
 * kvmgr and batcher, each replica's series labelled replica="k" when there
 * are several; then one CONTROL op REROUTE to each router with its batchers, before any request.
 * *out is set as soon as the set is allocated, also when a later step fails: actors already
 * spawned read it, so the caller frees it only after the runtime (sh__replica_teardown). Returns
 * SH_OK, or SH_ENOMEM, SH_EINVAL (a front with more replicas than SH_CLUSTER_MAX_REPLICAS) or the
 * spawn's or the send's error, with e filled. Not from a loop thread. */
sh_err sh__replica_start(sh_runtime *rt, const sh_replica_opts *o, sh_replica_set **out,
                         sh_error *e);

/* What serves the replicas, freed by sh__replica_teardown in this order:
 *   1. stop_faults(faults_ud): fault layers and scenario runners, before the transport closes;
 *   2. the front's transport is closed (sh__cluster_front_close), so no frame arrives any more;
 *   3. the runtime is destroyed (every actor stopped: nothing reads the models after it);
 *   4. the front is destroyed and freed; the replica set is freed;
 *   5. after_runtime(after_ud): the owner's part that needs the runtime gone and the models alive
 *      (an engine ends its requests, whose callbacks may still ask about the model);
 *   6. the context, the backend, the tokenizers and the models.
 * Every pointer member points at the owner's field; each field is set to NULL once freed (so the
 * hooks see what is left). Any member may be NULL, and any field NULL. */
typedef struct sh_replica_owned {
    void (*stop_faults)(void *ud);
    void *faults_ud;
    sh_cluster_front **front; /* heap (calloc), freed here */
    sh_runtime **rt;
    sh_replica_set **set;
    void (*after_runtime)(void *ud);
    void *after_ud;
    sh_llama_ctx **ctx;
    sh_backend **be;
    sh_tokenizer **tok;
    sh_llama **m;
    /* n_more further models and their tokenizers (a front serving several models). */
    sh_tokenizer **more_tok;
    sh_llama **more_m;
    int32_t n_more;
} sh_replica_owned;

/* Frees what o points at, in the order above. Not from a loop thread of the runtime. */
void sh__replica_teardown(const sh_replica_owned *o);

#endif
