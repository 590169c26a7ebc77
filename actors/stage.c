/* The stage actor: runs its layers of each STEP (or ACT) as one batched forward pass on a worker
 * thread; a middle stage forwards the hidden states as ACT, the last samples the sequences that
 * want a token and answers STEP_DONE. */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "actors/actor_util.h"
#include "actors/hello.h"
#include "actors/serve.h"
#include "actors/stage_grammar.h"
#include "base/error.h"
#include "base/file.h"
#include "kernels/cpu/quant.h"
#include "model/sampler.h"
#include "model/spec.h"
#include "runtime/coll.h"
#include "runtime/fault_agent.h"
#include "runtime/mpack_write.h"
#include "runtime/msg.h"
#include "runtime/peers.h"
#include "runtime/proto.h"

#define STAGE_ARENA_BYTES (4u << 20) /* decoded step_seq entries, bias lists, stop strings */
#define STAGE_QUEUE_INIT 16          /* kept STEPs before the queue first grows */
#define PARALLEL_SAMPLES 8 /* sampled sequences from which a step samples on two threads */
#define STAGE_SENT_RING 16 /* forwarded steps remembered to answer an ACT that bounces */
#define STAGE_URL_CAP 280  /* bytes of a rank's network-collective URL, with its NUL */
#define STAGE_FAIL_CAP 320 /* bytes of a sequence's failure message (step_out.message) */

_Static_assert(SH_STAGE_SPEC_ROWS == 4 * SH_SPEC_MAX_K, "actors/serve.h says 4 * SH_SPEC_MAX_K");
_Static_assert(SH_PROTO_MAX_DRAFT == SH_SPEC_MAX_K, "a STEP's drafts are what one step verifies");

/* A sequence's sampler. `used` is the step counter when it last sampled (0: free slot), which
 * orders the least recently used for eviction. `at` and the draws after it remember its last
 * step's answer: a step run again (a duplicated STEP or ACT, or the batcher's retry of a step
 * whose STEP_DONE was lost) asks for the token at the same index, and gets those draws again
 * instead of new ones, so that neither the sampler's generator nor its penalty window moves twice
 * (a seeded request's tokens stay those of an undisturbed run). A speculative step draws up to
 * SH_SPEC_MAX_K + 1 tokens from `at` on, each following the ones before it: a step whose first
 * new token's index falls among them (a retry, perhaps with other drafts after a pause, or the
 * step after a retry that took fewer of them) gets the remembered draws from there, verified
 * against its drafts, and draws anew (with the sampler where they left it) only past their end. */
typedef struct smp_slot {
    uint64_t seq;
    uint64_t used;
    sh_sampler *s;
    int64_t at;            /* the index of the first token of the last draws; -1: none */
    int32_t n_drawn;       /* tokens drawn from `at` on (1..SH_SPEC_MAX_K + 1): tok[0..n_drawn) */
    sh_proto_step_out out; /* the first draw; its top lists point into top_tok and top_lp */
    int32_t top_tok[SH_SAMPLER_MAX_LOGPROBS];
    float top_lp[SH_SAMPLER_MAX_LOGPROBS];
    int32_t tok[SH_SPEC_MAX_K + 1]; /* every draw, the first included, with its logprobs */
    float lp[SH_SPEC_MAX_K + 1], lr[SH_SPEC_MAX_K + 1];
    sh_sgram_seq gram; /* the sequence's grammar matcher, when it has a grammar */
} smp_slot;

/* A step this stage answered or forwarded (its first try's id) and when: a retry of it that had
 * arrived before then is dropped (its answer is on its way). */
typedef struct done_step {
    uint64_t root, us;
} done_step;
#define STAGE_DONE_RING 64

/* A step this stage forwarded as ACT: where its STEP_DONE goes if the ACT bounces. */
typedef struct sent_step {
    uint64_t step, trace;
    sh_addr reply;
} sent_step;

typedef struct stage_state {
    /* Set by init, read-only afterwards (both threads read them). */
    sh_runtime *rt;
    sh_addr self;
    sh_addr next;     /* ACT goes here; SH_ADDR_NONE on the last stage */
    sh_addr batcher;  /* failures whose reply address is unknown; may be SH_ADDR_NONE */
    bool first, last; /* this stage embeds tokens (takes STEP) / computes logits and samples */
    const sh_llama *model;
    sh_llama_ctx *ctx;
    sh_hello_auth *auth;   /* NULL: serve every node (no cluster key) */
    uint32_t control_node; /* sh_stage_args.control_node */
    uint32_t drafter_node; /* sh_stage_args.drafter_node */
    sh_act_decoder ctl;    /* CONTROL, decoded on the loop thread (dec is the worker's) */
    int32_t max_seqs, n_vocab, n_blocks, dim;
    int32_t tab_len; /* block-table entries per sequence (released ones included) */
    int32_t max_tok; /* rows one step may carry: the pool's positions (each new row takes one) */
    uint32_t link_dtype;            /* SH_PROTO_DTYPE_F32, _F16 or _I8: how ACT leaves this stage */
    sh_counter *m_bytes, *m_hidden; /* shoal_act_bytes_total, shoal_act_hidden_bytes_total */
    /* MoE models: shoal_moe_expert_tokens_total of each (layer of the stage, expert), and the
     * context's totals already added to them; NULL for a dense model. Worker thread. */
    sh_counter **m_expert; // ((last - first) * n_expert)
    uint64_t *expert_seen; // ((last - first) * n_expert)

    sh_act_worker worker; /* runs the kept STEPs, ACTs and CONTROLs in arrival order */
    /* The newest allowed epoch among the STEPs and ACTs that arrived: the loop thread raises it
     * as it queues each (note_epoch), the worker reads it. A step of an older epoch was
     * abandoned at its batcher's pause: the worker drops it, still queued or just run, so the
     * steps sent after the resume do not wait behind the abandoned ones (each a whole step of
     * compute, which could take the resumed steps past the batcher's step timeout). */
    _Atomic uint64_t epoch_in;

    /* The worker's own; sized at init so that a step allocates nothing. */
    uint64_t epoch; /* the newest STEP/ACT epoch seen: older ones are dropped (proto STEP) */
    sh_act_decoder dec;
    int32_t *tok;       // (max_tok) the step's token ids, sequence after sequence
    int32_t *blk;       // (max_seqs, tab_len) each sequence's block table
    sh_llama_seq *seqs; // (max_seqs)
    sh_sampler **smp;   // (max_seqs) the sampler of each sampled sequence of the step
    smp_slot **sl;      // (max_seqs) and its slot
    bool *again;        // (max_seqs) the step asks again for the slot's last draws
    int32_t *ban;       // (max_seqs * SH_PROTO_MAX_BAN) each sequence's banned ids this step
    uint8_t *acc;  // (max_seqs) the last acc tokens of the answer are new and not in the window yet
    bool *moved;   // (max_seqs) the sampler took new tokens into its window while verifying
    int32_t *more; // (max_seqs, SH_SPEC_MAX_K) the answers' more lists
    float *more_lp, *more_lr; // (max_seqs, SH_SPEC_MAX_K)
    sh_sample *samples;       // (max_seqs)
    sh_proto_step_out *out;   // (max_seqs) the reply's entries
    /* A sequence that failed alone this step (its grammar's matcher passed its bounds, every
     * token banned, ...): its sh_err (0: none) and why; its answer carries them (step_out.status)
     * and the step's other sequences go on. */
    int32_t *fail;                    // (max_seqs)
    char (*fail_msg)[STAGE_FAIL_CAP]; // (max_seqs)
    int32_t *top_tok;                 // (max_seqs, SH_SAMPLER_MAX_LOGPROBS)
    float *top_lp;                    // (max_seqs, SH_SAMPLER_MAX_LOGPROBS)
    smp_slot *slots;                  // (n_slots) = 2 * max_seqs
    sh_sgram *gram;                   // grammars of the slots' sequences (actors/stage_grammar.h)
    int32_t n_slots;
    int32_t *row; // (max_seqs) each sampled sequence's (first) row of logits
    /* Verification's samples, the worker's [0] and the sampling helper's [1]. */
    sh_sample vs[2][SH_SPEC_MAX_K + 1];
    /* Pipeline buffers, grown to the largest step seen and kept (no allocation per step after
     * that): the aligned (or widened) copy of an ACT's hidden states, the narrowed rows and
     * scales of an ACT this stage sends in F16 or I8, and the encoded ACT frame. */
    float *hid; // (hid_cap) = (rows, dim)
    size_t hid_cap;
    void *lnk; // (lnk_cap bytes) = (rows, dim) of link_dtype
    size_t lnk_cap;
    float *scl; // (scl_cap) = (rows) I8 row scales
    size_t scl_cap;
    float *emb; // (emb_cap bytes) = (max_seqs, dim) the embedding sequences' pooled parts
    size_t emb_cap;
    double *emb_acc; // (emb_acc_cap bytes) = (dim) a mean's sum
    size_t emb_acc_cap;
    sh_buf enc;
    sent_step sent[STAGE_SENT_RING];
    uint32_t n_sent;
    done_step done[STAGE_DONE_RING];
    uint32_t n_done;
    sh_counter *m_retry_dropped; /* shoal_stage_retries_dropped_total */
    sh_counter *m_stale;         /* shoal_stage_stale_steps_dropped_total */

    /* The sampling helper: samples the upper part of a big step's sequences while the worker
     * samples the lower part (samplers are per sequence, so the two never share one). hmu guards
     * the hand-off; the range and logits are written before hgen moves. */
    uv_thread_t helper;
    bool helper_ok, hquit;
    uv_mutex_t hmu;
    uv_cond_t hcv, hdone;
    uint64_t hgen, hdone_gen;
    const sh_proto_step *h_step;
    const float *h_logits;
    const sh_llama_top1 *h_top1;
    uint32_t h_lo, h_hi;
    uint64_t tick;
    sh_logit_bias bias[SH_SAMPLER_MAX_BIAS];

    /* Tensor parallelism (sh_stage_args): set by init. */
    int32_t tp_rank, tp_size;            /* tp_size 1: no group */
    sh_addr tp_ranks[SH_COLL_MAX_RANKS]; /* the worker's (REGROUP rewrites them) */
    sh_addr leader; /* tp_ranks[0] as the loop thread checks frames against it (atomic) */
    sh_coll_kind coll_kind;
    sh_coll_opts coll_opts; /* its urls point at url_of: the worker's copy of every rank's URL */
    char (*urls)[STAGE_URL_CAP]; // (tp_size) with the network collective; NULL otherwise
    const char *url_of[SH_COLL_MAX_RANKS];
    sh_backend *be;
    sh_llama_ctx_opts ctx_opts;
    int32_t want_blocks;
    /* The worker's: the group and the context over it (created at the first step, again after a
     * failure or a new batcher epoch), the group's epoch, the batcher epoch it was created under
     * (the leader's), and whether a call on it failed. */
    sh_coll *coll;
    uint32_t gen;
    uint64_t group_step_epoch;
    bool coll_broken;
    /* The group's series (docs/cluster.md), fed from coll's counters after each step: what was
     * counted of the present group so far, and the nanoseconds of step time not yet counted (the
     * series counts whole microseconds). */
    sh_counter *m_coll[7]; /* calls, failures, bytes, wire bytes, wait us, groups formed, step us */
    sh_coll_stats coll_seen;
    uint64_t step_ns;
    bool group_failed; /* the step at hand failed for the group's sake (not the step's own) */
} stage_state;

