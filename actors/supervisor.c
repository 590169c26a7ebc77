/* The supervisor of a cluster front (actors/supervisor.h): the watchdog's deaths and returns,
 * handed by its actor to its own thread, which promotes standbys, awaits and rejoins lost nodes,
 * takes replicas out of routing and decides the fail-stop. */
#include "actors/supervisor.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "actors/actor_util.h"
#include "base/error.h"
#include "runtime/internal.h" /* sh__rt_thread_create: the engine places every runtime thread */
#include "runtime/peers.h"    /* sh__msg_conn */
#include "runtime/proto.h"

#define MAX_NODES 256 /* the script's nodes that can be awaited (as sh_cluster_front) */
#define QUEUE_CAP SH_WATCHDOG_MAX_NODES /* deaths waiting for the thread: one per node */
#define CHECK_NS 20000000ull            /* how often the thread looks at awaited nodes */
#define DECODE_ARENA 4096

/* One death, from the watchdog, for the thread. */
typedef struct sup_event {
    int32_t node;
    char why[200];
} sup_event;

struct sh_supervisor {
    sh_supervisor_args a;
    sh_runtime *rt;
    sh_addr batcher[SH_CLUSTER_MAX_REPLICAS]; /* each replica's, for PAUSE / RESUME */
    /* The watchdog's view and what it is spawned with (its actor reads them). */
    sh_watchdog_view watch;
    sh_watchdog_args wa;
    bool watch_on[SH_WATCHDOG_MAX_NODES];
    sh_addr pong_from[SH_WATCHDOG_MAX_NODES];
    const char *names[SH_WATCHDOG_MAX_NODES];
    uint64_t budget[SH_WATCHDOG_MAX_NODES]; /* node{ memory_budget } */
    /* [k * n_nodes + i]: replica k has a stage on node i (atomic: a promotion moves stages while
     * the watchdog reads it). */
    bool replica_on[SH_WATCHDOG_MAX_REPLICAS * SH_WATCHDOG_MAX_NODES];
    /* The thread's own. Lost nodes awaited (recover_ms), by script index: */
    struct {
        bool waiting;
        uint64_t since_ms, deadline_ms;
    } rec[MAX_NODES];
    bool spent[SH_WATCHDOG_MAX_NODES]; /* a standby promoted (or failed to be): not used again */
    /* Events from the actor to the thread, under mu. */
    uv_mutex_t mu;
    uv_cond_t cv;
    sup_event q[QUEUE_CAP];
    int32_t q_head, q_len;
    bool stopping;
    bool sync_ok, thread_on;
    uv_thread_t thread;
    /* The outcome: what, then failed (release). */
    char what[768];
    _Atomic int failed;
};

static uint64_t mono_ms(void) { return sh__act_mono_us() / 1000; }

static const char *recover_what(const sh_supervisor *s)
{
    return s->a.recover_what ? s->a.recover_what : "the recovery wait";
}

static void note(sh_supervisor *s, bool error, const char *fmt, ...) SH_PRINTF(3, 4);
static void note(sh_supervisor *s, bool error, const char *fmt, ...)
{
    if (!s->a.note)
        return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->a.note(s->a.note_user, error, line);
}

/* ---- recovery (the supervisor's thread) ---------------------------------------------------- */

/* Sends replica k's batcher CONTROL op (PAUSE or RESUME), as itself. */
static void control_replica(sh_supervisor *s, int32_t k, uint8_t op)
{
    sh_proto_control c = {.op = op};
    sh_error e = {0};
    if (sh__act_send(s->rt, s->batcher[k], s->batcher[k], SH_MSG_CONTROL, 0, &c, &e))
        note(s, false, "replica %d: control: %s", (int)k + 1, e.msg);
}

/* Whether replica k still waits for one of its nodes. */
static bool replica_waits(const sh_supervisor *s, int32_t k)
{
    const sh_cluster_plan *p = &s->a.front->plan;
    for (int32_t i = 0; i < p->c->n_nodes && i < MAX_NODES; i++)
        if (s->rec[i].waiting && sh__cluster_replica_on(p, k, i))
            return true;
    return false;
}

/* A lost node with recover_ms: the watchdog already paused every replica with a stage there (its
 * steps in flight are abandoned, its sequences go back to its queue keeping their tokens, its KV
 * is forgotten) and took it out of routing; wait for the node to come back. */
