/* Tests of model/quantize.c: llama-quantize --pure's tensor rules, tensor data equal to what
 * llama.cpp's llama-quantize wrote (sha256s in tests/data/quantize/llama_quantize.txt, made by
 * make_hashes.sh beside it; llama.cpp is not needed here), round trips through F32 against the
 * kernels' dequantization, requantizing, --keep, thread independence and kept metadata. The
 * seeded F32 models (llama, gemma3, phi3, MoE) come from the `shoal mkmodel` binary (SH_SHOAL),
 * with the commands recorded in the data file's header. */
#include <dirent.h>
#include <mbedtls/sha256.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/cpu/quant.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/quantize.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_quantXXXXXX";
static const char *shoal;

static const char *const all_types[] = {"F32",  "F16",  "BF16", "Q8_0",   "Q4_0",
                                        "Q4_1", "Q5_0", "Q5_1", "Q2_K",   "Q3_K",
                                        "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

static const char *tmp_path(const char *name)
{
    static char buf[8][512];
    static int k;
    char *b = buf[k++ & 7];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

static sh_dtype parse_type(const char *s)
{
    sh_dtype t = SH_DTYPE_COUNT_;
    if (!sh__dtype_parse(s, &t))
        SH_FAIL_("unknown type %s", s);
    return t;
}

/* Converts in -> out with the library; 2 threads unless told otherwise. */
static sh_err quantize(const char *in, const char *out, const char *type, int threads,
                       const char *const *keep, size_t n_keep)
{
    sh_quantize_opts o;
    sh__quantize_opts_init(&o);
    o.type = parse_type(type);
    o.n_threads = threads;
    o.keep = keep;
    o.n_keep = n_keep;
    sh_error e = {0};
    sh_err err = sh__quantize_file(in, out, &o, NULL, &e);
    if (err)
        SH_FAIL_("quantize %s -> %s (%s): %s", in, out, type, e.msg);
    return err;
}

/* ---- Rules --------------------------------------------------------------------------------- */

static sh_dtype plan(const char *name, uint32_t nd, uint64_t ne0, uint64_t ne1, uint64_t ne2,
                     sh_dtype cur, sh_dtype target, sh_quantize_why *why)
{
    uint64_t ne[4] = {ne0, ne1, ne2, 1};
    return sh__quantize_plan_tensor("llama", name, nd, ne, cur, target, NULL, 0, why);
}

static void test_rules(void)
{
    sh_quantize_why w;
    const sh_dtype F32 = SH_DTYPE_F32, Q4K = SH_DTYPE_Q4_K;
    /* Matrices, embeddings and the output projection are converted (--pure). */
    CHECK_INT_EQ(plan("blk.0.attn_q.weight", 2, 256, 256, 1, F32, Q4K, &w), Q4K);
    CHECK_INT_EQ(w, SH_QUANTIZE_CONVERT);
    CHECK_INT_EQ(plan("token_embd.weight", 2, 512, 1000, 1, F32, Q4K, &w), Q4K);
    CHECK_INT_EQ(plan("output.weight", 2, 512, 1000, 1, SH_DTYPE_Q8_0, Q4K, &w), Q4K);
    /* 3-D expert stacks too. */
    CHECK_INT_EQ(plan("blk.0.ffn_up_exps.weight", 3, 256, 64, 8, F32, Q4K, &w), Q4K);
    /* 1-D, a declared 2-D with a trailing 1, norms, routers, non-weights keep their type. */
    CHECK_INT_EQ(plan("blk.0.attn_norm.weight", 1, 256, 1, 1, F32, Q4K, &w), F32);
    CHECK_INT_EQ(w, SH_QUANTIZE_NOT_MATRIX);
    CHECK_INT_EQ(plan("blk.0.attn_q.weight", 2, 256, 1, 1, F32, Q4K, &w), F32);
    CHECK_INT_EQ(plan("blk.0.attn_q_norm.weight", 2, 256, 4, 1, F32, Q4K, &w), F32);
    CHECK_INT_EQ(plan("blk.0.ffn_gate_inp.weight", 2, 256, 8, 1, SH_DTYPE_F16, Q4K, &w),
                 SH_DTYPE_F16);
    CHECK_INT_EQ(plan("blk.0.attn_q.bias", 2, 256, 256, 1, F32, Q4K, &w), F32);
    CHECK_INT_EQ(plan("position_embd.weight", 2, 256, 256, 1, F32, Q4K, &w), F32);
    CHECK_INT_EQ(plan("rope_freqs.weight", 1, 32, 1, 1, F32, Q4K, &w), F32);
    /* Already the target: copied. */
    CHECK_INT_EQ(plan("blk.0.attn_q.weight", 2, 256, 256, 1, Q4K, Q4K, &w), Q4K);
    CHECK_INT_EQ(w, SH_QUANTIZE_SAME);
    /* Fallbacks by row length: 256-blocks to 32-blocks, then F16. */
    static const struct {
        sh_dtype target;
        uint64_t ne0;
        sh_dtype want;
    } fb[] = {
        {SH_DTYPE_Q2_K, 320, SH_DTYPE_Q4_0},     {SH_DTYPE_Q3_K, 320, SH_DTYPE_Q4_0},
        {SH_DTYPE_Q4_K, 320, SH_DTYPE_Q5_0},     {SH_DTYPE_Q5_K, 320, SH_DTYPE_Q5_1},
        {SH_DTYPE_Q6_K, 576, SH_DTYPE_Q8_0},     {SH_DTYPE_Q4_K, 80, SH_DTYPE_F16},
        {SH_DTYPE_Q4_0, 80, SH_DTYPE_F16},       {SH_DTYPE_Q8_0, 48, SH_DTYPE_F16},
        {SH_DTYPE_Q6_K, 1536, SH_DTYPE_Q6_K},    {SH_DTYPE_BF16, 80, SH_DTYPE_BF16},
        {SH_DTYPE_IQ4_XS, 320, SH_DTYPE_IQ4_NL}, {SH_DTYPE_IQ4_XS, 80, SH_DTYPE_F16},
        {SH_DTYPE_IQ4_NL, 96, SH_DTYPE_IQ4_NL},  {SH_DTYPE_IQ4_NL, 80, SH_DTYPE_F16},
    };
    for (size_t i = 0; i < sizeof fb / sizeof fb[0]; i++) {
        sh_dtype got = plan("blk.0.ffn_down.weight", 2, fb[i].ne0, 64, 1, F32, fb[i].target, &w);
        if (got != fb[i].want)
            SH_FAIL_("%s, row %llu: got %s, want %s", sh__dtype_name(fb[i].target),
                     (unsigned long long)fb[i].ne0, sh__dtype_name(got),
                     sh__dtype_name(fb[i].want));
        CHECK_INT_EQ(w, got == fb[i].target ? SH_QUANTIZE_CONVERT : SH_QUANTIZE_FALLBACK);
    }
    /* --keep globs; glm5-next's own exclusions. */
    const char *keep[] = {"blk.1.*", "token_embd.weight"};
    uint64_t ne[4] = {256, 256, 1, 1};
    CHECK_INT_EQ(
        sh__quantize_plan_tensor("llama", "blk.1.attn_q.weight", 2, ne, F32, Q4K, keep, 2, &w),
        F32);
    CHECK_INT_EQ(w, SH_QUANTIZE_KEEP);
    CHECK_INT_EQ(
        sh__quantize_plan_tensor("llama", "blk.10.attn_q.weight", 2, ne, F32, Q4K, keep, 2, &w),
        Q4K);
    CHECK_INT_EQ(
        sh__quantize_plan_tensor("llama", "blk.0.hc_x.weight", 2, ne, F32, Q4K, NULL, 0, &w), Q4K);
    CHECK_INT_EQ(
        sh__quantize_plan_tensor("glm5-next", "blk.0.hc_x.weight", 2, ne, F32, Q4K, NULL, 0, &w),
        F32);
    /* llama_ftype numbers, and the accepted targets. */
    CHECK_INT_EQ(sh__quantize_file_type(SH_DTYPE_Q4_K), 15);
    CHECK_INT_EQ(sh__quantize_file_type(SH_DTYPE_Q5_1), 9);
    CHECK_INT_EQ(sh__quantize_file_type(SH_DTYPE_BF16), 32);
    CHECK_INT_EQ(sh__quantize_file_type(SH_DTYPE_IQ4_NL), 25);
    CHECK_INT_EQ(sh__quantize_file_type(SH_DTYPE_IQ4_XS), 30);
    CHECK(!sh__quantize_target_ok(SH_DTYPE_Q8_K));
    CHECK(!sh__quantize_target_ok(SH_DTYPE_IQ3_S));
}

/* ---- Hashes -------------------------------------------------------------------------------- */

static void hex(const unsigned char h[32], char out[65])
{
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", h[i]);
}

static void sha256_hex(const void *p, size_t n, char out[65])
{
    unsigned char h[32];
    mbedtls_sha256_ret(p, n, h, 0);
    hex(h, out);
}

/* The reference's "NAME TYPE SHA" lines, looked up by "MODEL TYPE" prefix. */
typedef struct ref {
    char **lines;
    size_t n;
} ref;

static void ref_load(ref *r)
{
    FILE *f = fopen(sh_test_path("tests/data/quantize/llama_quantize.txt"), "r");
    CHECK(f != NULL);
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        r->lines = realloc(r->lines, (r->n + 1) * sizeof *r->lines);
        r->lines[r->n++] = strdup(line);
    }
    if (f)
        fclose(f);
}

static void ref_free(ref *r)
{
    for (size_t i = 0; i < r->n; i++)
        free(r->lines[i]);
    free(r->lines);
}

/* One line per tensor of `path`, sorted by name: "NAME TYPE SHA256". *n receives the count. */
static char **tensor_lines(const char *path, size_t *n)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e)) {
        SH_FAIL_("open %s: %s", path, e.msg);
        *n = 0;
        return NULL;
    }
    *n = sh_gguf_n_tensors(g);
    char **out = calloc(*n, sizeof *out);
    for (uint64_t i = 0; i < *n; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        char h[65];
        sha256_hex(t->data, (size_t)t->nbytes, h);
        out[i] = malloc(256);
        snprintf(out[i], 256, "%.*s %s %s", (int)t->name.len, t->name.ptr, sh__dtype_name(t->type),
                 h);
    }
    sh_gguf_close(g);
    for (size_t i = 1; i < *n; i++) /* insertion sort: a few dozen names */
        for (size_t j = i; j > 0 && strcmp(out[j - 1], out[j]) > 0; j--) {
            char *x = out[j];
            out[j] = out[j - 1];
            out[j - 1] = x;
        }
    return out;
}

