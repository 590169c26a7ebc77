/* `shoal bench`: a load generator for OpenAI-compatible servers (shoal serve, vLLM, llama.cpp's
 * llama-server): N concurrent streams of synthetic requests on one libuv loop, then a report. */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/error.h"
#include "tools/bench.h"
#include "tools/cmd.h"
#include "tools/cmd_util.h"

#define MAX_ERROR_KINDS 32
#define PROGRESS_TTY_MS 250
#define PROGRESS_LOG_MS 5000
#define RATE_WINDOW 8 /* progress ticks the live output rate is measured over on a terminal */

/* One concurrent stream: a connection and the request it is running. */
typedef struct slot {
    struct bench *b;
    sh__bench_conn *conn;
    sh__bench_xfer x;
    char *body;
    int64_t index; /* the request's index; -1 while idle */
    bool warmup;
    int64_t prompt_words;
    uint64_t t_first, t_prev; /* ns: first and latest token-bearing events; 0 before the first */
    int64_t n_events;         /* token-bearing events */
    int64_t n_words;          /* words of a whole response, its estimate without usage */
    bool has_usage;
    int64_t usage_prompt, usage_output;
    double *gaps; /* s, between successive token-bearing events */
    size_t n_gaps, cap_gaps;
} slot;

typedef struct bench {
    sh__bench_opts o;
    sh__bench_url url;
    sh__bench_http_cfg cfg;
    uv_loop_t loop;
    uv_timer_t tick;
    uv_signal_t sigint;
    char path[300], *model, *prefix;
    slot *slots;
    int64_t next, end, in_flight; /* next request index to start; end of the current phase */
    bool warmup_phase, stopping, interrupted, oom, tty;
    uint64_t t0, t_last; /* ns: start of the measured phase; its latest completion */
    sh__bench_result *results;
    int64_t n_results, warmup_done, warmup_failed, n_failed;
    double *itl;
    size_t n_itl, cap_itl;
    sh__bench_error errors[MAX_ERROR_KINDS];
    int n_errors;
    int64_t live_tokens; /* output tokens seen so far in the measured phase, for the progress */
    double ring_t[RATE_WINDOW + 1];
    int64_t ring_tok[RATE_WINDOW + 1];
    int ring_n;
} bench;

/* --- responses --- */

/* The message of an error body: OpenAI's {"error":{"message":...}}, {"error":"..."}, FastAPI's
 * {"detail":...}, or else the start of the body with control characters blanked. */
static void error_text(const char *body, size_t len, char *out, size_t cap)
{
    json_t *j = json_loadb(body, len, 0, NULL), *e = json_object_get(j, "error");
    const char *m = json_string_value(e);
    if (!m)
        m = json_string_value(json_object_get(e, "message"));
    if (!m)
        m = json_string_value(json_object_get(j, "detail"));
    if (!m)
        m = json_string_value(json_object_get(j, "message"));
    if (m) {
        snprintf(out, cap, "%s", m);
    } else {
        size_t n = len < cap - 1 ? len : cap - 1;
        for (size_t i = 0; i < n; i++)
            out[i] = (unsigned char)body[i] < 0x20 ? ' ' : body[i];
        out[n] = '\0';
        if (n == 0)
            snprintf(out, cap, "(empty body)");
    }
    json_decref(j);
}

/* The generated text of a choice: completions' text, chat's message or delta content
 * (reasoning models stream their thoughts as reasoning_content or reasoning). */
static const char *choice_text(json_t *c)
{
    const char *t = json_string_value(json_object_get(c, "text"));
    if (t && *t)
        return t;
    json_t *m = json_object_get(c, "delta");
    if (!m)
        m = json_object_get(c, "message");
    static const char *const keys[] = {"content", "reasoning_content", "reasoning"};
    for (int k = 0; k < 3; k++) {
        t = json_string_value(json_object_get(m, keys[k]));
        if (t && *t)
            return t;
    }
    return NULL;
}

static void read_usage(slot *s, json_t *j)
{
    json_t *u = json_object_get(j, "usage");
    json_t *ct = json_object_get(u, "completion_tokens");
    if (!json_is_integer(ct))
        return;
    s->has_usage = true;
    s->usage_output = json_integer_value(ct);
    json_t *pt = json_object_get(u, "prompt_tokens");
    s->usage_prompt = json_is_integer(pt) ? json_integer_value(pt) : -1;
}

