/* SH_COLL_NET: the collectives between ranks on several hosts, over NNG links (runtime/coll.h).
 *
 * Sockets. Each rank listens with one pull0 socket on urls[rank] and dials every peer with one
 * push0 socket of its own, as the node transport does (runtime/transport_nng.c). One listener
 * fair-queues every peer's frames into one receive queue, so the calling thread waits on one
 * socket with one deadline whichever peer speaks next, and a frame's pipe tells which connection
 * it came by; one push socket per peer addresses that peer alone. pair1 would need a socket (and a
 * listening URL) per pair of ranks, or its deprecated polyamorous mode. Sends never block the
 * calling thread: each push socket has a queue drained by one NNG aio (send_cb), so two ranks
 * sending each other a whole ring step cannot deadlock on full socket buffers; a frame a peer does
 * not take within timeout_ms fails its link, and the next call on it fails.
 *
 * Join. create sends every peer a HELLO carrying a fresh nonce and the group's parameters (epoch,
 * size, max_bytes, compression), again every 50 ms to a peer that has not answered (a HELLO that
 * reached the peer's previous incarnation at the same URL is lost with it), and answers each
 * HELLO with a PROOF (so do the calls, for a peer still in create): the peer's nonce and, when
 * the group has a cluster key, HMAC-SHA256(key, "shoal coll join v1" | the PROOF's header |
 * destination rank | nonce). A rank has joined when its PROOF answers this rank's nonce (a
 * recorded proof answers no later create) with a valid MAC; a bad MAC is dropped, counted and
 * logged once naming the peer's URL, and create goes on waiting: a forged frame cannot end it.
 * With a key, the pipe that carried a rank's PROOF is the only one its data frames are taken
 * from afterwards (a reconnection breaks the group); without a key, any pipe may claim a rank.
 * A PROOF with other parameters fails create with SH_EPROTO; frames of another epoch are dropped.
 * On tcp:// the key authenticates the joining ranks, not the data, and nothing is encrypted. On
 * tls+tcp:// every listener and dialer takes the TLS configuration of the node's own links
 * (runtime/transport_tls.c: its certificate, the CA, mutual verification): the frames are the
 * same, encrypted by NNG's TLS transport, and a peer whose certificate the CA did not sign never
 * completes a connection (the join's timeout names it with its failed handshakes).
 *
 * Calls. Every frame carries the header of runtime/coll_net.h: sequence, op, source, segment,
 * element count, compression and a CRC-32C. A frame with a bad CRC, another epoch, an older
 * sequence or one too far ahead is dropped and counted; frames of the next few calls (a fast
 * peer) wait in a bounded stash. A frame of the current call from the rank waited for with
 * another op, size, segment or length fails the call with SH_EPROTO naming the rank and both
 * values. Waits end at the call's deadline (timeout_ms from its start) with SH_ETIMEDOUT naming
 * the rank waited for (a stopped peer), or within about 100 ms of the rank's connection closing
 * (the one its join PROOF came by: the process died, destroyed its handle or reconnected, losing
 * what was in flight) with SH_ECLOSED naming it, once what it sent before has been read.
 *
 * Lost frames. The listener's receive is always pending (recv_cb, on an NNG thread): it queues
 * what arrives for the calling thread and answers a NACK at once, even between calls. A call
 * waiting for a frame from a rank that has sent nothing for NACK_FIRST_NS asks that rank for it
 * again (a NACK naming the call, the frame's type and index), the gap doubling up to
 * NACK_MAX_NS while the rank stays silent; post keeps a copy of every data and acknowledgement
 * frame of the last AHEAD + 1 calls (a direct broadcast's receivers can run a few calls ahead of
 * a rank still waiting) and the NACK's answer is that copy, marked resent (not when the link is
 * still handing frames over or the frame was posted under NACK_FIRST_NS ago: it may be on its
 * way). A ring all-reduce's first frames are kept without a copy (post_lazy): while the call
 * runs, a resend encodes them again from the caller's buffer. Frames are taken by (call, type,
 * source, index), so one that comes late or twice is stashed and then let go. The fault hook
 * (sh_coll_opts.fault) decides each frame's fate in fault_send.
 *
 * The collectives themselves are in coll_net_algo.c, the join in coll_net_join.c.
 *
 * Destroy gives the links up to LINGER_MS to hand over what they still hold (a rank's call can
 * end before its last forwards have left), pauses CLOSE_PAUSE_MS (TLS_PAUSE_MS on tls+tcp://),
 * closes its links, closes the listener to new connections and waits up to DRAIN_MS for the
 * peers' links to it to close, then closes everything. A peer still waiting for this rank sees
 * the connection close (SH_ECLOSED).
 *
 * Limits, with NNG 1.5.2 (the system's): nng_close can hang on a socket that connections or
 * frames are still reaching (NNG issues #1219 and #1543: fixed after 1.5.2), which is why destroy
 * sends nothing new, pauses, and closes its listener last; and a group re-created at once on the
 * same URLs can meet a stuck connection or a listener that no longer accepts: create opens the link
 * or the listener afresh when it is safe (coll_net_join.c says when). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nng/nng.h>

#include <nng/protocol/pipeline0/pull.h>
#include <nng/protocol/pipeline0/push.h>

#include "base/error.h"
#include "runtime/coll_net_int.h"
#include "runtime/transport.h"

/* The reasons of runtime/coll_net_int.h's DROP_* as the log says them. */
static const char *const drop_why[] = {
    "bad magic, version, length or CRC",
    "another epoch",
    "a bad source rank or group size",
    "a link that did not prove the rank",
    "an older call",
    "a call too far ahead",
    "the stash is full",
    "a join proof that fails the cluster key check",
};

uint64_t sh__coll_net_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Counts a dropped frame and logs the first of each reason. `src` < 0: unknown sender. */
void sh__coll_net_drop(net *im, nng_msg *m, int why, int src)
{
    atomic_fetch_add_explicit(&im->dropped, 1, memory_order_relaxed);
    if (!(im->logged & (1u << why))) {
        im->logged |= 1u << why;
        sh__log_emit(&im->lg, SH_LOG_LEVEL_WARN, NULL, 0, "coll_frame_dropped",
                     "rank=%d claimed_rank=%d url=%s reason=\"%s\" (logged once per reason)",
                     (int)im->c->rank, src, src >= 0 && src < im->c->size ? im->urls[src] : "?",
                     drop_why[why]);
    }
    nng_msg_free(m);
}

/* ---- Sending ---------------------------------------------------------------------------- */

static void link_kick(peer_link *l, nng_msg *m)
{
    nng_aio_set_msg(l->aio, m);
    nng_aio_set_timeout(l->aio, (nng_duration)l->im->c->timeout_ms);
    nng_send_aio(l->sock, l->aio);
}

