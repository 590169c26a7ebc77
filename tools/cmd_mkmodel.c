/* `shoal mkmodel`: writes a GGUF with seeded random weights for a named or explicit shape. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "model/mkmodel.h"
#include "tools/cmd.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal mkmodel --shape NAME --type T -o OUT.gguf [options]\n"
               "\n"
               "Writes a GGUF (llama, gemma3, qwen3, qwen3moe or phi3; Mixtral-style experts\n"
               "for llama) with seeded normal weights (same seed, same bytes) and a generated\n"
               "byte-level BPE vocabulary, or one copied from a GGUF.\n"
               "\n"
               "  --shape NAME       custom, or one of:");
    size_t n;
    const sh_mkmodel_shape *s = sh__mkmodel_shapes(&n);
    for (size_t i = 0; i < n; i++)
        fprintf(f, " %s", s[i].name);
    fprintf(f, "\n"
               "  --type T           F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,\n"
               "                     Q4_K, Q5_K or Q6_K (the 2-D matrices; norms stay F32; the\n"
               "                     K types need dim and ffn multiples of 256)\n"
               "  -o, --output FILE  where to write (via a temporary file, renamed at the end)\n"
               "  --seed N           random seed (default 1)\n"
               "  --std X            weight standard deviation (default 0.02)\n"
               "  --vocab-from FILE  copy every tokenizer.* key from this GGUF\n"
               "  --threads N        generation threads (default 2; output does not depend on it)\n"
               "  --layers N --dim N --ffn N --heads N --kv-heads N --vocab N --ctx N\n"
               "  --rope-base X --rms-eps X --tied --untied\n"
               "                     explicit dimensions: all of layers, dim, ffn, heads,\n"
               "                     kv-heads and vocab (unless --vocab-from) for --shape custom;\n"
               "                     they override a named shape\n"
               "  --sliding-window N attention sees only the last N positions (Mistral-style;\n"
               "                     gemma3: its local layers)\n"
               "  --arch NAME        llama (default for custom), gemma3, qwen3, qwen3moe, phi3\n"
               "  --head-dim N       attention head width (default dim / heads)\n"
               "  --experts N --experts-used K --expert-ffn N\n"
               "                     routed experts per layer, chosen per token, and each\n"
               "                     expert's FFN width (default --ffn); llama and qwen3moe\n"
               "  --swa-pattern N    gemma3: every Nth layer is global (file default: 6)\n"
               "  --rope-base-swa X  gemma3: rope base of the local layers (file default: 10000)\n"
               "  --softcap X        final logit soft-capping\n"
               "  --rope-scaling T --rope-factor X --rope-orig-ctx N\n"
               "                     linear, yarn or llama3 (a rope_freqs tensor) scaling by X\n"
               "                     from an original context of N positions\n");
}

/* Prints one `error:` line and returns the usage exit code. */
static int bad(const char *fmt, ...) SH_PRINTF(1, 2);
static int bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see shoal mkmodel --help)\n");
    va_end(ap);
    return 2;
}

static int parse_i64(const char *flag, const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < 1)
        return bad("%s wants a positive integer, got '%s'", flag, s);
    *out = v;
    return 0;
}

static int parse_u64(const char *flag, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || s[0] == '-')
        return bad("%s wants a non-negative integer, got '%s'", flag, s);
    *out = v;
    return 0;
}

static int parse_f32(const char *flag, const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !(v > 0))
        return bad("%s wants a positive number, got '%s'", flag, s);
    *out = v;
    return 0;
}

typedef struct progress {
    int last_pct;
    double t0;
} progress;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void on_progress(void *user, uint64_t done, uint64_t total)
{
    progress *p = user;
    int pct = total ? (int)(done * 100 / total) : 100;
    if (pct == p->last_pct)
        return;
    p->last_pct = pct;
    fprintf(stderr, "\rmkmodel: %3d%%  %.2f / %.2f GB  %.0f s", pct, (double)done / 1e9,
            (double)total / 1e9, now() - p->t0);
    if (pct == 100)
        fputc('\n', stderr);
    fflush(stderr);
}

