/* JSON schema → GBNF: walks the schema, emitting one expression per subschema, a named rule per
 * $ref target (so recursion works) and per shared piece, and the primitives it used. */
#include "net/json_schema.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "net/json_schema_internal.h"

static const char PRIM_WS[] = "ws ::= [ \\t\\n]{0,20}\n";
static const char PRIM_CHAR[] =
    "char ::= [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-CeEfF] "
    "[0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))\n";
static const char PRIM_RAWCHAR[] = "rawchar ::= [^\"\\\\\\x7F\\x00-\\x1F]\n";
static const char PRIM_STRING[] = "string ::= \"\\\"\" char* \"\\\"\"\n";
static const char PRIM_NUMBER[] = "number ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15}) (\".\" "
                                  "[0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?\n";
static const char PRIM_INTEGER[] = "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n";
static const char PRIM_VALUE[] =
    "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "object ::= \"{\" ws (string ws \":\" ws value (ws \",\" ws string ws \":\" ws value)* ws)? "
    "\"}\"\n"
    "array ::= \"[\" ws (value (ws \",\" ws value)* ws)? \"]\"\n";

static const char *const ANNOTATIONS[] = {
    "title",    "description", "examples", "default",   "$schema", "$id",
    "$comment", "deprecated",  "readOnly", "writeOnly", "$defs",   "definitions",
};

static const char *const KNOWN[] = {
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
};

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static bool in_list(const char *k, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(k, list[i]) == 0)
            return true;
    return false;
}

const char *sh__json_schema_at(sh__json_schema_cv *c) { return c->path_n ? c->path : "/"; }

/* Sets the conversion's error (the first one wins): the message, " at ", the JSON pointer. */
sh_err sh__json_schema_fail(sh__json_schema_cv *c, const char *fmt, ...)
{
    if (c->err)
        return c->err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->err = sh__error_set(c->e, SH_EINVAL, "%s at %s", msg, sh__json_schema_at(c));
    return c->err;
}

/* Appends one JSON-pointer segment (~ and / escaped); returns the length to restore. */
size_t sh__json_schema_path_push(sh__json_schema_cv *c, const char *seg)
{
    size_t old = c->path_n;
    char t[2] = {'/', 0};
    size_t n = c->path_n;
    for (const char *s = t; *s && n + 1 < sizeof c->path; s++)
        c->path[n++] = *s;
    for (const char *s = seg; *s && n + 2 < sizeof c->path; s++) {
        if (*s == '~' || *s == '/') {
            c->path[n++] = '~';
            c->path[n++] = *s == '~' ? '0' : '1';
        } else {
            c->path[n++] = *s;
        }
    }
    c->path[n] = 0;
    c->path_n = n;
    return old;
}

size_t sh__json_schema_path_push_i(sh__json_schema_cv *c, size_t i)
{
    char t[24];
    snprintf(t, sizeof t, "%zu", i);
    return sh__json_schema_path_push(c, t);
}

void sh__json_schema_path_pop(sh__json_schema_cv *c, size_t old)
{
    c->path_n = old;
    c->path[old] = 0;
}

/* Adds `name ::= body` (name from prefix and a counter, or prefix itself when fixed); writes the
 * name to out (64 bytes). */
void sh__json_schema_add_rule(sh__json_schema_cv *c, const char *name, const sh__jsb *body)
{
    if (++c->n_rules > SH_JSON_SCHEMA_MAX_RULES) {
        sh__json_schema_fail(c, "more than %s named rules", "4096");
        return;
    }
    sh__jsb_puts(&c->rules, name);
    sh__jsb_puts(&c->rules, " ::= ");
    sh__jsb_put(&c->rules, body->p ? body->p : "", body->n);
    sh__jsb_puts(&c->rules, "\n");
}

/* Puts expr into out as it is when short, else as a new rule `<prefix>-<n>` referenced by name
 * (expressions used more than once stay linear in size however deep they nest). */
