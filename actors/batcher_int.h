/* The batcher's internals (actors/batcher.c says what it does): the state of its requests,
 * sequences and steps in flight, shared by batcher.c (requests, reports, the actor),
 * batcher_plan.c (queue, admission, preemption, planning and dispatch of steps) and
 * batcher_step.c (STEP_DONE, failed and timed-out steps). Every function runs on the batcher's
 * loop thread. */
#ifndef SH_ACTORS_BATCHER_INT_H
#define SH_ACTORS_BATCHER_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "model/spec.h"
#include "model/tokenizer.h"
#include "net/openai.h"

#define TIMER_FORM 1
#define TIMER_DEADLINE 2
#define TIMER_REPORT 3
#define DEADLINE_TICK_MS 100

typedef enum seq_state {
    SEQ_WAITING = 0, /* in the queue, no KV */
    SEQ_RUNNING,     /* in the running set */
    SEQ_FINISHED,
} seq_state;

typedef struct breq breq;

typedef struct bseq {
    breq *r;
    int32_t choice;
    seq_state state;
    uint64_t kv_id;     /* 0: holds no KV */
    int32_t *toks;      // (cap) prompt then generated tokens, then this step's drafts
    int32_t n_toks;     /* prompt + generated */
    int32_t n_gen;      /* generated tokens (sent to the gateway) */
    int32_t n_computed; /* positions whose KV is in the cache */
    int32_t n_reserved; /* positions reserved in the block table */
    int32_t n_marked;   /* computed count last reported to the kvmgr */
    int32_t n_cached;   /* prompt positions found in the prefix cache at admission */
    int32_t *blocks;    // (max_blocks) block table copy
    int32_t n_blocks;
    /* this step */
    bool planned, in_step, alloc_ok, sampled;
    int32_t step_k;
    int32_t fl_slot, fl_pos; /* while in_step: its flight and its place in the flight's order */
    bool fork_pending;       /* waits for the first choice's prompt to be computed */
    bool short_kv;           /* this step's reservation was refused for want of blocks */
    /* Speculative decoding. A step's drafts sit in toks[n_toks .. n_toks + step_draft), after the
     * last token, untouched until the step's answer, so that every try sends the same ones. Their
     * KV positions are reserved by a KV_ALLOC of their own (draft_alloc, the last of kv_wait
     * replies due), whose refusal only drops the drafts. n_reserved exceeds n_computed + 1 after
     * drafts were rejected: the next KV_ALLOC gives those positions back (keep) first. */
    sh_spec_seq spec;
    int32_t step_draft;   /* drafted tokens this step (0: none) */
    int32_t n_pooled;     /* tokens of toks given to the replica's n-gram pool */
    int32_t kv_wait;      /* KV_ALLOC replies due for this plan */
    bool draft_alloc;     /* the last of them reserves the drafts' positions */
    uint64_t queued_us;   /* when it last began to wait: arrival, or its latest preemption */
    uint64_t admitted_us; /* when it last joined the running set */
    uint64_t queued_step, admitted_step; /* the batcher's step count at those times */
    bool relieved; /* admitted ahead of the queue as starving: spared by shortages for a slice */
    bool held_kv;  /* was ever granted KV blocks (true for good: a preempted one too) */
    bool admitted_once; /* its queue wait is in shoal_queue_wait_seconds */
    sh_tokenizer_stream *detok;
    sh_openai_stopper stop;
    /* An embedding (breq.embed): the pooled parts of the chunks answered since its admission
     * (emb_has), summed in emb_sum (emb_dim), and the final unit vector DONE carries. */
    double *emb_sum;
    float *emb_vec;
    int32_t emb_dim;
    bool emb_has;
    struct bseq *next; /* queue link */
} bseq;

