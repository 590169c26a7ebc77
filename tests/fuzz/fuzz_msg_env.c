/* libFuzzer target for whole frames: envelope and typed body decoding of arbitrary bytes, then
 * the round-trip property: a frame that decodes re-encodes to bytes that decode to the same
 * re-encoding. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static max_align_t arena_mem[(1 << 22) / sizeof(max_align_t)];

/* Exactly one reason counted per failed decode, none per success. */
static void check_counted(const sh_msg_stats *before, const sh_msg_stats *after, sh_err err)
{
    uint64_t n = 0;
    for (int r = 0; r < SH_MSG_REJECT_COUNT_; r++)
        n += after->rejected[r] - before->rejected[r];
    if (n != (err != SH_OK))
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    c.max_frame = 1 << 20;
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_msg_env env;
    sh_proto_body body;
    sh_error e = {0};
    /* The seal check of frames between nodes: never reads out of bounds; on success the frame
     * to decode is the input less its trailer; on failure exactly one reason is counted. */
    sh_msg_stats before = c.stats;
    size_t inner = 0;
    sh_err us = sh__msg_unseal(&c, data, size, &inner, &e);
    check_counted(&before, &c.stats, us);
    if (us == SH_OK && inner != size - SH_MSG_SEAL_BYTES)
        __builtin_trap();
    (void)sh__msg_foreign_unsealed(data, size);
    memset(&e, 0, sizeof e);
    before = c.stats;
    sh_err err = sh__proto_decode(&c, data, size, &env, &body, &a, &e);
    check_counted(&before, &c.stats, err);
    if (err) {
        if ((err != SH_EFORMAT && err != SH_EPROTO && err != SH_ERANGE) || !e.msg[0])
            __builtin_trap();
        if (env.n_fields > 8)
            __builtin_trap();
        return 0;
    }
    if (env.body < data || env.body + env.body_len != data + size)
        __builtin_trap();
    /* Re-encoding reads every view and list (ASan checks they lie in the input). */
    sh_buf b1, b2;
    sh__buf_init(&b1);
    sh__buf_init(&b2);
    if (sh__proto_encode(&b1, &env.hdr, &body, &e) != SH_OK)
        __builtin_trap(); /* the decoder accepted what the encoder refuses */
    sh__proto_arena_reset(&a);
    sh_msg_env env2;
    if (sh__proto_decode(&c, b1.data, b1.len, &env2, &body, &a, &e) != SH_OK)
        __builtin_trap();
    if (sh__proto_encode(&b2, &env2.hdr, &body, &e) != SH_OK || b1.len != b2.len ||
        memcmp(b1.data, b2.data, b1.len) != 0 || memcmp(&env.hdr, &env2.hdr, sizeof env.hdr))
        __builtin_trap();
    sh__buf_fini(&b1);
    sh__buf_fini(&b2);
    return 0;
}
