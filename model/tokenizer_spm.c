/* SentencePiece-style encoding as llama.cpp does it: spaces become U+2581, characters are merged
 * pairwise, best-scoring vocabulary pair first, and what stays unmatched falls back to <0xNN>. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/tokenizer_internal.h"

#define SPACE_MARK "\xE2\x96\x81" /* U+2581, SentencePiece's visible space */

typedef struct spm_sym {
    int32_t prev, next;
    uint32_t off, n; /* bytes of the escaped text; n == 0 once merged into its left neighbour */
} spm_sym;

static bool is_mark(const char *s, size_t n) { return n == 3 && memcmp(s, SPACE_MARK, 3) == 0; }

/* Splitting the text into words before merging gives the same result as merging it whole (what
 * llama.cpp does) when no vocabulary text could span a word boundary: merges never cross it, and
 * merges inside a word happen in the same relative order. The boundaries used are before a U+2581
 * that follows another character, so it is safe when no token holds a U+2581 right after a
 * character other than U+2581. Tokens are cut into characters the way the encoder cuts text. */
static bool split_is_safe(const sh_tokenizer *t)
{
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const char *s = sh__tok_sym_text(t, id);
        size_t n = t->sym_len[id], i = 0;
        bool prev_other = false;
        while (i < n) {
            size_t k = sh__tok_utf8_len((unsigned char)s[i]);
            if (k > n - i)
                k = n - i;
            bool mark = is_mark(s + i, k);
            if (mark && prev_other)
                return false;
            prev_other = !mark;
            i += k;
        }
    }
    return true;
}

sh_err sh__spm_init(sh_tokenizer *t, sh_error *e)
{
    (void)e;
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char name[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
        int32_t id = sh__tok_lookup(t, name, 6);
        if (id < 0) {
            char c = (char)b;
            id = sh__tok_lookup(t, &c, 1);
        }
        t->byte_tok[b] = id >= 0 ? id : t->unk;
    }
    t->spm_split = split_is_safe(t);
    t->pre_known = true;
    return SH_OK;
}

typedef struct spm_run {
    const sh_tokenizer *t;
    sh__tok_work *w;
    const char *text;
    spm_sym *sym;
    sh__tok_heap heap;
} spm_run;

static void try_bigram(spm_run *r, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return;
    const spm_sym *l = &r->sym[left], *rt = &r->sym[right];
    uint32_t size = l->n + rt->n;
    if (size > r->t->max_token_len)
        return;
    int32_t id = sh__tok_lookup(r->t, r->text + l->off, size);
    if (id < 0 || id >= r->t->n_vocab)
        return;
    /* Plain text never merges into a control, unknown or byte token: "<s>" or "<0x41>" typed by a
     * user stays text. SentencePiece keeps these out of its merge table; llama.cpp does not
     * check, which is the one place this encoder departs from it. */
    uint8_t ty = r->t->types[id];
    if (ty == SH_TOKEN_CONTROL || ty == SH_TOKEN_UNKNOWN || ty == SH_TOKEN_BYTE)
        return;
    /* Higher score first; tag[0] is the pair's byte length, which changes if either side merges. */
    sh__tok_bigram b = {-r->t->scores[id], left, right, {(int32_t)size, 0, 0}};
    sh__tok_heap_push(&r->heap, b);
}

/* Merges text[off, off + n) on its own and appends its tokens. The symbol and heap arrays are
 * sized by the caller for the longest word. */
static sh_err merge_word(spm_run *r, uint32_t off, uint32_t n)
{
    const sh_tokenizer *t = r->t;
    int32_t count = 0;
    for (uint32_t i = 0; i < n;) {
        uint32_t k = (uint32_t)sh__tok_utf8_len((unsigned char)r->text[off + i]);
        if (k > n - i)
            k = n - i;
        r->sym[count] = (spm_sym){count - 1, i + k == n ? -1 : count + 1, off + i, k};
        count++;
        i += k;
    }
    r->heap.n = 0;
    for (int32_t i = 1; i < count; i++)
        try_bigram(r, i - 1, i);
    while (r->heap.n) {
        sh__tok_bigram b = sh__tok_heap_pop(&r->heap);
        spm_sym *l = &r->sym[b.left], *rt = &r->sym[b.right];
        if (l->n == 0 || rt->n == 0 || l->n + rt->n != (uint32_t)b.tag[0])
            continue;
        l->n += rt->n;
        rt->n = 0;
        l->next = rt->next;
        if (rt->next >= 0)
            r->sym[rt->next].prev = b.left;
        try_bigram(r, l->prev, b.left);
        try_bigram(r, b.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && count > 0; i = r->sym[i].next) {
        const spm_sym *s = &r->sym[i];
        int32_t id = sh__tok_lookup(t, r->text + s->off, s->n);
        if (id >= 0 && id < t->n_vocab) {
            sh_err err = sh__tok_push(r->w, id);
            if (err)
                return err;
            continue;
        }
        /* Not a token: every byte on its own (a single character outside the vocabulary). */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t bt = t->byte_tok[(unsigned char)r->text[s->off + j]];
            if (bt < 0)
                continue;
            sh_err err = sh__tok_push(r->w, bt);
            if (err)
                return err;
        }
    }
    return SH_OK;
}

/* Start of the next word at or after symbol position i: a U+2581 that follows another symbol. */
static size_t next_word(const char *s, size_t n, size_t i)
{
    bool prev_other = false;
    while (i < n) {
        size_t k = sh__tok_utf8_len((unsigned char)s[i]);
        if (k > n - i)
            k = n - i;
        bool mark = is_mark(s + i, k);
        if (mark && prev_other)
            return i;
        prev_other = !mark;
        i += k;
    }
    return n;
}

sh_err sh__spm_encode(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len,
                      bool prefix_space)
{
    size_t cap = len * 3 + 3;
    void *buf = w->buf;
    sh_err err = sh__tok_reserve(&buf, &w->buf_cap, cap, 1);
    w->buf = buf;
    if (err)
        return sh__error_set(w->e, err, "tokenizer: out of memory for %zu bytes", cap);
    size_t m = 0;
    if (prefix_space) {
        memcpy(w->buf, SPACE_MARK, 3);
        m = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(w->buf + m, SPACE_MARK, 3);
            m += 3;
        } else {
            w->buf[m++] = text[i];
        }
    }

    /* Word boundaries first, to size the scratch for the longest word. */
    size_t longest = 0;
    if (t->spm_split) {
        for (size_t a = 0; a < m;) {
            size_t b = next_word(w->buf, m, a == 0 ? 0 : a + 3);
            if (b - a > longest)
                longest = b - a;
            a = b;
        }
    } else {
        longest = m;
    }
    void *sym = w->sym, *heap = w->heap;
    err = sh__tok_reserve(&sym, &w->sym_cap, longest + 1, sizeof(spm_sym));
    w->sym = sym;
    if (!err) {
        /* Each merge queues at most two pairs on top of the initial n - 1. */
        err = sh__tok_reserve(&heap, &w->heap_cap, 3 * longest + 4, sizeof(sh__tok_bigram));
        w->heap = heap;
    }
    if (err)
        return sh__error_set(w->e, err, "tokenizer: out of memory for %zu symbols", longest);

    spm_run r = {t, w, w->buf, w->sym, {w->heap, 0}};
    for (size_t a = 0; a < m;) {
        size_t b = t->spm_split ? next_word(w->buf, m, a == 0 ? 0 : a + 3) : m;
        if ((err = merge_word(&r, (uint32_t)a, (uint32_t)(b - a))))
            return err;
        a = b;
    }
    return SH_OK;
}
