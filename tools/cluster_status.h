/* The cluster's status document: what `GET /admin/cluster` answers on a serving process and
 * `shoal cluster status` prints (docs/cluster.md, "Watching a cluster"). */
#ifndef SH_TOOLS_CLUSTER_STATUS_H
#define SH_TOOLS_CLUSTER_STATUS_H

#include <stdint.h>

#include "actors/cluster.h"
#include "actors/cluster_events.h"
#include "actors/watchdog.h"
#include "shoal/runtime.h"

/* What the document is built from. Filled by `shoal serve` before the gateway is spawned; must
 * outlive the runtime (the gateway's callback reads it). The metric pointers are looked up on
 * the first request, after the batcher and kvmgr registered theirs. */
typedef struct sh_cluster_status_src {
    const sh_cluster_front *front; /* the cluster front (plan, join answers, links); NULL for a
                                    * single-process server, which is one node and one stage */
    sh_runtime *rt;                /* its metrics registry holds the replica's gauges */
    const char *node;              /* this process's node name */
    const char *model;             /* the model's name as clients give it */
    int32_t n_layers;
    sh_cluster_events *events;     /* the front's faults and recoveries, for /admin/status (NULL:
                                    * none kept, the list is empty) */
    const sh_watchdog_view *watch; /* the front's watchdog (NULL: none; node health then comes
                                    * from the links alone) */
    /* The replica's series, registered on first use (first registration's help wins, so the
     * same help texts as the batcher's and the kvmgr's). Gateway's loop thread only. */
    struct sh_cluster_status_rep {
        sh_gauge *running, *waiting, *kv_used, *kv_total, *kv_cached, *paused;
        sh_counter *steps, *prompt_tokens, *gen_tokens, *preemptions;
        sh_gauge *load, *weight, *held, *healthy; /* the router's, with several replicas */
        sh_counter *routed, *redispatched, *affinity_hits;
    } rep[SH_CLUSTER_MAX_REPLICAS];
    bool looked_up;
} sh_cluster_status_src;

/* The gateway's cluster_json callback (sh_gateway_args): the status document of the process,
 * a JSON object, malloc'd (the caller frees it), or NULL when out of memory. user is an
 * sh_cluster_status_src. Reads link snapshots (sh_transport_link_get) and atomic gauges only, so
 * it never blocks. Layout (every field always present):
 *
 *   {"object": "shoal.cluster", "version": "0.1.0", "node": "front", "model": {"name": "m",
 * "layers": 5}, "mode": "cluster" | "single", "nodes": [{"name", "url" (its transport URL; "" for a
 * single process), "role": "front" | "worker" | "single", "joined": bool, "state": "self" | "up" |
 * "down" | "connecting", "reconnects": n, "lost": bool (reconnected or down since the join),
 *               "last_error": "" or the transport's text, "stages": [stage numbers, 1-based],
 *               "frames_sent": n, "queued": n}],
 *    "replicas": [{"replica": 0, "tp": n (the most ranks of any of its stages' groups; 1: none
 *                  split), "stages": [{"stage": 1, "node": "w0" (a group's leader),
 *                  "ranks": ["w0", ...] (every rank's node, in rank order), "first_layer": 0,
 *                  "last_layer": 3}], "running": n, "waiting": n, "kv_blocks_used": n,
 *                  "kv_blocks_total": n, "kv_blocks_cached": n, "steps": n, "prompt_tokens": n,
 *                  "generation_tokens": n, "preemptions": n, "healthy": bool,
 *                  "router": null or {"load": n, "weight": x, "requests": n, "routed": n,
 *                  "redispatched": n, "affinity_hits": n, "routed_by_class": {"long": n,
 *                  "short": n, "script": n}}}],
 *    "routing": {"long_prompt": n (the length rule's threshold in prompt tokens), "route": bool
 *                (the script gives route())}}
 *
 * Stage numbers count from 1 over the whole plan, replica after replica (with one replica: its
 * pipeline order). The router figures exist only with several replicas (the router's series).
 *
 * Layer ranges are half-open, [first_layer, last_layer). */
char *sh__cluster_status_json(void *user);

/* The gateway's status_json callback: GET /admin/status, what the status page (GET /admin/,
 * net/admin_page.h) draws. The same contract as sh__cluster_status_json(); the document is
 * a superset of /admin/cluster's ("object": "shoal.status"), with:
 *
 *   "time_unix_ms": the server's wall clock, "health_source": "watchdog" (a node's health is the
 *   watchdog's verdict from its heartbeats and link) or "links" (no watchdog: its link's state as
 *   the front sees it),
 *   "degradation": {"level": n, or null while no shoal_degradation_level gauge is registered},
 *   every node also has "health": "alive" | "joining" (never joined yet, or back on a new
 *   connection and not greeted again) | "dead" (judged dead by the watchdog; without one: its
 *   link is down), and the watchdog's figures, null without a heartbeat answered:
 *   "heartbeat_rtt_ms" (the last heartbeat's round trip), "heartbeat_age_ms" (since the last
 *   answer), "rss_bytes" (the node process's resident memory), "deaths" (times judged dead; 0
 *   without a watchdog);
 *   "links": [{"from": node, "to": node, "replica": k, "health"}]: the front to each replica's
 *   first stage node, and each stage's node to the next stage's (when they differ), with the
 *   worse health of their two ends;
 *   every replica also has "state": "serving" | "paused" (waiting for a lost node, out of
 *   routing) | "down" (out of routing, not paused), "load" and "weight" (the router's, null with
 *   one replica);
 *   "events_total": events ever logged, "events": the last (at most 32), oldest first, each
 *   {"seq", "unix_ms", "kind" (actors/cluster_events.h), "node": name or null, "replica": k or
 *   null, "msg"}. */
char *sh__cluster_status_full_json(void *user);

/* `shoal cluster status [URL]`: fetches URL's /admin/cluster and prints it as tables (--json: the
 * raw document). argv[0] is "status". Returns 0, 2 (bad usage, an unreachable URL, a refused key:
 * one error line naming the URL) or 1 (an answer that is not a status document). */
int sh__cmd_cluster_status(int argc, char **argv);

#endif
