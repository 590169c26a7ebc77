/* The KV manager's logic: block refcounts, copy-on-write, hash-chain prefix cache, LRU eviction. */
#include "actors/kvmgr_core.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

/* Which intrusive list a block is on. A used block (ref > 0) is on none. */
enum { LIST_NONE, LIST_FREE, LIST_LRU };

typedef struct block {
    int32_t ref;
    int32_t prev, next; /* links on the free or LRU list, -1 at the ends */
    int32_t hnext;      /* next block in the same hash bucket, -1 at the end */
    uint8_t list;       /* LIST_* */
    uint8_t hashed;     /* registered in the hash table (implies chained) */
    uint8_t chained;    /* full, computed, hash/id/parent_id valid */
    uint64_t hash;      /* chain hash of the prefix ending with this block */
    uint64_t id;        /* cache id: own when hashed, else that of the equal cached block */
    uint64_t parent_id; /* cache id of the previous block of the chain (0: first block) */
} block;

typedef struct list {
    int32_t head, tail, n;
} list;

typedef struct seq {
    int32_t *table; /* max_blocks_per_seq entries; the first ceil(n_tokens / bt) are in use */
    int32_t n_tokens;
    int32_t n_computed;
    int32_t n_released; /* table entries before this one are SH_KV_NO_BLOCK (window) */
    uint8_t live;
    uint8_t cacheable; /* every token id appended so far is known */
} seq;

struct sh_kv_mgr {
    sh_kv_config cfg;
    int32_t bt; /* block_tokens */
    uint64_t hash_mask;
    block *blocks;   /* n_blocks */
    int32_t *ids;    /* (n_blocks, bt) token ids of the positions written in each block */
    int32_t *bucket; /* n_buckets heads, -1 when empty */
    uint64_t bucket_mask;
    seq *seqs;         /* max_seqs */
    int32_t *tables;   /* (max_seqs, max_blocks_per_seq) */
    int32_t *seq_free; /* stack of unused sequence ids */
    int32_t n_seq_free;
    list free_list; /* ref 0, not cached: order does not matter */
    list lru;       /* ref 0, cached: head is the least recently released, evicted first */
    int32_t n_used;
    int32_t n_hashed;
    uint64_t next_id; /* cache ids start at 1; 0 names the root of every chain */
    sh_kv_stats st;   /* counters only; gauges are computed on demand */
};

/* ---- lists ---- */

static void list_push_tail(sh_kv_mgr *kv, list *l, int which, int32_t b)
{
    block *x = &kv->blocks[b];
    x->list = (uint8_t)which;
    x->prev = l->tail;
    x->next = -1;
    if (l->tail >= 0)
        kv->blocks[l->tail].next = b;
    else
        l->head = b;
    l->tail = b;
    l->n++;
}

static void list_remove(sh_kv_mgr *kv, list *l, int32_t b)
{
    block *x = &kv->blocks[b];
    if (x->prev >= 0)
        kv->blocks[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next >= 0)
        kv->blocks[x->next].prev = x->prev;
    else
        l->tail = x->prev;
    x->prev = x->next = -1;
    x->list = LIST_NONE;
    l->n--;
}

/* ---- hashing and the hash table ---- */

static uint64_t mix64(uint64_t x)
{
    /* splitmix64's finaliser: a bijection with full avalanche, so every id bit reaches every
     * hash bit. */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t sh_kv_hash_seed(void) { return 0x5eedb10cc4a11ull; }

uint64_t sh_kv_hash_block(uint64_t parent, const int32_t *ids, int32_t n)
{
    uint64_t h = mix64(parent ^ (uint64_t)(uint32_t)n);
    for (int32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint64_t)(uint32_t)ids[i]);
    return h;
}

static uint64_t kv_hash(const sh_kv_mgr *kv, uint64_t parent, const int32_t *ids)
{
    return sh_kv_hash_block(parent, ids, kv->bt) & kv->hash_mask;
}

static const int32_t *block_ids(const sh_kv_mgr *kv, int32_t b)
{
    return kv->ids + (size_t)b * (size_t)kv->bt;
}