/* A send finished (on an NNG thread): record a failure, start the next frame. */
static void send_cb(void *arg)
{
    peer_link *l = arg;
    int rv = nng_aio_result(l->aio);
    bool join = false;
    if (rv) {
        nng_msg *m = nng_aio_get_msg(l->aio);
        nng_aio_set_msg(l->aio, NULL);
        join = nng_msg_len(m) > 5 && ((uint8_t *)nng_msg_body(m))[5] < SH__COLL_NET_DATA;
        nng_msg_free(m);
    }
    nng_msg *next = NULL;
    pthread_mutex_lock(&l->mu);
    if (rv && !join && !l->err) /* a lost join frame is said again; a lost data frame is not */
        l->err = rv;
    if (!l->closed && l->n) {
        next = l->q[l->head];
        l->head = (l->head + 1) % l->cap;
        l->n--;
    } else {
        l->sending = false;
        pthread_cond_broadcast(&l->idle);
    }
    pthread_mutex_unlock(&l->mu);
    if (next)
        link_kick(l, next);
}

/* A link's connection came or went (on an NNG thread). */
static void link_pipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    (void)pipe;
    peer_link *l = arg;
    pthread_mutex_lock(&l->mu);
    l->pipes += ev == NNG_PIPE_EV_ADD_POST ? 1 : -1;
    pthread_cond_broadcast(&l->idle);
    pthread_mutex_unlock(&l->mu);
}

/* Queues m for rank dst. m is the link's in every case (freed on failure); SH_ETIMEDOUT or
 * SH_EIO when an earlier frame to dst failed, SH_ENOMEM. */
