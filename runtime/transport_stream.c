/* The stream engine: links, sending, the loop's actor and setup (connections are in
 * transport_stream_conn.c). */
#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/error.h"
#include "runtime/actor_uv.h"
#include "runtime/transport_driver.h"
#include "runtime/transport_stream_int.h"

/* ---- Buffers ---------------------------------------------------------------------------- */

static size_t rawbuf_cap(void *h) { return ((rawbuf *)h)->cap; }
static void rawbuf_free(void *h) { free(h); }
static const sh__bufpool_ops rawbuf_ops = {.cap = rawbuf_cap, .free = rawbuf_free};

uint8_t *sh__stream_buf_get(sh__stream *x, size_t cap, bool counted, sh_frame_owner *owner)
{
    rawbuf *b = sh__bufpool_take(x->pool, cap);
    if (!b) {
        /* Untouched pages of a fresh allocation cost nothing, so a peer that announces a large
         * frame and sends little of it holds only what it sent. */
        if (cap > SIZE_MAX - sizeof *b || !(b = malloc(sizeof *b + cap)))
            return NULL;
        b->cap = cap;
    }
    *owner = counted ? sh__bufpool_owner_counted(x->pool, b) : sh__bufpool_owner(x->pool, b);
    return b->data;
}

uint8_t *sh__stream_frame_alloc(sh__stream *x, size_t cap, sh_frame_owner *owner)
{
    return sh__stream_buf_get(x, cap, false, owner);
}

/* ---- Sending ---------------------------------------------------------------------------- */

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

/* ---- The engine's handles ---------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h) { sh__stream_conn_handle_closed(h->data); }

/* The stop member found nothing to close. */
static void handle_closed_none(sh__stream *x)
{
    x->open_handles = 1;
    sh__stream_conn_handle_closed(x);
}

static void on_tick(uv_timer_t *h);

void sh__stream_service(sh__stream *x)
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
                sh__stream_conn_close(l->c, SH_OK, NULL, 0);
            continue;
        }
        if (!l->c && !l->resolving && now >= l->redial_at)
            sh__stream_conn_dial(l);
        if (l->c && want)
            sh__stream_conn_events(l->c, UV_READABLE | UV_WRITABLE);
        if (!l->c && !l->resolving && l->redial_at < next)
            next = l->redial_at;
        if (n > 0 && now + EXPIRE_TICK_MS < next)
            next = now + EXPIRE_TICK_MS;
    }
    if (x->paused_conns > 0) {
        if (!sh__stream_conn_full(x))
            sh__stream_conn_resume(x);
        else if (now + PAUSE_TICK_MS < next)
            next = now + PAUSE_TICK_MS;
    }
    uint64_t pre = sh__stream_conn_preauth(x, now);
    if (pre < next)
        next = pre;
    if (x->accept_resume && now >= x->accept_resume) {
        x->accept_resume = 0;
        uv_poll_start(&x->lpoll, UV_READABLE, sh__stream_conn_on_listen);
    }
    if (x->accept_resume && x->accept_resume < next)
        next = x->accept_resume;
    if (next == UINT64_MAX)
        uv_timer_stop(&x->tick);
    else
        uv_timer_start(&x->tick, on_tick, next > now ? next - now : 1, 0);
}