/* The cached block continuing the chain at parent_id with these ids, or -1. The hash only
 * narrows the search; the ids and the parent's cache id decide, so a collision never hits. */
static int32_t hash_find(const sh_kv_mgr *kv, uint64_t h, uint64_t parent_id, const int32_t *ids)
{
    for (int32_t b = kv->bucket[h & kv->bucket_mask]; b >= 0; b = kv->blocks[b].hnext) {
        const block *x = &kv->blocks[b];
        if (x->hash == h && x->parent_id == parent_id &&
            memcmp(block_ids(kv, b), ids, (size_t)kv->bt * sizeof *ids) == 0)
            return b;
    }
    return -1;
}

static void hash_insert(sh_kv_mgr *kv, int32_t b)
{
    int32_t *head = &kv->bucket[kv->blocks[b].hash & kv->bucket_mask];
    kv->blocks[b].hnext = *head;
    *head = b;
    kv->blocks[b].hashed = 1;
    kv->n_hashed++;
}

static void hash_remove(sh_kv_mgr *kv, int32_t b)
{
    int32_t *p = &kv->bucket[kv->blocks[b].hash & kv->bucket_mask];
    while (*p != b)
        p = &kv->blocks[*p].hnext;
    *p = kv->blocks[b].hnext;
    kv->blocks[b].hnext = -1;
    kv->blocks[b].hashed = 0;
    kv->blocks[b].chained = 0;
    kv->n_hashed--;
}

/* ---- block references ---- */

/* A block for new content with ref 1. The caller has checked sh_kv_available() > 0. Free blocks
 * go first; only then is the least recently released cached block evicted, because its KV might
 * still save a prefill. */
static int32_t block_alloc(sh_kv_mgr *kv)
{
    int32_t b;
    if (kv->free_list.head >= 0) {
        b = kv->free_list.head;
        list_remove(kv, &kv->free_list, b);
    } else {
        b = kv->lru.head;
        if (b < 0)
            sh_panic("kvmgr: allocation with no free or evictable block");
        list_remove(kv, &kv->lru, b);
        hash_remove(kv, b);
        kv->st.evictions++;
    }
    block *x = &kv->blocks[b];
    x->ref = 1;
    x->chained = 0;
    kv->n_used++;
    return b;
}

static void block_ref(sh_kv_mgr *kv, int32_t b)
{
    block *x = &kv->blocks[b];
    if (x->ref == 0) {
        /* Only cached blocks are ever adopted at ref 0 (prefix hits). */
        list_remove(kv, &kv->lru, b);
        kv->n_used++;
    }
    x->ref++;
}

static void block_unref(sh_kv_mgr *kv, int32_t b)
{
    block *x = &kv->blocks[b];
    if (x->ref <= 0)
        sh_panic("kvmgr: block %d released with ref %d", b, x->ref);
    if (--x->ref > 0)
        return;
    kv->n_used--;
    if (x->hashed)
        list_push_tail(kv, &kv->lru, LIST_LRU, b);
    else
        list_push_tail(kv, &kv->free_list, LIST_FREE, b);
}

/* ---- creation ---- */

static sh_err check_range(sh_error *e, const char *name, int64_t v, int64_t lo, int64_t hi)
{
    if (v < lo || v > hi)
        return sh__error_set(e, SH_EINVAL, "kvmgr: %s = %lld outside [%lld, %lld]", name,
                             (long long)v, (long long)lo, (long long)hi);
    return SH_OK;
}

