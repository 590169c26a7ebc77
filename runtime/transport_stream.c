/* The stream engine: pipeline0 frames over Unix and TCP sockets watched by a runtime loop. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "runtime/actor_uv.h"
#include "runtime/bufpool.h"
#include "runtime/error.h"
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
/* While frames wait, the loop looks for expired ones this often. */
#define EXPIRE_TICK_MS 50u
#define POOL_BUFS 16u
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
    uint8_t hlen; /* frame header bytes of the scheme */
    uint8_t hs[HS_LEN];
    uint32_t hs_got;
    /* Receiving (accepted): a small-frame buffer, or a large frame being read. */
    uint8_t *rbuf; /* (RBUF_LEN) */
    size_t rpos, rlen;
    uint8_t *big;
    size_t big_len, big_got;
    sh_frame_owner big_owner;
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
    int open_handles;
    conn *accepted;
    _Atomic uint64_t frames_sent, bytes_sent, frames_recv, bytes_recv, rejected, busy, expired;
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void hs_make(uint8_t *hs, uint16_t proto)
{
    const uint8_t h[HS_LEN] = {0, 'S', 'P', 0, (uint8_t)(proto >> 8), (uint8_t)proto, 0, 0};
    memcpy(hs, h, HS_LEN);
}

/* Records an errno failure on a link (caller holds l->mu). */
static void link_fail(sh__stream_link *l, sh_err code, const char *what, int err)
{
    l->info.last_err = code;
    snprintf(l->info.last_error, sizeof l->info.last_error, "%s: %s", what,
             err ? strerror(err) : "protocol error");
}

/* ---- Buffers ---------------------------------------------------------------------------- */

static size_t rawbuf_cap(void *h) { return ((rawbuf *)h)->cap; }
static void rawbuf_free(void *h) { free(h); }
static const sh__bufpool_ops rawbuf_ops = {.cap = rawbuf_cap, .free = rawbuf_free};

uint8_t *sh__stream_frame_alloc(sh__stream *x, size_t cap, sh_frame_owner *owner)
{
    rawbuf *b = sh__bufpool_take(x->pool, cap);
    if (!b) {
        /* Untouched pages of a fresh allocation cost nothing, so a peer that announces a large
         * frame and sends little of it holds only what it sent. */
        if (cap > SIZE_MAX - sizeof *b || !(b = malloc(sizeof *b + cap)))
            return NULL;
        b->cap = cap;
    }
    *owner = sh__bufpool_owner(x->pool, b);
    return b->data;
}

static void qframe_release(qframe *q)
{
    if (q->owner.release)
        q->owner.release(q->owner.ctx, q->owner.handle);
    else
        free(q->data);
    q->data = NULL;
}

/* ---- Sending ---------------------------------------------------------------------------- */

static void kick(sh__stream *x)
{
    if (atomic_load_explicit(&x->ready, memory_order_acquire))
        uv_async_send(&x->kick);
}

/* Writes what the kernel takes of the queued frames, from the head (caller holds l->mu and the
 * link is up). Returns 0, or the errno that broke the connection. */
