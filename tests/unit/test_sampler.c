/* Unit tests of the sampler on small vocabularies whose answers can be checked by hand. */
#include <math.h>

#include "model/sampler.h"
#include "sh_test.h"

static sh_sampler *make(int32_t n_vocab, const sh_sampler_params *p)
{
    sh_sampler *s = NULL;
    sh_error e = {0};
    if (sh_sampler_create(n_vocab, p, &s, &e))
        fprintf(stderr, "sampler_create: %s\n", e.msg);
    return s;
}

static sh_sampler_params greedy(void)
{
    sh_sampler_params p = sh_sampler_params_default();
    p.temperature = 0.0f;
    return p;
}

static void test_greedy_and_raw_logprob(void)
{
    const float lg[4] = {1.0f, 2.0f, 3.0f, 0.0f};
    sh_sampler_params p = greedy();
    sh_sampler *s = make(4, &p);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 2);
    // log-softmax: 3 - log(e^1 + e^2 + e^3 + e^0)
    double lse = log(exp(1.0) + exp(2.0) + exp(3.0) + 1.0);
    CHECK_NEAR(r.logprob_raw, 3.0 - lse, 1e-6);
    CHECK_NEAR(r.logprob, 3.0 - lse, 1e-6); // no transforms: final == raw
    CHECK_INT_EQ(r.n_top, 0);
    sh_sampler_destroy(s);
}

static void test_logit_bias(void)
{
    const float lg[4] = {1.0f, 2.0f, 3.0f, 0.0f};
    sh_logit_bias b[2] = {{2, -INFINITY}, {3, 2.5f}}; // ban 2; 3 becomes 2.5 > 2
    sh_sampler_params p = greedy();
    p.bias = b;
    p.n_bias = 2;
    sh_sampler *s = make(4, &p);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 3);
    // Everything banned: an error, not a random pick.
    sh_logit_bias all[4] = {{0, -INFINITY}, {1, -INFINITY}, {2, -INFINITY}, {3, -INFINITY}};
    p.bias = all;
    p.n_bias = 4;
    sh_sampler *s2 = make(4, &p);
    CHECK_INT_EQ(sh_sampler_sample(s2, lg, &r), SH_ERANGE);
    CHECK_INT_EQ(r.id, -1);
    p.temperature = 1.0f;
    sh_sampler *s3 = make(4, &p);
    CHECK_INT_EQ(sh_sampler_sample(s3, lg, &r), SH_ERANGE);
    sh_sampler_destroy(s);
    sh_sampler_destroy(s2);
    sh_sampler_destroy(s3);
}

static void test_repeat_penalty(void)
{
    const float lg[3] = {2.0f, 1.9f, -1.0f};
    sh_sampler_params p = greedy();
    p.repeat_penalty = 1.2f;
    sh_sampler *s = make(3, &p);
    sh_sample r;
    sh_sampler_accept(s, 0); // 2.0 / 1.2 = 1.67 < 1.9
    sh_sampler_accept(s, 0); // a repeat in the window is penalised once, not twice
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 1);
    // The final logprob sees the penalised logits: 1.9 vs 2/1.2 vs -1.
    double z = exp(2.0 / 1.2) + exp(1.9) + exp(-1.0);
    CHECK_NEAR(r.logprob, 1.9 - log(z), 1e-5);
    sh_sampler_reset(s, 0);
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 0);
    sh_sampler_destroy(s);

    // Negative logits are multiplied: -1 * 1.2 = -1.2 loses to -1.1.
    const float neg[2] = {-1.0f, -1.1f};
    s = make(2, &p);
    sh_sampler_accept(s, 0);
    CHECK_OK(sh_sampler_sample(s, neg, &r));
    CHECK_INT_EQ(r.id, 1);
    sh_sampler_destroy(s);
}