sh_err sh_kv_create(const sh_kv_config *cfg, sh_kv_mgr **out, sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "kvmgr: out is NULL");
    *out = NULL;
    if (!cfg)
        return sh__error_set(e, SH_EINVAL, "kvmgr: config is NULL");
    sh_kv_config c = *cfg;
    if (c.block_tokens == 0)
        c.block_tokens = SH_KV_DEFAULT_BLOCK_TOKENS;
    if (c.max_blocks_per_seq == 0)
        c.max_blocks_per_seq = c.n_blocks;
    sh_err rc;
    if ((rc = check_range(e, "n_blocks", c.n_blocks, 1, 1 << 26)) ||
        (rc = check_range(e, "block_tokens", c.block_tokens, 1, 1024)) ||
        (rc = check_range(e, "max_seqs", c.max_seqs, 1, 1 << 20)) ||
        (rc = check_range(e, "max_blocks_per_seq", c.max_blocks_per_seq, 1, 1 << 24)) ||
        (rc = check_range(e, "max_seqs * max_blocks_per_seq",
                          (int64_t)c.max_seqs * c.max_blocks_per_seq, 1, (int64_t)1 << 28)) ||
        (rc = check_range(e, "n_blocks * block_tokens", (int64_t)c.n_blocks * c.block_tokens, 1,
                          (int64_t)1 << 30)) ||
        (rc = check_range(e, "window", c.window, 0, INT32_MAX)) ||
        (rc = check_range(e, "hash_bits", c.hash_bits, 0, 63)))
        return rc;

    sh_kv_mgr *kv = calloc(1, sizeof *kv);
    if (!kv)
        return sh__error_set(e, SH_ENOMEM, "kvmgr: out of memory");
    kv->cfg = c;
    kv->bt = c.block_tokens;
    kv->hash_mask = c.hash_bits ? (1ull << c.hash_bits) - 1 : ~0ull;
    size_t n_buckets = 1;
    while (n_buckets < (size_t)c.n_blocks)
        n_buckets <<= 1;
    kv->bucket_mask = n_buckets - 1;
    kv->blocks = calloc((size_t)c.n_blocks, sizeof *kv->blocks);
    kv->ids = calloc((size_t)c.n_blocks * (size_t)c.block_tokens, sizeof *kv->ids);
    kv->bucket = malloc(n_buckets * sizeof *kv->bucket);
    kv->seqs = calloc((size_t)c.max_seqs, sizeof *kv->seqs);
    kv->tables = malloc((size_t)c.max_seqs * (size_t)c.max_blocks_per_seq * sizeof *kv->tables);
    kv->seq_free = malloc((size_t)c.max_seqs * sizeof *kv->seq_free);
    if (!kv->blocks || !kv->ids || !kv->bucket || !kv->seqs || !kv->tables || !kv->seq_free) {
        sh_kv_destroy(kv);
        return sh__error_set(e, SH_ENOMEM, "kvmgr: out of memory for %d blocks", c.n_blocks);
    }
    for (size_t i = 0; i < n_buckets; i++)
        kv->bucket[i] = -1;
    kv->free_list = (list){-1, -1, 0};
    kv->lru = (list){-1, -1, 0};
    for (int32_t b = 0; b < c.n_blocks; b++) {
        kv->blocks[b].hnext = -1;
        list_push_tail(kv, &kv->free_list, LIST_FREE, b);
    }
    /* Pushed in reverse so that ids come out 0, 1, 2, ...: readable traces and tests. */
    for (int32_t s = 0; s < c.max_seqs; s++) {
        kv->seqs[s].table = kv->tables + (size_t)s * (size_t)c.max_blocks_per_seq;
        kv->seq_free[s] = c.max_seqs - 1 - s;
    }
    kv->n_seq_free = c.max_seqs;
    kv->next_id = 1;
    *out = kv;
    return SH_OK;
}

void sh_kv_destroy(sh_kv_mgr *kv)
{
    if (!kv)
        return;
    free(kv->blocks);
    free(kv->ids);
    free(kv->bucket);
    free(kv->seqs);
    free(kv->tables);
    free(kv->seq_free);
    free(kv);
}

/* ---- sequences ---- */

static seq *live_seq(const sh_kv_mgr *kv, int32_t s)
{
    if (s < 0 || s >= kv->cfg.max_seqs || !kv->seqs[s].live)
        return NULL;
    return &kv->seqs[s];
}

static int32_t n_table(const sh_kv_mgr *kv, int32_t n_tokens)
{
    return (int32_t)(((int64_t)n_tokens + kv->bt - 1) / kv->bt);
}

/* Walks the cache along the prompt's chain; writes the matched blocks to out (when not NULL)
 * and returns how many matched. Never matches the block holding the prompt's last token. */
