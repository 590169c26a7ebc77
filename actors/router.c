/* The router actor: one replica per request, by estimated load, measured weight, prefix affinity
 * and health, with re-dispatch of requests stuck in a queue (actors/router.h says what it does).
 *
 * Each request the router holds keeps a copy of its SUBMIT body (allocated at SUBMIT, freed when
 * it finishes), so that it can be submitted again to another replica. Everything else is
 * allocated at init. Thread: the router's loop. */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "actors/actor_util.h"
#include "actors/kvmgr_core.h"
#include "actors/router.h"
#include "base/error.h"

#define TIMER_TICK 1
#define TICK_MS 100
#define N_BUCKETS 4096u  /* request table: chained hash buckets */
#define AFF_SLOTS 65536u /* remembered block chains (direct-mapped; a collision replaces) */
#define MAX_AFF_BLOCKS 512
#define MIN_WEIGHT 0.05
#define MIN_BUSY_US 50000 /* a window with less busy time than this keeps the old weight */
#define COST_FACTOR 1.2
#define ROUTER_ARENA_BYTES ((size_t)1 << 20)
#define DEF_LONG_PROMPT 512
#define ROUTE_LOG_US 60000000u /* a failing route() is logged at most once a minute */

/* How a request's replica was chosen (sh_router_args): by the length rule or by route(). */
enum { CLS_NONE = -1, CLS_LONG, CLS_SHORT, CLS_SCRIPT, N_CLS };
static const char *const cls_names[N_CLS] = {"long", "short", "script"};

typedef struct rreq {
    uint64_t id;
    sh_addr reply_to;
    uint64_t trace;
    int32_t replica;
    double cost;
    uint64_t routed_us;   /* when it was sent to its current replica */
    uint64_t withdraw_us; /* when a withdraw was sent (0: none pending) */
    uint32_t n_choices, n_done;
    int8_t cls;    /* CLS_*: its moves prefer replicas of its class */
    bool streamed; /* a TOKEN reached the client: it can no longer move */
    bool cancelled;
    uint8_t *body; /* the SUBMIT as the gateway sent it */
    size_t body_len;
    struct rreq *next;
} rreq;

typedef struct replica {
    sh_addr batcher;
    int32_t id;         /* its label and index into down (args.ids) */
    int32_t tp, stages; /* its shape (args.tp, args.stages) */
    double load;        /* sum of the costs of the requests it holds */
    int32_t held;
    double weight, capacity;
    bool healthy, reported;
    bool removed; /* down[k] was 2: out of routing for good, its requests ended or moved */
    int64_t waiting, running, max_seqs;
    uint64_t tokens, busy_us;         /* as last reported */
    uint64_t win_tokens, win_busy_us; /* at the last weight refresh */
    sh_gauge *g_load, *g_weight, *g_reqs, *g_queue, *g_healthy;
    sh_counter *c_routed, *c_redisp, *c_aff;
    sh_counter *c_cls[N_CLS]; /* NULL for a class that cannot occur */
} replica;

typedef struct aff_slot {
    uint64_t hash;
    int32_t replica; /* -1: empty */
} aff_slot;

typedef struct router {
    sh_actor_ctx *ctx;
    sh_router_args a;
    replica *rep; // (n)
    int32_t n;
    rreq **bucket;    // (N_BUCKETS)
    aff_slot *aff;    // (AFF_SLOTS)
    uint64_t *hashes; // (MAX_AFF_BLOCKS)
    int32_t *blk;     // (block_tokens) one block's ids, aligned
    uint32_t rr;
    uint64_t refresh_us;
    bool mixed; /* both shapes among the replicas: the length rule applies */
    int32_t long_prompt;
    struct sh_config_route *route; /* NULL: no route() */
    sh_route_replica *route_reps;  // (n)
    sh_counter *c_route_err;
    uint64_t route_logged_us, route_unlogged; /* the last logged failure, failures since */
    sh_act_decoder dec;
} router;

/* ---- the request table ---- */

static rreq **find_slot(router *r, uint64_t id)
{
    rreq **p = &r->bucket[sh__act_hash_u64(id) & (N_BUCKETS - 1)];
    while (*p && (*p)->id != id)
        p = &(*p)->next;
    return p;
}

