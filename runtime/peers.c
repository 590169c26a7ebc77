/* The peer gate: which node each inbound connection proved in HELLO, and the check every frame
 * from another node passes before anything acts on it (runtime/peers.h). */
#include <inttypes.h>
#include <stdio.h>
#include <time.h>

#include "runtime/internal.h"
#include "runtime/msg.h"
#include "runtime/peers.h"

#define LOG_EVERY_MS 5000

static const char *const reason_names[SH__PEERS_REASON_COUNT_] = {
    [SH__PEERS_UNPROVED] = "unproved",           [SH__PEERS_SRC_MISMATCH] = "src_mismatch",
    [SH__PEERS_PREAUTH_FRAME] = "preauth_frame", [SH__PEERS_PREAUTH_CAP] = "preauth_cap",
    [SH__PEERS_PREAUTH_SLOW] = "preauth_slow",   [SH__PEERS_EPOCH] = "epoch",
    [SH__PEERS_TP_NOT_LEADER] = "tp_not_leader",
};

static const char *const reason_text[SH__PEERS_REASON_COUNT_] = {
    [SH__PEERS_UNPROVED] = "its connection has proved no node in HELLO",
    [SH__PEERS_SRC_MISMATCH] = "its src names another node than its connection proved in HELLO",
    [SH__PEERS_PREAUTH_FRAME] = "a connection that has not proved a node sent a frame over the "
                                "HELLO budget: not delivered",
    [SH__PEERS_PREAUTH_CAP] = "the listener holds its cap of connections that have not proved a "
                              "node: closed",
    [SH__PEERS_PREAUTH_SLOW] = "a connection proved no node within the handshake deadline: closed",
    [SH__PEERS_EPOCH] = "a STEP epoch that no rule of the stage allows",
    [SH__PEERS_TP_NOT_LEADER] = "STEP or ACT to a tensor-parallel rank from another actor than "
                                "its group's leader",
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

const char *sh__peers_reason_name(sh__peers_reason r)
{
    return (unsigned)r < SH__PEERS_REASON_COUNT_ ? reason_names[r] : "?";
}

int sh__peers_init(sh__peers *p) { return uv_mutex_init(&p->mu); }

void sh__peers_fini(sh__peers *p) { uv_mutex_destroy(&p->mu); }

sh_err sh__peers_metrics(sh_runtime *rt, const char *node_label)
{
    for (int i = 0; i < SH__PEERS_REASON_COUNT_; i++) {
        char lab[96];
        snprintf(lab, sizeof lab, "%s,reason=\"%s\"", node_label, reason_names[i]);
        sh_err err = sh_metrics_counter(rt->metrics, "shoal_frames_refused_total",
                                        "Frames or connections from other nodes refused by the "
                                        "peer gate (runtime/peers.h), by reason.",
                                        lab, &rt->peers.refused[i]);
        if (err)
            return err;
    }
    return SH_OK;
}

void sh__peers_enforce(sh_runtime *rt) { atomic_store(&rt->peers.on, 1); }

bool sh__peers_enforced(sh_runtime *rt) { return atomic_load(&rt->peers.on) != 0; }

uint64_t sh__msg_conn(const sh_msg *m) { return m->conn; }

bool sh__peers_bind(sh_runtime *rt, uint64_t conn, uint32_t node)
{
    sh__peers *p = &rt->peers;
    if (!conn || !node)
        return false;
    bool ok = false;
    uv_mutex_lock(&p->mu);
    uint32_t i = 0;
    while (i < p->n_bound && p->bound[i].conn != conn)
        i++;
    if (i < p->n_bound) {
        ok = p->bound[i].node == node;
    } else if (p->n_bound < SH__PEERS_MAX_BOUND) {
        p->bound[p->n_bound].conn = conn;
        p->bound[p->n_bound].node = node;
        p->n_bound++;
        ok = true;
    }
    uv_mutex_unlock(&p->mu);
    return ok;
}

void sh__peers_unbind(sh_runtime *rt, uint64_t conn)
{
    sh__peers *p = &rt->peers;
    uv_mutex_lock(&p->mu);
    for (uint32_t i = 0; i < p->n_bound; i++)
        if (p->bound[i].conn == conn) {
            p->bound[i] = p->bound[--p->n_bound];
            break;
        }
    uv_mutex_unlock(&p->mu);
}

bool sh__peers_node_bound(sh_runtime *rt, uint32_t node)
{
    sh__peers *p = &rt->peers;
    bool found = false;
    uv_mutex_lock(&p->mu);
    for (uint32_t i = 0; i < p->n_bound && !found; i++)
        found = p->bound[i].node == node;
    uv_mutex_unlock(&p->mu);
    return found;
}

uint32_t sh__peers_node(sh_runtime *rt, uint64_t conn)
{
    sh__peers *p = &rt->peers;
    uint32_t node = 0;
    if (!conn)
        return 0;
    uv_mutex_lock(&p->mu);
    for (uint32_t i = 0; i < p->n_bound && !node; i++)
        if (p->bound[i].conn == conn)
            node = p->bound[i].node;
    uv_mutex_unlock(&p->mu);
    return node;
}

void sh__peers_refuse(sh_runtime *rt, sh__peers_reason r, uint32_t node, const char *what)
{
    sh__peers *p = &rt->peers;
    if ((unsigned)r >= SH__PEERS_REASON_COUNT_)
        return;
    sh_counter_add(p->refused[r], 1);
    uint64_t n = atomic_fetch_add_explicit(&p->since_log[r], 1, memory_order_relaxed) + 1;
    uint64_t now = mono_ms(), next = atomic_load_explicit(&p->next_log_ms[r], memory_order_relaxed);
    if (now < next ||
        !atomic_compare_exchange_strong(&p->next_log_ms[r], &next, now + LOG_EVERY_MS))
        return;
    atomic_store_explicit(&p->since_log[r], 0, memory_order_relaxed);
    sh__log_emit(&rt->log, SH_LOG_LEVEL_WARN, NULL, 0, "frame_refused",
                 "reason=%s claimed_node=%u what=%s refused=%" PRIu64 " why=\"%s\"",
                 reason_names[r], (unsigned)node, what ? what : "?", n, reason_text[r]);
}

bool sh__peers_allows(sh_runtime *rt, uint64_t conn, uint32_t src_node, uint32_t type)
{
    if (!atomic_load_explicit(&rt->peers.on, memory_order_relaxed) || type == SH_MSG_HELLO)
        return true;
    uint32_t proved = sh__peers_node(rt, conn);
    if (proved && proved == src_node)
        return true;
    sh__peers_refuse(rt, proved ? SH__PEERS_SRC_MISMATCH : SH__PEERS_UNPROVED, src_node,
                     sh__msg_type_name(type));
    return false;
}

void sh__peers_link_state(sh_runtime *rt, uint32_t node, bool up)
{
    sh__peers *p = &rt->peers;
    if (node >= SH__PEERS_MAX_NODES)
        return;
    if (up)
        atomic_fetch_add_explicit(&p->link_ups[node], 1, memory_order_release);
    atomic_store_explicit(&p->link_up[node], up, memory_order_release);
}

uint32_t sh__peers_link_ups(sh_runtime *rt, uint32_t node, bool *up)
{
    sh__peers *p = &rt->peers;
    if (node >= SH__PEERS_MAX_NODES) {
        *up = false;
        return 0;
    }
    *up = atomic_load_explicit(&p->link_up[node], memory_order_acquire) != 0;
    return atomic_load_explicit(&p->link_ups[node], memory_order_acquire);
}
