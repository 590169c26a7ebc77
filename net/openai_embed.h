/* POST /v1/embeddings: the request parsed and validated, and the response built (OpenAI's
 * shapes). Pure functions, no I/O; any thread. */
#ifndef SH_NET_OPENAI_EMBED_H
#define SH_NET_OPENAI_EMBED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "net/openai.h"

#define SH_OPENAI_EMBED_MAX_INPUTS 2048 /* inputs in one request (OpenAI's limit) */

typedef struct sh_openai_embed_limits {
    const char *const *models; /* as sh_openai_limits.models */
    int32_t n_models;
    int32_t n_vocab;    /* token ids must be below it; 0: unchecked */
    int32_t max_tokens; /* tokens of one token-id input at most */
    int32_t dim;        /* the model's embedding width: "dimensions" must equal it */
} sh_openai_embed_limits;

/* A validated request: n inputs, each a text (texts[i], ids[i] NULL) or token ids (ids[i],
 * n_ids[i]). Every pointer is owned by the request. */
typedef struct sh_openai_embed_req {
    const char *model; /* as asked, or models[0] when absent and only one is served */
    int32_t n;
    const char **texts;
    int32_t **ids;
    int32_t *n_ids;
    bool base64; /* encoding_format "base64" (little-endian float32 bytes); else "float" */
    void *root_;
} sh_openai_embed_req;

/* Parses body: input (a string, an array of strings, an array of token ids or an array of such
 * arrays; none empty, at most SH_OPENAI_EMBED_MAX_INPUTS), model, encoding_format ("float" or
 * "base64"), dimensions (only the model's width), user (ignored); other keys are ignored.
 * Returns SH_OK with *out (free with sh_openai_embed_free), or SH_EINVAL / SH_ENOMEM with err
 * filled (400 naming the field and input index; 404 for a model not served). */
sh_err sh_openai_embed_parse(const char *body, size_t len, const sh_openai_embed_limits *lim,
                             sh_openai_embed_req **out, sh_openai_error *err);
void sh_openai_embed_free(sh_openai_embed_req *r);

/* The response {"object":"list","data":[{"object":"embedding","index":i,"embedding":...}],
 * "model":...,"usage":{"prompt_tokens":N,"total_tokens":N}} for n vectors of dim floats (vecs,
 * row-major): arrays of numbers, or base64 strings. malloc'd; NULL when out of memory. */
char *sh_openai_embed_json(const char *model, const float *vecs, int32_t n, int32_t dim,
                           bool base64, int64_t n_tokens);

#endif