static int flush_locked(sh__stream_link *l)
{
    sh__stream *x = l->x;
    const size_t H = l->hlen;
    while (l->n > 0) {
        struct iovec iov[2 * IOV_FRAMES];
        int k = 0;
        size_t offered = 0;
        for (uint32_t i = 0; i < l->n && i < IOV_FRAMES; i++) {
            qframe *q = &l->ring[(l->head + i) % l->cap];
            if (q->off < H)
                iov[k++] = (struct iovec){q->head + q->off, H - q->off};
            size_t d = q->off > H ? q->off - H : 0;
            if (q->len > d)
                iov[k++] = (struct iovec){q->data + d, q->len - d};
            offered += H + q->len - q->off;
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t w = sendmsg(l->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
        }
        size_t left = (size_t)w;
        while (l->n > 0) {
            qframe *q = &l->ring[l->head];
            size_t need = H + q->len - q->off;
            if (left < need) {
                q->off += left;
                break;
            }
            left -= need;
            l->bytes -= q->len;
            l->info.sent++;
            atomic_fetch_add_explicit(&x->frames_sent, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&x->bytes_sent, q->len, memory_order_relaxed);
            qframe_release(q);
            l->head = (l->head + 1) % l->cap;
            l->n--;
        }
        if ((size_t)w < offered)
            return 0; /* the kernel took less than offered: the socket is full */
    }
    l->info.last_activity_ms = mono_ms();
    return 0;
}

sh_err sh__stream_link_send(sh__stream_link *l, uint8_t *frame, size_t len,
                            const sh_frame_owner *owner, sh_error *e)
{
    sh__stream *x = l->x;
    uint8_t head[SH__ENDPOINT_HEAD_MAX];
    size_t H = sh__endpoint_head(l->hlen, head, len);
    uv_mutex_lock(&l->mu);
    if (l->closed) {
        uv_mutex_unlock(&l->mu);
        return sh__error_set(e, SH_ECLOSED, "transport: link to node %u closed", (unsigned)l->node);
    }
    if (l->n >= x->o.q_msgs || (l->n > 0 && l->bytes + len > x->o.q_bytes)) {
        l->info.busy++;
        atomic_fetch_add_explicit(&x->busy, 1, memory_order_relaxed);
        uint32_t n = l->n;
        uint64_t bytes = l->bytes;
        uv_mutex_unlock(&l->mu);
        return sh__error_set(e, SH_EBUSY,
                             "transport: link to node %u is full (%u frames, %llu bytes queued)",
                             (unsigned)l->node, (unsigned)n, (unsigned long long)bytes);
    }
    size_t off = 0;
    if (l->up && l->n == 0) {
        /* The fast path: straight into the socket from this thread. */
        struct iovec iov[2] = {{head, H}, {frame, len}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        ssize_t w;
        do
            w = sendmsg(l->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (w < 0 && errno == EINTR);
        if (w == (ssize_t)(H + len)) {
            l->info.sent++;
            l->info.last_activity_ms = mono_ms();
            uv_mutex_unlock(&l->mu);
            atomic_fetch_add_explicit(&x->frames_sent, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&x->bytes_sent, len, memory_order_relaxed);
            if (owner)
                owner->release(owner->ctx, owner->handle);
            return SH_OK;
        }
        /* Partly written, or not at all (full, or broken: the loop sees the error and
         * reconnects); the rest waits in the queue. */
        off = w > 0 ? (size_t)w : 0;
    }
    qframe q = {.len = len, .off = off, .t_ms = mono_ms()};
    memcpy(q.head, head, H);
    if (owner) {
        q.data = frame;
        q.owner = *owner;
    } else if (!(q.data = malloc(len ? len : 1))) {
        /* A partly written frame cannot be taken back: the stream is broken for the peer, so
         * the connection must go; the loop sees want_write with nothing sane to finish. */
        if (off)
            shutdown(l->fd, SHUT_RDWR);
        uv_mutex_unlock(&l->mu);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for a %zu-byte frame", len);
    } else {
        memcpy(q.data, frame, len);
    }
    l->ring[(l->head + l->n) % l->cap] = q;
    l->n++;
    l->bytes += len;
    /* Wake the loop to watch for writability (once per backlog), or to arm the expiry tick
     * while the link is not up. */
    bool wake = !l->up || !l->want_write;
    if (l->up)
        l->want_write = true;
    uv_mutex_unlock(&l->mu);
    if (wake)
        kick(x);
    return SH_OK;
}

/* Drops queued frames older than send_to that have not started (caller holds l->mu). */
static void expire_locked(sh__stream_link *l, uint64_t now)
{
    sh__stream *x = l->x;
    uint32_t first = l->n > 0 && l->ring[l->head].off > 0 ? 1u : 0u;
    uint32_t k = 0;
    while (first + k < l->n) {
        qframe *q = &l->ring[(l->head + first + k) % l->cap];
        if (now - q->t_ms < x->o.send_to)
            break;
        l->bytes -= q->len;
        qframe_release(q);
        k++;
    }
    if (k == 0)
        return;
    if (first) /* keep the partly written frame at the front */
        l->ring[(l->head + k) % l->cap] = l->ring[l->head];
    l->head = (l->head + k) % l->cap;
    l->n -= k;
    l->info.expired += k;
    atomic_fetch_add_explicit(&x->expired, k, memory_order_relaxed);
    link_fail(l, SH_ETIMEDOUT, "send", ETIMEDOUT);
}

/* ---- Connections (loop thread) ---------------------------------------------------------- */

static void handle_closed(sh__stream *x)
{
    if (--x->open_handles > 0)
        return;
    uv_mutex_lock(&x->mu);
    x->io_state = IO_DONE;
    uv_cond_broadcast(&x->cv);
    uv_mutex_unlock(&x->mu);
}

static void on_handle_closed(uv_handle_t *h) { handle_closed(h->data); }

/* The stop member found nothing to close. */
static void handle_closed_none(sh__stream *x)
{
    x->open_handles = 1;
    handle_closed(x);
}

static void on_conn_closed(uv_handle_t *h)
{
    conn *c = h->data;
    sh__stream *x = c->x;
    close(c->fd);
    free(c->rbuf);
    if (c->big)
        c->big_owner.release(c->big_owner.ctx, c->big_owner.handle);
    free(c);
    handle_closed(x);
}

static void conn_io(uv_poll_t *h, int status, int events);

static void conn_events(conn *c, int events)
{
    if (c->closing || c->events == events)
        return;
    c->events = events;
    uv_poll_start(&c->poll, events, conn_io);
}

static conn *conn_new(sh__stream *x, int fd, sh__stream_link *l, uint8_t hlen)
{
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    if (uv_poll_init(x->loop, &c->poll, fd) != 0) {
        free(c);
        return NULL;
    }
    c->poll.data = c;
    c->x = x;
    c->link = l;
    c->fd = fd;
    c->hlen = hlen;
    x->open_handles++;
    return c;
}

/* Closes c. A dialled connection's link goes down (its partly written frame is lost with the
 * stream) and redials after its backoff. `err`/`code` say why, for the link's last error. */
static void conn_close(conn *c, sh_err code, const char *what, int err)
{
    if (c->closing)
        return;
    c->closing = true;
    sh__stream *x = c->x;
    sh__stream_link *l = c->link;
    if (l) {
        uv_mutex_lock(&l->mu);
        l->fd = -1;
        if (l->up) {
            l->info.state = SH_LINK_STATE_DOWN;
            l->info.last_activity_ms = mono_ms();
        }
        l->up = false;
        l->want_write = false;
        if (l->n > 0 && l->ring[l->head].off > 0) {
            qframe *q = &l->ring[l->head];
            l->bytes -= q->len;
            qframe_release(q);
            l->head = (l->head + 1) % l->cap;
            l->n--;
            l->info.expired++;
            atomic_fetch_add_explicit(&x->expired, 1, memory_order_relaxed);
        }
        for (uint32_t i = 0; i < l->n; i++)
            l->ring[(l->head + i) % l->cap].off = 0;
        if (what)
            link_fail(l, code, what, err);
        uv_mutex_unlock(&l->mu);
        l->c = NULL;
        l->redial_at = mono_ms() + l->backoff;
        l->backoff = l->backoff * 2 > x->o.rc_max ? x->o.rc_max : l->backoff * 2;
        kick(x); /* schedule the redial */
    } else {
        if (c->prev)
            c->prev->next = c->next;
        else
            x->accepted = c->next;
        if (c->next)
            c->next->prev = c->prev;
    }
    uv_close((uv_handle_t *)&c->poll, on_conn_closed);
}

/* Reads the peer's 8-byte header. Returns 1 when complete and valid, 0 to wait for more, -1
 * when c was closed. */
static int read_handshake(conn *c, uint16_t want)
{
    while (c->hs_got < HS_LEN) {
        ssize_t r = read(c->fd, c->hs + c->hs_got, HS_LEN - c->hs_got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (r <= 0) {
            conn_close(c, SH_ECLOSED, "handshake", r == 0 ? ECONNRESET : errno);
            return -1;
        }
        c->hs_got += (uint32_t)r;
    }
    uint8_t ok[HS_LEN];
    hs_make(ok, want);
    if (memcmp(c->hs, ok, HS_LEN) != 0) {
        if (!c->link)
            atomic_fetch_add_explicit(&c->x->rejected, 1, memory_order_relaxed);
        conn_close(c, SH_EPROTO, "handshake: the peer is not an SP pipeline0 socket", 0);
        return -1;
    }
    return 1;
}

/* Hands one received frame to the runtime. */
static void deliver(sh__stream *x, const uint8_t *frame, size_t len)
{
    atomic_fetch_add_explicit(&x->frames_recv, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->bytes_recv, len, memory_order_relaxed);
    sh_error e;
    sh_err err = sh_transport_deliver(x->rt, frame, len, &e);
    if (err == SH_EFORMAT || err == SH_EPROTO)
        atomic_fetch_add_explicit(&x->rejected, 1, memory_order_relaxed);
}

static void deliver_big(sh__stream *x, conn *c)
{
    atomic_fetch_add_explicit(&x->frames_recv, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->bytes_recv, c->big_len, memory_order_relaxed);
    sh_error e;
    sh_err err = sh_transport_deliver_owned(x->rt, c->big, c->big_len, &c->big_owner, &e);
    if (err) { /* the runtime did not take it */
        c->big_owner.release(c->big_owner.ctx, c->big_owner.handle);
        if (err == SH_EFORMAT || err == SH_EPROTO)
            atomic_fetch_add_explicit(&x->rejected, 1, memory_order_relaxed);
    }
    c->big = NULL;
}

/* Parses whole frames out of c->rbuf. Returns false when c was closed. */
static bool parse(conn *c)
{
    sh__stream *x = c->x;
    const size_t H = c->hlen;
    while (c->rlen - c->rpos >= H) {
        const uint8_t *p = c->rbuf + c->rpos;
        uint64_t len = 0;
        if (!sh__endpoint_head_read(c->hlen, p, &len) || len > x->o.max_frame) {
            atomic_fetch_add_explicit(&x->rejected, 1, memory_order_relaxed);
            conn_close(c, SH_EPROTO, NULL, 0);
            return false;
        }
        size_t have = c->rlen - c->rpos - H;
        if (len <= RBUF_LEN - H) {
            if (have < len)
                break;
            deliver(x, p + H, (size_t)len);
            c->rpos += H + (size_t)len;
            continue;
        }
        uint8_t *b = sh__stream_frame_alloc(x, (size_t)len, &c->big_owner);
        if (!b) {
            conn_close(c, SH_ENOMEM, NULL, 0);
            return false;
        }
        c->big = b;
        c->big_len = (size_t)len;
        c->big_got = have;
        memcpy(b, p + H, have);
        c->rpos = c->rlen = 0;
        return true;
    }
    if (c->rpos == c->rlen) {
        c->rpos = c->rlen = 0;
    } else if (c->rpos > 0) {
        memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
    }
    return true;
}

/* An accepted connection is readable. */
static void accepted_read(conn *c)
{
    if (c->state == C_HS) {
        int hs = read_handshake(c, PROTO_PUSH0);
        if (hs <= 0)
            return;
        c->state = C_UP;
    }
    if (!c->rbuf && !(c->rbuf = malloc(RBUF_LEN))) {
        conn_close(c, SH_ENOMEM, NULL, 0);
        return;
    }
    size_t budget = READ_BUDGET;
    uint64_t frames0 = atomic_load_explicit(&c->x->frames_recv, memory_order_relaxed);
    while (budget > 0 && atomic_load_explicit(&c->x->frames_recv, memory_order_relaxed) - frames0 <
                             FRAME_BUDGET) {
        ssize_t r;
        if (c->big)
            r = read(c->fd, c->big + c->big_got, c->big_len - c->big_got);
        else
            r = read(c->fd, c->rbuf + c->rlen, RBUF_LEN - c->rlen);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0) {
            conn_close(c, SH_ECLOSED, NULL, 0);
            return;
        }
        budget = (size_t)r > budget ? 0 : budget - (size_t)r;
        if (c->big) {
            c->big_got += (size_t)r;
            if (c->big_got == c->big_len)
                deliver_big(c->x, c);
        } else {
            c->rlen += (size_t)r;
            if (!parse(c))
                return;
        }
    }
}

/* A dialled connection is readable: the handshake, then nothing (a pull0 peer never sends;
 * whatever comes is read and ignored) until end of file. */
static void dialled_read(conn *c)
{
    sh__stream_link *l = c->link;
    if (c->state == C_HS) {
        int hs = read_handshake(c, PROTO_PULL0);
        if (hs <= 0)
            return;
        c->state = C_UP;
        uv_mutex_lock(&l->mu);
        if (l->closed) { /* removed while connecting: the next service pass closes c */
            uv_mutex_unlock(&l->mu);
            return;
        }
        l->fd = c->fd;
        l->up = true;
        l->info.state = SH_LINK_STATE_UP;
        l->info.ups++;
        l->info.last_activity_ms = mono_ms();
        l->want_write = l->n > 0;
        bool want = l->want_write;
        uv_mutex_unlock(&l->mu);
        l->backoff = c->x->o.rc_min;
        conn_events(c, want ? UV_READABLE | UV_WRITABLE : UV_READABLE);
    }
    uint8_t junk[256];
    for (;;) {
        ssize_t r = read(c->fd, junk, sizeof junk);
        if (r > 0)
            continue;
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        conn_close(c, SH_ECLOSED, "connection closed by the peer", r == 0 ? ECONNRESET : errno);
        return;
    }
}

static void dialled_write(conn *c)
{
    sh__stream_link *l = c->link;
    if (c->state == C_CONNECTING) {
        int err = 0;
        socklen_t sl = sizeof err;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl) != 0)
            err = errno;
        uint8_t hs[HS_LEN];
        hs_make(hs, PROTO_PUSH0);
        if (!err && send(c->fd, hs, HS_LEN, MSG_NOSIGNAL | MSG_DONTWAIT) != HS_LEN)
            err = errno ? errno : EIO;
        if (err) {
            conn_close(c, SH_ECLOSED, "connect", err);
            return;
        }
        c->state = C_HS;
        conn_events(c, UV_READABLE);
        return;
    }
    if (c->state != C_UP)
        return;
    uv_mutex_lock(&l->mu);
    int err = flush_locked(l);
    bool more = l->n > 0;
    l->want_write = more;
    uv_mutex_unlock(&l->mu);
    if (err)
        conn_close(c, SH_ECLOSED, "write", err);
    else
        conn_events(c, more ? UV_READABLE | UV_WRITABLE : UV_READABLE);
}

static void conn_io(uv_poll_t *h, int status, int events)
{
    conn *c = h->data;
    if (status < 0) {
        conn_close(c, SH_EIO, c->link ? "poll" : NULL, -status);
        return;
    }
    if (c->link) {
        if ((events & UV_WRITABLE) && !c->closing)
            dialled_write(c);
        if ((events & UV_READABLE) && !c->closing && c->state != C_CONNECTING)
            dialled_read(c);
        return;
    }
    accepted_read(c);
}

/* Starts a connection attempt for link l (loop thread, l->c == NULL). */
static void dial(sh__stream_link *l)
{
    sh__stream *x = l->x;
    int fd = sh__endpoint_socket(&l->ep);
    int err = fd < 0 ? errno : 0;
    int rc = -1;
    if (fd >= 0) {
        do
            rc = connect(fd, (struct sockaddr *)&l->ep.sa, l->ep.sa_len);
        while (rc != 0 && errno == EINTR);
        err = rc == 0 || errno == EINPROGRESS ? 0 : errno;
    }
    conn *c = err ? NULL : conn_new(x, fd, l, l->hlen);
    if (!c) {
        if (fd >= 0)
            close(fd);
        uv_mutex_lock(&l->mu);
        link_fail(l, err == ENOENT ? SH_ENOTFOUND : SH_ECLOSED, "connect", err ? err : ENOMEM);
        uv_mutex_unlock(&l->mu);
        l->redial_at = mono_ms() + l->backoff;
        l->backoff = l->backoff * 2 > x->o.rc_max ? x->o.rc_max : l->backoff * 2;
        return;
    }
    l->c = c;
    if (rc == 0) { /* a Unix socket usually connects at once, tcp almost never */
        c->state = C_CONNECTING;
        dialled_write(c);
        return;
    }
    c->state = C_CONNECTING;
    conn_events(c, UV_WRITABLE);
}

static void service(sh__stream *x);

/* Accepts every pending connection on the listener. */
static void on_listen(uv_poll_t *h, int status, int events)
{
    (void)events;
    sh__stream *x = h->data;
    if (status < 0)
        return;
    for (;;) {
        int fd = accept4(x->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                /* Out of descriptors or memory: the pending connection stays readable, so stop
                 * watching for a while instead of spinning on it. */
                uv_poll_stop(&x->lpoll);
                x->accept_resume = mono_ms() + ACCEPT_PAUSE_MS;
                service(x);
            }
            return;
        }
        uint8_t hs[HS_LEN];
        hs_make(hs, PROTO_PULL0);
        conn *c = NULL;
        if (!x->lep.unix_path) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        }
        if (send(fd, hs, HS_LEN, MSG_NOSIGNAL | MSG_DONTWAIT) != HS_LEN ||
            !(c = conn_new(x, fd, NULL, x->lep.head_len))) {
            close(fd);
            continue;
        }
        c->state = C_HS;
        c->next = x->accepted;
        if (x->accepted)
            x->accepted->prev = c;
        x->accepted = c;
        conn_events(c, UV_READABLE);
    }
}

