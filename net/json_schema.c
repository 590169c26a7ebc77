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

/* Primitive rules, emitted at the end when used. */
enum {
    P_WS = 1 << 0,
    P_CHAR = 1 << 1,
    P_RAWCHAR = 1 << 2,
    P_STRING = 1 << 3,
    P_NUMBER = 1 << 4,
    P_INTEGER = 1 << 5,
    P_VALUE = 1 << 6,
};

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

typedef struct ref_rule {
    char *ptr; /* the $ref text */
    char name[64];
    bool open; /* its body is being generated */
} ref_rule;

typedef struct cv {
    const json_t *root;
    bool strict;
    sh_error *e;
    sh_err err;
    sh__jsb rules; /* named rules other than root and the primitives, in creation order */
    int n_rules;
    ref_rule *refs;
    int n_refs;
    unsigned need;
    char path[512];
    size_t path_n;
    int depth;
} cv;

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

static const char *at(cv *c) { return c->path_n ? c->path : "/"; }

static sh_err fail(cv *c, const char *fmt, ...) SH_PRINTF(2, 3);

/* Sets the conversion's error (the first one wins): the message, " at ", the JSON pointer. */
static sh_err fail(cv *c, const char *fmt, ...)
{
    if (c->err)
        return c->err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->err = sh__error_set(c->e, SH_EINVAL, "%s at %s", msg, at(c));
    return c->err;
}

/* Appends one JSON-pointer segment (~ and / escaped); returns the length to restore. */
static size_t path_push(cv *c, const char *seg)
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

static size_t path_push_i(cv *c, size_t i)
{
    char t[24];
    snprintf(t, sizeof t, "%zu", i);
    return path_push(c, t);
}

static void path_pop(cv *c, size_t old)
{
    c->path_n = old;
    c->path[old] = 0;
}

/* Adds `name ::= body` (name from prefix and a counter, or prefix itself when fixed); writes the
 * name to out (64 bytes). */
static void add_rule(cv *c, const char *name, const sh__jsb *body)
{
    if (++c->n_rules > SH_JSON_SCHEMA_MAX_RULES) {
        fail(c, "more than %s named rules", "4096");
        return;
    }
    sh__jsb_puts(&c->rules, name);
    sh__jsb_puts(&c->rules, " ::= ");
    sh__jsb_put(&c->rules, body->p ? body->p : "", body->n);
    sh__jsb_puts(&c->rules, "\n");
}

/* Puts expr into out as it is when short, else as a new rule `<prefix>-<n>` referenced by name
 * (expressions used more than once stay linear in size however deep they nest). */
static void put_shared(cv *c, sh__jsb *out, sh__jsb *expr, const char *prefix)
{
    if (expr->n <= 24) {
        sh__jsb_put(out, expr->p, expr->n);
        return;
    }
    char name[64];
    snprintf(name, sizeof name, "%s-%d", prefix, c->n_rules + 1);
    add_rule(c, name, expr);
    sh__jsb_puts(out, name);
}

static void put_rep(sh__jsb *b, long a, long z)
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
static void put_json_literal(cv *c, sh__jsb *b, const json_t *v)
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

static void gen(cv *c, const json_t *s, sh__jsb *out);

/* A count keyword: absent (-1), or a nonnegative integer up to SH_JSON_SCHEMA_MAX_REPEAT. */
static long get_count(cv *c, const json_t *s, const char *k)
{
    const json_t *v = json_object_get(s, k);
    if (!v)
        return -1;
    double d = json_is_integer(v) ? (double)json_integer_value(v)
               : json_is_real(v)  ? json_real_value(v)
                                  : -1;
    if (d < 0 || d != floor(d)) {
        fail(c, "'%s' is not a nonnegative integer", k);
        return -1;
    }
    if (d > SH_JSON_SCHEMA_MAX_REPEAT) {
        fail(c, "'%s' above %s is not supported", k, "1000");
        return -1;
    }
    return (long)d;
}

/* --- strings --- */

