/* Llama-family loading (llama, mistral, qwen2, qwen3, gemma3, phi3, and the MoE forms mixtral,
 * qwen2moe, qwen3moe, olmoe through llama_moe.c): hyperparameters and weight views from a GGUF or a
 * llama2.c checkpoint. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/file.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/llama2c.h"
#include "model/llama_moe.h"
#include "model/llama_rope.h"
#include "model/llama_tp.h"

/* Weight types the backend's matmul takes (backend.h, sh_matmul_args). */
static bool matmul_type_ok(sh_dtype t)
{
    return t == SH_DTYPE_F32 || t == SH_DTYPE_F16 || t == SH_DTYPE_BF16 || t == SH_DTYPE_Q8_0 ||
           t == SH_DTYPE_Q4_0 || t == SH_DTYPE_Q4_1 || t == SH_DTYPE_Q5_0 || t == SH_DTYPE_Q5_1 ||
           t == SH_DTYPE_Q2_K || t == SH_DTYPE_Q3_K || t == SH_DTYPE_Q4_K || t == SH_DTYPE_Q5_K ||
           t == SH_DTYPE_Q6_K || t == SH_DTYPE_IQ4_NL || t == SH_DTYPE_IQ4_XS;
}

/* ---- GGUF -------------------------------------------------------------------------------- */

static sh_err get_i32(const sh_gguf *g, const char *arch, const char *key, int32_t *out,
                      int32_t dflt, bool required, sh_error *e)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    sh_err err = sh_gguf_get_i32(g, full, out);
    if (err == SH_ENOTFOUND && !required) {
        *out = dflt;
        return SH_OK;
    }
    if (err)
        return sh__error_set(e, SH_EFORMAT, "metadata %s: %s", full, sh_strerror(err));
    if (*out <= 0)
        return sh__error_set(e, SH_EFORMAT, "metadata %s: %d is not positive", full, (int)*out);
    return SH_OK;
}

static sh_err get_f32(const sh_gguf *g, const char *arch, const char *key, float *out, float dflt,
                      sh_error *e)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    sh_err err = sh_gguf_get_f32(g, full, out);
    if (err == SH_ENOTFOUND) {
        *out = dflt;
        return SH_OK;
    }
    if (err || !isfinite(*out) || *out <= 0.0f)
        return sh__error_set(e, SH_EFORMAT, "metadata %s: bad value", full);
    return SH_OK;
}

/* Binds tensor `name` as (ne1 rows of ne0); vectors (ne1 == 0) must be f32. A missing optional
 * tensor leaves t->data NULL. */
static sh_err bind(const sh_gguf *g, const char *name, int64_t ne0, int64_t ne1, bool optional,
                   sh_tensor *t, sh_error *e)
{
    memset(t, 0, sizeof *t);
    const sh_gguf_tensor *gt = sh_gguf_find_tensor(g, name);
    if (!gt) {
        if (optional)
            return SH_OK;
        return sh__error_set(e, SH_EFORMAT, "tensor '%s' is missing", name);
    }
    int64_t want1 = ne1 ? ne1 : 1;
    if ((int64_t)gt->ne[0] != ne0 || (int64_t)gt->ne[1] != want1 || gt->ne[2] != 1 ||
        gt->ne[3] != 1)
        return sh__error_set(e, SH_EFORMAT,
                             "tensor '%s': shape [%llu, %llu, %llu, %llu], expected [%lld, %lld]",
                             name, (unsigned long long)gt->ne[0], (unsigned long long)gt->ne[1],
                             (unsigned long long)gt->ne[2], (unsigned long long)gt->ne[3],
                             (long long)ne0, (long long)want1);
    if (ne1 == 0 ? gt->type != SH_DTYPE_F32 : !matmul_type_ok(gt->type))
        return sh__error_set(e, SH_EUNSUPPORTED, "tensor '%s': type %s is not supported here", name,
                             sh__dtype_name(gt->type));
    t->type = gt->type;
    t->ne[0] = ne0;
    t->ne[1] = want1;
    t->ne[2] = t->ne[3] = 1;
    t->data = (void *)gt->data; // weights are read-only; the backend never writes them
    return SH_OK;
}

/* Gemma 3's layout of local (sliding-window) and global layers, <arch>.attention.
 * sliding_window_pattern: a period p (layer l slides when l % p < p - 1), or one bool per layer,
 * which must then follow such a period (the only layouts the KV manager and forward pass know).
 * Absent: `dflt`. Sets hp->swa_period, or hp->sliding_window = 0 when no layer slides. */
