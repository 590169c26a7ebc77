/* OpenAI request parsing and validation with jansson, and OpenAI-shaped error bodies. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/json_schema.h"
#include "net/openai.h"
#include "net/openai_tools.h"

sh_err sh_openai_error_set(sh_openai_error *e, int status, const char *code, const char *param,
                           const char *fmt, ...)
{
    e->status = status;
    e->type = status == 429   ? "rate_limit_error"
              : status >= 500 ? "server_error"
                              : "invalid_request_error";
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return SH_EINVAL;
}

char *sh_openai_error_json(const sh_openai_error *e)
{
    json_t *err = json_pack("{s:s, s:s, s:o, s:o}", "message", e->message, "type",
                            e->type ? e->type : "invalid_request_error", "param",
                            e->param[0] ? json_string(e->param) : json_null(), "code",
                            e->code ? json_string(e->code) : json_null());
    if (!err)
        return NULL;
    json_t *root = json_pack("{s:o}", "error", err);
    if (!root)
        return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

sh_openai_sampling sh_openai_sampling_neutral(void)
{
    return (sh_openai_sampling){.temperature = 1.0f,
                                .top_p = 1.0f,
                                .typical_p = 1.0f,
                                .repeat_penalty = 1.0f,
                                .repeat_last_n = 64};
}

sh_openai_sampling sh_openai_sampling_builtin(void)
{
    sh_openai_sampling d = sh_openai_sampling_neutral();
    d.temperature = 0.8f;
    d.top_k = 40;
    d.top_p = 0.95f;
    d.min_p = 0.05f;
    return d;
}

void sh_openai_sampling_json(const sh_openai_sampling *d, char *buf, size_t cap)
{
    int n = snprintf(buf, cap,
                     "{\"temperature\":%g,\"top_k\":%d,\"top_p\":%g,\"min_p\":%g,"
                     "\"typical_p\":%g,\"repeat_penalty\":%g,\"repeat_last_n\":%d,"
                     "\"presence_penalty\":%g,\"frequency_penalty\":%g}",
                     (double)d->temperature, (int)d->top_k, (double)d->top_p, (double)d->min_p,
                     (double)d->typical_p, (double)d->repeat_penalty, (int)d->repeat_last_n,
                     (double)d->presence_penalty, (double)d->frequency_penalty);
    if (n < 0 || (size_t)n >= cap)
        buf[0] = '\0';
}

/* Field getters: each returns 1 when absent or null (value untouched), 0 when set, -1 on a
 * validation error (err filled). */

static int get_number(json_t *o, const char *name, double lo, double hi, float *v,
                      sh_openai_error *err)
{
    json_t *j = json_object_get(o, name);
    if (!j || json_is_null(j))
        return 1;
    if (!json_is_number(j))
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be a number", name), -1;
    double d = json_number_value(j);
    if (!(d >= lo && d <= hi))
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be between %g and %g", name, lo,
                                   hi),
               -1;
    *v = (float)d;
    return 0;
}

static int get_int(json_t *o, const char *name, long long lo, long long hi, long long *v,
                   sh_openai_error *err)
{
    json_t *j = json_object_get(o, name);
    if (!j || json_is_null(j))
        return 1;
    if (!json_is_integer(j))
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be an integer", name), -1;
    long long x = json_integer_value(j);
    if (x < lo || x > hi)
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be between %lld and %lld", name,
                                   lo, hi),
               -1;
    *v = x;
    return 0;
}

static int get_bool(json_t *o, const char *name, bool *v, sh_openai_error *err)
{
    json_t *j = json_object_get(o, name);
    if (!j || json_is_null(j))
        return 1;
    if (!json_is_boolean(j))
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be a boolean", name), -1;
    *v = json_is_true(j);
    return 0;
}

static int get_string(json_t *o, const char *name, const char **v, sh_openai_error *err)
{
    json_t *j = json_object_get(o, name);
    if (!j || json_is_null(j))
        return 1;
    if (!json_is_string(j))
        return sh_openai_error_set(err, 400, NULL, name, "'%s' must be a string", name), -1;
    *v = json_string_value(j);
    return 0;
}