static sh_err link_send(net *im, int32_t dst, nng_msg *m, sh_error *e)
{
    peer_link *l = &im->links[dst];
    size_t len = nng_msg_len(m);
    int err;
    bool kick = false, full = false;
    pthread_mutex_lock(&l->mu);
    err = l->err;
    if (!err && l->sending) {
        if (l->n == l->cap) {
            size_t cap = l->cap ? l->cap * 2 : 64;
            nng_msg **q = malloc(cap * sizeof *q);
            if (q) {
                for (size_t i = 0; i < l->n; i++)
                    q[i] = l->q[(l->head + i) % l->cap];
                free(l->q);
                l->q = q;
                l->cap = cap;
                l->head = 0;
            } else {
                full = true;
            }
        }
        if (!full) {
            l->q[(l->head + l->n) % l->cap] = m;
            l->n++;
        }
    } else if (!err) {
        l->sending = kick = true;
    }
    pthread_mutex_unlock(&l->mu);
    if (err || full) {
        nng_msg_free(m);
        if (full)
            return sh__error_set(e, SH_ENOMEM, "coll: out of memory queueing a frame");
        return sh__error_set(e, err == NNG_ETIMEDOUT ? SH_ETIMEDOUT : SH_EIO,
                             "coll: rank %d: sending to rank %d (%s) failed: %s", (int)im->c->rank,
                             (int)dst, im->urls[dst], nng_strerror(err));
    }
    if (kick)
        link_kick(l, m);
    atomic_fetch_add_explicit(&im->c->bytes_wire, len, memory_order_relaxed);
    return SH_OK;
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* link_send through the fault hook: a dropped frame is counted as sent and freed, a duplicated
 * one queued twice. A join frame passes untouched. */
static sh_err fault_send(net *im, int32_t dst, nng_msg *m, sh_error *e)
{
    uint8_t type = ((const uint8_t *)nng_msg_body(m))[5] & (uint8_t)~SH__COLL_NET_RESENT;
    sh_coll_fault f =
        im->fault && type >= SH__COLL_NET_DATA ? im->fault(im->fault_ud, dst) : SH_COLL_FAULT_PASS;
    if (f == SH_COLL_FAULT_DROP) {
        atomic_fetch_add_explicit(&im->c->bytes_wire, nng_msg_len(m), memory_order_relaxed);
        nng_msg_free(m);
        return SH_OK;
    }
    nng_msg *twin = NULL;
    if (f == SH_COLL_FAULT_DUPLICATE && nng_msg_dup(&twin, m) != 0)
        twin = NULL;
    sh_err rc = link_send(im, dst, m, e);
    if (twin)
        rc = rc ? (nng_msg_free(twin), rc) : link_send(im, dst, twin, e);
    return rc;
}

/* Adds k to the kept frames (false: out of memory). */
static bool keep(net *im, kept k, size_t *slot)
{
    pthread_mutex_lock(&im->kmu);
    if (im->n_kept == im->cap_kept) {
        size_t cap = im->cap_kept ? im->cap_kept * 2 : 64;
        kept *a = realloc(im->kept, cap * sizeof *a);
        if (!a) {
            pthread_mutex_unlock(&im->kmu);
            return false;
        }
        im->kept = a;
        im->cap_kept = cap;
    }
    if (slot)
        *slot = im->n_kept;
    im->kept[im->n_kept++] = k;
    pthread_mutex_unlock(&im->kmu);
    return true;
}

/* Keeps a copy of a data or acknowledgement frame of the current call (to send it again when
 * the peer asks), then sends it. */
sh_err sh__coll_net_post(net *im, int32_t dst, nng_msg *m, sh_error *e)
{
    const uint8_t *b = nng_msg_body(m);
    if (b[5] == SH__COLL_NET_DATA || b[5] == SH__COLL_NET_ACK) {
        /* The copy comes from the pool when it can (nng_msg_dup would allocate and zero a new
         * frame, then fault its pages in: with the copy itself, a fifth of a 16 MB ring's time
         * on two vCPUs). */
        size_t len = nng_msg_len(m);
        nng_msg *copy = sh__coll_net_frame_new(im, len - SH__COLL_NET_HDR);
        if (!copy) {
            nng_msg_free(m);
            return sh__coll_net_oom(e);
        }
        memcpy(nng_msg_body(copy), b, len);
        if (!keep(im,
                  (kept){.m = copy,
                         .seq = im->c->seq,
                         .at_ns = sh__coll_net_now_ns(),
                         .dst = dst,
                         .index = rd32(b + 32),
                         .type = b[5]},
                  NULL)) {
            nng_msg_free(copy);
            nng_msg_free(m);
            return sh__coll_net_oom(e);
        }
    }
    return fault_send(im, dst, m, e);
}

sh_err sh__coll_net_post_lazy(net *im, int32_t dst, nng_msg *m, const sh__coll_net_hdr *h,
                              const float *src, size_t *slot, sh_error *e)
{
    if (!keep(im,
              (kept){.src = src,
                     .count = h->count,
                     .h = *h,
                     .seq = im->c->seq,
                     .at_ns = sh__coll_net_now_ns(),
                     .dst = dst,
                     .index = h->index,
                     .type = h->type},
              slot)) {
        nng_msg_free(m);
        return sh__coll_net_oom(e);
    }
    return fault_send(im, dst, m, e);
}

void sh__coll_net_kept_drop(net *im, size_t slot, size_t n)
{
    pthread_mutex_lock(&im->kmu);
    for (size_t i = slot; i < slot + n && i < im->n_kept; i++)
        im->kept[i].src = NULL;
    pthread_mutex_unlock(&im->kmu);
}

void sh__coll_net_kept_prune(net *im)
{
    size_t k = 0;
    pthread_mutex_lock(&im->kmu);
    for (size_t i = 0; i < im->n_kept; i++) {
        if (im->kept[i].seq + AHEAD < im->c->seq) {
            if (im->kept[i].m)
                sh__coll_net_frame_release(im, im->kept[i].m); /* for post's next copies */
        } else {
            im->kept[k++] = im->kept[i];
        }
    }
    im->n_kept = k;
    pthread_mutex_unlock(&im->kmu);
}

/* A peer asked for a frame again (on an NNG thread): send the kept copy, marked resent, if any
 * (a frame not sent yet will be sent anyway), unless the link to the peer is still handing
 * frames over or the frame was posted less than NACK_FIRST_NS ago (it may still be on its way:
 * the peer asks again if it does not come). */
static void resend(net *im, const sh__coll_net_hdr *h)
{
    nng_msg *m = NULL;
    peer_link *l = &im->links[h->src];
    pthread_mutex_lock(&l->mu);
    bool busy = l->sending;
    pthread_mutex_unlock(&l->mu);
    if (busy)
        return;
    pthread_mutex_lock(&im->kmu);
    for (size_t i = 0; i < im->n_kept; i++) {
        kept *k = &im->kept[i];
        if (k->dst == h->src && k->seq == h->seq && k->index == h->index &&
            k->type == (uint8_t)h->count) {
            if (sh__coll_net_now_ns() - k->at_ns < NACK_FIRST_NS)
                break;
            if (k->m) {
                if (nng_msg_dup(&m, k->m) != 0)
                    m = NULL;
            } else if (k->src) {
                /* Encoded again from floats the calling thread leaves alone until it has
                 * dropped this entry, which it does under kmu. */
                size_t plen = sh__coll_net_wire_size((sh_coll_compress)k->h.compress, k->count);
                if (nng_msg_alloc(&m, SH__COLL_NET_HDR + plen) == 0) {
                    sh__coll_net_encode((sh_coll_compress)k->h.compress, k->src, k->count,
                                        payload(m));
                    sh__coll_net_seal(&k->h, nng_msg_body(m), plen);
                } else {
                    m = NULL;
                }
            }
            break;
        }
    }
    pthread_mutex_unlock(&im->kmu);
    if (!m)
        return;
    sh__coll_net_hdr k;
    if (sh__coll_net_open(nng_msg_body(m), nng_msg_len(m), &k)) {
        k.resent = true;
        sh__coll_net_seal(&k, nng_msg_body(m), payload_len(m));
    }
    atomic_fetch_add_explicit(&im->resent, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&im->recovery_bytes, nng_msg_len(m), memory_order_relaxed);
    sh_error e = {0};
    (void)fault_send(im, h->src, m, &e); /* a failed link fails the next call */
}

/* Asks rank src for the frame (type, index) of the current call again. */
static void nack(net *im, int32_t src, uint8_t type, uint32_t index)
{
    nng_msg *m = sh__coll_net_frame_new(im, 0);
    if (!m)
        return;
    sh__coll_net_hdr h = sh__coll_net_hdr_of(im, SH__COLL_NET_NACK, im->op, im->total, index, type);
    sh__coll_net_seal(&h, nng_msg_body(m), 0);
    atomic_fetch_add_explicit(&im->nacks, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&im->recovery_bytes, nng_msg_len(m), memory_order_relaxed);
    sh_error e = {0};
    (void)fault_send(im, src, m, &e);
}

/* A new frame with a plen-byte payload (uninitialised), or NULL: a kept frame large enough when
 * there is one (no allocation, no zeroing, no page faults: a ring of 16 MB moves 128 frames per
 * call), else a new one. */
nng_msg *sh__coll_net_frame_new(net *im, size_t plen)
{
    size_t len = SH__COLL_NET_HDR + plen;
    for (size_t i = im->n_pool; i-- > 0;) {
        nng_msg *m = im->pool[i];
        if (nng_msg_capacity(m) < len)
            continue;
        im->pool[i] = im->pool[--im->n_pool];
        im->pool_bytes -= nng_msg_capacity(m);
        nng_msg_clear(m);
        nng_msg_header_clear(m);
        if (nng_msg_realloc(m, len) == 0) /* within the capacity: only the length changes */
            return m;
        nng_msg_free(m);
        break;
    }
    nng_msg *m;
    return nng_msg_alloc(&m, len) == 0 ? m : NULL;
}

/* Keeps a received or no longer kept frame for frame_new (up to POOL_MSGS and 2 max_bytes + 1 MB:
 * a ring all-reduce sends up to twice its size, and post copies all of it), or frees it. */
void sh__coll_net_frame_release(net *im, nng_msg *m)
{
    size_t cap = nng_msg_capacity(m);
    if (im->n_pool < POOL_MSGS &&
        im->pool_bytes + cap <= 2 * im->c->max_bytes + ((size_t)1 << 20)) {
        im->pool[im->n_pool++] = m;
        im->pool_bytes += cap;
    } else {
        nng_msg_free(m);
    }
}

/* The header of a frame of the current call from this rank. */
sh__coll_net_hdr sh__coll_net_hdr_of(net *im, uint8_t type, uint8_t op, uint64_t total,
                                     uint32_t index, uint32_t count)
{
    sh_coll *c = im->c;
    return (sh__coll_net_hdr){.type = type,
                              .op = op,
                              .compress = op == SH__COLL_OP_ALLREDUCE ? (uint8_t)im->cmp : 0,
                              .epoch = c->epoch,
                              .src = (uint16_t)c->rank,
                              .size = (uint16_t)c->size,
                              .seq = c->seq,
                              .total = total,
                              .index = index,
                              .count = count};
}

/* Builds a frame of count floats encoded with the group's compression (NULL: out of memory). */
nng_msg *sh__coll_net_frame_floats(net *im, uint64_t total, uint32_t index, const float *x,
                                   size_t count)
{
    size_t plen = sh__coll_net_wire_size(im->cmp, count);
    nng_msg *m = sh__coll_net_frame_new(im, plen);
    if (!m)
        return NULL;
    sh__coll_net_encode(im->cmp, x, count, payload(m));
    sh__coll_net_hdr h = sh__coll_net_hdr_of(im, SH__COLL_NET_DATA, SH__COLL_OP_ALLREDUCE, total,
                                             index, (uint32_t)count);
    sh__coll_net_seal(&h, nng_msg_body(m), plen);
    return m;
}

/* Builds a frame of len bytes as they are (type DATA or ACK). */
nng_msg *sh__coll_net_frame_bytes(net *im, uint8_t type, uint8_t op, uint64_t total, uint32_t index,
                                  const void *p, size_t len)
{
    nng_msg *m = sh__coll_net_frame_new(im, len);
    if (!m)
        return NULL;
    if (len)
        memcpy(payload(m), p, len);
    sh__coll_net_hdr h = sh__coll_net_hdr_of(im, type, op, total, index, (uint32_t)len);
    sh__coll_net_seal(&h, nng_msg_body(m), len);
    return m;
}

/* Re-addresses a received frame as this rank's, with another index, to forward it unchanged. */
void sh__coll_net_frame_forward(net *im, nng_msg *m, const sh__coll_net_hdr *got, uint32_t index)
{
    sh__coll_net_hdr h = *got;
    h.src = (uint16_t)im->c->rank;
    h.resent = false;
    h.index = index;
    sh__coll_net_seal(&h, nng_msg_body(m), payload_len(m));
}

sh_err sh__coll_net_oom(sh_error *e) { return sh__error_set(e, SH_ENOMEM, "coll: out of memory"); }

/* ---- Receiving -------------------------------------------------------------------------- */

/* A connection to the listener closed (on an NNG thread): when it is the one a rank joined by,
 * that rank has died or left (or reconnected, having lost what was in flight): the calls stop
 * waiting for it (take). */
static void listener_pipe_cb(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    (void)ev;
    net *im = arg;
    uint32_t id = (uint32_t)nng_pipe_id(pipe);
    for (int32_t p = 0; p < im->c->size; p++)
        if (p != im->c->rank && atomic_load(&im->pipe_of[p]) == id)
            atomic_fetch_or(&im->lost, 1ull << p);
}

/* A frame reached the listener (on an NNG thread): a NACK is answered here, whatever the
 * calling thread does (it may be between calls); the rest is queued for recv_one. The receive
 * is started again until the socket closes. */
static void recv_cb(void *arg)
{
    net *im = arg;
    int rv = nng_aio_result(im->raio);
    if (rv) {
        pthread_mutex_lock(&im->rmu);
        im->rerr = rv;
        pthread_cond_broadcast(&im->rcv);
        pthread_mutex_unlock(&im->rmu);
        return;
    }
    nng_msg *m = nng_aio_get_msg(im->raio);
    nng_aio_set_msg(im->raio, NULL);
    sh__coll_net_hdr h;
    const sh_coll *c = im->c;
    if (nng_msg_len(m) == SH__COLL_NET_HDR &&
        sh__coll_net_open(nng_msg_body(m), nng_msg_len(m), &h) && h.type == SH__COLL_NET_NACK) {
        bool ok = h.epoch == c->epoch && h.src < c->size && h.src != c->rank &&
                  (!im->key ||
                   (uint32_t)nng_pipe_id(nng_msg_get_pipe(m)) == atomic_load(&im->pipe_of[h.src]));
        nng_msg_free(m);
        if (ok)
            resend(im, &h);
        else
            atomic_fetch_add_explicit(&im->dropped, 1, memory_order_relaxed);
    } else {
        pthread_mutex_lock(&im->rmu);
        if (im->rq_n == im->rq_cap) {
            size_t cap = im->rq_cap ? im->rq_cap * 2 : 256;
            nng_msg **q = malloc(cap * sizeof *q);
            if (q) {
                for (size_t i = 0; i < im->rq_n; i++)
                    q[i] = im->rq[(im->rq_head + i) % im->rq_cap];
                free(im->rq);
                im->rq = q;
                im->rq_cap = cap;
                im->rq_head = 0;
            }
        }
        if (im->rq_n < im->rq_cap) {
            im->rq[(im->rq_head + im->rq_n) % im->rq_cap] = m;
            im->rq_n++;
            pthread_cond_signal(&im->rcv);
        } else { /* out of memory: lost, as on the wire (asked for again) */
            nng_msg_free(m);
        }
        pthread_mutex_unlock(&im->rmu);
    }
    nng_recv_aio(im->lsock, im->raio);
}

/* Waits until deadline for the next frame on the listener: 0 with *m, or an NNG code. */
int sh__coll_net_recv_one(net *im, uint64_t deadline, nng_msg **m)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000u),
                          .tv_nsec = (long)(deadline % 1000000000u)};
    int rv = 0;
    pthread_mutex_lock(&im->rmu);
    while (!im->rq_n && !im->rerr) {
        if (sh__coll_net_now_ns() >= deadline ||
            pthread_cond_timedwait(&im->rcv, &im->rmu, &ts) == ETIMEDOUT) {
            if (!im->rq_n && !im->rerr)
                rv = NNG_ETIMEDOUT;
            if (rv)
                break;
        }
    }
    if (!rv && im->rq_n) {
        *m = im->rq[im->rq_head];
        im->rq_head = (im->rq_head + 1) % im->rq_cap;
        im->rq_n--;
    } else if (!rv) {
        rv = im->rerr;
    }
    pthread_mutex_unlock(&im->rmu);
    return rv;
}