static sh_err load_swa_pattern(const sh_gguf *g, const char *arch, int32_t dflt,
                               sh_llama_hparams *hp, sh_error *e)
{
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", arch);
    const sh_gguf_value *v = sh_gguf_find(g, key);
    int32_t p = dflt;
    if (v && v->type == SH_GGUF_ARRAY) {
        const sh_gguf_value *arr;
        if (sh_gguf_get_arr(g, key, SH_GGUF_BOOL, &arr) || arr->v.arr.n != (uint64_t)hp->n_layers)
            return sh__error_set(e, SH_EFORMAT, "metadata %s: want %d bools", key,
                                 (int)hp->n_layers);
        /* the smallest period giving the same layers (1: none slides, n_layers + 1: all do) */
        for (p = 1; p <= hp->n_layers + 1; p++) {
            bool same = true;
            for (int32_t l = 0; l < hp->n_layers && same; l++)
                same = (sh_gguf_arr_u64(arr, (uint64_t)l) != 0) == (l % p < p - 1);
            if (same)
                break;
        }
        if (p > hp->n_layers + 1)
            return sh__error_set(e, SH_EUNSUPPORTED,
                                 "metadata %s: sliding layers without a period (not supported)",
                                 key);
    } else if (v) {
        sh_err err = sh_gguf_get_i32(g, key, &p);
        if (err || p < 0)
            return sh__error_set(e, SH_EFORMAT, "metadata %s: bad value", key);
    }
    if (p == 1) /* every layer global */
        hp->sliding_window = 0;
    hp->swa_period = p == 1 || p > hp->n_layers ? 0 : p; /* past n_layers: every layer slides */
    return SH_OK;
}

/* The settings particular to phi3, qwen3, olmoe and gemma3 (llama, mistral and qwen2 keep the
 * defaults). */
static sh_err load_arch_extras(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e)
{
    const char *a = hp->arch;
    sh_err err;
    if (strcmp(a, "phi3") == 0) {
        /* phi3's converted files carry a sliding window without saying which layers use it;
         * llama.cpp and the reference attend over the whole context, so do we. */
        hp->sliding_window = 0;
        return SH_OK;
    }
    if (strcmp(a, "qwen3") == 0 || strcmp(a, "qwen3moe") == 0) {
        hp->qk_norm = true;
        return SH_OK;
    }
    if (strcmp(a, "olmoe") == 0) { /* one norm over all of q, one over all of k (llama.cpp) */
        hp->qk_norm = hp->qk_norm_full = true;
        if (hp->n_expert == 0)
            return sh__error_set(e, SH_EFORMAT, "metadata olmoe.expert_count is missing");
        return SH_OK;
    }
    if (strcmp(a, "gemma3") != 0)
        return SH_OK;
    hp->qk_norm = true;
    hp->post_norms = true;
    hp->ffn_act = SH_MATMUL_ACT_GEGLU;
    hp->embd_scale = sqrtf((float)hp->dim);
    /* Gemma's query_pre_attn_scalar is head_dim except for the 27B model (62 layers), where it
     * is dim / n_heads; GGUF does not store it, so the layer count tells them apart as
     * llama.cpp does. */
    if (hp->n_layers == 62)
        hp->attn_scale = 1.0f / sqrtf((float)(hp->dim / hp->n_heads));
    if (hp->sliding_window > 0) {
        if ((err = load_swa_pattern(g, a, 6, hp, e)) ||
            (err = get_f32(g, a, "rope.freq_base_swa", &hp->rope_base_swa, 10000.0f, e)))
            return err;
    }
    if ((err = get_f32(g, a, "final_logit_softcapping", &hp->final_softcap, 0.0f, e)))
        return err;
    char key[128];
    float cap = 0.0f;
    snprintf(key, sizeof key, "%s.attn_logit_softcapping", a);
    if (sh_gguf_get_f32(g, key, &cap) == SH_OK && cap != 0.0f)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "metadata %s: attention soft-capping (Gemma 2) "
                             "is not supported",
                             key);
    return SH_OK;
}

