/* The supervisor of a cluster front (DESIGN.md "supervisor", issue 25): owns what the front knows
 * of its lost worker nodes (who is down, who is awaited, which standby is spent) and recovers
 * from their loss: standby promotion, waiting for a lost node to come back (recover_ms) and its
 * rejoin, replicas leaving routing, and the fail-stop when nothing is left. `shoal serve -c` and
 * the embedding engine on a cluster script (api/engine_front.c) both start one.
 *
 *   front: watchdog --CONTROL NODE_DEAD / NODE_ALIVE--> front: supervisor (actor)
 *   supervisor actor --event--> supervisor thread: promote, rejoin, resume (may block 30 s)
 *   supervisor thread --CONTROL PAUSE / RESUME / REROUTE--> batchers, stages
 *
 * The actor only hands each event to the supervisor's own thread: a promotion waits up to 30 s
 * for a standby and a rejoin up to 3 s for a restarted node, which no loop thread may do. That
 * thread alone writes the recovery state (the front's down[] beside the watchdog's pause, lost[],
 * the waits and spent standbys); readers (the router, the status page) read the atomics. When
 * the front must stop (its only replica, or every replica, is lost for good) the thread says what
 * once, through on_stop and sh__supervisor_failed, and does nothing more. */
#ifndef SH_ACTORS_SUPERVISOR_H
#define SH_ACTORS_SUPERVISOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "actors/cluster.h"
#include "actors/cluster_events.h"
#include "actors/watchdog.h"
#include "shoal/runtime.h"

typedef struct sh_supervisor sh_supervisor;

typedef struct sh_supervisor_args {
    /* The front (joined: sh__cluster_front_start returned 0), or NULL: no worker nodes, and the
     * watchdog only ticks `tick`. Borrowed; must outlive the supervisor. */
    sh_cluster_front *front;
    const sh_addr *batchers; /* (front->plan.n_replicas) each replica's batcher; copied */
    uint32_t recover_ms; /* how long a lost node's replicas wait for it (0: none; fail at once) */
    /* What sets recover_ms, as the lines name it ("--recover-timeout"); NULL: "the recovery
     * wait". */
    const char *recover_what;
    sh_cluster_events *events; /* the front's event ring (may be NULL); borrowed */
    /* One line for the operator, without a newline ("promoting standby s0 in place of node w0"),
     * error set for a failure; on the supervisor's thread or a loop thread. May be NULL. */
    void (*note)(void *user, bool error, const char *line);
    void *note_user;
    /* The front must stop: `what` says why; called once, on the supervisor's thread, which then
     * does nothing more. May be NULL (sh__supervisor_failed tells the same). */
    void (*on_stop)(void *user, const char *what);
    void *on_stop_user;
    /* The watchdog's tick (the degradation ladder) and its events, as sh_watchdog_args has them;
     * each may be NULL. */
    void (*tick)(void *user, uint64_t now_ms);
    void *tick_user;
} sh_supervisor_args;

/* Allocates a supervisor from a (copied) into *out; nothing runs yet. With a front, checks that
 * the watchdog can watch it (SH_EUNSUPPORTED past SH_WATCHDOG_MAX_NODES nodes or
 * SH_WATCHDOG_MAX_REPLICAS replicas). Returns SH_OK, SH_ENOMEM or that, with e filled. */
sh_err sh__supervisor_create(const sh_supervisor_args *a, sh_supervisor **out, sh_error *e);

/* The watchdog's view of the nodes (the status page and the policy's metrics read it); valid
 * from create to destroy. */
sh_watchdog_view *sh__supervisor_view(sh_supervisor *s);

/* Starts the supervisor's thread and spawns the actors "supervisor" and "watchdog" on rt's loop
 * `loop` (registering both kinds when rt lacks them). Not from a loop thread. Returns SH_OK, or
 * the spawn's or thread's error with e filled (sh__supervisor_stop and _destroy still apply). */
sh_err sh__supervisor_start(sh_supervisor *s, sh_runtime *rt, int loop, sh_error *e);

/* Whether the front must stop; what (cap bytes, may be NULL) gets why. Any thread. */
bool sh__supervisor_failed(sh_supervisor *s, char *what, size_t cap);

/* Stops the supervisor's thread after the recovery step it runs (a promotion in flight finishes
 * first); later events are dropped. Call before the front's transport closes and before the
 * runtime is destroyed. Accepts NULL; a second call does nothing. Not from a loop thread. */
void sh__supervisor_stop(sh_supervisor *s);

/* Frees it (stopping it first); after sh_runtime_destroy. Accepts NULL. */
void sh__supervisor_destroy(sh_supervisor *s);

extern const sh_actor_vtable sh__supervisor_vtable;

#endif
