/* `--fault-scenario FILE` of `shoal node` and `shoal serve -c`: a fault scenario (lua/config.h,
 * lua/examples/scenario-demo.lua) run against the links leaving this process, for testing how a
 * cluster behaves when a link is slow, lossy or cut; `--fault-epoch` shares one clock between the
 * processes of a cluster (`shoal chaos`, docs/chaos.md). */
#ifndef SH_TOOLS_CMD_FAULT_H
#define SH_TOOLS_CMD_FAULT_H

#include <stdbool.h>
#include <uv.h>

#include "lua/config.h"
#include "runtime/fault_scenario.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

#define SH_CMD_FAULT_LEAKS_MAX 16

typedef struct sh_cmd_fault_leak {
    struct sh_cmd_fault *cf;
    double mb_per_s, lasting_s;
    uv_thread_t thread;
    bool started;
} sh_cmd_fault_leak;

typedef struct sh_cmd_fault {
    const sh_cluster_config *c;
    sh_scenario *sc;
    sh_fault *f;
    sh_fault_runner *run;
    sh_fault_host host;
    uint32_t self; /* this process's node id */
    /* --fault-epoch @FILE: a thread waits for the file, then starts the runner. */
    char epoch_file[4096];
    uv_thread_t waiter;
    bool waiting;
    /* leak events: one thread each; the memory is freed at stop */
    uv_mutex_t mu;
    uv_cond_t cv;
    bool stop;
    void **chunks; /* (n_chunks) 1 MiB blocks, touched */
    size_t n_chunks, cap_chunks;
    sh_cmd_fault_leak leaks[SH_CMD_FAULT_LEAKS_MAX];
    int n_leaks;
} sh_cmd_fault;

/* Loads the scenario at path, checks its node names against the cluster script c, installs a
 * fault layer on rt in front of tp and starts applying the events at their times (from now).
 * Link events act on the links leaving this node; a leak event naming this node allocates and
 * touches memory at its rate (held until sh__cmd_fault_stop); kill, stop, cont, stall and other
 * nodes' leaks are left to `shoal chaos` and skipped here. Prints one line `shoal: fault scenario
 * PATH: N events`. Returns 0, or 2 with an error line (a bad script, an unknown node). cf, c, rt
 * and tp must outlive the layer (sh__cmd_fault_stop). Not from a loop thread. */
int sh__cmd_fault_start(sh_cmd_fault *cf, const char *path, const sh_cluster_config *c,
                        sh_runtime *rt, sh_transport *tp);

/* The same with --fault-epoch EPOCH (NULL: from now): "UNIX_MS" counts the events' times from
 * that wall-clock instant (milliseconds since 1970), "@FILE" from the instant written in FILE
 * (decimal UNIX_MS), waiting in the background until the file exists; a process restarted after
 * the epoch applies the events already due at once. A bad EPOCH: 2 with an error line. */
int sh__cmd_fault_start_epoch(sh_cmd_fault *cf, const char *path, const char *epoch,
                              const sh_cluster_config *c, sh_runtime *rt, sh_transport *tp);

/* Checks an --fault-epoch value's form. Returns 0, or 2 with an error line. */
int sh__cmd_fault_epoch_check(const char *epoch);

/* Stops the events not yet due and removes the layer; call before closing the transport.
 * Accepts a zeroed cf. */
void sh__cmd_fault_stop(sh_cmd_fault *cf);

#endif
