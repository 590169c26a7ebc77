/* The subcommands of the `shoal` program; each lives in tools/cmd_<name>.c. */
#ifndef SH_TOOLS_CMD_H
#define SH_TOOLS_CMD_H

/* Each takes the arguments after the subcommand name (argv[0] is the subcommand) and returns the
 * process exit code: 0 on success, 1 on a runtime failure, 2 on bad usage or bad input files. */
int sh__cmd_inspect(int argc, char **argv);
int sh__cmd_mkmodel(int argc, char **argv);
int sh__cmd_quantize(int argc, char **argv);
int sh__cmd_tokenize(int argc, char **argv);
int sh__cmd_run(int argc, char **argv);
int sh__cmd_serve(int argc, char **argv);
int sh__cmd_node(int argc, char **argv);
int sh__cmd_cluster(int argc, char **argv);
int sh__cmd_bench(int argc, char **argv);
int sh__cmd_chaos(int argc, char **argv);

#endif
