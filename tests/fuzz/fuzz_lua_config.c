/* Fuzz target for the Lua host: arbitrary bytes evaluated as a cluster script, a fault scenario
 * and a policy under tight memory and time limits. It must never crash, leak or hang; a success
 * must produce a config whose indices are in range. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_config(const sh_cluster_config *c)
{
    for (int32_t i = 0; i < c->n_replicas; i++) {
        const sh_config_replica *r = &c->replicas[i];
        if (r->model < 0 || r->model >= c->n_models || r->n_stages < 1)
            abort();
        for (int32_t j = 0; j < r->n_stages; j++)
            if (r->stages[j].node < 0 || r->stages[j].node >= c->n_nodes ||
                c->nodes[r->stages[j].node].standby)
                abort();
    }
    if (c->gateway.node < 0 || c->gateway.node >= c->n_nodes || !c->watchdog.policy)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    sh_lua_limits lim = {.memory_bytes = 4u << 20, .time_ms = 50};
    sh_error e;
    sh_cluster_config *c = NULL;
    if (sh_config_load_string((const char *)data, size, "fuzz.lua", &lim, &c, &e) == SH_OK)
        check_config(c);
    sh_scenario *s = NULL;
    if (sh_scenario_load_string((const char *)data, size, "fuzz.lua", &lim, &s, &e) == SH_OK) {
        for (size_t i = 1; i < s->n_events; i++)
            if (s->events[i].time_s < s->events[i - 1].time_s)
                abort();
        if (c)
            sh_scenario_check(s, c, &e);
    }
    sh_scenario_destroy(s);
    sh_config_destroy(c);
    sh_policy *p = NULL;
    if (sh_policy_create(&lim, &p, &e) == SH_OK &&
        sh_policy_load_string(p, (const char *)data, size, "fuzz.lua", &e) == SH_OK) {
        sh_policy_metrics m = {.queue_wait_p99_ms = 700, .kv_used = 0.5};
        int32_t level;
        if (sh_policy_level(p, &m, &level, &e) == SH_OK && (level < 0 || level > 4))
            abort();
    }
    sh_policy_destroy(p);
    return 0;
}
