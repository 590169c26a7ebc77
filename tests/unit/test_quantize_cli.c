/* Tests of `shoal quantize` run as a real process (the binary's path comes in SH_SHOAL): bad
 * arguments and bad files give one `error:` line, exit 2 and no output file or temporary left
 * behind; good runs print per-tensor progress and a summary; `shoal run` runs every type. */
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/gguf_write.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_qcliXXXXXX";
static const char *shoal;

static const char *tmp_path(const char *name)
{
    static char buf[8][512];
    static int k;
    char *b = buf[k++ & 7];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
}

/* Runs `shoal SUB ARGS` with stdout and stderr captured (outside the temporary directory, which
 * the leftover checks count); returns the exit code. */
static int run(const char *sub, const char *args, char *out, size_t out_cap, char *err,
               size_t err_cap)
{
    char *cmd = NULL, o[600], e[600];
    snprintf(o, sizeof o, "%s.stdout", dir);
    snprintf(e, sizeof e, "%s.stderr", dir);
    if (asprintf(&cmd, "'%s' %s %s >'%s' 2>'%s'", shoal, sub, args, o, e) < 0)
        return -1;
    int st = system(cmd);
    free(cmd);
    slurp(o, out, out_cap);
    slurp(e, err, err_cap);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static int count_dir(void)
{
    int n = 0;
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d));)
        n += de->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

static sh_err fill_zero(void *user, const sh_gguf_write_tensor *t, uint64_t row0, uint64_t n_rows,
                        void *dst, sh_error *e)
{
    (void)user, (void)row0, (void)e;
    memset(dst, 0, (size_t)(n_rows * t->row_bytes));
    return SH_OK;
}

/* The input files of the bad cases: a model, a truncated copy, one with an IQ3_S matrix, one
 * whose IQ4_NL matrix has a byte less than its shape needs. */
static void make_inputs(void)
{
    char out[4096], err[4096], args[1024];
    snprintf(args, sizeof args,
             "--shape custom --layers 2 --dim 256 --ffn 320 --heads 4 --kv-heads 2 --vocab 512 "
             "--type F32 --seed 7 -o '%s'",
             tmp_path("a.gguf"));
    CHECK_INT_EQ(run("mkmodel", args, out, sizeof out, err, sizeof err), 0);
    FILE *f = fopen(tmp_path("a.gguf"), "rb"), *g = fopen(tmp_path("trunc.gguf"), "wb");
    CHECK(f && g);
    static char buf[1 << 20];
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    CHECK(n == sizeof buf);
    if (g)
        fwrite(buf, 1, n / 2, g);
    if (f)
        fclose(f);
    if (g)
        fclose(g);
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    uint64_t ne[2] = {256, 4};
    CHECK_OK(sh__gguf_write_create(&w, &e));
    CHECK_OK(sh__gguf_write_set_str(w, "general.architecture", "llama", &e));
    CHECK_OK(sh__gguf_write_add_tensor(w, "blk.0.ffn_up.weight", SH_DTYPE_IQ3_S, 2, ne, fill_zero,
                                       NULL, &e));
    CHECK_OK(sh__gguf_write_file(w, tmp_path("iq4.gguf"), &e));
    sh__gguf_write_destroy(w);
    /* 4 rows of 256 IQ4_NL elements are 576 bytes, the end of the file (no padding after). */
    w = NULL;
    CHECK_OK(sh__gguf_write_create(&w, &e));
    CHECK_OK(sh__gguf_write_set_str(w, "general.architecture", "llama", &e));
    CHECK_OK(sh__gguf_write_add_tensor(w, "blk.0.attn_k.weight", SH_DTYPE_IQ4_NL, 2, ne, fill_zero,
                                       NULL, &e));
    CHECK_OK(sh__gguf_write_file(w, tmp_path("iq4short.gguf"), &e));
    sh__gguf_write_destroy(w);
    struct stat sst;
    CHECK(stat(tmp_path("iq4short.gguf"), &sst) == 0);
    CHECK_INT_EQ(truncate(tmp_path("iq4short.gguf"), sst.st_size - 1), 0);
    CHECK_INT_EQ(symlink(tmp_path("a.gguf"), tmp_path("link.gguf")), 0);
    CHECK_INT_EQ(mkdir(tmp_path("adir"), 0755), 0);
}

