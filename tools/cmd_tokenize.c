/* `shoal tokenize`: encodes text with a GGUF file's tokenizer and prints the ids (or pieces), or
 * decodes a list of ids back to text. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "tools/cmd.h"

static int usage(const char *why)
{
    if (why)
        fprintf(stderr, "shoal tokenize: %s\n", why);
    fprintf(stderr,
            "usage: shoal tokenize -m FILE.gguf (-p TEXT | -f FILE) [--special] [--no-bos] "
            "[--pieces]\n"
            "       shoal tokenize -m FILE.gguf --decode \"ID ID ...\" [--special]\n"
            "  -p TEXT       text to encode\n"
            "  -f FILE       file to encode ('-' for standard input)\n"
            "  --special     recognise special tokens (<|im_start|>, <s>, ...) in the text; when\n"
            "                decoding, print them\n"
            "  --no-bos      do not add the BOS token the model asks for\n"
            "  --pieces      one line per token: the id and its quoted piece\n"
            "  --decode IDS  print the text of the ids (separated by spaces or commas)\n");
    return 2;
}

static char *read_stream(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0, k;
    char *buf = malloc(cap);
    while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                return NULL;
            }
            buf = b;
            cap *= 2;
        }
    }
    if (buf && ferror(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* Length of the valid UTF-8 character (two bytes or more) at p[0, n), or 0. */
static size_t utf8_char(const unsigned char *p, size_t n)
{
    size_t k = p[0] >= 0xC2 && p[0] <= 0xDF   ? 2
               : p[0] >= 0xE0 && p[0] <= 0xEF ? 3
               : p[0] >= 0xF0 && p[0] <= 0xF4 ? 4
                                              : 0;
    if (k == 0 || k > n)
        return 0;
    for (size_t i = 1; i < k; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    unsigned c1 = p[1];
    if ((p[0] == 0xE0 && c1 < 0xA0) || (p[0] == 0xED && c1 > 0x9F) || (p[0] == 0xF0 && c1 < 0x90) ||
        (p[0] == 0xF4 && c1 > 0x8F))
        return 0;
    return k;
}

/* Prints a piece in double quotes: printable ASCII and whole UTF-8 characters as they are, other
 * bytes (controls, a character split across tokens) as escapes. */
static void print_quoted(const char *p, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        size_t k = c >= 0x80 ? utf8_char((const unsigned char *)p + i, n - i) : 0;
        if (k) {
            fwrite(p + i, 1, k, stdout);
            i += k - 1;
            continue;
        }
        switch (c) {
        case '"':
            fputs("\\\"", stdout);
            break;
        case '\\':
            fputs("\\\\", stdout);
            break;
        case '\n':
            fputs("\\n", stdout);
            break;
        case '\t':
            fputs("\\t", stdout);
            break;
        case '\r':
            fputs("\\r", stdout);
            break;
        default:
            if (c < 0x20 || c >= 0x7F)
                printf("\\x%02X", c);
            else
                putchar(c);
        }
    }
    putchar('"');
}

static int encode_cmd(const sh_tokenizer *t, const char *text, size_t len, uint32_t flags,
                      int pieces)
{
    sh_error e = {0};
    size_t n = 0;
    sh_err err = sh_tokenizer_encode(t, text, len, flags, NULL, 0, &n, &e);
    if (err != SH_OK && err != SH_ERANGE) {
        fprintf(stderr, "error: %s\n", e.msg);
        return 1;
    }
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids || sh_tokenizer_encode(t, text, len, flags, ids, n, &n, &e) != SH_OK) {
        fprintf(stderr, "error: %s\n", ids ? e.msg : "out of memory");
        free(ids);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        if (pieces) {
            const char *p;
            size_t k = sh_tokenizer_piece(t, ids[i], SH_DECODE_SPECIAL, &p);
            printf("%d ", (int)ids[i]);
            print_quoted(p, k);
            putchar('\n');
        } else {
            printf(i ? " %d" : "%d", (int)ids[i]);
        }
    }
    if (!pieces)
        putchar('\n');
    free(ids);
    return 0;
}

