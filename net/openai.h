/* OpenAI API layer: request parsing and validation, response and SSE chunk builders, stop
 * strings over a token stream, and bearer API keys. Pure functions, no I/O; any thread. */
#ifndef SH_NET_OPENAI_H
#define SH_NET_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

#define SH_OPENAI_MAX_STOP 4            /* stop strings per request (OpenAI's limit) */
#define SH_OPENAI_MAX_STOP_BYTES 1024   /* bytes of one stop string (SH_PROTO_MAX_STR_ITEM) */
#define SH_OPENAI_MAX_BIAS 300          /* logit_bias entries (OpenAI's limit) */
#define SH_OPENAI_MAX_LOGPROBS_CMPL 5   /* /v1/completions logprobs */
#define SH_OPENAI_MAX_TOP_LOGPROBS 20   /* /v1/chat/completions top_logprobs */
#define SH_OPENAI_MAX_SPEC_N 16         /* speculative.n_max (SH_SPEC_MAX_K) */
#define SH_OPENAI_MAX_GRAMMAR (1 << 18) /* bytes of a grammar (SH_PROTO_MAX_GRAMMAR) */

/* --- errors --- */

/* An error in OpenAI's shape: {"error":{"message","type","param","code"}} with an HTTP status.
 * type is "invalid_request_error" for 4xx (OpenAI uses it for 401 too), "rate_limit_error" for
 * 429, "server_error" for 5xx. */
typedef struct sh_openai_error {
    int status;       /* HTTP status */
    const char *type; /* static */
    const char *code; /* static, or NULL for JSON null */
    char param[64];   /* the offending field ("messages[1].content"); "" for null */
    char message[256];
} sh_openai_error;

/* Fills e; param and code may be NULL. Returns SH_EINVAL for convenience in parse paths. */
sh_err sh_openai_error_set(sh_openai_error *e, int status, const char *code, const char *param,
                           const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* The error's JSON body (malloc'd, caller frees), or NULL when out of memory. */
char *sh_openai_error_json(const sh_openai_error *e);

/* --- requests --- */

typedef enum sh_openai_kind {
    SH_OPENAI_COMPLETION = 0, /* POST /v1/completions */
    SH_OPENAI_CHAT,           /* POST /v1/chat/completions */
} sh_openai_kind;

typedef enum sh_openai_role {
    SH_OPENAI_SYSTEM = 0, /* "system" and "developer" */
    SH_OPENAI_USER,
    SH_OPENAI_ASSISTANT,
    SH_OPENAI_TOOL, /* a tool's result (tool_call_id) */
} sh_openai_role;

typedef struct sh_openai_message {
    sh_openai_role role;
    const char *content;      /* text parts concatenated ("" for an assistant's null content);
                               * owned by the request */
    const void *tool_calls;   /* assistant: the validated "tool_calls" array (a jansson json_t),
                               * NULL when absent; owned by the request */
    const char *tool_call_id; /* tool: the call it answers; NULL otherwise */
} sh_openai_message;

typedef enum sh_openai_tool_choice {
    SH_OPENAI_TOOL_CHOICE_NONE = 0, /* no tools, or "none": the model is not offered them */
    SH_OPENAI_TOOL_CHOICE_AUTO,     /* the default with tools: the model may call some */
    SH_OPENAI_TOOL_CHOICE_REQUIRED, /* at least one call, forced by a grammar */
    SH_OPENAI_TOOL_CHOICE_NAMED,    /* one call of tool_named, forced by a grammar */
} sh_openai_tool_choice;

typedef struct sh_openai_bias {
    int32_t token;
    float bias; /* -100..100 */
} sh_openai_bias;

/* The sampling values a request's absent fields take. Neutral values: temperature and top_p 1,
 * top_k 0, min_p 0, typical_p 1, repeat_penalty 1, penalties 0. */
typedef struct sh_openai_sampling {
    float temperature, top_p, min_p, typical_p;
    int32_t top_k;
    float repeat_penalty;  /* llama.cpp's / vLLM's multiplicative penalty */
    int32_t repeat_last_n; /* its window of recent tokens; -1: the whole context */
    float presence_penalty, frequency_penalty;
} sh_openai_sampling;

/* OpenAI's defaults: temperature 1, no truncation, no penalty (repeat_last_n 64). */
sh_openai_sampling sh_openai_sampling_neutral(void);

/* Shoal serve's built-in defaults (llama-server's): temperature 0.8, top_k 40, top_p 0.95,
 * min_p 0.05, no penalty (repeat_last_n 64). */
sh_openai_sampling sh_openai_sampling_builtin(void);

