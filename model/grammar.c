/* The GBNF parser: text to rules of elements, with bounded work, then the checks that make the
 * matcher safe to run (every rule defined, no left recursion, a non-empty language). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/grammar_internal.h"

typedef struct gvec {
    sh_gel *v;
    size_t n, cap;
} gvec;

typedef struct prule {
    gvec body;
    const char *name; /* into the text; NULL for generated rules */
    size_t name_len;
    size_t ref_at; /* where it was first used, for "undefined rule" */
    int defined;
} prule;

typedef struct parser {
    const char *s;
    size_t n, i;
    sh_error *e;
    sh_err err; /* the first error; parsing stops at it */
    prule *rules;
    size_t n_rules, cap_rules;
    uint32_t *names; /* open-addressed (cap_names): rule id + 1, 0 empty; named rules only */
    size_t cap_names;
    uint32_t *ranges; /* (lo, hi) pairs of every class, in order */
    size_t n_ranges, cap_ranges;
    uint32_t *cls_off;
    uint8_t *cls_neg;
    size_t n_cls, cap_cls, cap_neg;
    size_t total_el; /* elements in all rules, against SH_GRAMMAR_MAX_ELEMENTS */
    int depth;
} parser;

/* Fails the parse at byte offset `at` with "line L, column C: ..." (columns count bytes). */
SH_PRINTF(4, 5) static void fail(parser *p, sh_err code, size_t at, const char *fmt, ...)
{
    if (p->err)
        return;
    p->err = code;
    size_t line = 1, col = 1;
    for (size_t k = 0; k < at && k < p->n; k++) {
        if (p->s[k] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    sh__error_set(p->e, code, "grammar: line %zu, column %zu: %s", line, col, what);
}

static void nomem(parser *p)
{
    if (!p->err)
        p->err = sh__error_set(p->e, SH_ENOMEM, "grammar: out of memory");
}

static int grow(parser *p, void **a, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 1;
    size_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    void *b = realloc(*a, c * size);
    if (!b) {
        nomem(p);
        return 0;
    }
    *a = b;
    *cap = c;
    return 1;
}

/* Appends to a rule body, counting against the element bound. */
static int push_el(parser *p, gvec *g, uint32_t type, uint32_t v)
{
    if (p->err)
        return 0;
    if (p->total_el >= SH_GRAMMAR_MAX_ELEMENTS) {
        fail(p, SH_ERANGE, p->i, "grammar too large (more than %u elements after expansion)",
             (unsigned)SH_GRAMMAR_MAX_ELEMENTS);
        return 0;
    }
    if (!grow(p, (void **)&g->v, &g->cap, g->n + 1, sizeof *g->v))
        return 0;
    g->v[g->n++] = (sh_gel){type, v};
    p->total_el++;
    return 1;
}

static uint32_t new_rule(parser *p, const char *name, size_t len, size_t at)
{
    if (p->err)
        return 0;
    if (p->n_rules >= SH_GRAMMAR_MAX_RULES) {
        fail(p, SH_ERANGE, at, "too many rules (more than %d, generated ones included)",
             SH_GRAMMAR_MAX_RULES);
        return 0;
    }
    if (!grow(p, (void **)&p->rules, &p->cap_rules, p->n_rules + 1, sizeof *p->rules))
        return 0;
    p->rules[p->n_rules] = (prule){.name = name, .name_len = len, .ref_at = at};
    return (uint32_t)p->n_rules++;
}

static uint64_t hash_name(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t k = 0; k < n; k++)
        h = (h ^ (uint8_t)s[k]) * 1099511628211ull;
    return h;
}

/* The id of the named rule, created (undefined) on first sight. */
static uint32_t rule_id(parser *p, const char *name, size_t len, size_t at)
{
    if (p->err)
        return 0;
    if (p->n_rules * 2 + 2 > p->cap_names) {
        size_t cap = p->cap_names ? p->cap_names * 2 : 64;
        uint32_t *t = calloc(cap, sizeof *t);
        if (!t) {
            nomem(p);
            return 0;
        }
        for (size_t k = 0; k < p->cap_names; k++) {
            uint32_t id = p->names[k];
            if (!id)
                continue;
            const prule *r = &p->rules[id - 1];
            size_t h = (size_t)hash_name(r->name, r->name_len) & (cap - 1);
            while (t[h])
                h = (h + 1) & (cap - 1);
            t[h] = id;
        }
        free(p->names);
        p->names = t;
        p->cap_names = cap;
    }
    size_t h = (size_t)hash_name(name, len) & (p->cap_names - 1);
    for (; p->names[h]; h = (h + 1) & (p->cap_names - 1)) {
        const prule *r = &p->rules[p->names[h] - 1];
        if (r->name_len == len && memcmp(r->name, name, len) == 0)
            return p->names[h] - 1;
    }
    uint32_t id = new_rule(p, name, len, at);
    if (!p->err)
        p->names[h] = id + 1;
    return id;
}

static int peek(const parser *p) { return p->i < p->n ? (unsigned char)p->s[p->i] : -1; }

static int is_word(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

/* Skips blanks and comments; newlines too when newline_ok (inside groups, after `::=` and `|`). */
static void skip_space(parser *p, int newline_ok)
{
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t') {
            p->i++;
        } else if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n')
                p->i++;
        } else if (newline_ok && (c == '\n' || c == '\r')) {
            p->i++;
        } else {
            break;
        }
    }
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class: an escape or one UTF-8 code point. */
static uint32_t parse_char(parser *p)
{
    size_t at = p->i;
    const unsigned char *s = (const unsigned char *)p->s;
    if (s[p->i] == '\\') {
        if (p->i + 1 >= p->n) {
            fail(p, SH_EINVAL, at, "escape at the end of the text");
            return 0;
        }
        int c = s[p->i + 1];
        p->i += 2;
        int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        if (digits) {
            uint32_t v = 0;
            for (int k = 0; k < digits; k++) {
                int h = p->i < p->n ? hexval(s[p->i]) : -1;
                if (h < 0) {
                    fail(p, SH_EINVAL, p->i, "expected %d hex digits after \\%c", digits, c);
                    return 0;
                }
                v = v * 16 + (uint32_t)h;
                p->i++;
            }
            if (v > 0x10FFFF) {
                fail(p, SH_EINVAL, at, "code point U+%X is above U+10FFFF", (unsigned)v);
                return 0;
            }
            return v;
        }
        switch (c) {
        case 'n':
            return '\n';
        case 'r':
            return '\r';
        case 't':
            return '\t';
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
            return (uint32_t)c;
        default:
            fail(p, SH_EINVAL, at, "unknown escape \\%c", c);
            return 0;
        }
    }
    uint32_t c = s[p->i];
    int need = c < 0x80                 ? 0
               : c >= 0xC2 && c <= 0xDF ? 1
               : c >= 0xE0 && c <= 0xEF ? 2
               : c >= 0xF0 && c <= 0xF4 ? 3
                                        : -1;
    if (need < 0 || p->i + (size_t)need >= p->n) {
        fail(p, SH_EINVAL, at, "invalid UTF-8");
        return 0;
    }
    uint32_t v = need == 0 ? c : need == 1 ? c & 0x1F : need == 2 ? c & 0x0F : c & 0x07;
    for (int k = 1; k <= need; k++) {
        uint32_t b = s[p->i + (size_t)k];
        if ((b & 0xC0) != 0x80) {
            fail(p, SH_EINVAL, at, "invalid UTF-8");
            return 0;
        }
        v = (v << 6) | (b & 0x3F);
    }
    static const uint32_t min[4] = {0, 0x80, 0x800, 0x10000};
    if (v < min[need] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        fail(p, SH_EINVAL, at, "invalid UTF-8");
        return 0;
    }
    p->i += (size_t)need + 1;
    return v;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* [...] after the '[': a class of sorted, merged ranges. */
static uint32_t parse_class(parser *p)
{
    size_t at = p->i - 1;
    int neg = peek(p) == '^';
    if (neg)
        p->i++;
    size_t first = p->n_ranges;
    while (!p->err && peek(p) != ']') {
        if (p->i >= p->n) {
            fail(p, SH_EINVAL, at, "unterminated character class");
            return 0;
        }
        size_t c_at = p->i;
        uint32_t lo = parse_char(p), hi = lo;
        if (!p->err && peek(p) == '-' && p->i + 1 < p->n && p->s[p->i + 1] != ']') {
            p->i++;
            hi = parse_char(p);
            if (!p->err && hi < lo)
                fail(p, SH_EINVAL, c_at, "range end U+%X is below its start U+%X", (unsigned)hi,
                     (unsigned)lo);
        }
        if (p->err || !grow(p, (void **)&p->ranges, &p->cap_ranges, 2 * (p->n_ranges + 1), 4))
            return 0;
        p->ranges[2 * p->n_ranges] = lo;
        p->ranges[2 * p->n_ranges + 1] = hi;
        p->n_ranges++;
        if (p->n_ranges - first > SH_GRAMMAR_MAX_ELEMENTS) {
            fail(p, SH_ERANGE, at, "character class too large");
            return 0;
        }
    }
    if (p->err)
        return 0;
    p->i++; /* ']' */
    /* Sort and merge so that a class is disjoint, non-adjacent ranges: the matcher's test for a
     * partial UTF-8 prefix (can any code point in [lo, hi] match?) is then exact. */
    size_t n = p->n_ranges - first, m = 0;
    uint32_t *r = n ? p->ranges + 2 * first : NULL;
    if (n)
        qsort(r, n, 2 * sizeof *r, cmp_range);
    for (size_t k = 0; k < n; k++) {
        if (m > 0 && r[2 * k] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * k + 1] > r[2 * (m - 1) + 1])
                r[2 * (m - 1) + 1] = r[2 * k + 1];
        } else {
            r[2 * m] = r[2 * k];
            r[2 * m + 1] = r[2 * k + 1];
            m++;
        }
    }
    p->n_ranges = first + m;
    if (!grow(p, (void **)&p->cls_off, &p->cap_cls, p->n_cls + 2, sizeof *p->cls_off) ||
        !grow(p, (void **)&p->cls_neg, &p->cap_neg, p->n_cls + 1, 1))
        return 0;
    p->cls_off[p->n_cls] = (uint32_t)first;
    p->cls_neg[p->n_cls] = (uint8_t)neg;
    p->cls_off[p->n_cls + 1] = (uint32_t)p->n_ranges;
    return (uint32_t)p->n_cls++;
}

