/* The "hello" actor: answers HELLO with this node's identity, greets the peers it is given until
 * each has answered, and runs the cluster key's challenge-response (actors/hello.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "actors/actor_util.h"
#include "actors/hello.h"
#include "runtime/msg.h"
#include "runtime/peers.h"
#include "runtime/proto.h"

#define HELLO_ARENA (16 * 1024)
#define PENDING 16        /* challenges this node answered and may still see a proof for */
#define LOG_EVERY_MS 5000 /* one refusal line per node per this long */
#define TICK_MS 50        /* how often new outgoing connections are looked for (greet_links) */
#define LINK_WAIT_MS 2000 /* an unanswered link greeting delays the front's answer this long */

/* A challenge this node answered: the greeting node's nonce and name, and ours. */
typedef struct pending_challenge {
    uint32_t node;
    uint8_t nf[SH_AUTH_NONCE_LEN], nw[SH_AUTH_NONCE_LEN];
    char name[64];
} pending_challenge;

typedef struct hello_state {
    sh_hello_args a;
    sh_act_decoder dec;
    uint64_t timer;
    bool keyed;
    pending_challenge pend[PENDING];
    uint32_t pend_next;
    uint64_t next_log_ms[SH_HELLO_MAX_NODES]; /* refusal lines, by node id */
    /* greet_links: the greeting over each node's current outgoing connection, by node id
     * (SH_HELLO_MAX_NODES), and the link's up count it was started for. */
    sh_hello_peer *links;
    uint32_t *links_ups;
    uint64_t *links_since_ms;
    uint64_t next_greet_ms;
    uint64_t front_wait_ms; /* when the front's greeting first waited on sources; 0: none */
} hello_state;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* "NAME (node ID)", with the script's name of the id when it is known and differs. */
static void who(const sh_hello_auth *a, uint32_t node, const char *claimed, char *buf, size_t cap)
{
    const char *script = a && a->names && node < a->n_names ? a->names[node] : NULL;
    if (script && claimed && claimed[0] && strcmp(script, claimed))
        snprintf(buf, cap, "'%s' (node %u, which calls itself '%s')", script, (unsigned)node,
                 claimed);
    else
        snprintf(buf, cap, "'%s' (node %u)",
                 script    ? script
                 : claimed ? claimed
                           : "?",
                 (unsigned)node);
}

bool sh__hello_auth_allows(sh_hello_auth *a, sh_runtime *rt, sh_addr src, const char *what)
{
    uint32_t node = sh_addr_node(src);
    if (!a || !a->key || !a->key->set || node == a->self)
        return true;
    if (node < SH_HELLO_MAX_NODES && atomic_load_explicit(&a->ok[node], memory_order_acquire))
        return true;
    uint32_t i = node < SH_HELLO_MAX_NODES ? node : 0;
    uint64_t dropped = atomic_fetch_add_explicit(&a->dropped[i], 1, memory_order_relaxed) + 1;
    uint64_t now = mono_ms(), next = atomic_load_explicit(&a->next_log_ms[i], memory_order_relaxed);
    if (now >= next &&
        atomic_compare_exchange_strong(&a->next_log_ms[i], &next, now + LOG_EVERY_MS)) {
        atomic_store_explicit(&a->dropped[i], 0, memory_order_relaxed);
        char name[160];
        who(a, node, NULL, name, sizeof name);
        sh_runtime_log(rt, SH_LOG_LEVEL_WARN, "auth_refused",
                       "from=\"%s\" what=%s dropped=%" PRIu64
                       " reason=\"the node has not proved the cluster key in HELLO\"",
                       name, what, dropped);
    }
    return false;
}

static void copy_str(char *dst, size_t cap, sh_strv s)
{
    size_t n = s.len < cap - 1 ? s.len : cap - 1;
    memcpy(dst, s.ptr, n);
    dst[n] = '\0';
}

/* Hex strings of a body: they live as long as the body is being encoded. */
typedef struct hexbuf {
    char nonce[2 * SH_AUTH_NONCE_LEN + 1], peer_nonce[2 * SH_AUTH_NONCE_LEN + 1];
    char proof[2 * SH_AUTH_MAC_LEN + 1];
} hexbuf;

static sh_strv strv(const char *s) { return (sh_strv){s, (uint32_t)strlen(s)}; }