static void await_node(sh_supervisor *s, int32_t node, const char *what)
{
    const sh_cluster_plan *p = &s->a.front->plan;
    uint64_t now = mono_ms();
    s->rec[node].waiting = true;
    s->rec[node].since_ms = now;
    s->rec[node].deadline_ms = now + s->a.recover_ms;
    for (int32_t k = 0; k < p->n_replicas; k++) {
        if (!sh__cluster_replica_on(p, k, node))
            continue;
        if (!__atomic_exchange_n(&s->a.front->down[k], 1, __ATOMIC_ACQ_REL))
            control_replica(s, k, SH_PROTO_CONTROL_OP_PAUSE); /* not paused by the watchdog */
        note(s, false,
             "%s: replica %d paused; waiting up to %.1f s for the node to come back "
             "(%s), then its requests resume by recompute",
             what, (int)k + 1, s->a.recover_ms / 1000.0, recover_what(s));
    }
}

/* Resumes the replicas of node i that wait for no other node, after it came back (how: "came
 * back" for a node that answers heartbeats again, "restarted" for a new process). */
static void node_back(sh_supervisor *s, int32_t i, const char *how)
{
    const sh_cluster_plan *p = &s->a.front->plan;
    const sh_config_node *nd = &p->c->nodes[i];
    double after = (double)(mono_ms() - s->rec[i].since_ms) / 1000.0;
    bool restarted = !strcmp(how, "restarted");
    __atomic_store_n(&s->a.front->lost[i], false, __ATOMIC_RELEASE); /* the status reads it */
    if (nd->standby && restarted)
        s->spent[i] = false; /* a fresh standby process: it can be promoted again */
    if (restarted)
        sh__cluster_events_add(s->a.events, "restarted", i, -1,
                               "node %s rejoined as a new process %.2f s after it was lost",
                               nd->name, after);
    for (int32_t k = 0; k < p->n_replicas; k++) {
        if (!sh__cluster_replica_on(p, k, i) || replica_waits(s, k))
            continue;
        control_replica(s, k, SH_PROTO_CONTROL_OP_RESUME);
        __atomic_store_n(&s->a.front->down[k], 0, __ATOMIC_RELEASE);
        sh__cluster_events_add(s->a.events, "resumed", i, k,
                               "replica %d resumed %.2f s after node %s was lost (its sequences "
                               "are recomputed)",
                               (int)k + 1, after, nd->name);
        note(s, false,
             "node %s came back %.1f s after it was lost (%s); replica %d resumed (its sequences "
             "are recomputed)",
             nd->name, after, restarted ? "a new process" : "the same process", (int)k + 1);
    }
}

/* Moves node dead's stages and ranks to standby sb (sh__cluster_front_promote; dead == sb: a
 * restarted standby takes its stages back), reroutes the stage before each moved one or moved
 * group leader (or the batcher, for a first stage) to its new address, regroups each group that
 * got a new rank (sh__cluster_front_regroup) and resumes the replicas that wait for no other
 * node. Returns whether it was done. */
