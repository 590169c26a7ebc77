/* Tests of `shoal mkmodel` run as a real process (the binary's path comes in SH_SHOAL). */
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/llama.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_mkcliXXXXXX";
static const char *shoal;

static const char *tmp_path(const char *name)
{
    static char buf[4][256];
    static int k;
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

/* Runs `shoal mkmodel ARGS` with stdout and stderr captured; returns the exit code. */
static int run(const char *args, char *out, size_t out_cap, char *err, size_t err_cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' mkmodel %s >'%s' 2>'%s'", shoal, args, tmp_path("stdout"),
             tmp_path("stderr"));
    int st = system(cmd);
    const char *files[2] = {tmp_path("stdout"), tmp_path("stderr")};
    char *bufs[2] = {out, err};
    size_t caps[2] = {out_cap, err_cap};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "r");
        size_t n = f ? fread(bufs[i], 1, caps[i] - 1, f) : 0;
        bufs[i][n] = 0;
        if (f)
            fclose(f);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static void test_bad_args(void)
{
    static const char *const cases[] = {
        "",
        "--shape smollm2-135m --type F16",                       /* no -o */
        "--shape nope --type F16 -o x.gguf",                     /* unknown shape */
        "--shape smollm2-135m --type IQ3_S -o x.gguf",           /* unsupported type */
        "--shape smollm2-135m --type Q4_K -o x.gguf",            /* 576 % 256 */
        "--shape smollm2-135m --type F16 -o x.gguf --bogus 1",   /* unknown flag */
        "--shape smollm2-135m --type F16 -o x.gguf --seed",      /* missing value */
        "--shape smollm2-135m --type F16 -o x.gguf --dim abc",   /* not a number */
        "--shape smollm2-135m --type F16 -o x.gguf --layers -3", /* not positive */
        "--shape custom --type F16 -o x.gguf --dim 64",          /* dims missing */
        "--shape custom --type F16 -o x.gguf --layers 1 --dim 64 --ffn 128 --heads 5 "
        "--kv-heads 1 --vocab 300", /* 64 % 5 */
        "--shape custom --type Q4_0 -o x.gguf --layers 1 --dim 48 --ffn 128 --heads 4 "
        "--kv-heads 1 --vocab 300", /* 48 % 32 */
        "--shape custom --type F16 -o x.gguf --layers 1 --dim 64 --ffn 128 --heads 4 "
        "--kv-heads 1 --vocab 300 --vocab-from /nonexistent.gguf", /* unreadable */
        "--shape custom --type F16 -o x.gguf --layers 1 --dim 64 --ffn 128 --heads 4 "
        "--kv-heads 1 --vocab-from tests/data/stories260K/stories260K.bin", /* not a GGUF */
        "--shape qwen3-0.6b --type F16 -o x.gguf --arch gpt2",              /* unknown arch */
        "--shape qwen3-0.6b --type F16 -o x.gguf --rope-scaling ntk",       /* unknown scaling */
        "--shape smollm2-135m --type F16 -o x.gguf --rope-scaling llama3",  /* no factor */
        "--shape smollm2-135m --type F16 -o x.gguf --experts 4 --experts-used 5", /* K > N */
        "--shape phi3-mini --type F16 -o x.gguf --experts 4 --experts-used 2",    /* no MoE */
        "--shape qwen3moe-tiny --type F16 -o x.gguf --experts 0",                 /* not positive */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char out[4096], err[4096];
        int rc = run(cases[i], out, sizeof out, err, sizeof err);
        if (rc != 2 || count_lines(err) != 1 || strncmp(err, "error: ", 7) != 0)
            SH_FAIL_("mkmodel %s: exit %d, stderr:\n%s", cases[i], rc, err);
        else
            fprintf(stderr, "  (expected) %s", err);
        CHECK(access("x.gguf", F_OK) != 0);
    }
    char out[8192], err[4096];
    CHECK_INT_EQ(run("--help", out, sizeof out, err, sizeof err), 0);
    CHECK(strstr(out, "tinyllama-1.1b") != NULL);
}

