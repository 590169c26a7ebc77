/* Per-node metrics: the worker's reporter, the front's collector and the store /metrics renders
 * from (actors/node_metrics.h). */
#include "actors/node_metrics.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "actors/actor_util.h"
#include "base/error.h"
#include "runtime/msg.h"

#define NAME_MAX_BYTES 64
#define LABELS_MAX (SH_PROTO_MAX_NAME + 2 * NAME_MAX_BYTES + 64) /* merged label set */
#define WARN_EVERY_US (10u * 1000 * 1000)
#define MAX_VALUES 4096 /* SH_PROTO_FIELDS_metrics */
#define MAX_HISTS 1024

/* ---- checks on what a peer sends ------------------------------------------------------------ */

/* Whether s (n bytes) is well-formed UTF-8 (no overlong forms, surrogates or values past
 * U+10FFFF) without control characters. */
static bool text_ok(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    while (p < end) {
        unsigned c = *p++;
        if (c < 0x20 || c == 0x7f)
            return false;
        if (c < 0x80)
            continue;
        int more = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc2 ? 1 : -1;
        if (more < 0 || c > 0xf4 || end - p < more)
            return false;
        uint32_t cp = c & (0x3fu >> more);
        for (int i = 0; i < more; i++) {
            if ((p[i] & 0xc0) != 0x80)
                return false;
            cp = cp << 6 | (p[i] & 0x3f);
        }
        if ((more == 2 && cp < 0x800) || (more == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        p += more;
    }
    return true;
}

/* Whether s (n bytes) is a metric family name, [a-zA-Z_:][a-zA-Z0-9_:]*. */
static bool family_ok(const char *s, size_t n)
{
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9'))
            return false;
    }
    return true;
}

/* ---- the store ------------------------------------------------------------------------------ */

/* One report, copied: samples whose strings and arrays live in the same block. */
typedef struct snapshot {
    sh_metric_sample *s; /* (n) */
    size_t n;
} snapshot;

typedef struct peer {
    char name[NAME_MAX_BYTES];
    char labels[2 * NAME_MAX_BYTES + 16]; /* node="NAME" */
    sh_addr from;
    snapshot *snap; /* NULL before the first report */
    uint64_t got_us, reports, rejected;
} peer;

struct sh_node_metrics {
    uv_mutex_t mu; /* guards every peer's snap, got_us, reports and rejected; and scratch */
    peer *peers;
    int32_t n;
    sh_metric_sample *scratch; /* render's sample list */
    size_t scratch_cap;
};

sh_err sh__node_metrics_create(const sh_node_metrics_peer *peers, int32_t n, sh_node_metrics **out)
{
    if (n < 0 || (n > 0 && !peers))
        return SH_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (!peers[i].name || strlen(peers[i].name) >= NAME_MAX_BYTES)
            return SH_EINVAL;
    sh_node_metrics *nm = calloc(1, sizeof *nm);
    if (!nm)
        return SH_ENOMEM;
    nm->peers = calloc(n ? (size_t)n : 1, sizeof *nm->peers);
    if (!nm->peers || uv_mutex_init(&nm->mu) != 0) {
        free(nm->peers);
        free(nm);
        return SH_ENOMEM;
    }
    nm->n = n;
    for (int32_t i = 0; i < n; i++) {
        peer *p = &nm->peers[i];
        snprintf(p->name, sizeof p->name, "%s", peers[i].name);
        p->from = peers[i].from;
        sh_err err = sh_metrics_labels_add("", 0, "node", p->name, p->labels, sizeof p->labels);
        if (err) {
            sh__node_metrics_destroy(nm);
            return err;
        }
    }
    *out = nm;
    return SH_OK;
}

void sh__node_metrics_destroy(sh_node_metrics *nm)
{
    if (!nm)
        return;
    for (int32_t i = 0; i < nm->n; i++)
        free(nm->peers[i].snap);
    free(nm->peers);
    free(nm->scratch);
    uv_mutex_destroy(&nm->mu);
    free(nm);
}

/* One entry of a report before it is copied: the views of a value or a histogram. */
typedef struct entry {
    sh_strv family, labels, help;
    sh_metric_kind kind;
    const sh_proto_metric *v;
    const sh_proto_histogram *h;
} entry;

/* Splits `family{labels}` and checks the parts a peer controls. */
static sh_err entry_of(sh_strv name, sh_strv help, entry *en, sh_error *e)
{
    const char *brace = memchr(name.ptr, '{', name.len);
    size_t fl = brace ? (size_t)(brace - name.ptr) : name.len;
    en->family = (sh_strv){name.ptr, (uint32_t)fl};
    en->labels = (sh_strv){"", 0};
    en->help = help;
    if (!family_ok(name.ptr, fl))
        return sh__error_set(e, SH_EPROTO, "a bad metric name (%u bytes)", (unsigned)name.len);
    if (brace) {
        if (name.ptr[name.len - 1] != '}')
            return sh__error_set(e, SH_EPROTO, "metric %.*s: labels not closed", (int)fl, name.ptr);
        en->labels = (sh_strv){brace + 1, (uint32_t)(name.len - fl - 2)};
    }
    if (!text_ok(name.ptr, name.len) || !text_ok(help.ptr, help.len))
        return sh__error_set(e, SH_EPROTO,
                             "metric %.*s: its labels or help are not UTF-8 without control "
                             "characters",
                             (int)fl, name.ptr);
    return SH_OK;
}

static int cmp_sample(const void *a, const void *b)
{
    const sh_metric_sample *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : strcmp(x->labels, y->labels);
}

/* Copies the entries into one block with node label `node` merged in; NULL with e set. */
static snapshot *snapshot_build(const entry *en, size_t n, const char *node, sh_error *e)
{
    /* Sizes first: samples, then 8-byte words (bounds and counts), then text. */
    size_t words = 0, chars = 0;
    for (size_t i = 0; i < n; i++) {
        chars += en[i].family.len + en[i].help.len + LABELS_MAX + 3;
        if (en[i].h)
            words += 2 * (size_t)en[i].h->bounds.n + 1;
    }
    size_t head = (sizeof(snapshot) + 7) & ~(size_t)7;
    char *blk = malloc(head + n * sizeof(sh_metric_sample) + words * 8 + chars);
    if (!blk) {
        sh__error_set(e, SH_ENOMEM, "out of memory for a report of %zu series", n);
        return NULL;
    }
    snapshot *sn = (snapshot *)blk;
    sn->s = (sh_metric_sample *)(blk + head);
    sn->n = n;
    uint64_t *w = (uint64_t *)(sn->s + n);
    char *t = (char *)(w + words);
    for (size_t i = 0; i < n; i++) {
        const entry *x = &en[i];
        sh_metric_sample *s = &sn->s[i];
        memset(s, 0, sizeof *s);
        s->kind = x->kind;
        s->name = t;
        memcpy(t, x->family.ptr, x->family.len);
        t[x->family.len] = '\0';
        t += x->family.len + 1;
        s->help = t;
        memcpy(t, x->help.ptr, x->help.len);
        t[x->help.len] = '\0';
        t += x->help.len + 1;
        sh_err err =
            sh_metrics_labels_add(x->labels.ptr, x->labels.len, "node", node, t, LABELS_MAX + 1);
        if (err) {
            sh__error_set(e, SH_EPROTO, "metric %s: %s label set (%u bytes)", s->name,
                          err == SH_ERANGE ? "too long a" : "a malformed", (unsigned)x->labels.len);
            free(blk);
            return NULL;
        }
        s->labels = t;
        t += strlen(t) + 1;
        if (x->v) {
            s->value = x->v->value;
            continue;
        }
        const sh_proto_histogram *h = x->h;
        s->n_bounds = h->bounds.n;
        s->bounds = (const double *)w;
        for (uint32_t k = 0; k < h->bounds.n; k++) {
            double b = sh_f64s_at(h->bounds, k);
            if (!isfinite(b) || (k > 0 && !(b > ((const double *)w)[k - 1]))) {
                sh__error_set(e, SH_EPROTO, "histogram %s: bounds not finite and increasing",
                              s->name);
                free(blk);
                return NULL;
            }
            memcpy(&w[k], &b, sizeof b);
        }
        w += h->bounds.n;
        s->counts = w;
        for (uint32_t k = 0; k < h->counts.n; k++)
            w[k] = sh_u64s_at(h->counts, k);
        w += h->counts.n;
        s->sum = h->sum;
    }
    /* One series once, one kind per family: checked on a sorted copy of the list. */
    sh_metric_sample *sorted = malloc((n ? n : 1) * sizeof *sorted);
    if (!sorted) {
        sh__error_set(e, SH_ENOMEM, "out of memory");
        free(blk);
        return NULL;
    }
    memcpy(sorted, sn->s, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_sample);
    for (size_t i = 1; i < n; i++) {
        const sh_metric_sample *a = &sorted[i - 1], *b = &sorted[i];
        if (strcmp(a->name, b->name) != 0)
            continue;
        if (a->kind != b->kind || !strcmp(a->labels, b->labels)) {
            sh__error_set(e, SH_EPROTO, "metric %s: %s", a->name,
                          a->kind != b->kind ? "two kinds" : "one series twice");
            free(sorted);
            free(blk);
            return NULL;
        }
    }
    free(sorted);
    return sn;
}

static peer *peer_of(sh_node_metrics *nm, sh_addr from)
{
    for (int32_t i = 0; i < nm->n; i++)
        if (nm->peers[i].from == from)
            return &nm->peers[i];
    return NULL;
}

/* Counts a report from `from` that could not even be decoded. */
static void count_rejected(sh_node_metrics *nm, sh_addr from)
{
    peer *p = peer_of(nm, from);
    if (!p)
        return;
    uv_mutex_lock(&nm->mu);
    p->rejected++;
    uv_mutex_unlock(&nm->mu);
}

sh_err sh__node_metrics_put(sh_node_metrics *nm, sh_addr from, const sh_proto_metrics *r,
                            uint64_t now_us, sh_error *e)
{
    peer *p = peer_of(nm, from);
    if (!p)
        return sh__error_set(e, SH_ENOTFOUND, "a report from %u:%u, which is no reporting node",
                             (unsigned)sh_addr_node(from), (unsigned)sh_addr_actor(from));
    size_t n = (size_t)r->values.n + r->hists.n;
    entry *en = malloc((n ? n : 1) * sizeof *en);
    if (!en)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    sh_err err = SH_OK;
    size_t k = 0;
    for (uint32_t i = 0; !err && i < r->values.n; i++, k++) {
        const sh_proto_metric *v = &r->values.v[i];
        err = entry_of(v->name, v->help, &en[k], e);
        en[k].kind = v->kind == 0 ? SH_METRIC_COUNTER : SH_METRIC_GAUGE;
        en[k].v = v;
        en[k].h = NULL;
    }
    for (uint32_t i = 0; !err && i < r->hists.n; i++, k++) {
        const sh_proto_histogram *h = &r->hists.v[i];
        err = entry_of(h->name, h->help, &en[k], e);
        en[k].kind = SH_METRIC_HISTOGRAM;
        en[k].v = NULL;
        en[k].h = h;
    }
    snapshot *sn = err ? NULL : snapshot_build(en, n, p->name, e);
    free(en);
    if (!sn && !err)
        err = e ? e->code : SH_EPROTO;
    uv_mutex_lock(&nm->mu);
    if (err) {
        p->rejected++;
    } else {
        free(p->snap);
        p->snap = sn;
        p->got_us = now_us;
        p->reports++;
    }
    uv_mutex_unlock(&nm->mu);
    return err == SH_ENOMEM ? SH_ENOMEM : err ? SH_EPROTO : SH_OK;
}

sh_err sh__node_metrics_render(void *user, sh_metrics *m, char *buf, size_t cap, size_t *len)
{
    sh_node_metrics *nm = user;
    uint64_t now = sh__act_mono_us();
    uv_mutex_lock(&nm->mu);
    size_t n = 3 * (size_t)nm->n;
    for (int32_t i = 0; i < nm->n; i++)
        n += nm->peers[i].snap ? nm->peers[i].snap->n : 0;
    if (n > nm->scratch_cap) {
        sh_metric_sample *s = realloc(nm->scratch, n * sizeof *s);
        if (!s) {
            uv_mutex_unlock(&nm->mu);
            return SH_ENOMEM;
        }
        nm->scratch = s;
        nm->scratch_cap = n;
    }
    size_t k = 0;
    for (int32_t i = 0; i < nm->n; i++) {
        const peer *p = &nm->peers[i];
        if (p->snap) {
            memcpy(nm->scratch + k, p->snap->s, p->snap->n * sizeof *nm->scratch);
            k += p->snap->n;
        }
        double age = !p->snap ? INFINITY : now > p->got_us ? (double)(now - p->got_us) / 1e6 : 0;
        nm->scratch[k++] = (sh_metric_sample){
            .name = "shoal_node_metrics_age_seconds",
            .help = "Seconds since the node's latest metrics report arrived (+Inf: none yet).",
            .labels = p->labels,
            .kind = SH_METRIC_GAUGE,
            .value = age};
        nm->scratch[k++] = (sh_metric_sample){.name = "shoal_node_metrics_reports_total",
                                              .help = "Metrics reports stored from the node.",
                                              .labels = p->labels,
                                              .kind = SH_METRIC_COUNTER,
                                              .value = (double)p->reports};
        nm->scratch[k++] =
            (sh_metric_sample){.name = "shoal_node_metrics_rejected_total",
                               .help = "Metrics reports from the node refused as malformed.",
                               .labels = p->labels,
                               .kind = SH_METRIC_COUNTER,
                               .value = (double)p->rejected};
    }
    sh_err err = sh_metrics_render_with(m, nm->scratch, k, buf, cap, len);
    uv_mutex_unlock(&nm->mu);
    return err;
}

/* ---- the collector -------------------------------------------------------------------------- */

typedef struct collector {
    sh_node_metrics *nm;
    sh_act_decoder dec;
    uint64_t warned_us, unlogged;
} collector;

/* Enough for the largest report the protocol allows (4096 values and 1024 histograms). */
#define COLLECTOR_ARENA ((size_t)1 << 20)

static sh_err collector_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    collector *c = state;
    c->nm = ((const sh_node_metrics_collector_args *)arg)->nm;
    if (!c->nm)
        return SH_EINVAL;
    return sh__act_decoder_init(&c->dec, COLLECTOR_ARENA);
}

