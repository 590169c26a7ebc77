/* The batcher: iteration-level (continuous) batching for one replica.
 *
 * Requests arrive as SUBMIT from the gateway. Each choice of a request is one sequence. A
 * sequence waits in a queue ordered by priority class, then arrival; when admitted it gets KV
 * blocks from the kvmgr (KV_ALLOC, a request/reply) and joins the running set. Every step is
 * planned the same way:
 *
 *   1. plan    for each running sequence with tokens to compute, in priority order, a chunk of
 *              them within the step's token budget (a decode is one token, a prefill chunk up to
 *              the budget); new sequences are admitted while the budget, max_seqs and the last
 *              known free KV blocks allow, a starving sequence first (relieve_starving);
 *              choices 1..n-1 of a request fork the first choice's computed prompt blocks
 *              (KV_FORK) instead of computing them again;
 *   2. alloc   one KV_ALLOC (or KV_FORK) per planned sequence; the replies come back in order;
 *   3. step    the sequences whose reservation succeeded go to the stage in ONE STEP;
 *              when running sequences could not get their blocks, just enough others are
 *              preempted (pick_victim: lowest class, then latest arrival, sparing one that has
 *              not yet run a slice): their blocks are freed and they go back to the queue to be
 *              recomputed from their prompt and the tokens they generated so far;
 *   4. done    STEP_DONE brings one sampled token per finished chunk: the token is detokenized,
 *              checked against stop strings, EOS, max_tokens and the context, and streamed to the
 *              gateway as TOKEN; a finished sequence frees its blocks (KV_FREE) and the request
 *              gets DONE once all its choices finished.
 *
 * Pipelining. Up to max_inflight (P) steps are in flight at once, each in a `flight` slot with
 * its own step id, send time and sequences. A sequence is in at most one step at a time (its next
 * chunk needs the token the previous one samples), so while steps are out the next one is planned
 * from the sequences in none of them: with P stages every stage has a step to run. Each step
 * takes at most an equal share of the sequences there are to run (step_share: 32 decoding
 * streams and P = 2 alternate as two groups of 16), and each has the whole token budget
 * (max_step_tokens rows is what a stage computes at once); max_seqs bounds the running set, so
 * the steps in flight hold at most max_seqs sequences together. A sequence in a step in flight is
 * never preempted (the step is writing its blocks) and a deadline or cancel that reaches it
 * waits for the step's answer. With P = 1 one step is in flight at a time, as before.
 *
 * When a step could start (the replica idle, or a pipeline slot free) the first SUBMIT waits a
 * moment (1 ms after the last arrival, at most max_wait_ms) so a burst forms one batch; the
 * answer of a step in flight ends that wait.
 *
 * Lost steps. STEP is one-way: when a stage node dies the step's STEP_DONE never comes. With
 * step_timeout_ms the deadline tick fails each step not answered in time (the requests of its
 * sequences get 503; the other steps in flight go on) and the batcher goes on; a STEP_DONE whose
 * step id is not that of a step in flight (late, after such a timeout, or a duplicate) is
 * ignored. A failed step's sequences are failed whole, never resumed: the KV rows of a step that
 * did not answer cannot be trusted.
 *
 * A router (args.router) gets a METRICS report at init and every report_ms (send_report): load
 * gauges and counters of the work done, from which it derives capacity as tokens per busy
 * microsecond. CANCEL with withdraw takes back a request that never got KV (withdraw).
 *
 * Memory: a request's buffers (tokens, block tables, detokenizer, stop strings) are allocated at
 * SUBMIT; planning and token handling reuse state-owned arrays, so the steady state allocates
 * nothing per token (the stop-string matcher grows its buffer at most to its longest stop string).
 *
 * Thread: every member runs on the batcher's loop thread. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/router.h"
#include "actors/serve.h"
#include "base/error.h"
#include "model/sampler.h"

#define TIMER_FORM 1
#define TIMER_DEADLINE 2
#define TIMER_REPORT 3
#define DEADLINE_TICK_MS 100

/* Preemption and starvation (docs/serving.md, Preemption and No starvation). A slice is SLICE_US
 * and at least SLICE_STEPS steps, so that where steps are slow a sequence still gets enough
 * tokens out of each admission to pay for its recompute. A sequence that has waited a slice is
 * starving; it is admitted ahead of the queue, and a KV shortage spares it for a slice unless
 * nothing else is left. A running sequence that has run a slice, of the starving one's class or
 * a lower one, yields to it when it has more than twice its work left, and STARVE_MARGIN tokens
 * more; among starving sequences the least work goes first, each gaining a credit of
 * AGE_TOKENS_PER_S tokens per second waited. */
#define SLICE_US 1000000
#define SLICE_STEPS 32
#define AGE_TOKENS_PER_S 16
#define STARVE_MARGIN 32

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
    int32_t *toks;      // (cap) prompt then generated tokens
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
    uint64_t queued_us;      /* when it last began to wait: arrival, or its latest preemption */
    uint64_t admitted_us;    /* when it last joined the running set */
    uint64_t queued_step, admitted_step; /* the batcher's step count at those times */
    bool relieved; /* admitted ahead of the queue as starving: spared by shortages for a slice */
    bool held_kv;  /* was ever granted KV blocks (true for good: a preempted one too) */
    sh_tokenizer_stream *detok;
    sh_openai_stopper stop;
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
    int32_t n_choices, n_finished;
    int32_t shared; /* prompt positions choices > 0 fork from choice 0 */
    bool cancelled;
    sh_proto_sampling samp; /* stop and bias point into owned memory below */
    sh_strv stop_v[SH_PROTO_MAX_STOP];
    sh_proto_logit_bias *bias;
    char *stop_mem;
    bseq *seqs; // (n_choices)
    breq *next_live;
};

/* A step in flight: sent, its STEP_DONE not yet handled. order[i] is the step's i-th sequence
 * (NULL once retired: a failure of another step can end its request meanwhile). */
typedef struct flight {
    uint64_t step; /* 0: this slot is free */
    uint64_t sent_us;
    int32_t n;
    bseq **order; // (max_seqs)
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
    int32_t avail_est; /* free + evictable KV blocks, from the kvmgr's last reply */
    int32_t allocs_out;
    bool forming;
    uint64_t form_start_us;
    uint64_t form_timer;
    /* steps in flight: at most max_inflight (P), on disjoint sets of sequences */
    int32_t max_inflight;
    flight *fl; // (max_inflight)
    int32_t n_inflight;
    /* step scratch */
    sh_proto_step_seq *step_seqs; // (max_seqs)
    uint64_t *fail_ids;           // (max_seqs) request ids of a failed step
    /* metrics */
    sh_gauge *m_running, *m_waiting;
    sh_counter *m_preempt, *m_prompt_toks, *m_gen_toks, *m_steps;
    sh_counter *m_fin[5];
    sh_histogram *m_batch, *m_step_tokens, *m_step_time, *m_inflight;
    /* what METRICS reports to the router say (counters since init) */
    uint64_t tot_tokens, tot_generated, tot_steps, busy_us;
    uint64_t busy_since; /* when the steps in flight went from none to one (0: none in flight) */
    sh_proto_metric report[9];
} batcher;

static const char *const FIN_NAMES[5] = {"stop", "length", "cancel", "timeout", "error"};
enum { FIN_ERROR = 4 };

static void plan_step(batcher *b);
static void busy_update(batcher *b, uint64_t now_us);

/* ---- helpers ------------------------------------------------------------------------------ */

static int32_t blocks_for(const batcher *b, int32_t n_tokens)
{
    return (n_tokens + b->a.block_tokens - 1) / b->a.block_tokens;
}

static bool seq_before(const bseq *x, const bseq *y)
{
    if (x->r->prio != y->r->prio)
        return x->r->prio < y->r->prio;
    if (x->r->arrival != y->r->arrival)
        return x->r->arrival < y->r->arrival;
    return x->choice < y->choice;
}

static void queue_insert(batcher *b, bseq *s)
{
    bseq **pp = &b->queue;
    while (*pp && !seq_before(s, *pp))
        pp = &(*pp)->next;
    s->next = *pp;
    *pp = s;
    s->state = SEQ_WAITING;
    b->n_waiting++;
}

