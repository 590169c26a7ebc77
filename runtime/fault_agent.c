/* The fault layer's agent: an actor that turns FAULT messages from a chaos driver into rules. */
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "base/error.h"
#include "runtime/fault_agent.h"
#include "runtime/proto.h"

/* The arena holds a decoded FAULT body's rule list: 256 entries at most. */
#define ARENA_BYTES ((size_t)64 << 10)

struct sh__fault_agent {
    sh_fault *f;
    sh_runtime *rt;
    sh_addr addr;
    uv_mutex_t mu;
    uv_cond_t cv;
    bool started, stopped;
    sh_msg_codec codec;
    sh_proto_arena arena;
    max_align_t arena_mem[ARENA_BYTES / sizeof(max_align_t)];
    sh_fault_rule rules[256];
};

static void mark(sh__fault_agent *a, bool *flag)
{
    uv_mutex_lock(&a->mu);
    *flag = true;
    uv_cond_broadcast(&a->cv);
    uv_mutex_unlock(&a->mu);
}

static sh_err agent_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    sh__fault_agent *a = arg;
    *(sh__fault_agent **)state = a;
    mark(a, &a->started);
    return SH_OK;
}

static void agent_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__fault_agent *a = *(sh__fault_agent **)state;
    mark(a, &a->stopped);
}

static void answer_error(sh_actor_ctx *ctx, const sh_msg *m, sh_err code, const char *text)
{
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->session == 0)
        return;
    sh_proto_error body = {
        .code = (int32_t)code, .message = {text, strlen(text)}, .type = (uint32_t)h->type};
    (void)sh_reply_with(ctx, m, SH_MSG_ERROR, sh__proto_encode, &body, NULL);
}

/* One wire rule as an sh_fault_rule: src and dst name nodes (0: any). */
static sh_err rule_from_wire(const sh_proto_fault_rule *w, sh_fault_rule *r, sh_error *e)
{
    if (sh_addr_actor(w->src) || sh_addr_actor(w->dst))
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "a rule names actors (src %llx, dst %llx): rules act on links between "
                             "nodes; give node addresses (actor 0)",
                             (unsigned long long)w->src, (unsigned long long)w->dst);
    *r = (sh_fault_rule){.action = (sh_fault_action)w->action,
                         .p = w->prob,
                         .delay_ms = w->delay_ms,
                         .bytes = w->bytes,
                         .lasting_s = w->lasting_s,
                         .type = w->type,
                         .count = w->count};
    if (w->src)
        r->from[r->n_from++] = sh_addr_node(w->src);
    if (w->dst)
        r->to[r->n_to++] = sh_addr_node(w->dst);
    return SH_OK;
}

static sh_msg_fate agent_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    sh__fault_agent *a = *(sh__fault_agent **)state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type != SH_MSG_FAULT) {
        if (h->type != SH_MSG_ERROR)
            answer_error(ctx, m, SH_EPROTO, "fault agent: only FAULT messages are understood");
        return SH_MSG_FATE_DONE;
    }
    size_t len = 0;
    const void *b = sh_msg_body(m, &len);
    sh_proto_body body;
    sh_error e = {0};
    sh__proto_arena_reset(&a->arena);
    sh_err err = sh__proto_decode_body(&a->codec, SH_MSG_FAULT, b, len, &body, &a->arena, &e);
    const sh_proto_fault *fb = &body.fault;
    for (uint32_t i = 0; !err && i < fb->rules.n; i++) {
        sh_error why = {0};
        if ((err = rule_from_wire(&fb->rules.v[i], &a->rules[i], &why)) != SH_OK)
            sh__error_set(&e, err, "rule %u: %s", (unsigned)i, why.msg);
    }
    size_t active = 0;
    if (!err)
        err = sh__fault_apply(a->f, fb->clear, fb->seed, a->rules, fb->rules.n, &active, &e);
    if (err) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "fault_refused", "error=\"%s\"", e.msg);
        answer_error(ctx, m, err, e.msg);
        return SH_MSG_FATE_DONE;
    }
    sh_actor_log(ctx, SH_LOG_LEVEL_INFO, "fault_applied", "clear=%d seed=%llu added=%u active=%zu",
                 (int)fb->clear, (unsigned long long)fb->seed, (unsigned)fb->rules.n, active);
    if (h->session) {
        sh_proto_fault ack = {.seed = active};
        (void)sh_reply_with(ctx, m, SH_MSG_FAULT, sh__proto_encode, &ack, NULL);
    }
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable agent_vt = {.name = "fault_agent",
                                         .state_size = sizeof(sh__fault_agent *),
                                         .init = agent_init,
                                         .handle = agent_handle,
                                         .stop = agent_stop};

sh_err sh_fault_agent_spawn(sh_fault *f, int loop, sh_addr *addr, sh_error *e)
{
    if (!f || !addr)
        return sh__error_set(e, SH_EINVAL, "fault agent: NULL argument");
    sh__fault_agent **slot = sh__fault_agent_slot(f);
    if (*slot)
        return sh__error_set(e, SH_EBUSY, "fault agent: the layer has one already");
    sh__fault_agent *a = calloc(1, sizeof *a);
    if (!a)
        return sh__error_set(e, SH_ENOMEM, "fault agent: out of memory");
    a->f = f;
    a->rt = sh__fault_runtime(f);
    uv_mutex_init(&a->mu);
    uv_cond_init(&a->cv);
    sh__msg_codec_init(&a->codec);
    sh__proto_arena_init(&a->arena, a->arena_mem, sizeof a->arena_mem);
    sh_err err = sh_runtime_register(a->rt, &agent_vt, e);
    if (!err)
        err = sh_actor_spawn(a->rt, agent_vt.name, a, loop, &a->addr, e);
    if (err) {
        uv_cond_destroy(&a->cv);
        uv_mutex_destroy(&a->mu);
        free(a);
        return err;
    }
    /* Waiting for init makes destroy safe: from then on the stop member always runs. */
    uv_mutex_lock(&a->mu);
    while (!a->started)
        uv_cond_wait(&a->cv, &a->mu);
    uv_mutex_unlock(&a->mu);
    *slot = a;
    *addr = a->addr;
    return SH_OK;
}

void sh__fault_agent_destroy(sh__fault_agent *a)
{
    if (!a)
        return;
    sh_actor_stop(a->rt, a->addr);
    uv_mutex_lock(&a->mu);
    while (!a->stopped)
        uv_cond_wait(&a->cv, &a->mu);
    uv_mutex_unlock(&a->mu);
    uv_cond_destroy(&a->cv);
    uv_mutex_destroy(&a->mu);
    free(a);
}
