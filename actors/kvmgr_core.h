/* The KV manager's logic: a paged block allocator with refcounts, copy-on-write and a prefix cache.
 */
#ifndef SH_ACTORS_KVMGR_CORE_H
#define SH_ACTORS_KVMGR_CORE_H

#include <stdbool.h>
#include <stdint.h>

#include "shoal/err.h"

/* Overview.
 *
 * The stages hold a KV pool of n_blocks blocks of block_tokens positions each (kernels/backend.h);
 * this module decides which sequence owns which block. A sequence is a small integer id with a
 * block table: position p of the sequence lives in block table[p / block_tokens] at offset
 * p % block_tokens, exactly what model/llama.h and sh_attn_seq expect.
 *
 * A block is in one of three states:
 *   used        ref > 0: held by one or more block tables (shared after a fork or a prefix hit);
 *   cached-free ref == 0 but registered in the prefix cache: its KV is still valid and can be
 *               adopted by a later prompt, or evicted (least recently released first) when no
 *               free block is left;
 *   free        ref == 0, not cached: allocated first.
 * Invariants (checked by sh_kv_check): a block's ref equals the number of table entries holding
 * it; used + cached_free + free == n_blocks; only full blocks whose KV has been written are cached.
 *
 * Prefix cache. Each full, computed block of a sequence gets a chain hash
 * h_i = H(h_{i-1}, its block_tokens token ids), h_{-1} a fixed seed, so equal hashes mean (up to
 * collisions) equal whole prefixes. A hit is confirmed, not trusted: every cached block stores its
 * token ids and the cache id of its parent block (ids are never reused), and a lookup accepts a
 * block only when its ids equal the prompt's and its parent is exactly the block matched one step
 * earlier. By induction a hit is therefore exact whatever the hash does.
 *
 * Copy-on-write. After a fork the last, partial block is shared. Before a sequence writes into a
 * block another table still holds (or one registered in the cache), sh_kv_append gives it a fresh
 * block and returns a copy instruction {src, dst, n_tokens}: the stage must copy positions
 * [0, n_tokens) of block src to block dst in every layer's K and V pool before it runs the step
 * that writes the new tokens. The batcher collects the instructions of all appends of a step and
 * ships them with the STEP.
 *
 * Sequence ids are small integers (0 .. max_seqs - 1) from a free list; the kvmgr actor maps the
 * request ids of KV_ALLOC / KV_FREE / KV_FORK (u64) onto them.
 *
 * Memory. Every table is sized at sh_kv_create; no call but create (and the debug sh_kv_check)
 * allocates, so the steady state does no heap allocation per token or per step.
 *
 * Thread: none of these functions is thread-safe. A manager is owned by one thread (the kvmgr
 * actor's loop, or the batcher when it runs the manager inline); all calls come from it. */

/* Default tokens per block; equals SH_KV_BLOCK_TOKENS so that the kernels' layout matches. */
#define SH_KV_DEFAULT_BLOCK_TOKENS 16

/* A table entry released by the sliding window. The attention kernels never read it because
 * every position it covered is outside the window of any query the sequence will still make. */
#define SH_KV_NO_BLOCK (-1)

typedef struct sh_kv_mgr sh_kv_mgr;

typedef struct sh_kv_config {
    int32_t n_blocks;           /* blocks in the pool (>= 1) */
    int32_t block_tokens;       /* positions per block; 0 means SH_KV_DEFAULT_BLOCK_TOKENS (the
                                 * kernels need SH_KV_BLOCK_TOKENS; other sizes are for tests) */
    int32_t max_seqs;           /* live sequences at once (>= 1) */
    int32_t max_blocks_per_seq; /* table length per sequence; 0 means n_blocks */
    int32_t window;    /* sliding window: a query at position p sees keys > p - window; 0: none */
    int32_t hash_bits; /* tests only: keep the low hash_bits bits of every hash (1..63) to force
                        * collisions; 0 means all 64 */
} sh_kv_config;

/* A copy the stage must do before the step that follows the append which returned it. */
typedef struct sh_kv_copy {
    int32_t src;      /* block to read, or -1 when no copy is needed */
    int32_t dst;      /* block to write */
    int32_t n_tokens; /* positions [0, n_tokens) of the block are copied */
} sh_kv_copy;

