/* The kvmgr actor in a real runtime: a client actor sends KV_ALLOC / KV_FORK / KV_FREE and checks
 * the replies, the metrics and that the steady state does not allocate. */
#include <pthread.h>
#include <stdatomic.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "runtime/proto.h"
#include "test_runtime_util.h"

/* ---- allocation counting on one thread ------------------------------------------------------ */

/* kvmgr_actor.cmake links with --wrap: allocations made on the watched thread (the kvmgr's loop)
 * are counted. */
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
static pthread_t watched;
static atomic_int watching;
static _Atomic long n_allocs;

static void count_alloc(void)
{
    if (atomic_load_explicit(&watching, memory_order_acquire) &&
        pthread_equal(pthread_self(), watched))
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

/* ---- the client actor ---------------------------------------------------------------------- */

/* One call the test thread asks the client to make: a typed body, or raw body bytes. */
typedef struct call {
    uint32_t type;
    bool request; /* false: one-way (KV_FREE, or a message the kvmgr should drop) */
    sh_proto_body body;
    const uint8_t *raw; /* when set, raw_len bytes are sent instead of body */
    size_t raw_len;
} call;

typedef struct shared {
    sh_addr kvmgr;
    call c;
    _Atomic long done; /* calls completed (one-way: sent; request: answered) */
    _Atomic long bad;  /* unexpected messages or failed sends */
    /* The last answer, copied out of the message. */
    uint32_t r_type;
    sh_proto_kv_alloc ra;
    sh_proto_kv_fork rf;
    int32_t blocks[64];
    uint32_t n_blocks;
    _Atomic int probe_ready;
} shared;

typedef struct client_state {
    shared *sh;
    uint64_t session;
    sh_act_decoder dec;
} client_state;

static sh_err client_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    client_state *st = state;
    st->sh = arg;
    return sh__act_decoder_init(&st->dec, 1 << 16);
}

static void client_stop(sh_actor_ctx *ctx, void *state)
{
    sh__act_decoder_fini(&((client_state *)state)->dec);
}

static void make_call(sh_actor_ctx *ctx, client_state *st)
{
    shared *sh = st->sh;
    const call *c = &sh->c;
    sh_error e = {0};
    sh_err err;
    if (c->request && c->raw)
        err = sh_request(ctx, sh->kvmgr, c->type, c->raw, c->raw_len, 5000, &st->session, &e);
    else if (c->request)
        err = sh_request_with(ctx, sh->kvmgr, c->type, sh__proto_encode, &c->body, 5000,
                              &st->session, &e);
    else if (c->raw)
        err = sh_actor_send(ctx, sh->kvmgr, c->type, c->raw, c->raw_len, &e);
    else
        err = sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), sh->kvmgr, c->type, 0,
                           &c->body, &e);
    if (err) {
        fprintf(stderr, "client send: %s\n", e.msg);
        atomic_fetch_add(&sh->bad, 1);
    }
    if (err || !c->request)
        atomic_fetch_add(&sh->done, 1);
}

static void copy_blocks(shared *sh, sh_i32s v)
{
    sh->n_blocks = v.n;
    for (uint32_t i = 0; i < v.n && i < 64; i++)
        sh->blocks[i] = sh_i32s_at(v, i);
}

