/* OpenAI request parsing (every field, a corpus of bad requests), response builders, API keys. */
#include <jansson.h>

#include "net/openai.h"
#include "sh_test.h"
#include "shoal/err.h"

static const char *const MODELS[] = {"tiny", "other"};
static const sh_openai_limits LIM = {
    .models = MODELS, .n_models = 2, .max_tokens = 4096, .max_n = 4, .n_vocab = 1000};

static sh_openai_request *parse_ok(sh_openai_kind kind, const char *body)
{
    sh_openai_request *r = NULL;
    sh_openai_error e = {0};
    sh_err rc = sh_openai_request_parse(kind, body, strlen(body), &LIM, &r, &e);
    if (rc != SH_OK)
        SH_FAIL_("parse of %s failed: %d %s", body, e.status, e.message);
    return r;
}

/* Parses a bad request and compares the status and the whole error JSON. */
static void bad(sh_openai_kind kind, const char *body, size_t len, int status, const char *param,
                const char *code)
{
    sh_openai_request *r = NULL;
    sh_openai_error e = {0};
    sh_err rc = sh_openai_request_parse(kind, body, len, &LIM, &r, &e);
    if (rc == SH_OK) {
        SH_FAIL_("accepted a bad request: %.*s", (int)len, body);
        sh_openai_request_free(r);
        return;
    }
    CHECK(r == NULL);
    if (e.status != status)
        SH_FAIL_("%.*s: status %d != %d (%s)", (int)len, body, e.status, status, e.message);
    char *js = sh_openai_error_json(&e);
    json_t *j = json_loads(js, 0, NULL);
    json_t *er = json_object_get(j, "error");
    CHECK(json_is_string(json_object_get(er, "message")));
    CHECK_STR_EQ(json_string_value(json_object_get(er, "type")),
                 status == 500 ? "server_error" : "invalid_request_error");
    json_t *p = json_object_get(er, "param"), *c = json_object_get(er, "code");
    if (param)
        CHECK_STR_EQ(json_string_value(p), param);
    else if (!json_is_null(p))
        SH_FAIL_("%.*s: param %s, want null", (int)len, body, json_string_value(p));
    if (code)
        CHECK_STR_EQ(json_string_value(c), code);
    else
        CHECK(json_is_null(c));
    json_decref(j);
    free(js);
}

#define BAD(kind, body, st, param, code) bad(kind, body, strlen(body), st, param, code)
#define CMPL SH_OPENAI_COMPLETION
#define CHAT SH_OPENAI_CHAT

static void test_completion_every_field(void)
{
    sh_openai_request *r = parse_ok(
        CMPL, "{\"model\":\"tiny\",\"prompt\":\"Once\",\"max_tokens\":7,\"temperature\":0.5,"
              "\"top_p\":0.9,\"top_k\":40,\"min_p\":0.05,\"stop\":[\"\\n\",\"END\",\"\"],"
              "\"seed\":-1,\"n\":2,\"presence_penalty\":-1.5,\"frequency_penalty\":2,"
              "\"logit_bias\":{\"0\":-100,\"999\":5.5},\"logprobs\":3,\"echo\":false,"
              "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"user\":\"u1\","
              "\"priority\":3,\"unknown_field\":{\"x\":[1,2]},\"suffix\":null}");
    if (!r)
        return;
    CHECK_INT_EQ(r->kind, CMPL);
    CHECK_STR_EQ(r->model, "tiny");
    CHECK_STR_EQ(r->prompt, "Once");
    CHECK(r->prompt_tokens == NULL);
    CHECK_INT_EQ(r->max_tokens, 7);
    CHECK_NEAR(r->temperature, 0.5, 1e-6);
    CHECK_NEAR(r->top_p, 0.9, 1e-6);
    CHECK_INT_EQ(r->top_k, 40);
    CHECK_NEAR(r->min_p, 0.05, 1e-6);
    CHECK_INT_EQ(r->n_stop, 2); /* the empty stop string is dropped */
    CHECK_STR_EQ(r->stop[0], "\n");
    CHECK_STR_EQ(r->stop[1], "END");
    CHECK(r->has_seed);
    CHECK_UINT_EQ(r->seed, UINT64_MAX);
    CHECK_INT_EQ(r->n, 2);
    CHECK_NEAR(r->presence_penalty, -1.5, 1e-6);
    CHECK_NEAR(r->frequency_penalty, 2, 1e-6);
    CHECK_INT_EQ(r->n_bias, 2);
    CHECK_INT_EQ(r->bias[0].token, 0);
    CHECK_NEAR(r->bias[0].bias, -100, 1e-6);
    CHECK_INT_EQ(r->bias[1].token, 999);
    CHECK_NEAR(r->bias[1].bias, 5.5, 1e-6);
    CHECK(r->logprobs);
    CHECK_INT_EQ(r->top_logprobs, 3);
    CHECK(!r->echo);
    CHECK(r->stream);
    CHECK(r->include_usage);
    CHECK_STR_EQ(r->user, "u1");
    CHECK_INT_EQ(r->priority, 3);
    sh_openai_request_free(r);
}

