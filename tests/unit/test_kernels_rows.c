/* Row independence of the CPU matmul kernels (see kernels_rows.cmake): for every weight type the
 * backend multiplies, every ISA this machine runs, the file layout and the packed copy
 * (sh_backend_weight_prepare), a batch of n_tok tokens gives each token the bits it gets alone. */
#include <stdint.h>

#include "kernels/cpu/cpu.h"
#include "kernels_test_util.h"

static const sh_dtype types[] = {SH_DTYPE_F32,    SH_DTYPE_F16,    SH_DTYPE_BF16, SH_DTYPE_Q4_0,
                                 SH_DTYPE_Q4_1,   SH_DTYPE_Q5_0,   SH_DTYPE_Q5_1, SH_DTYPE_Q8_0,
                                 SH_DTYPE_IQ4_NL, SH_DTYPE_IQ4_XS, SH_DTYPE_Q2_K, SH_DTYPE_Q3_K,
                                 SH_DTYPE_Q4_K,   SH_DTYPE_Q5_K,   SH_DTYPE_Q6_K};

/* Checks w (n_out x n_in) on one backend: x holds 17 tokens; batches of each size in n_toks
 * against every token alone. Returns the number of batches checked. */
static int check(sh_backend *be, sh_backend_stream *st, const char *what, const sh_tensor *w,
                 const float *x, int64_t n_in, int64_t n_out)
{
    static const int64_t n_toks[] = {2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17};
    float *alone = malloc((size_t)(17 * n_out) * sizeof(float));
    float *batch = malloc((size_t)(17 * n_out) * sizeof(float));
    for (int64_t t = 0; t < 17; t++)
        CHECK_OK(sh_backend_matmul(be, st, w, x + t * n_in, 1, alone + t * n_out));
    CHECK_OK(sh_backend_sync(be, st));
    int n = 0;
    for (size_t i = 0; i < sizeof n_toks / sizeof n_toks[0]; i++, n++) {
        const int64_t nt = n_toks[i];
        /* the batch starts at token 17 - nt, so that its tokens are not the first ones alone */
        CHECK_OK(sh_backend_matmul(be, st, w, x + (17 - nt) * n_in, nt, batch));
        CHECK_OK(sh_backend_sync(be, st));
        for (int64_t t = 0; t < nt; t++)
            if (memcmp(batch + t * n_out, alone + (17 - nt + t) * n_out,
                       (size_t)n_out * sizeof(float)) != 0) {
                SH_FAIL_("%s: token %lld of a batch of %lld differs from the token alone", what,
                         (long long)t, (long long)nt);
                break;
            }
    }
    free(alone);
    free(batch);
    return n;
}

static void test_rows(void)
{
    int checked = 0;
    for (int isa = SH_BACKEND_CPU_ISA_SCALAR; isa <= sh__cpu_isa_detect(); isa++) {
        sh_backend *be = NULL;
        sh_backend_stream *st = NULL;
        sh_error e = {0};
        sh_backend_cpu_opts o = {.n_threads = 2, .isa = isa};
        if (sh_backend_cpu_create(&o, &be, &e) || sh_backend_stream_create(be, &st, &e)) {
            SH_FAIL_("backend isa %d: %s", isa, e.msg);
            return;
        }
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            const sh_dtype ty = types[ti];
            if (!sh__quant_supported(ty))
                continue;
            /* 512 inputs for every type; for the float types also 72 and 80, whose tails take
             * the kernels' short steps and scalar ends */
            const int64_t widths[] = {512, 80, 72};
            const bool fl = ty == SH_DTYPE_F32 || ty == SH_DTYPE_F16 || ty == SH_DTYPE_BF16;
            for (int wi = 0; wi < (fl ? 3 : 1); wi++) {
                const int64_t n_in = widths[wi], n_out = 40;
                wmat w = make_w(ty, n_out, n_in);
                float *x = malloc((size_t)(17 * n_in) * sizeof(float));
                fill(x, 17 * n_in, 1.0f);
                for (int packed = 0; packed < 2; packed++) {
                    char what[96];
                    snprintf(what, sizeof what, "%s %s n_in %lld %s",
                             sh_backend_cpu_isa_name(sh_backend_cpu_isa(be)), sh__dtype_name(ty),
                             (long long)n_in, packed ? "packed" : "file layout");
                    if (packed && sh_backend_weight_prepare(be, &w.t) != SH_OK)
                        continue; /* a type this ISA keeps in the file layout */
                    checked += check(be, st, what, &w.t, x, n_in, n_out);
                    if (packed)
                        sh_backend_weight_release(be, w.t.data);
                }
                free(x);
                free_w(&w);
            }
        }
        sh_backend_stream_destroy(be, st);
        sh_backend_destroy(be);
    }
    fprintf(stderr, "%d batches checked against their tokens alone\n", checked);
    CHECK(checked > 0);
}

static const sh_test_case tests[] = {
    {"rows", test_rows},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