static sh_msg_fate client_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    client_state *st = state;
    shared *sh = st->sh;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type == SH_MSG_PING && h->session == 0) { /* the test thread's "go" */
        make_call(ctx, st);
        return SH_MSG_FATE_DONE;
    }
    if (h->session != st->session) {
        atomic_fetch_add(&sh->bad, 1);
        return SH_MSG_FATE_DONE;
    }
    sh->r_type = h->type;
    sh->n_blocks = 0;
    if (h->type != SH_MSG_ERROR) {
        sh_proto_body b;
        sh_error e = {0};
        if (sh__act_decode(&st->dec, m, &b, &e)) {
            fprintf(stderr, "client decode: %s\n", e.msg);
            atomic_fetch_add(&sh->bad, 1);
        } else if (h->type == SH_MSG_KV_ALLOC) {
            sh->ra = b.kv_alloc;
            sh->ra.tokens = (sh_i32s){NULL, 0};
            copy_blocks(sh, b.kv_alloc.blocks);
        } else if (h->type == SH_MSG_KV_FORK) {
            sh->rf = b.kv_fork;
            copy_blocks(sh, b.kv_fork.blocks);
        }
    }
    atomic_fetch_add(&sh->done, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable client_vt = {
    .name = "kvclient",
    .state_size = sizeof(client_state),
    .init = client_init,
    .handle = client_handle,
    .stop = client_stop,
};

/* Spawned on the kvmgr's loop: records that loop's thread for the allocation count. */
static sh_err probe_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    watched = pthread_self();
    atomic_store(&((shared *)arg)->probe_ready, 1);
    return SH_OK;
}

static sh_msg_fate probe_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable probe_vt = {
    .name = "probe", .init = probe_init, .handle = probe_handle};

/* ---- fixture ------------------------------------------------------------------------------- */

typedef struct fixture {
    test_rt t;
    shared sh;
    sh_addr client;
} fixture;

/* A runtime of two loops: the kvmgr on loop 1 (with a probe), the client on loop 0. */
static void fx_start(fixture *f, int32_t n_blocks, int32_t max_seqs, int32_t block_tokens,
                     bool prefix_cache)
{
    memset(f, 0, sizeof *f);
    rt_start(&f->t, 3, 2, NULL);
    CHECK_OK(sh_runtime_register(f->t.rt, &sh__kvmgr_vtable, NULL));
    CHECK_OK(sh_runtime_register(f->t.rt, &client_vt, NULL));
    CHECK_OK(sh_runtime_register(f->t.rt, &probe_vt, NULL));
    sh_kvmgr_args a = {
        .cfg = {.n_blocks = n_blocks, .block_tokens = block_tokens, .max_seqs = max_seqs},
        .prefix_cache = prefix_cache};
    sh_addr probe;
    CHECK_OK(sh_actor_spawn(f->t.rt, "kvmgr", &a, 1, &f->sh.kvmgr, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "probe", &f->sh, 1, &probe, NULL));
    CHECK_OK(sh_actor_spawn(f->t.rt, "kvclient", &f->sh, 0, &f->client, NULL));
    /* `a` must live until init ran: the probe, spawned after the kvmgr on the same loop, runs
     * its init after the kvmgr's. */
    uint64_t end = now_ms() + 5000;
    while (!atomic_load(&f->sh.probe_ready) && now_ms() < end)
        sleep_ms(1);
    CHECK(atomic_load(&f->sh.probe_ready));
}

static void fx_finish(fixture *f)
{
    CHECK_INT_EQ(atomic_load(&f->sh.bad), 0);
    rt_finish(&f->t);
}

/* Makes the client send f->sh.c and waits for the answer (or for the send, one-way). */
static void fx_call(fixture *f)
{
    long before = atomic_load(&f->sh.done);
    CHECK_OK(send_body(f->t.rt, 0, f->client, 0, SH_MSG_PING, 0, 0));
    CHECK(wait_ge(&f->sh.done, before + 1, 5000));
}

static sh_proto_kv_alloc *alloc(fixture *f, uint64_t seq, uint32_t n, const int32_t *ids,
                                uint32_t n_ids, uint32_t computed)
{
    f->sh.c = (call){.type = SH_MSG_KV_ALLOC, .request = true};
    f->sh.c.body.kv_alloc = (sh_proto_kv_alloc){
        .seq = seq, .n_tokens = n, .tokens = {ids, n_ids}, .computed = computed};
    fx_call(f);
    CHECK_UINT_EQ(f->sh.r_type, SH_MSG_KV_ALLOC);
    CHECK_UINT_EQ(f->sh.ra.seq, seq);
    CHECK_UINT_EQ(f->sh.ra.n_tokens, n);
    return &f->sh.ra;
}

