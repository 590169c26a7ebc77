/* Internals of the network collectives shared by coll_net.c (links, frames, receiving, create and
 * destroy), coll_net_join.c (the join handshake) and coll_net_algo.c (the collectives). */
#ifndef SH_RUNTIME_COLL_NET_INT_H
#define SH_RUNTIME_COLL_NET_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>

#include "base/auth.h"
#include "runtime/coll_net.h"
#include "runtime/log.h"

#define ONESHOT_MAX ((size_t)64 << 10) /* bytes: one-shot / direct at or below */
#define SEG_BYTES ((size_t)128 << 10)  /* ring and chain segments (before compression) */
#define SEG_FLOATS (SEG_BYTES / sizeof(float))
#define RECV_MAX (SEG_BYTES + ONESHOT_MAX + 4096) /* the largest frame a listener takes */
#define AHEAD 4u                                  /* stash frames up to this many calls ahead */
#define STASH_FRAMES 8192u
#define NONCE SH_AUTH_NONCE_LEN
#define MAC SH_AUTH_MAC_LEN
#define URL_MAX 256
#define POOL_MSGS 512u
#define HELLO_EVERY_NS 50000000u /* create repeats its HELLO to silent peers this often */
#define CLOSE_PAUSE_MS 20        /* see net_free */
#define LOST_POLL_MS 50u         /* see take */
#define LOST_GRACE_MS 50u
#define LINGER_MS 500    /* destroy's wait for frames still queued */
#define DRAIN_MS 200     /* destroy's wait for the peers' links to its listener to close */
#define TLS_PAUSE_MS 200 /* see net_free */
/* take asks for a frame again after its sender has been silent NACK_FIRST_NS, the gap doubling
 * up to NACK_MAX_NS. */
#define NACK_FIRST_NS 5000000u
#define NACK_MAX_NS 100000000u
#define REDIAL_NS 300000000u /* see sh__coll_net_join */
#define JOIN_TAG "shoal coll join v1"

/* One peer's outgoing link: a push socket and the queue its aio drains. */
typedef struct peer_link {
    struct net *im;
    nng_socket sock;
    nng_dialer dialer;
    bool sock_open;
    nng_aio *aio;
    pthread_mutex_t mu;  /* everything below */
    pthread_cond_t idle; /* signalled when the queue has drained */
    nng_msg **q;         /* (cap) ring of frames waiting for the aio */
    size_t cap, head, n;
    bool sending, closed;
    int pipes; /* connections to the peer (0 or 1) */
    int err;   /* the first failed send's NNG code, 0 when none */
} peer_link;

/* A frame this rank sent in one of its last AHEAD + 1 calls, kept to send again on a NACK: a
 * copy (m), or while the call runs, the floats it was encoded from (src, count, h: see
 * sh__coll_net_post_lazy); neither once a lazy frame's source has gone. */
typedef struct kept {
    nng_msg *m;
    const float *src; /* (count) */
    size_t count;
    sh__coll_net_hdr h;
    uint64_t seq;
    uint64_t at_ns; /* when it was posted */
    int32_t dst;
    uint32_t index;
    uint8_t type;
} kept;

typedef struct stashed {
    nng_msg *m;
    sh__coll_net_hdr h;
} stashed;

/* Reasons a frame is dropped: each is logged once per handle and every drop counted. */
enum { DROP_BAD, DROP_EPOCH, DROP_RANK, DROP_PIPE, DROP_OLD, DROP_AHEAD, DROP_STASH, DROP_KEY };

typedef struct net {
    sh_coll *c;
    sh_coll_compress cmp;
    uint8_t *key; /* (key_len) NULL: no key */
    size_t key_len;
    char (*urls)[URL_MAX]; /* (size) */
    nng_socket lsock;
    nng_listener listener;
    bool lopen;
    nng_tls_config *tls_server, *tls_client; /* tls+tcp:// only (NULL otherwise) */
    /* Failed TLS handshakes of the dialers (by rank) and listeners closed by a redial or a
     * relisten during create (sh__coll_net_tls_auth). */
    uint64_t tls_auth[SH_COLL_MAX_RANKS], tls_auth_listen;
    nng_aio *raio; /* the listener's receive, always pending (recv_cb) */
    sh_coll_fault_fn fault;
    void *fault_ud;
    pthread_mutex_t rmu; /* the received frames' queue, filled by recv_cb */
    pthread_cond_t rcv;
    nng_msg **rq; /* (rq_cap) ring */
    size_t rq_head, rq_n, rq_cap;
    int rerr;            /* the receive's failure (NNG code), 0 while it works */
    pthread_mutex_t kmu; /* kept frames, read by recv_cb on a NACK */
    kept *kept;          /* (n_kept, cap_kept) */
    size_t n_kept, cap_kept;
    _Atomic uint64_t nacks, resent;  /* asked for again, sent again */
    _Atomic uint64_t recovery_bytes; /* of the NACKs and frames sent again (in bytes_wire too) */
    peer_link *links;                /* (size); links[rank] unused */
    _Atomic uint32_t *pipe_of;       /* (size) the pipe each rank's join PROOF came by */
    _Atomic uint64_t lost; /* ranks whose pipe_of connection has closed (listener_pipe_cb) */
    uint8_t nonce[NONCE];
    stashed *stash; /* (n_stash) in arrival order */
    size_t n_stash, stash_bytes, stash_cap_bytes;
    float *slots;             /* (size, ONESHOT_MAX / 4) one-shot contributions */
    nng_msg *pool[POOL_MSGS]; /* (n_pool) received frames kept to send the next ones in */
    size_t n_pool, pool_bytes;
    uint8_t op;     /* the current call's */
    uint64_t total; /* the current call's element count (as in its frames' headers) */
    sh__log lg;
    _Atomic uint64_t dropped;
    uint32_t logged;      /* drop reasons already logged */
    uint64_t bad_key;     /* ranks whose join proof failed the key check */
    uint64_t other_epoch; /* frames of another epoch dropped during create */
} net;

