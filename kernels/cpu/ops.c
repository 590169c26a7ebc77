/* Row-wise ops of the CPU backend (RMSNorm, RoPE, SiLU); shared by every ISA. */
#include <math.h>

#include "kernels/cpu/cpu.h"

void sh__cpu_rmsnorm_rows(const sh__cpu_kernels *k, const float *x, const float *w, float eps,
                          int64_t n, float *y, int64_t t0, int64_t t1)
{
    for (int64_t t = t0; t < t1; t++) {
        const float *xr = x + t * n;
        float *yr = y + t * n;
        /* y = x / sqrt(mean(x^2) + eps) * w */
        float inv = 1.0f / sqrtf(k->sumsq(xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            yr[i] = xr[i] * inv * w[i];
    }
}

/* Largest n_rot / 2 the RoPE kernel takes (checked at enqueue). */
#define ROPE_MAX_PAIRS 512

/* YaRN's correction range [lo, hi] in pair indices: the pairs whose wavelength makes between
 * beta_fast and beta_slow turns over the original context (see sh_rope_scaling). */
static void yarn_range(int32_t n_rot, double base, const sh_rope_scaling *sc, double *lo,
                       double *hi)
{
    const double two_pi = 6.283185307179586;
    double df = n_rot * log(sc->n_ctx_orig / (sc->beta_fast * two_pi)) / (2.0 * log(base));
    double ds = n_rot * log(sc->n_ctx_orig / (sc->beta_slow * two_pi)) / (2.0 * log(base));
    *lo = fmax(0.0, floor(df));
    *hi = fmin(n_rot - 1.0, ceil(ds));
}

void sh__cpu_rope_range(float *x, const int32_t *pos, int32_t n_heads, int32_t head_dim,
                        int32_t n_rot, float freq_base, sh_rope_scaling sc, sh_rope_mode mode,
                        int64_t t0, int64_t t1)
{
    float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];
    double freq[ROPE_MAX_PAIRS], ramp[ROPE_MAX_PAIRS];
    const int32_t half = n_rot / 2;
    /* Pair i turns by pos * base^(-2i / n_rot) / factor_i, interpolated by freq_scale and, with
     * YaRN, mixed back toward the extrapolated angle by ramp_i (sh_rope_scaling): the
     * frequencies and ramps once per range, the angles once per token (the same for every
     * head). */
    double mscale = sc.attn_factor, lo = 0.0, hi = 0.0;
    if (sc.ext_factor != 0.0f) {
        yarn_range(n_rot, freq_base, &sc, &lo, &hi);
        mscale *= 1.0 + 0.1 * log(1.0 / sc.freq_scale);
    }
    for (int32_t i = 0; i < half; i++) {
        freq[i] = pow(freq_base, -2.0 * i / n_rot);
        if (sc.freq_factors)
            freq[i] /= sc.freq_factors[i];
        ramp[i] = 0.0;
        if (sc.ext_factor != 0.0f) {
            double y = (i - lo) / fmax(0.001, hi - lo);
            ramp[i] = (1.0 - fmin(1.0, fmax(0.0, y))) * sc.ext_factor;
        }
    }
    for (int64_t t = t0; t < t1; t++) {
        for (int32_t i = 0; i < half; i++) {
            double extrap = (double)pos[t] * freq[i];
            double theta = extrap * sc.freq_scale * (1.0 - ramp[i]) + extrap * ramp[i];
            cs[i] = (float)(cos(theta) * mscale);
            sn[i] = (float)(sin(theta) * mscale);
        }
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * head_dim;
            for (int32_t i = 0; i < half; i++) {
                /* NORMAL pairs adjacent elements, NEOX pairs i with i + n_rot/2. */
                int32_t a = mode == SH_ROPE_MODE_NEOX ? i : 2 * i;
                int32_t b = mode == SH_ROPE_MODE_NEOX ? i + half : 2 * i + 1;
                float x0 = v[a], x1 = v[b];
                v[a] = x0 * cs[i] - x1 * sn[i];
                v[b] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
}

float sh__cpu_silu(float g) { return g / (1.0f + expf(-g)); }

void sh__cpu_swiglu_ref(const float *g, const float *u, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = sh__cpu_silu(g[i]) * u[i];
}