static void test_frequency_presence_window(void)
{
    const float lg[4] = {2.0f, 1.5f, 0.0f, 0.0f};
    sh_sampler_params p = greedy();
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.25f;
    p.penalty_last_n = 3;
    sh_sampler *s = make(4, &p);
    sh_sample r;
    sh_sampler_accept(s, 0);
    sh_sampler_accept(s, 0); // 2.0 - 2 * 0.1 - 0.25 = 1.55 > 1.5
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 0);
    sh_sampler_accept(s, 0); // 2.0 - 0.3 - 0.25 = 1.45 < 1.5
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 1);
    // Window of 3: three more tokens push every 0 out.
    sh_sampler_accept(s, 2);
    sh_sampler_accept(s, 3);
    sh_sampler_accept(s, 2);
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 0);
    CHECK_NEAR(r.logprob_raw, 2.0 - log(exp(2.0) + exp(1.5) + 2.0), 1e-6);
    sh_sampler_destroy(s);
}

/* Probabilities 0.5, 0.3, 0.15, 0.05 as logits. */
static const float four[4] = {-0.693147f, -1.203973f, -1.897120f, -2.995732f};

static void histogram(sh_sampler *s, const float *lg, int n_draws, int *hist, int n)
{
    for (int i = 0; i < n; i++)
        hist[i] = 0;
    for (int i = 0; i < n_draws; i++) {
        sh_sample r;
        CHECK_OK(sh_sampler_sample(s, lg, &r));
        if (r.id >= 0 && r.id < n)
            hist[r.id]++;
    }
}

static void test_top_p(void)
{
    sh_sampler_params p = sh_sampler_params_default();
    p.top_p = 0.7f; // 0.5 + 0.3 reaches it: {0, 1}, renormalised to 0.625 / 0.375
    p.seed = 42;
    sh_sampler *s = make(4, &p);
    int h[4];
    histogram(s, four, 4000, h, 4);
    CHECK_INT_EQ(h[2] + h[3], 0);
    CHECK_NEAR(h[0] / 4000.0, 0.625, 0.03);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, four, &r));
    CHECK_NEAR(r.logprob, log(r.id == 0 ? 0.625 : 0.375), 1e-4);
    CHECK_NEAR(r.logprob_raw, four[r.id], 1e-5);
    sh_sampler_destroy(s);
}

static void test_min_p_and_top_k(void)
{
    sh_sampler_params p = sh_sampler_params_default();
    p.min_p = 0.5f; // p >= 0.25: {0, 1} (0.3 / 0.5 = 0.6, 0.15 / 0.5 = 0.3)
    p.seed = 7;
    sh_sampler *s = make(4, &p);
    int h[4];
    histogram(s, four, 2000, h, 4);
    CHECK_INT_EQ(h[2] + h[3], 0);
    CHECK(h[1] > 0);
    sh_sampler_destroy(s);

    p = sh_sampler_params_default();
    p.top_k = 1; // top-k 1 at temperature 1 is greedy
    s = make(4, &p);
    histogram(s, four, 200, h, 4);
    CHECK_INT_EQ(h[0], 200);
    sh_sampler_destroy(s);

    p.top_k = 3;
    s = make(4, &p);
    histogram(s, four, 4000, h, 4);
    CHECK_INT_EQ(h[3], 0);
    CHECK_NEAR(h[2] / 4000.0, 0.15 / 0.95, 0.03);
    sh_sampler_destroy(s);
}

static void test_temperature(void)
{
    // Two tokens with odds 1:3. At T = 0.5 logits double, odds 1:9.
    const float lg[2] = {0.0f, 1.0986123f};
    sh_sampler_params p = sh_sampler_params_default();
    p.seed = 3;
    sh_sampler *s = make(2, &p);
    int h[2];
    histogram(s, lg, 4000, h, 2);
    CHECK_NEAR(h[1] / 4000.0, 0.75, 0.03);
    sh_sampler_destroy(s);
    p.temperature = 0.5f;
    s = make(2, &p);
    histogram(s, lg, 4000, h, 2);
    CHECK_NEAR(h[1] / 4000.0, 0.9, 0.02);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_NEAR(r.logprob, log(r.id == 1 ? 0.9 : 0.1), 1e-4);
    sh_sampler_destroy(s);
}

