/* Tokenizer tables: the string-to-symbol hash table over the text pool, the 64-bit-key table for
 * merges and the special-token trie, and the per-call scratch helpers. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/tokenizer_internal.h"

/* ---- hashing and tables ---- */

uint32_t sh__tok_hash(const char *s, size_t n)
{
    /* Eight bytes at a time with a multiply-xorshift mix: texts are short and this runs for every
     * candidate merge, so it must be cheap; quality only needs to spread ids over the table. */
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, s, n);
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0x94D049BB133111EBull;
    return (uint32_t)(h ^ (h >> 32));
}

int32_t sh__tok_lookup(const sh_tokenizer *t, const char *s, size_t n)
{
    uint32_t h = sh__tok_hash(s, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        const sh__tok_strslot *sl = &t->map[i];
        if (sl->id < 0)
            return -1;
        if (sl->hash == h && t->sym_len[sl->id] == n &&
            memcmp(t->pool + t->sym_off[sl->id], s, n) == 0)
            return sl->id;
    }
}

sh_err sh__tok_pool_add(sh_tokenizer *t, const char *s, size_t n, bool nul, uint32_t *off)
{
    size_t need = t->pool_len + n + (nul ? 1 : 0);
    if (need > UINT32_MAX)
        return SH_ERANGE;
    if (need > t->pool_cap) {
        size_t cap = t->pool_cap ? t->pool_cap : 4096;
        while (cap < need)
            cap *= 2;
        char *p = realloc(t->pool, cap);
        if (!p)
            return SH_ENOMEM;
        t->pool = p;
        t->pool_cap = cap;
    }
    *off = (uint32_t)t->pool_len;
    if (n)
        memcpy(t->pool + t->pool_len, s, n);
    t->pool_len += n;
    if (nul)
        t->pool[t->pool_len++] = '\0';
    return SH_OK;
}

/* Points the slot of text at id (overwriting an earlier id with the same text, as llama.cpp's
 * token_to_id map does). The table is sized so that it never fills past half. */
static void map_set(sh_tokenizer *t, int32_t id)
{
    const char *s = t->pool + t->sym_off[id];
    size_t n = t->sym_len[id];
    uint32_t h = sh__tok_hash(s, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        sh__tok_strslot *sl = &t->map[i];
        if (sl->id < 0 || (sl->hash == h && t->sym_len[sl->id] == n &&
                           memcmp(t->pool + t->sym_off[sl->id], s, n) == 0)) {
            sl->hash = h;
            sl->id = id;
            return;
        }
    }
}

sh_err sh__tok_map_resize(sh_tokenizer *t, size_t n_syms)
{
    size_t cap = 64;
    while (cap < n_syms * 2)
        cap *= 2;
    if (cap > ((size_t)1 << 31))
        return SH_ERANGE;
    sh__tok_strslot *m = malloc(cap * sizeof *m);
    if (!m)
        return SH_ENOMEM;
    for (size_t i = 0; i < cap; i++)
        m[i].id = -1;
    free(t->map);
    t->map = m;
    t->map_mask = (uint32_t)(cap - 1);
    for (int32_t i = 0; i < t->n_sym; i++)
        map_set(t, i);
    return SH_OK;
}

sh_err sh__tok_sym_add(sh_tokenizer *t, const char *s, size_t n, int32_t *id)
{
    if (t->n_sym == t->sym_cap) {
        if (t->sym_cap > INT32_MAX / 2)
            return SH_ERANGE;
        int32_t cap = t->sym_cap ? t->sym_cap * 2 : 1024;
        uint32_t *o = realloc(t->sym_off, (size_t)cap * sizeof *o);
        if (!o)
            return SH_ENOMEM;
        t->sym_off = o;
        uint32_t *l = realloc(t->sym_len, (size_t)cap * sizeof *l);
        if (!l)
            return SH_ENOMEM;
        t->sym_len = l;
        t->sym_cap = cap;
    }
    int32_t i = t->n_sym;
    sh_err err = sh__tok_pool_add(t, s, n, true, &t->sym_off[i]);
    if (err)
        return err;
    t->sym_len[i] = (uint32_t)n;
    t->n_sym++;
    if ((size_t)t->n_sym * 2 > (size_t)t->map_mask + 1) {
        err = sh__tok_map_resize(t, (size_t)t->n_sym * 2);
        if (err)
            return err;
    } else {
        map_set(t, i);
    }
    *id = i;
    return SH_OK;
}

sh_err sh__tok_intern(sh_tokenizer *t, const char *s, size_t n, int32_t *id)
{
    int32_t i = sh__tok_lookup(t, s, n);
    if (i >= 0) {
        *id = i;
        return SH_OK;
    }
    return sh__tok_sym_add(t, s, n, id);
}

sh_err sh__tok_u64map_init(sh__tok_u64map *m, size_t n)
{
    size_t cap = 16;
    while (cap < n * 2)
        cap *= 2;
    if (cap > ((size_t)1 << 31))
        return SH_ERANGE;
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots)
        return SH_ENOMEM;
    for (size_t i = 0; i < cap; i++)
        m->slots[i].key = UINT64_MAX;
    m->mask = (uint32_t)(cap - 1);
    m->n = 0;
    return SH_OK;
}

void sh__tok_u64map_fini(sh__tok_u64map *m)
{
    free(m->slots);
    m->slots = NULL;
}

static uint32_t u64_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDull;
    k ^= k >> 33;
    return (uint32_t)k;
}

void sh__tok_u64map_put(sh__tok_u64map *m, uint64_t key, int32_t a, int32_t b)
{
    for (uint32_t i = u64_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        sh__tok_u64slot *s = &m->slots[i];
        if (s->key == key)
            return;
        if (s->key == UINT64_MAX) {
            s->key = key;
            s->a = a;
            s->b = b;
            m->n++;
            return;
        }
    }
}

const sh__tok_u64slot *sh__tok_u64map_get(const sh__tok_u64map *m, uint64_t key)
{
    if (!m->slots)
        return NULL;
    for (uint32_t i = u64_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        const sh__tok_u64slot *s = &m->slots[i];
        if (s->key == key)
            return s;
        if (s->key == UINT64_MAX)
            return NULL;
    }
}

/* ---- per-call scratch ---- */

sh_err sh__tok_reserve(void **p, size_t *cap, size_t n, size_t elem)
{
    if (n <= *cap)
        return SH_OK;
    size_t c = *cap ? *cap : 64;
    while (c < n)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return SH_ENOMEM;
    *p = q;
    *cap = c;
    return SH_OK;
}

sh_err sh__tok_push(sh__tok_work *w, int32_t id)
{
    if (w->max_out && w->n_out >= w->max_out) {
        w->over = true;
        return sh__error_set(w->e, SH_ERANGE, "tokenizer: more than %zu ids", w->max_out);
    }
    if (w->n_out == w->out_cap) {
        void *p = w->out;
        sh_err err = sh__tok_reserve(&p, &w->out_cap, w->n_out + 1, sizeof(int32_t));
        w->out = p;
        if (err)
            return sh__error_set(w->e, err, "tokenizer: out of memory for %zu ids", w->n_out + 1);
    }
    w->out[w->n_out++] = id;
    return SH_OK;
}

void sh__tok_work_fini(sh__tok_work *w)
{
    free(w->out);
    free(w->sym);
    free(w->heap);
    free(w->buf);
    if (w->md)
        pcre2_match_data_free(w->md);
    if (w->mctx)
        pcre2_match_context_free(w->mctx);
    if (w->jit)
        pcre2_jit_stack_free(w->jit);
}
