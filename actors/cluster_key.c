/* Where a cluster node's key comes from (actors/cluster_key.h). */
#include "actors/cluster_key.h"

#include <stdlib.h>

#include "base/error.h"

int sh__cluster_key_load(const char *flag, const sh_cluster_config *c, sh_auth_key *key,
                         sh_error *e)
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
    sh_error le = {0};
    if (sh__auth_key_load(path, key, &le)) {
        sh__error_set(e, le.code, "cluster key (from %s): %s", from, le.msg);
        return 2;
    }
    return 0;
}
