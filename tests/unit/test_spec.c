/* Unit tests of model/spec.c: --spec parsing, n-gram lookup and the shared pool, verification
 * (exact under greedy; under sampling, a chi-square test that the first verified token keeps the
 * target's distribution), and draft lengths from cost and acceptance. */
#include <math.h>
#include <string.h>

#include "model/spec.h"
#include "sh_test.h"

static void test_parse(void)
{
    sh_spec_opts o;
    sh_error e = {0};
    CHECK_OK(sh_spec_parse("ngram", NULL, &o, &e));
    CHECK_INT_EQ(o.kind, SH_SPEC_NGRAM);
    CHECK_INT_EQ(o.k, SH_SPEC_DEFAULT_K);
    CHECK_OK(sh_spec_parse("draft:/m/a.gguf", "5", &o, &e));
    CHECK_INT_EQ(o.kind, SH_SPEC_DRAFT);
    CHECK_STR_EQ(o.path, "/m/a.gguf");
    CHECK_INT_EQ(o.k, 5);
    CHECK_OK(sh_spec_parse("self:4", "16", &o, &e));
    CHECK_INT_EQ(o.kind, SH_SPEC_SELF);
    CHECK_INT_EQ(o.layers, 4);
    CHECK_OK(sh_spec_parse("off", NULL, &o, &e));
    CHECK_INT_EQ(o.kind, SH_SPEC_OFF);
    const char *bad_spec[] = {
        "", "ngrams", "draft:", "self:", "self:0", "self:-2", "self:3x", "draft"};
    for (size_t i = 0; i < sizeof bad_spec / sizeof *bad_spec; i++) {
        CHECK_INT_EQ(sh_spec_parse(bad_spec[i], NULL, &o, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "--spec") != NULL);
        CHECK_INT_EQ(o.kind, SH_SPEC_OFF);
    }
    const char *bad_k[] = {"0", "17", "-1", "", "4.5", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad_k / sizeof *bad_k; i++) {
        CHECK_INT_EQ(sh_spec_parse("ngram", bad_k[i], &o, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "--spec-k") != NULL);
    }
    CHECK_STR_EQ(sh_spec_kind_name(SH_SPEC_SELF), "self");
}

static void test_ngram_lookup(void)
{
    /* ... 5 6 7 8 9 ... then the suffix 6 7: the continuation of the latest "6 7" is 8 9 1. */
    const int32_t h[] = {1, 5, 6, 7, 8, 9, 1, 2, 3, 6, 7};
    int32_t out[SH_SPEC_MAX_K];
    int32_t n = sh_spec_ngram_propose(h, 11, NULL, 3, 0, out);
    CHECK_INT_EQ(n, 3);
    CHECK_INT_EQ(out[0], 8);
    CHECK_INT_EQ(out[1], 9);
    CHECK_INT_EQ(out[2], 1);
    /* The longest suffix wins over a more recent shorter match. */
    const int32_t h2[] = {4, 6, 7, 50, 51, 9, 6, 7, 60, 4, 6, 7};
    n = sh_spec_ngram_propose(h2, 12, NULL, 2, 0, out);
    CHECK_INT_EQ(n, 2);
    CHECK_INT_EQ(out[0], 50);
    CHECK_INT_EQ(out[1], 51);
    /* Continuations stop at the end of the history. */
    const int32_t h3[] = {3, 4, 3, 4};
    n = sh_spec_ngram_propose(h3, 4, NULL, 8, 0, out);
    CHECK_INT_EQ(n, 2);
    CHECK_INT_EQ(out[0], 3);
    CHECK_INT_EQ(out[1], 4);
    /* No match: nothing; a window that hides the match: nothing. */
    const int32_t h4[] = {1, 2, 3, 4, 5, 6};
    CHECK_INT_EQ(sh_spec_ngram_propose(h4, 6, NULL, 4, 0, out), 0);
    CHECK_INT_EQ(sh_spec_ngram_propose(h, 11, NULL, 3, 4, out), 0);
    CHECK_INT_EQ(sh_spec_ngram_propose(h, 11, NULL, 0, 0, out), 0);
    CHECK_INT_EQ(sh_spec_ngram_propose(h, 1, NULL, 4, 0, out), 0);
}

