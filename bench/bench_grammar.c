/* Grammar mask cost per decode step: a JSON grammar over a realistic JSON document, tokenized by
 * a real model's tokenizer and fed token by token; before each token the full mask is built.
 * Prints one JSON line per model: p50/p99/max of the mask as a fresh matcher serves it (its
 * automaton and mask caches filling as it goes), of the trie walk alone (mask cache bypassed)
 * and of the sampled-token check. Run from the source tree or with SH_SOURCE_DIR set; optional
 * arguments are GGUF files to use instead of the two default models.
 *
 * Options (for bench/llama-grammar.py, which runs llama.cpp's grammar on the same input):
 *   --schema FILE   the grammar is net/json_schema.c's conversion of this JSON schema (strict)
 *                   instead of the generic JSON grammar; the document's trailing newline is
 *                   dropped (a schema's root value has no whitespace after it)
 *   --print-ids     add the document's token ids ("ids") to each JSON line
 *   --print WHAT    print the grammar text ("grammar") or the document ("doc") in use, then exit */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/grammar.h"
#include "model/tokenizer.h"
#include "net/json_schema.h"

static const char *JSON_GBNF =
    "root    ::= ws value ws\n"
    "value   ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "object  ::= \"{\" ws ( member ( ws \",\" ws member )* ws )? \"}\"\n"
    "member  ::= string ws \":\" ws value\n"
    "array   ::= \"[\" ws ( value ( ws \",\" ws value )* ws )? \"]\"\n"
    "string  ::= \"\\\"\" char* \"\\\"\"\n"
    "char    ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" hex{4})\n"
    "hex     ::= [0-9a-fA-F]\n"
    "number  ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n"
    "ws      ::= [ \\t\\n\\r]*\n";

/* What a model answering with structured output writes: nested objects, arrays, prose in strings,
 * numbers, an escape and non-ASCII text. */
static const char *DOC =
    "{\n"
    "  \"id\": \"order-20931\",\n"
    "  \"customer\": {\"name\": \"Ana Souza\", \"email\": \"ana.souza@example.com\", \"vip\": "
    "true},\n"
    "  \"items\": [\n"
    "    {\"sku\": \"KB-104\", \"title\": \"Mechanical keyboard, brown switches\", \"qty\": 1, "
    "\"price\": 89.99},\n"
    "    {\"sku\": \"MS-220\", \"title\": \"Wireless mouse\", \"qty\": 2, \"price\": 24.5},\n"
    "    {\"sku\": \"CB-007\", \"title\": \"USB-C cable (2 m)\", \"qty\": 3, \"price\": 7.25}\n"
    "  ],\n"
    "  \"shipping\": {\"method\": \"express\", \"address\": \"Rua das Flores 12, S\xc3\xa3o "
    "Paulo\", "
    "\"eta_days\": 2},\n"
    "  \"notes\": \"Leave the parcel with the concierge if nobody answers. \\\"Fragile\\\" on the "
    "box, please.\",\n"
    "  \"tags\": [\"gift\", \"priority\", \"repeat-customer\"],\n"
    "  \"discount\": null,\n"
    "  \"total\": 160.24e0\n"
    "}\n";

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p)
{
    qsort(v, n, sizeof *v, cmp_d);
    size_t k = (size_t)(p * (double)(n - 1) + 0.5);
    return v[k < n ? k : n - 1];
}

static const char *gbnf = NULL; /* the grammar in use: JSON_GBNF or the schema's */
static size_t doc_len = 0;      /* of DOC in use */
static int print_ids = 0;

