/* Per-loop deadline heap: request deadlines and actor timers share one libuv timer per loop. */
#ifndef SH_RUNTIME_TIMER_H
#define SH_RUNTIME_TIMER_H

#include <stdint.h>

#include "shoal/err.h"

struct sh__loop;
struct sh_actor_ctx;

/* What a heap node belongs to; the loop's timer callback dispatches on it. */
typedef enum sh__timer_kind {
    SH__TIMER_KIND_SESSION = 1, /* an sh__session (runtime/session.c) */
    SH__TIMER_KIND_ACTOR = 2,   /* an actor timer (sh__atimer below) */
} sh__timer_kind;

/* A node embedded in its owner. `idx` is its slot in the heap (UINT32_MAX when not queued), so
 * removal is O(log n) without a search. */
typedef struct sh__timer_node {
    uint64_t due_ns; /* uv_hrtime() clock */
    uint64_t seq;    /* tie-breaker: equal deadlines fire in insertion order */
    uint32_t idx;
    uint8_t kind; /* sh__timer_kind */
} sh__timer_node;

/* A binary min-heap of node pointers ordered by (due_ns, seq). Loop thread only. */
typedef struct sh__timer_heap {
    sh__timer_node **v;
    uint32_t n, cap;
    uint64_t seq;
} sh__timer_heap;

/* An actor timer: owned by its actor's list, freed when it fires (one-shot), is stopped, or the
 * actor stops. */
typedef struct sh__atimer {
    sh__timer_node tn; /* first member: the heap hands back &tn */
    uint64_t id;
    uint64_t tag;
    uint32_t repeat_ms;
    struct sh_actor_ctx *actor;
    struct sh__atimer *prev, *next;
} sh__atimer;

#define SH__TIMER_IDLE UINT32_MAX

/* Queues node at due_ns and re-arms the loop's libuv timer when it became the earliest.
 * Returns SH_ENOMEM (node not queued). Loop thread only. */
sh_err sh__timer_add(struct sh__loop *l, sh__timer_node *node, uint64_t due_ns);

/* Removes a queued node (no-op when idle). Loop thread only. */
void sh__timer_remove(struct sh__loop *l, sh__timer_node *node);

/* The libuv timer callback body: fires every due node and re-arms. Loop thread only. */
void sh__timer_run_due(struct sh__loop *l);

/* Cancels and frees every timer of actor a. Loop thread only. */
void sh__timer_cancel_actor(struct sh__loop *l, struct sh_actor_ctx *a);

/* Frees the heap's array (the heap must be empty). */
void sh__timer_heap_fini(struct sh__loop *l);

#endif
