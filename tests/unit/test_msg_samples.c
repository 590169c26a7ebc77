/* Builds one valid message of each type with random values (never all zeros) for the tests. */
#include "test_msg_samples.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t test_rand(uint64_t *state)
{
    uint64_t x = *state ? *state : 0x9e3779b97f4a7c15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

static uint64_t rnd(test_sample *s) { return test_rand(&s->rng); }

/* A value in [lo, hi]. */
static int64_t range(test_sample *s, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd(s) % (uint64_t)(hi - lo + 1));
}

/* A non-zero 64-bit value. */
static uint64_t nz64(test_sample *s) { return rnd(s) | 1; }

static float rf(test_sample *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((rnd(s) >> 40) + 1) / (float)(1 << 24);
}

static void *take(test_sample *s, size_t n)
{
    size_t at = (s->used + 15) & ~(size_t)15;
    if (at + n > s->cap) {
        fprintf(stderr, "test sample pool exhausted\n");
        abort();
    }
    s->used = at + n;
    return s->pool + at;
}

static sh_i32s tokens(test_sample *s, uint32_t n)
{
    int32_t *v = take(s, 4 * (size_t)n + 1);
    for (uint32_t i = 0; i < n; i++)
        v[i] = (int32_t)range(s, 1, 151935);
    return (sh_i32s){v, n};
}

static sh_f32s floats(test_sample *s, uint32_t n)
{
    float *v = take(s, 4 * (size_t)n + 1);
    for (uint32_t i = 0; i < n; i++)
        v[i] = -rf(s, 0.001f, 20.0f);
    return (sh_f32s){v, n};
}

static sh_u64s u64s(test_sample *s, uint32_t n)
{
    uint64_t *v = take(s, 8 * (size_t)n + 1);
    for (uint32_t i = 0; i < n; i++)
        v[i] = nz64(s);
    return (sh_u64s){v, n};
}

static sh_strv text(test_sample *s, uint32_t lo, uint32_t hi)
{
    uint32_t n = (uint32_t)range(s, lo, hi);
    char *p = take(s, n + 1);
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,!?0123456789\xc3\xa9";
    for (uint32_t i = 0; i < n; i++)
        p[i] = alphabet[rnd(s) % (sizeof alphabet - 1)];
    return (sh_strv){p, n};
}

static void sampling(test_sample *s, sh_proto_sampling *p)
{
    p->temperature = rf(s, 0.1f, 1.5f);
    p->top_k = (int32_t)range(s, 1, 100);
    p->top_p = rf(s, 0.5f, 1.0f);
    p->min_p = rf(s, 0.01f, 0.2f);
    p->repeat_penalty = rf(s, 1.0f, 1.3f);
    p->frequency_penalty = rf(s, -1.0f, 1.0f);
    p->presence_penalty = rf(s, -1.0f, 1.0f);
    p->penalty_last_n = (int32_t)range(s, 1, 256);
    p->seed = nz64(s);
    p->max_tokens = (uint32_t)range(s, 1, 4096);
    p->n_logprobs = (int32_t)range(s, 1, SH_PROTO_MAX_LOGPROBS);
    p->logprobs_mode = (uint8_t)range(s, 0, 1);
    uint32_t ns = (uint32_t)range(s, 1, 4);
    sh_strv *stop = take(s, ns * sizeof *stop);
    for (uint32_t i = 0; i < ns; i++)
        stop[i] = text(s, 1, 40);
    p->stop = (sh_strv_list){stop, ns};
    uint32_t nb = (uint32_t)range(s, 1, 6);
    sh_proto_logit_bias *b = take(s, nb * sizeof *b);
    for (uint32_t i = 0; i < nb; i++)
        b[i] = (sh_proto_logit_bias){(int32_t)range(s, 0, 32000), rf(s, -100.0f, 100.0f)};
    p->bias = (sh_proto_logit_bias_list){b, nb};
}

