/* The JSON-schema converter's `pattern`: an ECMA regex subset translated to GBNF over JSON string
 * text (sh__json_schema_pattern in json_schema_internal.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "net/json_schema.h"
#include "net/json_schema_internal.h"

/* --- patterns ---
 * The regex is matched against the decoded string; the grammar produces JSON string text. A
 * literal character becomes its JSON encoding (a quote as \", a newline as \n); a class, an
 * escape class (\d \w \s and negations) and `.` produce only characters that stand raw in JSON
 * text (not the quote, the backslash, U+0000..U+001F, U+007F), which narrows the language but
 * never widens it. Without ^ (or $) a branch may be preceded (followed) by any characters. */

#define CP_MAX 0x10FFFF
#define SET_MAX 64

typedef struct cpset {
    uint32_t lo[SET_MAX], hi[SET_MAX];
    int n;
} cpset;

typedef struct rx {
    const char *s; /* the pattern */
    size_t i, n;
    const char *chr, *path;
    sh_error *e;
    sh_err err;
    int depth;
} rx;

static sh_err rx_fail(rx *r, const char *what)
{
    if (!r->err)
        r->err = sh__error_set(r->e, SH_EINVAL, "pattern at %s: %s (at offset %zu)", r->path, what,
                               r->i);
    return r->err;
}

/* Decodes one UTF-8 code point at r->i (the pattern is valid UTF-8: jansson checked it). */
static uint32_t rx_next(rx *r)
{
    const unsigned char *p = (const unsigned char *)r->s + r->i;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (len > 1)
        c &= 0x3F >> (len - 1);
    for (int k = 1; k < len && r->i + (size_t)k < r->n; k++)
        c = c << 6 | (p[k] & 0x3F);
    r->i += (size_t)len;
    if (r->i > r->n)
        r->i = r->n;
    return c;
}

static void set_add(rx *r, cpset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == SET_MAX) {
        rx_fail(r, "character class with too many ranges");
        return;
    }
    s->lo[s->n] = lo;
    s->hi[s->n] = hi;
    s->n++;
}

static void set_norm(cpset *s)
{
    for (int i = 1; i < s->n; i++) /* insertion sort by lo */
        for (int j = i; j > 0 && s->lo[j] < s->lo[j - 1]; j--) {
            uint32_t t = s->lo[j];
            s->lo[j] = s->lo[j - 1];
            s->lo[j - 1] = t;
            t = s->hi[j];
            s->hi[j] = s->hi[j - 1];
            s->hi[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < s->n; i++) {
        if (m && s->lo[i] <= s->hi[m - 1] + 1) {
            if (s->hi[i] > s->hi[m - 1])
                s->hi[m - 1] = s->hi[i];
        } else {
            s->lo[m] = s->lo[i];
            s->hi[m] = s->hi[i];
            m++;
        }
    }
    s->n = m;
}

/* Complement over 0..CP_MAX of a normalised set. */
static void set_not(cpset *s)
{
    cpset t = {.n = 0};
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->lo[i] > next) {
            t.lo[t.n] = next;
            t.hi[t.n++] = s->lo[i] - 1;
        }
        next = s->hi[i] + 1;
    }
    if (next <= CP_MAX) {
        t.lo[t.n] = next;
        t.hi[t.n++] = CP_MAX;
    }
    *s = t;
}

/* Intersects a normalised set with what stands raw in JSON text (and is valid UTF-8). */
static void set_raw(cpset *s)
{
    static const uint32_t ok[][2] = {
        {0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0x7E}, {0x80, 0xD7FF}, {0xE000, CP_MAX}};
    cpset t = {.n = 0};
    for (int i = 0; i < s->n; i++)
        for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
            uint32_t lo = s->lo[i] > ok[k][0] ? s->lo[i] : ok[k][0];
            uint32_t hi = s->hi[i] < ok[k][1] ? s->hi[i] : ok[k][1];
            if (lo <= hi && t.n < SET_MAX) {
                t.lo[t.n] = lo;
                t.hi[t.n++] = hi;
            }
        }
    *s = t;
}

void sh__jsb_class_cp(sh__jsb *b, uint32_t c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        sh__jsb_printf(b, "%c", (char)c);
    else if (c < 0x80)
        sh__jsb_printf(b, "\\x%02X", c);
    else if (c <= 0xFFFF)
        sh__jsb_printf(b, "\\u%04X", c);
    else
        sh__jsb_printf(b, "\\U%08X", c);
}

