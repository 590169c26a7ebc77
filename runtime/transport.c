/* The transport: one link table over two link drivers (runtime/transport_driver.h), the stream
 * engine (ipc://, tcp://) and NNG (inproc://, tls+tcp://, or every URL with use_nng), with
 * bounded queues. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "base/error.h"
#include "runtime/msg.h"
#include "runtime/transport_driver.h"
#include "runtime/transport_resolve.h"

#define URL_MAX 256 /* a peer's URL, with its NUL */
#define MAX_DRIVERS 2

/* A link driver the transport created. */
typedef struct driver {
    const sh__transport_driver *vt;
    void *ctx;
} driver;

/* One peer link: its driver and the driver's link. The struct lives until the transport is
 * destroyed (a removed peer is retired, not freed) so senders may keep the pointer. */
typedef struct peer {
    uint32_t node;
    const sh__transport_driver *vt;
    void *ctx;  /* the driver's */
    void *link; /* what vt->link_add returned */
} peer;

struct sh_transport {
    sh_runtime *rt;
    driver drivers[MAX_DRIVERS]; /* (n_drivers) in order of preference; the last takes any URL */
    size_t n_drivers;
    uint32_t self;
    size_t max_frame;
    char listen_url[256];
    uv_mutex_t mu; /* the peer table */
    peer **peers;  /* (n_peers) live links in add order */
    size_t n_peers, cap_peers;
    peer **retired; /* (n_retired) removed links, freed at destroy */
    size_t n_retired, cap_retired;
    _Atomic int closed;
    _Atomic int busy_senders; /* threads inside send_frame; close waits for zero */
    sh_transport_hooks hooks;
};

