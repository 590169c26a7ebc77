/* The AVX2 kernels on packed Q4_0, Q4_1, Q8_0, IQ4_NL (ops_avx2_packed.c) and F16
 * (ops_f16_avx2_packed.c), Q4_K (ops_q4k_avx2_packed.c), Q5_K (ops_q5k_avx2_packed.c), Q6_K
 * (ops_q6k_avx2_packed.c) and IQ4_XS (ops_iq4xs_avx2_packed.c) weights, called directly on a packed
 * copy, against the scalar reference on the file layout (within 2e-5 of sum_k |w||x|; only the
 * float order differs), every token bitwise equal to the same token alone (the matvec), rows
 * outside the range untouched, every block unpacked back to the file's bytes; Q8_0, Q4_K, Q5_K,
 * IQ4_NL, IQ4_XS and Q6_K at the extremes of their integer sums; and through an AVX2 backend with
 * prepared weights. Exit 77 without AVX2. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#define KT_SEED 0xa4093822299f31d0ull
#include "kernels_test_util.h"

#define N_TYPES 9
static const sh_dtype types[N_TYPES] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1,   SH_DTYPE_Q8_0,
                                        SH_DTYPE_F16,  SH_DTYPE_Q4_K,   SH_DTYPE_Q6_K,
                                        SH_DTYPE_Q5_K, SH_DTYPE_IQ4_NL, SH_DTYPE_IQ4_XS};
static const sh__cpu_mm_fn packed_fn[N_TYPES] = {
    sh__cpu_avx2_mmp_q4_0, sh__cpu_avx2_mmp_q4_1,   sh__cpu_avx2_mmp_q8_0,
    sh__cpu_avx2_mmp_f16,  sh__cpu_avx2_mmp_q4_k,   sh__cpu_avx2_mmp_q6_k,
    sh__cpu_avx2_mmp_q5_k, sh__cpu_avx2_mmp_iq4_nl, sh__cpu_avx2_mmp_iq4_xs};

/* Activation codes of n_tok rows as the backend makes them (the scalar rule): the 32-element
 * blocks, the Q8_K rows when n_in is a multiple of 256, and the rows transposed per 16-token tile
 * (xt, read by packed F16 when n_tok > 1). */
typedef struct acts {
    sh__cpu_act a;
    float *x, *d, *s, *xt;
    int8_t *qs;
    sh_block_q8_k *qk;
} acts;

static acts make_acts(int64_t n_tok, int64_t n_in, const float *x0)
{
    const int64_t nb = n_in / 32;
    acts r = {.x = malloc((size_t)(n_tok * n_in) * sizeof(float)),
              .d = malloc((size_t)(n_tok * nb) * sizeof(float)),
              .s = malloc((size_t)(n_tok * nb) * sizeof(float)),
              .qs = malloc((size_t)(n_tok * n_in)),
              .xt = malloc((size_t)((n_tok + 15) / 16 * 16 * n_in) * sizeof(float))};
    if (x0)
        memcpy(r.x, x0, (size_t)(n_tok * n_in) * sizeof(float));
    else
        fill(r.x, n_tok * n_in, 1.0f);
    for (int64_t t = 0; t < n_tok; t++)
        sh__cpu_quant_act_ref(r.x + t * n_in, n_in, r.qs + t * n_in, r.d + t * nb, r.s + t * nb);
    r.qk = NULL;
    if (n_in % SH_QK_K == 0) {
        r.qk = malloc((size_t)(n_tok * (n_in / SH_QK_K)) * sizeof *r.qk);
        sh__quant_k_quantize(SH_DTYPE_Q8_K, r.x, r.qk, n_tok * (n_in / SH_QK_K));
    }
    r.a = (sh__cpu_act){.x = r.x,
                        .qs = r.qs,
                        .d = r.d,
                        .s = r.s,
                        .qk = r.qk,
                        .xt = r.xt,
                        .n_in = n_in,
                        .n_tok = n_tok};
    sh__cpu_act_transpose(&r.a, 0, n_tok);
    return r;
}

static void free_acts(acts *r)
{
    free(r->x);
    free(r->d);
    free(r->s);
    free(r->qs);
    free(r->qk);
    free(r->xt);
}

