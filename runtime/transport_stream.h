/* The ipc:// engine: NNG's pipeline0 wire protocol over Unix sockets, run on a runtime loop. */
#ifndef SH_RUNTIME_TRANSPORT_IPC_H
#define SH_RUNTIME_TRANSPORT_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/transport.h"

/* Why this exists. NNG's own ipc transport hands every frame through four or five of its worker
 * threads (poller, task queue, socket, aio callback) before our callback sees it, and on a small
 * virtual machine each wake-up of a sleeping thread costs tens of microseconds; it also zeroes a
 * freshly allocated message for every frame it receives. This engine speaks exactly the bytes
 * NNG's ipc transport puts on the wire for push0 -> pull0 (so either side may be NNG), but:
 *   - the sockets are watched by one of the runtime's own loops (an internal actor), so a frame
 *     read there is handed to an actor on the same loop without any thread hop;
 *   - a sender writes its frame straight into the socket from its own thread when the link is
 *     idle (no queue, no copy, no hop); only what the kernel does not take at once is queued and
 *     finished by the loop when the socket is writable;
 *   - large frames are read into recycled buffers (no allocation, zeroing or page faults) and
 *     adopted by the runtime without a copy; large outgoing frames are built in them too.
 *
 * The wire format (NNG's SP over IPC): each side sends 8 bytes {0, 'S', 'P', 0, protocol as 2
 * bytes big-endian, 0, 0} on connect (push0 is 0x50, pull0 0x51); then every message is one byte
 * 1, its length as 8 bytes big-endian, and the bytes. */

typedef struct sh__ipc sh__ipc;
typedef struct sh__ipc_link sh__ipc_link;

typedef struct sh__ipc_opts {
    const char *listen_url;     /* an ipc:// URL to listen on, or NULL */
    uint32_t q_msgs;            /* per link: frames queued (the one being written included) */
    uint64_t q_bytes;           /* per link: bytes queued */
    size_t max_frame;           /* larger frames are refused (sent) or drop the connection */
    uint32_t rc_min, rc_max;    /* redial backoff, ms */
    uint32_t send_to;           /* a queued frame not started within this many ms is dropped */
    uint32_t loop;              /* the runtime loop that watches the sockets */
    uint64_t recycle_max_bytes; /* buffer pool bound; SH_TRANSPORT_RECYCLE_OFF keeps none */
} sh__ipc_opts;

/* The path of an ipc:// URL, or NULL for any other URL. */
const char *sh__ipc_path(const char *url);

/* Creates the engine: binds opts->listen_url (when set) and starts the internal actor on loop
 * opts->loop, waiting for it to run. Returns SH_EINVAL (bad loop, a path longer than a Unix
 * socket allows), SH_EBUSY (another process listens there), SH_EIO, SH_ENOMEM; nothing is left
 * on failure. Not from a loop thread of rt. */
sh_err sh__ipc_create(sh_runtime *rt, const sh__ipc_opts *opts, sh__ipc **out, sh_error *e);

/* A new link dialling `url` (ipc://) for node `node`; the loop dials it, redialling with backoff.
 * The engine owns the link until sh__ipc_destroy(). Returns SH_EINVAL (path too long),
 * SH_ECLOSED, SH_ENOMEM. Any thread. */
sh_err sh__ipc_link_add(sh__ipc *x, uint32_t node, const char *url, sh__ipc_link **out,
                        sh_error *e);

/* Sends one frame. With owner NULL the frame is borrowed: written at once when the link is idle,
 * copied when it has to wait. With an owner the link takes the buffer on SH_OK and releases it
 * exactly once when written or dropped; on an error the caller keeps it. Returns SH_EBUSY (queue
 * full), SH_ECLOSED (link removed), SH_ENOMEM. Any thread. */
sh_err sh__ipc_link_send(sh__ipc_link *l, uint8_t *frame, size_t len, const sh_frame_owner *owner,
                         sh_error *e);

/* Closes the link: queued frames are dropped, the connection closed on the loop. Any thread. */
void sh__ipc_link_close(sh__ipc_link *l);

/* The link as the watchdog sees it. Any thread. */
void sh__ipc_link_snapshot(sh__ipc_link *l, sh_transport_link *out);

/* A buffer of at least cap bytes that sh__ipc_link_send() sends without copying (a recycled one
 * when the pool has it), with its owner; NULL when out of memory or closed. Any thread. */
uint8_t *sh__ipc_frame_alloc(sh__ipc *x, size_t cap, sh_frame_owner *owner);

/* Adds the engine's counters to *st. Any thread. */
void sh__ipc_stats_add(sh__ipc *x, sh_transport_stats *st);

/* Stops all I/O and waits until the loop has closed every socket; the listening socket's file
 * is removed. Afterwards nothing calls into the runtime. Idempotent. Not from a loop thread of
 * the runtime. Accepts NULL. */
void sh__ipc_close(sh__ipc *x);

/* Closes (if needed) and frees the engine and its links. Accepts NULL. */
void sh__ipc_destroy(sh__ipc *x);

#endif
