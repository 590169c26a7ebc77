/* Leaf generators of the JSON-schema converter: text buffer, numeric ranges digit by digit,
 * string formats (the regex subset for `pattern` is in json_schema_regex.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "net/json_schema.h"
#include "net/json_schema_internal.h"
#include "net/strbuf.h"

/* --- text buffer --- */

void sh__jsb_put(sh__jsb *b, const char *s, size_t n)
{
    if (b->full || b->oom || n == 0)
        return;
    if (b->n + n + 1 > SH_JSON_SCHEMA_MAX_BYTES) {
        b->full = true;
        return;
    }
    /* The growth is net/strbuf's; this buffer adds the size bound. */
    sh_strbuf g = {.p = b->p, .len = b->n, .cap = b->cap};
    sh_strbuf_addn(&g, s, n);
    b->p = g.p;
    b->n = g.len;
    b->cap = g.cap;
    b->oom = g.oom;
}

void sh__jsb_puts(sh__jsb *b, const char *s) { sh__jsb_put(b, s, strlen(s)); }

void sh__jsb_printf(sh__jsb *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp)
        sh_panic("sh__jsb_printf: %d bytes", n); /* only short fixed formats are used */
    sh__jsb_put(b, tmp, (size_t)n);
}

void sh__jsb_fini(sh__jsb *b)
{
    free(b->p);
    *b = (sh__jsb){0};
}

void sh__jsb_literal(sh__jsb *b, const char *s, size_t n)
{
    sh__jsb_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char t[2] = {'\\', (char)c};
            sh__jsb_put(b, t, 2);
        } else if (c < 0x20 || c == 0x7f) {
            sh__jsb_printf(b, "\\x%02X", c);
        } else {
            sh__jsb_put(b, (const char *)&s[i], 1);
        }
    }
    sh__jsb_put(b, "\"", 1);
}

/* --- numeric ranges --- */

static bool all_of(const char *s, int n, char c)
{
    for (int i = 0; i < n; i++)
        if (s[i] != c)
            return false;
    return true;
}

/* Integers of n digits (leading zeros allowed here: callers pass equal-length strings whose
 * first digit is nonzero unless n is 1) between lo and hi. */
static void range_same(sh__jsb *b, const char *lo, const char *hi, int n)
{
    if (n == 0)
        return;
    if (memcmp(lo, hi, (size_t)n) == 0) {
        sh__jsb_literal(b, lo, (size_t)n);
        return;
    }
    if (all_of(lo, n, '0') && all_of(hi, n, '9')) {
        if (n == 1)
            sh__jsb_puts(b, "[0-9]");
        else
            sh__jsb_printf(b, "[0-9]{%d}", n);
        return;
    }
    if (lo[0] == hi[0]) {
        sh__jsb_literal(b, lo, 1);
        sh__jsb_puts(b, " ");
        range_same(b, lo + 1, hi + 1, n - 1);
        return;
    }
    char nines[20], zeros[20];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int mid_lo = lo[0] - '0', mid_hi = hi[0] - '0';
    bool first = true;
    sh__jsb_puts(b, "(");
    if (!all_of(lo + 1, n - 1, '0')) {
        sh__jsb_literal(b, lo, 1);
        sh__jsb_puts(b, " ");
        range_same(b, lo + 1, nines, n - 1);
        mid_lo++;
        first = false;
    }
    bool hi_edge = !all_of(hi + 1, n - 1, '9');
    if (hi_edge)
        mid_hi--;
    if (mid_lo <= mid_hi) {
        if (!first)
            sh__jsb_puts(b, " | ");
        if (mid_lo == mid_hi)
            sh__jsb_printf(b, "\"%d\"", mid_lo);
        else
            sh__jsb_printf(b, "[%d-%d]", mid_lo, mid_hi);
        if (n == 2)
            sh__jsb_puts(b, " [0-9]");
        else if (n > 2)
            sh__jsb_printf(b, " [0-9]{%d}", n - 1);
        first = false;
    }
    if (hi_edge) {
        if (!first)
            sh__jsb_puts(b, " | ");
        sh__jsb_literal(b, hi, 1);
        sh__jsb_puts(b, " ");
        range_same(b, zeros, hi + 1, n - 1);
    }
    sh__jsb_puts(b, ")");
}

