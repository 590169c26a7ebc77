/* Unit tests of the Q5_0 / Q5_1 scalar reference (kernels/cpu/quant.c): round trips with error
 * bounds on fresh random data, refusals of ragged rows, zero and constant blocks, the rounding
 * of quantize_row_q5_*_ref on exact inputs, and hand-built blocks with known values. The bit-exact
 * comparison with an independent implementation is test_quant_k_gguf.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "kernels/cpu/quant.h"
#include "sh_test.h"

static const sh_dtype q5_types[] = {SH_DTYPE_Q5_0, SH_DTYPE_Q5_1};
#define N_TYPES (sizeof q5_types / sizeof q5_types[0])
#define QK 32

/* xorshift64*, seeded from the clock so every run sees fresh data; the seed is printed. */
static uint64_t rng_state;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
static double rng_unit(void) { return ((double)(rng_next() >> 11) + 0.5) / 9007199254740992.0; }
static float rng_normal(void)
{
    return (float)(sqrt(-2.0 * log(rng_unit())) * cos(6.283185307179586 * rng_unit()));
}

/* Per-block scale over five decades; some blocks shifted (all one sign, which exercises Q5_1's
 * minimum) and a few carry one outlier. Never zeros. */
static void fill_random(float *x, int64_t n)
{
    for (int64_t b = 0; b < n / QK; b++) {
        float scale = (float)pow(10.0, -3.0 + 5.0 * rng_unit());
        float shift = (rng_next() % 4 == 0) ? scale * (float)(rng_unit() * 4.0 - 2.0) : 0.0f;
        float *xb = x + b * QK;
        for (int j = 0; j < QK; j++)
            xb[j] = rng_normal() * scale + shift;
        if (rng_next() % 8 == 0)
            xb[rng_next() % QK] = scale * 12.0f;
    }
}

/* Each element is within half a step of its value, but for the fp16 rounding of the scale (and
 * of Q5_1's minimum), which moves the grid by up to 2^-11 relative per step. Q5_0's step is
 * amax / 16, Q5_1's (max - min) / 31. Q5_0 has one more exception: values of the sign opposite
 * to the extreme beyond 15.5 steps want code 32 and are clamped to 31 (15 steps). */
static double step_of(sh_dtype t, const float *x)
{
    float amax = 0, mn = x[0], mx = x[0];
    for (int j = 0; j < QK; j++) {
        amax = fmaxf(amax, fabsf(x[j]));
        mn = fminf(mn, x[j]);
        mx = fmaxf(mx, x[j]);
    }
    return t == SH_DTYPE_Q5_0 ? amax / 16.0 : (mx - mn) / 31.0;
}

static double worst[N_TYPES];

static void check_block(size_t ti, const float *x, const float *y, int64_t b)
{
    sh_dtype t = q5_types[ti];
    double step = step_of(t, x), amax = 0;
    for (int j = 0; j < QK; j++)
        amax = fmax(amax, fabs(x[j]));
    /* half a step, plus the fp16 rounding of d (2^-11 relative, times up to 16 or 31 steps) and
     * of Q5_1's minimum (2^-11 of |min| <= amax) */
    double slack = step * 32 * 0x1p-11 + (t == SH_DTYPE_Q5_1 ? amax * 0x1p-11 : 0.0);
    for (int j = 0; j < QK; j++) {
        double e = fabs((double)x[j] - y[j]);
        double a = fabs(x[j]);
        double base = (t == SH_DTYPE_Q5_0 && a > 15.5 * step) ? a - 15 * step : 0.5 * step;
        double bound = base * (1 + 1e-6) + slack;
        worst[ti] = fmax(worst[ti], step > 0 ? e / step : 0);
        if (!(e <= bound)) {
            SH_FAIL_("%s block %lld element %d: x %.9g y %.9g error %.4g (bound %.4g)",
                     sh__dtype_name(t), (long long)b, j, x[j], y[j], e, bound);
            return;
        }
    }
}

