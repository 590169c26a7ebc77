/* The K-quant dot products (kernels/cpu/ops_k_ref.c, ops_k_avx2.c): the scalar reference against
 * the float dot product of the dequantized rows, and every fast integer kernel against the
 * reference's integers (exactly) and dot products (bit for bit), on fresh random rows. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_k.h"
#include "sh_test.h"

/* xorshift64*, seeded from the clock so every run sees fresh data; the seed is printed. */
static uint64_t rng_state;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
/* Uniform in (-1, 1), never exactly zero. */
static float rng_sym(void) { return ((float)((rng_next() >> 40) + 1) / 16777217.0f) * 2.0f - 1.0f; }

static const sh_dtype types[] = {SH_DTYPE_Q4_K, SH_DTYPE_Q6_K, SH_DTYPE_Q5_K,
                                 SH_DTYPE_Q3_K, SH_DTYPE_Q2_K, SH_DTYPE_IQ4_XS};
static const char *const type_names[] = {"Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS"};
#define N_TYPES 6

/* Row lengths: one super-block up to a large row, and lengths that end in a partial chunk of the
 * float part (16 super-blocks). */
static const int64_t lens[] = {256, 512, 768, 4096, 4352, 11008, 16384};
#define N_LENS 7

/* A random finite fp16 scale of magnitude in [2^-14, 2^-2] (never zero). */
static uint16_t rand_half(void)
{
    float v = ldexpf(0.5f + 0.5f * fabsf(rng_sym()), -(int)(rng_next() % 13) - 2);
    return sh__quant_fp16_from_f32(rng_next() & 1 ? v : -v);
}

/* A weight row of n elements: mode 0 quantizes random floats (what files hold), mode 1 is random
 * bytes everywhere (every code and scale pattern) with finite random d and dmin. */
static void make_w(sh_dtype type, int64_t n, uint8_t *w, int mode)
{
    const int64_t nb = n / SH_QK_K;
    const size_t bsz = sh__dtype_row_bytes(type, SH_QK_K);
    if (mode == 0) {
        float *x = malloc((size_t)n * sizeof *x);
        for (int64_t b = 0; b < nb; b++) {
            const float scale = ldexpf(1.0f, (int)(rng_next() % 8) - 4);
            const float shift = rng_next() % 4 == 0 ? scale * rng_sym() : 0.0f;
            for (int i = 0; i < SH_QK_K; i++)
                x[b * SH_QK_K + i] = rng_sym() * scale + shift;
        }
        CHECK_OK(sh__quant_row(type, x, w, n));
        free(x);
        return;
    }
    for (size_t i = 0; i < (size_t)nb * bsz; i++)
        w[i] = (uint8_t)rng_next();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * bsz;
        uint16_t d = rand_half(), dm = rand_half();
        switch (type) {
        case SH_DTYPE_Q2_K:
            memcpy(blk + offsetof(sh_block_q2_k, d), &d, 2);
            memcpy(blk + offsetof(sh_block_q2_k, dmin), &dm, 2);
            break;
        case SH_DTYPE_Q3_K:
            memcpy(blk + offsetof(sh_block_q3_k, d), &d, 2);
            break;
        case SH_DTYPE_Q4_K:
        case SH_DTYPE_Q5_K:
            memcpy(blk + offsetof(sh_block_q4_k, d), &d, 2);
            memcpy(blk + offsetof(sh_block_q4_k, dmin), &dm, 2);
            break;
        case SH_DTYPE_IQ4_XS:
            memcpy(blk + offsetof(sh_block_iq4_xs, d), &d, 2);
            break;
        default:
            memcpy(blk + offsetof(sh_block_q6_k, d), &d, 2);
            break;
        }
    }
}

/* An activation row: random floats quantized to Q8_K; mode 1 then replaces the codes by random
 * bytes (-128 included) and recomputes the bsums, as the fast kernels require. */
static void make_a(int64_t n, sh_block_q8_k *a, int mode)
{
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_sym() * (float)(1 + rng_next() % 5);
    CHECK_OK(sh__quant_row(SH_DTYPE_Q8_K, x, a, n));
    free(x);
    if (mode == 0)
        return;
    for (int64_t b = 0; b < n / SH_QK_K; b++) {
        for (int i = 0; i < SH_QK_K; i++)
            a[b].qs[i] = (int8_t)(uint8_t)rng_next();
        for (int j = 0; j < SH_QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++)
                s += a[b].qs[16 * j + i];
            a[b].bsums[j] = (int16_t)s;
        }
    }
}

/* The reference's dot product against the dequantized rows' dot product, summed in double:
 * |ref - exact| <= 2e-6 * sum_k |w_k a_k| + 1e-30. The reference is exact in its integers and
 * rounds only dw * ints, dmin * ints, their difference, the product with da and the running sum
 * (one rounding each per super-block), against dequantization's roundings per element (d * sc,
 * dmin * m, their products with q). */
static void test_ref_vs_dequant(void)
{
    for (int t = 0; t < N_TYPES; t++)
        for (int li = 0; li < N_LENS; li++)
            for (int mode = 0; mode < 2; mode++) {
                const int64_t n = lens[li], nb = n / SH_QK_K;
                uint8_t *w = malloc(sh__dtype_row_bytes(types[t], (uint64_t)n));
                sh_block_q8_k *a = malloc((size_t)nb * sizeof *a);
                float *wf = malloc((size_t)n * sizeof *wf), *af = malloc((size_t)n * sizeof *af);
                make_w(types[t], n, w, mode);
                make_a(n, a, mode);
                CHECK_OK(sh__dequant_row(types[t], w, wf, n));
                CHECK_OK(sh__dequant_row(SH_DTYPE_Q8_K, a, af, n));
                double exact = 0.0, mag = 0.0;
                for (int64_t k = 0; k < n; k++) {
                    exact += (double)wf[k] * (double)af[k];
                    mag += fabs((double)wf[k] * (double)af[k]);
                }
                CHECK(mag > 0.0);
                const float got = sh__cpu_dot_k(
                    sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, types[t]), types[t], w, a, nb);
                const double tol = 2e-6 * mag + 1e-30;
                if (!(fabs((double)got - exact) <= tol))
                    SH_FAIL_("%s n=%lld mode %d: ref %.9g vs dequantized %.9g (tolerance %.3g)",
                             type_names[t], (long long)n, mode, got, exact, tol);
                free(w);
                free(a);
                free(wf);
                free(af);
            }
}

