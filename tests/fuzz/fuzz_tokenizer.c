/* Fuzz target for the tokenizers: arbitrary bytes through one SPM and one BPE vocabulary, with
 * and without special-token parsing, decoded whole and through the streaming decoder; valid UTF-8
 * must round-trip. The vocabularies load once from tests/data/vocab (SH_SOURCE_DIR or the working
 * directory, which ctest sets to the source tree). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static sh_tokenizer *spm, *bpe;
/* Bytes the BPE vocabulary can encode: byte-level vocabularies often lack the GPT-2 characters of
 * bytes that never occur in UTF-8 (C0, C1, F5-FF), and those are dropped as in llama.cpp. */
static bool bpe_byte_ok[256];

static sh_tokenizer *load(const char *rel)
{
    const char *root = getenv("SH_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root ? root : ".", rel);
    sh_gguf *g = NULL;
    sh_tokenizer *t = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK || sh_tokenizer_create_gguf(g, &t, &e) != SH_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", e.msg);
        abort();
    }
    sh_gguf_close(g);
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    spm = load("tests/data/vocab/ggml-vocab-llama-spm.gguf");
    bpe = load("tests/data/vocab/ggml-vocab-starcoder.gguf");
    for (int b = 0; b < 256; b++) {
        char c = (char)b, back[8];
        int32_t ids[8];
        size_t n = 0, len = 0;
        bpe_byte_ok[b] =
            sh_tokenizer_encode(bpe, &c, 1, 0, ids, 8, &n, NULL) == SH_OK &&
            sh_tokenizer_decode(bpe, ids, n, 0, back, sizeof back, &len, NULL) == SH_OK &&
            len == 1 && back[0] == c;
    }
    return 0;
}

static bool valid_utf8(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        size_t k;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            k = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 3;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 4;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return false;
        }
        if (n - i < k || s[i + 1] < lo || s[i + 1] > hi)
            return false;
        for (size_t j = 2; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

static void check(const sh_tokenizer *t, const uint8_t *data, size_t size, uint32_t flags,
                  bool expect_round_trip)
{
    size_t n = 0;
    sh_err err = sh_tokenizer_encode(t, (const char *)data, size, flags, NULL, 0, &n, NULL);
    if (err != SH_OK && err != SH_ERANGE)
        abort();
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    size_t n2 = 0;
    if (sh_tokenizer_encode(t, (const char *)data, size, flags, ids, n, &n2, NULL) != SH_OK ||
        n2 != n)
        abort();
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= sh_tokenizer_n_vocab(t))
            abort();

    uint32_t dflags =
        SH_DECODE_STRIP_SPACE | (flags & SH_TOKENIZE_PARSE_SPECIAL ? SH_DECODE_SPECIAL : 0);
    size_t len = 0;
    err = sh_tokenizer_decode(t, ids, n, dflags, NULL, 0, &len, NULL);
    if (err != SH_OK && err != SH_ERANGE)
        abort();
    char *text = malloc(len + 1);
    if (sh_tokenizer_decode(t, ids, n, dflags, text, len + 1, &len, NULL) != SH_OK)
        abort();

    /* The stream: chunks concatenate to valid UTF-8, equal to the whole decode when that is. */
    sh_tokenizer_stream *s = NULL;
    if (sh_tokenizer_stream_create(t, dflags, &s, NULL) != SH_OK)
        abort();
    size_t cap = 3 * len + 16, m = 0;
    char *out = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        const char *chunk;
        size_t k;
        if (i < n) {
            if (sh_tokenizer_stream_feed(s, ids[i], &chunk, &k) != SH_OK)
                abort();
        } else {
            sh_tokenizer_stream_flush(s, &chunk, &k);
        }
        if (!valid_utf8((const uint8_t *)chunk, k) || m + k > cap)
            abort();
        memcpy(out + m, chunk, k);
        m += k;
    }
    sh_tokenizer_stream_destroy(s);
    if (valid_utf8((const uint8_t *)text, len) && (m != len || memcmp(out, text, len) != 0))
        abort();

    if (expect_round_trip && (len != size || memcmp(text, data, size) != 0)) {
        fprintf(stderr, "round trip failed: %zu bytes in, %zu out\n", size, len);
        abort();
    }
    free(out);
    free(text);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    bool utf8 = valid_utf8(data, size);
    /* SentencePiece cannot tell a typed U+2581 from a space. */
    bool has_mark = size >= 3 && memmem(data, size, "\xE2\x96\x81", 3) != NULL;
    check(spm, data, size, 0, utf8 && !has_mark);
    check(spm, data, size, SH_TOKENIZE_PARSE_SPECIAL, false);
    /* Byte-level BPE round-trips any bytes it has characters for, and special tokens decode back
     * to their text. */
    bool bytes_ok = true;
    for (size_t i = 0; i < size && bytes_ok; i++)
        bytes_ok = bpe_byte_ok[data[i]];
    check(bpe, data, size, 0, bytes_ok);
    check(bpe, data, size, SH_TOKENIZE_PARSE_SPECIAL, bytes_ok);
    return 0;
}
