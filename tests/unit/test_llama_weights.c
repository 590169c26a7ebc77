/* One copy of the weights: once the CPU backend has repacked a model's matrices into memory of
 * its own, the file mapping's pages of them are gone from the process (checked page by page in
 * /proc/self/pagemap, after a prefault made them all resident), while the model still computes
 * the same logits as one whose weights are read in place. Synthetic Q4_0 models from mkmodel,
 * with a tied output head (whose table the embedding then reads from the packed copy), an
 * untied one (whose embedding table is read in place and keeps its pages), and a Mixtral-style
 * one whose 3-D expert stacks the MoE op reads from their packed copies; and a tensor-parallel
 * rank, which maps none of the other ranks' rows. */
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/dtype.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "model/mkmodel.h"
#include "sh_test.h"

enum { VOCAB = 1000, DIM = 256, N_TOK = 7 };

static char dir[64];
static bool no_copy; /* the CPU's kernels read the file layout: nothing to test */

static const char *write_model(const char *name, bool tied, bool moe)
{
    static char path[3][128];
    char *p = path[moe ? 2 : tied];
    snprintf(p, sizeof path[0], "%s/%s", dir, name);
    sh_mkmodel_opts o;
    sh__mkmodel_opts_init(&o);
    o.shape.n_layers = 3;
    o.shape.dim = DIM;
    o.shape.ffn = 512;
    o.shape.n_heads = 4;
    o.shape.n_kv_heads = 2;
    o.shape.vocab = VOCAB;
    o.shape.ctx = 256;
    o.shape.tied = tied;
    if (moe) {
        o.shape.n_experts = 4;
        o.shape.n_experts_used = 2;
    }
    o.type = SH_DTYPE_Q4_0;
    o.seed = 11;
    o.std = 0.1f;
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(p, &o, NULL, &e));
    return p;
}

/* Resident pages and whole pages of the tensor's bytes, from /proc/self/pagemap (bit 63: page
 * present; readable by the process itself without privileges). */
static void resident(const sh_tensor *t, size_t *present, size_t *pages)
{
    *present = *pages = 0;
    long ps = sysconf(_SC_PAGESIZE);
    size_t bytes =
        sh__dtype_row_bytes(t->type, (uint64_t)t->ne[0]) * (size_t)t->ne[1] * (size_t)t->ne[2];
    uintptr_t lo = ((uintptr_t)t->data + (uintptr_t)ps - 1) / (uintptr_t)ps;
    uintptr_t hi = ((uintptr_t)t->data + bytes) / (uintptr_t)ps;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    for (uintptr_t pg = lo; pg < hi; pg++) {
        uint64_t ent = 0;
        CHECK(pread(fd, &ent, sizeof ent, (off_t)(pg * sizeof ent)) == (ssize_t)sizeof ent);
        *present += (ent >> 63) & 1;
        (*pages)++;
    }
    close(fd);
}

/* Last-token logits of one prefill of N_TOK tokens. */
static void logits_of(const sh_llama *m, sh_backend *be, bool prepare, float *out)
{
    sh_error e = {0};
    sh_llama_ctx *ctx = NULL;
    sh_llama_ctx_opts co = {
        .max_tokens = 16, .max_seqs = 1, .kv_tokens = 64, .no_weight_prepare = !prepare};
    CHECK_OK(sh_llama_ctx_create(m, be, &co, &ctx, &e));
    if (!ctx)
        return;
    int32_t toks[N_TOK] = {1, 17, 400, 999, 3, 3, 250}, blocks[4] = {0, 1, 2, 3};
    sh_llama_seq s = {toks, N_TOK, 0, blocks, true, 0};
    sh_llama_batch b = {1, &s, false, NULL, false, false};
    sh_llama_out o = {0};
    CHECK_OK(sh_llama_forward(ctx, &b, &o, &e));
    if (o.logits)
        memcpy(out, o.logits, VOCAB * sizeof(float));
    sh_llama_ctx_destroy(ctx);
}

