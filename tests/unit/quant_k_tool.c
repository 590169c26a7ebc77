/* Test helper for test_quant_k_gguf.py: converts a file of raw blocks to little-endian floats
 * (`deq TYPE IN OUT`) or floats to blocks (`q TYPE IN OUT`) with the scalar reference in
 * kernels/cpu/quant.c, so a Python reference can check our bytes and floats. Exit 0 on success,
 * 2 on bad arguments or input, 1 on an I/O error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/quant.h"

static void *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            unsigned char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

static int write_all(const char *path, const void *p, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t put = fwrite(p, 1, len, f);
    return (fclose(f) == 0 && put == len) ? 0 : -1;
}

int main(int argc, char **argv)
{
    sh_dtype type;
    if (argc != 5 || (strcmp(argv[1], "deq") && strcmp(argv[1], "q")) ||
        !sh__dtype_parse(argv[2], &type) || !sh__quant_supported(type)) {
        fprintf(stderr, "usage: quant_k_tool deq|q TYPE IN OUT\n");
        return 2;
    }
    const sh_dtype_info *info = sh__dtype_info((uint32_t)type);
    size_t len;
    void *in = read_all(argv[3], &len);
    if (!in) {
        fprintf(stderr, "error: cannot read %s\n", argv[3]);
        return 1;
    }
    int dequant = strcmp(argv[1], "deq") == 0;
    size_t unit = dequant ? info->block_bytes : info->block_elems * sizeof(float);
    if (len % unit) {
        fprintf(stderr, "error: %s: %zu bytes is not whole blocks of %zu\n", argv[3], len, unit);
        free(in);
        return 2;
    }
    int64_t n = (int64_t)(len / unit) * info->block_elems;
    size_t out_len =
        dequant ? (size_t)n * sizeof(float) : (size_t)sh__dtype_row_bytes(type, (uint64_t)n);
    void *out = malloc(out_len ? out_len : 1);
    sh_err err = dequant ? sh__dequant_row(type, in, out, n) : sh__quant_row(type, in, out, n);
    int rc = 0;
    if (err != SH_OK) {
        fprintf(stderr, "error: %s\n", sh_strerror(err));
        rc = 2;
    } else if (write_all(argv[4], out, out_len)) {
        fprintf(stderr, "error: cannot write %s\n", argv[4]);
        rc = 1;
    }
    free(in);
    free(out);
    return rc;
}
