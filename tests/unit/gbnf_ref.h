/* A small reference GBNF parser and backtracking matcher for tests, independent of the grammar
 * engine: whole-input matches over UTF-8 code points, rules one per line ("name ::= body"),
 * literals, classes, groups, alternation, * + ? {m} {m,} {m,n}. Slow (exponential at worst) and
 * meant for short instances only. */
#ifndef SH_TEST_GBNF_REF_H
#define SH_TEST_GBNF_REF_H

#include <ctype.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { GR_LIT, GR_CLASS, GR_REF, GR_SEQ, GR_ALT, GR_REP, GR_PROGRESS } gr_kind;

typedef struct gr_node {
    gr_kind k;
    uint32_t *cp; /* literal code points, or class ranges as pairs */
    int n_cp;
    bool neg;
    struct gr_node **kid;
    int n_kid;
    int min, max; /* repetition; max -1 unbounded */
    char ref[64];
    int rule;
} gr_node;

typedef struct gr_grammar {
    char name[256][64];
    gr_node *body[256];
    int n;
    char err[160];
} gr_grammar;

typedef struct gr_parser {
    const char *s;
    size_t i, n;
    gr_grammar *g;
} gr_parser;

static gr_node *gr_new(gr_kind k)
{
    gr_node *x = calloc(1, sizeof *x);
    x->k = k;
    return x;
}

static void gr_add_kid(gr_node *x, gr_node *kid)
{
    x->kid = realloc(x->kid, (size_t)(x->n_kid + 1) * sizeof *x->kid);
    x->kid[x->n_kid++] = kid;
}

static void gr_add_cp(gr_node *x, uint32_t c)
{
    x->cp = realloc(x->cp, (size_t)(x->n_cp + 1) * sizeof *x->cp);
    x->cp[x->n_cp++] = c;
}

static uint32_t gr_utf8(const char *s, size_t *i)
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

static void gr_ws(gr_parser *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t'))
        p->i++;
}

static uint32_t gr_char(gr_parser *p)
{
    if (p->s[p->i] != '\\')
        return gr_utf8(p->s, &p->i);
    p->i++;
    char c = p->s[p->i++];
    int len = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (!len)
        return c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : (uint32_t)c;
    uint32_t v = 0;
    for (int k = 0; k < len; k++) {
        char h = p->s[p->i++];
        v = v << 4 | (uint32_t)(h <= '9' ? h - '0' : (h | 32) - 'a' + 10);
    }
    return v;
}

static gr_node *gr_alt(gr_parser *p);

static gr_node *gr_primary(gr_parser *p)
{
    char c = p->s[p->i];
    gr_node *x = NULL;
    if (c == '"') {
        p->i++;
        x = gr_new(GR_LIT);
        while (p->i < p->n && p->s[p->i] != '"')
            gr_add_cp(x, gr_char(p));
        p->i++;
    } else if (c == '[') {
        p->i++;
        x = gr_new(GR_CLASS);
        if (p->s[p->i] == '^') {
            x->neg = true;
            p->i++;
        }
        while (p->i < p->n && p->s[p->i] != ']') {
            uint32_t lo = gr_char(p), hi = lo;
            if (p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
                p->i++;
                hi = gr_char(p);
            }
            gr_add_cp(x, lo);
            gr_add_cp(x, hi);
        }
        p->i++;
    } else if (c == '(') {
        p->i++;
        x = gr_alt(p);
        gr_ws(p);
        if (p->s[p->i] != ')')
            snprintf(p->g->err, sizeof p->g->err, "missing ) at %zu", p->i);
        p->i++;
    } else {
        x = gr_new(GR_REF);
        size_t n = 0;
        while (p->i < p->n && (isalnum((unsigned char)p->s[p->i]) || p->s[p->i] == '-') &&
               n + 1 < sizeof x->ref)
            x->ref[n++] = p->s[p->i++];
        if (!n)
            snprintf(p->g->err, sizeof p->g->err, "unexpected '%c' at %zu", c, p->i);
    }
    for (;;) {
        char q = p->i < p->n ? p->s[p->i] : 0;
        int mn, mx;
        if (q == '*' || q == '+' || q == '?') {
            p->i++;
            mn = q == '+';
            mx = q == '?' ? 1 : -1;
        } else if (q == '{') {
            p->i++;
            mn = (int)strtol(p->s + p->i, NULL, 10);
            while (p->s[p->i] >= '0' && p->s[p->i] <= '9')
                p->i++;
            mx = mn;
            if (p->s[p->i] == ',') {
                p->i++;
                mx = p->s[p->i] == '}' ? -1 : (int)strtol(p->s + p->i, NULL, 10);
                while (p->s[p->i] >= '0' && p->s[p->i] <= '9')
                    p->i++;
            }
            p->i++;
        } else {
            return x;
        }
        gr_node *r = gr_new(GR_REP);
        r->min = mn;
        r->max = mx;
        gr_add_kid(r, x);
        x = r;
    }
}

