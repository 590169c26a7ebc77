/* What fault.c and the FAULT-message agent (fault_agent.c) share. */
#ifndef SH_RUNTIME_FAULT_AGENT_H
#define SH_RUNTIME_FAULT_AGENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/fault.h"

typedef struct sh__fault_agent sh__fault_agent;

/* fault.c */

/* The checks sh_fault_rule_add() makes, without adding. */
sh_err sh__fault_rule_check(const sh_fault_rule *r, sh_error *e);

/* Checks every rule, then under one lock: clears the rules (clear), reseeds (seed != 0) and adds
 * them all; *active gets the rules active afterwards. SH_EINVAL names the first bad rule,
 * SH_ERANGE when they would exceed 256; nothing changed then. Any thread. */
sh_err sh__fault_apply(sh_fault *f, bool clear, uint64_t seed, const sh_fault_rule *rules, size_t n,
                       size_t *active, sh_error *e);

sh_runtime *sh__fault_runtime(sh_fault *f);

/* sh_fault_decide on every layer installed on rt (none: 0), for code that knows the runtime but
 * not its layer (a stage's collectives, actors/stage.c). Any thread. */
uint32_t sh__fault_decide_rt(sh_runtime *rt, uint32_t to, uint32_t type);

/* Where the layer keeps its agent (NULL until spawned). */
sh__fault_agent **sh__fault_agent_slot(sh_fault *f);

/* fault_agent.c */

/* Stops the agent's actor, waits until it has stopped and frees it. Accepts NULL. Not from a
 * loop thread. */
void sh__fault_agent_destroy(sh__fault_agent *a);

#endif
