/* The transport: NNG (inproc://, tls+tcp://, or anything with use_nng) and the stream engine
 * (ipc://, tcp://) behind one link table, with bounded queues. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nng/nng.h>

#include <nng/protocol/pipeline0/pull.h>
#include <nng/protocol/pipeline0/push.h>
#include <uv.h>

#include "base/error.h"
#include "runtime/bufpool.h"
#include "runtime/mailbox.h"
#include "runtime/msg.h"
#include "runtime/peers.h"
#include "runtime/transport.h"
#include "runtime/transport_endpoint.h"
#include "runtime/transport_stream.h"

/* One peer link. The ring holds frames waiting for the aio; the aio carries at most one more
 * (`sending`). Everything below `mu` is protected by it; the struct lives until the transport
 * is destroyed (a removed peer is retired, not freed) so senders may keep the pointer. */
typedef struct peer {
    sh_transport *tp;
    uint32_t node;
    char url[256];
    sh__stream_link *stream; /* an ipc:// or tcp:// link of the stream engine: the fields
                              * below are unused */
    nng_socket sock;
    nng_aio *aio;
    bool sock_open;
    uv_mutex_t mu;
    nng_msg **ring; /* (cap) */
    uint32_t cap, head, nwait;
    bool sending;
    bool closed;
    size_t inflight_len;
    uint64_t bytes; /* waiting + in flight */
    int pipes;
    sh_transport_link info; /* state, errors, counters; queue fields filled on snapshot */
} peer;

/* Large nng_msgs kept for reuse (runtime/bufpool.h). A received frame's buffer, once the
 * runtime frees it, is kept and handed out for the next large outgoing frame, so a node that
 * relays activations neither allocates nor zeroes (NNG zeroes every new message) per frame. */
#define POOL_MSGS 16u

