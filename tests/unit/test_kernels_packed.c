/* Unit tests of prepared (packed) weights: every packed kernel against the scalar reference on
 * the file layout, fused forms, thread counts, and prepare/release bookkeeping; and the
 * vectorized SwiGLU over its whole range. */
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/cpu.h"
#define KT_SEED 0x13198a2e03707344ull
#include "kernels_test_util.h"

static const sh_dtype qtypes[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0, SH_DTYPE_F16};

/* The packed kernels (best ISA, prepared weights) vs the scalar reference on the same codes:
 * within 2e-5 of sum_k |w||x| (only the float summation order differs). Ragged row counts
 * exercise the padding rows and masked stores; token counts cover the tile and its tails. Under
 * SHOAL_ISA=amx the 32-block types' prefills of SH_CPU_BF16_MIN_TOK tokens or more run in BF16:
 * those are held to the same 2e-5 against the product of the bf16-rounded operands instead
 * (kernels_test_util.h). */
static void test_packed_vs_ref(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 2), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    /* the last width makes n_tok * n_in pass the kernels' 1 MiB token block (40 tokens: two
     * blocks of 30 and 10 with the 6-token tiles and their tails) */
    const int64_t n_ins[] = {32, 96, 576, 1056, 32768};
    const int64_t n_outs[] = {1, 7, 16, 33, 577};
    const int64_t n_toks[] = {1, 3, 6, 7, 17, 40};
    for (size_t ti = 0; ti < 4; ti++)
        for (size_t a = 0; a < 5; a++)
            for (size_t b = 0; b < 5; b++)
                for (size_t c = 0; c < 6; c++) {
                    const int64_t n_in = n_ins[a], n_out = n_outs[b], n_tok = n_toks[c];
                    if (n_in * n_out * n_tok > 4000000 && !(a == 4 && b == 3 && c == 5))
                        continue;
                    wmat w = make_w(qtypes[ti], n_out, n_in);
                    CHECK_OK(sh_backend_weight_prepare(be, &w.t));
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    float *y = malloc((size_t)(n_tok * n_out) * sizeof(float));
                    float *ry = malloc((size_t)(n_tok * n_out) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    x[0] = 3.0f;
                    fill(y, n_tok * n_out, 1.0f);
                    CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y));
                    CHECK_OK(sh_backend_matmul(ref, rs, &w.t, x, n_tok, ry));
                    CHECK_OK(sh_backend_sync(be, s));
                    CHECK_OK(sh_backend_sync(ref, rs));
                    const int bf16 = sh_backend_cpu_isa(be) == SH_BACKEND_CPU_ISA_AMX &&
                                     n_tok >= SH_CPU_BF16_MIN_TOK && qtypes[ti] != SH_DTYPE_F16;
                    const double worst =
                        bf16 ? bf16_worst(&w, x, NULL, y, n_tok, n_out, n_in, 0, n_out, 0, 1)
                             : worst_rel_err(&w, x, y, ry, n_tok, n_out, n_in);
                    if (!(worst <= 2e-5))
                        SH_FAIL_("packed %s n_in %lld n_out %lld n_tok %lld: %.3g",
                                 sh__dtype_name(qtypes[ti]), (long long)n_in, (long long)n_out,
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

/* Fused forms with a mix of packed and unpacked weights: Q (70 rows, so K's rows start inside a
 * 16-row group of the concatenated split) and K packed, V in F16; gate/up packed; the residual
 * add on a packed weight. Against the reference, unfused. 1, 2 and 3 threads give identical
 * bits. */
static void test_packed_fused(void)
{
    const int64_t n_in = 192, n_tok = 7;
    wmat wq = make_w(SH_DTYPE_Q4_0, 70, n_in), wk = make_w(SH_DTYPE_Q8_0, 33, n_in);
    wmat wv = make_w(SH_DTYPE_F16, 33, n_in), wg = make_w(SH_DTYPE_Q4_1, 100, n_in);
    wmat wu = make_w(SH_DTYPE_Q4_0, 100, n_in);
    float x[7 * 192], norm[192], xn[7 * 192];
    fill(x, n_tok * n_in, 2.0f);
    fill(norm, n_in, 1.0f);
    float rq[7 * 70], rk[7 * 33], rv[7 * 33], rg[7 * 100], ru[7 * 100], ra[7 * 70];
    sh_backend *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *rs;
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    CHECK_OK(sh_backend_rmsnorm(ref, rs, x, norm, 1e-5f, n_tok, n_in, xn));
    CHECK_OK(sh_backend_matmul(ref, rs, &wq.t, xn, n_tok, rq));
    CHECK_OK(sh_backend_matmul(ref, rs, &wk.t, xn, n_tok, rk));
    CHECK_OK(sh_backend_matmul(ref, rs, &wv.t, xn, n_tok, rv));
    CHECK_OK(sh_backend_matmul(ref, rs, &wg.t, xn, n_tok, rg));
    CHECK_OK(sh_backend_matmul(ref, rs, &wu.t, xn, n_tok, ru));
    CHECK_OK(sh_backend_swiglu(ref, rs, rg, ru, n_tok * 100, rg));
    CHECK_OK(sh_backend_matmul(ref, rs, &wq.t, x, n_tok, ra));
    CHECK_OK(sh_backend_sync(ref, rs));
    float q[3][7 * 70], k[3][7 * 33], v[3][7 * 33], h[3][7 * 100], y[3][7 * 70], y0[7 * 70];
    fill(y0, n_tok * 70, 1.0f);
    for (int n = 1; n <= 3; n++) {
        sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        wmat *ws[] = {&wq, &wk, &wv, &wg, &wu};
        for (int i = 0; i < 5; i++)
            CHECK_OK(sh_backend_weight_prepare(be, &ws[i]->t));
        float *qn = q[n - 1], *kn = k[n - 1], *vn = v[n - 1], *hn = h[n - 1], *yn = y[n - 1];
        memcpy(yn, y0, sizeof y0);
        CHECK_OK(
            sh_backend_norm_qkv(be, s, x, norm, 1e-5f, n_tok, &wq.t, &wk.t, &wv.t, qn, kn, vn));
        CHECK_OK(sh_backend_norm_ffn_up(be, s, x, norm, 1e-5f, n_tok, &wg.t, &wu.t, hn));
        CHECK_OK(sh_backend_matmul_add(be, s, &wq.t, x, n_tok, yn));
        CHECK_OK(sh_backend_sync(be, s));
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be); /* frees the packed copies */
        for (int j = 0; j < n_tok * 70; j++) {
            CHECK_NEAR(qn[j], rq[j], 1e-4 * (1 + fabs(rq[j])));
            CHECK_NEAR(yn[j], y0[j] + ra[j], 1e-4 * (1 + fabs(ra[j])));
        }
        for (int j = 0; j < n_tok * 33; j++) {
            CHECK_NEAR(kn[j], rk[j], 1e-4 * (1 + fabs(rk[j])));
            CHECK_NEAR(vn[j], rv[j], 1e-4 * (1 + fabs(rv[j])));
        }
        for (int j = 0; j < n_tok * 100; j++)
            CHECK_NEAR(hn[j], rg[j], 1e-4 * (1 + fabs(rg[j])));
    }
    for (int n = 1; n < 3; n++) {
        CHECK(memcmp(q[0], q[n], sizeof q[0]) == 0);
        CHECK(memcmp(k[0], k[n], sizeof k[0]) == 0);
        CHECK(memcmp(h[0], h[n], sizeof h[0]) == 0);
        CHECK(memcmp(y[0], y[n], sizeof y[0]) == 0);
    }
    free_w(&wq);
    free_w(&wk);
    free_w(&wv);
    free_w(&wg);
    free_w(&wu);
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(ref);
}

