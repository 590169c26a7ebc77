/* Unit tests of the GBNF parser and matcher: grammars written here (arithmetic, JSON from the
 * ECMA-404 spec, CSV, a small language) against accepted and rejected strings, the parser's
 * errors and bounds, partial UTF-8, and the token mask against token-by-token checks on a small
 * vocabulary and on the default model's. */
#include <time.h>

#include "model/gguf.h"
#include "model/grammar.h"
#include "model/tokenizer.h"
#include "sh_test.h"

static const char *ARITH = "root   ::= expr\n"
                           "expr   ::= term ((\"+\" | \"-\") term)*\n"
                           "term   ::= factor ((\"*\" | \"/\") factor)*\n"
                           "factor ::= number | \"(\" expr \")\" | \"-\" factor\n"
                           "number ::= [0-9]+ (\".\" [0-9]+)?\n";

/* JSON as ECMA-404 defines it, with optional whitespace around values. */
static const char *JSON = "# JSON (ECMA-404)\n"
                          "root    ::= ws value ws\n"
                          "value   ::= object | array | string | number | \"true\" | \"false\" "
                          "| \"null\"\n"
                          "object  ::= \"{\" ws ( member ( ws \",\" ws member )* ws )? \"}\"\n"
                          "member  ::= string ws \":\" ws value\n"
                          "array   ::=\n"
                          "  \"[\" ws (\n"
                          "    value\n"
                          "    (ws \",\" ws value)* ws\n"
                          "  )? \"]\"\n"
                          "string  ::= \"\\\"\" char* \"\\\"\"\n"
                          "char    ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" "
                          "hex{4})\n"
                          "hex     ::= [0-9a-fA-F]\n"
                          "number  ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? "
                          "[0-9]+)?\n"
                          "ws      ::= [ \\t\\n\\r]*\n";

static const char *CSV = "root  ::= row (\"\\n\" row)* \"\\n\"?\n"
                         "row   ::= field (\",\" field)*\n"
                         "field ::= [^,\"\\n]* | \"\\\"\" ([^\"] | \"\\\"\\\"\")* \"\\\"\"\n";

/* A small imperative language: assignments, print, while and if blocks. */
static const char *LANG = "root  ::= ws (stmt ws)+\n"
                          "stmt  ::= (\n"
                          "    ident ws \"=\" ws expr ws \";\"\n"
                          "  | \"print\" ws \"(\" ws expr ws \")\" ws \";\"\n"
                          "  | (\"while\" | \"if\") ws \"(\" ws cond ws \")\" ws block)\n"
                          "block ::= \"{\" ws (stmt ws)* \"}\"\n"
                          "cond  ::= expr ws (\"<\" | \">\" | \"==\" | \"!=\") ws expr\n"
                          "expr  ::= atom (ws [-+*/] ws atom)*\n"
                          "atom  ::= ident | [0-9]+ | \"(\" ws expr ws \")\"\n"
                          "ident ::= [a-z_] [a-z0-9_]{0,31}\n"
                          "ws    ::= [ \\t\\n]*\n";

static sh_grammar *parse(const char *text)
{
    sh_grammar *g = NULL;
    sh_error e = {0};
    if (sh_grammar_parse(text, strlen(text), &g, &e))
        fprintf(stderr, "parse: %s\n", e.msg);
    return g;
}

/* Whether the whole of s is a sentence of g. */
static int sentence(const sh_grammar *g, const char *s)
{
    sh_gmatch *m = NULL;
    if (sh_gmatch_create(g, &m, NULL))
        return -1;
    int ok = sh_gmatch_accept_bytes(m, s, strlen(s)) && sh_gmatch_can_end(m);
    sh_gmatch_free(m);
    return ok;
}

#define CHECK_SENTENCE(g, s, want)                                                                 \
    do {                                                                                           \
        int got_ = sentence(g, s);                                                                 \
        if (got_ != (want))                                                                        \
            SH_FAIL_("\"%s\": expected %s, got %d", s, (want) ? "a sentence" : "rejection", got_); \
    } while (0)

