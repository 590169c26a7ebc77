/* The drafter actor: sits between a batcher and its first stage, appends greedy drafts of a draft
 * model (model/spec_draft_batch.h) to the sequences of each STEP that ask for them, and passes the
 * STEP on so that STEP_DONE goes straight back to the batcher: under the batcher's address on its
 * node, under its own with the batcher's as the STEP's reply_to from another node. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/hello.h"
#include "actors/serve.h"
#include "base/error.h"
#include "model/spec.h"
#include "model/spec_draft_batch.h"
#include "runtime/msg.h"
#include "runtime/proto.h"

#define DRAFTER_ARENA_BYTES (8u << 20) /* a decoded STEP: its sequences, tokens and priors */

typedef struct drafter_state {
    /* Set by init, read-only afterwards. */
    sh_runtime *rt;
    sh_addr self, stage;
    sh_spec_drafts *drafts;
    int32_t max_seqs, block_tokens;
    sh_hello_auth *auth;
    sh_counter *m_steps, *m_drafted, *m_us; /* shoal_drafter_* */

    sh_act_worker worker; /* drafts the kept STEPs one at a time, in arrival order */

    /* The worker's own. */
    sh_act_decoder dec;
    sh_spec_drafts_req *req; // (max_seqs)
    int32_t *idx;            // (max_seqs) the step_seq of each request
    int32_t *tok;            // (tok_cap) each sequence's prior, tokens and room for drafts, in turn
    size_t tok_cap;
} drafter_state;

/* Whether sequence q of a step may take drafts: it asks, it samples without top logprobs and
 * carries no drafts of its own; *k is then how many its block table has room for. */
static bool may_draft(const drafter_state *st, const sh_proto_step_seq *q, int32_t *k)
{
    *k = 0;
    if (q->want_draft == 0 || !q->sample || q->draft != 0 || q->tokens.n == 0 ||
        q->sampling.n_logprobs > 0)
        return false;
    int64_t room = (int64_t)q->blocks.n * st->block_tokens - q->pos - q->tokens.n;
    int64_t k64 = q->want_draft;
    if (k64 > room)
        k64 = room;
    if (k64 > SH_SPEC_MAX_K)
        k64 = SH_SPEC_MAX_K;
    *k = (int32_t)(k64 > 0 ? k64 : 0);
    return *k > 0;
}

/* Makes room for n tokens in st->tok. */
static bool tok_room(drafter_state *st, size_t n)
{
    if (n <= st->tok_cap)
        return true;
    size_t cap = st->tok_cap ? st->tok_cap : 4096;
    while (cap < n)
        cap *= 2;
    int32_t *t = realloc(st->tok, cap * sizeof *t);
    if (!t)
        return false;
    st->tok = t;
    st->tok_cap = cap;
    return true;
}

/* Whether m came from another node than the drafter's (a cluster's front): the STEP then goes on
 * under the drafter's address, since the stage's node takes frames from a node only under that
 * node's addresses (runtime/peers.h), and carries the batcher's as its reply_to. */
static bool remote(const drafter_state *st, const sh_msg *m)
{
    return sh_addr_node(sh_msg_header(m)->src) != sh_addr_node(st->self);
}

/* Passes m on to the stage unchanged (a STEP the drafter could not read: the stage answers it).
 * From another node it cannot go on unread (its reply_to is not set): it is dropped, and the
 * batcher's step retry or timeout takes care of it. */
static void pass_raw(drafter_state *st, const sh_msg *m)
{
    sh_msg_hdr h = *sh_msg_header(m);
    if (remote(st, m)) {
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "drafter_step_dropped",
                       "session=%" PRIu64 " from_node=%u", h.session,
                       (unsigned)sh_addr_node(h.src));
        return;
    }
    h.dst = st->stage;
    size_t len = 0;
    const void *body = sh_msg_body(m, &len);
    sh_error e = {0};
    if (sh_send(st->rt, &h, body, len, &e))
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "drafter_send_failed", "error=\"%s\"", e.msg);
}

