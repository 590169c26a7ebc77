/* OpenAI response objects, SSE chunks, /v1/models and /health bodies, built with jansson. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "net/openai.h"

size_t sh_openai_utf8_seq(const unsigned char *p, size_t left)
{
    size_t n = p[0] < 0x80             ? 1
               : (p[0] & 0xe0) == 0xc0 ? 2
               : (p[0] & 0xf0) == 0xe0 ? 3
               : (p[0] & 0xf8) == 0xf0 ? 4
                                       : 0;
    if (n == 0 || n > left || (n == 2 && p[0] < 0xc2))
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((n == 3 && p[0] == 0xe0 && p[1] < 0xa0) || (n == 3 && p[0] == 0xed && p[1] >= 0xa0) ||
        (n == 4 && p[0] == 0xf0 && p[1] < 0x90) || (n == 4 && p[0] > 0xf4) ||
        (n == 4 && p[0] == 0xf4 && p[1] >= 0x90))
        return 0;
    return n;
}

/* A JSON string of generated text. A token can end inside a UTF-8 character, which JSON cannot
 * carry: invalid bytes become U+FFFD, as OpenAI does. */
static json_t *text_json(const char *s)
{
    if (!s)
        s = "";
    json_t *j = json_string(s);
    if (j)
        return j;
    size_t n = strlen(s);
    char *w = malloc(3 * n + 1), *o = w;
    if (!w)
        return NULL;
    for (size_t i = 0; i < n;) {
        size_t k = sh_openai_utf8_seq((const unsigned char *)s + i, n - i);
        if (k) {
            memcpy(o, s + i, k);
            o += k;
            i += k;
        } else {
            /* One U+FFFD per maximal invalid subpart: a cut character is one replacement. */
            unsigned char c = (unsigned char)s[i];
            size_t want = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : 0;
            memcpy(o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
            while (want-- > 0 && i < n && ((unsigned char)s[i] & 0xc0) == 0x80)
                i++;
        }
    }
    j = json_stringn(w, (size_t)(o - w));
    free(w);
    return j;
}

void *sh__openai_text_json(const char *s) { return text_json(s); }

/* JSON has no infinities: OpenAI reports a token outside the candidates as -9999. */
static json_t *lp_value(float lp) { return json_real(isfinite(lp) ? (double)lp : -9999.0); }

/* The UTF-8 bytes of a token, as chat logprobs carry them. */
static json_t *bytes_of(const char *s)
{
    json_t *a = json_array();
    for (const unsigned char *p = (const unsigned char *)s; a && *p; p++)
        json_array_append_new(a, json_integer(*p));
    return a;
}

static const char *finish_text(sh_openai_finish f)
{
    return f == SH_OPENAI_FINISH_STOP         ? "stop"
           : f == SH_OPENAI_FINISH_LENGTH     ? "length"
           : f == SH_OPENAI_FINISH_TIMEOUT    ? "timeout"
           : f == SH_OPENAI_FINISH_TOOL_CALLS ? "tool_calls"
                                              : NULL;
}

static json_t *finish_json(sh_openai_finish f)
{
    const char *t = finish_text(f);
    return t ? json_string(t) : json_null();
}

/* Completions: {"tokens","token_logprobs","top_logprobs":[{tok: lp}],"text_offset"}. */
static json_t *logprobs_cmpl(const sh_openai_choice *c)
{
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (int32_t i = 0; i < c->n_logprobs; i++) {
        const sh_openai_logprob *l = &c->logprobs[i];
        json_array_append_new(toks, text_json(l->token));
        json_array_append_new(lps, lp_value(l->logprob));
        json_t *t = json_object();
        for (int32_t k = 0; k < l->n_top; k++) {
            json_t *key = text_json(l->top[k].token); /* keys must be valid UTF-8 too */
            json_object_set_new(t, key ? json_string_value(key) : "", lp_value(l->top[k].logprob));
            json_decref(key);
        }
        json_array_append_new(tops, t);
        json_array_append_new(offs, json_integer(l->text_offset));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs",
                     tops, "text_offset", offs);
}

/* Chat: {"content":[{"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}]}]}. */
static json_t *logprobs_chat(const sh_openai_choice *c)
{
    json_t *content = json_array();
    for (int32_t i = 0; i < c->n_logprobs; i++) {
        const sh_openai_logprob *l = &c->logprobs[i];
        json_t *tops = json_array();
        for (int32_t k = 0; k < l->n_top; k++) {
            const char *t = l->top[k].token ? l->top[k].token : "";
            json_array_append_new(tops,
                                  json_pack("{s:o, s:o, s:o}", "token", text_json(t), "logprob",
                                            lp_value(l->top[k].logprob), "bytes", bytes_of(t)));
        }
        const char *t = l->token ? l->token : "";
        json_array_append_new(content, json_pack("{s:o, s:o, s:o, s:o}", "token", text_json(t),
                                                 "logprob", lp_value(l->logprob), "bytes",
                                                 bytes_of(t), "top_logprobs", tops));
    }
    return json_pack("{s:o}", "content", content);
}

static json_t *logprobs_json(sh_openai_kind kind, const sh_openai_choice *c)
{
    if (!c->logprobs)
        return json_null();
    return kind == SH_OPENAI_CHAT ? logprobs_chat(c) : logprobs_cmpl(c);
}

static json_t *usage_json(const sh_openai_usage *u)
{
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", u->prompt_tokens,
                     "completion_tokens", u->completion_tokens, "total_tokens",
                     u->prompt_tokens + u->completion_tokens, "prompt_tokens_details",
                     "cached_tokens", u->cached_tokens);
}