static void test_seed_reproducible(void)
{
    float lg[50];
    for (int i = 0; i < 50; i++)
        lg[i] = (float)((i * 37) % 11) * 0.3f;
    sh_sampler_params p = sh_sampler_params_default();
    p.seed = 1234;
    sh_sampler *a = make(50, &p), *b = make(50, &p);
    p.seed = 1235;
    sh_sampler *c = make(50, &p);
    int same = 1, differ = 0;
    for (int i = 0; i < 64; i++) {
        sh_sample ra, rb, rc;
        CHECK_OK(sh_sampler_sample(a, lg, &ra));
        CHECK_OK(sh_sampler_sample(b, lg, &rb));
        CHECK_OK(sh_sampler_sample(c, lg, &rc));
        same &= ra.id == rb.id;
        differ |= ra.id != rc.id;
    }
    CHECK(same);
    CHECK(differ);
    sh_sampler_reset(a, 99);
    sh_sampler_reset(b, 99);
    CHECK_UINT_EQ(sh_sampler_rand(a), sh_sampler_rand(b));
    sh_sampler_destroy(a);
    sh_sampler_destroy(b);
    sh_sampler_destroy(c);
}

static void test_logprobs_lists(void)
{
    sh_sampler_params p = sh_sampler_params_default();
    p.top_k = 2;
    p.n_logprobs = 3;
    p.logprobs_mode = SH_LOGPROBS_RAW;
    sh_sampler *s = make(4, &p);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, four, &r));
    CHECK_INT_EQ(r.n_top, 3);
    CHECK_INT_EQ(r.top[0].id, 0);
    CHECK_INT_EQ(r.top[1].id, 1);
    CHECK_INT_EQ(r.top[2].id, 2);
    CHECK_NEAR(r.top[2].logprob_raw, log(0.15), 1e-5);
    CHECK_NEAR(r.top[0].logprob, log(0.5 / 0.8), 1e-5);     // within the top-2 distribution
    CHECK(isinf(r.top[2].logprob) && r.top[2].logprob < 0); // cut by top-k
    sh_sampler_destroy(s);

    p.logprobs_mode = SH_LOGPROBS_FINAL; // ranked by the final distribution: only 2 survive
    s = make(4, &p);
    CHECK_OK(sh_sampler_sample(s, four, &r));
    CHECK_INT_EQ(r.n_top, 2);
    CHECK_INT_EQ(r.top[0].id, 0);
    CHECK_NEAR(r.top[1].logprob, log(0.3 / 0.8), 1e-5);
    CHECK_NEAR(r.top[1].logprob_raw, log(0.3), 1e-5);
    sh_sampler_destroy(s);
}

/* A large vocabulary exercises the partial selection used by top-k and top-p. */
static void test_large_vocab_selection(void)
{
    enum { V = 50000 };
    static float lg[V];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < V; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        lg[i] = (float)(x % 100000) / 5000.0f; // 0 .. 20
    }
    // The top 5 by brute force.
    int best[5];
    for (int k = 0; k < 5; k++) {
        int b = -1;
        for (int i = 0; i < V; i++) {
            int used = 0;
            for (int j = 0; j < k; j++)
                used |= best[j] == i;
            if (!used && (b < 0 || lg[i] > lg[b]))
                b = i;
        }
        best[k] = b;
    }
    sh_sampler_params p = sh_sampler_params_default();
    p.n_logprobs = 5;
    p.top_p = 0.9f;
    sh_sampler *s = make(V, &p);
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    for (int k = 0; k < 5; k++)
        CHECK_INT_EQ(r.top[k].id, best[k]);
    sh_sampler_destroy(s);
    p = greedy();
    s = make(V, &p);
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, best[0]);
    sh_sampler_destroy(s);
}

/* sh_sampler_plain_greedy: greedy without logprobs, bias or a penalty in effect; then the sample
 * is sh_sampler_top1's pick with logprob = max - log(sum) (what tensor-parallel ranks combine). */
