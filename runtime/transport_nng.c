/* The NNG link driver: inproc://, tls+tcp:// (and every URL with use_nng) through NNG sockets. */
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
#include "runtime/transport_driver.h"

typedef struct tnng tnng;

/* One NNG link: a push socket dialling the peer. The ring holds frames waiting for the aio; the
 * aio carries at most one more (`sending`). Everything below `mu` is protected by it; the
 * struct lives until link_free (after the driver closed) so senders may keep the pointer. */
typedef struct nlink {
    tnng *d;
    uint32_t node;
    char url[256];
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
} nlink;

/* Large nng_msgs kept for reuse (runtime/bufpool.h). A received frame's buffer, once the
 * runtime frees it, is kept and handed out for the next large outgoing frame, so a node that
 * relays activations neither allocates nor zeroes (NNG zeroes every new message) per frame. */
#define POOL_MSGS 16u

/* Pipes of the listener that have not proved a node in HELLO (runtime/peers.h), while the peer
 * gate is on, get the stream engine's budgets (transport_stream_int.h) as far as NNG allows: each
 * must prove one within PREAUTH_DEADLINE_MS of being added, the listener holds at most
 * PREAUTH_MAX_PIPES of them (a new one closes the oldest), and a frame over PREAUTH_FRAME_MAX from
 * one is dropped before the runtime decodes it. NNG reads a message whole before handing it over
 * and its receive limit (NNG_OPT_RECVMAXSZ) is set per socket or listener, not per pipe, so such a
 * frame is still read (up to max_frame) before it is dropped. Not on inproc://, which only this
 * process can reach. */
#define PREAUTH_DEADLINE_MS 5000u
#define PREAUTH_MAX_PIPES 64u
#define PREAUTH_FRAME_MAX ((size_t)64 << 10)

/* A listener pipe that has not proved a node: its NNG id and when it was added. */
typedef struct unproved {
    uint32_t pipe;
    uint64_t born_ms;
} unproved;