static json_t *head_json(const sh_openai_meta *m, const char *object)
{
    json_t *h = json_pack("{s:s, s:s, s:I, s:s}", "id", m->id ? m->id : "", "object", object,
                          "created", (json_int_t)m->created, "model", m->model ? m->model : "");
    if (h && m->fingerprint)
        json_object_set_new(h, "system_fingerprint", json_string(m->fingerprint));
    return h;
}

/* Dumps and frees; NULL when root is NULL (an allocation failed while building). */
static char *dump(json_t *root, const char *prefix)
{
    if (!root)
        return NULL;
    char *s = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!s || !prefix)
        return s;
    size_t pl = strlen(prefix), sl = strlen(s);
    char *out = malloc(pl + sl + 3);
    if (out) {
        memcpy(out, prefix, pl);
        memcpy(out + pl, s, sl);
        memcpy(out + pl + sl, "\n\n", 3);
    }
    free(s);
    return out;
}

char *sh_openai_response_json(const sh_openai_meta *meta, const sh_openai_choice *choices,
                              int32_t n_choices, const sh_openai_usage *usage)
{
    bool chat = meta->kind == SH_OPENAI_CHAT;
    json_t *root = head_json(meta, chat ? "chat.completion" : "text_completion");
    json_t *arr = json_array();
    for (int32_t i = 0; i < n_choices; i++) {
        const sh_openai_choice *c = &choices[i];
        const char *text = c->text ? c->text : "";
        json_t *ch;
        if (chat && c->tool_calls)
            ch = json_pack("{s:i, s:{s:s, s:o, s:o}, s:o, s:o}", "index", c->index, "message",
                           "role", "assistant", "content",
                           c->text ? text_json(c->text) : json_null(), "tool_calls",
                           json_loads(c->tool_calls, 0, NULL), "logprobs",
                           logprobs_json(meta->kind, c), "finish_reason", finish_json(c->finish));
        else if (chat)
            ch = json_pack("{s:i, s:{s:s, s:o}, s:o, s:o}", "index", c->index, "message", "role",
                           "assistant", "content", text_json(text), "logprobs",
                           logprobs_json(meta->kind, c), "finish_reason", finish_json(c->finish));
        else
            ch = json_pack("{s:i, s:o, s:o, s:o}", "index", c->index, "text", text_json(text),
                           "logprobs", logprobs_json(meta->kind, c), "finish_reason",
                           finish_json(c->finish));
        if (!ch || json_array_append_new(arr, ch) != 0) {
            json_decref(arr);
            json_decref(root);
            return NULL;
        }
    }
    if (!root || json_object_set_new(root, "choices", arr) != 0) {
        json_decref(root);
        return NULL;
    }
    if (usage)
        json_object_set_new(root, "usage", usage_json(usage));
    return dump(root, NULL);
}

