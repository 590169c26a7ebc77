/* POST /v1/responses requests: the Responses body checked and rewritten as the chat request it
 * amounts to, parsed by sh_openai_request_parse, with errors renamed to the Responses fields. */
#include "net/openai_responses.h"

#include <ctype.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_METADATA 16 /* OpenAI's limits on metadata */
#define MAX_META_KEY 64
#define MAX_META_VALUE 512

static bool bad(sh_openai_error *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool bad(sh_openai_error *err, const char *param, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sh_openai_error_set(err, 400, NULL, param, "%s", msg);
    return false;
}

static bool refuse(sh_openai_error *err, const char *param, const char *why)
{
    sh_openai_error_set(err, 400, "unsupported_parameter", param, "'%s' is not supported: %s",
                        param, why);
    return false;
}

static bool oom(sh_openai_error *err)
{
    sh_openai_error_set(err, 500, NULL, NULL, "out of memory");
    return false;
}

/* Fields of the Responses API that need what a stateless server has not, or that Shoal does not
 * implement: any value but the neutral one is a 400 naming the field. */
typedef enum { NEUTRAL_NULL, NEUTRAL_FALSE, NEUTRAL_EMPTY, NEUTRAL_ZERO, NEUTRAL_DISABLED } neutral;
static const struct {
    const char *name;
    neutral neutral;
    const char *why;
} k_refused[] = {
    {"previous_response_id", NEUTRAL_NULL,
     "this server is stateless and keeps no responses; send the whole conversation in 'input'"},
    {"conversation", NEUTRAL_NULL,
     "this server is stateless and keeps no conversations; send the whole conversation in "
     "'input'"},
    {"store", NEUTRAL_FALSE,
     "this server keeps no responses ('store': false, or leave it out; nothing is stored)"},
    {"background", NEUTRAL_FALSE, "background responses need stored state"},
    {"include", NEUTRAL_EMPTY, "no additional output data is available"},
    {"prompt", NEUTRAL_NULL, "stored prompt templates are not available"},
    {"reasoning", NEUTRAL_NULL, "no reasoning options are implemented"},
    {"truncation", NEUTRAL_DISABLED,
     "the input is never truncated; a request that does not fit is refused"},
    {"top_logprobs", NEUTRAL_ZERO, "log-probabilities are not reported on /v1/responses"},
    /* /v1/chat/completions' names, which mean something else here or nothing */
    {"messages", NEUTRAL_NULL, "use 'input' on /v1/responses"},
    {"max_tokens", NEUTRAL_NULL, "use 'max_output_tokens' on /v1/responses"},
    {"max_completion_tokens", NEUTRAL_NULL, "use 'max_output_tokens' on /v1/responses"},
    {"response_format", NEUTRAL_NULL, "use 'text.format' on /v1/responses"},
    {"logprobs", NEUTRAL_FALSE, "log-probabilities are not reported on /v1/responses"},
    {"functions", NEUTRAL_NULL, "use 'tools' on /v1/responses"},
    {"function_call", NEUTRAL_NULL, "use 'tool_choice' on /v1/responses"},
    {"n", NEUTRAL_NULL, "a response has one output"},
    {"echo", NEUTRAL_FALSE, "'echo' is a /v1/completions field"},
};

/* Accepted and dropped: they change nothing here. */
static const char *const k_dropped[] = {"service_tier",   "prompt_cache_key", "safety_identifier",
                                        "max_tool_calls", "stream_options",   "metadata"};

static bool is_neutral(json_t *j, neutral k)
{
    if (json_is_null(j))
        return true;
    switch (k) {
    case NEUTRAL_NULL:
        /* an object whose members are all null asks for nothing (reasoning: {"effort": null}) */
        if (json_is_object(j)) {
            const char *key;
            json_t *v;
            json_object_foreach(j, key, v) if (!json_is_null(v)) return false;
            return true;
        }
        return false;
    case NEUTRAL_FALSE:
        return json_is_false(j);
    case NEUTRAL_EMPTY:
        return json_is_array(j) && json_array_size(j) == 0;
    case NEUTRAL_ZERO:
        return json_is_integer(j) && json_integer_value(j) == 0;
    case NEUTRAL_DISABLED:
        return json_is_string(j) && strcmp(json_string_value(j), "disabled") == 0;
    }
    return false;
}

/* A parse: the input JSON, the chat request being built and where each chat message came from. */
typedef struct conv {
    json_t *in, *chat, *msgs, *echo;
    int32_t *src; /* chat message i came from input[src[i]]; -1: instructions */
    size_t n_src, cap_src;
    sh_openai_error *err;
} conv;

static bool add_msg(conv *c, json_t *msg, int32_t src)
{
    if (!msg)
        return oom(c->err);
    if (c->n_src == c->cap_src) {
        size_t cap = c->cap_src ? c->cap_src * 2 : 16;
        int32_t *p = realloc(c->src, cap * sizeof *p);
        if (!p) {
            json_decref(msg);
            return oom(c->err);
        }
        c->src = p;
        c->cap_src = cap;
    }
    if (json_array_append_new(c->msgs, msg))
        return oom(c->err);
    c->src[c->n_src++] = src;
    return true;
}

static const char *type_of(json_t *item)
{
    json_t *t = json_object_get(item, "type");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

/* A message's content: a string, or text parts (input_text, output_text) as chat text parts. */
static json_t *content_of(conv *c, json_t *content, const char *param)
{
    if (json_is_string(content))
        return json_incref(content);
    char p[96];
    if (!json_is_array(content)) {
        bad(c->err, param, "'%s' must be a string or a list of input_text parts", param);
        return NULL;
    }
    json_t *parts = json_array();
    size_t k;
    json_t *part;
    json_array_foreach(content, k, part)
    {
        snprintf(p, sizeof p, "%s[%zu]", param, k);
        const char *t = type_of(part);
        json_t *text = json_object_get(part, "text");
        if (t &&
            (!strcmp(t, "input_image") || !strcmp(t, "input_file") || !strcmp(t, "input_audio"))) {
            sh_openai_error_set(c->err, 400, "unsupported_parameter", p,
                                "'%s' is a %s part: this server takes text only (input_text)", p,
                                t);
            json_decref(parts);
            return NULL;
        }
        if (!t || (strcmp(t, "input_text") && strcmp(t, "output_text")) || !json_is_string(text)) {
            bad(c->err, p, "'%s' must be {\"type\": \"input_text\", \"text\": string}", p);
            json_decref(parts);
            return NULL;
        }
        json_array_append_new(parts, json_pack("{s:s, s:O}", "type", "text", "text", text));
    }
    return parts;
}

static bool item_message(conv *c, json_t *item, int32_t i, const char *param)
{
    char p[64];
    snprintf(p, sizeof p, "%s.role", param);
    json_t *rj = json_object_get(item, "role");
    const char *role = json_is_string(rj) ? json_string_value(rj) : "";
    if (strcmp(role, "user") && strcmp(role, "system") && strcmp(role, "developer") &&
        strcmp(role, "assistant"))
        return bad(c->err, p, "'%s' must be one of user, system, developer, assistant", p);
    snprintf(p, sizeof p, "%s.content", param);
    json_t *content = content_of(c, json_object_get(item, "content"), p);
    if (!content)
        return false;
    return add_msg(c, json_pack("{s:s, s:o}", "role", role, "content", content), i);
}

static bool string_field(conv *c, json_t *item, const char *name, const char *param, json_t **v)
{
    char p[64];
    snprintf(p, sizeof p, "%s.%s", param, name);
    *v = json_object_get(item, name);
    if (!json_is_string(*v))
        return bad(c->err, p, "'%s' is required (a string)", p);
    return true;
}

/* An assistant's call: joins the assistant message just before it, or starts one. */
static bool item_call(conv *c, json_t *item, int32_t i, const char *param)
{
    json_t *id, *name, *args;
    if (!string_field(c, item, "call_id", param, &id) ||
        !string_field(c, item, "name", param, &name) ||
        !string_field(c, item, "arguments", param, &args))
        return false;
    /* chat checks the name too, but would name the assistant message this call joins */
    const char *nm = json_string_value(name);
    size_t nl = strlen(nm), k = 0;
    while (k < nl && (isalnum((unsigned char)nm[k]) || nm[k] == '_' || nm[k] == '-'))
        k++;
    if (nl == 0 || nl > 64 || k < nl) {
        char p[64];
        snprintf(p, sizeof p, "%s.name", param);
        return bad(c->err, p, "'%s' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -", p);
    }
    json_t *call = json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", id, "type", "function", "function",
                             "name", name, "arguments", args);
    if (!call)
        return oom(c->err);
    size_t n = json_array_size(c->msgs);
    json_t *last = n ? json_array_get(c->msgs, n - 1) : NULL;
    const char *role = json_string_value(json_object_get(last, "role"));
    if (last && role && !strcmp(role, "assistant")) {
        json_t *calls = json_object_get(last, "tool_calls");
        if (!calls) {
            calls = json_array();
            json_object_set_new(last, "tool_calls", calls);
        }
        if (!calls || json_array_append_new(calls, call))
            return oom(c->err);
        return true;
    }
    return add_msg(
        c, json_pack("{s:s, s:n, s:[o]}", "role", "assistant", "content", "tool_calls", call), i);
}

/* A call's result: a tool message. The output is a string or input_text parts. */
static bool item_output(conv *c, json_t *item, int32_t i, const char *param)
{
    json_t *id;
    if (!string_field(c, item, "call_id", param, &id))
        return false;
    char p[64];
    snprintf(p, sizeof p, "%s.output", param);
    json_t *content = content_of(c, json_object_get(item, "output"), p);
    if (!content)
        return false;
    return add_msg(
        c, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", id, "content", content), i);
}

static bool parse_input(conv *c)
{
    json_t *ins = json_object_get(c->in, "instructions");
    if (ins && !json_is_null(ins)) {
        if (!json_is_string(ins))
            return bad(c->err, "instructions", "'%s' must be a string", "instructions");
        if (!add_msg(c, json_pack("{s:s, s:O}", "role", "system", "content", ins), -1))
            return false;
    }
    json_t *input = json_object_get(c->in, "input");
    if (json_is_string(input))
        return add_msg(c, json_pack("{s:s, s:O}", "role", "user", "content", input), 0);
    if (!json_is_array(input) || json_array_size(input) == 0)
        return bad(c->err, "input", "'%s' is required: a string or a non-empty list of input items",
                   "input");
    size_t i;
    json_t *item;
    char param[32];
    json_array_foreach(input, i, item)
    {
        snprintf(param, sizeof param, "input[%zu]", i);
        if (!json_is_object(item))
            return bad(c->err, param, "'%s' must be an input item (an object)", param);
        const char *t = type_of(item);
        bool ok;
        if (!t || !strcmp(t, "message"))
            ok = item_message(c, item, (int32_t)i, param);
        else if (!strcmp(t, "function_call"))
            ok = item_call(c, item, (int32_t)i, param);
        else if (!strcmp(t, "function_call_output"))
            ok = item_output(c, item, (int32_t)i, param);
        else {
            char p[64];
            snprintf(p, sizeof p, "%s.type", param);
            sh_openai_error_set(c->err, 400, "unsupported_parameter", p,
                                "input item type '%.64s' is not supported (message, "
                                "function_call and function_call_output are)",
                                t);
            ok = false;
        }
        if (!ok)
            return false;
    }
    return true;
}

/* Function tools, flat in the Responses form, become chat's {"type", "function": {...}}. */
static bool parse_tools(conv *c)
{
    json_t *tools = json_object_get(c->in, "tools");
    if (!tools || json_is_null(tools)) {
        json_object_set_new(c->echo, "tools", json_array());
        return true;
    }
    if (!json_is_array(tools))
        return bad(c->err, "tools", "'%s' must be a list of function tools", "tools");
    json_t *out = json_array();
    if (!out || json_object_set_new(c->chat, "tools", out))
        return oom(c->err);
    size_t i;
    json_t *t;
    char param[64];
    json_array_foreach(tools, i, t)
    {
        snprintf(param, sizeof param, "tools[%zu]", i);
        const char *type = json_is_object(t) ? type_of(t) : NULL;
        if (!type)
            return bad(c->err, param, "'%s' must be {\"type\": \"function\", \"name\", ...}",
                       param);
        if (strcmp(type, "function")) {
            snprintf(param, sizeof param, "tools[%zu].type", i);
            sh_openai_error_set(c->err, 400, "unsupported_parameter", param,
                                "tool type '%.64s' is not supported: this server runs no "
                                "built-in tools, only function tools",
                                type);
            return false;
        }
        if (json_object_get(t, "function"))
            return bad(c->err, param,
                       "'%s' is a chat-style tool: on /v1/responses a function tool is flat "
                       "({\"type\": \"function\", \"name\", \"parameters\", ...})",
                       param);
        json_t *fn = json_object();
        const char *key;
        json_t *v;
        json_object_foreach(t, key, v) if (strcmp(key, "type")) json_object_set(fn, key, v);
        if (json_array_append_new(out, json_pack("{s:s, s:o}", "type", "function", "function", fn)))
            return oom(c->err);
    }
    json_object_set(c->echo, "tools", tools);
    return true;
}

static bool parse_tool_choice(conv *c)
{
    json_t *tc = json_object_get(c->in, "tool_choice");
    static const char form[] = "'%s' must be \"auto\", \"none\", \"required\" or {\"type\": "
                               "\"function\", \"name\": ...}";
    if (!tc || json_is_null(tc)) {
        json_object_set_new(c->echo, "tool_choice", json_string("auto"));
        return true;
    }
    json_object_set(c->echo, "tool_choice", tc);
    if (json_is_string(tc)) {
        json_object_set(c->chat, "tool_choice", tc); /* chat checks the word */
        return true;
    }
    const char *type = json_is_object(tc) ? type_of(tc) : NULL;
    if (!type)
        return bad(c->err, "tool_choice", form, "tool_choice");
    if (strcmp(type, "function")) {
        sh_openai_error_set(c->err, 400, "unsupported_parameter", "tool_choice",
                            "tool_choice type '%.64s' is not supported: only function tools "
                            "are (\"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                            "\"name\": ...})",
                            type);
        return false;
    }
    json_t *name = json_object_get(tc, "name");
    if (!json_is_string(name))
        return bad(c->err, "tool_choice", form, "tool_choice");
    json_object_set_new(c->chat, "tool_choice",
                        json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name));
    return true;
}

/* text.format is chat's response_format, flat: {"type": "json_schema", "name", "schema"}. */
static bool parse_text(conv *c)
{
    json_t *text = json_object_get(c->in, "text");
    json_t *fmt = json_is_object(text) ? json_object_get(text, "format") : NULL;
    if (text && !json_is_null(text) && !json_is_object(text))
        return bad(c->err, "text", "'%s' must be an object {\"format\": {...}}", "text");
    if (!fmt || json_is_null(fmt)) {
        json_object_set_new(c->echo, "text", json_pack("{s:{s:s}}", "format", "type", "text"));
        return true;
    }
    json_object_set_new(c->echo, "text", json_pack("{s:O}", "format", fmt));
    const char *type = json_is_object(fmt) ? type_of(fmt) : NULL;
    if (!type)
        return bad(c->err, "text.format",
                   "'%s' must be {\"type\": \"text\" | \"json_object\" | "
                   "\"json_schema\", ...}",
                   "text.format");
    json_t *rf;
    if (!strcmp(type, "json_schema")) {
        json_t *js = json_object();
        const char *key;
        json_t *v;
        json_object_foreach(fmt, key, v) if (strcmp(key, "type")) json_object_set(js, key, v);
        rf = json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js);
    } else {
        rf = json_deep_copy(fmt); /* text, json_object, or a type chat names in its 400 */
    }
    if (!rf || json_object_set_new(c->chat, "response_format", rf))
        return oom(c->err);
    return true;
}

