/* The default model's tokenizer (SmolLM2, byte-level BPE with the smollm pre-tokenizer): chat
 * special tokens and a round trip. Skips (77) when models/ does not hold the file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "sh_test.h"

static sh_tokenizer *t;

static int32_t encode(const char *s, uint32_t flags, int32_t *ids, size_t cap, size_t *n)
{
    CHECK_OK(sh_tokenizer_encode(t, s, strlen(s), flags, ids, cap, n, NULL));
    return *n ? ids[0] : -1;
}

static void test_chat_tokens(void)
{
    int32_t im_start = sh_tokenizer_find(t, "<|im_start|>", 12);
    int32_t im_end = sh_tokenizer_find(t, "<|im_end|>", 10);
    CHECK(im_start >= 0 && im_end >= 0);
    CHECK(sh_tokenizer_is_control(t, im_start));
    CHECK(sh_tokenizer_is_eog(t, im_end));
    const char *chat = "<|im_start|>user\nHi there<|im_end|>\n";
    int32_t ids[256];
    size_t n = 0;
    encode(chat, SH_TOKENIZE_PARSE_SPECIAL, ids, 256, &n);
    CHECK(n > 3 && ids[0] == im_start);
    int found_end = 0;
    for (size_t i = 0; i < n; i++)
        found_end += ids[i] == im_end;
    CHECK_INT_EQ(found_end, 1);
    /* Plain text: the markers are spelled out with ordinary tokens. */
    encode(chat, 0, ids, 256, &n);
    for (size_t i = 0; i < n; i++)
        CHECK(ids[i] != im_start && ids[i] != im_end);
    char buf[256];
    size_t len;
    CHECK_OK(sh_tokenizer_decode(t, ids, n, 0, buf, sizeof buf, &len, NULL));
    CHECK_STR_EQ(buf, chat);
}

static void test_round_trip(void)
{
    static const char *const files[] = {"tests/data/tokenizer/multilingual.txt",
                                        "tests/data/tokenizer/emoji.txt",
                                        "tests/data/tokenizer/code.txt"};
    CHECK_STR_EQ(sh_tokenizer_pre(t), "smollm");
    CHECK(sh_tokenizer_pre_known(t));
    for (int f = 0; f < 3; f++) {
        FILE *fp = fopen(sh_test_path(files[f]), "rb");
        CHECK(fp != NULL);
        if (!fp)
            continue;
        char text[8192];
        size_t n = fread(text, 1, sizeof text - 1, fp);
        fclose(fp);
        int32_t ids[8192];
        size_t n_ids, len;
        CHECK_OK(sh_tokenizer_encode(t, text, n, 0, ids, 8192, &n_ids, NULL));
        char back[8192];
        CHECK_OK(sh_tokenizer_decode(t, ids, n_ids, 0, back, sizeof back, &len, NULL));
        CHECK(len == n && memcmp(back, text, n) == 0);
    }
}

static const sh_test_case tests[] = {
    {"chat_tokens", test_chat_tokens},
    {"round_trip", test_round_trip},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    const char *path = sh_test_path("models/smollm2-135m-instruct-q4_1.gguf");
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK) {
        fprintf(stderr, "skip: %s\n", e.msg);
        return SH_TEST_SKIP;
    }
    sh_err err = sh_tokenizer_create_gguf(g, &t, &e);
    sh_gguf_close(g);
    if (err) {
        fprintf(stderr, "%s\n", e.msg);
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    sh_tokenizer_destroy(t);
    return rc;
}
