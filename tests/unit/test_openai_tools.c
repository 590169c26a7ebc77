/* Tool calls (net/openai_tools.h): request fields and their 400s, rendering into each family's
 * syntax, parsing outputs (whole and streamed byte by byte), and the forcing grammars checked
 * with the grammar engine: valid calls accepted, invalid arguments refused. */
#include <jansson.h>

#include "model/grammar.h"
#include "net/openai.h"
#include "net/openai_tools.h"
#include "sh_test.h"

#define CHAT SH_OPENAI_CHAT

static const char TOOLS[] =
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":"
    "\"Weather of a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{"
    "\"type\":\"string\"},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]";

static sh_openai_request *parse(const char *body, sh_openai_error *e)
{
    sh_openai_request *r = NULL;
    *e = (sh_openai_error){0};
    sh_openai_request_parse(CHAT, body, strlen(body), NULL, &r, e);
    return r;
}

static sh_openai_request *parse_ok(const char *body)
{
    sh_openai_error e;
    sh_openai_request *r = parse(body, &e);
    if (!r)
        SH_FAIL_("parse of %s failed: %d %s", body, e.status, e.message);
    return r;
}

static void bad(const char *body, const char *param, const char *in_message)
{
    sh_openai_error e;
    sh_openai_request *r = parse(body, &e);
    if (r) {
        SH_FAIL_("accepted %s", body);
        sh_openai_request_free(r);
        return;
    }
    CHECK_INT_EQ(e.status, 400);
    CHECK_STR_EQ(e.param, param);
    if (in_message && !strstr(e.message, in_message))
        SH_FAIL_("%s: message '%s' lacks '%s'", body, e.message, in_message);
}

static char *with_tools(const char *msgs, const char *extra)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "{\"model\":\"m\",\"messages\":%s,%s%s}", msgs, TOOLS, extra);
    return buf;
}

static const char USER[] = "[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}]";

static void test_request_fields(void)
{
    sh_openai_request *r = parse_ok(with_tools(USER, ""));
    CHECK_INT_EQ(r->n_tools, 2);
    CHECK_INT_EQ(r->tool_choice, SH_OPENAI_TOOL_CHOICE_AUTO);
    CHECK(r->parallel_tool_calls);
    CHECK(sh_openai_tools_active(r));
    sh_openai_request_free(r);
    r = parse_ok(with_tools(USER, ",\"tool_choice\":\"none\""));
    CHECK_INT_EQ(r->tool_choice, SH_OPENAI_TOOL_CHOICE_NONE);
    CHECK(!sh_openai_tools_active(r));
    sh_openai_request_free(r);
    r = parse_ok(with_tools(USER, ",\"tool_choice\":\"required\",\"parallel_tool_calls\":false"));
    CHECK_INT_EQ(r->tool_choice, SH_OPENAI_TOOL_CHOICE_REQUIRED);
    CHECK(!r->parallel_tool_calls);
    sh_openai_request_free(r);
    r = parse_ok(with_tools(USER, ",\"tool_choice\":{\"type\":\"function\",\"function\":{"
                                  "\"name\":\"now\"}}"));
    CHECK_INT_EQ(r->tool_choice, SH_OPENAI_TOOL_CHOICE_NAMED);
    CHECK_INT_EQ(r->tool_named, 1);
    sh_openai_request_free(r);
    // A conversation with a call and its result.
    r = parse_ok(with_tools(
        "[{\"role\":\"user\",\"content\":\"Weather?\"},{\"role\":\"assistant\",\"content\":null,"
        "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
        "\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},{\"role\":\"tool\","
        "\"tool_call_id\":\"call_1\",\"content\":\"21 C\"}]",
        ""));
    CHECK_INT_EQ(r->n_messages, 3);
    CHECK_INT_EQ(r->messages[1].role, SH_OPENAI_ASSISTANT);
    CHECK(r->messages[1].tool_calls != NULL);
    CHECK_STR_EQ(r->messages[1].content, "");
    CHECK_INT_EQ(r->messages[2].role, SH_OPENAI_TOOL);
    CHECK_STR_EQ(r->messages[2].tool_call_id, "call_1");
    CHECK_STR_EQ(r->messages[2].content, "21 C");
    sh_openai_request_free(r);
}