static rreq *find(router *r, uint64_t id) { return *find_slot(r, id); }

static void set_gauges(replica *p)
{
    sh_gauge_set(p->g_load, (int64_t)(p->load / p->weight));
    sh_gauge_set(p->g_weight, (int64_t)(p->weight * 1000.0 + 0.5));
    sh_gauge_set(p->g_reqs, p->held);
    sh_gauge_set(p->g_queue, p->waiting);
    sh_gauge_set(p->g_healthy, p->healthy);
}

static void hold(router *r, rreq *q, int32_t k)
{
    q->replica = k;
    r->rep[k].load += q->cost;
    r->rep[k].held++;
    set_gauges(&r->rep[k]);
}

static void unhold(router *r, rreq *q)
{
    replica *p = &r->rep[q->replica];
    p->load -= q->cost;
    if (--p->held <= 0) {
        p->held = 0;
        p->load = 0; /* no rounding drift once empty */
    }
    set_gauges(p);
}

/* Forgets a finished request. */
static void finish(router *r, rreq *q)
{
    rreq **p = find_slot(r, q->id);
    if (*p == q)
        *p = q->next;
    unhold(r, q);
    free(q->body);
    free(q);
}

/* ---- choosing a replica ---- */

static double eff_load(const replica *p) { return p->load / p->weight; }

/* The kvmgr's prefix-cache chain hash (actors/kvmgr_core.h) over the prompt's full blocks:
 * hashes[i] covers blocks 0..i. Returns the count. The ids are copied into an aligned block first
 * (the frame's are not aligned). */
static int32_t chain_hashes(router *r, sh_i32s prompt)
{
    int32_t bt = r->a.block_tokens;
    int32_t n = (int32_t)(prompt.n / (uint32_t)bt);
    if (n > MAX_AFF_BLOCKS)
        n = MAX_AFF_BLOCKS;
    uint64_t h = sh_kv_hash_seed();
    for (int32_t b = 0; b < n; b++) {
        memcpy(r->blk, (const int32_t *)prompt.ptr + (size_t)b * (size_t)bt,
               (size_t)bt * sizeof *r->blk);
        r->hashes[b] = h = sh_kv_hash_block(h, r->blk, bt);
    }
    return n;
}

/* The replica holding the longest remembered chain of the prompt's leading blocks, or -1. */
static int32_t affinity_of(const router *r, int32_t n_hashes)
{
    int32_t best = -1;
    for (int32_t b = 0; b < n_hashes; b++) {
        const aff_slot *s = &r->aff[r->hashes[b] & (AFF_SLOTS - 1)];
        if (s->replica < 0 || s->hash != r->hashes[b])
            break;
        best = s->replica;
    }
    return best;
}

static void remember(router *r, int32_t n_hashes, int32_t k)
{
    for (int32_t b = 0; b < n_hashes; b++)
        r->aff[r->hashes[b] & (AFF_SLOTS - 1)] = (aff_slot){r->hashes[b], k};
}

/* Whether replica k serves class cls: with both shapes, long prompts go to tensor-parallel
 * replicas and short ones to the others; any replica serves the other classes. */
static bool in_class(const router *r, int32_t k, int cls)
{
    if (!r->mixed || (cls != CLS_LONG && cls != CLS_SHORT))
        return true;
    return (r->rep[k].tp > 1) == (cls == CLS_LONG);
}

/* The least loaded healthy replica other than `except` (ties round-robin) of class cls, or of any
 * class when none of cls is healthy (health is a veto, the class a preference); -1 if none. */
static int32_t least_loaded(router *r, int32_t except, int cls)
{
    int32_t best = -1;
    double lo = 0;
    bool strict = false;
    for (int32_t k = 0; k < r->n && !strict; k++)
        strict = k != except && r->rep[k].healthy && in_class(r, k, cls);
    for (int32_t i = 0; i < r->n; i++) {
        int32_t k = (int32_t)((r->rr + (uint32_t)i) % (uint32_t)r->n);
        if (k == except || !r->rep[k].healthy || (strict && !in_class(r, k, cls)))
            continue;
        double l = eff_load(&r->rep[k]);
        if (best < 0 || l < lo - 1e-9) {
            best = k;
            lo = l;
        }
    }
    r->rr++;
    return best;
}