int32_t sh_stage_max_logits(int32_t max_seqs, int32_t max_tokens)
{
    int64_t n = (int64_t)max_seqs + SH_STAGE_SPEC_ROWS;
    return n < max_tokens ? (int32_t)n : max_tokens;
}

/* ---- samplers ---- */

/* Finds seq's sampler or creates it from q's parameters (accepting its history), evicting the
 * least recently used when the table is full. Returns SH_OK (*out set) or the sampler's error
 * with e naming the sequence. Worker thread. */
static sh_err sampler_get(stage_state *st, const sh_proto_step_seq *q, sh_sampler **out,
                          smp_slot **slot, sh_error *e)
{
    smp_slot *victim = NULL;
    for (int32_t i = 0; i < st->n_slots; i++) {
        smp_slot *sl = &st->slots[i];
        if (sl->used && sl->seq == q->seq) {
            sl->used = st->tick;
            *out = sl->s;
            *slot = sl;
            return SH_OK;
        }
        if (!victim || sl->used < victim->used)
            victim = sl;
    }
    const sh_proto_sampling *sp = &q->sampling;
    if (sp->bias.n > SH_SAMPLER_MAX_BIAS)
        return sh__error_set(e, SH_EINVAL, "stage: sequence %" PRIu64 ": %u logit biases", q->seq,
                             (unsigned)sp->bias.n);
    for (uint32_t i = 0; i < sp->bias.n; i++)
        st->bias[i] = (sh_logit_bias){sp->bias.v[i].id, sp->bias.v[i].bias};
    sh_sampler_params p = sh_sampler_params_default();
    p.temperature = sp->temperature;
    p.top_k = sp->top_k;
    p.top_p = sp->top_p;
    p.min_p = sp->min_p;
    p.repeat_penalty = sp->repeat_penalty;
    p.frequency_penalty = sp->frequency_penalty;
    p.presence_penalty = sp->presence_penalty;
    p.penalty_last_n = sp->penalty_last_n;
    p.typical_p = sp->typical_p > 0.0f && sp->typical_p < 1.0f ? sp->typical_p : 1.0f;
    p.seed = sp->seed;
    p.n_logprobs = sp->n_logprobs;
    p.logprobs_mode = sp->logprobs_mode ? SH_LOGPROBS_FINAL : SH_LOGPROBS_RAW;
    p.bias = st->bias;
    p.n_bias = (int32_t)sp->bias.n;
    sh_sampler *s = NULL;
    sh_error se = {0};
    if (sh_sampler_create(st->n_vocab, &p, &s, &se))
        return sh__error_set(e, se.code, "stage: sequence %" PRIu64 ": %s", q->seq, se.msg);
    for (uint32_t i = 0; i < q->history.n; i++)
        sh_sampler_accept(s, sh_i32s_at(q->history, i));
    sh_sampler_destroy(victim->s);
    sh__sgram_seq_clear(st->gram, &victim->gram);
    *victim = (smp_slot){.seq = q->seq, .used = st->tick, .s = s, .at = -1};
    *out = s;
    *slot = victim;
    return SH_OK;
}

/* ---- one step ---- */

/* Checks the step, copies its ids and block tables into the aligned buffers and fills st->seqs.
 * A drafted sequence (draft d > 0) must sample, ask for no top logprobs and carry its last
 * accepted token before the drafts (d < tokens); it wants d + 1 rows of logits, and the last
 * stage's context must hold the step's rows. Returns SH_OK, SH_EINVAL or SH_ETIMEDOUT with e
 * filled. */
static sh_err step_prepare(stage_state *st, const sh_proto_step *s, sh_error *e)
{
    uint32_t n = s->seqs.n;
    if (n > (uint32_t)st->max_seqs)
        return sh__error_set(e, SH_EINVAL, "stage: step %" PRIu64 " has %u sequences (at most %d)",
                             s->step, (unsigned)n, (int)st->max_seqs);
    if (s->deadline_ms && sh__act_unix_ms() > s->deadline_ms)
        return sh__error_set(e, SH_ETIMEDOUT, "stage: step %" PRIu64 " is past its deadline",
                             s->step);
    int32_t t = 0;
    int64_t rows = 0;
    for (uint32_t i = 0; i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        uint32_t nt = q->tokens.n, d = q->draft;
        const char *why = !d                           ? NULL
                          : !q->sample                 ? "the sequence does not sample"
                          : d >= nt                    ? "not fewer than its tokens"
                          : d > SH_SPEC_MAX_K          ? "more than SH_SPEC_MAX_K"
                          : q->sampling.n_logprobs > 0 ? "it asks for top logprobs, which a "
                                                         "speculative step does not give"
                                                       : NULL;
        if (why)
            return sh__error_set(e, SH_EINVAL,
                                 "stage: sequence %" PRIu64 ": %u drafted tokens of %u: %s", q->seq,
                                 (unsigned)d, (unsigned)nt, why);
        rows += q->sample ? (int64_t)d + 1 : 0;
        int64_t end = (int64_t)q->pos + nt;
        int64_t nb = (end + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
        if (nt == 0 || nt > (uint32_t)(st->max_tok - t))
            return sh__error_set(e, SH_EINVAL,
                                 "stage: sequence %" PRIu64 ": %u tokens (%d rows left of %d)",
                                 q->seq, (unsigned)nt, (int)(st->max_tok - t), (int)st->max_tok);
        if (nb > st->tab_len || nb > (int64_t)q->blocks.n)
            return sh__error_set(e, SH_EINVAL,
                                 "stage: sequence %" PRIu64
                                 ": positions [%u, %lld) with %u table entries (pool %d blocks)",
                                 q->seq, (unsigned)q->pos, (long long)end, (unsigned)q->blocks.n,
                                 (int)st->n_blocks);
        /* Packed little-endian int32 is the host layout; the copies only fix the alignment. */
        int32_t *tab = st->blk + (size_t)i * st->tab_len;
        memcpy(st->tok + t, q->tokens.ptr, (size_t)nt * sizeof(int32_t));
        memcpy(tab, q->blocks.ptr, (size_t)nb * sizeof(int32_t));
        st->seqs[i] = (sh_llama_seq){.tokens = st->tok + t,
                                     .n_tokens = (int32_t)nt,
                                     .pos0 = (int32_t)q->pos,
                                     .blocks = tab,
                                     .want_logits = q->sample,
                                     .n_logits = d ? (int32_t)d + 1 : 0};
        t += (int32_t)nt;
    }
    int32_t max_rows = st->last && st->ctx ? sh_llama_ctx_max_logits(st->ctx) : INT32_MAX;
    if (rows > max_rows)
        return sh__error_set(e, SH_EINVAL,
                             "stage: step %" PRIu64 " wants %lld rows of logits (its drafts "
                             "included), the stage's context holds %d",
                             s->step, (long long)rows, (int)max_rows);
    return SH_OK;
}

/* Whether step sequence q samples under a grammar: its text or, on its later steps, its hash. */
static bool seq_grammar(const sh_proto_step_seq *q)
{
    return q->sampling.grammar.len || q->gram_hash;
}

/* Whether every sequence step s samples is sampled plain greedy (sh_sampler_plain_greedy), read
 * from the step's sampling parameters only, which every rank of a group has alike: greedy, no
 * top-n list, no logit bias, neutral penalties (a penalty window in effect would change the pick,
 * and only the leader holds the windows). A tensor-parallel group's last stage then asks its
 * forward pass for the rows' top-1 and log-sum-exp (sh_llama_batch.top1_only) instead of the
 * gathered logits. Never on a single node (its logits are not gathered) or a step that samples
 * nothing. */
static bool step_greedy_head(const stage_state *st, const sh_proto_step *s)
{
    if (!st->last || st->tp_size < 2)
        return false;
    bool any = false;
    for (uint32_t i = 0; i < s->seqs.n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        if (!q->sample)
            continue;
        const sh_proto_sampling *p = &q->sampling;
        if (!(p->temperature <= 0.0f) || p->n_logprobs != 0 || p->bias.n != 0 || q->ban.n != 0 ||
            p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f ||
            p->presence_penalty != 0.0f || seq_grammar(q))
            return false;
        any = true;
    }
    return any;
}

/* Fails sequence i of the step alone with err and msg (st->fail, st->fail_msg): its answer says
 * so and the step's other sequences go on. Worker or sampling helper thread (sequence i's own). */
static void seq_fail(stage_state *st, uint32_t i, sh_err err, const char *msg)
{
    st->fail[i] = (int32_t)err;
    snprintf(st->fail_msg[i], STAGE_FAIL_CAP, "%s", msg);
}

/* Appends a token to sequence i's answer o: the first to token/logprob/logprob_raw, the others to
 * its more lists (in st->more*). Worker or sampling helper thread (sequence i's own). */
static void answer_add(stage_state *st, uint32_t i, sh_proto_step_out *o, int32_t tok, float lp,
                       float lr)
{
    if (o->token < 0) {
        o->token = tok;
        o->logprob = lp;
        o->logprob_raw = lr;
        return;
    }
    size_t at = (size_t)i * SH_SPEC_MAX_K;
    uint32_t k = o->more.n;
    st->more[at + k] = tok;
    st->more_lp[at + k] = lp;
    st->more_lr[at + k] = lr;
    o->more = (sh_i32s){st->more + at, k + 1};
    o->more_lp = (sh_f32s){st->more_lp + at, k + 1};
    o->more_lp_raw = (sh_f32s){st->more_lr + at, k + 1};
}

/* Samples sequences [lo, hi) of step s from the forward pass's logits into st->out, or, for a
 * greedy head's step (top1 not NULL), from each row's top-1 and log-sum-exp: the token and
 * logprob = logprob_raw = logit - lse that sh_sampler_sample gives a plain greedy sampler
 * (model/sampler.h). A drafted sequence (draft d) is verified over its d + 1 rows: with its
 * sampler by sh_spec_verify (which takes each token into the window as it goes: st->moved), or
 * with the greedy head by comparing each row's top-1 with the draft. A sequence asking again for
 * remembered draws (st->again, smp_slot) gets them, verified against its drafts, and draws anew
 * only past them. st->acc counts the new tokens at the answer's end that the window has yet to
 * take. A sequence whose sampling fails (its grammar's matcher passed its bounds, every token
 * banned) fails alone (seq_fail); a sequence that failed before the forward pass is skipped.
 * Worker or sampling helper thread (vs its verification scratch): each touches only its own
 * sequences' samplers, output slots and failure entries. */
static void sample_range(stage_state *st, const sh_proto_step *s, const float *logits,
                         const sh_llama_top1 *top1, uint32_t lo, uint32_t hi, sh_sample *vs)
{
    int th = vs == st->vs[1]; /* the sampling helper's scratch */
    for (uint32_t i = lo; i < hi; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        sh_proto_step_out *o = &st->out[i];
        if (!q->sample || st->fail[i])
            continue;
        int32_t d = (int32_t)q->draft, j = 0;
        const int32_t *drafts = st->seqs[i].tokens + st->seqs[i].n_tokens - d;
        if (st->again[i]) { /* these draws were made: the same answers, as far as they go */
            const smp_slot *sl = st->sl[i];
            int32_t off = (int32_t)((int64_t)q->pos + q->tokens.n - d - sl->at);
            if (off == 0) {
                int32_t *tt = st->top_tok + (size_t)i * SH_SAMPLER_MAX_LOGPROBS;
                float *tl = st->top_lp + (size_t)i * SH_SAMPLER_MAX_LOGPROBS;
                memcpy(tt, sl->top_tok, sl->out.top_tokens.n * sizeof *tt);
                memcpy(tl, sl->top_lp, sl->out.top_logprobs.n * sizeof *tl);
                o->top_tokens = (sh_i32s){tt, sl->out.top_tokens.n};
                o->top_logprobs = (sh_f32s){tl, sl->out.top_logprobs.n};
            }
            for (; off + j < sl->n_drawn; j++) {
                int32_t r = off + j;
                answer_add(st, i, o, sl->tok[r], sl->lp[r], sl->lr[r]);
                if (j == d || sl->tok[r] != drafts[j])
                    break;
            }
            if (off + j < sl->n_drawn)
                continue;
            /* Every remembered draw from here was an accepted draft of this step: the sampler is
             * where they left it, and verifies the rest. */
        }
        if (top1) {
            for (; j <= d; j++) {
                const sh_llama_top1 *t = &top1[st->row[i] + j];
                if (t->id < 0) {
                    seq_fail(st, i, SH_ERANGE, "every token is banned: no token to sample");
                    break;
                }
                float lp = (float)((double)t->logit - t->lse);
                answer_add(st, i, o, t->id, lp, lp);
                st->acc[i]++;
                if (j == d || t->id != drafts[j])
                    break;
            }
            continue;
        }
        const float *rows = logits + ((size_t)st->row[i] + (size_t)j) * (size_t)st->n_vocab;
        if (d > 0) {
            int32_t nv = 0;
            st->moved[i] = true;
            sh_err err = sh_spec_verify(st->smp[i], rows, st->n_vocab, drafts + j, d - j, vs, &nv);
            for (int32_t k = 0; k < nv; k++)
                answer_add(st, i, o, vs[k].id, vs[k].logprob, vs[k].logprob_raw);
            if (err)
                seq_fail(st, i, err,
                         "every token is banned while verifying drafts: no token to sample");
            continue;
        }
        sh_sample *smp = &st->samples[i];
        sh_sgram_seq *gs = &st->sl[i]->gram;
        bool mask_first = q->sampling.n_logprobs > 0 || q->sampling.gram_lp;
        sh_error ge = {0};
        sh_err err;
        if (seq_grammar(q) && gs->gm) {
            if ((err =
                     sh__sgram_sample(st->gram, gs, st->smp[i], rows, th, mask_first, smp, &ge))) {
                seq_fail(st, i, err, ge.msg);
                continue;
            }
        } else if ((err = sh_sampler_sample(st->smp[i], rows, smp))) {
            seq_fail(st, i, err,
                     "every token is banned (logit_bias and min_tokens leave no token to sample)");
            continue;
        }
        answer_add(st, i, o, smp->id, smp->logprob, smp->logprob_raw);
        st->acc[i] = 1;
        if (smp->n_top > 0) {
            int32_t *tt = st->top_tok + (size_t)i * SH_SAMPLER_MAX_LOGPROBS;
            float *tl = st->top_lp + (size_t)i * SH_SAMPLER_MAX_LOGPROBS;
            bool raw = q->sampling.logprobs_mode == SH_LOGPROBS_RAW;
            for (int32_t k = 0; k < smp->n_top; k++) {
                tt[k] = smp->top[k].id;
                tl[k] = raw ? smp->top[k].logprob_raw : smp->top[k].logprob;
            }
            o->top_tokens = (sh_i32s){tt, (uint32_t)smp->n_top};
            o->top_logprobs = (sh_f32s){tl, (uint32_t)smp->n_top};
        }
    }
}

/* The sampling helper's loop: waits for a range, samples it, reports. */
static void helper_main(void *arg)
{
    stage_state *st = arg;
    uint64_t seen = 0;
    pthread_setname_np(pthread_self(), "shoal-sample");
    uv_mutex_lock(&st->hmu);
    for (;;) {
        while (!st->hquit && st->hgen == seen)
            uv_cond_wait(&st->hcv, &st->hmu);
        if (st->hquit)
            break;
        seen = st->hgen;
        const sh_proto_step *s = st->h_step;
        const float *logits = st->h_logits;
        const sh_llama_top1 *top1 = st->h_top1;
        uint32_t lo = st->h_lo, hi = st->h_hi;
        uv_mutex_unlock(&st->hmu);
        sample_range(st, s, logits, top1, lo, hi, st->vs[1]);
        uv_mutex_lock(&st->hmu);
        st->hdone_gen = seen;
        uv_cond_signal(&st->hdone);
    }
    uv_mutex_unlock(&st->hmu);
}

/* Adds the experts' tokens of the step just run to shoal_moe_expert_tokens_total (the context
 * counts since its creation; the counters get the difference). Worker thread. */
static void expert_count(stage_state *st)
{
    if (!st->m_expert)
        return;
    const sh_llama *m = st->model;
    const int32_t ne = m->hp.n_expert;
    for (int32_t l = m->first; l < m->last; l++) {
        const uint64_t *tot = sh_llama_ctx_expert_tokens(st->ctx, l);
        for (int32_t x = 0; tot && x < ne; x++) {
            const size_t i = (size_t)(l - m->first) * ne + x;
            if (tot[x] != st->expert_seen[i] && st->m_expert[i])
                sh_counter_add(st->m_expert[i], tot[x] - st->expert_seen[i]);
            st->expert_seen[i] = tot[x];
        }
    }
}

/* ---- a tensor-parallel group ---- */

/* The leader's: the group epoch step s runs under. The group's own while it serves the batcher
 * epoch it was created under; otherwise (none yet, a failed call, a new batcher epoch after a
 * pause, when a rank may have been replaced) a new one, above every earlier one and at least this
 * node's Unix seconds, so that a restarted leader does not reuse its predecessor's (a standby
 * promoted in a leader's place gets a floor above them with its REGROUP). Worker. */
static uint32_t group_gen(stage_state *st, uint64_t step_epoch)
{
    if (st->coll && !st->coll_broken && st->group_step_epoch == step_epoch)
        return st->gen;
    uint64_t now_s = sh__act_unix_ms() / 1000;
    uint32_t g = st->gen + 1;
    if (now_s > g && now_s < UINT32_MAX)
        g = (uint32_t)now_s;
    st->group_step_epoch = step_epoch;
    return g;
}

/* The leader's: sends the STEP or ACT m, body as it came, to every other rank, with the group
 * epoch gen as the envelope's session. A failed send is logged: that rank misses the step, and
 * the group's agreement on it fails within the timeout. Worker thread. */
static void group_forward(stage_state *st, const sh_msg *m, uint32_t gen)
{
    size_t len = 0;
    const void *body = sh_msg_body(m, &len);
    sh_msg_hdr h = *sh_msg_header(m);
    h.session = gen;
    h.src = st->self;
    for (int32_t r = 1; r < st->tp_size; r++) {
        h.dst = st->tp_ranks[r];
        sh_error se = {0};
        if (sh_send(st->rt, &h, body, len, &se))
            sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "tp_forward_failed",
                           "rank=%d to=%" PRIu64 " error=\"%s\"", (int)r, (uint64_t)h.dst, se.msg);
    }
}

