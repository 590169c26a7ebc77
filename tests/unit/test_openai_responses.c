/* The Responses API codec (net/openai_responses.h): input items, tools and text.format turned
 * into the chat request they amount to, the 400s naming Responses fields, the response object,
 * and the stream's events (order, sequence numbers, UTF-8 held across pieces). */
#include <jansson.h>

#include "net/openai.h"
#include "net/openai_responses.h"
#include "sh_test.h"

static sh_openai_request *parse(const char *body, sh_openai_error *e)
{
    sh_openai_request *r = NULL;
    *e = (sh_openai_error){0};
    sh_openai_responses_parse(body, strlen(body), NULL, &r, e);
    return r;
}

static sh_openai_request *parse_ok(const char *body)
{
    sh_openai_error e;
    sh_openai_request *r = parse(body, &e);
    if (!r)
        SH_FAIL_("parse of %s failed: %d %s (%s)", body, e.status, e.message, e.param);
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

static void test_input(void)
{
    sh_openai_request *r = parse_ok("{\"model\":\"m\",\"input\":\"Hello\"}");
    if (!r)
        return;
    CHECK_INT_EQ(r->kind, SH_OPENAI_CHAT);
    CHECK_INT_EQ(r->n_messages, 1);
    CHECK_INT_EQ(r->messages[0].role, SH_OPENAI_USER);
    CHECK_STR_EQ(r->messages[0].content, "Hello");
    CHECK_INT_EQ(r->n, 1);
    CHECK(r->resp_echo != NULL);
    sh_openai_request_free(r);

    /* instructions first, developer as system, parts joined, an assistant's output_text, a call
     * joining the assistant message before it and its output as a tool message */
    r = parse_ok(
        "{\"model\":\"m\",\"instructions\":\"Be brief.\",\"max_output_tokens\":17,"
        "\"temperature\":0,\"input\":[{\"role\":\"developer\",\"content\":\"dev\"},"
        "{\"type\":\"message\",\"role\":\"user\",\"content\":[{\"type\":\"input_text\",\"text\":"
        "\"a\"},{\"type\":\"input_text\",\"text\":\"b\"}]},"
        "{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"status\":\"completed\","
        "\"content\":[{\"type\":\"output_text\",\"text\":\"Let me look.\",\"annotations\":[]}]},"
        "{\"type\":\"function_call\",\"call_id\":\"call_9\",\"name\":\"now\",\"arguments\":\"{}\"},"
        "{\"type\":\"function_call_output\",\"call_id\":\"call_9\",\"output\":\"12:00\"}]}");
    if (!r)
        return;
    CHECK_INT_EQ(r->n_messages, 5);
    CHECK_INT_EQ(r->messages[0].role, SH_OPENAI_SYSTEM);
    CHECK_STR_EQ(r->messages[0].content, "Be brief.");
    CHECK_INT_EQ(r->messages[1].role, SH_OPENAI_SYSTEM);
    CHECK_STR_EQ(r->messages[2].content, "ab");
    CHECK_INT_EQ(r->messages[3].role, SH_OPENAI_ASSISTANT);
    CHECK_STR_EQ(r->messages[3].content, "Let me look.");
    const json_t *calls = r->messages[3].tool_calls;
    CHECK(calls && json_array_size(calls) == 1);
    CHECK_STR_EQ(json_string_value(json_object_get(json_array_get(calls, 0), "id")), "call_9");
    CHECK_INT_EQ(r->messages[4].role, SH_OPENAI_TOOL);
    CHECK_STR_EQ(r->messages[4].tool_call_id, "call_9");
    CHECK_STR_EQ(r->messages[4].content, "12:00");
    CHECK_INT_EQ(r->max_tokens, 17);
    CHECK(r->temperature == 0.0f);
    json_t *echo = json_loads(r->resp_echo, 0, NULL);
    CHECK_STR_EQ(json_string_value(json_object_get(echo, "instructions")), "Be brief.");
    CHECK_INT_EQ(json_integer_value(json_object_get(echo, "max_output_tokens")), 17);
    CHECK_STR_EQ(json_string_value(json_object_get(echo, "tool_choice")), "auto");
    CHECK(json_is_array(json_object_get(echo, "tools")));
    json_decref(echo);
    sh_openai_request_free(r);

    /* the values in force are echoed as written (0.95, not 0.949999988) */
    r = parse_ok("{\"model\":\"m\",\"input\":\"x\",\"top_p\":0.95}");
    if (!r)
        return;
    echo = json_loads(r->resp_echo, 0, NULL);
    CHECK(json_real_value(json_object_get(echo, "top_p")) == 0.95);
    CHECK(json_real_value(json_object_get(echo, "temperature")) == 1.0);
    json_decref(echo);
    sh_openai_request_free(r);

    /* a call with no assistant message before it makes one; store false is fine */
    r = parse_ok("{\"model\":\"m\",\"store\":false,\"input\":[{\"role\":\"user\",\"content\":"
                 "\"q\"},{\"type\":\"function_call\",\"call_id\":\"c1\",\"name\":\"f\","
                 "\"arguments\":\"{}\"},{\"type\":\"function_call\",\"call_id\":\"c2\","
                 "\"name\":\"g\",\"arguments\":\"{}\"}]}");
    if (!r)
        return;
    CHECK_INT_EQ(r->n_messages, 2);
    CHECK_INT_EQ(json_array_size(r->messages[1].tool_calls), 2);
    sh_openai_request_free(r);
}

static const char TOOL[] =
    "\"tools\":[{\"type\":\"function\",\"name\":\"get_weather\",\"description\":\"d\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
    "\"required\":[\"city\"]},\"strict\":true}]";

static void test_tools_and_format(void)
{
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\":\"m\",\"input\":\"w\",%s,\"tool_choice\":{\"type\":\"function\","
             "\"name\":\"get_weather\"},\"parallel_tool_calls\":false}",
             TOOL);
    sh_openai_request *r = parse_ok(body);
    if (!r)
        return;
    CHECK_INT_EQ(r->n_tools, 1);
    CHECK_INT_EQ(r->tool_choice, SH_OPENAI_TOOL_CHOICE_NAMED);
    CHECK_INT_EQ(r->tool_named, 0);
    CHECK(!r->parallel_tool_calls);
    json_t *echo = json_loads(r->resp_echo, 0, NULL);
    CHECK_STR_EQ(json_string_value(
                     json_object_get(json_array_get(json_object_get(echo, "tools"), 0), "name")),
                 "get_weather");
    CHECK(json_is_false(json_object_get(echo, "parallel_tool_calls")));
    json_decref(echo);
    sh_openai_request_free(r);

    r = parse_ok("{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\","
                 "\"name\":\"p\",\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{"
                 "\"type\":\"integer\"}},\"required\":[\"a\"]},\"strict\":true}}}");
    if (!r)
        return;
    CHECK(r->grammar != NULL);
    sh_openai_request_free(r);
    r = parse_ok(
        "{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_object\"}}}");
    if (r)
        CHECK(r->grammar != NULL);
    sh_openai_request_free(r);
    r = parse_ok("{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"text\"}}}");
    if (r)
        CHECK(r->grammar == NULL);
    sh_openai_request_free(r);
}