/* The decode matvec (one token: several row-group ranges walked side by side, see MV_STREAMS in
 * ops_avx512_packed.c and ops_q6k_avx512_packed.c) against the prefill tiles: each token alone
 * gives the bits of its row in a batch, with and without the residual add, and through the fused
 * gate/up with SwiGLU (whose one-token chunks are longer), on 1 to 3 threads, for every packed
 * type (F16 too); row counts where the streams' ranges leave groups over and end padded. */
static void test_matvec_streams(void)
{
    static const sh_dtype types[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0, SH_DTYPE_Q5_0,
                                     SH_DTYPE_Q5_1, SH_DTYPE_Q6_K, SH_DTYPE_Q4_K, SH_DTYPE_F16};
    const int64_t n_tok = 5, n_outs[] = {100, 261, 1000};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t oi = 0; oi < sizeof n_outs / sizeof n_outs[0]; oi++) {
            const int64_t n_out = n_outs[oi], n_in = sh__cpu_type_k(types[ti]) ? 256 : 96;
            wmat w = make_w(types[ti], n_out, n_in), wu = make_w(types[ti], n_out, n_in);
            float norm[256];
            fill(norm, n_in, 1.0f);
            float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
            float *y0 = malloc((size_t)(n_tok * n_out) * sizeof(float));
            float *yb = malloc((size_t)(n_tok * n_out) * sizeof(float));
            float *y1 = malloc((size_t)(n_tok * n_out) * sizeof(float));
            fill(x, n_tok * n_in, 1.0f);
            fill(y0, n_tok * n_out, 1.0f);
            for (int n = 1; n <= 3; n++) {
                sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n);
                sh_backend_stream *s;
                CHECK_OK(sh_backend_stream_create(be, &s, NULL));
                CHECK_OK(sh_backend_weight_prepare(be, &w.t));
                CHECK_OK(sh_backend_weight_prepare(be, &wu.t));
                for (int add = 0; add < 3; add++) { /* 2: the fused gate/up */
                    memcpy(yb, y0, (size_t)(n_tok * n_out) * sizeof(float));
                    memcpy(y1, y0, (size_t)(n_tok * n_out) * sizeof(float));
                    for (int64_t t = -1; t < n_tok; t++) { /* -1: the batch */
                        const int64_t t0 = t < 0 ? 0 : t, nt = t < 0 ? n_tok : 1;
                        const float *xt = x + t0 * n_in;
                        float *yt = (t < 0 ? yb : y1) + t0 * n_out;
                        if (add == 2)
                            CHECK_OK(sh_backend_norm_ffn_up(be, s, xt, norm, 1e-5f, nt, &w.t, &wu.t,
                                                            yt));
                        else if (add)
                            CHECK_OK(sh_backend_matmul_add(be, s, &w.t, xt, nt, yt));
                        else
                            CHECK_OK(sh_backend_matmul(be, s, &w.t, xt, nt, yt));
                    }
                    CHECK_OK(sh_backend_sync(be, s));
                    if (memcmp(yb, y1, (size_t)(n_tok * n_out) * sizeof(float)) != 0)
                        SH_FAIL_("%s n_out %lld, %d threads%s: a token alone differs from its "
                                 "row in the batch",
                                 sh__dtype_name(types[ti]), (long long)n_out, n,
                                 add == 2 ? ", gate/up"
                                 : add    ? ", residual add"
                                          : "");
                }
                sh_backend_stream_destroy(be, s);
                sh_backend_destroy(be);
            }
            free(x);
            free(y0);
            free(yb);
            free(y1);
            free_w(&w);
            free_w(&wu);
        }
}

/* A few tokens (2 .. 17: a speculative verify step of 1 .. 16 drafts, a small decode batch) in
 * one product give each token's row bit for bit as the token alone does (the one-token matvec),
 * for every packed type and every ISA this CPU has: batched greedy serving and speculative
 * verification rely on it. Ragged row counts, 1 and 2 threads (other row ranges per thread), and
 * the residual add. */