/* Where a new request of class cls goes: affinity first (within the class when the class has a
 * healthy replica) while its replica's load is within the slack. */
static int32_t choose(router *r, int32_t n_hashes, int cls, bool *by_affinity)
{
    *by_affinity = false;
    int32_t k = least_loaded(r, -1, cls);
    if (k < 0 || r->a.affinity_slack < 0 || n_hashes == 0)
        return k;
    int32_t a = affinity_of(r, n_hashes);
    if (a >= 0 && r->rep[a].healthy && (in_class(r, a, cls) || !in_class(r, k, cls)) &&
        eff_load(&r->rep[a]) <= eff_load(&r->rep[k]) + r->a.affinity_slack) {
        *by_affinity = true;
        return a;
    }
    return k;
}

/* ---- sending ---- */

static void fail_client(router *r, const rreq *q, const char *msg)
{
    sh_proto_fail f = {.req = q->id,
                       .code = SH_ECLOSED,
                       .message = {msg, (uint32_t)strlen(msg)},
                       .retryable = true,
                       .status_http = 503};
    sh_error e = {0};
    sh__act_send(sh_actor_runtime(r->ctx), sh_actor_self(r->ctx), q->reply_to, SH_MSG_FAIL,
                 q->trace, &f, &e);
}

static void send_cancel(router *r, const rreq *q, bool withdraw, const char *why)
{
    sh_proto_cancel c = {
        .req = q->id, .reason = {why, (uint32_t)strlen(why)}, .withdraw = withdraw};
    sh_error e = {0};
    sh__act_send(sh_actor_runtime(r->ctx), sh_actor_self(r->ctx), r->rep[q->replica].batcher,
                 SH_MSG_CANCEL, q->trace, &c, &e);
}

/* Sends q's SUBMIT (reply_to = the router) to replica k. */
static sh_err submit_to(router *r, rreq *q, sh_proto_submit *m, int32_t k)
{
    m->reply_to = sh_actor_self(r->ctx);
    sh_error e = {0};
    sh_err rc = sh__act_send(sh_actor_runtime(r->ctx), sh_actor_self(r->ctx), r->rep[k].batcher,
                             SH_MSG_SUBMIT, q->trace, m, &e);
    if (rc)
        return rc;
    hold(r, q, k);
    q->routed_us = sh__act_mono_us();
    q->withdraw_us = 0;
    sh_counter_add(r->rep[k].c_routed, 1);
    return SH_OK;
}

/* Moves a request that streamed nothing to another healthy replica (not `from`); when none is
 * left it ends with an error. q is not held by any replica on entry. */
static void move(router *r, rreq *q, int32_t from, const char *why_none)
{
    int32_t k = least_loaded(r, from, q->cls);
    if (k < 0) {
        fail_client(r, q, why_none);
        q->replica = from;
        hold(r, q, from); /* finish() unholds */
        finish(r, q);
        return;
    }
    sh_proto_body pb;
    sh_error e = {0};
    sh__proto_arena_reset(&r->dec.arena);
    if (sh__proto_decode_body(&r->dec.codec, SH_MSG_SUBMIT, q->body, q->body_len, &pb,
                              &r->dec.arena, &e) ||
        submit_to(r, q, &pb.submit, k)) {
        fail_client(r, q, "the router could not move this request to another replica");
        q->replica = from;
        hold(r, q, from);
        finish(r, q);
        return;
    }
    sh_counter_add(r->rep[k].c_redisp, 1);
    sh_actor_log(r->ctx, SH_LOG_LEVEL_INFO, "redispatch", "req=%" PRIu64 " from=%d to=%d", q->id,
                 (int)from, (int)k);
}

/* ---- route() ---- */

/* The replica the script's route() names for m, or -1 for the default rule: it returned nil, a
 * replica that is not healthy (health is a veto), or it failed (counted, logged once a minute). */
