/* The gateway's smaller API surface: CORS, system_fingerprint, /v1/models with each model's
 * context, and llama.cpp's POST /tokenize and POST /detokenize. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "actors/gateway_int.h"
#include "base/version.h"

/* ---- system_fingerprint ------------------------------------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* "shoal-<build version>-<12 hex digits>": the digits hash the model's name, vocabulary (every
 * token's text), vocabulary size and context, so the string changes with the build or the model
 * and nothing else. */
void sh__gateway_fingerprints(gateway *g)
{
    for (int32_t i = 0; i < g->n_m; i++) {
        const sh_gateway_model *m = &g->m[i];
        uint64_t h = 0xcbf29ce484222325ull;
        h = fnv(h, m->name, strlen(m->name) + 1);
        int32_t nums[3] = {m->n_vocab, m->n_ctx, m->n_ctx_train};
        h = fnv(h, nums, sizeof nums);
        int32_t nv = m->tok ? sh_tokenizer_n_vocab(m->tok) : 0;
        for (int32_t id = 0; id < nv; id++) {
            const char *p = NULL;
            size_t n = sh_tokenizer_piece(m->tok, id, SH_DECODE_SPECIAL, &p);
            h = fnv(h, p ? p : "", n);
            h = fnv(h, "", 1);
        }
        snprintf(g->fp[i], sizeof g->fp[i], "shoal-%.24s-%012" PRIx64, sh__version_build(),
                 (uint64_t)(h & 0xffffffffffffull));
    }
}

/* ---- CORS --------------------------------------------------------------------------------- */

/* Whether origin is one of --cors-origin's (or any, with "*"). */
static const char *allowed_origin(const gateway *g, const char *origin)
{
    if (!origin || !*origin)
        return NULL;
    for (const char *const *p = g->a.cors_origins; *p; p++) {
        const char *o = *p;
        if (!strcmp(o, "*"))
            return "*";
        if (!strcasecmp(o, origin))
            return origin;
    }
    return NULL;
}

bool sh__gateway_cors(gateway *g, sh_http_req *req)
{
    if (!g->a.cors_origins || !g->a.cors_origins[0])
        return false;
    const char *allow = allowed_origin(g, sh_http_req_header(req, "Origin"));
    sh_http_req_add_header(req, "Vary", "Origin");
    if (allow)
        sh_http_req_add_header(req, "Access-Control-Allow-Origin", allow);
    if (strcmp(sh_http_req_method(req), "OPTIONS"))
        return false;
    // A preflight: answered here, before the API keys (a browser sends none with it).
    if (allow) {
        const char *want = sh_http_req_header(req, "Access-Control-Request-Headers");
        char hdrs[512];
        size_t n = 0;
        for (const char *p = want; p && *p && n + 1 < sizeof hdrs; p++)
            if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                *p == '-' || *p == '_' || *p == ',' || *p == ' ')
                hdrs[n++] = *p;
        hdrs[n] = '\0';
        sh_http_req_add_header(req, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        sh_http_req_add_header(req, "Access-Control-Allow-Headers",
                               n ? hdrs : "Authorization, Content-Type");
        sh_http_req_add_header(req, "Access-Control-Max-Age", "86400");
    }
    sh_http_respond(req, 204, NULL, "", 0);
    return true;
}

/* ---- /v1/models --------------------------------------------------------------------------- */

/* Adds to each model of a /v1/models body (taken, freed) its "sampling_defaults": what a request
 * that leaves a sampling field out gets. NULL when out of memory. */
static char *models_with_sampling(const gateway *g, char *body)
{
    json_t *root = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    json_t *data = root ? json_object_get(root, "data") : NULL;
    for (size_t i = 0; i < json_array_size(data); i++) {
        json_t *e = json_array_get(data, i);
        const char *id = json_string_value(json_object_get(e, "id"));
        const sh_gateway_model *m = sh__gateway_model(g, id);
        sh_openai_sampling d = m->sampling ? *m->sampling : sh_openai_sampling_neutral();
        char buf[512];
        sh_openai_sampling_json(&d, buf, sizeof buf);
        json_t *o = json_loads(buf, 0, NULL);
        if (o)
            json_object_set_new(e, "sampling_defaults", o);
    }
    char *out = root ? json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    json_decref(root);
    return out;
}

