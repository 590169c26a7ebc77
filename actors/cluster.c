/* The cluster plan and the front's join, shared by `shoal node` and `shoal serve -c`
 * (actors/cluster.h). */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "actors/actor_util.h"
#include "actors/cluster.h"
#include "actors/cluster_key.h"
#include "actors/kvmgr_core.h"
#include "actors/node_metrics.h"
#include "base/error.h"
#include "base/version.h"
#include "model/gguf.h"
#include "runtime/coll.h"
#include "runtime/peers.h"
#include "runtime/proto.h"
#include "runtime/transport_resolve.h"
#include "shoal/version.h"

#define DEFAULT_STAGE_KV_MEM ((uint64_t)1 << 30)

/* The module's one error line goes into e (this is library code: it prints nothing); returns 2,
 * the exit status of a refused script or peer that callers pass on. */
static int fail(sh_error *e, const char *fmt, ...) SH_PRINTF(2, 3);
static int fail(sh_error *e, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
        e->code = SH_EINVAL;
    }
    return 2;
}

/* Whether a stage of the script, or a rank of a stage's group, is on node. */
static bool hosts_stage(const sh_cluster_config *c, int32_t node)
{
    for (int32_t r = 0; r < c->n_replicas; r++)
        for (int32_t s = 0; s < c->replicas[r].n_stages; s++)
            for (int32_t k = 0; k < c->replicas[r].stages[s].tp; k++)
                if (c->replicas[r].stages[s].ranks[k] == node)
                    return true;
    return false;
}

/* tls+tcp://: every node or none (one transport configuration dials every peer), a CA, and a
 * certificate and key per node. */
static int check_tls(const sh_cluster_config *c, const char *script, sh_error *e)
{
    int32_t tls = -1, plain = -1;
    for (int32_t i = 0; i < c->n_nodes; i++)
        *(!strncmp(c->nodes[i].listen, "tls+tcp://", 10) ? &tls : &plain) = i;
    if (tls < 0)
        return 0;
    const sh_config_node *t = &c->nodes[tls];
    if (plain >= 0)
        return fail(e,
                    "%s: node '%s' listens on %s and node '%s' on %s: with TLS, every "
                    "node must listen on tls+tcp://",
                    script, t->name, t->listen, c->nodes[plain].name, c->nodes[plain].listen);
    if (!c->tls_ca)
        return fail(e,
                    "%s: node '%s' listens on %s: tls+tcp:// needs cluster.tls_ca, the "
                    "CA that signs every node's certificate",
                    script, t->name, t->listen);
    for (int32_t i = 0; i < c->n_nodes; i++)
        if (!c->nodes[i].tls_cert || !c->nodes[i].tls_key)
            return fail(e,
                        "%s: node '%s' listens on %s: give it tls_cert and tls_key (its "
                        "certificate and private key, PEM, signed by cluster.tls_ca)",
                        script, c->nodes[i].name, c->nodes[i].listen);
    return 0;
}

const sh_transport_tls *sh__cluster_tls(const sh_cluster_config *c, int32_t node,
                                        sh_transport_tls *out)
{
    const sh_config_node *n = &c->nodes[node];
    if (strncmp(n->listen, "tls+tcp://", 10) != 0)
        return NULL;
    *out =
        (sh_transport_tls){.cert_file = n->tls_cert, .key_file = n->tls_key, .ca_file = c->tls_ca};
    return out;
}

/* The scheme of a listen URL ("ipc", "tcp", "tls+tcp", ...): its length up to "://". */
static size_t scheme_len(const char *url)
{
    const char *p = strstr(url, "://");
    return p ? (size_t)(p - url) : 0;
}

static bool url_local(const char *url);
static bool same_host(const char *a, const char *b, bool literal);

/* How a group of tp ranks on nodes[] links (for the plan's groups and the standby checks): as the
 * replica's tp_link says
 * ("net": SH_COLL_NET, "hier": SH_COLL_HIER), else ("auto") SH_COLL_SHM when every rank is on
 * this host, SH_COLL_HIER when the ranks are on several hosts with more than one on some,
 * SH_COLL_NET otherwise (one rank per host, or every rank on one other host). */
static int32_t links_kind(const sh_cluster_config *c, const sh_config_replica *rep,
                          const int32_t *nodes, int32_t tp)
{
    if (rep->tp_net)
        return SH_COLL_NET;
    if (rep->tp_hier)
        return SH_COLL_HIER;
    bool local = true, shared = false;
    int32_t n_hosts = 0;
    for (int32_t r = 0; r < tp; r++) {
        const char *u = c->nodes[nodes[r]].listen;
        local = local && url_local(u);
        int32_t q = 0;
        while (q < r && !same_host(c->nodes[nodes[q]].listen, u, false))
            q++;
        n_hosts += q == r;
        shared = shared || q < r;
    }
    if (local)
        return SH_COLL_SHM;
    return n_hosts > 1 && shared ? SH_COLL_HIER : SH_COLL_NET;
}

/* A standby may take the place of any rank of a tensor-parallel group (docs/cluster.md,
 * "Standby nodes"): it must link to the group as its ranks do, on their URL scheme, and on this
 * host when the group exchanges through shared memory. */
static int check_standby_groups(const sh_cluster_config *c, const char *script, int32_t sb,
                                sh_error *e)
{
    const sh_config_node *n = &c->nodes[sb];
    for (int32_t k = 0; k < c->n_replicas; k++)
        for (int32_t s = 0; s < c->replicas[k].n_stages; s++) {
            const sh_config_stage *st = &c->replicas[k].stages[s];
            if (st->tp < 2)
                continue;
            const char *r0 = c->nodes[st->ranks[0]].listen;
            int32_t kind = links_kind(c, &c->replicas[k], st->ranks, st->tp);
            bool local = kind == SH_COLL_SHM;
            // Two levels: a rank's host decides its segment and its host's leader, which a
            // standby elsewhere would move.
            if (kind == SH_COLL_HIER)
                return fail(
                    e,
                    "%s: standby '%s' and replica %d stage %d's group, which links over two "
                    "levels: a standby cannot take a rank's place in a two-level group yet",
                    script, n->name, (int)k + 1, (int)s + 1);
            size_t l = scheme_len(r0);
            if (scheme_len(n->listen) != l || strncmp(n->listen, r0, l))
                return fail(e,
                            "%s: standby '%s' listens on %s and replica %d stage %d's ranks on "
                            "%.*s://: a standby takes a rank's place over the ranks' kind of link",
                            script, n->name, n->listen, (int)k + 1, (int)s + 1, (int)l, r0);
            if (local && !url_local(n->listen))
                return fail(e,
                            "%s: standby '%s' listens on %s, not on this host, and replica %d "
                            "stage %d's ranks exchange through shared memory here: it could not "
                            "take a rank's place (give it a local URL, or the replica "
                            "tp_link = \"net\")",
                            script, n->name, n->listen, (int)k + 1, (int)s + 1);
        }
    return 0;
}

