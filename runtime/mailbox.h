/* The intrusive MPSC queue behind every mailbox and loop run queue, and the message buffer pool. */
#ifndef SH_RUNTIME_MAILBOX_H
#define SH_RUNTIME_MAILBOX_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"
#include "shoal/runtime.h"

/* Vyukov's intrusive multi-producer single-consumer queue. Producers (any thread) swap
 * themselves into `head` with one atomic exchange and then link the previous node to the new one;
 * the consumer (one thread at a time: the owning loop, or whoever holds the last reference) walks
 * from `tail`. A stub node keeps the queue never truly empty, so neither side needs a lock or a
 * CAS loop. Between a producer's exchange and its link store the queue looks empty from that node
 * on ("in progress"); the producer always wakes the consumer after linking (runtime/loop.c), so
 * the consumer may treat that window as empty.
 *
 * Invariant: every node pushed is popped exactly once, in the order of the producers' exchanges
 * (so per producer, FIFO). Nodes are owned by the queue from push until pop. */
typedef struct sh__mpsc_node {
    _Atomic(struct sh__mpsc_node *) next;
} sh__mpsc_node;

typedef struct sh__mailbox {
    _Atomic(sh__mpsc_node *) head;  /* producers' end: the newest node */
    char pad_[64 - sizeof(void *)]; /* keeps producers' and consumer's lines apart */
    sh__mpsc_node *tail;            /* consumer's end: the oldest node (or the stub) */
    sh__mpsc_node stub;
} sh__mailbox;

/* An empty queue. */
void sh__mailbox_init(sh__mailbox *q);

/* Appends n (owned by the queue until popped). Any thread; wait-free. */
void sh__mailbox_push(sh__mailbox *q, sh__mpsc_node *n);

/* Removes and returns the oldest node, or NULL when empty or when the next node is still being
 * linked by a producer (who will wake the consumer). Consumer only. */
sh__mpsc_node *sh__mailbox_pop(sh__mailbox *q);

/* True when a pop would return a node now. Consumer only. */
bool sh__mailbox_ready(sh__mailbox *q);

/* Frames up to this many bytes live inside a pooled message block; larger ones get their own
 * allocation. 64 B bodies plus the envelope fit with room to spare. */
#define SH__MAILBOX_SMALL_FRAME 448u
/* The pool keeps at most this many free blocks (about 2 MiB) and frees the rest. */
#define SH__MAILBOX_POOL_MAX 4096u
/* Medium frames (a batcher's STEP, a KV reply with a long block table, a TOKEN with logprobs) up
 * to this many bytes get a pooled block too, so that a steady flow of them allocates nothing;
 * the pool keeps at most SH__MAILBOX_MID_MAX free ones (4 MiB). */
#define SH__MAILBOX_MID_FRAME ((size_t)16 << 10)
#define SH__MAILBOX_MID_MAX 256u

/* Large blocks (header and a frame of at least SH__MAILBOX_BIG_MIN bytes) are kept on release, up
 * to SH__MAILBOX_BIG_MAX blocks and SH__MAILBOX_BIG_BYTES bytes per runtime, and reused for a frame
 * that fits in at most twice its size: a node passing activations between local actors neither
 * allocates nor page-faults fresh memory per frame, whatever the allocator's mmap threshold (the
 * library never changes process-wide malloc settings). */
#define SH__MAILBOX_BIG_MIN ((size_t)64 << 10)
#define SH__MAILBOX_BIG_MAX 8u
#define SH__MAILBOX_BIG_BYTES ((uint64_t)64 << 20)

/* Allocates a message able to hold a frame of `cap` bytes (data, cap set; everything else zeroed
 * except rt; the frame bytes are not zeroed). Small ones come from the runtime's pool without
 * malloc, large ones from the big-block pool when one fits. Returns NULL when out of
 * memory. Any thread. */
sh_msg *sh__mailbox_msg_alloc(sh_runtime *rt, size_t cap);

/* A message around `data` (len bytes of cap, allocated with malloc by an sh_buf), which it now
 * owns and frees on release. Returns NULL when out of memory (data stays with the caller). */
sh_msg *sh__mailbox_msg_adopt(sh_runtime *rt, uint8_t *data, size_t len, size_t cap);

/* A message (a pooled header block) around `data`, len bytes that `owner` frees: the message
 * owns the buffer and releases it through the owner when it is released, unless
 * sh__mailbox_msg_disown() gave it back first. Returns NULL when out of memory (the buffer stays
 * with the caller). Any thread. */
sh_msg *sh__mailbox_msg_wrap(sh_runtime *rt, uint8_t *data, size_t len,
                             const sh_frame_owner *owner);

/* Forgets an owned buffer without releasing it (it went back to the caller or to a transport);
 * the message must not be read afterwards, only released. */
void sh__mailbox_msg_disown(sh_msg *m);

/* Returns a message's memory to the pool (or to malloc). Any thread. */
void sh__mailbox_msg_release(sh_msg *m);

/* Frees every pooled block; the runtime is quiescent. */
void sh__mailbox_pool_fini(sh_runtime *rt);

#endif