static sh_proto_step_seq_list seqs(test_sample *s, uint32_t n, uint32_t max_tok)
{
    sh_proto_step_seq *v = take(s, n * sizeof *v);
    for (uint32_t i = 0; i < n; i++) {
        v[i].seq = nz64(s);
        v[i].tokens = tokens(s, (uint32_t)range(s, 1, max_tok));
        v[i].pos = (uint32_t)range(s, 1, 100000);
        v[i].blocks = tokens(s, (uint32_t)range(s, 1, 64));
        v[i].sample = (i & 1) == 0;
        sampling(s, &v[i].sampling);
        v[i].history = tokens(s, (uint32_t)range(s, 1, 32));
        v[i].draft = (uint32_t)range(s, 0, SH_PROTO_MAX_DRAFT);
        /* Derived from the fields above, so that the generator's sequence (which the other
         * samples and tests depend on) stays as it was. */
        v[i].want_draft = (v[i].draft * 7u + 3u) % (SH_PROTO_MAX_DRAFT + 1u);
        v[i].prior = (i & 2) ? v[i].history : (sh_i32s){NULL, 0};
        v[i].gram_hash = (i & 1) ? v[i].seq * 0x9e3779b97f4a7c15ull : 0;
        v[i].n_gen = v[i].history.n;
    }
    return (sh_proto_step_seq_list){v, n};
}