static void test_round_trip(void)
{
    static const int64_t sizes[] = {32, 64, 32 * 997};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
        size_t cap = (size_t)n + 64;
        uint8_t *q = malloc(cap), *q2 = malloc(cap);
        fill_random(x, n);
        for (size_t t = 0; t < N_TYPES; t++) {
            sh_dtype ty = q5_types[t];
            uint64_t bytes = sh__dtype_row_bytes(ty, (uint64_t)n);
            CHECK(bytes > 0 && bytes < cap);
            CHECK_UINT_EQ(bytes, (uint64_t)(n / QK) * (ty == SH_DTYPE_Q5_0 ? 22u : 24u));
            memset(q, 0xa5, cap);
            CHECK_OK(sh__quant_row(ty, x, q, n));
            CHECK_UINT_EQ(q[bytes], 0xa5); /* nothing written past the row */
            CHECK_OK(sh__dequant_row(ty, q, y, n));
            for (int64_t b = 0; b < n / QK; b++)
                check_block(t, x + b * QK, y + b * QK, b);
            CHECK_OK(sh__quant_row(ty, x, q2, n)); /* deterministic */
            CHECK(memcmp(q, q2, (size_t)bytes) == 0);
        }
        free(x);
        free(y);
        free(q);
        free(q2);
    }
    for (size_t t = 0; t < N_TYPES; t++)
        printf("  %s: worst error %.4f of a step\n", sh__dtype_name(q5_types[t]), worst[t]);
}

/* n not a multiple of 32 is refused, and nothing is written. */
static void test_ragged(void)
{
    static const int64_t bad[] = {1, 16, 31, 33, 48, 32 * 3 + 1, -32};
    float x[QK * 4];
    fill_random(x, QK * 4);
    uint8_t q[256];
    float y[QK * 4];
    for (size_t t = 0; t < N_TYPES; t++) {
        sh_dtype ty = q5_types[t];
        CHECK(sh__quant_supported(ty));
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(q, 0x5a, sizeof q);
            for (int j = 0; j < QK * 4; j++)
                y[j] = 7.0f;
            CHECK_INT_EQ(sh__quant_row(ty, x, q, bad[i]), SH_EINVAL);
            CHECK_INT_EQ(sh__dequant_row(ty, q, y, bad[i]), SH_EINVAL);
            CHECK_UINT_EQ(q[0], 0x5a);
            CHECK(y[0] == 7.0f);
        }
        CHECK_INT_EQ(sh__quant_row(ty, x, q, 0), SH_OK);
        CHECK_INT_EQ(sh__dequant_row(ty, q, y, 0), SH_OK);
    }
}

/* All-zero input: d = -0 and (Q5_0) every code 16, (Q5_1) every code 0, exact zeros back. A
 * constant block: Q5_0 maps it to code 0 with d = -c / 16 (exact for c = -0.75), Q5_1 carries
 * it in the minimum with d = 0. */
static void test_zero_and_constant(void)
{
    float x[QK], y[QK];
    sh_block_q5_0 b0;
    sh_block_q5_1 b1;

    memset(x, 0, sizeof x);
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_0, x, &b0, QK));
    CHECK_UINT_EQ(b0.d, 0x8000); /* 0 / -16 is -0, as in ggml */
    for (int j = 0; j < 4; j++)
        CHECK_UINT_EQ(b0.qh[j], 0xff); /* code 16 = fifth bit set, low nibble 0 */
    for (int j = 0; j < QK / 2; j++)
        CHECK_UINT_EQ(b0.qs[j], 0);
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_0, &b0, y, QK));
    for (int j = 0; j < QK; j++)
        CHECK(y[j] == 0.0f);
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_1, x, &b1, QK));
    CHECK(b1.d == 0 && b1.m == 0);
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_1, &b1, y, QK));
    for (int j = 0; j < QK; j++)
        CHECK(y[j] == 0.0f);

    for (int j = 0; j < QK; j++)
        x[j] = -0.75f;
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_0, x, &b0, QK));
    CHECK_UINT_EQ(b0.d, sh__quant_fp16_from_f32(0.75f / 16));
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_0, &b0, y, QK));
    for (int j = 0; j < QK; j++)
        CHECK(y[j] == -0.75f);
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_1, x, &b1, QK));
    CHECK_UINT_EQ(b1.d, 0);
    CHECK_UINT_EQ(b1.m, sh__quant_fp16_from_f32(-0.75f));
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_1, &b1, y, QK));
    for (int j = 0; j < QK; j++)
        CHECK(y[j] == -0.75f);
}