static sh_proto_kv_fork *fork_seq(fixture *f, uint64_t seq, uint64_t child, uint32_t n)
{
    f->sh.c = (call){.type = SH_MSG_KV_FORK, .request = true};
    f->sh.c.body.kv_fork = (sh_proto_kv_fork){.seq = seq, .child = child, .n_tokens = n};
    fx_call(f);
    CHECK_UINT_EQ(f->sh.r_type, SH_MSG_KV_FORK);
    return &f->sh.rf;
}

/* One-way KV_FREE, then a fork of a sequence that does not exist (refused, changes nothing) so
 * that the free has been handled when this returns. */
static void free_seq(fixture *f, uint64_t seq, uint32_t computed)
{
    f->sh.c = (call){.type = SH_MSG_KV_FREE};
    f->sh.c.body.kv_free = (sh_proto_kv_free){.seq = seq, .computed = computed};
    fx_call(f);
    CHECK_INT_EQ(fork_seq(f, UINT64_MAX - 1, UINT64_MAX - 2, 0)->status, SH_EINVAL);
}

static int64_t gauge(fixture *f, const char *name)
{
    sh_gauge *g = NULL;
    CHECK_OK(sh_metrics_gauge(sh_runtime_metrics(f->t.rt), name, "x", NULL, &g));
    return g ? sh_gauge_value(g) : -1;
}

static uint64_t counter(fixture *f, const char *name)
{
    sh_counter *c = NULL;
    CHECK_OK(sh_metrics_counter(sh_runtime_metrics(f->t.rt), name, "x", NULL, &c));
    return c ? sh_counter_value(c) : UINT64_MAX;
}

/* ---- tests --------------------------------------------------------------------------------- */

/* A prompt's full, computed blocks survive its sequence's free and are adopted by the next
 * sequence with the same prompt. */
static void test_prefix_hit_after_free(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, true);
    int32_t p[11] = {5, 9, 2, 7, 1, 8, 3, 6, 4, 11, 12};
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_total"), 8);
    sh_proto_kv_alloc *r = alloc(&f, 100, 10, p, 10, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 0);
    CHECK_UINT_EQ(r->appended, 10);
    CHECK_UINT_EQ(f.sh.n_blocks, 3);
    CHECK_UINT_EQ(r->available, 5);
    int32_t first[3];
    memcpy(first, f.sh.blocks, sizeof first);
    /* Decode: positions [0, 10) computed, one more token reserved. */
    r = alloc(&f, 100, 1, p + 10, 1, 10);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->appended, 1);
    CHECK_UINT_EQ(f.sh.n_blocks, 3);
    CHECK_INT_EQ(memcmp(f.sh.blocks, first, sizeof first), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 3);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 2);
    free_seq(&f, 100, 11);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 2);

    /* The same prompt again: the two full blocks are hits; the last prompt token is computed
     * anyway (the hit is capped below the prompt's length). */
    r = alloc(&f, 200, 10, p, 10, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 8);
    CHECK_UINT_EQ(r->appended, 2);
    CHECK_UINT_EQ(f.sh.n_blocks, 3);
    CHECK_INT_EQ(f.sh.blocks[0], first[0]);
    CHECK_INT_EQ(f.sh.blocks[1], first[1]);
    CHECK_UINT_EQ(counter(&f, "shoal_prefix_cache_query_tokens_total"), 20);
    CHECK_UINT_EQ(counter(&f, "shoal_prefix_cache_hit_tokens_total"), 8);
    /* n_tokens above what the given ids cover reserves only the ids. */
    r = alloc(&f, 300, 40, p, 6, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 4);
    CHECK_UINT_EQ(r->appended, 2);
    free_seq(&f, 200, 0);
    free_seq(&f, 300, 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);
    fx_finish(&f);
}

