/* Tokenizer behaviour: round trips on a multilingual, emoji and code corpus for both kinds, the
 * streaming decoder, special tokens, the llama2.c tokenizer.bin, the API's edges and threads. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "sh_test.h"

static char *read_file(const char *rel, size_t *len)
{
    FILE *f = fopen(sh_test_path(rel), "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf)
        buf[n] = '\0';
    *len = (size_t)n;
    return buf;
}

static sh_tokenizer *load(const char *rel)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(sh_test_path(rel), NULL, &g, &e) != SH_OK) {
        SH_FAIL_("open %s: %s", rel, e.msg);
        return NULL;
    }
    sh_tokenizer *t = NULL;
    if (sh_tokenizer_create_gguf(g, &t, &e) != SH_OK)
        SH_FAIL_("tokenizer %s: %s", rel, e.msg);
    sh_gguf_close(g); /* the tokenizer must not need the file any more */
    return t;
}

/* Encodes into a fresh array (exercising the SH_ERANGE size query first). */
static int32_t *encode(const sh_tokenizer *t, const char *s, size_t n, uint32_t flags,
                       size_t *n_ids)
{
    sh_error e = {0};
    size_t need = 0;
    sh_err err = sh_tokenizer_encode(t, s, n, flags, NULL, 0, &need, &e);
    if (err != SH_OK && err != SH_ERANGE) {
        SH_FAIL_("encode: %s", e.msg);
        return NULL;
    }
    int32_t *ids = malloc((need + 1) * sizeof *ids);
    CHECK_OK(sh_tokenizer_encode(t, s, n, flags, ids, need, n_ids, &e));
    CHECK_UINT_EQ(*n_ids, need);
    return ids;
}

static char *decode(const sh_tokenizer *t, const int32_t *ids, size_t n, uint32_t flags,
                    size_t *len)
{
    size_t need = 0;
    sh_err err = sh_tokenizer_decode(t, ids, n, flags, NULL, 0, &need, NULL);
    CHECK(err == SH_OK || err == SH_ERANGE);
    char *buf = malloc(need + 1);
    CHECK_OK(sh_tokenizer_decode(t, ids, n, flags, buf, need + 1, len, NULL));
    return buf;
}

/* decode(encode(x)) == x. For SPM the encoder prefixes a space, which STRIP_SPACE removes again;
 * without it the text comes back with that space in front. */
static void check_round_trip(const sh_tokenizer *t, const char *name, const char *s, size_t n)
{
    for (int bos = 0; bos < 2; bos++) {
        size_t n_ids = 0, len = 0;
        int32_t *ids = encode(t, s, n, bos ? SH_TOKENIZE_ADD_BOS : 0, &n_ids);
        char *back = decode(t, ids, n_ids, SH_DECODE_STRIP_SPACE, &len);
        if (len != n || memcmp(back, s, n) != 0)
            SH_FAIL_("%s: round trip (bos %d) of %zu bytes gave %zu bytes:\n[%.*s]\n[%.*s]", name,
                     bos, n, len, (int)n, s, (int)len, back);
        free(back);
        if (sh_tokenizer_get_kind(t) == SH_TOKENIZER_SPM && n > 0) {
            back = decode(t, ids, n_ids, 0, &len);
            CHECK(len == n + 1 && back[0] == ' ' && memcmp(back + 1, s, n) == 0);
            free(back);
        }
        free(ids);
    }
}

static void round_trip_corpus(const char *vocab)
{
    static const char *const files[] = {"tests/data/tokenizer/multilingual.txt",
                                        "tests/data/tokenizer/emoji.txt",
                                        "tests/data/tokenizer/code.txt"};
    sh_tokenizer *t = load(vocab);
    if (!t)
        return;
    for (size_t f = 0; f < 3; f++) {
        size_t n;
        char *text = read_file(files[f], &n);
        if (!text) {
            SH_FAIL_("cannot read %s", files[f]);
            continue;
        }
        check_round_trip(t, files[f], text, n);
        /* Line by line too, so leading spaces, tabs and empty lines each start a text. */
        for (char *p = text, *end = text + n; p < end;) {
            char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t k = nl ? (size_t)(nl - p) : (size_t)(end - p);
            check_round_trip(t, files[f], p, k);
            p += k + 1;
        }
        free(text);
    }
    static const char *const edge[] = {"", " ", "  ", "\t", "\n", " \n ", "a", "▁", "\xC2\xA0x"};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
        /* SentencePiece cannot tell a literal U+2581 from a space, so skip it there. */
        if (sh_tokenizer_get_kind(t) == SH_TOKENIZER_SPM && strstr(edge[i], "▁"))
            continue;
        check_round_trip(t, "edge", edge[i], strlen(edge[i]));
    }
    sh_tokenizer_destroy(t);
}