/* Figures for /metrics and the batcher. Counters only grow; gauges are the current state. */
typedef struct sh_kv_stats {
    int32_t blocks_total;
    int32_t blocks_used;        /* ref > 0 */
    int32_t blocks_cached_free; /* ref == 0, still in the prefix cache (evictable) */
    int32_t blocks_free;        /* ref == 0, not cached */
    int32_t blocks_cached;      /* in the prefix cache, used or not */
    int32_t seqs_live;
    double utilisation;           /* blocks_used / blocks_total */
    uint64_t prefix_queries;      /* sh_kv_seq_create calls with a prompt */
    uint64_t prefix_query_tokens; /* prompt tokens looked up */
    uint64_t prefix_hit_tokens;   /* of which found computed in the cache */
    double prefix_hit_ratio;      /* hit tokens / query tokens (0 before the first query) */
    uint64_t evictions;           /* cached-free blocks reused for new content */
    uint64_t cow_copies;          /* copy instructions handed out */
    uint64_t window_released;     /* table entries dropped by the sliding window */
} sh_kv_stats;

/* Creates a manager for cfg (copied). On success *out owns every table; free it with
 * sh_kv_destroy. Returns SH_EINVAL (a field out of range; e says which), SH_ENOMEM, leaving *out
 * NULL. */
sh_err sh_kv_create(const sh_kv_config *cfg, sh_kv_mgr **out, sh_error *e);

/* Frees the manager and every table. Accepts NULL. Outstanding block tables become invalid. */
void sh_kv_destroy(sh_kv_mgr *kv);

/* Starts a sequence. When prompt is not NULL (n_prompt > 0), looks up the longest chain of cached
 * blocks matching the prompt and adopts them (ref++); *n_cached (may be NULL) receives the number
 * of prompt positions whose KV is already there, which prefill can skip. The hit is capped at
 * (n_prompt - 1) rounded down to a block boundary: the last prompt token must always be computed
 * because its logits give the first sampled token. The sequence then holds n_cached tokens, all
 * computed; the caller appends the rest of the prompt (prompt + n_cached) with sh_kv_append.
 * The prompt is borrowed for the call. Never allocates new blocks, so it cannot run out of them.
 * Returns SH_OK (*seq set), SH_EINVAL (n_prompt < 0), SH_EBUSY (max_seqs sequences live); on
 * failure nothing changes. */
sh_err sh_kv_seq_create(sh_kv_mgr *kv, const int32_t *prompt, int32_t n_prompt, int32_t *seq,
                        int32_t *n_cached);

/* Ends a sequence: releases every block of its table (ref--; a block reaching 0 becomes
 * cached-free if it is in the prefix cache, else free) and recycles the id. The table is released
 * from its last block to its first, so a chain's tail becomes evictable before its head and a
 * shared prefix survives longest. Returns SH_OK or SH_EINVAL (seq not live; nothing changes). */
sh_err sh_kv_seq_free(sh_kv_mgr *kv, int32_t seq);

/* Starts a child sequence sharing the parent's first n_tokens positions (n_tokens < 0: all of
 * them), e.g. for n > 1 samples of one prompt: the child's table points at the same blocks
 * (ref++), including a partial last block, which either side copies on its next write
 * (sh_kv_append). The child's computed count is min(parent's, n_tokens); fork after the prompt is
 * computed so that the child never recomputes shared positions. Returns SH_OK (*child set),
 * SH_EINVAL (parent not live, n_tokens beyond it, or the window already released a block the
 * child would still attend to), SH_EBUSY (max_seqs live); on failure nothing changes. */
sh_err sh_kv_seq_fork(sh_kv_mgr *kv, int32_t parent, int32_t n_tokens, int32_t *child);

/* Blocks that appending n tokens to seq would take from the pool right now: new table entries
 * plus one when the write into the last block needs a copy. Returns SH_OK (*needed set) or
 * SH_EINVAL (seq not live, n < 0), SH_ERANGE (the table would exceed max_blocks_per_seq). */
sh_err sh_kv_blocks_needed(const sh_kv_mgr *kv, int32_t seq, int32_t n, int32_t *needed);

