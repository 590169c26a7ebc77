/* The status document of a serving process, built on the gateway's loop for GET /admin/cluster
 * (tools/cluster_status.h). */
#include <jansson.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

/* One node of the cluster: the front itself, or a worker with its link's snapshot. */
static json_t *node_json(const sh_cluster_front *f, int32_t i, int32_t peer)
{
    const sh_cluster_plan *p = &f->plan;
    const sh_config_node *nd = &p->c->nodes[i];
    bool self = i == p->front;
    json_t *stages = json_array();
    for (int32_t k = 0; k < p->n_stages; k++)
        if (p->stage_node[k] == i)
            json_array_append_new(stages, json_integer(k + 1));
    bool joined = self;
    const char *state = "self";
    char last_error[160] = "";
    json_int_t reconnects = 0, sent = 0, queued = 0;
    bool lost = false;
    sh_transport_link l;
    if (!self && peer >= 0 && peer < 256)
        joined =
            atomic_load_explicit((atomic_int *)&f->peers[peer].answered, memory_order_acquire) != 0;
    if (!self && f->tp && sh_transport_link_get(f->tp, (uint32_t)i + 1, &l) == SH_OK) {
        state = state_name(l.state);
        reconnects = l.ups > 1 ? (json_int_t)(l.ups - 1) : 0;
        ascii(last_error, sizeof last_error, l.last_error);
        sent = (json_int_t)l.sent;
        queued = (json_int_t)l.queue_msgs;
        lost = i < 256 && f->ups[i] && (l.state != SH_LINK_STATE_UP || l.ups != f->ups[i]);
    } else if (!self) {
        state = "connecting";
    }
    return json_pack("{s:s, s:s, s:s, s:b, s:s, s:I, s:b, s:s, s:o, s:I, s:I}", "name", nd->name,
                     "url", nd->listen, "role", self ? "front" : "worker", "joined", joined,
                     "state", state, "reconnects", reconnects, "lost", lost, "last_error",
                     last_error, "stages", stages, "frames_sent", sent, "queued", queued);
}

static json_t *stage_json(const char *node, int32_t stage, int32_t first, int32_t last)
{
    return json_pack("{s:i, s:s, s:i, s:i}", "stage", (int)stage, "node", node, "first_layer",
                     (int)first, "last_layer", (int)last);
}

static json_t *replica_json(const sh_cluster_status_src *s, int32_t k, int32_t n_rep,
                            const char *model, json_t *stages)
{
    const struct sh_cluster_status_rep *r = &s->rep[k];
    bool healthy = !(s->front && s->front->down[k]);
    json_t *router = json_null();
    if (n_rep > 1)
        router = json_pack("{s:I, s:f, s:I, s:I, s:I, s:I}", "load", gauge(r->load), "weight",
                           (double)gauge(r->weight) / 1000.0, "requests", gauge(r->held), "routed",
                           counter(r->routed), "redispatched", counter(r->redispatched),
                           "affinity_hits", counter(r->affinity_hits));
    return json_pack("{s:i, s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, s:o}",
                     "replica", (int)k, "model", model, "stages", stages, "running",
                     gauge(r->running), "waiting", gauge(r->waiting), "kv_blocks_used",
                     gauge(r->kv_used), "kv_blocks_total", gauge(r->kv_total), "kv_blocks_cached",
                     gauge(r->kv_cached), "steps", counter(r->steps), "prompt_tokens",
                     counter(r->prompt_tokens), "generation_tokens", counter(r->gen_tokens),
                     "preemptions", counter(r->preemptions), "healthy", healthy, "router", router);
}

char *sh__cluster_status_json(void *user)
{
    sh_cluster_status_src *s = user;
    const sh_cluster_front *f = s->front;
    int32_t n_rep = f ? f->plan.n_replicas : 1;
    lookup(s, n_rep);
    json_t *nodes = json_array(), *replicas = json_array();
    if (f) {
        const sh_cluster_plan *p = &f->plan;
        int32_t peer = 0;
        for (int32_t i = 0; i < p->c->n_nodes; i++)
            json_array_append_new(nodes, node_json(f, i, i == p->front ? -1 : peer++));
        for (int32_t k = 0; k < n_rep; k++) {
            json_t *stages = json_array();
            const sh_cluster_replica_plan *rp = &p->rep[k];
            for (int32_t i = rp->stage0; i < rp->stage0 + rp->n_stages; i++)
                json_array_append_new(stages, stage_json(p->c->nodes[p->stage_node[i]].name, i + 1,
                                                         p->first[i], p->last[i]));
            // The first replica's model is the one this process names (--model-name).
            const char *model = p->c->replicas[k].model == p->c->replicas[0].model
                                    ? s->model
                                    : p->c->models[p->c->replicas[k].model].name;
            json_array_append_new(replicas, replica_json(s, k, n_rep, model, stages));
        }
    } else {
        json_array_append_new(
            nodes, json_pack("{s:s, s:s, s:s, s:b, s:s, s:I, s:b, s:s, s:[i], s:I, s:I}", "name",
                             s->node, "url", "", "role", "single", "joined", 1, "state", "self",
                             "reconnects", (json_int_t)0, "lost", 0, "last_error", "", "stages", 1,
                             "frames_sent", (json_int_t)0, "queued", (json_int_t)0));
        json_t *stages = json_array();
        json_array_append_new(stages, stage_json(s->node, 1, 0, s->n_layers));
        json_array_append_new(replicas, replica_json(s, 0, 1, s->model, stages));
    }
    json_t *root = json_pack("{s:s, s:s, s:s, s:s, s:{s:s, s:i}, s:o, s:o}", "object",
                             "shoal.cluster", "version", SH_VERSION_STRING, "mode",
                             f ? "cluster" : "single", "node", s->node, "model", "name", s->model,
                             "layers", (int)s->n_layers, "nodes", nodes, "replicas", replicas);
    if (!root)
        return NULL;
    char *out = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    return out;
}