struct sh_transport {
    sh_runtime *rt;
    sh__bufpool *pool;  /* of nng_msgs */
    sh__stream *stream; /* the ipc:// and tcp:// engine (NULL with use_nng) */
    bool use_nng;
    uint32_t self;
    uint32_t q_msgs;
    uint64_t q_bytes;
    size_t max_frame;
    uint32_t rc_min, rc_max, send_to;
    nng_tls_config *tls_server, *tls_client;
    char listen_url[256];
    nng_socket lsock;
    nng_listener listener;
    bool listening;
    nng_aio *raio;
    uv_mutex_t mu; /* the peer table */
    peer **peers;  /* (n_peers) live links in add order */
    size_t n_peers, cap_peers;
    peer **retired; /* (n_retired) removed links, freed at destroy */
    size_t n_retired, cap_retired;
    _Atomic int closed;
    _Atomic int busy_senders; /* threads inside send_frame; close waits for zero */
    _Atomic uint64_t frames_sent, bytes_sent, frames_recv, bytes_recv, rejected, busy, expired;
    sh_transport_hooks hooks;
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Records a failure on the link (caller holds p->mu). */
static void link_fail(peer *p, int rv)
{
    p->info.last_err = sh__transport_map(rv);
    snprintf(p->info.last_error, sizeof p->info.last_error, "%s", nng_strerror(rv));
}

/* ---- Buffer pool ------------------------------------------------------------------------ */

static size_t nngmsg_cap(void *h) { return nng_msg_capacity(h); }
static void nngmsg_free(void *h) { nng_msg_free(h); }
static const sh__bufpool_ops nngmsg_ops = {.cap = nngmsg_cap, .free = nngmsg_free};

/* A message with a body of len bytes: the smallest kept buffer that fits (no allocation, no
 * zeroing) or a new one. NULL when out of memory. */
static nng_msg *pool_get(sh__bufpool *pl, size_t len)
{
    nng_msg *m = sh__bufpool_take(pl, len);
    if (m) {
        nng_msg_clear(m);
        nng_msg_header_clear(m);
        if (nng_msg_realloc(m, len) == 0) /* fits the capacity: only the length changes */
            return m;
        nng_msg_free(m);
    }
    return nng_msg_alloc(&m, len) == 0 ? m : NULL;
}

/* ---- Sending ---------------------------------------------------------------------------- */

static void kick(peer *p, nng_msg *m)
{
    nng_aio_set_msg(p->aio, m);
    nng_aio_set_timeout(p->aio, (nng_duration)p->tp->send_to);
    nng_send_aio(p->sock, p->aio);
}

/* Pops the next waiting frame into flight (caller holds p->mu); NULL when none. */
static nng_msg *next_locked(peer *p)
{
    if (p->nwait == 0 || p->closed) {
        p->sending = false;
        p->inflight_len = 0;
        return NULL;
    }
    nng_msg *m = p->ring[p->head];
    p->head = (p->head + 1) % p->cap;
    p->nwait--;
    p->sending = true;
    p->inflight_len = nng_msg_len(m);
    return m;
}

/* NNG completion of one send, on an NNG thread. A failed frame (timeout: no connection took it
 * in time) is dropped; the requester's deadline answers it. */
static void send_cb(void *arg)
{
    peer *p = arg;
    sh_transport *tp = p->tp;
    int rv = nng_aio_result(p->aio);
    if (rv) {
        nng_msg *m = nng_aio_get_msg(p->aio);
        nng_aio_set_msg(p->aio, NULL);
        nng_msg_free(m);
    }
    uv_mutex_lock(&p->mu);
    p->bytes -= p->inflight_len;
    if (rv == 0) {
        p->info.sent++;
        p->info.last_activity_ms = mono_ms();
        atomic_fetch_add_explicit(&tp->frames_sent, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&tp->bytes_sent, p->inflight_len, memory_order_relaxed);
    } else {
        p->info.expired++;
        atomic_fetch_add_explicit(&tp->expired, 1, memory_order_relaxed);
        link_fail(p, rv);
    }
    nng_msg *next = next_locked(p);
    uv_mutex_unlock(&p->mu);
    if (next)
        kick(p, next);
}

static peer *find_locked(sh_transport *tp, uint32_t node)
{
    for (size_t i = 0; i < tp->n_peers; i++)
        if (tp->peers[i]->node == node)
            return tp->peers[i];
    return NULL;
}

/* The live link of `node`. Links are never freed before the transport, so the pointer stays
 * valid after the table lock is dropped. Returns SH_ECLOSED or SH_ENOTFOUND. */
static sh_err peer_find(sh_transport *tp, uint32_t node, peer **out, sh_error *e)
{
    if (atomic_load(&tp->closed))
        return sh__error_set(e, SH_ECLOSED, "transport: closed (send to node %u)", (unsigned)node);
    uv_mutex_lock(&tp->mu);
    peer *p = find_locked(tp, node);
    uv_mutex_unlock(&tp->mu);
    if (!p)
        return sh__error_set(e, SH_ENOTFOUND, "transport: no peer for node %u", (unsigned)node);
    *out = p;
    return SH_OK;
}

/* Queues m (len bytes) on NNG link p, or refuses. On SH_OK m belongs to the link; on an error
 * the caller keeps it. */
static sh_err enqueue(sh_transport *tp, peer *p, nng_msg *m, size_t len, sh_error *e)
{
    sh_err err = SH_OK;
    uv_mutex_lock(&p->mu);
    uint32_t depth = p->nwait + (p->sending ? 1u : 0u);
    if (p->closed) {
        err = sh__error_set(e, SH_ECLOSED, "transport: link to node %u closed", (unsigned)p->node);
    } else if (depth >= tp->q_msgs || (depth > 0 && p->bytes + len > tp->q_bytes)) {
        p->info.busy++;
        atomic_fetch_add_explicit(&tp->busy, 1, memory_order_relaxed);
        err = sh__error_set(e, SH_EBUSY,
                            "transport: link to node %u is full (%u frames, %llu bytes queued)",
                            (unsigned)p->node, (unsigned)depth, (unsigned long long)p->bytes);
    }
    if (err) {
        uv_mutex_unlock(&p->mu);
        return err;
    }
    p->ring[(p->head + p->nwait) % p->cap] = m;
    p->nwait++;
    p->bytes += len;
    nng_msg *first = p->sending ? NULL : next_locked(p);
    uv_mutex_unlock(&p->mu);
    if (first)
        kick(p, first);
    return SH_OK;
}

static sh_err check_len(sh_transport *tp, size_t len, sh_error *e)
{
    if (len > tp->max_frame)
        return sh__error_set(e, SH_ERANGE, "transport: frame of %zu bytes exceeds max_frame %zu",
                             len, tp->max_frame);
    return SH_OK;
}

/* Copies frame into a new nng_msg and queues it on NNG link p. */
static sh_err send_copy(sh_transport *tp, peer *p, const uint8_t *frame, size_t len, sh_error *e)
{
    nng_msg *m = pool_get(tp->pool, len);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for a %zu-byte frame", len);
    memcpy(nng_msg_body(m), frame, len);
    sh_err err = enqueue(tp, p, m, len, e);
    if (err)
        nng_msg_free(m);
    return err;
}

/* Sends on link p: a stream engine link writes the frame itself (taking any owner's buffer); an NNG
 * link sends one of its own nng_msgs as it is and copies anything else. */
static sh_err send_on(sh_transport *tp, peer *p, uint8_t *frame, size_t len,
                      const sh_frame_owner *owner, sh_error *e)
{
    if (p->stream)
        return sh__stream_link_send(p->stream, frame, len, owner, e);
    nng_msg *m = owner && sh__bufpool_owns(tp->pool, owner) ? owner->handle : NULL;
    if (m && frame == nng_msg_body(m) && len <= nng_msg_len(m)) {
        size_t was = nng_msg_len(m);
        (void)nng_msg_realloc(m, len); /* shrinking only sets the length */
        sh_err err = enqueue(tp, p, m, len, e);
        if (err)
            (void)nng_msg_realloc(m, was);
        else
            sh__bufpool_unref(tp->pool); /* the owner's reference; NNG frees m once written */
        return err;
    }
    sh_err err = send_copy(tp, p, frame, len, e);
    if (!err && owner)
        owner->release(owner->ctx, owner->handle);
    return err;
}

/* The runtime's send_frame hook: the frame is borrowed for the call. */
static sh_err tp_send(void *ctx, uint32_t node, const uint8_t *frame, size_t len, sh_error *e)
{
    sh_transport *tp = ctx;
    atomic_fetch_add(&tp->busy_senders, 1);
    peer *p = NULL;
    sh_err err = check_len(tp, len, e);
    if (!err)
        err = peer_find(tp, node, &p, e);
    if (!err)
        err = send_on(tp, p, (uint8_t *)frame, len, NULL, e);
    atomic_fetch_sub(&tp->busy_senders, 1);
    return err;
}

/* The send_owned hook: the buffer moves to the link on SH_OK. */
static sh_err tp_send_owned(void *ctx, uint32_t node, uint8_t *frame, size_t len,
                            const sh_frame_owner *owner, sh_error *e)
{
    sh_transport *tp = ctx;
    atomic_fetch_add(&tp->busy_senders, 1);
    peer *p = NULL;
    sh_err err = check_len(tp, len, e);
    if (!err)
        err = peer_find(tp, node, &p, e);
    if (!err)
        err = send_on(tp, p, frame, len, owner, e);
    atomic_fetch_sub(&tp->busy_senders, 1);
    return err;
}

/* The frame_alloc hook: a recycled or new buffer that node's link sends without copying. */
static uint8_t *tp_frame_alloc(void *ctx, uint32_t node, size_t cap, sh_frame_owner *owner)
{
    sh_transport *tp = ctx;
    if (cap > tp->max_frame || atomic_load(&tp->closed))
        return NULL;
    peer *p = NULL;
    if (peer_find(tp, node, &p, NULL) == SH_OK && p->stream)
        return sh__stream_frame_alloc(tp->stream, cap, owner);
    nng_msg *m = pool_get(tp->pool, cap);
    if (!m)
        return NULL;
    *owner = sh__bufpool_owner(tp->pool, m);
    return nng_msg_body(m);
}

/* Link state from NNG pipe events, on an NNG thread. */
static void pipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    peer *p = arg;
    uv_mutex_lock(&p->mu);
    if (ev == NNG_PIPE_EV_ADD_POST) {
        if (p->pipes++ == 0) {
            p->info.state = SH_LINK_STATE_UP;
            p->info.ups++;
        }
        sh__peers_link_state(p->tp->rt, p->node, true); /* each new pipe greets again */
    } else if (ev == NNG_PIPE_EV_REM_POST && p->pipes > 0) {
        if (--p->pipes == 0) {
            p->info.state = SH_LINK_STATE_DOWN;
            sh__peers_link_state(p->tp->rt, p->node, false);
        }
    }
    p->info.last_activity_ms = mono_ms();
    uv_mutex_unlock(&p->mu);
}

