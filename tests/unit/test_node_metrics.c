/* Per-node metrics (actors/node_metrics.h): the label merge, rendering a registry with another
 * node's series, the front's store refusing malformed reports, and a reporter and a collector
 * exchanging real METRICS messages; every rendering is checked by a Prometheus text parser. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/node_metrics.h"
#include "actors/serve.h"
#include "runtime/proto.h"
#include "test_runtime_util.h"

/* ---- a Prometheus text format 0.0.4 checker ------------------------------------------------- */

#define MAX_FAMILIES 256
#define MAX_SERIES 4096

typedef struct prom {
    char fam[MAX_FAMILIES][128];
    char kind[MAX_FAMILIES][16];
    int n_fam;
    char *series[MAX_SERIES]; /* name{sorted labels} of every sample, to find duplicates */
    int n_series;
    char why[256];
} prom;

static bool fail(prom *p, const char *line, const char *why)
{
    snprintf(p->why, sizeof p->why, "%s: '%.120s'", why, line);
    return false;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Parses `{k="v",...}` at *s; writes the label pairs sorted into key (for duplicate detection),
 * the same without le into base, and le's value into le (empty when none). */
static bool parse_labels(prom *p, const char *line, const char **s, char *key, char *base,
                         size_t cap, char *le)
{
    char pairs[64][256];
    int n = 0;
    le[0] = '\0';
    const char *q = *s;
    key[0] = base[0] = '\0';
    if (*q != '{')
        return true;
    q++;
    while (*q != '}') {
        if (n == 64)
            return fail(p, line, "too many labels");
        const char *k = q;
        while ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || *q == '_' ||
               (q > k && *q >= '0' && *q <= '9'))
            q++;
        if (q == k || q[0] != '=' || q[1] != '"')
            return fail(p, line, "bad label name");
        size_t kn = (size_t)(q - k);
        q += 2;
        const char *v = q;
        while (*q != '"') {
            if (!*q || *q == '\n')
                return fail(p, line, "unterminated label value");
            if (*q == '\\') {
                if (q[1] != '\\' && q[1] != '"' && q[1] != 'n')
                    return fail(p, line, "bad escape");
                q++;
            }
            q++;
        }
        snprintf(pairs[n], sizeof pairs[n], "%.*s=%.*s", (int)kn, k, (int)(q - v), v);
        for (int i = 0; i < n; i++)
            if (!strncmp(pairs[i], pairs[n], kn + 1))
                return fail(p, line, "a label twice");
        if (kn == 2 && !strncmp(k, "le", 2))
            snprintf(le, 64, "%.*s", (int)(q - v), v);
        n++;
        q++;
        if (*q == ',' && q[1] != '}')
            q++;
        else if (*q != '}')
            return fail(p, line, "bad label separator");
    }
    *s = q + 1;
    char *ptrs[64];
    for (int i = 0; i < n; i++)
        ptrs[i] = pairs[i];
    qsort(ptrs, (size_t)n, sizeof *ptrs, cmp_str);
    for (int i = 0; i < n; i++) {
        size_t l = strlen(key);
        snprintf(key + l, cap - l, "%s%s", i ? "," : "", ptrs[i]);
        if (strncmp(ptrs[i], "le=", 3)) {
            l = strlen(base);
            snprintf(base + l, cap - l, "%s%s", l ? "," : "", ptrs[i]);
        }
    }
    return true;
}

static bool parse_value(const char *s, double *v)
{
    if (!strcmp(s, "+Inf") || !strcmp(s, "-Inf") || !strcmp(s, "NaN")) {
        *v = !strcmp(s, "NaN") ? NAN : s[0] == '+' ? INFINITY : -INFINITY;
        return true;
    }
    char *end;
    *v = strtod(s, &end);
    return end != s && *end == '\0';
}

/* Checks every line: HELP then TYPE once per family, each sample under its family's TYPE (a
 * histogram's as _bucket with a cumulative le ending at +Inf, then _sum and _count equal to the
 * +Inf bucket), label syntax, values, no series twice. */
