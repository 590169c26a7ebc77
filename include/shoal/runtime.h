/* The actor runtime: loops, actors, mailboxes, sending, sessions, timers, logs and metrics. */
#ifndef SHOAL_RUNTIME_H
#define SHOAL_RUNTIME_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "shoal/addr.h"
#include "shoal/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A runtime (DESIGN.md section 2) is one node: N control loops (libuv, one thread each), the
 * actors pinned to them, a registry from sh_addr to actor, a pool of message buffers, a stall
 * watchdog thread, a logger and a metrics registry. Nothing is process-global: several runtimes
 * live side by side in one process (that is how the tests run a cluster) and never see each
 * other unless a transport connects them.
 *
 * Threads. "Any thread" below means any thread of the process, including loop threads, unless
 * the text says "loop thread only" (the calling actor's own loop, i.e. inside one of its vtable
 * members). No runtime call blocks a loop except sh_runtime_destroy(), which must not be called
 * from a loop thread.
 *
 * Messages are frames: the msgpack envelope of runtime/msg.h with its body. A local send encodes
 * the same frame a remote send would put on the wire and queues it in the destination's mailbox
 * (the socket is skipped, the bytes are the same). Types from runtime/msg.h (sh_msg_hdr, the
 * SH_MSG_* message types) and runtime/proto.h (typed bodies) are used with this API. */

struct sh_msg_hdr; /* runtime/msg.h */
struct sh_buf;     /* runtime/mpack_write.h */

typedef struct sh_runtime sh_runtime;
typedef struct sh_actor_ctx sh_actor_ctx; /* an actor as its own vtable members see it */
typedef struct sh_msg sh_msg;             /* one message: its frame and decoded envelope */
typedef struct sh_metrics sh_metrics;

/* ---- Logging ---------------------------------------------------------------------------- */

/* Zero is not a level, so that zeroed options mean the default (INFO). */
typedef enum sh_log_level {
    SH_LOG_LEVEL_ERROR = 1,
    SH_LOG_LEVEL_WARN = 2,
    SH_LOG_LEVEL_INFO = 3,
    SH_LOG_LEVEL_DEBUG = 4,
    SH_LOG_LEVEL_TRACE = 5,
} sh_log_level;

/* A log sink: receives one complete line (no trailing newline, NUL-terminated, len bytes) on the
 * thread that logged; it must be thread-safe and must not call back into the runtime. */
typedef void (*sh_log_fn)(void *ud, sh_log_level level, const char *line, size_t len);

/* ---- Runtime ---------------------------------------------------------------------------- */

/* Final counters, filled by sh_runtime_destroy() after everything has been freed (see
 * sh_runtime_opts.final_stats) or read live with sh_runtime_stats(). The *_live fields are what
 * a clean shutdown must bring to zero. */
typedef struct sh_runtime_stats {
    uint64_t actors_live;   /* actors spawned and not yet freed */
    uint64_t msgs_live;     /* messages allocated and not yet freed (queued, held or in flight) */
    uint64_t handles_live;  /* libuv handles initialised and not yet closed */
    uint64_t allocs_live;   /* allocations made through the runtime and not yet freed */
    uint64_t threads_live;  /* loop and watchdog threads started and not yet joined */
    uint64_t msgs_sent;     /* frames accepted by sh_send*() and sh_transport_deliver() */
    uint64_t msgs_handled;  /* calls of a vtable's handle */
    uint64_t undeliverable; /* messages whose local destination was unknown or stopped */
    uint64_t errors_sent;   /* ERROR answers the runtime generated for undeliverable requests */
    uint64_t timeouts;      /* requests whose deadline passed (ERROR SH_ETIMEDOUT delivered) */
    uint64_t late_replies;  /* replies that arrived after their request timed out (dropped) */
    uint64_t stalls;        /* handle calls that ran past the stall threshold */
    uint64_t overloads;     /* mailbox depth crossings of the warning threshold */
    uint64_t pool_hits;     /* message buffers served from the pool (no malloc) */
    uint64_t pool_misses;   /* message buffers that needed malloc */
    uint64_t corrupt;       /* received frames whose checksum failed (dropped unanswered) */
} sh_runtime_stats;