void sh__json_schema_put_shared(sh__json_schema_cv *c, sh__jsb *out, sh__jsb *expr,
                                const char *prefix)
{
    if (expr->n <= 24) {
        sh__jsb_put(out, expr->p, expr->n);
        return;
    }
    char name[64];
    snprintf(name, sizeof name, "%s-%d", prefix, c->n_rules + 1);
    sh__json_schema_add_rule(c, name, expr);
    sh__jsb_puts(out, name);
}

void sh__json_schema_put_rep(sh__jsb *b, long a, long z)
{
    if (a == 0 && z < 0)
        sh__jsb_puts(b, "*");
    else if (a == 1 && z < 0)
        sh__jsb_puts(b, "+");
    else if (a == 0 && z == 1)
        sh__jsb_puts(b, "?");
    else if (a == z)
        sh__jsb_printf(b, "{%ld}", a);
    else if (z < 0)
        sh__jsb_printf(b, "{%ld,}", a);
    else
        sh__jsb_printf(b, "{%ld,%ld}", a, z);
}

/* Appends a JSON value's compact text as a GBNF literal. */
void sh__json_schema_put_literal(sh__json_schema_cv *c, sh__jsb *b, const json_t *v)
{
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) {
        b->oom = true;
        return;
    }
    (void)c;
    sh__jsb_literal(b, s, strlen(s));
    free(s);
}

/* A count keyword: absent (-1), or a nonnegative integer up to SH_JSON_SCHEMA_MAX_REPEAT. */
long sh__json_schema_get_count(sh__json_schema_cv *c, const json_t *s, const char *k)
{
    const json_t *v = json_object_get(s, k);
    if (!v)
        return -1;
    double d = json_is_integer(v) ? (double)json_integer_value(v)
               : json_is_real(v)  ? json_real_value(v)
                                  : -1;
    if (d < 0 || d != floor(d)) {
        sh__json_schema_fail(c, "'%s' is not a nonnegative integer", k);
        return -1;
    }
    if (d > SH_JSON_SCHEMA_MAX_REPEAT) {
        sh__json_schema_fail(c, "'%s' above %s is not supported", k, "1000");
        return -1;
    }
    return (long)d;
}

/* --- enum, const --- */

