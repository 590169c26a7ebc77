/* The gateway: the OpenAI-compatible HTTP API in front of a replica's batcher.
 *
 * It runs the HTTP/1.1 server of net/http.h on its own loop (so every HTTP callback runs on
 * the gateway's thread, beside its vtable members), validates and tokenizes each request, sends
 * one SUBMIT to the batcher, and turns the TOKEN / DONE / FAIL messages that come back into
 * server-sent events or a single JSON response. It keeps each request until it is finished, and
 * tells the batcher (CANCEL) when a client goes away.
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (as chat, answered
 * by gateway_resp.c), POST /v1/embeddings, GET /v1/models
 * (each also without /v1, as llama-server answers them), POST /tokenize, POST /detokenize, GET
 * /health, GET /metrics, GET /admin/cluster, GET /admin/status and the status page GET /admin/
 * (when the process gave providers). Errors are OpenAI-shaped JSON (net/openai.h).
 *
 * CORS, fingerprints, /v1/models and /tokenize are in gateway_api.c, tokenization off the loop
 * in gateway_tok.c, drain and key reloads in gateway_ctl.c; what
 * the three files share is in gateway_int.h.
 *
 * Thread: every member and every HTTP callback runs on the gateway's loop thread. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "actors/degrade.h"
#include "actors/gateway_int.h"
#include "base/error.h"
#include "base/file.h"
#include "model/grammar.h"
#include "model/sampler.h"
#include "net/admin_page.h"
#include "net/openai_responses.h"
#include "runtime/actor_uv.h"

#define MAX_PIECE 256

typedef struct gw_top {
    int32_t id;
    float lp;
} gw_top;

/* One generated token's logprob record (non-streamed responses keep them until the end). */
typedef struct gw_lp {
    int32_t id;
    float lp;
    int32_t text_offset;
    int32_t n_top;
    gw_top top[SH_SAMPLER_MAX_LOGPROBS];
} gw_lp;

struct gw_choice {
    char *text; /* the generated text so far (non-streamed) */
    size_t len, cap;
    gw_lp *lps;
    int32_t n_lps, cap_lps;
    int32_t n_gen;
    bool started, done;
    sh_openai_finish finish;
    sh_openai_toolstream ts; /* a streamed tools request: its calls so far */
};

/* ---- small helpers ------------------------------------------------------------------------ */

static void respond_json(sh_http_req *req, int status, char *body)
{
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":null}}";
        sh_http_respond(req, 500, "application/json", oom, sizeof oom - 1);
        return;
    }
    sh_http_respond(req, status, "application/json", body, strlen(body));
    free(body);
}

static void respond_error(gateway *g, sh_http_req *req, const sh_openai_error *err)
{
    sh_counter_add(g->m_http_errors, 1);
    respond_json(req, err->status, sh_openai_error_json(err));
}

void sh__gateway_respond_errorf(gateway *g, sh_http_req *req, int status, const char *code,
                                const char *param, const char *fmt, ...)
{
    sh_openai_error err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sh_openai_error_set(&err, status, code, param, "%s", msg);
    respond_error(g, req, &err);
}

static int append(char **p, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        char *q = realloc(*p, c);
        if (!q)
            return -1;
        *p = q;
        *cap = c;
    }
    memcpy(*p + *len, s, n);
    *len += n;
    (*p)[*len] = '\0';
    return 0;
}

/* The text of a token for logprobs (special tokens by their vocabulary text). */
static const char *piece_text(const gw_req *r, int32_t id, char *buf)
{
    const char *p = NULL;
    size_t n = sh_tokenizer_piece(r->m->tok, id, SH_DECODE_SPECIAL, &p);
    if (n >= MAX_PIECE)
        n = MAX_PIECE - 1;
    if (n)
        memcpy(buf, p, n);
    buf[n] = '\0';
    return buf;
}

