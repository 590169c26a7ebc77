/* JSON schema → GBNF: the typed generators (strings, numbers, objects, arrays), split from
 * net/json_schema.c's walk; they append one expression for the subschema s to out. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "net/json_schema.h"
#include "net/json_schema_internal.h"

/* --- strings --- */

void sh__json_schema_string(sh__json_schema_cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    long mn = sh__json_schema_get_count(c, s, "minLength"),
         mx = sh__json_schema_get_count(c, s, "maxLength");
    if (c->err)
        return;
    bool len = mn >= 0 || mx >= 0;
    if ((pat != NULL) + (fmt != NULL) + len > 1) {
        sh__json_schema_fail(c, "combining %s with another string keyword is not supported",
                             pat ? "'pattern'" : "'format'");
        return;
    }
    if (pat) {
        if (!json_is_string(pat)) {
            sh__json_schema_fail(c, "'pattern' is not a string");
            return;
        }
        size_t old = sh__json_schema_path_push(c, "pattern"), start = out->n;
        if (strlen(json_string_value(pat)) != json_string_length(pat)) {
            sh__json_schema_fail(c, "'pattern' holds a NUL character");
            return;
        }
        c->err = sh__json_schema_pattern(out, json_string_value(pat), "char", sh__json_schema_at(c),
                                         c->e);
        sh__json_schema_path_pop(c, old);
        if (out->p && strstr(out->p + start, "char*")) /* an unanchored end */
            c->need |= SH__JS_P_CHAR;
        return;
    }
    if (fmt) {
        if (!json_is_string(fmt)) {
            sh__json_schema_fail(c, "'format' is not a string");
            return;
        }
        if (!sh__json_schema_format(out, json_string_value(fmt)))
            sh__json_schema_fail(
                c, "unsupported format '%s' (supported: date, time, date-time, uuid, ipv4)",
                json_string_value(fmt));
        return;
    }
    c->need |= SH__JS_P_CHAR;
    if (!len) {
        c->need |= SH__JS_P_STRING;
        sh__jsb_puts(out, "string");
        return;
    }
    if (mn < 0)
        mn = 0;
    if (mx >= 0 && mx < mn) {
        sh__json_schema_fail(c, "unsatisfiable: minLength above maxLength");
        return;
    }
    sh__jsb_puts(out, "\"\\\"\" char");
    sh__json_schema_put_rep(out, mn, mx);
    sh__jsb_puts(out, " \"\\\"\"");
}

/* --- numbers --- */