static bool prom_check(prom *p, const char *text)
{
    memset(p, 0, sizeof *p);
    char *copy = strdup(text);
    bool ok = true;
    int cur = -1;
    double last_cum = -1, inf_count = -1;
    char hist_labels[2048] = "";
    for (char *save = NULL, *line = strtok_r(copy, "\n", &save); ok && line;
         line = strtok_r(NULL, "\n", &save)) {
        if (!strncmp(line, "# HELP ", 7) || !strncmp(line, "# TYPE ", 7)) {
            char name[128], rest[512] = "";
            if (sscanf(line + 7, "%127s %511[^\n]", name, rest) < 1)
                ok = fail(p, line, "bad comment");
            else if (line[2] == 'H') {
                for (int i = 0; ok && i < p->n_fam; i++)
                    if (!strcmp(p->fam[i], name))
                        ok = fail(p, line, "a family declared twice");
                if (ok && p->n_fam < MAX_FAMILIES) {
                    cur = p->n_fam++;
                    snprintf(p->fam[cur], sizeof p->fam[cur], "%s", name);
                    p->kind[cur][0] = '\0';
                }
            } else if (cur < 0 || strcmp(p->fam[cur], name) || p->kind[cur][0]) {
                ok = fail(p, line, "TYPE without its HELP, or twice");
            } else if (strcmp(rest, "counter") && strcmp(rest, "gauge") &&
                       strcmp(rest, "histogram")) {
                ok = fail(p, line, "unknown type");
            } else {
                snprintf(p->kind[cur], sizeof p->kind[cur], "%.15s", rest);
            }
            continue;
        }
        if (line[0] == '#')
            continue;
        const char *s = line;
        while ((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_' || *s == ':' ||
               (s > line && *s >= '0' && *s <= '9'))
            s++;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(s - line), line);
        char key[2048], base[2048], le[64];
        if (!parse_labels(p, line, &s, key, base, sizeof key, le)) {
            ok = false;
            break;
        }
        double v;
        if (*s != ' ' || !parse_value(s + 1, &v)) {
            ok = fail(p, line, "bad value");
            break;
        }
        if (cur < 0 || !p->kind[cur][0]) {
            ok = fail(p, line, "a sample before its TYPE");
            break;
        }
        const char *fam = p->fam[cur];
        size_t fl = strlen(fam);
        bool hist = !strcmp(p->kind[cur], "histogram");
        if (!hist && strcmp(name, fam)) {
            ok = fail(p, line, "a sample outside its family");
            break;
        }
        if (hist) {
            const char *suf = strncmp(name, fam, fl) ? "" : name + fl;
            if (!strcmp(suf, "_bucket")) {
                if (!le[0]) {
                    ok = fail(p, line, "a bucket without le");
                    break;
                }
                if (strcmp(base, hist_labels)) {
                    if (last_cum >= 0 && inf_count < 0) {
                        ok = fail(p, line, "a histogram without its +Inf bucket");
                        break;
                    }
                    snprintf(hist_labels, sizeof hist_labels, "%s", base);
                    last_cum = 0;
                    inf_count = -1;
                }
                if (v < last_cum) {
                    ok = fail(p, line, "buckets not cumulative");
                    break;
                }
                last_cum = v;
                if (!strcmp(le, "+Inf"))
                    inf_count = v;
            } else if (!strcmp(suf, "_count")) {
                if (inf_count < 0 || v != inf_count)
                    ok = fail(p, line, "_count is not the +Inf bucket");
                last_cum = -1;
                hist_labels[0] = '\0';
            } else if (strcmp(suf, "_sum")) {
                ok = fail(p, line, "a histogram sample that is no bucket, sum or count");
            }
        }
        if (p->n_series < MAX_SERIES) {
            char full[4500];
            snprintf(full, sizeof full, "%s{%s}", name, key);
            for (int i = 0; ok && i < p->n_series; i++)
                if (!strcmp(p->series[i], full))
                    ok = fail(p, line, "a series twice");
            p->series[p->n_series++] = strdup(full);
        }
    }
    for (int i = 0; i < p->n_series; i++)
        free(p->series[i]);
    free(copy);
    return ok;
}