static void test_completion_defaults_and_prompts(void)
{
    sh_openai_request *r = parse_ok(CMPL, "{\"model\":\"other\",\"prompt\":\"x\"}");
    if (r) {
        CHECK_STR_EQ(r->prompt, "x");
        CHECK(!r->parse_special);
        CHECK_INT_EQ(r->max_tokens, 256);
        CHECK_NEAR(r->temperature, 1, 0);
        CHECK_NEAR(r->top_p, 1, 0);
        CHECK_INT_EQ(r->top_k, 0);
        CHECK_INT_EQ(r->n, 1);
        CHECK(!r->has_seed && !r->stream && !r->include_usage && !r->logprobs && !r->echo);
        CHECK(r->user == NULL);
        CHECK_INT_EQ(r->priority, -1);
        CHECK_INT_EQ(r->n_stop, 0);
    }
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":[\"one\"],\"stop\":\"x\",\"echo\":true,"
                       "\"logprobs\":null,\"top_k\":-1}");
    if (r) {
        CHECK_STR_EQ(r->prompt, "one");
        CHECK_INT_EQ(r->n_stop, 1);
        CHECK(r->echo);
        CHECK_INT_EQ(r->top_k, 0);
    }
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,2,999]}");
    if (r) {
        CHECK(r->prompt == NULL);
        CHECK_INT_EQ(r->n_prompt_tokens, 3);
        CHECK_INT_EQ(r->prompt_tokens[2], 999);
    }
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":[[5,6]],\"logprobs\":0}");
    if (r) {
        CHECK_INT_EQ(r->n_prompt_tokens, 2);
        CHECK(r->logprobs);
        CHECK_INT_EQ(r->top_logprobs, 0);
    }
    sh_openai_request_free(r);
}

static sh_openai_request *parse_lim(sh_openai_kind kind, const char *body,
                                    const sh_openai_limits *lim, sh_openai_error *e)
{
    sh_openai_request *r = NULL;
    sh_openai_error dummy;
    sh_openai_request_parse(kind, body, strlen(body), lim, &r, e ? e : &dummy);
    return r;
}

/* Absent sampling fields take the limits' defaults (OpenAI's without them), present ones win;
 * llama.cpp's and vLLM's sampling extensions parse; the ones not implemented are 400s naming the
 * field unless they hold their neutral value. */
static void test_sampling_fields(void)
{
    sh_openai_sampling d = sh_openai_sampling_builtin();
    CHECK_NEAR(d.temperature, 0.8, 1e-6);
    CHECK_INT_EQ(d.top_k, 40);
    CHECK_NEAR(d.top_p, 0.95, 1e-6);
    CHECK_NEAR(d.min_p, 0.05, 1e-6);
    CHECK_NEAR(d.typical_p, 1, 0);
    CHECK_NEAR(d.repeat_penalty, 1, 0);
    CHECK_INT_EQ(d.repeat_last_n, 64);
    d.presence_penalty = 0.5f;
    sh_openai_limits lim = LIM;
    lim.defaults = &d;
    sh_openai_request *r = parse_lim(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\"}", &lim, NULL);
    CHECK(r != NULL);
    if (r) {
        CHECK_NEAR(r->temperature, 0.8, 1e-6);
        CHECK_INT_EQ(r->top_k, 40);
        CHECK_NEAR(r->top_p, 0.95, 1e-6);
        CHECK_NEAR(r->min_p, 0.05, 1e-6);
        CHECK_NEAR(r->presence_penalty, 0.5, 1e-6);
        CHECK_NEAR(r->frequency_penalty, 0, 0);
        CHECK_NEAR(r->typical_p, 1, 0);
        CHECK_NEAR(r->repeat_penalty, 1, 0);
        CHECK_INT_EQ(r->repeat_last_n, 64);
    }
    sh_openai_request_free(r);
    // The request's own values win, null included as "absent", top_k -1 as "off".
    r = parse_lim(CHAT,
                  "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                  "\"temperature\":0,\"top_k\":-1,\"top_p\":null,\"min_p\":0,"
                  "\"presence_penalty\":0,\"typical_p\":0.5,\"repeat_penalty\":1.1,"
                  "\"repeat_last_n\":-1}",
                  &lim, NULL);
    CHECK(r != NULL);
    if (r) {
        CHECK_NEAR(r->temperature, 0, 0);
        CHECK_INT_EQ(r->top_k, 0);
        CHECK_NEAR(r->top_p, 0.95, 1e-6);
        CHECK_NEAR(r->min_p, 0, 0);
        CHECK_NEAR(r->presence_penalty, 0, 0);
        CHECK_NEAR(r->typical_p, 0.5, 1e-6);
        CHECK_NEAR(r->repeat_penalty, 1.1, 1e-6);
        CHECK_INT_EQ(r->repeat_last_n, -1);
    }
    sh_openai_request_free(r);
    // vLLM's repetition_penalty: over the prompt and output (window -1) unless repeat_last_n.
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repetition_penalty\":1.2}");
    if (r) {
        CHECK_NEAR(r->repeat_penalty, 1.2, 1e-6);
        CHECK_INT_EQ(r->repeat_last_n, -1);
        CHECK_NEAR(r->temperature, 1, 0); // no defaults given: OpenAI's
        CHECK_NEAR(r->top_p, 1, 0);
    }
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repetition_penalty\":1.2,"
                       "\"repeat_penalty\":1.2,\"repeat_last_n\":0}");
    if (r) {
        CHECK_NEAR(r->repeat_penalty, 1.2, 1e-6);
        CHECK_INT_EQ(r->repeat_last_n, 0);
    }
    sh_openai_request_free(r);
    // Neutral values of fields not implemented are accepted (clients that send every field).
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"mirostat\":0,\"mirostat_tau\":5,"
                       "\"xtc_probability\":0,\"xtc_threshold\":0.1,\"dry_multiplier\":0,"
                       "\"dry_base\":1.75,\"dynatemp_range\":0,\"top_n_sigma\":-1,\"tfs_z\":1,"
                       "\"n_probs\":0,\"min_keep\":0,\"best_of\":1,\"use_beam_search\":false,"
                       "\"penalize_nl\":false,\"samplers\":[],\"stop_token_ids\":[],"
                       "\"bad_words\":[],\"allowed_token_ids\":null,\"logits_processors\":null,"
                       "\"prompt_logprobs\":0,\"post_sampling_probs\":false}");
    sh_openai_request_free(r);
    static const char *const refused[] = {
        "\"mirostat\":2",
        "\"xtc_probability\":0.5",
        "\"dry_multiplier\":0.8",
        "\"dynatemp_range\":0.5",
        "\"top_n_sigma\":1.0",
        "\"tfs_z\":0.9",
        "\"n_probs\":5",
        "\"min_keep\":5",
        "\"best_of\":2",
        "\"use_beam_search\":true",
        "\"penalize_nl\":true",
        "\"samplers\":\"kpt\"",
        "\"stop_token_ids\":[2]",
        "\"bad_words\":[\"x\"]",
        "\"allowed_token_ids\":[1]",
        "\"logits_processors\":[\"a\"]",
        "\"prompt_logprobs\":1",
        "\"post_sampling_probs\":true",
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        char body[256], param[64];
        snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"x\",%s}", refused[i]);
        const char *q = strchr(refused[i] + 1, '"');
        snprintf(param, sizeof param, "%.*s", (int)(q - refused[i] - 1), refused[i] + 1);
        BAD(CMPL, body, 400, param, "unsupported_parameter");
        sh_openai_error e = {0};
        CHECK(parse_lim(CMPL, body, &lim, &e) == NULL);
        CHECK(strstr(e.message, param) != NULL);
    }
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"typical_p\":0}", 400, "typical_p", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"typical_p\":1.5}", 400, "typical_p", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repeat_penalty\":0}", 400, "repeat_penalty",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repetition_penalty\":-1}", 400,
        "repetition_penalty", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repetition_penalty\":101}", 400,
        "repetition_penalty", NULL);
    BAD(CMPL,
        "{\"model\":\"tiny\",\"prompt\":\"x\",\"repetition_penalty\":1.1,\"repeat_penalty\":1.2}",
        400, "repetition_penalty", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repeat_last_n\":-2}", 400, "repeat_last_n",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"repeat_last_n\":1.5}", 400, "repeat_last_n",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"typical_p\":\"0.5\"}", 400, "typical_p",
        NULL);
    char js[512];
    sh_openai_sampling_json(&d, js, sizeof js);
    json_t *j = json_loads(js, 0, NULL);
    CHECK(j != NULL);
    CHECK_NEAR(json_number_value(json_object_get(j, "temperature")), 0.8, 1e-6);
    CHECK_INT_EQ(json_integer_value(json_object_get(j, "top_k")), 40);
    CHECK_INT_EQ(json_integer_value(json_object_get(j, "repeat_last_n")), 64);
    CHECK_NEAR(json_number_value(json_object_get(j, "presence_penalty")), 0.5, 1e-6);
    json_decref(j);
}

