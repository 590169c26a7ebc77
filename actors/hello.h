/* The "hello" actor of a cluster node: the identity check between the front and its worker
 * nodes before any request is served, and the cluster key's challenge-response (issue 11). */
#ifndef SH_ACTORS_HELLO_H
#define SH_ACTORS_HELLO_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/auth.h"
#include "shoal/runtime.h"

#define SH_HELLO_MAX_STAGES 64
#define SH_HELLO_MAX_NODES 1025 /* node ids 1..1024 (a script has at most 1024 nodes) */

/* What a node says about itself in HELLO (runtime/proto_table.h, SH_PROTO_FIELDS_hello). */
typedef struct sh_hello_ident {
    char node[64];    /* the node's name in the cluster script */
    char version[32]; /* SH_VERSION_STRING of the build (base/version.h) */
    uint32_t proto;   /* SH_PROTO_VERSION (base/version.h) */
    uint64_t model_size, model_hash;
    int32_t n_blocks, max_seqs, max_tokens, seq_blocks; /* the stages' settings (0: none) */
    uint32_t link_dtype; /* the dtype its stages send ACT in (SH_PROTO_DTYPE_*, 0: F32) */
    uint32_t kv_dtype;   /* its stages' KV cache type (kv.type: 0 F32, 1 F16) */
    int32_t n_stages;
    uint64_t stages[SH_HELLO_MAX_STAGES]; /* the node's stage addresses */
    /* Per stage address, what it holds: SH_HELLO_SLICE(first, last, tp, rank) (0: not stated) */
    uint64_t slices[SH_HELLO_MAX_STAGES];
    bool keyed; /* it holds a cluster key */
} sh_hello_ident;

/* A stage actor's slice in HELLO: its layers [first, last) and, in a tensor-parallel group of tp
 * ranks (1: none), its rank and how the group links: SH_HELLO_SLICE_LINK (0 none, 1 shared
 * memory, 2 the network, 3 two levels: sh_coll_kind) and SH_HELLO_SLICE_COMPRESS (the network's
 * sh_coll_compress: 0 none, 1 f16, 2 int8). 20 bits per layer bound, 10 each for tp and rank, 4
 * for the link: 2 for its kind, 2 for its compression (SH_HELLO_SLICE_L takes them as kind |
 * compress << 2). */
#define SH_HELLO_SLICE_LINK(s) ((int32_t)(((s) >> 60) & 0x3u))
#define SH_HELLO_SLICE_COMPRESS(s) ((int32_t)((s) >> 62))
#define SH_HELLO_SLICE_L(first, last, tp, rank, link)                                              \
    (SH_HELLO_SLICE(first, last, tp, rank) | ((uint64_t)(uint32_t)(link)&0xfu) << 60)
#define SH_HELLO_SLICE(first, last, tp, rank)                                                      \
    (((uint64_t)(uint32_t)(first)&0xfffffu) << 40 | ((uint64_t)(uint32_t)(last)&0xfffffu) << 20 |  \
     ((uint64_t)(uint32_t)(tp)&0x3ffu) << 10 | ((uint64_t)(uint32_t)(rank)&0x3ffu))
#define SH_HELLO_SLICE_FIRST(s) ((int32_t)(((s) >> 40) & 0xfffffu))
#define SH_HELLO_SLICE_LAST(s) ((int32_t)(((s) >> 20) & 0xfffffu))
#define SH_HELLO_SLICE_TP(s) ((int32_t)(((s) >> 10) & 0x3ffu))
#define SH_HELLO_SLICE_RANK(s) ((int32_t)((s)&0x3ffu))

/* How a greeting ended, as judged by the greeting node's cluster key (valid once answered). */
typedef enum sh_hello_verdict {
    SH_HELLO_OPEN = 0,     /* neither node has a cluster key: nothing checked */
    SH_HELLO_AUTHED,       /* both hold the same key: each checked the other's proof */
    SH_HELLO_WRONG_KEY,    /* its proof does not check with this node's key */
    SH_HELLO_PEER_UNKEYED, /* this node has a key and the peer has none */
    SH_HELLO_SELF_UNKEYED, /* the peer has a key and this node has none */
    SH_HELLO_REFUSED,      /* the peer did not accept this node's proof */
} sh_hello_verdict;

/* One node the hello actor greets. The actor writes `got` and `verdict` and then sets `answered`
 * (release); another thread may read them once it has seen answered == 1 (acquire). */
typedef struct sh_hello_peer {
    sh_addr addr; /* the peer's hello actor */
    atomic_int answered;
    sh_hello_ident got;
    sh_hello_verdict verdict;
    /* The actor's loop only. */
    uint64_t session; /* the request in flight */
    int phase;        /* 0: greeting (identity, challenge); 1: sending this node's proof */
    sh_hello_verdict pending;
    uint8_t nonce[SH_AUTH_NONCE_LEN], peer_nonce[SH_AUTH_NONCE_LEN];
    uint8_t proof[SH_AUTH_MAC_LEN]; /* this node's proof for phase 1 */
} sh_hello_peer;

