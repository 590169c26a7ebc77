/* llama2.c checkpoints (the legacy "version 0" .bin export): header validation and f32 weight
 * pointers into the mapped file. The tokenizer.bin reader lives elsewhere. */
#ifndef SH_MODEL_LLAMA2C_H
#define SH_MODEL_LLAMA2C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/file.h"
#include "shoal/err.h"

/* Limits beyond which a header is taken for garbage rather than a model. */
#define SH_LLAMA2C_MAX_DIM (1 << 16)
#define SH_LLAMA2C_MAX_HIDDEN (1 << 20)
#define SH_LLAMA2C_MAX_LAYERS 1024
#define SH_LLAMA2C_MAX_VOCAB (1 << 24)
#define SH_LLAMA2C_MAX_SEQ (1 << 24)

typedef struct sh_llama2c_config {
    int32_t dim;        /* model width */
    int32_t hidden_dim; /* feed-forward width */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t vocab_size;     /* always positive here (the header's sign is shared_classifier) */
    int32_t seq_len;        /* context the model was trained for */
    bool shared_classifier; /* the header's vocab_size was positive: wcls is token_embedding */
    int32_t head_size;      /* dim / n_heads */
    int32_t kv_dim;         /* n_kv_heads * head_size */
} sh_llama2c_config;

/* An open checkpoint. Every pointer is into the read-only mapping and lives as long as the
 * handle; the file stores them in this order, each as little-endian f32. */
typedef struct sh_llama2c {
    sh_llama2c_config cfg;
    const float *token_embedding; // (vocab_size, dim)
    const float *rms_att;         // (n_layers, dim)
    const float *wq;              // (n_layers, dim, dim)
    const float *wk;              // (n_layers, kv_dim, dim)
    const float *wv;              // (n_layers, kv_dim, dim)
    const float *wo;              // (n_layers, dim, dim)
    const float *rms_ffn;         // (n_layers, dim)
    const float *w1;              // (n_layers, hidden_dim, dim)  gate
    const float *w2;              // (n_layers, dim, hidden_dim)  down
    const float *w3;              // (n_layers, hidden_dim, dim)  up
    const float *rms_final;       // (dim)
    const float *freq_cis_real;   // (seq_len, head_size / 2)  unused by llama2.c's run.c
    const float *freq_cis_imag;   // (seq_len, head_size / 2)
    const float *wcls;            // (vocab_size, dim); == token_embedding when shared
    uint64_t n_params;            // weights excluding the RoPE tables and a shared classifier
    sh_file_map map;              /* the mapping; empty for sh__llama2c_open_mem */
} sh_llama2c;

/* Validates the 7-int32 header (every field positive, within the limits above, dim divisible by
 * n_heads, n_heads by n_kv_heads, an even head size) and that the file is exactly as long as the
 * header implies. Returns, leaving *out NULL: SH_EIO (cannot open or map), SH_EFORMAT (bad or
 * implausible header, truncated or over-long file; e names the field or the byte counts),
 * SH_EUNSUPPORTED (a newer llama2.c export with a magic number), SH_ENOMEM. On success *out
 * owns the mapping; free it with sh__llama2c_close. Any thread. */
sh_err sh__llama2c_open(const char *path, sh_llama2c **out, sh_error *e);

/* The same over a caller's buffer (4-byte aligned, else SH_EINVAL), which is not copied and must
 * outlive the handle. */
sh_err sh__llama2c_open_mem(const void *buf, size_t size, sh_llama2c **out, sh_error *e);

/* Unmaps and frees; accepts NULL. */
void sh__llama2c_close(sh_llama2c *m);

#endif