/* Logs a refused report: at most one line per WARN_EVERY_US, saying how many were not logged. */
static void collector_warn(sh_actor_ctx *ctx, collector *c, uint64_t now, sh_addr from,
                           const char *why)
{
    if (c->warned_us && now - c->warned_us < WARN_EVERY_US) {
        c->unlogged++;
        return;
    }
    sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "node_metrics_bad",
                 "from=%u:%u err=\"%s\" not_logged=%llu", (unsigned)sh_addr_node(from),
                 (unsigned)sh_addr_actor(from), why, (unsigned long long)c->unlogged);
    c->warned_us = now;
    c->unlogged = 0;
}

static sh_msg_fate collector_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    collector *c = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type != SH_MSG_METRICS)
        return SH_MSG_FATE_DONE;
    uint64_t now = sh__act_mono_us();
    sh_proto_body body;
    sh_error e = {0};
    if (sh__act_decode(&c->dec, m, &body, &e) == SH_OK)
        sh__node_metrics_put(c->nm, h->src, &body.metrics, now, &e);
    else
        count_rejected(c->nm, h->src);
    if (e.code)
        collector_warn(ctx, c, now, h->src, e.msg);
    return SH_MSG_FATE_DONE;
}

static void collector_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__act_decoder_fini(&((collector *)state)->dec);
}