/* Rewrites out[start, n) as that item repeated min to max times (max < 0: no limit), as
 * llama.cpp does: min copies, then a chain of generated optional rules. */
static void repeat(parser *p, gvec *out, size_t start, long min, long max, size_t at)
{
    if (start >= out->n) {
        fail(p, SH_EINVAL, at, "repetition without a preceding item");
        return;
    }
    if (min > SH_GRAMMAR_MAX_REPEAT || max > SH_GRAMMAR_MAX_REPEAT) {
        fail(p, SH_ERANGE, at, "repetition count above %d", SH_GRAMMAR_MAX_REPEAT);
        return;
    }
    if (max >= 0 && max < min) {
        fail(p, SH_EINVAL, at, "repetition {%ld,%ld}: the maximum is below the minimum", min, max);
        return;
    }
    size_t len = out->n - start;
    sh_gel *item = malloc(len * sizeof *item);
    if (!item) {
        nomem(p);
        return;
    }
    memcpy(item, out->v + start, len * sizeof *item);
    p->total_el -= len;
    out->n = start;
    for (long k = 0; k < min && !p->err; k++)
        for (size_t j = 0; j < len; j++)
            push_el(p, out, item[j].type, item[j].v);
    long n_opt = max < 0 ? 1 : max - min;
    uint32_t last = 0;
    for (long k = 0; k < n_opt && !p->err; k++) {
        uint32_t id = new_rule(p, NULL, 0, at);
        if (p->err)
            break;
        gvec *b = &p->rules[id].body;
        p->rules[id].defined = 1;
        for (size_t j = 0; j < len; j++)
            push_el(p, b, item[j].type, item[j].v);
        if (k > 0 || max < 0)
            push_el(p, b, SH_GEL_REF, max < 0 ? id : last);
        push_el(p, b, SH_GEL_ALT, 0);
        push_el(p, b, SH_GEL_END, 0);
        last = id;
    }
    if (n_opt > 0)
        push_el(p, out, SH_GEL_REF, last);
    free(item);
}

