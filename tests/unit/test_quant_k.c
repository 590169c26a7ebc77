/* Unit tests of the K-quants' scalar reference (kernels/cpu/quant_k.c, through quant.h): round
 * trips with per-type error bounds on fresh random data, refusals of ragged rows, all-zero and
 * constant blocks, and hand-built blocks with known values. The bit-exact comparison with an
 * independent dequantizer is test_quant_k_gguf.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_k.h"
#include "sh_test.h"

static const sh_dtype k_types[] = {SH_DTYPE_Q2_K, SH_DTYPE_Q3_K, SH_DTYPE_Q4_K,
                                   SH_DTYPE_Q5_K, SH_DTYPE_Q6_K, SH_DTYPE_Q8_K};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

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

/* Per-block scale varies over five decades; some blocks are shifted (all positive or mostly
 * negative, which exercises the mins) and a few carry one outlier. Never zeros. */
static void fill_random(float *x, int64_t n)
{
    for (int64_t b = 0; b < n / SH_QK_K; b++) {
        float scale = (float)pow(10.0, -3.0 + 5.0 * rng_unit());
        float shift = (rng_next() % 4 == 0) ? scale * (float)(rng_unit() * 4.0 - 2.0) : 0.0f;
        float *xb = x + b * SH_QK_K;
        for (int j = 0; j < SH_QK_K; j++)
            xb[j] = rng_normal() * scale + shift;
        if (rng_next() % 8 == 0)
            xb[rng_next() % SH_QK_K] = scale * 12.0f;
    }
}

/* Bounds on one super-block's error, from the types' step sizes with margin over what the
 * reference achieves on this data (about 1.4x the worst over 60 seeds): the RMS error relative
 * to the block's RMS about zero, and the largest error relative to the block's largest
 * magnitude. Blocks with an outlier dominate both. */
typedef struct bounds {
    double rel_rms;
    double rel_max;
} bounds;

static bounds type_bounds(sh_dtype t)
{
    switch (t) {
    case SH_DTYPE_Q2_K:
        return (bounds){0.65, 0.55};
    case SH_DTYPE_Q3_K:
        return (bounds){0.35, 0.30};
    case SH_DTYPE_Q4_K:
        return (bounds){0.16, 0.14};
    case SH_DTYPE_Q5_K:
        return (bounds){0.08, 0.085};
    case SH_DTYPE_Q6_K:
        return (bounds){0.05, 0.055};
    default: /* Q8_K: each element within half a step (amax / 127) but for float rounding */
        return (bounds){0.05, 0.5 / 127 + 1e-5};
    }
}

static double worst_rms[N_TYPES], worst_max[N_TYPES];

static void check_block(size_t ti, const float *x, const float *y, int64_t b)
{
    double sx2 = 0, se2 = 0, amax = 0, emax = 0;
    for (int j = 0; j < SH_QK_K; j++) {
        double e = fabs((double)x[j] - y[j]);
        sx2 += (double)x[j] * x[j];
        se2 += e * e;
        amax = fmax(amax, fabs(x[j]));
        emax = fmax(emax, e);
    }
    double rel_rms = sqrt(se2 / sx2), rel_max = emax / amax;
    worst_rms[ti] = fmax(worst_rms[ti], rel_rms);
    worst_max[ti] = fmax(worst_max[ti], rel_max);
    bounds bd = type_bounds(k_types[ti]);
    if (!(rel_rms <= bd.rel_rms) || !(rel_max <= bd.rel_max))
        SH_FAIL_("%s block %lld: relative rms error %.4g (bound %.4g), max %.4g (bound %.4g)",
                 sh__dtype_name(k_types[ti]), (long long)b, rel_rms, bd.rel_rms, rel_max,
                 bd.rel_max);
}

static void test_round_trip(void)
{
    static const int64_t sizes[] = {256, 512, 256 * 61};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
        size_t cap = (size_t)n * 2 + 64;
        uint8_t *q = malloc(cap), *q2 = malloc(cap);
        fill_random(x, n);
        for (size_t t = 0; t < N_TYPES; t++) {
            sh_dtype ty = k_types[t];
            uint64_t bytes = sh__dtype_row_bytes(ty, (uint64_t)n);
            CHECK(bytes > 0 && bytes < cap);
            memset(q, 0xa5, cap);
            CHECK_OK(sh__quant_row(ty, x, q, n));
            CHECK_UINT_EQ(q[bytes], 0xa5); /* nothing written past the row */
            CHECK_OK(sh__dequant_row(ty, q, y, n));
            for (int64_t b = 0; b < n / SH_QK_K; b++)
                check_block(t, x + b * SH_QK_K, y + b * SH_QK_K, b);
            CHECK_OK(sh__quant_row(ty, x, q2, n)); /* deterministic */
            CHECK(memcmp(q, q2, (size_t)bytes) == 0);
        }
        free(x);
        free(y);
        free(q);
        free(q2);
    }
    for (size_t t = 0; t < N_TYPES; t++)
        printf("  %s: worst relative rms error %.4f, worst max error %.4f of amax\n",
               sh__dtype_name(k_types[t]), worst_rms[t], worst_max[t]);
}

