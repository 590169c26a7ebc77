/* The actor registry: a sharded, mutex-protected hash from actor id to refcounted actor. */
#include "runtime/registry.h"

#include "runtime/internal.h"

/* Ids are dense and sequential: the shard is id % SHARDS and the bucket (id / SHARDS) % cap, so
 * consecutive actors spread evenly without a hash function. */
static sh__registry_shard *shard_of(sh__registry *r, uint32_t id)
{
    return &r->shards[id % SH__REGISTRY_SHARDS];
}

static uint32_t bucket_of(const sh__registry_shard *s, uint32_t id)
{
    return (id / SH__REGISTRY_SHARDS) & (s->cap - 1);
}

sh_err sh__registry_init(sh__registry *r, sh_runtime *rt)
{
    r->rt = rt;
    for (uint32_t i = 0; i < SH__REGISTRY_SHARDS; i++) {
        sh__registry_shard *s = &r->shards[i];
        if (uv_mutex_init(&s->mu) != 0) {
            sh__registry_fini(r);
            return SH_EIO;
        }
        r->n_init++;
        s->cap = 16;
        s->buckets = sh__rt_alloc(rt, s->cap * sizeof *s->buckets);
        if (!s->buckets) {
            sh__registry_fini(r);
            return SH_ENOMEM;
        }
    }
    return SH_OK;
}

void sh__registry_fini(sh__registry *r)
{
    for (uint32_t i = 0; i < r->n_init; i++) {
        sh__rt_free(r->rt, r->shards[i].buckets);
        r->shards[i].buckets = NULL;
        uv_mutex_destroy(&r->shards[i].mu);
    }
    r->n_init = 0;
}

/* Doubles the bucket array when the load passes 1; keeps the old one when out of memory
 * (chains just get longer). Under the shard lock. */
static void grow(sh__registry *r, sh__registry_shard *s)
{
    uint32_t ncap = s->cap * 2;
    sh_actor_ctx **nb = sh__rt_alloc(r->rt, ncap * sizeof *nb);
    if (!nb)
        return;
    uint32_t ocap = s->cap;
    sh_actor_ctx **ob = s->buckets;
    s->cap = ncap;
    s->buckets = nb;
    for (uint32_t i = 0; i < ocap; i++) {
        for (sh_actor_ctx *a = ob[i]; a;) {
            sh_actor_ctx *next = a->reg_next;
            uint32_t b = bucket_of(s, a->id);
            a->reg_next = nb[b];
            nb[b] = a;
            a = next;
        }
    }
    sh__rt_free(r->rt, ob);
}

sh_err sh__registry_insert(sh__registry *r, sh_actor_ctx *a)
{
    sh__registry_shard *s = shard_of(r, a->id);
    sh__actor_retain(a);
    uv_mutex_lock(&s->mu);
    if (s->n >= s->cap)
        grow(r, s);
    uint32_t b = bucket_of(s, a->id);
    a->reg_next = s->buckets[b];
    s->buckets[b] = a;
    s->n++;
    uv_mutex_unlock(&s->mu);
    return SH_OK;
}

sh_actor_ctx *sh__registry_lookup(sh__registry *r, uint32_t id)
{
    sh__registry_shard *s = shard_of(r, id);
    uv_mutex_lock(&s->mu);
    sh_actor_ctx *a = s->buckets[bucket_of(s, id)];
    while (a && a->id != id)
        a = a->reg_next;
    if (a)
        sh__actor_retain(a);
    uv_mutex_unlock(&s->mu);
    return a;
}

sh_actor_ctx *sh__registry_remove(sh__registry *r, uint32_t id)
{
    sh__registry_shard *s = shard_of(r, id);
    uv_mutex_lock(&s->mu);
    sh_actor_ctx **pp = &s->buckets[bucket_of(s, id)];
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->reg_next;
    sh_actor_ctx *a = *pp;
    if (a) {
        *pp = a->reg_next;
        a->reg_next = NULL;
        s->n--;
    }
    uv_mutex_unlock(&s->mu);
    return a;
}

sh_err sh__registry_snapshot(sh__registry *r, sh_actor_ctx ***out, size_t *n)
{
    size_t cap = 64, k = 0;
    sh_actor_ctx **v = sh__rt_alloc(r->rt, cap * sizeof *v);
    if (!v)
        return SH_ENOMEM;
    for (uint32_t i = 0; i < r->n_init; i++) {
        sh__registry_shard *s = &r->shards[i];
        uv_mutex_lock(&s->mu);
        if (k + s->n > cap) {
            size_t ncap = (k + s->n) * 2;
            sh_actor_ctx **nv = sh__rt_realloc(r->rt, v, ncap * sizeof *nv);
            if (!nv) {
                uv_mutex_unlock(&s->mu);
                for (size_t j = 0; j < k; j++)
                    sh__actor_release(v[j]);
                sh__rt_free(r->rt, v);
                return SH_ENOMEM;
            }
            v = nv;
            cap = ncap;
        }
        for (uint32_t b = 0; b < s->cap; b++) {
            for (sh_actor_ctx *a = s->buckets[b]; a; a = a->reg_next) {
                sh__actor_retain(a);
                v[k++] = a;
            }
        }
        uv_mutex_unlock(&s->mu);
    }
    *out = v;
    *n = k;
    return SH_OK;
}