/* The defaults as a JSON object text ({"temperature":0.8,...}) into buf; "" when it does not
 * fit. */
void sh_openai_sampling_json(const sh_openai_sampling *d, char *buf, size_t cap);

/* What the server accepts; zero fields take the defaults in brackets. */
typedef struct sh_openai_limits {
    const char *const *models; /* names served; NULL or n_models 0: any model name is accepted;
                                * a request without "model" gets the one name when n_models is
                                * 1, else 400 (listing the names) */
    int32_t n_models;
    int32_t max_tokens;         /* largest max_tokens [32768] */
    int32_t default_max_tokens; /* when the request gives none [256] */
    int32_t max_n;              /* largest n [1] */
    int32_t n_vocab;            /* token ids (prompt, logit_bias) must be below it; 0: unchecked */
    int32_t max_prompt_tokens;  /* length of a token-id prompt [32768] */
    int32_t max_messages;       /* [1024] */
    const sh_openai_sampling *defaults; /* absent sampling fields [sh_openai_sampling_neutral] */
} sh_openai_limits;

/* A validated request. Sampling fields hold limits->defaults when absent; the fields marked
 * (extension) are not OpenAI's. Every pointer is owned by the request. */
typedef struct sh_openai_request {
    sh_openai_kind kind;
    const char *model; /* as asked, or limits->models[0] when absent and only one is served */
    /* completions: the prompt as text, or as token ids (prompt NULL then) */
    const char *prompt;
    int32_t *prompt_tokens;
    int32_t n_prompt_tokens;
    /* chat */
    sh_openai_message *messages;
    int32_t n_messages;
    int32_t max_tokens;    /* limits->default_max_tokens when absent */
    float temperature;     /* 0..2 */
    float top_p;           /* 0..1 */
    int32_t top_k;         /* (extension) <= 0: off; -1 accepted as off */
    float min_p;           /* (extension) 0..1 */
    float typical_p;       /* (extension, llama.cpp's) (0, 1]; 1: off */
    float repeat_penalty;  /* (extension) "repeat_penalty" (llama.cpp) or "repetition_penalty"
                            * (vLLM): (0, 100]; 1: off */
    int32_t repeat_last_n; /* (extension) its window: "repeat_last_n" (-1: the context, 0: no
                            * penalty); "repetition_penalty" alone means -1 (prompt + output) */
    const char *stop[SH_OPENAI_MAX_STOP];
    int32_t n_stop;
    bool has_seed;
    uint64_t seed;                             /* a negative JSON seed is taken modulo 2^64 */
    int32_t n;                                 /* 1..limits->max_n [1] */
    float presence_penalty, frequency_penalty; /* -2..2 */
    sh_openai_bias *bias;
    int32_t n_bias;
    bool logprobs;        /* completions: logprobs given (even 0); chat: logprobs true */
    int32_t top_logprobs; /* completions: the logprobs integer 0..5; chat: top_logprobs 0..20 */
    bool echo;            /* completions: prepend the prompt (not with logprobs) */
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool ignore_eos;    /* (extension, as vLLM) end-of-sequence tokens do not stop generation */
    int32_t min_tokens; /* (extension, as vLLM) end-of-sequence is masked, and stop strings do
                         * not end the text, before this many */
    bool no_spec;       /* (extension) "speculative": false or n_max 0: never draft for it */
    int32_t spec_n_max; /* (extension) "speculative": {"n_max": N} or "speculative.n_max": N:
                         * at most N (1..SH_OPENAI_MAX_SPEC_N) drafted tokens a step; 0: no cap */
    bool parse_special; /* (extension) completions with a text prompt: special-token texts in it
                         * (<|im_end|>, <s>, ...) become special tokens; by default they are
                         * plain text. Refused (400) on chat and with token-id prompts. */
    const char *user;   /* NULL when absent */
    char *grammar;      /* GBNF the output must follow, malloc'd: the `grammar` field (llama.cpp's)
                         * or what response_format asks for (net/json_schema.h); NULL for none
                         * or "text". The caller parses it (model/grammar.h) and answers a
                         * bad one with a 400 naming grammar_param. */
    const char *grammar_param; /* "grammar" or "response_format" (static); NULL without one */
    int32_t priority;          /* (extension) 0..255, lower runs first; -1 when absent */
    /* chat tools (net/openai_tools.h renders, parses and forces them) */
    const void *tools; /* the validated "tools" array (json_t); NULL: none */
    int32_t n_tools;
    sh_openai_tool_choice tool_choice; /* NONE without tools */
    int32_t tool_named;                /* NAMED: the index in tools; -1 otherwise */
    bool parallel_tool_calls;          /* [true] */
    void *root_;                       /* the parsed JSON, which owns the borrowed strings */
    char *text_;                       /* concatenated chat contents */
    char *resp_echo; /* POST /v1/responses (net/openai_responses.h): the request fields its
                      * response object repeats, a JSON object text (malloc'd); NULL otherwise */
} sh_openai_request;