/* Reads a bound keyword into *v; false when absent. */
static bool get_bound(sh__json_schema_cv *c, const json_t *s, const char *k, double *v)
{
    const json_t *j = json_object_get(s, k);
    if (!j)
        return false;
    if (json_is_boolean(j)) {
        sh__json_schema_fail(c, "boolean '%s' (draft 4) is not supported", k);
        return false;
    }
    if (!json_is_number(j)) {
        sh__json_schema_fail(c, "'%s' is not a number", k);
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

void sh__json_schema_number(sh__json_schema_cv *c, const json_t *s, sh__jsb *out, bool frac)
{
    double mn = 0, mx = 0, xmn = 0, xmx = 0;
    bool h_mn = get_bound(c, s, "minimum", &mn), h_mx = get_bound(c, s, "maximum", &mx);
    bool h_xmn = get_bound(c, s, "exclusiveMinimum", &xmn);
    bool h_xmx = get_bound(c, s, "exclusiveMaximum", &xmx);
    if (c->err)
        return;
    if (!h_mn && !h_mx && !h_xmn && !h_xmx) {
        c->need |= frac ? SH__JS_P_NUMBER : SH__JS_P_INTEGER;
        sh__jsb_puts(out, frac ? "number" : "integer");
        return;
    }
    /* The tighter of the inclusive and the exclusive bound on each side. */
    bool has_lo = h_mn || h_xmn, has_hi = h_mx || h_xmx;
    bool lo_x = h_xmn && (!h_mn || xmn >= mn), hi_x = h_xmx && (!h_mx || xmx <= mx);
    double lo = lo_x ? xmn : mn, hi = hi_x ? xmx : mx;
    if (frac) {
        if ((has_lo && lo != floor(lo)) || (has_hi && hi != floor(hi))) {
            sh__json_schema_fail(
                c, "a non-integer bound on a number is not supported (integer bounds are)");
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
        sh__json_schema_fail(c, "unsatisfiable: no %s between the bounds",
                             frac ? "number" : "integer");
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
static void not_keys(sh__json_schema_cv *c, sh__jsb *b, const char *const *names, size_t n,
                     size_t off, int depth)
{
    if (depth > 256) {
        sh__json_schema_fail(
            c, "property name longer than 256 characters beside additional properties");
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
    c->need |= SH__JS_P_RAWCHAR;
}

/* `"key" ws ":" ws value` for one property. */
static void gen_kv(sh__json_schema_cv *c, const prop *p, sh__jsb *out)
{
    json_t *k = json_string(p->name);
    sh__json_schema_put_literal(c, out, k);
    json_decref(k);
    sh__jsb_puts(out, " ws \":\" ws ");
    c->need |= SH__JS_P_WS;
    size_t old = sh__json_schema_path_push(c, "properties");
    sh__json_schema_path_push(c, p->name);
    if (p->schema) {
        sh__json_schema_gen(c, p->schema, out);
    } else {
        c->need |= SH__JS_P_VALUE;
        sh__jsb_puts(out, "value");
    }
    sh__json_schema_path_pop(c, old);
}

void sh__json_schema_object(sh__json_schema_cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *add = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) {
        sh__json_schema_fail(c, "'properties' is not an object");
        return;
    }
    if (req && !json_is_array(req)) {
        sh__json_schema_fail(c, "'required' is not an array");
        return;
    }
    if (add && !json_is_boolean(add) && !json_is_object(add)) {
        sh__json_schema_fail(c, "'additionalProperties' is not a schema");
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
            sh__json_schema_fail(c, "'required' holds a non-string");
            break;
        }
        if (props && json_object_get(props, json_string_value(r)))
            continue;
        if (!extra) {
            sh__json_schema_fail(
                c,
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
        c->need |= SH__JS_P_WS;
        if (n_names) {
            qsort(names, n_names, sizeof *names, cmp_str);
            sh__jsb_puts(&x, "\"\\\"\" ");
            not_keys(c, &x, names, n_names, 0, 0);
            sh__jsb_puts(&x, " \"\\\"\"");
        } else {
            c->need |= SH__JS_P_STRING | SH__JS_P_CHAR;
            sh__jsb_puts(&x, "string");
        }
        sh__jsb_puts(&x, " ws \":\" ws ");
        size_t old = sh__json_schema_path_push(c, "additionalProperties");
        if (extra_schema) {
            sh__json_schema_gen(c, extra_schema, &x);
        } else {
            c->need |= SH__JS_P_VALUE;
            sh__jsb_puts(&x, "value");
        }
        sh__json_schema_path_pop(c, old);
    }
    c->need |= SH__JS_P_WS;
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
            sh__json_schema_put_shared(c, out, &x, "kv");
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
                sh__json_schema_add_rule(c, kv[i], &t);
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
            sh__json_schema_put_shared(c, &x2, &x, "kv");
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
                    sh__json_schema_add_rule(c, tl[i], &t);
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

void sh__json_schema_array(sh__json_schema_cv *c, const json_t *s, sh__jsb *out)
{
    const json_t *items = json_object_get(s, "items"), *pre = json_object_get(s, "prefixItems");
    long m = sh__json_schema_get_count(c, s, "minItems"),
         M = sh__json_schema_get_count(c, s, "maxItems");
    if (c->err)
        return;
    if (pre && !json_is_array(pre)) {
        sh__json_schema_fail(c, "'prefixItems' is not an array");
        return;
    }
    const char *pre_kw = "prefixItems";
    bool tuple = items && json_is_array(items);
    if (tuple) {
        /* Draft 2019 and before: "items" as an array is prefixItems; items past them (allowed
         * there unless additionalItems, which is refused, says otherwise) are not generated. */
        if (pre) {
            sh__json_schema_fail(c, "'items' as an array beside 'prefixItems' is not supported");
            return;
        }
        pre = items;
        pre_kw = "items";
    } else if (items && !json_is_boolean(items) && !json_is_object(items)) {
        sh__json_schema_fail(c, "'items' is not a schema");
        return;
    }
    long k = pre ? (long)json_array_size(pre) : 0;
    if (k > SH_JSON_SCHEMA_MAX_REPEAT) {
        sh__json_schema_fail(c, "'%s' longer than 1000 is not supported", pre_kw);
        return;
    }
    if (m < 0)
        m = 0;
    bool more = !tuple && !(items && json_is_false(items));
    if (!more && (M < 0 || M > k))
        M = k;
    if (M >= 0 && m > M) {
        sh__json_schema_fail(c, "unsatisfiable: minItems above the most items allowed");
        return;
    }
    if (M >= 0 && k > M)
        k = M;
    c->need |= SH__JS_P_WS;
    sh__jsb item = {0};
    if (more && (M < 0 || M > k)) {
        size_t old = sh__json_schema_path_push(c, "items");
        if (items && json_is_object(items)) {
            sh__json_schema_gen(c, items, &item);
        } else {
            c->need |= SH__JS_P_VALUE;
            sh__jsb_puts(&item, "value");
        }
        sh__json_schema_path_pop(c, old);
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
        sh__json_schema_put_shared(c, &shared, &item, "item");
        sh__jsb_put(out, shared.p, shared.n);
        if (M != 1) {
            sh__jsb_puts(out, " (ws \",\" ws ");
            sh__jsb_put(out, shared.p, shared.n);
            sh__jsb_puts(out, ")");
            sh__json_schema_put_rep(out, m > 0 ? m - 1 : 0, M < 0 ? -1 : M - 1);
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
            size_t old = sh__json_schema_path_push(c, pre_kw);
            sh__json_schema_path_push_i(c, (size_t)i);
            sh__json_schema_gen(c, json_array_get(pre, (size_t)i), out);
            sh__json_schema_path_pop(c, old);
        }
        if (item.n && (M < 0 || M > k)) {
            long a = m > k ? m - k : 0, z = M < 0 ? -1 : M - k;
            sh__jsb_puts(out, " (ws \",\" ws ");
            sh__jsb_put(out, item.p, item.n);
            sh__jsb_puts(out, ")");
            sh__json_schema_put_rep(out, a, z);
        }
        for (int i = 0; i < opened; i++)
            sh__jsb_puts(out, ")?");
    }
    if (item.full || item.oom)
        out->full = true;
    sh__jsb_fini(&item);
    sh__jsb_puts(out, m == 0 ? " ws)? \"]\"" : " ws \"]\"");
}
