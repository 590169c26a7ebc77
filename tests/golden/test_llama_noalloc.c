/* No heap allocation per decoded token: after warm-up, a decode loop (forward pass, sampling with
 * top-k/top-p and logprobs, streaming detokenization) calls malloc zero times. The test replaces
 * the allocator of its own process with counting wrappers around glibc's, so every allocation
 * made by any thread (the backend's workers included) is seen. */
#include "kernels/backend.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "sh_alloc_count.h"
#include "sh_test.h"

#ifndef SH_NOALLOC_SKIP

#define MODEL "models/smollm2-135m-instruct-q4_1.gguf"

static void test_decode_allocates_nothing(void)
{
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *ctx = NULL;
    sh_sampler *smp = NULL;
    sh_gguf *g = NULL;
    sh_tokenizer *tok = NULL;
    sh_tokenizer_stream *st = NULL;

    CHECK_OK(sh_llama_load(sh_test_path(MODEL), NULL, &m, &e));
    sh_backend_cpu_opts bo = {.n_threads = 2};
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    sh_llama_ctx_opts co = {.max_tokens = 64, .max_seqs = 1, .kv_tokens = 256};
    CHECK_OK(sh_llama_ctx_create(m, be, &co, &ctx, &e));
    sh_sampler_params sp = sh_sampler_params_default();
    sp.temperature = 0.8f;
    sp.top_k = 40;
    sp.top_p = 0.95f;
    sp.seed = 7;
    sp.n_logprobs = 5;
    CHECK_OK(sh_sampler_create(m->hp.n_vocab, &sp, &smp, &e));
    CHECK_OK(sh_gguf_open(sh_test_path(MODEL), NULL, &g, &e));
    CHECK_OK(sh_tokenizer_create_gguf(g, &tok, &e));
    CHECK_OK(sh_tokenizer_stream_create(tok, 0, &st, &e));
    if (!m || !be || !ctx || !smp || !tok || !st) {
        fprintf(stderr, "setup failed: %s\n", e.msg);
        goto out;
    }

    /* The hook must see the setup's allocations, or a zero below would prove nothing. */
    CHECK(atomic_load(&n_allocs) > 10);

    int32_t blocks[16];
    for (int i = 0; i < 16; i++)
        blocks[i] = i;
    int32_t prompt[] = {1, 9690, 198, 2683, 359, 253, 5356, 5646};
    int32_t n_prompt = (int32_t)(sizeof prompt / sizeof prompt[0]);
    sh_llama_seq seq = {prompt, n_prompt, 0, blocks, true, 0};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &seq};
    sh_llama_out o;
    CHECK_OK(sh_llama_forward(ctx, &b, &o, &e));

    int32_t pos = n_prompt, tokv;
    long before = 0;
    for (int step = 0; step < 48; step++) {
        if (step == 8) /* warm-up done: scratch has grown to its steady size */
            before = atomic_load(&n_allocs);
        sh_sample s;
        CHECK_OK(sh_sampler_sample(smp, o.logits, &s));
        sh_sampler_accept(smp, s.id);
        const char *text = NULL;
        size_t n_text = 0;
        CHECK_OK(sh_tokenizer_stream_feed(st, s.id, &text, &n_text));
        tokv = s.id;
        seq = (sh_llama_seq){&tokv, 1, pos++, blocks, true, 0};
        CHECK_OK(sh_llama_forward(ctx, &b, &o, &e));
    }
    long during = atomic_load(&n_allocs) - before;
    CHECK_INT_EQ(during, 0);
    fprintf(stderr, "allocations in 40 decode steps after warm-up: %ld\n", during);
out:
    sh_tokenizer_stream_destroy(st);
    sh_tokenizer_destroy(tok);
    sh_gguf_close(g);
    sh_sampler_destroy(smp);
    sh_llama_ctx_destroy(ctx);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
}
#endif

int main(int argc, char **argv)
{
#ifdef SH_NOALLOC_SKIP
    (void)argc;
    (void)argv;
    fprintf(stderr, "skipped: sanitizer builds replace the allocator\n");
    return SH_TEST_SKIP;
#else
    FILE *f = fopen(sh_test_path(MODEL), "rb");
    if (!f) {
        fprintf(stderr, "skipped: %s absent (scripts/get-model.sh fetches it)\n", MODEL);
        return SH_TEST_SKIP;
    }
    fclose(f);
    static const sh_test_case tests[] = {
        {"decode_allocates_nothing", test_decode_allocates_nothing}, {NULL, NULL}};
    return sh_test_main(argc, argv, tests);
#endif
}
