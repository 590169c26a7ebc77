/* Unit tests of the CPU backend's matmul and embed for Q5_0, Q5_1, the K-quants Q2_K..Q6_K,
 * IQ4_NL and IQ4_XS: every ISA against a float reference built from the scalar dequantization of
 * the weights and of the scalar-quantized activations, fused and mixed-type forms, thread counts,
 * and the real tensors of the Gemma 3 270M Q4_K_M file when it is present. */
#include <stdint.h>
#include <time.h>

#include "kernels/cpu/cpu.h"
#include "kernels_test_util.h"
#include "model/gguf.h"

static const sh_dtype new_types[] = {SH_DTYPE_Q5_0, SH_DTYPE_Q5_1,   SH_DTYPE_Q2_K,
                                     SH_DTYPE_Q3_K, SH_DTYPE_Q4_K,   SH_DTYPE_Q5_K,
                                     SH_DTYPE_Q6_K, SH_DTYPE_IQ4_NL, SH_DTYPE_IQ4_XS};
#define N_NEW (sizeof new_types / sizeof new_types[0])

/* The ISAs this machine runs, scalar first. */
static int isas[3], n_isas;
static void list_isas(void)
{
    n_isas = 0;
    for (int i = SH_BACKEND_CPU_ISA_SCALAR; i <= sh__cpu_isa_detect(); i++)
        isas[n_isas++] = i;
}

/* The activation row x (n floats) as a weight of type `wt` sees it: quantized by the scalar
 * reference of its form (Q8_K per 256 for the K-quants, the Q8_0 rule per 32 otherwise) and
 * widened back. */
static void act_seen(sh_dtype wt, const float *x, int64_t n, float *out)
{
    if (sh__cpu_type_k(wt)) {
        sh_block_q8_k *q = malloc((size_t)(n / SH_QK_K) * sizeof *q);
        CHECK_OK(sh__quant_row(SH_DTYPE_Q8_K, x, q, n));
        CHECK_OK(sh__dequant_row(SH_DTYPE_Q8_K, q, out, n));
        free(q);
        return;
    }
    int8_t *qs = malloc((size_t)n);
    float *d = malloc((size_t)(n / 32) * sizeof(float)),
          *s = malloc((size_t)(n / 32) * sizeof(float));
    sh__cpu_quant_act_ref(x, n, qs, d, s);
    for (int64_t i = 0; i < n; i++)
        out[i] = d[i / 32] * (float)qs[i];
    free(qs);
    free(d);
    free(s);
}

/* truth[t, r] = sum_k deq(W)[r, k] * act_seen(x_t)[k] in double and scale[t, r] = sum_k
 * |deq(W)[r, k] * act_seen(x_t)[k]|: the kernels compute the same sum of the same products with
 * exact integer parts and float scale steps, so they must agree within a few float roundings of
 * scale. */
static void reference(sh_dtype wt, const float *deq, int64_t n_out, int64_t n_in, const float *x,
                      int64_t n_tok, float *truth, double *scale)
{
    float *xa = malloc((size_t)n_in * sizeof(float));
    for (int64_t t = 0; t < n_tok; t++) {
        act_seen(wt, x + t * n_in, n_in, xa);
        for (int64_t r = 0; r < n_out; r++) {
            double s = 0, sa = 0;
            for (int64_t k = 0; k < n_in; k++) {
                const double p = (double)deq[r * n_in + k] * xa[k];
                s += p;
                sa += fabs(p);
            }
            truth[t * n_out + r] = (float)s;
            scale[t * n_out + r] = sa;
        }
    }
    free(xa);
}

/* Largest |a - b| / scale over n (a NaN sticks). */
static double worst_rel(const float *a, const float *b, const double *scale, int64_t n)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]) / (scale[i] + 1e-30);
        if (!(e <= worst))
            worst = e;
    }
    return worst;
}

/* Tolerance against the float reference, in units of sum|w a|: float rounding of the per-block
 * scale steps only (worst seen about 2e-7). */
#define TOL_REF 1e-5
/* Fast paths against the scalar one (the float summation order differs: Q5's activations, the
 * K-quants' vector sums across blocks). */
#define TOL_FAST 2e-5

