/* The status documents of a serving process, built on the gateway's loop for GET /admin/cluster
 * and GET /admin/status (tools/cluster_status.h). */
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shoal/transport.h"
#include "shoal/version.h"
#include "tools/cluster_status.h"

/* Looks the replicas' series up in the registry once (the help texts are the batcher's, the
 * kvmgr's and the router's, in case this runs before they registered). With several replicas
 * their series carry replica="k". */
static void lookup(sh_cluster_status_src *s, int32_t n_rep)
{
    if (s->looked_up)
        return;
    s->looked_up = true;
    sh_metrics *mx = sh_runtime_metrics(s->rt);
    for (int32_t k = 0; k < n_rep; k++) {
        struct sh_cluster_status_rep *r = &s->rep[k];
        char lb[32] = "";
        if (n_rep > 1)
            snprintf(lb, sizeof lb, "replica=\"%d\"", (int)k);
        sh_metrics_gauge(mx, "shoal_requests_running", "Sequences in the running set.", lb,
                         &r->running);
        sh_metrics_gauge(mx, "shoal_requests_waiting", "Sequences waiting for admission.", lb,
                         &r->waiting);
        sh_metrics_gauge(mx, "shoal_batcher_paused",
                         "1 while the replica is paused (CONTROL PAUSE until RESUME).", lb,
                         &r->paused);
        sh_metrics_gauge(mx, "shoal_kv_blocks_used", "KV blocks held by sequences", lb,
                         &r->kv_used);
        sh_metrics_gauge(mx, "shoal_kv_blocks_total", "KV blocks in the pool", lb, &r->kv_total);
        sh_metrics_gauge(mx, "shoal_kv_blocks_cached",
                         "KV blocks in the prefix cache (used or evictable)", lb, &r->kv_cached);
        sh_metrics_counter(mx, "shoal_steps_total", "Batched forward steps run.", lb, &r->steps);
        sh_metrics_counter(mx, "shoal_prompt_tokens_total", "Prompt tokens submitted.", lb,
                           &r->prompt_tokens);
        sh_metrics_counter(mx, "shoal_generation_tokens_total", "Tokens generated.", lb,
                           &r->gen_tokens);
        sh_metrics_counter(mx, "shoal_preemptions_total",
                           "Sequences preempted (recomputed later) because KV blocks ran out.", lb,
                           &r->preemptions);
        if (n_rep < 2)
            continue;
        sh_metrics_gauge(mx, "shoal_router_load",
                         "Estimated load of a replica: the sum of (prompt + max_tokens / 2) * "
                         "1.2 over its requests, divided by its weight",
                         lb, &r->load);
        sh_metrics_gauge(mx, "shoal_router_weight",
                         "A replica's weight from its measured capacity, x1000", lb, &r->weight);
        sh_metrics_gauge(mx, "shoal_router_requests", "Requests the router holds on a replica", lb,
                         &r->held);
        sh_metrics_gauge(mx, "shoal_router_healthy", "1 while a replica takes requests", lb,
                         &r->healthy);
        sh_metrics_counter(mx, "shoal_router_routed_total",
                           "Requests sent to a replica (moves included)", lb, &r->routed);
        sh_metrics_counter(mx, "shoal_router_redispatched_total",
                           "Requests moved to a replica from another", lb, &r->redispatched);
        sh_metrics_counter(mx, "shoal_router_affinity_hits_total",
                           "Requests routed to a replica by prefix affinity", lb,
                           &r->affinity_hits);
    }
}

static json_int_t gauge(const sh_gauge *g) { return g ? (json_int_t)sh_gauge_value(g) : 0; }
static json_int_t counter(const sh_counter *c) { return c ? (json_int_t)sh_counter_value(c) : 0; }

/* A copy of text with every byte outside printable ASCII as '?' (JSON strings must be UTF-8). */
static void ascii(char *dst, size_t cap, const char *text)
{
    size_t n = 0;
    for (; text[n] && n + 1 < cap; n++)
        dst[n] = text[n] >= 0x20 && text[n] < 0x7f ? text[n] : '?';
    dst[n] = '\0';
}