static bool parse_metadata(conv *c)
{
    json_t *md = json_object_get(c->in, "metadata");
    if (!md || json_is_null(md)) {
        json_object_set_new(c->echo, "metadata", json_object());
        return true;
    }
    if (!json_is_object(md) || json_object_size(md) > MAX_METADATA)
        return bad(c->err, "metadata", "'%s' must be an object of at most 16 string values",
                   "metadata");
    const char *key;
    json_t *v;
    json_object_foreach(md, key, v)
    {
        if (strlen(key) > MAX_META_KEY || !json_is_string(v) ||
            json_string_length(v) > MAX_META_VALUE)
            return bad(c->err, "metadata",
                       "'%s' takes keys of at most 64 characters and string values of at most "
                       "512",
                       "metadata");
    }
    json_object_set(c->echo, "metadata", md);
    return true;
}

static bool is_handled(const char *key)
{
    static const char *const mine[] = {"input", "instructions", "max_output_tokens",
                                       "tools", "tool_choice",  "text"};
    for (size_t i = 0; i < sizeof mine / sizeof mine[0]; i++)
        if (!strcmp(key, mine[i]))
            return true;
    for (size_t i = 0; i < sizeof k_dropped / sizeof k_dropped[0]; i++)
        if (!strcmp(key, k_dropped[i]))
            return true;
    for (size_t i = 0; i < sizeof k_refused / sizeof k_refused[0]; i++)
        if (!strcmp(key, k_refused[i].name))
            return true;
    return false;
}