/* The worst errors seen, printed so that the margins stay visible. */
static double seen_ref, seen_fast;

static sh_backend *be_of[3];
static sh_backend_stream *st_of[3];

static bool open_backends(int threads)
{
    list_isas();
    for (int i = 0; i < n_isas; i++) {
        be_of[i] = make(isas[i], threads);
        if (!be_of[i])
            return false;
        CHECK_OK(sh_backend_stream_create(be_of[i], &st_of[i], NULL));
    }
    return true;
}

static void close_backends(void)
{
    for (int i = 0; i < n_isas; i++) {
        sh_backend_stream_destroy(be_of[i], st_of[i]);
        sh_backend_destroy(be_of[i]);
        be_of[i] = NULL;
    }
}

/* y = x W^T for one weight on every ISA: each against the float reference within TOL_REF; the
 * fast paths within TOL_FAST of the scalar kernels. `what` names the case in messages. */
static void check_matmul(const sh_tensor *w, const float *deq, const float *x, int64_t n_tok,
                         const char *what)
{
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const size_t ny = (size_t)(n_tok * n_out);
    float *truth = malloc(ny * sizeof(float)), *y[3] = {NULL, NULL, NULL};
    double *scale = malloc(ny * sizeof(double));
    reference(w->type, deq, n_out, n_in, x, n_tok, truth, scale);
    for (int i = 0; i < n_isas; i++) {
        y[i] = malloc(ny * sizeof(float));
        fill(y[i], (int64_t)ny, 1.0f); /* garbage the op must overwrite */
        CHECK_OK(sh_backend_matmul(be_of[i], st_of[i], w, x, n_tok, y[i]));
        CHECK_OK(sh_backend_sync(be_of[i], st_of[i]));
        /* The weight prepared (repacked where the ISA has a packed kernel for its type) */
        float *yp = malloc(ny * sizeof(float));
        fill(yp, (int64_t)ny, 1.0f);
        CHECK_OK(sh_backend_weight_prepare(be_of[i], w));
        CHECK_OK(sh_backend_matmul(be_of[i], st_of[i], w, x, n_tok, yp));
        CHECK_OK(sh_backend_sync(be_of[i], st_of[i]));
        sh_backend_weight_release(be_of[i], w->data);
        const double ep = worst_rel(yp, y[i], scale, (int64_t)ny);
        seen_fast = ep > seen_fast ? ep : seen_fast;
        if (!(ep <= TOL_FAST))
            SH_FAIL_("%s %s %s n_in %lld n_out %lld n_tok %lld: prepared vs not %.3g", what,
                     sh_backend_cpu_isa_name(isas[i]), sh__dtype_name(w->type), (long long)n_in,
                     (long long)n_out, (long long)n_tok, ep);
        free(yp);
        const double e = worst_rel(y[i], truth, scale, (int64_t)ny);
        seen_ref = e > seen_ref ? e : seen_ref;
        if (!(e <= TOL_REF))
            SH_FAIL_("%s %s %s n_in %lld n_out %lld n_tok %lld: vs float reference %.3g", what,
                     sh_backend_cpu_isa_name(isas[i]), sh__dtype_name(w->type), (long long)n_in,
                     (long long)n_out, (long long)n_tok, e);
        if (i == 0)
            continue;
        /* The fast paths differ from the scalar kernels in rounding only: the K-quants' AVX-512
         * rows keep vector float sums across blocks (the integers stay exact), Q5 rounds the
         * activations differently. */
        const double f = worst_rel(y[i], y[0], scale, (int64_t)ny);
        seen_fast = f > seen_fast ? f : seen_fast;
        if (!(f <= TOL_FAST))
            SH_FAIL_("%s %s %s n_in %lld n_out %lld n_tok %lld: vs scalar %.3g", what,
                     sh_backend_cpu_isa_name(isas[i]), sh__dtype_name(w->type), (long long)n_in,
                     (long long)n_out, (long long)n_tok, f);
    }
    for (int i = 0; i < n_isas; i++)
        free(y[i]);
    free(truth);
    free(scale);
}

/* Every new type on ragged shapes: row counts that are not multiples of 16, single and odd
 * token counts, rows of one block and of several (odd block counts for the 32-block types). */