static void on_tick(uv_timer_t *h);

/* Dials, expires and arms what the links need; re-arms the tick for the next deadline. */
static void service(sh__stream *x)
{
    uint64_t now = mono_ms(), next = UINT64_MAX;
    uv_mutex_lock(&x->mu);
    sh__stream_link *first = x->links;
    uv_mutex_unlock(&x->mu);
    for (sh__stream_link *l = first; l; l = l->next) {
        uv_mutex_lock(&l->mu);
        bool closed = l->closed, want = l->up && l->want_write;
        if (l->n > 0)
            expire_locked(l, now);
        uint32_t n = l->n;
        uv_mutex_unlock(&l->mu);
        if (closed) {
            if (l->c)
                conn_close(l->c, SH_OK, NULL, 0);
            continue;
        }
        if (!l->c && now >= l->redial_at)
            dial(l);
        if (l->c && want)
            conn_events(l->c, UV_READABLE | UV_WRITABLE);
        if (!l->c && l->redial_at < next)
            next = l->redial_at;
        if (n > 0 && now + EXPIRE_TICK_MS < next)
            next = now + EXPIRE_TICK_MS;
    }
    if (x->accept_resume && now >= x->accept_resume) {
        x->accept_resume = 0;
        uv_poll_start(&x->lpoll, UV_READABLE, on_listen);
    }
    if (x->accept_resume && x->accept_resume < next)
        next = x->accept_resume;
    if (next == UINT64_MAX)
        uv_timer_stop(&x->tick);
    else
        uv_timer_start(&x->tick, on_tick, next > now ? next - now : 1, 0);
}