struct tnng {
    sh_runtime *rt;
    sh__bufpool *pool; /* of nng_msgs */
    sh__transport_driver_opts o;
    nng_tls_config *tls_server, *tls_client;
    char listen_url[256];
    nng_socket lsock;
    nng_listener listener;
    bool listening;
    nng_aio *raio;
    bool preauth;   /* the listener applies the PREAUTH_* budgets (not inproc://) */
    uv_mutex_t pmu; /* pend, n_pend, ticking */
    unproved pend[PREAUTH_MAX_PIPES]; /* (n_pend) oldest first */
    uint32_t n_pend;
    bool ticking;  /* `tick` is armed for the oldest's deadline */
    nng_aio *tick; /* sleeps until the oldest unproved pipe's deadline */
    _Atomic int closed;
    _Atomic uint64_t frames_sent, bytes_sent, frames_recv, bytes_recv, rejected, busy, expired;
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Records a failure on the link (caller holds l->mu). */
static void link_fail(nlink *l, int rv)
{
    l->info.last_err = sh__transport_map(rv);
    snprintf(l->info.last_error, sizeof l->info.last_error, "%s", nng_strerror(rv));
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

static uint8_t *frame_alloc(void *ctx, size_t cap, sh_frame_owner *owner)
{
    tnng *d = ctx;
    nng_msg *m = pool_get(d->pool, cap);
    if (!m)
        return NULL;
    *owner = sh__bufpool_owner(d->pool, m);
    return nng_msg_body(m);
}

/* ---- Sending ---------------------------------------------------------------------------- */

static void kick(nlink *l, nng_msg *m)
{
    nng_aio_set_msg(l->aio, m);
    nng_aio_set_timeout(l->aio, (nng_duration)l->d->o.send_to);
    nng_send_aio(l->sock, l->aio);
}

/* Pops the next waiting frame into flight (caller holds l->mu); NULL when none. */
static nng_msg *next_locked(nlink *l)
{
    if (l->nwait == 0 || l->closed) {
        l->sending = false;
        l->inflight_len = 0;
        return NULL;
    }
    nng_msg *m = l->ring[l->head];
    l->head = (l->head + 1) % l->cap;
    l->nwait--;
    l->sending = true;
    l->inflight_len = nng_msg_len(m);
    return m;
}

/* NNG completion of one send, on an NNG thread. A failed frame (timeout: no connection took it
 * in time) is dropped; the requester's deadline answers it. */
static void send_cb(void *arg)
{
    nlink *l = arg;
    tnng *d = l->d;
    int rv = nng_aio_result(l->aio);
    if (rv) {
        nng_msg *m = nng_aio_get_msg(l->aio);
        nng_aio_set_msg(l->aio, NULL);
        nng_msg_free(m);
    }
    uv_mutex_lock(&l->mu);
    l->bytes -= l->inflight_len;
    if (rv == 0) {
        l->info.sent++;
        l->info.last_activity_ms = mono_ms();
        atomic_fetch_add_explicit(&d->frames_sent, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&d->bytes_sent, l->inflight_len, memory_order_relaxed);
    } else {
        l->info.expired++;
        atomic_fetch_add_explicit(&d->expired, 1, memory_order_relaxed);
        link_fail(l, rv);
    }
    nng_msg *next = next_locked(l);
    uv_mutex_unlock(&l->mu);
    if (next)
        kick(l, next);
}

/* Queues m (len bytes) on link l, or refuses. On SH_OK m belongs to the link; on an error the
 * caller keeps it. */
static sh_err enqueue(tnng *d, nlink *l, nng_msg *m, size_t len, sh_error *e)
{
    sh_err err = SH_OK;
    uv_mutex_lock(&l->mu);
    uint32_t depth = l->nwait + (l->sending ? 1u : 0u);
    if (l->closed) {
        err = sh__error_set(e, SH_ECLOSED, "transport: link to node %u closed", (unsigned)l->node);
    } else if (depth >= d->o.q_msgs || (depth > 0 && l->bytes + len > d->o.q_bytes)) {
        l->info.busy++;
        atomic_fetch_add_explicit(&d->busy, 1, memory_order_relaxed);
        err = sh__error_set(e, SH_EBUSY,
                            "transport: link to node %u is full (%u frames, %llu bytes queued)",
                            (unsigned)l->node, (unsigned)depth, (unsigned long long)l->bytes);
    }
    if (err) {
        uv_mutex_unlock(&l->mu);
        return err;
    }
    l->ring[(l->head + l->nwait) % l->cap] = m;
    l->nwait++;
    l->bytes += len;
    nng_msg *first = l->sending ? NULL : next_locked(l);
    uv_mutex_unlock(&l->mu);
    if (first)
        kick(l, first);
    return SH_OK;
}

/* Copies frame into a new nng_msg and queues it on link l. */
static sh_err send_copy(tnng *d, nlink *l, const uint8_t *frame, size_t len, sh_error *e)
{
    nng_msg *m = pool_get(d->pool, len);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for a %zu-byte frame", len);
    memcpy(nng_msg_body(m), frame, len);
    sh_err err = enqueue(d, l, m, len, e);
    if (err)
        nng_msg_free(m);
    return err;
}

/* Sends one of this driver's own nng_msgs as it is and copies anything else. */
static sh_err link_send(void *ctx, void *link, uint8_t *frame, size_t len,
                        const sh_frame_owner *owner, sh_error *e)
{
    tnng *d = ctx;
    nlink *l = link;
    nng_msg *m = owner && sh__bufpool_owns(d->pool, owner) ? owner->handle : NULL;
    if (m && frame == nng_msg_body(m) && len <= nng_msg_len(m)) {
        size_t was = nng_msg_len(m);
        (void)nng_msg_realloc(m, len); /* shrinking only sets the length */
        sh_err err = enqueue(d, l, m, len, e);
        if (err)
            (void)nng_msg_realloc(m, was);
        else
            sh__bufpool_unref(d->pool); /* the owner's reference; NNG frees m once written */
        return err;
    }
    sh_err err = send_copy(d, l, frame, len, e);
    if (!err && owner)
        owner->release(owner->ctx, owner->handle);
    return err;
}

/* Link state from NNG pipe events, on an NNG thread. */
static void pipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    (void)pipe;
    nlink *l = arg;
    uv_mutex_lock(&l->mu);
    if (ev == NNG_PIPE_EV_ADD_POST) {
        if (l->pipes++ == 0) {
            l->info.state = SH_LINK_STATE_UP;
            l->info.ups++;
        }
        sh__peers_link_state(l->d->rt, l->node, true); /* each new pipe greets again */
    } else if (ev == NNG_PIPE_EV_REM_POST && l->pipes > 0) {
        if (--l->pipes == 0) {
            l->info.state = SH_LINK_STATE_DOWN;
            sh__peers_link_state(l->d->rt, l->node, false);
        }
    }
    l->info.last_activity_ms = mono_ms();
    uv_mutex_unlock(&l->mu);
}

/* ---- Receiving -------------------------------------------------------------------------- */

/* The peer gate's id of a received pipe: NNG's pipe id with the top bit set, apart from the stream
 * engine's connection ids. */
static uint64_t pipe_conn(nng_pipe pipe) { return (1ull << 63) | (uint64_t)nng_pipe_id(pipe); }

/* True while listener pipe `pipe` has proved no node and the gate applies the budgets to it. */
static bool pipe_unproved(tnng *d, nng_pipe pipe)
{
    return d->preauth && sh__peers_enforced(d->rt) && !sh__peers_node(d->rt, pipe_conn(pipe));
}

/* Drops entry i of the unproved pipes (caller holds d->pmu). */
static void pend_remove_locked(tnng *d, uint32_t i)
{
    memmove(&d->pend[i], &d->pend[i + 1], (d->n_pend - i - 1) * sizeof d->pend[0]);
    d->n_pend--;
}

/* Forgets the pipes that proved a node since (caller holds d->pmu). */
static void pend_prune_locked(tnng *d)
{
    for (uint32_t i = 0; i < d->n_pend;) {
        nng_pipe p = {.id = d->pend[i].pipe};
        if (sh__peers_node(d->rt, pipe_conn(p)))
            pend_remove_locked(d, i);
        else
            i++;
    }
}

/* Closes the unproved pipes past their deadline and sleeps until the next one's, on an NNG
 * thread. */
static void tick_cb(void *arg)
{
    tnng *d = arg;
    int rv = nng_aio_result(d->tick);
    uint32_t late[PREAUTH_MAX_PIPES], n_late = 0;
    uint64_t now = mono_ms(), wait = 0;
    uv_mutex_lock(&d->pmu);
    if (rv != NNG_ECANCELED && rv != NNG_ECLOSED && !atomic_load(&d->closed)) {
        pend_prune_locked(d);
        while (d->n_pend > 0 && d->pend[0].born_ms + PREAUTH_DEADLINE_MS <= now) {
            late[n_late++] = d->pend[0].pipe;
            pend_remove_locked(d, 0);
        }
        if (d->n_pend > 0)
            wait = d->pend[0].born_ms + PREAUTH_DEADLINE_MS - now;
    }
    d->ticking = wait > 0;
    uv_mutex_unlock(&d->pmu);
    for (uint32_t i = 0; i < n_late; i++) {
        sh__peers_refuse(d->rt, SH__PEERS_PREAUTH_SLOW, 0, "connection");
        nng_pipe_close((nng_pipe){.id = late[i]});
    }
    if (wait > 0)
        nng_sleep_aio((nng_duration)wait, d->tick);
}

/* A new listener pipe that has not proved a node: at the cap the oldest such pipe is closed (so
 * that a flood of idle connections cannot keep new peers out), and its deadline is watched. */
static void preauth_add(tnng *d, nng_pipe pipe)
{
    uint64_t now = mono_ms();
    uint32_t evict = 0;
    bool arm = false;
    uv_mutex_lock(&d->pmu);
    pend_prune_locked(d);
    if (d->n_pend == PREAUTH_MAX_PIPES) {
        evict = d->pend[0].pipe;
        pend_remove_locked(d, 0);
    }
    d->pend[d->n_pend++] = (unproved){.pipe = (uint32_t)nng_pipe_id(pipe), .born_ms = now};
    if (!d->ticking && !atomic_load(&d->closed))
        arm = d->ticking = true;
    uint64_t due = d->pend[0].born_ms + PREAUTH_DEADLINE_MS;
    uv_mutex_unlock(&d->pmu);
    if (evict) {
        sh__peers_refuse(d->rt, SH__PEERS_PREAUTH_CAP, 0, "connection");
        nng_pipe_close((nng_pipe){.id = evict});
    }
    if (arm)
        nng_sleep_aio((nng_duration)(due > now ? due - now : 1), d->tick);
}

/* A pipe of the listening socket came or went: one that has not proved a node is budgeted;
 * what a closed one proved goes with it. */
static void lpipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    tnng *d = arg;
    if (ev == NNG_PIPE_EV_ADD_POST) {
        if (pipe_unproved(d, pipe))
            preauth_add(d, pipe);
        return;
    }
    if (ev != NNG_PIPE_EV_REM_POST)
        return;
    sh__peers_unbind(d->rt, pipe_conn(pipe));
    uv_mutex_lock(&d->pmu);
    for (uint32_t i = 0; i < d->n_pend; i++)
        if (d->pend[i].pipe == (uint32_t)nng_pipe_id(pipe)) {
            pend_remove_locked(d, i);
            break;
        }
    uv_mutex_unlock(&d->pmu);
}