/* Checks what every frame must pass (CRC, epoch, source, the proven pipe for data); false when
 * it dropped the frame. */
bool sh__coll_net_frame_check(net *im, nng_msg *m, sh__coll_net_hdr *h)
{
    sh_coll *c = im->c;
    if (!sh__coll_net_open(nng_msg_body(m), nng_msg_len(m), h)) {
        sh__coll_net_drop(im, m, DROP_BAD, -1);
        return false;
    }
    if (h->epoch != c->epoch) {
        sh__coll_net_drop(im, m, DROP_EPOCH, h->src < c->size ? h->src : -1);
        return false;
    }
    if (h->src >= c->size || h->src == c->rank || h->size != c->size) {
        sh__coll_net_drop(im, m, DROP_RANK, -1);
        return false;
    }
    if (im->key && h->type >= SH__COLL_NET_DATA &&
        (uint32_t)nng_pipe_id(nng_msg_get_pipe(m)) != atomic_load(&im->pipe_of[h->src])) {
        sh__coll_net_drop(im, m, DROP_PIPE, h->src);
        return false;
    }
    return true;
}

/* Keeps a frame of a later call (or of this call, not yet wanted) until it is. */
void sh__coll_net_stash_put(net *im, nng_msg *m, const sh__coll_net_hdr *h)
{
    size_t len = nng_msg_len(m);
    if (im->n_stash >= STASH_FRAMES || im->stash_bytes + len > im->stash_cap_bytes) {
        sh__coll_net_drop(im, m, DROP_STASH, h->src);
        return;
    }
    im->stash[im->n_stash++] = (stashed){.m = m, .h = *h};
    im->stash_bytes += len;
}

