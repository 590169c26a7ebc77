/* Tokenizer test vectors: every input of tests/data/vocab/ggml-vocab-NAME.gguf.inp must encode to
 * the ids llama.cpp recorded in NAME.gguf.out (no BOS, special tokens not parsed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "sh_test.h"

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t k;
    while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            char *b = realloc(buf, 2 * cap + 1);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf)
        buf[n] = '\0';
    *len = n;
    return buf;
}

/* Runs one vocabulary's vectors; returns the number of mismatches (or -1 when the files are
 * missing). The .inp framing follows llama.cpp's test-tokenizer-0: inputs are separated by
 * "\n__ggml_vocab_test__\n", so the newline before each separator belongs to the separator. */
static int run_vocab(const char *name, int *n_cases)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/data/vocab/ggml-vocab-%s.gguf", name);
    char path[1024], inp_path[1100], out_path[1100];
    snprintf(path, sizeof path, "%s", sh_test_path(rel));
    snprintf(inp_path, sizeof inp_path, "%s.inp", path);
    snprintf(out_path, sizeof out_path, "%s.out", path);

    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK) {
        fprintf(stderr, "%s: %s\n", name, e.msg);
        return -1;
    }
    sh_tokenizer *t = NULL;
    CHECK_OK(sh_tokenizer_create_gguf(g, &t, &e));
    sh_gguf_close(g);
    if (!t) {
        fprintf(stderr, "%s: %s\n", name, e.msg);
        return -1;
    }
    CHECK(sh_tokenizer_pre_known(t));

    size_t inp_len, out_len;
    char *inp = read_all(inp_path, &inp_len);
    char *out = read_all(out_path, &out_len);
    CHECK(inp && out);
    int bad = 0, cases = 0;
    const char *sep = "\n__ggml_vocab_test__\n";
    size_t sep_len = strlen(sep);
    char *ip = inp, *op = out;
    int32_t ids[4096];
    while (inp && out && ip < inp + inp_len) {
        char *next = strstr(ip, sep);
        size_t n = next ? (size_t)(next - ip) : (size_t)(inp + inp_len - ip);
        char *eol = strchr(op, '\n');
        if (!eol) {
            SH_FAIL_("%s: fewer output lines than inputs", name);
            bad++;
            break;
        }
        *eol = '\0';
        int32_t want[4096];
        size_t n_want = 0;
        for (char *q = op; *q;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q)
                break;
            want[n_want++] = (int32_t)v;
            q = end;
        }
        size_t n_ids = 0;
        sh_err err = sh_tokenizer_encode(t, ip, n, 0, ids, 4096, &n_ids, &e);
        bool same = err == SH_OK && n_ids == n_want && memcmp(ids, want, n_ids * 4) == 0;
        if (!same) {
            bad++;
            fprintf(stderr, "%s: case %d \"%.*s\"\n  want:", name, cases, (int)n, ip);
            for (size_t i = 0; i < n_want; i++)
                fprintf(stderr, " %d", (int)want[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < n_ids; i++)
                fprintf(stderr, " %d", (int)ids[i]);
            fprintf(stderr, "%s%s\n", err ? " error: " : "", err ? e.msg : "");
        }
        cases++;
        op = eol + 1;
        ip = next ? next + sep_len : inp + inp_len;
    }
    free(inp);
    free(out);
    sh_tokenizer_destroy(t);
    *n_cases = cases;
    return bad;
}

static void check_vocab(const char *name)
{
    int cases = 0;
    int bad = run_vocab(name, &cases);
    if (bad < 0) {
        SH_FAIL_("%s: vocabulary or vectors missing", name);
        return;
    }
    fprintf(stderr, "%s: %d/%d vectors match\n", name, cases - bad, cases);
    CHECK_INT_EQ(bad, 0);
    CHECK(cases > 0);
}

static void test_llama_spm(void) { check_vocab("llama-spm"); }
static void test_phi_3(void) { check_vocab("phi-3"); }
static void test_gpt_2(void) { check_vocab("gpt-2"); }
static void test_starcoder(void) { check_vocab("starcoder"); }
static void test_falcon(void) { check_vocab("falcon"); }
static void test_deepseek_coder(void) { check_vocab("deepseek-coder"); }
static void test_deepseek_llm(void) { check_vocab("deepseek-llm"); }
static void test_mpt(void) { check_vocab("mpt"); }
static void test_refact(void) { check_vocab("refact"); }

static const sh_test_case tests[] = {
    {"llama_spm", test_llama_spm},
    {"phi_3", test_phi_3},
    {"gpt_2", test_gpt_2},
    {"starcoder", test_starcoder},
    {"falcon", test_falcon},
    {"deepseek_coder", test_deepseek_coder},
    {"deepseek_llm", test_deepseek_llm},
    {"mpt", test_mpt},
    {"refact", test_refact},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