static void test_chat_fields(void)
{
    sh_openai_request *r = parse_ok(
        CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hé\"},"
        "{\"type\":\"text\",\"text\":\"llo\"}],\"name\":\"x\"},"
        "{\"role\":\"assistant\",\"content\":null},{\"role\":\"developer\",\"content\":\"d\"}],"
        "\"logprobs\":true,\"top_logprobs\":20,\"max_tokens\":9,"
        "\"max_completion_tokens\":12,\"temperature\":0,\"stop\":[\"a\",\"b\",\"c\",\"d\"]}");
    if (!r)
        return;
    CHECK_INT_EQ(r->n_messages, 4);
    CHECK_INT_EQ(r->messages[0].role, SH_OPENAI_SYSTEM);
    CHECK_STR_EQ(r->messages[0].content, "Be brief.");
    CHECK_INT_EQ(r->messages[1].role, SH_OPENAI_USER);
    CHECK_STR_EQ(r->messages[1].content, "Héllo");
    CHECK_INT_EQ(r->messages[2].role, SH_OPENAI_ASSISTANT);
    CHECK_STR_EQ(r->messages[2].content, "");
    CHECK_INT_EQ(r->messages[3].role, SH_OPENAI_SYSTEM);
    CHECK(r->logprobs);
    CHECK_INT_EQ(r->top_logprobs, 20);
    CHECK_INT_EQ(r->max_tokens, 12); /* max_completion_tokens wins */
    CHECK_NEAR(r->temperature, 0, 0);
    CHECK_INT_EQ(r->n_stop, 4);
    sh_openai_request_free(r);
    r = parse_ok(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                       "\"max_tokens\":9}");
    if (r)
        CHECK_INT_EQ(r->max_tokens, 9);
    sh_openai_request_free(r);
}