static bool type_matches(const json_t *v, const char *t)
{
    if (strcmp(t, "null") == 0)
        return json_is_null(v);
    if (strcmp(t, "boolean") == 0)
        return json_is_boolean(v);
    if (strcmp(t, "string") == 0)
        return json_is_string(v);
    if (strcmp(t, "number") == 0)
        return json_is_number(v);
    if (strcmp(t, "integer") == 0)
        return json_is_integer(v) ||
               (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (strcmp(t, "object") == 0)
        return json_is_object(v);
    if (strcmp(t, "array") == 0)
        return json_is_array(v);
    return false;
}

static const char *const TYPES[] = {"null",    "boolean", "string", "number",
                                    "integer", "object",  "array"};

/* Checks "type" (a name or an array of names); fills types[] and returns their count, 0 when
 * absent, -1 on error. */
static int get_types(sh__json_schema_cv *c, const json_t *s, const char *types[8])
{
    const json_t *t = json_object_get(s, "type");
    if (!t)
        return 0;
    int n = 0;
    if (json_is_string(t)) {
        types[n++] = json_string_value(t);
    } else if (json_is_array(t) && json_array_size(t) > 0 && json_array_size(t) <= 7) {
        for (size_t i = 0; i < json_array_size(t); i++) {
            const json_t *x = json_array_get(t, i);
            if (!json_is_string(x)) {
                sh__json_schema_fail(c, "'type' holds a non-string");
                return -1;
            }
            types[n++] = json_string_value(x);
        }
    } else {
        sh__json_schema_fail(c, "'type' is not a type name or a non-empty array of them");
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (!in_list(types[i], TYPES, N_OF(TYPES))) {
            sh__json_schema_fail(c, "unknown type '%s'", types[i]);
            return -1;
        }
    return n;
}

static void gen_enum(sh__json_schema_cv *c, const json_t *s, sh__jsb *out, const char *const *types,
                     int n_types)
{
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (en && cn) {
        sh__json_schema_fail(c, "'enum' together with 'const' is not supported");
        return;
    }
    if (en && !json_is_array(en)) {
        sh__json_schema_fail(c, "'enum' is not an array");
        return;
    }
    size_t n = en ? json_array_size(en) : 1;
    if (n > SH_JSON_SCHEMA_MAX_ENUM) {
        sh__json_schema_fail(c, "'enum' with more than %s values is not supported", "1024");
        return;
    }
    int used = 0;
    sh__jsb_puts(out, "(");
    for (size_t i = 0; i < n; i++) {
        const json_t *v = en ? json_array_get(en, i) : cn;
        bool ok = n_types == 0;
        for (int t = 0; t < n_types; t++)
            ok |= type_matches(v, types[t]);
        if (!ok)
            continue;
        if (used++)
            sh__jsb_puts(out, " | ");
        sh__json_schema_put_literal(c, out, v);
    }
    sh__jsb_puts(out, ")");
    if (!used)
        sh__json_schema_fail(c, "unsatisfiable: no %s value matches 'type'", en ? "enum" : "const");
}

/* --- $ref, anyOf, allOf --- */

/* Resolves a local reference ("#", "#/$defs/x", any "#/a/b" pointer) against the root. */
static const json_t *resolve(sh__json_schema_cv *c, const char *ref)
{
    if (ref[0] != '#' || (ref[1] && ref[1] != '/')) {
        sh__json_schema_fail(c, "unsupported $ref '%s' (only local references '#/...')", ref);
        return NULL;
    }
    if (strchr(ref, '%')) {
        sh__json_schema_fail(c, "unsupported $ref '%s' (percent-encoding)", ref);
        return NULL;
    }
    const json_t *node = c->root;
    const char *p = ref + 1;
    char seg[256];
    while (*p == '/' && node) {
        p++;
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof seg) {
            if (p[0] == '~' && (p[1] == '0' || p[1] == '1')) {
                seg[n++] = p[1] == '0' ? '~' : '/';
                p += 2;
            } else {
                seg[n++] = *p++;
            }
        }
        seg[n] = 0;
        if (json_is_object(node)) {
            node = json_object_get(node, seg);
        } else if (json_is_array(node)) {
            char *end;
            unsigned long i = strtoul(seg, &end, 10);
            node = *seg && !*end ? json_array_get(node, i) : NULL;
        } else {
            node = NULL;
        }
    }
    if (!node || *p)
        sh__json_schema_fail(c, "unresolvable $ref '%s'", ref);
    return node;
}

static void gen_ref(sh__json_schema_cv *c, const char *ref, sh__jsb *out)
{
    for (int i = 0; i < c->n_refs; i++)
        if (strcmp(c->refs[i].ptr, ref) == 0) {
            sh__jsb_puts(out, c->refs[i].name);
            return;
        }
    const json_t *target = resolve(c, ref);
    if (!target)
        return;
    if (c->n_refs >= SH_JSON_SCHEMA_MAX_RULES) {
        sh__json_schema_fail(c, "more than %s $ref targets", "4096");
        return;
    }
    ref_rule *r = realloc(c->refs, (size_t)(c->n_refs + 1) * sizeof *r);
    if (!r) {
        c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
        return;
    }
    c->refs = r;
    r = &c->refs[c->n_refs];
    r->ptr = strdup(ref);
    if (!r->ptr) {
        c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
        return;
    }
    /* The name: "ref-" and the pointer's last segment in [a-zA-Z0-9-], then a number. */
    const char *last = strrchr(ref, '/');
    last = last ? last + 1 : "root";
    char base[40];
    size_t n = 0;
    for (; *last && n + 1 < sizeof base; last++)
        base[n++] = (char)((*last >= 'a' && *last <= 'z') || (*last >= 'A' && *last <= 'Z') ||
                                   (*last >= '0' && *last <= '9')
                               ? *last
                               : '-');
    base[n] = 0;
    snprintf(r->name, sizeof r->name, "ref-%s-%d", n ? base : "x", c->n_refs + 1);
    r->open = true;
    int self = c->n_refs++;
    char name[64];
    memcpy(name, r->name, sizeof name);
    sh__jsb_puts(out, name);
    /* Generate the target with its own pointer as the error path. */
    char saved[sizeof c->path];
    size_t saved_n = c->path_n;
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "%s", ref + 1);
    c->path_n = strlen(c->path);
    sh__jsb body = {0};
    sh__json_schema_gen(c, target, &body);
    memcpy(c->path, saved, sizeof saved);
    c->path_n = saved_n;
    /* A target that is only a reference back to itself ({"$ref": "#"} at the root, or a cycle
     * of such) matches nothing a grammar can produce. */
    for (int i = 0; i < c->n_refs && !c->err; i++)
        if (c->refs[i].open && body.p && strcmp(body.p, c->refs[i].name) == 0)
            sh__json_schema_fail(c, "$ref '%s' refers only to itself", ref);
    c->refs[self].open = false;
    if (!c->err)
        sh__json_schema_add_rule(c, name, &body);
    if (body.full || body.oom)
        out->full = true;
    sh__jsb_fini(&body);
}

