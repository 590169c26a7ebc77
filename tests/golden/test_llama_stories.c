/* Golden tests on stories260K (a real trained Llama-2-architecture model): greedy decoding from
 * BOS must equal llama2.c's recorded ids from both the GGUF and the .bin, the text must equal
 * run.c's output, and batching, chunking and thread count must not change the results. */
#include "llama_driver.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#define GGUF "tests/data/stories260K/stories260K.gguf"
#define BIN "tests/data/stories260K/stories260K.bin"
#define N 256

static int32_t expected[N];

static void load_expected(void)
{
    CHECK_INT_EQ(
        read_ids(sh_test_path("tests/data/stories260K/expected_ids_bos_256.txt"), expected, N), N);
}

static void check_bos_greedy(const char *rel, int32_t threads)
{
    drv d;
    if (!drv_open(&d, sh_test_path(rel), threads, 64, 4, 512))
        return;
    int32_t bos = 1, gen[N];
    CHECK_INT_EQ(drv_greedy(&d, &bos, 1, N, gen), N);
    int32_t first_diff = -1;
    for (int32_t i = 0; i < N && first_diff < 0; i++)
        if (gen[i] != expected[i])
            first_diff = i;
    if (first_diff >= 0)
        SH_FAIL_("%s (%d threads): id %d is %d, llama2.c gave %d", rel, (int)threads,
                 (int)first_diff, (int)gen[first_diff], (int)expected[first_diff]);
    drv_close(&d);
}

static void test_gguf_bos_256(void) { check_bos_greedy(GGUF, 1); }
static void test_bin_bos_256(void) { check_bos_greedy(BIN, 1); }
static void test_gguf_bos_256_two_threads(void) { check_bos_greedy(GGUF, 2); }

/* The ids decode to run.c's text (which ends with the newline run.c prints at the end). */
static void test_text(void)
{
    FILE *f = fopen(sh_test_path("tests/data/stories260K/expected_run_t0_n256.txt"), "rb");
    CHECK(f != NULL);
    if (!f)
        return;
    static char want[4096], got[4096];
    size_t wn = fread(want, 1, sizeof want - 1, f);
    fclose(f);
    want[wn] = '\0';
    sh_gguf *g = NULL;
    sh_tokenizer *t = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open(sh_test_path(GGUF), NULL, &g, &e));
    CHECK_OK(sh_tokenizer_create_gguf(g, &t, &e));
    if (!t) {
        sh_gguf_close(g);
        return;
    }
    size_t len = 0;
    CHECK_OK(sh_tokenizer_decode(t, expected, N, SH_DECODE_STRIP_SPACE, got, sizeof got, &len, &e));
    got[len] = '\0';
    if (len + 1 < sizeof got)
        strcat(got, "\n");
    CHECK_STR_EQ(got, want);
    sh_tokenizer_destroy(t);
    sh_gguf_close(g);
}

/* A prompt fed as one chunk, as several chunks, or token by token gives the same logits. */
static void test_chunked_prefill(void)
{
    drv d;
    if (!drv_open(&d, sh_test_path(GGUF), 1, 64, 4, 512))
        return;
    int32_t V = d.m->hp.n_vocab, ids[40];
    ids[0] = 1;
    for (int i = 1; i < 40; i++)
        ids[i] = expected[i - 1];
    static float whole[40 * 512];
    const float *lg = drv_feed(&d, ids, 40, 0, true);
    if (!lg)
        goto out;
    memcpy(whole, lg, sizeof(float) * 40 * (size_t)V);
    // Chunks of 7, then singles: every row's logits must agree with the whole-prompt pass.
    double worst = 0.0;
    for (int32_t p = 0; p < 40;) {
        int32_t k = p < 28 ? 7 : 1;
        lg = drv_feed(&d, ids + p, k, p, true);
        if (!lg)
            goto out;
        for (int32_t r = 0; r < k; r++)
            for (int32_t v = 0; v < V; v++) {
                double diff = fabs(lg[r * V + v] - whole[(p + r) * V + v]);
                worst = diff > worst ? diff : worst;
            }
        p += k;
    }
    CHECK_NEAR(worst, 0.0, 1e-4);
out:
    drv_close(&d);
}

/* Three sequences in one batch (a prefill chunk and two decodes with their own block tables)
 * produce the same greedy continuations as each run alone. */