static void test_bad_requests(void)
{
    BAD(CMPL, "", 400, NULL, NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\"", 400, NULL, NULL);
    BAD(CMPL, "[1,2]", 400, NULL, NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"model\":\"other\"}", 400, NULL, NULL);
    BAD(CMPL, "{\"prompt\":\"x\"}", 400, "model", NULL);
    BAD(CMPL, "{\"model\":7,\"prompt\":\"x\"}", 400, "model", NULL);
    BAD(CMPL, "{\"model\":\"nope\",\"prompt\":\"x\"}", 404, "model", "model_not_found");
    BAD(CMPL, "{\"model\":\"tiny\"}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":5}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[\"a\",\"b\"]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,-2]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,1000]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,\"a\"]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":-1}", 400, "max_tokens", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":4097}", 400, "max_tokens", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":99999999999999999999999}", 400,
        NULL, NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "max_tokens",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":5.5}", 400, "max_tokens", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"temperature\":2.5}", 400, "temperature",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"min_p\":-0.1}", 400, "min_p", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"top_k\":-2}", 400, "top_k", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"presence_penalty\":-2.01}", 400,
        "presence_penalty", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"frequency_penalty\":3}", 400,
        "frequency_penalty", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"n\":0}", 400, "n", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"n\":5}", 400, "n", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"seed\":1.5}", 400, "seed", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400,
        "stop", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stop\":[\"a\",1]}", 400, "stop", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stop\":3}", 400, "stop", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":[1]}", 400, "logit_bias", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"abc\":1}}", 400, "logit_bias",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"-1\":1}}", 400, "logit_bias",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"01\":1}}", 400, "logit_bias",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"1000\":1}}", 400,
        "logit_bias", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\" 5\":1}}", 400, "logit_bias",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"5\":101}}", 400, "logit_bias",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logit_bias\":{\"5\":\"1\"}}", 400,
        "logit_bias", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logprobs\":6}", 400, "logprobs", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"logprobs\":1,\"echo\":true}", 400, "echo",
        NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}",
        400, "stream_options", NULL);
    BAD(CMPL,
        "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream\":true,\"stream_options\":"
        "{\"include_usage\":1}}",
        400, "stream_options.include_usage", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"user\":5}", 400, "user", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"priority\":256}", 400, "priority", NULL);
    /* Invalid UTF-8 (a lone continuation byte, an overlong form) and an escaped NUL. */
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"\x80\"}", 400, NULL, NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"\xc0\xaf\"}", 400, NULL, NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"a\\u0000b\"}", 400, NULL, NULL);
    static const char nul[] = "{\"model\":\"tiny\",\"prompt\":\"a\0b\"}";
    bad(CMPL, nul, sizeof nul - 1, 400, NULL, NULL);
    /* chat */
    BAD(CHAT, "{\"model\":\"tiny\"}", 400, "messages", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[]}", 400, "messages", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[1]}", 400, "messages[0]", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", 400,
        "messages[0].role", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", 400,
        "messages[0].tool_call_id", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"content\":\"x\"}]}", 400, "messages[0].role",
        NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":"
        "\"user\",\"content\":5}]}",
        400, "messages[1].content", NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
        "\"image_url\",\"image_url\":{}}]}]}",
        400, "messages[0].content", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":null}]}", 400,
        "messages[0].content", NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"top_logprobs\":2}",
        400, "top_logprobs", NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"logprobs\":true,\"top_logprobs\":21}",
        400, "top_logprobs", NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"logprobs\":3}",
        400, "logprobs", NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"max_completion_tokens\":-5}",
        400, "max_completion_tokens", NULL);
}

/* The error of a request parsed with limits lim (NULL: LIM); *message receives its text. */
static int parse_err(sh_openai_kind kind, const char *body, const sh_openai_limits *lim,
                     sh_openai_error *e)
{
    sh_openai_request *r = NULL;
    memset(e, 0, sizeof *e);
    sh_err rc = sh_openai_request_parse(kind, body, strlen(body), lim ? lim : &LIM, &r, e);
    if (rc == SH_OK) {
        SH_FAIL_("accepted: %s", body);
        sh_openai_request_free(r);
        return 0;
    }
    return e->status;
}

/* Empty prompts, the token-id error's position and value, the model a request may leave out,
 * and parse_special. */
