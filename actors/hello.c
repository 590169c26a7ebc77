/* The "hello" actor: answers HELLO with this node's identity and greets the peers it is given
 * until each has answered (actors/hello.h). */
#include <stdio.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/hello.h"
#include "runtime/msg.h"
#include "runtime/proto.h"

#define HELLO_ARENA (16 * 1024)

typedef struct hello_state {
    sh_hello_args a;
    sh_act_decoder dec;
    uint64_t timer;
} hello_state;

static void to_body(const sh_hello_ident *id, sh_proto_hello *b)
{
    memset(b, 0, sizeof *b);
    b->node = (sh_strv){id->node, (uint32_t)strlen(id->node)};
    b->version = (sh_strv){id->version, (uint32_t)strlen(id->version)};
    b->proto = id->proto;
    b->model_size = id->model_size;
    b->model_hash = id->model_hash;
    b->n_blocks = id->n_blocks;
    b->max_seqs = id->max_seqs;
    b->max_tokens = id->max_tokens;
    b->seq_blocks = id->seq_blocks;
    b->link_dtype = id->link_dtype;
    b->stages = (sh_u64s){id->stages, (uint32_t)id->n_stages};
}

static void copy_str(char *dst, size_t cap, sh_strv s)
{
    size_t n = s.len < cap - 1 ? s.len : cap - 1;
    memcpy(dst, s.ptr, n);
    dst[n] = '\0';
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
    uint32_t n = b->stages.n < SH_HELLO_MAX_STAGES ? b->stages.n : SH_HELLO_MAX_STAGES;
    for (uint32_t i = 0; i < n; i++)
        memcpy(&id->stages[i], (const uint8_t *)b->stages.ptr + 8 * i, 8);
    id->n_stages = (int32_t)n;
}

static void greet(sh_actor_ctx *ctx, hello_state *s)
{
    sh_proto_hello b;
    to_body(s->a.self, &b);
    for (int32_t i = 0; i < s->a.n_peers; i++) {
        sh_hello_peer *p = &s->a.peers[i];
        if (atomic_load_explicit(&p->answered, memory_order_relaxed))
            continue;
        uint64_t session = 0;
        // A failed send (the link's queue is full, or not up yet) is retried at the next tick.
        if (sh_request_with(ctx, p->addr, SH_MSG_HELLO, sh__proto_encode, &b, s->a.retry_ms,
                            &session, NULL) == SH_OK)
            p->session = session;
    }
}

static sh_err hello_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    hello_state *s = state;
    s->a = *(const sh_hello_args *)arg;
    if (!s->a.retry_ms)
        s->a.retry_ms = 500;
    sh_err rc = sh__act_decoder_init(&s->dec, HELLO_ARENA);
    if (rc)
        return rc;
    if (s->a.n_peers > 0) {
        greet(ctx, s);
        rc = sh_actor_timer_start(ctx, s->a.retry_ms, s->a.retry_ms, 1, &s->timer);
    }
    return rc;
}

static void hello_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)tag;
    greet(ctx, state);
}

static sh_msg_fate hello_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    hello_state *s = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type != SH_MSG_HELLO)
        return SH_MSG_FATE_DONE; /* timeouts of our requests (ERROR): the timer asks again */
    sh_proto_body body;
    sh_error e = {0};
    if (sh__act_decode(&s->dec, m, &body, &e)) {
        sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_WARN, "hello_bad", "err=\"%s\"", e.msg);
        return SH_MSG_FATE_DONE;
    }
    for (int32_t i = 0; i < s->a.n_peers; i++) {
        sh_hello_peer *p = &s->a.peers[i];
        if (h->session && h->session == p->session && h->src == p->addr) {
            if (!atomic_load_explicit(&p->answered, memory_order_relaxed)) {
                from_body(&body.hello, &p->got);
                atomic_store_explicit(&p->answered, 1, memory_order_release);
            }
            return SH_MSG_FATE_DONE;
        }
    }
    if (!h->session)
        return SH_MSG_FATE_DONE; /* a late or stray answer */
    char who[64];
    copy_str(who, sizeof who, body.hello.node);
    sh_runtime_log(sh_actor_runtime(ctx), SH_LOG_LEVEL_INFO, "hello", "from=%s version=%.*s", who,
                   (int)body.hello.version.len, body.hello.version.ptr);
    sh_proto_hello b;
    to_body(s->a.self, &b);
    (void)sh_reply_with(ctx, m, SH_MSG_HELLO, sh__proto_encode, &b, NULL);
    return SH_MSG_FATE_DONE;
}

static void hello_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    hello_state *s = state;
    sh__act_decoder_fini(&s->dec);
}

const sh_actor_vtable sh__hello_vtable = {
    .name = "hello",
    .state_size = sizeof(hello_state),
    .init = hello_init,
    .handle = hello_handle,
    .stop = hello_stop,
    .timer = hello_timer,
};
