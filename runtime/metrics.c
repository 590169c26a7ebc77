/* Counters, gauges and fixed-bucket histograms per registry, and their Prometheus text form. */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "shoal/runtime.h"

/* Updates are single relaxed atomics on the series itself (no lock, no per-thread shards: the
 * runtime's hot counters are few and a contended add costs tens of nanoseconds). Registration
 * and rendering take the registry's mutex; series are never removed before destroy, so a pointer
 * handed out stays valid without reference counting. */

enum { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM };

struct sh_counter {
    _Atomic uint64_t v;
};

struct sh_gauge {
    _Atomic int64_t v;
};

struct sh_histogram {
    uint32_t n;                                             /* bounds */
    double bounds[SH_HISTOGRAM_MAX_BUCKETS];                /* strictly increasing upper bounds */
    _Atomic uint64_t buckets[SH_HISTOGRAM_MAX_BUCKETS + 1]; /* per bucket (not cumulative);
                                                               the last is (bounds[n-1], +Inf] */
    _Atomic uint64_t count;
    _Atomic uint64_t sum_bits; /* a double's bits, updated by compare-and-swap */
};

typedef struct series {
    struct series *next;
    char *labels; /* "" for none */
    union {
        struct sh_counter c;
        struct sh_gauge g;
        struct sh_histogram h;
    } u;
} series;

typedef struct family {
    struct family *next;
    char *name;
    char *help;
    int kind;
    series *first, *last;
} family;

struct sh_metrics {
    uv_mutex_t mu;
    family *first, *last;
};

sh_err sh_metrics_create(sh_metrics **out)
{
    sh_metrics *m = calloc(1, sizeof *m);
    if (!m)
        return SH_ENOMEM;
    if (uv_mutex_init(&m->mu) != 0) {
        free(m);
        return SH_ENOMEM;
    }
    *out = m;
    return SH_OK;
}

void sh_metrics_destroy(sh_metrics *m)
{
    if (!m)
        return;
    for (family *f = m->first; f;) {
        family *fn = f->next;
        for (series *s = f->first; s;) {
            series *sn = s->next;
            free(s->labels);
            free(s);
            s = sn;
        }
        free(f->name);
        free(f->help);
        free(f);
        f = fn;
    }
    uv_mutex_destroy(&m->mu);
    free(m);
}

static bool name_ok(const char *s)
{
    if (!s || !*s)
        return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        if (!alpha && !(p != s && c >= '0' && c <= '9'))
            return false;
    }
    return true;
}

/* `k="v"` pairs separated by commas, label names [a-zA-Z_][a-zA-Z0-9_]*, values with \" escapes
 * and no raw newline. */
static bool labels_ok(const char *s)
{
    const char *p = s;
    for (;;) {
        const char *k = p;
        while ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' ||
               (p != k && *p >= '0' && *p <= '9'))
            p++;
        if (p == k || *p++ != '=' || *p++ != '"')
            return false;
        while (*p && *p != '"') {
            if (*p == '\n')
                return false;
            if (*p == '\\' && !*++p)
                return false;
            p++;
        }
        if (*p++ != '"')
            return false;
        if (!*p)
            return true;
        if (*p++ != ',')
            return false;
    }
}

static char *str_dup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

/* Finds or adds the series; returns it (under the lock the caller holds) or NULL with *err. */
static series *get_series(sh_metrics *m, const char *name, const char *help, const char *labels,
                          int kind, sh_err *err)
{
    if (!labels)
        labels = "";
    if (!name_ok(name) || (labels[0] && !labels_ok(labels))) {
        *err = SH_EINVAL;
        return NULL;
    }
    family *f = m->first;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (f && f->kind != kind) {
        *err = SH_EINVAL;
        return NULL;
    }
    if (f) {
        for (series *s = f->first; s; s = s->next)
            if (strcmp(s->labels, labels) == 0)
                return s;
    }
    series *s = calloc(1, sizeof *s);
    if (!s || !(s->labels = str_dup(labels))) {
        free(s);
        *err = SH_ENOMEM;
        return NULL;
    }
    if (!f) {
        f = calloc(1, sizeof *f);
        if (!f || !(f->name = str_dup(name)) || !(f->help = str_dup(help ? help : ""))) {
            if (f)
                free(f->name);
            free(f);
            free(s->labels);
            free(s);
            *err = SH_ENOMEM;
            return NULL;
        }
        f->kind = kind;
        if (m->last)
            m->last->next = f;
        else
            m->first = f;
        m->last = f;
    }
    if (f->last)
        f->last->next = s;
    else
        f->first = s;
    f->last = s;
    return s;
}