static void test_prompt_rules(void)
{
    sh_openai_error e;
    // An empty prompt is refused in every spelling (OpenAI answers 400 too).
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"\"}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[\"\"]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[[]]}", 400, "prompt", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[]}", 400, "prompt", NULL);
    BAD(CHAT, "{\"model\":\"tiny\",\"messages\":[]}", 400, "messages", NULL);
    // A bad token id: its position and its value.
    CHECK_INT_EQ(parse_err(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,-1,5]}", NULL, &e), 400);
    if (!strstr(e.message, "position 1") || !strstr(e.message, "-1"))
        SH_FAIL_("message lacks the position or the value: %s", e.message);
    CHECK_INT_EQ(parse_err(CMPL, "{\"model\":\"tiny\",\"prompt\":[7,8,1000]}", NULL, &e), 400);
    if (!strstr(e.message, "position 2") || !strstr(e.message, "1000") ||
        !strstr(e.message, "0..999"))
        SH_FAIL_("message lacks the position, the value or the range: %s", e.message);
    CHECK_INT_EQ(parse_err(CMPL, "{\"model\":\"tiny\",\"prompt\":[7,\"a\"]}", NULL, &e), 400);
    if (!strstr(e.message, "position 1"))
        SH_FAIL_("message lacks the position: %s", e.message);
    // One model served: a request without "model" gets it.
    static const char *const one[] = {"only"};
    sh_openai_limits lim1 = LIM;
    lim1.models = one;
    lim1.n_models = 1;
    sh_openai_request *r = NULL;
    const char *body = "{\"prompt\":\"x\"}";
    CHECK_OK(sh_openai_request_parse(CMPL, body, strlen(body), &lim1, &r, &e));
    if (r)
        CHECK_STR_EQ(r->model, "only");
    sh_openai_request_free(r);
    r = NULL;
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"model\":\"\"}";
    CHECK_OK(sh_openai_request_parse(CHAT, body, strlen(body), &lim1, &r, &e));
    if (r)
        CHECK_STR_EQ(r->model, "only");
    sh_openai_request_free(r);
    // Several: 400 naming them. None configured (any name accepted): still required.
    CHECK_INT_EQ(parse_err(CMPL, "{\"prompt\":\"x\"}", NULL, &e), 400);
    CHECK_STR_EQ(e.param, "model");
    if (!strstr(e.message, "'tiny'") || !strstr(e.message, "'other'"))
        SH_FAIL_("message does not list the models: %s", e.message);
    sh_openai_limits lim0 = LIM;
    lim0.models = NULL;
    lim0.n_models = 0;
    CHECK_INT_EQ(parse_err(CMPL, "{\"prompt\":\"x\"}", &lim0, &e), 400);
    CHECK_STR_EQ(e.param, "model");
    // parse_special: completions with a text prompt only, a boolean.
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"<s>x\",\"parse_special\":true}");
    if (r)
        CHECK(r->parse_special);
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,2],\"parse_special\":false}");
    if (r)
        CHECK(!r->parse_special);
    sh_openai_request_free(r);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"parse_special\":\"yes\"}", 400,
        "parse_special", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":[1,2],\"parse_special\":true}", 400, "parse_special",
        NULL);
    BAD(CHAT,
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
        "\"parse_special\":true}",
        400, "parse_special", NULL);
    // speculative (extension): false opts out of speculative decoding; absent or true does not.
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"speculative\":false}");
    if (r)
        CHECK(r->no_spec);
    sh_openai_request_free(r);
    r = parse_ok(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":"
                       "\"hi\"}],\"speculative\":true}");
    if (r)
        CHECK(!r->no_spec);
    sh_openai_request_free(r);
    r = parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\"}");
    if (r)
        CHECK(!r->no_spec);
    sh_openai_request_free(r);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"speculative\":0}", 400, "speculative", NULL);
    // {"n_max": N} and llama.cpp's flat "speculative.n_max": N cap the draft length; 0 opts out.
    static const struct {
        const char *fields;
        bool no_spec;
        int32_t n_max;
    } good[] = {
        {"\"speculative\":{\"n_max\":1}", false, 1},
        {"\"speculative\":{\"n_max\":16}", false, 16},
        {"\"speculative\":{\"n_max\":0}", true, 0},
        {"\"speculative\":{}", false, 0},
        {"\"speculative\":{\"n_max\":null}", false, 0},
        {"\"speculative.n_max\":3", false, 3},
        {"\"speculative.n_max\":0", true, 0},
        {"\"speculative\":true,\"speculative.n_max\":2", false, 2},
        {"\"speculative\":false,\"speculative.n_max\":0", true, 0},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char sb[256];
        snprintf(sb, sizeof sb, "{\"model\":\"tiny\",\"prompt\":\"x\",%s}", good[i].fields);
        r = parse_ok(CMPL, sb);
        if (r) {
            CHECK_INT_EQ(r->no_spec, good[i].no_spec);
            CHECK_INT_EQ(r->spec_n_max, good[i].n_max);
        }
        sh_openai_request_free(r);
    }
    static const struct {
        const char *fields, *param;
    } bad_spec[] = {
        {"\"speculative\":{\"n_max\":17}", "speculative.n_max"},
        {"\"speculative\":{\"n_max\":-1}", "speculative.n_max"},
        {"\"speculative\":{\"n_max\":\"2\"}", "speculative.n_max"},
        {"\"speculative\":{\"n_max\":1.5}", "speculative.n_max"},
        {"\"speculative\":{\"n_min\":1}", "speculative"},
        {"\"speculative\":{\"n_max\":1,\"p_min\":0.5}", "speculative"},
        {"\"speculative\":[1]", "speculative"},
        {"\"speculative.n_max\":17", "speculative.n_max"},
        {"\"speculative.n_max\":true", "speculative.n_max"},
        {"\"speculative\":{\"n_max\":2},\"speculative.n_max\":2", "speculative.n_max"},
        {"\"speculative\":false,\"speculative.n_max\":2", "speculative.n_max"},
    };
    for (size_t i = 0; i < sizeof bad_spec / sizeof bad_spec[0]; i++) {
        char sb[256];
        snprintf(sb, sizeof sb, "{\"model\":\"tiny\",\"prompt\":\"x\",%s}", bad_spec[i].fields);
        BAD(CMPL, sb, 400, bad_spec[i].param, NULL);
    }
}

