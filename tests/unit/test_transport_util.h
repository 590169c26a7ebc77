/* Helpers shared by the transport and fault tests: echo, sink and requester actors. */
#ifndef SH_TEST_TRANSPORT_UTIL_H
#define SH_TEST_TRANSPORT_UTIL_H

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "shoal/transport.h"
#include "test_runtime_util.h"

/* Answers every PING with a PONG carrying the same body; errors (gone requesters) ignored. */
static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    if (sh_msg_header(m)->type == SH_MSG_PING && sh_msg_header(m)->session != 0) {
        size_t n = 0;
        const void *b = sh_msg_body(m, &n);
        (void)sh_reply(ctx, m, SH_MSG_PONG, b, n, NULL);
    }
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

/* Records the sequence numbers it receives, in order. */
typedef struct sink_log {
    _Atomic long n;
    _Atomic long out_of_order;
    uint32_t last[8]; /* per sender (who < 8): last seq + 1 */
} sink_log;

static sh_err sink_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    *(sink_log **)state = arg;
    return SH_OK;
}
static sh_msg_fate sink_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    sink_log *l = *(sink_log **)state;
    uint32_t who, seq;
    body_read(m, &who, &seq);
    if (who < 8) {
        if (seq != l->last[who])
            atomic_fetch_add(&l->out_of_order, 1);
        l->last[who] = seq + 1;
    }
    atomic_fetch_add(&l->n, 1);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable sink_vt = {
    .name = "sink", .state_size = sizeof(sink_log *), .init = sink_init, .handle = sink_handle};

/* Sends `n` requests (PING, who = 1, seq i) to `peer` at init, counts the answers. */
typedef struct req_cfg {
    sh_addr peer;
    uint32_t n;
    uint32_t deadline_ms;
    _Atomic long answers, pongs, timeouts, errors, in_order;
    uint32_t next_seq;
} req_cfg;

static sh_err req_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    req_cfg *c = arg;
    *(req_cfg **)state = c;
    for (uint32_t i = 0; i < c->n; i++) {
        uint8_t b[13];
        body_make(b, 1, i);
        uint64_t s;
        sh_err err = sh_request(ctx, c->peer, SH_MSG_PING, b, sizeof b, c->deadline_ms, &s, NULL);
        if (err) {
            atomic_fetch_add(&c->errors, 1);
            atomic_fetch_add(&c->answers, 1);
        }
    }
    return SH_OK;
}
static sh_msg_fate req_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    req_cfg *c = *(req_cfg **)state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type == SH_MSG_PONG) {
        uint32_t who, seq;
        body_read(m, &who, &seq);
        if (seq == c->next_seq)
            atomic_fetch_add(&c->in_order, 1);
        c->next_seq = seq + 1;
        atomic_fetch_add(&c->pongs, 1);
    } else if (h->type == SH_MSG_ERROR) {
        if (sh_msg_error_code(m) == SH_ETIMEDOUT)
            atomic_fetch_add(&c->timeouts, 1);
        else
            atomic_fetch_add(&c->errors, 1);
    }
    atomic_fetch_add(&c->answers, 1);
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable req_vt = {
    .name = "req", .state_size = sizeof(req_cfg *), .init = req_init, .handle = req_handle};

/* Spawns a requester on rt and waits for all its answers (or ms). Returns the pongs. */
static inline long ping_many(sh_runtime *rt, sh_addr peer, uint32_t n, uint32_t deadline_ms,
                             unsigned ms, req_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->peer = peer;
    c->n = n;
    c->deadline_ms = deadline_ms;
    sh_addr a;
    if (sh_actor_spawn(rt, "req", c, SH_ACTOR_LOOP_ANY, &a, NULL) != SH_OK)
        return -1;
    wait_ge(&c->answers, (long)n, ms);
    sh_actor_stop(rt, a);
    sleep_ms(20); /* let the stop land before c goes out of scope */
    return atomic_load(&c->pongs);
}

/* Waits until node's link is UP with at least `ups` connections made. */
static inline int wait_link_up(sh_transport *tp, uint32_t node, uint64_t ups, unsigned ms)
{
    uint64_t end = now_ms() + ms;
    sh_transport_link l;
    while (now_ms() < end) {
        if (sh_transport_link_get(tp, node, &l) == SH_OK && l.state == SH_LINK_STATE_UP &&
            l.ups >= ups)
            return 1;
        sleep_ms(5);
    }
    return 0;
}

/* Waits until node's link is in `state`; returns 1, or 0 after ms. *out gets the last snapshot. */
static inline int wait_link_state(sh_transport *tp, uint32_t node, sh_link_state state, unsigned ms,
                                  sh_transport_link *out)
{
    uint64_t end = now_ms() + ms;
    do {
        if (sh_transport_link_get(tp, node, out) == SH_OK && out->state == state)
            return 1;
        sleep_ms(2);
    } while (now_ms() < end);
    return 0;
}

/* A runtime of two loops with a transport (listening on url unless NULL) and the echo, sink
 * and req kinds registered. */
typedef struct node {
    test_rt t;
    sh_transport *tp;
    char url[128]; /* the bound URL */
} node;