static void on_tick(uv_timer_t *h) { service(h->data); }
static void on_kick(uv_async_t *h) { service(h->data); }

/* ---- The loop's actor ------------------------------------------------------------------- */

/* Opens the loop's handles. A failure is reported through io_failed rather than by failing init,
 * so that the stop member still runs and closes what was opened. */
static sh_err io_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    sh__stream *x = arg;
    *(sh__stream **)state = x;
    x->loop = sh__actor_uv_loop(ctx);
    int rc = uv_async_init(x->loop, &x->kick, on_kick);
    if (rc == 0) {
        x->kick.data = x;
        x->kick_ok = true;
        uv_timer_init(x->loop, &x->tick); /* cannot fail */
        x->tick.data = x;
        x->tick_ok = true;
        x->open_handles = 2;
        if (x->lfd >= 0 && (rc = uv_poll_init(x->loop, &x->lpoll, x->lfd)) == 0) {
            x->lpoll.data = x;
            x->lpoll_ok = true;
            x->open_handles++;
            rc = uv_poll_start(&x->lpoll, UV_READABLE, on_listen);
        }
    }
    uv_mutex_lock(&x->mu);
    x->io_failed = rc != 0;
    x->io_state = IO_RUNNING;
    uv_cond_broadcast(&x->cv);
    uv_mutex_unlock(&x->mu);
    if (rc == 0) {
        atomic_store_explicit(&x->ready, 1, memory_order_release);
        service(x);
    }
    return SH_OK;
}