static void test_bad_requests(void)
{
    bad(with_tools(USER, ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"x\"}}"),
        "tool_choice", "'x'");
    bad(with_tools(USER, ",\"tool_choice\":\"always\""), "tool_choice", NULL);
    bad(with_tools(USER, ",\"tool_choice\":{\"type\":\"function\"}"), "tool_choice", NULL);
    bad(with_tools(USER, ",\"parallel_tool_calls\":1"), "parallel_tool_calls", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":"
        "\"required\"}",
        "tool_choice", "needs 'tools'");
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}",
        "tools", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
        "\"type\":\"retrieval\"}]}",
        "tools[0]", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
        "\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}",
        "tools[0].function.name", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
        "\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"type\":\"function\","
        "\"function\":{\"name\":\"a\"}}]}",
        "tools[1].function.name", "twice");
    // Parameters that are not a schema the converter accepts: a 400 naming the tool.
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
        "\"type\":\"function\",\"function\":{\"name\":\"calc\",\"parameters\":{\"type\":"
        "\"object\",\"if\":{}}}}]}",
        "tools[0].function.parameters", "tool 'calc'");
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
        "\"type\":\"function\",\"function\":{\"name\":\"calc\",\"parameters\":[1]}}]}",
        "tools[0].function.parameters", "tool 'calc'");
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}",
        "messages[0].tool_call_id", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}]}",
        "messages[0].tool_calls", "assistant");
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":"
        "[{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{}}}]}]}",
        "messages[0].tool_calls[0].function", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":"
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}]}",
        "messages[0].tool_calls[0]", NULL);
    bad("{\"model\":\"m\",\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}",
        "messages[0].role", NULL);
}

static const char CONV[] =
    "[{\"role\":\"user\",\"content\":\"Weather?\"},{\"role\":\"assistant\",\"content\":null,"
    "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
    "\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},{\"role\":\"tool\","
    "\"tool_call_id\":\"call_1\",\"content\":\"21 C\"},{\"role\":\"tool\",\"tool_call_id\":"
    "\"call_2\",\"content\":\"noon\"},{\"role\":\"user\",\"content\":\"And now?\"}]";

static void has(const char *s, const char *want)
{
    if (!strstr(s, want))
        SH_FAIL_("'%s' does not hold '%s'", s, want);
}