static void queue_remove(batcher *b, bseq *s)
{
    for (bseq **pp = &b->queue; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            s->next = NULL;
            b->n_waiting--;
            return;
        }
}

/* Adds s to the running set at its rank, so that the set stays in queue order: planning, the
 * kvmgr (which serves reservations in the order they are sent) and preemption all favour the
 * higher class and, within a class, the earlier arrival. */
static void running_insert(batcher *b, bseq *s)
{
    int32_t i = b->n_running;
    while (i > 0 && seq_before(s, b->running[i - 1]))
        i--;
    memmove(b->running + i + 1, b->running + i, (size_t)(b->n_running - i) * sizeof *b->running);
    b->running[i] = s;
    b->n_running++;
}

static void running_remove(batcher *b, bseq *s)
{
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i] == s) {
            memmove(b->running + i, b->running + i + 1,
                    (size_t)(b->n_running - i - 1) * sizeof *b->running);
            b->n_running--;
            return;
        }
}

static void update_gauges(batcher *b)
{
    sh_gauge_set(b->m_running, b->n_running);
    sh_gauge_set(b->m_waiting, b->n_waiting);
}

static void req_free(breq *r)
{
    if (!r)
        return;
    for (int32_t i = 0; r->seqs && i < r->n_choices; i++) {
        free(r->seqs[i].toks);
        free(r->seqs[i].blocks);
        sh_tokenizer_stream_destroy(r->seqs[i].detok);
        sh_openai_stopper_fini(&r->seqs[i].stop);
    }
    free(r->seqs);
    free(r->bias);
    free(r->stop_mem);
    free(r);
}

static void live_remove(batcher *b, breq *r)
{
    for (breq **pp = &b->live; *pp; pp = &(*pp)->next_live)
        if (*pp == r) {
            *pp = r->next_live;
            b->n_reqs--;
            return;
        }
}

static breq *find_req(batcher *b, uint64_t id)
{
    for (breq *r = b->live; r; r = r->next_live)
        if (r->id == id)
            return r;
    return NULL;
}

static bseq *find_running(batcher *b, uint64_t kv_id)
{
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i]->kv_id == kv_id)
            return b->running[i];
    return NULL;
}

static void send_fail(batcher *b, const breq *r, sh_err code, uint32_t http, const char *fmt, ...)
    SH_PRINTF(5, 6);
static void send_fail(batcher *b, const breq *r, sh_err code, uint32_t http, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sh_proto_fail f = {.req = r->id,
                       .code = (int32_t)code,
                       .message = {msg, (uint32_t)strlen(msg)},
                       .retryable = http == 429 || http == 503,
                       .status_http = http};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), r->reply_to, SH_MSG_FAIL,
                     r->trace, &f, &e))
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "fail_send", "req=%" PRIu64 " err=\"%s\"", r->id,
                     e.msg);
}

/* Releases a sequence's KV (KV_FREE with its computed count, so its full blocks stay cached). */
static void kv_release(batcher *b, bseq *s)
{
    if (!s->kv_id)
        return;
    sh_proto_kv_free f = {.seq = s->kv_id, .computed = (uint32_t)s->n_computed};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.kvmgr, SH_MSG_KV_FREE, 0,
                     &f, &e))
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "kv_free_send", "err=\"%s\"", e.msg);
    b->avail_est += s->n_blocks;
    s->kv_id = 0;
    s->n_blocks = 0;
    s->n_computed = s->n_reserved = s->n_marked = 0;
}

/* Takes a sequence out of the queue or the running set, frees its KV and marks it finished. */
static void seq_retire(batcher *b, bseq *s)
{
    if (s->in_step) {
        // Its step is still in flight (its request failed with another step): the step's
        // answer must not touch it.
        b->fl[s->fl_slot].order[s->fl_pos] = NULL;
        s->in_step = false;
    }
    if (s->state == SEQ_WAITING)
        queue_remove(b, s);
    else if (s->state == SEQ_RUNNING)
        running_remove(b, s);
    kv_release(b, s);
    s->state = SEQ_FINISHED;
}

/* Ends a request: frees what is left, counts it, unlinks it. */
static void req_end(batcher *b, breq *r)
{
    for (int32_t i = 0; i < r->n_choices; i++)
        seq_retire(b, &r->seqs[i]);
    live_remove(b, r);
    req_free(r);
    update_gauges(b);
}

/* A choice finished (fin an sh_proto_finish, or FIN_ERROR): flushes its text, frees its KV and
 * sends DONE; the request ends with its last choice. */
static void seq_finish(batcher *b, bseq *s, int fin)
{
    breq *r = s->r;
    if (s->state == SEQ_FINISHED)
        return;
    const char *out = NULL;
    size_t out_len = 0;
    char tail[512];
    size_t tail_len = 0;
    if (!s->stop.stopped && fin != FIN_ERROR) {
        const char *t;
        size_t tl;
        bool stopped = false;
        sh_tokenizer_stream_flush(s->detok, &t, &tl);
        if (tl && sh_openai_stopper_feed(&s->stop, t, tl, &out, &out_len, &stopped) == SH_OK &&
            out_len) {
            size_t k = out_len < sizeof tail ? out_len : sizeof tail;
            memcpy(tail, out, k);
            tail_len = k;
        }
        if (!stopped) {
            sh_openai_stopper_flush(&s->stop, &out, &out_len);
            size_t k = out_len < sizeof tail - tail_len ? out_len : sizeof tail - tail_len;
            memcpy(tail + tail_len, out, k);
            tail_len += k;
        } else {
            fin = SH_PROTO_FINISH_STOP;
        }
    }
    seq_retire(b, s);
    sh_counter_add(b->m_fin[fin], 1);
    if (fin != FIN_ERROR) {
        sh_proto_done d = {.req = r->id,
                           .finish = (uint8_t)fin,
                           .n_prompt = (uint32_t)r->n_prompt,
                           .n_generated = (uint32_t)s->n_gen,
                           .n_cached = (uint32_t)s->n_cached,
                           .text = {tail, (uint32_t)tail_len},
                           .choice = (uint32_t)s->choice};
        sh_error e = {0};
        if (!r->cancelled && sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx),
                                          r->reply_to, SH_MSG_DONE, r->trace, &d, &e))
            sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "done_send", "req=%" PRIu64 " err=\"%s\"",
                         r->id, e.msg);
    }
    // Choices still waiting to fork from this one start on their own.
    for (int32_t i = 0; i < r->n_choices; i++)
        if (r->seqs[i].fork_pending && s->choice == 0)
            r->seqs[i].fork_pending = false;
    if (++r->n_finished == r->n_choices)
        req_end(b, r);
    update_gauges(b);
}

/* Fails a whole request: FAIL to the gateway, every unfinished choice counted as an error. */
static void req_fail(batcher *b, breq *r, sh_err code, uint32_t http, const char *msg)
{
    send_fail(b, r, code, http, "%s", msg);
    for (int32_t i = 0; i < r->n_choices; i++)
        if (r->seqs[i].state != SEQ_FINISHED)
            sh_counter_add(b->m_fin[FIN_ERROR], 1);
    req_end(b, r);
}

/* Finishes every unfinished choice of r that is not in a step in flight with fin (the others
 * when their step is answered); r is freed with its last choice. */
static void req_finish_all(batcher *b, breq *r, int fin)
{
    int32_t left = 0;
    for (int32_t i = 0; i < r->n_choices; i++)
        left += r->seqs[i].state != SEQ_FINISHED && !r->seqs[i].in_step;
    for (int32_t i = 0; left > 0; i++)
        if (r->seqs[i].state != SEQ_FINISHED && !r->seqs[i].in_step) {
            left--;
            seq_finish(b, &r->seqs[i], fin);
        }
}

/* ---- SUBMIT ------------------------------------------------------------------------------- */

