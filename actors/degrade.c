/* The degradation ladder (actors/degrade.h): metrics gathered from the registry, the policy's
 * level(m) with hysteresis, the level published to the gateway, and its effects on a request. */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "actors/degrade.h"
#include "base/error.h"

#define WINDOW_MS 5000 /* the percentiles' and the rate's window */
#define SNAP_EVERY_MS 500
#define N_SNAPS 16 /* covers 8 s at one snapshot per 500 ms */
#define MAX_BUCKETS (SH_HISTOGRAM_MAX_BUCKETS + 1)
#define MAX_PAIRS 48
#define MAX_UNHEALTHY 64

static const char *const EFFECTS[4] = {"logprobs", "max_tokens", "fallback", "shed"};

/* The names gather() passes to level(m), in its order. */
static const char *const NAMES[] = {
    "queue_wait_p50_ms", "queue_wait_p99_ms", "ttft_p50_ms",  "ttft_p99_ms", "step_latency_p99_ms",
    "queue_depth",       "running_seqs",      "requests",     "kv_used",     "tokens_per_s",
    "replicas",          "healthy_replicas",  "front_rss_mb", "level"};

/* One histogram family, summed over its series. */
typedef struct hsum {
    uint32_t n_bounds;
    double bounds[SH_HISTOGRAM_MAX_BUCKETS];
    uint64_t counts[MAX_BUCKETS];
} hsum;

typedef struct snap {
    uint64_t t_ms;
    double generated;
    hsum ttft, step, qwait;
} snap;

/* What one pass over the registry found. */
typedef struct gathered {
    double waiting, running, kv_used, kv_total, generated;
    int32_t batchers, paused, routed, unrouted;
    int32_t n_bad; /* label sets of replicas paused or out of routing */
    char bad[MAX_UNHEALTHY][48];
    hsum ttft, step, qwait;
} gathered;

struct sh_degrade {
    sh_degrade_opts o;
    char *policy_path; /* NULL: the built-in default */
    char *fallback;
    pthread_mutex_t mu; /* the policy, the hysteresis and the snapshots: tick against reload */
    sh_policy *pol;
    _Atomic int32_t level;
    bool holding;     /* level() answered lower than the level at every tick since hold_t */
    uint64_t hold_t;  /* when that began */
    int32_t hold_max; /* the highest of those answers */
    char last_err[sizeof(
        ((sh_error *)0)->msg)]; /* the last error logged; "" after a successful call */
    snap snaps[N_SNAPS];        /* ring, oldest first from snap_head */
    int32_t n_snaps, snap_head;
    gathered g;
    sh_policy_metric pairs[MAX_PAIRS];
    sh_gauge *m_level;
    sh_counter *m_eff[4], *m_errors, *m_reload_ok, *m_reload_err;
};

/* ---- metrics from the registry ------------------------------------------------------------ */

static void hsum_add(hsum *h, const sh_metric_sample *s)
{
    if (s->n_bounds == 0 || s->n_bounds > SH_HISTOGRAM_MAX_BUCKETS)
        return;
    if (h->n_bounds == 0) {
        h->n_bounds = s->n_bounds;
        memcpy(h->bounds, s->bounds, s->n_bounds * sizeof h->bounds[0]);
    } else if (h->n_bounds != s->n_bounds) {
        return; /* a series with other bounds cannot be summed bucket by bucket */
    }
    for (uint32_t i = 0; i <= s->n_bounds; i++)
        h->counts[i] += s->counts[i];
}

static void mark_bad(gathered *g, const char *labels)
{
    const char *l = labels ? labels : "";
    for (int32_t i = 0; i < g->n_bad; i++)
        if (!strncmp(g->bad[i], l, sizeof g->bad[i] - 1))
            return;
    if (g->n_bad < MAX_UNHEALTHY)
        snprintf(g->bad[g->n_bad++], sizeof g->bad[0], "%s", l);
}

