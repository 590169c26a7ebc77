/* The gateway's POST /v1/embeddings (and /embeddings): each input is one SUBMIT with `embed`
 * set (the batcher runs it as a prefill with no decode, the last stage pools the final hidden
 * states: actors/batcher_embed.c), at most EMB_WINDOW of a request in flight at a time; the DONEs
 * carry the unit vectors, which are put in input order and answered in OpenAI's shape
 * (net/openai_embed.h). With worker nodes (shoal serve -c) the same: the last stage's node pools
 * each chunk and the front's batcher combines them. Text inputs are tokenized on libuv's worker
 * pool first, as completion prompts are (a BOS where the model wants one). The inputs' request ids
 * are consecutive, from `base`. Thread: the gateway's loop. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "actors/gateway_int.h"
#include "net/openai_embed.h"
#include "runtime/actor_uv.h"

#define EMB_WINDOW 64               /* inputs of one request in the batcher at a time */
#define EMB_MAX_TOTAL_TOKENS 262144 /* tokens of one request, all inputs together */

typedef struct gw_emb {
    uv_work_t work;
    gateway *g;        /* NULL once the gateway stopped (while tokenizing) */
    sh_http_req *http; /* NULL once answered */
    const sh_gateway_model *m;
    sh_openai_embed_req *q;
    const sh_tokenizer *tok;
    int32_t max_ids, prio;
    bool tokenizing;
    /* the inputs' ids: tokenized texts (owned) or q's token ids (borrowed) */
    int32_t **ids;
    int32_t *n_ids;
    bool *own;
    sh_err rc;
    int32_t bad; /* the input whose tokenization failed */
    sh_error e;
    /* in the batcher */
    uint64_t base;
    int32_t n, next, n_done;
    bool *done;
    float *vecs; // (n, dim)
    int64_t n_tokens;
    struct gw_emb *next_emb;
} gw_emb;

static void emb_free(gw_emb *t)
{
    for (int32_t i = 0; t->ids && i < t->n; i++)
        if (t->own[i])
            free(t->ids[i]);
    free(t->ids);
    free(t->n_ids);
    free(t->own);
    free(t->done);
    free(t->vecs);
    sh_openai_embed_free(t->q);
    free(t);
}

static void emb_unlink(gateway *g, gw_emb *t)
{
    for (gw_emb **pp = &g->embs; *pp; pp = &(*pp)->next_emb)
        if (*pp == t) {
            *pp = t->next_emb;
            return;
        }
}

/* CANCELs every input of t still in the batcher. */
static void emb_cancel(gateway *g, gw_emb *t, const char *why)
{
    for (int32_t i = 0; i < t->next; i++)
        if (!t->done[i]) {
            sh_proto_cancel c = {.req = t->base + (uint64_t)i,
                                 .reason = {why, (uint32_t)strlen(why)}};
            sh_error e = {0};
            sh__act_send(sh_actor_runtime(g->ctx), sh_actor_self(g->ctx), t->m->batcher,
                         SH_MSG_CANCEL, c.req, &c, &e);
        }
}

/* Ends t with an error (its inputs cancelled), unlinks and frees it. */
static void emb_end(gateway *g, gw_emb *t, int status, const char *code, const char *fmt, ...)
    SH_PRINTF(5, 6);
static void emb_end(gateway *g, gw_emb *t, int status, const char *code, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    emb_cancel(g, t, "embedding request ended");
    if (t->http) {
        sh_http_req_on_abort(t->http, NULL, NULL);
        sh__gateway_respond_errorf(g, t->http, status, code, NULL, "%s", msg);
        t->http = NULL;
    }
    emb_unlink(g, t);
    emb_free(t);
}

/* Submits inputs until EMB_WINDOW are in the batcher. False: t was ended (freed). */
static bool emb_pump(gateway *g, gw_emb *t)
{
    while (t->next < t->n && t->next - t->n_done < EMB_WINDOW) {
        int32_t i = t->next;
        sh_proto_submit sub = {
            .req = t->base + (uint64_t)i,
            .prompt = {t->ids[i], (uint32_t)t->n_ids[i]},
            .sampling = {.temperature = 0.0f,
                         .top_p = 1.0f,
                         .repeat_penalty = 1.0f,
                         .max_tokens = 1,
                         .no_spec = true},
            .priority = (uint8_t)t->prio,
            .deadline_ms =
                g->a.request_timeout_ms ? sh__act_unix_ms() + g->a.request_timeout_ms : 0,
            .reply_to = sh_actor_self(g->ctx),
            .n = 1,
            .embed = t->m->pooling ? t->m->pooling : 1,
        };
        sh_error e = {0};
        if (sh__act_send(sh_actor_runtime(g->ctx), sh_actor_self(g->ctx), t->m->batcher,
                         SH_MSG_SUBMIT, sub.req, &sub, &e)) {
            emb_end(g, t, 503, NULL, "the scheduler is not reachable: %s", e.msg);
            return false;
        }
        t->next++;
    }
    return true;
}