/* Drops what the stash holds of calls before the current one (duplicates, leftovers). */
void sh__coll_net_stash_purge(net *im)
{
    size_t k = 0;
    for (size_t i = 0; i < im->n_stash; i++) {
        if (im->stash[i].h.seq < im->c->seq) {
            im->stash_bytes -= nng_msg_len(im->stash[i].m);
            if (im->stash[i].h.resent) /* a frame asked for again that came twice */
                nng_msg_free(im->stash[i].m);
            else
                sh__coll_net_drop(im, im->stash[i].m, DROP_OLD, im->stash[i].h.src);
        } else {
            im->stash[k++] = im->stash[i];
        }
    }
    im->n_stash = k;
}

/* Whether h is the frame take waits for: of the current call, of `type`, from src, at index
 * (or one that cannot be: another op, size or broadcast root, for expect to refuse). */
static bool wanted(const net *im, const sh__coll_net_hdr *h, uint8_t type, int32_t src,
                   uint32_t index)
{
    if (h->seq != im->c->seq || h->type != type || h->src != src)
        return false;
    if (h->index == index || h->op != im->op || h->total != im->total)
        return true;
    return im->op == SH__COLL_OP_BROADCAST && h->index >> 24 != index >> 24;
}

/* The frame (type, index) of the current call from rank src: from the stash, else from the
 * socket until deadline. Other frames of this call and of the next AHEAD calls are stashed;
 * the rest are dropped. When src has been silent NACK_FIRST_NS (then twice as long, up to
 * NACK_MAX_NS), the frame is asked for again: it may have been lost. SH_ETIMEDOUT names src
 * and `what`; SH_ECLOSED when src's connection closed; SH_EIO when the socket fails. */
sh_err sh__coll_net_take(net *im, uint8_t type, int32_t src, uint32_t index, uint64_t deadline,
                         const char *what, nng_msg **out, sh__coll_net_hdr *h, sh_error *e)
{
    sh_coll *c = im->c;
    for (size_t i = 0; i < im->n_stash; i++) {
        stashed *s = &im->stash[i];
        if (wanted(im, &s->h, type, src, index)) {
            *out = s->m;
            *h = s->h;
            im->stash_bytes -= nng_msg_len(s->m);
            memmove(s, s + 1, (im->n_stash - i - 1) * sizeof *s);
            im->n_stash--;
            return SH_OK;
        }
    }
    /* The wait goes in slices of LOST_POLL_MS, to notice src's connection closing; then what
     * src sent before it closed has LOST_GRACE_MS to be read before the call fails. */
    bool lost = false;
    uint64_t gap = NACK_FIRST_NS, nack_at = sh__coll_net_now_ns() + gap;
    for (;;) {
        nng_msg *m;
        uint64_t now = sh__coll_net_now_ns(), slice = now + LOST_POLL_MS * 1000000u;
        if (!lost && (atomic_load(&im->lost) >> src & 1u)) {
            lost = true;
            if (deadline > now + LOST_GRACE_MS * 1000000u)
                deadline = now + LOST_GRACE_MS * 1000000u;
        }
        if (!lost && now >= nack_at) {
            nack(im, src, type, index);
            gap = gap * 2 < NACK_MAX_NS ? gap * 2 : NACK_MAX_NS;
            nack_at = now + gap;
        }
        if (slice > nack_at)
            slice = nack_at;
        int rv = sh__coll_net_recv_one(im, slice < deadline ? slice : deadline, &m);
        if (rv == NNG_ETIMEDOUT && sh__coll_net_now_ns() < deadline)
            continue;
        if (rv == NNG_ETIMEDOUT && lost)
            return sh__error_set(e, SH_ECLOSED,
                                 "coll: %s #%llu: rank %d (%s) closed its connection to rank %d "
                                 "(it died or left) before sending %s",
                                 sh__coll_op_name(im->op), (unsigned long long)c->seq, (int)src,
                                 im->urls[src], (int)c->rank, what);
        if (rv == NNG_ETIMEDOUT)
            return sh__error_set(e, SH_ETIMEDOUT,
                                 "coll: %s #%llu: rank %d waited %d ms for rank %d (%s): %s",
                                 sh__coll_op_name(im->op), (unsigned long long)c->seq, (int)c->rank,
                                 (int)c->timeout_ms, (int)src, im->urls[src], what);
        if (rv)
            return sh__error_set(e, SH_EIO, "coll: rank %d: receive failed: %s", (int)c->rank,
                                 nng_strerror(rv));
        if (!sh__coll_net_frame_check(im, m, h))
            continue;
        if (h->src == src) { /* src is not silent: a lost frame shows as silence */
            gap = NACK_FIRST_NS;
            nack_at = sh__coll_net_now_ns() + gap;
        }
        if (h->type == SH__COLL_NET_HELLO && payload_len(m) == NONCE) {
            /* A peer still in create (its first HELLO went to this rank's previous incarnation,
             * or its PROOF from here was lost): answer it as create does. */
            sh_err rc = sh__coll_net_join_send(im, SH__COLL_NET_PROOF, h->src, payload(m), e);
            nng_msg_free(m);
            if (rc)
                return rc;
            continue;
        }
        if (h->type < SH__COLL_NET_DATA || h->type > SH__COLL_NET_ACK) {
            nng_msg_free(m); /* a late PROOF: this rank has joined already */
            continue;
        }
        if (h->seq < c->seq) {
            if (h->resent) /* asked for, then found in the queue: not a stray */
                nng_msg_free(m);
            else
                sh__coll_net_drop(im, m, DROP_OLD, h->src);
            continue;
        }
        if (h->seq > c->seq + AHEAD) {
            sh__coll_net_drop(im, m, DROP_AHEAD, h->src);
            continue;
        }
        if (wanted(im, h, type, src, index)) {
            *out = m;
            return SH_OK;
        }
        sh__coll_net_stash_put(im, m, h);
    }
}

/* Checks that a frame of the current call is the one this rank expects: op, total size,
 * compression, index, element count and payload length. SH_EPROTO names the rank and both
 * values. */
