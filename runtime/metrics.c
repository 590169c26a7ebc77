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

/* One `k="v"` pair of a label set: the name and the value as written (escapes kept). */
typedef struct lpair {
    const char *k, *v;
    size_t kn, vn;
} lpair;

/* Reads the pair at p (before end) into *lp; returns the position after it and its comma, end
 * after the last pair, or NULL when it is malformed: label names [a-zA-Z_][a-zA-Z0-9_]*, values
 * with \ escapes and no raw newline, no trailing comma. */
static const char *label_next(const char *p, const char *end, lpair *lp)
{
    lp->k = p;
    while (p < end && ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' ||
                       (p != lp->k && *p >= '0' && *p <= '9')))
        p++;
    lp->kn = (size_t)(p - lp->k);
    if (lp->kn == 0 || end - p < 2 || p[0] != '=' || p[1] != '"')
        return NULL;
    p += 2;
    lp->v = p;
    while (p < end && *p != '"') {
        if (*p == '\n' || (*p == '\\' && ++p == end))
            return NULL;
        p++;
    }
    if (p == end)
        return NULL;
    lp->vn = (size_t)(p - lp->v);
    p++; /* the closing quote */
    if (p == end)
        return end;
    if (*p != ',' || p + 1 == end)
        return NULL;
    return p + 1;
}

#define MAX_LABELS 64

/* Whether s (n bytes) is a well-formed label set with at most MAX_LABELS pairs and no name
 * twice; an empty set is. When `find` is given, *found says whether a label of that name is in
 * it. */
static bool labels_check(const char *s, size_t n, const char *find, bool *found)
{
    lpair seen[MAX_LABELS];
    int count = 0;
    if (found)
        *found = false;
    const char *p = s, *end = s + n;
    while (p < end) {
        if (count == MAX_LABELS || !(p = label_next(p, end, &seen[count])))
            return false;
        for (int i = 0; i < count; i++)
            if (seen[i].kn == seen[count].kn && !memcmp(seen[i].k, seen[count].k, seen[i].kn))
                return false;
        if (find && strlen(find) == seen[count].kn && !memcmp(find, seen[count].k, seen[count].kn))
            *found = true;
        count++;
    }
    return true;
}

static bool labels_ok(const char *s) { return s[0] && labels_check(s, strlen(s), NULL, NULL); }

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

/* Whole numbers below 1e15 in full, anything else in the shortest %g form that reads back as
 * the same double; Prometheus spellings for the non-finite values. */
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
    if (v == floor(v) && fabs(v) < 1e15) { /* whole numbers as such: 100, not 1e+02 */
        n = snprintf(t, sizeof t, "%.0f", v);
        out_raw(o, t, (size_t)n);
        return;
    }
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

/* A histogram's lines from per-bucket counts (n_bounds + 1, the last the +Inf bucket). */
static void render_histogram(out *o, const char *name, const char *labels, uint32_t n_bounds,
                             const double *bounds, const uint64_t *counts, double sum)
{
    uint64_t cum = 0;
    char le[64];
    for (uint32_t i = 0; i <= n_bounds; i++) {
        cum += counts[i];
        out tmp = {le, sizeof le - 1, 0};
        out_str(&tmp, "le=\"");
        if (i < n_bounds)
            out_f64(&tmp, bounds[i]);
        else
            out_str(&tmp, "+Inf");
        out_str(&tmp, "\"");
        le[tmp.len < sizeof le ? tmp.len : sizeof le - 1] = 0;
        out_series(o, name, "_bucket", labels, le);
        out_u64(o, cum);
        out_str(o, "\n");
    }
    out_series(o, name, "_sum", labels, NULL);
    out_f64(o, sum);
    out_str(o, "\n");
    /* _count is the +Inf bucket's cumulative value, which keeps the two equal even while
     * observations race with the rendering. */
    out_series(o, name, "_count", labels, NULL);
    out_u64(o, cum);
    out_str(o, "\n");
}

