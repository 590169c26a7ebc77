/* The gateway's internals shared by gateway.c, gateway_tok.c and gateway_ctl.c. */
#ifndef SH_ACTORS_GATEWAY_INT_H
#define SH_ACTORS_GATEWAY_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "actors/actor_util.h"
#include "actors/serve.h"
#include "base/error.h"
#include "net/http.h"
#include "net/openai_tools.h"

typedef struct gw_choice gw_choice; /* one choice's progress (gateway.c) */
typedef struct gw_resp gw_resp;     /* a /v1/responses answer being built (gateway_resp.c) */

typedef struct gateway gateway;

typedef struct gw_req {
    gateway *g;
    uint64_t id;
    sh_http_req *http;         /* NULL once completed */
    const sh_gateway_model *m; /* the model asked for (an entry of g->m) */
    sh_openai_kind kind;
    bool stream, include_usage, logprobs, echo;
    bool stream_started; /* the 200 and the event-stream headers went out */
    int32_t top_n;
    int32_t n_choices, n_done;
    int32_t n_prompt;
    int32_t n_cached; /* prompt tokens the prefix cache served (choice 0's DONE) */
    char id_str[48];
    int64_t created;
    uint64_t t0_us, t_first_us;
    char *echo_text;
    bool tools;                      /* the output is parsed for tool calls */
    sh_openai_tool_style tool_style; /* the model's tool syntax */
    gw_choice *choices;
    gw_resp *resp; /* POST /v1/responses: its answer; NULL for chat and completions */
    struct gw_req *next;
} gw_req;

struct gateway {
    sh_gateway_args a;
    sh_actor_ctx *ctx;
    sh_http_server *srv;
    sh_act_decoder dec;
    gw_req *reqs;
    struct gw_tok *toks; /* prompts being tokenized on the worker pool (gateway_tok.c) */
    struct gw_emb *embs; /* embedding requests (gateway_embed.c) */
    uint64_t next_id;
    sh_gateway_model m[SH_GATEWAY_MAX_MODELS]; /* the models served (args.models, or the one) */
    const char *models[SH_GATEWAY_MAX_MODELS]; /* their names */
    char fp[SH_GATEWAY_MAX_MODELS][64];        /* their system_fingerprint (gateway_api.c) */
    int32_t n_m;
    char *metrics_buf;
    size_t metrics_cap;
    sh_histogram *m_ttft, *m_tpot, *m_e2e;
    sh_counter *m_http_errors;
    sh_gauge *kv_total, *kv_used;
    sh_counter *pc_query, *pc_hit;
    /* Shutdown and keys (gateway_ctl.c). */
    sh_openai_key *keys; /* owned copy (one block: array, then the strings) */
    int32_t n_keys;
    bool draining, drained;
    uint64_t drain_deadline_ms; /* uv_now */
    struct gw_ctl_handles *hd;  /* the ctl wakeup and the drain timer, when a ctl is given */
};

/* ---- gateway.c ---------------------------------------------------------------------------- */

/* The model named `name` (q->model after parsing), or the first when none has that name. */
const sh_gateway_model *sh__gateway_model(const gateway *g, const char *name);
/* Answers req with an OpenAI-shaped error and counts it in shoal_http_errors_total. */
void sh__gateway_respond_errorf(gateway *g, sh_http_req *req, int status, const char *code,
                                const char *param, const char *fmt, ...) SH_PRINTF(6, 7);
/* Frees r (not linked in g->reqs any more); accepts NULL. */
void sh__gateway_req_free(gw_req *r);
/* Sends the request to the batcher or answers http with an error. Takes q and ids (malloc'd). */
void sh__gateway_submit(gateway *g, sh_http_req *http, sh_openai_request *q, int32_t *ids,
                        size_t n_ids, int32_t key_prio);
/* Answers r's client with an error (drain deadline, stop); r stays for the caller to free. */
void sh__gateway_end_with_error(gateway *g, gw_req *r, int status, const char *code,
                                const char *msg);

/* ---- gateway_api.c: CORS, fingerprints, /v1/models, /tokenize ---------------------------- */