static void gen_string(cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    long mn = get_count(c, s, "minLength"), mx = get_count(c, s, "maxLength");
    if (c->err)
        return;
    bool len = mn >= 0 || mx >= 0;
    if ((pat != NULL) + (fmt != NULL) + len > 1) {
        fail(c, "combining %s with another string keyword is not supported",
             pat ? "'pattern'" : "'format'");
        return;
    }
    if (pat) {
        if (!json_is_string(pat)) {
            fail(c, "'pattern' is not a string");
            return;
        }
        size_t old = path_push(c, "pattern"), start = out->n;
        if (strlen(json_string_value(pat)) != json_string_length(pat)) {
            fail(c, "'pattern' holds a NUL character");
            return;
        }
        c->err = sh__json_schema_pattern(out, json_string_value(pat), "char", at(c), c->e);
        path_pop(c, old);
        if (out->p && strstr(out->p + start, "char*")) /* an unanchored end */
            c->need |= P_CHAR;
        return;
    }
    if (fmt) {
        if (!json_is_string(fmt)) {
            fail(c, "'format' is not a string");
            return;
        }
        if (!sh__json_schema_format(out, json_string_value(fmt)))
            fail(c, "unsupported format '%s' (supported: date, time, date-time, uuid, ipv4)",
                 json_string_value(fmt));
        return;
    }
    c->need |= P_CHAR;
    if (!len) {
        c->need |= P_STRING;
        sh__jsb_puts(out, "string");
        return;
    }
    if (mn < 0)
        mn = 0;
    if (mx >= 0 && mx < mn) {
        fail(c, "unsatisfiable: minLength above maxLength");
        return;
    }
    sh__jsb_puts(out, "\"\\\"\" char");
    put_rep(out, mn, mx);
    sh__jsb_puts(out, " \"\\\"\"");
}

/* --- numbers --- */

/* Reads a bound keyword into *v; false when absent. */
static bool get_bound(cv *c, const json_t *s, const char *k, double *v)
{
    const json_t *j = json_object_get(s, k);
    if (!j)
        return false;
    if (json_is_boolean(j)) {
        fail(c, "boolean '%s' (draft 4) is not supported", k);
        return false;
    }
    if (!json_is_number(j)) {
        fail(c, "'%s' is not a number", k);
        return false;
    }
    *v = json_number_value(j);
    return true;
}

static int64_t clamp_bound(double d)
{
    const double lim = (double)SH__JSON_SCHEMA_INT_MAX + 1;
    return d < -lim ? -(int64_t)lim : d > lim ? (int64_t)lim : (int64_t)d;
}

static void gen_number(cv *c, const json_t *s, sh__jsb *out, bool frac)
{
    double mn = 0, mx = 0, xmn = 0, xmx = 0;
    bool h_mn = get_bound(c, s, "minimum", &mn), h_mx = get_bound(c, s, "maximum", &mx);
    bool h_xmn = get_bound(c, s, "exclusiveMinimum", &xmn);
    bool h_xmx = get_bound(c, s, "exclusiveMaximum", &xmx);
    if (c->err)
        return;
    if (!h_mn && !h_mx && !h_xmn && !h_xmx) {
        c->need |= frac ? P_NUMBER : P_INTEGER;
        sh__jsb_puts(out, frac ? "number" : "integer");
        return;
    }
    /* The tighter of the inclusive and the exclusive bound on each side. */
    bool has_lo = h_mn || h_xmn, has_hi = h_mx || h_xmx;
    bool lo_x = h_xmn && (!h_mn || xmn >= mn), hi_x = h_xmx && (!h_mx || xmx <= mx);
    double lo = lo_x ? xmn : mn, hi = hi_x ? xmx : mx;
    if (frac) {
        if ((has_lo && lo != floor(lo)) || (has_hi && hi != floor(hi))) {
            fail(c, "a non-integer bound on a number is not supported (integer bounds are)");
            return;
        }
    } else {
        /* Integers: inclusive integer bounds. */
        if (has_lo)
            lo = lo_x ? floor(lo) + 1 : ceil(lo);
        if (has_hi)
            hi = hi_x ? ceil(hi) - 1 : floor(hi);
        lo_x = hi_x = false;
    }
    if (!sh__json_schema_num_range(out, has_lo, has_lo ? clamp_bound(lo) : 0, lo_x, has_hi,
                                   has_hi ? clamp_bound(hi) : 0, hi_x, frac))
        fail(c, "unsatisfiable: no %s between the bounds", frac ? "number" : "integer");
}

