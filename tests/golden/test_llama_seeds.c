/* The model seeds of fuzz_gguf's corpus (tests/fuzz/corpus/gguf, written by make_gguf_corpus.py
 * and make_model_seeds.py): the tiny file of each architecture loads and runs a step with finite
 * logits, each K-quant file holds whole blocks of its type, and each broken file is refused with
 * the key or tensor named, by the loader and by `shoal run` (exit 2, one `error:` line). */
#include <math.h>

#include "golden_ref.h"
#include "model/gguf.h"

static const char *seed(const char *file)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fuzz/corpus/gguf/%s", file);
    return sh_test_path(rel);
}

static const struct {
    const char *file, *arch;
    int32_t n_expert;
} archs[] = {
    {"arch_qwen3.gguf", "qwen3", 0},       {"arch_gemma3.gguf", "gemma3", 0},
    {"arch_phi3.gguf", "phi3", 0},         {"arch_llama3rope.gguf", "llama", 0},
    {"arch_mixtral.gguf", "llama", 4},     {"arch_qwen2moe.gguf", "qwen2moe", 4},
    {"arch_qwen3moe.gguf", "qwen3moe", 4}, {"arch_olmoe.gguf", "olmoe", 4},
};

static void test_arch_seeds(void)
{
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        drv d;
        if (!drv_open(&d, seed(archs[i].file), 1, 8, 1, 32))
            continue;
        CHECK_STR_EQ(d.m->hp.arch, archs[i].arch);
        CHECK_INT_EQ(d.m->hp.n_expert, archs[i].n_expert);
        const int32_t ids[] = {1, 2, 3};
        const float *lg = drv_feed(&d, ids, 3, 0, false);
        CHECK(lg != NULL);
        for (int32_t v = 0; lg && v < d.m->hp.n_vocab; v++)
            if (!isfinite(lg[v])) {
                SH_FAIL_("%s: logit %d is %g", archs[i].file, (int)v, lg[v]);
                break;
            }
        drv_close(&d);
    }
}

/* One file per K-quant type: two tensors of whole 256-element blocks, their byte sizes the
 * type's block size times the blocks. */
static void test_kquant_seeds(void)
{
    static const struct {
        const char *file;
        sh_dtype type;
        uint64_t block_bytes;
    } kq[] = {{"kquant_q2_k.gguf", SH_DTYPE_Q2_K, 84},  {"kquant_q3_k.gguf", SH_DTYPE_Q3_K, 110},
              {"kquant_q4_k.gguf", SH_DTYPE_Q4_K, 144}, {"kquant_q5_k.gguf", SH_DTYPE_Q5_K, 176},
              {"kquant_q6_k.gguf", SH_DTYPE_Q6_K, 210}, {"kquant_q8_k.gguf", SH_DTYPE_Q8_K, 292}};
    for (size_t i = 0; i < sizeof kq / sizeof kq[0]; i++) {
        sh_gguf *g = NULL;
        sh_error e = {0};
        CHECK_OK(sh_gguf_open(seed(kq[i].file), NULL, &g, &e));
        if (!g)
            continue;
        const sh_gguf_tensor *a = sh_gguf_find_tensor(g, "blk.0.ffn_down.weight");
        const sh_gguf_tensor *b = sh_gguf_find_tensor(g, "output.weight");
        CHECK(a && b);
        if (a && b) {
            CHECK_INT_EQ(a->type, kq[i].type);
            CHECK_INT_EQ(b->type, kq[i].type);
            CHECK_UINT_EQ(a->nbytes, 4 * kq[i].block_bytes); /* [512, 2] */
            CHECK_UINT_EQ(b->nbytes, kq[i].block_bytes);     /* [256, 1] */
        }
        sh_gguf_close(g);
    }
}

static void test_broken_seeds(void)
{
    static const struct {
        const char *file;
        sh_err code;
        const char *needle;
    } bad[] = {
        {"bad_mixtral_expert_count.gguf", SH_EFORMAT, "blk.0.ffn_gate_inp.weight"},
        {"bad_qwen3moe_expert_count.gguf", SH_EFORMAT, "blk.0.ffn_gate_inp.weight"},
        {"bad_olmoe_no_expert_count.gguf", SH_EFORMAT, "olmoe.expert_count"},
        {"bad_qwen2moe_expert_used.gguf", SH_EFORMAT, "qwen2moe.expert_used_count"},
        {"bad_qwen3_q4_k_rows.gguf", SH_EFORMAT, "blk.0.attn_q.weight"},
        {"bad_olmoe_q4_k_experts.gguf", SH_EFORMAT, "blk.0.ffn_up_exps.weight"},
        {"bad_unknown_arch.gguf", SH_EUNSUPPORTED, "olmo2"},
        {"bad_block_count.gguf", SH_EFORMAT, "llama.block_count"},
        {"bad_q5_k_rows.gguf", SH_EFORMAT, "blk.0.attn_q.weight"},
        {"bad_q6_k_truncated.gguf", SH_EFORMAT, "blk.0.attn_k.weight"},
        {"bad_alignment.gguf", SH_EFORMAT, "token_embd__.weight"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        golden_expect_load_fail(seed(bad[i].file), bad[i].code, bad[i].needle);
}

static const sh_test_case tests[] = {
    {"arch_seeds", test_arch_seeds},
    {"kquant_seeds", test_kquant_seeds},
    {"broken_seeds", test_broken_seeds},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