static const char *state_name(sh_link_state st)
{
    switch (st) {
    case SH_LINK_STATE_UP:
        return "up";
    case SH_LINK_STATE_DOWN:
        return "down";
    default:
        return "connecting";
    }
}

/* Health ranks: a link between two nodes is as bad as its worse end. */
enum { HEALTH_ALIVE, HEALTH_JOINING, HEALTH_DEAD };
static const char *const health_names[] = {"alive", "joining", "dead"};

/* One node of the cluster: the front itself, or a worker with its link's snapshot. *health gets
 * the node's health as the link shows it. */
static json_t *node_json(const sh_cluster_front *f, int32_t i, int32_t peer, int *health)
{
    const sh_cluster_plan *p = &f->plan;
    const sh_config_node *nd = &p->c->nodes[i];
    bool self = i == p->front;
    json_t *stages = json_array();
    for (int32_t k = 0; k < p->n_stages; k++)
        if (sh__cluster_rank_on(p, k, i) >= 0)
            json_array_append_new(stages, json_integer(k + 1));
    bool joined = self;
    const char *state = "self";
    char last_error[160] = "";
    json_int_t reconnects = 0, sent = 0, queued = 0;
    bool lost = false;
    sh_transport_link l;
    *health = self ? HEALTH_ALIVE : HEALTH_JOINING;
    if (!self && peer >= 0 && peer < 256)
        joined =
            atomic_load_explicit((atomic_int *)&f->peers[peer].answered, memory_order_acquire) != 0;
    if (!self && f->tp && sh_transport_link_get(f->tp, (uint32_t)i + 1, &l) == SH_OK) {
        state = state_name(l.state);
        reconnects = l.ups > 1 ? (json_int_t)(l.ups - 1) : 0;
        ascii(last_error, sizeof last_error, l.last_error);
        sent = (json_int_t)l.sent;
        queued = (json_int_t)l.queue_msgs;
        uint64_t joined_ups = i < 256 ? __atomic_load_n(&f->ups[i], __ATOMIC_ACQUIRE) : 0;
        lost = joined_ups && (l.state != SH_LINK_STATE_UP || l.ups != joined_ups);
        // Up on the connection the join (or the last rejoin) greeted: alive. Up on a newer one
        // (the process restarted) or never joined: joining until the front greets it.
        if (l.state == SH_LINK_STATE_DOWN)
            *health = HEALTH_DEAD;
        else if (l.state == SH_LINK_STATE_UP && joined && !lost &&
                 !(i < 256 && __atomic_load_n(&f->lost[i], __ATOMIC_ACQUIRE)))
            *health = HEALTH_ALIVE;
    } else if (!self) {
        state = "connecting";
    }
    return json_pack("{s:s, s:s, s:s, s:b, s:s, s:I, s:b, s:s, s:o, s:I, s:I}", "name", nd->name,
                     "url", nd->listen, "role", self ? "front" : "worker", "joined", joined,
                     "state", state, "reconnects", reconnects, "lost", lost, "last_error",
                     last_error, "stages", stages, "frames_sent", sent, "queued", queued);
}

/* Stage `stage` (1-based) of the plan: its node (a group's leader) and every rank's node. */
static json_t *stage_json(const sh_cluster_plan *p, int32_t i)
{
    json_t *ranks = json_array();
    for (int32_t r = 0; r < (p->stage_tp[i] > 1 ? p->stage_tp[i] : 1); r++)
        json_array_append_new(
            ranks,
            json_string(
                p->c->nodes[p->stage_tp[i] > 1 ? p->rank_node[i][r] : p->stage_node[i]].name));
    return json_pack("{s:i, s:s, s:o, s:i, s:i}", "stage", (int)i + 1, "node",
                     p->c->nodes[p->stage_node[i]].name, "ranks", ranks, "first_layer",
                     (int)p->first[i], "last_layer", (int)p->last[i]);
}

/* The router's shoal_router_routed_class_total per replica and class (long, short, script), found
 * by visiting the registry so that this file registers no series of a class the router has not. */
struct class_find {
    double n[SH_CLUSTER_MAX_REPLICAS][3];
};

