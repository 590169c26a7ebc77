/* SH_COLL_HIER: the two-level collectives of a group spanning hosts with several ranks each: one
 * shared-memory group per host and one network group of the hosts' leaders (runtime/coll.h).
 *
 * Layout. Hosts are numbered in the order their first rank appears (rank 0's host is host 0);
 * a host's ranks, in rank order, are its local ranks 0, 1, ...; local rank 0 is the host's leader.
 * The network group's rank h is host h's leader, listening on urls[leader]; host h's segment is
 * named shm_name + "-h<h>" (hosts that are one machine in a test then use distinct segments). A
 * host with one rank has no shared-memory group; a group on one host has no network group.
 *
 * Calls. all-reduce: the host's sum by the shared-memory all-reduce (summed in local rank order),
 * the leaders' all-reduce of those sums over the network (one-shot or ring by size, compressed as
 * asked), then the leader's result broadcast to its host: every rank ends with its leader's bits,
 * and every leader with the same bits (the network all-reduce's guarantee), so every rank holds
 * the same bits. all-gather: the host's blocks gathered in the shared-memory group, the leaders'
 * all-gather of their hosts' blocks (padded to the largest host), reordered into rank order and
 * broadcast to the host. broadcast: through the root's host, then among the leaders, then within
 * every other host. Every rank of a host makes the same calls on its shared-memory group and
 * every leader the same on the network group, so their sequence, op and size checks (and the
 * epoch, which the inner groups share) hold as they do for a flat group.
 *
 * Failures. A call that fails on an inner group destroys both inner groups at once, so that a
 * peer waiting on this rank in either sees it leave within milliseconds (shared memory) or about
 * 100 ms (network) rather than at its timeout: a dead non-leader fails its host's ranks, whose
 * leader then leaves the network group, whose other leaders then leave their hosts' groups. The
 * handle is broken after that (coll.c), as for a flat group.
 *
 * Create. Every rank joins its host's group, and the leaders then the network group; the leader
 * tells its host how that went by a broadcast of a small status (code and text), so a rank
 * returns from create only when the whole group has formed, or with the leader's error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "runtime/coll_int.h"

/* What a leader broadcasts to its host at the end of create. */
typedef struct status {
    int32_t rc;
    char msg[252];
} status;

typedef struct hier {
    sh_coll *local;         /* this host's ranks (NULL when this rank is alone on its host) */
    sh_coll *net;           /* the hosts' leaders (NULL on a non-leader or with one host) */
    int32_t n_hosts, host;  /* the number of hosts, this rank's host */
    int32_t local_rank;     /* this rank's index on its host */
    int32_t max_local;      /* the most ranks on one host */
    int32_t *host_of;       /* (size) each rank's host */
    int32_t *local_of;      /* (size) each rank's local rank */
    int32_t *leader_of;     /* (n_hosts) each host's leader, a global rank */
    int32_t *host_size;     /* (n_hosts) each host's number of ranks */
    unsigned char *gather;  /* leader: (2 * n_hosts * max_local * max_bytes / size) */
    sh_coll_fault_fn fault; /* the caller's hook, asked with global ranks */
    void *fault_ud;
} hier;

static sh_coll_fault fault_map(void *ud, int32_t peer)
{
    hier *h = ud;
    return h->fault(h->fault_ud, h->leader_of[peer]);
}

static void inner_destroy(hier *h)
{
    sh_coll_destroy(h->net);
    h->net = NULL;
    sh_coll_destroy(h->local);
    h->local = NULL;
}

/* Ends a step: on failure names the level and leaves both inner groups; on success copies the
 * network group's wire counter. */
static sh_err step(sh_coll *c, bool across, sh_err rc, sh_error *e)
{
    hier *h = c->impl;
    if (h->net) {
        sh_coll_stats s;
        sh_coll_stats_get(h->net, &s);
        atomic_store_explicit(&c->bytes_wire, s.bytes_wire, memory_order_relaxed);
    }
    if (!rc)
        return SH_OK;
    char inner[sizeof e->msg];
    snprintf(inner, sizeof inner, "%s", e->msg);
    if (across) {
        sh__error_set(e, rc,
                      "coll: rank %d (leader of host %d): among the hosts' leaders (their rank k "
                      "is host k's leader): %s",
                      (int)c->rank, (int)h->host, inner);
    } else {
        char ranks[96] = "";
        size_t len = 0;
        for (int32_t r = 0; r < c->size && len + 16 < sizeof ranks; r++)
            if (h->host_of[r] == h->host)
                len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%d", len ? ", " : "",
                                        (int)r);
        sh__error_set(e, rc,
                      "coll: rank %d (host %d, local rank %d): within the host (its local ranks "
                      "are ranks %s): %s",
                      (int)c->rank, (int)h->host, (int)h->local_rank, ranks, inner);
    }
    inner_destroy(h);
    return rc;
}

