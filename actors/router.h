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

#endif
