/* The batcher's step 4 (actors/batcher.c has the overview): the answers of the steps in flight,
 * the tokens they bring, steps that were lost and are sent again, and steps that failed or timed
 * out. Thread: the batcher's loop. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/batcher_int.h"
#include "base/error.h"
#include "model/sampler.h"

/* ---- STEP_DONE ---------------------------------------------------------------------------- */

/* One generated token of s: its logprob (lp, lp_raw) and top lists (top_tokens and
 * top_logprobs, empty but for a step's first token). Appends it, streams it as TOKEN and checks
 * it against EOS, stop strings, max_tokens and the context. Returns false when it finished the
 * sequence: s may then be freed (with its request) and must not be touched. */
static bool emit_token(batcher *b, bseq *s, int32_t id, float lp_log, float lp_raw,
                       sh_i32s top_tokens, sh_f32s top_logprobs)
{
    breq *r = s->r;
    bool eog =
        (sh_tokenizer_is_eog(b->a.tok, id) || (b->a.llama2c && id == sh_tokenizer_bos(b->a.tok))) &&
        s->n_gen >= r->min_tokens;
    if (eog) {
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_STOP);
        return false;
    }
    s->toks[s->n_toks++] = id;
    s->n_gen++;
    b->tot_generated++;
    sh_counter_add(b->m_gen_toks, 1);
    const char *text = NULL, *out = NULL;
    size_t len = 0, out_len = 0;
    bool stopped = false;
    // Before min_tokens no stop string ends the text (as vLLM): the stopper looks for none then,
    // so a stop string counts only when it completes in text after that.
    int n_stop = s->stop.n_stop;
    if (s->n_gen < r->min_mask)
        s->stop.n_stop = 0;
    if (sh_tokenizer_stream_feed(s->detok, id, &text, &len) == SH_OK && len)
        sh_openai_stopper_feed(&s->stop, text, len, &out, &out_len, &stopped);
    s->stop.n_stop = n_stop;
    if (!r->cancelled) {
        sh_proto_token t = {.req = r->id,
                            .index = (uint32_t)(s->n_gen - 1),
                            .tokens = {&s->toks[s->n_toks - 1], 1},
                            .text = {out ? out : "", (uint32_t)out_len},
                            .choice = (uint32_t)s->choice};
        float lp = r->samp.logprobs_mode == SH_LOGPROBS_RAW ? lp_raw : lp_log;
        t.logprobs = (sh_f32s){&lp, 1};
        t.top_n = (uint8_t)top_tokens.n;
        t.top_tokens = top_tokens;
        t.top_logprobs = top_logprobs;
        sh_error e = {0};
        if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), r->reply_to, SH_MSG_TOKEN,
                         r->trace, &t, &e))
            sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "token_send", "req=%" PRIu64 " err=\"%s\"",
                         r->id, e.msg);
    }
    if (stopped) {
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_STOP);
        return false;
    }
    if (s->n_gen >= r->max_tokens || s->n_toks >= b->a.n_ctx) {
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_LENGTH);
        return false;
    }
    return true;
}

/* How many drafts sequence s's step carried, of the `asked` the batcher planned: its own n-gram
 * drafts are all sent; a drafter actor (remote) appends up to `asked` (fewer where the block table
 * or its model says so, none when it fails), and the last stage reports how many in
 * step_out.drafted. A stage older than that field answers 0 there: an answer with accepted drafts
 * and drafted 0 counts as `asked`; one with none counts as no drafts. */
static int32_t answer_drafted(batcher *b, const bseq *s, const sh_proto_step_out *o, int32_t asked)
{
    if (!b->remote)
        return asked;
    if (o->drafted == 0 && o->more.n > 0)
        return asked;
    if ((int64_t)o->drafted > asked) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "step_answer_bad",
                     "req=%" PRIu64 " drafted=%u of %d asked for", s->r->id, (unsigned)o->drafted,
                     (int)asked);
        return asked;
    }
    return (int32_t)o->drafted;
}