static void test_plain_greedy(void)
{
    enum { V = 3000 };
    static float lg[V];
    uint64_t x = 1234567ull;
    for (int i = 0; i < V; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        lg[i] = (float)(x % 100000) / 7000.0f - 5.0f;
    }
    lg[1700] = lg[2900] = 20.0f; /* a tie: the first wins */
    sh_sampler_params p = greedy();
    sh_sampler *s = make(V, &p);
    CHECK(sh_sampler_plain_greedy(s));
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    int32_t id;
    float mx;
    double sum;
    sh_sampler_top1(lg, V, &id, &mx, &sum);
    CHECK_INT_EQ(id, 1700);
    CHECK_INT_EQ(r.id, id);
    CHECK(mx == 20.0f);
    CHECK_NEAR(r.logprob, -log(sum), 1e-6);
    CHECK_NEAR(r.logprob_raw, -log(sum), 1e-6);
    sh_sampler_accept(s, 5); /* no penalty configured: still plain */
    CHECK(sh_sampler_plain_greedy(s));
    sh_sampler_destroy(s);
    p.repeat_penalty = 1.3f;
    s = make(V, &p);
    CHECK(sh_sampler_plain_greedy(s)); /* nothing in the window yet */
    sh_sampler_accept(s, 5);
    CHECK(!sh_sampler_plain_greedy(s));
    sh_sampler_destroy(s);
    p = greedy();
    p.n_logprobs = 2;
    s = make(V, &p);
    CHECK(!sh_sampler_plain_greedy(s));
    sh_sampler_destroy(s);
    p = greedy();
    sh_logit_bias b = {3, 1.0f};
    p.bias = &b;
    p.n_bias = 1;
    s = make(V, &p);
    CHECK(!sh_sampler_plain_greedy(s));
    sh_sampler_destroy(s);
    p = sh_sampler_params_default(); /* temperature 1 */
    s = make(V, &p);
    CHECK(!sh_sampler_plain_greedy(s));
    sh_sampler_destroy(s);
    /* every value -inf or NaN: no pick */
    float bad[3] = {-INFINITY, NAN, -INFINITY};
    sh_sampler_top1(bad, 3, &id, &mx, &sum);
    CHECK_INT_EQ(id, -1);
    CHECK(sum == 0.0);
}

/* The multiplicative penalty (llama.cpp's repeat_penalty, vLLM's repetition_penalty) with
 * frequency and presence penalties, at temperature 1 over a window long enough to hold every
 * token (vLLM's prompt + output): the final distribution equals a reference computed here. */
static void test_penalty_distribution(void)
{
    const float lg[6] = {1.5f, -0.5f, 0.7f, 2.0f, -2.0f, 0.0f};
    const int32_t seen[] = {3, 1, 3, 4, 0, 3, 1};
    sh_sampler_params p = sh_sampler_params_default();
    p.repeat_penalty = 1.3f;
    p.frequency_penalty = 0.2f;
    p.presence_penalty = 0.1f;
    p.penalty_last_n = 1000;
    p.n_logprobs = 6;
    p.logprobs_mode = SH_LOGPROBS_FINAL;
    sh_sampler *s = make(6, &p);
    for (size_t i = 0; i < sizeof seen / sizeof seen[0]; i++)
        sh_sampler_accept(s, seen[i]);
    double ref[6], z = 0.0;
    for (int t = 0; t < 6; t++) {
        int c = 0;
        for (size_t i = 0; i < sizeof seen / sizeof seen[0]; i++)
            c += seen[i] == t;
        double v = lg[t];
        if (c) {
            v = v > 0 ? v / 1.3 : v * 1.3;
            v -= 0.2 * c + 0.1;
        }
        ref[t] = v;
        z += exp(v);
    }
    sh_sample r;
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.n_top, 6);
    for (int k = 0; k < r.n_top; k++) {
        int32_t t = r.top[k].id;
        CHECK_NEAR(r.top[k].logprob, ref[t] - log(z), 1e-5);
        CHECK_NEAR(r.top[k].logprob_raw,
                   lg[t] - log(exp(1.5) + exp(-0.5) + exp(0.7) + exp(2.0) + exp(-2.0) + 1.0), 1e-5);
    }
    sh_sampler_destroy(s);
    // A window of 2 sees only the last two tokens (3, 1): token 4 is no longer penalised.
    p.penalty_last_n = 2;
    s = make(6, &p);
    for (size_t i = 0; i < sizeof seen / sizeof seen[0]; i++)
        sh_sampler_accept(s, seen[i]);
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    double z2 = 0.0, v4 = lg[4];
    for (int t = 0; t < 6; t++) {
        double v = lg[t];
        if (t == 3 || t == 1)
            v = (v > 0 ? v / 1.3 : v * 1.3) - 0.2 - 0.1;
        z2 += exp(v);
    }
    for (int k = 0; k < r.n_top; k++)
        if (r.top[k].id == 4)
            CHECK_NEAR(r.top[k].logprob, v4 - log(z2), 1e-5);
    sh_sampler_destroy(s);
}

