/* Speculative decoding's parts that know no actors and no files: the n-gram proposer (lookup in a
 * sequence's own tokens, then in a bounded pool shared by a model's requests), verification of
 * drafted tokens against the target's rows of logits, and the choice of a draft length from the
 * measured cost of a k-row forward pass and a sequence's recent acceptance. `shoal run`, the stage
 * (verification) and the batcher (proposals, draft lengths) use them. */
#ifndef SH_MODEL_SPEC_H
#define SH_MODEL_SPEC_H

#include <stdbool.h>
#include <stdint.h>

#include "model/sampler.h"
#include "shoal/err.h"

#define SH_SPEC_MAX_K 16     /* most drafted tokens verified in one step */
#define SH_SPEC_DEFAULT_K 8  /* --spec-k when not given */
#define SH_SPEC_NGRAM_MAX 4  /* longest suffix the lookup matches */
#define SH_SPEC_NGRAM_MIN 2  /* shortest: a single token matches too often to pay */
#define SH_SPEC_PATH_MAX 512 /* bytes of a draft model's path, with its NUL */

typedef enum sh_spec_kind {
    SH_SPEC_OFF = 0,
    SH_SPEC_NGRAM, /* prompt and output lookup, then the shared pool */
    SH_SPEC_DRAFT, /* a smaller model with the same vocabulary drafts greedily */
    SH_SPEC_SELF,  /* the target's first `layers` layers and its output head draft greedily */
} sh_spec_kind;

/* What `--spec` and `--spec-k` (and the same fields of cluster scripts and the C API) ask for. */
typedef struct sh_spec_opts {
    sh_spec_kind kind;
    int32_t k;                   /* most drafted tokens per step, 1..SH_SPEC_MAX_K */
    int32_t layers;              /* SH_SPEC_SELF: the draft's layers, 1..n_layers - 1 */
    char path[SH_SPEC_PATH_MAX]; /* SH_SPEC_DRAFT: the draft model's file */
} sh_spec_opts;

/* Parses a `--spec` value, "off", "ngram", "draft:PATH" or "self:LAYERS", and a `--spec-k` value
 * (k <= 0 in `k_text` NULL means the default), into *out. Returns SH_EINVAL with e naming the bad
 * part (an unknown kind, an empty or too long path, LAYERS not a positive integer, k not an
 * integer in 1..SH_SPEC_MAX_K); *out is then all off. Checking LAYERS against the model and the
 * draft's file and vocabulary is the loader's. Any thread. */
sh_err sh_spec_parse(const char *spec, const char *k_text, sh_spec_opts *out, sh_error *e);

/* The name of a kind as --spec spells it ("off", "ngram", "draft", "self"). */
const char *sh_spec_kind_name(sh_spec_kind k);

/* ---- n-gram proposals --------------------------------------------------------------------- */

/* A bounded pool of n-gram continuations shared by the requests of one model: for each suffix of
 * SH_SPEC_NGRAM_MAX tokens seen (hashed), the up to SH_SPEC_MAX_K tokens that followed it last.
 * Entries are replaced on hash collision, so the pool never grows. Not thread-safe: one owner
 * (the batcher's loop, or `shoal run`'s thread). */
typedef struct sh_spec_pool sh_spec_pool;

/* Creates a pool of `entries` slots (at least 1; each about 80 bytes). SH_EINVAL, SH_ENOMEM. */
sh_err sh_spec_pool_create(int32_t entries, sh_spec_pool **out, sh_error *e);
void sh_spec_pool_destroy(sh_spec_pool *p); /* accepts NULL */

/* Records the n-grams of toks[0..n) whose continuation ends at or after `from` (pass the count
 * recorded last time, so that repeated calls over a growing sequence add each n-gram once). */
void sh_spec_pool_add(sh_spec_pool *p, const int32_t *toks, int32_t n, int32_t from);

/* Proposes up to k (<= SH_SPEC_MAX_K) tokens to follow hist[0..n): the tokens that followed the
 * most recent earlier occurrence of the longest suffix of hist (SH_SPEC_NGRAM_MAX down to
 * SH_SPEC_NGRAM_MIN tokens) within hist itself, else the pool's continuation of the last
 * SH_SPEC_NGRAM_MAX tokens (pool may be NULL). Writes them to out and returns how many (0: no
 * proposal). Reads at most the last `window` tokens of hist for the lookup (0: all). */
int32_t sh_spec_ngram_propose(const int32_t *hist, int32_t n, const sh_spec_pool *pool, int32_t k,
                              int32_t window, int32_t *out);

/* ---- verification ------------------------------------------------------------------------- */