static bool on_event(sh__bench_xfer *x, const char *data, size_t len, uint64_t t)
{
    slot *s = x->user;
    json_t *j = json_loadb(data, len, 0, NULL);
    if (!json_is_object(j)) {
        snprintf(x->err, sizeof x->err, "bad event (not a JSON object): %.80s", data);
        json_decref(j);
        return false;
    }
    json_t *e = json_object_get(j, "error");
    if (e && !json_is_null(e)) {
        char *dump = json_dumps(j, JSON_COMPACT);
        char msg[200];
        error_text(dump ? dump : "", dump ? strlen(dump) : 0, msg, sizeof msg);
        snprintf(x->err, sizeof x->err, "error in stream: %s", msg);
        free(dump);
        json_decref(j);
        return false;
    }
    bool token = false;
    json_t *ch = json_object_get(j, "choices");
    for (size_t i = 0; i < json_array_size(ch) && !token; i++)
        token = choice_text(json_array_get(ch, i)) != NULL;
    read_usage(s, j);
    json_decref(j);
    if (!token)
        return true;
    if (s->t_first) {
        if (s->n_gaps == s->cap_gaps) {
            size_t cap = s->cap_gaps ? s->cap_gaps * 2 : 256;
            double *g = realloc(s->gaps, cap * sizeof *g);
            if (g) {
                s->gaps = g;
                s->cap_gaps = cap;
            }
        }
        if (s->n_gaps < s->cap_gaps)
            s->gaps[s->n_gaps++] = (double)(t - s->t_prev) * 1e-9;
    } else {
        s->t_first = t;
    }
    s->t_prev = t;
    s->n_events++;
    if (!s->warmup)
        s->b->live_tokens++;
    return true;
}

/* A whole (not streamed) 2xx response: its usage, or else its words as the estimate. */
static bool read_whole(slot *s, const sh__bench_xfer *x, char *msg, size_t cap)
{
    json_t *j = json_loadb(x->resp, x->resp_len, 0, NULL);
    if (!json_is_object(j)) {
        snprintf(msg, cap, "response is not a JSON object: %.80s", x->resp);
        json_decref(j);
        return false;
    }
    json_t *e = json_object_get(j, "error");
    if (e && !json_is_null(e)) {
        error_text(x->resp, x->resp_len, msg, cap);
        json_decref(j);
        return false;
    }
    read_usage(s, j);
    if (!s->has_usage) {
        json_t *ch = json_object_get(j, "choices");
        for (size_t i = 0; i < json_array_size(ch); i++) {
            const char *t = choice_text(json_array_get(ch, i));
            for (bool in_word = false; t && *t; t++) {
                bool space = *t == ' ' || *t == '\n' || *t == '\t';
                s->n_words += !space && !in_word;
                in_word = !space;
            }
        }
    }
    json_decref(j);
    return true;
}

/* --- scheduling --- */

static void add_error(bench *b, int status, const char *msg)
{
    int k = 0;
    while (k < b->n_errors && strcmp(b->errors[k].msg, msg) != 0)
        k++;
    if (k == b->n_errors) {
        if (k == MAX_ERROR_KINDS) { // the last kind collects whatever does not fit
            k--;
            snprintf(b->errors[k].msg, sizeof b->errors[k].msg, "(other errors)");
            b->errors[k].status = 0;
        } else {
            b->n_errors++;
            snprintf(b->errors[k].msg, sizeof b->errors[k].msg, "%s", msg);
            b->errors[k].status = status;
            b->errors[k].count = 0;
        }
    }
    b->errors[k].count++;
}

static void record(bench *b, slot *s, const sh__bench_result *q, const char *msg)
{
    if (s->warmup) {
        b->warmup_done++;
        b->warmup_failed += !q->ok;
        return;
    }
    b->results[b->n_results++] = *q;
    b->t_last = uv_hrtime();
    if (!q->ok) {
        b->n_failed++;
        add_error(b, q->status, msg);
        return;
    }
    b->live_tokens += q->output_tokens - s->n_events;
    if (b->n_itl + s->n_gaps > b->cap_itl) {
        size_t cap = b->cap_itl ? b->cap_itl : 4096;
        while (cap < b->n_itl + s->n_gaps)
            cap *= 2;
        double *p = realloc(b->itl, cap * sizeof *p);
        if (!p)
            return; // the gaps of this request are left out
        b->itl = p;
        b->cap_itl = cap;
    }
    if (s->n_gaps)
        memcpy(b->itl + b->n_itl, s->gaps, s->n_gaps * sizeof *s->gaps);
    b->n_itl += s->n_gaps;
}

