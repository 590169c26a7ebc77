/* The NNG transport between nodes: one listening URL per node, a dialled link per peer. */
#ifndef SHOAL_TRANSPORT_H
#define SHOAL_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"
#include "shoal/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A transport connects one sh_runtime to other nodes (DESIGN.md sections 2 and 10).
 *
 * Sockets. The node listens on one URL with an NNG pull0 socket: every peer's frames arrive
 * there, in order per peer, and are handed to sh_transport_deliver() from one NNG aio callback
 * (a receive path per node; deliver only copies and queues, so it never blocks). For each peer
 * the node opens one push0 socket that dials the peer's listening URL. Push/pull fits because
 * links are one-way (a reply travels back on the peer's own link to us), a push socket never
 * needs a reply to make progress, and pull fans in any number of peers on one listener, which
 * pair1 cannot do without its deprecated polyamorous mode. The dialer reconnects by itself with
 * exponential backoff between reconnect_min_ms and reconnect_max_ms (NNG_OPT_RECONNMINT/MAXT).
 *
 * Zero copy. A received frame is not copied: the runtime adopts the nng_msg's body
 * (sh_transport_deliver_owned()), decodes it in place and hands the message back to the
 * transport's buffer pool when it is freed. A large outgoing frame is built by the runtime
 * directly in an nng_msg the transport lends it (the frame_alloc hook) and queued as it is
 * (send_owned): the only copy on the send side is the body into the frame. Small frames keep the
 * runtime's pooled blocks and one copy into a fresh nng_msg. NNG zeroes every message it
 * allocates; the pool (recycle_max_bytes) lets a node that receives and sends large frames skip
 * that.
 *
 * Back-pressure. Each link has a bounded send queue (queue_max_msgs frames and queue_max_bytes
 * bytes, counting frames queued and the one being written). A send that does not fit fails at
 * once with SH_EBUSY and the caller keeps its message: memory never grows without bound when a
 * peer is slow, stopped or gone. A queued frame that no connection takes within
 * send_timeout_ms is dropped and counted as expired (the requester's own deadline answers it).
 *
 * URLs: inproc://, ipc://, tcp:// and tls+tcp://. tls+tcp needs `tls` in the options; with it
 * both sides present certificates signed by the CA and verify each other (mutual TLS).
 *
 * ipc://PATH (a Unix socket; PATH at most 107 bytes) and tcp://HOST:PORT (tcp4://, tcp6://;
 * [v6] hosts; "*" or an empty host and port 0 when listening) are served by the runtime itself
 * rather than by NNG's transports, with the same bytes on the wire (NNG's SP handshake and
 * framing for push0 -> pull0), so a node on either side may use NNG. Their sockets are watched
 * by runtime loop `io_loop` (an internal actor named "stream_io" lives there), a received frame
 * is handed to an actor on that loop without a thread hop, and a sender writes its frame into
 * the socket from its own thread when the link is idle; only what the kernel does not take at
 * once is queued. Connect failures show in the link's last_error ("connect: Connection
 * refused"). A peer's host name is resolved again before each dial (on libuv's thread pool, not
 * the loop), so a peer restarted at another address is found; while it does not resolve the
 * link redials with backoff and its last_error says "host H did not resolve (...)". NNG's
 * tls+tcp:// dialer resolves before each dial too. A listener's host name is resolved when the
 * transport is created (listen_resolve_ms). A socket file left at an ipc:// listening path by a
 * dead process is replaced; a live listener's path is SH_EBUSY; the file is removed when the
 * transport closes. use_nng selects NNG's transports. inproc:// and tls+tcp:// always use NNG.
 *
 * Threads. Every function may be called from any thread unless it says otherwise; the link
 * table and the counters are protected internally. NNG runs the receive and send completions
 * on its own threads; the stream engine on the runtime loop io_loop. sh_transport_create() and
 * sh_transport_close() wait for that loop, so they must not be called from one of rt's loop
 * threads. No process-global state: several transports (one per runtime) may live in
 * one process, e.g. over inproc:// in the tests. */