static void free_lines(char **l, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(l[i]);
    free(l);
}

/* Compares every tensor of `path` with the reference lines starting with `prefix` ("tensor a
 * Q4_K " or "input a "); returns the mismatches. */
static int check_tensors(const ref *r, const char *prefix, const char *path)
{
    size_t n, k = 0, pl = strlen(prefix);
    char **got = tensor_lines(path, &n);
    int bad = 0;
    for (size_t i = 0; i < r->n; i++) {
        if (strncmp(r->lines[i], prefix, pl) != 0)
            continue;
        const char *want = r->lines[i] + pl;
        if (k >= n || strcmp(got[k], want) != 0) {
            SH_FAIL_("%s%s: shoal wrote %s", prefix, want, k < n ? got[k] : "(nothing)");
            bad++;
        }
        k++;
    }
    if (k != n) {
        SH_FAIL_("%s: %zu tensors in the reference, %zu in %s", prefix, k, n, path);
        bad++;
    }
    free_lines(got, n);
    return bad;
}

/* make_hashes.sh's digest: sha256 over "NAME\nTYPE\nSHA\n" of the tensors sorted by name. */
static void digest(const char *path, char out[65])
{
    size_t n;
    char **l = tensor_lines(path, &n);
    mbedtls_sha256_context c;
    mbedtls_sha256_init(&c);
    mbedtls_sha256_starts_ret(&c, 0);
    for (size_t i = 0; i < n; i++) {
        for (char *p = l[i]; *p; p++)
            if (*p == ' ')
                *p = '\n';
        mbedtls_sha256_update_ret(&c, (const unsigned char *)l[i], strlen(l[i]));
        mbedtls_sha256_update_ret(&c, (const unsigned char *)"\n", 1);
    }
    unsigned char h[32];
    mbedtls_sha256_finish_ret(&c, h);
    mbedtls_sha256_free(&c);
    hex(h, out);
    free_lines(l, n);
}