static bool promote_to(sh_supervisor *s, int32_t dead, int32_t sb)
{
    sh_cluster_plan *p = &s->a.front->plan;
    const sh_config_node *nodes = p->c->nodes;
    int32_t k0 = -1;
    for (int32_t k = 0; k < p->n_replicas && k0 < 0; k++)
        if (sh__cluster_replica_on(p, k, dead))
            k0 = k;
    if (k0 < 0)
        return false;
    const char *dn = nodes[dead].name, *sn = nodes[sb].name;
    if (dead != sb)
        note(s, false, "promoting standby %s in place of node %s", sn, dn);
    uint64_t t0 = mono_ms();
    int32_t moved[SH_CLUSTER_MAX_STAGES], ranks[SH_CLUSTER_MAX_STAGES], n = 0;
    char why[512];
    uint32_t wait_ms = s->a.recover_ms ? s->a.recover_ms : 30000;
    int rc = sh__cluster_front_promote(s->a.front, s->rt, s->batcher[k0], dead, sb, wait_ms,
                                       dead == sb ? NULL : &s->watch.node[sb].health, moved, ranks,
                                       &n, why, sizeof why);
    if (rc) {
        sh__cluster_events_add(s->a.events, "fault", sb, -1, "promotion of %s failed: %s", sn, why);
        note(s, false, "promotion of standby %s failed: %s", sn, why);
        return false;
    }
    // A group with a new rank learns its ranks anew before anything resumes (the leader's next
    // step forms the group with them); a stage whose leader moved is rerouted to below.
    for (int32_t j = 0; j < n; j++) {
        int32_t i = moved[j];
        if (p->stage_tp[i] > 1 &&
            sh__cluster_front_regroup(s->a.front, s->rt, s->batcher[p->stage_replica[i]], i, why,
                                      sizeof why)) {
            sh__cluster_events_add(s->a.events, "fault", sb, -1, "regroup after %s: %s", sn, why);
            note(s, false, "regroup after the promotion of standby %s: %s", sn, why);
        }
    }
    for (int32_t j = 0; j < n; j++) {
        int32_t i = moved[j], k = p->stage_replica[i];
        uint64_t t = p->stage_addr[i];
        sh_proto_control ctl = {.op = SH_PROTO_CONTROL_OP_REROUTE, .targets = {&t, 1}};
        if (ranks[j] != 0)
            continue; /* a rank of a group other than its leader: reached through the leader */
        if (i != p->rep[k].stage0 && p->stage_node[i - 1] == sb)
            continue; /* moved along: the standby wired it */
        sh_addr at = i == p->rep[k].stage0 ? s->batcher[k] : p->stage_addr[i - 1];
        sh_error e = {0};
        if (sh__act_send(s->rt, s->batcher[k], at, SH_MSG_CONTROL, 0, &ctl, &e))
            note(s, false, "reroute to standby %s: %s", sn, e.msg);
    }
    int32_t nn = p->c->n_nodes;
    for (int32_t k = 0; k < p->n_replicas; k++) {
        __atomic_store_n(&s->replica_on[k * nn + dead], sh__cluster_replica_on(p, k, dead),
                         __ATOMIC_RELEASE);
        __atomic_store_n(&s->replica_on[k * nn + sb], sh__cluster_replica_on(p, k, sb),
                         __ATOMIC_RELEASE);
    }
    double took = (double)(mono_ms() - t0) / 1000.0;
    sh__cluster_events_add(s->a.events, "promoted", sb, k0,
                           "standby %s took over node %s's %d stage%s in %.2f s", sn, dn, (int)n,
                           n == 1 ? "" : "s", took);
    for (int32_t k = 0; k < p->n_replicas; k++) {
        if (!sh__cluster_replica_on(p, k, sb) || replica_waits(s, k))
            continue;
        control_replica(s, k, SH_PROTO_CONTROL_OP_RESUME);
        __atomic_store_n(&s->a.front->down[k], 0, __ATOMIC_RELEASE);
        sh__cluster_events_add(s->a.events, "resumed", sb, k,
                               "replica %d resumed on standby %s (its sequences are recomputed)",
                               (int)k + 1, sn);
        note(s, false,
             "node %s was replaced by standby %s in %.2f s; replica %d resumed (its sequences are "
             "recomputed)",
             dn, sn, took, (int)k + 1);
    }
    return true;
}

/* Replaces dead node `dead` with a live standby (one that preloads its stages first), when there
 * is one (promote_to). Returns false when none could: the caller then waits for the node. */
static bool promote(sh_supervisor *s, int32_t dead)
{
    const sh_cluster_config *c = s->a.front->plan.c;
    int32_t sb = -1;
    // A drafter's node holds no stage a standby could take: it is awaited.
    for (int32_t k = 0; k < c->n_replicas; k++)
        if (c->replicas[k].drafter_node == dead)
            return false;
    for (int32_t i = 0; i < c->n_nodes; i++) {
        if (!c->nodes[i].standby || s->spent[i] || i == dead ||
            atomic_load(&s->watch.node[i].health) != SH_WATCHDOG_ALIVE)
            continue;
        if (sb < 0 || (c->nodes[i].preload && !strcmp(c->nodes[i].preload, c->nodes[dead].name)))
            sb = i;
    }
    if (sb < 0)
        return false;
    s->spent[sb] = true;
    if (promote_to(s, dead, sb))
        return true;
    note(s, false, "waiting for node %s instead", c->nodes[dead].name);
    return false;
}

