/* libFuzzer target for the OpenAI layer a client reaches first: the first byte picks the
 * endpoint (completions or chat) and the limits, the rest is the request body. A body that parses
 * is turned into a response, a stream chunk and an error the way the gateway does, and its stop
 * strings run over the body's own bytes; nothing may crash, leak or produce invalid JSON. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/openai.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void must_be_json(char *s)
{
    if (!s)
        return; /* out of memory is allowed */
    json_error_t je;
    json_t *j = json_loads(s, JSON_DECODE_ANY, &je);
    if (!j)
        abort();
    json_decref(j);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    static const char *const models[] = {"m"};
    sh_openai_kind kind = data[0] & 1 ? SH_OPENAI_CHAT : SH_OPENAI_COMPLETION;
    sh_openai_limits lim = {.models = data[0] & 2 ? models : NULL,
                            .n_models = data[0] & 2 ? 1 : 0,
                            .max_n = 1 + (data[0] >> 5),
                            .n_vocab = data[0] & 4 ? 1000 : 0};
    sh_openai_request *r = NULL;
    sh_openai_error err;
    if (sh_openai_request_parse(kind, (const char *)data + 1, size - 1, &lim, &r, &err)) {
        if (err.status < 400 || err.status > 599)
            abort();
        must_be_json(sh_openai_error_json(&err));
        return 0;
    }
    const char *text = r->prompt ? r->prompt : r->n_messages ? r->messages[0].content : "";
    sh_openai_meta meta = {.kind = kind, .id = "x", .created = 1, .model = r->model};
    sh_openai_top top = {text, -1.5f};
    sh_openai_logprob lp = {.token = text, .logprob = -0.5f, .top = &top, .n_top = 1};
    sh_openai_choice ch = {.index = 0,
                           .text = text,
                           .finish = SH_OPENAI_FINISH_STOP,
                           .logprobs = r->logprobs ? &lp : NULL,
                           .n_logprobs = r->logprobs ? 1 : 0};
    sh_openai_usage usage = {3, 4, 1};
    must_be_json(sh_openai_response_json(&meta, &ch, 1, &usage));
    char *sse = sh_openai_chunk_sse(&meta, &ch, data[0] & 8, r->include_usage);
    if (sse && (strncmp(sse, "data: ", 6) != 0 || strlen(sse) < 8))
        abort();
    free(sse);
    sh_openai_stopper st;
    if (sh_openai_stopper_init(&st, r->stop, r->n_stop) == SH_OK) {
        const char *out;
        size_t out_len;
        bool stopped = false;
        for (size_t i = 1; i < size && !stopped; i += 3) {
            size_t n = size - i < 3 ? size - i : 3;
            if (sh_openai_stopper_feed(&st, (const char *)data + i, n, &out, &out_len, &stopped))
                break;
        }
        if (!stopped)
            sh_openai_stopper_flush(&st, &out, &out_len);
        sh_openai_stopper_fini(&st);
    }
    sh_openai_request_free(r);
    return 0;
}