static void test_tiny_model(void)
{
    char args[1024], out[4096], err[4096];
    char path[256], p2[256]; /* tmp_path's buffers are reused by run() */
    snprintf(path, sizeof path, "%s", tmp_path("tiny.gguf"));
    snprintf(p2, sizeof p2, "%s", tmp_path("tiny2.gguf"));
    snprintf(args, sizeof args,
             "--shape custom --type q8_0 -o '%s' --layers 2 --dim 64 --ffn 128 --heads 4 "
             "--kv-heads 2 --vocab 300 --ctx 128 --seed 7 --std 0.05 --tied --threads 3",
             path);
    int rc = run(args, out, sizeof out, err, sizeof err);
    CHECK_INT_EQ(rc, 0);
    if (rc)
        fprintf(stderr, "%s", err);
    CHECK(strstr(out, "wrote") != NULL && strstr(out, path) != NULL);
    CHECK_INT_EQ(count_lines(out), 1);
    CHECK_INT_EQ(strlen(err), 0); /* no progress line when stderr is not a terminal */
    sh_gguf *g = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
    if (g) {
        uint32_t v = 0;
        CHECK_OK(sh_gguf_get_u32(g, "llama.context_length", &v));
        CHECK_UINT_EQ(v, 128);
        CHECK_OK(sh_gguf_get_u32(g, "general.file_type", &v));
        CHECK_UINT_EQ(v, 7);
        CHECK(sh_gguf_find_tensor(g, "output.weight") == NULL);
        const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "blk.1.ffn_down.weight");
        CHECK(t && t->type == SH_DTYPE_Q8_0 && t->ne[0] == 128 && t->ne[1] == 64);
    }
    sh_gguf_close(g);

    /* A named shape with explicit overrides, and the same seed again gives the same bytes. */
    snprintf(args, sizeof args,
             "--shape smollm2-135m --type Q8_0 -o '%s' --layers 2 --dim 64 --ffn 128 --heads 4 "
             "--kv-heads 2 --vocab 300 --ctx 128 --seed 7 --std 0.05 --threads 1",
             p2);
    CHECK_INT_EQ(run(args, out, sizeof out, err, sizeof err), 0);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", path, p2);
    /* Only general.name differs (it names the shape): compare sizes instead of bytes. */
    FILE *a = fopen(path, "rb"), *b = fopen(p2, "rb");
    if (a && b) {
        fseek(a, 0, SEEK_END);
        fseek(b, 0, SEEK_END);
        CHECK(labs(ftell(a) - ftell(b)) <= 32);
    }
    if (a)
        fclose(a);
    if (b)
        fclose(b);
    sh_gguf *g2 = NULL;
    CHECK_OK(sh_gguf_open(p2, NULL, &g2, &e));
    if (g2) {
        float f = 0;
        CHECK_OK(sh_gguf_get_f32(g2, "llama.rope.freq_base", &f)); /* from the named shape */
        CHECK_NEAR(f, 100000.0, 0);
        CHECK(sh_gguf_find_tensor(g2, "output.weight") == NULL); /* smollm2 is tied */
    }
    sh_gguf_close(g2);
    snprintf(args, sizeof args,
             "--shape smollm2-135m --type Q8_0 -o '%s' --layers 2 --dim 64 --ffn 128 --heads 4 "
             "--kv-heads 2 --vocab 300 --ctx 128 --seed 7 --std 0.05 --threads 2",
             path);
    CHECK_INT_EQ(run(args, out, sizeof out, err, sizeof err), 0);
    CHECK_INT_EQ(system(cmd), 0);
    unlink(path);
    unlink(p2);
}

/* Each architecture from the command line: the options reach the file, and the model loader
 * takes it. */
static void test_archs(void)
{
    static const struct {
        const char *args, *arch, *key;
        uint32_t want;
    } cases[] = {
        {"--shape gemma3-270m --head-dim 32 --sliding-window 16 --swa-pattern 3", "gemma3",
         "gemma3.attention.sliding_window_pattern", 3},
        {"--shape qwen3-0.6b --head-dim 32", "qwen3", "qwen3.attention.key_length", 32},
        {"--shape qwen3moe-tiny --experts 6 --experts-used 2 --expert-ffn 32", "qwen3moe",
         "qwen3moe.expert_feed_forward_length", 32},
        {"--shape mixtral-tiny --experts 4 --experts-used 2", "llama", "llama.expert_count", 4},
        {"--shape phi3-mini", "phi3", "phi3.rope.dimension_count", 16},
        {"--shape qwen2moe-tiny --experts 4 --experts-used 2 --shared-ffn 96", "qwen2moe",
         "qwen2moe.expert_shared_feed_forward_length", 96},
        {"--shape custom --arch olmoe --kv-heads 4 --experts 4 --experts-used 1", "olmoe",
         "olmoe.expert_used_count", 1},
        /* Mixtral-style llama and OLMoE files have no other FFN width: --expert-ffn is theirs. */
        {"--shape custom --experts 4 --experts-used 2 --expert-ffn 96", "llama",
         "llama.feed_forward_length", 96},
        {"--shape custom --arch olmoe --kv-heads 4 --experts 4 --experts-used 2 --expert-ffn 96",
         "olmoe", "olmoe.feed_forward_length", 96},
        {"--shape custom --arch qwen3 --rope-scaling yarn --rope-factor 4 --rope-orig-ctx 64",
         "qwen3", "qwen3.rope.scaling.original_context_length", 64},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[1024], out[4096], err[4096], path[256];
        snprintf(path, sizeof path, "%s", tmp_path("arch.gguf"));
        snprintf(args, sizeof args,
                 "--type F16 -o '%s' --layers 2 --dim 64 --ffn 128 --heads 4 --kv-heads 2 "
                 "--vocab 300 --ctx 128 %s",
                 path, cases[i].args);
        int rc = run(args, out, sizeof out, err, sizeof err);
        if (rc != 0) {
            SH_FAIL_("mkmodel %s: exit %d: %s", cases[i].args, rc, err);
            continue;
        }
        sh_gguf *g = NULL;
        sh_error e = {0};
        CHECK_OK(sh_gguf_open(path, NULL, &g, &e));
        if (g) {
            sh_str s;
            uint32_t v = 0;
            CHECK_OK(sh_gguf_get_str(g, "general.architecture", &s));
            CHECK(sh_str_eq(s, cases[i].arch));
            CHECK_OK(sh_gguf_get_u32(g, cases[i].key, &v));
            CHECK_UINT_EQ(v, cases[i].want);
        }
        sh_gguf_close(g);
        sh_llama *m = NULL;
        sh_error le = {0};
        if (sh_llama_load(path, NULL, &m, &le) != SH_OK)
            SH_FAIL_("mkmodel %s: the loader refuses the file: %s", cases[i].args, le.msg);
        sh_llama_destroy(m);
        unlink(path);
    }
}

static const sh_test_case tests[] = {
    {"bad_args", test_bad_args},
    {"tiny_model", test_tiny_model},
    {"archs", test_archs},
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
    unlink(tmp_path("stdout"));
    unlink(tmp_path("stderr"));
    rmdir(dir);
    return rc;
}
