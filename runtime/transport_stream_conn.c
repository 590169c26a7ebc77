/* The stream engine's connections: dialling, accepting, handshakes, reading and delivering
 * frames, finishing queued writes. Everything here runs on the engine's loop thread. */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "runtime/internal.h"
#include "runtime/peers.h"
#include "runtime/transport_stream_int.h"

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

void sh__stream_conn_handle_closed(sh__stream *x)
{
    if (--x->open_handles > 0)
        return;
    uv_mutex_lock(&x->mu);
    x->io_state = IO_DONE;
    uv_cond_broadcast(&x->cv);
    uv_mutex_unlock(&x->mu);
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
    sh__stream_conn_handle_closed(x);
}

static void conn_io(uv_poll_t *h, int status, int events);

/* Ids of accepted connections, unique in the process (NNG's pipes use the top bit). */
static _Atomic uint64_t next_conn_id;

void sh__stream_conn_events(conn *c, int events)
{
    if (c->closing || c->events == events)
        return;
    c->events = events;
    if (events)
        uv_poll_start(&c->poll, events, conn_io);
    else
        uv_poll_stop(&c->poll);
}

bool sh__stream_conn_full(sh__stream *x)
{
    return atomic_load_explicit(&x->rt->msgs_live, memory_order_relaxed) >= x->o.pause_msgs ||
           sh__bufpool_held(x->pool) >= x->o.pause_bytes;
}

void sh__stream_conn_resume(sh__stream *x)
{
    for (conn *c = x->accepted; c; c = c->next)
        if (c->paused) {
            c->paused = false;
            sh__stream_conn_events(c, UV_READABLE);
        }
    x->paused_conns = 0;
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
void sh__stream_conn_close(conn *c, sh_err code, const char *what, int err)
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
            sh__peers_link_state(x->rt, l->node, false);
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
        sh__peers_unbind(x->rt, c->id);
        if (c->paused)
            x->paused_conns--;
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
            sh__stream_conn_close(c, SH_ECLOSED, "handshake", r == 0 ? ECONNRESET : errno);
            return -1;
        }
        c->hs_got += (uint32_t)r;
    }
    uint8_t ok[HS_LEN];
    hs_make(ok, want);
    if (memcmp(c->hs, ok, HS_LEN) != 0) {
        if (!c->link)
            atomic_fetch_add_explicit(&c->x->rejected, 1, memory_order_relaxed);
        sh__stream_conn_close(c, SH_EPROTO, "handshake: the peer is not an SP pipeline0 socket", 0);
        return -1;
    }
    return 1;
}

/* A frame the runtime refused: when it is another protocol version's, that becomes the sender's
 * link's last error (runtime/transport.c's note_foreign does the same for NNG's transports). */
static void note_foreign(sh__stream *x, const uint8_t *frame, size_t len)
{
    char text[sizeof((sh_transport_link *)0)->last_error];
    uint32_t node = sh__msg_foreign_note(frame, len, text, sizeof text);
    sh__stream_link *l = node ? sh__stream_link_find(x, node) : NULL;
    if (l)
        sh__stream_link_note(l, SH_EPROTO, text);
}

/* Hands one received frame to the runtime. */
static void deliver(sh__stream *x, const conn *c, const uint8_t *frame, size_t len)
{
    atomic_fetch_add_explicit(&x->frames_recv, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->bytes_recv, len, memory_order_relaxed);
    sh_error e;
    sh_err err = sh__transport_deliver_conn(x->rt, c->id, frame, len, &e);
    if (err == SH_EPROTO)
        note_foreign(x, frame, len);
    if (err == SH_EFORMAT || err == SH_EPROTO)
        atomic_fetch_add_explicit(&x->rejected, 1, memory_order_relaxed);
}

static void deliver_big(sh__stream *x, conn *c)
{
    atomic_fetch_add_explicit(&x->frames_recv, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&x->bytes_recv, c->big_len, memory_order_relaxed);
    sh_error e;
    sh_err err =
        sh__transport_deliver_owned_conn(x->rt, c->id, c->big, c->big_len, &c->big_owner, &e);
    if (err == SH_EPROTO)
        note_foreign(x, c->big, c->big_len);
    if (err) { /* the runtime did not take it */
        c->big_owner.release(c->big_owner.ctx, c->big_owner.handle);
        if (err == SH_EFORMAT || err == SH_EPROTO)
            atomic_fetch_add_explicit(&x->rejected, 1, memory_order_relaxed);
    }
    c->big = NULL;
}

/* True while accepted connection c has proved no node and the peer gate is on (cached once it
 * has). */
