/* A fault scenario as data: timed events (kill, stall, link rules, stop/cont, leak) that the Lua
 * loader (lua/config.h, sh_scenario_load_*) fills and the runner (runtime/fault_scenario.h)
 * applies to the fault layers. Plain structs, so that neither side includes the other. */
#ifndef SH_BASE_FAULT_EVENT_H
#define SH_BASE_FAULT_EVENT_H

#include <stddef.h>
#include <stdint.h>

typedef enum sh_fault_kind {
    SH_FAULT_KILL,      /* kill "node": from = the node */
    SH_FAULT_STALL,     /* stall{ actor, ms }: from = the actor ("node" or "node/actor") */
    SH_FAULT_DELAY,     /* delay{ from, to | link, ms, lasting } */
    SH_FAULT_DROP,      /* drop{ link | from, to, p, lasting } */
    SH_FAULT_DUPLICATE, /* duplicate{ link | from, to, p, lasting } */
    SH_FAULT_CORRUPT,   /* corrupt{ link | from, to, bytes, p, lasting } */
    SH_FAULT_PARTITION, /* partition{ a, b, lasting }: from = a, to = b, both directions */
    SH_FAULT_HEAL,      /* heal{ link | from, to | a, b }: lifts matching rules; heal{} lifts all */
    SH_FAULT_STOP,      /* stop "node" | stop{ node, lasting }: SIGSTOP the node's process (from =
                           the node); with lasting, SIGCONT after lasting_s */
    SH_FAULT_CONT,      /* cont "node": SIGCONT the node's process (from = the node) */
    SH_FAULT_LEAK,      /* leak{ node, mb_per_s, lasting }: the node allocates and touches memory at
                           mb_per_s MiB per second for lasting_s seconds (from = the node) */
} sh_fault_kind;

#define SH_FAULT_NAME_MAX 64

/* One scheduled fault. Links are directed from -> to; "*" matches any node. */
typedef struct sh_fault_event {
    double time_s; /* seconds from the start of the run */
    sh_fault_kind kind;
    char from[SH_FAULT_NAME_MAX];
    char to[SH_FAULT_NAME_MAX];
    double ms;        /* delay or stall length */
    double p;         /* probability per message, 0..1 (1 when not given) */
    int32_t bytes;    /* corrupt: bytes flipped per message */
    double lasting_s; /* how long the rule holds; 0 = until healed or the end of the run */
    int32_t line;     /* line of the at() call, for logs */
    double mb_per_s;  /* leak: MiB allocated and touched per second */
    uint32_t type;    /* link rules: only messages of this type (0: every message; 255, the
                         fault layer's SH_FAULT_TYPE_COLL: a group's collectives alone) */
} sh_fault_event;

typedef struct sh_scenario {
    char source[128]; /* the script's file or chunk name, for messages */
    size_t n_events;
    sh_fault_event *events; /* (n_events), sorted by time, script order among equal times */
} sh_scenario;

#endif
