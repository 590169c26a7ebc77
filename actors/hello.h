/* The "hello" actor of a cluster node: the identity check between the front and its worker
 * nodes before any request is served (issue 11). */
#ifndef SH_ACTORS_HELLO_H
#define SH_ACTORS_HELLO_H

#include <stdatomic.h>
#include <stdint.h>

#include "shoal/runtime.h"

#define SH_HELLO_MAX_STAGES 64

/* What a node says about itself in HELLO (runtime/proto_table.h, SH_PROTO_FIELDS_hello). */
typedef struct sh_hello_ident {
    char node[64];    /* the node's name in the cluster script */
    char version[32]; /* SH_VERSION_STRING of the build */
    uint32_t proto;   /* SH_PROTO_VERSION */
    uint64_t model_size, model_hash;
    int32_t n_blocks, max_seqs, max_tokens, seq_blocks; /* the stages' settings (0: none) */
    uint32_t link_dtype; /* the dtype its stages send ACT in (SH_PROTO_DTYPE_*, 0: F32) */
    int32_t n_stages;
    uint64_t stages[SH_HELLO_MAX_STAGES]; /* the node's stage addresses */
} sh_hello_ident;

/* One node the hello actor greets. The actor writes `got` and then sets `answered` (release);
 * another thread may read `got` once it has seen answered == 1 (acquire). */
typedef struct sh_hello_peer {
    sh_addr addr; /* the peer's hello actor */
    atomic_int answered;
    sh_hello_ident got;
    uint64_t session; /* the request in flight; actor's loop only */
} sh_hello_peer;

/* Kind "hello". Every HELLO request it receives is answered with `self`. With peers, it sends
 * each peer that has not answered yet a HELLO request with `self` every retry_ms (default 500):
 * a peer whose link is not up yet, or whose process has not started, is simply asked again until
 * the caller gives up. The caller compares the answers (this actor judges nothing). args, self
 * and peers are borrowed and must outlive the actor. */
typedef struct sh_hello_args {
    const sh_hello_ident *self;
    sh_hello_peer *peers; /* (n_peers); NULL on a worker */
    int32_t n_peers;
    uint32_t retry_ms;
} sh_hello_args;

extern const sh_actor_vtable sh__hello_vtable;

#endif
