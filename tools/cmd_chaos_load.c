/* `shoal chaos`'s load: the reference run and the bounded mixed load on `shoal bench`'s HTTP
 * engine (tools/bench_http.c), each answer checked against the undisturbed greedy text. */
#include <stdlib.h>
#include <string.h>

#include "tools/bench.h"
#include "tools/cmd_chaos.h"
#include "tools/cmd_util.h"

#define TICK_MS 10
#define TEXT_MAX (1 << 20)

typedef struct slot {
    struct run *r;
    sh__bench_conn *conn;
    sh__bench_xfer x;
    char *body;
    int64_t req; /* index into reqs (load) or the prompt (reference); -1 when idle */
    char *text;
    size_t len, cap;
    char finish[16];
    bool err_event;
    char errmsg[200];
} slot;

typedef struct run {
    sh__chaos_load *l;
    uv_loop_t loop;
    uv_timer_t tick;
    sh__bench_http_cfg cfg;
    sh__bench_url url;
    slot *slots;
    int32_t n_slots;
    bool ref;
    int64_t next, in_flight, cap_reqs;
    uint64_t t0_ns;
    bool oom, closing;
    char fail[300]; /* reference: the first failure */
} run;

static double now_s(const run *r) { return (double)(uv_hrtime() - r->t0_ns) / 1e9; }

static bool append(slot *s, const char *p, size_t n)
{
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        while (cap < s->len + n + 1)
            cap *= 2;
        if (cap > TEXT_MAX)
            return false;
        char *q = realloc(s->text, cap);
        if (!q)
            return false;
        s->text = q;
        s->cap = cap;
    }
    memcpy(s->text + s->len, p, n);
    s->len += n;
    s->text[s->len] = '\0';
    return true;
}

/* The text and finish_reason of choices[0] of a response or chunk; an "error" member sets
 * err_event. */
static void take_json(slot *s, json_t *j)
{
    json_t *err = json_object_get(j, "error");
    if (err) {
        const char *m = json_string_value(err);
        if (!m)
            m = json_string_value(json_object_get(err, "message"));
        s->err_event = true;
        snprintf(s->errmsg, sizeof s->errmsg, "%s", m ? m : "error without a message");
        return;
    }
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    const char *t = json_string_value(json_object_get(c, "text"));
    if (t && !append(s, t, strlen(t))) {
        s->err_event = true;
        snprintf(s->errmsg, sizeof s->errmsg, "response text too long");
    }
    const char *f = json_string_value(json_object_get(c, "finish_reason"));
    if (f)
        snprintf(s->finish, sizeof s->finish, "%s", f);
}

static bool on_event(sh__bench_xfer *x, const char *data, size_t len, uint64_t t_ns)
{
    (void)t_ns;
    slot *s = x->user;
    json_t *j = json_loadb(data, len, 0, NULL);
    if (j)
        take_json(s, j);
    json_decref(j);
    return true;
}

static void start_next(run *r, slot *s);

/* How a finished exchange of the load ended. */
static void classify(run *r, slot *s, sh__chaos_req *q)
{
    sh__bench_xfer *x = &s->x;
    q->t_end = now_s(r);
    q->status = x->status;
    const char *ref = r->l->reference[q->prompt];
    if (!x->sse && x->resp && x->status) {
        json_t *j = json_loadb(x->resp, x->resp_len, 0, NULL);
        if (j)
            take_json(s, j);
        json_decref(j);
    }
    if (s->err_event) {
        q->outcome = SH__CHAOS_ERROR;
        snprintf(q->err, sizeof q->err, "%d: %.180s", x->status, s->errmsg);
    } else if (x->failed) {
        q->outcome = SH__CHAOS_LOST;
        snprintf(q->err, sizeof q->err, "%.190s", x->err);
    } else if (x->status != 200) {
        q->outcome = SH__CHAOS_ERROR;
        snprintf(q->err, sizeof q->err, "HTTP %d: %.150s", x->status, x->resp ? x->resp : "");
    } else if (!s->finish[0]) {
        q->outcome = SH__CHAOS_LOST;
        snprintf(q->err, sizeof q->err, "the response ended without a finish_reason");
    } else if (strcmp(s->finish, "length") && strcmp(s->finish, "stop")) {
        q->outcome = SH__CHAOS_ERROR;
        snprintf(q->err, sizeof q->err, "finish_reason \"%s\"", s->finish);
    } else {
        sh__chaos_judge_text(q, s->text ? s->text : "", ref);
    }
}

