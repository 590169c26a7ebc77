/* The drafter actor (actors/drafter.c) before a stage actor in a real runtime, on stories260K
 * (llama2.c's greedy ids as the reference): STEPs asking for drafts (step_seq.want_draft) come
 * back as STEP_DONE to their sender with the accepted drafts in `more`, every token the greedy
 * one; a draft model drafting for itself has all its drafts accepted, the target's first 2
 * layers some; a sequence joining past position 0 drafts with its prior tokens; a sequence that
 * asks for top logprobs, or does not ask, gets none; the drafter's time is in compute_us; a step
 * with a token outside the vocabulary goes on without drafts and is refused by the stage. */
#include <stdatomic.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "model/spec.h"
#include "model/spec_draft_batch.h"
#include "model/tokenizer.h"
#include "runtime/proto.h"
#include "unit/test_runtime_util.h"

#define GGUF "tests/data/stories260K/stories260K.gguf"
#define SEQ_BLOCKS 16 /* 256 positions */
#define N_TOK 120     /* tokens each sequence reaches */

static int32_t expected[257]; /* BOS, then llama2.c's greedy ids */

/* ---- the collector: the last STEP_DONE ------------------------------------------------------ */

typedef struct rec {
    int32_t status;
    uint64_t compute_us;
    uint32_t n;
    uint64_t seq[4];
    int32_t tok[4][SH_PROTO_MAX_DRAFT + 1]; /* token, then more */
    uint32_t n_tok[4];
    uint32_t drafted[4]; /* step_out.drafted: the drafts the drafter appended */
} rec;