static void test_bad(void)
{
    bad("{\"model\":\"m\"}", "input", NULL);
    bad("{\"model\":\"m\",\"input\":[]}", "input", NULL);
    bad("{\"model\":\"m\",\"input\":42}", "input", NULL);
    bad("{\"model\":\"m\",\"input\":[\"hi\"]}", "input[0]", NULL);
    bad("{\"model\":\"m\",\"input\":[{\"type\":\"reasoning\",\"summary\":[]}]}", "input[0].type",
        "reasoning");
    bad("{\"model\":\"m\",\"input\":[{\"role\":\"robot\",\"content\":\"x\"}]}", "input[0].role",
        NULL);
    bad("{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_image\","
        "\"image_url\":\"x\"}]}]}",
        "input[0].content[0]", "text only");
    bad("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":"
        "\"{}\"}]}",
        "input[0].call_id", NULL);
    bad("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"c\",\"name\":"
        "\"a b\",\"arguments\":\"{}\"}]}",
        "input[0].name", NULL);
    bad("{\"model\":\"m\",\"input\":[{\"type\":\"function_call_output\",\"call_id\":\"c\"}]}",
        "input[0].output", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"previous_response_id\":\"resp_1\"}",
        "previous_response_id", "stateless");
    bad("{\"model\":\"m\",\"input\":\"x\",\"store\":true}", "store", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"background\":true}", "background", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"conversation\":\"conv_1\"}", "conversation", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"messages\":[]}", "messages", "input");
    bad("{\"model\":\"m\",\"input\":\"x\",\"max_tokens\":5}", "max_tokens", "max_output_tokens");
    bad("{\"model\":\"m\",\"input\":\"x\",\"tools\":[{\"type\":\"web_search\"}]}", "tools[0].type",
        "web_search");
    bad("{\"model\":\"m\",\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"function\":{"
        "\"name\":\"f\"}}]}",
        "tools[0]", "flat");
    bad("{\"model\":\"m\",\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"f\","
        "\"parameters\":{\"type\":\"object\",\"if\":{}}}]}",
        "tools[0].parameters", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"a b\"}]}",
        "tools[0].name", NULL);
    char body[1024];
    snprintf(body, sizeof body,
             "{\"model\":\"m\",\"input\":\"x\",%s,\"tool_choice\":{\"type\":\"function\","
             "\"name\":\"launch\"}}",
             TOOL);
    bad(body, "tool_choice", "launch");
    snprintf(body, sizeof body,
             "{\"model\":\"m\",\"input\":\"x\",%s,\"tool_choice\":{\"type\":\"file_search\"}}",
             TOOL);
    bad(body, "tool_choice", "file_search");
    bad("{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"yaml\"}}}",
        "text.format.type", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\","
        "\"name\":\"p\",\"schema\":{\"type\":\"object\",\"if\":{}}}}}",
        "text.format.schema", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"max_output_tokens\":0}", "max_output_tokens",
        "'max_output_tokens'");
    bad("{\"model\":\"m\",\"input\":\"x\",\"temperature\":3}", "temperature", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"metadata\":{\"k\":1}}", "metadata", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"instructions\":5}", "instructions", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"top_logprobs\":3}", "top_logprobs", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"truncation\":\"auto\"}", "truncation", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\",\"mirostat\":2}", "mirostat", NULL);
    bad("{\"model\":\"m\",\"input\":\"x\"", "", "parse the JSON");
    /* neutral values of the refused fields pass */
    sh_openai_request *r = parse_ok("{\"model\":\"m\",\"input\":\"x\",\"previous_response_id\":"
                                    "null,\"background\":false,\"include\":[],\"truncation\":"
                                    "\"disabled\",\"top_logprobs\":0,\"reasoning\":{\"effort\":"
                                    "null},\"service_tier\":\"auto\",\"n\":1}");
    sh_openai_request_free(r);
}

