/* The batcher with real parts: a batcher, a kvmgr and two stage actors (stories260K split in the
 * middle, each stage with its own backend and KV pool, joined by ACT) in one runtime, and a
 * client actor standing where the gateway or the router would. It checks:
 *   - reports: with `router` set the batcher sends a METRICS report at init and every report_ms
 *     (waiting, running, max_seqs, kv_free, kv_total, tokens, generated, busy_us, steps), the
 *     counters matching what was served; metric_labels labels every series it registers;
 *   - CANCEL withdraw: a request still waiting is removed with FAIL SH_EBUSY 503 "withdrawn" and
 *     no DONE; a running one, a preempted one (back in the queue, but it held KV) and an unknown
 *     one are left alone, nothing answered;
 *   - pipelining (max_inflight 2): greedy outputs of 16 concurrent streams (one prompt longer than
 *     the step budget, one request with n = 2 choices) equal max_inflight 1's token for token, and
 *     two steps really were in flight at once (the batcher's shoal_steps_in_flight histogram:
 *     never above 1 with max_inflight 1, mostly 2 with 2);
 *   - a step timeout with two steps in flight and retries off (a link in front of the first
 *     stage drops one STEP): only the requests of the dropped step fail (503 naming the step),
 *     the others go on meanwhile and end with the reference's tokens;
 *   - retries (on by default with step_timeout_ms): the dropped STEP is sent again under a new
 *     step id and every stream ends with the reference's tokens; once more with the dropped
 *     STEP delivered late, right after its retry (both tries answer: the first answer is taken,
 *     the other ignored), and with every third STEP delivered twice (the stages run it twice,
 *     rewriting the same KV rows; the second STEP_DONE is ignored);
 *   - CONTROL PAUSE / RESUME (max_inflight 1 and 2): the link sends PAUSE at the 20th STEP and
 *     forwards that STEP late (its STEP_DONE comes after the pause and is ignored) or drops it
 *     (the dead node); while paused a second PAUSE, a SUBMIT and a CANCEL arrive (the cancelled
 *     request ends at once, silently), no STEP goes out, and the kvmgr's blocks are all free
 *     (its RESET); after RESUME every stream ends with the reference's tokens,
 *     its TOKEN indices contiguous (none repeated, none missing). A RESUME without a PAUSE does
 *     nothing. Once more with the PAUSE sent while a KV_ALLOC is on its way (a link in front of
 *     the kvmgr): the reply about the old pool is absorbed.
 *   - speculative decoding (sh_batcher_args.spec ngram, the last stage verifying): greedy
 *     outputs with two steps in flight, with a STEP lost and retried (late: both tries answer)
 *     and every third STEP duplicated, and across a PAUSE / RESUME, equal the reference without
 *     drafts; seeded sampling with drafts equals seeded sampling without, duplicates and the
 *     late retry included (each try carries the same drafts); drafts are accepted in each;
 *     with sh_batcher_args.spec draft and a drafter (the link standing in for one) that appends
 *     one draft fewer than asked (of two or more), the streams are the reference's and the
 * batcher's shoal_spec_* counters count the drafts appended (STEP_DONE's drafted), not those asked.
 * Every TOKEN's index is checked to be the next one of its choice.
 * Skips (77) without the model. */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "actors/router.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "runtime/msg.h"
#include "runtime/proto.h"
#include "unit/test_runtime_util.h"

#define MODEL "tests/data/stories260K/stories260K.gguf"
#define N_STREAMS 16
#define N_GEN 64
#define MAX_REQ 32
#define MAX_PROMPT 256
#define STEP_TOKENS 64
#define MAX_SEQS 32
#define N_VALUES 9

static sh_llama *full; /* the whole model: the tokenizer and the layer count */
static sh_tokenizer *tok;
static int32_t prompt_ids[N_STREAMS][MAX_PROMPT]; /* the prompts, encoded */
static int32_t n_prompt_ids[N_STREAMS];
static int32_t ref[N_STREAMS][2][N_GEN]; /* the streams' tokens with max_inflight 1 */

/* ---- the client: stands where the gateway (and the router) would ---------------------------- */

typedef struct choice_out {
    int32_t tok[N_GEN + 8];
    int32_t n;
    uint32_t next; /* the index the next TOKEN must carry */
    bool done;
    int fin;
    uint32_t n_generated; /* as DONE says */
    uint64_t done_ms;
} choice_out;

typedef struct req_out {
    int32_t n_choices; /* set by the submitter */
    choice_out ch[2];
    int32_t n_done;
    bool failed;
    int32_t code;
    uint32_t http;
    bool retry;
    char msg[200];
    uint64_t fail_ms;
    int32_t n_msgs; /* every message about this request */
} req_out;

static struct {
    pthread_mutex_t mu;
    req_out r[MAX_REQ + 1];
    _Atomic long n_ended; /* requests ended: every choice DONE, or FAIL */
    _Atomic long n_metrics;
    double first[N_VALUES], last[N_VALUES]; /* report values, in router.h's order */
    uint64_t last_at_us;
    _Atomic long bad;
} cl = {.mu = PTHREAD_MUTEX_INITIALIZER};

static const char *const value_names[N_VALUES] = {
    SH_ROUTER_M_WAITING,   SH_ROUTER_M_RUNNING,  SH_ROUTER_M_MAX_SEQS,
    SH_ROUTER_M_KV_FREE,   SH_ROUTER_M_KV_TOTAL, SH_ROUTER_M_TOKENS,
    SH_ROUTER_M_GENERATED, SH_ROUTER_M_BUSY_US,  SH_ROUTER_M_STEPS};
enum { V_WAITING, V_RUNNING, V_MAX_SEQS, V_KV_FREE, V_KV_TOTAL, V_TOKENS, V_GEN, V_BUSY, V_STEPS };

static void client_reset(void)
{
    pthread_mutex_lock(&cl.mu);
    memset(cl.r, 0, sizeof cl.r);
    memset(cl.first, 0, sizeof cl.first);
    memset(cl.last, 0, sizeof cl.last);
    atomic_store(&cl.n_ended, 0);
    atomic_store(&cl.n_metrics, 0);
    atomic_store(&cl.bad, 0);
    pthread_mutex_unlock(&cl.mu);
}

typedef struct client_state {
    sh_act_decoder dec;
} client_state;

static sh_err client_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    (void)arg;
    return sh__act_decoder_init(&((client_state *)state)->dec, 1 << 20);
}

static void client_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__act_decoder_fini(&((client_state *)state)->dec);
}

static req_out *req_of(uint64_t id)
{
    if (id < 1 || id > MAX_REQ) {
        atomic_fetch_add(&cl.bad, 1);
        return NULL;
    }
    cl.r[id].n_msgs++;
    return &cl.r[id];
}

static void on_metrics(const sh_proto_metrics *m)
{
    double v[N_VALUES];
    int found = 0;
    for (int i = 0; i < N_VALUES; i++)
        for (uint32_t j = 0; j < m->values.n; j++)
            if (m->values.v[j].name.len == strlen(value_names[i]) &&
                !memcmp(m->values.v[j].name.ptr, value_names[i], m->values.v[j].name.len)) {
                CHECK_INT_EQ(m->values.v[j].kind, i < V_TOKENS ? 1 : 0);
                v[i] = m->values.v[j].value;
                found++;
                break;
            }
    CHECK_INT_EQ(found, N_VALUES);
    CHECK_INT_EQ(m->values.n, N_VALUES);
    if (found != N_VALUES)
        return;
    if (atomic_load(&cl.n_metrics) == 0)
        memcpy(cl.first, v, sizeof v);
    else
        for (int i = V_TOKENS; i < N_VALUES; i++)
            CHECK(v[i] >= cl.last[i]); /* counters never go back */
    CHECK(m->at_us >= cl.last_at_us);
    memcpy(cl.last, v, sizeof v);
    cl.last_at_us = m->at_us;
    atomic_fetch_add(&cl.n_metrics, 1);
}