/* --- objects --- */

typedef struct prop {
    const char *name;
    const json_t *schema; /* NULL: any value */
} prop;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Decodes the UTF-8 code point at s[*i]. */
static uint32_t utf8_at(const char *s, size_t *i)
{
    const unsigned char *p = (const unsigned char *)s + *i;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (len > 1)
        c &= 0x3F >> (len - 1);
    for (int k = 1; k < len && p[k]; k++)
        c = c << 6 | (p[k] & 0x3F);
    *i += (size_t)len;
    return c;
}

static bool raw_cp(uint32_t c) { return c >= 0x20 && c != '"' && c != '\\' && c != 0x7F; }

/* Raw key text (no escapes) that differs from every name in names[0..n) (sorted, sharing their
 * first `off` bytes): a trie walk; each branch either follows a name or leaves all of them. */
static void not_keys(cv *c, sh__jsb *b, const char *const *names, size_t n, size_t off, int depth)
{
    if (depth > 256) {
        fail(c, "property name longer than 256 characters beside additional properties");
        return;
    }
    bool terminal = false;
    sh__jsb cls = {0};
    sh__jsb_puts(b, "(");
    bool first = true;
    for (size_t i = 0; i < n && !c->err;) {
        if (names[i][off] == 0) {
            terminal = true;
            i++;
            continue;
        }
        size_t next = off;
        uint32_t cp = utf8_at(names[i], &next);
        size_t j = i + 1;
        while (j < n && strncmp(names[j] + off, names[i] + off, next - off) == 0)
            j++;
        if (raw_cp(cp)) {
            sh__jsb_class_cp(&cls, cp);
            if (!first)
                sh__jsb_puts(b, " | ");
            first = false;
            sh__jsb_literal(b, names[i] + off, next - off);
            sh__jsb_puts(b, " ");
            not_keys(c, b, names + i, j - i, next, depth + 1);
        }
        i = j;
    }
    if (!first)
        sh__jsb_puts(b, " | ");
    sh__jsb_puts(b, "[^\"\\\\\\x7F\\x00-\\x1F");
    sh__jsb_put(b, cls.p ? cls.p : "", cls.n);
    sh__jsb_puts(b, "] rawchar*)");
    if (!terminal)
        sh__jsb_puts(b, "?");
    if (cls.full || cls.oom)
        b->full = true;
    sh__jsb_fini(&cls);
    c->need |= P_RAWCHAR;
}

/* `"key" ws ":" ws value` for one property. */
static void gen_kv(cv *c, const prop *p, sh__jsb *out)
{
    json_t *k = json_string(p->name);
    put_json_literal(c, out, k);
    json_decref(k);
    sh__jsb_puts(out, " ws \":\" ws ");
    c->need |= P_WS;
    size_t old = path_push(c, "properties");
    path_push(c, p->name);
    if (p->schema) {
        gen(c, p->schema, out);
    } else {
        c->need |= P_VALUE;
        sh__jsb_puts(out, "value");
    }
    path_pop(c, old);
}

