/* The network collectives' algorithms (SH_COLL_NET, runtime/coll_net.c has the links):
 *
 * Chosen by size so that every rank chooses alike (a rank passing another size fails the call
 * with SH_EPROTO):
 * - all-reduce of at most ONESHOT_MAX bytes: one-shot. Every rank sends its buffer to every
 *   other and sums the size contributions in rank order, so every rank computes the same sum,
 *   bit for bit. Larger: ring. Reduce-scatter (size - 1 steps: rank r sends chunk r - s to its
 *   right and adds chunk r - s - 1 from its left), then all-gather (size - 1 steps) of each
 *   chunk's final value from the rank that owns it; every segment of SEG_BYTES is forwarded as
 *   soon as it is summed, so the steps overlap. The owner's value is the only one computed and
 *   every other rank copies its bytes, so every rank ends with the same bits.
 * - all-gather: direct (every rank sends its part to every other) up to ONESHOT_MAX bytes per
 *   rank, else a pipelined ring.
 * - broadcast: direct from the root up to ONESHOT_MAX bytes, else a pipelined chain (root,
 *   root + 1, ...). Every receiver (direct) or the chain's last rank acknowledges to the root, so
 *   the root's call ends only when every rank has the data, and no rank runs more than a couple
 *   of calls ahead of another (which bounds the stash).
 * - compression (all-reduce only; all-gather and broadcast move bytes as they are): what
 *   crosses a link is f16 or int8 (runtime/coll_net_wire.c); sums are taken in f32. Each
 *   rank's own contribution (one-shot) and each chunk's final value (ring) go through the same
 *   encode and decode as what it sends, so ranks still agree bit for bit. */
#include <string.h>

#include "base/error.h"
#include "runtime/coll_net_int.h"

static int32_t mod(int64_t a, int32_t n) { return (int32_t)(((a % n) + n) % n); }

/* Starts a call: its op and size, its deadline, a stash without the older calls' leftovers, and
 * the frames kept for resending without those of calls no peer can still wait for. */
static uint64_t call_begin(net *im, uint8_t op, uint64_t total)
{
    im->op = op;
    im->total = total;
    sh__coll_net_stash_purge(im);
    sh__coll_net_kept_prune(im);
    return sh__coll_net_now_ns() + (uint64_t)im->c->timeout_ms * 1000000u;
}

/* One-shot all-reduce: every contribution to every rank, summed in rank order. */
static sh_err allreduce_oneshot(net *im, float *buf, size_t n, uint64_t deadline, sh_error *e)
{
    sh_coll *c = im->c;
    const uint8_t op = SH__COLL_OP_ALLREDUCE;
    size_t plen = sh__coll_net_wire_size(im->cmp, n);
    nng_msg *mine = sh__coll_net_frame_floats(im, n, 0, buf, n);
    if (!mine)
        return sh__coll_net_oom(e);
    /* This rank's own contribution as the others will decode it. */
    sh__coll_net_decode(im->cmp, payload(mine), n, im->slots + (size_t)c->rank * n, false);
    sh_err rc = SH_OK;
    for (int32_t p = 0; p < c->size && !rc; p++) {
        if (p == c->rank)
            continue;
        nng_msg *m;
        if (nng_msg_dup(&m, mine) != 0)
            rc = sh__coll_net_oom(e);
        else
            rc = sh__coll_net_post(im, p, m, e);
    }
    nng_msg_free(mine);
    for (int32_t p = 0; p < c->size && !rc; p++) {
        if (p == c->rank)
            continue;
        nng_msg *m;
        sh__coll_net_hdr h;
        rc = sh__coll_net_take_data(im, p, deadline, op, n, 0, (uint32_t)n, plen, &m, &h, e);
        if (rc)
            break;
        sh__coll_net_decode(im->cmp, payload(m), n, im->slots + (size_t)p * n, false);
        sh__coll_net_frame_release(im, m);
    }
    if (rc)
        return rc;
    memcpy(buf, im->slots, n * sizeof(float));
    for (int32_t p = 1; p < c->size; p++) {
        const float *s = im->slots + (size_t)p * n;
        for (size_t i = 0; i < n; i++)
            buf[i] += s[i];
    }
    return SH_OK;
}

/* Chunk k of n elements split size ways: [*off, *off + *len). */
static void chunk_of(size_t n, int32_t size, int32_t k, size_t *off, size_t *len)
{
    *off = n * (size_t)k / (size_t)size;
    *len = n * (size_t)(k + 1) / (size_t)size - *off;
}

static size_t nseg(size_t len, size_t seg) { return (len + seg - 1) / seg; }