/* The client went away: its inputs are cancelled; a tokenizing item is freed by emb_tok_done. */
static void emb_abort(sh_http_req *http, void *arg)
{
    gw_emb *t = arg;
    gateway *g = t->g;
    t->http = NULL;
    sh_http_respond(http, 499, "application/json", "", 0);
    if (t->tokenizing || !g)
        return;
    emb_cancel(g, t, "client disconnected");
    emb_unlink(g, t);
    emb_free(t);
}

/* Worker thread: tokenizes the text inputs (token-id inputs are taken as they are). */
static void emb_tok_run(uv_work_t *w)
{
    gw_emb *t = w->data;
    for (int32_t i = 0; i < t->n && !t->rc; i++) {
        if (!t->q->texts[i])
            continue;
        sh_tokenize_opts o = {.max_ids = (size_t)t->max_ids};
        if (sh_tokenizer_wants_bos(t->tok))
            o.flags |= SH_TOKENIZE_ADD_BOS;
        size_t n = 0;
        t->rc = sh_tokenizer_encode_opts(t->tok, t->q->texts[i], strlen(t->q->texts[i]), &o,
                                         &t->ids[i], &n, &t->e);
        t->own[i] = t->ids[i] != NULL;
        t->n_ids[i] = (int32_t)(n > (size_t)INT32_MAX ? INT32_MAX : n);
        if (t->rc)
            t->bad = i;
    }
}

/* Loop thread: the inputs' ids are ready; they go to the batcher, or the client gets the 400. */
static void emb_tok_done(uv_work_t *w, int status)
{
    gw_emb *t = w->data;
    gateway *g = t->g;
    t->tokenizing = false;
    if (!g || !t->http) {
        if (g)
            emb_unlink(g, t);
        emb_free(t);
        return;
    }
    if (status == UV_ECANCELED) {
        emb_end(g, t, 503, NULL, "the server is shutting down");
        return;
    }
    if (t->rc == SH_ERANGE && t->n_ids[t->bad] > t->max_ids) {
        emb_end(g, t, 400, "context_length_exceeded",
                "input[%d] has more than %d tokens, this model's most for one input (its "
                "context is %d)",
                (int)t->bad, (int)t->max_ids, (int)t->m->n_ctx);
        return;
    }
    if (t->rc) {
        emb_end(g, t, t->rc == SH_ENOMEM ? 500 : 400, NULL, "input[%d]: cannot tokenize: %s",
                (int)t->bad, t->e.msg);
        return;
    }
    for (int32_t i = 0; i < t->n; i++) {
        if (t->n_ids[i] == 0) {
            emb_end(g, t, 400, NULL, "input[%d] has no tokens", (int)i);
            return;
        }
        t->n_tokens += t->n_ids[i];
    }
    if (t->n_tokens > EMB_MAX_TOTAL_TOKENS) {
        emb_end(g, t, 400, NULL,
                "the inputs have %" PRId64 " tokens together; at most %d in one request",
                t->n_tokens, EMB_MAX_TOTAL_TOKENS);
        return;
    }
    t->base = g->next_id + 1;
    g->next_id += (uint64_t)t->n;
    emb_pump(g, t);
}

void sh__gateway_embed(gateway *g, sh_http_req *req, int32_t key_prio)
{
    size_t blen = 0;
    const char *body = sh_http_req_body(req, &blen);
    const sh_gateway_model *m = &g->m[0];
    if (g->n_m > 1) { /* the model asked for: its vocabulary, context and width check the rest */
        json_t *root = json_loadb(body, blen, 0, NULL);
        json_t *name = json_is_object(root) ? json_object_get(root, "model") : NULL;
        if (json_is_string(name))
            m = sh__gateway_model(g, json_string_value(name));
        json_decref(root);
    }
    if (m->embd_dim <= 0) {
        sh__gateway_respond_errorf(g, req, 501, "not_implemented", NULL,
                                   "model '%s' does not serve embeddings (its width is unknown "
                                   "here)",
                                   m->name);
        return;
    }
    sh_openai_embed_limits lim = {.models = g->models,
                                  .n_models = g->n_m,
                                  .n_vocab = m->n_vocab,
                                  .max_tokens = m->n_ctx > 1 ? m->n_ctx - 1 : 1,
                                  .dim = m->embd_dim};
    sh_openai_embed_req *q = NULL;
    sh_openai_error err;
    if (sh_openai_embed_parse(body, blen, &lim, &q, &err)) {
        sh__gateway_respond_errorf(g, req, err.status, err.code, err.param[0] ? err.param : NULL,
                                   "%s", err.message);
        return;
    }
    gw_emb *t = calloc(1, sizeof *t);
    int32_t n = q->n;
    if (t) {
        t->ids = calloc((size_t)n, sizeof *t->ids);
        t->n_ids = calloc((size_t)n, sizeof *t->n_ids);
        t->own = calloc((size_t)n, sizeof *t->own);
        t->done = calloc((size_t)n, sizeof *t->done);
        t->vecs = malloc((size_t)n * (size_t)m->embd_dim * sizeof *t->vecs);
    }
    if (!t || !t->ids || !t->n_ids || !t->own || !t->done || !t->vecs) {
        if (t) {
            t->q = q; /* freed with it */
            emb_free(t);
        } else {
            sh_openai_embed_free(q);
        }
        sh__gateway_respond_errorf(g, req, 500, NULL, NULL, "out of memory");
        return;
    }
    t->g = g;
    t->http = req;
    t->m = m;
    t->q = q;
    t->tok = m->tok;
    t->n = n;
    t->prio = key_prio;
    t->max_ids = lim.max_tokens;
    bool texts = false;
    for (int32_t i = 0; i < n; i++) {
        t->ids[i] = q->ids[i];
        t->n_ids[i] = q->n_ids[i];
        texts |= q->texts[i] != NULL;
    }
    t->next_emb = g->embs;
    g->embs = t;
    sh_http_req_on_abort(req, emb_abort, t);
    t->work.data = t;
    if (!texts) { /* token ids only: nothing to tokenize */
        emb_tok_done(&t->work, 0);
        return;
    }
    t->tokenizing = true;
    int rc = uv_queue_work(sh__actor_uv_loop(g->ctx), &t->work, emb_tok_run, emb_tok_done);
    if (rc) {
        t->tokenizing = false;
        emb_end(g, t, 503, NULL, "cannot queue for tokenization: %s", uv_strerror(rc));
    }
}