static void visit(void *arg, const sh_metric_sample *s)
{
    gathered *g = arg;
    const char *n = s->name;
    if (!strcmp(n, "shoal_requests_waiting"))
        g->waiting += s->value;
    else if (!strcmp(n, "shoal_requests_running"))
        g->running += s->value;
    else if (!strcmp(n, "shoal_kv_blocks_used"))
        g->kv_used += s->value;
    else if (!strcmp(n, "shoal_kv_blocks_total"))
        g->kv_total += s->value;
    else if (!strcmp(n, "shoal_generation_tokens_total"))
        g->generated += s->value;
    else if (!strcmp(n, "shoal_batcher_paused")) {
        g->batchers++;
        if (s->value != 0) {
            g->paused++;
            mark_bad(g, s->labels);
        }
    } else if (!strcmp(n, "shoal_router_healthy")) {
        g->routed++;
        if (s->value == 0) {
            g->unrouted++;
            mark_bad(g, s->labels);
        }
    } else if (!strcmp(n, "shoal_time_to_first_token_seconds") && s->kind == SH_METRIC_HISTOGRAM)
        hsum_add(&g->ttft, s);
    else if (!strcmp(n, "shoal_step_seconds") && s->kind == SH_METRIC_HISTOGRAM)
        hsum_add(&g->step, s);
    else if (!strcmp(n, "shoal_queue_wait_seconds") && s->kind == SH_METRIC_HISTOGRAM)
        hsum_add(&g->qwait, s);
}

/* The q-quantile of the observations in now minus base, in the histogram's unit, interpolated
 * linearly inside its bucket as Prometheus's histogram_quantile does; 0 with no observations. */
static double quantile(const hsum *now, const hsum *base, double q)
{
    uint32_t n = now->n_bounds;
    bool same = base->n_bounds == n;
    uint64_t d[MAX_BUCKETS], total = 0;
    for (uint32_t i = 0; i <= n; i++) {
        uint64_t b = same && base->counts[i] <= now->counts[i] ? base->counts[i] : 0;
        d[i] = now->counts[i] - b;
        total += d[i];
    }
    if (total == 0)
        return 0;
    double rank = q * (double)total, seen = 0;
    for (uint32_t i = 0; i <= n; i++) {
        if (seen + (double)d[i] >= rank && d[i] > 0) {
            if (i == n) /* the +Inf bucket: its lower bound is all that is known */
                return n ? now->bounds[n - 1] : 0;
            double lo = i ? now->bounds[i - 1] : 0, hi = now->bounds[i];
            return lo + (hi - lo) * (rank - seen) / (double)d[i];
        }
        seen += (double)d[i];
    }
    return n ? now->bounds[n - 1] : 0;
}

static double rss_mb(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (!f)
        return 0;
    int got = fscanf(f, "%llu %llu", &size, &res);
    fclose(f);
    return got == 2 ? (double)res * (double)sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0) : 0;
}

