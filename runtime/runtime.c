/* The runtime object: creation, ordered shutdown, counters, allocation accounting, hooks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "runtime/internal.h"

void *sh__rt_alloc(sh_runtime *rt, size_t n)
{
    void *p = calloc(1, n);
    if (p)
        atomic_fetch_add_explicit(&rt->allocs_live, 1, memory_order_relaxed);
    return p;
}

void *sh__rt_realloc(sh_runtime *rt, void *p, size_t n)
{
    void *q = realloc(p, n);
    if (q && !p)
        atomic_fetch_add_explicit(&rt->allocs_live, 1, memory_order_relaxed);
    return q;
}

void sh__rt_free(sh_runtime *rt, void *p)
{
    if (!p)
        return;
    free(p);
    atomic_fetch_sub_explicit(&rt->allocs_live, 1, memory_order_relaxed);
}

void sh__rt_adopted(sh_runtime *rt)
{
    atomic_fetch_add_explicit(&rt->allocs_live, 1, memory_order_relaxed);
}

uint64_t sh__rt_now(void) { return uv_hrtime(); }

uint32_t sh_runtime_node(const sh_runtime *rt) { return rt->node_id; }

sh_metrics *sh_runtime_metrics(sh_runtime *rt) { return rt->metrics; }

void sh_runtime_log(sh_runtime *rt, sh_log_level level, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sh__log_vemit(&rt->log, level, NULL, 0, event, fmt, ap);
    va_end(ap);
}

/* The runtime's own series, all labelled with the node. */
static sh_err register_metrics(sh_runtime *rt)
{
    char lab[32];
    snprintf(lab, sizeof lab, "node=\"%u\"", (unsigned)rt->node_id);
    struct {
        sh_counter **slot;
        const char *name, *help;
    } cs[] = {
        {&rt->m.sent, "shoal_msgs_sent_total", "Messages accepted for delivery."},
        {&rt->m.undeliverable, "shoal_msgs_undeliverable_total",
         "Messages whose local destination was unknown or stopped."},
        {&rt->m.errors_sent, "shoal_error_replies_total",
         "ERROR answers generated for undeliverable requests."},
        {&rt->m.timeouts, "shoal_request_timeouts_total", "Requests whose deadline passed."},
        {&rt->m.late, "shoal_late_replies_total", "Replies dropped after their request timed out."},
        {&rt->m.stalls, "shoal_actor_stalls_total", "Handle calls past the stall threshold."},
        {&rt->m.overloads, "shoal_mailbox_overloads_total",
         "Mailbox depth crossings of the warning threshold."},
        {&rt->m.pool_hits, "shoal_msg_pool_hits_total", "Message buffers served by the pool."},
        {&rt->m.pool_misses, "shoal_msg_pool_misses_total", "Message buffers that needed malloc."},
        {&rt->m.dropped, "shoal_msgs_filtered_total", "Messages dropped by the send filter."},
        {&rt->m.rejected, "shoal_frames_rejected_total", "Received frames that failed decoding."},
        {&rt->m.corrupt, "shoal_frames_corrupt_total",
         "Received frames whose CRC-32C did not match: dropped unread."},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        sh_err err = sh_metrics_counter(rt->metrics, cs[i].name, cs[i].help, lab, cs[i].slot);
        if (err)
            return err;
    }
    sh_err err = sh__peers_metrics(rt, lab);
    if (err)
        return err;
    return sh_metrics_gauge(rt->metrics, "shoal_actors", "Live actors.", lab, &rt->m.actors);
}

/* Frees what create built, in reverse; every step tolerates a half-built runtime. */
static void teardown(sh_runtime *rt)
{
    sh__loop_watch_stop(rt);
    for (uint32_t i = 0; rt->loops && i < rt->n_loops; i++)
        sh__loop_stop_join(&rt->loops[i]);
    sh_runtime_stats fin;
    sh_runtime_stats_get(rt, &fin); /* the totals, while loops and metrics still exist */
    sh__mailbox_pool_fini(rt);
    sh__registry_fini(&rt->reg);
    sh__rt_free(rt, rt->loops);
    rt->loops = NULL;
    for (uint32_t i = 0; i < rt->n_hooks_old; i++)
        sh__rt_free(rt, rt->hooks_old[i]);
    sh__rt_free(rt, atomic_load(&rt->hooks));
    sh_metrics_destroy(rt->metrics);
    rt->metrics = NULL;
    if (rt->final_stats) {
        /* The live counts after everything was freed: what a leak check looks at. */
        fin.actors_live = atomic_load(&rt->actors_live);
        fin.msgs_live = atomic_load(&rt->msgs_live);
        fin.handles_live = atomic_load(&rt->handles_live);
        fin.allocs_live = atomic_load(&rt->allocs_live);
        fin.threads_live = atomic_load(&rt->threads_live);
        *rt->final_stats = fin;
    }
    uv_mutex_destroy(&rt->kinds_mu);
    uv_mutex_destroy(&rt->pool_mu);
    uv_mutex_destroy(&rt->hooks_mu);
    uv_mutex_destroy(&rt->life_mu);
    uv_cond_destroy(&rt->life_cv);
    uv_mutex_destroy(&rt->wd_mu);
    uv_cond_destroy(&rt->wd_cv);
    sh__peers_fini(&rt->peers);
    free(rt);
}