static void test_few_tokens(void)
{
    static const sh_dtype types[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0,
                                     SH_DTYPE_Q5_0, SH_DTYPE_Q5_1, SH_DTYPE_IQ4_NL,
                                     SH_DTYPE_Q6_K, SH_DTYPE_Q4_K, SH_DTYPE_F16};
    static const int isas[] = {SH_BACKEND_CPU_ISA_AVX2, SH_BACKEND_CPU_ISA_AVX512};
    const int64_t max_tok = 17, n_outs[] = {261, 1000};
    for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
        if (sh__cpu_isa_detect() < isas[ii]) {
            printf("  few_tokens: %s not on this CPU, not checked\n",
                   sh_backend_cpu_isa_name(isas[ii]));
            continue;
        }
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t oi = 0; oi < sizeof n_outs / sizeof n_outs[0]; oi++) {
                const int64_t n_out = n_outs[oi], n_in = sh__cpu_type_k(types[ti]) ? 256 : 192;
                wmat w = make_w(types[ti], n_out, n_in);
                float *x = malloc((size_t)(max_tok * n_in) * sizeof(float));
                float *y0 = malloc((size_t)(max_tok * n_out) * sizeof(float));
                float *yb = malloc((size_t)(max_tok * n_out) * sizeof(float));
                float *y1 = malloc((size_t)(max_tok * n_out) * sizeof(float));
                fill(x, max_tok * n_in, 1.0f);
                fill(y0, max_tok * n_out, 1.0f);
                for (int n = 1; n <= 2; n++) {
                    sh_backend *be = make(isas[ii], n);
                    sh_backend_stream *s;
                    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
                    CHECK_OK(sh_backend_weight_prepare(be, &w.t));
                    for (int add = 0; add < 2; add++) {
                        const size_t ybytes = (size_t)(max_tok * n_out) * sizeof(float);
                        memcpy(y1, y0, ybytes);
                        for (int64_t t = 0; t < max_tok; t++)
                            if (add)
                                CHECK_OK(sh_backend_matmul_add(be, s, &w.t, x + t * n_in, 1,
                                                               y1 + t * n_out));
                            else
                                CHECK_OK(sh_backend_matmul(be, s, &w.t, x + t * n_in, 1,
                                                           y1 + t * n_out));
                        CHECK_OK(sh_backend_sync(be, s));
                        for (int64_t nt = 2; nt <= max_tok; nt++) {
                            memcpy(yb, y0, ybytes);
                            if (add)
                                CHECK_OK(sh_backend_matmul_add(be, s, &w.t, x, nt, yb));
                            else
                                CHECK_OK(sh_backend_matmul(be, s, &w.t, x, nt, yb));
                            CHECK_OK(sh_backend_sync(be, s));
                            if (memcmp(yb, y1, (size_t)(nt * n_out) * sizeof(float)) != 0)
                                SH_FAIL_("%s %s n_out %lld, %d threads, %lld tokens%s: a row "
                                         "differs from the token alone",
                                         sh_backend_cpu_isa_name(isas[ii]),
                                         sh__dtype_name(types[ti]), (long long)n_out, n,
                                         (long long)nt, add ? ", residual add" : "");
                        }
                    }
                    sh_backend_stream_destroy(be, s);
                    sh_backend_destroy(be);
                }
                free(x);
                free(y0);
                free(yb);
                free(y1);
                free_w(&w);
            }
    }
}

/* Bookkeeping: many weights (the table grows), re-preparing, releasing some, a view of the same
 * data with another shape (must not use the copy), types without a packed form, bad tensors. */
static void test_prepare_release(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 2), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    enum { N = 80 };
    static wmat w[N];
    const int64_t n_in = 64;
    for (int i = 0; i < N; i++) {
        w[i] = make_w(qtypes[i % 4], 20 + i % 7, n_in);
        CHECK_OK(sh_backend_weight_prepare(be, &w[i].t));
    }
    CHECK_OK(sh_backend_weight_prepare(be, &w[5].t)); /* again: a second reference */
    for (int i = 0; i < N; i += 3)
        sh_backend_weight_release(be, w[i].t.data);
    sh_backend_weight_release(be, w[0].t.data); /* twice: nothing */
    sh_backend_weight_release(be, NULL);
    float x[2 * 64], y[2 * 32], ry[2 * 32];
    fill(x, 2 * n_in, 1.0f);
    for (int i = 0; i < N; i++) {
        sh_tensor t = w[i].t;
        if (i % 4 == 1)
            t.ne[1] = 3; /* the first 3 rows only: another shape, read unpacked */
        CHECK_OK(sh_backend_matmul(be, s, &t, x, 2, y));
        CHECK_OK(sh_backend_matmul(ref, rs, &t, x, 2, ry));
        CHECK_OK(sh_backend_sync(be, s));
        CHECK_OK(sh_backend_sync(ref, rs));
        for (int j = 0; j < 2 * t.ne[1]; j++)
            CHECK_NEAR(y[j], ry[j], 1e-4 * (1 + fabs(ry[j])));
    }
    wmat f = make_w(SH_DTYPE_BF16, 4, n_in);
    CHECK_OK(sh_backend_weight_prepare(be, &f.t)); /* nothing to do */
    sh_tensor bad = f.t;
    bad.ne[0] = 40; /* rows that are not whole blocks: read as they are */
    CHECK_OK(sh_backend_weight_prepare(be, &bad));
    bad.ne[1] = 0;
    CHECK_INT_EQ(sh_backend_weight_prepare(be, &bad), SH_EINVAL);
    bad = f.t;
    bad.data = NULL;
    CHECK_INT_EQ(sh_backend_weight_prepare(be, &bad), SH_EINVAL);
    free_w(&f);
    sh_backend_stream_destroy(be, s);
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(be); /* frees the remaining copies (ASan checks) */
    sh_backend_destroy(ref);
    for (int i = 0; i < N; i++)
        free_w(&w[i]);
}

/* The layout itself: packing then reading back element (r, k) through the documented layout
 * gives the file's codes (independent of any SIMD kernel). */