static void to_body(const hello_state *s, sh_proto_hello *b)
{
    const sh_hello_ident *id = s->a.self;
    memset(b, 0, sizeof *b);
    b->node = strv(id->node);
    b->version = strv(id->version);
    b->proto = id->proto;
    b->model_size = id->model_size;
    b->model_hash = id->model_hash;
    b->n_blocks = id->n_blocks;
    b->max_seqs = id->max_seqs;
    b->max_tokens = id->max_tokens;
    b->seq_blocks = id->seq_blocks;
    b->link_dtype = id->link_dtype;
    b->kv_dtype = id->kv_dtype;
    // A standby's promotion (another thread) writes stages[] before it raises n_stages.
    b->stages = (sh_u64s){id->stages, (uint32_t)__atomic_load_n(&id->n_stages, __ATOMIC_ACQUIRE)};
    b->slices = (sh_u64s){id->slices, b->stages.n};
    b->keyed = s->keyed;
}

static void from_body(const sh_proto_hello *b, sh_hello_ident *id)
{
    memset(id, 0, sizeof *id);
    copy_str(id->node, sizeof id->node, b->node);
    copy_str(id->version, sizeof id->version, b->version);
    id->proto = b->proto;
    id->model_size = b->model_size;
    id->model_hash = b->model_hash;
    id->n_blocks = b->n_blocks;
    id->max_seqs = b->max_seqs;
    id->max_tokens = b->max_tokens;
    id->seq_blocks = b->seq_blocks;
    id->link_dtype = b->link_dtype;
    id->kv_dtype = b->kv_dtype;
    uint32_t n = b->stages.n < SH_HELLO_MAX_STAGES ? b->stages.n : SH_HELLO_MAX_STAGES;
    for (uint32_t i = 0; i < n; i++)
        memcpy(&id->stages[i], (const uint8_t *)b->stages.ptr + 8 * i, 8);
    for (uint32_t i = 0; i < n && i < b->slices.n; i++)
        memcpy(&id->slices[i], (const uint8_t *)b->slices.ptr + 8 * i, 8);
    id->n_stages = (int32_t)n;
    id->keyed = b->keyed;
}

/* One refusal line per node per LOG_EVERY_MS (loop thread). */
static void log_refusal(sh_actor_ctx *ctx, hello_state *s, uint32_t node, const char *claimed,
                        const char *reason)
{
    uint32_t i = node < SH_HELLO_MAX_NODES ? node : 0;
    uint64_t now = mono_ms();
    if (now < s->next_log_ms[i])
        return;
    s->next_log_ms[i] = now + LOG_EVERY_MS;
    char name[160];
    who(s->a.auth, node, claimed, name, sizeof name);
    sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_WARN, "hello_refused",
                   "from=\"%s\" reason=\"%s\"", name, reason);
}

/* The connection m arrived on proved `node` (runtime/peers.h): its frames may now act as it. */
static void bind_conn(sh_actor_ctx *ctx, const sh_msg *m, uint32_t node)
{
    uint64_t conn = sh__msg_conn(m);
    if (conn && !sh__peers_bind(sh_actor_runtime(ctx), conn, node))
        sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_WARN, "hello_bind_refused",
                       "node=%u reason=\"its connection already proved another node\"",
                       (unsigned)node);
}

static void mark(hello_state *s, uint32_t node)
{
    if (s->a.auth && node < SH_HELLO_MAX_NODES)
        atomic_store_explicit(&s->a.auth->ok[node], 1, memory_order_release);
}

static void finish(hello_state *s, sh_hello_peer *p, sh_hello_verdict v)
{
    p->verdict = v;
    if (v == SH_HELLO_AUTHED)
        mark(s, sh_addr_node(p->addr));
    atomic_store_explicit(&p->answered, 1, memory_order_release);
}

/* Sends peer p our greeting (phase 0) or our proof (phase 1). */
static void send_to(sh_actor_ctx *ctx, hello_state *s, sh_hello_peer *p)
{
    sh_proto_hello b;
    hexbuf hx;
    to_body(s, &b);
    if (s->keyed) {
        sh__auth_hex(p->nonce, sizeof p->nonce, hx.nonce);
        b.nonce = strv(hx.nonce);
    }
    if (p->phase == 1) {
        b.phase = 1;
        sh__auth_hex(p->peer_nonce, sizeof p->peer_nonce, hx.peer_nonce);
        sh__auth_hex(p->proof, sizeof p->proof, hx.proof);
        b.peer_nonce = strv(hx.peer_nonce);
        b.proof = strv(hx.proof);
    }
    uint64_t session = 0;
    // A failed send (the link's queue is full, or not up yet) is retried at the next tick.
    if (sh_request_with(ctx, p->addr, SH_MSG_HELLO, sh__proto_encode, &b, s->a.retry_ms, &session,
                        NULL) == SH_OK)
        p->session = session;
}

