/* JSON schema → GBNF: exact text for small schemas, every case of json_schema_cases.h through an
 * independent reference matcher (gbnf_ref.h), and the refusals (unsupported keywords with their
 * JSON pointer, malformed and unsatisfiable schemas, hostile sizes). */
#include <jansson.h>

#include "gbnf_ref.h"
#include "json_schema_cases.h"
#include "net/json_schema.h"
#include "sh_test.h"
#include "shoal/err.h"

/* Converts a schema given as JSON text; NULL (and *e filled) when it is refused. */
static char *convert(const char *schema, bool loose, sh_error *e)
{
    json_error_t je;
    json_t *j = json_loads(schema, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!j) {
        SH_FAIL_("test schema is not JSON: %s: %s", schema, je.text);
        return NULL;
    }
    sh_json_schema_opts o = {.strict = !loose};
    char *g = NULL;
    sh_error err = {0};
    sh_err rc = sh_json_schema_to_gbnf(j, &o, &g, &err);
    json_decref(j);
    if (e)
        *e = err;
    if (rc != SH_OK)
        CHECK(g == NULL);
    return g;
}

static void expect_gbnf(const char *schema, const char *want)
{
    sh_error e;
    char *g = convert(schema, false, &e);
    if (!g) {
        SH_FAIL_("%s refused: %s", schema, e.msg);
        return;
    }
    CHECK_STR_EQ(g, want);
    free(g);
}

#define WS "ws ::= [ \\t\\n]{0,20}\n"
#define CHAR                                                                                       \
    "char ::= [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-CeEfF] "      \
    "[0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))\n"

static void test_exact(void)
{
    expect_gbnf("{\"type\":\"boolean\"}", "root ::= (\"true\" | \"false\")\n");
    expect_gbnf("{\"enum\":[\"a\",2,null]}", "root ::= (\"\\\"a\\\"\" | \"2\" | \"null\")\n");
    expect_gbnf("{\"type\":\"string\",\"maxLength\":3}",
                "root ::= \"\\\"\" char{0,3} \"\\\"\"\n" CHAR);
    expect_gbnf("{\"type\":\"integer\",\"minimum\":3,\"maximum\":120}",
                "root ::= (([3-9]) | [1-9] [0-9]{1,1} | \"1\" ([0-1] [0-9] | \"2\" \"0\"))\n");
    expect_gbnf("{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"null\"},\"a\":{\"type\":"
                "\"integer\"}},\"required\":[\"a\"]}",
                "root ::= \"{\" ws \"\\\"a\\\"\" ws \":\" ws integer (ws \",\" ws \"\\\"b\\\"\" ws "
                "\":\" ws \"null\")? ws \"}\"\n" WS
                "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n");
    expect_gbnf("{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"maxItems\":2}",
                "root ::= \"[\" ws ((\"true\" | \"false\") (ws \",\" ws (\"true\" | \"false\"))? "
                "ws)? \"]\"\n" WS);
    expect_gbnf("{\"$defs\":{\"l\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/l\"}}},"
                "\"$ref\":\"#/$defs/l\"}",
                "root ::= ref-l-1\n"
                "ref-l-1 ::= \"[\" ws (ref-l-1 (ws \",\" ws ref-l-1)* ws)? \"]\"\n" WS);
    expect_gbnf("{\"type\":\"string\",\"pattern\":\"^a[0-9]?$\"}",
                "root ::= \"\\\"\" ((\"a\" [0-9]?)) \"\\\"\"\n");
}

/* Every case: the grammar parses in the reference parser, accepts the valid instances and
 * rejects the invalid ones. */
static void expect_refused(const char *schema, const char *msg);

static void check_cases(const js_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const js_case *c = &cases[i];
        sh_error e;
        char *text = convert(c->schema, c->loose, &e);
        if (!text) {
            SH_FAIL_("%s: refused: %s", c->name, e.msg);
            continue;
        }
        gr_grammar g;
        if (!gr_parse(&g, text)) {
            SH_FAIL_("%s: reference parser: %s\n%s", c->name, g.err, text);
            gr_free(&g);
            free(text);
            continue;
        }
        for (int k = 0; c->valid[k]; k++)
            if (!gr_accepts(&g, c->valid[k]))
                SH_FAIL_("%s: rejects valid %s\n%s", c->name, c->valid[k], text);
        for (int k = 0; c->invalid[k]; k++)
            if (gr_accepts(&g, c->invalid[k]))
                SH_FAIL_("%s: accepts invalid %s\n%s", c->name, c->invalid[k], text);
        gr_free(&g);
        free(text);
    }
}