static void test_round_trip_spm(void)
{
    round_trip_corpus("tests/data/vocab/ggml-vocab-llama-spm.gguf");
}
static void test_round_trip_gpt2(void)
{
    round_trip_corpus("tests/data/vocab/ggml-vocab-gpt-2.gguf");
}
static void test_round_trip_starcoder(void)
{
    round_trip_corpus("tests/data/vocab/ggml-vocab-starcoder.gguf");
}

/* Byte-level BPE keeps bytes that are not UTF-8 (llama.cpp would turn them into U+FFFD). */
static void test_bpe_invalid_utf8(void)
{
    sh_tokenizer *t = load("tests/data/vocab/ggml-vocab-gpt-2.gguf");
    if (!t)
        return;
    static const char s[] = "ok \xFF\xFE bad \xE2\x82 cut \xED\xA0\x80 surrogate \xC0\xAF end\x80";
    size_t n = sizeof s - 1, n_ids, len;
    int32_t *ids = encode(t, s, n, 0, &n_ids);
    char *back = decode(t, ids, n_ids, 0, &len);
    CHECK(len == n && memcmp(back, s, n) == 0);
    free(back);
    free(ids);
    sh_tokenizer_destroy(t);
}

/* Feeds ids one at a time; checks each chunk is valid UTF-8 and returns the concatenation. */
static char *stream_all(const sh_tokenizer *t, const int32_t *ids, size_t n, uint32_t flags,
                        size_t *len)
{
    sh_tokenizer_stream *s = NULL;
    CHECK_OK(sh_tokenizer_stream_create(t, flags, &s, NULL));
    size_t cap = 16, m = 0;
    char *out = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        const char *txt;
        size_t k;
        if (i < n)
            CHECK_OK(sh_tokenizer_stream_feed(s, ids[i], &txt, &k));
        else
            sh_tokenizer_stream_flush(s, &txt, &k);
        /* Every chunk must stand alone as UTF-8: a server sends it as is. */
        for (size_t j = 0; j < k;) {
            unsigned char c = (unsigned char)txt[j];
            size_t need = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
            if (c >= 0x80 && c < 0xC2)
                SH_FAIL_("chunk %zu starts a character with byte %02x", i, c);
            if (j + need > k) {
                SH_FAIL_("chunk %zu ends inside a character", i);
                break;
            }
            j += need;
        }
        while (m + k + 1 > cap)
            cap *= 2;
        out = realloc(out, cap);
        memcpy(out + m, txt, k);
        m += k;
    }
    sh_tokenizer_stream_destroy(s);
    *len = m;
    return out;
}

