/* The tokenizer's internal layout and the helpers its files (tokenizer*.c) share. */
#ifndef SH_MODEL_TOKENIZER_INTERNAL_H
#define SH_MODEL_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "model/tokenizer.h"

#define SH__TOK_MAX_RE 6 /* most regexes a pre-tokenizer chains (deepseek-llm) */

/* Open-addressing table from a byte string to a symbol id; the strings themselves live in the
 * tokenizer's pool, so a slot holds only the hash and the id (-1 when empty). */
typedef struct sh__tok_strslot {
    uint32_t hash;
    int32_t id;
} sh__tok_strslot;

/* Open-addressing table from a 64-bit key to two int32 values; key UINT64_MAX marks empty. Used
 * for BPE merges ((left, right) -> (rank, result)) and the special-token trie edges. */
typedef struct sh__tok_u64slot {
    uint64_t key;
    int32_t a, b;
} sh__tok_u64slot;

typedef struct sh__tok_u64map {
    sh__tok_u64slot *slots;
    uint32_t mask; /* capacity - 1; capacity is a power of two */
    uint32_t n;
} sh__tok_u64map;

/* Symbols are the strings the algorithms compare: ids [0, n_vocab) are the tokens, ids from
 * n_vocab on are strings that appear only in BPE merges (a merge whose parts or result are not
 * tokens). */
struct sh_tokenizer {
    sh_tokenizer_kind kind;
    int32_t n_vocab;
    int32_t n_sym, sym_cap;

    char *pool; /* symbol texts (each NUL-terminated) and decoded pieces */
    size_t pool_len, pool_cap;
    uint32_t *sym_off, *sym_len;     /* (sym_cap) */
    uint32_t *piece_off, *piece_len; /* (n_vocab) */
    float *scores;                   /* (n_vocab) */
    uint8_t *types;                  /* (n_vocab) sh_token_type */

    sh__tok_strslot *map; /* text -> symbol id; a repeated text maps to its last id */
    uint32_t map_mask;

    int32_t bos, eos, eot, eom, unk;
    bool add_bos, add_eos, add_space_prefix;
    uint32_t max_token_len; /* longest vocabulary text in bytes */
    size_t max_piece;

    /* Special-token trie: edge (node << 8 | byte) -> child node in .a. trie_any[node] is the
     * token (CONTROL, UNKNOWN or USER_DEFINED) whose text ends at node, trie_user[node] the
     * USER_DEFINED one; -1 when none. special_first marks bytes that start a special text. */
    sh__tok_u64map trie;
    int32_t *trie_any, *trie_user;
    int32_t n_trie;
    bool special_first[256];

    /* SPM */
    int32_t byte_tok[256]; /* token for a raw byte: <0xNN>, else the 1-byte text, else unk/-1 */
    bool spm_split;        /* words may be merged independently (see tokenizer_spm.c) */

    /* BPE */
    sh__tok_u64map merges;
    int32_t byte_sym[256]; /* symbol of the GPT-2 character for each byte, or -1 */
    bool ignore_merges;    /* a whole pre-token that is a token is emitted as is (Llama 3) */
    char pre[64];
    bool pre_known;
    int n_re;
    pcre2_code *re[SH__TOK_MAX_RE];
};

/* Per-call scratch for encode; zero-initialise, then sh__tok_work_fini. */
typedef struct sh__tok_work {
    int32_t *out; /* output ids */
    size_t n_out, out_cap;
    void *sym; /* symbols of the algorithm in progress */
    size_t sym_cap;
    void *heap; /* its priority queue */
    size_t heap_cap;
    char *buf; /* escaped text (SPM) or byte-mapped word (BPE) */
    size_t buf_cap;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    sh_error *e;
    size_t max_out; /* > 0: sh__tok_push fails with SH_ERANGE past this many ids (over set) */
    bool over;
} sh__tok_work;

void sh__tok_work_fini(sh__tok_work *w);
sh_err sh__tok_push(sh__tok_work *w, int32_t id);
/* Grows a scratch array to hold at least n elements of size elem. */
sh_err sh__tok_reserve(void **p, size_t *cap, size_t n, size_t elem);

uint32_t sh__tok_hash(const char *s, size_t n);
/* Symbol id of text[0, n), or -1. */
int32_t sh__tok_lookup(const sh_tokenizer *t, const char *s, size_t n);
/* Symbol id of text[0, n), adding it as a new symbol when absent. */
sh_err sh__tok_intern(sh_tokenizer *t, const char *s, size_t n, int32_t *id);
/* Adds text[0, n) as a new symbol (even when the text is known: a repeated vocabulary text then
 * maps to its last id). */