/* Makes model `name` with the `shoal mkmodel` command the reference's header records for it
 * ("# model NAME: shoal mkmodel ARGS"). */
static int make_model(const ref *r, const char *name, const char *out)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "# model %s: shoal mkmodel ", name);
    const char *args = NULL;
    for (size_t i = 0; i < r->n && !args; i++)
        if (strncmp(r->lines[i], prefix, strlen(prefix)) == 0)
            args = r->lines[i] + strlen(prefix);
    if (!args) {
        SH_FAIL_("no '%s' line in the reference", prefix);
        return -1;
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' mkmodel %s -o '%s' >/dev/null", shoal, args, out);
    int st = system(cmd);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (rc != 0)
        SH_FAIL_("%s: exit %d", cmd, rc);
    return rc;
}

static void test_llama_hashes(void)
{
    ref r = {0};
    ref_load(&r);
    CHECK(r.n > 600);
    for (int m = 0; m < 2; m++) {
        const char *name = m ? "b" : "a";
        char in[512], prefix[64];
        snprintf(in, sizeof in, "%s", tmp_path(m ? "b.gguf" : "a.gguf"));
        if (make_model(&r, name, in))
            continue;
        /* The inputs first: if mkmodel's bytes changed, no quantized hash can match. */
        snprintf(prefix, sizeof prefix, "input %s ", name);
        if (check_tensors(&r, prefix, in)) {
            SH_FAIL_("model %s: shoal mkmodel no longer writes the recorded weights; remake "
                     "the reference with tests/data/quantize/make_hashes.sh",
                     name);
            continue;
        }
        int bad = 0;
        for (size_t t = 0; t < N_TYPES; t++) {
            char out[512];
            snprintf(out, sizeof out, "%s/%s-%s.gguf", dir, name, all_types[t]);
            if (quantize(in, out, all_types[t], 2, NULL, 0))
                continue;
            snprintf(prefix, sizeof prefix, "tensor %s %s ", name, all_types[t]);
            bad += check_tensors(&r, prefix, out);
        }
        fprintf(stderr, "  model %s: %zu types, %d tensor mismatches with llama-quantize\n", name,
                N_TYPES, bad);
    }
    /* Requantizing: from our (identical) output of each type to each type. */
    int n = 0, bad = 0;
    for (size_t i = 0; i < r.n; i++) {
        char from[16], to[16], want[80];
        if (sscanf(r.lines[i], "digest a %15s %15s %79s", from, to, want) != 3)
            continue;
        char src[512], got[65];
        snprintf(src, sizeof src, "%s/a-%s.gguf", dir, from);
        if (quantize(src, tmp_path("r.gguf"), to, 2, NULL, 0))
            continue;
        digest(tmp_path("r.gguf"), got);
        n++;
        if (strcmp(got, want) != 0) {
            SH_FAIL_("requantize %s -> %s: digest %s, llama-quantize %s", from, to, got, want);
            bad++;
        }
    }
    CHECK_INT_EQ(n, (N_TYPES - 1) * N_TYPES);
    fprintf(stderr, "  requantize: %d pairs, %d differ from llama-quantize\n", n, bad);
    ref_free(&r);
}