#define CHECK_PROM(text)                                                                           \
    do {                                                                                           \
        prom p_;                                                                                   \
        if (!prom_check(&p_, (text))) {                                                            \
            fprintf(stderr, "%s\n", (text));                                                       \
            SH_FAIL_("not valid Prometheus text: %s", p_.why);                                     \
        }                                                                                          \
    } while (0)

/* The checker itself must refuse what it is there to catch. */
static void test_checker(void)
{
    prom p;
    CHECK(prom_check(&p, "# HELP a x\n# TYPE a counter\na{b=\"1\"} 2\na{b=\"2\"} 3\n"));
    CHECK(!prom_check(&p, "# HELP a x\n# TYPE a counter\na 1\n# HELP a x\n# TYPE a counter\n"));
    CHECK(!prom_check(&p, "# HELP a x\n# TYPE a counter\na{b=\"1\",b=\"2\"} 1\n"));
    CHECK(!prom_check(&p, "# HELP a x\n# TYPE a counter\na{b=\"1\"} 1\na{b=\"1\"} 2\n"));
    CHECK(!prom_check(&p, "# HELP a x\n# TYPE a counter\nb 1\n"));
    CHECK(!prom_check(&p, "# HELP a x\n# TYPE a counter\na one\n"));
    CHECK(!prom_check(&p, "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\n"
                          "h_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"));
}

/* ---- the label merge ------------------------------------------------------------------------ */