/* Adds what the group's collectives did since the last call to the stage's series. Worker. */
static void group_count(stage_state *st)
{
    if (!st->coll)
        return;
    sh_coll_stats now, *was = &st->coll_seen;
    sh_coll_stats_get(st->coll, &now);
    uint64_t d[5] = {now.calls - was->calls, now.failures - was->failures, now.bytes - was->bytes,
                     now.bytes_wire - was->bytes_wire, (now.wait_ns - was->wait_ns) / 1000};
    for (int i = 0; i < 5; i++)
        if (st->m_coll[i] && d[i])
            sh_counter_add(st->m_coll[i], d[i]);
    *was = now;
}

/* Adds ns nanoseconds of a step's time in the group to the stage's series. Worker. */
static void group_step_time(stage_state *st, uint64_t ns)
{
    st->step_ns += ns;
    if (st->m_coll[6] && st->step_ns >= 1000)
        sh_counter_add(st->m_coll[6], st->step_ns / 1000);
    st->step_ns %= 1000;
}

/* Makes sure the group of epoch gen and the context over it exist: when there are none, the
 * group failed or its epoch is another, both are created again (the KV pool starts empty: the
 * batcher has forgotten every block since, as a new epoch follows a pause). Creating the group
 * waits up to its timeout for every rank. Worker thread. */
/* The group's frames to rank `peer` go through this node's fault layer (if any) as messages to
 * that rank's node of type SH_FAULT_TYPE_COLL: a scenario's drop or duplicate on the link reaches
 * the network collective (a partition or a corruption drops the frame; a delay is not applied). */
static sh_coll_fault coll_fault(void *ud, int32_t peer)
{
    const stage_state *st = ud;
    uint32_t a = sh__fault_decide_rt(st->rt, sh_addr_node(st->tp_ranks[peer]), SH_FAULT_TYPE_COLL);
    if (a & (1u << SH_FAULT_ACTION_PARTITION | 1u << SH_FAULT_ACTION_DROP |
             1u << SH_FAULT_ACTION_CORRUPT))
        return SH_COLL_FAULT_DROP;
    return a & (1u << SH_FAULT_ACTION_DUPLICATE) ? SH_COLL_FAULT_DUPLICATE : SH_COLL_FAULT_PASS;
}

/* Counts what the group did, then drops it and the context over it (its KV pool with them).
 * Worker thread. */
static void group_drop(stage_state *st)
{
    group_count(st);
    st->coll_seen = (sh_coll_stats){0};
    sh_llama_ctx_destroy(st->ctx);
    st->ctx = NULL;
    sh_coll_destroy(st->coll);
    st->coll = NULL;
    st->coll_broken = false;
}