static gr_node *gr_seq(gr_parser *p)
{
    gr_node *s = gr_new(GR_SEQ);
    for (;;) {
        gr_ws(p);
        if (p->i >= p->n || p->s[p->i] == '|' || p->s[p->i] == ')' || p->g->err[0])
            return s;
        gr_add_kid(s, gr_primary(p));
    }
}

static gr_node *gr_alt(gr_parser *p)
{
    gr_node *a = gr_new(GR_ALT);
    gr_add_kid(a, gr_seq(p));
    while (p->i < p->n && p->s[p->i] == '|' && !p->g->err[0]) {
        p->i++;
        gr_add_kid(a, gr_seq(p));
    }
    return a;
}

static bool gr_link(gr_grammar *g, gr_node *x)
{
    if (x->k == GR_REF) {
        x->rule = -1;
        for (int i = 0; i < g->n; i++)
            if (strcmp(g->name[i], x->ref) == 0)
                x->rule = i;
        if (x->rule < 0) {
            snprintf(g->err, sizeof g->err, "undefined rule '%s'", x->ref);
            return false;
        }
    }
    for (int i = 0; i < x->n_kid; i++)
        if (!gr_link(g, x->kid[i]))
            return false;
    return true;
}

/* Parses text; false with g->err set on a malformed grammar. */
static bool gr_parse(gr_grammar *g, const char *text)
{
    memset(g, 0, sizeof *g);
    const char *line = text;
    while (*line) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        const char *def = strstr(line, " ::= ");
        if (!def || def > line + len || g->n == 256) {
            snprintf(g->err, sizeof g->err, "bad rule line %.40s", line);
            return false;
        }
        snprintf(g->name[g->n], sizeof g->name[0], "%.*s", (int)(def - line), line);
        for (int i = 0; i < g->n; i++)
            if (strcmp(g->name[i], g->name[g->n]) == 0) {
                snprintf(g->err, sizeof g->err, "rule '%s' defined twice", g->name[i]);
                return false;
            }
        gr_parser p = {.s = def + 5, .n = len - (size_t)(def + 5 - line), .g = g};
        g->body[g->n++] = gr_alt(&p);
        if (!g->err[0] && p.i != p.n)
            snprintf(g->err, sizeof g->err, "trailing text in rule %s at %zu", g->name[g->n - 1],
                     p.i);
        if (g->err[0])
            return false;
        line = end ? end + 1 : line + len;
    }
    if (g->n == 0 || strcmp(g->name[0], "root") != 0) {
        snprintf(g->err, sizeof g->err, "first rule is not root");
        return false;
    }
    for (int i = 0; i < g->n; i++)
        if (!gr_link(g, g->body[i]))
            return false;
    return true;
}

static void gr_free_node(gr_node *x)
{
    for (int i = 0; i < x->n_kid; i++)
        gr_free_node(x->kid[i]);
    free(x->kid);
    free(x->cp);
    free(x);
}

