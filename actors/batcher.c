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
 * Lost steps. STEP is one-way: a STEP, ACT or STEP_DONE dropped on a link (or corrupted, and so
 * dropped by the receiver's checksum) leaves a step unanswered. With step_timeout_ms (stages on
 * other nodes) the deadline tick sends such a step again under a new step id once its retry
 * deadline passes (max(step_retry_ms, 4 x the latency expected of a step of its size), doubled
 * at each retry): the same sequences, tokens, positions, block tables and seeds, so a stage that
 * already ran the lost try rewrites the same KV rows, and the first answer to any of the step's
 * tries is taken. A step still unanswered after step_retries retries, or step_timeout_ms after
 * its first try (a stage node that died), fails: the requests of its sequences get 503, the
 * other steps in flight go on, and the batcher goes on. A STEP_DONE whose step id is not one of a
 * step in flight's tries (late, a duplicate, or after a timeout) is ignored. A failed step's
 * sequences are failed whole, never resumed: the KV rows of a step that did not answer cannot be
 * trusted.
 *
 * Pause and resume. CONTROL op PAUSE (a stage node died; the front resumes once it is back)
 * abandons every step in flight, as if it had never been sent (its STEP_DONE is then an unknown
 * step id), puts every running sequence back in the queue as preemption does but with its KV
 * forgotten rather than freed, and sends the kvmgr CONTROL op RESET: the stages' KV rows cannot be
 * trusted, so every interrupted sequence is recomputed from its prompt and generated tokens
 * after RESUME, and its stream goes on with its next token. Nothing is planned while paused.
 *
 * A router (args.router) gets a METRICS report at init and every report_ms (send_report): load
 * gauges and counters of the work done, from which it derives capacity as tokens per busy
 * microsecond. CANCEL with withdraw takes back a request that never got KV (withdraw).
 *
 * Speculative decoding (args.spec ngram). After admission (plan_drafts), a sequence planned for
 * a one-token decode step may get k drafted tokens from the n-gram proposer (its own tokens, then
 * a pool all the replica's sequences feed), written after its last token and sent in the same
 * STEP (step_seq.draft = k); k comes from its recent acceptance and the measured cost of a
 * step's rows (each STEP_DONE's compute_us feeds sh_spec_cost), so it falls to 0 once the batch
 * is large enough. The drafts' KV positions are reserved (with the drafts' ids) by a KV_ALLOC of
 * their own; when it is refused the step goes without drafts and nobody is preempted. The answer
 * carries the accepted drafts and the stage's own token (step_out.more); each goes through step
 * 4 in turn and n_computed advances over the accepted ones kept, so rejected positions are never
 * reported computed, and the next KV_ALLOC gives them back first (keep): the prefix cache hashes
 * a block only by the ids of the tokens its KV was computed for. No drafts for a request that asks
 * for top logprobs or opted out (sampling.no_spec). With a draft model (args.spec draft or self)
 * the drafter actor at args.stage drafts: the batcher asks for k (step_seq.want_draft), reserves
 * k positions without ids, and takes the accepted tokens of the answer as they come; its metrics
 * and acceptance estimate count the drafts the drafter appended, which the last stage reports
 * (step_out.drafted), not the k asked for.
 *
 * Memory: a request's buffers (tokens, block tables, detokenizer, stop strings) are allocated at
 * SUBMIT; planning and token handling reuse state-owned arrays, so the steady state allocates
 * nothing per token (the stop-string matcher grows its buffer at most to its longest stop string).
 *
 * Files: this one (requests, SUBMIT and CANCEL, reports, the actor), batcher_plan.c (the queue,
 * admission, preemption, steps 1 to 3), batcher_step.c (step 4, failed and timed-out steps),
 * batcher_int.h (the state they share).
 *
 * Thread: every member runs on the batcher's loop thread. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/batcher_int.h"
#include "actors/router.h"
#include "actors/stage_grammar.h"
#include "base/error.h"

