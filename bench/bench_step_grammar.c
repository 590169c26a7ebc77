/* STEP frame size with grammars: 12 sequences, each under the grammar of one of 12 JSON schemas
 * (the mix of tests/integration/test_serve_grammar.py, converted by net/json_schema.h), decoding
 * 160 tokens together, each step encoded by the real wire encoder (runtime/proto.h) two ways:
 * "every": every sampling step carries the grammar text and every generated token (as the
 * batcher sent them before step_seq.gram_hash); "first": the text and the tokens on a sequence's
 * first sampling step only, its hash and the generated count afterwards (as the batcher sends
 * them now). Prints one JSON line: bytes per step (first, mean, last) and in all, for each way.
 * Both ways write the fields gram_h and ngen (as zero when unused: the encoder writes every
 * field), so "every" is 14 bytes per sequence above what an older batcher sent. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actors/stage_grammar.h"
#include "net/json_schema.h"
#include "runtime/mpack_write.h"
#include "runtime/proto.h"

#define N_SEQ 12
#define N_GEN 160
#define N_BLK 16

static const char *const SCHEMAS[N_SEQ] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":20},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120}},\"required\":[\"name\","
    "\"age\"]}",
    "{\"type\":\"object\",\"properties\":{\"color\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"color\",\"ok\"]}",
    "{\"type\":\"array\",\"items\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":5},"
    "\"minItems\":2,\"maxItems\":4}",
    "{\"type\":\"object\",\"properties\":{\"point\":{\"type\":\"object\",\"properties\":{\"x\":"
    "{\"type\":\"number\"},\"y\":{\"type\":\"number\"}},\"required\":[\"x\",\"y\"]}},"
    "\"required\":[\"point\"]}",
    "{\"anyOf\":[{\"type\":\"string\",\"minLength\":1,\"maxLength\":8},{\"type\":\"integer\"}]}",
    "{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"cat\"},\"lives\":{\"type\":"
    "\"integer\",\"minimum\":1,\"maximum\":9}},\"required\":[\"kind\",\"lives\"]}",
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\","
    "\"minimum\":0,\"maximum\":99},\"next\":{\"anyOf\":[{\"type\":\"null\"},{\"$ref\":"
    "\"#/$defs/node\"}]}},\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\",\"maxLength\":10},{\"type\":"
    "\"boolean\"}],\"items\":false,\"minItems\":2}",
    "{\"type\":[\"string\",\"null\"],\"maxLength\":12}",
    "{\"type\":\"object\",\"properties\":{\"tags\":{\"type\":\"array\",\"items\":{\"type\":"
    "\"string\",\"maxLength\":10},\"maxItems\":3},\"id\":{\"type\":\"integer\"}},\"required\":"
    "[\"id\",\"tags\"]}",
    "{\"oneOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
    "\"required\":[\"a\"]},{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"boolean\"}},"
    "\"required\":[\"b\"]}]}",
    "{\"type\":\"number\",\"minimum\":0,\"maximum\":1}",
};

typedef struct way {
    size_t first, last, total;
} way;

int main(void)
{
    char *gram[N_SEQ] = {0};
    uint64_t hash[N_SEQ];
    size_t gram_bytes = 0;
    for (int i = 0; i < N_SEQ; i++) {
        json_error_t je;
        json_t *s = json_loads(SCHEMAS[i], 0, &je);
        sh_error e = {0};
        if (!s || sh_json_schema_to_gbnf(s, NULL, &gram[i], &e)) {
            fprintf(stderr, "schema %d: %s\n", i, s ? e.msg : je.text);
            return 1;
        }
        json_decref(s);
        hash[i] = sh__sgram_text_hash((sh_strv){gram[i], (uint32_t)strlen(gram[i])});
        gram_bytes += strlen(gram[i]);
    }
    int32_t toks[N_SEQ][64 + N_GEN], blocks[N_SEQ][N_BLK];
    for (int i = 0; i < N_SEQ; i++) {
        for (int j = 0; j < 64 + N_GEN; j++)
            toks[i][j] = 1000 + 37 * i + 11 * j;
        for (int j = 0; j < N_BLK; j++)
            blocks[i][j] = i * N_BLK + j;
    }
    sh_proto_step_seq q[N_SEQ];
    way w[2] = {{0}};
    sh_buf b;
    sh__buf_init(&b);
    for (int mode = 0; mode < 2; mode++) {
        for (int g = 0; g < N_GEN; g++) {
            for (int i = 0; i < N_SEQ; i++) {
                const int32_t *t = toks[i];
                q[i] = (sh_proto_step_seq){.seq = 100 + (uint64_t)i,
                                           .tokens = {t + 63 + g, 1},
                                           .pos = (uint32_t)(63 + g),
                                           .blocks = {blocks[i], N_BLK},
                                           .sample = true,
                                           .sampling = {.temperature = 1.0f,
                                                        .top_p = 1.0f,
                                                        .repeat_penalty = 1.0f,
                                                        .penalty_last_n = 64,
                                                        .max_tokens = N_GEN}};
                bool text = mode == 0 || g == 0;
                if (text) {
                    q[i].sampling.grammar = (sh_strv){gram[i], (uint32_t)strlen(gram[i])};
                    q[i].gen = (sh_i32s){t + 64, (uint32_t)g};
                } else {
                    q[i].gram_hash = hash[i];
                }
                if (mode == 1)
                    q[i].n_gen = (uint32_t)g;
            }
            sh_proto_step st = {.step = 1 + (uint64_t)g, .seqs = {q, N_SEQ}, .epoch = 1};
            sh_msg_hdr h = {.type = SH_MSG_STEP, .session = 1, .src = 1, .dst = 2};
            sh_error e = {0};
            sh__buf_reset(&b);
            if (sh__proto_encode_step(&b, &h, &st, &e)) {
                fprintf(stderr, "encode: %s\n", e.msg);
                return 1;
            }
            if (g == 0)
                w[mode].first = b.len;
            w[mode].last = b.len;
            w[mode].total += b.len;
        }
    }
    printf("{\"bench\":\"step_grammar\",\"seqs\":%d,\"steps\":%d,\"grammar_bytes\":%zu,"
           "\"every\":{\"first\":%zu,\"mean\":%zu,\"last\":%zu,\"total\":%zu},"
           "\"first\":{\"first\":%zu,\"mean\":%zu,\"last\":%zu,\"total\":%zu},"
           "\"ratio_total\":%.2f}\n",
           N_SEQ, N_GEN, gram_bytes, w[0].first, w[0].total / N_GEN, w[0].last, w[0].total,
           w[1].first, w[1].total / N_GEN, w[1].last, w[1].total,
           (double)w[0].total / (double)w[1].total);
    sh__buf_fini(&b);
    for (int i = 0; i < N_SEQ; i++)
        free(gram[i]);
    return 0;
}