static long parse_int(parser *p)
{
    size_t at = p->i;
    long v = 0;
    if (peek(p) < '0' || peek(p) > '9') {
        fail(p, SH_EINVAL, at, "expected a number");
        return 0;
    }
    while (peek(p) >= '0' && peek(p) <= '9') {
        v = v * 10 + (peek(p) - '0');
        p->i++;
        if (v > SH_GRAMMAR_MAX_REPEAT) {
            fail(p, SH_ERANGE, at, "repetition count above %d", SH_GRAMMAR_MAX_REPEAT);
            return 0;
        }
    }
    return v;
}

static void parse_alternates(parser *p, uint32_t rule, int nested);

static void parse_sequence(parser *p, gvec *out, int nested)
{
    size_t last = out->n;
    while (!p->err && p->i < p->n) {
        int c = peek(p);
        size_t at = p->i;
        if (c == '"') {
            p->i++;
            last = out->n;
            while (!p->err && peek(p) != '"') {
                if (p->i >= p->n) {
                    fail(p, SH_EINVAL, at, "unterminated string literal");
                    return;
                }
                uint32_t cp = parse_char(p);
                push_el(p, out, SH_GEL_LIT, cp);
            }
            p->i++;
        } else if (c == '[') {
            p->i++;
            last = out->n;
            uint32_t cls = parse_class(p);
            push_el(p, out, SH_GEL_CLASS, cls);
        } else if (c == '.') {
            p->i++;
            last = out->n;
            push_el(p, out, SH_GEL_ANY, 0);
        } else if (is_word(c)) {
            size_t s0 = p->i;
            while (is_word(peek(p)))
                p->i++;
            last = out->n;
            uint32_t id = rule_id(p, p->s + s0, p->i - s0, s0);
            push_el(p, out, SH_GEL_REF, id);
        } else if (c == '(') {
            p->i++;
            if (++p->depth > SH_GRAMMAR_MAX_DEPTH) {
                fail(p, SH_ERANGE, at, "groups nested more than %d deep", SH_GRAMMAR_MAX_DEPTH);
                return;
            }
            skip_space(p, 1);
            uint32_t id = new_rule(p, NULL, 0, at);
            if (p->err)
                return;
            p->rules[id].defined = 1;
            parse_alternates(p, id, 1);
            p->depth--;
            if (p->err)
                return;
            if (peek(p) != ')') {
                fail(p, SH_EINVAL, p->i, "expected ')' to close the group");
                return;
            }
            p->i++;
            last = out->n;
            push_el(p, out, SH_GEL_REF, id);
        } else if (c == '*' || c == '+' || c == '?') {
            p->i++;
            repeat(p, out, last, c == '+', c == '?' ? 1 : -1, at);
        } else if (c == '{') {
            p->i++;
            skip_space(p, nested);
            long min = parse_int(p), max = min;
            skip_space(p, nested);
            if (!p->err && peek(p) == ',') {
                p->i++;
                skip_space(p, nested);
                max = -1;
                if (peek(p) >= '0' && peek(p) <= '9')
                    max = parse_int(p);
                skip_space(p, nested);
            }
            if (!p->err && peek(p) != '}') {
                fail(p, SH_EINVAL, p->i, "expected '}' to close the repetition");
                return;
            }
            p->i++;
            repeat(p, out, last, min, max, at);
        } else {
            break;
        }
        skip_space(p, nested);
    }
}

