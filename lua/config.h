/* In-tree API of the Lua host: sandbox limits, cluster topology, degradation policies and fault
 * scenarios, each evaluated in a sandboxed Lua 5.4 state and copied into typed C structs. */
#ifndef SH_LUA_CONFIG_H
#define SH_LUA_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/fault_event.h"
#include "shoal/err.h"

/* ---- Limits shared by every script kind ---------------------------------------------------- */

/* Receives print() output and Lua warnings of a script, one line without the newline. Called on
 * the thread that runs the script. Without a callback that text is dropped. */
typedef void (*sh_lua_log_fn)(void *ud, const char *line);

/* Limits of one sandboxed state. A zeroed struct means the defaults of the script kind: 64 MiB
 * and 2000 ms for cluster files and scenarios, 8 MiB and 50 ms per call for policies. The time
 * limit is wall-clock per evaluation (one chunk run, one level() call), checked every 1000 VM
 * instructions and by the allocator (every 256 allocations and at every refused one), so
 * allocation-heavy loops stop on time too; the memory limit counts every byte the Lua state
 * holds. */
typedef struct sh_lua_limits {
    size_t memory_bytes;
    uint32_t time_ms;
    sh_lua_log_fn log;
    void *log_ud;
} sh_lua_limits;

/* ---- Cluster topology (cluster.lua, DESIGN.md section 7) ------------------------------------ */

typedef struct sh_config_node {
    char *name;   /* unique, [A-Za-z0-9_.-]{1,63} */
    char *listen; /* inproc://, ipc://, tcp://host:port or tls+tcp://host:port */
    bool standby; /* a spare: holds no stage until the watchdog promotes it */
    /* tls+tcp:// (docs/cluster.md): this node's certificate and private key (PEM), signed by the
     * cluster's tls_ca; relative to the script's directory. NULL when not given. */
    char *tls_cert;
    char *tls_key;
    /* node{ memory_budget = "2GiB" } (bytes, or a size string as for kv.memory): the resident
     * memory the front's watchdog lets this node's process hold; above it the node is drained
     * and asked to restart (docs/cluster.md). 0 when not given: no limit. */
    uint64_t memory_budget;
    /* node{ standby = true, preload = "w1" }: the node whose stages this standby loads at start
     * (a hot standby: promoting it to replace that node costs no load time); NULL when not given
     * (a cold standby loads the dead node's layers when it is promoted). Checked against the
     * node names by the cluster check (tools/cluster.c). */
    char *preload;
} sh_config_node;

typedef struct sh_config_model {
    char *name;       /* unique */
    char *path;       /* GGUF or llama2.c file. From a script file, a relative path is taken
                         relative to the script's directory (the script path's directory part is
                         prefixed: "conf/c.lua" with "m.gguf" gives "conf/m.gguf"); absolute
                         paths, and every path from sh_config_load_string, are as written */
    int32_t n_layers; /* from model{ layers = n }; 0 when unknown until the file is loaded */
} sh_config_model;

/* The most ranks of one stage's tensor-parallel group (SH_COLL_MAX_RANKS, runtime/coll.h). */
#define SH_CONFIG_MAX_TP 64

/* One pipeline stage: layers [first_layer, last_layer) on one node, or on a tensor-parallel group
 * of tp nodes (docs/cluster.md, "Tensor parallelism"). Both are -1 when the script did not know
 * the layer count: whoever loads the model resolves them with sh_config_replica_layers() (evenly,
 * or by weight), in order. */
typedef struct sh_config_stage {
    int32_t node; /* index into sh_cluster_config.nodes: rank 0, the group's leader (the node the
                   * previous stage or the batcher sends to); never a standby node */
    int32_t first_layer;
    int32_t last_layer;
    /* pipeline(m, nodes, { weights = {...} }): this stage's weight (> 0, every stage of the
     * replica has one); 0 when the split is even or written out. Kept after the loader resolved
     * the ranges (the layer count was known), for information. */
    double weight;
    /* The stage's tensor-parallel group: tp ranks (1: the stage runs whole on `node`), ranks[r]
     * the node index of rank r (ranks[0] == node). Distinct nodes, none a standby, all listening
     * on one scheme. */
    int32_t tp;
    int32_t ranks[SH_CONFIG_MAX_TP];
} sh_config_stage;

