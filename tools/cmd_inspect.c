/* `shoal inspect`: prints a GGUF file's header, a model summary, its metadata and tensor table. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "tools/cmd.h"

#define ARRAY_SHOWN 8   /* array elements shown without --all */
#define STRING_SHOWN 64 /* string bytes shown without --all */

typedef struct opts {
    const char *path;
    bool all, no_tensors;
} opts;

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal inspect FILE [--all] [--no-tensors]\n\n"
               "Prints a GGUF file's header, a summary of the model and tokenizer, every metadata\n"
               "key with its type and value, and the tensor table.\n\n"
               "  --all         print long strings and arrays in full\n"
               "  --no-tensors  leave out the tensor table\n");
}

/* Length of the valid UTF-8 sequence at p (n bytes available), or 0 when it is not one. */
static size_t utf8_len(const unsigned char *p, uint64_t n)
{
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        len = 2;
    else if (p[0] >= 0xe0 && p[0] <= 0xef)
        len = 3, lo = p[0] == 0xe0 ? 0xa0 : 0x80, hi = p[0] == 0xed ? 0x9f : 0xbf;
    else if (p[0] >= 0xf0 && p[0] <= 0xf4)
        len = 4, lo = p[0] == 0xf0 ? 0x90 : 0x80, hi = p[0] == 0xf4 ? 0x8f : 0xbf;
    else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t k = 2; k < len; k++)
        if ((p[k] & 0xc0) != 0x80)
            return 0;
    return len;
}

/* Code points that would reorder or control the terminal if printed raw: C1 controls and the
 * bidirectional overrides and isolates. */
static bool unsafe_cp(const unsigned char *p, size_t len)
{
    if (len == 2)
        return p[0] == 0xc2 && p[1] < 0xa0;
    if (len == 3 && p[0] == 0xe2 && p[1] == 0x80)
        return p[2] >= 0xaa && p[2] <= 0xae;
    if (len == 3 && p[0] == 0xe2 && p[1] == 0x81)
        return p[2] >= 0xa6 && p[2] <= 0xa9;
    return false;
}

/* Writes s escaped for a terminal (valid, harmless UTF-8 as is; everything else as escapes),
 * cut after `limit` bytes with "...". With f NULL only counts. Returns the columns written. */
static size_t put_escaped(FILE *f, sh_str s, uint64_t limit)
{
    const unsigned char *p = (const unsigned char *)s.ptr;
    size_t cols = 0;
    char tmp[16];
    uint64_t i = 0;
    while (i < s.len) {
        if (i >= limit) {
            cols += 3;
            if (f)
                fputs("...", f);
            break;
        }
        const char *out = tmp;
        size_t step = 1, len;
        unsigned char c = p[i];
        if (c == '\n')
            out = "\\n";
        else if (c == '\t')
            out = "\\t";
        else if (c == '\r')
            out = "\\r";
        else if (c == '"' || c == '\\')
            snprintf(tmp, sizeof tmp, "\\%c", c);
        else if (c >= 0x20 && c < 0x7f)
            snprintf(tmp, sizeof tmp, "%c", c);
        else if (c >= 0x80 && (len = utf8_len(p + i, s.len - i)) != 0 && !unsafe_cp(p + i, len)) {
            if (f)
                fwrite(p + i, 1, len, f);
            cols++, i += len;
            continue;
        } else {
            snprintf(tmp, sizeof tmp, "\\x%02x", c);
        }
        cols += strlen(out);
        if (f)
            fputs(out, f);
        i += step;
    }
    return cols;
}

static void put_quoted(FILE *f, sh_str s, const opts *o)
{
    fputc('"', f);
    put_escaped(f, s, o->all ? UINT64_MAX : STRING_SHOWN);
    fputc('"', f);
    if (!o->all && s.len > STRING_SHOWN)
        fprintf(f, " (%" PRIu64 " bytes)", s.len);
}