static void check_model(bool tied, bool moe)
{
    const char *path = write_model(moe    ? "moe.gguf"
                                   : tied ? "tied.gguf"
                                          : "untied.gguf",
                                   tied, moe);
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_llama_load_opts lo = {.prefault = true};
    CHECK_OK(sh_llama_load(path, &lo, &m, &e));
    sh_backend *be = NULL, *ref = NULL;
    sh_backend_cpu_opts bo = {.n_threads = 2};
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    CHECK_OK(sh_backend_cpu_create(&bo, &ref, &e));
    if (!m || !be || !ref)
        goto out;
    const sh_llama_layer *L = &m->layers[1];
    const sh_tensor *mats[] = {&L->wq,
                               &L->wk,
                               &L->wv,
                               &L->wo,
                               moe ? &L->gate_exps : &L->w_gate,
                               moe ? &L->up_exps : &L->w_up,
                               moe ? &L->down_exps : &L->w_down,
                               &m->output};
    size_t present, pages;
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) { /* the prefault mapped them all */
        resident(mats[i], &present, &pages);
        CHECK(pages > 0);
        CHECK_UINT_EQ(present, pages);
    }
    float *in_place = calloc(VOCAB, sizeof(float)), *packed = calloc(VOCAB, sizeof(float));
    logits_of(m, ref, false, in_place); /* before any drop: the file's bytes as they are */

    sh_error e2 = {0};
    sh_llama_ctx *ctx = NULL;
    sh_llama_ctx_opts co = {.max_tokens = 16, .max_seqs = 1, .kv_tokens = 64};
    CHECK_OK(sh_llama_ctx_create(m, be, &co, &ctx, &e2));
    if (!sh_backend_weight_copied(be, &L->wq)) {
        fprintf(stderr, "this CPU's kernels read the file layout (no copy): skipped\n");
        no_copy = true;
        sh_llama_ctx_destroy(ctx);
        free(in_place);
        free(packed);
        goto out;
    }
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
        /* (on AVX2 an MoE layer's expert stacks are read in place, not copied: weights.c) */
        if (moe && i >= 4 && i < 7 && !sh_backend_weight_copied(be, mats[i]))
            continue;
        resident(mats[i], &present, &pages);
        if (present)
            SH_FAIL_("%s model, matrix %zu: %zu of %zu pages of the file still resident after "
                     "the backend copied it (the weights are held twice)",
                     tied ? "tied" : "untied", i, present, pages);
    }
    /* The embedding table of the untied model is read in place: its pages stay. */
    if (!tied) {
        resident(&m->tok_embd, &present, &pages);
        CHECK_UINT_EQ(present, pages);
    }
    /* A second context shares the copies; the logits with the pages dropped (the tied table read
     * from the packed copy) are the in-place ones, up to the packed kernels' summation order. */
    logits_of(m, be, true, packed);
    double worst = 0, scale = 0;
    for (int i = 0; i < VOCAB; i++) {
        worst = fmax(worst, fabs((double)packed[i] - in_place[i]));
        scale = fmax(scale, fabs((double)in_place[i]));
    }
    if (!(scale > 0 && worst <= 1e-4 * scale))
        SH_FAIL_("logits after the drop differ by %g (largest %g)", worst, scale);
    sh_llama_ctx_destroy(ctx);
    /* Released copies: the model reads the file again (its pages fault back in). */
    logits_of(m, ref, false, packed);
    for (int i = 0; i < VOCAB; i++)
        if (packed[i] != in_place[i]) {
            SH_FAIL_("logit %d after release: %g vs %g", i, packed[i], in_place[i]);
            break;
        }
    free(in_place);
    free(packed);
out:
    sh_backend_destroy(be);
    sh_backend_destroy(ref);
    sh_llama_destroy(m);
}

static void test_tied(void) { check_model(true, false); }
static void test_untied(void) { check_model(false, false); }
static void test_moe(void) { check_model(false, true); }

/* Writes a model of 2 layers of ~8 MiB (dim 1024, FFN 4096, Q4_0) to `path` with one write(): the
 * page cache then holds it in large folios, 2 MiB where they can be (what a file read back through
 * a mapping also gets on this kernel). */
static void write_in_one_piece(const char *path)
{
    char tmp[128];
    snprintf(tmp, sizeof tmp, "%s/big-w.gguf", dir);
    sh_mkmodel_opts o;
    sh__mkmodel_opts_init(&o);
    o.shape.n_layers = 2;
    o.shape.dim = 1024;
    o.shape.ffn = 4096;
    o.shape.n_heads = 8;
    o.shape.n_kv_heads = 8;
    o.shape.vocab = VOCAB;
    o.shape.ctx = 256;
    o.type = SH_DTYPE_Q4_0;
    o.seed = 5;
    o.std = 0.05f;
    sh_error e = {0};
    CHECK_OK(sh__mkmodel_write(tmp, &o, NULL, &e));
    FILE *f = fopen(tmp, "rb");
    char *buf = NULL;
    long n = -1;
    if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = malloc((size_t)n)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        CHECK(fd >= 0 && write(fd, buf, (size_t)n) == (ssize_t)n);
        if (fd >= 0)
            close(fd);
    } else {
        SH_FAIL_("cannot read %s back", tmp);
    }
    free(buf);
    if (f)
        fclose(f);
}