/* Asks every peer that has not answered yet. Our proof after a wrong one of theirs is sent once
 * only (on_answer): its verdict stands with or without an answer. */
static void greet(sh_actor_ctx *ctx, hello_state *s)
{
    for (int32_t i = 0; i < s->a.n_peers; i++) {
        sh_hello_peer *p = &s->a.peers[i];
        if (atomic_load_explicit(&p->answered, memory_order_relaxed) ||
            (p->phase == 1 && p->pending != SH_HELLO_AUTHED))
            continue;
        send_to(ctx, s, p);
    }
}

/* greet_links: starts a greeting over each outgoing connection that came up since the last look
 * (so that the node at its end binds it to this node: runtime/peers.h), and asks again, every
 * retry_ms, those that have not answered. The front is left out: it binds this node's
 * connection from the answers to its own greetings. */
static void greet_links(sh_actor_ctx *ctx, hello_state *s, bool retry)
{
    sh_runtime *rt = sh_actor_runtime(ctx);
    sh_addr me = sh_actor_self(ctx);
    uint64_t now = mono_ms();
    for (uint32_t n = 1; n < SH_HELLO_MAX_NODES; n++) {
        if (n == sh_addr_node(me) || n == s->a.front)
            continue;
        bool up = false;
        uint32_t ups = sh__peers_link_ups(rt, n, &up);
        sh_hello_peer *p = &s->links[n];
        if (up && ups != s->links_ups[n]) {
            memset(p, 0, sizeof *p);
            p->addr = sh_addr_make(n, sh_addr_actor(me));
            if (s->keyed && sh__auth_random(p->nonce, SH_AUTH_NONCE_LEN, NULL) != SH_OK)
                continue; /* tried again at the next tick */
            s->links_ups[n] = ups;
            s->links_since_ms[n] = now;
            send_to(ctx, s, p);
        } else if (retry && up && s->links_ups[n] &&
                   !atomic_load_explicit(&p->answered, memory_order_relaxed) &&
                   !(p->phase == 1 && p->pending != SH_HELLO_AUTHED)) {
            send_to(ctx, s, p);
        }
    }
}

static sh_err hello_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    hello_state *s = state;
    s->a = *(const sh_hello_args *)arg;
    s->keyed = s->a.key && s->a.key->set;
    if (!s->a.retry_ms)
        s->a.retry_ms = 500;
    for (int32_t i = 0; s->keyed && i < s->a.n_peers; i++) {
        sh_err rc = sh__auth_random(s->a.peers[i].nonce, SH_AUTH_NONCE_LEN, NULL);
        if (rc)
            return rc;
    }
    sh_err rc = sh__act_decoder_init(&s->dec, HELLO_ARENA);
    if (rc)
        return rc;
    if (s->a.greet_links) {
        s->links = calloc(SH_HELLO_MAX_NODES, sizeof *s->links);
        s->links_ups = calloc(SH_HELLO_MAX_NODES, sizeof *s->links_ups);
        s->links_since_ms = calloc(SH_HELLO_MAX_NODES, sizeof *s->links_since_ms);
        if (!s->links || !s->links_ups || !s->links_since_ms) {
            free(s->links);
            free(s->links_ups);
            free(s->links_since_ms);
            sh__act_decoder_fini(&s->dec);
            return SH_ENOMEM;
        }
    }
    if (s->a.n_peers > 0)
        greet(ctx, s);
    s->next_greet_ms = mono_ms() + s->a.retry_ms;
    if (s->links)
        rc = sh_actor_timer_start(ctx, TICK_MS, TICK_MS, 1, &s->timer);
    else if (s->a.n_peers > 0)
        rc = sh_actor_timer_start(ctx, s->a.retry_ms, s->a.retry_ms, 1, &s->timer);
    return rc;
}

static void hello_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)tag;
    hello_state *s = state;
    uint64_t now = mono_ms();
    bool retry = !s->links || now >= s->next_greet_ms;
    if (retry) {
        s->next_greet_ms = now + s->a.retry_ms;
        greet(ctx, s);
    }
    if (s->links)
        greet_links(ctx, s, retry);
}

