/* Unit tests of the CPU backend's Gemma ops: the GEGLU activation (scalar reference against the
 * tanh formula in double precision, each ISA's SIMD path against the reference, ragged lengths),
 * the matmul fused with GEGLU against separate products, and the scale and soft-cap ops, on
 * fresh random inputs (seed printed; SH_TEST_SEED repeats it). */
#include <stdint.h>
#include <time.h>

#include "kernels/cpu/cpu.h"
#include "kernels_test_util.h"

static int isas[3], n_isas;
static void list_isas(void)
{
    n_isas = 0;
    for (int i = SH_BACKEND_CPU_ISA_SCALAR; i <= sh__cpu_isa_detect(); i++)
        isas[n_isas++] = i;
}

/* gelu(g) by its definition, 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3), in
 * double, written g / (1 + exp(-2z)) (the same number; 1 + tanh(z) would cancel for z << 0). */
static double gelu_exact(double g)
{
    double z = sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g);
    return g / (1.0 + exp(-2.0 * z));
}

/* The relative error a float computation of gelu(g) carries: the exponent's argument 2z, itself
 * rounded, moves exp(-2z) by about |2z| float roundings (so up to 1e-5 near g = -9, where gelu
 * is 1e-28), plus a few roundings of the rest. Results below 1e-30 compare absolutely. */
static double gelu_tol(float g, double want)
{
    double z2 = fabs(2.0 * sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g));
    return 3.0e-7 * (4.0 + z2) * fabs(want) + 1e-30;
}

/* Random values over several magnitudes: most in (-4, 4) where gelu bends, some up to +-40
 * (the exponential's clamp), a few tiny. */
static float rand_arg(void)
{
    uint64_t r = rng_next() % 16;
    float s = r < 11 ? 4.0f : r < 14 ? 40.0f : 1e-3f;
    return rng_sym() * s;
}

/* The reference against the definition, within gelu_tol: the sigmoid form has no cancellation,
 * so this holds for very negative g too. */
static void test_geglu_ref_formula(void)
{
    enum { N = 20000 };
    static float g[N], u[N], y[N];
    for (int i = 0; i < N; i++) {
        g[i] = rand_arg();
        u[i] = rng_sym() * 3.0f;
    }
    g[0] = -87.0f, g[1] = 87.0f, g[2] = -9.0f, g[3] = 9.0f; /* the tails */
    sh__cpu_geglu_ref(g, u, y, N);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        double want = gelu_exact(g[i]) * u[i];
        double err = fabs(y[i] - want) / (fabs(want) + 1e-30);
        if (fabs(want) > 1e-30 && err > worst)
            worst = err;
        if (!(fabs(y[i] - want) <= gelu_tol(g[i], want)))
            SH_FAIL_("g %.9g u %.9g: %.9g, formula %.9g", g[i], u[i], y[i], want);
    }
    printf("geglu reference vs the tanh formula: worst relative error %.2e\n", worst);
}

/* Each ISA's GEGLU (the one the fused matmul uses) against the reference, lengths 0..67 and a
 * long row, y in place over g as the backend allows. */
static void test_geglu_simd(void)
{
    list_isas();
    enum { N = 4099 };
    static float g[N], u[N], want[N], got[N];
    for (int i = 0; i < n_isas; i++) {
        sh__cpu_glu_fn fn = sh__cpu_geglu_for(isas[i]);
        double worst = 0;
        for (int n = 0; n <= N; n = n < 67 ? n + 1 : N + 1) {
            int len = n <= 67 ? n : N;
            for (int j = 0; j < len; j++) {
                g[j] = rand_arg();
                u[j] = rng_sym() * 2.0f;
            }
            sh__cpu_geglu_ref(g, u, want, len);
            memcpy(got, g, sizeof(float) * (size_t)len);
            fn(got, u, got, len); /* in place; g keeps the arguments for the checks */
            for (int j = 0; j < len; j++) {
                double err = fabs((double)got[j] - want[j]) / (fabs(want[j]) + 1e-30);
                if (fabs(want[j]) > 1e-30 && err > worst)
                    worst = err;
                if (!(fabs(got[j] - want[j]) <= gelu_tol(g[j], want[j])))
                    SH_FAIL_("isa %d n %d [%d]: g %.9g u %.9g: %.9g, reference %.9g", isas[i], len,
                             j, g[j], u[j], got[j], want[j]);
            }
        }
        printf("geglu %s vs reference: worst relative error %.2e\n",
               sh_backend_cpu_isa_name(isas[i]), worst);
    }
}

/* The matmul fused with GEGLU equals gelu(x' Wg^T) * (x' Wu^T) computed from separate products
 * on the scalar backend, on every ISA, for float and quantized weights, with a norm and without,
 * with a row count that is not a multiple of the 16-row chunk. */
