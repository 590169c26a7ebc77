/* Unit tests of mkmodel's architectures (gemma3, qwen3, qwen3moe, phi3, Mixtral-style llama,
 * Llama 3 rope scaling): keys, tensor names and shapes as llama.cpp's converter writes them. */
#include <stdint.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/mkmodel.h"
#include "sh_test.h"

static char dir[] = "/tmp/sh_test_mkarchXXXXXX";

static const char *tmp_path(const char *name)
{
    static char buf[4][256];
    static int k;
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

/* A named shape scaled down to 2 layers of width 64 with 4 heads on 2 KV heads. */
static void small_opts(sh_mkmodel_opts *o, const char *shape)
{
    sh__mkmodel_opts_init(o);
    const sh_mkmodel_shape *s = sh__mkmodel_shape_find(shape);
    if (!s) {
        SH_FAIL_("shape %s missing", shape);
        return;
    }
    o->shape = *s;
    o->shape.n_layers = 2;
    o->shape.dim = 64;
    o->shape.ffn = 128;
    o->shape.n_heads = 4;
    o->shape.n_kv_heads = 2;
    o->shape.vocab = 300;
    o->shape.ctx = 256;
    o->type = SH_DTYPE_F16;
    o->seed = 3;
}

static uint32_t get_u32(const sh_gguf *g, const char *key)
{
    uint32_t v = 0;
    if (sh_gguf_get_u32(g, key, &v) != SH_OK)
        SH_FAIL_("key %s missing or not an integer", key);
    return v;
}

static float get_f32(const sh_gguf *g, const char *key)
{
    float v = 0;
    if (sh_gguf_get_f32(g, key, &v) != SH_OK)
        SH_FAIL_("key %s missing or not a float", key);
    return v;
}

static void check_tensor(const sh_gguf *g, const char *name, sh_dtype type, uint32_t n_dims,
                         uint64_t ne0, uint64_t ne1, uint64_t ne2)
{
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, name);
    if (!t) {
        SH_FAIL_("tensor %s missing", name);
        return;
    }
    if (t->type != type || t->n_dims != n_dims || t->ne[0] != ne0 ||
        (n_dims > 1 && t->ne[1] != ne1) || (n_dims > 2 && t->ne[2] != ne2))
        SH_FAIL_("tensor %s: %s %u dims [%llu, %llu, %llu], want %s %u dims [%llu, %llu, %llu]",
                 name, sh__dtype_name(t->type), t->n_dims, (unsigned long long)t->ne[0],
                 (unsigned long long)t->ne[1], (unsigned long long)t->ne[2], sh__dtype_name(type),
                 n_dims, (unsigned long long)ne0, (unsigned long long)ne1, (unsigned long long)ne2);
}

static void check_absent(const sh_gguf *g, const char *name)
{
    if (sh_gguf_find_tensor(g, name) || sh_gguf_find(g, name))
        SH_FAIL_("%s should not be in the file", name);
}

static sh_gguf *write_and_open(const sh_mkmodel_opts *o, const char *file, sh_mkmodel_result *res)
{
    sh_error e = {0};
    const char *path = tmp_path(file);
    if (sh__mkmodel_write(path, o, res, &e) != SH_OK) {
        SH_FAIL_("write %s: %s", file, e.msg);
        return NULL;
    }
    sh_gguf *g = NULL;
    if (sh_gguf_open(path, NULL, &g, &e) != SH_OK)
        SH_FAIL_("open %s: %s", file, e.msg);
    unlink(path); /* the mapping stays valid */
    return g;
}

static void check_arch(const sh_gguf *g, const char *arch)
{
    sh_str s;
    CHECK_OK(sh_gguf_get_str(g, "general.architecture", &s));
    if (!sh_str_eq(s, arch))
        SH_FAIL_("general.architecture '%.*s', want '%s'", (int)s.len, s.ptr, arch);
}

