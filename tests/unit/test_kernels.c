/* Unit tests of the CPU backend's matmul family and row-wise ops: every fast path against the
 * scalar reference (and the reference against dequantized f32 maths) on fresh random inputs. */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "kernels/cpu/cpu.h"
#include "kernels_test_util.h"

/* The ISAs this machine runs, best last. */
static int isas[3], n_isas;
static void list_isas(void)
{
    n_isas = 0;
    for (int i = SH_BACKEND_CPU_ISA_SCALAR; i <= sh__cpu_isa_detect(); i++)
        isas[n_isas++] = i;
}

/* Largest |a - b| over n, relative to the matching sum_k |w||x| (the natural scale of a dot
 * product's rounding and quantization error). */
static double worst_rel(const float *a, const float *b, const double *scale, int64_t n)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]) / (scale[i] + 1e-30);
        if (!(e <= worst)) /* a NaN sticks */
            worst = e;
    }
    return worst;
}

static const sh_dtype types[] = {SH_DTYPE_F32,  SH_DTYPE_F16,  SH_DTYPE_BF16,
                                 SH_DTYPE_Q8_0, SH_DTYPE_Q4_0, SH_DTYPE_Q4_1};

static bool quantized(sh_dtype t)
{
    return t == SH_DTYPE_Q8_0 || t == SH_DTYPE_Q4_0 || t == SH_DTYPE_Q4_1;
}

/* y = x W^T on every ISA (2 threads) vs the scalar reference, and the reference vs f32 maths on
 * the dequantized weight. Tolerances: fast vs reference 2e-5 of sum|w||x| (same integer codes,
 * only the float summation order differs); reference vs f32 maths 1e-5 of sum|w||x|, plus for
 * quantized weights the activation rounding bound sum_blocks (max|x|/127/2) sum|w|. */
static void test_matmul_vs_ref(void)
{
    list_isas();
    sh_backend *be[3];
    sh_backend_stream *st[3];
    for (int i = 0; i < n_isas; i++) {
        be[i] = make(isas[i], 2);
        CHECK(be[i] != NULL);
        if (!be[i])
            return;
        CHECK_OK(sh_backend_stream_create(be[i], &st[i], NULL));
    }
    /* 8 and 172 (stories260K's FFN width) are not whole blocks: float weights only. */
    const int64_t n_ins[] = {8, 32, 96, 172, 576, 1056};
    const int64_t n_outs[] = {1, 7, 64, 577};
    const int64_t n_toks[] = {1, 3, 17};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t a = 0; a < 6; a++)
            for (size_t b = 0; b < 4; b++)
                for (size_t c = 0; c < 3; c++) {
                    const int64_t n_in = n_ins[a], n_out = n_outs[b], n_tok = n_toks[c];
                    if (n_in * n_out * n_tok > 4000000 || (quantized(types[ti]) && n_in % 32))
                        continue;
                    wmat w = make_w(types[ti], n_out, n_in);
                    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float));
                    fill(x, n_tok * n_in, 1.0f);
                    x[0] = 3.0f; /* one outlier block scale */
                    float *y[3] = {NULL, NULL, NULL},
                          *truth = malloc((size_t)(n_tok * n_out) * sizeof(float));
                    double *scale = malloc((size_t)(n_tok * n_out) * sizeof(double));
                    double *bound = malloc((size_t)(n_tok * n_out) * sizeof(double));
                    for (int64_t t = 0; t < n_tok; t++)
                        for (int64_t r = 0; r < n_out; r++) {
                            double s = 0, sa = 0, qb = 0;
                            for (int64_t k0 = 0; k0 < n_in; k0 += 32) {
                                double amax = 0, wabs = 0;
                                for (int64_t k = k0; k < k0 + 32 && k < n_in; k++) {
                                    s += (double)w.deq[r * n_in + k] * x[t * n_in + k];
                                    sa += fabs((double)w.deq[r * n_in + k] * x[t * n_in + k]);
                                    amax = fmax(amax, fabs(x[t * n_in + k]));
                                    wabs += fabs(w.deq[r * n_in + k]);
                                }
                                /* int8 rounding moves each activation by at most d/2 */
                                qb += amax / 127.0 / 2.0 * wabs;
                            }
                            truth[t * n_out + r] = (float)s;
                            scale[t * n_out + r] = sa;
                            bound[t * n_out + r] =
                                (quantized(types[ti]) ? 1.01 * qb : 0) + 1e-5 * sa;
                        }
                    for (int i = 0; i < n_isas; i++) {
                        y[i] = malloc((size_t)(n_tok * n_out) * sizeof(float));
                        fill(y[i], n_tok * n_out, 1.0f); /* garbage the op must overwrite */
                        CHECK_OK(sh_backend_matmul(be[i], st[i], &w.t, x, n_tok, y[i]));
                        CHECK_OK(sh_backend_sync(be[i], st[i]));
                    }
                    double e_ref = worst_rel(y[0], truth, bound, n_tok * n_out);
                    if (!(e_ref <= 1.0))
                        SH_FAIL_("%s n_in %lld n_out %lld n_tok %lld: ref vs f32 %.3g of bound",
                                 sh__dtype_name(types[ti]), (long long)n_in, (long long)n_out,
                                 (long long)n_tok, e_ref);
                    for (int i = 1; i < n_isas; i++) {
                        double e = worst_rel(y[i], y[0], scale, n_tok * n_out);
                        if (!(e <= 2e-5))
                            SH_FAIL_("%s %s n_in %lld n_out %lld n_tok %lld: fast vs ref %.3g",
                                     sh_backend_cpu_isa_name(isas[i]), sh__dtype_name(types[ti]),
                                     (long long)n_in, (long long)n_out, (long long)n_tok, e);
                    }
                    for (int i = 0; i < n_isas; i++)
                        free(y[i]);
                    free(truth);
                    free(scale);
                    free(bound);
                    free(x);
                    free_w(&w);
                }
    for (int i = 0; i < n_isas; i++) {
        sh_backend_stream_destroy(be[i], st[i]);
        sh_backend_destroy(be[i]);
    }
}