static bool parse_stop(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    json_t *j = json_object_get(o, "stop");
    if (!j || json_is_null(j))
        return true;
    json_t *one[1] = {j};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(j)) {
        n = json_array_size(j);
        if (n > SH_OPENAI_MAX_STOP)
            return sh_openai_error_set(err, 400, NULL, "stop",
                                       "'stop' takes at most %d strings, got %zu",
                                       SH_OPENAI_MAX_STOP, n),
                   false;
        items = NULL;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(j, i);
        if (!json_is_string(s))
            return sh_openai_error_set(err, 400, NULL, "stop",
                                       "'stop' must be a string or an array of strings"),
                   false;
        size_t len = json_string_length(s);
        if (len > SH_OPENAI_MAX_STOP_BYTES)
            return sh_openai_error_set(err, 400, NULL, "stop",
                                       "a stop string is longer than %d bytes",
                                       SH_OPENAI_MAX_STOP_BYTES),
                   false;
        if (len > 0)
            r->stop[r->n_stop++] = json_string_value(s);
    }
    return true;
}

static bool parse_bias(json_t *o, sh_openai_request *r, const sh_openai_limits *lim,
                       sh_openai_error *err)
{
    json_t *j = json_object_get(o, "logit_bias");
    if (!j || json_is_null(j))
        return true;
    if (!json_is_object(j))
        return sh_openai_error_set(err, 400, NULL, "logit_bias",
                                   "'logit_bias' must be an object of token id to bias"),
               false;
    size_t n = json_object_size(j);
    if (n > SH_OPENAI_MAX_BIAS)
        return sh_openai_error_set(err, 400, NULL, "logit_bias",
                                   "'logit_bias' takes at most %d entries", SH_OPENAI_MAX_BIAS),
               false;
    if (n == 0)
        return true;
    r->bias = calloc(n, sizeof *r->bias);
    if (!r->bias)
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
    const char *key;
    json_t *v;
    json_object_foreach(j, key, v)
    {
        /* Keys are decimal token ids: digits only, no sign, no spaces, no leading zeros. */
        size_t kl = strlen(key);
        bool digits = kl > 0 && kl <= 10 && (key[0] != '0' || kl == 1);
        for (size_t i = 0; digits && i < kl; i++)
            digits = key[i] >= '0' && key[i] <= '9';
        long long id = digits ? strtoll(key, NULL, 10) : -1;
        if (!digits || id > INT32_MAX || (lim->n_vocab > 0 && id >= lim->n_vocab))
            return sh_openai_error_set(err, 400, NULL, "logit_bias",
                                       "'logit_bias' key '%.40s' is not a valid token id", key),
                   false;
        if (!json_is_number(v) || !(json_number_value(v) >= -100 && json_number_value(v) <= 100))
            return sh_openai_error_set(err, 400, NULL, "logit_bias",
                                       "'logit_bias' values must be numbers between -100 and 100"),
                   false;
        r->bias[r->n_bias++] = (sh_openai_bias){(int32_t)id, (float)json_number_value(v)};
    }
    return true;
}

/* A token-id array: every element an integer in [0, n_vocab). */
static bool parse_tokens(json_t *a, sh_openai_request *r, const sh_openai_limits *lim,
                         sh_openai_error *err)
{
    size_t n = json_array_size(a);
    if (n == 0)
        return sh_openai_error_set(err, 400, NULL, "prompt", "'prompt' must not be empty"), false;
    if (n > (size_t)lim->max_prompt_tokens)
        return sh_openai_error_set(err, 400, "context_length_exceeded", "prompt",
                                   "the prompt has %zu tokens; at most %d are allowed", n,
                                   lim->max_prompt_tokens),
               false;
    r->prompt_tokens = malloc(n * sizeof *r->prompt_tokens);
    if (!r->prompt_tokens)
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(a, i);
        if (!json_is_integer(t))
            return sh_openai_error_set(err, 400, NULL, "prompt",
                                       "'prompt' token at position %zu is not an integer (a "
                                       "token id array holds integers only)",
                                       i),
                   false;
        long long id = json_integer_value(t);
        if (id < 0 || id > INT32_MAX || (lim->n_vocab > 0 && id >= lim->n_vocab)) {
            if (lim->n_vocab > 0)
                return sh_openai_error_set(err, 400, NULL, "prompt",
                                           "'prompt' token at position %zu is %lld, not a valid "
                                           "token id (0..%d)",
                                           i, id, lim->n_vocab - 1),
                       false;
            return sh_openai_error_set(err, 400, NULL, "prompt",
                                       "'prompt' token at position %zu is %lld, not a valid token "
                                       "id",
                                       i, id),
                   false;
        }
        r->prompt_tokens[i] = (int32_t)id;
    }
    r->n_prompt_tokens = (int32_t)n;
    return true;
}

