/* libFuzzer target for POST /v1/responses: the first byte picks the limits, the rest is the
 * request body. A body that parses has its echo turned into a response whose text is the body's
 * own bytes in pieces (UTF-8 cut anywhere) and whose calls are its messages' tool calls, streamed
 * and whole; an error becomes its JSON. Nothing may crash or leak, every event's data and every
 * body must be JSON, and sequence numbers must count up from 0. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/openai.h"
#include "net/openai_responses.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void must_be_json(char *s)
{
    if (!s)
        return; /* out of memory is allowed */
    json_t *j = json_loads(s, JSON_DECODE_ANY, NULL);
    if (!j)
        abort();
    json_decref(j);
    free(s);
}

/* Each "event: T\ndata: D\n\n" block: D is JSON of type T with the next sequence number. */
static void check_events(const char *ev, int64_t *seq)
{
    if (!ev)
        return;
    while (*ev) {
        const char *nl = strchr(ev, '\n'), *end = strstr(ev, "\n\n");
        if (strncmp(ev, "event: ", 7) || !nl || !end || strncmp(nl + 1, "data: ", 6))
            abort();
        json_t *d = json_loadb(nl + 7, (size_t)(end - nl - 7), 0, NULL);
        const char *type = json_string_value(json_object_get(d, "type"));
        if (!type || strncmp(ev + 7, type, strlen(type)) ||
            json_integer_value(json_object_get(d, "sequence_number")) != (*seq)++)
            abort();
        json_decref(d);
        ev = end + 2;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    static const char *const models[] = {"m"};
    sh_openai_limits lim = {.models = data[0] & 1 ? models : NULL,
                            .n_models = data[0] & 1 ? 1 : 0,
                            .max_messages = data[0] & 2 ? 4 : 0};
    sh_openai_request *r = NULL;
    sh_openai_error err;
    if (sh_openai_responses_parse((const char *)data + 1, size - 1, &lim, &r, &err)) {
        if (err.status < 400 || err.status > 599)
            abort();
        must_be_json(sh_openai_error_json(&err));
        return 0;
    }
    if (!r->resp_echo || r->kind != SH_OPENAI_CHAT || r->n != 1)
        abort();
    sh_openai_usage usage = {3, 4, 1};
    for (int whole = 0; whole < 2; whole++) {
        sh_openai_resp s;
        if (sh_openai_resp_init(&s, "resp_x", 1, r->model, r->resp_echo))
            break;
        int64_t seq = 0;
        if (!whole)
            check_events(sh_openai_resp_start(&s), &seq);
        size_t step = 1 + (data[0] >> 5);
        for (size_t i = 1; i < size; i += step) {
            size_t n = size - i < step ? size - i : step;
            const char *ev = sh_openai_resp_text(&s, (const char *)data + i, n);
            if (!whole)
                check_events(ev, &seq);
        }
        for (int32_t m = 0; m < r->n_messages; m++) {
            if (!r->messages[m].tool_calls)
                continue;
            char *calls = json_dumps(r->messages[m].tool_calls, JSON_COMPACT);
            const char *ev = sh_openai_resp_calls(&s, calls);
            if (!whole)
                check_events(ev, &seq);
            free(calls);
        }
        if (whole) {
            must_be_json(sh_openai_resp_json(
                &s, data[0] & 4 ? SH_OPENAI_FINISH_LENGTH : SH_OPENAI_FINISH_STOP, &usage));
        } else if (data[0] & 8) {
            sh_openai_error_set(&err, 503, NULL, NULL, "stopping");
            check_events(sh_openai_resp_fail(&s, &err), &seq);
        } else {
            check_events(sh_openai_resp_end(&s, SH_OPENAI_FINISH_STOP, &usage), &seq);
        }
        sh_openai_resp_fini(&s);
    }
    sh_openai_request_free(r);
    return 0;
}