static void put_set(rx *r, sh__jsb *b, cpset *s)
{
    set_norm(s);
    set_raw(s);
    if (s->n == 0) {
        rx_fail(r, "character class matches no character a JSON string holds unescaped");
        return;
    }
    sh__jsb_puts(b, "[");
    for (int i = 0; i < s->n; i++) {
        sh__jsb_class_cp(b, s->lo[i]);
        if (s->hi[i] != s->lo[i]) {
            sh__jsb_puts(b, "-");
            sh__jsb_class_cp(b, s->hi[i]);
        }
    }
    sh__jsb_puts(b, "]");
}

/* A literal code point as the JSON text that encodes it. */
static void put_literal_cp(sh__jsb *b, uint32_t c)
{
    char t[8];
    size_t n;
    if (c == '"' || c == '\\') {
        t[0] = '\\';
        t[1] = (char)c;
        n = 2;
    } else if (c < 0x20) {
        const char *esc = c == '\n'   ? "\\n"
                          : c == '\t' ? "\\t"
                          : c == '\r' ? "\\r"
                          : c == 8    ? "\\b"
                          : c == 12   ? "\\f"
                                      : NULL;
        if (esc) {
            n = 2;
            memcpy(t, esc, 2);
        } else {
            n = (size_t)snprintf(t, sizeof t, "\\u%04x", c);
        }
    } else if (c < 0x80) {
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
    sh__jsb_literal(b, t, n);
}

/* Adds the class of an escape letter (d D w W s S) to s; false for another letter. */
static bool escape_class(rx *r, cpset *s, uint32_t c)
{
    cpset t = {.n = 0};
    switch (c) {
    case 'd':
    case 'D':
        set_add(r, &t, '0', '9');
        break;
    case 'w':
    case 'W':
        set_add(r, &t, '0', '9');
        set_add(r, &t, 'A', 'Z');
        set_add(r, &t, 'a', 'z');
        set_add(r, &t, '_', '_');
        break;
    case 's':
    case 'S': {
        static const uint32_t ws[][2] = {{9, 13},          {0x20, 0x20},     {0xA0, 0xA0},
                                         {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029},
                                         {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
                                         {0xFEFF, 0xFEFF}};
        for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++)
            set_add(r, &t, ws[k][0], ws[k][1]);
        break;
    }
    default:
        return false;
    }
    set_norm(&t);
    if (c == 'D' || c == 'W' || c == 'S')
        set_not(&t);
    for (int i = 0; i < t.n; i++)
        set_add(r, s, t.lo[i], t.hi[i]);
    return true;
}

static int hexval(uint32_t c)
{
    return c >= '0' && c <= '9'   ? (int)(c - '0')
           : c >= 'a' && c <= 'f' ? (int)(c - 'a' + 10)
           : c >= 'A' && c <= 'F' ? (int)(c - 'A' + 10)
                                  : -1;
}

/* An escape after the backslash that stands for one code point (\n, \x41, \u00e9, \.); -1 for
 * one that is refused (the failure is set). in_class: \b is backspace, not a word boundary. */
static int64_t escape_char(rx *r, uint32_t c, bool in_class)
{
    switch (c) {
    case 'n':
        return '\n';
    case 't':
        return '\t';
    case 'r':
        return '\r';
    case 'f':
        return '\f';
    case 'v':
        return '\v';
    case '0':
        return 0;
    case 'b':
        if (in_class)
            return 8;
        rx_fail(r, "unsupported construct: word boundary \\b");
        return -1;
    case 'x':
    case 'u': {
        int len = c == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int k = 0; k < len; k++) {
            int h = r->i < r->n ? hexval((unsigned char)r->s[r->i]) : -1;
            if (h < 0) {
                rx_fail(r, "bad \\x or \\u escape");
                return -1;
            }
            v = v << 4 | (uint32_t)h;
            r->i++;
        }
        if (v >= 0xD800 && v <= 0xDFFF) {
            rx_fail(r, "unsupported construct: surrogate escape");
            return -1;
        }
        return v;
    }
    default:
        break;
    }
    if (c < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
        return c; /* escaped punctuation stands for itself */
    if (c >= '1' && c <= '9')
        rx_fail(r, "unsupported construct: backreference");
    else if (c == 'B')
        rx_fail(r, "unsupported construct: word boundary \\B");
    else if (c == 'p' || c == 'P')
        rx_fail(r, "unsupported construct: Unicode property escape");
    else
        rx_fail(r, "unsupported escape");
    return -1;
}

static void rx_class(rx *r, sh__jsb *b)
{
    cpset s = {.n = 0};
    bool neg = r->i < r->n && r->s[r->i] == '^';
    if (neg)
        r->i++;
    bool first = true;
    for (;;) {
        if (r->i >= r->n) {
            rx_fail(r, "unterminated character class");
            return;
        }
        if (r->s[r->i] == ']' && !first)
            break;
        if (r->s[r->i] == ']') {
            rx_fail(r, "unsupported construct: empty character class");
            return;
        }
        first = false;
        int64_t lo;
        uint32_t c = rx_next(r);
        if (c == '\\') {
            if (r->i >= r->n) {
                rx_fail(r, "trailing backslash");
                return;
            }
            uint32_t x = rx_next(r);
            if (escape_class(r, &s, x))
                continue;
            lo = escape_char(r, x, true);
            if (lo < 0)
                return;
        } else {
            lo = c;
        }
        int64_t hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            uint32_t d = rx_next(r);
            if (d == '\\') {
                if (r->i >= r->n) {
                    rx_fail(r, "trailing backslash");
                    return;
                }
                hi = escape_char(r, rx_next(r), true);
                if (hi < 0)
                    return;
            } else {
                hi = d;
            }
            if (hi < lo) {
                rx_fail(r, "character class range out of order");
                return;
            }
        }
        set_add(r, &s, (uint32_t)lo, (uint32_t)hi);
        if (r->err)
            return;
    }
    r->i++; /* ] */
    set_norm(&s);
    if (neg)
        set_not(&s);
    put_set(r, b, &s);
}