void sh__chaos_judge_text(sh__chaos_req *q, const char *text, const char *ref)
{
    if (strcmp(text, ref)) {
        /* Shown from a little before the first difference, which may lie past the texts' start. */
        size_t at = 0;
        while (text[at] && text[at] == ref[at])
            at++;
        size_t from = at > 20 ? at - 20 : 0;
        q->outcome = SH__CHAOS_WRONG;
        snprintf(q->err, sizeof q->err,
                 "prompt %d differs at byte %zu: got \"%.60s\", want \"%.60s\"", (int)q->prompt, at,
                 text + from, ref + from);
    } else {
        q->outcome = SH__CHAOS_OK;
    }
}

static void on_done(sh__bench_xfer *x)
{
    slot *s = x->user;
    run *r = s->r;
    if (r->ref) {
        json_t *j = !x->failed && x->status == 200 && x->resp
                        ? json_loadb(x->resp, x->resp_len, 0, NULL)
                        : NULL;
        if (j)
            take_json(s, j);
        json_decref(j);
        if (!j || s->err_event || !s->finish[0]) {
            if (!r->fail[0])
                snprintf(r->fail, sizeof r->fail, "prompt %d: %.100s%.100s HTTP %d %.60s",
                         (int)s->req, x->failed ? x->err : "", s->errmsg, x->status,
                         x->resp ? x->resp : "");
        } else if (!(r->l->reference[s->req] = strdup(s->text ? s->text : ""))) {
            r->oom = true;
        }
    } else {
        classify(r, s, &r->l->reqs[s->req]);
    }
    r->in_flight--;
    start_next(r, s);
}

static char *body_of(const run *r, int32_t prompt, bool stream)
{
    const sh__chaos_opts *o = r->l->o;
    json_t *j = json_pack("{s:s, s:s, s:i, s:f, s:b, s:b}", "model", r->l->model, "prompt",
                          r->l->prompts[prompt], "max_tokens", (int)o->max_tokens, "temperature",
                          0.0, "ignore_eos", 1, "stream", stream);
    char *b = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return b;
}

static void finish_run(run *r)
{
    if (r->closing)
        return;
    r->closing = true;
    uv_timer_stop(&r->tick);
    uv_close((uv_handle_t *)&r->tick, NULL);
    for (int32_t i = 0; i < r->n_slots; i++) {
        sh__bench_http_conn_destroy(r->slots[i].conn);
        r->slots[i].conn = NULL;
    }
}

/* Starts the next request on s, or leaves s idle when the run is over. */
static void start_next(run *r, slot *s)
{
    const sh__chaos_opts *o = r->l->o;
    free(s->body);
    s->body = NULL;
    s->req = -1;
    s->len = 0;
    if (s->text)
        s->text[0] = '\0';
    s->finish[0] = '\0';
    s->err_event = false;
    s->errmsg[0] = '\0';
    bool more = r->ref ? r->next < o->prompts && !r->fail[0]
                       : r->next < o->requests || now_s(r) < r->l->load_end_s;
    if (!more || r->oom || r->closing) {
        if (r->in_flight == 0)
            finish_run(r);
        return;
    }
    int32_t prompt;
    bool stream = false;
    if (r->ref) {
        prompt = (int32_t)r->next;
        s->req = r->next++;
    } else {
        if (r->next == r->cap_reqs) {
            int64_t cap = r->cap_reqs * 2;
            sh__chaos_req *q = realloc(r->l->reqs, (size_t)cap * sizeof *q);
            if (!q) {
                r->oom = true;
                if (r->in_flight == 0)
                    finish_run(r);
                return;
            }
            r->l->reqs = q;
            r->cap_reqs = cap;
        }
        int64_t i = r->next++;
        prompt = (int32_t)(i % o->prompts);
        stream = i % 2 == 1;
        sh__chaos_req *q = &r->l->reqs[i];
        memset(q, 0, sizeof *q);
        q->index = i;
        q->prompt = prompt;
        q->stream = stream;
        q->t_start = now_s(r);
        r->l->n_reqs = r->next;
        s->req = i;
    }
    s->body = body_of(r, prompt, stream);
    if (!s->body) {
        r->oom = true;
        s->req = -1;
        if (r->in_flight == 0)
            finish_run(r);
        return;
    }
    s->x = (sh__bench_xfer){.method = "POST",
                            .path = "/v1/completions",
                            .body = s->body,
                            .body_len = strlen(s->body),
                            .stream = stream,
                            .on_event = on_event,
                            .on_done = on_done,
                            .user = s};
    r->in_flight++;
    sh__bench_http_start(s->conn, &s->x);
}

static void on_tick(uv_timer_t *t)
{
    run *r = t->data;
    if (r->l->tick)
        r->l->tick(r->l->ud, now_s(r));
    // The load may have reached its request count before its end time: idle slots start again.
    if (!r->ref && !r->closing)
        for (int32_t i = 0; i < r->n_slots; i++)
            if (r->slots[i].req < 0 && now_s(r) < r->l->load_end_s)
                start_next(r, &r->slots[i]);
}

