/* Byte-level BPE encoding as llama.cpp does it: each pre-tokenized word is mapped through the GPT-2
 * byte-to-character table and merged pairwise by merge rank, lowest rank first. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/tokenizer_internal.h"

/* GPT-2's byte-to-unicode map: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * (controls, space, DEL, NBSP, soft hyphen) take code points 256, 257, ... in byte order, so that
 * every byte is a visible character. */
static bool byte_printable(unsigned b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

static uint32_t byte_cp(unsigned b)
{
    if (byte_printable(b))
        return b;
    if (b <= 32)
        return 256 + b; /* the first 33 unprintable bytes */
    if (b <= 160)
        return b + 162; /* 127..160 follow at 289 */
    return 323;         /* 173, the soft hyphen, is the last */
}

/* Inverse of byte_cp; -1 for a code point outside the map. */
static int cp_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_printable(cp) ? (int)cp : -1;
    if (cp <= 288)
        return (int)(cp - 256);
    if (cp <= 322)
        return (int)(cp - 162);
    return cp == 323 ? 173 : -1;
}

/* UTF-8 of the character byte b maps to: 1 or 2 bytes. */
static size_t byte_utf8(unsigned b, char out[2])
{
    uint32_t cp = byte_cp(b);
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

size_t sh__bpe_unmap(const char *text, size_t n, char *out)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        /* Only one- and two-byte characters can be in the map (code points below 324). */
        if (s[i] < 0x80) {
            out[m++] = (char)s[i++];
            continue;
        }
        if (i + 1 < n && s[i] >= 0xC2 && s[i] <= 0xDF && (s[i + 1] & 0xC0) == 0x80) {
            uint32_t cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
            int b = cp_byte(cp);
            if (b >= 0) {
                out[m++] = (char)b;
                i += 2;
                continue;
            }
        }
        /* A character outside the map (an added token's raw text): kept as it is. */
        out[m++] = (char)s[i++];
    }
    return m;
}

sh_err sh__bpe_init(sh_tokenizer *t, const sh_gguf_value *merges, sh_error *e)
{
    uint64_t n = merges->v.arr.n;
    if (n > INT32_MAX / 4)
        return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.merges: %llu merges",
                             (unsigned long long)n);
    sh_err err = sh__tok_u64map_init(&t->merges, (size_t)n);
    if (err)
        return sh__error_set(e, err, "tokenizer: out of memory for %llu merges",
                             (unsigned long long)n);
    char *tmp = NULL;
    size_t tmp_cap = 0;
    for (uint64_t i = 0; i < n; i++) {
        const sh_str *m = &merges->v.arr.strs[i];
        /* llama.cpp splits at the first space after the first byte. */
        const char *sp = m->len > 1 ? memchr(m->ptr + 1, ' ', (size_t)m->len - 1) : NULL;
        if (!sp || m->len > UINT32_MAX / 2) {
            free(tmp);
            return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.merges[%llu]: no 'left right' pair",
                                 (unsigned long long)i);
        }
        size_t nl = (size_t)(sp - m->ptr), nr = (size_t)m->len - nl - 1;
        void *p = tmp;
        if ((err = sh__tok_reserve(&p, &tmp_cap, nl + nr + 1, 1))) {
            free(tmp);
            return sh__error_set(e, err, "tokenizer: out of memory");
        }
        tmp = p;
        memcpy(tmp, m->ptr, nl);
        memcpy(tmp + nl, sp + 1, nr);
        int32_t l, r, res;
        if ((err = sh__tok_intern(t, m->ptr, nl, &l)) ||
            (err = sh__tok_intern(t, sp + 1, nr, &r)) ||
            (err = sh__tok_intern(t, tmp, nl + nr, &res))) {
            free(tmp);
            return sh__error_set(e, err, "tokenizer.ggml.merges[%llu]: %s", (unsigned long long)i,
                                 sh_strerror(err));
        }
        /* A repeated pair keeps its first (best) rank, like llama.cpp's emplace. */
        sh__tok_u64map_put(&t->merges, (uint64_t)(uint32_t)l << 32 | (uint32_t)r, (int32_t)i, res);
    }
    free(tmp);
    for (unsigned b = 0; b < 256; b++) {
        char u[2];
        size_t k = byte_utf8(b, u);
        t->byte_sym[b] = sh__tok_lookup(t, u, k);
    }
    return sh__pre_init(t, e);
}

