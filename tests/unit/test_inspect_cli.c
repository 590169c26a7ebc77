/* `shoal inspect` as a real process: output on valid files, one `error:` line and exit code 2 on
 * broken ones, never a signal. */
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sh_test.h"
#include "test_gguf_util.h"

extern char **environ;

static char tmpdir[512];

typedef struct result {
    int status; /* from waitpid; -1 when the spawn failed */
    bool hung;  /* killed after RUN_TIMEOUT_MS */
    char *out, *err;
} result;

#define RUN_TIMEOUT_MS 20000 /* a run that takes longer hangs (a FIFO given as the file) */

/* waitpid with a deadline: a child still running after ms is killed and *hung set. */
static pid_t wait_for(pid_t pid, int *status, int ms, bool *hung)
{
    *hung = false;
    for (int waited = 0;; waited += 10) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r != 0)
            return r;
        if (waited >= ms) {
            *hung = true;
            kill(pid, SIGKILL);
            return waitpid(pid, status, 0);
        }
        usleep(10000);
    }
}

static char *slurp(const char *path)
{
    size_t n = 0;
    uint8_t *p = gw_read_file(path, &n);
    char *s = malloc(n + 1);
    if (n)
        memcpy(s, p, n);
    s[n] = '\0';
    free(p);
    return s;
}

/* Runs `shoal inspect ARGS...` with stdout and stderr captured in files. */
static result run_inspect(const char *const *args)
{
    result r = {-1, false, NULL, NULL};
    const char *shoal = getenv("SH_SHOAL");
    char out[600], err[600];
    snprintf(out, sizeof out, "%s/stdout", tmpdir);
    snprintf(err, sizeof err, "%s/stderr", tmpdir);
    char *argv[16] = {(char *)shoal, "inspect"};
    int argc = 2;
    for (; args[argc - 2] && argc < 15; argc++)
        argv[argc] = (char *)args[argc - 2];
    argv[argc] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    pid_t pid;
    if (posix_spawn(&pid, shoal, &fa, NULL, argv, environ) == 0 &&
        wait_for(pid, &r.status, RUN_TIMEOUT_MS, &r.hung) == pid)
        ;
    else
        r.status = -1;
    posix_spawn_file_actions_destroy(&fa);
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
}

static void result_free(result *r)
{
    free(r->out);
    free(r->err);
}

static int exit_code(const result *r)
{
    if (r->status == -1)
        return -1;
    if (WIFSIGNALED(r->status))
        return 128 + WTERMSIG(r->status);
    return WEXITSTATUS(r->status);
}

/* Expects exit 2, nothing on stdout and exactly one stderr line beginning "error: ". */
static void expect_error(const char *path, const char *label, const char *want)
{
    const char *args[] = {path, NULL};
    result r = run_inspect(args);
    if (r.hung)
        SH_FAIL_("%s: still running after %d ms (killed)", label, RUN_TIMEOUT_MS);
    else if (r.status != -1 && WIFSIGNALED(r.status))
        SH_FAIL_("%s: killed by signal %d", label, WTERMSIG(r.status));
    if (exit_code(&r) != 2)
        SH_FAIL_("%s: exit %d, expected 2; stderr: %s", label, exit_code(&r), r.err);
    size_t len = strlen(r.err);
    const char *nl = strchr(r.err, '\n');
    if (strncmp(r.err, "error: ", 7) != 0 || !nl || nl != r.err + len - 1)
        SH_FAIL_("%s: stderr is not one 'error: ' line: \"%s\"", label, r.err);
    if (want && !strstr(r.err, want))
        SH_FAIL_("%s: stderr \"%s\" lacks \"%s\"", label, r.err, want);
    if (r.out[0])
        SH_FAIL_("%s: printed to stdout: %.200s", label, r.out);
    result_free(&r);
}

static bool have_shoal(void)
{
    const char *s = getenv("SH_SHOAL");
    return s && access(s, X_OK) == 0;
}

