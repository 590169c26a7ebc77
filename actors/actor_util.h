/* Small helpers the serving actors share: typed decode of a message body into a preallocated
 * arena, typed sends from an actor or from a worker thread, and a worker thread with its queue
 * of kept messages. */
#ifndef SH_ACTORS_ACTOR_UTIL_H
#define SH_ACTORS_ACTOR_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "runtime/msg.h"
#include "runtime/proto.h"
#include "shoal/runtime.h"

/* A decoder an actor keeps in its state: codec statistics and an arena allocated once, so that
 * decoding a message never allocates. */
typedef struct sh_act_decoder {
    sh_msg_codec codec;
    sh_proto_arena arena;
    void *mem;
} sh_act_decoder;

/* Allocates an arena of arena_bytes (bodies whose lists need more are refused with SH_ERANGE).
 * Returns SH_OK or SH_ENOMEM. */
sh_err sh__act_decoder_init(sh_act_decoder *d, size_t arena_bytes);
void sh__act_decoder_fini(sh_act_decoder *d);

/* Decodes m's body by its envelope type into *out (views into m and the arena, valid until the
 * next decode with d or until m is freed). Returns SH_OK, or the decoder's error with e filled. */
sh_err sh__act_decode(sh_act_decoder *d, const sh_msg *m, sh_proto_body *out, sh_error *e);

/* Sends a typed body (the sh_proto_<type> struct of `type`) from actor address src to dst, with
 * trace_id. Any thread (a worker thread sends as its actor). Returns as sh_send_with(). */
sh_err sh__act_send(sh_runtime *rt, sh_addr src, sh_addr dst, uint32_t type, uint64_t trace_id,
                    const void *body, sh_error *e);

/* An actor's worker thread and the messages its loop thread keeps for it (the stage's steps, the
 * drafter's): a ring guarded by mu, grown by doubling, that the worker drains in arrival order,
 * calling run(user, m, arrived_us) for each with mu released and freeing m after. Embedded in the
 * actor's state. */
typedef struct sh_act_worker {
    uv_mutex_t mu;
    uv_cond_t cv;
    struct sh_act_queued {
        sh_msg *m;
        uint64_t us; /* when it was pushed (sh__act_mono_us) */
    } * q;           // (cap)
    uint32_t cap, head, len;
    bool stopping;
    uv_thread_t thread;
    void (*run)(void *user, const sh_msg *m, uint64_t arrived_us);
    void *user;
    const char *name; /* the thread's name (at most 15 bytes) */
} sh_act_worker;

/* Starts w's thread, named name, with room for cap messages before the ring first grows. Returns
 * SH_OK, SH_ENOMEM (the ring) or SH_EIO (the mutex, condition or thread: e says which); w is
 * left zeroed on failure. Loop thread (init). */
sh_err sh__act_worker_start(sh_act_worker *w, const char *name, uint32_t cap,
                            void (*run)(void *user, const sh_msg *m, uint64_t arrived_us),
                            void *user, sh_error *e);

/* Queues m (the caller then returns SH_MSG_FATE_KEPT: the worker frees it) with the time now and
 * wakes the worker. Returns SH_OK, or SH_ENOMEM when the ring cannot grow (m stays the
 * caller's). Any thread but the worker. */
sh_err sh__act_worker_push(sh_act_worker *w, sh_msg *m);

/* Lets the worker finish the message it runs, joins it, frees the messages it did not take and
 * the ring. Loop thread (stop); only after a successful start. */
void sh__act_worker_stop(sh_act_worker *w);

/* Mixes a 64-bit id into a 32-bit hash-table index (the finalizer of MurmurHash3's fmix64). */
static inline uint32_t sh__act_hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Unix time in milliseconds and a monotonic clock in microseconds. */
uint64_t sh__act_unix_ms(void);
uint64_t sh__act_mono_us(void);

/* This process's resident memory in bytes (/proc/self/statm), 0 when it cannot be read. A few
 * microseconds: fine once per heartbeat, not per token. */
uint64_t sh__act_rss_bytes(void);

#endif