static void test_pool(void)
{
    sh_spec_pool *p = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(sh_spec_pool_create(0, &p, &e), SH_EINVAL);
    CHECK(p == NULL);
    CHECK_OK(sh_spec_pool_create(1024, &p, &e));
    /* One request's output, added as it grows. */
    const int32_t a[] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    int32_t recorded = 0;
    for (int32_t n = 1; n <= 11; n++) {
        sh_spec_pool_add(p, a, n, recorded);
        recorded = n;
    }
    /* Another request that ends in 10 11 12 13 is told 14 15 ... from the pool. */
    const int32_t b[] = {99, 98, 10, 11, 12, 13};
    int32_t out[SH_SPEC_MAX_K];
    int32_t n = sh_spec_ngram_propose(b, 6, p, 5, 0, out);
    CHECK_INT_EQ(n, 5);
    for (int32_t i = 0; i < 5; i++)
        CHECK_INT_EQ(out[i], 14 + i);
    /* Its own history wins where it has a match. */
    const int32_t c[] = {12, 13, 77, 1, 12, 13};
    n = sh_spec_ngram_propose(c, 6, p, 3, 0, out);
    CHECK_INT_EQ(n, 3);
    CHECK_INT_EQ(out[0], 77);
    /* A pool of one slot keeps only the latest gram and never grows. */
    sh_spec_pool *q = NULL;
    CHECK_OK(sh_spec_pool_create(1, &q, &e));
    sh_spec_pool_add(q, a, 11, 0);
    CHECK_INT_EQ(sh_spec_ngram_propose(b, 6, q, 5, 0, out), 0);
    const int32_t d[] = {5, 16, 17, 18, 19};
    CHECK_INT_EQ(sh_spec_ngram_propose(d, 5, q, 5, 0, out), 1);
    CHECK_INT_EQ(out[0], 20);
    sh_spec_pool_destroy(q);
    sh_spec_pool_destroy(p);
    sh_spec_pool_destroy(NULL);
}

static sh_sampler *make(int32_t n_vocab, float temp, uint64_t seed)
{
    sh_sampler_params sp = sh_sampler_params_default();
    sp.temperature = temp;
    sp.seed = seed;
    sh_sampler *s = NULL;
    sh_error e = {0};
    if (sh_sampler_create(n_vocab, &sp, &s, &e))
        fprintf(stderr, "sampler: %s\n", e.msg);
    return s;
}

static void test_verify_greedy(void)
{
    enum { V = 8 };
    /* Rows' argmaxes: 3, 5, 1, 6. */
    float lg[4][V] = {{0}};
    lg[0][3] = 2.0f;
    lg[1][5] = 2.0f;
    lg[2][1] = 2.0f;
    lg[3][6] = 2.0f;
    sh_sampler *s = make(V, 0.0f, 1);
    sh_sample out[4];
    int32_t n = 0;
    const int32_t all_good[3] = {3, 5, 1};
    CHECK_OK(sh_spec_verify(s, &lg[0][0], V, all_good, 3, out, &n));
    CHECK_INT_EQ(n, 4); /* three accepted and the bonus token */
    CHECK_INT_EQ(out[3].id, 6);
    const int32_t second_bad[3] = {3, 4, 1};
    CHECK_OK(sh_spec_verify(s, &lg[0][0], V, second_bad, 3, out, &n));
    CHECK_INT_EQ(n, 2);
    CHECK_INT_EQ(out[0].id, 3);
    CHECK_INT_EQ(out[1].id, 5); /* the target's token replaces the rejected draft */
    CHECK_OK(sh_spec_verify(s, &lg[0][0], V, NULL, 0, out, &n));
    CHECK_INT_EQ(n, 1);
    CHECK_INT_EQ(out[0].id, 3);
    /* A row with every token banned. */
    float banned[2][V];
    for (int i = 0; i < V; i++)
        banned[0][i] = banned[1][i] = -INFINITY;
    banned[0][2] = 1.0f;
    const int32_t d2[1] = {2};
    CHECK_INT_EQ(sh_spec_verify(s, &banned[0][0], V, d2, 1, out, &n), SH_ERANGE);
    CHECK_INT_EQ(n, 1);
    sh_sampler_destroy(s);
}