static void test_error_json(void)
{
    sh_openai_error e;
    sh_openai_error_set(&e, 429, "rate_limit_exceeded", NULL, "slow down");
    char *s = sh_openai_error_json(&e);
    CHECK_STR_EQ(s, "{\"error\":{\"message\":\"slow down\",\"type\":\"rate_limit_error\","
                    "\"param\":null,\"code\":\"rate_limit_exceeded\"}}");
    free(s);
    sh_openai_error_set(&e, 503, NULL, NULL, "no replica");
    s = sh_openai_error_json(&e);
    CHECK_STR_EQ(s, "{\"error\":{\"message\":\"no replica\",\"type\":\"server_error\","
                    "\"param\":null,\"code\":null}}");
    free(s);
    sh_openai_error_set(&e, 405, NULL, NULL, "Method GET not allowed for %s", "/v1/completions");
    s = sh_openai_error_json(&e);
    CHECK_STR_EQ(s, "{\"error\":{\"message\":\"Method GET not allowed for /v1/completions\","
                    "\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}");
    free(s);
}

static json_t *load(char *s, const char *prefix)
{
    if (!s) {
        SH_FAIL_("builder returned NULL");
        return NULL;
    }
    size_t pl = prefix ? strlen(prefix) : 0;
    if (prefix) {
        CHECK(strncmp(s, prefix, pl) == 0);
        size_t n = strlen(s);
        CHECK(n >= 2 && s[n - 1] == '\n' && s[n - 2] == '\n');
    }
    json_error_t je;
    json_t *j = json_loads(s + pl, JSON_DISABLE_EOF_CHECK, &je);
    if (!j)
        SH_FAIL_("not JSON: %s (%s)", s, je.text);
    free(s);
    return j;
}

#define JS(o, k) json_string_value(json_object_get(o, k))
#define JI(o, k) json_integer_value(json_object_get(o, k))

static void test_response_builders(void)
{
    sh_openai_top top[2] = {{"a", -0.1f}, {"b", -2.5f}};
    sh_openai_logprob lps[2] = {{"He", -0.5f, 0, top, 2}, {"\xe2\x82", -INFINITY, 2, NULL, 0}};
    sh_openai_choice ch = {0, "He\xe2\x82", SH_OPENAI_FINISH_LENGTH, lps, 2, NULL};
    sh_openai_usage u = {5, 2, 3};
    sh_openai_meta m = {SH_OPENAI_COMPLETION, "cmpl-1", 1700000000, "tiny", "shoal-fp"};
    json_t *j = load(sh_openai_response_json(&m, &ch, 1, &u), NULL);
    if (j) {
        CHECK_STR_EQ(JS(j, "object"), "text_completion");
        CHECK_STR_EQ(JS(j, "id"), "cmpl-1");
        CHECK_INT_EQ(JI(j, "created"), 1700000000);
        CHECK_STR_EQ(JS(j, "model"), "tiny");
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK_INT_EQ(JI(c0, "index"), 0);
        CHECK_STR_EQ(JS(c0, "text"), "He\xef\xbf\xbd"); /* a cut character becomes U+FFFD */
        CHECK_STR_EQ(JS(c0, "finish_reason"), "length");
        json_t *lp = json_object_get(c0, "logprobs");
        CHECK_INT_EQ(json_array_size(json_object_get(lp, "tokens")), 2);
        CHECK_NEAR(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 1)), -9999,
                   0);
        json_t *t0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
        CHECK_NEAR(json_real_value(json_object_get(t0, "b")), -2.5, 1e-6);
        CHECK_INT_EQ(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 2);
        json_t *us = json_object_get(j, "usage");
        CHECK_INT_EQ(JI(us, "prompt_tokens"), 5);
        CHECK_INT_EQ(JI(us, "completion_tokens"), 2);
        CHECK_INT_EQ(JI(us, "total_tokens"), 7);
        CHECK_INT_EQ(JI(json_object_get(us, "prompt_tokens_details"), "cached_tokens"), 3);
        CHECK_STR_EQ(JS(j, "system_fingerprint"), "shoal-fp");
        json_decref(j);
    }
    m = (sh_openai_meta){SH_OPENAI_CHAT, "chatcmpl-1", 1, "tiny", NULL};
    ch = (sh_openai_choice){0, "Hi \"there\"", SH_OPENAI_FINISH_STOP, lps, 1, NULL};
    j = load(sh_openai_response_json(&m, &ch, 1, &u), NULL);
    if (j) {
        CHECK_STR_EQ(JS(j, "object"), "chat.completion");
        CHECK(json_object_get(j, "system_fingerprint") == NULL);
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        json_t *msg = json_object_get(c0, "message");
        CHECK_STR_EQ(JS(msg, "role"), "assistant");
        CHECK_STR_EQ(JS(msg, "content"), "Hi \"there\"");
        CHECK_STR_EQ(JS(c0, "finish_reason"), "stop");
        json_t *e0 = json_array_get(json_object_get(json_object_get(c0, "logprobs"), "content"), 0);
        CHECK_STR_EQ(JS(e0, "token"), "He");
        CHECK_INT_EQ(json_array_size(json_object_get(e0, "bytes")), 2);
        CHECK_INT_EQ(json_integer_value(json_array_get(json_object_get(e0, "bytes"), 0)), 'H');
        json_t *tp = json_array_get(json_object_get(e0, "top_logprobs"), 1);
        CHECK_STR_EQ(JS(tp, "token"), "b");
        json_decref(j);
    }
    /* Chat without logprobs: "logprobs": null. */
    ch.logprobs = NULL;
    j = load(sh_openai_response_json(&m, &ch, 1, NULL), NULL);
    if (j) {
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK(json_is_null(json_object_get(c0, "logprobs")));
        CHECK(json_object_get(j, "usage") == NULL);
        json_decref(j);
    }
}