const sh_actor_vtable sh__node_metrics_collector_vtable = {
    .name = "node_metrics_collector",
    .state_size = sizeof(collector),
    .init = collector_init,
    .handle = collector_handle,
    .stop = collector_stop,
};

/* ---- the reporter --------------------------------------------------------------------------- */

/* Growing buffers reused from one report to the next. While the registry is visited, entries
 * hold offsets into chars and words (which may move as they grow); pointers are set after. */
typedef struct reporter {
    sh_node_metrics_reporter_args a;
    sh_counter *skipped;
    bool failing;
    sh_proto_metric *values;
    sh_proto_histogram *hists;
    uint32_t n_values, n_hists, cap_values, cap_hists;
    char *chars;
    size_t n_chars, cap_chars;
    uint64_t *words;
    size_t n_words, cap_words;
    uint64_t n_skipped; /* in this visit */
    bool oom;
} reporter;

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return false;
    *p = q;
    *cap = c;
    return true;
}

/* Appends n bytes of s (only its first strlen(s) when shorter: the caller fills the rest);
 * returns their offset, or SIZE_MAX when memory ran out. */
static size_t put_chars(reporter *r, const char *s, size_t n)
{
    if (!grow((void **)&r->chars, &r->cap_chars, r->n_chars + n, 1))
        return SIZE_MAX;
    size_t sl = strnlen(s, n);
    memcpy(r->chars + r->n_chars, s, sl);
    r->n_chars += n;
    return r->n_chars - n;
}

