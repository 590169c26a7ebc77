/* The AMX forms of the packed 32-block kernels (ops_avx512_packed.c), called directly: without
 * bf16 activations (sh__cpu_act.xb) the INT8 form against the VNNI forms it must equal bit for
 * bit; with them the BF16 form against a double-precision product of the same bf16-rounded
 * operands and against the exact product, and each token's result against the same token in
 * other calls. Then through the backend (SHOAL_ISA's amx level). Exit 77 where the CPU has no
 * AMX-INT8/AMX-BF16 or the OS does not grant its tile state. */
#include <math.h>
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

typedef struct bf16_act {
    sh__cpu_act act;
    uint16_t *xb;
} bf16_act;

static bf16_act bf16_act_make(const float *x, int64_t n_in, int64_t n_tok)
{
    bf16_act b = {{.x = x, .n_in = n_in, .n_tok = n_tok}, NULL};
    const size_t bytes = (size_t)((n_tok + 15) / 16 * 16 * n_in) * sizeof(uint16_t);
    b.xb = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    b.act.xb = b.xb;
    sh__cpu_amx_act_bf16(&b.act, 0, n_tok);
    return b;
}

/* The BF16 form on the shapes of test_amx_equals_vnni, plus calls of fewer than 16 tokens (1, 5:
 * one padded tile) and 300 tokens (19 tiles, an odd one at the end) at n_in 4096 and 2048 (K
 * ranges of 53 steps: 3 and 2 ranges, the partial sums stored and reloaded), 200 rows at n_in
 * 2048 (row blocks of 4 group pairs: 4 + 2 pairs and a lone group) and 530 tokens at n_in 2048
 * (token blocks of 32 tiles: 32 + 2, ranges of 32 steps): within the bounds above, rows outside
 * the range untouched, and bitwise:
 *  - a row range's outputs equal the full range's (any row split, e.g. across threads, and odd
 *    group counts that end in a lone group);
 *  - tokens [5, n_tok) of a call equal the same tokens in a call of their own (other tiles,
 *    other token blocks, other neighbours), so a token's result does not depend on the batch. */
static void test_amx_bf16(void)
{
    const int64_t n_ins[] = {32, 256, 2048, 4096};
    const int64_t n_outs[] = {7, 16, 33, 50, 200};
    const int64_t n_toks[] = {1, 5, 16, 17, 37, 300, 530};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t ai = 0; ai < 4; ai++)
            for (size_t bi = 0; bi < 5; bi++)
                for (size_t ci = 0; ci < 7; ci++) {
                    const int64_t n_in = n_ins[ai], n_out = n_outs[bi], n_tok = n_toks[ci];
                    if (n_tok == 530 && (n_in != 2048 || n_out != 33))
                        continue;
                    if (n_out == 200 && (n_in != 2048 || n_tok != 300))
                        continue;
                    if (n_tok == 300 && n_out != 33 && n_out != 200)
                        continue;
                    if (n_in == 2048 && n_tok != 300 && n_tok != 530)
                        continue;
                    wmat w = make_w(types[ti], n_out, n_in);
                    const size_t gb = sh__cpu_pack_group_bytes(types[ti], n_in);
                    const size_t pbytes = sh__cpu_pack_bytes(types[ti], n_out, n_in);
                    uint8_t *p = aligned_alloc(64, (pbytes + 63) & ~(size_t)63);
                    sh__cpu_pack(types[ti], w.t.data, n_out, n_in, p);
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    const bf16_act ba = bf16_act_make(x, n_in, n_tok);
                    const size_t ny = (size_t)(n_tok * n_out);
                    float *y0 = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float));
                    float *yfull = malloc(ny * sizeof(float));
                    fill(y0, (int64_t)ny, 1.0f);
                    const char *name = sh__dtype_name(types[ti]);
                    const int64_t ranges[3][2] = {
                        {0, n_out}, {16, n_out}, {3, n_out < 20 ? n_out : 20}};
                    for (int ri = 0; ri < 3; ri++)
                        for (int accum = 0; accum < 2; accum++) {
                            const int64_t r0 = ranges[ri][0], r1 = ranges[ri][1];
                            if (r0 >= r1)
                                continue;
                            memcpy(ya, y0, ny * sizeof(float));
                            sh__cpu_mm ma = {&ba.act, p, gb, ya, n_out, accum};
                            amx[ti](&ma, r0, r1);
                            if (ri == 0 && !accum)
                                memcpy(yfull, ya, ny * sizeof(float));
                            const double same =
                                bf16_worst(&w, x, y0, ya, n_tok, n_out, n_in, r0, r1, accum, 1);
                            const double exact =
                                bf16_worst(&w, x, y0, ya, n_tok, n_out, n_in, r0, r1, accum, 0);
                            if (!(same <= BF16_TOL_SAME) || !(exact <= BF16_TOL_EXACT))
                                SH_FAIL_("%s n_in %lld n_out %lld n_tok %lld rows [%lld, %lld) "
                                         "accumulate %d: %.3g of S from the bf16 operands' "
                                         "product (tolerance %.3g), %.3g from the exact one "
                                         "(%.3g)",
                                         name, (long long)n_in, (long long)n_out, (long long)n_tok,
                                         (long long)r0, (long long)r1, accum, same, BF16_TOL_SAME,
                                         exact, BF16_TOL_EXACT);
                            for (int64_t t = 0; t < n_tok; t++)
                                for (int64_t r = 0; r < n_out; r++) {
                                    const float v = ya[t * n_out + r];
                                    if ((r < r0 || r >= r1) && v != y0[t * n_out + r])
                                        SH_FAIL_("%s: row %lld outside [%lld, %lld) written", name,
                                                 (long long)r, (long long)r0, (long long)r1);
                                    if (r >= r0 && r < r1 && !accum && v != yfull[t * n_out + r])
                                        SH_FAIL_("%s n_in %lld n_tok %lld: token %lld row %lld "
                                                 "of rows [%lld, %lld) %.9g, of all rows %.9g",
                                                 name, (long long)n_in, (long long)n_tok,
                                                 (long long)t, (long long)r, (long long)r0,
                                                 (long long)r1, v, yfull[t * n_out + r]);
                                }
                        }
                    if (n_tok > 5) { /* tokens [5, n_tok) alone: shifted by 5 against the tiles */
                        const int64_t n2 = n_tok - 5;
                        const bf16_act b2 = bf16_act_make(x + 5 * n_in, n_in, n2);
                        sh__cpu_mm m2 = {&b2.act, p, gb, ya, n_out, 0};
                        amx[ti](&m2, 0, n_out);
                        if (memcmp(ya, yfull + 5 * n_out, (size_t)(n2 * n_out) * sizeof(float)))
                            SH_FAIL_("%s n_in %lld n_out %lld n_tok %lld: tokens [5, n_tok) "
                                     "alone differ from the same tokens in the whole call",
                                     name, (long long)n_in, (long long)n_out, (long long)n_tok);
                        free(b2.xb);
                    }
                    free(p);
                    free(x);
                    free(ba.xb);
                    free(y0);
                    free(ya);
                    free(yfull);
                    free_w(&w);
                }
}

