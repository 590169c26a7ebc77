/* Tool calls through the C API (sh_request_opts.messages_json, tools, tool_choice,
 * no_parallel_tool_calls; sh_done_info.tool_calls) on the default model (SmolLM2, ChatML: the
 * Hermes tool syntax). tool_choice "required" and a named function give calls whose arguments
 * follow the tool's schema (checked here with jansson), finish SH_FINISH_TOOL_CALLS and no call
 * text in on_token; a round trip with the call and a "tool" message continues the chat; a chat
 * given as messages_json equals the same chat given as messages; bad fields fail sh_submit with
 * SH_EINVAL naming the field, and the engine serves on. Skips (77) without the model. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sh_test.h"
#include "shoal.h"

#define MODEL "models/smollm2-135m-instruct-q4_1.gguf"

static const char WEATHER[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"The "
    "current weather in a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{"
    "\"type\":\"string\",\"maxLength\":24},\"unit\":{\"type\":\"string\",\"enum\":[\"celsius\","
    "\"fahrenheit\"]}},\"required\":[\"city\",\"unit\"]}}},{\"type\":\"function\",\"function\":{"
    "\"name\":\"add\",\"description\":\"Adds two integers\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":["
    "\"a\",\"b\"]}}}]";

typedef struct got {
    char text[8192];
    size_t len;
    char calls[4096];
    int n_done, n_error, finish, prompt_tokens, completion_tokens, n_ids;
    char error[512];
} got;

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    (void)id;
    got *g = user;
    g->n_ids += ev->n_ids;
    if (g->len + ev->text_len < sizeof g->text) {
        memcpy(g->text + g->len, ev->text, ev->text_len);
        g->len += ev->text_len;
        g->text[g->len] = '\0';
    }
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    (void)id;
    got *g = user;
    g->n_done++;
    g->finish = (int)info->finish;
    g->prompt_tokens = info->prompt_tokens;
    g->completion_tokens = info->completion_tokens;
    snprintf(g->calls, sizeof g->calls, "%s", info->tool_calls ? info->tool_calls : "");
}

static void on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    got *g = user;
    g->n_error++;
    snprintf(g->error, sizeof g->error, "%s: %s", sh_strerror(code), msg);
}

static const sh_callbacks cb = {on_token, on_done, on_error};

static sh_engine *eng;

static bool open_engine(void)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = 2;
    o.kv_bytes = 32u << 20;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s: %s\n", sh_strerror(rc), e.msg);
    CHECK_OK(rc);
    return rc == SH_OK;
}

/* Submits r and polls it to its end; false (with the message in g->error) when sh_submit
 * refused it. */
static bool run(const sh_request_opts *r, got *g, sh_err *code)
{
    memset(g, 0, sizeof *g);
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, r, &cb, g, &id, &e);
    if (code)
        *code = rc;
    if (rc) {
        snprintf(g->error, sizeof g->error, "%s", e.msg);
        return false;
    }
    for (int i = 0; i < 12000 && sh_pending(eng) > 0; i++)
        CHECK_OK(sh_poll(eng, 10, NULL));
    CHECK_INT_EQ(sh_pending(eng), 0);
    CHECK_INT_EQ(g->n_done + g->n_error, 1);
    if (g->n_error)
        SH_FAIL_("the request failed: %s", g->error);
    return true;
}

/* Checks one call's arguments against the tools above; returns its name (static) or NULL. */
static const char *check_call(json_t *call)
{
    static char name[64];
    const char *id = json_string_value(json_object_get(call, "id"));
    const char *type = json_string_value(json_object_get(call, "type"));
    json_t *fn = json_object_get(call, "function");
    const char *nm = json_string_value(json_object_get(fn, "name"));
    const char *args = json_string_value(json_object_get(fn, "arguments"));
    if (!id || strncmp(id, "call_", 5) || !type || strcmp(type, "function") || !nm || !args) {
        SH_FAIL_("a call without id, type, name or arguments");
        return NULL;
    }
    json_t *a = json_loads(args, 0, NULL);
    if (!json_is_object(a)) {
        SH_FAIL_("%s's arguments are not a JSON object: %s", nm, args);
        json_decref(a);
        return NULL;
    }
    bool ok;
    if (!strcmp(nm, "get_weather")) {
        const char *city = json_string_value(json_object_get(a, "city"));
        const char *unit = json_string_value(json_object_get(a, "unit"));
        ok = city && strlen(city) <= 24 && unit &&
             (!strcmp(unit, "celsius") || !strcmp(unit, "fahrenheit")) && json_object_size(a) == 2;
    } else if (!strcmp(nm, "add")) {
        ok = json_is_integer(json_object_get(a, "a")) && json_is_integer(json_object_get(a, "b")) &&
             json_object_size(a) == 2;
    } else {
        ok = false;
    }
    if (!ok)
        SH_FAIL_("%s's arguments do not follow its schema: %s", nm, args);
    snprintf(name, sizeof name, "%s", nm);
    json_decref(a);
    return ok ? name : NULL;
}