/* The fused forms against their unfused definitions on the reference backend: norm + Q/K/V of
 * three different types, norm + gate/up + SwiGLU, and accumulate (the residual add). */
static void test_matmul_fused(void)
{
    list_isas();
    const int64_t n_in = 192, n_tok = 5;
    for (int i = 0; i < n_isas; i++) {
        sh_backend *be = make(isas[i], 3), *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
        sh_backend_stream *s, *rs;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
        wmat wq = make_w(SH_DTYPE_Q4_0, 70, n_in), wk = make_w(SH_DTYPE_Q8_0, 33, n_in);
        wmat wv = make_w(SH_DTYPE_F16, 33, n_in), wg = make_w(SH_DTYPE_Q4_1, 100, n_in);
        wmat wu = make_w(SH_DTYPE_Q4_0, 100, n_in);
        float x[5 * 192], norm[192], xn[5 * 192];
        fill(x, n_tok * n_in, 2.0f);
        fill(norm, n_in, 1.0f);
        float q[5 * 70], k[5 * 33], v[5 * 33], h[5 * 100];
        float rq[5 * 70], rk[5 * 33], rv[5 * 33], rg[5 * 100], ru[5 * 100];
        CHECK_OK(sh_backend_norm_qkv(be, s, x, norm, 1e-5f, n_tok, &wq.t, &wk.t, &wv.t, q, k, v));
        CHECK_OK(sh_backend_norm_ffn_up(be, s, x, norm, 1e-5f, n_tok, &wg.t, &wu.t, h));
        CHECK_OK(sh_backend_sync(be, s));
        /* normalized by the backend under test (the fused ops' own norm code), so that both
         * sides quantize the same floats: the scalar norm's last-ulp differences can move an
         * activation code (test_kernels_gemma's seed 624 did) */
        CHECK_OK(sh_backend_rmsnorm(be, s, x, norm, 1e-5f, n_tok, n_in, xn));
        CHECK_OK(sh_backend_sync(be, s));
        CHECK_OK(sh_backend_matmul(ref, rs, &wq.t, xn, n_tok, rq));
        CHECK_OK(sh_backend_matmul(ref, rs, &wk.t, xn, n_tok, rk));
        CHECK_OK(sh_backend_matmul(ref, rs, &wv.t, xn, n_tok, rv));
        CHECK_OK(sh_backend_matmul(ref, rs, &wg.t, xn, n_tok, rg));
        CHECK_OK(sh_backend_matmul(ref, rs, &wu.t, xn, n_tok, ru));
        CHECK_OK(sh_backend_swiglu(ref, rs, rg, ru, n_tok * 100, rg));
        CHECK_OK(sh_backend_sync(ref, rs));
        for (int j = 0; j < n_tok * 70; j++)
            CHECK_NEAR(q[j], rq[j], 1e-4 * (1 + fabs(rq[j])));
        for (int j = 0; j < n_tok * 33; j++) {
            CHECK_NEAR(k[j], rk[j], 1e-4 * (1 + fabs(rk[j])));
            CHECK_NEAR(v[j], rv[j], 1e-4 * (1 + fabs(rv[j])));
        }
        for (int j = 0; j < n_tok * 100; j++)
            CHECK_NEAR(h[j], rg[j], 1e-4 * (1 + fabs(rg[j])));
        /* accumulate: y = y0 + x W^T */
        float y[5 * 70], y0[5 * 70];
        fill(y, n_tok * 70, 1.0f);
        memcpy(y0, y, sizeof y);
        CHECK_OK(sh_backend_matmul_add(be, s, &wq.t, x, n_tok, y));
        CHECK_OK(sh_backend_matmul(ref, rs, &wq.t, x, n_tok, rq));
        CHECK_OK(sh_backend_sync(be, s));
        CHECK_OK(sh_backend_sync(ref, rs));
        for (int j = 0; j < n_tok * 70; j++)
            CHECK_NEAR(y[j], y0[j] + rq[j], 1e-4 * (1 + fabs(rq[j])));
        free_w(&wq);
        free_w(&wk);
        free_w(&wv);
        free_w(&wg);
        free_w(&wu);
        sh_backend_stream_destroy(be, s);
        sh_backend_stream_destroy(ref, rs);
        sh_backend_destroy(be);
        sh_backend_destroy(ref);
    }
}