struct breq {
    uint64_t id;
    sh_addr reply_to;
    uint64_t trace;
    uint8_t prio;
    uint64_t arrival;
    uint64_t deadline_ms;
    int32_t n_prompt;
    int32_t max_tokens;
    int32_t min_tokens; /* end-of-sequence tokens are ordinary tokens before this many */
    int32_t min_mask;   /* and are masked (never sampled) before this many */
    int32_t n_choices, n_finished;
    int32_t shared; /* prompt positions choices > 0 fork from choice 0 */
    bool cancelled;
    uint8_t embed; /* SUBMIT's embed: a prefill whose pooled hidden states are the answer */
    sh_proto_sampling samp; /* stop, bias and grammar point into owned memory below */
    sh_strv stop_v[SH_PROTO_MAX_STOP];
    sh_proto_logit_bias *bias;
    char *grammar;
    uint64_t gram_hash; /* sh__sgram_text_hash of grammar: how steps after the first name it */
    char *stop_mem;
    bseq *seqs; // (n_choices)
    breq *next_live;
};

#define STEP_TRIES_MAX 16 /* tries of one step remembered (the first and up to 15 retries) */

/* A step in flight: sent, its STEP_DONE not yet handled. order[i] is the step's i-th sequence
 * (NULL once retired: a failure of another step can end its request meanwhile). A step that was
 * not answered in time is sent again under a new id (a try); an answer to any try is its answer. */
typedef struct flight {
    uint64_t step;     /* the latest try's id; 0: this slot is free */
    uint64_t sent_us;  /* when the latest try was sent */
    uint64_t first_us; /* when the first try was sent */
    int32_t n;
    int32_t n_tok;                     /* tokens the step computes */
    int32_t n_tries;                   /* tries sent, 1 + retries */
    uint64_t tries[STEP_TRIES_MAX];    /* their step ids, oldest first */
    uint64_t tries_us[STEP_TRIES_MAX]; /* and when each was sent */
    bseq **order;                      // (max_seqs)
} flight;

typedef struct batcher {
    sh_batcher_args a;
    sh_actor_ctx *ctx;
    sh_act_decoder dec;
    breq *live; /* every request not yet finished */
    int32_t n_reqs;
    bseq *queue; /* waiting sequences, by (prio, arrival) */
    int32_t n_waiting;
    bseq **running; // (max_seqs)
    int32_t n_running;
    int32_t max_blocks;
    uint64_t next_kv_id, arrivals, step_no;
    uint64_t epoch; /* STEP's epoch: the first step id of the latest pause (or of init) */
    int32_t eog[SH_PROTO_MAX_BAN]; /* the vocabulary's end-of-sequence ids (masked before
                                    * min_tokens) */
    int32_t n_eog;
    int32_t avail_est; /* free + evictable KV blocks, from the kvmgr's last reply */
    int32_t allocs_out;
    /* CONTROL PAUSE/RESUME: while paused nothing is planned and no step or KV request is sent;
     * stale_kv counts the replies still due to KV requests sent before the pause (to the pool
     * the RESET dropped), absorbed unread as they arrive (the kvmgr answers in order) */
    bool paused;
    int32_t stale_kv;
    bool forming;
    uint64_t form_start_us;
    uint64_t form_timer;
    /* steps in flight: at most max_inflight (P), on disjoint sets of sequences */
    int32_t max_inflight;
    flight *fl; // (max_inflight)
    int32_t n_inflight;
    /* retries of lost steps (sh_batcher_args.step_retry_ms, step_retries): the moving averages
     * of an answered step's latency (send to STEP_DONE) and token count set each deadline */
    int32_t retries_max; /* 0: no retries */
    uint32_t retry_min_ms;
    double lat_avg_us, tok_avg;
    uint64_t answered_sent_us; /* send time of the latest-sent try that was answered */
    /* step scratch */
    sh_proto_step_seq *step_seqs; // (max_seqs)
    uint64_t *fail_ids;           // (max_seqs) request ids of a failed step
    /* metrics */
    sh_gauge *m_running, *m_waiting, *m_paused;
    sh_counter *m_preempt, *m_prompt_toks, *m_gen_toks, *m_steps, *m_retries, *m_ignored;
    sh_counter *m_fin[5];
    sh_histogram *m_batch, *m_step_tokens, *m_step_time, *m_inflight;
    sh_histogram *m_queue_wait; /* arrival to first admission, once per sequence */
    /* speculative decoding (sh_batcher_args.spec): spec_on when on; the n-gram pool with ngram,
     * remote when a drafter actor drafts (draft, self) */
    bool spec_on, remote;
    sh_spec_pool *pool;
    sh_spec_cost cost; /* a step's compute time by its rows (tokens, drafts included) */
    sh_counter *m_spec_drafts, *m_spec_draft_toks, *m_spec_accepted;
    sh_counter *m_spec_pos[SH_SPEC_MAX_K]; /* drafts accepted at position i + 1 */
    /* what METRICS reports to the router say (counters since init) */
    uint64_t tot_tokens, tot_generated, tot_steps, busy_us;
    uint64_t busy_since; /* when the steps in flight went from none to one (0: none in flight) */
    sh_proto_metric report[9];
} batcher;