/* The other architectures' models: a digest of all tensors per type. */
static void test_llama_arch_digests(void)
{
    ref r = {0};
    ref_load(&r);
    int n = 0, bad = 0;
    for (size_t i = 0; i < r.n; i++) {
        char name[16], want[80], got[65];
        if (sscanf(r.lines[i], "input-digest %15s %79s", name, want) != 2)
            continue;
        char in[512];
        snprintf(in, sizeof in, "%s/%s.gguf", dir, name);
        if (make_model(&r, name, in))
            continue;
        digest(in, got);
        if (strcmp(got, want) != 0) {
            SH_FAIL_("model %s: shoal mkmodel no longer writes the recorded weights; remake the "
                     "reference with tests/data/quantize/make_hashes.sh",
                     name);
            continue;
        }
        for (size_t j = 0; j < r.n; j++) {
            char m[16], type[16];
            if (sscanf(r.lines[j], "model-digest %15s %15s %79s", m, type, want) != 3 ||
                strcmp(m, name) != 0)
                continue;
            if (quantize(in, tmp_path("arch.gguf"), type, 2, NULL, 0))
                continue;
            digest(tmp_path("arch.gguf"), got);
            n++;
            if (strcmp(got, want) != 0) {
                SH_FAIL_("model %s -> %s: digest %s, llama-quantize %s", name, type, got, want);
                bad++;
            }
        }
        unlink(in);
    }
    CHECK_INT_EQ(n, 4 * N_TYPES);
    fprintf(stderr, "  gemma3, phi3, llama MoE, qwen3moe: %d conversions, %d differ\n", n, bad);
    unlink(tmp_path("arch.gguf"));
    ref_free(&r);
}

