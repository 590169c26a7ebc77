/* Pipeline stages over runtime messages: 2 and 3 stage actors, each with its own sh_llama loaded
 * for its layer range, its own backend and its own KV pool, joined by ACT, in one process and in
 * separate processes over ipc:// (shoal_test_stage_node children, tests/integration/stage_node.c).
 * For stories260K and the default model, four sequences batched in every step (one prefilled in
 * two chunks) give the same greedy tokens, and logprobs, as the single-stage stage, token for
 * token;
 * decode steps through a pipeline allocate nothing; every failure (a bad ACT, a STEP or ACT sent
 * to the wrong stage, a later stage refusing the step, an undecodable ACT, a next stage nobody
 * receives, an I8 ACT with the wrong number of row scales) reaches the batcher's address as a
 * failed STEP_DONE, and the pipeline goes on. With F16 and INT8 links (link_dtype) the greedy
 * tokens' agreement with the single stage is measured, printed and held to a floor, and the ACT
 * bytes per link are half (F16) and a quarter plus the row scales (INT8) of F32's. Speculative
 * steps through 3 stages verify drafts into the single stage's greedy tokens (the middle stage
 * carries the draft counts on). Embedding sequences (step_seq.embed) pool the same through 3
 * stages as through one. Skips (77) when neither model is present. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "runtime/mpack_write.h"
#include "runtime/msg.h"
#include "runtime/proto.h"
#include "test_proc_util.h"
#include "unit/test_runtime_util.h"

#define N_SEQ 4
#define N_GEN 64
#define MAX_PROMPT 48
#define SEQ_BLOCKS 8 /* blocks per sequence: 128 positions */
#define MAX_STAGES 3
#define MAX_RECS 256
#define EMB_KEEP 16

static const char *const prompts[N_SEQ] = {
    "Once upon a time, there was a little girl named",
    "The capital of France is",
    "Tom and his dog went to the park. They saw a big",
    "Here is a short list of colours: red, green,",
};

/* One model: its prompts and the single-stage stage's outputs, the reference. */
typedef struct model_env {
    const char *path;
    int32_t n_layers, dim, n_vocab;
    int32_t prompt[N_SEQ][MAX_PROMPT];
    int32_t n_prompt[N_SEQ];
    int32_t ref[N_SEQ][N_GEN];
    float ref_lp[N_SEQ][N_GEN];
    bool have_ref;
} model_env;

static model_env models[2] = {
    {.path = "tests/data/stories260K/stories260K.gguf"},
    {.path = "models/smollm2-135m-instruct-q4_1.gguf"},
};

/* The dtype pipe_start's stages send ACT in, and what the last in-process run of 2 or more stages
 * counted on its first link (shoal_act_bytes_total and shoal_act_hidden_bytes_total). */
static uint32_t link_dtype = SH_PROTO_DTYPE_F32;
static uint64_t link_bytes, link_hidden;

/* In every stage, sequence s owns blocks SEQ_BLOCKS s + 3 .. in reverse order. */
static int32_t blocks[N_SEQ][SEQ_BLOCKS];

/* ---- allocation counting (stage_pipeline.cmake links with --wrap) ------------------------- */

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
static pthread_t main_thread;
static atomic_int counting; /* 1: count allocations on every thread but the test's own */
static _Atomic long n_allocs;