sh_err sh__coll_net_expect(net *im, nng_msg *m, const sh__coll_net_hdr *h, uint8_t op,
                           uint64_t total, uint32_t index, uint32_t count, size_t plen, sh_error *e)
{
    sh_coll *c = im->c;
    const char *on = sh__coll_op_name(op);
    unsigned long long seq = (unsigned long long)c->seq;
    if (h->op != op)
        return sh__error_set(e, SH_EPROTO, "coll: call #%llu: rank %d called %s, this rank %d %s",
                             seq, (int)h->src, sh__coll_op_name(h->op), (int)c->rank, on);
    if (h->total != total)
        return sh__error_set(e, SH_EPROTO,
                             "coll: %s #%llu: rank %d passed %llu %s, this rank %d passed %llu", on,
                             seq, (int)h->src, (unsigned long long)h->total,
                             op == SH__COLL_OP_ALLREDUCE ? "floats" : "bytes", (int)c->rank,
                             (unsigned long long)total);
    uint8_t cmp = op == SH__COLL_OP_ALLREDUCE ? (uint8_t)im->cmp : 0;
    if (h->compress != cmp)
        return sh__error_set(
            e, SH_EPROTO, "coll: %s #%llu: rank %d sent compression %u, this rank %d uses %u", on,
            seq, (int)h->src, (unsigned)h->compress, (int)c->rank, (unsigned)cmp);
    if (h->index != index || h->count != count || payload_len(m) != plen)
        return sh__error_set(e, SH_EPROTO,
                             "coll: %s #%llu: rank %d sent segment %#x of %u elements in %zu "
                             "bytes, rank %d expected segment %#x of %u in %zu",
                             on, seq, (int)h->src, (unsigned)h->index, (unsigned)h->count,
                             payload_len(m), (int)c->rank, (unsigned)index, (unsigned)count, plen);
    return SH_OK;
}

/* take + expect for a data frame; frees the frame on failure. */
sh_err sh__coll_net_take_data(net *im, int32_t src, uint64_t deadline, uint8_t op, uint64_t total,
                              uint32_t index, uint32_t count, size_t plen, nng_msg **m,
                              sh__coll_net_hdr *h, sh_error *e)
{
    char what[64];
    snprintf(what, sizeof what, "segment %#x of %s", (unsigned)index, sh__coll_op_name(op));
    sh_err rc = sh__coll_net_take(im, SH__COLL_NET_DATA, src, index, deadline, what, m, h, e);
    if (rc)
        return rc;
    rc = sh__coll_net_expect(im, *m, h, op, total, index, count, plen, e);
    if (rc)
        nng_msg_free(*m);
    return rc;
}

/* ---- Create and destroy ----------------------------------------------------------------- */

static void net_free(net *im)
{
    if (!im)
        return;
    /* A call can end on this rank before its last frames have left (a ring's last forwards):
     * the links get up to LINGER_MS together to hand what they hold to NNG, and none once the
     * peer has closed the connection (it has left, so it waits for nothing); then CLOSE_PAUSE_MS
     * for NNG to write the last one. Nothing new is sent: NNG 1.5.2's nng_close can hang on a
     * socket that frames are still arriving at, so a goodbye frame would do more harm than good
     * (a peer still waiting for this rank times out). */
    /* A create that failed over tls+tcp:// flushes too: its join was sending HELLOs and PROOFs
     * to the peers until the end, and closing a TLS link in mid-write can hang in nng_close
     * (test_coll_net_tls wrong_key: 1 run in 17 under load hung in the link's close below). */
    bool flush = im->c->ops != NULL || im->tls_client != NULL;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += (long)LINGER_MS * 1000000;
    until.tv_sec += until.tv_nsec / 1000000000;
    until.tv_nsec %= 1000000000;
    for (int32_t p = 0; flush && im->links && p < im->c->size; p++) {
        peer_link *l = &im->links[p];
        if (!l->sock_open)
            continue;
        pthread_mutex_lock(&l->mu);
        while (l->sending && !l->err && l->pipes > 0 &&
               pthread_cond_timedwait(&l->idle, &l->mu, &until) == 0) {
        }
        pthread_mutex_unlock(&l->mu);
    }
    /* Then this rank's links to its peers close, before its listener: NNG 1.5.2's nng_close of
     * a pull socket can wait for ever for an inbound pipe still receiving (its issue #1219;
     * test_coll_net ipc with 4 ranks, three copies at once: 1 run in 30-90 hung in the
     * listener's close, every later close of the process with it), so the listener closes once
     * the peers' links to it are gone, which their own destroys now close first (up to
     * DRAIN_MS: a peer still in a call keeps its link). First a pause for NNG to write what the
     * links handed over: CLOSE_PAUSE_MS, or TLS_PAUSE_MS on tls+tcp://, where NNG's TLS layer
     * encrypts and writes 16 KiB at a time and closing a socket while it still writes the last
     * frame can leave NNG's reaper waiting for ever (bench_collectives --transport tls, 2 ranks,
     * 16 MiB all-reduces: 1 to 3 runs in 8 hung in destroy without it, none in 38 with it). A
     * resend recv_cb still makes finds the link closed. */
    if (flush)
        nanosleep(&(struct timespec){.tv_nsec = (im->tls_client ? TLS_PAUSE_MS : CLOSE_PAUSE_MS) *
                                                1000000L},
                  NULL);
    for (int32_t p = 0; im->links && p < im->c->size; p++) {
        peer_link *l = &im->links[p];
        if (!l->im) /* never set up */
            continue;
        pthread_mutex_lock(&l->mu);
        l->closed = true;
        pthread_mutex_unlock(&l->mu);
        if (l->sock_open) {
            /* No pipe event after this point may reach l, which is freed below. */
            nng_pipe_notify(l->sock, NNG_PIPE_EV_ADD_POST, NULL, NULL);
            nng_pipe_notify(l->sock, NNG_PIPE_EV_REM_POST, NULL, NULL);
            nng_close(l->sock); /* fails the send in flight at once */
        }
    }
    if (im->lopen) {
        /* No new connection; then the pause, also for one accepted just before (a peer's next
         * incarnation dialling this URL) to finish its handshake (NNG 1.5.2's nng_close can
         * wait forever for a pipe still negotiating), and until every joined peer's link to
         * this rank has closed (listener_pipe_cb marks it lost). */
        nng_listener_close(im->listener);
        nanosleep(&(struct timespec){.tv_nsec = CLOSE_PAUSE_MS * 1000000L}, NULL);
        uint64_t peers = 0;
        for (int32_t p = 0; p < im->c->size; p++)
            if (p != im->c->rank && atomic_load(&im->pipe_of[p]))
                peers |= 1ull << p;
        for (int i = 0; flush && i < DRAIN_MS && (atomic_load(&im->lost) & peers) != peers; i++)
            nanosleep(&(struct timespec){.tv_nsec = 1000000L}, NULL);
        nng_pipe_notify(im->lsock, NNG_PIPE_EV_REM_POST, NULL, NULL);
        nng_close(im->lsock);
    }
    if (im->raio)
        nng_aio_stop(im->raio); /* no recv_cb (nor resend) runs after this */
    for (int32_t p = 0; im->links && p < im->c->size; p++) {
        peer_link *l = &im->links[p];
        if (!l->im)
            continue;
        if (l->aio)
            nng_aio_free(l->aio); /* waits for its callback */
        for (size_t i = 0; i < l->n; i++)
            nng_msg_free(l->q[(l->head + i) % l->cap]);
        free(l->q);
        pthread_cond_destroy(&l->idle);
        pthread_mutex_destroy(&l->mu);
    }
    if (im->raio)
        nng_aio_free(im->raio);
    for (size_t i = 0; i < im->rq_n; i++)
        nng_msg_free(im->rq[(im->rq_head + i) % im->rq_cap]);
    free(im->rq);
    for (size_t i = 0; i < im->n_kept; i++)
        nng_msg_free(im->kept[i].m); /* NULL for a lazy one */
    free(im->kept);
    pthread_cond_destroy(&im->rcv);
    pthread_mutex_destroy(&im->rmu);
    pthread_mutex_destroy(&im->kmu);
    for (size_t i = 0; i < im->n_stash; i++)
        nng_msg_free(im->stash[i].m);
    for (size_t i = 0; i < im->n_pool; i++)
        nng_msg_free(im->pool[i]);
    free(im->stash);
    free(im->links);
    free(im->pipe_of);
    free(im->slots);
    free(im->urls);
    if (im->tls_server) /* NNG holds its own reference while a listener or dialer uses one */
        nng_tls_config_free(im->tls_server);
    if (im->tls_client)
        nng_tls_config_free(im->tls_client);
    if (im->key) {
        memset(im->key, 0, im->key_len);
        free(im->key);
    }
    free(im);
}