/* An empty text prompt would generate from nothing (or from BOS alone): refused, as OpenAI does. */
static bool check_prompt_text(const sh_openai_request *r, sh_openai_error *err)
{
    if (r->prompt[0])
        return true;
    return sh_openai_error_set(err, 400, NULL, "prompt", "'prompt' must not be empty"), false;
}

static bool parse_prompt(json_t *o, sh_openai_request *r, const sh_openai_limits *lim,
                         sh_openai_error *err)
{
    json_t *p = json_object_get(o, "prompt");
    if (!p)
        return sh_openai_error_set(err, 400, NULL, "prompt", "'prompt' is required"), false;
    if (json_is_string(p)) {
        r->prompt = json_string_value(p);
        return check_prompt_text(r, err);
    }
    if (!json_is_array(p) || json_array_size(p) == 0)
        return sh_openai_error_set(err, 400, NULL, "prompt",
                                   "'prompt' must be a string, an array of strings or an array "
                                   "of token ids"),
               false;
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first))
        return parse_tokens(p, r, lim, err);
    if (json_array_size(p) > 1)
        return sh_openai_error_set(err, 400, NULL, "prompt",
                                   "only one prompt per request is supported"),
               false;
    if (json_is_string(first)) {
        r->prompt = json_string_value(first);
        return check_prompt_text(r, err);
    }
    if (json_is_array(first))
        return parse_tokens(first, r, lim, err);
    return sh_openai_error_set(err, 400, NULL, "prompt",
                               "'prompt' must be a string, an array of strings or an array of "
                               "token ids"),
           false;
}

static bool parse_messages(json_t *o, sh_openai_request *r, const sh_openai_limits *lim,
                           sh_openai_error *err)
{
    json_t *m = json_object_get(o, "messages");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return sh_openai_error_set(err, 400, NULL, "messages",
                                   "'messages' must be a non-empty array"),
               false;
    size_t n = json_array_size(m);
    if (n > (size_t)lim->max_messages)
        return sh_openai_error_set(err, 400, NULL, "messages", "too many messages (%zu > %d)", n,
                                   lim->max_messages),
               false;
    /* First pass: types and the total text size; second pass: copy into one buffer. */
    size_t total = 0;
    char param[64];
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(msg))
            return sh_openai_error_set(err, 400, NULL, param, "'%s' must be an object", param),
                   false;
        const char *role = json_string_value(json_object_get(msg, "role"));
        if (!role || (strcmp(role, "system") && strcmp(role, "developer") && strcmp(role, "user") &&
                      strcmp(role, "assistant") && strcmp(role, "tool"))) {
            snprintf(param, sizeof param, "messages[%zu].role", i);
            return sh_openai_error_set(err, 400, NULL, param,
                                       "'%s' must be one of system, developer, user, assistant, "
                                       "tool",
                                       param),
                   false;
        }
        if (!sh__openai_tools_check_message(msg, i, role, err))
            return false;
        snprintf(param, sizeof param, "messages[%zu].content", i);
        json_t *c = json_object_get(msg, "content");
        if (json_is_string(c)) {
            total += json_string_length(c) + 1;
        } else if (json_is_null(c) && strcmp(role, "assistant") == 0) {
            total += 1;
        } else if (json_is_array(c)) {
            size_t k;
            json_t *part;
            json_array_foreach(c, k, part)
            {
                json_t *type = json_object_get(part, "type");
                json_t *text = json_object_get(part, "text");
                if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 ||
                    !json_is_string(text))
                    return sh_openai_error_set(err, 400, NULL, param,
                                               "'%s' parts must be {\"type\":\"text\",\"text\":"
                                               "string}; other part types are not supported",
                                               param),
                           false;
                total += json_string_length(text);
            }
            total += 1;
        } else {
            return sh_openai_error_set(err, 400, NULL, param,
                                       "'%s' must be a string or an array of text parts", param),
                   false;
        }
    }
    r->messages = calloc(n, sizeof *r->messages);
    r->text_ = malloc(total + 1);
    if (!r->messages || !r->text_)
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
    char *w = r->text_;
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        const char *role = json_string_value(json_object_get(msg, "role"));
        r->messages[i].role = role[0] == 'u'   ? SH_OPENAI_USER
                              : role[0] == 'a' ? SH_OPENAI_ASSISTANT
                              : role[0] == 't' ? SH_OPENAI_TOOL
                                               : SH_OPENAI_SYSTEM;
        json_t *calls = json_object_get(msg, "tool_calls");
        if (role[0] == 'a' && json_is_array(calls) && json_array_size(calls) > 0)
            r->messages[i].tool_calls = calls;
        if (role[0] == 't')
            r->messages[i].tool_call_id = json_string_value(json_object_get(msg, "tool_call_id"));
        r->messages[i].content = w;
        json_t *c = json_object_get(msg, "content");
        if (json_is_string(c)) {
            memcpy(w, json_string_value(c), json_string_length(c));
            w += json_string_length(c);
        } else if (json_is_array(c)) {
            size_t k;
            json_t *part;
            json_array_foreach(c, k, part)
            {
                json_t *text = json_object_get(part, "text");
                memcpy(w, json_string_value(text), json_string_length(text));
                w += json_string_length(text);
            }
        }
        *w++ = '\0';
    }
    r->n_messages = (int32_t)n;
    return true;
}

