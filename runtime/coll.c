/* The collectives' front: argument checks, sequence numbers, the broken state and the counters,
 * in front of the shared-memory, network and two-level transports. */
#include "runtime/coll.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "runtime/coll_int.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

const char *sh__coll_op_name(uint32_t op)
{
    switch (op) {
    case 0:
        return "no call";
    case SH__COLL_OP_ALLREDUCE:
        return "all-reduce";
    case SH__COLL_OP_ALLGATHER:
        return "all-gather";
    case SH__COLL_OP_BROADCAST:
        return "broadcast";
    default:
        return "an unknown collective";
    }
}

sh_err sh_coll_create(sh_coll_kind kind, const sh_coll_opts *o, sh_coll **out, sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "coll: out is NULL");
    *out = NULL;
    if (!o)
        return sh__error_set(e, SH_EINVAL, "coll: options are NULL");
    if (o->size < 1 || o->size > SH_COLL_MAX_RANKS)
        return sh__error_set(e, SH_EINVAL, "coll: group size %d outside 1..%d", (int)o->size,
                             SH_COLL_MAX_RANKS);
    if (o->rank < 0 || o->rank >= o->size)
        return sh__error_set(e, SH_EINVAL, "coll: rank %d outside 0..%d", (int)o->rank,
                             (int)o->size - 1);
    if (o->max_bytes == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes is 0");
    if (kind != SH_COLL_SHM && kind != SH_COLL_NET && kind != SH_COLL_HIER)
        return sh__error_set(e, SH_EINVAL, "coll: unknown transport kind %d", (int)kind);
    sh_coll *c = calloc(1, sizeof *c);
    if (!c)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    c->rank = o->rank;
    c->size = o->size;
    c->epoch = o->epoch;
    c->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 5000;
    c->max_bytes = o->max_bytes;
    sh_err rc = kind == SH_COLL_SHM   ? sh__coll_shm_create(c, o, e)
                : kind == SH_COLL_NET ? sh__coll_net_create(c, o, e)
                                      : sh__coll_hier_create(c, o, e);
    if (rc) {
        free(c);
        return rc;
    }
    *out = c;
    return SH_OK;
}

void sh_coll_destroy(sh_coll *c)
{
    if (!c)
        return;
    if (c->ops && c->ops->destroy)
        c->ops->destroy(c);
    free(c);
}

int32_t sh_coll_rank(const sh_coll *c) { return c->rank; }

int32_t sh_coll_size(const sh_coll *c) { return c->size; }

/* Starts a call: refuses it when the group is broken or the size is out of bounds, and numbers
 * it. */
static sh_err begin(sh_coll *c, size_t bytes, const char *what, sh_error *e)
{
    if (c->broken)
        return sh__error_set(e, c->broken, "coll: %s: the group is broken: %s", what,
                             c->broken_msg);
    if (bytes > c->max_bytes)
        return sh__error_set(e, SH_EINVAL,
                             "coll: %s of %zu bytes exceeds the group's max_bytes %zu", what, bytes,
                             c->max_bytes);
    c->seq++;
    return SH_OK;
}

/* Ends a call: counts it, and breaks the group on failure. */
static sh_err end(sh_coll *c, sh_err rc, size_t bytes, uint64_t t0, sh_error *e)
{
    atomic_fetch_add_explicit(&c->wait_ns, now_ns() - t0, memory_order_relaxed);
    if (rc) {
        c->broken = rc;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", e->msg);
        atomic_fetch_add_explicit(&c->failures, 1, memory_order_relaxed);
        return rc;
    }
    atomic_fetch_add_explicit(&c->calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->bytes, bytes, memory_order_relaxed);
    return SH_OK;
}

sh_err sh_coll_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e)
{
    sh_error local;
    if (!e)
        e = &local; /* end() keeps the text of a failure */
    sh_err rc = begin(c, n * sizeof(float), "all-reduce", e);
    if (rc || c->size == 1 || n == 0)
        return rc;
    uint64_t t0 = now_ns();
    return end(c, c->ops->allreduce(c, buf, n, e), n * sizeof(float), t0, e);
}

sh_err sh_coll_allgather(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e)
{
    sh_error local;
    if (!e)
        e = &local; /* end() keeps the text of a failure */
    sh_err rc = begin(c, bytes * (size_t)c->size, "all-gather", e);
    if (rc || bytes == 0)
        return rc;
    if (c->size == 1) {
        memmove(out, in, bytes);
        return SH_OK;
    }
    uint64_t t0 = now_ns();
    return end(c, c->ops->allgather(c, in, bytes, out, e), bytes, t0, e);
}

sh_err sh_coll_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e)
{
    sh_error local;
    if (!e)
        e = &local; /* end() keeps the text of a failure */
    if (root < 0 || root >= c->size)
        return sh__error_set(e, SH_EINVAL, "coll: broadcast root %d outside 0..%d", (int)root,
                             (int)c->size - 1);
    sh_err rc = begin(c, bytes, "broadcast", e);
    if (rc || c->size == 1 || bytes == 0)
        return rc;
    uint64_t t0 = now_ns();
    return end(c, c->ops->broadcast(c, buf, bytes, root, e), bytes, t0, e);
}

sh_err sh_coll_allreduce_ud(void *ud, float *buf, size_t n, sh_error *e)
{
    return sh_coll_allreduce(ud, buf, n, e);
}

sh_err sh_coll_allgather_ud(void *ud, const void *in, size_t bytes, void *out, sh_error *e)
{
    return sh_coll_allgather(ud, in, bytes, out, e);
}

void sh_coll_stats_get(const sh_coll *c, sh_coll_stats *s)
{
    sh_coll *m = (sh_coll *)c;
    s->calls = atomic_load_explicit(&m->calls, memory_order_relaxed);
    s->failures = atomic_load_explicit(&m->failures, memory_order_relaxed);
    s->bytes = atomic_load_explicit(&m->bytes, memory_order_relaxed);
    s->bytes_wire = atomic_load_explicit(&m->bytes_wire, memory_order_relaxed);
    s->wait_ns = atomic_load_explicit(&m->wait_ns, memory_order_relaxed);
}
