/* The architectures mkmodel writes: the named shapes, their consistency checks, and the
 * architecture keys and tensor layout that llama.cpp's converter gives each. */
#include "model/mkmodel_arch.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/error.h"

static const sh_mkmodel_shape shapes[] = {
    {.name = "smollm2-135m",
     .n_layers = 30,
     .dim = 576,
     .ffn = 1536,
     .n_heads = 9,
     .n_kv_heads = 3,
     .vocab = 49152,
     .ctx = 8192,
     .rope_base = 100000.0f,
     .rms_eps = 1e-5f,
     .tied = true},
    {.name = "tinyllama-1.1b",
     .n_layers = 22,
     .dim = 2048,
     .ffn = 5632,
     .n_heads = 32,
     .n_kv_heads = 4,
     .vocab = 32000,
     .ctx = 2048,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f},
    /* Llama 3 8B's dimensions without its rope scaling (the 8192-token original). */
    {.name = "llama3-8b",
     .n_layers = 32,
     .dim = 4096,
     .ffn = 14336,
     .n_heads = 32,
     .n_kv_heads = 8,
     .vocab = 128256,
     .ctx = 8192,
     .rope_base = 500000.0f,
     .rms_eps = 1e-5f},
    /* Llama 3.2 1B: Llama 3 rope scaling (factor 32 over 8192 positions) as rope_freqs. */
    {.name = "llama3.2-1b",
     .n_layers = 16,
     .dim = 2048,
     .ffn = 8192,
     .n_heads = 32,
     .n_kv_heads = 8,
     .vocab = 128256,
     .ctx = 131072,
     .rope_base = 500000.0f,
     .rms_eps = 1e-5f,
     .tied = true,
     .rope_scaling = SH_MKMODEL_ROPE_SCALING_LLAMA3,
     .rope_factor = 32.0f,
     .rope_orig_ctx = 8192},
    /* Gemma 3 270M: 256-wide heads, one KV head, 5 local (512-token window) layers per global
     * one, global rope base 1e6 and local 10000 (llama.cpp's default, not written). */
    {.name = "gemma3-270m",
     .arch = "gemma3",
     .n_layers = 18,
     .dim = 640,
     .ffn = 2048,
     .n_heads = 4,
     .n_kv_heads = 1,
     .head_dim = 256,
     .vocab = 262144,
     .ctx = 32768,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .tied = true,
     .sliding_window = 512},
    {.name = "qwen3-0.6b",
     .arch = "qwen3",
     .n_layers = 28,
     .dim = 1024,
     .ffn = 3072,
     .n_heads = 16,
     .n_kv_heads = 8,
     .head_dim = 128,
     .vocab = 151936,
     .ctx = 40960,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .tied = true},
    /* A small Qwen3-30B-A3B: 16 experts of width 256, 4 per token. */
    {.name = "qwen3moe-tiny",
     .arch = "qwen3moe",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1536,
     .n_heads = 8,
     .n_kv_heads = 4,
     .head_dim = 64,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .n_experts = 16,
     .n_experts_used = 4,
     .expert_ffn = 256},
    /* Phi-3 mini 4k: fused QKV and gate/up; the converter writes its 2047 window, which
     * llama.cpp ignores for phi3. */
    {.name = "phi3-mini",
     .arch = "phi3",
     .n_layers = 32,
     .dim = 3072,
     .ffn = 8192,
     .n_heads = 32,
     .n_kv_heads = 32,
     .vocab = 32064,
     .ctx = 4096,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f,
     .sliding_window = 2047,
     .rope_orig_ctx = 4096},
    /* A small Qwen1.5-MoE: qwen2 attention with Q/K/V biases, 8 routed experts (4 per token,
     * weights not renormalised) and a sigmoid-gated shared expert. */
    {.name = "qwen2moe-tiny",
     .arch = "qwen2moe",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1024,
     .n_heads = 8,
     .n_kv_heads = 8,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-6f,
     .n_experts = 8,
     .n_experts_used = 4,
     .expert_ffn = 256,
     .shared_ffn = 1024},
    /* A small OLMoE: RMSNorm over all of Q and all of K, 16 experts (4 per token, weights not
     * renormalised); feed_forward_length is the expert width. */
    {.name = "olmoe-tiny",
     .arch = "olmoe",
     .n_layers = 8,
     .dim = 512,
     .ffn = 256,
     .n_heads = 8,
     .n_kv_heads = 8,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f,
     .n_experts = 16,
     .n_experts_used = 4},
    /* A small Mixtral: llama with 8 experts, 2 per token. */
    {.name = "mixtral-tiny",
     .n_layers = 8,
     .dim = 512,
     .ffn = 1536,
     .n_heads = 8,
     .n_kv_heads = 2,
     .vocab = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-5f,
     .n_experts = 8,
     .n_experts_used = 2},
};

