/* Which node of a cluster script this process is: `--name NAME`, or `--name-from VAR` (a node's
 * name, or a rank, read from an environment variable that Slurm, systemd or Kubernetes sets), or
 * SHOAL_NODE when neither is given (docs/deploy.md, "Node identity"). */
#ifndef SH_TOOLS_NODE_IDENTITY_H
#define SH_TOOLS_NODE_IDENTITY_H

#include <stdbool.h>
#include <stdint.h>

#include "lua/config.h"

/* The variable read when neither --name nor --name-from is given. */
#define SH_NODE_IDENTITY_ENV "SHOAL_NODE"

/* The help text of --name-from, for `shoal node` and `shoal serve`. */
#define SH_NODE_IDENTITY_HELP                                                                      \
    "  --name-from VAR     take the node's name from environment variable VAR: a\n"                \
    "                      node's name, or a rank k (a number, or a name ending in\n"              \
    "                      -k such as shoal-2): the script's k-th worker node,\n"                  \
    "                      0-based, the gateway's node left out (docs/deploy.md);\n"               \
    "                      without --name and --name-from, " SH_NODE_IDENTITY_ENV " if set\n"

/* `shoal node`'s flags that say which node it is and how long it waits for its own address:
 * --name, --name-from and --join-timeout as given (join_ms: SH_REPLICA_JOIN_TIMEOUT_MS when not
 * given, set by the caller). */
typedef struct sh_node_identity {
    const char *name, *from;
    uint32_t join_ms;
} sh_node_identity;

/* The help text of --join-timeout for `shoal node`. */
#define SH_NODE_IDENTITY_JOIN_HELP                                                                 \
    "  --join-timeout S    how long to wait for the host name of this node's own\n"                \
    "                      address to resolve (DNS not ready yet; default 60)\n"

/* Takes argv[*i] when it is --name, --name-from or --join-timeout (with its value: *i moves past
 * it). Returns 0 when taken, 1 when argv[*i] is another flag, 2 after an error line (no value, a
 * bad --join-timeout). */
int sh__node_identity_flag(sh_node_identity *id, int argc, char **argv, int *i);

/* Checks the flags before the script is read: --name and --name-from together, or neither and
 * no SHOAL_NODE when `required`. Returns 0, or 2 after one error line (`cmd` names the command
 * in it, e.g. "shoal node"). */
int sh__node_identity_check(const char *name, const char *from, bool required, const char *cmd);

/* The node this process is in script c: `name` when given (returned as is; the caller checks
 * that the script has it), else the value of variable `from` (or SHOAL_NODE when from is NULL
 * and it is set) as a node's name, else as a rank: a decimal number k, or a value ending in "-k"
 * (a StatefulSet pod's host name): the k-th worker node in the script's order, the gateway's
 * node skipped. A fully qualified host name that is no node's name is read by its first label
 * (shoal-2.shoal.default.svc: shoal-2). `front` (`shoal serve -c`): the node found must be the
 * gateway's. *out points into c (or is `name`); NULL with 0 when nothing names a node (name and
 * from NULL, no SHOAL_NODE). Returns 0, or 2 after one error line: the variable not set or empty, a
 * value that is neither a node nor a rank, a rank past the script's worker nodes (the line gives
 * their count), or a front that is not the gateway's node. Prints "shoal: node NAME (from
 * VAR=VALUE)" when the name came from a variable. */
int sh__node_identity_resolve(const sh_cluster_config *c, const char *script, const char *name,
                              const char *from, bool front, const char **out);

#endif
