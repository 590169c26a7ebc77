/* Unit tests of the scalar fp16/bf16 conversions and the row quantizers (kernels/cpu/quant.c). */
#include <float.h>
#include <stdint.h>

#include "kernels/cpu/quant.h"
#include "sh_test.h"

static float fbits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bitsf(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* xorshift64*: test inputs only. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
static float rng_unit(void) { return (float)((rng_next() >> 40) + 1) / 16777217.0f; } /* (0,1) */

static void test_fp16_edges(void)
{
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(0.0f), 0x0000);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-0.0f), 0x8000);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(1.0f), 0x3c00);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-2.0f), 0xc000);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(0.333333333f), 0x3555);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(65504.0f), 0x7bff);  /* largest finite */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(65519.99f), 0x7bff); /* just below the tie */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(65520.0f), 0x7c00);  /* tie rounds to even = inf */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-1e30f), 0xfc00);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(INFINITY), 0x7c00);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-INFINITY), 0xfc00);
    uint16_t n = sh__quant_fp16_from_f32(NAN);
    CHECK((n & 0x7c00) == 0x7c00 && (n & 0x03ff) != 0);
    CHECK((sh__quant_fp16_from_f32(fbits(0x7f800001u)) & 0x0200) != 0); /* signalling -> quiet */
    CHECK(isnan(sh__quant_f32_from_fp16(n)));
    /* Subnormals: m * 2^-24. */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1.0f, -24)), 0x0001);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1.0f, -25)), 0x0000);    /* tie -> even 0 */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1.5f, -25)), 0x0001);    /* above the tie */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(3.0f, -25)), 0x0002);    /* 1.5 -> 2 (even) */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(5.0f, -25)), 0x0002);    /* 2.5 -> 2 (even) */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-ldexpf(1.0f, -20)), 0x8010);   /* 16 * 2^-24 */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1023.5f, -24)), 0x0400); /* up to normal */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1.0f, -14)), 0x0400);    /* smallest normal */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(ldexpf(1.0f, -30)), 0x0000);    /* underflow */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(fbits(0x00000001u)), 0x0000);   /* float subnormal */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(-fbits(0x00000001u)), 0x8000);
    /* Ties between normals go to the even mantissa. */
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(1.0f + ldexpf(1.0f, -11)), 0x3c00);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(1.0f + ldexpf(3.0f, -11)), 0x3c02);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(1.0f + ldexpf(1.0f, -11) + ldexpf(1.0f, -20)), 0x3c01);
    CHECK_UINT_EQ(sh__quant_fp16_from_f32(2047.5f), 0x6800); /* mantissa carry into exponent */

    CHECK_NEAR(sh__quant_f32_from_fp16(0x7bff), 65504.0, 0);
    CHECK_NEAR(sh__quant_f32_from_fp16(0x0001), ldexp(1.0, -24), 0);
    CHECK_NEAR(sh__quant_f32_from_fp16(0x83ff), -ldexp(1023.0, -24), 0);
    CHECK_NEAR(sh__quant_f32_from_fp16(0x3555), 0.333251953125, 0);
    CHECK(isinf(sh__quant_f32_from_fp16(0xfc00)) && sh__quant_f32_from_fp16(0xfc00) < 0);
    CHECK_UINT_EQ(bitsf(sh__quant_f32_from_fp16(0x8000)), 0x80000000u);
}

/* Every half widens and narrows back to itself (NaNs stay NaN with the quiet bit). */
static void test_fp16_all_halves(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = sh__quant_f32_from_fp16((uint16_t)h);
        uint16_t back = sh__quant_fp16_from_f32(f);
        bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (is_nan ? !(isnan(f) && back == (h | 0x200)) : back != h)
            bad++;
    }
    CHECK_INT_EQ(bad, 0);
}

/* The compiler's _Float16 conversion is IEEE round-to-nearest-even: compare on a sweep of bit
 * patterns covering every exponent, plus random ones. */
