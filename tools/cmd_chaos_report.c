/* `shoal chaos`'s report: the cluster's history (GET /admin/status's events, or its log lines),
 * detection and recovery time per scenario event, outcome counts and latency by phase. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/bench.h"
#include "tools/cmd_chaos.h"

#define ERROR_KINDS 8
#define LISTED 10

bool sh__chaos_marks_add(sh__chaos_marks *m, const sh__chaos_mark *mk)
{
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 32;
        sh__chaos_mark *v = realloc(m->v, cap * sizeof *v);
        if (!v)
            return false;
        m->v = v;
        m->cap = cap;
    }
    m->v[m->n++] = *mk;
    return true;
}

static void add(sh__chaos_marks *m, double t, const char *kind, const char *node, size_t node_len,
                int32_t replica, const char *line)
{
    sh__chaos_mark mk = {.t = t, .replica = replica};
    snprintf(mk.kind, sizeof mk.kind, "%s", kind);
    if (node_len >= sizeof mk.node)
        node_len = sizeof mk.node - 1;
    memcpy(mk.node, node, node_len);
    mk.node[node_len] = '\0';
    snprintf(mk.msg, sizeof mk.msg, "%s", line);
    (void)sh__chaos_marks_add(m, &mk);
}

/* The lines of `shoal chaos --engine`'s engine (its log callback, "[engine] LINE"): the
 * watchdog's death (`... event=node_dead node="w1" why="..."`), and the supervisor's pause and
 * resumption (actors/supervisor.c):
 *   node NAME (URL) was lost: ...: replica K paused; ...
 *   node NAME came back S s after it was lost (...); replica K resumed ...
 *   node NAME was replaced by standby S in T s; replica K resumed ... */
static void marks_from_engine(sh__chaos_marks *m, const char *line, double t)
{
    const char *p = strstr(line, " event=node_dead node=\"");
    const char *rep;
    int k;
    if (p) {
        const char *name = p + 23;
        add(m, t, "dead", name, strcspn(name, "\""), -1, line);
        return;
    }
    if (strncmp(line + 9, "node ", 5))
        return;
    const char *name = line + 14;
    size_t len = strcspn(name, " ");
    if (strstr(name, " was lost") && (rep = strstr(name, "replica ")) &&
        sscanf(rep, "replica %d paused", &k) == 1 && strstr(rep, "paused"))
        add(m, t, "paused", "", 0, k - 1, line);
    else if ((strstr(name, " came back ") || strstr(name, " was replaced by standby ")) &&
             (rep = strstr(name, "; replica ")) && sscanf(rep, "; replica %d resumed", &k) == 1)
        add(m, t, "resumed", name, len, k - 1, line);
}

/* The front's lines (tools/cmd_serve.c) and the supervisor's (tools/cmd_cluster.c):
 *   [front] shoal: node NAME (URL) was lost: ...: replica K paused; ...
 *   [front] shoal: node NAME came back S s after it was lost; replica K resumed ...
 *   cluster: node NAME exited (...) */
void sh__chaos_marks_from_line(sh__chaos_marks *m, const char *line, double t)
{
    const char *p = strstr(line, "shoal: node ");
    const char *rep;
    int k;
    if (!strncmp(line, "[engine] ", 9)) {
        marks_from_engine(m, line, t);
        return;
    }
    if (p) {
        const char *name = p + 12;
        size_t len = strcspn(name, " ");
        if (strstr(name, " was lost") && (rep = strstr(name, "replica ")) &&
            sscanf(rep, "replica %d paused", &k) == 1 && strstr(rep, "paused")) {
            add(m, t, "dead", name, len, -1, line);
            add(m, t, "paused", "", 0, k - 1, line);
        } else if (strstr(name, " came back ") && (rep = strstr(name, "; replica ")) &&
                   sscanf(rep, "; replica %d resumed", &k) == 1) {
            add(m, t, "resumed", name, len, k - 1, line);
        }
        return;
    }
    if (!strncmp(line, "cluster: node ", 14) && strstr(line, " exited (")) {
        const char *name = line + 14;
        add(m, t, "exited", name, strcspn(name, " "), -1, line);
    }
}