/* A standby that held promoted stages came back as a new process (its link is up on a new
 * connection): it takes the same stages again (promote_to with dead == sb). Returns whether it
 * did; false leaves the node to the usual rejoin (which refuses it: it holds nothing). */
static bool standby_back(sh_supervisor *s, int32_t i)
{
    sh_cluster_front *f = s->a.front;
    sh_transport_link l;
    if (!f->plan.c->nodes[i].standby ||
        sh_transport_link_get(f->tp, (uint32_t)i + 1, &l) != SH_OK || l.state != SH_LINK_STATE_UP ||
        l.ups == __atomic_load_n(&f->ups[i], __ATOMIC_ACQUIRE))
        return false;
    s->rec[i].waiting = false; /* its replicas wait for nothing else here */
    if (!promote_to(s, i, i)) {
        s->rec[i].waiting = true;
        return false;
    }
    __atomic_store_n(&f->ups[i], l.ups, __ATOMIC_RELEASE);
    atomic_store_explicit(&s->watch.node[i].base_ups, l.ups, memory_order_release);
    __atomic_store_n(&f->lost[i], false, __ATOMIC_RELEASE);
    return true;
}

/* Replicas still serving (down[k] == 0). */
static int32_t replicas_up(const sh_supervisor *s)
{
    int32_t up = 0;
    for (int32_t k = 0; k < s->a.front->plan.n_replicas; k++)
        up += !__atomic_load_n(&s->a.front->down[k], __ATOMIC_ACQUIRE);
    return up;
}

/* Brings awaited nodes back: one that answers heartbeats again on the same connection (it was
 * stopped, or cut off) is back at once; one whose link came up on a new connection (restarted)
 * is greeted first. Resumes the replicas that have all their nodes again. Returns true when the
 * front must stop: a node refused on its return, or not back in time, while no replica is left
 * (with one replica: at once); what (cap bytes) then says why. */
static bool check_awaited(sh_supervisor *s, char *what, size_t cap)
{
    const sh_cluster_plan *p = &s->a.front->plan;
    for (int32_t i = 0; i < p->c->n_nodes && i < MAX_NODES; i++) {
        if (!s->rec[i].waiting)
            continue;
        const sh_config_node *nd = &p->c->nodes[i];
        if (atomic_load_explicit(&s->watch.node[i].health, memory_order_acquire) ==
            SH_WATCHDOG_ALIVE) {
            s->rec[i].waiting = false;
            node_back(s, i, "came back");
            continue;
        }
        if (standby_back(s, i))
            continue;
        uint64_t now = mono_ms();
        uint64_t left = s->rec[i].deadline_ms > now ? s->rec[i].deadline_ms - now : 0;
        int rc = left ? sh__cluster_front_rejoin(s->a.front, s->rt, i,
                                                 left < 3000 ? (uint32_t)left : 3000, what, cap)
                      : 1;
        if (rc == 1 && mono_ms() < s->rec[i].deadline_ms)
            continue;
        s->rec[i].waiting = false;
        if (rc == 0) {
            // The new process is the one to trust now: the watchdog judges it by its heartbeats.
            atomic_store_explicit(&s->watch.node[i].base_ups, s->a.front->ups[i],
                                  memory_order_release);
            node_back(s, i, "restarted");
            continue;
        }
        if (rc == 1)
            snprintf(what, cap, "node %s (%s) did not come back within %.1f s (%s)", nd->name,
                     nd->listen, (double)(s->rec[i].deadline_ms - s->rec[i].since_ms) / 1000.0,
                     recover_what(s));
        for (int32_t k = 0; k < p->n_replicas; k++)
            if (sh__cluster_replica_on(p, k, i)) {
                __atomic_store_n(&s->a.front->down[k], 2, __ATOMIC_RELEASE); /* for good */
                sh__cluster_events_add(s->a.events, "removed", i, k, "replica %d: %s", (int)k + 1,
                                       what);
            }
        if (p->n_replicas == 1 || replicas_up(s) == 0)
            return true;
        note(s, true, "%s: its replicas stay out of routing", what);
    }
    return false;
}

