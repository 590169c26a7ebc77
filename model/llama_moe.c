/* Mixture-of-Experts layers of the Llama-family model: expert metadata and tensor binding. */
#include "model/llama_moe.h"

#include <stdio.h>
#include <string.h>

#include "base/error.h"

/* Weight types the MoE op and the router matmul take (backend.h, sh_moe_args). */
static bool type_ok(sh_dtype t)
{
    return t == SH_DTYPE_F32 || t == SH_DTYPE_F16 || t == SH_DTYPE_BF16 || t == SH_DTYPE_Q8_0 ||
           t == SH_DTYPE_Q4_0 || t == SH_DTYPE_Q4_1 || t == SH_DTYPE_Q5_0 || t == SH_DTYPE_Q5_1 ||
           t == SH_DTYPE_Q2_K || t == SH_DTYPE_Q3_K || t == SH_DTYPE_Q4_K || t == SH_DTYPE_Q5_K ||
           t == SH_DTYPE_Q6_K || t == SH_DTYPE_IQ4_NL || t == SH_DTYPE_IQ4_XS;
}

/* An integer key <arch>.<key>: *out = dflt when absent; present values must be >= min. */
static sh_err get_int(const sh_gguf *g, const char *arch, const char *key, int32_t *out,
                      int32_t dflt, int32_t min, sh_error *e)
{
    char full[128];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    sh_err err = sh_gguf_get_i32(g, full, out);
    if (err == SH_ENOTFOUND) {
        *out = dflt;
        return SH_OK;
    }
    if (err)
        return sh__error_set(e, SH_EFORMAT, "metadata %s: %s", full, sh_strerror(err));
    if (*out < min)
        return sh__error_set(e, SH_EFORMAT, "metadata %s: %d is below %d", full, (int)*out,
                             (int)min);
    return SH_OK;
}

sh_err sh__llama_moe_hparams(const sh_gguf *g, sh_llama_hparams *hp, sh_error *e)
{
    const char *a = hp->arch;
    sh_err err;
    if ((err = get_int(g, a, "expert_count", &hp->n_expert, 0, 0, e)))
        return err;
    if (hp->n_expert == 0) {
        hp->n_expert_used = hp->n_ff_exp = hp->n_ff_shexp = 0;
        const sh_gguf_tensor *t = sh_gguf_find_tensor(g, "blk.0.ffn_gate_exps.weight");
        if (t)
            return sh__error_set(e, SH_EFORMAT,
                                 "metadata %s.expert_count is missing, but tensor "
                                 "'blk.0.ffn_gate_exps.weight' holds %llu experts",
                                 a, (unsigned long long)t->ne[2]);
        return SH_OK;
    }
    if ((err = get_int(g, a, "expert_used_count", &hp->n_expert_used, 0, 1, e)) ||
        (err = get_int(g, a, "expert_feed_forward_length", &hp->n_ff_exp, hp->n_ff, 1, e)) ||
        (err = get_int(g, a, "expert_shared_feed_forward_length", &hp->n_ff_shexp, 0, 0, e)))
        return err;
    if (hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert)
        return sh__error_set(e, SH_EFORMAT, "metadata %s.expert_used_count: %d of %d experts", a,
                             (int)hp->n_expert_used, (int)hp->n_expert);
    /* qwen2moe and olmoe weigh the chosen experts by their softmax probabilities as they are;
     * mixtral (llama), qwen3moe and the others renormalise them to sum 1 (llama.cpp's norm_w) */
    hp->expert_norm = strcmp(a, "qwen2moe") != 0 && strcmp(a, "olmoe") != 0;
    return SH_OK;
}

/* Binds tensor `name` of shape [ne0, ne1, ne2] (ne2 = 0: 2-D, ne1 = ne2 = 0: a vector). */
static sh_err bind3(const sh_gguf *g, const char *name, const sh_llama_hparams *hp, int64_t ne0,
                    int64_t ne1, int64_t ne2, bool optional, sh_tensor *t, sh_error *e)
{
    memset(t, 0, sizeof *t);
    const sh_gguf_tensor *gt = sh_gguf_find_tensor(g, name);
    if (!gt) {
        if (optional)
            return SH_OK;
        return sh__error_set(e, SH_EFORMAT, "tensor '%s' is missing (%s.expert_count is %d)", name,
                             hp->arch, (int)hp->n_expert);
    }
    const int64_t w1 = ne1 ? ne1 : 1, w2 = ne2 ? ne2 : 1;
    if (ne2 && (int64_t)gt->ne[2] != ne2 && gt->ne[0] == (uint64_t)ne0 &&
        gt->ne[1] == (uint64_t)ne1 && gt->ne[3] == 1)
        return sh__error_set(e, SH_EFORMAT, "tensor '%s' holds %llu experts, %s.expert_count is %d",
                             name, (unsigned long long)gt->ne[2], hp->arch, (int)hp->n_expert);
    if ((int64_t)gt->ne[0] != ne0 || (int64_t)gt->ne[1] != w1 || (int64_t)gt->ne[2] != w2 ||
        gt->ne[3] != 1)
        return sh__error_set(e, SH_EFORMAT,
                             "tensor '%s': shape [%llu, %llu, %llu, %llu], expected [%lld, %lld, "
                             "%lld] (%s.expert_count %d)",
                             name, (unsigned long long)gt->ne[0], (unsigned long long)gt->ne[1],
                             (unsigned long long)gt->ne[2], (unsigned long long)gt->ne[3],
                             (long long)ne0, (long long)w1, (long long)w2, hp->arch,
                             (int)hp->n_expert);
    if (!type_ok(gt->type))
        return sh__error_set(e, SH_EUNSUPPORTED, "tensor '%s': type %s is not supported here", name,
                             sh__dtype_name(gt->type));
    t->type = gt->type;
    t->ne[0] = ne0;
    t->ne[1] = w1;
    t->ne[2] = w2;
    t->ne[3] = 1;
    t->data = (void *)gt->data; // read-only: the backend never writes weights
    return SH_OK;
}

sh_err sh__llama_moe_bind(const sh_gguf *g, const sh_llama_hparams *hp, int32_t l,
                          sh_llama_layer *L, sh_error *e)
{
    const int64_t dim = hp->dim, ne = hp->n_expert, ff = hp->n_ff_exp, fs = hp->n_ff_shexp;
    char n[96];
    sh_err err;
#define BIND(field, suffix, ne0, ne1, ne2, optional)                                               \
    snprintf(n, sizeof n, "blk.%d.%s", (int)l, suffix);                                            \
    if ((err = bind3(g, n, hp, ne0, ne1, ne2, optional, &L->field, e)))                            \
        return err;
    BIND(ffn_gate_inp, "ffn_gate_inp.weight", dim, ne, 0, false);
    BIND(gate_exps, "ffn_gate_exps.weight", dim, ff, ne, false);
    BIND(up_exps, "ffn_up_exps.weight", dim, ff, ne, false);
    BIND(down_exps, "ffn_down_exps.weight", ff, dim, ne, false);
    if (fs > 0) {
        BIND(gate_shexp, "ffn_gate_shexp.weight", dim, fs, 0, false);
        BIND(up_shexp, "ffn_up_shexp.weight", dim, fs, 0, false);
        BIND(down_shexp, "ffn_down_shexp.weight", fs, dim, 0, false);
        BIND(gate_inp_shexp, "ffn_gate_inp_shexp.weight", dim, 0, 0, true);
    }
#undef BIND
    return SH_OK;
}