/* The tokens of one sequence's answer: `token`, then `more` (a step with `drafted` drafts: the
 * accepted drafts, then the stage's own token). Each goes through emit_token in order, and the
 * first that finishes the sequence ends it: the tokens after a stop are dropped. The KV of an
 * accepted draft's position is the sequence's, so n_computed advances over the accepted drafts
 * that were kept; positions after them hold rejected drafts and are never reported computed
 * (the next steps overwrite them). An answer with fewer tokens than drafted + 1 is the stage
 * rejecting drafts (a stage that ignores drafts answers one token); one with more, or whose
 * accepted tokens differ from the drafts, is the stage's error: only its outputs up to the first
 * that differs from the drafts are taken. */
static void emit_answer(batcher *b, bseq *s, const sh_proto_step_out *o, int32_t drafted)
{
    int32_t dr[SH_SPEC_MAX_K] = {0};
    int32_t n_out = 1 + (int32_t)o->more.n;
    bool lp_ok = o->more_lp.n == o->more.n && o->more_lp_raw.n == o->more.n;
    if (n_out > drafted + 1 || !lp_ok) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "step_answer_bad",
                     "req=%" PRIu64 " drafted=%d answered=%d more_lp=%u more_lr=%u", s->r->id,
                     (int)drafted, (int)n_out, (unsigned)o->more_lp.n, (unsigned)o->more_lp_raw.n);
        n_out = 1;
    }
    for (int32_t i = 0; i < drafted && !b->remote; i++)
        dr[i] = s->toks[s->n_toks + i];
    int32_t accepted = b->remote ? n_out - 1 : 0; /* a drafter's drafts are not known here */
    while (accepted < n_out - 1 &&
           (accepted == 0 ? o->token : sh_i32s_at(o->more, (uint32_t)accepted - 1)) == dr[accepted])
        accepted++;
    if (accepted < n_out - 1) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "step_answer_bad",
                     "req=%" PRIu64 " answer differs from the drafts at %d of %d", s->r->id,
                     (int)accepted, (int)n_out);
        n_out = accepted + 1;
    }
    if (drafted > 0) {
        sh_spec_seq_update(&s->spec, drafted, accepted);
        sh_counter_add(b->m_spec_drafts, 1);
        sh_counter_add(b->m_spec_draft_toks, (uint64_t)drafted);
        sh_counter_add(b->m_spec_accepted, (uint64_t)accepted);
        for (int32_t i = 0; i < accepted; i++)
            sh_counter_add(b->m_spec_pos[i], 1);
    }
    for (int32_t i = 0; i < n_out; i++) {
        int32_t id = i == 0 ? o->token : sh_i32s_at(o->more, (uint32_t)i - 1);
        if (id < 0 || id >= b->a.n_vocab) {
            sh__batcher_req_fail(b, s->r, SH_EPROTO, 500,
                                 "the stage sampled a token outside the vocabulary");
            return;
        }
        float lp = i == 0 ? o->logprob : sh_f32s_at(o->more_lp, (uint32_t)i - 1);
        float lr = i == 0 ? o->logprob_raw : sh_f32s_at(o->more_lp_raw, (uint32_t)i - 1);
        if (!emit_token(b, s, id, lp, lr, i == 0 ? o->top_tokens : (sh_i32s){0},
                        i == 0 ? o->top_logprobs : (sh_f32s){0}))
            return;
        if (i < accepted)
            s->n_computed++; /* the accepted draft's KV: the position of the token just kept */
    }
}

/* Takes step f out of flight (its slot is free again): its sequences are in no step now. */
static void flight_end(batcher *b, flight *f)
{
    for (int32_t i = 0; i < f->n; i++)
        if (f->order[i])
            f->order[i]->in_step = false;
    f->step = 0;
    f->n_tries = 0;
    b->n_inflight--;
    sh__batcher_busy_update(b, sh__act_mono_us());
}