static void test_matmul_geglu(void)
{
    list_isas();
    const int64_t n_in = 160, n_tok = 6, n_ff = 83;
    const sh_dtype types[] = {SH_DTYPE_F32, SH_DTYPE_F16, SH_DTYPE_Q8_0, SH_DTYPE_Q4_0};
    for (int i = 0; i < n_isas; i++)
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (int with_norm = 0; with_norm < 2; with_norm++) {
                sh_backend *be = make(isas[i], 3), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
                if (!be || !ref)
                    return;
                sh_backend_stream *s, *rs;
                CHECK_OK(sh_backend_stream_create(be, &s, NULL));
                CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
                wmat wg = make_w(types[ti], n_ff, n_in), wu = make_w(types[ti], n_ff, n_in);
                float x[6 * 160], norm[160], xn[6 * 160];
                float h[6 * 83], rg[6 * 83], ru[6 * 83], want[6 * 83];
                fill(x, n_tok * n_in, 2.0f);
                fill(norm, n_in, 1.0f);
                sh_matmul_args a = {.x = x,
                                    .n_tok = n_tok,
                                    .norm = with_norm ? norm : NULL,
                                    .norm_eps = 1e-6f,
                                    .n_w = 2,
                                    .w = {wg.t, wu.t},
                                    .y = {h, NULL},
                                    .act = SH_MATMUL_ACT_GEGLU};
                CHECK_OK(sh_backend_matmul_ex(be, s, &a));
                CHECK_OK(sh_backend_sync(be, s));
                const float *in = x;
                if (with_norm) {
                    /* normalized by the backend under test (the fused op's own norm code): a
                     * last-ulp difference from the scalar norm can move a Q8_0 activation code,
                     * which shifts a small output by more than the tolerance (seed 624) */
                    CHECK_OK(sh_backend_rmsnorm(be, s, x, norm, 1e-6f, n_tok, n_in, xn));
                    CHECK_OK(sh_backend_sync(be, s));
                    in = xn;
                }
                CHECK_OK(sh_backend_matmul(ref, rs, &wg.t, in, n_tok, rg));
                CHECK_OK(sh_backend_matmul(ref, rs, &wu.t, in, n_tok, ru));
                CHECK_OK(sh_backend_sync(ref, rs));
                for (int j = 0; j < n_tok * n_ff; j++)
                    want[j] = (float)(gelu_exact(rg[j]) * ru[j]);
                for (int j = 0; j < n_tok * n_ff; j++)
                    CHECK_NEAR(h[j], want[j], 1e-4 * (1 + fabs(want[j])));
                /* GEGLU takes two weights of one height and no accumulate */
                a.accumulate = true;
                CHECK_INT_EQ(sh_backend_matmul_ex(be, s, &a), SH_EINVAL);
                a.accumulate = false;
                a.n_w = 1;
                CHECK_INT_EQ(sh_backend_matmul_ex(be, s, &a), SH_EINVAL);
                free_w(&wg);
                free_w(&wu);
                sh_backend_stream_destroy(be, s);
                sh_backend_stream_destroy(ref, rs);
                sh_backend_destroy(be);
                sh_backend_destroy(ref);
            }
}

/* scale and softcap on every ISA and thread count against the formulas, small (run inline) and
 * large (split over the pool) sizes, in place and not; bad arguments refused. */
static void test_scale_softcap(void)
{
    list_isas();
    const int64_t sizes[] = {1, 77, 8192, 70001};
    for (int i = 0; i < n_isas; i++)
        for (int threads = 1; threads <= 3; threads += 2) {
            sh_backend *be = make(isas[i], threads);
            if (!be)
                return;
            sh_backend_stream *s;
            CHECK_OK(sh_backend_stream_create(be, &s, NULL));
            for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
                const int64_t n = sizes[k];
                float *x = malloc((size_t)n * sizeof(float)),
                      *y = malloc((size_t)n * sizeof(float));
                float *z = malloc((size_t)n * sizeof(float));
                fill(x, n, 60.0f);
                memcpy(z, x, (size_t)n * sizeof(float));
                const float sc = 25.298221281347036f, cap = 30.0f;
                CHECK_OK(sh_backend_scale(be, s, x, n, sc, y));
                CHECK_OK(sh_backend_softcap(be, s, z, n, cap, z)); /* in place */
                CHECK_OK(sh_backend_sync(be, s));
                for (int64_t j = 0; j < n; j++) {
                    CHECK_NEAR(y[j], sc * x[j], 1e-6 * fabs(sc * x[j]));
                    double want = cap * tanh((double)x[j] / cap);
                    CHECK_NEAR(z[j], want, 2e-6 * fabs(want) + 1e-6);
                    CHECK(fabsf(z[j]) < cap);
                }
                free(x);
                free(y);
                free(z);
            }
            float v = 1.0f;
            CHECK_INT_EQ(sh_backend_softcap(be, s, &v, 1, 0.0f, &v), SH_EINVAL);
            CHECK_INT_EQ(sh_backend_softcap(be, s, &v, 1, -1.0f, &v), SH_EINVAL);
            CHECK_INT_EQ(sh_backend_scale(be, s, &v, 0, 2.0f, &v), SH_EINVAL);
            CHECK_INT_EQ(sh_backend_scale(be, s, NULL, 1, 2.0f, &v), SH_EINVAL);
            sh_backend_stream_destroy(be, s);
            sh_backend_destroy(be);
        }
}

int main(int argc, char **argv)
{
    rng_state = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull | 1;
    if (getenv("SH_TEST_SEED"))
        rng_state = strtoull(getenv("SH_TEST_SEED"), NULL, 0) | 1;
    printf("seed %llu (SH_TEST_SEED to repeat)\n", (unsigned long long)rng_state);
    static const sh_test_case tests[] = {
        {"geglu_ref_formula", test_geglu_ref_formula},
        {"geglu_simd", test_geglu_simd},
        {"matmul_geglu", test_matmul_geglu},
        {"scale_softcap", test_scale_softcap},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