static void test_arithmetic(void)
{
    sh_grammar *g = parse(ARITH);
    CHECK(g != NULL);
    if (!g)
        return;
    const char *good[] = {"1", "1+2", "(1+2)*3", "-4/2.5", "((7))", "1*-2", "10-2-3"};
    const char *bad[] = {"", "1+", "(1", "1)", "+1", "1..2", "a", "1 + 2", "()"};
    for (size_t k = 0; k < sizeof good / sizeof *good; k++)
        CHECK_SENTENCE(g, good[k], 1);
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++)
        CHECK_SENTENCE(g, bad[k], 0);
    /* A prefix is accepted but cannot end; a wrong byte is refused and leaves m unchanged. */
    sh_gmatch *m = NULL;
    CHECK_OK(sh_gmatch_create(g, &m, NULL));
    CHECK(sh_gmatch_accept_bytes(m, "(1+", 3));
    CHECK(!sh_gmatch_can_end(m));
    CHECK(!sh_gmatch_accept_bytes(m, ")", 1));
    CHECK(sh_gmatch_accept_bytes(m, "2)", 2));
    CHECK(sh_gmatch_can_end(m));
    CHECK_INT_EQ(sh_gmatch_error(m, NULL), SH_OK);
    sh_gmatch_free(m);
    sh_grammar_free(g);
}

static void test_json(void)
{
    sh_grammar *g = parse(JSON);
    CHECK(g != NULL);
    if (!g)
        return;
    const char *good[] = {"{}",
                          "[]",
                          "0",
                          "-0.5e+10",
                          "\"\"",
                          "true",
                          " null ",
                          "{\"a\": [1, 2, {\"b\": null}]}",
                          "\"\\u00e9\\n\"",
                          "\"h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80\"",
                          "[\n  {\"k\" : \"v\"},\n  []\n]\n"};
    const char *bad[] = {
        "{",      "{\"a\"}", "[1,]", "01",       "\"\\x\"",      "\"a\nb\"",        "tru",
        "{a: 1}", "[1 2]",   "1.",   "\"\xc3\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\""};
    for (size_t k = 0; k < sizeof good / sizeof *good; k++)
        CHECK_SENTENCE(g, good[k], 1);
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++)
        CHECK_SENTENCE(g, bad[k], 0);
    sh_grammar_free(g);
}

static void test_csv_and_language(void)
{
    sh_grammar *g = parse(CSV);
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "a,b,c\n1,2,3\n", 1);
        CHECK_SENTENCE(g, "\"x,y\",\"say \"\"hi\"\"\",\n", 1);
        CHECK_SENTENCE(g, "", 1);
        CHECK_SENTENCE(g, "a\"b", 0);
        CHECK_SENTENCE(g, "\"open", 0);
        sh_grammar_free(g);
    }
    g = parse(LANG);
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "x = 1;\nwhile (x < 10) { x = x + 1; print(x); }\n", 1);
        CHECK_SENTENCE(g, "if (a == b) {}", 1);
        CHECK_SENTENCE(g, "x = ;", 0);
        CHECK_SENTENCE(g, "while x < 1 {}", 0);
        CHECK_SENTENCE(g, "print(1)", 0);
        /* ident is at most 32 characters: {0,31} after the first. */
        CHECK_SENTENCE(g, "abcdefghijabcdefghijabcdefghijab = 1;", 1);
        CHECK_SENTENCE(g, "abcdefghijabcdefghijabcdefghijabc = 1;", 0);
        sh_grammar_free(g);
    }
}