/* Reads the registry and fills d->pairs; returns how many. Under d->mu. */
static size_t gather(sh_degrade *d, uint64_t now_ms)
{
    gathered *g = &d->g;
    memset(g, 0, sizeof *g);
    sh_metrics_foreach(sh_runtime_metrics(d->o.rt), visit, g);
    // The window's base: the newest snapshot at least WINDOW_MS old, else the oldest there is.
    const snap *base = NULL;
    for (int32_t i = 0; i < d->n_snaps; i++) {
        const snap *s = &d->snaps[(d->snap_head + i) % N_SNAPS];
        if (!base || now_ms - s->t_ms >= WINDOW_MS)
            base = s;
    }
    snap cur = {.t_ms = now_ms,
                .generated = g->generated,
                .ttft = g->ttft,
                .step = g->step,
                .qwait = g->qwait};
    if (!base)
        base = &cur;
    double ttft50 = quantile(&g->ttft, &base->ttft, 0.50) * 1000;
    double ttft99 = quantile(&g->ttft, &base->ttft, 0.99) * 1000;
    double step99 = quantile(&g->step, &base->step, 0.99) * 1000;
    double wait50 = quantile(&g->qwait, &base->qwait, 0.50) * 1000;
    double wait99 = quantile(&g->qwait, &base->qwait, 0.99) * 1000;
    double dt = (double)(now_ms - base->t_ms) / 1000.0;
    double tps =
        dt > 0 && g->generated >= base->generated ? (g->generated - base->generated) / dt : 0;
    int32_t last = d->n_snaps ? (d->snap_head + d->n_snaps - 1) % N_SNAPS : -1;
    if (last < 0 || now_ms - d->snaps[last].t_ms >= SNAP_EVERY_MS) {
        if (d->n_snaps == N_SNAPS) {
            d->snaps[d->snap_head] = cur;
            d->snap_head = (d->snap_head + 1) % N_SNAPS;
        } else {
            d->snaps[(d->snap_head + d->n_snaps++) % N_SNAPS] = cur;
        }
    }
    int32_t replicas = g->batchers;
    int32_t healthy = replicas - g->n_bad;
    if (healthy < 0)
        healthy = 0;
    const double v[] = {wait50,
                        wait99,
                        ttft50,
                        ttft99,
                        step99,
                        g->waiting,
                        g->running,
                        g->waiting + g->running,
                        g->kv_total > 0 ? g->kv_used / g->kv_total : 0,
                        tps,
                        replicas,
                        healthy,
                        rss_mb(),
                        atomic_load(&d->level)};
    _Static_assert(sizeof v / sizeof v[0] == sizeof NAMES / sizeof NAMES[0], "one value a name");
    size_t n = sizeof NAMES / sizeof NAMES[0];
    sh_policy_metric *p = d->pairs;
    for (size_t i = 0; i < n; i++)
        p[i] = (sh_policy_metric){NAMES[i], v[i]};
    if (d->o.extra)
        n += d->o.extra(d->o.extra_user, p + n, MAX_PAIRS - n);
    return n;
}

/* "name=value ..." of the metrics, for the log and the events. */
static void format_pairs(const sh_policy_metric *p, size_t n, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && len + 1 < cap; i++) {
        int w = snprintf(buf + len, cap - len, "%s%s=%.6g", i ? " " : "", p[i].name, p[i].value);
        if (w < 0)
            break;
        len += (size_t)w;
    }
}

/* ---- create, tick, reload ----------------------------------------------------------------- */

static sh_err load_policy(sh_degrade *d, sh_policy *p, sh_error *e)
{
    return d->policy_path ? sh_policy_load_file(p, d->policy_path, e)
                          : sh_policy_load_default(p, e);
}