/* Q8_K's bsums are the sums of each 16 quants; its scale maps the signed extreme to -127. */
static void test_q8_k_sums(void)
{
    float x[SH_QK_K * 3];
    fill_random(x, SH_QK_K * 3);
    sh_block_q8_k b[3];
    CHECK_OK(sh__quant_row(SH_DTYPE_Q8_K, x, b, SH_QK_K * 3));
    for (int i = 0; i < 3; i++) {
        int has_extreme = 0;
        for (int g = 0; g < SH_QK_K / 16; g++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) {
                sum += b[i].qs[16 * g + l];
                has_extreme |= b[i].qs[16 * g + l] == -127;
            }
            CHECK_INT_EQ(b[i].bsums[g], sum);
        }
        CHECK(has_extreme);
    }
}

/* n not a multiple of 256 is refused, and nothing is written. */
static void test_ragged(void)
{
    static const int64_t bad[] = {1, 32, 128, 255, 257, 256 + 32, -256};
    float x[SH_QK_K * 2] = {0};
    fill_random(x, SH_QK_K * 2);
    uint8_t q[1024];
    float y[SH_QK_K * 2];
    for (size_t t = 0; t < N_TYPES; t++) {
        sh_dtype ty = k_types[t];
        CHECK(sh__quant_supported(ty));
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(q, 0x5a, sizeof q);
            for (int j = 0; j < SH_QK_K * 2; j++)
                y[j] = 7.0f;
            CHECK_INT_EQ(sh__quant_row(ty, x, q, bad[i]), SH_EINVAL);
            CHECK_INT_EQ(sh__dequant_row(ty, q, y, bad[i]), SH_EINVAL);
            CHECK_UINT_EQ(q[0], 0x5a);
            CHECK(y[0] == 7.0f);
        }
        CHECK_INT_EQ(sh__quant_row(ty, x, q, 0), SH_OK);
        CHECK_INT_EQ(sh__dequant_row(ty, q, y, 0), SH_OK);
    }
    CHECK(!sh__quant_supported(SH_DTYPE_IQ3_S));
}

/* All-zero input gives all-zero blocks and exact zeros back; a constant block comes back within
 * its type's bound (the asymmetric types carry it in the min, the symmetric in the scale). */
static void test_zero_and_constant(void)
{
    float x[SH_QK_K], y[SH_QK_K];
    uint8_t q[512];
    for (size_t t = 0; t < N_TYPES; t++) {
        sh_dtype ty = k_types[t];
        uint64_t bytes = sh__dtype_row_bytes(ty, SH_QK_K);
        memset(x, 0, sizeof x);
        memset(q, 0xff, sizeof q);
        CHECK_OK(sh__quant_row(ty, x, q, SH_QK_K));
        CHECK_OK(sh__dequant_row(ty, q, y, SH_QK_K));
        for (int j = 0; j < SH_QK_K; j++)
            if (y[j] != 0.0f) {
                SH_FAIL_("%s: zero input gave %g at %d", sh__dtype_name(ty), y[j], j);
                break;
            }
        if (ty == SH_DTYPE_Q6_K || ty == SH_DTYPE_Q8_K)
            for (uint64_t i = 0; i < bytes; i++)
                if (q[i] != 0) {
                    SH_FAIL_("%s: zero input left byte %llu = %u", sh__dtype_name(ty),
                             (unsigned long long)i, q[i]);
                    break;
                }
        for (int j = 0; j < SH_QK_K; j++)
            x[j] = -0.7f;
        CHECK_OK(sh__quant_row(ty, x, q, SH_QK_K));
        CHECK_OK(sh__dequant_row(ty, q, y, SH_QK_K));
        for (int j = 0; j < SH_QK_K; j++)
            CHECK_NEAR(y[j], -0.7f, 0.7 * type_bounds(ty).rel_max);
    }
}