/* ---- Round trips and options --------------------------------------------------------------- */

static bool files_equal(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool eq = fa && fb;
    while (eq) {
        char x[65536], y[65536];
        size_t na = fread(x, 1, sizeof x, fa), nb = fread(y, 1, sizeof y, fb);
        eq = na == nb && memcmp(x, y, na) == 0;
        if (na == 0)
            break;
    }
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    return eq;
}

/* Model a, made by test_llama_hashes or here when a case runs alone. */
static int ensure_a(void)
{
    if (access(tmp_path("a.gguf"), F_OK) == 0)
        return 0;
    ref r = {0};
    ref_load(&r);
    int rc = make_model(&r, "a", tmp_path("a.gguf"));
    ref_free(&r);
    return rc;
}

/* Quantize to T, dequantize that to F32 with the tool: each tensor equals the kernels'
 * sh__dequant_row of the quantized one, bit for bit; quantizing the T file to T again rewrites
 * it byte for byte. Uses test_llama_hashes' a-T.gguf files, made here when run alone. */
static void test_roundtrip(void)
{
    if (ensure_a())
        return;
    for (size_t ti = 1; ti < N_TYPES; ti++) {
        char q[512], back[512], again[512];
        snprintf(q, sizeof q, "%s/a-%s.gguf", dir, all_types[ti]);
        snprintf(back, sizeof back, "%s/back.gguf", dir);
        snprintf(again, sizeof again, "%s/again.gguf", dir);
        if ((access(q, F_OK) != 0 && quantize(tmp_path("a.gguf"), q, all_types[ti], 2, NULL, 0)) ||
            quantize(q, back, "F32", 3, NULL, 0) || quantize(q, again, all_types[ti], 2, NULL, 0))
            continue;
        if (!files_equal(q, again))
            SH_FAIL_("%s requantized to %s is not the same file", q, all_types[ti]);
        sh_gguf *gq = NULL, *gb = NULL;
        sh_error e = {0};
        CHECK_OK(sh_gguf_open(q, NULL, &gq, &e));
        CHECK_OK(sh_gguf_open(back, NULL, &gb, &e));
        if (!gq || !gb) {
            sh_gguf_close(gq);
            sh_gguf_close(gb);
            continue;
        }
        CHECK_UINT_EQ(sh_gguf_n_tensors(gq), sh_gguf_n_tensors(gb));
        int bad = 0;
        for (uint64_t i = 0; i < sh_gguf_n_tensors(gq); i++) {
            const sh_gguf_tensor *a = sh_gguf_tensor_at(gq, i), *b = sh_gguf_tensor_at(gb, i);
            CHECK(a->name.len == b->name.len && memcmp(a->name.ptr, b->name.ptr, a->name.len) == 0);
            /* Model a's only tensors the plan leaves alone are F32 norms. */
            CHECK_INT_EQ(b->type, SH_DTYPE_F32);
            float *want = malloc((size_t)a->n_elems * sizeof *want);
            uint64_t rows = a->n_elems / a->ne[0];
            uint64_t rb = sh__dtype_row_bytes(a->type, a->ne[0]);
            for (uint64_t r = 0; r < rows; r++)
                CHECK_OK(sh__dequant_row(a->type, (const uint8_t *)a->data + r * rb,
                                         want + r * a->ne[0], (int64_t)a->ne[0]));
            if (b->type != SH_DTYPE_F32 || b->nbytes != a->n_elems * sizeof(float) ||
                memcmp(want, b->data, (size_t)b->nbytes) != 0) {
                SH_FAIL_("%s: tensor %.*s dequantized by quantize differs from sh__dequant_row",
                         all_types[ti], (int)a->name.len, a->name.ptr);
                bad++;
            }
            free(want);
        }
        fprintf(stderr, "  %-4s -> F32: %llu tensors, %d differ from the kernels' dequant\n",
                all_types[ti], (unsigned long long)sh_gguf_n_tensors(gq), bad);
        sh_gguf_close(gq);
        sh_gguf_close(gb);
    }
    unlink(tmp_path("back.gguf"));
    unlink(tmp_path("again.gguf"));
}

