/* Pending request sessions of one loop's actors: matching replies, deadlines, late replies. */
#ifndef SH_RUNTIME_SESSION_H
#define SH_RUNTIME_SESSION_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime/timer.h"
#include "shoal/addr.h"
#include "shoal/err.h"
#include "shoal/runtime.h"

struct sh__loop;

/* One request an actor of this loop sent and has not had answered. While pending, its timer node
 * holds the deadline; after the deadline it stays "expired" for the runtime's late_grace_ms so
 * a late reply is recognised and dropped instead of being mistaken for a new request. */
typedef struct sh__session {
    sh__timer_node tn; /* first member: the heap hands back &tn */
    uint64_t id;       /* the envelope session */
    sh_addr peer;      /* the request's destination: the only valid replier */
    uint32_t type;     /* the request's type, for the timeout ERROR */
    uint64_t trace_id;
    bool expired;
    struct sh_actor_ctx *actor;
    struct sh__session *map_next;        /* hash chain */
    struct sh__session *a_prev, *a_next; /* the actor's list */
} sh__session;

/* Chained hash of sessions by id. Loop thread only. */
typedef struct sh__session_map {
    sh__session **buckets;
    uint32_t cap, n;
    sh__session *spare; /* freed sessions kept for reuse (linked by map_next), so that a steady
                         * flow of requests allocates nothing */
    uint32_t n_spare;
} sh__session_map;

/* Registers a pending session for actor a: request `id` to `peer`, deadline `deadline_ms` from
 * now. Returns SH_ENOMEM. Loop thread only. */
sh_err sh__session_add(struct sh__loop *l, struct sh_actor_ctx *a, uint64_t id, sh_addr peer,
                       uint32_t type, uint64_t trace_id, uint32_t deadline_ms);

/* Forgets session `id` of actor a (a request whose send failed). Loop thread only. */
void sh__session_forget(struct sh__loop *l, struct sh_actor_ctx *a, uint64_t id);

/* What delivery should do with a message that carries a session, for actor a. */
typedef enum sh__session_match {
    SH__SESSION_MATCH_NONE = 0,  /* not a reply to a's requests: deliver as a new message */
    SH__SESSION_MATCH_REPLY = 1, /* the answer to a pending request (now completed): deliver */
    SH__SESSION_MATCH_LATE = 2,  /* the answer to a request that timed out: drop, counted */
} sh__session_match;

/* Matches an arriving message against a's sessions and completes the session it answers.
 * Loop thread only. */
sh__session_match sh__session_match_msg(struct sh__loop *l, struct sh_actor_ctx *a,
                                        const sh_msg *m);

/* The heap callback for a session node: delivers the timeout ERROR or forgets an expired one. */
void sh__session_fire(struct sh__loop *l, sh__session *s);

/* Cancels and frees every session of actor a. Loop thread only. */
void sh__session_cancel_actor(struct sh__loop *l, struct sh_actor_ctx *a);

/* Frees the map (must be empty). */
void sh__session_map_fini(struct sh__loop *l);

#endif