static int32_t script_choice(router *r, const sh_proto_submit *m)
{
    for (int32_t k = 0; k < r->n; k++)
        r->route_reps[k] = (sh_route_replica){.index = r->rep[k].id,
                                              .tp = r->rep[k].tp,
                                              .stages = r->rep[k].stages,
                                              .load = eff_load(&r->rep[k]),
                                              .healthy = r->rep[k].healthy};
    sh_route_req rq = {.prompt_tokens = (int32_t)m->prompt.n,
                       .max_tokens = (int32_t)m->sampling.max_tokens,
                       .priority = (int32_t)m->priority,
                       .model = r->a.model};
    int32_t choice = -1;
    sh_error e = {0};
    if (sh_config_route_call(r->route, &rq, r->route_reps, r->n, &choice, &e)) {
        sh_counter_add(r->c_route_err, 1);
        uint64_t now = sh__act_mono_us();
        if (r->route_logged_us && now - r->route_logged_us < ROUTE_LOG_US) {
            r->route_unlogged++;
            return -1;
        }
        for (char *c = e.msg; *c; c++) /* one line: a traceback's lines joined */
            if (*c == '\n' || *c == '\t' || *c == '"')
                *c = *c == '"' ? '\'' : ' ';
        sh_actor_log(r->ctx, SH_LOG_LEVEL_WARN, "route_failed",
                     "req=%" PRIu64 " err=\"%s\" (%" PRIu64
                     " more since the last line): the default rule routes it",
                     m->req, e.msg, r->route_unlogged);
        r->route_logged_us = now;
        r->route_unlogged = 0;
        return -1;
    }
    for (int32_t k = 0; k < r->n && choice >= 0; k++)
        if (r->rep[k].id == choice)
            return r->rep[k].healthy ? k : -1;
    return -1;
}

/* ---- messages ---- */

static void on_submit(router *r, const sh_msg *msg, sh_proto_submit *m)
{
    const sh_msg_hdr *h = sh_msg_header(msg);
    rreq tmp = {.id = m->req, .reply_to = m->reply_to, .trace = h->trace_id};
    if (find(r, m->req)) {
        fail_client(r, &tmp, "duplicate request id");
        return;
    }
    int32_t n_hashes = chain_hashes(r, m->prompt);
    bool by_aff = false;
    int cls = CLS_SCRIPT;
    int32_t k = r->route ? script_choice(r, m) : -1;
    if (k < 0) {
        cls = !r->mixed ? CLS_NONE : m->prompt.n > (uint32_t)r->long_prompt ? CLS_LONG : CLS_SHORT;
        k = choose(r, n_hashes, cls, &by_aff);
    }
    if (k < 0) {
        fail_client(r, &tmp, "no healthy replica: every replica of this model lost a stage node");
        return;
    }
    size_t len = 0;
    const void *body = sh_msg_body(msg, &len);
    rreq *q = calloc(1, sizeof *q);
    uint8_t *copy = q ? malloc(len ? len : 1) : NULL;
    if (!q || !copy) {
        free(q);
        fail_client(r, &tmp, "out of memory in the router");
        return;
    }
    memcpy(copy, body, len);
    *q = tmp;
    q->body = copy;
    q->body_len = len;
    q->n_choices = m->n ? m->n : 1;
    q->cls = (int8_t)cls;
    q->cost = ((double)m->prompt.n + (double)m->generated.n +
               (double)q->n_choices * (double)m->sampling.max_tokens / 2.0) *
              COST_FACTOR;
    if (submit_to(r, q, m, k)) {
        fail_client(r, q, "the router could not reach the replica");
        free(q->body);
        free(q);
        return;
    }
    rreq **slot = &r->bucket[sh__act_hash_u64(q->id) & (N_BUCKETS - 1)];
    q->next = *slot;
    *slot = q;
    if (by_aff)
        sh_counter_add(r->rep[k].c_aff, 1);
    if (cls != CLS_NONE && r->rep[k].c_cls[cls])
        sh_counter_add(r->rep[k].c_cls[cls], 1);
    remember(r, n_hashes, k);
}

static void on_cancel(router *r, const sh_msg *msg, const sh_proto_cancel *m)
{
    rreq *q = find(r, m->req);
    if (!q)
        return;
    q->cancelled = true;
    size_t len = 0;
    const void *body = sh_msg_body(msg, &len);
    sh_msg_hdr h = {.type = SH_MSG_CANCEL,
                    .src = sh_actor_self(r->ctx),
                    .dst = r->rep[q->replica].batcher,
                    .trace_id = sh_msg_header(msg)->trace_id};
    sh_error e = {0};
    sh_send(sh_actor_runtime(r->ctx), &h, body, len, &e);
}