/* allOf as a merge of object schemas (properties and required), the schema's own object
 * keywords included; anything else in a member is refused. */
static void gen_allof(sh__json_schema_cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *all = json_object_get(s, "allOf");
    if (!json_is_array(all) || json_array_size(all) == 0) {
        sh__json_schema_fail(c, "'allOf' is not a non-empty array");
        return;
    }
    json_t *props = json_object(), *req = json_array();
    json_t *merged =
        json_pack("{s:s, s:o, s:o}", "type", "object", "properties", props, "required", req);
    if (!merged) {
        c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
        return;
    }
    size_t n = json_array_size(all);
    for (size_t i = 0; i <= n && !c->err; i++) {
        const json_t *m = i < n ? json_array_get(all, i) : s;
        size_t old = i < n ? sh__json_schema_path_push(c, "allOf") : c->path_n;
        if (i < n)
            sh__json_schema_path_push_i(c, i);
        for (int hops = 0; json_is_object(m) && json_object_get(m, "$ref") && !c->err; hops++) {
            if (hops > SH_JSON_SCHEMA_MAX_DEPTH || json_object_size(m) != 1) {
                sh__json_schema_fail(c,
                                     "allOf member with $ref and other keywords is not supported");
                break;
            }
            if (!json_is_string(json_object_get(m, "$ref"))) {
                sh__json_schema_fail(c, "'$ref' is not a string");
                break;
            }
            m = resolve(c, json_string_value(json_object_get(m, "$ref")));
        }
        if (!c->err && !json_is_object(m))
            sh__json_schema_fail(c, "allOf member is not an object schema");
        const char *key;
        const json_t *v;
        json_object_foreach((json_t *)m, key, v)
        {
            if (c->err)
                break;
            if (in_list(key, ANNOTATIONS, N_OF(ANNOTATIONS)) ||
                (i == n && strcmp(key, "allOf") == 0))
                continue;
            if (strcmp(key, "type") == 0) {
                if (!json_is_string(v) || strcmp(json_string_value(v), "object") != 0)
                    sh__json_schema_fail(
                        c, "allOf is supported only as a merge of object schemas: 'type' is "
                           "not \"object\"");
            } else if (strcmp(key, "properties") == 0 && json_is_object(v)) {
                const char *pk;
                json_t *pv;
                json_object_foreach((json_t *)v, pk, pv)
                {
                    if (json_object_get(props, pk)) {
                        sh__json_schema_fail(
                            c, "allOf: property '%s' defined twice is not supported", pk);
                        break;
                    }
                    json_object_set(props, pk, pv);
                }
            } else if (strcmp(key, "required") == 0 && json_is_array(v)) {
                json_array_extend(req, (json_t *)v);
            } else {
                sh__json_schema_fail(
                    c,
                    "allOf is supported only as a merge of object schemas: keyword '%s' is "
                    "not",
                    key);
            }
        }
        sh__json_schema_path_pop(c, old);
    }
    if (!c->err)
        sh__json_schema_gen(c, merged, out);
    json_decref(merged);
}