static void count_alloc(void)
{
    if (atomic_load_explicit(&counting, memory_order_acquire) &&
        !pthread_equal(pthread_self(), main_thread))
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

static void *probe_main(void *arg)
{
    void *volatile q = malloc(16);
    free(q);
    return arg;
}

/* The wrapper must be in place, or a zero count proves nothing: one malloc on another thread
 * counts once. */
static bool probe_counting(void)
{
    pthread_t t;
    atomic_store(&n_allocs, 0);
    atomic_store(&counting, 1);
    bool ok = pthread_create(&t, NULL, probe_main, NULL) == 0 && pthread_join(t, NULL) == 0;
    atomic_store(&counting, 0);
    return ok && atomic_load(&n_allocs) >= 1;
}

/* ---- the collector: the batcher's stand-in, records every STEP_DONE ---------------------- */

typedef struct rec {
    uint64_t step, trace, compute_us;
    int32_t status;
    char msg[256];
    uint32_t n;
    uint64_t seq[N_SEQ];
    int32_t tok[N_SEQ];
    float lp[N_SEQ];
    uint32_t drafted[N_SEQ]; /* step_out.drafted: the drafts the last stage saw */
    uint32_t n_more[N_SEQ];  /* a speculative step's tokens after tok, with logprob_raw */
    int32_t more[N_SEQ][SH_PROTO_MAX_DRAFT];
    float more_lr[N_SEQ][SH_PROTO_MAX_DRAFT];
    uint32_t n_emb[N_SEQ]; /* step_out.embd: its length, sum and first EMB_KEEP numbers */
    double emb_sum[N_SEQ];
    float emb[N_SEQ][EMB_KEEP];
} rec;

typedef struct shared {
    _Atomic long n; /* records filled */
    _Atomic long bad;
    rec r[MAX_RECS];
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
    if (h->type != SH_MSG_STEP_DONE || k >= MAX_RECS || sh__act_decode(&st->dec, m, &b, &e)) {
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
    for (uint32_t i = 0; i < d->seqs.n && i < N_SEQ; i++) {
        r->seq[i] = d->seqs.v[i].seq;
        r->tok[i] = d->seqs.v[i].token;
        r->lp[i] = d->seqs.v[i].logprob_raw;
        const sh_proto_step_out *o = &d->seqs.v[i];
        r->drafted[i] = o->drafted;
        r->n_more[i] = o->more.n;
        if (o->more.n != o->more_lp.n || o->more.n != o->more_lp_raw.n)
            atomic_fetch_add(&sh->bad, 1);
        for (uint32_t j = 0; j < o->more.n && j < SH_PROTO_MAX_DRAFT; j++) {
            r->more[i][j] = sh_i32s_at(o->more, j);
            r->more_lr[i][j] = sh_f32s_at(o->more_lp_raw, j);
        }
        r->n_emb[i] = o->embd.n;
        for (uint32_t j = 0; j < o->embd.n; j++) {
            r->emb_sum[i] += sh_f32s_at(o->embd, j);
            if (j < EMB_KEEP)
                r->emb[i][j] = sh_f32s_at(o->embd, j);
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

/* ---- a pipeline: P stages in one runtime ------------------------------------------------- */

typedef struct stage_res {
    sh_llama *m;
    sh_backend *be;
    sh_llama_ctx *c;
    sh_stage_args args;
} stage_res;

typedef struct pline {
    test_rt t;
    shared sh;
    int n; /* stages */
    stage_res st[MAX_STAGES];
    sh_addr coll, stage[MAX_STAGES];
    long k; /* records consumed */
    /* Separate processes: stages 1.. run in children (node i + 1); this node listens here. */
    sh_transport *tp;
    char dir[64], url[MAX_STAGES][128];
    child kids[MAX_STAGES];
    int n_kids;
} pline;

/* Loads stage i of `cuts` (layer boundaries: cuts[0] = 0 < ... < cuts[n] = n_layers): its model
 * range, a 2-thread backend and a context with a 4096-position pool. */
static bool stage_load(stage_res *r, const model_env *me, int32_t first, int32_t last)
{
    sh_error e = {0};
    sh_llama_load_opts lo = {.first = first, .last = last};
    sh_backend_cpu_opts bo = {.n_threads = 2};
    sh_llama_ctx_opts co = {.max_tokens = 256,
                            .max_seqs = 8,
                            .max_logits = sh_stage_max_logits(8, 256),
                            .kv_tokens = 4096};
    if (sh_llama_load(sh_test_path(me->path), &lo, &r->m, &e) ||
        sh_backend_cpu_create(&bo, &r->be, &e) ||
        sh_llama_ctx_create(r->m, r->be, &co, &r->c, &e)) {
        SH_FAIL_("stage [%d, %d) of %s: %s", (int)first, (int)last, me->path, e.msg);
        return false;
    }
    CHECK_INT_EQ(r->m->first, first);
    CHECK_INT_EQ(r->m->last, last);
    r->args = (sh_stage_args){.model = r->m, .ctx = r->c, .max_seqs = 8};
    return true;
}

static void stage_free(stage_res *r)
{
    sh_llama_ctx_destroy(r->c);
    sh_backend_destroy(r->be);
    sh_llama_destroy(r->m);
    memset(r, 0, sizeof *r);
}

/* Starts a runtime with the collector and n stages over cuts (spawned last first, so each knows
 * its next); max_seqs[i] > 0 overrides stage i's. Every stage's failures without a reply address
 * go to the collector. */
/* Separate processes: this node (1) holds the collector and stage 0, child i (node i + 1) holds
 * stage i, started last first so each is told its next stage's address. */
static bool pipe_start_procs(pline *p, const model_env *me, int n, const int32_t *cuts)
{
    memset(p, 0, sizeof *p);
    p->n = 1;
    if (!stage_load(&p->st[0], me, cuts[0], cuts[1]))
        return false;
    tmpdir_make(p->dir, sizeof p->dir);
    for (int i = 0; i < n; i++)
        snprintf(p->url[i], sizeof p->url[i], "ipc://%s/n%d", p->dir, i + 1);
    rt_start(&p->t, 1, 2, NULL);
    CHECK_OK(sh_runtime_register(p->t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(p->t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(p->t.rt, "collector", &p->sh, 0, &p->coll, NULL));
    sh_transport_opts o = {.listen_url = p->url[0], .reconnect_max_ms = 100};
    sh_err err = sh_transport_create(p->t.rt, &o, &p->tp, NULL);
    CHECK_OK(err);
    if (err)
        return false;
    const char *path = sh_test_path(me->path);
    for (int i = n - 1; i >= 1; i--) {
        char nid[16], first[16], last[16], next[32], home[160], peer[160];
        snprintf(nid, sizeof nid, "%d", i + 1);
        snprintf(first, sizeof first, "%d", (int)cuts[i]);
        snprintf(last, sizeof last, "%d", (int)cuts[i + 1]);
        snprintf(next, sizeof next, "%llu",
                 (unsigned long long)(i + 1 < n ? p->kids[i + 1].echo : SH_ADDR_NONE));
        snprintf(home, sizeof home, "1=%s", p->url[0]);
        snprintf(peer, sizeof peer, "%d=%s", i + 2, i + 1 < n ? p->url[i + 1] : "");
        /* 16 entries: child_start reads up to 15 before it stops at the NULL. */
        const char *args[16] = {nid,  p->url[i], path, first,
                                last, next,      home, i + 1 < n ? peer : NULL};
        if (child_start(&p->kids[i], args) != 0) {
            SH_FAIL_("stage node %d did not start", i + 1);
            return false;
        }
        p->n_kids++;
        p->stage[i] = p->kids[i].echo;
    }
    CHECK_OK(sh_transport_peer_add(p->tp, 2, p->url[1], NULL));
    p->st[0].args.next = p->stage[1];
    p->st[0].args.batcher = p->coll;
    err = sh_actor_spawn(p->t.rt, "stage", &p->st[0].args, 1, &p->stage[0], NULL);
    CHECK_OK(err);
    return err == SH_OK;
}

static bool pipe_start(pline *p, const model_env *me, int n, const int32_t *cuts,
                       const int32_t *max_seqs)
{
    memset(p, 0, sizeof *p);
    p->n = n;
    for (int i = 0; i < n; i++)
        if (!stage_load(&p->st[i], me, cuts[i], cuts[i + 1]))
            return false;
    for (int i = 1; i < n; i++)
        CHECK_INT_EQ(sh_llama_ctx_n_blocks(p->st[i].c), sh_llama_ctx_n_blocks(p->st[0].c));
    rt_start(&p->t, 7, (uint32_t)n + 1, NULL);
    CHECK_OK(sh_runtime_register(p->t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(p->t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(p->t.rt, "collector", &p->sh, 0, &p->coll, NULL));
    for (int i = n - 1; i >= 0; i--) {
        p->st[i].args.next = i + 1 < n ? p->stage[i + 1] : SH_ADDR_NONE;
        p->st[i].args.batcher = p->coll;
        p->st[i].args.link_dtype = link_dtype;
        if (max_seqs && max_seqs[i] > 0)
            p->st[i].args.max_seqs = max_seqs[i];
        sh_err err = sh_actor_spawn(p->t.rt, "stage", &p->st[i].args, i + 1, &p->stage[i], NULL);
        CHECK_OK(err);
        if (err)
            return false;
    }
    return true;
}

static void pipe_finish(pline *p)
{
    for (int i = MAX_STAGES - 1; i >= 1; i--)
        if (p->kids[i].pid > 0)
            CHECK_INT_EQ(child_stop(&p->kids[i]), 0);
    if (p->tp)
        sh_transport_close(p->tp);
    if (p->t.rt)
        rt_finish(&p->t);
    sh_transport_destroy(p->tp);
    if (p->dir[0]) {
        for (int i = 0; i < MAX_STAGES; i++)
            if (p->url[i][0])
                unlink(p->url[i] + 6);
        tmpdir_remove(p->dir);
    }
    CHECK_INT_EQ(atomic_load(&p->sh.bad), 0);
    for (int i = 0; i < p->n; i++)
        stage_free(&p->st[i]);
}

static sh_proto_sampling greedy(void)
{
    return (sh_proto_sampling){.temperature = 0.0f,
                               .top_p = 1.0f,
                               .repeat_penalty = 1.0f,
                               .penalty_last_n = 64,
                               .max_tokens = N_GEN};
}

/* Sends a STEP from the collector to stage `to` with trace id 1000 + step. */
static void send_step(pline *p, int to, uint64_t step, const sh_proto_step_seq *seqs, uint32_t n)
{
    sh_proto_step body = {.step = step, .seqs = {seqs, n}};
    sh_msg_hdr h = {
        .type = SH_MSG_STEP, .src = p->coll, .dst = p->stage[to], .trace_id = 1000 + step};
    sh_error e = {0};
    if (sh_send_with(p->t.rt, &h, sh__proto_encode, &body, &e))
        SH_FAIL_("send STEP %llu: %s", (unsigned long long)step, e.msg);
}

/* Sends an ACT from the collector to stage `to` (reply_to the collector). */
static void send_act(pline *p, int to, const sh_proto_act *a)
{
    sh_msg_hdr h = {.type = SH_MSG_ACT,
                    .session = a->step,
                    .src = p->coll,
                    .dst = p->stage[to],
                    .trace_id = 1000 + a->step};
    sh_error e = {0};
    if (sh_send_with(p->t.rt, &h, sh__proto_encode, a, &e))
        SH_FAIL_("send ACT %llu: %s", (unsigned long long)a->step, e.msg);
}

/* Waits for the next record (NULL after a failed check). */
static const rec *next_rec(pline *p)
{
    long k = p->k;
    if (!wait_ge(&p->sh.n, k + 1, sh_test_ms(120000))) {
        SH_FAIL_("no STEP_DONE #%ld", k);
        return NULL;
    }
    p->k++;
    return &p->sh.r[k];
}

/* ---- greedy runs --------------------------------------------------------------------------- */

typedef struct seq_run {
    int32_t fed, ngen;
    int32_t gen[N_GEN];
    float lp[N_GEN];
} seq_run;

/* The next STEP entry of each unfinished sequence: its prompt (sequence 2 in two chunks, the
 * first not sampled), then its last token. Returns the count; ids[i] names the sequence. */
static uint32_t build_step(const model_env *me, seq_run *sr, sh_proto_step_seq *q, int *ids)
{
    uint32_t n = 0;
    for (int s = 0; s < N_SEQ; s++) {
        if (sr[s].ngen == N_GEN)
            continue;
        sh_proto_step_seq *x = &q[n];
        *x = (sh_proto_step_seq){.seq = 100 + (uint64_t)s,
                                 .pos = (uint32_t)sr[s].fed,
                                 .blocks = {blocks[s], SEQ_BLOCKS},
                                 .sample = true,
                                 .sampling = greedy(),
                                 .history = {me->prompt[s], (uint32_t)me->n_prompt[s]}};
        if (sr[s].fed < me->n_prompt[s]) {
            int32_t chunk = me->n_prompt[s] - sr[s].fed;
            if (s == 2 && sr[s].fed == 0)
                chunk = me->n_prompt[s] / 2;
            x->tokens = (sh_i32s){me->prompt[s] + sr[s].fed, (uint32_t)chunk};
            x->sample = sr[s].fed + chunk == me->n_prompt[s];
        } else {
            x->tokens = (sh_i32s){&sr[s].gen[sr[s].ngen - 1], 1};
        }
        ids[n++] = s;
    }
    return n;
}

/* Generates N_GEN greedy tokens for every prompt through a pipeline of n stages over cuts. With
 * count_allocs, decode steps from the 6th on must allocate nothing on any thread of the
 * runtime. Fills sr; returns false when the run broke off. */
static bool run_greedy(const model_env *me, int n, const int32_t *cuts, seq_run *sr,
                       bool count_allocs, bool procs)
{
    pline *p = calloc(1, sizeof *p);
    bool ok = p && (procs ? pipe_start_procs(p, me, n, cuts) : pipe_start(p, me, n, cuts, NULL));
    memset(sr, 0, N_SEQ * sizeof *sr);
    sh_proto_step_seq q[N_SEQ];
    int ids[N_SEQ];
    uint64_t step = 1;
    for (; ok; step++) {
        uint32_t ns = build_step(me, sr, q, ids);
        if (ns == 0)
            break;
        if (count_allocs && step == 6) {
            atomic_store(&n_allocs, 0);
            atomic_store_explicit(&counting, 1, memory_order_release);
        }
        send_step(p, 0, step, q, ns);
        const rec *r = next_rec(p);
        if (!r) {
            ok = false;
            break;
        }
        CHECK_UINT_EQ(r->step, step);
        CHECK_UINT_EQ(r->trace, 1000 + step);
        CHECK_INT_EQ(r->status, 0);
        CHECK_UINT_EQ(r->n, ns);
        CHECK(r->compute_us > 0);
        if (r->status || r->n != ns) {
            fprintf(stderr, "step %llu: %s\n", (unsigned long long)step, r->msg);
            ok = false;
            break;
        }
        for (uint32_t i = 0; i < ns; i++) {
            int s = ids[i];
            CHECK_UINT_EQ(r->seq[i], 100 + (uint64_t)s);
            sr[s].fed += (int32_t)q[i].tokens.n;
            if (!q[i].sample) {
                CHECK_INT_EQ(r->tok[i], -1);
                continue;
            }
            CHECK(r->tok[i] >= 0 && r->tok[i] < me->n_vocab);
            sr[s].lp[sr[s].ngen] = r->lp[i];
            sr[s].gen[sr[s].ngen++] = r->tok[i];
        }
    }
    atomic_store(&counting, 0);
    if (ok && !procs && n >= 2) {
        /* Registering the same name and labels again returns the stage's series. */
        const char *dn = link_dtype == SH_PROTO_DTYPE_I8    ? "int8"
                         : link_dtype == SH_PROTO_DTYPE_F16 ? "f16"
                                                            : "f32";
        char labels[64];
        snprintf(labels, sizeof labels, "layer=\"%d\",dtype=\"%s\"", (int)cuts[1], dn);
        sh_counter *cb = NULL, *ch = NULL;
        sh_metrics *mx = sh_runtime_metrics(p->t.rt);
        CHECK_OK(sh_metrics_counter(mx, "shoal_act_bytes_total", "", labels, &cb));
        CHECK_OK(sh_metrics_counter(mx, "shoal_act_hidden_bytes_total", "", labels, &ch));
        link_bytes = cb ? sh_counter_value(cb) : 0;
        link_hidden = ch ? sh_counter_value(ch) : 0;
    }
    if (count_allocs && ok) {
        long a = atomic_load(&n_allocs);
        if (a != 0)
            fprintf(stderr, "%s, %d stages: %ld allocations in %llu decode steps\n", me->path, n, a,
                    (unsigned long long)(step - 6));
        CHECK_INT_EQ(a, 0);
        CHECK(probe_counting());
    }
    if (p)
        pipe_finish(p);
    free(p);
    return ok;
}

/* Loads the whole model once to tokenize the prompts, then records the single-stage stage's
 * tokens. Returns false (after a failed check) when that fails. */
static bool model_ref(model_env *me)
{
    if (me->have_ref)
        return true;
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_tokenizer *tok = NULL;
    if (sh_llama_load(sh_test_path(me->path), NULL, &m, &e) ||
        sh_tokenizer_create_gguf(m->gguf, &tok, &e)) {
        SH_FAIL_("open %s: %s", me->path, e.msg);
        sh_llama_destroy(m);
        return false;
    }
    me->n_layers = m->hp.n_layers;
    me->dim = m->hp.dim;
    me->n_vocab = m->hp.n_vocab;
    uint32_t flags = sh_tokenizer_wants_bos(tok) ? SH_TOKENIZE_ADD_BOS : 0;
    bool ok = true;
    for (int s = 0; s < N_SEQ && ok; s++) {
        size_t n = 0;
        sh_err err = sh_tokenizer_encode(tok, prompts[s], strlen(prompts[s]), flags, me->prompt[s],
                                         MAX_PROMPT, &n, &e);
        CHECK_OK(err);
        me->n_prompt[s] = (int32_t)n;
        ok = !err && n >= 4;
    }
    sh_tokenizer_destroy(tok);
    sh_llama_destroy(m);
    CHECK(me->n_layers >= 3);
    if (!ok || me->n_layers < 3)
        return false;
    seq_run sr[N_SEQ];
    int32_t whole[2] = {0, me->n_layers};
    if (!run_greedy(me, 1, whole, sr, false, false))
        return false;
    for (int s = 0; s < N_SEQ; s++) {
        memcpy(me->ref[s], sr[s].gen, sizeof me->ref[s]);
        memcpy(me->ref_lp[s], sr[s].lp, sizeof me->ref_lp[s]);
    }
    me->have_ref = true;
    return true;
}

/* Runs n stages over cuts and compares every token with the single stage's. */
static void check_pipeline(model_env *me, int n, const int32_t *cuts, bool count_allocs, bool procs)
{
    if (!model_ref(me))
        return;
    seq_run sr[N_SEQ];
    if (!run_greedy(me, n, cuts, sr, count_allocs, procs))
        return;
    int same = 0;
    float max_dlp = 0.0f;
    for (int s = 0; s < N_SEQ; s++) {
        for (int g = 0; g < N_GEN; g++) {
            if (sr[s].gen[g] == me->ref[s][g])
                same++;
            float d = fabsf(sr[s].lp[g] - me->ref_lp[s][g]);
            max_dlp = d > max_dlp ? d : max_dlp;
        }
        for (int g = 0; g < N_GEN; g++) {
            if (sr[s].gen[g] != me->ref[s][g]) {
                SH_FAIL_("%s, %d stages: sequence %d differs at token %d: %d, single stage %d",
                         me->path, n, s, g, (int)sr[s].gen[g], (int)me->ref[s][g]);
                break;
            }
        }
    }
    char split[64] = "";
    for (int i = 0; i < n; i++)
        snprintf(split + strlen(split), sizeof split - strlen(split), "%s[%d,%d)", i ? " " : "",
                 (int)cuts[i], (int)cuts[i + 1]);
    fprintf(stderr,
            "%s: %d stages %s%s: %d/%d greedy tokens equal the single stage's; largest logprob "
            "difference %.3g\n",
            me->path, n, split, procs ? " in separate processes" : "", same, N_SEQ * N_GEN,
            (double)max_dlp);
    CHECK(max_dlp < 1e-3f);
}

static bool have(const model_env *me) { return access(sh_test_path(me->path), R_OK) == 0; }

#define SKIP_WITHOUT(me)                                                                           \
    do {                                                                                           \
        if (!have(me)) {                                                                           \
            fprintf(stderr, "skip: %s not found\n", (me)->path);                                   \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static void test_stories_2(void)
{
    model_env *me = &models[0];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    int32_t cuts[3] = {0, me->n_layers / 2, me->n_layers};
    check_pipeline(me, 2, cuts, true, false);
}

static void test_stories_3(void)
{
    model_env *me = &models[0];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    int32_t cuts[4] = {0, 1, me->n_layers - 1, me->n_layers};
    check_pipeline(me, 3, cuts, true, false);
}

static void test_smollm2_2(void)
{
    model_env *me = &models[1];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    int32_t cuts[3] = {0, me->n_layers / 2, me->n_layers};
    check_pipeline(me, 2, cuts, false, false);
}

static void test_smollm2_3(void)
{
    model_env *me = &models[1];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    /* Uneven: 7, 16 and the rest of 30 layers. */
    int32_t cuts[4] = {0, 7, 23, me->n_layers};
    check_pipeline(me, 3, cuts, true, false);
}

/* Separate processes over ipc://: 2 and 3 stages of each model. */
static void test_procs(void)
{
    model_env *st = &models[0], *sm = &models[1];
    if (have(st) && model_ref(st)) {
        int32_t c2[3] = {0, 3, st->n_layers};
        check_pipeline(st, 2, c2, false, true);
        int32_t c3[4] = {0, 2, 4, st->n_layers};
        check_pipeline(st, 3, c3, false, true);
    }
    if (have(sm) && model_ref(sm)) {
        int32_t c2[3] = {0, 12, sm->n_layers};
        check_pipeline(sm, 2, c2, false, true);
        int32_t c3[4] = {0, 10, 20, sm->n_layers};
        check_pipeline(sm, 3, c3, false, true);
    }
}

/* ---- narrow links ------------------------------------------------------------------------ */

/* How a run's greedy tokens compare with the single stage's: equal tokens position by position
 * (all, and over each sequence's first 16), tokens before each sequence's first difference, and
 * the largest difference of the chosen token's logprob over those common prefixes (after a
 * difference the contexts differ and logprobs are not comparable). */
typedef struct agreement {
    int same, same16, prefix;
    float max_dlp;
} agreement;

static agreement agree(const model_env *me, const seq_run *sr)
{
    agreement a = {0};
    for (int s = 0; s < N_SEQ; s++) {
        bool diverged = false;
        for (int g = 0; g < N_GEN; g++) {
            bool eq = sr[s].gen[g] == me->ref[s][g];
            a.same += eq;
            a.same16 += eq && g < 16;
            if (!eq)
                diverged = true;
            if (diverged)
                continue;
            a.prefix++;
            float d = fabsf(sr[s].lp[g] - me->ref_lp[s][g]);
            a.max_dlp = d > a.max_dlp ? d : a.max_dlp;
        }
    }
    return a;
}

/* 2 stages split in the middle with F32, F16 and INT8 links: F32 equals the single stage token
 * for token; F16 and INT8 agree with it on at least floor16[k] of the 64 first-16 tokens of the
 * 4 prompts (the floors sit below what was measured at this commit, docs/cluster.md: stories260K
 * F16 64/64, INT8 49/64; smollm2 F16 52/64, INT8 23/64: its middle layers carry one huge
 * activation (about 22000 in the first position's row, rows otherwise about 100 at most with an
 * RMS of 7), which a scale per row cannot keep together with the small values); the hidden bytes
 * on the link are exactly half of F32's (F16) and a quarter plus 4 bytes of scale per row
 * (INT8); decode steps allocate nothing with either. */
static void check_links(model_env *me, const int floor16[3])
{
    if (!model_ref(me))
        return;
    int32_t cuts[3] = {0, me->n_layers / 2, me->n_layers};
    static const uint32_t dts[3] = {SH_PROTO_DTYPE_F32, SH_PROTO_DTYPE_F16, SH_PROTO_DTYPE_I8};
    static const char *const names[3] = {"f32", "f16", "int8"};
    uint64_t bytes[3] = {0}, hidden[3] = {0};
    for (int k = 0; k < 3; k++) {
        seq_run sr[N_SEQ];
        link_dtype = dts[k];
        link_bytes = link_hidden = 0;
        bool ok = run_greedy(me, 2, cuts, sr, k > 0, false);
        link_dtype = SH_PROTO_DTYPE_F32;
        if (!ok)
            return;
        bytes[k] = link_bytes;
        hidden[k] = link_hidden;
        agreement a = agree(me, sr);
        fprintf(stderr,
                "%s: 2 stages [0,%d) [%d,%d), %s link: %d/%d greedy tokens equal the single "
                "stage's (%.1f%%), first 16 of each prompt %d/%d (%.1f%%), %d before the first "
                "difference; largest logprob difference there %.3g; ACT bytes on the link %llu "
                "(hidden rows and scales %llu)\n",
                me->path, (int)cuts[1], (int)cuts[1], (int)cuts[2], names[k], a.same, N_SEQ * N_GEN,
                100.0 * a.same / (N_SEQ * N_GEN), a.same16, N_SEQ * 16,
                100.0 * a.same16 / (N_SEQ * 16), a.prefix, (double)a.max_dlp,
                (unsigned long long)bytes[k], (unsigned long long)hidden[k]);
        if (k == 0)
            CHECK_INT_EQ(a.same, N_SEQ * N_GEN);
        if (a.same16 < floor16[k])
            SH_FAIL_("%s, %s link: %d of the first-16 tokens agree, below the floor %d", me->path,
                     names[k], a.same16, floor16[k]);
        CHECK(hidden[k] > 0 && bytes[k] > hidden[k]);
    }
    uint64_t rows = hidden[0] / (4u * (uint64_t)me->dim);
    CHECK_UINT_EQ(hidden[0], rows * 4u * (uint64_t)me->dim);
    CHECK_UINT_EQ(hidden[1] * 2u, hidden[0]);
    CHECK_UINT_EQ(hidden[2], hidden[0] / 4u + rows * 4u);
    fprintf(stderr,
            "%s: link bytes per hidden row (dim %d): f32 %llu, f16 %llu (%.3f of f32), int8 %llu "
            "(%.3f); whole ACT bodies %.3f and %.3f of f32's\n",
            me->path, (int)me->dim, (unsigned long long)(hidden[0] / rows),
            (unsigned long long)(hidden[1] / rows), (double)hidden[1] / (double)hidden[0],
            (unsigned long long)(hidden[2] / rows), (double)hidden[2] / (double)hidden[0],
            (double)bytes[1] / (double)bytes[0], (double)bytes[2] / (double)bytes[0]);
}

static void test_links(void)
{
    static const int floors[2][3] = {{64, 58, 40}, {64, 40, 12}};
    for (int i = 0; i < 2; i++)
        if (have(&models[i]))
            check_links(&models[i], floors[i]);
}

/* ---- failures ----------------------------------------------------------------------------- */

/* Expects the next record to be a failed STEP_DONE for `step` with `status` and a message
 * containing `needle` (or any when NULL). */
static void expect_fail(pline *p, uint64_t step, int32_t status, const char *needle)
{
    const rec *r = next_rec(p);
    if (!r)
        return;
    CHECK_UINT_EQ(r->step, step);
    CHECK_INT_EQ(r->status, status);
    CHECK_UINT_EQ(r->n, 0);
    if (needle && !strstr(r->msg, needle))
        SH_FAIL_("step %llu: message \"%s\" lacks \"%s\"", (unsigned long long)step, r->msg,
                 needle);
}

/* One good step of sequence 0's prompt: its first token is the single stage's. */
static void expect_good(pline *p, const model_env *me, uint64_t step, uint64_t seq)
{
    sh_proto_step_seq q = {.seq = seq,
                           .tokens = {me->prompt[0], (uint32_t)me->n_prompt[0]},
                           .blocks = {blocks[0], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    send_step(p, 0, step, &q, 1);
    const rec *r = next_rec(p);
    if (!r)
        return;
    CHECK_UINT_EQ(r->step, step);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->n, 1);
    CHECK_INT_EQ(r->tok[0], me->ref[0][0]);
}

/* A 2-stage pipeline whose second stage takes at most 2 sequences per step. */
static void test_failures(void)
{
    model_env *me = &models[0];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    pline *p = calloc(1, sizeof *p);
    int32_t cuts[3] = {0, 2, me->n_layers};
    int32_t max_seqs[2] = {8, 2};
    if (!p || !pipe_start(p, me, 2, cuts, max_seqs)) {
        if (p)
            pipe_finish(p);
        free(p);
        return;
    }
    expect_good(p, me, 1, 500);

    /* Stage 0 accepts 3 sequences, stage 1 refuses them: its failure reaches the collector. */
    sh_proto_step_seq q[3];
    for (int s = 0; s < 3; s++)
        q[s] = (sh_proto_step_seq){.seq = 510 + (uint64_t)s,
                                   .tokens = {me->prompt[s], (uint32_t)me->n_prompt[s]},
                                   .blocks = {blocks[s], SEQ_BLOCKS},
                                   .sample = true,
                                   .sampling = greedy()};
    send_step(p, 0, 2, q, 3);
    expect_fail(p, 2, SH_EINVAL, "at most 2");

    /* ACTs straight to stage 1: hidden states of the wrong width, then of the wrong dtype. */
    uint32_t rows = (uint32_t)me->n_prompt[0];
    float *h = calloc((size_t)rows * (size_t)(me->dim + 1), sizeof *h);
    CHECK(h != NULL);
    if (h) {
        sh_proto_act a = {.step = 3,
                          .seqs = {q, 1},
                          .hidden = {.dtype = SH_PROTO_DTYPE_F32,
                                     .ndim = 2,
                                     .shape = {rows, (uint64_t)me->dim + 1},
                                     .data = h,
                                     .nbytes = (uint64_t)rows * (uint64_t)(me->dim + 1) * 4},
                          .reply_to = p->coll};
        send_act(p, 1, &a);
        expect_fail(p, 3, SH_EINVAL, "hidden states");
        a.step = 4;
        a.hidden.dtype = SH_PROTO_DTYPE_BF16;
        a.hidden.shape[1] = (uint64_t)me->dim;
        a.hidden.nbytes = (uint64_t)rows * (uint64_t)me->dim * 2;
        send_act(p, 1, &a);
        expect_fail(p, 4, SH_EINVAL, "hidden states");
        /* An ACT to the first stage and a STEP to the second: each answered, not run. */
        a.step = 5;
        a.hidden.dtype = SH_PROTO_DTYPE_F32;
        a.hidden.nbytes = (uint64_t)rows * (uint64_t)me->dim * 4;
        send_act(p, 0, &a);
        expect_fail(p, 5, SH_EINVAL, "take STEP");
        free(h);
    }
    send_step(p, 1, 6, q, 1);
    expect_fail(p, 6, SH_EINVAL, "take ACT");

    /* An ACT whose body cannot be decoded: no reply address, so the stage's `batcher` gets it,
     * with the envelope's session as the step. */
    static const uint8_t empty_map = 0x80;
    sh_msg_hdr eh = {.type = SH_MSG_ACT, .session = 7, .src = p->coll, .dst = p->stage[1]};
    CHECK_OK(sh_send(p->t.rt, &eh, &empty_map, 1, NULL));
    expect_fail(p, 7, SH_EPROTO, NULL);

    /* An I8 ACT with one row scale too few: the encoder refuses it, so the frame is a good one
     * with its last field (the scales' bin) cut by 4 bytes. The decoder refuses it and the
     * failure goes to `batcher`. */
    {
        uint32_t rows8 = (uint32_t)me->n_prompt[0];
        size_t n8 = (size_t)rows8 * (size_t)me->dim;
        int8_t *q8 = calloc(n8, 1);
        float *sc = calloc(rows8, sizeof *sc);
        CHECK(q8 && sc && 4 * rows8 < 256);
        if (q8 && sc && 4 * rows8 < 256) {
            sh_proto_act a = {.step = 70,
                              .seqs = {q, 1},
                              .hidden = {.dtype = SH_PROTO_DTYPE_I8,
                                         .ndim = 2,
                                         .shape = {rows8, (uint64_t)me->dim},
                                         .data = q8,
                                         .nbytes = n8},
                              .reply_to = p->coll,
                              .scales = {sc, rows8}};
            sh_msg_hdr ah = {.type = SH_MSG_ACT, .session = 70, .src = p->coll, .dst = p->stage[1]};
            sh_buf fb, eb;
            uint8_t env[64];
            sh__buf_init(&fb);
            sh__buf_init_fixed(&eb, env, sizeof env);
            sh__msg_put_header(&eb, &ah);
            CHECK_OK(sh__proto_encode(&fb, &ah, &a, NULL));
            size_t tail = (size_t)4 * rows8; /* the scales' bytes end the body */
            CHECK(fb.len > eb.len + tail + 2 && fb.data[fb.len - tail - 2] == 0xc4 &&
                  fb.data[fb.len - tail - 1] == tail);
            fb.data[fb.len - tail - 1] = (uint8_t)(tail - 4);
            CHECK_OK(sh_send(p->t.rt, &ah, fb.data + eb.len, fb.len - eb.len - 4, NULL));
            expect_fail(p, 70, SH_EPROTO, "row scales");
            sh__buf_fini(&fb);
        }
        free(q8);
        free(sc);
    }

    /* An empty step is answered by the first stage. */
    send_step(p, 0, 8, NULL, 0);
    const rec *r = next_rec(p);
    if (r) {
        CHECK_UINT_EQ(r->step, 8);
        CHECK_INT_EQ(r->status, 0);
        CHECK_UINT_EQ(r->n, 0);
    }

    /* The pipeline still works. */
    expect_good(p, me, 9, 501);
    pipe_finish(p);
    free(p);
}

/* A first stage whose next stage does not exist: the ACT bounces as an ERROR and the step fails
 * with SH_ENOTFOUND; a stage that is not the last refuses to start without a next address. */
static void test_next_unreachable(void)
{
    model_env *me = &models[0];
    SKIP_WITHOUT(me);
    if (!model_ref(me))
        return;
    pline *p = calloc(1, sizeof *p);
    CHECK(p != NULL);
    if (!p)
        return;
    p->n = 1;
    if (!stage_load(&p->st[0], me, 0, 2)) {
        pipe_finish(p);
        free(p);
        return;
    }
    rt_start(&p->t, 7, 2, NULL);
    CHECK_OK(sh_runtime_register(p->t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(p->t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(p->t.rt, "collector", &p->sh, 0, &p->coll, NULL));
    /* Without a next address the stage's init fails: the actor is gone again. */
    static sh_stage_args no_next;
    no_next = p->st[0].args;
    sh_addr dead = SH_ADDR_NONE;
    CHECK_OK(sh_actor_spawn(p->t.rt, "stage", &no_next, 1, &dead, NULL));
    sh_runtime_stats rs = {0};
    for (int i = 0; i < 500; i++) {
        sh_runtime_stats_get(p->t.rt, &rs);
        if (rs.actors_live == 1)
            break;
        sleep_ms(10);
    }
    CHECK_UINT_EQ(rs.actors_live, 1);
    p->st[0].args.next = sh_addr_make(7, 4242);
    CHECK_OK(sh_actor_spawn(p->t.rt, "stage", &p->st[0].args, 1, &p->stage[0], NULL));
    sh_proto_step_seq q = {.seq = 600,
                           .tokens = {me->prompt[1], (uint32_t)me->n_prompt[1]},
                           .blocks = {blocks[1], SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy()};
    send_step(p, 0, 31, &q, 1);
    expect_fail(p, 31, SH_ENOTFOUND, "next stage");
    send_step(p, 0, 32, &q, 1);
    expect_fail(p, 32, SH_ENOTFOUND, "next stage");
    const rec *r = &p->sh.r[p->k - 1];
    CHECK_UINT_EQ(r->trace, 1032);
    pipe_finish(p);
    free(p);
}

/* Speculative steps through 3 stages in one process: the middle stage carries each sequence's
 * draft count on in its ACT, and the last verifies the drafts into the single stage's greedy
 * tokens (all accepted, or up to a wrong draft); a drafted step is refused by the first stage
 * when its drafts are bad, and by the last when its rows of logits do not fit, and the pipeline
 * goes on. */
static void test_spec(void)
{
    model_env *me = have(&models[1]) ? &models[1] : &models[0];
    if (!model_ref(me))
        return;
    pline *p = calloc(1, sizeof *p);
    int32_t cuts[4] = {0, me->n_layers / 3, 2 * me->n_layers / 3, me->n_layers};
    if (!p || !pipe_start(p, me, 3, cuts, NULL)) {
        if (p)
            pipe_finish(p);
        free(p);
        return;
    }
    const int32_t *g0 = me->ref[0], *g1 = me->ref[1];
    uint32_t np0 = (uint32_t)me->n_prompt[0], np1 = (uint32_t)me->n_prompt[1];
    sh_proto_step_seq q[5];
    for (int s = 0; s < 5; s++)
        q[s] = (sh_proto_step_seq){
            .seq = 700 + (uint64_t)s,
            .blocks = {blocks[s % N_SEQ], SEQ_BLOCKS},
            .sample = true,
            .sampling = greedy(),
            .history = {me->prompt[s % N_SEQ], (uint32_t)me->n_prompt[s % N_SEQ]}};
    q[0].tokens = (sh_i32s){me->prompt[0], np0};
    q[1].tokens = (sh_i32s){me->prompt[1], np1};
    int32_t wrong[4] = {g1[0], g1[1], (g1[2] + 1) % me->n_vocab, g1[3]};
    struct {
        sh_i32s t0, t1;
        uint32_t pos0, pos1, d0, d1;
        int from0, n0, from1, n1;
    } steps[] = {
        {{g0, 5}, {wrong, 4}, np0, np1, 4, 3, 1, 5, 1, 2}, /* all 4 accepted; 1 of 3 */
        {{g0 + 5, 3}, {g1 + 2, 3}, np0 + 5, np1 + 2, 2, 2, 6, 3, 3, 3},
    };
    send_step(p, 0, 1, q, 2);
    const rec *r = next_rec(p);
    if (r && !r->status && r->n == 2) {
        CHECK_INT_EQ(r->tok[0], g0[0]);
        CHECK_INT_EQ(r->tok[1], g1[0]);
    } else {
        SH_FAIL_("step 1: %s", r ? r->msg : "no answer");
    }
    for (int i = 0; i < 2; i++) {
        q[0].tokens = steps[i].t0;
        q[0].pos = steps[i].pos0;
        q[0].draft = steps[i].d0;
        q[1].tokens = steps[i].t1;
        q[1].pos = steps[i].pos1;
        q[1].draft = steps[i].d1;
        send_step(p, 0, 2 + (uint64_t)i, q, 2);
        r = next_rec(p);
        if (!r || r->status || r->n != 2) {
            SH_FAIL_("step %d: %s", 2 + i, r ? r->msg : "no answer");
            break;
        }
        int from[2] = {steps[i].from0, steps[i].from1}, cnt[2] = {steps[i].n0, steps[i].n1};
        CHECK_UINT_EQ(r->drafted[0], steps[i].d0);
        CHECK_UINT_EQ(r->drafted[1], steps[i].d1);
        for (int s = 0; s < 2; s++) {
            CHECK_INT_EQ(r->tok[s], me->ref[s][from[s]]);
            CHECK_NEAR(r->lp[s], me->ref_lp[s][from[s]], 1e-3);
            CHECK_UINT_EQ(r->n_more[s], (uint32_t)cnt[s] - 1);
            for (uint32_t j = 0; j < r->n_more[s] && j + 1 < (uint32_t)cnt[s]; j++) {
                CHECK_INT_EQ(r->more[s][j], me->ref[s][from[s] + 1 + (int)j]);
                CHECK_NEAR(r->more_lr[s][j], me->ref_lp[s][from[s] + 1 + (int)j], 1e-3);
            }
        }
    }
    /* Bad drafts: refused by the first stage; too many rows of logits (5 sequences of 16
     * drafts: 85 of 72): by the last. */
    q[0].tokens = (sh_i32s){g0 + 8, 1};
    q[0].pos = np0 + 8;
    q[0].draft = 1;
    send_step(p, 0, 4, q, 1);
    expect_fail(p, 4, SH_EINVAL, "sequence 700: 1 drafted tokens of 1");
    int32_t toks[17];
    for (int j = 0; j < 17; j++)
        toks[j] = me->prompt[0][j % me->n_prompt[0]];
    for (int s = 0; s < 5; s++) {
        q[s].tokens = (sh_i32s){toks, 17};
        q[s].pos = 0;
        q[s].draft = 16;
    }
    send_step(p, 0, 5, q, 5);
    expect_fail(p, 5, SH_EINVAL, "85 rows of logits");
    /* The pipeline goes on (the refused step wrote the first stages' cache: start afresh). */
    expect_good(p, me, 6, 710);
    pipe_finish(p);
    free(p);
}

/* Embedding sequences (step_seq.embed: 1 mean, 2 CLS, 3 last) beside a sampled one, through one
 * stage and through three: the last stage answers each one's pooled part (step_out.embd, the
 * model's width; none for the sampled one, no token for the others), the same through the
 * pipeline as through the single stage; a mean sequence prefilled in two chunks answers the two
 * chunks' sums, which add up to the whole prompt's. */
static void test_embed(void)
{
    for (int mi = 0; mi < 2; mi++) {
        model_env *me = &models[mi];
        if (!have(me) || !model_ref(me))
            continue;
        rec got[2][2];
        for (int k = 0; k < 2; k++) {
            int n = k == 0 ? 1 : 3;
            int32_t cuts[4] = {0, me->n_layers, 0, 0};
            if (n == 3) {
                cuts[1] = me->n_layers / 3;
                cuts[2] = 2 * me->n_layers / 3;
                cuts[3] = me->n_layers;
            }
            pline *p = calloc(1, sizeof *p);
            if (!p || !pipe_start(p, me, n, cuts, NULL)) {
                if (p)
                    pipe_finish(p);
                free(p);
                return;
            }
            sh_proto_step_seq q[N_SEQ];
            for (int i = 0; i < N_SEQ; i++)
                q[i] = (sh_proto_step_seq){.seq = 800 + (uint64_t)i,
                                           .tokens = {me->prompt[i], (uint32_t)me->n_prompt[i]},
                                           .blocks = {blocks[i], SEQ_BLOCKS},
                                           .sample = i == 3,
                                           .sampling = greedy(),
                                           .embed = (uint8_t)(i < 3 ? i + 1 : 0)};
            send_step(p, 0, 1, q, N_SEQ);
            const rec *r = next_rec(p);
            if (r)
                got[k][0] = *r;
            /* sequence 0 again as 4 more, in two chunks */
            uint32_t half = (uint32_t)me->n_prompt[0] / 2;
            q[0].seq = 900;
            q[0].blocks = (sh_i32s){blocks[1], SEQ_BLOCKS};
            q[0].tokens = (sh_i32s){me->prompt[0], half};
            send_step(p, 0, 2, q, 1);
            r = next_rec(p);
            if (r)
                got[k][1] = *r;
            q[0].tokens = (sh_i32s){me->prompt[0] + half, (uint32_t)me->n_prompt[0] - half};
            q[0].pos = half;
            send_step(p, 0, 3, q, 1);
            r = next_rec(p);
            if (r) {
                CHECK_INT_EQ(r->status, 0);
                CHECK_UINT_EQ(r->n_emb[0], (uint32_t)me->dim);
                got[k][1].emb_sum[0] += r->emb_sum[0];
                for (int j = 0; j < EMB_KEEP; j++)
                    got[k][1].emb[0][j] += r->emb[0][j];
            }
            pipe_finish(p);
            free(p);
        }
        for (int k = 0; k < 2; k++) {
            const rec *r = &got[k][0];
            CHECK_INT_EQ(r->status, 0);
            CHECK_UINT_EQ(r->n, N_SEQ);
            for (int i = 0; i < 3; i++) {
                CHECK_UINT_EQ(r->n_emb[i], (uint32_t)me->dim);
                CHECK_INT_EQ(r->tok[i], -1);
            }
            CHECK_UINT_EQ(r->n_emb[3], 0);
            CHECK_INT_EQ(r->tok[3], me->ref[3][0]);
        }
        fprintf(stderr, "embed: %s: mean part's sum %.6g (1 stage) %.6g (3 stages)\n", me->path,
                got[0][0].emb_sum[0], got[1][0].emb_sum[0]);
        for (int i = 0; i < 3; i++) {
            double scale = i == 0 ? me->n_prompt[0] : 1.0;
            CHECK_NEAR(got[0][0].emb_sum[i], got[1][0].emb_sum[i], 1e-4 * scale);
            for (int j = 0; j < EMB_KEEP; j++)
                CHECK_NEAR(got[0][0].emb[i][j], got[1][0].emb[i][j], 1e-5 * scale);
        }
        /* two chunks' sums: the whole prompt's */
        for (int k = 0; k < 2; k++)
            for (int j = 0; j < EMB_KEEP; j++)
                CHECK_NEAR(got[k][1].emb[0][j], got[k][0].emb[0][j], 1e-5 * me->n_prompt[0]);
    }
}

static const sh_test_case tests[] = {
    {"stories_2", test_stories_2},
    {"stories_3", test_stories_3},
    {"smollm2_2", test_smollm2_2},
    {"smollm2_3", test_smollm2_3},
    {"procs", test_procs},
    {"links", test_links},
    {"failures", test_failures},
    {"next_unreachable", test_next_unreachable},
    {"spec", test_spec},
    {"embed", test_embed},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    main_thread = pthread_self();
    if (!have(&models[0]) && !have(&models[1])) {
        fprintf(stderr, "skip: neither %s nor %s found\n", models[0].path, models[1].path);
        return SH_TEST_SKIP;
    }
    for (int s = 0; s < N_SEQ; s++)
        for (int32_t j = 0; j < SEQ_BLOCKS; j++)
            blocks[s][j] = SEQ_BLOCKS * s + 3 + (SEQ_BLOCKS - 1 - j);
    return sh_test_main(argc, argv, tests);
}
