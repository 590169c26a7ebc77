/* Unit tests of the frame seal (runtime/msg.h): CRC-32C values, sealing every message type, and
 * a changed byte at every position of a sealed frame refused and counted; then through a
 * runtime: a corrupted frame from "another node" is counted and never delivered. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/crc32c.h"
#include "runtime/mpack_write.h"
#include "runtime/msg.h"
#include "runtime/proto.h"
#include "sh_test.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"
#include "shoal/version.h"
#include "test_msg_samples.h"

/* The check values of RFC 3720 (iSCSI) appendix B.4 and the usual "123456789". */
static void test_crc_vectors(void)
{
    uint8_t z[32] = {0}, ff[32], inc[32], dec[32];
    for (int i = 0; i < 32; i++) {
        ff[i] = 0xff;
        inc[i] = (uint8_t)i;
        dec[i] = (uint8_t)(31 - i);
    }
    for (int hw = 0; hw < 2; hw++) {
        uint32_t (*f)(uint32_t, const void *, size_t) = hw ? sh__crc32c : sh__crc32c_sw;
        CHECK_UINT_EQ(f(0, "123456789", 9), 0xe3069283u);
        CHECK_UINT_EQ(f(0, z, 32), 0x8a9136aau);
        CHECK_UINT_EQ(f(0, ff, 32), 0x62a8ab43u);
        CHECK_UINT_EQ(f(0, inc, 32), 0x46dd794eu);
        CHECK_UINT_EQ(f(0, dec, 32), 0x113fdb5cu);
        CHECK_UINT_EQ(f(0, "", 0), 0);
    }
    static const char *const how[] = {"tables", "sse4.2 instruction",
                                      "sse4.2 instruction, vpclmulqdq folding from 1 KiB"};
    fprintf(stderr, "crc32c: %s\n", how[sh__crc32c_hw()]);
}

/* The fast paths (folding from 1 KiB where the CPU can, else three chains joined above 12 KiB)
 * equal the tables at every length and alignment tried, whole or in pieces. */
static void test_crc_paths_agree(void)
{
    size_t n = 70000;
    uint8_t *buf = malloc(n + 8);
    uint64_t rng = 7;
    for (size_t i = 0; i < n + 8; i++)
        buf[i] = (uint8_t)test_rand(&rng);
    static const size_t lens[] = {0,     1,     7,     8,     9,     63,    64,    65,   255,
                                  256,   1023,  1024,  1025,  1039,  1087,  1279,  1280, 4095,
                                  12287, 12288, 12289, 24576, 24583, 36864, 50000, 70000};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        for (size_t off = 0; off < 8; off++) {
            uint32_t a = sh__crc32c(0, buf + off, lens[k]);
            uint32_t b = sh__crc32c_sw(0, buf + off, lens[k]);
            uint32_t c = sh__crc32c_insn(0, buf + off, lens[k]);
            if (a != b || c != b)
                SH_FAIL_("len %zu offset %zu: 0x%08x (fastest), 0x%08x (instruction) != "
                         "0x%08x (tables)",
                         lens[k], off, (unsigned)a, (unsigned)c, (unsigned)b);
            size_t cut = lens[k] / 3;
            CHECK_UINT_EQ(sh__crc32c(sh__crc32c(0, buf + off, cut), buf + off + cut, lens[k] - cut),
                          a);
        }
    free(buf);
}

/* Encodes sample `type` into a growable buffer with room for the seal, seals it. */
static size_t sealed_sample(sh_buf *b, sh_msg_type type, uint64_t seed, size_t act_bytes)
{
    test_sample s;
    test_sample_make(&s, type, seed, act_bytes);
    sh__buf_reset(b);
    CHECK_OK(sh__proto_encode(b, &s.hdr, &s.body, NULL));
    size_t n = b->len;
    CHECK(sh__buf_append(b, SH_MSG_SEAL_BYTES) != NULL);
    sh__msg_seal(b->data, n);
    test_sample_free(&s);
    return n;
}

/* Every type seals and unseals to the frame it was; a byte changed at any position, the trailer
 * included, by any of several patterns, is refused with SH_EFORMAT and counted once as
 * "checksum", and so is every shortened frame. */