/* The names of the models served, quoted, as many as fit in cap (then an ellipsis). */
static void list_models(const sh_openai_limits *lim, char *names, size_t cap)
{
    size_t k = 0;
    names[0] = '\0';
    for (int32_t i = 0; i < lim->n_models && k < cap; i++) {
        int w = snprintf(names + k, cap - k, "%s'%s'", i ? ", " : "", lim->models[i]);
        if (w < 0)
            break;
        k += (size_t)w;
    }
    if (k >= cap) // cut: end with an ellipsis
        memcpy(names + cap - 4, "...", 4);
}

static bool check_model(const char *model, const sh_openai_limits *lim, sh_openai_error *err)
{
    if (lim->n_models <= 0 || !lim->models)
        return true;
    for (int32_t i = 0; i < lim->n_models; i++)
        if (strcmp(lim->models[i], model) == 0)
            return true;
    char names[160];
    list_models(lim, names, sizeof names);
    sh_openai_error_set(err, 404, "model_not_found", "model",
                        "The model '%.100s' does not exist (this server serves %s)", model, names);
    return false;
}

/* The 400 for a request without a model when the server cannot pick one: it names the models
 * served (as many as fit in the message). */
static void model_required(const sh_openai_limits *lim, sh_openai_error *err)
{
    if (!lim->models || lim->n_models <= 0) {
        sh_openai_error_set(err, 400, NULL, "model", "'model' is required");
        return;
    }
    char names[160];
    list_models(lim, names, sizeof names);
    sh_openai_error_set(err, 400, NULL, "model",
                        "'model' is required: this server serves %d models: %s", lim->n_models,
                        names);
}

/* Extension: "speculative" is true (the default), false (no speculative decoding for this
 * request) or {"n_max": N} (at most N drafted tokens per step, as llama.cpp's
 * speculative.n_max; 0: none); llama.cpp's flat "speculative.n_max": N says the same. An object
 * with another key, n_max given both ways, or false with an n_max above 0 is a 400. */
static bool parse_spec(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    static const char *const flat = "speculative.n_max";
    const long long hi = SH_OPENAI_MAX_SPEC_N;
    long long v = 0;
    int has_flat = get_int(o, flat, 0, hi, &v, err);
    if (has_flat < 0)
        return false;
    long long n_max = has_flat == 0 ? v : -1; /* -1: not given */
    json_t *j = json_object_get(o, "speculative");
    bool spec = true;
    if (j && json_is_object(j)) {
        const char *key;
        json_t *val;
        json_object_foreach(j, key, val)
        {
            if (strcmp(key, "n_max") != 0)
                return sh_openai_error_set(err, 400, NULL, "speculative",
                                           "'speculative' has an unknown key '%.64s' (it takes "
                                           "n_max)",
                                           key),
                       false;
        }
        json_t *n = json_object_get(j, "n_max");
        if (n && !json_is_null(n)) {
            if (!json_is_integer(n) || json_integer_value(n) < 0 || json_integer_value(n) > hi)
                return sh_openai_error_set(err, 400, NULL, flat,
                                           "'speculative.n_max' must be an integer between 0 "
                                           "and %lld",
                                           hi),
                       false;
            if (n_max >= 0)
                return sh_openai_error_set(err, 400, NULL, flat,
                                           "'speculative.n_max' is given twice (in "
                                           "'speculative' and as a key of its own)"),
                       false;
            n_max = json_integer_value(n);
        }
    } else if (j && !json_is_null(j) && !json_is_boolean(j)) {
        return sh_openai_error_set(err, 400, NULL, "speculative",
                                   "'speculative' must be a boolean or an object {\"n_max\": N}"),
               false;
    } else if (j && json_is_boolean(j)) {
        spec = json_is_true(j);
    }
    if (!spec && n_max > 0)
        return sh_openai_error_set(err, 400, NULL, flat,
                                   "'speculative.n_max' = %lld contradicts 'speculative': false",
                                   n_max),
               false;
    r->no_spec = !spec || n_max == 0;
    r->spec_n_max = n_max > 0 ? (int32_t)n_max : 0;
    return true;
}

