/* Actor kinds, spawning, stopping, reference counting and the stop sequence. */
#include <string.h>

#include "base/error.h"
#include "runtime/actor_uv.h"
#include "runtime/internal.h"

static bool kind_name_ok(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++) {
        char c = s[n];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
            return false;
    }
    return n > 0 && n < 32;
}

sh_err sh_runtime_register(sh_runtime *rt, const sh_actor_vtable *vt, sh_error *e)
{
    if (!vt)
        return sh__error_set(e, SH_EINVAL, "register: NULL vtable");
    if (!vt->name || !kind_name_ok(vt->name))
        return sh__error_set(e, SH_EINVAL, "register: kind name \"%s\" must be [a-z0-9_]{1,31}",
                             vt->name ? vt->name : "(null)");
    if (!vt->handle)
        return sh__error_set(e, SH_EINVAL, "register: kind %s has no handle member", vt->name);
    if (vt->state_size > ((size_t)1 << 30))
        return sh__error_set(e, SH_EINVAL, "register: kind %s state_size %zu is absurd", vt->name,
                             vt->state_size);
    sh_err err = SH_OK;
    uv_mutex_lock(&rt->kinds_mu);
    uint32_t i = 0;
    while (i < rt->n_kinds && strcmp(rt->kinds[i]->name, vt->name) != 0)
        i++;
    if (i < rt->n_kinds) {
        if (rt->kinds[i] != vt)
            err = sh__error_set(e, SH_EBUSY, "register: kind %s is already registered", vt->name);
    } else if (rt->n_kinds == SH__MAX_KINDS) {
        err = sh__error_set(e, SH_ENOMEM, "register: more than %d kinds", SH__MAX_KINDS);
    } else {
        rt->kinds[rt->n_kinds++] = vt;
    }
    uv_mutex_unlock(&rt->kinds_mu);
    return err;
}

static const sh_actor_vtable *find_kind(sh_runtime *rt, const char *name)
{
    const sh_actor_vtable *vt = NULL;
    uv_mutex_lock(&rt->kinds_mu);
    for (uint32_t i = 0; i < rt->n_kinds && !vt; i++)
        if (strcmp(rt->kinds[i]->name, name) == 0)
            vt = rt->kinds[i];
    uv_mutex_unlock(&rt->kinds_mu);
    return vt;
}

/* The next actor id, or 0 when all 2^32-1 have been used (ids are never reused). */
static uint32_t next_id(sh_runtime *rt)
{
    uint32_t old = atomic_load(&rt->next_actor);
    do {
        if (old == UINT32_MAX)
            return 0;
    } while (!atomic_compare_exchange_weak(&rt->next_actor, &old, old + 1));
    return old + 1;
}

sh_err sh_actor_spawn(sh_runtime *rt, const char *kind, void *arg, int loop, sh_addr *addr,
                      sh_error *e)
{
    if (atomic_load(&rt->stopping))
        return sh__error_set(e, SH_ECLOSED, "spawn: runtime is shutting down");
    const sh_actor_vtable *vt = kind ? find_kind(rt, kind) : NULL;
    if (!vt)
        return sh__error_set(e, SH_ENOTFOUND, "spawn: unknown kind \"%s\"", kind ? kind : "");
    uint32_t li;
    if (loop == SH_ACTOR_LOOP_ANY)
        li = atomic_fetch_add(&rt->rr, 1) % rt->n_loops;
    else if (loop >= 0 && (uint32_t)loop < rt->n_loops)
        li = (uint32_t)loop;
    else
        return sh__error_set(e, SH_EINVAL, "spawn: loop %d out of 0..%u", loop,
                             (unsigned)rt->n_loops - 1);
    sh_actor_ctx *a = sh__rt_alloc(rt, sizeof *a);
    void *state = vt->state_size ? sh__rt_alloc(rt, vt->state_size) : NULL;
    if (!a || (vt->state_size && !state)) {
        sh__rt_free(rt, a);
        sh__rt_free(rt, state);
        return sh__error_set(e, SH_ENOMEM, "spawn: out of memory");
    }
    uint32_t id = next_id(rt);
    if (id == 0) {
        sh__rt_free(rt, a);
        sh__rt_free(rt, state);
        return sh__error_set(e, SH_ERANGE, "spawn: actor ids exhausted");
    }
    sh__mailbox_init(&a->mbox);
    a->rt = rt;
    a->loop = &rt->loops[li];
    a->vt = vt;
    a->id = id;
    a->addr = sh_addr_make(rt->node_id, id);
    a->state = state;
    a->init_arg = arg;
    atomic_store(&a->life, SH__ACTOR_INIT);
    atomic_store(&a->refs, 1); /* ours until the end of spawn */
    atomic_fetch_add(&rt->actors_live, 1);
    sh_gauge_add(rt->m.actors, 1);
    sh__registry_insert(&rt->reg, a);
    sh__loop_schedule(a); /* runs init on the loop */
    /* A destroy that began after our first check may have missed this actor in its snapshot;
     * the registry's lock orders the two, so re-checking here is enough. */
    if (atomic_load(&rt->stopping)) {
        sh__actor_stop_ref(a);
        sh__actor_release(a);
        return sh__error_set(e, SH_ECLOSED, "spawn: runtime is shutting down");
    }
    sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, vt->name, id, "actor_spawn", "loop=%u",
                 (unsigned)li);
    *addr = a->addr;
    sh__actor_release(a);
    return SH_OK;
}

