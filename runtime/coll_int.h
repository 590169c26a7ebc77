/* Internals shared by the collectives' front (coll.c) and their transports (coll_shm.c,
 * coll_net.c, coll_hier.c). */
#ifndef SH_RUNTIME_COLL_INT_H
#define SH_RUNTIME_COLL_INT_H

#include <stdatomic.h>
#include <stdbool.h>

#include "runtime/coll.h"

typedef enum sh__coll_op {
    SH__COLL_OP_ALLREDUCE = 1,
    SH__COLL_OP_ALLGATHER,
    SH__COLL_OP_BROADCAST,
} sh__coll_op;

/* One transport's implementation of the three collectives. Each is called by coll.c with the
 * arguments checked (sizes within max_bytes, root in range), the group not broken, and c->seq
 * already holding this call's sequence number; it returns SH_OK or fills e. */
typedef struct sh__coll_ops {
    sh_err (*allreduce)(sh_coll *c, float *buf, size_t n, sh_error *e);
    sh_err (*allgather)(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e);
    sh_err (*broadcast)(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e);
    void (*destroy)(sh_coll *c); /* frees impl; coll.c frees c */
} sh__coll_ops;

struct sh_coll {
    const sh__coll_ops *ops;
    void *impl;
    int32_t rank, size;
    uint32_t epoch;
    int32_t timeout_ms;
    size_t max_bytes;
    uint64_t seq;         /* sequence number of the current (or last) call, from 1 */
    sh_err broken;        /* SH_OK until a call fails; then every call returns it */
    char broken_msg[320]; /* the first failure's text, repeated by later calls */
    _Atomic uint64_t calls, failures, bytes, bytes_wire, wait_ns;
};

/* The name of a collective for error text ("all-reduce", ...); "no call" for 0 (a peer that has
 * not called yet), "an unknown collective" for anything else. */
const char *sh__coll_op_name(uint32_t op);

/* The transports' constructors: c comes from coll.c with every field but ops and impl set (o
 * checked); they set c->ops and c->impl, waiting for the peers to join, or return an error
 * leaving nothing allocated. */
sh_err sh__coll_shm_create(sh_coll *c, const sh_coll_opts *o, sh_error *e);
sh_err sh__coll_net_create(sh_coll *c, const sh_coll_opts *o, sh_error *e);
sh_err sh__coll_hier_create(sh_coll *c, const sh_coll_opts *o, sh_error *e);

#endif