#define OFF(x) ((const char *)(uintptr_t)(x)) /* an offset kept in a pointer until fix-up */

static void visit(void *arg, const sh_metric_sample *s)
{
    reporter *r = arg;
    size_t nl = strlen(s->name), ll = s->labels ? strlen(s->labels) : 0;
    size_t full = nl + (ll ? ll + 2 : 0);
    size_t hl = s->help ? strlen(s->help) : 0;
    if (hl > SH_PROTO_MAX_MSG)
        hl = SH_PROTO_MAX_MSG;
    bool hist = s->kind == SH_METRIC_HISTOGRAM;
    if (full > SH_PROTO_MAX_NAME || (hist ? r->n_hists >= MAX_HISTS : r->n_values >= MAX_VALUES)) {
        r->n_skipped++;
        return;
    }
    size_t at = put_chars(r, s->name, nl + (ll ? ll + 2 : 0));
    if (at != SIZE_MAX && ll) {
        r->chars[at + nl] = '{';
        memcpy(r->chars + at + nl + 1, s->labels, ll);
        r->chars[at + nl + 1 + ll] = '}';
    }
    size_t help_at = put_chars(r, s->help ? s->help : "", hl);
    if (at == SIZE_MAX || help_at == SIZE_MAX) {
        r->oom = true;
        return;
    }
    sh_strv name = {OFF(at), (uint32_t)full}, help = {OFF(help_at), (uint32_t)hl};
    if (!hist) {
        size_t cap = r->cap_values;
        if (!grow((void **)&r->values, &cap, r->n_values + 1u, sizeof *r->values)) {
            r->oom = true;
            return;
        }
        r->cap_values = (uint32_t)cap;
        r->values[r->n_values++] = (sh_proto_metric){.name = name,
                                                     .kind = s->kind == SH_METRIC_COUNTER ? 0 : 1,
                                                     .value = s->value,
                                                     .help = help};
        return;
    }
    size_t cap = r->cap_hists;
    size_t w = 2 * (size_t)s->n_bounds + 1;
    if (!grow((void **)&r->hists, &cap, r->n_hists + 1u, sizeof *r->hists) ||
        !grow((void **)&r->words, &r->cap_words, r->n_words + w, sizeof *r->words)) {
        r->oom = true;
        return;
    }
    r->cap_hists = (uint32_t)cap;
    uint64_t *dst = r->words + r->n_words;
    memcpy(dst, s->bounds, s->n_bounds * sizeof(double));
    memcpy(dst + s->n_bounds, s->counts, (s->n_bounds + 1) * sizeof(uint64_t));
    r->hists[r->n_hists++] =
        (sh_proto_histogram){.name = name,
                             .bounds = {OFF(r->n_words), s->n_bounds},
                             .counts = {OFF(r->n_words + s->n_bounds), s->n_bounds + 1},
                             .sum = s->sum,
                             .help = help};
    r->n_words += w;
}