/* Shortest decimal that reads back as the same float (or double). */
static void put_float(FILE *f, double v, bool single)
{
    char buf[40];
    /* Whole numbers print as such rather than as 1e+04. */
    if (v == floor(v) && fabs(v) < 1e15) {
        fprintf(f, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        double back = strtod(buf, NULL);
        if (single ? (float)back == (float)v : back == v)
            break;
    }
    fputs(buf, f);
}

static void put_value(FILE *f, const sh_gguf_value *v, const opts *o);

static void put_array(FILE *f, const sh_gguf_value *v, const opts *o)
{
    uint64_t n = v->v.arr.n, shown = o->all || n <= ARRAY_SHOWN ? n : ARRAY_SHOWN;
    fputc('[', f);
    for (uint64_t i = 0; i < shown; i++) {
        if (i)
            fputs(", ", f);
        sh_gguf_type t = v->v.arr.type;
        if (t == SH_GGUF_STRING) {
            put_quoted(f, v->v.arr.strs[i], o);
        } else if (t == SH_GGUF_ARRAY) {
            put_array(f, &v->v.arr.vals[i], o);
        } else if (t == SH_GGUF_FLOAT32 || t == SH_GGUF_FLOAT64) {
            put_float(f, sh_gguf_arr_f64(v, i), t == SH_GGUF_FLOAT32);
        } else if (t == SH_GGUF_BOOL) {
            fputs(sh_gguf_arr_u64(v, i) ? "true" : "false", f);
        } else if (t == SH_GGUF_INT8 || t == SH_GGUF_INT16 || t == SH_GGUF_INT32 ||
                   t == SH_GGUF_INT64) {
            fprintf(f, "%" PRId64, sh_gguf_arr_i64(v, i));
        } else {
            fprintf(f, "%" PRIu64, sh_gguf_arr_u64(v, i));
        }
    }
    if (shown < n)
        fprintf(f, "%s... (%" PRIu64 " total)", shown ? ", " : "", n);
    fputc(']', f);
}

static void put_value(FILE *f, const sh_gguf_value *v, const opts *o)
{
    switch (v->type) {
    case SH_GGUF_UINT8:
    case SH_GGUF_UINT16:
    case SH_GGUF_UINT32:
    case SH_GGUF_UINT64:
        fprintf(f, "%" PRIu64, v->v.u);
        break;
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        fprintf(f, "%" PRId64, v->v.i);
        break;
    case SH_GGUF_FLOAT32:
    case SH_GGUF_FLOAT64:
        put_float(f, v->v.f, v->type == SH_GGUF_FLOAT32);
        break;
    case SH_GGUF_BOOL:
        fputs(v->v.b ? "true" : "false", f);
        break;
    case SH_GGUF_STRING:
        put_quoted(f, v->v.s, o);
        break;
    case SH_GGUF_ARRAY:
        put_array(f, v, o);
        break;
    default:
        fputs("?", f);
        break;
    }
}

/* "array[string]", "array[array]", or the scalar type's name. */
static const char *type_label(const sh_gguf_value *v, char *buf, size_t cap)
{
    if (v->type != SH_GGUF_ARRAY)
        return sh_gguf_type_name(v->type);
    snprintf(buf, cap, "array[%s]", sh_gguf_type_name(v->v.arr.type));
    return buf;
}

static void put_padded(FILE *f, sh_str s, size_t width)
{
    size_t cols = put_escaped(f, s, STRING_SHOWN);
    for (; cols < width; cols++)
        fputc(' ', f);
}

/* 1.5 KiB, 3.2 MiB, ... */
static void put_bytes(FILE *f, uint64_t n)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024 && u < 6)
        v /= 1024, u++;
    if (u == 0)
        fprintf(f, "%" PRIu64 " B", n);
    else
        fprintf(f, "%.1f %s", v, units[u]);
}

static void put_count(FILE *f, uint64_t n)
{
    static const char *const units[] = {"", "K", "M", "B", "T", "P", "E"};
    double v = (double)n;
    int u = 0;
    while (v >= 1000 && u < 6)
        v /= 1000, u++;
    if (u == 0)
        fprintf(f, "%" PRIu64, n);
    else
        fprintf(f, "%.2f%s (%" PRIu64 ")", v, units[u], n);
}

static void print_header(FILE *f, const sh_gguf *g, const char *path)
{
    uint64_t doff = sh_gguf_data_offset(g);
    fprintf(f, "file          ");
    put_escaped(f, (sh_str){path, strlen(path)}, UINT64_MAX);
    fprintf(f, "\nsize          %" PRIu64 " bytes (", sh_gguf_file_size(g));
    put_bytes(f, sh_gguf_file_size(g));
    fprintf(f,
            ")\nGGUF version  %" PRIu32 "\nalignment     %" PRIu32 "\nkv count      %" PRIu64
            "\ntensor count  %" PRIu64 "\ndata offset   %" PRIu64 " (%" PRIu64 " bytes)\n",
            sh_gguf_version(g), sh_gguf_alignment(g), sh_gguf_n_kv(g), sh_gguf_n_tensors(g), doff,
            sh_gguf_file_size(g) - doff);
}