static sh_msg_fate io_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx, (void)state, (void)m; /* nobody has a reason to write to it */
    return SH_MSG_FATE_DONE;
}

/* Closes every socket and handle; the last close callback marks the engine done. */
static void io_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__stream *x = *(sh__stream **)state;
    atomic_store_explicit(&x->ready, 0, memory_order_release);
    while (x->accepted)
        conn_close(x->accepted, SH_OK, NULL, 0);
    uv_mutex_lock(&x->mu);
    sh__stream_link *first = x->links;
    uv_mutex_unlock(&x->mu);
    for (sh__stream_link *l = first; l; l = l->next)
        if (l->c)
            conn_close(l->c, SH_ECLOSED, "transport closed", 0);
    if (x->kick_ok)
        uv_close((uv_handle_t *)&x->kick, on_handle_closed);
    if (x->tick_ok)
        uv_close((uv_handle_t *)&x->tick, on_handle_closed);
    if (x->lpoll_ok)
        uv_close((uv_handle_t *)&x->lpoll, on_handle_closed);
    if (x->open_handles == 0)
        handle_closed_none(x);
}

static const sh_actor_vtable io_vt = {.name = "stream_io",
                                      .state_size = sizeof(sh__stream *),
                                      .init = io_init,
                                      .handle = io_handle,
                                      .stop = io_stop};

