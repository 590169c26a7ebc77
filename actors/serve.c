/* How one replica is sized and what it is told about its model, shared by `shoal serve` and the
 * embedding API (api/engine.c): the context, batch and KV pool defaults of actors/serve.h; and
 * the registration of the serving kinds. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "actors/node_metrics.h"
#include "actors/serve.h"
#include "base/error.h"
#include "model/gguf.h"
#include "model/spec.h"
#include "model/spec_draft_batch.h"

/* The KV budget when none is given: 1 GiB, or a quarter of the memory available now when that is
 * less (a small machine keeps room for the weights and everything else). */
uint64_t sh__serve_default_kv_mem(void)
{
    const uint64_t def = (uint64_t)1 << 30;
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    uint64_t quarter = pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size / 4 : 0;
    return quarter && quarter < def ? quarter : def;
}

sh_err sh__serve_size(const sh_llama_hparams *hp, const sh_serve_size_opts *o, sh_serve_size *out,
                      sh_error *e)
{
    sh_serve_size s = {0};
    s.n_ctx = o->n_ctx ? o->n_ctx : (hp->n_ctx_train < 8192 ? hp->n_ctx_train : 8192);
    if (s.n_ctx < 16)
        s.n_ctx = 16;
    s.max_seqs = o->max_seqs ? o->max_seqs : 64;
    s.step_tokens = o->step_tokens ? o->step_tokens : 4096;
    if (s.step_tokens < s.max_seqs)
        s.step_tokens = s.max_seqs;
    // The KV pool: a block holds K and V of 16 positions in every layer.
    s.bytes_per_block = (uint64_t)2 * (uint64_t)hp->n_layers * (uint64_t)hp->n_kv_heads *
                        (uint64_t)hp->head_dim * SH_KV_DEFAULT_BLOCK_TOKENS * (o->kv_f32 ? 4u : 2u);
    s.n_blocks = o->kv_blocks;
    if (!s.n_blocks)
        s.n_blocks =
            (int64_t)((o->kv_mem ? o->kv_mem : sh__serve_default_kv_mem()) / s.bytes_per_block);
    if (s.n_blocks < 1)
        return sh__error_set(e, SH_ENOMEM,
                             "the KV budget holds no block (one block takes %" PRIu64 " bytes)",
                             s.bytes_per_block);
    if (s.n_blocks > (1 << 22))
        s.n_blocks = 1 << 22;
    *out = s;
    return SH_OK;
}

int32_t sh__serve_seq_blocks(const sh_llama_hparams *hp, int32_t n_ctx, int32_t n_blocks)
{
    int32_t per_seq = (n_ctx + SH_KV_DEFAULT_BLOCK_TOKENS - 1) / SH_KV_DEFAULT_BLOCK_TOKENS + 1;
    // A table never holds more live blocks than the pool; with a sliding window its released
    // entries (-1) do not count, so a sequence may span more positions than the pool holds.
    if (per_seq > n_blocks && sh_llama_kv_window(hp) <= 0)
        per_seq = n_blocks;
    return per_seq;
}

int32_t sh__serve_max_logits(int32_t max_seqs, int32_t step_tokens, bool spec)
{
    if (spec)
        return sh_stage_max_logits(max_seqs, step_tokens);
    return max_seqs < step_tokens ? max_seqs : step_tokens;
}

sh_chat_template sh__serve_model_chat(const sh_llama *m, char *sys, size_t cap, bool *has_sys)
{
    const char *tmpl = NULL;
    size_t tmpl_len = 0;
    sh_str st;
    if (m->gguf && sh_gguf_get_str(m->gguf, "tokenizer.chat_template", &st) == SH_OK) {
        tmpl = st.ptr;
        tmpl_len = (size_t)st.len;
    }
    *has_sys = sh_chat_default_system(tmpl, tmpl_len, sys, cap);
    return sh_chat_for_model(tmpl, tmpl_len, m->hp.arch);
}

void sh__serve_base_name(const char *path, char *buf, size_t cap)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    snprintf(buf, cap, "%s", b);
    size_t l = strlen(buf);
    if (l > 5 && !strcmp(buf + l - 5, ".gguf"))
        buf[l - 5] = '\0';
}