static sh_err copy_sampling(breq *r, const sh_proto_sampling *in)
{
    r->samp = *in;
    size_t stop_bytes = 0;
    for (uint32_t i = 0; i < in->stop.n; i++)
        stop_bytes += in->stop.v[i].len;
    r->stop_mem = malloc(stop_bytes + 1);
    if (!r->stop_mem)
        return SH_ENOMEM;
    size_t off = 0;
    for (uint32_t i = 0; i < in->stop.n; i++) {
        memcpy(r->stop_mem + off, in->stop.v[i].ptr, in->stop.v[i].len);
        r->stop_v[i] = (sh_strv){r->stop_mem + off, in->stop.v[i].len};
        off += in->stop.v[i].len;
    }
    r->samp.stop = (sh_strv_list){r->stop_v, in->stop.n};
    if (in->bias.n) {
        r->bias = malloc(in->bias.n * sizeof *r->bias);
        if (!r->bias)
            return SH_ENOMEM;
        memcpy(r->bias, in->bias.v, in->bias.n * sizeof *r->bias);
    }
    r->samp.bias = (sh_proto_logit_bias_list){r->bias, in->bias.n};
    return SH_OK;
}

static sh_err seq_init(batcher *b, breq *r, bseq *s, int32_t choice, const sh_proto_submit *m)
{
    s->r = r;
    s->choice = choice;
    int32_t cap = b->a.n_ctx;
    s->toks = malloc((size_t)cap * sizeof *s->toks);
    s->blocks = malloc((size_t)b->max_blocks * sizeof *s->blocks);
    if (!s->toks || !s->blocks)
        return SH_ENOMEM;
    for (uint32_t i = 0; i < m->prompt.n; i++)
        s->toks[i] = sh_i32s_at(m->prompt, i);
    s->n_toks = (int32_t)m->prompt.n;
    // A resumed request carries what it generated before; only choice 0 can be resumed.
    if (choice == 0)
        for (uint32_t i = 0; i < m->generated.n && s->n_toks < cap; i++) {
            s->toks[s->n_toks++] = sh_i32s_at(m->generated, i);
            s->n_gen++;
        }
    sh_error e = {0};
    if (sh_tokenizer_stream_create(b->a.tok, 0, &s->detok, &e))
        return SH_ENOMEM;
    const char *stops[SH_OPENAI_MAX_STOP];
    char *tmp[SH_OPENAI_MAX_STOP] = {0};
    int n_stop = 0;
    sh_err err = SH_OK;
    for (uint32_t i = 0; i < r->samp.stop.n && n_stop < SH_OPENAI_MAX_STOP; i++) {
        tmp[n_stop] = strndup(r->samp.stop.v[i].ptr, r->samp.stop.v[i].len);
        if (!tmp[n_stop]) {
            err = SH_ENOMEM;
            break;
        }
        stops[n_stop] = tmp[n_stop];
        n_stop++;
    }
    if (!err)
        err = sh_openai_stopper_init(&s->stop, stops, n_stop);
    for (int i = 0; i < n_stop; i++)
        free(tmp[i]);
    return err;
}

static void on_submit(batcher *b, const sh_msg *msg, const sh_proto_submit *m)
{
    const sh_msg_hdr *h = sh_msg_header(msg);
    breq tmp = {.id = m->req, .reply_to = m->reply_to ? m->reply_to : h->src, .trace = h->trace_id};
    uint32_t n = m->n ? m->n : 1;
    int32_t n_prompt = (int32_t)m->prompt.n;
    if (find_req(b, m->req)) {
        send_fail(b, &tmp, SH_EINVAL, 400, "request id %" PRIu64 " is already running", m->req);
        return;
    }
    if (n_prompt < 1) {
        send_fail(b, &tmp, SH_EINVAL, 400, "the prompt is empty");
        return;
    }
    if (n_prompt + (int32_t)m->generated.n >= b->a.n_ctx) {
        send_fail(b, &tmp, SH_ERANGE, 400,
                  "the prompt has %d tokens; the context window holds %d (prompt and output)",
                  n_prompt, b->a.n_ctx);
        return;
    }
    // A request whose sequence could not fit the pool even alone is refused now, before any
    // token; one that fits is never failed for want of KV later (dispatch_step).
    int64_t ctx = (int64_t)n_prompt + m->sampling.max_tokens;
    ctx = ctx < b->a.n_ctx ? ctx : b->a.n_ctx;
    if (b->a.seq_blocks > 0 && blocks_for(b, (int32_t)ctx - 1) > b->a.seq_blocks) {
        int64_t most = (int64_t)b->a.seq_blocks * b->a.block_tokens + 1 - n_prompt;
        if (most < 1)
            send_fail(b, &tmp, SH_ENOMEM, 503,
                      "the KV cache is too small for this request's prompt: %d tokens; it holds "
                      "%d blocks of %d",
                      n_prompt, b->a.seq_blocks, b->a.block_tokens);
        else
            send_fail(b, &tmp, SH_ENOMEM, 503,
                      "the KV cache is too small for this request's context: %d prompt tokens "
                      "and max_tokens %u need %d blocks of %d; it holds %d (max_tokens %" PRId64
                      " would fit)",
                      n_prompt, (unsigned)m->sampling.max_tokens, blocks_for(b, (int32_t)ctx - 1),
                      b->a.block_tokens, b->a.seq_blocks, most);
        return;
    }
    if ((int32_t)n > b->a.max_seqs) {
        send_fail(b, &tmp, SH_EINVAL, 400, "n=%u exceeds the %d sequences a step can run",
                  (unsigned)n, b->a.max_seqs);
        return;
    }
    for (uint32_t i = 0; i < m->prompt.n; i++) {
        int32_t t = sh_i32s_at(m->prompt, i);
        if (t < 0 || t >= b->a.n_vocab) {
            send_fail(b, &tmp, SH_EINVAL, 400, "token id %d is outside the vocabulary", (int)t);
            return;
        }
    }
    if (b->n_reqs >= b->a.max_queue) {
        send_fail(b, &tmp, SH_EBUSY, 429, "the server is busy: %d requests are queued", b->n_reqs);
        return;
    }
    breq *r = calloc(1, sizeof *r);
    if (!r) {
        send_fail(b, &tmp, SH_ENOMEM, 503, "out of memory");
        return;
    }
    *r = tmp;
    r->prio = m->priority;
    r->arrival = ++b->arrivals;
    r->deadline_ms = m->deadline_ms;
    r->n_prompt = n_prompt;
    r->max_tokens = (int32_t)m->sampling.max_tokens;
    r->min_tokens = (int32_t)m->min_tokens;
    r->n_choices = (int32_t)n;
    r->seqs = calloc(n, sizeof *r->seqs);
    sh_err err = r->seqs ? copy_sampling(r, &m->sampling) : SH_ENOMEM;
    for (int32_t i = 0; !err && i < (int32_t)n; i++)
        err = seq_init(b, r, &r->seqs[i], i, m);
    if (err) {
        send_fail(b, r, err, 503, "out of memory");
        req_free(r);
        return;
    }
    // Choices after the first share the prompt's whole blocks (all but the last token).
    r->shared = n > 1 ? ((n_prompt - 1) / b->a.block_tokens) * b->a.block_tokens : 0;
    r->next_live = b->live;
    b->live = r;
    b->n_reqs++;
    uint64_t now_us = sh__act_mono_us();
    for (int32_t i = 0; i < (int32_t)n; i++) {
        r->seqs[i].fork_pending = i > 0 && r->shared > 0;
        r->seqs[i].queued_us = now_us;
        r->seqs[i].queued_step = b->step_no;
        queue_insert(b, &r->seqs[i]);
    }
    sh_counter_add(b->m_prompt_toks, (uint64_t)n_prompt);
    update_gauges(b);
    // A step can start (idle, or a pipeline slot free): wait a moment for a burst to form one
    // batch; otherwise the next plan picks it up.
    if (b->n_inflight < b->max_inflight && b->allocs_out == 0) {
        uint64_t now = now_us;
        if (!b->forming) {
            b->forming = true;
            b->form_start_us = now;
        } else {
            sh_actor_timer_stop(b->ctx, b->form_timer);
        }
        uint64_t waited_ms = (now - b->form_start_us) / 1000;
        if ((int64_t)waited_ms >= b->a.max_wait_ms || b->n_waiting >= b->a.max_seqs) {
            b->forming = false;
            plan_step(b);
        } else {
            sh_actor_timer_start(b->ctx, 1, 0, TIMER_FORM, &b->form_timer);
        }
    }
}