/* True when sh_kv_append(kv, seq, ..., n, ...) would succeed now. Lets the batcher plan a whole
 * step (and preempt) before it changes anything. */
bool sh_kv_can_append(const sh_kv_mgr *kv, int32_t seq, int32_t n);

/* Blocks an allocation can draw on: free plus cached-free (evictable). */
int32_t sh_kv_available(const sh_kv_mgr *kv);

/* Reserves positions [len, len + n) of seq for tokens (ids borrowed; NULL when unknown, which
 * stops prefix caching for this sequence from here on), allocating blocks as needed (free blocks
 * first, then evicting the least recently released cached-free block). *cow receives the copy the
 * stage must do first, or cow->src == -1; at most one copy per call, because only the current
 * partial block can be shared. The new positions count as not computed until sh_kv_mark_computed.
 * Returns SH_OK; SH_EBUSY (not enough free or evictable blocks: the batcher preempts),
 * SH_ERANGE (max_blocks_per_seq), SH_EINVAL (seq not live, n < 0); on failure nothing changes
 * and cow->src is -1. */
sh_err sh_kv_append(sh_kv_mgr *kv, int32_t seq, const int32_t *tokens, int32_t n, sh_kv_copy *cow);

/* Gives back positions [n_tokens, len) of seq, reserved but never computed (a speculative step's
 * rejected drafts): whole blocks past the new length return to the pool, and the next
 * sh_kv_append writes its ids over what is left of the last block, so no block is ever hashed by
 * a position's former ids. n_tokens >= the current length does nothing. Returns SH_OK or
 * SH_EINVAL (seq not live, n_tokens below its computed count; nothing changes). */
sh_err sh_kv_truncate(sh_kv_mgr *kv, int32_t seq, int32_t n_tokens);

/* Tells the manager that positions [0, n_computed) of seq now hold KV (a step completed). Blocks
 * that became full and computed enter the prefix cache (a block equal to one already cached
 * keeps the cached one as its chain parent instead of being registered twice). With a window,
 * blocks entirely before n_computed - window are then released (ref--) and their entries set to
 * SH_KV_NO_BLOCK: every later query sits at position >= n_computed and sees only the window.
 * n_computed is absolute and may repeat (idempotent). Returns SH_OK or SH_EINVAL (seq not live,
 * n_computed below the current count or beyond the appended length; nothing changes). */
sh_err sh_kv_mark_computed(sh_kv_mgr *kv, int32_t seq, int32_t n_computed);

/* Borrows seq's block table: *blocks (may be NULL when *n_blocks is 0) has ceil(len /
 * block_tokens) entries, valid until the next call that changes this sequence. Positions and
 * computed count go to *n_tokens / *n_computed (each may be NULL). Returns SH_OK or SH_EINVAL. */
sh_err sh_kv_seq_table(const sh_kv_mgr *kv, int32_t seq, const int32_t **blocks, int32_t *n_blocks,
                       int32_t *n_tokens, int32_t *n_computed);

/* Prompt positions a sh_kv_seq_create would find cached now (same cap), without adopting
 * anything or counting in the statistics: for routing by prefix affinity and admission planning. */
int32_t sh_kv_prefix_lookup(const sh_kv_mgr *kv, const int32_t *prompt, int32_t n_prompt);

/* The chain hash of one block: H(parent, ids[0..n)). parent is sh_kv_hash_seed() for the first
 * block. A splitmix64-style mix of every id, so that the router can compute the same chain. */
uint64_t sh_kv_hash_block(uint64_t parent, const int32_t *ids, int32_t n);
uint64_t sh_kv_hash_seed(void);

/* Fills *st (current gauges and counters). */
void sh_kv_stats_get(const sh_kv_mgr *kv, sh_kv_stats *st);

/* Checks every invariant in O(n_blocks + tables): refcounts against the tables, list membership
 * and lengths, hash table membership, counts, window releases. For tests and debug builds; it
 * allocates a scratch array, so keep it out of the steady state. Returns SH_OK, SH_EFORMAT with
 * the first violation in e, or SH_ENOMEM; changes nothing. */
sh_err sh_kv_check(const sh_kv_mgr *kv, sh_error *e);

#endif
