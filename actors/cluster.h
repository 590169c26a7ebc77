/* What `shoal node` and `shoal serve -c` share about a cluster script: the plan of one replica
 * whose pipeline stages sit on worker nodes (node ids, actor addresses, stage settings), and the
 * front's join of the workers (issue 11, docs/cluster.md). */
#ifndef SH_ACTORS_CLUSTER_H
#define SH_ACTORS_CLUSTER_H

#include <stdbool.h>
#include <stdint.h>

#include "actors/hello.h"
#include "actors/node_metrics.h"
#include "lua/config.h"
#include "model/llama.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

#define SH_CLUSTER_MAX_STAGES 64 /* over all replicas */
#define SH_CLUSTER_MAX_REPLICAS 16

/* Node i of the script is runtime node id i + 1. On every worker node the hello actor is actor 1
 * and the node's stages follow as actors 2, 3, ... in the order of the plan (replica by replica,
 * each in pipeline order), so every node computes every address from the script alone. The
 * front's hello actor comes after its metrics collector and its transport's I/O actor; nobody
 * addresses it (workers answer its requests). */
#define SH_CLUSTER_HELLO_ACTOR 1u
#define SH_CLUSTER_FIRST_STAGE_ACTOR 2u
/* Per-node metrics (actors/node_metrics.h): on the front, the metrics collector is actor 1:
 * sh__cluster_front_start() spawns it first, before the transport (whose I/O actor takes the next
 * id) and the hello actor. On a worker, the reporter follows the node's stages (actor 2 + its
 * stage count, sh__cluster_metrics_reporter()), before the transport. */
#define SH_CLUSTER_METRICS_ACTOR 1u
/* A replica's drafter (replica{ drafter = ... }) runs on a worker node that holds nothing else:
 * its hello actor is actor 1, its metrics reporter actor 2 and the drafter actor 3. */
#define SH_CLUSTER_DRAFTER_ACTOR 3u

/* One replica of the plan: its stages are plan.stage_*[stage0, stage0 + n_stages). */
typedef struct sh_cluster_replica_plan {
    int32_t stage0, n_stages;
    int32_t model;           /* the script's model index (c->models) */
    int32_t n_layers, n_ctx; /* the model's layer count and context; 0 when its hyper-parameters
                              * were not given (the plan then only places the stages) */
    uint64_t model_size;     /* the model file's identity when the front filled it (HELLO), */
    uint64_t model_hash;     /* 0 otherwise */
    int32_t n_blocks, seq_blocks; /* KV blocks of every stage's pool; block-table length */
    uint64_t block_bytes;         /* KV bytes of one block of the replica's largest stage */
    uint32_t link_dtype;          /* replica link_dtype: the SH_PROTO_DTYPE_* stages send ACT in */
    /* The replica's drafter (replica{ drafter = ... }): its node and address, where the batcher
     * sends its STEPs; -1 and SH_ADDR_NONE when it has none. */
    int32_t drafter_node;
    sh_addr drafter;
} sh_cluster_replica_plan;

typedef struct sh_cluster_plan {
    const sh_cluster_config *c;
    int32_t front;    /* the gateway's node */
    int32_t n_stages; /* every replica's stages */
    /* A stage's node and address are its group's leader's (rank 0): the batcher or the previous
     * stage sends it STEP or ACT, and the watchdog and the supervisor see the stage there. */
    int32_t stage_node[SH_CLUSTER_MAX_STAGES], stage_replica[SH_CLUSTER_MAX_STAGES];
    int32_t first[SH_CLUSTER_MAX_STAGES], last[SH_CLUSTER_MAX_STAGES];
    sh_addr stage_addr[SH_CLUSTER_MAX_STAGES];
    /* Tensor parallelism (docs/cluster.md): stage i runs on stage_tp[i] ranks (1: one node),
     * rank r on node rank_node[i][r] as the actor rank_addr[i][r] (rank 0: stage_node[i],
     * stage_addr[i]). On every node, the stage actors of every rank it holds are numbered in plan
     * order (stage by stage, rank by rank). A promotion moves a rank to a standby (rank_node,
     * rank_addr; for rank 0 stage_node and stage_addr too), each store atomic. */
    int32_t stage_tp[SH_CLUSTER_MAX_STAGES];
    int32_t rank_node[SH_CLUSTER_MAX_STAGES][SH_CONFIG_MAX_TP];
    sh_addr rank_addr[SH_CLUSTER_MAX_STAGES][SH_CONFIG_MAX_TP];
    int32_t n_replicas;
    sh_cluster_replica_plan rep[SH_CLUSTER_MAX_REPLICAS];
    /* Settings shared by every stage and by the front's batchers and kvmgrs. */
    int32_t max_seqs, step_tokens;
} sh_cluster_plan;