static sh_err group_ready(stage_state *st, uint32_t gen, sh_error *e)
{
    if (st->coll && !st->coll_broken && st->gen == gen)
        return SH_OK;
    group_drop(st);
    // A rank whose node has no proved connection here (it died, or is restarting) cannot join:
    // fail at once rather than wait out the group's timeout (the watchdog pauses the replica,
    // and the step after the resume forms the group).
    for (int32_t r = 0; st->tp_rank == 0 && r < st->tp_size && sh__peers_enforced(st->rt); r++) {
        uint32_t node = sh_addr_node(st->tp_ranks[r]);
        if (node != sh_addr_node(st->self) && !sh__peers_node_bound(st->rt, node))
            return sh__error_set(e, SH_ECLOSED,
                                 "stage: rank %d of %d: node %u is not connected: its group "
                                 "cannot form",
                                 (int)r, (int)st->tp_size, (unsigned)node);
    }
    sh_coll_opts o = st->coll_opts;
    o.rank = st->tp_rank;
    o.size = st->tp_size;
    o.epoch = gen;
    o.fault = coll_fault;
    o.fault_ud = st;
    sh_error ce = {0};
    sh_err err = sh_coll_create(st->coll_kind, &o, &st->coll, &ce);
    if (err)
        return sh__error_set(e, err,
                             "stage: rank %d of %d: its tensor-parallel group (epoch %u): %s",
                             (int)st->tp_rank, (int)st->tp_size, (unsigned)gen, ce.msg);
    st->gen = gen;
    sh_llama_ctx_opts co = st->ctx_opts;
    co.comm = (sh_llama_comm){sh_coll_rank(st->coll), sh_coll_size(st->coll), st->coll,
                              sh_coll_allreduce_ud, sh_coll_allgather_ud};
    err = sh_llama_ctx_create(st->model, st->be, &co, &st->ctx, &ce);
    if (!err && sh_llama_ctx_n_blocks(st->ctx) != st->want_blocks)
        err = sh__error_set(&ce, SH_EINVAL, "the KV pool has %d blocks, the plan %d",
                            (int)sh_llama_ctx_n_blocks(st->ctx), (int)st->want_blocks);
    if (err) {
        sh_llama_ctx_destroy(st->ctx);
        st->ctx = NULL;
        sh_coll_destroy(st->coll);
        st->coll = NULL;
        return sh__error_set(e, err, "stage: rank %d of %d: context: %s", (int)st->tp_rank,
                             (int)st->tp_size, ce.msg);
    }
    if (st->expert_seen) /* a new context counts from 0 */
        memset(st->expert_seen, 0,
               (size_t)(st->model->last - st->model->first) * (size_t)st->model->hp.n_expert *
                   sizeof *st->expert_seen);
    if (st->m_coll[5])
        sh_counter_add(st->m_coll[5], 1);
    static const char *const cmps[3] = {"", " compress=f16", " compress=int8"};
    sh_runtime_log(st->rt, SH_LOG_LEVEL_INFO, "tp_group", "rank=%d size=%d epoch=%u kind=%s%s",
                   (int)st->tp_rank, (int)st->tp_size, (unsigned)gen,
                   st->coll_kind == SH_COLL_SHM   ? "shm"
                   : st->coll_kind == SH_COLL_NET ? "net"
                                                  : "hier",
                   (unsigned)o.compress < 3 ? cmps[o.compress] : "");
    return SH_OK;
}

/* Whether a REGROUP's body fits this rank: one address per rank then the epoch floor, its own
 * rank at this actor, and over the network one URL per line for each rank (each under
 * STAGE_URL_CAP bytes). When urls is not NULL, the lines are copied there. Either thread (its own
 * decoded body). */
static bool regroup_fits(const stage_state *st, const sh_proto_control *c,
                         char (*urls)[STAGE_URL_CAP])
{
    if (st->tp_size < 2 || c->targets.n != (uint32_t)st->tp_size + 1 ||
        sh_u64s_at(c->targets, (uint32_t)st->tp_size) > UINT32_MAX ||
        sh_u64s_at(c->targets, (uint32_t)st->tp_rank) != st->self)
        return false;
    if (!st->urls)
        return true;
    const char *p = c->arg.ptr ? c->arg.ptr : "", *end = p + c->arg.len;
    for (int32_t r = 0; r < st->tp_size; r++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl ? nl : end;
        if (p >= end || stop == p || stop - p >= STAGE_URL_CAP || (r + 1 < st->tp_size && !nl))
            return false;
        if (urls)
            snprintf(urls[r], STAGE_URL_CAP, "%.*s", (int)(stop - p), p);
        p = nl ? nl + 1 : end;
    }
    return true;
}

/* The worker's side of a REGROUP (kept and queued, so that the steps before it ran with the old
 * group): the group and its context go (its KV pool with them: the batcher recomputes every
 * sequence after the pause that comes with a promotion), every rank's address and URL are the
 * new ones, and the next step forms the group anew (the leader with a new epoch). */
static void regroup_apply(stage_state *st, const sh_msg *m)
{
    sh_proto_body b;
    sh_error e = {0};
    if (sh__act_decode(&st->dec, m, &b, &e) || !regroup_fits(st, &b.control, NULL))
        return; /* checked on the loop thread: a decoder that cannot hold it now */
    group_drop(st);
    for (int32_t r = 0; r < st->tp_size; r++)
        st->tp_ranks[r] = r == st->tp_rank ? st->self : sh_u64s_at(b.control.targets, (uint32_t)r);
    // The leader's next epoch is at least the floor (group_gen: above gen).
    uint32_t floor = (uint32_t)sh_u64s_at(b.control.targets, (uint32_t)st->tp_size);
    if (floor > 0 && st->gen < floor - 1)
        st->gen = floor - 1;
    if (st->urls)
        (void)regroup_fits(st, &b.control, st->urls);
    sh_runtime_log(st->rt, SH_LOG_LEVEL_INFO, "tp_regroup", "rank=%d size=%d leader=%" PRIu64,
                   (int)st->tp_rank, (int)st->tp_size, (uint64_t)st->tp_ranks[0]);
}

/* One rank's verdict on a step, gathered from every rank before the forward pass. */
typedef struct agree_rec {
    int32_t status; /* this rank's sh_err for the step so far */
    int32_t rank;
    uint64_t step;
} agree_rec;

/* Every rank of the group tells the others whether step s is good on it (mine: its error so far,
 * e filled), so that either all run the forward pass or none does. Returns mine, or the first
 * failing rank's code naming it, or the group's failure (which breaks it). Worker thread. */
static sh_err group_agree(stage_state *st, const sh_proto_step *s, sh_err mine, sh_error *e)
{
    agree_rec me = {(int32_t)mine, st->tp_rank, s->step}, all[SH_COLL_MAX_RANKS];
    sh_error ce = {0};
    sh_err err = st->coll ? sh_coll_allgather(st->coll, &me, sizeof me, all, &ce) : SH_ECLOSED;
    if (err) {
        st->coll_broken = true;
        st->group_failed = true;
        return sh__error_set(e, err,
                             "stage: step %" PRIu64 ": its tensor-parallel group of %d "
                             "ranks failed: %s",
                             s->step, (int)st->tp_size, st->coll ? ce.msg : "not created");
    }
    for (int32_t r = 0; r < st->tp_size; r++)
        if (all[r].step != s->step || all[r].rank != r) {
            st->coll_broken = true;
            st->group_failed = true;
            return sh__error_set(e, SH_EPROTO,
                                 "stage: step %" PRIu64 ": rank %d of the group runs step %" PRIu64
                                 " (rank %d) instead",
                                 s->step, (int)r, all[r].step, (int)all[r].rank);
        }
    if (mine)
        return mine;
    for (int32_t r = 0; r < st->tp_size; r++)
        if (all[r].status)
            return sh__error_set(e, (sh_err)all[r].status,
                                 "stage: step %" PRIu64 ": rank %d of the group refused it (%s; "
                                 "its node's log says why)",
                                 s->step, (int)r, sh_strerror((sh_err)all[r].status));
    return SH_OK;
}

/* Whether step s has an embedding sequence (step_seq.embed): the last stage then pools. */
static bool step_embeds(const sh_proto_step *s)
{
    for (uint32_t i = 0; i < s->seqs.n; i++)
        if (s->seqs.v[i].embed)
            return true;
    return false;
}

static sh_err embed_pool(stage_state *st, const sh_proto_step *s, const float *hidden, sh_error *e);

/* Runs this stage's part of a decoded step: the forward pass over its layers (from the tokens on
 * the first stage, from hidden_in (rows, dim) on the others), then, on the last stage, sampling.
 * On SH_OK the last stage's d->seqs points into st->out and another stage's *hidden holds the
 * step's rows (in the context, valid until the next forward); a sequence that failed alone (its
 * grammar, every token banned) has its error in its answer (step_out.status). On an error e says
 * why and nothing was accepted by any sampler. Worker thread. */