static void test_gemma3(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "gemma3-270m");
    o.shape.head_dim = 32;
    o.shape.swa_pattern = 3;
    o.shape.rope_base_swa = 20000.0f;
    o.shape.softcap = 30.0f;
    sh_mkmodel_result res = {0};
    sh_gguf *g = write_and_open(&o, "gemma3.gguf", &res);
    if (!g)
        return;
    check_arch(g, "gemma3");
    CHECK_UINT_EQ(get_u32(g, "gemma3.embedding_length"), 64);
    CHECK_UINT_EQ(get_u32(g, "gemma3.block_count"), 2);
    CHECK_UINT_EQ(get_u32(g, "gemma3.feed_forward_length"), 128);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.head_count"), 4);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.head_count_kv"), 2);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.key_length"), 32);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.value_length"), 32);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.sliding_window"), 512);
    CHECK_UINT_EQ(get_u32(g, "gemma3.attention.sliding_window_pattern"), 3);
    CHECK_UINT_EQ(get_u32(g, "gemma3.context_length"), 256);
    CHECK_NEAR(get_f32(g, "gemma3.rope.freq_base"), 1e6, 0);
    CHECK_NEAR(get_f32(g, "gemma3.rope.freq_base_swa"), 20000, 0);
    CHECK_NEAR(get_f32(g, "gemma3.final_logit_softcapping"), 30, 0);
    CHECK_NEAR(get_f32(g, "gemma3.attention.layer_norm_rms_epsilon"), 1e-6, 1e-12);
    check_absent(g, "llama.vocab_size");
    check_absent(g, "gemma3.rope.dimension_count");
    /* embedding + output norm + per layer: 4 norms of 64, q/k norms of 32, q (64 -> 128),
     * k, v (64 -> 64), o (128 -> 64), gate/up (64 -> 128), down; tied head. */
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 1 + 1 + 2 * 13);
    check_absent(g, "output.weight");
    check_tensor(g, "token_embd.weight", SH_DTYPE_F16, 2, 64, 300, 1);
    check_tensor(g, "blk.1.attn_q.weight", SH_DTYPE_F16, 2, 64, 128, 1);
    check_tensor(g, "blk.1.attn_k.weight", SH_DTYPE_F16, 2, 64, 64, 1);
    check_tensor(g, "blk.1.attn_v.weight", SH_DTYPE_F16, 2, 64, 64, 1);
    check_tensor(g, "blk.1.attn_output.weight", SH_DTYPE_F16, 2, 128, 64, 1);
    check_tensor(g, "blk.1.attn_q_norm.weight", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.1.attn_k_norm.weight", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.1.attn_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.post_attention_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.ffn_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.post_ffw_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.ffn_gate.weight", SH_DTYPE_F16, 2, 64, 128, 1);
    check_tensor(g, "blk.1.ffn_up.weight", SH_DTYPE_F16, 2, 64, 128, 1);
    check_tensor(g, "blk.1.ffn_down.weight", SH_DTYPE_F16, 2, 128, 64, 1);
    /* Gemma norms are stored with the +1 folded in (the converter adds it): near 1. */
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "blk.0.post_ffw_norm.weight");
    if (t) {
        const float *x = t->data;
        for (int i = 0; i < 64; i++)
            if (x[i] < 0.85f || x[i] > 1.15f)
                SH_FAIL_("post_ffw_norm[%d] = %g is not near 1", i, (double)x[i]);
    }
    CHECK_UINT_EQ(res.n_params,
                  300 * 64 + 64 +
                      2 * (4 * 64 + 2 * 32 + 64 * 128 + 2 * 64 * 64 + 128 * 64 + 3 * 64 * 128));
    sh_gguf_close(g);
}

static void test_qwen3(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "qwen3-0.6b");
    o.shape.head_dim = 32;
    sh_gguf *g = write_and_open(&o, "qwen3.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "qwen3");
    CHECK_UINT_EQ(get_u32(g, "qwen3.attention.key_length"), 32);
    CHECK_UINT_EQ(get_u32(g, "qwen3.attention.head_count_kv"), 2);
    CHECK_NEAR(get_f32(g, "qwen3.rope.freq_base"), 1e6, 0);
    check_absent(g, "qwen3.attention.sliding_window");
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 1 + 1 + 2 * 11);
    check_tensor(g, "blk.0.attn_q_norm.weight", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.0.attn_k_norm.weight", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.0.attn_q.weight", SH_DTYPE_F16, 2, 64, 128, 1);
    check_absent(g, "blk.0.attn_q.bias");
    check_absent(g, "blk.0.post_attention_norm.weight");
    check_absent(g, "output.weight");
    sh_gguf_close(g);
}