static sh_err load_gguf_hparams(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e)
{
    sh_str arch;
    if (sh_gguf_get_str(g, "general.architecture", &arch))
        return sh__error_set(e, SH_EFORMAT, "metadata general.architecture is missing");
    if (arch.len >= sizeof hp->arch)
        return sh__error_set(e, SH_EUNSUPPORTED, "architecture name too long");
    memcpy(hp->arch, arch.ptr, arch.len);
    hp->arch[arch.len] = '\0';
    /* GGUF stores llama and mistral Q/K rows permuted for adjacent-pair RoPE; the others rotate
     * halves (NEOX). */
    bool neox = strcmp(hp->arch, "qwen2") == 0 || strcmp(hp->arch, "qwen3") == 0 ||
                strcmp(hp->arch, "gemma3") == 0 || strcmp(hp->arch, "qwen2moe") == 0 ||
                strcmp(hp->arch, "qwen3moe") == 0 || strcmp(hp->arch, "phi3") == 0 ||
                strcmp(hp->arch, "olmoe") == 0;
    if (!neox && strcmp(hp->arch, "llama") != 0 && strcmp(hp->arch, "mistral") != 0)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "architecture '%s' (llama, mistral, qwen2, qwen2moe, qwen3, qwen3moe, "
                             "gemma3, phi3, olmoe only)",
                             hp->arch);
    const char *a = hp->arch;
    sh_err err;
    if ((err = get_i32(g, a, "embedding_length", &hp->dim, 0, true, e)) ||
        (err = get_i32(g, a, "block_count", &hp->n_layers, 0, true, e)) ||
        (err = get_i32(g, a, "feed_forward_length", &hp->n_ff, 0, true, e)) ||
        (err = get_i32(g, a, "attention.head_count", &hp->n_heads, 0, true, e)) ||
        (err = get_i32(g, a, "attention.head_count_kv", &hp->n_kv_heads, hp->n_heads, false, e)) ||
        (err = get_i32(g, a, "context_length", &hp->n_ctx_train, 2048, false, e)) ||
        (err = get_i32(g, a, "attention.sliding_window", &hp->sliding_window, 0, false, e)) ||
        (err = get_i32(g, a, "attention.key_length", &hp->head_dim, hp->dim / hp->n_heads, false,
                       e)) ||
        (err = get_i32(g, a, "rope.dimension_count", &hp->n_rot, hp->head_dim, false, e)) ||
        (err = get_f32(g, a, "rope.freq_base", &hp->rope_base, 10000.0f, e)) ||
        (err = get_f32(g, a, "attention.layer_norm_rms_epsilon", &hp->norm_eps, 1e-5f, e)) ||
        (err = sh__llama_moe_hparams(g, hp, e)))
        return err;
    /* Each layer has several tensors: a block count past the file's tensors is refused here,
     * before the per-layer table is allocated (a few bytes of metadata must not ask for
     * gigabytes). */
    if ((uint64_t)hp->n_layers > sh_gguf_n_tensors(g))
        return sh__error_set(e, SH_EFORMAT,
                             "metadata %s.block_count: %d layers in a file of %llu tensors", a,
                             (int)hp->n_layers, (unsigned long long)sh_gguf_n_tensors(g));
    if (hp->n_heads % hp->n_kv_heads != 0)
        return sh__error_set(e, SH_EFORMAT, "%d heads are not a multiple of %d KV heads",
                             (int)hp->n_heads, (int)hp->n_kv_heads);
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0)
        return sh__error_set(e, SH_EFORMAT, "rope dimension %d with head size %d", (int)hp->n_rot,
                             (int)hp->head_dim);
    if ((err = sh__llama_rope_hparams(g, hp, e)))
        return err;
    int32_t v_len;
    if ((err = get_i32(g, a, "attention.value_length", &v_len, hp->head_dim, false, e)))
        return err;
    if (v_len != hp->head_dim)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "metadata %s.attention.value_length: %d differs "
                             "from the key length %d",
                             a, (int)v_len, (int)hp->head_dim);
    hp->rope_mode = neox ? SH_ROPE_MODE_NEOX : SH_ROPE_MODE_NORMAL;
    hp->rope_base_swa = hp->rope_base;
    hp->ffn_act = SH_MATMUL_ACT_SWIGLU;
    hp->embd_scale = 1.0f;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    if ((err = load_arch_extras(g, hp, e)))
        return err;
    const sh_gguf_tensor *emb = sh_gguf_find_tensor(g, "token_embd.weight");
    if (!emb)
        return sh__error_set(e, SH_EFORMAT, "tensor 'token_embd.weight' is missing");
    if (emb->ne[1] == 0 || emb->ne[1] > (1u << 24))
        return sh__error_set(e, SH_EFORMAT, "token_embd.weight has %llu rows",
                             (unsigned long long)emb->ne[1]);
    hp->n_vocab = (int32_t)emb->ne[1];
    hp->tied_embeddings = sh_gguf_find_tensor(g, "output.weight") == NULL;
    hp->qkv_bias = sh_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    return SH_OK;
}