/* Static partitioning: 1, 2 and 3 threads give bit-identical outputs (each output element is
 * computed by one thread with the same instruction sequence). */
static void test_threads_identical(void)
{
    const int64_t n_in = 576, n_out = 577, n_tok = 3;
    wmat w = make_w(SH_DTYPE_Q4_1, n_out, n_in);
    wmat g = make_w(SH_DTYPE_Q8_0, 300, n_in), u = make_w(SH_DTYPE_F16, 300, n_in);
    float *x = malloc((size_t)(n_tok * n_in) * sizeof(float)), norm[576];
    fill(x, n_tok * n_in, 1.0f);
    fill(norm, n_in, 1.0f);
    float *y[3], *h[3];
    for (int n = 1; n <= 3; n++) {
        sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, n);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        y[n - 1] = malloc((size_t)(n_tok * n_out) * sizeof(float));
        h[n - 1] = malloc((size_t)(n_tok * 300) * sizeof(float));
        CHECK_OK(sh_backend_matmul(be, s, &w.t, x, n_tok, y[n - 1]));
        CHECK_OK(sh_backend_norm_ffn_up(be, s, x, norm, 1e-6f, n_tok, &g.t, &u.t, h[n - 1]));
        CHECK_OK(sh_backend_sync(be, s));
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be);
    }
    for (int n = 1; n < 3; n++) {
        CHECK(memcmp(y[0], y[n], (size_t)(n_tok * n_out) * sizeof(float)) == 0);
        CHECK(memcmp(h[0], h[n], (size_t)(n_tok * 300) * sizeof(float)) == 0);
    }
    for (int n = 0; n < 3; n++) {
        free(y[n]);
        free(h[n]);
    }
    free(x);
    free_w(&w);
    free_w(&g);
    free_w(&u);
}