static void class_visit(void *arg, const sh_metric_sample *m)
{
    static const char *const names[3] = {"long", "short", "script"};
    struct class_find *cf = arg;
    int k = -1;
    char cls[16];
    if (m->kind != SH_METRIC_COUNTER || strcmp(m->name, "shoal_router_routed_class_total") ||
        !m->labels || sscanf(m->labels, "replica=\"%d\",class=\"%15[a-z]\"", &k, cls) != 2 ||
        k < 0 || k >= SH_CLUSTER_MAX_REPLICAS)
        return;
    for (int c = 0; c < 3; c++)
        if (!strcmp(cls, names[c]))
            cf->n[k][c] += m->value;
}

static json_t *replica_json(const sh_cluster_status_src *s, int32_t k, int32_t n_rep,
                            const char *model, json_t *stages, const struct class_find *cf)
{
    const struct sh_cluster_status_rep *r = &s->rep[k];
    bool healthy = !(s->front && __atomic_load_n(&s->front->down[k], __ATOMIC_ACQUIRE));
    json_t *router = json_null();
    if (n_rep > 1)
        router = json_pack("{s:I, s:f, s:I, s:I, s:I, s:I, s:{s:I, s:I, s:I}}", "load",
                           gauge(r->load), "weight", (double)gauge(r->weight) / 1000.0, "requests",
                           gauge(r->held), "routed", counter(r->routed), "redispatched",
                           counter(r->redispatched), "affinity_hits", counter(r->affinity_hits),
                           "routed_by_class", "long", (json_int_t)cf->n[k][0], "short",
                           (json_int_t)cf->n[k][1], "script", (json_int_t)cf->n[k][2]);
    int32_t tp = s->front ? s->front->plan.c->replicas[k].tp : 1;
    return json_pack("{s:i, s:s, s:i, s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, s:o}",
                     "replica", (int)k, "model", model, "tp", (int)(tp > 1 ? tp : 1), "stages",
                     stages, "running", gauge(r->running), "waiting", gauge(r->waiting),
                     "kv_blocks_used", gauge(r->kv_used), "kv_blocks_total", gauge(r->kv_total),
                     "kv_blocks_cached", gauge(r->kv_cached), "steps", counter(r->steps),
                     "prompt_tokens", counter(r->prompt_tokens), "generation_tokens",
                     counter(r->gen_tokens), "preemptions", counter(r->preemptions), "healthy",
                     healthy, "router", router);
}

/* The value of the gauge shoal_degradation_level (the largest over its label sets), found by
 * visiting the registry so that this file never registers a family another owns. */
struct level_find {
    bool found;
    double level;
};

static void level_visit(void *arg, const sh_metric_sample *m)
{
    struct level_find *lf = arg;
    if (m->kind != SH_METRIC_GAUGE || strcmp(m->name, "shoal_degradation_level"))
        return;
    if (!lf->found || m->value > lf->level)
        lf->level = m->value;
    lf->found = true;
}

static json_t *event_json(const sh_cluster_status_src *s, const sh_cluster_event *e)
{
    const sh_cluster_front *f = s->front;
    const char *node = NULL;
    if (e->node >= 0)
        node = !f ? s->node : e->node < f->plan.c->n_nodes ? f->plan.c->nodes[e->node].name : NULL;
    char kind[sizeof e->kind], msg[sizeof e->msg];
    ascii(kind, sizeof kind, e->kind);
    ascii(msg, sizeof msg, e->msg);
    return json_pack("{s:I, s:I, s:s, s:o, s:o, s:s}", "seq", (json_int_t)e->seq, "unix_ms",
                     (json_int_t)e->unix_ms, "kind", kind, "node",
                     node ? json_string(node) : json_null(), "replica",
                     e->replica >= 0 ? json_integer(e->replica) : json_null(), "msg", msg);
}

#define STATUS_EVENTS 32 /* the events /admin/status lists */

/* The watchdog's figures of node i into its object, and its verdict into *health (a node it
 * judged dead that is back on a new connection is joining: the front greets it next). */