/* Node `node` was judged dead (why: the watchdog's reason): marks it lost, then promotes a
 * standby in its place, or awaits it (recover_ms), or takes its replicas out of routing. Without
 * recover_ms: with one replica, any lost worker stops the front; with several, once every
 * replica lost a stage node. Returns true when the front must stop; what (cap bytes) says what
 * happened last. */
static bool node_dead(sh_supervisor *s, int32_t node, const char *why, char *what, size_t cap)
{
    const sh_cluster_plan *p = &s->a.front->plan;
    __atomic_store_n(&s->a.front->lost[node], true, __ATOMIC_RELEASE);
    const sh_config_node *nd = &p->c->nodes[node];
    snprintf(what, cap, "node %s (%s) was lost: %s", nd->name, nd->listen,
             why[0] ? why : "it stopped answering");
    if (node < MAX_NODES && s->rec[node].waiting)
        return false; /* died again while awaited: its deadline stands */
    bool holds = false;
    for (int32_t k = 0; k < p->n_replicas; k++)
        holds |= sh__cluster_replica_on(p, k, node);
    if (!holds && !nd->standby)
        return false; /* replaced by a standby before: nothing waits for it */
    if (holds && promote(s, node))
        return false;
    if (s->a.recover_ms && node < MAX_NODES) {
        await_node(s, node, what);
        return false;
    }
    if (p->n_replicas == 1)
        return true;
    for (int32_t k = 0; k < p->n_replicas; k++) {
        if (sh__cluster_replica_on(p, k, node) &&
            __atomic_exchange_n(&s->a.front->down[k], 2, __ATOMIC_ACQ_REL) != 2) {
            sh__cluster_events_add(s->a.events, "removed", node, k, "replica %d leaves routing: %s",
                                   (int)k + 1, what);
            note(s, true,
                 "%s: replica %d stops (its requests move to another replica or end with an "
                 "error; without %s it does not come back)",
                 what, (int)k + 1, recover_what(s));
        }
    }
    if (replicas_up(s) == 0) {
        snprintf(what, cap, "every replica lost a stage node");
        return true;
    }
    return false;
}

/* Whether a node is awaited (the thread then wakes every CHECK_NS to look at it). */
static bool any_awaited(const sh_supervisor *s)
{
    for (int32_t i = 0; i < MAX_NODES; i++)
        if (s->rec[i].waiting)
            return true;
    return false;
}

/* The supervisor's thread: takes the watchdog's events in order and checks the awaited nodes,
 * until the front must stop or sh__supervisor_stop. A return ("alive") needs no event of its own:
 * check_awaited reads the node's health, and the event only wakes the thread early. */
static void sup_main(void *arg)
{
    sh_supervisor *s = arg;
    char what[768] = "";
    bool stop = false;
    uv_mutex_lock(&s->mu);
    while (!s->stopping) {
        if (!s->q_len) {
            if (any_awaited(s))
                (void)uv_cond_timedwait(&s->cv, &s->mu, CHECK_NS);
            else
                uv_cond_wait(&s->cv, &s->mu);
        }
        while (s->q_len && !s->stopping && !stop) {
            sup_event ev = s->q[s->q_head];
            s->q_head = (s->q_head + 1) % QUEUE_CAP;
            s->q_len--;
            uv_mutex_unlock(&s->mu);
            stop = node_dead(s, ev.node, ev.why, what, sizeof what);
            uv_mutex_lock(&s->mu);
        }
        if (!stop && !s->stopping) {
            uv_mutex_unlock(&s->mu);
            stop = check_awaited(s, what, sizeof what);
            uv_mutex_lock(&s->mu);
        }
        if (stop)
            break;
    }
    uv_mutex_unlock(&s->mu);
    if (!stop)
        return;
    snprintf(s->what, sizeof s->what, "%s", what);
    atomic_store_explicit(&s->failed, 1, memory_order_release);
    if (s->a.on_stop)
        s->a.on_stop(s->a.on_stop_user, s->what);
}

/* ---- the actor: the watchdog's messages, handed to the thread ------------------------------ */

typedef struct sup_actor {
    sh_supervisor *s;
    sh_addr watchdog; /* the only sender it accepts */
    sh_act_decoder dec;
} sup_actor;

