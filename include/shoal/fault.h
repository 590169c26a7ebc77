/* Fault injection in the send path: per-link drop, delay, duplicate, corrupt and partition. */
#ifndef SHOAL_FAULT_H
#define SHOAL_FAULT_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"
#include "shoal/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A fault layer sits in one runtime's send path as its filter hook (DESIGN.md section 2) and
 * wraps the transport's send_frame. It sees every message leaving the node for another node
 * (local messages pass untouched) and applies the rules whose link matches: link = this node ->
 * destination node. Each node of a cluster runs its own layer with the same rules; a partition
 * rule drops traffic both ways because each side drops its own half.
 *
 * Reproducibility. Each link (destination node) has its own xoshiro256** generator seeded from
 * the layer's seed and the link (splitmix64). For every message a matching rule draws the same
 * number of values whatever the outcome, so the same seed and the same per-link sequence of
 * messages give the same decisions, whatever the timing or the other links do.
 *
 * Threads. Every function may be called from any thread. The filter runs on the sending thread
 * under the layer's lock; delayed messages are held (bounded by max_held) and re-injected by the
 * layer's own timer thread. */

typedef struct sh_fault sh_fault;

/* The values match sh_proto_fault_action (runtime/proto.h). */
typedef enum sh_fault_action {
    SH_FAULT_ACTION_DROP = 0,      /* drop with probability p */
    SH_FAULT_ACTION_DELAY = 1,     /* hold delay_ms, with probability p */
    SH_FAULT_ACTION_DUPLICATE = 2, /* send twice, with probability p */
    SH_FAULT_ACTION_CORRUPT = 3,   /* flip `bytes` bytes of a copy at random positions, with p */
    SH_FAULT_ACTION_PARTITION = 4, /* drop everything between set A (from) and set B (to) */
} sh_fault_action;

#define SH_FAULT_SET_MAX 16          /* nodes in one rule's from / to set */
#define SH_FAULT_FLIPS_MAX 16        /* bytes one corruption flips at most */
#define SH_FAULT_DELAY_MAX_MS 600000 /* longest DELAY (10 minutes) */

typedef struct sh_fault_rule {
    sh_fault_action action;
    uint32_t from[SH_FAULT_SET_MAX]; /* sending nodes; n_from 0 = any ("*") */
    uint32_t n_from;
    uint32_t to[SH_FAULT_SET_MAX]; /* receiving nodes; n_to 0 = any */
    uint32_t n_to;
    double p;          /* probability per message, 0..1 (partition ignores it) */
    uint32_t delay_ms; /* DELAY: 0..SH_FAULT_DELAY_MAX_MS */
    uint32_t bytes;    /* CORRUPT: 1..SH_FAULT_FLIPS_MAX */
    double lasting_s;  /* the rule expires this long after it was added; <= 0: never */
    uint32_t type;     /* only messages of this type (SH_MSG_*, runtime/msg.h); 0: any */
    uint32_t count;    /* the rule expires once this many messages matched it; 0: never */
} sh_fault_rule;

/* What the layer decided for one message (for logs and the determinism tests). */
typedef struct sh_fault_decision {
    uint32_t from, to; /* the link */
    uint64_t seq;      /* index of the message on its link, from 0 */
    uint32_t type;     /* message type */
    uint32_t actions;  /* bit (1 << sh_fault_action) for every action taken */
    uint32_t delay_ms;
    uint32_t n_flips;
    uint32_t flip_pos[SH_FAULT_FLIPS_MAX];
} sh_fault_decision;

/* Called under the layer's lock for every message a rule matched, in decision order; it must be
 * quick and must not call into the layer or the runtime. */
typedef void (*sh_fault_log_fn)(void *ud, const sh_fault_decision *d);

typedef struct sh_fault_opts {
    uint64_t seed;
    const sh_transport_hooks *next; /* the hooks to wrap (sh_transport_hooks_get()); NULL: none */
    uint32_t max_held;              /* delayed messages held at once; 0: 4096 (then pass) */
    sh_fault_log_fn log_fn;
    void *log_ud;
} sh_fault_opts;

