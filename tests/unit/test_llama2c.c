/* Unit tests of the llama2.c checkpoint loader, against the stories260K checkpoint and its GGUF. */
#include <stdint.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/llama2c.h"
#include "sh_test.h"

#define BIN "tests/data/stories260K/stories260K.bin"
#define GGUF "tests/data/stories260K/stories260K.gguf"

static void test_open_stories(void)
{
    sh_llama2c *m = NULL;
    sh_error e = {0};
    CHECK_OK(sh__llama2c_open(sh_test_path(BIN), &m, &e));
    if (!m) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    const sh_llama2c_config *c = &m->cfg;
    CHECK_INT_EQ(c->dim, 64);
    CHECK_INT_EQ(c->hidden_dim, 172);
    CHECK_INT_EQ(c->n_layers, 5);
    CHECK_INT_EQ(c->n_heads, 8);
    CHECK_INT_EQ(c->n_kv_heads, 4);
    CHECK_INT_EQ(c->vocab_size, 512);
    CHECK_INT_EQ(c->seq_len, 512);
    CHECK(c->shared_classifier);
    CHECK_INT_EQ(c->head_size, 8);
    CHECK_INT_EQ(c->kv_dim, 32);
    CHECK(m->wcls == m->token_embedding);
    /* Layout: consecutive tensors, ending exactly at the end of the file. */
    CHECK((const uint8_t *)m->token_embedding == m->map.data + 28);
    CHECK(m->rms_att == m->token_embedding + 512 * 64);
    CHECK(m->wk == m->wq + 5 * 64 * 64);
    CHECK(m->w2 == m->w1 + 5 * 172 * 64);
    CHECK(m->freq_cis_imag == m->freq_cis_real + 512 * 4);
    CHECK((const uint8_t *)(m->freq_cis_imag + 512 * 4) == m->map.data + m->map.size);
    /* Embedding + 5 layers (2 norms, 4 attention and 3 ffn matrices) + final norm. */
    uint64_t per_layer = 2 * 64 + 64 * 64 * 2 + 32 * 64 * 2 + 172 * 64 * 3;
    CHECK_UINT_EQ(m->n_params, 512 * 64 + 5 * per_layer + 64);
    /* RoPE table row 0 is angle 0: cos 1, sin 0. */
    CHECK_NEAR(m->freq_cis_real[0], 1.0, 1e-6);
    CHECK_NEAR(m->freq_cis_imag[0], 0.0, 1e-6);
    sh__llama2c_close(m);
    sh__llama2c_close(NULL);
}

/* Counts elements of a GGUF F32 tensor that differ from `want` (n floats). */
static int diff_f32(const sh_gguf *g, const char *name, const float *want, uint64_t n)
{
    const sh_gguf_tensor *t = sh_gguf_find_tensor(g, name);
    if (!t) {
        SH_FAIL_("tensor %s missing", name);
        return -1;
    }
    if (t->type != SH_DTYPE_F32 || t->n_elems != n) {
        SH_FAIL_("tensor %s: type %s, %llu elements, want F32 x %llu", name,
                 sh__dtype_name(t->type), (unsigned long long)t->n_elems, (unsigned long long)n);
        return -1;
    }
    const float *got = t->data;
    int bad = 0;
    for (uint64_t i = 0; i < n; i++)
        bad += got[i] != want[i];
    return bad;
}

/* convert_hf_to_gguf's RoPE permutation, per head of hd rows: row 2i + t of the result is row
 * t * hd/2 + i of the input (halves layout to interleaved pairs). */
static int diff_permuted(const float *got, const float *src, int heads, int hd, int cols)
{
    int bad = 0;
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < hd / 2; i++)
            for (int t = 0; t < 2; t++) {
                const float *a = got + (size_t)(h * hd + 2 * i + t) * cols;
                const float *b = src + (size_t)(h * hd + t * hd / 2 + i) * cols;
                bad += memcmp(a, b, (size_t)cols * sizeof(float)) != 0;
            }
    return bad;
}