/* Fills g->fp for every model. */
void sh__gateway_fingerprints(gateway *g);
/* With --cors-origin: adds Vary and, for an allowed Origin, Access-Control-Allow-Origin to req's
 * response; answers a preflight (OPTIONS) with 204 and returns true. False: go on routing. */
bool sh__gateway_cors(gateway *g, sh_http_req *req);
/* GET /v1/models. */
void sh__gateway_models(gateway *g, sh_http_req *req);
/* POST /tokenize (detok false) or POST /detokenize. */
void sh__gateway_tokenize(gateway *g, sh_http_req *req, bool detok);
/* POST /tokenize's answer once the worker pool encoded it (rc, msg: its result). */
void sh__gateway_tokenize_done(gateway *g, sh_http_req *req, const sh_tokenizer *tok,
                               const int32_t *ids, size_t n, bool with_pieces, sh_err rc,
                               const char *msg);

/* ---- gateway_tok.c: tokenization, off the loop -------------------------------------------- */

/* Tokenizes q's prompt on the worker pool, then submits it or answers http. Takes q. */
void sh__gateway_tok_queue(gateway *g, sh_http_req *http, sh_openai_request *q, int32_t key_prio);
/* POST /tokenize: text[0, len) (malloc'd; taken) encoded with flags (SH_TOKENIZE_*) on the
 * worker pool, then answered by sh__gateway_tokenize_done. */
void sh__gateway_tok_queue_text(gateway *g, sh_http_req *http, const sh_tokenizer *tok, char *text,
                                size_t len, uint32_t flags, bool with_pieces);
/* Answers every prompt still being tokenized with 503 (stop). */
void sh__gateway_tok_orphan_all(gateway *g);

/* ---- gateway_embed.c: POST /v1/embeddings ------------------------------------------------ */

/* POST /v1/embeddings (and /embeddings). */
void sh__gateway_embed(gateway *g, sh_http_req *req, int32_t key_prio);
/* A DONE or FAIL for one of an embedding request's inputs: taken (true) or not one of them. */
bool sh__gateway_embed_done(gateway *g, const sh_proto_done *d);
bool sh__gateway_embed_fail(gateway *g, const sh_proto_fail *f);
/* Ends every embedding request (stop, drain deadline) with 503 and msg; CANCELs their inputs. */
void sh__gateway_embed_end_all(gateway *g, const char *msg);

/* ---- gateway_resp.c: POST /v1/responses ------------------------------------------------- */

/* r (set up from a request with resp_echo, r->id_str "resp_...") answers in the Responses shape:
 * r->resp is made from echo. SH_OK or SH_ENOMEM (r->resp NULL). */
sh_err sh__gateway_resp_create(gw_req *r, const char *echo);
/* Frees r->resp; NULL is fine. */
void sh__gateway_resp_free(gw_resp *p);
/* A streamed request's next generated text (last: its end), through ts when r->tools: the
 * events it makes are written (response.created first). */
void sh__gateway_resp_piece(gw_req *r, sh_openai_toolstream *ts, const char *text, size_t len,
                            bool last);
/* The end: a stream gets its last events and ends; otherwise the whole response object from
 * text (the generated text, parsed for tool calls when r->tools) is the 200 answer. The handle
 * is completed either way; the caller sets r->http NULL. */
void sh__gateway_resp_finish(gw_req *r, const char *text, size_t len, sh_openai_finish finish,
                             const sh_openai_usage *usage);
/* A started Responses stream that fails: an error event and response.failed, then its end; true
 * when it was one (the handle is completed), false for the caller to answer otherwise. */
bool sh__gateway_resp_fail(gw_req *r, const sh_openai_error *err);

/* ---- gateway_ctl.c: drain and keys -------------------------------------------------------- */

/* A copy of keys in one block that one free() releases; NULL for none or no memory. */
sh_openai_key *sh__gateway_ctl_keys_copy(const sh_openai_key *keys, int32_t n);
/* Init and stop: g's ctl wakeup and drain timer (nothing without a ctl). SH_OK or SH_ENOMEM. */
sh_err sh__gateway_ctl_attach(gateway *g);
void sh__gateway_ctl_detach(gateway *g);

#endif