static sh_err step_run(stage_state *st, const sh_proto_step *s, const float *hidden_in,
                       sh_proto_step_done *d, const float **hidden, sh_error *e)
{
    uint32_t n = s->seqs.n;
    sh_err err;
    if (n == 0)
        return SH_OK;
    err = step_prepare(st, s, e);
    st->tick++;
    /* Samplers first: bad sampling parameters fail the step before this stage's KV cache is
     * written (earlier stages of a pipeline have written theirs; the step is failed anyway).
     * Only a group's leader samples. */
    bool samples = st->last && st->tp_rank == 0;
    bool top1 = step_greedy_head(st, s);
    if (samples && !err)
        memset(st->fail, 0, n * sizeof *st->fail);
    for (uint32_t i = 0; !err && samples && i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        st->again[i] = false;
        if (q->sample && (err = sampler_get(st, q, &st->smp[i], &st->sl[i], e)))
            break;
        if (q->sample) { /* end-of-sequence tokens banned before min_tokens, this step only */
            int32_t *ban = st->ban + (size_t)i * SH_PROTO_MAX_BAN;
            for (uint32_t k = 0; k < q->ban.n; k++)
                ban[k] = sh_i32s_at(q->ban, k);
            sh_sampler_set_ban(st->smp[i], ban, (int32_t)q->ban.n);
        }
        /* The index of the step's first new token: the one after its last accepted token. */
        int64_t at = (int64_t)q->pos + (int64_t)q->tokens.n - (int64_t)q->draft;
        st->again[i] = q->sample && st->sl[i]->at >= 0 && at >= st->sl[i]->at &&
                       at < st->sl[i]->at + st->sl[i]->n_drawn;
        /* A grammar's matcher must stand after the tokens generated so far (a step given again
         * has its draws, and its matcher past them). One that cannot fails its sequence alone
         * (SH_ENOTFOUND: the batcher sends the text again). */
        sh_error ge = {0};
        sh_err gerr;
        if (q->sample && seq_grammar(q) && !st->again[i] &&
            (gerr = sh__sgram_seq_sync(st->gram, &st->sl[i]->gram, q->sampling.grammar,
                                       q->gram_hash, q->gen, q->n_gen, q->seq, &ge)))
            seq_fail(st, i, gerr, ge.msg);
        /* The parameters say plain greedy; so must the sampler the leader keeps for the sequence
         * (made from the same parameters), or the top-1 would not be its pick. */
        if (top1 && q->sample && !st->again[i] && !sh_sampler_plain_greedy(st->smp[i]))
            err = sh__error_set(e, SH_EINVAL,
                                "stage: sequence %" PRIu64
                                ": its sampler is not greedy as the step's parameters say",
                                q->seq);
    }
    /* A group runs the forward pass only when every rank found the step good. */
    if (st->tp_size > 1)
        err = group_agree(st, s, err, e);
    if (err)
        return err;
    sh_llama_batch b = {.n_seqs = (int32_t)n,
                        .seqs = st->seqs,
                        .hidden_in = hidden_in,
                        .top1_only = top1,
                        .want_hidden = st->last && step_embeds(s)};
    sh_llama_out out;
    sh_coll_stats before = {0}, after = {0};
    if (st->coll)
        sh_coll_stats_get(st->coll, &before);
    if ((err = sh_llama_forward(st->ctx, &b, &out, e))) {
        if (st->coll)
            sh_coll_stats_get(st->coll, &after);
        /* A collective that failed half-way broke the group (model/llama.h). */
        st->coll_broken |= after.failures > before.failures;
        st->group_failed |= after.failures > before.failures;
        return err;
    }
    /* A model file truncated under the mapping reads as zeros from then on (the program's SIGBUS
     * guard, base/file.h): this step and every later one are wrong, so fail them. */
    char bad[200];
    if (sh__file_damaged(bad, sizeof bad))
        return sh__error_set(e, SH_EIO,
                             "the model file %s was truncated while it was served (its missing "
                             "pages read as zeros): restart the server with the whole file",
                             bad);
    expert_count(st);
    if (st->tp_rank > 0)
        return SH_OK; /* the leader forwards or samples */
    if (!st->last) {
        *hidden = out.hidden;
        return SH_OK;
    }
    int32_t k = 0, n_sampled = 0;
    for (uint32_t i = 0; i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        st->out[i] = (sh_proto_step_out){.seq = q->seq, .token = -1, .drafted = q->draft};
        st->acc[i] = 0;
        st->moved[i] = false;
        st->row[i] = q->sample ? k : -1;
        k += q->sample ? (int32_t)q->draft + 1 : 0;
        n_sampled += q->sample;
    }
    if (b.want_hidden && (err = embed_pool(st, s, out.hidden, e)))
        return err;
    // Sample: on two threads when the step is big enough to pay for the hand-off.
    uint32_t mid = n;
    if (st->helper_ok && n_sampled >= PARALLEL_SAMPLES) {
        mid = n / 2;
        uv_mutex_lock(&st->hmu);
        st->h_step = s;
        st->h_logits = out.logits;
        st->h_top1 = out.top1;
        st->h_lo = mid;
        st->h_hi = n;
        st->hgen++;
        uv_cond_signal(&st->hcv);
        uv_mutex_unlock(&st->hmu);
    }
    sample_range(st, s, out.logits, out.top1, 0, mid, st->vs[0]);
    if (mid < n) {
        uv_mutex_lock(&st->hmu);
        while (st->hdone_gen != st->hgen)
            uv_cond_wait(&st->hdone, &st->hmu);
        uv_mutex_unlock(&st->hmu);
    }
    /* A sequence that failed alone answers its error and loses its slot (sampler, matcher and
     * remembered draws: its window may have moved while verifying): its request ends, and a
     * sequence the batcher goes on with (SH_ENOTFOUND) starts anew from its history. */
    for (uint32_t i = 0; i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        if (!q->sample || !st->fail[i])
            continue;
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "stage_seq_failed",
                       "step=%" PRIu64 " seq=%" PRIu64 " code=%d error=\"%s\"", s->step, q->seq,
                       (int)st->fail[i], st->fail_msg[i]);
        st->out[i] = (sh_proto_step_out){
            .seq = q->seq,
            .token = -1,
            .drafted = q->draft,
            .status = st->fail[i],
            .message = {st->fail_msg[i], (uint32_t)strnlen(st->fail_msg[i], STAGE_FAIL_CAP)}};
        sh_sampler_destroy(st->sl[i]->s);
        sh__sgram_seq_clear(st->gram, &st->sl[i]->gram);
        *st->sl[i] = (smp_slot){.at = -1};
    }
    /* Only now do the penalty windows take the new tokens (those that verification did not take
     * already), and the slots remember the draws (draws given again were taken the first time). */
    for (uint32_t i = 0; i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        if (!q->sample || st->fail[i] || (!st->acc[i] && !st->moved[i]))
            continue;
        const sh_proto_step_out *o = &st->out[i];
        smp_slot *sl = st->sl[i];
        sl->n_drawn = 1 + (int32_t)o->more.n;
        sl->tok[0] = o->token;
        sl->lp[0] = o->logprob;
        sl->lr[0] = o->logprob_raw;
        for (uint32_t j = 0; j < o->more.n; j++) {
            sl->tok[1 + j] = sh_i32s_at(o->more, j);
            sl->lp[1 + j] = sh_f32s_at(o->more_lp, j);
            sl->lr[1 + j] = sh_f32s_at(o->more_lp_raw, j);
        }
        for (int32_t j = sl->n_drawn - st->acc[i]; j < sl->n_drawn; j++) {
            sh_sampler_accept(st->smp[i], sl->tok[j]);
            if (seq_grammar(q))
                sh__sgram_seq_accept(st->gram, &sl->gram, sl->tok[j]);
        }
        sl->at = (int64_t)q->pos + (int64_t)q->tokens.n - (int64_t)q->draft;
        sl->out = *o;
        sl->out.more = (sh_i32s){0};
        sl->out.more_lp = sl->out.more_lp_raw = (sh_f32s){0};
        if (o->top_tokens.n) {
            memcpy(sl->top_tok, o->top_tokens.ptr, o->top_tokens.n * sizeof(int32_t));
            memcpy(sl->top_lp, o->top_logprobs.ptr, o->top_logprobs.n * sizeof(float));
        }
        sl->out.top_tokens.ptr = sl->top_tok;
        sl->out.top_logprobs.ptr = sl->top_lp;
    }
    d->seqs = (sh_proto_step_out_list){st->out, n};
    return SH_OK;
}

/* Grows a kept buffer to at least n bytes (never shrinks it). Returns false when out of memory
 * (the buffer is unchanged). Worker thread. */
static bool grow(void **buf, size_t *cap, size_t n)
{
    if (n <= *cap)
        return true;
    void *p = realloc(*buf, n);
    if (!p)
        return false;
    *buf = p;
    *cap = n;
    return true;
}

/* The pooled part of each embedding sequence of step s (step_seq.embed), from the last stage's
 * normed hidden rows (rows, dim) into st->out[i].embd: mean, the sum of the chunk's rows (the
 * batcher adds the chunks and divides); cls, the row of position 0 (empty for a later chunk);
 * last, the chunk's last row (the batcher keeps the final chunk's). Each row's part depends on
 * that row alone, so a sequence pools the same in any batch. Worker thread. */
static sh_err embed_pool(stage_state *st, const sh_proto_step *s, const float *hidden, sh_error *e)
{
    uint32_t n = s->seqs.n;
    size_t dim = (size_t)st->dim;
    if (!grow((void **)&st->emb, &st->emb_cap, (size_t)n * dim * sizeof(float)) ||
        !grow((void **)&st->emb_acc, &st->emb_acc_cap, dim * sizeof(double)))
        return sh__error_set(e, SH_ENOMEM, "stage: out of memory for embeddings");
    size_t row = 0;
    for (uint32_t i = 0; i < n; i++) {
        const sh_proto_step_seq *q = &s->seqs.v[i];
        size_t nt = q->tokens.n;
        float *v = st->emb + (size_t)i * dim;
        const float *h = hidden + row * dim;
        row += nt;
        if (!q->embed)
            continue;
        if (q->embed == 1) { /* row by row into doubles, in position order */
            double *acc = st->emb_acc;
            memset(acc, 0, dim * sizeof *acc);
            for (size_t t = 0; t < nt; t++)
                for (size_t j = 0; j < dim; j++)
                    acc[j] += h[t * dim + j];
            for (size_t j = 0; j < dim; j++)
                v[j] = (float)acc[j];
        } else if (q->embed == 2) {
            if (q->pos != 0)
                continue;
            memcpy(v, h, dim * sizeof(float));
        } else {
            memcpy(v, h + (nt - 1) * dim, dim * sizeof(float));
        }
        st->out[i].embd = (sh_f32s){v, (uint32_t)dim};
    }
    return SH_OK;
}

/* Checks an ACT's hidden states against the step and this stage's width and points *out at
 * F32 rows: in the frame when they are F32 and aligned, else in st->hid (grown when a step is
 * larger than any before), copied or widened from F16, or from I8 times the row's scale (the
 * decoder checked that an I8 tensor has one scale per row and others none). Returns SH_OK,
 * SH_EINVAL or SH_ENOMEM with e filled. Worker thread. */
static sh_err act_hidden(stage_state *st, const sh_proto_act *a, const float **out, sh_error *e)
{
    const sh_proto_tensor *t = &a->hidden;
    bool known = t->dtype == SH_PROTO_DTYPE_F32 || t->dtype == SH_PROTO_DTYPE_F16 ||
                 t->dtype == SH_PROTO_DTYPE_I8;
    if (!known || t->ndim != 2 || t->shape[1] != (uint64_t)st->dim || !t->data ||
        (t->dtype == SH_PROTO_DTYPE_I8 && a->scales.n != t->shape[0]))
        return sh__error_set(e, SH_EINVAL,
                             "stage: step %" PRIu64 ": hidden states of dtype %u and shape "
                             "(%llu, %llu), expected F32, F16 or I8 (rows, %d) in the frame",
                             a->step, (unsigned)t->dtype, (unsigned long long)t->shape[0],
                             (unsigned long long)t->shape[1], (int)st->dim);
    size_t rows = (size_t)t->shape[0], dim = (size_t)st->dim, n = rows * dim;
    if (t->dtype == SH_PROTO_DTYPE_F32 && ((uintptr_t)t->data & (_Alignof(float) - 1)) == 0) {
        *out = t->data;
        return SH_OK;
    }
    size_t cap = st->hid_cap * sizeof *st->hid;
    if (!grow((void **)&st->hid, &cap, n * sizeof *st->hid))
        return sh__error_set(e, SH_ENOMEM, "stage: step %" PRIu64 ": %zu hidden rows", a->step,
                             rows);
    st->hid_cap = cap / sizeof *st->hid;
    const uint8_t *src = t->data;
    if (t->dtype == SH_PROTO_DTYPE_F32) {
        memcpy(st->hid, src, n * sizeof *st->hid);
    } else if (t->dtype == SH_PROTO_DTYPE_F16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            st->hid[i] = sh__quant_f32_from_fp16(h);
        }
    } else {
        const int8_t *q = (const int8_t *)src;
        for (size_t r = 0; r < rows; r++) {
            float d = sh_f32s_at(a->scales, (uint32_t)r), *o = st->hid + r * dim;
            for (size_t j = 0; j < dim; j++)
                o[j] = (float)q[r * dim + j] * d;
        }
    }
    *out = st->hid;
    return SH_OK;
}

/* Narrows n = rows * dim F32 values into st->lnk as the stage's link dtype (F16 rounded to
 * nearest even; I8 symmetric per row: scale max|x| / 127 into st->scl, q = x / scale rounded
 * to nearest, a row of zeros or with a non-finite maximum all 0 with that maximum's scale).
 * Returns false when the kept buffers cannot grow. Worker thread. */
static bool act_narrow(stage_state *st, const float *x, size_t rows)
{
    size_t dim = (size_t)st->dim, n = rows * dim;
    bool i8 = st->link_dtype == SH_PROTO_DTYPE_I8;
    size_t scap = st->scl_cap * sizeof *st->scl;
    if (!grow(&st->lnk, &st->lnk_cap, n * (i8 ? 1 : 2)) ||
        (i8 && !grow((void **)&st->scl, &scap, rows * sizeof *st->scl)))
        return false;
    st->scl_cap = scap / sizeof *st->scl;
    if (!i8) {
        uint16_t *h = st->lnk;
        for (size_t i = 0; i < n; i++)
            h[i] = sh__quant_fp16_from_f32(x[i]);
        return true;
    }
    int8_t *q = st->lnk;
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        int8_t *qr = q + r * dim;
        float amax = 0.0f;
        for (size_t j = 0; j < dim; j++)
            amax = fmaxf(amax, fabsf(xr[j]));
        st->scl[r] = amax / 127.0f;
        if (!(amax > 0.0f) || !isfinite(amax)) {
            memset(qr, 0, dim);
            continue;
        }
        float inv = 127.0f / amax;
        for (size_t j = 0; j < dim; j++) {
            /* The clamp also maps a NaN element to -127 (fmaxf picks the number). */
            float v = fminf(fmaxf(xr[j] * inv, -127.0f), 127.0f);
            qr[j] = (int8_t)lrintf(v);
        }
    }
    return true;
}

