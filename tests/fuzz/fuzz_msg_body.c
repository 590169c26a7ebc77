/* libFuzzer target for the body decoder's dispatch over every message type: the first byte picks
 * the type (unknown ones included), the rest is the body map. A body that decodes must survive a
 * full frame round trip unchanged. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "runtime/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static max_align_t arena_mem[(1 << 22) / sizeof(max_align_t)];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    sh_msg_type type = (sh_msg_type)(data[0] & 0x1f);
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    c.max_frame = 1 << 20;
    c.max_depth = 2 + data[0] / 32; /* vary the depth limit too */
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    sh_proto_body body;
    sh_error e = {0};
    sh_err err = sh__proto_decode_body(&c, type, data + 1, size - 1, &body, &a, &e);
    uint64_t rejected = 0;
    for (int r = 0; r < SH_MSG_REJECT_COUNT_; r++)
        rejected += c.stats.rejected[r];
    if (rejected != (err != SH_OK) || c.stats.bodies_ok != (err == SH_OK))
        __builtin_trap();
    if (err) {
        if ((err != SH_EFORMAT && err != SH_EPROTO && err != SH_ERANGE) || !e.msg[0] || a.used != 0)
            __builtin_trap();
        return 0;
    }
    if (!sh__msg_type_known((uint64_t)type))
        __builtin_trap();
    sh_msg_hdr h = {type, 1, sh_addr_make(1, 1), sh_addr_make(2, 2), 3};
    sh_buf b1, b2;
    sh__buf_init(&b1);
    sh__buf_init(&b2);
    if (sh__proto_encode(&b1, &h, &body, &e) != SH_OK)
        __builtin_trap();
    sh__proto_arena_reset(&a);
    sh_msg_env env;
    c.max_depth = SH_MSG_MAX_DEPTH_DEFAULT;
    if (sh__proto_decode(&c, b1.data, b1.len, &env, &body, &a, &e) != SH_OK)
        __builtin_trap();
    if (sh__proto_encode(&b2, &env.hdr, &body, &e) != SH_OK || b1.len != b2.len ||
        memcmp(b1.data, b2.data, b1.len) != 0)
        __builtin_trap();
    sh__buf_fini(&b1);
    sh__buf_fini(&b2);
    return 0;
}
