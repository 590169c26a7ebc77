/* The AMX forms of the packed 32-block kernels (ops_avx512_packed.c) against the VNNI forms they
 * must equal bit for bit, called directly on the same packed weights and activation codes; and
 * through the backend (SHOAL_ISA's amx level) against the scalar reference. Exit 77 where the
 * CPU has no AMX or the OS does not grant its tile state. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#define KT_SEED 0x3f84d5b5b5470917ull
#include "kernels_test_util.h"

static const sh_dtype types[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0, SH_DTYPE_Q5_0,
                                 SH_DTYPE_Q5_1};
static const sh__cpu_mm_fn vnni[] = {sh__cpu_avx512_mmp_q4_0, sh__cpu_avx512_mmp_q4_1,
                                     sh__cpu_avx512_mmp_q8_0, sh__cpu_avx512_mmp_q5_0,
                                     sh__cpu_avx512_mmp_q5_1};
static const sh__cpu_mm_fn amx[] = {sh__cpu_amx_mmp_q4_0, sh__cpu_amx_mmp_q4_1,
                                    sh__cpu_amx_mmp_q8_0, sh__cpu_amx_mmp_q5_0,
                                    sh__cpu_amx_mmp_q5_1};

/* Ragged shapes: rows not a multiple of 16 (padding rows, masked stores), token counts of whole
 * 16-token tiles and with VNNI tails (17, 37), one past the 1 MiB token block at n_in 4096 (300
 * tokens: blocks of 240 and 60); row sub-ranges starting inside a group; accumulate on and off.
 * Every output bitwise equal to the VNNI kernel's, and rows outside the range untouched. */
static void test_amx_equals_vnni(void)
{
    const int64_t n_ins[] = {32, 256, 4096};
    const int64_t n_outs[] = {7, 16, 33, 50};
    const int64_t n_toks[] = {16, 17, 37, 300};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t ai = 0; ai < 3; ai++)
            for (size_t bi = 0; bi < 4; bi++)
                for (size_t ci = 0; ci < 4; ci++) {
                    const int64_t n_in = n_ins[ai], n_out = n_outs[bi], n_tok = n_toks[ci];
                    if (n_tok == 300 && (n_in != 4096 || n_out != 33))
                        continue;
                    const int64_t nb = n_in / 32;
                    wmat w = make_w(types[ti], n_out, n_in);
                    const size_t gb = sh__cpu_pack_group_bytes(types[ti], n_in);
                    const size_t pbytes = sh__cpu_pack_bytes(types[ti], n_out, n_in);
                    uint8_t *p = aligned_alloc(64, (pbytes + 63) & ~(size_t)63);
                    sh__cpu_pack(types[ti], w.t.data, n_out, n_in, p);
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    int8_t *qs = malloc((size_t)(n_tok * n_in));
                    float *d = malloc((size_t)(n_tok * nb) * sizeof(float));
                    float *s = malloc((size_t)(n_tok * nb) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    for (int64_t t = 0; t < n_tok; t++)
                        sh__cpu_quant_act_ref(x + t * n_in, n_in, qs + t * n_in, d + t * nb,
                                              s + t * nb);
                    const sh__cpu_act act = {
                        .x = x, .qs = qs, .d = d, .s = s, .n_in = n_in, .n_tok = n_tok};
                    const size_t ny = (size_t)(n_tok * n_out);
                    float *y0 = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float));
                    float *yv = malloc(ny * sizeof(float));
                    fill(y0, (int64_t)ny, 1.0f);
                    const int64_t ranges[3][2] = {
                        {0, n_out}, {16, n_out}, {3, n_out < 20 ? n_out : 20}};
                    for (int ri = 0; ri < 3; ri++)
                        for (int accum = 0; accum < 2; accum++) {
                            const int64_t r0 = ranges[ri][0], r1 = ranges[ri][1];
                            if (r0 >= r1)
                                continue;
                            memcpy(ya, y0, ny * sizeof(float));
                            memcpy(yv, y0, ny * sizeof(float));
                            sh__cpu_mm mv = {&act, p, gb, yv, n_out, accum};
                            sh__cpu_mm ma = {&act, p, gb, ya, n_out, accum};
                            vnni[ti](&mv, r0, r1);
                            amx[ti](&ma, r0, r1);
                            if (memcmp(ya, yv, ny * sizeof(float)))
                                SH_FAIL_("%s n_in %lld n_out %lld n_tok %lld rows [%lld, %lld) "
                                         "accumulate %d: AMX differs from VNNI",
                                         sh__dtype_name(types[ti]), (long long)n_in,
                                         (long long)n_out, (long long)n_tok, (long long)r0,
                                         (long long)r1, accum);
                            for (int64_t t = 0; t < n_tok; t++)
                                for (int64_t r = 0; r < n_out; r++)
                                    if ((r < r0 || r >= r1) &&
                                        ya[t * n_out + r] != y0[t * n_out + r])
                                        SH_FAIL_("%s: row %lld outside [%lld, %lld) written",
                                                 sh__dtype_name(types[ti]), (long long)r,
                                                 (long long)r0, (long long)r1);
                        }
                    free(p);
                    free(x);
                    free(qs);
                    free(d);
                    free(s);
                    free(y0);
                    free(ya);
                    free(yv);
                    free_w(&w);
                }
}

/* Through the backend at the amx level (prepared weights) against the scalar reference on the
 * file layout: within 2e-5 of sum_k |w||x|, a 64-token prefill on 2 threads. */
static void test_amx_backend(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AMX, 2), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    CHECK_INT_EQ(sh_backend_cpu_isa(be), SH_BACKEND_CPU_ISA_AMX);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    const int64_t n_in = 576, n_out = 70, n_tok = 64;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        wmat w = make_w(types[ti], n_out, n_in);
        CHECK_OK(sh_backend_weight_prepare(be, &w.t));
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
            SH_FAIL_("amx backend %s: %.3g", sh__dtype_name(types[ti]), worst);
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
    if (!sh__cpu_amx_usable()) {
        fprintf(stderr, "skip: no AMX-INT8 here (or the OS did not grant the tile state)\n");
        return 77;
    }
    static const sh_test_case tests[] = {
        {"amx_equals_vnni", test_amx_equals_vnni},
        {"amx_backend", test_amx_backend},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
