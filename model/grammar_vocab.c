/* The vocabulary trie and the per-step token mask: one walk over the trie of every token's raw
 * bytes, each node one cached automaton transition (grammar_match.c), a dead transition skipping
 * the node's whole subtree; masks are cached per state. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/grammar_match.h"
#include "model/tokenizer.h"

/* Trie nodes in depth-first order (the root is implicit): node i's subtree is [i, skip). The
 * tokens sorted by bytes are in the same order, so node i's subtree holds the tokens
 * order[tok_lo[i], tok_lo[skip]) and the ones ending at node i are order[tok_lo[i], tok_lo[i+1]).
 */
typedef struct tnode {
    uint32_t skip;
    uint32_t tok_lo;
    uint16_t depth; /* bytes from the root: this node is byte depth - 1 of its tokens */
    uint8_t byte;
    uint8_t wide : 1;  /* some byte in the subtree is not ASCII */
    uint8_t clean : 1; /* each token in the subtree is whole valid UTF-8 from this node on */
} tnode;

struct sh_gvocab {
    int32_t n_vocab;
    uint32_t n_nodes, max_depth;
    tnode *nodes;       /* (n_nodes + 1): the last one only closes tok_lo */
    uint64_t (*sig)[2]; /* (n_nodes): the ASCII bytes in node i's subtree, its own included */
    int32_t *order;     /* (n_text): the tokens in the trie, sorted by bytes */
    uint8_t *kind;      /* (n_vocab): KIND_* */
    char *bytes;        /* every token's bytes, back to back */
    size_t *off;        /* (n_vocab + 1) */
    int32_t *eos;
    int32_t n_eos;
};

enum { KIND_NEVER, KIND_TEXT, KIND_EOS };
#define MAX_TOKEN_BYTES 65535