/* The output's grammar: `grammar` (GBNF text, llama.cpp's field) or `response_format` (through
 * net/json_schema.h), not both. The text is kept in r->grammar (the gateway parses it before
 * anything is queued: net/ does not link the grammar engine). Returns false with err filled. */
static bool parse_grammar(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    json_t *rf = json_object_get(o, "response_format");
    json_t *gj = json_object_get(o, "grammar");
    if (gj && json_is_null(gj))
        gj = NULL;
    const char *param = "grammar";
    if (gj) {
        if (!json_is_string(gj))
            return sh_openai_error_set(err, 400, NULL, "grammar", "'grammar' must be a string"),
                   false;
        if (rf && !json_is_null(rf))
            return sh_openai_error_set(err, 400, NULL, "grammar",
                                       "'grammar' and 'response_format' cannot be given together"),
                   false;
        size_t len = json_string_length(gj);
        if (len > SH_OPENAI_MAX_GRAMMAR)
            return sh_openai_error_set(err, 400, NULL, "grammar",
                                       "'grammar' is %zu bytes; at most %d are allowed", len,
                                       SH_OPENAI_MAX_GRAMMAR),
                   false;
        if (!(r->grammar = malloc(len + 1)))
            return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
        memcpy(r->grammar, json_string_value(gj), len + 1);
    } else if (rf) {
        char pbuf[64] = "response_format";
        sh_error e = {0};
        sh_err rc = sh_json_schema_response_format(rf, &r->grammar, pbuf, &e);
        if (rc == SH_ENOMEM)
            return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
        if (rc)
            return sh_openai_error_set(err, 400, NULL, pbuf[0] ? pbuf : "response_format", "%s",
                                       e.msg),
                   false;
        param = "response_format";
        if (r->grammar && strlen(r->grammar) > SH_OPENAI_MAX_GRAMMAR)
            return sh_openai_error_set(err, 400, NULL, param,
                                       "the schema's grammar is %zu bytes; at most %d are allowed",
                                       strlen(r->grammar), SH_OPENAI_MAX_GRAMMAR),
                   false;
    }
    r->grammar_param = r->grammar ? param : NULL;
    return true;
}

/* Sampling fields of other servers (llama.cpp, vLLM, OpenAI) that Shoal does not implement, with
 * the JSON value that leaves sampling as it is: a request may send that value (clients that fill
 * every field do), any other is a 400 naming the field. */
