/* The link-driver interface: what the transport's link table asks of the engine that carries a
 * link. */
#ifndef SH_RUNTIME_TRANSPORT_DRIVER_H
#define SH_RUNTIME_TRANSPORT_DRIVER_H

/*
 * A driver is an interface struct of function pointers plus a context pointer (as
 * kernels/backend.h). The transport (runtime/transport.c) holds one link table: it picks a driver
 * per URL (the first of its drivers whose `handles` accepts it), calls `link_add` for a dialled
 * link and afterwards reaches the link only through the table below; it never sees which engine
 * carries it. Two drivers exist:
 *   - the stream engine (runtime/transport_stream.c, sh__stream_driver): ipc:// and tcp://, on
 *     a runtime loop, without NNG's threads;
 *   - NNG (runtime/transport_nng.c, sh__transport_nng_driver): inproc://, tls+tcp://, and every
 *     URL when the transport is created with use_nng (then it is the only driver).
 * A listening URL goes to the driver that handles it, given as `listen_url` at create.
 *
 * Lifetime: create -> link_add ... -> link_close (each link) -> close -> link_free (each
 * link) -> destroy. A link's pointer stays valid until link_free, so senders may keep it after a
 * close. Every member takes the driver's ctx first; `link` is what link_add returned.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

/* What the transport tells every driver at create (its resolved options). */
typedef struct sh__transport_driver_opts {
    const char *listen_url;     /* a URL this driver handles, to listen on, or NULL */
    uint32_t q_msgs;            /* per link: frames queued (the one in flight included) */
    uint64_t q_bytes;           /* per link: bytes queued */
    size_t max_frame;           /* larger frames are refused (sent) or dropped (received) */
    uint32_t rc_min, rc_max;    /* redial backoff, ms */
    uint32_t send_to;           /* a queued frame not sent within this many ms is dropped */
    uint32_t loop;              /* the runtime loop that watches sockets (stream engine) */
    uint64_t recycle_max_bytes; /* buffer pool bound; SH_TRANSPORT_RECYCLE_OFF keeps none */
    uint64_t pause_msgs;        /* receive budget: stop reading while the runtime holds this many */
    uint64_t pause_bytes;       /* ... messages or this many bytes of received large frames */
    const sh_transport_tls *tls; /* certificates for tls+tcp:// (NNG), or NULL */
    /* A received frame the runtime refused with SH_EPROTO: the transport records it on the
     * sender's link, whichever driver carries that link. Any thread. */
    void (*note_foreign)(void *up, const void *frame, size_t len);
    void *up;
} sh__transport_driver_opts;

typedef struct sh__transport_driver {
    const char *name; /* "stream", "nng" */

    /* Whether this driver carries `url` (no ctx: the transport asks before creating it). */
    bool (*handles)(const char *url);

    /* Creates the driver and listens on o->listen_url when set. Returns SH_EINVAL (bad URL or
     * loop), SH_ENOTFOUND, SH_EBUSY (address in use), SH_EUNSUPPORTED, SH_EIO, SH_ENOMEM;
     * nothing is left on failure. Not from a loop thread of rt. */
    sh_err (*create)(sh_runtime *rt, const sh__transport_driver_opts *o, void **ctx, sh_error *e);

    /* The URL listened on as bound (tcp port 0 resolved), or NULL when not listening. */
    const char *(*listen_url)(void *ctx);

    /* Optional: refuses a URL this driver handles but cannot dial in this configuration
     * (tls+tcp:// without certificates: SH_EUNSUPPORTED). The transport asks before anything
     * else about a new link or its listening URL. */
    sh_err (*url_check)(void *ctx, const char *url, sh_error *e);

    /* A new link dialling `url` for `node` (non-blocking: it starts CONNECTING). Returns
     * SH_EINVAL, SH_ENOTFOUND, SH_ECLOSED, SH_ENOMEM, SH_EIO; nothing is left on failure. Any
     * thread; the transport calls it under its table lock. */
    sh_err (*link_add)(void *ctx, uint32_t node, const char *url, void **link, sh_error *e);

    /* Sends one frame (at most max_frame bytes; the transport checked). With owner NULL the
     * frame is borrowed for the call; with an owner the link takes the buffer on SH_OK and
     * releases it exactly once, on an error the caller keeps it. Returns SH_EBUSY (queue full),
     * SH_ECLOSED (link closed), SH_ENOMEM. Any thread: the send path, one indirect call. */
    sh_err (*send)(void *ctx, void *link, uint8_t *frame, size_t len, const sh_frame_owner *owner,
                   sh_error *e);

    /* A buffer of at least cap bytes that `send` on this driver's links takes without copying,
     * with its owner; NULL when out of memory or closed. Any thread. */
    uint8_t *(*frame_alloc)(void *ctx, size_t cap, sh_frame_owner *owner);

    /* Sets the link's last error without touching its state (what the receive side learnt about
     * the peer: a frame of another protocol version). Any thread. */
    void (*link_note)(void *ctx, void *link, sh_err code, const char *text);

    /* The link as the watchdog sees it. Any thread. */
    void (*link_snapshot)(void *ctx, void *link, sh_transport_link *out);

    /* Stops the link: no new frame starts, queued frames are dropped. Any thread; idempotent. */
    void (*link_close)(void *ctx, void *link);

    /* Optional: frees a closed link (after `close`). NULL where the driver owns its links until
     * destroy. */
    void (*link_free)(void *ctx, void *link);

    /* Adds the driver's counters to *st. Any thread. */
    void (*stats_add)(void *ctx, sh_transport_stats *st);

    /* Stops all I/O (links already closed) and waits for it: afterwards nothing calls into the
     * runtime. Not from a loop thread of rt. Idempotent. */
    void (*close)(void *ctx);

    /* Closes (if needed) and frees the driver. Accepts NULL. */
    void (*destroy)(void *ctx);
} sh__transport_driver;

/* The two drivers. */
extern const sh__transport_driver sh__stream_driver;        /* runtime/transport_stream.c */
extern const sh__transport_driver sh__transport_nng_driver; /* runtime/transport_nng.c */

#endif
