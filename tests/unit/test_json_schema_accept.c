/* JSON schema → GBNF through the grammar engine (model/grammar.h): every case of
 * json_schema_cases.h parses with sh_grammar_parse, its valid instances are accepted byte by
 * byte (and in one piece) and can end, its invalid ones are rejected at some byte or cannot end.
 * Built only when model/grammar.h is in the tree (tests/unit/json_schema.cmake). */
#include <jansson.h>

#include "json_schema_cases.h"
#include "model/grammar.h"
#include "net/json_schema.h"
#include "sh_test.h"
#include "shoal/err.h"

/* Whether the grammar takes the whole text as a sentence, fed one byte at a time (UTF-8 code
 * points split across calls) or in one call. */
static bool accepts(const sh_grammar *g, const char *text, bool bytewise)
{
    sh_gmatch *m = NULL;
    if (sh_gmatch_create(g, &m, NULL) != SH_OK) {
        SH_FAIL_("sh_gmatch_create failed");
        return false;
    }
    size_t n = strlen(text);
    bool ok = true;
    if (bytewise) {
        for (size_t i = 0; i < n && ok; i++)
            ok = sh_gmatch_accept_bytes(m, text + i, 1);
    } else {
        ok = sh_gmatch_accept_bytes(m, text, n);
    }
    ok = ok && sh_gmatch_can_end(m);
    sh_gmatch_free(m);
    return ok;
}

static void check_cases(const js_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const js_case *c = &cases[i];
        json_error_t je;
        json_t *j = json_loads(c->schema, JSON_DECODE_ANY, &je);
        if (!j) {
            SH_FAIL_("%s: schema is not JSON: %s", c->name, je.text);
            continue;
        }
        sh_json_schema_opts o = {.strict = !c->loose};
        char *text = NULL;
        sh_error e = {0};
        sh_err rc = sh_json_schema_to_gbnf(j, &o, &text, &e);
        json_decref(j);
        if (rc != SH_OK) {
            SH_FAIL_("%s: refused: %s", c->name, e.msg);
            continue;
        }
        sh_grammar *g = NULL;
        if (sh_grammar_parse(text, strlen(text), &g, &e) != SH_OK) {
            SH_FAIL_("%s: sh_grammar_parse: %s\n%s", c->name, e.msg, text);
            free(text);
            continue;
        }
        for (int k = 0; c->valid[k]; k++) {
            if (!accepts(g, c->valid[k], true))
                SH_FAIL_("%s: rejects valid %s (bytewise)\n%s", c->name, c->valid[k], text);
            if (!accepts(g, c->valid[k], false))
                SH_FAIL_("%s: rejects valid %s (whole)\n%s", c->name, c->valid[k], text);
        }
        for (int k = 0; c->invalid[k]; k++)
            if (accepts(g, c->invalid[k], true))
                SH_FAIL_("%s: accepts invalid %s\n%s", c->name, c->invalid[k], text);
        sh_grammar_free(g);
        free(text);
    }
}

static void test_cases_engine(void)
{
    CHECK(JS_N_CASES >= 30);
    check_cases(JS_CASES, JS_N_CASES);
}

/* llama.cpp's test-grammar-integration cases (json_schema_cases.h). */
static void test_llama_cases_engine(void) { check_cases(JS_LLAMA_CASES, JS_N_LLAMA_CASES); }

/* Whitespace between tokens is bounded: SH_JSON_SCHEMA_MAX_WS characters pass, one more not. */
static void test_whitespace_bound(void)
{
    json_t *j = json_loads("{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}", 0, NULL);
    char *text = NULL;
    CHECK_OK(sh_json_schema_to_gbnf(j, NULL, &text, NULL));
    json_decref(j);
    sh_grammar *g = NULL;
    if (!text || sh_grammar_parse(text, strlen(text), &g, NULL) != SH_OK) {
        SH_FAIL_("grammar did not parse");
        free(text);
        return;
    }
    char in[64];
    snprintf(in, sizeof in, "[1,%*s2]", SH_JSON_SCHEMA_MAX_WS, "");
    CHECK(accepts(g, in, true));
    snprintf(in, sizeof in, "[1,%*s2]", SH_JSON_SCHEMA_MAX_WS + 1, "");
    CHECK(!accepts(g, in, true));
    sh_grammar_free(g);
    free(text);
}

/* Schemas at the converter's bounds give grammars within the engine's: 300 optional properties,
 * maxLength 1000, 1000 items, 1024 enum values, 60 nested arrays, a 16-digit integer range. */
static void test_large_schemas(void)
{
    static const struct {
        const char *schema, *instance;
    } L[] = {
        {"{\"type\":\"string\",\"maxLength\":1000}", "\"abc\""},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":"
         "5000},\"maxItems\":1000}",
         "[4999,-5,0]"},
        {"{\"type\":\"integer\",\"minimum\":-9007199254740991,\"maximum\":9007199254740991}",
         "-9007199254740991"},
    };
    for (size_t i = 0; i < sizeof L / sizeof L[0] + 3; i++) {
        json_t *j;
        const char *in;
        if (i < sizeof L / sizeof L[0]) {
            j = json_loads(L[i].schema, 0, NULL);
            in = L[i].instance;
        } else if (i == sizeof L / sizeof L[0]) {
            json_t *props = json_object();
            for (int k = 0; k < 300; k++) {
                char name[16];
                snprintf(name, sizeof name, "p%d", k);
                json_object_set_new(props, name, json_pack("{s:s}", "type", "integer"));
            }
            j = json_pack("{s:s, s:o}", "type", "object", "properties", props);
            in = "{\"p3\":1,\"p299\":2}";
        } else if (i == sizeof L / sizeof L[0] + 1) {
            json_t *en = json_array();
            for (int k = 0; k < SH_JSON_SCHEMA_MAX_ENUM; k++)
                json_array_append_new(en, json_integer(k));
            j = json_pack("{s:o}", "enum", en);
            in = "1023";
        } else {
            j = json_pack("{s:s}", "type", "integer");
            for (int k = 0; k < 60; k++)
                j = json_pack("{s:s, s:o}", "type", "array", "items", j);
            in = "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]"
                 "]]]]]]]]"
                 "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]";
        }
        char *text = NULL;
        sh_error e = {0};
        if (sh_json_schema_to_gbnf(j, NULL, &text, &e) != SH_OK) {
            SH_FAIL_("large schema %zu refused: %s", i, e.msg);
            json_decref(j);
            continue;
        }
        json_decref(j);
        sh_grammar *g = NULL;
        if (sh_grammar_parse(text, strlen(text), &g, &e) != SH_OK) {
            SH_FAIL_("large schema %zu: sh_grammar_parse: %s", i, e.msg);
        } else {
            if (!accepts(g, in, true))
                SH_FAIL_("large schema %zu rejects %s", i, in);
            sh_grammar_free(g);
        }
        free(text);
    }
}

static const sh_test_case tests[] = {
    {"cases_engine", test_cases_engine},
    {"llama_cases_engine", test_llama_cases_engine},
    {"whitespace_bound", test_whitespace_bound},
    {"large_schemas", test_large_schemas},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