static void test_pack_layout(void)
{
    for (size_t ti = 0; ti < 4; ti++) {
        const int64_t n_out = 21, n_in = 96, nb = n_in / 32;
        wmat w = make_w(qtypes[ti], n_out, n_in);
        uint8_t *p = malloc(sh__cpu_pack_bytes(qtypes[ti], n_out, n_in));
        sh__cpu_pack(qtypes[ti], w.t.data, n_out, n_in, p);
        const size_t gb = sh__cpu_pack_group_bytes(qtypes[ti], n_in);
        const size_t cb = sh__cpu_pack_code_bytes(qtypes[ti]);
        CHECK(gb % 64 == 0);
        for (int64_t r = 0; r < 32; r++)
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *pg = p + (size_t)(r / 16) * gb, *codes = pg + (size_t)b * cb;
                const int64_t l = r % 16;
                uint16_t d;
                if (qtypes[ti] == SH_DTYPE_F16)
                    memcpy(&d, codes + 2 * l, 2); /* element 32b of the row */
                else
                    memcpy(&d, pg + (size_t)nb * cb + (size_t)b * 32 + 2 * l, 2);
                if (r >= n_out) {
                    CHECK_INT_EQ(d, 0); /* padding rows */
                    continue;
                }
                float dw = sh__quant_f32_from_fp16(d), mw = 0.0f;
                if (qtypes[ti] == SH_DTYPE_Q4_1) {
                    uint16_t m;
                    memcpy(&m, pg + (size_t)nb * (cb + 32) + (size_t)b * 32 + 2 * l, 2);
                    mw = sh__quant_f32_from_fp16(m);
                }
                for (int e = 0; e < 32; e++) {
                    float v;
                    if (qtypes[ti] == SH_DTYPE_F16) {
                        uint16_t h;
                        memcpy(&h, codes + 2 * (16 * e + l), 2);
                        v = sh__quant_f32_from_fp16(h);
                    } else if (qtypes[ti] == SH_DTYPE_Q8_0) {
                        int u = codes[64 * (e / 4) + 4 * l + e % 4];
                        v = dw * (float)(u - 128);
                    } else {
                        int lo = e < 16, j = (e % 16) / 4;
                        int byte = codes[64 * j + 4 * l + e % 4];
                        int q = lo ? byte & 15 : byte >> 4;
                        v = qtypes[ti] == SH_DTYPE_Q4_1 ? dw * (float)q + mw : dw * (float)(q - 8);
                    }
                    CHECK(v == w.deq[r * n_in + b * 32 + e]);
                }
            }
        free(p);
        free_w(&w);
    }
}

/* An embedding lookup in a table that is also a prepared weight (a tied output head) reads the
 * packed copy, one block at a time back to the file layout: it gives bitwise the rows of the
 * file layout, for every row of a group of 16 and past the ragged end; an id out of range gives
 * zeros. The file's bytes are scribbled over after the prepare to show they are not read. */
static void test_packed_embed(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 2);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    const int32_t ids[] = {0, 1, 15, 16, 17, 36, 3, -1, 37, 20};
    const int64_t n_tok = sizeof ids / sizeof ids[0], n_out = 37, n_in = 96;
    for (size_t ti = 0; ti < 4; ti++) {
        wmat w = make_w(qtypes[ti], n_out, n_in);
        CHECK_OK(sh_backend_weight_prepare(be, &w.t));
        bool copied = sh_backend_weight_copied(be, &w.t);
        if (copied) /* the backend must not read these bytes any more */
            memset(w.t.data, 0x5a, sh__dtype_row_bytes(qtypes[ti], (uint64_t)n_in) * n_out);
        float *y = malloc((size_t)(n_tok * n_in) * sizeof(float));
        fill(y, n_tok * n_in, 1.0f);
        CHECK_OK(sh_backend_embed(be, s, &w.t, ids, n_tok, y));
        CHECK_OK(sh_backend_sync(be, s));
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t k = 0; k < n_in; k++) {
                float want = ids[t] < 0 || ids[t] >= n_out ? 0.0f : w.deq[ids[t] * n_in + k];
                if (y[t * n_in + k] != want) {
                    SH_FAIL_("%s id %d element %lld: %g vs %g", sh__dtype_name(qtypes[ti]),
                             (int)ids[t], (long long)k, y[t * n_in + k], want);
                    t = n_tok;
                    break;
                }
            }
        sh_backend_weight_release(be, w.t.data);
        free(y);
        free_w(&w);
    }
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
}

/* ---- Q4_K (256-element super-blocks, packed for the AVX-512 VNNI kernel) ------------------- */

/* Packing a Q4_K weight and unpacking every super-block of every row gives the file's bytes back
 * (padding rows: zeros); the documented layout holds byte for byte; the packed size is the
 * file's plus the padding rows. */
static void test_q4k_pack_roundtrip(void)
{
    const int64_t n_out = 21, n_in = 768, nb = n_in / 256;
    wmat w = make_w(SH_DTYPE_Q4_K, n_out, n_in);
    const size_t rb = sh__dtype_row_bytes(SH_DTYPE_Q4_K, (uint64_t)n_in);
    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q4_K, n_in);
    CHECK_INT_EQ(gb, 16 * rb);
    CHECK_INT_EQ(sh__cpu_pack_bytes(SH_DTYPE_Q4_K, n_out, n_in), 2 * gb);
    uint8_t *p = malloc(2 * gb);
    memset(p, 0xa5, 2 * gb); /* the packer must write every byte */
    sh__cpu_pack(SH_DTYPE_Q4_K, w.t.data, n_out, n_in, p);
    for (int64_t r = 0; r < 32; r++)
        for (int64_t b = 0; b < nb; b++) {
            _Alignas(16) uint8_t blk[256], want[sizeof(sh_block_q4_k)];
            sh__cpu_unpack_block(SH_DTYPE_Q4_K, p, n_in, r, b, blk);
            if (r < n_out)
                memcpy(want, (const uint8_t *)w.t.data + (size_t)r * rb + (size_t)b * sizeof want,
                       sizeof want);
            else
                memset(want, 0, sizeof want);
            if (memcmp(blk, want, sizeof want) != 0)
                SH_FAIL_("Q4_K row %lld block %lld: unpacked bytes differ", (long long)r,
                         (long long)b);
            const sh_block_q4_k *k = (const sh_block_q4_k *)want;
            const uint8_t *pb = p + (size_t)(r / 16) * gb + (size_t)b * SH_CPU_PACK_Q4K_BYTES;
            const int64_t l = r % 16;
            for (int i = 0; i < 128; i++)
                CHECK_INT_EQ(pb[SH_CPU_PACK_Q4K_CODES + 64 * (i / 4) + 4 * l + i % 4], k->qs[i]);
            for (int i = 0; i < 12; i++)
                CHECK_INT_EQ(pb[SH_CPU_PACK_Q4K_SC + 64 * (i / 4) + 4 * l + i % 4], k->scales[i]);
            uint16_t d, dm;
            memcpy(&d, pb + SH_CPU_PACK_Q4K_D + 2 * l, 2);
            memcpy(&dm, pb + SH_CPU_PACK_Q4K_D + 32 + 2 * l, 2);
            CHECK_INT_EQ(d, k->d);
            CHECK_INT_EQ(dm, k->dmin);
        }
    free(p);
    free_w(&w);
}