static void test_render(void)
{
    sh_openai_request *r = parse_ok(with_tools(CONV, ""));
    sh_openai_chat_text t;
    // Hermes (ChatML): tools in a system message made from the default one.
    CHECK_OK(sh_openai_tools_render(r, SH_OPENAI_TOOLS_HERMES, "You are Bob.", &t));
    CHECK_INT_EQ(t.n, 5); // system, user, assistant, one user turn for both results, user
    CHECK_STR_EQ(t.msgs[0].role, "system");
    has(t.msgs[0].content, "You are Bob.\n\n# Tools\n");
    has(t.msgs[0].content,
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", ");
    has(t.msgs[0].content, "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}\n</tools>");
    CHECK_STR_EQ(t.msgs[2].role, "assistant");
    CHECK_STR_EQ(t.msgs[2].content,
                 "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                 "\"Paris\"}}\n</tool_call>");
    CHECK_STR_EQ(t.msgs[3].role, "user");
    CHECK_STR_EQ(t.msgs[3].content, "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n"
                                    "noon\n</tool_response>");
    CHECK_STR_EQ(t.msgs[4].content, "And now?");
    sh_openai_chat_text_fini(&t);
    // Llama 3: the tools in the first user message, results as ipython turns.
    CHECK_OK(sh_openai_tools_render(r, SH_OPENAI_TOOLS_LLAMA3, NULL, &t));
    CHECK_INT_EQ(t.n, 5); // each result its own ipython turn
    CHECK_STR_EQ(t.msgs[0].role, "user");
    has(t.msgs[0].content, "Given the following functions");
    has(t.msgs[0].content, "\"name\": \"get_weather\"");
    has(t.msgs[0].content, "}\n\nWeather?");
    CHECK_STR_EQ(t.msgs[1].content,
                 "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
    CHECK_STR_EQ(t.msgs[2].role, "ipython");
    CHECK_STR_EQ(t.msgs[2].content, "21 C");
    CHECK_STR_EQ(t.msgs[3].role, "ipython");
    CHECK_STR_EQ(t.msgs[4].content, "And now?");
    sh_openai_chat_text_fini(&t);
    // Mistral: the tools before the last user message.
    CHECK_OK(sh_openai_tools_render(r, SH_OPENAI_TOOLS_MISTRAL, NULL, &t));
    CHECK_INT_EQ(t.n, 5);
    CHECK_STR_EQ(t.msgs[0].content, "Weather?");
    CHECK_STR_EQ(t.msgs[1].content, "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": "
                                    "{\"city\": \"Paris\"}, \"id\": \"call_1\"}]");
    CHECK_STR_EQ(t.msgs[2].content,
                 "[TOOL_RESULTS] {\"call_id\": \"call_1\", \"content\": \"21 C\"}[/TOOL_RESULTS]");
    has(t.msgs[4].content, "[AVAILABLE_TOOLS] [{\"type\": \"function\"");
    has(t.msgs[4].content, "[/AVAILABLE_TOOLS]And now?");
    sh_openai_chat_text_fini(&t);
    sh_openai_request_free(r);
    // tool_choice none: the tools are not shown; the conversation's calls still are.
    r = parse_ok(with_tools(CONV, ",\"tool_choice\":\"none\""));
    CHECK_OK(sh_openai_tools_render(r, SH_OPENAI_TOOLS_GENERIC, "Sys", &t));
    CHECK_INT_EQ(t.n, 4);
    CHECK_STR_EQ(t.msgs[0].role, "user");
    has(t.msgs[1].content, "<tool_call>");
    sh_openai_chat_text_fini(&t);
    sh_openai_request_free(r);
    // No tools at all: the messages as they are.
    r = parse_ok("{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":"
                 "\"user\",\"content\":\"U\"}]}");
    CHECK_OK(sh_openai_tools_render(r, SH_OPENAI_TOOLS_HERMES, "D", &t));
    CHECK_INT_EQ(t.n, 2);
    CHECK_STR_EQ(t.msgs[0].content, "S");
    CHECK_STR_EQ(t.msgs[1].role, "user");
    sh_openai_chat_text_fini(&t);
    sh_openai_request_free(r);
}

/* Checks a parsed calls array: names and arguments in order, distinct "call_" ids. */
static void check_calls(const char *calls_json, int n, const char *const *names,
                        const char *const *args)
{
    json_t *a = json_loads(calls_json ? calls_json : "null", 0, NULL);
    if (!json_is_array(a) || json_array_size(a) != (size_t)n) {
        SH_FAIL_("calls %s, want %d", calls_json ? calls_json : "NULL", n);
        json_decref(a);
        return;
    }
    for (int i = 0; i < n; i++) {
        json_t *c = json_array_get(a, (size_t)i);
        const char *id = json_string_value(json_object_get(c, "id"));
        CHECK(id && strncmp(id, "call_", 5) == 0 && strlen(id) > 10);
        for (int k = 0; k < i; k++)
            CHECK(strcmp(id, json_string_value(
                                 json_object_get(json_array_get(a, (size_t)k), "id"))) != 0);
        CHECK_STR_EQ(json_string_value(json_object_get(c, "type")), "function");
        json_t *fn = json_object_get(c, "function");
        CHECK_STR_EQ(json_string_value(json_object_get(fn, "name")), names[i]);
        CHECK_STR_EQ(json_string_value(json_object_get(fn, "arguments")), args[i]);
    }
    json_decref(a);
}

static void parse_case(sh_openai_tool_style st, const char *text, const char *content, int n,
                       const char *const *names, const char *const *args)
{
    char *c = NULL, *calls = NULL;
    CHECK_OK(sh_openai_tools_parse(st, text, strlen(text), 42, &c, &calls));
    if (content)
        CHECK_STR_EQ(c ? c : "(null)", content);
    else if (c)
        SH_FAIL_("%s: content '%s', want null", text, c);
    if (n == 0 && calls)
        SH_FAIL_("%s: calls %s, want none", text, calls);
    if (n)
        check_calls(calls, n, names, args);
    free(c);
    free(calls);
}

static void test_parse(void)
{
    const char *n2[] = {"get_weather", "now"};
    const char *a2[] = {"{\"city\":\"Paris\"}", "{}"};
    parse_case(SH_OPENAI_TOOLS_HERMES,
               "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
               "\"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"now\",\"arguments\":{}}"
               "</tool_call>",
               "Let me check.", 2, n2, a2);
    // The last call may lack its end marker (the model stopped right after it).
    parse_case(SH_OPENAI_TOOLS_GENERIC, "<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}",
               NULL, 1, n2 + 1, a2 + 1);
    // Not JSON, or no name: stays content.
    parse_case(SH_OPENAI_TOOLS_HERMES, "a <tool_call>{nope}</tool_call> b",
               "a <tool_call>{nope}</tool_call> b", 0, NULL, NULL);
    parse_case(SH_OPENAI_TOOLS_HERMES, "<tool_call>{\"arguments\":{}}</tool_call>",
               "<tool_call>{\"arguments\":{}}</tool_call>", 0, NULL, NULL);
    parse_case(SH_OPENAI_TOOLS_HERMES, "  Plain answer.\n", "Plain answer.", 0, NULL, NULL);
    // Arguments must be an object (or a string holding one).
    parse_case(SH_OPENAI_TOOLS_HERMES,
               "<tool_call>{\"name\":\"now\",\"arguments\":\"x\"}</tool_call>",
               "<tool_call>{\"name\":\"now\",\"arguments\":\"x\"}</tool_call>", 0, NULL, NULL);
    parse_case(SH_OPENAI_TOOLS_HERMES,
               "<tool_call>{\"name\":\"now\",\"arguments\":[1]}</tool_call>",
               "<tool_call>{\"name\":\"now\",\"arguments\":[1]}</tool_call>", 0, NULL, NULL);
    // Llama 3: the whole output is the call(s).
    parse_case(SH_OPENAI_TOOLS_LLAMA3,
               "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; "
               "{\"name\": \"now\", \"parameters\": {}}",
               NULL, 2, n2, a2);
    parse_case(SH_OPENAI_TOOLS_LLAMA3, "{\"name\": \"now\", \"parameters\": {}} and more",
               "{\"name\": \"now\", \"parameters\": {}} and more", 0, NULL, NULL);
    parse_case(SH_OPENAI_TOOLS_LLAMA3, "It is sunny.", "It is sunny.", 0, NULL, NULL);
    // Mistral: an array after [TOOL_CALLS] (the marker may be a special token, not in the text).
    parse_case(SH_OPENAI_TOOLS_MISTRAL,
               "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, "
               "{\"name\": \"now\", \"arguments\": {}}]",
               NULL, 2, n2, a2);
    parse_case(SH_OPENAI_TOOLS_MISTRAL, " [{\"name\": \"now\", \"arguments\": {}}]", NULL, 1,
               n2 + 1, a2 + 1);
    parse_case(SH_OPENAI_TOOLS_MISTRAL, "[1, 2]", "[1, 2]", 0, NULL, NULL);
}

/* Streams text one byte at a time; the content and the calls must equal a whole parse's. */
static void stream_case(sh_openai_tool_style st, const char *text)
{
    sh_openai_toolstream s;
    sh_openai_toolstream_init(&s, st, 7);
    char content[1024] = "";
    json_t *calls = json_array();
    size_t n = strlen(text);
    for (size_t i = 0; i <= n; i++) {
        const char *c, *d;
        CHECK_OK(sh_openai_toolstream_feed(&s, text + i, i < n ? 1 : 0, i == n, &c, &d));
        if (c)
            strncat(content, c, sizeof content - strlen(content) - 1);
        if (d) {
            json_t *a = json_loads(d, 0, NULL);
            size_t k;
            json_t *e;
            json_array_foreach(a, k, e)
            {
                CHECK_INT_EQ(json_integer_value(json_object_get(e, "index")),
                             (long long)json_array_size(calls));
                json_object_del(e, "index");
                json_array_append(calls, e);
            }
            json_decref(a);
        }
    }
    char *wc = NULL, *wcalls = NULL;
    CHECK_OK(sh_openai_tools_parse(st, text, n, 7, &wc, &wcalls));
    // Content: the same text but for the whitespace the whole parse trims.
    char *p = content;
    while (*p == ' ' || *p == '\n')
        p++;
    size_t pl = strlen(p);
    while (pl && (p[pl - 1] == ' ' || p[pl - 1] == '\n'))
        pl--;
    p[pl] = '\0';
    CHECK_STR_EQ(p, wc ? wc : "");
    json_t *want = json_loads(wcalls ? wcalls : "[]", 0, NULL);
    CHECK_INT_EQ((long long)json_array_size(calls), (long long)json_array_size(want));
    for (size_t i = 0; i < json_array_size(want) && i < json_array_size(calls); i++) {
        json_t *a = json_object_get(json_array_get(calls, i), "function");
        json_t *b = json_object_get(json_array_get(want, i), "function");
        CHECK(json_equal(a, b));
    }
    CHECK_INT_EQ(s.n_calls, (int)json_array_size(want));
    json_decref(want);
    json_decref(calls);
    free(wc);
    free(wcalls);
    sh_openai_toolstream_fini(&s);
}

static void test_stream(void)
{
    stream_case(SH_OPENAI_TOOLS_HERMES,
                "Checking <tool_ <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                "{\"city\": \"Paris\"}}\n</tool_call> then <tool_call>{\"name\":\"now\","
                "\"arguments\":{}}</tool_call> done <tool_ca");
    stream_case(SH_OPENAI_TOOLS_HERMES, "just text, no calls");
    stream_case(SH_OPENAI_TOOLS_HERMES, "<tool_call>{bad}</tool_call> after");
    stream_case(SH_OPENAI_TOOLS_GENERIC, "<tool_call>{\"name\":\"now\",\"arguments\":{}}");
    stream_case(SH_OPENAI_TOOLS_LLAMA3, "  {\"name\": \"now\", \"parameters\": {}}");
    stream_case(SH_OPENAI_TOOLS_LLAMA3, "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}");
    stream_case(SH_OPENAI_TOOLS_LLAMA3, "<|python is not a tag");
    stream_case(SH_OPENAI_TOOLS_LLAMA3, "Sunny today.");
    stream_case(SH_OPENAI_TOOLS_MISTRAL, "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]");
    stream_case(SH_OPENAI_TOOLS_MISTRAL, "No calls.");
}

static bool grammar_accepts(const sh_grammar *g, const char *s)
{
    sh_gmatch *m = NULL;
    sh_error e = {0};
    if (sh_gmatch_create(g, &m, &e)) {
        SH_FAIL_("gmatch: %s", e.msg);
        return false;
    }
    bool ok = sh_gmatch_accept_bytes(m, s, strlen(s)) && sh_gmatch_can_end(m);
    sh_gmatch_free(m);
    return ok;
}

static void grammar_case(sh_openai_tool_style st, const char *extra, const char *const *good,
                         const char *const *badv)
{
    sh_openai_request *r = parse_ok(with_tools(USER, extra));
    char *gbnf = NULL;
    sh_error e = {0};
    CHECK_OK(sh_openai_tools_grammar(r, st, &gbnf, &e));
    CHECK(gbnf != NULL);
    sh_grammar *g = NULL;
    if (!gbnf || sh_grammar_parse(gbnf, strlen(gbnf), &g, &e)) {
        SH_FAIL_("grammar for %s does not parse: %s\n%s", extra, e.msg, gbnf ? gbnf : "");
        free(gbnf);
        sh_openai_request_free(r);
        return;
    }
    for (const char *const *s = good; *s; s++) {
        if (!grammar_accepts(g, *s))
            SH_FAIL_("%s %s: refused %s", sh_openai_tool_style_name(st), extra, *s);
        // What the grammar allows parses back as calls, nothing left over.
        char *c = NULL, *calls = NULL;
        CHECK_OK(sh_openai_tools_parse(st, *s, strlen(*s), 1, &c, &calls));
        if (c || !calls)
            SH_FAIL_("%s: parsed to content '%s', calls %s", *s, c ? c : "", calls ? calls : "");
        free(c);
        free(calls);
    }
    for (const char *const *s = badv; *s; s++)
        if (grammar_accepts(g, *s))
            SH_FAIL_("%s %s: accepted %s", sh_openai_tool_style_name(st), extra, *s);
    sh_grammar_free(g);
    free(gbnf);
    sh_openai_request_free(r);
}

static void test_grammar(void)
{
    const char *named = ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
                        "\"get_weather\"}}";
    const char *req1 = ",\"tool_choice\":\"required\",\"parallel_tool_calls\":false";
    const char *reqn = ",\"tool_choice\":\"required\"";
    const char *hw = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                     "\"Paris\", \"unit\": \"c\"}}\n</tool_call>";
    const char *hn = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    char both[512];
    snprintf(both, sizeof both, "%s\n%s", hw, hn);
    {
        const char *good[] = {hw, NULL};
        const char *badv[] = {hn,
                              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n"
                              "</tool_call>",
                              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                              "\"Paris\", \"unit\": \"k\"}}\n</tool_call>",
                              both,
                              "hello",
                              "",
                              NULL};
        grammar_case(SH_OPENAI_TOOLS_HERMES, named, good, badv);
        grammar_case(SH_OPENAI_TOOLS_GENERIC, named, good, badv);
    }
    {
        const char *good[] = {hw, hn, NULL};
        const char *badv[] = {both, "", NULL};
        grammar_case(SH_OPENAI_TOOLS_HERMES, req1, good, badv);
    }
    {
        const char *good[] = {hw, hn, both, NULL};
        const char *badv[] = {"", "text", NULL};
        grammar_case(SH_OPENAI_TOOLS_HERMES, reqn, good, badv);
    }
    {
        const char *good[] = {"{\"name\": \"now\", \"parameters\": {}}",
                              "{\"name\": \"now\", \"parameters\": {}}; {\"name\": "
                              "\"get_weather\", \"parameters\": {\"city\": \"x\"}}",
                              NULL};
        const char *badv[] = {"{\"name\": \"now\", \"parameters\": {\"a\": 1}}", NULL};
        grammar_case(SH_OPENAI_TOOLS_LLAMA3, reqn, good, badv);
    }
    {
        const char *good[] = {"[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": "
                              "{\"city\": \"Rome\"}}]",
                              NULL};
        const char *badv[] = {"[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]",
                              "[TOOL_CALLS] []", NULL};
        grammar_case(SH_OPENAI_TOOLS_MISTRAL, named, good, badv);
    }
    // auto and none force nothing.
    sh_openai_request *r = parse_ok(with_tools(USER, ""));
    char *gbnf = (char *)"x";
    sh_error e = {0};
    CHECK_OK(sh_openai_tools_grammar(r, SH_OPENAI_TOOLS_HERMES, &gbnf, &e));
    CHECK(gbnf == NULL);
    sh_openai_request_free(r);
    // A forced call with a response_format grammar too: refused.
    bad(with_tools(USER, ",\"tool_choice\":\"required\",\"response_format\":{\"type\":"
                         "\"json_object\"}"),
        "tool_choice", "response_format");
}

static void test_responses(void)
{
    sh_openai_meta meta = {.kind = SH_OPENAI_CHAT, .id = "chatcmpl-1", .created = 1, .model = "m"};
    const char *calls = "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"now\","
                        "\"arguments\":\"{}\"}}]";
    sh_openai_choice ch = {.index = 0, .finish = SH_OPENAI_FINISH_TOOL_CALLS, .tool_calls = calls};
    char *s = sh_openai_response_json(&meta, &ch, 1, NULL);
    json_t *j = json_loads(s, 0, NULL);
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(c0, "message");
    CHECK(json_is_null(json_object_get(msg, "content")));
    CHECK_STR_EQ(json_string_value(json_object_get(c0, "finish_reason")), "tool_calls");
    CHECK_STR_EQ(
        json_string_value(json_object_get(
            json_object_get(json_array_get(json_object_get(msg, "tool_calls"), 0), "function"),
            "name")),
        "now");
    json_decref(j);
    free(s);
    const char *delta = "[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{"
                        "\"name\":\"now\",\"arguments\":\"{}\"}}]";
    sh_openai_choice d = {.index = 0, .tool_calls = delta};
    s = sh_openai_chunk_sse(&meta, &d, false, false);
    CHECK(s && strncmp(s, "data: ", 6) == 0);
    j = json_loads(s + 6, 0, NULL);
    json_t *dl = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
    CHECK(json_object_get(dl, "content") == NULL);
    CHECK_INT_EQ(json_integer_value(json_object_get(
                     json_array_get(json_object_get(dl, "tool_calls"), 0), "index")),
                 0);
    json_decref(j);
    free(s);
}

static const sh_test_case tests[] = {
    {"request_fields", test_request_fields},
    {"bad_requests", test_bad_requests},
    {"render", test_render},
    {"parse", test_parse},
    {"stream", test_stream},
    {"grammar", test_grammar},
    {"responses", test_responses},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
