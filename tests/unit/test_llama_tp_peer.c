/* A tensor-parallel rank whose peer leaves (model/llama.c): the all-reduces of a forward pass run
 * on the backend's thread in stream order, so a peer that is gone must surface as the forward
 * call's error, naming the layer and the collective's message, within the group's timeout and
 * not at the end of it, and the next call must fail the same way (the group is broken), never
 * hang or compute on. Ranks are threads of this process over the in-process shared-memory
 * collective, on stories260K; the peer runs one pass with rank 0 and then leaves the group (that
 * ranks which stay agree pass after pass is test_llama_tp's). Usage: test_llama_tp_peer [case]. */
#include <pthread.h>
#include <time.h>

#include "base/error.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "runtime/coll.h"
#include "sh_test.h"

#define STORIES "tests/data/stories260K/stories260K.bin"
#define GROUP_BYTES ((size_t)4 << 20)
#define TIMEOUT_MS 20000

typedef struct rank_run {
    int32_t rank;
    int32_t passes; /* forward passes this rank runs before it leaves (or fails) */
    sh_coll_inproc *g;
    int32_t ok;       /* passes that succeeded */
    char msg[2][512]; /* the errors of the first two failing passes */
    double fail_s;    /* seconds the first failing pass took */
} rank_run;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *c = NULL;
    sh_coll *coll = NULL;
    sh_llama_load_opts lo = {.tp_rank = r->rank, .tp_size = 2};
    sh_backend_cpu_opts bo = {.n_threads = 1, .no_spin = 1};
    sh_llama_ctx_opts co = {.max_tokens = 32, .max_seqs = 1, .max_logits = 1, .kv_tokens = 256};
    sh_coll_opts o = {.rank = r->rank,
                      .size = 2,
                      .epoch = 1,
                      .timeout_ms = TIMEOUT_MS,
                      .max_bytes = GROUP_BYTES,
                      .inproc = r->g};
    if (sh_llama_load(sh_test_path(STORIES), &lo, &m, &e) || sh_backend_cpu_create(&bo, &be, &e) ||
        sh_coll_create(SH_COLL_SHM, &o, &coll, &e)) {
        snprintf(r->msg[0], sizeof r->msg[0], "setup: %s", e.msg);
        goto out;
    }
    co.comm = (sh_llama_comm){sh_coll_rank(coll), sh_coll_size(coll), coll, sh_coll_allreduce_ud,
                              sh_coll_allgather_ud};
    if (sh_llama_ctx_create(m, be, &co, &c, &e)) {
        snprintf(r->msg[0], sizeof r->msg[0], "setup: %s", e.msg);
        goto out;
    }
    const int32_t V = m->hp.n_vocab;
    int32_t tokens[16], blocks[16], fails = 0;
    for (int32_t i = 0; i < 16; i++) {
        tokens[i] = 1 + (i * 37 + 5) % (V - 1);
        blocks[i] = i;
    }
    for (int32_t p = 0; p < r->passes && fails < 2; p++) {
        sh_llama_seq s = {.tokens = tokens,
                          .n_tokens = 16,
                          .pos0 = 16 * p,
                          .blocks = blocks,
                          .want_logits = true};
        sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
        sh_llama_out out;
        double t0 = now_s();
        if (sh_llama_forward(c, &b, &out, &e)) {
            if (fails == 0)
                r->fail_s = now_s() - t0;
            snprintf(r->msg[fails++], sizeof r->msg[0], "%s", e.msg);
            continue;
        }
        r->ok++;
    }
out:
    sh_llama_ctx_destroy(c);
    sh_coll_destroy(coll); /* leaves the group: the peer's next collective fails */
    sh_backend_destroy(be);
    sh_llama_destroy(m);
    return NULL;
}

static void run_pair(rank_run *r0, rank_run *r1)
{
    sh_error e = {0};
    sh_coll_inproc *g = NULL;
    CHECK_OK(sh_coll_inproc_create(2, GROUP_BYTES, &g, &e));
    r0->g = r1->g = g;
    pthread_t t0, t1;
    pthread_create(&t0, NULL, rank_main, r0);
    pthread_create(&t1, NULL, rank_main, r1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
    sh_coll_inproc_destroy(g);
}

/* Rank 1 runs one pass and leaves; rank 0's second pass fails at layer 0's all-reduce, quickly
 * (the peer's state is seen, not the timeout), and its third fails too. */
static void test_peer_leaves(void)
{
    static rank_run r0, r1;
    r0 = (rank_run){.rank = 0, .passes = 3};
    r1 = (rank_run){.rank = 1, .passes = 1};
    run_pair(&r0, &r1);
    CHECK_INT_EQ(r1.ok, 1);
    CHECK_INT_EQ(r0.ok, 1);
    fprintf(stderr, "rank 0, pass 2 (%.3f s): %s\nrank 0, pass 3: %s\n", r0.fail_s, r0.msg[0],
            r0.msg[1]);
    CHECK(strstr(r0.msg[0], "layer 0") != NULL);
    CHECK(strstr(r0.msg[0], "all-reduce") != NULL);
    CHECK(r0.msg[1][0] != '\0');
    CHECK(r0.fail_s < TIMEOUT_MS / 2000.0);
}

static const sh_test_case tests[] = {
    {"peer_leaves", test_peer_leaves},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