/* TOKEN, DONE or FAIL from replica `from` for request `id`: relayed to the client unless the
 * request lives elsewhere now. */
static void on_reply(router *r, const sh_msg *msg, int32_t from, uint64_t id,
                     const sh_proto_body *pb)
{
    const sh_msg_hdr *h = sh_msg_header(msg);
    rreq *q = find(r, id);
    if (!q || q->replica != from)
        return; /* finished, or moved: only the current replica speaks for it */
    if (h->type == SH_MSG_FAIL && q->withdraw_us && pb->fail.code == SH_EBUSY &&
        pb->fail.message.len == 9 && !memcmp(pb->fail.message.ptr, "withdrawn", 9)) {
        unhold(r, q);
        if (q->cancelled) {
            q->replica = from;
            hold(r, q, from);
            finish(r, q);
            return;
        }
        move(r, q, from, "no replica left to move this request to");
        return;
    }
    size_t len = 0;
    const void *body = sh_msg_body(msg, &len);
    sh_msg_hdr out = {
        .type = h->type, .src = sh_actor_self(r->ctx), .dst = q->reply_to, .trace_id = h->trace_id};
    sh_error e = {0};
    sh_send(sh_actor_runtime(r->ctx), &out, body, len, &e);
    if (h->type == SH_MSG_TOKEN)
        q->streamed = true;
    else if (h->type == SH_MSG_FAIL || ++q->n_done >= q->n_choices)
        finish(r, q);
}

static int32_t replica_of(const router *r, sh_addr src)
{
    if (!src)
        return -1;
    for (int32_t k = 0; k < r->n; k++)
        if (r->rep[k].batcher == src)
            return k;
    return -1;
}

static void on_metrics(router *r, int32_t k, const sh_proto_metrics *m)
{
    replica *p = &r->rep[k];
    for (uint32_t i = 0; i < m->values.n; i++) {
        const sh_proto_metric *v = &m->values.v[i];
#define IS(key) (v->name.len == strlen(key) && !memcmp(v->name.ptr, key, v->name.len))
        double x = v->value < 0 ? 0 : v->value;
        if (IS(SH_ROUTER_M_WAITING))
            p->waiting = (int64_t)x;
        else if (IS(SH_ROUTER_M_RUNNING))
            p->running = (int64_t)x;
        else if (IS(SH_ROUTER_M_MAX_SEQS))
            p->max_seqs = (int64_t)x;
        else if (IS(SH_ROUTER_M_TOKENS))
            p->tokens = (uint64_t)x;
        else if (IS(SH_ROUTER_M_BUSY_US))
            p->busy_us = (uint64_t)x;
#undef IS
    }
    if (!p->reported) {
        p->win_tokens = p->tokens;
        p->win_busy_us = p->busy_us;
        p->reported = true;
    }
    set_gauges(p);
}

/* ---- the tick: health, weights, re-dispatch ---- */

/* Replica k is out of routing: down[k] was set. Paused (down 1: its node is awaited and the
 * replica resumes by recompute when it is back): its requests that streamed nothing move to a
 * healthy replica when there is one, and the rest stay to resume there. Removed (down 2: it will
 * not come back): those that streamed nothing move or end, the others end with an error. */
static void on_down(router *r, int32_t k, bool removed)
{
    replica *p = &r->rep[k];
    p->healthy = false;
    p->removed = removed;
    set_gauges(p);
    sh_actor_log(r->ctx, SH_LOG_LEVEL_WARN, "replica_down",
                 "replica=%d held=%d %s: no new requests go there", (int)p->id, (int)p->held,
                 removed ? "removed" : "paused");
    bool elsewhere = least_loaded(r, k, CLS_NONE) >= 0;
    for (uint32_t b = 0; b < N_BUCKETS; b++) {
        rreq *q = r->bucket[b];
        while (q) {
            rreq *next = q->next;
            if (q->replica == k && !removed && (q->streamed || q->cancelled || !elsewhere)) {
                // It resumes on this replica (recompute from its tokens) once the node is back.
            } else if (q->replica == k) {
                send_cancel(r, q, false, "replica lost");
                if (q->streamed || q->cancelled) {
                    if (!q->cancelled)
                        fail_client(r, q,
                                    "the replica serving this request lost a stage node; retry");
                    finish(r, q);
                } else {
                    unhold(r, q);
                    move(r, q, k,
                         "the replica holding this request lost a stage node and no "
                         "healthy replica is left");
                }
            }
            q = next;
        }
    }
}