/* The file's pages stay dropped while the model runs. The page cache may hold a file read through
 * a mapping in 2 MiB folios (Linux 6.18 on ext4 does for a file written in one piece), which a read
 * fault maps whole: a norm read every step, between two dropped matrices, would map the dropped
 * pages of its 2 MiB again (sh__file_drop marks the dropped ranges no-huge). */
static void test_huge_folios(void)
{
    char path[128];
    snprintf(path, sizeof path, "%s/big.gguf", dir);
    write_in_one_piece(path);
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *ctx = NULL;
    sh_llama_load_opts lo = {.prefault = true};
    sh_backend_cpu_opts bo = {.n_threads = 1, .no_spin = 1};
    CHECK_OK(sh_llama_load(path, &lo, &m, &e));
    CHECK_OK(sh_backend_cpu_create(&bo, &be, &e));
    sh_llama_ctx_opts co = {.max_tokens = 16, .max_seqs = 1, .kv_tokens = 64};
    if (!m || !be || sh_llama_ctx_create(m, be, &co, &ctx, &e))
        goto out;
    if (!sh_backend_weight_copied(be, &m->layers[0].w_up)) {
        fprintf(stderr, "this CPU's kernels read the file layout (no copy): skipped\n");
        no_copy = true;
        goto out;
    }
    int32_t toks[N_TOK] = {1, 17, 400, 999, 3, 3, 250}, blocks[4] = {0, 1, 2, 3};
    for (int32_t step = 0; step < 2; step++) {
        sh_llama_seq sq = {toks, N_TOK, step * N_TOK, blocks, true, 0};
        sh_llama_batch b = {1, &sq, false, NULL, false, false};
        sh_llama_out out = {0};
        CHECK_OK(sh_llama_forward(ctx, &b, &out, &e));
    }
    for (int32_t l = 0; l < 2; l++) {
        const sh_llama_layer *L = &m->layers[l];
        const sh_tensor *mats[] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                   &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            size_t present, pages;
            resident(mats[i], &present, &pages);
            if (present)
                SH_FAIL_("layer %d, matrix %zu: %zu of %zu pages of the file mapped again after "
                         "two steps",
                         (int)l, i, present, pages);
        }
    }
out:
    sh_llama_ctx_destroy(ctx);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
}

/* A tensor-parallel rank maps none of the other ranks' rows: rank 0 of 2, prefaulted, over the
 * file of test_huge_folios (2 MiB folios), holds its half of every row-split matrix (wq, wk, wv,
 * gate, up, the output head) and not one whole page of the other half. Before the loader dropped
 * and marked the other halves no-huge, the prefault of the rank's rows mapped the folios they
 * share with the neighbouring rows (39 MiB per rank of llama3-8b). */
static void test_tp_others(void)
{
    char path[128];
    snprintf(path, sizeof path, "%s/big-tp.gguf", dir);
    write_in_one_piece(path);
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_llama_load_opts lo = {.prefault = true, .tp_rank = 0, .tp_size = 2};
    CHECK_OK(sh_llama_load(path, &lo, &m, &e));
    if (!m)
        return;
    const sh_llama_layer *L = &m->layers[1];
    const sh_tensor *mats[] = {&L->wq, &L->wk, &L->wv, &L->w_gate, &L->w_up, &m->output};
    const int64_t whole_rows[] = {1024, 1024, 1024, 4096, 4096, VOCAB};
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
        sh_tensor mine = *mats[i], rest = *mats[i];
        CHECK_INT_EQ(mine.ne[1], whole_rows[i] / 2);
        const size_t rb = sh__dtype_row_bytes(mine.type, (uint64_t)mine.ne[0]);
        rest.ne[1] = whole_rows[i] - mine.ne[1];
        rest.data = (uint8_t *)mine.data + rb * (size_t)mine.ne[1];
        size_t present, pages;
        resident(&mine, &present, &pages);
        CHECK(pages > 0);
        CHECK_UINT_EQ(present, pages);
        resident(&rest, &present, &pages);
        CHECK(pages > 0);
        if (present)
            SH_FAIL_("matrix %zu: %zu of the %zu pages of rank 1's rows are mapped in rank 0", i,
                     present, pages);
    }
    sh_llama_destroy(m);
}

int main(int argc, char **argv)
{
    snprintf(dir, sizeof dir, "/tmp/shoal-weights-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    static const sh_test_case tests[] = {{"tied", test_tied},
                                         {"untied", test_untied},
                                         {"moe", test_moe},
                                         {"huge_folios", test_huge_folios},
                                         {"tp_others", test_tp_others},
                                         {NULL, NULL}};
    int rc = sh_test_main(argc, argv, tests);
    if (rc == 0 && no_copy)
        rc = SH_TEST_SKIP;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