/* Turns the offsets the visit left into pointers. */
static void fix_up(reporter *r)
{
    for (uint32_t i = 0; i < r->n_values; i++) {
        sh_proto_metric *v = &r->values[i];
        v->name.ptr = r->chars + (uintptr_t)v->name.ptr;
        v->help.ptr = r->chars + (uintptr_t)v->help.ptr;
    }
    for (uint32_t i = 0; i < r->n_hists; i++) {
        sh_proto_histogram *h = &r->hists[i];
        h->name.ptr = r->chars + (uintptr_t)h->name.ptr;
        h->help.ptr = r->chars + (uintptr_t)h->help.ptr;
        h->bounds.ptr = r->words + (uintptr_t)h->bounds.ptr;
        h->counts.ptr = r->words + (uintptr_t)h->counts.ptr;
    }
}

static void report(sh_actor_ctx *ctx, reporter *r)
{
    sh_runtime *rt = sh_actor_runtime(ctx);
    r->n_values = r->n_hists = 0;
    r->n_chars = r->n_words = 0;
    r->n_skipped = 0;
    r->oom = false;
    sh_metrics_foreach(sh_runtime_metrics(rt), visit, r);
    if (r->n_skipped)
        sh_counter_add(r->skipped, r->n_skipped);
    if (r->oom) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "node_metrics_oom", NULL);
        return;
    }
    fix_up(r);
    sh_proto_metrics body = {.at_us = sh__act_mono_us(),
                             .values = {r->values, r->n_values},
                             .hists = {r->hists, r->n_hists}};
    sh_error e = {0};
    sh_err err = sh__act_send(rt, sh_actor_self(ctx), r->a.collector, SH_MSG_METRICS, 0, &body, &e);
    if (err && !r->failing)
        sh_actor_log(ctx, SH_LOG_LEVEL_INFO, "node_metrics_send_failed", "err=\"%s\"", e.msg);
    r->failing = err != SH_OK;
}

