/* The degradation ladder, applied (issue 12, DESIGN.md section 7; docs/serving.md,
 * "Degradation"): a loaded policy script, the level in force, the hysteresis that holds it, and
 * what each level does to a request.
 *
 * Every tick (the watchdog's, or the "degrade" actor's timer below) sh__degrade_tick() reads the
 * process's metrics registry, calls the policy's level(m), applies the hysteresis and publishes
 * the level; the gateway reads it once per request (sh__degrade_level(), any thread) and applies
 * the effects of every level up to it (sh__degrade_apply()):
 *
 *   1  logprobs are not computed (the request is served without them);
 *   2  max_tokens is capped at max_tokens;
 *   3  requests for any other model go to the `fallback` model's replicas (text prompts only);
 *   4  requests of priority shed_priority or above (lower numbers run first) get 503 with
 *      Retry-After.
 *
 * Hysteresis: a higher level takes effect at the first tick that returns it; a lower one only
 * once level() has returned lower than the level in force at every tick for hold_ms, and then
 * the highest of those answers takes effect. A tick whose call fails (the script errors, runs
 * past its time or memory limit, returns a non-integer or a level outside 0..4) keeps the level
 * and interrupts a hold; its error is logged and noted once per distinct message, not at every
 * tick. */
#ifndef SH_ACTORS_DEGRADE_H
#define SH_ACTORS_DEGRADE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lua/config.h"
#include "net/openai.h"
#include "shoal/runtime.h"

typedef struct sh_degrade sh_degrade;

typedef struct sh_degrade_opts {
    /* A script path, or NULL, "default" or "lua/policy/default.lua": the built-in copy of
     * lua/policy/default.lua (sh_policy_default_lua), found wherever the binary runs. */
    const char *policy;
    uint32_t hold_ms;       /* see above */
    int32_t max_tokens;     /* level 2's cap; 0: 64 */
    const char *fallback;   /* level 3's model name; NULL: level 3 changes nothing */
    int32_t shed_priority;  /* level 4; 0 sheds every request, 256 none */
    uint32_t retry_after_s; /* Retry-After of level 4's 503s; 0: hold_ms rounded up, at least 1 */
    /* Where the metrics come from and where the level gauge and the counters go (the runtime's
     * registry), and the log. Required; must outlive the object. */
    sh_runtime *rt;
    /* Optional: called (on the ticking thread, or the reloading one for "policy") for each level
     * change ("level", msg "0 -> 2: queue_depth=9 ...") and each reload ("policy"), for the
     * front's event ring (actors/cluster_events.h). */
    void (*note)(void *user, const char *kind, const char *msg);
    void *note_user;
    /* Optional: more metrics for level(m), written into out (at most cap) on the ticking thread
     * (and once by create, on its thread, for the names of the first load's trial call);
     * returns how many. Names must stay valid until the next call. */
    size_t (*extra)(void *user, sh_policy_metric *out, size_t cap);
    void *extra_user;
    uint32_t tick_ms; /* the "degrade" actor's period (below); 0: 100 */
} sh_degrade_opts;

/* Creates the object and loads the policy (a trial call with zero metrics included). Returns
 * SH_OK, SH_EINVAL (no rt, a bad setting), SH_ENOMEM, or the policy's load error (SH_EIO,
 * SH_ELUA, SH_EINVAL, SH_ETIMEDOUT, ...) with the script's file:line in e; nothing is left
 * allocated on failure. Registers shoal_degradation_level (gauge), shoal_degraded_requests_total
 * (counter by effect: logprobs, max_tokens, fallback, shed), shoal_policy_errors_total and
 * shoal_policy_reloads_total (by result: ok, error) in rt's registry. Any thread. */
sh_err sh__degrade_create(const sh_degrade_opts *o, sh_degrade **out, sh_error *e);

/* Frees d; accepts NULL. No tick, reload or apply may run or follow. */
void sh__degrade_destroy(sh_degrade *d);