void sh__gateway_models(gateway *g, sh_http_req *req)
{
    sh_openai_model_info mi[SH_GATEWAY_MAX_MODELS];
    for (int32_t i = 0; i < g->n_m; i++)
        mi[i] = (sh_openai_model_info){.id = g->m[i].name,
                                       .max_model_len = g->m[i].n_ctx,
                                       .n_ctx_train = g->m[i].n_ctx_train,
                                       .n_vocab = g->m[i].n_vocab,
                                       // As sh__gateway_embed decides (a 501 without it).
                                       .embeddings = g->m[i].embd_dim > 0};
    char *body = models_with_sampling(g, sh_openai_models_info_json(mi, g->n_m, 0, "shoal"));
    if (!body) {
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    sh_http_respond(req, 200, "application/json", body, strlen(body));
    free(body);
}

/* ---- /tokenize and /detokenize ------------------------------------------------------------ */

/* Tokenized on the worker pool (gateway_tok.c), never on the loop; bounded all the same. */
#define TOKENIZE_MAX_BYTES (1u << 20)
#define DETOKENIZE_MAX_IDS (64u << 10)

static bool utf8_valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t k = sh_openai_utf8_seq((const unsigned char *)s + i, n - i);
        if (!k || (k == 1 && s[i] == '\0'))
            return false;
        i += k;
    }
    return true;
}