/* CANCEL withdraw (a router moving r to another replica): only when every sequence of r is in
 * the queue and none was ever granted KV blocks (so none computed a position or generated a
 * token here; a preempted one was, one whose first reservation was refused was not) is r
 * removed, silently (no DONE), and its sender told with FAIL SH_EBUSY, retryable, 503,
 * "withdrawn". Otherwise nothing happens and nothing is answered. */
static void withdraw(batcher *b, breq *r)
{
    for (int32_t i = 0; i < r->n_choices; i++)
        if (r->seqs[i].held_kv || r->seqs[i].state != SEQ_WAITING)
            return;
    send_fail(b, r, SH_EBUSY, 503, "withdrawn");
    sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "withdrawn", "req=%" PRIu64, r->id);
    req_end(b, r);
}

static void on_cancel(batcher *b, const sh_proto_cancel *m)
{
    breq *r = find_req(b, m->req);
    if (!r)
        return;
    if (m->withdraw) {
        withdraw(b, r);
        return;
    }
    r->cancelled = true;
    // Sequences in a step or waiting for their KV finish when that completes; the others now.
    int32_t left = r->n_choices - r->n_finished;
    for (int32_t i = 0; left > 0 && i < r->n_choices; i++) {
        bseq *s = &r->seqs[i];
        if (s->state == SEQ_FINISHED)
            continue;
        left--;
        if (!s->in_step && !s->planned)
            seq_finish(b, s, SH_PROTO_FINISH_CANCEL);
    }
}

/* ---- planning ----------------------------------------------------------------------------- */

static void send_alloc(batcher *b, bseq *s, int32_t k)
{
    sh_proto_kv_alloc a = {.seq = s->kv_id, .computed = (uint32_t)s->n_computed};
    if (s->n_reserved == 0 && s->n_computed == 0) {
        // A new sequence: the whole token list, so the kvmgr can find a cached prefix.
        a.tokens = (sh_i32s){s->toks, (uint32_t)s->n_toks};
        a.n_tokens = (uint32_t)k;
    } else {
        a.tokens = (sh_i32s){s->toks + s->n_reserved, (uint32_t)k};
        a.n_tokens = (uint32_t)k;
    }
    s->n_marked = s->n_computed;
    sh_error e = {0};
    uint64_t session;
    sh_err err = sh_request_with(b->ctx, b->a.kvmgr, SH_MSG_KV_ALLOC, sh__proto_encode, &a, 30000,
                                 &session, &e);
    if (err) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "kv_alloc_send", "err=\"%s\"", e.msg);
        s->planned = false;
        return;
    }
    b->allocs_out++;
}

static void send_fork(batcher *b, bseq *s, const bseq *parent)
{
    sh_proto_kv_fork f = {
        .seq = parent->kv_id, .child = s->kv_id, .n_tokens = (uint32_t)s->r->shared};
    sh_error e = {0};
    uint64_t session;
    if (sh_request_with(b->ctx, b->a.kvmgr, SH_MSG_KV_FORK, sh__proto_encode, &f, 30000, &session,
                        &e)) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "kv_fork_send", "err=\"%s\"", e.msg);
        s->planned = false;
        return;
    }
    b->allocs_out++;
}

static bool past_deadline(const breq *r, uint64_t now_ms)
{
    return r->deadline_ms && now_ms >= r->deadline_ms;
}

/* ---- preemption --------------------------------------------------------------------------- */

/* Whether s has had its slice since its latest admission (see SLICE_US). */
static bool slice_used(const batcher *b, const bseq *s, uint64_t now_us)
{
    return now_us - s->admitted_us >= SLICE_US && b->step_no - s->admitted_step >= SLICE_STEPS;
}

/* Whether queued sequence s has waited a slice since it last began to wait. */
static bool starving(const batcher *b, const bseq *s, uint64_t now_us)
{
    return now_us - s->queued_us >= SLICE_US && b->step_no - s->queued_step >= SLICE_STEPS;
}

/* Tokens s still has to generate: what starvation weighs. */
static int64_t work_left(const bseq *s)
{
    int64_t left = (int64_t)s->r->max_tokens - s->n_gen;
    return left > 0 ? left : 0;
}

/* The victim of a KV shortage: among the sequences that hold KV, those of the lowest priority
 * class; of them the last in queue order (the latest arrival), passing over one admitted as
 * starving that has not yet run its slice unless nothing else is left. A sequence ranks by its
 * request's arrival, not by when it was last admitted, so a preempted sequence keeps its place:
 * a shortage takes every later arrival of its class first. */
static bseq *pick_victim(batcher *b, uint64_t now_us)
{
    bseq *last = NULL;
    for (int32_t i = b->n_running - 1; i >= 0; i--) {
        bseq *s = b->running[i];
        if (!s->kv_id || s->fork_pending || s->in_step)
            continue; /* a step in flight is writing the blocks of one in_step */
        if (last && s->r->prio != last->r->prio)
            break; /* the running set is ranked: a better class from here on */
        if (!s->relieved || slice_used(b, s, now_us))
            return s;
        if (!last)
            last = s;
    }
    return last;
}

/* Blocks s's refused reservation would have added to its table. */
static int32_t grow_need(const batcher *b, const bseq *s)
{
    int32_t n = blocks_for(b, s->n_reserved + s->step_k) - s->n_blocks;
    return n > 1 ? n : 1;
}

/* Puts a running sequence back in the queue; it is recomputed from its tokens when readmitted.
 * Choices that were to fork from it wait for it again. */
static void preempt(batcher *b, bseq *s)
{
    running_remove(b, s);
    kv_release(b, s);
    s->planned = s->alloc_ok = s->sampled = s->short_kv = false;
    s->queued_us = sh__act_mono_us();
    s->queued_step = b->step_no;
    sh_counter_add(b->m_preempt, 1);
    sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "preempt", "req=%" PRIu64 " choice=%d tokens=%d",
                 s->r->id, (int)s->choice, (int)s->n_toks);
    queue_insert(b, s);
}

/* The starving sequence to admit first: among those that waited a slice (and need no fork), the
 * best class, then the least work left less the credit of its wait (ties: the earlier). NULL
 * when none is starving. */
static bseq *pick_starving(const batcher *b, uint64_t now_us)
{
    bseq *best = NULL;
    int64_t best_key = 0;
    for (bseq *s = b->queue; s; s = s->next) {
        if (s->fork_pending || !starving(b, s, now_us))
            continue;
        int64_t k =
            work_left(s) - (int64_t)((now_us - s->queued_us) / 1000) * AGE_TOKENS_PER_S / 1000;
        if (!best || s->r->prio < best->r->prio || (s->r->prio == best->r->prio && k < best_key)) {
            best = s;
            best_key = k;
        }
    }
    return best;
}

/* Whether other choices of s's request still wait to fork from it. */
static bool forks_pending(const bseq *s)
{
    for (int32_t i = 1; s->choice == 0 && i < s->r->n_choices; i++)
        if (s->r->seqs[i].fork_pending)
            return true;
    return false;
}

/* Whether running sequence v may give way to starving sequence h: v holds KV, is of h's class or
 * a lower one, has had its slice, has more than twice h's work left (and STARVE_MARGIN more), and
 * no choice waits to fork from it. Between requests of about the same size the order stays first
 * come, first served, so they do not take turns at the price of recomputing each other. */
static bool may_yield(const batcher *b, const bseq *v, const bseq *h, uint64_t now_us)
{
    return v->kv_id && !v->fork_pending && !v->in_step && v->r->prio >= h->r->prio &&
           slice_used(b, v, now_us) && work_left(v) > 2 * work_left(h) + STARVE_MARGIN &&
           !forks_pending(v);
}

/* ---- admission ---------------------------------------------------------------------------- */

/* Moves queued sequence s into the running set with a first chunk of k tokens (0 for a fork). */
static void admit(batcher *b, bseq *s, int32_t k, uint64_t now_us)
{
    queue_remove(b, s);
    s->state = SEQ_RUNNING;
    s->planned = !s->fork_pending;
    s->in_step = s->alloc_ok = false;
    s->step_k = k;
    s->kv_id = s->fork_pending ? 0 : ++b->next_kv_id;
    s->n_computed = s->n_reserved = s->n_marked = 0;
    s->admitted_us = now_us;
    s->admitted_step = b->step_no;
    s->relieved = false;
    running_insert(b, s);
}