sh_err sh_metrics_counter(sh_metrics *m, const char *name, const char *help, const char *labels,
                          sh_counter **out)
{
    sh_err err = SH_OK;
    uv_mutex_lock(&m->mu);
    series *s = get_series(m, name, help, labels, KIND_COUNTER, &err);
    uv_mutex_unlock(&m->mu);
    if (s)
        *out = &s->u.c;
    return err;
}

sh_err sh_metrics_gauge(sh_metrics *m, const char *name, const char *help, const char *labels,
                        sh_gauge **out)
{
    sh_err err = SH_OK;
    uv_mutex_lock(&m->mu);
    series *s = get_series(m, name, help, labels, KIND_GAUGE, &err);
    uv_mutex_unlock(&m->mu);
    if (s)
        *out = &s->u.g;
    return err;
}

sh_err sh_metrics_histogram(sh_metrics *m, const char *name, const char *help, const char *labels,
                            const double *bounds, uint32_t n_bounds, sh_histogram **out)
{
    if (!bounds || n_bounds == 0 || n_bounds > SH_HISTOGRAM_MAX_BUCKETS)
        return SH_EINVAL;
    for (uint32_t i = 0; i < n_bounds; i++)
        if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
            return SH_EINVAL;
    sh_err err = SH_OK;
    uv_mutex_lock(&m->mu);
    series *s = get_series(m, name, help, labels, KIND_HISTOGRAM, &err);
    if (s && s->u.h.n == 0) {
        s->u.h.n = n_bounds;
        memcpy(s->u.h.bounds, bounds, n_bounds * sizeof *bounds);
    } else if (s && (s->u.h.n != n_bounds ||
                     memcmp(s->u.h.bounds, bounds, n_bounds * sizeof *bounds) != 0)) {
        s = NULL; /* the same series registered again with other buckets */
        err = SH_EINVAL;
    }
    uv_mutex_unlock(&m->mu);
    if (s)
        *out = &s->u.h;
    return err;
}

void sh_counter_add(sh_counter *c, uint64_t n)
{
    atomic_fetch_add_explicit(&c->v, n, memory_order_relaxed);
}

uint64_t sh_counter_value(const sh_counter *c)
{
    return atomic_load_explicit(&((sh_counter *)c)->v, memory_order_relaxed);
}

void sh_gauge_set(sh_gauge *g, int64_t v) { atomic_store_explicit(&g->v, v, memory_order_relaxed); }

void sh_gauge_add(sh_gauge *g, int64_t d)
{
    atomic_fetch_add_explicit(&g->v, d, memory_order_relaxed);
}

int64_t sh_gauge_value(const sh_gauge *g)
{
    return atomic_load_explicit(&((sh_gauge *)g)->v, memory_order_relaxed);
}