/* The packed Q4_K kernel called directly against the scalar reference kernel on the file layout,
 * with the same Q8_K activations: within 2e-5 of sum_k |w||x| (the integers are exact; only the
 * float order differs). Ragged row counts (padding rows, masked stores), token counts around the
 * 4-token tile (1, 2, 4, 5, 17), accumulate on and off, row sub-ranges starting inside a group
 * (rows outside the range untouched), and every token of a batch bit-identical to the same token
 * alone (the matvec path). */
static void test_q4k_kernel(void)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX512) {
        fprintf(stderr, "q4k_kernel: no AVX-512 VNNI here, nothing to test\n");
        return;
    }
    const int64_t n_ins[] = {256, 768, 2816};
    const int64_t n_outs[] = {1, 7, 16, 33, 50};
    const int64_t n_toks[] = {1, 2, 4, 5, 17};
    for (size_t ai = 0; ai < 3; ai++)
        for (size_t bi = 0; bi < 5; bi++)
            for (size_t ci = 0; ci < 5; ci++) {
                const int64_t n_in = n_ins[ai], n_out = n_outs[bi], n_tok = n_toks[ci];
                const int64_t nb = n_in / 256;
                wmat w = make_w(SH_DTYPE_Q4_K, n_out, n_in);
                const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q4_K, n_in);
                const size_t pbytes = sh__cpu_pack_bytes(SH_DTYPE_Q4_K, n_out, n_in);
                uint8_t *p = aligned_alloc(64, (pbytes + 63) & ~(size_t)63);
                sh__cpu_pack(SH_DTYPE_Q4_K, w.t.data, n_out, n_in, p);
                float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                fill(x, n_tok * n_in, 1.0f);
                x[0] = 3.0f;
                sh_block_q8_k *qk = malloc((size_t)(n_tok * nb) * sizeof *qk);
                sh__quant_k_quantize(SH_DTYPE_Q8_K, x, qk, n_tok * nb);
                const size_t ny = (size_t)(n_tok * n_out);
                float *yr = malloc(ny * sizeof(float)), *y0 = malloc(ny * sizeof(float));
                float *y = malloc(ny * sizeof(float)), *y1 = malloc(ny * sizeof(float));
                fill(y0, (int64_t)ny, 1.0f);
                const sh__cpu_act act = {.x = x, .qk = qk, .n_in = n_in, .n_tok = n_tok};
                sh__cpu_mm mr = {&act, w.t.data, sh__dtype_row_bytes(SH_DTYPE_Q4_K, (uint64_t)n_in),
                                 yr,   n_out,    0};
                sh__cpu_mm_ref_q4_k(&mr, 0, n_out);
                /* row ranges: all; from the second group; inside the first two groups */
                const int64_t ranges[3][2] = {
                    {0, n_out}, {16, n_out}, {3, n_out < 20 ? n_out : 20}};
                for (int ri = 0; ri < 3; ri++)
                    for (int accum = 0; accum < 2; accum++) {
                        const int64_t r0 = ranges[ri][0], r1 = ranges[ri][1];
                        if (r0 >= r1 || (ri > 0 && accum == 0))
                            continue;
                        memcpy(y, y0, ny * sizeof(float));
                        sh__cpu_mm m = {&act, p, gb, y, n_out, accum};
                        sh__cpu_avx512_mmp_q4_k(&m, r0, r1);
                        double worst = 0;
                        for (int64_t t = 0; t < n_tok; t++)
                            for (int64_t r = 0; r < n_out; r++) {
                                const size_t i = (size_t)(t * n_out + r);
                                if (r < r0 || r >= r1) {
                                    CHECK(y[i] == y0[i]);
                                    continue;
                                }
                                double sa = 0;
                                for (int64_t k = 0; k < n_in; k++)
                                    sa += fabs((double)w.deq[r * n_in + k] * x[t * n_in + k]);
                                const double want = (double)yr[i] + (accum ? y0[i] : 0.0);
                                const double e =
                                    fabs(y[i] - want) / (sa + (accum ? fabs(y0[i]) : 0));
                                if (!(e <= worst))
                                    worst = e;
                            }
                        if (!(worst <= 2e-5))
                            SH_FAIL_("packed Q4_K n_in %lld n_out %lld n_tok %lld rows "
                                     "[%lld, %lld) accumulate %d: %.3g",
                                     (long long)n_in, (long long)n_out, (long long)n_tok,
                                     (long long)r0, (long long)r1, accum, worst);
                    }
                /* each token alone (a matvec) gives the batch's bits */
                sh__cpu_mm m = {&act, p, gb, y, n_out, 0};
                sh__cpu_avx512_mmp_q4_k(&m, 0, n_out);
                for (int64_t t = 0; t < n_tok; t++) {
                    const sh__cpu_act one = {
                        .x = x + t * n_in, .qk = qk + t * nb, .n_in = n_in, .n_tok = 1};
                    sh__cpu_mm m1 = {&one, p, gb, y1, n_out, 0};
                    sh__cpu_avx512_mmp_q4_k(&m1, 0, n_out);
                    if (memcmp(y1, y + t * n_out, (size_t)n_out * sizeof(float)) != 0)
                        SH_FAIL_("packed Q4_K n_in %lld n_out %lld: token %lld of %lld alone "
                                 "differs from its batch",
                                 (long long)n_in, (long long)n_out, (long long)t, (long long)n_tok);
                }
                free(p);
                free(x);
                free(qk);
                free(yr);
                free(y0);
                free(y);
                free(y1);
                free_w(&w);
            }
}