static inline void node_start(node *n, uint32_t id, const char *url, const sh_transport_opts *o)
{
    rt_start(&n->t, id, 2, NULL);
    CHECK_OK(sh_runtime_register(n->t.rt, &echo_vt, NULL));
    CHECK_OK(sh_runtime_register(n->t.rt, &sink_vt, NULL));
    CHECK_OK(sh_runtime_register(n->t.rt, &req_vt, NULL));
    sh_transport_opts oo = {0};
    if (o)
        oo = *o;
    oo.listen_url = url;
    sh_error e = {0};
    n->tp = NULL;
    n->url[0] = '\0';
    sh_err err = sh_transport_create(n->t.rt, &oo, &n->tp, &e);
    if (err)
        fprintf(stderr, "transport: %s\n", e.msg);
    CHECK_OK(err);
    if (url)
        CHECK_OK(sh_transport_listen_url(n->tp, n->url, sizeof n->url));
}

static inline void node_finish(node *n)
{
    sh_transport_close(n->tp);
    rt_finish(&n->t);
    sh_transport_destroy(n->tp);
}

/* ---- Large echoed frames, checked byte for byte ------------------------------------------ */

/* Sends one PING per size in `sizes` ({"d": bin(size)} with a pattern), one at a time, and
 * checks that each PONG carries the same bytes back. */
typedef struct big_cfg {
    sh_addr peer;
    const size_t *sizes;
    int n;
    int next;
    uint8_t *body; /* (body_cap) */
    size_t body_cap, body_len;
    _Atomic int done, bad;
} big_cfg;

static inline void big_fill(big_cfg *c, size_t n, uint32_t salt)
{
    uint8_t *b = c->body;
    b[0] = 0x81, b[1] = 0xa1, b[2] = 'd', b[3] = 0xc6;
    for (int i = 0; i < 4; i++)
        b[4 + i] = (uint8_t)(n >> (24 - 8 * i));
    for (size_t i = 0; i < n; i++)
        b[8 + i] = (uint8_t)((i * 131u + salt) >> 3);
    c->body_len = n + 8;
}

static inline void big_next(sh_actor_ctx *ctx, big_cfg *c)
{
    if (c->next >= c->n)
        return;
    big_fill(c, c->sizes[c->next], (uint32_t)c->next);
    uint64_t s;
    if (sh_request(ctx, c->peer, SH_MSG_PING, c->body, c->body_len, 20000, &s, NULL) != SH_OK) {
        atomic_fetch_add(&c->bad, 1);
        atomic_store(&c->done, c->n);
    }
}

static inline sh_err big_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    *(big_cfg **)state = arg;
    big_next(ctx, arg);
    return SH_OK;
}

static inline sh_msg_fate big_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    big_cfg *c = *(big_cfg **)state;
    size_t n = 0;
    const void *b = sh_msg_body(m, &n);
    if (sh_msg_header(m)->type != SH_MSG_PONG || n != c->body_len || memcmp(b, c->body, n) != 0) {
        fprintf(stderr, "big frame %d (%zu bytes): type %u, %zu bytes back\n", c->next,
                c->sizes[c->next], (unsigned)sh_msg_header(m)->type, n);
        atomic_fetch_add(&c->bad, 1);
    }
    c->next++;
    atomic_fetch_add(&c->done, 1);
    big_next(ctx, c);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable big_vt = {
    .name = "big", .state_size = sizeof(big_cfg *), .init = big_init, .handle = big_handle};

/* Runs the sizes from a's "big" actor to b's echo; returns the mismatches (-1: not finished). */
static inline int big_echo(node *a, sh_addr echo, const size_t *sizes, int n)
{
    static big_cfg c;
    memset(&c, 0, sizeof c);
    c.peer = echo;
    c.sizes = sizes;
    c.n = n;
    c.body_cap = 0;
    for (int i = 0; i < n; i++)
        if (sizes[i] + 8 > c.body_cap)
            c.body_cap = sizes[i] + 8;
    c.body = malloc(c.body_cap);
    CHECK(c.body != NULL);
    CHECK_OK(sh_runtime_register(a->t.rt, &big_vt, NULL));
    sh_addr addr;
    CHECK_OK(sh_actor_spawn(a->t.rt, "big", &c, 0, &addr, NULL));
    uint64_t end = now_ms() + 30000;
    while (atomic_load(&c.done) < n && now_ms() < end)
        sleep_ms(2);
    sh_actor_stop(a->t.rt, addr);
    sleep_ms(20);
    int bad = atomic_load(&c.done) < n ? -1 : atomic_load(&c.bad);
    free(c.body);
    return bad;
}

/* A fresh private directory for ipc:// sockets. */
static inline void tmpdir_make(char *buf, size_t cap)
{
    snprintf(buf, cap, "/tmp/shoal-tp-XXXXXX");
    if (!mkdtemp(buf))
        buf[0] = '\0';
}

/* Removes a directory made by tmpdir_make with the socket files left in it. */
static inline void tmpdir_remove(const char *dir)
{
    DIR *d = dir[0] ? opendir(dir) : NULL;
    if (!d)
        return;
    struct dirent *ent;
    char path[512];
    while ((ent = readdir(d)) != NULL) {
        if (!strcmp(ent->d_name, ".") || !strcmp(ent->d_name, ".."))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

#endif
