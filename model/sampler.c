/* Token sampler: logit transforms, truncation and a seeded draw, with scratch sized at creation. */
#include "model/sampler.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

struct sh_sampler {
    sh_sampler_params p;
    int32_t n_vocab;
    uint64_t rng;
    float *x;       // (n_vocab) working logits
    int32_t *idx;   // (n_vocab) candidate ids
    float *prob;    // (n_vocab) candidate probabilities, parallel to idx
    int32_t *idx2;  // (n_vocab) scratch ids for the raw top-n
    int32_t *count; // (n_vocab) occurrences of each id in the penalty window
    float *score;   // (n_vocab, typical_p only) typicality of each candidate, negated
    int32_t *tid;   // (n_vocab, typical_p only) scratch ids
    int32_t *ring;  // (penalty_last_n) the window, oldest at ring_head when full
    int32_t ring_len, ring_head;
    sh_logit_bias *bias; // (n_bias)
    const int32_t *ban;  // (n_ban) banned ids (sh_sampler_set_ban), borrowed
    int32_t n_ban;
};

sh_sampler_params sh_sampler_params_default(void)
{
    sh_sampler_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.typical_p = 1.0f;
    p.repeat_penalty = 1.0f;
    p.penalty_last_n = 64;
    return p;
}

/* splitmix64: a tiny generator with full 64-bit period; good enough for sampling and trivially
 * reproducible from a seed. */
static uint64_t next_u64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint32_t sh_sampler_rand(sh_sampler *s) { return (uint32_t)(next_u64(&s->rng) >> 32); }

/* Uniform in [0, 1) with 24 bits, exactly representable as a float. */
static float rand_unit(sh_sampler *s)
{
    return (float)(next_u64(&s->rng) >> 40) * (1.0f / 16777216.0f);
}

sh_err sh_sampler_create(int32_t n_vocab, const sh_sampler_params *params, sh_sampler **out,
                         sh_error *e)
{
    *out = NULL;
    sh_sampler_params p = params ? *params : sh_sampler_params_default();
    if (n_vocab <= 0)
        return sh__error_set(e, SH_EINVAL, "sampler: vocabulary size %d", (int)n_vocab);
    if (!(p.temperature >= 0.0f))
        return sh__error_set(e, SH_EINVAL, "sampler: temperature %g", (double)p.temperature);
    if (!(p.top_p >= 0.0f && p.top_p <= 1.0f))
        return sh__error_set(e, SH_EINVAL, "sampler: top_p %g not in [0, 1]", (double)p.top_p);
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
        return sh__error_set(e, SH_EINVAL, "sampler: min_p %g not in [0, 1]", (double)p.min_p);
    if (!(p.typical_p > 0.0f && p.typical_p <= 1.0f))
        return sh__error_set(e, SH_EINVAL, "sampler: typical_p %g not in (0, 1]",
                             (double)p.typical_p);
    if (!(p.repeat_penalty > 0.0f))
        return sh__error_set(e, SH_EINVAL, "sampler: repeat_penalty %g", (double)p.repeat_penalty);
    if (!isfinite(p.frequency_penalty) || !isfinite(p.presence_penalty))
        return sh__error_set(e, SH_EINVAL, "sampler: penalty not finite");
    if (p.penalty_last_n < 0)
        return sh__error_set(e, SH_EINVAL, "sampler: penalty_last_n %d", (int)p.penalty_last_n);
    if (p.n_logprobs < 0 || p.n_logprobs > SH_SAMPLER_MAX_LOGPROBS)
        return sh__error_set(e, SH_EINVAL, "sampler: n_logprobs %d not in [0, %d]",
                             (int)p.n_logprobs, SH_SAMPLER_MAX_LOGPROBS);
    if (p.n_bias < 0 || p.n_bias > SH_SAMPLER_MAX_BIAS || (p.n_bias > 0 && !p.bias))
        return sh__error_set(e, SH_EINVAL, "sampler: %d logit bias entries", (int)p.n_bias);
    for (int32_t i = 0; i < p.n_bias; i++)
        if (p.bias[i].id < 0 || p.bias[i].id >= n_vocab || isnan(p.bias[i].bias))
            return sh__error_set(e, SH_EINVAL, "sampler: logit bias id %d", (int)p.bias[i].id);

    sh_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return sh__error_set(e, SH_ENOMEM, "sampler: out of memory");
    size_t v = (size_t)n_vocab;
    s->x = malloc(v * sizeof *s->x);
    s->idx = malloc(v * sizeof *s->idx);
    s->prob = malloc(v * sizeof *s->prob);
    s->idx2 = malloc(v * sizeof *s->idx2);
    s->count = calloc(v, sizeof *s->count);
    s->ring = malloc(((size_t)p.penalty_last_n + 1) * sizeof *s->ring);
    s->bias = malloc(((size_t)p.n_bias + 1) * sizeof *s->bias);
    if (p.typical_p < 1.0f) {
        s->score = malloc(v * sizeof *s->score);
        s->tid = malloc(v * sizeof *s->tid);
    }
    if (!s->x || !s->idx || !s->prob || !s->idx2 || !s->count || !s->ring || !s->bias ||
        (p.typical_p < 1.0f && (!s->score || !s->tid))) {
        sh_sampler_destroy(s);
        return sh__error_set(e, SH_ENOMEM, "sampler: out of memory for vocabulary %d",
                             (int)n_vocab);
    }
    if (p.n_bias)
        memcpy(s->bias, p.bias, (size_t)p.n_bias * sizeof *s->bias);
    p.bias = s->bias;
    s->p = p;
    s->n_vocab = n_vocab;
    s->rng = p.seed;
    *out = s;
    return SH_OK;
}