/* Loop thread. Spawns the watchdog on this loop, told to report to this actor: its address is
 * known here before any of its messages can be handled. */
static sh_err sup_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    sup_actor *a = state;
    a->s = arg;
    sh_err rc = sh__act_decoder_init(&a->dec, DECODE_ARENA);
    if (rc)
        return rc;
    a->s->wa.supervisor = sh_actor_self(ctx);
    sh_error e = {0};
    rc = sh_actor_spawn(sh_actor_runtime(ctx), "watchdog", &a->s->wa, (int)sh_actor_loop(ctx),
                        &a->watchdog, &e);
    if (rc) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "supervisor_init_failed", "err=\"watchdog: %s\"",
                     e.msg);
        sh__act_decoder_fini(&a->dec);
    }
    return rc;
}

/* Loop thread; never blocks: queues a death for the thread, or wakes it for a return. Only the
 * watchdog's CONTROL NODE_DEAD and NODE_ALIVE are taken; anything else is dropped. */
static sh_msg_fate sup_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    sup_actor *a = state;
    sh_supervisor *s = a->s;
    const sh_msg_hdr *h = sh_msg_header(m);
    sh_proto_body b;
    sh_error e = {0};
    // Local only: from this process's watchdog, never a frame off a link (whatever src it names).
    if (h->type != SH_MSG_CONTROL || h->src != a->watchdog || sh__msg_conn(m) != 0 ||
        sh__act_decode(&a->dec, m, &b, &e) != SH_OK)
        return SH_MSG_FATE_DONE;
    uint8_t op = b.control.op;
    int32_t node = b.control.level;
    if ((op != SH_PROTO_CONTROL_OP_NODE_DEAD && op != SH_PROTO_CONTROL_OP_NODE_ALIVE) || node < 0 ||
        node >= s->watch.n_nodes)
        return SH_MSG_FATE_DONE;
    // A return only wakes the thread (check_awaited reads the node's health). A death is queued
    // once per node: a second one while the first waits changes nothing the thread would do, so
    // the queue never holds more than one event per node and cannot fill.
    uv_mutex_lock(&s->mu);
    bool queued = op != SH_PROTO_CONTROL_OP_NODE_DEAD;
    for (int32_t j = 0; j < s->q_len && !queued; j++)
        queued = s->q[(s->q_head + j) % QUEUE_CAP].node == node;
    if (!queued && s->q_len < QUEUE_CAP) {
        sup_event *ev = &s->q[(s->q_head + s->q_len) % QUEUE_CAP];
        size_t n = b.control.arg.len < sizeof ev->why - 1 ? b.control.arg.len : sizeof ev->why - 1;
        ev->node = node;
        if (n)
            memcpy(ev->why, b.control.arg.ptr, n);
        ev->why[n] = '\0';
        s->q_len++;
    }
    uv_cond_signal(&s->cv);
    uv_mutex_unlock(&s->mu);
    return SH_MSG_FATE_DONE;
}

static void sup_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__act_decoder_fini(&((sup_actor *)state)->dec);
}

const sh_actor_vtable sh__supervisor_vtable = {
    .name = "supervisor",
    .state_size = sizeof(sup_actor),
    .init = sup_init,
    .handle = sup_handle,
    .stop = sup_stop,
};

/* ---- the object ---------------------------------------------------------------------------- */

/* The watchdog's events go into the ring (a death's reason is also in its NODE_DEAD). On the
 * watchdog's loop thread. */
static void watch_note(void *user, const char *kind, int32_t node, int32_t replica, const char *msg)
{
    sh_supervisor *s = user;
    sh__cluster_events_add(s->a.events, kind, node, replica, "%s", msg);
}