/* Sends step s's hidden states (rows, dim) on to the next stage as ACT, with the sequences'
 * metadata, the reply address and the compute time so far. The envelope's session is the step
 * id, so an ACT nobody receives comes back as an ERROR (act_bounced). The frame is encoded into
 * st->enc and copied into a pooled runtime message. Returns SH_OK or the send's error (the ACT
 * was not sent). Worker thread. */
static sh_err act_forward(stage_state *st, const sh_msg_hdr *h, const sh_proto_step *s,
                          const float *hidden, sh_addr reply, uint64_t compute_us, sh_error *e)
{
    uint32_t rows = 0;
    for (uint32_t i = 0; i < s->seqs.n; i++)
        rows += s->seqs.v[i].tokens.n;
    uint64_t n = (uint64_t)rows * (uint64_t)st->dim;
    sh_proto_act a = {.step = s->step,
                      .deadline_ms = s->deadline_ms,
                      .seqs = s->seqs,
                      .hidden = {.dtype = SH_PROTO_DTYPE_F32,
                                 .ndim = 2,
                                 .shape = {rows, (uint64_t)st->dim},
                                 .data = hidden,
                                 .nbytes = n * sizeof(float)},
                      .reply_to = reply,
                      .compute_us = compute_us,
                      .epoch = s->epoch};
    if (st->link_dtype != SH_PROTO_DTYPE_F32) {
        if (!act_narrow(st, hidden, rows))
            return sh__error_set(e, SH_ENOMEM, "stage: step %" PRIu64 ": %u hidden rows to send",
                                 s->step, (unsigned)rows);
        a.hidden.dtype = st->link_dtype;
        a.hidden.data = st->lnk;
        a.hidden.nbytes = n * sh__proto_dtype_size(st->link_dtype);
        if (st->link_dtype == SH_PROTO_DTYPE_I8)
            a.scales = (sh_f32s){st->scl, rows};
    }
    sh_msg_hdr ah = {.type = SH_MSG_ACT,
                     .session = s->step,
                     .src = st->self,
                     .dst = __atomic_load_n(&st->next, __ATOMIC_ACQUIRE),
                     .trace_id = h->trace_id};
    sh__buf_reset(&st->enc);
    sh_err err = sh__proto_encode(&st->enc, &ah, &a, e);
    if (err)
        return err;
    /* The body follows the envelope's first seven fields, which are the same bytes again. */
    uint8_t env[64];
    sh_buf eb;
    sh__buf_init_fixed(&eb, env, sizeof env);
    sh__msg_put_header(&eb, &ah);
    if (eb.failed || eb.len >= st->enc.len)
        return sh__error_set(e, SH_EPROTO, "stage: step %" PRIu64 ": ACT envelope", s->step);
    if ((err = sh_send(st->rt, &ah, st->enc.data + eb.len, st->enc.len - eb.len, e)))
        return err;
    if (st->m_bytes && st->m_hidden) {
        sh_counter_add(st->m_bytes, st->enc.len - eb.len);
        sh_counter_add(st->m_hidden, a.hidden.nbytes + (uint64_t)a.scales.n * sizeof(float));
    }
    st->sent[st->n_sent++ % STAGE_SENT_RING] =
        (sent_step){.step = s->step, .trace = h->trace_id, .reply = reply};
    return SH_OK;
}

/* Sends STEP_DONE d to `to` (a failed one when err != 0, with e's message). Worker thread. */
static void done_send(stage_state *st, sh_addr to, uint64_t trace, sh_proto_step_done *d,
                      sh_err err, const sh_error *e)
{
    if (err) {
        d->status = (int32_t)err;
        d->message = (sh_strv){e->msg, (uint32_t)strnlen(e->msg, sizeof e->msg)};
        d->seqs = (sh_proto_step_out_list){NULL, 0};
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "stage_step_failed",
                       "step=%" PRIu64 " code=%d error=\"%s\"", d->step, (int)err, e->msg);
    }
    if (to == SH_ADDR_NONE) {
        sh_runtime_log(st->rt, SH_LOG_LEVEL_ERROR, "stage_no_reply",
                       "step=%" PRIu64 " error=\"no address to answer STEP_DONE to\"", d->step);
        return;
    }
    sh_error se = {0};
    if (sh__act_send(st->rt, st->self, to, SH_MSG_STEP_DONE, trace, d, &se))
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "stage_send_failed",
                       "step=%" PRIu64 " error=\"%s\"", d->step, se.msg);
}

/* An ACT this stage sent could not be delivered (the runtime or the next node answered ERROR
 * with the ACT's session, the step id): the step's STEP_DONE fails with the error's code. */
static void act_bounced(stage_state *st, const sh_msg *m)
{
    const sh_msg_hdr *h = sh_msg_header(m);
    sh_proto_body b;
    sh_error e = {0};
    if (sh__act_decode(&st->dec, m, &b, &e) || b.error.type != SH_MSG_ACT)
        return;
    uint32_t n = st->n_sent < STAGE_SENT_RING ? st->n_sent : STAGE_SENT_RING;
    for (uint32_t i = 0; i < n; i++) {
        sent_step *ss = &st->sent[(st->n_sent - 1 - i) % STAGE_SENT_RING];
        if (ss->step != h->session)
            continue;
        sh_proto_step_done d = {.step = ss->step};
        sh__error_set(&e, SH_EIO, "stage: step %" PRIu64 ": the next stage: %.*s", ss->step,
                      (int)b.error.message.len, b.error.message.ptr);
        done_send(st, ss->reply, ss->trace, &d, (sh_err)b.error.code, &e);
        ss->step = 0;
        return;
    }
}

/* Whether a STEP that arrived at arrived_us is a retry of a step this stage answered (or
 * forwarded) after that: the batcher sent it only because the first try was slow, and the
 * answer it waits for is on its way, so running it again would only delay the steps behind it.
 * A retry sent after the answer was lost arrives after it and runs. Worker thread. */
static bool retry_answered(const stage_state *st, const sh_proto_step *s, uint64_t arrived_us)
{
    if (!s->retry_of)
        return false;
    uint32_t n = st->n_done < STAGE_DONE_RING ? st->n_done : STAGE_DONE_RING;
    for (uint32_t i = 0; i < n; i++) {
        const done_step *d = &st->done[(st->n_done - 1 - i) % STAGE_DONE_RING];
        if (d->root == s->retry_of)
            return d->us > arrived_us;
    }
    return false;
}

/* Whether STEP or ACT s (from h->src) may raise the stage's epoch: the epoch is the id of the
 * first step after its batcher's pause or start, so a legitimate one never exceeds the step's own
 * id, and step ids count from the batcher's clock (Unix ms << 16), so none lies more than a day
 * ahead of this node's. A STEP comes from the front's batcher (control_node) when one is known,
 * or from the replica's drafter on its own node (drafter_node);
 * an ACT's sender is the previous stage, which checked the STEP. Anything else would let one
 * frame make the stage drop every real step as stale (issue 25). */
static bool epoch_allowed(const stage_state *st, const sh_msg_hdr *h, const sh_proto_step *s,
                          bool is_act)
{
    if (!is_act && st->control_node && sh_addr_node(h->src) != st->control_node &&
        (!st->drafter_node || sh_addr_node(h->src) != st->drafter_node))
        return false;
    const uint64_t day_ms = 86400000ull;
    uint64_t horizon = (sh__act_unix_ms() + day_ms) << 16;
    return s->epoch <= s->step && s->step <= horizon;
}

/* Whether step s (not a follower's) belongs to an epoch older than the newest one seen (run
 * or arrived): it was abandoned at its batcher's pause, the sequences it holds run again from
 * the resume (with a newer epoch) and its blocks may belong to others by now. It is dropped
 * unanswered: the batcher forgot it. `when` says whether it was dropped queued or after it ran
 * (for the log). Worker thread. */
static bool stale(stage_state *st, const sh_proto_step *s, const char *when)
{
    uint64_t in = atomic_load_explicit(&st->epoch_in, memory_order_acquire);
    uint64_t newest = in > st->epoch ? in : st->epoch;
    if (s->epoch >= newest)
        return false;
    if (st->m_stale)
        sh_counter_add(st->m_stale, 1);
    sh_runtime_log(st->rt, SH_LOG_LEVEL_DEBUG, "stale_epoch",
                   "step=%" PRIu64 " epoch=%" PRIu64 " seen=%" PRIu64 " when=%s", s->step, s->epoch,
                   newest, when);
    return true;
}

/* Loop thread, as STEP or ACT m is queued for the worker: raises epoch_in to its epoch when that
 * is newer and allowed (epoch_allowed, as the worker judges it). Reads only the body's step id and
 * epoch; a body that does not show them leaves epoch_in as it is (the worker's decode judges the
 * frame). */
static void note_epoch(stage_state *st, const sh_msg *m)
{
    static const char *const keys[2] = {"step", "ep"};
    const sh_msg_hdr *h = sh_msg_header(m);
    size_t len = 0;
    const void *body = sh_msg_body(m, &len);
    uint64_t v[2] = {0, 0};
    if (sh__proto_peek_u64s(body, len, keys, 2, v) != 3)
        return;
    sh_proto_step view = {.step = v[0], .epoch = v[1]};
    uint64_t in = atomic_load_explicit(&st->epoch_in, memory_order_relaxed);
    if (view.epoch > in && epoch_allowed(st, h, &view, h->type == SH_MSG_ACT))
        atomic_store_explicit(&st->epoch_in, view.epoch, memory_order_release);
}

/* Decodes and runs one kept STEP or ACT: a middle stage forwards ACT, the last (or any stage
 * failing) answers STEP_DONE to the STEP's sender or the ACT's reply_to. Worker thread. */