static int32_t prefix_walk(const sh_kv_mgr *kv, const int32_t *prompt, int32_t n_prompt,
                           int32_t *out)
{
    if (!prompt || n_prompt <= 1)
        return 0;
    int32_t max = (n_prompt - 1) / kv->bt;
    if (max > kv->cfg.max_blocks_per_seq)
        max = kv->cfg.max_blocks_per_seq;
    uint64_t h = sh_kv_hash_seed() & kv->hash_mask, pid = 0;
    int32_t i = 0;
    for (; i < max; i++) {
        const int32_t *ids = prompt + (size_t)i * (size_t)kv->bt;
        h = kv_hash(kv, h, ids);
        int32_t b = hash_find(kv, h, pid, ids);
        if (b < 0)
            break;
        if (out)
            out[i] = b;
        pid = kv->blocks[b].id;
    }
    return i;
}

int32_t sh_kv_prefix_lookup(const sh_kv_mgr *kv, const int32_t *prompt, int32_t n_prompt)
{
    return prefix_walk(kv, prompt, n_prompt, NULL) * kv->bt;
}

static sh_err take_seq_id(sh_kv_mgr *kv, int32_t *id)
{
    if (kv->n_seq_free == 0)
        return SH_EBUSY;
    *id = kv->seq_free[--kv->n_seq_free];
    seq *s = &kv->seqs[*id];
    s->live = 1;
    s->cacheable = 1;
    s->n_tokens = s->n_computed = s->n_released = 0;
    return SH_OK;
}

sh_err sh_kv_seq_create(sh_kv_mgr *kv, const int32_t *prompt, int32_t n_prompt, int32_t *seq_out,
                        int32_t *n_cached)
{
    if (!kv || !seq_out || n_prompt < 0 || (n_prompt > 0 && !prompt))
        return SH_EINVAL;
    int32_t id;
    if (take_seq_id(kv, &id))
        return SH_EBUSY;
    seq *s = &kv->seqs[id];
    int32_t m = prefix_walk(kv, prompt, n_prompt, s->table);
    for (int32_t i = 0; i < m; i++)
        block_ref(kv, s->table[i]);
    s->n_tokens = s->n_computed = m * kv->bt;
    if (n_prompt > 0) {
        kv->st.prefix_queries++;
        kv->st.prefix_query_tokens += (uint64_t)n_prompt;
        kv->st.prefix_hit_tokens += (uint64_t)s->n_tokens;
    }
    *seq_out = id;
    if (n_cached)
        *n_cached = s->n_tokens;
    return SH_OK;
}

sh_err sh_kv_seq_free(sh_kv_mgr *kv, int32_t id)
{
    seq *s = kv ? live_seq(kv, id) : NULL;
    if (!s)
        return SH_EINVAL;
    for (int32_t i = n_table(kv, s->n_tokens) - 1; i >= 0; i--)
        if (s->table[i] != SH_KV_NO_BLOCK)
            block_unref(kv, s->table[i]);
    s->live = 0;
    kv->seq_free[kv->n_seq_free++] = id;
    return SH_OK;
}

/* Table entries a sequence with n_computed computed positions may have released: the blocks
 * entirely before n_computed - window, which no later query (at position >= n_computed) sees. */
static int32_t released_upto(const sh_kv_mgr *kv, int32_t n_computed)
{
    if (kv->cfg.window <= 0 || n_computed <= kv->cfg.window)
        return 0;
    return (n_computed - kv->cfg.window) / kv->bt;
}

sh_err sh_kv_seq_fork(sh_kv_mgr *kv, int32_t parent, int32_t n_tokens, int32_t *child)
{
    const seq *p = kv ? live_seq(kv, parent) : NULL;
    if (!p || !child || n_tokens > p->n_tokens)
        return SH_EINVAL;
    if (n_tokens < 0)
        n_tokens = p->n_tokens;
    /* The child computes from min(parent's computed, n_tokens) on, so it needs every block its
     * own window reaches back to from there; the parent may have released some already. */
    int32_t nb = n_table(kv, n_tokens);
    int32_t nc = p->n_computed < n_tokens ? p->n_computed : n_tokens;
    int32_t rel = p->n_released < nb ? p->n_released : nb;
    if (rel > released_upto(kv, nc))
        return SH_EINVAL;
    int32_t id;
    if (take_seq_id(kv, &id))
        return SH_EBUSY;
    seq *c = &kv->seqs[id];
    p = &kv->seqs[parent];
    for (int32_t i = 0; i < nb; i++) {
        c->table[i] = p->table[i];
        if (c->table[i] != SH_KV_NO_BLOCK)
            block_ref(kv, c->table[i]);
    }
    c->n_tokens = n_tokens;
    c->n_computed = nc;
    c->n_released = rel;
    c->cacheable = p->cacheable;
    *child = id;
    return SH_OK;
}