/* CONTROL op RESET: every sequence and cached block forgotten, the pool whole again; the
 * counters go on; old ids are unknown afterwards (KV_FREE ignored, KV_ALLOC starts a new one). */
static void test_reset(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, true);
    int32_t p[9] = {5, 9, 2, 7, 1, 8, 3, 6, 4};
    CHECK_INT_EQ(alloc(&f, 1, 9, p, 9, 0)->status, 0);
    CHECK_INT_EQ(alloc(&f, 2, 9, p, 9, 0)->status, 0);
    free_seq(&f, 2, 9); /* its two full blocks enter the prefix cache */
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 3);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 2);
    uint64_t queried = counter(&f, "shoal_prefix_cache_query_tokens_total");
    CHECK_UINT_EQ(queried, 18);
    f.sh.c = (call){.type = SH_MSG_CONTROL};
    f.sh.c.body.control = (sh_proto_control){.op = SH_PROTO_CONTROL_OP_RESET};
    fx_call(&f);
    free_seq(&f, 1, 9); /* unknown now: ignored */
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_total"), 8);
    CHECK_UINT_EQ(counter(&f, "shoal_prefix_cache_query_tokens_total"), queried);
    /* The same prompt finds nothing cached; the pool has all 8 blocks. */
    sh_proto_kv_alloc *r = alloc(&f, 1, 9, p, 9, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 0);
    CHECK_UINT_EQ(r->available, 5);
    CHECK_UINT_EQ(counter(&f, "shoal_prefix_cache_query_tokens_total"), queried + 9);
    /* Other CONTROL ops change nothing. */
    f.sh.c = (call){.type = SH_MSG_CONTROL};
    f.sh.c.body.control = (sh_proto_control){.op = SH_PROTO_CONTROL_OP_PAUSE};
    fx_call(&f);
    free_seq(&f, 1, 9);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 2);
    fx_finish(&f);
}

/* Without prefix caching nothing is looked up or adopted. */
static void test_prefix_cache_off(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, false);
    int32_t p[9] = {5, 9, 2, 7, 1, 8, 3, 6, 4};
    alloc(&f, 1, 9, p, 9, 0);
    alloc(&f, 1, 0, NULL, 0, 9);
    free_seq(&f, 1, 9);
    sh_proto_kv_alloc *r = alloc(&f, 2, 9, p, 9, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 0);
    CHECK_UINT_EQ(r->appended, 9);
    CHECK_UINT_EQ(counter(&f, "shoal_prefix_cache_hit_tokens_total"), 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 0);
    fx_finish(&f);
}

/* A pool too short: SH_EBUSY, and a new sequence that could not get its blocks is not left
 * allocated; beyond max_blocks_per_seq: SH_ERANGE. */
static void test_busy_and_range(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, true);
    sh_proto_kv_alloc *r = alloc(&f, 1, 24, NULL, 0, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(f.sh.n_blocks, 6);
    CHECK_UINT_EQ(r->available, 2);
    r = alloc(&f, 2, 16, NULL, 0, 0);
    CHECK_INT_EQ(r->status, SH_EBUSY);
    CHECK_UINT_EQ(r->appended, 0);
    CHECK_UINT_EQ(f.sh.n_blocks, 0);
    CHECK_UINT_EQ(r->available, 2);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 6);
    /* Sequence 2 does not exist: a smaller request creates it afresh. */
    r = alloc(&f, 2, 8, NULL, 0, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(f.sh.n_blocks, 2);
    CHECK_UINT_EQ(r->available, 0);
    /* A known sequence short of blocks keeps its table. */
    r = alloc(&f, 1, 4, NULL, 0, 0);
    CHECK_INT_EQ(r->status, SH_EBUSY);
    CHECK_UINT_EQ(f.sh.n_blocks, 6);
    free_seq(&f, 1, 0);
    free_seq(&f, 2, 0);
    r = alloc(&f, 3, 36, NULL, 0, 0); /* 9 blocks > max_blocks_per_seq (8) */
    CHECK_INT_EQ(r->status, SH_ERANGE);
    CHECK_UINT_EQ(r->available, 8);
    fx_finish(&f);
}

