/* What `shoal cluster manifest` writes (docs/deploy.md): a cluster script's copy for where its
 * nodes run, made by a Lua prelude that sets every node's address (and the gateway's HTTP
 * address, and for Kubernetes the model paths) before the script runs, and the Kubernetes
 * manifests that run it. Used by tools/cmd_cluster_manifest.c (flags and wiring). */
#ifndef SH_TOOLS_CLUSTER_MANIFEST_H
#define SH_TOOLS_CLUSTER_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "lua/config.h"

/* Memory a node needs beyond its weights and KV: code, runtime, buffers, activations. */
#define NODE_OVERHEAD_MIB 256

/* `shoal cluster manifest` flags (shoal cluster manifest --help). */
typedef struct sh__manifest_opts {
    const char *kind, *script, *image, *ns, *name, *model_dir, *claim, *key_file, *hosts;
    int64_t port, http_port, threads;
    double drain_s, recover_s;
} sh__manifest_opts;

/* The whole file at path, NUL-terminated, malloc'd, its length in *len; NULL with errno set. */
char *sh__manifest_read_all(const char *path, size_t *len);

/* "tls+tcp" for a tls+tcp:// URL, else "tcp": the scheme a node keeps in its new address. */
const char *sh__manifest_scheme(const char *url);

/* The script's text src (len bytes, of file `script`) after a prelude that wraps node{},
 * cluster{} and, when model_dir is not NULL, model{}: node i (script order) gets listen =
 * addr[i], the gateway http = `http`, every model path model_dir/FILE. `who` ("k8s", "slurm")
 * names the command in the prelude's comment. Returns a malloc'd string, NULL out of memory. */
char *sh__manifest_job_script(const sh_cluster_config *c, char **addr, const char *http,
                              const char *model_dir, const char *who, const char *script,
                              const char *src, size_t len);

/* Loads text as the nodes will (named `script`, so relative paths resolve beside it) and checks
 * that node i got addr[i] and that the layout is still supported (sh__cluster_check). Returns 0,
 * or 2 after one error line on stderr. */
int sh__manifest_check_job(const char *text, const char *script, char **addr);

/* Writes the Kubernetes manifests for c (loaded from o->script, whose text is src) on stdout.
 * Returns 0, or 2 after one error line (nothing written): no worker node, tls+tcp:// nodes or a
 * policy file of the script's own (not placed yet), a model or drafter file or the key file
 * that cannot be read. */
int sh__manifest_k8s(const sh__manifest_opts *o, const sh_cluster_config *c, const char *src,
                     size_t len);

#endif