/* Everything but the input: refusals, then the fields chat takes as they are (model,
 * temperature, top_p, stream, parallel_tool_calls, user, the sampling extensions). */
static bool parse_fields(conv *c)
{
    for (size_t i = 0; i < sizeof k_refused / sizeof k_refused[0]; i++) {
        json_t *j = json_object_get(c->in, k_refused[i].name);
        bool n1 =
            !strcmp(k_refused[i].name, "n") && json_is_integer(j) && json_integer_value(j) == 1;
        if (j && !n1 && !is_neutral(j, k_refused[i].neutral))
            return refuse(c->err, k_refused[i].name, k_refused[i].why);
    }
    const char *key;
    json_t *v;
    json_object_foreach(c->in, key, v) if (!is_handled(key)) json_object_set(c->chat, key, v);
    json_t *mot = json_object_get(c->in, "max_output_tokens");
    if (mot)
        json_object_set(c->chat, "max_completion_tokens", mot);
    json_object_set_new(c->echo, "max_output_tokens", mot ? json_incref(mot) : json_null());
    json_t *ins = json_object_get(c->in, "instructions");
    json_object_set_new(c->echo, "instructions", ins ? json_incref(ins) : json_null());
    json_t *user = json_object_get(c->in, "user");
    if (json_is_string(user))
        json_object_set(c->echo, "user", user);
    return parse_metadata(c) && parse_tools(c) && parse_tool_choice(c) && parse_text(c);
}

