/* Helpers shared by the CPU kernel tests: a seeded generator of nonzero inputs, backend creation
 * and random quantized weights with their dequantized copy. Define KT_SEED before including. */
#ifndef SH_TESTS_KERNELS_TEST_UTIL_H
#define SH_TESTS_KERNELS_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/quant.h"
#include "sh_test.h"

#ifndef KT_SEED
#define KT_SEED 0x243f6a8885a308d3ull
#endif

static uint64_t rng_state = KT_SEED;
static inline uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
/* Uniform in (-1, 1), never exactly zero. */
static inline float rng_sym(void)
{
    return ((float)((rng_next() >> 40) + 1) / 16777217.0f) * 2.0f - 1.0f;
}

static inline void fill(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_sym() * scale;
}

/* A CPU backend with the given ISA and thread count, or NULL (a failed check, with the reason). */
static inline sh_backend *make(int isa, int threads)
{
    sh_backend *be = NULL;
    sh_backend_cpu_opts o = {.n_threads = threads, .isa = isa};
    sh_error e = {0};
    if (sh_backend_cpu_create(&o, &be, &e) != SH_OK) {
        SH_FAIL_("backend create (isa %d): %s", isa, e.msg);
        return NULL;
    }
    return be;
}

/* A random weight (n_out, n_in) of `type`, plus its dequantized f32 copy. Row scales vary so that
 * per-block scales differ. */
typedef struct wmat {
    sh_tensor t;
    float *deq;
} wmat;

static inline wmat make_w(sh_dtype type, int64_t n_out, int64_t n_in)
{
    wmat w = {{type, {n_in, n_out, 1, 1}, NULL}, malloc((size_t)(n_out * n_in) * sizeof(float))};
    size_t rb = sh__dtype_row_bytes(type, (uint64_t)n_in);
    w.t.data = malloc(rb * (size_t)n_out);
    float *row = malloc((size_t)n_in * sizeof(float));
    for (int64_t r = 0; r < n_out; r++) {
        fill(row, n_in, 0.05f + 0.1f * (float)(r % 5));
        CHECK_OK(sh__quant_row(type, row, (uint8_t *)w.t.data + r * rb, n_in));
        CHECK_OK(sh__dequant_row(type, (uint8_t *)w.t.data + r * rb, w.deq + r * n_in, n_in));
    }
    free(row);
    return w;
}

/* The worst |y - ry| / sum_k |w||x| over the n_tok x n_out outputs (token-major) of a product
 * with w against the reference ry on the same codes: only the float summation order may differ,
 * so fast paths are held to about 2e-5 of it. */
static inline double worst_rel_err(const wmat *w, const float *x, const float *y, const float *ry,
                                   int64_t n_tok, int64_t n_out, int64_t n_in)
{
    double worst = 0;
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = 0; r < n_out; r++) {
            double sa = 0;
            for (int64_t k = 0; k < n_in; k++)
                sa += fabs((double)w->deq[r * n_in + k] * x[t * n_in + k]);
            const double e = fabs((double)y[t * n_out + r] - ry[t * n_out + r]) / sa;
            if (!(e <= worst)) /* a NaN sticks */
                worst = e;
        }
    return worst;
}

/* bf16 of f (round to nearest even, as VCVTNE2PS2BF16 for the normal numbers of these tests),
 * back as a float. */
static inline float bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* Bounds of the AMX level's BF16 prefill (ops_avx512_packed.c) on an output y (t, r), with S =
 * sum_k |w_k x_k|:
 *  - against the double sum of the bf16-rounded products bf16(w_k) bf16(x_k): only the fp32
 *    accumulation differs (a product of two bf16 values is exact in fp32), so the tolerance
 *    of the other fast paths, 2e-5 S (the worst case K 2^-24 S is 2.4e-4 at K 4096, but the
 *    rounding errors of K random terms add up as sqrt(K) 2^-24 S, under 4e-6);
 *  - against the exact product (f32 weights and activations, double sums): each of w and x
 *    rounded to bf16 (8 significant bits) is off by at most 2^-9 of itself, a product by
 *    2^-8 + 2^-18 of itself, so |y - exact| <= (2^-8 + 2^-18) S plus the accumulation's 2e-5 S.
 *    The first check pins the arithmetic (a dropped or misplaced block moves y by far more than
 *    2e-5 S); the second states the accuracy that callers get. */
#define BF16_TOL_SAME 2e-5
#define BF16_TOL_EXACT (1.0 / 256 + 1.0 / 262144 + 2e-5)

/* The worst |y - ref| / S of rows [r0, r1), where ref is y0 (when accumulating) plus the double
 * sum over k of f(w) f(x) with f the identity or bf16_round. */
static inline double bf16_worst(const wmat *w, const float *x, const float *y0, const float *y,
                                int64_t n_tok, int64_t n_out, int64_t n_in, int64_t r0, int64_t r1,
                                int accum, int rounded)
{
    double worst = 0;
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = r0; r < r1; r++) {
            double sum = 0, sa = 0;
            for (int64_t k = 0; k < n_in; k++) {
                const float wk = w->deq[r * n_in + k], xk = x[t * n_in + k];
                const double p =
                    rounded ? (double)bf16_round(wk) * bf16_round(xk) : (double)wk * xk;
                sum += p;
                sa += fabs((double)wk * xk);
            }
            const double ref = (accum ? (double)y0[t * n_out + r] : 0.0) + sum;
            const double e = fabs((double)y[t * n_out + r] - ref) / sa;
            if (!(e <= worst))
                worst = e;
        }
    return worst;
}

static inline void free_w(wmat *w)
{
    free(w->t.data);
    free(w->deq);
}

#endif