/* A planned running sequence's blocks and tokens this step, given back to *avail and *budget. */
static void unplan(const batcher *b, const bseq *s, int32_t *avail, int32_t *budget)
{
    *avail += s->n_blocks;
    if (s->planned) {
        *avail += blocks_for(b, s->n_computed + s->step_k) - blocks_for(b, s->n_computed);
        *budget += s->step_k;
    }
}

/* Starvation relief: when a starving sequence does not fit, running sequences that may yield to
 * it (worst class first, then most work left) are preempted, but only when together they make
 * room; then it is admitted ahead of the queue (it counts in *n_plan, the sequences of the step).
 * Returns whether one was admitted. */
static bool relieve_starving(batcher *b, uint64_t now_us, int32_t *avail, int32_t *budget,
                             int32_t reserve, int32_t *n_plan)
{
    bseq *h = pick_starving(b, now_us);
    if (!h || *budget <= 0 || b->n_running >= b->a.max_seqs)
        return false;
    int32_t k = h->n_toks < *budget ? h->n_toks : *budget;
    int32_t need = blocks_for(b, k) + 1 + reserve;
    int32_t room = *avail;
    for (int32_t i = 0; i < b->n_running && room < need; i++)
        if (may_yield(b, b->running[i], h, now_us))
            room += b->running[i]->n_blocks;
    if (room < need)
        return false;
    while (*avail < need) {
        bseq *v = NULL;
        for (int32_t i = 0; i < b->n_running; i++) {
            bseq *s = b->running[i];
            if (may_yield(b, s, h, now_us) &&
                (!v || s->r->prio > v->r->prio ||
                 (s->r->prio == v->r->prio && work_left(s) > work_left(v))))
                v = s;
        }
        if (!v)
            return false;
        unplan(b, v, avail, budget);
        preempt(b, v);
    }
    *avail -= blocks_for(b, k) + 1;
    *budget -= k;
    admit(b, h, k, now_us);
    h->relieved = true;
    *n_plan += k > 0;
    return true;
}

/* The most sequences one step may take with P steps in flight: an equal share of the sequences
 * there are to run, so that the groups alternate (32 decoding sequences, P = 2: two groups of
 * 16). Unbounded with one step in flight. */
static int32_t step_share(const batcher *b)
{
    if (b->max_inflight <= 1)
        return INT32_MAX;
    int32_t active = b->n_running + b->n_waiting;
    active = active < b->a.max_seqs ? active : b->a.max_seqs;
    int32_t share = (active + b->max_inflight - 1) / b->max_inflight;
    return share > 1 ? share : 1;
}

/* Step 1 and 2: choose the step's sequences among those not in a step in flight and ask the
 * kvmgr for their blocks. */
static void plan_step(batcher *b)
{
    if (b->n_inflight >= b->max_inflight || b->allocs_out || b->forming)
        return;
    uint64_t now_ms = sh__act_unix_ms(), now_us = sh__act_mono_us();
    // Deadlines first: anything past its deadline finishes now.
    for (breq *r = b->live, *next; r; r = next) {
        next = r->next_live;
        if (past_deadline(r, now_ms))
            req_finish_all(b, r, SH_PROTO_FINISH_DEADLINE);
    }
    int32_t budget = b->a.max_step_tokens;
    int32_t avail = b->avail_est;
    int32_t share = step_share(b), n_plan = 0;
    // Running sequences, in queue order (running_insert keeps the array ranked by priority class,
    // then arrival), so that a short budget goes to the earlier work. One in a step in flight
    // waits for its answer (its next chunk needs the token that step samples).
    for (int32_t i = 0; i < b->n_running && budget > 0 && n_plan < share; i++) {
        bseq *s = b->running[i];
        if (s->in_step)
            continue;
        s->planned = s->alloc_ok = false;
        int32_t pending = s->n_toks - s->n_computed;
        if (s->fork_pending || pending <= 0)
            continue;
        int32_t k = pending < budget ? pending : budget;
        s->step_k = k;
        s->planned = true;
        budget -= k;
        n_plan++;
        avail -= blocks_for(b, s->n_computed + k) - blocks_for(b, s->n_computed);
    }
    // Forks: choices waiting for choice 0's prompt blocks.
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->fork_pending || s->kv_id)
            continue;
        const bseq *p = &s->r->seqs[0];
        if (p->state != SEQ_RUNNING || !p->kv_id || p->n_computed < s->r->shared)
            continue;
        if (p->n_marked < s->r->shared && !p->planned)
            continue; /* the kvmgr hears of the computed prompt with choice 0's next alloc */
        s->kv_id = ++b->next_kv_id;
        s->planned = true;
        s->step_k = 0;
    }
    // A starving sequence goes first, with room made for it if need be. Then the queue head while
    // the budget, the sequence limit and the KV allow. Nothing passes a head that does not fit,
    // so a later arrival never overtakes a waiting (or preempted) earlier one. When no sequence
    // holds KV the head goes in whatever the estimate says (choices waiting to fork hold none and
    // must not keep it out).
    int32_t reserve = 1 + b->n_running / 8;
    relieve_starving(b, now_us, &avail, &budget, reserve, &n_plan);
    bool held = false;
    for (int32_t i = 0; i < b->n_running && !held; i++)
        held = b->running[i]->kv_id != 0;
    while (b->queue && budget > 0 && b->n_running < b->a.max_seqs && n_plan < share) {
        bseq *s = b->queue;
        int32_t k = 0;
        if (!s->fork_pending) {
            k = s->n_toks < budget ? s->n_toks : budget;
            int32_t need = blocks_for(b, k) + 1;
            if (avail - need < reserve && held)
                break;
            held = true;
            avail -= need;
            budget -= k;
            n_plan++;
        }
        admit(b, s, k, now_us);
    }
    // Requests: allocs for choice 0s before forks (the kvmgr handles them in order).
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && !s->fork_pending)
            send_alloc(b, s, s->step_k);
    }
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && s->fork_pending)
            send_fork(b, s, &s->r->seqs[0]);
    }
    update_gauges(b);
    int32_t idle = 0; /* running sequences not in a step in flight */
    for (int32_t i = 0; i < b->n_running; i++)
        idle += !b->running[i]->in_step;
    if (b->allocs_out == 0 && idle > 0) {
        // Nothing could be planned although sequences run: they wait on forks; try later.
        sh_actor_timer_start(b->ctx, 5, 0, TIMER_FORM, &b->form_timer);
        b->forming = true;
        b->form_start_us = sh__act_mono_us();
    }
}

