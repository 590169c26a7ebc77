/* The matcher's state, shared by grammar_match.c and the vocabulary mask (grammar_vocab.c). */
#ifndef SH_MODEL_GRAMMAR_MATCH_H
#define SH_MODEL_GRAMMAR_MATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "model/grammar_internal.h"

#define SH_GSTATE_DEAD 0xFFFFFFFEu
#define SH_GTRANS_DEAD (-1)
#define SH_GTRANS_UNKNOWN (-2)
/* Cached automaton states: past SOFT the cache is dropped between calls (the position is kept);
 * one call that alone would pass MAX fails the matcher. Each state costs 1 KiB of transitions. */
#define SH_GMATCH_STATES_SOFT 4096u
#define SH_GMATCH_STATES_MAX 32768u
#define SH_GMATCH_MASKS 8 /* masks cached per matcher, by state */

typedef struct sh_gnode {
    uint32_t pos, parent; /* the element on top; the node below (node 0: the empty stack) */
} sh_gnode;

typedef struct sh_gset {
    uint32_t off, n; /* stack ids pool[off, off + n), sorted */
} sh_gset;

typedef struct sh_gstate {
    uint32_t set, pend;  /* a set of stacks; the pending partial code point (grammar_match.c) */
    uint32_t loop_known; /* loop and wide_loop are computed */
    uint32_t wide_loop;  /* every non-ASCII code point leads back to this state */
    uint64_t loop[2];    /* the ASCII bytes whose transition leads back to this state */
} sh_gstate;

typedef struct sh_gmask {
    uint32_t state; /* UINT32_MAX: unused */
    uint64_t stamp; /* last use, for eviction */
    const void *vocab;
    uint64_t *bits;
} sh_gmask;

/* The most stacks one mask may match and expand (over all its transitions): a grammar whose
 * sets of parse stacks are huge and ambiguous (nested repetitions of "any character") could
 * otherwise spend seconds on one token's mask while each transition stays within its own bound.
 * About 0.1-0.5 s of work; the mask then fails with SH_ERANGE. */
#define SH_GMATCH_MASK_WORK ((uint64_t)1 << 22)

struct sh_gmatch {
    const sh_grammar *g;
    sh_gnode *nodes;
    uint32_t *mark; /* (cap_nodes) generation in which advance() last expanded the node */
    uint32_t *node_tab;
    uint32_t n_nodes, cap_nodes, node_tab_cap, gen, expanded;
    /* Stacks matched and expanded so far, and the bound (SH_GMATCH_MASK_WORK) inside a mask. */
    uint64_t spent, spent_cap;
    sh_gset *sets;
    uint32_t *pool, *set_tab;
    size_t n_pool, cap_pool;
    uint32_t n_sets, cap_sets, set_tab_cap;
    sh_gstate *states;
    int32_t *trans; /* (cap_states, 256): next state, SH_GTRANS_DEAD or SH_GTRANS_UNKNOWN */
    uint32_t *state_tab;
    uint32_t n_states, cap_states, state_tab_cap;
    uint32_t cur;         /* the current state */
    uint32_t *work, *out; /* scratch of advance() */
    uint32_t n_work, cap_work, n_out, cap_out;
    sh_gmask masks[SH_GMATCH_MASKS];
    uint64_t clock;
    sh_err err; /* sticky: set once the matcher has failed */
    sh_error errd;
};

int32_t sh__gmatch_trans_slow(sh_gmatch *m, uint32_t s, uint8_t b);

/* The state after byte b from state s (>= 0), or SH_GTRANS_DEAD. */
static inline int32_t sh__gmatch_trans(sh_gmatch *m, uint32_t s, uint8_t b)
{
    int32_t t = m->trans[(size_t)s * 256 + b];
    return t != SH_GTRANS_UNKNOWN ? t : sh__gmatch_trans_slow(m, s, b);
}

/* The state with its self-loops computed (on first use: 128 transitions and one character). */
const sh_gstate *sh__gmatch_loop(sh_gmatch *m, uint32_t s);
int32_t sh__gmatch_walk(sh_gmatch *m, uint32_t s, const char *bytes, size_t n);
bool sh__gmatch_state_can_end(const sh_gmatch *m, uint32_t s);
/* Drops the cached states when past SH_GMATCH_STATES_SOFT (between operations only). */
void sh__gmatch_maybe_flush(sh_gmatch *m);

#endif