/* ---- Setup ------------------------------------------------------------------------------ */

static sh_err listen_bind(sh__stream *x, const char *url, sh_error *e)
{
    sh_err err = sh__endpoint_parse(url, true, &x->lep, e);
    if (!err)
        err = sh__endpoint_listen(&x->lep, url, &x->lfd, x->lurl, sizeof x->lurl, e);
    return err;
}

const char *sh__stream_listen_url(const sh__stream *x) { return x->lfd >= 0 ? x->lurl : NULL; }

sh_err sh__stream_create(sh_runtime *rt, const sh__stream_opts *opts, sh__stream **out, sh_error *e)
{
    sh__stream *x = calloc(1, sizeof *x);
    if (!x)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    x->rt = rt;
    x->o = *opts;
    x->o.listen_url = NULL;
    x->lfd = -1;
    bool off = opts->recycle_max_bytes == SH_TRANSPORT_RECYCLE_OFF;
    x->pool = sh__bufpool_create(&rawbuf_ops, off ? 0 : POOL_BUFS, opts->recycle_max_bytes);
    if (!x->pool) {
        free(x);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    }
    uv_mutex_init(&x->mu);
    uv_cond_init(&x->cv);
    sh_err err = opts->listen_url ? listen_bind(x, opts->listen_url, e) : SH_OK;
    if (!err)
        err = sh_runtime_register(rt, &io_vt, e);
    if (!err)
        err = sh_actor_spawn(rt, io_vt.name, x, (int)opts->loop, &x->io, e);
    if (!err) {
        x->io_spawned = true;
        uv_mutex_lock(&x->mu);
        while (x->io_state == IO_STARTING)
            uv_cond_wait(&x->cv, &x->mu);
        if (x->io_failed)
            err = sh__error_set(e, SH_EIO, "transport: cannot watch sockets on loop %u",
                                (unsigned)opts->loop);
        uv_mutex_unlock(&x->mu);
    }
    if (err) {
        sh__stream_destroy(x);
        return err;
    }
    *out = x;
    return SH_OK;
}