/* Step 3: every reservation answered; run the step with those that got their blocks. */
static void dispatch_step(batcher *b)
{
    uint64_t now_us = sh__act_mono_us();
    // Admissions that did not fit go back to the queue; running sequences that could not grow
    // are counted for preemption.
    int32_t failed = 0;
    bseq *refused = NULL;
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->planned || s->alloc_ok)
            continue;
        s->planned = false;
        if (s->fork_pending)
            continue;
        if (s->kv_id == 0) {
            running_remove(b, s);
            queue_insert(b, s);
            refused = refused ? refused : s;
            i--;
        } else if (s->n_toks > s->n_computed) {
            s->short_kv = true;
            failed++;
        }
    }
    int32_t holders = 0;
    for (int32_t i = 0; i < b->n_running; i++)
        holders += b->running[i]->kv_id != 0;
    if (refused && holders == 0) {
        // Refused by a pool that nothing else holds: this prompt can never fit.
        req_fail(b, refused->r, SH_ENOMEM, 503,
                 "the KV cache is too small for this request's prompt");
    }
    // The blocks the refused growth asks for beyond what the pool has left; victims give theirs
    // back until it is covered. A victim that is itself short needs nothing any more. Only when
    // the one sequence left holding KV is still short does it not fit the pool even alone.
    int32_t deficit = -b->avail_est;
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i]->short_kv)
            deficit += grow_need(b, b->running[i]);
    while (failed > 0 && deficit > 0) {
        bseq *v = pick_victim(b, now_us);
        if (!v)
            break;
        if (holders == 1) {
            if (v->short_kv)
                req_fail(b, v->r, SH_ENOMEM, 503,
                         "the KV cache is too small for this request's context");
            break;
        }
        if (v->short_kv) {
            deficit -= grow_need(b, v);
            failed--;
        }
        deficit -= v->n_blocks;
        preempt(b, v);
        holders--;
    }
    for (int32_t i = 0; i < b->n_running; i++)
        b->running[i]->short_kv = false;
    // The step itself, in a free flight slot.
    int32_t slot = 0;
    while (b->fl[slot].step)
        slot++;
    flight *f = &b->fl[slot];
    f->n = 0;
    int32_t n_tok = 0;
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->planned || !s->alloc_ok || s->step_k <= 0)
            continue;
        sh_proto_step_seq *q = &b->step_seqs[f->n];
        memset(q, 0, sizeof *q);
        q->seq = s->kv_id;
        q->tokens = (sh_i32s){s->toks + s->n_computed, (uint32_t)s->step_k};
        q->pos = (uint32_t)s->n_computed;
        q->blocks = (sh_i32s){s->blocks, (uint32_t)s->n_blocks};
        q->sample = s->n_computed + s->step_k == s->n_toks;
        q->sampling = s->r->samp;
        q->sampling.stop = (sh_strv_list){0};
        q->sampling.seed = s->r->samp.seed + (uint64_t)s->choice * 0x9E3779B97F4A7C15ull +
                           (uint64_t)s->n_gen * 0xBF58476D1CE4E5B9ull;
        if (q->sample && !s->sampled) {
            int32_t w = s->r->samp.penalty_last_n;
            if (w > s->n_computed + s->step_k)
                w = s->n_computed + s->step_k;
            q->history = (sh_i32s){s->toks + s->n_computed + s->step_k - w, (uint32_t)w};
        }
        s->in_step = true;
        s->fl_slot = slot;
        s->fl_pos = f->n;
        f->order[f->n++] = s;
        n_tok += s->step_k;
    }
    for (int32_t i = 0; i < b->n_running; i++)
        b->running[i]->planned = false;
    if (f->n == 0) {
        // Nothing to run. With a step in flight its answer plans the next one.
        if (b->n_inflight == 0 && (b->n_running || b->n_waiting)) {
            b->forming = true;
            b->form_start_us = sh__act_mono_us();
            sh_actor_timer_start(b->ctx, 2, 0, TIMER_FORM, &b->form_timer);
        }
        return;
    }
    sh_proto_step st = {.step = ++b->step_no, .seqs = {b->step_seqs, (uint32_t)f->n}};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.stage, SH_MSG_STEP, 0,
                     &st, &e)) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_send", "err=\"%s\"", e.msg);
        for (int32_t i = 0; i < f->n; i++)
            f->order[i]->in_step = false;
        f->n = 0;
        for (breq *r = b->live, *next; r; r = next) {
            next = r->next_live;
            req_fail(b, r, SH_EIO, 503, "the stage could not be reached");
        }
        return;
    }
    f->step = b->step_no;
    f->sent_us = sh__act_mono_us();
    b->n_inflight++;
    busy_update(b, f->sent_us);
    sh_counter_add(b->m_steps, 1);
    sh_histogram_observe(b->m_batch, f->n);
    sh_histogram_observe(b->m_step_tokens, n_tok);
    sh_histogram_observe(b->m_inflight, b->n_inflight);
    // Room for another step (a pipeline): plan it from the sequences this one left.
    if (b->n_inflight < b->max_inflight)
        plan_step(b);
}

static void on_kv_reply(batcher *b, uint32_t type, const sh_proto_body *pb, bool decoded)
{
    if (b->allocs_out > 0)
        b->allocs_out--;
    uint64_t kv_id = 0;
    int32_t status = SH_EPROTO;
    sh_i32s blocks = {0};
    if (decoded && type == SH_MSG_KV_ALLOC) {
        kv_id = pb->kv_alloc.seq;
        status = pb->kv_alloc.status;
        blocks = pb->kv_alloc.blocks;
        if (pb->kv_alloc.status == 0 || pb->kv_alloc.status == SH_EBUSY)
            b->avail_est = (int32_t)pb->kv_alloc.available;
    } else if (decoded && type == SH_MSG_KV_FORK) {
        kv_id = pb->kv_fork.child;
        status = pb->kv_fork.status;
        blocks = pb->kv_fork.blocks;
    }
    bseq *s = kv_id ? find_running(b, kv_id) : NULL;
    if (s && s->planned) {
        if (status == 0 && (int32_t)blocks.n <= b->max_blocks) {
            for (uint32_t i = 0; i < blocks.n; i++)
                s->blocks[i] = sh_i32s_at(blocks, i);
            s->n_blocks = (int32_t)blocks.n;
            s->held_kv = true;
            if (type == SH_MSG_KV_ALLOC) {
                if (s->n_reserved == 0 && s->n_computed == 0) {
                    s->n_cached = (int32_t)pb->kv_alloc.cached;
                    s->n_computed = s->n_marked = s->n_cached;
                    s->n_reserved = s->n_cached;
                    s->step_k = (int32_t)pb->kv_alloc.appended;
                }
                s->n_reserved += (int32_t)pb->kv_alloc.appended;
                s->alloc_ok = s->step_k > 0;
            } else {
                s->n_computed = s->n_reserved = s->n_marked = s->r->shared;
                s->n_cached = s->r->shared;
                s->fork_pending = false;
                s->alloc_ok = false; /* computes from the next step on */
            }
        } else {
            if (type == SH_MSG_KV_FORK) {
                s->kv_id = 0; /* retried at the next plan when the pool was short */
                if (status != SH_EBUSY)
                    s->fork_pending = false; /* e.g. the window released the prompt's start */
            } else if (s->n_reserved == 0 && s->n_computed == 0) {
                s->kv_id = 0; /* the kvmgr freed the new sequence again */
            }
            if (status != SH_EBUSY && status != 0)
                sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "kv_refused", "req=%" PRIu64 " status=%d",
                             s->r->id, (int)status);
            if (status == SH_ERANGE) {
                seq_finish(b, s, SH_PROTO_FINISH_LENGTH);
                s = NULL;
            }
        }
    } else if (status == 0 && kv_id) {
        // The sequence ended (cancel) while its reservation was on the way: release it.
        sh_proto_kv_free f = {.seq = kv_id};
        sh_error e = {0};
        sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.kvmgr, SH_MSG_KV_FREE, 0,
                     &f, &e);
    }
    if (b->allocs_out == 0)
        dispatch_step(b);
}

/* ---- STEP_DONE ---------------------------------------------------------------------------- */

static void emit_token(batcher *b, bseq *s, const sh_proto_step_out *o)
{
    breq *r = s->r;
    int32_t id = o->token;
    bool eog =
        (sh_tokenizer_is_eog(b->a.tok, id) || (b->a.llama2c && id == sh_tokenizer_bos(b->a.tok))) &&
        s->n_gen >= r->min_tokens;
    if (eog) {
        seq_finish(b, s, SH_PROTO_FINISH_STOP);
        return;
    }
    s->toks[s->n_toks++] = id;
    s->n_gen++;
    b->tot_generated++;
    sh_counter_add(b->m_gen_toks, 1);
    const char *text = NULL, *out = NULL;
    size_t len = 0, out_len = 0;
    bool stopped = false;
    if (sh_tokenizer_stream_feed(s->detok, id, &text, &len) == SH_OK && len)
        sh_openai_stopper_feed(&s->stop, text, len, &out, &out_len, &stopped);
    if (!r->cancelled) {
        sh_proto_token t = {.req = r->id,
                            .index = (uint32_t)(s->n_gen - 1),
                            .tokens = {&s->toks[s->n_toks - 1], 1},
                            .text = {out ? out : "", (uint32_t)out_len},
                            .choice = (uint32_t)s->choice};
        float lp = r->samp.logprobs_mode == SH_LOGPROBS_RAW ? o->logprob_raw : o->logprob;
        t.logprobs = (sh_f32s){&lp, 1};
        t.top_n = (uint8_t)o->top_tokens.n;
        t.top_tokens = o->top_tokens;
        t.top_logprobs = o->top_logprobs;
        sh_error e = {0};
        if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), r->reply_to, SH_MSG_TOKEN,
                         r->trace, &t, &e))
            sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "token_send", "req=%" PRIu64 " err=\"%s\"",
                         r->id, e.msg);
    }
    if (stopped) {
        seq_finish(b, s, SH_PROTO_FINISH_STOP);
        return;
    }
    if (s->n_gen >= r->max_tokens || s->n_toks >= b->a.n_ctx)
        seq_finish(b, s, SH_PROTO_FINISH_LENGTH);
}