typedef struct sh_transport sh_transport;

/* TLS material: PEM files, or PEM strings when the matching *_file is NULL. */
typedef struct sh_transport_tls {
    const char *cert_file; /* this node's certificate (PEM) */
    const char *key_file;  /* its private key (PEM) */
    const char *ca_file;   /* the CA that signs every node's certificate (PEM) */
    const char *cert_pem;
    const char *key_pem;
    const char *ca_pem;
    const char *key_password; /* NULL: the key is not encrypted */
    const char *server_name;  /* name the dialled peers' certificates must carry; NULL: none */
} sh_transport_tls;

typedef struct sh_transport_opts {
    const char *listen_url;      /* NULL: this node only dials (it receives nothing) */
    uint32_t queue_max_msgs;     /* per link; 0: 1024 */
    uint64_t queue_max_bytes;    /* per link; 0: 256 MiB */
    size_t max_frame;            /* larger frames are refused, sent or received; 0: 128 MiB */
    uint32_t reconnect_min_ms;   /* first redial delay; 0: 10 */
    uint32_t reconnect_max_ms;   /* backoff cap; 0: 1000 */
    uint32_t send_timeout_ms;    /* a queued frame older than this is dropped; 0: 10000 */
    const sh_transport_tls *tls; /* needed for tls+tcp:// (copied at create) */
    /* Received frame buffers of 64 KiB and more are kept, once the runtime frees them, up to
     * this many bytes (and 16 buffers), and reused for large outgoing frames: no allocation,
     * zeroing or page faults per frame on a node that relays activations. 0: 64 MiB;
     * SH_TRANSPORT_RECYCLE_OFF: keep none. */
    uint64_t recycle_max_bytes;
    /* ipc:// and tcp:// links and listeners run on the runtime's own loop number io_loop (see
     * "ipc://" above); 0 is the first loop. Put the actors that talk to other nodes there: a
     * frame for an actor on another loop costs one more thread wake-up. */
    uint32_t io_loop;
    /* Non-zero: ipc:// and tcp:// go through NNG's transports like the other schemes (the same
     * bytes on the wire, more thread hops per frame). */
    int use_nng;
    /* Receive back-pressure (ipc:// and tcp://): the node stops reading its incoming
     * connections while its runtime holds recv_pause_msgs messages (0: 16384) or received large
     * frames (64 KiB and more) of recv_pause_bytes bytes (0: 256 MiB) that its actors have not
     * finished with, and reads again once below. The bytes wait in the kernel and then in the
     * senders' bounded queues, whose sends fail with SH_EBUSY: a stalled actor cannot make a
     * flooding peer grow this node's memory without bound. Messages that actors keep count
     * too: a node whose actors keep more than recv_pause_msgs messages while they wait for
     * replies from other nodes would stop reading those replies, so raise the limit there. */
    uint64_t recv_pause_msgs;
    uint64_t recv_pause_bytes;
    /* listen_url's host is a name that does not resolve yet (DNS not ready: a Kubernetes pod's
     * name appears in its Service's records after the pod starts): sh_transport_create tries
     * again every 250 ms for up to this long before it fails with SH_ENOTFOUND. 0: one try. */
    uint32_t listen_resolve_ms;
} sh_transport_opts;

#define SH_TRANSPORT_RECYCLE_OFF UINT64_MAX

typedef enum sh_link_state {
    SH_LINK_STATE_CONNECTING = 0, /* dialling, never connected yet */
    SH_LINK_STATE_UP = 1,         /* a connection is established */
    SH_LINK_STATE_DOWN = 2,       /* was up, lost; redialling with backoff */
} sh_link_state;

