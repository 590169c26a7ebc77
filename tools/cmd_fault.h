/* `--fault-scenario FILE` of `shoal node` and `shoal serve -c`: a fault scenario (lua/config.h,
 * lua/examples/scenario-demo.lua) run against the links leaving this process, for testing how a
 * cluster behaves when a link is slow, lossy or cut. */
#ifndef SH_TOOLS_CMD_FAULT_H
#define SH_TOOLS_CMD_FAULT_H

#include "lua/config.h"
#include "lua/fault_scenario.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

typedef struct sh_cmd_fault {
    const sh_cluster_config *c;
    sh_scenario *sc;
    sh_fault *f;
    sh_fault_runner *run;
    sh_fault_host host;
} sh_cmd_fault;

/* Loads the scenario at path, checks its node names against the cluster script c, installs a
 * fault layer on rt in front of tp and starts applying the events at their times (from now).
 * Link events act on the links leaving this node; kill and stall events are not supported here
 * and are counted as failed. Prints one line `shoal: fault scenario PATH: N events`. Returns 0,
 * or 2 with an error line (a bad script, an unknown node). cf, c, rt and tp must outlive the
 * layer (sh__cmd_fault_stop). Not from a loop thread. */
int sh__cmd_fault_start(sh_cmd_fault *cf, const char *path, const sh_cluster_config *c,
                        sh_runtime *rt, sh_transport *tp);

/* Stops the events not yet due and removes the layer; call before closing the transport.
 * Accepts a zeroed cf. */
void sh__cmd_fault_stop(sh_cmd_fault *cf);

#endif