/* One evaluation at now_ms (CLOCK_MONOTONIC ms, non-decreasing): gathers the metrics (below),
 * calls level(m) and updates the level as described above; logs a level change
 * (event=degradation_level, with the metrics that caused it) and notes it. The metrics, by
 * name, summed over every replica in the registry:
 *   queue_wait_p50_ms, queue_wait_p99_ms  how long the sequences first admitted in the last
 *                       5 s waited in their batcher's queue (shoal_queue_wait_seconds); 0 when
 *                       none was admitted
 *   ttft_p50_ms, ttft_p99_ms  time to first token of the requests that got their first token in
 *                       the same window (queue wait plus prefill, as the gateway measures it)
 *   step_latency_p99_ms  shoal_step_seconds over the same window
 *   queue_depth         sequences waiting for admission (shoal_requests_waiting)
 *   running_seqs        sequences running (shoal_requests_running)
 *   requests            queue_depth + running_seqs
 *   kv_used             KV blocks used / total (0..1)
 *   tokens_per_s        tokens generated per second over the window
 *   replicas, healthy_replicas  batchers, and those neither paused nor taken out of routing
 *   front_rss_mb        resident memory of this process
 *   level               the level in force before this tick
 * plus the extra callback's. Called on one thread at a time (the watchdog's loop); it takes the
 * policy lock, so a reload on another thread waits for it (and it for a reload). */
void sh__degrade_tick(sh_degrade *d, uint64_t now_ms);

/* sh__degrade_tick with d as user: the watchdog's tick hook (sh_watchdog_args.tick). */
void sh__degrade_tick_cb(void *user, uint64_t now_ms);

/* Loads the policy again from the path it was created with (or the built-in default). On
 * success the new script replaces the old one; on failure the old one stays in force. Either way
 * the outcome is logged (event=policy_reload), noted ("policy") and counted, and msg (cap bytes)
 * says it in one line: "reloaded PATH" or the error with file:line. Returns SH_OK or the load's
 * error. Any thread (waits for a tick in progress). */
sh_err sh__degrade_reload(sh_degrade *d, char *msg, size_t cap);

/* The level in force, 0..4. Any thread (an atomic load). */
int32_t sh__degrade_level(const sh_degrade *d);

/* The policy's path as given at creation ("default" for the built-in one). */
const char *sh__degrade_policy(const sh_degrade *d);

/* What sh__degrade_apply() did to a request. */
enum {
    SH_DEGRADE_LOGPROBS = 1 << 0,   /* logprobs dropped */
    SH_DEGRADE_MAX_TOKENS = 1 << 1, /* max_tokens lowered to the cap */
    SH_DEGRADE_FALLBACK = 1 << 2,   /* q->model now names the fallback model */
    SH_DEGRADE_SHED = 1 << 3,       /* the request must be answered 503 (nothing else changed) */
};

typedef struct sh_degrade_effect {
    int32_t level;          /* the level applied */
    uint32_t what;          /* SH_DEGRADE_* bits */
    char header[160];       /* the X-Shoal-Degraded value ("logprobs, max_tokens=64"), or "" */
    uint32_t retry_after_s; /* with SH_DEGRADE_SHED */
    int32_t priority;       /* the request's priority class (max of key and request) */
    int32_t shed_priority;  /* with SH_DEGRADE_SHED */
} sh_degrade_effect;

/* Applies the level in force to the parsed request q, whose key has priority key_prio: changes
 * q in place (logprobs, top_logprobs, max_tokens; q->model is pointed at `fallback_name`, which
 * the caller passes when it serves the fallback model, else NULL) and counts each effect in
 * shoal_degraded_requests_total. Only what changes the request counts: a request without
 * logprobs is not degraded at level 1. A request with a token-id prompt is never sent to the
 * fallback (its ids belong to the model asked for). d may be NULL (nothing happens). Any thread. */
void sh__degrade_apply(sh_degrade *d, sh_openai_request *q, int32_t key_prio,
                       const char *fallback_name, sh_degrade_effect *out);

/* The fallback model's name (opts.fallback), or NULL. */
const char *sh__degrade_fallback(const sh_degrade *d);

/* The settings in force (defaults applied). */
typedef struct sh_degrade_settings {
    uint32_t hold_ms, retry_after_s;
    int32_t max_tokens, shed_priority;
} sh_degrade_settings;
void sh__degrade_settings(const sh_degrade *d, sh_degrade_settings *out);

/* Kind "degrade": spawned with an sh_degrade * as its argument (which must outlive the actor),
 * it ticks it every opts.tick_ms on its loop, for a process without a watchdog to do it. */

extern const sh_actor_vtable sh__degrade_vtable;

#endif