/* Every Q6_K code 0 (weight -32 d sc), every scale -128, activations +-1 (codes +-127): each
 * super-block's integer sum is at its extreme, 2^27 (test_kernels_packed's worst case). */
static void make_extreme_q6k(wmat *w, int64_t n_out, int64_t n_in, float *x, int64_t n_tok)
{
    for (int64_t i = 0; i < n_out * (n_in / SH_QK_K); i++) {
        sh_block_q6_k *blk = (sh_block_q6_k *)w->t.data + i;
        memset(blk->ql, 0, sizeof blk->ql);
        memset(blk->qh, 0, sizeof blk->qh);
        memset(blk->scales, 0x80, sizeof blk->scales);
        CHECK_OK(sh__dequant_row(SH_DTYPE_Q6_K, blk, w->deq + i * SH_QK_K, SH_QK_K));
    }
    for (int64_t i = 0; i < n_tok * n_in; i++)
        x[i] = (i / n_in) % 2 ? 1.0f : -1.0f;
}

/* Block b of every row of the packed copy p unpacked (sh__cpu_unpack_block, as the embedding
 * lookup reads a packed table) gives the file block's bytes. */
static void check_unpack(sh_dtype type, const uint8_t *src, const uint8_t *p, int64_t n_out,
                         int64_t n_in)
{
    const int64_t bk = sh__cpu_type_k(type) ? SH_QK_K : SH_CPU_QK;
    const size_t fb = sh__dtype_row_bytes(type, (uint64_t)bk);
    const size_t rb = sh__dtype_row_bytes(type, (uint64_t)n_in);
    for (int64_t r = 0; r < n_out; r++)
        for (int64_t b = 0; b < n_in / bk; b++) {
            uint8_t blk[256];
            sh__cpu_unpack_block(type, p, n_in, r, b, blk);
            if (memcmp(blk, src + (size_t)r * rb + (size_t)b * fb, fb))
                SH_FAIL_("%s n_in %lld: row %lld block %lld unpacks differently",
                         sh__dtype_name(type), (long long)n_in, (long long)r, (long long)b);
        }
}

/* Ragged rows (padding rows, masked stores, a range starting inside a half), token counts
 * around the tiles (Q4_0/Q4_1: 3 tokens, Q4_K/Q5_K: 5, Q8_0/IQ4_NL: 6, IQ4_XS: 7 below 8 tokens,
 * 10 from 8 on, Q6_K: 8 with tails of 4, 2 and 1, F16: 16 rows x 6 with tails 5 (5 tokens), 3
 * (13), 4 + 3 (7) and 4 + 4 (8), its 12-token blocks at n_in 16384 and 192-token blocks at n_in
 * 256, whose last one holds a single token at 193; IQ4_XS meets the tails 1 to 6 below 8 tokens,
 * 8, 2, 3, 7, 4 and 6 above), one past the 1 MiB token block (n_in 16384, 70 tokens: IQ4_XS's
 * 256 KiB block holds 14) and past the 256-token block of Q4_K, Q5_K, Q6_K and IQ4_XS (n_in 256,
 * 300 tokens), 23 tokens at every n_in (33 rows: the 32-block kernels' tiles past FEW_MAX at
 * n_in 32 and 576, IQ4_XS's sweep with a tail of 3),
 * accumulate on and off; the K-quants only where n_in is whole super-blocks, Q6_K also at its
 * integer extreme (n_in 2048, 70 rows). */