static void gr_free(gr_grammar *g)
{
    for (int i = 0; i < g->n; i++)
        gr_free_node(g->body[i]);
    g->n = 0;
}

/* The continuation: what remains to match after the current node. */
typedef struct gr_k {
    const gr_node *n;
    int count;  /* repetitions done (GR_REP) */
    size_t pos; /* GR_PROGRESS: the position that must have been passed */
    const struct gr_k *next;
} gr_k;

typedef struct gr_in {
    const gr_grammar *g;
    const uint32_t *cp;
    size_t n;
    long steps;
} gr_in;

static bool gr_match(gr_in *in, const gr_k *k, size_t pos)
{
    if (++in->steps > 50000000)
        return false;
    if (!k)
        return pos == in->n;
    const gr_node *x = k->n;
    switch (x->k) {
    case GR_LIT:
        for (int i = 0; i < x->n_cp; i++)
            if (pos + (size_t)i >= in->n || in->cp[pos + (size_t)i] != x->cp[i])
                return false;
        return gr_match(in, k->next, pos + (size_t)x->n_cp);
    case GR_CLASS: {
        if (pos >= in->n)
            return false;
        bool hit = false;
        for (int i = 0; i < x->n_cp; i += 2)
            hit |= in->cp[pos] >= x->cp[i] && in->cp[pos] <= x->cp[i + 1];
        return hit != x->neg && gr_match(in, k->next, pos + 1);
    }
    case GR_REF: {
        gr_k t = {in->g->body[x->rule], 0, 0, k->next};
        return gr_match(in, &t, pos);
    }
    case GR_SEQ: {
        if (x->n_kid == 0)
            return gr_match(in, k->next, pos);
        gr_k *chain = malloc((size_t)x->n_kid * sizeof *chain);
        for (int i = x->n_kid - 1; i >= 0; i--)
            chain[i] = (gr_k){x->kid[i], 0, 0, i + 1 < x->n_kid ? &chain[i + 1] : k->next};
        bool ok = gr_match(in, &chain[0], pos);
        free(chain);
        return ok;
    }
    case GR_ALT:
        for (int i = 0; i < x->n_kid; i++) {
            gr_k t = {x->kid[i], 0, 0, k->next};
            if (gr_match(in, &t, pos))
                return true;
        }
        return false;
    case GR_REP: {
        gr_k again = {x, k->count + 1, 0, k->next};
        if (k->count < x->min) {
            gr_k t = {x->kid[0], 0, 0, &again};
            return gr_match(in, &t, pos);
        }
        if (x->max < 0 || k->count < x->max) {
            static const gr_node progress = {.k = GR_PROGRESS};
            gr_k pr = {&progress, 0, pos, &again};
            gr_k t = {x->kid[0], 0, 0, &pr};
            if (gr_match(in, &t, pos))
                return true;
        }
        return gr_match(in, k->next, pos);
    }
    case GR_PROGRESS:
        return pos > k->pos && gr_match(in, k->next, pos);
    }
    return false;
}

/* Whether the whole text (UTF-8) is a sentence of the grammar. */
static bool gr_accepts(const gr_grammar *g, const char *text)
{
    size_t n = strlen(text), m = 0;
    uint32_t *cp = malloc((n + 1) * sizeof *cp);
    for (size_t i = 0; i < n;)
        cp[m++] = gr_utf8(text, &i);
    gr_in in = {g, cp, m, 0};
    gr_k k = {g->body[0], 0, 0, NULL};
    bool ok = gr_match(&in, &k, 0);
    free(cp);
    return ok;
}

/* --- random sentences --- */

typedef struct gr_out {
    char buf[4096];
    size_t n;
    bool over;
} gr_out;