static void test_matches_gguf(void)
{
    sh_llama2c *m = NULL;
    sh_gguf *g = NULL;
    sh_error e = {0};
    CHECK_OK(sh__llama2c_open(sh_test_path(BIN), &m, &e));
    CHECK_OK(sh_gguf_open(sh_test_path(GGUF), NULL, &g, &e));
    if (!m || !g) {
        fprintf(stderr, "%s\n", e.msg);
        sh__llama2c_close(m);
        sh_gguf_close(g);
        return;
    }
    const sh_llama2c_config *c = &m->cfg;
    const uint64_t dim = 64, hid = 172, kv = 32;
    uint32_t u = 0;
    CHECK_OK(sh_gguf_get_u32(g, "llama.embedding_length", &u));
    CHECK_UINT_EQ(u, dim);
    CHECK_OK(sh_gguf_get_u32(g, "llama.feed_forward_length", &u));
    CHECK_UINT_EQ(u, hid);
    CHECK_OK(sh_gguf_get_u32(g, "llama.block_count", &u));
    CHECK_UINT_EQ(u, 5);

    CHECK_INT_EQ(diff_f32(g, "token_embd.weight", m->token_embedding, 512 * dim), 0);
    CHECK_INT_EQ(diff_f32(g, "output_norm.weight", m->rms_final, dim), 0);
    if (sh_gguf_find_tensor(g, "output.weight")) /* a shared classifier may still be written */
        CHECK_INT_EQ(diff_f32(g, "output.weight", m->wcls, 512 * dim), 0);
    int q_direct = 0, q_perm = 0, k_direct = 0, k_perm = 0;
    for (int l = 0; l < c->n_layers; l++) {
        char name[64];
#define LAYER(suffix, ptr, count)                                                                  \
    do {                                                                                           \
        snprintf(name, sizeof name, "blk.%d.%s.weight", l, suffix);                                \
        int bad_ = diff_f32(g, name, (ptr) + (size_t)l * (count), (count));                        \
        if (bad_)                                                                                  \
            SH_FAIL_("%s: %d elements differ", name, bad_);                                        \
    } while (0)
        LAYER("attn_norm", m->rms_att, dim);
        LAYER("ffn_norm", m->rms_ffn, dim);
        LAYER("attn_v", m->wv, kv * dim);
        LAYER("attn_output", m->wo, dim * dim);
        LAYER("ffn_gate", m->w1, hid * dim);
        LAYER("ffn_down", m->w2, dim * hid);
        LAYER("ffn_up", m->w3, hid * dim);
#undef LAYER
        /* Q and K: either stored as is or permuted for RoPE; record which holds per layer. */
        snprintf(name, sizeof name, "blk.%d.attn_q.weight", l);
        const sh_gguf_tensor *tq = sh_gguf_find_tensor(g, name);
        snprintf(name, sizeof name, "blk.%d.attn_k.weight", l);
        const sh_gguf_tensor *tk = sh_gguf_find_tensor(g, name);
        CHECK(tq && tk);
        if (!tq || !tk || tq->n_elems != dim * dim || tk->n_elems != kv * dim)
            continue;
        const float *wq = m->wq + (size_t)l * dim * dim, *wk = m->wk + (size_t)l * kv * dim;
        q_direct += memcmp(tq->data, wq, dim * dim * 4) == 0;
        k_direct += memcmp(tk->data, wk, kv * dim * 4) == 0;
        q_perm += diff_permuted(tq->data, wq, 8, 8, 64) == 0;
        k_perm += diff_permuted(tk->data, wk, 4, 8, 64) == 0;
    }
    /* llama2.c already rotates interleaved pairs, as llama.cpp's "norm" RoPE does, so its
     * converter writes Q and K unpermuted; the test also proves they are not permuted (the
     * permutation is not the identity on these random-looking weights). */
    CHECK_INT_EQ(q_direct, 5);
    CHECK_INT_EQ(k_direct, 5);
    CHECK_INT_EQ(q_perm, 0);
    CHECK_INT_EQ(k_perm, 0);
    sh_gguf_close(g);
    sh__llama2c_close(m);
}

/* A well-formed checkpoint in memory: header plus the right number of floats. */
static float *make_ckpt(const int32_t h[7], size_t extra_floats, size_t *size)
{
    int64_t dim = h[0], hid = h[1], L = h[2], heads = h[3], kvh = h[4], seq = h[6];
    int64_t vocab = h[5] < 0 ? -(int64_t)h[5] : h[5], hs = dim / heads, kv = kvh * hs;
    size_t n = (size_t)(vocab * dim + L * (2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hid * dim) +
                        dim + seq * hs);
    if (h[5] < 0)
        n += (size_t)(vocab * dim);
    n += extra_floats;
    float *buf = calloc(n + 7, sizeof(float));
    memcpy(buf, h, 28);
    for (size_t i = 0; i < n; i++)
        buf[7 + i] = (float)i;
    *size = (n + 7) * sizeof(float);
    return buf;
}

static sh_err open_buf(const int32_t h[7], ptrdiff_t delta, sh_llama2c **m, sh_error *e)
{
    size_t size;
    float *buf = make_ckpt(h, delta > 0 ? (size_t)delta : 0, &size);
    if (delta < 0)
        size -= (size_t)-delta * sizeof(float);
    sh_err err = sh__llama2c_open_mem(buf, size, m, e);
    sh__llama2c_close(*m);
    *m = NULL;
    free(buf);
    if (err)
        fprintf(stderr, "  (expected) %s\n", e->msg);
    return err;
}

