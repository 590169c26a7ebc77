/* The kvmgr actor: the replica's KV block table (actors/kvmgr_core.h) behind KV_ALLOC, KV_FORK
 * and KV_FREE messages, with the request's u64 sequence ids mapped onto the core's small ids. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "base/error.h"
#include "runtime/msg.h"
#include "runtime/proto.h"

/* The bodies of KV_ALLOC/KV_FREE/KV_FORK hold no lists, so the decode arena stays small. */
#define KVMGR_ARENA_BYTES (64u << 10)

/* One slot of the id map: a request's u64 id and the core's id. Linear probing with
 * backward-shift deletion, so no tombstones accumulate and a lookup stops at the first empty
 * slot. The core refuses more than max_seqs live sequences and the map has at least 2 * max_seqs
 * slots, so it is never more than half full. */
typedef struct id_slot {
    uint64_t key;
    int32_t id;
    bool used;
} id_slot;

/* Published values of the runtime's series, so that each update adds the difference: several
 * kvmgrs in one runtime then sum into the same series, and stop takes this one's share out. */
typedef struct kv_published {
    int64_t total, used, cached;
    uint64_t query_tokens, hit_tokens, evictions;
} kv_published;

typedef struct kvmgr_state {
    sh_kv_mgr *kv;
    bool prefix_cache;
    int32_t block_tokens;
    id_slot *map;     // (map_cap)
    uint32_t map_cap; /* a power of two >= 2 * max_seqs */
    int32_t *ids;     // (max_ids) a request's token ids, aligned (the frame's bin is not)
    int32_t max_ids;  /* positions one sequence can hold: max_blocks_per_seq * block_tokens */
    sh_act_decoder dec;
    sh_gauge *g_total, *g_used, *g_cached;
    sh_counter *c_query, *c_hit, *c_evict;
    kv_published pub;
    kv_published base; /* counters of the managers a RESET replaced (only the counters used) */
    sh_kv_config cfg;  /* what RESET recreates the manager with */
    uint64_t resets;
} kvmgr_state;

/* ---- the id map ---- */

/* The slot holding key, or the empty slot where it would go. */
static uint32_t map_find(const kvmgr_state *st, uint64_t key)
{
    uint32_t mask = st->map_cap - 1, i = sh__act_hash_u64(key) & mask;
    while (st->map[i].used && st->map[i].key != key)
        i = (i + 1) & mask;
    return i;
}

/* The core id of key, or -1. */
static int32_t map_get(const kvmgr_state *st, uint64_t key)
{
    uint32_t i = map_find(st, key);
    return st->map[i].used ? st->map[i].id : -1;
}

static void map_put(kvmgr_state *st, uint64_t key, int32_t id)
{
    uint32_t i = map_find(st, key);
    st->map[i] = (id_slot){.key = key, .id = id, .used = true};
}

/* Removes key (present or not). Backward shift: every entry after the hole whose home slot does
 * not lie cyclically in (hole, its slot] moves into the hole, which keeps each probe chain
 * unbroken without tombstones. */
static void map_del(kvmgr_state *st, uint64_t key)
{
    uint32_t mask = st->map_cap - 1, hole = map_find(st, key);
    if (!st->map[hole].used)
        return;
    for (uint32_t j = (hole + 1) & mask; st->map[j].used; j = (j + 1) & mask) {
        uint32_t home = sh__act_hash_u64(st->map[j].key) & mask;
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            st->map[hole] = st->map[j];
            hole = j;
        }
    }
    st->map[hole].used = false;
}

/* ---- metrics ---- */