typedef struct shared {
    _Atomic long n;
    _Atomic long bad;
    rec r;
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
    sh_proto_body b;
    sh_error e = {0};
    if (sh_msg_header(m)->type != SH_MSG_STEP_DONE || sh__act_decode(&st->dec, m, &b, &e)) {
        atomic_fetch_add(&sh->bad, 1);
        return SH_MSG_FATE_DONE;
    }
    const sh_proto_step_done *d = &b.step_done;
    rec *r = &sh->r;
    memset(r, 0, sizeof *r);
    r->status = d->status;
    r->compute_us = d->compute_us;
    r->n = d->seqs.n < 4 ? d->seqs.n : 4;
    for (uint32_t i = 0; i < r->n; i++) {
        const sh_proto_step_out *o = &d->seqs.v[i];
        r->seq[i] = o->seq;
        r->tok[i][0] = o->token;
        for (uint32_t j = 0; j < o->more.n && j < SH_PROTO_MAX_DRAFT; j++)
            r->tok[i][1 + j] = sh_i32s_at(o->more, j);
        r->n_tok[i] = 1 + (o->more.n < SH_PROTO_MAX_DRAFT ? o->more.n : SH_PROTO_MAX_DRAFT);
        r->drafted[i] = o->drafted;
    }
    atomic_fetch_add(&sh->n, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable coll_vt = {
    .name = "collector",
    .state_size = sizeof(coll_state),
    .init = coll_init,
    .handle = coll_handle,
    .stop = coll_stop,
};

/* ---- the setting ---------------------------------------------------------------------------- */

typedef struct fixture {
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
    sh_llama_ctx *c;
    sh_spec_drafts *drafts;
    test_rt t;
    shared sh;
    sh_addr coll, stage, drafter;
    sh_stage_args sa;
    sh_drafter_args da;
} fixture;

static bool fx_start(fixture *f, int32_t self_layers)
{
    memset(f, 0, sizeof *f);
    sh_error e = {0};
    sh_backend_cpu_opts bo = {.n_threads = 1};
    sh_llama_ctx_opts co = {.max_tokens = 256,
                            .max_seqs = 4,
                            .max_logits = sh_stage_max_logits(4, 256),
                            .kv_tokens = 4 * SEQ_BLOCKS * SH_KV_BLOCK_TOKENS};
    sh_spec_drafts_opts dop = {.draft = {.path = self_layers ? NULL : sh_test_path(GGUF),
                                         .self_layers = self_layers,
                                         .kv_tokens = 4 * SEQ_BLOCKS * SH_KV_BLOCK_TOKENS,
                                         .max_tokens = 64},
                               .max_seqs = 4,
                               .max_slots = 8,
                               .seq_tokens = SEQ_BLOCKS * SH_KV_BLOCK_TOKENS};
    if (sh_llama_load(sh_test_path(GGUF), NULL, &f->m, &e) ||
        sh_backend_cpu_create(&bo, &f->be, &e) ||
        sh_llama_ctx_create(f->m, f->be, &co, &f->c, &e) ||
        sh_tokenizer_create_gguf(f->m->gguf, &f->tok, &e) ||
        sh_spec_drafts_create(f->m, f->tok, f->be, &dop, &f->drafts, &e)) {
        SH_FAIL_("open: %s", e.msg);
        return false;
    }
    rt_start(&f->t, 5, 2, NULL);
    f->sa = (sh_stage_args){.model = f->m, .ctx = f->c, .max_seqs = 4};
    CHECK_OK(sh_runtime_register(f->t.rt, &sh__stage_vtable, NULL));
    CHECK_OK(sh_runtime_register(f->t.rt, &sh__drafter_vtable, NULL));
    CHECK_OK(sh_runtime_register(f->t.rt, &coll_vt, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "collector", &f->sh, 0, &f->coll, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "stage", &f->sa, 1, &f->stage, NULL));
    f->da = (sh_drafter_args){.drafts = f->drafts, .stage = f->stage, .max_seqs = 4};
    CHECK_OK(sh_actor_spawn(f->t.rt, "drafter", &f->da, 1, &f->drafter, NULL));
    return f->drafter != SH_ADDR_NONE;
}

static void fx_finish(fixture *f)
{
    if (f->t.rt)
        rt_finish(&f->t);
    CHECK_INT_EQ(atomic_load(&f->sh.bad), 0);
    sh_spec_drafts_destroy(f->drafts);
    sh_llama_ctx_destroy(f->c);
    sh_tokenizer_destroy(f->tok);
    sh_backend_destroy(f->be);
    sh_llama_destroy(f->m);
}

/* Sends a STEP from the collector's address to `to` and waits for its STEP_DONE. */
static const rec *step(fixture *f, sh_addr to, uint64_t id, const sh_proto_step_seq *q, uint32_t n)
{
    long k = atomic_load(&f->sh.n);
    sh_proto_step body = {.step = id, .seqs = {q, n}};
    sh_msg_hdr h = {.type = SH_MSG_STEP, .src = f->coll, .dst = to, .trace_id = id};
    sh_error e = {0};
    if (sh_send_with(f->t.rt, &h, sh__proto_encode, &body, &e)) {
        SH_FAIL_("send STEP: %s", e.msg);
        return NULL;
    }
    if (!wait_ge(&f->sh.n, k + 1, 30000)) {
        SH_FAIL_("no STEP_DONE for step %llu", (unsigned long long)id);
        return NULL;
    }
    return &f->sh.r;
}

static sh_proto_sampling greedy(void)
{
    return (sh_proto_sampling){.temperature = 0.0f, .top_p = 1.0f, .repeat_penalty = 1.0f};
}

typedef struct seq {
    uint64_t id;
    int32_t hist[N_TOK + SH_PROTO_MAX_DRAFT + 2];
    int32_t n, fed; /* tokens known; positions the stage computed */
    int32_t blocks[SEQ_BLOCKS];
    int32_t want, logprobs;
    int32_t drafted, steps; /* drafts accepted; steps run */
    int32_t sent;           /* drafts the stage saw (STEP_DONE's drafted), accepted or not */
} seq;

/* Runs both sequences to N_TOK tokens through the drafter, checking every token against the
 * greedy reference. Sequence b's first SEQ_BLOCKS tokens went to the stage directly, so the
 * drafter first sees it at position 16 (with its prior tokens when `prior`). */
static void run(fixture *f, seq *s, int32_t ns, bool prior)
{
    uint64_t id = 1;
    for (int guard = 0; guard < 400; guard++) {
        sh_proto_step_seq q[4];
        int32_t who[4], n = 0;
        for (int32_t i = 0; i < ns; i++) {
            if (s[i].n >= N_TOK)
                continue;
            q[n] =
                (sh_proto_step_seq){.seq = s[i].id,
                                    .pos = (uint32_t)s[i].fed,
                                    .tokens = {s[i].hist + s[i].fed, (uint32_t)(s[i].n - s[i].fed)},
                                    .blocks = {s[i].blocks, SEQ_BLOCKS},
                                    .sample = true,
                                    .sampling = greedy(),
                                    .want_draft = (uint32_t)s[i].want};
            q[n].sampling.n_logprobs = s[i].logprobs;
            if (prior && s[i].steps == 0 && s[i].fed > 0)
                q[n].prior = (sh_i32s){s[i].hist, (uint32_t)s[i].fed};
            who[n++] = i;
        }
        if (n == 0)
            return;
        const rec *r = step(f, f->drafter, id++, q, (uint32_t)n);
        if (!r)
            return;
        CHECK_INT_EQ(r->status, 0);
        CHECK_INT_EQ(r->n, n);
        CHECK(r->compute_us > 0);
        if (r->status || r->n != (uint32_t)n)
            return;
        for (int32_t j = 0; j < n; j++) {
            seq *x = &s[who[j]];
            CHECK_UINT_EQ(r->seq[j], x->id);
            /* The step computed the sequence's new tokens and its accepted drafts. */
            x->fed = x->n + (int32_t)r->n_tok[j] - 1;
            for (uint32_t t = 0; t < r->n_tok[j]; t++) {
                if (r->tok[j][t] != expected[x->n]) {
                    SH_FAIL_("sequence %llu, token %d: %d, greedy %d", (unsigned long long)x->id,
                             (int)x->n, (int)r->tok[j][t], (int)expected[x->n]);
                    return;
                }
                x->hist[x->n++] = r->tok[j][t];
            }
            x->drafted += (int32_t)r->n_tok[j] - 1;
            /* The stage reports the drafts it verified: at least those accepted, at most those
             * asked for. */
            CHECK(r->drafted[j] + 1 >= r->n_tok[j] && r->drafted[j] <= (uint32_t)x->want);
            x->sent += (int32_t)r->drafted[j];
            x->steps++;
        }
    }
    SH_FAIL_("the sequences did not finish");
}

static void seq_init(seq *s, uint64_t id, int32_t prompt, int32_t block0)
{
    memset(s, 0, sizeof *s);
    s->id = id;
    memcpy(s->hist, expected, (size_t)prompt * sizeof(int32_t));
    s->n = prompt;
    for (int32_t j = 0; j < SEQ_BLOCKS; j++)
        s->blocks[j] = block0 + j;
}

/* Sequence b: its first 16 tokens straight to the stage (as a prefix the drafter never saw). */
static void prefill_direct(fixture *f, seq *b)
{
    sh_proto_step_seq q = {.seq = b->id,
                           .pos = 0,
                           .tokens = {b->hist, 16},
                           .blocks = {b->blocks, SEQ_BLOCKS},
                           .sample = false,
                           .sampling = greedy()};
    const rec *r = step(f, f->stage, 999, &q, 1);
    if (r)
        CHECK_INT_EQ(r->status, 0);
    b->fed = 16;
}

static void check_draft(int32_t self_layers)
{
    fixture f;
    if (!fx_start(&f, self_layers))
        goto out;
    seq s[4];
    seq_init(&s[0], 100, 8, 0);
    seq_init(&s[1], 101, 20, SEQ_BLOCKS);
    seq_init(&s[2], 102, 5, 2 * SEQ_BLOCKS);
    seq_init(&s[3], 103, 12, 3 * SEQ_BLOCKS);
    s[0].want = 4;
    s[1].want = 3;
    s[2].want = 5;
    s[2].logprobs = 2; /* top logprobs: no drafts */
    s[3].want = 0;     /* does not ask */
    prefill_direct(&f, &s[1]);
    run(&f, s, 4, true);
    for (int i = 0; i < 2; i++) {
        CHECK(s[i].drafted > 0);
        /* Drafting for itself: every draft accepted, every step full; the first 2 layers: some
         * rejected. */
        if (!self_layers) {
            CHECK(s[i].steps <= (N_TOK - 8) / (s[i].want + 1) + 2);
            CHECK_INT_EQ(s[i].sent, s[i].drafted);
        } else {
            CHECK(s[i].sent > s[i].drafted);
        }
    }
    CHECK_INT_EQ(s[2].drafted, 0);
    CHECK_INT_EQ(s[3].drafted, 0);
    CHECK_INT_EQ(s[2].sent, 0);
    CHECK_INT_EQ(s[3].sent, 0);
out:
    fx_finish(&f);
}

static void test_draft_itself(void) { check_draft(0); }
static void test_self_layers(void) { check_draft(2); }

/* Without its prior tokens a sequence joining at position 16 never drafts (its history has a
 * hole), and its tokens stay the greedy ones. */
static void test_join_without_prior(void)
{
    fixture f;
    if (!fx_start(&f, 0))
        goto out;
    seq s[1];
    seq_init(&s[0], 101, 20, 0);
    s[0].want = 4;
    prefill_direct(&f, &s[0]);
    run(&f, s, 1, false);
    CHECK_INT_EQ(s[0].drafted, 0);
    CHECK_INT_EQ(s[0].sent, 0); /* asked for 4 every step, drafted none */
out:
    fx_finish(&f);
}

/* A step with a token outside the vocabulary: the drafter's pass fails, the step goes on without
 * drafts and the stage refuses it with a status; the next steps draft again. */
static void test_bad_step(void)
{
    fixture f;
    if (!fx_start(&f, 0))
        goto out;
    int32_t bad[3] = {1, 100000, 5};
    int32_t blocks[SEQ_BLOCKS];
    for (int32_t j = 0; j < SEQ_BLOCKS; j++)
        blocks[j] = j;
    sh_proto_step_seq q = {.seq = 55,
                           .tokens = {bad, 3},
                           .blocks = {blocks, SEQ_BLOCKS},
                           .sample = true,
                           .sampling = greedy(),
                           .want_draft = 4};
    const rec *r = step(&f, f.drafter, 1, &q, 1);
    if (r)
        CHECK_INT_EQ(r->status, SH_EINVAL);
    seq s[1];
    seq_init(&s[0], 56, 8, 0);
    s[0].want = 4;
    run(&f, s, 1, false);
    CHECK(s[0].drafted > 0);
out:
    fx_finish(&f);
}

static const sh_test_case tests[] = {
    {"bad_step", test_bad_step},
    {"draft_itself", test_draft_itself},
    {"self_layers", test_self_layers},
    {"join_without_prior", test_join_without_prior},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    expected[0] = 1;
    FILE *fp = fopen(sh_test_path("tests/data/stories260K/expected_ids_bos_256.txt"), "r");
    if (!fp)
        return 1;
    for (int i = 1; i <= 256; i++)
        if (fscanf(fp, "%d", &expected[i]) != 1) {
            fclose(fp);
            return 1;
        }
    fclose(fp);
    return sh_test_main(argc, argv, tests);
}