static void watch_json(const sh_watchdog_view *w, int32_t i, json_t *v, int *health)
{
    json_t *rtt = json_null(), *age = json_null(), *rss = json_null();
    json_int_t deaths = 0;
    if (w && i < w->n_nodes && i < SH_WATCHDOG_MAX_NODES) {
        const sh_watchdog_node *n = &w->node[i];
        int32_t h = atomic_load_explicit(&n->health, memory_order_acquire);
        if (h == SH_WATCHDOG_ALIVE)
            *health = HEALTH_ALIVE;
        else if (h == SH_WATCHDOG_DEAD)
            *health = *health == HEALTH_JOINING ? HEALTH_JOINING : HEALTH_DEAD;
        uint64_t last = atomic_load_explicit(&n->last_pong_ms, memory_order_relaxed);
        if (last) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
            rtt =
                json_real((double)atomic_load_explicit(&n->rtt_us, memory_order_relaxed) / 1000.0);
            age = json_integer(now > last ? (json_int_t)(now - last) : 0);
            uint64_t b = atomic_load_explicit(&n->rss_bytes, memory_order_relaxed);
            if (b)
                rss = json_integer((json_int_t)b);
        }
        deaths = (json_int_t)atomic_load_explicit(&n->deaths, memory_order_relaxed);
    }
    json_object_set_new(v, "heartbeat_rtt_ms", rtt);
    json_object_set_new(v, "heartbeat_age_ms", age);
    json_object_set_new(v, "rss_bytes", rss);
    json_object_set_new(v, "deaths", json_integer(deaths));
}

/* What /admin/status adds to the cluster document (tools/cluster_status.h). health holds each
 * node's health by script index as its link shows it (the single process: [0]); the watchdog's
 * verdict replaces it. */