static uint32_t ring_index(int32_t step, size_t seg)
{
    return (uint32_t)step << 16 | (uint32_t)seg;
}

/* Uncompressed, a partial sum is taken in the frame itself, in one pass: p[i] = p[i] + x[i]
 * (the same bits as x[i] + p[i]: addition commutes), and the final one stored in x too. The
 * payload is only 4-byte aligned (after the 44-byte header), hence the memcpy loads. */
static void add_f32(uint8_t *p, float *x, size_t n, bool store)
{
    if (store) {
        for (size_t i = 0; i < n; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            v += x[i];
            memcpy(p + 4 * i, &v, 4);
            x[i] = v;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            v += x[i];
            memcpy(p + 4 * i, &v, 4);
        }
    }
}

/* Ring all-reduce: reduce-scatter then all-gather, segment by segment. */
static sh_err allreduce_ring(net *im, float *buf, size_t n, uint64_t deadline, sh_error *e)
{
    sh_coll *c = im->c;
    const uint8_t op = SH__COLL_OP_ALLREDUCE;
    const int32_t r = c->rank, N = c->size, S = N - 1, right = mod(r + 1, N), left = mod(r - 1, N);
    size_t off, len;
    sh_err rc = SH_OK;
    /* This rank's own chunk goes out first. Its frames are kept lazily (no copy): the chunk
     * stays as it is until its final value comes back in the all-gather, which shows that the
     * right neighbour has them (every rank's contribution is in that value), so they are
     * dropped from the kept frames just before it is written, or when the call ends. Their
     * slots are consecutive (nothing else is kept in between, and only call_begin prunes). */
    size_t slot0 = 0, posted = 0;
    chunk_of(n, N, r, &off, &len);
    for (size_t j = 0; j < nseg(len, SEG_FLOATS) && !rc; j++) {
        size_t o = off + j * SEG_FLOATS,
               k = len - j * SEG_FLOATS < SEG_FLOATS ? len - j * SEG_FLOATS : SEG_FLOATS,
               plen = sh__coll_net_wire_size(im->cmp, k), slot;
        nng_msg *m = sh__coll_net_frame_new(im, plen);
        if (!m) {
            rc = sh__coll_net_oom(e);
            break;
        }
        sh__coll_net_encode(im->cmp, buf + o, k, payload(m));
        sh__coll_net_hdr h =
            sh__coll_net_hdr_of(im, SH__COLL_NET_DATA, op, n, ring_index(0, j), (uint32_t)k);
        sh__coll_net_seal(&h, nng_msg_body(m), plen);
        rc = sh__coll_net_post_lazy(im, right, m, &h, buf + o, &slot, e);
        if (!rc && posted++ == 0)
            slot0 = slot;
    }
    /* Reduce-scatter: step s adds chunk r - s - 1 and passes it on; the last step's chunk,
     * r + 1, is this rank's, whose final value starts the all-gather. */
    for (int32_t s = 0; s < S && !rc; s++) {
        chunk_of(n, N, mod(r - s - 1, N), &off, &len);
        for (size_t j = 0; j < nseg(len, SEG_FLOATS) && !rc; j++) {
            size_t o = off + j * SEG_FLOATS,
                   k = len - j * SEG_FLOATS < SEG_FLOATS ? len - j * SEG_FLOATS : SEG_FLOATS;
            nng_msg *m;
            sh__coll_net_hdr h;
            rc = sh__coll_net_take_data(im, left, deadline, op, n, ring_index(s, j), (uint32_t)k,
                                        sh__coll_net_wire_size(im->cmp, k), &m, &h, e);
            if (rc)
                break;
            /* The sum goes on in the frame it came in (same length: same k). */
            if (im->cmp == SH_COLL_COMPRESS_NONE) {
                add_f32(payload(m), buf + o, k, s == S - 1);
            } else {
                sh__coll_net_decode(im->cmp, payload(m), k, buf + o, true);
                sh__coll_net_encode(im->cmp, buf + o, k, payload(m));
                if (s == S - 1) /* the final value, as every other rank will decode it */
                    sh__coll_net_decode(im->cmp, payload(m), k, buf + o, false);
            }
            h = sh__coll_net_hdr_of(im, SH__COLL_NET_DATA, op, n, ring_index(s + 1, j),
                                    (uint32_t)k);
            sh__coll_net_seal(&h, nng_msg_body(m), payload_len(m));
            rc = sh__coll_net_post(im, right, m, e);
        }
    }
    /* All-gather: step t takes chunk r - t's final value and passes its bytes on unchanged. */
    for (int32_t t = 0; t < S && !rc; t++) {
        chunk_of(n, N, mod(r - t, N), &off, &len);
        for (size_t j = 0; j < nseg(len, SEG_FLOATS) && !rc; j++) {
            size_t o = off + j * SEG_FLOATS,
                   k = len - j * SEG_FLOATS < SEG_FLOATS ? len - j * SEG_FLOATS : SEG_FLOATS;
            nng_msg *m;
            sh__coll_net_hdr h;
            rc = sh__coll_net_take_data(im, left, deadline, op, n, ring_index(S + t, j),
                                        (uint32_t)k, sh__coll_net_wire_size(im->cmp, k), &m, &h, e);
            if (rc)
                break;
            if (t == 0 && j < posted) /* this rank's chunk (see above) */
                sh__coll_net_kept_drop(im, slot0 + j, 1);
            sh__coll_net_decode(im->cmp, payload(m), k, buf + o, false);
            if (t < S - 1) {
                sh__coll_net_frame_forward(im, m, &h, ring_index(S + t + 1, j));
                rc = sh__coll_net_post(im, right, m, e);
            } else {
                sh__coll_net_frame_release(im, m);
            }
        }
    }
    sh__coll_net_kept_drop(im, slot0, posted); /* buf is the caller's again */
    return rc;
}

