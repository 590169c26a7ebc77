/* llama2.c checkpoint loader: validates the header and lays f32 weight pointers over the file. */
#include "model/llama2c.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

#define HEADER_INTS 7
#define HEADER_BYTES (HEADER_INTS * 4)
/* llama2.c's newer exporters (version 1 and 2) start with this magic, "ak42" little-endian. */
#define LLAMA2C_V1_MAGIC 0x616b3432u

static const char *const field_names[HEADER_INTS] = {
    "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len",
};

static sh_err check_header(const int32_t h[HEADER_INTS], sh_llama2c_config *c, sh_error *e)
{
    if ((uint32_t)h[0] == LLAMA2C_V1_MAGIC)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "llama2.c export version %d (magic 'ak42') is not supported; "
                             "export with the legacy version-0 format",
                             h[1]);
    static const int64_t limits[HEADER_INTS] = {
        SH_LLAMA2C_MAX_DIM, SH_LLAMA2C_MAX_HIDDEN, SH_LLAMA2C_MAX_LAYERS, SH_LLAMA2C_MAX_DIM,
        SH_LLAMA2C_MAX_DIM, SH_LLAMA2C_MAX_VOCAB,  SH_LLAMA2C_MAX_SEQ,
    };
    for (int i = 0; i < HEADER_INTS; i++) {
        /* vocab_size carries a flag in its sign; every other field must be positive. */
        int64_t v = i == 5 ? llabs((long long)h[i]) : h[i];
        if (v <= 0 || v > limits[i])
            return sh__error_set(e, SH_EFORMAT,
                                 "header field %s = %d is outside 1..%lld: not a llama2.c "
                                 "checkpoint, or a corrupt one",
                                 field_names[i], h[i], (long long)limits[i]);
    }
    c->dim = h[0];
    c->hidden_dim = h[1];
    c->n_layers = h[2];
    c->n_heads = h[3];
    c->n_kv_heads = h[4];
    c->shared_classifier = h[5] > 0;
    c->vocab_size = h[5] > 0 ? h[5] : -h[5];
    c->seq_len = h[6];
    if (c->dim % c->n_heads)
        return sh__error_set(e, SH_EFORMAT, "dim %d is not divisible by n_heads %d", c->dim,
                             c->n_heads);
    if (c->n_heads % c->n_kv_heads)
        return sh__error_set(e, SH_EFORMAT, "n_heads %d is not divisible by n_kv_heads %d",
                             c->n_heads, c->n_kv_heads);
    c->head_size = c->dim / c->n_heads;
    if (c->head_size % 2) /* RoPE rotates pairs of dimensions */
        return sh__error_set(e, SH_EFORMAT, "head size %d (dim %d / n_heads %d) is odd",
                             c->head_size, c->dim, c->n_heads);
    c->kv_dim = c->n_kv_heads * c->head_size;
    return SH_OK;
}

/* Lays the weight pointers over the data after the header, in file order, and returns the number
 * of floats the header implies. The limits keep every count below 2^50, so nothing overflows. */
static uint64_t lay_out(sh_llama2c *m, const float *p)
{
    const sh_llama2c_config *c = &m->cfg;
    const uint64_t L = (uint64_t)c->n_layers, dim = (uint64_t)c->dim;
    const uint64_t hid = (uint64_t)c->hidden_dim, kv = (uint64_t)c->kv_dim;
    const uint64_t vocab = (uint64_t)c->vocab_size;
    uint64_t at = 0;
#define TAKE(field, count)                                                                         \
    do {                                                                                           \
        if (p)                                                                                     \
            m->field = p + at;                                                                     \
        at += (count);                                                                             \
    } while (0)
    TAKE(token_embedding, vocab * dim);
    TAKE(rms_att, L * dim);
    TAKE(wq, L * dim * dim);
    TAKE(wk, L * kv * dim);
    TAKE(wv, L * kv * dim);
    TAKE(wo, L * dim * dim);
    TAKE(rms_ffn, L * dim);
    TAKE(w1, L * hid * dim);
    TAKE(w2, L * dim * hid);
    TAKE(w3, L * hid * dim);
    TAKE(rms_final, dim);
    uint64_t rope = at;
    TAKE(freq_cis_real, (uint64_t)c->seq_len * (uint64_t)(c->head_size / 2));
    TAKE(freq_cis_imag, (uint64_t)c->seq_len * (uint64_t)(c->head_size / 2));
    uint64_t rope_floats = at - rope;
    if (c->shared_classifier) {
        if (p)
            m->wcls = m->token_embedding;
    } else {
        TAKE(wcls, vocab * dim);
    }
#undef TAKE
    m->n_params = at - rope_floats;
    return at;
}

sh_err sh__llama2c_open_mem(const void *buf, size_t size, sh_llama2c **out, sh_error *e)
{
    *out = NULL;
    if (((uintptr_t)buf & 3) != 0)
        return sh__error_set(e, SH_EINVAL, "llama2.c buffer is not 4-byte aligned");
    if (size < HEADER_BYTES)
        return sh__error_set(e, SH_EFORMAT,
                             "file of %zu bytes is shorter than the %d-byte llama2.c header", size,
                             HEADER_BYTES);
    int32_t h[HEADER_INTS];
    memcpy(h, buf, sizeof h);
    sh_llama2c_config cfg;
    sh_err err = check_header(h, &cfg, e);
    if (err)
        return err;

    sh_llama2c *m = calloc(1, sizeof *m);
    if (!m)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    m->cfg = cfg;
    uint64_t want = HEADER_BYTES + lay_out(m, NULL) * sizeof(float);
    if ((uint64_t)size != want) {
        /* Name the likely cause when the difference is exactly one classifier matrix. */
        uint64_t cls = (uint64_t)cfg.vocab_size * (uint64_t)cfg.dim * sizeof(float);
        const char *hint = "";
        if (cfg.shared_classifier && (uint64_t)size == want + cls)
            hint = " (one more vocab x dim matrix: a separate classifier while the header's "
                   "positive vocab_size says shared?)";
        else if (!cfg.shared_classifier && (uint64_t)size + cls == want)
            hint = " (one vocab x dim matrix short: the header's negative vocab_size says a "
                   "separate classifier follows)";
        err = sh__error_set(e, SH_EFORMAT,
                            "file is %zu bytes but the header (dim %d, hidden %d, %d layers, %d "
                            "heads, %d kv heads, vocab %d, seq %d) implies %llu%s%s",
                            size, cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads,
                            cfg.n_kv_heads, cfg.vocab_size, cfg.seq_len, (unsigned long long)want,
                            (uint64_t)size < want ? ": truncated" : "", hint);
        free(m);
        return err;
    }
    lay_out(m, (const float *)((const uint8_t *)buf + HEADER_BYTES));
    *out = m;
    return SH_OK;
}

sh_err sh__llama2c_open(const char *path, sh_llama2c **out, sh_error *e)
{
    *out = NULL;
    sh_file_map map;
    sh_err err = sh__file_map(path, 0, &map, e);
    if (err)
        return err;
    /* An empty file maps to NULL; give the parser a non-NULL, aligned empty buffer instead. */
    static const int32_t empty[1];
    err = sh__llama2c_open_mem(map.data ? (const void *)map.data : empty, map.size, out, e);
    if (err) {
        sh__file_unmap(&map);
        sh__error_prefix(e, path);
        return err;
    }
    (*out)->map = map;
    return SH_OK;
}

void sh__llama2c_close(sh_llama2c *m)
{
    if (!m)
        return;
    sh__file_unmap(&m->map);
    free(m);
}