static sh_msg_fate client_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    (void)ctx;
    client_state *st = state;
    const sh_msg_hdr *h = sh_msg_header(msg);
    sh_proto_body b;
    sh_error e = {0};
    if (sh__act_decode(&st->dec, msg, &b, &e)) {
        fprintf(stderr, "client: undecodable %s: %s\n", sh__msg_type_name(h->type), e.msg);
        atomic_fetch_add(&cl.bad, 1);
        return SH_MSG_FATE_DONE;
    }
    pthread_mutex_lock(&cl.mu);
    req_out *r;
    switch (h->type) {
    case SH_MSG_TOKEN:
        if (!(r = req_of(b.token.req)) || b.token.choice >= 2) {
            atomic_fetch_add(&cl.bad, 1);
            break;
        }
        for (uint32_t i = 0; i < b.token.tokens.n; i++) {
            uint32_t at = b.token.index + i;
            choice_out *c = &r->ch[b.token.choice];
            if (at != c->next++) {
                fprintf(stderr, "client: request %llu choice %u: token index %u, expected %d\n",
                        (unsigned long long)b.token.req, (unsigned)b.token.choice, (unsigned)at,
                        (int)c->next - 1);
                atomic_fetch_add(&cl.bad, 1);
            }
            if (at < N_GEN + 8) {
                c->tok[at] = sh_i32s_at(b.token.tokens, i);
                c->n = (int32_t)at + 1 > c->n ? (int32_t)at + 1 : c->n;
            }
        }
        break;
    case SH_MSG_DONE:
        if (!(r = req_of(b.done.req)) || b.done.choice >= 2) {
            atomic_fetch_add(&cl.bad, 1);
            break;
        }
        r->ch[b.done.choice].done = true;
        r->ch[b.done.choice].fin = b.done.finish;
        r->ch[b.done.choice].n_generated = b.done.n_generated;
        r->ch[b.done.choice].done_ms = now_ms();
        if (++r->n_done == r->n_choices)
            atomic_fetch_add(&cl.n_ended, 1);
        break;
    case SH_MSG_FAIL:
        if (!(r = req_of(b.fail.req)))
            break;
        r->failed = true;
        r->code = b.fail.code;
        r->http = b.fail.status_http;
        r->retry = b.fail.retryable;
        r->fail_ms = now_ms();
        snprintf(r->msg, sizeof r->msg, "%.*s", (int)b.fail.message.len, b.fail.message.ptr);
        atomic_fetch_add(&cl.n_ended, 1);
        break;
    case SH_MSG_METRICS:
        on_metrics(&b.metrics);
        break;
    default:
        fprintf(stderr, "client: unexpected %s\n", sh__msg_type_name(h->type));
        atomic_fetch_add(&cl.bad, 1);
    }
    pthread_mutex_unlock(&cl.mu);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable client_vt = {.name = "client",
                                          .state_size = sizeof(client_state),
                                          .init = client_init,
                                          .handle = client_handle,
                                          .stop = client_stop};

/* ---- the link: forwards the batcher's STEPs to the first stage, dropping one -------------- */

static struct {
    long drop_nth; /* which STEP to drop, counting from 1 (0: none) */
    long n_steps;  /* STEPs seen */
    _Atomic long dropped;
    uint64_t dropped_step;   /* its step id */
    uint64_t first_seq;      /* the lowest sequence id any STEP carried */
    uint64_t seqs[MAX_SEQS]; /* the dropped step's sequence ids */
    uint32_t pos0;           /* and its first sequence's position */
    uint32_t n_seqs;
    _Atomic long forwarded;
    long pause_nth;       /* at which STEP to send the batcher CONTROL PAUSE (0: never) */
    bool pause_drop;      /* drop that STEP (else forward it after the PAUSE: a late STEP_DONE) */
    sh_addr batcher;      /* where PAUSE goes */
    _Atomic long paused;  /* PAUSE sent */
    long pause_alloc_nth; /* at which KV_ALLOC (through the kv link) to send PAUSE (0: never) */
    long n_allocs;
    bool drop_late;       /* keep the dropped STEP and forward it right after its retry */
    bool slow_first;      /* ... right BEFORE its retry instead (a slow first try) */
    bool drop_retries;    /* drop its retries too (a stage that never answers it) */
    sh_msg *held;         /* that STEP, until then */
    long dup_every;       /* forward every dup_every-th STEP twice (0: none) */
    _Atomic long dups;    /* STEPs forwarded twice */
    _Atomic long retried; /* retries of the dropped step seen */
} lk;

typedef struct link_state {
    sh_addr next;
    sh_act_decoder dec;
} link_state;

/* With `on`, the link drafts as a drafter actor does for a batcher with sh_batcher_args.spec
 * SH_SPEC_DRAFT (the batcher asks with step_seq.want_draft): for a sequence whose prompt it
 * recognised it appends one draft fewer than asked (one when asked for one, so that acceptance
 * builds up), the reference's next tokens (so they are right), and sets `draft`; the stage
 * reports how many (step_out.drafted). Link thread. */
#define DS_SEQS (2 * N_STREAMS)
static struct {
    bool on;
    int32_t n;
    uint64_t seq[DS_SEQS];
    int stream[DS_SEQS];
    int32_t tok[MAX_SEQS][STEP_TOKENS + SH_PROTO_MAX_DRAFT]; /* one STEP's rewritten tokens */
    _Atomic long asked, appended, drafting; /* drafts asked for, appended; sequence steps with */
} ds;

/* The stream whose prompt holds q's tokens at q's position (the first step of a sequence, or of
 * a fork's second choice), remembered by sequence id; -1 when none or several. */
static int ds_stream(const sh_proto_step_seq *q)
{
    for (int32_t i = 0; i < ds.n; i++)
        if (ds.seq[i] == q->seq)
            return ds.stream[i];
    int found = -1;
    for (int p = 0; p < N_STREAMS; p++)
        if ((int64_t)q->pos + q->tokens.n <= n_prompt_ids[p] &&
            memcmp(prompt_ids[p] + q->pos, q->tokens.ptr, q->tokens.n * sizeof(int32_t)) == 0)
            found = found < 0 ? p : N_STREAMS;
    if (found < 0 || found == N_STREAMS || ds.n == DS_SEQS)
        return -1;
    ds.seq[ds.n] = q->seq;
    ds.stream[ds.n++] = found;
    return found;
}

/* Drafts for STEP s as said above and sends it on under its sender's address. */
static void ds_step(sh_actor_ctx *ctx, const link_state *st, const sh_msg_hdr *h, sh_proto_step *s)
{
    sh_proto_step_seq *v = (sh_proto_step_seq *)s->seqs.v; /* the decoder's arena: ours */
    for (uint32_t i = 0; i < s->seqs.n && i < MAX_SEQS; i++) {
        sh_proto_step_seq *q = &v[i];
        int p = ds_stream(q);
        int32_t want = (int32_t)q->want_draft;
        q->want_draft = 0;
        q->prior = (sh_i32s){NULL, 0};
        if (want == 0 || p < 0 || q->tokens.n > STEP_TOKENS)
            continue;
        atomic_fetch_add(&ds.asked, want);
        int32_t g = (int32_t)(q->pos + q->tokens.n) - 1 - n_prompt_ids[p]; /* the last token's */
        int32_t k = want > 1 ? want - 1 : want;
        if (g < 0)
            k = 0;
        if (g + k >= N_GEN)
            k = N_GEN - 1 - g;
        if (k <= 0)
            continue;
        memcpy(ds.tok[i], q->tokens.ptr, q->tokens.n * sizeof(int32_t));
        memcpy(ds.tok[i] + q->tokens.n, &ref[p][0][g + 1], (size_t)k * sizeof(int32_t));
        q->tokens = (sh_i32s){ds.tok[i], q->tokens.n + (uint32_t)k};
        q->draft = (uint32_t)k;
        atomic_fetch_add(&ds.appended, k);
        atomic_fetch_add(&ds.drafting, 1);
    }
    sh_error e = {0};
    CHECK_OK(
        sh__act_send(sh_actor_runtime(ctx), h->src, st->next, SH_MSG_STEP, h->trace_id, s, &e));
    atomic_fetch_add(&lk.forwarded, 1);
}

/* Forwards a STEP as sent, the batcher's address as the source: the stage answers it directly. */
static void link_forward(sh_actor_ctx *ctx, const link_state *st, const sh_msg *msg)
{
    sh_msg_hdr h = *sh_msg_header(msg);
    size_t len = 0;
    const void *body = sh_msg_body(msg, &len);
    h.dst = st->next;
    CHECK_OK(sh_send(sh_actor_runtime(ctx), &h, body, len, NULL));
    atomic_fetch_add(&lk.forwarded, 1);
}

static sh_err link_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    link_state *st = state;
    st->next = *(const sh_addr *)arg;
    return sh__act_decoder_init(&st->dec, 1 << 20);
}