sh_err sh_runtime_create(const sh_runtime_opts *opts, sh_runtime **out, sh_error *e)
{
    if (!opts || !out)
        return sh__error_set(e, SH_EINVAL, "runtime: NULL options or out");
    if (opts->node_id == 0)
        return sh__error_set(e, SH_EINVAL, "runtime: node_id must be non-zero");
    if (opts->n_loops > 64)
        return sh__error_set(e, SH_EINVAL, "runtime: n_loops %u > 64", (unsigned)opts->n_loops);
    sh_runtime *rt = calloc(1, sizeof *rt);
    if (!rt)
        return sh__error_set(e, SH_ENOMEM, "runtime: out of memory");
    /* The synchronisation objects first, so that teardown can always destroy them. */
    if (uv_mutex_init(&rt->kinds_mu) || uv_mutex_init(&rt->pool_mu) ||
        uv_mutex_init(&rt->hooks_mu) || uv_mutex_init(&rt->life_mu) || uv_cond_init(&rt->life_cv) ||
        uv_mutex_init(&rt->wd_mu) || uv_cond_init(&rt->wd_cv) || sh__peers_init(&rt->peers)) {
        free(rt); /* pthread objects need no destruction on Linux when their init failed */
        return sh__error_set(e, SH_EIO, "runtime: mutex or condition init failed");
    }
    rt->node_id = opts->node_id;
    rt->n_loops = opts->n_loops ? opts->n_loops : 1;
    rt->max_turns = opts->max_turns ? opts->max_turns : 64;
    rt->mailbox_warn = opts->mailbox_warn ? opts->mailbox_warn : 10000;
    rt->stall_ns = (uint64_t)(opts->stall_ms ? opts->stall_ms : 1000) * 1000000u;
    rt->late_grace_ms = opts->late_grace_ms ? opts->late_grace_ms : 60000;
    rt->final_stats = opts->final_stats;
    rt->thread_start = opts->thread_start;
    rt->thread_start_ud = opts->thread_start_ud;
    atomic_store(&rt->next_session, 0);
    char name[64];
    if (opts->name)
        snprintf(name, sizeof name, "%s", opts->name);
    else
        snprintf(name, sizeof name, "node%u", (unsigned)rt->node_id);
    sh__log_init(&rt->log, opts->log_level ? opts->log_level : SH_LOG_LEVEL_INFO, opts->log_fn,
                 opts->log_ud, opts->log_file, name);

    sh_err err = sh_metrics_create(&rt->metrics);
    if (!err)
        err = register_metrics(rt);
    if (!err)
        err = sh__registry_init(&rt->reg, rt);
    if (err) {
        teardown(rt);
        return sh__error_set(e, err, "runtime: %s", sh_strerror(err));
    }
    rt->loops = sh__rt_alloc(rt, rt->n_loops * sizeof *rt->loops);
    if (!rt->loops) {
        teardown(rt);
        return sh__error_set(e, SH_ENOMEM, "runtime: out of memory");
    }
    for (uint32_t i = 0; i < rt->n_loops && !err; i++)
        err = sh__loop_init(rt, &rt->loops[i], i, e);
    for (uint32_t i = 0; i < rt->n_loops && !err; i++)
        err = sh__loop_start(&rt->loops[i], e);
    if (!err)
        err = sh__loop_watch_start(rt, e);
    if (err) {
        teardown(rt);
        return err;
    }
    sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, NULL, 0, "runtime_start", "loops=%u",
                 (unsigned)rt->n_loops);
    *out = rt;
    return SH_OK;
}

typedef struct {
    sh_runtime *rt;
    void (*fn)(void *);
    void *arg;
    uv_mutex_t mu;
    uv_cond_t cv;
    bool placed;
} thread_begin;

static void thread_trampoline(void *p)
{
    thread_begin *b = p;
    sh_runtime *rt = b->rt;
    void (*fn)(void *) = b->fn;
    void *arg = b->arg;
    if (rt->thread_start)
        rt->thread_start(rt->thread_start_ud);
    uv_mutex_lock(&b->mu);
    b->placed = true; /* b lives on the creator's stack: not touched after this */
    uv_cond_signal(&b->cv);
    uv_mutex_unlock(&b->mu);
    fn(arg);
}