/* Hand-built blocks whose values follow from the layouts by hand. */
static void test_known_blocks(void)
{
    float y[SH_QK_K];

    /* Q2_K: d = 1, dmin = 1; sub-block 0 scale 2 min 3, sub-block 1 scale 5 min 1. Element 0 is
     * qs[0] bits 0-1, element 16 qs[16] bits 0-1, element 32 qs[0] bits 2-3. */
    sh_block_q2_k b2;
    memset(&b2, 0, sizeof b2);
    b2.d = 0x3c00;
    b2.dmin = 0x3c00;
    b2.scales[0] = 0x32;
    b2.scales[1] = 0x15;
    b2.scales[2] = 0x01;
    b2.qs[0] = 0x03 | (0x02 << 2);
    b2.qs[16] = 0x01;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q2_K, &b2, y, SH_QK_K));
    CHECK(y[0] == 2 * 3 - 3);
    CHECK(y[16] == 5 * 1 - 1);
    CHECK(y[32] == 1 * 2 - 0);
    CHECK(y[1] == -3);

    /* Q3_K: d = 2; scale 0 = (5 | 2 << 4) - 32 = 5; element 0 has low bits 3 and a clear hmask
     * bit, so q = 3 - 4 = -1; element 32 (scale 2, low bits from qs[0] bits 2-3, hmask bit 1). */
    sh_block_q3_k b3;
    memset(&b3, 0, sizeof b3);
    b3.d = 0x4000;
    b3.scales[0] = 0x05;
    b3.scales[8] = 0x02;
    b3.scales[2] = 0x01;
    b3.scales[10] = 0x02; /* scale 2 = (1 | 2 << 4) - 32 = 1 */
    b3.qs[0] = 0x03 | (0x01 << 2);
    b3.hmask[0] = 0x02;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q3_K, &b3, y, SH_QK_K));
    CHECK(y[0] == 2.0f * 5 * -1);
    CHECK(y[32] == 2.0f * 1 * 1);
    CHECK(y[1] == 2.0f * 5 * -4);

    /* Q4_K: d = 1, dmin = 0.5; sub-block 0 scale 1 min 2, sub-block 1 scale 3 min 4; sub-block 4
     * scale 1 | 1 << 4 = 17 (its top bits in byte 0) and min 2. */
    sh_block_q4_k b4;
    memset(&b4, 0, sizeof b4);
    b4.d = 0x3c00;
    b4.dmin = 0x3800;
    b4.scales[0] = 0x41;
    b4.scales[4] = 0x02;
    b4.scales[1] = 0x03;
    b4.scales[5] = 0x04;
    b4.scales[8] = 0x21;
    b4.qs[0] = 0x73;
    b4.qs[64] = 0x05;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q4_K, &b4, y, SH_QK_K));
    CHECK(y[0] == 1 * 3 - 0.5f * 2);
    CHECK(y[32] == 3 * 7 - 0.5f * 4);
    CHECK(y[128] == 17 * 5 - 0.5f * 2);

    /* Q5_K: the same scales; qh[0] bit 0 adds 16 to element 0, bit 1 to element 32. */
    sh_block_q5_k b5;
    memset(&b5, 0, sizeof b5);
    b5.d = b4.d;
    b5.dmin = b4.dmin;
    memcpy(b5.scales, b4.scales, sizeof b5.scales);
    b5.qs[0] = 0x73;
    b5.qh[0] = 0x01;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q5_K, &b5, y, SH_QK_K));
    CHECK(y[0] == 1 * (3 + 16) - 0.5f * 2);
    CHECK(y[32] == 3 * 7 - 0.5f * 4);

    /* Q6_K: d = 0.25; element 0 = low nibble of ql[0] | qh[0] bits 0-1 << 4, minus 32;
     * element 64 = high nibble of ql[0] | qh[0] bits 4-5 << 4, minus 32, with scale 4. */
    sh_block_q6_k b6;
    memset(&b6, 0, sizeof b6);
    b6.d = 0x3400;
    b6.scales[0] = -3;
    b6.scales[4] = 2;
    b6.ql[0] = 0x21;
    b6.qh[0] = 0x02;
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q6_K, &b6, y, SH_QK_K));
    CHECK(y[0] == 0.25f * -3 * ((1 | 2 << 4) - 32));
    CHECK(y[64] == 0.25f * 2 * (2 - 32));

    /* Q8_K: integers from -127 to 127 with -127 first quantize with scale 1 exactly. */
    float x[SH_QK_K];
    for (int j = 0; j < SH_QK_K; j++)
        x[j] = (float)(j % 255 - 127);
    sh_block_q8_k b8;
    CHECK_OK(sh__quant_row(SH_DTYPE_Q8_K, x, &b8, SH_QK_K));
    CHECK(b8.d == 1.0f);
    for (int j = 0; j < SH_QK_K; j++)
        CHECK_INT_EQ(b8.qs[j], (int)x[j]);
    CHECK_INT_EQ(b8.bsums[0], (-127 - 112) * 8);
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q8_K, &b8, y, SH_QK_K));
    CHECK(memcmp(x, y, sizeof x) == 0);
}

static const sh_test_case tests[] = {
    {"round_trip", test_round_trip},
    {"q8_k_sums", test_q8_k_sums},
    {"ragged", test_ragged},
    {"zero_and_constant", test_zero_and_constant},
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
