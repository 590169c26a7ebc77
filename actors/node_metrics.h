/* Per-node metrics of a cluster (issue 11): a reporter on each worker node sends its runtime's
 * registry to a collector on the front every period, and the front's GET /metrics carries every
 * node's latest series with a `node="NAME"` label (docs/cluster.md, "Metrics of every node").
 *
 *   worker: node_metrics_reporter --METRICS every period_ms--> front: node_metrics_collector
 *   front:  gateway /metrics --metrics_render (sh_gateway_args)--> sh__node_metrics_render()
 *
 * The collector and the gateway share one sh_node_metrics store; they may run on different loop
 * threads, so the store keeps its snapshots under a mutex. Nodes report over the transport; the
 * front never scrapes them. */
#ifndef SH_ACTORS_NODE_METRICS_H
#define SH_ACTORS_NODE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/proto.h"
#include "shoal/runtime.h"

#define SH_NODE_METRICS_PERIOD_MS 1000 /* a reporter's default period */

/* ---- the front's store -------------------------------------------------------------------- */

/* The latest report of every worker node, and how many came and were refused. */
typedef struct sh_node_metrics sh_node_metrics;

/* A node allowed to report: reports from any other address are refused. */
typedef struct sh_node_metrics_peer {
    const char *name; /* its name in the cluster script (copied), the value of its node label */
    sh_addr from;     /* its reporter's address */
} sh_node_metrics_peer;

/* Creates a store for n peers (n >= 0; names up to 63 bytes). Returns SH_OK, SH_EINVAL (a NULL
 * or too long name), SH_ENOMEM. */
sh_err sh__node_metrics_create(const sh_node_metrics_peer *peers, int32_t n, sh_node_metrics **out);
/* Frees the store and every snapshot. Accepts NULL. No concurrent users: call it after the
 * runtime whose collector and gateway use it is destroyed. */
void sh__node_metrics_destroy(sh_node_metrics *nm);

/* Stores report r (views into a decoded METRICS body, borrowed for the call) from `from`,
 * received at now_us (CLOCK_MONOTONIC microseconds): checked whole, copied, and then it replaces
 * that node's previous snapshot. Each value's name is `family` or `family{labels}` (the
 * registry's label form); `node="NAME"` is added to its labels (a `node` label it already has is
 * kept as `exported_node`). Refused whole, counted on the node (shoal_node_metrics_rejected_total)
 * and leaving its snapshot as it was: a malformed name or label set, text that is not UTF-8 or
 * holds control characters, histogram bounds that are not finite and increasing, one series
 * twice, one family with two kinds. Returns SH_OK, SH_ENOTFOUND (`from` is no peer: nothing
 * counted), SH_EPROTO (refused, e says why), SH_ENOMEM. Any thread. */
sh_err sh__node_metrics_put(sh_node_metrics *nm, sh_addr from, const sh_proto_metrics *r,
                            uint64_t now_us, sh_error *e);

/* The gateway's metrics_render callback (sh_gateway_args; user is the sh_node_metrics): renders
 * registry m (sh_metrics_render_with()) with every node's latest series and, per peer,
 * shoal_node_metrics_age_seconds (seconds since its latest report arrived, +Inf before the
 * first), shoal_node_metrics_reports_total and shoal_node_metrics_rejected_total, each labelled
 * with the node. Returns as sh_metrics_render_with(). Any thread; holds the store's mutex for the
 * rendering (never blocks on a peer). */
sh_err sh__node_metrics_render(void *user, sh_metrics *m, char *buf, size_t cap, size_t *len);

/* ---- the actors (registered by sh__serve_register()) --------------------------------------- */

/* Kind "node_metrics_collector" (the front): stores every METRICS it receives with
 * sh__node_metrics_put(); a refused one is dropped and logged (event node_metrics_bad, at most
 * one line per 10 s with the count of those not logged). Anything else is dropped. nm is
 * borrowed and must outlive the actor. */
typedef struct sh_node_metrics_collector_args {
    sh_node_metrics *nm;
} sh_node_metrics_collector_args;

extern const sh_actor_vtable sh__node_metrics_collector_vtable;

/* Kind "node_metrics_reporter" (a worker node): every period_ms (0: SH_NODE_METRICS_PERIOD_MS)
 * from its start, snapshots its runtime's registry (sh_metrics_foreach) and sends it to
 * `collector` in one one-way METRICS message: counters and gauges as values of kind 0 and 1,
 * histograms with per-bucket counts, every series named `family{labels}`, with its help. A
 * series whose name and labels exceed SH_PROTO_MAX_NAME bytes, or past the message's limits
 * (4096 values, 1024 histograms), is left out and counted in its own registry
 * (shoal_node_metrics_skipped_total). A failed send (the front not up yet, its link down) is
 * dropped: the next period sends a fresh snapshot; the first failure after a success is logged at
 * info (node_metrics_send_failed), earlier ones not at all (the front not up yet). args is copied
 * by init. */
typedef struct sh_node_metrics_reporter_args {
    sh_addr collector;
    uint32_t period_ms;
} sh_node_metrics_reporter_args;

extern const sh_actor_vtable sh__node_metrics_reporter_vtable;

#endif
