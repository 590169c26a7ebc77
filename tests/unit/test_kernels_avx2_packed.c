/* The AVX2 kernels on packed Q4_0 and Q4_1 weights (ops_avx2_packed.c), called directly on a
 * packed copy, against the scalar reference on the file layout (within 2e-5 of sum_k |w||x|;
 * only the float order differs), every token bitwise equal to the same token alone (the matvec),
 * rows outside the range untouched; and through an AVX2 backend with prepared weights. Exit 77
 * without AVX2. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#define KT_SEED 0xa4093822299f31d0ull
#include "kernels_test_util.h"

static const sh_dtype types[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1};
static const sh__cpu_mm_fn packed_fn[] = {sh__cpu_avx2_mmp_q4_0, sh__cpu_avx2_mmp_q4_1};

/* Activation codes of n_tok rows as the backend makes them (the scalar rule). */
typedef struct acts {
    sh__cpu_act a;
    float *x, *d, *s;
    int8_t *qs;
} acts;

static acts make_acts(int64_t n_tok, int64_t n_in, const float *x0)
{
    const int64_t nb = n_in / 32;
    acts r = {.x = malloc((size_t)(n_tok * n_in) * sizeof(float)),
              .d = malloc((size_t)(n_tok * nb) * sizeof(float)),
              .s = malloc((size_t)(n_tok * nb) * sizeof(float)),
              .qs = malloc((size_t)(n_tok * n_in))};
    if (x0)
        memcpy(r.x, x0, (size_t)(n_tok * n_in) * sizeof(float));
    else
        fill(r.x, n_tok * n_in, 1.0f);
    for (int64_t t = 0; t < n_tok; t++)
        sh__cpu_quant_act_ref(r.x + t * n_in, n_in, r.qs + t * n_in, r.d + t * nb, r.s + t * nb);
    r.a = (sh__cpu_act){.x = r.x, .qs = r.qs, .d = r.d, .s = r.s, .n_in = n_in, .n_tok = n_tok};
    return r;
}

static void free_acts(acts *r)
{
    free(r->x);
    free(r->d);
    free(r->s);
    free(r->qs);
}

/* Ragged rows (padding rows, masked stores, a range starting inside a half), token counts
 * around the 3-token tile (1, 2, 3, 4, 17) and one past the 1 MiB token block (n_in 16384, 70
 * tokens), accumulate on and off. */