static json_t *calls_of(const got *g, size_t min, size_t max)
{
    json_t *c = json_loads(g->calls, 0, NULL);
    if (!json_is_array(c) || json_array_size(c) < min || json_array_size(c) > max) {
        SH_FAIL_("tool_calls %s: not an array of %zu to %zu calls", g->calls, min, max);
        json_decref(c);
        return NULL;
    }
    return c;
}

static const sh_chat_message WEATHER_Q[] = {
    {"user", "What is the weather like in Paris today? Answer in celsius."}};

/* tool_choice "required": at least one call, each following its tool's schema; with
 * no_parallel_tool_calls exactly one. The call's text never reaches on_token. */
static void test_required(void)
{
    if (!eng)
        return;
    for (int par = 0; par < 2; par++) {
        sh_request_opts r = sh_request_opts_default();
        r.messages = WEATHER_Q;
        r.n_messages = 1;
        r.tools = WEATHER;
        r.tool_choice = "required";
        r.no_parallel_tool_calls = par == 0;
        r.max_tokens = 160;
        got g;
        if (!run(&r, &g, NULL))
            continue;
        CHECK_INT_EQ(g.finish, SH_FINISH_TOOL_CALLS);
        json_t *c = calls_of(&g, 1, par == 0 ? 1 : 8);
        size_t i;
        json_t *call;
        json_array_foreach(c, i, call) check_call(call);
        json_decref(c);
        CHECK(strstr(g.text, "<tool_call>") == NULL);
        CHECK(g.n_ids == g.completion_tokens);
        fprintf(stderr, "required%s: %s (text '%s')\n", par ? "" : ", one call", g.calls, g.text);
    }
}

/* A named function: one call of it, whichever the question is about. */
static void test_named(void)
{
    if (!eng)
        return;
    sh_request_opts r = sh_request_opts_default();
    r.messages = WEATHER_Q;
    r.n_messages = 1;
    r.tools = WEATHER;
    r.tool_choice = "{\"type\": \"function\", \"function\": {\"name\": \"add\"}}";
    r.max_tokens = 160;
    got g;
    if (!run(&r, &g, NULL))
        return;
    CHECK_INT_EQ(g.finish, SH_FINISH_TOOL_CALLS);
    json_t *c = calls_of(&g, 1, 1);
    const char *nm = c ? check_call(json_array_get(c, 0)) : NULL;
    CHECK(nm && !strcmp(nm, "add"));
    json_decref(c);
}

/* A round trip: the call the model made goes back as the assistant's tool_calls with a "tool"
 * message answering it; the model continues (text, finish STOP or LENGTH), and the prompt holds
 * the tool's answer (longer than the chat without it). tool_choice "none": no tools offered, no
 * calls taken out. */
static void test_round_trip(void)
{
    if (!eng)
        return;
    sh_request_opts r = sh_request_opts_default();
    r.messages = WEATHER_Q;
    r.n_messages = 1;
    r.tools = WEATHER;
    r.tool_choice = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}";
    r.max_tokens = 160;
    got g;
    if (!run(&r, &g, NULL))
        return;
    json_t *calls = calls_of(&g, 1, 1);
    if (!calls)
        return;
    const char *call_id = json_string_value(json_object_get(json_array_get(calls, 0), "id"));
    json_t *msgs = json_pack("[{s:s,s:s},{s:s,s:n,s:O},{s:s,s:s,s:s}]", "role", "user", "content",
                             WEATHER_Q[0].content, "role", "assistant", "content", "tool_calls",
                             calls, "role", "tool", "tool_call_id", call_id, "content",
                             "{\"temperature\": 21, \"sky\": \"sunny\"}");
    char *mj = json_dumps(msgs, JSON_COMPACT);
    json_decref(msgs);
    json_decref(calls);
    sh_request_opts r2 = sh_request_opts_default();
    r2.messages_json = mj;
    r2.tools = WEATHER;
    r2.max_tokens = 48;
    got g2;
    if (run(&r2, &g2, NULL)) {
        CHECK(g2.finish == SH_FINISH_STOP || g2.finish == SH_FINISH_LENGTH ||
              g2.finish == SH_FINISH_TOOL_CALLS);
        CHECK(g2.completion_tokens > 0);
        CHECK(g2.prompt_tokens > g.prompt_tokens + 20);
        fprintf(stderr, "round trip: prompt %d tokens, '%s' %s\n", g2.prompt_tokens, g2.text,
                g2.calls);
    }
    // "none": the same chat, no tools offered: a shorter prompt, the text as it comes.
    r2.tool_choice = "none";
    got g3;
    if (run(&r2, &g3, NULL)) {
        CHECK(g3.prompt_tokens < g2.prompt_tokens);
        CHECK_INT_EQ((int)strlen(g3.calls), 0);
        CHECK(g3.finish == SH_FINISH_STOP || g3.finish == SH_FINISH_LENGTH);
    }
    free(mj);
}