void sh__actor_retain(sh_actor_ctx *a)
{
    atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
}

void sh__actor_drain(sh_actor_ctx *a, sh_err code)
{
    sh__mpsc_node *n;
    while ((n = sh__mailbox_pop(&a->mbox)) != NULL) {
        atomic_fetch_sub(&a->depth, 1);
        sh__actor_bounce((sh_msg *)n, code);
    }
}

static void actor_free(sh_actor_ctx *a)
{
    sh_runtime *rt = a->rt;
    /* Senders that held a reference may have queued after the stop sequence drained. */
    sh__actor_drain(a, SH_ECLOSED);
    sh__rt_free(rt, a->state); /* only when the actor never reached its loop */
    sh__rt_free(rt, a);
    /* Under the lock: once the count reads zero, destroy may free rt. */
    uv_mutex_lock(&rt->life_mu);
    if (atomic_fetch_sub(&rt->actors_live, 1) == 1)
        uv_cond_broadcast(&rt->life_cv);
    uv_mutex_unlock(&rt->life_mu);
}

void sh__actor_release(sh_actor_ctx *a)
{
    if (atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) == 1)
        actor_free(a);
}

sh_err sh__actor_stop_ref(sh_actor_ctx *a)
{
    int life = atomic_load(&a->life);
    do {
        if (life >= SH__ACTOR_STOPPING)
            return SH_ENOTFOUND;
    } while (!atomic_compare_exchange_weak(&a->life, &life, SH__ACTOR_STOPPING));
    sh_actor_ctx *reg = sh__registry_remove(&a->rt->reg, a->id);
    sh__loop_schedule(a);
    if (reg)
        sh__actor_release(reg);
    return SH_OK;
}

sh_err sh_actor_stop(sh_runtime *rt, sh_addr addr)
{
    if (sh_addr_node(addr) != rt->node_id)
        return SH_EINVAL;
    sh_actor_ctx *a = sh__registry_lookup(&rt->reg, sh_addr_actor(addr));
    if (!a)
        return SH_ENOTFOUND;
    sh_err err = sh__actor_stop_ref(a);
    sh__actor_release(a);
    return err;
}

void sh__actor_finish(struct sh__loop *l, sh_actor_ctx *a)
{
    sh_runtime *rt = a->rt;
    if (a->inited && a->vt->stop) {
        sh__loop_busy_begin(l, a);
        a->vt->stop(a, a->state);
        sh__loop_busy_end(l);
    }
    atomic_store(&a->life, SH__ACTOR_STOPPED);
    sh__session_cancel_actor(l, a);
    sh__timer_cancel_actor(l, a);
    sh__rt_free(rt, a->state);
    a->state = NULL;
    sh_actor_ctx *reg = sh__registry_remove(&rt->reg, a->id);
    if (reg)
        sh__actor_release(reg); /* not the last: the loop still holds its own reference */
    sh__actor_drain(a, SH_ECLOSED);
    sh_gauge_add(rt->m.actors, -1);
    sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, a->vt->name, a->id, "actor_stop", NULL);
}

sh_addr sh_actor_self(const sh_actor_ctx *ctx) { return ctx->addr; }

sh_runtime *sh_actor_runtime(const sh_actor_ctx *ctx) { return ctx->rt; }

uint32_t sh_actor_loop(const sh_actor_ctx *ctx) { return ctx->loop->index; }

uv_loop_t *sh__actor_uv_loop(sh_actor_ctx *ctx) { return &ctx->loop->uv; }

const char *sh_actor_kind(const sh_actor_ctx *ctx) { return ctx->vt->name; }

void sh_actor_log(sh_actor_ctx *ctx, sh_log_level level, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sh__log_vemit(&ctx->rt->log, level, ctx->vt->name, ctx->id, event, fmt, ap);
    va_end(ap);
}