static void test_types(void)
{
    if (!open_backends(2))
        return;
    const int64_t n_ins[] = {256, 768, 2560, 96};
    const int64_t n_outs[] = {1, 13, 67};
    const int64_t n_toks[] = {1, 2, 5, 17};
    for (size_t ti = 0; ti < N_NEW; ti++)
        for (size_t a = 0; a < 4; a++)
            for (size_t b = 0; b < 3; b++)
                for (size_t c = 0; c < 4; c++) {
                    const sh_dtype type = new_types[ti];
                    const int64_t n_in = n_ins[a], n_out = n_outs[b], n_tok = n_toks[c];
                    if (n_in % sh__dtype_info(type)->block_elems)
                        continue;
                    wmat w = make_w(type, n_out, n_in);
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    x[n_in / 2] = -4.0f; /* one outlier block scale */
                    check_matmul(&w.t, w.deq, x, n_tok, "types");
                    free(x);
                    free_w(&w);
                }
    printf("worst vs float reference %.3g (tolerance %g), fast vs scalar %.3g (%g)\n", seen_ref,
           TOL_REF, seen_fast, TOL_FAST);
    close_backends();
}

/* 1, 2 and 3 threads give bit-identical outputs for every new type (each output is one thread's
 * fixed instruction sequence, whichever thread computes it). */
static void test_threads(void)
{
    const int64_t n_in = 512, n_out = 83, n_tok = 3;
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
    fill(x, n_tok * n_in, 1.0f);
    for (size_t ti = 0; ti < N_NEW; ti++) {
        wmat w = make_w(new_types[ti], n_out, n_in);
        float *y[3];
        for (int n = 1; n <= 3; n++) {
            sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n);
            sh_backend_stream *s;
            CHECK_OK(sh_backend_stream_create(be, &s, NULL));
            y[n - 1] = malloc((size_t)(n_tok * n_out) * sizeof(float));
            CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y[n - 1]));
            CHECK_OK(sh_backend_sync(be, s));
            sh_backend_stream_destroy(be, s);
            sh_backend_destroy(be);
        }
        for (int n = 1; n < 3; n++)
            if (memcmp(y[0], y[n], (size_t)(n_tok * n_out) * sizeof(float)) != 0)
                SH_FAIL_("%s: %d threads differ from 1", sh__dtype_name(new_types[ti]), n + 1);
        for (int n = 0; n < 3; n++)
            free(y[n]);
        free_w(&w);
    }
    free(x);
}

/* A batch's outputs equal each token's alone (matvec) bit for bit, on every ISA: the batched
 * tiles run each token's float steps in the matvec's order. */
static void test_batched(void)
{
    if (!open_backends(2))
        return;
    const int64_t n_in = 768, n_out = 37, n_tok = 6;
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
    float *yb = malloc((size_t)(n_tok * n_out) * sizeof(float)), *y1 = malloc((size_t)n_out * 4);
    fill(x, n_tok * n_in, 1.0f);
    for (size_t ti = 0; ti < N_NEW; ti++) {
        if (!sh__cpu_type_k(new_types[ti]))
            continue;
        wmat w = make_w(new_types[ti], n_out, n_in);
        for (int i = 0; i < n_isas; i++) {
            CHECK_OK(sh_backend_matmul(be_of[i], st_of[i], &w.t, x, n_tok, yb));
            CHECK_OK(sh_backend_sync(be_of[i], st_of[i]));
            for (int64_t t = 0; t < n_tok; t++) {
                CHECK_OK(sh_backend_matmul(be_of[i], st_of[i], &w.t, x + t * n_in, 1, y1));
                CHECK_OK(sh_backend_sync(be_of[i], st_of[i]));
                if (memcmp(y1, yb + t * n_out, (size_t)n_out * sizeof(float)) != 0)
                    SH_FAIL_("%s %s: token %lld of a batch differs from its matvec",
                             sh_backend_cpu_isa_name(isas[i]), sh__dtype_name(new_types[ti]),
                             (long long)t);
            }
        }
        free_w(&w);
    }
    free(x);
    free(yb);
    free(y1);
    close_backends();
}

