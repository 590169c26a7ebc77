/* The network collectives' join handshake (SH_COLL_NET; runtime/coll_net.c describes it). */
#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "runtime/coll_net_int.h"

/* ---- Join ------------------------------------------------------------------------------- */

/* A join frame (HELLO or PROOF) to rank dst. */
sh_err sh__coll_net_join_send(net *im, uint8_t type, int32_t dst, const uint8_t *nonce, sh_error *e)
{
    sh_coll *c = im->c;
    size_t plen = type == SH__COLL_NET_HELLO ? NONCE : NONCE + MAC;
    nng_msg *m = sh__coll_net_frame_new(im, plen);
    if (!m)
        return sh__coll_net_oom(e);
    uint8_t *body = nng_msg_body(m), *p = payload(m);
    sh__coll_net_hdr h = {.type = type,
                          .compress = (uint8_t)im->cmp,
                          .epoch = c->epoch,
                          .src = (uint16_t)c->rank,
                          .size = (uint16_t)c->size,
                          .total = c->max_bytes,
                          .index = (uint32_t)dst};
    memcpy(p, nonce, NONCE);
    if (type == SH__COLL_NET_PROOF) {
        memset(p + NONCE, 0, MAC);
        sh__coll_net_seal(&h, body, plen);
        if (im->key) {
            uint8_t msg[sizeof JOIN_TAG + 40 + NONCE];
            memcpy(msg, JOIN_TAG, sizeof JOIN_TAG);
            memcpy(msg + sizeof JOIN_TAG, body, 40);
            memcpy(msg + sizeof JOIN_TAG + 40, nonce, NONCE);
            if (sh__auth_hmac(im->key, im->key_len, msg, sizeof msg, p + NONCE) != SH_OK) {
                nng_msg_free(m);
                return sh__error_set(e, SH_EIO, "coll: HMAC failed");
            }
        }
    }
    sh__coll_net_seal(&h, body, plen);
    sh_err rc = sh__coll_net_post(im, dst, m, e);
    /* Join frames are not the calls' traffic. */
    atomic_fetch_sub_explicit(&c->bytes_wire, rc ? 0 : SH__COLL_NET_HDR + plen,
                              memory_order_relaxed);
    return rc;
}

/* Whether a PROOF's MAC is right for this rank's nonce. */
static bool proof_valid(net *im, nng_msg *m)
{
    if (!im->key)
        return true;
    uint8_t msg[sizeof JOIN_TAG + 40 + NONCE], mac[MAC];
    memcpy(msg, JOIN_TAG, sizeof JOIN_TAG);
    memcpy(msg + sizeof JOIN_TAG, nng_msg_body(m), 40);
    memcpy(msg + sizeof JOIN_TAG + 40, im->nonce, NONCE);
    return sh__auth_hmac(im->key, im->key_len, msg, sizeof msg, mac) == SH_OK &&
           sh__auth_equal(mac, payload(m) + NONCE, MAC);
}

/* Lists the ranks (and URLs) of mask into buf. */
static void list_ranks(net *im, uint64_t mask, char *buf, size_t cap)
{
    size_t k = 0;
    buf[0] = 0;
    for (int32_t p = 0; p < im->c->size && k + 1 < cap; p++)
        if (mask >> p & 1u)
            k +=
                (size_t)snprintf(buf + k, cap - k, "%s%d (%s)", k ? ", " : "", (int)p, im->urls[p]);
}

/* The statistics of the dialer or listener (`kind`) with that id among NNG's (a scope per object
 * under the root, its "id" among its children). NNG 1.5.2's nng_stat_find_dialer and
 * nng_stat_find_listener return the first object of the kind whatever its id. */
static nng_stat *stat_of(nng_stat *all, const char *kind, int id)
{
    for (nng_stat *s = nng_stat_child(all); s; s = nng_stat_next(s)) {
        if (nng_stat_type(s) != NNG_STAT_SCOPE || strcmp(nng_stat_name(s), kind) != 0)
            continue;
        nng_stat *i = nng_stat_find(s, "id");
        if (i && nng_stat_type(i) == NNG_STAT_ID && nng_stat_value(i) == (uint64_t)id)
            return s;
    }
    return NULL;
}

uint64_t sh__coll_net_tls_auth(net *im, int32_t p)
{
    nng_stat *all = NULL;
    if (!im->tls_client || nng_stats_get(&all) != 0)
        return 0;
    nng_stat *st = p >= 0 ? stat_of(all, "dialer", nng_dialer_id(im->links[p].dialer))
                          : stat_of(all, "listener", nng_listener_id(im->listener));
    st = st ? nng_stat_find(st, "auth") : NULL;
    uint64_t n = st ? nng_stat_value(st) : 0;
    nng_stats_free(all);
    return n;
}

/* On tls+tcp://, what the join's timeout adds: the failed TLS handshakes (a certificate the other
 * side's CA did not sign, or none) with the ranks of `miss` (this rank dialling them) and at this
 * rank's listener, which NNG reports nowhere else. */
