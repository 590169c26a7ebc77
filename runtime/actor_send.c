/* Building frames into pooled messages and routing them: mailbox, transport or ERROR bounce. */
#include <stdbool.h>
#include <string.h>

#include "base/error.h"
#include "runtime/internal.h"
#include "runtime/proto.h"

/* The envelope before the body is at most 58 bytes (fixarray, magic, version, type, and four
 * 64-bit integers of 9 bytes each); 64 leaves room. Every frame is built with room for the
 * seal after it (SH_MSG_SEAL_BYTES), which a frame for another node gets in sh__actor_route. */
#define ENVELOPE_MAX 64u
#define SEAL SH_MSG_SEAL_BYTES

static const uint8_t empty_map = 0x80;

/* A sender's use of the transport hooks, from loading the pointer to the last call through it
 * (the grace period of sh_transport_set, runtime/internal.h). */
static int hooks_enter(sh_runtime *rt)
{
    int side = (int)(atomic_load(&rt->hook_gen) & 1);
    atomic_fetch_add(&rt->hook_users[side], 1);
    return side;
}

static void hooks_leave(sh_runtime *rt, int side) { atomic_fetch_sub(&rt->hook_users[side], 1); }

/* A large frame for another node is built straight in a buffer the transport can send without
 * copying (an nng_msg body), when the installed hooks offer one. NULL: use the runtime's own. */
static sh_msg *remote_alloc(sh_runtime *rt, const sh_msg_hdr *h, size_t cap)
{
    if (cap <= SH__MAILBOX_SMALL_FRAME || sh_addr_node(h->dst) == rt->node_id)
        return NULL;
    int side = hooks_enter(rt);
    const sh_transport_hooks *hooks = atomic_load_explicit(&rt->hooks, memory_order_acquire);
    sh_frame_owner owner = {0};
    uint8_t *data = hooks && hooks->frame_alloc && hooks->send_owned
                        ? hooks->frame_alloc(hooks->ctx, sh_addr_node(h->dst), cap, &owner)
                        : NULL;
    hooks_leave(rt, side);
    if (!data)
        return NULL;
    sh_msg *m = sh__mailbox_msg_wrap(rt, data, 0, &owner);
    if (!m) {
        owner.release(owner.ctx, owner.handle);
        return NULL;
    }
    m->cap = cap;
    return m;
}

sh_err sh__actor_msg_build(sh_runtime *rt, const sh_msg_hdr *h, const void *body, size_t body_len,
                           sh_msg **out, sh_error *e)
{
    if (!sh__msg_type_known((uint64_t)h->type))
        return sh__error_set(e, SH_EINVAL, "send: unknown message type %u", (unsigned)h->type);
    if (h->dst == SH_ADDR_NONE)
        return sh__error_set(e, SH_EINVAL, "send: no destination");
    if (!body || body_len == 0) {
        body = &empty_map;
        body_len = 1;
    }
    sh_msg *m = remote_alloc(rt, h, body_len + ENVELOPE_MAX + SEAL);
    if (!m)
        m = sh__mailbox_msg_alloc(rt, body_len + ENVELOPE_MAX + SEAL);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "send: out of memory for %zu bytes", body_len);
    sh_buf b;
    sh__buf_init_fixed(&b, m->data, m->cap - SEAL);
    sh__msg_put_header(&b, h);
    size_t off = b.len;
    uint8_t *p = sh__buf_append(&b, body_len);
    if (!p || b.failed) {
        sh__mailbox_msg_release(m);
        return sh__error_set(e, SH_ERANGE, "send: envelope larger than expected");
    }
    memcpy(p, body, body_len);
    m->len = b.len;
    m->env.hdr = *h;
    m->env.body = m->data + off;
    m->env.body_len = body_len;
    m->env.n_fields = 8;
    *out = m;
    return SH_OK;
}

/* Fills m->env from its frame; the frame was written by our own encoder, so this only fails for
 * a writer that broke its contract. */
static sh_err decode_env(sh_msg *m, sh_error *e)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    return sh__msg_decode(&c, m->data, m->len, &m->env, e);
}