/* rmsnorm, swiglu, add, embed, softmax, argmax on every ISA against direct formulas. */
static void test_rowwise_ops(void)
{
    list_isas();
    for (int i = 0; i < n_isas; i++) {
        sh_backend *be = make(isas[i], 2);
        sh_backend_stream *s;
        CHECK_OK(sh_backend_stream_create(be, &s, NULL));
        enum { T = 3, N = 200 };
        float x[T * N], w[N], y[T * N], g[T * N], u[T * N], sw[T * N], sum[T * N];
        fill(x, T * N, 3.0f);
        fill(w, N, 1.0f);
        fill(g, T * N, 6.0f);
        fill(u, T * N, 1.0f);
        CHECK_OK(sh_backend_rmsnorm(be, s, x, w, 1e-5f, T, N, y));
        CHECK_OK(sh_backend_swiglu(be, s, g, u, T * N, sw));
        CHECK_OK(sh_backend_add(be, s, g, u, T * N, sum));
        /* embedding: a Q4_0 table of 10 rows; id 10 is out of range -> zeros */
        wmat tab = make_w(SH_DTYPE_Q4_0, 10, 64);
        int32_t ids[4] = {3, 0, 9, 10};
        float emb[4 * 64];
        CHECK_OK(sh_backend_embed(be, s, &tab.t, ids, 4, emb));
        float sm[2 * 50], smx[2 * 50];
        fill(sm, 100, 4.0f);
        memcpy(smx, sm, sizeof sm);
        sm[77] = 9.0f;
        smx[77] = 9.0f;
        int32_t am[2] = {-1, -1};
        CHECK_OK(sh_backend_argmax(be, s, sm, 2, 50, am));
        CHECK_OK(sh_backend_softmax(be, s, sm, 2, 50, 0.5f));
        CHECK_OK(sh_backend_sync(be, s));
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int k = 0; k < N; k++)
                ss += (double)x[t * N + k] * x[t * N + k];
            double inv = 1.0 / sqrt(ss / N + 1e-5);
            for (int k = 0; k < N; k++)
                CHECK_NEAR(y[t * N + k], x[t * N + k] * inv * w[k], 1e-5);
        }
        for (int k = 0; k < T * N; k++) {
            CHECK_NEAR(sw[k], g[k] / (1.0 + exp(-(double)g[k])) * u[k], 1e-5);
            CHECK_NEAR(sum[k], (double)g[k] + u[k], 1e-6);
        }
        for (int k = 0; k < 64; k++) {
            CHECK_NEAR(emb[k], tab.deq[3 * 64 + k], 0);
            CHECK_NEAR(emb[64 + k], tab.deq[k], 0);
            CHECK_NEAR(emb[128 + k], tab.deq[9 * 64 + k], 0);
            CHECK_NEAR(emb[192 + k], 0, 0);
        }
        for (int r = 0; r < 2; r++) {
            int best = 0;
            double mx = -1e30, tot = 0;
            for (int k = 0; k < 50; k++) {
                if (smx[r * 50 + k] > smx[r * 50 + best])
                    best = k;
                mx = fmax(mx, 0.5 * smx[r * 50 + k]);
            }
            CHECK_INT_EQ(am[r], best);
            for (int k = 0; k < 50; k++)
                tot += exp(0.5 * smx[r * 50 + k] - mx);
            for (int k = 0; k < 50; k++)
                CHECK_NEAR(sm[r * 50 + k], exp(0.5 * smx[r * 50 + k] - mx) / tot, 1e-6);
        }
        CHECK_INT_EQ(am[1], 27);
        free_w(&tab);
        sh_backend_stream_destroy(be, s);
        sh_backend_destroy(be);
    }
}