static int go(sh__chaos_load *l, bool ref)
{
    const sh__chaos_opts *o = l->o;
    run *r = calloc(1, sizeof *r);
    if (!r)
        return (sh__cmd_fail("out of memory"), 1);
    r->l = l;
    r->ref = ref;
    char err[300];
    int rc = 0;
    if (!sh__bench_http_parse_url(l->url, &r->url, err, sizeof err) ||
        uv_loop_init(&r->loop) != 0) {
        free(r);
        return (sh__cmd_fail("%s: %s", l->url, err), 1);
    }
    if (!sh__bench_http_resolve(&r->loop, &r->url, &r->cfg.addr, err, sizeof err)) {
        rc = (sh__cmd_fail("%s", err), 1);
        goto out;
    }
    r->cfg.host_header = r->url.host_header;
    r->cfg.api_key = o->api_key;
    r->cfg.timeout_ms = (uint64_t)(o->timeout_s * 1000.0 + 0.5);
    r->n_slots = o->concurrency;
    r->slots = calloc((size_t)r->n_slots, sizeof *r->slots);
    r->cap_reqs = o->requests + 64;
    if (!ref && !(l->reqs = calloc((size_t)r->cap_reqs, sizeof *l->reqs)))
        r->oom = true;
    if (!r->slots || r->oom) {
        rc = (sh__cmd_fail("out of memory"), 1);
        goto out;
    }
    for (int32_t i = 0; i < r->n_slots; i++) {
        r->slots[i].r = r;
        r->slots[i].req = -1;
        if (!sh__bench_http_conn_create(&r->loop, &r->cfg, &r->slots[i].conn)) {
            rc = (sh__cmd_fail("out of memory"), 1);
            goto out;
        }
    }
    uv_timer_init(&r->loop, &r->tick);
    r->tick.data = r;
    uv_timer_start(&r->tick, on_tick, TICK_MS, TICK_MS);
    r->t0_ns = uv_hrtime();
    for (int32_t i = 0; i < r->n_slots; i++)
        start_next(r, &r->slots[i]);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    if (r->oom)
        rc = (sh__cmd_fail("out of memory"), 1);
    else if (ref && r->fail[0])
        rc = (sh__cmd_fail("the reference run (before any fault) failed: %s", r->fail), 1);
out:
    if (!r->closing) {
        for (int32_t i = 0; r->slots && i < r->n_slots; i++)
            sh__bench_http_conn_destroy(r->slots[i].conn);
        if (uv_is_active((uv_handle_t *)&r->tick) || r->tick.data)
            uv_close((uv_handle_t *)&r->tick, NULL);
    }
    uv_run(&r->loop, UV_RUN_DEFAULT);
    uv_loop_close(&r->loop);
    for (int32_t i = 0; r->slots && i < r->n_slots; i++) {
        free(r->slots[i].body);
        free(r->slots[i].text);
    }
    free(r->slots);
    free(r);
    return rc;
}

int sh__chaos_load_reference(sh__chaos_load *l)
{
    return l->eng ? sh__chaos_engine_load(l, true) : go(l, true);
}

int sh__chaos_load_run(sh__chaos_load *l)
{
    return l->eng ? sh__chaos_engine_load(l, false) : go(l, false);
}

typedef struct get_ctx {
    uv_loop_t *loop;
    char *body;
    int status;
} get_ctx;

static void on_get_done(sh__bench_xfer *x)
{
    get_ctx *g = x->user;
    g->status = x->failed ? 0 : x->status;
    if (!x->failed && x->resp)
        g->body = strndup(x->resp, x->resp_len);
    uv_stop(g->loop); /* the keep-alive connection would hold the loop */
}

char *sh__chaos_http_get(const char *url, const char *path, const char *api_key, int *status)
{
    *status = 0;
    sh__bench_url u;
    sh__bench_http_cfg cfg = {0};
    char err[300];
    uv_loop_t loop;
    if (!sh__bench_http_parse_url(url, &u, err, sizeof err) || uv_loop_init(&loop) != 0)
        return NULL;
    get_ctx g = {.loop = &loop};
    sh__bench_conn *c = NULL;
    if (sh__bench_http_resolve(&loop, &u, &cfg.addr, err, sizeof err)) {
        cfg.host_header = u.host_header;
        cfg.api_key = api_key;
        cfg.timeout_ms = 10000;
        if (sh__bench_http_conn_create(&loop, &cfg, &c)) {
            sh__bench_xfer x = {.method = "GET", .path = path, .on_done = on_get_done, .user = &g};
            sh__bench_http_start(c, &x);
            uv_run(&loop, UV_RUN_DEFAULT);
            sh__bench_http_conn_destroy(c);
        }
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    *status = g.status;
    return g.body;
}