static void gen_anyof(sh__json_schema_cv *c, const json_t *s, const char *kw, sh__jsb *out)
{
    const json_t *alts = json_object_get(s, kw);
    if (!json_is_array(alts) || json_array_size(alts) == 0) {
        sh__json_schema_fail(c, "'%s' is not a non-empty array", kw);
        return;
    }
    sh__jsb_puts(out, "(");
    for (size_t i = 0; i < json_array_size(alts) && !c->err; i++) {
        if (i)
            sh__jsb_puts(out, " | ");
        size_t old = sh__json_schema_path_push(c, kw);
        sh__json_schema_path_push_i(c, i);
        sh__json_schema_gen(c, json_array_get(alts, i), out);
        sh__json_schema_path_pop(c, old);
    }
    sh__jsb_puts(out, ")");
}

/* --- one subschema --- */

/* Types implied by the keywords of a schema without "type". */
static int infer_types(const json_t *s, const char *types[8])
{
    static const struct {
        const char *kw, *type;
    } K[] = {{"properties", "object"},
             {"required", "object"},
             {"additionalProperties", "object"},
             {"items", "array"},
             {"prefixItems", "array"},
             {"minItems", "array"},
             {"maxItems", "array"},
             {"minLength", "string"},
             {"maxLength", "string"},
             {"pattern", "string"},
             {"format", "string"},
             {"minimum", "number"},
             {"maximum", "number"},
             {"exclusiveMinimum", "number"},
             {"exclusiveMaximum", "number"}};
    int n = 0;
    for (size_t i = 0; i < N_OF(K); i++) {
        if (!json_object_get(s, K[i].kw))
            continue;
        bool seen = false;
        for (int t = 0; t < n; t++)
            seen |= strcmp(types[t], K[i].type) == 0;
        if (!seen)
            types[n++] = K[i].type;
    }
    return n;
}

static void gen_typed(sh__json_schema_cv *c, const json_t *s, const char *t, sh__jsb *out)
{
    if (strcmp(t, "null") == 0)
        sh__jsb_puts(out, "\"null\"");
    else if (strcmp(t, "boolean") == 0)
        sh__jsb_puts(out, "(\"true\" | \"false\")");
    else if (strcmp(t, "string") == 0)
        sh__json_schema_string(c, s, out);
    else if (strcmp(t, "number") == 0)
        sh__json_schema_number(c, s, out, true);
    else if (strcmp(t, "integer") == 0)
        sh__json_schema_number(c, s, out, false);
    else if (strcmp(t, "object") == 0)
        sh__json_schema_object(c, s, out);
    else
        sh__json_schema_array(c, s, out);
}