/* Alternatives into rule `rule`'s body: each sequence closed by ALT, the last by END. The body
 * is re-fetched after each call since nested groups may move the rule array. */
static void parse_alternates(parser *p, uint32_t rule, int nested)
{
    gvec seq = {0};
    for (;;) {
        seq.n = 0;
        parse_sequence(p, &seq, nested);
        if (p->err)
            break;
        gvec *b = &p->rules[rule].body;
        /* Moving the sequence in is not new work: its elements were counted already. */
        if (!grow(p, (void **)&b->v, &b->cap, b->n + seq.n + 1, sizeof *b->v))
            break;
        if (seq.n)
            memcpy(b->v + b->n, seq.v, seq.n * sizeof *seq.v);
        b->n += seq.n;
        int more = peek(p) == '|';
        b->v[b->n++] = (sh_gel){more ? SH_GEL_ALT : SH_GEL_END, 0};
        p->total_el++;
        if (!more)
            break;
        p->i++;
        skip_space(p, 1);
    }
    free(seq.v);
}

static void parse_all(parser *p)
{
    skip_space(p, 1);
    while (!p->err && p->i < p->n) {
        size_t at = p->i;
        while (is_word(peek(p)))
            p->i++;
        if (p->i == at) {
            fail(p, SH_EINVAL, at, "expected a rule name");
            return;
        }
        uint32_t id = rule_id(p, p->s + at, p->i - at, at);
        if (p->err)
            return;
        if (p->rules[id].defined) {
            fail(p, SH_EINVAL, at, "rule '%.*s' defined twice", (int)(p->i - at), p->s + at);
            return;
        }
        p->rules[id].defined = 1;
        skip_space(p, 0);
        if (p->n - p->i < 3 || memcmp(p->s + p->i, "::=", 3) != 0) {
            fail(p, SH_EINVAL, p->i, "expected '::=' after the rule name");
            return;
        }
        p->i += 3;
        skip_space(p, 1);
        parse_alternates(p, id, 0);
        if (p->err)
            return;
        if (peek(p) == '\r')
            p->i++;
        if (p->i < p->n && peek(p) != '\n') {
            fail(p, SH_EINVAL, p->i, "unexpected '%c': expected the end of the rule",
                 peek(p) >= 0x20 && peek(p) < 0x7F ? peek(p) : '?');
            return;
        }
        skip_space(p, 1);
    }
}