sh_err sh__coll_net_algo_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e)
{
    net *im = c->impl;
    uint64_t deadline = call_begin(im, SH__COLL_OP_ALLREDUCE, n);
    if (n * sizeof(float) <= ONESHOT_MAX)
        return allreduce_oneshot(im, buf, n, deadline, e);
    return allreduce_ring(im, buf, n, deadline, e);
}

/* Sends len bytes at p to every other rank as one frame each. */
static sh_err send_all(net *im, uint8_t op, uint64_t total, uint32_t index, const void *p,
                       size_t len, int32_t skip, sh_error *e)
{
    sh_err rc = SH_OK;
    for (int32_t q = 0; q < im->c->size && !rc; q++) {
        if (q == im->c->rank || q == skip)
            continue;
        nng_msg *m = sh__coll_net_frame_bytes(im, SH__COLL_NET_DATA, op, total, index, p, len);
        rc = m ? sh__coll_net_post(im, q, m, e) : sh__coll_net_oom(e);
    }
    return rc;
}

sh_err sh__coll_net_algo_allgather(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e)
{
    net *im = c->impl;
    const uint8_t op = SH__COLL_OP_ALLGATHER;
    const int32_t r = c->rank, N = c->size, S = N - 1, right = mod(r + 1, N), left = mod(r - 1, N);
    uint64_t deadline = call_begin(im, op, bytes);
    uint8_t *o8 = out;
    sh_err rc = SH_OK;
    if (bytes <= ONESHOT_MAX) { /* direct */
        rc = send_all(im, op, bytes, 0, in, bytes, -1, e);
        memmove(o8 + (size_t)r * bytes, in, bytes);
        for (int32_t p = 0; p < N && !rc; p++) {
            if (p == r)
                continue;
            nng_msg *m;
            sh__coll_net_hdr h;
            rc = sh__coll_net_take_data(im, p, deadline, op, bytes, 0, (uint32_t)bytes, bytes, &m,
                                        &h, e);
            if (rc)
                break;
            memcpy(o8 + (size_t)p * bytes, payload(m), bytes);
            sh__coll_net_frame_release(im, m);
        }
        return rc;
    }
    size_t ns = nseg(bytes, SEG_BYTES);
    for (size_t j = 0; j < ns && !rc; j++) {
        size_t k = bytes - j * SEG_BYTES < SEG_BYTES ? bytes - j * SEG_BYTES : SEG_BYTES;
        nng_msg *m = sh__coll_net_frame_bytes(im, SH__COLL_NET_DATA, op, bytes, ring_index(0, j),
                                              (const uint8_t *)in + j * SEG_BYTES, k);
        rc = m ? sh__coll_net_post(im, right, m, e) : sh__coll_net_oom(e);
    }
    if (!rc)
        memmove(o8 + (size_t)r * bytes, in, bytes);
    /* Step t takes rank r - t - 1's part from the left and passes it on. */
    for (int32_t t = 0; t < S && !rc; t++) {
        uint8_t *dst = o8 + (size_t)mod(r - t - 1, N) * bytes;
        for (size_t j = 0; j < ns && !rc; j++) {
            size_t k = bytes - j * SEG_BYTES < SEG_BYTES ? bytes - j * SEG_BYTES : SEG_BYTES;
            nng_msg *m;
            sh__coll_net_hdr h;
            rc = sh__coll_net_take_data(im, left, deadline, op, bytes, ring_index(t, j),
                                        (uint32_t)k, k, &m, &h, e);
            if (rc)
                break;
            memcpy(dst + j * SEG_BYTES, payload(m), k);
            if (t < S - 1) {
                sh__coll_net_frame_forward(im, m, &h, ring_index(t + 1, j));
                rc = sh__coll_net_post(im, right, m, e);
            } else {
                sh__coll_net_frame_release(im, m);
            }
        }
    }
    return rc;
}