/* Same key order, types and values; `skip` keys only need to be present. */
static void check_same_metadata(const sh_gguf *a, const sh_gguf *b)
{
    CHECK_UINT_EQ(sh_gguf_n_kv(a), sh_gguf_n_kv(b));
    for (uint64_t i = 0; i < sh_gguf_n_kv(a) && i < sh_gguf_n_kv(b); i++) {
        const sh_gguf_kv *x = sh_gguf_kv_at(a, i), *y = sh_gguf_kv_at(b, i);
        if (x->key.len != y->key.len || memcmp(x->key.ptr, y->key.ptr, x->key.len) != 0 ||
            x->value.type != y->value.type) {
            SH_FAIL_("key %llu: %.*s vs %.*s", (unsigned long long)i, (int)x->key.len, x->key.ptr,
                     (int)y->key.len, y->key.ptr);
            continue;
        }
        if (sh_str_eq(x->key, "general.file_type"))
            continue;
        const sh_gguf_value *u = &x->value, *v = &y->value;
        bool same = true;
        switch (u->type) {
        case SH_GGUF_STRING:
            same = u->v.s.len == v->v.s.len && memcmp(u->v.s.ptr, v->v.s.ptr, u->v.s.len) == 0;
            break;
        case SH_GGUF_ARRAY:
            same = u->v.arr.type == v->v.arr.type && u->v.arr.n == v->v.arr.n;
            if (same && u->v.arr.raw)
                same = memcmp(u->v.arr.raw, v->v.arr.raw,
                              (size_t)(u->v.arr.n * sh_gguf_type_size(u->v.arr.type))) == 0;
            for (uint64_t k = 0; same && u->v.arr.strs && k < u->v.arr.n; k++)
                same =
                    u->v.arr.strs[k].len == v->v.arr.strs[k].len &&
                    memcmp(u->v.arr.strs[k].ptr, v->v.arr.strs[k].ptr, u->v.arr.strs[k].len) == 0;
            break;
        default:
            same = memcmp(&u->v, &v->v, sizeof u->v.u) == 0;
        }
        if (!same)
            SH_FAIL_("key %.*s changed", (int)x->key.len, x->key.ptr);
    }
}