void sh__json_schema_gen(sh__json_schema_cv *c, const json_t *s, sh__jsb *out)
{
    if (c->err)
        return;
    if (out->full || out->oom) {
        c->err = out->oom
                     ? sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema")
                     : sh__error_set(c->e, SH_EINVAL, "the grammar for the schema exceeds %d bytes",
                                     SH_JSON_SCHEMA_MAX_BYTES);
        return;
    }
    if (json_is_true(s)) {
        c->need |= SH__JS_P_VALUE;
        sh__jsb_puts(out, "value");
        return;
    }
    if (json_is_false(s)) {
        sh__json_schema_fail(c, "unsatisfiable: schema false");
        return;
    }
    if (!json_is_object(s)) {
        sh__json_schema_fail(c, "schema is not an object or a boolean");
        return;
    }
    if (++c->depth > SH_JSON_SCHEMA_MAX_DEPTH) {
        sh__json_schema_fail(c, "schema nested deeper than %s", "64");
        c->depth--;
        return;
    }
    const char *key;
    const json_t *v;
    const char *group = NULL; /* a keyword that stands alone (with annotations and type) */
    json_object_foreach((json_t *)s, key, v)
    {
        if (in_list(key, ANNOTATIONS, N_OF(ANNOTATIONS)))
            continue;
        if (!in_list(key, KNOWN, N_OF(KNOWN))) {
            sh__json_schema_fail(c, "unsupported keyword '%s'", key);
            goto out;
        }
    }
    static const char *const ALONE[] = {"$ref", "anyOf", "oneOf"};
    for (size_t i = 0; i < N_OF(ALONE); i++)
        if (json_object_get(s, ALONE[i])) {
            if (group) {
                sh__json_schema_fail(c, "'%s' beside '%s' is not supported", ALONE[i], group);
                goto out;
            }
            group = ALONE[i];
        }
    if (group) {
        json_object_foreach((json_t *)s, key, v)
        {
            if (!in_list(key, ANNOTATIONS, N_OF(ANNOTATIONS)) && strcmp(key, group) != 0) {
                sh__json_schema_fail(c, "keyword '%s' beside '%s' is not supported", key, group);
                goto out;
            }
        }
        if (strcmp(group, "$ref") == 0) {
            const json_t *r = json_object_get(s, "$ref");
            if (!json_is_string(r) || strlen(json_string_value(r)) != json_string_length(r))
                sh__json_schema_fail(c, "'$ref' is not a string without NUL characters");
            else
                gen_ref(c, json_string_value(r), out);
        } else {
            gen_anyof(c, s, group, out);
        }
        goto out;
    }
    if (json_object_get(s, "allOf")) {
        gen_allof(c, s, out);
        goto out;
    }
    const char *types[8];
    int n_types = get_types(c, s, types);
    if (n_types < 0)
        goto out;
    if (json_object_get(s, "enum") || json_object_get(s, "const")) {
        json_object_foreach((json_t *)s, key, v)
        {
            if (!in_list(key, ANNOTATIONS, N_OF(ANNOTATIONS)) && strcmp(key, "type") != 0 &&
                strcmp(key, "enum") != 0 && strcmp(key, "const") != 0) {
                sh__json_schema_fail(c, "keyword '%s' beside '%s' is not supported", key,
                                     json_object_get(s, "enum") ? "enum" : "const");
                goto out;
            }
        }
        gen_enum(c, s, out, types, n_types);
        goto out;
    }
    if (n_types == 0)
        n_types = infer_types(s, types);
    if (n_types == 0) {
        c->need |= SH__JS_P_VALUE;
        sh__jsb_puts(out, "value");
        goto out;
    }
    if (n_types > 1)
        sh__jsb_puts(out, "(");
    for (int i = 0; i < n_types && !c->err; i++) {
        if (i)
            sh__jsb_puts(out, " | ");
        gen_typed(c, s, types[i], out);
    }
    if (n_types > 1)
        sh__jsb_puts(out, ")");
out:
    c->depth--;
}

