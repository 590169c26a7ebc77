/* Internals shared by the JSON-schema converter's files: a bounded growable text buffer, the leaf
 * generators (numeric ranges and string formats in json_schema_leaf.c, `pattern` in
 * json_schema_regex.c), and the converter's state and helpers (json_schema.c) that the typed
 * generators (json_schema_types.c) use. */
#ifndef SH_NET_JSON_SCHEMA_INTERNAL_H
#define SH_NET_JSON_SCHEMA_INTERNAL_H

#include <jansson.h>
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

/* --- the converter's state and helpers (net/json_schema.c), used by json_schema_types.c --- */

/* Primitive rules, emitted at the end when used. */
enum {
    SH__JS_P_WS = 1 << 0,
    SH__JS_P_CHAR = 1 << 1,
    SH__JS_P_RAWCHAR = 1 << 2,
    SH__JS_P_STRING = 1 << 3,
    SH__JS_P_NUMBER = 1 << 4,
    SH__JS_P_INTEGER = 1 << 5,
    SH__JS_P_VALUE = 1 << 6,
};

typedef struct ref_rule {
    char *ptr; /* the $ref text */
    char name[64];
    bool open; /* its body is being generated */
} ref_rule;

typedef struct sh__json_schema_cv {
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
} sh__json_schema_cv;

/* The current JSON pointer ("/" for the root). */
const char *sh__json_schema_at(sh__json_schema_cv *c);
/* Sets the conversion's error (the first one wins): the message, " at ", the JSON pointer. */
sh_err sh__json_schema_fail(sh__json_schema_cv *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Appends a pointer segment (an index); returns the length sh__json_schema_path_pop restores. */
size_t sh__json_schema_path_push(sh__json_schema_cv *c, const char *seg);
size_t sh__json_schema_path_push_i(sh__json_schema_cv *c, size_t i);
void sh__json_schema_path_pop(sh__json_schema_cv *c, size_t old);
/* Adds the rule `name ::= body`. */
void sh__json_schema_add_rule(sh__json_schema_cv *c, const char *name, const sh__jsb *body);
/* Puts expr into out, or a rule `<prefix>-<n>` made of it when it is long (used twice). */
void sh__json_schema_put_shared(sh__json_schema_cv *c, sh__jsb *out, sh__jsb *expr,
                                const char *prefix);
/* Appends a repetition suffix for a..z occurrences (z -1: unbounded). */
void sh__json_schema_put_rep(sh__jsb *b, long a, long z);
/* Appends a JSON value's compact text as a GBNF literal. */
void sh__json_schema_put_literal(sh__json_schema_cv *c, sh__jsb *b, const json_t *v);
/* A count keyword: -1 when absent, else 0..SH_JSON_SCHEMA_MAX_REPEAT (error past it). */
long sh__json_schema_get_count(sh__json_schema_cv *c, const json_t *s, const char *k);
/* Appends the expression of subschema s. */
void sh__json_schema_gen(sh__json_schema_cv *c, const json_t *s, sh__jsb *out);

/* The typed generators of net/json_schema_types.c. */
void sh__json_schema_string(sh__json_schema_cv *c, const json_t *s, sh__jsb *out);
void sh__json_schema_number(sh__json_schema_cv *c, const json_t *s, sh__jsb *out, bool frac);
void sh__json_schema_object(sh__json_schema_cv *c, const json_t *s, sh__jsb *out);
void sh__json_schema_array(sh__json_schema_cv *c, const json_t *s, sh__jsb *out);

#endif
