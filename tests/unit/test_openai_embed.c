/* POST /v1/embeddings' codec (net/openai_embed.h): inputs of every form, the errors naming the
 * field and input, and the response in float and base64. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "net/openai_embed.h"
#include "sh_test.h"

static const char *const models[] = {"m"};
static const sh_openai_embed_limits lim = {
    .models = models, .n_models = 1, .n_vocab = 100, .max_tokens = 8, .dim = 4};

static sh_openai_embed_req *ok(const char *body)
{
    sh_openai_embed_req *r = NULL;
    sh_openai_error e;
    sh_err rc = sh_openai_embed_parse(body, strlen(body), &lim, &r, &e);
    if (rc)
        fprintf(stderr, "  %s -> %d %s\n", body, e.status, e.message);
    CHECK_INT_EQ(rc, SH_OK);
    return r;
}

static void bad(const char *body, int status, const char *param, const char *text)
{
    sh_openai_embed_req *r = NULL;
    sh_openai_error e;
    CHECK(sh_openai_embed_parse(body, strlen(body), &lim, &r, &e) != SH_OK);
    CHECK(r == NULL);
    CHECK_INT_EQ(e.status, status);
    CHECK_STR_EQ(e.param, param);
    if (!strstr(e.message, text))
        fprintf(stderr, "  %s: message '%s' lacks '%s'\n", body, e.message, text);
    CHECK(strstr(e.message, text) != NULL);
}

static void test_inputs(void)
{
    sh_openai_embed_req *r = ok("{\"input\":\"hi\"}");
    CHECK_INT_EQ(r->n, 1);
    CHECK_STR_EQ(r->texts[0], "hi");
    CHECK_STR_EQ(r->model, "m");
    CHECK(!r->base64);
    sh_openai_embed_free(r);
    r = ok("{\"input\":[\"a\",[1,2,3]],\"encoding_format\":\"base64\",\"model\":\"m\","
           "\"dimensions\":4,\"user\":\"u\"}");
    CHECK_INT_EQ(r->n, 2);
    CHECK_STR_EQ(r->texts[0], "a");
    CHECK(r->texts[1] == NULL);
    CHECK_INT_EQ(r->n_ids[1], 3);
    CHECK_INT_EQ(r->ids[1][2], 3);
    CHECK(r->base64);
    sh_openai_embed_free(r);
    r = ok("{\"input\":[5,6]}");
    CHECK_INT_EQ(r->n, 1);
    CHECK_INT_EQ(r->n_ids[0], 2);
    CHECK_INT_EQ(r->ids[0][1], 6);
    sh_openai_embed_free(r);
}

static void test_bad(void)
{
    bad("{\"input\":\"\"}", 400, "input", "input[0] is empty");
    bad("{\"input\":[]}", 400, "input", "'input' is empty");
    bad("{\"input\":[[1],[]]}", 400, "input", "input[1] is empty");
    bad("{\"input\":3}", 400, "input", "must be a string");
    bad("{\"input\":[\"a\",3]}", 400, "input", "input[1]:");
    bad("{\"input\":[1,100]}", 400, "input", "input[0][1] must be a token id");
    bad("{\"input\":[1,-1]}", 400, "input", "input[0][1]");
    bad("{\"input\":[[1,2,3,4,5,6,7,8,9]]}", 400, "input", "input[0] has 9 tokens");
    bad("{}", 400, "input", "'input' is required");
    bad("{\"input\":\"a\",\"dimensions\":3}", 400, "dimensions", "must be 4");
    bad("{\"input\":\"a\",\"encoding_format\":\"hex\"}", 400, "encoding_format", "base64");
    bad("{\"input\":\"a\",\"model\":\"x\"}", 404, "model", "does not exist");
    bad("{\"input\":\"a\",\"model\":7}", 400, "model", "must be a string");
    bad("[1]", 400, "", "JSON object");
    bad("{\"input\"", 400, "", "not valid JSON");
}

static void test_response(void)
{
    const float v[8] = {1.0f, -0.5f, 0.25f, 3e-8f, 0, 1, 0, 0};
    char *f = sh_openai_embed_json("m", v, 2, 4, false, 7);
    json_t *j = json_loads(f, 0, NULL);
    CHECK(j != NULL);
    CHECK_STR_EQ(json_string_value(json_object_get(j, "object")), "list");
    CHECK_STR_EQ(json_string_value(json_object_get(j, "model")), "m");
    json_t *d = json_object_get(j, "data");
    CHECK_INT_EQ((int)json_array_size(d), 2);
    json_t *e0 = json_object_get(json_array_get(d, 0), "embedding");
    CHECK_INT_EQ((int)json_integer_value(json_object_get(json_array_get(d, 1), "index")), 1);
    for (int i = 0; i < 4; i++)
        CHECK((float)json_real_value(json_array_get(e0, (size_t)i)) == v[i] ||
              (float)json_number_value(json_array_get(e0, (size_t)i)) == v[i]);
    json_t *u = json_object_get(j, "usage");
    CHECK_INT_EQ((int)json_integer_value(json_object_get(u, "prompt_tokens")), 7);
    CHECK_INT_EQ((int)json_integer_value(json_object_get(u, "total_tokens")), 7);
    json_decref(j);
    free(f);
    /* base64 of the little-endian bytes: 1.0f -0.5f 0.25f 3e-8f */
    char *b = sh_openai_embed_json("m", v, 1, 4, true, 1);
    j = json_loads(b, 0, NULL);
    const char *s = json_string_value(
        json_object_get(json_array_get(json_object_get(j, "data"), 0), "embedding"));
    CHECK_STR_EQ(s, "AACAPwAAAL8AAIA+WdkAMw==");
    json_decref(j);
    free(b);
}

static const sh_test_case tests[] = {
    {"inputs", test_inputs},
    {"bad", test_bad},
    {"response", test_response},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