static void test_fp16_vs_compiler(void)
{
#if defined(__FLT16_MAX__)
    int bad = 0;
    for (uint64_t k = 0; k < (1u << 22) + 100000; k++) {
        uint32_t u =
            k < (1u << 22) ? (uint32_t)(k << 10) | (uint32_t)(k & 0x3ff) : (uint32_t)rng_next();
        float f = fbits(u);
        if (isnan(f))
            continue;
        _Float16 c = (_Float16)f;
        uint16_t want;
        memcpy(&want, &c, sizeof want);
        if (sh__quant_fp16_from_f32(f) != want && bad++ < 5)
            fprintf(stderr, "fp16(%08x): got %04x want %04x\n", u, sh__quant_fp16_from_f32(f),
                    want);
    }
    CHECK_INT_EQ(bad, 0);
#endif
}

static void test_bf16_edges(void)
{
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(1.0f), 0x3f80);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(-0.0f), 0x8000);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x3f808000u)), 0x3f80); /* tie -> even */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x3f818000u)), 0x3f82); /* tie -> even (up) */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x3f808001u)), 0x3f81); /* above the tie */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x3f807fffu)), 0x3f80);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(INFINITY), 0x7f80);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(-INFINITY), 0xff80);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(FLT_MAX), 0x7f80); /* rounds up to infinity */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x7f7f7fffu)), 0x7f7f);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x7f800001u)), 0x7fc0); /* signalling -> quiet */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0xffc12345u)), 0xffc1);
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x00010000u)), 0x0001); /* subnormal kept */
    CHECK_UINT_EQ(sh__quant_bf16_from_f32(fbits(0x00008000u)), 0x0000); /* tie -> even 0 */
    CHECK_NEAR(sh__quant_f32_from_bf16(0x4049), 3.140625, 0);
    CHECK(isnan(sh__quant_f32_from_bf16(0x7fc0)));
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = sh__quant_f32_from_bf16((uint16_t)h);
        uint16_t back = sh__quant_bf16_from_f32(f);
        bool is_nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        if (is_nan ? back != (h | 0x40) : back != h)
            bad++;
    }
    CHECK_INT_EQ(bad, 0);
}

/* Hand-computed blocks. */
static void test_known_q4_0(void)
{
    /* x = j - 16: the largest magnitude is -16, so d = -16 / -8 = 2 and q = (int)(x/2 + 8.5),
     * i.e. q_j = (j + 1) / 2, with q_31 = 16 clamped to 15. */
    float x[32];
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j - 16);
    static const uint8_t want[16] = {0x80, 0x91, 0x91, 0xa2, 0xa2, 0xb3, 0xb3, 0xc4,
                                     0xc4, 0xd5, 0xd5, 0xe6, 0xe6, 0xf7, 0xf7, 0xf8};
    sh_block_q4_0 b;
    CHECK_OK(sh__quant_row(SH_DTYPE_Q4_0, x, &b, 32));
    CHECK_UINT_EQ(b.d, 0x4000); /* 2.0 */
    CHECK(memcmp(b.qs, want, 16) == 0);
    float y[32];
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q4_0, &b, y, 32));
    CHECK_NEAR(y[0], -16.0, 0);
    CHECK_NEAR(y[1], -14.0, 0); /* 1.5 rounds half up to q = 1: (1 - 8) * 2 */
    CHECK_NEAR(y[31], 14.0, 0); /* clamped */
}

static void test_known_q4_1(void)
{
    /* x = 1 + (j % 16): min 1, max 16, d = 1, m = 1 and q = j % 16, except two values placed on
     * and below a rounding boundary: 4.5 rounds half up to 5, 4.49 down to 4. */
    float x[32];
    for (int j = 0; j < 32; j++)
        x[j] = 1.0f + (float)(j % 16);
    x[5] = 5.5f;
    x[21] = 5.49f;
    sh_block_q4_1 b;
    CHECK_OK(sh__quant_row(SH_DTYPE_Q4_1, x, &b, 32));
    CHECK_UINT_EQ(b.d, 0x3c00);
    CHECK_UINT_EQ(b.m, 0x3c00);
    for (int j = 0; j < 16; j++) {
        int lo = j == 5 ? 5 : j, hi = j == 5 ? 4 : j;
        CHECK_UINT_EQ(b.qs[j], (unsigned)(lo | hi << 4));
    }
}