static void refresh_weights(router *r)
{
    double best = 0;
    for (int32_t k = 0; k < r->n; k++) {
        replica *p = &r->rep[k];
        uint64_t busy = p->busy_us - p->win_busy_us, toks = p->tokens - p->win_tokens;
        if (p->reported && p->busy_us >= p->win_busy_us && busy >= MIN_BUSY_US &&
            p->tokens >= p->win_tokens)
            p->capacity = (double)toks / (double)busy;
        p->win_busy_us = p->busy_us;
        p->win_tokens = p->tokens;
        if (p->healthy && p->capacity > best)
            best = p->capacity;
    }
    for (int32_t k = 0; k < r->n; k++) {
        replica *p = &r->rep[k];
        if (best > 0 && p->capacity > 0) {
            p->weight = p->capacity / best;
            if (p->weight < MIN_WEIGHT)
                p->weight = MIN_WEIGHT;
        }
        set_gauges(p);
        sh_actor_log(r->ctx, SH_LOG_LEVEL_DEBUG, "weight", "replica=%d capacity=%.1f weight=%.3f",
                     (int)k, p->capacity * 1e6, p->weight);
    }
}

/* Whether some healthy replica other than k reports room: nothing waiting, a free slot. */
static bool room_elsewhere(const router *r, int32_t k)
{
    for (int32_t i = 0; i < r->n; i++) {
        const replica *p = &r->rep[i];
        if (i != k && p->healthy && p->reported && p->waiting == 0 && p->running < p->max_seqs)
            return true;
    }
    return false;
}

static void check_stuck(router *r, uint64_t now)
{
    uint64_t wait = (uint64_t)r->a.redispatch_ms * 1000u;
    for (uint32_t b = 0; b < N_BUCKETS; b++)
        for (rreq *q = r->bucket[b]; q; q = q->next) {
            if (q->streamed || q->cancelled || now - q->routed_us <= wait)
                continue;
            if (q->withdraw_us) {
                if (now - q->withdraw_us > wait) { /* it was running: try again later */
                    q->withdraw_us = 0;
                    q->routed_us = now;
                }
                continue;
            }
            if (r->rep[q->replica].waiting > 0 && room_elsewhere(r, q->replica)) {
                send_cancel(r, q, true, "moving to another replica");
                q->withdraw_us = now;
            }
        }
}

static void tick(router *r)
{
    for (int32_t k = 0; k < r->n && r->a.down; k++) {
        int down = __atomic_load_n(&r->a.down[r->rep[k].id], __ATOMIC_ACQUIRE);
        if ((r->rep[k].healthy && down) || (!r->rep[k].removed && down == 2)) {
            on_down(r, k, down == 2);
        } else if (!r->rep[k].healthy && !down) { /* its node came back and it resumed */
            r->rep[k].healthy = true;
            r->rep[k].removed = false;
            set_gauges(&r->rep[k]);
            sh_actor_log(r->ctx, SH_LOG_LEVEL_INFO, "replica_up",
                         "replica=%d: takes requests again", (int)r->rep[k].id);
        }
    }
    uint64_t now = sh__act_mono_us();
    if (now - r->refresh_us >= (uint64_t)r->a.weight_refresh_ms * 1000u) {
        r->refresh_us = now;
        refresh_weights(r);
    }
    if (r->a.redispatch_ms != UINT32_MAX && r->n > 1)
        check_stuck(r, now);
}

/* ---- the actor ---- */