/* An answer to one of our requests (the greeting's or the proof's). */
static void on_answer(sh_actor_ctx *ctx, hello_state *s, sh_hello_peer *p, const sh_msg *m,
                      const sh_proto_hello *b)
{
    if (atomic_load_explicit(&p->answered, memory_order_relaxed))
        return;
    if (p->phase == 1) {
        if (b->phase != 1)
            return; /* a late answer to a greeting */
        finish(s, p,
               p->pending != SH_HELLO_AUTHED ? p->pending
               : b->auth_ok                  ? SH_HELLO_AUTHED
                                             : SH_HELLO_REFUSED);
        return;
    }
    from_body(b, &p->got);
    if (!s->keyed) {
        if (!b->keyed) /* an open cluster: the answer's connection is the node it answers for */
            bind_conn(ctx, m, sh_addr_node(p->addr));
        finish(s, p, b->keyed ? SH_HELLO_SELF_UNKEYED : SH_HELLO_OPEN);
        return;
    }
    if (!b->keyed) {
        finish(s, p, SH_HELLO_PEER_UNKEYED);
        return;
    }
    // Check its proof, then send ours (even when its proof is wrong, so that it logs the refusal
    // too); the verdict is given when our proof is answered.
    uint8_t theirs[SH_AUTH_MAC_LEN], want[SH_AUTH_MAC_LEN];
    bool ok = sh__auth_unhex(b->nonce.ptr, b->nonce.len, p->peer_nonce, sizeof p->peer_nonce) &&
              sh__auth_unhex(b->proof.ptr, b->proof.len, theirs, sizeof theirs) &&
              sh__auth_proof(s->a.key, 'W', p->nonce, p->peer_nonce, s->a.self->node, p->got.node,
                             want) == SH_OK &&
              sh__auth_equal(theirs, want, sizeof want);
    if (sh__auth_proof(s->a.key, 'F', p->nonce, p->peer_nonce, s->a.self->node, p->got.node,
                       p->proof) != SH_OK)
        ok = false;
    p->pending = ok ? SH_HELLO_AUTHED : SH_HELLO_WRONG_KEY;
    p->phase = 1;
    if (ok) /* its proof over our fresh nonce came on this connection */
        bind_conn(ctx, m, sh_addr_node(p->addr));
    if (!ok)
        log_refusal(ctx, s, sh_addr_node(p->addr), p->got.node, "wrong cluster key");
    p->session = 0;
    send_to(ctx, s, p);
    if (!ok && !p->session) /* not sent: judge it now */
        finish(s, p, p->pending);
}