static void test_qwen3moe(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "qwen3moe-tiny");
    o.shape.head_dim = 16;
    o.shape.n_experts = 8;
    o.shape.n_experts_used = 3;
    o.shape.expert_ffn = 32;
    o.type = SH_DTYPE_Q8_0;
    sh_gguf *g = write_and_open(&o, "qwen3moe.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "qwen3moe");
    CHECK_UINT_EQ(get_u32(g, "qwen3moe.expert_count"), 8);
    CHECK_UINT_EQ(get_u32(g, "qwen3moe.expert_used_count"), 3);
    CHECK_UINT_EQ(get_u32(g, "qwen3moe.expert_feed_forward_length"), 32);
    CHECK_UINT_EQ(get_u32(g, "qwen3moe.feed_forward_length"), 128);
    /* embedding, output norm, output + per layer: 2 norms, q/k norms, q, k, v, o, router, 3
     * expert tensors. */
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 3 + 2 * 12);
    check_tensor(g, "output.weight", SH_DTYPE_Q8_0, 2, 64, 300, 1);
    check_tensor(g, "blk.1.attn_q.weight", SH_DTYPE_Q8_0, 2, 64, 64, 1);
    check_tensor(g, "blk.1.attn_k.weight", SH_DTYPE_Q8_0, 2, 64, 32, 1);
    check_tensor(g, "blk.1.attn_q_norm.weight", SH_DTYPE_F32, 1, 16, 1, 1);
    check_tensor(g, "blk.1.ffn_gate_inp.weight", SH_DTYPE_F32, 2, 64, 8, 1);
    check_tensor(g, "blk.1.ffn_gate_exps.weight", SH_DTYPE_Q8_0, 3, 64, 32, 8);
    check_tensor(g, "blk.1.ffn_up_exps.weight", SH_DTYPE_Q8_0, 3, 64, 32, 8);
    check_tensor(g, "blk.1.ffn_down_exps.weight", SH_DTYPE_Q8_0, 3, 32, 64, 8);
    check_absent(g, "blk.1.ffn_gate.weight");
    /* Experts get distinct weights: expert 0's and expert 1's first rows differ. */
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "blk.0.ffn_up_exps.weight");
    if (t) {
        uint64_t row = sh__dtype_row_bytes(t->type, t->ne[0]);
        CHECK(memcmp(t->data, (const uint8_t *)t->data + 32 * row, row) != 0);
    }
    sh_gguf_close(g);
}

static void test_mixtral(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "mixtral-tiny");
    o.shape.n_experts = 4;
    o.shape.n_experts_used = 2;
    o.shape.ffn = 96;
    sh_gguf *g = write_and_open(&o, "mixtral.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "llama");
    CHECK_UINT_EQ(get_u32(g, "llama.expert_count"), 4);
    CHECK_UINT_EQ(get_u32(g, "llama.expert_used_count"), 2);
    CHECK_UINT_EQ(get_u32(g, "llama.feed_forward_length"), 96); /* Mixtral: the expert width */
    CHECK_UINT_EQ(get_u32(g, "llama.rope.dimension_count"), 16);
    CHECK_UINT_EQ(get_u32(g, "llama.vocab_size"), 300);
    check_absent(g, "llama.expert_feed_forward_length");
    check_absent(g, "llama.attention.key_length");
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 3 + 2 * 10);
    check_tensor(g, "blk.0.ffn_gate_inp.weight", SH_DTYPE_F32, 2, 64, 4, 1);
    check_tensor(g, "blk.0.ffn_gate_exps.weight", SH_DTYPE_F16, 3, 64, 96, 4);
    check_tensor(g, "blk.0.ffn_down_exps.weight", SH_DTYPE_F16, 3, 96, 64, 4);
    check_absent(g, "blk.0.attn_q_norm.weight");
    sh_gguf_close(g);
}