static void test_repetition_and_classes(void)
{
    sh_grammar *g = parse("root ::= \"ab\"{2,3} [^a-c\\]] . x?\nx ::= \"\\x41\" \"\\u00E9\"");
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "ababdz", 1);
        CHECK_SENTENCE(g, "abababdz", 1);
        CHECK_SENTENCE(g,
                       "abababab"
                       "dz",
                       0);
        CHECK_SENTENCE(g,
                       "ab"
                       "dz",
                       0);
        CHECK_SENTENCE(g, "ababbz", 0);
        CHECK_SENTENCE(g, "abab]z", 0);
        CHECK_SENTENCE(g,
                       "ababd\xe2\x82\xac"
                       "A\xc3\xa9",
                       1);
        sh_grammar_free(g);
    }
    g = parse("root ::= [a]{3,}");
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "aa", 0);
        CHECK_SENTENCE(g, "aaaaaaaaaa", 1);
        sh_grammar_free(g);
    }
}

static void test_partial_utf8(void)
{
    sh_grammar *g = parse("root ::= \"\xc3\xa9\" [\xe2\x82\xac-\xe2\x82\xaf]");
    CHECK(g != NULL);
    if (!g)
        return;
    sh_gmatch *m = NULL;
    CHECK_OK(sh_gmatch_create(g, &m, NULL));
    CHECK(sh_gmatch_accept_bytes(m, "\xc3", 1)); /* pending: could become U+00E9 */
    CHECK(!sh_gmatch_can_end(m));
    CHECK(!sh_gmatch_accept_bytes(m, "\xa8", 1)); /* U+00E8: not allowed */
    CHECK(sh_gmatch_accept_bytes(m, "\xa9\xe2", 2));
    CHECK(!sh_gmatch_accept_bytes(m, "\x81", 1)); /* U+2040..U+207F: outside the class */
    CHECK(sh_gmatch_accept_bytes(m, "\x82", 1));
    sh_gmatch *c = NULL;
    CHECK_OK(sh_gmatch_clone(m, &c, NULL));
    CHECK(sh_gmatch_accept_bytes(m, "\xac", 1));
    CHECK(sh_gmatch_can_end(m));
    CHECK(!sh_gmatch_accept_bytes(m, "a", 1));
    /* The clone stays where it was copied. */
    CHECK(!sh_gmatch_can_end(c));
    CHECK(!sh_gmatch_accept_bytes(c, "\xb0", 1));
    CHECK(sh_gmatch_accept_bytes(c, "\xaf", 1));
    CHECK(sh_gmatch_can_end(c));
    sh_gmatch_free(c);
    sh_gmatch_free(m);
    /* Invalid UTF-8 is never accepted, even by `.`. */
    sh_grammar_free(g);
    g = parse("root ::= .*");
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "\xff", 0);
        CHECK_SENTENCE(g, "\xc0\x80", 0);
        CHECK_SENTENCE(g, "\x80", 0);
        CHECK_SENTENCE(g, "any \xe6\x97\xa5\xe6\x9c\xac", 1);
        /* A surrogate's first two bytes are refused at once (no code point can follow). */
        CHECK_OK(sh_gmatch_create(g, &m, NULL));
        CHECK(!sh_gmatch_accept_bytes(m, "\xed\xa0", 2));
        CHECK(sh_gmatch_accept_bytes(m, "\xed\x9f", 2));
        sh_gmatch_free(m);
        sh_grammar_free(g);
    }
}

/* The error for text, which must contain want. */
static void check_error(const char *text, sh_err code, const char *want)
{
    sh_grammar *g = NULL;
    sh_error e = {0};
    sh_err rc = sh_grammar_parse(text, strlen(text), &g, &e);
    if (rc != code || !strstr(e.msg, want))
        SH_FAIL_("grammar \"%.40s\": expected %s with \"%s\", got %s: \"%s\"", text,
                 sh_strerror(code), want, sh_strerror(rc), e.msg);
    CHECK(g == NULL);
}

