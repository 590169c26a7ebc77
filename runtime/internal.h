/* The runtime's internal structures shared by runtime.c, loop.c, actor*.c, session.c, timer.c. */
#ifndef SH_RUNTIME_INTERNAL_H
#define SH_RUNTIME_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "runtime/log.h"
#include "runtime/mailbox.h"
#include "runtime/msg.h"
#include "runtime/peers.h"
#include "runtime/registry.h"
#include "runtime/session.h"
#include "runtime/timer.h"
#include "shoal/runtime.h"

/* Message flags: local-only facts that do not travel in the frame. */
enum {
    SH__MSG_POOLED = 1u << 0,   /* the block came from the runtime's pool */
    SH__MSG_EXTDATA = 1u << 1,  /* data is a separate malloc'd buffer (adopted from an sh_buf) */
    SH__MSG_REPLY = 1u << 2,    /* sent with sh_reply*: never bounced with an ERROR */
    SH__MSG_TIMEOUT = 1u << 3,  /* the runtime's timeout ERROR: bypasses session matching */
    SH__MSG_NOFILTER = 1u << 4, /* re-injected by the fault layer: skip the filter */
    SH__MSG_OWNED = 1u << 5,    /* data belongs to `owner` (a transport buffer): released there */
    SH__MSG_BIG = 1u << 6,      /* a large block (header + frame) the big-block pool may keep */
    SH__MSG_MID = 1u << 7,      /* a medium block (SH__MAILBOX_MID_FRAME) from its own pool */
    SH__MSG_SEALED = 1u << 8    /* len includes the CRC-32C trailer for another node (msg.h) */
};

struct sh_msg {
    sh__mpsc_node node; /* first member: mailbox link */
    sh_runtime *rt;
    sh_msg_env env; /* hdr and body view into data */
    uint8_t *data;  /* the frame */
    size_t len;     /* frame bytes */
    size_t cap;     /* bytes data can hold */
    uint32_t flags;
    struct sh_msg *pool_next; /* free list link while pooled */
    sh_frame_owner owner;     /* with SH__MSG_OWNED: who frees data */
    uint64_t conn; /* the inbound connection a remote frame arrived on (0: local or unknown) */
};

/* Actor lifecycle. Transitions: INIT -> RUNNING -> STOPPING -> STOPPED, or INIT -> STOPPING.
 * Senders deliver only to INIT and RUNNING actors. */
enum {
    SH__ACTOR_INIT = 0,
    SH__ACTOR_RUNNING = 1,
    SH__ACTOR_STOPPING = 2,
    SH__ACTOR_STOPPED = 3,
};

struct sh_actor_ctx {
    sh__mpsc_node sched_node; /* first member: link in the loop's run queue */
    sh__mailbox mbox;
    sh_runtime *rt;
    struct sh__loop *loop;
    const sh_actor_vtable *vt;
    sh_addr addr;
    uint32_t id;
    void *state;
    void *init_arg;
    _Atomic int life;       /* SH__ACTOR_* */
    _Atomic int scheduled;  /* 1 while in the run queue or being run: one wake-up at a time */
    _Atomic uint32_t refs;  /* registry, run queue, senders in flight */
    _Atomic int64_t depth;  /* queued messages */
    _Atomic int overloaded; /* depth crossed mailbox_warn and has not fallen to half */
    struct sh_actor_ctx *reg_next; /* registry chain (under the shard lock) */
    /* Loop thread only. */
    struct sh_actor_ctx *run_next;
    sh__session *sessions;
    sh__atimer *timers;
    bool inited;
};

