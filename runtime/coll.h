/* Collectives of a tensor-parallel group: all-reduce, all-gather and broadcast among its ranks. */
#ifndef SH_RUNTIME_COLL_H
#define SH_RUNTIME_COLL_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

/* A group is `size` ranks (0 .. size - 1) that call the same collectives in the same order, each
 * from its own compute thread (a stage rank's executor). A call blocks that thread until every
 * rank has contributed, or fails within the group's timeout: a dead, stopped or misbehaving
 * rank makes every peer's call fail (SH_ETIMEDOUT, SH_ECLOSED or SH_EPROTO), never hang. After
 * a failed call the group is broken: every later call fails at once with the same code; the
 * stage recreates the group with a new epoch once the watchdog has replaced the rank.
 *
 * Every contribution carries the group's epoch and the call's sequence number (the count of
 * collectives this rank has called since create); a rank that sees another epoch, sequence,
 * operation or size fails the call with SH_EPROTO naming the rank and both values.
 *
 * Transports (sh_coll_kind):
 * - SH_COLL_SHM: ranks on one host exchange through one shared-memory segment, with no socket
 *   on the per-call path (spin about a microsecond, yield the CPU for up to 50 us, then futex
 *   wait). `shm_name` names the segment (every rank passes the same name; rank 0 replaces
 *   whatever the name held with a fresh segment and unlinks it in destroy; the others open it
 *   within the timeout, waiting out a segment left by a dead or finished run or an older
 *   epoch); NULL puts the segment in this process's memory, shared by ranks that are threads
 *   of one process and created with the same `inproc` handle (see sh_coll_opts). A peer
 *   process that dies is noticed within milliseconds (SH_ECLOSED), not at the timeout. The
 *   segment takes (2 * size + 1) * max_bytes plus a few KB; a named one is reserved whole at
 *   create (a /dev/shm without room for it is SH_EIO then, never a fault in a call).
 * - SH_COLL_NET: ranks exchange frames over NNG links (ipc://, tcp://, or tls+tcp:// with
 *   sh_coll_opts.tls: mutual TLS on every link), each rank listening on urls[rank]: a one-shot
 *   exchange (every rank sends its buffer to every other) for small messages, a ring
 *   (reduce-scatter then all-gather, chunks pipelined) for large ones. A lost frame does not fail
 * the call: a rank that waits for a frame a few ms after its sender went silent asks for it again
 * (after 5 ms at first, the gap doubling up to 100 ms), and the sender keeps what it sent in its
 * last five calls to send it again (a ring's first frames only while the call runs: they are
 * encoded again from the caller's buffer; sh_coll_opts.fault injects losses); duplicates are
 * dropped. A call still fails at timeout_ms when the frame never comes (a peer stopped, or every
 * frame to it lost), or within ~100 ms when its sender has destroyed its handle (a frame lost in a
 * rank's last call before destroy is not recovered). Optional compression of what crosses the links
 * (f16, or int8 with one scale per chunk of at most 256 values); sums are always taken in f32.
 * - SH_COLL_HIER: two levels, for a group spanning hosts with several ranks on some: `hosts`
 *   gives each rank's host (any ids; equal ids are one host). The ranks of a host form an
 *   SH_COLL_SHM group on the segment shm_name + "-h<k>" (k: the host's index, hosts numbered in
 *   the order their first rank appears), and each host's first rank (its leader) joins an
 *   SH_COLL_NET group of the leaders on its urls[rank] (the other ranks' URLs are not used;
 *   compress, key, tls and fault apply to it, fault being asked with global ranks). all-reduce sums
 *   each host's buffers in shared memory (in rank order), the leaders' sums over the network,
 *   and broadcasts the result back to each host: every rank gets the same bits, which may differ
 *   in the last bits from a flat group's (another order of the sum). all-gather and broadcast
 *   go the same way. A failure on either level makes the rank leave both at once, so every peer
 *   learns of it within about 100 ms, or at the timeout when a rank stopped; errors name the
 *   level and the rank, then quote the inner group's error (its own ranks and call numbers).
 *   A host of one rank uses no segment, a group on one host no sockets. The leaders' group
 *   carries max(max_bytes, hosts x the largest host's ranks x max_bytes / size) (their
 *   all-gather pads each host to the largest).
 *
 * Threads: create, the collectives and destroy of one handle belong to one thread at a time;
 * sh_coll_stats_get may be called from any thread. */

typedef struct sh_coll sh_coll;

typedef enum sh_coll_kind {
    SH_COLL_SHM = 1,
    SH_COLL_NET,
    SH_COLL_HIER,
} sh_coll_kind;

typedef enum sh_coll_compress {
    SH_COLL_COMPRESS_NONE = 0, /* f32 on the wire */
    SH_COLL_COMPRESS_F16,
    SH_COLL_COMPRESS_INT8, /* one f32 scale per chunk of at most 256 values */
} sh_coll_compress;

/* Ranks that are threads of one process share one of these (SH_COLL_SHM with shm_name NULL):
 * create it once, pass it to every rank's sh_coll_create, destroy it after every rank's handle.
 * It holds one incarnation of the group: each rank joins it once (joining a rank again is
 * SH_EINVAL); form the group again with a new one. Its size and max_bytes must equal the ranks'
 * options (SH_EINVAL). */
typedef struct sh_coll_inproc sh_coll_inproc;
sh_err sh_coll_inproc_create(int32_t size, size_t max_bytes, sh_coll_inproc **out, sh_error *e);
void sh_coll_inproc_destroy(sh_coll_inproc *g);