enum { FIN_ERROR = 4 }; /* seq_finish's fin for a failed choice (after sh_proto_finish's) */

static inline int32_t blocks_for(const batcher *b, int32_t n_tokens)
{
    return (n_tokens + b->a.block_tokens - 1) / b->a.block_tokens;
}

/* batcher.c: requests. */
void sh__batcher_update_gauges(batcher *b);
breq *sh__batcher_find_req(batcher *b, uint64_t id);
/* Releases a sequence's KV (KV_FREE with its computed count, so its full blocks stay cached). */
void sh__batcher_kv_release(batcher *b, bseq *s);
/* A choice finished (fin an sh_proto_finish, or FIN_ERROR): DONE; r is freed with its last. */
void sh__batcher_seq_finish(batcher *b, bseq *s, int fin);
/* Fails a whole request (FAIL to its sender) and frees it. */
void sh__batcher_req_fail(batcher *b, breq *r, sh_err code, uint32_t http, const char *msg);
/* Finishes every choice of r not in a step in flight with fin. */
void sh__batcher_req_finish_all(batcher *b, breq *r, int fin);
/* To call whenever the number of steps in flight may have changed (busy_us of the reports). */
void sh__batcher_busy_update(batcher *b, uint64_t now_us);

/* batcher_plan.c: the queue and the running set, planning and dispatch. */
void sh__batcher_plan_queue_insert(batcher *b, bseq *s);
void sh__batcher_plan_queue_remove(batcher *b, bseq *s);
void sh__batcher_plan_running_remove(batcher *b, bseq *s);
bseq *sh__batcher_plan_find_running(batcher *b, uint64_t kv_id);
/* Steps 1 and 2: plans the next step when a pipeline slot is free (KV_ALLOC/KV_FORK sent). */
void sh__batcher_plan_step(batcher *b);
/* Fills q with what STEP says of sequence s for its current chunk (step_k tokens from
 * n_computed): the same on every try of a step. */
void sh__batcher_plan_seq_fill(const batcher *b, const bseq *s, sh_proto_step_seq *q);
/* Past-deadline requests finish (DEADLINE), except their choices in a step in flight. */
void sh__batcher_plan_expire(batcher *b);
/* A KV_ALLOC or KV_FORK reply (decoded false: undecodable, or an ERROR); the last one of a plan
 * dispatches the step (step 3). */
void sh__batcher_plan_kv_reply(batcher *b, uint32_t type, const sh_proto_body *pb, bool decoded);

/* batcher_embed.c: an embedding sequence's answer (o.embd) of a step; the last one finishes it
 * with the vector in DONE. */
void sh__batcher_embed_answer(batcher *b, bseq *s, const sh_proto_step_out *o);

/* batcher_step.c: answers of the steps in flight (step 4). */
/* CONTROL PAUSE: abandons every step in flight (its slot freed, so its STEP_DONE is ignored)
 * and returns the number abandoned; the sequences stay in the running set for the caller. */
int32_t sh__batcher_step_abandon_all(batcher *b);
void sh__batcher_step_done(batcher *b, const sh_proto_step_done *m);
/* An undecodable STEP_DONE: ignored with retries (its step is sent again at its deadline);
 * without, the oldest step in flight fails. */
void sh__batcher_step_lost(batcher *b);
/* The deadline tick: re-sends every step in flight past its retry deadline and fails those
 * past step_timeout_ms (or out of retries). */
void sh__batcher_step_check_timeouts(batcher *b);

#endif