/* KV_FORK: the child shares the parent's blocks; refusals for unknown parents, existing children
 * and cuts off a block boundary. */
static void test_fork(void)
{
    fixture f;
    fx_start(&f, 16, 4, 4, true);
    int32_t p[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    alloc(&f, 10, 10, p, 10, 0);
    int32_t parent[3];
    memcpy(parent, f.sh.blocks, sizeof parent);
    alloc(&f, 10, 0, NULL, 0, 10);
    sh_proto_kv_fork *r = fork_seq(&f, 10, 11, 8);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->seq, 10);
    CHECK_UINT_EQ(r->child, 11);
    CHECK_UINT_EQ(f.sh.n_blocks, 2);
    CHECK_INT_EQ(f.sh.blocks[0], parent[0]);
    CHECK_INT_EQ(f.sh.blocks[1], parent[1]);
    CHECK_INT_EQ(fork_seq(&f, 10, 12, 6)->status, SH_EINVAL); /* off a block boundary */
    CHECK_UINT_EQ(f.sh.n_blocks, 0);
    CHECK_INT_EQ(fork_seq(&f, 99, 12, 4)->status, SH_EINVAL);  /* unknown parent */
    CHECK_INT_EQ(fork_seq(&f, 10, 11, 4)->status, SH_EINVAL);  /* child exists */
    CHECK_INT_EQ(fork_seq(&f, 10, 10, 4)->status, SH_EINVAL);  /* child is the parent */
    CHECK_INT_EQ(fork_seq(&f, 10, 12, 12)->status, SH_EINVAL); /* beyond the parent */
    /* The child writes its own tokens into a fresh block. */
    sh_proto_kv_alloc *a = alloc(&f, 11, 2, p + 8, 2, 0);
    CHECK_INT_EQ(a->status, 0);
    CHECK_UINT_EQ(f.sh.n_blocks, 3);
    CHECK(f.sh.blocks[2] != parent[2]);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 4);
    free_seq(&f, 10, 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 3);
    free_seq(&f, 11, 0);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);
    fx_finish(&f);
}

/* KV_ALLOC's keep: a speculative step's draft positions (reserved with the drafts' ids) that
 * were rejected are given back before the next reservation, so the blocks the prefix cache keeps
 * hold the tokens that were computed. */
static void test_keep(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, true);
    int32_t p[12] = {5, 9, 2, 7, 1, 8, 3, 6, 4, 11, 12, 13};
    int32_t d[4] = {3, 30, 31, 32}; /* p[6] and 3 wrong drafts for p[7..9] */
    CHECK_INT_EQ(alloc(&f, 20, 6, p, 6, 0)->status, 0);
    CHECK_INT_EQ(alloc(&f, 20, 4, d, 4, 6)->status, 0);
    CHECK_UINT_EQ(f.sh.n_blocks, 3);
    /* No draft accepted: positions [0, 7) computed; 7.. given back, then one token reserved. */
    f.sh.c = (call){.type = SH_MSG_KV_ALLOC, .request = true};
    f.sh.c.body.kv_alloc = (sh_proto_kv_alloc){
        .seq = 20, .n_tokens = 1, .tokens = {p + 7, 1}, .computed = 7, .keep = 7};
    fx_call(&f);
    CHECK_INT_EQ(f.sh.ra.status, 0);
    CHECK_UINT_EQ(f.sh.ra.appended, 1);
    CHECK_UINT_EQ(f.sh.n_blocks, 2);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 2);
    /* keep below what is computed is refused. */
    f.sh.c = (call){.type = SH_MSG_KV_ALLOC, .request = true};
    f.sh.c.body.kv_alloc = (sh_proto_kv_alloc){.seq = 20, .computed = 7, .keep = 3};
    fx_call(&f);
    CHECK_INT_EQ(f.sh.ra.status, SH_EINVAL);
    free_seq(&f, 20, 8);
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_cached"), 2);
    /* A prompt of p's first 9 tokens finds both blocks (8 positions): none holds a draft. */
    sh_proto_kv_alloc *r = alloc(&f, 21, 9, p, 9, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->cached, 8);
    free_seq(&f, 21, 0);
    fx_finish(&f);
}