static void test_known_q8_0(void)
{
    /* amax = 127 gives d = 1 exactly; roundf rounds halves away from zero. */
    float x[32] = {127, -127, 0.5f, -0.5f, 1.5f, 2.5f, -2.5f, 3.49f, -3.51f, 100.2f, 0.49f};
    for (int j = 11; j < 32; j++)
        x[j] = (float)(j * 3 - 50);
    static const int8_t want[11] = {127, -127, 1, -1, 2, 3, -3, 3, -4, 100, 0};
    sh_block_q8_0 b;
    CHECK_OK(sh__quant_row(SH_DTYPE_Q8_0, x, &b, 32));
    CHECK_UINT_EQ(b.d, 0x3c00);
    for (int j = 0; j < 11; j++)
        CHECK_INT_EQ(b.qs[j], want[j]);
    for (int j = 11; j < 32; j++)
        CHECK_INT_EQ(b.qs[j], j * 3 - 50);
}

/* Random rows of several lengths, each block with its own scale; never zeros. */
static void fill_random(float *x, int64_t n)
{
    for (int64_t b = 0; b < n; b += 32) {
        float scale = powf(10.0f, -3.0f + 5.0f * rng_unit());
        float shift = rng_unit() < 0.3f ? scale * (rng_unit() - 0.2f) * 4.0f : 0.0f;
        for (int64_t j = b; j < b + 32 && j < n; j++) {
            float v = (rng_unit() * 2.0f - 1.0f) * scale + shift;
            x[j] = v != 0.0f ? v : scale;
        }
    }
}

static double block_amax(const float *x)
{
    double a = 0;
    for (int j = 0; j < 32; j++)
        a = fmax(a, fabs(x[j]));
    return a;
}

static void check_block_error(sh_dtype t, const float *x, const float *y, const void *blk)
{
    for (int j = 0; j < 32; j++) {
        double err = fabs((double)x[j] - y[j]), bound;
        double amax = block_amax(x);
        if (t == SH_DTYPE_Q8_0) {
            /* Half a step of the exact d, plus the fp16 rounding of d times |q| <= 127. */
            const sh_block_q8_0 *b = blk;
            double d = amax / 127.0, dh = sh__quant_f32_from_fp16(b->d);
            bound = d / 2 + 127 * fabs(dh - d);
        } else if (t == SH_DTYPE_Q4_0) {
            /* Half a step, or a whole one at q = 15 where the far extreme (up to +8 steps) is
             * clamped; plus the fp16 rounding of d times |q - 8| <= 8. */
            const sh_block_q4_0 *b = blk;
            int q = j < 16 ? b->qs[j] & 15 : b->qs[j - 16] >> 4;
            double d = amax / 8.0, dh = fabs(sh__quant_f32_from_fp16(b->d));
            bound = (q == 15 ? d : d / 2) + 8 * fabs(dh - d);
        } else {
            const sh_block_q4_1 *b = blk;
            double mn = x[0], mx = x[0];
            for (int k = 1; k < 32; k++) {
                mn = fmin(mn, x[k]);
                mx = fmax(mx, x[k]);
            }
            double d = (mx - mn) / 15, dh = sh__quant_f32_from_fp16(b->d);
            double mh = sh__quant_f32_from_fp16(b->m);
            bound = d / 2 + 15 * fabs(dh - d) + fabs(mh - mn);
        }
        bound += amax * 1e-6; /* float arithmetic in the quantizer */
        if (!(err <= bound)) {
            SH_FAIL_("%s element %d: |%.9g - %.9g| = %.3g > %.3g", sh__dtype_name(t), j, x[j], y[j],
                     err, bound);
            return;
        }
    }
}

