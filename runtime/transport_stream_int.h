/* The stream engine's internals shared by transport_stream.c (links, sending, the loop's actor,
 * setup) and transport_stream_conn.c (connections: dialling, accepting, reading, writing). */
#ifndef SH_RUNTIME_TRANSPORT_STREAM_INT_H
#define SH_RUNTIME_TRANSPORT_STREAM_INT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "runtime/bufpool.h"
#include "runtime/transport_endpoint.h"
#include "runtime/transport_stream.h"

#define HS_LEN 8
#define PROTO_PUSH0 0x50
#define PROTO_PULL0 0x51
/* Frames up to this size are read through a per-connection buffer and copied into the runtime's
 * pooled blocks; larger ones are read straight into a recycled buffer the runtime adopts. */
#define RBUF_LEN ((size_t)64 << 10)
/* At most this many frames go into one sendmsg. */
#define IOV_FRAMES 32
/* One readable callback stops reading after this many bytes or frames (what it has read it
 * still parses), so the actors of its loop get their turns while a peer floods it. */
#define READ_BUDGET ((size_t)4 << 20)
#define FRAME_BUDGET 512u
/* While reading is paused, the loop looks at the runtime's load this often. */
#define PAUSE_TICK_MS 1u
/* While frames wait, the loop looks for expired ones this often. */
#define EXPIRE_TICK_MS 50u
#define POOL_BUFS 16u
/* Connections that have not proved a node in HELLO (runtime/peers.h), while the peer gate is on:
 * a frame over the small buffer (any HELLO fits) is not read until the connection proves a node,
 * which it must do within PREAUTH_DEADLINE_MS of being accepted; the listener holds at most
 * PREAUTH_MAX_CONNS of them (a new one closes the oldest). */
#define PREAUTH_DEADLINE_MS 5000u
#define PREAUTH_MAX_CONNS 64u
#define PREAUTH_HOLD_TICK_MS 10u
/* How long accepting pauses when the process is out of descriptors. */
#define ACCEPT_PAUSE_MS 100u

/* A frame waiting on a link. `off` counts bytes already written, head included. */
typedef struct qframe {
    uint8_t head[SH__ENDPOINT_HEAD_MAX];
    uint8_t *data;
    size_t len;
    size_t off;
    sh_frame_owner owner; /* release NULL: data is our malloc'd copy */
    uint64_t t_ms;
} qframe;

typedef enum conn_state { C_CONNECTING, C_HS, C_UP } conn_state;

/* One connection: dialled for a link (link != NULL) or accepted on the listener. Loop thread
 * only, except that senders write to a dialled connection's fd through its link (under l->mu). */
typedef struct conn {
    uv_poll_t poll;
    sh__stream *x;
    sh__stream_link *link;
    struct conn *prev, *next; /* accepted connections */
    int fd;
    conn_state state;
    int events;
    bool closing;
    bool paused;  /* not read until the runtime drains (receive back-pressure) */
    uint8_t hlen; /* frame header bytes of the scheme */
    uint8_t hs[HS_LEN];
    uint32_t hs_got;
    /* Receiving (accepted): a small-frame buffer, or a large frame being read. */
    uint8_t *rbuf; /* (RBUF_LEN) */
    size_t rpos, rlen;
    uint8_t *big;
    size_t big_len, big_got;
    sh_frame_owner big_owner;
    uint64_t id;      /* accepted: the id the peer gate binds (runtime/peers.h), never 0 */
    uint64_t born_ms; /* accepted: when */
    bool proved;      /* accepted: it proved a node (or the gate is off): no budget applies */
    bool held; /* accepted, unproved: a large frame's head waits in rbuf until it proves a node */
} conn;

struct sh__stream_link {
    sh__stream *x;
    struct sh__stream_link *next; /* the engine's list; prepended, never unlinked before destroy */
    uint32_t node;
    sh__endpoint ep;
    uint8_t hlen;
    uv_mutex_t mu;
    /* Under mu. */
    int fd; /* the connection senders write to; -1 unless up */
    bool up, closed, want_write;
    qframe *ring; /* (cap) */
    uint32_t cap, head, n;
    uint64_t bytes;
    sh_transport_link info;
    /* Loop thread only. */
    conn *c;
    uint64_t redial_at;
    uint32_t backoff;
    /* A named host (ep.named) being resolved before a dial: gai is in flight on libuv's thread
     * pool and counts as one of the engine's open handles until its callback. */
    bool resolving;
    uv_getaddrinfo_t gai;
};