int32_t sh__batcher_step_abandon_all(batcher *b)
{
    int32_t n = 0;
    for (int32_t i = 0; i < b->max_inflight; i++)
        if (b->fl[i].step) {
            flight_end(b, &b->fl[i]);
            n++;
        }
    return n;
}

/* Plans the next step after one left flight. With several steps in flight a burst may be
 * forming meanwhile (on_submit); the answer plans at once instead. */
static void plan_after_step(batcher *b)
{
    if (b->max_inflight > 1 && b->forming) {
        sh_actor_timer_stop(b->ctx, b->form_timer);
        b->forming = false;
    }
    sh__batcher_plan_step(b);
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
        breq *r = sh__batcher_find_req(b, b->fail_ids[i]);
        if (r)
            sh__batcher_req_fail(b, r, code, http, msg);
    }
    plan_after_step(b);
}

/* The step in flight one of whose tries has id `step`, and which try (*k), or NULL. */
static flight *find_flight(batcher *b, uint64_t step, int32_t *k)
{
    for (int32_t i = 0; step && i < b->max_inflight; i++)
        for (int32_t t = b->fl[i].step ? b->fl[i].n_tries - 1 : -1; t >= 0; t--)
            if (b->fl[i].tries[t] == step) {
                *k = t;
                return &b->fl[i];
            }
    return NULL;
}

/* Sends step f again under a new id, its sequences as they are (none has moved: a sequence in a
 * step in flight is in no other and is not preempted). Returns false when the stage could not be
 * reached (the caller fails the step). */
static bool step_resend(batcher *b, flight *f, uint64_t now_us)
{
    uint32_t n = 0;
    for (int32_t i = 0; i < f->n; i++)
        if (f->order[i])
            sh__batcher_plan_seq_fill(b, f->order[i], &b->step_seqs[n++]);
    uint64_t id = ++b->step_no;
    sh_proto_step st = {
        .step = id, .seqs = {b->step_seqs, n}, .epoch = b->epoch, .retry_of = f->tries[0]};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.stage, SH_MSG_STEP, 0,
                     &st, &e)) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_send", "step=%" PRIu64 " err=\"%s\"", id,
                     e.msg);
        return false;
    }
    sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "step_sent",
                 "step=%" PRIu64 " epoch=%" PRIu64 " seqs=%d retry_of=%" PRIu64, id, b->epoch,
                 (int)n, f->tries[0]);
    f->tries[f->n_tries] = id; /* room: retries_max < STEP_TRIES_MAX */
    f->tries_us[f->n_tries] = now_us;
    f->n_tries++;
    f->step = id;
    f->sent_us = now_us;
    sh_counter_add(b->m_retries, 1);
    return true;
}

/* Retries sent for f so far. */
static int32_t retries_of(const flight *f) { return f->n_tries - 1; }

#define COLD_EXPECT_US 1000000.0 /* a step's expected latency before any step was answered */

/* How long the latest try of f may go unanswered before it is sent again. Stages run steps in
 * the order they come and links keep order, so when a try sent after f's latest was answered
 * already, f's was lost (or held back by a delay): a short while, retry_min_ms / 4. Otherwise
 * 4 x the latency expected of a step of f's size (the moving average, scaled by its tokens over
 * the average step's; 1 s before the first answer), at least retry_min_ms. Doubled at each
 * retry, so that a step that is only slow is not sent again and again. */
static uint64_t retry_after_us(const batcher *b, const flight *f)
{
    double us;
    if (b->answered_sent_us > f->sent_us) {
        us = (double)b->retry_min_ms * 250;
    } else {
        double expect = b->lat_avg_us > 0 ? b->lat_avg_us : COLD_EXPECT_US;
        if (b->tok_avg > 0 && f->n_tok > b->tok_avg)
            expect *= (double)f->n_tok / b->tok_avg;
        us = 4 * expect;
        if (us < (double)b->retry_min_ms * 1000)
            us = (double)b->retry_min_ms * 1000;
    }
    int32_t r = retries_of(f);
    return (uint64_t)us << (r < 6 ? r : 6);
}