typedef enum {
    NEUTRAL_ZERO,
    NEUTRAL_ONE,
    NEUTRAL_NONPOS,
    NEUTRAL_LE1,
    NEUTRAL_FALSE,
    NEUTRAL_EMPTY
} neutral_kind;
static const struct {
    const char *name;
    neutral_kind neutral;
    const char *why;
} k_refused[] = {
    {"mirostat", NEUTRAL_ZERO, "mirostat sampling is not implemented"},
    {"xtc_probability", NEUTRAL_ZERO, "XTC sampling is not implemented"},
    {"dry_multiplier", NEUTRAL_ZERO, "DRY sampling is not implemented"},
    {"dynatemp_range", NEUTRAL_ZERO, "dynamic temperature is not implemented"},
    {"top_n_sigma", NEUTRAL_NONPOS, "top-n-sigma sampling is not implemented"},
    {"tfs_z", NEUTRAL_ONE, "tail-free sampling is not implemented"},
    {"n_probs", NEUTRAL_ZERO, "use 'logprobs' and 'top_logprobs'"},
    {"min_keep", NEUTRAL_LE1, "truncation always keeps at least one token"},
    {"best_of", NEUTRAL_ONE, "only best_of 1 is served; use 'n' for several choices"},
    {"use_beam_search", NEUTRAL_FALSE, "beam search is not implemented"},
    {"penalize_nl", NEUTRAL_FALSE, "newline is penalised like any token"},
    {"samplers", NEUTRAL_EMPTY, "the sampler order is fixed (see docs/serving.md)"},
    {"stop_token_ids", NEUTRAL_EMPTY, "use 'stop' strings or 'logit_bias'"},
    {"bad_words", NEUTRAL_EMPTY, "use 'logit_bias' to ban tokens"},
    {"allowed_token_ids", NEUTRAL_EMPTY, "use 'logit_bias'"},
    {"logits_processors", NEUTRAL_EMPTY, "logits processors are not supported"},
    {"prompt_logprobs", NEUTRAL_ZERO, "log-probabilities of prompt tokens are not reported"},
    {"post_sampling_probs", NEUTRAL_FALSE, "logprobs are the raw model's"},
};

static bool is_neutral(json_t *j, neutral_kind k)
{
    if (json_is_null(j))
        return true;
    switch (k) {
    case NEUTRAL_ZERO:
        return json_is_number(j) && json_number_value(j) == 0.0;
    case NEUTRAL_ONE:
        return json_is_number(j) && json_number_value(j) == 1.0;
    case NEUTRAL_NONPOS:
        return json_is_number(j) && json_number_value(j) <= 0.0;
    case NEUTRAL_LE1:
        return json_is_number(j) && json_number_value(j) <= 1.0;
    case NEUTRAL_FALSE:
        return json_is_false(j);
    case NEUTRAL_EMPTY:
        return (json_is_array(j) && json_array_size(j) == 0) ||
               (json_is_string(j) && json_string_length(j) == 0);
    }
    return false;
}

/* The sampling fields beyond OpenAI's: typical_p, the multiplicative repetition penalty under
 * llama.cpp's and vLLM's names, and the refused ones. */
static bool parse_sampling_ext(json_t *o, sh_openai_request *r, sh_openai_error *err)
{
    for (size_t i = 0; i < sizeof k_refused / sizeof k_refused[0]; i++) {
        json_t *j = json_object_get(o, k_refused[i].name);
        if (j && !is_neutral(j, k_refused[i].neutral))
            return sh_openai_error_set(err, 400, "unsupported_parameter", k_refused[i].name,
                                       "'%s' is not supported: %s", k_refused[i].name,
                                       k_refused[i].why),
                   false;
    }
    float typ = -1.0f;
    int rc = get_number(o, "typical_p", 0, 1, &typ, err);
    if (rc < 0)
        return false;
    if (rc == 0 && !(typ > 0.0f))
        return sh_openai_error_set(err, 400, NULL, "typical_p",
                                   "'typical_p' must be above 0 and at most 1 (1: off)"),
               false;
    if (rc == 0)
        r->typical_p = typ;
    float rp = 0.0f, vp = 0.0f;
    int rc_rp = get_number(o, "repeat_penalty", 0, 100, &rp, err);
    if (rc_rp < 0)
        return false;
    int rc_vp = get_number(o, "repetition_penalty", 0, 100, &vp, err);
    if (rc_vp < 0)
        return false;
    if ((rc_rp == 0 && !(rp > 0.0f)) || (rc_vp == 0 && !(vp > 0.0f)))
        return sh_openai_error_set(
                   err, 400, NULL,
                   rc_rp == 0 && !(rp > 0.0f) ? "repeat_penalty" : "repetition_penalty",
                   "'%s' must be above 0 and at most 100 (1: off)",
                   rc_rp == 0 && !(rp > 0.0f) ? "repeat_penalty" : "repetition_penalty"),
               false;
    if (rc_rp == 0 && rc_vp == 0 && rp != vp)
        return sh_openai_error_set(err, 400, NULL, "repetition_penalty",
                                   "'repetition_penalty' (vLLM's name) and 'repeat_penalty' "
                                   "(llama.cpp's) are the same penalty; give one"),
               false;
    long long n = 0;
    int rc_n = get_int(o, "repeat_last_n", -1, 1 << 20, &n, err);
    if (rc_n < 0)
        return false;
    if (rc_rp == 0)
        r->repeat_penalty = rp;
    if (rc_vp == 0) { // vLLM's: over the prompt and the output
        r->repeat_penalty = vp;
        r->repeat_last_n = -1;
    }
    if (rc_n == 0)
        r->repeat_last_n = (int32_t)n;
    return true;
}