static void req_unlink(gateway *g, gw_req *r)
{
    for (gw_req **pp = &g->reqs; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

void sh__gateway_req_free(gw_req *r)
{
    if (!r)
        return;
    for (int32_t i = 0; r->choices && i < r->n_choices; i++) {
        free(r->choices[i].text);
        free(r->choices[i].lps);
        sh_openai_toolstream_fini(&r->choices[i].ts);
    }
    free(r->choices);
    free(r->echo_text);
    sh__gateway_resp_free(r->resp);
    free(r);
}

static gw_req *find_req(gateway *g, uint64_t id)
{
    for (gw_req *r = g->reqs; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

static sh_openai_meta meta_of(const gw_req *r)
{
    return (sh_openai_meta){.kind = r->kind,
                            .id = r->id_str,
                            .created = r->created,
                            .model = r->m->name,
                            .fingerprint = r->g->fp[r->m - r->g->m]};
}

const sh_gateway_model *sh__gateway_model(const gateway *g, const char *name)
{
    for (int32_t i = 0; name && i < g->n_m; i++)
        if (!strcmp(g->m[i].name, name))
            return &g->m[i];
    return &g->m[0];
}

/* ---- simple endpoints --------------------------------------------------------------------- */

static void serve_metrics(gateway *g, sh_http_req *req)
{
    sh_metrics *mx = sh_runtime_metrics(sh_actor_runtime(g->ctx));
    size_t len = 0;
    for (;;) {
        sh_err rc = SH_ERANGE;
        if (g->metrics_cap && g->a.metrics_render)
            rc = g->a.metrics_render(g->a.metrics_user, mx, g->metrics_buf, g->metrics_cap, &len);
        else if (g->metrics_cap)
            rc = sh_metrics_render(mx, g->metrics_buf, g->metrics_cap, &len);
        if (rc == SH_OK)
            break;
        if (rc != SH_ERANGE) {
            sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "cannot render the metrics: %s",
                                       sh_strerror(rc));
            return;
        }
        size_t cap = (len + 4096) * 2;
        char *p = realloc(g->metrics_buf, cap);
        if (!p) {
            sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
            return;
        }
        g->metrics_buf = p;
        g->metrics_cap = cap;
    }
    // Ratios the registry's integer gauges cannot hold, derived from the kvmgr's figures.
    double total = g->kv_total ? (double)sh_gauge_value(g->kv_total) : 0;
    double used = g->kv_used ? (double)sh_gauge_value(g->kv_used) : 0;
    double q = g->pc_query ? (double)sh_counter_value(g->pc_query) : 0;
    double hit = g->pc_hit ? (double)sh_counter_value(g->pc_hit) : 0;
    sh_http_stats hs;
    sh_http_server_stats(g->srv, &hs);
    char extra[2048];
    int n = snprintf(extra, sizeof extra,
                     "# HELP shoal_kv_usage_ratio Fraction of KV blocks in use (0..1).\n"
                     "# TYPE shoal_kv_usage_ratio gauge\n"
                     "shoal_kv_usage_ratio %.6f\n"
                     "# HELP shoal_prefix_cache_hit_ratio Prompt tokens found in the prefix "
                     "cache / prompt tokens looked up.\n"
                     "# TYPE shoal_prefix_cache_hit_ratio gauge\n"
                     "shoal_prefix_cache_hit_ratio %.6f\n"
                     "# HELP shoal_http_connections Open HTTP connections.\n"
                     "# TYPE shoal_http_connections gauge\n"
                     "shoal_http_connections %u\n"
                     "# HELP shoal_http_connections_shed_total Idle HTTP connections closed to "
                     "make room for new ones.\n"
                     "# TYPE shoal_http_connections_shed_total counter\n"
                     "shoal_http_connections_shed_total %llu\n"
                     "# HELP shoal_http_connections_rejected_total New HTTP connections turned "
                     "away at a limit.\n"
                     "# TYPE shoal_http_connections_rejected_total counter\n"
                     "shoal_http_connections_rejected_total %llu\n"
                     "# HELP shoal_http_accept_errors_total Accepts that found file descriptors "
                     "short (EMFILE, or a descriptor inside the reserve).\n"
                     "# TYPE shoal_http_accept_errors_total counter\n"
                     "shoal_http_accept_errors_total %llu\n",
                     total > 0 ? used / total : 0.0, q > 0 ? hit / q : 0.0,
                     sh_http_server_conns(g->srv), (unsigned long long)hs.shed,
                     (unsigned long long)hs.rejected,
                     (unsigned long long)(hs.accept_errors + hs.fd_short));
    char *body = malloc(len + (size_t)n + 1);
    if (!body) {
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    memcpy(body, g->metrics_buf, len);
    memcpy(body + len, extra, (size_t)n);
    sh_http_respond(req, 200, "text/plain; version=0.0.4", body, len + (size_t)n);
    free(body);
}

/* ---- completions -------------------------------------------------------------------------- */

static void on_abort(sh_http_req *http, void *arg);

/* The degradation level in force applied to a parsed request (actors/degrade.h): q is changed
 * in place and the response says so in X-Shoal-Degraded. Returns false when the request was shed
 * and answered here (503 with Retry-After; q freed). */
static bool degrade(gateway *g, sh_http_req *http, sh_openai_request *q, int32_t key_prio)
{
    const char *fb = sh__degrade_fallback(g->a.degrade), *fb_name = NULL;
    for (int32_t i = 0; fb && i < g->n_m; i++)
        if (!strcmp(g->m[i].name, fb))
            fb_name = g->m[i].name; /* lives as long as the gateway, unlike q's strings */
    sh_degrade_effect ef;
    sh__degrade_apply(g->a.degrade, q, key_prio, fb_name, &ef);
    if (ef.header[0])
        sh_http_req_add_header(http, "X-Shoal-Degraded", ef.header);
    if (!(ef.what & SH_DEGRADE_SHED))
        return true;
    char ra[16];
    snprintf(ra, sizeof ra, "%u", (unsigned)ef.retry_after_s);
    sh_http_req_add_header(http, "Retry-After", ra);
    sh_openai_request_free(q);
    sh__gateway_respond_errorf(g, http, 503, "overloaded", NULL,
                               "the server is overloaded (degradation level %d): requests of "
                               "priority %d and above are turned away, this one has %d; retry "
                               "after %u s",
                               (int)ef.level, (int)ef.shed_priority, (int)ef.priority,
                               (unsigned)ef.retry_after_s);
    return false;
}

/* POST /admin/policy/reload: the policy script read again; a broken one keeps the old (422 with
 * its error). When keys are set it needs an admin key (403 for any other valid key). */
static void policy_reload(gateway *g, sh_http_req *req)
{
    sh_openai_error err;
    if (sh_openai_auth_admin(g->keys, g->n_keys, sh_http_req_header(req, "Authorization"), &err)) {
        respond_error(g, req, &err);
        return;
    }
    if (!g->a.degrade) {
        sh__gateway_respond_errorf(g, req, 409, "no_policy", NULL,
                                   "no degradation policy is in force (shoal serve --policy, or "
                                   "watchdog = { policy = ... } in the cluster script)");
        return;
    }
    char msg[512];
    if (sh__degrade_reload(g->a.degrade, msg, sizeof msg)) {
        sh__gateway_respond_errorf(g, req, 422, "policy_error", NULL, "%s", msg);
        return;
    }
    json_t *o = json_pack("{s:s, s:s, s:i, s:s}", "status", "reloaded", "policy",
                          sh__degrade_policy(g->a.degrade), "level",
                          (int)sh__degrade_level(g->a.degrade), "message", msg);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    respond_json(req, 200, body);
}

/* POST /v1/completions, /v1/chat/completions, and /v1/responses (responses: parsed as the chat
 * request it amounts to, answered in its own shape by gateway_resp.c). */
static void handle_generate(gateway *g, sh_http_req *http, sh_openai_kind kind, bool responses,
                            int32_t key_prio)
{
    size_t blen = 0;
    const char *body = sh_http_req_body(http, &blen);
    // With several models, a token-id prompt is checked against the vocabulary and context of
    // the one asked for: its name is read first (a name served by none is the parser's 404).
    const sh_gateway_model *m = &g->m[0];
    if (g->n_m > 1) {
        json_t *root = json_loadb(body, blen, 0, NULL);
        json_t *name = json_is_object(root) ? json_object_get(root, "model") : NULL;
        if (json_is_string(name))
            m = sh__gateway_model(g, json_string_value(name));
        json_decref(root);
    }
    sh_openai_limits lim = {.models = g->models,
                            .n_models = g->n_m,
                            .max_tokens = g->a.max_tokens,
                            .max_n = g->a.max_n,
                            .n_vocab = m->n_vocab,
                            .max_prompt_tokens = m->n_ctx,
                            .defaults = m->sampling};
    sh_openai_request *q = NULL;
    sh_openai_error err;
    if (responses ? sh_openai_responses_parse(body, blen, &lim, &q, &err)
                  : sh_openai_request_parse(kind, body, blen, &lim, &q, &err)) {
        respond_error(g, http, &err);
        return;
    }
    // The grammar is parsed here (bounded work: model/grammar.h) so that a bad one is a 400 with
    // its line and column before anything is queued; the sampling stage parses it again.
    if (q->grammar) {
        sh_grammar *gr = NULL;
        sh_error ge = {0};
        sh_err rc = sh_grammar_parse(q->grammar, strlen(q->grammar), &gr, &ge);
        sh_grammar_free(gr);
        if (rc) {
            const char *param = q->grammar_param;
            sh_openai_request_free(q);
            if (rc == SH_ENOMEM)
                sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
            else
                sh__gateway_respond_errorf(g, http, 400, NULL, param, "%s", ge.msg);
            return;
        }
    }
    if (g->a.degrade && !degrade(g, http, q, key_prio))
        return;
    if (kind == SH_OPENAI_COMPLETION && !q->prompt) { // token ids: nothing to tokenize
        int32_t *ids = malloc(((size_t)q->n_prompt_tokens + 1) * sizeof *ids);
        if (!ids) {
            sh_openai_request_free(q);
            sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
            return;
        }
        memcpy(ids, q->prompt_tokens, (size_t)q->n_prompt_tokens * sizeof *ids);
        sh__gateway_submit(g, http, q, ids, (size_t)q->n_prompt_tokens, key_prio);
        return;
    }
    sh__gateway_tok_queue(g, http, q, key_prio);
}

/* A request with its prompt ids goes to the batcher. Takes q and ids (malloc'd). */
void sh__gateway_submit(gateway *g, sh_http_req *http, sh_openai_request *q, int32_t *ids,
                        size_t n_ids, int32_t key_prio)
{
    sh_openai_kind kind = q->kind;
    const char *prompt_param = q->resp_echo             ? "input"
                               : kind == SH_OPENAI_CHAT ? "messages"
                                                        : "prompt";
    const sh_gateway_model *m = sh__gateway_model(g, q->model);
    if (n_ids == 0) {
        free(ids);
        sh_openai_request_free(q);
        sh__gateway_respond_errorf(g, http, 400, NULL, "prompt", "the prompt is empty");
        return;
    }
    if ((int64_t)n_ids >= m->n_ctx) {
        free(ids);
        sh_openai_request_free(q);
        sh__gateway_respond_errorf(
            g, http, 400, "context_length_exceeded", prompt_param,
            "This model's maximum context length is %d tokens. However, your prompt "
            "has %zu tokens; it must leave room for at least one generated token.",
            (int)m->n_ctx, n_ids);
        return;
    }
    gw_req *r = calloc(1, sizeof *r);
    if (r)
        r->choices = calloc((size_t)q->n, sizeof *r->choices);
    if (!r || !r->choices) {
        free(r);
        free(ids);
        sh_openai_request_free(q);
        sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
        return;
    }
    r->g = g;
    r->m = m;
    r->id = ++g->next_id;
    r->http = http;
    r->kind = kind;
    r->stream = q->stream;
    r->include_usage = q->include_usage;
    r->logprobs = q->logprobs;
    r->top_n = q->top_logprobs;
    r->n_choices = q->n;
    r->n_prompt = (int32_t)n_ids;
    r->created = (int64_t)time(NULL);
    r->t0_us = sh__act_mono_us();
    snprintf(r->id_str, sizeof r->id_str, "%s%" PRIx64 "%06" PRIx64,
             q->resp_echo             ? "resp_"
             : kind == SH_OPENAI_CHAT ? "chatcmpl-"
                                      : "cmpl-",
             (uint64_t)r->created, r->id);
    if (q->resp_echo && sh__gateway_resp_create(r, q->resp_echo)) {
        sh__gateway_req_free(r);
        free(ids);
        sh_openai_request_free(q);
        sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
        return;
    }
    if (q->echo && q->prompt)
        r->echo_text = strdup(q->prompt);
    r->echo = r->echo_text != NULL;
    r->tools = kind == SH_OPENAI_CHAT && sh_openai_tools_active(q);
    r->tool_style = sh__serve_tool_style(m->chat);
    for (int32_t i = 0; r->tools && i < r->n_choices; i++)
        sh_openai_toolstream_init(&r->choices[i].ts, r->tool_style,
                                  r->id * 0x9E3779B97F4A7C15ull ^ (uint64_t)r->created ^
                                      ((uint64_t)i << 48));

    // Generation never runs past the context window: max_tokens is clamped to what is left.
    int32_t max_tokens = q->max_tokens;
    if ((int64_t)n_ids + max_tokens > m->n_ctx)
        max_tokens = m->n_ctx - (int32_t)n_ids;
    sh_proto_logit_bias bias[SH_OPENAI_MAX_BIAS];
    for (int32_t i = 0; i < q->n_bias; i++)
        bias[i] = (sh_proto_logit_bias){q->bias[i].token, q->bias[i].bias};
    sh_strv stops[SH_OPENAI_MAX_STOP];
    for (int32_t i = 0; i < q->n_stop; i++)
        stops[i] = (sh_strv){q->stop[i], (uint32_t)strlen(q->stop[i])};
    uint64_t seed = q->has_seed ? q->seed : (sh__act_mono_us() * 0x9E3779B97F4A7C15ull) ^ r->id;
    int32_t prio = key_prio;
    if (q->priority > prio)
        prio = q->priority;
    sh_proto_submit sub = {
        .req = r->id,
        .prompt = {ids, (uint32_t)n_ids},
        .sampling = {.temperature = q->temperature,
                     .top_k = q->top_k > 0 ? q->top_k : 0,
                     .top_p = q->top_p,
                     .min_p = q->min_p,
                     .repeat_penalty = q->repeat_penalty,
                     .frequency_penalty = q->frequency_penalty,
                     .presence_penalty = q->presence_penalty,
                     .penalty_last_n = q->repeat_last_n < 0 || q->repeat_last_n > m->n_ctx
                                           ? m->n_ctx
                                           : q->repeat_last_n,
                     .typical_p = q->typical_p < 1.0f ? q->typical_p : 0.0f,
                     .seed = seed,
                     .max_tokens = (uint32_t)max_tokens,
                     .n_logprobs = q->logprobs ? q->top_logprobs : 0,
                     .logprobs_mode = SH_LOGPROBS_RAW,
                     .stop = {stops, (uint32_t)q->n_stop},
                     .bias = {bias, (uint32_t)q->n_bias},
                     // A sequence with a grammar takes no drafts (its matcher checks one
                     // sampled token a step).
                     .no_spec = q->no_spec || q->grammar,
                     .spec_max = (uint8_t)q->spec_n_max,
                     .grammar = {q->grammar, q->grammar ? (uint32_t)strlen(q->grammar) : 0},
                     // Logprobs are those of the masked row: each sample masks first.
                     .gram_lp = q->grammar && q->logprobs},
        .priority = (uint8_t)prio,
        .deadline_ms = g->a.request_timeout_ms ? sh__act_unix_ms() + g->a.request_timeout_ms : 0,
        .reply_to = sh_actor_self(g->ctx),
        .n = (uint32_t)q->n,
        .min_tokens = q->ignore_eos ? (uint32_t)max_tokens : (uint32_t)q->min_tokens,
        .min_mask = q->ignore_eos ? 0 : (uint32_t)q->min_tokens,
    };
    sh_error e = {0};
    sh_err rc = sh__act_send(sh_actor_runtime(g->ctx), sh_actor_self(g->ctx), m->batcher,
                             SH_MSG_SUBMIT, r->id, &sub, &e);
    free(ids);
    sh_openai_request_free(q);
    if (rc) {
        sh__gateway_req_free(r);
        sh__gateway_respond_errorf(g, http, 503, NULL, NULL, "the scheduler is not reachable: %s",
                                   e.msg);
        return;
    }
    r->next = g->reqs;
    g->reqs = r;
    sh_http_req_on_abort(http, on_abort, r);
}

/* The client went away: the batcher stops the request; its handle is completed now. */
static void on_abort(sh_http_req *http, void *arg)
{
    gw_req *r = arg;
    gateway *g = r->g;
    sh_proto_cancel c = {.req = r->id, .reason = {"client disconnected", 19}};
    sh_error e = {0};
    sh__act_send(sh_actor_runtime(g->ctx), sh_actor_self(g->ctx), r->m->batcher, SH_MSG_CANCEL,
                 r->id, &c, &e);
    if (r->stream)
        sh_http_stream_end(http);
    else
        sh_http_respond(http, 499, "application/json", "", 0);
    r->http = NULL;
    req_unlink(g, r);
    sh__gateway_req_free(r);
}

/* Writes one SSE event (takes ownership of ev). */
static void sse_write(gw_req *r, char *ev)
{
    if (!ev || !r->http)
        goto out;
    sh_http_stream_write(r->http, ev, strlen(ev));
out:
    free(ev);
}

/* Starts the event stream on the first event (errors before it are plain JSON responses). */
static bool ensure_stream(gw_req *r)
{
    if (!r->http)
        return false;
    if (!r->stream_started) {
        if (sh_http_stream_start(r->http, 200, "text/event-stream", true) != SH_OK)
            return false;
        r->stream_started = true;
    }
    return true;
}

static void fill_lp(const gw_req *r, const gw_lp *src, sh_openai_logprob *dst, sh_openai_top *tops,
                    char (*texts)[MAX_PIECE], int32_t *n_texts)
{
    dst->token = piece_text(r, src->id, texts[(*n_texts)++]);
    dst->logprob = src->lp;
    dst->text_offset = src->text_offset;
    dst->n_top = src->n_top;
    dst->top = tops;
    for (int32_t k = 0; k < src->n_top; k++) {
        tops[k].token = piece_text(r, src->top[k].id, texts[(*n_texts)++]);
        tops[k].logprob = src->top[k].lp;
    }
}

/* A streamed tools request's next text (last: the generation ended): the content that is
 * safe to send and each call completed, as OpenAI's deltas. */
static void stream_tools(gw_req *r, const sh_openai_meta *meta, int32_t index, gw_choice *c,
                         const char *text, bool last, const sh_openai_logprob *lp)
{
    const char *content = NULL, *deltas = NULL;
    if (sh_openai_toolstream_feed(&c->ts, text, strlen(text), last, &content, &deltas))
        content = deltas = NULL; // out of memory: this piece is lost, the stream goes on
    if (content || lp) {
        sh_openai_choice ch = {.index = index,
                               .text = content ? content : "",
                               .logprobs = lp,
                               .n_logprobs = lp ? 1 : 0};
        sse_write(r, sh_openai_chunk_sse(meta, &ch, false, r->include_usage));
    }
    if (deltas) {
        sh_openai_choice ch = {.index = index, .tool_calls = deltas};
        sse_write(r, sh_openai_chunk_sse(meta, &ch, false, r->include_usage));
    }
}

static void on_token(gateway *g, const sh_proto_token *t)
{
    gw_req *r = find_req(g, t->req);
    if (!r || t->choice >= (uint32_t)r->n_choices)
        return;
    gw_choice *c = &r->choices[t->choice];
    if (!r->t_first_us)
        r->t_first_us = sh__act_mono_us();
    c->n_gen += (int32_t)t->tokens.n;
    gw_lp lp = {0};
    bool has_lp = r->logprobs && t->tokens.n == 1 && t->logprobs.n == 1;
    if (has_lp) {
        lp.id = sh_i32s_at(t->tokens, 0);
        lp.lp = sh_f32s_at(t->logprobs, 0);
        lp.text_offset = (int32_t)c->len;
        int32_t k = t->top_n;
        if (k > SH_SAMPLER_MAX_LOGPROBS)
            k = SH_SAMPLER_MAX_LOGPROBS;
        if ((uint32_t)k > t->top_tokens.n || (uint32_t)k > t->top_logprobs.n)
            k = 0;
        lp.n_top = k;
        for (int32_t i = 0; i < k; i++)
            lp.top[i] = (gw_top){sh_i32s_at(t->top_tokens, (uint32_t)i),
                                 sh_f32s_at(t->top_logprobs, (uint32_t)i)};
    }
    if (r->stream) {
        if (!ensure_stream(r))
            return;
        if (r->resp) {
            c->started = true;
            sh__gateway_resp_piece(r, &c->ts, t->text.ptr ? t->text.ptr : "", t->text.len, false);
            return;
        }
        sh_openai_meta meta = meta_of(r);
        if (!c->started && r->kind == SH_OPENAI_CHAT) {
            sh_openai_choice ch = {.index = (int32_t)t->choice, .text = ""};
            sse_write(r, sh_openai_chunk_sse(&meta, &ch, true, r->include_usage));
        }
        c->started = true;
        if (!t->text.len && !has_lp)
            return;
        char *text = strndup(t->text.ptr ? t->text.ptr : "", t->text.len);
        sh_openai_logprob l;
        sh_openai_top tops[SH_SAMPLER_MAX_LOGPROBS];
        char texts[SH_SAMPLER_MAX_LOGPROBS + 1][MAX_PIECE];
        int32_t nt = 0;
        if (has_lp)
            fill_lp(r, &lp, &l, tops, texts, &nt);
        if (r->tools) {
            stream_tools(r, &meta, (int32_t)t->choice, c, text ? text : "", false,
                         has_lp ? &l : NULL);
            free(text);
            return;
        }
        sh_openai_choice ch = {.index = (int32_t)t->choice,
                               .text = text ? text : "",
                               .logprobs = has_lp ? &l : NULL,
                               .n_logprobs = has_lp ? 1 : 0};
        sse_write(r, sh_openai_chunk_sse(&meta, &ch, false, r->include_usage));
        free(text);
        return;
    }
    c->started = true;
    if (has_lp) {
        if (c->n_lps == c->cap_lps) {
            int32_t cap = c->cap_lps ? c->cap_lps * 2 : 64;
            gw_lp *p = realloc(c->lps, (size_t)cap * sizeof *p);
            if (p) {
                c->lps = p;
                c->cap_lps = cap;
            }
        }
        if (c->n_lps < c->cap_lps)
            c->lps[c->n_lps++] = lp;
    }
    if (t->text.len)
        append(&c->text, &c->len, &c->cap, t->text.ptr, t->text.len);
}

static sh_openai_finish finish_of(uint8_t fin)
{
    return fin == SH_PROTO_FINISH_STOP       ? SH_OPENAI_FINISH_STOP
           : fin == SH_PROTO_FINISH_DEADLINE ? SH_OPENAI_FINISH_TIMEOUT
                                             : SH_OPENAI_FINISH_LENGTH;
}

/* The non-streamed response: every choice's text (after the echoed prompt) and logprobs. */
static void respond_final(gw_req *r, const sh_openai_meta *meta, const sh_openai_usage *usage)
{
    int32_t n = r->n_choices;
    size_t per = SH_SAMPLER_MAX_LOGPROBS;
    sh_openai_choice *ch = calloc((size_t)n, sizeof *ch);
    sh_openai_logprob **lps = calloc((size_t)n, sizeof *lps);
    sh_openai_top **tops = calloc((size_t)n, sizeof *tops);
    char(**pieces)[MAX_PIECE] = calloc((size_t)n, sizeof *pieces);
    char **texts = calloc((size_t)n, sizeof *texts);
    char **calls = calloc((size_t)n, sizeof *calls);
    bool ok = ch && lps && tops && pieces && texts && calls;
    for (int32_t i = 0; ok && i < n; i++) {
        gw_choice *c = &r->choices[i];
        ch[i] = (sh_openai_choice){.index = i, .finish = c->finish, .text = c->text ? c->text : ""};
        if (r->echo) {
            size_t el = strlen(r->echo_text);
            texts[i] = malloc(el + c->len + 1);
            if (!texts[i]) {
                ok = false;
                break;
            }
            memcpy(texts[i], r->echo_text, el);
            memcpy(texts[i] + el, c->text ? c->text : "", c->len);
            texts[i][el + c->len] = '\0';
            ch[i].text = texts[i];
        }
        if (r->tools) {
            // The calls come out of the text; what is left is the content (null when none).
            uint64_t seed =
                r->id * 0x9E3779B97F4A7C15ull ^ (uint64_t)r->created ^ ((uint64_t)i << 48);
            if (sh_openai_tools_parse(r->tool_style, c->text ? c->text : "", c->len, seed,
                                      &texts[i], &calls[i])) {
                ok = false;
                break;
            }
            ch[i].text = texts[i];
            ch[i].tool_calls = calls[i];
            if (calls[i] && ch[i].finish == SH_OPENAI_FINISH_STOP)
                ch[i].finish = SH_OPENAI_FINISH_TOOL_CALLS;
            if (!calls[i] && !texts[i])
                ch[i].text = "";
        }
        if (r->logprobs) {
            lps[i] = calloc((size_t)c->n_lps + 1, sizeof **lps);
            tops[i] = calloc(((size_t)c->n_lps + 1) * per, sizeof **tops);
            pieces[i] = calloc(((size_t)c->n_lps + 1) * (per + 1), MAX_PIECE);
            if (!lps[i] || !tops[i] || !pieces[i]) {
                ok = false;
                break;
            }
            int32_t nt = 0;
            for (int32_t k = 0; k < c->n_lps; k++)
                fill_lp(r, &c->lps[k], &lps[i][k], tops[i] + (size_t)k * per, pieces[i], &nt);
            ch[i].logprobs = lps[i];
            ch[i].n_logprobs = c->n_lps;
        }
    }
    char *body = ok ? sh_openai_response_json(meta, ch, n, usage) : NULL;
    respond_json(r->http, 200, body);
    for (int32_t i = 0; i < n; i++) {
        if (lps)
            free(lps[i]);
        if (tops)
            free(tops[i]);
        if (pieces)
            free(pieces[i]);
        if (texts)
            free(texts[i]);
        if (calls)
            free(calls[i]);
    }
    free(calls);
    free(ch);
    free(lps);
    free(tops);
    free(pieces);
    free(texts);
}

/* Every choice finished: the final response (or the stream's end). */
static void complete(gateway *g, gw_req *r)
{
    uint64_t now = sh__act_mono_us();
    int32_t n_gen = 0;
    for (int32_t i = 0; i < r->n_choices; i++)
        n_gen += r->choices[i].n_gen;
    sh_histogram_observe(g->m_e2e, (double)(now - r->t0_us) * 1e-6);
    if (r->t_first_us) {
        sh_histogram_observe(g->m_ttft, (double)(r->t_first_us - r->t0_us) * 1e-6);
        int32_t per = r->n_choices ? n_gen / r->n_choices : 0;
        if (per > 1)
            sh_histogram_observe(g->m_tpot, (double)(now - r->t_first_us) * 1e-6 / (per - 1));
    }
    sh_openai_meta meta = meta_of(r);
    sh_openai_usage usage = {r->n_prompt, n_gen, r->n_cached};
    if (r->resp) {
        gw_choice *c = &r->choices[0];
        if (r->http && (!r->stream || ensure_stream(r)))
            sh__gateway_resp_finish(r, c->text, c->len, c->finish, &usage);
    } else if (r->stream) {
        if (ensure_stream(r)) {
            if (r->include_usage)
                sse_write(r, sh_openai_usage_sse(&meta, &usage));
            sh_http_stream_write(r->http, SH_OPENAI_SSE_DONE, strlen(SH_OPENAI_SSE_DONE));
            sh_http_stream_end(r->http);
        }
    } else if (r->http) {
        respond_final(r, &meta, &usage);
    }
    r->http = NULL;
    req_unlink(g, r);
    sh__gateway_req_free(r);
}

static void on_done(gateway *g, const sh_proto_done *d)
{
    if (sh__gateway_embed_done(g, d))
        return;
    gw_req *r = find_req(g, d->req);
    if (!r || d->choice >= (uint32_t)r->n_choices || r->choices[d->choice].done)
        return;
    gw_choice *c = &r->choices[d->choice];
    if (d->choice == 0) // the other choices fork the first's prompt: no cache lookup of their own
        r->n_cached = d->n_cached < (uint32_t)r->n_prompt ? (int32_t)d->n_cached : r->n_prompt;
    c->done = true;
    c->finish = finish_of(d->finish);
    r->n_done++;
    if (r->stream && r->resp) {
        if (ensure_stream(r)) {
            c->started = true;
            sh__gateway_resp_piece(r, &c->ts, d->text.ptr ? d->text.ptr : "", d->text.len, true);
        }
    } else if (r->stream) {
        if (ensure_stream(r)) {
            sh_openai_meta meta = meta_of(r);
            if (!c->started && r->kind == SH_OPENAI_CHAT) {
                sh_openai_choice ch = {.index = (int32_t)d->choice, .text = ""};
                sse_write(r, sh_openai_chunk_sse(&meta, &ch, true, r->include_usage));
            }
            c->started = true;
            if (r->tools) {
                char *text = strndup(d->text.ptr ? d->text.ptr : "", d->text.len);
                stream_tools(r, &meta, (int32_t)d->choice, c, text ? text : "", true, NULL);
                free(text);
                if (c->ts.n_calls > 0 && c->finish == SH_OPENAI_FINISH_STOP)
                    c->finish = SH_OPENAI_FINISH_TOOL_CALLS;
            } else if (d->text.len) {
                char *text = strndup(d->text.ptr, d->text.len);
                sh_openai_choice ch = {.index = (int32_t)d->choice, .text = text ? text : ""};
                sse_write(r, sh_openai_chunk_sse(&meta, &ch, false, r->include_usage));
                free(text);
            }
            sh_openai_choice fin = {.index = (int32_t)d->choice,
                                    .text = r->kind == SH_OPENAI_CHAT ? NULL : "",
                                    .finish = c->finish};
            sse_write(r, sh_openai_chunk_sse(&meta, &fin, false, r->include_usage));
        }
    } else if (d->text.len) {
        append(&c->text, &c->len, &c->cap, d->text.ptr, d->text.len);
    }
    if (r->n_done == r->n_choices)
        complete(g, r);
}

/* Answers r's client with err and completes the handle (r->http becomes NULL): a stream already
 * started gets an error event and [DONE], anything else a JSON error with err's status. */
static void respond_err(gw_req *r, const sh_openai_error *err)
{
    if (!r->http)
        return;
    if (sh__gateway_resp_fail(r, err)) {
        r->http = NULL;
        return;
    }
    if (r->stream && r->stream_started) {
        char *json = sh_openai_error_json(err);
        if (json) {
            sh_http_stream_write(r->http, "data: ", 6);
            sh_http_stream_write(r->http, json, strlen(json));
            sh_http_stream_write(r->http, "\n\n", 2);
            free(json);
        }
        sh_http_stream_write(r->http, SH_OPENAI_SSE_DONE, strlen(SH_OPENAI_SSE_DONE));
        sh_http_stream_end(r->http);
    } else {
        respond_json(r->http, err->status, sh_openai_error_json(err));
    }
    r->http = NULL;
}

static void on_fail(gateway *g, const sh_proto_fail *f)
{
    if (sh__gateway_embed_fail(g, f))
        return;
    gw_req *r = find_req(g, f->req);
    if (!r)
        return;
    int status = f->status_http >= 400 ? (int)f->status_http : 500;
    sh_openai_error err;
    sh_openai_error_set(&err, status, NULL, NULL, "%.*s", (int)f->message.len, f->message.ptr);
    sh_counter_add(g->m_http_errors, 1);
    respond_err(r, &err);
    req_unlink(g, r);
    sh__gateway_req_free(r);
}

/* Ends a request that cannot finish (drain deadline, stop): a started stream gets an error event
 * and [DONE], anything else a JSON error. The handle is completed; r stays for the caller. */
void sh__gateway_end_with_error(gateway *g, gw_req *r, int status, const char *code,
                                const char *msg)
{
    if (!r->http)
        return;
    sh_http_req_on_abort(r->http, NULL, NULL);
    sh_openai_error err;
    sh_openai_error_set(&err, status, code, NULL, "%s", msg);
    sh_counter_add(g->m_http_errors, 1);
    respond_err(r, &err);
}

/* ---- routing ------------------------------------------------------------------------------ */

/* GET /admin/: the status page (net/admin_page.h). With keys set it needs one like the other
 * admin routes, from ?key= (a browser's address bar sends no header; the page's script then
 * sends it as a bearer key) or the Authorization header; without one it answers 401 with a form
 * that asks for it. */
static void serve_admin_page(gateway *g, sh_http_req *req)
{
    size_t len;
    if (g->n_keys) {
        char key[512], bearer[520];
        const char *auth = sh_http_req_header(req, "Authorization");
        if (sh__admin_page_query_key(sh_http_req_query(req), key, sizeof key)) {
            snprintf(bearer, sizeof bearer, "Bearer %s", key);
            auth = bearer;
        }
        int32_t prio;
        sh_openai_error err;
        if (sh_openai_auth_check(g->keys, g->n_keys, auth, 0, &prio, &err)) {
            sh_counter_add(g->m_http_errors, 1);
            const char *login = sh__admin_page_login_html(&len);
            sh_http_req_add_header(req, "Cache-Control", "no-store");
            sh_http_req_add_header(req, "Content-Security-Policy", sh__admin_page_login_csp());
            sh_http_req_add_header(req, "X-Frame-Options", "DENY");
            sh_http_req_add_header(req, "X-Content-Type-Options", "nosniff");
            sh_http_respond(req, 401, "text/html; charset=utf-8", login, len);
            return;
        }
    }
    const char *page = sh__admin_page_html(&len);
    sh_http_req_add_header(req, "Cache-Control", "no-store");
    sh_http_req_add_header(req, "Referrer-Policy", "no-referrer");
    sh_http_req_add_header(req, "Content-Security-Policy", sh__admin_page_csp());
    sh_http_req_add_header(req, "X-Frame-Options", "DENY");
    sh_http_req_add_header(req, "X-Content-Type-Options", "nosniff");
    sh_http_respond(req, 200, "text/html; charset=utf-8", page, len);
}

static void on_http(sh_http_req *req, void *user)
{
    gateway *g = user;
    const char *method = sh_http_req_method(req);
    const char *path = sh_http_req_path(req);
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    bool post = !strcmp(method, "POST");
    // /health stays open to everyone (load balancers probe it without keys); while draining it
    // says so with 503, which takes the server out of rotation.
    if (!strcmp(path, "/health")) {
        if (!get)
            goto bad_method;
        // A model file truncated under this process (base/file.h's guard): every step fails, so
        // take the server out of rotation.
        bool damaged = sh__file_damaged(NULL, 0);
        char *body = sh_openai_health_json(damaged       ? "model_file_damaged"
                                           : g->draining ? "draining"
                                                         : "ok",
                                           NULL);
        respond_json(req, damaged || g->draining ? 503 : 200, body);
        return;
    }
    // The OpenAI paths also without /v1, as llama-server answers them (llama.cpp's clients).
    const char *api = !strncmp(path, "/v1/", 4) ? path + 3 : path;
    bool is_metrics = !strcmp(path, "/metrics");
    bool is_models = !strcmp(api, "/models");
    bool is_cmpl = !strcmp(api, "/completions");
    bool is_chat = !strcmp(api, "/chat/completions");
    bool is_tok = !strcmp(path, "/tokenize"), is_detok = !strcmp(path, "/detokenize");
    bool is_emb = !strcmp(api, "/embeddings");
    bool is_resp = !strcmp(api, "/responses");
    is_chat = is_chat || is_resp;
    if ((is_models || is_cmpl || is_chat || is_tok || is_detok || is_emb) &&
        sh__gateway_cors(g, req))
        return; /* a CORS preflight: answered before the keys, a browser sends none with it */
    if (!strcmp(path, "/admin/policy/reload")) { /* answered while draining too */
        if (!post)
            goto bad_method;
        policy_reload(g, req);
        return;
    }
    bool is_cluster = g->a.cluster_json && !strcmp(path, "/admin/cluster");
    bool is_status = g->a.status_json && !strcmp(path, "/admin/status");
    if (g->a.status_json && (!strcmp(path, "/admin/") || !strcmp(path, "/admin"))) {
        if (!get)
            goto bad_method;
        serve_admin_page(g, req); /* answered while draining too, with its own key check */
        return;
    }
    if (!is_metrics && !is_models && !is_cmpl && !is_chat && !is_tok && !is_detok && !is_emb &&
        !is_cluster && !is_status) {
        sh__gateway_respond_errorf(g, req, 404, "not_found", NULL, "no such endpoint: %s %s",
                                   method, path);
        return;
    }
    int32_t prio = 0;
    sh_openai_error err;
    if ((!is_metrics || !g->a.metrics_public) &&
        sh_openai_auth_check(g->keys, g->n_keys, sh_http_req_header(req, "Authorization"), 0, &prio,
                             &err)) {
        respond_error(g, req, &err);
        return;
    }
    if (is_metrics) {
        if (!get)
            goto bad_method;
        serve_metrics(g, req);
        return;
    }
    if (is_cluster || is_status) { /* answered while draining too: it shows what is going on */
        if (!get)
            goto bad_method;
        char *doc = (is_status ? g->a.status_json : g->a.cluster_json)(g->a.cluster_user);
        if (!doc) {
            sh__gateway_respond_errorf(g, req, 500, NULL, NULL,
                                       "the cluster status is not available (out of memory)");
            return;
        }
        respond_json(req, 200, doc);
        return;
    }
    if (g->draining) {
        sh__gateway_respond_errorf(g, req, 503, "server_shutting_down", NULL,
                                   "the server is shutting down; retry on another replica");
        return;
    }
    if (is_models) {
        if (!get)
            goto bad_method;
        sh__gateway_models(g, req);
        return;
    }
    if (!post)
        goto bad_method;
    if (is_tok || is_detok) {
        sh__gateway_tokenize(g, req, is_detok);
        return;
    }
    if (is_emb) {
        sh__gateway_embed(g, req, prio);
        return;
    }
    handle_generate(g, req, is_chat ? SH_OPENAI_CHAT : SH_OPENAI_COMPLETION, is_resp, prio);
    return;
bad_method:
    sh__gateway_respond_errorf(g, req, 405, "method_not_allowed", NULL, "%s is not allowed on %s",
                               method, path);
}

/* The HTTP server's warnings (descriptors exhausted, connections shed) into the actor's log. */
static void on_http_log(void *user, const char *event, const char *detail)
{
    gateway *g = user;
    sh_actor_log(g->ctx, SH_LOG_LEVEL_WARN, event, "msg=\"%s\"", detail);
}

/* ---- the actor ---------------------------------------------------------------------------- */

static sh_err gateway_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    gateway *g = state;
    const sh_gateway_args *a = arg;
    g->ctx = ctx;
    g->a = *a;
    if (a->models && (a->n_models < 1 || a->n_models > SH_GATEWAY_MAX_MODELS))
        return SH_EINVAL;
    g->n_m = a->models ? a->n_models : 1;
    if (a->models)
        memcpy(g->m, a->models, (size_t)g->n_m * sizeof g->m[0]);
    else
        g->m[0] = (sh_gateway_model){.name = a->model_name,
                                     .batcher = a->batcher,
                                     .tok = a->tok,
                                     .chat = a->chat,
                                     .default_system = a->default_system,
                                     .n_vocab = a->n_vocab,
                                     .n_ctx = a->n_ctx,
                                     .n_ctx_train = a->n_ctx_train,
                                     .sampling = a->sampling,
                                     .embd_dim = a->embd_dim,
                                     .pooling = a->pooling};
    int32_t max_ctx = 0;
    for (int32_t i = 0; i < g->n_m; i++) {
        g->models[i] = g->m[i].name;
        if (g->m[i].n_ctx > max_ctx)
            max_ctx = g->m[i].n_ctx;
    }
    sh__gateway_fingerprints(g);
    if (g->a.max_n <= 0)
        g->a.max_n = 8;
    if (g->a.max_tokens <= 0)
        g->a.max_tokens = max_ctx;
    sh_metrics *mx = sh_runtime_metrics(sh_actor_runtime(ctx));
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                                 1,     1.5,  2,     3,    5,     7.5, 10,   20,  40,  80};
    static const double tpot[] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
                                  0.075, 0.1,    0.15,  0.2,  0.3,   0.5,  0.75, 1,    2.5};
    sh_metrics_histogram(mx, "shoal_time_to_first_token_seconds",
                         "Time from receiving a request to its first generated token.", NULL, lat,
                         sizeof lat / sizeof lat[0], &g->m_ttft);
    sh_metrics_histogram(mx, "shoal_time_per_output_token_seconds",
                         "Mean time between generated tokens of a request, after the first.", NULL,
                         tpot, sizeof tpot / sizeof tpot[0], &g->m_tpot);
    sh_metrics_histogram(mx, "shoal_e2e_request_latency_seconds",
                         "Time from receiving a request to its last byte.", NULL, lat,
                         sizeof lat / sizeof lat[0], &g->m_e2e);
    sh_metrics_counter(mx, "shoal_http_errors_total", "Requests answered with an error status.",
                       NULL, &g->m_http_errors);
    // The kvmgr's figures, read for the ratios on /metrics (same series it registers).
    sh_metrics_gauge(mx, "shoal_kv_blocks_total", "KV blocks in the pool.", NULL, &g->kv_total);
    sh_metrics_gauge(mx, "shoal_kv_blocks_used", "KV blocks held by sequences.", NULL, &g->kv_used);
    sh_metrics_counter(mx, "shoal_prefix_cache_query_tokens_total",
                       "Prompt tokens looked up in the prefix cache.", NULL, &g->pc_query);
    sh_metrics_counter(mx, "shoal_prefix_cache_hit_tokens_total",
                       "Prompt tokens found in the prefix cache.", NULL, &g->pc_hit);
    if (!g->m_ttft || !g->m_tpot || !g->m_e2e || !g->m_http_errors ||
        sh__act_decoder_init(&g->dec, (size_t)1 << 16))
        return SH_ENOMEM;
    g->n_keys = g->a.n_keys > 0 ? g->a.n_keys : 0;
    g->keys = sh__gateway_ctl_keys_copy(g->a.keys, g->n_keys);
    if (g->n_keys && !g->keys) {
        sh__act_decoder_fini(&g->dec);
        return SH_ENOMEM;
    }
    sh_http_opts ho = {.host = g->a.host,
                       .port = g->a.port,
                       .max_conns = g->a.max_conns,
                       .max_conns_per_ip = g->a.max_conns_per_ip,
                       .max_body_bytes = g->a.max_body_bytes,
                       .header_timeout_ms = g->a.header_timeout_ms,
                       .idle_timeout_ms = g->a.idle_timeout_ms,
                       .handler = on_http,
                       .user = g,
                       .log = on_http_log};
    sh_error e = {0};
    sh_err err = sh_http_server_create(sh__actor_uv_loop(ctx), &ho, &g->srv, &e);
    if (!err && sh__gateway_ctl_attach(g)) {
        sh_http_server_close(g->srv, true, NULL, NULL);
        g->srv = NULL;
        err = SH_ENOMEM;
        snprintf(e.msg, sizeof e.msg, "out of memory");
    }
    if (err) {
        free(g->keys);
        g->keys = NULL;
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "listen_failed", "host=%s port=%d err=\"%s\"",
                     g->a.host ? g->a.host : "127.0.0.1", g->a.port, e.msg);
        if (g->a.bound_port)
            __atomic_store_n(g->a.bound_port, -1, __ATOMIC_RELEASE);
        sh__act_decoder_fini(&g->dec);
        return err;
    }
    if (g->a.bound_port)
        __atomic_store_n(g->a.bound_port, sh_http_server_port(g->srv), __ATOMIC_RELEASE);
    return SH_OK;
}