/* ---- Receiving -------------------------------------------------------------------------- */

/* The peer gate's id of a received pipe: NNG's pipe id with the top bit set, apart from the stream
 * engine's connection ids. */
static uint64_t pipe_conn(nng_pipe pipe) { return (1ull << 63) | (uint64_t)nng_pipe_id(pipe); }

/* A pipe of the listening socket closed: what it proved goes with it. */
static void lpipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    sh_transport *tp = arg;
    if (ev == NNG_PIPE_EV_REM_POST)
        sh__peers_unbind(tp->rt, pipe_conn(pipe));
}

/* A received frame the runtime refused: when it is another protocol version's, that becomes the
 * sender's link's last error, where the front's join and `shoal cluster status` read it (the
 * frame itself is dropped, so nothing else would tell). */
static void note_foreign(sh_transport *tp, const void *frame, size_t len)
{
    char text[sizeof((sh_transport_link *)0)->last_error];
    uint32_t node = sh__msg_foreign_note(frame, len, text, sizeof text);
    if (!node)
        return;
    uv_mutex_lock(&tp->mu);
    peer *p = find_locked(tp, node);
    if (p && p->stream) {
        sh__stream_link_note(p->stream, SH_EPROTO, text);
    } else if (p) {
        uv_mutex_lock(&p->mu);
        p->info.last_err = SH_EPROTO;
        snprintf(p->info.last_error, sizeof p->info.last_error, "%s", text);
        uv_mutex_unlock(&p->mu);
    }
    uv_mutex_unlock(&tp->mu);
}