/* A series of the registry as a sample; counts is the caller's (SH_HISTOGRAM_MAX_BUCKETS + 1). */
static void sample_of(const family *f, const series *s, uint64_t *counts, sh_metric_sample *smp)
{
    *smp = (sh_metric_sample){
        .name = f->name, .help = f->help, .labels = s->labels, .kind = (sh_metric_kind)f->kind};
    if (f->kind == KIND_COUNTER) {
        smp->value = (double)sh_counter_value(&s->u.c);
    } else if (f->kind == KIND_GAUGE) {
        smp->value = (double)sh_gauge_value(&s->u.g);
    } else {
        struct sh_histogram *h = (struct sh_histogram *)&s->u.h;
        for (uint32_t i = 0; i <= h->n; i++)
            counts[i] = atomic_load_explicit(&h->buckets[i], memory_order_relaxed);
        smp->n_bounds = h->n;
        smp->bounds = h->bounds;
        smp->counts = counts;
        smp->sum = bits_to_double(atomic_load_explicit(&h->sum_bits, memory_order_relaxed));
    }
}

void sh_metrics_foreach(sh_metrics *m, sh_metrics_visit_fn fn, void *arg)
{
    uint64_t counts[SH_HISTOGRAM_MAX_BUCKETS + 1];
    uv_mutex_lock(&m->mu);
    for (const family *f = m->first; f; f = f->next) {
        for (const series *s = f->first; s; s = s->next) {
            sh_metric_sample smp;
            sample_of(f, s, counts, &smp);
            fn(arg, &smp);
        }
    }
    uv_mutex_unlock(&m->mu);
}

static void render_head(out *o, const char *name, const char *help, sh_metric_kind kind)
{
    static const char *const kind_names[] = {"counter", "gauge", "histogram"};
    out_str(o, "# HELP ");
    out_str(o, name);
    out_str(o, " ");
    out_help(o, help ? help : "");
    out_str(o, "\n# TYPE ");
    out_str(o, name);
    out_str(o, " ");
    out_str(o, kind_names[kind]);
    out_str(o, "\n");
}

/* An extra sample's lines (its family's head is written by the caller). */
static void render_extra(out *o, const sh_metric_sample *x)
{
    if (x->kind == SH_METRIC_HISTOGRAM) {
        render_histogram(o, x->name, x->labels, x->n_bounds, x->bounds, x->counts, x->sum);
        return;
    }
    out_series(o, x->name, "", x->labels, NULL);
    out_f64(o, x->value);
    out_str(o, "\n");
}

/* Whether an extra sample can be rendered: a good name and kind, a well-formed label set without
 * `le` on a histogram, at most SH_METRICS_SAMPLE_MAX_BOUNDS bounds. */
static bool extra_ok(const sh_metric_sample *x)
{
    bool le = false;
    const char *labels = x->labels ? x->labels : "";
    if (!name_ok(x->name) || (unsigned)x->kind > SH_METRIC_HISTOGRAM ||
        !labels_check(labels, strlen(labels), "le", &le))
        return false;
    if (x->kind != SH_METRIC_HISTOGRAM)
        return true;
    return !le && x->n_bounds <= SH_METRICS_SAMPLE_MAX_BOUNDS && (x->n_bounds == 0 || x->bounds) &&
           x->counts;
}

/* An extra sample's place in the sorted order: by name, then by its index (a stable order). */
typedef struct extra_ref {
    const char *name;
    uint32_t i;
} extra_ref;

static int cmp_extra(const void *a, const void *b)
{
    const extra_ref *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->i > y->i) - (x->i < y->i);
}

