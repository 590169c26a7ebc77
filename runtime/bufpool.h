/* A small pool of large frame buffers kept for reuse by the NNG links and the stream engine. */
#ifndef SH_RUNTIME_BUFPOOL_H
#define SH_RUNTIME_BUFPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/runtime.h"

/* What a pool keeps: an opaque buffer handle (an nng_msg, or a raw block of transport_ipc.c)
 * with a capacity. `cap` and `free` are called with the pool's lock held or after it is gone;
 * neither may call back into the pool. */
typedef struct sh__bufpool_ops {
    size_t (*cap)(void *handle);
    void (*free)(void *handle);
} sh__bufpool_ops;

/* Buffers of RECYCLE_MIN bytes and more that the runtime (or a link) is done with are kept, up
 * to max_bytes and max_n buffers, and handed out again for the next large frame: a node that
 * moves activations then neither allocates nor page-faults fresh memory per frame. Reference
 * counted: the creator holds one reference and every buffer lent out through an owner one more,
 * so a release after the creator closed the pool is still safe. */
typedef struct sh__bufpool sh__bufpool;

#define SH__BUFPOOL_MIN ((size_t)64 << 10)

/* A pool keeping at most max_n buffers and max_bytes bytes (0 buffers: keep none). NULL when out
 * of memory. The caller holds the first reference. */
sh__bufpool *sh__bufpool_create(const sh__bufpool_ops *ops, uint32_t max_n, uint64_t max_bytes);

/* Drops a reference; the last frees every kept buffer and the pool. Any thread. */
void sh__bufpool_unref(sh__bufpool *pl);

/* The smallest kept buffer of at least len bytes, taken out of the pool, or NULL (len below
 * SH__BUFPOOL_MIN, nothing fits, or closed). Any thread. */
void *sh__bufpool_take(sh__bufpool *pl, size_t len);

/* Keeps `handle` for reuse, or frees it through ops->free (too small, pool full or closed).
 * Does not touch references. Any thread. */
void sh__bufpool_put(sh__bufpool *pl, void *handle);

/* An owner for `handle` whose release puts it back (sh__bufpool_put) and drops the reference it
 * takes now. Any thread. */
sh_frame_owner sh__bufpool_owner(sh__bufpool *pl, void *handle);

/* As sh__bufpool_owner(), and the buffer's capacity counts in sh__bufpool_held() until it is
 * released: for received frames, so a reader can tell how much the runtime still holds. */
sh_frame_owner sh__bufpool_owner_counted(sh__bufpool *pl, void *handle);

/* The capacity of the buffers lent through counted owners and not released yet. Any thread. */
uint64_t sh__bufpool_held(sh__bufpool *pl);

/* True when `owner` came from sh__bufpool_owner() or sh__bufpool_owner_counted() on pl. */
bool sh__bufpool_owns(const sh__bufpool *pl, const sh_frame_owner *owner);

/* Frees the kept buffers and keeps none from now on (buffers still lent out are freed when they
 * come back). Idempotent. Any thread. */
void sh__bufpool_close(sh__bufpool *pl);

#endif
