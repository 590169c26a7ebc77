/* `shoal cluster policy reload [URL]`: asks a running `shoal serve` to reload its degradation
 * policy (POST /admin/policy/reload, docs/serving.md "Degradation"). */
#ifndef SH_TOOLS_CMD_CLUSTER_POLICY_H
#define SH_TOOLS_CMD_CLUSTER_POLICY_H

/* argv[0] is "policy". Returns the exit status: 0 reloaded, 1 refused (the script's error is
 * printed; the old policy stays), 2 bad usage or the server not reachable or refusing the key. */
int sh__cmd_cluster_policy(int argc, char **argv);

#endif