static void publish(kvmgr_state *st)
{
    sh_kv_stats s;
    sh_kv_stats_get(st->kv, &s);
    kv_published now = {s.blocks_total,
                        s.blocks_used,
                        s.blocks_cached,
                        st->base.query_tokens + s.prefix_query_tokens,
                        st->base.hit_tokens + s.prefix_hit_tokens,
                        st->base.evictions + s.evictions};
    sh_gauge_add(st->g_total, now.total - st->pub.total);
    sh_gauge_add(st->g_used, now.used - st->pub.used);
    sh_gauge_add(st->g_cached, now.cached - st->pub.cached);
    sh_counter_add(st->c_query, now.query_tokens - st->pub.query_tokens);
    sh_counter_add(st->c_hit, now.hit_tokens - st->pub.hit_tokens);
    sh_counter_add(st->c_evict, now.evictions - st->pub.evictions);
    st->pub = now;
}

static sh_err register_metrics(sh_metrics *m, kvmgr_state *st, const char *lb)
{
    sh_err err;
    if ((err = sh_metrics_gauge(m, "shoal_kv_blocks_total", "KV blocks in the pool", lb,
                                &st->g_total)) ||
        (err = sh_metrics_gauge(m, "shoal_kv_blocks_used", "KV blocks held by sequences", lb,
                                &st->g_used)) ||
        (err = sh_metrics_gauge(m, "shoal_kv_blocks_cached",
                                "KV blocks in the prefix cache (used or evictable)", lb,
                                &st->g_cached)) ||
        (err =
             sh_metrics_counter(m, "shoal_prefix_cache_query_tokens_total",
                                "Prompt tokens looked up in the prefix cache", lb, &st->c_query)) ||
        (err = sh_metrics_counter(m, "shoal_prefix_cache_hit_tokens_total",
                                  "Prompt tokens found computed in the prefix cache", lb,
                                  &st->c_hit)) ||
        (err = sh_metrics_counter(m, "shoal_kv_evictions_total",
                                  "Cached KV blocks evicted for new content", lb, &st->c_evict)))
        return err;
    return SH_OK;
}

/* ---- requests ---- */

/* Applies a request's `computed`: positions [0, computed) of id hold KV. A value at or below
 * what the manager already knows is a no-op (a repeated or reordered report); beyond the
 * reserved positions it is SH_EINVAL. */
static sh_err apply_computed(kvmgr_state *st, int32_t id, uint32_t computed)
{
    int32_t n_tokens = 0, n_computed = 0;
    if (computed == 0)
        return SH_OK;
    if (sh_kv_seq_table(st->kv, id, NULL, NULL, &n_tokens, &n_computed))
        return SH_EINVAL;
    if ((int64_t)computed <= n_computed)
        return SH_OK;
    if ((int64_t)computed > n_tokens)
        return SH_EINVAL;
    return sh_kv_mark_computed(st->kv, id, (int32_t)computed);
}

/* Fills r->blocks with id's whole table: a view of the manager's own table, which stays valid
 * until the next call that changes the sequence (after the reply is encoded). */
static void reply_table(const kvmgr_state *st, int32_t id, sh_i32s *blocks)
{
    const int32_t *tab = NULL;
    int32_t n = 0;
    *blocks = (sh_i32s){NULL, 0};
    if (id >= 0 && sh_kv_seq_table(st->kv, id, &tab, &n, NULL, NULL) == SH_OK && n > 0)
        *blocks = (sh_i32s){tab, (uint32_t)n};
}

static void warn_cow(sh_actor_ctx *ctx, const sh_kv_copy *cow, uint64_t seq)
{
    /* Forks are refused off block boundaries and only full blocks are cached, so an append can
     * never write into a shared block; the reply has no field for a copy. */
    if (cow->src >= 0)
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "kvmgr_unexpected_copy",
                     "seq=%llu src=%d dst=%d n=%d", (unsigned long long)seq, (int)cow->src,
                     (int)cow->dst, (int)cow->n_tokens);
}

/* Copies a request's token ids into the aligned buffer (NULL when there are none). More ids than
 * one sequence can hold is SH_ERANGE. */