sh_err sh__actor_msg_write(sh_runtime *rt, const sh_msg_hdr *h, sh_frame_writer writer,
                           const void *body, sh_msg **out, sh_error *e)
{
    if (h->dst == SH_ADDR_NONE)
        return sh__error_set(e, SH_EINVAL, "send: no destination");
    sh_msg *m = sh__mailbox_msg_alloc(rt, SH__MAILBOX_SMALL_FRAME);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "send: out of memory");
    sh_buf b;
    sh__buf_init_fixed(&b, m->data, m->cap - SEAL);
    sh_err err = writer(&b, h, body, e);
    if (err == SH_ERANGE) {
        /* Too big for a small block: try a pooled medium one. */
        sh__mailbox_msg_release(m);
        m = sh__mailbox_msg_alloc(rt, SH__MAILBOX_MID_FRAME);
        if (!m)
            return sh__error_set(e, SH_ENOMEM, "send: out of memory");
        sh__buf_init_fixed(&b, m->data, m->cap - SEAL);
        err = writer(&b, h, body, e);
    }
    if (err == SH_ERANGE) {
        /* Too big for a pooled block: encode into a growing buffer and adopt it. */
        sh__mailbox_msg_release(m);
        sh_buf g;
        sh__buf_init(&g);
        err = writer(&g, h, body, e);
        if (!err) { /* room for the seal */
            size_t n = g.len;
            if (!sh__buf_append(&g, SEAL))
                err = sh__error_set(e, SH_ENOMEM, "send: out of memory");
            sh__buf_truncate(&g, n);
        }
        if (!err && !(m = sh__mailbox_msg_adopt(rt, g.data, g.len, g.cap)))
            err = sh__error_set(e, SH_ENOMEM, "send: out of memory");
        if (err) {
            sh__buf_fini(&g);
            return err;
        }
    } else if (err) {
        sh__mailbox_msg_release(m);
        return err;
    } else {
        m->len = b.len;
    }
    err = decode_env(m, e);
    if (err) {
        sh__mailbox_msg_release(m);
        return err;
    }
    *out = m;
    return SH_OK;
}

sh_err sh__actor_msg_error(sh_runtime *rt, const sh_msg_hdr *req, sh_err code, const char *text,
                           sh_msg **out)
{
    sh_msg *m = sh__mailbox_msg_alloc(rt, SH__MAILBOX_SMALL_FRAME);
    if (!m)
        return SH_ENOMEM;
    sh_buf b;
    sh__buf_init_fixed(&b, m->data, m->cap - SEAL);
    sh_err err = sh__proto_encode_error_reply(&b, req, code, text, NULL);
    if (!err) {
        m->len = b.len;
        err = decode_env(m, NULL);
    }
    if (err) {
        sh__mailbox_msg_release(m);
        return err;
    }
    *out = m;
    return SH_OK;
}

void sh__actor_enqueue(sh_actor_ctx *a, sh_msg *m)
{
    sh_runtime *rt = a->rt;
    int64_t depth = atomic_fetch_add(&a->depth, 1) + 1;
    if (depth > (int64_t)rt->mailbox_warn && !atomic_load(&a->overloaded) &&
        !atomic_exchange(&a->overloaded, 1)) {
        sh_counter_add(rt->m.overloads, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_WARN, a->vt->name, a->id, "mailbox_overload",
                     "depth=%lld threshold=%u", (long long)depth, (unsigned)rt->mailbox_warn);
    }
    sh__mailbox_push(&a->mbox, &m->node);
    sh__loop_schedule(a);
}

void sh__actor_bounce(sh_msg *m, sh_err code)
{
    sh_runtime *rt = m->rt;
    const sh_msg_hdr *h = &m->env.hdr;
    if (h->session != 0 && h->type != SH_MSG_ERROR && !(m->flags & SH__MSG_REPLY) &&
        h->src != SH_ADDR_NONE && !atomic_load(&rt->closing)) {
        sh_msg *r = NULL;
        if (sh__actor_msg_error(rt, h, code, sh_strerror(code), &r) == SH_OK) {
            r->flags |= SH__MSG_REPLY; /* an ERROR is never answered: no ping-pong of errors */
            sh_counter_add(rt->m.errors_sent, 1);
            if (sh__actor_route(rt, r, NULL) != SH_OK)
                sh__mailbox_msg_release(r);
        }
    }
    sh__mailbox_msg_release(m);
}

/* Seals a frame for another node once, before the filter sees it (runtime/msg.h): what the
 * fault layer or the wire does to its bytes afterwards, the receiver's check catches. Every
 * frame built here has room; a received one forwarded has its stripped trailer's. */