/* Which nodes proved the cluster key to this one, shared by its hello actor (which writes) and
 * its stage actors (which read, sh__hello_auth_allows). Embedded in the node's state; zero it,
 * then set key, self and names. */
typedef struct sh_hello_auth {
    const sh_auth_key *key;   /* the node's key; NULL or not set: the node serves anyone */
    uint32_t self;            /* this node's id: its own actors are always allowed */
    const char *const *names; /* names[id]: the script's name of node id (may be NULL) */
    uint32_t n_names;
    atomic_uchar ok[SH_HELLO_MAX_NODES];              /* by node id: it proved the key */
    _Atomic uint64_t next_log_ms[SH_HELLO_MAX_NODES]; /* rate limit of the refusal lines */
    _Atomic uint64_t dropped[SH_HELLO_MAX_NODES];     /* frames dropped since the last line */
} sh_hello_auth;

/* Whether a message from `src` may be served: always without a key, always from this node, and
 * otherwise only when src's node proved the key in a HELLO. A refusal is logged on rt as
 * `event=auth_refused` naming the node and `what` (the message type), at most once per 5 s per
 * node with the count dropped since. Any thread. */
bool sh__hello_auth_allows(sh_hello_auth *a, sh_runtime *rt, sh_addr src, const char *what);

/* Kind "hello". Every HELLO request it receives is answered with `self`. With peers, it sends
 * each peer that has not answered yet a HELLO request with `self` every retry_ms (default 500):
 * a peer whose link is not up yet, or whose process has not started, is simply asked again until
 * the caller gives up. The caller compares identities (this actor judges only the key).
 * PING (a watchdog's heartbeat) is answered with PONG carrying this process's resident memory.
 *
 * The cluster key (key set): nodes prove they hold it without sending it, by HMAC proofs over a
 * fresh nonce from each side and both names (sh__auth_proof). The greeting node sends its nonce
 * Nf; the answering node answers with its nonce Nw and its proof ('W'); the greeting node checks
 * it and sends its own proof ('F') with Nw (phase 1), which the answering node checks and
 * answers with auth_ok. Each side that checked the other's proof marks it in `auth` (when set).
 * The greeting node sends its proof even when the answer's proof was wrong, so that the other
 * side logs the refusal too; verdict says how it ended. An answering node with a key refuses a
 * greeting without one, and logs each refusal (event=hello_refused, once per 5 s per node).
 * A node with peers of its own answers its front's greeting (phase 0; any greeting when `front`
 * is 0) only once each of its peers has answered, so that a front that joined a worker knows the
 * worker's own greetings are done; other nodes' greetings are answered at once.
 * Connections (issue 25, runtime/peers.h): the connection a HELLO arrived on is bound to its
 * node when it proves it: with a key, the greeting node's proof (phase 1) and the answering
 * node's proof in its answer; without one, the greeting or answer itself. Frames that claim a
 * node their connection did not prove are refused by the runtime before any actor sees them.
 * args, self, peers, key and auth are borrowed and must outlive the actor. */
typedef struct sh_hello_args {
    const sh_hello_ident *self;
    sh_hello_peer *peers; /* (n_peers); NULL when it only answers */
    int32_t n_peers;
    uint32_t retry_ms;
    const sh_auth_key *key; /* NULL or not set: no key */
    sh_hello_auth *auth;    /* optional: where the nodes that proved the key are marked */
    /* A worker's front (its node id; 0: none). CONTROL op SHUTDOWN from an actor of that node
     * (which must have proved the key when this node holds one) calls on_shutdown(user, why) on
     * the actor's loop thread, why being the CONTROL's arg ("" when none): the front's watchdog
     * asks a node over its memory budget to restart. Others are dropped and logged. */
    uint32_t front;
    void (*on_shutdown)(void *user, const char *why);
    void *shutdown_user;
    /* A standby's: CONTROL op PROMOTE from the front calls on_promote(user, stages, ranks, n)
     * on the actor's loop thread with the plan's stage indices it must take over and, for each,
     * the rank of the stage's tensor-parallel group it takes (0 for a stage of one node; it must
     * not block: loading runs elsewhere); the front then reads their addresses from HELLO. */
    void (*on_promote)(void *user, const int32_t *stages, const int32_t *ranks, int32_t n);
    void *promote_user;
    /* A worker's (issue 25): greet every node (but the front) over each outgoing connection as it
     * comes up (runtime/peers.h's link counts), so that the node at its end binds that connection
     * to this one before it carries anything else; a greeting of the front is answered only once
     * those young greetings (under 2 s) answered too. */
    bool greet_links;
    /* A worker's: the nodes that send its stages ACT (the previous stages' nodes). Its front's
     * greeting is answered only once a connection from each of them proved its node (they greet
     * it: greet_links), or 2 s after the front's first greeting, so that the first ACT of a
     * joined cluster never comes on a connection that proved nothing yet. */
    const uint32_t *sources;
    int32_t n_sources;
} sh_hello_args;

extern const sh_actor_vtable sh__hello_vtable;

#endif