/* Exact inputs whose codes follow from the reference rounding by hand. Q5_0: the extreme -16
 * gives d = 1, so x = k lands on code k + 16, and the positive extreme 16 would be code 32,
 * clamped to 31; halves round up (x = 0.5 -> 16.5 + 0.5 = 17 after truncation). Q5_1: min 0,
 * max 31 gives d = 1 and code = x; 2.5 rounds up to 3. */
static void test_rounding(void)
{
    float x[QK], y[QK];
    sh_block_q5_0 b0;
    for (int j = 0; j < QK; j++)
        x[j] = (float)(j - 15);
    x[0] = -16.0f; /* the extreme: d = -16 / -16 = 1 */
    x[31] = 16.0f; /* a tie in magnitude with x[0]; the first one wins, so d stays 1 */
    x[20] = 0.5f;  /* 0.5 + 16.5 = 17 */
    x[21] = -0.5f; /* -0.5 + 16.5 = 16 */
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_0, x, &b0, QK));
    CHECK_UINT_EQ(b0.d, 0x3c00);
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_0, &b0, y, QK));
    for (int j = 0; j < QK; j++) {
        float want = j == 31 ? 15.0f : j == 20 ? 1.0f : j == 21 ? 0.0f : x[j];
        CHECK(y[j] == want);
    }

    sh_block_q5_1 b1;
    for (int j = 0; j < QK; j++)
        x[j] = (float)((j * 7) % 32); /* a permutation of 0..31 */
    x[5] = 2.5f;                      /* (5 * 7) % 32 = 3 was here; 2.5 rounds up to 3 */
    CHECK_OK(sh__quant_row(SH_DTYPE_Q5_1, x, &b1, QK));
    CHECK_UINT_EQ(b1.d, 0x3c00);
    CHECK_UINT_EQ(b1.m, 0);
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_1, &b1, y, QK));
    for (int j = 0; j < QK; j++)
        CHECK(y[j] == (j == 5 ? 3.0f : x[j]));
}

/* Hand-built blocks: element j's low nibble in qs[j % 16] (low half for j < 16), its fifth bit
 * in bit j of qh read little-endian. */
static void test_known_blocks(void)
{
    float y[QK];
    sh_block_q5_0 b0;
    memset(&b0, 0, sizeof b0);
    b0.d = 0x4000;   /* 2 */
    b0.qs[0] = 0xf3; /* element 0 low bits 3, element 16 low bits 15 */
    b0.qs[15] = 0x1a;
    b0.qh[0] = 0x01; /* element 0 fifth bit */
    b0.qh[2] = 0x01; /* element 16 */
    b0.qh[3] = 0x80; /* element 31 */
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_0, &b0, y, QK));
    CHECK(y[0] == 2.0f * ((3 | 16) - 16));
    CHECK(y[16] == 2.0f * ((15 | 16) - 16));
    CHECK(y[15] == 2.0f * (10 - 16));
    CHECK(y[31] == 2.0f * ((1 | 16) - 16));
    CHECK(y[1] == 2.0f * -16);

    sh_block_q5_1 b1;
    memset(&b1, 0, sizeof b1);
    b1.d = 0x3800; /* 0.5 */
    b1.m = 0xc000; /* -2 */
    b1.qs[0] = 0xf3;
    b1.qs[15] = 0x1a;
    b1.qh[0] = 0x01;
    b1.qh[2] = 0x01;
    b1.qh[3] = 0x80;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_1, &b1, y, QK));
    CHECK(y[0] == 0.5f * 19 - 2);
    CHECK(y[16] == 0.5f * 31 - 2);
    CHECK(y[15] == 0.5f * 10 - 2);
    CHECK(y[31] == 0.5f * 17 - 2);
    CHECK(y[1] == -2.0f);
}

static const sh_test_case tests[] = {
    {"round_trip", test_round_trip},
    {"ragged", test_ragged},
    {"zero_and_constant", test_zero_and_constant},
    {"rounding", test_rounding},
    {"known_blocks", test_known_blocks},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    rng_state = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull | 1;
    if (getenv("SH_TEST_SEED"))
        rng_state = strtoull(getenv("SH_TEST_SEED"), NULL, 0) | 1;
    printf("seed %llu (SH_TEST_SEED to repeat)\n", (unsigned long long)rng_state);
    return sh_test_main(argc, argv, tests);
}