typedef struct sh_config_replica {
    int32_t model; /* index into sh_cluster_config.models */
    int32_t tp;    /* the most ranks of any stage's group (sh_config_stage.tp); 1: none split */
    /* How ACT carries hidden rows from each stage to the next: replica{ link_dtype = "f32" |
     * "f16" | "int8" }, as the GGUF type id (base/dtype.h): 0 F32 (default), 1 F16 (rounded to
     * nearest even), 24 I8 (with one F32 scale per row, max|x| / 127). */
    uint32_t link_dtype;
    /* replica{ tp_link = "auto" | "net" | "hier" }: how the ranks of a group exchange; "auto"
     * (default, both false): shared memory when every rank is on this host, two levels when the
     * ranks are on several hosts with more than one on some, else the network; "net" (tp_net):
     * the network always; "hier" (tp_hier): two levels always, each node URL's host part taken
     * as its host as written (docs/cluster.md, "Tensor parallelism"). */
    bool tp_net;
    /* replica{ tp_compress = "none" | "f16" | "int8" }: what the network collective's links carry
     * for the all-reduces, summed in f32 (runtime/coll.h): 0 none (default), 1 f16, 2 int8 (the
     * values of sh_coll_compress). Anything but "none" needs tp_link = "net". */
    int32_t tp_compress;
    bool tp_hier;
    /* replica{ drafter = { node = "NAME", model = "PATH" | self = LAYERS } } (docs/cluster.md,
     * "Speculative decoding"): the replica drafts on node drafter_node, a worker node that holds
     * nothing else, between the front's batcher and the first stage, with the draft model at
     * PATH (drafter_path: a GGUF with the target's vocabulary; relative to the script's
     * directory like model paths) or with the replica's own model's first drafter_self layers
     * and its output head (self-speculation; drafter_path NULL). Exactly one is given;
     * drafter_self is 1..n_layers - 1, checked here against model{ layers = n } when the script
     * gives the count, else by the cluster plan against the file (actors/cluster.c), whose error
     * names drafter_where ("file:line" of the replica). drafter_node is -1, drafter_path and
     * drafter_where NULL and drafter_self 0 when the replica has no drafter. */
    int32_t drafter_node;
    char *drafter_path;
    int32_t drafter_self;
    char *drafter_where;
    int32_t n_stages;
    sh_config_stage *stages; /* (n_stages), in pipeline order */
} sh_config_replica;

typedef struct sh_config_gateway {
    int32_t node; /* index into nodes */
    char *http;   /* "host:port" the HTTP server listens on */
    int32_t n_api_keys;
    char **api_keys; /* (n_api_keys); none means the API is open */
} sh_config_gateway;

/* batcher.spec's values and spec_k's bounds, as model/spec.h has them (sh_spec_kind's
 * SH_SPEC_OFF / SH_SPEC_NGRAM, SH_SPEC_DEFAULT_K, SH_SPEC_MAX_K): lua/ includes no model/ header,
 * so actors/replica.c checks that the two agree. */
#define SH_CONFIG_SPEC_OFF 0
#define SH_CONFIG_SPEC_NGRAM 1
#define SH_CONFIG_SPEC_DEFAULT_K 8
#define SH_CONFIG_SPEC_MAX_K 16

typedef struct sh_config_batcher {
    int32_t max_step_tokens; /* default 4096 */
    int32_t max_seqs;        /* default 64 */
    int32_t max_wait_ms;     /* default 50 */
    int32_t spec;            /* SH_CONFIG_SPEC_OFF ("off", default) or SH_CONFIG_SPEC_NGRAM; a
                              * replica with a drafter drafts with it whatever this says */
    int32_t spec_k;          /* 1..16 drafted tokens at most per step; 0 (absent): the default */
} sh_config_batcher;

