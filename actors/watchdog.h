/* The watchdog actor of a cluster front (DESIGN.md sections 4 and 8, issue 12): heartbeats every
 * worker node, judges a node dead after `dead_after` missed beats or at once when its link
 * breaks or reconnects, pauses the replicas with a stage there and takes them out of routing, and
 * ticks the degradation ladder. Bringing a dead node back (a standby in its place, greeting a
 * restarted process, resuming the paused replicas by recompute) is the front's supervisor's work
 * (actors/supervisor.h, which spawns it): the watchdog tells it of each death and return.
 *
 *   front: watchdog --PING every heartbeat_ms--> worker: hello --PONG (RSS)--> front: watchdog
 *   front: watchdog --CONTROL PAUSE--> batcher (of each replica on a dead node)
 *   front: watchdog --CONTROL NODE_DEAD (why) / NODE_ALIVE--> front: supervisor
 *
 * The worker's hello actor answers PING (actors/hello.c) on its node's first loop, which runs
 * no model work, so a long prefill on the stage's loop never delays a heartbeat. */
#ifndef SH_ACTORS_WATCHDOG_H
#define SH_ACTORS_WATCHDOG_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "shoal/runtime.h"
#include "shoal/transport.h"

#define SH_WATCHDOG_MAX_NODES 256
#define SH_WATCHDOG_MAX_REPLICAS 16

typedef enum sh_watchdog_health {
    SH_WATCHDOG_UNWATCHED = 0, /* not a worker (the front itself) or not heartbeaten */
    SH_WATCHDOG_ALIVE = 1,     /* answering heartbeats on the connection the front trusts */
    SH_WATCHDOG_DEAD = 2,      /* missed dead_after beats, or its link broke or reconnected */
} sh_watchdog_health;

/* What the watchdog knows of one node. The actor writes every field but base_ups; the supervisor's
 * thread writes base_ups; anyone may read (atomics, relaxed except health: release/acquire,
 * so a reader that sees ALIVE sees the figures that made it so). */
typedef struct sh_watchdog_node {
    _Atomic int32_t health;        /* sh_watchdog_health */
    _Atomic uint64_t rtt_us;       /* the last heartbeat's round trip */
    _Atomic uint64_t rss_bytes;    /* resident memory of the node's process, from its last PONG */
    _Atomic uint64_t last_pong_ms; /* CLOCK_MONOTONIC ms of its last PONG (0: none yet) */
    _Atomic uint64_t pongs;        /* PONGs received */
    _Atomic uint64_t deaths;       /* times judged dead */
    _Atomic uint64_t dead_ms;      /* CLOCK_MONOTONIC ms of the last death */
    _Atomic uint64_t drains;       /* times drained and asked to restart (over its budget) */
    /* The connection count (sh_transport_link.ups) of the process the front trusts: another
     * count means another process, whose KV is not what the replica's kvmgr believes. Set by the
     * front when the node joins or rejoins (after its HELLO); the node is dead while its link's
     * count differs. */
    _Atomic uint64_t base_ups;
} sh_watchdog_node;

/* The watchdog's shared view, embedded in the front's state; zero it, set n_nodes, then each
 * worker's base_ups before spawning the actor. */
typedef struct sh_watchdog_view {
    int32_t n_nodes;
    sh_watchdog_node node[SH_WATCHDOG_MAX_NODES]; /* by the script's node index (node id - 1) */
    _Atomic uint64_t ticks;                       /* timer ticks so far */
} sh_watchdog_view;

/* Kind "watchdog": spawned on the front. Every heartbeat_ms it sends a one-way PING to each
 * watched node's `pong_from` actor (which answers PONG to the sender) and ticks `tick`; every
 * heartbeat_ms / 4 it judges: a watched node is dead when its link is not up, its link's
 * connection count differs from base_ups, or no PONG came for dead_after * heartbeat_ms (counted
 * from the spawn before the first) while the dead_after PINGs sent since went unanswered (so a
 * stall of the watchdog's own loop or process blames no node). Spawn it on a loop of its own:
 * its timing should not depend on the gateway's work. On the transition to dead it sets down[k]
 * (release) and sends CONTROL PAUSE to batchers[k] for every replica k with a stage on it whose
 * down[k] was clear, calls note("dead", ...) and note("paused", ...), and sends `supervisor`
 * CONTROL NODE_DEAD (level: the node, arg: why). A dead node becomes alive again when its link is
 * up with base_ups connections and a PONG sent after the death comes back (note "alive", CONTROL
 * NODE_ALIVE); resuming its replicas is the supervisor's (clear down[k], send RESUME). PONGs from
 * an unknown address or stale seq are ignored. Everything borrowed must outlive the actor. Memory:
 * see budget below. */
typedef struct sh_watchdog_args {
    sh_watchdog_view *view;
    sh_transport *tp;         /* link states; NULL: heartbeats only */
    const bool *watch;        /* (view->n_nodes): heartbeat this node */
    const sh_addr *pong_from; /* (view->n_nodes): the actor that answers its PINGs */
    const char *const *names; /* (view->n_nodes): node names, for messages */
    /* (view->n_nodes) or NULL: each node's memory budget in bytes (0: none). A live node whose
     * PONG reports more resident memory is drained: judged dead at once (its replicas pause as
     * for a death; its requests resume by recompute), sent CONTROL SHUTDOWN (arg: why) so that
     * it exits for its supervisor to restart it, and kept dead until its process is gone (its
     * link breaks or reconnects), whatever it answers meanwhile. */
    const uint64_t *budget;
    uint32_t heartbeat_ms;   /* 0: 100 */
    uint32_t dead_after;     /* missed beats; 0: 3 */
    int32_t n_replicas;      /* <= SH_WATCHDOG_MAX_REPLICAS */
    const bool *replica_on;  /* (n_replicas * view->n_nodes): [k * n_nodes + i] */
    const sh_addr *batchers; /* (n_replicas) */
    int *down;               /* (n_replicas): the router's veto, set atomically */
    sh_addr supervisor;      /* told of deaths and returns (0: nobody) */
    /* Called on the actor's loop thread every heartbeat_ms (may be NULL): the degradation
     * ladder's evaluation. now_ms is CLOCK_MONOTONIC. Must not block for long. */
    void (*tick)(void *user, uint64_t now_ms);
    void *tick_user;
    /* Called on the actor's loop thread for each event (may be NULL); kind as in
     * actors/cluster_events.h, node and replica -1 when not about one. */
    void (*note)(void *user, const char *kind, int32_t node, int32_t replica, const char *msg);
    void *note_user;
} sh_watchdog_args;

extern const sh_actor_vtable sh__watchdog_vtable;

#endif
