/* JSON schema → GBNF: the grammar text (llama.cpp's dialect, start rule `root`) whose sentences
 * are JSON texts that validate against a schema, for structured output. Pure functions, no I/O;
 * any thread.
 *
 * Every sentence of the grammar validates against the schema (the grammar may be narrower than
 * the schema: see docs/serving.md, "JSON schema coverage", for exactly what is kept out); every
 * keyword that would change validation and is not handled is an error, never ignored. */
#ifndef SH_NET_JSON_SCHEMA_H
#define SH_NET_JSON_SCHEMA_H

#include <jansson.h>
#include <stdbool.h>

#include "shoal/err.h"

#define SH_JSON_SCHEMA_MAX_DEPTH 64        /* nesting of subschemas (and of $ref chains) */
#define SH_JSON_SCHEMA_MAX_RULES 4096      /* named rules in the output */
#define SH_JSON_SCHEMA_MAX_ENUM 1024       /* values of one enum */
#define SH_JSON_SCHEMA_MAX_REPEAT 1000     /* minLength, maxLength, minItems, maxItems, {m,n} */
#define SH_JSON_SCHEMA_MAX_BYTES (1 << 20) /* grammar text */
#define SH_JSON_SCHEMA_MAX_WS 20           /* whitespace characters between two tokens */

typedef struct sh_json_schema_opts {
    /* true: an object schema without additionalProperties allows no other keys (OpenAI's
     * strict mode); false: it allows any other key with any value. An explicit
     * additionalProperties (false, true or a schema) is followed either way. */
    bool strict;
} sh_json_schema_opts;

/* Converts `schema` (an object, or true for any JSON value) to GBNF text, in *gbnf (malloc'd,
 * NUL-terminated; the caller frees it). o may be NULL (strict). For OpenAI's
 * {"type": "json_object"} mode pass {"type": "object"} with strict false: any JSON object.
 *
 * Layout of the text: `root ::= ...` first, then one rule per $ref target and per shared piece
 * (in the order they were met), then the primitives used (ws, char, string, number, integer,
 * value, object, array). Tokens inside objects and arrays are separated by `ws`
 * ([ \t\n]{0,SH_JSON_SCHEMA_MAX_WS}); the root value has no whitespace before or after it.
 * Object keys come in schema order: required properties first, in the order of "properties",
 * then the optional ones in that order, then (when allowed) other keys.
 *
 * Returns SH_OK; SH_EINVAL with e naming the keyword or value and its JSON pointer
 * ("unsupported keyword 'if' at /properties/a") for a schema outside the coverage, a malformed
 * one, an unsatisfiable one (enum with no value, minimum above maximum) or one past the
 * SH_JSON_SCHEMA_MAX_* bounds; SH_ENOMEM. *gbnf is NULL on any error. */
sh_err sh_json_schema_to_gbnf(const json_t *schema, const sh_json_schema_opts *o, char **gbnf,
                              sh_error *e);

/* OpenAI's `response_format` value → grammar text for it:
 * - NULL, JSON null or {"type": "text"}: SH_OK with *gbnf NULL (no constraint);
 * - {"type": "json_object"}: any JSON object (llama.cpp's extension: with a "schema" member, that
 *   schema instead, strict);
 * - {"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}: the
 *   schema's grammar, strict unless "strict" is false; no "schema" means any JSON value.
 * *gbnf is malloc'd (the caller frees it). Errors: SH_EINVAL with e naming the problem (a
 * schema's refusal as sh_json_schema_to_gbnf words it) and `param` (64 bytes, may be NULL) the
 * request field at fault ("response_format", "response_format.type",
 * "response_format.json_schema", "response_format.json_schema.schema"); SH_ENOMEM. */
sh_err sh_json_schema_response_format(const json_t *rf, char **gbnf, char *param, sh_error *e);

#endif
