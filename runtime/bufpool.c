/* The transports' pool of large frame buffers (see bufpool.h). */
#include <stdatomic.h>
#include <stdlib.h>

#include <uv.h>

#include "runtime/bufpool.h"

struct sh__bufpool {
    _Atomic uint32_t refs;
    sh__bufpool_ops ops;
    uv_mutex_t mu;
    bool closed;
    void **bufs; /* (max_n) */
    uint32_t n, max_n;
    uint64_t bytes, max_bytes;
    _Atomic uint64_t held; /* capacity of the buffers lent through counted owners */
};

sh__bufpool *sh__bufpool_create(const sh__bufpool_ops *ops, uint32_t max_n, uint64_t max_bytes)
{
    sh__bufpool *pl = calloc(1, sizeof *pl);
    if (!pl)
        return NULL;
    if (max_n && (pl->bufs = calloc(max_n, sizeof *pl->bufs)) == NULL) {
        free(pl);
        return NULL;
    }
    atomic_init(&pl->refs, 1);
    pl->ops = *ops;
    pl->max_n = max_n;
    pl->max_bytes = max_bytes;
    uv_mutex_init(&pl->mu);
    return pl;
}

void sh__bufpool_unref(sh__bufpool *pl)
{
    if (!pl || atomic_fetch_sub_explicit(&pl->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (uint32_t i = 0; i < pl->n; i++)
        pl->ops.free(pl->bufs[i]);
    free(pl->bufs);
    uv_mutex_destroy(&pl->mu);
    free(pl);
}

void *sh__bufpool_take(sh__bufpool *pl, size_t len)
{
    if (len < SH__BUFPOOL_MIN)
        return NULL;
    void *h = NULL;
    uv_mutex_lock(&pl->mu);
    uint32_t best = pl->n;
    size_t best_cap = 0;
    for (uint32_t i = 0; i < pl->n; i++) {
        size_t c = pl->ops.cap(pl->bufs[i]);
        if (c >= len && (best == pl->n || c < best_cap)) {
            best = i;
            best_cap = c;
        }
    }
    if (best < pl->n) {
        h = pl->bufs[best];
        pl->bufs[best] = pl->bufs[--pl->n];
        pl->bytes -= best_cap;
    }
    uv_mutex_unlock(&pl->mu);
    return h;
}

void sh__bufpool_put(sh__bufpool *pl, void *handle)
{
    size_t cap = pl->ops.cap(handle);
    if (cap >= SH__BUFPOOL_MIN) {
        uv_mutex_lock(&pl->mu);
        if (!pl->closed && pl->n < pl->max_n && pl->bytes + cap <= pl->max_bytes) {
            pl->bufs[pl->n++] = handle;
            pl->bytes += cap;
            handle = NULL;
        }
        uv_mutex_unlock(&pl->mu);
    }
    if (handle)
        pl->ops.free(handle);
}

static void owner_release(void *ctx, void *handle)
{
    sh__bufpool *pl = ctx;
    sh__bufpool_put(pl, handle);
    sh__bufpool_unref(pl);
}

sh_frame_owner sh__bufpool_owner(sh__bufpool *pl, void *handle)
{
    atomic_fetch_add_explicit(&pl->refs, 1, memory_order_relaxed);
    return (sh_frame_owner){.release = owner_release, .ctx = pl, .handle = handle};
}

static void counted_release(void *ctx, void *handle)
{
    sh__bufpool *pl = ctx;
    atomic_fetch_sub_explicit(&pl->held, pl->ops.cap(handle), memory_order_relaxed);
    owner_release(ctx, handle);
}

sh_frame_owner sh__bufpool_owner_counted(sh__bufpool *pl, void *handle)
{
    atomic_fetch_add_explicit(&pl->refs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pl->held, pl->ops.cap(handle), memory_order_relaxed);
    return (sh_frame_owner){.release = counted_release, .ctx = pl, .handle = handle};
}

uint64_t sh__bufpool_held(sh__bufpool *pl)
{
    return atomic_load_explicit(&pl->held, memory_order_relaxed);
}

bool sh__bufpool_owns(const sh__bufpool *pl, const sh_frame_owner *owner)
{
    return (owner->release == owner_release || owner->release == counted_release) &&
           owner->ctx == pl;
}

void sh__bufpool_close(sh__bufpool *pl)
{
    uv_mutex_lock(&pl->mu);
    pl->closed = true;
    for (uint32_t i = 0; i < pl->n; i++)
        pl->ops.free(pl->bufs[i]);
    pl->n = 0;
    pl->bytes = 0;
    uv_mutex_unlock(&pl->mu);
}