/* Rows [r0, r0 + n) of matrix t, pointing into t's data (row sizes are whole quant blocks). */
static sh_tensor row_view(const sh_tensor *t, int64_t r0, int64_t n)
{
    sh_tensor v = *t;
    v.ne[1] = n;
    v.data = (uint8_t *)t->data + sh__dtype_row_bytes(t->type, (uint64_t)t->ne[0]) * (uint64_t)r0;
    return v;
}

static sh_err bind_gguf(sh_llama *m, sh_error *e)
{
    const sh_gguf *g = m->gguf;
    const sh_llama_hparams *hp = &m->hp;
    int64_t dim = hp->dim, qd = (int64_t)hp->n_heads * hp->head_dim;
    int64_t kvd = (int64_t)hp->n_kv_heads * hp->head_dim;
    sh_err err;
    sh_tensor vec;
    bool head = m->last == hp->n_layers;
    /* phi3 fuses Q, K, V into attn_qkv and the gate and up projections into ffn_up. */
    bool fused_qkv = sh_gguf_find_tensor(g, "blk.0.attn_qkv.weight") != NULL;
    bool fused_ffn = strcmp(hp->arch, "phi3") == 0;
    if ((err = sh__llama_rope_bind(g, m, e)))
        return err;
    if (m->first == 0 || (head && hp->tied_embeddings))
        if ((err = bind(g, "token_embd.weight", dim, hp->n_vocab, false, &m->tok_embd, e)))
            return err;
    if (head) {
        if ((err = bind(g, "output_norm.weight", dim, 0, false, &vec, e)))
            return err;
        m->out_norm = vec.data;
        if (hp->tied_embeddings)
            m->output = m->tok_embd;
        else if ((err = bind(g, "output.weight", dim, hp->n_vocab, false, &m->output, e)))
            return err;
    }
    for (int32_t l = m->first; l < m->last; l++) {
        sh_llama_layer *L = &m->layers[l];
        char n[96];
#define BIND_TO(t, suffix, ne0, ne1)                                                               \
    snprintf(n, sizeof n, "blk.%d.%s", (int)l, suffix);                                            \
    if ((err = bind(g, n, ne0, ne1, false, &t, e)))                                                \
        return err;
#define BIND(field, suffix, ne0, ne1) BIND_TO(L->field, suffix, ne0, ne1)
#define BIND_VEC(field, suffix, ne0, optional)                                                     \
    snprintf(n, sizeof n, "blk.%d.%s", (int)l, suffix);                                            \
    if ((err = bind(g, n, ne0, 0, optional, &vec, e)))                                             \
        return err;                                                                                \
    L->field = vec.data;
        BIND_VEC(attn_norm, "attn_norm.weight", dim, false);
        if (fused_qkv) { /* phi3: one matrix of Q, K and V rows; views, no copy */
            sh_tensor qkv;
            BIND_TO(qkv, "attn_qkv.weight", dim, qd + 2 * kvd);
            L->wq = row_view(&qkv, 0, qd);
            L->wk = row_view(&qkv, qd, kvd);
            L->wv = row_view(&qkv, qd + kvd, kvd);
        } else {
            BIND(wq, "attn_q.weight", dim, qd);
            BIND(wk, "attn_k.weight", dim, kvd);
            BIND(wv, "attn_v.weight", dim, kvd);
        }
        BIND(wo, "attn_output.weight", qd, dim);
        BIND_VEC(ffn_norm, "ffn_norm.weight", dim, false);
        if (hp->n_expert > 0) {
            if ((err = sh__llama_moe_bind(g, hp, l, L, e)))
                return err;
        } else if (fused_ffn) { /* phi3: ffn_up is [gate; up], 2 n_ff rows */
            sh_tensor gu;
            BIND_TO(gu, "ffn_up.weight", dim, 2 * (int64_t)hp->n_ff);
            L->w_gate = row_view(&gu, 0, hp->n_ff);
            L->w_up = row_view(&gu, hp->n_ff, hp->n_ff);
            BIND(w_down, "ffn_down.weight", hp->n_ff, dim);
        } else {
            BIND(w_gate, "ffn_gate.weight", dim, hp->n_ff);
            BIND(w_up, "ffn_up.weight", dim, hp->n_ff);
            BIND(w_down, "ffn_down.weight", hp->n_ff, dim);
        }
        BIND_VEC(bq, "attn_q.bias", qd, !hp->qkv_bias);
        BIND_VEC(bk, "attn_k.bias", kvd, !hp->qkv_bias);
        BIND_VEC(bv, "attn_v.bias", kvd, !hp->qkv_bias);
        if (hp->qk_norm) { /* per head, or olmoe's over the whole of q and of k */
            BIND_VEC(q_norm, "attn_q_norm.weight", hp->qk_norm_full ? qd : hp->head_dim, false);
            BIND_VEC(k_norm, "attn_k_norm.weight", hp->qk_norm_full ? kvd : hp->head_dim, false);
        }
        if (hp->post_norms) {
            BIND_VEC(post_attn_norm, "post_attention_norm.weight", dim, false);
            BIND_VEC(post_ffn_norm, "post_ffw_norm.weight", dim, false);
        }
#undef BIND
#undef BIND_TO
#undef BIND_VEC
    }
    return SH_OK;
}