/* Splits an event stream into (type, data) and checks the framing and sequence numbers. */
static int32_t events(const char *sse, json_t **out, int32_t max, int64_t *seq)
{
    int32_t n = 0;
    const char *p = sse;
    while (*p && n < max) {
        CHECK(strncmp(p, "event: ", 7) == 0);
        const char *nl = strchr(p, '\n');
        if (!nl || strncmp(nl + 1, "data: ", 6) != 0) {
            SH_FAIL_("bad framing at '%.40s'", p);
            return n;
        }
        const char *end = strstr(nl, "\n\n");
        if (!end)
            return n;
        json_t *d = json_loadb(nl + 7, (size_t)(end - nl - 7), 0, NULL);
        CHECK(d != NULL);
        const char *type = json_string_value(json_object_get(d, "type"));
        if (!type || strncmp(p + 7, type, strlen(type)) != 0)
            SH_FAIL_("event name '%.40s' != type '%s'", p + 7, type ? type : "");
        CHECK_INT_EQ(json_integer_value(json_object_get(d, "sequence_number")), *seq);
        (*seq)++;
        out[n++] = d;
        p = end + 2;
    }
    return n;
}

static const char *type_of(json_t *d) { return json_string_value(json_object_get(d, "type")); }

static void test_stream(void)
{
    sh_openai_resp s;
    CHECK_OK(sh_openai_resp_init(&s, "resp_abc", 1700000000, "m",
                                 "{\"instructions\":null,\"tools\":[],\"tool_choice\":\"auto\","
                                 "\"temperature\":1.0,\"top_p\":1.0,\"parallel_tool_calls\":true,"
                                 "\"text\":{\"format\":{\"type\":\"text\"}},\"metadata\":{}}"));
    json_t *ev[32];
    int64_t seq = 0;
    int32_t n = events(sh_openai_resp_start(&s), ev, 32, &seq);
    CHECK_INT_EQ(n, 2);
    CHECK_STR_EQ(type_of(ev[0]), "response.created");
    CHECK_STR_EQ(type_of(ev[1]), "response.in_progress");
    CHECK_STR_EQ(json_string_value(json_object_get(json_object_get(ev[0], "response"), "status")),
                 "in_progress");
    for (int32_t i = 0; i < n; i++)
        json_decref(ev[i]);
    /* "é" (C3 A9) cut between two pieces comes out whole in the second delta */
    n = events(sh_openai_resp_text(&s, "caf\xC3", 4), ev, 32, &seq);
    CHECK_INT_EQ(n, 3);
    CHECK_STR_EQ(type_of(ev[0]), "response.output_item.added");
    CHECK_STR_EQ(type_of(ev[1]), "response.content_part.added");
    CHECK_STR_EQ(type_of(ev[2]), "response.output_text.delta");
    CHECK_STR_EQ(json_string_value(json_object_get(ev[2], "delta")), "caf");
    CHECK_STR_EQ(json_string_value(json_object_get(ev[2], "item_id")), "msg_abc00");
    for (int32_t i = 0; i < n; i++)
        json_decref(ev[i]);
    n = events(sh_openai_resp_text(&s, "\xA9!", 2), ev, 32, &seq);
    CHECK_INT_EQ(n, 1);
    CHECK_STR_EQ(json_string_value(json_object_get(ev[0], "delta")), "\xC3\xA9!");
    json_decref(ev[0]);
    CHECK_STR_EQ(sh_openai_resp_text(&s, "", 0), "");
    n = events(sh_openai_resp_calls(&s, "[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\","
                                        "\"function\":{\"name\":\"now\",\"arguments\":\"{}\"}}]"),
               ev, 32, &seq);
    static const char *const want[] = {"response.output_text.done",
                                       "response.content_part.done",
                                       "response.output_item.done",
                                       "response.output_item.added",
                                       "response.function_call_arguments.delta",
                                       "response.function_call_arguments.done",
                                       "response.output_item.done"};
    CHECK_INT_EQ(n, 7);
    for (int32_t i = 0; i < n && i < 7; i++)
        CHECK_STR_EQ(type_of(ev[i]), want[i]);
    CHECK_STR_EQ(json_string_value(json_object_get(ev[0], "text")), "caf\xC3\xA9!");
    json_t *fc = json_object_get(ev[6], "item");
    CHECK_STR_EQ(json_string_value(json_object_get(fc, "call_id")), "call_1");
    CHECK_STR_EQ(json_string_value(json_object_get(fc, "name")), "now");
    CHECK_INT_EQ(json_integer_value(json_object_get(ev[6], "output_index")), 1);
    for (int32_t i = 0; i < n; i++)
        json_decref(ev[i]);
    /* text after a call is a second message, with an id of its own */
    n = events(sh_openai_resp_text(&s, "ok", 2), ev, 32, &seq);
    CHECK_INT_EQ(n, 3);
    CHECK_INT_EQ(json_integer_value(json_object_get(ev[2], "output_index")), 2);
    CHECK_STR_EQ(json_string_value(json_object_get(ev[2], "item_id")), "msg_abc02");
    for (int32_t i = 0; i < n; i++)
        json_decref(ev[i]);
    sh_openai_usage u = {10, 5, 4};
    n = events(sh_openai_resp_end(&s, SH_OPENAI_FINISH_STOP, &u), ev, 32, &seq);
    CHECK_INT_EQ(n, 4);
    CHECK_STR_EQ(type_of(ev[3]), "response.completed");
    for (int32_t i = 0; i < 3; i++)
        json_decref(ev[i]);
    ev[0] = ev[3];
    json_t *resp = json_object_get(ev[0], "response");
    CHECK_STR_EQ(json_string_value(json_object_get(resp, "status")), "completed");
    CHECK_INT_EQ(json_array_size(json_object_get(resp, "output")), 3);
    json_t *usage = json_object_get(resp, "usage");
    CHECK_INT_EQ(json_integer_value(json_object_get(usage, "total_tokens")), 15);
    CHECK_INT_EQ(json_integer_value(json_object_get(json_object_get(usage, "input_tokens_details"),
                                                    "cached_tokens")),
                 4);
    json_decref(ev[0]);
    sh_openai_resp_fini(&s);
}