/* Through the backend at the amx level (prepared weights), 2 threads: a 64-token prefill runs in
 * BF16 (within the bounds of test_amx_bf16), an 8-token one through the VNNI tiles, bitwise
 * equal to the avx512 level's. */
static void test_amx_backend(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AMX, 2), *vb = make(SH_BACKEND_CPU_ISA_AVX512, 2);
    CHECK_INT_EQ(sh_backend_cpu_isa(be), SH_BACKEND_CPU_ISA_AMX);
    sh_backend_stream *s, *vs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(vb, &vs, NULL));
    const int64_t n_in = 576, n_out = 70, n_tok = 64, n_small = 8;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        wmat w = make_w(types[ti], n_out, n_in);
        CHECK_OK(sh_backend_weight_prepare(be, &w.t));
        CHECK_OK(sh_backend_weight_prepare(vb, &w.t));
        float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
        float *y = malloc((size_t)(n_tok * n_out) * sizeof(float));
        float *vy = malloc((size_t)(n_tok * n_out) * sizeof(float));
        fill(x, n_tok * n_in, 1.0f);
        CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y));
        CHECK_OK(sh_backend_sync(be, s));
        const double same = bf16_worst(&w, x, NULL, y, n_tok, n_out, n_in, 0, n_out, 0, 1);
        const double exact = bf16_worst(&w, x, NULL, y, n_tok, n_out, n_in, 0, n_out, 0, 0);
        if (!(same <= BF16_TOL_SAME) || !(exact <= BF16_TOL_EXACT))
            SH_FAIL_("amx backend %s: %.3g of S from the bf16 operands' product, %.3g from the "
                     "exact one",
                     sh__dtype_name(types[ti]), same, exact);
        CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_small, y));
        CHECK_OK(sh_backend_matmul(vb, vs, &w.t, x, n_small, vy));
        CHECK_OK(sh_backend_sync(be, s));
        CHECK_OK(sh_backend_sync(vb, vs));
        if (memcmp(y, vy, (size_t)(n_small * n_out) * sizeof(float)))
            SH_FAIL_("amx backend %s: %lld tokens differ from the avx512 level",
                     sh__dtype_name(types[ti]), (long long)n_small);
        sh_backend_weight_release(be, w.t.data);
        sh_backend_weight_release(vb, w.t.data);
        free(x);
        free(y);
        free(vy);
        free_w(&w);
    }
    sh_backend_stream_destroy(be, s);
    sh_backend_stream_destroy(vb, vs);
    sh_backend_destroy(be);
    sh_backend_destroy(vb);
}

int main(int argc, char **argv)
{
    if (!sh__cpu_amx_usable()) {
        fprintf(stderr,
                "skip: no AMX-INT8/AMX-BF16 here (or the OS did not grant the tile state)\n");
        return 77;
    }
    static const sh_test_case tests[] = {
        {"amx_equals_vnni", test_amx_equals_vnni},
        {"amx_bf16", test_amx_bf16},
        {"amx_backend", test_amx_backend},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
