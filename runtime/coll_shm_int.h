/* Internals of the shared-memory transport of the collectives, shared by coll_shm.c (the
 * per-call protocol) and coll_shm_seg.c (the segment: layout, creation, opening, the in-process
 * group). */
#ifndef SH_RUNTIME_COLL_SHM_INT_H
#define SH_RUNTIME_COLL_SHM_INT_H

#include <stdalign.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "runtime/coll_int.h"

/* Segment layout: a header, one control block per rank, two slots per rank (the data a rank
 * contributes to a call lives in the slot of the call's parity, so that a rank writing call s+1's
 * data never touches what a slower peer may still read of call s), and one result area that the
 * reduce-scatter path fills share by share.
 *
 * Per call s, every rank writes its call descriptor (epoch, sequence, operation, size, root),
 * then copies its data into its slot in chunks of 64 KB, publishing (s, j) in its `pub` word
 * (release) after the j-th. Before reading anything of a peer, a rank waits for every peer's
 * (s, 1) and checks each descriptor against its own. From there:
 * - small all-reduces and two ranks: every rank sums each chunk of all the slots, in rank
 *   order, into its buffer as soon as every rank has published it (one barrier, pipelined);
 * - larger ones with more ranks: once every chunk is published, rank r sums its 1/size share
 *   into the result area, publishes (s, PROG_RESULT), waits for every peer's and copies the
 *   whole result out (two barriers);
 * - all-gather copies each chunk of every slot out in rank order; broadcast copies the root's.
 * Reuse is safe: every call waits for every peer's (s, 1); a rank writes its slot of parity p in
 * call s+2 (or the result area in call s+1) only after every peer published (s+1, 1), which each
 * does only once it has finished call s. Sums are taken in rank order element by element on
 * every path, so every rank gets the same bits. */

#define SH__COLL_SHM_MAGIC 0x4745534c4f434853ull /* "SHCOLSEG" in memory order */
#define SH__COLL_SHM_VERSION 1u
#define SH__COLL_SHM_ALIGN 64u

/* A rank's control block: free, joined, left (destroy) or broken (a failed call). */
enum { SH__COLL_SHM_FREE = 0, SH__COLL_SHM_JOINED, SH__COLL_SHM_CLOSED, SH__COLL_SHM_BROKEN };

typedef struct sh__coll_shm_hdr {
    _Atomic uint64_t magic; /* SH__COLL_SHM_MAGIC once the creator has initialised the rest */
    uint32_t version;
    uint32_t epoch;
    int32_t size;
    int32_t creator_pid;
    uint64_t max_bytes;
    uint64_t total;
    alignas(SH__COLL_SHM_ALIGN) _Atomic uint32_t
        bell;                 /* the futex word: bumped when a sleeper must wake */
    _Atomic uint32_t waiters; /* ranks sleeping (or about to) on bell */
} sh__coll_shm_hdr;

typedef struct sh__coll_shm_desc {
    uint64_t seq;
    uint64_t bytes;
    uint32_t epoch;
    uint32_t op;
    int32_t root;
} sh__coll_shm_desc;

typedef struct sh__coll_shm_ctl {
    alignas(
        SH__COLL_SHM_ALIGN) _Atomic uint64_t pub; /* last step published (coll_shm.c: step_of) */
    _Atomic uint32_t state;
    int32_t pid;
    uint32_t epoch;
    alignas(SH__COLL_SHM_ALIGN) sh__coll_shm_desc desc[2]; /* by the call's parity */
} sh__coll_shm_ctl;

typedef struct sh__coll_shm {
    unsigned char *base;
    size_t total;
    bool named;  /* a shm_open segment (else the memory of an sh_coll_inproc) */
    bool joined; /* this rank holds its control block */
    char name[256];
    ino_t ino; /* the named segment's inode, so rank 0 unlinks only its own */
    dev_t dev;
    sh__coll_shm_hdr *hdr;
    sh__coll_shm_ctl *ctl;
    unsigned char *slots;
    size_t slot_stride;
    float *result;
} sh__coll_shm;

/* The in-process group: the segment in this process's memory (anonymous, zeroed). */
struct sh_coll_inproc {
    int32_t size;
    size_t max_bytes;
    unsigned char *base;
    size_t total;
};

static inline size_t sh__coll_shm_round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* The bytes a segment takes for (size, max_bytes) and the stride of one slot; 0 when it does
 * not fit a size_t. */
size_t sh__coll_shm_seg_bytes(int32_t size, size_t max_bytes, size_t *slot_stride);

/* Sets s->total and the pointers into s->base for a group of (size, max_bytes). */
void sh__coll_shm_seg_layout(sh__coll_shm *s, int32_t size, size_t max_bytes);

/* Rank 0 of a named group: replaces whatever s->name held with a fresh segment of c's size,
 * max_bytes and epoch, every page reserved, and maps it into s. SH_EINVAL, SH_EIO. */
sh_err sh__coll_shm_seg_create(sh__coll_shm *s, const sh_coll *c, sh_error *e);

/* Ranks > 0 of a named group: opens and maps the segment rank 0 made, retrying until the
 * deadline (CLOCK_MONOTONIC ns) while it is missing, being set up, or left over from a dead or
 * finished run or an older epoch. SH_EPROTO (a newer epoch or another layout version),
 * SH_EINVAL (another size or max_bytes), SH_ETIMEDOUT (naming the last reason), SH_EIO. */
sh_err sh__coll_shm_seg_open(sh__coll_shm *s, const sh_coll *c, uint64_t deadline, sh_error *e);

/* Unmaps a named segment; with unlink (rank 0), removes its name too while the name is still
 * this segment's (a new incarnation's rank 0 may have replaced it). */
void sh__coll_shm_seg_close(sh__coll_shm *s, bool unlink);

/* Whether process pid is gone (or a zombie nobody has reaped yet). */
bool sh__coll_shm_seg_pid_dead(int32_t pid);

#endif
