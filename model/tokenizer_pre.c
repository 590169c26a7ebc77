/* BPE pre-tokenizers: the split regexes llama.cpp uses for each tokenizer.ggml.pre name, compiled
 * once with PCRE2 and applied in sequence, each one splitting the pieces the previous left. */
#include <string.h>

#include "base/error.h"
#include "model/tokenizer_internal.h"

/* The GPT-2 pattern as llama.cpp writes it (without the final `|\s+`: text no alternative matches
 * is kept as its own piece anyway, which gives the same split). */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_CJK "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+"
#define RE_LLAMA3_HEAD                                                                             \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

typedef struct pre_rules {
    const char *names; /* the tokenizer.ggml.pre values, '|'-separated */
    bool ignore_merges;
    const char *re[SH__TOK_MAX_RE];
} pre_rules;

static const pre_rules rules[] = {
    {"default", false, {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    {"gpt-2|gpt2|phi-2|mpt|olmo|jais|roberta-bpe|trillion", false, {RE_GPT2}},
    {"starcoder|refact|smollm|command-r|codeshell|exaone|minerva-7b", false, {"\\p{N}", RE_GPT2}},
    {"falcon", false, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}},
    {"llama-bpe|llama3|llama-v3|falcon3|pixtral",
     true,
     {RE_LLAMA3_HEAD "\\p{N}{1,3}|" RE_LLAMA3_TAIL}},
    {"dbrx|smaug-bpe", false, {RE_LLAMA3_HEAD "\\p{N}{1,3}|" RE_LLAMA3_TAIL}},
    {"qwen2|deepseek-r1-qwen|stablelm2|megrez", false, {RE_LLAMA3_HEAD "\\p{N}|" RE_LLAMA3_TAIL}},
    /* deepseek-llm's letter class is Unicode's cased letters (LC) as its tokenizer.json spells
     * them out; the CJK class covers ideographs and Hangul. */
    {"deepseek-llm",
     false,
     {"[\\r\\n]",
      "\\s?"
      "[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}"
      "\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}"
      "\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-"
      "\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}"
      "\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}"
      "\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}"
      "\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}"
      "\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-"
      "\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-"
      "\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}"
      "\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-"
      "\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}"
      "\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}"
      "\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}"
      "\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}"
      "\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}"
      "\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}"
      "\\x{1E900}-\\x{1E943}]+",
      "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}]+",
      "\\s+$", RE_CJK, "\\p{N}+"}},
    {"deepseek-coder", false, {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK, "\\p{N}"}},
};

static bool name_in(const char *names, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = names; *p;) {
        const char *bar = strchr(p, '|');
        size_t k = bar ? (size_t)(bar - p) : strlen(p);
        if (k == n && memcmp(p, name, n) == 0)
            return true;
        if (!bar)
            break;
        p = bar + 1;
    }
    return false;
}

sh_err sh__pre_init(sh_tokenizer *t, sh_error *e)
{
    const pre_rules *r = &rules[0];
    t->pre_known = false;
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
        if (name_in(rules[i].names, t->pre)) {
            r = &rules[i];
            t->pre_known = true;
            break;
        }
    }
    t->ignore_merges = r->ignore_merges;
    for (int i = 0; i < SH__TOK_MAX_RE && r->re[i]; i++) {
        int code;
        PCRE2_SIZE at;
        /* UCP makes \s, \d and \w Unicode-aware like the Python and Rust engines the patterns come
         * from; DOLLAR_ENDONLY keeps `$` from matching before a final newline. */
        pcre2_code *re =
            pcre2_compile((PCRE2_SPTR)r->re[i], PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY, &code, &at, NULL);
        if (!re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            return sh__error_set(e, SH_EUNSUPPORTED, "pre-tokenizer '%s' regex %d at %zu: %s",
                                 t->pre, i, (size_t)at, (const char *)msg);
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
        t->re[t->n_re++] = re;
    }
    return SH_OK;
}

void sh__pre_fini(sh_tokenizer *t)
{
    for (int i = 0; i < t->n_re; i++)
        pcre2_code_free(t->re[i]);
    t->n_re = 0;
}

/* One match of regex `level` in s[0, n) from pos; returns 1 with the match in [*ms, *me), 0 when
 * there is none. Retries once with a larger JIT stack when the default one runs out. */
static sh_err match(const sh_tokenizer *t, sh__tok_work *w, int level, const char *s, size_t n,
                    size_t pos, size_t *ms, size_t *me, int *found)
{
    for (;;) {
        int rc =
            pcre2_match(t->re[level], (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, w->md, w->mctx);
        if (rc >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
            *ms = ov[0];
            *me = ov[1];
            *found = 1;
            return SH_OK;
        }
        if (rc == PCRE2_ERROR_NOMATCH) {
            *found = 0;
            return SH_OK;
        }
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !w->jit) {
            w->mctx = pcre2_match_context_create(NULL);
            w->jit = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, NULL);
            if (!w->mctx || !w->jit)
                return sh__error_set(w->e, SH_ENOMEM, "pre-tokenizer: out of memory");
            pcre2_jit_stack_assign(w->mctx, NULL, w->jit);
            continue;
        }
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return sh__error_set(w->e, rc == PCRE2_ERROR_NOMEMORY ? SH_ENOMEM : SH_ERANGE,
                             "pre-tokenizer '%s' regex %d: %s", t->pre, level, (const char *)msg);
    }
}

/* Splits s[0, n) with regex `level`: the matches and the text between them become pieces, each
 * split further by the next regex (llama.cpp's unicode_regex_split). Each regex sees one piece as
 * its whole subject, so lookaheads and `$` stop at the piece's end, as there. */
static sh_err split(const sh_tokenizer *t, sh__tok_work *w, int level, const char *s, size_t n,
                    sh__pre_word_fn fn)
{
    if (n == 0)
        return SH_OK;
    if (level == t->n_re)
        return fn(t, w, s, n);
    size_t pos = 0, gap = 0;
    sh_err err = SH_OK;
    while (pos < n && !err) {
        size_t ms, me;
        int found;
        if ((err = match(t, w, level, s, n, pos, &ms, &me, &found)) || !found)
            break;
        if (me == ms) { /* an empty match: step over one character, it stays in the gap */
            pos = ms + sh__tok_utf8_len((unsigned char)s[ms]);
            continue;
        }
        if (ms > gap)
            err = split(t, w, level + 1, s + gap, ms - gap, fn);
        if (!err)
            err = split(t, w, level + 1, s + ms, me - ms, fn);
        gap = pos = me;
    }
    if (!err && gap < n)
        err = split(t, w, level + 1, s + gap, n - gap, fn);
    return err;
}

sh_err sh__pre_split(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len,
                     sh__pre_word_fn fn)
{
    if (!w->md) {
        w->md = pcre2_match_data_create(8, NULL);
        if (!w->md)
            return sh__error_set(w->e, SH_ENOMEM, "pre-tokenizer: out of memory");
    }
    /* The regexes run on valid UTF-8 only; each run of invalid bytes becomes a word of its own,
     * encoded byte by byte, so that no byte is lost. */
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    sh_err err = SH_OK;
    while (i < len && !err) {
        size_t ok = sh__tok_utf8_valid(s + i, len - i);
        if (ok) {
            err = split(t, w, 0, text + i, ok, fn);
            i += ok;
            continue;
        }
        size_t j = i + 1;
        while (j < len && sh__tok_utf8_valid(s + j, len - j < 4 ? len - j : 4) == 0)
            j++;
        err = fn(t, w, text + i, j - i);
        i = j;
    }
    return err;
}