static void test_stream_split_characters(void)
{
    /* Byte-level BPE splits rare characters across tokens: the stream must hold them back. */
    sh_tokenizer *t = load("tests/data/vocab/ggml-vocab-gpt-2.gguf");
    if (!t)
        return;
    size_t n;
    char *text = read_file("tests/data/tokenizer/emoji.txt", &n);
    CHECK(text != NULL);
    if (text) {
        size_t n_ids, len;
        int32_t *ids = encode(t, text, n, 0, &n_ids);
        CHECK(n_ids > 0);
        char *out = stream_all(t, ids, n_ids, 0, &len);
        CHECK(len == n && memcmp(out, text, n) == 0);
        free(out);
        free(ids);
        free(text);
    }
    sh_tokenizer_destroy(t);

    /* SPM byte tokens, one byte each: "€" arrives in three pieces. */
    t = load("tests/data/vocab/ggml-vocab-llama-spm.gguf");
    if (!t)
        return;
    int32_t e2 = sh_tokenizer_find(t, "<0xE2>", 6), x82 = sh_tokenizer_find(t, "<0x82>", 6);
    int32_t xac = sh_tokenizer_find(t, "<0xAC>", 6), xa = sh_tokenizer_find(t, "<0x41>", 6);
    CHECK(e2 >= 0 && x82 >= 0 && xac >= 0 && xa >= 0);
    sh_tokenizer_stream *s = NULL;
    CHECK_OK(sh_tokenizer_stream_create(t, 0, &s, NULL));
    const char *txt;
    size_t k;
    CHECK_OK(sh_tokenizer_stream_feed(s, e2, &txt, &k));
    CHECK_UINT_EQ(k, 0);
    CHECK_OK(sh_tokenizer_stream_feed(s, x82, &txt, &k));
    CHECK_UINT_EQ(k, 0);
    CHECK_OK(sh_tokenizer_stream_feed(s, xac, &txt, &k));
    CHECK(k == 3 && memcmp(txt, "\xE2\x82\xAC", 3) == 0);
    /* A sequence cut short by an ASCII byte: U+FFFD for the fragment, then the byte. */
    CHECK_OK(sh_tokenizer_stream_feed(s, e2, &txt, &k));
    CHECK_OK(sh_tokenizer_stream_feed(s, xa, &txt, &k));
    CHECK(k == 4 && memcmp(txt,
                           "\xEF\xBF\xBD"
                           "A",
                           4) == 0);
    /* A lone continuation byte is invalid at once. */
    CHECK_OK(sh_tokenizer_stream_feed(s, x82, &txt, &k));
    CHECK(k == 3 && memcmp(txt, "\xEF\xBF\xBD", 3) == 0);
    /* Held bytes at the end come out as one U+FFFD. */
    CHECK_OK(sh_tokenizer_stream_feed(s, e2, &txt, &k));
    CHECK_OK(sh_tokenizer_stream_feed(s, x82, &txt, &k));
    CHECK_UINT_EQ(k, 0);
    sh_tokenizer_stream_flush(s, &txt, &k);
    CHECK(k == 3 && memcmp(txt, "\xEF\xBF\xBD", 3) == 0);
    CHECK(sh_tokenizer_stream_feed(s, -1, &txt, &k) == SH_EINVAL);
    CHECK(sh_tokenizer_stream_feed(s, sh_tokenizer_n_vocab(t), &txt, &k) == SH_EINVAL);

    /* STRIP_SPACE: after BOS the first piece loses its space, later ones keep theirs. */
    size_t n_ids, len;
    int32_t *ids = encode(t, "Hello world", 11, SH_TOKENIZE_ADD_BOS, &n_ids);
    char *out = stream_all(t, ids, n_ids, SH_DECODE_STRIP_SPACE, &len);
    CHECK(len == 11 && memcmp(out, "Hello world", 11) == 0);
    free(out);
    out = stream_all(t, ids, n_ids, 0, &len);
    CHECK(len == 12 && memcmp(out, " Hello world", 12) == 0);
    free(out);
    free(ids);
    sh_tokenizer_stream_destroy(s);
    sh_tokenizer_destroy(t);
}

static size_t count_eq(const int32_t *ids, size_t n, int32_t id)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ids[i] == id;
    return k;
}

static bool contains(const int32_t *ids, size_t n, int32_t id)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