static void test_qwen2moe(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "qwen2moe-tiny");
    o.shape.n_experts = 4;
    o.shape.n_experts_used = 2;
    o.shape.expert_ffn = 32;
    o.shape.shared_ffn = 96;
    sh_gguf *g = write_and_open(&o, "qwen2moe.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "qwen2moe");
    CHECK_UINT_EQ(get_u32(g, "qwen2moe.expert_count"), 4);
    CHECK_UINT_EQ(get_u32(g, "qwen2moe.expert_used_count"), 2);
    CHECK_UINT_EQ(get_u32(g, "qwen2moe.expert_feed_forward_length"), 32);
    CHECK_UINT_EQ(get_u32(g, "qwen2moe.expert_shared_feed_forward_length"), 96);
    /* embedding, output norm, output + per layer: 2 norms, q/k/v and their biases, o, router,
     * 3 expert tensors, the shared expert's gate row and 3 matrices. */
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 3 + 2 * 17);
    check_tensor(g, "blk.0.attn_q.bias", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.0.attn_k.bias", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.0.attn_v.bias", SH_DTYPE_F32, 1, 32, 1, 1);
    check_tensor(g, "blk.0.ffn_gate_inp_shexp.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.0.ffn_gate_shexp.weight", SH_DTYPE_F16, 2, 64, 96, 1);
    check_tensor(g, "blk.0.ffn_up_shexp.weight", SH_DTYPE_F16, 2, 64, 96, 1);
    check_tensor(g, "blk.0.ffn_down_shexp.weight", SH_DTYPE_F16, 2, 96, 64, 1);
    check_tensor(g, "blk.0.ffn_down_exps.weight", SH_DTYPE_F16, 3, 32, 64, 4);
    check_absent(g, "blk.0.attn_q_norm.weight");
    /* Biases and the shared gate are centred on 0, norms on 1. */
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "blk.1.attn_q.bias");
    if (t) {
        double sum = 0;
        for (int i = 0; i < 64; i++)
            sum += ((const float *)t->data)[i];
        CHECK(fabs(sum / 64) < 0.02);
    }
    sh_gguf_close(g);
}

static void test_olmoe(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "olmoe-tiny");
    o.shape.n_kv_heads = 4;
    o.shape.ffn = 96;
    o.shape.n_experts = 4;
    o.shape.n_experts_used = 2;
    sh_gguf *g = write_and_open(&o, "olmoe.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "olmoe");
    CHECK_UINT_EQ(get_u32(g, "olmoe.expert_count"), 4);
    CHECK_UINT_EQ(get_u32(g, "olmoe.feed_forward_length"), 96); /* the expert width */
    check_absent(g, "olmoe.expert_feed_forward_length");
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 3 + 2 * 12);
    /* QK-norm over the whole of Q and K, not per head. */
    check_tensor(g, "blk.1.attn_q_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.attn_k_norm.weight", SH_DTYPE_F32, 1, 64, 1, 1);
    check_tensor(g, "blk.1.ffn_up_exps.weight", SH_DTYPE_F16, 3, 64, 96, 4);
    sh_gguf_close(g);
}

static void test_phi3(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "phi3-mini");
    sh_gguf *g = write_and_open(&o, "phi3.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "phi3");
    CHECK_UINT_EQ(get_u32(g, "phi3.rope.dimension_count"), 16);
    CHECK_UINT_EQ(get_u32(g, "phi3.rope.scaling.original_context_length"), 4096);
    CHECK_UINT_EQ(get_u32(g, "phi3.attention.sliding_window"), 2047);
    CHECK_UINT_EQ(sh_gguf_n_tensors(g), 3 + 2 * 6);
    /* Fused rows: 64 query, 32 key, 32 value; gate rows then up rows. */
    check_tensor(g, "blk.0.attn_qkv.weight", SH_DTYPE_F16, 2, 64, 128, 1);
    check_tensor(g, "blk.0.attn_output.weight", SH_DTYPE_F16, 2, 64, 64, 1);
    check_tensor(g, "blk.0.ffn_up.weight", SH_DTYPE_F16, 2, 64, 256, 1);
    check_tensor(g, "blk.0.ffn_down.weight", SH_DTYPE_F16, 2, 128, 64, 1);
    check_absent(g, "blk.0.attn_q.weight");
    check_absent(g, "blk.0.ffn_gate.weight");
    /* llama.cpp looks these control tokens up by name in phi3 files. */
    const sh_gguf_value *toks = NULL;
    CHECK_OK(sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &toks));
    if (toks && toks->v.arr.n == 300) {
        CHECK(sh_str_eq(toks->v.arr.strs[296], "<unk>"));
        CHECK(sh_str_eq(toks->v.arr.strs[297], "<s>"));
        CHECK(sh_str_eq(toks->v.arr.strs[298], "</s>"));
        CHECK(sh_str_eq(toks->v.arr.strs[299], "<|endoftext|>"));
    }
    CHECK_UINT_EQ(get_u32(g, "tokenizer.ggml.bos_token_id"), 297);
    CHECK_UINT_EQ(get_u32(g, "tokenizer.ggml.eos_token_id"), 299);
    sh_gguf_close(g);
}

/* Llama 3 scaling as rope_freqs.weight; expected values from the converter's formula evaluated
 * in Python (tests/reference/ref_rope.py llama3_factors(10000, 16, 8, 1, 4, 64)). */