static void test_batched_sequences(void)
{
    drv d;
    if (!drv_open(&d, sh_test_path(GGUF), 2, 64, 4, 2048))
        return;
    int32_t V = d.m->hp.n_vocab;
    enum { S = 3, G = 24 };
    const int32_t prompts[S][6] = {{1}, {1, 403, 407, 261}, {1, 403, 407, 261, 378, 432}};
    const int32_t lens[S] = {1, 4, 6};
    int32_t alone[S][G], batched[S][G];
    for (int s = 0; s < S; s++)
        drv_greedy(&d, prompts[s], lens[s], G, alone[s]);
    // Disjoint block tables: sequence s uses blocks 10s, 10s+1, ...
    int32_t tables[S][10];
    for (int s = 0; s < S; s++)
        for (int j = 0; j < 10; j++)
            tables[s][j] = 10 * s + j;
    // Step 0: everyone prefills together. Later steps: everyone decodes one token; sequence 2
    // starts one step late to mix a prefill chunk with decodes.
    int32_t pos[S] = {0}, next[S], done[S] = {0};
    for (int step = 0; step < G + 1; step++) {
        sh_llama_seq seqs[S];
        int n = 0, who[S];
        for (int s = 0; s < S; s++) {
            if (done[s] >= G || (s == 2 && step == 0))
                continue;
            bool pre = pos[s] == 0;
            seqs[n] = (sh_llama_seq){.tokens = pre ? prompts[s] : &next[s],
                                     .n_tokens = pre ? lens[s] : 1,
                                     .pos0 = pos[s],
                                     .blocks = tables[s],
                                     .want_logits = true};
            who[n++] = s;
        }
        if (n == 0)
            break;
        sh_llama_batch b = {.n_seqs = n, .seqs = seqs};
        sh_llama_out out;
        sh_error e = {0};
        if (sh_llama_forward(d.c, &b, &out, &e)) {
            SH_FAIL_("forward: %s", e.msg);
            break;
        }
        CHECK_INT_EQ(out.n_logits, n);
        for (int i = 0; i < n; i++) {
            int s = who[i];
            pos[s] += seqs[i].n_tokens;
            next[s] = argmax(out.logits + (size_t)i * V, V);
            batched[s][done[s]++] = next[s];
        }
    }
    for (int s = 0; s < S; s++)
        for (int i = 0; i < G; i++)
            if (batched[s][i] != alone[s][i]) {
                SH_FAIL_("sequence %d token %d: batched %d, alone %d", s, i, (int)batched[s][i],
                         (int)alone[s][i]);
                break;
            }
    drv_close(&d);
}

/* Bad batches are refused without touching the cache. */
static void test_bad_batch(void)
{
    drv d;
    if (!drv_open(&d, sh_test_path(GGUF), 1, 8, 2, 64))
        return;
    int32_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, bad_block[4] = {99, 0, 0, 0};
    sh_llama_seq s = {.tokens = ids, .n_tokens = 9, .pos0 = 0, .blocks = d.blocks};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
    sh_llama_out out;
    sh_error e = {0};
    CHECK_INT_EQ(sh_llama_forward(d.c, &b, &out, &e), SH_EINVAL); // 9 rows > 8
    s.n_tokens = 1;
    ids[0] = 512;
    CHECK_INT_EQ(sh_llama_forward(d.c, &b, &out, &e), SH_EINVAL); // id outside the vocabulary
    ids[0] = 1;
    s.blocks = bad_block;
    CHECK_INT_EQ(sh_llama_forward(d.c, &b, &out, &e), SH_EINVAL); // block outside the pool
    s.blocks = d.blocks;
    s.pos0 = 64;
    CHECK_INT_EQ(sh_llama_forward(d.c, &b, &out, &e), SH_EINVAL); // past the pool's capacity
    drv_close(&d);
}

static const sh_test_case tests[] = {
    {"gguf_bos_256", test_gguf_bos_256},
    {"bin_bos_256", test_bin_bos_256},
    {"gguf_bos_256_two_threads", test_gguf_bos_256_two_threads},
    {"text", test_text},
    {"chunked_prefill", test_chunked_prefill},
    {"batched_sequences", test_batched_sequences},
    {"bad_batch", test_bad_batch},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    load_expected();
    return sh_test_main(argc, argv, tests);
}