static void tls_failures(net *im, uint64_t miss, char *buf, size_t cap)
{
    buf[0] = 0;
    if (!im->tls_client)
        return;
    size_t k = 0;
    for (int32_t p = 0; p < im->c->size && k + 1 < cap; p++) {
        uint64_t n = miss >> p & 1u ? im->tls_auth[p] + sh__coll_net_tls_auth(im, p) : 0;
        if (n)
            k += (size_t)snprintf(buf + k, cap - k, "%s%llu dialling rank %d", k ? ", " : "",
                                  (unsigned long long)n, (int)p);
    }
    uint64_t n = im->tls_auth_listen + sh__coll_net_tls_auth(im, -1);
    if (n && k + 1 < cap)
        k += (size_t)snprintf(buf + k, cap - k, "%s%llu at this rank's listener", k ? ", " : "",
                              (unsigned long long)n);
    if (k && k + 1 < cap)
        snprintf(buf + k, cap - k,
                 " (each rank's certificate must be signed by the CA every rank trusts)");
}

/* Waits until every rank has proved itself (HELLO out, PROOF back), answering their HELLOs.
 *
 * Re-creating a group at once on the same URLs (the stage does after a failure) meets two faults
 * of NNG 1.5.2: a connection this rank's new link made just as the peer's previous incarnation
 * closed its listener can stay accepted but never read (push0 keeps sending into it), and this
 * rank's new listener can stop taking connections. So, while create waits: a link is opened
 * afresh (sh__coll_net_redial) when the peer cannot have joined over it yet, i.e. the peer still
 * says HELLO REDIAL_NS after this rank first answered it (the PROOFs do not get through), or
 * nothing came from the peer for 2 * REDIAL_NS; and while no peer has joined, the listener is
 * opened afresh (sh__coll_net_relisten) when a peer whose link is up has not been heard from for
 * 2 * REDIAL_NS. test_coll_net's recreate case forms 50 groups in a row on the same URLs. */