static void test_special_tokens(void)
{
    sh_tokenizer *t = load("tests/data/vocab/ggml-vocab-starcoder.gguf");
    if (!t)
        return;
    const char *s = "<fim_prefix>def f():<|endoftext|>";
    int32_t fim = sh_tokenizer_find(t, "<fim_prefix>", 12);
    int32_t eot = sh_tokenizer_find(t, "<|endoftext|>", 13);
    CHECK(fim >= 0 && eot >= 0);
    CHECK(sh_tokenizer_is_control(t, fim) && sh_tokenizer_is_special(t, fim));
    CHECK(sh_tokenizer_is_eog(t, eot));
    size_t n_ids, len;
    int32_t *ids = encode(t, s, strlen(s), SH_TOKENIZE_PARSE_SPECIAL, &n_ids);
    CHECK(n_ids > 2 && ids[0] == fim && ids[n_ids - 1] == eot);
    char *back = decode(t, ids, n_ids, SH_DECODE_SPECIAL, &len);
    CHECK_STR_EQ(back, s);
    free(back);
    back = decode(t, ids, n_ids, 0, &len);
    CHECK_STR_EQ(back, "def f():");
    free(back);
    free(ids);
    /* As plain text the same string cannot produce the control tokens. */
    ids = encode(t, s, strlen(s), 0, &n_ids);
    CHECK(!contains(ids, n_ids, fim) && !contains(ids, n_ids, eot));
    back = decode(t, ids, n_ids, 0, &len);
    CHECK_STR_EQ(back, s);
    free(back);
    free(ids);
    sh_tokenizer_destroy(t);

    /* SPM: "<s>" is BOS only when parsed; the text after it gets the space prefix again. */
    t = load("tests/data/vocab/ggml-vocab-llama-spm.gguf");
    if (!t)
        return;
    ids = encode(t, "<s>Hi", 5, SH_TOKENIZE_PARSE_SPECIAL, &n_ids);
    CHECK(n_ids >= 2 && ids[0] == sh_tokenizer_bos(t));
    free(ids);
    ids = encode(t, "<s>Hi", 5, 0, &n_ids);
    CHECK(!contains(ids, n_ids, sh_tokenizer_bos(t)));
    free(ids);
    sh_tokenizer_destroy(t);

    /* MPT's runs of spaces are USER_DEFINED: matched in both modes, as llama.cpp does. */
    t = load("tests/data/vocab/ggml-vocab-mpt.gguf");
    if (!t)
        return;
    int32_t two = sh_tokenizer_find(t, "  ", 2);
    CHECK(two >= 0 && sh_tokenizer_token_type(t, two) == SH_TOKEN_USER_DEFINED);
    for (uint32_t f = 0; f <= SH_TOKENIZE_PARSE_SPECIAL; f += SH_TOKENIZE_PARSE_SPECIAL) {
        ids = encode(t, "a  b", 4, f, &n_ids);
        CHECK(contains(ids, n_ids, two));
        back = decode(t, ids, n_ids, 0, &len);
        CHECK_STR_EQ(back, "a  b");
        free(back);
        free(ids);
    }
    sh_tokenizer_destroy(t);
}