static void recv_cb(void *arg)
{
    sh_transport *tp = arg;
    int rv = nng_aio_result(tp->raio);
    if (rv == NNG_ECLOSED || rv == NNG_ECANCELED || atomic_load(&tp->closed))
        return;
    if (rv == 0) {
        nng_msg *m = nng_aio_get_msg(tp->raio);
        nng_aio_set_msg(tp->raio, NULL);
        size_t len = nng_msg_len(m);
        atomic_fetch_add_explicit(&tp->frames_recv, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&tp->bytes_recv, len, memory_order_relaxed);
        sh_error e;
        sh_err err;
        if (len <= SH__MAILBOX_SMALL_FRAME) {
            /* A small frame is copied into a pooled block and NNG's buffer freed here, on the
             * thread that allocated it: cheaper than a cross-thread free later. */
            err = sh__transport_deliver_conn(tp->rt, pipe_conn(nng_msg_get_pipe(m)),
                                             nng_msg_body(m), len, &e);
            if (err == SH_EPROTO)
                note_foreign(tp, nng_msg_body(m), len);
            nng_msg_free(m);
        } else {
            /* Zero-copy: the runtime decodes the frame in the nng_msg and frees it through the
             * pool when the message is done. */
            sh_frame_owner owner = sh__bufpool_owner(tp->pool, m);
            err = sh__transport_deliver_owned_conn(tp->rt, pipe_conn(nng_msg_get_pipe(m)),
                                                   nng_msg_body(m), len, &owner, &e);
            if (err == SH_EPROTO)
                note_foreign(tp, nng_msg_body(m), len);
            if (err) /* the runtime did not take it */
                owner.release(owner.ctx, owner.handle);
        }
        if (err == SH_EFORMAT || err == SH_EPROTO)
            atomic_fetch_add_explicit(&tp->rejected, 1, memory_order_relaxed);
    }
    nng_recv_aio(tp->lsock, tp->raio);
}