/* Replaces the first `from` in s (cap bytes) with `to`, when it fits. */
static void replace(char *s, size_t cap, const char *from, const char *to)
{
    char *p = strstr(s, from);
    size_t fl = strlen(from), tl = strlen(to), sl = strlen(s);
    if (!p || sl - fl + tl + 1 > cap)
        return;
    memmove(p + tl, p + fl, sl - (size_t)(p - s) - fl + 1);
    memcpy(p, to, tl);
}

/* Chat's error, renamed to the Responses field it came from, in param and in the message. */
static void rename_error(const conv *c, sh_openai_error *err)
{
    static const struct {
        const char *chat, *resp; /* prefixes */
    } names[] = {
        {"response_format.json_schema", "text.format"},
        {"response_format", "text.format"},
        {"max_completion_tokens", "max_output_tokens"},
    };
    char old[64], now[64];
    snprintf(old, sizeof old, "%s", err->param);
    snprintf(now, sizeof now, "%s", err->param);
    int j = -1;
    const char *rest = NULL;
    if (sscanf(old, "messages[%d]", &j) == 1 && j >= 0 && (size_t)j < c->n_src) {
        if (c->src[j] < 0)
            snprintf(now, sizeof now, "instructions");
        else
            snprintf(now, sizeof now, "input[%d]", (int)c->src[j]);
    } else if (!strcmp(old, "messages")) {
        snprintf(now, sizeof now, "input");
    } else if (!strncmp(old, "tools[", 6) && (rest = strstr(old, "].function"))) {
        snprintf(now, sizeof now, "%.*s]%s", (int)(rest - old), old, rest + 10);
    } else {
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            size_t n = strlen(names[i].chat);
            if (!strncmp(old, names[i].chat, n)) {
                snprintf(now, sizeof now, "%s%s", names[i].resp, old + n);
                break;
            }
        }
    }
    if (old[0] && strcmp(old, now)) {
        snprintf(err->param, sizeof err->param, "%s", now);
        replace(err->message, sizeof err->message, old, now);
    }
    replace(err->message, sizeof err->message, "'response_format'", "'text.format'");
    replace(err->message, sizeof err->message, "'max_completion_tokens'", "'max_output_tokens'");
}