typedef struct sh_config_kv {
    int32_t block_tokens;  /* default 16 */
    bool prefix_cache;     /* default true */
    uint64_t memory_bytes; /* KV memory budget per stage; 0 (default) sizes it from free memory */
    bool f32;              /* type = "f32": the stages' KV cache in F32; false (default): "f16" */
} sh_config_kv;

typedef struct sh_config_watchdog {
    int32_t heartbeat_ms; /* default 100 */
    int32_t dead_after;   /* missed heartbeats; default 3 */
    char *policy;         /* policy script path; default "lua/policy/default.lua". "default" and
                           * "lua/policy/default.lua" name the built-in copy; any other relative
                           * path is resolved against the script's directory */
    /* The degradation ladder (docs/serving.md, "Degradation"). It runs only when the script names
     * a policy (policy_given); the settings below have their defaults otherwise. */
    bool policy_given;
    int32_t hold_ms;            /* hold_s: a lower level waits this long; default 5000 */
    int32_t degrade_max_tokens; /* level 2 caps max_tokens at this; default 64 */
    char *fallback;             /* level 3: the model requests for the others go to; NULL: none */
    int32_t shed_priority;      /* level 4: requests of this priority or above (less urgent) get
                                 * 503; default 1 (only priority 0 is served); 256: none */
} sh_config_watchdog;

/* cluster{ routing = { long_prompt = n, route = function(req, replicas) ... end } }
 * (docs/cluster.md, "Length-aware routing"): how a model's router picks between replicas of
 * different shapes. */
typedef struct sh_config_routing {
    /* Prompts of more than this many tokens go to the model's tensor-parallel replicas (tp > 1),
     * the others to its replicas of one rank per stage, when the model has both; 0..2^30,
     * default 512. */
    int32_t long_prompt;
    /* The script's route(req, replicas), kept in the sandbox the script ran in (lua/route.c);
     * NULL when the script gives none. */
    struct sh_config_route *route;
} sh_config_routing;

typedef struct sh_cluster_config {
    int32_t n_nodes;
    sh_config_node *nodes;
    int32_t n_models;
    sh_config_model *models; /* listed in cluster{ models = ... } plus those replicas name */
    int32_t n_replicas;
    sh_config_replica *replicas;
    sh_config_gateway gateway;
    sh_config_batcher batcher;
    sh_config_kv kv;
    sh_config_watchdog watchdog;
    /* cluster{ key_file = "path" }: the cluster key nodes prove to each other in HELLO
     * (docs/cluster.md); relative to the script's directory like model paths. NULL: none given
     * (a flag or SHOAL_CLUSTER_KEY_FILE may still give one). */
    char *key_file;
    /* cluster{ tls_ca = "path" }: the CA (PEM) that signs every node's tls_cert; relative to the
     * script's directory. NULL when not given. */
    char *tls_ca;
    sh_config_routing routing;
} sh_cluster_config;

/* Evaluates a cluster script (a file, or `len` bytes of text named `name` in messages) in a fresh
 * sandbox and returns the validated topology with defaults applied. The script must return the
 * value of a cluster{} call. limits may be NULL (defaults). On success *out is owned by the
 * caller (sh_config_destroy). On failure *out is NULL and e names the file and line:
 * SH_EIO (unreadable file), SH_ELUA (syntax or runtime error, with a short traceback),
 * SH_EINVAL (a constructor's argument failed validation), SH_ENOTFOUND (a reference to an
 * unknown node or model), SH_ETIMEDOUT / SH_ENOMEM (a limit). Relative model paths, key_file,
 * tls_ca and the nodes' tls_cert and tls_key of a script file are resolved against its directory
 * (see sh_config_model.path); other paths are not.
 * Any thread; no shared state. */