static void test_vs_ref(void)
{
    const int64_t n_ins[] = {32, 256, 576, 2048, 16384};
    const int64_t n_outs[] = {1, 7, 16, 33, 70};
    const int64_t n_toks[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17, 23, 70, 193, 300};
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (size_t ai = 0; ai < 5; ai++)
            for (size_t bi = 0; bi < 5; bi++) {
                const int64_t n_in = n_ins[ai], n_out = n_outs[bi];
                if (sh__cpu_type_k(types[ti]) && n_in % SH_QK_K)
                    continue;
                /* one weight for every token count (quantizing weights was most of this test's
                 * time) */
                const int extreme = types[ti] == SH_DTYPE_Q6_K && n_in == 2048 && n_out == 70;
                wmat w = make_w(types[ti], n_out, n_in);
                if (extreme)
                    make_extreme_q6k(&w, n_out, n_in, NULL, 0);
                const size_t gb = sh__cpu_pack_group_bytes(types[ti], n_in);
                const size_t pbytes = sh__cpu_pack_bytes(types[ti], n_out, n_in);
                uint8_t *p = aligned_alloc(64, (pbytes + 63) & ~(size_t)63);
                sh__cpu_pack(types[ti], w.t.data, n_out, n_in, p);
                check_unpack(types[ti], w.t.data, p, n_out, n_in);
                for (size_t ci = 0; ci < sizeof n_toks / sizeof n_toks[0]; ci++) {
                    const int64_t n_tok = n_toks[ci];
                    if ((n_tok == 70) != (n_in == 16384 && n_out == 33) ||
                        (n_tok == 300 || n_tok == 193) != (n_in == 256 && n_out == 33) ||
                        (n_tok == 23 && n_out != 33))
                        continue;
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    if (extreme)
                        make_extreme_q6k(&w, n_out, n_in, x, n_tok);
                    acts A = make_acts(n_tok, n_in, x);
                    const size_t ny = (size_t)(n_tok * n_out);
                    float *y0 = malloc(ny * sizeof(float)), *y = malloc(ny * sizeof(float));
                    float *yr = malloc(ny * sizeof(float)), *y1 = malloc((size_t)n_out * 4);
                    fill(y0, (int64_t)ny, 1.0f);
                    sh__cpu_mm mr = {&A.a, w.t.data, sh__dtype_row_bytes(types[ti], (uint64_t)n_in),
                                     yr,   n_out,    0};
                    sh__cpu_mm_for(&sh__cpu_kernels_ref, types[ti])(&mr, 0, n_out);
                    /* sum_k |w||x| of every (token, row), once for the six checks below */
                    double *sabs = malloc(ny * sizeof(double));
                    for (int64_t t = 0; t < n_tok; t++)
                        for (int64_t r = 0; r < n_out; r++) {
                            double sa = 0;
                            for (int64_t k = 0; k < n_in; k++)
                                sa += fabs((double)w.deq[r * n_in + k] * A.x[t * n_in + k]);
                            sabs[t * n_out + r] = sa;
                        }
                    /* whole groups, and ranges starting inside a group's first half and inside
                     * its second half (the Q4 tiles take a group's one half or both) */
                    const int64_t ranges[4][2] = {{0, n_out},
                                                  {16, n_out},
                                                  {3, n_out < 20 ? n_out : 20},
                                                  {11, n_out < 30 ? n_out : 30}};
                    for (int ri = 0; ri < 4; ri++)
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
                                    const double want =
                                        yr[t * n_out + r] + (accum ? y0[t * n_out + r] : 0.0f);
                                    const double e =
                                        fabs(got - want) / (sabs[t * n_out + r] + 1e-30);
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
                    /* each token alone (the matvec path) gives the tile's bits: its rows of the
                     * codes (quantized row by row, so the same as a batch of one would have), its
                     * own transposed tile */
                    memcpy(y, y0, ny * sizeof(float));
                    sh__cpu_mm mp = {&A.a, p, gb, y, n_out, 0};
                    packed_fn[ti](&mp, 0, n_out);
                    float *xt1 = malloc((size_t)(16 * n_in) * sizeof(float));
                    for (int64_t t = 0; t < n_tok; t++) {
                        const int64_t nb = n_in / 32;
                        sh__cpu_act one = {.x = A.x + t * n_in,
                                           .qs = A.qs + t * n_in,
                                           .d = A.d + t * nb,
                                           .s = A.s + t * nb,
                                           .qk = A.qk ? A.qk + t * (n_in / SH_QK_K) : NULL,
                                           .xt = xt1,
                                           .n_in = n_in,
                                           .n_tok = 1};
                        sh__cpu_act_transpose(&one, 0, 1);
                        sh__cpu_mm m1 = {&one, p, gb, y1, n_out, 0};
                        packed_fn[ti](&m1, 0, n_out);
                        if (memcmp(y1, y + t * n_out, (size_t)n_out * sizeof(float)))
                            SH_FAIL_("%s n_in %lld n_out %lld: token %lld alone differs",
                                     sh__dtype_name(types[ti]), (long long)n_in, (long long)n_out,
                                     (long long)t);
                    }
                    free(xt1);
                    free(sabs);
                    free(y0);
                    free(y);
                    free(yr);
                    free(y1);
                    free(x);
                    free_acts(&A);
                }
                free(p);
                free_w(&w);
            }
}