/* One control loop and its thread. */
struct sh__loop {
    sh_runtime *rt;
    uint32_t index;
    uv_loop_t uv;
    uv_async_t async; /* wakes the loop: run queue non-empty or quit */
    uv_timer_t timer; /* armed at the heap's earliest deadline */
    uv_thread_t thread;
    bool uv_ok, async_ok, timer_ok, thread_ok;
    _Atomic int quit;
    _Atomic int in_round; /* the loop will re-check runq before sleeping: no wake needed */
    sh__mailbox runq;     /* actors with work (sched_node) */
    /* Loop thread only. */
    sh__timer_heap heap;
    sh__session_map sessions;
    uint64_t armed_due; /* due_ns the libuv timer is armed for; 0 when not armed */
    uint64_t handled;   /* handle calls (published relaxed in handled_pub) */
    /* Stall detector: written by the loop thread around every vtable call, read by the
     * watchdog. busy_seq changes on every call; busy_since is 0 while idle. */
    _Atomic uint64_t busy_since;
    _Atomic uint64_t busy_seq;
    _Atomic uint32_t busy_id;
    _Atomic(const sh_actor_vtable *) busy_vt;
    _Atomic uint64_t handled_pub;
    uint64_t stall_seen; /* watchdog thread only: busy_seq already reported */
    char pad_[64];
};

#define SH__MAX_KINDS 64

struct sh_runtime {
    uint32_t node_id;
    uint32_t n_loops;
    uint32_t max_turns;
    uint32_t mailbox_warn;
    uint64_t stall_ns;
    uint32_t late_grace_ms;
    sh_runtime_stats *final_stats;
    void (*thread_start)(void *ud); /* sh_runtime_opts' hook, run first on each thread */
    void *thread_start_ud;
    sh__log log;
    struct sh__loop *loops;

    /* Counters of live objects: what a clean shutdown brings to zero. */
    _Atomic uint64_t actors_live, msgs_live, handles_live, allocs_live, threads_live;

    _Atomic uint32_t next_actor; /* last actor id handed out; ids are never reused */
    _Atomic uint32_t rr;         /* round-robin loop choice */
    _Atomic uint64_t next_session;
    _Atomic int closing;  /* set by destroy: sends fail with SH_ECLOSED */
    _Atomic int stopping; /* set by destroy: spawns fail with SH_ECLOSED */

    sh__registry reg;
    uv_mutex_t kinds_mu;
    const sh_actor_vtable *kinds[SH__MAX_KINDS];
    uint32_t n_kinds;

    /* Message pool (mailbox.c). */
    uv_mutex_t pool_mu;
    sh_msg *pool_free;
    uint32_t pool_n;
    sh_msg *mid_free; /* medium blocks kept for reuse (pool_mu); see SH__MAILBOX_MID_* */
    uint32_t mid_n;
    sh_msg *big_free; /* large blocks kept for reuse (pool_mu); see SH__MAILBOX_BIG_* */
    uint32_t big_n;
    uint64_t big_bytes;

    /* Transport hooks: every installed set is kept until destroy so that a sender never reads
     * a freed set (installs are rare). A sender counts itself in hook_users[hook_gen & 1] while
     * it uses the hooks (sh__hooks_enter/leave); sh_transport_set flips hook_gen and waits for
     * the old side to empty, so that when it returns no sender still runs a replaced hook and
     * its owner (a fault layer, a transport) may free the hook's context. */
    _Atomic(sh_transport_hooks *) hooks;
    sh_transport_hooks *hooks_old[16];
    uint32_t n_hooks_old;
    uv_mutex_t hooks_mu;
    _Atomic uint64_t hook_gen;
    _Atomic int hook_users[2];

    /* Waiting for actors to finish (destroy). */
    uv_mutex_t life_mu;
    uv_cond_t life_cv;

    /* Stall watchdog thread. */
    uv_thread_t wd_thread;
    uv_mutex_t wd_mu;
    uv_cond_t wd_cv;
    bool wd_quit, wd_ok;

    sh_metrics *metrics;
    struct {
        sh_counter *sent, *undeliverable, *errors_sent, *timeouts, *late, *stalls, *overloads,
            *pool_hits, *pool_misses, *dropped, *rejected, *corrupt;
        sh_gauge *actors;
    } m;
    sh__peers peers; /* the peer gate (runtime/peers.h) */
};