/* One link as the watchdog sees it (a snapshot; counters since the peer was added). */
typedef struct sh_transport_link {
    uint32_t node;
    char url[256];
    sh_link_state state;
    sh_err last_err;           /* SH_OK when nothing failed yet */
    char last_error[160];      /* the NNG text of the last failure, "" when none */
    uint64_t last_activity_ms; /* CLOCK_MONOTONIC ms of the last frame written or link change */
    uint32_t queue_msgs;       /* frames queued or being written */
    uint64_t queue_bytes;
    uint64_t sent;    /* frames handed to a connection */
    uint64_t busy;    /* sends refused with SH_EBUSY (queue full) */
    uint64_t expired; /* queued frames dropped after send_timeout_ms or on error */
    uint64_t ups;     /* times the link came up (1 + reconnects) */
} sh_transport_link;

/* Counters of the whole transport. */
typedef struct sh_transport_stats {
    uint64_t frames_sent, bytes_sent; /* handed to a connection */
    uint64_t frames_recv, bytes_recv; /* received on the listener */
    uint64_t rejected;                /* received frames sh_transport_deliver() refused */
    uint64_t busy;                    /* sends refused with SH_EBUSY */
    uint64_t expired;                 /* queued frames dropped */
} sh_transport_stats;

/* Creates the transport for rt, starts listening on opts->listen_url and installs itself as rt's
 * send_frame hook (sh_transport_set(); no filter). *out is set on success only. Returns
 * SH_EINVAL (bad options or URL, the NNG text in e), SH_EUNSUPPORTED (tls+tcp:// without tls
 * options, or an NNG built without TLS), SH_EBUSY (the address is in use), SH_ENOTFOUND (the
 * listening host did not resolve within listen_resolve_ms), SH_ENOMEM, SH_EIO
 * (other NNG failures); on failure nothing is left open. Not concurrently with another
 * sh_transport_set() on rt. */
sh_err sh_transport_create(sh_runtime *rt, const sh_transport_opts *opts, sh_transport **out,
                           sh_error *e);

/* The URL actually listened on (for tcp:// with port 0, the bound port). Returns SH_ENOTFOUND
 * when not listening, SH_ERANGE when cap is too small. */
sh_err sh_transport_listen_url(sh_transport *tp, char *buf, size_t cap);

/* The hooks the transport installed, for a layer that wraps them (runtime/fault.h). */
void sh_transport_hooks_get(sh_transport *tp, sh_transport_hooks *out);

/* Adds node `node`'s listening URL and starts dialling it (non-blocking: the link starts
 * CONNECTING). Returns SH_EINVAL (node 0, this node, bad URL), SH_EBUSY (node already has a
 * peer), SH_EUNSUPPORTED (a scheme NNG does not know, or tls+tcp:// without TLS), SH_ECLOSED,
 * SH_ENOMEM, SH_EIO. */
sh_err sh_transport_peer_add(sh_transport *tp, uint32_t node, const char *url, sh_error *e);

/* Closes node's link; its queued frames are dropped. Returns SH_ENOTFOUND. */
sh_err sh_transport_peer_remove(sh_transport *tp, uint32_t node);

/* Copies up to cap link snapshots (in peer-add order) into out and sets *n to the number of
 * links (which may exceed cap). */
void sh_transport_links(sh_transport *tp, sh_transport_link *out, size_t cap, size_t *n);

/* One link's snapshot. Returns SH_ENOTFOUND. */
sh_err sh_transport_link_get(sh_transport *tp, uint32_t node, sh_transport_link *out);

void sh_transport_stats_get(sh_transport *tp, sh_transport_stats *out);

/* Stops all I/O: removes the hooks from the runtime, closes every socket (waiting for NNG
 * callbacks in progress), drops queued frames. Afterwards nothing calls into the runtime and
 * sends that still reach the transport fail with SH_ECLOSED. Idempotent. Shutdown order:
 * sh_fault_destroy(), sh_transport_close(), sh_runtime_destroy(), sh_transport_destroy(). */
void sh_transport_close(sh_transport *tp);

/* Closes (if needed) and frees. Accepts NULL. Call it after sh_runtime_destroy(), or when no
 * thread can be inside a send of the runtime any more: the runtime may still hold the old
 * hooks for a sender already past its hook lookup. */
void sh_transport_destroy(sh_transport *tp);

#ifdef __cplusplus
}
#endif

#endif