/* ---- llama2.c ---------------------------------------------------------------------------- */

static sh_tensor f32_view(const float *p, int64_t ne0, int64_t ne1)
{
    sh_tensor t = {.type = SH_DTYPE_F32, .ne = {ne0, ne1, 1, 1}, .data = (void *)p};
    return t;
}

static void bind_llama2c(sh_llama *m)
{
    const sh_llama2c *c = m->l2c;
    const sh_llama2c_config *cfg = &c->cfg;
    int64_t dim = cfg->dim, kvd = cfg->kv_dim, ff = cfg->hidden_dim;
    bool head = m->last == cfg->n_layers;
    if (m->first == 0 || head)
        m->tok_embd = f32_view(c->token_embedding, dim, cfg->vocab_size);
    if (head) {
        m->out_norm = c->rms_final;
        m->output = f32_view(c->wcls, dim, cfg->vocab_size);
    }
    for (int32_t l = m->first; l < m->last; l++) {
        sh_llama_layer *L = &m->layers[l];
        // llama2.c stores each weight kind for all layers contiguously: layer l is slice l.
        L->attn_norm = c->rms_att + l * dim;
        L->wq = f32_view(c->wq + l * dim * dim, dim, dim);
        L->wk = f32_view(c->wk + l * kvd * dim, dim, kvd);
        L->wv = f32_view(c->wv + l * kvd * dim, dim, kvd);
        L->wo = f32_view(c->wo + l * dim * dim, dim, dim);
        L->ffn_norm = c->rms_ffn + l * dim;
        L->w_gate = f32_view(c->w1 + l * ff * dim, dim, ff);
        L->w_down = f32_view(c->w2 + l * dim * ff, ff, dim);
        L->w_up = f32_view(c->w3 + l * ff * dim, dim, ff);
    }
}

static void llama2c_hparams(const sh_llama2c_config *cfg, sh_llama_hparams *hp)
{
    snprintf(hp->arch, sizeof hp->arch, "llama2c");
    hp->n_vocab = cfg->vocab_size;
    hp->dim = cfg->dim;
    hp->n_layers = cfg->n_layers;
    hp->n_heads = cfg->n_heads;
    hp->n_kv_heads = cfg->n_kv_heads;
    hp->head_dim = cfg->head_size;
    hp->n_ff = cfg->hidden_dim;
    hp->n_ctx_train = cfg->seq_len;
    hp->n_rot = cfg->head_size;
    // run.c's constants: theta 10000, eps 1e-5, RoPE on adjacent pairs (i, i+1).
    hp->rope_base = 10000.0f;
    hp->rope_scaling = sh_rope_scaling_none();
    hp->norm_eps = 1e-5f;
    hp->rope_mode = SH_ROPE_MODE_NORMAL;
    hp->rope_base_swa = hp->rope_base;
    hp->ffn_act = SH_MATMUL_ACT_SWIGLU;
    hp->embd_scale = 1.0f;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    hp->tied_embeddings = cfg->shared_classifier;
}

/* ---- common ------------------------------------------------------------------------------ */