static void test_object(void)
{
    sh_openai_resp s;
    CHECK_OK(sh_openai_resp_init(&s, "resp_1", 5, "m", NULL));
    CHECK(sh_openai_resp_text(&s, "Hi there", 8) != NULL);
    sh_openai_usage u = {3, 8, 0};
    char *body = sh_openai_resp_json(&s, SH_OPENAI_FINISH_LENGTH, &u);
    json_t *o = json_loads(body, 0, NULL);
    CHECK_STR_EQ(json_string_value(json_object_get(o, "object")), "response");
    CHECK_STR_EQ(json_string_value(json_object_get(o, "id")), "resp_1");
    CHECK_STR_EQ(json_string_value(json_object_get(o, "status")), "incomplete");
    CHECK_STR_EQ(
        json_string_value(json_object_get(json_object_get(o, "incomplete_details"), "reason")),
        "max_output_tokens");
    json_t *msg = json_array_get(json_object_get(o, "output"), 0);
    CHECK_STR_EQ(json_string_value(json_object_get(msg, "type")), "message");
    CHECK_STR_EQ(json_string_value(json_object_get(msg, "role")), "assistant");
    json_t *part = json_array_get(json_object_get(msg, "content"), 0);
    CHECK_STR_EQ(json_string_value(json_object_get(part, "type")), "output_text");
    CHECK_STR_EQ(json_string_value(json_object_get(part, "text")), "Hi there");
    CHECK(json_is_array(json_object_get(part, "annotations")));
    CHECK_INT_EQ(json_integer_value(json_object_get(
                     json_object_get(json_object_get(o, "usage"), "output_tokens_details"),
                     "reasoning_tokens")),
                 0);
    json_decref(o);
    free(body);
    sh_openai_resp_fini(&s);

    /* an empty answer still has its message; a failure is an error event and response.failed */
    CHECK_OK(sh_openai_resp_init(&s, "resp_2", 5, "m", NULL));
    body = sh_openai_resp_json(&s, SH_OPENAI_FINISH_STOP, &u);
    o = json_loads(body, 0, NULL);
    CHECK_INT_EQ(json_array_size(json_object_get(o, "output")), 1);
    json_decref(o);
    free(body);
    sh_openai_error e;
    sh_openai_error_set(&e, 503, "server_shutting_down", NULL, "the server is shutting down");
    json_t *ev[4];
    int64_t seq = 0;
    sh_openai_resp_fini(&s);
    CHECK_OK(sh_openai_resp_init(&s, "resp_3", 5, "m", NULL));
    int32_t n = events(sh_openai_resp_fail(&s, &e), ev, 4, &seq);
    CHECK_INT_EQ(n, 2);
    CHECK_STR_EQ(type_of(ev[0]), "error");
    CHECK_STR_EQ(type_of(ev[1]), "response.failed");
    CHECK_STR_EQ(json_string_value(json_object_get(json_object_get(ev[1], "response"), "status")),
                 "failed");
    for (int32_t i = 0; i < n; i++)
        json_decref(ev[i]);
    sh_openai_resp_fini(&s);
}

static const sh_test_case tests[] = {
    {"input", test_input},   {"tools_and_format", test_tools_and_format},
    {"bad", test_bad},       {"stream", test_stream},
    {"object", test_object}, {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