/* The driver that carries `url`: the first that handles it. */
static const driver *driver_for(sh_transport *tp, const char *url)
{
    for (size_t i = 0; i + 1 < tp->n_drivers; i++)
        if (tp->drivers[i].vt->handles(url))
            return &tp->drivers[i];
    return &tp->drivers[tp->n_drivers - 1];
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

/* ---- Sending ---------------------------------------------------------------------------- */

static sh_err check_len(sh_transport *tp, size_t len, sh_error *e)
{
    if (len > tp->max_frame)
        return sh__error_set(e, SH_ERANGE, "transport: frame of %zu bytes exceeds max_frame %zu",
                             len, tp->max_frame);
    return SH_OK;
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
        err = p->vt->send(p->ctx, p->link, (uint8_t *)frame, len, NULL, e);
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
        err = p->vt->send(p->ctx, p->link, frame, len, owner, e);
    atomic_fetch_sub(&tp->busy_senders, 1);
    return err;
}

/* The frame_alloc hook: a recycled or new buffer that node's link sends without copying (the
 * last driver's, NNG's, when node has no link). */
static uint8_t *tp_frame_alloc(void *ctx, uint32_t node, size_t cap, sh_frame_owner *owner)
{
    sh_transport *tp = ctx;
    if (cap > tp->max_frame || atomic_load(&tp->closed))
        return NULL;
    peer *p = NULL;
    if (peer_find(tp, node, &p, NULL) == SH_OK)
        return p->vt->frame_alloc(p->ctx, cap, owner);
    const driver *d = &tp->drivers[tp->n_drivers - 1];
    return d->vt->frame_alloc(d->ctx, cap, owner);
}

/* ---- Receiving -------------------------------------------------------------------------- */

/* A received frame the runtime refused: when it is another protocol version's, that becomes the
 * sender's link's last error, where the front's join and `shoal cluster status` read it (the
 * frame itself is dropped, so nothing else would tell). Any thread. */
static void note_foreign(void *up, const void *frame, size_t len)
{
    sh_transport *tp = up;
    char text[sizeof((sh_transport_link *)0)->last_error];
    uint32_t node = sh__msg_foreign_note(frame, len, text, sizeof text);
    if (!node)
        return;
    uv_mutex_lock(&tp->mu);
    peer *p = find_locked(tp, node);
    if (p)
        p->vt->link_note(p->ctx, p->link, SH_EPROTO, text);
    uv_mutex_unlock(&tp->mu);
}

/* ---- Setup ------------------------------------------------------------------------------ */

static void drivers_destroy(sh_transport *tp)
{
    for (size_t i = tp->n_drivers; i-- > 0;)
        tp->drivers[i].vt->destroy(tp->drivers[i].ctx);
    tp->n_drivers = 0;
}

sh_err sh_transport_create(sh_runtime *rt, const sh_transport_opts *opts, sh_transport **out,
                           sh_error *e)
{
    if (!rt || !opts || !out)
        return sh__error_set(e, SH_EINVAL, "transport: NULL argument");
    sh_err rerr = opts->listen_url
                      ? sh__transport_resolve_wait(opts->listen_url, opts->listen_resolve_ms, e)
                      : SH_OK;
    if (rerr)
        return rerr;
    sh_transport *tp = calloc(1, sizeof *tp);
    if (!tp)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory");
    tp->rt = rt;
    tp->self = sh_runtime_node(rt);
    sh__transport_driver_opts o = {
        .q_msgs = opts->queue_max_msgs ? opts->queue_max_msgs : 1024,
        .q_bytes = opts->queue_max_bytes ? opts->queue_max_bytes : (uint64_t)256 << 20,
        .max_frame = opts->max_frame ? opts->max_frame : SH_MSG_MAX_FRAME_DEFAULT,
        .rc_min = opts->reconnect_min_ms ? opts->reconnect_min_ms : 10,
        .rc_max = opts->reconnect_max_ms ? opts->reconnect_max_ms : 1000,
        .send_to = opts->send_timeout_ms ? opts->send_timeout_ms : 10000,
        .loop = opts->io_loop,
        .recycle_max_bytes = opts->recycle_max_bytes ? opts->recycle_max_bytes : (uint64_t)64 << 20,
        .pause_msgs = opts->recv_pause_msgs ? opts->recv_pause_msgs : 16384,
        .pause_bytes = opts->recv_pause_bytes ? opts->recv_pause_bytes : (uint64_t)256 << 20,
        .tls = opts->tls,
        .note_foreign = note_foreign,
        .up = tp};
    if (o.rc_max < o.rc_min)
        o.rc_max = o.rc_min;
    tp->max_frame = o.max_frame;
    uv_mutex_init(&tp->mu);
    /* NNG alone with use_nng; else the stream engine first (ipc://, tcp://), NNG for the rest. */
    const sh__transport_driver *vts[MAX_DRIVERS] = {&sh__stream_driver, &sh__transport_nng_driver};
    size_t n = 2, first = opts->use_nng ? 1 : 0;
    size_t listen_on = n; /* the driver that listens */
    for (size_t i = first; opts->listen_url && listen_on == n && i < n; i++)
        if (i + 1 == n || vts[i]->handles(opts->listen_url))
            listen_on = i;
    sh_err err = SH_OK;
    for (size_t i = first; i < n && !err; i++) {
        o.listen_url = i == listen_on ? opts->listen_url : NULL;
        driver *d = &tp->drivers[tp->n_drivers];
        d->vt = vts[i];
        if ((err = d->vt->create(rt, &o, &d->ctx, e)) == SH_OK)
            tp->n_drivers++;
    }
    if (!err && listen_on < n) {
        const char *bound =
            tp->drivers[listen_on - first].vt->listen_url(tp->drivers[listen_on - first].ctx);
        snprintf(tp->listen_url, sizeof tp->listen_url, "%s", bound ? bound : "");
    }
    tp->hooks = (sh_transport_hooks){.ctx = tp,
                                     .send_frame = tp_send,
                                     .send_owned = tp_send_owned,
                                     .frame_alloc = tp_frame_alloc};
    if (!err && sh_transport_set(rt, &tp->hooks) != SH_OK)
        err = sh__error_set(e, SH_ENOMEM, "transport: cannot install hooks");
    if (err) {
        drivers_destroy(tp);
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
    if (p->vt->link_free)
        p->vt->link_free(p->ctx, p->link);
    free(p);
}

sh_err sh_transport_peer_add(sh_transport *tp, uint32_t node, const char *url, sh_error *e)
{
    if (node == 0 || node == tp->self || !url || strlen(url) >= URL_MAX)
        return sh__error_set(e, SH_EINVAL, "transport: bad peer (node %u, url %s)", (unsigned)node,
                             url ? url : "(null)");
    const driver *d = driver_for(tp, url);
    sh_err err = d->vt->url_check ? d->vt->url_check(d->ctx, url, e) : SH_OK;
    if (err)
        return err;
    if (atomic_load(&tp->closed))
        return sh__error_set(e, SH_ECLOSED, "transport: closed");
    peer *p = calloc(1, sizeof *p);
    if (!p)
        return sh__error_set(e, SH_ENOMEM, "transport: out of memory for peer %u", (unsigned)node);
    p->node = node;
    p->vt = d->vt;
    p->ctx = d->ctx;
    uv_mutex_lock(&tp->mu);
    if (find_locked(tp, node)) {
        uv_mutex_unlock(&tp->mu);
        free(p);
        return sh__error_set(e, SH_EBUSY, "transport: node %u already has a peer", (unsigned)node);
    }
    if (tp->n_peers == tp->cap_peers) {
        size_t cap = tp->cap_peers ? tp->cap_peers * 2 : 8;
        peer **np = realloc(tp->peers, cap * sizeof *np);
        if (!np) {
            uv_mutex_unlock(&tp->mu);
            free(p);
            return sh__error_set(e, SH_ENOMEM, "transport: out of memory for the peer table");
        }
        tp->peers = np;
        tp->cap_peers = cap;
    }
    /* Opened under the table lock so that two adds of one node cannot both dial. Dialling is
     * non-blocking, so the lock is held briefly. */
    if ((err = p->vt->link_add(p->ctx, node, url, &p->link, e)) != SH_OK) {
        uv_mutex_unlock(&tp->mu);
        free(p);
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
    p->vt->link_close(p->ctx, p->link);
    return SH_OK;
}

void sh_transport_links(sh_transport *tp, sh_transport_link *out, size_t cap, size_t *n)
{
    uv_mutex_lock(&tp->mu);
    for (size_t i = 0; i < tp->n_peers && i < cap; i++) {
        peer *p = tp->peers[i];
        p->vt->link_snapshot(p->ctx, p->link, &out[i]);
    }
    *n = tp->n_peers;
    uv_mutex_unlock(&tp->mu);
}

sh_err sh_transport_link_get(sh_transport *tp, uint32_t node, sh_transport_link *out)
{
    uv_mutex_lock(&tp->mu);
    peer *p = find_locked(tp, node);
    if (p)
        p->vt->link_snapshot(p->ctx, p->link, out);
    uv_mutex_unlock(&tp->mu);
    return p ? SH_OK : SH_ENOTFOUND;
}

void sh_transport_stats_get(sh_transport *tp, sh_transport_stats *out)
{
    *out = (sh_transport_stats){0};
    for (size_t i = 0; i < tp->n_drivers; i++)
        tp->drivers[i].vt->stats_add(tp->drivers[i].ctx, out);
}

void sh_transport_close(sh_transport *tp)
{
    if (!tp || atomic_exchange(&tp->closed, 1))
        return;
    sh_transport_set(tp->rt, NULL);
    /* A sender that passed the hook lookup before the hooks went away finishes first. */
    while (atomic_load(&tp->busy_senders) > 0) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    uv_mutex_lock(&tp->mu);
    for (size_t i = 0; i < tp->n_peers; i++)
        tp->peers[i]->vt->link_close(tp->peers[i]->ctx, tp->peers[i]->link);
    uv_mutex_unlock(&tp->mu);
    /* Each driver stops its listener and I/O (waited for: nothing reads after this). */
    for (size_t i = 0; i < tp->n_drivers; i++)
        tp->drivers[i].vt->close(tp->drivers[i].ctx);
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
    drivers_destroy(tp);
    uv_mutex_destroy(&tp->mu);
    free(tp);
}
