/* Runs a fault scenario (the events of base/fault_event.h, which the Lua loader of lua/config.h
 * fills from a script) against fault layers (shoal/fault.h) and host callbacks. It touches no Lua:
 * the runtime knows the events as data, never the scripts. */
#ifndef SH_RUNTIME_FAULT_SCENARIO_H
#define SH_RUNTIME_FAULT_SCENARIO_H

#include "base/fault_event.h"
#include "shoal/err.h"
#include "shoal/fault.h"

/* What the host provides for the process-level actions and for names. Called on the runner's
 * thread; none may block for long (a kill that waits for a child is fine, it delays later
 * events by as much). */
typedef struct sh_fault_host {
    void *ud;
    /* The node id of a node name; 0 when unknown (the event then fails with SH_ENOTFOUND).
     * Required for link events. "*" never reaches it. */
    uint32_t (*node_id)(void *ud, const char *name);
    /* kill "node": destroy its runtime or kill its process. NULL: kill events fail. */
    sh_err (*kill)(void *ud, const char *node);
    /* stall{ actor, ms }: make the actor ("node" or "node/actor") stop handling for ms. */
    sh_err (*stall)(void *ud, const char *actor, double ms);
    /* stop "node" (SIGSTOP, SIGCONT after lasting_s when it is > 0) and cont "node" (SIGCONT):
     * kind is SH_FAULT_STOP or SH_FAULT_CONT. NULL: those events fail. */
    sh_err (*stop_cont)(void *ud, const char *node, sh_fault_kind kind, double lasting_s);
    /* leak{ node, mb_per_s, lasting }: allocate and touch memory at that rate, in the background.
     * NULL: leak events fail. */
    sh_err (*leak)(void *ud, const char *node, double mb_per_s, double lasting_s);
} sh_fault_host;

/* Applies one event now: link events become rules on every layer (each applies only the links
 * leaving its own node), heal removes matching rules, kill, stop, cont, leak and stall call the
 * host. Returns
 * SH_ENOTFOUND (unknown node), SH_EUNSUPPORTED (no host callback for the action), or the layer's
 * error. Any thread. */
sh_err sh_fault_event_apply(const sh_fault_event *ev, sh_fault *const *layers, size_t n_layers,
                            const sh_fault_host *host, sh_error *e);

typedef struct sh_fault_runner sh_fault_runner;

/* Copies the scenario's events and starts a thread that applies each at start + time_s (start =
 * now). The layers array is copied; the layers and the host must outlive the runner. A failed
 * event is counted and the run goes on. Returns SH_ENOMEM, SH_EIO (thread). */
sh_err sh_fault_runner_start(const sh_scenario *s, sh_fault *const *layers, size_t n_layers,
                             const sh_fault_host *host, sh_fault_runner **out, sh_error *e);

/* The same with the events' times counted from epoch_unix_ms (wall clock, milliseconds since
 * 1970) instead of now, so that several processes apply one scenario at the same moments. Events
 * already past are applied at once, in order, except link rules whose lasting_s has run out
 * (they would only flicker) and leaks that began more than a second before the start (a process
 * restarted because of a leak does not leak again). */
sh_err sh_fault_runner_start_at(const sh_scenario *s, sh_fault *const *layers, size_t n_layers,
                                const sh_fault_host *host, uint64_t epoch_unix_ms,
                                sh_fault_runner **out, sh_error *e);

/* Waits up to timeout_ms for every event to have been applied. Returns SH_ETIMEDOUT. */
sh_err sh_fault_runner_wait(sh_fault_runner *r, uint32_t timeout_ms);

/* Events applied so far and events that failed. */
void sh_fault_runner_counts(sh_fault_runner *r, size_t *applied, size_t *failed);

/* Cancels the events not yet due, joins the thread and frees. Accepts NULL. Not from a host
 * callback. */
void sh_fault_runner_destroy(sh_fault_runner *r);

#endif