bool sh__chaos_marks_from_status(sh__chaos_marks *m, const char *body, size_t len,
                                 uint64_t epoch_unix_ms)
{
    json_t *j = json_loadb(body, len, 0, NULL);
    json_t *evs = json_object_get(j, "events");
    if (!json_is_array(evs) || json_array_size(evs) == 0) {
        json_decref(j);
        return false;
    }
    sh__chaos_marks out = {0};
    size_t i;
    json_t *ev;
    json_array_foreach(evs, i, ev)
    {
        json_t *ms = json_object_get(ev, "unix_ms");
        const char *kind = json_string_value(json_object_get(ev, "kind"));
        if (!json_is_number(ms) || !kind)
            continue;
        const char *node = json_string_value(json_object_get(ev, "node"));
        json_t *rep = json_object_get(ev, "replica");
        const char *msg = json_string_value(json_object_get(ev, "msg"));
        double t = (json_number_value(ms) - (double)epoch_unix_ms) / 1000.0;
        add(&out, t, kind, node ? node : "", node ? strlen(node) : 0,
            json_is_integer(rep) ? (int32_t)json_integer_value(rep) : -1, msg ? msg : "");
    }
    json_decref(j);
    free(m->v);
    *m = out;
    return true;
}

/* Whether the event starts a disturbance the cluster may detect (heal and cont end one). */
static bool disturbs(const sh_fault_event *ev)
{
    return ev->kind != SH_FAULT_HEAL && ev->kind != SH_FAULT_CONT;
}

static double event_end(const sh_fault_event *ev)
{
    if (ev->kind == SH_FAULT_STALL)
        return ev->time_s + ev->ms / 1000.0;
    return ev->time_s + ev->lasting_s;
}

void sh__chaos_report_compute(sh__chaos_report *r)
{
    const sh__chaos_marks *m = r->marks;
    bool *used = calloc(m->n ? m->n : 1, sizeof *used);
    r->window_start = INFINITY;
    r->window_end = -INFINITY;
    for (size_t i = 0; i < r->sc->n_events; i++) {
        const sh_fault_event *ev = &r->sc->events[i];
        sh__chaos_event_result *er = &r->events[i];
        er->ev = ev;
        er->detect_s = er->recover_s = NAN;
        if (ev->time_s < r->window_start)
            r->window_start = ev->time_s;
        if (event_end(ev) > r->window_end)
            r->window_end = event_end(ev);
        if (!disturbs(ev) || !used)
            continue;
        // The first unclaimed "dead" (a leak: "drain") at or after the event, then the first
        // unclaimed "resumed" after it.
        size_t d = m->n;
        for (size_t k = 0; k < m->n && d == m->n; k++)
            if (!used[k] && m->v[k].t >= ev->time_s - 0.001 &&
                (!strcmp(m->v[k].kind, "dead") ||
                 (ev->kind == SH_FAULT_LEAK && !strcmp(m->v[k].kind, "drain"))))
                d = k;
        if (d == m->n)
            continue;
        used[d] = true;
        er->detect_s = m->v[d].t - ev->time_s;
        for (size_t k = 0; k < m->n; k++)
            if (!used[k] && m->v[k].t >= m->v[d].t && !strcmp(m->v[k].kind, "resumed")) {
                used[k] = true;
                er->recover_s = m->v[k].t - ev->time_s;
                break;
            }
    }
    for (size_t k = 0; k < m->n; k++)
        if (!strcmp(m->v[k].kind, "resumed") && m->v[k].t > r->window_end)
            r->window_end = m->v[k].t;
    free(used);
    if (!isfinite(r->window_start))
        r->window_start = r->window_end = 0;
    memset(r->counts, 0, sizeof r->counts);
    for (int64_t i = 0; i < r->n_reqs; i++)
        r->counts[r->reqs[i].outcome]++;
}

typedef struct phase {
    const char *name;
    double *v;
    size_t n;
    double p50, p90, p99, max;
} phase;

static void phases(const sh__chaos_report *r, phase ph[3])
{
    static const char *const names[3] = {"before", "during", "after"};
    for (int i = 0; i < 3; i++) {
        ph[i] = (phase){.name = names[i]};
        ph[i].v = malloc((size_t)(r->n_reqs ? r->n_reqs : 1) * sizeof(double));
    }
    for (int64_t i = 0; i < r->n_reqs; i++) {
        const sh__chaos_req *q = &r->reqs[i];
        if (q->outcome != SH__CHAOS_OK && q->outcome != SH__CHAOS_WRONG)
            continue;
        // During: the request was open at some moment of the fault window.
        int k = q->t_end < r->window_start ? 0 : q->t_start <= r->window_end ? 1 : 2;
        if (ph[k].v)
            ph[k].v[ph[k].n++] = q->t_end - q->t_start;
    }
    for (int i = 0; i < 3; i++) {
        ph[i].p50 = sh__bench_report_percentile(ph[i].v, ph[i].n, 50);
        ph[i].p90 = sh__bench_report_percentile(ph[i].v, ph[i].n, 90);
        ph[i].p99 = sh__bench_report_percentile(ph[i].v, ph[i].n, 99);
        ph[i].max = sh__bench_report_percentile(ph[i].v, ph[i].n, 100);
    }
}