static void gen_object(cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *add = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) {
        fail(c, "'properties' is not an object");
        return;
    }
    if (req && !json_is_array(req)) {
        fail(c, "'required' is not an array");
        return;
    }
    if (add && !json_is_boolean(add) && !json_is_object(add)) {
        fail(c, "'additionalProperties' is not a schema");
        return;
    }
    bool extra = add ? !json_is_false(add) : !c->strict;
    const json_t *extra_schema = add && json_is_object(add) ? add : NULL;
    size_t n_props = props ? json_object_size(props) : 0, n_req = req ? json_array_size(req) : 0;
    prop *list = calloc(n_props + n_req + 1, sizeof *list);
    const char **names = calloc(n_props + 1, sizeof *names);
    bool *is_req = calloc(n_props + n_req + 1, sizeof *is_req);
    if (!list || !names || !is_req) {
        c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
        goto out;
    }
    /* Required names: each must be a string; those not in properties take additionalProperties. */
    size_t n = 0, n_names = 0;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)props, key, v) names[n_names++] = key;
    for (size_t i = 0; i < n_req && !c->err; i++) {
        const json_t *r = json_array_get(req, i);
        if (!json_is_string(r)) {
            fail(c, "'required' holds a non-string");
            break;
        }
        if (props && json_object_get(props, json_string_value(r)))
            continue;
        if (!extra) {
            fail(c,
                 "unsatisfiable: required property '%s' is not in properties and no other "
                 "property is allowed",
                 json_string_value(r));
            break;
        }
        bool dup = false;
        for (size_t k = 0; k < n; k++)
            dup |= strcmp(list[k].name, json_string_value(r)) == 0;
        if (!dup) {
            list[n] = (prop){json_string_value(r), extra_schema};
            is_req[n++] = true;
        }
    }
    if (c->err)
        goto out;
    /* Order: required properties (in properties order), required others, then optional ones. */
    prop *sorted = calloc(n_props + n + 1, sizeof *sorted);
    if (!sorted) {
        c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
        goto out;
    }
    size_t k = 0, n_required = 0;
    for (int pass = 0; pass < 2; pass++) {
        json_object_foreach((json_t *)props, key, v)
        {
            bool r = false;
            for (size_t i = 0; i < n_req; i++)
                r |= json_is_string(json_array_get(req, i)) &&
                     strcmp(json_string_value(json_array_get(req, i)), key) == 0;
            if (r == (pass == 0))
                sorted[k++] = (prop){key, v};
        }
        if (pass == 0) {
            for (size_t i = 0; i < n; i++)
                sorted[k++] = list[i];
            n_required = k;
        }
    }
    size_t total = k;
    /* The expression of an extra key-value pair. */
    sh__jsb x = {0};
    if (extra) {
        c->need |= P_WS;
        if (n_names) {
            qsort(names, n_names, sizeof *names, cmp_str);
            sh__jsb_puts(&x, "\"\\\"\" ");
            not_keys(c, &x, names, n_names, 0, 0);
            sh__jsb_puts(&x, " \"\\\"\"");
        } else {
            c->need |= P_STRING | P_CHAR;
            sh__jsb_puts(&x, "string");
        }
        sh__jsb_puts(&x, " ws \":\" ws ");
        size_t old = path_push(c, "additionalProperties");
        if (extra_schema) {
            gen(c, extra_schema, &x);
        } else {
            c->need |= P_VALUE;
            sh__jsb_puts(&x, "value");
        }
        path_pop(c, old);
    }
    c->need |= P_WS;
    sh__jsb_puts(out, "\"{\" ws ");
    if (n_required) {
        for (size_t i = 0; i < total && !c->err; i++) {
            if (i > 0)
                sh__jsb_puts(out, i < n_required ? " ws \",\" ws " : " (ws \",\" ws ");
            gen_kv(c, &sorted[i], out);
            if (i >= n_required)
                sh__jsb_puts(out, ")?");
        }
        if (extra) {
            sh__jsb_puts(out, " (ws \",\" ws ");
            put_shared(c, out, &x, "kv");
            sh__jsb_puts(out, ")*");
        }
        sh__jsb_puts(out, " ws \"}\"");
    } else if (total || extra) {
        /* Any in-order subset of the optional properties, then extras: the first one present
         * starts the list. */
        char(*kv)[64] = calloc(total + 2, sizeof *kv);
        if (!kv) {
            c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
            sh__jsb_fini(&x);
            free(sorted);
            goto out;
        }
        for (size_t i = 0; i < total && !c->err; i++) {
            sh__jsb t = {0};
            gen_kv(c, &sorted[i], &t);
            snprintf(kv[i], sizeof kv[i], "kv-%d", c->n_rules + 1);
            if (total + extra > 1) {
                add_rule(c, kv[i], &t);
            } else {
                sh__jsb_puts(out, "(");
                sh__jsb_put(out, t.p, t.n);
                sh__jsb_puts(out, " ws)? \"}\"");
            }
            if (t.full || t.oom)
                out->full = true;
            sh__jsb_fini(&t);
        }
        if (extra) {
            sh__jsb x2 = {0};
            put_shared(c, &x2, &x, "kv");
            snprintf(kv[total], sizeof kv[total], "%s", x2.p ? x2.p : "");
            sh__jsb_fini(&x2);
        }
        if (total + extra > 1) {
            sh__jsb_puts(out, "((");
            /* Tail rules keep this linear: tl[i] is what may follow property i-1, namely
             * (ws "," ws kv_i)? then tl[i+1] (after the last property, the extras). */
            char(*tl)[64] = calloc(total + 1, sizeof *tl);
            if (!tl) {
                c->err = sh__error_set(c->e, SH_ENOMEM, "out of memory converting a schema");
            } else {
                sh__jsb rest = {0};
                if (extra) {
                    sh__jsb_puts(&rest, "(ws \",\" ws ");
                    sh__jsb_puts(&rest, kv[total]);
                    sh__jsb_puts(&rest, ")*");
                }
                for (size_t i = total; i-- > 1 && !c->err;) {
                    sh__jsb t = {0};
                    sh__jsb_puts(&t, "(ws \",\" ws ");
                    sh__jsb_puts(&t, kv[i]);
                    sh__jsb_puts(&t, ")?");
                    if (rest.n) {
                        sh__jsb_puts(&t, " ");
                        sh__jsb_put(&t, rest.p, rest.n);
                    }
                    snprintf(tl[i], sizeof tl[i], "tail-%d", c->n_rules + 1);
                    add_rule(c, tl[i], &t);
                    sh__jsb_fini(&t);
                    sh__jsb_fini(&rest);
                    sh__jsb_puts(&rest, tl[i]);
                }
                for (size_t i = 0; i < total + extra && !c->err; i++) {
                    if (i)
                        sh__jsb_puts(out, " | ");
                    sh__jsb_puts(out, kv[i]);
                    if (i + 1 < total) {
                        sh__jsb_puts(out, " ");
                        sh__jsb_puts(out, tl[i + 1]);
                    } else if (extra) {
                        sh__jsb_puts(out, " (ws \",\" ws ");
                        sh__jsb_puts(out, kv[total]);
                        sh__jsb_puts(out, ")*");
                    }
                }
                sh__jsb_fini(&rest);
                free(tl);
            }
            sh__jsb_puts(out, ") ws)? \"}\"");
        } else if (extra) {
            sh__jsb_puts(out, "(");
            sh__jsb_puts(out, kv[total]);
            sh__jsb_puts(out, " (ws \",\" ws ");
            sh__jsb_puts(out, kv[total]);
            sh__jsb_puts(out, ")* ws)? \"}\"");
        }
        free(kv);
    } else {
        sh__jsb_puts(out, "\"}\"");
    }
    if (x.full || x.oom)
        out->full = true;
    sh__jsb_fini(&x);
    free(sorted);