static bool unproved(conn *c)
{
    if (c->proved)
        return false;
    if (!sh__peers_enforced(c->x->rt) || sh__peers_node(c->x->rt, c->id))
        c->proved = true;
    return !c->proved;
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
            sh__stream_conn_close(c, SH_EPROTO, NULL, 0);
            return false;
        }
        size_t have = c->rlen - c->rpos - H;
        if (len <= RBUF_LEN - H) {
            if (have < len)
                break;
            deliver(x, c, p + H, (size_t)len);
            c->rpos += H + (size_t)len;
            continue;
        }
        if (unproved(c)) {
            /* Over the HELLO budget before proving a node: no buffer is taken for it (and none
             * counts toward pause_bytes, which would stop every link); its head waits in rbuf
             * until the connection proves a node (a HELLO just delivered may still be on its way
             * to the hello actor) or its deadline closes it. */
            c->held = true;
            sh__stream_conn_events(c, 0);
            break;
        }
        uint8_t *b = sh__stream_buf_get(x, (size_t)len, true, &c->big_owner);
        if (!b) {
            sh__stream_conn_close(c, SH_ENOMEM, NULL, 0);
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
    if (c->held)
        return;
    if (!c->rbuf && !(c->rbuf = malloc(RBUF_LEN))) {
        sh__stream_conn_close(c, SH_ENOMEM, NULL, 0);
        return;
    }
    size_t budget = READ_BUDGET;
    uint64_t frames0 = atomic_load_explicit(&c->x->frames_recv, memory_order_relaxed);
    while (budget > 0 && atomic_load_explicit(&c->x->frames_recv, memory_order_relaxed) - frames0 <
                             FRAME_BUDGET) {
        if (!c->big && sh__stream_conn_full(c->x)) {
            /* Receive back-pressure: the runtime is not keeping up. Leave the bytes in the
             * kernel, whose buffers fill, then the sender's queue, whose sends then fail with
             * SH_EBUSY. A frame already being read is finished first (its buffer is held). */
            c->paused = true;
            c->x->paused_conns++;
            sh__stream_conn_events(c, 0);
            sh__stream_service(c->x); /* arms the tick that resumes */
            return;
        }
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
            sh__stream_conn_close(c, SH_ECLOSED, NULL, 0);
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
            if (c->held) {
                sh__stream_service(c->x); /* arms the tick that looks at it again */
                return;
            }
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
        sh__peers_link_state(c->x->rt, l->node, true);
        l->want_write = l->n > 0;
        bool want = l->want_write;
        uv_mutex_unlock(&l->mu);
        l->backoff = c->x->o.rc_min;
        sh__stream_conn_events(c, want ? UV_READABLE | UV_WRITABLE : UV_READABLE);
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
        sh__stream_conn_close(c, SH_ECLOSED, "connection closed by the peer",
                              r == 0 ? ECONNRESET : errno);
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
            sh__stream_conn_close(c, SH_ECLOSED, "connect", err);
            return;
        }
        c->state = C_HS;
        sh__stream_conn_events(c, UV_READABLE);
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
        sh__stream_conn_close(c, SH_ECLOSED, "write", err);
    else
        sh__stream_conn_events(c, more ? UV_READABLE | UV_WRITABLE : UV_READABLE);
}

static void conn_io(uv_poll_t *h, int status, int events)
{
    conn *c = h->data;
    if (status < 0) {
        // libuv reports POLLERR as EBADF; the socket's own error says what happened (a refused
        // or unreachable connect, a reset).
        int err = -status, so = 0;
        socklen_t sl = sizeof so;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &so, &sl) == 0 && so)
            err = so;
        const char *what = !c->link ? NULL : c->state == C_CONNECTING ? "connect" : "poll";
        sh__stream_conn_close(c, err == -status ? SH_EIO : SH_ECLOSED, what, err);
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

/* Connects link l to the address in l->ep (loop thread, l->c == NULL). */
static void dial_connect(sh__stream_link *l)
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
    sh__stream_conn_events(c, UV_WRITABLE);
}

/* A named host's lookup finished (loop thread): connect to its first address, or note the
 * failure and redial after the backoff. After io_stop (cancelled, or finished meanwhile) it
 * only counts the lookup closed. */