static void phases_free(phase ph[3])
{
    for (int i = 0; i < 3; i++)
        free(ph[i].v);
}

static void describe(const sh_fault_event *ev, char *buf, size_t cap)
{
    const char *k = sh_scenario_kind_name(ev->kind);
    switch (ev->kind) {
    case SH_FAULT_KILL:
    case SH_FAULT_CONT:
        snprintf(buf, cap, "%s %s", k, ev->from);
        break;
    case SH_FAULT_STOP:
        if (ev->lasting_s > 0)
            snprintf(buf, cap, "stop %s for %g s", ev->from, ev->lasting_s);
        else
            snprintf(buf, cap, "stop %s", ev->from);
        break;
    case SH_FAULT_STALL:
        snprintf(buf, cap, "stall %s for %g ms", ev->from, ev->ms);
        break;
    case SH_FAULT_LEAK:
        snprintf(buf, cap, "leak %s %g MiB/s for %g s", ev->from, ev->mb_per_s, ev->lasting_s);
        break;
    case SH_FAULT_PARTITION:
        snprintf(buf, cap, "partition %s | %s%s", ev->from, ev->to, ev->lasting_s > 0 ? "" : "");
        break;
    case SH_FAULT_DELAY:
        snprintf(buf, cap, "delay %s->%s %g ms", ev->from, ev->to, ev->ms);
        break;
    case SH_FAULT_CORRUPT:
        snprintf(buf, cap, "corrupt %s->%s p=%g bytes=%d", ev->from, ev->to, ev->p, (int)ev->bytes);
        break;
    default:
        snprintf(buf, cap, "%s %s->%s p=%g", k, ev->from, ev->to, ev->p);
        break;
    }
    if (ev->lasting_s > 0 && ev->kind != SH_FAULT_STOP && ev->kind != SH_FAULT_LEAK) {
        size_t n = strlen(buf);
        snprintf(buf + n, cap - n, " for %g s", ev->lasting_s);
    }
}

/* Distinct error texts of the requests of one outcome, with counts. */
typedef struct err_kind {
    const char *msg;
    int64_t n;
} err_kind;

static int error_kinds(const sh__chaos_report *r, sh__chaos_outcome o, err_kind *out)
{
    int n = 0;
    for (int64_t i = 0; i < r->n_reqs; i++) {
        const sh__chaos_req *q = &r->reqs[i];
        if (q->outcome != o)
            continue;
        int k = 0;
        while (k < n && strcmp(out[k].msg, q->err))
            k++;
        if (k == n && n < ERROR_KINDS)
            out[n++] = (err_kind){q->err, 0};
        if (k < n)
            out[k].n++;
    }
    return n;
}

static bool passed(const sh__chaos_report *r)
{
    return r->counts[SH__CHAOS_LOST] == 0 && r->counts[SH__CHAOS_WRONG] == 0;
}

void sh__chaos_report_text(FILE *f, const sh__chaos_report *r)
{
    const int64_t *c = r->counts;
    fprintf(f, "shoal chaos: %s against %s%s, %zu events\n", r->o->scenario, r->o->cluster,
            r->o->engine ? " (front: an embedding engine in this process)" : "", r->sc->n_events);
    fprintf(f,
            "requests: %lld accepted, %lld completed (%lld equal to the reference, %lld wrong), "
            "%lld ended with a clear error, %lld lost\n",
            (long long)r->n_reqs, (long long)(c[SH__CHAOS_OK] + c[SH__CHAOS_WRONG]),
            (long long)c[SH__CHAOS_OK], (long long)c[SH__CHAOS_WRONG],
            (long long)c[SH__CHAOS_ERROR], (long long)c[SH__CHAOS_LOST]);
    fprintf(f, "events (detection and recovery from %s):\n", r->marks_source);
    for (size_t i = 0; i < r->sc->n_events; i++) {
        const sh__chaos_event_result *er = &r->events[i];
        char d[200];
        describe(er->ev, d, sizeof d);
        fprintf(f, "  %8.3f s  %-40s line %-4d", er->ev->time_s, d, (int)er->ev->line);
        if (!disturbs(er->ev))
            fprintf(f, "\n");
        else if (isnan(er->detect_s))
            fprintf(f, "  not detected\n");
        else if (isnan(er->recover_s))
            fprintf(f, "  detected after %.3f s, no recovery seen\n", er->detect_s);
        else
            fprintf(f, "  detected after %.3f s, recovered after %.3f s\n", er->detect_s,
                    er->recover_s);
    }
    phase ph[3];
    phases(r, ph);
    fprintf(f, "latency of completed requests (s), fault window %.3f..%.3f s:\n", r->window_start,
            r->window_end);
    fprintf(f, "  %-7s %6s %8s %8s %8s %8s\n", "phase", "n", "p50", "p90", "p99", "max");
    for (int i = 0; i < 3; i++)
        fprintf(f, "  %-7s %6zu %8.3f %8.3f %8.3f %8.3f\n", ph[i].name, ph[i].n, ph[i].p50,
                ph[i].p90, ph[i].p99, ph[i].max);
    phases_free(ph);
    static const char *const what[4] = {NULL, "wrong", "errors", "lost"};
    for (int o = SH__CHAOS_WRONG; o <= SH__CHAOS_LOST; o++) {
        err_kind ek[ERROR_KINDS];
        int n = error_kinds(r, (sh__chaos_outcome)o, ek);
        for (int k = 0; k < n; k++)
            fprintf(f, "%s: %lld x %s\n", what[o], (long long)ek[k].n, ek[k].msg);
    }
    if (r->log_path)
        fprintf(f, "cluster log: %s\n", r->log_path);
    fprintf(f, "result: %s (%lld lost, %lld wrong)\n", passed(r) ? "PASS" : "FAIL",
            (long long)c[SH__CHAOS_LOST], (long long)c[SH__CHAOS_WRONG]);
}