/* One summary line "  label   value" when key is present. */
static void summary_kv(FILE *f, const sh_gguf *g, const char *label, const char *key, const opts *o)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return;
    fprintf(f, "  %-32s ", label);
    put_value(f, v, o);
    fputc('\n', f);
}

static void print_model(FILE *f, const sh_gguf *g, const opts *o)
{
    static const char *const arch_keys[] = {
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "rope.dimension_count",
        "attention.layer_norm_rms_epsilon",
        "vocab_size",
        "attention.layer_norm_epsilon",
    };
    if (!sh_gguf_find(g, "general.architecture") && !sh_gguf_find(g, "general.name"))
        return;
    fprintf(f, "\nmodel\n");
    summary_kv(f, g, "architecture", "general.architecture", o);
    summary_kv(f, g, "name", "general.name", o);
    summary_kv(f, g, "file_type", "general.file_type", o);
    sh_str arch;
    if (sh_gguf_get_str(g, "general.architecture", &arch) != SH_OK || arch.len > 64)
        return;
    char key[160];
    for (size_t i = 0; i < sizeof arch_keys / sizeof arch_keys[0]; i++) {
        snprintf(key, sizeof key, "%.*s.%s", (int)arch.len, arch.ptr, arch_keys[i]);
        summary_kv(f, g, arch_keys[i], key, o);
    }
}

static void special_token(FILE *f, const sh_gguf *g, const char *label, const char *key,
                          const sh_gguf_value *tokens)
{
    uint64_t id;
    if (sh_gguf_get_u64(g, key, &id) != SH_OK)
        return;
    fprintf(f, "  %-32s %" PRIu64, label, id);
    if (tokens && id < tokens->v.arr.n) {
        fputs(" \"", f);
        put_escaped(f, tokens->v.arr.strs[id], STRING_SHOWN);
        fputc('"', f);
    } else {
        fputs(" (no such token)", f);
    }
    fputc('\n', f);
}

static void print_tokenizer(FILE *f, const sh_gguf *g, const opts *o)
{
    const sh_gguf_value *tokens = NULL, *merges = NULL;
    sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &tokens);
    sh_gguf_get_arr(g, "tokenizer.ggml.merges", SH_GGUF_STRING, &merges);
    if (!tokens && !sh_gguf_find(g, "tokenizer.ggml.model"))
        return;
    fprintf(f, "\ntokenizer\n");
    summary_kv(f, g, "model", "tokenizer.ggml.model", o);
    summary_kv(f, g, "pre", "tokenizer.ggml.pre", o);
    if (tokens)
        fprintf(f, "  %-32s %" PRIu64 "\n", "vocab size", tokens->v.arr.n);
    if (merges)
        fprintf(f, "  %-32s %" PRIu64 "\n", "merges", merges->v.arr.n);
    special_token(f, g, "bos", "tokenizer.ggml.bos_token_id", tokens);
    special_token(f, g, "eos", "tokenizer.ggml.eos_token_id", tokens);
    special_token(f, g, "unk", "tokenizer.ggml.unknown_token_id", tokens);
    special_token(f, g, "pad", "tokenizer.ggml.padding_token_id", tokens);
    summary_kv(f, g, "add_bos_token", "tokenizer.ggml.add_bos_token", o);
    summary_kv(f, g, "add_eos_token", "tokenizer.ggml.add_eos_token", o);
    sh_str tmpl;
    if (sh_gguf_get_str(g, "tokenizer.chat_template", &tmpl) == SH_OK)
        fprintf(f, "  %-32s present (%" PRIu64 " bytes)\n", "chat template", tmpl.len);
    else
        fprintf(f, "  %-32s none\n", "chat template");
}

static void print_params(FILE *f, const sh_gguf *g)
{
    uint64_t n_t = sh_gguf_n_tensors(g);
    if (n_t == 0)
        return;
    uint64_t count[SH_DTYPE_COUNT_] = {0}, params[SH_DTYPE_COUNT_] = {0},
             bytes[SH_DTYPE_COUNT_] = {0}, total = 0, total_bytes = 0;
    for (uint64_t i = 0; i < n_t; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        count[t->type]++;
        params[t->type] += t->n_elems; /* each is below 2^64 and the file holds the data, */
        bytes[t->type] += t->nbytes;   /* so the sums are bounded by the file size too */
        total += t->n_elems;
        total_bytes += t->nbytes;
    }
    fprintf(f, "\nparameters\n  %-32s ", "total");
    put_count(f, total);
    fprintf(f, ", %" PRIu64 " bytes (", total_bytes);
    put_bytes(f, total_bytes);
    fprintf(f, ")\n");
    for (int d = 0; d < SH_DTYPE_COUNT_; d++) {
        if (!count[d])
            continue;
        fprintf(f, "  %-32s %" PRIu64 " tensors, %" PRIu64 " params, %" PRIu64 " bytes\n",
                sh__dtype_name((uint32_t)d), count[d], params[d], bytes[d]);
    }
}