out:
    free(list);
    free(names);
    free(is_req);
}

/* --- arrays --- */

static void gen_array(cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *items = json_object_get(s, "items"), *pre = json_object_get(s, "prefixItems");
    long m = get_count(c, s, "minItems"), M = get_count(c, s, "maxItems");
    if (c->err)
        return;
    if (pre && !json_is_array(pre)) {
        fail(c, "'prefixItems' is not an array");
        return;
    }
    const char *pre_kw = "prefixItems";
    bool tuple = items && json_is_array(items);
    if (tuple) {
        /* Draft 2019 and before: "items" as an array is prefixItems; items past them (allowed
         * there unless additionalItems, which is refused, says otherwise) are not generated. */
        if (pre) {
            fail(c, "'items' as an array beside 'prefixItems' is not supported");
            return;
        }
        pre = items;
        pre_kw = "items";
    } else if (items && !json_is_boolean(items) && !json_is_object(items)) {
        fail(c, "'items' is not a schema");
        return;
    }
    long k = pre ? (long)json_array_size(pre) : 0;
    if (k > SH_JSON_SCHEMA_MAX_REPEAT) {
        fail(c, "'%s' longer than 1000 is not supported", pre_kw);
        return;
    }
    if (m < 0)
        m = 0;
    bool more = !tuple && !(items && json_is_false(items));
    if (!more && (M < 0 || M > k))
        M = k;
    if (M >= 0 && m > M) {
        fail(c, "unsatisfiable: minItems above the most items allowed");
        return;
    }
    if (M >= 0 && k > M)
        k = M;
    c->need |= P_WS;
    sh__jsb item = {0};
    if (more && (M < 0 || M > k)) {
        size_t old = path_push(c, "items");
        if (items && json_is_object(items)) {
            gen(c, items, &item);
        } else {
            c->need |= P_VALUE;
            sh__jsb_puts(&item, "value");
        }
        path_pop(c, old);
    }
    sh__jsb_puts(out, "\"[\" ws ");
    if (M == 0) {
        sh__jsb_puts(out, "\"]\"");
        sh__jsb_fini(&item);
        return;
    }
    if (m == 0)
        sh__jsb_puts(out, "(");
    if (k == 0) {
        sh__jsb shared = {0};
        put_shared(c, &shared, &item, "item");
        sh__jsb_put(out, shared.p, shared.n);
        if (M != 1) {
            sh__jsb_puts(out, " (ws \",\" ws ");
            sh__jsb_put(out, shared.p, shared.n);
            sh__jsb_puts(out, ")");
            put_rep(out, m > 0 ? m - 1 : 0, M < 0 ? -1 : M - 1);
        }
        sh__jsb_fini(&shared);
    } else {
        int opened = 0;
        for (long i = 0; i < k && !c->err; i++) {
            if (i > 0) {
                if (i >= m) {
                    sh__jsb_puts(out, " (");
                    opened++;
                } else {
                    sh__jsb_puts(out, " ");
                }
                sh__jsb_puts(out, "ws \",\" ws ");
            }
            size_t old = path_push(c, pre_kw);
            path_push_i(c, (size_t)i);
            gen(c, json_array_get(pre, (size_t)i), out);
            path_pop(c, old);
        }
        if (item.n && (M < 0 || M > k)) {
            long a = m > k ? m - k : 0, z = M < 0 ? -1 : M - k;
            sh__jsb_puts(out, " (ws \",\" ws ");
            sh__jsb_put(out, item.p, item.n);
            sh__jsb_puts(out, ")");
            put_rep(out, a, z);
        }
        for (int i = 0; i < opened; i++)
            sh__jsb_puts(out, ")?");
    }
    if (item.full || item.oom)
        out->full = true;
    sh__jsb_fini(&item);
    sh__jsb_puts(out, m == 0 ? " ws)? \"]\"" : " ws \"]\"");
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
static int get_types(cv *c, const json_t *s, const char *types[8])
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
                fail(c, "'type' holds a non-string");
                return -1;
            }
            types[n++] = json_string_value(x);
        }
    } else {
        fail(c, "'type' is not a type name or a non-empty array of them");
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (!in_list(types[i], TYPES, N_OF(TYPES))) {
            fail(c, "unknown type '%s'", types[i]);
            return -1;
        }
    return n;
}

