/* `shoal bench`'s report: percentiles of TTFT, TPOT, inter-token gaps and latency, throughput,
 * failures; as text for people and as JSON for scripts. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/bench.h"

#define MAX_ERRORS_SHOWN 5

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double sh__bench_report_percentile(double *v, size_t n, double p)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    double pos = p / 100.0 * (double)(n - 1);
    size_t i = (size_t)pos;
    if (i + 1 >= n)
        return v[n - 1];
    return v[i] + (v[i + 1] - v[i]) * (pos - (double)i);
}

/* Percentiles and mean of one figure, in milliseconds; NAN without samples. */
typedef struct stat4 {
    double p50, p90, p99, mean;
    size_t n;
} stat4;

static stat4 stat_of(double *v, size_t n)
{
    stat4 s = {NAN, NAN, NAN, NAN, n};
    if (n == 0)
        return s;
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    s.mean = sum / (double)n * 1e3;
    s.p50 = sh__bench_report_percentile(v, n, 50) * 1e3;
    s.p90 = sh__bench_report_percentile(v, n, 90) * 1e3;
    s.p99 = sh__bench_report_percentile(v, n, 99) * 1e3;
    return s;
}

/* Everything the two reports print, computed once. */
typedef struct figures {
    int64_t ok, failed, prompt_tokens, output_tokens, n_usage;
    double rps, out_tps, total_tps, in_flight;
    stat4 ttft, tpot, itl, latency;
} figures;

static figures compute(const sh__bench_run *r)
{
    figures f = {0};
    size_t n = (size_t)r->n_results;
    double *ttft = malloc((n + 1) * sizeof *ttft), *tpot = malloc((n + 1) * sizeof *tpot);
    double *lat = malloc((n + 1) * sizeof *lat), *itl = malloc((r->n_itl + 1) * sizeof *itl);
    size_t n_ok = 0, n_tpot = 0;
    double busy = 0;
    for (size_t i = 0; i < n; i++) {
        const sh__bench_result *q = &r->results[i];
        busy += q->latency_s;
        if (!q->ok) {
            f.failed++;
            continue;
        }
        f.ok++;
        f.prompt_tokens += q->prompt_tokens;
        f.output_tokens += q->output_tokens;
        f.n_usage += q->usage;
        if (!ttft || !tpot || !lat)
            continue;
        ttft[n_ok] = q->ttft_s;
        lat[n_ok++] = q->latency_s;
        // Time per output token after the first: the decode rate one request saw.
        if (q->output_tokens > 1)
            tpot[n_tpot++] = (q->latency_s - q->ttft_s) / (double)(q->output_tokens - 1);
    }
    if (itl && r->n_itl)
        memcpy(itl, r->itl_s, r->n_itl * sizeof *itl);
    if (r->duration_s > 0) {
        f.rps = (double)f.ok / r->duration_s;
        f.out_tps = (double)f.output_tokens / r->duration_s;
        f.total_tps = (double)(f.output_tokens + f.prompt_tokens) / r->duration_s;
        f.in_flight = busy / r->duration_s;
    }
    f.ttft = stat_of(ttft, ttft ? n_ok : 0);
    f.tpot = stat_of(tpot, tpot ? n_tpot : 0);
    f.latency = stat_of(lat, lat ? n_ok : 0);
    f.itl = stat_of(itl, itl ? r->n_itl : 0);
    free(ttft);
    free(tpot);
    free(lat);
    free(itl);
    return f;
}

/* Where the token counts of the ok requests come from: the server's usage, the client's
 * estimate (words sent, token-bearing events, words received), or both. */
static const char *token_source(int64_t n_usage, int64_t ok)
{
    if (ok == 0)
        return "none";
    if (n_usage == ok)
        return "usage";
    return n_usage == 0 ? "estimate" : "mixed";
}

static void print_ms(FILE *f, double v)
{
    if (isnan(v))
        fprintf(f, " %10s", "n/a");
    else
        fprintf(f, " %10.2f", v);
}

static void print_stat(FILE *f, const char *name, const stat4 *s)
{
    fprintf(f, "  %-16s", name);
    print_ms(f, s->p50);
    print_ms(f, s->p90);
    print_ms(f, s->p99);
    print_ms(f, s->mean);
    fputc('\n', f);
}