static void next(slot *s);

static void on_request_done(sh__bench_xfer *x)
{
    slot *s = x->user;
    bench *b = s->b;
    sh__bench_result q = {.status = x->status};
    char msg[256] = "";
    q.latency_s = (double)(x->t_end - x->t_start) * 1e-9;
    if (x->failed) {
        snprintf(msg, sizeof msg, "%s", x->err);
    } else if (x->status / 100 != 2) {
        char text[160];
        error_text(x->resp, x->resp_len, text, sizeof text);
        snprintf(msg, sizeof msg, "HTTP %d: %s", x->status, text);
    } else if (x->sse || read_whole(s, x, msg, sizeof msg)) {
        q.ok = true;
        q.ttft_s = s->t_first ? (double)(s->t_first - x->t_start) * 1e-9 : q.latency_s;
        q.usage = s->has_usage;
        q.output_tokens = s->has_usage ? s->usage_output : x->sse ? s->n_events : s->n_words;
        q.prompt_tokens = s->has_usage && s->usage_prompt >= 0 ? s->usage_prompt : s->prompt_words;
    }
    if (!q.ok && !msg[0])
        snprintf(msg, sizeof msg, "request failed");
    b->in_flight--;
    record(b, s, &q, msg);
    free(s->body);
    s->body = NULL;
    s->index = -1;
    next(s);
}

static void start_phase(bench *b, bool warmup)
{
    b->warmup_phase = warmup;
    b->next = warmup ? 0 : b->o.warmup;
    b->end = warmup ? b->o.warmup : b->o.warmup + b->o.requests;
    b->t0 = b->t_last = uv_hrtime();
    b->ring_n = 0;
    for (int32_t i = 0; i < b->o.concurrency; i++)
        if (b->slots[i].index < 0)
            next(&b->slots[i]);
}

/* Starts the next request on s, or ends the phase once nothing is left or in flight. */
static void next(slot *s)
{
    bench *b = s->b;
    if (b->stopping)
        return;
    if (b->next >= b->end) {
        if (b->in_flight > 0)
            return;
        if (b->warmup_phase) {
            start_phase(b, false);
        } else {
            b->stopping = true;
            uv_stop(&b->loop);
        }
        return;
    }
    int64_t i = b->next++;
    s->index = i;
    s->warmup = b->warmup_phase;
    s->t_first = s->t_prev = 0;
    s->n_events = s->n_words = 0;
    s->n_gaps = 0;
    s->has_usage = false;
    s->body = sh__bench_prompt_body(&b->o, b->model, b->prefix, i, &s->prompt_words);
    if (!s->body) {
        b->oom = b->stopping = true;
        uv_stop(&b->loop);
        return;
    }
    s->x = (sh__bench_xfer){
        .method = "POST",
        .path = b->path,
        .body = s->body,
        .body_len = strlen(s->body),
        .stream = b->o.stream,
        .on_event = on_event,
        .on_done = on_request_done,
        .user = s,
    };
    b->in_flight++;
    sh__bench_http_start(s->conn, &s->x);
}

/* --- progress --- */

