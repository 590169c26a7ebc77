/* A standby node (node{ standby = true }, docs/cluster.md "Standby nodes"): `shoal node` on it
 * holds no stage until the front's watchdog promotes it, when a stage node died. Promotion
 * (CONTROL op PROMOTE to its hello actor, with the plan's indices of the dead node's stages)
 * loads those stages' layers unless they were preloaded at start (node{ preload = "w1" }: a hot
 * standby), spawns their stage actors and lists their addresses in the node's HELLO identity,
 * which the front reads back before it reroutes the replica there and resumes it. */
#ifndef SH_TOOLS_STANDBY_H
#define SH_TOOLS_STANDBY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "actors/cluster.h"
#include "actors/hello.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "runtime/coll.h"
#include "shoal/runtime.h"

typedef struct sh_standby_stage {
    int32_t stage;     /* the plan's index */
    int32_t rank;      /* the rank of the stage's tensor-parallel group (0: a stage of one node) */
    sh_llama *m;       /* the stage's layers, or the rank's slices of them */
    sh_llama_ctx *ctx; /* NULL for a rank of a group: its stage actor creates it */
    /* A rank of a group: its links (the plan with this node in the rank's place), collective
     * settings and context options, which the stage actor reads when it forms the group. */
    sh_cluster_group *group;
    sh_coll_opts coll;
    sh_llama_ctx_opts co;
    sh_addr ranks[SH_CONFIG_MAX_TP];
    sh_stage_args sa; /* kept: the stage actor's init reads it */
    sh_addr addr;     /* once spawned; 0 before */
} sh_standby_stage;

/* Embedded in the node's state; zeroed, then every field up to `be` set before use. */
typedef struct sh_standby {
    sh_cluster_plan plan; /* a copy of the node's plan */
    int32_t self;         /* the standby's node index */
    const char *path;     /* the model file the stages load from */
    int32_t model;        /* its index in the script: only that model's stages can move here */
    sh_backend *be;
    sh_runtime *rt;        /* set once the runtime exists, before the hello actor is spawned */
    sh_hello_ident *ident; /* the hello actor's identity: stages[] and n_stages grow */
    /* Owned. */
    int32_t n;
    sh_standby_stage st[SH_CLUSTER_MAX_STAGES];
    pthread_t thread;
    bool started;    /* thread is to be joined; written and read only while holding gate */
    atomic_int gate; /* 0 open, 1 a promotion is being started (hello's loop thread), 2 closed
                        by sh__standby_join: no promotion starts any more */
    atomic_int busy; /* a promotion runs */
    int32_t want[SH_CLUSTER_MAX_STAGES], want_rank[SH_CLUSTER_MAX_STAGES];
    int32_t n_want;
} sh_standby;

/* Loads the stages of the node `preload` names (none: nothing) with their KV pools, and its ranks
 * of tensor-parallel groups (their slices; a group's context is created when it forms), so that a
 * promotion costs no load time. Prints one line. Returns 0, or 1/2 after an error line. Before
 * the runtime exists. */
int sh__standby_preload(sh_standby *sb);

/* The hello actor's on_promote (user: the sh_standby): starts a thread that takes over stages,
 * or ranks of their groups (loads those not preloaded, spawns their stage actors, publishes
 * their addresses and slices in ident) and prints one line when done or one error line. A
 * request while one runs, or one naming a stage of another model, no stage or a rank outside its
 * group, is refused with a log line. Hello's loop thread; never blocks. */
void sh__standby_promote(void *user, const int32_t *stages, const int32_t *ranks, int32_t n);

/* Waits for a promotion in progress. Call before the runtime is destroyed. Accepts a zeroed sb. */
void sh__standby_join(sh_standby *sb);
/* Frees the stages' models and contexts. After the runtime is destroyed. Accepts a zeroed sb. */
void sh__standby_free(sh_standby *sb);

#endif