void sh__bench_report_text(FILE *f, const sh__bench_run *r)
{
    const sh__bench_opts *o = r->o;
    figures g = compute(r);
    fprintf(f, "shoal bench: %s, model %s, %s, %s%s\n", o->url, r->model ? r->model : "?",
            o->chat ? "/v1/chat/completions" : "/v1/completions",
            o->stream ? "streaming" : "not streaming", r->interrupted ? " (interrupted)" : "");
    fprintf(f, "  requests:        %" PRId64 " ok, %" PRId64 " failed\n", g.ok, g.failed);
    fprintf(f, "  concurrency:     %d (mean in flight %.2f)\n", (int)o->concurrency, g.in_flight);
    fprintf(f, "  duration:        %.3f s\n", r->duration_s);
    fprintf(f, "  requests/s:      %.3f\n", g.rps);
    fprintf(f, "  output tok/s:    %.1f\n", g.out_tps);
    fprintf(f, "  total tok/s:     %.1f\n", g.total_tps);
    const char *src = token_source(g.n_usage, g.ok);
    const char *note = !strcmp(src, "estimate") ? " (estimated: the server reported no usage)"
                       : !strcmp(src, "mixed")  ? " (partly estimated: some responses had no usage)"
                                                : "";
    fprintf(f, "  prompt tokens:   %" PRId64 "%s\n", g.prompt_tokens, note);
    fprintf(f, "  output tokens:   %" PRId64 "%s\n", g.output_tokens, note);
    fprintf(f, "  %-16s %10s %10s %10s %10s\n", "", "p50", "p90", "p99", "mean");
    print_stat(f, "TTFT (ms)", &g.ttft);
    print_stat(f, "TPOT (ms)", &g.tpot);
    if (o->stream)
        print_stat(f, "ITL (ms)", &g.itl);
    print_stat(f, "latency (ms)", &g.latency);
    if (r->n_errors > 0) {
        fprintf(f, "  errors:%s\n", r->n_errors > MAX_ERRORS_SHOWN ? " (most frequent first)" : "");
        for (int i = 0; i < r->n_errors && i < MAX_ERRORS_SHOWN; i++)
            fprintf(f, "    %" PRId64 " x %s\n", r->errors[i].count, r->errors[i].msg);
        if (r->n_errors > MAX_ERRORS_SHOWN)
            fprintf(f, "    ... and %d other kinds\n", r->n_errors - MAX_ERRORS_SHOWN);
    }
}

static json_t *num(double v) { return isnan(v) || isinf(v) ? json_null() : json_real(v); }

static json_t *stat_json(const stat4 *s)
{
    json_t *j = json_object();
    json_object_set_new(j, "p50", num(s->p50));
    json_object_set_new(j, "p90", num(s->p90));
    json_object_set_new(j, "p99", num(s->p99));
    json_object_set_new(j, "mean", num(s->mean));
    json_object_set_new(j, "samples", json_integer((json_int_t)s->n));
    return j;
}

static json_t *dist_json(const sh__bench_dist *d)
{
    json_t *j = json_object();
    json_object_set_new(j, "min", json_integer(d->lo));
    json_object_set_new(j, "max", json_integer(d->hi));
    return j;
}

json_t *sh__bench_report_json(const sh__bench_run *r)
{
    const sh__bench_opts *o = r->o;
    figures g = compute(r);
    json_t *j = json_object(), *t;
    if (!j)
        return NULL;
    json_object_set_new(j, "url", json_string(o->url));
    json_object_set_new(j, "model", r->model ? json_string(r->model) : json_null());
    json_object_set_new(j, "endpoint", json_string(o->chat ? "chat" : "completions"));
    json_object_set_new(j, "stream", json_boolean(o->stream));
    json_object_set_new(j, "interrupted", json_boolean(r->interrupted));
    json_object_set_new(j, "concurrency", json_integer(o->concurrency));
    json_object_set_new(j, "mean_in_flight", num(g.in_flight));
    json_object_set_new(j, "requests", t = json_object());
    json_object_set_new(t, "total", json_integer(g.ok + g.failed));
    json_object_set_new(t, "ok", json_integer(g.ok));
    json_object_set_new(t, "failed", json_integer(g.failed));
    json_object_set_new(j, "duration_s", num(r->duration_s));
    json_object_set_new(j, "throughput", t = json_object());
    json_object_set_new(t, "requests_per_s", num(g.rps));
    json_object_set_new(t, "output_tokens_per_s", num(g.out_tps));
    json_object_set_new(t, "total_tokens_per_s", num(g.total_tps));
    json_object_set_new(j, "tokens", t = json_object());
    json_object_set_new(t, "prompt", json_integer(g.prompt_tokens));
    json_object_set_new(t, "output", json_integer(g.output_tokens));
    json_object_set_new(t, "source", json_string(token_source(g.n_usage, g.ok)));
    json_object_set_new(j, "ttft_ms", stat_json(&g.ttft));
    json_object_set_new(j, "tpot_ms", stat_json(&g.tpot));
    json_object_set_new(j, "itl_ms", stat_json(&g.itl));
    json_object_set_new(j, "latency_ms", stat_json(&g.latency));
    json_t *errs = json_array();
    for (int i = 0; i < r->n_errors; i++) {
        json_t *e = json_object();
        json_object_set_new(e, "count", json_integer(r->errors[i].count));
        json_object_set_new(e, "status", json_integer(r->errors[i].status));
        json_object_set_new(e, "message", json_string(r->errors[i].msg));
        json_array_append_new(errs, e);
    }
    json_object_set_new(j, "errors", errs);
    json_object_set_new(j, "config", t = json_object());
    json_object_set_new(t, "requests", json_integer(o->requests));
    json_object_set_new(t, "warmup", json_integer(o->warmup));
    json_object_set_new(t, "prompt_tokens", dist_json(&o->prompt_tokens));
    json_object_set_new(t, "output_tokens", dist_json(&o->output_tokens));
    json_object_set_new(t, "shared_prefix", json_integer(o->shared_prefix));
    json_object_set_new(t, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(t, "temperature", json_real(o->temperature));
    json_object_set_new(t, "ignore_eos", json_boolean(o->ignore_eos));
    json_object_set_new(t, "timeout_s", json_real(o->timeout_s));
    return j;
}