/* Allocation through the runtime: counted in allocs_live. sh__rt_free accepts NULL. */
void *sh__rt_alloc(sh_runtime *rt, size_t n);            /* zeroed */
void *sh__rt_realloc(sh_runtime *rt, void *p, size_t n); /* p NULL counts a new allocation */
void sh__rt_free(sh_runtime *rt, void *p);
/* Accounts for memory allocated elsewhere (an adopted sh_buf) that sh__rt_free will free. */
void sh__rt_adopted(sh_runtime *rt);

/* Nanoseconds on uv_hrtime()'s monotonic clock. */
uint64_t sh__rt_now(void);

/* Starts a thread of the runtime: it runs the thread_start hook (the engine's placement) first,
 * then fn(arg). Returns once the hook has run, so that no thread of the runtime is ever seen
 * running outside its placement. uv_thread_create's result. */
int sh__rt_thread_create(sh_runtime *rt, uv_thread_t *t, void (*fn)(void *), void *arg);

/* Loops (loop.c). */
sh_err sh__loop_init(sh_runtime *rt, struct sh__loop *l, uint32_t index, sh_error *e);
sh_err sh__loop_start(struct sh__loop *l, sh_error *e);
/* Asks the loop to close its handles and return; joins its thread; closes the libuv loop. */
void sh__loop_stop_join(struct sh__loop *l);
/* Queues actor a to run on its loop unless it already is (takes a reference then). Any thread. */
void sh__loop_schedule(sh_actor_ctx *a);
/* Marks the start and end of a vtable call for the stall detector. Loop thread only. */
void sh__loop_busy_begin(struct sh__loop *l, const sh_actor_ctx *a);
void sh__loop_busy_end(struct sh__loop *l);

/* Stall watchdog (loop_watch.c). */
sh_err sh__loop_watch_start(sh_runtime *rt, sh_error *e);
void sh__loop_watch_stop(sh_runtime *rt);

/* Actors (actor.c). */
void sh__actor_retain(sh_actor_ctx *a);
/* Drops a reference; the last one drains the mailbox and frees the actor. Any thread. */
void sh__actor_release(sh_actor_ctx *a);
/* Moves a to STOPPING and schedules it. Returns SH_ENOTFOUND when it was already stopping. */
sh_err sh__actor_stop_ref(sh_actor_ctx *a);
/* Runs the stop sequence on the loop thread: stop member, sessions, timers, state, registry,
 * queued messages. */
void sh__actor_finish(struct sh__loop *l, sh_actor_ctx *a);
/* Frees every queued message of a, answering requests with ERROR `code`. Consumer only. */
void sh__actor_drain(sh_actor_ctx *a, sh_err code);

/* Sending (actor_send.c). */
/* Builds a message from a header and an encoded body (NULL/0: an empty map). */
sh_err sh__actor_msg_build(sh_runtime *rt, const sh_msg_hdr *h, const void *body, size_t body_len,
                           sh_msg **out, sh_error *e);
/* Builds a message whose whole frame writer() writes (checked with sh__msg_decode). */
sh_err sh__actor_msg_write(sh_runtime *rt, const sh_msg_hdr *h, sh_frame_writer writer,
                           const void *body, sh_msg **out, sh_error *e);
/* Builds the ERROR answering request header `req` (from req->dst to req->src, same session). */
sh_err sh__actor_msg_error(sh_runtime *rt, const sh_msg_hdr *req, sh_err code, const char *text,
                           sh_msg **out);
/* Routes m: filter, local mailbox or transport. On SH_OK m is consumed; otherwise it stays with
 * the caller. */
sh_err sh__actor_route(sh_runtime *rt, sh_msg *m, sh_error *e);
/* Answers m with an ERROR `code` when it is a request (session != 0, not a reply, not an ERROR,
 * a sender to answer), then frees m. */
void sh__actor_bounce(sh_msg *m, sh_err code);
/* Pushes m into a's mailbox and schedules a. a is INIT or RUNNING; the caller holds a ref. */
void sh__actor_enqueue(sh_actor_ctx *a, sh_msg *m);

#endif
