/* Which node each inbound connection proved in HELLO, and the gate every frame from another node
 * passes before anything acts on it (issue 25). */
#ifndef SH_RUNTIME_PEERS_H
#define SH_RUNTIME_PEERS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "shoal/runtime.h"

#define SH__PEERS_MAX_NODES 1025 /* node ids 1..1024, as SH_HELLO_MAX_NODES */
#define SH__PEERS_MAX_BOUND 4096 /* proved connections held at once */

/* Why a frame from another node was refused: the `reason` label of
 * shoal_frames_refused_total. */
typedef enum sh__peers_reason {
    SH__PEERS_UNPROVED = 0,  /* its connection proved no identity in HELLO yet */
    SH__PEERS_SRC_MISMATCH,  /* its envelope's src names another node than its connection proved */
    SH__PEERS_PREAUTH_FRAME, /* an unproved connection announced a frame over the HELLO budget */
    SH__PEERS_PREAUTH_CAP,   /* the listener already holds its cap of unproved connections */
    SH__PEERS_PREAUTH_SLOW,  /* an unproved connection passed the handshake deadline */
    SH__PEERS_EPOCH,         /* a STEP's epoch no rule of the receiving stage allows */
    SH__PEERS_TP_NOT_LEADER, /* STEP or ACT to a tensor-parallel rank from other than its leader */
    SH__PEERS_REASON_COUNT_
} sh__peers_reason;

/* A runtime's peer table. Any thread; embedded in sh_runtime. */
typedef struct sh__peers {
    _Atomic int on; /* the gate is closed to unproved connections (a cluster node) */
    uv_mutex_t mu;  /* bound[], n_bound */
    struct {
        uint64_t conn;
        uint32_t node;
    } bound[SH__PEERS_MAX_BOUND];
    uint32_t n_bound;
    /* Outgoing links, by node id: how many times each came up, and whether it is up now (the
     * transports write; the hello actor greets a node over each new connection). */
    _Atomic uint32_t link_ups[SH__PEERS_MAX_NODES];
    atomic_uchar link_up[SH__PEERS_MAX_NODES];
    sh_counter *refused[SH__PEERS_REASON_COUNT_];
    _Atomic uint64_t next_log_ms[SH__PEERS_REASON_COUNT_];
    _Atomic uint64_t since_log[SH__PEERS_REASON_COUNT_];
} sh__peers;

/* "unproved", "src_mismatch", ... */
const char *sh__peers_reason_name(sh__peers_reason r);

/* Returns 0, or uv_mutex_init's error. */
int sh__peers_init(sh__peers *p);
void sh__peers_fini(sh__peers *p);

/* Registers shoal_frames_refused_total{node=...,reason=...} on the runtime's registry. */
sh_err sh__peers_metrics(sh_runtime *rt, const char *node_label);

/* Closes the gate: from now on a frame from another node is delivered only when its connection
 * proved, in HELLO, the node its envelope's src names (HELLO frames themselves always pass to
 * the hello actor, which judges them). A cluster node calls it before its transport starts. */
void sh__peers_enforce(sh_runtime *rt);

/* Whether the gate is closed (sh__peers_enforce was called). */
bool sh__peers_enforced(sh_runtime *rt);

/* Binds inbound connection `conn` (a transport's id, never 0) to `node`: called by the hello
 * actor once the connection proved it (the cluster key's proof, or the open cluster's HELLO). A
 * connection keeps the first node it proved; binding it to another is refused (false). */
bool sh__peers_bind(sh_runtime *rt, uint64_t conn, uint32_t node);

/* Forgets `conn` (its connection closed). */
void sh__peers_unbind(sh_runtime *rt, uint64_t conn);

/* Whether some inbound connection proved `node` now. */
bool sh__peers_node_bound(sh_runtime *rt, uint32_t node);

/* The node `conn` proved; 0 when none. */
uint32_t sh__peers_node(sh_runtime *rt, uint64_t conn);

/* The gate for one decoded frame that arrived on `conn` (0: not known) claiming `src_node`, of
 * message type `type`. True: deliver it. False: it was counted and logged (rate-limited); drop it.
 */
bool sh__peers_allows(sh_runtime *rt, uint64_t conn, uint32_t src_node, uint32_t type);

/* Counts one refusal and logs it (event=frame_refused, at most one line per reason per 5 s,
 * with the number refused since the last). `node` is the claimed sender (0: unknown). */
void sh__peers_refuse(sh_runtime *rt, sh__peers_reason r, uint32_t node, const char *what);

/* The inbound connection message m arrived on (0: sent by this process, or not known). */
uint64_t sh__msg_conn(const sh_msg *m);

/* sh_transport_deliver() and sh_transport_deliver_owned() for a frame that arrived on inbound
 * connection `conn` (a transport's id, unique in the process, never 0), which the peer gate checks
 * the frame's src against. Same ownership and return codes; SH_EPROTO also when the gate refused it
 * (counted, logged, dropped; an owned buffer stays with the caller). */
sh_err sh__transport_deliver_conn(sh_runtime *rt, uint64_t conn, const void *frame, size_t len,
                                  sh_error *e);
sh_err sh__transport_deliver_owned_conn(sh_runtime *rt, uint64_t conn, uint8_t *frame, size_t len,
                                        const sh_frame_owner *owner, sh_error *e);

/* Transports: the outgoing link to `node` came up on a new connection, or went down. */
void sh__peers_link_state(sh_runtime *rt, uint32_t node, bool up);

/* How many times the link to `node` came up (0: never), and whether it is up now. */
uint32_t sh__peers_link_ups(sh_runtime *rt, uint32_t node, bool *up);

#endif