/* --keep copies matching tensors; thread count does not change a byte; metadata is kept. */
static void test_keep_threads_metadata(void)
{
    if (ensure_a())
        return;
    const char *keep[] = {"blk.1.*", "output.weight"};
    if (quantize(tmp_path("a.gguf"), tmp_path("k1.gguf"), "Q4_K", 1, keep, 2) ||
        quantize(tmp_path("a.gguf"), tmp_path("k5.gguf"), "Q4_K", 5, keep, 2))
        return;
    CHECK(files_equal(tmp_path("k1.gguf"), tmp_path("k5.gguf")));
    sh_gguf *a = NULL, *k = NULL;
    sh_error e = {0};
    CHECK_OK(sh_gguf_open(tmp_path("a.gguf"), NULL, &a, &e));
    CHECK_OK(sh_gguf_open(tmp_path("k1.gguf"), NULL, &k, &e));
    if (a && k) {
        int n_kept = 0, n_q = 0;
        for (uint64_t i = 0; i < sh_gguf_n_tensors(a); i++) {
            const sh_gguf_tensor *x = sh_gguf_tensor_at(a, i), *y = sh_gguf_tensor_at(k, i);
            bool kept = (x->name.len > 6 && memcmp(x->name.ptr, "blk.1.", 6) == 0) ||
                        sh_str_eq(x->name, "output.weight");
            if (kept || x->n_dims == 1) {
                n_kept += kept;
                CHECK(y->type == x->type && y->nbytes == x->nbytes &&
                      memcmp(x->data, y->data, (size_t)x->nbytes) == 0);
            } else {
                n_q++;
                CHECK_INT_EQ(y->type, (x->ne[0] % 256 ? SH_DTYPE_Q5_0 : SH_DTYPE_Q4_K));
            }
        }
        CHECK_INT_EQ(n_kept, 10);
        CHECK_INT_EQ(n_q, 8);
        check_same_metadata(a, k);
        uint32_t ft = 0, qv = 0;
        CHECK_OK(sh_gguf_get_u32(k, "general.file_type", &ft));
        CHECK_OK(sh_gguf_get_u32(k, "general.quantization_version", &qv));
        CHECK_INT_EQ(ft, 15);
        CHECK_INT_EQ(qv, 2);
    }
    sh_gguf_close(a);
    sh_gguf_close(k);
    unlink(tmp_path("k1.gguf"));
    unlink(tmp_path("k5.gguf"));
}

/* A split part refuses; split keys of a one-part file are dropped; an unreadable tensor type is
 * refused unless kept; nothing is left behind. */
static sh_err fill_zero(void *user, const sh_gguf_write_tensor *t, uint64_t row0, uint64_t n_rows,
                        void *dst, sh_error *e)
{
    (void)user, (void)row0, (void)e;
    memset(dst, 0, (size_t)(n_rows * t->row_bytes));
    return SH_OK;
}