sh_err sh__stream_link_add(sh__stream *x, uint32_t node, const char *url, sh__stream_link **out,
                           sh_error *e)
{
    sh__endpoint ep;
    sh_err err = sh__endpoint_parse(url, false, &ep, e);
    if (err)
        return err;
    sh__stream_link *l = calloc(1, sizeof *l);
    qframe *ring = calloc(x->o.q_msgs, sizeof *ring);
    if (!l || !ring) {
        free(l);
        free(ring);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for peer %u", (unsigned)node);
    }
    l->x = x;
    l->node = node;
    l->ep = ep;
    l->hlen = ep.head_len;
    uv_mutex_init(&l->mu);
    l->fd = -1;
    l->ring = ring;
    l->cap = x->o.q_msgs;
    l->info.node = node;
    snprintf(l->info.url, sizeof l->info.url, "%s", url);
    l->info.state = SH_LINK_STATE_CONNECTING;
    l->info.last_activity_ms = mono_ms();
    l->backoff = x->o.rc_min;
    uv_mutex_lock(&x->mu);
    if (x->closed) {
        uv_mutex_unlock(&x->mu);
        uv_mutex_destroy(&l->mu);
        free(ring);
        free(l);
        return sh__error_set(e, SH_ECLOSED, "transport: closed");
    }
    l->next = x->links;
    x->links = l;
    uv_mutex_unlock(&x->mu);
    kick(x);
    *out = l;
    return SH_OK;
}

