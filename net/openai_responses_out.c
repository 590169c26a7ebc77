/* POST /v1/responses answers: the response object with its output items, and the typed
 * server-sent events that build it up when streamed. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/openai_responses.h"

sh_err sh_openai_resp_init(sh_openai_resp *s, const char *id, int64_t created_at, const char *model,
                           const char *echo)
{
    memset(s, 0, sizeof *s);
    snprintf(s->id, sizeof s->id, "%s", id ? id : "resp_0");
    snprintf(s->model, sizeof s->model, "%s", model ? model : "");
    s->created_at = created_at;
    json_t *e = echo ? json_loads(echo, 0, NULL) : json_object();
    json_t *out = json_array();
    if (!json_is_object(e) || !out) {
        json_decref(e);
        json_decref(out);
        memset(s, 0, sizeof *s);
        return SH_ENOMEM;
    }
    s->echo_ = e;
    s->output_ = out;
    return SH_OK;
}

void sh_openai_resp_fini(sh_openai_resp *s)
{
    json_decref(s->echo_);
    json_decref(s->output_);
    free(s->text.p);
    free(s->ev.p);
    memset(s, 0, sizeof *s);
}

/* ---- building blocks ---------------------------------------------------------------------- */

/* Appends "event: <type>\ndata: <json>\n\n" with the next sequence_number; takes data. */
static void emit(sh_openai_resp *s, json_t *data)
{
    if (!data) {
        s->ev.oom = true;
        return;
    }
    json_object_set_new(data, "sequence_number", json_integer(s->seq++));
    char *d = json_dumps(data, JSON_COMPACT | JSON_PRESERVE_ORDER);
    const char *type = json_string_value(json_object_get(data, "type"));
    if (!d || !type) {
        s->ev.oom = true;
    } else {
        sh_strbuf_add(&s->ev, "event: ");
        sh_strbuf_add(&s->ev, type);
        sh_strbuf_add(&s->ev, "\ndata: ");
        sh_strbuf_add(&s->ev, d);
        sh_strbuf_add(&s->ev, "\n\n");
    }
    free(d);
    json_decref(data);
}

/* Starts a call's events. */
static void ev_reset(sh_openai_resp *s)
{
    s->ev.len = 0;
    s->ev.oom = false;
    if (s->ev.p)
        s->ev.p[0] = '\0';
}

static const char *ev_result(sh_openai_resp *s)
{
    if (s->ev.oom)
        return NULL;
    return s->ev.p ? s->ev.p : "";
}

static void item_id(const sh_openai_resp *s, const char *prefix, int32_t n, char *buf, size_t cap)
{
    const char *base = strncmp(s->id, "resp_", 5) ? s->id : s->id + 5;
    snprintf(buf, cap, "%s_%s%02d", prefix, base, (int)n);
}

static json_t *text_part(const char *text)
{
    return json_pack("{s:s, s:o, s:[], s:[]}", "type", "output_text", "text",
                     sh__openai_text_json(text), "annotations", "logprobs");
}

static int32_t n_output(const sh_openai_resp *s)
{
    return (int32_t)json_array_size((json_t *)s->output_);
}

/* The open message's id: its output index (nothing is added to the output while it is open). */
static void msg_id(const sh_openai_resp *s, char *buf, size_t cap)
{
    item_id(s, "msg", n_output(s), buf, cap);
}

static json_t *message_item(const sh_openai_resp *s, const char *status, bool with_text)
{
    char id[96];
    msg_id(s, id, sizeof id);
    json_t *content =
        with_text ? json_pack("[o]", text_part(s->text.p ? s->text.p : "")) : json_array();
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "id", id, "type", "message", "status", status,
                     "role", "assistant", "content", content);
}

static void open_message(sh_openai_resp *s)
{
    if (s->msg_open)
        return;
    s->msg_open = true;
    int32_t at = n_output(s);
    char id[96];
    msg_id(s, id, sizeof id);
    emit(s, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.added", "output_index", at,
                      "item", message_item(s, "in_progress", false)));
    emit(s, json_pack("{s:s, s:s, s:i, s:i, s:o}", "type", "response.content_part.added", "item_id",
                      id, "output_index", at, "content_index", 0, "part", text_part("")));
}

/* Text bytes [t, t + n) joined to what waits in s->cut; the end of a cut UTF-8 character waits
 * for the next piece (flush: nothing waits, a cut character becomes U+FFFD in JSON). */
