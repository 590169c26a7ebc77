/* The actor registry: actor id to a refcounted actor reference, safe from any thread. */
#ifndef SH_RUNTIME_REGISTRY_H
#define SH_RUNTIME_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "shoal/err.h"

struct sh_actor_ctx;
struct sh_runtime;

/* Sharded by actor id (ids are sequential, so shards fill evenly) so that senders on different
 * loops rarely meet on one mutex; each shard is a chained hash through the actor's reg_next.
 * The registry holds one reference on every actor in it. */
#define SH__REGISTRY_SHARDS 16

typedef struct sh__registry_shard {
    uv_mutex_t mu;
    struct sh_actor_ctx **buckets;
    uint32_t cap, n;
    char pad_[24];
} sh__registry_shard;

typedef struct sh__registry {
    struct sh_runtime *rt;
    sh__registry_shard shards[SH__REGISTRY_SHARDS];
    uint32_t n_init; /* shards whose mutex was initialised */
} sh__registry;

/* Returns SH_ENOMEM or SH_EIO (mutex); on failure nothing is left to free. */
sh_err sh__registry_init(sh__registry *r, struct sh_runtime *rt);

/* Frees the tables (the registry must be empty). */
void sh__registry_fini(sh__registry *r);

/* Adds a (takes one reference for the registry). Returns SH_ENOMEM. Any thread. */
sh_err sh__registry_insert(sh__registry *r, struct sh_actor_ctx *a);

/* The actor with id `id`, with a new reference the caller releases (sh__actor_release), or
 * NULL. Any thread. */
struct sh_actor_ctx *sh__registry_lookup(sh__registry *r, uint32_t id);

/* Removes actor `id` and returns it with the registry's reference (now the caller's), or NULL
 * when it is not there. Any thread. */
struct sh_actor_ctx *sh__registry_remove(sh__registry *r, uint32_t id);

/* Every actor in the registry, each with a new reference, in a runtime allocation the caller
 * frees (sh__rt_free). Returns SH_ENOMEM. Any thread. */
sh_err sh__registry_snapshot(sh__registry *r, struct sh_actor_ctx ***out, size_t *n);

#endif
