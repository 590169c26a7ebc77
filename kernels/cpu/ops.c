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

void sh__cpu_rope_range(float *x, const int32_t *pos, int32_t n_heads, int32_t head_dim,
                        int32_t n_rot, float freq_base, float freq_scale, sh_rope_mode mode,
                        int64_t t0, int64_t t1)
{
    float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];
    double freq[ROPE_MAX_PAIRS];
    const int32_t half = n_rot / 2;
    /* Pair i turns by theta_i = pos * freq_scale * base^(-2i / n_rot): the frequencies once per
     * range, the angles once per token (the same for every head). */
    for (int32_t i = 0; i < half; i++)
        freq[i] = pow(freq_base, -2.0 * i / n_rot);
    for (int64_t t = t0; t < t1; t++) {
        for (int32_t i = 0; i < half; i++) {
            double theta = (double)pos[t] * freq_scale * freq[i];
            cs[i] = (float)cos(theta);
            sn[i] = (float)sin(theta);
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