/* Through the backend: a prepared Q4_K weight (packed on AVX-512 VNNI, the file layout elsewhere)
 * against the scalar backend, plain and with the residual add, with 1, 2 and 3 threads giving the
 * same bits; and an embedding lookup in the prepared table (a tied head) bitwise equal to the
 * file's rows, with the file's bytes scribbled over. */
static void test_q4k_backend(void)
{
    const int64_t n_in = 512, n_out = 70, n_tok = 7;
    wmat w = make_w(SH_DTYPE_Q4_K, n_out, n_in);
    float x[7 * 512], ry[7 * 70], y0[7 * 70], y[3][7 * 70], ya[3][7 * 70];
    fill(x, n_tok * n_in, 1.0f);
    fill(y0, n_tok * n_out, 1.0f);
    sh_backend *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *rs;
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    CHECK_OK(sh_backend_matmul(ref, rs, &w.t, x, n_tok, ry));
    CHECK_OK(sh_backend_sync(ref, rs));
    for (int n = 1; n <= 3; n++) {
        sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        CHECK_OK(sh_backend_weight_prepare(be, &w.t));
        memcpy(ya[n - 1], y0, sizeof y0);
        CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y[n - 1]));
        CHECK_OK(sh_backend_matmul_add(be, s, &w.t, x, n_tok, ya[n - 1]));
        CHECK_OK(sh_backend_sync(be, s));
        sh_backend_weight_release(be, w.t.data);
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be);
        for (int j = 0; j < n_tok * n_out; j++) {
            CHECK_NEAR(y[n - 1][j], ry[j], 1e-4 * (1 + fabs(ry[j])));
            CHECK_NEAR(ya[n - 1][j], y0[j] + ry[j], 1e-4 * (1 + fabs(ry[j])));
        }
    }
    for (int n = 1; n < 3; n++) {
        CHECK(memcmp(y[0], y[n], sizeof y[0]) == 0);
        CHECK(memcmp(ya[0], ya[n], sizeof ya[0]) == 0);
    }
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(ref);

    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 2);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_weight_prepare(be, &w.t));
    if (sh_backend_weight_copied(be, &w.t))
        memset(w.t.data, 0x5a, sh__dtype_row_bytes(SH_DTYPE_Q4_K, (uint64_t)n_in) * n_out);
    const int32_t ids[] = {0, 1, 15, 16, 17, 69, 3, -1, 70, 40};
    const int64_t n_ids = sizeof ids / sizeof ids[0];
    float *e = malloc((size_t)(n_ids * n_in) * sizeof(float));
    CHECK_OK(sh_backend_embed(be, s, &w.t, ids, n_ids, e));
    CHECK_OK(sh_backend_sync(be, s));
    for (int64_t t = 0; t < n_ids; t++)
        for (int64_t k = 0; k < n_in; k++) {
            const float want = ids[t] < 0 || ids[t] >= n_out ? 0.0f : w.deq[ids[t] * n_in + k];
            if (e[t * n_in + k] != want) {
                SH_FAIL_("Q4_K id %d element %lld: %g vs %g", (int)ids[t], (long long)k,
                         e[t * n_in + k], want);
                t = n_ids;
                break;
            }
        }
    free(e);
    sh_backend_weight_release(be, w.t.data);
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
    free_w(&w);
}

/* The vectorized SwiGLU (its exp approximation) against the double formula over the whole
 * range that matters, plus the ends where exp over- or underflows; odd lengths for the tail. */
static void test_swiglu_range(void)
{
    enum { N = 4001 };
    static float g[N], u[N], y[N];
    for (int i = 0; i < N; i++) {
        g[i] = -120.0f + 240.0f * (float)i / (N - 1);
        u[i] = rng_sym() * 2.0f;
    }
    g[7] = 1e30f;
    g[8] = -1e30f;
    g[9] = 0.0f;
    for (int isa = SH_BACKEND_CPU_ISA_SCALAR; isa <= sh__cpu_isa_detect(); isa++) {
        sh_backend *be = make(isa, 2);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        CHECK_OK(sh_backend_swiglu(be, s, g, u, N, y));
        CHECK_OK(sh_backend_sync(be, s));
        for (int i = 0; i < N; i++) {
            double want = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            if (!(fabs(y[i] - want) <= 1e-6 * fabs(want) + 1e-30))
                SH_FAIL_("isa %d g %g u %g: %g vs %g", isa, g[i], u[i], y[i], want);
        }
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be);
    }
}

/* ---- Q6_K ---- */

/* The Q6_K layout: element (r, k) read back through the layout documented at
 * SH_CPU_PACK_Q6K_BLOCK gives the file's value, padding rows are zero, and sh__cpu_unpack_block
 * gives back every file block byte for byte. */
static void test_q6k_layout(void)
{
    const int64_t n_out = 21, n_in = 512, nb = n_in / SH_QK_K;
    wmat w = make_w(SH_DTYPE_Q6_K, n_out, n_in);
    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q6_K, n_in);
    CHECK(gb % 64 == 0);
    CHECK(gb <= (size_t)nb * 16 * sizeof(sh_block_q6_k) + 63);
    uint8_t *p = malloc(sh__cpu_pack_bytes(SH_DTYPE_Q6_K, n_out, n_in));
    sh__cpu_pack(SH_DTYPE_Q6_K, w.t.data, n_out, n_in, p);
    for (int64_t r = 0; r < 32; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pg = p + (size_t)(r / 16) * gb;
            const uint8_t *pb = pg + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
            const int64_t l = r % 16;
            uint16_t d;
            memcpy(&d, pg + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK + (size_t)b * 32 + 2 * l, 2);
            if (r >= n_out) {
                CHECK_INT_EQ(d, 0);
                continue;
            }
            for (int e = 0; e < SH_QK_K; e++) {
                const int s = e / 16, v = (e % 16) / 4, i = e % 4;
                const uint8_t *u = pb + SH_CPU_PACK_Q6K_UNITS + (size_t)s * SH_CPU_PACK_Q6K_UNIT;
                const int nib = (u[64 * (v / 2) + 4 * l + i] >> (4 * (v % 2))) & 15;
                const int hi = (u[128 + 4 * l + i] >> (2 * v)) & 3;
                const int sc = (int8_t)pb[SH_CPU_PACK_Q6K_SC + 16 * s + l];
                const float want = w.deq[r * n_in + b * SH_QK_K + e];
                const float v6 =
                    sh__quant_f32_from_fp16(d) * (float)sc * (float)((nib | hi << 4) - 32);
                if (v6 != want) {
                    SH_FAIL_("row %lld block %lld element %d: %g vs %g", (long long)r, (long long)b,
                             e, v6, want);
                    r = 32;
                    break;
                }
            }
            uint8_t blk[256];
            sh__cpu_unpack_block(SH_DTYPE_Q6_K, p, n_in, r, b, blk);
            const uint8_t *file =
                (const uint8_t *)w.t.data + (size_t)(r * nb + b) * sizeof(sh_block_q6_k);
            CHECK(memcmp(blk, file, sizeof(sh_block_q6_k)) == 0);
        }
    free(p);
    free_w(&w);
}