/* Locally typical sampling keeps, in order of |surprisal - entropy|, the shortest set whose mass
 * exceeds typical_p (llama.cpp's rule), computed here by a direct reference. */
static void test_typical_p(void)
{
    const float lg[8] = {3.0f, 2.2f, 2.0f, 1.0f, 0.5f, 0.0f, -1.0f, -3.0f};
    const float ps[3] = {0.3f, 0.6f, 0.9f};
    for (int c = 0; c < 3; c++) {
        // Reference.
        double q[8], z = 0.0, h = 0.0, d[8];
        int order[8];
        for (int t = 0; t < 8; t++)
            z += exp(lg[t]);
        for (int t = 0; t < 8; t++) {
            q[t] = exp(lg[t]) / z;
            h -= q[t] * log(q[t]);
        }
        for (int t = 0; t < 8; t++) {
            d[t] = fabs(-log(q[t]) - h);
            order[t] = t;
        }
        for (int a = 0; a < 8; a++) // insertion sort by distance, ties by id
            for (int b = a; b > 0 && (d[order[b]] < d[order[b - 1]] ||
                                      (d[order[b]] == d[order[b - 1]] && order[b] < order[b - 1]));
                 b--) {
                int x = order[b];
                order[b] = order[b - 1];
                order[b - 1] = x;
            }
        bool keep[8] = {false};
        double cum = 0.0, kept = 0.0;
        for (int k = 0; k < 8; k++) {
            keep[order[k]] = true;
            kept += q[order[k]];
            cum += q[order[k]];
            if (cum > ps[c])
                break;
        }
        sh_sampler_params p = sh_sampler_params_default();
        p.typical_p = ps[c];
        p.n_logprobs = 8;
        p.logprobs_mode = SH_LOGPROBS_RAW;
        p.seed = 11;
        sh_sampler *s = make(8, &p);
        sh_sample r;
        CHECK_OK(sh_sampler_sample(s, lg, &r));
        CHECK_INT_EQ(r.n_top, 8);
        for (int k = 0; k < 8; k++) {
            int32_t t = r.top[k].id;
            if (keep[t])
                CHECK_NEAR(r.top[k].logprob, log(q[t] / kept), 1e-4);
            else
                CHECK(r.top[k].logprob == -INFINITY);
        }
        // Draws stay inside the kept set.
        int hist[8];
        histogram(s, lg, 500, hist, 8);
        for (int t = 0; t < 8; t++)
            if (!keep[t])
                CHECK_INT_EQ(hist[t], 0);
        sh_sampler_destroy(s);
    }
    // The most likely token is not typical of a flat-tailed distribution: p = 0.3 drops it.
    sh_sampler_params p = sh_sampler_params_default();
    p.typical_p = 0.3f;
    sh_sampler *s = make(8, &p);
    int hist[8];
    histogram(s, lg, 300, hist, 8);
    CHECK_INT_EQ(hist[0], 0);
    sh_sampler_destroy(s);
}