static void step_answer(stage_state *st, const sh_msg *m, uint64_t arrived_us)
{
    uint64_t t0 = sh__act_mono_us();
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type == SH_MSG_ERROR) {
        act_bounced(st, m);
        return;
    }
    if (h->type == SH_MSG_CONTROL) {
        regroup_apply(st, m);
        return;
    }
    bool is_act = h->type == SH_MSG_ACT;
    sh_proto_body b;
    sh_proto_step_done d = {.step = h->session};
    sh_proto_step view;
    const sh_proto_step *s = NULL;
    const float *hidden_in = NULL, *hidden = NULL;
    sh_addr reply = is_act ? st->batcher : h->src;
    uint64_t prior_us = 0;
    sh_error e = {0};
    sh_err err = sh__act_decode(&st->dec, m, &b, &e);
    if (err) {
        err = SH_EPROTO;
    } else if (!is_act) {
        s = &b.step;
        prior_us = b.step.compute_us; /* a drafter's time before this stage */
        /* A drafter on another node than the batcher names it; with a known front, only an
         * address on the front's node is taken, so a STEP cannot send answers elsewhere. */
        if (b.step.reply_to != SH_ADDR_NONE &&
            (!st->control_node || sh_addr_node(b.step.reply_to) == st->control_node))
            reply = b.step.reply_to;
    } else {
        view = (sh_proto_step){.step = b.act.step,
                               .deadline_ms = b.act.deadline_ms,
                               .seqs = b.act.seqs,
                               .epoch = b.act.epoch};
        s = &view;
        if (b.act.reply_to != SH_ADDR_NONE)
            reply = b.act.reply_to;
        prior_us = b.act.compute_us;
    }
    /* A rank other than its group's leader takes what the leader ran, unchecked: the leader made
     * these checks, and the ranks must run the same steps in the same order. */
    bool follower = st->tp_rank > 0;
    if (s)
        sh_runtime_log(st->rt, SH_LOG_LEVEL_DEBUG, "stage_step",
                       "type=%s step=%" PRIu64 " epoch=%" PRIu64 " retry_of=%" PRIu64 " seqs=%u",
                       sh__msg_type_name(h->type), s->step, s->epoch, s->retry_of,
                       (unsigned)s->seqs.n);
    if (s && !follower && s->epoch > st->epoch && !epoch_allowed(st, h, s, is_act)) {
        sh__peers_refuse(st->rt, SH__PEERS_EPOCH, sh_addr_node(h->src), sh__msg_type_name(h->type));
        return;
    }
    if (s && !follower && stale(st, s, "queued"))
        return;
    if (s && !follower && !is_act && retry_answered(st, s, arrived_us)) {
        if (st->m_retry_dropped)
            sh_counter_add(st->m_retry_dropped, 1);
        sh_runtime_log(st->rt, SH_LOG_LEVEL_DEBUG, "stage_retry_dropped",
                       "step=%" PRIu64 " retry_of=%" PRIu64, s->step, s->retry_of);
        return;
    }
    uint64_t group_t0 = 0; /* when the group was ready: the step's time in it from here */
    if (s) {
        st->epoch = s->epoch;
        d.step = s->step;
        st->group_failed = false;
        /* A group: the leader hands the step to every rank, and each makes sure its group (of
         * the epoch the leader chose) and its context exist. */
        bool grouped = false;
        if (st->tp_size > 1 && s->seqs.n > 0) {
            uint32_t gen = follower ? (uint32_t)h->session : group_gen(st, s->epoch);
            if (!follower)
                group_forward(st, m, gen);
            err = group_ready(st, gen, &e);
            grouped = !err;
            st->group_failed = err != SH_OK;
            group_t0 = grouped ? uv_hrtime() : 0;
        }
        if (!err && is_act == st->first)
            err = sh__error_set(&e, SH_EINVAL, "stage: layers [%d, %d) take %s, not %s",
                                (int)st->model->first, (int)st->model->last,
                                st->first ? "STEP" : "ACT", sh__msg_type_name(h->type));
        else if (!err && is_act && s->seqs.n > 0)
            err = act_hidden(st, &b.act, &hidden_in, &e);
        if (!err)
            err = step_run(st, s, hidden_in, &d, &hidden, &e);
        else if (grouped) /* the other ranks wait for this one's verdict */
            err = group_agree(st, s, err, &e);
    }
    if (st->tp_size > 1) { /* the step's time first: a report in between never shows more wait */
        if (group_t0)
            group_step_time(st, uv_hrtime() - group_t0);
        group_count(st);
    }
    /* A step the group could not run (a rank dead, stopped or gone) is not answered, as a dead
     * stage's is not: the watchdog pauses the replica (the step is abandoned), or the batcher
     * sends it again after its retry deadline and the group forms anew. An answer would make the
     * batcher retry at once and then fail the step's requests, perhaps before the pause. */
    if (err && st->group_failed && !follower) {
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "tp_step_unanswered",
                       "step=%" PRIu64 " code=%d error=\"%s\"", d.step, (int)err, e.msg);
        return;
    }
    if (follower) {
        if (err)
            sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "stage_step_failed",
                           "step=%" PRIu64 " rank=%d code=%d error=\"%s\"", d.step,
                           (int)st->tp_rank, (int)err, e.msg);
        return;
    }
    d.compute_us = prior_us + (sh__act_mono_us() - t0);
    /* A step whose epoch ended while it ran is not forwarded: the next stage would spend a
     * step's compute on it before the steps of the resume. */
    if (!err && !st->last && s->seqs.n > 0 && stale(st, s, "run"))
        return;
    /* An empty step has no rows to forward: any stage answers it at once. */
    if (!err && !st->last && s->seqs.n > 0)
        err = act_forward(st, h, s, hidden, reply, d.compute_us, &e);
    if (!err && !is_act) /* answered or forwarded: remembered for its retries */
        st->done[st->n_done++ % STAGE_DONE_RING] =
            (done_step){.root = s->retry_of ? s->retry_of : s->step, .us = sh__act_mono_us()};
    if (!err && !st->last && s->seqs.n > 0)
        return;
    done_send(st, reply, h->trace_id, &d, err, &e);
}

/* The worker's run: one kept message, in arrival order (the worker frees it). */
static void worker_run(void *user, const sh_msg *m, uint64_t arrived_us)
{
    step_answer(user, m, arrived_us);
}

/* Stops and joins the sampling helper, if it runs. */
static void helper_stop(stage_state *st)
{
    if (!st->helper_ok)
        return;
    uv_mutex_lock(&st->hmu);
    st->hquit = true;
    uv_cond_signal(&st->hcv);
    uv_mutex_unlock(&st->hmu);
    uv_thread_join(&st->helper);
    uv_cond_destroy(&st->hdone);
    uv_cond_destroy(&st->hcv);
    uv_mutex_destroy(&st->hmu);
    st->helper_ok = false;
}

/* ---- vtable ---- */

/* Frees what init allocated (every pointer may be NULL). */
static void free_buffers(stage_state *st)
{
    for (int32_t i = 0; st->slots && i < st->n_slots; i++) {
        sh_sampler_destroy(st->slots[i].s);
        if (st->gram)
            sh__sgram_seq_clear(st->gram, &st->slots[i].gram);
    }
    sh__sgram_free(st->gram);
    sh__act_decoder_fini(&st->dec);
    sh__act_decoder_fini(&st->ctl);
    free(st->tok);
    free(st->blk);
    free(st->seqs);
    free(st->smp);
    free(st->sl);
    free(st->again);
    free(st->ban);
    free(st->acc);
    free(st->moved);
    free(st->more);
    free(st->more_lp);
    free(st->more_lr);
    free(st->samples);
    free(st->out);
    free(st->fail);
    free(st->fail_msg);
    free(st->top_tok);
    free(st->top_lp);
    free(st->slots);
    free(st->row);
    free(st->hid);
    free(st->emb);
    free(st->emb_acc);
    free(st->lnk);
    free(st->scl);
    free(st->urls);
    free(st->m_expert);
    free(st->expert_seen);
    sh__buf_fini(&st->enc);
}

/* MoE models: one shoal_moe_expert_tokens_total series per (layer of the stage, expert), the
 * per-expert load of the router (a stage reports only its own layers). Returns SH_ENOMEM. */
static sh_err expert_metrics(stage_state *st)
{
    const sh_llama *m = st->model;
    const size_t n = (size_t)(m->last - m->first) * (size_t)m->hp.n_expert;
    st->m_expert = calloc(n, sizeof *st->m_expert);
    st->expert_seen = calloc(n, sizeof *st->expert_seen);
    if (!st->m_expert || !st->expert_seen)
        return SH_ENOMEM;
    sh_metrics *mx = sh_runtime_metrics(st->rt);
    for (int32_t l = m->first; l < m->last; l++) {
        const uint64_t *tot = st->ctx ? sh_llama_ctx_expert_tokens(st->ctx, l) : NULL;
        for (int32_t x = 0; x < m->hp.n_expert; x++) {
            const size_t i = (size_t)(l - m->first) * m->hp.n_expert + x;
            char labels[64];
            snprintf(labels, sizeof labels, "layer=\"%d\",expert=\"%d\"", (int)l, (int)x);
            sh_err err = sh_metrics_counter(mx, "shoal_moe_expert_tokens_total",
                                            "Tokens the MoE router sent to each expert of a layer.",
                                            labels, &st->m_expert[i]);
            if (err == SH_ENOMEM)
                return err;
            st->expert_seen[i] = tot ? tot[x] : 0; /* count from now on */
        }
    }
    return SH_OK;
}