static sh_err seal(sh_msg *m, sh_error *e)
{
    if (m->flags & SH__MSG_SEALED)
        return SH_OK;
    if (m->cap < m->len + SEAL)
        return sh__error_set(e, SH_ERANGE, "send: no room for the %zu-byte frame's checksum",
                             m->len);
    sh__msg_seal(m->data, m->len);
    m->len += SEAL;
    m->flags |= SH__MSG_SEALED;
    return SH_OK;
}

static sh_err route(sh_runtime *rt, sh_msg *m, sh_error *e);

sh_err sh__actor_route(sh_runtime *rt, sh_msg *m, sh_error *e)
{
    if (atomic_load_explicit(&rt->closing, memory_order_relaxed))
        return sh__error_set(e, SH_ECLOSED, "send: runtime is shutting down");
    if (sh_addr_node(m->env.hdr.dst) != rt->node_id) {
        sh_err err = seal(m, e);
        if (err)
            return err;
    }
    int side = hooks_enter(rt);
    sh_err err = route(rt, m, e);
    hooks_leave(rt, side);
    return err;
}

/* The message through the hooks (filter, then a remote node's transport) or to a local actor;
 * inside hooks_enter/leave. */
static sh_err route(sh_runtime *rt, sh_msg *m, sh_error *e)
{
    const sh_transport_hooks *hooks = atomic_load_explicit(&rt->hooks, memory_order_acquire);
    if (hooks && hooks->filter && !(m->flags & SH__MSG_NOFILTER)) {
        sh_send_verdict v = hooks->filter(hooks->ctx, m);
        if (v == SH_SEND_VERDICT_DROP) {
            sh_counter_add(rt->m.dropped, 1);
            sh__mailbox_msg_release(m);
            return SH_OK;
        }
        if (v == SH_SEND_VERDICT_TAKEN)
            return SH_OK;
    }
    m->flags &= ~(uint32_t)SH__MSG_NOFILTER;
    sh_addr dst = m->env.hdr.dst;
    uint32_t node = sh_addr_node(dst);
    if (node != rt->node_id) {
        if (!hooks || (!hooks->send_frame && !hooks->send_owned))
            return sh__error_set(e, SH_EUNSUPPORTED,
                                 "send: destination node %u is remote and no transport is set",
                                 (unsigned)node);
        sh_err err;
        if ((m->flags & SH__MSG_OWNED) && hooks->send_owned) {
            /* The buffer moves to the transport; the header block goes back to the pool. */
            err = hooks->send_owned(hooks->ctx, node, m->data, m->len, &m->owner, e);
            if (!err)
                sh__mailbox_msg_disown(m);
        } else if (hooks->send_frame) {
            err = hooks->send_frame(hooks->ctx, node, m->data, m->len, e);
        } else {
            err = sh__error_set(e, SH_EUNSUPPORTED, "send: the transport for node %u cannot send",
                                (unsigned)node);
        }
        if (err)
            return err;
        sh_counter_add(rt->m.sent, 1);
        sh__mailbox_msg_release(m);
        return SH_OK;
    }
    sh_actor_ctx *a = sh__registry_lookup(&rt->reg, sh_addr_actor(dst));
    if (!a || atomic_load(&a->life) >= SH__ACTOR_STOPPING) {
        if (a)
            sh__actor_release(a);
        sh_counter_add(rt->m.undeliverable, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, NULL, 0, "undeliverable",
                     "dst=%u:%u type=%s session=%llu", (unsigned)node, (unsigned)sh_addr_actor(dst),
                     sh__msg_type_name((uint64_t)m->env.hdr.type),
                     (unsigned long long)m->env.hdr.session);
        sh__actor_bounce(m, SH_ENOTFOUND);
        return SH_OK;
    }
    sh_counter_add(rt->m.sent, 1);
    sh__actor_enqueue(a, m);
    sh__actor_release(a);
    return SH_OK;
}

sh_err sh_send(sh_runtime *rt, const sh_msg_hdr *h, const void *body, size_t body_len, sh_error *e)
{
    sh_msg *m = NULL;
    sh_err err = sh__actor_msg_build(rt, h, body, body_len, &m, e);
    if (!err && (err = sh__actor_route(rt, m, e)) != SH_OK)
        sh__mailbox_msg_release(m);
    return err;
}