static void net_destroy(sh_coll *c) { net_free(c->impl); }

static const sh__coll_ops net_ops = {
    .allreduce = sh__coll_net_algo_allreduce,
    .allgather = sh__coll_net_algo_allgather,
    .broadcast = sh__coll_net_algo_broadcast,
    .destroy = net_destroy,
};

static bool url_tls(const char *u) { return strncmp(u, "tls+tcp://", 10) == 0; }

/* Checks the URLs: every rank's set, ipc://, tcp:// or tls+tcp:// (every rank's or none, with
 * the TLS material), no two alike. */
static sh_err check_urls(const sh_coll_opts *o, sh_error *e)
{
    if (!o->urls)
        return sh__error_set(e, SH_EINVAL,
                             "coll: urls is NULL (the network transport needs every "
                             "rank's listening URL)");
    for (int32_t i = 0; i < o->size; i++) {
        const char *u = o->urls[i];
        if (!u || !*u)
            return sh__error_set(e, SH_EINVAL, "coll: urls[%d] is %s", (int)i,
                                 u ? "empty" : "NULL");
        if (strlen(u) >= URL_MAX)
            return sh__error_set(e, SH_EINVAL, "coll: urls[%d] is longer than %d bytes", (int)i,
                                 URL_MAX - 1);
        if (strncmp(u, "ipc://", 6) != 0 && strncmp(u, "tcp://", 6) != 0 && !url_tls(u))
            return sh__error_set(e, SH_EINVAL,
                                 "coll: urls[%d] %s: not an ipc://, tcp:// or tls+tcp:// URL",
                                 (int)i, u);
        if (i > 0 && url_tls(u) != url_tls(o->urls[0]))
            return sh__error_set(e, SH_EINVAL,
                                 "coll: urls[0] is %s and urls[%d] %s: with TLS every rank "
                                 "must listen on tls+tcp://",
                                 o->urls[0], (int)i, u);
        if (url_tls(u) && !o->tls)
            return sh__error_set(e, SH_EINVAL,
                                 "coll: urls[%d] %s: tls+tcp:// needs sh_coll_opts.tls (this "
                                 "rank's certificate and key, and the CA)",
                                 (int)i, u);
        for (int32_t j = 0; j < i; j++)
            if (strcmp(o->urls[j], u) == 0)
                return sh__error_set(e, SH_EINVAL, "coll: ranks %d and %d have the same URL %s",
                                     (int)j, (int)i, u);
    }
    return SH_OK;
}

/* Opens rank p's link (its push socket, dialling p's URL); its mutex, condition and aio exist. */
static sh_err link_open(net *im, int32_t p, sh_error *e)
{
    sh_coll *c = im->c;
    peer_link *l = &im->links[p];
    int rv;
    if ((rv = nng_push0_open(&l->sock)) != 0)
        return sh__error_set(e, SH_EIO, "coll: rank %d: cannot open a push socket: %s",
                             (int)c->rank, nng_strerror(rv));
    l->sock_open = true;
    if ((rv = nng_pipe_notify(l->sock, NNG_PIPE_EV_ADD_POST, link_pipe_cb, l)) != 0 ||
        (rv = nng_pipe_notify(l->sock, NNG_PIPE_EV_REM_POST, link_pipe_cb, l)) != 0 ||
        (rv = nng_socket_set_ms(l->sock, NNG_OPT_RECONNMINT, 10)) != 0 ||
        (rv = nng_socket_set_ms(l->sock, NNG_OPT_RECONNMAXT, 100)) != 0 ||
        (rv = nng_dialer_create(&l->dialer, l->sock, im->urls[p])) != 0 ||
        (im->tls_client &&
         (rv = nng_dialer_set_ptr(l->dialer, NNG_OPT_TLS_CONFIG, im->tls_client)) != 0) ||
        (rv = nng_dialer_start(l->dialer, NNG_FLAG_NONBLOCK)) != 0)
        return sh__error_set(e, SH_EIO, "coll: rank %d cannot dial rank %d at %s: %s", (int)c->rank,
                             (int)p, im->urls[p], nng_strerror(rv));
    return SH_OK;
}

/* Listens on this rank's URL (with the TLS configuration on tls+tcp://): 0 or an NNG code. */
static int listen_start(net *im)
{
    int rv = nng_listener_create(&im->listener, im->lsock, im->urls[im->c->rank]);
    if (!rv && im->tls_server)
        rv = nng_listener_set_ptr(im->listener, NNG_OPT_TLS_CONFIG, im->tls_server);
    if (!rv)
        rv = nng_listener_start(im->listener, 0);
    return rv;
}