/* Verifies n_draft drafted tokens against n_draft + 1 rows of the target's logits (row j follows
 * the sequence with the first j drafts appended): row j is sampled with s, which takes the token
 * into its penalty window (sh_sampler_accept); while the sampled token equals draft[j] the next
 * row is sampled, else verification stops. Writes the samples to out[0..*n_out) (1 <= *n_out <=
 * n_draft + 1: the accepted drafts, then the target's own token at the first mismatch or after the
 * last draft). Every proposer here is deterministic given the sequence, so this sampling-and-
 * comparing is the rejection-sampling rule for a draft that puts all its mass on one token: a
 * drafted token is kept with probability p(token), and the token that replaces a rejected one is
 * drawn from p with the rejected token removed; the output's distribution is the target's. With
 * greedy sampling the output is exactly what one-token steps would give. Returns SH_OK, or
 * SH_ERANGE when a row has every token banned (out[0..*n_out) hold the samples before it, already
 * accepted into s). */
sh_err sh_spec_verify(sh_sampler *s, const float *logits, int32_t n_vocab, const int32_t *draft,
                      int32_t n_draft, sh_sample *out, int32_t *n_out);

/* ---- draft lengths ------------------------------------------------------------------------ */

/* The cost of a forward pass by its rows, relative to one row: measured (calibration, or steps
 * observed while serving) and interpolated between measured points. Points without a measurement
 * use a prior that makes extra rows cost 10% each, so that speculation starts cautious. */
#define SH_SPEC_COST_POINTS 24
typedef struct sh_spec_cost {
    int32_t rows[SH_SPEC_COST_POINTS]; /* 1..17, 24, 32, 48, 64, 128, 256, 512 */
    double us[SH_SPEC_COST_POINTS];    /* moving average of a pass's time; 0: not measured */
    int32_t seen[SH_SPEC_COST_POINTS]; /* measurements taken (saturating) */
} sh_spec_cost;

void sh_spec_cost_init(sh_spec_cost *c);
/* Adds one pass of `rows` rows that took `us` microseconds to the nearest point's average. */
void sh_spec_cost_observe(sh_spec_cost *c, int32_t rows, double us);
/* The time of a pass of `rows` rows divided by that of one row (>= 1 by construction for rows
 * >= 1). */
double sh_spec_cost_ratio(const sh_spec_cost *c, int32_t rows);

/* A sequence's speculation state: how often its drafts were accepted lately and the draft
 * length to use next. Embedded, init/fini-free. */
typedef struct sh_spec_seq {
    double accept;     /* per-token acceptance, 0..1: succ / (succ + fail) */
    double succ, fail; /* recent drafted tokens kept, and rejections, decayed by 0.8 a run */
    int32_t k;         /* the draft length chosen for the next step (0: do not draft) */
    int32_t idle;      /* steps since the last draft, for a retry after backing off */
    int32_t probe;     /* idle steps before that retry: 16, doubled (to 256) per probe made at
                          high acceptance, back to 16 once a draft is chosen */
    uint64_t drafts;   /* steps that verified drafts */
    uint64_t drafted;  /* tokens drafted */
    uint64_t accepted; /* drafted tokens accepted */
} sh_spec_seq;

/* Starts a sequence's state with an optimistic acceptance (so that the first drafts are tried). */
void sh_spec_seq_init(sh_spec_seq *q);
/* Takes the outcome of one verification: n_draft tokens drafted, n_accepted of them accepted. */
void sh_spec_seq_update(sh_spec_seq *q, int32_t n_draft, int32_t n_accepted);

/* The draft length that maximizes the expected tokens per unit of time of a step of `batch_rows`
 * rows (one per sequence, this one's included) when this sequence adds k drafts: with per-token
 * acceptance a they yield (1 - a^(k+1)) / (1 - a) tokens instead of 1, and the step costs the
 * ratio of batch_rows + k rows over batch_rows rows.
 * Returns 0 (no draft) when no k in 1..kmax beats plain decode, which is what happens once the
 * batch is big enough that extra rows cost as much as they bring. */
int32_t sh_spec_choose_k(const sh_spec_cost *c, double accept, int32_t kmax, int32_t batch_rows);

/* Updates q->k for the next step with sh_spec_choose_k, and, when it says 0 while q->idle has
 * reached q->probe steps (16), allows a single 1-token draft so that a sequence whose text turned
 * repetitive is noticed. A probe made while the acceptance is already 0.9 or more cannot show a
 * better one, since the cost is what keeps drafts off: the next waits twice as long (up to 256
 * steps; a model drafter's probe pays for passing the idle steps' tokens through it). Returns
 * q->k. */
int32_t sh_spec_seq_plan(sh_spec_seq *q, const sh_spec_cost *c, int32_t kmax, int32_t batch_rows);

#endif