/* ---- appending ---- */

/* Whether writing into block b (not at offset 0) needs a private copy first: another table
 * holds it. A block only this sequence holds is written in place (leaving the cache if it was
 * there, which can happen after a fork cut a cached block in the middle). */
static bool needs_copy(const sh_kv_mgr *kv, int32_t b) { return kv->blocks[b].ref > 1; }

sh_err sh_kv_blocks_needed(const sh_kv_mgr *kv, int32_t id, int32_t n, int32_t *needed)
{
    const seq *s = kv ? live_seq(kv, id) : NULL;
    if (!s || n < 0 || !needed)
        return SH_EINVAL;
    int32_t have = n_table(kv, s->n_tokens);
    int64_t want = ((int64_t)s->n_tokens + n + kv->bt - 1) / kv->bt;
    if (want > kv->cfg.max_blocks_per_seq)
        return SH_ERANGE;
    int32_t k = (int32_t)want - have;
    if (n > 0 && s->n_tokens % kv->bt != 0 && needs_copy(kv, s->table[have - 1]))
        k++;
    *needed = k;
    return SH_OK;
}

int32_t sh_kv_available(const sh_kv_mgr *kv) { return kv->free_list.n + kv->lru.n; }

bool sh_kv_can_append(const sh_kv_mgr *kv, int32_t id, int32_t n)
{
    int32_t k;
    return sh_kv_blocks_needed(kv, id, n, &k) == SH_OK && k <= sh_kv_available(kv);
}

sh_err sh_kv_append(sh_kv_mgr *kv, int32_t id, const int32_t *tokens, int32_t n, sh_kv_copy *cow)
{
    if (cow)
        *cow = (sh_kv_copy){-1, -1, 0};
    if (!kv || !cow)
        return SH_EINVAL;
    int32_t k;
    sh_err rc = sh_kv_blocks_needed(kv, id, n, &k);
    if (rc)
        return rc;
    if (k > sh_kv_available(kv))
        return SH_EBUSY;
    seq *s = &kv->seqs[id];
    if (n == 0)
        return SH_OK;
    if (!tokens)
        s->cacheable = 0;
    int32_t bt = kv->bt, pos = s->n_tokens;
    if (pos % bt != 0) {
        int32_t i = pos / bt, old = s->table[i];
        if (needs_copy(kv, old)) {
            int32_t nb = block_alloc(kv);
            memcpy(kv->ids + (size_t)nb * (size_t)bt, block_ids(kv, old),
                   (size_t)(pos % bt) * sizeof *kv->ids);
            block_unref(kv, old);
            s->table[i] = nb;
            *cow = (sh_kv_copy){old, nb, pos % bt};
            kv->st.cow_copies++;
        } else if (kv->blocks[old].hashed) {
            hash_remove(kv, old);
        }
        kv->blocks[s->table[i]].chained = 0;
    }
    for (int32_t j = 0; j < n; j++, pos++) {
        if (pos % bt == 0)
            s->table[pos / bt] = block_alloc(kv);
        kv->ids[(size_t)s->table[pos / bt] * (size_t)bt + (size_t)(pos % bt)] =
            tokens ? tokens[j] : 0;
    }
    s->n_tokens = pos;
    return SH_OK;
}

sh_err sh_kv_truncate(sh_kv_mgr *kv, int32_t id, int32_t n_tokens)
{
    seq *s = kv ? live_seq(kv, id) : NULL;
    if (!s || n_tokens < s->n_computed)
        return SH_EINVAL;
    if (n_tokens >= s->n_tokens)
        return SH_OK;
    // A block past the new length holds no computed position, so it was never hashed (only
    // full, computed blocks are) and never shared (forks share computed prompt blocks).
    for (int32_t i = n_table(kv, s->n_tokens) - 1; i >= n_table(kv, n_tokens); i--)
        if (s->table[i] != SH_KV_NO_BLOCK)
            block_unref(kv, s->table[i]);
    s->n_tokens = n_tokens;
    return SH_OK;
}

