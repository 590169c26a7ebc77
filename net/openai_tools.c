/* OpenAI tool calls: request fields, rendering into the prompt, parsing the output back. */
#include "net/openai_tools.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/json_schema.h"
#include "net/strbuf.h"

#define MAX_TOOLS 128 /* tools in one request (OpenAI's limit) */

const char *sh_openai_tool_style_name(sh_openai_tool_style s)
{
    switch (s) {
    case SH_OPENAI_TOOLS_HERMES:
        return "hermes";
    case SH_OPENAI_TOOLS_LLAMA3:
        return "llama3";
    case SH_OPENAI_TOOLS_MISTRAL:
        return "mistral";
    case SH_OPENAI_TOOLS_GENERIC:
        break;
    }
    return "generic";
}

bool sh_openai_tools_active(const sh_openai_request *r)
{
    return r->n_tools > 0 && r->tool_choice != SH_OPENAI_TOOL_CHOICE_NONE;
}

/* ---- request fields ------------------------------------------------------------------------ */

/* OpenAI's function names: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'. They are written unescaped
 * into prompts and grammar literals, so the check matters. */
static bool name_ok(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static bool bad(sh_openai_error *err, const char *param, const char *what)
{
    sh_openai_error_set(err, 400, NULL, param, "'%s' %s", param, what);
    return false;
}

bool sh__openai_tools_check_message(const void *msgv, size_t i, const char *role,
                                    sh_openai_error *err)
{
    json_t *msg = (json_t *)msgv;
    char param[64];
    json_t *calls = json_object_get(msg, "tool_calls");
    if (calls && !json_is_null(calls)) {
        snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
        if (strcmp(role, "assistant") != 0)
            return bad(err, param, "is only allowed in assistant messages");
        if (!json_is_array(calls))
            return bad(err, param, "must be an array");
        size_t k;
        json_t *c;
        json_array_foreach(calls, k, c)
        {
            snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", i, k);
            json_t *type = json_object_get(c, "type");
            json_t *fn = json_object_get(c, "function");
            if (!json_is_object(c) || !json_is_string(json_object_get(c, "id")) ||
                (type &&
                 !(json_is_string(type) && strcmp(json_string_value(type), "function") == 0)) ||
                !json_is_object(fn))
                return bad(err, param,
                           "must be {\"id\": string, \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}");
            snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu].function", i, k);
            if (!name_ok(json_string_value(json_object_get(fn, "name"))) ||
                !json_is_string(json_object_get(fn, "arguments")))
                return bad(err, param,
                           "must hold a valid \"name\" and \"arguments\" as a JSON string");
        }
    }
    if (strcmp(role, "tool") == 0) {
        snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
        json_t *id = json_object_get(msg, "tool_call_id");
        if (!json_is_string(id))
            return bad(err, param, "is required in a tool message (a string)");
    }
    return true;
}