/* Errors. Every function below that can refuse writes its one error line into e (never to stdout
 * or stderr: this is library code; the shoal program prints it) and returns 2 (a refused script,
 * model or peer) or 1 (an internal failure), 0 on success. */

/* Receives one progress line of the front's join ("node w0 joined (...)"), without a newline.
 * Called on the joining thread. */
typedef void (*sh_cluster_note_fn)(void *ud, const char *line);

/* Refuses what is not built yet with one error line naming it (returns 2): a worker node that
 * holds stages of two different models, more than SH_CLUSTER_MAX_REPLICAS replicas, a standby
 * that could not take a tensor-parallel rank's place (another URL scheme than the group's ranks,
 * or off this host while they exchange through shared memory), a stage on the gateway's node beside
 * worker stages, inproc:// URLs, tls+tcp:// on some nodes only or without tls_ca, tls_cert and
 * tls_key, a node that hosts nothing, a drafter on a node that holds anything else (a stage, the
 * gateway, a standby or another drafter), more than SH_CLUSTER_MAX_STAGES stages. Returns 0 when
 * supported. `script` names the file in messages. */
int sh__cluster_check(const sh_cluster_config *c, const char *script, sh_error *e);

/* The TLS material of node `node` when the script's nodes listen on tls+tcp:// (its tls_cert and
 * tls_key, the cluster's tls_ca; sh__cluster_check made sure they are given), written into *out
 * and returned; NULL for any other scheme. */
const sh_transport_tls *sh__cluster_tls(const sh_cluster_config *c, int32_t node,
                                        sh_transport_tls *out);

/* Fills the plan from the script and each model's hyper-parameters (hp[i] of the script's model
 * i, c->n_models entries): resolves even splits, checks that each replica's layer ranges cover [0,
 * n_layers) without gap or overlap, and derives each replica's KV block count from kv.memory_bytes
 * (default 1 GiB per stage) over its largest stage. A replica whose model's hp[i] is NULL (a worker
 * without that model) is only placed: its stages' nodes and addresses, which follow from the script
 * alone; its layers and KV sizes stay 0. Returns 0, or 2 with an error line. */
int sh__cluster_plan(const sh_cluster_config *c, const char *script,
                     const sh_llama_hparams *const *hp, sh_cluster_plan *p, sh_error *e);

/* The model file's identity (size and header hash); 2 with an error line for a non-GGUF model. */

/* Fills the stage settings of node's HELLO identity: the replica of its first stage (n_blocks,
 * seq_blocks, link_dtype, and the model identity when the plan holds it) and the plan's shared
 * ones. */
void sh__cluster_ident_settings(const sh_cluster_plan *p, int32_t node, sh_hello_ident *id);

/* The replica of stage i's successor in its pipeline, or SH_ADDR_NONE for a last stage. */
sh_addr sh__cluster_next_stage(const sh_cluster_plan *p, int32_t i);
int sh__cluster_model_ident(const sh_llama *m, const char *path, sh_hello_ident *id, sh_error *e);

/* The address of node's metrics reporter, or SH_ADDR_NONE for a node without stages. */
sh_addr sh__cluster_metrics_reporter(const sh_cluster_plan *p, int32_t node);

/* Adds every other node that hosts a stage or the gateway as a transport peer. Returns 0 or 2. */
int sh__cluster_add_peers(const sh_cluster_plan *p, int32_t self, sh_transport *tp, sh_error *e);

/* The front's join: greets every worker node through a hello actor spawned on rt (rt must have
 * its transport and peers) and waits until each has answered, passing "node NAME joined
 * (...)" per node to note (may be NULL). A worker that fails the cluster key (`key`, may be NULL:
 * none; a wrong key, or a key on one side only) or whose identity differs from `self` is refused
 * with an error naming it and what differs. `peers` (at least c->n_nodes entries), `self` and `key`
 * must outlive rt: the actor keeps them. Returns 0 when all joined, 2 on a refusal or when
 * timeout_ms passes (the error names the nodes still missing, each with its link's last error from
 * tp when tp is not NULL), 1 when the actor cannot be spawned. Not from a loop thread. */