static void add_text(sh_openai_resp *s, const char *t, size_t n, bool flush)
{
    char buf[1024];
    while (n > 0 || (flush && s->n_cut)) {
        size_t k = s->n_cut, take = n < sizeof buf - 4 ? n : sizeof buf - 4;
        memcpy(buf, s->cut, k);
        memcpy(buf + k, t, take);
        k += take;
        t += take;
        n -= take;
        s->n_cut = 0;
        size_t keep = 0;
        for (size_t back = 1; !flush && n == 0 && back <= 3 && back <= k; back++) {
            unsigned char c = (unsigned char)buf[k - back];
            if ((c & 0xc0) == 0x80)
                continue;
            size_t want = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
            if (want > back)
                keep = back;
            break;
        }
        memcpy(s->cut, buf + k - keep, keep);
        s->n_cut = keep;
        k -= keep;
        if (k == 0)
            continue;
        open_message(s);
        buf[k] = '\0';
        sh_strbuf_addn(&s->text, buf, k);
        char id[96];
        msg_id(s, id, sizeof id);
        emit(s, json_pack("{s:s, s:s, s:i, s:i, s:o, s:[]}", "type", "response.output_text.delta",
                          "item_id", id, "output_index", n_output(s), "content_index", 0, "delta",
                          sh__openai_text_json(buf), "logprobs"));
    }
}

static void close_message(sh_openai_resp *s, const char *status)
{
    add_text(s, "", 0, true);
    if (!s->msg_open)
        return;
    s->msg_open = false;
    int32_t at = n_output(s);
    char id[96];
    msg_id(s, id, sizeof id);
    const char *text = s->text.p ? s->text.p : "";
    emit(s, json_pack("{s:s, s:s, s:i, s:i, s:o, s:[]}", "type", "response.output_text.done",
                      "item_id", id, "output_index", at, "content_index", 0, "text",
                      sh__openai_text_json(text), "logprobs"));
    emit(s, json_pack("{s:s, s:s, s:i, s:i, s:o}", "type", "response.content_part.done", "item_id",
                      id, "output_index", at, "content_index", 0, "part", text_part(text)));
    json_t *item = message_item(s, status, true);
    emit(s, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index", at,
                      "item", item));
    if (!item || json_array_append_new((json_t *)s->output_, item))
        s->ev.oom = true;
}

/* The response object; status "in_progress" leaves usage null. */
static json_t *response_obj(const sh_openai_resp *s, const char *status, json_t *error,
                            json_t *incomplete, const sh_openai_usage *u)
{
    json_t *e = s->echo_;
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:b, s:o, s:o}", "id", s->id, "object", "response",
                          "created_at", (json_int_t)s->created_at, "status", status, "background",
                          0, "error", error ? error : json_null(), "incomplete_details",
                          incomplete ? incomplete : json_null());
    if (!o)
        return NULL;
    static const char *const before[] = {"instructions", "max_output_tokens"};
    static const char *const after[] = {"parallel_tool_calls", "temperature", "text",
                                        "tool_choice",         "tools",       "top_p"};
    for (size_t i = 0; i < sizeof before / sizeof before[0]; i++)
        json_object_set(o, before[i], json_object_get(e, before[i]));
    json_object_set_new(o, "max_tool_calls", json_null());
    json_object_set_new(o, "model", json_string(s->model));
    json_object_set_new(o, "output",
                        strcmp(status, "in_progress") ? json_deep_copy((json_t *)s->output_)
                                                      : json_array());
    json_object_set_new(o, "previous_response_id", json_null());
    json_object_set_new(o, "reasoning", json_pack("{s:n, s:n}", "effort", "summary"));
    json_object_set_new(o, "service_tier", json_string("default"));
    json_object_set_new(o, "store", json_false());
    for (size_t i = 0; i < sizeof after / sizeof after[0]; i++)
        json_object_set(o, after[i], json_object_get(e, after[i]));
    json_object_set_new(o, "top_logprobs", json_integer(0));
    json_object_set_new(o, "truncation", json_string("disabled"));
    json_object_set_new(o, "usage",
                        u ? json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}", "input_tokens",
                                      u->prompt_tokens, "input_tokens_details", "cached_tokens",
                                      u->cached_tokens, "output_tokens", u->completion_tokens,
                                      "output_tokens_details", "reasoning_tokens", 0,
                                      "total_tokens", u->prompt_tokens + u->completion_tokens)
                          : json_null());
    json_t *user = json_object_get(e, "user");
    if (user)
        json_object_set(o, "user", user);
    json_object_set(o, "metadata", json_object_get(e, "metadata"));
    return o;
}

/* ---- the calls ---------------------------------------------------------------------------- */