static void test_vs_ref(void)
{
    const int64_t n_ins[] = {32, 576, 2048, 16384};
    const int64_t n_outs[] = {1, 7, 16, 33, 70};
    const int64_t n_toks[] = {1, 2, 3, 4, 17, 70};
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t ai = 0; ai < 4; ai++)
            for (size_t bi = 0; bi < 5; bi++)
                for (size_t ci = 0; ci < 6; ci++) {
                    const int64_t n_in = n_ins[ai], n_out = n_outs[bi], n_tok = n_toks[ci];
                    if ((n_tok == 70) != (n_in == 16384 && n_out == 33))
                        continue;
                    wmat w = make_w(types[ti], n_out, n_in);
                    const size_t gb = sh__cpu_pack_group_bytes(types[ti], n_in);
                    const size_t pbytes = sh__cpu_pack_bytes(types[ti], n_out, n_in);
                    uint8_t *p = aligned_alloc(64, (pbytes + 63) & ~(size_t)63);
                    sh__cpu_pack(types[ti], w.t.data, n_out, n_in, p);
                    acts A = make_acts(n_tok, n_in, NULL);
                    const size_t ny = (size_t)(n_tok * n_out);
                    float *y0 = malloc(ny * sizeof(float)), *y = malloc(ny * sizeof(float));
                    float *yr = malloc(ny * sizeof(float)), *y1 = malloc((size_t)n_out * 4);
                    fill(y0, (int64_t)ny, 1.0f);
                    sh__cpu_mm mr = {&A.a, w.t.data, sh__dtype_row_bytes(types[ti], (uint64_t)n_in),
                                     yr,   n_out,    0};
                    sh__cpu_mm_for(&sh__cpu_kernels_ref, types[ti])(&mr, 0, n_out);
                    const int64_t ranges[3][2] = {
                        {0, n_out}, {16, n_out}, {3, n_out < 20 ? n_out : 20}};
                    for (int ri = 0; ri < 3; ri++)
                        for (int accum = 0; accum < 2; accum++) {
                            const int64_t r0 = ranges[ri][0], r1 = ranges[ri][1];
                            if (r0 >= r1)
                                continue;
                            memcpy(y, y0, ny * sizeof(float));
                            sh__cpu_mm mp = {&A.a, p, gb, y, n_out, accum};
                            packed_fn[ti](&mp, r0, r1);
                            double worst = 0;
                            for (int64_t t = 0; t < n_tok; t++)
                                for (int64_t r = 0; r < n_out; r++) {
                                    const float got = y[t * n_out + r];
                                    if (r < r0 || r >= r1) {
                                        if (got != y0[t * n_out + r])
                                            SH_FAIL_("row %lld outside [%lld, %lld) written",
                                                     (long long)r, (long long)r0, (long long)r1);
                                        continue;
                                    }
                                    double sa = 0;
                                    for (int64_t k = 0; k < n_in; k++)
                                        sa += fabs((double)w.deq[r * n_in + k] * A.x[t * n_in + k]);
                                    const double want =
                                        yr[t * n_out + r] + (accum ? y0[t * n_out + r] : 0.0f);
                                    const double e = fabs(got - want) / (sa + 1e-30);
                                    if (!(e <= worst))
                                        worst = e;
                                }
                            if (!(worst <= 2e-5))
                                SH_FAIL_("%s n_in %lld n_out %lld n_tok %lld rows [%lld, %lld) "
                                         "accumulate %d: %.3g",
                                         sh__dtype_name(types[ti]), (long long)n_in,
                                         (long long)n_out, (long long)n_tok, (long long)r0,
                                         (long long)r1, accum, worst);
                        }
                    /* each token alone (the matvec path) gives the tile's bits */
                    memcpy(y, y0, ny * sizeof(float));
                    sh__cpu_mm mp = {&A.a, p, gb, y, n_out, 0};
                    packed_fn[ti](&mp, 0, n_out);
                    for (int64_t t = 0; t < n_tok; t++) {
                        acts one = make_acts(1, n_in, A.x + t * n_in);
                        sh__cpu_mm m1 = {&one.a, p, gb, y1, n_out, 0};
                        packed_fn[ti](&m1, 0, n_out);
                        if (memcmp(y1, y + t * n_out, (size_t)n_out * sizeof(float)))
                            SH_FAIL_("%s n_in %lld n_out %lld: token %lld alone differs",
                                     sh__dtype_name(types[ti]), (long long)n_in, (long long)n_out,
                                     (long long)t);
                        free_acts(&one);
                    }
                    free(p);
                    free(y0);
                    free(y);
                    free(yr);
                    free(y1);
                    free_acts(&A);
                    free_w(&w);
                }
}

/* An AVX2 backend prepares (packs) Q4_0 and Q4_1 weights and its matmuls read the copy: a
 * 40-token prefill and a decode row on 2 threads against the scalar reference. */
static void test_backend(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AVX2, 2), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    const int64_t n_in = 576, n_out = 77;
    for (size_t ti = 0; ti < 2; ti++)
        for (int64_t n_tok = 1; n_tok <= 40; n_tok += 39) {
            wmat w = make_w(types[ti], n_out, n_in);
            CHECK_OK(sh_backend_weight_prepare(be, &w.t));
            CHECK(sh_backend_weight_copied(be, &w.t));
            float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
            float *y = malloc((size_t)(n_tok * n_out) * sizeof(float));
            float *ry = malloc((size_t)(n_tok * n_out) * sizeof(float));
            fill(x, n_tok * n_in, 1.0f);
            CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y));
            CHECK_OK(sh_backend_matmul(ref, rs, &w.t, x, n_tok, ry));
            CHECK_OK(sh_backend_sync(be, s));
            CHECK_OK(sh_backend_sync(ref, rs));
            const double worst = worst_rel_err(&w, x, y, ry, n_tok, n_out, n_in);
            if (!(worst <= 2e-5))
                SH_FAIL_("avx2 backend %s n_tok %lld: %.3g", sh__dtype_name(types[ti]),
                         (long long)n_tok, worst);
            sh_backend_weight_release(be, w.t.data);
            free(x);
            free(y);
            free(ry);
            free_w(&w);
        }
    sh_backend_stream_destroy(be, s);
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(be);
    sh_backend_destroy(ref);
}

int main(int argc, char **argv)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX2) {
        fprintf(stderr, "skip: no AVX2 + FMA + F16C here\n");
        return 77;
    }
    static const sh_test_case tests[] = {
        {"vs_ref", test_vs_ref},
        {"backend", test_backend},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