static sh_err register_metrics(router *r)
{
    sh_metrics *mx = sh_runtime_metrics(sh_actor_runtime(r->ctx));
    sh_err rc = SH_OK;
    for (int32_t k = 0; k < r->n && !rc; k++) {
        replica *p = &r->rep[k];
        char lb[32];
        snprintf(lb, sizeof lb, "replica=\"%d\"", (int)p->id);
        if ((rc = sh_metrics_gauge(mx, "shoal_router_load",
                                   "Estimated load of a replica: the sum of (prompt + max_tokens "
                                   "/ 2) * 1.2 over its requests, divided by its weight",
                                   lb, &p->g_load)) ||
            (rc = sh_metrics_gauge(mx, "shoal_router_weight",
                                   "A replica's weight from its measured capacity, x1000", lb,
                                   &p->g_weight)) ||
            (rc = sh_metrics_gauge(mx, "shoal_router_requests",
                                   "Requests the router holds on a replica", lb, &p->g_reqs)) ||
            (rc = sh_metrics_gauge(mx, "shoal_router_queue",
                                   "Sequences waiting in a replica's queue, as last reported", lb,
                                   &p->g_queue)) ||
            (rc = sh_metrics_gauge(mx, "shoal_router_healthy", "1 while a replica takes requests",
                                   lb, &p->g_healthy)) ||
            (rc = sh_metrics_counter(mx, "shoal_router_routed_total",
                                     "Requests sent to a replica (moves included)", lb,
                                     &p->c_routed)) ||
            (rc = sh_metrics_counter(mx, "shoal_router_redispatched_total",
                                     "Requests moved to a replica from another", lb,
                                     &p->c_redisp)) ||
            (rc = sh_metrics_counter(mx, "shoal_router_affinity_hits_total",
                                     "Requests routed to a replica by prefix affinity", lb,
                                     &p->c_aff)))
            break;
        for (int c = 0; c < N_CLS && !rc; c++) {
            if (c == CLS_SCRIPT ? !r->route : !r->mixed)
                continue; /* a class that cannot occur gets no series */
            char cl[64];
            snprintf(cl, sizeof cl, "%s,class=\"%s\"", lb, cls_names[c]);
            rc = sh_metrics_counter(mx, "shoal_router_routed_class_total",
                                    "Requests routed to a replica (moves not included) by the "
                                    "length rule (class long or short) or by the script's route()",
                                    cl, &p->c_cls[c]);
        }
        set_gauges(p);
    }
    if (!rc && r->route)
        rc = sh_metrics_counter(mx, "shoal_router_route_errors_total",
                                "Calls of the script's route() that failed or returned a bad "
                                "value (the default rule routed the request)",
                                NULL, &r->c_route_err);
    return rc;
}

static sh_err router_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    router *r = state;
    const sh_router_args *a = arg;
    if (!a || a->n_replicas < 1)
        return SH_EINVAL;
    r->ctx = ctx;
    r->a = *a;
    r->a.batchers = NULL;
    if (r->a.block_tokens <= 0)
        r->a.block_tokens = 16;
    if (!r->a.weight_refresh_ms)
        r->a.weight_refresh_ms = 5000;
    if (!r->a.redispatch_ms)
        r->a.redispatch_ms = 500;
    if (r->a.affinity_slack == 0)
        r->a.affinity_slack = 4096;
    r->n = a->n_replicas;
    r->long_prompt = a->routing ? a->routing->long_prompt : DEF_LONG_PROMPT;
    r->route = a->routing ? a->routing->route : NULL;
    r->a.tp = r->a.stages = NULL;
    r->a.routing = NULL;
    r->rep = calloc((size_t)r->n, sizeof *r->rep);
    r->route_reps = calloc((size_t)r->n, sizeof *r->route_reps);
    r->bucket = calloc(N_BUCKETS, sizeof *r->bucket);
    r->aff = malloc(AFF_SLOTS * sizeof *r->aff);
    r->hashes = malloc(MAX_AFF_BLOCKS * sizeof *r->hashes);
    r->blk = malloc((size_t)r->a.block_tokens * sizeof *r->blk);
    sh_err rc = SH_ENOMEM;
    if (!r->rep || !r->route_reps || !r->bucket || !r->aff || !r->hashes || !r->blk ||
        sh__act_decoder_init(&r->dec, ROUTER_ARENA_BYTES))
        goto fail;
    r->a.ids = NULL;
    for (uint32_t i = 0; i < AFF_SLOTS; i++)
        r->aff[i].replica = -1;
    for (int32_t k = 0; k < r->n; k++)
        r->rep[k] = (replica){.batcher = a->batchers ? a->batchers[k] : 0,
                              .id = a->ids ? a->ids[k] : k,
                              .tp = a->tp && a->tp[k] > 1 ? a->tp[k] : 1,
                              .stages = a->stages && a->stages[k] > 0 ? a->stages[k] : 1,
                              .weight = 1.0,
                              .healthy = true};
    bool some_tp = false, some_one = false;
    for (int32_t k = 0; k < r->n; k++) {
        some_tp |= r->rep[k].tp > 1;
        some_one |= r->rep[k].tp == 1;
    }
    r->mixed = some_tp && some_one;
    if ((rc = register_metrics(r)))
        goto fail;
    r->refresh_us = sh__act_mono_us();
    uint64_t id;
    if ((rc = sh_actor_timer_start(ctx, TICK_MS, TICK_MS, TIMER_TICK, &id)))
        goto fail;
    return SH_OK;