static void test_round_trip(void)
{
    static const int64_t sizes[] = {32, 64, 96, 256, 4096, 32 * 333};
    static const sh_dtype types[] = {SH_DTYPE_F32,  SH_DTYPE_F16,  SH_DTYPE_BF16,
                                     SH_DTYPE_Q8_0, SH_DTYPE_Q4_0, SH_DTYPE_Q4_1};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
        uint8_t *q = malloc((size_t)n * 4 + 64);
        fill_random(x, n);
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            sh_dtype ty = types[t];
            uint64_t bytes = sh__dtype_row_bytes(ty, (uint64_t)n);
            memset(q, 0xa5, (size_t)n * 4 + 64);
            CHECK_OK(sh__quant_row(ty, x, q, n));
            CHECK_UINT_EQ(q[bytes], 0xa5); /* nothing written past the row */
            CHECK_OK(sh__dequant_row(ty, q, y, n));
            for (int64_t i = 0; i < n; i++) {
                double err = fabs((double)x[i] - y[i]), ax = fabs(x[i]);
                if (ty == SH_DTYPE_F32 && err != 0)
                    SH_FAIL_("F32 element %lld differs", (long long)i);
                if (ty == SH_DTYPE_F16 && err > ax * ldexp(1, -11) + ldexp(1, -25))
                    SH_FAIL_("F16 element %lld: %.9g vs %.9g", (long long)i, x[i], y[i]);
                if (ty == SH_DTYPE_BF16 && err > ax * ldexp(1, -8))
                    SH_FAIL_("BF16 element %lld: %.9g vs %.9g", (long long)i, x[i], y[i]);
            }
            const sh_dtype_info *info = sh__dtype_info(ty);
            if (info->block_elems == 32)
                for (int64_t b = 0; b < n / 32; b++)
                    check_block_error(ty, x + b * 32, y + b * 32, q + b * info->block_bytes);
            /* Re-quantizing the dequantized row is stable for the block types' scale choice
             * only approximately, so just check the quantizer is deterministic. */
            uint8_t *q2 = malloc((size_t)bytes);
            CHECK_OK(sh__quant_row(ty, x, q2, n));
            CHECK(memcmp(q, q2, (size_t)bytes) == 0);
            free(q2);
        }
        free(x);
        free(y);
        free(q);
    }
}

static void test_constant_block(void)
{
    float x[32], y[32];
    for (int j = 0; j < 32; j++)
        x[j] = -3.0f;
    uint8_t q[64];
    CHECK_OK(sh__quant_row(SH_DTYPE_Q4_1, x, q, 32)); /* d = 0: every q is 0 and m carries it */
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q4_1, q, y, 32));
    for (int j = 0; j < 32; j++)
        CHECK_NEAR(y[j], -3.0, 0);
    CHECK_OK(sh__quant_row(SH_DTYPE_Q4_0, x, q, 32)); /* all at the -8 end */
    CHECK_OK(sh__dequant_row(SH_DTYPE_Q4_0, q, y, 32));
    for (int j = 0; j < 32; j++)
        CHECK_NEAR(y[j], -3.0, 0);
}

static void test_errors(void)
{
    float x[64] = {1};
    uint8_t q[512];
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_Q4_0, x, q, 33), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_Q8_0, x, q, 16), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_Q8_1, x, q, 32), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_IQ3_S, x, q, 256), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row((sh_dtype)99, x, q, 32), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_F16, x, q, -1), SH_EINVAL);
    CHECK_INT_EQ(sh__dequant_row(SH_DTYPE_Q4_1, q, x, 31), SH_EINVAL);
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_F16, x, q, 3), SH_OK); /* plain types: any length */
    CHECK_INT_EQ(sh__quant_row(SH_DTYPE_Q4_0, x, q, 0), SH_OK);
    CHECK(sh__quant_supported(SH_DTYPE_BF16));
    CHECK(!sh__quant_supported(SH_DTYPE_Q8_1));
}

static const sh_test_case tests[] = {
    {"fp16_edges", test_fp16_edges},
    {"fp16_all_halves", test_fp16_all_halves},
    {"fp16_vs_compiler", test_fp16_vs_compiler},
    {"bf16_edges", test_bf16_edges},
    {"known_q4_0", test_known_q4_0},
    {"known_q4_1", test_known_q4_1},
    {"known_q8_0", test_known_q8_0},
    {"round_trip", test_round_trip},
    {"constant_block", test_constant_block},
    {"errors", test_errors},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