void sh_sampler_destroy(sh_sampler *s)
{
    if (!s)
        return;
    free(s->x);
    free(s->idx);
    free(s->prob);
    free(s->idx2);
    free(s->count);
    free(s->score);
    free(s->tid);
    free(s->ring);
    free(s->bias);
    free(s);
}

void sh_sampler_reset(sh_sampler *s, uint64_t seed)
{
    for (int32_t i = 0; i < s->ring_len; i++)
        s->count[s->ring[i]] = 0;
    s->ring_len = s->ring_head = 0;
    s->rng = seed;
}

void sh_sampler_set_ban(sh_sampler *s, const int32_t *ids, int32_t n)
{
    s->ban = n > 0 ? ids : NULL;
    s->n_ban = n > 0 ? n : 0;
}

void sh_sampler_accept(sh_sampler *s, int32_t id)
{
    int32_t w = s->p.penalty_last_n;
    if (id < 0 || id >= s->n_vocab || w == 0)
        return;
    if (s->ring_len < w) {
        s->ring[s->ring_len++] = id;
    } else { // full: the slot at ring_head is the oldest; replace it
        s->count[s->ring[s->ring_head]]--;
        s->ring[s->ring_head] = id;
        s->ring_head = (s->ring_head + 1) % w;
    }
    s->count[id]++;
}

/* Rearranges ids[0..n) so that ids[0..m) are the m largest by val[], sorted descending (ties by
 * lower id, so results do not depend on the partition order). Quickselect, then a sort of the
 * prefix only: O(n + m log m). */
static float key(const float *val, int32_t i) { return isnan(val[i]) ? -INFINITY : val[i]; }

/* A strict total order (NaN ranks as -inf, ties broken by id) so that quickselect terminates. */
static int better(const float *val, int32_t a, int32_t b)
{
    float va = key(val, a), vb = key(val, b);
    return va > vb || (va == vb && a < b);
}

static _Thread_local const float *tl_val; // qsort has no context argument

static int cmp_desc(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return better(tl_val, a, b) ? -1 : better(tl_val, b, a) ? 1 : 0;
}