int sh__cluster_check(const sh_cluster_config *c, const char *script, sh_error *e)
{
    const char *later = "not implemented yet (see docs/cluster.md)";
    if (c->n_replicas > SH_CLUSTER_MAX_REPLICAS)
        return fail(e, "%s: %d replicas; at most %d are supported", script, (int)c->n_replicas,
                    SH_CLUSTER_MAX_REPLICAS);
    int32_t total = 0;
    for (int32_t k = 0; k < c->n_replicas; k++) {
        const sh_config_replica *r = &c->replicas[k];
        // A worker answers HELLO with one model identity: its stages must share a model.
        for (int32_t j = 0; j < k; j++) {
            if (c->replicas[j].model == r->model)
                continue;
            for (int32_t s = 0; s < r->n_stages * SH_CONFIG_MAX_TP; s++) {
                const sh_config_stage *st = &r->stages[s / SH_CONFIG_MAX_TP];
                if (s % SH_CONFIG_MAX_TP >= st->tp)
                    continue;
                int32_t node = st->ranks[s % SH_CONFIG_MAX_TP];
                for (int32_t t = 0; t < c->replicas[j].n_stages * SH_CONFIG_MAX_TP; t++)
                    if (t % SH_CONFIG_MAX_TP < c->replicas[j].stages[t / SH_CONFIG_MAX_TP].tp &&
                        c->replicas[j].stages[t / SH_CONFIG_MAX_TP].ranks[t % SH_CONFIG_MAX_TP] ==
                            node)
                        return fail(
                            e,
                            "%s: node '%s' holds stages of replica %d (model '%s') and replica %d "
                            "(model '%s'): a worker node serves one model; give each model's "
                            "stages their own nodes",
                            script, c->nodes[node].name, (int)j + 1,
                            c->models[c->replicas[j].model].name, (int)k + 1,
                            c->models[r->model].name);
            }
        }
        total += r->n_stages;
    }
    if (total > SH_CLUSTER_MAX_STAGES)
        return fail(e, "%s: %d stages in all; at most %d are supported", script, (int)total,
                    SH_CLUSTER_MAX_STAGES);

    for (int32_t i = 0; i < c->n_nodes; i++) {
        const sh_config_node *n = &c->nodes[i];
        if (n->standby && i == c->gateway.node)
            return fail(e, "%s: node '%s' is the gateway's node and cannot be a standby", script,
                        n->name);
        if (n->standby) {
            int rc = check_standby_groups(c, script, i, e);
            if (rc)
                return rc;
        }
        if (n->standby && n->preload) {
            int32_t of = sh_config_find_node(c, n->preload);
            if (of < 0 || c->nodes[of].standby || !hosts_stage(c, of))
                return fail(e,
                            "%s: node '%s': preload = '%s' must name a node that hosts "
                            "stages",
                            script, n->name, n->preload);
        }
        if (!strncmp(n->listen, "inproc://", 9))
            return fail(e,
                        "%s: node '%s' listens on %s: inproc:// only reaches inside one "
                        "process; give worker nodes ipc:// or tcp:// URLs",
                        script, n->name, n->listen);
        int32_t drafters = 0;
        for (int32_t k = 0; k < c->n_replicas; k++)
            drafters += c->replicas[k].drafter_node == i;
        if (drafters && (i == c->gateway.node || n->standby || hosts_stage(c, i) || drafters > 1))
            return fail(e,
                        "%s: node '%s' runs a replica's drafter and %s: a drafter's node holds "
                        "only the drafter",
                        script, n->name,
                        drafters > 1           ? "another drafter"
                        : i == c->gateway.node ? "the gateway"
                        : n->standby           ? "is a standby"
                                               : "a stage");
        if (i != c->gateway.node && !n->standby && !hosts_stage(c, i) && !drafters)
            return fail(e,
                        "%s: node '%s' hosts nothing (no stage and not the gateway's "
                        "node); remove it or give it a stage",
                        script, n->name);
    }
    if (hosts_stage(c, c->gateway.node))
        return fail(e,
                    "%s: node '%s' runs the gateway and a stage: with worker nodes, the "
                    "gateway's node runs only the gateway, batcher and kvmgr (a stage "
                    "there is %s)",
                    script, c->nodes[c->gateway.node].name, later);
    return check_tls(c, script, e);
}

/* Places stage g's ranks: each takes its node's next actor id (per_node counts the stage actors
 * already placed on each node). */
static void place(const sh_config_stage *s, int32_t g, uint32_t *per_node, sh_cluster_plan *p)
{
    int32_t tp = s->tp > 0 ? s->tp : 1;
    p->stage_tp[g] = tp;
    for (int32_t r = 0; r < tp; r++) {
        int32_t node = tp == 1 ? s->node : s->ranks[r];
        uint32_t n = node < 256 ? per_node[node]++ : 0;
        p->rank_node[g][r] = node;
        p->rank_addr[g][r] = sh_addr_make((uint32_t)node + 1, SH_CLUSTER_FIRST_STAGE_ACTOR + n);
    }
    p->stage_node[g] = p->rank_node[g][0];
    p->stage_addr[g] = p->rank_addr[g][0];
}

/* Plans replica k's stages from stage index p->n_stages on; per_node counts the stages already
 * placed on each node (their actor ids follow). */