bool sh_llama_layer_slides(const sh_llama_hparams *hp, int32_t l)
{
    if (hp->sliding_window <= 0)
        return false;
    return hp->swa_period == 0 || l % hp->swa_period < hp->swa_period - 1;
}

int32_t sh_llama_kv_window(const sh_llama_hparams *hp)
{
    for (int32_t l = 0; l < hp->n_layers; l++)
        if (!sh_llama_layer_slides(hp, l))
            return 0;
    return hp->sliding_window;
}

static uint64_t tensor_bytes(const sh_tensor *t)
{
    return t->data ? sh__dtype_row_bytes(t->type, (uint64_t)t->ne[0]) * (uint64_t)t->ne[1] *
                         (uint64_t)t->ne[2] * (uint64_t)t->ne[3]
                   : 0;
}

/* Whether the head's rows lie inside tok_embd (tied, the table bound whole): counted once. */
static bool head_in_embd(const sh_llama *m)
{
    return m->output.data == m->tok_embd.data || (m->hp.tied_embeddings && m->tok_embd.data);
}

uint64_t sh_llama_weight_bytes(const sh_llama *m)
{
    uint64_t n = tensor_bytes(&m->tok_embd);
    if (!head_in_embd(m))
        n += tensor_bytes(&m->output);
    for (int32_t l = m->first; l < m->last; l++) {
        const sh_llama_layer *L = &m->layers[l];
        n += tensor_bytes(&L->wq) + tensor_bytes(&L->wk) + tensor_bytes(&L->wv) +
             tensor_bytes(&L->wo) + tensor_bytes(&L->w_gate) + tensor_bytes(&L->w_up) +
             tensor_bytes(&L->w_down) + tensor_bytes(&L->ffn_gate_inp) +
             tensor_bytes(&L->gate_exps) + tensor_bytes(&L->up_exps) + tensor_bytes(&L->down_exps) +
             tensor_bytes(&L->gate_shexp) + tensor_bytes(&L->up_shexp) +
             tensor_bytes(&L->down_shexp);
        for (int32_t p = 0; p + 1 < m->tp.n_parts; p++)
            n += tensor_bytes(&L->tp_part[p].wq) + tensor_bytes(&L->tp_part[p].wk) +
                 tensor_bytes(&L->tp_part[p].wv) + tensor_bytes(&L->tp_part[p].wo);
    }
    return n;
}

/* Reads one byte per page so the kernel maps the whole tensor now, not during a token. */
static void touch(const sh_tensor *t, uint64_t *done, uint64_t total, const sh_llama_load_opts *o)
{
    uint64_t n = tensor_bytes(t);
    const volatile uint8_t *p = t->data;
    uint8_t sink = 0;
    for (uint64_t i = 0; i < n; i += 4096) {
        sink ^= p[i];
        if (o->progress && (i & ((1u << 24) - 1)) == 0)
            o->progress((float)(*done + i) / (float)total, o->progress_arg);
    }
    (void)sink;
    *done += n;
}

static void prefault(const sh_llama *m, const sh_llama_load_opts *o)
{
    uint64_t total = sh_llama_weight_bytes(m) + 1, done = 0;
    touch(&m->tok_embd, &done, total, o);
    if (!head_in_embd(m))
        touch(&m->output, &done, total, o);
    int32_t last = m->last;
    if (o->prefault_layers > 0 && o->prefault_layers < last - m->first)
        last = m->first + o->prefault_layers;
    for (int32_t l = m->first; l < last; l++) {
        const sh_llama_layer *L = &m->layers[l];
        const sh_tensor *ts[] = {&L->wq,        &L->wk,        &L->wv,        &L->wo,
                                 &L->w_gate,    &L->w_up,      &L->w_down,    &L->ffn_gate_inp,
                                 &L->gate_exps, &L->up_exps,   &L->down_exps, &L->gate_shexp,
                                 &L->up_shexp,  &L->down_shexp};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            touch(ts[i], &done, total, o);
        for (int32_t p = 0; p + 1 < m->tp.n_parts; p++) {
            touch(&L->tp_part[p].wq, &done, total, o);
            touch(&L->tp_part[p].wk, &done, total, o);
            touch(&L->tp_part[p].wv, &done, total, o);
            touch(&L->tp_part[p].wo, &done, total, o);
        }
        if (o->progress)
            o->progress((float)done / (float)total, o->progress_arg);
    }
    if (o->progress)
        o->progress(1.0f, o->progress_arg);
}