/* Q4_K at the edge of the kernel's 16-bit sums: every code 15, every scale and minimum 63, and
 * activations whose Q8_K codes are all -127 (a constant row quantizes to -127 whatever its sign,
 * quant_k.c), so each sub-block's eight pair sums add to -30480 per 16-bit lane; random rows
 * beside them. Against the scalar reference (2e-5 of sum_k |w||x|) and every token alone equal to
 * its tile. */
static void test_q4k_extreme(void)
{
    const int64_t n_in = 1024, n_out = 40, n_tok = 9, nb = n_in / SH_QK_K;
    wmat w = make_w(SH_DTYPE_Q4_K, n_out, n_in);
    for (int64_t r = 0; r < n_out; r += 2) /* every other row at the extreme */
        for (int64_t b = 0; b < nb; b++) {
            sh_block_q4_k *blk = (sh_block_q4_k *)w.t.data + r * nb + b;
            memset(blk->scales, 0xff, sizeof blk->scales);
            memset(blk->qs, 0xff, sizeof blk->qs);
            blk->d = sh__quant_fp16_from_f32(0.01f);
            blk->dmin = sh__quant_fp16_from_f32(0.02f);
            CHECK_OK(sh__dequant_row(SH_DTYPE_Q4_K, blk, w.deq + r * n_in + b * SH_QK_K, SH_QK_K));
        }
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
    fill(x, n_tok * n_in, 1.0f);
    for (int64_t t = 0; t < n_tok; t += 2) /* every other token constant: codes all -127 */
        for (int64_t k = 0; k < n_in; k++)
            x[t * n_in + k] = t % 4 ? 0.5f : -0.75f;
    acts A = make_acts(n_tok, n_in, x);
    CHECK_INT_EQ(A.qk[0].qs[5], -127);
    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q4_K, n_in);
    uint8_t *p = aligned_alloc(64, (sh__cpu_pack_bytes(SH_DTYPE_Q4_K, n_out, n_in) + 63) & ~63ull);
    sh__cpu_pack(SH_DTYPE_Q4_K, w.t.data, n_out, n_in, p);
    const size_t ny = (size_t)(n_tok * n_out);
    float *y = malloc(ny * sizeof(float)), *yr = malloc(ny * sizeof(float));
    float *y1 = malloc((size_t)n_out * sizeof(float));
    sh__cpu_mm mr = {&A.a, w.t.data, sh__dtype_row_bytes(SH_DTYPE_Q4_K, (uint64_t)n_in),
                     yr,   n_out,    0};
    sh__cpu_mm_ref_q4_k(&mr, 0, n_out);
    sh__cpu_mm mp = {&A.a, p, gb, y, n_out, 0};
    sh__cpu_avx2_mmp_q4_k(&mp, 0, n_out);
    const double worst = worst_rel_err(&w, A.x, y, yr, n_tok, n_out, n_in);
    if (!(worst <= 2e-5))
        SH_FAIL_("Q4_K extremes: %.3g", worst);
    for (int64_t t = 0; t < n_tok; t++) {
        acts one = make_acts(1, n_in, A.x + t * n_in);
        sh__cpu_mm m1 = {&one.a, p, gb, y1, n_out, 0};
        sh__cpu_avx2_mmp_q4_k(&m1, 0, n_out);
        if (memcmp(y1, y + t * n_out, (size_t)n_out * sizeof(float)))
            SH_FAIL_("Q4_K extremes: token %lld alone differs", (long long)t);
        free_acts(&one);
    }
    free(p);
    free(x);
    free(y);
    free(yr);
    free(y1);
    free_acts(&A);
    free_w(&w);
}

/* Y = W X for packed weights p (group bytes gb) of `type` against the reference on the file
 * layout w (2e-5 of sum_k |w||x|), and every token alone equal to its tile. */
