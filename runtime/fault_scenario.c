/* The scenario runner: timed fault events applied to fault layers or handed to the host. */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "base/error.h"
#include "runtime/fault_scenario.h"

struct sh_fault_runner {
    sh_fault_event *events; /* (n) */
    size_t n;
    sh_fault **layers; /* (n_layers) */
    size_t n_layers;
    sh_fault_host host;
    int64_t start_ns;   /* CLOCK_MONOTONIC ns of time 0; may lie before the clock's 0 */
    int64_t started_ns; /* CLOCK_MONOTONIC ns when the runner started */
    uv_mutex_t mu;      /* below */
    uv_cond_t cv;
    bool stop;
    size_t applied, failed;
    uv_thread_t thread;
};

/* A name as a node set: "*" is any (n = 0). */
static sh_err node_set(const char *name, const sh_fault_host *host, uint32_t *set, uint32_t *n,
                       sh_error *e)
{
    *n = 0;
    if (name[0] == '\0' || strcmp(name, "*") == 0)
        return SH_OK;
    uint32_t id = host && host->node_id ? host->node_id(host->ud, name) : 0;
    if (id == 0)
        return sh__error_set(e, SH_ENOTFOUND, "fault: unknown node '%s'", name);
    set[0] = id;
    *n = 1;
    return SH_OK;
}