/* Under temperature 1, the first token verify emits must follow the target's softmax whatever the
 * draft proposes. 40000 draws over 6 tokens; chi-square with 5 degrees of freedom below 20.5
 * (p = 0.001), for a draft that is the likeliest token, an unlikely one and a mid one. */
static void test_verify_distribution(void)
{
    enum { V = 6, N = 40000 };
    const float row[V] = {1.5f, 0.2f, -0.7f, 0.9f, 0.0f, -2.0f};
    float lg[2][V];
    memcpy(lg[0], row, sizeof row);
    memcpy(lg[1], row, sizeof row);
    double p[V], z = 0;
    for (int i = 0; i < V; i++)
        z += exp(row[i]);
    for (int i = 0; i < V; i++)
        p[i] = exp(row[i]) / z;
    const int32_t drafts[3] = {0, 5, 3};
    for (int d = 0; d < 3; d++) {
        sh_sampler *s = make(V, 1.0f, 1234 + (uint64_t)d);
        long cnt[V] = {0};
        long accepted = 0;
        for (int i = 0; i < N; i++) {
            sh_sample out[2];
            int32_t n = 0;
            CHECK_OK(sh_spec_verify(s, &lg[0][0], V, &drafts[d], 1, out, &n));
            cnt[out[0].id]++;
            accepted += n == 2;
        }
        double chi = 0;
        for (int i = 0; i < V; i++) {
            double ex = p[i] * N;
            chi += (cnt[i] - ex) * (cnt[i] - ex) / ex;
        }
        fprintf(stderr, "draft %d: chi-square %.2f (5 dof, bound 20.5), accepted %.3f (p %.3f)\n",
                (int)drafts[d], chi, (double)accepted / N, p[drafts[d]]);
        CHECK(chi < 20.5);
        /* The draft is kept with probability p(draft). */
        CHECK_NEAR((double)accepted / N, p[drafts[d]], 0.015);
        sh_sampler_destroy(s);
    }
}

