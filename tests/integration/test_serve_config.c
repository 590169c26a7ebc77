/* `shoal serve -c` and `-m` as real processes: cluster scripts it cannot run in one process are
 * refused (exit 2, one `error:` line), a FIFO model is refused without hanging, model paths in a
 * script are relative to the script, and --port keeps the script's host. */
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sh_test.h"

#define STORIES "tests/data/stories260K/stories260K.gguf"
#define EXIT_TIMEOUT_MS 30000 /* a refused command answers at once; past this it hangs */

static char tmpdir[256];
static char err_buf[1 << 16];

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = 0;
    if (f) {
        n = fread(buf, 1, cap - 1, f);
        fclose(f);
    }
    buf[n] = '\0';
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Starts `shoal serve ARGS...` in directory `cwd` with stdin from /dev/null and stdout and
 * stderr into tmpdir/err; returns the pid (-1 on failure). */
static pid_t start(const char *cwd, const char *const *args)
{
    const char *bin = getenv("SH_SHOAL");
    char err_path[300];
    snprintf(err_path, sizeof err_path, "%s/err", tmpdir);
    const char *argv[32];
    int n = 0;
    argv[n++] = bin;
    argv[n++] = "serve";
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        int fi = open("/dev/null", O_RDONLY);
        int fe = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fi < 0 || fe < 0 || chdir(cwd) != 0)
            _exit(127);
        dup2(fi, 0);
        dup2(fe, 1);
        dup2(fe, 2);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* Waits up to ms for the child; kills it when it is still running then. Returns the exit code,
 * 128+signal, or -1 when it had to be killed (a hang). Reads its output into err_buf. */
static int finish(pid_t pid, int ms)
{
    int status = 0, rc = -1;
    uint64_t end = now_ms() + (uint64_t)ms;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            break;
        }
        if (r < 0 || now_ms() >= end) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            break;
        }
        usleep(10000);
    }
    char err_path[300];
    snprintf(err_path, sizeof err_path, "%s/err", tmpdir);
    slurp(err_path, err_buf, sizeof err_buf);
    return rc;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* `shoal serve ARGS` run from the source directory must exit 2 at once with exactly one
 * `error:` line holding `want`. */
static void expect_refused(const char *label, const char *want, const char *const *args)
{
    pid_t pid = start(sh_test_path(""), args);
    CHECK(pid > 0);
    if (pid <= 0)
        return;
    int rc = finish(pid, EXIT_TIMEOUT_MS);
    if (rc == -1)
        SH_FAIL_("%s: still running after %d ms (killed); output: %.300s", label, EXIT_TIMEOUT_MS,
                 err_buf);
    else if (rc != 2)
        SH_FAIL_("%s: exit %d, expected 2; output: %.300s", label, rc, err_buf);
    else if (strncmp(err_buf, "error: ", 7) != 0 || count_lines(err_buf) != 1)
        SH_FAIL_("%s: output is not one error line: \"%s\"", label, err_buf);
    else if (!strstr(err_buf, want))
        SH_FAIL_("%s: \"%s\" lacks \"%s\"", label, err_buf, want);
}

/* As expect_refused, for a command that may print progress lines first (the front's join):
 * exit 2 with exactly one `error:` line, holding `want`. */
static void expect_error_line(const char *label, const char *want, const char *const *args)
{
    pid_t pid = start(sh_test_path(""), args);
    CHECK(pid > 0);
    if (pid <= 0)
        return;
    int rc = finish(pid, EXIT_TIMEOUT_MS);
    const char *line = strstr(err_buf, "error: ");
    if (rc != 2)
        SH_FAIL_("%s: exit %d, expected 2; output: %.300s", label, rc, err_buf);
    else if (!line || (line != err_buf && line[-1] != '\n') || strstr(line + 1, "error: "))
        SH_FAIL_("%s: not one error line: \"%s\"", label, err_buf);
    else if (!strstr(line, want))
        SH_FAIL_("%s: \"%s\" lacks \"%s\"", label, line, want);
}

/* Defect 10 of issue 10: a gateway on one node and the stage on a tcp:// node was accepted and
 * run in this one process. Now that process is the front: it waits for worker 'b' to join and,
 * with nobody listening there, exits 2 naming it (a standby too: it joins like a worker). What is
 * not built yet (a worker node holding stages of two models) is refused by name. */
static void test_multi_node_refused(void)
{
    char script[300];
    snprintf(script, sizeof script, "%s/two-nodes.lua", tmpdir);
    char src[1024];
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'tcp://127.0.0.1:7301' },\n"
             "            node { name = 'b', listen = 'tcp://127.0.0.1:7302' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'b' }) } },\n"
             "}\n",
             sh_test_path(STORIES));
    write_text(script, src);
    const char *two[] = {"-c", script, "--port", "0", "--join-timeout", "0.5", NULL};
    expect_error_line("2-node script, worker absent", "did not join within 0.5 s", two);
    CHECK(strstr(err_buf, "'b' (tcp://127.0.0.1:7302)") != NULL);
    // A standby node joins like a worker: the front waits for it too and names it.
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'tcp://127.0.0.1:7301' },\n"
             "            node { name = 'b', listen = 'tcp://127.0.0.1:7302' },\n"
             "            node { name = 's', listen = 'tcp://127.0.0.1:7303', standby = true } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'b' }) } },\n"
             "}\n",
             sh_test_path(STORIES));
    write_text(script, src);
    expect_error_line("a standby absent", "did not join within 0.5 s", two);
    CHECK(strstr(err_buf, "'s' (tcp://127.0.0.1:7303)") != NULL);
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "local m2 = model { path = '%s', name = 'stories2' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'tcp://127.0.0.1:7301' },\n"
             "            node { name = 'b', listen = 'tcp://127.0.0.1:7302' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'b' }) },\n"
             "               replica { model = m2, stages = pipeline(m2, { 'b' }) } },\n"
             "}\n",
             sh_test_path(STORIES), sh_test_path(STORIES));
    write_text(script, src);
    expect_refused("one worker holding stages of 2 models",
                   "node 'b' holds stages of replica 1 (model 'stories') and replica 2 (model "
                   "'stories2'): a worker node serves one model",
                   two);
    unlink(script);
}

