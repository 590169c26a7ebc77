/* The stream engine: NNG's pipeline0 wire protocol over Unix and TCP sockets, on a runtime loop. */
#ifndef SH_RUNTIME_TRANSPORT_STREAM_H
#define SH_RUNTIME_TRANSPORT_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/transport.h"

/* Why this exists. NNG's own ipc and tcp transports hand every frame through four or five of
 * its worker threads (poller, task queue, socket, aio callback) before our callback sees it, and
 * on a small virtual machine each wake-up of a sleeping thread costs tens of microseconds; they
 * also zero a freshly allocated message for every frame received. This engine speaks exactly the
 * bytes NNG's transports put on the wire for push0 -> pull0 (so either side may be NNG), but:
 *   - the sockets are watched by one of the runtime's own loops (an internal actor), so a frame
 *     read there is handed to an actor on the same loop without any thread hop;
 *   - a sender writes its frame straight into the socket from its own thread when the link is
 *     idle (no queue, no copy, no hop); only what the kernel does not take at once is queued and
 *     finished by the loop when the socket is writable;
 *   - large frames are read into recycled buffers (no allocation, zeroing or page faults) and
 *     adopted by the runtime without a copy; large outgoing frames are built in them too.
 *
 * The wire format (NNG's SP over IPC and TCP): each side sends 8 bytes {0, 'S', 'P', 0, protocol
 * as 2 bytes big-endian, 0, 0} on connect (push0 is 0x50, pull0 0x51); then every message is its
 * length as 8 bytes big-endian and the bytes, with one more byte (1) in front of the length on
 * ipc:// (runtime/transport_endpoint.h). */

typedef struct sh__stream sh__stream;
typedef struct sh__stream_link sh__stream_link;

typedef struct sh__stream_opts {
    const char *listen_url;     /* an ipc:// or tcp:// URL to listen on, or NULL */
    uint32_t q_msgs;            /* per link: frames queued (the one being written included) */
    uint64_t q_bytes;           /* per link: bytes queued */
    size_t max_frame;           /* larger frames are refused (sent) or drop the connection */
    uint32_t rc_min, rc_max;    /* redial backoff, ms */
    uint32_t send_to;           /* a queued frame not started within this many ms is dropped */
    uint32_t loop;              /* the runtime loop that watches the sockets */
    uint64_t recycle_max_bytes; /* buffer pool bound; SH_TRANSPORT_RECYCLE_OFF keeps none */
    uint64_t pause_msgs;        /* stop reading while the runtime holds this many messages */
    uint64_t pause_bytes;       /* ... or received large frames it still holds this many bytes */
} sh__stream_opts;

/* The listening URL as bound (tcp port 0 resolved), or NULL when not listening. */
const char *sh__stream_listen_url(const sh__stream *x);

/* Creates the engine: binds opts->listen_url (when set) and starts the internal actor on loop
 * opts->loop, waiting for it to run. Returns SH_EINVAL (bad loop or URL), SH_ENOTFOUND (host
 * does not resolve), SH_EBUSY (the address is in use), SH_EIO, SH_ENOMEM; nothing is left on
 * failure. Not from a loop thread of rt. */
sh_err sh__stream_create(sh_runtime *rt, const sh__stream_opts *opts, sh__stream **out,
                         sh_error *e);

/* A new link dialling `url` (ipc:// or tcp://, resolved now) for node `node`; the loop dials it,
 * redialling with backoff. The engine owns the link until sh__stream_destroy(). Returns
 * SH_EINVAL (malformed URL, path too long), SH_ENOTFOUND (host does not resolve), SH_ECLOSED,
 * SH_ENOMEM. Any thread. */
sh_err sh__stream_link_add(sh__stream *x, uint32_t node, const char *url, sh__stream_link **out,
                           sh_error *e);

/* Sends one frame. With owner NULL the frame is borrowed: written at once when the link is idle,
 * copied when it has to wait. With an owner the link takes the buffer on SH_OK and releases it
 * exactly once when written or dropped; on an error the caller keeps it. Returns SH_EBUSY (queue
 * full), SH_ECLOSED (link removed), SH_ENOMEM. Any thread. */
sh_err sh__stream_link_send(sh__stream_link *l, uint8_t *frame, size_t len,
                            const sh_frame_owner *owner, sh_error *e);

/* Closes the link: queued frames are dropped, the connection closed on the loop. Any thread. */
void sh__stream_link_close(sh__stream_link *l);

/* Sets the link's last error (code and text) without touching its state: what the receive side
 * learnt about the peer (a frame of another protocol version, runtime/msg.h). Any thread. */
void sh__stream_link_note(sh__stream_link *l, sh_err code, const char *text);

/* The open link of `node` (the first added, if several), or NULL. Any thread; the link lives until
 * the engine is destroyed. */
sh__stream_link *sh__stream_link_find(sh__stream *x, uint32_t node);

/* The link as the watchdog sees it. Any thread. */
void sh__stream_link_snapshot(sh__stream_link *l, sh_transport_link *out);

/* A buffer of at least cap bytes that sh__stream_link_send() sends without copying (a recycled one
 * when the pool has it), with its owner; NULL when out of memory or closed. Any thread. */
uint8_t *sh__stream_frame_alloc(sh__stream *x, size_t cap, sh_frame_owner *owner);

/* Adds the engine's counters to *st. Any thread. */
void sh__stream_stats_add(sh__stream *x, sh_transport_stats *st);

/* Stops all I/O and waits until the loop has closed every socket; the listening socket's file
 * is removed. Afterwards nothing calls into the runtime. Idempotent. Not from a loop thread of
 * the runtime. Accepts NULL. */
void sh__stream_close(sh__stream *x);

/* Closes (if needed) and frees the engine and its links. Accepts NULL. */
void sh__stream_destroy(sh__stream *x);

#endif