static int plan_replica(const sh_cluster_config *c, const char *script, const sh_llama_hparams *hp,
                        int32_t k, uint32_t *per_node, sh_cluster_plan *p, sh_error *e)
{
    const sh_config_replica *r = &c->replicas[k];
    sh_cluster_replica_plan *rp = &p->rep[k];
    char who[48] = "";
    if (c->n_replicas > 1)
        snprintf(who, sizeof who, "replica %d, ", (int)k + 1);
    rp->stage0 = p->n_stages;
    rp->n_stages = r->n_stages;
    rp->link_dtype = r->link_dtype; /* the script's GGUF type ids are the wire's dtype ids */
    rp->model = r->model;
    rp->drafter_node = r->drafter_node;
    rp->drafter = r->drafter_node >= 0
                      ? sh_addr_make((uint32_t)r->drafter_node + 1, SH_CLUSTER_DRAFTER_ACTOR)
                      : SH_ADDR_NONE;
    if (!hp) { /* only placed: the addresses follow from the script alone */
        for (int32_t i = 0; i < r->n_stages; i++) {
            p->stage_replica[rp->stage0 + i] = k;
            place(&r->stages[i], rp->stage0 + i, per_node, p);
        }
        p->n_stages += r->n_stages;
        return 0;
    }
    rp->n_layers = hp->n_layers;
    // A self-drafter's layers against the file's count (the script checked it when it gave one).
    if (r->drafter_self >= hp->n_layers)
        return fail(e,
                    "%s: replica %d: drafter self = %d: the draft's layers must be from 1 to %d "
                    "(the model has %d)",
                    r->drafter_where ? r->drafter_where : script, (int)k + 1, (int)r->drafter_self,
                    (int)hp->n_layers - 1, (int)hp->n_layers);
    rp->n_ctx = hp->n_ctx_train < 8192 ? hp->n_ctx_train : 8192;
    if (rp->n_ctx < 16)
        rp->n_ctx = 16;
    // Ranges the script did not know (the layer count came with the model) are resolved here,
    // evenly or by pipeline()'s weights, by the loader's rule (lua/config.h).
    int32_t firsts[SH_CLUSTER_MAX_STAGES], lasts[SH_CLUSTER_MAX_STAGES];
    sh_error le = {0};
    if (r->n_stages > hp->n_layers || r->n_stages > SH_CLUSTER_MAX_STAGES ||
        sh_config_replica_layers(r, hp->n_layers, firsts, lasts, &le))
        return fail(e, "%s: %s%d stages for a model of %d layers", script, who, (int)r->n_stages,
                    (int)hp->n_layers);
    int32_t widest = 0;
    for (int32_t i = 0; i < r->n_stages; i++) {
        const sh_config_stage *s = &r->stages[i];
        int32_t first = firsts[i], last = lasts[i];
        int32_t g = rp->stage0 + i;
        int32_t expect = i ? p->last[g - 1] : 0;
        if (first != expect || last <= first || last > hp->n_layers)
            return fail(e,
                        "%s: %sstage %d on node '%s' holds layers [%d, %d): the stages "
                        "must cover layers [0, %d) of the model in order, without gap or "
                        "overlap (this one should start at layer %d)",
                        script, who, (int)i + 1, c->nodes[s->node].name, (int)first, (int)last,
                        (int)hp->n_layers, (int)expect);
        // What the front can check of a group against the model's shape; each rank's loader
        // checks the rest (block boundaries) when the node starts, naming the node.
        if (s->tp > hp->n_heads)
            return fail(e,
                        "%s: %sstage %d: a group of %d ranks is more than the model's %d "
                        "attention heads",
                        script, who, (int)i + 1, (int)s->tp, (int)hp->n_heads);
        p->first[g] = first;
        p->last[g] = last;
        p->stage_replica[g] = k;
        place(s, g, per_node, p);
        if (last - first > widest)
            widest = last - first;
    }
    p->n_stages += r->n_stages;
    if (p->last[p->n_stages - 1] != hp->n_layers)
        return fail(e, "%s: %sthe stages end at layer %d but the model has %d layers", script, who,
                    (int)p->last[p->n_stages - 1], (int)hp->n_layers);
    rp->block_bytes = (uint64_t)2 * (uint64_t)widest * (uint64_t)hp->n_kv_heads *
                      (uint64_t)hp->head_dim * SH_KV_DEFAULT_BLOCK_TOKENS *
                      (c->kv.f32 ? 4u : 2u); /* K and V, F16 unless kv.type = "f32" */
    uint64_t mem = c->kv.memory_bytes ? c->kv.memory_bytes : DEFAULT_STAGE_KV_MEM;
    uint64_t nb = mem / rp->block_bytes;
    if (nb < 1)
        return fail(e,
                    "%s: kv.memory holds no KV block (one block of the largest stage "
                    "takes %" PRIu64 " bytes)",
                    script, rp->block_bytes);
    rp->n_blocks = nb > (1u << 22) ? (1 << 22) : (int32_t)nb;
    rp->seq_blocks = (rp->n_ctx + SH_KV_DEFAULT_BLOCK_TOKENS - 1) / SH_KV_DEFAULT_BLOCK_TOKENS + 1;
    if (rp->seq_blocks > rp->n_blocks && sh_llama_kv_window(hp) <= 0)
        rp->seq_blocks = rp->n_blocks;
    return 0;
}

int sh__cluster_plan(const sh_cluster_config *c, const char *script,
                     const sh_llama_hparams *const *hp, sh_cluster_plan *p, sh_error *e)
{
    memset(p, 0, sizeof *p);
    p->c = c;
    p->front = c->gateway.node;
    p->max_seqs = c->batcher.max_seqs > 0 ? c->batcher.max_seqs : 64;
    p->step_tokens = c->batcher.max_step_tokens > 0 ? c->batcher.max_step_tokens : 4096;
    if (p->step_tokens < p->max_seqs)
        p->step_tokens = p->max_seqs;
    if (c->n_replicas < 1 || c->n_replicas > SH_CLUSTER_MAX_REPLICAS)
        return fail(e, "%s: %d replicas; 1 to %d are supported", script, (int)c->n_replicas,
                    SH_CLUSTER_MAX_REPLICAS);
    uint32_t per_node[256] = {0};
    p->n_replicas = c->n_replicas;
    for (int32_t k = 0; k < c->n_replicas; k++) {
        if (p->n_stages + c->replicas[k].n_stages > SH_CLUSTER_MAX_STAGES)
            return fail(e, "%s: more than %d stages in all", script, SH_CLUSTER_MAX_STAGES);
        int rc = plan_replica(c, script, hp[c->replicas[k].model], k, per_node, p, e);
        if (rc)
            return rc;
    }
    return 0;
}

int32_t sh__cluster_rank_on(const sh_cluster_plan *p, int32_t i, int32_t node)
{
    // A promotion moves a whole stage by stage_node, or a group's rank by rank_node, atomically.
    if (p->stage_tp[i] <= 1)
        return __atomic_load_n(&p->stage_node[i], __ATOMIC_ACQUIRE) == node ? 0 : -1;
    for (int32_t r = 0; r < p->stage_tp[i]; r++)
        if (__atomic_load_n(&p->rank_node[i][r], __ATOMIC_ACQUIRE) == node)
            return r;
    return -1;
}

/* Whether a listen URL is on this host: ipc://, or tcp:// and tls+tcp:// on 127.x, localhost or
 * [::1]. */
static bool url_local(const char *url)
{
    if (!strncmp(url, "ipc://", 6))
        return true;
    if (!strncmp(url, "tls+tcp://", 10))
        url += 4;
    if (strncmp(url, "tcp://", 6))
        return false;
    const char *h = url + 6, *end = strrchr(h, ':');
    size_t len = end ? (size_t)(end - h) : strlen(h);
    if ((len == 5 && !strncmp(h, "[::1]", 5)) || (len == 9 && !strncmp(h, "localhost", 9)))
        return true;
    if (len < 4 || strncmp(h, "127.", 4))
        return false;
    for (size_t k = 4; k < len; k++)
        if (!(h[k] == '.' || (h[k] >= '0' && h[k] <= '9')))
            return false;
    return true;
}

/* The host part of a listen URL: tcp:// and tls+tcp://'s address without the port, "" for the
 * others (ipc://: this host). */
static size_t url_host(const char *url, const char **h)
{
    if (!strncmp(url, "tls+tcp://", 10))
        url += 4;
    if (strncmp(url, "tcp://", 6)) {
        *h = "";
        return 0;
    }
    *h = url + 6;
    const char *end = strrchr(*h, ':');
    return end ? (size_t)(end - *h) : strlen(*h);
}