sh_err sh_json_schema_to_gbnf(const json_t *schema, const sh_json_schema_opts *o, char **gbnf,
                              sh_error *e)
{
    *gbnf = NULL;
    if (!schema)
        return sh__error_set(e, SH_EINVAL, "no schema");
    sh__json_schema_cv c = {.root = schema, .strict = o ? o->strict : true, .e = e};
    sh__jsb root = {0}, all = {0};
    sh__json_schema_gen(&c, schema, &root);
    if (!c.err && (root.oom || c.rules.oom))
        c.err = sh__error_set(e, SH_ENOMEM, "out of memory converting a schema");
    if (!c.err) {
        sh__jsb_puts(&all, "root ::= ");
        sh__jsb_put(&all, root.p, root.n);
        sh__jsb_puts(&all, "\n");
        sh__jsb_put(&all, c.rules.p ? c.rules.p : "", c.rules.n);
        if (c.need & SH__JS_P_VALUE)
            c.need |= SH__JS_P_WS | SH__JS_P_STRING | SH__JS_P_CHAR | SH__JS_P_NUMBER;
        if (c.need & SH__JS_P_STRING)
            c.need |= SH__JS_P_CHAR;
        static const struct {
            unsigned bit;
            const char *text;
        } PR[] = {{SH__JS_P_WS, PRIM_WS},           {SH__JS_P_VALUE, PRIM_VALUE},
                  {SH__JS_P_STRING, PRIM_STRING},   {SH__JS_P_CHAR, PRIM_CHAR},
                  {SH__JS_P_RAWCHAR, PRIM_RAWCHAR}, {SH__JS_P_NUMBER, PRIM_NUMBER},
                  {SH__JS_P_INTEGER, PRIM_INTEGER}};
        for (size_t i = 0; i < N_OF(PR); i++)
            if (c.need & PR[i].bit)
                sh__jsb_puts(&all, PR[i].text);
        if (all.oom)
            c.err = sh__error_set(e, SH_ENOMEM, "out of memory converting a schema");
        else if (all.full || root.full || c.rules.full)
            c.err = sh__error_set(e, SH_EINVAL, "the grammar for the schema exceeds %d bytes",
                                  SH_JSON_SCHEMA_MAX_BYTES);
    }
    for (int i = 0; i < c.n_refs; i++)
        free(c.refs[i].ptr);
    free(c.refs);
    sh__jsb_fini(&root);
    sh__jsb_fini(&c.rules);
    if (c.err) {
        sh__jsb_fini(&all);
        return c.err;
    }
    *gbnf = all.p;
    return SH_OK;
}

static sh_err rf_fail(char *param, const char *field, sh_err rc)
{
    if (param)
        snprintf(param, 64, "%s", field);
    return rc;
}

sh_err sh_json_schema_response_format(const json_t *rf, char **gbnf, char *param, sh_error *e)
{
    *gbnf = NULL;
    if (param)
        param[0] = 0;
    if (!rf || json_is_null(rf))
        return SH_OK;
    if (!json_is_object(rf))
        return rf_fail(param, "response_format",
                       sh__error_set(e, SH_EINVAL, "response_format is not an object"));
    const json_t *type = json_object_get(rf, "type");
    if (!json_is_string(type))
        return rf_fail(param, "response_format.type",
                       sh__error_set(e, SH_EINVAL, "response_format.type is not a string"));
    const char *t = json_string_value(type);
    sh_json_schema_opts o = {.strict = true};
    const json_t *schema;
    const char *field = "response_format.json_schema.schema";
    if (strcmp(t, "text") == 0)
        return SH_OK;
    if (strcmp(t, "json_object") == 0) {
        schema = json_object_get(rf, "schema");
        field = "response_format.schema";
        if (!schema) {
            json_t *obj = json_pack("{s:s}", "type", "object");
            if (!obj)
                return sh__error_set(e, SH_ENOMEM, "out of memory");
            o.strict = false;
            sh_err rc = sh_json_schema_to_gbnf(obj, &o, gbnf, e);
            json_decref(obj);
            return rc;
        }
    } else if (strcmp(t, "json_schema") == 0) {
        const json_t *js = json_object_get(rf, "json_schema");
        if (!json_is_object(js))
            return rf_fail(
                param, "response_format.json_schema",
                sh__error_set(e, SH_EINVAL, "response_format.json_schema is not an object"));
        const json_t *strict = json_object_get(js, "strict");
        if (strict && !json_is_boolean(strict) && !json_is_null(strict))
            return rf_fail(
                param, "response_format.json_schema.strict",
                sh__error_set(e, SH_EINVAL, "response_format.json_schema.strict is not a boolean"));
        o.strict = !json_is_false(strict);
        schema = json_object_get(js, "schema");
        if (!schema)
            schema = json_true();
    } else {
        return rf_fail(param, "response_format.type",
                       sh__error_set(e, SH_EINVAL,
                                     "unknown response_format.type '%.64s' (text, json_object, "
                                     "json_schema)",
                                     t));
    }
    sh_err rc = sh_json_schema_to_gbnf(schema, &o, gbnf, e);
    if (rc == SH_EINVAL)
        rf_fail(param, field, rc);
    return rc;
}