sh_err sh__coll_net_join(net *im, uint64_t deadline, sh_error *e)
{
    sh_coll *c = im->c;
    uint64_t all = c->size == 64 ? ~0ull : (1ull << c->size) - 1, joined = 1ull << c->rank;
    uint64_t answered[SH_COLL_MAX_RANKS] = {0}, heard[SH_COLL_MAX_RANKS] = {0};
    uint64_t dialed[SH_COLL_MAX_RANKS], listened = sh__coll_net_now_ns();
    for (int32_t p = 0; p < c->size; p++)
        dialed[p] = sh__coll_net_now_ns();
    for (int32_t p = 0; p < c->size; p++) {
        if (p == c->rank)
            continue;
        sh_err rc = sh__coll_net_join_send(im, SH__COLL_NET_HELLO, p, im->nonce, e);
        if (rc)
            return rc;
    }
    uint64_t resend = sh__coll_net_now_ns() + HELLO_EVERY_NS;
    while (joined != all) {
        nng_msg *m;
        sh__coll_net_hdr h;
        int rv = sh__coll_net_recv_one(im, deadline < resend ? deadline : resend, &m);
        if (rv == NNG_ETIMEDOUT && sh__coll_net_now_ns() < deadline) {
            /* A HELLO can be lost: one that reached a peer's previous incarnation (the same
             * URL, before it closed) is gone with it. Say it again to every rank that has not
             * answered, unless the last one is still waiting for a connection. */
            for (int32_t p = 0; p < c->size; p++) {
                if (joined >> p & 1u)
                    continue;
                uint64_t now = sh__coll_net_now_ns();
                if (!heard[p] && now - dialed[p] > 2ull * REDIAL_NS) {
                    sh_err rc = sh__coll_net_redial(im, p, e);
                    if (rc)
                        return rc;
                    dialed[p] = now;
                }
                pthread_mutex_lock(&im->links[p].mu);
                bool busy = im->links[p].sending;
                pthread_mutex_unlock(&im->links[p].mu);
                sh_err rc =
                    busy ? SH_OK : sh__coll_net_join_send(im, SH__COLL_NET_HELLO, p, im->nonce, e);
                if (rc)
                    return rc;
            }
            /* Our listener may be wedged (no peer's connection gets through): a peer we have
             * not heard from for 2 * REDIAL_NS though our link to it is up. Listening afresh is
             * safe while no peer has joined over it. */
            uint64_t now = sh__coll_net_now_ns();
            bool wedged = false;
            for (int32_t p = 0; p < c->size; p++) {
                if (p == c->rank || heard[p] || now - listened < 2ull * REDIAL_NS)
                    continue;
                pthread_mutex_lock(&im->links[p].mu);
                wedged |= im->links[p].pipes > 0;
                pthread_mutex_unlock(&im->links[p].mu);
            }
            if (wedged && joined == 1ull << c->rank) {
                sh_err rc = sh__coll_net_relisten(im, e);
                if (rc)
                    return rc;
                listened = now;
            }
            resend = sh__coll_net_now_ns() + HELLO_EVERY_NS;
            continue;
        }
        if (rv == NNG_ETIMEDOUT) {
            char miss[1024], bad[512] = "", tls[400];
            list_ranks(im, all & ~joined, miss, sizeof miss);
            tls_failures(im, all & ~joined, tls, sizeof tls);
            if (im->bad_key) {
                char who[400];
                list_ranks(im, im->bad_key, who, sizeof who);
                snprintf(bad, sizeof bad,
                         "; the join proof of rank %s failed the cluster key check", who);
            }
            return sh__error_set(e, SH_ETIMEDOUT,
                                 "coll: rank %d: rank %s did not join within %d ms%s%s%s%s",
                                 (int)c->rank, miss, (int)c->timeout_ms, bad,
                                 im->other_epoch ? "; frames of another epoch were dropped" : "",
                                 tls[0] ? "; TLS handshakes failed: " : "", tls);
        }
        if (rv)
            return sh__error_set(e, SH_EIO, "coll: rank %d: receive failed: %s", (int)c->rank,
                                 nng_strerror(rv));
        if (!sh__coll_net_open(nng_msg_body(m), nng_msg_len(m), &h)) {
            sh__coll_net_drop(im, m, DROP_BAD, -1);
            continue;
        }
        if (h.epoch != c->epoch) {
            im->other_epoch++;
            /* The peer is there, in another epoch: its link works, so no redial toward it (a
             * redial just before the create gives up can leave NNG 1.5.2's nng_close of that
             * link hanging: test_coll_net wrong_epoch, 5 runs in 50 under load). */
            if (h.src < c->size && h.src != c->rank)
                heard[h.src] = sh__coll_net_now_ns();
        }
        if (h.type == SH__COLL_NET_HELLO && h.epoch == c->epoch && h.src < c->size &&
            h.src != c->rank && payload_len(m) == NONCE) {
            uint64_t now = sh__coll_net_now_ns();
            heard[h.src] = now;
            if (!answered[h.src]) {
                answered[h.src] = now;
            } else if (now - answered[h.src] > REDIAL_NS && !(im->bad_key >> h.src & 1u)) {
                /* Our PROOFs do not get through. Not when the peer's own PROOF failed the key
                 * check: the keys differ, the link is fine, and closing a tls+tcp:// link while
                 * it sends can hang in NNG 1.5.2's nng_close (test_coll_net_tls wrong_key: 3 runs
                 * in 27 under load hung there, in this redial). */
                sh_err rc = sh__coll_net_redial(im, h.src, e);
                if (!rc && !(joined >> h.src & 1u))
                    rc = sh__coll_net_join_send(im, SH__COLL_NET_HELLO, h.src, im->nonce, e);
                if (rc) {
                    nng_msg_free(m);
                    return rc;
                }
                answered[h.src] = now;
                dialed[h.src] = now;
            }
            sh_err rc = sh__coll_net_join_send(im, SH__COLL_NET_PROOF, h.src, payload(m), e);
            nng_msg_free(m);
            if (rc)
                return rc;
            continue;
        }
        if (h.type == SH__COLL_NET_PROOF && h.epoch == c->epoch && h.src < c->size &&
            h.src != c->rank && h.index == (uint32_t)c->rank && payload_len(m) == NONCE + MAC) {
            if (!sh__auth_equal(payload(m), im->nonce, NONCE)) { /* an answer to another create */
                sh__coll_net_drop(im, m, DROP_OLD, h.src);
                continue;
            }
            if (!proof_valid(im, m)) {
                im->bad_key |= 1ull << h.src;
                sh__coll_net_drop(im, m, DROP_KEY, h.src);
                continue;
            }
            uint32_t pipe = (uint32_t)nng_pipe_id(nng_msg_get_pipe(m));
            nng_msg_free(m);
            if (h.size != c->size || h.total != c->max_bytes || h.compress != (uint8_t)im->cmp)
                return sh__error_set(
                    e, SH_EPROTO,
                    "coll: rank %d (%s) joined with size %u, max_bytes %llu, compression %u; "
                    "rank %d has %d, %zu, %u",
                    (int)h.src, im->urls[h.src], (unsigned)h.size, (unsigned long long)h.total,
                    (unsigned)h.compress, (int)c->rank, (int)c->size, c->max_bytes,
                    (unsigned)im->cmp);
            atomic_store(&im->pipe_of[h.src], pipe);
            joined |= 1ull << h.src;
            continue;
        }
        /* A fast peer's first calls, or anything else. */
        if (!sh__coll_net_frame_check(im, m, &h))
            continue;
        if (h.type >= SH__COLL_NET_DATA && h.seq >= 1 && h.seq <= AHEAD)
            sh__coll_net_stash_put(im, m, &h);
        else
            sh__coll_net_drop(im, m, h.seq > AHEAD ? DROP_AHEAD : DROP_RANK, h.src);
    }
    return SH_OK;
}
