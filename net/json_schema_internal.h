/* Internals shared by the JSON-schema converter's files: a bounded growable text buffer and the
 * leaf generators (regex patterns, string formats, numeric ranges) of net/json_schema_leaf.c. */
#ifndef SH_NET_JSON_SCHEMA_INTERNAL_H
#define SH_NET_JSON_SCHEMA_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

/* Text that grows up to SH_JSON_SCHEMA_MAX_BYTES; past it (or when an allocation fails) it keeps
 * its text and sets `full` (or `oom`), which the converter turns into an error. */
typedef struct sh__jsb {
    char *p;
    size_t n, cap;
    bool full, oom;
} sh__jsb;

void sh__jsb_put(sh__jsb *b, const char *s, size_t n);
void sh__jsb_puts(sh__jsb *b, const char *s);
void sh__jsb_printf(sh__jsb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sh__jsb_fini(sh__jsb *b);

/* Appends `s` (n bytes) as a GBNF string literal "..." (quote, backslash and control bytes
 * escaped; other bytes, UTF-8 included, as they are). */
void sh__jsb_literal(sh__jsb *b, const char *s, size_t n);

/* Appends code point c as one member of a GBNF character class (escaped unless alphanumeric). */
void sh__jsb_class_cp(sh__jsb *b, uint32_t c);

/* The largest integer part the grammar produces: 16 digits. */
#define SH__JSON_SCHEMA_INT_MAX 9999999999999999LL

/* Appends an expression for the decimal integers lo..hi (no sign, no leading zero;
 * 0 <= lo <= hi <= SH__JSON_SCHEMA_INT_MAX): exact, digit by digit. */
void sh__json_schema_uint_range(sh__jsb *b, int64_t lo, int64_t hi);

/* Appends an expression for JSON numbers x with lo <= x (lo < x when lo_excl) and x <= hi
 * (x < hi), each bound present or not; integer-valued bounds. `frac`: numbers with an optional
 * fraction (no exponent), else integers. Returns false (nothing appended) when no number
 * qualifies. */
bool sh__json_schema_num_range(sh__jsb *b, bool has_lo, int64_t lo, bool lo_excl, bool has_hi,
                               int64_t hi, bool hi_excl, bool frac);

/* Appends the expression of a JSON string (quotes included) matching the ECMA regex `re` (a
 * subset: see json_schema_leaf.c). `chr` is the name of the rule for one JSON string character
 * (for unanchored ends). Returns SH_OK or SH_EINVAL naming the construct ("... at <path>"). */
sh_err sh__json_schema_pattern(sh__jsb *b, const char *re, const char *chr, const char *path,
                               sh_error *e);

/* Appends the expression of a JSON string (quotes included) in `format`; false when the format
 * is not supported. */
bool sh__json_schema_format(sh__jsb *b, const char *format);

#endif