static int n_digits(int64_t v)
{
    int d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

static int64_t pow10i(int d)
{
    int64_t p = 1;
    while (d-- > 0)
        p *= 10;
    return p;
}

void sh__json_schema_uint_range(sh__jsb *b, int64_t lo, int64_t hi)
{
    int dl = n_digits(lo), dh = n_digits(hi);
    bool first = true;
    if (dl != dh)
        sh__jsb_puts(b, "(");
    for (int d = dl; d <= dh; d++) {
        int64_t a = d == dl ? lo : pow10i(d - 1), z = d == dh ? hi : pow10i(d) - 1;
        if (!first)
            sh__jsb_puts(b, " | ");
        first = false;
        bool full_lo = d > 1 && a == pow10i(d - 1);
        if (full_lo && z == pow10i(d) - 1 && d < dh) {
            /* d..e digits all full: one run [1-9] [0-9]{d-1,e-1}. */
            int e = d;
            while (e + 1 < dh || (e + 1 == dh && hi == pow10i(dh) - 1))
                e++;
            sh__jsb_printf(b, "[1-9] [0-9]{%d,%d}", d - 1, e - 1);
            d = e;
            continue;
        }
        char sa[24], sz[24];
        snprintf(sa, sizeof sa, "%lld", (long long)a);
        snprintf(sz, sizeof sz, "%lld", (long long)z);
        range_same(b, sa, sz, d);
    }
    if (dl != dh)
        sh__jsb_puts(b, ")");
}

#define FRAC "(\".\" [0-9]{1,16})?"
#define ZEROFRAC "(\".\" \"0\"{1,16})?"
#define NZFRAC "\".\" \"0\"{0,15} [1-9] [0-9]{0,15}"

/* Magnitudes m >= 0 with a <= m (a < m when a_excl) and m <= z (m < z) when has_z. */
static bool magnitude(sh__jsb *b, int64_t a, bool a_excl, bool has_z, int64_t z, bool z_excl,
                      bool frac)
{
    const int64_t MAX = SH__JSON_SCHEMA_INT_MAX;
    if (has_z && z > MAX)
        has_z = false;
    if (!frac) {
        if (a_excl)
            a++;
        if (has_z && z_excl)
            z--;
        if (!has_z)
            z = MAX;
        if (a > z || a > MAX)
            return false;
        sh__json_schema_uint_range(b, a, z);
        return true;
    }
    if (a > MAX || (has_z && (z < a || (z == a && (a_excl || z_excl)))))
        return false;
    char num[24];
    if (has_z && z == a) {
        snprintf(num, sizeof num, "%lld", (long long)a);
        sh__jsb_puts(b, "(");
        sh__jsb_literal(b, num, strlen(num));
        sh__jsb_puts(b, " " ZEROFRAC ")");
        return true;
    }
    sh__jsb_puts(b, "(");
    snprintf(num, sizeof num, "%lld", (long long)a);
    sh__jsb_literal(b, num, strlen(num));
    sh__jsb_puts(b, a_excl ? " " NZFRAC : " " FRAC);
    int64_t top = has_z ? z - 1 : MAX;
    if (a + 1 <= top) {
        sh__jsb_puts(b, " | ");
        sh__json_schema_uint_range(b, a + 1, top);
        sh__jsb_puts(b, " " FRAC);
    }
    if (has_z && !z_excl) {
        snprintf(num, sizeof num, "%lld", (long long)z);
        sh__jsb_puts(b, " | ");
        sh__jsb_literal(b, num, strlen(num));
        sh__jsb_puts(b, " " ZEROFRAC);
    }
    sh__jsb_puts(b, ")");
    return true;
}

bool sh__json_schema_num_range(sh__jsb *b, bool has_lo, int64_t lo, bool lo_excl, bool has_hi,
                               int64_t hi, bool hi_excl, bool frac)
{
    sh__jsb pos = {0}, neg = {0};
    bool p = false, n = false;
    /* x >= 0. */
    if (!(has_hi && (hi < 0 || (hi == 0 && hi_excl)))) {
        bool lo_pos = has_lo && lo >= 0;
        p = magnitude(&pos, lo_pos ? lo : 0, lo_pos && lo_excl, has_hi, hi, hi_excl, frac);
    }
    /* x = -m, m > 0. */
    if (!(has_lo && lo >= 0)) {
        bool hi_neg = has_hi && hi < 0;
        n = magnitude(&neg, hi_neg ? -hi : 0, hi_neg ? hi_excl : true, has_lo, has_lo ? -lo : 0,
                      lo_excl, frac);
    }
    if (p && n) {
        sh__jsb_puts(b, "(");
        sh__jsb_put(b, pos.p, pos.n);
        sh__jsb_puts(b, " | \"-\" ");
        sh__jsb_put(b, neg.p, neg.n);
        sh__jsb_puts(b, ")");
    } else if (p) {
        sh__jsb_put(b, pos.p, pos.n);
    } else if (n) {
        sh__jsb_puts(b, "\"-\" ");
        sh__jsb_put(b, neg.p, neg.n);
    }
    if (pos.full || neg.full)
        b->full = true;
    if (pos.oom || neg.oom)
        b->oom = true;
    sh__jsb_fini(&pos);
    sh__jsb_fini(&neg);
    return p || n;
}

/* --- formats --- */

#define F_DATE                                                                                     \
    "([1-9] [0-9]{3} | \"0\" ([1-9] [0-9]{2} | \"0\" ([1-9] [0-9] | \"0\" [1-9]))) \"-\" ("        \
    "(\"0\" [13578] | \"1\" [02]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01]) | "                \
    "(\"0\" [469] | \"11\") \"-\" (\"0\" [1-9] | [12] [0-9] | \"30\") | "                          \
    "\"02-\" (\"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8]))"
#define F_HM "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9]"
#define F_TIME F_HM " \":\" [0-5] [0-9] (\".\" [0-9]{1,9})? (\"Z\" | [+-] " F_HM ")"
#define F_OCTET "(\"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9])"

bool sh__json_schema_format(sh__jsb *b, const char *format)
{
    static const struct {
        const char *name, *body;
    } F[] = {
        {"date", F_DATE},
        {"time", F_TIME},
        {"date-time", F_DATE " \"T\" " F_TIME},
        {"uuid", "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" "
                 "[0-9a-f]{12}"},
        {"ipv4", F_OCTET " \".\" " F_OCTET " \".\" " F_OCTET " \".\" " F_OCTET},
    };
    for (size_t i = 0; i < sizeof F / sizeof F[0]; i++) {
        if (strcmp(format, F[i].name) == 0) {
            sh__jsb_puts(b, "\"\\\"\" ");
            sh__jsb_puts(b, F[i].body);
            sh__jsb_puts(b, " \"\\\"\"");
            return true;
        }
    }
    return false;
}