/* The packed Q6_K kernel itself (AVX-512 VNNI machines only) against the scalar kernel on the
 * file layout, on the same Q8_K activations: within 2e-6 of sum_k |w||x| (the sub-block integers
 * are exact in both; the float steps differ in order and rounding only). Ragged row counts and
 * row sub-ranges (a start inside a group: the kernel stores only [r0, r1)), accumulate on and
 * off, token counts around the tile of 16 and its power-of-two tails (31 = 16 + 8 + 4 + 2 + 1).
 * Every token's output must equal, bit for bit, the matvec of that token alone. The last case is
 * the extreme one: every code 0 (weight -32 d sc), every scale -128 and every activation code
 * +-127, so each super-block's sum reaches 2^27, past float's exact integers. */
static void test_q6k_kernel(void)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX512)
        return;
    const int64_t n_ins[] = {256, 768, 2048};
    const int64_t n_outs[] = {1, 16, 37};
    const int64_t n_toks[] = {1, 2, 16, 17, 31};
    for (size_t a = 0; a < 3; a++)
        for (size_t bo = 0; bo < 3; bo++)
            for (size_t c = 0; c < 5; c++)
                for (int acc = 0; acc < 2; acc++) {
                    const int64_t n_in = n_ins[a], n_out = n_outs[bo], n_tok = n_toks[c];
                    const int64_t nb = n_in / SH_QK_K;
                    wmat w = make_w(SH_DTYPE_Q6_K, n_out, n_in);
                    const int extreme = a == 2 && bo == 2 && c == 4;
                    if (extreme)
                        for (int64_t i = 0; i < n_out * nb; i++) {
                            sh_block_q6_k *blk = (sh_block_q6_k *)w.t.data + i;
                            memset(blk->ql, 0, sizeof blk->ql);
                            memset(blk->qh, 0, sizeof blk->qh);
                            memset(blk->scales, 0x80, sizeof blk->scales);
                            CHECK_OK(
                                sh__dequant_row(SH_DTYPE_Q6_K, blk, w.deq + i * SH_QK_K, SH_QK_K));
                        }
                    uint8_t *p = malloc(sh__cpu_pack_bytes(SH_DTYPE_Q6_K, n_out, n_in));
                    sh__cpu_pack(SH_DTYPE_Q6_K, w.t.data, n_out, n_in, p);
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    sh_block_q8_k *qk = malloc((size_t)(n_tok * nb) * sizeof *qk);
                    fill(x, n_tok * n_in, 1.0f);
                    x[0] = 3.0f;
                    if (extreme)
                        for (int64_t i = 0; i < n_tok * n_in; i++)
                            x[i] = (i / n_in) % 2 ? 1.0f : -1.0f;
                    sh__quant_k_quantize(SH_DTYPE_Q8_K, x, qk, n_tok * nb);
                    const size_t ny = (size_t)(n_tok * n_out);
                    float *y0 = malloc(ny * sizeof(float)), *y = malloc(ny * sizeof(float));
                    float *ry = malloc(ny * sizeof(float)), *y1 = malloc(ny * sizeof(float));
                    fill(y0, (int64_t)ny, 1.0f);
                    memcpy(y, y0, ny * sizeof(float));
                    memcpy(ry, y0, ny * sizeof(float));
                    memcpy(y1, y0, ny * sizeof(float));
                    sh__cpu_act act = {.x = x, .qk = qk, .n_in = n_in, .n_tok = n_tok};
                    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q6_K, n_in);
                    sh__cpu_mm mp = {&act, p, gb, y, n_out, acc};
                    sh__cpu_mm mr = {
                        &act, w.t.data, sh__dtype_row_bytes(SH_DTYPE_Q6_K, (uint64_t)n_in),
                        ry,   n_out,    acc};
                    /* rows in three calls: [0, 5), [5, 21), [21, n_out) where they exist */
                    const int64_t cuts[] = {0, 5, 21, n_out};
                    for (int k = 0; k < 3; k++) {
                        const int64_t lo = cuts[k] < n_out ? cuts[k] : n_out;
                        const int64_t hi = cuts[k + 1] < n_out ? cuts[k + 1] : n_out;
                        if (lo < hi) {
                            sh__cpu_avx512_mmp_q6_k(&mp, lo, hi);
                            sh__cpu_mm_ref_q6_k(&mr, lo, hi);
                        }
                    }
                    /* each token alone */
                    for (int64_t t = 0; t < n_tok; t++) {
                        sh__cpu_act a1 = {
                            .x = x + t * n_in, .qk = qk + t * nb, .n_in = n_in, .n_tok = 1};
                        sh__cpu_mm m1 = {&a1, p, gb, y1 + t * n_out, n_out, acc};
                        sh__cpu_avx512_mmp_q6_k(&m1, 0, n_out);
                    }
                    CHECK(memcmp(y, y1, ny * sizeof(float)) == 0);
                    double worst = 0;
                    for (int64_t t = 0; t < n_tok; t++)
                        for (int64_t r = 0; r < n_out; r++) {
                            double sa = 0;
                            for (int64_t k = 0; k < n_in; k++)
                                sa += fabs((double)w.deq[r * n_in + k] * x[t * n_in + k]);
                            const double e =
                                fabs((double)y[t * n_out + r] - ry[t * n_out + r]) / sa;
                            if (!(e <= worst))
                                worst = e;
                        }
                    if (!(worst <= 2e-6))
                        SH_FAIL_("q6_k n_in %lld n_out %lld n_tok %lld acc %d: %.3g",
                                 (long long)n_in, (long long)n_out, (long long)n_tok, acc, worst);
                    free(p);
                    free(x);
                    free(qk);
                    free(y0);
                    free(y);
                    free(ry);
                    free(y1);
                    free_w(&w);
                }
}

