/* RoPE scaling of the Llama-family models (see llama_rope.h): which angles the metadata asks for
 * and the factor tensors that divide each frequency. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "model/llama_rope.h"

/* <arch>.<key> as any finite float (integers too), dflt when absent. */
static sh_err get_float(const sh_gguf *g, const char *arch, const char *key, float dflt, float *out,
                        sh_error *e)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    sh_err err = sh_gguf_get_f32(g, full, out);
    if (err == SH_ENOTFOUND) {
        *out = dflt;
        return SH_OK;
    }
    if (err || !isfinite(*out))
        return sh__error_set(e, SH_EFORMAT, "metadata %s: bad value", full);
    return SH_OK;
}

/* YaRN's magnitude for a context stretched by s: 0.1 m ln s + 1 (1 when s <= 1). */
static double yarn_mscale(double s, double m) { return s <= 1.0 ? 1.0 : 0.1 * m * log(s) + 1.0; }

sh_err sh__llama_rope_hparams(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e)
{
    const char *a = hp->arch;
    sh_rope_scaling *r = &hp->rope_scaling;
    *r = sh_rope_scaling_none();
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    sh_str st;
    bool none = false, yarn = false;
    sh_err err = sh_gguf_get_str(g, key, &st);
    if (err == SH_OK) {
        none = sh_str_eq(st, "none");
        yarn = sh_str_eq(st, "yarn");
        if (!none && !yarn && !sh_str_eq(st, "linear") && !sh_str_eq(st, "longrope"))
            return sh__error_set(e, SH_EUNSUPPORTED,
                                 "metadata %s: '%.*s' is not one of none, linear, yarn, longrope",
                                 key, (int)(st.len > 32 ? 32 : st.len), st.ptr);
    } else if (err != SH_ENOTFOUND) {
        return sh__error_set(e, SH_EFORMAT, "metadata %s: not a string", key);
    }
    float factor, orig, ext, attn_yarn, log_mul, attn;
    if ((err = get_float(g, a, "rope.scale_linear", 0.0f, &factor, e)) ||
        (err = get_float(g, a, "rope.scaling.factor", factor, &factor, e)) ||
        (err = get_float(g, a, "rope.scaling.original_context_length", (float)hp->n_ctx_train,
                         &orig, e)) ||
        (err = get_float(g, a, "rope.scaling.yarn_ext_factor", -1.0f, &ext, e)) ||
        (err = get_float(g, a, "rope.scaling.yarn_attn_factor", 1.0f, &attn_yarn, e)) ||
        (err = get_float(g, a, "rope.scaling.yarn_beta_fast", 32.0f, &r->beta_fast, e)) ||
        (err = get_float(g, a, "rope.scaling.yarn_beta_slow", 1.0f, &r->beta_slow, e)) ||
        (err = get_float(g, a, "rope.scaling.yarn_log_multiplier", 0.0f, &log_mul, e)) ||
        (err = get_float(g, a, "rope.scaling.attn_factor", 1.0f, &attn, e)))
        return err;
    if (factor < 0.0f)
        return sh__error_set(e, SH_EFORMAT, "metadata %s.rope.scaling.factor: %g is negative", a,
                             (double)factor);
    if (!(orig >= 1.0f && orig <= 1e9f))
        return sh__error_set(e, SH_EFORMAT,
                             "metadata %s.rope.scaling.original_context_length: bad value", a);
    /* llama.cpp: the factor interpolates positions (freq_scale = 1 / factor) unless the type is
     * none or no factor is given. */
    r->freq_scale = none || factor == 0.0f ? 1.0f : 1.0f / factor;
    r->n_ctx_orig = (int32_t)orig;
    r->ext_factor = ext < 0.0f ? (yarn ? 1.0f : 0.0f) : ext;
    double af = attn_yarn;
    if (r->ext_factor != 0.0f) {
        if (!(r->beta_fast > 0.0f) || !(r->beta_slow > 0.0f))
            return sh__error_set(e, SH_EFORMAT,
                                 "metadata %s.rope.scaling.yarn_beta_fast/slow: not positive", a);
        /* YaRN's magnitude mscale(factor) (over mscale(factor, log_mul) when the file gives a
         * log multiplier), divided by the 1 + 0.1 ln factor the rope op applies again. */
        double s = 1.0 / r->freq_scale;
        af = log_mul != 0.0f ? yarn_mscale(s, 1.0) / yarn_mscale(s, log_mul) : yarn_mscale(s, 1.0);
        af /= 1.0 + 0.1 * log(s);
    }
    r->attn_factor = (float)(af * attn);
    return SH_OK;
}

/* One factor tensor: NULL when absent, else n_rot / 2 positive finite F32 divisors. */
static sh_err bind_factors(const sh_gguf *g, const char *name, int32_t n_rot, const float **out,
                           sh_error *e)
{
    *out = NULL;
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, name);
    if (!t)
        return SH_OK;
    const uint64_t want = (uint64_t)n_rot / 2;
    if (t->type != SH_DTYPE_F32 || t->ne[0] != want || t->ne[1] != 1 || t->ne[2] != 1 ||
        t->ne[3] != 1)
        return sh__error_set(e, SH_EFORMAT,
                             "tensor '%s': want %llu F32 values (rope dimension %d / 2), have "
                             "%s [%llu, %llu]",
                             name, (unsigned long long)want, (int)n_rot, sh__dtype_name(t->type),
                             (unsigned long long)t->ne[0], (unsigned long long)t->ne[1]);
    const float *f = t->data;
    for (uint64_t i = 0; i < want; i++)
        if (!(f[i] > 0.0f) || !isfinite(f[i]))
            return sh__error_set(e, SH_EFORMAT,
                                 "tensor '%s': value %llu is %g, not a positive "
                                 "divisor",
                                 name, (unsigned long long)i, (double)f[i]);
    *out = f;
    return SH_OK;
}

sh_err sh__llama_rope_bind(const sh_gguf *g, sh_llama *m, sh_error *e)
{
    const int32_t n = m->hp.n_rot;
    const float *freqs, *shrt, *lng;
    sh_err err;
    if ((err = bind_factors(g, "rope_freqs.weight", n, &freqs, e)) ||
        (err = bind_factors(g, "rope_factors_short.weight", n, &shrt, e)) ||
        (err = bind_factors(g, "rope_factors_long.weight", n, &lng, e)))
        return err;
    m->rope_freqs = freqs ? freqs : shrt;
    m->rope_freqs_long = lng;
    return SH_OK;
}

sh_rope_scaling sh__llama_rope_for_ctx(const sh_llama *m, int32_t kv_tokens)
{
    sh_rope_scaling r = m->hp.rope_scaling;
    r.freq_factors = m->rope_freqs;
    int64_t padded = ((int64_t)kv_tokens + 255) / 256 * 256;
    if (m->rope_freqs_long && padded > r.n_ctx_orig)
        r.freq_factors = m->rope_freqs_long;
    return r;
}