/* The inner groups are gone after a failure; coll.c refuses calls on a broken group first. */
static sh_err hier_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e)
{
    hier *h = c->impl;
    if (h->local) {
        sh_err rc = step(c, false, sh_coll_allreduce(h->local, buf, n, e), e);
        if (rc)
            return rc;
    }
    if (h->net) {
        sh_err rc = step(c, true, sh_coll_allreduce(h->net, buf, n, e), e);
        if (rc)
            return rc;
    }
    if (h->local && h->n_hosts > 1)
        return step(c, false, sh_coll_broadcast(h->local, buf, n * sizeof *buf, 0, e), e);
    return SH_OK;
}

static sh_err hier_allgather(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e)
{
    hier *h = c->impl;
    unsigned char *o = out;
    /* out (size * bytes) first holds this host's blocks in local order. */
    if (h->local) {
        sh_err rc = step(c, false, sh_coll_allgather(h->local, in, bytes, out, e), e);
        if (rc)
            return rc;
    } else {
        memmove(out, in, bytes);
    }
    if (h->n_hosts == 1)
        return SH_OK; /* local order is rank order */
    if (h->net) {
        size_t part = (size_t)h->max_local * bytes;
        unsigned char *mine = h->gather, *all = h->gather + part;
        memcpy(mine, out, (size_t)h->host_size[h->host] * bytes);
        memset(mine + (size_t)h->host_size[h->host] * bytes, 0,
               part - (size_t)h->host_size[h->host] * bytes);
        sh_err rc = step(c, true, sh_coll_allgather(h->net, mine, part, all, e), e);
        if (rc)
            return rc;
        for (int32_t r = 0; r < c->size; r++)
            memcpy(o + (size_t)r * bytes,
                   all + ((size_t)h->host_of[r] * (size_t)h->max_local + (size_t)h->local_of[r]) *
                             bytes,
                   bytes);
    }
    if (h->local)
        return step(c, false, sh_coll_broadcast(h->local, out, (size_t)c->size * bytes, 0, e), e);
    return SH_OK;
}

static sh_err hier_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e)
{
    hier *h = c->impl;
    int32_t rh = h->host_of[root];
    if (h->host == rh && h->local) {
        sh_err rc =
            step(c, false, sh_coll_broadcast(h->local, buf, bytes, h->local_of[root], e), e);
        if (rc)
            return rc;
    }
    if (h->net) {
        sh_err rc = step(c, true, sh_coll_broadcast(h->net, buf, bytes, rh, e), e);
        if (rc)
            return rc;
    }
    if (h->host != rh && h->local)
        return step(c, false, sh_coll_broadcast(h->local, buf, bytes, 0, e), e);
    return SH_OK;
}

static void hier_free(hier *h)
{
    if (!h)
        return;
    inner_destroy(h);
    free(h->host_of);
    free(h->local_of);
    free(h->leader_of);
    free(h->host_size);
    free(h->gather);
    free(h);
}

static void hier_destroy(sh_coll *c)
{
    hier_free(c->impl);
    c->impl = NULL;
}

static const sh__coll_ops hier_ops = {
    .allreduce = hier_allreduce,
    .allgather = hier_allgather,
    .broadcast = hier_broadcast,
    .destroy = hier_destroy,
};

/* Numbers the hosts and the local ranks from o->hosts. */
static sh_err layout(hier *h, const sh_coll *c, const sh_coll_opts *o, sh_error *e)
{
    int32_t n = c->size;
    h->host_of = calloc((size_t)n, sizeof *h->host_of);
    h->local_of = calloc((size_t)n, sizeof *h->local_of);
    h->leader_of = calloc((size_t)n, sizeof *h->leader_of);
    h->host_size = calloc((size_t)n, sizeof *h->host_size);
    if (!h->host_of || !h->local_of || !h->leader_of || !h->host_size)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    for (int32_t r = 0; r < n; r++) {
        int32_t k = 0;
        while (k < h->n_hosts && o->hosts[h->leader_of[k]] != o->hosts[r])
            k++;
        if (k == h->n_hosts)
            h->leader_of[h->n_hosts++] = r;
        h->host_of[r] = k;
        h->local_of[r] = h->host_size[k]++;
        if (h->host_size[k] > h->max_local)
            h->max_local = h->host_size[k];
    }
    h->host = h->host_of[c->rank];
    h->local_rank = h->local_of[c->rank];
    return SH_OK;
}