static void test_errors(void)
{
    check_error("root ::= \"a", SH_EINVAL, "line 1, column 10: unterminated string");
    check_error("root ::= a\n\nb ::= [a-", SH_EINVAL, "line 3, column 7: unterminated");
    check_error("root ::= x\n", SH_EINVAL, "line 1, column 10: undefined rule 'x'");
    check_error("r ::= \"a\"\n", SH_EINVAL, "no 'root' rule");
    check_error("root ::= \"a\" )", SH_EINVAL, "line 1, column 14: unexpected ')'");
    check_error("root ::= (\"a\"", SH_EINVAL, "expected ')'");
    check_error("root = \"a\"", SH_EINVAL, "line 1, column 6: expected '::='");
    check_error("root ::= * \"a\"", SH_EINVAL, "repetition without a preceding item");
    check_error("root ::= \"\\q\"", SH_EINVAL, "column 11: unknown escape");
    check_error("root ::= [z-a]", SH_EINVAL, "range end");
    check_error("root ::= \"a\"{3,2}", SH_EINVAL, "maximum is below");
    check_error("root ::= \"a\"\nroot ::= \"b\"", SH_EINVAL,
                "line 2, column 1: rule 'root' "
                "defined twice");
    check_error("root ::= \"\xff\"", SH_EINVAL, "invalid UTF-8");
    check_error("root ::= root \"a\" | \"b\"", SH_EINVAL, "'root' is left-recursive");
    check_error("root ::= x\nx ::= y? x \"a\" | \"b\"\ny ::= \"c\"", SH_EINVAL,
                "'x' is left-recursive");
    check_error("root ::= root \"a\"", SH_EINVAL, "left-recursive");
    check_error("root ::= \"a\" root", SH_EINVAL, "language of 'root' is empty");
    check_error("root ::= x\nx ::= \"b\" x | \"c\" x", SH_EINVAL, "empty");
    check_error("", SH_EINVAL, "no 'root' rule");
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_bounds(void)
{
    check_error("root ::= \"a\"{10001}", SH_ERANGE, "repetition count above");
    check_error("root ::= \"a\"{0,99999999999999999999}", SH_ERANGE, "repetition count above");
    /* Repeated literals are copied: past the element bound the grammar is refused, quickly. */
    char big[512] = "root ::=";
    for (int k = 0; k < 7; k++)
        strcat(big, " \"0123456789abcdef\"{10000}");
    double t0 = now();
    check_error(big, SH_ERANGE, "grammar too large");
    CHECK(now() - t0 < 2.0);
    check_error("root ::= \"a\"{0,10000} \"a\"{0,10000} \"a\"{0,10000} \"a\"{0,10000} "
                "\"a\"{0,10000} \"a\"{0,10000} \"a\"{0,10000}",
                SH_ERANGE, "too many rules");
    char deep[400];
    memset(deep, '(', 150);
    snprintf(deep + 150, sizeof deep - 150, "\"a\"");
    char text[600];
    snprintf(text, sizeof text, "root ::= %s", deep);
    check_error(text, SH_ERANGE, "nested more than");
    /* States that blow up: (a|a|...)-style ambiguity multiplies stacks; the matcher stops at its
     * bound and says so, in bounded time. */
    sh_grammar *g = parse("root ::= x{0,3000}\nx ::= [a-z] | [a-z] [a-z]{0,3000}");
    CHECK(g != NULL);
    if (g) {
        sh_gmatch *m = NULL;
        t0 = now();
        sh_err rc = sh_gmatch_create(g, &m, NULL);
        int ok = 1;
        for (int k = 0; rc == SH_OK && k < 3000 && ok; k++)
            ok = sh_gmatch_accept_bytes(m, "a", 1);
        sh_error e = {0};
        if (rc == SH_OK) {
            CHECK(!ok);
            CHECK_INT_EQ(sh_gmatch_error(m, &e), SH_ERANGE);
            CHECK(strstr(e.msg, "bound") != NULL);
            CHECK(!sh_gmatch_accept_bytes(m, "a", 1));
        }
        CHECK(now() - t0 < 10.0);
        sh_gmatch_free(m);
        sh_grammar_free(g);
    }
}

/* Long sentences: more automaton states than the cache keeps (it is dropped between calls and the
 * position kept), and an enumeration of many alternatives (as a schema's enum becomes). */
static void test_long_and_wide(void)
{
    sh_grammar *g = parse("root ::= [a-z]{0,9000} \"!\"");
    CHECK(g != NULL);
    if (g) {
        sh_gmatch *m = NULL;
        CHECK_OK(sh_gmatch_create(g, &m, NULL));
        int ok = 1;
        for (int k = 0; k < 9000 && ok; k++)
            ok = sh_gmatch_accept_bytes(m, "q", 1);
        CHECK(ok);
        CHECK(!sh_gmatch_accept_bytes(m, "q", 1));
        CHECK(!sh_gmatch_can_end(m));
        CHECK(sh_gmatch_accept_bytes(m, "!", 1));
        CHECK(sh_gmatch_can_end(m));
        CHECK_INT_EQ(sh_gmatch_error(m, NULL), SH_OK);
        sh_gmatch_free(m);
        sh_grammar_free(g);
    }
    size_t cap = 200000, n = 0;
    char *text = malloc(cap);
    n += (size_t)snprintf(text, cap, "root ::= \"v0\"");
    for (int k = 1; k < 10000; k++)
        n += (size_t)snprintf(text + n, cap - n, " | \"v%d\"", k);
    g = parse(text);
    CHECK(g != NULL);
    if (g) {
        CHECK_SENTENCE(g, "v9999", 1);
        CHECK_SENTENCE(g, "v1234", 1);
        CHECK_SENTENCE(g, "v10000", 0);
        sh_grammar_free(g);
    }
    free(text);
}

/* A small vocabulary: the mask equals token-by-token checks at every step of a JSON text. */
static void test_mask_small(void)
{
    static const char *toks[] = {"{", "}",   "\"",  "\"a", "a",    "ab\"",     ":",
                                 " ", "1",   "12",  "-",   "true", "\xc3",     "\xa9",
                                 ",", "<e>", "[]",  "\n ", "x\"",  "\xc3\xa9", "nul",
                                 "l", "",    "<s>", "a"};
    enum { N = sizeof toks / sizeof *toks };
    size_t lens[N];
    bool special[N] = {0};
    for (int i = 0; i < N; i++)
        lens[i] = strlen(toks[i]);
    special[15] = special[23] = true;
    int32_t eos = 15;
    sh_gvocab *v = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gvocab_create(toks, lens, N, special, &eos, 1, &v, &e));
    sh_grammar *g = parse(JSON);
    sh_gmatch *m = NULL;
    CHECK_OK(sh_gmatch_create(g, &m, NULL));
    /* Token ids of {"a": 12, "ab": [], "\xc3\xa9": nul l} (é split into two byte tokens). */
    const int32_t path[] = {0, 3, 2, 6, 7, 9, 14, 7, 3, 5, 6, 16, 14, 2, 12, 13, 2, 6, 20, 21, 1};
    for (size_t step = 0; step <= sizeof path / sizeof *path; step++) {
        uint64_t bits[1] = {0};
        CHECK_OK(sh_gmatch_mask(m, v, bits));
        for (int32_t t = 0; t < N; t++) {
            int in_mask = (int)((bits[0] >> t) & 1);
            sh_gmatch *c = NULL;
            CHECK_OK(sh_gmatch_clone(m, &c, NULL));
            int ok = sh_gmatch_token_ok(m, v, t);
            int acc = sh_gmatch_accept_token(c, v, t);
            if (in_mask != ok || ok != acc)
                SH_FAIL_("step %zu token %d '%s': mask %d token_ok %d accept %d", step, t, toks[t],
                         in_mask, ok, acc);
            sh_gmatch_free(c);
        }
        CHECK(!((bits[0] >> 22) & 1)); /* the empty token */
        CHECK(!((bits[0] >> 23) & 1)); /* a special token */
        CHECK_INT_EQ((int)((bits[0] >> 15) & 1), step == sizeof path / sizeof *path);
        if (step < sizeof path / sizeof *path && !sh_gmatch_accept_token(m, v, path[step]))
            SH_FAIL_("step %zu: token %d '%s' refused", step, path[step], toks[path[step]]);
    }
    CHECK(sh_gmatch_can_end(m));
    CHECK(sh_gmatch_accept_token(m, v, eos));
    sh_gmatch_free(m);
    sh_grammar_free(g);
    sh_gvocab_free(v);
    CHECK_INT_EQ(sh_gvocab_create(toks, lens, N, special, &(int32_t){N}, 1, &v, &e), SH_EINVAL);
}