sh_err sh_config_load_file(const char *path, const sh_lua_limits *limits, sh_cluster_config **out,
                           sh_error *e);
sh_err sh_config_load_string(const char *src, size_t len, const char *name,
                             const sh_lua_limits *limits, sh_cluster_config **out, sh_error *e);

/* The layer range of every stage of r for a model of n_layers layers, into first[i], last[i]
 * (r->n_stages entries each): the script's ranges when it wrote them out or the loader resolved
 * them; otherwise the split pipeline() describes. Even: stage i starts at
 * floor(i * n_layers / n_stages). By weight: the boundary before stage k is the cumulative weight
 * share rounded to the nearest layer, halves up, floor(n_layers * (w_0 + ... + w_{k-1}) / W + 0.5)
 * with W the sum of all weights, clamped into [boundary k-1 + 1, n_layers - (n_stages - k)] so
 * that every stage holds at least one layer ({2, 1} over 30 layers: [0, 20) and [20, 30)).
 * Ranges are not checked against each other here (the caller checks coverage). Returns SH_EINVAL
 * (more stages than layers, none); first and last are then undefined. Any thread. */
sh_err sh_config_replica_layers(const sh_config_replica *r, int32_t n_layers, int32_t *first,
                                int32_t *last, sh_error *e);

/* Index of the node called `name`, or -1. */
int32_t sh_config_find_node(const sh_cluster_config *c, const char *name);

/* Whether the script runs its replica's stages on worker nodes (more than one node, more than one
 * replica or stage, or the stage not on the gateway's node); false for the single-process
 * topology that `shoal serve -c` and an embedded engine run themselves. Any thread. */
bool sh_config_has_workers(const sh_cluster_config *c);

/* Frees the config and everything it points to (its route() state too); accepts NULL. */
void sh_config_destroy(sh_cluster_config *c);

/* ---- route(req, replicas) (lua/route.c) ---------------------------------------------------- */

/* What route() gets as req: prompt_tokens, max_tokens, priority, model. */
typedef struct sh_route_req {
    int32_t prompt_tokens, max_tokens, priority;
    const char *model;
} sh_route_req;

/* One entry of route()'s replicas list: index (the replica's index in the script, from 0, as in
 * metrics and status), tp, stages, load (the router's estimate) and healthy. */
typedef struct sh_route_replica {
    int32_t index, tp, stages;
    double load;
    bool healthy;
} sh_route_replica;

/* Calls the script's route(req, replicas) under the sandbox's limits (the script's memory limit,
 * SH_ROUTE_TIME_MS per call). On success *choice is the index it returned, or -1 for nil (the
 * default rule). A Lua error, a limit, or a value that is neither nil nor the index of one of
 * the n replicas is SH_ELUA, SH_ETIMEDOUT, SH_ENOMEM or SH_EINVAL with e naming it; the state
 * stays usable. One thread at a time (the front's routers all run on loop 0). */
#define SH_ROUTE_TIME_MS 50u
sh_err sh_config_route_call(struct sh_config_route *r, const sh_route_req *q,
                            const sh_route_replica *reps, int32_t n, int32_t *choice, sh_error *e);

/* Internal to lua/: keeps the sandbox b (its registry holds the function under the key
 * "shoal.route.fn") as c->routing.route; takes b (destroyed on failure). Frees with the config. */
struct sh__lua_box;
sh_err sh__config_route_keep(sh_cluster_config *c, struct sh__lua_box *b, sh_error *e);
void sh__config_route_destroy(struct sh_config_route *r);

/* ---- Degradation policies ------------------------------------------------------------------ */

/* The metrics the watchdog hands to level(m) every tick; field names are the Lua keys. */
typedef struct sh_policy_metrics {
    double queue_wait_p99_ms;
    double step_latency_p99_ms;
    double kv_used; /* fraction of KV blocks in use, 0..1 */
    double tokens_per_s;
    double queue_depth;
    double running_seqs;
    double nodes_dead;
    double level; /* the level now in force */
} sh_policy_metrics;

