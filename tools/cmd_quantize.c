/* `shoal quantize`: converts a GGUF model's weight matrices to another type (model/quantize.c). */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "model/quantize.h"
#include "tools/cmd.h"

#define MAX_KEEP 256

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: shoal quantize IN.gguf OUT.gguf --type T [--keep PATTERN ...] [-t THREADS]\n"
        "\n"
        "Rewrites a GGUF model with its weight matrices in type T, as llama.cpp's\n"
        "`llama-quantize --pure IN OUT T` does, byte for byte on the tensor data: 1-D tensors,\n"
        "norms and a few small tensors keep their type; token_embd and output are converted\n"
        "too; a type whose 256-element block does not divide a row falls back to Q4_0 (Q2_K,\n"
        "Q3_K), Q5_0 (Q4_K), Q5_1 (Q5_K), Q8_0 (Q6_K) or IQ4_NL (IQ4_XS), and to F16 when 32\n"
        "does not divide it either (a 32-block type goes straight to F16). Quantized inputs\n"
        "are dequantized first (requantizing), so any of these types converts to any other.\n"
        "Every metadata key is kept; general.file_type and\n"
        "general.quantization_version are updated. See docs/quantize.md.\n"
        "\n"
        "  --type T           F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,\n"
        "                     Q5_K, Q6_K, IQ4_NL or IQ4_XS\n"
        "  --keep PATTERN     leave tensors whose name matches this glob as they are\n"
        "                     (repeatable; e.g. --keep 'token_embd.weight' --keep '*.ffn_down.*')\n"
        "  -t, --threads N    conversion threads (default: the CPUs online; output does not\n"
        "                     depend on it)\n"
        "  -q, --quiet        no per-tensor lines on stderr\n"
        "\n"
        "The output is written to a temporary file beside OUT and renamed at the end.\n"
        "Exit codes: 0 done, 2 bad arguments or input (one `error:` line), 1 other failures.\n");
}

static int bad(const char *fmt, ...) SH_PRINTF(1, 2);
static int bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see shoal quantize --help)\n");
    va_end(ap);
    return 2;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *why_text(sh_quantize_why w)
{
    switch (w) {
    case SH_QUANTIZE_CONVERT:
        return "";
    case SH_QUANTIZE_FALLBACK:
        return " (fallback: row length)";
    case SH_QUANTIZE_SAME:
        return " (already)";
    case SH_QUANTIZE_KEEP:
        return " (--keep)";
    case SH_QUANTIZE_NOT_MATRIX:
        return " (not a weight matrix)";
    }
    return "";
}

typedef struct progress {
    double t0;
} progress;

/* One line per tensor: position, share of the output done, name, shape, types and sizes. */
static void on_tensor(void *user, const sh_quantize_tensor_info *t)
{
    progress *p = user;
    char shape[96];
    int n = 0;
    for (uint32_t i = 0; i < t->n_dims && n < (int)sizeof shape - 24; i++)
        n += snprintf(shape + n, sizeof shape - (size_t)n, "%s%llu", i ? "x" : "",
                      (unsigned long long)t->ne[i]);
    int pct = t->total_bytes ? (int)(t->done_bytes * 100 / t->total_bytes) : 100;
    fprintf(stderr, "[%4llu/%4llu %3d%% %5.0fs] %-32s %-14s %-5s -> %-5s %9.3f -> %9.3f MiB%s\n",
            (unsigned long long)t->index + 1, (unsigned long long)t->n_tensors, pct, now() - p->t0,
            t->name, shape, sh__dtype_name(t->from), sh__dtype_name(t->to),
            (double)t->in_bytes / 1048576.0, (double)t->out_bytes / 1048576.0, why_text(t->why));
}

int sh__cmd_quantize(int argc, char **argv)
{
    sh_quantize_opts o;
    sh__quantize_opts_init(&o);
    const char *paths[2] = {NULL, NULL}, *type_name = NULL;
    const char *keep[MAX_KEEP];
    size_t n_keep = 0, n_paths = 0;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    o.n_threads = cpus < 1 ? 1 : cpus > 64 ? 64 : (int)cpus;
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "-q") == 0 || strcmp(a, "--quiet") == 0) {
            quiet = true;
            continue;
        }
        if (a[0] != '-' || a[1] == 0) {
            if (n_paths == 2)
                return bad("unexpected argument '%s'", a);
            paths[n_paths++] = a;
            continue;
        }
        if (i + 1 >= argc)
            return bad("%s needs a value", a);
        const char *v = argv[++i];
        if (strcmp(a, "--type") == 0) {
            type_name = v;
        } else if (strcmp(a, "--keep") == 0) {
            if (n_keep == MAX_KEEP)
                return bad("more than %d --keep patterns", MAX_KEEP);
            keep[n_keep++] = v;
        } else if (strcmp(a, "-t") == 0 || strcmp(a, "--threads") == 0) {
            char *end;
            errno = 0;
            long t = strtol(v, &end, 10);
            if (errno || end == v || *end || t < 1)
                return bad("%s wants a positive integer, got '%s'", a, v);
            o.n_threads = t > 64 ? 64 : (int)t;
        } else {
            return bad("unknown option '%s'", a);
        }
    }
    if (n_paths < 2)
        return bad("IN.gguf and OUT.gguf are required");
    if (!type_name)
        return bad("--type is required");
    if (!sh__dtype_parse(type_name, &o.type) || !sh__quantize_target_ok(o.type))
        return bad("--type '%s' is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                   "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS",
                   type_name);
    o.keep = keep;
    o.n_keep = n_keep;
    progress p = {now()};
    if (!quiet) {
        o.progress = on_tensor;
        o.progress_user = &p;
    }

    sh_quantize_result r;
    sh_error e = {0};
    sh_err err = sh__quantize_file(paths[0], paths[1], &o, &r, &e);
    if (err) {
        fprintf(stderr, "error: %s\n", e.msg[0] ? e.msg : sh_strerror(err));
        /* Bad inputs and an output that cannot be written are the user's to fix. */
        return err == SH_ENOMEM ? 1 : 2;
    }
    double bpw_in = r.n_elems ? (double)r.in_tensor_bytes * 8.0 / (double)r.n_elems : 0,
           bpw_out = r.n_elems ? (double)r.out_tensor_bytes * 8.0 / (double)r.n_elems : 0;
    printf("wrote %s: %s, %llu tensors (%llu converted, %llu fell back, %llu kept), "
           "%.2f MiB (%.2f bits/weight) -> %.2f MiB (%.2f bits/weight), file %llu -> %llu "
           "bytes, %.1f s\n",
           paths[1], sh__dtype_name(o.type), (unsigned long long)r.n_tensors,
           (unsigned long long)r.n_converted, (unsigned long long)r.n_fallback,
           (unsigned long long)r.n_kept, (double)r.in_tensor_bytes / 1048576.0, bpw_in,
           (double)r.out_tensor_bytes / 1048576.0, bpw_out, (unsigned long long)r.in_file_bytes,
           (unsigned long long)r.out_file_bytes, now() - p.t0);
    return 0;
}