static void test_chunks(void)
{
    sh_openai_meta m = {SH_OPENAI_CHAT, "chatcmpl-2", 2, "tiny", "shoal-fp"};
    sh_openai_choice ch = {0, NULL, SH_OPENAI_FINISH_NONE, NULL, 0, NULL};
    json_t *j = load(sh_openai_chunk_sse(&m, &ch, true, true), "data: ");
    if (j) {
        CHECK_STR_EQ(JS(j, "object"), "chat.completion.chunk");
        CHECK_STR_EQ(JS(j, "system_fingerprint"), "shoal-fp");
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK_STR_EQ(JS(json_object_get(c0, "delta"), "role"), "assistant");
        CHECK_STR_EQ(JS(json_object_get(c0, "delta"), "content"), "");
        CHECK(json_is_null(json_object_get(c0, "finish_reason")));
        CHECK(json_is_null(json_object_get(j, "usage")));
        json_decref(j);
    }
    ch.text = "lo";
    j = load(sh_openai_chunk_sse(&m, &ch, false, false), "data: ");
    if (j) {
        json_t *d = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
        CHECK_STR_EQ(JS(d, "content"), "lo");
        CHECK(json_object_get(d, "role") == NULL);
        CHECK(json_object_get(j, "usage") == NULL);
        json_decref(j);
    }
    ch.text = NULL;
    ch.finish = SH_OPENAI_FINISH_STOP;
    j = load(sh_openai_chunk_sse(&m, &ch, false, false), "data: ");
    if (j) {
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK_INT_EQ(json_object_size(json_object_get(c0, "delta")), 0);
        CHECK_STR_EQ(JS(c0, "finish_reason"), "stop");
        json_decref(j);
    }
    sh_openai_usage u = {3, 4, 0};
    j = load(sh_openai_usage_sse(&m, &u), "data: ");
    if (j) {
        CHECK_INT_EQ(json_array_size(json_object_get(j, "choices")), 0);
        CHECK_INT_EQ(JI(json_object_get(j, "usage"), "total_tokens"), 7);
        json_t *pd = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
        CHECK_INT_EQ(JI(pd, "cached_tokens"), 0);
        json_decref(j);
    }
    m.kind = SH_OPENAI_COMPLETION;
    ch = (sh_openai_choice){0, " world", SH_OPENAI_FINISH_NONE, NULL, 0, NULL};
    j = load(sh_openai_chunk_sse(&m, &ch, true, false), "data: ");
    if (j) {
        CHECK_STR_EQ(JS(j, "object"), "text_completion");
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK_STR_EQ(JS(c0, "text"), " world");
        CHECK(json_is_null(json_object_get(c0, "logprobs")));
        json_decref(j);
    }
    CHECK_STR_EQ(SH_OPENAI_SSE_DONE, "data: [DONE]\n\n");
}

static void test_models_health(void)
{
    json_t *j = load(sh_openai_models_json(MODELS, 2, 42, NULL), NULL);
    if (j) {
        CHECK_STR_EQ(JS(j, "object"), "list");
        json_t *d1 = json_array_get(json_object_get(j, "data"), 1);
        CHECK_STR_EQ(JS(d1, "id"), "other");
        CHECK_STR_EQ(JS(d1, "object"), "model");
        CHECK_INT_EQ(JI(d1, "created"), 42);
        CHECK_STR_EQ(JS(d1, "owned_by"), "shoal");
        json_decref(j);
    }
    sh_openai_model_info mi[1] = {{"tiny", 2048, 8192, 1000, false}};
    j = load(sh_openai_models_info_json(mi, 1, 42, NULL), NULL);
    if (j) {
        json_t *d0 = json_array_get(json_object_get(j, "data"), 0);
        CHECK_STR_EQ(JS(d0, "id"), "tiny");
        CHECK_INT_EQ(JI(d0, "max_model_len"), 2048);
        CHECK_INT_EQ(JI(json_object_get(d0, "meta"), "n_ctx_train"), 8192);
        CHECK_INT_EQ(JI(json_object_get(d0, "meta"), "n_vocab"), 1000);
        CHECK_STR_EQ(json_string_value(json_array_get(json_object_get(d0, "capabilities"), 1)),
                     "chat");
        CHECK_UINT_EQ(json_array_size(json_object_get(d0, "capabilities")), 2);
        json_decref(j);
    }
    mi[0].embeddings = true; /* a model whose embeddings are served says so */
    j = load(sh_openai_models_info_json(mi, 1, 42, NULL), NULL);
    if (j) {
        json_t *caps =
            json_object_get(json_array_get(json_object_get(j, "data"), 0), "capabilities");
        CHECK_UINT_EQ(json_array_size(caps), 3);
        CHECK_STR_EQ(json_string_value(json_array_get(caps, 2)), "embeddings");
        json_decref(j);
    }
    j = load(sh_openai_health_json("ok", "\"replicas\":2"), NULL);
    if (j) {
        CHECK_STR_EQ(JS(j, "status"), "ok");
        CHECK_INT_EQ(JI(j, "replicas"), 2);
        json_decref(j);
    }
    CHECK(sh_openai_health_json("ok", "\"broken") == NULL);
}