sh_err sh__supervisor_create(const sh_supervisor_args *a, sh_supervisor **out, sh_error *e)
{
    *out = NULL;
    const sh_cluster_front *f = a->front;
    if (f && (f->plan.c->n_nodes > SH_WATCHDOG_MAX_NODES ||
              f->plan.n_replicas > SH_WATCHDOG_MAX_REPLICAS))
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "the watchdog watches at most %d nodes and %d replicas",
                             SH_WATCHDOG_MAX_NODES, SH_WATCHDOG_MAX_REPLICAS);
    sh_supervisor *s = calloc(1, sizeof *s);
    if (!s)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    s->a = *a;
    s->wa = (sh_watchdog_args){.view = &s->watch,
                               .note = watch_note,
                               .note_user = s,
                               .tick = a->tick,
                               .tick_user = a->tick_user};
    if (f) {
        const sh_cluster_plan *p = &f->plan;
        const sh_cluster_config *c = p->c;
        int32_t n_rep = p->n_replicas;
        s->watch.n_nodes = c->n_nodes;
        for (int32_t k = 0; k < n_rep; k++)
            s->batcher[k] = a->batchers[k];
        for (int32_t i = 0; i < c->n_nodes; i++) {
            s->names[i] = c->nodes[i].name;
            s->budget[i] = c->nodes[i].memory_budget;
            s->pong_from[i] = sh_addr_make((uint32_t)i + 1, SH_CLUSTER_HELLO_ACTOR);
            // Every worker that hosts a stage, and every standby; not the front (itself).
            s->watch_on[i] = c->nodes[i].standby;
            for (int32_t k = 0; k < n_rep; k++)
                if ((s->replica_on[k * c->n_nodes + i] = sh__cluster_replica_on(p, k, i)))
                    s->watch_on[i] = i != c->gateway.node;
            atomic_store(&s->watch.node[i].base_ups, f->ups[i]);
        }
        s->wa.tp = f->tp;
        s->wa.watch = s->watch_on;
        s->wa.pong_from = s->pong_from;
        s->wa.names = s->names;
        s->wa.budget = s->budget;
        s->wa.n_replicas = n_rep;
        s->wa.replica_on = s->replica_on;
        s->wa.batchers = s->batcher;
        s->wa.down = a->front->down;
        s->wa.heartbeat_ms = (uint32_t)c->watchdog.heartbeat_ms;
        s->wa.dead_after = (uint32_t)c->watchdog.dead_after;
    }
    atomic_init(&s->failed, 0);
    *out = s;
    return SH_OK;
}

sh_watchdog_view *sh__supervisor_view(sh_supervisor *s) { return &s->watch; }

sh_err sh__supervisor_start(sh_supervisor *s, sh_runtime *rt, int loop, sh_error *e)
{
    s->rt = rt;
    sh_err rc;
    if ((rc = sh_runtime_register(rt, &sh__watchdog_vtable, e)))
        return rc;
    if (s->a.front) {
        if (uv_mutex_init(&s->mu))
            return sh__error_set(e, SH_ENOMEM, "supervisor: mutex");
        if (uv_cond_init(&s->cv)) {
            uv_mutex_destroy(&s->mu);
            return sh__error_set(e, SH_ENOMEM, "supervisor: condition");
        }
        s->sync_ok = true;
        int uv = sh__rt_thread_create(rt, &s->thread, sup_main, s);
        if (uv)
            return sh__error_set(e, SH_EIO, "supervisor: thread: %s", uv_strerror(uv));
        s->thread_on = true;
        // Its init spawns the watchdog (sup_init).
        sh_addr addr;
        if ((rc = sh_runtime_register(rt, &sh__supervisor_vtable, e)))
            return rc;
        return sh_actor_spawn(rt, "supervisor", s, loop, &addr, e);
    }
    sh_addr addr;
    return sh_actor_spawn(rt, "watchdog", &s->wa, loop, &addr, e);
}

bool sh__supervisor_failed(sh_supervisor *s, char *what, size_t cap)
{
    if (!s || !atomic_load_explicit(&s->failed, memory_order_acquire))
        return false;
    if (what && cap)
        snprintf(what, cap, "%s", s->what);
    return true;
}

void sh__supervisor_stop(sh_supervisor *s)
{
    if (!s || !s->thread_on)
        return;
    uv_mutex_lock(&s->mu);
    s->stopping = true;
    uv_cond_signal(&s->cv);
    uv_mutex_unlock(&s->mu);
    uv_thread_join(&s->thread);
    s->thread_on = false;
}

void sh__supervisor_destroy(sh_supervisor *s)
{
    if (!s)
        return;
    sh__supervisor_stop(s);
    if (s->sync_ok) {
        uv_cond_destroy(&s->cv);
        uv_mutex_destroy(&s->mu);
    }
    free(s);
}