static void test_every_position(void)
{
    sh_msg_codec c;
    sh__msg_codec_init(&c);
    sh_buf b;
    sh__buf_init(&b);
    uint64_t tried = 0, rng = 99;
    for (int t = 1; t < SH_MSG_TYPE_LIMIT_; t++) {
        if (!sh__msg_type_known((uint64_t)t))
            continue;
        size_t n = sealed_sample(&b, (sh_msg_type)t, (uint64_t)t * 31, 512);
        size_t len = n + SH_MSG_SEAL_BYTES, inner = 0;
        CHECK_OK(sh__msg_unseal(&c, b.data, len, &inner, NULL));
        CHECK_UINT_EQ(inner, n);
        sh_msg_env env;
        CHECK_OK(sh__msg_decode(&c, b.data, inner, &env, NULL));
        CHECK_INT_EQ(env.hdr.type, t);
        /* The strict decoder refuses the sealed frame as it is: the seal is not msgpack. */
        CHECK_INT_EQ(sh__msg_decode(&c, b.data, len, &env, NULL), SH_EFORMAT);
        for (size_t pos = 0; pos < len; pos++) {
            uint8_t pats[4] = {0x01, 0x80, 0xff, (uint8_t)(1 + test_rand(&rng) % 255)};
            for (int k = 0; k < 4; k++) {
                b.data[pos] ^= pats[k];
                uint64_t before = c.stats.rejected[SH_MSG_REJECT_CHECKSUM];
                sh_error e = {0};
                inner = 0;
                sh_err err = sh__msg_unseal(&c, b.data, len, &inner, &e);
                b.data[pos] ^= pats[k];
                if (err != SH_EFORMAT || inner != 0 ||
                    c.stats.rejected[SH_MSG_REJECT_CHECKSUM] != before + 1 || !e.msg[0])
                    SH_FAIL_("%s: byte %zu of %zu ^ 0x%02x: got %s", sh__msg_type_name(t), pos, len,
                             pats[k], sh_strerror(err));
                tried++;
            }
        }
        /* Two bytes apart by up to 64 bytes (bursts up to 32 bits are always caught; these
         * wider ones are caught but for one chance in 2^32). */
        for (size_t pos = 0; pos + 1 < len; pos += 3) {
            size_t other = pos + 1 + test_rand(&rng) % 64;
            if (other >= len)
                other = len - 1;
            b.data[pos] ^= 0x5a;
            b.data[other] ^= 0xa5;
            CHECK_INT_EQ(sh__msg_unseal(&c, b.data, len, &inner, NULL), SH_EFORMAT);
            b.data[pos] ^= 0x5a;
            b.data[other] ^= 0xa5;
            tried++;
        }
        for (size_t cut = 0; cut < len; cut++) {
            CHECK_INT_EQ(sh__msg_unseal(&c, b.data, cut, &inner, NULL), SH_EFORMAT);
            tried++;
        }
    }
    CHECK_UINT_EQ(c.stats.rejected[SH_MSG_REJECT_CHECKSUM], tried);
    CHECK_STR_EQ(sh__msg_reject_name(SH_MSG_REJECT_CHECKSUM), "checksum");
    fprintf(stderr, "seal: %llu changed or cut frames refused\n", (unsigned long long)tried);
    sh__buf_fini(&b);
}

/* An unsealed frame of another protocol version (an older peer) is told apart from a sealed
 * frame of ours whose version byte was changed. */