/* A JSON string of s[0, n): invalid UTF-8 becomes U+FFFD, one per bad byte. */
static json_t *text_json(const char *s, size_t n)
{
    char *w = malloc(3 * n + 1), *o = w;
    if (!w)
        return NULL;
    for (size_t i = 0; i < n;) {
        size_t k = sh_openai_utf8_seq((const unsigned char *)s + i, n - i);
        if (k && !(k == 1 && s[i] == '\0')) {
            memcpy(o, s + i, k);
            o += k;
            i += k;
        } else {
            memcpy(o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    json_t *j = json_stringn(w, (size_t)(o - w));
    free(w);
    return j;
}

/* A token's piece as llama-server writes it: a string when valid UTF-8, else its bytes. */
static json_t *piece_json(const char *p, size_t n)
{
    if (utf8_valid(p, n))
        return json_stringn(p ? p : "", n);
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        json_array_append_new(a, json_integer((unsigned char)p[i]));
    return a;
}

/* An optional boolean field: false with a 400 answered when it is not one. */
static bool opt_bool(gateway *g, sh_http_req *req, json_t *root, const char *key, bool *v)
{
    json_t *j = json_object_get(root, key);
    if (!j || json_is_null(j))
        return true;
    if (!json_is_boolean(j)) {
        sh__gateway_respond_errorf(g, req, 400, NULL, key, "'%s' must be a boolean", key);
        return false;
    }
    *v = json_is_true(j);
    return true;
}

static void respond_dump(gateway *g, sh_http_req *req, json_t *o)
{
    char *body = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(o);
    if (!body) {
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    sh_http_respond(req, 200, "application/json", body, strlen(body));
    free(body);
}

static void tokenize(gateway *g, sh_http_req *req, json_t *root, const sh_gateway_model *m)
{
    json_t *c = json_object_get(root, "content");
    if (!json_is_string(c)) {
        sh__gateway_respond_errorf(g, req, 400, NULL, "content",
                                   c ? "'content' must be a string"
                                     : "'content' is required (the text to tokenize)");
        return;
    }
    size_t len = json_string_length(c);
    if (len > TOKENIZE_MAX_BYTES) {
        sh__gateway_respond_errorf(g, req, 400, NULL, "content",
                                   "'content' is %zu bytes; at most %u are tokenized at once", len,
                                   TOKENIZE_MAX_BYTES);
        return;
    }
    bool add_special = false, parse_special = true, with_pieces = false;
    if (!opt_bool(g, req, root, "add_special", &add_special) ||
        !opt_bool(g, req, root, "parse_special", &parse_special) ||
        !opt_bool(g, req, root, "with_pieces", &with_pieces))
        return;
    uint32_t flags = (parse_special ? SH_TOKENIZE_PARSE_SPECIAL : 0u) |
                     (add_special && sh_tokenizer_wants_bos(m->tok) ? SH_TOKENIZE_ADD_BOS : 0u);
    char *text = malloc(len + 1);
    if (!text) {
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    memcpy(text, json_string_value(c), len + 1);
    sh__gateway_tok_queue_text(g, req, m->tok, text, len, flags, with_pieces);
}

void sh__gateway_tokenize_done(gateway *g, sh_http_req *req, const sh_tokenizer *tok,
                               const int32_t *ids, size_t n, bool with_pieces, sh_err rc,
                               const char *msg)
{
    if (rc) {
        sh__gateway_respond_errorf(g, req, rc == SH_ENOMEM ? 500 : 400, NULL, "content",
                                   "cannot tokenize 'content': %s", msg);
        return;
    }
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++) {
        json_t *t;
        if (with_pieces) {
            const char *p = NULL;
            size_t k = sh_tokenizer_piece(tok, ids[i], SH_DECODE_SPECIAL, &p);
            t = json_pack("{s:i, s:o}", "id", (int)ids[i], "piece", piece_json(p, k));
        } else {
            t = json_integer(ids[i]);
        }
        if (!t || json_array_append_new(arr, t)) {
            json_decref(arr);
            arr = NULL;
        }
    }
    respond_dump(g, req, arr ? json_pack("{s:o}", "tokens", arr) : NULL);
}

static void detokenize(gateway *g, sh_http_req *req, json_t *root, const sh_gateway_model *m)
{
    json_t *t = json_object_get(root, "tokens");
    if (!json_is_array(t)) {
        sh__gateway_respond_errorf(g, req, 400, NULL, "tokens",
                                   t ? "'tokens' must be an array of token ids"
                                     : "'tokens' is required (an array of token ids)");
        return;
    }
    size_t n = json_array_size(t);
    if (n > DETOKENIZE_MAX_IDS) {
        sh__gateway_respond_errorf(g, req, 400, NULL, "tokens",
                                   "'tokens' has %zu ids; at most %u are decoded at once", n,
                                   DETOKENIZE_MAX_IDS);
        return;
    }
    int32_t nv = sh_tokenizer_n_vocab(m->tok);
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids) {
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(t, i);
        char param[64];
        snprintf(param, sizeof param, "tokens[%zu]", i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= nv) {
            free(ids);
            sh__gateway_respond_errorf(g, req, 400, NULL, param,
                                       "'%s' must be a token id from 0 to %d", param, (int)nv - 1);
            return;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    size_t need = 0;
    sh_error e = {0};
    sh_err rc = sh_tokenizer_decode(m->tok, ids, n, SH_DECODE_SPECIAL, NULL, 0, &need, &e);
    char *text = rc == SH_OK || rc == SH_ERANGE ? malloc(need + 1) : NULL;
    if (text)
        rc = sh_tokenizer_decode(m->tok, ids, n, SH_DECODE_SPECIAL, text, need + 1, &need, &e);
    free(ids);
    if (!text || rc) {
        free(text);
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "cannot decode: %s",
                                   text ? e.msg : "out of memory");
        return;
    }
    json_t *s = text_json(text, need);
    free(text);
    respond_dump(g, req, s ? json_pack("{s:o}", "content", s) : NULL);
}

void sh__gateway_tokenize(gateway *g, sh_http_req *req, bool detok)
{
    size_t blen = 0;
    const char *body = sh_http_req_body(req, &blen);
    json_error_t je;
    json_t *root = json_loadb(body, blen, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(root)) {
        json_decref(root);
        sh__gateway_respond_errorf(g, req, 400, NULL, NULL,
                                   "the request body must be a JSON object%s%.150s",
                                   root ? "" : ": ", root ? "" : je.text);
        return;
    }
    json_t *name = json_object_get(root, "model");
    if (name && !json_is_null(name) && !json_is_string(name)) {
        json_decref(root);
        sh__gateway_respond_errorf(g, req, 400, NULL, "model", "'model' must be a string");
        return;
    }
    const char *mn = json_string_value(name);
    const sh_gateway_model *m = sh__gateway_model(g, mn);
    if (mn && strcmp(m->name, mn)) {
        sh__gateway_respond_errorf(g, req, 404, "model_not_found", "model",
                                   "The model '%.100s' does not exist", mn);
        json_decref(root); /* after: mn lives in it */
        return;
    }
    if (detok)
        detokenize(g, req, root, m);
    else
        tokenize(g, req, root, m);
    json_decref(root);
}