static void test_api(void)
{
    sh_tokenizer *t = load("tests/data/vocab/ggml-vocab-llama-spm.gguf");
    if (!t)
        return;
    CHECK(sh_tokenizer_get_kind(t) == SH_TOKENIZER_SPM);
    CHECK_INT_EQ(sh_tokenizer_n_vocab(t), 32000);
    CHECK_INT_EQ(sh_tokenizer_bos(t), 1);
    CHECK_INT_EQ(sh_tokenizer_eos(t), 2);
    CHECK_INT_EQ(sh_tokenizer_unk(t), 0);
    CHECK(sh_tokenizer_wants_bos(t) && !sh_tokenizer_wants_eos(t));
    CHECK_STR_EQ(sh_tokenizer_token_text(t, 1, NULL), "<s>");
    CHECK(sh_tokenizer_token_text(t, 32000, NULL) == NULL);
    CHECK(sh_tokenizer_is_control(t, 1) && !sh_tokenizer_is_control(t, 100));
    CHECK(sh_tokenizer_token_type(t, 3) == SH_TOKEN_BYTE);
    CHECK(sh_tokenizer_token_type(t, -5) == SH_TOKEN_UNDEFINED);
    CHECK_INT_EQ(sh_tokenizer_find(t, "<0x0A>", 6), 13);
    CHECK_INT_EQ(sh_tokenizer_find(t, "no such token text", 18), -1);
    const char *p;
    CHECK(sh_tokenizer_piece(t, 13, 0, &p) == 1 && p[0] == '\n');
    CHECK(sh_tokenizer_piece(t, 1, 0, &p) == 0);
    CHECK(sh_tokenizer_piece(t, 1, SH_DECODE_SPECIAL, &p) == 3 && memcmp(p, "<s>", 3) == 0);
    CHECK(sh_tokenizer_piece(t, 99999, 0, &p) == 0 && p == NULL);
    CHECK(sh_tokenizer_max_piece(t) >= 16);

    /* Too small a buffer: SH_ERANGE and the size needed. */
    int32_t ids[2];
    size_t n = 0;
    sh_error e = {0};
    CHECK(sh_tokenizer_encode(t, "Hello world again", 17, 0, ids, 2, &n, &e) == SH_ERANGE);
    CHECK(n > 2);
    CHECK(sh_tokenizer_encode(t, NULL, 3, 0, ids, 2, &n, &e) == SH_EINVAL);
    CHECK_OK(sh_tokenizer_encode(t, NULL, 0, 0, ids, 2, &n, &e));
    CHECK_UINT_EQ(n, 0);
    CHECK_OK(sh_tokenizer_encode(t, "", 0, SH_TOKENIZE_ADD_BOS, ids, 2, &n, &e));
    CHECK(n == 1 && ids[0] == 1);
    char buf[4];
    size_t len;
    int32_t bad[2] = {5, 40000};
    CHECK(sh_tokenizer_decode(t, bad, 2, 0, buf, sizeof buf, &len, &e) == SH_EINVAL);
    int32_t hello[1] = {15043}; /* "▁Hello" */
    CHECK(sh_tokenizer_decode(t, hello, 1, 0, buf, sizeof buf, &len, &e) == SH_ERANGE);
    CHECK_UINT_EQ(len, 6);
    sh_tokenizer_destroy(t);
    sh_tokenizer_destroy(NULL);
    sh_tokenizer_stream_destroy(NULL);

    t = load("tests/data/vocab/ggml-vocab-gpt-2.gguf");
    if (!t)
        return;
    CHECK(sh_tokenizer_get_kind(t) == SH_TOKENIZER_BPE);
    CHECK_STR_EQ(sh_tokenizer_pre(t), "gpt-2");
    CHECK(!sh_tokenizer_wants_bos(t));
    CHECK_INT_EQ(sh_tokenizer_eot(t), 50256);
    CHECK_STR_EQ(sh_tokenizer_token_text(t, 220, NULL), "\xC4\xA0"); /* "Ġ", the space */
    CHECK(sh_tokenizer_piece(t, 220, 0, &p) == 1 && p[0] == ' ');
    sh_tokenizer_destroy(t);

    /* Not a tokenizer file. */
    sh_gguf *g = NULL;
    if (sh_gguf_open(sh_test_path("tests/data/tiny-random/llama-2-tiny-random.gguf"), NULL, &g,
                     &e) == SH_OK) {
        CHECK_OK(sh_tokenizer_create_gguf(g, &t, &e));
        CHECK_INT_EQ(sh_tokenizer_n_vocab(t), 32000);
        sh_tokenizer_destroy(t);
        sh_gguf_close(g);
    }
    CHECK(sh_tokenizer_create_gguf(NULL, &t, &e) == SH_EINVAL && t == NULL);
}