/* Through the backend: a prepared Q6_K weight (packed on AVX-512 VNNI) against the scalar
 * backend, with tokens past the kernel's 1 MiB token block (2048 wide: 1 MiB is 448 tokens of
 * Q8_K, so 460 tokens make two blocks), 1 and 3 threads identical; and an embedding lookup in
 * the prepared table gives the file's rows bit for bit. */
static void test_q6k_backend(void)
{
    const int64_t n_in = 2048, n_out = 35, n_tok = 460;
    wmat w = make_w(SH_DTYPE_Q6_K, n_out, n_in);
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
    fill(x, n_tok * n_in, 1.0f);
    float *ry = malloc((size_t)(n_tok * n_out) * sizeof(float));
    float *y[2];
    sh_backend *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *rs;
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    CHECK_OK(sh_backend_matmul(ref, rs, &w.t, x, n_tok, ry));
    CHECK_OK(sh_backend_sync(ref, rs));
    for (int n = 0; n < 2; n++) {
        y[n] = malloc((size_t)(n_tok * n_out) * sizeof(float));
        sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n ? 3 : 1);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        CHECK_OK(sh_backend_weight_prepare(be, &w.t));
        CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y[n]));
        const int32_t ids[] = {0, 15, 16, 34, -1, 35, 7};
        float *e = malloc(7 * (size_t)n_in * sizeof(float));
        CHECK_OK(sh_backend_embed(be, s, &w.t, ids, 7, e));
        CHECK_OK(sh_backend_sync(be, s));
        for (int t = 0; t < 7; t++)
            for (int64_t k = 0; k < n_in; k++) {
                const float want = ids[t] < 0 || ids[t] >= n_out ? 0.0f : w.deq[ids[t] * n_in + k];
                if (e[t * n_in + k] != want) {
                    SH_FAIL_("embed id %d element %lld: %g vs %g", (int)ids[t], (long long)k,
                             e[t * n_in + k], want);
                    t = 7;
                    break;
                }
            }
        free(e);
        sh_backend_weight_release(be, w.t.data);
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be);
    }
    CHECK(memcmp(y[0], y[1], (size_t)(n_tok * n_out) * sizeof(float)) == 0);
    for (int64_t i = 0; i < n_tok * n_out; i++)
        CHECK_NEAR(y[0][i], ry[i], 1e-4 * (1 + fabs(ry[i])));
    free(y[0]);
    free(y[1]);
    free(ry);
    free(x);
    free_w(&w);
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(ref);
}

/* The packed copy of a large weight is asked for huge pages over its whole 2 MiB pages only: the
 * tail past the last one is in 4 KiB pages, resident no further than the copy's bytes reach. A
 * Q4_0 matrix of 2048 x 4096 packs to 4.5 MiB; with the whole copy advised, its last 0.5 MiB took
 * a 2 MiB huge page (6 MiB resident for 4.5). Counted with mincore over the 2 MiB past the last
 * whole one. */
static void test_pack_tail_pages(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    if (!be)
        return;
    const int64_t n_out = 2048, n_in = 4096;
    const size_t rb = sh__dtype_row_bytes(SH_DTYPE_Q4_0, (uint64_t)n_in);
    sh_tensor t = {SH_DTYPE_Q4_0, {n_in, n_out, 1, 1}, calloc((size_t)n_out, rb)};
    CHECK(t.data != NULL);
    CHECK_OK(sh_backend_weight_prepare(be, &t));
    const uint8_t *p = sh__cpu_weights_lookup((sh__cpu_ctx *)be->ctx, &t);
    const size_t bytes = sh__cpu_pack_bytes(SH_DTYPE_Q4_0, n_out, n_in);
    const size_t huge = (size_t)2 << 20, whole = bytes & ~(huge - 1);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (!p) {
        fprintf(stderr, "this CPU's kernels read Q4_0 in the file layout (no copy): skipped\n");
    } else {
        CHECK_UINT_EQ(bytes, (size_t)9 << 19); /* 4.5 MiB */
        CHECK_UINT_EQ((uintptr_t)p % huge, 0);
        unsigned char vec[512]; /* the 2 MiB from p + whole, in pages of 4 KiB (or larger) */
        const size_t n = huge / page, used = (bytes - whole + page - 1) / page;
        if (n > sizeof vec || mincore((void *)(p + whole), huge, vec) != 0) {
            SH_FAIL_("mincore over the copy's tail failed");
        } else {
            size_t resident = 0;
            for (size_t i = 0; i < n; i++)
                resident += vec[i] & 1;
            if (resident > used)
                SH_FAIL_("%zu pages of the copy's last 2 MiB are resident for its %zu bytes "
                         "there (%zu pages)",
                         resident, bytes - whole, used);
        }
    }
    sh_backend_weight_release(be, t.data);
    sh_backend_destroy(be);
    free(t.data);
}

int main(int argc, char **argv)
{
    static const sh_test_case tests[] = {
        {"pack_layout", test_pack_layout},         {"packed_vs_ref", test_packed_vs_ref},
        {"packed_fused", test_packed_fused},       {"matvec_streams", test_matvec_streams},
        {"few_tokens", test_few_tokens},           {"prepare_release", test_prepare_release},
        {"swiglu_range", test_swiglu_range},       {"packed_embed", test_packed_embed},
        {"q6k_layout", test_q6k_layout},           {"q6k_kernel", test_q6k_kernel},
        {"q6k_backend", test_q6k_backend},         {"q4k_pack_roundtrip", test_q4k_pack_roundtrip},
        {"q4k_kernel", test_q4k_kernel},           {"q4k_backend", test_q4k_backend},
        {"pack_tail_pages", test_pack_tail_pages}, {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