typedef struct sh_fault_stats {
    uint64_t seen;        /* remote messages that went through the filter */
    uint64_t dropped;     /* DROP */
    uint64_t partitioned; /* PARTITION */
    uint64_t delayed;
    uint64_t duplicated;
    uint64_t corrupted;
    uint64_t overflow; /* delays not applied because max_held messages were held */
    uint64_t held;     /* messages held right now */
} sh_fault_stats;

/* Creates a layer and installs it on rt (filter + send_frame forwarding to opts->next). Returns
 * SH_EINVAL, SH_ENOMEM, SH_EIO (timer thread); nothing is installed on failure. */
sh_err sh_fault_create(sh_runtime *rt, const sh_fault_opts *opts, sh_fault **out, sh_error *e);

/* Adds a rule, effective for the next message; *id (may be NULL) names it. Returns SH_EINVAL (an
 * out-of-range field, named in e), SH_ERANGE (256 rules already). */
sh_err sh_fault_rule_add(sh_fault *f, const sh_fault_rule *r, uint64_t *id, sh_error *e);

/* Removes a rule. Returns SH_ENOTFOUND. */
sh_err sh_fault_rule_remove(sh_fault *f, uint64_t id);

/* Removes every rule whose from and to sets equal the given ones, either way round (heal of
 * a link or a partition); with n_from == n_to == 0, removes all. Returns how many. */
size_t sh_fault_heal(sh_fault *f, const uint32_t *from, uint32_t n_from, const uint32_t *to,
                     uint32_t n_to);

/* Restarts every link's generator from `seed` (and the link sequence numbers from 0). */
void sh_fault_reseed(sh_fault *f, uint64_t seed);

/* Rules currently active (expired ones are not counted). */
size_t sh_fault_rule_count(sh_fault *f);

void sh_fault_stats_get(sh_fault *f, sh_fault_stats *out);

/* The rule type (sh_fault_rule.type) of the frames of a tensor-parallel group's network
 * collectives (runtime/coll.h's SH_COLL_NET), which leave the node outside its transport: a rule
 * of this type applies to them alone; a rule of type 0 to them and to every message. */
#define SH_FAULT_TYPE_COLL 255u

/* Decides for one frame that leaves this node for node `to` outside the transport (the caller
 * applies the outcome): draws from the link's generator and counts as filter does for a message
 * of `type`, and returns the actions taken as bits (1 << sh_fault_action). Any thread. */
uint32_t sh_fault_decide(sh_fault *f, uint32_t to, uint32_t type);

/* Spawns the layer's agent on loop `loop` of its runtime (SH_ACTOR_LOOP_ANY allowed) and sets
 * *addr: an actor that takes FAULT messages (runtime/proto_table.h) from a chaos driver on any
 * node, so one process can steer the faults of a whole cluster. A FAULT applies as a whole or
 * not at all: `clr` removes every rule first, a non-zero seed reseeds (sh_fault_reseed), then
 * the rules are added. A wire rule's src and dst name nodes (their actor part must be 0; 0
 * matches any node); its other fields are those of sh_fault_rule ("b" corrupt bytes, "for"
 * lasting seconds, "n" count, "ty" type). A request is answered with a FAULT carrying the rules
 * now active in its seed field and no rules (success), or with an ERROR naming the first bad
 * rule (nothing applied). Other message types are answered with ERROR SH_EPROTO. At most one
 * agent per layer: SH_EBUSY for a second. Returns as sh_actor_spawn() otherwise. The agent is
 * stopped by sh_fault_destroy(). Not from a loop thread of the runtime. */
sh_err sh_fault_agent_spawn(sh_fault *f, int loop, sh_addr *addr, sh_error *e);

/* Uninstalls the layer (re-installing opts->next, or nothing), stops the agent (waiting for it)
 * and the timer thread, and frees the messages still held (they are lost, as a dying link would
 * lose them). Accepts NULL. Call before destroying the transport and the runtime, and not from
 * one of the runtime's loop threads. */
void sh_fault_destroy(sh_fault *f);

#ifdef __cplusplus
}
#endif

#endif