static void test_llama2c(void)
{
    sh_error e = {0};
    sh_tokenizer *bin = NULL;
    CHECK_OK(sh_tokenizer_create_llama2c(sh_test_path("tests/data/stories260K/tok512.bin"), 512,
                                         &bin, &e));
    sh_tokenizer *gg = load("tests/data/stories260K/stories260K.gguf");
    if (!bin || !gg) {
        SH_FAIL_("llama2c: %s", e.msg);
        sh_tokenizer_destroy(bin);
        sh_tokenizer_destroy(gg);
        return;
    }
    CHECK_INT_EQ(sh_tokenizer_n_vocab(bin), 512);
    CHECK_INT_EQ(sh_tokenizer_bos(bin), 1);
    CHECK_INT_EQ(sh_tokenizer_eos(bin), 2);
    /* The same vocabulary as the GGUF conversion, text and type. */
    for (int32_t i = 0; i < 512; i++) {
        size_t la, lb;
        const char *a = sh_tokenizer_token_text(bin, i, &la),
                   *b = sh_tokenizer_token_text(gg, i, &lb);
        if (la != lb || memcmp(a, b, la) != 0 ||
            sh_tokenizer_token_type(bin, i) != sh_tokenizer_token_type(gg, i))
            SH_FAIL_("token %d: '%s' (%d) vs '%s' (%d)", (int)i, a,
                     (int)sh_tokenizer_token_type(bin, i), b, (int)sh_tokenizer_token_type(gg, i));
    }
    static const char *const sentences[] = {
        "Once upon a time, there was a little girl named Lily.",
        "She loved to play outside in the park!",
        "  Two leading spaces, tabs\tand\nnewlines.",
        "Ünïcödé and emoji 🦙 fall back to bytes.",
        "",
    };
    for (size_t k = 0; k < sizeof sentences / sizeof sentences[0]; k++) {
        const char *s = sentences[k];
        size_t na, nb, len;
        int32_t *a = encode(bin, s, strlen(s), SH_TOKENIZE_ADD_BOS, &na);
        int32_t *b = encode(gg, s, strlen(s), SH_TOKENIZE_ADD_BOS, &nb);
        CHECK(na == nb && memcmp(a, b, na * sizeof *a) == 0);
        char *back = decode(bin, a, na, SH_DECODE_STRIP_SPACE, &len);
        CHECK_STR_EQ(back, s);
        free(back);
        free(a);
        free(b);
    }

    /* The recorded llama2.c run decodes to its recorded text. */
    size_t n_txt, n_ids_txt;
    char *want = read_file("tests/data/stories260K/expected_run_t0_n256.txt", &n_txt);
    char *idtxt = read_file("tests/data/stories260K/expected_ids_bos_256.txt", &n_ids_txt);
    if (want && idtxt) {
        int32_t ids[300];
        size_t n = 0;
        ids[n++] = 1;
        for (char *q = idtxt; n < 300;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q)
                break;
            ids[n++] = (int32_t)v;
            q = end;
        }
        CHECK_UINT_EQ(n, 257);
        size_t len;
        char *got = decode(bin, ids, n, SH_DECODE_STRIP_SPACE, &len);
        while (n_txt && want[n_txt - 1] == '\n')
            want[--n_txt] = '\0';
        CHECK(len == n_txt && memcmp(got, want, n_txt) == 0);
        if (len != n_txt || memcmp(got, want, n_txt) != 0)
            fprintf(stderr, "got:  [%s]\nwant: [%s]\n", got, want);
        free(got);
    } else {
        SH_FAIL_("expected run files missing");
    }
    free(want);
    free(idtxt);

    sh_tokenizer *t = NULL;
    CHECK(sh_tokenizer_create_llama2c(sh_test_path("tests/data/stories260K/tok512.bin"), 100000, &t,
                                      &e) == SH_EFORMAT);
    CHECK(t == NULL);
    CHECK(sh_tokenizer_create_llama2c(sh_test_path("tests/data/no-such-file.bin"), 512, &t, &e) ==
          SH_EIO);
    sh_tokenizer_destroy(bin);
    sh_tokenizer_destroy(gg);
}

/* Many threads encode the same texts with one tokenizer and must all agree with one thread. */
typedef struct thread_job {
    const sh_tokenizer *t;
    const char *text;
    size_t n;
    const int32_t *want;
    size_t n_want;
    int bad;
} thread_job;

static void *thread_main(void *arg)
{
    thread_job *j = arg;
    int32_t *ids = malloc((j->n_want + 1) * sizeof *ids);
    for (int r = 0; r < 20; r++) {
        size_t n = 0;
        if (sh_tokenizer_encode(j->t, j->text, j->n, 0, ids, j->n_want, &n, NULL) != SH_OK ||
            n != j->n_want || memcmp(ids, j->want, n * sizeof *ids) != 0)
            j->bad++;
    }
    free(ids);
    return NULL;
}