sh_err sh_send_with(sh_runtime *rt, const sh_msg_hdr *h, sh_frame_writer writer, const void *body,
                    sh_error *e)
{
    if (!writer)
        return sh__error_set(e, SH_EINVAL, "send: NULL writer");
    sh_msg *m = NULL;
    sh_err err = sh__actor_msg_write(rt, h, writer, body, &m, e);
    if (!err && (err = sh__actor_route(rt, m, e)) != SH_OK)
        sh__mailbox_msg_release(m);
    return err;
}

sh_err sh_actor_send(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, const void *body,
                     size_t body_len, sh_error *e)
{
    sh_msg_hdr h = {.type = (sh_msg_type)type, .src = ctx->addr, .dst = dst};
    return sh_send(ctx->rt, &h, body, body_len, e);
}

static sh_err reply(sh_actor_ctx *ctx, const sh_msg *req, uint32_t type, const void *body,
                    size_t body_len, sh_frame_writer writer, sh_error *e)
{
    const sh_msg_hdr *q = &req->env.hdr;
    if (q->src == SH_ADDR_NONE)
        return sh__error_set(e, SH_EINVAL, "reply: the request has no sender");
    sh_msg_hdr h = {.type = (sh_msg_type)type,
                    .session = q->session,
                    .src = ctx->addr,
                    .dst = q->src,
                    .trace_id = q->trace_id};
    sh_msg *m = NULL;
    sh_err err = writer ? sh__actor_msg_write(ctx->rt, &h, writer, body, &m, e)
                        : sh__actor_msg_build(ctx->rt, &h, body, body_len, &m, e);
    if (err)
        return err;
    m->flags |= SH__MSG_REPLY;
    if ((err = sh__actor_route(ctx->rt, m, e)) != SH_OK)
        sh__mailbox_msg_release(m);
    return err;
}

sh_err sh_reply(sh_actor_ctx *ctx, const sh_msg *req, uint32_t type, const void *body,
                size_t body_len, sh_error *e)
{
    return reply(ctx, req, type, body, body_len, NULL, e);
}

sh_err sh_reply_with(sh_actor_ctx *ctx, const sh_msg *req, uint32_t type, sh_frame_writer writer,
                     const void *body, sh_error *e)
{
    if (!writer)
        return sh__error_set(e, SH_EINVAL, "reply: NULL writer");
    return reply(ctx, req, type, body, 0, writer, e);
}

const sh_msg_hdr *sh_msg_header(const sh_msg *m) { return &m->env.hdr; }

const void *sh_msg_body(const sh_msg *m, size_t *len)
{
    if (len)
        *len = m->env.body_len;
    return m->env.body;
}

const void *sh_msg_frame(const sh_msg *m, size_t *len)
{
    if (len)
        *len = m->len;
    return m->data;
}

void sh_msg_free(sh_msg *m)
{
    if (m)
        sh__mailbox_msg_release(m);
}

sh_err sh_msg_error_code(const sh_msg *m)
{
    if (m->env.hdr.type != SH_MSG_ERROR)
        return SH_EPROTO;
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_proto_body b;
    sh_proto_arena arena;
    sh__proto_arena_init(&arena, NULL, 0);
    if (sh__proto_decode_body(&c, SH_MSG_ERROR, m->env.body, m->env.body_len, &b, &arena, NULL))
        return SH_EPROTO;
    int32_t code = b.error.code;
    return code > 0 && code < SH_ERR_COUNT_ ? (sh_err)code : SH_EPROTO;
}

/* Decodes m (its frame already in place) and routes it. On an error m is freed here, except that
 * an owned buffer is disowned first: the caller keeps it. */