/* Every field after the type-specific ones. Returns false with err filled. */
static bool parse_common(json_t *o, sh_openai_request *r, const sh_openai_limits *lim,
                         sh_openai_error *err)
{
    long long v = 0;
    int rc;
    if (get_string(o, "model", &r->model, err) < 0)
        return false;
    if ((!r->model || !r->model[0]) && lim->models && lim->n_models == 1)
        r->model = lim->models[0]; // one model served: it is the one asked for (as vLLM does)
    if (!r->model || !r->model[0])
        return model_required(lim, err), false;
    const char *mt = r->kind == SH_OPENAI_CHAT ? "max_completion_tokens" : "max_tokens";
    if ((rc = get_int(o, mt, 1, lim->max_tokens, &v, err)) < 0)
        return false;
    if (rc == 1 && r->kind == SH_OPENAI_CHAT &&
        (rc = get_int(o, "max_tokens", 1, lim->max_tokens, &v, err)) < 0)
        return false;
    r->max_tokens = rc == 0 ? (int32_t)v : lim->default_max_tokens;
    if (get_number(o, "temperature", 0, 2, &r->temperature, err) < 0 ||
        get_number(o, "top_p", 0, 1, &r->top_p, err) < 0 ||
        get_number(o, "min_p", 0, 1, &r->min_p, err) < 0 ||
        get_number(o, "presence_penalty", -2, 2, &r->presence_penalty, err) < 0 ||
        get_number(o, "frequency_penalty", -2, 2, &r->frequency_penalty, err) < 0)
        return false;
    if ((rc = get_int(o, "top_k", -1, INT32_MAX, &v, err)) < 0)
        return false;
    if (rc == 0)
        r->top_k = v > 0 ? (int32_t)v : 0;
    if (!parse_sampling_ext(o, r, err))
        return false;
    if ((rc = get_int(o, "n", 1, lim->max_n, &v, err)) < 0)
        return false;
    r->n = rc == 0 ? (int32_t)v : 1;
    /* Any int64 seed is accepted (jansson rejects larger numbers as malformed). */
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &v, err)) < 0)
        return false;
    r->has_seed = rc == 0;
    r->seed = (uint64_t)v;
    if ((rc = get_int(o, "priority", 0, 255, &v, err)) < 0)
        return false;
    r->priority = rc == 0 ? (int32_t)v : -1;
    if (get_bool(o, "stream", &r->stream, err) < 0 || get_string(o, "user", &r->user, err) < 0)
        return false;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return sh_openai_error_set(err, 400, NULL, "stream_options",
                                       "'stream_options' must be an object"),
                   false;
        if (!r->stream)
            return sh_openai_error_set(err, 400, NULL, "stream_options",
                                       "'stream_options' is only allowed when 'stream' is true"),
                   false;
        if (get_bool(so, "include_usage", &r->include_usage, err) < 0) {
            snprintf(err->param, sizeof err->param, "stream_options.include_usage");
            return false;
        }
    }
    if (!parse_stop(o, r, err) || !parse_bias(o, r, lim, err))
        return false;
    // Extensions shared with vLLM: generate past end-of-sequence tokens, and a minimum length.
    if (get_bool(o, "ignore_eos", &r->ignore_eos, err) < 0)
        return false;
    // Special-token texts in a text prompt are plain text unless the request opts in.
    if (get_bool(o, "parse_special", &r->parse_special, err) < 0)
        return false;
    if (r->parse_special && (r->kind != SH_OPENAI_COMPLETION || !r->prompt))
        return sh_openai_error_set(err, 400, NULL, "parse_special",
                                   "'parse_special' applies to a text 'prompt' of "
                                   "/v1/completions only; chat message contents are always "
                                   "plain text"),
               false;
    if ((rc = get_int(o, "min_tokens", 0, 1 << 20, &v, err)) < 0)
        return false;
    r->min_tokens = rc == 0 ? (int32_t)v : 0;
    if (!parse_spec(o, r, err))
        return false;
    if (r->kind == SH_OPENAI_COMPLETION) {
        if ((rc = get_int(o, "logprobs", 0, SH_OPENAI_MAX_LOGPROBS_CMPL, &v, err)) < 0)
            return false;
        r->logprobs = rc == 0;
        r->top_logprobs = rc == 0 ? (int32_t)v : 0;
        if (get_bool(o, "echo", &r->echo, err) < 0)
            return false;
        if (r->echo && r->logprobs)
            return sh_openai_error_set(err, 400, NULL, "echo",
                                       "'echo' together with 'logprobs' is not supported"),
                   false;
    } else {
        if (get_bool(o, "logprobs", &r->logprobs, err) < 0)
            return false;
        if ((rc = get_int(o, "top_logprobs", 0, SH_OPENAI_MAX_TOP_LOGPROBS, &v, err)) < 0)
            return false;
        r->top_logprobs = rc == 0 ? (int32_t)v : 0;
        if (rc == 0 && !r->logprobs)
            return sh_openai_error_set(err, 400, NULL, "top_logprobs",
                                       "'top_logprobs' requires 'logprobs' to be true"),
                   false;
    }
    if (!parse_grammar(o, r, err))
        return false;
    if (!sh__openai_tools_parse_request(o, r, err))
        return false;
    return check_model(r->model, lim, err);
}