/* Whether b[0, len) (len 1-4, a lead byte first) is one whole valid code point. */
static int utf8_whole(const char *b, size_t len)
{
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    const uint8_t *u = (const uint8_t *)b;
    uint32_t v = len == 1 ? u[0] : len == 2 ? u[0] & 0x1Fu : len == 3 ? u[0] & 0x0Fu : u[0] & 7u;
    for (size_t k = 1; k < len; k++) {
        if ((u[k] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (u[k] & 0x3Fu);
    }
    return v >= min[len] && v <= 0x10FFFF && !(v >= 0xD800 && v <= 0xDFFF);
}

/* The length of the UTF-8 sequence that byte c starts; 0 for a continuation or invalid byte. */
static size_t utf8_len(uint8_t c)
{
    return c < 0x80                 ? 1
           : c >= 0xC2 && c <= 0xDF ? 2
           : c >= 0xE0 && c <= 0xEF ? 3
           : c >= 0xF0 && c <= 0xF4 ? 4
                                    : 0;
}

typedef struct sort_ctx {
    const char *bytes;
    const size_t *off;
} sort_ctx;

static int cmp_tok(const void *a, const void *b, void *c)
{
    const sort_ctx *x = c;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    size_t li = x->off[i + 1] - x->off[i], lj = x->off[j + 1] - x->off[j];
    int r = memcmp(x->bytes + x->off[i], x->bytes + x->off[j], li < lj ? li : lj);
    if (r)
        return r;
    if (li != lj)
        return li < lj ? -1 : 1;
    return i < j ? -1 : i > j;
}

sh_err sh_gvocab_create(const char *const *bytes, const size_t *lens, int32_t n,
                        const bool *special, const int32_t *eos, int32_t n_eos, sh_gvocab **out,
                        sh_error *e)
{
    *out = NULL;
    if (n <= 0 || !bytes || !lens || n_eos < 0 || (n_eos > 0 && !eos))
        return sh__error_set(e, SH_EINVAL, "grammar vocabulary: bad arguments (n %d)", (int)n);
    sh_gvocab *v = calloc(1, sizeof *v);
    if (!v)
        return sh__error_set(e, SH_ENOMEM, "grammar vocabulary: out of memory");
    v->n_vocab = n;
    v->kind = calloc((size_t)n, 1);
    v->off = malloc(((size_t)n + 1) * sizeof *v->off);
    v->eos = malloc(((size_t)n_eos + 1) * sizeof *v->eos);
    int32_t *order = malloc((size_t)n * sizeof *order);
    uint32_t *open = NULL, *path = NULL;
    uint8_t *valid = NULL; /* (max token length + 1) */
    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        total += lens[i] <= MAX_TOKEN_BYTES ? lens[i] : 0;
    v->bytes = malloc(total + 1);
    if (!v->kind || !v->off || !v->eos || !order || !v->bytes)
        goto nomem;
    for (int32_t k = 0; k < n_eos; k++) {
        if (eos[k] < 0 || eos[k] >= n) {
            sh_gvocab_free(v);
            free(order);
            return sh__error_set(e, SH_EINVAL, "grammar vocabulary: end token %d out of range",
                                 (int)eos[k]);
        }
        v->eos[k] = eos[k];
    }
    v->n_eos = n_eos;
    /* Control tokens are left out of the trie: the model may not emit "<|im_start|>" to satisfy
     * a grammar that wants that text (its bytes would not be what the detokenizer prints). */
    int32_t n_text = 0;
    size_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        v->off[i] = at;
        int text = (!special || !special[i]) && lens[i] > 0 && lens[i] <= MAX_TOKEN_BYTES;
        if (text) {
            memcpy(v->bytes + at, bytes[i], lens[i]);
            at += lens[i];
            v->kind[i] = KIND_TEXT;
            order[n_text++] = i;
        }
    }
    v->off[n] = at;
    for (int32_t k = 0; k < n_eos; k++)
        v->kind[eos[k]] = KIND_EOS;
    sort_ctx ctx = {v->bytes, v->off};
    qsort_r(order, (size_t)n_text, sizeof *order, cmp_tok, &ctx);
    /* Build the nodes in sorted order, which is depth-first order: a token shares with the one
     * before it their common prefix's nodes and adds nodes for the rest. */
    v->nodes = malloc((at + 1) * sizeof *v->nodes);
    v->sig = malloc((at + 1) * sizeof *v->sig);
    uint32_t *parent = malloc((at + 1) * sizeof *parent);
    uint32_t maxd = 1;
    for (int32_t k = 0; k < n_text; k++) {
        size_t l = v->off[order[k] + 1] - v->off[order[k]];
        if (l > maxd)
            maxd = (uint32_t)l;
    }
    path = malloc(((size_t)maxd + 1) * sizeof *path);
    valid = malloc((size_t)maxd + 1);
    open = malloc(((size_t)maxd + 1) * sizeof *open);
    if (!v->nodes || !v->sig || !parent || !path || !open || !valid) {
        free(parent);
        goto nomem;
    }
    v->max_depth = maxd;
    uint32_t nn = 0, n_open = 0;
    const char *prev = NULL;
    size_t prev_len = 0;
    for (int32_t k = 0; k < n_text; k++) {
        int32_t t = order[k];
        const char *b = v->bytes + v->off[t];
        size_t l = v->off[t + 1] - v->off[t], lcp = 0;
        while (prev && lcp < l && lcp < prev_len && b[lcp] == prev[lcp])
            lcp++;
        for (size_t d = lcp + 1; d <= l; d++) {
            /* Every open node at this depth or deeper is complete: its subtree ends here. */
            while (n_open > 0 && v->nodes[open[n_open - 1]].depth >= d)
                v->nodes[open[--n_open]].skip = nn;
            uint8_t c = (uint8_t)b[d - 1];
            v->nodes[nn] = (tnode){0, (uint32_t)k, (uint16_t)d, c, c >= 0x80, 1};
            v->sig[nn][0] = c < 64 ? 1ull << c : 0;
            v->sig[nn][1] = c >= 64 && c < 128 ? 1ull << (c - 64) : 0;
            parent[nn] = d > 1 ? path[d - 1] : UINT32_MAX;
            path[d] = nn;
            open[n_open++] = nn;
            nn++;
        }
        /* A node is clean when, for every token through it, the token's bytes from the start of
         * the character holding the node's byte to its end are whole valid UTF-8: backwards,
         * which offsets start valid text up to the end; then forwards, each continuation byte
         * takes its lead byte's answer. */
        valid[l] = 1;
        for (size_t d = l; d-- > 0;) {
            size_t len = utf8_len((uint8_t)b[d]);
            valid[d] = len > 0 && d + len <= l && valid[d + len] && utf8_whole(b + d, len);
        }
        uint8_t lead_ok = 0;
        for (size_t d = 0, rest = 0; d < l; d++) {
            size_t len = utf8_len((uint8_t)b[d]);
            if (len > 0) {
                lead_ok = valid[d];
                rest = len - 1;
            } else if (rest > 0) {
                rest--;
            } else {
                lead_ok = 0;
            }
            if (!lead_ok)
                v->nodes[path[d + 1]].clean = 0;
        }
        prev = b;
        prev_len = l;
    }
    while (n_open > 0)
        v->nodes[open[--n_open]].skip = nn;
    v->n_nodes = nn;
    v->nodes[nn] = (tnode){nn, (uint32_t)n_text, 0, 0, 0, 1};
    /* Children come after their parent: fold each subtree's bytes into its parent, last first. */
    for (uint32_t i = nn; i-- > 0;) {
        uint32_t q = parent[i];
        if (q == UINT32_MAX)
            continue;
        v->sig[q][0] |= v->sig[i][0];
        v->sig[q][1] |= v->sig[i][1];
        v->nodes[q].wide |= v->nodes[i].wide;
        v->nodes[q].clean &= v->nodes[i].clean;
    }
    free(parent);
    v->order = order;
    free(open);
    free(path);
    free(valid);
    *out = v;
    return SH_OK;
nomem:
    free(order);
    free(open);
    free(path);
    free(valid);
    sh_gvocab_free(v);
    return sh__error_set(e, SH_ENOMEM, "grammar vocabulary: out of memory");
}

sh_err sh_gvocab_create_tokenizer(const sh_tokenizer *t, sh_gvocab **out, sh_error *e)
{
    int32_t n = sh_tokenizer_n_vocab(t), n_eos = 0;
    const char **bytes = malloc((size_t)n * sizeof *bytes);
    size_t *lens = malloc((size_t)n * sizeof *lens);
    bool *special = malloc((size_t)n * sizeof *special);
    int32_t *eos = malloc((size_t)n * sizeof *eos);
    sh_err rc = SH_ENOMEM;
    if (!bytes || !lens || !special || !eos) {
        sh__error_set(e, rc, "grammar vocabulary: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < n; i++) {
        lens[i] = sh_tokenizer_piece(t, i, 0, &bytes[i]);
        special[i] = sh_tokenizer_is_control(t, i);
        if (sh_tokenizer_is_eog(t, i))
            eos[n_eos++] = i;
    }
    rc = sh_gvocab_create(bytes, lens, n, special, eos, n_eos, out, e);
out:
    free(bytes);
    free(lens);
    free(special);
    free(eos);
    return rc;
}

void sh_gvocab_free(sh_gvocab *v)
{
    if (!v)
        return;
    free(v->nodes);
    free(v->sig);
    free(v->order);
    free(v->kind);
    free(v->bytes);
    free(v->off);
    free(v->eos);
    free(v);
}

int32_t sh_gvocab_n_vocab(const sh_gvocab *v) { return v->n_vocab; }

bool sh_gmatch_token_ok(sh_gmatch *m, const sh_gvocab *v, int32_t tok)
{
    sh__gmatch_maybe_flush(m);
    if (m->err || tok < 0 || tok >= v->n_vocab)
        return false;
    if (v->kind[tok] == KIND_EOS)
        return sh__gmatch_state_can_end(m, m->cur);
    if (v->kind[tok] != KIND_TEXT)
        return false;
    return sh__gmatch_walk(m, m->cur, v->bytes + v->off[tok], v->off[tok + 1] - v->off[tok]) >= 0;
}

bool sh_gmatch_accept_token(sh_gmatch *m, const sh_gvocab *v, int32_t tok)
{
    sh__gmatch_maybe_flush(m);
    if (m->err || tok < 0 || tok >= v->n_vocab)
        return false;
    if (v->kind[tok] == KIND_EOS)
        return sh__gmatch_state_can_end(m, m->cur);
    if (v->kind[tok] != KIND_TEXT)
        return false;
    int32_t s = sh__gmatch_walk(m, m->cur, v->bytes + v->off[tok], v->off[tok + 1] - v->off[tok]);
    if (s < 0)
        return false;
    m->cur = (uint32_t)s;
    return true;
}

sh_err sh_gmatch_mask(sh_gmatch *m, const sh_gvocab *v, uint64_t *bits)
{
    sh__gmatch_maybe_flush(m);
    if (m->err)
        return m->err;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    m->clock++;
    for (int k = 0; k < SH_GMATCH_MASKS; k++) {
        sh_gmask *c = &m->masks[k];
        if (c->state == m->cur && c->vocab == v) {
            memcpy(bits, c->bits, words * sizeof *bits);
            c->stamp = m->clock;
            return SH_OK;
        }
    }
    uint32_t *st = malloc(((size_t)v->max_depth + 1) * sizeof *st);
    if (!st)
        return SH_ENOMEM;
    m->spent_cap = m->spent + SH_GMATCH_MASK_WORK;
    memset(bits, 0, words * sizeof *bits);
    st[0] = m->cur;
    const tnode *nodes = v->nodes;
    const int32_t *order = v->order;
    for (uint32_t i = 0; i < v->n_nodes && !m->err;) {
        const tnode *x = &nodes[i];
        uint32_t sp = st[x->depth - 1];
        /* A subtree of whole characters that all lead back to the parent's state (the inside of
         * a JSON string): every token in it is allowed, without walking it. */
        if (x->skip - i >= 2 && x->clean) {
            const sh_gstate *ls = sh__gmatch_loop(m, sp);
            /* Cleanliness is counted from the token's start: it holds only where the state is
             * inside a character exactly when the node's byte continues one. */
            int starts = (x->byte & 0xC0) != 0x80, pending = (ls->pend & 3) != 0;
            if (starts != pending && !(v->sig[i][0] & ~ls->loop[0]) &&
                !(v->sig[i][1] & ~ls->loop[1]) && (!x->wide || ls->wide_loop)) {
                for (uint32_t k = x->tok_lo; k < nodes[x->skip].tok_lo; k++)
                    bits[order[k] >> 6] |= 1ull << (order[k] & 63);
                i = x->skip;
                continue;
            }
        }
        int32_t t = sh__gmatch_trans(m, sp, x->byte);
        if (t < 0) {
            i = x->skip;
            continue;
        }
        st[x->depth] = (uint32_t)t;
        for (uint32_t k = x->tok_lo; k < nodes[i + 1].tok_lo; k++)
            bits[order[k] >> 6] |= 1ull << (order[k] & 63);
        i++;
    }
    free(st);
    m->spent_cap = UINT64_MAX;
    if (m->err)
        return m->err;
    if (sh__gmatch_state_can_end(m, m->cur))
        for (int32_t k = 0; k < v->n_eos; k++)
            bits[v->eos[k] >> 6] |= 1ull << (v->eos[k] & 63);
    /* Keep a copy for the next time this state comes back (the least recently used slot). */
    sh_gmask *c = &m->masks[0];
    for (int k = 1; k < SH_GMATCH_MASKS; k++)
        if (m->masks[k].stamp < c->stamp)
            c = &m->masks[k];
    if (c->vocab != v || !c->bits) {
        free(c->bits);
        c->bits = malloc(words * sizeof *bits);
        c->vocab = c->bits ? v : NULL;
        c->state = UINT32_MAX;
    }
    if (c->bits) {
        memcpy(c->bits, bits, words * sizeof *bits);
        c->state = m->cur;
        c->stamp = m->clock;
    }
    return SH_OK;
}
