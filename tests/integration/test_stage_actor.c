/* The stage actor with the default model in a real runtime: three sequences batched into STEPs
 * (a chunked prefill among them) give the same greedy tokens as each sequence run alone through
 * sh_llama_forward; bad steps fail with a status and leave the next step working; stopping with
 * steps queued frees them; decode steps (speculative ones too) allocate nothing. Speculative
 * steps (step_seq.draft): greedy drafts verified into the tokens of the sequence run alone (all
 * accepted, or up to a wrong one), sampled drafts verified into exactly the tokens and logprobs
 * of one-token steps with the same seed and penalties, retries (with the same, other or fewer
 * drafts) answered from the draws already made, bad drafts refused; in a tensor-parallel group
 * of 2 stage actors (stories260K), through the greedy head and the gathered logits. Skips (77)
 * when models/smollm2-135m-instruct-q4_1.gguf is absent. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "actors/stage_grammar.h"
#include "kernels/backend.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "runtime/coll.h"
#include "runtime/proto.h"
#include "unit/test_runtime_util.h"

#define MODEL "models/smollm2-135m-instruct-q4_1.gguf"
#define N_SEQ 3
#define N_GEN 6
#define N_REF 10 /* greedy tokens of each sequence run alone (N_GEN for the batched test) */
#define MAX_PROMPT 64
#define SEQ_BLOCKS 20 /* blocks per sequence: 320 positions */

static const char *const prompts[N_SEQ] = {
    "The capital of France is",
    "Here is a short list of colours: red, green,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
};

/* The model, its context and what each sequence gives when run alone. */
typedef struct env {
    sh_llama *m;
    sh_backend *be;
    sh_llama_ctx *c;
    int32_t n_vocab;
    int32_t prompt[N_SEQ][MAX_PROMPT];
    int32_t n_prompt[N_SEQ];
    int32_t ref[N_SEQ][N_REF];   /* greedy tokens */
    float ref_lp[N_SEQ];         /* log-softmax of the first token */
    float ref_lps[N_SEQ][N_REF]; /* and of each */
    int32_t blocks[N_SEQ][SEQ_BLOCKS];
    sh_stage_args args;
} env;

static env E;

/* ---- allocation counting ------------------------------------------------------------------ */

/* stage_actor.cmake links with --wrap: while `counting` is 1, allocations on any thread but the
 * test's own (the stage's worker, the loops, the backend's pool) are counted; 2 counts all. */
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
static pthread_t main_thread;
static atomic_int counting;
static _Atomic long n_allocs;

static void count_alloc(void)
{
    int c = atomic_load_explicit(&counting, memory_order_acquire);
    if (c == 2 || (c == 1 && !pthread_equal(pthread_self(), main_thread)))
        atomic_fetch_add(&n_allocs, 1);
}
void *__wrap_malloc(size_t n)
{
    count_alloc();
    return __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n)
{
    count_alloc();
    return __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n)
{
    count_alloc();
    return __real_realloc(p, n);
}

/* ---- the collector: records every STEP_DONE --------------------------------------------- */

typedef struct rec {
    uint64_t step, trace, compute_us;
    int32_t status;
    char msg[256];
    uint32_t n;
    uint64_t seq[8];
    int32_t tok[8];
    float lp[8], lp_raw[8];
    uint32_t n_top[8];
    int32_t top_tok[8][SH_PROTO_MAX_LOGPROBS];
    float top_lp[8][SH_PROTO_MAX_LOGPROBS];
    uint32_t drafted[8]; /* step_out.drafted: the drafts the stage saw (step_seq.draft) */
    int32_t sst[8];      /* step_out.status: a sequence's own failure, and why */
    char smsg[8][256];
    uint32_t n_more[8]; /* a speculative step's tokens after tok, with their logprobs */
    int32_t more[8][SH_PROTO_MAX_DRAFT];
    float more_lp[8][SH_PROTO_MAX_DRAFT], more_lr[8][SH_PROTO_MAX_DRAFT];
} rec;

typedef struct shared {
    _Atomic long n; /* records filled */
    _Atomic long bad;
    rec r[64];
} shared;

typedef struct coll_state {
    shared *sh;
    sh_act_decoder dec;
} coll_state;

static sh_err coll_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    coll_state *st = state;
    st->sh = arg;
    return sh__act_decoder_init(&st->dec, 1 << 20);
}

static void coll_stop(sh_actor_ctx *ctx, void *state)
{
    sh__act_decoder_fini(&((coll_state *)state)->dec);
}