static void gr_put_cp(gr_out *o, uint32_t c)
{
    char t[4];
    size_t n;
    if (c < 0x80) {
        t[0] = (char)c;
        n = 1;
    } else if (c < 0x800) {
        t[0] = (char)(0xC0 | c >> 6);
        t[1] = (char)(0x80 | (c & 0x3F));
        n = 2;
    } else if (c < 0x10000) {
        t[0] = (char)(0xE0 | c >> 12);
        t[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        t[2] = (char)(0x80 | (c & 0x3F));
        n = 3;
    } else {
        t[0] = (char)(0xF0 | c >> 18);
        t[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((c >> 6) & 0x3F));
        t[3] = (char)(0x80 | (c & 0x3F));
        n = 4;
    }
    if (o->n + n + 1 >= sizeof o->buf) {
        o->over = true;
        return;
    }
    memcpy(o->buf + o->n, t, n);
    o->n += n;
    o->buf[o->n] = 0;
}

static uint32_t gr_rand(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*s >> 33);
}

static bool gr_in_class(const gr_node *x, uint32_t c)
{
    bool hit = false;
    for (int i = 0; i < x->n_cp; i += 2)
        hit |= c >= x->cp[i] && c <= x->cp[i + 1];
    return hit != x->neg;
}

/* Appends a random sentence of node x; false when it ran too deep or too long (try again). */
static bool gr_gen(const gr_grammar *g, const gr_node *x, gr_out *o, uint64_t *seed, int depth)
{
    if (depth > 60 || o->over)
        return false;
    switch (x->k) {
    case GR_LIT:
        for (int i = 0; i < x->n_cp; i++)
            gr_put_cp(o, x->cp[i]);
        return !o->over;
    case GR_CLASS: {
        static const uint32_t pool[] = {'a',  'Z',    '0',    '7',     '9',  ' ',  '-',
                                        '_',  '.',    '"',    '\\',    '\n', 0x01, 0x7F,
                                        0xE9, 0x20AC, 0x2028, 0x1F600, '{',  'x'};
        for (int t = 0; t < 64; t++) {
            uint32_t c;
            if (!x->neg && t % 2 == 0) {
                int r = (int)(gr_rand(seed) % (uint32_t)(x->n_cp / 2)) * 2;
                uint32_t span = x->cp[r + 1] - x->cp[r];
                c = x->cp[r] + (span > 0 ? gr_rand(seed) % (span + 1 < 300 ? span + 1 : 300) : 0);
            } else {
                c = pool[gr_rand(seed) % (sizeof pool / sizeof pool[0])];
            }
            if (gr_in_class(x, c) && !(c >= 0xD800 && c <= 0xDFFF)) {
                gr_put_cp(o, c);
                return !o->over;
            }
        }
        return false;
    }
    case GR_REF:
        return gr_gen(g, g->body[x->rule], o, seed, depth + 1);
    case GR_SEQ:
        for (int i = 0; i < x->n_kid; i++)
            if (!gr_gen(g, x->kid[i], o, seed, depth + 1))
                return false;
        return true;
    case GR_ALT:
        return gr_gen(g, x->kid[gr_rand(seed) % (uint32_t)x->n_kid], o, seed, depth + 1);
    case GR_REP: {
        int span = x->max < 0 ? 3 : x->max - x->min;
        if (span > 3)
            span = 3;
        int n = x->min + (int)(gr_rand(seed) % (uint32_t)(span + 1));
        for (int i = 0; i < n; i++)
            if (!gr_gen(g, x->kid[0], o, seed, depth + 1))
                return false;
        return true;
    }
    case GR_PROGRESS:
        return true;
    }
    return false;
}

/* A random sentence of the grammar in o (NUL-terminated); false after 100 failed tries. */
static bool gr_sentence(const gr_grammar *g, gr_out *o, uint64_t *seed)
{
    for (int t = 0; t < 100; t++) {
        o->n = 0;
        o->over = false;
        o->buf[0] = 0;
        if (gr_gen(g, g->body[0], o, seed, 0))
            return true;
    }
    return false;
}

#endif
