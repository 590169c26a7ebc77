/* The batcher's step 4 (actors/batcher.c has the overview): the answers of the steps in flight,
 * the tokens they bring, and steps that failed, were lost or timed out. Thread: the batcher's
 * loop. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/batcher_int.h"
#include "base/error.h"
#include "model/sampler.h"

/* ---- STEP_DONE ---------------------------------------------------------------------------- */

static void emit_token(batcher *b, bseq *s, const sh_proto_step_out *o)
{
    breq *r = s->r;
    int32_t id = o->token;
    bool eog =
        (sh_tokenizer_is_eog(b->a.tok, id) || (b->a.llama2c && id == sh_tokenizer_bos(b->a.tok))) &&
        s->n_gen >= r->min_tokens;
    if (eog) {
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_STOP);
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
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_STOP);
        return;
    }
    if (s->n_gen >= r->max_tokens || s->n_toks >= b->a.n_ctx)
        sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_LENGTH);
}

/* Takes step f out of flight (its slot is free again): its sequences are in no step now. */
static void flight_end(batcher *b, flight *f)
{
    for (int32_t i = 0; i < f->n; i++)
        if (f->order[i])
            f->order[i]->in_step = false;
    f->step = 0;
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

static flight *find_flight(batcher *b, uint64_t step)
{
    for (int32_t i = 0; step && i < b->max_inflight; i++)
        if (b->fl[i].step == step)
            return &b->fl[i];
    return NULL;
}

void sh__batcher_step_done(batcher *b, const sh_proto_step_done *m)
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
        bseq *s = sh__batcher_plan_find_running(b, o->seq);
        if (!s || s->state != SEQ_RUNNING || s->in_step)
            continue;
        if (s->r->cancelled) {
            sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_CANCEL);
            continue;
        }
        if (o->token < 0)
            continue;
        s->sampled = true;
        if (o->token >= b->a.n_vocab) {
            sh__batcher_req_fail(b, s->r, SH_EPROTO, 500,
                                 "the stage sampled a token outside the vocabulary");
            continue;
        }
        emit_token(b, s, o);
    }
    plan_after_step(b);
}

/* A STEP_DONE that could not be decoded: its step id is unknown, so it counts as the answer to
 * the oldest step in flight (stages answer in order), whose requests fail. */
void sh__batcher_step_lost(batcher *b)
{
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

/* The deadline tick: a step in flight has waited step_timeout_ms for its STEP_DONE. A stage
 * node that died (or hangs) never answers; fail that step's requests and go on. */
void sh__batcher_step_check_timeouts(batcher *b)
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
