/* The watchdog actor (actors/watchdog.h): heartbeats, death and return of worker nodes, the
 * pause of their replicas, and the degradation ladder's tick. */
#include "actors/watchdog.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "actors/actor_util.h"
#include "base/error.h"
#include "runtime/proto.h"

#define TAG_BEAT 1
#define TAG_JUDGE 2
#define DECODE_ARENA 4096

typedef struct watchdog {
    sh_watchdog_args a;
    sh_act_decoder dec;
    uint64_t seq;                             /* the last PING's number */
    uint64_t start_ms;                        /* spawn time: the grace before a first PONG */
    uint64_t dead_seq[SH_WATCHDOG_MAX_NODES]; /* the PING seq in flight when it died */
    uint64_t last_seq[SH_WATCHDOG_MAX_NODES]; /* the newest PONG's seq */
    /* PINGs sent since the node's last PONG: a node is judged silent only after dead_after of
     * them went unanswered, so a stall of this actor's own loop (or process) blames nobody. */
    uint32_t unanswered[SH_WATCHDOG_MAX_NODES];
    bool drain[SH_WATCHDOG_MAX_NODES]; /* asked to restart: dead until that process is gone */
} watchdog;

static uint64_t now_ms(void) { return sh__act_mono_us() / 1000; }

static const char *name_of(const watchdog *w, int32_t i)
{
    return w->a.names && w->a.names[i] ? w->a.names[i] : "?";
}

static void note(watchdog *w, const char *kind, int32_t node, int32_t replica, const char *fmt, ...)
    SH_PRINTF(5, 6);
static void note(watchdog *w, const char *kind, int32_t node, int32_t replica, const char *fmt, ...)
{
    if (!w->a.note)
        return;
    char msg[240];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    w->a.note(w->a.note_user, kind, node, replica, msg);
}

static void beat(sh_actor_ctx *ctx, watchdog *w)
{
    sh_proto_ping p = {.seq = ++w->seq, .sent_us = sh__act_mono_us()};
    sh_runtime *rt = sh_actor_runtime(ctx);
    for (int32_t i = 0; i < w->a.view->n_nodes; i++) {
        if (!w->a.watch[i])
            continue;
        sh_error e = {0};
        // A send that fails (the link is down) is the judge's business, not an error here.
        (void)sh__act_send(rt, sh_actor_self(ctx), w->a.pong_from[i], SH_MSG_PING, 0, &p, &e);
        if (w->unanswered[i] < UINT32_MAX)
            w->unanswered[i]++;
    }
}

/* Whether node i's process is gone as the front knew it: its link is not up, or came up again
 * on a new connection (why, cap bytes, says which). */
static bool link_gone(watchdog *w, int32_t i, char *why, size_t cap)
{
    sh_watchdog_node *n = &w->a.view->node[i];
    if (w->a.tp) {
        sh_transport_link l;
        if (sh_transport_link_get(w->a.tp, (uint32_t)i + 1, &l) == SH_OK) {
            if (l.state != SH_LINK_STATE_UP) {
                snprintf(why, cap, "its connection %s%s%s%s",
                         l.state == SH_LINK_STATE_DOWN ? "closed" : "is not up",
                         l.last_error[0] ? " (" : "", l.last_error, l.last_error[0] ? ")" : "");
                return true;
            }
            uint64_t base = atomic_load_explicit(&n->base_ups, memory_order_acquire);
            if (l.ups != base) {
                snprintf(why, cap, "it reconnected (a new process: its KV cache is gone)");
                return true;
            }
        }
    }
    return false;
}

/* Why node i is dead now, into why (cap bytes), or false when it is not. */
static bool dead_now(watchdog *w, int32_t i, uint64_t now, char *why, size_t cap)
{
    sh_watchdog_node *n = &w->a.view->node[i];
    if (link_gone(w, i, why, cap))
        return true;
    uint64_t last = atomic_load_explicit(&n->last_pong_ms, memory_order_relaxed);
    if (!last)
        last = w->start_ms;
    uint64_t limit = (uint64_t)w->a.dead_after * w->a.heartbeat_ms;
    if (now > last + limit && w->unanswered[i] >= w->a.dead_after) {
        snprintf(why, cap, "no heartbeat answer for %llu ms (%u missed)",
                 (unsigned long long)(now - last), (unsigned)((now - last) / w->a.heartbeat_ms));
        return true;
    }
    return false;
}