static void recv_cb(void *arg)
{
    tnng *d = arg;
    int rv = nng_aio_result(d->raio);
    if (rv == NNG_ECLOSED || rv == NNG_ECANCELED || atomic_load(&d->closed))
        return;
    if (rv == 0) {
        nng_msg *m = nng_aio_get_msg(d->raio);
        nng_aio_set_msg(d->raio, NULL);
        size_t len = nng_msg_len(m);
        atomic_fetch_add_explicit(&d->frames_recv, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&d->bytes_recv, len, memory_order_relaxed);
        sh_error e;
        sh_err err;
        if (len > PREAUTH_FRAME_MAX && pipe_unproved(d, nng_msg_get_pipe(m))) {
            /* Over the HELLO budget before proving a node: dropped here, so it never becomes a
             * message the runtime holds (pause_msgs) or decodes; the pipe's deadline stands. */
            sh__peers_refuse(d->rt, SH__PEERS_PREAUTH_FRAME, 0, "frame");
            nng_msg_free(m);
            err = SH_OK;
        } else if (len <= SH__MAILBOX_SMALL_FRAME) {
            /* A small frame is copied into a pooled block and NNG's buffer freed here, on the
             * thread that allocated it: cheaper than a cross-thread free later. */
            err = sh__transport_deliver_conn(d->rt, pipe_conn(nng_msg_get_pipe(m)), nng_msg_body(m),
                                             len, &e);
            if (err == SH_EPROTO)
                d->o.note_foreign(d->o.up, nng_msg_body(m), len);
            nng_msg_free(m);
        } else {
            /* Zero-copy: the runtime decodes the frame in the nng_msg and frees it through the
             * pool when the message is done. */
            sh_frame_owner owner = sh__bufpool_owner(d->pool, m);
            err = sh__transport_deliver_owned_conn(d->rt, pipe_conn(nng_msg_get_pipe(m)),
                                                   nng_msg_body(m), len, &owner, &e);
            if (err == SH_EPROTO)
                d->o.note_foreign(d->o.up, nng_msg_body(m), len);
            if (err) /* the runtime did not take it */
                owner.release(owner.ctx, owner.handle);
        }
        if (err == SH_EFORMAT || err == SH_EPROTO)
            atomic_fetch_add_explicit(&d->rejected, 1, memory_order_relaxed);
    }
    nng_recv_aio(d->lsock, d->raio);
}