/* Takes step f out of flight (its slot is free again): its sequences are in no step now. */
static void flight_end(batcher *b, flight *f)
{
    for (int32_t i = 0; i < f->n; i++)
        if (f->order[i])
            f->order[i]->in_step = false;
    f->step = 0;
    b->n_inflight--;
    busy_update(b, sh__act_mono_us());
}

/* Plans the next step after one left flight. With several steps in flight a burst may be
 * forming meanwhile (on_submit); the answer plans at once instead. */
static void plan_after_step(batcher *b)
{
    if (b->max_inflight > 1 && b->forming) {
        sh_actor_timer_stop(b->ctx, b->form_timer);
        b->forming = false;
    }
    plan_step(b);
}

/* Step f failed or was not answered: its sequences cannot trust their new cache rows, so their
 * requests fail with `http` and msg (by id, since failing one frees its choices). The other
 * steps in flight go on. */
static void fail_step(batcher *b, flight *f, sh_err code, uint32_t http, const char *msg)
{
    int32_t n = 0;
    for (int32_t i = 0; i < f->n; i++)
        if (f->order[i])
            b->fail_ids[n++] = f->order[i]->r->id;
    flight_end(b, f);
    for (int32_t i = 0; i < n; i++) {
        breq *r = find_req(b, b->fail_ids[i]);
        if (r)
            req_fail(b, r, code, http, msg);
    }
    plan_after_step(b);
}

static flight *find_flight(batcher *b, uint64_t step)
{
    for (int32_t i = 0; step && i < b->max_inflight; i++)
        if (b->fl[i].step == step)
            return &b->fl[i];
    return NULL;
}

static void on_step_done(batcher *b, const sh_proto_step_done *m)
{
    flight *f = find_flight(b, m->step);
    if (!f) {
        // Late (its step already timed out) or a duplicate: the requests it was for are gone.
        sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "step_done_ignored",
                     "step=%" PRIu64 " in_flight=%d", m->step, (int)b->n_inflight);
        return;
    }
    if (m->compute_us)
        sh_histogram_observe(b->m_step_time, (double)m->compute_us * 1e-6);
    if (m->status) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_failed",
                     "step=%" PRIu64 " status=%d msg=\"%.*s\"", m->step, (int)m->status,
                     (int)m->message.len, m->message.ptr);
        fail_step(b, f, (sh_err)m->status, 500, "the model step failed");
        return;
    }
    b->tot_steps++;
    for (int32_t i = 0; i < f->n; i++) {
        bseq *s = f->order[i];
        if (!s)
            continue;
        s->n_computed += s->step_k;
        b->tot_tokens += (uint64_t)s->step_k;
        s->step_k = 0;
    }
    flight_end(b, f);
    for (uint32_t j = 0; j < m->seqs.n; j++) {
        const sh_proto_step_out *o = &m->seqs.v[j];
        bseq *s = find_running(b, o->seq);
        if (!s || s->state != SEQ_RUNNING || s->in_step)
            continue;
        if (s->r->cancelled) {
            seq_finish(b, s, SH_PROTO_FINISH_CANCEL);
            continue;
        }
        if (o->token < 0)
            continue;
        s->sampled = true;
        if (o->token >= b->a.n_vocab) {
            req_fail(b, s->r, SH_EPROTO, 500, "the stage sampled a token outside the vocabulary");
            continue;
        }
        emit_token(b, s, o);
    }
    plan_after_step(b);
}

/* A STEP_DONE that could not be decoded: its step id is unknown, so it counts as the answer to
 * the oldest step in flight (stages answer in order), whose requests fail. */
static void step_lost(batcher *b)
{
    flight *oldest = NULL;
    for (int32_t i = 0; i < b->max_inflight; i++)
        if (b->fl[i].step && (!oldest || b->fl[i].step < oldest->step))
            oldest = &b->fl[i];
    if (!oldest)
        return;
    sh_proto_step_done lost = {
        .step = oldest->step, .status = SH_EPROTO, .message = {"undecodable STEP_DONE", 21}};
    on_step_done(b, &lost);
}

/* The deadline tick: a step in flight has waited step_timeout_ms for its STEP_DONE. A stage
 * node that died (or hangs) never answers; fail that step's requests and go on. */
static void check_step_timeout(batcher *b)
{
    if (!b->n_inflight || !b->a.step_timeout_ms)
        return;
    uint64_t now_us = sh__act_mono_us();
    for (int32_t i = 0; i < b->max_inflight; i++) {
        flight *f = &b->fl[i];
        uint64_t waited_us = now_us - f->sent_us;
        if (!f->step || waited_us < (uint64_t)b->a.step_timeout_ms * 1000)
            continue;
        char msg[160];
        snprintf(msg, sizeof msg,
                 "the pipeline did not answer step %" PRIu64 " within %" PRIu32
                 " ms; a stage node may be down",
                 f->step, b->a.step_timeout_ms);
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_timeout",
                     "step=%" PRIu64 " seqs=%d waited_ms=%" PRIu64 " timeout_ms=%" PRIu32, f->step,
                     (int)f->n, waited_us / 1000, b->a.step_timeout_ms);
        fail_step(b, f, SH_ETIMEDOUT, 503, msg);
    }
}

/* ---- reports to the router --------------------------------------------------------------- */

/* Called whenever the number of steps in flight may have changed: busy_us counts the time during
 * which at least one was. */
static void busy_update(batcher *b, uint64_t now_us)
{
    if (b->n_inflight > 0 && !b->busy_since)
        b->busy_since = now_us ? now_us : 1;
    else if (b->n_inflight == 0 && b->busy_since) {
        b->busy_us += now_us - b->busy_since;
        b->busy_since = 0;
    }
}

/* One METRICS message to the router (actors/router.h names the values). The values live in the
 * state and the frame comes from the runtime's pools: nothing is allocated per report. */
static void send_report(batcher *b)
{
    uint64_t now = sh__act_mono_us();
    if (b->busy_since) {
        b->busy_us += now - b->busy_since;
        b->busy_since = now;
    }
    const double v[9] = {b->n_waiting,
                         b->n_running,
                         b->a.max_seqs,
                         b->avail_est,
                         b->a.n_blocks,
                         (double)b->tot_tokens,
                         (double)b->tot_generated,
                         (double)b->busy_us,
                         (double)b->tot_steps};
    for (int i = 0; i < 9; i++)
        b->report[i].value = v[i];
    sh_proto_metrics m = {.at_us = now, .values = {b->report, 9}};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.router, SH_MSG_METRICS,
                     0, &m, &e))
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "metrics_send", "err=\"%s\"", e.msg);
}

static void report_init(batcher *b)
{
    static const char *const names[9] = {
        SH_ROUTER_M_WAITING,   SH_ROUTER_M_RUNNING,  SH_ROUTER_M_MAX_SEQS,
        SH_ROUTER_M_KV_FREE,   SH_ROUTER_M_KV_TOTAL, SH_ROUTER_M_TOKENS,
        SH_ROUTER_M_GENERATED, SH_ROUTER_M_BUSY_US,  SH_ROUTER_M_STEPS};
    for (int i = 0; i < 9; i++)
        b->report[i] = (sh_proto_metric){.name = {names[i], (uint32_t)strlen(names[i])},
                                         .kind = i < 5 ? 1 : 0};
}

/* ---- the actor ---------------------------------------------------------------------------- */

/* The first error of several calls. */
static void keep(sh_err *first, sh_err err)
{
    if (!*first)
        *first = err;
}

/* Registers the batcher's series, each labelled with metric_labels when set (so several
 * batchers share one registry). Returns SH_OK, SH_EINVAL (labels the registry refuses, or too
 * long) or SH_ENOMEM. */
