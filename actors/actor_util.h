/* Small helpers the serving actors share: typed decode of a message body into a preallocated
 * arena, and typed sends from an actor or from a worker thread. */
#ifndef SH_ACTORS_ACTOR_UTIL_H
#define SH_ACTORS_ACTOR_UTIL_H

#include <stddef.h>
#include <stdint.h>

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