/* Defect 4: a FIFO as the model blocked in open() for ever. */
static void test_fifo_model(void)
{
    char fifo[300];
    snprintf(fifo, sizeof fifo, "%s/model.fifo", tmpdir);
    CHECK_INT_EQ(mkfifo(fifo, 0600), 0);
    const char *a[] = {"-m", fifo, "--port", "0", NULL};
    expect_refused("-m FIFO", "model.fifo: not a regular file (a FIFO)", a);
    const char *d[] = {"-m", "/dev/zero", "--port", "0", NULL};
    expect_refused("-m /dev/zero", "not a regular file (a character device)", d);
    unlink(fifo);
}

static void test_memory_too_large(void)
{
    char script[300], src[1024];
    snprintf(script, sizeof script, "%s/huge.lua", tmpdir);
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'inproc://a' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
             "  kv = { memory = '999999TiB' },\n"
             "}\n",
             sh_test_path(STORIES));
    write_text(script, src);
    const char *a[] = {"-c", script, NULL};
    expect_refused("memory 999999TiB", "is too large (\"999999TiB\"): the maximum is", a);
    // kv.type: only "f32" or "f16".
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'inproc://a' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
             "  kv = { type = 'q8' },\n"
             "}\n",
             sh_test_path(STORIES));
    write_text(script, src);
    expect_refused("kv type q8", "cluster.kv: type 'q8' must be \"f32\" or \"f16\"", a);
    unlink(script);
}

/* A script beside its model names it by a relative path and is run from another directory; its
 * gateway.http host stays when --port replaces the port; its kv.type = "f32" gives an F32 KV
 * cache (the startup line says so). */
static void test_script_dir_and_host(void)
{
    char sub[300], script[400], link[400], src[1024];
    snprintf(sub, sizeof sub, "%s/conf", tmpdir);
    CHECK_INT_EQ(mkdir(sub, 0700), 0);
    snprintf(link, sizeof link, "%s/stories.gguf", sub);
    CHECK_INT_EQ(symlink(sh_test_path(STORIES), link), 0);
    snprintf(script, sizeof script, "%s/local.lua", sub);
    snprintf(src, sizeof src,
             "local m = model { path = 'stories.gguf', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'inproc://a' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.2:1' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
             "  kv = { memory = '16MiB', type = 'f32' },\n"
             "}\n");
    write_text(script, src);
    const char *a[] = {"-c", script, "--port", "0", "-t", "1", NULL};
    pid_t pid = start("/", a);
    CHECK(pid > 0);
    if (pid > 0) {
        char err_path[300];
        snprintf(err_path, sizeof err_path, "%s/err", tmpdir);
        bool listening = false, exited = false;
        uint64_t end = now_ms() + 60000;
        while (now_ms() < end && !listening && !exited) {
            usleep(20000);
            slurp(err_path, err_buf, sizeof err_buf);
            listening = strstr(err_buf, "listening on http://") != NULL;
            exited = waitpid(pid, NULL, WNOHANG) == pid;
        }
        if (!listening)
            SH_FAIL_("serve -c (script-relative model) did not listen: %.500s", err_buf);
        else if (!strstr(err_buf, "listening on http://127.0.0.2:"))
            SH_FAIL_("--port replaced the script's host 127.0.0.2: %.500s", err_buf);
        else if (!strstr(err_buf, " MiB f32), prefix cache"))
            SH_FAIL_("kv.type = 'f32' did not give an F32 KV cache: %.500s", err_buf);
        if (!exited) {
            kill(pid, SIGTERM);
            int rc = finish(pid, 30000);
            CHECK(rc != -1);
        }
    }
    unlink(script);
    unlink(link);
    rmdir(sub);
}

static const sh_test_case tests[] = {
    {"multi_node_refused", test_multi_node_refused},
    {"fifo_model", test_fifo_model},
    {"memory_too_large", test_memory_too_large},
    {"script_dir_and_host", test_script_dir_and_host},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!getenv("SH_SHOAL")) {
        fprintf(stderr, "skip: SH_SHOAL is not set\n");
        return SH_TEST_SKIP;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal-serve-config-XXXXXX");
    if (!mkdtemp(tmpdir))
        return 1;
    int rc = sh_test_main(argc, argv, tests);
    char p[300];
    snprintf(p, sizeof p, "%s/err", tmpdir);
    unlink(p);
    rmdir(tmpdir);
    return rc;
}