typedef struct sh_runtime_opts {
    uint32_t node_id;       /* this node's id, non-zero; the high half of every local sh_addr */
    const char *name;       /* node name for logs (copied); NULL: "node<id>" */
    uint32_t n_loops;       /* control loops, one thread each; 0: 1; at most 64 */
    uint32_t max_turns;     /* messages one actor handles per wake-up before yielding; 0: 64 */
    uint32_t mailbox_warn;  /* mailbox depth that logs an overload warning; 0: 10000 */
    uint32_t stall_ms;      /* a handle call longer than this is reported; 0: 1000 */
    uint32_t late_grace_ms; /* how long a timed-out session is remembered to drop its late
                               reply; 0: 60000 */
    sh_log_level log_level; /* lines above this level are not formatted; 0: INFO */
    sh_log_fn log_fn;       /* sink; NULL: write lines to log_file */
    void *log_ud;           /* passed to log_fn */
    FILE *log_file;         /* used when log_fn is NULL; NULL: stderr */
    sh_runtime_stats *final_stats; /* when set, destroy writes the final counters here */
    /* Called first on every thread the runtime starts (its loops, its watchdog, a fault layer's
     * timer), before it does anything else, e.g. to place it on CPUs; the call that starts the
     * thread returns only after it ran. NULL: nothing. */
    void (*thread_start)(void *ud);
    void *thread_start_ud;
} sh_runtime_opts;

/* Creates a runtime and starts its loop threads and watchdog. *out is set on success only.
 * Returns SH_EINVAL (node_id 0, n_loops > 64), SH_ENOMEM, or SH_EIO when a libuv loop or thread
 * cannot start (the libuv text in e); on failure nothing is left running or allocated. Any
 * thread. */
sh_err sh_runtime_create(const sh_runtime_opts *opts, sh_runtime **out, sh_error *e);

/* Shuts down and frees: stops every actor (calling its vtable's stop on its loop), waits for
 * them, answers requests still queued with ERROR (SH_ECLOSED) where the requester is still
 * alive or remote, frees every queued message, closes every libuv handle, joins every thread,
 * frees the pools and fills opts.final_stats. Accepts NULL. Not from a loop thread (it would
 * wait for itself); not concurrently with other calls on the same runtime from other threads
 * that create actors. Blocks while a handle call is stuck (the stall detector logs it). */
void sh_runtime_destroy(sh_runtime *rt);

/* Current counters (relaxed reads; exact once the runtime is quiescent). Any thread. */
void sh_runtime_stats_get(sh_runtime *rt, sh_runtime_stats *out);

/* This node's id. Any thread. */
uint32_t sh_runtime_node(const sh_runtime *rt);

/* The runtime's metrics registry (owned by the runtime, valid until destroy). Any thread. */
sh_metrics *sh_runtime_metrics(sh_runtime *rt);

/* Writes one log line: `ts=<unix seconds>.<micro> level=<lvl> node=<name> event=<event>`
 * followed by " " and the formatted key=value tail when fmt is not NULL/empty. Values that may
 * hold spaces should be quoted by the caller. Lines are cut at 1 KiB. Any thread. */
