/* Request sessions: pending map per loop, deadline ERRORs, late-reply detection, sh_request. */
#include "runtime/session.h"

#include <string.h>

#include "base/error.h"
#include "runtime/internal.h"

#define MAX_SPARE 4096 /* freed sessions a loop keeps for reuse */

/* Session ids come from one runtime-wide counter, so they are dense: the low bits index the
 * buckets directly. A session is looked up by id and then checked against the actor and peer,
 * because an id chosen by another node's requester may collide with ours. */

static uint32_t bucket(const sh__session_map *m, uint64_t id)
{
    return (uint32_t)(id ^ (id >> 32)) & (m->cap - 1);
}

static sh_err map_grow(sh_runtime *rt, sh__session_map *m)
{
    uint32_t ncap = m->cap ? m->cap * 2 : 64;
    sh__session **nb = sh__rt_alloc(rt, ncap * sizeof *nb);
    if (!nb)
        return m->cap ? SH_OK : SH_ENOMEM; /* a full table still works, with longer chains */
    sh__session **ob = m->buckets;
    uint32_t ocap = m->cap;
    m->buckets = nb;
    m->cap = ncap;
    for (uint32_t i = 0; i < ocap; i++) {
        for (sh__session *s = ob[i]; s;) {
            sh__session *next = s->map_next;
            uint32_t b = bucket(m, s->id);
            s->map_next = nb[b];
            nb[b] = s;
            s = next;
        }
    }
    sh__rt_free(rt, ob);
    return SH_OK;
}

/* Unlinks s from the map, its actor's list and the heap, and frees it. */
static void session_free(struct sh__loop *l, sh__session *s)
{
    sh__session_map *m = &l->sessions;
    sh__session **pp = &m->buckets[bucket(m, s->id)];
    while (*pp && *pp != s)
        pp = &(*pp)->map_next;
    if (*pp) {
        *pp = s->map_next;
        m->n--;
    }
    if (s->a_prev)
        s->a_prev->a_next = s->a_next;
    else
        s->actor->sessions = s->a_next;
    if (s->a_next)
        s->a_next->a_prev = s->a_prev;
    sh__timer_remove(l, &s->tn);
    if (m->n_spare < MAX_SPARE) {
        s->map_next = m->spare;
        m->spare = s;
        m->n_spare++;
    } else {
        sh__rt_free(l->rt, s);
    }
}

sh_err sh__session_add(struct sh__loop *l, sh_actor_ctx *a, uint64_t id, sh_addr peer,
                       uint32_t type, uint64_t trace_id, uint32_t deadline_ms)
{
    sh__session_map *m = &l->sessions;
    if (m->n >= m->cap && map_grow(l->rt, m) != SH_OK)
        return SH_ENOMEM;
    sh__session *s = m->spare;
    if (s) {
        m->spare = s->map_next;
        m->n_spare--;
    } else if (!(s = sh__rt_alloc(l->rt, sizeof *s))) {
        return SH_ENOMEM;
    }
    memset(s, 0, sizeof *s);
    s->tn.kind = SH__TIMER_KIND_SESSION;
    s->tn.idx = SH__TIMER_IDLE;
    s->id = id;
    s->peer = peer;
    s->type = type;
    s->trace_id = trace_id;
    s->actor = a;
    if (sh__timer_add(l, &s->tn, sh__rt_now() + (uint64_t)deadline_ms * 1000000u) != SH_OK) {
        sh__rt_free(l->rt, s);
        return SH_ENOMEM;
    }
    uint32_t b = bucket(m, id);
    s->map_next = m->buckets[b];
    m->buckets[b] = s;
    m->n++;
    s->a_next = a->sessions;
    if (s->a_next)
        s->a_next->a_prev = s;
    a->sessions = s;
    return SH_OK;
}

static sh__session *find(struct sh__loop *l, const sh_actor_ctx *a, uint64_t id)
{
    sh__session_map *m = &l->sessions;
    if (!m->cap)
        return NULL;
    sh__session *s = m->buckets[bucket(m, id)];
    while (s && !(s->id == id && s->actor == a))
        s = s->map_next;
    return s;
}

void sh__session_forget(struct sh__loop *l, sh_actor_ctx *a, uint64_t id)
{
    sh__session *s = find(l, a, id);
    if (s)
        session_free(l, s);
}