int sh__cmd_mkmodel(int argc, char **argv)
{
    sh_mkmodel_opts o;
    sh__mkmodel_opts_init(&o);
    const char *shape_name = NULL, *type_name = NULL, *out = NULL;
    /* Explicit dimensions, 0 when not given; -1/1 for --untied/--tied. */
    int64_t dims[7] = {0};
    static const char *const dim_flags[7] = {"--layers",   "--dim",   "--ffn", "--heads",
                                             "--kv-heads", "--vocab", "--ctx"};
    float rope_base = 0, rms_eps = 0;
    int64_t window = 0;
    /* Architecture options; 0 / NULL when not given. */
    const char *arch = NULL, *scaling = NULL;
    int64_t head_dim = 0, experts = 0, experts_used = 0, expert_ffn = 0, swa_pattern = 0;
    int64_t orig_ctx = 0;
    float rope_base_swa = 0, softcap = 0, rope_factor = 0;
    int tied = 0;
    int rc;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--tied") == 0 || strcmp(a, "--untied") == 0) {
            tied = a[2] == 't' ? 1 : -1;
            continue;
        }
        if (a[0] != '-')
            return bad("unexpected argument '%s'", a);
        if (i + 1 >= argc)
            return bad("%s needs a value", a);
        const char *v = argv[++i];
        int d = -1;
        for (int k = 0; k < 7; k++)
            if (strcmp(a, dim_flags[k]) == 0)
                d = k;
        if (d >= 0) {
            if ((rc = parse_i64(a, v, &dims[d])))
                return rc;
        } else if (strcmp(a, "--shape") == 0) {
            shape_name = v;
        } else if (strcmp(a, "--type") == 0) {
            type_name = v;
        } else if (strcmp(a, "-o") == 0 || strcmp(a, "--output") == 0) {
            out = v;
        } else if (strcmp(a, "--seed") == 0) {
            if ((rc = parse_u64(a, v, &o.seed)))
                return rc;
        } else if (strcmp(a, "--std") == 0) {
            if ((rc = parse_f32(a, v, &o.std)))
                return rc;
        } else if (strcmp(a, "--rope-base") == 0) {
            if ((rc = parse_f32(a, v, &rope_base)))
                return rc;
        } else if (strcmp(a, "--sliding-window") == 0) {
            if ((rc = parse_i64(a, v, &window)))
                return rc;
        } else if (strcmp(a, "--arch") == 0) {
            arch = v;
        } else if (strcmp(a, "--rope-scaling") == 0) {
            scaling = v;
        } else if (strcmp(a, "--head-dim") == 0 || strcmp(a, "--experts") == 0 ||
                   strcmp(a, "--experts-used") == 0 || strcmp(a, "--expert-ffn") == 0 ||
                   strcmp(a, "--swa-pattern") == 0 || strcmp(a, "--rope-orig-ctx") == 0) {
            int64_t *dst = strcmp(a, "--head-dim") == 0       ? &head_dim
                           : strcmp(a, "--experts") == 0      ? &experts
                           : strcmp(a, "--experts-used") == 0 ? &experts_used
                           : strcmp(a, "--expert-ffn") == 0   ? &expert_ffn
                           : strcmp(a, "--swa-pattern") == 0  ? &swa_pattern
                                                              : &orig_ctx;
            if ((rc = parse_i64(a, v, dst)))
                return rc;
        } else if (strcmp(a, "--rope-base-swa") == 0 || strcmp(a, "--softcap") == 0 ||
                   strcmp(a, "--rope-factor") == 0) {
            float *dst = strcmp(a, "--rope-base-swa") == 0 ? &rope_base_swa
                         : strcmp(a, "--softcap") == 0     ? &softcap
                                                           : &rope_factor;
            if ((rc = parse_f32(a, v, dst)))
                return rc;
        } else if (strcmp(a, "--rms-eps") == 0) {
            if ((rc = parse_f32(a, v, &rms_eps)))
                return rc;
        } else if (strcmp(a, "--vocab-from") == 0) {
            o.vocab_from = v;
        } else if (strcmp(a, "--threads") == 0) {
            int64_t t = 0;
            if ((rc = parse_i64(a, v, &t)))
                return rc;
            o.n_threads = t > 64 ? 64 : (int)t;
        } else {
            return bad("unknown option '%s'", a);
        }
    }
    if (!shape_name)
        return bad("--shape is required");
    if (!type_name)
        return bad("--type is required");
    if (!out)
        return bad("-o OUT.gguf is required");
    if (!sh__dtype_parse(type_name, &o.type) || sh__mkmodel_file_type(o.type) < 0)
        return bad("--type '%s' is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, "
                   "Q3_K, Q4_K, Q5_K, Q6_K",
                   type_name);
    if (strcmp(shape_name, "custom") != 0) {
        const sh_mkmodel_shape *s = sh__mkmodel_shape_find(shape_name);
        if (!s)
            return bad("unknown shape '%s'", shape_name);
        o.shape = *s;
    } else {
        for (int k = 0; k < 6; k++)
            if (!dims[k] && !(k == 5 && o.vocab_from))
                return bad("--shape custom needs %s", dim_flags[k]);
        if (!dims[6])
            dims[6] = 2048;
    }
    int64_t *fields[7] = {&o.shape.n_layers,   &o.shape.dim,   &o.shape.ffn, &o.shape.n_heads,
                          &o.shape.n_kv_heads, &o.shape.vocab, &o.shape.ctx};
    for (int k = 0; k < 7; k++)
        if (dims[k])
            *fields[k] = dims[k];
    o.vocab_explicit = dims[5] != 0;
    if (rope_base > 0)
        o.shape.rope_base = rope_base;
    if (rms_eps > 0)
        o.shape.rms_eps = rms_eps;
    if (window > 0)
        o.shape.sliding_window = window;
    if (tied)
        o.shape.tied = tied > 0;
    if (arch) {
        static const char *const archs[] = {"llama", "gemma3", "qwen3", "qwen3moe", "phi3"};
        size_t k = 0;
        while (k < sizeof archs / sizeof archs[0] && strcmp(arch, archs[k]) != 0)
            k++;
        if (k == sizeof archs / sizeof archs[0])
            return bad("--arch '%s' is not one of llama, gemma3, qwen3, qwen3moe, phi3", arch);
        o.shape.arch = archs[k];
    }
    if (head_dim)
        o.shape.head_dim = head_dim;
    if (experts)
        o.shape.n_experts = experts;
    if (experts_used)
        o.shape.n_experts_used = experts_used;
    if (expert_ffn)
        o.shape.expert_ffn = expert_ffn;
    if (swa_pattern)
        o.shape.swa_pattern = swa_pattern;
    if (orig_ctx)
        o.shape.rope_orig_ctx = orig_ctx;
    if (rope_base_swa > 0)
        o.shape.rope_base_swa = rope_base_swa;
    if (softcap > 0)
        o.shape.softcap = softcap;
    if (rope_factor > 0)
        o.shape.rope_factor = rope_factor;
    if (scaling) {
        static const char *const names[] = {"none", "linear", "yarn", "llama3"};
        int k = 0;
        while (k < 4 && strcmp(scaling, names[k]) != 0)
            k++;
        if (k == 4)
            return bad("--rope-scaling '%s' is not one of none, linear, yarn, llama3", scaling);
        o.shape.rope_scaling = (sh_mkmodel_rope_scaling)k;
    }
    if (o.shape.rope_scaling != SH_MKMODEL_ROPE_SCALING_NONE && !(o.shape.rope_factor > 0))
        return bad("--rope-scaling %s needs --rope-factor", scaling ? scaling : "");
    if (o.vocab_from && access(o.vocab_from, R_OK) != 0)
        return bad("--vocab-from '%s': %s", o.vocab_from, strerror(errno));

    progress p = {-1, now()};
    if (isatty(STDERR_FILENO)) {
        o.progress = on_progress;
        o.progress_user = &p;
    }
    sh_mkmodel_result res;
    sh_error e = {0};
    sh_err err = sh__mkmodel_write(out, &o, &res, &e);
    if (err) {
        if (p.last_pct >= 0 && p.last_pct < 100)
            fputc('\n', stderr);
        fprintf(stderr, "error: %s\n", e.msg[0] ? e.msg : sh_strerror(err));
        /* Inconsistent dimensions and unreadable vocabulary files are bad input. */
        return err == SH_EINVAL || err == SH_EFORMAT || err == SH_EUNSUPPORTED ? 2 : 1;
    }
    printf("wrote %s: %s %s, %.1fM params, vocab %" PRId64 ", %" PRIu64 " bytes (%.2f GB), "
           "%.1f s\n",
           out, o.shape.name, sh__dtype_name(o.type), (double)res.n_params / 1e6, res.vocab,
           res.n_bytes, (double)res.n_bytes / 1e9, now() - p.t0);
    return 0;
}
