/* Helpers shared by the runtime tests: runtimes with leak checks, waiting, tiny message bodies. */
#ifndef SH_TEST_RUNTIME_UTIL_H
#define SH_TEST_RUNTIME_UTIL_H

#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "runtime/msg.h"
#include "sh_test.h"
#include "shoal/runtime.h"

/* A runtime whose final counters are checked by rt_finish(). */
typedef struct test_rt {
    sh_runtime *rt;
    sh_runtime_stats fin;
} test_rt;

static inline void rt_start(test_rt *t, uint32_t node, uint32_t loops, sh_runtime_opts *o)
{
    sh_runtime_opts def = {0};
    if (!o)
        o = &def;
    o->node_id = node;
    o->n_loops = loops;
    o->final_stats = &t->fin;
    memset(&t->fin, 0xff, sizeof t->fin);
    sh_error e = {0};
    t->rt = NULL;
    sh_err err = sh_runtime_create(o, &t->rt, &e);
    if (err)
        fprintf(stderr, "runtime create: %s\n", e.msg);
    CHECK_OK(err);
}

/* Destroys the runtime and checks that nothing is left: actors, messages, handles, threads and
 * allocations made through the runtime. */
static inline void rt_finish(test_rt *t)
{
    sh_runtime_destroy(t->rt);
    t->rt = NULL;
    CHECK_UINT_EQ(t->fin.actors_live, 0);
    CHECK_UINT_EQ(t->fin.msgs_live, 0);
    CHECK_UINT_EQ(t->fin.handles_live, 0);
    CHECK_UINT_EQ(t->fin.threads_live, 0);
    CHECK_UINT_EQ(t->fin.allocs_live, 0);
}

static inline uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Waits up to `ms` for *v >= target; returns whether it got there. */
static inline int wait_ge(_Atomic long *v, long target, unsigned ms)
{
    uint64_t end = now_ms() + ms;
    while (atomic_load(v) < target) {
        if (now_ms() > end)
            return 0;
        sleep_ms(1);
    }
    return 1;
}

/* A body {"d": bin(8)} carrying two u32: who sent it and its sequence number. */
static inline void body_make(uint8_t *b, uint32_t who, uint32_t seq)
{
    b[0] = 0x81;
    b[1] = 0xa1;
    b[2] = 'd';
    b[3] = 0xc4;
    b[4] = 8;
    memcpy(b + 5, &who, 4);
    memcpy(b + 9, &seq, 4);
}

static inline void body_read(const sh_msg *m, uint32_t *who, uint32_t *seq)
{
    size_t n = 0;
    const uint8_t *b = sh_msg_body(m, &n);
    *who = *seq = UINT32_MAX;
    if (n == 13 && b[4] == 8) {
        memcpy(who, b + 5, 4);
        memcpy(seq, b + 9, 4);
    }
}

static inline sh_err send_body(sh_runtime *rt, sh_addr src, sh_addr dst, uint64_t session,
                               uint32_t type, uint32_t who, uint32_t seq)
{
    uint8_t b[13];
    body_make(b, who, seq);
    sh_msg_hdr h = {.type = (sh_msg_type)type, .session = session, .src = src, .dst = dst};
    return sh_send(rt, &h, b, sizeof b, NULL);
}

#endif