static void test_rope_scaling(void)
{
    sh_mkmodel_opts o;
    small_opts(&o, "llama3.2-1b");
    o.shape.rope_base = 10000.0f;
    o.shape.rope_factor = 8.0f;
    o.shape.rope_orig_ctx = 64;
    sh_gguf *g = write_and_open(&o, "llama3.gguf", NULL);
    if (!g)
        return;
    check_arch(g, "llama");
    check_absent(g, "llama.rope.scaling.type");
    check_tensor(g, "rope_freqs.weight", SH_DTYPE_F32, 1, 8, 1, 1);
    check_absent(g, "rope_factors_long.weight");
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "rope_freqs.weight");
    static const double want[8] = {1.0, 1.29397583, 7.6673851, 8, 8, 8, 8, 8};
    for (int i = 0; t && i < 8; i++)
        CHECK_NEAR(((const float *)t->data)[i], want[i], 1e-6);
    sh_gguf_close(g);

    small_opts(&o, "qwen3-0.6b");
    o.shape.rope_scaling = SH_MKMODEL_ROPE_SCALING_YARN;
    o.shape.rope_factor = 4.0f;
    o.shape.rope_orig_ctx = 128;
    g = write_and_open(&o, "yarn.gguf", NULL);
    if (!g)
        return;
    sh_str s;
    CHECK_OK(sh_gguf_get_str(g, "qwen3.rope.scaling.type", &s));
    CHECK(sh_str_eq(s, "yarn"));
    CHECK_NEAR(get_f32(g, "qwen3.rope.scaling.factor"), 4, 0);
    CHECK_UINT_EQ(get_u32(g, "qwen3.rope.scaling.original_context_length"), 128);
    check_absent(g, "rope_freqs.weight");
    sh_gguf_close(g);

    /* Phi-3 long context: both factor tensors and the magnitude factor. */
    small_opts(&o, "phi3-mini");
    o.shape.rope_scaling = SH_MKMODEL_ROPE_SCALING_LONGROPE;
    o.shape.rope_factor = 32.0f;
    o.shape.rope_orig_ctx = 4096;
    g = write_and_open(&o, "longrope.gguf", NULL);
    if (!g)
        return;
    check_tensor(g, "rope_factors_long.weight", SH_DTYPE_F32, 1, 8, 1, 1);
    check_tensor(g, "rope_factors_short.weight", SH_DTYPE_F32, 1, 8, 1, 1);
    const sh_gguf_tensor *lt = sh_gguf_find_tensor(g, "rope_factors_long.weight");
    const sh_gguf_tensor *st = sh_gguf_find_tensor(g, "rope_factors_short.weight");
    if (lt && st) {
        const float *l = lt->data, *sh = st->data;
        CHECK_NEAR(l[0], 1.0, 0);
        CHECK_NEAR(l[7], 32.0, 1e-5);
        CHECK_NEAR(sh[7], 1.0 + 31.0 / 8, 1e-5);
        for (int i = 1; i < 8; i++)
            CHECK(l[i] > l[i - 1] && sh[i] > sh[i - 1] && sh[i] < l[i]);
    }
    /* Phi-3 128k's converter: sqrt(1 + ln(131072 / 4096) / ln 4096). */
    CHECK_NEAR(get_f32(g, "phi3.rope.scaling.attn_factor"), sqrt(1.0 + log(32.0) / log(4096.0)),
               1e-6);
    check_absent(g, "phi3.rope.scaling.type");
    sh_gguf_close(g);
}

