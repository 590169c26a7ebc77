/* The gateway's tokenization of prompts on libuv's worker pool, off its I/O loop. */
#include <stdlib.h>
#include <string.h>

#include "actors/gateway_int.h"
#include "base/error.h"
#include "model/grammar.h"
#include "runtime/actor_uv.h"

/* ---- tokenization, off the loop ------------------------------------------------------------
 *
 * A text prompt (or a chat rendered with its template) is tokenized on libuv's worker pool, so a
 * huge prompt never holds up the loop and every other client with it. The work item owns the
 * parsed request until it comes back to the loop (tok_done). Meanwhile the client may go away
 * (tok_abort: answered at once, the result is dropped) or the gateway may stop
 * (sh__gateway_tok_orphan_all: answered with 503, the item frees itself when the pool hands it
 * back; the loop keeps running until then, and the tokenizer outlives the runtime). */

typedef struct gw_tok {
    uv_work_t work;
    gateway *g;           /* NULL once the gateway stopped */
    sh_http_req *http;    /* NULL once answered (client gone, gateway stopped) */
    sh_openai_request *q; /* NULL for a POST /tokenize job (text below) */
    int32_t prio;
    char *text; /* POST /tokenize: the content (owned), its encode flags, with_pieces */
    size_t text_len;
    uint32_t flags;
    bool with_pieces;
    /* what the worker reads: copied, so it never touches the gateway */
    const sh_tokenizer *tok;
    sh_chat_template chat;
    const char *default_system;
    size_t max_ids;
    /* what it writes */
    int32_t *ids;
    size_t n_ids;
    sh_err rc;
    sh_error e;
    bool tool_grammar; /* rc is the forcing grammar's failure, not the tokenizer's */
    struct gw_tok *next;
} gw_tok;

sh_openai_tool_style sh__serve_tool_style(sh_chat_template t)
{
    switch (t) {
    case SH_CHAT_CHATML:
        return SH_OPENAI_TOOLS_HERMES;
    case SH_CHAT_LLAMA3:
        return SH_OPENAI_TOOLS_LLAMA3;
    case SH_CHAT_LLAMA2:
        return SH_OPENAI_TOOLS_MISTRAL;
    default:
        return SH_OPENAI_TOOLS_GENERIC;
    }
}

/* Worker thread: the prompt's ids, stopping as soon as they cannot fit max_ids. Message contents
 * are plain text (only the template's markers are special); a completion prompt's special-token
 * texts are special only when the request asked for it (parse_special). */
static void tok_run(uv_work_t *w)
{
    gw_tok *t = w->data;
    const sh_openai_request *q = t->q;
    if (!q) {
        sh_tokenize_opts o = {.flags = t->flags};
        t->rc =
            sh_tokenizer_encode_opts(t->tok, t->text, t->text_len, &o, &t->ids, &t->n_ids, &t->e);
        return;
    }
    if (q->kind == SH_OPENAI_COMPLETION) {
        sh_tokenize_opts o = {.flags = q->parse_special ? SH_TOKENIZE_PARSE_SPECIAL : 0,
                              .max_ids = t->max_ids};
        if (sh_tokenizer_wants_bos(t->tok))
            o.flags |= SH_TOKENIZE_ADD_BOS;
        t->rc = sh_tokenizer_encode_opts(t->tok, q->prompt, strlen(q->prompt), &o, &t->ids,
                                         &t->n_ids, &t->e);
        return;
    }
    // Tools, tool calls and tool results are written in the model family's syntax first.
    sh_openai_tool_style style = sh__serve_tool_style(t->chat);
    sh_openai_chat_text ct;
    sh_chat_msg *msgs = NULL;
    if (sh_openai_tools_render(q, style, t->default_system, &ct) ||
        !(msgs = calloc((size_t)ct.n + 1, sizeof *msgs))) {
        if (!msgs)
            sh_openai_chat_text_fini(&ct);
        t->rc = sh__error_set(&t->e, SH_ENOMEM, "out of memory");
        return;
    }
    for (int32_t i = 0; i < ct.n; i++)
        msgs[i] = (sh_chat_msg){ct.msgs[i].role, ct.msgs[i].content};
    t->rc = sh_chat_tokenize(t->tok, t->chat, msgs, (size_t)ct.n, t->default_system, true,
                             t->max_ids, &t->ids, &t->n_ids, &t->e);
    free(msgs);
    sh_openai_chat_text_fini(&ct);
    // tool_choice "required" or a named function: the grammar that forces the call.
    if (!t->rc && !t->q->grammar) {
        t->rc = sh_openai_tools_grammar(t->q, style, &t->q->grammar, &t->e);
        if (!t->rc && t->q->grammar && strlen(t->q->grammar) > SH_OPENAI_MAX_GRAMMAR)
            t->rc =
                sh__error_set(&t->e, SH_EINVAL, "the grammar is %zu bytes; at most %d are allowed",
                              strlen(t->q->grammar), SH_OPENAI_MAX_GRAMMAR);
        if (!t->rc && t->q->grammar) { // parsed as a grammar field is (bounded work)
            sh_grammar *gr = NULL;
            t->rc = sh_grammar_parse(t->q->grammar, strlen(t->q->grammar), &gr, &t->e);
            sh_grammar_free(gr);
        }
        t->tool_grammar = t->rc != SH_OK && t->rc != SH_ENOMEM;
    }
}

static void tok_free(gw_tok *t)
{
    free(t->ids);
    free(t->text);
    sh_openai_request_free(t->q);
    free(t);
}