static void check_extreme(const char *what, sh_dtype type, sh__cpu_mm_fn fn, const wmat *w,
                          const uint8_t *p, const float *x, int64_t n_tok, int64_t n_out,
                          int64_t n_in)
{
    acts A = make_acts(n_tok, n_in, x);
    const size_t gb = sh__cpu_pack_group_bytes(type, n_in), ny = (size_t)(n_tok * n_out);
    float *y = malloc(ny * sizeof(float)), *yr = malloc(ny * sizeof(float));
    float *y1 = malloc((size_t)n_out * sizeof(float));
    sh__cpu_mm mr = {&A.a, w->t.data, sh__dtype_row_bytes(type, (uint64_t)n_in), yr, n_out, 0};
    sh__cpu_mm_for(&sh__cpu_kernels_ref, type)(&mr, 0, n_out);
    sh__cpu_mm mp = {&A.a, p, gb, y, n_out, 0};
    fn(&mp, 0, n_out);
    const double worst = worst_rel_err(w, A.x, y, yr, n_tok, n_out, n_in);
    if (!(worst <= 2e-5))
        SH_FAIL_("%s: %.3g (y[0] %g, ref %g)", what, worst, (double)y[0], (double)yr[0]);
    for (int64_t t = 0; t < n_tok; t++) {
        acts one = make_acts(1, n_in, A.x + t * n_in);
        sh__cpu_mm m1 = {&one.a, p, gb, y1, n_out, 0};
        fn(&m1, 0, n_out);
        if (memcmp(y1, y + t * n_out, (size_t)n_out * sizeof(float)))
            SH_FAIL_("%s: token %lld alone differs", what, (long long)t);
        free_acts(&one);
    }
    free(y);
    free(yr);
    free(y1);
    free_acts(&A);
}

/* Q5_K at the edge of the kernel's 16-bit sums: every code 31 (all qs and qh bits set), every
 * scale and minimum 63, against activations whose Q8_K codes are all -127 (as test_q4k_extreme):
 * a pair sum is -2 * 31 * 127, so the four the kernel adds in int16 reach -31496, where eight
 * would wrap; random rows and tokens beside them, 9 tokens (a 5-token tile and a 4-token tail). */
static void test_q5k_extreme(void)
{
    const int64_t n_in = 1024, n_out = 40, n_tok = 9, nb = n_in / SH_QK_K;
    wmat w = make_w(SH_DTYPE_Q5_K, n_out, n_in);
    for (int64_t r = 0; r < n_out; r += 2)
        for (int64_t b = 0; b < nb; b++) {
            sh_block_q5_k *blk = (sh_block_q5_k *)w.t.data + r * nb + b;
            memset(blk->scales, 0xff, sizeof blk->scales);
            memset(blk->qs, 0xff, sizeof blk->qs);
            memset(blk->qh, 0xff, sizeof blk->qh);
            blk->d = sh__quant_fp16_from_f32(0.01f);
            blk->dmin = sh__quant_fp16_from_f32(0.02f);
            CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_K, blk, w.deq + r * n_in + b * SH_QK_K, SH_QK_K));
        }
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
    fill(x, n_tok * n_in, 1.0f);
    for (int64_t t = 0; t < n_tok; t += 2)
        for (int64_t k = 0; k < n_in; k++)
            x[t * n_in + k] = t % 4 ? 0.5f : -0.75f;
    uint8_t *p = aligned_alloc(64, (sh__cpu_pack_bytes(SH_DTYPE_Q5_K, n_out, n_in) + 63) & ~63ull);
    sh__cpu_pack(SH_DTYPE_Q5_K, w.t.data, n_out, n_in, p);
    check_extreme("Q5_K extremes", SH_DTYPE_Q5_K, sh__cpu_avx2_mmp_q5_k, &w, p, x, n_tok, n_out,
                  n_in);
    free(p);
    free(x);
    free_w(&w);
}

/* IQ4_NL at the ends of its grid: rows of code 0 (-127), of code 15 (113) and of both (low
 * nibbles 0, high 15), against constant activations +-1 (codes all +-127), so a row of code 0 has
 * every vpmaddubsw pair sum at 2 * 127 * 127 = 32258 in magnitude, one sign (two would not fit
 * int16); random rows beside them, 1, 2 and 7 tokens (the matvec, a tail, a 6-token tile and a
 * tail). */