static void test_labels_add(void)
{
    char b[128];
    CHECK_OK(sh_metrics_labels_add("", 0, "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "node=\"w0\"");
    CHECK_OK(sh_metrics_labels_add(NULL, 0, "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "node=\"w0\"");
    const char *l = "layer=\"15\",dtype=\"int8\"";
    CHECK_OK(sh_metrics_labels_add(l, strlen(l), "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "layer=\"15\",dtype=\"int8\",node=\"w0\"");
    /* Only len bytes are read (the collector passes views into a frame). */
    CHECK_OK(sh_metrics_labels_add(l, 10, "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "layer=\"15\",node=\"w0\"");
    /* A clash keeps the old label as exported_node, in its place. */
    l = "node=\"2\",kind=\"a\\\"b\"";
    CHECK_OK(sh_metrics_labels_add(l, strlen(l), "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "exported_node=\"2\",kind=\"a\\\"b\",node=\"w0\"");
    l = "exported_node=\"x\"";
    CHECK_OK(sh_metrics_labels_add(l, strlen(l), "node", "w0", b, sizeof b));
    CHECK_STR_EQ(b, "exported_node=\"x\",node=\"w0\"");
    l = "node=\"2\",exported_node=\"x\"";
    CHECK_INT_EQ(sh_metrics_labels_add(l, strlen(l), "node", "w0", b, sizeof b), SH_EINVAL);
    /* The value is escaped. */
    CHECK_OK(sh_metrics_labels_add("", 0, "node", "a\"b\\c\nd", b, sizeof b));
    CHECK_STR_EQ(b, "node=\"a\\\"b\\\\c\\nd\"");
    /* Malformed sets, a label twice, a bad name; too small a buffer. */
    const char *bad[] = {"a",        "a=1",   "a=\"1\",", "a=\"1\"b=\"2\"", "a=\"1\",a=\"2\"",
                         "9a=\"1\"", "a=\"1", "a=\"x\\"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_INT_EQ(sh_metrics_labels_add(bad[i], strlen(bad[i]), "node", "w0", b, sizeof b),
                     SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_labels_add("", 0, "no de", "w0", b, sizeof b), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_labels_add("", 0, "", "w0", b, sizeof b), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_labels_add("", 0, "node", "w0", b, 8), SH_ERANGE);
    CHECK_UINT_EQ(strlen(b), 7);
}

/* ---- rendering extras ----------------------------------------------------------------------- */

static void test_render_with(void)
{
    sh_metrics *m = NULL;
    CHECK_OK(sh_metrics_create(&m));
    sh_counter *c;
    sh_gauge *g;
    CHECK_OK(sh_metrics_counter(m, "shoal_msgs_total", "Messages.", "node=\"1\"", &c));
    CHECK_OK(sh_metrics_gauge(m, "shoal_depth", "Depth.", NULL, &g));
    sh_counter_add(c, 5);
    sh_gauge_set(g, 2);
    const double bounds[] = {0.5, 1};
    const uint64_t counts[] = {1, 2, 3};
    sh_metric_sample x[] = {
        {.name = "shoal_zeta_total",
         .help = "",
         .labels = "node=\"w1\"",
         .kind = SH_METRIC_COUNTER,
         .value = 1},
        {.name = "shoal_msgs_total",
         .labels = "exported_node=\"2\",node=\"w0\"",
         .kind = SH_METRIC_COUNTER,
         .value = 7},
        {.name = "shoal_step_seconds",
         .help = "Step time.",
         .labels = "node=\"w0\"",
         .kind = SH_METRIC_HISTOGRAM,
         .n_bounds = 2,
         .bounds = bounds,
         .counts = counts,
         .sum = 4.25},
        {.name = "shoal_zeta_total",
         .help = "Zeta.",
         .labels = "node=\"w0\"",
         .kind = SH_METRIC_COUNTER,
         .value = 1e15},
        /* Left out: another kind than the registry's family, than the family's first sample; a
         * bad name; a label twice; le on a histogram. */
        {.name = "shoal_depth", .labels = "node=\"w0\"", .kind = SH_METRIC_COUNTER, .value = 1},
        {.name = "shoal_zeta_total", .labels = "node=\"w2\"", .kind = SH_METRIC_GAUGE},
        {.name = "9bad", .kind = SH_METRIC_GAUGE},
        {.name = "shoal_x", .labels = "a=\"1\",a=\"2\"", .kind = SH_METRIC_GAUGE},
        {.name = "shoal_h",
         .labels = "le=\"1\"",
         .kind = SH_METRIC_HISTOGRAM,
         .n_bounds = 2,
         .bounds = bounds,
         .counts = counts},
        {.name = "shoal_age_seconds",
         .labels = "node=\"w3\"",
         .kind = SH_METRIC_GAUGE,
         .value = INFINITY},
    };
    const char *want = "# HELP shoal_msgs_total Messages.\n"
                       "# TYPE shoal_msgs_total counter\n"
                       "shoal_msgs_total{node=\"1\"} 5\n"
                       "shoal_msgs_total{exported_node=\"2\",node=\"w0\"} 7\n"
                       "# HELP shoal_depth Depth.\n"
                       "# TYPE shoal_depth gauge\n"
                       "shoal_depth 2\n"
                       "# HELP shoal_age_seconds \n"
                       "# TYPE shoal_age_seconds gauge\n"
                       "shoal_age_seconds{node=\"w3\"} +Inf\n"
                       "# HELP shoal_step_seconds Step time.\n"
                       "# TYPE shoal_step_seconds histogram\n"
                       "shoal_step_seconds_bucket{node=\"w0\",le=\"0.5\"} 1\n"
                       "shoal_step_seconds_bucket{node=\"w0\",le=\"1\"} 3\n"
                       "shoal_step_seconds_bucket{node=\"w0\",le=\"+Inf\"} 6\n"
                       "shoal_step_seconds_sum{node=\"w0\"} 4.25\n"
                       "shoal_step_seconds_count{node=\"w0\"} 6\n"
                       "# HELP shoal_zeta_total Zeta.\n"
                       "# TYPE shoal_zeta_total counter\n"
                       "shoal_zeta_total{node=\"w1\"} 1\n"
                       "shoal_zeta_total{node=\"w0\"} 1e+15\n";
    char buf[4096];
    size_t len = 0;
    CHECK_OK(sh_metrics_render_with(m, x, sizeof x / sizeof x[0], buf, sizeof buf, &len));
    CHECK_STR_EQ(buf, want);
    CHECK_UINT_EQ(len, strlen(want));
    CHECK_PROM(buf);
    char small[32];
    CHECK_INT_EQ(sh_metrics_render_with(m, x, sizeof x / sizeof x[0], small, sizeof small, &len),
                 SH_ERANGE);
    CHECK_UINT_EQ(len, strlen(want));
    /* No extras: exactly sh_metrics_render(). */
    char plain[4096];
    CHECK_OK(sh_metrics_render(m, plain, sizeof plain, NULL));
    CHECK_OK(sh_metrics_render_with(m, NULL, 0, buf, sizeof buf, NULL));
    CHECK_STR_EQ(buf, plain);
    sh_metrics_destroy(m);
}

/* ---- the store ------------------------------------------------------------------------------ */

static sh_strv sv(const char *s) { return (sh_strv){s, (uint32_t)strlen(s)}; }

/* Renders as the gateway does: again with a larger buffer while it does not fit (the ages'
 * digits change from one call to the next). */
static char *render(sh_node_metrics *nm, sh_metrics *m)
{
    size_t len = 0, cap = 0;
    char *buf = NULL;
    CHECK_INT_EQ(sh__node_metrics_render(nm, m, NULL, 0, &len), SH_ERANGE);
    for (;;) {
        cap = len + 64;
        buf = realloc(buf, cap);
        sh_err err = sh__node_metrics_render(nm, m, buf, cap, &len);
        if (err == SH_OK)
            break;
        CHECK_INT_EQ(err, SH_ERANGE);
    }
    CHECK_PROM(buf);
    return buf;
}

static void test_store(void)
{
    const sh_addr w0 = sh_addr_make(2, 3), w1 = sh_addr_make(3, 4);
    sh_node_metrics_peer peers[] = {{"w0", w0}, {"w1", w1}};
    sh_node_metrics *nm = NULL;
    CHECK_OK(sh__node_metrics_create(peers, 2, &nm));
    sh_metrics *front = NULL;
    CHECK_OK(sh_metrics_create(&front));
    sh_counter *c;
    CHECK_OK(sh_metrics_counter(front, "shoal_msgs_sent_total", "Sent.", "node=\"1\"", &c));

    /* Before any report: the age is +Inf, nothing else of the nodes. */
    char *t = render(nm, front);
    CHECK(strstr(t, "shoal_node_metrics_age_seconds{node=\"w0\"} +Inf\n"));
    CHECK(strstr(t, "shoal_node_metrics_reports_total{node=\"w1\"} 0\n"));
    free(t);

    const double b[] = {0.01, 0.1};
    const uint64_t cnt[] = {4, 0, 1};
    sh_proto_metric v[] = {
        {sv("shoal_act_bytes_total{layer=\"15\",dtype=\"int8\"}"), 0, 1234, sv("ACT bytes.")},
        {sv("shoal_msgs_sent_total{node=\"2\"}"), 0, 99, sv("Sent.")},
        {sv("shoal_actors"), 1, 3, sv("")},
    };
    sh_proto_histogram h[] = {
        {sv("shoal_stage_seconds{stage=\"1\"}"), {b, 2}, {cnt, 3}, 0.5, sv("Stage time.")}};
    sh_proto_metrics r = {.at_us = 1, .values = {v, 3}, .hists = {h, 1}};
    sh_error e = {0};
    CHECK_OK(sh__node_metrics_put(nm, w0, &r, sh__act_mono_us(), &e));
    v[0].value = 2000;
    CHECK_OK(sh__node_metrics_put(nm, w1, &r, sh__act_mono_us() - 3000000, &e));
    CHECK_INT_EQ(sh__node_metrics_put(nm, sh_addr_make(2, 4), &r, 0, &e), SH_ENOTFOUND);
    t = render(nm, front);
    CHECK(strstr(t, "# TYPE shoal_msgs_sent_total counter\n"
                    "shoal_msgs_sent_total{node=\"1\"} 0\n"
                    "shoal_msgs_sent_total{exported_node=\"2\",node=\"w0\"} 99\n"
                    "shoal_msgs_sent_total{exported_node=\"2\",node=\"w1\"} 99\n"));
    CHECK(strstr(t, "# HELP shoal_act_bytes_total ACT bytes.\n# TYPE shoal_act_bytes_total "
                    "counter\nshoal_act_bytes_total{layer=\"15\",dtype=\"int8\",node=\"w0\"} 1234\n"
                    "shoal_act_bytes_total{layer=\"15\",dtype=\"int8\",node=\"w1\"} 2000\n"));
    CHECK(strstr(t, "shoal_stage_seconds_bucket{stage=\"1\",node=\"w0\",le=\"0.1\"} 4\n"));
    CHECK(strstr(t, "shoal_stage_seconds_count{stage=\"1\",node=\"w1\"} 5\n"));
    CHECK(strstr(t, "shoal_actors{node=\"w1\"} 3\n"));
    CHECK(strstr(t, "shoal_node_metrics_reports_total{node=\"w0\"} 1\n"));
    double age0 = -1, age1 = -1;
    const char *a0 = strstr(t, "shoal_node_metrics_age_seconds{node=\"w0\"} ");
    const char *a1 = strstr(t, "shoal_node_metrics_age_seconds{node=\"w1\"} ");
    CHECK(a0 && a1);
    age0 = strtod(strchr(a0, '}') + 2, NULL);
    age1 = strtod(strchr(a1, '}') + 2, NULL);
    CHECK(age0 >= 0 && age0 < 1);
    CHECK(age1 >= 3 && age1 < 4);
    free(t);

    /* Refused whole, the snapshot left as it was, counted. */
    struct {
        int which; /* 0: value 0's name, 1: histogram bounds, 2: a duplicate, 3: two kinds */
        const char *name;
    } bad[] = {
        {0, "bad name{a=\"1\"}"},
        {0, "a{b=\"1\""},
        {0, "a{b=1}"},
        {0, "a{b=\"\xff\"}"},
        {0, "a{b=\"\x01\"}"},
        {0, "a{b=\"1\",b=\"2\"}"},
        {0, "a{node=\"1\",exported_node=\"2\"}"},
        {0, ""},
        {0, "{a=\"1\"}"},
        {1, NULL},
        {2, NULL},
        {3, NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sh_proto_metric vv[3];
        memcpy(vv, v, sizeof vv);
        sh_proto_histogram hh = h[0];
        const double nb[] = {0.1, 0.1};
        if (bad[i].which == 0)
            vv[0].name = sv(bad[i].name);
        else if (bad[i].which == 1)
            hh.bounds = (sh_f64s){nb, 2};
        else if (bad[i].which == 2)
            vv[2] = vv[1];
        else
            vv[2].name = sv("shoal_stage_seconds{stage=\"2\"}");
        sh_proto_metrics rr = {.at_us = 2, .values = {vv, 3}, .hists = {&hh, 1}};
        sh_error e2 = {0};
        CHECK_INT_EQ(sh__node_metrics_put(nm, w0, &rr, sh__act_mono_us(), &e2), SH_EPROTO);
        CHECK(e2.msg[0] != '\0');
    }
    /* A bad help text too. */
    v[0].help = sv("line\nbreak");
    CHECK_INT_EQ(sh__node_metrics_put(nm, w0, &r, sh__act_mono_us(), &e), SH_EPROTO);
    t = render(nm, front);
    CHECK(strstr(t, "shoal_act_bytes_total{layer=\"15\",dtype=\"int8\",node=\"w0\"} 1234\n"));
    char want[128];
    snprintf(want, sizeof want, "shoal_node_metrics_rejected_total{node=\"w0\"} %d\n",
             (int)(sizeof bad / sizeof bad[0]) + 1);
    CHECK(strstr(t, want));
    CHECK(strstr(t, "shoal_node_metrics_rejected_total{node=\"w1\"} 0\n"));
    free(t);

    /* An empty report empties the node's series. */
    sh_proto_metrics empty = {.at_us = 3};
    CHECK_OK(sh__node_metrics_put(nm, w0, &empty, sh__act_mono_us(), &e));
    t = render(nm, front);
    CHECK(!strstr(t, "node=\"w0\"} 1234"));
    CHECK(strstr(t, "shoal_node_metrics_reports_total{node=\"w0\"} 2\n"));
    free(t);
    sh__node_metrics_destroy(nm);
    sh__node_metrics_destroy(NULL);
    sh_metrics_destroy(front);

    sh_node_metrics_peer badp[] = {{NULL, w0}};
    CHECK_INT_EQ(sh__node_metrics_create(badp, 1, &nm), SH_EINVAL);
}

/* ---- the actors, with real METRICS messages ------------------------------------------------- */

/* A reporter and a collector in one runtime (node 7): the collector stores the reporter's
 * snapshots of the runtime's own registry; a METRICS whose body does not decode, sent as if by
 * the reporter, is dropped and counted; the runtime stops with nothing left. */
static void test_actors(void)
{
    test_rt t;
    rt_start(&t, 7, 2, NULL);
    sh_error e = {0};
    CHECK_OK(sh__serve_register(t.rt, &e));
    /* Actor ids follow spawn order: the collector is 1, the reporter 2. */
    const sh_addr rep = sh_addr_make(7, 2);
    sh_node_metrics_peer peers[] = {{"w0", rep}};
    sh_node_metrics *nm = NULL;
    CHECK_OK(sh__node_metrics_create(peers, 1, &nm));
    sh_node_metrics_collector_args ca = {.nm = nm};
    sh_addr col = 0, got = 0;
    CHECK_OK(sh_actor_spawn(t.rt, "node_metrics_collector", &ca, 0, &col, &e));
    sh_counter *c;
    const double b[] = {1, 2};
    sh_histogram *h;
    sh_metrics *mx = sh_runtime_metrics(t.rt);
    CHECK_OK(sh_metrics_counter(mx, "shoal_act_bytes_total", "ACT bytes.",
                                "layer=\"3\",dtype=\"f32\"", &c));
    CHECK_OK(sh_metrics_histogram(mx, "shoal_test_seconds", "Test.", NULL, b, 2, &h));
    sh_histogram_observe(h, 1.5);
    sh_node_metrics_reporter_args ra = {.collector = col, .period_ms = 20};
    CHECK_OK(sh_actor_spawn(t.rt, "node_metrics_reporter", &ra, 1, &got, &e));
    CHECK_UINT_EQ(got, rep);

    sh_metrics *front = NULL;
    CHECK_OK(sh_metrics_create(&front));
    char *text = NULL;
    uint64_t deadline = now_ms() + 5000;
    for (uint64_t n = 1; n <= 3; n++) {
        sh_counter_add(c, 100);
        char want[128];
        snprintf(want, sizeof want,
                 "shoal_act_bytes_total{layer=\"3\",dtype=\"f32\",node=\"w0\"} %llu\n",
                 (unsigned long long)(100 * n));
        for (;;) {
            free(text);
            text = render(nm, front);
            if (strstr(text, want))
                break;
            if (now_ms() > deadline) {
                fprintf(stderr, "%s\n", text);
                SH_FAIL_("no report with %s", want);
            }
            sleep_ms(5);
        }
    }
    CHECK(strstr(text, "# HELP shoal_act_bytes_total ACT bytes.\n"));
    CHECK(strstr(text, "shoal_test_seconds_bucket{node=\"w0\",le=\"2\"} 1\n"));
    CHECK(strstr(text, "shoal_test_seconds_sum{node=\"w0\"} 1.5\n"));
    /* The runtime's own series carry node="7": kept as exported_node. */
    CHECK(strstr(text, "shoal_msgs_sent_total{exported_node=\"7\",node=\"w0\"} "));
    CHECK(strstr(text, "shoal_node_metrics_skipped_total{node=\"w0\"} 0\n"));
    CHECK(strstr(text, "shoal_node_metrics_rejected_total{node=\"w0\"} 0\n"));

    /* A body that is not a METRICS map, as if from the reporter: dropped and counted. */
    const uint8_t junk[] = {0x81, 0xa1, 't', 0xa3, 'x', 'y', 'z'}; /* {"t": "xyz"} */
    sh_msg_hdr hd = {.type = SH_MSG_METRICS, .src = rep, .dst = col};
    CHECK_OK(sh_send(t.rt, &hd, junk, sizeof junk, &e));
    deadline = now_ms() + 5000;
    while (!strstr(text, "shoal_node_metrics_rejected_total{node=\"w0\"} 1\n")) {
        CHECK(now_ms() < deadline);
        sleep_ms(5);
        free(text);
        text = render(nm, front);
    }
    free(text);
    rt_finish(&t);
    sh__node_metrics_destroy(nm);
    sh_metrics_destroy(front);
}

static const sh_test_case tests[] = {
    {"checker", test_checker}, {"labels_add", test_labels_add}, {"render_with", test_render_with},
    {"store", test_store},     {"actors", test_actors},         {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