static void gen_enum(cv *c, const json_t *s, sh__jsb *out, const char *const *types, int n_types)
{
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (en && cn) {
        fail(c, "'enum' together with 'const' is not supported");
        return;
    }
    if (en && !json_is_array(en)) {
        fail(c, "'enum' is not an array");
        return;
    }
    size_t n = en ? json_array_size(en) : 1;
    if (n > SH_JSON_SCHEMA_MAX_ENUM) {
        fail(c, "'enum' with more than %s values is not supported", "1024");
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
        put_json_literal(c, out, v);
    }
    sh__jsb_puts(out, ")");
    if (!used)
        fail(c, "unsatisfiable: no %s value matches 'type'", en ? "enum" : "const");
}

/* --- $ref, anyOf, allOf --- */

/* Resolves a local reference ("#", "#/$defs/x", any "#/a/b" pointer) against the root. */
static const json_t *resolve(cv *c, const char *ref)
{
    if (ref[0] != '#' || (ref[1] && ref[1] != '/')) {
        fail(c, "unsupported $ref '%s' (only local references '#/...')", ref);
        return NULL;
    }
    if (strchr(ref, '%')) {
        fail(c, "unsupported $ref '%s' (percent-encoding)", ref);
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
        fail(c, "unresolvable $ref '%s'", ref);
    return node;
}

static void gen_ref(cv *c, const char *ref, sh__jsb *out)
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
        fail(c, "more than %s $ref targets", "4096");
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
    gen(c, target, &body);
    memcpy(c->path, saved, sizeof saved);
    c->path_n = saved_n;
    /* A target that is only a reference back to itself ({"$ref": "#"} at the root, or a cycle
     * of such) matches nothing a grammar can produce. */
    for (int i = 0; i < c->n_refs && !c->err; i++)
        if (c->refs[i].open && body.p && strcmp(body.p, c->refs[i].name) == 0)
            fail(c, "$ref '%s' refers only to itself", ref);
    c->refs[self].open = false;
    if (!c->err)
        add_rule(c, name, &body);
    if (body.full || body.oom)
        out->full = true;
    sh__jsb_fini(&body);
}