/* The fused forms with mixed types against their unfused definitions on the same ISA, which run
 * the same float operations and so must agree exactly: norm + Q/K/V of a 32-block type, a
 * K-quant and Q8_0 (both activation forms prepared at once), norm + SwiGLU over a K-quant gate
 * and a K-quant or Q5 up, and accumulate. */
static void test_fused(void)
{
    if (!open_backends(3))
        return;
    const int64_t n_in = 512;
    const sh_dtype qkv[][3] = {{SH_DTYPE_Q5_0, SH_DTYPE_Q4_K, SH_DTYPE_Q8_0},
                               {SH_DTYPE_Q6_K, SH_DTYPE_Q5_1, SH_DTYPE_Q2_K},
                               {SH_DTYPE_Q3_K, SH_DTYPE_Q5_K, SH_DTYPE_F16},
                               {SH_DTYPE_IQ4_NL, SH_DTYPE_IQ4_XS, SH_DTYPE_Q4_0}};
    const sh_dtype ffn[][2] = {{SH_DTYPE_Q4_K, SH_DTYPE_Q6_K},
                               {SH_DTYPE_Q5_0, SH_DTYPE_Q5_K},
                               {SH_DTYPE_Q2_K, SH_DTYPE_Q4_1},
                               {SH_DTYPE_IQ4_XS, SH_DTYPE_IQ4_NL}};
    const int64_t n_toks[] = {1, 5};
    for (int i = 0; i < n_isas; i++)
        for (size_t c = 0; c < 4; c++)
            for (size_t tk = 0; tk < 2; tk++) {
                sh_backend *be = be_of[i];
                sh_backend_stream *s = st_of[i];
                const int64_t n_tok = n_toks[tk];
                wmat wq = make_w(qkv[c][0], 70, n_in), wk = make_w(qkv[c][1], 33, n_in);
                wmat wv = make_w(qkv[c][2], 17, n_in), wg = make_w(ffn[c][0], 100, n_in);
                wmat wu = make_w(ffn[c][1], 100, n_in);
                float x[5 * 512], norm[512], xn[5 * 512];
                fill(x, n_tok * n_in, 2.0f);
                fill(norm, n_in, 1.0f);
                float q[5 * 70], k[5 * 33], v[5 * 17], h[5 * 100];
                float rq[5 * 70], rk[5 * 33], rv[5 * 17], rg[5 * 100], ru[5 * 100];
                CHECK_OK(sh_backend_norm_qkv(be, s, x, norm, 1e-5f, n_tok, &wq.t, &wk.t, &wv.t, q,
                                             k, v));
                CHECK_OK(sh_backend_norm_ffn_up(be, s, x, norm, 1e-5f, n_tok, &wg.t, &wu.t, h));
                CHECK_OK(sh_backend_rmsnorm(be, s, x, norm, 1e-5f, n_tok, n_in, xn));
                CHECK_OK(sh_backend_matmul(be, s, &wq.t, xn, n_tok, rq));
                CHECK_OK(sh_backend_matmul(be, s, &wk.t, xn, n_tok, rk));
                CHECK_OK(sh_backend_matmul(be, s, &wv.t, xn, n_tok, rv));
                CHECK_OK(sh_backend_matmul(be, s, &wg.t, xn, n_tok, rg));
                CHECK_OK(sh_backend_matmul(be, s, &wu.t, xn, n_tok, ru));
                CHECK_OK(sh_backend_swiglu(be, s, rg, ru, n_tok * 100, rg));
                CHECK_OK(sh_backend_sync(be, s));
                const char *isa = sh_backend_cpu_isa_name(isas[i]);
                if (memcmp(q, rq, (size_t)(n_tok * 70) * sizeof(float)) ||
                    memcmp(k, rk, (size_t)(n_tok * 33) * sizeof(float)) ||
                    memcmp(v, rv, (size_t)(n_tok * 17) * sizeof(float)))
                    SH_FAIL_("%s norm_qkv %s/%s/%s n_tok %lld differs from unfused", isa,
                             sh__dtype_name(qkv[c][0]), sh__dtype_name(qkv[c][1]),
                             sh__dtype_name(qkv[c][2]), (long long)n_tok);
                if (memcmp(h, rg, (size_t)(n_tok * 100) * sizeof(float)))
                    SH_FAIL_("%s swiglu %s/%s n_tok %lld differs from unfused", isa,
                             sh__dtype_name(ffn[c][0]), sh__dtype_name(ffn[c][1]),
                             (long long)n_tok);
                /* the fused products against the float reference too */
                check_matmul(&wk.t, wk.deq, xn, n_tok, "fused input");
                /* accumulate: y = y0 + x W^T, for a K-quant and a 32-block weight */
                const wmat *acc_w[2] = {&wk, &wq};
                for (int aw = 0; aw < 2; aw++) {
                    const int64_t n_out = acc_w[aw]->t.ne[1];
                    float y[5 * 70], y0[5 * 70], p[5 * 70];
                    fill(y, n_tok * n_out, 1.0f);
                    memcpy(y0, y, sizeof y);
                    CHECK_OK(sh_backend_matmul_add(be, s, &acc_w[aw]->t, x, n_tok, y));
                    CHECK_OK(sh_backend_matmul(be, s, &acc_w[aw]->t, x, n_tok, p));
                    CHECK_OK(sh_backend_sync(be, s));
                    for (int64_t j = 0; j < n_tok * n_out; j++)
                        if (y[j] != y0[j] + p[j]) {
                            SH_FAIL_("%s accumulate %s [%lld]: %.9g != %.9g + %.9g", isa,
                                     sh__dtype_name(acc_w[aw]->t.type), (long long)j, (double)y[j],
                                     (double)y0[j], (double)p[j]);
                            break;
                        }
                }
                free_w(&wq);
                free_w(&wk);
                free_w(&wv);
                free_w(&wg);
                free_w(&wu);
            }
    close_backends();
}

