/* `shoal tokenize` end to end: ids, pieces, --no-bos, --special, --decode, and the exit codes of
 * bad arguments and bad files. Runs the binary named by SH_SHOAL (set by ctest); skips without it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sh_test.h"

static const char *shoal;

/* Runs `shoal tokenize ARGS` with stderr folded into stdout; returns the exit code and the output
 * in out (truncated to cap). A run still going after 20 s is killed (exit 137): it hangs. */
static int run(const char *args, char *out, size_t cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout -s KILL 20 '%s' tokenize %s 2>&1",
             sh_test_path(""), shoal, args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#define SPM "-m tests/data/vocab/ggml-vocab-llama-spm.gguf"

static void test_encode(void)
{
    char out[4096];
    CHECK_INT_EQ(run(SPM " -p 'Hello world'", out, sizeof out), 0);
    CHECK_STR_EQ(out, "1 15043 3186\n");
    CHECK_INT_EQ(run(SPM " -p 'Hello world' --no-bos", out, sizeof out), 0);
    CHECK_STR_EQ(out, "15043 3186\n");
    CHECK_INT_EQ(run(SPM " -p 'Hello world' --pieces", out, sizeof out), 0);
    CHECK_STR_EQ(out, "1 \"<s>\"\n15043 \" Hello\"\n3186 \" world\"\n");
    CHECK_INT_EQ(run(SPM " -f tests/data/tokenizer/code.txt --no-bos", out, sizeof out), 0);
    CHECK(strlen(out) > 100);
    CHECK_INT_EQ(run("-m tests/data/vocab/ggml-vocab-starcoder.gguf -p '<fim_prefix>x' --special",
                     out, sizeof out),
                 0);
    CHECK(strncmp(out, "1 ", 2) == 0);
    CHECK_INT_EQ(
        run("-m tests/data/vocab/ggml-vocab-starcoder.gguf -p '<fim_prefix>x'", out, sizeof out),
        0);
    CHECK(strncmp(out, "1 ", 2) != 0);
}

static void test_decode(void)
{
    char out[4096];
    CHECK_INT_EQ(run(SPM " --decode '1 15043 3186'", out, sizeof out), 0);
    CHECK_STR_EQ(out, "Hello world\n");
    CHECK_INT_EQ(run(SPM " --decode '1,15043,3186' --special", out, sizeof out), 0);
    CHECK_STR_EQ(out, "<s>Hello world\n");
}

static void test_errors(void)
{
    char out[4096];
    CHECK_INT_EQ(run("", out, sizeof out), 2);
    CHECK(strstr(out, "usage:") != NULL);
    CHECK_INT_EQ(run(SPM, out, sizeof out), 2);
    CHECK_INT_EQ(run(SPM " -p x --decode 1", out, sizeof out), 2);
    CHECK_INT_EQ(run(SPM " -p x --bogus", out, sizeof out), 2);
    CHECK_INT_EQ(run(SPM " -p", out, sizeof out), 2);
    /* A bad file: one `error: ` line. */
    CHECK_INT_EQ(run("-m tests/data/no-such.gguf -p x", out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0 && strchr(out, '\n') == out + strlen(out) - 1);
    CHECK_INT_EQ(run("-m tests/data/README.md -p x", out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0 && strchr(out, '\n') == out + strlen(out) - 1);
    CHECK_INT_EQ(run(SPM " --decode '1 99999'", out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0);
    CHECK_INT_EQ(run(SPM " -f tests/data/no-such.txt", out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0);
}

/* Defect 4 of issue 10: a FIFO as the model blocked open() for ever; devices are refused too. */
static void test_special_files(void)
{
    char dir[] = "/tmp/sh_tok_cli_XXXXXX", fifo[64], args[256], out[4096];
    if (!mkdtemp(dir)) {
        SH_FAIL_("mkdtemp failed");
        return;
    }
    snprintf(fifo, sizeof fifo, "%s/model.fifo", dir);
    CHECK_INT_EQ(mkfifo(fifo, 0600), 0);
    snprintf(args, sizeof args, "-m '%s' -p x", fifo);
    CHECK_INT_EQ(run(args, out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0 && strchr(out, '\n') == out + strlen(out) - 1);
    CHECK(strstr(out, "model.fifo: not a regular file (a FIFO)") != NULL);
    CHECK_INT_EQ(run("-m /dev/zero -p x", out, sizeof out), 2);
    CHECK(strncmp(out, "error: ", 7) == 0 && strchr(out, '\n') == out + strlen(out) - 1);
    CHECK(strstr(out, "not a regular file (a character device)") != NULL);
    unlink(fifo);
    rmdir(dir);
}

static const sh_test_case tests[] = {
    {"encode", test_encode},
    {"decode", test_decode},
    {"errors", test_errors},
    {"special_files", test_special_files},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    shoal = getenv("SH_SHOAL");
    if (!shoal || !*shoal) {
        fprintf(stderr, "skip: SH_SHOAL is not set\n");
        return SH_TEST_SKIP;
    }
    return sh_test_main(argc, argv, tests);
}