static void select_top(int32_t *ids, int32_t n, int32_t m, const float *val)
{
    if (m <= 0)
        return;
    if (m > n)
        m = n;
    int32_t lo = 0, hi = n - 1, k = m - 1;
    while (lo < hi) { // Hoare-style partition around the median of three, ordering by better()
        int32_t mid = lo + (hi - lo) / 2, a = ids[lo], b = ids[mid], c = ids[hi], piv;
        if (better(val, a, b))
            piv = better(val, b, c) ? b : (better(val, a, c) ? c : a);
        else
            piv = better(val, a, c) ? a : (better(val, b, c) ? c : b);
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (better(val, ids[i], piv))
                i++;
            while (better(val, piv, ids[j]))
                j--;
            if (i <= j) {
                int32_t t = ids[i];
                ids[i++] = ids[j];
                ids[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    tl_val = val;
    qsort(ids, (size_t)m, sizeof *ids, cmp_desc);
}

/* exp(t) for t <= 0, within about 2 float ulps, written so that the compiler vectorizes the loops
 * that call it (the vocabulary-wide sums below are most of a greedy sample's time with libm's
 * scalar exp). Cody-Waite reduction t = k ln2 + r, |r| <= ln2/2, a degree-6 polynomial for
 * exp(r), and 2^k built in the exponent bits. Below -87 (or for -inf and NaN) it returns 0. */
static inline __attribute__((always_inline)) float exp_nonpos(float t)
{
    float ok = t >= -87.0f ? 1.0f : 0.0f; /* NaN compares false */
    t = t >= -87.0f ? t : -87.0f;
    float k = (t * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = t - k * 0.693145752f - k * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f +
                                                  r * (4.1666667e-2f +
                                                       r * (8.3333333e-3f + r * 1.3888889e-3f)))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * ok;
}

/* The vocabulary-wide loops: 16 running lanes per loop (lane j takes elements j, j + 16, ...),
 * combined in a fixed order at the end, so the compiler can vectorize them without reassociating
 * anything and every instruction set gives the same result. They are compiled twice, for
 * AVX-512 and for the baseline, and picked at run time from cpuid (no ifunc, which sanitizer
 * runtimes cannot run before they start). */
#define VOCAB_LOOPS(SFX, ATTR)                                                                     \
    /* The largest of v[0..n) (NaN never wins) and its first index; -1 when none is finite. */     \
    ATTR static int32_t arg_max_##SFX(const float *v, int32_t n, float *max)                       \
    {                                                                                              \
        float lane[16];                                                                            \
        for (int j = 0; j < 16; j++)                                                               \
            lane[j] = -INFINITY;                                                                   \
        int32_t i = 0;                                                                             \
        for (; i + 16 <= n; i += 16)                                                               \
            for (int j = 0; j < 16; j++)                                                           \
                lane[j] = v[i + j] > lane[j] ? v[i + j] : lane[j];                                 \
        float mx = -INFINITY;                                                                      \
        for (; i < n; i++)                                                                         \
            mx = v[i] > mx ? v[i] : mx;                                                            \
        for (int j = 0; j < 16; j++)                                                               \
            mx = lane[j] > mx ? lane[j] : mx;                                                      \
        *max = mx;                                                                                 \
        if (mx == -INFINITY)                                                                       \
            return -1;                                                                             \
        for (i = 0; i < n; i++)                                                                    \
            if (v[i] == mx)                                                                        \
                return i;                                                                          \
        return -1;                                                                                 \
    }                                                                                              \
    /* sum(exp(v[i] - mx)) over v[0..n) (NaN and -inf count 0), mx >= every v[i]; out (may be      \
     * NULL) receives each term. Lane sums per block of 256, each block added in double. */        \
    ATTR static double sum_exp_##SFX(const float *v, int32_t n, float mx, float *out)              \
    {                                                                                              \
        double sum = 0.0;                                                                          \
        for (int32_t b = 0; b < n; b += 256) {                                                     \
            const int32_t e = n - b < 256 ? n : b + 256;                                           \
            float lane[16] = {0};                                                                  \
            int32_t i = b;                                                                         \
            for (; i + 16 <= e; i += 16) {                                                         \
                float x[16];                                                                       \
                for (int j = 0; j < 16; j++)                                                       \
                    x[j] = exp_nonpos(v[i + j] - mx);                                              \
                for (int j = 0; j < 16; j++)                                                       \
                    lane[j] += x[j];                                                               \
                if (out)                                                                           \
                    memcpy(out + i, x, sizeof x);                                                  \
            }                                                                                      \
            for (; i < e; i++) {                                                                   \
                float x = exp_nonpos(v[i] - mx);                                                   \
                lane[(i - b) % 16] += x;                                                           \
                if (out)                                                                           \
                    out[i] = x;                                                                    \
            }                                                                                      \
            float part = 0.0f;                                                                     \
            for (int j = 0; j < 16; j++)                                                           \
                part += lane[j];                                                                   \
            sum += part;                                                                           \
        }                                                                                          \
        return sum;                                                                                \
    }

VOCAB_LOOPS(base, )
#if defined(__x86_64__) && defined(__GNUC__)
VOCAB_LOOPS(avx512, __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))))