int sh__rt_thread_create(sh_runtime *rt, uv_thread_t *t, void (*fn)(void *), void *arg)
{
    thread_begin b = {.rt = rt, .fn = fn, .arg = arg};
    if (uv_mutex_init(&b.mu))
        return UV_ENOMEM;
    if (uv_cond_init(&b.cv)) {
        uv_mutex_destroy(&b.mu);
        return UV_ENOMEM;
    }
    int rc = uv_thread_create(t, thread_trampoline, &b);
    if (!rc) {
        uv_mutex_lock(&b.mu);
        while (!b.placed)
            uv_cond_wait(&b.cv, &b.mu);
        uv_mutex_unlock(&b.mu);
    }
    uv_cond_destroy(&b.cv);
    uv_mutex_destroy(&b.mu);
    return rc;
}

void sh_runtime_destroy(sh_runtime *rt)
{
    if (!rt)
        return;
    /* 1. No new actors; stop every existing one (each runs its stop member on its loop). */
    atomic_store(&rt->stopping, 1);
    sh_actor_ctx **all = NULL;
    size_t n = 0;
    if (sh__registry_snapshot(&rt->reg, &all, &n) == SH_OK) {
        for (size_t i = 0; i < n; i++) {
            sh__actor_stop_ref(all[i]);
            sh__actor_release(all[i]);
        }
        sh__rt_free(rt, all);
    } else {
        /* Out of memory for the snapshot: stop them one id at a time instead. */
        uint32_t last = atomic_load(&rt->next_actor);
        for (uint32_t id = 1; id <= last; id++)
            sh_actor_stop(rt, sh_addr_make(rt->node_id, id));
    }
    /* 2. Wait until every actor is freed: stop members ran, mailboxes drained. Messages sent
     * meanwhile to stopped actors are dropped or answered, so this converges. */
    uv_mutex_lock(&rt->life_mu);
    while (atomic_load(&rt->actors_live) != 0)
        uv_cond_wait(&rt->life_cv, &rt->life_mu);
    uv_mutex_unlock(&rt->life_mu);
    /* 3. No more sends; close handles, join threads, free everything. */
    atomic_store(&rt->closing, 1);
    sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, NULL, 0, "runtime_stop", NULL);
    teardown(rt);
}

void sh_runtime_stats_get(sh_runtime *rt, sh_runtime_stats *out)
{
    memset(out, 0, sizeof *out);
    out->actors_live = atomic_load(&rt->actors_live);
    out->msgs_live = atomic_load(&rt->msgs_live);
    out->handles_live = atomic_load(&rt->handles_live);
    out->allocs_live = atomic_load(&rt->allocs_live);
    out->threads_live = atomic_load(&rt->threads_live);
    for (uint32_t i = 0; rt->loops && i < rt->n_loops; i++)
        out->msgs_handled += atomic_load_explicit(&rt->loops[i].handled_pub, memory_order_relaxed);
    if (!rt->metrics || !rt->m.actors)
        return; /* metrics gone (destroy) or never fully made */
    out->msgs_sent = sh_counter_value(rt->m.sent);
    out->undeliverable = sh_counter_value(rt->m.undeliverable);
    out->errors_sent = sh_counter_value(rt->m.errors_sent);
    out->timeouts = sh_counter_value(rt->m.timeouts);
    out->late_replies = sh_counter_value(rt->m.late);
    out->stalls = sh_counter_value(rt->m.stalls);
    out->overloads = sh_counter_value(rt->m.overloads);
    out->pool_hits = sh_counter_value(rt->m.pool_hits);
    out->pool_misses = sh_counter_value(rt->m.pool_misses);
    out->corrupt = sh_counter_value(rt->m.corrupt);
}

sh_err sh_transport_set(sh_runtime *rt, const sh_transport_hooks *hooks)
{
    sh_transport_hooks *copy = NULL;
    if (hooks) {
        copy = sh__rt_alloc(rt, sizeof *copy);
        if (!copy)
            return SH_ENOMEM;
        *copy = *hooks;
    }
    uv_mutex_lock(&rt->hooks_mu);
    if (rt->n_hooks_old == sizeof rt->hooks_old / sizeof rt->hooks_old[0]) {
        uv_mutex_unlock(&rt->hooks_mu);
        sh__rt_free(rt, copy);
        return SH_ENOMEM; /* installs are for setup, not a hot path */
    }
    sh_transport_hooks *old = atomic_exchange(&rt->hooks, copy);
    if (old)
        rt->hooks_old[rt->n_hooks_old++] = old;
    /* Grace period: senders that may have loaded the old set counted themselves on the side
     * that was current before this flip; wait until that side is empty (runtime/internal.h). */
    int side = (int)(atomic_fetch_add(&rt->hook_gen, 1) & 1);
    while (atomic_load(&rt->hook_users[side]) > 0) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    uv_mutex_unlock(&rt->hooks_mu);
    return SH_OK;
}