const char *sh__mkmodel_arch(const sh_mkmodel_shape *s) { return s->arch ? s->arch : "llama"; }

int64_t sh__mkmodel_head_dim(const sh_mkmodel_shape *s)
{
    return s->head_dim ? s->head_dim : s->n_heads ? s->dim / s->n_heads : 0;
}

const sh_mkmodel_shape *sh__mkmodel_shapes(size_t *n)
{
    *n = sizeof shapes / sizeof shapes[0];
    return shapes;
}

const sh_mkmodel_shape *sh__mkmodel_shape_find(const char *name)
{
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (strcmp(shapes[i].name, name) == 0)
            return &shapes[i];
    return NULL;
}

static bool arch_is(const sh_mkmodel_shape *s, const char *name)
{
    return strcmp(sh__mkmodel_arch(s), name) == 0;
}

sh_err sh__mkmodel_arch_check(const sh_mkmodel_shape *s, sh_error *e)
{
    static const char *const archs[] = {"llama",    "gemma3", "qwen3", "qwen3moe",
                                        "qwen2moe", "phi3",   "olmoe"};
    bool known = false;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        known |= arch_is(s, archs[i]);
    if (!known)
        return sh__error_set(e, SH_EINVAL,
                             "architecture '%s' is not one of llama, gemma3, qwen3, qwen3moe, "
                             "qwen2moe, phi3, olmoe",
                             sh__mkmodel_arch(s));
    struct {
        const char *name;
        int64_t v, max;
    } f[] = {
        {"layers", s->n_layers, 4096},
        {"dim", s->dim, 1 << 16},
        {"ffn", s->ffn, 1 << 20},
        {"heads", s->n_heads, 1 << 12},
        {"kv-heads", s->n_kv_heads, 1 << 12},
        {"vocab", s->vocab, 1 << 24},
        {"ctx", s->ctx, 1 << 24},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < 1 || f[i].v > f[i].max)
            return sh__error_set(e, SH_EINVAL, "%s = %lld is outside 1..%lld", f[i].name,
                                 (long long)f[i].v, (long long)f[i].max);
    if (s->head_dim < 0 || s->head_dim > 4096 || s->n_experts < 0 || s->n_experts > 512 ||
        s->expert_ffn < 0 || s->expert_ffn > (1 << 20) || s->swa_pattern < 0 ||
        s->sliding_window < 0 || s->rope_orig_ctx < 0)
        return sh__error_set(e, SH_EINVAL,
                             "head-dim, experts (<= 512), expert-ffn, swa-pattern, "
                             "sliding-window and rope-orig-ctx cannot be negative "
                             "or that large");
    if (!s->head_dim && s->dim % s->n_heads)
        return sh__error_set(e, SH_EINVAL, "dim %lld is not divisible by heads %lld",
                             (long long)s->dim, (long long)s->n_heads);
    if (s->n_heads % s->n_kv_heads)
        return sh__error_set(e, SH_EINVAL, "heads %lld is not divisible by kv-heads %lld",
                             (long long)s->n_heads, (long long)s->n_kv_heads);
    const int64_t hd = sh__mkmodel_head_dim(s);
    if (hd % 2)
        return sh__error_set(e, SH_EINVAL, "head dim %lld is odd (RoPE rotates pairs)",
                             (long long)hd);
    const bool olmoe = arch_is(s, "olmoe");
    if ((arch_is(s, "phi3") || arch_is(s, "qwen2moe") || olmoe) && hd * s->n_heads != s->dim)
        return sh__error_set(e, SH_EINVAL, "%s needs head-dim x heads = dim (%lld x %lld != %lld)",
                             sh__mkmodel_arch(s), (long long)hd, (long long)s->n_heads,
                             (long long)s->dim);
    /* llama.cpp's olmoe takes K's norm to be dim wide: no grouped-query attention. */
    if (olmoe && s->n_kv_heads != s->n_heads)
        return sh__error_set(e, SH_EINVAL, "olmoe needs kv-heads = heads (%lld != %lld)",
                             (long long)s->n_kv_heads, (long long)s->n_heads);
    const bool moe_arch = arch_is(s, "qwen3moe") || arch_is(s, "qwen2moe") || olmoe;
    const bool moe_ok = moe_arch || arch_is(s, "llama");
    if (moe_arch && !s->n_experts)
        return sh__error_set(e, SH_EINVAL, "%s needs --experts", sh__mkmodel_arch(s));
    if (s->n_experts && !moe_ok)
        return sh__error_set(e, SH_EINVAL,
                             "%s has no experts (llama, qwen3moe, qwen2moe, olmoe do)",
                             sh__mkmodel_arch(s));
    if (s->shared_ffn < 0 || s->shared_ffn > (1 << 20) ||
        (s->shared_ffn && !arch_is(s, "qwen2moe")))
        return sh__error_set(e, SH_EINVAL, "a shared expert (--shared-ffn) is for qwen2moe");
    if (s->n_experts && (s->n_experts_used < 1 || s->n_experts_used > s->n_experts))
        return sh__error_set(e, SH_EINVAL, "experts-used %lld is outside 1..experts %lld",
                             (long long)s->n_experts_used, (long long)s->n_experts);
    if (!(s->rope_base > 0) || !(s->rms_eps > 0) || s->rope_base_swa < 0 || s->softcap < 0)
        return sh__error_set(e, SH_EINVAL, "rope base and rms eps must be positive");
    if (s->rope_scaling != SH_MKMODEL_ROPE_SCALING_NONE && !(s->rope_factor > 0))
        return sh__error_set(e, SH_EINVAL, "rope scaling needs a positive factor");
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LLAMA3 && !arch_is(s, "llama"))
        return sh__error_set(e, SH_EINVAL, "llama3 rope scaling is for the llama architecture");
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE && !arch_is(s, "phi3"))
        return sh__error_set(e, SH_EINVAL, "longrope scaling is for the phi3 architecture");
    return SH_OK;
}

