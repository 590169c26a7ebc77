/* Tool calls through the embedding API (include/shoal.h: sh_request_opts.messages_json, tools,
 * tool_choice): the request's chat fields are put together as a POST /v1/chat/completions body
 * and checked by the server's own parser (net/openai.h), rendered in the model family's tool
 * syntax and tokenized (net/openai_tools.h, model/chat.h); the generated text is split into
 * content and calls as it streams. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/engine_int.h"
#include "base/error.h"
#include "model/grammar.h"
#include "net/openai_tools.h"

struct sh_api_tools {
    sh_openai_toolstream ts;
    json_t *calls; /* the calls so far, as message.tool_calls holds them */
    char *calls_text;
};

bool sh__engine_tools_wanted(const sh_request_opts *r)
{
    return r->messages_json || r->tools || r->tool_choice || r->no_parallel_tool_calls;
}

/* The request's chat fields as one chat-completions body (malloc'd JSON text). */
static sh_err chat_body(const sh_request_opts *r, char **out, sh_error *e)
{
    json_error_t je;
    json_t *body = json_object(), *msgs = NULL;
    if (!body)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    sh_err rc = SH_OK;
    if (r->messages_json) {
        if (!(msgs = json_loads(r->messages_json, JSON_REJECT_DUPLICATES, &je)))
            rc = sh__error_set(e, SH_EINVAL,
                               "sh_submit: messages_json is not JSON (line %d, column %d: %s)",
                               je.line, je.column, je.text);
    } else if (!(msgs = json_array())) {
        rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    } else {
        for (int32_t i = 0; !rc && i < r->n_messages; i++) {
            // Roles and UTF-8 were checked by the caller (sh__engine_chat_msgs).
            json_t *m = json_pack("{s:s,s:s}", "role", r->messages[i].role, "content",
                                  r->messages[i].content);
            if (!m || json_array_append_new(msgs, m))
                rc = sh__error_set(e, SH_ENOMEM, "out of memory");
        }
    }
    if (!rc && json_object_set_new(body, "messages", msgs))
        rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    msgs = NULL;
    if (!rc && r->tools) {
        json_t *t = json_loads(r->tools, JSON_REJECT_DUPLICATES, &je);
        if (!t)
            rc =
                sh__error_set(e, SH_EINVAL, "sh_submit: tools is not JSON (line %d, column %d: %s)",
                              je.line, je.column, je.text);
        else if (json_object_set_new(body, "tools", t))
            rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    if (!rc && r->tool_choice) {
        const char *c = r->tool_choice;
        json_t *t = NULL;
        bool word = !strcmp(c, "auto") || !strcmp(c, "none") || !strcmp(c, "required");
        bool object = c[strspn(c, " \t\r\n")] == '{';
        if (word)
            t = json_string(c);
        else if (object)
            t = json_loads(c, JSON_REJECT_DUPLICATES, &je);
        if (!word && !object)
            rc = sh__error_set(e, SH_EINVAL,
                               "sh_submit: tool_choice must be \"auto\", \"none\", \"required\" "
                               "or {\"type\": \"function\", \"function\": {\"name\": ...}}");
        else if (!t && word)
            rc = sh__error_set(e, SH_ENOMEM, "out of memory");
        else if (!t)
            rc = sh__error_set(e, SH_EINVAL,
                               "sh_submit: tool_choice is not JSON (line %d, column %d: %s)",
                               je.line, je.column, je.text);
        else if (json_object_set_new(body, "tool_choice", t))
            rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    if (!rc && r->no_parallel_tool_calls &&
        json_object_set_new(body, "parallel_tool_calls", json_false()))
        rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    if (!rc && !(*out = json_dumps(body, JSON_COMPACT)))
        rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    json_decref(body);
    return rc;
}

/* The request checked as the server checks a chat completion (*q: free with
 * sh_openai_request_free). */
static sh_err chat_parse(sh_engine *eng, const sh_request_opts *r, sh_openai_request **q,
                         sh_error *e)
{
    char *body = NULL;
    sh_err rc = chat_body(r, &body, e);
    if (rc)
        return rc;
    const char *name = eng->name;
    sh_openai_limits lim = {.models = &name, .n_models = 1};
    sh_openai_error oe = {0};
    rc = sh_openai_request_parse(SH_OPENAI_CHAT, body, strlen(body), &lim, q, &oe);
    free(body);
    if (rc == SH_ENOMEM)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    if (rc)
        return sh__error_set(e, SH_EINVAL, "sh_submit: %s%s%s", oe.param, oe.param[0] ? ": " : "",
                             oe.message);
    return SH_OK;
}

sh_err sh__engine_tools_prompt(sh_engine *eng, const sh_request_opts *r, size_t max_ids,
                               int32_t **ids, size_t *n, char **gram, sh_api_tools **out,
                               sh_error *e)
{
    *out = NULL;
    if (!r->messages && !r->messages_json)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: tools and tool_choice need a chat (messages or "
                             "messages_json), not a prompt");
    if (r->embed)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: an embedding takes a prompt, not a chat with tools");
    if (!eng->has_template)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: %s has no chat template: give a prompt, not messages",
                             eng->name);
    if (r->messages) {
        sh_chat_msg *tmp = calloc((size_t)r->n_messages, sizeof *tmp);
        if (!tmp)
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        sh_err rc = sh__engine_chat_msgs(r->messages, r->n_messages, tmp, "sh_submit", e);
        free(tmp);
        if (rc)
            return rc;
    }
    sh_openai_request *q = NULL;
    sh_err rc = chat_parse(eng, r, &q, e);
    if (rc)
        return rc;
    sh_openai_tool_style style = sh__serve_tool_style(eng->chat);
    const char *sys = eng->has_system ? eng->system : NULL;
    sh_openai_chat_text ct = {0};
    sh_chat_msg *msgs = NULL;
    if (sh_openai_tools_render(q, style, sys, &ct) ||
        !(msgs = calloc((size_t)ct.n + 1, sizeof *msgs))) {
        rc = sh__error_set(e, SH_ENOMEM, "out of memory");
    } else {
        for (int32_t i = 0; i < ct.n; i++)
            msgs[i] = (sh_chat_msg){ct.msgs[i].role, ct.msgs[i].content};
        rc = sh_chat_tokenize(eng->tok, eng->chat, msgs, (size_t)ct.n, sys, true, max_ids, ids, n,
                              e);
    }
    free(msgs);
    sh_openai_chat_text_fini(&ct);
    // tool_choice "required" or a named function: the grammar that forces the call, unless
    // the request brought its own.
    if (!rc && !*gram) {
        sh_error ge = {0};
        sh_err grc = sh_openai_tools_grammar(q, style, gram, &ge);
        sh_grammar *g = NULL;
        if (!grc && *gram && strlen(*gram) > SH_PROTO_MAX_GRAMMAR)
            grc = sh__error_set(&ge, SH_EINVAL, "%zu bytes, at most %d", strlen(*gram),
                                SH_PROTO_MAX_GRAMMAR);
        else if (!grc && *gram)
            grc = sh_grammar_parse(*gram, strlen(*gram), &g, &ge);
        sh_grammar_free(g);
        if (grc)
            rc = sh__error_set(e, grc == SH_ENOMEM ? grc : SH_EINVAL,
                               "sh_submit: the grammar forcing tool_choice: %s", ge.msg);
    }
    if (!rc && sh_openai_tools_active(q)) {
        sh_api_tools *t = calloc(1, sizeof *t);
        if (!t || !(t->calls = json_array())) {
            free(t);
            rc = sh__error_set(e, SH_ENOMEM, "out of memory");
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            uint64_t seed =
                (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^ (uint64_t)(uintptr_t)t;
            sh_openai_toolstream_init(&t->ts, style, seed);
            *out = t;
        }
    }
    sh_openai_request_free(q);
    if (rc) { /* *n stays: a prompt past max_ids is reported by its length */
        free(*ids);
        *ids = NULL;
    }
    return rc;
}

sh_err sh__engine_tools_feed(sh_api_tools *t, const char *piece, size_t len, bool last,
                             const char **content)
{
    const char *deltas = NULL;
    *content = NULL;
    sh_err rc = sh_openai_toolstream_feed(&t->ts, piece, len, last, content, &deltas);
    if (rc || !deltas)
        return rc;
    json_t *d = json_loads(deltas, 0, NULL);
    size_t i;
    json_t *c;
    if (!d)
        return SH_ENOMEM;
    json_array_foreach(d, i, c)
    {
        // A delta item is the call with its stream index first; the call alone is kept.
        json_t *call = json_deep_copy(c);
        if (!call || json_object_del(call, "index") || json_array_append_new(t->calls, call)) {
            json_decref(d);
            return SH_ENOMEM;
        }
    }
    json_decref(d);
    return SH_OK;
}

const char *sh__engine_tools_calls(sh_api_tools *t)
{
    if (!json_array_size(t->calls))
        return NULL;
    if (!t->calls_text)
        t->calls_text = json_dumps(t->calls, JSON_COMPACT);
    return t->calls_text;
}

void sh__engine_tools_free(sh_api_tools *t)
{
    if (!t)
        return;
    sh_openai_toolstream_fini(&t->ts);
    json_decref(t->calls);
    free(t->calls_text);
    free(t);
}