static int run(const char *path)
{
    sh_gguf *f = NULL;
    sh_tokenizer *t = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &f, &e) || sh_tokenizer_create_gguf(f, &t, &e)) {
        fprintf(stderr, "bench_grammar: %s: %s\n", path, e.msg);
        sh_gguf_close(f);
        return 1;
    }
    sh_gguf_close(f);
    double t0 = now();
    sh_gvocab *v = NULL;
    sh_grammar *g = NULL;
    sh_gmatch *m = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    int rc = 1;
    uint64_t *bits = NULL;
    double *served = NULL, *walk = NULL, *check = NULL;
    if (sh_gvocab_create_tokenizer(t, &v, &e))
        goto out;
    double t_vocab = now() - t0;
    if (sh_grammar_parse(gbnf, strlen(gbnf), &g, &e) || sh_gmatch_create(g, &m, &e) ||
        sh_tokenizer_encode_opts(t, DOC, doc_len, NULL, &ids, &n_ids, &e))
        goto out;
    int32_t n = sh_gvocab_n_vocab(v);
    size_t words = ((size_t)n + 63) / 64;
    bits = malloc(words * 8);
    served = malloc(n_ids * sizeof *served);
    walk = malloc(n_ids * sizeof *walk);
    check = malloc(n_ids * sizeof *check);
    if (!bits || !served || !walk || !check)
        goto out;
    size_t allowed_sum = 0;
    for (size_t k = 0; k < n_ids; k++) {
        /* The trie walk alone: a clone keeps the automaton's transitions but not the masks. */
        sh_gmatch *c = NULL;
        if (sh_gmatch_clone(m, &c, &e))
            goto out;
        double a = now();
        sh_err err = sh_gmatch_mask(c, v, bits);
        walk[k] = now() - a;
        sh_gmatch_free(c);
        a = now();
        err = err ? err : sh_gmatch_mask(m, v, bits);
        served[k] = now() - a;
        if (err) {
            sh_gmatch_error(m, &e);
            goto out;
        }
        for (size_t w = 0; w < words; w++)
            allowed_sum += (size_t)__builtin_popcountll(bits[w]);
        if (!((bits[ids[k] / 64] >> (ids[k] % 64)) & 1)) {
            fprintf(stderr, "bench_grammar: token %zu (%d) of the document is not in the mask\n", k,
                    (int)ids[k]);
            goto out;
        }
        a = now();
        int ok = sh_gmatch_token_ok(m, v, ids[k]) && sh_gmatch_accept_token(m, v, ids[k]);
        check[k] = now() - a;
        if (!ok) {
            fprintf(stderr, "bench_grammar: token %zu refused\n", k);
            goto out;
        }
    }
    if (!sh_gmatch_can_end(m)) {
        fprintf(stderr, "bench_grammar: the document did not end the grammar\n");
        goto out;
    }
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    printf("{\"model\": \"%s\", \"n_vocab\": %d, \"steps\": %zu, \"vocab_build_ms\": %.1f, "
           "\"mean_allowed\": %.0f, "
           "\"mask_ms\": {\"p50\": %.4f, \"p99\": %.4f, \"max\": %.3f}, "
           "\"walk_ms\": {\"p50\": %.4f, \"p99\": %.4f, \"max\": %.3f}, "
           "\"check_accept_us\": {\"p50\": %.2f, \"p99\": %.2f}",
           name, (int)n, n_ids, 1e3 * t_vocab, (double)allowed_sum / (double)n_ids,
           1e3 * pct(served, n_ids, 0.5), 1e3 * pct(served, n_ids, 0.99),
           1e3 * pct(served, n_ids, 1.0), 1e3 * pct(walk, n_ids, 0.5), 1e3 * pct(walk, n_ids, 0.99),
           1e3 * pct(walk, n_ids, 1.0), 1e6 * pct(check, n_ids, 0.5),
           1e6 * pct(check, n_ids, 0.99));
    for (size_t k = 0; print_ids && k < n_ids; k++)
        printf("%s%d", k ? ", " : ", \"ids\": [", (int)ids[k]);
    printf("%s}\n", print_ids && n_ids ? "]" : "");
    rc = 0;
out:
    free(bits);
    free(served);
    free(walk);
    free(check);
    if (rc && e.msg[0])
        fprintf(stderr, "bench_grammar: %s\n", e.msg);
    free(ids);
    sh_gmatch_free(m);
    sh_grammar_free(g);
    sh_gvocab_free(v);
    sh_tokenizer_destroy(t);
    return rc;
}

/* The grammar for the schema in `file` (malloc'd), or NULL after a message. */
static char *schema_gbnf(const char *file)
{
    json_error_t je;
    json_t *s = json_load_file(file, 0, &je);
    if (!s) {
        fprintf(stderr, "bench_grammar: %s:%d: %s\n", file, je.line, je.text);
        return NULL;
    }
    char *out = NULL;
    sh_error e = {0};
    if (sh_json_schema_to_gbnf(s, NULL, &out, &e))
        fprintf(stderr, "bench_grammar: %s: %s\n", file, e.msg);
    json_decref(s);
    return out;
}

int main(int argc, char **argv)
{
    const char *root = getenv("SH_SOURCE_DIR");
    char p[2][1024];
    snprintf(p[0], sizeof p[0], "%s/models/smollm2-135m-instruct-q4_1.gguf", root ? root : ".");
    snprintf(p[1], sizeof p[1], "%s/models/gemma3-270m-q4_k_m.gguf", root ? root : ".");
    const char *schema = NULL, *print = NULL;
    char **models = argv + 1;
    int n_models = 0;
    for (int k = 1; k < argc; k++) {
        if (!strcmp(argv[k], "--schema") && k + 1 < argc)
            schema = argv[++k];
        else if (!strcmp(argv[k], "--print") && k + 1 < argc)
            print = argv[++k];
        else if (!strcmp(argv[k], "--print-ids"))
            print_ids = 1;
        else if (argv[k][0] == '-') {
            fprintf(stderr, "usage: bench_grammar [--schema FILE] [--print-ids] "
                            "[--print grammar|doc] [GGUF...]\n");
            return 2;
        } else
            models[n_models++] = argv[k];
    }
    char *from_schema = schema ? schema_gbnf(schema) : NULL;
    if (schema && !from_schema)
        return 1;
    gbnf = from_schema ? from_schema : JSON_GBNF;
    doc_len = strlen(DOC);
    while (schema && doc_len && DOC[doc_len - 1] == '\n')
        doc_len--;
    int rc = 0;
    if (print) {
        if (strcmp(print, "grammar") && strcmp(print, "doc")) {
            fprintf(stderr, "bench_grammar: --print takes grammar or doc\n");
            rc = 2;
        } else if (!strcmp(print, "grammar"))
            fputs(gbnf, stdout);
        else
            fwrite(DOC, 1, doc_len, stdout);
    } else if (n_models)
        for (int k = 0; k < n_models; k++)
            rc |= run(models[k]);
    else
        rc = run(p[0]) | run(p[1]);
    free(from_schema);
    return rc;
}