/* Slots of the replica's n-gram pool (model/spec.h: about 80 bytes each). */
#define SPEC_POOL_ENTRIES (1 << 15)

static const char *const FIN_NAMES[5] = {"stop", "length", "cancel", "timeout", "error"};

/* ---- requests ----------------------------------------------------------------------------- */

void sh__batcher_update_gauges(batcher *b)
{
    sh_gauge_set(b->m_running, b->n_running);
    sh_gauge_set(b->m_waiting, b->n_waiting);
    sh_gauge_set(b->m_paused, b->paused);
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
        free(r->seqs[i].emb_sum);
        free(r->seqs[i].emb_vec);
    }
    free(r->seqs);
    free(r->bias);
    free(r->grammar);
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

breq *sh__batcher_find_req(batcher *b, uint64_t id)
{
    for (breq *r = b->live; r; r = r->next_live)
        if (r->id == id)
            return r;
    return NULL;
}

static void send_fail(batcher *b, const breq *r, sh_err code, uint32_t http, const char *fmt, ...)
    SH_PRINTF(5, 6);
static void send_fail(batcher *b, const breq *r, sh_err code, uint32_t http, const char *fmt, ...)
{
    char msg[512];
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
void sh__batcher_kv_release(batcher *b, bseq *s)
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
        sh__batcher_plan_queue_remove(b, s);
    else if (s->state == SEQ_RUNNING)
        sh__batcher_plan_running_remove(b, s);
    sh__batcher_kv_release(b, s);
    s->state = SEQ_FINISHED;
}

/* Ends a request: frees what is left, counts it, unlinks it. */
static void req_end(batcher *b, breq *r)
{
    for (int32_t i = 0; i < r->n_choices; i++)
        seq_retire(b, &r->seqs[i]);
    live_remove(b, r);
    req_free(r);
    sh__batcher_update_gauges(b);
}

/* A choice finished (fin an sh_proto_finish, or FIN_ERROR): flushes its text, frees its KV and
 * sends DONE; the request ends with its last choice. */
void sh__batcher_seq_finish(batcher *b, bseq *s, int fin)
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
                           .choice = (uint32_t)s->choice,
                           .embedding = {s->emb_vec, s->emb_vec ? (uint32_t)s->emb_dim : 0}};
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
    sh__batcher_update_gauges(b);
}

/* Fails a whole request: FAIL to the gateway, every unfinished choice counted as an error. */
void sh__batcher_req_fail(batcher *b, breq *r, sh_err code, uint32_t http, const char *msg)
{
    send_fail(b, r, code, http, "%s", msg);
    for (int32_t i = 0; i < r->n_choices; i++)
        if (r->seqs[i].state != SEQ_FINISHED)
            sh_counter_add(b->m_fin[FIN_ERROR], 1);
    req_end(b, r);
}

/* Finishes every unfinished choice of r that is not in a step in flight with fin (the others
 * when their step is answered); r is freed with its last choice. */
void sh__batcher_req_finish_all(batcher *b, breq *r, int fin)
{
    int32_t left = 0;
    for (int32_t i = 0; i < r->n_choices; i++)
        left += r->seqs[i].state != SEQ_FINISHED && !r->seqs[i].in_step;
    for (int32_t i = 0; left > 0; i++)
        if (r->seqs[i].state != SEQ_FINISHED && !r->seqs[i].in_step) {
            left--;
            sh__batcher_seq_finish(b, &r->seqs[i], fin);
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
    r->samp.grammar = (sh_strv){0};
    if (in->grammar.len) {
        if (!(r->grammar = malloc(in->grammar.len)))
            return SH_ENOMEM;
        memcpy(r->grammar, in->grammar.ptr, in->grammar.len);
        r->samp.grammar = (sh_strv){r->grammar, in->grammar.len};
        r->gram_hash = sh__sgram_text_hash(r->samp.grammar);
    }
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
    sh_spec_seq_init(&s->spec);
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
    if (sh__batcher_find_req(b, m->req)) {
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
    r->min_mask = (int32_t)m->min_mask;
    if (r->min_mask > r->min_tokens)
        r->min_tokens = r->min_mask;
    r->embed = m->embed;
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
        sh__batcher_plan_queue_insert(b, &r->seqs[i]);
    }
    sh_counter_add(b->m_prompt_toks, (uint64_t)n_prompt);
    sh__batcher_update_gauges(b);
    // A step can start (idle, or a pipeline slot free): wait a moment for a burst to form one
    // batch; otherwise the next plan picks it up.
    if (!b->paused && b->n_inflight < b->max_inflight && b->allocs_out == 0) {
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
            sh__batcher_plan_step(b);
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
    breq *r = sh__batcher_find_req(b, m->req);
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
            sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_CANCEL);
    }
}

