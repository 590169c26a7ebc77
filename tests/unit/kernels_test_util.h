/* Helpers shared by the CPU kernel tests: a seeded generator of nonzero inputs, backend creation
 * and random quantized weights with their dequantized copy. Define KT_SEED before including. */
#ifndef SH_TESTS_KERNELS_TEST_UTIL_H
#define SH_TESTS_KERNELS_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

static inline void free_w(wmat *w)
{
    free(w->t.data);
    free(w->deq);
}

#endif