/* ---- computing, caching and the window ---- */

/* Block i of s just became full and computed: give it its chain hash and register it, unless
 * its predecessor is not chained (unknown ids, released by the window) or an equal block is
 * already cached, in which case it chains through that one so later blocks still connect. */
static void chain_block(sh_kv_mgr *kv, const seq *s, int32_t i)
{
    int32_t b = s->table[i];
    block *x = &kv->blocks[b];
    if (x->chained || !s->cacheable)
        return;
    uint64_t ph = sh_kv_hash_seed() & kv->hash_mask, pid = 0;
    if (i > 0) {
        int32_t p = s->table[i - 1];
        if (p == SH_KV_NO_BLOCK || !kv->blocks[p].chained)
            return;
        ph = kv->blocks[p].hash;
        pid = kv->blocks[p].id;
    }
    const int32_t *ids = block_ids(kv, b);
    uint64_t h = kv_hash(kv, ph, ids);
    int32_t eq = hash_find(kv, h, pid, ids);
    x->chained = 1;
    x->hash = h;
    x->parent_id = pid;
    if (eq >= 0) {
        x->id = kv->blocks[eq].id;
    } else {
        x->id = kv->next_id++;
        hash_insert(kv, b);
    }
}

sh_err sh_kv_mark_computed(sh_kv_mgr *kv, int32_t id, int32_t n_computed)
{
    seq *s = kv ? live_seq(kv, id) : NULL;
    if (!s || n_computed < s->n_computed || n_computed > s->n_tokens)
        return SH_EINVAL;
    for (int32_t i = s->n_computed / kv->bt; i < n_computed / kv->bt; i++)
        chain_block(kv, s, i);
    s->n_computed = n_computed;
    int32_t end = released_upto(kv, n_computed);
    if (end > s->n_released) {
        for (int32_t i = s->n_released; i < end; i++) {
            if (s->table[i] != SH_KV_NO_BLOCK) {
                block_unref(kv, s->table[i]);
                s->table[i] = SH_KV_NO_BLOCK;
                kv->st.window_released++;
            }
        }
        s->n_released = end;
    }
    return SH_OK;
}

sh_err sh_kv_seq_table(const sh_kv_mgr *kv, int32_t id, const int32_t **blocks, int32_t *n_blocks,
                       int32_t *n_tokens, int32_t *n_computed)
{
    const seq *s = kv ? live_seq(kv, id) : NULL;
    if (!s)
        return SH_EINVAL;
    if (blocks)
        *blocks = s->table;
    if (n_blocks)
        *n_blocks = n_table(kv, s->n_tokens);
    if (n_tokens)
        *n_tokens = s->n_tokens;
    if (n_computed)
        *n_computed = s->n_computed;
    return SH_OK;
}

/* ---- figures and invariants ---- */

void sh_kv_stats_get(const sh_kv_mgr *kv, sh_kv_stats *st)
{
    *st = kv->st;
    st->blocks_total = kv->cfg.n_blocks;
    st->blocks_used = kv->n_used;
    st->blocks_cached_free = kv->lru.n;
    st->blocks_free = kv->free_list.n;
    st->blocks_cached = kv->n_hashed;
    st->seqs_live = kv->cfg.max_seqs - kv->n_seq_free;
    st->utilisation = (double)kv->n_used / (double)kv->cfg.n_blocks;
    st->prefix_hit_ratio = st->prefix_query_tokens
                               ? (double)st->prefix_hit_tokens / (double)st->prefix_query_tokens
                               : 0.0;
}

#define BAD(...) return sh__error_set(e, SH_EFORMAT, "kvmgr check: " __VA_ARGS__)