/* ---- CONTROL: pause and resume ----------------------------------------------------------- */

/* PAUSE (a stage node of the replica died; the front resumes once it is back). Idempotent.
 * Every step in flight is abandoned: its slot is free, so its STEP_DONE (late or duplicated) is
 * an unknown step id and ignored, and its timeout no longer runs. Every running sequence goes
 * back to the queue as a preempted one does, keeping its tokens, but with its KV forgotten
 * without a KV_FREE; a cancelled request whose answer was awaited ends now. Then the kvmgr gets
 * one CONTROL op RESET, after every KV message sent before it (one sender, one mailbox: FIFO),
 * and the replies still due to earlier KV requests are absorbed unread (stale_kv). */
static void pause_replica(batcher *b)
{
    if (b->paused)
        return;
    b->paused = true;
    if (b->forming) {
        sh_actor_timer_stop(b->ctx, b->form_timer);
        b->forming = false;
    }
    int32_t steps = sh__batcher_step_abandon_all(b);
    b->epoch = b->step_no + 1; /* the steps after the resume: their stages drop older ones */
    b->stale_kv += b->allocs_out;
    b->allocs_out = 0;
    uint64_t now_us = sh__act_mono_us();
    int32_t requeued = 0;
    while (b->n_running > 0) {
        bseq *s = b->running[b->n_running - 1];
        sh__batcher_plan_running_remove(b, s);
        s->kv_id = 0;
        s->n_blocks = 0;
        s->n_computed = s->n_reserved = s->n_marked = 0;
        s->planned = s->alloc_ok = s->sampled = s->short_kv = s->in_step = false;
        s->step_k = s->step_draft = 0;
        s->queued_us = now_us;
        s->queued_step = b->step_no;
        sh__batcher_plan_queue_insert(b, s);
        requeued++;
    }
    // A choice waiting to fork whose first choice is queued again waits for it again; one that
    // already forked recomputes on its own (its KV went with the pool).
    for (breq *r = b->live, *next; r; r = next) {
        next = r->next_live;
        if (r->cancelled)
            sh__batcher_req_finish_all(b, r, SH_PROTO_FINISH_CANCEL);
    }
    b->avail_est = b->a.n_blocks > 0 ? b->a.n_blocks : INT32_MAX / 2;
    sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_RESET};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.kvmgr, SH_MSG_CONTROL, 0,
                     &c, &e))
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "kv_reset_send", "err=\"%s\"", e.msg);
    sh__batcher_update_gauges(b);
    sh_actor_log(b->ctx, SH_LOG_LEVEL_INFO, "batcher_paused",
                 "steps_abandoned=%d seqs_requeued=%d kv_replies_due=%d waiting=%d", (int)steps,
                 (int)requeued, (int)b->stale_kv, (int)b->n_waiting);
}

/* RESUME: planning starts again; the queued sequences are admitted with their whole token list
 * (prompt and generated) and recomputed, and each stream goes on with its next token. A RESUME
 * when not paused does nothing. */