static sh_err reporter_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    reporter *r = state;
    r->a = *(const sh_node_metrics_reporter_args *)arg;
    if (!r->a.collector)
        return SH_EINVAL;
    if (!r->a.period_ms)
        r->a.period_ms = SH_NODE_METRICS_PERIOD_MS;
    sh_err err = sh_metrics_counter(
        sh_runtime_metrics(sh_actor_runtime(ctx)), "shoal_node_metrics_skipped_total",
        "Series left out of this node's metrics reports (too long a name, or past the "
        "message's limits).",
        NULL, &r->skipped);
    // Not at once: a worker creates its transport after its actors, and the front may not be
    // up yet; until a send first succeeds, failures are expected and not logged.
    r->failing = true;
    if (!err)
        err = sh_actor_timer_start(ctx, r->a.period_ms, r->a.period_ms, 1, NULL);
    return err;
}

static void reporter_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)tag;
    report(ctx, state);
}

static sh_msg_fate reporter_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx;
    (void)state;
    (void)m;
    return SH_MSG_FATE_DONE; /* it receives nothing it needs */
}

static void reporter_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    reporter *r = state;
    free(r->values);
    free(r->hists);
    free(r->chars);
    free(r->words);
}

const sh_actor_vtable sh__node_metrics_reporter_vtable = {
    .name = "node_metrics_reporter",
    .state_size = sizeof(reporter),
    .init = reporter_init,
    .handle = reporter_handle,
    .stop = reporter_stop,
    .timer = reporter_timer,
};