sh_err sh_fault_event_apply(const sh_fault_event *ev, sh_fault *const *layers, size_t n_layers,
                            const sh_fault_host *host, sh_error *e)
{
    if (ev->kind == SH_FAULT_KILL) {
        if (!host || !host->kill)
            return sh__error_set(e, SH_EUNSUPPORTED, "fault: no kill callback (line %d)",
                                 (int)ev->line);
        return host->kill(host->ud, ev->from);
    }
    if (ev->kind == SH_FAULT_STALL) {
        if (!host || !host->stall)
            return sh__error_set(e, SH_EUNSUPPORTED, "fault: no stall callback (line %d)",
                                 (int)ev->line);
        return host->stall(host->ud, ev->from, ev->ms);
    }
    if (ev->kind == SH_FAULT_STOP || ev->kind == SH_FAULT_CONT) {
        if (!host || !host->stop_cont)
            return sh__error_set(e, SH_EUNSUPPORTED, "fault: no stop/cont callback (line %d)",
                                 (int)ev->line);
        return host->stop_cont(host->ud, ev->from, ev->kind, ev->lasting_s);
    }
    if (ev->kind == SH_FAULT_LEAK) {
        if (!host || !host->leak)
            return sh__error_set(e, SH_EUNSUPPORTED, "fault: no leak callback (line %d)",
                                 (int)ev->line);
        return host->leak(host->ud, ev->from, ev->mb_per_s, ev->lasting_s);
    }
    sh_fault_rule r = {.p = ev->p, .type = ev->type};
    sh_err err = node_set(ev->from, host, r.from, &r.n_from, e);
    if (!err)
        err = node_set(ev->to, host, r.to, &r.n_to, e);
    if (err)
        return err;
    if (ev->kind == SH_FAULT_HEAL) {
        for (size_t i = 0; i < n_layers; i++)
            sh_fault_heal(layers[i], r.from, r.n_from, r.to, r.n_to);
        return SH_OK;
    }
    switch (ev->kind) {
    case SH_FAULT_DELAY:
        r.action = SH_FAULT_ACTION_DELAY;
        r.delay_ms = (uint32_t)(ev->ms + 0.5);
        break;
    case SH_FAULT_DROP:
        r.action = SH_FAULT_ACTION_DROP;
        break;
    case SH_FAULT_DUPLICATE:
        r.action = SH_FAULT_ACTION_DUPLICATE;
        break;
    case SH_FAULT_CORRUPT:
        r.action = SH_FAULT_ACTION_CORRUPT;
        r.bytes = ev->bytes > 0 ? (uint32_t)ev->bytes : 1;
        break;
    default:
        r.action = SH_FAULT_ACTION_PARTITION;
        r.p = 1.0;
        break;
    }
    r.lasting_s = isfinite(ev->lasting_s) ? ev->lasting_s : 0;
    for (size_t i = 0; i < n_layers; i++)
        if ((err = sh_fault_rule_add(layers[i], &r, NULL, e)) != SH_OK)
            return err;
    return SH_OK;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void runner_main(void *arg)
{
    sh_fault_runner *r = arg;
    uv_mutex_lock(&r->mu);
    for (size_t i = 0; i < r->n && !r->stop;) {
        const sh_fault_event *ev = &r->events[i];
        int64_t due = r->start_ns + (int64_t)(ev->time_s * 1e9);
        int64_t now = (int64_t)mono_ns();
        if (due > now) {
            (void)uv_cond_timedwait(&r->cv, &r->mu, (uint64_t)(due - now));
            continue;
        }
        // A link rule that ended before now (a process started after the shared epoch) is
        // skipped: applied now it would hold for its whole length again. So is a leak that began
        // more than a second before this process started: its restart is what cures it.
        bool over = (ev->kind >= SH_FAULT_DELAY && ev->kind <= SH_FAULT_PARTITION &&
                     ev->lasting_s > 0 && due + (int64_t)(ev->lasting_s * 1e9) <= now) ||
                    (ev->kind == SH_FAULT_LEAK && due + (int64_t)1000000000 < r->started_ns);
        uv_mutex_unlock(&r->mu);
        sh_error e;
        sh_err err = over ? SH_OK : sh_fault_event_apply(ev, r->layers, r->n_layers, &r->host, &e);
        uv_mutex_lock(&r->mu);
        if (err)
            r->failed++;
        r->applied++;
        i++;
        uv_cond_broadcast(&r->cv);
    }
    uv_mutex_unlock(&r->mu);
}

static sh_err start_at(const sh_scenario *s, sh_fault *const *layers, size_t n_layers,
                       const sh_fault_host *host, int64_t start_ns, sh_fault_runner **out,
                       sh_error *e)
{
    sh_fault_runner *r = calloc(1, sizeof *r);
    if (!r)
        return sh__error_set(e, SH_ENOMEM, "fault runner: out of memory");
    r->n = s->n_events;
    r->events = malloc((r->n ? r->n : 1) * sizeof *r->events);
    r->layers = malloc((n_layers ? n_layers : 1) * sizeof *r->layers);
    if (!r->events || !r->layers) {
        free(r->events);
        free(r->layers);
        free(r);
        return sh__error_set(e, SH_ENOMEM, "fault runner: out of memory");
    }
    if (r->n)
        memcpy(r->events, s->events, r->n * sizeof *r->events);
    if (n_layers)
        memcpy(r->layers, layers, n_layers * sizeof *r->layers);
    r->n_layers = n_layers;
    if (host)
        r->host = *host;
    uv_mutex_init(&r->mu);
    uv_cond_init(&r->cv);
    r->start_ns = start_ns;
    r->started_ns = (int64_t)mono_ns();
    int rv = uv_thread_create(&r->thread, runner_main, r);
    if (rv) {
        uv_cond_destroy(&r->cv);
        uv_mutex_destroy(&r->mu);
        free(r->events);
        free(r->layers);
        free(r);
        return sh__error_set(e, SH_EIO, "fault runner: thread: %s", uv_strerror(rv));
    }
    *out = r;
    return SH_OK;
}

sh_err sh_fault_runner_start(const sh_scenario *s, sh_fault *const *layers, size_t n_layers,
                             const sh_fault_host *host, sh_fault_runner **out, sh_error *e)
{
    return start_at(s, layers, n_layers, host, (int64_t)mono_ns(), out, e);
}

sh_err sh_fault_runner_start_at(const sh_scenario *s, sh_fault *const *layers, size_t n_layers,
                                const sh_fault_host *host, uint64_t epoch_unix_ms,
                                sh_fault_runner **out, sh_error *e)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t wall_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    int64_t ahead_ms = (int64_t)epoch_unix_ms - wall_ms; /* negative: the epoch is past */
    return start_at(s, layers, n_layers, host, (int64_t)mono_ns() + ahead_ms * 1000000, out, e);
}

sh_err sh_fault_runner_wait(sh_fault_runner *r, uint32_t timeout_ms)
{
    uint64_t end = mono_ns() + (uint64_t)timeout_ms * 1000000u;
    uv_mutex_lock(&r->mu);
    while (r->applied < r->n) {
        uint64_t now = mono_ns();
        if (now >= end)
            break;
        (void)uv_cond_timedwait(&r->cv, &r->mu, end - now);
    }
    bool done = r->applied >= r->n;
    uv_mutex_unlock(&r->mu);
    return done ? SH_OK : SH_ETIMEDOUT;
}

void sh_fault_runner_counts(sh_fault_runner *r, size_t *applied, size_t *failed)
{
    uv_mutex_lock(&r->mu);
    *applied = r->applied;
    *failed = r->failed;
    uv_mutex_unlock(&r->mu);
}

void sh_fault_runner_destroy(sh_fault_runner *r)
{
    if (!r)
        return;
    uv_mutex_lock(&r->mu);
    r->stop = true;
    uv_cond_broadcast(&r->cv);
    uv_mutex_unlock(&r->mu);
    uv_thread_join(&r->thread);
    uv_cond_destroy(&r->cv);
    uv_mutex_destroy(&r->mu);
    free(r->events);
    free(r->layers);
    free(r);
}