static gw_emb *find_emb(gateway *g, uint64_t req, int32_t *i)
{
    for (gw_emb *t = g->embs; t; t = t->next_emb)
        if (!t->tokenizing && t->n && req >= t->base && req < t->base + (uint64_t)t->next) {
            *i = (int32_t)(req - t->base);
            return t;
        }
    return NULL;
}

bool sh__gateway_embed_done(gateway *g, const sh_proto_done *d)
{
    int32_t i = 0;
    gw_emb *t = find_emb(g, d->req, &i);
    if (!t)
        return false;
    if (t->done[i])
        return true;
    if (d->embedding.n == 0 && d->finish == SH_PROTO_FINISH_DEADLINE) {
        emb_end(g, t, 504, "timeout", "input[%d] was not embedded within the request timeout",
                (int)i);
        return true;
    }
    if ((int32_t)d->embedding.n != t->m->embd_dim) {
        emb_end(g, t, 500, NULL,
                "input[%d]: the model answered a vector of %u numbers, not %d (a replica that "
                "does not compute embeddings?)",
                (int)i, (unsigned)d->embedding.n, (int)t->m->embd_dim);
        return true;
    }
    memcpy(t->vecs + (size_t)i * (size_t)t->m->embd_dim, d->embedding.ptr,
           (size_t)t->m->embd_dim * sizeof(float)); /* packed little-endian = host order */
    t->done[i] = true;
    t->n_done++;
    if (t->n_done < t->n) {
        emb_pump(g, t);
        return true;
    }
    if (t->http) {
        sh_http_req_on_abort(t->http, NULL, NULL);
        char *body = sh_openai_embed_json(t->q->model, t->vecs, t->n, t->m->embd_dim, t->q->base64,
                                          t->n_tokens);
        if (body) {
            sh_http_respond(t->http, 200, "application/json", body, strlen(body));
            free(body);
        } else {
            sh__gateway_respond_errorf(g, t->http, 500, NULL, NULL, "out of memory");
        }
        t->http = NULL;
    }
    emb_unlink(g, t);
    emb_free(t);
    return true;
}

bool sh__gateway_embed_fail(gateway *g, const sh_proto_fail *f)
{
    int32_t i = 0;
    gw_emb *t = find_emb(g, f->req, &i);
    if (!t)
        return false;
    t->done[i] = true; /* nothing left to cancel for it */
    int status = f->status_http >= 400 ? (int)f->status_http : 500;
    emb_end(g, t, status, NULL, "input[%d]: %.*s", (int)i, (int)f->message.len, f->message.ptr);
    return true;
}

void sh__gateway_embed_end_all(gateway *g, const char *msg)
{
    gw_emb *t = g->embs;
    while (t) {
        gw_emb *nx = t->next_emb;
        if (t->tokenizing) {
            /* the pool hands it back to emb_tok_done, which frees it */
            emb_unlink(g, t);
            t->g = NULL;
            uv_cancel((uv_req_t *)&t->work);
            if (t->http) {
                sh_http_req_on_abort(t->http, NULL, NULL);
                sh__gateway_respond_errorf(g, t->http, 503, "server_shutting_down", NULL, "%s",
                                           msg);
                t->http = NULL;
            }
        } else {
            emb_end(g, t, 503, "server_shutting_down", "%s", msg);
        }
        t = nx;
    }
}