static void test_foreign_unsealed(void)
{
    uint8_t f[64];
    sh_buf b;
    sh__buf_init_fixed(&b, f, sizeof f - SH_MSG_SEAL_BYTES);
    sh__mpack_put_array(&b, 8);
    sh__mpack_put_uint(&b, SH_PROTO_MAGIC);
    sh__mpack_put_uint(&b, 1); /* the last version without the seal */
    sh__mpack_put_uint(&b, SH_MSG_PING);
    sh__mpack_put_uint(&b, 42);
    sh__mpack_put_uint(&b, sh_addr_make(1, 2));
    sh__mpack_put_uint(&b, sh_addr_make(3, 4));
    sh__mpack_put_uint(&b, 99);
    sh__mpack_put_map(&b, 0);
    CHECK(!b.failed);
    CHECK(sh__msg_foreign_unsealed(f, b.len));
    sh__msg_seal(f, b.len); /* the same bytes sealed: our frame with a bad version byte */
    CHECK(!sh__msg_foreign_unsealed(f, b.len + SH_MSG_SEAL_BYTES));
    f[2] = (uint8_t)SH_PROTO_VERSION; /* a sealed frame of ours: not foreign at all */
    CHECK(!sh__msg_foreign_unsealed(f, b.len));
    CHECK(!sh__msg_foreign_unsealed(f, 3));
}

/* ---- Through a runtime ------------------------------------------------------------------- */

static _Atomic long got;

static sh_msg_fate sink_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx;
    (void)state;
    (void)m;
    atomic_fetch_add(&got, 1);
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable sink_vt = {.name = "sink", .handle = sink_handle};

/* A sealed PING from node 2 changed at each byte in turn, then intact: only the intact one
 * arrives; the others are counted as corrupt, logged and dropped unanswered (no ERROR sent
 * back, though they carry a session). */
static void test_runtime_drops(void)
{
    sh_runtime_stats fin = {0};
    sh_runtime_opts o = {.node_id = 1, .log_level = SH_LOG_LEVEL_ERROR, .final_stats = &fin};
    sh_runtime *rt = NULL;
    CHECK_OK(sh_runtime_create(&o, &rt, NULL));
    CHECK_OK(sh_runtime_register(rt, &sink_vt, NULL));
    sh_addr sink;
    CHECK_OK(sh_actor_spawn(rt, "sink", NULL, 0, &sink, NULL));
    sh_buf b;
    sh__buf_init(&b);
    sh_msg_hdr h = {.type = SH_MSG_PING, .session = 7, .src = sh_addr_make(2, 1), .dst = sink};
    static const uint8_t body[] = {0x81, 0xa1, 'x', 0x05};
    CHECK_OK(sh__msg_encode_raw(&b, &h, body, sizeof body, NULL));
    size_t n = b.len;
    CHECK(sh__buf_append(&b, SH_MSG_SEAL_BYTES) != NULL);
    sh__msg_seal(b.data, n);
    for (size_t pos = 0; pos < b.len; pos++) {
        b.data[pos] ^= 0x10;
        CHECK_INT_EQ(sh_transport_deliver(rt, b.data, b.len, NULL), SH_EFORMAT);
        b.data[pos] ^= 0x10;
    }
    CHECK_OK(sh_transport_deliver(rt, b.data, b.len, NULL));
    for (int i = 0; i < 500 && atomic_load(&got) < 1; i++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    sh_runtime_stats st;
    sh_runtime_stats_get(rt, &st);
    CHECK_INT_EQ(atomic_load(&got), 1);
    CHECK_UINT_EQ(st.corrupt, b.len);
    CHECK_UINT_EQ(st.errors_sent, 0);
    /* The counter is on the runtime's /metrics. */
    char text[1 << 14];
    size_t tl = 0;
    CHECK_OK(sh_metrics_render(sh_runtime_metrics(rt), text, sizeof text, &tl));
    char want[96];
    snprintf(want, sizeof want, "shoal_frames_corrupt_total{node=\"1\"} %zu", b.len);
    if (!strstr(text, want))
        SH_FAIL_("no '%s' in the metrics", want);
    sh__buf_fini(&b);
    sh_runtime_destroy(rt);
    CHECK_UINT_EQ(fin.msgs_live, 0);
    CHECK_UINT_EQ(fin.actors_live, 0);
    CHECK_UINT_EQ(fin.allocs_live, 0);
}

static const sh_test_case tests[] = {
    {"crc_vectors", test_crc_vectors},       {"crc_paths_agree", test_crc_paths_agree},
    {"every_position", test_every_position}, {"foreign_unsealed", test_foreign_unsealed},
    {"runtime_drops", test_runtime_drops},   {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