static void test_threads(void)
{
    const char *vocabs[] = {"tests/data/vocab/ggml-vocab-llama-spm.gguf",
                            "tests/data/vocab/ggml-vocab-starcoder.gguf"};
    size_t n;
    char *text = read_file("tests/data/tokenizer/code.txt", &n);
    CHECK(text != NULL);
    for (int v = 0; v < 2 && text; v++) {
        sh_tokenizer *t = load(vocabs[v]);
        if (!t)
            continue;
        size_t n_want;
        int32_t *want = encode(t, text, n, 0, &n_want);
        thread_job jobs[4];
        pthread_t th[4];
        for (int i = 0; i < 4; i++) {
            jobs[i] = (thread_job){t, text, n, want, n_want, 0};
            CHECK(pthread_create(&th[i], NULL, thread_main, &jobs[i]) == 0);
        }
        for (int i = 0; i < 4; i++) {
            pthread_join(th[i], NULL);
            CHECK_INT_EQ(jobs[i].bad, 0);
        }
        free(want);
        sh_tokenizer_destroy(t);
    }
    free(text);
}

/* A long input with no word boundaries must not take quadratic time (the ctest timeout catches
 * that) and must still round-trip. */
static void test_long_inputs(void)
{
    size_t n = 1 << 18;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++)
        s[i] = "ab"[i % 2];
    s[n] = '\0';
    char *sp = malloc(n + 1);
    memset(sp, ' ', n);
    sp[n] = '\0';
    const char *vocabs[] = {"tests/data/vocab/ggml-vocab-llama-spm.gguf",
                            "tests/data/vocab/ggml-vocab-gpt-2.gguf"};
    for (int v = 0; v < 2; v++) {
        sh_tokenizer *t = load(vocabs[v]);
        if (!t)
            continue;
        check_round_trip(t, "letters", s, n);
        check_round_trip(t, "spaces", sp, n);
        sh_tokenizer_destroy(t);
    }
    free(s);
    free(sp);
}

/* sh_tokenizer_encode_opts: special tokens only inside the given spans, the same ids as
 * sh_tokenizer_encode otherwise, and max_ids stopping early (by bytes alone, or by count). */