/* A status a stage answers for a link's reasons (the next stage unreachable, a queue full): the
 * step may well run when sent again. */
static bool status_transient(int32_t status)
{
    return status == SH_EIO || status == SH_EBUSY || status == SH_ETIMEDOUT || status == SH_ECLOSED;
}

void sh__batcher_step_done(batcher *b, const sh_proto_step_done *m)
{
    int32_t k = 0;
    flight *f = find_flight(b, m->step, &k);
    if (!f) {
        // Late (its step already timed out or was answered through another try) or a duplicate:
        // the requests it was for are gone or moved on.
        sh_counter_add(b->m_ignored, 1);
        sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "step_done_ignored",
                     "step=%" PRIu64 " in_flight=%d", m->step, (int)b->n_inflight);
        return;
    }
    if (m->compute_us)
        sh_histogram_observe(b->m_step_time, (double)m->compute_us * 1e-6);
    if (m->status && b->retries_max > 0 && status_transient(m->status) &&
        retries_of(f) < b->retries_max) {
        // A failed try for a link's reasons: the next try goes out at once.
        sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "step_retry",
                     "step=%" PRIu64 " try=%d status=%d msg=\"%.*s\"", m->step, (int)f->n_tries,
                     (int)m->status, (int)m->message.len, m->message.ptr);
        if (step_resend(b, f, sh__act_mono_us()))
            return;
    }
    if (m->status) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_failed",
                     "step=%" PRIu64 " status=%d msg=\"%.*s\"", m->step, (int)m->status,
                     (int)m->message.len, m->message.ptr);
        fail_step(b, f, (sh_err)m->status, 500, "the model step failed");
        return;
    }
    b->tot_steps++;
    {
        // The moving averages that set retry deadlines: the latency of the try that answered.
        double lat = (double)(sh__act_mono_us() - f->tries_us[k]);
        if (f->tries_us[k] > b->answered_sent_us)
            b->answered_sent_us = f->tries_us[k];
        if (b->lat_avg_us == 0) {
            b->lat_avg_us = lat;
            b->tok_avg = f->n_tok;
        } else {
            b->lat_avg_us += 0.1 * (lat - b->lat_avg_us);
            b->tok_avg += 0.1 * ((double)f->n_tok - b->tok_avg);
        }
    }
    for (int32_t i = 0; i < f->n; i++) {
        bseq *s = f->order[i];
        if (!s)
            continue;
        s->n_computed += s->step_k;
        b->tot_tokens += (uint64_t)s->step_k;
        s->step_k = 0;
    }
    flight_end(b, f);
    int32_t n_rows = f->n_tok; /* the step's rows: less the drafts a drafter did not append */
    for (uint32_t j = 0; j < m->seqs.n; j++) {
        const sh_proto_step_out *o = &m->seqs.v[j];
        bseq *s = sh__batcher_plan_find_running(b, o->seq);
        if (!s || s->state != SEQ_RUNNING || s->in_step)
            continue;
        int32_t asked = s->step_draft;
        s->step_draft = 0;
        int32_t drafted = asked > 0 && o->token >= 0 ? answer_drafted(b, s, o, asked) : asked;
        n_rows -= asked - drafted;
        if (s->r->cancelled) {
            sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_CANCEL);
            continue;
        }
        if (o->status == SH_ENOTFOUND && s->sampled && s->r->samp.grammar.len &&
            s->n_computed == s->n_toks && s->n_computed > 0) {
            // The stage lacks the sequence's matcher and had only the grammar's hash: the next
            // step feeds the last token again (its KV is there already; this writes the same
            // values) with the grammar's text and the generated tokens, as after an admission.
            sh_actor_log(b->ctx, SH_LOG_LEVEL_INFO, "grammar_resend",
                         "req=%" PRIu64 " seq=%" PRIu64 " n_gen=%d", s->r->id, o->seq,
                         (int)s->n_gen);
            s->sampled = false;
            s->n_computed--;
            continue;
        }
        if (o->status) {
            // This sequence alone failed at the stage (its grammar's matcher passed its bounds,
            // every token was banned): its request ends with the stage's reason; the step's
            // other sequences go on.
            char msg[SH_PROTO_MAX_MSG / 4];
            snprintf(msg, sizeof msg, "%.*s", (int)o->message.len,
                     o->message.ptr ? o->message.ptr : "");
            sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "seq_failed",
                         "req=%" PRIu64 " seq=%" PRIu64 " status=%d msg=\"%s\"", s->r->id, o->seq,
                         (int)o->status, msg);
            sh__batcher_req_fail(b, s->r, (sh_err)o->status, 500,
                                 msg[0] ? msg : "the stage failed this sequence");
            continue;
        }
        if (s->r->embed) {
            sh__batcher_embed_answer(b, s, o);
            continue;
        }
        if (o->token < 0)
            continue;
        s->sampled = true;
        emit_answer(b, s, o, drafted);
    }
    if (m->compute_us && b->spec_on)
        sh_spec_cost_observe(&b->cost, n_rows, (double)m->compute_us);
    plan_after_step(b);
}