/* What is not a valid request: unknown sequences on KV_FREE, other message types and ERRORs are
 * dropped; a body that does not decode, or that breaks the rules, is answered with a status. */
static void test_bad_input(void)
{
    fixture f;
    fx_start(&f, 8, 4, 4, true);
    int32_t p[4] = {1, 2, 3, 4};
    alloc(&f, 7, 4, p, 4, 0);
    CHECK_UINT_EQ(f.sh.ra.available, 7);
    free_seq(&f, 12345, 4); /* unknown: ignored */
    /* A PING and an ERROR to the kvmgr are dropped. */
    static const uint8_t ping[] = {0x82, 0xa1, 'n', 0x01, 0xa1, 't', 0x02};
    f.sh.c = (call){.type = SH_MSG_PING, .raw = ping, .raw_len = sizeof ping};
    fx_call(&f);
    static const uint8_t err[] = {0x82, 0xa4, 'c', 'o', 'd', 'e', 0x01, 0xa3, 'm', 's', 'g', 0xa0};
    f.sh.c = (call){.type = SH_MSG_ERROR, .raw = err, .raw_len = sizeof err};
    fx_call(&f);
    sh_proto_kv_alloc *r = alloc(&f, 7, 0, NULL, 0, 0);
    CHECK_INT_EQ(r->status, 0);
    CHECK_UINT_EQ(r->available, 7);
    /* A KV_ALLOC without its required "n", and a KV_FORK whose "n" is a string. */
    static const uint8_t no_n[] = {0x81, 0xa2, 'i', 'd', 0x05};
    f.sh.c = (call){.type = SH_MSG_KV_ALLOC, .request = true, .raw = no_n, .raw_len = sizeof no_n};
    fx_call(&f);
    CHECK_UINT_EQ(f.sh.r_type, SH_MSG_KV_ALLOC);
    CHECK_INT_EQ(f.sh.ra.status, SH_EPROTO);
    static const uint8_t bad_fork[] = {0x83, 0xa2, 'i',  'd',  0x05, 0xa3, 'n',
                                       'e',  'w',  0x06, 0xa1, 'n',  0xa1, 'x'};
    f.sh.c = (call){
        .type = SH_MSG_KV_FORK, .request = true, .raw = bad_fork, .raw_len = sizeof bad_fork};
    fx_call(&f);
    CHECK_UINT_EQ(f.sh.r_type, SH_MSG_KV_FORK);
    CHECK_INT_EQ(f.sh.rf.status, SH_EPROTO);
    /* A KV_FREE without its "id" (one-way): logged and dropped. */
    static const uint8_t no_id[] = {0x81, 0xa1, 'n', 0x01};
    f.sh.c = (call){.type = SH_MSG_KV_FREE, .raw = no_id, .raw_len = sizeof no_id};
    fx_call(&f);
    /* Known sequence: ids that do not match n_tokens; computed beyond what is reserved. */
    CHECK_INT_EQ(alloc(&f, 7, 2, p, 3, 0)->status, SH_EINVAL);
    CHECK_INT_EQ(alloc(&f, 7, 1, NULL, 0, 9)->status, SH_EINVAL);
    CHECK_UINT_EQ(f.sh.n_blocks, 1);
    /* Unknown sequence with computed positions. */
    CHECK_INT_EQ(alloc(&f, 8, 1, NULL, 0, 3)->status, SH_EINVAL);
    CHECK_UINT_EQ(f.sh.n_blocks, 0);
    /* A repeated (lower) computed is harmless. */
    CHECK_INT_EQ(alloc(&f, 7, 0, NULL, 0, 4)->status, 0);
    CHECK_INT_EQ(alloc(&f, 7, 1, NULL, 0, 2)->status, 0);
    CHECK_UINT_EQ(f.sh.ra.available, 6);
    /* max_seqs (4) live: the fifth is SH_EBUSY. */
    for (uint64_t s = 20; s < 23; s++)
        CHECK_INT_EQ(alloc(&f, s, 1, NULL, 0, 0)->status, 0);
    CHECK_INT_EQ(alloc(&f, 23, 1, NULL, 0, 0)->status, SH_EBUSY);
    fx_finish(&f);
}