/* A greeting (phase 0) or a greeting node's proof (phase 1) from another node: m is the request. */
static void on_request(sh_actor_ctx *ctx, hello_state *s, const sh_msg *m, const sh_proto_hello *b)
{
    const sh_msg_hdr *h = sh_msg_header(m);
    uint32_t node = sh_addr_node(h->src);
    char claimed[64];
    copy_str(claimed, sizeof claimed, b->node);
    sh_proto_hello r;
    hexbuf hx;
    to_body(s, &r);
    if (b->phase == 1) {
        r.phase = 1;
        const pending_challenge *pc = NULL;
        uint8_t nw[SH_AUTH_NONCE_LEN], theirs[SH_AUTH_MAC_LEN], want[SH_AUTH_MAC_LEN];
        if (s->keyed && sh__auth_unhex(b->peer_nonce.ptr, b->peer_nonce.len, nw, sizeof nw))
            for (uint32_t i = 0; i < PENDING && !pc; i++)
                if (s->pend[i].node == node && sh__auth_equal(s->pend[i].nw, nw, sizeof nw))
                    pc = &s->pend[i];
        r.auth_ok = pc && sh__auth_unhex(b->proof.ptr, b->proof.len, theirs, sizeof theirs) &&
                    sh__auth_proof(s->a.key, 'F', pc->nf, pc->nw, pc->name, s->a.self->node,
                                   want) == SH_OK &&
                    sh__auth_equal(theirs, want, sizeof want);
        if (r.auth_ok) {
            if (node >= SH_HELLO_MAX_NODES || !s->a.auth || !s->a.auth->ok[node])
                sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_INFO, "hello_authenticated",
                               "from=%s node=%u", claimed, (unsigned)node);
            mark(s, node);
            bind_conn(ctx, m, node);
        } else {
            log_refusal(ctx, s, node, claimed,
                        !s->keyed ? "it sent a key proof and this node has no cluster key"
                        : pc      ? "wrong cluster key"
                                  : "its key proof answers no challenge of this node");
        }
        (void)sh_reply_with(ctx, m, SH_MSG_HELLO, sh__proto_encode, &r, NULL);
        return;
    }
    // A node that greets peers of its own (a worker proving the key to the node its ACT comes
    // from) answers only once they all answered: the front's join then means the whole
    // pipeline is authenticated. The greeting node asks again.
    // A worker delays only its front's greeting (the join's meaning above); the greetings of
    // other nodes are answered at once, so that no two nodes wait on each other. Its greetings over
    // new outgoing connections (greet_links) count too, while they are young.
    if (!s->a.front || node == s->a.front) {
        bool wait = false;
        for (int32_t i = 0; i < s->a.n_peers && !wait; i++)
            wait = !atomic_load_explicit(&s->a.peers[i].answered, memory_order_relaxed);
        uint64_t now = mono_ms();
        for (uint32_t n = 1; s->links && n < SH_HELLO_MAX_NODES && !wait; n++) {
            bool up = false;
            (void)sh__peers_link_ups(sh_actor_runtime(ctx), n, &up);
            wait = s->links_ups[n] && up && n != node &&
                   !atomic_load_explicit(&s->links[n].answered, memory_order_relaxed) &&
                   now < s->links_since_ms[n] + LINK_WAIT_MS;
        }
        for (int32_t i = 0; s->a.front && i < s->a.n_sources && !wait; i++) {
            if (!s->front_wait_ms)
                s->front_wait_ms = now;
            wait = !sh__peers_node_bound(sh_actor_runtime(ctx), s->a.sources[i]) &&
                   now < s->front_wait_ms + LINK_WAIT_MS;
        }
        if (wait) {
            greet(ctx, s);
            return;
        }
        s->front_wait_ms = 0;
    }
    // An open cluster: the greeting's connection is the node it names (nothing is proved).
    if (!s->keyed && !b->keyed)
        bind_conn(ctx, m, node);
    sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_INFO, "hello", "from=%s version=%.*s",
                   claimed, (int)b->version.len, b->version.ptr);
    if (s->keyed && !b->keyed) {
        log_refusal(ctx, s, node, claimed,
                    "it has no cluster key and this node has one (give both the same key)");
    } else if (!s->keyed && b->keyed) {
        log_refusal(ctx, s, node, claimed,
                    "it has a cluster key and this node has none (give both the same key)");
    } else if (s->keyed) {
        pending_challenge *pc = &s->pend[s->pend_next++ % PENDING];
        uint8_t proof[SH_AUTH_MAC_LEN];
        if (!sh__auth_unhex(b->nonce.ptr, b->nonce.len, pc->nf, sizeof pc->nf) ||
            sh__auth_random(pc->nw, sizeof pc->nw, NULL) != SH_OK ||
            sh__auth_proof(s->a.key, 'W', pc->nf, pc->nw, claimed, s->a.self->node, proof)) {
            pc->node = 0;
            log_refusal(ctx, s, node, claimed, "its greeting carries no valid challenge");
        } else {
            pc->node = node;
            memcpy(pc->name, claimed, sizeof pc->name);
            sh__auth_hex(pc->nw, sizeof pc->nw, hx.nonce);
            sh__auth_hex(proof, sizeof proof, hx.proof);
            r.nonce = strv(hx.nonce);
            r.proof = strv(hx.proof);
        }
    }
    (void)sh_reply_with(ctx, m, SH_MSG_HELLO, sh__proto_encode, &r, NULL);
}

/* A watchdog's heartbeat: PONG back to its sender with this process's resident memory. Answered
 * on this loop, which runs no model work, so a busy stage never delays it. */
static void answer_ping(sh_actor_ctx *ctx, hello_state *s, const sh_msg *m)
{
    sh_proto_body body;
    sh_error e = {0};
    if (sh__act_decode(&s->dec, m, &body, &e))
        return;
    sh_proto_pong p = {.seq = body.ping.seq,
                       .sent_us = body.ping.sent_us,
                       .health = SH_PROTO_HEALTH_OK,
                       .mem_bytes = sh__act_rss_bytes()};
    (void)sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), sh_msg_header(m)->src,
                       SH_MSG_PONG, 0, &p, &e);
}

/* CONTROL from the front: SHUTDOWN asks this node to restart (its watchdog found it over its
 * memory budget); PROMOTE asks a standby to take over stages. */