static sh_msg_fate coll_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    coll_state *st = state;
    shared *sh = st->sh;
    const sh_msg_hdr *h = sh_msg_header(m);
    long k = atomic_load(&sh->n);
    sh_proto_body b;
    sh_error e = {0};
    if (h->type != SH_MSG_STEP_DONE || k >= 64 || sh__act_decode(&st->dec, m, &b, &e)) {
        fprintf(stderr, "collector: unexpected %s %s\n", sh__msg_type_name(h->type), e.msg);
        atomic_fetch_add(&sh->bad, 1);
        return SH_MSG_FATE_DONE;
    }
    const sh_proto_step_done *d = &b.step_done;
    rec *r = &sh->r[k];
    memset(r, 0, sizeof *r);
    r->step = d->step;
    r->trace = h->trace_id;
    r->compute_us = d->compute_us;
    r->status = d->status;
    snprintf(r->msg, sizeof r->msg, "%.*s", (int)d->message.len, d->message.ptr);
    r->n = d->seqs.n;
    for (uint32_t i = 0; i < d->seqs.n && i < 8; i++) {
        const sh_proto_step_out *o = &d->seqs.v[i];
        r->seq[i] = o->seq;
        r->tok[i] = o->token;
        r->lp[i] = o->logprob;
        r->lp_raw[i] = o->logprob_raw;
        r->n_top[i] = o->top_tokens.n;
        if (o->top_tokens.n != o->top_logprobs.n)
            atomic_fetch_add(&sh->bad, 1);
        for (uint32_t j = 0; j < o->top_tokens.n && j < SH_PROTO_MAX_LOGPROBS; j++) {
            r->top_tok[i][j] = sh_i32s_at(o->top_tokens, j);
            r->top_lp[i][j] = sh_f32s_at(o->top_logprobs, j);
        }
        r->drafted[i] = o->drafted;
        r->sst[i] = o->status;
        snprintf(r->smsg[i], sizeof r->smsg[i], "%.*s", (int)o->message.len,
                 o->message.ptr ? o->message.ptr : "");
        r->n_more[i] = o->more.n;
        if (o->more.n != o->more_lp.n || o->more.n != o->more_lp_raw.n)
            atomic_fetch_add(&sh->bad, 1);
        for (uint32_t j = 0; j < o->more.n && j < SH_PROTO_MAX_DRAFT; j++) {
            r->more[i][j] = sh_i32s_at(o->more, j);
            r->more_lp[i][j] = sh_f32s_at(o->more_lp, j);
            r->more_lr[i][j] = sh_f32s_at(o->more_lp_raw, j);
        }
    }
    atomic_store(&sh->n, k + 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable coll_vt = {
    .name = "collector",
    .state_size = sizeof(coll_state),
    .init = coll_init,
    .handle = coll_handle,
    .stop = coll_stop,
};

/* ---- setup ------------------------------------------------------------------------------- */

static double log_softmax_at(const float *x, int32_t n, int32_t id)
{
    double mx = x[0], sum = 0.0;
    for (int32_t i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int32_t i = 0; i < n; i++)
        sum += exp((double)x[i] - mx);
    return (double)x[id] - mx - log(sum);
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Loads the model, tokenizes the prompts and runs each sequence alone (blocks 0, 1, 2, ...). */
static bool env_open(void)
{
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 2};
    sh_llama_ctx_opts co = {.max_tokens = 256,
                            .max_seqs = 8,
                            .max_logits = sh_stage_max_logits(8, 256),
                            .kv_tokens = 4096};
    sh_tokenizer *tok = NULL;
    if (sh_llama_load(sh_test_path(MODEL), NULL, &E.m, &e) ||
        sh_backend_cpu_create(&bo, &E.be, &e) || sh_llama_ctx_create(E.m, E.be, &co, &E.c, &e) ||
        sh_tokenizer_create_gguf(E.m->gguf, &tok, &e)) {
        SH_FAIL_("open: %s", e.msg);
        sh_tokenizer_destroy(tok);
        return false;
    }
    E.n_vocab = E.m->hp.n_vocab;
    for (int s = 0; s < N_SEQ; s++) {
        size_t n = 0;
        CHECK_OK(sh_tokenizer_encode(tok, prompts[s], strlen(prompts[s]), 0, E.prompt[s],
                                     MAX_PROMPT, &n, &e));
        E.n_prompt[s] = (int32_t)n;
        CHECK(n >= 4);
    }
    sh_tokenizer_destroy(tok);
    int32_t ident[SEQ_BLOCKS];
    for (int32_t j = 0; j < SEQ_BLOCKS; j++)
        ident[j] = j;
    for (int s = 0; s < N_SEQ; s++) {
        sh_llama_seq q = {
            .tokens = E.prompt[s], .n_tokens = E.n_prompt[s], .blocks = ident, .want_logits = true};
        for (int g = 0; g < N_REF; g++) {
            sh_llama_batch b = {.n_seqs = 1, .seqs = &q};
            sh_llama_out out;
            if (sh_llama_forward(E.c, &b, &out, &e)) {
                SH_FAIL_("forward: %s", e.msg);
                return false;
            }
            E.ref[s][g] = argmax(out.logits, E.n_vocab);
            E.ref_lps[s][g] = (float)log_softmax_at(out.logits, E.n_vocab, E.ref[s][g]);
            if (g == 0)
                E.ref_lp[s] = E.ref_lps[s][0];
            q = (sh_llama_seq){.tokens = &E.ref[s][g],
                               .n_tokens = 1,
                               .pos0 = q.pos0 + q.n_tokens,
                               .blocks = ident,
                               .want_logits = true};
        }
    }
    /* In the stage, sequence s owns blocks 20 s + 7 .. in reverse order: nothing like the
     * reference's tables. */
    for (int s = 0; s < N_SEQ; s++)
        for (int32_t j = 0; j < SEQ_BLOCKS; j++)
            E.blocks[s][j] = SEQ_BLOCKS * s + 7 + (SEQ_BLOCKS - 1 - j);
    E.args = (sh_stage_args){.model = E.m, .ctx = E.c, .max_seqs = 8};
    return true;
}

static void env_close(void)
{
    sh_llama_ctx_destroy(E.c);
    sh_backend_destroy(E.be);
    sh_llama_destroy(E.m);
}

/* ---- driving ------------------------------------------------------------------------------ */

typedef struct fixture {
    test_rt t;
    shared sh;
    sh_addr coll, stage;
} fixture;

static void fx_start(fixture *f)
{
    memset(f, 0, sizeof *f);
    rt_start(&f->t, 5, 2, NULL);
    CHECK_OK(sh_runtime_register(f->t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(f->t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "collector", &f->sh, 0, &f->coll, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "stage", &E.args, 1, &f->stage, NULL));
}

static sh_proto_sampling greedy(void)
{
    return (sh_proto_sampling){.temperature = 0.0f,
                               .top_p = 1.0f,
                               .repeat_penalty = 1.0f,
                               .penalty_last_n = 64,
                               .max_tokens = N_GEN};
}

/* Sends a STEP of epoch `epoch` from the collector's address with trace id 1000 + step. */
static void send_step_epoch(fixture *f, uint64_t step, const sh_proto_step_seq *seqs, uint32_t n,
                            uint64_t epoch)
{
    sh_proto_step body = {.step = step, .seqs = {seqs, n}, .epoch = epoch};
    sh_msg_hdr h = {.type = SH_MSG_STEP, .src = f->coll, .dst = f->stage, .trace_id = 1000 + step};
    sh_error e = {0};
    sh_err err = sh_send_with(f->t.rt, &h, sh__proto_encode, &body, &e);
    if (err)
        SH_FAIL_("send STEP %llu: %s", (unsigned long long)step, e.msg);
}

static void send_step(fixture *f, uint64_t step, const sh_proto_step_seq *seqs, uint32_t n)
{
    send_step_epoch(f, step, seqs, n, 0);
}

/* Waits for record k and returns it (NULL after a failed check). */
static const rec *wait_rec(fixture *f, long k)
{
    if (!wait_ge(&f->sh.n, k + 1, 60000)) {
        SH_FAIL_("no STEP_DONE #%ld", k);
        return NULL;
    }
    return &f->sh.r[k];
}

/* ---- tests -------------------------------------------------------------------------------- */

/* Sequence s's progress through the batched run. */
typedef struct seq_run {
    int32_t fed;  /* positions in its cache */
    int32_t ngen; /* tokens sampled */
    int32_t gen[N_GEN];
} seq_run;

/* Builds the next STEP entry of each unfinished sequence: the prompt (sequence 2 in two chunks,
 * the first not sampled), then its last token. Returns the count; ids[i] names the sequence. */
static uint32_t build_step(seq_run *sr, sh_proto_step_seq *q, int *ids)
{
    uint32_t n = 0;
    for (int s = 0; s < N_SEQ; s++) {
        if (sr[s].ngen == N_GEN)
            continue;
        sh_proto_step_seq *x = &q[n];
        *x = (sh_proto_step_seq){.seq = 100 + (uint64_t)s,
                                 .pos = (uint32_t)sr[s].fed,
                                 .blocks = {E.blocks[s], SEQ_BLOCKS},
                                 .sample = true,
                                 .sampling = greedy(),
                                 .history = {E.prompt[s], (uint32_t)E.n_prompt[s]}};
        if (s == 1)
            x->sampling.n_logprobs = 3;
        if (sr[s].fed < E.n_prompt[s]) {
            int32_t chunk = E.n_prompt[s] - sr[s].fed;
            if (s == 2 && sr[s].fed == 0)
                chunk = E.n_prompt[s] / 2;
            x->tokens = (sh_i32s){E.prompt[s] + sr[s].fed, (uint32_t)chunk};
            x->sample = sr[s].fed + chunk == E.n_prompt[s];
        } else {
            x->tokens = (sh_i32s){&sr[s].gen[sr[s].ngen - 1], 1};
        }
        ids[n++] = s;
    }
    return n;
}

static void test_batched_equals_alone(void)
{
    fixture f;
    fx_start(&f);
    seq_run sr[N_SEQ] = {0};
    sh_proto_step_seq q[N_SEQ];
    int ids[N_SEQ];
    long k = 0;
    bool bad_sent = false;
    for (uint64_t step = 1; step < 40; step++) {
        uint32_t n = build_step(sr, q, ids);
        if (n == 0)
            break;
        if (step == 3 && !bad_sent) {
            /* Two bad steps queued right before this good one: a token outside the vocabulary,
             * and a new sequence whose sampling parameters the sampler refuses. */
            sh_proto_step_seq bad[N_SEQ];
            memcpy(bad, q, sizeof bad);
            int32_t oov = E.n_vocab;
            bad[0].tokens = (sh_i32s){&oov, 1};
            send_step(&f, 900, bad, n);
            sh_proto_step_seq nosmp = q[0];
            nosmp.seq = 77;
            nosmp.sampling.repeat_penalty = 0.0f;
            send_step(&f, 901, &nosmp, 1);
            send_step(&f, step, q, n);
            const rec *r = wait_rec(&f, k++);
            if (r) {
                CHECK_UINT_EQ(r->step, 900);
                CHECK_UINT_EQ(r->trace, 1900);
                CHECK_INT_EQ(r->status, SH_EINVAL);
                CHECK_UINT_EQ(r->n, 0);
                CHECK(r->msg[0] != '\0');
            }
            r = wait_rec(&f, k++);
            if (r) {
                CHECK_UINT_EQ(r->step, 901);
                CHECK_INT_EQ(r->status, SH_EINVAL);
                CHECK_UINT_EQ(r->n, 0);
                CHECK(strstr(r->msg, "77") != NULL);
            }
            bad_sent = true;
        } else {
            send_step(&f, step, q, n);
        }
        const rec *r = wait_rec(&f, k++);
        if (!r)
            break;
        CHECK_UINT_EQ(r->step, step);
        CHECK_UINT_EQ(r->trace, 1000 + step);
        CHECK_INT_EQ(r->status, 0);
        CHECK(r->compute_us > 0);
        CHECK_UINT_EQ(r->n, n);
        if (r->status || r->n != n)
            break;
        for (uint32_t i = 0; i < n; i++) {
            int s = ids[i];
            CHECK_UINT_EQ(r->seq[i], 100 + (uint64_t)s);
            sr[s].fed += (int32_t)q[i].tokens.n;
            if (!q[i].sample) {
                CHECK_INT_EQ(r->tok[i], -1);
                CHECK_UINT_EQ(r->n_top[i], 0);
                continue;
            }
            int g = sr[s].ngen;
            CHECK_INT_EQ(r->tok[i], E.ref[s][g]);
            if (g == 0)
                CHECK_NEAR(r->lp_raw[i], E.ref_lp[s], 0.05);
            CHECK_NEAR(r->lp[i], r->lp_raw[i], 1e-4); /* nothing transforms the logits */
            if (s == 1) {
                CHECK_UINT_EQ(r->n_top[i], 3);
                CHECK_INT_EQ(r->top_tok[i][0], r->tok[i]);
                CHECK_NEAR(r->top_lp[i][0], r->lp_raw[i], 1e-4);
                CHECK(r->top_lp[i][1] <= r->top_lp[i][0] && r->top_lp[i][2] <= r->top_lp[i][1]);
            } else {
                CHECK_UINT_EQ(r->n_top[i], 0);
            }
            sr[s].gen[sr[s].ngen++] = r->tok[i];
        }
    }
    CHECK(bad_sent);
    for (int s = 0; s < N_SEQ; s++)
        CHECK_INT_EQ(sr[s].ngen, N_GEN);
    /* Other message types and an empty step. */
    CHECK_OK(send_body(f.t.rt, f.coll, f.stage, 0, SH_MSG_PING, 0, 0));
    send_step(&f, 50, NULL, 0);
    const rec *r = wait_rec(&f, k++);
    if (r) {
        CHECK_UINT_EQ(r->step, 50);
        CHECK_INT_EQ(r->status, 0);
        CHECK_UINT_EQ(r->n, 0);
    }
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* Shutting down with STEPs queued: the worker finishes the one it runs and the rest are freed
 * (rt_finish checks that no message is left). A table too short for the positions fails. */
static void test_stop_with_queue(void)
{
    fixture f;
    fx_start(&f);
    int32_t short_table[1] = {3};
    sh_proto_step_seq q = {.seq = 5,
                           .tokens = {E.prompt[2], (uint32_t)E.n_prompt[2]},
                           .blocks = {short_table, 1},
                           .sample = true,
                           .sampling = greedy()};
    send_step(&f, 1, &q, 1);
    const rec *r = wait_rec(&f, 0);
    if (r) {
        CHECK_INT_EQ(r->status, E.n_prompt[2] > 16 ? SH_EINVAL : 0);
    }
    q.blocks = (sh_i32s){E.blocks[0], SEQ_BLOCKS};
    for (uint64_t s = 2; s < 12; s++)
        send_step(&f, s, &q, 1);
    rt_finish(&f.t);
    CHECK(atomic_load(&f.sh.n) < 12);
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
}

/* After each sequence's first sample (which creates its sampler), decode steps with a full
 * sampling chain and top logprobs allocate nothing on any thread. */
static void test_decode_no_alloc(void)
{
    /* The wrapper must be in place, or a zero count proves nothing (2: count every thread). */
    atomic_store(&n_allocs, 0);
    atomic_store(&counting, 2);
    void *volatile probe = malloc(16);
    free(probe);
    atomic_store(&counting, 0);
    CHECK_INT_EQ(atomic_load(&n_allocs), 1);

    fixture f;
    fx_start(&f);
    int32_t last[N_SEQ], fed[N_SEQ];
    sh_proto_step_seq q[N_SEQ];
    long k = 0;
    for (int s = 0; s < N_SEQ; s++) {
        q[s] = (sh_proto_step_seq){.seq = 200 + (uint64_t)s,
                                   .tokens = {E.prompt[s], (uint32_t)E.n_prompt[s]},
                                   .blocks = {E.blocks[s], SEQ_BLOCKS},
                                   .sample = true,
                                   .sampling = greedy()};
        q[s].sampling.temperature = 0.8f;
        q[s].sampling.top_k = 40;
        q[s].sampling.top_p = 0.95f;
        q[s].sampling.repeat_penalty = 1.1f;
        q[s].sampling.seed = 7 + (uint64_t)s;
        q[s].sampling.n_logprobs = 5;
        q[s].sampling.logprobs_mode = (uint8_t)(s & 1);
        fed[s] = E.n_prompt[s];
    }
    for (uint64_t step = 1; step <= 16; step++) {
        if (step == 6) {
            atomic_store(&n_allocs, 0);
            atomic_store_explicit(&counting, 1, memory_order_release);
        }
        send_step(&f, step, q, N_SEQ);
        const rec *r = wait_rec(&f, k++);
        if (!r || r->status || r->n != N_SEQ) {
            SH_FAIL_("step %llu failed: %s", (unsigned long long)step, r ? r->msg : "no answer");
            break;
        }
        for (int s = 0; s < N_SEQ; s++) {
            CHECK(r->tok[s] >= 0 && r->tok[s] < E.n_vocab);
            /* RAW ranks the whole vocabulary; FINAL only what top-k/top-p left. */
            if (s & 1)
                CHECK(r->n_top[s] >= 1 && r->n_top[s] <= 5);
            else
                CHECK_UINT_EQ(r->n_top[s], 5);
            last[s] = r->tok[s];
            q[s].pos = (uint32_t)fed[s];
            q[s].tokens = (sh_i32s){&last[s], 1};
            fed[s]++;
        }
    }
    atomic_store(&counting, 0);
    CHECK_INT_EQ(atomic_load(&n_allocs), 0);
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* Epochs: a STEP of an epoch older than one the stage has seen is dropped unanswered (it was
 * abandoned at its batcher's pause); the same epoch or a newer one runs. A batcher's epoch is the
 * id of its first step after a pause, so it never exceeds the step's own id. */
static void test_stale_epoch(void)
{
    fixture f;
    fx_start(&f);
    sh_proto_step_seq q = {.seq = 9,
                           .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
                           .blocks = {E.blocks[0], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    send_step_epoch(&f, 11, &q, 1, 5);
    const rec *r = wait_rec(&f, 0);
    if (r) {
        CHECK_UINT_EQ(r->step, 11);
    }
    q.seq = 10;
    send_step_epoch(&f, 12, &q, 1, 4); /* older: dropped */
    q.seq = 11;
    send_step_epoch(&f, 13, &q, 1, 5); /* the same epoch: runs */
    r = wait_rec(&f, 1);
    if (r) {
        CHECK_UINT_EQ(r->step, 13);
    }
    q.seq = 12;
    send_step_epoch(&f, 14, &q, 1, 6); /* newer: runs, and 5 is old from now on */
    r = wait_rec(&f, 2);
    if (r) {
        CHECK_UINT_EQ(r->step, 14);
    }
    q.seq = 13;
    send_step_epoch(&f, 15, &q, 1, 5);
    struct timespec ts = {0, 300 * 1000000};
    nanosleep(&ts, NULL);
    CHECK_INT_EQ(atomic_load(&f.sh.n), 3); /* steps 12 and 15 were never answered */
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* The steps a batcher abandoned at a pause that still wait in the stage's queue when the first
 * step after the resume (a newer epoch) arrives are dropped unanswered, not run ahead of it: only
 * the one the worker had started (and, if the loop thread was slow to queue the new step, the next)
 * is answered. Each abandoned step prefills the three prompts, so seven of them take a while. */
static void test_queued_stale(void)
{
    fixture f;
    fx_start(&f);
    sh_proto_step_seq q[N_SEQ];
    for (int s = 0; s < N_SEQ; s++)
        q[s] = (sh_proto_step_seq){.seq = 40 + (uint64_t)s,
                                   .tokens = {E.prompt[s], (uint32_t)E.n_prompt[s]},
                                   .blocks = {E.blocks[s], SEQ_BLOCKS}};
    for (uint64_t step = 41; step <= 47; step++)
        send_step_epoch(&f, step, q, N_SEQ, 41);
    sh_proto_step_seq n = {.seq = 50,
                           .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
                           .blocks = {E.blocks[0], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    send_step_epoch(&f, 50, &n, 1, 50);
    long got = -1;
    for (long k = 0; got < 0 && k < 8; k++) {
        const rec *r = wait_rec(&f, k);
        if (!r)
            break;
        CHECK_INT_EQ(r->status, 0);
        if (r->step == 50)
            got = k;
    }
    if (got < 0)
        SH_FAIL_("step 50 (epoch 50) not answered among the first %ld answers",
                 atomic_load(&f.sh.n));
    else {
        CHECK_INT_EQ(f.sh.r[got].tok[0], E.ref[0][0]);
        /* Answered before it: the abandoned step the worker was running, perhaps one more. */
        if (got > 2)
            SH_FAIL_("%ld abandoned steps of epoch 41 answered before step 50 (want <= 2)", got);
    }
    struct timespec ts = {0, 300 * 1000000};
    nanosleep(&ts, NULL);
    CHECK_INT_EQ(atomic_load(&f.sh.n), got + 1); /* none of epoch 41 after it */
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* Issue 25: a STEP whose epoch no batcher could have sent (2^64-1, over its own step id, or with a
 * step id beyond the batcher's clock) is refused and does not raise the stage's epoch: the steps
 * after it still run. */
static void test_forged_epoch(void)
{
    fixture f;
    fx_start(&f);
    sh_proto_step_seq q = {.seq = 20,
                           .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
                           .blocks = {E.blocks[0], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    send_step_epoch(&f, UINT64_MAX, &q, 1, UINT64_MAX); /* a step id far past the clock */
    q.seq = 21;
    send_step_epoch(&f, 30, &q, 1, UINT64_MAX); /* an epoch over its step id */
    q.seq = 22;
    send_step_epoch(&f, 31, &q, 1, 0);
    const rec *r = wait_rec(&f, 0);
    if (r) {
        CHECK_UINT_EQ(r->step, 31);
    }
    struct timespec ts = {0, 300 * 1000000};
    nanosleep(&ts, NULL);
    CHECK_INT_EQ(atomic_load(&f.sh.n), 1); /* the forged two were never answered */
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* ---- speculative steps -------------------------------------------------------------------- */

/* A greedy, sampled entry for sequence `id` in the blocks of prompt b: n tokens at pos, the last
 * `draft` of them drafted, with prompt b as its history. */
static sh_proto_step_seq spec_seq(uint64_t id, int b, const int32_t *toks, uint32_t n, uint32_t pos,
                                  uint32_t draft)
{
    return (sh_proto_step_seq){.seq = id,
                               .tokens = {toks, n},
                               .pos = pos,
                               .blocks = {E.blocks[b], SEQ_BLOCKS},
                               .sample = true,
                               .sampling = greedy(),
                               .history = {E.prompt[b], (uint32_t)E.n_prompt[b]},
                               .draft = draft};
}

/* Checks that entry i of r answers want[0..n): want[0] in tok, the rest in more. */
static void check_answer(const rec *r, uint32_t i, const int32_t *want, uint32_t n)
{
    CHECK_INT_EQ(r->tok[i], want[0]);
    CHECK_UINT_EQ(r->n_more[i], n - 1);
    for (uint32_t j = 1; j < n && j - 1 < r->n_more[i]; j++)
        CHECK_INT_EQ(r->more[i][j - 1], want[j]);
}

/* Checks that two answers to the same step are the same, logprobs bit for bit. */
static void check_same(const rec *a, const rec *b)
{
    CHECK_UINT_EQ(a->n, b->n);
    for (uint32_t i = 0; i < a->n && i < b->n && i < 8; i++) {
        CHECK_INT_EQ(a->tok[i], b->tok[i]);
        CHECK(a->lp[i] == b->lp[i] && a->lp_raw[i] == b->lp_raw[i]);
        CHECK_UINT_EQ(a->n_more[i], b->n_more[i]);
        for (uint32_t j = 0; j < a->n_more[i] && j < b->n_more[i]; j++) {
            CHECK_INT_EQ(a->more[i][j], b->more[i][j]);
            CHECK(a->more_lp[i][j] == b->more_lp[i][j] && a->more_lr[i][j] == b->more_lr[i][j]);
        }
    }
}

/* Sends a step and waits for its answer, record (*k)++; NULL (a failed check) without one, or
 * when it failed and ok says it should not have. */
static const rec *step_rec(fixture *f, uint64_t step, const sh_proto_step_seq *q, uint32_t n,
                           long *k, bool ok)
{
    send_step(f, step, q, n);
    const rec *r = wait_rec(f, (*k)++);
    if (r && ok && (r->status || r->n != n)) {
        SH_FAIL_("step %llu: status %d: %s", (unsigned long long)step, (int)r->status, r->msg);
        return NULL;
    }
    /* Each answer says how many drafts its sequence carried (the batcher's count of what a
     * drafter appended). */
    for (uint32_t i = 0; r && ok && i < n && i < 8; i++) {
        CHECK_UINT_EQ(r->seq[i], q[i].seq);
        CHECK_UINT_EQ(r->drafted[i], q[i].draft);
    }
    return r;
}

/* Greedy drafts: the stage's answers are the tokens of the sequence run alone, whichever draft
 * is wrong; the same step again answers the same; bad drafts are refused with the sequence
 * named, and the stage goes on serving. */
static void test_spec_greedy(void)
{
    fixture f;
    fx_start(&f);
    long k = 0;
    const int32_t *g0 = E.ref[0], *g1 = E.ref[1], *g2 = E.ref[2];
    uint32_t np0 = (uint32_t)E.n_prompt[0], np1 = (uint32_t)E.n_prompt[1],
             np2 = (uint32_t)E.n_prompt[2];
    sh_proto_step_seq q[5];
    q[0] = spec_seq(300, 0, E.prompt[0], np0, 0, 0);
    q[1] = spec_seq(301, 1, E.prompt[1], np1, 0, 0);
    const rec *r = step_rec(&f, 1, q, 2, &k, true);
    if (r) {
        check_answer(r, 0, g0, 1);
        check_answer(r, 1, g1, 1);
    }
    /* A plain prefill first (its row of logits comes before the drafted ones); 300's drafts are
     * its greedy continuation: all accepted, then the target's next token; 301's third draft is
     * wrong: two accepted, then the target's own token in its place. */
    int32_t wrong1[5] = {g1[0], g1[1], g1[2], (g1[3] + 1) % E.n_vocab, g1[4]};
    q[0] = spec_seq(302, 2, E.prompt[2], np2, 0, 0);
    q[1] = spec_seq(300, 0, g0, 4, np0, 3);
    q[2] = spec_seq(301, 1, wrong1, 5, np1, 4);
    r = step_rec(&f, 2, q, 3, &k, true);
    if (r) {
        check_answer(r, 0, g2, 1);
        check_answer(r, 1, g0 + 1, 4);
        check_answer(r, 2, g1 + 1, 3);
        CHECK_NEAR(r->lp_raw[1], E.ref_lps[0][1], 0.05);
        for (int j = 0; j < 3; j++) {
            CHECK_NEAR(r->more_lr[1][j], E.ref_lps[0][2 + j], 0.05);
            CHECK_NEAR(r->more_lp[1][j], r->more_lr[1][j], 1e-4);
        }
    }
    /* 301 goes on from the target's token (the rejected draft's cache row is written over), and
     * the same step sent again (a retry whose answer was lost) gets the same answer. Neither
     * allocates on the stage's threads. */
    q[0] = spec_seq(301, 1, g1 + 3, 2, np1 + 3, 1);
    q[1] = spec_seq(300, 0, g0 + 4, 3, np0 + 4, 2);
    atomic_store(&n_allocs, 0);
    atomic_store_explicit(&counting, 1, memory_order_release);
    const rec *r3 = step_rec(&f, 3, q, 2, &k, true);
    const rec *r4 = step_rec(&f, 4, q, 2, &k, true);
    atomic_store(&counting, 0);
    CHECK_INT_EQ(atomic_load(&n_allocs), 0);
    if (r3 && r4) {
        check_answer(r3, 0, g1 + 4, 2);
        check_answer(r3, 1, g0 + 5, 3);
        check_same(r3, r4);
    }
    q[0] = spec_seq(301, 1, g1 + 5, 4, np1 + 5, 3);
    r = step_rec(&f, 5, q, 1, &k, true);
    if (r)
        check_answer(r, 0, g1 + 6, 4);

    /* Bad drafts: as many drafts as tokens, drafts on a sequence that does not sample, drafts
     * with top logprobs, and 5 sequences of 16 drafts (85 rows of logits of the context's 72). */
    for (int bad = 0; bad < 4; bad++) {
        uint32_t n = 1;
        q[0] = spec_seq(302, 2, g2, 2, np2, 1);
        if (bad == 0)
            q[0].tokens.n = 1;
        if (bad == 1)
            q[0].sample = false;
        if (bad == 2)
            q[0].sampling.n_logprobs = 2;
        int32_t toks[17];
        for (int j = 0; j < 17; j++)
            toks[j] = E.prompt[2][j % E.n_prompt[2]];
        if (bad == 3)
            for (n = 0; n < 5; n++)
                q[n] = spec_seq(310 + n, (int)n % 3, toks, 17, 0, 16);
        r = step_rec(&f, 6 + (uint64_t)bad, q, n, &k, false);
        if (r) {
            CHECK_INT_EQ(r->status, SH_EINVAL);
            CHECK_UINT_EQ(r->n, 0);
            CHECK(strstr(r->msg, bad == 3 ? "85 rows of logits" : "302") != NULL);
            fprintf(stderr, "refused as it should: %s\n", r->msg);
        }
    }
    /* Still serving: 302 drafts its greedy continuation. */
    q[0] = spec_seq(302, 2, g2, 3, np2, 2);
    r = step_rec(&f, 10, q, 1, &k, true);
    if (r)
        check_answer(r, 0, g2 + 1, 3);
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* Sampled drafts (temperature 1, top-k, repetition and frequency penalties, a seed): each row is
 * drawn as a one-token step would draw it and its token taken into the penalty window (once: the
 * frequency penalty would see a token taken twice), so a sequence fed
 * drafts gives exactly the tokens (and logprobs) of one fed one token a step, whichever drafts
 * are wrong. Steps asked again (the same drafts, others, fewer) get the draws already made, and
 * draw anew only past them: the tokens after them stay those of the undisturbed run. */
static void test_spec_sampled(void)
{
    fixture f;
    fx_start(&f);
    long k = 0;
    uint32_t np = (uint32_t)E.n_prompt[0];
    sh_proto_sampling smp = greedy();
    smp.temperature = 1.0f;
    smp.top_k = 40;
    smp.repeat_penalty = 1.3f;
    smp.frequency_penalty = 0.4f; /* counts: a token taken twice would weigh twice */
    smp.seed = 11;
    int32_t p[10];
    float plp[10], plr[10];
    /* The plain run: sequence 500, one token a step. */
    sh_proto_step_seq q = spec_seq(500, 0, E.prompt[0], np, 0, 0);
    q.sampling = smp;
    for (int g = 0; g < 10; g++) {
        const rec *r = step_rec(&f, 1 + (uint64_t)g, &q, 1, &k, true);
        if (!r) {
            rt_finish(&f.t);
            return;
        }
        p[g] = r->tok[0];
        plp[g] = r->lp[0];
        plr[g] = r->lp_raw[0];
        CHECK_UINT_EQ(r->n_more[0], 0);
        q = spec_seq(500, 0, &p[g], 1, np + (uint32_t)g, 0);
        q.sampling = smp;
    }
    /* The speculative run: sequence 501, in other blocks. Each step: its tokens (from p, or x
     * with a wrong draft), their position, drafts, and the run of p it must answer. */
    int32_t x[3] = {p[3], p[4], (p[5] + 1) % E.n_vocab};
    const struct {
        const int32_t *toks;
        uint32_t n, pos, draft;
        int from, count;
    } steps[] = {
        {E.prompt[0], np, 0, 0, 0, 1}, /* the prefill */
        {p, 3, np, 2, 1, 3},           /* p1 p2 drafted: accepted, then p3 */
        {x, 3, np + 3, 2, 4, 2},       /* p4 then a wrong draft: p4, p5 */
        {x, 3, np + 3, 2, 4, 2},       /* the same step again: the same answer */
        {p + 3, 3, np + 3, 2, 4, 3},   /* again with right drafts: p4 p5 given again, p6 drawn */
        {p + 3, 1, np + 3, 0, 4, 1},   /* again without drafts: p4 given again */
        {p + 4, 3, np + 4, 2, 5, 3},   /* p5 p6 given again, p7 drawn */
        {p + 7, 2, np + 7, 1, 8, 2},   /* drawn: p8, p9 */
    };
    const rec *prev = NULL;
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        q = spec_seq(501, 1, steps[i].toks, steps[i].n, steps[i].pos, steps[i].draft);
        q.sampling = smp;
        q.history = (sh_i32s){E.prompt[0], np};
        const rec *r = step_rec(&f, 20 + i, &q, 1, &k, true);
        if (!r)
            break;
        check_answer(r, 0, p + steps[i].from, (uint32_t)steps[i].count);
        CHECK_NEAR(r->lp[0], plp[steps[i].from], 1e-3);
        CHECK_NEAR(r->lp_raw[0], plr[steps[i].from], 1e-3);
        for (uint32_t j = 0; j < r->n_more[0] && j + 1 < (uint32_t)steps[i].count; j++) {
            CHECK_NEAR(r->more_lp[0][j], plp[steps[i].from + 1 + (int)j], 1e-3);
            CHECK_NEAR(r->more_lr[0][j], plr[steps[i].from + 1 + (int)j], 1e-3);
        }
        if (i == 3 && prev)
            check_same(prev, r);
        prev = r;
    }
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
}

/* A tensor-parallel group of 2 stage actors (stories260K split over 2 ranks in this process, over
 * the in-process collective): drafted steps verified through the greedy head (each row's top-1
 * compared with the drafts; plain greedy sampling) and through the gathered logits and the
 * sampler (a logit bias entry turns the greedy head off) give the tokens and logprobs of the
 * group's one-token steps, whichever draft is wrong, and the same step again the same answer. */
#define TP_MODEL "tests/data/stories260K/stories260K.gguf"
static void test_spec_tp(void)
{
    const char *path = sh_test_path(TP_MODEL);
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "skip: %s not found\n", path);
        return;
    }
    sh_error e = {0};
    sh_llama *m[2] = {NULL, NULL};
    sh_backend *be[2] = {NULL, NULL};
    sh_coll_inproc *g = NULL;
    sh_llama_ctx_opts co = {.max_tokens = 64,
                            .max_seqs = 4,
                            .max_logits = sh_stage_max_logits(4, 64),
                            .kv_tokens = 64 * SH_KV_BLOCK_TOKENS};
    sh_backend_cpu_opts bo = {.n_threads = 1};
    bool ok = true;
    for (int r = 0; r < 2 && ok; r++) {
        sh_llama_load_opts lo = {.tp_rank = r, .tp_size = 2};
        ok = !sh_llama_load(path, &lo, &m[r], &e) && !sh_backend_cpu_create(&bo, &be[r], &e);
    }
    size_t need = ok ? sh_llama_tp_coll_bytes(m[0], &co) : 0;
    need = need > 4096 ? need : 4096;
    ok = ok && !sh_coll_inproc_create(2, need, &g, &e);
    if (!ok) {
        SH_FAIL_("tp: %s", e.msg);
        goto out;
    }
    sh_coll_opts copts = {.timeout_ms = 20000, .max_bytes = need, .inproc = g};
    fixture f;
    memset(&f, 0, sizeof f);
    rt_start(&f.t, 6, 3, NULL);
    CHECK_OK(sh_runtime_register(f.t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(f.t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(f.t.rt, "collector", &f.sh, 0, &f.coll, NULL));
    /* Actor ids are handed out in order: rank 1 is spawned first and told the leader's. */
    sh_addr ranks[2] = {sh_addr_make(sh_addr_node(f.coll), sh_addr_actor(f.coll) + 2), 0};
    sh_stage_args a[2];
    for (int r = 1; r >= 0; r--) {
        a[r] = (sh_stage_args){.model = m[r],
                               .max_seqs = 4,
                               .tp_rank = r,
                               .tp_size = 2,
                               .tp_ranks = ranks,
                               .coll_kind = SH_COLL_SHM,
                               .coll = &copts,
                               .be = be[r],
                               .ctx_opts = &co,
                               .n_blocks = 64};
        sh_addr at = 0;
        CHECK_OK(sh_actor_spawn(f.t.rt, "stage", &a[r], 1 + r, &at, NULL));
        if (r == 1)
            ranks[1] = at;
        else
            f.stage = at;
    }
    CHECK_UINT_EQ(f.stage, ranks[0]);
    long k = 0;
    int32_t prompt[4] = {1, 400, 300, 270}, blk[3][8];
    for (int s = 0; s < 3; s++)
        for (int j = 0; j < 8; j++)
            blk[s][j] = 8 * s + j;
    sh_proto_sampling biased = greedy();
    sh_proto_logit_bias zero = {.id = 0, .bias = 0.0f};
    biased.bias = (sh_proto_logit_bias_list){&zero, 1};
    /* The plain run: sequence 800, one token a step, through the greedy head. */
    int32_t t[12];
    float lp[12];
    sh_proto_step_seq q = {.seq = 800,
                           .tokens = {prompt, 4},
                           .blocks = {blk[0], 8},
                           .sample = true,
                           .sampling = greedy()};
    for (int j = 0; j < 12 && ok; j++) {
        const rec *r = step_rec(&f, 1 + (uint64_t)j, &q, 1, &k, true);
        ok = r != NULL;
        t[j] = ok ? r->tok[0] : -1;
        lp[j] = ok ? r->lp[0] : 0.0f;
        q.tokens = (sh_i32s){&t[j], 1};
        q.pos = 4 + (uint32_t)j;
    }
    /* Drafted runs: 801 through the greedy head, 802 through the gathered logits. */
    int32_t x[3] = {t[5], t[6], (t[7] + 1) % m[0]->hp.n_vocab};
    const struct {
        const int32_t *toks;
        uint32_t n, pos, draft;
        int from, count;
    } steps[] = {
        {prompt, 4, 0, 0, 0, 1}, /* the prefill */
        {t, 5, 4, 4, 1, 5},      /* 4 drafts accepted, then t5 */
        {x, 3, 9, 2, 6, 2},      /* t6, then a wrong draft: t7 */
        {x, 3, 9, 2, 6, 2},      /* the same step again */
        {t + 7, 3, 11, 2, 8, 3}, /* t8 t9 accepted, then t10 */
    };
    for (int s = 1; s < 3 && ok; s++) {
        const rec *prev = NULL;
        for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
            q = (sh_proto_step_seq){.seq = 800 + (uint64_t)s,
                                    .tokens = {steps[i].toks, steps[i].n},
                                    .pos = steps[i].pos,
                                    .blocks = {blk[s], 8},
                                    .sample = true,
                                    .sampling = s == 1 ? greedy() : biased,
                                    .draft = steps[i].draft};
            const rec *r = step_rec(&f, 100 * (uint64_t)s + i, &q, 1, &k, true);
            if (!r)
                break;
            check_answer(r, 0, t + steps[i].from, (uint32_t)steps[i].count);
            CHECK_NEAR(r->lp[0], lp[steps[i].from], 1e-4);
            for (uint32_t j = 0; j < r->n_more[0] && j + 1 < (uint32_t)steps[i].count; j++) {
                CHECK_NEAR(r->more_lp[0][j], lp[steps[i].from + 1 + (int)j], 1e-4);
                CHECK_NEAR(r->more_lr[0][j], r->more_lp[0][j], 1e-4);
            }
            if (i == 3 && prev)
                check_same(prev, r);
            prev = r;
        }
    }
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    rt_finish(&f.t);
out:
    sh_coll_inproc_destroy(g);
    for (int r = 0; r < 2; r++) {
        sh_backend_destroy(be[r]);
        sh_llama_destroy(m[r]);
    }
}

/* Constrained decoding at the sampling stage (actors/stage_grammar.h): a greedy sequence whose
 * grammar refuses the model's first choice (" Paris" after "The capital of France is") is steered
 * token by token into " Berlin", then an end token; a fresh sequence whose step carries the
 * generated tokens (a stage without its matcher: a restart, a failover) replays them and answers
 * what the first did; a bad grammar or a generated token outside the grammar fails its step and
 * the stage goes on. */
static void test_grammar(void)
{
    static const char gram[] = "root ::= \" Berlin\"";
    static const char want[] = " Berlin";
    sh_tokenizer *tok = NULL;
    sh_error e = {0};
    CHECK_OK(sh_tokenizer_create_gguf(E.m->gguf, &tok, &e));
    if (!tok)
        return;
    fixture f;
    fx_start(&f);
    int32_t toks[MAX_PROMPT + 16];
    int32_t n = E.n_prompt[0];
    memcpy(toks, E.prompt[0], (size_t)n * sizeof *toks);
    int32_t gen[16], n_gen = 0;
    char text[64] = "";
    long k = 0;
    bool ended = false;
    for (int step = 0; step < 12 && !ended; step++) {
        sh_proto_step_seq q = {.seq = 300,
                               .tokens = {n_gen ? &toks[n - 1] : toks, n_gen ? 1u : (uint32_t)n},
                               .pos = n_gen ? (uint32_t)(n - 1) : 0,
                               .blocks = {E.blocks[0], SEQ_BLOCKS},
                               .sample = true,
                               .sampling = greedy(),
                               .n_gen = (uint32_t)n_gen};
        // As the batcher sends it: the text on the first step, its hash on the later ones.
        if (step == 0)
            q.sampling.grammar = (sh_strv){gram, sizeof gram - 1};
        else
            q.gram_hash = sh__sgram_text_hash((sh_strv){gram, sizeof gram - 1});
        send_step(&f, 100 + (uint64_t)step, &q, 1);
        const rec *r = wait_rec(&f, k++);
        if (!r || r->status != 0 || r->sst[0] != 0) {
            SH_FAIL_("grammar step %d: %s%s", step, r ? r->msg : "none", r ? r->smsg[0] : "");
            break;
        }
        int32_t t = r->tok[0];
        if (step == 0)
            CHECK(t != E.ref[0][0]); /* the unconstrained greedy pick is refused */
        if (sh_tokenizer_is_eog(tok, t)) {
            ended = true;
            break;
        }
        char piece[64];
        size_t len = 0;
        CHECK_OK(sh_tokenizer_decode(tok, &t, 1, 0, piece, sizeof piece, &len, &e));
        CHECK(strlen(text) + len < sizeof text);
        strncat(text, piece, len);
        CHECK(strncmp(text, want, strlen(text)) == 0);
        gen[n_gen++] = t;
        toks[n++] = t;
    }
    CHECK(ended);
    CHECK_STR_EQ(text, want);
    /* A fresh sequence given prompt + the first generated token at once, with gen: the stage
     * replays gen into a new matcher and answers the second token as the first sequence did. */
    if (n_gen >= 2) {
        sh_proto_step_seq q = {.seq = 301,
                               .tokens = {toks, (uint32_t)(E.n_prompt[0] + 1)},
                               .blocks = {E.blocks[1], SEQ_BLOCKS},
                               .sample = true,
                               .sampling = greedy(),
                               .gen = {gen, 1}};
        q.sampling.grammar = (sh_strv){gram, sizeof gram - 1};
        send_step(&f, 200, &q, 1);
        const rec *r = wait_rec(&f, k++);
        if (r) {
            CHECK_INT_EQ(r->status, 0);
            CHECK_INT_EQ(r->tok[0], gen[1]);
        }
    }
    /* A grammar that does not parse, then a generated token the grammar refuses: each step fails
     * naming the problem, and a good step runs after them. */
    static const char bad[] = "root ::= [a-";
    int32_t wrong = E.ref[0][0];
    sh_proto_step_seq q = {.seq = 302,
                           .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
                           .blocks = {E.blocks[2], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    q.sampling.grammar = (sh_strv){bad, sizeof bad - 1};
    send_step(&f, 300, &q, 1);
    const rec *r = wait_rec(&f, k++);
    if (r) {
        CHECK_INT_EQ(r->status, 0); /* the sequence fails, not the step */
        CHECK(r->sst[0] != 0);
        CHECK(strstr(r->smsg[0], "column") != NULL);
    }
    q.seq = 303;
    q.sampling.grammar = (sh_strv){gram, sizeof gram - 1};
    q.gen = (sh_i32s){&wrong, 1};
    send_step(&f, 301, &q, 1);
    r = wait_rec(&f, k++);
    if (r) {
        CHECK_INT_EQ(r->status, 0);
        CHECK(r->sst[0] != 0);
        CHECK(strstr(r->smsg[0], "outside its grammar") != NULL);
    }
    q.seq = 304;
    q.gen = (sh_i32s){0};
    send_step(&f, 302, &q, 1);
    r = wait_rec(&f, k++);
    if (r) {
        CHECK_INT_EQ(r->status, 0);
        CHECK_INT_EQ(r->sst[0], 0);
        CHECK(r->tok[0] != E.ref[0][0]);
    }
    /* One step, three sequences: a grammar whose parse stacks double at every word, replaying
     * 20 generated words (its matcher passes its bounds: that sequence fails alone, naming the
     * limit), one that names its grammar by hash after generated tokens the stage never saw
     * (SH_ENOTFOUND: the batcher would send the text again), and a plain greedy one, which
     * answers the token it gives alone. */
    static const char blow[] = "root ::= w a\n"
                               "a ::= \" \" w a \"b\" | \" \" w a \"c\" | \"\\x01\"\n"
                               "w ::= [a-zA-Z]+";
    static const char words[] = "Once upon a time there was a little dragon who lived in a big "
                                "cave far away from the town and";
    int32_t wt[64];
    size_t nw = 0;
    CHECK_OK(sh_tokenizer_encode(tok, words, strlen(words), 0, wt, 64, &nw, &e));
    sh_proto_step_seq three[3] = {
        {.seq = 305,
         .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
         .blocks = {E.blocks[0], SEQ_BLOCKS},
         .sample = true,
         .sampling = greedy(),
         .gen = {wt, (uint32_t)nw},
         .n_gen = (uint32_t)nw},
        {.seq = 306,
         .tokens = {E.prompt[1], (uint32_t)E.n_prompt[1]},
         .blocks = {E.blocks[1], SEQ_BLOCKS},
         .sample = true,
         .sampling = greedy(),
         .gram_hash = sh__sgram_text_hash((sh_strv){gram, sizeof gram - 1}),
         .n_gen = 3},
        {.seq = 307,
         .tokens = {E.prompt[2], (uint32_t)E.n_prompt[2]},
         .blocks = {E.blocks[2], SEQ_BLOCKS},
         .sample = true,
         .sampling = greedy()},
    };
    three[0].sampling.grammar = (sh_strv){blow, sizeof blow - 1};
    send_step(&f, 303, three, 3);
    r = wait_rec(&f, k++);
    if (r) {
        CHECK_INT_EQ(r->status, 0);
        CHECK_UINT_EQ(r->n, 3);
        CHECK_INT_EQ(r->sst[0], SH_ERANGE);
        if (!strstr(r->smsg[0], "grammar limit hit"))
            SH_FAIL_("sequence 305: %s", r->smsg[0]);
        CHECK_INT_EQ(r->tok[0], -1);
        CHECK_INT_EQ(r->sst[1], SH_ENOTFOUND);
        CHECK_INT_EQ(r->sst[2], 0);
        CHECK_INT_EQ(r->tok[2], E.ref[2][0]);
    }
    /* The grammar is in the stage's cache: a new sequence before its first token may name it
     * by hash alone. */
    sh_proto_step_seq h0 = {.seq = 308,
                            .tokens = {E.prompt[0], (uint32_t)E.n_prompt[0]},
                            .blocks = {E.blocks[1], SEQ_BLOCKS},
                            .sample = true,
                            .sampling = greedy(),
                            .gram_hash = sh__sgram_text_hash((sh_strv){gram, sizeof gram - 1})};
    send_step(&f, 304, &h0, 1);
    r = wait_rec(&f, k++);
    if (r) {
        CHECK_INT_EQ(r->status, 0);
        CHECK_INT_EQ(r->sst[0], 0);
        CHECK_INT_EQ(r->tok[0], gen[0]);
    }
    rt_finish(&f.t);
    CHECK_INT_EQ(atomic_load(&f.sh.bad), 0);
    sh_tokenizer_destroy(tok);
}

static const sh_test_case tests[] = {
    {"stale_epoch", test_stale_epoch},
    {"forged_epoch", test_forged_epoch},
    {"queued_stale", test_queued_stale},
    {"batched_equals_alone", test_batched_equals_alone},
    {"decode_no_alloc", test_decode_no_alloc},
    {"stop_with_queue", test_stop_with_queue},
    {"spec_greedy", test_spec_greedy},
    {"spec_sampled", test_spec_sampled},
    {"spec_tp", test_spec_tp},
    {"grammar", test_grammar},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    main_thread = pthread_self();
    if (access(sh_test_path(MODEL), R_OK) != 0) {
        fprintf(stderr, "skip: %s not found\n", sh_test_path(MODEL));
        return SH_TEST_SKIP;
    }
    if (!env_open()) {
        env_close();
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    env_close();
    return rc;
}
