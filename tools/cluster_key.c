/* Where a cluster node's key comes from (tools/cluster_key.h). */
#include "tools/cluster_key.h"

#include <stdlib.h>

#include "tools/cmd_util.h"

int sh__cluster_key_load(const char *flag, const sh_cluster_config *c, sh_auth_key *key)
{
    const char *env = getenv(SH_CLUSTER_KEY_ENV);
    const char *path = NULL, *from = NULL;
    if (flag) {
        path = flag;
        from = "--cluster-key-file";
    } else if (env && *env) {
        path = env;
        from = SH_CLUSTER_KEY_ENV;
    } else if (c && c->key_file) {
        path = c->key_file;
        from = "the script's cluster.key_file";
    }
    if (!path) {
        *key = (sh_auth_key){0};
        return 0;
    }
    sh_error e = {0};
    if (sh__auth_key_load(path, key, &e))
        return sh__cmd_fail("cluster key (from %s): %s", from, e.msg);
    return 0;
}