static void on_control(sh_actor_ctx *ctx, hello_state *s, const sh_msg *m)
{
    sh_addr src = sh_msg_header(m)->src;
    uint32_t node = sh_addr_node(src);
    sh_proto_body body;
    sh_error e = {0};
    if (sh__act_decode(&s->dec, m, &body, &e))
        return;
    bool shutdown = body.control.op == SH_PROTO_CONTROL_OP_SHUTDOWN && s->a.on_shutdown;
    bool promote = body.control.op == SH_PROTO_CONTROL_OP_PROMOTE && s->a.on_promote;
    if (!s->a.front || node != s->a.front || !(shutdown || promote) ||
        (s->a.auth && !sh__hello_auth_allows(s->a.auth, sh_actor_runtime(ctx), src, "CONTROL"))) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "hello_control_dropped", "from_node=%u op=%u",
                     (unsigned)node, (unsigned)body.control.op);
        return;
    }
    if (promote) {
        int32_t idx[SH_HELLO_MAX_STAGES], rank[SH_HELLO_MAX_STAGES];
        uint32_t n = 0;
        for (uint32_t i = 0; i < body.control.targets.n && n < SH_HELLO_MAX_STAGES; i++) {
            uint64_t t = sh_u64s_at(body.control.targets, i); /* stage | rank << 32 */
            idx[n] = (int32_t)(uint32_t)t;
            rank[n++] = (int32_t)(uint32_t)(t >> 32);
        }
        s->a.on_promote(s->a.promote_user, idx, rank, (int32_t)n);
        return;
    }
    char why[256];
    snprintf(why, sizeof why, "%.*s", (int)body.control.arg.len,
             body.control.arg.ptr ? body.control.arg.ptr : "");
    s->a.on_shutdown(s->a.shutdown_user, why);
}

static sh_msg_fate hello_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    hello_state *s = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type == SH_MSG_ERROR) {
        // A request of ours that timed out or was undeliverable: the timer asks again. Our
        // proof after a wrong one of theirs is sent once: its verdict stands without an answer.
        for (int32_t i = 0; i < s->a.n_peers; i++) {
            sh_hello_peer *p = &s->a.peers[i];
            if (h->session && h->session == p->session && p->phase == 1 &&
                p->pending != SH_HELLO_AUTHED &&
                !atomic_load_explicit(&p->answered, memory_order_relaxed))
                finish(s, p, p->pending);
        }
        for (uint32_t n = 1; s->links && h->session && n < SH_HELLO_MAX_NODES; n++) {
            sh_hello_peer *p = &s->links[n];
            if (h->session == p->session && p->phase == 1 && p->pending != SH_HELLO_AUTHED &&
                !atomic_load_explicit(&p->answered, memory_order_relaxed))
                finish(s, p, p->pending);
        }
        return SH_MSG_FATE_DONE;
    }
    if (h->type == SH_MSG_PING) {
        answer_ping(ctx, s, m);
        return SH_MSG_FATE_DONE;
    }
    if (h->type == SH_MSG_CONTROL) {
        on_control(ctx, s, m);
        return SH_MSG_FATE_DONE;
    }
    if (h->type != SH_MSG_HELLO)
        return SH_MSG_FATE_DONE;
    sh_proto_body body;
    sh_error e = {0};
    if (sh__act_decode(&s->dec, m, &body, &e)) {
        sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_WARN, "hello_bad", "err=\"%s\"", e.msg);
        return SH_MSG_FATE_DONE;
    }
    for (int32_t i = 0; i < s->a.n_peers; i++) {
        sh_hello_peer *p = &s->a.peers[i];
        if (h->session && h->session == p->session && h->src == p->addr) {
            on_answer(ctx, s, p, m, &body.hello);
            return SH_MSG_FATE_DONE;
        }
    }
    uint32_t from = sh_addr_node(h->src);
    if (s->links && h->session && from < SH_HELLO_MAX_NODES && s->links_ups[from] &&
        h->session == s->links[from].session && h->src == s->links[from].addr) {
        on_answer(ctx, s, &s->links[from], m, &body.hello);
        return SH_MSG_FATE_DONE;
    }
    if (!h->session)
        return SH_MSG_FATE_DONE; /* a late or stray answer */
    on_request(ctx, s, m, &body.hello);
    return SH_MSG_FATE_DONE;
}

static void hello_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    hello_state *s = state;
    sh__act_decoder_fini(&s->dec);
    free(s->links);
    free(s->links_ups);
    free(s->links_since_ms);
}

const sh_actor_vtable sh__hello_vtable = {
    .name = "hello",
    .state_size = sizeof(hello_state),
    .init = hello_init,
    .handle = hello_handle,
    .stop = hello_stop,
    .timer = hello_timer,
};
