/* IQ4_NL and IQ4_XS weights through the whole forward pass: a seeded F32 mkmodel file (rows of
 * 256, and ffn_down rows of 320, where IQ4_XS falls back to IQ4_NL) converted by sh__quantize_file
 * (what `shoal quantize` runs) to each type, and that file converted back to F32. The two files
 * hold the same weights, so the quantized model must follow its dequantized copy: the logits of
 * every row of prompt + continuation within TOL of the largest, and each greedy id of the
 * quantized model equal to the copy's argmax on the same context except at a near tie (the
 * copy's top two closer than twice the largest logit difference of that row). What separates the
 * two is the int8 quantization of the activations the quantized kernels do (per 32 elements for
 * IQ4_NL, per 256 for IQ4_XS). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llama_driver.h"
#include "model/gguf.h"
#include "model/mkmodel.h"
#include "model/quantize.h"

/* As test_llama_kquant: activation rounding moves these random models' logits by a few percent
 * of the largest. */
#define TOL 4e-2
#define N_GEN 24

static char dir[64] = "/tmp/sh-golden-iq4-XXXXXX";

static const char *path_in(const char *name)
{
    static char p[4][128];
    static int k;
    char *b = p[k++ & 3];
    snprintf(b, 128, "%s/%s", dir, name);
    return b;
}

static bool write_f32(const char *path)
{
    sh_mkmodel_opts o;
    sh__mkmodel_opts_init(&o);
    o.shape.n_layers = 2;
    o.shape.dim = 256;
    o.shape.ffn = 320;
    o.shape.n_heads = 4;
    o.shape.n_kv_heads = 2;
    o.shape.vocab = 512;
    o.shape.ctx = 256;
    o.type = SH_DTYPE_F32;
    o.seed = 21;
    o.std = 0.05f;
    o.n_threads = 2;
    sh_error e = {0};
    if (sh__mkmodel_write(path, &o, NULL, &e) != SH_OK) {
        SH_FAIL_("mkmodel %s: %s", path, e.msg);
        return false;
    }
    return true;
}

static bool convert(const char *in, const char *out, sh_dtype type)
{
    sh_quantize_opts o;
    sh__quantize_opts_init(&o);
    o.type = type;
    o.n_threads = 2;
    sh_error e = {0};
    if (sh__quantize_file(in, out, &o, NULL, &e) != SH_OK) {
        SH_FAIL_("quantize %s to %s: %s", in, sh__dtype_name(type), e.msg);
        return false;
    }
    return true;
}

/* Matrices of type t in the file (the conversion did make the type under test). */
static int count_type(const char *path, sh_dtype t)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK)
        return -1;
    int n = 0;
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++)
        n += sh_gguf_tensor_at(g, i)->type == t;
    sh_gguf_close(g);
    return n;
}

static void check(sh_dtype type, int want_main, int want_nl)
{
    const char *f32 = path_in("f32.gguf"), *q = path_in("q.gguf"), *back = path_in("back.gguf");
    if (!convert(f32, q, type) || !convert(q, back, SH_DTYPE_F32))
        return;
    /* 2 layers x 7 matrices + token_embd + output; ffn_down (rows of 320) falls back for XS. */
    CHECK_INT_EQ(count_type(q, type), want_main);
    if (type == SH_DTYPE_IQ4_XS)
        CHECK_INT_EQ(count_type(q, SH_DTYPE_IQ4_NL), want_nl);
    drv dq, df;
    if (!drv_open(&dq, q, 2, 64, 1, 256))
        return;
    if (!drv_open(&df, back, 2, 64, 1, 256)) {
        drv_close(&dq);
        return;
    }
    const int32_t V = dq.m->hp.n_vocab;
    static const int32_t prompts[3][6] = {
        {1, 17, 300, 42, 99, 7}, {5, 400, 401, 402, 3, 250}, {2, 2, 88, 511, 64, 128}};
    int decisive = 0, ties = 0;
    for (int p = 0; p < 3; p++) {
        int32_t ids[6 + N_GEN];
        memcpy(ids, prompts[p], sizeof prompts[p]);
        CHECK_INT_EQ(drv_greedy(&dq, ids, 6, N_GEN, ids + 6), N_GEN);
        /* Both models on the quantized model's path, every row's logits at once (the quantized
         * model's copied out: the next forward reuses the buffer). */
        const float *l = drv_feed(&dq, ids, 6 + N_GEN - 1, 0, true);
        if (!l)
            continue;
        float *lq = malloc((size_t)(6 + N_GEN - 1) * (size_t)V * sizeof(float));
        memcpy(lq, l, (size_t)(6 + N_GEN - 1) * (size_t)V * sizeof(float));
        const float *lf = drv_feed(&df, ids, 6 + N_GEN - 1, 0, true);
        if (!lf) {
            free(lq);
            continue;
        }
        double scale = 0.0, worst = 0.0;
        for (int64_t i = 0; i < (int64_t)(6 + N_GEN - 1) * V; i++)
            scale = fmax(scale, fabs((double)lf[i]));
        for (int64_t i = 0; i < (int64_t)(6 + N_GEN - 1) * V; i++)
            worst = fmax(worst, fabs((double)lq[i] - (double)lf[i]));
        if (!(worst <= TOL * scale))
            SH_FAIL_("%s prompt %d: logits differ by %.4g, more than %g of the largest %.4g",
                     sh__dtype_name(type), p, worst, TOL, scale);
        for (int i = 0; i < N_GEN; i++) {
            /* Within delta of each other everywhere, the two rows have the same argmax when the
             * copy's top two are more than 2 delta apart. */
            const float *row = lf + (int64_t)(5 + i) * V, *rq = lq + (int64_t)(5 + i) * V;
            double delta = 0.0;
            for (int32_t v = 0; v < V; v++)
                delta = fmax(delta, fabs((double)rq[v] - (double)row[v]));
            const double margin = 2.0 * delta;
            const int32_t best = argmax(row, V);
            float second = -INFINITY;
            for (int32_t v = 0; v < V; v++)
                if (v != best && row[v] > second)
                    second = row[v];
            const double gap = (double)row[best] - (double)second;
            if (gap <= margin) {
                ties++;
                continue;
            }
            decisive++;
            if (ids[6 + i] != best)
                SH_FAIL_("%s prompt %d step %d: greedy id %d, the F32 copy's argmax %d by %.3f "
                         "(> %.3f)",
                         sh__dtype_name(type), p, i, (int)ids[6 + i], (int)best, gap, margin);
        }
        fprintf(stderr, "  %s prompt %d: worst logit difference %.4f of %.3f (%.2f%%)\n",
                sh__dtype_name(type), p, worst, scale, 100.0 * worst / scale);
        free(lq);
    }
    fprintf(stderr, "  %s: %d greedy ids checked against the F32 copy, %d near ties skipped\n",
            sh__dtype_name(type), decisive, ties);
    /* Enough decisive steps that the comparison means something. */
    CHECK(decisive >= 3 * N_GEN / 2);
    drv_close(&dq);
    drv_close(&df);
    unlink(q);
    unlink(back);
}

static void test_iq4_nl(void) { check(SH_DTYPE_IQ4_NL, 16, 0); }
static void test_iq4_xs(void) { check(SH_DTYPE_IQ4_XS, 14, 2); }

static const sh_test_case tests[] = {
    {"iq4_nl", test_iq4_nl},
    {"iq4_xs", test_iq4_xs},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = write_f32(path_in("f32.gguf")) ? sh_test_main(argc, argv, tests) : 1;
    unlink(path_in("f32.gguf"));
    rmdir(dir);
    return rc;
}
