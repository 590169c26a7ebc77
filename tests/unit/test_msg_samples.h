/* Valid messages of every type with random, never-zero values, for the codec tests and corpus. */
#ifndef SH_TEST_MSG_SAMPLES_H
#define SH_TEST_MSG_SAMPLES_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/proto.h"

/* A message and the memory its views point to (one pool, freed by test_sample_free). */
typedef struct test_sample {
    sh_msg_hdr hdr;
    sh_proto_body body;
    uint8_t *pool;
    size_t used, cap;
    uint64_t rng;
} test_sample;

/* Fills s with a valid message of `type` whose values are drawn from `seed`. ACT carries a
 * hidden-state tensor of about `act_bytes` bytes (at least a few rows). */
void test_sample_make(test_sample *s, sh_msg_type type, uint64_t seed, size_t act_bytes);

void test_sample_free(test_sample *s);

/* xorshift64*: a small deterministic generator for tests. */
uint64_t test_rand(uint64_t *state);

#endif