const char *sh_openai_resp_start(sh_openai_resp *s)
{
    ev_reset(s);
    emit(s, json_pack("{s:s, s:o}", "type", "response.created", "response",
                      response_obj(s, "in_progress", NULL, NULL, NULL)));
    emit(s, json_pack("{s:s, s:o}", "type", "response.in_progress", "response",
                      response_obj(s, "in_progress", NULL, NULL, NULL)));
    return ev_result(s);
}

const char *sh_openai_resp_text(sh_openai_resp *s, const char *t, size_t n)
{
    ev_reset(s);
    add_text(s, t, n, false);
    return ev_result(s);
}

const char *sh_openai_resp_calls(sh_openai_resp *s, const char *calls_json)
{
    ev_reset(s);
    if (!calls_json)
        return "";
    json_t *calls = json_loads(calls_json, 0, NULL);
    if (!json_is_array(calls)) {
        json_decref(calls);
        return NULL;
    }
    close_message(s, "completed");
    size_t i;
    json_t *c;
    json_array_foreach(calls, i, c)
    {
        json_t *fn = json_object_get(c, "function");
        const char *call_id = json_string_value(json_object_get(c, "id"));
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        char id[96], cid[32];
        int32_t at = n_output(s);
        item_id(s, "fc", at, id, sizeof id);
        if (!call_id) {
            snprintf(cid, sizeof cid, "call_%d", (int)s->n_calls);
            call_id = cid;
        }
        s->n_calls++;
        json_t *item = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "id", id, "type",
                                 "function_call", "status", "completed", "arguments",
                                 args ? args : "{}", "call_id", call_id, "name", name ? name : "");
        emit(s, json_pack("{s:s, s:i, s:{s:s, s:s, s:s, s:s, s:s, s:s}}", "type",
                          "response.output_item.added", "output_index", at, "item", "id", id,
                          "type", "function_call", "status", "in_progress", "arguments", "",
                          "call_id", call_id, "name", name ? name : ""));
        emit(s, json_pack("{s:s, s:s, s:i, s:s}", "type", "response.function_call_arguments.delta",
                          "item_id", id, "output_index", at, "delta", args ? args : "{}"));
        emit(s, json_pack("{s:s, s:s, s:i, s:s, s:s}", "type",
                          "response.function_call_arguments.done", "item_id", id, "output_index",
                          at, "name", name ? name : "", "arguments", args ? args : "{}"));
        emit(s, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index",
                          at, "item", item));
        if (!item || json_array_append_new((json_t *)s->output_, item))
            s->ev.oom = true;
    }
    json_decref(calls);
    return ev_result(s);
}

/* Closes the output and returns the final object (new reference) for finish. */
static json_t *finish_obj(sh_openai_resp *s, sh_openai_finish finish, const sh_openai_usage *u,
                          const char **event)
{
    bool cut = finish == SH_OPENAI_FINISH_LENGTH || finish == SH_OPENAI_FINISH_TIMEOUT;
    /* A response without calls always has its message, empty or not. */
    if (!s->msg_open && n_output(s) == 0)
        open_message(s);
    close_message(s, cut ? "incomplete" : "completed");
    json_t *inc =
        cut ? json_pack("{s:s}", "reason",
                        finish == SH_OPENAI_FINISH_LENGTH ? "max_output_tokens" : "timeout")
            : NULL;
    *event = cut ? "response.incomplete" : "response.completed";
    return response_obj(s, cut ? "incomplete" : "completed", NULL, inc, u);
}

const char *sh_openai_resp_end(sh_openai_resp *s, sh_openai_finish finish,
                               const sh_openai_usage *usage)
{
    ev_reset(s);
    const char *event;
    json_t *o = finish_obj(s, finish, usage, &event);
    emit(s, json_pack("{s:s, s:o}", "type", event, "response", o));
    return ev_result(s);
}

const char *sh_openai_resp_fail(sh_openai_resp *s, const sh_openai_error *e)
{
    ev_reset(s);
    emit(s, json_pack("{s:s, s:o, s:s, s:o}", "type", "error", "code",
                      e->code ? json_string(e->code) : json_null(), "message", e->message, "param",
                      e->param[0] ? json_string(e->param) : json_null()));
    const char *code = e->status == 429 ? "rate_limit_exceeded" : "server_error";
    json_t *err = json_pack("{s:s, s:s}", "code", code, "message", e->message);
    emit(s, json_pack("{s:s, s:o}", "type", "response.failed", "response",
                      response_obj(s, "failed", err, NULL, NULL)));
    return ev_result(s);
}

char *sh_openai_resp_json(sh_openai_resp *s, sh_openai_finish finish, const sh_openai_usage *usage)
{
    const char *event;
    json_t *o = finish_obj(s, finish, usage, &event);
    ev_reset(s);
    if (!o)
        return NULL;
    char *out = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    return out;
}
