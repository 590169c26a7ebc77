/* `shoal cluster manifest k8s|slurm CLUSTER.lua`: what Kubernetes or a Slurm job needs to run a
 * cluster script's nodes (docs/deploy.md). */
#ifndef SH_TOOLS_CMD_CLUSTER_MANIFEST_H
#define SH_TOOLS_CMD_CLUSTER_MANIFEST_H

/* argv[0] is "manifest", argv[1] "k8s" or "slurm". Writes the manifests (k8s) or the job's
 * cluster script (slurm) on stdout. Returns the exit status: 0 written, 2 bad usage or a script
 * that does not load or cannot be placed (one error line on stderr, nothing on stdout). */
int sh__cmd_cluster_manifest(int argc, char **argv);

#endif