static sh_err copy_ids(kvmgr_state *st, sh_i32s v, const int32_t **ids)
{
    *ids = NULL;
    if (v.n == 0)
        return SH_OK;
    if (v.n > (uint32_t)st->max_ids)
        return SH_ERANGE;
    memcpy(st->ids, v.ptr, (size_t)v.n * sizeof *st->ids); /* packed LE = host order */
    *ids = st->ids;
    return SH_OK;
}

/* KV_ALLOC on a sequence the map does not know: create it, adopt a cached prefix, reserve. */
static sh_err alloc_new(sh_actor_ctx *ctx, kvmgr_state *st, const sh_proto_kv_alloc *q,
                        sh_proto_kv_alloc *r, int32_t *id)
{
    int32_t n_tok = (int32_t)q->tokens.n, cached = 0;
    const int32_t *ids;
    if (q->computed > 0)
        return SH_EINVAL; /* nothing of an unknown sequence can hold KV */
    sh_err err = copy_ids(st, q->tokens, &ids);
    if (err)
        return err;
    if (ids && st->prefix_cache)
        err = sh_kv_seq_create(st->kv, ids, n_tok, id, &cached);
    else
        err = sh_kv_seq_create(st->kv, NULL, 0, id, NULL);
    if (err)
        return err;
    int32_t n = (int32_t)q->n_tokens;
    if (ids && n > n_tok - cached)
        n = n_tok - cached;
    sh_kv_copy cow;
    err = sh_kv_append(st->kv, *id, ids && st->prefix_cache ? ids + cached : NULL, n, &cow);
    if (err) {
        sh_kv_seq_free(st->kv, *id);
        *id = -1;
        return err;
    }
    warn_cow(ctx, &cow, q->seq);
    map_put(st, q->seq, *id);
    r->cached = (uint32_t)cached;
    r->appended = (uint32_t)n;
    return SH_OK;
}

static void on_alloc(sh_actor_ctx *ctx, kvmgr_state *st, const sh_msg *m,
                     const sh_proto_kv_alloc *q)
{
    sh_proto_kv_alloc r = {.seq = q->seq, .n_tokens = q->n_tokens};
    int32_t id = map_get(st, q->seq);
    const int32_t *ids = NULL;
    sh_err err;
    if (id < 0) {
        err = alloc_new(ctx, st, q, &r, &id);
    } else if (q->tokens.n != 0 && q->tokens.n != q->n_tokens) {
        err = SH_EINVAL;
    } else if (!(err = apply_computed(st, id, q->computed)) &&
               !(err = q->keep ? sh_kv_truncate(st->kv, id, (int32_t)q->keep) : SH_OK) &&
               !(err = copy_ids(st, q->tokens, &ids))) {
        sh_kv_copy cow;
        err = sh_kv_append(st->kv, id, st->prefix_cache ? ids : NULL, (int32_t)q->n_tokens, &cow);
        if (!err) {
            warn_cow(ctx, &cow, q->seq);
            r.appended = q->n_tokens;
        }
    }
    r.status = (int32_t)err;
    reply_table(st, id, &r.blocks);
    r.available = (uint32_t)sh_kv_available(st->kv);
    publish(st); /* before the reply, so that its receiver sees the figures it caused */
    sh_error e = {0};
    if (sh_reply_with(ctx, m, SH_MSG_KV_ALLOC, sh__proto_encode, &r, &e))
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_reply_failed", "type=KV_ALLOC error=\"%s\"",
                     e.msg);
}

static void on_fork(sh_actor_ctx *ctx, kvmgr_state *st, const sh_msg *m, const sh_proto_kv_fork *q)
{
    sh_proto_kv_fork r = {.seq = q->seq, .child = q->child, .n_tokens = q->n_tokens};
    int32_t parent = map_get(st, q->seq), child = -1;
    sh_err err = SH_OK;
    if (parent < 0 || map_get(st, q->child) >= 0 || q->child == q->seq ||
        q->n_tokens % (uint32_t)st->block_tokens != 0)
        err = SH_EINVAL;
    else if (!(err = sh_kv_seq_fork(st->kv, parent, (int32_t)q->n_tokens, &child)))
        map_put(st, q->child, child);
    r.status = (int32_t)err;
    reply_table(st, child, &r.blocks);
    publish(st);
    sh_error e = {0};
    if (sh_reply_with(ctx, m, SH_MSG_KV_FORK, sh__proto_encode, &r, &e))
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_reply_failed", "type=KV_FORK error=\"%s\"",
                     e.msg);
}