static void pause_replicas(sh_actor_ctx *ctx, watchdog *w, int32_t i)
{
    int32_t n = w->a.view->n_nodes;
    for (int32_t k = 0; k < w->a.n_replicas; k++) {
        if (!w->a.replica_on[k * n + i])
            continue;
        int expect = 0;
        if (!__atomic_compare_exchange_n(&w->a.down[k], &expect, 1, false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue; /* already out of routing (paused for another node, or removed) */
        sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_PAUSE};
        sh_error e = {0};
        if (sh__act_send(sh_actor_runtime(ctx), w->a.batchers[k], w->a.batchers[k], SH_MSG_CONTROL,
                         0, &c, &e))
            sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "watchdog_pause_failed", "replica=%d err=\"%s\"",
                         (int)k + 1, e.msg);
        note(w, "paused", i, k,
             "replica %d paused (node %s is dead): its steps in flight are abandoned and its "
             "requests wait to resume by recompute",
             (int)k + 1, name_of(w, i));
    }
}

/* Tells the supervisor (when there is one) that node i died (why) or answers again (why NULL). */
static void tell(sh_actor_ctx *ctx, watchdog *w, int32_t i, const char *why)
{
    if (!w->a.supervisor)
        return;
    sh_proto_control c = {
        .op = why ? SH_PROTO_CONTROL_OP_NODE_DEAD : SH_PROTO_CONTROL_OP_NODE_ALIVE, .level = i};
    if (why)
        c.arg = (sh_strv){why, (uint32_t)strlen(why)};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), w->a.supervisor, SH_MSG_CONTROL, 0,
                     &c, &e))
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "watchdog_tell_failed", "node=\"%s\" err=\"%s\"",
                     name_of(w, i), e.msg);
}

/* Marks node i dead (why), pauses its replicas and tells the supervisor. */
static void kill_node(sh_actor_ctx *ctx, watchdog *w, int32_t i, uint64_t now, const char *why)
{
    sh_watchdog_node *n = &w->a.view->node[i];
    sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "node_dead", "node=\"%s\" why=\"%s\"", name_of(w, i), why);
    note(w, "dead", i, -1, "node %s was lost: %s", name_of(w, i), why);
    atomic_store_explicit(&n->dead_ms, now, memory_order_relaxed);
    w->dead_seq[i] = w->seq;
    atomic_store_explicit(&n->health, SH_WATCHDOG_DEAD, memory_order_release);
    atomic_fetch_add_explicit(&n->deaths, 1, memory_order_release);
    pause_replicas(ctx, w, i);
    tell(ctx, w, i, why);
}

/* Node i holds more memory than its budget: drain it (its replicas pause, as for a death) and
 * ask it to restart. */
static void drain(sh_actor_ctx *ctx, watchdog *w, int32_t i, uint64_t now, uint64_t rss)
{
    char why[200];
    snprintf(why, sizeof why,
             "over its memory budget (resident %.0f MiB > %.0f MiB): drained and asked to restart",
             (double)rss / 1048576.0, (double)w->a.budget[i] / 1048576.0);
    w->drain[i] = true;
    atomic_fetch_add_explicit(&w->a.view->node[i].drains, 1, memory_order_relaxed);
    note(w, "drain", i, -1, "node %s is %s", name_of(w, i), why);
    kill_node(ctx, w, i, now, why);
    sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_SHUTDOWN, .arg = {why, (uint32_t)strlen(why)}};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(ctx), sh_actor_self(ctx), w->a.pong_from[i], SH_MSG_CONTROL,
                     0, &c, &e))
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "watchdog_shutdown_failed", "node=\"%s\" err=\"%s\"",
                     name_of(w, i), e.msg);
}

static void judge(sh_actor_ctx *ctx, watchdog *w)
{
    uint64_t now = now_ms();
    for (int32_t i = 0; i < w->a.view->n_nodes; i++) {
        if (!w->a.watch[i])
            continue;
        sh_watchdog_node *n = &w->a.view->node[i];
        int32_t h = atomic_load_explicit(&n->health, memory_order_relaxed);
        char why[200];
        if (w->drain[i]) { /* asked to restart: dead until that process is gone */
            if (link_gone(w, i, why, sizeof why))
                w->drain[i] = false;
            continue;
        }
        bool dead = dead_now(w, i, now, why, sizeof why);
        uint64_t rss = atomic_load_explicit(&n->rss_bytes, memory_order_relaxed);
        if (dead && h != SH_WATCHDOG_DEAD) {
            kill_node(ctx, w, i, now, why);
        } else if (!dead && h == SH_WATCHDOG_ALIVE && w->a.budget && w->a.budget[i] &&
                   rss > w->a.budget[i]) {
            drain(ctx, w, i, now, rss);
        } else if (!dead && h == SH_WATCHDOG_DEAD && w->last_seq[i] > w->dead_seq[i]) {
            atomic_store_explicit(&n->health, SH_WATCHDOG_ALIVE, memory_order_release);
            note(w, "alive", i, -1, "node %s answers heartbeats again after %.2f s", name_of(w, i),
                 (double)(now - atomic_load_explicit(&n->dead_ms, memory_order_relaxed)) / 1000.0);
            tell(ctx, w, i, NULL);
        } else if (!dead && h == SH_WATCHDOG_UNWATCHED && w->last_seq[i]) {
            atomic_store_explicit(&n->health, SH_WATCHDOG_ALIVE, memory_order_release);
        }
    }
}