/* Drafts for one STEP and sends it on. Worker thread. */
static void step_draft(drafter_state *st, const sh_msg *m)
{
    uint64_t t0 = sh__act_mono_us();
    const sh_msg_hdr *h = sh_msg_header(m);
    sh_proto_body b;
    sh_error e = {0};
    if (h->type != SH_MSG_STEP || sh__act_decode(&st->dec, m, &b, &e)) {
        pass_raw(st, m);
        return;
    }
    sh_proto_step *s = &b.step;
    sh_proto_step_seq *v = (sh_proto_step_seq *)s->seqs.v; /* the decoder's arena: ours */
    /* Every sequence's tokens (and prior) are copied, aligned, with room for drafts after them. */
    uint32_t ns = s->seqs.n < (uint32_t)st->max_seqs ? s->seqs.n : (uint32_t)st->max_seqs;
    size_t need = 0;
    for (uint32_t i = 0; i < ns; i++)
        need += (size_t)v[i].prior.n + v[i].tokens.n + SH_SPEC_MAX_K;
    if (!tok_room(st, need)) {
        pass_raw(st, m);
        return;
    }
    int32_t n = 0;
    size_t off = 0;
    bool ok = true;
    for (uint32_t i = 0; i < ns; i++) {
        const sh_proto_step_seq *q = &v[i];
        int32_t k = 0;
        may_draft(st, q, &k);
        bool whole = q->prior.n >= q->pos && q->pos > 0;
        int32_t *pri = st->tok + off;
        if (whole)
            memcpy(pri, q->prior.ptr, (size_t)q->pos * sizeof *pri);
        off += whole ? q->pos : 0;
        int32_t *t = st->tok + off;
        memcpy(t, q->tokens.ptr, (size_t)q->tokens.n * sizeof *t);
        off += q->tokens.n + SH_SPEC_MAX_K;
        st->req[n] = (sh_spec_drafts_req){.id = q->seq,
                                          .prior = whole ? pri : NULL,
                                          .n_prior = whole ? (int32_t)q->pos : 0,
                                          .pos = (int32_t)q->pos,
                                          .tokens = t,
                                          .n_tokens = (int32_t)q->tokens.n,
                                          .k = k,
                                          .out = t + q->tokens.n};
        st->idx[n++] = (int32_t)i;
        ok &= q->seq != 0; /* not the batcher's: nothing is drafted */
    }
    /* Every sequence's tokens are recorded (a prefill chunk today is the history of tomorrow's
     * drafts); a step with nothing to draft runs no forward pass. */
    if (ok && sh_spec_drafts_step(st->drafts, st->req, n, &e)) {
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "drafter_failed", "step=%" PRIu64 " error=\"%s\"",
                       s->step, e.msg);
        ok = false;
    }
    uint64_t drafted = 0;
    for (int32_t i = 0; i < n && ok; i++) {
        const sh_spec_drafts_req *r = &st->req[i];
        if (r->n_out == 0)
            continue;
        sh_proto_step_seq *q = &v[st->idx[i]];
        /* The drafts were written right after the sequence's copied tokens. */
        q->tokens = (sh_i32s){r->tokens, q->tokens.n + (uint32_t)r->n_out};
        q->draft = (uint32_t)r->n_out;
        drafted += (uint64_t)r->n_out;
    }
    /* What the drafter was asked is its own: the stages never see it. */
    for (uint32_t i = 0; i < s->seqs.n; i++) {
        v[i].want_draft = 0;
        v[i].prior = (sh_i32s){NULL, 0};
    }
    uint64_t us = sh__act_mono_us() - t0;
    /* A catch-up over a sequence's history (its prompt) is not what drafts cost: leaving it out
     * keeps one long prompt from making every draft look expensive to the batcher. */
    uint64_t extra = ok ? sh_spec_drafts_extra_us(st->drafts) : 0;
    s->compute_us += us > extra ? us - extra : 0;
    if (st->m_steps) {
        sh_counter_add(st->m_steps, 1);
        sh_counter_add(st->m_drafted, drafted);
        sh_counter_add(st->m_us, us);
    }
    sh_addr from = h->src;
    if (remote(st, m)) {
        s->reply_to = h->src;
        from = st->self;
    }
    if (sh__act_send(st->rt, from, st->stage, SH_MSG_STEP, h->trace_id, s, &e))
        sh_runtime_log(st->rt, SH_LOG_LEVEL_WARN, "drafter_send_failed",
                       "step=%" PRIu64 " error=\"%s\"", s->step, e.msg);
}