/* Marks the rules that derive the empty string (nullable) or some finite string (productive),
 * in time linear in the grammar: each alternative counts the symbols it still waits for (its
 * references, and for nullable any character makes it wait forever); a rule is marked when one of
 * its alternatives waits for nothing, and marking it releases the alternatives that use it. */
static sh_err fixpoint(const sh_grammar *g, uint8_t *flag, int nullable)
{
    uint32_t n_alts = g->alt_off[g->n_rules];
    uint32_t *need = calloc(n_alts + 1, sizeof *need), *owner = malloc((n_alts + 1) * 4);
    uint32_t *occ_off = calloc(g->n_rules + 2, 4), *queue = malloc(((size_t)g->n_rules + 1) * 4);
    uint32_t *occ = NULL;
    sh_err rc = SH_ENOMEM;
    if (!need || !owner || !occ_off || !queue)
        goto out;
    size_t n_occ = 0;
    for (uint32_t r = 0; r < g->n_rules; r++)
        for (uint32_t a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
            owner[a] = r;
            for (const sh_gel *x = g->el + g->alts[a]; !sh__gel_is_end(x); x++) {
                if (x->type == SH_GEL_REF) {
                    need[a]++;
                    occ_off[x->v + 1]++;
                    n_occ++;
                } else if (nullable) {
                    need[a] = UINT32_MAX / 2; /* never released */
                }
            }
        }
    occ = malloc((n_occ + 1) * 4);
    if (!occ)
        goto out;
    for (uint32_t r = 0; r < g->n_rules; r++)
        occ_off[r + 1] += occ_off[r];
    for (uint32_t r = 0; r < g->n_rules; r++)
        for (uint32_t a = g->alt_off[r]; a < g->alt_off[r + 1]; a++)
            for (const sh_gel *x = g->el + g->alts[a]; !sh__gel_is_end(x); x++)
                if (x->type == SH_GEL_REF)
                    occ[occ_off[x->v]++] = a;
    /* occ_off[t] now ends rule t's occurrences; they start at occ_off[t - 1] (0 for t = 0). */
    size_t qh = 0, qt = 0;
    for (uint32_t a = 0; a < n_alts; a++)
        if (need[a] == 0 && !flag[owner[a]]) {
            flag[owner[a]] = 1;
            queue[qt++] = owner[a];
        }
    while (qh < qt) {
        uint32_t t = queue[qh++];
        for (uint32_t k = t ? occ_off[t - 1] : 0; k < occ_off[t]; k++) {
            uint32_t a = occ[k];
            if (--need[a] == 0 && !flag[owner[a]]) {
                flag[owner[a]] = 1;
                queue[qt++] = owner[a];
            }
        }
    }
    rc = SH_OK;
out:
    free(need);
    free(owner);
    free(occ_off);
    free(queue);
    free(occ);
    return rc;
}