static void on_tick(uv_timer_t *h) { sh__stream_service(h->data); }
static void on_kick(uv_async_t *h) { sh__stream_service(h->data); }

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
            rc = uv_poll_start(&x->lpoll, UV_READABLE, sh__stream_conn_on_listen);
        }
    }
    uv_mutex_lock(&x->mu);
    x->io_failed = rc != 0;
    x->io_state = IO_RUNNING;
    uv_cond_broadcast(&x->cv);
    uv_mutex_unlock(&x->mu);
    if (rc == 0) {
        atomic_store_explicit(&x->ready, 1, memory_order_release);
        sh__stream_service(x);
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
        sh__stream_conn_close(x->accepted, SH_OK, NULL, 0);
    uv_mutex_lock(&x->mu);
    sh__stream_link *first = x->links;
    uv_mutex_unlock(&x->mu);
    for (sh__stream_link *l = first; l; l = l->next) {
        if (l->c)
            sh__stream_conn_close(l->c, SH_ECLOSED, "transport closed", 0);
        if (l->resolving) /* its callback comes (cancelled or not) and counts it closed */
            uv_cancel((uv_req_t *)&l->gai);
    }
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
    sh_err err = sh__endpoint_parse_dial(url, &ep, e);
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

void sh__stream_link_note(sh__stream_link *l, sh_err code, const char *text)
{
    uv_mutex_lock(&l->mu);
    l->info.last_err = code;
    snprintf(l->info.last_error, sizeof l->info.last_error, "%s", text);
    uv_mutex_unlock(&l->mu);
}

sh__stream_link *sh__stream_link_find(sh__stream *x, uint32_t node)
{
    sh__stream_link *found = NULL;
    uv_mutex_lock(&x->mu);
    for (sh__stream_link *l = x->links; l; l = l->next) {
        if (l->node != node)
            continue;
        uv_mutex_lock(&l->mu);
        bool open = !l->closed;
        uv_mutex_unlock(&l->mu);
        if (open)
            found = l; /* prepended: the last open match is the first added */
    }
    uv_mutex_unlock(&x->mu);
    return found;
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

/* ---- The link driver (runtime/transport_driver.h) --------------------------------------- */

static bool drv_handles(const char *url) { return sh__endpoint_handles(url); }

static sh_err drv_create(sh_runtime *rt, const sh__transport_driver_opts *o, void **ctx,
                         sh_error *e)
{
    sh__stream_opts so = {.listen_url = o->listen_url,
                          .q_msgs = o->q_msgs,
                          .q_bytes = o->q_bytes,
                          .max_frame = o->max_frame,
                          .rc_min = o->rc_min,
                          .rc_max = o->rc_max,
                          .send_to = o->send_to,
                          .loop = o->loop,
                          .recycle_max_bytes = o->recycle_max_bytes,
                          .pause_msgs = o->pause_msgs,
                          .pause_bytes = o->pause_bytes};
    sh__stream *x = NULL;
    sh_err err = sh__stream_create(rt, &so, &x, e);
    if (!err)
        *ctx = x;
    return err;
}

static const char *drv_listen_url(void *ctx) { return sh__stream_listen_url(ctx); }

static sh_err drv_link_add(void *ctx, uint32_t node, const char *url, void **link, sh_error *e)
{
    sh__stream_link *l = NULL;
    sh_err err = sh__stream_link_add(ctx, node, url, &l, e);
    if (!err)
        *link = l;
    return err;
}

static sh_err drv_send(void *ctx, void *link, uint8_t *frame, size_t len,
                       const sh_frame_owner *owner, sh_error *e)
{
    (void)ctx;
    return sh__stream_link_send(link, frame, len, owner, e);
}

static uint8_t *drv_frame_alloc(void *ctx, size_t cap, sh_frame_owner *owner)
{
    return sh__stream_frame_alloc(ctx, cap, owner);
}

static void drv_link_note(void *ctx, void *link, sh_err code, const char *text)
{
    (void)ctx;
    sh__stream_link_note(link, code, text);
}

static void drv_link_snapshot(void *ctx, void *link, sh_transport_link *out)
{
    (void)ctx;
    sh__stream_link_snapshot(link, out);
}

static void drv_link_close(void *ctx, void *link)
{
    (void)ctx;
    sh__stream_link_close(link);
}

static void drv_stats_add(void *ctx, sh_transport_stats *st) { sh__stream_stats_add(ctx, st); }
static void drv_close(void *ctx) { sh__stream_close(ctx); }
static void drv_destroy(void *ctx) { sh__stream_destroy(ctx); }

/* Links live in the engine until sh__stream_destroy (no link_free). */
const sh__transport_driver sh__stream_driver = {
    .name = "stream",
    .handles = drv_handles,
    .create = drv_create,
    .listen_url = drv_listen_url,
    .link_add = drv_link_add,
    .send = drv_send,
    .frame_alloc = drv_frame_alloc,
    .link_note = drv_link_note,
    .link_snapshot = drv_link_snapshot,
    .link_close = drv_link_close,
    .stats_add = drv_stats_add,
    .close = drv_close,
    .destroy = drv_destroy,
};