/* The same chat as messages and as messages_json: the same prompt and greedy text; with tools
 * and tool_choice "auto", whatever the model says is split so that no call text reaches
 * on_token. */
static void test_messages_json(void)
{
    if (!eng)
        return;
    static const sh_chat_message chat[] = {{"system", "You are terse."},
                                           {"user", "Name three colours."}};
    sh_request_opts r = sh_request_opts_default();
    r.messages = chat;
    r.n_messages = 2;
    r.max_tokens = 24;
    got a, b;
    if (!run(&r, &a, NULL))
        return;
    r.messages = NULL;
    r.n_messages = 0;
    r.messages_json = "[{\"role\":\"system\",\"content\":\"You are terse.\"},"
                      "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Name three "
                      "colours.\"}]}]";
    if (!run(&r, &b, NULL))
        return;
    CHECK_INT_EQ(b.prompt_tokens, a.prompt_tokens);
    CHECK_STR_EQ(b.text, a.text);
    CHECK_INT_EQ(b.finish, a.finish);
    r.messages_json = NULL;
    r.messages = WEATHER_Q;
    r.n_messages = 1;
    r.tools = WEATHER;
    r.max_tokens = 96;
    got c;
    if (run(&r, &c, NULL)) {
        CHECK(strstr(c.text, "<tool_call>") == NULL && strstr(c.text, "</tool_call>") == NULL);
        if (c.calls[0]) {
            json_t *cs = calls_of(&c, 1, 8);
            json_decref(cs);
            CHECK_INT_EQ(c.finish, SH_FINISH_TOOL_CALLS);
        }
        fprintf(stderr, "auto: '%s' %s\n", c.text, c.calls);
    }
}

typedef struct bad_case {
    const char *messages_json, *tools, *tool_choice, *prompt, *want;
    bool embed;
} bad_case;

/* Each bad field: SH_EINVAL naming it; nothing queued; the engine answers the next request. */
static void test_bad(void)
{
    if (!eng)
        return;
    static const char bad_params[] = "[{\"type\":\"function\",\"function\":{\"name\":\"f\","
                                     "\"parameters\":5}}]";
    static const char user[] = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    static const bad_case cases[] = {
        {user, "[{\"type\":", NULL, NULL, "tools is not JSON", false},
        {user, bad_params, NULL, NULL, "parameters", false},
        {user, WEATHER, "{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}", NULL, "nope",
         false},
        {user, WEATHER, "sometimes", NULL, "tool_choice must be", false},
        {user, NULL, "required", NULL, "tool_choice", false},
        {"[{\"role\":\"robot\",\"content\":\"hi\"}]", NULL, NULL, NULL, "role", false},
        {"{\"role\":\"user\"}", NULL, NULL, NULL, "messages", false},
        {"[]", NULL, NULL, NULL, "messages", false},
        {"[{\"role\":", NULL, NULL, NULL, "messages_json is not JSON", false},
        {NULL, WEATHER, NULL, "Hello", "need a chat", false},
        {user, WEATHER, NULL, NULL, "embedding", true},
        {user, NULL, NULL, "Hello", "exactly one of", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sh_request_opts r = sh_request_opts_default();
        r.messages_json = cases[i].messages_json;
        r.tools = cases[i].tools;
        r.tool_choice = cases[i].tool_choice;
        r.prompt = cases[i].prompt;
        r.embed = cases[i].embed;
        got g;
        sh_err code = SH_OK;
        CHECK(!run(&r, &g, &code));
        CHECK_INT_EQ(code, SH_EINVAL);
        if (!strstr(g.error, cases[i].want))
            SH_FAIL_("case %zu: '%s' does not name '%s'", i, g.error, cases[i].want);
        fprintf(stderr, "bad %zu: %s\n", i, g.error);
    }
    CHECK_INT_EQ(sh_pending(eng), 0);
    sh_request_opts r = sh_request_opts_default();
    r.messages = WEATHER_Q;
    r.n_messages = 1;
    r.max_tokens = 4;
    got g;
    if (run(&r, &g, NULL))
        CHECK_INT_EQ(g.completion_tokens, 4);
}

static void test_close(void)
{
    CHECK_OK(sh_engine_close(eng));
    eng = NULL;
}

static const sh_test_case tests[] = {{"required", test_required},
                                     {"named", test_named},
                                     {"round_trip", test_round_trip},
                                     {"messages_json", test_messages_json},
                                     {"bad", test_bad},
                                     {"close", test_close},
                                     {NULL, NULL}};

int main(int argc, char **argv)
{
    if (access(sh_test_path(MODEL), R_OK) != 0) {
        fprintf(stderr, "skip: %s is absent (scripts/get-model.sh)\n", MODEL);
        return SH_TEST_SKIP;
    }
    if (!open_engine())
        return 1;
    return sh_test_main(argc, argv, tests);
}