/* Finds a rule that can reach itself without consuming a character (left recursion), which
 * would make the matcher's expansion loop; iterative depth-first search over the "may start
 * with" edges. Returns the rule or UINT32_MAX. */
static uint32_t find_left_recursion(const sh_grammar *g, const uint8_t *nullable, sh_err *err)
{
    uint8_t *color = calloc(g->n_rules, 1);
    /* Each frame: the rule and how far its edge walk has got (alternative, element). */
    uint32_t(*st)[3] = malloc((size_t)g->n_rules * sizeof *st);
    if (!color || !st) {
        free(color);
        free(st);
        *err = SH_ENOMEM;
        return UINT32_MAX;
    }
    uint32_t found = UINT32_MAX;
    for (uint32_t r0 = 0; r0 < g->n_rules && found == UINT32_MAX; r0++) {
        if (color[r0])
            continue;
        size_t sp = 0;
        st[sp][0] = r0;
        st[sp][1] = g->alt_off[r0];
        st[sp][2] = g->alt_off[r0] < g->alt_off[r0 + 1] ? g->alts[g->alt_off[r0]] : 0;
        sp++;
        color[r0] = 1;
        while (sp > 0 && found == UINT32_MAX) {
            uint32_t *f = st[sp - 1];
            uint32_t r = f[0];
            if (f[1] >= g->alt_off[r + 1]) {
                color[r] = 2;
                sp--;
                continue;
            }
            const sh_gel *x = g->el + f[2];
            if (sh__gel_is_end(x) || x->type != SH_GEL_REF ||
                (f[2] > g->alts[f[1]] && !nullable[g->el[f[2] - 1].v])) {
                /* This alternative's possible first symbols are done: next alternative. */
                f[1]++;
                f[2] = f[1] < g->alt_off[r + 1] ? g->alts[f[1]] : 0;
                continue;
            }
            f[2]++;
            uint32_t t = x->v;
            if (color[t] == 1) {
                found = t;
            } else if (color[t] == 0) {
                color[t] = 1;
                st[sp][0] = t;
                st[sp][1] = g->alt_off[t];
                st[sp][2] = g->alt_off[t] < g->alt_off[t + 1] ? g->alts[g->alt_off[t]] : 0;
                sp++;
            }
        }
    }
    free(color);
    free(st);
    return found;
}

/* Flattens the parsed rules into g. */
static sh_err build(parser *p, sh_grammar *g)
{
    g->n_rules = (uint32_t)p->n_rules;
    size_t n_el = 0, n_alts = 0;
    for (size_t r = 0; r < p->n_rules; r++) {
        n_el += p->rules[r].body.n;
        for (size_t k = 0; k < p->rules[r].body.n; k++)
            n_alts += sh__gel_is_end(&p->rules[r].body.v[k]);
    }
    g->el = malloc((n_el + 1) * sizeof *g->el);
    g->alts = malloc((n_alts + 1) * sizeof *g->alts);
    g->alt_off = malloc((p->n_rules + 1) * sizeof *g->alt_off);
    g->cls_off = malloc((p->n_cls + 1) * sizeof *g->cls_off);
    g->cls_neg = malloc(p->n_cls + 1);
    g->ranges = malloc((2 * p->n_ranges + 1) * sizeof *g->ranges);
    if (!g->el || !g->alts || !g->alt_off || !g->cls_off || !g->cls_neg || !g->ranges)
        return SH_ENOMEM;
    uint32_t e = 0, a = 0;
    for (size_t r = 0; r < p->n_rules; r++) {
        g->alt_off[r] = a;
        const gvec *b = &p->rules[r].body;
        g->alts[a++] = e;
        for (size_t k = 0; k < b->n; k++) {
            g->el[e++] = b->v[k];
            if (b->v[k].type == SH_GEL_ALT)
                g->alts[a++] = e;
        }
    }
    g->alt_off[p->n_rules] = a;
    g->n_el = e;
    if (p->n_cls)
        memcpy(g->cls_off, p->cls_off, (p->n_cls + 1) * sizeof *g->cls_off);
    else
        g->cls_off[0] = 0;
    if (p->n_cls)
        memcpy(g->cls_neg, p->cls_neg, p->n_cls);
    if (p->n_ranges)
        memcpy(g->ranges, p->ranges, 2 * p->n_ranges * sizeof *g->ranges);
    g->n_cls = (uint32_t)p->n_cls;
    return SH_OK;
}