/* Parses and validates the body of POST /v1/completions (SH_OPENAI_COMPLETION) or
 * /v1/chat/completions (SH_OPENAI_CHAT). limits may be NULL (defaults). Unknown fields are
 * ignored, except the sampling fields of other servers that Shoal does not implement (mirostat,
 * xtc_*, dry_*, top_n_sigma, dynatemp_range, tfs_z, n_probs, best_of > 1, use_beam_search, ...):
 * those are a 400 naming the field unless they hold their neutral value. Returns SH_OK with *out
 * set (free with sh_openai_request_free), or SH_EINVAL with *out NULL and err filled: 400
 * (malformed JSON, invalid UTF-8, a wrong type, a value out of range, a missing field, an empty
 * prompt or messages list, an unsupported feature), 404 (a model not in limits->models, code
 * "model_not_found"); SH_ENOMEM with a 500 error. */
sh_err sh_openai_request_parse(sh_openai_kind kind, const char *body, size_t len,
                               const sh_openai_limits *limits, sh_openai_request **out,
                               sh_openai_error *err);

/* Frees a request; NULL is fine. */
void sh_openai_request_free(sh_openai_request *r);

/* --- responses (each returns malloc'd text the caller frees, or NULL when out of memory) --- */

typedef enum sh_openai_finish {
    SH_OPENAI_FINISH_NONE = 0,   /* still running (streaming chunks): JSON null */
    SH_OPENAI_FINISH_STOP,       /* "stop": EOS or a stop string */
    SH_OPENAI_FINISH_LENGTH,     /* "length": max_tokens or the context */
    SH_OPENAI_FINISH_TIMEOUT,    /* "timeout" (extension): the server's request deadline passed */
    SH_OPENAI_FINISH_TOOL_CALLS, /* "tool_calls": the model called tools */
} sh_openai_finish;

/* The fields every response object shares. */
typedef struct sh_openai_meta {
    sh_openai_kind kind;
    const char *id;  /* "cmpl-..." or "chatcmpl-..." */
    int64_t created; /* Unix seconds */
    const char *model;
    const char *fingerprint; /* "system_fingerprint"; NULL: left out */
} sh_openai_meta;

typedef struct sh_openai_top {
    const char *token; /* the token's text */
    float logprob;
} sh_openai_top;

/* One generated token's log-probability with its top alternatives. -inf is written as -9999. */
typedef struct sh_openai_logprob {
    const char *token;
    float logprob;
    int32_t text_offset; /* completions: byte offset of the token in the returned text */
    const sh_openai_top *top;
    int32_t n_top;
} sh_openai_logprob;

typedef struct sh_openai_choice {
    int32_t index;
    const char *text; /* the generated text (a delta in chunks) */
    sh_openai_finish finish;
    const sh_openai_logprob *logprobs; /* NULL: "logprobs": null */
    int32_t n_logprobs;
    /* chat: a JSON array text (net/openai_tools.h) written as message.tool_calls (responses;
     * "content" is then null when text is NULL) or delta.tool_calls (chunks); NULL: none */
    const char *tool_calls;
} sh_openai_choice;

/* Written as {"prompt_tokens","completion_tokens","total_tokens",
 * "prompt_tokens_details":{"cached_tokens"}}. */
typedef struct sh_openai_usage {
    int32_t prompt_tokens, completion_tokens;
    int32_t cached_tokens; /* prompt tokens served from the prefix cache */
} sh_openai_usage;

/* A complete "text_completion" or "chat.completion" object (by meta->kind). */
char *sh_openai_response_json(const sh_openai_meta *meta, const sh_openai_choice *choices,
                              int32_t n_choices, const sh_openai_usage *usage);

/* One SSE event "data: {chunk}\n\n" for one choice: completions carry the text delta; chat
 * carries {"role":"assistant","content":""} when first is true, else {"content": text} (or {}
 * when text is NULL, as in the final chunk). with_usage adds "usage": null (include_usage). */
char *sh_openai_chunk_sse(const sh_openai_meta *meta, const sh_openai_choice *choice, bool first,
                          bool with_usage);

/* The usage event that include_usage asks for: empty choices and the usage object. */
char *sh_openai_usage_sse(const sh_openai_meta *meta, const sh_openai_usage *usage);