/* Whether two listen URLs are on one host: their host parts as written when `literal`
 * (tp_link = "hier", so that 127.0.0.1 and 127.0.0.2 play two hosts), else with every URL on
 * this host (url_local) counted as one. */
static bool same_host(const char *a, const char *b, bool literal)
{
    if (!literal && (url_local(a) || url_local(b)))
        return url_local(a) && url_local(b);
    const char *ha, *hb;
    size_t la = url_host(a, &ha), lb = url_host(b, &hb);
    return la == lb && !strncmp(ha, hb, la);
}

/* Rank r's host in stage i's group: the first rank of the group on the same host. */
static int32_t rank_host(const sh_cluster_plan *p, int32_t i, int32_t r, bool literal)
{
    const char *u = p->c->nodes[p->rank_node[i][r]].listen;
    int32_t k = 0;
    while (k < r && !same_host(p->c->nodes[p->rank_node[i][k]].listen, u, literal))
        k++;
    return k;
}

/* How stage i's group links (links_kind), 0 for a stage of one node. */
static int32_t group_kind(const sh_cluster_plan *p, int32_t i)
{
    if (p->stage_tp[i] <= 1)
        return 0;
    return links_kind(p->c, &p->c->replicas[p->stage_replica[i]], p->rank_node[i], p->stage_tp[i]);
}

/* What stage i's group compresses on its links: the replica's tp_compress over the network, 0
 * (none) otherwise (the script refuses tp_compress without tp_link = "net"). */
static int32_t group_compress(const sh_cluster_plan *p, int32_t i)
{
    int32_t k = group_kind(p, i);
    return k == SH_COLL_NET || k == SH_COLL_HIER ? p->c->replicas[p->stage_replica[i]].tp_compress
                                                 : 0;
}

uint64_t sh__cluster_slice(const sh_cluster_plan *p, int32_t i, int32_t rank)
{
    int32_t tp = p->stage_tp[i] > 0 ? p->stage_tp[i] : 1;
    return SH_HELLO_SLICE_L(p->first[i], p->last[i], tp, rank,
                            group_kind(p, i) | group_compress(p, i) << 2);
}

void sh__cluster_ident_settings(const sh_cluster_plan *p, int32_t node, sh_hello_ident *id)
{
    const sh_cluster_replica_plan *rp = &p->rep[0];
    // A standby that preloads another node's stages serves that node's replica.
    const char *pre = p->c->nodes[node].standby ? p->c->nodes[node].preload : NULL;
    int32_t as = pre ? sh_config_find_node(p->c, pre) : -1;
    for (int32_t i = 0; i < p->n_stages; i++)
        if (sh__cluster_rank_on(p, i, node) >= 0 ||
            (as >= 0 && sh__cluster_rank_on(p, i, as) >= 0)) {
            rp = &p->rep[p->stage_replica[i]];
            break;
        }
    for (int32_t k = 0; k < p->n_replicas; k++)
        if (p->rep[k].drafter_node == node)
            rp = &p->rep[k];
    id->n_blocks = rp->n_blocks;
    id->max_seqs = p->max_seqs;
    id->max_tokens = p->step_tokens;
    id->seq_blocks = rp->seq_blocks;
    id->link_dtype = rp->link_dtype;
    id->kv_dtype = p->c->kv.f32 ? 0u : 1u; /* SH_DTYPE_F32 or SH_DTYPE_F16 */
    if (rp->model_size) {
        id->model_size = rp->model_size;
        id->model_hash = rp->model_hash;
    }
}

sh_addr sh__cluster_next_stage(const sh_cluster_plan *p, int32_t i)
{
    return i + 1 < p->n_stages && p->stage_replica[i + 1] == p->stage_replica[i]
               ? p->stage_addr[i + 1]
               : 0;
}

int sh__cluster_model_ident(const sh_llama *m, const char *path, sh_hello_ident *id, sh_error *e)
{
    if (!m->gguf)
        return fail(e, "%s: cluster nodes need a GGUF model", path);
    id->model_size = sh_gguf_file_size(m->gguf);
    id->model_hash = sh_gguf_header_hash(m->gguf);
    snprintf(id->version, sizeof id->version, "%s", sh__version_build());
    id->proto = sh__version_proto();
    return 0;
}

int sh__cluster_add_peers(const sh_cluster_plan *p, int32_t self, sh_transport *tp, sh_error *e)
{
    const sh_cluster_config *c = p->c;
    for (int32_t i = 0; i < c->n_nodes; i++) {
        if (i == self)
            continue;
        sh_error le = {0};
        if (sh_transport_peer_add(tp, (uint32_t)i + 1, c->nodes[i].listen, &le))
            return fail(e, "node '%s' (%s): %s", c->nodes[i].name, c->nodes[i].listen, le.msg);
    }
    return 0;
}

/* Appends "what: front X, node Y" to buf when they differ. */
static void differ_u64(char *buf, size_t cap, const char *what, uint64_t mine, uint64_t theirs)
{
    if (mine == theirs)
        return;
    size_t l = strlen(buf);
    snprintf(buf + l, cap - l, "%s%s: here %" PRIu64 ", there %" PRIu64, l ? "; " : "", what, mine,
             theirs);
}

/* The script's name of a link dtype id. */
static const char *link_name(uint32_t dtype)
{
    return dtype == 0 ? "f32" : dtype == 1 ? "f16" : dtype == 24 ? "int8" : "?";
}