/* ---- Setup ------------------------------------------------------------------------------ */

/* Every URL: NNG carries whatever the stream engine does not (the transport asks it last). */
static bool handles(const char *url)
{
    (void)url;
    return true;
}

/* A tls+tcp:// URL needs the certificates. */
static sh_err url_check(void *ctx, const char *url, sh_error *e)
{
    tnng *d = ctx;
    if (sh__transport_is_tls(url) && !d->tls_server)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "transport: %s needs TLS certificates (sh_transport_opts.tls)", url);
    return SH_OK;
}

static sh_err listen_start(tnng *d, const char *url, sh_error *e)
{
    sh_err err = url_check(d, url, e);
    if (err)
        return err;
    int rv = nng_pull0_open(&d->lsock);
    if (rv)
        return sh__transport_nng_error(e, rv, "open pull socket for", url);
    d->preauth = strncmp(url, "inproc://", 9) != 0;
    /* A peer cannot make us allocate more than max_frame for one message. */
    if ((rv = nng_socket_set_size(d->lsock, NNG_OPT_RECVMAXSZ, d->o.max_frame)) == 0 &&
        (rv = nng_aio_alloc(&d->tick, tick_cb, d)) == 0 &&
        (rv = nng_pipe_notify(d->lsock, NNG_PIPE_EV_ADD_POST, lpipe_cb, d)) == 0 &&
        (rv = nng_pipe_notify(d->lsock, NNG_PIPE_EV_REM_POST, lpipe_cb, d)) == 0 &&
        (rv = nng_listener_create(&d->listener, d->lsock, url)) == 0 &&
        (!sh__transport_is_tls(url) ||
         (rv = nng_listener_set_ptr(d->listener, NNG_OPT_TLS_CONFIG, d->tls_server)) == 0) &&
        (rv = nng_listener_start(d->listener, 0)) == 0 &&
        (rv = nng_aio_alloc(&d->raio, recv_cb, d)) == 0) {
        d->listening = true;
        snprintf(d->listen_url, sizeof d->listen_url, "%s", url);
        int port = 0;
        const char *colon = strrchr(url, ':');
        if (strstr(url, "tcp") && colon &&
            nng_listener_get_int(d->listener, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
            snprintf(d->listen_url, sizeof d->listen_url, "%.*s:%d", (int)(colon - url), url, port);
        nng_recv_aio(d->lsock, d->raio);
        return SH_OK;
    }
    nng_close(d->lsock);
    return sh__transport_nng_error(e, rv, "listen on", url);
}

static void drv_destroy(void *ctx);

static sh_err drv_create(sh_runtime *rt, const sh__transport_driver_opts *o, void **out,
                         sh_error *e)
{
    tnng *d = calloc(1, sizeof *d);
    if (!d)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    d->rt = rt;
    d->o = *o;
    d->o.listen_url = NULL;
    d->o.tls = NULL;
    bool off = o->recycle_max_bytes == SH_TRANSPORT_RECYCLE_OFF;
    if (!(d->pool = sh__bufpool_create(&nngmsg_ops, off ? 0 : POOL_MSGS, o->recycle_max_bytes))) {
        free(d);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    }
    uv_mutex_init(&d->pmu);
    sh_err err = SH_OK;
    if (o->tls)
        err = sh__transport_tls_configs(o->tls, &d->tls_server, &d->tls_client, e);
    if (!err && o->listen_url)
        err = listen_start(d, o->listen_url, e);
    if (err) {
        drv_destroy(d);
        return err;
    }
    *out = d;
    return SH_OK;
}

static const char *drv_listen_url(void *ctx)
{
    tnng *d = ctx;
    return d->listening ? d->listen_url : NULL;
}

static void link_free(void *ctx, void *link)
{
    (void)ctx;
    nlink *l = link;
    for (uint32_t i = 0; i < l->nwait; i++)
        nng_msg_free(l->ring[(l->head + i) % l->cap]);
    free(l->ring);
    uv_mutex_destroy(&l->mu);
    free(l);
}

/* Stops a link's I/O: no new frame starts, the aio is cancelled and its callback waited for,
 * the socket closed, waiting frames dropped. */
static void link_close(void *ctx, void *link)
{
    (void)ctx;
    nlink *l = link;
    uv_mutex_lock(&l->mu);
    l->closed = true;
    uv_mutex_unlock(&l->mu);
    if (l->aio)
        nng_aio_stop(l->aio);
    if (l->sock_open)
        nng_close(l->sock);
    l->sock_open = false;
    uv_mutex_lock(&l->mu);
    for (uint32_t i = 0; i < l->nwait; i++)
        nng_msg_free(l->ring[(l->head + i) % l->cap]);
    l->nwait = 0;
    l->bytes = 0;
    uv_mutex_unlock(&l->mu);
    if (l->aio) {
        nng_aio_free(l->aio);
        l->aio = NULL;
    }
}

static sh_err link_add(void *ctx, uint32_t node, const char *url, void **out, sh_error *e)
{
    tnng *d = ctx;
    nlink *l = calloc(1, sizeof *l);
    nng_msg **ring = calloc(d->o.q_msgs, sizeof *ring);
    if (!l || !ring) {
        free(l);
        free(ring);
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for peer %u", (unsigned)node);
    }
    l->d = d;
    l->node = node;
    l->ring = ring;
    l->cap = d->o.q_msgs;
    snprintf(l->url, sizeof l->url, "%s", url); /* the transport checked the length */
    l->info.node = node;
    snprintf(l->info.url, sizeof l->info.url, "%s", url);
    l->info.state = SH_LINK_STATE_CONNECTING;
    l->info.last_activity_ms = mono_ms();
    uv_mutex_init(&l->mu);
    int rv = nng_push0_open(&l->sock);
    if (rv) {
        link_free(d, l);
        return sh__transport_nng_error(e, rv, "open push socket for", url);
    }
    l->sock_open = true;
    nng_dialer dl;
    if ((rv = nng_aio_alloc(&l->aio, send_cb, l)) == 0 &&
        (rv = nng_pipe_notify(l->sock, NNG_PIPE_EV_ADD_POST, pipe_cb, l)) == 0 &&
        (rv = nng_pipe_notify(l->sock, NNG_PIPE_EV_REM_POST, pipe_cb, l)) == 0 &&
        (rv = nng_socket_set_ms(l->sock, NNG_OPT_RECONNMINT, (nng_duration)d->o.rc_min)) == 0 &&
        (rv = nng_socket_set_ms(l->sock, NNG_OPT_RECONNMAXT, (nng_duration)d->o.rc_max)) == 0 &&
        (rv = nng_dialer_create(&dl, l->sock, url)) == 0 &&
        (!sh__transport_is_tls(url) ||
         (rv = nng_dialer_set_ptr(dl, NNG_OPT_TLS_CONFIG, d->tls_client)) == 0) &&
        (rv = nng_dialer_start(dl, NNG_FLAG_NONBLOCK)) == 0) {
        *out = l;
        return SH_OK;
    }
    sh_err err = sh__transport_nng_error(e, rv, "dial", url);
    link_close(d, l);
    link_free(d, l);
    return err;
}

static void link_note(void *ctx, void *link, sh_err code, const char *text)
{
    (void)ctx;
    nlink *l = link;
    uv_mutex_lock(&l->mu);
    l->info.last_err = code;
    snprintf(l->info.last_error, sizeof l->info.last_error, "%s", text);
    uv_mutex_unlock(&l->mu);
}

static void link_snapshot(void *ctx, void *link, sh_transport_link *out)
{
    (void)ctx;
    nlink *l = link;
    uv_mutex_lock(&l->mu);
    *out = l->info;
    out->queue_msgs = l->nwait + (l->sending ? 1u : 0u);
    out->queue_bytes = l->bytes;
    uv_mutex_unlock(&l->mu);
}

static void stats_add(void *ctx, sh_transport_stats *st)
{
    tnng *d = ctx;
    st->frames_sent += atomic_load(&d->frames_sent);
    st->bytes_sent += atomic_load(&d->bytes_sent);
    st->frames_recv += atomic_load(&d->frames_recv);
    st->bytes_recv += atomic_load(&d->bytes_recv);
    st->rejected += atomic_load(&d->rejected);
    st->busy += atomic_load(&d->busy);
    st->expired += atomic_load(&d->expired);
}

static void drv_close(void *ctx)
{
    tnng *d = ctx;
    if (atomic_exchange(&d->closed, 1))
        return;
    if (d->listening) {
        nng_aio_stop(d->raio); /* waits for a delivery in progress */
        nng_close(d->lsock);   /* no pipe event after this */
        nng_aio_stop(d->tick);
    }
    /* Kept buffers go now; buffers still lent to the runtime are freed when it releases them. */
    sh__bufpool_close(d->pool);
}

static void drv_destroy(void *ctx)
{
    tnng *d = ctx;
    if (!d)
        return;
    drv_close(d);
    if (d->raio)
        nng_aio_free(d->raio);
    if (d->tick)
        nng_aio_free(d->tick);
    if (d->tls_server)
        nng_tls_config_free(d->tls_server);
    if (d->tls_client)
        nng_tls_config_free(d->tls_client);
    sh__bufpool_unref(d->pool);
    uv_mutex_destroy(&d->pmu);
    free(d);
}

const sh__transport_driver sh__transport_nng_driver = {
    .name = "nng",
    .handles = handles,
    .create = drv_create,
    .listen_url = drv_listen_url,
    .url_check = url_check,
    .link_add = link_add,
    .send = link_send,
    .frame_alloc = frame_alloc,
    .link_note = link_note,
    .link_snapshot = link_snapshot,
    .link_close = link_close,
    .link_free = link_free,
    .stats_add = stats_add,
    .close = drv_close,
    .destroy = drv_destroy,
};