static void test_cases_reference(void)
{
    CHECK(JS_N_CASES >= 30);
    check_cases(JS_CASES, JS_N_CASES);
}

/* llama.cpp's test-grammar-integration cases (json_schema_cases.h). */
static void test_llama_cases_reference(void) { check_cases(JS_LLAMA_CASES, JS_N_LLAMA_CASES); }

/* Where JSON Schema and llama.cpp's converter disagree, the converter follows JSON Schema: {} is
 * any value (llama.cpp: an object), and uniqueItems is refused (llama.cpp: ignored). */
static void test_llama_divergences(void)
{
    sh_error e;
    char *text = convert("{}", false, &e);
    gr_grammar g;
    if (text && gr_parse(&g, text)) {
        CHECK(gr_accepts(&g, "{}"));
        CHECK(gr_accepts(&g, "{\"foo\": \"bar\"}"));
        CHECK(gr_accepts(&g, "null"));
        CHECK(gr_accepts(&g, "[]"));
        CHECK(!gr_accepts(&g, ""));
        gr_free(&g);
    } else {
        SH_FAIL_("{} did not convert");
    }
    free(text);
    expect_refused("{\"type\":\"object\",\"properties\":{\"tags\":{\"type\":\"array\","
                   "\"items\":{\"type\":\"string\"},\"uniqueItems\":true}}}",
                   "unsupported keyword 'uniqueItems' at /properties/tags");
}

static void expect_refused(const char *schema, const char *msg)
{
    sh_error e = {0};
    char *g = convert(schema, false, &e);
    if (g) {
        SH_FAIL_("accepted %s:\n%s", schema, g);
        free(g);
        return;
    }
    if (e.code != SH_EINVAL || !strstr(e.msg, msg))
        SH_FAIL_("%s: error %d \"%s\", want SH_EINVAL with \"%s\"", schema, e.code, e.msg, msg);
}