/* Parses {m}, {m,}, {m,n} at r->i (just after '{'); false (r->i unchanged) if it is not one. */
static bool rx_braces(rx *r, long *m, long *n)
{
    size_t i = r->i;
    long a = 0, z = -1;
    int digits = 0;
    while (i < r->n && r->s[i] >= '0' && r->s[i] <= '9' && digits < 8) {
        a = a * 10 + (r->s[i++] - '0');
        digits++;
    }
    if (!digits)
        return false;
    if (i < r->n && r->s[i] == '}') {
        z = a;
    } else if (i < r->n && r->s[i] == ',') {
        i++;
        digits = 0;
        long v = 0;
        while (i < r->n && r->s[i] >= '0' && r->s[i] <= '9' && digits < 8) {
            v = v * 10 + (r->s[i++] - '0');
            digits++;
        }
        if (i >= r->n || r->s[i] != '}')
            return false;
        z = digits ? v : -1;
    } else {
        return false;
    }
    r->i = i + 1;
    *m = a;
    *n = z;
    return true;
}

static void rx_alt(rx *r, sh__jsb *b, bool top);

/* One atom (with its quantifier) at r->i; the caller checked there is one. */
static void rx_atom(rx *r, sh__jsb *b)
{
    uint32_t c = rx_next(r);
    switch (c) {
    case '(':
        if (r->i < r->n && r->s[r->i] == '?') {
            if (r->i + 1 < r->n && r->s[r->i + 1] == ':') {
                r->i += 2;
            } else {
                rx_fail(r, "unsupported construct: lookaround or named group '(?'");
                return;
            }
        }
        if (++r->depth > SH_JSON_SCHEMA_MAX_DEPTH) {
            rx_fail(r, "groups nested too deep");
            return;
        }
        sh__jsb_puts(b, "(");
        rx_alt(r, b, false);
        r->depth--;
        if (r->err)
            return;
        if (r->i >= r->n || r->s[r->i] != ')') {
            rx_fail(r, "unbalanced parenthesis");
            return;
        }
        r->i++;
        sh__jsb_puts(b, ")");
        break;
    case '[':
        rx_class(r, b);
        break;
    case '.': {
        cpset s = {.n = 0};
        set_add(r, &s, '\n', '\n');
        set_add(r, &s, '\r', '\r');
        set_add(r, &s, 0x2028, 0x2029);
        set_norm(&s);
        set_not(&s);
        put_set(r, b, &s);
        break;
    }
    case '\\': {
        if (r->i >= r->n) {
            rx_fail(r, "trailing backslash");
            return;
        }
        uint32_t x = rx_next(r);
        cpset s = {.n = 0};
        if (escape_class(r, &s, x)) {
            set_norm(&s);
            put_set(r, b, &s);
        } else {
            int64_t v = escape_char(r, x, false);
            if (v < 0)
                return;
            put_literal_cp(b, (uint32_t)v);
        }
        break;
    }
    case '*':
    case '+':
    case '?':
        rx_fail(r, "nothing to repeat");
        return;
    case '^':
    case '$':
        rx_fail(r, "unsupported construct: anchor inside the pattern (only ^ at the start and $ "
                   "at the end of a top-level branch)");
        return;
    default:
        put_literal_cp(b, c);
        break;
    }
    if (r->err || r->i >= r->n)
        return;
    char q = r->s[r->i];
    long m, n;
    if (q == '*' || q == '+' || q == '?') {
        r->i++;
        sh__jsb_printf(b, "%c", q);
    } else if (q == '{' && (r->i++, rx_braces(r, &m, &n))) {
        if (m > SH_JSON_SCHEMA_MAX_REPEAT || n > SH_JSON_SCHEMA_MAX_REPEAT) {
            rx_fail(r, "repetition count above SH_JSON_SCHEMA_MAX_REPEAT (1000)");
            return;
        }
        if (n >= 0 && n < m) {
            rx_fail(r, "repetition {m,n} with n < m");
            return;
        }
        if (n == m)
            sh__jsb_printf(b, "{%ld}", m);
        else if (n < 0)
            sh__jsb_printf(b, "{%ld,}", m);
        else
            sh__jsb_printf(b, "{%ld,%ld}", m, n);
    } else {
        if (q == '{')
            r->i--; /* a '{' that opens no quantifier is a literal: the next atom */
        return;
    }
    if (r->i < r->n && r->s[r->i] == '?')
        r->i++; /* lazy: the same language */
    if (r->i < r->n &&
        (r->s[r->i] == '*' || r->s[r->i] == '+' || r->s[r->i] == '?' ||
         (r->s[r->i] == '{' && r->i + 1 < r->n && r->s[r->i + 1] >= '0' && r->s[r->i + 1] <= '9')))
        rx_fail(r, "nothing to repeat");
}