/* ARCH.suffix into buf. */
static const char *akey(char *buf, size_t cap, const sh_mkmodel_shape *s, const char *suffix)
{
    snprintf(buf, cap, "%s.%s", sh__mkmodel_arch(s), suffix);
    return buf;
}

sh_err sh__mkmodel_arch_metadata(sh_gguf_writer *w, const sh_mkmodel_shape *s, sh_error *e)
{
    char k[96];
    const int64_t hd = sh__mkmodel_head_dim(s);
    const bool llama = arch_is(s, "llama"), phi3 = arch_is(s, "phi3");
    sh_err err;
#define U32(suffix, v)                                                                             \
    if ((err = sh__gguf_write_set_u32(w, akey(k, sizeof k, s, suffix), (uint32_t)(v), e)))         \
    return err
#define F32(suffix, v)                                                                             \
    if ((err = sh__gguf_write_set_f32(w, akey(k, sizeof k, s, suffix), (v), e)))                   \
    return err
    U32("context_length", s->ctx);
    U32("embedding_length", s->dim);
    U32("block_count", s->n_layers);
    /* A Mixtral-style llama or an OLMoE file has no other FFN: its feed_forward_length is the
     * experts' width (--expert-ffn where given), as llama.cpp reads it. */
    const bool ffn_is_expert = s->n_experts && (llama || arch_is(s, "olmoe"));
    U32("feed_forward_length", ffn_is_expert && s->expert_ffn ? s->expert_ffn : s->ffn);
    U32("attention.head_count", s->n_heads);
    U32("attention.head_count_kv", s->n_kv_heads);
    F32("rope.freq_base", s->rope_base);
    F32("attention.layer_norm_rms_epsilon", s->rms_eps);
    /* llama.cpp's converters write the rotated width for llama and phi3 and the head width
     * (key/value length) where the config names one: always for gemma3 and qwen3. */
    if (llama || phi3) {
        U32("rope.dimension_count", hd);
    }
    if (!llama && !phi3) {
        U32("attention.key_length", hd);
        U32("attention.value_length", hd);
    } else if (s->head_dim && s->head_dim * s->n_heads != s->dim) {
        U32("attention.key_length", hd);
        U32("attention.value_length", hd);
    }
    if (s->sliding_window > 0) {
        U32("attention.sliding_window", s->sliding_window);
    }
    if (s->swa_pattern > 0) {
        U32("attention.sliding_window_pattern", s->swa_pattern);
    }
    if (s->rope_base_swa > 0) {
        F32("rope.freq_base_swa", s->rope_base_swa);
    }
    if (s->softcap > 0) {
        F32("final_logit_softcapping", s->softcap);
    }
    const int64_t orig_ctx = s->rope_orig_ctx ? s->rope_orig_ctx : s->ctx;
    if (phi3) {
        U32("rope.scaling.original_context_length", orig_ctx);
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LINEAR ||
        s->rope_scaling == SH_MKMODEL_ROPE_SCALING_YARN) {
        bool yarn = s->rope_scaling == SH_MKMODEL_ROPE_SCALING_YARN;
        if ((err = sh__gguf_write_set_str(w, akey(k, sizeof k, s, "rope.scaling.type"),
                                          yarn ? "yarn" : "linear", e)))
            return err;
        F32("rope.scaling.factor", s->rope_factor);
        if (yarn && !phi3) {
            U32("rope.scaling.original_context_length", orig_ctx);
        }
    }
    if (s->n_experts) {
        U32("expert_count", s->n_experts);
        U32("expert_used_count", s->n_experts_used);
        /* Mixtral's and OLMoE's feed_forward_length is the expert width; qwen3moe and qwen2moe
         * name it apart. */
        if (!llama && !arch_is(s, "olmoe")) {
            U32("expert_feed_forward_length", s->expert_ffn ? s->expert_ffn : s->ffn);
        }
        if (arch_is(s, "qwen2moe")) {
            U32("expert_shared_feed_forward_length", s->shared_ffn ? s->shared_ffn : s->ffn);
        }
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE) {
        double f = s->rope_factor > 1 ? s->rope_factor : 1.0;
        F32("rope.scaling.attn_factor", (float)sqrt(1.0 + log(f) / log((double)orig_ctx)));
    }
    if (llama) {
        U32("vocab_size", s->vocab);
    }
#undef U32
#undef F32
    return SH_OK;
}

