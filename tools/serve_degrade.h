/* `shoal serve`'s degradation ladder (actors/degrade.h): its flags, the object made from them and
 * the cluster script's watchdog settings, the actor that ticks it, and its SIGHUP reload. */
#ifndef SH_TOOLS_SERVE_DEGRADE_H
#define SH_TOOLS_SERVE_DEGRADE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "actors/degrade.h"
#include "actors/serve.h"
#include "lua/config.h"

/* The flags as given (zero: not given). */
typedef struct sh_serve_degrade {
    const char *policy; /* --policy FILE | default */
    int32_t hold_ms;    /* --policy-hold S */
    bool hold_set;
    int32_t max_tokens;    /* --degrade-max-tokens N */
    int32_t shed_priority; /* --shed-priority P */
    bool shed_set;
    const char *fallback; /* --fallback-model NAME */
} sh_serve_degrade;

/* Writes the flags' lines of `shoal serve --help`. */
void sh__serve_degrade_usage(FILE *f);

/* Takes argv[*i] when it is one of the flags above (advancing *i past its value). Returns 0 when
 * taken, 1 when it is not one of them, 2 after an error line (a missing or bad value). */
int sh__serve_degrade_flag(sh_serve_degrade *o, int argc, char **argv, int *i);

/* Makes the ladder when a policy is given (--policy, or the script's watchdog.policy; flags win
 * over the script's settings); *out stays NULL without a policy. The caller has the watchdog
 * tick it (sh__degrade_tick_cb). note and extra (sh_degrade_opts) may be NULL. Returns 0, or 1
 * after an error line (a policy that does not load, with its file:line). Main thread. */
int sh__serve_degrade_create(const sh_serve_degrade *o, const sh_cluster_config *cfg,
                             sh_runtime *rt,
                             void (*note)(void *user, const char *kind, const char *msg),
                             void *note_user,
                             size_t (*extra)(void *user, sh_policy_metric *out, size_t cap),
                             void *extra_user, sh_degrade **out);

/* Checks that d's fallback model is one ga serves and prints the ladder's settings in one line.
 * Nothing when d is NULL. Returns 0, or 1 after an error line. Main thread, before the gateway
 * is spawned with ga.degrade = d. */
int sh__serve_degrade_check(const sh_degrade *d, const sh_gateway_args *ga);

/* SIGHUP: reloads d's policy (nothing when d is NULL) and prints one line saying how it went. */
void sh__serve_degrade_reload(sh_degrade *d);

#endif