sh_err sh__degrade_create(const sh_degrade_opts *o, sh_degrade **out, sh_error *e)
{
    *out = NULL;
    if (!o || !o->rt)
        return sh__error_set(e, SH_EINVAL, "degrade: no runtime");
    if (o->max_tokens < 0 || o->shed_priority < 0 || o->shed_priority > 256)
        return sh__error_set(e, SH_EINVAL,
                             "degrade: max_tokens %d or shed_priority %d out of range",
                             (int)o->max_tokens, (int)o->shed_priority);
    sh_degrade *d = calloc(1, sizeof *d);
    if (!d)
        return sh__error_set(e, SH_ENOMEM, "degrade: out of memory");
    d->o = *o;
    if (!d->o.max_tokens)
        d->o.max_tokens = 64;
    if (!d->o.retry_after_s)
        d->o.retry_after_s = d->o.hold_ms ? (d->o.hold_ms + 999) / 1000 : 1;
    bool builtin =
        !o->policy || !strcmp(o->policy, "default") || !strcmp(o->policy, "lua/policy/default.lua");
    if ((!builtin && !(d->policy_path = strdup(o->policy))) ||
        (o->fallback && !(d->fallback = strdup(o->fallback)))) {
        sh__degrade_destroy(d);
        return sh__error_set(e, SH_ENOMEM, "degrade: out of memory");
    }
    d->o.policy = d->policy_path ? d->policy_path : "default";
    d->o.fallback = d->fallback;
    pthread_mutex_init(&d->mu, NULL);
    // The first load's trial call gets every name a tick passes (at 0), not only the struct's.
    size_t nz = sizeof NAMES / sizeof NAMES[0];
    for (size_t i = 0; i < nz; i++)
        d->pairs[i] = (sh_policy_metric){NAMES[i], 0};
    if (o->extra)
        nz += o->extra(o->extra_user, d->pairs + nz, MAX_PAIRS - nz);
    for (size_t i = sizeof NAMES / sizeof NAMES[0]; i < nz; i++)
        d->pairs[i].value = 0;
    sh_err err = sh_policy_create(NULL, &d->pol, e);
    if (!err)
        err = sh_policy_set_trial(d->pol, d->pairs, nz, e);
    if (!err)
        err = load_policy(d, d->pol, e);
    sh_metrics *mx = sh_runtime_metrics(o->rt);
    if (!err)
        err = sh_metrics_gauge(mx, "shoal_degradation_level",
                               "The degradation level in force (0 normal .. 4 shedding).", NULL,
                               &d->m_level);
    for (int i = 0; !err && i < 4; i++) {
        char lb[32];
        snprintf(lb, sizeof lb, "effect=\"%s\"", EFFECTS[i]);
        err = sh_metrics_counter(mx, "shoal_degraded_requests_total",
                                 "Requests changed by the degradation ladder, by effect.", lb,
                                 &d->m_eff[i]);
    }
    if (!err)
        err = sh_metrics_counter(mx, "shoal_policy_errors_total",
                                 "Policy evaluations that failed (the level was kept).", NULL,
                                 &d->m_errors);
    if (!err)
        err = sh_metrics_counter(mx, "shoal_policy_reloads_total", "Policy reloads, by result.",
                                 "result=\"ok\"", &d->m_reload_ok);
    if (!err)
        err = sh_metrics_counter(mx, "shoal_policy_reloads_total", "Policy reloads, by result.",
                                 "result=\"error\"", &d->m_reload_err);
    if (err) {
        if (e && !e->msg[0])
            sh__error_set(e, err, "degrade: cannot register the metrics");
        sh__degrade_destroy(d);
        return err;
    }
    sh_gauge_set(d->m_level, 0);
    *out = d;
    return SH_OK;
}

void sh__degrade_destroy(sh_degrade *d)
{
    if (!d)
        return;
    if (d->pol) {
        sh_policy_destroy(d->pol);
        pthread_mutex_destroy(&d->mu);
    }
    free(d->policy_path);
    free(d->fallback);
    free(d);
}

static void note(sh_degrade *d, const char *kind, const char *msg)
{
    if (d->o.note)
        d->o.note(d->o.note_user, kind, msg);
}

/* Publishes a new level: the atomic, the gauge, one log line and one event. */
static void set_level(sh_degrade *d, int32_t from, int32_t to, const char *why,
                      const sh_policy_metric *p, size_t n)
{
    char mbuf[1024], ev[240];
    atomic_store(&d->level, to);
    sh_gauge_set(d->m_level, to);
    format_pairs(p, n, mbuf, sizeof mbuf);
    sh_runtime_log(d->o.rt, to > from ? SH_LOG_LEVEL_WARN : SH_LOG_LEVEL_INFO, "degradation_level",
                   "from=%d to=%d why=\"%s\" policy=\"%s\" %s", (int)from, (int)to, why,
                   d->o.policy, mbuf);
    snprintf(ev, sizeof ev, "%d -> %d (%.40s): %.180s", (int)from, (int)to, why, mbuf);
    note(d, "level", ev);
}