/* Opens the listener and the links to every peer. */
static sh_err open_sockets(net *im, sh_error *e)
{
    sh_coll *c = im->c;
    const char *url = im->urls[c->rank];
    int rv = nng_pull0_open(&im->lsock);
    if (rv)
        return sh__error_set(e, SH_EIO, "coll: rank %d: cannot open a pull socket: %s",
                             (int)c->rank, nng_strerror(rv));
    im->lopen = true;
    if ((rv = nng_socket_set_size(im->lsock, NNG_OPT_RECVMAXSZ, RECV_MAX)) != 0 ||
        (rv = nng_pipe_notify(im->lsock, NNG_PIPE_EV_REM_POST, listener_pipe_cb, im)) != 0 ||
        (rv = nng_aio_alloc(&im->raio, recv_cb, im)) != 0 || (rv = listen_start(im)) != 0)
        return sh__error_set(e, SH_EIO, "coll: rank %d cannot listen on %s: %s", (int)c->rank, url,
                             nng_strerror(rv));
    nng_recv_aio(im->lsock, im->raio);
    for (int32_t p = 0; p < c->size; p++) {
        if (p == c->rank)
            continue;
        peer_link *l = &im->links[p];
        l->im = im;
        pthread_mutex_init(&l->mu, NULL);
        pthread_cond_init(&l->idle, NULL);
        if ((rv = nng_aio_alloc(&l->aio, send_cb, l)) != 0)
            return sh__error_set(e, SH_EIO, "coll: rank %d: cannot allocate an aio: %s",
                                 (int)c->rank, nng_strerror(rv));
        sh_err rc = link_open(im, p, e);
        if (rc)
            return rc;
    }
    return SH_OK;
}

/* Closes this rank's listener and listens again on its URL (create only, before any peer has
 * joined over it): with NNG 1.5.2 a listener can stop taking connections after one from a peer's
 * previous incarnation (see sh__coll_net_join). */
sh_err sh__coll_net_relisten(net *im, sh_error *e)
{
    const char *url = im->urls[im->c->rank];
    im->tls_auth_listen += sh__coll_net_tls_auth(im, -1);
    nng_listener_close(im->listener);
    int rv = listen_start(im);
    if (rv)
        return sh__error_set(e, SH_EIO, "coll: rank %d cannot listen on %s again: %s",
                             (int)im->c->rank, url, nng_strerror(rv));
    return SH_OK;
}

sh_err sh__coll_net_redial(net *im, int32_t p, sh_error *e)
{
    peer_link *l = &im->links[p];
    im->tls_auth[p] += sh__coll_net_tls_auth(im, p);
    pthread_mutex_lock(&l->mu);
    l->closed = true;
    pthread_mutex_unlock(&l->mu);
    nng_pipe_notify(l->sock, NNG_PIPE_EV_ADD_POST, NULL, NULL);
    nng_pipe_notify(l->sock, NNG_PIPE_EV_REM_POST, NULL, NULL);
    nng_close(l->sock); /* fails the send in flight */
    l->sock_open = false;
    nng_aio_wait(l->aio);
    pthread_mutex_lock(&l->mu);
    for (size_t i = 0; i < l->n; i++)
        nng_msg_free(l->q[(l->head + i) % l->cap]);
    l->head = l->n = 0;
    l->closed = l->sending = false;
    l->pipes = 0;
    l->err = 0;
    pthread_mutex_unlock(&l->mu);
    return link_open(im, p, e);
}

sh_err sh__coll_net_create(sh_coll *c, const sh_coll_opts *o, sh_error *e)
{
    uint64_t deadline = sh__coll_net_now_ns() + (uint64_t)c->timeout_ms * 1000000u;
    sh_err rc = check_urls(o, e);
    if (rc)
        return rc;
    if (o->compress < SH_COLL_COMPRESS_NONE || o->compress > SH_COLL_COMPRESS_INT8)
        return sh__error_set(e, SH_EINVAL, "coll: unknown compression %d", (int)o->compress);
    if ((o->key == NULL) != (o->key_len == 0))
        return sh__error_set(e, SH_EINVAL, "coll: key and key_len disagree (%s key of %zu bytes)",
                             o->key ? "a" : "no", o->key_len);
    net *im = calloc(1, sizeof *im);
    if (!im)
        return sh__coll_net_oom(e);
    im->c = c;
    im->cmp = o->compress;
    im->fault = o->fault;
    im->fault_ud = o->fault_ud;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&im->rcv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&im->rmu, NULL);
    pthread_mutex_init(&im->kmu, NULL);
    size_t n = (size_t)c->size;
    size_t slot = c->max_bytes < ONESHOT_MAX ? c->max_bytes : ONESHOT_MAX;
    im->urls = calloc(n, sizeof *im->urls);
    im->links = calloc(n, sizeof *im->links);
    im->pipe_of = calloc(n, sizeof *im->pipe_of);
    im->stash = calloc(STASH_FRAMES, sizeof *im->stash);
    im->slots = malloc(n * slot + sizeof(float));
    im->stash_cap_bytes = 4 * c->max_bytes + ((size_t)4 << 20);
    if (o->key) {
        im->key = malloc(o->key_len);
        if (im->key) {
            memcpy(im->key, o->key, o->key_len);
            im->key_len = o->key_len;
        }
    }
    if (!im->urls || !im->links || !im->pipe_of || !im->stash || !im->slots ||
        (o->key && !im->key)) {
        net_free(im);
        return sh__coll_net_oom(e);
    }
    for (size_t i = 0; i < n; i++)
        snprintf(im->urls[i], URL_MAX, "%s", o->urls[i]);
    char node[32];
    snprintf(node, sizeof node, "coll-rank%d", (int)c->rank);
    sh__log_init(&im->lg, SH_LOG_LEVEL_WARN, NULL, NULL, stderr, node);
    c->impl = im;
    if (url_tls(im->urls[0])) {
        sh_error te = {0};
        rc = sh__transport_tls_configs(o->tls, &im->tls_server, &im->tls_client, &te);
        if (rc) {
            c->impl = NULL;
            net_free(im);
            return sh__error_set(e, rc, "coll: rank %d: %s", (int)c->rank, te.msg);
        }
    }
    if ((rc = sh__auth_random(im->nonce, NONCE, e)) != SH_OK ||
        (rc = open_sockets(im, e)) != SH_OK || (rc = sh__coll_net_join(im, deadline, e)) != SH_OK) {
        c->impl = NULL;
        net_free(im);
        return rc;
    }
    c->ops = &net_ops;
    return SH_OK;
}

uint64_t sh__coll_net_dropped(const sh_coll *c)
{
    net *im = c->impl;
    return atomic_load_explicit(&im->dropped, memory_order_relaxed);
}

void sh__coll_net_resends(const sh_coll *c, uint64_t *nacks, uint64_t *resent, uint64_t *bytes)
{
    net *im = c->impl;
    *nacks = atomic_load_explicit(&im->nacks, memory_order_relaxed);
    *resent = atomic_load_explicit(&im->resent, memory_order_relaxed);
    *bytes = atomic_load_explicit(&im->recovery_bytes, memory_order_relaxed);
}