/* Loop thread. Sizes every buffer from the context and starts the worker. */
static sh_err stage_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    stage_state *st = state;
    const sh_stage_args *a = arg;
    bool group = a && a->tp_size > 1;
    if (!a || !a->model || !a->ctx == !group || a->max_seqs <= 0) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_init_failed",
                     "error=\"needs a model, a context (none for a group) and max_seqs > 0\"");
        return SH_EINVAL;
    }
    if (group && (a->tp_size > SH_COLL_MAX_RANKS || a->tp_rank < 0 || a->tp_rank >= a->tp_size ||
                  !a->tp_ranks || !a->coll || !a->be || !a->ctx_opts || a->n_blocks <= 0)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_init_failed",
                     "error=\"rank %d of %d: a group needs its ranks, its collective options, a "
                     "backend, context options and a block count\"",
                     (int)a->tp_rank, (int)a->tp_size);
        return SH_EINVAL;
    }
    bool last = a->model->last == a->model->hp.n_layers;
    if (last != (a->next == SH_ADDR_NONE)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_init_failed",
                     "error=\"layers [%d, %d) of %d: %s\"", (int)a->model->first,
                     (int)a->model->last, (int)a->model->hp.n_layers,
                     last ? "the last stage has no next stage" : "needs the next stage's address");
        return SH_EINVAL;
    }
    if (a->link_dtype != SH_PROTO_DTYPE_F32 && a->link_dtype != SH_PROTO_DTYPE_F16 &&
        a->link_dtype != SH_PROTO_DTYPE_I8) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_init_failed",
                     "error=\"link dtype %u: expected F32 (0), F16 (1) or I8 (24)\"",
                     (unsigned)a->link_dtype);
        return SH_EINVAL;
    }
    st->rt = sh_actor_runtime(ctx);
    st->self = sh_actor_self(ctx);
    st->link_dtype = a->link_dtype;
    st->auth = a->auth;
    if (a->model->first == 0)
        sh_metrics_counter(sh_runtime_metrics(st->rt), "shoal_stage_retries_dropped_total",
                           "Retried steps a first stage dropped because it had answered an "
                           "earlier try after the retry arrived.",
                           NULL, &st->m_retry_dropped);
    sh_metrics_counter(sh_runtime_metrics(st->rt), "shoal_stage_stale_steps_dropped_total",
                       "Steps and activations a stage dropped because their batcher had paused "
                       "since it sent them (an older epoch than one that reached the stage).",
                       NULL, &st->m_stale);
    if (!last) {
        /* One series per link, named by the receiving stage's first layer. */
        static const char *const names[] = {"f32", "f16", "int8"};
        const char *dn = names[a->link_dtype == SH_PROTO_DTYPE_I8    ? 2
                               : a->link_dtype == SH_PROTO_DTYPE_F16 ? 1
                                                                     : 0];
        char labels[64];
        snprintf(labels, sizeof labels, "layer=\"%d\",dtype=\"%s\"", (int)a->model->last, dn);
        sh_metrics *mx = sh_runtime_metrics(st->rt);
        sh_metrics_counter(mx, "shoal_act_bytes_total",
                           "Bytes of ACT bodies a stage sent to the next (per link).", labels,
                           &st->m_bytes);
        sh_metrics_counter(mx, "shoal_act_hidden_bytes_total",
                           "Bytes of hidden rows and row scales in the ACT a stage sent.", labels,
                           &st->m_hidden);
    }
    st->next = a->next;
    st->control_node = a->control_node;
    st->drafter_node = a->drafter_node;
    st->batcher = a->batcher;
    st->first = a->model->first == 0;
    st->last = last;
    st->model = a->model;
    st->ctx = a->ctx;
    st->max_seqs = a->max_seqs;
    st->n_vocab = a->model->hp.n_vocab;
    st->dim = a->model->hp.dim;
    sh__buf_init(&st->enc);
    st->tp_rank = group ? a->tp_rank : 0;
    st->tp_size = group ? a->tp_size : 1;
    if (group) {
        memcpy(st->tp_ranks, a->tp_ranks, (size_t)a->tp_size * sizeof *st->tp_ranks);
        st->tp_ranks[a->tp_rank] = st->self;
        st->leader = st->tp_ranks[0];
        st->coll_kind = (sh_coll_kind)a->coll_kind;
        st->coll_opts = *a->coll;
        if (a->coll->urls && st->coll_kind == SH_COLL_NET) /* copied: a REGROUP rewrites them */
            st->urls = calloc((size_t)a->tp_size, sizeof *st->urls);
        for (int32_t r = 0; st->urls && r < a->tp_size; r++) {
            snprintf(st->urls[r], sizeof st->urls[r], "%s", a->coll->urls[r]);
            st->url_of[r] = st->urls[r];
            st->coll_opts.urls = st->url_of;
        }
        st->be = a->be;
        st->ctx_opts = *a->ctx_opts;
        st->want_blocks = a->n_blocks;
    }
    st->n_blocks = group ? a->n_blocks : sh_llama_ctx_n_blocks(a->ctx);
    if (group) { /* one series set per rank, named by the stage's first layer */
        static const char *const names[7][2] = {
            {"shoal_tp_collectives_total", "Collectives a tensor-parallel rank completed."},
            {"shoal_tp_collective_failures_total", "Collectives a tensor-parallel rank failed."},
            {"shoal_tp_collective_bytes_total",
             "Bytes a tensor-parallel rank passed to its collectives."},
            {"shoal_tp_collective_wire_bytes_total",
             "Bytes a tensor-parallel rank sent over the network collective's links."},
            {"shoal_tp_collective_wait_microseconds_total",
             "Microseconds a tensor-parallel rank spent inside collectives."},
            {"shoal_tp_groups_formed_total",
             "Times a tensor-parallel rank formed its group (the first step, then new epochs)."},
            {"shoal_tp_step_microseconds_total",
             "Microseconds a tensor-parallel rank spent on steps once its group was ready "
             "(collectives included)."}};
        char labels[64];
        snprintf(labels, sizeof labels, "layer=\"%d\",rank=\"%d\"", (int)a->model->first,
                 (int)a->tp_rank);
        for (int i = 0; i < 7; i++)
            sh_metrics_counter(sh_runtime_metrics(st->rt), names[i][0], names[i][1], labels,
                               &st->m_coll[i]);
    }
    st->max_tok = st->n_blocks * SH_KV_BLOCK_TOKENS;
    st->tab_len = a->max_blocks_per_seq > 0 ? a->max_blocks_per_seq : st->n_blocks;
    st->n_slots = 2 * a->max_seqs;
    size_t S = (size_t)a->max_seqs, L = SH_SAMPLER_MAX_LOGPROBS;
    st->tok = malloc((size_t)st->max_tok * sizeof *st->tok);
    st->blk = malloc(S * (size_t)st->tab_len * sizeof *st->blk);
    st->seqs = calloc(S, sizeof *st->seqs);
    st->smp = calloc(S, sizeof *st->smp);
    st->sl = calloc(S, sizeof *st->sl);
    st->again = calloc(S, sizeof *st->again);
    st->ban = calloc(S * SH_PROTO_MAX_BAN, sizeof *st->ban);
    st->acc = calloc(S, sizeof *st->acc);
    st->moved = calloc(S, sizeof *st->moved);
    st->more = calloc(S * SH_SPEC_MAX_K, sizeof *st->more);
    st->more_lp = calloc(S * SH_SPEC_MAX_K, sizeof *st->more_lp);
    st->more_lr = calloc(S * SH_SPEC_MAX_K, sizeof *st->more_lr);
    st->samples = calloc(S, sizeof *st->samples);
    st->out = calloc(S, sizeof *st->out);
    st->fail = calloc(S, sizeof *st->fail);
    st->fail_msg = calloc(S, sizeof *st->fail_msg);
    st->top_tok = malloc(S * L * sizeof *st->top_tok);
    st->top_lp = malloc(S * L * sizeof *st->top_lp);
    st->slots = calloc((size_t)st->n_slots, sizeof *st->slots);
    st->row = calloc(S, sizeof *st->row);
    sh_error gre = {0};
    if (sh__sgram_create(a->model, st->n_vocab, st->n_slots, &st->gram, &gre))
        st->gram = NULL;
    sh_err err = SH_ENOMEM;
    if (!st->tok || !st->blk || !st->seqs || !st->smp || !st->sl || !st->again || !st->ban ||
        !st->acc || !st->moved || !st->more || !st->more_lp || !st->more_lr || !st->samples ||
        !st->out || !st->fail || !st->fail_msg || !st->gram || !st->top_tok || !st->top_lp ||
        !st->slots || !st->row ||
        (group && a->coll->urls && st->coll_kind == SH_COLL_NET && !st->urls) ||
        sh__act_decoder_init(&st->dec, STAGE_ARENA_BYTES) || sh__act_decoder_init(&st->ctl, 4096))
        goto fail;
    if (a->model->hp.n_expert > 0 && (err = expert_metrics(st)))
        goto fail;
    // The sampling helper is an optimisation: without it the worker samples everything.
    if (last && a->max_seqs >= PARALLEL_SAMPLES && !uv_mutex_init(&st->hmu)) {
        if (uv_cond_init(&st->hcv)) {
            uv_mutex_destroy(&st->hmu);
        } else if (uv_cond_init(&st->hdone)) {
            uv_cond_destroy(&st->hcv);
            uv_mutex_destroy(&st->hmu);
        } else if (uv_thread_create(&st->helper, helper_main, st)) {
            uv_cond_destroy(&st->hdone);
            uv_cond_destroy(&st->hcv);
            uv_mutex_destroy(&st->hmu);
        } else {
            st->helper_ok = true;
        }
    }
    sh_error we = {0};
    err = sh__act_worker_start(&st->worker, "shoal-stage", STAGE_QUEUE_INIT, worker_run, st, &we);
    if (err) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_init_failed", "error=\"%s\"", we.msg);
        helper_stop(st);
        goto fail;
    }
    return SH_OK;
fail:
    free_buffers(st);
    memset(st, 0, sizeof *st);
    return err;
}

/* CONTROL from the control node, on the loop thread: REROUTE (the next stage moved: a standby
 * took it over; the worker sends its next ACT there) is done here; REGROUP (a standby took a
 * rank's place in this stage's group) moves the leader the loop thread checks frames against at
 * once and is kept for the worker (regroup_apply), in order with the steps. Returns the
 * message's fate. */
static sh_msg_fate control(sh_actor_ctx *ctx, stage_state *st, sh_msg *m)
{
    sh_proto_body b;
    sh_error e = {0};
    uint32_t node = sh_addr_node(sh_msg_header(m)->src);
    bool ok = st->control_node && node == st->control_node && !sh__act_decode(&st->ctl, m, &b, &e);
    if (ok && b.control.op == SH_PROTO_CONTROL_OP_REROUTE && !st->last &&
        b.control.targets.n == 1) {
        sh_addr to = sh_u64s_at(b.control.targets, 0);
        __atomic_store_n(&st->next, to, __ATOMIC_RELEASE);
        sh_actor_log(ctx, SH_LOG_LEVEL_INFO, "stage_rerouted", "next=%" PRIu64, (uint64_t)to);
        return SH_MSG_FATE_DONE;
    }
    if (ok && b.control.op == SH_PROTO_CONTROL_OP_REGROUP && regroup_fits(st, &b.control, NULL)) {
        __atomic_store_n(&st->leader, sh_u64s_at(b.control.targets, 0), __ATOMIC_RELEASE);
        if (!sh__act_worker_push(&st->worker, m))
            return SH_MSG_FATE_KEPT;
    }
    sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "stage_control_dropped", "from_node=%u op=%u",
                 (unsigned)node, ok ? (unsigned)b.control.op : 0u);
    return SH_MSG_FATE_DONE;
}

/* Loop thread; never blocks on a step: a STEP or ACT is kept and queued for the worker, which
 * frees it. So is an ERROR with a session (an ACT of ours that bounced), so that the worker, who
 * remembers the steps it forwarded, answers it in order. */
static sh_msg_fate stage_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    stage_state *st = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    sh_msg_type type = h->type;
    if (type == SH_MSG_ERROR && (st->last || h->session == 0))
        return SH_MSG_FATE_DONE;
    if (type == SH_MSG_CONTROL)
        return control(ctx, st, m);
    if (type != SH_MSG_STEP && type != SH_MSG_ACT && type != SH_MSG_ERROR) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "stage_unexpected", "type=%s",
                     sh__msg_type_name(type));
        return SH_MSG_FATE_DONE;
    }
    // A group's other ranks take steps from its leader only; they send nothing that could bounce.
    if (st->tp_rank > 0) {
        if (type == SH_MSG_ERROR)
            return SH_MSG_FATE_DONE;
        if (h->src != __atomic_load_n(&st->leader, __ATOMIC_ACQUIRE)) {
            sh__peers_refuse(st->rt, SH__PEERS_TP_NOT_LEADER, sh_addr_node(h->src),
                             sh__msg_type_name(type));
            return SH_MSG_FATE_DONE;
        }
    }
    // With a cluster key, only nodes that proved it are served; the rest is dropped unanswered
    // (an answer would tell an unauthenticated sender about this node's steps).
    if (type != SH_MSG_ERROR &&
        !sh__hello_auth_allows(st->auth, st->rt, h->src, sh__msg_type_name(type)))
        return SH_MSG_FATE_DONE;
    if (st->tp_rank == 0 && type != SH_MSG_ERROR)
        note_epoch(st, m);
    if (sh__act_worker_push(&st->worker, m)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "stage_queue_full", "error=\"out of memory\"");
        return SH_MSG_FATE_DONE;
    }
    return SH_MSG_FATE_KEPT;
}

/* Loop thread. Lets the worker finish the step it runs, joins it and frees the STEPs it did not
 * take. */
static void stage_stop(sh_actor_ctx *ctx, void *state)
{
    stage_state *st = state;
    sh__act_worker_stop(&st->worker);
    helper_stop(st);
    if (st->tp_size > 1) { /* the group's context is the actor's own */
        sh_llama_ctx_destroy(st->ctx);
        sh_coll_destroy(st->coll);
    }
    free_buffers(st);
}

const sh_actor_vtable sh__stage_vtable = {
    .name = "stage",
    .state_size = sizeof(stage_state),
    .init = stage_init,
    .handle = stage_handle,
    .stop = stage_stop,
};
