/* A fault scenario against this process's own links (tools/cmd_fault.h). */
#include "tools/cmd_fault.h"

#include <stdio.h>
#include <string.h>

#include "tools/cmd_util.h"

static uint32_t node_id(void *ud, const char *name)
{
    const sh_cmd_fault *cf = ud;
    int32_t i = sh_config_find_node(cf->c, name);
    return i < 0 ? 0 : (uint32_t)i + 1;
}

int sh__cmd_fault_start(sh_cmd_fault *cf, const char *path, const sh_cluster_config *c,
                        sh_runtime *rt, sh_transport *tp)
{
    memset(cf, 0, sizeof *cf);
    cf->c = c;
    sh_error e = {0};
    if (sh_scenario_load_file(path, NULL, &cf->sc, &e) || sh_scenario_check(cf->sc, c, &e))
        return sh__cmd_fail("--fault-scenario: %s", e.msg);
    sh_transport_hooks next;
    sh_transport_hooks_get(tp, &next);
    sh_fault_opts fo = {.seed = 1, .next = &next};
    if (sh_fault_create(rt, &fo, &cf->f, &e))
        return (sh__cmd_fail("--fault-scenario: %s", e.msg), 1);
    cf->host = (sh_fault_host){.ud = cf, .node_id = node_id};
    sh_fault *layers[1] = {cf->f};
    if (sh_fault_runner_start(cf->sc, layers, 1, &cf->host, &cf->run, &e))
        return (sh__cmd_fail("--fault-scenario: %s", e.msg), 1);
    fprintf(stderr, "shoal: fault scenario %s: %zu events\n", path, cf->sc->n_events);
    fflush(stderr);
    return 0;
}

void sh__cmd_fault_stop(sh_cmd_fault *cf)
{
    sh_fault_runner_destroy(cf->run);
    sh_fault_destroy(cf->f);
    sh_scenario_destroy(cf->sc);
    memset(cf, 0, sizeof *cf);
}