/* Bad arguments are refused at enqueue with SH_EINVAL. */
static void test_invalid_args(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    float x[64], y[64];
    uint8_t data[64 * 4] = {0};
    sh_tensor w = {SH_DTYPE_Q8_0, {40, 1, 1, 1}, data}; /* n_in not whole blocks */
    CHECK_INT_EQ(sh_backend_matmul(be, s, &w, x, 1, y), SH_EINVAL);
    w.ne[0] = 32;
    w.type = SH_DTYPE_Q5_K; /* unsupported weight type */
    CHECK_INT_EQ(sh_backend_matmul(be, s, &w, x, 1, y), SH_EINVAL);
    w.type = SH_DTYPE_F32;
    CHECK_INT_EQ(sh_backend_matmul(be, s, &w, x, 0, y), SH_EINVAL);
    int32_t pos[1] = {0};
    CHECK_INT_EQ(sh_backend_rope(be, s, x, pos, 1, 1, 8, 9, 1e4f, 1.0f, SH_ROPE_MODE_NORMAL),
                 SH_EINVAL);
    CHECK_INT_EQ(sh_backend_all_reduce(be, s, x, 4), SH_EUNSUPPORTED);
    CHECK_OK(sh_backend_sync(be, s));
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
    sh_backend_cpu_opts bad = {.n_threads = -3};
    sh_backend *none = NULL;
    CHECK_INT_EQ(sh_backend_cpu_create(&bad, &none, NULL), SH_EINVAL);
    CHECK(none == NULL);
}

/* The fast path is what runs here: report the ISA; on an AVX-512 VNNI CPU it must be chosen. */
static void test_isa_selected(void)
{
    unsetenv("SHOAL_ISA"); /* this test is about what AUTO picks uncapped */
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    int32_t isa = sh_backend_cpu_isa(be);
    fprintf(stderr, "cpu backend ISA: %s\n", sh_backend_cpu_isa_name(isa));
    CHECK_INT_EQ(isa, sh__cpu_isa_detect());
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        CHECK_INT_EQ(isa, SH_BACKEND_CPU_ISA_AVX512);
    else if (__builtin_cpu_supports("avx2"))
        CHECK(isa >= SH_BACKEND_CPU_ISA_AVX2);
#endif
    sh_backend_destroy(be);
}

/* SHOAL_ISA caps what AUTO picks (never above the CPU's best), leaves an explicit isa alone, and
 * a value it does not know fails creation with a message naming it. */
static void test_isa_override(void)
{
    static const char *names[] = {"scalar", "avx2", "avx512"};
    const int32_t best = sh__cpu_isa_detect();
    for (int32_t cap = SH_BACKEND_CPU_ISA_SCALAR; cap <= SH_BACKEND_CPU_ISA_AVX512; cap++) {
        setenv("SHOAL_ISA", names[cap - 1], 1);
        sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
        CHECK_INT_EQ(sh_backend_cpu_isa(be), cap < best ? cap : best);
        char line[160];
        CHECK(sh_backend_cpu_describe(be, line, sizeof line) > 0);
        CHECK(strstr(line, sh_backend_cpu_isa_name(cap < best ? cap : best)) == line);
        CHECK((strstr(line, "capped by SHOAL_ISA") != NULL) == (cap < best));
        sh_backend_destroy(be);
        be = make(SH_BACKEND_CPU_ISA_SCALAR, 1); /* explicit: not capped, not raised */
        CHECK_INT_EQ(sh_backend_cpu_isa(be), SH_BACKEND_CPU_ISA_SCALAR);
        sh_backend_destroy(be);
    }
    setenv("SHOAL_ISA", "auto", 1);
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    CHECK_INT_EQ(sh_backend_cpu_isa(be), best);
    sh_backend_destroy(be);
    setenv("SHOAL_ISA", "amx", 1); /* an opt-in, not a cap: AMX where usable, else the best */
    be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    CHECK_INT_EQ(sh_backend_cpu_isa(be), sh__cpu_amx_usable() ? SH_BACKEND_CPU_ISA_AMX : best);
    sh_backend_destroy(be);
    setenv("SHOAL_ISA", "avx3", 1);
    sh_error e = {0};
    sh_backend_cpu_opts o = {.n_threads = 1};
    be = NULL;
    CHECK_INT_EQ(sh_backend_cpu_create(&o, &be, &e), SH_EINVAL);
    CHECK(be == NULL);
    CHECK(strstr(e.msg, "SHOAL_ISA=avx3") != NULL);
    int32_t isa = -1;
    CHECK_INT_EQ(sh_backend_cpu_isa_parse("AVX2", &isa), SH_EINVAL);
    CHECK_INT_EQ(isa, -1);
    CHECK_INT_EQ(sh_backend_cpu_isa_parse("avx512-vnni", &isa), SH_OK);
    CHECK_INT_EQ(isa, SH_BACKEND_CPU_ISA_AVX512);
    unsetenv("SHOAL_ISA");
}