/* ---- Setup ------------------------------------------------------------------------------ */

/* Sets the TLS configuration on a dialer or listener of a tls+tcp:// URL. */
static sh_err need_tls(sh_transport *tp, const char *url, sh_error *e)
{
    if (sh__transport_is_tls(url) && !tp->tls_server)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "transport: %s needs TLS certificates (sh_transport_opts.tls)", url);
    return SH_OK;
}

static sh_err listen_start(sh_transport *tp, const char *url, sh_error *e)
{
    sh_err err = need_tls(tp, url, e);
    if (err)
        return err;
    int rv = nng_pull0_open(&tp->lsock);
    if (rv)
        return sh__transport_nng_error(e, rv, "open pull socket for", url);
    /* A peer cannot make us allocate more than max_frame for one message. */
    if ((rv = nng_socket_set_size(tp->lsock, NNG_OPT_RECVMAXSZ, tp->max_frame)) == 0 &&
        (rv = nng_pipe_notify(tp->lsock, NNG_PIPE_EV_REM_POST, lpipe_cb, tp)) == 0 &&
        (rv = nng_listener_create(&tp->listener, tp->lsock, url)) == 0 &&
        (!sh__transport_is_tls(url) ||
         (rv = nng_listener_set_ptr(tp->listener, NNG_OPT_TLS_CONFIG, tp->tls_server)) == 0) &&
        (rv = nng_listener_start(tp->listener, 0)) == 0 &&
        (rv = nng_aio_alloc(&tp->raio, recv_cb, tp)) == 0) {
        tp->listening = true;
        snprintf(tp->listen_url, sizeof tp->listen_url, "%s", url);
        int port = 0;
        const char *colon = strrchr(url, ':');
        if (strstr(url, "tcp") && colon &&
            nng_listener_get_int(tp->listener, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
            snprintf(tp->listen_url, sizeof tp->listen_url, "%.*s:%d", (int)(colon - url), url,
                     port);
        nng_recv_aio(tp->lsock, tp->raio);
        return SH_OK;
    }
    nng_close(tp->lsock);
    return sh__transport_nng_error(e, rv, "listen on", url);
}

sh_err sh_transport_create(sh_runtime *rt, const sh_transport_opts *opts, sh_transport **out,
                           sh_error *e)
{
    if (!rt || !opts || !out)
        return sh__error_set(e, SH_EINVAL, "transport: NULL argument");
    sh_transport *tp = calloc(1, sizeof *tp);
    if (!tp)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    tp->rt = rt;
    tp->self = sh_runtime_node(rt);
    tp->q_msgs = opts->queue_max_msgs ? opts->queue_max_msgs : 1024;
    tp->q_bytes = opts->queue_max_bytes ? opts->queue_max_bytes : (uint64_t)256 << 20;
    tp->max_frame = opts->max_frame ? opts->max_frame : SH_MSG_MAX_FRAME_DEFAULT;
    tp->rc_min = opts->reconnect_min_ms ? opts->reconnect_min_ms : 10;
    tp->rc_max = opts->reconnect_max_ms ? opts->reconnect_max_ms : 1000;
    tp->send_to = opts->send_timeout_ms ? opts->send_timeout_ms : 10000;
    if (tp->rc_max < tp->rc_min)
        tp->rc_max = tp->rc_min;
    tp->use_nng = opts->use_nng != 0;
    uv_mutex_init(&tp->mu);
    sh_err err = SH_OK;
    uint64_t keep = opts->recycle_max_bytes ? opts->recycle_max_bytes : (uint64_t)64 << 20;
    bool off = keep == SH_TRANSPORT_RECYCLE_OFF;
    if (!(tp->pool = sh__bufpool_create(&nngmsg_ops, off ? 0 : POOL_MSGS, keep))) {
        uv_mutex_destroy(&tp->mu);
        free(tp);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    }
    if (opts->tls)
        err = sh__transport_tls_configs(opts->tls, &tp->tls_server, &tp->tls_client, e);
    bool stream_listen = !tp->use_nng && sh__endpoint_handles(opts->listen_url);
    if (!err && !tp->use_nng) {
        sh__stream_opts io = {.listen_url = stream_listen ? opts->listen_url : NULL,
                              .q_msgs = tp->q_msgs,
                              .q_bytes = tp->q_bytes,
                              .max_frame = tp->max_frame,
                              .rc_min = tp->rc_min,
                              .rc_max = tp->rc_max,
                              .send_to = tp->send_to,
                              .loop = opts->io_loop,
                              .pause_msgs = opts->recv_pause_msgs ? opts->recv_pause_msgs : 16384,
                              .pause_bytes = opts->recv_pause_bytes ? opts->recv_pause_bytes
                                                                    : (uint64_t)256 << 20,
                              .recycle_max_bytes = keep};
        err = sh__stream_create(rt, &io, &tp->stream, e);
        if (!err && stream_listen)
            snprintf(tp->listen_url, sizeof tp->listen_url, "%s",
                     sh__stream_listen_url(tp->stream));
    }
    if (!err && opts->listen_url && !stream_listen)
        err = listen_start(tp, opts->listen_url, e);
    tp->hooks = (sh_transport_hooks){.ctx = tp,
                                     .send_frame = tp_send,
                                     .send_owned = tp_send_owned,
                                     .frame_alloc = tp_frame_alloc};
    if (!err && sh_transport_set(rt, &tp->hooks) != SH_OK)
        err = sh__error_set(e, SH_ENOMEM, "transport: cannot install hooks");
    if (err) {
        if (tp->listening) {
            nng_close(tp->lsock);
            nng_aio_free(tp->raio);
        }
        if (tp->tls_server)
            nng_tls_config_free(tp->tls_server);
        if (tp->tls_client)
            nng_tls_config_free(tp->tls_client);
        sh__stream_destroy(tp->stream);
        sh__bufpool_unref(tp->pool);
        uv_mutex_destroy(&tp->mu);
        free(tp);
        return err;
    }
    *out = tp;
    return SH_OK;
}

sh_err sh_transport_listen_url(sh_transport *tp, char *buf, size_t cap)
{
    if (!tp->listen_url[0])
        return SH_ENOTFOUND;
    int n = snprintf(buf, cap, "%s", tp->listen_url);
    return n < 0 || (size_t)n >= cap ? SH_ERANGE : SH_OK;
}

void sh_transport_hooks_get(sh_transport *tp, sh_transport_hooks *out) { *out = tp->hooks; }

static void peer_free(peer *p)
{
    for (uint32_t i = 0; i < p->nwait; i++)
        nng_msg_free(p->ring[(p->head + i) % p->cap]);
    free(p->ring);
    uv_mutex_destroy(&p->mu);
    free(p);
}

/* Stops a link's I/O: no new frame starts, the aio is cancelled and its callback waited for,
 * the socket closed, waiting frames dropped. */
static void peer_close(peer *p)
{
    if (p->stream) {
        sh__stream_link_close(p->stream);
        return;
    }
    uv_mutex_lock(&p->mu);
    p->closed = true;
    uv_mutex_unlock(&p->mu);
    if (p->aio)
        nng_aio_stop(p->aio);
    if (p->sock_open)
        nng_close(p->sock);
    p->sock_open = false;
    uv_mutex_lock(&p->mu);
    for (uint32_t i = 0; i < p->nwait; i++)
        nng_msg_free(p->ring[(p->head + i) % p->cap]);
    p->nwait = 0;
    p->bytes = 0;
    uv_mutex_unlock(&p->mu);
    if (p->aio) {
        nng_aio_free(p->aio);
        p->aio = NULL;
    }
}

static sh_err peer_open(sh_transport *tp, peer *p, sh_error *e)
{
    if (tp->stream && sh__endpoint_handles(p->url))
        return sh__stream_link_add(tp->stream, p->node, p->url, &p->stream, e);
    int rv = nng_push0_open(&p->sock);
    if (rv)
        return sh__transport_nng_error(e, rv, "open push socket for", p->url);
    p->sock_open = true;
    nng_dialer d;
    if ((rv = nng_aio_alloc(&p->aio, send_cb, p)) == 0 &&
        (rv = nng_pipe_notify(p->sock, NNG_PIPE_EV_ADD_POST, pipe_cb, p)) == 0 &&
        (rv = nng_pipe_notify(p->sock, NNG_PIPE_EV_REM_POST, pipe_cb, p)) == 0 &&
        (rv = nng_socket_set_ms(p->sock, NNG_OPT_RECONNMINT, (nng_duration)tp->rc_min)) == 0 &&
        (rv = nng_socket_set_ms(p->sock, NNG_OPT_RECONNMAXT, (nng_duration)tp->rc_max)) == 0 &&
        (rv = nng_dialer_create(&d, p->sock, p->url)) == 0 &&
        (!sh__transport_is_tls(p->url) ||
         (rv = nng_dialer_set_ptr(d, NNG_OPT_TLS_CONFIG, tp->tls_client)) == 0) &&
        (rv = nng_dialer_start(d, NNG_FLAG_NONBLOCK)) == 0)
        return SH_OK;
    return sh__transport_nng_error(e, rv, "dial", p->url);
}

sh_err sh_transport_peer_add(sh_transport *tp, uint32_t node, const char *url, sh_error *e)
{
    if (node == 0 || node == tp->self || !url || strlen(url) >= sizeof((peer *)0)->url)
        return sh__error_set(e, SH_EINVAL, "transport: bad peer (node %u, url %s)", (unsigned)node,
                             url ? url : "(null)");
    sh_err err = need_tls(tp, url, e);
    if (err)
        return err;
    if (atomic_load(&tp->closed))
        return sh__error_set(e, SH_ECLOSED, "transport: closed");
    peer *p = calloc(1, sizeof *p);
    nng_msg **ring = calloc(tp->q_msgs, sizeof *ring);
    if (!p || !ring) {
        free(p);
        free(ring);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for peer %u", (unsigned)node);
    }
    p->tp = tp;
    p->node = node;
    p->ring = ring;
    p->cap = tp->q_msgs;
    snprintf(p->url, sizeof p->url, "%s", url);
    p->info.node = node;
    snprintf(p->info.url, sizeof p->info.url, "%s", url);
    p->info.state = SH_LINK_STATE_CONNECTING;
    p->info.last_activity_ms = mono_ms();
    uv_mutex_init(&p->mu);
    uv_mutex_lock(&tp->mu);
    if (find_locked(tp, node)) {
        uv_mutex_unlock(&tp->mu);
        peer_free(p);
        return sh__error_set(e, SH_EBUSY, "transport: node %u already has a peer", (unsigned)node);
    }
    if (tp->n_peers == tp->cap_peers) {
        size_t cap = tp->cap_peers ? tp->cap_peers * 2 : 8;
        peer **np = realloc(tp->peers, cap * sizeof *np);
        if (!np) {
            uv_mutex_unlock(&tp->mu);
            peer_free(p);
            return sh__error_set(e, SH_ENOMEM, "transport: out of memory for the peer table");
        }
        tp->peers = np;
        tp->cap_peers = cap;
    }
    /* Opened under the table lock so that two adds of one node cannot both dial. Dialling is
     * non-blocking (NNG_FLAG_NONBLOCK), so the lock is held briefly. */
    if ((err = peer_open(tp, p, e)) != SH_OK) {
        uv_mutex_unlock(&tp->mu);
        peer_close(p);
        peer_free(p);
        return err;
    }
    tp->peers[tp->n_peers++] = p;
    uv_mutex_unlock(&tp->mu);
    return SH_OK;
}

sh_err sh_transport_peer_remove(sh_transport *tp, uint32_t node)
{
    uv_mutex_lock(&tp->mu);
    peer *p = NULL;
    for (size_t i = 0; i < tp->n_peers && !p; i++) {
        if (tp->peers[i]->node == node) {
            p = tp->peers[i];
            memmove(&tp->peers[i], &tp->peers[i + 1], (tp->n_peers - i - 1) * sizeof p);
            tp->n_peers--;
        }
    }
    if (p && tp->n_retired == tp->cap_retired) {
        size_t cap = tp->cap_retired ? tp->cap_retired * 2 : 4;
        peer **np = realloc(tp->retired, cap * sizeof *np);
        if (!np) { /* keep it live rather than lose track of it */
            tp->peers[tp->n_peers++] = p;
            uv_mutex_unlock(&tp->mu);
            return SH_ENOMEM;
        }
        tp->retired = np;
        tp->cap_retired = cap;
    }
    if (p)
        tp->retired[tp->n_retired++] = p;
    uv_mutex_unlock(&tp->mu);
    if (!p)
        return SH_ENOTFOUND;
    peer_close(p);
    return SH_OK;
}

static void snapshot(peer *p, sh_transport_link *out)
{
    if (p->stream) {
        sh__stream_link_snapshot(p->stream, out);
        return;
    }
    uv_mutex_lock(&p->mu);
    *out = p->info;
    out->queue_msgs = p->nwait + (p->sending ? 1u : 0u);
    out->queue_bytes = p->bytes;
    uv_mutex_unlock(&p->mu);
}

void sh_transport_links(sh_transport *tp, sh_transport_link *out, size_t cap, size_t *n)
{
    uv_mutex_lock(&tp->mu);
    for (size_t i = 0; i < tp->n_peers && i < cap; i++)
        snapshot(tp->peers[i], &out[i]);
    *n = tp->n_peers;
    uv_mutex_unlock(&tp->mu);
}

sh_err sh_transport_link_get(sh_transport *tp, uint32_t node, sh_transport_link *out)
{
    uv_mutex_lock(&tp->mu);
    peer *p = find_locked(tp, node);
    if (p)
        snapshot(p, out);
    uv_mutex_unlock(&tp->mu);
    return p ? SH_OK : SH_ENOTFOUND;
}

void sh_transport_stats_get(sh_transport *tp, sh_transport_stats *out)
{
    out->frames_sent = atomic_load(&tp->frames_sent);
    out->bytes_sent = atomic_load(&tp->bytes_sent);
    out->frames_recv = atomic_load(&tp->frames_recv);
    out->bytes_recv = atomic_load(&tp->bytes_recv);
    out->rejected = atomic_load(&tp->rejected);
    out->busy = atomic_load(&tp->busy);
    out->expired = atomic_load(&tp->expired);
    if (tp->stream)
        sh__stream_stats_add(tp->stream, out);
}

void sh_transport_close(sh_transport *tp)
{
    if (!tp || atomic_exchange(&tp->closed, 1))
        return;
    sh_transport_set(tp->rt, NULL);
    if (tp->listening) {
        nng_aio_stop(tp->raio); /* waits for a delivery in progress */
        nng_close(tp->lsock);
    }
    /* A sender that passed the hook lookup before the hooks went away finishes first. */
    while (atomic_load(&tp->busy_senders) > 0) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    uv_mutex_lock(&tp->mu);
    for (size_t i = 0; i < tp->n_peers; i++)
        peer_close(tp->peers[i]);
    uv_mutex_unlock(&tp->mu);
    /* The stream engine's loop closes its sockets (waited for: nothing reads after this). */
    sh__stream_close(tp->stream);
    /* Kept buffers go now; buffers still lent to the runtime are freed when it releases them. */
    sh__bufpool_close(tp->pool);
}

void sh_transport_destroy(sh_transport *tp)
{
    if (!tp)
        return;
    sh_transport_close(tp);
    for (size_t i = 0; i < tp->n_peers; i++)
        peer_free(tp->peers[i]);
    for (size_t i = 0; i < tp->n_retired; i++)
        peer_free(tp->retired[i]);
    free(tp->peers);
    free(tp->retired);
    if (tp->raio)
        nng_aio_free(tp->raio);
    if (tp->tls_server)
        nng_tls_config_free(tp->tls_server);
    if (tp->tls_client)
        nng_tls_config_free(tp->tls_client);
    sh__stream_destroy(tp->stream);
    sh__bufpool_unref(tp->pool);
    uv_mutex_destroy(&tp->mu);
    free(tp);
}