static void test_synthetic(void)
{
    sh_llama2c *m = NULL;
    sh_error e = {0};
    const int32_t ok[7] = {16, 24, 2, 4, 2, 10, 8};
    CHECK_OK(open_buf(ok, 0, &m, &e));
    /* A separate classifier follows the RoPE tables. */
    const int32_t sep[7] = {16, 24, 2, 4, 2, -10, 8};
    size_t size;
    float *buf = make_ckpt(sep, 0, &size);
    CHECK_OK(sh__llama2c_open_mem(buf, size, &m, &e));
    if (m) {
        CHECK(!m->cfg.shared_classifier);
        CHECK_INT_EQ(m->cfg.vocab_size, 10);
        CHECK((const char *)(m->wcls + 10 * 16) == (const char *)buf + size);
        CHECK(m->wcls == m->freq_cis_imag + 8 * 2);
        CHECK_NEAR(m->token_embedding[5], 5.0, 0);
    }
    sh__llama2c_close(m);
    m = NULL;
    free(buf);
}

static void test_broken(void)
{
    sh_llama2c *m = NULL;
    sh_error e = {0};
    const int32_t ok[7] = {16, 24, 2, 4, 2, 10, 8};
    CHECK_INT_EQ(open_buf(ok, -1, &m, &e), SH_EFORMAT); /* truncated by one float */
    CHECK(strstr(e.msg, "truncated") != NULL);
    CHECK_INT_EQ(open_buf(ok, 1, &m, &e), SH_EFORMAT); /* trailing bytes */
    CHECK_INT_EQ(open_buf(ok, 10 * 16, &m, &e), SH_EFORMAT);
    CHECK(strstr(e.msg, "separate classifier") != NULL);
    const int32_t sep[7] = {16, 24, 2, 4, 2, -10, 8};
    CHECK_INT_EQ(open_buf(sep, -10 * 16, &m, &e), SH_EFORMAT);
    CHECK(strstr(e.msg, "short") != NULL);

    static const struct {
        int32_t h[7];
        const char *needle;
    } bad[] = {
        {{-16, 24, 2, 4, 2, 10, 8}, "dim = -16"},
        {{16, 0, 2, 4, 2, 10, 8}, "hidden_dim = 0"},
        {{16, 24, -2, 4, 2, 10, 8}, "n_layers"},
        {{16, 24, 2, 4, 2, 0, 8}, "vocab_size = 0"},
        {{16, 24, 2, 4, 2, 10, -8}, "seq_len"},
        {{1 << 30, 24, 2, 4, 2, 10, 8}, "dim = 1073741824"},
        {{16, 24, 100000, 4, 2, 10, 8}, "n_layers = 100000"},
        {{16, 24, 2, 4, 2, INT32_MIN, 8}, "vocab_size"},
        {{16, 24, 2, 5, 5, 10, 8}, "not divisible by n_heads"},
        {{16, 24, 2, 4, 3, 10, 8}, "not divisible by n_kv_heads"},
        {{16, 24, 2, 16, 4, 10, 8}, "odd"},
        {{0x616b3432, 1, 0, 0, 0, 0, 0}, "version 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        float buf[64] = {0};
        memcpy(buf, bad[i].h, 28);
        e.msg[0] = 0;
        sh_err err = sh__llama2c_open_mem(buf, sizeof buf, &m, &e);
        CHECK(err == SH_EFORMAT || err == SH_EUNSUPPORTED);
        CHECK(m == NULL);
        if (!strstr(e.msg, bad[i].needle))
            SH_FAIL_("case %zu: message '%s' lacks '%s'", i, e.msg, bad[i].needle);
    }
    float small[4] = {0};
    CHECK_INT_EQ(sh__llama2c_open_mem(small, 12, &m, &e), SH_EFORMAT);
    CHECK_INT_EQ(sh__llama2c_open_mem((const char *)small + 1, 12, &m, &e), SH_EINVAL);

    /* Files: missing, empty, truncated copy of the real checkpoint. */
    CHECK_INT_EQ(sh__llama2c_open("/nonexistent/x.bin", &m, &e), SH_EIO);
    char path[] = "/tmp/sh_test_llama2cXXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK_INT_EQ(sh__llama2c_open(path, &m, &e), SH_EFORMAT);
    CHECK(strstr(e.msg, path) != NULL); /* errors name the file */
    sh_llama2c *real = NULL;
    CHECK_OK(sh__llama2c_open(sh_test_path(BIN), &real, &e));
    if (real) {
        CHECK_INT_EQ(write(fd, real->map.data, real->map.size - 100),
                     (ssize_t)(real->map.size - 100));
        CHECK_INT_EQ(sh__llama2c_open(path, &m, &e), SH_EFORMAT);
        CHECK(strstr(e.msg, "truncated") != NULL);
        fprintf(stderr, "  (expected) %s\n", e.msg);
    }
    sh__llama2c_close(real);
    close(fd);
    unlink(path);
}

static const sh_test_case tests[] = {
    {"open_stories", test_open_stories},
    {"matches_gguf", test_matches_gguf},
    {"synthetic", test_synthetic},
    {"broken", test_broken},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