static void test_named(void)
{
    const sh_mkmodel_shape *s = sh__mkmodel_shape_find("gemma3-270m");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "gemma3") == 0 && s->n_layers == 18 && s->dim == 640 &&
          s->ffn == 2048 && s->n_heads == 4 && s->n_kv_heads == 1 &&
          sh__mkmodel_head_dim(s) == 256 && s->vocab == 262144 && s->sliding_window == 512 &&
          s->rope_base == 1e6f && s->tied);
    s = sh__mkmodel_shape_find("qwen3-0.6b");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "qwen3") == 0 && s->n_layers == 28 && s->dim == 1024 &&
          s->ffn == 3072 && s->n_heads == 16 && s->n_kv_heads == 8 &&
          sh__mkmodel_head_dim(s) == 128 && s->vocab == 151936 && s->tied);
    s = sh__mkmodel_shape_find("qwen3moe-tiny");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "qwen3moe") == 0 && s->n_experts == 16 &&
          s->n_experts_used == 4 && s->expert_ffn == 256);
    s = sh__mkmodel_shape_find("phi3-mini");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "phi3") == 0 && s->n_layers == 32 && s->dim == 3072 &&
          s->ffn == 8192 && s->n_heads == 32 && s->n_kv_heads == 32 && s->vocab == 32064 &&
          !s->tied);
    s = sh__mkmodel_shape_find("mixtral-tiny");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "llama") == 0 && s->n_experts == 8 &&
          s->n_experts_used == 2);
    s = sh__mkmodel_shape_find("qwen2moe-tiny");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "qwen2moe") == 0 && s->n_experts == 8 &&
          s->n_experts_used == 4 && s->shared_ffn == 1024);
    s = sh__mkmodel_shape_find("olmoe-tiny");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "olmoe") == 0 && s->n_experts == 16 &&
          s->n_experts_used == 4 && s->n_kv_heads == s->n_heads);
    s = sh__mkmodel_shape_find("llama3.2-1b");
    CHECK(s && s->rope_scaling == SH_MKMODEL_ROPE_SCALING_LLAMA3 && s->rope_factor == 32.0f &&
          s->rope_orig_ctx == 8192 && s->tied);
    s = sh__mkmodel_shape_find("smollm2-135m");
    CHECK(s && strcmp(sh__mkmodel_arch(s), "llama") == 0 && s->n_experts == 0);
}

static void test_errors(void)
{
    const char *path = tmp_path("bad.gguf");
    struct {
        const char *shape, *want;
        void (*edit)(sh_mkmodel_shape *);
    } cases[] = {
        {"qwen3moe-tiny", "needs --experts", NULL},
        {"mixtral-tiny", "experts-used", NULL},
        {"gemma3-270m", "has no experts", NULL},
        {"phi3-mini", "head-dim x heads", NULL},
        {"qwen3-0.6b", "llama3 rope scaling", NULL},
        {"qwen3-0.6b", "not one of", NULL},
        {"qwen3-0.6b", "odd", NULL},
        {"qwen3moe-tiny", "is for qwen2moe", NULL},
        {"mixtral-tiny", "longrope scaling is for the phi3", NULL},
        {"qwen2moe-tiny", "qwen2moe needs head-dim x heads", NULL},
        {"olmoe-tiny", "olmoe needs kv-heads = heads", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sh_mkmodel_opts o;
        small_opts(&o, cases[i].shape);
        switch (i) {
        case 0:
            o.shape.n_experts = 0;
            break;
        case 1:
            o.shape.n_experts_used = 9;
            break;
        case 2:
            o.shape.n_experts = 4;
            o.shape.n_experts_used = 2;
            break;
        case 3:
            o.shape.head_dim = 32;
            break;
        case 4:
            o.shape.rope_scaling = SH_MKMODEL_ROPE_SCALING_LLAMA3;
            o.shape.rope_factor = 8;
            break;
        case 5:
            o.shape.arch = "gpt2";
            break;
        case 6:
            o.shape.head_dim = 17;
            break;
        case 7:
            o.shape.shared_ffn = 64;
            break;
        case 8:
            o.shape.rope_scaling = SH_MKMODEL_ROPE_SCALING_LONGROPE;
            o.shape.rope_factor = 4;
            break;
        case 9:
            o.shape.head_dim = 32;
            break;
        default:
            break; /* small_opts' 2 KV heads for 4 heads */
        }
        sh_error e = {0};
        CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
        if (!strstr(e.msg, cases[i].want))
            SH_FAIL_("case %zu: '%s' does not say '%s'", i, e.msg, cases[i].want);
        CHECK(access(path, F_OK) != 0);
    }
    /* A quantized type needs whole blocks in every row width: heads x head-dim too. */
    sh_mkmodel_opts o;
    small_opts(&o, "qwen3-0.6b");
    o.shape.head_dim = 12; /* queries 48 wide */
    o.type = SH_DTYPE_Q8_0;
    sh_error e = {0};
    CHECK_INT_EQ(sh__mkmodel_write(path, &o, NULL, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "heads x head-dim (48) is not a multiple of 32") != NULL);
}

static const sh_test_case tests[] = {
    {"gemma3", test_gemma3},
    {"qwen3", test_qwen3},
    {"qwen3moe", test_qwen3moe},
    {"mixtral", test_mixtral},
    {"qwen2moe", test_qwen2moe},
    {"olmoe", test_olmoe},
    {"phi3", test_phi3},
    {"rope_scaling", test_rope_scaling},
    {"named", test_named},
    {"errors", test_errors},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    rmdir(dir);
    return rc;
}