/* A metric passed by name, for fields the struct lacks. */
typedef struct sh_policy_metric {
    const char *name;
    double value;
} sh_policy_metric;

#define SH_POLICY_LEVEL_MAX 4

/* A loaded policy script: its own sandboxed state, kept between calls so a script may hold state
 * (hysteresis) in its globals. Not thread-safe: one thread at a time (the watchdog's loop). */
typedef struct sh_policy sh_policy;

/* Creates an empty policy (no script yet); limits may be NULL. SH_ENOMEM on failure. */
sh_err sh_policy_create(const sh_lua_limits *limits, sh_policy **out, sh_error *e);

/* Loads (or reloads) the script, which must define a global function level(m). The new script
 * runs in a fresh state and must pass a trial call of level() with the metrics of the last call
 * (zeros before any). Only then does it replace the old one; on any failure the old script stays
 * in force and the error (as for sh_config_load_file) is returned. */
sh_err sh_policy_load_file(sh_policy *p, const char *path, sh_error *e);
sh_err sh_policy_load_string(sh_policy *p, const char *src, size_t len, const char *name,
                             sh_error *e);

/* Sets the metrics (copied) that the next load's trial call passes, as if level() had last been
 * called with them: a host whose names are not the struct's sets them before the first load, so
 * that a script using those names passes its trial. SH_EINVAL (a name is NULL), SH_ENOMEM. */
sh_err sh_policy_set_trial(sh_policy *p, const sh_policy_metric *m, size_t n, sh_error *e);

/* Loads the built-in copy of lua/policy/default.lua (sh_policy_default_lua), as
 * sh_policy_load_string() does. */
sh_err sh_policy_load_default(sh_policy *p, sh_error *e);
extern const char sh_policy_default_lua[];

/* Calls level(m) under the limits and stores the result (an integer 0..SH_POLICY_LEVEL_MAX) in
 * *level. Errors: SH_EINVAL (no script loaded, or level returned a non-integer), SH_ERANGE (out
 * of range), SH_ELUA (runtime error), SH_ETIMEDOUT / SH_ENOMEM (a limit; the state is collected
 * and stays usable). *level is untouched on failure. */
sh_err sh_policy_level(sh_policy *p, const sh_policy_metrics *m, int32_t *level, sh_error *e);
sh_err sh_policy_level_pairs(sh_policy *p, const sh_policy_metric *m, size_t n, int32_t *level,
                             sh_error *e);

/* Frees the policy; accepts NULL. */
void sh_policy_destroy(sh_policy *p);

/* ---- Fault scenarios ----------------------------------------------------------------------- */

/* The event data (sh_fault_kind, sh_fault_event, sh_scenario) is base/fault_event.h's, shared
 * with the runner in runtime/fault_scenario.h. */

/* Evaluates a scenario script of at(t, action) calls. Ownership and errors as for
 * sh_config_load_file. */
sh_err sh_scenario_load_file(const char *path, const sh_lua_limits *limits, sh_scenario **out,
                             sh_error *e);
sh_err sh_scenario_load_string(const char *src, size_t len, const char *name,
                               const sh_lua_limits *limits, sh_scenario **out, sh_error *e);

/* Checks that every node a scenario names exists in the cluster (SH_ENOTFOUND otherwise, naming
 * the event's line). Actor names are checked by their node part ("node/actor"). kill, stop, cont
 * and leak must name one node, never "*". */
sh_err sh_scenario_check(const sh_scenario *s, const sh_cluster_config *c, sh_error *e);

/* A static name of the kind ("kill", "delay", ...). */
const char *sh_scenario_kind_name(sh_fault_kind k);

/* Frees the scenario; accepts NULL. */
void sh_scenario_destroy(sh_scenario *s);

#endif