static bool vocab_avx512(void)
{
    static _Atomic int have; /* 0 unknown, 1 no, 2 yes; a race only recomputes the same answer */
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (!h) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
                ? 2
                : 1;
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h == 2;
}

static int32_t arg_max(const float *v, int32_t n, float *max)
{
    return vocab_avx512() ? arg_max_avx512(v, n, max) : arg_max_base(v, n, max);
}

static double sum_exp(const float *v, int32_t n, float mx, float *out)
{
    return vocab_avx512() ? sum_exp_avx512(v, n, mx, out) : sum_exp_base(v, n, mx, out);
}
#else
#define arg_max arg_max_base
#define sum_exp sum_exp_base
#endif

/* log(sum(exp(v - max))) + max over the raw logits (NaN skipped): the log-softmax normaliser. */
static double log_sum_exp(const float *v, int32_t n)
{
    float mx;
    if (arg_max(v, n, &mx) < 0)
        return -INFINITY;
    return mx + log(sum_exp(v, n, mx, NULL));
}

static void apply_bias_and_penalties(sh_sampler *s)
{
    float *x = s->x;
    for (int32_t i = 0; i < s->p.n_bias; i++)
        x[s->bias[i].id] += s->bias[i].bias;
    for (int32_t i = 0; i < s->n_ban; i++)
        if (s->ban[i] >= 0 && s->ban[i] < s->n_vocab)
            x[s->ban[i]] = -INFINITY;
    const sh_sampler_params *p = &s->p;
    if (p->repeat_penalty == 1.0f && p->frequency_penalty == 0.0f && p->presence_penalty == 0.0f)
        return;
    // Each distinct id in the window is penalised once: its count is negated while visited.
    for (int32_t i = 0; i < s->ring_len; i++) {
        int32_t id = s->ring[i], c = s->count[id];
        if (c <= 0)
            continue;
        float v = x[id];
        v = v > 0.0f ? v / p->repeat_penalty : v * p->repeat_penalty;
        x[id] = v - (float)c * p->frequency_penalty - p->presence_penalty;
        s->count[id] = -c;
    }
    for (int32_t i = 0; i < s->ring_len; i++)
        if (s->count[s->ring[i]] < 0)
            s->count[s->ring[i]] = -s->count[s->ring[i]];
}

/* Fills prob[0..n) = exp(x[idx[j]] - max) and returns their sum. identity: idx[j] == j for all
 * j (nothing selected yet), which lets the vectorized sum do it. */
static double exp_candidates(sh_sampler *s, int32_t n, bool identity)
{
    if (identity) {
        float mx;
        if (arg_max(s->x, n, &mx) < 0)
            return 0.0;
        return sum_exp(s->x, n, mx, s->prob);
    }
    float mx = -INFINITY;
    for (int32_t j = 0; j < n; j++)
        if (s->x[s->idx[j]] > mx)
            mx = s->x[s->idx[j]];
    double sum = 0.0;
    for (int32_t j = 0; j < n; j++) {
        s->prob[j] = expf(s->x[s->idx[j]] - mx);
        sum += s->prob[j];
    }
    return sum;
}

/* Top-p over the candidates: finds the smallest prefix of the descending order whose mass reaches
 * top_p. Sorting the whole vocabulary per token is wasteful, so it selects the top 64, then 4x
 * more, until the prefix holds the mass. Returns the new candidate count; idx/prob sorted. */
static int32_t cut_top_p(sh_sampler *s, int32_t n, double sum, bool sorted)
{
    double target = (double)s->p.top_p * sum;
    int32_t m = sorted ? n : (n < 64 ? n : 64);
    for (;;) {
        if (!sorted) {
            select_top(s->idx, n, m, s->x);
            exp_candidates(s, m, false); // same max as over all n: the best is in the prefix
        }
        double cum = 0.0;
        for (int32_t j = 0; j < m; j++) {
            cum += s->prob[j];
            if (cum >= target)
                return j + 1;
        }
        if (m == n)
            return n; // rounding: keep everything
        m = m > n / 4 ? n : m * 4;
    }
}

/* Locally typical sampling over the candidates idx/prob[0..n) (prob relative, summing to sum):
 * with H the entropy of the candidate distribution, ranks candidates by |-log p - H| (nearest
 * first) and keeps the shortest prefix of that order whose mass exceeds typical_p, as llama.cpp
 * does. Returns the new count; the kept candidates are in that order (not by probability). */
