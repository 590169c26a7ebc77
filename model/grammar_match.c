/* The grammar matcher: a set of parse stacks (as llama.cpp keeps) advanced one code point at a
 * time, seen from outside as a lazily built byte-level automaton whose transitions are cached.
 *
 * Stacks are hash-consed: a stack is a node id, a node is (element position, the node below), so
 * push and pop are O(1), equal stacks have equal ids and a set of stacks is a sorted id array.
 * Sets are interned too, and an automaton state is (set, pending bytes of a partial UTF-8 code
 * point). A state's 256 byte transitions are filled on first use, so the mask's walk over the
 * vocabulary trie (grammar_vocab.c) costs one table look-up per trie node once warm: inside a
 * JSON string every ordinary byte leads back to the same state. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/grammar_match.h"

#define NODES_MAX (1u << 20)
#define SETS_POOL_MAX (1u << 23) /* stack ids over all interned sets (32 MiB) */

/* ---- hash tables: open addressing, ids + 1 (0 empty), keyed by a 64-bit hash ---- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int tab_grow(uint32_t **tab, uint32_t *cap, uint32_t n,
                    uint64_t (*key)(const sh_gmatch *, uint32_t), const sh_gmatch *m)
{
    if ((uint64_t)(n + 1) * 2 <= *cap)
        return 1;
    uint32_t c = *cap ? *cap * 2 : 1024;
    uint32_t *t = calloc(c, sizeof *t);
    if (!t)
        return 0;
    for (uint32_t k = 0; k < *cap; k++) {
        uint32_t id = (*tab)[k];
        if (!id)
            continue;
        uint32_t h = (uint32_t)key(m, id - 1) & (c - 1);
        while (t[h])
            h = (h + 1) & (c - 1);
        t[h] = id;
    }
    free(*tab);
    *tab = t;
    *cap = c;
    return 1;
}

static uint64_t node_key(const sh_gmatch *m, uint32_t id)
{
    return mix64(((uint64_t)m->nodes[id].pos << 32) | m->nodes[id].parent);
}

static uint64_t set_hash(const uint32_t *s, uint32_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    for (uint32_t k = 0; k < n; k++)
        h = mix64(h ^ s[k]) + k;
    return h;
}

static uint64_t set_key(const sh_gmatch *m, uint32_t id)
{
    return set_hash(m->pool + m->sets[id].off, m->sets[id].n);
}

static uint64_t state_key(const sh_gmatch *m, uint32_t id)
{
    return mix64(((uint64_t)m->states[id].set << 32) | m->states[id].pend);
}

static void set_error(sh_gmatch *m, sh_err code, const char *what)
{
    if (m->err)
        return;
    m->err = code;
    sh__error_set(&m->errd, code, "grammar: %s", what);
}

/* The stack `pos` pushed on `parent`; UINT32_MAX after an error. */
static uint32_t push(sh_gmatch *m, uint32_t pos, uint32_t parent)
{
    uint64_t h = mix64(((uint64_t)pos << 32) | parent);
    uint32_t mask = m->node_tab_cap - 1;
    for (uint32_t k = (uint32_t)h & mask; m->node_tab[k]; k = (k + 1) & mask) {
        const sh_gnode *x = &m->nodes[m->node_tab[k] - 1];
        if (x->pos == pos && x->parent == parent)
            return m->node_tab[k] - 1;
    }
    if (m->n_nodes >= NODES_MAX) {
        set_error(m, SH_ERANGE, "the grammar's parse stacks passed their bound");
        return UINT32_MAX;
    }
    if (m->n_nodes == m->cap_nodes) {
        uint32_t c = m->cap_nodes * 2;
        sh_gnode *n = realloc(m->nodes, c * sizeof *n);
        uint32_t *mk = realloc(m->mark, c * sizeof *mk);
        if (mk)
            m->mark = mk;
        if (!n || !mk) {
            if (n)
                m->nodes = n;
            set_error(m, SH_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->nodes = n;
        memset(m->mark + m->cap_nodes, 0, (c - m->cap_nodes) * sizeof *mk);
        m->cap_nodes = c;
    }
    uint32_t id = m->n_nodes++;
    m->nodes[id] = (sh_gnode){pos, parent};
    m->mark[id] = 0;
    if (!tab_grow(&m->node_tab, &m->node_tab_cap, m->n_nodes, node_key, m)) {
        m->n_nodes--;
        set_error(m, SH_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    mask = m->node_tab_cap - 1;
    uint32_t k = (uint32_t)h & mask;
    while (m->node_tab[k])
        k = (k + 1) & mask;
    m->node_tab[k] = id + 1;
    return id;
}

static int scratch_push(sh_gmatch *m, uint32_t **a, uint32_t *n, uint32_t *cap, uint32_t v)
{
    if (*n == *cap) {
        uint32_t c = *cap ? *cap * 2 : 256;
        uint32_t *b = realloc(*a, c * sizeof *b);
        if (!b) {
            set_error(m, SH_ENOMEM, "out of memory");
            return 0;
        }
        *a = b;
        *cap = c;
    }
    (*a)[(*n)++] = v;
    return 1;
}

/* Expands the stack `id` until every resulting stack has a character element on top (or is
 * empty: the sentence may end), appending those to m->out. Stacks already expanded in this
 * generation are skipped, so the work is bounded by the number of distinct stacks, capped. */
static void advance(sh_gmatch *m, uint32_t id)
{
    const sh_grammar *g = m->g;
    m->n_work = 0;
    if (!scratch_push(m, &m->work, &m->n_work, &m->cap_work, id))
        return;
    while (m->n_work > 0 && !m->err) {
        uint32_t x = m->work[--m->n_work];
        if (m->mark[x] == m->gen)
            continue;
        m->mark[x] = m->gen;
        if (++m->expanded > 4 * SH_GRAMMAR_MAX_STACKS) {
            set_error(m, SH_ERANGE, "the grammar's parse stacks passed their bound");
            return;
        }
        if (++m->spent > m->spent_cap) {
            set_error(m, SH_ERANGE, "the grammar's work for one token's mask passed its bound");
            return;
        }
        if (x == 0) {
            scratch_push(m, &m->out, &m->n_out, &m->cap_out, 0);
            continue;
        }
        sh_gnode nd = m->nodes[x];
        const sh_gel *e = &g->el[nd.pos];
        if (e->type != SH_GEL_REF) {
            scratch_push(m, &m->out, &m->n_out, &m->cap_out, x);
            continue;
        }
        uint32_t base = sh__gel_is_end(e + 1) ? nd.parent : push(m, nd.pos + 1, nd.parent);
        for (uint32_t a = g->alt_off[e->v]; a < g->alt_off[e->v + 1] && !m->err; a++) {
            uint32_t s = g->alts[a];
            uint32_t y = sh__gel_is_end(&g->el[s]) ? base : push(m, s, base);
            if (!m->err)
                scratch_push(m, &m->work, &m->n_work, &m->cap_work, y);
        }
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Interns m->out (sorted, deduplicated here) as a set; UINT32_MAX after an error. */
static uint32_t intern_out(sh_gmatch *m)
{
    qsort(m->out, m->n_out, sizeof *m->out, cmp_u32);
    uint32_t n = 0;
    for (uint32_t k = 0; k < m->n_out; k++)
        if (n == 0 || m->out[n - 1] != m->out[k])
            m->out[n++] = m->out[k];
    if (n > SH_GRAMMAR_MAX_STACKS) {
        set_error(m, SH_ERANGE, "the grammar's parse stacks passed their bound");
        return UINT32_MAX;
    }
    uint64_t h = set_hash(m->out, n);
    uint32_t mask = m->set_tab_cap - 1;
    for (uint32_t k = (uint32_t)h & mask; m->set_tab[k]; k = (k + 1) & mask) {
        const sh_gset *s = &m->sets[m->set_tab[k] - 1];
        if (s->n == n && memcmp(m->pool + s->off, m->out, n * sizeof *m->out) == 0)
            return m->set_tab[k] - 1;
    }
    if (m->n_pool + n > SETS_POOL_MAX) {
        set_error(m, SH_ERANGE, "the grammar's states passed their bound");
        return UINT32_MAX;
    }
    if (m->n_pool + n > m->cap_pool) {
        size_t c = m->cap_pool * 2;
        while (c < m->n_pool + n)
            c *= 2;
        uint32_t *p = realloc(m->pool, c * sizeof *p);
        if (!p) {
            set_error(m, SH_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->pool = p;
        m->cap_pool = c;
    }
    if (m->n_sets == m->cap_sets) {
        sh_gset *s = realloc(m->sets, 2 * m->cap_sets * sizeof *s);
        if (!s) {
            set_error(m, SH_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->sets = s;
        m->cap_sets *= 2;
    }
    uint32_t id = m->n_sets++;
    m->sets[id] = (sh_gset){(uint32_t)m->n_pool, n};
    memcpy(m->pool + m->n_pool, m->out, n * sizeof *m->out);
    m->n_pool += n;
    if (!tab_grow(&m->set_tab, &m->set_tab_cap, m->n_sets, set_key, m)) {
        set_error(m, SH_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    mask = m->set_tab_cap - 1;
    uint32_t k = (uint32_t)h & mask;
    while (m->set_tab[k])
        k = (k + 1) & mask;
    m->set_tab[k] = id + 1;
    return id;
}

static int class_match(const sh_grammar *g, uint32_t c, uint32_t lo, uint32_t hi)
{
    const uint32_t *r = g->ranges + 2 * g->cls_off[c];
    uint32_t n = g->cls_off[c + 1] - g->cls_off[c];
    if (g->cls_neg[c]) {
        /* Ranges are disjoint and non-adjacent, so [lo, hi] is excluded only when one range
         * covers it. */
        for (uint32_t k = 0; k < n; k++)
            if (r[2 * k] <= lo && hi <= r[2 * k + 1])
                return 0;
        return 1;
    }
    for (uint32_t k = 0; k < n; k++)
        if (r[2 * k] <= hi && lo <= r[2 * k + 1])
            return 1;
    return 0;
}

/* Whether the character element at pos matches some code point in [lo, hi]. */
static int el_match(const sh_grammar *g, uint32_t pos, uint32_t lo, uint32_t hi)
{
    const sh_gel *e = &g->el[pos];
    switch (e->type) {
    case SH_GEL_LIT:
        return lo <= e->v && e->v <= hi;
    case SH_GEL_ANY:
        return 1;
    case SH_GEL_CLASS:
        return class_match(g, e->v, lo, hi);
    default:
        return 0;
    }
}

/* The set reached from set `s` over code point cp; SH_GSTATE_DEAD when none. */
static uint32_t set_step(sh_gmatch *m, uint32_t s, uint32_t cp)
{
    const sh_grammar *g = m->g;
    m->n_out = 0;
    m->expanded = 0;
    if (++m->gen == 0) { /* the generation counter wrapped: forget every mark */
        memset(m->mark, 0, m->cap_nodes * sizeof *m->mark);
        m->gen = 1;
    }
    sh_gset set = m->sets[s];
    m->spent += set.n;
    if (m->spent > m->spent_cap) {
        set_error(m, SH_ERANGE, "the grammar's work for one token's mask passed its bound");
        return UINT32_MAX;
    }
    for (uint32_t k = 0; k < set.n && !m->err; k++) {
        uint32_t x = m->pool[set.off + k];
        if (x == 0 || !el_match(g, m->nodes[x].pos, cp, cp))
            continue;
        sh_gnode nd = m->nodes[x];
        uint32_t y =
            sh__gel_is_end(&g->el[nd.pos + 1]) ? nd.parent : push(m, nd.pos + 1, nd.parent);
        if (!m->err)
            advance(m, y);
    }
    if (m->err)
        return UINT32_MAX;
    if (m->n_out == 0)
        return SH_GSTATE_DEAD;
    return intern_out(m);
}

static uint32_t state_intern(sh_gmatch *m, uint32_t set, uint32_t pend)
{
    uint64_t h = mix64(((uint64_t)set << 32) | pend);
    uint32_t mask = m->state_tab_cap - 1;
    for (uint32_t k = (uint32_t)h & mask; m->state_tab[k]; k = (k + 1) & mask) {
        const sh_gstate *x = &m->states[m->state_tab[k] - 1];
        if (x->set == set && x->pend == pend)
            return m->state_tab[k] - 1;
    }
    if (m->n_states >= SH_GMATCH_STATES_MAX) {
        set_error(m, SH_ERANGE, "the grammar's states passed their bound");
        return UINT32_MAX;
    }
    if (m->n_states == m->cap_states) {
        uint32_t c = m->cap_states * 2;
        sh_gstate *st = realloc(m->states, c * sizeof *st);
        if (st)
            m->states = st;
        int32_t *tr = st ? realloc(m->trans, (size_t)c * 256 * sizeof *tr) : NULL;
        if (!tr) {
            set_error(m, SH_ENOMEM, "out of memory");
            return UINT32_MAX;
        }
        m->trans = tr;
        m->cap_states = c;
    }
    uint32_t id = m->n_states++;
    m->states[id] = (sh_gstate){set, pend, 0, 0, {0, 0}};
    for (int b = 0; b < 256; b++)
        m->trans[(size_t)id * 256 + (size_t)b] = SH_GTRANS_UNKNOWN;
    if (!tab_grow(&m->state_tab, &m->state_tab_cap, m->n_states, state_key, m)) {
        set_error(m, SH_ENOMEM, "out of memory");
        return UINT32_MAX;
    }
    mask = m->state_tab_cap - 1;
    uint32_t k = (uint32_t)h & mask;
    while (m->state_tab[k])
        k = (k + 1) & mask;
    m->state_tab[k] = id + 1;
    return id;
}

/* Pending bytes are packed as: bits 0-1 how many are pending (0-3), bits 2-3 the code point's
 * total length minus one, bits 8-31 the value bits gathered so far. */
#define PEND_N(p) ((p)&3u)
#define PEND_LEN(p) ((((p) >> 2) & 3u) + 1)
#define PEND_V(p) ((p) >> 8)

/* Computes and caches the transition of state s over byte b. */
int32_t sh__gmatch_trans_slow(sh_gmatch *m, uint32_t s, uint8_t b)
{
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (m->err)
        return SH_GTRANS_DEAD;
    sh_gstate st = m->states[s];
    uint32_t n = PEND_N(st.pend), len, v;
    if (n == 0) {
        len = b < 0x80                 ? 1
              : b >= 0xC2 && b <= 0xDF ? 2
              : b >= 0xE0 && b <= 0xEF ? 3
              : b >= 0xF0 && b <= 0xF4 ? 4
                                       : 0;
        v = len == 1 ? b : len == 2 ? b & 0x1Fu : len == 3 ? b & 0x0Fu : b & 0x07u;
    } else {
        len = PEND_LEN(st.pend);
        v = b >= 0x80 && b <= 0xBF ? (PEND_V(st.pend) << 6) | (b & 0x3Fu) : 0;
        if (b < 0x80 || b > 0xBF)
            len = 0;
    }
    int32_t t = SH_GTRANS_DEAD;
    if (len == 0) {
        /* not UTF-8 */
    } else if (n + 1 == len) {
        if (v >= min_cp[len] && v <= 0x10FFFF && !(v >= 0xD800 && v <= 0xDFFF)) {
            uint32_t set = set_step(m, st.set, v);
            if (set != UINT32_MAX && set != SH_GSTATE_DEAD) {
                uint32_t id = state_intern(m, set, 0);
                t = id == UINT32_MAX ? SH_GTRANS_DEAD : (int32_t)id;
            }
        }
    } else {
        /* A partial code point: alive only when some stack accepts a code point it can still
         * become, which prunes the trie walk early. */
        uint32_t rest = 6 * (len - n - 1);
        uint32_t lo = v << rest, hi = lo | ((1u << rest) - 1);
        if (lo < min_cp[len])
            lo = min_cp[len];
        if (hi > 0x10FFFF)
            hi = 0x10FFFF;
        if (lo >= 0xD800 && hi <= 0xDFFF)
            hi = 0; /* surrogates only: never valid */
        int ok = 0;
        sh_gset set = m->sets[st.set];
        for (uint32_t k = 0; k < set.n && !ok && lo <= hi; k++) {
            uint32_t x = m->pool[set.off + k];
            ok = x != 0 && el_match(m->g, m->nodes[x].pos, lo, hi);
        }
        if (ok) {
            uint32_t pend = (n + 1) | ((len - 1) << 2) | (v << 8);
            uint32_t id = state_intern(m, st.set, pend);
            t = id == UINT32_MAX ? SH_GTRANS_DEAD : (int32_t)id;
        }
    }
    if (!m->err)
        m->trans[(size_t)s * 256 + b] = t;
    return t;
}

static int init_tables(sh_gmatch *m)
{
    m->cap_nodes = 1024;
    m->nodes = malloc(m->cap_nodes * sizeof *m->nodes);
    m->mark = calloc(m->cap_nodes, sizeof *m->mark);
    m->cap_sets = 256;
    m->sets = malloc(m->cap_sets * sizeof *m->sets);
    m->cap_pool = 4096;
    m->pool = malloc(m->cap_pool * sizeof *m->pool);
    m->cap_states = 64;
    m->states = malloc(m->cap_states * sizeof *m->states);
    m->trans = malloc((size_t)m->cap_states * 256 * sizeof *m->trans);
    m->node_tab_cap = m->set_tab_cap = m->state_tab_cap = 1024;
    m->node_tab = calloc(1024, sizeof *m->node_tab);
    m->set_tab = calloc(1024, sizeof *m->set_tab);
    m->state_tab = calloc(1024, sizeof *m->state_tab);
    for (int k = 0; k < SH_GMATCH_MASKS; k++)
        m->masks[k].state = UINT32_MAX;
    return m->nodes && m->mark && m->sets && m->pool && m->states && m->trans && m->node_tab &&
           m->set_tab && m->state_tab;
}

sh_err sh_gmatch_create(const sh_grammar *g, sh_gmatch **out, sh_error *e)
{
    *out = NULL;
    sh_gmatch *m = calloc(1, sizeof *m);
    if (!m || !init_tables(m)) {
        sh_gmatch_free(m);
        return sh__error_set(e, SH_ENOMEM, "grammar: out of memory");
    }
    m->g = g;
    m->nodes[0] = (sh_gnode){UINT32_MAX, UINT32_MAX}; /* the empty stack */
    m->n_nodes = 1;
    /* Not in node_tab: nothing pushes (UINT32_MAX, UINT32_MAX). */
    m->gen = 1;
    m->expanded = 0;
    m->spent_cap = UINT64_MAX; /* bounded only inside sh_gmatch_mask */
    for (uint32_t a = g->alt_off[g->root]; a < g->alt_off[g->root + 1] && !m->err; a++) {
        uint32_t s = g->alts[a];
        uint32_t y = sh__gel_is_end(&g->el[s]) ? 0 : push(m, s, 0);
        if (!m->err)
            advance(m, y);
    }
    uint32_t set = m->err ? UINT32_MAX : intern_out(m);
    uint32_t st = set == UINT32_MAX ? UINT32_MAX : state_intern(m, set, 0);
    if (st == UINT32_MAX) {
        sh_err rc = sh__error_set(e, m->err ? m->err : SH_ENOMEM, "%s", m->errd.msg);
        sh_gmatch_free(m);
        return rc;
    }
    m->cur = st;
    *out = m;
    return SH_OK;
}

#define DUP(field, count)                                                                          \
    do {                                                                                           \
        size_t sz_ = (size_t)(count) * sizeof *m->field;                                           \
        c->field = malloc(sz_ ? sz_ : 1);                                                          \
        if (!c->field)                                                                             \
            goto fail;                                                                             \
        if (sz_)                                                                                   \
            memcpy(c->field, m->field, sz_);                                                       \
    } while (0)

sh_err sh_gmatch_clone(const sh_gmatch *m, sh_gmatch **out, sh_error *e)
{
    *out = NULL;
    sh_gmatch *c = calloc(1, sizeof *c);
    if (!c)
        return sh__error_set(e, SH_ENOMEM, "grammar: out of memory");
    *c = *m;
    c->nodes = NULL, c->mark = NULL, c->node_tab = NULL, c->sets = NULL, c->pool = NULL;
    c->set_tab = NULL, c->states = NULL, c->trans = NULL, c->state_tab = NULL;
    c->work = NULL, c->out = NULL, c->n_work = c->cap_work = c->n_out = c->cap_out = 0;
    for (int k = 0; k < SH_GMATCH_MASKS; k++)
        c->masks[k] = (sh_gmask){.state = UINT32_MAX};
    DUP(nodes, m->cap_nodes);
    DUP(mark, m->cap_nodes);
    DUP(node_tab, m->node_tab_cap);
    DUP(sets, m->cap_sets);
    DUP(pool, m->cap_pool);
    DUP(set_tab, m->set_tab_cap);
    DUP(states, m->cap_states);
    DUP(trans, (size_t)m->cap_states * 256);
    DUP(state_tab, m->state_tab_cap);
    *out = c;
    return SH_OK;
fail:
    sh_gmatch_free(c);
    return sh__error_set(e, SH_ENOMEM, "grammar: out of memory");
}

void sh_gmatch_free(sh_gmatch *m)
{
    if (!m)
        return;
    free(m->nodes);
    free(m->mark);
    free(m->node_tab);
    free(m->sets);
    free(m->pool);
    free(m->set_tab);
    free(m->states);
    free(m->trans);
    free(m->state_tab);
    free(m->work);
    free(m->out);
    for (int k = 0; k < SH_GMATCH_MASKS; k++)
        free(m->masks[k].bits);
    free(m);
}

/* How a character element treats the non-ASCII code points: 1 matches all, 0 none, -1 some. */
static int el_wide(const sh_grammar *g, uint32_t pos)
{
    const sh_gel *e = &g->el[pos];
    if (e->type == SH_GEL_ANY)
        return 1;
    if (e->type == SH_GEL_LIT)
        return e->v < 0x80 ? 0 : -1;
    const uint32_t *r = g->ranges + 2 * g->cls_off[e->v];
    uint32_t n = g->cls_off[e->v + 1] - g->cls_off[e->v];
    int meets = 0, covers = 0;
    for (uint32_t k = 0; k < n; k++) {
        meets |= r[2 * k + 1] >= 0x80;
        covers |= r[2 * k] <= 0x80 && r[2 * k + 1] >= 0x10FFFF;
    }
    int all = covers, none = !meets;
    if (g->cls_neg[e->v]) {
        all = !meets;
        none = covers;
    }
    return all ? 1 : none ? 0 : -1;
}

const sh_gstate *sh__gmatch_loop(sh_gmatch *m, uint32_t s)
{
    if (!m->states[s].loop_known && PEND_N(m->states[s].pend)) {
        /* Inside a character: what holds for the state it started from holds for the rest of a
         * clean subtree (the character completes and leads back there when wide_loop). */
        uint32_t base = state_intern(m, m->states[s].set, 0);
        const sh_gstate *b = base == UINT32_MAX ? NULL : sh__gmatch_loop(m, base);
        sh_gstate *st = &m->states[s];
        st->loop[0] = b ? b->loop[0] : 0;
        st->loop[1] = b ? b->loop[1] : 0;
        st->wide_loop = b ? b->wide_loop : 0;
        st->loop_known = 1;
    }
    if (!m->states[s].loop_known) {
        uint64_t loop[2] = {0, 0};
        for (uint32_t b = 0; b < 128; b++)
            if (sh__gmatch_trans(m, s, (uint8_t)b) == (int32_t)s)
                loop[b >> 6] |= 1ull << (b & 63);
        /* When every stack treats all non-ASCII code points alike, one of them stands for all:
         * if U+00E9 leads back here, every non-ASCII character does. */
        int uniform = 1, any = 0;
        sh_gset set = m->sets[m->states[s].set];
        for (uint32_t k = 0; k < set.n && uniform; k++) {
            uint32_t x = m->pool[set.off + k];
            int w = x == 0 ? 0 : el_wide(m->g, m->nodes[x].pos);
            uniform = w >= 0;
            any |= w == 1;
        }
        uint32_t wide = uniform && any && sh__gmatch_walk(m, s, "\xc3\xa9", 2) == (int32_t)s;
        /* The transitions may have grown the state array: index it again. */
        sh_gstate *st = &m->states[s];
        st->loop[0] = loop[0];
        st->loop[1] = loop[1];
        st->wide_loop = wide;
        st->loop_known = 1;
    }
    return &m->states[s];
}

/* The state after bytes[0, n) from state s, or SH_GTRANS_DEAD. */
int32_t sh__gmatch_walk(sh_gmatch *m, uint32_t s, const char *bytes, size_t n)
{
    int32_t t = (int32_t)s;
    for (size_t k = 0; k < n && t >= 0; k++)
        t = sh__gmatch_trans(m, (uint32_t)t, (uint8_t)bytes[k]);
    return t;
}

void sh__gmatch_maybe_flush(sh_gmatch *m)
{
    if (m->n_states <= SH_GMATCH_STATES_SOFT || m->err)
        return;
    sh_gstate cur = m->states[m->cur];
    m->n_states = 0;
    memset(m->state_tab, 0, m->state_tab_cap * sizeof *m->state_tab);
    for (int k = 0; k < SH_GMATCH_MASKS; k++)
        m->masks[k].state = UINT32_MAX;
    m->cur = state_intern(m, cur.set, cur.pend); /* cannot fail: the arrays have room */
}

bool sh_gmatch_accept_bytes(sh_gmatch *m, const char *bytes, size_t n)
{
    sh__gmatch_maybe_flush(m);
    if (m->err)
        return false;
    int32_t t = sh__gmatch_walk(m, m->cur, bytes, n);
    if (t < 0)
        return false;
    m->cur = (uint32_t)t;
    return true;
}

bool sh__gmatch_state_can_end(const sh_gmatch *m, uint32_t s)
{
    const sh_gstate *st = &m->states[s];
    if (PEND_N(st->pend))
        return false;
    const sh_gset *set = &m->sets[st->set];
    /* Stack ids are sorted and the empty stack is id 0, so it can only come first. */
    return set->n > 0 && m->pool[set->off] == 0;
}

bool sh_gmatch_can_end(const sh_gmatch *m)
{
    return !m->err && sh__gmatch_state_can_end(m, m->cur);
}

sh_err sh_gmatch_error(const sh_gmatch *m, sh_error *e)
{
    if (m->err && e)
        *e = m->errd;
    return m->err;
}