static sh_err register_metrics(batcher *b)
{
    sh_metrics *mx = sh_runtime_metrics(sh_actor_runtime(b->ctx));
    const char *lb = b->a.metric_labels && b->a.metric_labels[0] ? b->a.metric_labels : NULL;
    char with[512];
    sh_err err = SH_OK;
    if (lb && strlen(lb) + 32 > sizeof with)
        return SH_EINVAL;
    keep(&err, sh_metrics_gauge(mx, "shoal_requests_running", "Sequences in the running set.", lb,
                                &b->m_running));
    keep(&err, sh_metrics_gauge(mx, "shoal_requests_waiting", "Sequences waiting for admission.",
                                lb, &b->m_waiting));
    keep(&err,
         sh_metrics_counter(mx, "shoal_preemptions_total",
                            "Sequences preempted (recomputed later) because KV blocks ran out.", lb,
                            &b->m_preempt));
    keep(&err, sh_metrics_counter(mx, "shoal_prompt_tokens_total", "Prompt tokens submitted.", lb,
                                  &b->m_prompt_toks));
    keep(&err, sh_metrics_counter(mx, "shoal_generation_tokens_total", "Tokens generated.", lb,
                                  &b->m_gen_toks));
    keep(&err, sh_metrics_counter(mx, "shoal_steps_total", "Batched forward steps run.", lb,
                                  &b->m_steps));
    for (int i = 0; i < 5; i++) {
        snprintf(with, sizeof with, "%s%sreason=\"%s\"", lb ? lb : "", lb ? "," : "", FIN_NAMES[i]);
        keep(&err,
             sh_metrics_counter(mx, "shoal_requests_finished_total",
                                "Finished sequences (choices) by reason.", with, &b->m_fin[i]));
    }
    static const double batch_bounds[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256};
    keep(&err, sh_metrics_histogram(mx, "shoal_batch_size", "Sequences per step.", lb, batch_bounds,
                                    sizeof batch_bounds / sizeof batch_bounds[0], &b->m_batch));
    static const double tok_bounds[] = {1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
    keep(&err,
         sh_metrics_histogram(mx, "shoal_step_tokens", "Tokens computed per step.", lb, tok_bounds,
                              sizeof tok_bounds / sizeof tok_bounds[0], &b->m_step_tokens));
    static const double time_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05,
                                         0.075, 0.1,    0.2,   0.5,  1,    2.5};
    keep(&err, sh_metrics_histogram(mx, "shoal_step_seconds",
                                    "Time a step spent on the stage (forward pass and sampling).",
                                    lb, time_bounds, sizeof time_bounds / sizeof time_bounds[0],
                                    &b->m_step_time));
    static const double fl_bounds[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
    keep(&err, sh_metrics_histogram(mx, "shoal_steps_in_flight",
                                    "Steps in flight when a step was sent, itself included (a "
                                    "pipeline of P stages keeps up to P).",
                                    lb, fl_bounds, sizeof fl_bounds / sizeof fl_bounds[0],
                                    &b->m_inflight));
    return err;
}

static sh_err batcher_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    batcher *b = state;
    const sh_batcher_args *a = arg;
    b->ctx = ctx;
    b->a = *a;
    if (b->a.max_step_tokens <= 0)
        b->a.max_step_tokens = 4096;
    if (b->a.max_seqs <= 0)
        b->a.max_seqs = 64;
    if (b->a.max_wait_ms <= 0)
        b->a.max_wait_ms = 50;
    if (b->a.max_queue <= 0)
        b->a.max_queue = 1024;
    if (b->a.block_tokens <= 0)
        b->a.block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS;
    if (!b->a.tok || b->a.n_ctx < 2 || b->a.n_vocab < 1 || !b->a.kvmgr || !b->a.stage)
        return SH_EINVAL;
    b->max_blocks = blocks_for(b, b->a.n_ctx) + 1;
    b->avail_est = b->a.n_blocks > 0 ? b->a.n_blocks : INT32_MAX / 2;
    b->max_inflight = b->a.max_inflight < 1 ? 1 : b->a.max_inflight > 64 ? 64 : b->a.max_inflight;
    b->running = calloc((size_t)b->a.max_seqs, sizeof *b->running);
    b->step_seqs = calloc((size_t)b->a.max_seqs, sizeof *b->step_seqs);
    b->fail_ids = calloc((size_t)b->a.max_seqs, sizeof *b->fail_ids);
    b->fl = calloc((size_t)b->max_inflight, sizeof *b->fl);
    for (int32_t i = 0; b->fl && i < b->max_inflight; i++)
        if (!(b->fl[i].order = calloc((size_t)b->a.max_seqs, sizeof *b->fl[i].order)))
            return SH_ENOMEM;
    if (!b->running || !b->step_seqs || !b->fail_ids || !b->fl ||
        sh__act_decoder_init(&b->dec, (size_t)1 << 20))
        return SH_ENOMEM;
    sh_err err = register_metrics(b);
    if (err)
        return err;
    sh_actor_timer_start(ctx, DEADLINE_TICK_MS, DEADLINE_TICK_MS, TIMER_DEADLINE, NULL);
    if (b->a.router) {
        // One report now, so that the router knows this replica before the first tick.
        uint32_t ms = b->a.report_ms ? b->a.report_ms : 1000;
        report_init(b);
        send_report(b);
        sh_actor_timer_start(ctx, ms, ms, TIMER_REPORT, NULL);
    }
    return SH_OK;
}

static sh_msg_fate batcher_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    batcher *b = state;
    const sh_msg_hdr *h = sh_msg_header(msg);
    sh_proto_body pb;
    sh_error e = {0};
    bool ok = h->type != SH_MSG_ERROR && sh__act_decode(&b->dec, msg, &pb, &e) == SH_OK;
    switch (h->type) {
    case SH_MSG_SUBMIT:
        if (ok)
            on_submit(b, msg, &pb.submit);
        break;
    case SH_MSG_CANCEL:
        if (ok)
            on_cancel(b, &pb.cancel);
        break;
    case SH_MSG_KV_ALLOC:
    case SH_MSG_KV_FORK:
        on_kv_reply(b, h->type, &pb, ok);
        break;
    case SH_MSG_STEP_DONE:
        if (ok)
            on_step_done(b, &pb.step_done);
        else
            step_lost(b);
        break;
    case SH_MSG_ERROR:
        // An undeliverable or timed-out KV request: treat as a refused reservation.
        if (b->allocs_out > 0)
            on_kv_reply(b, SH_MSG_KV_ALLOC, &pb, false);
        break;
    default:
        sh_actor_log(ctx, SH_LOG_LEVEL_DEBUG, "unexpected", "type=%u", (unsigned)h->type);
        break;
    }
    if (!ok && h->type != SH_MSG_ERROR)
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "bad_message", "type=%u err=\"%s\"", (unsigned)h->type,
                     e.msg);
    return SH_MSG_FATE_DONE;
}

static void batcher_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)ctx;
    batcher *b = state;
    if (tag == TIMER_REPORT) {
        send_report(b);
    } else if (tag == TIMER_FORM) {
        b->forming = false;
        plan_step(b);
    } else if (tag == TIMER_DEADLINE) {
        // With every pipeline slot taken only the steps' timeouts are checked (their answers
        // plan); otherwise the tick also plans, so that deadlines are enforced.
        bool full = b->n_inflight >= b->max_inflight;
        check_step_timeout(b);
        if (!full && !b->allocs_out && !b->forming && (b->n_running || b->n_waiting))
            plan_step(b);
    }
}

static void batcher_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    batcher *b = state;
    while (b->live) {
        breq *r = b->live;
        b->live = r->next_live;
        req_free(r);
    }
    free(b->running);
    free(b->step_seqs);
    free(b->fail_ids);
    for (int32_t i = 0; b->fl && i < b->max_inflight; i++)
        free(b->fl[i].order);
    free(b->fl);
    sh__act_decoder_fini(&b->dec);
}

const sh_actor_vtable sh__batcher_vtable = {
    .name = "batcher",
    .state_size = sizeof(batcher),
    .init = batcher_init,
    .handle = batcher_handle,
    .stop = batcher_stop,
    .timer = batcher_timer,
};