sh_err sh_grammar_parse(const char *text, size_t len, sh_grammar **out, sh_error *e)
{
    *out = NULL;
    if (!text && len)
        return sh__error_set(e, SH_EINVAL, "grammar: text is NULL");
    if (len > SH_GRAMMAR_MAX_TEXT)
        return sh__error_set(e, SH_ERANGE, "grammar: %zu bytes, above the limit of %u", len,
                             (unsigned)SH_GRAMMAR_MAX_TEXT);
    parser p = {.s = text, .n = len, .e = e};
    parse_all(&p);
    if (!p.err) {
        for (size_t r = 0; r < p.n_rules; r++)
            if (!p.rules[r].defined) {
                fail(&p, SH_EINVAL, p.rules[r].ref_at, "undefined rule '%.*s'",
                     (int)p.rules[r].name_len, p.rules[r].name);
                break;
            }
    }
    uint32_t root = 0;
    if (!p.err) {
        root = rule_id(&p, "root", 4, 0);
        if (!p.err && !p.rules[root].defined)
            p.err = sh__error_set(e, SH_EINVAL, "grammar: no 'root' rule");
    }
    sh_grammar *g = NULL;
    if (!p.err) {
        g = calloc(1, sizeof *g);
        sh_err rc = g ? build(&p, g) : SH_ENOMEM;
        if (rc)
            nomem(&p);
        else
            g->root = root;
    }
    uint8_t *nullable = NULL, *productive = NULL;
    if (!p.err) {
        nullable = calloc(g->n_rules, 1);
        productive = calloc(g->n_rules, 1);
        if (!nullable || !productive)
            nomem(&p);
    }
    if (!p.err && fixpoint(g, nullable, 1))
        nomem(&p);
    if (!p.err) {
        sh_err rc = SH_OK;
        uint32_t lr = find_left_recursion(g, nullable, &rc);
        if (rc) {
            nomem(&p);
        } else if (lr != UINT32_MAX) {
            const prule *r = &p.rules[lr];
            if (r->name)
                fail(&p, SH_EINVAL, r->ref_at, "rule '%.*s' is left-recursive", (int)r->name_len,
                     r->name);
            else
                fail(&p, SH_EINVAL, r->ref_at, "this group is left-recursive");
        }
    }
    if (!p.err && fixpoint(g, productive, 0))
        nomem(&p);
    if (!p.err) {
        if (!productive[root])
            p.err = sh__error_set(e, SH_EINVAL,
                                  "grammar: the language of 'root' is empty (no finite sentence)");
    }
    free(nullable);
    free(productive);
    for (size_t r = 0; r < p.n_rules; r++)
        free(p.rules[r].body.v);
    free(p.rules);
    free(p.names);
    free(p.ranges);
    free(p.cls_off);
    free(p.cls_neg);
    if (p.err) {
        sh_grammar_free(g);
        return p.err;
    }
    *out = g;
    return SH_OK;
}

void sh_grammar_free(sh_grammar *g)
{
    if (!g)
        return;
    free(g->el);
    free(g->alts);
    free(g->alt_off);
    free(g->cls_off);
    free(g->cls_neg);
    free(g->ranges);
    free(g);
}

int32_t sh_grammar_n_rules(const sh_grammar *g) { return (int32_t)g->n_rules; }