static void test_bad(void)
{
    make_inputs();
    char a[512], trunc[512], iq4[512], link[512], o[512], adir[512], short4[512];
    snprintf(a, sizeof a, "%s", tmp_path("a.gguf"));
    snprintf(trunc, sizeof trunc, "%s", tmp_path("trunc.gguf"));
    snprintf(iq4, sizeof iq4, "%s", tmp_path("iq4.gguf"));
    snprintf(link, sizeof link, "%s", tmp_path("link.gguf"));
    snprintf(o, sizeof o, "%s", tmp_path("o.gguf"));
    snprintf(adir, sizeof adir, "%s", tmp_path("adir"));
    snprintf(short4, sizeof short4, "%s", tmp_path("iq4short.gguf"));
    struct {
        char args[1200];
        const char *want; /* a word the error line must contain */
    } cases[] = {
        {"", "required"},
        {"", "--type is required"},
        {"", "Q9_9"},
        {"", "Q8_K"},
        {"", "IQ3_S"},
        {"", "--threads"},
        {"", "--bogus"},
        {"", "--keep needs"},
        {"", "unexpected"},
        {"", "/nonexistent"},
        {"", "stories260K.bin"},
        {"", "trunc.gguf"},
        {"", "output is the input"},
        {"", "output is the input"},
        {"", "/nonexistent-dir/"},
        {"", "adir"},
        {"", "blk.0.ffn_up.weight"},
        {"", "blk.0.attn_k.weight"},
    };
    size_t k = 0;
#define CASE(...) snprintf(cases[k++].args, sizeof cases[0].args, __VA_ARGS__)
    CASE("'%s'", a);
    CASE("'%s' '%s'", a, o);
    CASE("'%s' '%s' --type Q9_9", a, o);
    CASE("'%s' '%s' --type Q8_K", a, o);
    CASE("'%s' '%s' --type IQ3_S", a, o);
    CASE("'%s' '%s' --type Q4_0 --threads 0", a, o);
    CASE("'%s' '%s' --type Q4_0 --bogus 1", a, o);
    CASE("'%s' '%s' --type Q4_0 --keep", a, o);
    CASE("'%s' '%s' third --type Q4_0", a, o);
    CASE("/nonexistent.gguf '%s' --type Q4_0", o);
    CASE("'%s' '%s' --type Q4_0", sh_test_path("tests/data/stories260K/stories260K.bin"), o);
    CASE("'%s' '%s' --type Q4_0", trunc, o);
    CASE("'%s' '%s' --type Q4_0", a, a);
    CASE("'%s' '%s' --type Q4_0", a, link);
    CASE("'%s' /nonexistent-dir/o.gguf --type Q4_0", a);
    CASE("'%s' '%s' --type Q4_0", a, adir);
    CASE("'%s' '%s' --type Q4_K", iq4, o);
    CASE("'%s' '%s' --type IQ4_XS", short4, o);
#undef CASE
    int files = count_dir();
    for (size_t i = 0; i < k; i++) {
        char out[4096], err[4096];
        int rc = run("quantize", cases[i].args, out, sizeof out, err, sizeof err);
        if (rc != 2 || count_lines(err) != 1 || strncmp(err, "error: ", 7) != 0 ||
            !strstr(err, cases[i].want))
            SH_FAIL_("quantize %s: exit %d, want 2 and one error line with '%s'; stderr:\n%s",
                     cases[i].args, rc, cases[i].want, err);
        else
            fprintf(stderr, "  (expected) %s", err);
        if (count_dir() != files || access(o, F_OK) == 0)
            SH_FAIL_("quantize %s left a file behind", cases[i].args);
    }
    /* `shoal run` refuses the short IQ4_NL matrix the same way. */
    {
        char args[1200], out[4096], err[4096];
        snprintf(args, sizeof args, "-m '%s' -p hi -n 1 -t 1", short4);
        int rc = run("run", args, out, sizeof out, err, sizeof err);
        if (rc != 2 || count_lines(err) != 1 || strncmp(err, "error: ", 7) != 0 ||
            !strstr(err, "blk.0.attn_k.weight"))
            SH_FAIL_("run %s: exit %d, want 2 and one error line naming the tensor; stderr:\n%s",
                     args, rc, err);
        else
            fprintf(stderr, "  (expected) %s", err);
    }
    /* The symlink still points at an intact input. */
    struct stat st;
    CHECK(lstat(link, &st) == 0 && S_ISLNK(st.st_mode));
    char out[8192], err[4096];
    CHECK_INT_EQ(run("quantize", "--help", out, sizeof out, err, sizeof err), 0);
    CHECK(strstr(out, "usage: shoal quantize") != NULL);
    CHECK_INT_EQ(run("--help", "", out, sizeof out, err, sizeof err), 0);
    CHECK(strstr(out, "quantize") != NULL);
}

/* `shoal run` computes with every type quantize writes. */
static const char *const types[] = {"F32",  "F16",  "BF16", "Q8_0",   "Q4_0",
                                    "Q4_1", "Q5_0", "Q5_1", "Q2_K",   "Q3_K",
                                    "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"};

static void quantize_and_run(const char *type)
{
    char args[1200], out[65536], err[65536];
    const char *q = tmp_path("q.gguf");
    snprintf(args, sizeof args, "'%s' '%s' --type %s -t 2", tmp_path("a.gguf"), q, type);
    int rc = run("quantize", args, out, sizeof out, err, sizeof err);
    if (rc != 0) {
        SH_FAIL_("quantize %s: exit %d: %s", args, rc, err);
        return;
    }
    /* A line per tensor on stderr, one summary line on stdout. */
    CHECK_INT_EQ(count_lines(err), 21);
    CHECK(strstr(err, "[  21/  21") != NULL);
    CHECK_INT_EQ(count_lines(out), 1);
    CHECK(strncmp(out, "wrote ", 6) == 0 && strstr(out, type));
    snprintf(args, sizeof args, "-m '%s' -p 'hello there' -n 4 -t 1 --ids", q);
    rc = run("run", args, out, sizeof out, err, sizeof err);
    if (rc != 0 || !strstr(err, "timings:"))
        SH_FAIL_("shoal run on %s: exit %d: %s", type, rc, err);
    else
        fprintf(stderr, "  %-4s runs: %.*s\n", type, (int)strcspn(out, "\n"), out);
    unlink(q);
}

static void test_run(void)
{
    if (access(tmp_path("a.gguf"), F_OK) != 0)
        make_inputs();
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        quantize_and_run(types[i]);
}

static const sh_test_case tests[] = {
    {"bad", test_bad},
    {"run", test_run},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    shoal = getenv("SH_SHOAL");
    if (!shoal || access(shoal, X_OK) != 0) {
        fprintf(stderr, "SH_SHOAL is not set to the shoal binary: skipped\n");
        return SH_TEST_SKIP;
    }
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.stdout' '%s.stderr'", dir, dir, dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