static double bits_to_double(uint64_t b)
{
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

static uint64_t double_to_bits(double d)
{
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    return b;
}

void sh_histogram_observe(sh_histogram *h, double v)
{
    uint32_t i = 0;
    while (i < h->n && !(v <= h->bounds[i]))
        i++; /* NaN lands in +Inf, as in the Prometheus clients */
    atomic_fetch_add_explicit(&h->buckets[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->count, 1, memory_order_relaxed);
    uint64_t old = atomic_load_explicit(&h->sum_bits, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&h->sum_bits, &old,
                                                  double_to_bits(bits_to_double(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

/* A growing output that keeps counting past the caller's capacity. */
typedef struct out {
    char *buf;
    size_t cap, len;
} out;

static void out_raw(out *o, const char *s, size_t n)
{
    if (o->len < o->cap) {
        size_t room = o->cap - o->len;
        memcpy(o->buf + o->len, s, n < room ? n : room);
    }
    o->len += n;
}

static void out_str(out *o, const char *s) { out_raw(o, s, strlen(s)); }

static void out_u64(out *o, uint64_t v)
{
    char t[24];
    int n = snprintf(t, sizeof t, "%llu", (unsigned long long)v);
    out_raw(o, t, (size_t)n);
}

/* The shortest %g form that reads back as the same double; Prometheus spellings for the
 * non-finite values. */
static void out_f64(out *o, double v)
{
    char t[40];
    if (isnan(v)) {
        out_str(o, "NaN");
        return;
    }
    if (isinf(v)) {
        out_str(o, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    int n = 0;
    for (int prec = 1; prec <= 17; prec++) {
        n = snprintf(t, sizeof t, "%.*g", prec, v);
        if (strtod(t, NULL) == v)
            break;
    }
    out_raw(o, t, (size_t)n);
}

static void out_help(out *o, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\')
            out_str(o, "\\\\");
        else if (*s == '\n')
            out_str(o, "\\n");
        else
            out_raw(o, s, 1);
    }
}

/* name[suffix]{labels[,extra]} */
static void out_series(out *o, const char *name, const char *suffix, const char *labels,
                       const char *extra)
{
    out_str(o, name);
    out_str(o, suffix);
    if (labels[0] || extra) {
        out_str(o, "{");
        out_str(o, labels);
        if (extra) {
            if (labels[0])
                out_str(o, ",");
            out_str(o, extra);
        }
        out_str(o, "}");
    }
    out_str(o, " ");
}

static void render_histogram(out *o, const char *name, const series *s)
{
    const struct sh_histogram *h = &s->u.h;
    uint64_t cum = 0;
    char le[64];
    for (uint32_t i = 0; i <= h->n; i++) {
        cum += atomic_load_explicit(&((struct sh_histogram *)h)->buckets[i], memory_order_relaxed);
        out tmp = {le, sizeof le - 1, 0};
        out_str(&tmp, "le=\"");
        if (i < h->n)
            out_f64(&tmp, h->bounds[i]);
        else
            out_str(&tmp, "+Inf");
        out_str(&tmp, "\"");
        le[tmp.len < sizeof le ? tmp.len : sizeof le - 1] = 0;
        out_series(o, name, "_bucket", s->labels, le);
        out_u64(o, cum);
        out_str(o, "\n");
    }
    out_series(o, name, "_sum", s->labels, NULL);
    out_f64(o, bits_to_double(atomic_load_explicit(&((struct sh_histogram *)h)->sum_bits,
                                                   memory_order_relaxed)));
    out_str(o, "\n");
    /* _count is the +Inf bucket's cumulative value, which keeps the two equal even while
     * observations race with the rendering. */
    out_series(o, name, "_count", s->labels, NULL);
    out_u64(o, cum);
    out_str(o, "\n");
}

sh_err sh_metrics_render(sh_metrics *m, char *buf, size_t cap, size_t *len)
{
    static const char *const kind_names[] = {"counter", "gauge", "histogram"};
    out o = {buf, cap ? cap - 1 : 0, 0};
    uv_mutex_lock(&m->mu);
    for (const family *f = m->first; f; f = f->next) {
        out_str(&o, "# HELP ");
        out_str(&o, f->name);
        out_str(&o, " ");
        out_help(&o, f->help);
        out_str(&o, "\n# TYPE ");
        out_str(&o, f->name);
        out_str(&o, " ");
        out_str(&o, kind_names[f->kind]);
        out_str(&o, "\n");
        for (const series *s = f->first; s; s = s->next) {
            if (f->kind == KIND_HISTOGRAM) {
                render_histogram(&o, f->name, s);
                continue;
            }
            out_series(&o, f->name, "", s->labels, NULL);
            if (f->kind == KIND_COUNTER) {
                out_u64(&o, sh_counter_value(&s->u.c));
            } else {
                char t[24];
                int n = snprintf(t, sizeof t, "%lld", (long long)sh_gauge_value(&s->u.g));
                out_raw(&o, t, (size_t)n);
            }
            out_str(&o, "\n");
        }
    }
    uv_mutex_unlock(&m->mu);
    if (len)
        *len = o.len;
    if (cap)
        buf[o.len < cap ? o.len : cap - 1] = 0;
    return o.len < cap ? SH_OK : SH_ERANGE;
}
