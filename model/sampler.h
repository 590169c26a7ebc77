/* Token sampling from a row of logits: greedy, temperature, top-k, top-p, min-p, penalties over a
 * recent-token window, logit bias, a seeded per-request RNG and top-n logprobs. */
#ifndef SH_MODEL_SAMPLER_H
#define SH_MODEL_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "shoal/err.h"

#define SH_SAMPLER_MAX_LOGPROBS 20 /* OpenAI's limit for top_logprobs */
#define SH_SAMPLER_MAX_BIAS 300    /* OpenAI's limit for logit_bias entries */

typedef struct sh_logit_bias {
    int32_t id;
    float bias; /* added to the logit; -INFINITY bans the token */
} sh_logit_bias;

/* Which distribution the top-n logprob list is ranked by. Every entry carries both values. */
typedef enum sh_logprobs_mode {
    SH_LOGPROBS_RAW = 0, /* log-softmax of the model's raw logits (what OpenAI reports) */
    SH_LOGPROBS_FINAL,   /* the distribution actually sampled from (after every transform) */
} sh_logprobs_mode;

/* Sampling parameters. The neutral value of each field disables it; start from
 * sh_sampler_params_default(). The transforms apply in this order:
 *   logit bias -> repetition/frequency/presence penalties -> (temperature 0: argmax) ->
 *   top-k -> temperature -> softmax -> typical-p -> top-p -> min-p -> draw.
 * Temperature comes before top-p and min-p (as in vLLM and OpenAI), so they cut the tempered
 * distribution. */
typedef struct sh_sampler_params {
    float temperature;       /* <= 0: greedy (argmax after bias and penalties); default 1 */
    int32_t top_k;           /* keep the k most likely; <= 0 or >= vocab: off */
    float top_p;             /* keep the smallest prefix whose mass reaches p; >= 1: off */
    float min_p;             /* keep tokens with p >= min_p * p_max; <= 0: off */
    float typical_p;         /* locally typical sampling (Meister et al., llama.cpp's): keep the
                              * tokens whose surprisal is nearest the entropy until their mass
                              * exceeds typical_p; >= 1: off; default 1 */
    float repeat_penalty;    /* llama.cpp's: positive logits / r, negative * r; 1: off */
    float frequency_penalty; /* OpenAI's: logit -= f * count in window; 0: off */
    float presence_penalty;  /* OpenAI's: logit -= p if present in window; 0: off */
    int32_t penalty_last_n;  /* window of recent accepted tokens the penalties see; 0: none */
    uint64_t seed;           /* the RNG seed; equal seeds give equal draws */
    int32_t n_logprobs;      /* top-n entries wanted, 0..SH_SAMPLER_MAX_LOGPROBS */
    sh_logprobs_mode logprobs_mode;
    const sh_logit_bias *bias; /* n_bias entries, copied at creation */
    int32_t n_bias;
} sh_sampler_params;

typedef struct sh_logprob {
    int32_t id;
    float logprob;     /* under the final distribution; -INFINITY when cut by top-k/p/min-p */
    float logprob_raw; /* log-softmax of the raw logits */
} sh_logprob;

/* One sampled token. With temperature 0 the "final distribution" is the softmax of the biased
 * and penalised logits at temperature 1, untruncated, so greedy still reports useful values. */
typedef struct sh_sample {
    int32_t id;
    float logprob;     /* of id under the final distribution */
    float logprob_raw; /* of id under the raw logits */
    int32_t n_top;     /* entries in top, ranked by params.logprobs_mode, best first */
    sh_logprob top[SH_SAMPLER_MAX_LOGPROBS];
} sh_sample;

typedef struct sh_sampler sh_sampler;

/* Defaults: temperature 1, everything else off, penalty window 64, seed 0. */
sh_sampler_params sh_sampler_params_default(void);

/* Creates a sampler for a vocabulary of n_vocab tokens, allocating all scratch now so sampling
 * never allocates. Copies params (bias included). Returns SH_EINVAL (naming the field) for a
 * non-positive vocabulary, a NaN or negative temperature, top_p/min_p outside [0, 1], typical_p
 * outside (0, 1], a
 * non-positive repeat penalty, a negative window, n_logprobs out of range, or a bias id outside
 * the vocabulary; SH_ENOMEM. *out is NULL on failure. The sampler belongs to one request and one
 * thread at a time. */
sh_err sh_sampler_create(int32_t n_vocab, const sh_sampler_params *params, sh_sampler **out,
                         sh_error *e);

/* Frees; accepts NULL. */
void sh_sampler_destroy(sh_sampler *s);

/* Forgets the penalty window and reseeds the RNG with `seed`. */
void sh_sampler_reset(sh_sampler *s, uint64_t seed);

/* Bans ids[0..n) (borrowed until the next call; ids outside the vocabulary are skipped) from the
 * next samples, as a logit bias of -inf would: for end-of-sequence tokens before a request's
 * min_tokens. n 0 lifts the ban. */
void sh_sampler_set_ban(sh_sampler *s, const int32_t *ids, int32_t n);

/* Appends a token (prompt or generated) to the penalty window; ids outside the vocabulary are
 * ignored. */
void sh_sampler_accept(sh_sampler *s, int32_t id);

/* Picks a token from `logits` (n_vocab floats, not modified) and fills *out. Does not accept the
 * token: call sh_sampler_accept with it. When every token is banned (all logits -INFINITY or
 * NaN after bias) returns SH_ERANGE and leaves *out with id -1. */
sh_err sh_sampler_sample(sh_sampler *s, const float *logits, sh_sample *out);

/* Whether sh_sampler_sample would now pick the row's first largest logit and report
 * logprob = logprob_raw = logit - log(sum(exp(logits))) and no top-n list: greedy (temperature
 * <= 0), no logprobs, no logit bias or ban, no penalty in effect. Such a sample needs only the
 * row's top-1 and log-sum-exp (sh_llama_batch.top1_only), which tensor-parallel ranks combine
 * without gathering the rows. */
bool sh_sampler_plain_greedy(const sh_sampler *s);

/* Over v[0..n): *id the first index of the largest value (-1 when all are -INFINITY or NaN),
 * *max that value and *sum the sum of exp(v[i] - *max) (NaN and -inf count 0; 0 when *id is -1),
 * with the same vectorized loops as the sampler's greedy path. */
void sh_sampler_top1(const float *v, int32_t n, int32_t *id, float *max, double *sum);

/* The next 32 random bits of the sampler's generator (exposed for tests). */
uint32_t sh_sampler_rand(sh_sampler *s);

#endif
