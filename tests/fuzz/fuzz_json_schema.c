/* libFuzzer target for the JSON-schema → GBNF converter (what a client's response_format reaches):
 * the first byte picks strict or not, the rest is the schema's JSON text. Nothing may crash or
 * leak; a refusal must be SH_EINVAL (or SH_ENOMEM) with a message and no output; an accepted
 * schema gives text within SH_JSON_SCHEMA_MAX_BYTES that starts with the root rule. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/json_schema.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    json_error_t je;
    json_t *j = json_loadb((const char *)data + 1, size - 1, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!j)
        return 0;
    sh_json_schema_opts o = {.strict = !(data[0] & 1)};
    char *g = (char *)"unset";
    sh_error e = {0};
    sh_err rc = sh_json_schema_to_gbnf(j, &o, &g, &e);
    if (rc == SH_OK) {
        if (!g || strncmp(g, "root ::= ", 9) != 0 || strlen(g) >= SH_JSON_SCHEMA_MAX_BYTES)
            abort();
        free(g);
    } else {
        if (g != NULL || (rc != SH_EINVAL && rc != SH_ENOMEM) || e.code != rc || !e.msg[0])
            abort();
    }
    json_decref(j);
    return 0;
}