static void resume_replica(batcher *b)
{
    if (!b->paused)
        return;
    b->paused = false;
    sh__batcher_update_gauges(b);
    sh_actor_log(b->ctx, SH_LOG_LEVEL_INFO, "batcher_resumed", "waiting=%d requests=%d",
                 (int)b->n_waiting, (int)b->n_reqs);
    sh__batcher_plan_step(b);
}

static void on_control(batcher *b, const sh_proto_control *m)
{
    if (m->op == SH_PROTO_CONTROL_OP_REROUTE && m->targets.n == 1) {
        // A standby took over the first stage: steps go to its new address from now on (the
        // replica is paused meanwhile; the RESUME that follows recomputes there).
        b->a.stage = sh_u64s_at(m->targets, 0);
        sh_actor_log(b->ctx, SH_LOG_LEVEL_INFO, "batcher_rerouted", "stage=%" PRIu64,
                     (uint64_t)b->a.stage);
        return;
    }
    if (m->op == SH_PROTO_CONTROL_OP_PAUSE)
        pause_replica(b);
    else if (m->op == SH_PROTO_CONTROL_OP_RESUME)
        resume_replica(b);
    else
        sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "control_ignored", "op=%u", (unsigned)m->op);
}

/* ---- reports to the router --------------------------------------------------------------- */

/* Called whenever the number of steps in flight may have changed: busy_us counts the time during
 * which at least one was. */