static bool parse_tools(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    json_t *tools = json_object_get(o, "tools");
    if (!tools || json_is_null(tools))
        return true;
    if (!json_is_array(tools))
        return bad(err, "tools", "must be an array of tools");
    if (r->kind != SH_OPENAI_CHAT)
        return bad(err, "tools", "is only supported on /v1/chat/completions");
    size_t n = json_array_size(tools);
    if (n > MAX_TOOLS) {
        sh_openai_error_set(err, 400, NULL, "tools", "'tools' takes at most %d tools, got %zu",
                            MAX_TOOLS, n);
        return false;
    }
    char param[64];
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        snprintf(param, sizeof param, "tools[%zu]", i);
        json_t *type = json_object_get(t, "type");
        if (!json_is_object(t) || !json_is_string(type) ||
            strcmp(json_string_value(type), "function") != 0)
            return bad(err, param, "must be {\"type\": \"function\", \"function\": {...}}");
        json_t *fn = json_object_get(t, "function");
        snprintf(param, sizeof param, "tools[%zu].function", i);
        if (!json_is_object(fn))
            return bad(err, param, "must be an object");
        const char *name = json_string_value(json_object_get(fn, "name"));
        snprintf(param, sizeof param, "tools[%zu].function.name", i);
        if (!name_ok(name))
            return bad(err, param, "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -");
        for (size_t k = 0; k < i; k++) {
            json_t *prev = json_object_get(json_array_get(tools, k), "function");
            if (strcmp(json_string_value(json_object_get(prev, "name")), name) == 0) {
                sh_openai_error_set(err, 400, NULL, param, "tool name '%s' is given twice", name);
                return false;
            }
        }
        json_t *desc = json_object_get(fn, "description");
        snprintf(param, sizeof param, "tools[%zu].function.description", i);
        if (desc && !json_is_string(desc) && !json_is_null(desc))
            return bad(err, param, "must be a string");
        json_t *strict = json_object_get(fn, "strict");
        snprintf(param, sizeof param, "tools[%zu].function.strict", i);
        if (strict && !json_is_boolean(strict) && !json_is_null(strict))
            return bad(err, param, "must be a boolean");
        json_t *params = json_object_get(fn, "parameters");
        snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
        if (params && !json_is_null(params)) {
            if (!json_is_object(params)) {
                sh_openai_error_set(err, 400, NULL, param,
                                    "tool '%s': 'parameters' must be a JSON schema object", name);
                return false;
            }
            char *g = NULL;
            sh_error e = {0};
            sh_json_schema_opts so = {.strict = true};
            sh_err rc = sh_json_schema_to_gbnf(params, &so, &g, &e);
            free(g);
            if (rc == SH_ENOMEM)
                return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
            if (rc) {
                sh_openai_error_set(
                    err, 400, NULL, param,
                    "tool '%s': 'parameters' is not a supported JSON schema: %.150s", name, e.msg);
                return false;
            }
        }
    }
    r->tools = n ? tools : NULL;
    r->n_tools = (int32_t)n;
    return true;
}

static bool parse_choice(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    json_t *c = json_object_get(o, "tool_choice");
    r->tool_named = -1;
    r->tool_choice = r->n_tools ? SH_OPENAI_TOOL_CHOICE_AUTO : SH_OPENAI_TOOL_CHOICE_NONE;
    if (!c || json_is_null(c))
        return true;
    if (json_is_string(c)) {
        const char *s = json_string_value(c);
        if (strcmp(s, "none") == 0) {
            r->tool_choice = SH_OPENAI_TOOL_CHOICE_NONE;
            return true;
        }
        if (strcmp(s, "auto") && strcmp(s, "required"))
            return bad(err, "tool_choice",
                       "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}");
        if (!r->n_tools)
            return bad(err, "tool_choice", "needs 'tools'");
        r->tool_choice = s[0] == 'a' ? SH_OPENAI_TOOL_CHOICE_AUTO : SH_OPENAI_TOOL_CHOICE_REQUIRED;
        return true;
    }
    json_t *type = json_object_get(c, "type");
    json_t *fn = json_object_get(c, "function");
    const char *name = json_string_value(json_object_get(fn, "name"));
    if (!json_is_object(c) || !json_is_string(type) ||
        strcmp(json_string_value(type), "function") != 0 || !name)
        return bad(err, "tool_choice",
                   "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}");
    if (!r->n_tools)
        return bad(err, "tool_choice", "needs 'tools'");
    for (int32_t i = 0; i < r->n_tools; i++) {
        json_t *f = json_object_get(json_array_get((json_t *)r->tools, (size_t)i), "function");
        if (strcmp(json_string_value(json_object_get(f, "name")), name) == 0) {
            r->tool_choice = SH_OPENAI_TOOL_CHOICE_NAMED;
            r->tool_named = i;
            return true;
        }
    }
    sh_openai_error_set(err, 400, NULL, "tool_choice",
                        "'tool_choice' names function '%.64s', which is not in 'tools'", name);
    return false;
}

bool sh__openai_tools_parse_request(const void *root, sh_openai_request *r, sh_openai_error *err)
{
    json_t *o = (json_t *)root;
    r->parallel_tool_calls = true;
    if (!parse_tools(o, r, err) || !parse_choice(o, r, err))
        return false;
    json_t *p = json_object_get(o, "parallel_tool_calls");
    if (p && !json_is_null(p)) {
        if (!json_is_boolean(p))
            return bad(err, "parallel_tool_calls", "must be a boolean");
        r->parallel_tool_calls = json_is_true(p);
    }
    if (r->grammar && (r->tool_choice == SH_OPENAI_TOOL_CHOICE_REQUIRED ||
                       r->tool_choice == SH_OPENAI_TOOL_CHOICE_NAMED))
        return bad(err, "tool_choice",
                   "cannot force a tool call together with 'grammar' or 'response_format'");
    return true;
}