static sh_err check_list(const sh_kv_mgr *kv, const list *l, int which, sh_error *e)
{
    int32_t n = 0, prev = -1;
    for (int32_t b = l->head; b >= 0; prev = b, b = kv->blocks[b].next) {
        const block *x = &kv->blocks[b];
        if (++n > kv->cfg.n_blocks)
            BAD("list %d has a cycle", which);
        if (x->list != which || x->prev != prev || x->ref != 0)
            BAD("block %d on list %d: list %d prev %d/%d ref %d", b, which, x->list, x->prev, prev,
                x->ref);
        if ((which == LIST_LRU) != (x->hashed != 0))
            BAD("block %d on list %d with hashed=%d", b, which, x->hashed);
    }
    if (n != l->n || prev != l->tail)
        BAD("list %d counts %d, holds %d; tail %d/%d", which, l->n, n, l->tail, prev);
    return SH_OK;
}

sh_err sh_kv_check(const sh_kv_mgr *kv, sh_error *e)
{
    int32_t nbk = kv->cfg.n_blocks;
    int32_t *count = calloc((size_t)nbk, sizeof *count);
    if (!count)
        return sh__error_set(e, SH_ENOMEM, "kvmgr check: out of memory");
    sh_err rc = SH_OK;
    int32_t live = 0;
    for (int32_t id = 0; id < kv->cfg.max_seqs && !rc; id++) {
        const seq *s = &kv->seqs[id];
        if (!s->live)
            continue;
        live++;
        int32_t nb = n_table(kv, s->n_tokens);
        if (s->n_computed < 0 || s->n_computed > s->n_tokens || nb > kv->cfg.max_blocks_per_seq)
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: seq %d tokens %d computed %d", id,
                               s->n_tokens, s->n_computed);
        for (int32_t i = 0; i < nb && !rc; i++) {
            int32_t b = s->table[i];
            if (b == SH_KV_NO_BLOCK && i < s->n_released &&
                s->n_released <= released_upto(kv, s->n_computed))
                continue;
            if (b < 0 || b >= nbk)
                rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: seq %d entry %d = %d", id, i, b);
            else
                count[b]++;
        }
    }
    int32_t used = 0, hashed = 0;
    for (int32_t b = 0; b < nbk && !rc; b++) {
        const block *x = &kv->blocks[b];
        if (x->ref != count[b])
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: block %d ref %d, tables hold %d", b,
                               x->ref, count[b]);
        else if (x->ref > 0 && x->list != LIST_NONE)
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: used block %d on list %d", b, x->list);
        else if (x->ref == 0 && x->list == LIST_NONE)
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: block %d unreferenced, unlisted", b);
        else if (x->hashed && (!x->chained || x->id == 0 || x->parent_id >= x->id))
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: block %d cached without a chain", b);
        else if (x->hashed && hash_find(kv, x->hash, x->parent_id, block_ids(kv, b)) < 0)
            rc = sh__error_set(e, SH_EFORMAT, "kvmgr check: block %d not found by its hash", b);
        used += x->ref > 0;
        hashed += x->hashed;
    }
    free(count);
    if (rc)
        return rc;
    if ((rc = check_list(kv, &kv->free_list, LIST_FREE, e)) ||
        (rc = check_list(kv, &kv->lru, LIST_LRU, e)))
        return rc;
    int32_t in_buckets = 0;
    for (uint64_t i = 0; i <= kv->bucket_mask; i++)
        for (int32_t b = kv->bucket[i]; b >= 0; b = kv->blocks[b].hnext)
            if (++in_buckets > nbk || !kv->blocks[b].hashed)
                BAD("bucket %llu holds block %d (hashed %d)", (unsigned long long)i, b,
                    kv->blocks[b].hashed);
    if (used != kv->n_used || hashed != kv->n_hashed || in_buckets != hashed)
        BAD("used %d/%d hashed %d/%d in buckets %d", used, kv->n_used, hashed, kv->n_hashed,
            in_buckets);
    if (used + kv->free_list.n + kv->lru.n != nbk)
        BAD("used %d + free %d + cached-free %d != %d", used, kv->free_list.n, kv->lru.n, nbk);
    if (live != kv->cfg.max_seqs - kv->n_seq_free)
        BAD("live sequences %d, free ids %d of %d", live, kv->n_seq_free, kv->cfg.max_seqs);
    return SH_OK;
}