/* Row lookups in a table of each new type equal its scalar dequantization exactly; ids out of
 * range give zero rows. */
static void test_embed(void)
{
    if (!open_backends(2))
        return;
    const int64_t dim = 768, n_vocab = 41;
    const int32_t ids[] = {0, 7, 40, -1, 41, 13, 7};
    const int64_t n_tok = (int64_t)(sizeof ids / sizeof ids[0]);
    for (size_t ti = 0; ti < N_NEW; ti++) {
        wmat w = make_w(new_types[ti], n_vocab, dim);
        for (int i = 0; i < 2 * n_isas; i++) {
            /* each ISA twice: the table as it is, then prepared (a tied head: a packed table is
             * read back block by block) */
            sh_backend *be = be_of[i % n_isas];
            sh_backend_stream *st = st_of[i % n_isas];
            if (i >= n_isas)
                CHECK_OK(sh_backend_weight_prepare(be, &w.t));
            float *y = malloc((size_t)(n_tok * dim) * sizeof(float));
            fill(y, n_tok * dim, 1.0f);
            CHECK_OK(sh_backend_embed(be, st, &w.t, ids, n_tok, y));
            CHECK_OK(sh_backend_sync(be, st));
            if (i >= n_isas)
                sh_backend_weight_release(be, w.t.data);
            for (int64_t t = 0; t < n_tok; t++) {
                const int32_t id = ids[t];
                for (int64_t k = 0; k < dim; k++) {
                    const float want = id < 0 || id >= n_vocab ? 0.0f : w.deq[id * dim + k];
                    if (y[t * dim + k] != want) {
                        SH_FAIL_("%s%s %s id %d [%lld]: %.9g != %.9g",
                                 sh_backend_cpu_isa_name(isas[i % n_isas]),
                                 i >= n_isas ? " prepared" : "", sh__dtype_name(new_types[ti]), id,
                                 (long long)k, (double)y[t * dim + k], (double)want);
                        break;
                    }
                }
            }
            free(y);
        }
        free_w(&w);
    }
    close_backends();
}

/* A K-quant weight whose rows are not whole super-blocks is refused by the matmul (SH_EINVAL),
 * as is a mixed fused matmul whose shared n_in does not suit its K-quant member. */
