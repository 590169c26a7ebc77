/* Where a cluster node's key comes from (docs/cluster.md, "Cluster key"). */
#ifndef SH_ACTORS_CLUSTER_KEY_H
#define SH_ACTORS_CLUSTER_KEY_H

#include "base/auth.h"
#include "lua/config.h"

/* The environment variable `shoal node`, `shoal serve -c` and `shoal cluster up` read. */
#define SH_CLUSTER_KEY_ENV "SHOAL_CLUSTER_KEY_FILE"

/* Loads the node's cluster key from the first of: `flag` (--cluster-key-file, may be NULL), the
 * environment variable SHOAL_CLUSTER_KEY_FILE (when set and not empty), the script's
 * cluster{ key_file } (c may be NULL). None of them: *key is cleared (set = false) and the node
 * runs open, as without keys. Returns 0, or 2 with the error line in e naming the file and
 * where it was named (the file is missing, not a regular file, too short or too long). */
int sh__cluster_key_load(const char *flag, const sh_cluster_config *c, sh_auth_key *key,
                         sh_error *e);

#endif