/* A raw recycled buffer: its capacity, then the frame. */
typedef struct rawbuf {
    size_t cap;
    size_t pad_; /* keeps data 16-byte aligned */
    uint8_t data[];
} rawbuf;

enum { IO_STARTING, IO_RUNNING, IO_DONE };

struct sh__stream {
    sh_runtime *rt;
    sh__stream_opts o;
    sh__bufpool *pool;
    sh__endpoint lep;
    char lurl[256]; /* as bound */
    int lfd;
    uv_mutex_t mu; /* links list head, io_state */
    uv_cond_t cv;
    sh__stream_link *links;
    int io_state;
    sh_addr io;
    bool io_spawned, io_failed, closed;
    _Atomic int ready; /* the loop's handles exist: kicks may be sent */
    /* Loop thread only. */
    uv_loop_t *loop;
    uv_async_t kick;
    uv_timer_t tick;
    uv_poll_t lpoll;
    bool kick_ok, tick_ok, lpoll_ok;
    uint64_t accept_resume; /* accepting paused until then; 0: not paused */
    uint32_t paused_conns;  /* accepted connections not read while the runtime is full */
    int open_handles;
    conn *accepted;
    _Atomic uint64_t frames_sent, bytes_sent, frames_recv, bytes_recv, rejected, busy, expired;
};

static inline uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void hs_make(uint8_t *hs, uint16_t proto)
{
    const uint8_t h[HS_LEN] = {0, 'S', 'P', 0, (uint8_t)(proto >> 8), (uint8_t)proto, 0, 0};
    memcpy(hs, h, HS_LEN);
}

/* Records an errno failure on a link (caller holds l->mu). */
static inline void link_fail(sh__stream_link *l, sh_err code, const char *what, int err)
{
    l->info.last_err = code;
    snprintf(l->info.last_error, sizeof l->info.last_error, "%s: %s", what,
             err ? strerror(err) : "protocol error");
}

static inline void qframe_release(qframe *q)
{
    if (q->owner.release)
        q->owner.release(q->owner.ctx, q->owner.handle);
    else
        free(q->data);
    q->data = NULL;
}

static inline void kick(sh__stream *x)
{
    if (atomic_load_explicit(&x->ready, memory_order_acquire))
        uv_async_send(&x->kick);
}

/* ---- transport_stream.c ----------------------------------------------------------------- */

/* A recycled or new buffer of at least cap bytes with its owner; `counted` for received frames
 * (their bytes count toward pause_bytes until released). NULL when out of memory. */
uint8_t *sh__stream_buf_get(sh__stream *x, size_t cap, bool counted, sh_frame_owner *owner);

/* Dials, expires and arms what the links need; re-arms the tick for the next deadline. Loop
 * thread. */
void sh__stream_service(sh__stream *x);

/* ---- transport_stream_conn.c: connections, loop thread only ----------------------------- */

/* Watches c for `events` (UV_READABLE, UV_WRITABLE). */
void sh__stream_conn_events(conn *c, int events);

/* Closes c. A dialled connection's link goes down (its partly written frame is lost with the
 * stream) and redials after its backoff; `code`/`what`/`err` say why, for its last error (what
 * NULL: leave it). An accepted one leaves the engine's list. Idempotent. */
void sh__stream_conn_close(conn *c, sh_err code, const char *what, int err);

/* Starts a connection attempt for link l (l->c == NULL, not resolving): a named host is resolved
 * first (l->resolving until then). */
void sh__stream_conn_dial(sh__stream_link *l);

/* The listener's poll callback: accepts every pending connection. */
void sh__stream_conn_on_listen(uv_poll_t *h, int status, int events);

/* One of the engine's handles finished closing; the last marks the engine done. */
void sh__stream_conn_handle_closed(sh__stream *x);

/* True while the runtime holds pause_msgs messages, or pause_bytes of received large frames. */
bool sh__stream_conn_full(sh__stream *x);

/* Reads the paused accepted connections again. */
void sh__stream_conn_resume(sh__stream *x);

/* The budgets of accepted connections that have not proved a node (PREAUTH_*): closes those
 * past their deadline, reads again the held ones that proved one since. Returns when to look
 * again (UINT64_MAX: nothing to watch). */
uint64_t sh__stream_conn_preauth(sh__stream *x, uint64_t now);

#endif