/* A broadcast frame's index: the root (so ranks that disagree on it fail) and the segment. */
static uint32_t bcast_index(int32_t root, size_t seg)
{
    return (uint32_t)root << 24 | (uint32_t)seg;
}

sh_err sh__coll_net_algo_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e)
{
    net *im = c->impl;
    const uint8_t op = SH__COLL_OP_BROADCAST;
    const int32_t r = c->rank, N = c->size;
    uint64_t deadline = call_begin(im, op, bytes);
    uint8_t *b8 = buf;
    sh_err rc = SH_OK;
    nng_msg *m;
    sh__coll_net_hdr h;
    if (bytes <= ONESHOT_MAX) { /* direct, every receiver acknowledging */
        if (r == root) {
            rc = send_all(im, op, bytes, bcast_index(root, 0), buf, bytes, -1, e);
            for (int32_t p = 0; p < N && !rc; p++) {
                if (p == r)
                    continue;
                rc = sh__coll_net_take(im, SH__COLL_NET_ACK, p, bcast_index(root, 0), deadline,
                                       "its acknowledgement", &m, &h, e);
                if (rc)
                    break;
                rc = sh__coll_net_expect(im, m, &h, op, bytes, bcast_index(root, 0), 0, 0, e);
                nng_msg_free(m);
            }
            return rc;
        }
        rc = sh__coll_net_take_data(im, root, deadline, op, bytes, bcast_index(root, 0),
                                    (uint32_t)bytes, bytes, &m, &h, e);
        if (rc)
            return rc;
        memcpy(buf, payload(m), bytes);
        sh__coll_net_frame_release(im, m);
        m = sh__coll_net_frame_bytes(im, SH__COLL_NET_ACK, op, bytes, bcast_index(root, 0), NULL,
                                     0);
        return m ? sh__coll_net_post(im, root, m, e) : sh__coll_net_oom(e);
    }
    /* A chain root, root + 1, ..., root - 1, each forwarding a segment as it arrives; the last
     * acknowledges to the root. */
    const int32_t pos = mod(r - root, N), prev = mod(r - 1, N), next = mod(r + 1, N);
    size_t ns = nseg(bytes, SEG_BYTES);
    for (size_t j = 0; j < ns && !rc; j++) {
        size_t k = bytes - j * SEG_BYTES < SEG_BYTES ? bytes - j * SEG_BYTES : SEG_BYTES;
        if (r == root) {
            m = sh__coll_net_frame_bytes(im, SH__COLL_NET_DATA, op, bytes, bcast_index(root, j),
                                         b8 + j * SEG_BYTES, k);
            rc = m ? sh__coll_net_post(im, next, m, e) : sh__coll_net_oom(e);
            continue;
        }
        rc = sh__coll_net_take_data(im, prev, deadline, op, bytes, bcast_index(root, j),
                                    (uint32_t)k, k, &m, &h, e);
        if (rc)
            break;
        memcpy(b8 + j * SEG_BYTES, payload(m), k);
        if (pos < N - 1) {
            sh__coll_net_frame_forward(im, m, &h, bcast_index(root, j));
            rc = sh__coll_net_post(im, next, m, e);
        } else {
            sh__coll_net_frame_release(im, m);
        }
    }
    if (rc)
        return rc;
    if (r == root) {
        rc = sh__coll_net_take(im, SH__COLL_NET_ACK, prev, bcast_index(root, 0), deadline,
                               "the chain's acknowledgement", &m, &h, e);
        if (rc)
            return rc;
        rc = sh__coll_net_expect(im, m, &h, op, bytes, bcast_index(root, 0), 0, 0, e);
        nng_msg_free(m);
        return rc;
    }
    if (pos < N - 1)
        return SH_OK;
    m = sh__coll_net_frame_bytes(im, SH__COLL_NET_ACK, op, bytes, bcast_index(root, 0), NULL, 0);
    return m ? sh__coll_net_post(im, root, m, e) : sh__coll_net_oom(e);
}