/* The frame's payload, after the header. */
static inline uint8_t *payload(nng_msg *m) { return (uint8_t *)nng_msg_body(m) + SH__COLL_NET_HDR; }

static inline size_t payload_len(nng_msg *m) { return nng_msg_len(m) - SH__COLL_NET_HDR; }

/* coll_net.c: clock, drops. */
uint64_t sh__coll_net_now_ns(void);
/* Counts a dropped frame (freeing it) and logs the first of each reason; src < 0: unknown. */
void sh__coll_net_drop(net *im, nng_msg *m, int why, int src);
sh_err sh__coll_net_oom(sh_error *e);

/* coll_net.c: frames and sending. post queues m for rank dst (m is the link's in every case);
 * SH_ETIMEDOUT or SH_EIO when an earlier frame to dst failed. */
nng_msg *sh__coll_net_frame_new(net *im, size_t plen);
void sh__coll_net_frame_release(net *im, nng_msg *m);
sh__coll_net_hdr sh__coll_net_hdr_of(net *im, uint8_t type, uint8_t op, uint64_t total,
                                     uint32_t index, uint32_t count);
nng_msg *sh__coll_net_frame_floats(net *im, uint64_t total, uint32_t index, const float *x,
                                   size_t count);
nng_msg *sh__coll_net_frame_bytes(net *im, uint8_t type, uint8_t op, uint64_t total, uint32_t index,
                                  const void *p, size_t len);
void sh__coll_net_frame_forward(net *im, nng_msg *m, const sh__coll_net_hdr *got, uint32_t index);
sh_err sh__coll_net_post(net *im, int32_t dst, nng_msg *m, sh_error *e);
/* post for a data frame sealed with header h, its payload encoded from h->count floats at src
 * that stay as they are until sh__coll_net_kept_drop drops the frame: no copy is kept, a resend
 * encodes src again. *slot: where the frame is kept, for kept_drop. */
sh_err sh__coll_net_post_lazy(net *im, int32_t dst, nng_msg *m, const sh__coll_net_hdr *h,
                              const float *src, size_t *slot, sh_error *e);
/* The n lazily kept frames from slot on (from post_lazy in this call) are not sent again after
 * this: their source may change (the caller knows the peer has them, or the call is ending). */
void sh__coll_net_kept_drop(net *im, size_t slot, size_t n);

/* coll_net.c: receiving (see each definition). */
int sh__coll_net_recv_one(net *im, uint64_t deadline, nng_msg **m);
bool sh__coll_net_frame_check(net *im, nng_msg *m, sh__coll_net_hdr *h);
void sh__coll_net_stash_put(net *im, nng_msg *m, const sh__coll_net_hdr *h);
void sh__coll_net_stash_purge(net *im);
sh_err sh__coll_net_take(net *im, uint8_t type, int32_t src, uint32_t index, uint64_t deadline,
                         const char *what, nng_msg **out, sh__coll_net_hdr *h, sh_error *e);
/* Frees the kept frames of calls more than AHEAD before the current one (at the start of a
 * call): a peer can be a few calls behind (a direct broadcast's receivers wait for the root
 * only), never more than the stash lets it be. */
void sh__coll_net_kept_prune(net *im);
sh_err sh__coll_net_expect(net *im, nng_msg *m, const sh__coll_net_hdr *h, uint8_t op,
                           uint64_t total, uint32_t index, uint32_t count, size_t plen,
                           sh_error *e);
sh_err sh__coll_net_take_data(net *im, int32_t src, uint64_t deadline, uint8_t op, uint64_t total,
                              uint32_t index, uint32_t count, size_t plen, nng_msg **m,
                              sh__coll_net_hdr *h, sh_error *e);

/* coll_net_join.c: the TLS handshakes that failed on rank p's current dialer (p < 0: on this
 * rank's current listener), from NNG's statistics; 0 without TLS. */
uint64_t sh__coll_net_tls_auth(net *im, int32_t p);

/* coll_net.c: closes this rank's listener and listens again (see the definition). */
sh_err sh__coll_net_relisten(net *im, sh_error *e);

/* coll_net.c: closes rank p's link and opens a fresh one (create only; see sh__coll_net_join). */
sh_err sh__coll_net_redial(net *im, int32_t p, sh_error *e);

/* coll_net_join.c: a HELLO or PROOF to dst, and create's wait for every rank. */
sh_err sh__coll_net_join_send(net *im, uint8_t type, int32_t dst, const uint8_t *nonce,
                              sh_error *e);
sh_err sh__coll_net_join(net *im, uint64_t deadline, sh_error *e);

/* coll_net_algo.c: the three collectives (sh__coll_ops members). */
sh_err sh__coll_net_algo_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e);
sh_err sh__coll_net_algo_allgather(sh_coll *c, const void *in, size_t bytes, void *out,
                                   sh_error *e);
sh_err sh__coll_net_algo_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e);

#endif