int sh__cluster_join(const sh_cluster_plan *p, sh_runtime *rt, const sh_hello_ident *self,
                     sh_hello_peer *peers, uint32_t timeout_ms, const sh_auth_key *key,
                     sh_transport *tp, sh_cluster_note_fn note, void *note_ud, sh_error *e);

/* The front's side of a cluster: its plan, its identity, the workers' answers and its transport.
 * Lives until after the runtime is destroyed (the hello actor reads self and peers). */
typedef struct sh_cluster_front {
    sh_cluster_plan plan;
    sh_hello_ident self;
    sh_hello_peer peers[256];
    sh_auth_key key;         /* the cluster key: set (or left zeroed: none) before the start */
    sh_cluster_note_fn note; /* the join's progress lines (set before the start; NULL: none) */
    void *note_ud;
    sh_transport *tp;
    uint64_t ups[256]; /* per node: its link's connection count when the join completed; __atomic_*
                        * like lost[] (the gateway's status reads it) */
    sh_node_metrics_collector_args collector_args; /* read by the collector's init, later */
    bool lost[256]; /* per node: judged lost (the watchdog's death, until it is back); written
                     * and read with __atomic_* (the supervisor's thread, the gateway's) */
    /* sh__cluster_front_rejoin's greetings, per node (a hello actor keeps pointers to them). */
    sh_hello_peer rejoin[256];
    sh_hello_args rejoin_args[256];
    int down[SH_CLUSTER_MAX_REPLICAS]; /* per replica, atomic: 0 serving, 1 paused (a stage
                                        * node is awaited), 2 removed; the router reads it */
    /* The workers' latest metrics reports, rendered by the gateway's /metrics; its collector
     * actor reads it too (created by sh__cluster_front_start, freed by ..._front_destroy). */
    struct sh_node_metrics *metrics;
} sh_cluster_front;

/* The exit status of `shoal serve -c` after it lost a worker node (the watchdog judged it dead):
 * the replica stopped, an orchestrator should restart the whole cluster. */
#define SH_CLUSTER_EXIT_LOST 3

/* The exit status of `shoal node` when the front's watchdog asked it to restart (it was over its
 * memory budget): `shoal cluster up` starts it again at once, without backoff (EX_TEMPFAIL). */
#define SH_NODE_EXIT_RESTART 75

/* Starts the front on rt (node id gateway.node + 1): plans from the models (models[i] of the
 * script's model i, c->n_models entries, each loaded from c->models[i].path; NULL for a model no
 * replica serves; the front loads only what it needs for hyper-parameters and the tokenizer),
 * listens on the gateway node's URL, dials every worker and joins them (sh__cluster_join), then
 * notes each worker link's connection count (the watchdog's base_ups). Returns 0, 2 (bad script,
 * mismatch, timeout: the error line in e) or 1. Not from a loop thread. */
int sh__cluster_front_start(sh_cluster_front *f, const sh_cluster_config *c, const char *script,
                            const sh_llama *const *models, sh_runtime *rt, uint32_t timeout_ms,
                            sh_error *e);

/* Greets a lost worker node again once its link is up on a new connection (the process was
 * restarted): a fresh hello actor for that node, up to timeout_ms for its answer, then the join's
 * key and identity checks. Returns 0 when it answered as the plan expects (the node counts as
 * joined again: its connection count is recorded and it is no longer lost), 1 when it is not back
 * yet or did not answer in time (try again later), 2 when it answered and is refused (msg says
 * why). Its stages' KV pools are empty: the replica must recompute what it held (a batcher
 * PAUSE before, RESUME after). Not from a loop thread; one thread at a time. */
int sh__cluster_front_rejoin(sh_cluster_front *f, sh_runtime *rt, int32_t node, uint32_t timeout_ms,
                             char *msg, size_t cap);