void sh__batcher_busy_update(batcher *b, uint64_t now_us)
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
    keep(&err, sh_metrics_gauge(mx, "shoal_batcher_paused",
                                "1 while the replica is paused (CONTROL PAUSE until RESUME).", lb,
                                &b->m_paused));
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
    keep(&err, sh_metrics_counter(mx, "shoal_step_retries_total",
                                  "Steps sent again (under a new step id) because their STEP_DONE "
                                  "did not come in time or failed for a link's reasons.",
                                  lb, &b->m_retries));
    keep(&err,
         sh_metrics_counter(mx, "shoal_step_answers_ignored_total",
                            "STEP_DONE answers ignored: late (another try answered first, "
                            "or the step failed or was abandoned), duplicated or undecodable.",
                            lb, &b->m_ignored));
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
    static const double wait_bounds[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1,
                                         1.5,   2,     3,    5,     7.5,  10,  20,   30,  60};
    keep(&err, sh_metrics_histogram(mx, "shoal_queue_wait_seconds",
                                    "Time a request's sequence waited in the batcher's queue "
                                    "before it first joined the running set.",
                                    lb, wait_bounds, sizeof wait_bounds / sizeof wait_bounds[0],
                                    &b->m_queue_wait));
    static const double fl_bounds[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
    keep(&err, sh_metrics_histogram(mx, "shoal_steps_in_flight",
                                    "Steps in flight when a step was sent, itself included (a "
                                    "pipeline of P stages keeps up to P).",
                                    lb, fl_bounds, sizeof fl_bounds / sizeof fl_bounds[0],
                                    &b->m_inflight));
    keep(&err, sh_metrics_counter(mx, "shoal_spec_drafts_total",
                                  "Steps of a sequence that carried drafted tokens (speculative "
                                  "decoding).",
                                  lb, &b->m_spec_drafts));
    keep(&err,
         sh_metrics_counter(mx, "shoal_spec_draft_tokens_total",
                            "Drafted tokens sent to be verified.", lb, &b->m_spec_draft_toks));
    keep(&err, sh_metrics_counter(mx, "shoal_spec_accepted_tokens_total",
                                  "Drafted tokens the target accepted.", lb, &b->m_spec_accepted));
    for (int i = 0; i < SH_SPEC_MAX_K; i++) {
        snprintf(with, sizeof with, "%s%spos=\"%d\"", lb ? lb : "", lb ? "," : "", i + 1);
        keep(&err, sh_metrics_counter(mx, "shoal_spec_accepted_position_total",
                                      "Drafted tokens accepted, by their position in the draft "
                                      "(1: the first).",
                                      with, &b->m_spec_pos[i]));
    }
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
    for (int32_t id = 0; id < b->a.n_vocab && b->n_eog < SH_PROTO_MAX_BAN; id++)
        if (sh_tokenizer_is_eog(b->a.tok, id) || (b->a.llama2c && id == sh_tokenizer_bos(b->a.tok)))
            b->eog[b->n_eog++] = id;
    // Sequence and step ids count from the clock (Unix ms << 16), not from 1: stage nodes keep a
    // sampler per sequence id and the reply address of recent step ids, so a front restarted in
    // front of running workers must never reuse an id its predecessor used (that would take 65536
    // sequences per millisecond of the predecessor's life).
    b->next_kv_id = b->step_no = (sh__act_unix_ms() & ((1ull << 44) - 1)) << 16;
    b->epoch = b->step_no + 1;
    b->avail_est = b->a.n_blocks > 0 ? b->a.n_blocks : INT32_MAX / 2;
    b->max_inflight = b->a.max_inflight < 1 ? 1 : b->a.max_inflight > 64 ? 64 : b->a.max_inflight;
    // Retries only where steps can be lost: with stages on other nodes (step_timeout_ms).
    b->retries_max = b->a.step_retries == 0 ? 5 : b->a.step_retries;
    if (b->retries_max < 0 || !b->a.step_timeout_ms)
        b->retries_max = 0;
    if (b->retries_max > STEP_TRIES_MAX - 1)
        b->retries_max = STEP_TRIES_MAX - 1;
    b->retry_min_ms = b->a.step_retry_ms ? b->a.step_retry_ms : 200;
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
    if (b->a.spec != SH_SPEC_OFF && b->a.spec != SH_SPEC_NGRAM && b->a.spec != SH_SPEC_DRAFT &&
        b->a.spec != SH_SPEC_SELF)
        return SH_EINVAL;
    if (b->a.spec != SH_SPEC_OFF) {
        if (b->a.spec_k <= 0)
            b->a.spec_k = SH_SPEC_DEFAULT_K;
        if (b->a.spec_k > SH_SPEC_MAX_K)
            return SH_EINVAL;
        sh_spec_cost_init(&b->cost);
        b->spec_on = true;
        b->remote = b->a.spec != SH_SPEC_NGRAM; /* the drafter at `stage` drafts */
        sh_error pe = {0};
        if (!b->remote && sh_spec_pool_create(SPEC_POOL_ENTRIES, &b->pool, &pe))
            return SH_ENOMEM;
    }
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
    case SH_MSG_CONTROL:
        if (ok)
            on_control(b, &pb.control);
        break;
    case SH_MSG_KV_ALLOC:
    case SH_MSG_KV_FORK:
        sh__batcher_plan_kv_reply(b, h->type, &pb, ok);
        break;
    case SH_MSG_STEP_DONE:
        if (ok)
            sh__batcher_step_done(b, &pb.step_done);
        else
            sh__batcher_step_lost(b);
        break;
    case SH_MSG_ERROR:
        // An undeliverable or timed-out KV request: treat as a refused reservation.
        if (b->allocs_out > 0 || b->stale_kv > 0)
            sh__batcher_plan_kv_reply(b, SH_MSG_KV_ALLOC, &pb, false);
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
        sh__batcher_plan_step(b);
    } else if (tag == TIMER_DEADLINE) {
        // With every pipeline slot taken only the steps' timeouts are checked (their answers
        // plan); otherwise the tick also plans, so that deadlines are enforced.
        bool full = b->n_inflight >= b->max_inflight;
        if (b->paused) {
            sh__batcher_plan_expire(b); /* deadlines hold while paused; nothing is planned */
            return;
        }
        sh__batcher_step_check_timeouts(b);
        if (!full && !b->allocs_out && !b->forming && (b->n_running || b->n_waiting))
            sh__batcher_plan_step(b);
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
    sh_spec_pool_destroy(b->pool);
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