static json_t *num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

json_t *sh__chaos_report_json(const sh__chaos_report *r)
{
    const int64_t *c = r->counts;
    json_t *evs = json_array(), *marks = json_array(), *lat = json_object(), *errs = json_array();
    for (size_t i = 0; i < r->sc->n_events; i++) {
        const sh__chaos_event_result *er = &r->events[i];
        char d[200];
        describe(er->ev, d, sizeof d);
        json_array_append_new(
            evs, json_pack("{s:f, s:s, s:s, s:s, s:s, s:i, s:o, s:o}", "t", er->ev->time_s, "kind",
                           sh_scenario_kind_name(er->ev->kind), "what", d, "from", er->ev->from,
                           "to", er->ev->to, "line", (int)er->ev->line, "detect_s",
                           num(er->detect_s), "recover_s", num(er->recover_s)));
    }
    for (size_t k = 0; k < r->marks->n; k++) {
        const sh__chaos_mark *mk = &r->marks->v[k];
        json_array_append_new(marks,
                              json_pack("{s:f, s:s, s:s?, s:o, s:s}", "t", mk->t, "kind", mk->kind,
                                        "node", mk->node[0] ? mk->node : NULL, "replica",
                                        mk->replica >= 0 ? json_integer(mk->replica) : json_null(),
                                        "msg", mk->msg));
    }
    phase ph[3];
    phases(r, ph);
    for (int i = 0; i < 3; i++)
        json_object_set_new(lat, ph[i].name,
                            json_pack("{s:I, s:o, s:o, s:o, s:o}", "n", (json_int_t)ph[i].n, "p50",
                                      num(ph[i].p50), "p90", num(ph[i].p90), "p99", num(ph[i].p99),
                                      "max", num(ph[i].max)));
    phases_free(ph);
    static const char *const what[4] = {NULL, "wrong", "error", "lost"};
    for (int o = SH__CHAOS_WRONG; o <= SH__CHAOS_LOST; o++) {
        err_kind ek[ERROR_KINDS];
        int n = error_kinds(r, (sh__chaos_outcome)o, ek);
        for (int k = 0; k < n; k++)
            json_array_append_new(errs, json_pack("{s:s, s:I, s:s}", "outcome", what[o], "count",
                                                  (json_int_t)ek[k].n, "msg", ek[k].msg));
    }
    return json_pack(
        "{s:s, s:s, s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:o, s:s, s:o, s:[f, f], s:o, s:o, s:s?, "
        "s:b}",
        "scenario", r->o->scenario, "cluster", r->o->cluster, "requests", "accepted",
        (json_int_t)r->n_reqs, "completed", (json_int_t)(c[SH__CHAOS_OK] + c[SH__CHAOS_WRONG]),
        "equal", (json_int_t)c[SH__CHAOS_OK], "wrong", (json_int_t)c[SH__CHAOS_WRONG], "errors",
        (json_int_t)c[SH__CHAOS_ERROR], "lost", (json_int_t)c[SH__CHAOS_LOST], "events", evs,
        "marks_source", r->marks_source, "marks", marks, "fault_window", r->window_start,
        r->window_end, "latency_s", lat, "failures", errs, "log", r->log_path, "pass", passed(r));
}