/* A ban (end-of-sequence before min_tokens) masks its ids like a -inf bias, for greedy and
 * sampled draws, and is lifted by an empty one; a banned sampler is not plain greedy. */
static void test_ban(void)
{
    const float lg[4] = {3.0f, 1.0f, 2.5f, 0.0f};
    const int32_t eos[2] = {0, 99}; // 99 is outside the vocabulary: skipped
    sh_sampler_params p = greedy();
    sh_sampler *s = make(4, &p);
    sh_sample r;
    CHECK(sh_sampler_plain_greedy(s));
    sh_sampler_set_ban(s, eos, 2);
    CHECK(!sh_sampler_plain_greedy(s));
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 2);
    double z = exp(1.0) + exp(2.5) + exp(0.0);
    CHECK_NEAR(r.logprob, 2.5 - log(z), 1e-5); // the final distribution without token 0
    sh_sampler_set_ban(s, NULL, 0);
    CHECK(sh_sampler_plain_greedy(s));
    CHECK_OK(sh_sampler_sample(s, lg, &r));
    CHECK_INT_EQ(r.id, 0);
    sh_sampler_destroy(s);
    p = sh_sampler_params_default();
    p.seed = 5;
    s = make(4, &p);
    sh_sampler_set_ban(s, eos, 1);
    int hist[4];
    histogram(s, lg, 2000, hist, 4);
    CHECK_INT_EQ(hist[0], 0);
    CHECK(hist[2] > hist[1]);
    const int32_t all[4] = {0, 1, 2, 3};
    sh_sampler_set_ban(s, all, 4);
    CHECK_INT_EQ(sh_sampler_sample(s, lg, &r), SH_ERANGE);
    sh_sampler_destroy(s);
}

static void test_bad_params(void)
{
    sh_sampler *s = (sh_sampler *)1;
    sh_error e = {0};
    sh_sampler_params p = sh_sampler_params_default();
    CHECK_INT_EQ(sh_sampler_create(0, &p, &s, &e), SH_EINVAL);
    CHECK(s == NULL);
    p.top_p = 1.5f;
    CHECK_INT_EQ(sh_sampler_create(10, &p, &s, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "top_p") != NULL);
    p = sh_sampler_params_default();
    p.temperature = NAN;
    CHECK_INT_EQ(sh_sampler_create(10, &p, &s, &e), SH_EINVAL);
    p = sh_sampler_params_default();
    sh_logit_bias b = {10, 1.0f};
    p.bias = &b;
    p.n_bias = 1;
    CHECK_INT_EQ(sh_sampler_create(10, &p, &s, &e), SH_EINVAL);
    p = sh_sampler_params_default();
    p.n_logprobs = SH_SAMPLER_MAX_LOGPROBS + 1;
    CHECK_INT_EQ(sh_sampler_create(10, &p, &s, &e), SH_EINVAL);
    p = sh_sampler_params_default();
    p.typical_p = 0.0f;
    CHECK_INT_EQ(sh_sampler_create(10, &p, &s, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "typical_p") != NULL);
    sh_sampler_destroy(NULL);
}

static const sh_test_case tests[] = {
    {"greedy_and_raw_logprob", test_greedy_and_raw_logprob},
    {"logit_bias", test_logit_bias},
    {"repeat_penalty", test_repeat_penalty},
    {"frequency_presence_window", test_frequency_presence_window},
    {"top_p", test_top_p},
    {"min_p_and_top_k", test_min_p_and_top_k},
    {"temperature", test_temperature},
    {"seed_reproducible", test_seed_reproducible},
    {"logprobs_lists", test_logprobs_lists},
    {"large_vocab_selection", test_large_vocab_selection},
    {"plain_greedy", test_plain_greedy},
    {"penalty_distribution", test_penalty_distribution},
    {"typical_p", test_typical_p},
    {"ban", test_ban},
    {"bad_params", test_bad_params},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
