/* POST /v1/embeddings: parsing and the response (net/openai_embed.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "net/openai_embed.h"
#include "net/strbuf.h"

void sh_openai_embed_free(sh_openai_embed_req *r)
{
    if (!r)
        return;
    for (int32_t i = 0; r->ids && i < r->n; i++)
        free(r->ids[i]);
    free(r->ids);
    free(r->n_ids);
    free(r->texts);
    json_decref(r->root_);
    free(r);
}

static bool pick_model(json_t *root, const sh_openai_embed_limits *lim, sh_openai_embed_req *r,
                       sh_openai_error *err)
{
    json_t *m = json_object_get(root, "model");
    if (m && !json_is_null(m)) {
        if (!json_is_string(m))
            return sh_openai_error_set(err, 400, NULL, "model", "'model' must be a string"), false;
        r->model = json_string_value(m);
        if (lim->n_models <= 0 || !lim->models)
            return true;
        for (int32_t i = 0; i < lim->n_models; i++)
            if (!strcmp(lim->models[i], r->model))
                return true;
        sh_openai_error_set(err, 404, "model_not_found", "model",
                            "The model '%.100s' does not exist (this server serves '%.80s'%s)",
                            r->model, lim->models[0], lim->n_models > 1 ? " and others" : "");
        return false;
    }
    if (lim->n_models > 1)
        return sh_openai_error_set(err, 400, NULL, "model",
                                   "'model' is required: this server serves %d models",
                                   (int)lim->n_models),
               false;
    r->model = lim->n_models == 1 && lim->models ? lim->models[0] : "";
    return true;
}

/* Token ids of input i (a JSON array of integers) into r. */
static bool take_ids(json_t *a, int32_t i, const sh_openai_embed_limits *lim,
                     sh_openai_embed_req *r, sh_openai_error *err)
{
    size_t n = json_array_size(a);
    if (n == 0)
        return sh_openai_error_set(err, 400, NULL, "input", "input[%d] is empty", (int)i), false;
    if (lim->max_tokens > 0 && n > (size_t)lim->max_tokens)
        return sh_openai_error_set(err, 400, "context_length_exceeded", "input",
                                   "input[%d] has %zu tokens; this model embeds at most %d", (int)i,
                                   n, (int)lim->max_tokens),
               false;
    r->ids[i] = malloc(n * sizeof *r->ids[i]);
    if (!r->ids[i])
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
    for (size_t k = 0; k < n; k++) {
        json_t *v = json_array_get(a, k);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (!json_is_integer(v) || x < 0 || (lim->n_vocab > 0 && x >= lim->n_vocab))
            return sh_openai_error_set(err, 400, NULL, "input",
                                       "input[%d][%zu] must be a token id (an integer in [0, %d))",
                                       (int)i, k, (int)lim->n_vocab),
                   false;
        r->ids[i][k] = (int32_t)x;
    }
    r->n_ids[i] = (int32_t)n;
    return true;
}

static bool parse_input(json_t *in, const sh_openai_embed_limits *lim, sh_openai_embed_req *r,
                        sh_openai_error *err)
{
    static const char *const what = "'input' must be a string, an array of strings, an array of "
                                    "token ids or an array of arrays of token ids";
    if (!in || json_is_null(in))
        return sh_openai_error_set(err, 400, NULL, "input", "'input' is required"), false;
    size_t n = json_is_string(in) ? 1 : json_is_array(in) ? json_array_size(in) : 0;
    if (!json_is_string(in) && !json_is_array(in))
        return sh_openai_error_set(err, 400, NULL, "input", "%s", what), false;
    if (n == 0)
        return sh_openai_error_set(err, 400, NULL, "input", "'input' is empty"), false;
    bool flat_ids = json_is_array(in) && json_is_integer(json_array_get(in, 0));
    if (flat_ids)
        n = 1;
    if (n > SH_OPENAI_EMBED_MAX_INPUTS)
        return sh_openai_error_set(err, 400, NULL, "input",
                                   "'input' has %zu entries; at most %d in one request", n,
                                   SH_OPENAI_EMBED_MAX_INPUTS),
               false;
    r->n = (int32_t)n;
    r->texts = calloc(n, sizeof *r->texts);
    r->ids = calloc(n, sizeof *r->ids);
    r->n_ids = calloc(n, sizeof *r->n_ids);
    if (!r->texts || !r->ids || !r->n_ids)
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), false;
    if (json_is_string(in) || flat_ids) {
        if (flat_ids)
            return take_ids(in, 0, lim, r, err);
        if (json_string_length(in) == 0)
            return sh_openai_error_set(err, 400, NULL, "input", "input[0] is empty"), false;
        r->texts[0] = json_string_value(in);
        return true;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(in, i);
        if (json_is_string(v)) {
            if (json_string_length(v) == 0)
                return sh_openai_error_set(err, 400, NULL, "input", "input[%zu] is empty", i),
                       false;
            r->texts[i] = json_string_value(v);
        } else if (json_is_array(v)) {
            if (!take_ids(v, (int32_t)i, lim, r, err))
                return false;
        } else {
            return sh_openai_error_set(err, 400, NULL, "input", "input[%zu]: %s", i, what), false;
        }
    }
    return true;
}

