/* ABI check of libshoal.so: compiled as C99 against the API version-1 headers kept in
 * tests/abi/v1/ (copies of include/ as it was when API version 1 was first implemented), linked
 * and run against the library just built. It opens the tiny model named on the command line,
 * tokenizes, submits one greedy request, polls it to its end and closes, checking each answer. A
 * later change to the library that breaks programs built against version 1 (a function removed
 * or changed, a struct laid out differently) fails here.
 * Usage: test_abi MODEL.gguf */
#include <shoal.h>

#include <stdio.h>
#include <string.h>

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            failures++;                                                                            \
            printf("FAIL abi: %s (line %d): ", #cond, __LINE__);                                   \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

typedef struct run {
    int32_t tokens; /* ids received through on_token */
    int32_t next;   /* the index the next on_token event must carry */
    int done, errors;
    sh_done_info info;
    char text[4096];
    size_t len;
} run;

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    run *r = user;
    (void)id;
    CHECK(ev->index == r->next, "token event index %d, expected %d", (int)ev->index, (int)r->next);
    r->tokens += ev->n_ids;
    r->next += ev->n_ids;
    if (ev->text_len < sizeof r->text - r->len) {
        memcpy(r->text + r->len, ev->text, ev->text_len);
        r->len += ev->text_len;
        r->text[r->len] = '\0';
    }
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    run *r = user;
    (void)id;
    r->done++;
    r->info = *info;
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    run *r = user;
    (void)id;
    r->errors++;
    printf("FAIL abi: on_error %d (%s): %s\n", (int)code, sh_strerror(code), message);
}

int main(int argc, char **argv)
{
    sh_engine_opts o;
    sh_request_opts q;
    sh_callbacks cb;
    sh_engine *eng = NULL;
    sh_model_info mi;
    sh_error e;
    sh_err rc;
    run r;
    uint64_t id = 0;
    int32_t ids[64], n = 0;
    int polls;

    if (argc != 2) {
        printf("usage: test_abi MODEL.gguf\n");
        return 2;
    }
    printf("abi: library %s, header %s (API version %d)\n", sh_version(), SH_VERSION_STRING,
           SH_API_VERSION);
    CHECK(sh_version() != NULL && sh_version()[0] != '\0', "empty sh_version()");
    CHECK(strcmp(sh_strerror(SH_OK), sh_strerror(SH_EINVAL)) != 0, "sh_strerror texts");

    /* The defaults come back by value: their size must be the one this program was built with. */
    o = sh_engine_opts_default();
    CHECK(o.struct_size == sizeof o, "sh_engine_opts struct_size %u, v1 size %u",
          (unsigned)o.struct_size, (unsigned)sizeof o);
    q = sh_request_opts_default();
    CHECK(q.struct_size == sizeof q, "sh_request_opts struct_size %u, v1 size %u",
          (unsigned)q.struct_size, (unsigned)sizeof q);

    /* Misuse gets a code, not a crash. */
    CHECK(sh_engine_open(NULL, &eng, &e) == SH_EINVAL, "sh_engine_open(NULL)");
    CHECK(eng == NULL, "engine set on failure");
    CHECK(sh_engine_close(NULL) == SH_OK, "sh_engine_close(NULL)");

    o.model_path = argv[1];
    o.threads = 1;
    rc = sh_engine_open(&o, &eng, &e);
    CHECK(rc == SH_OK && eng != NULL, "sh_engine_open(%s): %d %s", argv[1], (int)rc, e.msg);
    if (rc != SH_OK || eng == NULL)
        return 1;

    rc = sh_model_info_get(eng, &mi);
    CHECK(rc == SH_OK, "sh_model_info_get: %d", (int)rc);
    CHECK(mi.n_vocab > 0 && mi.n_layers > 0 && mi.dim > 0, "model info: vocab %d layers %d dim %d",
          (int)mi.n_vocab, (int)mi.n_layers, (int)mi.dim);
    printf("abi: model %s (%s, %s), vocab %d, %d layers\n", mi.name, mi.arch, mi.weight_type,
           (int)mi.n_vocab, (int)mi.n_layers);

    rc = sh_tokenize(eng, "Once upon a time", 16, true, false, ids, 64, &n, &e);
    CHECK(rc == SH_OK && n > 1, "sh_tokenize: %d, %d ids: %s", (int)rc, (int)n, e.msg);

    memset(&r, 0, sizeof r);
    q.prompt = "Once upon a time";
    q.max_tokens = 8;
    cb.on_token = on_token;
    cb.on_done = on_done;
    cb.on_error = on_error;
    rc = sh_submit(eng, &q, &cb, &r, &id, &e);
    CHECK(rc == SH_OK && id != 0, "sh_submit: %d %s", (int)rc, e.msg);
    CHECK(sh_pending(eng) == (rc == SH_OK ? 1 : 0), "sh_pending %d", (int)sh_pending(eng));
    CHECK(sh_fd(eng) >= 0, "sh_fd %d", sh_fd(eng));

    /* 10 s at most: the model is tiny, 8 tokens take milliseconds. */
    for (polls = 0; rc == SH_OK && !r.done && !r.errors && polls < 200; polls++) {
        sh_err prc = sh_poll(eng, 50, NULL);
        CHECK(prc == SH_OK, "sh_poll: %d", (int)prc);
        if (prc != SH_OK)
            break;
    }
    CHECK(r.done == 1 && r.errors == 0, "request ended with %d done, %d errors after %d polls",
          r.done, r.errors, polls);
    CHECK(r.tokens > 0 && r.tokens <= 8, "%d tokens", (int)r.tokens);
    CHECK(r.info.completion_tokens == r.tokens, "usage says %d tokens, callbacks saw %d",
          (int)r.info.completion_tokens, (int)r.tokens);
    CHECK(r.info.prompt_tokens > 0, "usage says %d prompt tokens", (int)r.info.prompt_tokens);
    CHECK(r.info.finish == SH_FINISH_LENGTH || r.info.finish == SH_FINISH_STOP, "finish %d",
          (int)r.info.finish);
    CHECK(sh_pending(eng) == 0, "sh_pending %d after the end", (int)sh_pending(eng));
    CHECK(sh_cancel(eng, id, &e) == SH_ENOTFOUND, "sh_cancel of a finished request");
    printf("abi: %d tokens: \"%s\"\n", (int)r.tokens, r.text);

    CHECK(sh_engine_close(eng) == SH_OK, "sh_engine_close");
    if (failures) {
        printf("abi: %d check(s) failed\n", failures);
        return 1;
    }
    printf("abi: all checks passed\n");
    return 0;
}