/* Weights are read in place as floats, halves and quant blocks: every tensor's data must start
 * 4-byte aligned in the mapping (the file's data alignment, general.alignment, is a power of two
 * that GGUF allows down to 1; writers use 32). */
static sh_err check_tensor_alignment(const sh_gguf *g, sh_error *e)
{
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        if ((uintptr_t)t->data % 4 != 0)
            return sh__error_set(e, SH_EFORMAT,
                                 "tensor '%.*s': its data is not 4-byte aligned (general.alignment "
                                 "below 4)",
                                 (int)t->name.len, t->name.ptr);
    }
    return SH_OK;
}

/* Opens a file that is not GGUF as a llama2.c checkpoint. When that fails on the format, the
 * file is most likely neither (a text file, another format): say both, then the llama2.c reader's
 * reason without its copy of the path. */
static sh_err open_llama2c(const char *path, sh_llama2c **out, sh_error *e)
{
    sh_err err = sh__llama2c_open(path, out, e);
    if (err != SH_EFORMAT || !e)
        return err;
    char why[sizeof e->msg];
    size_t pl = strlen(path);
    const char *m = e->msg;
    if (strncmp(m, path, pl) == 0 && m[pl] == ':' && m[pl + 1] == ' ')
        m += pl + 2;
    snprintf(why, sizeof why, "%s", m);
    return sh__error_set(e, err,
                         "%s: neither a GGUF file (it does not begin with \"GGUF\") nor a "
                         "llama2.c checkpoint (%s)",
                         path, why);
}

sh_err sh_llama_load(const char *path, const sh_llama_load_opts *opts, sh_llama **out, sh_error *e)
{
    *out = NULL;
    sh_llama_load_opts o = {0};
    if (opts)
        o = *opts;
    sh_llama *m = calloc(1, sizeof *m);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    // The magic decides the reader. The file layer refuses FIFOs and devices before any read.
    unsigned char magic[4] = {0};
    size_t n_magic = 0;
    sh_err err = sh__file_read_head(path, magic, sizeof magic, &n_magic, e);
    if (err) {
        sh_llama_destroy(m);
        return err;
    }
    bool gguf = n_magic == 4 && memcmp(magic, "GGUF", 4) == 0;
    // The readers name the file in their own errors; later ones get the path prefixed.
    err = gguf ? sh_gguf_open(path, NULL, &m->gguf, e) : open_llama2c(path, &m->l2c, e);
    if (err) {
        sh_llama_destroy(m);
        return err;
    }
    if (gguf) {
        if ((err = check_tensor_alignment(m->gguf, e)) ||
            (err = load_gguf_hparams(m->gguf, &m->hp, e)))
            goto fail;
    } else {
        llama2c_hparams(&m->l2c->cfg, &m->hp);
    }
    m->first = o.first;
    m->last = o.last ? o.last : m->hp.n_layers;
    if (m->first < 0 || m->first >= m->last || m->last > m->hp.n_layers) {
        err = sh__error_set(e, SH_EINVAL, "layer range [%d, %d) of a %d-layer model", (int)m->first,
                            (int)m->last, (int)m->hp.n_layers);
        goto fail;
    }
    /* Tensor parallelism: the whole-model views are bound first (pointers only, nothing read),
     * then replaced by this rank's slices before anything touches the weights. */
    if ((err = sh__llama_tp_plan(m, o.tp_rank, o.tp_size, e)))
        goto fail;
    m->layers = calloc((size_t)m->hp.n_layers, sizeof *m->layers);
    if (!m->layers) {
        err = sh__error_set(e, SH_ENOMEM, "out of memory");
        goto fail;
    }
    if (gguf) {
        if ((err = bind_gguf(m, e)))
            goto fail;
    } else {
        bind_llama2c(m);
    }
    if ((err = sh__llama_tp_slice(m, e)))
        goto fail;
    m->file_mapped = true; /* both readers map the file (sh__file_map) */
    if (o.prefault)
        prefault(m, &o);
    *out = m;
    return SH_OK;
fail:
    sh__error_prefix(e, path);
    sh_llama_destroy(m);
    return err;
}

void sh_llama_destroy(sh_llama *m)
{
    if (!m)
        return;
    sh_gguf_close(m->gguf);
    sh__llama2c_close(m->l2c);
    sh__llama_tp_free(m);
    free(m->layers);
    free(m);
}