/* A real model's vocabulary: the trie walk's mask (with its skipped subtrees) equals token_ok
 * for every token, at the start of a JSON document, inside strings (ASCII and not), after a
 * number and inside a partial code point. */
static void mask_model(const char *rel)
{
    sh_gguf *f = NULL;
    sh_tokenizer *t = NULL;
    sh_error e = {0};
    if (sh_gguf_open(sh_test_path(rel), NULL, &f, &e)) {
        fprintf(stderr, "skipping: %s\n", e.msg);
        return;
    }
    CHECK_OK(sh_tokenizer_create_gguf(f, &t, &e));
    sh_gguf_close(f);
    sh_gvocab *v = NULL;
    CHECK_OK(sh_gvocab_create_tokenizer(t, &v, &e));
    int32_t n = sh_gvocab_n_vocab(v);
    uint64_t *bits = calloc(((size_t)n + 63) / 64, 8);
    sh_grammar *g = parse(JSON);
    sh_gmatch *m = NULL;
    CHECK_OK(sh_gmatch_create(g, &m, NULL));
    const char *prefixes[] = {
        "", "{\"name", "\": 12", ", \"x\": \"\xe2\x82", "\xac \xe6\x97", "\xa5 \\u00e9\\", "n\"}"};
    enum { N_PREFIX = sizeof prefixes / sizeof *prefixes };
    for (size_t k = 0; k < N_PREFIX; k++) {
        CHECK(sh_gmatch_accept_bytes(m, prefixes[k], strlen(prefixes[k])));
        CHECK_OK(sh_gmatch_mask(m, v, bits));
        int32_t allowed = 0, bad = 0;
        for (int32_t i = 0; i < n; i++) {
            int in = (int)((bits[i / 64] >> (i % 64)) & 1);
            allowed += in;
            if (in != (int)sh_gmatch_token_ok(m, v, i) && bad++ < 5)
                SH_FAIL_("%s after \"%s\": token %d: mask %d", rel, prefixes[k], (int)i, in);
        }
        CHECK(allowed > 0);
        CHECK_INT_EQ(bad, 0);
        /* EOS only at the end. */
        int32_t eos = sh_tokenizer_eos(t);
        CHECK_INT_EQ((int)((bits[eos / 64] >> (eos % 64)) & 1), k == N_PREFIX - 1);
    }
    sh_gmatch_free(m);
    sh_grammar_free(g);
    free(bits);
    sh_gvocab_free(v);
    sh_tokenizer_destroy(t);
}

static void test_mask_model(void)
{
    mask_model("models/smollm2-135m-instruct-q4_1.gguf");
    mask_model("models/gemma3-270m-q4_k_m.gguf");
}

static const sh_test_case tests[] = {
    {"arithmetic", test_arithmetic},
    {"json", test_json},
    {"csv_and_language", test_csv_and_language},
    {"repetition_and_classes", test_repetition_and_classes},
    {"partial_utf8", test_partial_utf8},
    {"errors", test_errors},
    {"bounds", test_bounds},
    {"long_and_wide", test_long_and_wide},
    {"mask_small", test_mask_small},
    {"mask_model", test_mask_model},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