static int add_status(sh_cluster_status_src *s, json_t *root, int *health)
{
    const sh_cluster_front *f = s->front;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct level_find lf = {0};
    sh_metrics_foreach(sh_runtime_metrics(s->rt), level_visit, &lf);
    json_t *nodes = json_object_get(root, "nodes"), *replicas = json_object_get(root, "replicas");
    size_t i;
    json_t *v;
    const sh_watchdog_view *w = f ? s->watch : NULL;
    json_array_foreach(nodes, i, v)
    {
        watch_json(w, (int32_t)i, v, &health[i]);
        json_object_set_new(v, "health", json_string(health_names[health[i]]));
    }
    json_t *links = json_array();
    int32_t n_rep = f ? f->plan.n_replicas : 1;
    for (int32_t k = 0; f && k < n_rep; k++) {
        const sh_cluster_plan *p = &f->plan;
        int32_t prev = p->front;
        for (int32_t st = p->rep[k].stage0; st < p->rep[k].stage0 + p->rep[k].n_stages; st++) {
            int32_t nd = p->stage_node[st];
            if (nd == prev)
                continue;
            int h = health[nd] > health[prev] ? health[nd] : health[prev];
            json_array_append_new(links,
                                  json_pack("{s:s, s:s, s:i, s:s}", "from", p->c->nodes[prev].name,
                                            "to", p->c->nodes[nd].name, "replica", (int)k, "health",
                                            health_names[h]));
            prev = nd;
        }
    }
    json_array_foreach(replicas, i, v)
    {
        const struct sh_cluster_status_rep *r = &s->rep[i];
        bool down = f && __atomic_load_n(&f->down[i], __ATOMIC_ACQUIRE);
        // Paused: waiting for a lost node to come back (out of routing meanwhile); down: out of
        // routing and not paused (removed, or the front is about to stop).
        json_object_set_new(v, "state",
                            json_string(gauge(r->paused) ? "paused"
                                        : down           ? "down"
                                                         : "serving"));
        json_object_set_new(v, "load", n_rep > 1 ? json_integer(gauge(r->load)) : json_null());
        json_object_set_new(v, "weight",
                            n_rep > 1 ? json_real((double)gauge(r->weight) / 1000.0) : json_null());
    }
    json_t *events = json_array();
    uint64_t total = 0;
    if (s->events) {
        sh_cluster_event *ev = malloc(STATUS_EVENTS * sizeof *ev);
        if (!ev) {
            json_decref(links);
            json_decref(events);
            return -1;
        }
        size_t n = sh__cluster_events_copy(s->events, 0, ev, STATUS_EVENTS, &total);
        for (size_t e = 0; e < n; e++)
            json_array_append_new(events, event_json(s, &ev[e]));
        free(ev);
    }
    json_object_set_new(root, "object", json_string("shoal.status"));
    json_object_set_new(root, "time_unix_ms",
                        json_integer((json_int_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000));
    json_object_set_new(root, "health_source", json_string(w ? "watchdog" : "links"));
    json_object_set_new(
        root, "degradation",
        json_pack("{s:o}", "level", lf.found ? json_integer((json_int_t)lf.level) : json_null()));
    json_object_set_new(root, "links", links);
    json_object_set_new(root, "events_total", json_integer((json_int_t)total));
    json_object_set_new(root, "events", events);
    return 0;
}

static char *document(sh_cluster_status_src *s, bool full)
{
    const sh_cluster_front *f = s->front;
    int32_t n_rep = f ? f->plan.n_replicas : 1;
    lookup(s, n_rep);
    struct class_find *cf = calloc(1, sizeof *cf);
    if (!cf)
        return NULL;
    sh_metrics_foreach(sh_runtime_metrics(s->rt), class_visit, cf);
    json_t *nodes = json_array(), *replicas = json_array();
    int health[256] = {HEALTH_ALIVE};
    if (f) {
        const sh_cluster_plan *p = &f->plan;
        int32_t peer = 0;
        for (int32_t i = 0; i < p->c->n_nodes && i < 256; i++)
            json_array_append_new(nodes, node_json(f, i, i == p->front ? -1 : peer++, &health[i]));
        for (int32_t k = 0; k < n_rep; k++) {
            json_t *stages = json_array();
            const sh_cluster_replica_plan *rp = &p->rep[k];
            for (int32_t i = rp->stage0; i < rp->stage0 + rp->n_stages; i++)
                json_array_append_new(stages, stage_json(p, i));
            // The first replica's model is the one this process names (--model-name).
            const char *model = p->c->replicas[k].model == p->c->replicas[0].model
                                    ? s->model
                                    : p->c->models[p->c->replicas[k].model].name;
            json_array_append_new(replicas, replica_json(s, k, n_rep, model, stages, cf));
        }
    } else {
        json_array_append_new(
            nodes, json_pack("{s:s, s:s, s:s, s:b, s:s, s:I, s:b, s:s, s:[i], s:I, s:I}", "name",
                             s->node, "url", "", "role", "single", "joined", 1, "state", "self",
                             "reconnects", (json_int_t)0, "lost", 0, "last_error", "", "stages", 1,
                             "frames_sent", (json_int_t)0, "queued", (json_int_t)0));
        json_t *stages = json_array();
        json_array_append_new(stages, json_pack("{s:i, s:s, s:[s], s:i, s:i}", "stage", 1, "node",
                                                s->node, "ranks", s->node, "first_layer", 0,
                                                "last_layer", (int)s->n_layers));
        json_array_append_new(replicas, replica_json(s, 0, 1, s->model, stages, cf));
    }
    json_t *root = json_pack("{s:s, s:s, s:s, s:s, s:{s:s, s:i}, s:o, s:o}", "object",
                             "shoal.cluster", "version", SH_VERSION_STRING, "mode",
                             f ? "cluster" : "single", "node", s->node, "model", "name", s->model,
                             "layers", (int)s->n_layers, "nodes", nodes, "replicas", replicas);
    free(cf);
    if (!root)
        return NULL;
    const sh_config_routing *rt = f ? &f->plan.c->routing : NULL;
    json_object_set_new(root, "routing",
                        json_pack("{s:i, s:b}", "long_prompt", rt ? (int)rt->long_prompt : 512,
                                  "route", rt && rt->route));
    char *out = NULL;
    if (!full || add_status(s, root, health) == 0)
        out = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    return out;
}

char *sh__cluster_status_json(void *user) { return document(user, false); }

char *sh__cluster_status_full_json(void *user) { return document(user, true); }