static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    sh__stream_link *l = req->data;
    sh__stream *x = l->x;
    l->resolving = false;
    bool stopping = !atomic_load_explicit(&x->ready, memory_order_acquire);
    if (!stopping && status == 0 && res && res->ai_addrlen <= sizeof l->ep.sa) {
        memcpy(&l->ep.sa, res->ai_addr, res->ai_addrlen);
        l->ep.sa_len = res->ai_addrlen;
    } else if (!stopping && status == 0) {
        status = UV_EAI_NONAME;
    }
    uv_freeaddrinfo(res);
    sh__stream_conn_handle_closed(x); /* the lookup was one of the open handles */
    if (stopping)
        return;
    uv_mutex_lock(&l->mu);
    bool closed = l->closed;
    if (status != 0) {
        l->info.last_err = SH_ENOTFOUND;
        snprintf(l->info.last_error, sizeof l->info.last_error, "host %.100s did not resolve (%s)",
                 l->ep.host, uv_strerror(status));
    }
    uv_mutex_unlock(&l->mu);
    if (status != 0) {
        l->redial_at = mono_ms() + l->backoff;
        l->backoff = l->backoff * 2 > x->o.rc_max ? x->o.rc_max : l->backoff * 2;
    } else if (!closed) {
        dial_connect(l);
    }
    sh__stream_service(x); /* re-arms the tick for the redial */
}

void sh__stream_conn_dial(sh__stream_link *l)
{
    if (!l->ep.named) {
        dial_connect(l);
        return;
    }
    sh__stream *x = l->x;
    struct addrinfo hints = {
        .ai_family = l->ep.family, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    l->gai.data = l;
    int rc = uv_getaddrinfo(x->loop, &l->gai, on_resolved, l->ep.host, l->ep.port, &hints);
    if (rc == 0) {
        l->resolving = true;
        x->open_handles++;
        return;
    }
    uv_mutex_lock(&l->mu);
    l->info.last_err = SH_ENOTFOUND;
    snprintf(l->info.last_error, sizeof l->info.last_error, "host %.100s: lookup not started (%s)",
             l->ep.host, uv_strerror(rc));
    uv_mutex_unlock(&l->mu);
    l->redial_at = mono_ms() + l->backoff;
    l->backoff = l->backoff * 2 > x->o.rc_max ? x->o.rc_max : l->backoff * 2;
}

/* Makes room for one more connection that has not proved a node: at the cap, the oldest such
 * connection is closed (so that a flood of idle connections cannot keep new peers out). */
static void preauth_cap(sh__stream *x)
{
    uint32_t n = 0;
    conn *oldest = NULL;
    for (conn *c = x->accepted; c; c = c->next)
        if (!c->closing && unproved(c)) {
            n++;
            if (!oldest || c->born_ms <= oldest->born_ms)
                oldest = c;
        }
    if (n >= PREAUTH_MAX_CONNS && oldest) {
        sh__peers_refuse(x->rt, SH__PEERS_PREAUTH_CAP, 0, "connection");
        sh__stream_conn_close(oldest, SH_EBUSY, NULL, 0);
    }
}

uint64_t sh__stream_conn_preauth(sh__stream *x, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    conn *c = x->accepted;
    while (c) {
        conn *nx = c->next; /* c may leave the list */
        if (c->closing || !unproved(c)) {
            if (c->held && !c->closing) { /* proved since: read its large frame now */
                c->held = false;
                if (parse(c) && !c->held)
                    sh__stream_conn_events(c, c->paused ? 0 : UV_READABLE);
            }
            c = nx;
            continue;
        }
        uint64_t due = c->born_ms + PREAUTH_DEADLINE_MS;
        if (now >= due) {
            sh__peers_refuse(x->rt, c->held ? SH__PEERS_PREAUTH_FRAME : SH__PEERS_PREAUTH_SLOW, 0,
                             "connection");
            sh__stream_conn_close(c, SH_ETIMEDOUT, NULL, 0);
        } else {
            if (c->held && now + PREAUTH_HOLD_TICK_MS < due)
                due = now + PREAUTH_HOLD_TICK_MS;
            if (due < next)
                next = due;
        }
        c = nx;
    }
    return next;
}

/* Accepts every pending connection on the listener. */
void sh__stream_conn_on_listen(uv_poll_t *h, int status, int events)
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
                sh__stream_service(x);
            } else if (sh__peers_enforced(x->rt)) {
                sh__stream_service(x); /* arms the tick for the new connections' deadlines */
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
        c->id = atomic_fetch_add(&next_conn_id, 1) + 1;
        c->born_ms = mono_ms();
        preauth_cap(x);
        c->next = x->accepted;
        if (x->accepted)
            x->accepted->prev = c;
        x->accepted = c;
        sh__stream_conn_events(c, UV_READABLE);
    }
}