static void on_free(sh_actor_ctx *ctx, kvmgr_state *st, const sh_proto_kv_free *q)
{
    int32_t id = map_get(st, q->seq);
    if (id < 0)
        return;
    if (apply_computed(st, id, q->computed))
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_bad_computed", "seq=%llu computed=%u",
                     (unsigned long long)q->seq, (unsigned)q->computed);
    sh_kv_seq_free(st->kv, id);
    map_del(st, q->seq);
}

/* CONTROL op RESET (the batcher, after a pause for a failed stage node): the pool becomes as
 * after init, every sequence and prefix-cache entry dropped and every block free, by creating the
 * manager again with the same configuration. The counters go on from where they were (base); the
 * gauges follow at the next publish. Messages about the old sequences that come after it find
 * unknown ids (KV_FREE is ignored, KV_ALLOC of an unknown id refused). When the new manager
 * cannot be created the old one stays (logged at error). */
static void on_reset(sh_actor_ctx *ctx, kvmgr_state *st)
{
    sh_kv_mgr *fresh = NULL;
    sh_error e = {0};
    if (sh_kv_create(&st->cfg, &fresh, &e)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "kvmgr_reset_failed", "error=\"%s\"", e.msg);
        return;
    }
    sh_kv_stats s;
    sh_kv_stats_get(st->kv, &s);
    st->base.query_tokens += s.prefix_query_tokens;
    st->base.hit_tokens += s.prefix_hit_tokens;
    st->base.evictions += s.evictions;
    sh_kv_destroy(st->kv);
    st->kv = fresh;
    memset(st->map, 0, st->map_cap * sizeof *st->map);
    st->resets++;
    sh_actor_log(ctx, SH_LOG_LEVEL_INFO, "kvmgr_reset",
                 "sequences=%d blocks_used=%d resets=%" PRIu64, (int)s.seqs_live,
                 (int)s.blocks_used, st->resets);
}

/* A request whose body did not decode: answered with the same type, zero ids and `code`, so the
 * requester's session completes. One-way messages are only logged. */
static void on_malformed(sh_actor_ctx *ctx, kvmgr_state *st, const sh_msg *m, sh_err code,
                         const sh_error *why)
{
    const sh_msg_hdr *h = sh_msg_header(m);
    sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_bad_body", "type=%s error=\"%s\"",
                 sh__msg_type_name(h->type), why->msg);
    if (h->session == 0 || h->type == SH_MSG_KV_FREE)
        return;
    sh_proto_kv_alloc ra = {.status = (int32_t)code};
    sh_proto_kv_fork rf = {.status = (int32_t)code};
    if (h->type == SH_MSG_KV_ALLOC) {
        ra.available = (uint32_t)sh_kv_available(st->kv);
        (void)sh_reply_with(ctx, m, h->type, sh__proto_encode, &ra, NULL);
    } else {
        (void)sh_reply_with(ctx, m, h->type, sh__proto_encode, &rf, NULL);
    }
}

/* ---- vtable ---- */