/* allOf as a merge of object schemas (properties and required), the schema's own object
 * keywords included; anything else in a member is refused. */
static void gen_allof(cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *all = json_object_get(s, "allOf");
    if (!json_is_array(all) || json_array_size(all) == 0) {
        fail(c, "'allOf' is not a non-empty array");
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
        size_t old = i < n ? path_push(c, "allOf") : c->path_n;
        if (i < n)
            path_push_i(c, i);
        for (int hops = 0; json_is_object(m) && json_object_get(m, "$ref") && !c->err; hops++) {
            if (hops > SH_JSON_SCHEMA_MAX_DEPTH || json_object_size(m) != 1) {
                fail(c, "allOf member with $ref and other keywords is not supported");
                break;
            }
            if (!json_is_string(json_object_get(m, "$ref"))) {
                fail(c, "'$ref' is not a string");
                break;
            }
            m = resolve(c, json_string_value(json_object_get(m, "$ref")));
        }
        if (!c->err && !json_is_object(m))
            fail(c, "allOf member is not an object schema");
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
                    fail(c, "allOf is supported only as a merge of object schemas: 'type' is "
                            "not \"object\"");
            } else if (strcmp(key, "properties") == 0 && json_is_object(v)) {
                const char *pk;
                json_t *pv;
                json_object_foreach((json_t *)v, pk, pv)
                {
                    if (json_object_get(props, pk)) {
                        fail(c, "allOf: property '%s' defined twice is not supported", pk);
                        break;
                    }
                    json_object_set(props, pk, pv);
                }
            } else if (strcmp(key, "required") == 0 && json_is_array(v)) {
                json_array_extend(req, (json_t *)v);
            } else {
                fail(c,
                     "allOf is supported only as a merge of object schemas: keyword '%s' is "
                     "not",
                     key);
            }
        }
        path_pop(c, old);
    }
    if (!c->err)
        gen(c, merged, out);
    json_decref(merged);
}