static void print_metadata(FILE *f, const sh_gguf *g, const opts *o)
{
    size_t width = 0;
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        size_t w = put_escaped(NULL, sh_gguf_kv_at(g, i)->key, STRING_SHOWN);
        width = w > width ? w : width;
    }
    fprintf(f, "\nmetadata (%" PRIu64 " keys)\n", sh_gguf_n_kv(g));
    char tbuf[32];
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        fputs("  ", f);
        put_padded(f, kv->key, width);
        fprintf(f, "  %-15s ", type_label(&kv->value, tbuf, sizeof tbuf));
        put_value(f, &kv->value, o);
        fputc('\n', f);
    }
}

static void format_shape(const sh_gguf_tensor *t, char *buf, size_t cap)
{
    int len = snprintf(buf, cap, "[");
    for (uint32_t d = 0; d < t->n_dims; d++)
        len += snprintf(buf + len, cap - (size_t)len, "%s%" PRIu64, d ? ", " : "", t->ne[d]);
    snprintf(buf + len, cap - (size_t)len, "]");
}

static void print_tensors(FILE *f, const sh_gguf *g)
{
    uint64_t n = sh_gguf_n_tensors(g);
    size_t width = 4, swidth = 5;
    if (n == 0) {
        fprintf(f, "\ntensors (0)\n");
        return;
    }
    char shape[128]; /* 4 dims of at most 20 digits fit */
    for (uint64_t i = 0; i < n; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        size_t w = put_escaped(NULL, t->name, STRING_SHOWN);
        width = w > width ? w : width;
        format_shape(t, shape, sizeof shape);
        swidth = strlen(shape) > swidth ? strlen(shape) : swidth;
    }
    fprintf(f, "\ntensors (%" PRIu64 ")\n  %5s  %-*s  %-7s  %-*s  %12s  %12s\n", n, "#", (int)width,
            "name", "type", (int)swidth, "shape", "bytes", "offset");
    for (uint64_t i = 0; i < n; i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        format_shape(t, shape, sizeof shape);
        fprintf(f, "  %5" PRIu64 "  ", i);
        put_padded(f, t->name, width);
        fprintf(f, "  %-7s  %-*s  %12" PRIu64 "  %12" PRIu64 "\n", sh__dtype_name(t->type),
                (int)swidth, shape, t->nbytes, t->offset);
    }
}

/* Prints "error: MSG" on one line, whatever bytes the message holds. */
static void print_error(const char *msg)
{
    fputs("error: ", stderr);
    for (const char *p = msg; *p; p++)
        fputc((unsigned char)*p < 0x20 ? '?' : *p, stderr);
    fputc('\n', stderr);
}

static int parse_args(int argc, char **argv, opts *o)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            return 1;
        if (strcmp(a, "--all") == 0)
            o->all = true;
        else if (strcmp(a, "--no-tensors") == 0)
            o->no_tensors = true;
        else if (a[0] == '-' && a[1] != '\0')
            return fprintf(stderr, "error: unknown option '%s'\n", a), -1;
        else if (o->path)
            return fprintf(stderr, "error: more than one FILE\n"), -1;
        else
            o->path = a;
    }
    if (!o->path)
        return fprintf(stderr, "error: missing FILE\n"), -1;
    return 0;
}

int sh__cmd_inspect(int argc, char **argv)
{
    opts o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        usage(rc > 0 ? stdout : stderr);
        return rc > 0 ? 0 : 2;
    }
    sh_gguf *g;
    sh_error e = {0};
    if (sh_gguf_open(o.path, NULL, &g, &e) != SH_OK) {
        print_error(e.msg);
        return 2;
    }
    print_header(stdout, g, o.path);
    print_model(stdout, g, &o);
    print_tokenizer(stdout, g, &o);
    print_params(stdout, g);
    print_metadata(stdout, g, &o);
    if (!o.no_tensors)
        print_tensors(stdout, g);
    sh_gguf_close(g);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "error: writing the output failed\n");
        return 1;
    }
    return 0;
}
