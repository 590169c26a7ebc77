/* The `shoal` command-line program: dispatches to its subcommands. */
#include <stdio.h>
#include <string.h>

#include "base/file.h"
#include "shoal.h"
#include "tools/cmd.h"

typedef struct command {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} command;

static const command commands[] = {
    {"inspect", sh__cmd_inspect, "print a GGUF file's metadata and tensor table"},
    {"tokenize", sh__cmd_tokenize, "encode text with a model's tokenizer, or decode ids"},
    {"run", sh__cmd_run, "generate text from a model"},
    {"mkmodel", sh__cmd_mkmodel, "write a GGUF with seeded random weights for a named shape"},
    {"quantize", sh__cmd_quantize,
     "convert a GGUF model's weights to another type (F16, Q8_0, Q4_K, ...)"},
    {"serve", sh__cmd_serve, "serve a model over an OpenAI-compatible HTTP API"},
    {"node", sh__cmd_node, "run one worker node of a cluster script (pipeline stages)"},
    {"cluster", sh__cmd_cluster,
     "cluster up: run every node of a local cluster script, supervised; cluster status: "
     "print a running cluster's nodes, stages and load"},
    {"bench", sh__cmd_bench, "load-test an OpenAI-compatible server"},
    {"chaos", sh__cmd_chaos,
     "run a fault scenario against a local cluster under load; report lost and wrong requests"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal COMMAND [ARGS]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n`shoal COMMAND --help` describes each command. `shoal --version` prints %s.\n",
            SH_VERSION_STRING);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    /* A model file truncated while mapped reads as zeros and fails the work that reads it, with
     * an error, instead of killing the process with SIGBUS (base/file.h). */
    if (sh__file_guard_install() != SH_OK)
        fprintf(stderr, "shoal: warning: no SIGBUS guard (sigaction failed)\n");
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
        printf("shoal %s\n", sh_version());
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(cmd, commands[i].name) == 0)
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "error: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