/* Promotes standby node sb in place of node dead (issue 12): sends the standby's hello actor
 * CONTROL op PROMOTE (from `as`, an actor of this node) with every stage the plan has on dead
 * and every rank of a tensor-parallel group it held, greets it until its HELLO lists that many
 * stages (a cold standby loads their layers, or its rank's slices, first), checks its identity
 * and key as the join does against the plan with those stages and ranks moved (each slice must
 * be the plan's: layers, rank, group size and link), and then moves them in f->plan (rank_node,
 * rank_addr, and for a whole stage or a group's leader stage_node and stage_addr; each store
 * atomic). moved and ranks (at least SH_CLUSTER_MAX_STAGES entries each) get their stage indices
 * and ranks (0 for a stage of one node), *n_moved their count. Gives up when timeout_ms pass or
 * when *sb_health (the watchdog's view of the standby, may be NULL) turns dead. Returns 0, or 1
 * (gave up) or 2 (refused) with msg saying why (the plan unchanged). Rerouting the previous stage
 * or the batcher, regrouping the groups (sh__cluster_front_regroup) and resuming are the
 * caller's. Not from a loop thread; one thread at a time. */
int sh__cluster_front_promote(sh_cluster_front *f, sh_runtime *rt, sh_addr as, int32_t dead,
                              int32_t sb, uint32_t timeout_ms, const _Atomic int32_t *sb_health,
                              int32_t *moved, int32_t *ranks, int32_t *n_moved, char *msg,
                              size_t cap);

/* After a promotion moved a rank of stage i's group: sends every rank's stage actor (from `as`,
 * an actor of this node; the leader last) CONTROL op REGROUP with the plan's rank addresses and,
 * over the network collective, every rank's URL, so that the group's next step forms it anew
 * with the standby in its place. Does nothing for a stage of one node. Returns 0, or 2 (the URLs
 * do not fit one message: nothing sent) or 1 (a send failed: the others are sent still) with msg
 * saying why. Not from a loop thread. */
int sh__cluster_front_regroup(sh_cluster_front *f, sh_runtime *rt, sh_addr as, int32_t i, char *msg,
                              size_t cap);

/* The rank of stage i's group on node (0 for a stage of one node there), or -1 when the stage has
 * no rank there. */
int32_t sh__cluster_rank_on(const sh_cluster_plan *p, int32_t i, int32_t node);

/* The slice HELLO states for rank `rank` of stage i (SH_HELLO_SLICE). */
uint64_t sh__cluster_slice(const sh_cluster_plan *p, int32_t i, int32_t rank);

/* The collective group of stage i's ranks (docs/cluster.md, "Tensor parallelism"): shared
 * memory when every rank listens on this host's addresses (ipc://, or tcp:// and tls+tcp:// on
 * 127.x, localhost or [::1]), in a segment named from the script's leader's URL (kept when a
 * standby takes a rank's place, the leader's included) and the stage; the network
 * otherwise, rank r listening on urls[r]: its node's listen URL with ".tpI" appended to an ipc://
 * path, or with the port raised by 1000 * I for tcp:// and tls+tcp:// (I the stage's index over
 * the plan, from 1), with the node's certificates on tls+tcp:// (sh__cluster_tls). timeout_ms
 * bounds each collective: 4 heartbeat periods times dead_after of the script's watchdog, at least
 * 5 s, so that the watchdog judges a dead rank's node (and pauses the replica) before the group
 * gives up on the step. */
typedef struct sh_cluster_group {
    int32_t kind;     /* sh_coll_kind */
    int32_t compress; /* sh_coll_compress over the network (the replica's tp_compress), else 0 */
    char shm_name[64];
    char urls[SH_CONFIG_MAX_TP][280];
    const char *url_of[SH_CONFIG_MAX_TP]; /* urls[r] */
    int32_t hosts[SH_CONFIG_MAX_TP];      /* SH_COLL_HIER: rank r's host (sh_coll_opts.hosts) */
    int32_t timeout_ms;
} sh_cluster_group;

/* Fills g for stage i (stage_tp[i] > 1). Returns 0, or 2 with an error line (a port past 65535). */
int sh__cluster_group(const sh_cluster_plan *p, int32_t i, sh_cluster_group *g, sh_error *e);

/* Whether the stages verify drafts (their contexts' rows of logits, sh__serve_max_logits): the
 * script's batcher.spec is "ngram" or a replica has a drafter. */
bool sh__cluster_spec_rows(const sh_cluster_config *c);

/* Whether replica k has a stage, or a rank of a stage's group, or its drafter on node. */
bool sh__cluster_replica_on(const sh_cluster_plan *p, int32_t k, int32_t node);

/* Stops the front's transport; call before sh_runtime_destroy(). Accepts a zeroed front. */
void sh__cluster_front_close(sh_cluster_front *f);
/* Frees the transport; call after sh_runtime_destroy(). Accepts a zeroed front. */
void sh__cluster_front_destroy(sh_cluster_front *f);

#endif