void sh__degrade_tick(sh_degrade *d, uint64_t now_ms)
{
    pthread_mutex_lock(&d->mu);
    size_t n = gather(d, now_ms);
    int32_t cur = atomic_load(&d->level), got = -1;
    sh_error e = {0};
    sh_err err = sh_policy_level_pairs(d->pol, d->pairs, n, &got, &e);
    if (err) {
        // The level stays; a hold in progress starts over (a drop needs an unbroken run of lower
        // answers). One log line per distinct error, not one per tick.
        sh_counter_add(d->m_errors, 1);
        d->holding = false;
        if (strcmp(d->last_err, e.msg) != 0) {
            snprintf(d->last_err, sizeof d->last_err, "%s", e.msg);
            sh_runtime_log(d->o.rt, SH_LOG_LEVEL_ERROR, "policy_error",
                           "policy=\"%s\" level=%d kept=true err=\"%s\"", d->o.policy, (int)cur,
                           e.msg);
            char ev[240];
            snprintf(ev, sizeof ev, "level(m) failed, level %d kept: %.190s", (int)cur, e.msg);
            note(d, "policy", ev);
        }
        pthread_mutex_unlock(&d->mu);
        return;
    }
    if (d->last_err[0]) {
        sh_runtime_log(d->o.rt, SH_LOG_LEVEL_INFO, "policy_ok", "policy=\"%s\" level=%d",
                       d->o.policy, (int)got);
        d->last_err[0] = '\0';
    }
    if (got > cur) {
        d->holding = false;
        set_level(d, cur, got, "up", d->pairs, n);
    } else if (got == cur) {
        d->holding = false;
    } else if (!d->holding) {
        d->holding = true;
        d->hold_t = now_ms;
        d->hold_max = got;
    } else {
        if (got > d->hold_max)
            d->hold_max = got;
        if (now_ms - d->hold_t >= d->o.hold_ms) {
            char why[64];
            snprintf(why, sizeof why, "below for %.1f s", (double)(now_ms - d->hold_t) / 1000.0);
            set_level(d, cur, d->hold_max, why, d->pairs, n);
            d->holding = false;
        }
    }
    // hold_ms 0: a lower answer takes effect at once.
    if (d->holding && d->o.hold_ms == 0) {
        set_level(d, cur, d->hold_max, "below", d->pairs, n);
        d->holding = false;
    }
    pthread_mutex_unlock(&d->mu);
}

void sh__degrade_tick_cb(void *user, uint64_t now_ms) { sh__degrade_tick(user, now_ms); }

sh_err sh__degrade_reload(sh_degrade *d, char *msg, size_t cap)
{
    sh_error e = {0};
    char ev[240];
    pthread_mutex_lock(&d->mu);
    sh_err err = load_policy(d, d->pol, &e);
    if (!err)
        d->last_err[0] = '\0'; /* the new script's errors are news */
    pthread_mutex_unlock(&d->mu);
    if (err) {
        sh_counter_add(d->m_reload_err, 1);
        sh_runtime_log(d->o.rt, SH_LOG_LEVEL_ERROR, "policy_reload",
                       "policy=\"%s\" ok=false kept=old err=\"%s\"", d->o.policy, e.msg);
        snprintf(msg, cap, "not reloaded, the old policy stays: %.400s", e.msg);
    } else {
        sh_counter_add(d->m_reload_ok, 1);
        sh_runtime_log(d->o.rt, SH_LOG_LEVEL_INFO, "policy_reload", "policy=\"%s\" ok=true",
                       d->o.policy);
        snprintf(msg, cap, "reloaded %s", d->o.policy);
    }
    snprintf(ev, sizeof ev, "%.230s", msg);
    note(d, "policy", ev);
    return err;
}