static void test_refused(void)
{
    expect_refused("{\"type\":\"object\",\"properties\":{\"a\":{\"if\":{}}}}",
                   "unsupported keyword 'if' at /properties/a");
    expect_refused("{\"not\":{}}", "unsupported keyword 'not' at /");
    expect_refused("{\"type\":\"array\",\"items\":{\"uniqueItems\":true}}",
                   "unsupported keyword 'uniqueItems' at /items");
    expect_refused("{\"type\":\"number\",\"multipleOf\":2}", "unsupported keyword 'multipleOf'");
    expect_refused("{\"properties\":{\"a/b\":{\"patternProperties\":{}}}}",
                   "unsupported keyword 'patternProperties' at /properties/a~1b");
    expect_refused("{\"anyOf\":[{\"type\":\"string\"},{\"minProperties\":1}]}",
                   "unsupported keyword 'minProperties' at /anyOf/1");
    expect_refused("{\"$defs\":{\"x\":{\"dependentRequired\":{}}},\"$ref\":\"#/$defs/x\"}",
                   "unsupported keyword 'dependentRequired' at /$defs/x");
    expect_refused("{\"type\":\"string\",\"format\":\"email\"}", "unsupported format 'email'");
    expect_refused("{\"type\":\"string\",\"pattern\":\"a(?=b)\"}", "lookaround");
    expect_refused("{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "backreference");
    expect_refused("{\"type\":\"string\",\"pattern\":\"\\\\bword\"}", "word boundary");
    expect_refused("{\"type\":\"string\",\"pattern\":\"a^b\"}", "anchor inside the pattern");
    expect_refused("{\"type\":\"string\",\"pattern\":\"(ab\"}", "unbalanced parenthesis");
    expect_refused("{\"type\":\"string\",\"pattern\":\"\\\\p{L}\"}", "Unicode property");
    expect_refused("{\"type\":\"string\",\"pattern\":\"*a\"}", "nothing to repeat");
    expect_refused("{\"type\":\"string\",\"pattern\":\"a{2000}\"}", "repetition count");
    expect_refused("{\"$ref\":\"http://example.com/s.json\"}", "only local references");
    expect_refused("{\"$ref\":\"#/$defs/missing\"}", "unresolvable $ref '#/$defs/missing'");
    expect_refused("{\"$ref\":\"#\"}", "$ref '#' refers only to itself");
    expect_refused("{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},"
                   "\"$ref\":\"#/$defs/a\"}",
                   "refers only to itself");
    expect_refused("{\"type\":\"string\",\"pattern\":\"a\\u0000b\"}", "NUL");
    expect_refused("{\"type\":\"string\",\"maxLength\":5000}", "'maxLength' above 1000");
    expect_refused("{\"type\":\"array\",\"minItems\":1001}", "'minItems' above 1000");
    expect_refused("{\"type\":\"string\",\"minLength\":-1}", "not a nonnegative integer");
    expect_refused("{\"type\":\"strin\"}", "unknown type 'strin'");
    expect_refused("{\"type\":[]}", "'type' is not a type name");
    expect_refused("{\"enum\":[]}", "unsatisfiable");
    expect_refused("{\"type\":\"integer\",\"enum\":[\"a\"]}", "unsatisfiable");
    expect_refused("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "unsatisfiable");
    expect_refused("{\"type\":\"integer\",\"exclusiveMinimum\":4,\"exclusiveMaximum\":5}",
                   "unsatisfiable");
    expect_refused("{\"type\":\"number\",\"minimum\":0.5}", "non-integer bound");
    expect_refused("{\"type\":\"number\",\"exclusiveMinimum\":true}", "boolean");
    expect_refused("{\"type\":\"string\",\"minLength\":3,\"maxLength\":2}", "unsatisfiable");
    expect_refused("{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "unsatisfiable");
    expect_refused("{\"type\":\"array\",\"prefixItems\":[{}],\"items\":false,\"minItems\":2}",
                   "unsatisfiable");
    expect_refused("{\"type\":\"object\",\"required\":[\"x\"]}",
                   "required property 'x' is not in properties");
    expect_refused("{\"properties\":{\"a\":false},\"required\":[\"a\"]}",
                   "unsatisfiable: schema false at /properties/a");
    expect_refused("{\"anyOf\":[{\"type\":\"string\"}],\"type\":\"string\"}",
                   "keyword 'type' beside 'anyOf'");
    expect_refused("{\"allOf\":[{\"type\":\"string\"}]}", "merge of object schemas");
    expect_refused("{\"allOf\":[{\"properties\":{\"a\":{}}},{\"properties\":{\"a\":{}}}]}",
                   "property 'a' defined twice");
    expect_refused("{\"type\":\"string\",\"pattern\":\"a\",\"maxLength\":3}", "combining");
    expect_refused("{\"enum\":[1],\"minimum\":0}", "keyword 'minimum' beside 'enum'");
    expect_refused("[1]", "not an object or a boolean");
    expect_refused("false", "unsatisfiable: schema false");
    expect_refused("{\"type\":\"array\",\"items\":[{}],\"prefixItems\":[{}]}",
                   "'items' as an array beside 'prefixItems'");
    expect_refused("{\"type\":\"array\",\"items\":[{}],\"additionalItems\":false}",
                   "unsupported keyword 'additionalItems'");
    expect_refused(
        "{\"items\":[{\"type\":\"string\"},{\"format\":\"x\"}]}",
        "unsupported format 'x' (supported: date, time, date-time, uuid, ipv4) at /items/1");
}

/* Hostile sizes end in an error, not in unbounded time or memory. */
static void test_bounds(void)
{
    /* Deep nesting. */
    char deep[8192] = "";
    for (int i = 0; i < 100; i++)
        strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{}");
    for (int i = 0; i < 100; i++)
        strcat(deep, "}");
    expect_refused(deep, "nested deeper than 64");
    /* A long enum. */
    json_t *en = json_array();
    for (int i = 0; i < 2000; i++)
        json_array_append_new(en, json_integer(i));
    json_t *s = json_pack("{s:o}", "enum", en);
    char *g = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(sh_json_schema_to_gbnf(s, NULL, &g, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "more than 1024 values") != NULL);
    json_decref(s);
    /* Doubling at every level (an array of arrays, each with two properties referring to the
     * next level) stays linear through shared rules and the byte bound. */
    json_t *defs = json_object();
    for (int i = 0; i < 30; i++) {
        char ref[32], name[16];
        snprintf(name, sizeof name, "d%d", i);
        snprintf(ref, sizeof ref, "#/$defs/d%d", i + 1);
        json_t *next =
            i == 29 ? json_pack("{s:s}", "type", "integer") : json_pack("{s:s}", "$ref", ref);
        json_object_set_new(
            defs, name,
            json_pack("{s:s, s:{s:O, s:O}}", "type", "object", "properties", "a", next, "b", next));
        json_decref(next);
    }
    s = json_pack("{s:o, s:s}", "$defs", defs, "$ref", "#/$defs/d0");
    if (sh_json_schema_to_gbnf(s, NULL, &g, &e))
        SH_FAIL_("doubling schema refused: %s", e.msg);
    CHECK(g && strlen(g) < 64 * 1024);
    free(g);
    json_decref(s);
    /* Many optional properties: linear through tail rules (300 of them well under 64 KiB), and
     * refused past the rule bound. */
    for (int n = 300; n <= 3000; n += 2700) {
        json_t *props = json_object();
        for (int i = 0; i < n; i++) {
            char name[16];
            snprintf(name, sizeof name, "p%d", i);
            json_object_set_new(props, name, json_pack("{s:s}", "type", "integer"));
        }
        s = json_pack("{s:s, s:o}", "type", "object", "properties", props);
        sh_err rc = sh_json_schema_to_gbnf(s, NULL, &g, &e);
        if (n == 300) {
            CHECK_INT_EQ(rc, SH_OK);
            CHECK(g && strlen(g) < 64 * 1024);
            free(g);
        } else {
            CHECK_INT_EQ(rc, SH_EINVAL);
            CHECK(g == NULL);
            CHECK(strstr(e.msg, "more than 4096 named rules") != NULL);
        }
        json_decref(s);
    }
}

/* Annotations are ignored; key order follows the schema with required ones first. */
static void test_annotations_and_order(void)
{
    sh_error e;
    char *g = convert("{\"$schema\":\"https://json-schema.org/draft/2020-12/schema\",\"$id\":\"x\","
                      "\"title\":\"t\",\"description\":\"d\",\"examples\":[1],\"default\":1,"
                      "\"$comment\":\"c\",\"deprecated\":false,\"readOnly\":true,\"writeOnly\":"
                      "false,\"type\":\"integer\"}",
                      false, &e);
    CHECK(g != NULL);
    if (g)
        CHECK(strncmp(g, "root ::= integer\n", 17) == 0);
    free(g);
    g = convert("{\"type\":\"object\",\"properties\":{\"z\":{},\"y\":{},\"x\":{}},\"required\":["
                "\"x\",\"z\"]}",
                false, &e);
    CHECK(g != NULL);
    if (g) {
        const char *z = strstr(g, "\\\"z\\\""), *x = strstr(g, "\\\"x\\\""),
                   *y = strstr(g, "\\\"y\\\"");
        CHECK(z && x && y && z < x && x < y);
    }
    free(g);
}

/* Integer and number bounds are exact: for random bounds (inclusive, exclusive, one-sided, across
 * zero and powers of ten), every integer in a window and fractions around each bound are accepted
 * exactly when they are within them. */
static void test_ranges_exact(void)
{
    uint64_t seed = 99;
    static const long long edges[] = {0, 1, 9, 10, 99, 100, 999, 1000, 1001, 12345, 99999};
    for (int t = 0; t < 48; t++) {
        bool frac = t % 3 == 2;
        long long lo = (long long)(gr_rand(&seed) % 2400) - 1200;
        long long hi = lo + (long long)(gr_rand(&seed) % 1300);
        if (t % 7 == 3) {
            lo = edges[gr_rand(&seed) % 11] * (t % 2 ? -1 : 1);
            hi = edges[gr_rand(&seed) % 11];
            if (hi < lo)
                hi = lo;
        }
        bool has_lo = t % 5 != 1, has_hi = t % 5 != 2 || !has_lo;
        bool lo_x = t % 4 == 1, hi_x = t % 4 == 2;
        if (hi == lo && (lo_x || hi_x))
            hi++;
        char schema[256], part[96];
        snprintf(schema, sizeof schema, "{\"type\":\"%s\"", frac ? "number" : "integer");
        if (has_lo) {
            snprintf(part, sizeof part, ",\"%s\":%lld", lo_x ? "exclusiveMinimum" : "minimum", lo);
            strcat(schema, part);
        }
        if (has_hi) {
            snprintf(part, sizeof part, ",\"%s\":%lld", hi_x ? "exclusiveMaximum" : "maximum", hi);
            strcat(schema, part);
        }
        strcat(schema, "}");
        sh_error e;
        char *text = convert(schema, false, &e);
        gr_grammar g;
        if (!text || !gr_parse(&g, text)) {
            SH_FAIL_("%s: %s", schema, text ? g.err : e.msg);
            free(text);
            continue;
        }
        for (long long v = -1300; v <= 1300; v++) {
            static const char *const fr[] = {"", ".0", ".5", ".000", ".001"};
            for (int f = 0; f < (frac ? 5 : 1); f++) {
                double x = (double)v + (f == 2 ? 0.5 : f == 4 ? 0.001 : 0) * (v < 0 ? -1 : 1);
                if (v == 0 && f != 0 && !frac)
                    continue;
                bool in = (!has_lo || (lo_x ? x > (double)lo : x >= (double)lo)) &&
                          (!has_hi || (hi_x ? x < (double)hi : x <= (double)hi));
                char num[48];
                snprintf(num, sizeof num, "%lld%s", v, fr[f]);
                if (gr_accepts(&g, num) != in)
                    SH_FAIL_("%s: %s %s", schema, num, in ? "rejected" : "accepted");
            }
        }
        /* Far values: only inside when the side is open. */
        if (gr_accepts(&g, "123456789012345") != !has_hi)
            SH_FAIL_("%s: 123456789012345", schema);
        if (gr_accepts(&g, "-123456789012345") != !has_lo)
            SH_FAIL_("%s: -123456789012345", schema);
        if (!frac)
            CHECK(!gr_accepts(&g, "-0")); /* never produced: "0" stands for zero */
        for (int f = 0; frac && f < 3; f++) {
            static const char *const small[] = {"-0.5", "-0.001", "0.25"};
            static const double sv[] = {-0.5, -0.001, 0.25};
            bool in = (!has_lo || (lo_x ? sv[f] > (double)lo : sv[f] >= (double)lo)) &&
                      (!has_hi || (hi_x ? sv[f] < (double)hi : sv[f] <= (double)hi));
            if (gr_accepts(&g, small[f]) != in)
                SH_FAIL_("%s: %s %s", schema, small[f], in ? "rejected" : "accepted");
        }
        gr_free(&g);
        free(text);
    }
}

/* Random sentences of every case's grammar (the reference generator) are JSON that jansson reads
 * (numbers within a double's range) and that the reference matcher accepts. */
static void test_generated_sentences(void)
{
    uint64_t seed = 7;
    for (size_t i = 0; i < JS_N_CASES + JS_N_LLAMA_CASES; i++) {
        const js_case *c = i < JS_N_CASES ? &JS_CASES[i] : &JS_LLAMA_CASES[i - JS_N_CASES];
        char *text = convert(c->schema, c->loose, NULL);
        gr_grammar g;
        if (!text || !gr_parse(&g, text)) {
            SH_FAIL_("%s: no grammar", c->name);
            free(text);
            continue;
        }
        for (int k = 0; k < 100; k++) {
            gr_out out;
            if (!gr_sentence(&g, &out, &seed)) {
                SH_FAIL_("%s: the generator found no sentence", c->name);
                break;
            }
            json_error_t je;
            json_t *j = json_loads(out.buf, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!j)
                SH_FAIL_("%s: sentence is not JSON (%s): %s", c->name, je.text, out.buf);
            json_decref(j);
            if (!gr_accepts(&g, out.buf))
                SH_FAIL_("%s: the matcher rejects a generated sentence: %s", c->name, out.buf);
        }
        gr_free(&g);
        free(text);
    }
}

/* OpenAI's response_format: text, json_object (with llama.cpp's schema member), json_schema with
 * strict on and off, and each bad form with the field it names. */
static void rf_case(const char *rf, const char *accept, const char *reject, const char *param,
                    const char *msg)
{
    json_t *j = rf ? json_loads(rf, JSON_DECODE_ANY, NULL) : NULL;
    if (rf && !j) {
        SH_FAIL_("test response_format is not JSON: %s", rf);
        return;
    }
    char *g = (char *)"unset", pm[64] = "unset";
    sh_error e = {0};
    sh_err rc = sh_json_schema_response_format(j, &g, pm, &e);
    json_decref(j);
    if (param) {
        CHECK_INT_EQ(rc, SH_EINVAL);
        CHECK(g == NULL);
        CHECK_STR_EQ(pm, param);
        if (!strstr(e.msg, msg))
            SH_FAIL_("%s: message \"%s\", want \"%s\"", rf, e.msg, msg);
        return;
    }
    CHECK_INT_EQ(rc, SH_OK);
    CHECK_STR_EQ(pm, "");
    if (!accept) {
        CHECK(g == NULL);
        return;
    }
    gr_grammar gg;
    if (!g || !gr_parse(&gg, g)) {
        SH_FAIL_("%s: no grammar", rf);
        free(g);
        return;
    }
    CHECK(gr_accepts(&gg, accept));
    CHECK(!gr_accepts(&gg, reject));
    gr_free(&gg);
    free(g);
}

static void test_response_format(void)
{
    rf_case(NULL, NULL, NULL, NULL, NULL);
    rf_case("null", NULL, NULL, NULL, NULL);
    rf_case("{\"type\":\"text\"}", NULL, NULL, NULL, NULL);
    rf_case("{\"type\":\"json_object\"}", "{\"a\": [1, {}]}", "[]", NULL, NULL);
    rf_case("{\"type\":\"json_object\",\"schema\":{\"type\":\"object\",\"properties\":{\"n\":"
            "{\"type\":\"integer\"}},\"required\":[\"n\"]}}",
            "{\"n\":1}", "{\"n\":1,\"m\":2}", NULL, NULL);
#define JS_RF                                                                                      \
    "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"r\",\"schema\":{\"type\":\"object\","   \
    "\"properties\":{\"n\":{\"type\":\"integer\"}},\"required\":[\"n\"]}%s}}"
    char buf[512];
    snprintf(buf, sizeof buf, JS_RF, ",\"strict\":true");
    rf_case(buf, "{\"n\":1}", "{\"n\":1,\"m\":2}", NULL, NULL);
    snprintf(buf, sizeof buf, JS_RF, "");
    rf_case(buf, "{\"n\":1}", "{\"n\":1,\"m\":2}", NULL, NULL);
    snprintf(buf, sizeof buf, JS_RF, ",\"strict\":false");
    rf_case(buf, "{\"n\":1,\"m\":2}", "{\"m\":2}", NULL, NULL);
    rf_case("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"any\"}}", "[1]", "[1", NULL,
            NULL);
    rf_case("\"json_object\"", NULL, NULL, "response_format", "not an object");
    rf_case("{}", NULL, NULL, "response_format.type", "not a string");
    rf_case("{\"type\":\"xml\"}", NULL, NULL, "response_format.type",
            "unknown response_format.type 'xml'");
    rf_case("{\"type\":\"json_schema\"}", NULL, NULL, "response_format.json_schema",
            "not an object");
    rf_case("{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{},\"strict\":1}}", NULL, NULL,
            "response_format.json_schema.strict", "not a boolean");
    rf_case("{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"properties\":{\"a\":{"
            "\"if\":{}}}}}}",
            NULL, NULL, "response_format.json_schema.schema",
            "unsupported keyword 'if' at /properties/a");
    rf_case("{\"type\":\"json_object\",\"schema\":{\"not\":{}}}", NULL, NULL,
            "response_format.schema", "unsupported keyword 'not' at /");
}

static const sh_test_case tests[] = {
    {"exact", test_exact},
    {"cases_reference", test_cases_reference},
    {"llama_cases_reference", test_llama_cases_reference},
    {"llama_divergences", test_llama_divergences},
    {"refused", test_refused},
    {"bounds", test_bounds},
    {"annotations_and_order", test_annotations_and_order},
    {"generated_sentences", test_generated_sentences},
    {"ranges_exact", test_ranges_exact},
    {"response_format", test_response_format},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