/* A float as the decimal it was written as (0.95f is 0.949999988 as a double). */
static double float_value(float f)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%.7g", (double)f);
    return strtod(buf, NULL);
}

sh_err sh_openai_responses_parse(const char *body, size_t len, const sh_openai_limits *limits,
                                 sh_openai_request **out, sh_openai_error *err)
{
    *out = NULL;
    json_error_t je;
    json_t *in = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!in) {
        sh_openai_error_set(err, 400, NULL, NULL,
                            "We could not parse the JSON body of your request: %.150s "
                            "(line %d, column %d)",
                            je.text, je.line, je.column);
        return SH_EINVAL;
    }
    conv c = {.in = in, .err = err};
    bool ok = false;
    char *chat_body = NULL;
    if (!json_is_object(in)) {
        sh_openai_error_set(err, 400, NULL, NULL, "the request body must be a JSON object");
        goto out;
    }
    c.chat = json_object();
    c.msgs = json_array();
    c.echo = json_object();
    if (!c.chat || !c.msgs || !c.echo || json_object_set(c.chat, "messages", c.msgs)) {
        oom(err);
        goto out;
    }
    if (!parse_input(&c) || !parse_fields(&c))
        goto out;
    chat_body = json_dumps(c.chat, JSON_COMPACT);
    if (!chat_body) {
        oom(err);
        goto out;
    }
    sh_openai_request *r = NULL;
    if (sh_openai_request_parse(SH_OPENAI_CHAT, chat_body, strlen(chat_body), limits, &r, err)) {
        rename_error(&c, err);
        goto out;
    }
    /* The values in force: a field left out shows the server's default. */
    json_object_set_new(c.echo, "temperature", json_real(float_value(r->temperature)));
    json_object_set_new(c.echo, "top_p", json_real(float_value(r->top_p)));
    json_object_set_new(c.echo, "parallel_tool_calls", json_boolean(r->parallel_tool_calls));
    r->resp_echo = json_dumps(c.echo, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!r->resp_echo) {
        sh_openai_request_free(r);
        oom(err);
        goto out;
    }
    *out = r;
    ok = true;
out:
    free(chat_body);
    free(c.src);
    json_decref(c.msgs);
    json_decref(c.chat);
    json_decref(c.echo);
    json_decref(in);
    if (ok)
        return SH_OK;
    return err->status == 500 ? SH_ENOMEM : SH_EINVAL;
}