static void write_odd(const char *path, uint16_t split_count, sh_dtype type)
{
    sh_gguf_writer *w = NULL;
    sh_error e = {0};
    uint64_t ne[2] = {256, 4};
    CHECK_OK(sh__gguf_write_create(&w, &e));
    CHECK_OK(sh__gguf_write_set_str(w, "general.architecture", "llama", &e));
    CHECK_OK(sh__gguf_write_set_u16(w, "split.no", 0, &e));
    CHECK_OK(sh__gguf_write_set_u16(w, "split.count", split_count, &e));
    CHECK_OK(sh__gguf_write_add_tensor(w, "blk.0.attn_q.weight", type, 2, ne, fill_zero, NULL, &e));
    CHECK_OK(sh__gguf_write_file(w, path, &e));
    sh__gguf_write_destroy(w);
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

static void test_refusals(void)
{
    sh_quantize_opts o;
    sh__quantize_opts_init(&o);
    o.type = SH_DTYPE_Q4_K;
    sh_error e = {0};
    write_odd(tmp_path("split2.gguf"), 2, SH_DTYPE_F32);
    write_odd(tmp_path("split1.gguf"), 1, SH_DTYPE_F32);
    write_odd(tmp_path("iq3.gguf"), 1, SH_DTYPE_IQ3_S);
    int files = count_dir();
    CHECK_INT_EQ(sh__quantize_file(tmp_path("split2.gguf"), tmp_path("o.gguf"), &o, NULL, &e),
                 SH_EUNSUPPORTED);
    fprintf(stderr, "  (expected) %s\n", e.msg);
    CHECK(strstr(e.msg, "split.count") != NULL);
    CHECK_INT_EQ(sh__quantize_file(tmp_path("iq3.gguf"), tmp_path("o.gguf"), &o, NULL, &e),
                 SH_EUNSUPPORTED);
    fprintf(stderr, "  (expected) %s\n", e.msg);
    CHECK(strstr(e.msg, "blk.0.attn_q.weight") && strstr(e.msg, "IQ3_S"));
    CHECK_INT_EQ(sh__quantize_file(tmp_path("split1.gguf"), tmp_path("split1.gguf"), &o, NULL, &e),
                 SH_EINVAL);
    fprintf(stderr, "  (expected) %s\n", e.msg);
    o.type = SH_DTYPE_Q8_K;
    CHECK_INT_EQ(sh__quantize_file(tmp_path("split1.gguf"), tmp_path("o.gguf"), &o, NULL, &e),
                 SH_EINVAL);
    CHECK_INT_EQ(count_dir(), files);
    /* Kept, the IQ3_S tensor is copied; a one-part split file loses its split keys. */
    o.type = SH_DTYPE_Q4_K;
    const char *keep[] = {"*attn_q*"};
    o.keep = keep;
    o.n_keep = 1;
    CHECK_OK(sh__quantize_file(tmp_path("iq3.gguf"), tmp_path("o.gguf"), &o, NULL, &e));
    o.n_keep = 0;
    CHECK_OK(sh__quantize_file(tmp_path("split1.gguf"), tmp_path("o1.gguf"), &o, NULL, &e));
    sh_gguf *g = NULL;
    CHECK_OK(sh_gguf_open(tmp_path("o.gguf"), NULL, &g, &e));
    if (g) {
        CHECK_INT_EQ(sh_gguf_tensor_at(g, 0)->type, SH_DTYPE_IQ3_S);
        CHECK(sh_gguf_find(g, "split.count") == NULL && sh_gguf_find(g, "split.no") == NULL);
    }
    sh_gguf_close(g);
    g = NULL;
    CHECK_OK(sh_gguf_open(tmp_path("o1.gguf"), NULL, &g, &e));
    if (g)
        CHECK_INT_EQ(sh_gguf_tensor_at(g, 0)->type, SH_DTYPE_Q4_K);
    sh_gguf_close(g);
    const char *names[] = {"split2.gguf", "split1.gguf", "iq3.gguf", "o.gguf", "o1.gguf"};
    for (size_t i = 0; i < 5; i++)
        unlink(tmp_path(names[i]));
}

static const sh_test_case tests[] = {
    {"rules", test_rules},
    {"llama_hashes", test_llama_hashes},
    {"llama_arch_digests", test_llama_arch_digests},
    {"roundtrip", test_roundtrip},
    {"keep_threads_metadata", test_keep_threads_metadata},
    {"refusals", test_refusals},
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
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