static void test_iq4nl_extremes(void)
{
    const int64_t n_in = 256, n_out = 35, nb = n_in / 32;
    wmat w = make_w(SH_DTYPE_IQ4_NL, n_out, n_in);
    for (int64_t r = 0; r < n_out; r++) {
        if (r % 4 == 3)
            continue;
        for (int64_t b = 0; b < nb; b++) {
            sh_block_iq4_nl *blk = (sh_block_iq4_nl *)w.t.data + r * nb + b;
            memset(blk->qs, r % 4 == 0 ? 0x00 : r % 4 == 1 ? 0xff : 0xf0, sizeof blk->qs);
            blk->d = sh__quant_fp16_from_f32(1.0f);
            CHECK_OK(sh__dequant_row(SH_DTYPE_IQ4_NL, blk, w.deq + r * n_in + b * 32, 32));
        }
    }
    uint8_t *p =
        aligned_alloc(64, (sh__cpu_pack_bytes(SH_DTYPE_IQ4_NL, n_out, n_in) + 63) & ~63ull);
    sh__cpu_pack(SH_DTYPE_IQ4_NL, w.t.data, n_out, n_in, p);
    const int64_t n_toks[] = {1, 2, 7, 8, 9, 11, 15, 19};
    for (size_t ci = 0; ci < sizeof n_toks / sizeof n_toks[0]; ci++) {
        const int64_t n_tok = n_toks[ci];
        float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < n_in; k++)
                x[t * n_in + k] = t % 2 ? 1.0f : -1.0f;
        check_extreme("IQ4_NL extremes", SH_DTYPE_IQ4_NL, sh__cpu_avx2_mmp_iq4_nl, &w, p, x, n_tok,
                      n_out, n_in);
        free(x);
    }
    free(p);
    free_w(&w);
}

/* IQ4_XS at the ends of its grid and scales: rows of code 0 (-127) with every ls 0 (scale -32),
 * rows of code 15 (113) with every ls 63 (scale 31), against constant activations (Q8_K codes all
 * -127): every vpmaddubsw pair sum of the code-0 rows is 2 * 127 * 127 (two would not fit int16)
 * and the integer sum per super-block 2^27 in magnitude; random rows beside them, 1, 2 and 7
 * tokens (the tiles), 8, 9, 11, 15 and 19 (the sweep's tiles of 10 and its tails 8, 9, 1, 5, 9). */
static void test_iq4xs_extremes(void)
{
    const int64_t n_in = 512, n_out = 35, nb = n_in / SH_QK_K;
    wmat w = make_w(SH_DTYPE_IQ4_XS, n_out, n_in);
    for (int64_t r = 0; r < n_out; r++) {
        if (r % 3 == 2)
            continue;
        for (int64_t b = 0; b < nb; b++) {
            sh_block_iq4_xs *blk = (sh_block_iq4_xs *)w.t.data + r * nb + b;
            memset(blk->qs, r % 3 ? 0xff : 0x00, sizeof blk->qs);
            memset(blk->scales_l, r % 3 ? 0xff : 0x00, sizeof blk->scales_l);
            blk->scales_h = r % 3 ? 0xffff : 0;
            blk->d = sh__quant_fp16_from_f32(0.01f);
            CHECK_OK(
                sh__dequant_row(SH_DTYPE_IQ4_XS, blk, w.deq + r * n_in + b * SH_QK_K, SH_QK_K));
        }
    }
    uint8_t *p =
        aligned_alloc(64, (sh__cpu_pack_bytes(SH_DTYPE_IQ4_XS, n_out, n_in) + 63) & ~63ull);
    sh__cpu_pack(SH_DTYPE_IQ4_XS, w.t.data, n_out, n_in, p);
    const int64_t n_toks[] = {1, 2, 7, 8, 9, 11, 15, 19};
    for (size_t ci = 0; ci < sizeof n_toks / sizeof n_toks[0]; ci++) {
        const int64_t n_tok = n_toks[ci];
        float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < n_in; k++)
                x[t * n_in + k] = t % 2 ? 0.5f : -0.75f;
        check_extreme("IQ4_XS extremes", SH_DTYPE_IQ4_XS, sh__cpu_avx2_mmp_iq4_xs, &w, p, x, n_tok,
                      n_out, n_in);
        free(x);
    }
    free(p);
    free_w(&w);
}