typedef struct bpe_sym {
    int32_t prev, next;
    int32_t sym;     /* symbol id of the text, -1 when it is not a known string */
    uint32_t off, n; /* bytes of the word; n == 0 once merged away */
} bpe_sym;

typedef struct bpe_run {
    const sh_tokenizer *t;
    bpe_sym *sym;
    sh__tok_heap heap;
} bpe_run;

static void try_bigram(bpe_run *r, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return;
    int32_t ls = r->sym[left].sym, rs = r->sym[right].sym;
    if (ls < 0 || rs < 0)
        return;
    const sh__tok_u64slot *m =
        sh__tok_u64map_get(&r->t->merges, (uint64_t)(uint32_t)ls << 32 | (uint32_t)rs);
    if (!m)
        return;
    /* Lower rank first; the tags are the texts when queued: a change means the pair went stale. */
    sh__tok_bigram b = {(float)m->a, left, right, {ls, rs, m->b}};
    sh__tok_heap_push(&r->heap, b);
}

/* Appends the byte-mapped text of word bytes s[0, n) to w->buf from offset 0; returns its length.
 */
static size_t map_bytes(sh__tok_work *w, const unsigned char *s, size_t n)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        m += byte_utf8(s[i], w->buf + m);
    return m;
}

/* Encodes one pre-tokenized word. */
static sh_err bpe_word(const sh_tokenizer *t, sh__tok_work *w, const char *word, size_t n)
{
    const unsigned char *s = (const unsigned char *)word;
    void *buf = w->buf, *sym = w->sym, *heap = w->heap;
    sh_err err = sh__tok_reserve(&buf, &w->buf_cap, 2 * n + 2, 1);
    w->buf = buf;
    if (!err) {
        err = sh__tok_reserve(&sym, &w->sym_cap, n + 1, sizeof(bpe_sym));
        w->sym = sym;
    }
    if (!err) {
        err = sh__tok_reserve(&heap, &w->heap_cap, 3 * n + 4, sizeof(sh__tok_bigram));
        w->heap = heap;
    }
    if (err)
        return sh__error_set(w->e, err, "tokenizer: out of memory for a %zu-byte word", n);

    if (t->ignore_merges) {
        size_t m = map_bytes(w, s, n);
        int32_t id = sh__tok_lookup(t, w->buf, m);
        if (id >= 0 && id < t->n_vocab)
            return sh__tok_push(w, id);
    }

    bpe_run r = {t, w->sym, {w->heap, 0}};
    int32_t count = (int32_t)n;
    for (int32_t i = 0; i < count; i++)
        r.sym[i] = (bpe_sym){i - 1, i + 1 == count ? -1 : i + 1, t->byte_sym[s[i]], (uint32_t)i, 1};
    for (int32_t i = 1; i < count; i++)
        try_bigram(&r, i - 1, i);
    while (r.heap.n) {
        sh__tok_bigram b = sh__tok_heap_pop(&r.heap);
        bpe_sym *l = &r.sym[b.left], *rt = &r.sym[b.right];
        if (l->n == 0 || rt->n == 0 || l->sym != b.tag[0] || rt->sym != b.tag[1])
            continue;
        l->sym = b.tag[2];
        l->n += rt->n;
        rt->n = 0;
        l->next = rt->next;
        if (rt->next >= 0)
            r.sym[rt->next].prev = b.left;
        try_bigram(&r, l->prev, b.left);
        try_bigram(&r, b.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && count > 0; i = r.sym[i].next) {
        const bpe_sym *x = &r.sym[i];
        if (x->sym >= 0 && x->sym < t->n_vocab) {
            if ((err = sh__tok_push(w, x->sym)))
                return err;
            continue;
        }
        /* Not a token: llama.cpp looks up each byte of the mapped text as a one-byte token, which
         * only printable ASCII can match; the rest of the text is dropped. */
        size_t m = map_bytes(w, s + x->off, x->n);
        for (size_t j = 0; j < m; j++) {
            int32_t id = sh__tok_lookup(t, w->buf + j, 1);
            if (id >= 0 && id < t->n_vocab && (err = sh__tok_push(w, id)))
                return err;
        }
    }
    return SH_OK;
}

sh_err sh__bpe_encode(const sh_tokenizer *t, sh__tok_work *w, const char *text, size_t len)
{
    return sh__pre_split(t, w, text, len, bpe_word);
}