/* Every fast kernel: the integers equal the reference's, so the dot products are identical
 * (tolerance 0: the float part is one shared function). */
static void check_fast(int32_t isa, const char *isa_name)
{
    for (int t = 0; t < N_TYPES; t++) {
        sh__cpu_k_ints_fn ref = sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, types[t]);
        sh__cpu_k_ints_fn fast = sh__cpu_k_ints_for(isa, types[t]);
        CHECK(ref != NULL && fast != NULL);
        if (!ref || !fast)
            continue;
        CHECK(fast != ref);
        for (int li = 0; li < N_LENS; li++)
            for (int mode = 0; mode < 2; mode++) {
                const int64_t n = lens[li], nb = n / SH_QK_K;
                uint8_t *w = malloc(sh__dtype_row_bytes(types[t], (uint64_t)n));
                sh_block_q8_k *a = malloc((size_t)nb * sizeof *a);
                int32_t *ir = malloc((size_t)(2 * nb) * sizeof *ir);
                int32_t *ifast = malloc((size_t)(2 * nb) * sizeof *ifast);
                make_w(types[t], n, w, mode);
                make_a(n, a, mode);
                ref(w, a, nb, ir);
                fast(w, a, nb, ifast);
                int bad = 0;
                for (int64_t i = 0; i < 2 * nb && bad < 3; i++)
                    if (ir[i] != ifast[i]) {
                        SH_FAIL_("%s %s n=%lld mode %d: ints[%lld] %d (ref) != %d (%s)", isa_name,
                                 type_names[t], (long long)n, mode, (long long)i, ir[i], ifast[i],
                                 isa_name);
                        bad++;
                    }
                const float dr = sh__cpu_dot_k(ref, types[t], w, a, nb);
                const float df = sh__cpu_dot_k(fast, types[t], w, a, nb);
                if (memcmp(&dr, &df, sizeof dr) != 0)
                    SH_FAIL_("%s %s n=%lld mode %d: dot %.9g (ref) != %.9g", isa_name,
                             type_names[t], (long long)n, mode, dr, df);
                free(w);
                free(a);
                free(ir);
                free(ifast);
            }
    }
}

static int skipped;

static void test_avx2(void)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX2 || !sh__cpu_k_ints_avx2(SH_DTYPE_Q4_K)) {
        fprintf(stderr, "skip: this CPU (or build) has no AVX2\n");
        skipped = 1;
        return;
    }
    check_fast(SH_BACKEND_CPU_ISA_AVX2, "avx2");
}

/* The AVX-512 table: its own Q4_K and Q6_K kernels, the AVX2 ones for Q2_K, Q3_K and Q5_K. */
static void test_avx512(void)
{
    if (sh__cpu_isa_detect() < SH_BACKEND_CPU_ISA_AVX512 || !sh__cpu_k_ints_avx512(SH_DTYPE_Q4_K)) {
        fprintf(stderr, "skip: this CPU (or build) has no AVX-512\n");
        skipped = 1;
        return;
    }
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_AVX512, SH_DTYPE_Q4_K) ==
          sh__cpu_k_ints_avx512(SH_DTYPE_Q4_K));
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_AVX512, SH_DTYPE_Q6_K) ==
          sh__cpu_k_ints_avx512(SH_DTYPE_Q6_K));
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_AVX512, SH_DTYPE_Q5_K) ==
          sh__cpu_k_ints_avx2(SH_DTYPE_Q5_K));
    check_fast(SH_BACKEND_CPU_ISA_AVX512, "avx512");
}

/* The dispatch knows the five weight types and nothing else. */
static void test_dispatch(void)
{
    for (int t = 0; t < N_TYPES; t++)
        CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, types[t]) != NULL);
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, SH_DTYPE_Q8_K) == NULL);
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_AVX2, SH_DTYPE_Q4_0) == NULL);
    CHECK(sh__cpu_k_ints_for(SH_BACKEND_CPU_ISA_SCALAR, SH_DTYPE_F32) == NULL);
}

/* The cases that need nothing of the CPU (ctest runs them apart from the AVX2 one, which may skip).
 */
static void test_ref(void)
{
    test_dispatch();
    test_ref_vs_dequant();
}

static const sh_test_case tests[] = {
    {"ref", test_ref},
    {"avx2", test_avx2},
    {"avx512", test_avx512},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    rng_state = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull | 1;
    if (getenv("SH_TEST_SEED"))
        rng_state = strtoull(getenv("SH_TEST_SEED"), NULL, 0) | 1;
    printf("seed %llu (SH_TEST_SEED to repeat)\n", (unsigned long long)rng_state);
    int rc = sh_test_main(argc, argv, tests);
    /* Only the SIMD cases can be skipped: 77 when one was and everything that ran passed. */
    if (rc == 0 && skipped && argc > 1 &&
        (strcmp(argv[1], "avx2") == 0 || strcmp(argv[1], "avx512") == 0))
        return SH_TEST_SKIP;
    return rc;
}