/* Appends a JSON value in Python's json.dumps layout (", " and ": "), as the templates' tojson. */
static void sb_json(sh_strbuf *b, const json_t *v, size_t flags)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_PRESERVE_ORDER | flags);
    if (!s) {
        b->oom = true;
        return;
    }
    sh_strbuf_add(b, s);
    free(s);
}

/* Takes b's text (or "" when empty); NULL when out of memory. */
static char *sb_take(sh_strbuf *b)
{
    if (b->oom) {
        free(b->p);
        return NULL;
    }
    if (!b->p)
        return strdup("");
    return b->p;
}

/* ---- the prompt ---------------------------------------------------------------------------- */

static const char HERMES_HEAD[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char HERMES_TAIL[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call>";
static const char LLAMA3_HEAD[] =
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": "
    "function name, \"parameters\": dictionary of argument name and its value}.Do not use "
    "variables.\n\n";

/* A call's arguments as the prompt shows them: the JSON value the string holds, or the string
 * itself when it is not JSON. Returns a new reference (NULL: out of memory). */
static json_t *args_value(json_t *fn)
{
    const char *a = json_string_value(json_object_get(fn, "arguments"));
    json_t *v = json_loads(a ? a : "{}", JSON_DECODE_ANY, NULL);
    return v ? v : json_string(a ? a : "");
}

/* The tools block for the system message (hermes, generic). */
static void tools_hermes(sh_strbuf *b, const sh_openai_request *r)
{
    sh_strbuf_add(b, HERMES_HEAD);
    for (int32_t i = 0; i < r->n_tools; i++) {
        sh_strbuf_add(b, "\n");
        sb_json(b, json_array_get((json_t *)r->tools, (size_t)i), JSON_INDENT(0));
    }
    sh_strbuf_add(b, HERMES_TAIL);
}

/* An assistant message's content with its tool calls in style's syntax. */
static void assistant_calls(sh_strbuf *b, const sh_openai_message *m, sh_openai_tool_style style)
{
    json_t *calls = (json_t *)m->tool_calls;
    sh_strbuf_add(b, m->content);
    if (style == SH_OPENAI_TOOLS_MISTRAL) {
        json_t *arr = json_array();
        size_t k;
        json_t *c;
        json_array_foreach(calls, k, c)
        {
            json_t *fn = json_object_get(c, "function");
            json_array_append_new(arr, json_pack("{s:O, s:o, s:O}", "name",
                                                 json_object_get(fn, "name"), "arguments",
                                                 args_value(fn), "id", json_object_get(c, "id")));
        }
        sh_strbuf_add(b, "[TOOL_CALLS] ");
        sb_json(b, arr, JSON_INDENT(0));
        json_decref(arr);
        return;
    }
    size_t k;
    json_t *c;
    json_array_foreach(calls, k, c)
    {
        json_t *fn = json_object_get(c, "function");
        json_t *one =
            json_pack("{s:O, s:o}", "name", json_object_get(fn, "name"),
                      style == SH_OPENAI_TOOLS_LLAMA3 ? "parameters" : "arguments", args_value(fn));
        if (!one) {
            b->oom = true;
            return;
        }
        if (style == SH_OPENAI_TOOLS_LLAMA3) {
            if (k > 0 || m->content[0])
                sh_strbuf_add(b, "\n");
            sb_json(b, one, JSON_INDENT(0));
        } else {
            if (k > 0 || m->content[0])
                sh_strbuf_add(b, "\n");
            sh_strbuf_add(b, "<tool_call>\n");
            sb_json(b, one, JSON_INDENT(0));
            sh_strbuf_add(b, "\n</tool_call>");
        }
        json_decref(one);
    }
}

typedef struct render {
    sh_openai_chat_text *out;
} render;

/* Adds a message whose content is taken (malloc'd) or borrowed. */
static void add_msg(render *rd, const char *role, const char *content, char *owned)
{
    sh_openai_chat_text *t = rd->out;
    if (owned) {
        t->owned_[t->n_owned_++] = owned;
        content = owned;
    }
    t->msgs[t->n++] = (sh_openai_text_msg){role, content};
}

sh_err sh_openai_tools_render(const sh_openai_request *r, sh_openai_tool_style style,
                              const char *default_system, sh_openai_chat_text *out)
{
    memset(out, 0, sizeof *out);
    int32_t n = r->n_messages;
    out->msgs = calloc((size_t)n + 1, sizeof *out->msgs);
    out->owned_ = calloc((size_t)n + 1, sizeof *out->owned_);
    if (!out->msgs || !out->owned_) {
        sh_openai_chat_text_fini(out);
        return SH_ENOMEM;
    }
    render rd = {out};
    bool tools = sh_openai_tools_active(r);
    bool hermes = style == SH_OPENAI_TOOLS_HERMES || style == SH_OPENAI_TOOLS_GENERIC;
    int32_t last_user = -1, first_user = -1;
    for (int32_t i = 0; i < n; i++)
        if (r->messages[i].role == SH_OPENAI_USER) {
            last_user = i;
            if (first_user < 0)
                first_user = i;
        }
    int32_t i = 0;
    /* hermes and generic: the tools go in the system message (made when there is none). */
    if (tools && hermes) {
        sh_strbuf b = {0};
        bool has_sys = n > 0 && r->messages[0].role == SH_OPENAI_SYSTEM;
        const char *sys = has_sys ? r->messages[0].content : default_system;
        if (sys && sys[0]) {
            sh_strbuf_add(&b, sys);
            sh_strbuf_add(&b, "\n\n");
        }
        tools_hermes(&b, r);
        char *s = sb_take(&b);
        if (!s)
            goto oom;
        add_msg(&rd, "system", NULL, s);
        i = has_sys ? 1 : 0;
    }
    for (; i < n; i++) {
        const sh_openai_message *m = &r->messages[i];
        sh_strbuf b = {0};
        switch (m->role) {
        case SH_OPENAI_SYSTEM:
            add_msg(&rd, "system", m->content, NULL);
            break;
        case SH_OPENAI_USER:
            if (tools && style == SH_OPENAI_TOOLS_LLAMA3 && i == first_user) {
                sh_strbuf_add(&b, LLAMA3_HEAD);
                for (int32_t k = 0; k < r->n_tools; k++) {
                    sb_json(&b, json_array_get((json_t *)r->tools, (size_t)k), JSON_INDENT(4));
                    sh_strbuf_add(&b, "\n\n");
                }
                sh_strbuf_add(&b, m->content);
            } else if (tools && style == SH_OPENAI_TOOLS_MISTRAL && i == last_user) {
                sh_strbuf_add(&b, "[AVAILABLE_TOOLS] ");
                sb_json(&b, (json_t *)r->tools, JSON_INDENT(0));
                sh_strbuf_add(&b, "[/AVAILABLE_TOOLS]");
                sh_strbuf_add(&b, m->content);
            } else {
                add_msg(&rd, "user", m->content, NULL);
                break;
            }
            {
                char *s = sb_take(&b);
                if (!s)
                    goto oom;
                add_msg(&rd, "user", NULL, s);
            }
            break;
        case SH_OPENAI_ASSISTANT:
            if (!m->tool_calls) {
                add_msg(&rd, "assistant", m->content, NULL);
                break;
            }
            assistant_calls(&b, m, style);
            {
                char *s = sb_take(&b);
                if (!s)
                    goto oom;
                add_msg(&rd, "assistant", NULL, s);
            }
            break;
        case SH_OPENAI_TOOL:
            if (style == SH_OPENAI_TOOLS_LLAMA3) {
                add_msg(&rd, "ipython", m->content, NULL);
                break;
            }
            if (style == SH_OPENAI_TOOLS_MISTRAL) {
                json_t *o =
                    json_pack("{s:s, s:s}", "call_id", m->tool_call_id ? m->tool_call_id : "",
                              "content", m->content);
                sh_strbuf_add(&b, "[TOOL_RESULTS] ");
                if (o)
                    sb_json(&b, o, JSON_INDENT(0));
                else
                    b.oom = true;
                json_decref(o);
                sh_strbuf_add(&b, "[/TOOL_RESULTS]");
            } else {
                // Consecutive tool results share one user turn, as Qwen 2.5's template does.
                for (;;) {
                    sh_strbuf_add(&b, "<tool_response>\n");
                    sh_strbuf_add(&b, r->messages[i].content);
                    sh_strbuf_add(&b, "\n</tool_response>");
                    if (i + 1 >= n || r->messages[i + 1].role != SH_OPENAI_TOOL)
                        break;
                    sh_strbuf_add(&b, "\n");
                    i++;
                }
            }
            {
                char *s = sb_take(&b);
                if (!s)
                    goto oom;
                add_msg(&rd, "user", NULL, s);
            }
            break;
        }
    }
    return SH_OK;
oom:
    sh_openai_chat_text_fini(out);
    return SH_ENOMEM;
}

void sh_openai_chat_text_fini(sh_openai_chat_text *t)
{
    for (int32_t i = 0; t->owned_ && i < t->n_owned_; i++)
        free(t->owned_[i]);
    free(t->owned_);
    free(t->msgs);
    memset(t, 0, sizeof *t);
}

/* ---- the output ---------------------------------------------------------------------------- */

static uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* {"name", "arguments"} (or "parameters") → an OpenAI call object; NULL when it is not one. */
static json_t *make_call(json_t *o, uint64_t seed, int32_t index)
{
    if (!json_is_object(o))
        return NULL;
    const char *name = json_string_value(json_object_get(o, "name"));
    json_t *args = json_object_get(o, "arguments");
    if (!args)
        args = json_object_get(o, "parameters");
    if (!name_ok(name) || !args)
        return NULL;
    // The arguments are a JSON object (or a string holding one, as some models write them):
    // what the client gets is always that object's JSON text.
    json_t *held = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : NULL;
    if (held)
        args = held;
    char *a = json_is_object(args) ? json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(held);
    if (!a)
        return NULL;
    char id[48];
    uint64_t h = mix(seed ^ mix((uint64_t)index + 1));
    snprintf(id, sizeof id, "call_%016llx%08x", (unsigned long long)h, (unsigned)(mix(h) >> 32));
    json_t *c = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function", "function",
                          "name", name, "arguments", a);
    free(a);
    return c;
}

static bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

static const char *find(const char *h, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    for (size_t i = 0; m <= n && i + m <= n; i++)
        if (memcmp(h + i, needle, m) == 0)
            return h + i;
    return NULL;
}

/* Parses [p, p+n) trimmed as one JSON value; NULL when it is not exactly one. */
static json_t *load_trimmed(const char *p, size_t n)
{
    while (n && is_ws(*p))
        p++, n--;
    while (n && is_ws(p[n - 1]))
        n--;
    return n ? json_loadb(p, n, JSON_REJECT_DUPLICATES, NULL) : NULL;
}

/* Appends the calls of [p, p+n) parsed as JSON objects (Llama 3: separated by whitespace or ';')
 * or one array of objects (Mistral). False (calls untouched) when the text is anything else. */
static bool parse_json_calls(const char *p, size_t n, bool array, json_t *calls, uint64_t seed)
{
    json_t *found = json_array();
    if (!found)
        return false;
    size_t k = 0;
    bool ok = true;
    while (ok) {
        while (k < n && (is_ws(p[k]) || (!array && p[k] == ';')))
            k++;
        if (k >= n)
            break;
        json_error_t je;
        json_t *v = json_loadb(p + k, n - k, JSON_DISABLE_EOF_CHECK, &je);
        if (!v) {
            ok = false;
            break;
        }
        k += (size_t)je.position;
        if (array) {
            size_t i;
            json_t *e;
            ok = json_is_array(v) && json_array_size(v) > 0;
            json_array_foreach(v, i, e) ok = ok && json_array_append(found, e) == 0;
        } else {
            ok = json_array_append(found, v) == 0;
        }
        json_decref(v);
    }
    ok = ok && json_array_size(found) > 0;
    size_t base = json_array_size(calls);
    for (size_t i = 0; ok && i < json_array_size(found); i++) {
        json_t *c = make_call(json_array_get(found, i), seed, (int32_t)(base + i));
        if (!c)
            ok = false;
        else
            json_array_append_new(calls, c);
    }
    if (!ok)
        while (json_array_size(calls) > base)
            json_array_remove(calls, base);
    json_decref(found);
    return ok;
}

/* Strips a prefix (after whitespace) when present. */
static void skip_prefix(const char **p, size_t *n, const char *prefix)
{
    const char *s = *p;
    size_t m = *n;
    while (m && is_ws(*s))
        s++, m--;
    size_t pl = strlen(prefix);
    if (m >= pl && memcmp(s, prefix, pl) == 0) {
        *p = s + pl;
        *n = m - pl;
    }
}

/* Hermes: every <tool_call>...</tool_call> (the last may lack its end) is a call; the rest is
 * content. */
static void parse_hermes(const char *text, size_t len, json_t *calls, sh_strbuf *content,
                         uint64_t seed)
{
    static const char open[] = "<tool_call>", close[] = "</tool_call>";
    size_t k = 0;
    while (k < len) {
        const char *a = find(text + k, len - k, open);
        if (!a) {
            sh_strbuf_addn(content, text + k, len - k);
            return;
        }
        sh_strbuf_addn(content, text + k, (size_t)(a - (text + k)));
        const char *in = a + strlen(open);
        const char *b = find(in, len - (size_t)(in - text), close);
        size_t in_len = b ? (size_t)(b - in) : len - (size_t)(in - text);
        size_t end = b ? (size_t)(b - text) + strlen(close) : len;
        json_t *v = load_trimmed(in, in_len);
        json_t *c = v ? make_call(v, seed, (int32_t)json_array_size(calls)) : NULL;
        json_decref(v);
        if (c)
            json_array_append_new(calls, c);
        else
            sh_strbuf_addn(content, a, end - (size_t)(a - text)); // not a call: stays text
        k = end;
    }
}

/* Trimmed copy of b's text, NULL when empty; *oom set on failure. */
static char *trimmed(const sh_strbuf *b, bool *oom)
{
    const char *p = b->p ? b->p : "";
    size_t n = b->len;
    while (n && is_ws(*p))
        p++, n--;
    while (n && is_ws(p[n - 1]))
        n--;
    if (!n)
        return NULL;
    char *s = strndup(p, n);
    if (!s)
        *oom = true;
    return s;
}

/* The calls of a whole text into calls, the rest into content. */
static void parse_all(sh_openai_tool_style style, const char *text, size_t len, uint64_t seed,
                      json_t *calls, sh_strbuf *content)
{
    if (style == SH_OPENAI_TOOLS_HERMES || style == SH_OPENAI_TOOLS_GENERIC) {
        parse_hermes(text, len, calls, content, seed);
        return;
    }
    const char *p = text;
    size_t n = len;
    skip_prefix(&p, &n, style == SH_OPENAI_TOOLS_LLAMA3 ? "<|python_tag|>" : "[TOOL_CALLS]");
    if (!parse_json_calls(p, n, style == SH_OPENAI_TOOLS_MISTRAL, calls, seed))
        sh_strbuf_addn(content, text, len);
}

sh_err sh_openai_tools_parse(sh_openai_tool_style style, const char *text, size_t len,
                             uint64_t seed, char **content, char **calls_json)
{
    *content = *calls_json = NULL;
    json_t *calls = json_array();
    sh_strbuf b = {0};
    if (!calls)
        return SH_ENOMEM;
    parse_all(style, text, len, seed, calls, &b);
    bool oom = b.oom;
    *content = trimmed(&b, &oom);
    free(b.p);
    if (!oom && json_array_size(calls) > 0) {
        *calls_json = json_dumps(calls, JSON_COMPACT | JSON_PRESERVE_ORDER);
        oom = !*calls_json;
    }
    json_decref(calls);
    if (oom) {
        free(*content);
        free(*calls_json);
        *content = *calls_json = NULL;
        return SH_ENOMEM;
    }
    return SH_OK;
}

/* ---- streaming ----------------------------------------------------------------------------- */

enum { M_START = 0, M_CONTENT, M_CALL, M_ALL };

void sh_openai_toolstream_init(sh_openai_toolstream *s, sh_openai_tool_style style, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->style = style;
    s->seed = seed;
    s->mode =
        style == SH_OPENAI_TOOLS_HERMES || style == SH_OPENAI_TOOLS_GENERIC ? M_CONTENT : M_START;
}

void sh_openai_toolstream_fini(sh_openai_toolstream *s)
{
    free(s->buf);
    free(s->content);
    free(s->deltas);
    memset(s, 0, sizeof *s);
}

/* Drops the first n bytes of s->buf. */
static void consume(sh_openai_toolstream *s, size_t n)
{
    memmove(s->buf, s->buf + n, s->len - n);
    s->len -= n;
}

/* Calls found in one piece of text → delta items with their stream index. */
static void add_calls(sh_openai_toolstream *s, const char *p, size_t n, json_t *deltas,
                      sh_strbuf *content, bool whole)
{
    json_t *calls = json_array();
    if (!calls) {
        content->oom = true;
        return;
    }
    if (whole)
        parse_all(s->style, p, n, s->seed + (uint64_t)s->n_calls, calls, content);
    else
        parse_hermes(p, n, calls, content, s->seed + (uint64_t)s->n_calls);
    size_t i;
    json_t *c;
    json_array_foreach(calls, i, c)
    {
        // OpenAI's delta items open with their index.
        json_t *d = json_pack("{s:i}", "index", s->n_calls++);
        if (!d || json_object_update(d, c) || json_array_append_new(deltas, d))
            content->oom = true;
    }
    json_decref(calls);
}

sh_err sh_openai_toolstream_feed(sh_openai_toolstream *s, const char *piece, size_t len, bool last,
                                 const char **content, const char **deltas)
{
    static const char open[] = "<tool_call>", close[] = "</tool_call>";
    *content = *deltas = NULL;
    free(s->content);
    free(s->deltas);
    s->content = s->deltas = NULL;
    sh_strbuf in = {s->buf, s->len, s->cap, false};
    sh_strbuf_addn(&in, piece ? piece : "", len);
    if (in.oom)
        return SH_ENOMEM;
    s->buf = in.p;
    s->len = in.len;
    s->cap = in.cap;
    sh_strbuf out = {0};
    json_t *ds = json_array();
    if (!ds)
        return SH_ENOMEM;
    for (bool more = true; more;) {
        more = false;
        if (s->mode == M_START) {
            size_t k = 0;
            while (k < s->len && is_ws(s->buf[k]))
                k++;
            const char *tag =
                s->style == SH_OPENAI_TOOLS_LLAMA3 ? "<|python_tag|>" : "[TOOL_CALLS]";
            size_t rest = s->len - k, tl = strlen(tag);
            char first = s->style == SH_OPENAI_TOOLS_LLAMA3 ? '{' : '[';
            if (k == s->len) {
                if (last)
                    s->mode = M_CONTENT, more = true;
            } else if (s->buf[k] == first || memcmp(s->buf + k, tag, rest < tl ? rest : tl) == 0) {
                if (s->buf[k] == first || rest >= tl)
                    s->mode = M_ALL;
                else if (last)
                    s->mode = M_CONTENT;
                more = s->mode != M_START;
            } else {
                s->mode = M_CONTENT;
                more = true;
            }
        } else if (s->mode == M_ALL) {
            if (last) {
                add_calls(s, s->buf, s->len, ds, &out, true);
                s->len = 0;
            }
        } else if (s->mode == M_CALL) {
            const char *b = find(s->buf, s->len, close);
            if (b || last) {
                size_t end = b ? (size_t)(b - s->buf) + strlen(close) : s->len;
                add_calls(s, s->buf, end, ds, &out, false);
                consume(s, end);
                s->mode = M_CONTENT;
                more = s->len > 0;
            }
        } else { // M_CONTENT
            bool hermes = s->style == SH_OPENAI_TOOLS_HERMES || s->style == SH_OPENAI_TOOLS_GENERIC;
            const char *a = hermes ? find(s->buf, s->len, open) : NULL;
            if (a) {
                size_t k = (size_t)(a - s->buf);
                sh_strbuf_addn(&out, s->buf, k);
                consume(s, k);
                s->mode = M_CALL;
                more = true;
            } else {
                // Hold back a tail that may still become "<tool_call>".
                size_t keep = 0;
                for (size_t m = strlen(open) - 1; hermes && !last && m > 0 && !keep; m--)
                    if (s->len >= m && memcmp(s->buf + s->len - m, open, m) == 0)
                        keep = m;
                sh_strbuf_addn(&out, s->buf, s->len - keep);
                consume(s, s->len - keep);
            }
        }
    }
    bool oom = out.oom;
    if (!oom && out.len)
        s->content = out.p, out.p = NULL;
    free(out.p);
    if (!oom && json_array_size(ds)) {
        s->deltas = json_dumps(ds, JSON_COMPACT | JSON_PRESERVE_ORDER);
        oom = !s->deltas;
    }
    json_decref(ds);
    if (oom)
        return SH_ENOMEM;
    *content = s->content;
    *deltas = s->deltas;
    return SH_OK;
}

/* ---- forcing a call ------------------------------------------------------------------------ */

/* Appends g with every rule name prefixed by pre: names are runs of [a-zA-Z0-9_-] outside
 * literals ("..."), character classes ([...]), repetition bounds ({m,n}) and comments. */
static void add_renamed(sh_strbuf *b, const char *g, const char *pre)
{
    for (const char *p = g; *p;) {
        char c = *p;
        if (c == '"' || c == '[') {
            char end = c == '"' ? '"' : ']';
            const char *q = p + 1;
            while (*q && *q != end)
                q += (*q == '\\' && q[1]) ? 2 : 1;
            if (*q)
                q++;
            sh_strbuf_addn(b, p, (size_t)(q - p));
            p = q;
        } else if (c == '{' || c == '#') {
            const char *q = strchr(p, c == '{' ? '}' : '\n');
            q = q ? q + 1 : p + strlen(p);
            sh_strbuf_addn(b, p, (size_t)(q - p));
            p = q;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '-') {
            const char *q = p;
            while ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') ||
                   (*q >= '0' && *q <= '9') || *q == '_' || *q == '-')
                q++;
            sh_strbuf_add(b, pre);
            sh_strbuf_addn(b, p, (size_t)(q - p));
            p = q;
        } else {
            sh_strbuf_addn(b, p, 1);
            p++;
        }
    }
    sh_strbuf_add(b, "\n");
}