/* Loop thread. Creates the manager, the id map and the decoder; registers the metrics. */
static sh_err kvmgr_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    kvmgr_state *st = state;
    const sh_kvmgr_args *a = arg;
    sh_error e = {0};
    sh_err err;
    if (!a)
        return SH_EINVAL;
    st->prefix_cache = a->prefix_cache;
    st->cfg = a->cfg;
    st->block_tokens = a->cfg.block_tokens > 0 ? a->cfg.block_tokens : SH_KV_DEFAULT_BLOCK_TOKENS;
    if ((err = sh_kv_create(&a->cfg, &st->kv, &e))) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "kvmgr_init_failed", "error=\"%s\"", e.msg);
        return err;
    }
    st->map_cap = 16;
    while (st->map_cap < 2u * (uint32_t)a->cfg.max_seqs)
        st->map_cap *= 2;
    st->map = calloc(st->map_cap, sizeof *st->map);
    int32_t per_seq = a->cfg.max_blocks_per_seq > 0 ? a->cfg.max_blocks_per_seq : a->cfg.n_blocks;
    st->max_ids = (int32_t)((int64_t)per_seq * st->block_tokens > SH_PROTO_MAX_TOKENS
                                ? SH_PROTO_MAX_TOKENS
                                : (int64_t)per_seq * st->block_tokens);
    st->ids = malloc((size_t)st->max_ids * sizeof *st->ids);
    if (!st->map || !st->ids || (err = sh__act_decoder_init(&st->dec, KVMGR_ARENA_BYTES))) {
        err = SH_ENOMEM;
        goto fail;
    }
    if ((err = register_metrics(sh_runtime_metrics(sh_actor_runtime(ctx)), st, a->metric_labels)))
        goto fail;
    publish(st);
    return SH_OK;
fail:
    sh__act_decoder_fini(&st->dec);
    free(st->ids);
    free(st->map);
    sh_kv_destroy(st->kv);
    memset(st, 0, sizeof *st);
    return err;
}

/* Loop thread; never blocks. Every message is freed by the runtime (DONE). */
static sh_msg_fate kvmgr_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    kvmgr_state *st = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type == SH_MSG_ERROR)
        return SH_MSG_FATE_DONE;
    if (h->type != SH_MSG_KV_ALLOC && h->type != SH_MSG_KV_FORK && h->type != SH_MSG_KV_FREE &&
        h->type != SH_MSG_CONTROL) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_unexpected", "type=%s",
                     sh__msg_type_name(h->type));
        return SH_MSG_FATE_DONE;
    }
    sh_proto_body b;
    sh_error e = {0};
    sh_err err = sh__act_decode(&st->dec, m, &b, &e);
    if (err) {
        on_malformed(ctx, st, m, err == SH_ERANGE ? SH_ERANGE : SH_EPROTO, &e);
        return SH_MSG_FATE_DONE;
    }
    if (h->type == SH_MSG_CONTROL) {
        if (b.control.op == SH_PROTO_CONTROL_OP_RESET) {
            on_reset(ctx, st);
            publish(st);
        }
    } else if (h->type == SH_MSG_KV_FREE) {
        on_free(ctx, st, &b.kv_free);
        publish(st);
    } else if (h->session == 0)
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "kvmgr_no_session", "type=%s",
                     sh__msg_type_name(h->type));
    else if (h->type == SH_MSG_KV_ALLOC)
        on_alloc(ctx, st, m, &b.kv_alloc);
    else
        on_fork(ctx, st, m, &b.kv_fork);
    return SH_MSG_FATE_DONE;
}

/* Loop thread. Takes this manager's share out of the gauges and frees everything. */
static void kvmgr_stop(sh_actor_ctx *ctx, void *state)
{
    kvmgr_state *st = state;
    sh_gauge_add(st->g_total, -st->pub.total);
    sh_gauge_add(st->g_used, -st->pub.used);
    sh_gauge_add(st->g_cached, -st->pub.cached);
    sh__act_decoder_fini(&st->dec);
    free(st->ids);
    free(st->map);
    sh_kv_destroy(st->kv);
}

const sh_actor_vtable sh__kvmgr_vtable = {
    .name = "kvmgr",
    .state_size = sizeof(kvmgr_state),
    .init = kvmgr_init,
    .handle = kvmgr_handle,
    .stop = kvmgr_stop,
};