void sh_runtime_log(sh_runtime *rt, sh_log_level level, const char *event, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* ---- Actors ----------------------------------------------------------------------------- */

/* What the runtime does with a message after handle returns. */
typedef enum sh_msg_fate {
    SH_MSG_FATE_DONE = 0, /* the runtime frees the message */
    SH_MSG_FATE_KEPT = 1, /* the actor keeps it and frees it later with sh_msg_free() */
} sh_msg_fate;

/* An actor kind. The vtable is const, registered by pointer and must outlive every runtime it is
 * registered with (a static const object). Every member runs on the actor's loop thread, never
 * concurrently with another member of the same actor, and must not block: long work goes to an
 * executor and completes back through a message. */
typedef struct sh_actor_vtable {
    const char *name;  /* kind name, unique per runtime, [a-z0-9_]+, at most 31 bytes; required */
    size_t state_size; /* bytes of zeroed state the runtime allocates per actor (may be 0) */
    /* Optional. Called once on the loop thread before the first message, with the spawn's arg.
     * Returning an error stops the actor (stop is not called; queued requests get ERROR) and
     * logs the code. May send, request and start timers. */
    sh_err (*init)(sh_actor_ctx *ctx, void *state, void *arg);
    /* Required. One message at a time. `msg` is owned by the runtime for the call; return
     * SH_MSG_FATE_KEPT to keep it (the actor then owns it and must sh_msg_free() it). Replies to
     * this actor's requests, timeouts (ERROR SH_ETIMEDOUT) and undeliverable-request errors
     * arrive here too. */
    sh_msg_fate (*handle)(sh_actor_ctx *ctx, void *state, sh_msg *msg);
    /* Optional. Called once on the loop thread when the actor stops (sh_actor_stop() or runtime
     * shutdown) and its init succeeded (an actor stopped before its init ran gets neither init
     * nor stop: its state was never touched); it must free what the state owns (kept messages
     * included). The runtime frees the state itself afterwards. */
    void (*stop)(sh_actor_ctx *ctx, void *state);
    /* Optional; required for sh_actor_timer_start(). A timer fired, with the tag it was started
     * with. */
    void (*timer)(sh_actor_ctx *ctx, void *state, uint64_t tag);
} sh_actor_vtable;

/* Registers an actor kind. Returns SH_EINVAL (NULL vt, missing name or handle, a bad name, or
 * stop/timer/init given with an inconsistent state: init or stop with state_size 0 is allowed;
 * a NULL handle is not) with the reason in e, SH_EBUSY when a different vtable already holds the
 * name (registering the same pointer again is SH_OK), SH_ENOMEM. Any thread. */
sh_err sh_runtime_register(sh_runtime *rt, const sh_actor_vtable *vt, sh_error *e);

#define SH_ACTOR_LOOP_ANY (-1) /* spawn: pick a loop round robin */

/* Spawns an actor of the registered kind `kind` on loop `loop` (0..n_loops-1 or
 * SH_ACTOR_LOOP_ANY) and sets *addr to its address: this node's id and a fresh actor id, never
 * reused while the runtime lives. The address is valid at once: messages sent to it queue until
 * init has run on the loop thread. `arg` is handed to init unchanged: what it points to must
 * stay valid until init has run (or be owned by init). Returns SH_ENOTFOUND (unknown kind),
 * SH_EINVAL (bad loop), SH_ECLOSED (the runtime is shutting down), SH_ERANGE (actor ids
 * exhausted), SH_ENOMEM; on failure nothing was spawned. Any thread. */
sh_err sh_actor_spawn(sh_runtime *rt, const char *kind, void *arg, int loop, sh_addr *addr,
                      sh_error *e);

/* Asks the actor at `addr` to stop. Asynchronous: it stops on its loop after the message it is
 * handling (if any); messages still queued are freed, requests among them answered with ERROR
 * (SH_ECLOSED). The address is never reused. Returns SH_ENOTFOUND when there is no such live
 * actor on this node (already stopped included), SH_EINVAL for another node's address. Any
 * thread, including the actor itself. */
sh_err sh_actor_stop(sh_runtime *rt, sh_addr addr);

/* The calling actor's address, runtime, loop index and kind name. Loop thread only. */
sh_addr sh_actor_self(const sh_actor_ctx *ctx);
sh_runtime *sh_actor_runtime(const sh_actor_ctx *ctx);
uint32_t sh_actor_loop(const sh_actor_ctx *ctx);
const char *sh_actor_kind(const sh_actor_ctx *ctx);

/* Like sh_runtime_log() with `actor=<kind>#<id>` added. Loop thread only. */
void sh_actor_log(sh_actor_ctx *ctx, sh_log_level level, const char *event, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* Starts a timer that calls the kind's `timer` member with `tag` after `ms` milliseconds, then
 * every `repeat_ms` when that is non-zero. Timers share the loop's deadline heap (no libuv handle
 * per timer) and die with the actor. *id (may be NULL) names it for sh_actor_timer_stop().
 * Returns SH_EINVAL when the kind has no timer member, SH_ENOMEM. Loop thread only. */
sh_err sh_actor_timer_start(sh_actor_ctx *ctx, uint32_t ms, uint32_t repeat_ms, uint64_t tag,
                            uint64_t *id);

/* Cancels a timer of the calling actor. Returns SH_ENOTFOUND when it already fired (one-shot)
 * or was stopped. Loop thread only. */
sh_err sh_actor_timer_stop(sh_actor_ctx *ctx, uint64_t id);

/* ---- Messages --------------------------------------------------------------------------- */

/* Writes one whole frame for header h and typed body `body` into b: the signature of
 * sh__proto_encode() (runtime/proto.h), which is the usual writer. Returns SH_OK or an error
 * with b rolled back. */
typedef sh_err (*sh_frame_writer)(struct sh_buf *b, const struct sh_msg_hdr *h, const void *body,
                                  sh_error *e);

/* The decoded envelope, the body (one msgpack map, a view into the frame) and the whole frame.
 * Valid until the message is freed. Any thread that owns the message. */
const struct sh_msg_hdr *sh_msg_header(const sh_msg *m);
const void *sh_msg_body(const sh_msg *m, size_t *len);
const void *sh_msg_frame(const sh_msg *m, size_t *len);

/* For an ERROR message: its code (SH_ETIMEDOUT for a request whose deadline passed,
 * SH_ENOTFOUND/SH_ECLOSED for an undeliverable one, or whatever a peer sent). Returns SH_EPROTO
 * when m is not a well-formed ERROR. */
sh_err sh_msg_error_code(const sh_msg *m);

/* Frees a message the caller owns (a kept message). Accepts NULL. Any thread. */
void sh_msg_free(sh_msg *m);

/* Sends h (type, session, src, dst, trace_id) with `body_len` bytes of an already encoded body
 * (one msgpack map; copied into the frame). A local destination gets it in its mailbox; another
 * node's goes to the transport. A local destination that does not exist or has stopped does not
 * make the send fail: the message is dropped, counted, and when it is a request (session != 0,
 * not itself a reply or an ERROR) the sender gets an ERROR (SH_ENOTFOUND) with the same session
 * - the same thing a remote node would do. Returns SH_EINVAL (unknown type, dst 0),
 * SH_EUNSUPPORTED (remote destination and no transport), SH_ECLOSED (runtime shutting down),
 * SH_ENOMEM, or the transport's error; nothing was sent on failure. Any thread. */
sh_err sh_send(sh_runtime *rt, const struct sh_msg_hdr *h, const void *body, size_t body_len,
               sh_error *e);

/* As sh_send() with the frame written by writer(b, h, body, e), e.g. sh__proto_encode with an
 * sh_proto_<type> body. The frame is checked with sh__msg_decode(). */
sh_err sh_send_with(sh_runtime *rt, const struct sh_msg_hdr *h, sh_frame_writer writer,
                    const void *body, sh_error *e);

/* Sends a message from the calling actor (src = self, session 0, trace 0). Loop thread only.
 * Returns as sh_send(). */
sh_err sh_actor_send(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, const void *body,
                     size_t body_len, sh_error *e);

/* Sends a request from the calling actor: a fresh session id (never 0, unique in this runtime)
 * is set in the envelope, registered as pending on the actor, and returned in *session. Exactly
 * one answer arrives later in handle with that session: the reply, or an ERROR (the request was
 * undeliverable, or SH_ETIMEDOUT when `deadline_ms` passed first; a reply after that is dropped
 * and counted as late). The pending session's deadline lives in the loop's timer heap. Returns
 * as sh_send(); on failure nothing is pending. Loop thread only. */
sh_err sh_request(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, const void *body, size_t body_len,
                  uint32_t deadline_ms, uint64_t *session, sh_error *e);
sh_err sh_request_with(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, sh_frame_writer writer,
                       const void *body, uint32_t deadline_ms, uint64_t *session, sh_error *e);

/* Answers request `req` (any message with a session): type/body go to req's src with req's
 * session and trace id, from the calling actor. A reply is never answered with an ERROR when its
 * destination is gone. Returns as sh_send(); req is not consumed. Loop thread only. */
sh_err sh_reply(sh_actor_ctx *ctx, const sh_msg *req, uint32_t type, const void *body,
                size_t body_len, sh_error *e);
sh_err sh_reply_with(sh_actor_ctx *ctx, const sh_msg *req, uint32_t type, sh_frame_writer writer,
                     const void *body, sh_error *e);

/* ---- Transport hooks -------------------------------------------------------------------- */

/* What the fault-injection layer decides for one outgoing message. */
typedef enum sh_send_verdict {
    SH_SEND_VERDICT_PASS = 0, /* deliver normally */
    SH_SEND_VERDICT_DROP = 1, /* the runtime frees it (counted as dropped); the send succeeds */
    SH_SEND_VERDICT_TAKEN = 2 /* the hook owns it now and re-injects it later with
                                 sh_transport_reinject() (delay, duplicate) or frees it */
} sh_send_verdict;

/* Who owns a frame buffer that changes hands without a copy (a received nng_msg adopted by the
 * runtime, or a transport buffer the runtime builds an outgoing frame in): release(ctx, handle)
 * frees or recycles it and is called exactly once, on whichever thread drops the buffer last
 * (any thread). The struct itself is copied by whoever takes the buffer. */
typedef struct sh_frame_owner {
    void (*release)(void *ctx, void *handle);
    void *ctx;
    void *handle; /* e.g. the nng_msg whose body the frame is */
} sh_frame_owner;

/* Set by the transport module (NNG) and the fault-injection layer. Every member is optional and
 * called on the sending thread (any thread, loop threads included): none may block or call
 * sh_send* re-entrantly on the same thread's stack for the same message. */
typedef struct sh_transport_hooks {
    void *ctx;
    /* Sends one frame to node `node` (!= this node), already sealed (its CRC-32C trailer
     * included in len: runtime/msg.h). The frame is borrowed for the call: copy it
     * (into an nng_msg). Return SH_OK when queued; an error fails the sh_send*() with that code
     * (e filled), the caller keeping its message. NULL: remote sends fail with SH_EUNSUPPORTED. */
    sh_err (*send_frame)(void *ctx, uint32_t node, const uint8_t *frame, size_t len, sh_error *e);
    /* Sees every message, local or remote, before delivery (fault injection, tracing); a
     * message for another node is sealed before (sh_msg_frame() returns its trailer too). */
    sh_send_verdict (*filter)(void *ctx, sh_msg *m);
    /* Optional, zero-copy send (with frame_alloc). Like send_frame, but takes the buffer: on
     * SH_OK the hook owns `frame` and releases it through *owner exactly once (a transport that
     * recognises its own owner sends the buffer without copying; any other it copies and
     * releases at once); on an error the caller keeps it and nothing was released. The runtime
     * calls it for messages built in a frame_alloc buffer (or adopted with
     * sh_transport_deliver_owned() and forwarded); others go through send_frame. */
    sh_err (*send_owned)(void *ctx, uint32_t node, uint8_t *frame, size_t len,
                         const sh_frame_owner *owner, sh_error *e);
    /* Optional, with send_owned. Returns a buffer of at least cap bytes for a frame to `node`
     * that send_owned can take without copying and fills *owner (the caller then owns it and
     * releases it through the owner when it does not send it), or NULL when it cannot (the
     * runtime then uses its own memory). The runtime asks for frames larger than its pooled
     * message blocks only. */
    uint8_t *(*frame_alloc)(void *ctx, uint32_t node, size_t cap, sh_frame_owner *owner);
} sh_transport_hooks;

/* Installs (copies) hooks, or removes them with NULL. Call before traffic flows, from any
 * thread but never from inside a hook; concurrent senders see the old or the new set, never a
 * mix. Returns once no sender is still inside the replaced set's calls, so that its ctx may be
 * freed then. Returns SH_ENOMEM. */
sh_err sh_transport_set(sh_runtime *rt, const sh_transport_hooks *hooks);

/* A frame received from another node, sealed by the sender's runtime (runtime/msg.h): copied
 * into a message, its CRC-32C trailer checked and stripped, decoded with sh__msg_decode()
 * (limits of runtime/msg.h) and delivered like a local send (undeliverable requests answered).
 * A frame whose checksum fails is counted (sh_runtime_stats.corrupt and the metric
 * shoal_frames_corrupt_total), logged and dropped unanswered, returning SH_EFORMAT: none of its
 * fields can be trusted. A frame that fails decoding is counted, logged and, when its envelope
 * got as far as the session and src (and the session is non-zero), answered with ERROR
 * (SH_EPROTO) through the transport. Returns the decode error or SH_OK; the caller keeps
 * `frame`. Any thread. */
sh_err sh_transport_deliver(sh_runtime *rt, const void *frame, size_t len, sh_error *e);

/* As sh_transport_deliver() without the copy: the message adopts `frame` (len bytes, e.g. the
 * body of a received nng_msg) and decodes it in place. Ownership: on SH_OK the runtime owns the
 * buffer and calls owner->release exactly once, when the message is freed (by the runtime, an
 * actor that kept it, or a transport it was forwarded to), on any thread; the frame must stay
 * valid and unchanged until then. On any error (a frame that fails decoding included, which is
 * still counted, logged and answered as above) the caller keeps the buffer and release is not
 * called. Any thread. */
sh_err sh_transport_deliver_owned(sh_runtime *rt, uint8_t *frame, size_t len,
                                  const sh_frame_owner *owner, sh_error *e);

/* Re-injects a message a filter TAKE-ed: delivered without passing the filter again. Ownership
 * moves to the runtime on SH_OK; otherwise the caller keeps m. Any thread. */
sh_err sh_transport_reinject(sh_runtime *rt, sh_msg *m, sh_error *e);

/* ---- Metrics ---------------------------------------------------------------------------- */

typedef struct sh_counter sh_counter;
typedef struct sh_gauge sh_gauge;
typedef struct sh_histogram sh_histogram;

#define SH_HISTOGRAM_MAX_BUCKETS 32

/* A standalone registry (the runtime has its own, sh_runtime_metrics()). Returns SH_ENOMEM. */
sh_err sh_metrics_create(sh_metrics **out);
/* Frees the registry and every metric in it. Accepts NULL. No concurrent users. */
void sh_metrics_destroy(sh_metrics *m);

/* Registers one series: `name` ([a-zA-Z_:][a-zA-Z0-9_:]*), `help` (one line, \ and newlines
 * escaped on output) and `labels`, the label set as Prometheus writes it between braces
 * (`loop="0",kind="batcher"`; NULL or "" for none; the caller escapes values). Series of one name
 * render together under one HELP/TYPE; the first registration's help wins. Registering the same
 * name and labels again returns the existing series. Returns SH_EINVAL (bad name or labels, a
 * name already used by another metric type, histogram bounds not strictly increasing, 0 or more
 * than SH_HISTOGRAM_MAX_BUCKETS bounds), SH_ENOMEM. The pointer stays valid until the registry
 * is destroyed. Any thread (registration takes a lock; updates do not). */
sh_err sh_metrics_counter(sh_metrics *m, const char *name, const char *help, const char *labels,
                          sh_counter **out);
sh_err sh_metrics_gauge(sh_metrics *m, const char *name, const char *help, const char *labels,
                        sh_gauge **out);
sh_err sh_metrics_histogram(sh_metrics *m, const char *name, const char *help, const char *labels,
                            const double *bounds, uint32_t n_bounds, sh_histogram **out);

/* Updates: lock-free atomics, any thread. */
void sh_counter_add(sh_counter *c, uint64_t n);
uint64_t sh_counter_value(const sh_counter *c);
void sh_gauge_set(sh_gauge *g, int64_t v);
void sh_gauge_add(sh_gauge *g, int64_t d);
int64_t sh_gauge_value(const sh_gauge *g);
void sh_histogram_observe(sh_histogram *h, double v);

/* Renders every metric in Prometheus text format 0.0.4 into buf (cap bytes, NUL-terminated):
 * `# HELP`, `# TYPE`, one line per series; histograms as cumulative `_bucket{le="..."}` lines
 * ending with le="+Inf", then `_sum` and `_count`. Sets *len to the full length (excluding the
 * NUL) even when it did not fit; returns SH_ERANGE when cap was too small (buf holds a cut
 * prefix). Any thread. */
sh_err sh_metrics_render(sh_metrics *m, char *buf, size_t cap, size_t *len);

/* One series as a value: what sh_metrics_foreach() visits and what sh_metrics_render_with()
 * renders beside a registry (another node's series). */
typedef enum sh_metric_kind {
    SH_METRIC_COUNTER = 0,
    SH_METRIC_GAUGE = 1,
    SH_METRIC_HISTOGRAM = 2,
} sh_metric_kind;

#define SH_METRICS_SAMPLE_MAX_BOUNDS 256 /* histogram bounds of an extra sample */

typedef struct sh_metric_sample {
    const char *name;   /* the family's name, without labels */
    const char *help;   /* the family's help ("" or NULL when unknown) */
    const char *labels; /* the label set as sh_metrics_counter() takes it ("" or NULL: none) */
    sh_metric_kind kind;
    double value;           /* a counter's or gauge's value */
    uint32_t n_bounds;      /* a histogram's upper bounds, strictly increasing */
    const double *bounds;   /* (n_bounds) */
    const uint64_t *counts; /* (n_bounds + 1) per bucket, not cumulative; the last is +Inf */
    double sum;             /* a histogram's sum of observations */
} sh_metric_sample;

/* Called once per series; the sample and what it points to are valid for the call only. */
typedef void (*sh_metrics_visit_fn)(void *arg, const sh_metric_sample *s);

/* Visits every series of the registry, family by family in registration order, under the
 * registry's lock: fn must not call into the same registry (registering, rendering) and should
 * be quick. Updates racing with the visit are seen or not, each value read atomically. Any
 * thread. */
void sh_metrics_foreach(sh_metrics *m, sh_metrics_visit_fn fn, void *arg);

/* As sh_metrics_render() with the n_extra samples of `extra` (borrowed for the call) rendered
 * too, each family's lines together under one HELP/TYPE: an extra of a family the registry has
 * follows the registry's own series (left out when its kind differs); families only the extras
 * have follow the registry's, in name order, under the first sample's kind and the first
 * non-empty help (samples of another kind left out). Extras that cannot be rendered as valid
 * text are left out: a bad name, a malformed label set (sh_metrics_counter()'s rules) or one
 * holding a label twice, a histogram with an `le` label or more than
 * SH_METRICS_SAMPLE_MAX_BOUNDS bounds. The caller keeps each extra's series unique (no two with
 * one name and label set, nor one the registry has). Returns as sh_metrics_render(), or
 * SH_ENOMEM. Any thread. */
sh_err sh_metrics_render_with(sh_metrics *m, const sh_metric_sample *extra, size_t n_extra,
                              char *buf, size_t cap, size_t *len);

/* Writes into buf (cap bytes, NUL-terminated) the label set `labels` (len bytes, not
 * NUL-terminated; sh_metrics_counter()'s form, none when len is 0) with `name="value"` added
 * last (value escaped: \\, \" and newline). A label of that name already in the set is kept as
 * `exported_<name>`, in its place (Prometheus's rule for a scraped series whose label clashes
 * with a target's). Returns SH_OK, SH_EINVAL (a malformed set, a label twice, a bad label name,
 * or a set holding both name and exported_<name>), SH_ERANGE (cap too small; buf holds a cut
 * prefix). Any thread. */
sh_err sh_metrics_labels_add(const char *labels, size_t len, const char *name, const char *value,
                             char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