int32_t sh__degrade_level(const sh_degrade *d) { return atomic_load(&((sh_degrade *)d)->level); }

const char *sh__degrade_policy(const sh_degrade *d) { return d->o.policy; }

const char *sh__degrade_fallback(const sh_degrade *d) { return d->fallback; }

void sh__degrade_settings(const sh_degrade *d, sh_degrade_settings *out)
{
    *out = (sh_degrade_settings){.hold_ms = d->o.hold_ms,
                                 .retry_after_s = d->o.retry_after_s,
                                 .max_tokens = d->o.max_tokens,
                                 .shed_priority = d->o.shed_priority};
}

/* ---- effects on a request ----------------------------------------------------------------- */

/* Appends one effect (", "-separated) to the X-Shoal-Degraded value. */
static void header_add(sh_degrade_effect *out, const char *what)
{
    size_t len = strlen(out->header);
    snprintf(out->header + len, sizeof out->header - len, "%s%s", len ? ", " : "", what);
}

void sh__degrade_apply(sh_degrade *d, sh_openai_request *q, int32_t key_prio,
                       const char *fallback_name, sh_degrade_effect *out)
{
    memset(out, 0, sizeof *out);
    out->priority = q->priority > key_prio ? q->priority : key_prio;
    if (!d)
        return;
    int32_t level = sh__degrade_level(d);
    out->level = level;
    if (level >= 4 && out->priority >= d->o.shed_priority) {
        out->what = SH_DEGRADE_SHED;
        out->retry_after_s = d->o.retry_after_s;
        out->shed_priority = d->o.shed_priority;
        header_add(out, "shed");
        sh_counter_add(d->m_eff[3], 1);
        return;
    }
    if (level >= 1 && q->logprobs) {
        q->logprobs = false;
        q->top_logprobs = 0;
        out->what |= SH_DEGRADE_LOGPROBS;
        header_add(out, "logprobs");
        sh_counter_add(d->m_eff[0], 1);
    }
    if (level >= 2 && q->max_tokens > d->o.max_tokens) {
        q->max_tokens = d->o.max_tokens;
        if (q->min_tokens > q->max_tokens)
            q->min_tokens = q->max_tokens;
        out->what |= SH_DEGRADE_MAX_TOKENS;
        char what[48];
        snprintf(what, sizeof what, "max_tokens=%d", (int)d->o.max_tokens);
        header_add(out, what);
        sh_counter_add(d->m_eff[1], 1);
    }
    bool ids = q->kind == SH_OPENAI_COMPLETION && !q->prompt;
    if (level >= 3 && fallback_name && !ids && (!q->model || strcmp(q->model, fallback_name))) {
        q->model = fallback_name;
        out->what |= SH_DEGRADE_FALLBACK;
        char what[96];
        snprintf(what, sizeof what, "model=%.80s", fallback_name);
        header_add(out, what);
        sh_counter_add(d->m_eff[2], 1);
    }
}

/* ---- the "degrade" actor ------------------------------------------------------------------ */

typedef struct degrade_actor {
    sh_degrade *d;
} degrade_actor;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static sh_err degrade_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    degrade_actor *a = state;
    if (!arg)
        return SH_EINVAL;
    a->d = arg;
    uint32_t ms = a->d->o.tick_ms ? a->d->o.tick_ms : 100;
    return sh_actor_timer_start(ctx, ms, ms, 0, NULL);
}

static sh_msg_fate degrade_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    (void)ctx;
    (void)state;
    (void)msg;
    return SH_MSG_FATE_DONE;
}

static void degrade_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)ctx;
    (void)tag;
    degrade_actor *a = state;
    sh__degrade_tick(a->d, mono_ms());
}

const sh_actor_vtable sh__degrade_vtable = {
    .name = "degrade",
    .state_size = sizeof(degrade_actor),
    .init = degrade_init,
    .handle = degrade_handle,
    .timer = degrade_timer,
};