static sh_err deliver(sh_runtime *rt, sh_msg *m, sh_error *e)
{
    size_t len = m->len;
    bool owned = (m->flags & SH__MSG_OWNED) != 0;
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_error local;
    if (!e)
        e = &local;
    /* The seal first: a frame whose bytes changed on the way is dropped before any of them is
     * read, unanswered (its session and sender may be the changed bytes). A whole unsealed frame
     * of another protocol version is decoded as is, so that the mismatch is named. */
    size_t inner = 0;
    if (sh__msg_unseal(&c, m->data, len, &inner, e) == SH_OK) {
        len = m->len = inner;
    } else if (!sh__msg_foreign_unsealed(m->data, len)) {
        sh_counter_add(rt->m.corrupt, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_WARN, NULL, 0, "frame_corrupt", "len=%zu error=\"%s\"",
                     len, e->msg);
        if (owned)
            sh__mailbox_msg_disown(m);
        sh__mailbox_msg_release(m);
        return SH_EFORMAT;
    }
    sh_err err = sh__msg_decode(&c, m->data, len, &m->env, e);
    if (!err && sh_addr_node(m->env.hdr.dst) != rt->node_id)
        err = sh__error_set(e, SH_EPROTO, "deliver: frame for node %u reached node %u",
                            (unsigned)sh_addr_node(m->env.hdr.dst), (unsigned)rt->node_id);
    /* A frame of another protocol version: its header is read as that version wrote it, so the
     * log names the sender and a request is answered with an ERROR in our version, which tells
     * the other side (its transport notes it on the link: runtime/transport.c) that the two
     * builds do not speak the same protocol. */
    if (err && c.stats.rejected[SH_MSG_REJECT_VERSION])
        (void)sh__msg_peek_foreign(m->data, len, &m->env);
    if (err) {
        sh_counter_add(rt->m.rejected, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_WARN, NULL, 0, "frame_rejected", "len=%zu error=\"%s\"",
                     len, e->msg);
        if (owned) /* the header was decoded into m->env; the bytes are not needed again */
            sh__mailbox_msg_disown(m);
        /* Answer only a claimed remote requester: a frame must not make us message ourselves. */
        const sh_msg_hdr *h = &m->env.hdr;
        if (m->env.n_fields >= 6 && h->session != 0 && h->type != SH_MSG_ERROR &&
            h->src != SH_ADDR_NONE && sh_addr_node(h->src) != rt->node_id) {
            sh__actor_bounce(m, SH_EPROTO);
        } else {
            sh__mailbox_msg_release(m);
        }
        return err;
    }
    /* The peer gate: a frame acts only as the node its connection proved in HELLO. A refused
     * frame is dropped unanswered (its src is what it lied about). */
    if (!sh__peers_allows(rt, m->conn, sh_addr_node(m->env.hdr.src), m->env.hdr.type)) {
        sh_msg_type type = m->env.hdr.type;
        if (owned)
            sh__mailbox_msg_disown(m);
        sh__mailbox_msg_release(m);
        return sh__error_set(e, SH_EPROTO, "deliver: %s frame refused by the peer gate",
                             sh__msg_type_name(type));
    }
    m->flags |= SH__MSG_NOFILTER; /* faults were injected on the sending node */
    err = sh__actor_route(rt, m, e);
    if (err) {
        if (owned)
            sh__mailbox_msg_disown(m);
        sh__mailbox_msg_release(m);
    }
    return err;
}

sh_err sh_transport_deliver(sh_runtime *rt, const void *frame, size_t len, sh_error *e)
{
    return sh__transport_deliver_conn(rt, 0, frame, len, e);
}

sh_err sh_transport_deliver_owned(sh_runtime *rt, uint8_t *frame, size_t len,
                                  const sh_frame_owner *owner, sh_error *e)
{
    return sh__transport_deliver_owned_conn(rt, 0, frame, len, owner, e);
}

sh_err sh__transport_deliver_conn(sh_runtime *rt, uint64_t conn, const void *frame, size_t len,
                                  sh_error *e)
{
    if (atomic_load(&rt->closing))
        return sh__error_set(e, SH_ECLOSED, "deliver: runtime is shutting down");
    sh_msg *m = sh__mailbox_msg_alloc(rt, len);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "deliver: out of memory for %zu bytes", len);
    memcpy(m->data, frame, len);
    m->len = len;
    m->conn = conn;
    return deliver(rt, m, e);
}

sh_err sh__transport_deliver_owned_conn(sh_runtime *rt, uint64_t conn, uint8_t *frame, size_t len,
                                        const sh_frame_owner *owner, sh_error *e)
{
    if (!owner || !owner->release || (!frame && len))
        return sh__error_set(e, SH_EINVAL, "deliver: NULL frame or owner");
    if (atomic_load(&rt->closing))
        return sh__error_set(e, SH_ECLOSED, "deliver: runtime is shutting down");
    sh_msg *m = sh__mailbox_msg_wrap(rt, frame, len, owner);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "deliver: out of memory");
    m->conn = conn;
    return deliver(rt, m, e);
}

sh_err sh_transport_reinject(sh_runtime *rt, sh_msg *m, sh_error *e)
{
    m->flags |= SH__MSG_NOFILTER;
    return sh__actor_route(rt, m, e);
}