static void test_valid(void)
{
    const char *a1[] = {sh_test_path("tests/data/stories260K/stories260K.gguf"), NULL};
    result r = run_inspect(a1);
    CHECK_INT_EQ(exit_code(&r), 0);
    CHECK(strstr(r.out, "architecture") && strstr(r.out, "\"llama\""));
    CHECK(strstr(r.out, "block_count") && strstr(r.out, "blk.4.ffn_norm.weight"));
    CHECK(strstr(r.out, "[64, 512]") != NULL);
    CHECK(strstr(r.out, "... (512 total)") != NULL);
    CHECK_STR_EQ(r.err, "");
    result_free(&r);

    const char *a2[] = {"--no-tensors",
                        sh_test_path("tests/data/tiny-random/llama-2-tiny-random.gguf"), NULL};
    r = run_inspect(a2);
    CHECK_INT_EQ(exit_code(&r), 0);
    CHECK(strstr(r.out, "F16") != NULL);
    CHECK(strstr(r.out, "token_embd.weight") == NULL);
    result_free(&r);

    const char *a3[] = {sh_test_path("tests/data/vocab/ggml-vocab-phi-3.gguf"), "--all", NULL};
    r = run_inspect(a3);
    CHECK_INT_EQ(exit_code(&r), 0);
    CHECK(strstr(r.out, " total)") == NULL); /* --all prints arrays in full */
    CHECK(strlen(r.out) > 100000);
    result_free(&r);
}

static void test_usage(void)
{
    static const char *const cases[][3] = {
        {NULL}, {"--bogus", "x.gguf", NULL}, {"a.gguf", "b.gguf", NULL}};
    for (size_t i = 0; i < 3; i++) {
        result r = run_inspect(cases[i]);
        CHECK_INT_EQ(exit_code(&r), 2);
        CHECK(strstr(r.err, "usage: shoal inspect") != NULL);
        result_free(&r);
    }
    const char *h[] = {"--help", NULL};
    result r = run_inspect(h);
    CHECK_INT_EQ(exit_code(&r), 0);
    CHECK(strstr(r.out, "usage: shoal inspect") != NULL);
    result_free(&r);
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        if (n)
            CHECK(fwrite(p, 1, n, f) == n);
        fclose(f);
    }
}

static void test_broken(void)
{
    size_t n;
    uint8_t *real = gw_read_file(sh_test_path("tests/data/stories260K/stories260K.gguf"), &n);
    CHECK(real != NULL);
    if (!real)
        return;
    gb absurd = {0}, v1 = {0}, dup = {0};
    gb_header(&absurd, 3, 1ull << 63, 0), gb_fill(&absurd, 64, 0);
    gb_header(&v1, 1, 0, 0);
    gb_header(&dup, 3, 0, 2), gb_kv_u32(&dup, "k", 1), gb_kv_u32(&dup, "k", 2);
    uint8_t magic[64];
    memcpy(magic, real, sizeof magic);
    memcpy(magic, "\x78\x56\x34\x12", 4);
    const struct {
        const char *name;
        const void *p;
        size_t n;
        const char *want;
    } files[] = {
        {"truncated-kv.gguf", real, 1000, "truncated"},
        {"truncated-data.gguf", real, 20000, "beyond the data section"},
        {"bad-magic.gguf", magic, sizeof magic, "bad magic 0x12345678 (not a GGUF file)"},
        {"absurd-count.gguf", absurd.p, absurd.n, "n_tensors"},
        {"v1.gguf", v1.p, v1.n, "version 1"},
        {"dup-key.gguf", dup.p, dup.n, "duplicate key 'k'"},
        {"empty.gguf", "", 0, "too short"},
        {"bad\nname.gguf", magic, sizeof magic, "bad magic"},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[700];
        snprintf(path, sizeof path, "%s/%s", tmpdir, files[i].name);
        write_file(path, files[i].p, files[i].n);
        expect_error(path, files[i].name, files[i].want);
        unlink(path);
    }
    char path[700];
    snprintf(path, sizeof path, "%s/missing.gguf", tmpdir);
    expect_error(path, "missing file", "missing.gguf");
    expect_error(tmpdir, "directory", "not a regular file (a directory)");
    /* A FIFO used to block open() for ever, and a device would never end: refused unread. */
    snprintf(path, sizeof path, "%s/model.fifo", tmpdir);
    CHECK_INT_EQ(mkfifo(path, 0600), 0);
    expect_error(path, "FIFO", "model.fifo: not a regular file (a FIFO)");
    unlink(path);
    expect_error("/dev/zero", "character device", "not a regular file (a character device)");
    gb_free(&absurd), gb_free(&v1), gb_free(&dup);
    free(real);
}

static const sh_test_case tests[] = {
    {"valid", test_valid},
    {"usage", test_usage},
    {"broken", test_broken},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!have_shoal()) {
        fprintf(stderr, "SH_SHOAL is not set to the shoal binary: skipped\n");
        return SH_TEST_SKIP;
    }
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/sh_inspect_XXXXXX", t && t[0] ? t : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    char p[600];
    snprintf(p, sizeof p, "%s/stdout", tmpdir), unlink(p);
    snprintf(p, sizeof p, "%s/stderr", tmpdir), unlink(p);
    rmdir(tmpdir);
    return rc;
}