/* The worker's run: drafts one kept STEP (the worker frees it). */
static void worker_run(void *user, const sh_msg *m, uint64_t arrived_us)
{
    (void)arrived_us;
    step_draft(user, m);
}

/* ---- vtable ---- */

static void free_buffers(drafter_state *st)
{
    sh__act_decoder_fini(&st->dec);
    free(st->req);
    free(st->idx);
    free(st->tok);
}

/* Loop thread: checks the arguments, sizes the buffers and starts the worker. */
static sh_err drafter_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    drafter_state *st = state;
    const sh_drafter_args *a = arg;
    if (!a || !a->drafts || a->stage == SH_ADDR_NONE || a->max_seqs <= 0) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "drafter_init_failed",
                     "error=\"needs a drafter, the first stage and max_seqs > 0\"");
        return SH_EINVAL;
    }
    st->rt = sh_actor_runtime(ctx);
    st->self = sh_actor_self(ctx);
    st->stage = a->stage;
    st->drafts = a->drafts;
    st->max_seqs = a->max_seqs;
    st->auth = a->auth;
    st->block_tokens = a->block_tokens > 0 ? a->block_tokens : SH_KV_DEFAULT_BLOCK_TOKENS;
    sh_err err = sh__act_decoder_init(&st->dec, DRAFTER_ARENA_BYTES);
    st->req = calloc((size_t)a->max_seqs, sizeof *st->req);
    st->idx = calloc((size_t)a->max_seqs, sizeof *st->idx);
    if (err || !st->req || !st->idx || !tok_room(st, 4096)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "drafter_init_failed", "error=\"out of memory\"");
        free_buffers(st);
        memset(st, 0, sizeof *st);
        return SH_ENOMEM;
    }
    sh_metrics *mx = sh_runtime_metrics(st->rt);
    sh_metrics_counter(mx, "shoal_drafter_steps_total", "Steps the drafter passed to the stage.",
                       a->metric_labels, &st->m_steps);
    sh_metrics_counter(mx, "shoal_drafter_tokens_total",
                       "Draft tokens the drafter appended to steps.", a->metric_labels,
                       &st->m_drafted);
    sh_metrics_counter(mx, "shoal_drafter_compute_us_total",
                       "Microseconds the drafter spent on steps (drafting included).",
                       a->metric_labels, &st->m_us);
    if (!st->m_steps || !st->m_drafted || !st->m_us)
        st->m_steps = NULL;
    sh_error e = {0};
    err = sh__act_worker_start(&st->worker, "shoal-drafter", 16, worker_run, st, &e);
    if (err) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "drafter_init_failed", "error=\"%s\"", e.msg);
        free_buffers(st);
        memset(st, 0, sizeof *st);
        return err;
    }
    return SH_OK;
}

/* Loop thread; never blocks: a STEP is kept and queued for the worker, which frees it. */
static sh_msg_fate drafter_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    drafter_state *st = state;
    sh_msg_type type = sh_msg_header(m)->type;
    if (type != SH_MSG_STEP) {
        if (type != SH_MSG_ERROR && type != SH_MSG_CONTROL)
            sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "drafter_unexpected", "type=%s",
                         sh__msg_type_name(type));
        return SH_MSG_FATE_DONE;
    }
    // With a cluster key, only nodes that proved it are served, as at a stage.
    if (!sh__hello_auth_allows(st->auth, st->rt, sh_msg_header(m)->src, "STEP"))
        return SH_MSG_FATE_DONE;
    if (sh__act_worker_push(&st->worker, m)) {
        /* The step goes on without drafts rather than not at all. */
        pass_raw(st, m);
        return SH_MSG_FATE_DONE;
    }
    return SH_MSG_FATE_KEPT;
}

/* Loop thread: lets the worker finish the step it drafts, joins it and frees the rest. */
static void drafter_stop(sh_actor_ctx *ctx, void *state)
{
    drafter_state *st = state;
    sh__act_worker_stop(&st->worker);
    free_buffers(st);
}

const sh_actor_vtable sh__drafter_vtable = {
    .name = "drafter",
    .state_size = sizeof(drafter_state),
    .init = drafter_init,
    .handle = drafter_handle,
    .stop = drafter_stop,
};