/* Drops every queued frame (caller holds l->mu). */
static void drop_all_locked(sh__stream_link *l)
{
    for (uint32_t i = 0; i < l->n; i++)
        qframe_release(&l->ring[(l->head + i) % l->cap]);
    l->n = 0;
    l->bytes = 0;
}

void sh__stream_link_close(sh__stream_link *l)
{
    uv_mutex_lock(&l->mu);
    l->closed = true;
    l->up = false;
    l->fd = -1;
    drop_all_locked(l);
    uv_mutex_unlock(&l->mu);
    kick(l->x);
}

void sh__stream_link_snapshot(sh__stream_link *l, sh_transport_link *out)
{
    uv_mutex_lock(&l->mu);
    *out = l->info;
    out->queue_msgs = l->n;
    out->queue_bytes = l->bytes;
    uv_mutex_unlock(&l->mu);
}

void sh__stream_stats_add(sh__stream *x, sh_transport_stats *st)
{
    st->frames_sent += atomic_load(&x->frames_sent);
    st->bytes_sent += atomic_load(&x->bytes_sent);
    st->frames_recv += atomic_load(&x->frames_recv);
    st->bytes_recv += atomic_load(&x->bytes_recv);
    st->rejected += atomic_load(&x->rejected);
    st->busy += atomic_load(&x->busy);
    st->expired += atomic_load(&x->expired);
}

void sh__stream_close(sh__stream *x)
{
    if (!x)
        return;
    uv_mutex_lock(&x->mu);
    bool was = x->closed;
    x->closed = true;
    sh__stream_link *first = x->links;
    uv_mutex_unlock(&x->mu);
    if (was)
        return;
    for (sh__stream_link *l = first; l; l = l->next)
        sh__stream_link_close(l);
    if (x->io_spawned) {
        sh_actor_stop(x->rt, x->io);
        uv_mutex_lock(&x->mu);
        while (x->io_state != IO_DONE)
            uv_cond_wait(&x->cv, &x->mu);
        uv_mutex_unlock(&x->mu);
    }
    if (x->lfd >= 0) {
        close(x->lfd);
        if (x->lep.unix_path)
            unlink(((struct sockaddr_un *)&x->lep.sa)->sun_path);
        x->lfd = -1;
    }
    sh__bufpool_close(x->pool);
}

void sh__stream_destroy(sh__stream *x)
{
    if (!x)
        return;
    sh__stream_close(x);
    sh__stream_link *l = x->links;
    while (l) {
        sh__stream_link *next = l->next;
        drop_all_locked(l);
        free(l->ring);
        uv_mutex_destroy(&l->mu);
        free(l);
        l = next;
    }
    sh__bufpool_unref(x->pool);
    uv_cond_destroy(&x->cv);
    uv_mutex_destroy(&x->mu);
    free(x);
}