#define SH_OPENAI_SSE_DONE "data: [DONE]\n\n"

/* GET /v1/models: {"object":"list","data":[{"id","object":"model","created","owned_by"}]}. */
char *sh_openai_models_json(const char *const *models, int32_t n, int64_t created,
                            const char *owned_by);

/* What /v1/models says of one model beside its name. */
typedef struct sh_openai_model_info {
    const char *id;
    int32_t max_model_len; /* the context a request may use (vLLM's "max_model_len") */
    int32_t n_ctx_train;   /* the context the model was trained for; 0: left out */
    int32_t n_vocab;       /* 0: left out */
    bool embeddings;       /* POST /v1/embeddings is served for it */
} sh_openai_model_info;

/* The same list with each model's "max_model_len", "capabilities" (["completion","chat"], then
 * "embeddings" where it is served) and llama-server's "meta" object ({"n_ctx_train","n_vocab"}). */
char *sh_openai_models_info_json(const sh_openai_model_info *models, int32_t n, int64_t created,
                                 const char *owned_by);

/* GET /health: {"status": status} plus the extra JSON members in extra_json (e.g.
 * "\"replicas\":2"; NULL for none; must be valid JSON members, it is parsed). */
char *sh_openai_health_json(const char *status, const char *extra_json);

/* --- stop strings over a stream --- */

/* Holds back generated text that may be the start of a stop string, so a stop string is never
 * emitted and never split across emitted pieces, and never ends emitted text inside a UTF-8
 * character. Matching is by bytes; the earliest match among the stop strings wins. */
typedef struct sh_openai_stopper {
    char *stop[SH_OPENAI_MAX_STOP];
    size_t stop_len[SH_OPENAI_MAX_STOP];
    int n_stop;
    char *held; /* text received and not yet emitted */
    size_t held_len, held_cap;
    size_t out_len; /* bytes of held handed out by the last call */
    bool stopped;
    int32_t which; /* the stop string that matched, -1 */
} sh_openai_stopper;

/* Copies the stop strings (empty ones are ignored). Returns SH_EINVAL (n > 4), SH_ENOMEM. */
sh_err sh_openai_stopper_init(sh_openai_stopper *s, const char *const *stops, int n);
void sh_openai_stopper_fini(sh_openai_stopper *s);

/* Feeds the next piece of text. *out and *out_len give the text that is safe to emit now (valid
 * until the next call; may be empty). *stopped becomes true when a stop string matched: the text
 * before it has been emitted, the rest is discarded, and later feeds emit nothing. Returns SH_OK
 * or SH_ENOMEM (nothing consumed). */
sh_err sh_openai_stopper_feed(sh_openai_stopper *s, const char *piece, size_t len, const char **out,
                              size_t *out_len, bool *stopped);

/* The generation ended without a stop string: emits everything still held. */
void sh_openai_stopper_flush(sh_openai_stopper *s, const char **out, size_t *out_len);

/* --- API keys --- */

typedef struct sh_openai_key {
    const char *key;  /* the secret */
    int32_t priority; /* the priority class of requests with this key */
    bool admin;       /* may also change the server (POST /admin/policy/reload) */
} sh_openai_key;

/* Checks an Authorization header value ("Bearer <key>", NULL when absent) against keys, in time
 * that does not depend on the keys' contents. With n_keys 0 authentication is off: SH_OK and
 * *priority = default_priority. Returns SH_OK with the key's priority, or SH_EINVAL with a 401
 * error (code "invalid_api_key"). */
sh_err sh_openai_auth_check(const sh_openai_key *keys, int32_t n_keys, const char *authorization,
                            int32_t default_priority, int32_t *priority, sh_openai_error *err);

/* The same check for a route that changes the server (POST under /admin/): with keys set, the key
 * must also be an admin key, else SH_EINVAL with a 403 error (code "admin_key_required"); with
 * n_keys 0 authentication is off and SH_OK. */
sh_err sh_openai_auth_admin(const sh_openai_key *keys, int32_t n_keys, const char *authorization,
                            sh_openai_error *err);

/* Length of the valid UTF-8 sequence at p (1..4 of the left bytes: no overlong forms, no
 * surrogates, nothing past U+10FFFF), or 0 when p does not start one. */
size_t sh_openai_utf8_seq(const unsigned char *p, size_t left);

/* For net/ files: generated text as a JSON string (a jansson json_t, new reference; NULL when out
 * of memory), invalid UTF-8 bytes replaced by U+FFFD as OpenAI does. NULL s is "". */
void *sh__openai_text_json(const char *s);

#endif