static int decode_cmd(const sh_tokenizer *t, const char *list, int special)
{
    size_t cap = 64, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    for (const char *q = list; ids;) {
        while (*q == ' ' || *q == ',' || *q == '\t' || *q == '\n')
            q++;
        if (!*q)
            break;
        char *end;
        errno = 0;
        long v = strtol(q, &end, 10);
        if (end == q || errno || v < 0 || v >= sh_tokenizer_n_vocab(t)) {
            free(ids);
            fprintf(stderr, "error: --decode: bad token id at '%.20s' (vocabulary of %d)\n", q,
                    (int)sh_tokenizer_n_vocab(t));
            return 2;
        }
        if (n == cap) {
            int32_t *b = realloc(ids, 2 * cap * sizeof *ids);
            if (!b)
                break;
            ids = b;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        q = end;
    }
    uint32_t flags = SH_DECODE_STRIP_SPACE | (special ? SH_DECODE_SPECIAL : 0);
    size_t len = 0;
    sh_err err = ids ? sh_tokenizer_decode(t, ids, n, flags, NULL, 0, &len, NULL) : SH_ENOMEM;
    char *buf = err == SH_OK || err == SH_ERANGE ? malloc(len + 1) : NULL;
    if (!buf || sh_tokenizer_decode(t, ids, n, flags, buf, len + 1, &len, NULL) != SH_OK) {
        fprintf(stderr, "error: decode: out of memory\n");
        free(ids);
        free(buf);
        return 1;
    }
    fwrite(buf, 1, len, stdout);
    putchar('\n');
    free(ids);
    free(buf);
    return 0;
}

int sh__cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *prompt = NULL, *file = NULL, *decode = NULL;
    int special = 0, no_bos = 0, pieces = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_value = i + 1 < argc;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!has_value)
                return usage("-m needs a file");
            model = argv[++i];
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            if (!has_value)
                return usage("-p needs a text");
            prompt = argv[++i];
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            if (!has_value)
                return usage("-f needs a file");
            file = argv[++i];
        } else if (!strcmp(a, "--decode")) {
            if (!has_value)
                return usage("--decode needs a list of ids");
            decode = argv[++i];
        } else if (!strcmp(a, "--special")) {
            special = 1;
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = 1;
        } else if (!strcmp(a, "--pieces")) {
            pieces = 1;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(NULL);
            return 0;
        } else {
            fprintf(stderr, "shoal tokenize: unknown argument '%s'\n", a);
            return usage(NULL);
        }
    }
    if (!model)
        return usage("-m is required");
    if ((prompt != NULL) + (file != NULL) + (decode != NULL) != 1)
        return usage("give exactly one of -p, -f and --decode");

    sh_error e = {0};
    sh_gguf *g = NULL;
    if (sh_gguf_open(model, NULL, &g, &e) != SH_OK) {
        fprintf(stderr, "error: %s\n", e.msg);
        return 2;
    }
    sh_tokenizer *t = NULL;
    sh_err err = sh_tokenizer_create_gguf(g, &t, &e);
    sh_gguf_close(g);
    if (err) {
        fprintf(stderr, "error: %s: %s\n", model, e.msg);
        return 2;
    }
    if (!sh_tokenizer_pre_known(t))
        fprintf(stderr, "warning: unknown pre-tokenizer '%s'; using the default rules\n",
                sh_tokenizer_pre(t));

    int rc;
    if (decode) {
        rc = decode_cmd(t, decode, special);
    } else {
        size_t len = prompt ? strlen(prompt) : 0;
        char *text = NULL;
        if (file) {
            FILE *f = strcmp(file, "-") ? fopen(file, "rb") : stdin;
            text = f ? read_stream(f, &len) : NULL;
            if (f && f != stdin)
                fclose(f);
            if (!text) {
                fprintf(stderr, "error: %s: %s\n", file, f ? "read failed" : strerror(errno));
                sh_tokenizer_destroy(t);
                return 2;
            }
        }
        uint32_t flags = (special ? SH_TOKENIZE_PARSE_SPECIAL : 0) |
                         (sh_tokenizer_wants_bos(t) && !no_bos ? SH_TOKENIZE_ADD_BOS : 0);
        rc = encode_cmd(t, text ? text : prompt, len, flags, pieces);
        free(text);
    }
    if (fflush(stdout) != 0 && rc == 0)
        rc = 1;
    sh_tokenizer_destroy(t);
    return rc;
}