static void gen_anyof(cv *c, const json_t *s, const char *kw, sh__jsb *out)
{
    const json_t *alts = json_object_get(s, kw);
    if (!json_is_array(alts) || json_array_size(alts) == 0) {
        fail(c, "'%s' is not a non-empty array", kw);
        return;
    }
    sh__jsb_puts(out, "(");
    for (size_t i = 0; i < json_array_size(alts) && !c->err; i++) {
        if (i)
            sh__jsb_puts(out, " | ");
        size_t old = path_push(c, kw);
        path_push_i(c, i);
        gen(c, json_array_get(alts, i), out);
        path_pop(c, old);
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

static void gen_typed(cv *c, const json_t *s, const char *t, sh__jsb *out)
{
    if (strcmp(t, "null") == 0)
        sh__jsb_puts(out, "\"null\"");
    else if (strcmp(t, "boolean") == 0)
        sh__jsb_puts(out, "(\"true\" | \"false\")");
    else if (strcmp(t, "string") == 0)
        gen_string(c, s, out);
    else if (strcmp(t, "number") == 0)
        gen_number(c, s, out, true);
    else if (strcmp(t, "integer") == 0)
        gen_number(c, s, out, false);
    else if (strcmp(t, "object") == 0)
        gen_object(c, s, out);
    else
        gen_array(c, s, out);
}

static void gen(cv *c, const json_t *s, sh__jsb *out)
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
        c->need |= P_VALUE;
        sh__jsb_puts(out, "value");
        return;
    }
    if (json_is_false(s)) {
        fail(c, "unsatisfiable: schema false");
        return;
    }
    if (!json_is_object(s)) {
        fail(c, "schema is not an object or a boolean");
        return;
    }
    if (++c->depth > SH_JSON_SCHEMA_MAX_DEPTH) {
        fail(c, "schema nested deeper than %s", "64");
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
            fail(c, "unsupported keyword '%s'", key);
            goto out;
        }
    }
    static const char *const ALONE[] = {"$ref", "anyOf", "oneOf"};
    for (size_t i = 0; i < N_OF(ALONE); i++)
        if (json_object_get(s, ALONE[i])) {
            if (group) {
                fail(c, "'%s' beside '%s' is not supported", ALONE[i], group);
                goto out;
            }
            group = ALONE[i];
        }
    if (group) {
        json_object_foreach((json_t *)s, key, v)
        {
            if (!in_list(key, ANNOTATIONS, N_OF(ANNOTATIONS)) && strcmp(key, group) != 0) {
                fail(c, "keyword '%s' beside '%s' is not supported", key, group);
                goto out;
            }
        }
        if (strcmp(group, "$ref") == 0) {
            const json_t *r = json_object_get(s, "$ref");
            if (!json_is_string(r) || strlen(json_string_value(r)) != json_string_length(r))
                fail(c, "'$ref' is not a string without NUL characters");
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
                fail(c, "keyword '%s' beside '%s' is not supported", key,
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
        c->need |= P_VALUE;
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
    cv c = {.root = schema, .strict = o ? o->strict : true, .e = e};
    sh__jsb root = {0}, all = {0};
    gen(&c, schema, &root);
    if (!c.err && (root.oom || c.rules.oom))
        c.err = sh__error_set(e, SH_ENOMEM, "out of memory converting a schema");
    if (!c.err) {
        sh__jsb_puts(&all, "root ::= ");
        sh__jsb_put(&all, root.p, root.n);
        sh__jsb_puts(&all, "\n");
        sh__jsb_put(&all, c.rules.p ? c.rules.p : "", c.rules.n);
        if (c.need & P_VALUE)
            c.need |= P_WS | P_STRING | P_CHAR | P_NUMBER;
        if (c.need & P_STRING)
            c.need |= P_CHAR;
        static const struct {
            unsigned bit;
            const char *text;
        } PR[] = {{P_WS, PRIM_WS},          {P_VALUE, PRIM_VALUE},     {P_STRING, PRIM_STRING},
                  {P_CHAR, PRIM_CHAR},      {P_RAWCHAR, PRIM_RAWCHAR}, {P_NUMBER, PRIM_NUMBER},
                  {P_INTEGER, PRIM_INTEGER}};
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