/* What a fault hook (sh_coll_opts.fault) decides for one frame. */
typedef enum sh_coll_fault {
    SH_COLL_FAULT_PASS = 0,
    SH_COLL_FAULT_DROP,      /* the frame is lost */
    SH_COLL_FAULT_DUPLICATE, /* the frame is sent twice */
} sh_coll_fault;

/* Asked for every frame of a call (data, acknowledgement, resend request, resent frame) this
 * rank is about to send to rank `peer` (not for the join's frames). Called on the calling
 * thread or on one of NNG's threads: it must be quick and thread-safe. */
typedef sh_coll_fault (*sh_coll_fault_fn)(void *ud, int32_t peer);

typedef struct sh_coll_opts {
    int32_t rank, size; /* 0 <= rank < size, 1 <= size <= SH_COLL_MAX_RANKS */
    uint32_t epoch;     /* the group's incarnation; peers of another epoch are refused */
    int32_t timeout_ms; /* bound on one call and on create's wait for the peers (<= 0: 5000) */
    size_t max_bytes;   /* largest buffer one call passes (all-gather: its output) */
    /* SH_COLL_SHM */
    const char *shm_name;   /* e.g. "/shoal-<cluster>-<replica>-<stage>"; NULL: inproc */
    sh_coll_inproc *inproc; /* with shm_name NULL */
    /* SH_COLL_NET */
    const char *const *urls; /* (size) every rank's listening URL; urls[rank] is ours */
    sh_coll_compress compress;
    const uint8_t *key; /* the cluster key (NULL: an unkeyed cluster): each link proves it */
    size_t key_len;
    /* SH_COLL_HIER: shm_name (the segments' prefix), urls, compress, key, and */
    const int32_t *hosts; /* (size) each rank's host id: equal ids share a host */
    /* tls+tcp:// URLs (every rank's or none): this rank's certificate and key and the CA that
     * signs every rank's (include/shoal/transport.h; read at create, as a node's transport reads
     * them, server_name included); ignored for ipc:// and tcp://. A peer whose certificate that
     * CA did not sign never joins: create fails with SH_ETIMEDOUT naming it and the failed
     * handshakes. */
    const struct sh_transport_tls *tls;
    /* Fault injection (chaos scenarios, tests; NULL: none): see sh_coll_fault_fn. The transport
     * survives what it injects as it survives lost frames (SH_COLL_NET above). */
    sh_coll_fault_fn fault;
    void *fault_ud;
} sh_coll_opts;

#define SH_COLL_MAX_RANKS 64

/* Opens this rank's side of a group and waits (up to timeout_ms) until every rank has joined.
 * Returns SH_EINVAL (bad rank, size, kind or option, or a segment made for another size or
 * max_bytes, named in e), SH_EPROTO (a peer or the segment is of another epoch: both named),
 * SH_ETIMEDOUT (a peer did not join), SH_ECLOSED (a peer gave up or left before the group
 * formed), SH_EIO (shared memory or sockets could not be set up),
 * SH_ENOMEM; *out NULL on failure. The caller owns *out. */
sh_err sh_coll_create(sh_coll_kind kind, const sh_coll_opts *o, sh_coll **out, sh_error *e);

/* Leaves the group and frees the handle; accepts NULL. Peers still calling fail with SH_ECLOSED
 * or SH_ETIMEDOUT. SH_COLL_NET takes up to about three quarters of a second (its links hand over
 * what they still hold, then its peers' links to it close), 180 ms more on tls+tcp://
 * (runtime/coll_net.c, net_free). */
void sh_coll_destroy(sh_coll *c);

int32_t sh_coll_rank(const sh_coll *c);
int32_t sh_coll_size(const sh_coll *c);

/* Sums buf (n floats, the same n on every rank) element-wise over the ranks, in place: on return
 * every rank holds the same sum. With a size of 1 it returns at once. */
sh_err sh_coll_allreduce(sh_coll *c, float *buf, size_t n, sh_error *e);

/* Concatenates every rank's `bytes` bytes of `in` in rank order into `out` (size * bytes); the
 * same `bytes` on every rank. */
sh_err sh_coll_allgather(sh_coll *c, const void *in, size_t bytes, void *out, sh_error *e);

/* Copies root's buf (bytes) into every other rank's buf. */
sh_err sh_coll_broadcast(sh_coll *c, void *buf, size_t bytes, int32_t root, sh_error *e);

/* sh_coll_allreduce and sh_coll_allgather with the handle as a void *: the function pointers of
 * model/llama.h's sh_llama_comm (model/ does not include the runtime), ud being the sh_coll. */
sh_err sh_coll_allreduce_ud(void *ud, float *buf, size_t n, sh_error *e);
sh_err sh_coll_allgather_ud(void *ud, const void *in, size_t bytes, void *out, sh_error *e);

/* Counters since create (for /metrics and the bench). */
typedef struct sh_coll_stats {
    uint64_t calls;      /* collectives completed */
    uint64_t failures;   /* collectives failed */
    uint64_t bytes;      /* payload bytes passed in by the caller */
    uint64_t bytes_wire; /* bytes this rank sent (after compression; 0 for shm) */
    uint64_t wait_ns;    /* time spent inside the calls */
} sh_coll_stats;
void sh_coll_stats_get(const sh_coll *c, sh_coll_stats *s);

#endif