void test_sample_make(test_sample *s, sh_msg_type type, uint64_t seed, size_t act_bytes)
{
    memset(s, 0, sizeof *s);
    s->rng = seed * 0x9e3779b97f4a7c15ull + 12345;
    s->cap = (1 << 20) + 2 * act_bytes;
    s->pool = calloc(1, s->cap);
    if (!s->pool)
        abort();
    s->hdr = (sh_msg_hdr){type, nz64(s), sh_addr_make((uint32_t)range(s, 1, 9), (uint32_t)nz64(s)),
                          sh_addr_make((uint32_t)range(s, 1, 9), (uint32_t)nz64(s)), nz64(s)};
    sh_proto_body *b = &s->body;
    switch (type) {
    case SH_MSG_SUBMIT:
        b->submit.req = nz64(s);
        b->submit.prompt = tokens(s, (uint32_t)range(s, 1, 300));
        b->submit.generated = tokens(s, (uint32_t)range(s, 1, 20));
        sampling(s, &b->submit.sampling);
        b->submit.priority = (uint8_t)range(s, 1, 3);
        b->submit.deadline_ms = 1700000000000ull + (uint64_t)range(s, 1, 1000000);
        b->submit.reply_to = s->hdr.src;
        break;
    case SH_MSG_CANCEL:
        b->cancel.req = nz64(s);
        b->cancel.reason = text(s, 1, 50);
        break;
    case SH_MSG_TOKEN: {
        uint32_t n = (uint32_t)range(s, 1, 4), top = (uint32_t)range(s, 1, 5);
        b->token.req = nz64(s);
        b->token.index = (uint32_t)range(s, 1, 5000);
        b->token.tokens = tokens(s, n);
        b->token.text = text(s, 1, 60);
        b->token.logprobs = floats(s, n);
        b->token.top_n = (uint8_t)top;
        b->token.top_tokens = tokens(s, n * top);
        b->token.top_logprobs = floats(s, n * top);
        break;
    }
    case SH_MSG_DONE:
        b->done.req = nz64(s);
        b->done.finish = (uint8_t)range(s, 0, 3);
        b->done.n_prompt = (uint32_t)range(s, 1, 8000);
        b->done.n_generated = (uint32_t)range(s, 1, 8000);
        b->done.n_cached = (uint32_t)range(s, 1, 8000);
        b->done.text = text(s, 1, 10);
        break;
    case SH_MSG_FAIL:
        b->fail.req = nz64(s);
        b->fail.code = (int32_t)range(s, 1, 15);
        b->fail.message = text(s, 5, 200);
        b->fail.retryable = true;
        break;
    case SH_MSG_STEP:
        b->step.step = nz64(s);
        b->step.deadline_ms = nz64(s) >> 20;
        b->step.seqs = seqs(s, (uint32_t)range(s, 1, 8), 40);
        b->step.compute_us = b->step.deadline_ms % 1000000u; /* no draw: see seqs() */
        break;
    case SH_MSG_ACT: {
        b->act.step = nz64(s);
        b->act.deadline_ms = nz64(s) >> 20;
        b->act.seqs = seqs(s, (uint32_t)range(s, 1, 4), 8);
        uint64_t rows = 0;
        for (uint32_t i = 0; i < b->act.seqs.n; i++)
            rows += b->act.seqs.v[i].tokens.n;
        static const uint32_t dts[] = {SH_PROTO_DTYPE_F32, SH_PROTO_DTYPE_F16, SH_PROTO_DTYPE_BF16,
                                       SH_PROTO_DTYPE_I8};
        sh_proto_tensor *t = &b->act.hidden;
        t->dtype = dts[rnd(s) % 4];
        size_t esz = sh__proto_dtype_size(t->dtype);
        uint64_t d = act_bytes / (rows * esz);
        d = d < 4 ? 4 : d;
        t->ndim = 2;
        t->shape[0] = rows;
        t->shape[1] = d;
        t->nbytes = rows * d * esz;
        uint8_t *data = take(s, t->nbytes);
        for (uint64_t i = 0; i < t->nbytes; i += 8) {
            uint64_t r = rnd(s);
            memcpy(data + i, &r, t->nbytes - i < 8 ? t->nbytes - i : 8);
        }
        t->data = data;
        if (t->dtype == SH_PROTO_DTYPE_I8) /* one scale per row */
            b->act.scales = floats(s, (uint32_t)rows);
        break;
    }
    case SH_MSG_STEP_DONE: {
        uint32_t n = (uint32_t)range(s, 1, 16);
        sh_proto_step_out *v = take(s, n * sizeof *v);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t top = (uint32_t)range(s, 1, SH_PROTO_MAX_LOGPROBS);
            uint32_t more = (uint32_t)range(s, 0, SH_PROTO_MAX_DRAFT);
            v[i] = (sh_proto_step_out){nz64(s),
                                       (int32_t)range(s, -1, 150000),
                                       -rf(s, 0, 10),
                                       -rf(s, 0, 10),
                                       tokens(s, top),
                                       floats(s, top),
                                       tokens(s, more),
                                       floats(s, more),
                                       floats(s, more),
                                       more,
                                       (sh_f32s){NULL, 0},
                                       0,
                                       (sh_strv){NULL, 0}};
            if (i % 3 == 2) { /* derived: the generator's sequence stays as it was */
                v[i].status = SH_ERANGE;
                v[i].message = (sh_strv){"grammar limit hit", 17};
            }
        }
        b->step_done.step = nz64(s);
        b->step_done.seqs = (sh_proto_step_out_list){v, n};
        b->step_done.compute_us = (uint64_t)range(s, 1, 1000000);
        break;
    }
    case SH_MSG_KV_ALLOC:
        b->kv_alloc.seq = nz64(s);
        b->kv_alloc.n_tokens = (uint32_t)range(s, 1, 4096);
        b->kv_alloc.tokens = tokens(s, (uint32_t)range(s, 1, 100));
        b->kv_alloc.blocks = tokens(s, (uint32_t)range(s, 1, 50));
        b->kv_alloc.cached = (uint32_t)range(s, 1, 1000);
        b->kv_alloc.status = (int32_t)range(s, 1, 15);
        break;
    case SH_MSG_KV_FREE:
        b->kv_free.seq = nz64(s);
        b->kv_free.blocks = tokens(s, (uint32_t)range(s, 1, 50));
        break;
    case SH_MSG_KV_FORK:
        b->kv_fork.seq = nz64(s);
        b->kv_fork.child = nz64(s);
        b->kv_fork.n_tokens = (uint32_t)range(s, 1, 4096);
        b->kv_fork.blocks = tokens(s, (uint32_t)range(s, 1, 50));
        break;
    case SH_MSG_KV_PREFIX:
        b->kv_prefix.hashes = u64s(s, (uint32_t)range(s, 1, 40));
        b->kv_prefix.hits = (uint32_t)range(s, 1, 40);
        b->kv_prefix.blocks = tokens(s, (uint32_t)range(s, 1, 40));
        break;
    case SH_MSG_PING:
        b->ping.seq = nz64(s);
        b->ping.sent_us = nz64(s);
        break;
    case SH_MSG_PONG:
        b->pong = (sh_proto_pong){nz64(s),
                                  nz64(s),
                                  (uint8_t)range(s, 0, 2),
                                  (uint32_t)range(s, 1, 100000),
                                  nz64(s),
                                  (uint64_t)range(s, 1, 100000)};
        break;
    case SH_MSG_METRICS: {
        uint32_t nm = (uint32_t)range(s, 1, 20), nh = (uint32_t)range(s, 1, 4);
        sh_proto_metric *m = take(s, nm * sizeof *m);
        for (uint32_t i = 0; i < nm; i++)
            m[i] = (sh_proto_metric){text(s, 3, 40), (uint8_t)range(s, 0, 1), (double)nz64(s) / 3.0,
                                     text(s, 3, 40)};
        sh_proto_histogram *h = take(s, nh * sizeof *h);
        for (uint32_t i = 0; i < nh; i++) {
            uint32_t nb = (uint32_t)range(s, 1, 12);
            double *bounds = take(s, 8 * nb);
            for (uint32_t j = 0; j < nb; j++)
                bounds[j] = 0.001 * (j + 1) * (double)range(s, 1, 9);
            h[i] = (sh_proto_histogram){text(s, 3, 40),
                                        {bounds, nb},
                                        {u64s(s, nb + 1).ptr, nb + 1},
                                        (double)nz64(s) / 7.0,
                                        text(s, 3, 40)};
        }
        b->metrics.at_us = nz64(s);
        b->metrics.values = (sh_proto_metric_list){m, nm};
        b->metrics.hists = (sh_proto_histogram_list){h, nh};
        break;
    }
    case SH_MSG_CONTROL:
        b->control.op = (uint8_t)range(s, 0, 4);
        b->control.level = (int32_t)range(s, -3, 5) | 1;
        b->control.targets = u64s(s, (uint32_t)range(s, 1, 8));
        b->control.arg = text(s, 1, 30);
        break;
    case SH_MSG_FAULT: {
        uint32_t n = (uint32_t)range(s, 1, 8);
        sh_proto_fault_rule *r = take(s, n * sizeof *r);
        for (uint32_t i = 0; i < n; i++)
            r[i] = (sh_proto_fault_rule){(uint8_t)range(s, 0, 4),
                                         nz64(s),
                                         nz64(s),
                                         (uint32_t)range(s, 1, 18),
                                         rf(s, 0, 1),
                                         (uint32_t)range(s, 1, 500),
                                         (uint32_t)range(s, 1, 9),
                                         (uint32_t)range(s, 1, 16),
                                         rf(s, 0, 5)};
        b->fault.seed = nz64(s);
        b->fault.clear = true;
        b->fault.rules = (sh_proto_fault_rule_list){r, n};
        break;
    }
    case SH_MSG_ERROR:
        b->error.code = (int32_t)range(s, 1, 15);
        b->error.message = text(s, 5, 100);
        b->error.type = (uint32_t)range(s, 1, 18);
        break;
    case SH_MSG_HELLO:
        b->hello.node = text(s, 1, 20);
        b->hello.version = text(s, 5, 10);
        b->hello.proto = (uint32_t)range(s, 1, 5);
        b->hello.model_size = nz64(s);
        b->hello.model_hash = nz64(s);
        b->hello.n_blocks = (int32_t)range(s, 1, 100000);
        b->hello.max_seqs = (int32_t)range(s, 1, 1024);
        b->hello.max_tokens = (int32_t)range(s, 1, 65536);
        b->hello.seq_blocks = (int32_t)range(s, 1, 1000);
        b->hello.stages = u64s(s, (uint32_t)range(s, 1, 8));
        break;
    default:
        abort();
    }
}

void test_sample_free(test_sample *s)
{
    free(s->pool);
    memset(s, 0, sizeof *s);
}