static void on_pong(watchdog *w, sh_addr from, const sh_proto_pong *p)
{
    for (int32_t i = 0; i < w->a.view->n_nodes; i++) {
        if (!w->a.watch[i] || w->a.pong_from[i] != from)
            continue;
        if (p->seq <= w->last_seq[i] || p->seq > w->seq)
            return; /* a duplicate, a stale answer or not one of ours */
        w->last_seq[i] = p->seq;
        w->unanswered[i] = 0;
        sh_watchdog_node *n = &w->a.view->node[i];
        uint64_t now_us = sh__act_mono_us();
        atomic_store_explicit(&n->rtt_us, now_us > p->sent_us ? now_us - p->sent_us : 0,
                              memory_order_relaxed);
        atomic_store_explicit(&n->rss_bytes, p->mem_bytes, memory_order_relaxed);
        atomic_store_explicit(&n->last_pong_ms, now_us / 1000, memory_order_relaxed);
        atomic_fetch_add_explicit(&n->pongs, 1, memory_order_relaxed);
        return;
    }
}

static sh_err watchdog_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    watchdog *w = state;
    w->a = *(const sh_watchdog_args *)arg;
    if (!w->a.view || w->a.view->n_nodes < 0 || w->a.view->n_nodes > SH_WATCHDOG_MAX_NODES ||
        w->a.n_replicas < 0 || w->a.n_replicas > SH_WATCHDOG_MAX_REPLICAS ||
        (w->a.view->n_nodes && (!w->a.watch || !w->a.pong_from)) ||
        (w->a.n_replicas && (!w->a.replica_on || !w->a.batchers || !w->a.down)))
        return SH_EINVAL;
    if (!w->a.heartbeat_ms)
        w->a.heartbeat_ms = 100;
    if (!w->a.dead_after)
        w->a.dead_after = 3;
    w->start_ms = now_ms();
    sh_err rc = sh__act_decoder_init(&w->dec, DECODE_ARENA);
    if (!rc)
        rc = sh_actor_timer_start(ctx, w->a.heartbeat_ms, w->a.heartbeat_ms, TAG_BEAT, NULL);
    uint32_t judge_ms = w->a.heartbeat_ms / 4 ? w->a.heartbeat_ms / 4 : 1;
    if (!rc)
        rc = sh_actor_timer_start(ctx, judge_ms, judge_ms, TAG_JUDGE, NULL);
    if (!rc)
        beat(ctx, w);
    return rc;
}

static void watchdog_timer(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    watchdog *w = state;
    if (tag == TAG_JUDGE) {
        judge(ctx, w);
        return;
    }
    beat(ctx, w);
    atomic_fetch_add_explicit(&w->a.view->ticks, 1, memory_order_relaxed);
    if (w->a.tick)
        w->a.tick(w->a.tick_user, now_ms());
}

static sh_msg_fate watchdog_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx;
    watchdog *w = state;
    const sh_msg_hdr *h = sh_msg_header(m);
    if (h->type != SH_MSG_PONG)
        return SH_MSG_FATE_DONE;
    sh_proto_body b;
    sh_error e = {0};
    if (sh__act_decode(&w->dec, m, &b, &e) == SH_OK)
        on_pong(w, h->src, &b.pong);
    return SH_MSG_FATE_DONE;
}

static void watchdog_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    watchdog *w = state;
    sh__act_decoder_fini(&w->dec);
}

const sh_actor_vtable sh__watchdog_vtable = {
    .name = "watchdog",
    .state_size = sizeof(watchdog),
    .init = watchdog_init,
    .handle = watchdog_handle,
    .stop = watchdog_stop,
    .timer = watchdog_timer,
};
