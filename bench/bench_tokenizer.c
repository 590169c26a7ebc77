/* Tokenizer encode speed: English text of about 4 MB through an SPM and BPE vocabularies (and the
 * default model when present); one JSON object per line. Run from the source tree or with
 * SH_SOURCE_DIR set; optional arguments are extra GGUF files to measure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/tokenizer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *path_of(const char *rel, char *buf, size_t cap)
{
    const char *root = getenv("SH_SOURCE_DIR");
    if (rel[0] == '/')
        snprintf(buf, cap, "%s", rel);
    else
        snprintf(buf, cap, "%s/%s", root ? root : ".", rel);
    return buf;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
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
    *len = buf ? (size_t)n : 0;
    return buf;
}

/* English text: the GPL-3 when the system has it, else the test corpus, repeated to ~4 MB. */
static char *build_text(size_t *len)
{
    char p[1024];
    size_t n = 0;
    char *unit = read_file("/usr/share/common-licenses/GPL-3", &n);
    if (!unit)
        unit =
            read_file(path_of("tests/data/stories260K/expected_run_t0_n256.txt", p, sizeof p), &n);
    if (!unit || n == 0)
        return NULL;
    size_t reps = (4u << 20) / n + 1;
    char *text = malloc(n * reps);
    for (size_t i = 0; text && i < reps; i++)
        memcpy(text + i * n, unit, n);
    free(unit);
    *len = n * reps;
    return text;
}

static void bench(const char *label, const char *path, const char *text, size_t len)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK) {
        fprintf(stderr, "skip %s: %s\n", label, e.msg);
        return;
    }
    sh_tokenizer *t = NULL;
    sh_err err = sh_tokenizer_create_gguf(g, &t, &e);
    sh_gguf_close(g);
    if (err) {
        fprintf(stderr, "skip %s: %s\n", label, e.msg);
        return;
    }
    size_t cap = len + 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double t0 = now();
        err = sh_tokenizer_encode(t, text, len, 0, ids, cap, &n, &e);
        double dt = now() - t0;
        if (err) {
            fprintf(stderr, "%s: %s\n", label, e.msg);
            break;
        }
        if (dt < best)
            best = dt;
    }
    if (!err)
        printf("{\"name\":\"tokenizer_encode\",\"vocab\":\"%s\",\"value\":%.2f,\"unit\":\"MB/s\","
               "\"bytes\":%zu,\"tokens\":%zu}\n",
               label, (double)len / 1e6 / best, len, n);
    fflush(stdout);
    free(ids);
    sh_tokenizer_destroy(t);
}

int main(int argc, char **argv)
{
    size_t len;
    char *text = build_text(&len);
    if (!text) {
        fprintf(stderr, "no text to encode\n");
        return 1;
    }
    static const char *const vocabs[][2] = {
        {"llama-spm", "tests/data/vocab/ggml-vocab-llama-spm.gguf"},
        {"gpt-2", "tests/data/vocab/ggml-vocab-gpt-2.gguf"},
        {"starcoder", "tests/data/vocab/ggml-vocab-starcoder.gguf"},
        {"smollm2-135m-instruct", "models/smollm2-135m-instruct-q4_1.gguf"},
    };
    char p[1024];
    for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++)
        bench(vocabs[i][0], path_of(vocabs[i][1], p, sizeof p), text, len);
    for (int i = 1; i < argc; i++)
        bench(argv[i], argv[i], text, len);
    free(text);
    return 0;
}