sh_err sh_openai_embed_parse(const char *body, size_t len, const sh_openai_embed_limits *lim,
                             sh_openai_embed_req **out, sh_openai_error *err)
{
    *out = NULL;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return sh_openai_error_set(err, 400, NULL, NULL, "the body is not valid JSON: %s", je.text);
    sh_openai_embed_req *r = calloc(1, sizeof *r);
    if (!r) {
        json_decref(root);
        return sh_openai_error_set(err, 500, NULL, NULL, "out of memory"), SH_ENOMEM;
    }
    r->root_ = root;
    bool ok = json_is_object(root);
    if (!ok)
        sh_openai_error_set(err, 400, NULL, NULL, "the body must be a JSON object");
    ok = ok && pick_model(root, lim, r, err);
    json_t *f = ok ? json_object_get(root, "encoding_format") : NULL;
    if (f && !json_is_null(f)) {
        const char *s = json_is_string(f) ? json_string_value(f) : NULL;
        if (s && !strcmp(s, "base64"))
            r->base64 = true;
        else if (!s || strcmp(s, "float"))
            ok = !sh_openai_error_set(err, 400, NULL, "encoding_format",
                                      "'encoding_format' must be \"float\" or \"base64\"");
    }
    json_t *d = ok ? json_object_get(root, "dimensions") : NULL;
    if (d && !json_is_null(d) &&
        (!json_is_integer(d) || json_integer_value(d) != (json_int_t)lim->dim))
        ok = !sh_openai_error_set(err, 400, NULL, "dimensions",
                                  "'dimensions' must be %d, this model's embedding size: "
                                  "shortened embeddings are not supported",
                                  (int)lim->dim);
    json_t *u = ok ? json_object_get(root, "user") : NULL;
    if (u && !json_is_null(u) && !json_is_string(u))
        ok = !sh_openai_error_set(err, 400, NULL, "user", "'user' must be a string");
    ok = ok && parse_input(json_object_get(root, "input"), lim, r, err);
    if (!ok) {
        sh_openai_embed_free(r);
        return err->status >= 500 ? SH_ENOMEM : SH_EINVAL;
    }
    *out = r;
    return SH_OK;
}

/* ---- the response ---- */

static void put_b64(sh_strbuf *b, const float *v, int32_t dim)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const unsigned char *s = (const unsigned char *)v; /* little-endian hosts only (x86-64) */
    size_t n = (size_t)dim * sizeof(float);
    char q[4];
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)s[i] << 16;
        if (i + 1 < n)
            w |= (uint32_t)s[i + 1] << 8;
        if (i + 2 < n)
            w |= s[i + 2];
        q[0] = tab[(w >> 18) & 63];
        q[1] = tab[(w >> 12) & 63];
        q[2] = i + 1 < n ? tab[(w >> 6) & 63] : '=';
        q[3] = i + 2 < n ? tab[w & 63] : '=';
        sh_strbuf_addn(b, q, 4);
    }
}

char *sh_openai_embed_json(const char *model, const float *vecs, int32_t n, int32_t dim,
                           bool base64, int64_t n_tokens)
{
    sh_strbuf b = {0};
    char tmp[64];
    sh_strbuf_add(&b, "{\"object\":\"list\",\"data\":[");
    for (int32_t i = 0; i < n; i++) {
        snprintf(tmp, sizeof tmp,
                 "%s{\"object\":\"embedding\",\"index\":%d,\"embedding\":", i ? "," : "", (int)i);
        sh_strbuf_add(&b, tmp);
        const float *v = vecs + (size_t)i * dim;
        if (base64) {
            sh_strbuf_add(&b, "\"");
            put_b64(&b, v, dim);
            sh_strbuf_add(&b, "\"");
        } else {
            sh_strbuf_add(&b, "[");
            for (int32_t j = 0; j < dim; j++) {
                int k = snprintf(tmp, sizeof tmp, "%s%.9g", j ? "," : "",
                                 isfinite(v[j]) ? (double)v[j] : 0.0);
                sh_strbuf_addn(&b, tmp, (size_t)k);
            }
            sh_strbuf_add(&b, "]");
        }
        sh_strbuf_add(&b, "}");
    }
    sh_strbuf_add(&b, "],\"model\":");
    json_t *m = json_string(model ? model : "");
    char *ms = m ? json_dumps(m, JSON_ENCODE_ANY) : NULL;
    json_decref(m);
    if (!ms) {
        free(b.p);
        return NULL;
    }
    sh_strbuf_add(&b, ms);
    free(ms);
    snprintf(tmp, sizeof tmp, ",\"usage\":{\"prompt_tokens\":%lld,\"total_tokens\":%lld}}",
             (long long)n_tokens, (long long)n_tokens);
    sh_strbuf_add(&b, tmp);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