sh_err sh__tok_sym_add(sh_tokenizer *t, const char *s, size_t n, int32_t *id);
/* Appends n bytes (and a NUL when nul) to the pool; their offset in *off. */
sh_err sh__tok_pool_add(sh_tokenizer *t, const char *s, size_t n, bool nul, uint32_t *off);
/* Rebuilds the symbol table with room for n_syms symbols at half load. */
sh_err sh__tok_map_resize(sh_tokenizer *t, size_t n_syms);
static inline const char *sh__tok_sym_text(const sh_tokenizer *t, int32_t id)
{
    return t->pool + t->sym_off[id];
}

sh_err sh__tok_u64map_init(sh__tok_u64map *m, size_t n);
void sh__tok_u64map_fini(sh__tok_u64map *m);
/* Inserts key -> (a, b) unless key is present (then leaves it); the map must have room (init with
 * the final count). */
void sh__tok_u64map_put(sh__tok_u64map *m, uint64_t key, int32_t a, int32_t b);
const sh__tok_u64slot *sh__tok_u64map_get(const sh__tok_u64map *m, uint64_t key);

/* Length of the UTF-8 sequence a lead byte announces, as llama.cpp counts it (1 for a
 * continuation byte). */
static inline size_t sh__tok_utf8_len(unsigned char c)
{
    static const uint8_t lens[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lens[c >> 4];
}
/* Length of the longest prefix of s[0, n) that is valid UTF-8 (RFC 3629). */
size_t sh__tok_utf8_valid(const unsigned char *s, size_t n);

/* SPM (tokenizer_spm.c). */
sh_err sh__spm_init(sh_tokenizer *t, sh_error *e);
sh_err sh__spm_encode(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len,
                      bool prefix_space);

/* BPE (tokenizer_bpe.c). merges holds the "left right" strings (STRING array). */
sh_err sh__bpe_init(sh_tokenizer *t, const sh_gguf_value *merges, sh_error *e);
sh_err sh__bpe_encode(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len);
/* Appends the decoded bytes of a byte-level BPE token text to out (room for n bytes needed). */
size_t sh__bpe_unmap(const char *text, size_t n, char *out);

/* Pre-tokenizer (tokenizer_pre.c): picks and compiles the regexes for t->pre. */
sh_err sh__pre_init(sh_tokenizer *t, sh_error *e);
void sh__pre_fini(sh_tokenizer *t);
typedef sh_err (*sh__pre_word_fn)(const sh_tokenizer *t, sh__tok_work *w, const char *s, size_t n);
/* Splits text into words and calls fn on each, in order. */
sh_err sh__pre_split(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len,
                     sh__pre_word_fn fn);

/* A candidate merge of two adjacent symbols, as both encoders queue them. The queue pops the
 * lowest `prio` first and, on ties, the leftmost pair (llama.cpp's order): BPE uses the merge
 * rank, SentencePiece the negated score. `tag` is what the encoder needs to notice a pair that
 * went stale after it was queued (the symbols' texts or the pair's byte length). */
typedef struct sh__tok_bigram {
    float prio;
    int32_t left, right;
    int32_t tag[3];
} sh__tok_bigram;

/* A binary min-heap over caller-provided storage (sized by the caller: no growth here). */
typedef struct sh__tok_heap {
    sh__tok_bigram *v;
    size_t n;
} sh__tok_heap;

static inline int sh__tok_bigram_before(const sh__tok_bigram *a, const sh__tok_bigram *b)
{
    return a->prio < b->prio || (a->prio == b->prio && a->left < b->left);
}

static inline void sh__tok_heap_push(sh__tok_heap *h, sh__tok_bigram b)
{
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!sh__tok_bigram_before(&b, &h->v[p]))
            break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = b;
}

/* Removes and returns the first pair; the heap must not be empty. */
static inline sh__tok_bigram sh__tok_heap_pop(sh__tok_heap *h)
{
    sh__tok_bigram top = h->v[0], last = h->v[--h->n];
    size_t n = h->n, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && sh__tok_bigram_before(&h->v[c + 1], &h->v[c]))
            c++;
        if (!sh__tok_bigram_before(&h->v[c], &last))
            break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (n)
        h->v[i] = last;
    return top;
}

#endif