static sh_msg_fate gateway_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    gateway *g = state;
    const sh_msg_hdr *h = sh_msg_header(msg);
    sh_proto_body pb;
    sh_error e = {0};
    if (h->type == SH_MSG_ERROR)
        return SH_MSG_FATE_DONE;
    if (sh__act_decode(&g->dec, msg, &pb, &e)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "bad_message", "type=%u err=\"%s\"", (unsigned)h->type,
                     e.msg);
        return SH_MSG_FATE_DONE;
    }
    switch (h->type) {
    case SH_MSG_TOKEN:
        on_token(g, &pb.token);
        break;
    case SH_MSG_DONE:
        on_done(g, &pb.done);
        break;
    case SH_MSG_FAIL:
        on_fail(g, &pb.fail);
        break;
    default:
        sh_actor_log(ctx, SH_LOG_LEVEL_DEBUG, "unexpected", "type=%u", (unsigned)h->type);
        break;
    }
    return SH_MSG_FATE_DONE;
}

static void gateway_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    gateway *g = state;
    // Every open request is answered now, so no HTTP callback refers to this state later: a
    // stream ends with an error event and [DONE] (the client knows it was cut short), anything
    // else gets 503. Prompts still being tokenized are answered first.
    sh__gateway_tok_orphan_all(g);
    sh__gateway_embed_end_all(g, "the server is shutting down");
    while (g->reqs) {
        gw_req *r = g->reqs;
        g->reqs = r->next;
        sh__gateway_end_with_error(g, r, 503, "server_shutting_down",
                                   "the server is shutting down");
        sh__gateway_req_free(r);
    }
    sh__gateway_ctl_detach(g);
    if (g->srv)
        sh_http_server_close(g->srv, true, NULL, NULL);
    free(g->keys);
    free(g->metrics_buf);
    sh__act_decoder_fini(&g->dec);
}

const sh_actor_vtable sh__gateway_vtable = {
    .name = "gateway",
    .state_size = sizeof(gateway),
    .init = gateway_init,
    .handle = gateway_handle,
    .stop = gateway_stop,
};