static void test_refused(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    uint8_t data[4096] = {0};
    float x[640] = {0}, y[16];
    sh_tensor w = {SH_DTYPE_Q4_K, {640, 2, 1, 1}, data};
    CHECK(sh_backend_matmul(be, s, &w, x, 1, y) == SH_EINVAL);
    sh_tensor q5 = {SH_DTYPE_Q5_0, {640, 2, 1, 1}, data};
    sh_matmul_args a = {.x = x, .n_tok = 1, .n_w = 2, .w = {q5, w}, .y = {y, y + 8}};
    CHECK(sh_backend_matmul_ex(be, s, &a) == SH_EINVAL);
    sh_tensor q5b = {SH_DTYPE_Q5_1, {48, 2, 1, 1}, data};
    CHECK(sh_backend_matmul(be, s, &q5b, x, 1, y) == SH_EINVAL);
    CHECK_OK(sh_backend_sync(be, s));
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
}

/* The real tensors of models/gemma3-270m-q4_k_m.gguf (scripts/get-model.sh gemma3-270m): the
 * first matrix of each of its quantized types, the first rows of it, as matmul weights on every
 * ISA against the float reference (77 when the file is absent). */
static int gemma_skipped;
static void test_gemma(void)
{
    sh_gguf *g = NULL;
    sh_error e = {0};
    if (sh_gguf_open(sh_test_path("models/gemma3-270m-q4_k_m.gguf"), NULL, &g, &e) != SH_OK) {
        fprintf(stderr, "skip: %s (scripts/get-model.sh gemma3-270m)\n", e.msg);
        gemma_skipped = 1;
        return;
    }
    if (!open_backends(2)) {
        sh_gguf_close(g);
        return;
    }
    const sh_dtype want[] = {SH_DTYPE_Q4_K, SH_DTYPE_Q6_K, SH_DTYPE_Q5_0, SH_DTYPE_Q8_0};
    for (size_t wi = 0; wi < sizeof want / sizeof want[0]; wi++) {
        const sh_gguf_tensor *gt = NULL;
        for (uint64_t i = 0; i < sh_gguf_n_tensors(g) && !gt; i++) {
            const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
            if (t->type == want[wi] && t->n_dims == 2)
                gt = t;
        }
        if (!gt) {
            SH_FAIL_("the Gemma file has no %s matrix", sh__dtype_name(want[wi]));
            continue;
        }
        const int64_t n_in = (int64_t)gt->ne[0];
        const int64_t n_out = gt->ne[1] < 203 ? (int64_t)gt->ne[1] : 203; /* a ragged slice */
        sh_tensor w = {gt->type, {n_in, n_out, 1, 1}, (void *)gt->data};
        float *deq = malloc((size_t)(n_out * n_in) * sizeof(float));
        const size_t rb = sh__dtype_row_bytes(gt->type, (uint64_t)n_in);
        for (int64_t r = 0; r < n_out; r++)
            CHECK_OK(sh__dequant_row(gt->type, (const uint8_t *)gt->data + r * rb, deq + r * n_in,
                                     n_in));
        for (int64_t n_tok = 1; n_tok <= 4; n_tok += 3) {
            float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
            fill(x, n_tok * n_in, 1.0f);
            fprintf(stderr, "  %.*s (%s, %lld x %lld of %llu rows), %lld tokens\n",
                    (int)gt->name.len, gt->name.ptr, sh__dtype_name(gt->type), (long long)n_out,
                    (long long)n_in, (unsigned long long)gt->ne[1], (long long)n_tok);
            check_matmul(&w, deq, x, n_tok, "gemma");
            free(x);
        }
        free(deq);
    }
    close_backends();
    sh_gguf_close(g);
}

static const sh_test_case tests[] = {
    {"types", test_types},     {"threads", test_threads},
    {"batched", test_batched}, {"fused", test_fused},
    {"embed", test_embed},     {"refused", test_refused},
    {"gemma", test_gemma},     {NULL, NULL},
};

int main(int argc, char **argv)
{
    rng_state = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull | 1;
    if (getenv("SH_TEST_SEED"))
        rng_state = strtoull(getenv("SH_TEST_SEED"), NULL, 0) | 1;
    printf("seed %llu (SH_TEST_SEED to repeat)\n", (unsigned long long)rng_state);
    int rc = sh_test_main(argc, argv, tests);
    if (rc == 0 && gemma_skipped && argc > 1 && strcmp(argv[1], "gemma") == 0)
        return SH_TEST_SKIP;
    return rc;
}