char *sh_openai_chunk_sse(const sh_openai_meta *meta, const sh_openai_choice *c, bool first,
                          bool with_usage)
{
    bool chat = meta->kind == SH_OPENAI_CHAT;
    json_t *root = head_json(meta, chat ? "chat.completion.chunk" : "text_completion");
    json_t *ch;
    if (chat) {
        json_t *delta = json_object();
        if (first) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", text_json(c->text));
        } else if (c->text) {
            json_object_set_new(delta, "content", text_json(c->text));
        }
        if (c->tool_calls)
            json_object_set_new(delta, "tool_calls", json_loads(c->tool_calls, 0, NULL));
        ch = json_pack("{s:i, s:o, s:o, s:o}", "index", c->index, "delta", delta, "logprobs",
                       logprobs_json(meta->kind, c), "finish_reason", finish_json(c->finish));
    } else {
        ch = json_pack("{s:i, s:o, s:o, s:o}", "index", c->index, "text", text_json(c->text),
                       "logprobs", logprobs_json(meta->kind, c), "finish_reason",
                       finish_json(c->finish));
    }
    if (!root || !ch) {
        json_decref(root);
        json_decref(ch);
        return NULL;
    }
    json_object_set_new(root, "choices", json_pack("[o]", ch));
    if (with_usage)
        json_object_set_new(root, "usage", json_null());
    return dump(root, "data: ");
}

char *sh_openai_usage_sse(const sh_openai_meta *meta, const sh_openai_usage *usage)
{
    bool chat = meta->kind == SH_OPENAI_CHAT;
    json_t *root = head_json(meta, chat ? "chat.completion.chunk" : "text_completion");
    if (!root)
        return NULL;
    json_object_set_new(root, "choices", json_array());
    json_object_set_new(root, "usage", usage_json(usage));
    return dump(root, "data: ");
}

char *sh_openai_models_json(const char *const *models, int32_t n, int64_t created,
                            const char *owned_by)
{
    json_t *data = json_array();
    for (int32_t i = 0; data && i < n; i++)
        json_array_append_new(data, json_pack("{s:s, s:s, s:I, s:s}", "id", models[i], "object",
                                              "model", "created", (json_int_t)created, "owned_by",
                                              owned_by ? owned_by : "shoal"));
    if (!data)
        return NULL;
    return dump(json_pack("{s:s, s:o}", "object", "list", "data", data), NULL);
}

char *sh_openai_models_info_json(const sh_openai_model_info *models, int32_t n, int64_t created,
                                 const char *owned_by)
{
    json_t *data = json_array();
    for (int32_t i = 0; data && i < n; i++) {
        const sh_openai_model_info *m = &models[i];
        json_t *meta = json_object();
        if (meta && m->n_ctx_train > 0)
            json_object_set_new(meta, "n_ctx_train", json_integer(m->n_ctx_train));
        if (meta && m->n_vocab > 0)
            json_object_set_new(meta, "n_vocab", json_integer(m->n_vocab));
        json_t *caps = json_pack("[s,s]", "completion", "chat");
        if (caps && m->embeddings)
            json_array_append_new(caps, json_string("embeddings"));
        json_t *o =
            json_pack("{s:s, s:s, s:I, s:s, s:i, s:o, s:o}", "id", m->id, "object", "model",
                      "created", (json_int_t)created, "owned_by", owned_by ? owned_by : "shoal",
                      "max_model_len", m->max_model_len, "capabilities", caps, "meta", meta);
        if (!o || json_array_append_new(data, o)) {
            json_decref(data);
            return NULL;
        }
    }
    if (!data)
        return NULL;
    return dump(json_pack("{s:s, s:o}", "object", "list", "data", data), NULL);
}

char *sh_openai_health_json(const char *status, const char *extra_json)
{
    json_t *root = NULL;
    if (extra_json && *extra_json) {
        /* Parse "{extra}" so a malformed extra can never produce a malformed body. */
        size_t n = strlen(extra_json);
        char *wrapped = malloc(n + 3);
        if (!wrapped)
            return NULL;
        wrapped[0] = '{';
        memcpy(wrapped + 1, extra_json, n);
        memcpy(wrapped + 1 + n, "}", 2);
        root = json_loads(wrapped, 0, NULL);
        free(wrapped);
        if (!json_is_object(root)) {
            json_decref(root);
            return NULL;
        }
    } else {
        root = json_object();
    }
    if (!root)
        return NULL;
    json_t *st = json_string(status ? status : "ok");
    json_t *obj = json_object();
    json_object_set_new(obj, "status", st);
    json_object_update(obj, root);
    json_decref(root);
    return dump(obj, NULL);
}
