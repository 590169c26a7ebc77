/* libFuzzer target for the GBNF parser and matcher: the input is grammar text, then optionally a
 * NUL and up to 64 bytes of sample text. A grammar that fails to parse must say why; one that
 * parses is run over the sample byte by byte and at once (the two must agree), and at each step
 * the mask over a small vocabulary must equal the token-by-token check (after the first
 * MASKED_BYTES bytes). Everything is bounded: libFuzzer's timeout catches a grammar whose states
 * blow up past the matcher's bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const TOKS[] = {"a",  "b",  "ab",   "0",    "12", " ",    "\n",  "\"",   "{",
                                   "}",  "[",  "]",    ",",    ":",  "-",    "(",   ")",    "true",
                                   "\\", "\t", "\xc3", "\xa9", "é",  "日本", "a\"", "<eos>"};
enum { N_TOKS = sizeof TOKS / sizeof *TOKS };
/* Masks are checked after the first MASKED_BYTES bytes of the sample only: each mask may spend up
 * to SH_GMATCH_MASK_WORK (about 0.1 s in this build on a grammar of nested "any character"
 * repetitions, corpus/gbnf/nested-any-repeat-timeout), and 65 of them passed libFuzzer's 10 s. */
#define MASKED_BYTES 16

static sh_gvocab *vocab(void)
{
    static sh_gvocab *v;
    if (!v) {
        size_t lens[N_TOKS];
        bool special[N_TOKS] = {0};
        for (int i = 0; i < N_TOKS; i++)
            lens[i] = strlen(TOKS[i]);
        special[N_TOKS - 1] = true;
        int32_t eos = N_TOKS - 1;
        if (sh_gvocab_create(TOKS, lens, N_TOKS, special, &eos, 1, &v, NULL))
            abort();
    }
    return v;
}

static void check_mask(sh_gmatch *m)
{
    uint64_t bits[1];
    if (sh_gmatch_mask(m, vocab(), bits)) {
        if (sh_gmatch_error(m, NULL) == SH_OK)
            abort(); /* a failed mask is the matcher's error */
        return;
    }
    for (int32_t t = 0; t < N_TOKS; t++)
        if ((int)((bits[0] >> t) & 1) != (int)sh_gmatch_token_ok(m, vocab(), t) &&
            sh_gmatch_error(m, NULL) == SH_OK)
            abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    const char *nul = memchr(text, 0, size);
    size_t glen = nul ? (size_t)(nul - text) : size;
    const char *sample = nul ? nul + 1 : "";
    size_t slen = nul ? size - glen - 1 : 0;
    if (slen > 64)
        slen = 64;
    sh_grammar *g = NULL;
    sh_error e = {0};
    if (sh_grammar_parse(text, glen, &g, &e)) {
        if (g || e.code == SH_OK || strncmp(e.msg, "grammar: ", 9) != 0)
            abort();
        return 0;
    }
    sh_gmatch *m = NULL, *whole = NULL;
    if (sh_gmatch_create(g, &m, &e)) {
        if (e.code != SH_ERANGE && e.code != SH_ENOMEM)
            abort();
        sh_grammar_free(g);
        return 0;
    }
    if (sh_gmatch_clone(m, &whole, NULL) == SH_OK) {
        int all = sh_gmatch_accept_bytes(whole, sample, slen);
        int each = 1;
        check_mask(m);
        for (size_t k = 0; k < slen && each; k++) {
            each = sh_gmatch_accept_bytes(m, sample + k, 1);
            if (k < MASKED_BYTES)
                check_mask(m);
        }
        int failed = sh_gmatch_error(m, NULL) || sh_gmatch_error(whole, NULL);
        if (!failed && (all != each || (all && sh_gmatch_can_end(m) != sh_gmatch_can_end(whole))))
            abort();
    }
    sh_gmatch_free(whole);
    sh_gmatch_free(m);
    sh_grammar_free(g);
    return 0;
}