sh_err sh_openai_request_parse(sh_openai_kind kind, const char *body, size_t len,
                               const sh_openai_limits *limits, sh_openai_request **out,
                               sh_openai_error *err)
{
    *out = NULL;
    sh_openai_limits lim = limits ? *limits : (sh_openai_limits){0};
    lim.max_tokens = lim.max_tokens > 0 ? lim.max_tokens : 32768;
    lim.default_max_tokens = lim.default_max_tokens > 0 ? lim.default_max_tokens : 256;
    if (lim.default_max_tokens > lim.max_tokens)
        lim.default_max_tokens = lim.max_tokens;
    lim.max_n = lim.max_n > 0 ? lim.max_n : 1;
    lim.max_prompt_tokens = lim.max_prompt_tokens > 0 ? lim.max_prompt_tokens : 32768;
    lim.max_messages = lim.max_messages > 0 ? lim.max_messages : 1024;

    json_error_t je;
    /* Duplicate keys are rejected so that no two readers can disagree on a field's value;
     * jansson rejects invalid UTF-8 and \u0000 in strings by itself. */
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        sh_openai_error_set(err, 400, NULL, NULL,
                            "We could not parse the JSON body of your request: %.150s "
                            "(line %d, column %d)",
                            je.text, je.line, je.column);
        return SH_EINVAL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        sh_openai_error_set(err, 400, NULL, NULL, "the request body must be a JSON object");
        return SH_EINVAL;
    }
    sh_openai_request *r = calloc(1, sizeof *r);
    if (!r) {
        json_decref(root);
        sh_openai_error_set(err, 500, NULL, NULL, "out of memory");
        return SH_ENOMEM;
    }
    r->root_ = root;
    r->kind = kind;
    sh_openai_sampling d = lim.defaults ? *lim.defaults : sh_openai_sampling_neutral();
    r->temperature = d.temperature;
    r->top_p = d.top_p;
    r->top_k = d.top_k;
    r->min_p = d.min_p;
    r->typical_p = d.typical_p;
    r->repeat_penalty = d.repeat_penalty;
    r->repeat_last_n = d.repeat_last_n;
    r->presence_penalty = d.presence_penalty;
    r->frequency_penalty = d.frequency_penalty;
    bool ok = kind == SH_OPENAI_CHAT ? parse_messages(root, r, &lim, err)
                                     : parse_prompt(root, r, &lim, err);
    ok = ok && parse_common(root, r, &lim, err);
    if (!ok) {
        sh_openai_request_free(r);
        return err->status == 500 ? SH_ENOMEM : SH_EINVAL;
    }
    *out = r;
    return SH_OK;
}

void sh_openai_request_free(sh_openai_request *r)
{
    if (!r)
        return;
    free(r->prompt_tokens);
    free(r->messages);
    free(r->text_);
    free(r->bias);
    free(r->grammar);
    free(r->resp_echo);
    json_decref(r->root_);
    free(r);
}