static void on_tick(uv_timer_t *t)
{
    bench *b = t->data;
    double now = (double)(uv_hrtime() - b->t0) * 1e-9;
    if (b->ring_n == RATE_WINDOW + 1) {
        memmove(b->ring_t, b->ring_t + 1, RATE_WINDOW * sizeof *b->ring_t);
        memmove(b->ring_tok, b->ring_tok + 1, RATE_WINDOW * sizeof *b->ring_tok);
        b->ring_n--;
    }
    b->ring_t[b->ring_n] = now;
    b->ring_tok[b->ring_n++] = b->live_tokens;
    int back = b->tty ? b->ring_n - 1 : (b->ring_n > 1 ? 1 : 0);
    int k = b->ring_n - 1 - back; // the sample the rate is measured from
    double dt = now - (k >= 0 && back > 0 ? b->ring_t[k] : 0);
    double rate = dt > 0 ? (double)(b->live_tokens - (back > 0 ? b->ring_tok[k] : 0)) / dt : 0;
    int64_t done = b->warmup_phase ? b->warmup_done : b->n_results;
    int64_t total = b->warmup_phase ? b->o.warmup : b->o.requests;
    const char *phase = b->warmup_phase ? "warmup " : "";
    if (b->tty) {
        char bar[31];
        int fill = (int)(30 * done / (total ? total : 1));
        for (int i = 0; i < 30; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[30] = '\0';
        fprintf(stderr, "\r\033[K%s%" PRId64 "/%" PRId64 " [%s] %.1f s", phase, done, total, bar,
                now);
        if (!b->warmup_phase)
            fprintf(stderr, "  %.1f tok/s", rate);
        if (!b->warmup_phase && b->n_failed)
            fprintf(stderr, "  %" PRId64 " failed", b->n_failed);
    } else {
        fprintf(stderr, "bench: %s%" PRId64 "/%" PRId64 " requests, %.1f s", phase, done, total,
                now);
        if (!b->warmup_phase)
            fprintf(stderr, ", %.1f output tok/s, %" PRId64 " failed", rate, b->n_failed);
        fputc('\n', stderr);
    }
    fflush(stderr);
}

static void on_sigint(uv_signal_t *h, int signum)
{
    bench *b = h->data;
    uv_signal_stop(h); // a second ^C ends the process at once
    b->interrupted = b->stopping = true;
    b->t_last = uv_hrtime();
    uv_stop(&b->loop);
}

/* --- model discovery --- */

static void on_models_done(sh__bench_xfer *x) { uv_stop(&((bench *)x->user)->loop); }

/* Asks GET /v1/models for the first model id. Returns 0, or 1 with an error printed. */
static int discover_model(bench *b)
{
    sh__bench_conn *c;
    char path[300];
    snprintf(path, sizeof path, "%s/v1/models", b->url.base);
    if (!sh__bench_http_conn_create(&b->loop, &b->cfg, &c))
        return (sh__cmd_fail("out of memory"), 1);
    sh__bench_xfer x = {.method = "GET", .path = path, .on_done = on_models_done, .user = b};
    sh__bench_http_start(c, &x);
    uv_run(&b->loop, UV_RUN_DEFAULT);
    int rc = 1;
    char text[160];
    if (x.failed) {
        sh__cmd_fail("cannot list the models at %s: %s (give --model)", b->o.url, x.err);
    } else if (x.status != 200) {
        error_text(x.resp, x.resp_len, text, sizeof text);
        sh__cmd_fail("GET %s: HTTP %d: %s (give --model)", path, x.status, text);
    } else {
        json_t *j = json_loadb(x.resp, x.resp_len, 0, NULL);
        const char *id =
            json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        if (id && *id) {
            b->model = strdup(id);
            rc = b->model ? 0 : (sh__cmd_fail("out of memory"), 1);
        } else {
            sh__cmd_fail("GET %s: no model id in the response (give --model)", path);
        }
        json_decref(j);
    }
    sh__bench_http_conn_destroy(c);
    return rc;
}

/* --- the command --- */

static void on_close_noop(uv_handle_t *h) { (void)h; }

/* Sorts the error kinds most frequent first (stable: earlier kinds first among equals). */
static void sort_errors(bench *b)
{
    for (int i = 1; i < b->n_errors; i++) {
        sh__bench_error e = b->errors[i];
        int k = i;
        for (; k > 0 && b->errors[k - 1].count < e.count; k--)
            b->errors[k] = b->errors[k - 1];
        b->errors[k] = e;
    }
}

static int report(bench *b)
{
    sort_errors(b);
    sh__bench_run r = {
        .o = &b->o,
        .model = b->model,
        .results = b->results,
        .n_results = b->n_results,
        .itl_s = b->itl,
        .n_itl = b->n_itl,
        .duration_s = (double)(b->t_last - b->t0) * 1e-9,
        .errors = b->errors,
        .n_errors = b->n_errors,
        .interrupted = b->interrupted,
    };
    bool json_stdout = b->o.json_path && !strcmp(b->o.json_path, "-");
    sh__bench_report_text(json_stdout ? stderr : stdout, &r);
    if (b->warmup_failed)
        fprintf(stderr, "note: %" PRId64 " of %" PRId64 " warmup requests failed\n",
                b->warmup_failed, b->o.warmup);
    if (b->o.json_path) {
        json_t *j = sh__bench_report_json(&r);
        int rc = !j ? -1
                 : json_stdout
                     ? json_dumpf(j, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(10))
                     : json_dump_file(j, b->o.json_path, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
        if (json_stdout)
            fputc('\n', stdout);
        json_decref(j);
        if (rc != 0) {
            sh__cmd_fail("cannot write the JSON report to %s", b->o.json_path);
            return 1;
        }
    }
    if (b->interrupted)
        return 130;
    return b->n_results - b->n_failed > 0 ? 0 : 1;
}

static int run(bench *b)
{
    char err[300];
    if (!sh__bench_http_resolve(&b->loop, &b->url, &b->cfg.addr, err, sizeof err))
        return (sh__cmd_fail("%s", err), 1);
    b->cfg.host_header = b->url.host_header;
    b->cfg.api_key = b->o.api_key;
    b->cfg.timeout_ms = (uint64_t)(b->o.timeout_s * 1000.0 + 0.5);
    if (!b->o.model && discover_model(b))
        return 1;
    if (b->o.model && !(b->model = strdup(b->o.model)))
        return (sh__cmd_fail("out of memory"), 1);
    snprintf(b->path, sizeof b->path, "%s%s", b->url.base,
             b->o.chat ? "/v1/chat/completions" : "/v1/completions");
    if (b->o.shared_prefix > 0) {
        uint64_t s = b->o.seed ^ 0x5eedull;
        if (!(b->prefix = sh__bench_prompt_words(b->o.shared_prefix, &s)))
            return (sh__cmd_fail("out of memory"), 1);
    }
    b->results = calloc((size_t)b->o.requests, sizeof *b->results);
    b->slots = calloc((size_t)b->o.concurrency, sizeof *b->slots);
    if (!b->results || !b->slots)
        return (sh__cmd_fail("out of memory"), 1);
    for (int32_t i = 0; i < b->o.concurrency; i++) {
        b->slots[i].b = b;
        b->slots[i].index = -1;
        if (!sh__bench_http_conn_create(&b->loop, &b->cfg, &b->slots[i].conn))
            return (sh__cmd_fail("out of memory"), 1);
    }
    b->tty = isatty(2);
    if (!b->o.quiet) {
        uv_timer_start(&b->tick, on_tick, b->tty ? PROGRESS_TTY_MS : PROGRESS_LOG_MS,
                       b->tty ? PROGRESS_TTY_MS : PROGRESS_LOG_MS);
        uv_unref((uv_handle_t *)&b->tick);
    }
    uv_signal_start(&b->sigint, on_sigint, SIGINT);
    uv_unref((uv_handle_t *)&b->sigint);
    if (!b->o.quiet)
        fprintf(stderr, "shoal bench: %s, model %s, %" PRId64 " requests, concurrency %d\n",
                b->o.url, b->model, b->o.requests, (int)b->o.concurrency);
    start_phase(b, b->o.warmup > 0);
    uv_run(&b->loop, UV_RUN_DEFAULT);
    uv_timer_stop(&b->tick);
    uv_signal_stop(&b->sigint);
    if (!b->o.quiet && b->tty)
        fprintf(stderr, "\r\033[K");
    if (b->oom)
        return (sh__cmd_fail("out of memory"), 1);
    return report(b);
}

int sh__cmd_bench(int argc, char **argv)
{
    static bench b; // large and single: one run per process
    memset(&b, 0, sizeof b);
    int rc = sh__bench_opts_parse(argc, argv, &b.o);
    if (rc)
        return rc == 1 ? 0 : 2;
    char err[300];
    if (!sh__bench_http_parse_url(b.o.url, &b.url, err, sizeof err))
        return sh__cmd_fail("%s", err);
    // A peer that closes its end must show up as a write error, not kill the process.
    signal(SIGPIPE, SIG_IGN);
    if (uv_loop_init(&b.loop) != 0)
        return (sh__cmd_fail("cannot start the event loop"), 1);
    uv_timer_init(&b.loop, &b.tick);
    b.tick.data = &b;
    uv_signal_init(&b.loop, &b.sigint);
    b.sigint.data = &b;
    rc = run(&b);
    // Teardown: close every handle, let the loop run their close callbacks, then free.
    for (int32_t i = 0; b.slots && i < b.o.concurrency; i++)
        sh__bench_http_conn_destroy(b.slots[i].conn);
    uv_close((uv_handle_t *)&b.tick, on_close_noop);
    uv_close((uv_handle_t *)&b.sigint, on_close_noop);
    uv_run(&b.loop, UV_RUN_DEFAULT);
    uv_loop_close(&b.loop);
    for (int32_t i = 0; b.slots && i < b.o.concurrency; i++) {
        free(b.slots[i].body);
        free(b.slots[i].gaps);
    }
    free(b.slots);
    free(b.results);
    free(b.itl);
    free(b.model);
    free(b.prefix);
    return rc;
}