static void rx_alt(rx *r, sh__jsb *b, bool top)
{
    bool first = true;
    for (;;) {
        if (!first)
            sh__jsb_puts(b, " | ");
        first = false;
        bool start = false, end = false;
        if (top && r->i < r->n && r->s[r->i] == '^') {
            start = true;
            r->i++;
        }
        if (top && !start)
            sh__jsb_printf(b, "%s* ", r->chr);
        sh__jsb_puts(b, "(");
        bool any = false;
        while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')' && !r->err) {
            if (top && r->s[r->i] == '$' &&
                (r->i + 1 == r->n || r->s[r->i + 1] == '|' || r->s[r->i + 1] == ')')) {
                end = true;
                r->i++;
                break;
            }
            if (any)
                sh__jsb_puts(b, " ");
            rx_atom(r, b);
            any = true;
        }
        if (!any)
            sh__jsb_puts(b, "\"\"");
        sh__jsb_puts(b, ")");
        if (top && !end)
            sh__jsb_printf(b, " %s*", r->chr);
        if (r->err)
            return;
        if (r->i < r->n && r->s[r->i] == '|') {
            r->i++;
            continue;
        }
        return;
    }
}

sh_err sh__json_schema_pattern(sh__jsb *b, const char *re, const char *chr, const char *path,
                               sh_error *e)
{
    rx r = {.s = re, .n = strlen(re), .chr = chr, .path = path, .e = e};
    sh__jsb_puts(b, "\"\\\"\" (");
    rx_alt(&r, b, true);
    if (!r.err && r.i < r.n)
        rx_fail(&r, "unbalanced parenthesis");
    sh__jsb_puts(b, ") \"\\\"\"");
    return r.err;
}