static void test_cost_and_k(void)
{
    sh_spec_cost c;
    sh_spec_cost_init(&c);
    /* The prior: 10% a row. */
    CHECK_NEAR(sh_spec_cost_ratio(&c, 1), 1.0, 1e-9);
    CHECK_NEAR(sh_spec_cost_ratio(&c, 5), 1.4, 1e-9);
    /* Measured: 1 row 1000 us, 9 rows 1400 us, 17 rows 2200 us. */
    sh_spec_cost_observe(&c, 1, 1000);
    sh_spec_cost_observe(&c, 9, 1400);
    sh_spec_cost_observe(&c, 17, 2200);
    CHECK_NEAR(sh_spec_cost_ratio(&c, 9), 1.4, 1e-9);
    CHECK_NEAR(sh_spec_cost_ratio(&c, 5), 1.2, 1e-9);  /* between 1 and 9 */
    CHECK_NEAR(sh_spec_cost_ratio(&c, 13), 1.8, 1e-9); /* between 9 and 17 */
    CHECK(sh_spec_cost_ratio(&c, 40) > 2.2);           /* beyond: grows */
    sh_spec_cost_observe(&c, 1, NAN);
    sh_spec_cost_observe(&c, 0, 5);
    CHECK_NEAR(sh_spec_cost_ratio(&c, 9), 1.4, 1e-9);
    /* High acceptance on cheap rows drafts long; no acceptance never drafts. */
    int32_t k_hi = sh_spec_choose_k(&c, 0.9, 16, 1);
    CHECK(k_hi >= 8);
    CHECK_INT_EQ(sh_spec_choose_k(&c, 0.0, 16, 1), 0);
    CHECK_INT_EQ(sh_spec_choose_k(&c, 0.05, 16, 1), 0);
    CHECK(sh_spec_choose_k(&c, 0.9, 3, 1) <= 3);
    /* A big batch where rows cost what they bring: no drafts. */
    sh_spec_cost lin;
    sh_spec_cost_init(&lin);
    for (int32_t r = 1; r <= 17; r++)
        sh_spec_cost_observe(&lin, r, 1000.0 * r);
    sh_spec_cost_observe(&lin, 32, 32000.0);
    sh_spec_cost_observe(&lin, 64, 64000.0);
    CHECK_INT_EQ(sh_spec_choose_k(&lin, 0.9, 16, 32), 0);
    /* A sequence that stops being accepted backs off, then probes with one token. */
    sh_spec_seq q;
    sh_spec_seq_init(&q);
    CHECK(sh_spec_seq_plan(&q, &c, 8, 1) > 0);
    for (int i = 0; i < 12; i++)
        sh_spec_seq_update(&q, q.k ? q.k : 1, 0);
    CHECK(q.accept < 0.05);
    int probes = 0;
    for (int i = 0; i < 32; i++)
        probes += sh_spec_seq_plan(&q, &c, 8, 1) > 0;
    CHECK_INT_EQ(probes, 2);
    CHECK_UINT_EQ(q.drafts, 12);
    CHECK_UINT_EQ(q.accepted, 0);
    /* One-token probes that are always kept raise the acceptance towards 1, so that they lead to
     * longer drafts (an estimate from run lengths would stay at 2/3). */
    for (int i = 0; i < 15; i++)
        sh_spec_seq_update(&q, 1, 1);
    CHECK(q.accept > 0.9);
    CHECK(sh_spec_choose_k(&c, q.accept, 8, 1) >= 4);
    /* A first rejection counts one failure, whatever the draft's length. */
    sh_spec_seq r;
    sh_spec_seq_init(&r);
    sh_spec_seq_update(&r, 8, 3);
    CHECK_NEAR(r.accept, (0.96 + 3.0) / (0.96 + 3.0 + 0.64 + 1.0), 1e-9);
    /* Kept probes where rows cost what they bring (a model drafter as dear as the target): the
     * acceptance is high and drafts still do not pay. Probes every 16 steps raise the
     * acceptance from the prior's 0.6 past 0.9 (at the fifth); from then on each probe waits
     * twice as long as the one before, up to 256 steps. */
    sh_spec_seq h;
    sh_spec_seq_init(&h);
    int32_t at[16], n_at = 0;
    for (int32_t i = 1; i <= 1000; i++)
        if (sh_spec_seq_plan(&h, &lin, 8, 1) > 0) {
            if (n_at < 16)
                at[n_at++] = i;
            sh_spec_seq_update(&h, 1, 1);
        }
    CHECK(h.accept > 0.9);
    static const int32_t want[] = {16, 32, 48, 64, 80, 112, 176, 304, 560, 816};
    CHECK_INT_EQ(n_at, 10);
    for (int32_t i = 0; i < n_at && i < 10; i++)
        CHECK_INT_EQ(at[i], want[i]);
    /* A draft chosen again starts the probes over at 16 steps. */
    CHECK(sh_spec_seq_plan(&h, &c, 8, 1) > 0);
    CHECK_INT_EQ(h.probe, 16);
}

static const sh_test_case tests[] = {
    {"parse", test_parse},
    {"ngram_lookup", test_ngram_lookup},
    {"pool", test_pool},
    {"verify_greedy", test_verify_greedy},
    {"verify_distribution", test_verify_distribution},
    {"cost_and_k", test_cost_and_k},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
