"""Rotary position embeddings for the NumPy reference: plain, linear-scaled, YaRN and per-frequency
factors (Llama 3's rope_freqs, Phi-3's rope_factors_short/long), in float64.

What the GGUF metadata means is taken from llama.cpp's loader (src/llama-model.cpp,
src/llama-context.cpp) and its rope (ggml-cpu ops.cpp, rope_yarn): GGUF stores no "llama3"
scaling type; the converter turns Llama 3's rope_scaling into the rope_freqs.weight tensor, a
divisor per frequency. The formulas here are written from those semantics, not copied.
"""
import math

import numpy as np


class RopeParams:
    """Per-model rope settings; `angles` gives (cos, sin) for one position and one layer."""

    def __init__(self, get, arch, rope_dim, ctx_train):
        self.dim = rope_dim  # rotated dims per head (pairs)
        self.base = float(get(f"{arch}.rope.freq_base", 10000.0))
        # Local (sliding-window) layers of gemma3-style models have their own base; llama.cpp's
        # default for it is 10000 whatever the global base is.
        self.base_swa = float(get(f"{arch}.rope.freq_base_swa", 10000.0))
        stype = get(f"{arch}.rope.scaling.type", "linear")
        factor = float(get(f"{arch}.rope.scaling.factor", get(f"{arch}.rope.scale_linear", 0.0)))
        self.scaling = stype
        # freq_scale multiplies every angle (position interpolation); "none" never scales.
        self.freq_scale = 1.0 if (stype == "none" or factor == 0.0) else 1.0 / factor
        self.orig_ctx = int(get(f"{arch}.rope.scaling.original_context_length", ctx_train))
        ext = float(get(f"{arch}.rope.scaling.yarn_ext_factor", -1.0))
        if ext < 0:
            ext = 1.0 if stype == "yarn" else 0.0
        self.ext_factor = ext
        self.beta_fast = float(get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
        self.beta_slow = float(get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))
        log_mul = float(get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
        # The magnitude factor applied to cos and sin (llama.cpp's attn_factor): with YaRN it is
        # mscale(factor) / (1 + 0.1 ln factor) (the second factor cancels the one rope_yarn applies
        # again below), times the file's rope.scaling.attn_factor.
        attn = float(get(f"{arch}.rope.scaling.yarn_attn_factor", 1.0))
        if self.ext_factor != 0.0:
            fac = 1.0 / self.freq_scale

            def mscale(s, m):
                return 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0

            attn = mscale(fac, 1.0) / mscale(fac, log_mul) if log_mul != 0.0 else mscale(fac, 1.0)
            attn *= 1.0 / (1.0 + 0.1 * math.log(fac))
        self.attn_factor = attn * float(get(f"{arch}.rope.scaling.attn_factor", 1.0))
        self.factors = None  # per-frequency divisors (rope_dim / 2), or None

    def corr_dims(self, base):
        """YaRN's correction range: the dims whose wavelength is between beta_fast and beta_slow
        rotations over the original context."""

        def corr_dim(n_rot):
            return self.dim * math.log(self.orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        lo = math.floor(corr_dim(self.beta_fast))
        hi = math.ceil(corr_dim(self.beta_slow))
        return max(0.0, lo), min(self.dim - 1.0, hi)

    def angles(self, pos, base, freq_scale=None):
        """(cos, sin) arrays of rope_dim / 2 for position pos, already multiplied by the magnitude
        factor."""
        fs = self.freq_scale if freq_scale is None else freq_scale
        i = np.arange(self.dim // 2, dtype=np.float64)
        theta_extrap = pos * base ** (-2.0 * i / self.dim)
        if self.factors is not None:
            theta_extrap = theta_extrap / self.factors
        theta_interp = fs * theta_extrap
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            lo, hi = self.corr_dims(base)
            # ramp is 1 for fast (short-wavelength) dims, which keep the extrapolated angle.
            y = (i - lo) / max(0.001, hi - lo)
            ramp = (1.0 - np.clip(y, 0.0, 1.0)) * self.ext_factor
            theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp
            mscale = mscale * (1.0 + 0.1 * math.log(1.0 / fs))
        else:
            theta = theta_interp
        return np.cos(theta) * mscale, np.sin(theta) * mscale


def apply(x, cs, neox, n):
    """Rotates the first n dims of each row of x (heads, head_dim) by the angles cs = (cos, sin).
    NeoX pairs dim i with i + n/2; the normal (GPT-J / llama) layout pairs 2i with 2i + 1."""
    c, s = cs
    out = x.astype(np.float64).copy()
    if neox:
        a, b = out[:, : n // 2].copy(), out[:, n // 2 : n].copy()
        out[:, : n // 2] = a * c - b * s
        out[:, n // 2 : n] = a * s + b * c
    else:
        a, b = out[:, 0:n:2].copy(), out[:, 1:n:2].copy()
        out[:, 0:n:2] = a * c - b * s
        out[:, 1:n:2] = a * s + b * c
    return out.astype(np.float32)


def llama3_factors(base, dim, factor, low_freq_factor, high_freq_factor, orig_ctx):
    """The rope_freqs.weight divisors that llama.cpp's converter derives from a Llama 3
    rope_scaling block (HF's _compute_llama3_parameters): long wavelengths are divided by factor,
    short ones kept, the band between interpolated smoothly."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / (base ** (i / dim))
        wavelen = 2 * math.pi / freq
        if wavelen < orig_ctx / high_freq_factor:
            out.append(1.0)
        elif wavelen > orig_ctx / low_freq_factor:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