static void test_encode_opts(void)
{
    sh_tokenizer *t = load("tests/data/vocab/ggml-vocab-starcoder.gguf");
    if (!t)
        return;
    int32_t eot = sh_tokenizer_find(t, "<|endoftext|>", 13);
    const char *s = "<|endoftext|>user text <|endoftext|> more<|endoftext|>";
    size_t len = strlen(s);
    sh_error e = {0};
    int32_t *ids = NULL;
    size_t n = 0, n_ref = 0;
    // No options: as sh_tokenizer_encode without flags.
    int32_t *ref = encode(t, s, len, 0, &n_ref);
    CHECK_OK(sh_tokenizer_encode_opts(t, s, len, NULL, &ids, &n, &e));
    CHECK(ids && n == n_ref && memcmp(ids, ref, n * sizeof *ids) == 0);
    free(ids);
    free(ref);
    // PARSE_SPECIAL without spans: as the flag alone.
    ref = encode(t, s, len, SH_TOKENIZE_PARSE_SPECIAL, &n_ref);
    sh_tokenize_opts o = {.flags = SH_TOKENIZE_PARSE_SPECIAL};
    CHECK_OK(sh_tokenizer_encode_opts(t, s, len, &o, &ids, &n, &e));
    CHECK(ids && n == n_ref && memcmp(ids, ref, n * sizeof *ids) == 0);
    CHECK_UINT_EQ(count_eq(ids, n, eot), 3);
    free(ids);
    free(ref);
    // Spans over the first and last marker only: the middle one is text.
    sh_tokenizer_span sp[2] = {{0, 13}, {len - 13, 13}};
    o.special = sp;
    o.n_special = 2;
    CHECK_OK(sh_tokenizer_encode_opts(t, s, len, &o, &ids, &n, &e));
    CHECK(ids && n > 2 && ids[0] == eot && ids[n - 1] == eot);
    CHECK_UINT_EQ(count_eq(ids, n, eot), 2);
    size_t blen = 0;
    char *back = decode(t, ids, n, SH_DECODE_SPECIAL, &blen);
    CHECK_STR_EQ(back, s);
    free(back);
    free(ids);
    // A span that ends inside a marker does not make it special.
    sp[0] = (sh_tokenizer_span){0, 12};
    o.n_special = 1;
    CHECK_OK(sh_tokenizer_encode_opts(t, s, len, &o, &ids, &n, &e));
    CHECK_UINT_EQ(count_eq(ids, n, eot), 0);
    free(ids);
    // Spans out of order or outside the text.
    sh_tokenizer_span badsp[2] = {{20, 5}, {10, 5}};
    o.special = badsp;
    o.n_special = 2;
    CHECK_INT_EQ(sh_tokenizer_encode_opts(t, s, len, &o, &ids, &n, &e), SH_EINVAL);
    CHECK(ids == NULL);
    badsp[0] = (sh_tokenizer_span){len - 2, 5};
    o.n_special = 1;
    CHECK_INT_EQ(sh_tokenizer_encode_opts(t, s, len, &o, &ids, &n, &e), SH_EINVAL);
    // An empty text gives an array (with room for one id), not NULL.
    CHECK_OK(sh_tokenizer_encode_opts(t, "", 0, NULL, &ids, &n, &e));
    CHECK(ids != NULL && n == 0);
    free(ids);
    // max_ids: exactly enough passes; one less stops with the count max_ids + 1.
    ref = encode(t, s, len, 0, &n_ref);
    free(ref);
    sh_tokenize_opts lim = {.max_ids = n_ref};
    CHECK_OK(sh_tokenizer_encode_opts(t, s, len, &lim, &ids, &n, &e));
    CHECK_UINT_EQ(n, n_ref);
    free(ids);
    lim.max_ids = n_ref - 1;
    CHECK_INT_EQ(sh_tokenizer_encode_opts(t, s, len, &lim, &ids, &n, &e), SH_ERANGE);
    CHECK_UINT_EQ(n, n_ref);
    CHECK(ids == NULL);
    sh_tokenizer_destroy(t);

    // A huge single word is refused by its byte length alone, at once, on either kind.
    size_t big = (size_t)4 << 20;
    char *w = malloc(big);
    memset(w, 'a', big);
    const char *vocabs[] = {"tests/data/vocab/ggml-vocab-llama-spm.gguf",
                            "tests/data/vocab/ggml-vocab-gpt-2.gguf"};
    for (int v = 0; v < 2; v++) {
        t = load(vocabs[v]);
        if (!t)
            continue;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        sh_tokenize_opts o2 = {.max_ids = 8192};
        CHECK_INT_EQ(sh_tokenizer_encode_opts(t, w, big, &o2, &ids, &n, &e), SH_ERANGE);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        CHECK_UINT_EQ(n, 8193);
        if (ms > 50)
            SH_FAIL_("%s: refusing a %zu-byte word took %.1f ms", vocabs[v], big, ms);
        // Within the byte bound, the count stops it: a 64 KiB run of "a b " needs ~32k ids.
        for (size_t i = 0; i < 65536; i++)
            w[i] = "a b "[i % 4];
        CHECK_INT_EQ(sh_tokenizer_encode_opts(t, w, 65536, &o2, &ids, &n, &e), SH_ERANGE);
        CHECK_UINT_EQ(n, 8193);
        memset(w, 'a', 65536);
        sh_tokenizer_destroy(t);
    }
    free(w);
}

static const sh_test_case tests[] = {
    {"round_trip_spm", test_round_trip_spm},
    {"round_trip_gpt2", test_round_trip_gpt2},
    {"round_trip_starcoder", test_round_trip_starcoder},
    {"bpe_invalid_utf8", test_bpe_invalid_utf8},
    {"stream_split_characters", test_stream_split_characters},
    {"special_tokens", test_special_tokens},
    {"api", test_api},
    {"llama2c", test_llama2c},
    {"threads", test_threads},
    {"long_inputs", test_long_inputs},
    {"encode_opts", test_encode_opts},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