static int32_t cut_typical(sh_sampler *s, int32_t n, double sum)
{
    double h = 0.0;
    for (int32_t j = 0; j < n; j++) {
        double q = s->prob[j] / sum;
        if (q > 0.0)
            h -= q * log(q);
    }
    for (int32_t j = 0; j < n; j++) {
        double q = s->prob[j] / sum;
        s->score[j] = q > 0.0 ? (float)-fabs(-log(q) - h) : -INFINITY; // nearest ranks first
        s->idx2[j] = j;
    }
    select_top(s->idx2, n, n, s->score);
    double target = (double)s->p.typical_p, cum = 0.0;
    int32_t keep = n;
    for (int32_t t = 0; t < n; t++) {
        cum += s->prob[s->idx2[t]] / sum;
        if (cum > target) {
            keep = t + 1;
            break;
        }
    }
    for (int32_t t = 0; t < keep; t++) {
        s->tid[t] = s->idx[s->idx2[t]];
        s->score[t] = s->prob[s->idx2[t]];
    }
    memcpy(s->idx, s->tid, (size_t)keep * sizeof *s->idx);
    memcpy(s->prob, s->score, (size_t)keep * sizeof *s->prob);
    return keep;
}

static float candidate_logprob(sh_sampler *s, int32_t n, double sum, int32_t id)
{
    for (int32_t j = 0; j < n; j++)
        if (s->idx[j] == id)
            return (float)log(s->prob[j] / sum);
    return -INFINITY;
}

/* Greedy without a FINAL-mode top-n list: one argmax and one vectorized sum over the vocabulary,
 * instead of a selection and two scalar exp passes. Same results as the general path. */
static sh_err sample_greedy(sh_sampler *s, const float *logits, const float *x, sh_sample *out)
{
    const sh_sampler_params *p = &s->p;
    int32_t V = s->n_vocab;
    float mx;
    int32_t id = arg_max(x, V, &mx);
    if (id < 0)
        return SH_ERANGE;
    double lsum = log(sum_exp(x, V, mx, NULL));
    out->id = id;
    out->logprob = (float)-lsum; /* the chosen token is the maximum: exp(0) / sum */
    // The raw normaliser is the same sum when nothing changed the logits.
    double lse = x == logits ? mx + lsum : log_sum_exp(logits, V);
    out->logprob_raw = (float)(logits[id] - lse);
    if (p->n_logprobs == 0)
        return SH_OK;
    int32_t want = p->n_logprobs < V ? p->n_logprobs : V;
    for (int32_t i = 0; i < V; i++)
        s->idx2[i] = i;
    select_top(s->idx2, V, want, logits); /* ranked by the raw logits (NaN last) */
    for (int32_t t = 0; t < want; t++) {
        int32_t j = s->idx2[t];
        float lp = x[j] == -INFINITY || isnan(x[j]) ? -INFINITY : (float)(x[j] - mx - lsum);
        out->top[t] = (sh_logprob){j, lp, (float)(logits[j] - lse)};
    }
    out->n_top = want;
    return SH_OK;
}

static bool plain_of(const sh_sampler *s)
{
    const sh_sampler_params *p = &s->p;
    return p->n_bias == 0 && s->n_ban == 0 &&
           (s->ring_len == 0 || (p->repeat_penalty == 1.0f && p->frequency_penalty == 0.0f &&
                                 p->presence_penalty == 0.0f));
}

bool sh_sampler_plain_greedy(const sh_sampler *s)
{
    return s->p.temperature <= 0.0f && s->p.n_logprobs == 0 && plain_of(s);
}

void sh_sampler_top1(const float *v, int32_t n, int32_t *id, float *max, double *sum)
{
    *id = arg_max(v, n, max);
    *sum = *id < 0 ? 0.0 : sum_exp(v, n, *max, NULL);
}