/* Many sequence ids through the id map (colliding and wrapping probe chains, deletions in every
 * order), then ALLOC/FREE rounds on the kvmgr's loop with no heap allocation there. */
static void test_churn_no_alloc(void)
{
    fixture f;
    fx_start(&f, 64, 8, 4, true);
    int32_t p[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    uint64_t live[8];
    int n_live = 0;
    uint64_t x = 12345;
    for (int i = 0; i < 400; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (n_live == 8 || (n_live > 0 && (x >> 60) < 6)) {
            int k = (int)((x >> 32) % (uint64_t)n_live);
            free_seq(&f, live[k], 0);
            live[k] = live[--n_live];
        } else {
            /* Ids that share their low bits stress the probing. */
            uint64_t id = (x >> 40) << 20 | (uint64_t)(i & 3);
            sh_proto_kv_alloc *r = alloc(&f, id, 4, NULL, 0, 0);
            CHECK_INT_EQ(r->status, 0);
            CHECK_UINT_EQ(f.sh.n_blocks, 1);
            live[n_live++] = id;
        }
        /* One block per live sequence. */
        CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), n_live);
    }
    for (int k = 0; k < n_live; k++) {
        CHECK_INT_EQ(alloc(&f, live[k], 0, NULL, 0, 0)->status, 0);
        CHECK_UINT_EQ(f.sh.n_blocks, 1);
        free_seq(&f, live[k], 0);
    }
    CHECK_INT_EQ(gauge(&f, "shoal_kv_blocks_used"), 0);

    /* Steady state. Warm up the runtime's message pool first, then count. */
    for (int i = 0; i < 20; i++) {
        alloc(&f, 500, 8, p, 8, 0);
        alloc(&f, 500, 1, p, 1, 8);
        free_seq(&f, 500, 9);
    }
    atomic_store(&n_allocs, 0);
    atomic_store_explicit(&watching, 1, memory_order_release);
    for (int i = 0; i < 200; i++) {
        CHECK_INT_EQ(alloc(&f, 600 + (uint64_t)i, 8, p, 8, 0)->status, 0);
        CHECK_INT_EQ(alloc(&f, 600 + (uint64_t)i, 1, p, 1, 8)->status, 0);
        free_seq(&f, 600 + (uint64_t)i, 9);
    }
    atomic_store(&watching, 0);
    CHECK_INT_EQ(atomic_load(&n_allocs), 0);
    CHECK(counter(&f, "shoal_prefix_cache_hit_tokens_total") > 0);
    fx_finish(&f);
}

/* The wrapper must really be in place, or the count above proves nothing. */
static void test_wrap_active(void)
{
    watched = pthread_self();
    atomic_store(&n_allocs, 0);
    atomic_store(&watching, 1);
    void *volatile probe = malloc(16);
    free(probe);
    atomic_store(&watching, 0);
    CHECK_INT_EQ(atomic_load(&n_allocs), 1);
}

static const sh_test_case tests[] = {
    {"wrap_active", test_wrap_active},
    {"prefix_hit_after_free", test_prefix_hit_after_free},
    {"prefix_cache_off", test_prefix_cache_off},
    {"busy_and_range", test_busy_and_range},
    {"fork", test_fork},
    {"keep", test_keep},
    {"reset", test_reset},
    {"bad_input", test_bad_input},
    {"churn_no_alloc", test_churn_no_alloc},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