/* Q8_0 at the ends of its range: codes -128 and 127 against activation codes +-127 of either
 * sign, where a vpmaddubsw pair sum of |q| and a * sign(q) reaches 2 * 128 * 127 (a saturating
 * kernel would be off by thousands), on both paths (matvec and 2-token tiles). */
static void test_q8_extremes(void)
{
    const int64_t n_in = 256, n_out = 32, nb = n_in / 32;
    const size_t rb = sh__dtype_row_bytes(SH_DTYPE_Q8_0, (uint64_t)n_in);
    uint8_t *w = malloc(rb * (size_t)n_out);
    float *deq = malloc((size_t)(n_out * n_in) * sizeof(float));
    for (int64_t r = 0; r < n_out; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = w + (size_t)r * rb + (size_t)b * 34;
            const uint16_t one = 0x3c00; /* fp16 1.0 */
            memcpy(blk, &one, 2);
            for (int i = 0; i < 32; i++) {
                /* row pattern: all -128, all 127, alternating, or varying with the element */
                const int k = (int)(r % 4);
                const int8_t q = k == 0   ? -128
                                 : k == 1 ? 127
                                 : k == 2 ? (i % 2 ? 127 : -128)
                                          : (int8_t)((i * 37 + (int)b * 11 + (int)r) % 256 - 128);
                blk[2 + i] = (uint8_t)q;
                deq[r * n_in + 32 * b + i] = (float)q;
            }
        }
    for (int64_t n_tok = 1; n_tok <= 2; n_tok++) {
        float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < n_in; k++) /* +-1: codes +-127; token 1 flips the signs */
                x[t * n_in + k] = ((k / 2 + t) % 2 ? 1.0f : -1.0f);
        acts A = make_acts(n_tok, n_in, x);
        uint8_t *p = aligned_alloc(64, sh__cpu_pack_bytes(SH_DTYPE_Q8_0, n_out, n_in));
        sh__cpu_pack(SH_DTYPE_Q8_0, w, n_out, n_in, p);
        float *y = malloc((size_t)(n_tok * n_out) * sizeof(float));
        float *yr = malloc((size_t)(n_tok * n_out) * sizeof(float));
        sh__cpu_mm mr = {&A.a, w, rb, yr, n_out, 0};
        sh__cpu_mm_for(&sh__cpu_kernels_ref, SH_DTYPE_Q8_0)(&mr, 0, n_out);
        sh__cpu_mm mp = {&A.a, p, sh__cpu_pack_group_bytes(SH_DTYPE_Q8_0, n_in), y, n_out, 0};
        sh__cpu_avx2_mmp_q8_0(&mp, 0, n_out);
        const wmat wm = {{SH_DTYPE_Q8_0, {n_in, n_out, 1, 1}, w}, deq};
        const double worst = worst_rel_err(&wm, x, y, yr, n_tok, n_out, n_in);
        if (!(worst <= 2e-5))
            SH_FAIL_("Q8_0 extremes n_tok %lld: %.3g (y[0] %g, ref %g)", (long long)n_tok, worst,
                     (double)y[0], (double)yr[0]);
        free(y);
        free(yr);
        free(p);
        free(x);
        free_acts(&A);
    }
    free(w);
    free(deq);
}

/* An AVX2 backend prepares (packs) Q4_0, Q4_1, Q8_0, F16, Q4_K, Q6_K, Q5_K, IQ4_NL and IQ4_XS
 * weights and its matmuls read the copy: a 40-token prefill and a decode row on 2 threads against
 * the scalar reference. */
static void test_backend(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AVX2, 2), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (int64_t n_tok = 1; n_tok <= 40; n_tok += 39) {
            const int64_t n_in = sh__cpu_type_k(types[ti]) ? 768 : 576, n_out = 77;
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
        {"q4k_extreme", test_q4k_extreme},
        {"q5k_extreme", test_q5k_extreme},
        {"iq4nl_extremes", test_iq4nl_extremes},
        {"iq4xs_extremes", test_iq4xs_extremes},
        {"q8_extremes", test_q8_extremes},
        {"backend", test_backend},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