static void link_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__act_decoder_fini(&((link_state *)state)->dec);
    sh_msg_free(lk.held);
    lk.held = NULL;
}

static sh_msg_fate link_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    link_state *st = state;
    sh_msg_hdr h = *sh_msg_header(msg);
    sh_proto_body b;
    sh_error e = {0};
    if (h.type == SH_MSG_KV_ALLOC && ++lk.n_allocs == lk.pause_alloc_nth) {
        // The PAUSE is in the batcher's mailbox before the kvmgr can answer this KV_ALLOC: the
        // reply is one due from before the pause.
        sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_PAUSE};
        CHECK_OK(sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), lk.batcher, SH_MSG_CONTROL,
                              0, &c, &e));
        atomic_fetch_add(&lk.paused, 1);
    }
    if (h.type == SH_MSG_STEP && ds.on && sh__act_decode(&st->dec, msg, &b, &e) == SH_OK) {
        ds_step(ctx, st, &h, &b.step);
        return SH_MSG_FATE_DONE;
    }
    if (h.type == SH_MSG_STEP && sh__act_decode(&st->dec, msg, &b, &e) == SH_OK) {
        for (uint32_t i = 0; i < b.step.seqs.n; i++)
            if (!lk.first_seq || b.step.seqs.v[i].seq < lk.first_seq)
                lk.first_seq = b.step.seqs.v[i].seq;
        ++lk.n_steps;
        if (atomic_load(&lk.dropped) && b.step.step != lk.dropped_step && b.step.seqs.n &&
            b.step.seqs.n == lk.n_seqs && b.step.seqs.v[0].seq == lk.seqs[0] &&
            b.step.seqs.v[0].pos == lk.pos0) {
            // The dropped step's retry: the same sequences at the same positions.
            atomic_fetch_add(&lk.retried, 1);
            if (lk.drop_retries)
                return SH_MSG_FATE_DONE;
            if (lk.held && lk.slow_first) {
                link_forward(ctx, st, lk.held); /* the slow try, still unanswered */
                link_forward(ctx, st, msg);
                sh_msg_free(lk.held);
                lk.held = NULL;
                return SH_MSG_FATE_DONE;
            }
            if (lk.held) {
                link_forward(ctx, st, msg);
                link_forward(ctx, st, lk.held); /* the lost try, late */
                sh_msg_free(lk.held);
                lk.held = NULL;
                return SH_MSG_FATE_DONE;
            }
        }
        if (lk.n_steps == lk.pause_nth) {
            // The PAUSE is in the batcher's mailbox before the stage can answer this STEP.
            sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_PAUSE};
            CHECK_OK(sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), lk.batcher,
                                  SH_MSG_CONTROL, 0, &c, &e));
            lk.dropped_step = b.step.step;
            atomic_fetch_add(&lk.paused, 1);
            if (lk.pause_drop)
                return SH_MSG_FATE_DONE;
        }
        if (lk.n_steps == lk.drop_nth) {
            for (uint32_t i = 0; i < b.step.seqs.n && i < MAX_SEQS; i++)
                lk.seqs[i] = b.step.seqs.v[i].seq;
            lk.n_seqs = b.step.seqs.n;
            lk.pos0 = b.step.seqs.n ? b.step.seqs.v[0].pos : 0;
            lk.dropped_step = b.step.step;
            atomic_fetch_add(&lk.dropped, 1); /* publishes the fields above */
            if (lk.drop_late) {
                lk.held = msg;
                return SH_MSG_FATE_KEPT;
            }
            return SH_MSG_FATE_DONE;
        }
        if (lk.dup_every && lk.n_steps % lk.dup_every == 0) {
            link_forward(ctx, st, msg);
            atomic_fetch_add(&lk.dups, 1);
        }
    }
    // Forwarded as sent, the batcher's address as the source: the stage answers it directly.
    size_t len = 0;
    const void *body = sh_msg_body(msg, &len);
    h.dst = st->next;
    CHECK_OK(sh_send(sh_actor_runtime(ctx), &h, body, len, NULL));
    atomic_fetch_add(&lk.forwarded, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable link_vt = {.name = "link",
                                        .state_size = sizeof(link_state),
                                        .init = link_init,
                                        .handle = link_handle,
                                        .stop = link_stop};

/* ---- the rig: kvmgr, two stages, batcher, client (and optionally the link) ----------------- */

typedef struct rig {
    test_rt t;
    sh_llama *m[2];
    sh_backend *be[2];
    sh_llama_ctx *c[2];
    sh_addr kv, stage[2], link, kv_link, batcher, client;
    int32_t n_blocks;
    /* spawn arguments: actors init after sh_actor_spawn returns, so they live here */
    sh_kvmgr_args ka;
    sh_stage_args sa[2];
    sh_batcher_args ba;
} rig;

typedef struct rig_opts {
    int32_t max_inflight, max_seqs;
    bool link;    /* STEPs pass the link */
    bool kv_link; /* the batcher's KV messages pass a link too */
    bool router;
    uint32_t report_ms, step_timeout_ms;
    int32_t step_retries; /* sh_batcher_args.step_retries (0: the default, -1: none) */
    uint32_t step_retry_ms;
    int32_t kv_blocks; /* the kvmgr's and batcher's pool (0: the stages' whole pool) */
    const char *labels;
} rig_opts;

/* The rigs started while set speculate (n-gram drafts, rows of logits for them); spec_accepted
 * is the last such rig's shoal_spec_accepted_tokens_total, read when it stops. */
static bool rig_spec;
static double spec_accepted;

static double metric(rig *g, const char *series);

static bool rig_start(rig *g, const rig_opts *o)
{
    memset(g, 0, sizeof *g);
    client_reset();
    sh_error e = {0};
    int32_t cut[3] = {0, full->hp.n_layers / 2, full->hp.n_layers};
    for (int i = 0; i < 2; i++) {
        sh_llama_load_opts lo = {.first = cut[i], .last = cut[i + 1]};
        sh_backend_cpu_opts bo = {.n_threads = 1};
        sh_llama_ctx_opts co = {.max_tokens = STEP_TOKENS,
                                .max_seqs = MAX_SEQS,
                                .max_logits = sh__serve_max_logits(MAX_SEQS, STEP_TOKENS, rig_spec),
                                .kv_tokens = 8192};
        if (sh_llama_load(sh_test_path(MODEL), &lo, &g->m[i], &e) ||
            sh_backend_cpu_create(&bo, &g->be[i], &e) ||
            sh_llama_ctx_create(g->m[i], g->be[i], &co, &g->c[i], &e)) {
            SH_FAIL_("stage %d: %s", i, e.msg);
            return false;
        }
    }
    g->n_blocks = sh_llama_ctx_n_blocks(g->c[0]);
    CHECK_INT_EQ(sh_llama_ctx_n_blocks(g->c[1]), g->n_blocks);
    if (o->kv_blocks > 0 && o->kv_blocks < g->n_blocks)
        g->n_blocks = o->kv_blocks; /* block ids stay within the stages' pools */
    rt_start(&g->t, 1, 4, NULL);
    CHECK_OK(sh__serve_register(g->t.rt, &e));
    CHECK_OK(sh_runtime_register(g->t.rt, &client_vt, &e));
    CHECK_OK(sh_runtime_register(g->t.rt, &link_vt, &e));
    CHECK_OK(sh_actor_spawn(g->t.rt, "client", NULL, 0, &g->client, &e));
    g->ka = (sh_kvmgr_args){.cfg = {.n_blocks = g->n_blocks, .max_seqs = MAX_SEQS},
                            .prefix_cache = false};
    CHECK_OK(sh_actor_spawn(g->t.rt, "kvmgr", &g->ka, 1, &g->kv, &e));
    g->sa[1] = (sh_stage_args){.model = g->m[1], .ctx = g->c[1], .max_seqs = MAX_SEQS};
    CHECK_OK(sh_actor_spawn(g->t.rt, "stage", &g->sa[1], 3, &g->stage[1], &e));
    g->sa[0] = (sh_stage_args){
        .model = g->m[0], .ctx = g->c[0], .max_seqs = MAX_SEQS, .next = g->stage[1]};
    CHECK_OK(sh_actor_spawn(g->t.rt, "stage", &g->sa[0], 2, &g->stage[0], &e));
    if (o->link)
        CHECK_OK(sh_actor_spawn(g->t.rt, "link", &g->stage[0], 2, &g->link, &e));
    if (o->kv_link)
        CHECK_OK(sh_actor_spawn(g->t.rt, "link", &g->kv, 2, &g->kv_link, &e));
    g->ba = (sh_batcher_args){.kvmgr = o->kv_link ? g->kv_link : g->kv,
                              .stage = o->link ? g->link : g->stage[0],
                              .tok = tok,
                              .n_vocab = full->hp.n_vocab,
                              .n_ctx = 512,
                              .max_step_tokens = STEP_TOKENS,
                              .max_seqs = o->max_seqs ? o->max_seqs : MAX_SEQS,
                              .n_blocks = g->n_blocks,
                              .step_timeout_ms = o->step_timeout_ms,
                              .step_retries = o->step_retries,
                              .step_retry_ms = o->step_retry_ms,
                              .max_inflight = o->max_inflight,
                              .router = o->router ? g->client : SH_ADDR_NONE,
                              .report_ms = o->report_ms,
                              .metric_labels = o->labels,
                              .spec = ds.on      ? SH_SPEC_DRAFT
                                      : rig_spec ? SH_SPEC_NGRAM
                                                 : SH_SPEC_OFF,
                              .max_logits = sh__serve_max_logits(MAX_SEQS, STEP_TOKENS, rig_spec)};
    sh_err err = sh_actor_spawn(g->t.rt, "batcher", &g->ba, 1, &g->batcher, &e);
    CHECK_OK(err);
    return err == SH_OK;
}

static void rig_stop(rig *g)
{
    if (g->t.rt && rig_spec)
        spec_accepted = metric(g, "shoal_spec_accepted_tokens_total");
    if (g->t.rt)
        rt_finish(&g->t);
    for (int i = 0; i < 2; i++) {
        sh_llama_ctx_destroy(g->c[i]);
        sh_backend_destroy(g->be[i]);
        sh_llama_destroy(g->m[i]);
    }
}

/* The value of series `name{labels}` in the runtime's metrics (-1 when absent). */
static double metric(rig *g, const char *series)
{
    static char buf[1 << 18];
    size_t len = 0;
    CHECK_OK(sh_metrics_render(sh_runtime_metrics(g->t.rt), buf, sizeof buf, &len));
    size_t n = strlen(series);
    for (const char *p = buf; (p = strstr(p, series)); p += n)
        if ((p == buf || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* ---- requests ---------------------------------------------------------------------------- */

static const char *const prompts[N_STREAMS] = {
    "Once upon a time, there was a little girl named Lily.",
    "The sun was shining and the birds were singing.",
    "Tom and his dog went to the park. They saw a big",
    "One day, a little boy found a red ball in the garden.",
    "Mom said it was time for bed, but Ben wanted to play.",
    "There was a big tree near the house.",
    "The cat liked to sleep in the warm sun.",
    "Sara had a new toy car. It was blue and fast.",
    "Once upon a time, in a small town, there lived a kind old man who loved to bake bread for "
    "all the children. Every morning he woke up early, lit the big oven and made soft round "
    "loaves. The children came to his shop after school and he gave each of them a warm piece "
    "with honey. One day the oven broke and the old man was very sad.",
    "The little bird wanted to fly high in the sky.",
    "Max and Mia played in the sand at the beach.",
    "It was a rainy day and the frog was happy.",
    "The bear found a pot of honey in the woods.",
    "Lucy wanted to help her dad in the garden.",
    "A small fish swam in the big blue sea.",
    "The princess looked out of the window and saw",
};

static bool encode_prompts(void)
{
    for (int i = 0; i < N_STREAMS; i++) {
        size_t n = 0;
        sh_error e = {0};
        if (sh_tokenizer_encode(tok, prompts[i], strlen(prompts[i]), SH_TOKENIZE_ADD_BOS,
                                prompt_ids[i], MAX_PROMPT, &n, &e)) {
            SH_FAIL_("encode: %s", e.msg);
            return false;
        }
        n_prompt_ids[i] = (int32_t)n;
    }
    CHECK(n_prompt_ids[8] > STEP_TOKENS); /* chunked prefill */
    return true;
}

/* Sampling of the requests submit() sends: greedy unless a test sets a temperature. */
static struct {
    float temperature, frequency_penalty;
    uint64_t seed;
} samp;

/* Submits request id (1-based) with prompt p, n choices, greedy (or as `samp` says),
 * max_tokens = min_tokens. */
static void submit(rig *g, uint64_t id, int p, uint32_t n, int32_t max_tokens)
{
    pthread_mutex_lock(&cl.mu);
    cl.r[id].n_choices = (int32_t)n;
    pthread_mutex_unlock(&cl.mu);
    sh_proto_submit s = {.req = id,
                         .prompt = {prompt_ids[p], (uint32_t)n_prompt_ids[p]},
                         .sampling = {.temperature = samp.temperature,
                                      .top_p = 1.0f,
                                      .repeat_penalty = 1.0f,
                                      .frequency_penalty = samp.frequency_penalty,
                                      .penalty_last_n = 64,
                                      .seed = samp.seed + id,
                                      .max_tokens = (uint32_t)max_tokens},
                         .reply_to = g->client,
                         .n = n,
                         .min_tokens = (uint32_t)max_tokens};
    sh_error e = {0};
    CHECK_OK(sh__act_send(g->t.rt, g->client, g->batcher, SH_MSG_SUBMIT, 0, &s, &e));
}

static void cancel(rig *g, uint64_t id, bool withdraw)
{
    sh_proto_cancel c = {.req = id, .withdraw = withdraw};
    sh_error e = {0};
    CHECK_OK(sh__act_send(g->t.rt, g->client, g->batcher, SH_MSG_CANCEL, 0, &c, &e));
}

/* ---- reports, labels and withdraw -------------------------------------------------------- */

static void test_reports_labels_withdraw(void)
{
    rig g;
    uint64_t t0 = now_ms();
    rig_opts o = {.max_seqs = 2, .router = true, .report_ms = 50, .labels = "replica=\"7\""};
    if (!rig_start(&g, &o))
        goto out;
    // The first report comes at init, before any request.
    CHECK(wait_ge(&cl.n_metrics, 1, 10000));
    pthread_mutex_lock(&cl.mu);
    CHECK_NEAR(cl.first[V_WAITING], 0, 0);
    CHECK_NEAR(cl.first[V_RUNNING], 0, 0);
    CHECK_NEAR(cl.first[V_MAX_SEQS], 2, 0);
    CHECK_NEAR(cl.first[V_KV_TOTAL], g.n_blocks, 0);
    CHECK_NEAR(cl.first[V_KV_FREE], g.n_blocks, 0);
    for (int i = V_TOKENS; i < N_VALUES; i++)
        CHECK_NEAR(cl.first[i], 0, 0);
    pthread_mutex_unlock(&cl.mu);

    // max_seqs 2: requests 1 and 2 run, 3 and 4 wait; 4 is withdrawn at once (it waits behind
    // two running requests of 32 tokens), and a withdraw of 20 (unknown) changes nothing.
    for (int i = 1; i <= 4; i++)
        submit(&g, (uint64_t)i, i, 1, 32);
    cancel(&g, 4, true);
    cancel(&g, 20, true);
    // Request 1 has produced a token: it runs, so a withdraw leaves it alone.
    for (int i = 0; i < 10000; i++) {
        pthread_mutex_lock(&cl.mu);
        int32_t n = cl.r[1].ch[0].n;
        pthread_mutex_unlock(&cl.mu);
        if (n > 0)
            break;
        sleep_ms(1);
    }
    cancel(&g, 1, true);
    CHECK(wait_ge(&cl.n_ended, 4, 60000));
    long reports = atomic_load(&cl.n_metrics);
    sleep_ms(400); /* a few more reports, after the last step */
    CHECK(atomic_load(&cl.n_metrics) >= reports + 2);
    uint64_t wall_us = (now_ms() - t0) * 1000;

    pthread_mutex_lock(&cl.mu);
    const req_out *w = &cl.r[4];
    CHECK(w->failed);
    CHECK_INT_EQ(w->code, SH_EBUSY);
    CHECK_UINT_EQ(w->http, 503);
    CHECK(w->retry);
    CHECK_STR_EQ(w->msg, "withdrawn");
    CHECK_INT_EQ(w->ch[0].n, 0);
    CHECK(!w->ch[0].done);
    CHECK_INT_EQ(w->n_msgs, 1);
    CHECK_INT_EQ(cl.r[20].n_msgs, 0);
    int64_t prompt_toks = 0;
    for (int i = 1; i <= 3; i++) {
        CHECK(!cl.r[i].failed);
        CHECK(cl.r[i].ch[0].done);
        CHECK_INT_EQ(cl.r[i].ch[0].fin, SH_PROTO_FINISH_LENGTH);
        CHECK_INT_EQ(cl.r[i].ch[0].n, 32);
        prompt_toks += n_prompt_ids[i];
    }
    // tokens: every prompt position once (no prefix cache), then the 31 decodes of each request
    // (its last token is never computed); generated: 3 x 32.
    CHECK_NEAR(cl.last[V_TOKENS], (double)(prompt_toks + 3 * 31), 0);
    CHECK_NEAR(cl.last[V_GEN], 96, 0);
    CHECK_NEAR(cl.last[V_WAITING], 0, 0);
    CHECK_NEAR(cl.last[V_RUNNING], 0, 0);
    CHECK(cl.last[V_BUSY] > 0 && cl.last[V_BUSY] <= (double)wall_us);
    CHECK(cl.last[V_KV_FREE] > 0 && cl.last[V_KV_FREE] <= g.n_blocks);
    double steps = cl.last[V_STEPS];
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
    fprintf(stderr, "reports: %ld, steps %.0f, busy %.1f ms of %.1f ms\n",
            atomic_load(&cl.n_metrics), steps, cl.last[V_BUSY] / 1000, (double)wall_us / 1000);
    // Every series carries the labels, and the figures agree with the report.
    CHECK_NEAR(metric(&g, "shoal_steps_total{replica=\"7\"}"), steps, 0);
    CHECK_NEAR(metric(&g, "shoal_generation_tokens_total{replica=\"7\"}"), 96, 0);
    CHECK_NEAR(metric(&g, "shoal_requests_finished_total{replica=\"7\",reason=\"length\"}"), 3, 0);
    CHECK_NEAR(metric(&g, "shoal_requests_waiting{replica=\"7\"}"), 0, 0);
    CHECK_NEAR(metric(&g, "shoal_batch_size_count{replica=\"7\"}"), steps, 0);
    CHECK_NEAR(metric(&g, "shoal_steps_total"), -1, 0);
out:
    rig_stop(&g);
}

/* A request preempted for KV goes back to the queue, but it held KV and computed positions: a
 * withdraw leaves it alone and it finishes. Two long requests in a 30-block pool: the later one
 * is preempted when both have grown to about 15 blocks, and waits until the first finishes. */
static void test_withdraw_preempted(void)
{
    rig g;
    if (!rig_start(&g, &(rig_opts){.kv_blocks = 30}))
        goto out;
    submit(&g, 1, 0, 1, 400);
    submit(&g, 2, 1, 1, 400);
    bool sent = false;
    for (int i = 0; i < 60000 && !sent; i++) {
        if (metric(&g, "shoal_preemptions_total") >= 1 &&
            metric(&g, "shoal_requests_waiting") == 1) {
            pthread_mutex_lock(&cl.mu);
            bool first_running = !cl.r[1].ch[0].done;
            pthread_mutex_unlock(&cl.mu);
            CHECK(first_running); /* so the preempted one waits for it */
            cancel(&g, 2, true);
            sent = true;
        } else {
            sleep_ms(1);
        }
    }
    CHECK(sent);
    CHECK(wait_ge(&cl.n_ended, 2, 120000));
    pthread_mutex_lock(&cl.mu);
    for (int i = 1; i <= 2; i++) {
        CHECK(!cl.r[i].failed);
        if (cl.r[i].failed)
            fprintf(stderr, "request %d: FAIL %s\n", i, cl.r[i].msg);
        CHECK(cl.r[i].ch[0].done);
        CHECK_UINT_EQ(cl.r[i].ch[0].n_generated, 400);
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK(metric(&g, "shoal_preemptions_total") >= 1);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
out:
    rig_stop(&g);
}

/* ---- pipelining -------------------------------------------------------------------------- */

/* Stream i is request i + 1; stream 5 asks for n = 2 choices; stream 8 has the long prompt. */
#define FORK_STREAM 5

static bool have_ref;

static void submit_streams(rig *g)
{
    for (int i = 0; i < N_STREAMS; i++)
        submit(g, (uint64_t)i + 1, i, i == FORK_STREAM ? 2 : 1, N_GEN);
}

/* Runs the 16 streams with max_inflight P; fills out[i][c] with each choice's tokens and returns
 * the steps in flight at each send (histogram: how many sends saw more than one). */
static bool run_streams(int32_t P, int32_t out[N_STREAMS][2][N_GEN], double *sends,
                        double *sends_overlapped, double *ms)
{
    rig g;
    bool ok = false;
    if (!rig_start(&g, &(rig_opts){.max_inflight = P}))
        goto out;
    uint64_t t0 = now_ms();
    submit_streams(&g);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    *ms = (double)(now_ms() - t0);
    pthread_mutex_lock(&cl.mu);
    ok = true;
    for (int i = 0; i < N_STREAMS; i++) {
        const req_out *r = &cl.r[i + 1];
        CHECK(!r->failed);
        for (int c = 0; c < r->n_choices; c++) {
            CHECK(r->ch[c].done);
            CHECK_INT_EQ(r->ch[c].n, N_GEN);
            ok = ok && r->ch[c].done && r->ch[c].n == N_GEN && !r->failed;
            memcpy(out[i][c], r->ch[c].tok, sizeof out[i][c]);
        }
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
    *sends = metric(&g, "shoal_steps_in_flight_count");
    *sends_overlapped = *sends - metric(&g, "shoal_steps_in_flight_bucket{le=\"1\"}");
    CHECK_NEAR(metric(&g, "shoal_preemptions_total"), 0, 0);
out:
    rig_stop(&g);
    return ok;
}

static bool make_ref(void)
{
    if (have_ref)
        return true;
    double sends, over, ms;
    have_ref = run_streams(1, ref, &sends, &over, &ms);
    CHECK(sends > 0);
    CHECK_NEAR(over, 0, 0); /* one step at a time */
    fprintf(stderr, "max_inflight 1: %.0f steps, %.0f sent with another in flight, %.0f ms\n",
            sends, over, ms);
    return have_ref;
}

static void test_pipelined_equal(void)
{
    if (!make_ref())
        return;
    static int32_t out[N_STREAMS][2][N_GEN];
    double sends, over, ms;
    CHECK(run_streams(2, out, &sends, &over, &ms));
    fprintf(stderr, "max_inflight 2: %.0f steps, %.0f sent with another in flight, %.0f ms\n",
            sends, over, ms);
    // Two steps in flight most of the time: every decode step but the ends of the run.
    CHECK(over >= sends / 2);
    int diff = 0;
    for (int i = 0; i < N_STREAMS; i++)
        for (int c = 0; c < (i == FORK_STREAM ? 2 : 1); c++)
            for (int k = 0; k < N_GEN; k++)
                if (out[i][c][k] != ref[i][c][k]) {
                    if (diff++ < 5)
                        SH_FAIL_("stream %d choice %d token %d: %d != %d", i, c, k,
                                 (int)out[i][c][k], (int)ref[i][c][k]);
                    break;
                }
    CHECK_INT_EQ(diff, 0);
    // The two choices of a greedy request are the same text.
    CHECK(memcmp(ref[FORK_STREAM][0], ref[FORK_STREAM][1], sizeof ref[0][0]) == 0);
}

/* Two steps in flight, retries off; the link drops one: its requests fail with 503 naming it
 * after the step timeout, the other group's go on meanwhile and finish with the reference's
 * tokens. */
static void test_timeout_one_step(void)
{
    if (!make_ref())
        return;
    rig g;
    atomic_store(&lk.dropped, 0);
    lk.drop_nth = 24; /* a decode step, both groups decoding */
    lk.n_steps = 0;
    lk.first_seq = 0;
    lk.n_seqs = 0;
    rig_opts o = {.max_inflight = 2, .link = true, .step_timeout_ms = 3000, .step_retries = -1};
    if (!rig_start(&g, &o))
        goto out;
    // Single choices only, so that sequence (KV) ids follow the arrival order: request i + 1 is
    // the batcher's (i + 1)-th sequence, first_seq + i (no preemption, checked below).
    for (int i = 0; i < N_STREAMS; i++)
        submit(&g, (uint64_t)i + 1, i, 1, N_GEN);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    CHECK_INT_EQ(atomic_load(&lk.dropped), 1);
    CHECK_NEAR(metric(&g, "shoal_preemptions_total"), 0, 0);
    bool in_dropped[N_STREAMS + 1] = {0};
    for (uint32_t i = 0; i < lk.n_seqs; i++)
        if (lk.seqs[i] >= lk.first_seq && lk.seqs[i] - lk.first_seq < N_STREAMS)
            in_dropped[lk.seqs[i] - lk.first_seq + 1] = true;
    char want[64];
    snprintf(want, sizeof want, "did not answer step %llu ", (unsigned long long)lk.dropped_step);
    CHECK(lk.n_seqs >= 2 && lk.n_seqs <= N_STREAMS - 2); /* a group, not the whole set */
    pthread_mutex_lock(&cl.mu);
    int n_failed = 0, n_done_before = 0;
    uint64_t first_fail = UINT64_MAX;
    for (int i = 1; i <= N_STREAMS; i++)
        if (cl.r[i].failed && cl.r[i].fail_ms < first_fail)
            first_fail = cl.r[i].fail_ms;
    for (int i = 1; i <= N_STREAMS; i++) {
        const req_out *r = &cl.r[i];
        if (in_dropped[i]) {
            n_failed++;
            CHECK(r->failed);
            CHECK_UINT_EQ(r->http, 503);
            CHECK_INT_EQ(r->code, SH_ETIMEDOUT);
            CHECK(strstr(r->msg, want) != NULL);
            if (!strstr(r->msg, want))
                fprintf(stderr, "request %d: %s\n", i, r->msg);
            CHECK(!r->ch[0].done);
        } else {
            CHECK(!r->failed);
            CHECK(r->ch[0].done);
            CHECK_INT_EQ(r->ch[0].n, N_GEN);
            CHECK(memcmp(r->ch[0].tok, ref[i - 1][0], sizeof ref[0][0]) == 0);
            n_done_before += r->ch[0].done_ms < first_fail;
        }
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(n_failed, (int)lk.n_seqs);
    // The others did not wait for the timeout: the pipeline went on with the other step.
    CHECK(n_done_before >= 1);
    fprintf(stderr,
            "dropped step %llu, the 24th (%u sequences): %d requests failed, %d others "
            "finished before the timeout\n",
            (unsigned long long)lk.dropped_step, lk.n_seqs, n_failed, n_done_before);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
out:
    rig_stop(&g);
}

/* Every stream of run `g` ended with the reference's tokens, none failed. */
static void check_all_equal(void)
{
    pthread_mutex_lock(&cl.mu);
    for (int i = 1; i <= N_STREAMS; i++) {
        const req_out *r = &cl.r[i];
        if (r->failed)
            SH_FAIL_("request %d failed: %s", i, r->msg);
        for (int c = 0; c < r->n_choices; c++) {
            CHECK(r->ch[c].done);
            CHECK_INT_EQ(r->ch[c].n, N_GEN);
            if (memcmp(r->ch[c].tok, ref[i - 1][c], sizeof ref[0][0]) != 0)
                SH_FAIL_("request %d choice %d: tokens differ from the reference", i, c);
        }
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
}

/* Two steps in flight, retries on; the link drops the 24th STEP (late: holds it and forwards it
 * right after its retry; slow: right before it, so the first stage still runs the first try when
 * the retry arrives). The step is sent again and every stream ends with the reference's tokens;
 * with the late try both answers come and one is ignored; with the slow one the first stage
 * answers the first try and drops the retry (shoal_stage_retries_dropped_total), which a stage
 * under a long step would otherwise run again for nothing. */
static void run_retry(bool late, bool slow)
{
    if (!make_ref())
        return;
    rig g;
    atomic_store(&lk.dropped, 0);
    atomic_store(&lk.retried, 0);
    lk.drop_nth = 24;
    lk.drop_late = late || slow;
    lk.slow_first = slow;
    lk.n_steps = 0;
    lk.first_seq = 0;
    lk.n_seqs = 0;
    rig_opts o = {.max_inflight = 2, .link = true, .step_timeout_ms = 20000};
    uint64_t t0 = now_ms();
    if (!rig_start(&g, &o))
        goto out;
    submit_streams(&g);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    uint64_t took = now_ms() - t0;
    CHECK_INT_EQ(atomic_load(&lk.dropped), 1);
    CHECK(atomic_load(&lk.retried) >= 1);
    check_all_equal();
    // On a loaded machine another step may be slow enough to be sent again too: every try but
    // the dropped one (when not late) and those the first stage dropped answers, and all answers
    // of a step but one are ignored.
    double retries = metric(&g, "shoal_step_retries_total");
    const int held = late || slow;
    for (int i = 0;
         i < 100 && metric(&g, "shoal_step_answers_ignored_total") <
                        retries - 1 + held - metric(&g, "shoal_stage_retries_dropped_total");
         i++)
        usleep(10000);
    double ignored = metric(&g, "shoal_step_answers_ignored_total");
    double dropped = metric(&g, "shoal_stage_retries_dropped_total");
    CHECK(retries >= 1);
    CHECK_NEAR(ignored, retries - 1 + held - dropped, 0);
    if (slow)
        CHECK(dropped >= 1);
    CHECK(took < 15000); /* well before the step timeout */
    fprintf(stderr,
            "%s: dropped step %llu (%u sequences) retried; %.0f retries, %.0f answers "
            "ignored, %.0f retries dropped by the stage, %llu ms\n",
            slow   ? "slow"
            : late ? "late"
                   : "lost",
            (unsigned long long)lk.dropped_step, lk.n_seqs, retries, ignored, dropped,
            (unsigned long long)took);
out:
    rig_stop(&g);
    lk.drop_nth = 0;
    lk.drop_late = false;
    lk.slow_first = false;
}

static void test_retry_lost_step(void) { run_retry(false, false); }

/* A step lost on every try (2 retries allowed): its requests fail with 503 naming the step and
 * its 3 tries, well before the step timeout; the other group's end with the reference's tokens. */
static void test_retries_exhausted(void)
{
    if (!make_ref())
        return;
    rig g;
    atomic_store(&lk.dropped, 0);
    atomic_store(&lk.retried, 0);
    lk.drop_nth = 24;
    lk.drop_retries = true;
    lk.n_steps = 0;
    lk.first_seq = 0;
    lk.n_seqs = 0;
    rig_opts o = {.max_inflight = 2,
                  .link = true,
                  .step_timeout_ms = 30000,
                  .step_retries = 2,
                  .step_retry_ms = 100};
    uint64_t t0 = now_ms();
    if (!rig_start(&g, &o))
        goto out;
    for (int i = 0; i < N_STREAMS; i++)
        submit(&g, (uint64_t)i + 1, i, 1, N_GEN);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    uint64_t took = now_ms() - t0;
    CHECK_INT_EQ(atomic_load(&lk.retried), 2);
    char want[96];
    snprintf(want, sizeof want, "did not answer step %llu in ",
             (unsigned long long)lk.dropped_step);
    bool in_dropped[N_STREAMS + 1] = {0};
    for (uint32_t i = 0; i < lk.n_seqs; i++)
        if (lk.seqs[i] >= lk.first_seq && lk.seqs[i] - lk.first_seq < N_STREAMS)
            in_dropped[lk.seqs[i] - lk.first_seq + 1] = true;
    int n_failed = 0;
    pthread_mutex_lock(&cl.mu);
    for (int i = 1; i <= N_STREAMS; i++) {
        const req_out *r = &cl.r[i];
        if (in_dropped[i]) {
            n_failed++;
            CHECK(r->failed);
            CHECK_UINT_EQ(r->http, 503);
            CHECK(strstr(r->msg, want) != NULL && strstr(r->msg, "(3 tries)") != NULL);
            if (!strstr(r->msg, want))
                fprintf(stderr, "request %d: %s\n", i, r->msg);
        } else {
            CHECK(!r->failed);
            CHECK(memcmp(r->ch[0].tok, ref[i - 1][0], sizeof ref[0][0]) == 0);
        }
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(n_failed, (int)lk.n_seqs);
    CHECK(took < 20000);
    fprintf(stderr, "step %llu lost 3 times: %d requests failed after %llu ms\n",
            (unsigned long long)lk.dropped_step, n_failed, (unsigned long long)took);
out:
    rig_stop(&g);
    lk.drop_nth = 0;
    lk.drop_retries = false;
}
static void test_retry_late_step(void) { run_retry(true, false); }
static void test_retry_slow_step(void) { run_retry(false, true); }

/* Every third STEP is delivered twice: both stages run it twice (the second run rewrites the
 * same KV rows) and the batcher ignores the second STEP_DONE; the outputs are the reference's and
 * no step is retried. */
static void test_duplicate_steps(void)
{
    if (!make_ref())
        return;
    rig g;
    lk.dup_every = 3;
    lk.n_steps = 0;
    atomic_store(&lk.dups, 0);
    rig_opts o = {.max_inflight = 2, .link = true, .step_timeout_ms = 20000};
    if (!rig_start(&g, &o))
        goto out;
    submit_streams(&g);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    check_all_equal();
    long dups = atomic_load(&lk.dups);
    CHECK(dups >= 5);
    // Every duplicate's second answer is ignored, and so is every extra answer of a step sent
    // again because it was slow (a loaded machine): none is lost here.
    double retries = metric(&g, "shoal_step_retries_total");
    for (int i = 0;
         i < 100 && metric(&g, "shoal_step_answers_ignored_total") <
                        (double)dups + retries - metric(&g, "shoal_stage_retries_dropped_total");
         i++)
        usleep(10000); /* the last duplicate's answer may still be on its way */
    double ignored = metric(&g, "shoal_step_answers_ignored_total");
    CHECK_NEAR(ignored, (double)dups + retries - metric(&g, "shoal_stage_retries_dropped_total"),
               0);
    fprintf(stderr, "duplicates: %ld STEPs delivered twice, %.0f answers ignored, %.0f retries\n",
            dups, ignored, retries);
out:
    rig_stop(&g);
    lk.dup_every = 0;
}

/* One run of the 16 streams with seeded sampling (temperature 0.9, a frequency penalty) through
 * the link, P = 2, with every dup_every-th STEP duplicated and the 24th dropped and forwarded
 * late after its retry (late: both tries reach the stages). Returns whether every stream
 * ended. */
static bool run_seeded(long dup_every, bool late, int32_t out[N_STREAMS][2][N_GEN], double *ignored)
{
    rig g;
    bool ok = false;
    samp.temperature = 0.9f;
    samp.frequency_penalty = 0.5f;
    samp.seed = 1000;
    lk.dup_every = dup_every;
    lk.drop_nth = late ? 24 : 0;
    lk.drop_late = late;
    lk.n_steps = 0;
    lk.first_seq = 0;
    lk.n_seqs = 0;
    atomic_store(&lk.dropped, 0);
    atomic_store(&lk.retried, 0);
    atomic_store(&lk.dups, 0);
    if (!rig_start(&g, &(rig_opts){.max_inflight = 2, .link = true, .step_timeout_ms = 20000}))
        goto out;
    submit_streams(&g);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    pthread_mutex_lock(&cl.mu);
    ok = true;
    for (int i = 0; i < N_STREAMS; i++) {
        const req_out *r = &cl.r[i + 1];
        CHECK(!r->failed);
        for (int c = 0; c < r->n_choices; c++) {
            ok = ok && r->ch[c].done && r->ch[c].n == N_GEN && !r->failed;
            memcpy(out[i][c], r->ch[c].tok, sizeof out[i][c]);
        }
    }
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
    *ignored = metric(&g, "shoal_step_answers_ignored_total");
out:
    rig_stop(&g);
    memset(&samp, 0, sizeof samp);
    lk.dup_every = 0;
    lk.drop_nth = 0;
    lk.drop_late = false;
    return ok;
}

/* A seeded, penalised (non-greedy) request asks the last stage for the same draw again when a
 * step runs twice (duplicated, or retried after a lost answer while the lost try still runs):
 * the stage answers the draw it made instead of drawing again, so the outputs equal an
 * undisturbed run's token for token. */
static void test_seeded_steps_twice(void)
{
    if (!make_ref())
        return;
    static int32_t clean[N_STREAMS][2][N_GEN], twice[N_STREAMS][2][N_GEN];
    double ign0 = 0, ign1 = 0;
    if (!run_seeded(0, false, clean, &ign0) || !run_seeded(3, true, twice, &ign1))
        return;
    CHECK(ign1 >= 5); /* the duplicates' and the late try's answers */
    int diff = 0;
    for (int i = 0; i < N_STREAMS; i++)
        for (int c = 0; c < (i == FORK_STREAM ? 2 : 1); c++)
            if (memcmp(clean[i][c], twice[i][c], sizeof clean[i][c]) != 0 && diff++ < 5)
                SH_FAIL_("stream %d choice %d: the tokens differ from the undisturbed run's", i, c);
    CHECK_INT_EQ(diff, 0);
    // Sampled, not greedy: the outputs are not the greedy reference's.
    CHECK(memcmp(clean[0][0], ref[0][0], sizeof clean[0][0]) != 0);
    fprintf(stderr, "seeded: %.0f answers ignored, %d streams differ from the undisturbed run\n",
            ign1, diff);
}

/* ---- CONTROL PAUSE / RESUME ------------------------------------------------------------ */

static void control(rig *g, uint8_t op)
{
    sh_proto_control c = {.op = op};
    sh_error e = {0};
    CHECK_OK(sh__act_send(g->t.rt, g->client, g->batcher, SH_MSG_CONTROL, 0, &c, &e));
}

#define PAUSE_SUBMIT 17 /* submitted while paused: prompt 0 */
#define PAUSE_CANCEL 3  /* cancelled while paused */

/* The 16 streams with max_inflight P; the link pauses the batcher at the 20th STEP, dropping it or
 * forwarding it (a late STEP_DONE). Held paused 200 ms, then resumed: every stream but the
 * cancelled one ends with the reference's tokens. */
static void run_pause(int32_t P, bool drop, bool at_alloc)
{
    if (!make_ref())
        return;
    rig g;
    atomic_store(&lk.dropped, 0);
    atomic_store(&lk.paused, 0);
    atomic_store(&lk.forwarded, 0);
    lk.drop_nth = 0;
    lk.n_steps = 0;
    lk.first_seq = 0;
    lk.pause_nth = at_alloc ? 0 : 20;
    lk.pause_alloc_nth = at_alloc ? 200 : 0;
    lk.n_allocs = 0;
    lk.pause_drop = drop;
    rig_opts o = {.max_inflight = P, .link = true, .kv_link = at_alloc, .step_timeout_ms = 2000};
    if (!rig_start(&g, &o))
        goto out;
    lk.batcher = g.batcher;
    control(&g, SH_PROTO_CONTROL_OP_RESUME); /* not paused: nothing happens */
    submit_streams(&g);
    CHECK(wait_ge(&lk.paused, 1, 60000));
    usleep(50 * 1000);
    long ended_at_pause = atomic_load(&cl.n_ended);
    control(&g, SH_PROTO_CONTROL_OP_PAUSE); /* twice: nothing more happens */
    pthread_mutex_lock(&cl.mu);
    cl.r[PAUSE_SUBMIT].n_choices = 1;
    pthread_mutex_unlock(&cl.mu);
    submit(&g, PAUSE_SUBMIT, 0, 1, N_GEN);
    cancel(&g, PAUSE_CANCEL, false);
    usleep(150 * 1000);
    CHECK_NEAR(metric(&g, "shoal_batcher_paused"), 1, 0);
    CHECK_NEAR(metric(&g, "shoal_kv_blocks_used"), 0, 0); /* the RESET freed every block */
    long fwd = atomic_load(&lk.forwarded);
    usleep(50 * 1000);
    CHECK_INT_EQ(atomic_load(&lk.forwarded), fwd); /* no STEP while paused */
    // No request ended while paused (the cancelled one ends silently: no DONE after CANCEL).
    CHECK_INT_EQ(atomic_load(&cl.n_ended), ended_at_pause);
    control(&g, SH_PROTO_CONTROL_OP_RESUME);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000)); /* 15 streams and the one submitted paused */
    CHECK_NEAR(metric(&g, "shoal_batcher_paused"), 0, 0);
    // The last sequences' KV_FREE goes to the kvmgr while their DONE goes to the client: the
    // pool is empty once the kvmgr has taken them (up to 5 s).
    for (int i = 0; i < 500 && metric(&g, "shoal_kv_blocks_used") != 0; i++)
        usleep(10 * 1000);
    CHECK_NEAR(metric(&g, "shoal_kv_blocks_used"), 0, 0);
    pthread_mutex_lock(&cl.mu);
    for (int i = 0; i < N_STREAMS; i++) {
        const req_out *r = &cl.r[i + 1];
        CHECK(!r->failed);
        for (int c = 0; c < r->n_choices; c++) {
            if (i + 1 == PAUSE_CANCEL) {
                CHECK(!r->ch[c].done);
                CHECK(r->ch[c].n > 0 && r->ch[c].n < N_GEN);
                CHECK(memcmp(r->ch[c].tok, ref[i][c], (size_t)r->ch[c].n * sizeof(int32_t)) == 0);
                continue;
            }
            CHECK(r->ch[c].done);
            CHECK_INT_EQ(r->ch[c].n, N_GEN);
            CHECK_UINT_EQ(r->ch[c].n_generated, N_GEN);
            if (memcmp(r->ch[c].tok, ref[i][c], sizeof ref[i][c]) != 0)
                SH_FAIL_("stream %d choice %d differs from the undisturbed run", i, c);
        }
    }
    const req_out *late = &cl.r[PAUSE_SUBMIT];
    CHECK(!late->failed && late->ch[0].done);
    CHECK_INT_EQ(late->ch[0].n, N_GEN);
    CHECK(memcmp(late->ch[0].tok, ref[0][0], sizeof ref[0][0]) == 0);
    pthread_mutex_unlock(&cl.mu);
    CHECK_INT_EQ(atomic_load(&cl.bad), 0);
    if (at_alloc)
        fprintf(stderr, "max_inflight %d, paused at KV_ALLOC %ld: %ld messages forwarded\n", (int)P,
                lk.pause_alloc_nth, atomic_load(&lk.forwarded));
    else
        fprintf(stderr, "max_inflight %d, paused at step %llu (%s): %ld STEPs forwarded\n", (int)P,
                (unsigned long long)lk.dropped_step, drop ? "dropped" : "answered late",
                atomic_load(&lk.forwarded));
out:
    lk.pause_nth = lk.pause_alloc_nth = 0;
    rig_stop(&g);
}

static void test_pause_resume_late(void) { run_pause(1, false, false); }
static void test_pause_resume_drop(void) { run_pause(2, true, false); }
static void test_pause_resume_late_p2(void) { run_pause(2, false, false); }
/* PAUSE with a KV_ALLOC on its way: its reply (about the old pool) is absorbed. */
static void test_pause_resume_kv_due(void) { run_pause(2, false, true); }

/* ---- speculative decoding --------------------------------------------------------------- */

/* The greedy streams with drafts, two steps in flight: each of dup (every third STEP twice),
 * retry (the 24th dropped and forwarded after its retry) and pause (PAUSE at the 20th STEP)
 * gives the reference's tokens, and drafts were accepted. */
static void test_spec_retry_duplicate(void)
{
    if (!make_ref())
        return;
    rig_spec = true;
    spec_accepted = 0;
    run_retry(true, false);
    CHECK(spec_accepted > 0);
    fprintf(stderr, "spec, late retry: %.0f drafted tokens accepted\n", spec_accepted);
    spec_accepted = 0;
    test_duplicate_steps();
    CHECK(spec_accepted > 0);
    fprintf(stderr, "spec, duplicates: %.0f drafted tokens accepted\n", spec_accepted);
    rig_spec = false;
}

static void test_spec_pause_resume(void)
{
    if (!make_ref())
        return;
    rig_spec = true;
    spec_accepted = 0;
    run_pause(2, false, false);
    CHECK(spec_accepted > 0);
    fprintf(stderr, "spec, pause: %.0f drafted tokens accepted\n", spec_accepted);
    rig_spec = false;
}

/* Seeded sampling: the stage draws one number per token whether drafted or not, so the streams
 * with drafts (duplicates and a late retry included) equal those without. */
static void test_spec_seeded(void)
{
    static int32_t plain[N_STREAMS][2][N_GEN], drafted[N_STREAMS][2][N_GEN];
    double ign0 = 0, ign1 = 0;
    if (!run_seeded(0, false, plain, &ign0))
        return;
    rig_spec = true;
    spec_accepted = 0;
    bool ok = run_seeded(3, true, drafted, &ign1);
    rig_spec = false;
    if (!ok)
        return;
    CHECK(spec_accepted > 0);
    int diff = 0;
    for (int i = 0; i < N_STREAMS; i++)
        for (int c = 0; c < (i == FORK_STREAM ? 2 : 1); c++)
            if (memcmp(plain[i][c], drafted[i][c], sizeof plain[i][c]) != 0 && diff++ < 5)
                SH_FAIL_("stream %d choice %d: drafts changed the seeded tokens", i, c);
    CHECK_INT_EQ(diff, 0);
    fprintf(stderr, "spec, seeded: %.0f drafted tokens accepted, %.0f answers ignored\n",
            spec_accepted, ign1);
}

/* A drafter that appends fewer drafts than the batcher asks for (the link standing in for one,
 * above), two steps in flight: the streams are the reference's, every appended draft is
 * accepted, and the batcher's shoal_spec_* counters are what was appended (step_out.drafted),
 * not what it asked for. */
static void test_spec_drafter_short(void)
{
    if (!make_ref())
        return;
    memset(&ds, 0, sizeof ds);
    ds.on = true;
    rig_spec = true;
    rig g;
    if (!rig_start(&g, &(rig_opts){.max_inflight = 2, .link = true}))
        goto out;
    submit_streams(&g);
    CHECK(wait_ge(&cl.n_ended, N_STREAMS, 120000));
    check_all_equal();
    double drafts = metric(&g, "shoal_spec_drafts_total");
    double toks = metric(&g, "shoal_spec_draft_tokens_total");
    double acc = metric(&g, "shoal_spec_accepted_tokens_total");
    long asked = atomic_load(&ds.asked), appended = atomic_load(&ds.appended);
    fprintf(stderr,
            "drafter short: asked %ld, appended %ld in %ld steps; counted %.0f in %.0f, "
            "%.0f accepted\n",
            asked, appended, atomic_load(&ds.drafting), toks, drafts, acc);
    CHECK(appended > 0 && asked > appended);
    CHECK_NEAR(toks, (double)appended, 0);
    CHECK_NEAR(drafts, (double)atomic_load(&ds.drafting), 0);
    CHECK_NEAR(acc, (double)appended, 0); /* the reference's tokens: every one accepted */
out:
    rig_stop(&g);
    ds.on = false;
    rig_spec = false;
}

int main(int argc, char **argv)
{
    FILE *f = fopen(sh_test_path(MODEL), "rb");
    if (!f) {
        fprintf(stderr, "skipped: %s absent\n", MODEL);
        return SH_TEST_SKIP;
    }
    fclose(f);
    sh_error e = {0};
    if (sh_llama_load(sh_test_path(MODEL), NULL, &full, &e) ||
        sh_tokenizer_create_gguf(full->gguf, &tok, &e) || !encode_prompts()) {
        fprintf(stderr, "setup: %s\n", e.msg);
        return 1;
    }
    static const sh_test_case tests[] = {{"reports_labels_withdraw", test_reports_labels_withdraw},
                                         {"withdraw_preempted", test_withdraw_preempted},
                                         {"pipelined_equal", test_pipelined_equal},
                                         {"timeout_one_step", test_timeout_one_step},
                                         {"retry_lost_step", test_retry_lost_step},
                                         {"retries_exhausted", test_retries_exhausted},
                                         {"retry_late_step", test_retry_late_step},
                                         {"retry_slow_step", test_retry_slow_step},
                                         {"duplicate_steps", test_duplicate_steps},
                                         {"seeded_steps_twice", test_seeded_steps_twice},
                                         {"pause_resume_late", test_pause_resume_late},
                                         {"pause_resume_drop", test_pause_resume_drop},
                                         {"pause_resume_late_p2", test_pause_resume_late_p2},
                                         {"pause_resume_kv_due", test_pause_resume_kv_due},
                                         {"spec_retry_duplicate", test_spec_retry_duplicate},
                                         {"spec_pause_resume", test_spec_pause_resume},
                                         {"spec_seeded", test_spec_seeded},
                                         {"spec_drafter_short", test_spec_drafter_short},
                                         {NULL, NULL}};
    int rc = sh_test_main(argc, argv, tests);
    sh_tokenizer_destroy(tok);
    sh_llama_destroy(full);
    return rc;
}