/* The threads' placement: with cpu_mask CPU 0, SCHED_IDLE, nice +3 and no spinning, the pool's
 * helper and the queue thread (the threads the backend started) run under those settings, and
 * the backend still computes; out-of-range values are refused. */
static void test_thread_placement(void)
{
#ifdef __linux__
    int before[64], n_before = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    while (d && (de = readdir(d)) && n_before < 64)
        if (de->d_name[0] != '.')
            before[n_before++] = atoi(de->d_name);
    if (d)
        closedir(d);
    errno = 0;
    const int base_nice = getpriority(PRIO_PROCESS, 0);
    sh_backend_cpu_opts o = {
        .n_threads = 2, .cpu_mask = 1, .sched = SH_BACKEND_CPU_SCHED_IDLE, .nice = 3, .no_spin = 1};
    sh_backend *be = NULL;
    sh_error e = {0};
    CHECK_OK(sh_backend_cpu_create(&o, &be, &e));
    if (!be)
        return;
    int placed = 0;
    d = opendir("/proc/self/task");
    while (d && (de = readdir(d))) {
        const int tid = atoi(de->d_name);
        bool old = de->d_name[0] == '.';
        for (int i = 0; i < n_before && !old; i++)
            old = before[i] == tid;
        if (old)
            continue;
        cpu_set_t set;
        CHECK(sched_getaffinity(tid, sizeof set, &set) == 0);
        CHECK_INT_EQ(CPU_COUNT(&set), 1);
        CHECK(CPU_ISSET(0, &set));
        CHECK_INT_EQ(sched_getscheduler(tid), SCHED_IDLE);
        CHECK_INT_EQ(getpriority(PRIO_PROCESS, (id_t)tid), base_nice + 3 > 19 ? 19 : base_nice + 3);
        placed++;
    }
    if (d)
        closedir(d);
    CHECK_INT_EQ(placed, 2); /* the pool's helper and the queue thread */
    /* the creating thread keeps its own settings */
    CHECK_INT_EQ(sched_getscheduler(0), SCHED_OTHER);
    wmat w = make_w(SH_DTYPE_Q4_0, 64, 128);
    float x[2 * 128], y[2 * 64], ry[2 * 64];
    fill(x, 2 * 128, 1.0f);
    sh_backend *ref = make(SH_BACKEND_CPU_ISA_SCALAR, 1);
    sh_backend_stream *s, *rs;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    CHECK_OK(sh_backend_stream_create(ref, &rs, NULL));
    CHECK_OK(sh_backend_matmul(be, s, &w.t, x, 2, y));
    CHECK_OK(sh_backend_matmul(ref, rs, &w.t, x, 2, ry));
    CHECK_OK(sh_backend_sync(be, s));
    CHECK_OK(sh_backend_sync(ref, rs));
    for (int i = 0; i < 2 * 64; i++)
        CHECK_NEAR(y[i], ry[i], 1e-3);
    sh_backend_stream_destroy(be, s);
    sh_backend_stream_destroy(ref, rs);
    sh_backend_destroy(be);
    sh_backend_destroy(ref);
    free_w(&w);
    const sh_backend_cpu_opts bad[] = {{.n_threads = 1, .sched = 3},
                                       {.n_threads = 1, .nice = 20},
                                       {.n_threads = 1, .nice = -1},
                                       {.n_threads = 1, .cpu_mask = (uint64_t)1 << 63}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        be = NULL;
        CHECK_INT_EQ(sh_backend_cpu_create(&bad[i], &be, &e), SH_EINVAL);
        CHECK(be == NULL);
    }
#endif
}

int main(int argc, char **argv)
{
    static const sh_test_case tests[] = {
        {"matmul_vs_ref", test_matmul_vs_ref},
        {"matmul_fused", test_matmul_fused},
        {"threads_identical", test_threads_identical},
        {"rowwise_ops", test_rowwise_ops},
        {"invalid_args", test_invalid_args},
        {"isa_selected", test_isa_selected},
        {"isa_override", test_isa_override},
        {"thread_placement", test_thread_placement},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