sh_err sh_sampler_sample(sh_sampler *s, const float *logits, sh_sample *out)
{
    const sh_sampler_params *p = &s->p;
    int32_t V = s->n_vocab;
    out->id = -1;
    out->n_top = 0;
    bool plain = plain_of(s);
    if (p->temperature <= 0.0f && (p->n_logprobs == 0 || p->logprobs_mode == SH_LOGPROBS_RAW)) {
        if (plain)
            return sample_greedy(s, logits, logits, out);
        memcpy(s->x, logits, (size_t)V * sizeof *s->x);
        apply_bias_and_penalties(s);
        return sample_greedy(s, logits, s->x, out);
    }
    memcpy(s->x, logits, (size_t)V * sizeof *s->x);
    apply_bias_and_penalties(s);
    for (int32_t i = 0; i < V; i++) {
        if (isnan(s->x[i]))
            s->x[i] = -INFINITY; // a NaN logit can never be picked
        s->idx[i] = i;
    }

    int32_t n = V;
    bool sorted = false;
    if (p->temperature <= 0.0f) {
        // Greedy: the final distribution is the processed logits at temperature 1, untruncated.
        select_top(s->idx, n, 1, s->x);
        if (s->x[s->idx[0]] == -INFINITY)
            return SH_ERANGE;
    } else {
        if (p->top_k > 0 && p->top_k < n) {
            select_top(s->idx, n, p->top_k, s->x);
            n = p->top_k;
            sorted = true;
        }
        float inv_t = 1.0f / p->temperature;
        for (int32_t j = 0; j < n; j++)
            s->x[s->idx[j]] *= inv_t;
    }
    double sum = exp_candidates(s, n, n == V && !sorted && p->temperature > 0.0f);
    if (!(sum > 0.0))
        return SH_ERANGE;
    if (p->temperature > 0.0f) {
        if (p->typical_p < 1.0f) {
            n = cut_typical(s, n, sum);
            sorted = false;
            // Relative to the largest kept candidate again (typicality may drop the most likely).
            sum = exp_candidates(s, n, false);
        }
        if (p->top_p < 1.0f) {
            n = cut_top_p(s, n, sum, sorted);
            sorted = true;
        }
        if (p->min_p > 0.0f) {
            // p_j >= min_p * p_max, i.e. exp(x_j - max) >= min_p since prob is relative to max.
            int32_t k = 0;
            for (int32_t j = 0; j < n; j++)
                if (s->prob[j] >= p->min_p) {
                    s->idx[k] = s->idx[j];
                    s->prob[k++] = s->prob[j];
                }
            n = k;
        }
        sum = 0.0;
        for (int32_t j = 0; j < n; j++)
            sum += s->prob[j];
        // The draw: walk the cumulative mass to the first candidate past u * sum.
        double r = (double)rand_unit(s) * sum, cum = 0.0;
        int32_t pick = n - 1;
        for (int32_t j = 0; j < n; j++) {
            cum += s->prob[j];
            if (r < cum) {
                pick = j;
                break;
            }
        }
        out->id = s->idx[pick];
        out->logprob = (float)log(s->prob[pick] / sum);
    } else {
        out->id = s->idx[0];
        out->logprob = (float)log(s->prob[0] / sum);
    }

    double lse = log_sum_exp(logits, V);
    out->logprob_raw = (float)(logits[out->id] - lse);
    if (p->n_logprobs == 0)
        return SH_OK;

    // Top-n list. In greedy mode the candidates are the whole vocabulary.
    int32_t want = p->n_logprobs;
    if (p->logprobs_mode == SH_LOGPROBS_FINAL) {
        // Rank the kept candidates by probability: reuse idx2 as positions into idx/prob.
        if (want > n)
            want = n;
        for (int32_t j = 0; j < n; j++)
            s->idx2[j] = j;
        select_top(s->idx2, n, want, s->prob);
        for (int32_t t = 0; t < want; t++) {
            int32_t j = s->idx2[t], id = s->idx[j];
            out->top[t] = (sh_logprob){id, (float)log(s->prob[j] / sum), (float)(logits[id] - lse)};
        }
    } else {
        if (want > V)
            want = V;
        for (int32_t i = 0; i < V; i++)
            s->idx2[i] = i;
        // Ranked by the caller's raw logits (NaN ranks last).
        select_top(s->idx2, V, want, logits);
        for (int32_t t = 0; t < want; t++) {
            int32_t id = s->idx2[t];
            out->top[t] =
                (sh_logprob){id, candidate_logprob(s, n, sum, id), (float)(logits[id] - lse)};
        }
    }
    out->n_top = want;
    return SH_OK;
}