/* What differs between the front's view and a worker's answer, or "" when nothing does. */
static void compare(const sh_cluster_plan *p, int32_t node, const sh_hello_ident *front,
                    const sh_hello_ident *got, char *buf, size_t cap)
{
    buf[0] = '\0';
    sh_hello_ident want = *front; /* what this node's stages must hold */
    sh__cluster_ident_settings(p, node, &want);
    const sh_hello_ident *self = &want;
    if (strcmp(self->version, got->version))
        snprintf(buf, cap, "build version: here %.31s, there %.31s", self->version, got->version);
    differ_u64(buf, cap, "protocol version", self->proto, got->proto);
    if (self->model_size != got->model_size || self->model_hash != got->model_hash) {
        size_t l = strlen(buf);
        snprintf(buf + l, cap - l,
                 "%sa different model file (size %" PRIu64 " bytes, header hash %016" PRIx64
                 " here; %" PRIu64 " bytes, %016" PRIx64 " there)",
                 l ? "; " : "", self->model_size, self->model_hash, got->model_size,
                 got->model_hash);
    }
    if (strcmp(got->node, p->c->nodes[node].name)) {
        size_t l = strlen(buf);
        snprintf(buf + l, cap - l, "%sit calls itself '%s'", l ? "; " : "", got->node);
    }
    differ_u64(buf, cap, "KV blocks per stage", (uint64_t)self->n_blocks, (uint64_t)got->n_blocks);
    differ_u64(buf, cap, "max sequences per step", (uint64_t)self->max_seqs,
               (uint64_t)got->max_seqs);
    differ_u64(buf, cap, "max tokens per step", (uint64_t)self->max_tokens,
               (uint64_t)got->max_tokens);
    differ_u64(buf, cap, "block-table length", (uint64_t)self->seq_blocks,
               (uint64_t)got->seq_blocks);
    if (self->link_dtype != got->link_dtype) {
        size_t l = strlen(buf);
        snprintf(buf + l, cap - l, "%slink_dtype: here %s, there %s", l ? "; " : "",
                 link_name(self->link_dtype), link_name(got->link_dtype));
    }
    if (self->kv_dtype != got->kv_dtype) {
        size_t l = strlen(buf);
        snprintf(buf + l, cap - l, "%skv.type: here %s, there %s", l ? "; " : "",
                 link_name(self->kv_dtype), link_name(got->kv_dtype));
    }
    if (buf[0])
        return;
    // The stages it reports must be the ones the plan puts there, at the addresses computed,
    // each with the plan's slice: its layers and, in a tensor-parallel group, its rank and the
    // group's size.
    int32_t k = 0;
    for (int32_t i = 0; i < p->n_stages; i++) {
        int32_t r = sh__cluster_rank_on(p, i, node);
        if (r < 0)
            continue;
        sh_addr at = p->stage_tp[i] > 1 ? p->rank_addr[i][r] : p->stage_addr[i];
        if (k >= got->n_stages || got->stages[k] != at) {
            snprintf(buf, cap,
                     "its stages are not the script's (stage %d expected at actor %" PRIu64
                     "): was it started with another script?",
                     (int)i + 1, (uint64_t)(at & 0xffffffffu));
            return;
        }
        uint64_t want_slice = sh__cluster_slice(p, i, r), got_slice = got->slices[k];
        static const char *const links[4] = {"none", "shared memory", "the network",
                                             "two levels (shared memory and the network)"};
        static const char *const cmps[3] = {"none", "f16", "int8"};
        int32_t wl = SH_HELLO_SLICE_LINK(want_slice), gl = SH_HELLO_SLICE_LINK(got_slice);
        int32_t wc = SH_HELLO_SLICE_COMPRESS(want_slice), gc = SH_HELLO_SLICE_COMPRESS(got_slice);
        bool same_but_link = p->first[i] >= 0 && got_slice != want_slice &&
                             (got_slice << 4) == (want_slice << 4) && wc < 3 && gc < 3;
        if (same_but_link && wl != gl) {
            snprintf(buf, cap,
                     "stage %d: its group links over %s, the script's over %s: was it started "
                     "with another script?",
                     (int)i + 1, links[gl], links[wl]);
            return;
        }
        if (same_but_link) { /* the same kind: the compression differs */
            snprintf(buf, cap,
                     "stage %d: its group's links carry tp_compress = \"%s\", the script's \"%s\": "
                     "was it started with another script?",
                     (int)i + 1, cmps[gc], cmps[wc]);
            return;
        }
        if (p->first[i] >= 0 && got_slice != want_slice) { /* first < 0: only placed */
            snprintf(buf, cap,
                     "stage %d: it holds rank %d of %d with layers [%d, %d), the script gives it "
                     "rank %d of %d with layers [%d, %d): was it started with another script?",
                     (int)i + 1, (int)SH_HELLO_SLICE_RANK(got_slice),
                     (int)SH_HELLO_SLICE_TP(got_slice), (int)SH_HELLO_SLICE_FIRST(got_slice),
                     (int)SH_HELLO_SLICE_LAST(got_slice), (int)r, (int)p->stage_tp[i],
                     (int)p->first[i], (int)p->last[i]);
            return;
        }
        k++;
    }
    if (k != got->n_stages)
        snprintf(buf, cap, "it serves %d stages, the script gives it %d", (int)got->n_stages,
                 (int)k);
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Why a worker's answer is refused on the cluster key, or NULL when the key is fine. */
static const char *key_refusal(const sh_hello_peer *p, const char *name, char *buf, size_t cap)
{
    const char *how = "give every node the same key: --cluster-key-file, " SH_CLUSTER_KEY_ENV
                      " or the script's cluster.key_file";
    switch (p->verdict) {
    case SH_HELLO_WRONG_KEY:
        return "wrong cluster key (its proof of the key does not check with this node's key)";
    case SH_HELLO_PEER_UNKEYED:
        snprintf(buf, cap, "this node has a cluster key and '%s' has none (%s)", name, how);
        return buf;
    case SH_HELLO_SELF_UNKEYED:
        snprintf(buf, cap, "'%s' has a cluster key and this node has none (%s)", name, how);
        return buf;
    case SH_HELLO_REFUSED:
        return "it did not accept this node's proof of the cluster key";
    default:
        return NULL;
    }
}

int sh__cluster_join(const sh_cluster_plan *p, sh_runtime *rt, const sh_hello_ident *self,
                     sh_hello_peer *peers, uint32_t timeout_ms, const sh_auth_key *key,
                     sh_transport *tp, sh_cluster_note_fn note, void *note_ud, sh_error *e)
{
    const sh_cluster_config *c = p->c;
    int32_t n = 0, node_of[256];
    for (int32_t i = 0; i < c->n_nodes && n < 256; i++) {
        if (i == p->front)
            continue;
        memset(&peers[n], 0, sizeof peers[n]);
        peers[n].addr = sh_addr_make((uint32_t)i + 1, SH_CLUSTER_HELLO_ACTOR);
        node_of[n++] = i;
    }
    sh_hello_args ha = {.self = self, .peers = peers, .n_peers = n, .retry_ms = 500, .key = key};
    sh_error le = {0};
    sh_addr addr;
    if (sh_runtime_register(rt, &sh__hello_vtable, &le) ||
        sh_actor_spawn(rt, "hello", &ha, 0, &addr, &le))
        return (fail(e, "hello: %s", le.msg), 1);
    char line[512];
    if (note) {
        snprintf(line, sizeof line, "waiting for %d worker node%s to join (up to %.0f s)", (int)n,
                 n == 1 ? "" : "s", timeout_ms / 1000.0);
        note(note_ud, line);
    }
    bool seen[256] = {false};
    int32_t joined = 0;
    uint64_t deadline = mono_ms() + timeout_ms;
    while (joined < n) {
        for (int32_t k = 0; k < n; k++) {
            if (seen[k] || !atomic_load_explicit(&peers[k].answered, memory_order_acquire))
                continue;
            seen[k] = true;
            joined++;
            const sh_config_node *nd = &c->nodes[node_of[k]];
            char diff[1024];
            const char *refusal = key_refusal(&peers[k], nd->name, diff, sizeof diff);
            if (refusal)
                return fail(e, "node '%s' (%s) refused: %s", nd->name, nd->listen, refusal);
            compare(p, node_of[k], self, &peers[k].got, diff, sizeof diff);
            if (diff[0])
                return fail(e, "node '%s' (%s) refused: %s", nd->name, nd->listen, diff);
            if (note) {
                snprintf(line, sizeof line, "node %s joined (%s, %d stage%s, %d/%d)", nd->name,
                         nd->listen, (int)peers[k].got.n_stages,
                         peers[k].got.n_stages == 1 ? "" : "s", (int)joined, (int)n);
                note(note_ud, line);
            }
        }
        if (joined == n)
            break;
        if (mono_ms() >= deadline) {
            char missing[1024] = "";
            for (int32_t k = 0; k < n; k++) {
                if (seen[k])
                    continue;
                // The link's last error says why: nobody listens there, or it speaks another
                // protocol (runtime/msg.h); none when the process is simply not up yet. NNG's
                // TLS dialer reports no failed handshake, so a TLS link that never came up says
                // what to check.
                const char *url = c->nodes[node_of[k]].listen;
                sh_transport_link l;
                bool found = tp && sh_transport_link_get(tp, (uint32_t)node_of[k] + 1, &l) == SH_OK;
                const char *why = found && l.last_error[0] ? l.last_error : NULL;
                // A host that does not resolve (now) is named, whatever the link saw last.
                sh_error re = {0};
                if (sh__transport_resolve(url, &re) == SH_ENOTFOUND)
                    why = re.msg;
                if (!why && found && l.state == SH_LINK_STATE_CONNECTING &&
                    !strncmp(url, "tls+tcp://", 10))
                    why = "never connected: is it running, with a certificate signed by "
                          "cluster.tls_ca?";
                size_t len = strlen(missing);
                snprintf(missing + len, sizeof missing - len, "%s'%s' (%s)%s%s%s", len ? ", " : "",
                         c->nodes[node_of[k]].name, url, why ? " [" : "", why ? why : "",
                         why ? "]" : "");
            }
            return fail(e,
                        "%d of %d worker nodes did not join within %.1f s: %s (is `shoal "
                        "node -c SCRIPT --name NAME` running for each?)",
                        (int)(n - joined), (int)n, timeout_ms / 1000.0, missing);
        }
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

sh_addr sh__cluster_metrics_reporter(const sh_cluster_plan *p, int32_t node)
{
    uint32_t n = 0;
    for (int32_t i = 0; i < p->n_stages; i++)
        n += sh__cluster_rank_on(p, i, node) >= 0;
    // A standby spawns its reporter before any stage (they come with a promotion), a drafter's
    // node before its drafter.
    bool drafter = false;
    for (int32_t k = 0; k < p->n_replicas; k++)
        drafter |= p->rep[k].drafter_node == node;
    return n || p->c->nodes[node].standby || drafter
               ? sh_addr_make((uint32_t)node + 1, SH_CLUSTER_FIRST_STAGE_ACTOR + n)
               : SH_ADDR_NONE;
}

/* The front's metrics collector (SH_CLUSTER_METRICS_ACTOR); every worker node reports to it. */
static int start_metrics(sh_cluster_front *f, sh_runtime *rt, sh_error *e)
{
    const sh_cluster_plan *p = &f->plan;
    sh_node_metrics_peer peers[256];
    int32_t n = 0;
    for (int32_t i = 0; i < p->c->n_nodes && n < 256; i++) {
        sh_addr from = sh__cluster_metrics_reporter(p, i);
        if (i != p->front && from)
            peers[n++] = (sh_node_metrics_peer){p->c->nodes[i].name, from};
    }
    sh_error le = {0};
    sh_addr addr = 0;
    if (sh__node_metrics_create(peers, n, &f->metrics))
        return (fail(e, "metrics: out of memory, or a node name of 64 bytes or more"), 1);
    /* The args live in f: the collector's init runs on the loop thread after this returns
     * (sh_actor_spawn's contract; a local here was read after its frame was reused). */
    f->collector_args = (sh_node_metrics_collector_args){.nm = f->metrics};
    if (sh_actor_spawn(rt, "node_metrics_collector", &f->collector_args, 0, &addr, &le))
        return (fail(e, "spawn: %s", le.msg), 1);
    if (addr != sh_addr_make((uint32_t)p->front + 1, SH_CLUSTER_METRICS_ACTOR))
        return (fail(e, "internal: the metrics collector got address %" PRIu64, (uint64_t)addr), 1);
    return 0;
}

int sh__cluster_front_start(sh_cluster_front *f, const sh_cluster_config *c, const char *script,
                            const sh_llama *const *models, sh_runtime *rt, uint32_t timeout_ms,
                            sh_error *e)
{
    const sh_llama_hparams *hps[SH_CLUSTER_MAX_REPLICAS];
    if (c->n_models > SH_CLUSTER_MAX_REPLICAS)
        return fail(e, "%s: %d models; at most %d are supported", script, (int)c->n_models,
                    SH_CLUSTER_MAX_REPLICAS);
    for (int32_t i = 0; i < c->n_models; i++)
        hps[i] = models[i] ? &models[i]->hp : NULL;
    for (int32_t k = 0; k < c->n_replicas; k++)
        if (!models[c->replicas[k].model])
            return (fail(e, "internal: model %d of replica %d not loaded",
                         (int)c->replicas[k].model, (int)k + 1),
                    1);
    int rc = sh__cluster_plan(c, script, hps, &f->plan, e);
    // Each replica's workers must hold its model's file: its identity goes into the plan. Last
    // to first, so that the front's own identity is the first replica's model's.
    for (int32_t k = f->plan.n_replicas - 1; !rc && k >= 0; k--) {
        int32_t mi = c->replicas[k].model;
        rc = sh__cluster_model_ident(models[mi], c->models[mi].path, &f->self, e);
        f->plan.rep[k].model_size = f->self.model_size;
        f->plan.rep[k].model_hash = f->self.model_hash;
    }
    if (rc)
        return rc;
    const sh_config_node *me = &c->nodes[c->gateway.node];
    snprintf(f->self.node, sizeof f->self.node, "%s", me->name);
    sh__cluster_ident_settings(&f->plan, c->gateway.node, &f->self);
    sh_error le = {0};
    // The collector first: its actor id must not depend on what the transport spawns.
    if ((rc = start_metrics(f, rt, e)) != 0)
        return rc;
    sh_transport_tls tls;
    sh_transport_opts to = {.listen_url = me->listen,
                            .reconnect_max_ms = 250,
                            .tls = sh__cluster_tls(c, c->gateway.node, &tls),
                            .listen_resolve_ms = timeout_ms};
    // A worker's frames act only as the node their connection proved in HELLO (runtime/peers.h):
    // the answers to the join's greetings bind each worker's connection.
    sh__peers_enforce(rt);
    if (sh_transport_create(rt, &to, &f->tp, &le))
        return (fail(e, "node '%s': cannot listen on %s: %s", me->name, me->listen, le.msg),
                le.code == SH_EBUSY || le.code == SH_ENOTFOUND ? 2 : 1);
    rc = sh__cluster_add_peers(&f->plan, c->gateway.node, f->tp, e);
    if (!rc)
        rc = sh__cluster_join(&f->plan, rt, &f->self, f->peers, timeout_ms, &f->key, f->tp, f->note,
                              f->note_ud, e);
    // Every worker answered HELLO, so its link is up; a later change of its connection count
    // means it went away (the watchdog's base_ups).
    for (int32_t i = 0; !rc && i < c->n_nodes && i < 256; i++) {
        sh_transport_link l;
        if (i != c->gateway.node && sh_transport_link_get(f->tp, (uint32_t)i + 1, &l) == SH_OK)
            __atomic_store_n(&f->ups[i], l.state == SH_LINK_STATE_UP ? l.ups : 0, __ATOMIC_RELEASE);
    }
    return rc;
}

/* Greets node once through a fresh hello actor (the join's keeps pointers to its own peers):
 * returns 0 when it answered within timeout_ms (f->rejoin[node] holds the answer), 1 when not,
 * 2 when the actor cannot be spawned (msg says why). */
static int greet(sh_cluster_front *f, sh_runtime *rt, int32_t node, uint32_t timeout_ms, char *msg,
                 size_t cap)
{
    sh_hello_peer *peer = &f->rejoin[node];
    memset(peer, 0, sizeof *peer);
    peer->addr = sh_addr_make((uint32_t)node + 1, SH_CLUSTER_HELLO_ACTOR);
    f->rejoin_args[node] = (sh_hello_args){
        .self = &f->self, .peers = peer, .n_peers = 1, .retry_ms = 200, .key = &f->key};
    sh_error e = {0};
    sh_addr addr;
    if (sh_actor_spawn(rt, "hello", &f->rejoin_args[node], 0, &addr, &e))
        return (snprintf(msg, cap, "node %s: hello: %s", f->plan.c->nodes[node].name, e.msg), 2);
    uint64_t deadline = mono_ms() + timeout_ms;
    while (!atomic_load_explicit(&peer->answered, memory_order_acquire)) {
        if (mono_ms() >= deadline) {
            sh_actor_stop(rt, addr);
            return 1;
        }
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    sh_actor_stop(rt, addr);
    return 0;
}

int sh__cluster_front_promote(sh_cluster_front *f, sh_runtime *rt, sh_addr as, int32_t dead,
                              int32_t sb, uint32_t timeout_ms, const _Atomic int32_t *sb_health,
                              int32_t *moved, int32_t *ranks, int32_t *n_moved, char *msg,
                              size_t cap)
{
    sh_cluster_plan *p = &f->plan;
    const sh_config_node *nd = &p->c->nodes[sb];
    uint64_t stages[SH_CLUSTER_MAX_STAGES];
    int32_t n = 0;
    // Every stage on the dead node, and every rank of a group it held (in plan order: the
    // standby lists them so in HELLO).
    for (int32_t i = 0; i < p->n_stages; i++) {
        int32_t r = sh__cluster_rank_on(p, i, dead);
        if (r >= 0)
            moved[n] = i, ranks[n] = r, stages[n++] = (uint64_t)i | (uint64_t)r << 32;
    }
    if (!n)
        return (snprintf(msg, cap, "node %s holds no stage", p->c->nodes[dead].name), 2);
    // A greeting first: a standby that restarted has not seen this node's connection prove
    // itself yet, and drops anything else that arrives on it (runtime/peers.h). The greeting must
    // reach the process this promotion is for: a standby that died (and maybe came back as a new
    // process, on a new connection) meanwhile fails the promotion as before.
    sh_transport_link l0 = {0}, l1 = {0};
    (void)sh_transport_link_get(f->tp, (uint32_t)sb + 1, &l0);
    int grc = greet(f, rt, sb, timeout_ms < 3000 ? timeout_ms : 3000, msg, cap);
    if (grc == 2)
        return grc;
    (void)sh_transport_link_get(f->tp, (uint32_t)sb + 1, &l1);
    if ((sb_health && atomic_load(sb_health) == 2 /* SH_WATCHDOG_DEAD */) || l1.ups != l0.ups)
        return (snprintf(msg, cap, "standby %s died during its promotion", nd->name), 1);
    sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_PROMOTE, .targets = {stages, (uint32_t)n}};
    sh_error e = {0};
    if (sh__act_send(rt, as, sh_addr_make((uint32_t)sb + 1, SH_CLUSTER_HELLO_ACTOR), SH_MSG_CONTROL,
                     0, &c, &e))
        return (snprintf(msg, cap, "standby %s: %s", nd->name, e.msg), 1);
    // It answers HELLO at once; its stages appear in the answer once they are up.
    uint64_t deadline = mono_ms() + timeout_ms;
    for (;;) {
        if (sb_health && atomic_load(sb_health) == 2 /* SH_WATCHDOG_DEAD */)
            return (snprintf(msg, cap, "standby %s died during its promotion", nd->name), 1);
        uint64_t now = mono_ms();
        if (now >= deadline)
            return (snprintf(msg, cap, "standby %s did not take over within %.1f s", nd->name,
                             timeout_ms / 1000.0),
                    1);
        int rc =
            greet(f, rt, sb, (uint32_t)(deadline - now < 1000 ? deadline - now : 1000), msg, cap);
        if (rc == 2)
            return rc;
        if (rc == 0 && f->rejoin[sb].got.n_stages == n)
            break;
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
    }
    const sh_hello_peer *peer = &f->rejoin[sb];
    // The plan as it will be, checked against what the standby says it serves.
    sh_cluster_plan next = *p;
    for (int32_t k = 0; k < n; k++) {
        next.rank_node[moved[k]][ranks[k]] = sb;
        next.rank_addr[moved[k]][ranks[k]] = peer->got.stages[k];
        if (ranks[k] == 0) {
            next.stage_node[moved[k]] = sb;
            next.stage_addr[moved[k]] = peer->got.stages[k];
        }
    }
    char diff[1024];
    const char *refusal = key_refusal(peer, nd->name, diff, sizeof diff);
    if (!refusal) {
        compare(&next, sb, &f->self, &peer->got, diff, sizeof diff);
        refusal = diff[0] ? diff : NULL;
    }
    if (refusal)
        return (snprintf(msg, cap, "standby %s is refused: %s", nd->name, refusal), 2);
    for (int32_t k = 0; k < n; k++) {
        int32_t i = moved[k], r = ranks[k];
        __atomic_store_n(&p->rank_addr[i][r], next.rank_addr[i][r], __ATOMIC_RELEASE);
        __atomic_store_n(&p->rank_node[i][r], sb, __ATOMIC_RELEASE);
        if (r == 0) {
            __atomic_store_n(&p->stage_node[i], sb, __ATOMIC_RELEASE);
            __atomic_store_n(&p->stage_addr[i], next.stage_addr[i], __ATOMIC_RELEASE);
        }
    }
    *n_moved = n;
    return 0;
}

int sh__cluster_front_regroup(sh_cluster_front *f, sh_runtime *rt, sh_addr as, int32_t i, char *msg,
                              size_t cap)
{
    const sh_cluster_plan *p = &f->plan;
    int32_t tp = p->stage_tp[i];
    if (tp < 2)
        return 0;
    sh_cluster_group g;
    sh_error e = {0};
    if (sh__cluster_group(p, i, &g, &e))
        return (snprintf(msg, cap, "stage %d: %s", (int)i + 1, e.msg), 2);
    uint64_t addrs[SH_CONFIG_MAX_TP + 1];
    char urls[SH_PROTO_MAX_MSG] = "";
    size_t len = 0;
    for (int32_t r = 0; r < tp; r++) {
        addrs[r] = __atomic_load_n(&p->rank_addr[i][r], __ATOMIC_ACQUIRE);
        if (g.kind != SH_COLL_NET)
            continue;
        int w = snprintf(urls + len, sizeof urls - len, "%s%s", r ? "\n" : "", g.urls[r]);
        if (w < 0 || (size_t)w >= sizeof urls - len)
            return (snprintf(msg, cap,
                             "stage %d: its ranks' URLs take more than %d bytes in one message",
                             (int)i + 1, SH_PROTO_MAX_MSG),
                    2);
        len += (size_t)w;
    }
    // The epoch floor: the old group's epochs were chosen before the node died, at most this
    // host's Unix seconds then (group_gen in actors/stage.c, on hosts whose clocks agree), so a
    // leader that forms the group anew takes an epoch none of its ranks joined before.
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    addrs[tp] = (uint64_t)now.tv_sec + 1;
    sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_REGROUP,
                          .targets = {addrs, (uint32_t)tp + 1},
                          .arg = {urls, (uint32_t)len}};
    // The other ranks first, the leader last: the leader's next step reaches the others after
    // they know the group (a rank that forms it with stale links fails the step, which the
    // batcher sends again after its retry deadline).
    int rc = 0;
    for (int32_t r = tp; r-- > 0;) {
        if (sh__act_send(rt, as, (sh_addr)addrs[r], SH_MSG_CONTROL, 0, &c, &e) && !rc)
            rc = (snprintf(msg, cap, "stage %d rank %d: %s", (int)i + 1, (int)r, e.msg), 1);
    }
    return rc;
}

int sh__cluster_front_rejoin(sh_cluster_front *f, sh_runtime *rt, int32_t node, uint32_t timeout_ms,
                             char *msg, size_t cap)
{
    const sh_config_node *nd = &f->plan.c->nodes[node];
    sh_transport_link l;
    if (sh_transport_link_get(f->tp, (uint32_t)node + 1, &l) != SH_OK ||
        l.state != SH_LINK_STATE_UP || l.ups == __atomic_load_n(&f->ups[node], __ATOMIC_ACQUIRE))
        return 1; /* not back yet */
    int rc = greet(f, rt, node, timeout_ms, msg, cap);
    if (rc)
        return rc;
    sh_hello_peer *peer = &f->rejoin[node];
    char diff[1024];
    const char *refusal = key_refusal(peer, nd->name, diff, sizeof diff);
    if (!refusal) {
        compare(&f->plan, node, &f->self, &peer->got, diff, sizeof diff);
        refusal = diff[0] ? diff : NULL;
    }
    if (refusal)
        return (snprintf(msg, cap, "node '%s' (%s) came back but is refused: %s", nd->name,
                         nd->listen, refusal),
                2);
    // Its connection count now, so that a later loss is noticed again.
    if (sh_transport_link_get(f->tp, (uint32_t)node + 1, &l) == SH_OK)
        __atomic_store_n(&f->ups[node], l.ups, __ATOMIC_RELEASE);
    __atomic_store_n(&f->lost[node], false, __ATOMIC_RELEASE); /* the status page reads it */
    return 0;
}

int sh__cluster_group(const sh_cluster_plan *p, int32_t i, sh_cluster_group *g, sh_error *e)
{
    const sh_cluster_config *c = p->c;
    memset(g, 0, sizeof *g);
    int32_t tp = p->stage_tp[i];
    g->kind = group_kind(p, i);
    g->compress = group_compress(p, i);
    // The script's leader's URL is unique among the clusters of this host; the stage, within the
    // cluster. The name stays when a standby took a rank's place (the leader's, too): the new
    // leader replaces the segment as a restarted one does.
    int32_t k = p->stage_replica[i];
    const sh_config_stage *cs = &c->replicas[k].stages[i - p->rep[k].stage0];
    const char *lead = c->nodes[cs->tp > 1 ? cs->ranks[0] : cs->node].listen;
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *q = lead; *q; q++)
        h = (h ^ (uint8_t)*q) * 0x100000001b3ull;
    snprintf(g->shm_name, sizeof g->shm_name, "/shoal-tp-%016" PRIx64 "-%d", h, (int)i + 1);
    bool literal = c->replicas[p->stage_replica[i]].tp_hier;
    for (int32_t r = 0; r < tp; r++) {
        const char *u = c->nodes[p->rank_node[i][r]].listen;
        g->hosts[r] = rank_host(p, i, r, literal);
        g->url_of[r] = g->urls[r];
        if (!strncmp(u, "ipc://", 6) || !strncmp(u, "inproc://", 9)) {
            snprintf(g->urls[r], sizeof g->urls[r], "%s.tp%d", u, (int)i + 1);
            continue;
        }
        const char *colon = strrchr(u, ':');
        long port = colon ? strtol(colon + 1, NULL, 10) + 1000L * (i + 1) : 0;
        if (port <= 0 || port > 65535)
            return fail(e,
                        "node '%s' (%s): the collective link of stage %d would listen on port %ld "
                        "(its port + 1000 x %d): give the node a lower port",
                        c->nodes[p->rank_node[i][r]].name, u, (int)i + 1, port, (int)i + 1);
        snprintf(g->urls[r], sizeof g->urls[r], "%.*s:%ld", (int)(colon - u), u, port);
    }
    int64_t t = 4ll * c->watchdog.heartbeat_ms * c->watchdog.dead_after;
    g->timeout_ms = t < 5000 ? 5000 : t > 600000 ? 600000 : (int32_t)t;
    return 0;
}

bool sh__cluster_spec_rows(const sh_cluster_config *c)
{
    bool any = c->batcher.spec != SH_CONFIG_SPEC_OFF;
    for (int32_t k = 0; k < c->n_replicas; k++)
        any |= c->replicas[k].drafter_node >= 0;
    return any;
}

bool sh__cluster_replica_on(const sh_cluster_plan *p, int32_t k, int32_t node)
{
    const sh_cluster_replica_plan *rp = &p->rep[k];
    for (int32_t i = rp->stage0; i < rp->stage0 + rp->n_stages; i++)
        if (sh__cluster_rank_on(p, i, node) >= 0)
            return true;
    return rp->drafter_node >= 0 && rp->drafter_node == node;
}

void sh__cluster_front_close(sh_cluster_front *f)
{
    if (f->tp)
        sh_transport_close(f->tp);
}

void sh__cluster_front_destroy(sh_cluster_front *f)
{
    sh__node_metrics_destroy(f->metrics);
    f->metrics = NULL;
    sh_transport_destroy(f->tp);
    f->tp = NULL;
}
