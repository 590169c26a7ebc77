/* The stall watchdog: a thread that reports actors stuck in one vtable call past a threshold. */
#include "base/error.h"
#include "runtime/internal.h"

/* Why a thread and not a timer on each loop: a stuck handler blocks its own loop, so only
 * another thread can notice. Each loop publishes "busy since" and a call sequence number around
 * every vtable call (sh__loop_busy_begin/end); the watchdog samples them a few times per
 * threshold and reports each stuck call once. It never touches the actor itself, only the
 * vtable pointer (static, outliving the runtime) and the id the loop published. */

static void check(sh_runtime *rt)
{
    uint64_t now = sh__rt_now();
    for (uint32_t i = 0; i < rt->n_loops; i++) {
        struct sh__loop *l = &rt->loops[i];
        uint64_t seq = atomic_load_explicit(&l->busy_seq, memory_order_acquire);
        uint64_t since = atomic_load_explicit(&l->busy_since, memory_order_acquire);
        if (since == 0 || now < since || now - since <= rt->stall_ns || seq == l->stall_seen)
            continue;
        l->stall_seen = seq;
        const sh_actor_vtable *vt = atomic_load_explicit(&l->busy_vt, memory_order_relaxed);
        uint32_t id = atomic_load_explicit(&l->busy_id, memory_order_relaxed);
        sh_counter_add(rt->m.stalls, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_WARN, vt ? vt->name : "?", id, "actor_stall",
                     "loop=%u busy_ms=%llu threshold_ms=%llu", (unsigned)i,
                     (unsigned long long)((now - since) / 1000000u),
                     (unsigned long long)(rt->stall_ns / 1000000u));
    }
}

static void watch_main(void *arg)
{
    sh_runtime *rt = arg;
    uint64_t period = rt->stall_ns / 4;
    if (period < 1000000u)
        period = 1000000u;
    if (period > 100000000u)
        period = 100000000u;
    uv_mutex_lock(&rt->wd_mu);
    while (!rt->wd_quit) {
        uv_cond_timedwait(&rt->wd_cv, &rt->wd_mu, period);
        if (rt->wd_quit)
            break;
        uv_mutex_unlock(&rt->wd_mu);
        check(rt);
        uv_mutex_lock(&rt->wd_mu);
    }
    uv_mutex_unlock(&rt->wd_mu);
}

sh_err sh__loop_watch_start(sh_runtime *rt, sh_error *e)
{
    int rc = sh__rt_thread_create(rt, &rt->wd_thread, watch_main, rt);
    if (rc)
        return sh__error_set(e, SH_EIO, "watchdog: uv_thread_create: %s", uv_strerror(rc));
    rt->wd_ok = true;
    atomic_fetch_add(&rt->threads_live, 1);
    return SH_OK;
}

void sh__loop_watch_stop(sh_runtime *rt)
{
    if (!rt->wd_ok)
        return;
    uv_mutex_lock(&rt->wd_mu);
    rt->wd_quit = true;
    uv_cond_signal(&rt->wd_cv);
    uv_mutex_unlock(&rt->wd_mu);
    uv_thread_join(&rt->wd_thread);
    rt->wd_ok = false;
    atomic_fetch_sub(&rt->threads_live, 1);
}
