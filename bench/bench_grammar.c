/* Grammar mask cost per decode step: a JSON grammar over a realistic JSON document, tokenized by
 * a real model's tokenizer and fed token by token; before each token the full mask is built.
 * Prints one JSON line per model: p50/p99/max of the mask as a fresh matcher serves it (its
 * automaton and mask caches filling as it goes), of the trie walk alone (mask cache bypassed)
 * and of the sampled-token check. Run from the source tree or with SH_SOURCE_DIR set; optional
 * arguments are GGUF files to use instead of the two default models. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/grammar.h"
#include "model/tokenizer.h"

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
    if (sh_grammar_parse(JSON_GBNF, strlen(JSON_GBNF), &g, &e) || sh_gmatch_create(g, &m, &e) ||
        sh_tokenizer_encode_opts(t, DOC, strlen(DOC), NULL, &ids, &n_ids, &e))
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
           "\"mask_ms\": {\"p50\": %.3f, \"p99\": %.3f, \"max\": %.3f}, "
           "\"walk_ms\": {\"p50\": %.3f, \"p99\": %.3f, \"max\": %.3f}, "
           "\"check_accept_us\": {\"p50\": %.2f, \"p99\": %.2f}}\n",
           name, (int)n, n_ids, 1e3 * t_vocab, (double)allowed_sum / (double)n_ids,
           1e3 * pct(served, n_ids, 0.5), 1e3 * pct(served, n_ids, 0.99),
           1e3 * pct(served, n_ids, 1.0), 1e3 * pct(walk, n_ids, 0.5), 1e3 * pct(walk, n_ids, 0.99),
           1e3 * pct(walk, n_ids, 1.0), 1e6 * pct(check, n_ids, 0.5),
           1e6 * pct(check, n_ids, 0.99));
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

int main(int argc, char **argv)
{
    const char *root = getenv("SH_SOURCE_DIR");
    char p[2][1024];
    snprintf(p[0], sizeof p[0], "%s/models/smollm2-135m-instruct-q4_1.gguf", root ? root : ".");
    snprintf(p[1], sizeof p[1], "%s/models/gemma3-270m-q4_k_m.gguf", root ? root : ".");
    int rc = 0;
    if (argc > 1)
        for (int k = 1; k < argc; k++)
            rc |= run(argv[k]);
    else
        rc = run(p[0]) | run(p[1]);
    return rc;
}