sh_err sh_openai_tools_grammar(const sh_openai_request *r, sh_openai_tool_style style, char **gbnf,
                               sh_error *e)
{
    *gbnf = NULL;
    bool required = r->tool_choice == SH_OPENAI_TOOL_CHOICE_REQUIRED;
    if (!r->n_tools || (!required && r->tool_choice != SH_OPENAI_TOOL_CHOICE_NAMED))
        return SH_OK;
    sh_strbuf b = {0}, rules = {0};
    const char *argkey = style == SH_OPENAI_TOOLS_LLAMA3 ? "parameters" : "arguments";
    // The calls the grammar allows: each tool (required) or the named one.
    sh_strbuf_add(&b, "call ::= ");
    bool firstalt = true;
    for (int32_t i = 0; i < r->n_tools; i++) {
        if (!required && i != r->tool_named)
            continue;
        json_t *fn = json_object_get(json_array_get((json_t *)r->tools, (size_t)i), "function");
        json_t *params = json_object_get(fn, "parameters");
        json_t *empty = NULL;
        if (!params || json_is_null(params))
            params = empty = json_pack("{s:s, s:{}}", "type", "object", "properties");
        char *g = NULL;
        sh_json_schema_opts so = {.strict = true};
        sh_err rc = params ? sh_json_schema_to_gbnf(params, &so, &g, e) : SH_ENOMEM;
        json_decref(empty);
        if (rc) {
            free(b.p);
            free(rules.p);
            return rc;
        }
        char pre[16];
        snprintf(pre, sizeof pre, "t%d-", (int)i);
        add_renamed(&rules, g, pre);
        free(g);
        char alt[160];
        snprintf(alt, sizeof alt, "%s\"{\\\"name\\\": \\\"%s\\\", \\\"%s\\\": \" t%d-root \"}\"",
                 firstalt ? "" : " | ", json_string_value(json_object_get(fn, "name")), argkey,
                 (int)i);
        sh_strbuf_add(&b, alt);
        firstalt = false;
    }
    sh_strbuf_add(&b, "\n");
    bool many = required && r->parallel_tool_calls;
    char root[256];
    switch (style) {
    case SH_OPENAI_TOOLS_LLAMA3:
        snprintf(root, sizeof root, "root ::= call%s\n", many ? " (\"; \" call)*" : "");
        break;
    case SH_OPENAI_TOOLS_MISTRAL:
        snprintf(root, sizeof root, "root ::= \"[TOOL_CALLS] [\" call%s \"]\"\n",
                 many ? " (\", \" call)*" : "");
        break;
    default:
        snprintf(root, sizeof root,
                 "root ::= tc%s\ntc ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n",
                 many ? " (\"\\n\" tc)*" : "");
        break;
    }
    sh_strbuf all = {0};
    sh_strbuf_add(&all, root);
    sh_strbuf_addn(&all, b.p ? b.p : "", b.len);
    sh_strbuf_addn(&all, rules.p ? rules.p : "", rules.len);
    free(b.p);
    free(rules.p);
    if (b.oom || rules.oom || all.oom) {
        free(all.p);
        return SH_ENOMEM;
    }
    *gbnf = all.p;
    return SH_OK;
}