sh_err sh__serve_register(sh_runtime *rt, sh_error *e)
{
    const sh_actor_vtable *kinds[] = {&sh__kvmgr_vtable,
                                      &sh__stage_vtable,
                                      &sh__batcher_vtable,
                                      &sh__gateway_vtable,
                                      &sh__drafter_vtable,
                                      &sh__node_metrics_collector_vtable,
                                      &sh__node_metrics_reporter_vtable};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        sh_err err = sh_runtime_register(rt, kinds[i], e);
        if (err)
            return err;
    }
    return SH_OK;
}

sh_err sh__serve_drafts_create(const sh_llama *target, const sh_tokenizer *tok, sh_backend *be,
                               const sh_spec_opts *spec, int32_t n_ctx, int32_t max_seqs,
                               int32_t step_tokens, int64_t n_blocks, bool kv_f32,
                               sh_spec_drafts **out, sh_error *e)
{
    *out = NULL;
    if (spec->kind != SH_SPEC_DRAFT && spec->kind != SH_SPEC_SELF)
        return sh__error_set(e, SH_EINVAL, "--spec %s has no draft model",
                             sh_spec_kind_name(spec->kind));
    int64_t kv = n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS;
    sh_spec_drafts_opts o = {.draft = {.path = spec->kind == SH_SPEC_DRAFT ? spec->path : NULL,
                                       .self_layers = spec->kind == SH_SPEC_SELF ? spec->layers : 0,
                                       .kv_tokens = kv < INT32_MAX ? (int32_t)kv : INT32_MAX,
                                       .kv_type = kv_f32 ? SH_DTYPE_F32 : SH_DTYPE_F16,
                                       .max_tokens = step_tokens,
                                       .prefault = true},
                             .max_seqs = max_seqs,
                             .max_slots = 2 * max_seqs,
                             .seq_tokens = n_ctx};
    return sh_spec_drafts_create(target, tok, be, &o, out, e);
}

sh_err sh__serve_node_drafts_create(const sh_cluster_plan *plan, int32_t k, sh_backend *be,
                                    sh_llama **target, sh_tokenizer **tok, sh_spec_drafts **out,
                                    sh_error *e)
{
    *target = NULL;
    *tok = NULL;
    *out = NULL;
    const sh_cluster_config *c = plan->c;
    const sh_config_replica *r = &c->replicas[k];
    const sh_cluster_replica_plan *rp = &plan->rep[k];
    sh_spec_opts so = {.kind = r->drafter_self ? SH_SPEC_SELF : SH_SPEC_DRAFT,
                       .k = c->batcher.spec_k,
                       .layers = r->drafter_self};
    if (r->drafter_path && strlen(r->drafter_path) >= sizeof so.path)
        return sh__error_set(e, SH_EINVAL, "replica %d's drafter: the draft's path is too long",
                             (int)k + 1);
    if (r->drafter_path)
        snprintf(so.path, sizeof so.path, "%s", r->drafter_path);
    // A self-drafter runs the target's first layers and head only: only those are read.
    sh_llama_load_opts lo = {.prefault = true, .prefault_layers = r->drafter_self};
    sh_err err = sh_llama_load(c->models[r->model].path, &lo, target, e);
    if (!err && !(*target)->gguf)
        err = sh__error_set(e, SH_EUNSUPPORTED, "%s: a cluster needs a GGUF model",
                            c->models[r->model].path);
    if (!err)
        err = sh_tokenizer_create_gguf((*target)->gguf, tok, e);
    if (!err &&
        (err = sh__serve_drafts_create(*target, *tok, be, &so, rp->n_ctx, plan->max_seqs,
                                       plan->step_tokens, rp->n_blocks, c->kv.f32, out, e))) {
        char who[48];
        snprintf(who, sizeof who, "replica %d's drafter", (int)k + 1);
        sh__error_prefix(e, who);
    }
    if (err) {
        sh_tokenizer_destroy(*tok);
        sh_llama_destroy(*target);
        *tok = NULL;
        *target = NULL;
    }
    return err;
}

void sh__serve_gateway_embed(sh_gateway_args *ga, const sh_llama *m)
{
    ga->embd_dim = m->hp.dim;
    ga->pooling = sh_llama_pooling(m);
}
