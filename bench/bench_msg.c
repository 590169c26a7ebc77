/* Wire codec speed: encode and decode of a message with a 64-byte body and of 1 MiB and 8 MiB ACT
 * frames, reusing one buffer as a sender would; one JSON object per line. Encoding an ACT frame
 * copies the activations into the frame once; decoding it copies nothing. The round trip is also
 * timed with the seal frames between nodes carry (encode, seal; unseal, decode: runtime/msg.h),
 * and the CRC-32C alone, instruction and tables. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/crc32c.h"
#include "runtime/proto.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static volatile uint64_t sink;

/* Runs encode, decode and both, each for about `secs`, and prints one line. */
static int run(const char *name, const sh_msg_hdr *h, const void *body, double secs)
{
    sh_buf b;
    sh__buf_init(&b);
    sh_error e = {0};
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    static max_align_t arena_mem[4096];
    sh_proto_arena a;
    sh__proto_arena_init(&a, arena_mem, sizeof arena_mem);
    if (sh__proto_encode(&b, h, body, &e)) {
        fprintf(stderr, "%s: %s\n", name, e.msg);
        return 1;
    }
    size_t frame = b.len;
    sh_msg_env env;
    sh_proto_body out;
    if (sh__proto_decode(&c, b.data, b.len, &env, &out, &a, &e)) {
        fprintf(stderr, "%s: %s\n", name, e.msg);
        return 1;
    }
    size_t body_len = env.body_len;
    double rate[4];
    for (int mode = 0; mode < 4; mode++) {
        uint64_t n = 0;
        double t0 = now(), t;
        do {
            for (int i = 0; i < 64; i++) {
                if (mode != 1) {
                    sh__buf_reset(&b);
                    sh__proto_encode(&b, h, body, &e);
                }
                size_t len = b.len;
                if (mode == 3) { /* mode 3: the round trip with the seal */
                    size_t inner = 0;
                    sh__buf_append(&b, SH_MSG_SEAL_BYTES);
                    sh__msg_seal(b.data, len);
                    if (sh__msg_unseal(&c, b.data, b.len, &inner, &e) == SH_OK)
                        len = inner;
                }
                if (mode != 0) {
                    sh__proto_arena_reset(&a);
                    sh__proto_decode(&c, b.data, len, &env, &out, &a, &e);
                    sink += env.body_len;
                }
            }
            n += 64;
        } while ((t = now() - t0) < secs);
        rate[mode] = (double)n / t;
    }
    printf("{\"name\":\"msg_codec\",\"case\":\"%s\",\"frame_bytes\":%zu,\"body_bytes\":%zu,"
           "\"encode_msgs_per_s\":%.0f,\"decode_msgs_per_s\":%.0f,\"roundtrip_msgs_per_s\":%.0f,"
           "\"encode_gb_per_s\":%.3f,\"decode_gb_per_s\":%.3f,\"roundtrip_gb_per_s\":%.3f,"
           "\"sealed_roundtrip_msgs_per_s\":%.0f,\"seal_cost_ns_per_msg\":%.1f}\n",
           name, frame, body_len, rate[0], rate[1], rate[2], rate[0] * (double)frame / 1e9,
           rate[1] * (double)frame / 1e9, rate[2] * (double)frame / 1e9, rate[3],
           1e9 / rate[3] - 1e9 / rate[2]);
    sh__buf_fini(&b);
    return 0;
}

/* An ACT frame of about `bytes` of f16 activations: 4 sequences, d_model 4096. */
static int run_act(const char *name, size_t bytes, double secs)
{
    static int32_t toks[4096], blocks[256];
    for (int i = 0; i < 4096; i++)
        toks[i] = 1000 + i;
    for (int i = 0; i < 256; i++)
        blocks[i] = i * 7;
    uint64_t d = 4096, rows = bytes / (2 * d);
    sh_proto_step_seq seqs[4];
    memset(seqs, 0, sizeof seqs);
    for (int i = 0; i < 4; i++) {
        seqs[i].seq = 100 + (uint64_t)i;
        seqs[i].tokens = (sh_i32s){toks, (uint32_t)(rows / 4)};
        seqs[i].pos = 17;
        seqs[i].blocks = (sh_i32s){blocks, 64};
        seqs[i].sample = true;
        seqs[i].sampling.temperature = 0.7f;
        seqs[i].sampling.top_p = 0.9f;
        seqs[i].sampling.max_tokens = 256;
    }
    uint8_t *data = malloc(rows * d * 2);
    if (!data)
        return 1;
    for (size_t i = 0; i < rows * d * 2; i++)
        data[i] = (uint8_t)(i * 131 + 7);
    sh_proto_act act = {.step = 42, .seqs = {seqs, 4}};
    act.hidden = (sh_proto_tensor){SH_PROTO_DTYPE_F16, 2, {rows, d}, data, rows * d * 2};
    sh_msg_hdr h = {SH_MSG_ACT, 9, sh_addr_make(1, 3), sh_addr_make(2, 3), 77};
    int rc = run(name, &h, &act, secs);
    free(data);
    return rc;
}

/* CRC-32C alone over `bytes`: the instruction path and the tables. */
static void run_crc(size_t bytes, double secs)
{
    uint8_t *p = malloc(bytes);
    if (!p)
        return;
    for (size_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)(i * 131 + 7);
    double gbs[2];
    for (int hw = 0; hw < 2; hw++) {
        uint64_t n = 0;
        double t0 = now(), t;
        do {
            for (int i = 0; i < 16; i++)
                sink += hw ? sh__crc32c(0, p, bytes) : sh__crc32c_sw(0, p, bytes);
            n += 16;
        } while ((t = now() - t0) < secs);
        gbs[hw] = (double)n * (double)bytes / t / 1e9;
    }
    printf("{\"name\":\"crc32c\",\"bytes\":%zu,\"hw\":%d,\"fast_gb_per_s\":%.2f,"
           "\"tables_gb_per_s\":%.2f}\n",
           bytes, sh__crc32c_hw(), gbs[1], gbs[0]);
    free(p);
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.5;
    /* CANCEL with a reason sized so the body is 64 bytes. */
    static char reason[64];
    memset(reason, 'r', sizeof reason);
    sh_proto_cancel cancel = {.req = 0x123456789ull, .reason = {reason, 44}};
    sh_msg_hdr h = {SH_MSG_CANCEL, 1234, sh_addr_make(1, 2), sh_addr_make(3, 4), 0xabcdef};
    int rc = run("small_64B_body", &h, &cancel, secs);
    rc |= run_act("act_1MiB", (size_t)1 << 20, secs);
    rc |= run_act("act_8MiB", (size_t)8 << 20, secs);
    run_crc(64, secs);
    run_crc(4096, secs);
    run_crc((size_t)1 << 20, secs);
    return rc;
}