fail:
    free(r->rep);
    free(r->route_reps);
    free(r->bucket);
    free(r->aff);
    free(r->hashes);
    free(r->blk);
    sh__act_decoder_fini(&r->dec);
    return rc;
}

static sh_msg_fate router_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    router *r = state;
    const sh_msg_hdr *h = sh_msg_header(msg);
    sh_proto_body pb;
    sh_error e = {0};
    if (h->type == SH_MSG_ERROR)
        return SH_MSG_FATE_DONE;
    if (sh__act_decode(&r->dec, msg, &pb, &e)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "bad_message", "type=%u err=\"%s\"", (unsigned)h->type,
                     e.msg);
        return SH_MSG_FATE_DONE;
    }
    int32_t from = replica_of(r, h->src);
    switch (h->type) {
    case SH_MSG_SUBMIT:
        on_submit(r, msg, &pb.submit);
        break;
    case SH_MSG_CANCEL:
        on_cancel(r, msg, &pb.cancel);
        break;
    case SH_MSG_TOKEN:
        if (from >= 0)
            on_reply(r, msg, from, pb.token.req, &pb);
        break;
    case SH_MSG_DONE:
        if (from >= 0)
            on_reply(r, msg, from, pb.done.req, &pb);
        break;
    case SH_MSG_FAIL:
        if (from >= 0)
            on_reply(r, msg, from, pb.fail.req, &pb);
        break;
    case SH_MSG_CONTROL:
        if (pb.control.op == SH_PROTO_CONTROL_OP_REROUTE && pb.control.targets.n == (uint32_t)r->n)
            for (int32_t k = 0; k < r->n; k++)
                r->rep[k].batcher = sh_u64s_at(pb.control.targets, (uint32_t)k);
        else
            sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "bad_control", "op=%u targets=%u",
                         (unsigned)pb.control.op, (unsigned)pb.control.targets.n);
        break;
    case SH_MSG_METRICS:
        if (from >= 0)
            on_metrics(r, from, &pb.metrics);
        break;
    default:
        sh_actor_log(ctx, SH_LOG_LEVEL_DEBUG, "unexpected", "type=%u", (unsigned)h->type);
        break;
    }
    return SH_MSG_FATE_DONE;
}

static void router_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)ctx;
    if (tag == TIMER_TICK)
        tick(state);
}

static void router_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    router *r = state;
    for (uint32_t b = 0; b < N_BUCKETS; b++)
        while (r->bucket[b]) {
            rreq *q = r->bucket[b];
            r->bucket[b] = q->next;
            free(q->body);
            free(q);
        }
    free(r->rep);
    free(r->route_reps);
    free(r->bucket);
    free(r->aff);
    free(r->hashes);
    free(r->blk);
    sh__act_decoder_fini(&r->dec);
}

const sh_actor_vtable sh__router_vtable = {
    .name = "router",
    .state_size = sizeof(router),
    .init = router_init,
    .handle = router_handle,
    .stop = router_stop,
    .timer = router_timer,
};