sh_err sh_metrics_render_with(sh_metrics *m, const sh_metric_sample *extra, size_t n_extra,
                              char *buf, size_t cap, size_t *len)
{
    /* The extras sorted by name (stable), so that each family's lines come out together. */
    extra_ref *idx = NULL;
    size_t n_idx = 0;
    if (n_extra) {
        idx = malloc(n_extra * sizeof *idx);
        if (!idx)
            return SH_ENOMEM;
        for (size_t i = 0; i < n_extra && i < UINT32_MAX; i++)
            if (extra_ok(&extra[i]))
                idx[n_idx++] = (extra_ref){extra[i].name, (uint32_t)i};
        qsort(idx, n_idx, sizeof *idx, cmp_extra);
    }
    out o = {buf, cap ? cap - 1 : 0, 0};
    uint64_t counts[SH_HISTOGRAM_MAX_BUCKETS + 1];
    uv_mutex_lock(&m->mu);
    for (const family *f = m->first; f; f = f->next) {
        render_head(&o, f->name, f->help, (sh_metric_kind)f->kind);
        for (const series *s = f->first; s; s = s->next) {
            sh_metric_sample smp;
            sample_of(f, s, counts, &smp);
            if (f->kind == KIND_HISTOGRAM) {
                render_histogram(&o, f->name, s->labels, smp.n_bounds, smp.bounds, smp.counts,
                                 smp.sum);
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
        /* The extras of this family (a binary search for the first of its name). */
        size_t lo = 0, hi = n_idx;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (strcmp(idx[mid].name, f->name) < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (; lo < n_idx && !strcmp(idx[lo].name, f->name); lo++)
            if ((int)extra[idx[lo].i].kind == f->kind)
                render_extra(&o, &extra[idx[lo].i]);
    }
    /* Families only the extras have: the first sample's kind (and the first non-empty help)
     * stands for the family; samples of another kind are left out. */
    for (size_t i = 0; i < n_idx;) {
        const sh_metric_sample *first = &extra[idx[i].i];
        size_t j = i;
        while (j < n_idx && !strcmp(idx[j].name, first->name))
            j++;
        const family *f = m->first;
        while (f && strcmp(f->name, first->name) != 0)
            f = f->next;
        if (!f) {
            const char *help = "";
            for (size_t k = i; k < j && !help[0]; k++)
                help = extra[idx[k].i].help ? extra[idx[k].i].help : "";
            render_head(&o, first->name, help, first->kind);
            for (size_t k = i; k < j; k++)
                if (extra[idx[k].i].kind == first->kind)
                    render_extra(&o, &extra[idx[k].i]);
        }
        i = j;
    }
    uv_mutex_unlock(&m->mu);
    free(idx);
    if (len)
        *len = o.len;
    if (cap)
        buf[o.len < cap ? o.len : cap - 1] = 0;
    return o.len < cap ? SH_OK : SH_ERANGE;
}

sh_err sh_metrics_render(sh_metrics *m, char *buf, size_t cap, size_t *len)
{
    return sh_metrics_render_with(m, NULL, 0, buf, cap, len);
}

sh_err sh_metrics_labels_add(const char *labels, size_t len, const char *name, const char *value,
                             char *buf, size_t cap)
{
    char exported[80], probe[96];
    bool has = false, has_exported = false;
    size_t nn = name ? strlen(name) : 0;
    if (!labels)
        labels = "";
    if (nn == 0 || nn + sizeof "exported_" > sizeof exported)
        return SH_EINVAL;
    snprintf(exported, sizeof exported, "exported_%s", name);
    snprintf(probe, sizeof probe, "%s=\"\"", name); /* name checked as a one-pair set's key */
    if (!labels_check(probe, strlen(probe), NULL, NULL) || !labels_check(labels, len, name, &has) ||
        !labels_check(labels, len, exported, &has_exported) || (has && has_exported))
        return SH_EINVAL;
    out o = {buf, cap ? cap - 1 : 0, 0};
    const char *p = labels, *end = labels + len;
    while (p < end) {
        lpair lp;
        p = label_next(p, end, &lp);
        if (o.len)
            out_str(&o, ",");
        if (lp.kn == nn && !memcmp(lp.k, name, nn))
            out_str(&o, "exported_");
        out_raw(&o, lp.k, lp.kn);
        out_str(&o, "=\"");
        out_raw(&o, lp.v, lp.vn);
        out_str(&o, "\"");
    }
    if (o.len)
        out_str(&o, ",");
    out_str(&o, name);
    out_str(&o, "=\"");
    for (const char *v = value ? value : ""; *v; v++) {
        if (*v == '\\' || *v == '"')
            out_raw(&o, "\\", 1);
        if (*v == '\n')
            out_str(&o, "\\n");
        else
            out_raw(&o, v, 1);
    }
    out_str(&o, "\"");
    if (cap)
        buf[o.len < cap ? o.len : cap - 1] = 0;
    return o.len < cap ? SH_OK : SH_ERANGE;
}