static void test_auth(void)
{
    sh_openai_key keys[2] = {{"sk-alpha", 0, false}, {"sk-beta-long", 5, false}};
    sh_openai_error e;
    int32_t prio = -7;
    CHECK_OK(sh_openai_auth_check(NULL, 0, NULL, 2, &prio, &e));
    CHECK_INT_EQ(prio, 2);
    CHECK_OK(sh_openai_auth_check(keys, 2, "Bearer sk-beta-long", 2, &prio, &e));
    CHECK_INT_EQ(prio, 5);
    CHECK_OK(sh_openai_auth_check(keys, 2, "bearer sk-alpha", 2, &prio, &e));
    CHECK_INT_EQ(prio, 0);
    const char *bad_hdrs[] = {NULL,
                              "",
                              "Bearer ",
                              "Bearer sk-alph",
                              "Bearer sk-alphaa",
                              "Basic sk-alpha",
                              "sk-alpha",
                              "Bearer sk-beta"};
    for (size_t i = 0; i < sizeof bad_hdrs / sizeof *bad_hdrs; i++) {
        sh_err rc = sh_openai_auth_check(keys, 2, bad_hdrs[i], 2, &prio, &e);
        if (rc != SH_EINVAL || e.status != 401)
            SH_FAIL_("header '%s' accepted", bad_hdrs[i] ? bad_hdrs[i] : "(null)");
        CHECK_STR_EQ(e.code, "invalid_api_key");
    }
}

/* The routes that change the server: an admin key passes, another valid key gets 403, an
 * unknown or missing one 401; with no keys everything passes. */
static void test_auth_admin(void)
{
    sh_openai_key keys[3] = {{"sk-alpha", 0, false}, {"sk-ops", 3, true}, {"sk-ops2", 0, false}};
    sh_openai_error e;
    CHECK_OK(sh_openai_auth_admin(NULL, 0, NULL, &e));
    CHECK_OK(sh_openai_auth_admin(keys, 3, "Bearer sk-ops", &e));
    CHECK_OK(sh_openai_auth_admin(keys, 3, "Bearer  sk-ops \t", &e));
    const char *not_admin[] = {"Bearer sk-alpha", "Bearer sk-ops2"};
    for (size_t i = 0; i < 2; i++) {
        CHECK_INT_EQ(sh_openai_auth_admin(keys, 3, not_admin[i], &e), SH_EINVAL);
        CHECK_INT_EQ(e.status, 403);
        CHECK_STR_EQ(e.code, "admin_key_required");
    }
    const char *bad[] = {NULL, "Bearer sk-op", "Bearer sk-opsx", "sk-ops"};
    for (size_t i = 0; i < 4; i++) {
        CHECK_INT_EQ(sh_openai_auth_admin(keys, 3, bad[i], &e), SH_EINVAL);
        CHECK_INT_EQ(e.status, 401);
    }
}

/* The output's grammar: `grammar` kept as given, response_format's converted, which field it came
 * from, and the refusals (both fields, a non-string, past the size bound). */
static void test_grammar_fields(void)
{
    sh_openai_request *r =
        parse_ok(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"grammar\":\"root ::= \\\"a\\\"\"}");
    if (r) {
        CHECK_STR_EQ(r->grammar, "root ::= \"a\"");
        CHECK_STR_EQ(r->grammar_param, "grammar");
        sh_openai_request_free(r);
    }
    r = parse_ok(CHAT, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                       "\"response_format\":{\"type\":\"json_object\"},\"grammar\":null}");
    if (r) {
        CHECK(r->grammar != NULL && strstr(r->grammar, "root ::=") != NULL);
        CHECK_STR_EQ(r->grammar_param, "response_format");
        sh_openai_request_free(r);
    }
    r = parse_ok(CMPL,
                 "{\"model\":\"tiny\",\"prompt\":\"x\",\"response_format\":{\"type\":\"text\"}}");
    if (r) {
        CHECK(r->grammar == NULL && r->grammar_param == NULL);
        sh_openai_request_free(r);
    }
    BAD(CMPL,
        "{\"model\":\"tiny\",\"prompt\":\"x\",\"grammar\":\"root ::= \\\"a\\\"\","
        "\"response_format\":{\"type\":\"json_object\"}}",
        400, "grammar", NULL);
    BAD(CMPL, "{\"model\":\"tiny\",\"prompt\":\"x\",\"grammar\":5}", 400, "grammar", NULL);
    size_t n = SH_OPENAI_MAX_GRAMMAR + 64;
    char *big = malloc(n + 128);
    if (!big)
        return;
    int k = snprintf(big, n + 128, "{\"model\":\"tiny\",\"prompt\":\"x\",\"grammar\":\"root ::= ");
    memset(big + k, 'a', n - (size_t)k);
    snprintf(big + n, 128, "\"}");
    sh_openai_error e;
    CHECK_INT_EQ(parse_err(CMPL, big, NULL, &e), 400);
    CHECK_STR_EQ(e.param, "grammar");
    free(big);
}

static const sh_test_case tests[] = {
    {"prompt_rules", test_prompt_rules},
    {"completion_every_field", test_completion_every_field},
    {"completion_defaults_and_prompts", test_completion_defaults_and_prompts},
    {"chat_fields", test_chat_fields},
    {"sampling_fields", test_sampling_fields},
    {"bad_requests", test_bad_requests},
    {"grammar_fields", test_grammar_fields},
    {"error_json", test_error_json},
    {"response_builders", test_response_builders},
    {"chunks", test_chunks},
    {"models_health", test_models_health},
    {"auth", test_auth},
    {"auth_admin", test_auth_admin},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
