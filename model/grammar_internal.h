/* The parsed grammar shared by the parser (grammar.c) and the matcher (grammar_match.c). */
#ifndef SH_MODEL_GRAMMAR_INTERNAL_H
#define SH_MODEL_GRAMMAR_INTERNAL_H

#include <stdint.h>

#include "model/grammar.h"

/* Element kinds. A rule is its alternatives one after another, each a sequence of LIT / CLASS /
 * ANY / REF elements closed by ALT, the last one by END; so "the sequence ends here" is one test
 * (sh__gel_is_end). */
enum { SH_GEL_END, SH_GEL_ALT, SH_GEL_REF, SH_GEL_LIT, SH_GEL_CLASS, SH_GEL_ANY };

typedef struct sh_gel {
    uint32_t type; /* SH_GEL_* */
    uint32_t v;    /* REF: rule id; LIT: the code point; CLASS: class id */
} sh_gel;

struct sh_grammar {
    sh_gel *el; /* (n_el): every rule's elements */
    uint32_t n_el;
    uint32_t n_rules, root;
    uint32_t *alt_off; /* (n_rules + 1): rule r's alternatives are alts[alt_off[r], alt_off[r+1]) */
    uint32_t *alts;    /* the first element of each alternative, an index into el */
    /* Character classes: class c is the sorted, merged, disjoint ranges
     * ranges[2 * cls_off[c], 2 * cls_off[c+1]) as (lo, hi) pairs, negated when cls_neg[c]. */
    uint32_t *cls_off; /* (n_cls + 1) */
    uint32_t *ranges;
    uint8_t *cls_neg; /* (n_cls) */
    uint32_t n_cls;
};

static inline int sh__gel_is_end(const sh_gel *x) { return x->type <= SH_GEL_ALT; }

#endif
