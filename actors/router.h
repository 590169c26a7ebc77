/* The router (DESIGN.md section 4): data parallelism over several replicas of one model. It sits
 * between the gateway and the replicas' batchers:
 *
 *   gateway --SUBMIT/CANCEL--> router --SUBMIT/CANCEL--> batcher of replica r
 *   batcher --TOKEN/DONE/FAIL--> router --TOKEN/DONE/FAIL--> gateway
 *
 * Each batcher reports its load and what it measured in a METRICS message every report_ms
 * (sh_batcher_args.router); the values it sends are named below. */
#ifndef SH_ACTORS_ROUTER_H
#define SH_ACTORS_ROUTER_H

#include <stdint.h>

#include "lua/config.h"
#include "shoal/runtime.h"

/* Names of the values in a batcher's METRICS report (kind 1 gauge, kind 0 counter since the
 * batcher started; at_us is the batcher's CLOCK_MONOTONIC time in microseconds). */
#define SH_ROUTER_M_WAITING "waiting"     /* gauge: sequences waiting in the queue */
#define SH_ROUTER_M_RUNNING "running"     /* gauge: sequences in the running set */
#define SH_ROUTER_M_MAX_SEQS "max_seqs"   /* gauge: the batcher's max_seqs */
#define SH_ROUTER_M_KV_FREE "kv_free"     /* gauge: free plus evictable KV blocks, last known */
#define SH_ROUTER_M_KV_TOTAL "kv_total"   /* gauge: blocks in the pool */
#define SH_ROUTER_M_TOKENS "tokens"       /* counter: positions computed by answered steps */
#define SH_ROUTER_M_GENERATED "generated" /* counter: tokens generated */
#define SH_ROUTER_M_BUSY_US "busy_us"     /* counter: microseconds with a step in flight */
#define SH_ROUTER_M_STEPS "steps"         /* counter: steps answered */

/* Kind "router". Chooses a replica per SUBMIT and relays everything of that request:
 *
 * - load: each replica's estimated load is the sum over the requests it holds (routed and not yet
 *   finished) of (prompt_tokens + n * max_tokens / 2) * 1.2, divided by the replica's weight;
 * - weight: every weight_refresh_ms the router reads what each replica reported (METRICS:
 *   positions computed and microseconds busy since the last refresh) and sets weight =
 *   capacity / the best replica's capacity (in [0.05, 1]; 1 until measured; a replica idle during
 *   the window keeps its weight);
 * - health: a replica whose `down` flag is set (another thread: the front's watchdog lost one
 *   of its stage nodes) gets no new request. Flag 1, paused (the node is awaited): its requests
 *   that streamed nothing yet move to a healthy replica when there is one, and the others stay
 *   to resume there by recompute. Flag 2, removed (it will not come back): those that streamed
 *   nothing move, the others end with FAIL (503, retryable). With no healthy replica SUBMIT fails
 *   with 503. When the flag is cleared again (the node came back and the replica resumed), the
 *   replica takes requests again;
 * - prefix affinity: the router remembers which replica it last sent each chain of full prompt
 *   blocks (block_tokens tokens each) to; a request whose leading blocks were sent to a healthy
 *   replica goes there while that replica's load is at most the least loaded one's plus
 *   affinity_slack. Otherwise the least loaded healthy replica wins; ties go round-robin;
 * - re-dispatch: a request that streamed nothing redispatch_ms after it was routed, on a replica
 *   that reports sequences waiting, while another healthy replica reports room (nothing waiting,
 *   running < max_seqs), is withdrawn (CANCEL withdraw) and, when the batcher confirms it was
 *   still queued (FAIL SH_EBUSY "withdrawn"), submitted to the least loaded replica with room.
 *
 * TOKEN/DONE/FAIL from a replica a request no longer lives on are dropped, so a client sees one
 * replica's stream only. Metrics (labelled replica="k", 0-based, or ids[k]): shoal_router_load,
 * shoal_router_weight (x1000), shoal_router_requests (held now), shoal_router_queue (the
 * replica's waiting sequences, as reported), shoal_router_healthy (gauges);
 * shoal_router_routed_total, shoal_router_redispatched_total, shoal_router_affinity_hits_total
 * (counters); shoal_router_routed_class_total{replica, class = "long" | "short" | "script"}
 * (first routings by length rule or route(); only the classes that can occur) and
 * shoal_router_route_errors_total (route() failures, all routers). Thread: the router's loop. */
typedef struct sh_router_args {
    int32_t n_replicas;
    const sh_addr *batchers;    /* (n_replicas), copied; NULL: unknown until a CONTROL (op REROUTE)
                                 * brings them in `targets`, which must come before any SUBMIT */
    int32_t block_tokens;       /* prefix-affinity granularity (default 16) */
    uint32_t weight_refresh_ms; /* default 5000 */
    uint32_t redispatch_ms;     /* default 500; UINT32_MAX: never */
    double affinity_slack;      /* load units (default 4096); < 0: no affinity */
    int *down; /* (n_replicas) optional, read atomically: 0 up, 1 paused, 2 removed; outlives rt */
    /* Optional (n_replicas, copied): the number replica k carries in its metrics label and logs
     * and its index into `down` (a front with several routers, one per model, numbers replicas
     * across all of them). NULL: 0, 1, ... */
    const int32_t *ids;
    /* Length-aware routing (docs/cluster.md): replica k's shape, tp[k] (the most ranks of any of
     * its stages' groups) and stages[k] (optional, (n_replicas), copied; NULL: 1 and 1). When the
     * replicas have both shapes, a prompt of more than routing->long_prompt tokens (class "long")
     * is routed among the healthy replicas with tp > 1 and any other (class "short") among those
     * with tp = 1; with no healthy replica of its class, among all healthy ones (health is a
     * veto, never a failure). Load, affinity and round-robin choose within that set, and a move
     * prefers the request's class too. routing->route, when set, is called first with the
     * request and the replicas (class "script" when it names a healthy replica); an error or a
     * bad value falls back to the rule above, counted in shoal_router_route_errors_total and
     * logged at most once a minute. routing NULL: a threshold of 512 and no route(). */
    const int32_t *tp, *stages;
    const sh_config_routing *routing; /* outlives rt */
    const char *model;                /* route()'s req.model (outlives rt) */
} sh_router_args;

extern const sh_actor_vtable sh__router_vtable;

#endif