static void tok_unlink(gateway *g, gw_tok *t)
{
    for (gw_tok **pp = &g->toks; *pp; pp = &(*pp)->next)
        if (*pp == t) {
            *pp = t->next;
            return;
        }
}

/* The client went away while its prompt was being tokenized: answered now, the result dropped. */
static void tok_abort(sh_http_req *http, void *arg)
{
    gw_tok *t = arg;
    t->http = NULL;
    sh_http_respond(http, 499, "application/json", "", 0);
}

/* The gateway stops: every prompt still being tokenized is answered with 503; each item frees
 * itself in tok_done (queued ones are cancelled, running ones finish). */
void sh__gateway_tok_orphan_all(gateway *g)
{
    while (g->toks) {
        gw_tok *t = g->toks;
        g->toks = t->next;
        t->g = NULL;
        uv_cancel((uv_req_t *)&t->work);
        if (t->http) {
            sh_http_req_on_abort(t->http, NULL, NULL);
            static const char body[] = "{\"error\":{\"message\":\"the server is shutting "
                                       "down\",\"type\":\"server_error\",\"param\":null,"
                                       "\"code\":null}}";
            sh_http_respond(t->http, 503, "application/json", body, sizeof body - 1);
            t->http = NULL;
        }
    }
}

/* Loop thread: the ids are ready (or tokenization failed); the request goes on, or is answered. */
static void tok_done(uv_work_t *w, int status)
{
    gw_tok *t = w->data;
    gateway *g = t->g;
    if (g)
        tok_unlink(g, t);
    if (!g || !t->http) {
        tok_free(t);
        return;
    }
    sh_http_req *http = t->http;
    sh_http_req_on_abort(http, NULL, NULL);
    if (!t->q && status != UV_ECANCELED) { /* POST /tokenize */
        sh__gateway_tokenize_done(g, http, t->tok, t->ids, t->n_ids, t->with_pieces, t->rc,
                                  t->e.msg);
        tok_free(t);
        return;
    }
    const char *param = t->q && t->q->resp_echo                 ? "input"
                        : !t->q || t->q->kind == SH_OPENAI_CHAT ? "messages"
                                                                : "prompt";
    if (status == UV_ECANCELED) {
        sh__gateway_respond_errorf(g, http, 503, NULL, NULL, "the server is shutting down");
    } else if (t->rc == SH_ERANGE && t->n_ids > t->max_ids) {
        sh__gateway_respond_errorf(
            g, http, 400, "context_length_exceeded", param,
            "This model's maximum context length is %d tokens. However, your prompt "
            "has more than %zu tokens; it must leave room for at least one generated "
            "token.",
            (int)t->max_ids + 1, t->max_ids);
    } else if (t->rc == SH_ENOMEM) {
        sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
    } else if (t->rc && t->tool_grammar) {
        sh__gateway_respond_errorf(g, http, 400, NULL, "tools",
                                   "cannot build the grammar that forces a tool call: %s",
                                   t->e.msg);
    } else if (t->rc) {
        sh__gateway_respond_errorf(g, http, 400, NULL, param, "cannot tokenize: %s", t->e.msg);
    } else {
        sh__gateway_submit(g, http, t->q, t->ids, t->n_ids, t->prio);
        t->q = NULL;
        t->ids = NULL;
    }
    tok_free(t);
}

static void queue(gateway *g, sh_http_req *http, gw_tok *t);

/* A parsed request whose prompt must be tokenized first: the work item takes q. */
void sh__gateway_tok_queue(gateway *g, sh_http_req *http, sh_openai_request *q, int32_t key_prio)
{
    gw_tok *t = calloc(1, sizeof *t);
    if (!t) {
        sh_openai_request_free(q);
        sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
        return;
    }
    const sh_gateway_model *m = sh__gateway_model(g, q->model);
    *t = (gw_tok){.g = g,
                  .http = http,
                  .q = q,
                  .prio = key_prio,
                  .tok = m->tok,
                  .chat = m->chat,
                  .default_system = m->default_system,
                  // The prompt must leave room for one generated token.
                  .max_ids = m->n_ctx > 1 ? (size_t)m->n_ctx - 1 : 1};
    queue(g, http, t);
}

void sh__gateway_tok_queue_text(gateway *g, sh_http_req *http, const sh_tokenizer *tok, char *text,
                                size_t len, uint32_t flags, bool with_pieces)
{
    gw_tok *t = calloc(1, sizeof *t);
    if (!t) {
        free(text);
        sh__gateway_respond_errorf(g, http, 500, NULL, NULL, "out of memory");
        return;
    }
    *t = (gw_tok){.g = g,
                  .http = http,
                  .tok = tok,
                  .text = text,
                  .text_len = len,
                  .flags = flags,
                  .with_pieces = with_pieces};
    queue(g, http, t);
}

/* Queues t on the worker pool, or answers http (t freed). */
static void queue(gateway *g, sh_http_req *http, gw_tok *t)
{
    t->work.data = t;
    int rc = uv_queue_work(sh__actor_uv_loop(g->ctx), &t->work, tok_run, tok_done);
    if (rc) {
        tok_free(t);
        sh__gateway_respond_errorf(g, http, 503, NULL, NULL, "cannot queue for tokenization: %s",
                                   uv_strerror(rc));
        return;
    }
    t->next = g->toks;
    g->toks = t;
    sh_http_req_on_abort(http, tok_abort, t);
}