/* The local group's ranks are the host's ranks; the network group's the hosts' leaders. */
static sh_err join_local(sh_coll *c, hier *h, const sh_coll_opts *o, sh_error *e)
{
    char name[256];
    int len = snprintf(name, sizeof name, "%s-h%d", o->shm_name, (int)h->host);
    if (len < 0 || (size_t)len >= sizeof name)
        return sh__error_set(e, SH_EINVAL, "coll: shm_name \"%s\" is too long", o->shm_name);
    size_t st = sizeof(status);
    sh_coll_opts lo = {.rank = h->local_rank,
                       .size = h->host_size[h->host],
                       .epoch = c->epoch,
                       .timeout_ms = c->timeout_ms,
                       .max_bytes = c->max_bytes > st ? c->max_bytes : st,
                       .shm_name = name};
    sh_err rc = sh_coll_create(SH_COLL_SHM, &lo, &h->local, e);
    if (rc)
        return step(c, false, rc, e);
    return SH_OK;
}

static sh_err join_net(sh_coll *c, hier *h, const sh_coll_opts *o, sh_error *e)
{
    const char **urls = calloc((size_t)h->n_hosts, sizeof *urls);
    if (!urls)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    for (int32_t k = 0; k < h->n_hosts; k++)
        urls[k] = o->urls[h->leader_of[k]];
    /* The leaders' all-gather passes every host's blocks padded to the largest host. */
    size_t per = (c->max_bytes + (size_t)c->size - 1) / (size_t)c->size;
    size_t part = (size_t)h->max_local * per, all = part * (size_t)h->n_hosts;
    h->gather = malloc(part + all);
    if (!h->gather) {
        free(urls);
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    }
    h->fault = o->fault;
    h->fault_ud = o->fault_ud;
    sh_coll_opts no = {.rank = h->host,
                       .size = h->n_hosts,
                       .epoch = c->epoch,
                       .timeout_ms = c->timeout_ms,
                       .max_bytes = all > c->max_bytes ? all : c->max_bytes,
                       .urls = urls,
                       .compress = o->compress,
                       .key = o->key,
                       .key_len = o->key_len,
                       .tls = o->tls,
                       .fault = o->fault ? fault_map : NULL,
                       .fault_ud = h};
    sh_err rc = sh_coll_create(SH_COLL_NET, &no, &h->net, e);
    free(urls);
    if (rc) {
        char inner[sizeof e->msg];
        snprintf(inner, sizeof inner, "%s", e->msg);
        sh__error_set(e, rc,
                      "coll: rank %d (leader of host %d): joining the hosts' leaders (their rank k "
                      "is host k's leader): %s",
                      (int)c->rank, (int)h->host, inner);
    }
    return rc;
}

sh_err sh__coll_hier_create(sh_coll *c, const sh_coll_opts *o, sh_error *e)
{
    sh_error local;
    if (!e)
        e = &local; /* the inner groups' text is read back to name the level */
    if (!o->hosts)
        return sh__error_set(e, SH_EINVAL, "coll: the hierarchical transport needs hosts");
    if (!o->shm_name || o->inproc)
        return sh__error_set(e, SH_EINVAL,
                             "coll: the hierarchical transport needs shm_name (and no inproc)");
    if (!o->urls)
        return sh__error_set(e, SH_EINVAL, "coll: the hierarchical transport needs urls");
    hier *h = calloc(1, sizeof *h);
    if (!h)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    c->impl = h;
    c->ops = &hier_ops;
    sh_err rc = layout(h, c, o, e);
    if (!rc && h->host_size[h->host] > 1)
        rc = join_local(c, h, o, e);
    if (!rc && h->local_rank == 0 && h->n_hosts > 1)
        rc = join_net(c, h, o, e);
    /* A leader that failed above tells its host (whose ranks wait in the broadcast below); a
     * rank whose host group failed to form has nobody to tell. */
    if (h->local && h->n_hosts > 1) {
        status s = {.rc = rc};
        if (rc) /* the text's head: the network's part may be cut */
            memcpy(s.msg, e->msg, sizeof s.msg - 1);
        sh_error be = {0};
        sh_err brc = sh_coll_broadcast(h->local, &s, sizeof s, 0, &be);
        if (!rc && brc)
            rc = sh__error_set(e, brc, "coll: rank %d: waiting for host %d's leader (rank %d): %s",
                               (int)c->rank, (int)h->host, (int)h->leader_of[h->host], be.msg);
        else if (!rc && s.rc)
            rc = sh__error_set(e, s.rc, "coll: rank %d: host %d's leader (rank %d) failed: %s",
                               (int)c->rank, (int)h->host, (int)h->leader_of[h->host], s.msg);
    }
    if (rc) {
        hier_free(h);
        c->impl = NULL;
        c->ops = NULL;
        return rc;
    }
    return SH_OK;
}