sh__session_match sh__session_match_msg(struct sh__loop *l, sh_actor_ctx *a, const sh_msg *m)
{
    const sh_msg_hdr *h = &m->env.hdr;
    sh__session *s = find(l, a, h->session);
    if (!s || s->peer != h->src)
        return SH__SESSION_MATCH_NONE;
    sh__session_match r = s->expired ? SH__SESSION_MATCH_LATE : SH__SESSION_MATCH_REPLY;
    session_free(l, s); /* one answer per request: a second one is a new message */
    return r;
}

void sh__session_fire(struct sh__loop *l, sh__session *s)
{
    sh_runtime *rt = l->rt;
    if (s->expired) {
        session_free(l, s); /* the grace period for a late reply is over */
        return;
    }
    s->expired = true;
    sh_counter_add(rt->m.timeouts, 1);
    sh_actor_ctx *a = s->actor;
    sh_msg_hdr req = {.type = (sh_msg_type)s->type,
                      .session = s->id,
                      .src = a->addr,
                      .dst = s->peer,
                      .trace_id = s->trace_id};
    sh_msg *m = NULL;
    if (sh__actor_msg_error(rt, &req, SH_ETIMEDOUT, "deadline passed", &m) == SH_OK) {
        m->flags |= SH__MSG_TIMEOUT | SH__MSG_REPLY;
        sh__actor_enqueue(a, m);
    } else {
        sh__log_emit(&rt->log, SH_LOG_LEVEL_ERROR, a->vt->name, a->id, "timeout_lost",
                     "session=%llu reason=nomem", (unsigned long long)s->id);
    }
    if (sh__timer_add(l, &s->tn, sh__rt_now() + (uint64_t)rt->late_grace_ms * 1000000u) != SH_OK)
        session_free(l, s);
}

void sh__session_cancel_actor(struct sh__loop *l, sh_actor_ctx *a)
{
    while (a->sessions)
        session_free(l, a->sessions);
}

void sh__session_map_fini(struct sh__loop *l)
{
    while (l->sessions.spare) {
        sh__session *s = l->sessions.spare;
        l->sessions.spare = s->map_next;
        sh__rt_free(l->rt, s);
    }
    l->sessions.n_spare = 0;
    sh__rt_free(l->rt, l->sessions.buckets);
    l->sessions.buckets = NULL;
    l->sessions.cap = l->sessions.n = 0;
}

/* sh_request and sh_request_with. The session is registered before the send so that a failed
 * registration never leaves a request in flight; a failed send forgets it again. */
static sh_err request(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, const void *body,
                      size_t body_len, sh_frame_writer writer, uint32_t deadline_ms,
                      uint64_t *session, sh_error *e)
{
    sh_runtime *rt = ctx->rt;
    uint64_t id = atomic_fetch_add(&rt->next_session, 1) + 1;
    sh_msg_hdr h = {.type = (sh_msg_type)type, .session = id, .src = ctx->addr, .dst = dst};
    sh_msg *m = NULL;
    sh_err err = writer ? sh__actor_msg_write(rt, &h, writer, body, &m, e)
                        : sh__actor_msg_build(rt, &h, body, body_len, &m, e);
    if (err)
        return err;
    err = sh__session_add(ctx->loop, ctx, id, dst, type, 0, deadline_ms);
    if (err) {
        sh__mailbox_msg_release(m);
        return sh__error_set(e, err, "request: out of memory");
    }
    err = sh__actor_route(rt, m, e);
    if (err) {
        sh__session_forget(ctx->loop, ctx, id);
        sh__mailbox_msg_release(m);
        return err;
    }
    if (session)
        *session = id;
    return SH_OK;
}

sh_err sh_request(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, const void *body, size_t body_len,
                  uint32_t deadline_ms, uint64_t *session, sh_error *e)
{
    return request(ctx, dst, type, body, body_len, NULL, deadline_ms, session, e);
}

sh_err sh_request_with(sh_actor_ctx *ctx, sh_addr dst, uint32_t type, sh_frame_writer writer,
                       const void *body, uint32_t deadline_ms, uint64_t *session, sh_error *e)
{
    if (!writer)
        return sh__error_set(e, SH_EINVAL, "request: NULL writer");
    return request(ctx, dst, type, body, 0, writer, deadline_ms, session, e);
}