/* Llama 3's rope_freqs.weight: the divisor of each frequency base^(-2i/hd), as llama.cpp's
 * converter derives it from rope_scaling (factor, low_freq_factor 1, high_freq_factor 4,
 * original_max_position_embeddings): wavelengths shorter than orig / 4 keep their frequency,
 * longer than orig / 1 are divided by factor, and the band between is interpolated. */
static void llama3_rope_freqs(const sh_mkmodel_shape *s, float *out)
{
    const int64_t hd = sh__mkmodel_head_dim(s);
    const double lo = 1.0, hi = 4.0, factor = s->rope_factor;
    const double orig = (double)(s->rope_orig_ctx ? s->rope_orig_ctx : 8192);
    for (int64_t i = 0; i < hd / 2; i++) {
        double freq = 1.0 / pow(s->rope_base, (double)(2 * i) / (double)hd);
        double wavelen = 2.0 * 3.14159265358979323846 / freq;
        if (wavelen < orig / hi) {
            out[i] = 1.0f;
        } else if (wavelen > orig / lo) {
            out[i] = (float)factor;
        } else {
            double smooth = (orig / wavelen - lo) / (hi - lo);
            out[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
}

/* Adds the tensors in llama.cpp's naming; ne[0] is the input (contiguous) dimension, expert
 * tensors are (ne[0], ne[1], n_experts) with the expert index slowest. */
sh_err sh__mkmodel_arch_tensors(sh_gguf_writer *w, const sh_mkmodel_shape *s, sh_dtype type,
                                sh_gguf_write_fill_fn fill, void *user, float *factors_a,
                                float *factors_b, uint64_t *n_params, sh_error *e)
{
    const uint64_t dim = (uint64_t)s->dim, ffn = (uint64_t)s->ffn, vocab = (uint64_t)s->vocab;
    const uint64_t hd = (uint64_t)sh__mkmodel_head_dim(s);
    const uint64_t qd = hd * (uint64_t)s->n_heads, kv = hd * (uint64_t)s->n_kv_heads;
    const uint64_t nexp = (uint64_t)s->n_experts;
    const uint64_t eff = s->expert_ffn ? (uint64_t)s->expert_ffn : ffn;
    const bool gemma3 = arch_is(s, "gemma3"), phi3 = arch_is(s, "phi3");
    const bool qk_norm = gemma3 || arch_is(s, "qwen3") || arch_is(s, "qwen3moe");
    sh_err err = SH_OK;
    *n_params = 0;
#define ADD3(name, type, nd, d0, d1, d2)                                                           \
    do {                                                                                           \
        uint64_t ne_[3] = {(d0), (d1), (d2)};                                                      \
        if ((err = sh__gguf_write_add_tensor(w, name, type, nd, ne_, fill, user, e)))              \
            return err;                                                                            \
        *n_params += ne_[0] * ne_[1] * ne_[2];                                                     \
    } while (0)
#define ADD(name, type, nd, d0, d1) ADD3(name, type, nd, d0, d1, 1)
    ADD("token_embd.weight", type, 2, dim, vocab);
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LLAMA3) {
        uint64_t ne[1] = {hd / 2};
        llama3_rope_freqs(s, factors_a);
        if ((err = sh__gguf_write_add_tensor_data(w, "rope_freqs.weight", SH_DTYPE_F32, 1, ne,
                                                  factors_a, e)))
            return err;
        *n_params += hd / 2;
    }
    if (s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LONGROPE) {
        /* Made-up but smooth factors: long ones ramp from 1 (fast dims) to factor (slow ones),
         * short ones carry an eighth of that excess, as Phi-3's do in magnitude. */
        uint64_t ne[1] = {hd / 2};
        for (uint64_t i = 0; i < hd / 2; i++) {
            double r = hd > 2 ? (double)i / (double)(hd / 2 - 1) : 0.0;
            factors_a[i] = (float)(1.0 + (s->rope_factor - 1.0) * r);
            factors_b[i] = (float)(1.0 + (s->rope_factor - 1.0) * r / 8.0);
        }
        if ((err = sh__gguf_write_add_tensor_data(w, "rope_factors_long.weight", SH_DTYPE_F32, 1,
                                                  ne, factors_a, e)) ||
            (err = sh__gguf_write_add_tensor_data(w, "rope_factors_short.weight", SH_DTYPE_F32, 1,
                                                  ne, factors_b, e)))
            return err;
        *n_params += hd;
    }
    const bool qwen2moe = arch_is(s, "qwen2moe"), olmoe = arch_is(s, "olmoe");
    const uint64_t sff = s->shared_ffn ? (uint64_t)s->shared_ffn : ffn;
    for (int64_t l = 0; l < s->n_layers; l++) {
        char n[64];
#define LAYER3(suffix, type, nd, d0, d1, d2)                                                       \
    do {                                                                                           \
        snprintf(n, sizeof n, "blk.%lld.%s.weight", (long long)l, suffix);                         \
        ADD3(n, type, nd, d0, d1, d2);                                                             \
    } while (0)
#define LAYER(suffix, type, nd, d0, d1) LAYER3(suffix, type, nd, d0, d1, 1)
        LAYER("attn_norm", SH_DTYPE_F32, 1, dim, 1);
        if (phi3) {
            LAYER("attn_qkv", type, 2, dim, qd + 2 * kv);
        } else {
            LAYER("attn_q", type, 2, dim, qd);
            LAYER("attn_k", type, 2, dim, kv);
            LAYER("attn_v", type, 2, dim, kv);
        }
        if (qwen2moe) { /* Q/K/V biases, F32 as every 1-D tensor */
            static const char *const qkv[3] = {"q", "k", "v"};
            for (int b = 0; b < 3; b++) {
                snprintf(n, sizeof n, "blk.%lld.attn_%s.bias", (long long)l, qkv[b]);
                ADD(n, SH_DTYPE_F32, 1, b ? kv : qd, 1);
            }
        }
        if (qk_norm) {
            LAYER("attn_q_norm", SH_DTYPE_F32, 1, hd, 1);
            LAYER("attn_k_norm", SH_DTYPE_F32, 1, hd, 1);
        } else if (olmoe) { /* one norm over the whole Q and K (kv = qd = dim) */
            LAYER("attn_q_norm", SH_DTYPE_F32, 1, qd, 1);
            LAYER("attn_k_norm", SH_DTYPE_F32, 1, kv, 1);
        }
        LAYER("attn_output", type, 2, qd, dim);
        if (gemma3)
            LAYER("post_attention_norm", SH_DTYPE_F32, 1, dim, 1);
        LAYER("ffn_norm", SH_DTYPE_F32, 1, dim, 1);
        if (nexp) {
            /* The router stays F32, as llama.cpp's converter and quantizer keep it. */
            LAYER("ffn_gate_inp", SH_DTYPE_F32, 2, dim, nexp);
            LAYER3("ffn_gate_exps", type, 3, dim, eff, nexp);
            LAYER3("ffn_up_exps", type, 3, dim, eff, nexp);
            LAYER3("ffn_down_exps", type, 3, eff, dim, nexp);
            if (qwen2moe) { /* the shared expert and its sigmoid gate (one row, F32) */
                LAYER("ffn_gate_inp_shexp", SH_DTYPE_F32, 1, dim, 1);
                LAYER("ffn_gate_shexp", type, 2, dim, sff);
                LAYER("ffn_up_shexp", type, 2, dim, sff);
                LAYER("ffn_down_shexp", type, 2, sff, dim);
            }
        } else if (phi3) {
            LAYER("ffn_up", type, 2, dim, 2 * ffn); /* gate rows, then up rows */
            LAYER("ffn_down", type, 2, ffn, dim);
        } else {
            LAYER("ffn_gate", type, 2, dim, ffn);
            LAYER("ffn_up", type, 2, dim, ffn);
            LAYER("ffn_down", type, 2, ffn, dim);
        }
        if (gemma3)
            LAYER("post_ffw_norm", SH_DTYPE_F32, 1, dim, 1);
#undef LAYER
#undef LAYER3
    }
    ADD("output_norm.weight", SH_DTYPE_F32, 1, dim, 1);
    if (!s->tied)
        ADD("output.weight", type, 2, dim, vocab);
#undef ADD
#undef ADD3
    return err;
}