/* A STEP_DONE that could not be decoded: its step id is unknown. With retries its step is sent
 * again at its deadline like a lost one; without, it counts as the answer to the oldest step in
 * flight (stages answer in order), whose requests fail. */
void sh__batcher_step_lost(batcher *b)
{
    if (b->retries_max > 0) {
        sh_counter_add(b->m_ignored, 1);
        return;
    }
    flight *oldest = NULL;
    for (int32_t i = 0; i < b->max_inflight; i++)
        if (b->fl[i].step && (!oldest || b->fl[i].step < oldest->step))
            oldest = &b->fl[i];
    if (!oldest)
        return;
    sh_proto_step_done lost = {
        .step = oldest->step, .status = SH_EPROTO, .message = {"undecodable STEP_DONE", 21}};
    sh__batcher_step_done(b, &lost);
}

/* The deadline tick. A step whose latest try is past its retry deadline was lost on the way (a
 * STEP, ACT or STEP_DONE dropped or corrupted) or is slow: it is sent again. A step in flight
 * step_timeout_ms after its first try, or past its deadline with no retry left, fails: a stage
 * node that died (or hangs) never answers; that step's requests fail and batching goes on. */
void sh__batcher_step_check_timeouts(batcher *b)
{
    if (!b->n_inflight || !b->a.step_timeout_ms)
        return;
    uint64_t now_us = sh__act_mono_us();
    for (int32_t i = 0; i < b->max_inflight; i++) {
        flight *f = &b->fl[i];
        if (!f->step)
            continue;
        uint64_t waited_us = now_us - f->first_us;
        bool over = waited_us >= (uint64_t)b->a.step_timeout_ms * 1000;
        if (!over && b->retries_max > 0 && now_us - f->sent_us >= retry_after_us(b, f)) {
            if (retries_of(f) < b->retries_max) {
                sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "step_retry",
                             "step=%" PRIu64 " try=%d seqs=%d waited_ms=%" PRIu64, f->step,
                             (int)f->n_tries + 1, (int)f->n, (now_us - f->sent_us) / 1000);
                if (step_resend(b, f, now_us))
                    continue;
            }
            over = true;
        }
        if (!over)
            continue;
        char msg[160];
        snprintf(msg, sizeof msg,
                 "the pipeline did not answer step %" PRIu64 " in %" PRIu64
                 " ms (%d tries); a stage node may be down",
                 f->tries[0], waited_us / 1000, (int)f->n_tries);
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_timeout",
                     "step=%" PRIu64 " tries=%d seqs=%d waited_ms=%" PRIu64 " timeout_ms=%" PRIu32,
                     f->tries[0], (int)f->n_tries, (int)f->n, waited_us / 1000,
                     b->a.step_timeout_ms);
        fail_step(b, f, SH_ETIMEDOUT, 503, msg);
    }
}
