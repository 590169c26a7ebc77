/* Shoal's public embedding API: run a model (or front a cluster) inside a host program and drive
 * it from the host's own loop. Everything a host program may rely on is declared under include/;
 * nothing else in the tree is API. docs/embedding.md is the tour; this header is the reference.
 *
 * C99, and C++ through extern "C". Every type is opaque or a plain struct of options.
 *
 * The model of use (DESIGN.md section 9):
 *
 *     sh_engine_opts o = sh_engine_opts_default();
 *     o.model_path = "models/smollm2-135m-instruct-q4_1.gguf";
 *     sh_engine *eng;
 *     if (sh_engine_open(&o, &eng, &err)) ...;          // loads the model, starts its threads
 *     sh_request_opts r = sh_request_opts_default();
 *     r.prompt = "Once upon a time";
 *     sh_callbacks cb = {on_token, on_done, on_error};
 *     sh_submit(eng, &r, &cb, user, &id, &err);          // returns at once
 *     while (running) sh_poll(eng, 16, NULL);           // callbacks run here, on this thread
 *     sh_engine_close(eng);
 *
 * Threads. The library starts and joins its own threads (compute workers, the runtime's control
 * loops). Callbacks run only inside sh_poll(), on the thread that called it; nothing else ever
 * calls the host back, except the log callback (below). Unless a function says otherwise it may
 * be called from any thread, including from inside a callback.
 *
 * What the library never does: install signal handlers, call exit() or abort() on anything a
 * caller, a file or a peer can cause, write to stdout or stderr (it logs only through the log
 * callback), or keep memory beyond sh_engine_close().
 *
 * Errors. Fallible functions return an sh_err (shoal/err.h: SH_OK is 0) and, where they take an
 * `sh_error *err` (which may be NULL), fill it with the code and one line naming the offending
 * argument or value. Misuse (NULL arguments, an unknown or finished request id, a call from the
 * wrong place) gets SH_EINVAL, SH_ENOTFOUND or SH_EBUSY with a message, never a crash. */
#ifndef SHOAL_H
#define SHOAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "shoal/err.h"
#include "shoal/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below grows or a function changes meaning. Structs of options carry
 * their own size (struct_size, set by the *_default() functions), so a program built against an
 * older header keeps working with a newer library. */
#define SH_API_VERSION 2

typedef struct sh_engine sh_engine;

/* ---- Logging ----------------------------------------------------------------------------- */

/* Levels as in shoal/runtime.h's sh_log_level (1 error .. 5 trace). */
#define SH_ENGINE_LOG_ERROR 1
#define SH_ENGINE_LOG_WARN 2
#define SH_ENGINE_LOG_INFO 3
#define SH_ENGINE_LOG_DEBUG 4

/* Receives one complete log line (NUL-terminated, no newline). Called from the library's own
 * threads as well as the caller's: it must be thread-safe, quick, and must not call into the
 * engine. */
typedef void (*sh_engine_log_fn)(void *user, int level, const char *line);

/* ---- Opening and closing an engine ------------------------------------------------------- */

typedef struct sh_engine_opts {
    uint32_t struct_size; /* sizeof(sh_engine_opts); set by sh_engine_opts_default() */
    /* Exactly one of the two: */
    const char *model_path;     /* a GGUF (or llama2.c) file: the model runs in this process */
    const char *cluster_script; /* a Lua cluster script, as `shoal serve -c` takes it: the engine
                                 * fronts the cluster it describes (docs/cluster.md) */
    int32_t threads;            /* compute threads; 0: one per core, at most 8 */
    uint64_t memory_budget;     /* bytes the engine may hold (weights, KV, buffers); 0: no limit.
                                 * Open fails with SH_ENOMEM, naming both figures, when the model
                                 * plus the KV cache would exceed it */
    uint64_t kv_bytes;          /* KV cache memory; 0: the same default as `shoal serve` (within
                                 * memory_budget when one is set) */
    int32_t n_ctx;              /* positions per sequence; 0: the model's, capped as `shoal serve`
                                 * caps it */
    int32_t max_seqs;           /* sequences decoded together; 0: 16 */
    int32_t max_queue;          /* requests waiting before sh_submit answers SH_EBUSY; 0: 256 */
    sh_engine_log_fn log;       /* NULL: the library logs nothing */
    void *log_user;
    int32_t log_level; /* SH_ENGINE_LOG_*; 0: SH_ENGINE_LOG_WARN */
    /* Sharing the CPU with the host (a game loop, a server's own threads), for a model run in
     * this process; Linux applies them to every compute thread, elsewhere they are ignored: */
    uint64_t cpu_mask; /* bit i: compute threads may run on CPU i (i < 64); 0: anywhere the
                        * opening thread may */
    int32_t sched;     /* SH_ENGINE_SCHED_*: 0 normal, 1 batch (SCHED_BATCH), 2 idle (SCHED_IDLE:
                        * the engine computes only when the host's threads leave a CPU free) */
    int32_t nice;      /* 0..19 added to the compute threads' niceness */
    int32_t no_spin;   /* nonzero: compute threads sleep at once between ops instead of spinning
                        * 10-100 us (each op then costs a wake-up; the host keeps its CPU) */
    /* A cluster front's wait for a lost worker node (`shoal serve --recover-timeout`): how long
     * the replicas with a stage there stay paused for it to come back (stopped, cut off, or
     * restarted) and resume by recompute, when no standby takes its place. Past it, a replica
     * leaves routing, and when none is left every open request ends with on_error (SH_EIO).
     * Milliseconds: 0 means 30000 (as `shoal serve -c`), -1 no wait (fail at once), at most
     * 3600000; anything else fails the open with SH_EINVAL. Ignored for a model run here. */
    int32_t recover_timeout_ms;
    /* Speculative decoding, as `shoal serve --spec` (docs/serving.md): SH_ENGINE_SPEC_NGRAM drafts
     * up to spec_k tokens per decode step by n-gram lookup in each request's prompt and output
     * and verifies them in the same step (greedy output unchanged); SH_ENGINE_SPEC_OFF (0): none,
     * unless the cluster script's batcher.spec is "ngram". spec_k: 1..16; 0: the script's
     * batcher.spec_k, else 8. Anything else fails the open with SH_EINVAL. A request opts out
     * with sh_request_opts.no_spec, or caps its drafts a step with spec_n_max. */
    int32_t spec;
    int32_t spec_k;
} sh_engine_opts;

enum { SH_ENGINE_SCHED_NORMAL = 0, SH_ENGINE_SCHED_BATCH = 1, SH_ENGINE_SCHED_IDLE = 2 };
enum { SH_ENGINE_SPEC_OFF = 0, SH_ENGINE_SPEC_NGRAM = 1 };

/* The defaults: every field zero or NULL, struct_size set. Any thread; never fails. Inline, so
 * that struct_size is the size this program was compiled with: a library built against a later
 * header (with a larger struct) reads only those bytes and takes its defaults for the rest. */
static inline sh_engine_opts sh_engine_opts_default(void)
{
    sh_engine_opts o;
    memset(&o, 0, sizeof o);
    o.struct_size = (uint32_t)sizeof o;
    return o;
}

/* Opens an engine: loads the model (or connects to the cluster), starts the engine's threads and
 * returns when it is ready to take requests. Blocks (loading a model takes seconds). Any thread.
 * On success *out is the engine, owned by the caller until sh_engine_close(). On failure *out is
 * NULL, nothing is left running or allocated, and err names the cause: SH_EINVAL (no model and
 * no script, or both, a bad option), SH_EIO / SH_EFORMAT / SH_EUNSUPPORTED (the model file),
 * SH_ELUA (the script), SH_ENOMEM (memory, or the memory budget). */
sh_err sh_engine_open(const sh_engine_opts *opts, sh_engine **out, sh_error *err);

/* Closes an engine: every request still in flight ends with its on_error callback (SH_ECLOSED),
 * run once, on the calling thread, before this returns; then the engine's threads are joined and
 * every byte it held is freed. Blocks until that is done. NULL is fine (SH_OK). Must not be
 * called from inside a callback or while another thread is in sh_poll() on this engine: both
 * answer SH_EBUSY and leave the engine open. Afterwards the handle is refused by every call:
 * SH_EINVAL (sh_fd -1, sh_pending 0, sh_engine_fault NULL), a second close included, as long as
 * no later engine was opened at the same address; no call may race with its engine's close. */
sh_err sh_engine_close(sh_engine *eng);

/* ---- Requests ---------------------------------------------------------------------------- */

typedef struct sh_chat_message {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content; /* UTF-8 */
} sh_chat_message;

/* One request, with the fields of the OpenAI API. Exactly one of prompt, prompt_tokens and
 * messages is given. The zero value of every sampling field means greedy decoding (temperature 0);
 * set temperature (and the rest) to sample. Everything is borrowed for the sh_submit() call only
 * (copied as needed). */
typedef struct sh_request_opts {
    uint32_t struct_size;         /* sizeof(sh_request_opts); set by sh_request_opts_default() */
    const char *prompt;           /* a completion prompt, UTF-8 */
    const int32_t *prompt_tokens; /* or a prompt as token ids */
    int32_t n_prompt_tokens;
    const sh_chat_message *messages; /* or a chat: the model's chat template is applied */
    int32_t n_messages;
    int32_t max_tokens;                        /* tokens to generate at most; 0: 256 */
    float temperature;                         /* 0..2; 0: greedy */
    float top_p;                               /* 0..1; 0: 1 (off) */
    int32_t top_k;                             /* 0: off */
    float min_p;                               /* 0..1; 0: off */
    float presence_penalty, frequency_penalty; /* -2..2 */
    float repeat_penalty;                      /* 0: 1 (off) */
    const char *const *stop;                   /* stop strings, at most 4 */
    int32_t n_stop;
    uint64_t seed;         /* the sampler's seed: the same seed and request give the same text */
    int32_t priority;      /* 0..255, lower runs first; 0 is the default class */
    int32_t top_logprobs;  /* 0..20 alternatives per token in on_token; 0: none */
    bool logprobs;         /* on_token carries each token's log-probability */
    bool ignore_eos;       /* generate max_tokens whatever the model says */
    uint32_t timeout_ms;   /* the request ends (finish SH_FINISH_DEADLINE) after this; 0: none */
    bool no_spec;          /* never draft tokens for it (sh_engine_opts.spec); top_logprobs > 0
                            * implies it */
    int32_t spec_n_max;    /* at most this many drafted tokens a step for it (1..16, under
                            * sh_engine_opts.spec_k; llama.cpp's speculative.n_max); 0: no cap of
                            * its own. Outside 0..16 sh_submit fails with SH_EINVAL. */
    float typical_p;       /* locally typical sampling (llama.cpp's), 0..1; 0: 1 (off) */
    int32_t repeat_last_n; /* the penalties' window of recent tokens: 0: 64; -1: the context */
    int32_t min_tokens;    /* end-of-sequence tokens are masked before this many (as vLLM's
                            * min_tokens); 0: none */
    /* An embedding instead of a completion: the prompt is prefilled and nothing is generated
     * (on_token never runs); on_done's info carries the model's final hidden states, pooled as
     * its <arch>.pooling_type says (mean by default; CLS or last token) and L2-normalised, as
     * POST /v1/embeddings computes them (docs/serving.md). The sampling fields are ignored. An
     * engine fronting worker nodes computes them too (the last stage's node pools). */
    bool embed;
    /* Structured output (docs/serving.md, "Structured output"): the generated text follows
     * `grammar`, GBNF text as llama.cpp writes it (start rule `root`), or `response_format`,
     * OpenAI's response_format object as JSON text: {"type": "json_object"} (any JSON object) or
     * {"type": "json_schema", "json_schema": {"schema": {...}, "strict": true}}. At most one of
     * the two; NULL: none. Generation ends where the grammar does (finish SH_FINISH_STOP), or at
     * max_tokens. A grammar that does not parse fails sh_submit with SH_EINVAL and a message
     * naming its line and column; a schema outside the converter's coverage with SH_EINVAL naming
     * the keyword; a grammar whose matcher passes its bounds while generating ends the request
     * with on_error (SH_ERANGE, "grammar limit hit ..."). Copied by sh_submit. */
    const char *grammar;
    const char *response_format;
    /* Tool calls (docs/embedding.md, "Tool calls"), as POST /v1/chat/completions takes them
     * (docs/serving.md, "Tool calls"); each field is JSON text in OpenAI's form and is checked
     * as the server checks it (a bad one fails sh_submit with SH_EINVAL naming the field).
     * messages_json: the chat as OpenAI's "messages" array, instead of messages: the form that
     * carries an assistant's "tool_calls" and "tool" messages with their "tool_call_id".
     * tools: OpenAI's "tools" array ({"type": "function", "function": {"name", "description",
     * "parameters": a JSON schema}}); needs messages or messages_json. tool_choice: "auto" (the
     * default with tools), "none", "required" (a call is forced by a grammar), or the object
     * {"type": "function", "function": {"name": ...}} (a call of that one, forced). A request
     * with tools (and tool_choice not "none") has its calls taken out of the text: on_token
     * carries only the text outside them (a call's text is never passed on, so some events
     * carry ids and no text), and on_done's info carries the calls (tool_calls). Not with
     * embed; grammar or response_format win over a forcing tool_choice. */
    const char *messages_json;
    const char *tools;
    const char *tool_choice;
    bool no_parallel_tool_calls; /* parallel_tool_calls false: one call at most */
} sh_request_opts;

/* The defaults (greedy, 256 tokens, struct_size set). Any thread; never fails. Inline for the
 * reason sh_engine_opts_default() is. */
static inline sh_request_opts sh_request_opts_default(void)
{
    sh_request_opts r;
    memset(&r, 0, sizeof r);
    r.struct_size = (uint32_t)sizeof r;
    r.max_tokens = 256;
    return r;
}

typedef enum sh_finish {
    SH_FINISH_STOP = 0,       /* end of sequence or a stop string */
    SH_FINISH_LENGTH = 1,     /* max_tokens or the context length */
    SH_FINISH_CANCEL = 2,     /* sh_cancel() */
    SH_FINISH_DEADLINE = 3,   /* timeout_ms passed */
    SH_FINISH_TOOL_CALLS = 4, /* the model called tools (sh_done_info.tool_calls) */
} sh_finish;

/* Newly generated tokens of one request. Every pointer is valid during the callback only. */
typedef struct sh_token_event {
    const char *text; /* the text they add (UTF-8, whole characters, stop strings withheld) */
    size_t text_len;
    const int32_t *ids; /* the token ids */
    int32_t n_ids;
    int32_t index;          /* ids[0] is the index-th generated token (from 0) */
    const float *logprobs;  /* n_ids log-probabilities, or NULL unless logprobs was asked */
    int32_t top_n;          /* alternatives per token (top_logprobs), 0 when not asked */
    const int32_t *top_ids; /* n_ids * top_n, token-major */
    const float *top_logprobs;
} sh_token_event;

typedef struct sh_done_info {
    sh_finish finish;
    int32_t prompt_tokens;     /* usage, as OpenAI counts it */
    int32_t completion_tokens; /* tokens generated */
    int32_t cached_tokens;     /* prompt tokens served from the prefix cache */
    /* sh_request_opts.embed: the unit vector (n_embedding floats, the model's width), valid
     * during the callback only; NULL and 0 otherwise. */
    const float *embedding;
    int32_t n_embedding;
    /* sh_request_opts.tools: the calls the model made, as a JSON array text in the form of
     * OpenAI's message.tool_calls ([{"id": "call_...", "type": "function", "function": {"name",
     * "arguments": JSON text}}]), valid during the callback only; NULL when it made none. */
    const char *tool_calls;
} sh_done_info;

/* A request's callbacks. They run inside sh_poll() on its thread. on_token may run any number of
 * times; then exactly one of on_done and on_error runs, once, and the request is over: its id is
 * unknown from then on. Each may be NULL. Callbacks may call sh_submit() and sh_cancel() (also
 * for their own request); sh_poll() and sh_engine_close() from a callback answer SH_EBUSY. */
typedef struct sh_callbacks {
    void (*on_token)(void *user, uint64_t id, const sh_token_event *ev);
    void (*on_done)(void *user, uint64_t id, const sh_done_info *info);
    /* code: why (SH_EBUSY overloaded, SH_ECLOSED engine closed, SH_EIO a cluster node lost, ...);
     * message: one line, valid during the callback. */
    void (*on_error)(void *user, uint64_t id, sh_err code, const char *message);
} sh_callbacks;

/* Submits a request and returns at once with its id in *id (never 0; ids are not reused by an
 * engine). cb is copied; user is passed back to every callback. Does not block. On failure no
 * callback will run for it and *id is 0: SH_EINVAL (a NULL argument, no prompt or more than one,
 * a value out of range, a prompt that is not valid UTF-8, a prompt longer than the context),
 * SH_EBUSY (the queue is full), SH_ECLOSED (the engine is closing), SH_EIO (a cluster front that
 * lost its worker nodes for good: its open requests ended with on_error SH_EIO; close it). */
sh_err sh_submit(sh_engine *eng, const sh_request_opts *req, const sh_callbacks *cb, void *user,
                 uint64_t *id, sh_error *err);

/* Asks a request to stop; it ends later with on_done (finish SH_FINISH_CANCEL) or, if it had
 * already finished in the meantime, as it would have. Does not block. SH_ENOTFOUND: no such
 * request (never submitted, or already over: its final callback has run); SH_ECANCELED: already
 * being cancelled (a second sh_cancel). */
sh_err sh_cancel(sh_engine *eng, uint64_t id, sh_error *err);

/* ---- Driving the engine from the host's loop --------------------------------------------- */

/* Runs the callbacks that are due, on the calling thread, waiting up to timeout_ms for the first
 * one (0: do not wait; -1: wait until one is due). *ran (may be NULL) counts callbacks run.
 * One thread at a time: a concurrent call from another thread, or a call from a callback,
 * answers SH_EBUSY without running anything. */
sh_err sh_poll(sh_engine *eng, int32_t timeout_ms, uint32_t *ran);

/* A file descriptor that is readable while callbacks are due (for epoll, select, libuv's
 * uv_poll): call sh_poll(eng, 0, NULL) when it is. Owned by the engine (do not close or read
 * it); the same for the engine's life. -1 for a NULL engine. */
int sh_fd(sh_engine *eng);

/* Requests submitted and not yet over (their final callback has not run). */
int32_t sh_pending(sh_engine *eng);

/* ---- Model, tokenizer, chat template ----------------------------------------------------- */

typedef struct sh_model_info {
    char name[128];       /* general.name, or the file name */
    char arch[32];        /* "llama", "gemma3", "qwen3", ... */
    char weight_type[16]; /* the main weights' type: "Q4_1", "Q4_K", "F16", ... */
    int32_t n_vocab;
    int32_t n_ctx; /* positions per sequence this engine serves */
    int32_t n_ctx_train;
    int32_t n_layers;
    int32_t dim;
    uint64_t n_params;
    uint64_t weight_bytes;  /* bytes of weights held (0 when fronting a cluster) */
    uint64_t kv_bytes;      /* bytes of KV cache held (0 when fronting a cluster) */
    int32_t bos, eos;       /* -1 when the model has none */
    bool has_chat_template; /* a template is known for the model */
} sh_model_info;

sh_err sh_model_info_get(sh_engine *eng, sh_model_info *out);

/* Tokenizes UTF-8 text. Writes at most cap ids to ids and the full count to *n (call with cap 0
 * to size the buffer; SH_ERANGE when cap was too small, ids then holds the first cap).
 * add_special: prepend BOS as the model does for a prompt; parse_special: special-token texts
 * (<|im_end|>) become their tokens. SH_EINVAL: invalid UTF-8. */
sh_err sh_tokenize(sh_engine *eng, const char *text, size_t len, bool add_special,
                   bool parse_special, int32_t *ids, int32_t cap, int32_t *n, sh_error *err);

/* Turns ids back into text: writes at most cap bytes (NUL-terminated when room allows) and the
 * full length without the NUL to *len; SH_ERANGE when cap was too small. SH_EINVAL: an id out of
 * the vocabulary. */
sh_err sh_detokenize(sh_engine *eng, const int32_t *ids, int32_t n, char *text, size_t cap,
                     size_t *len, sh_error *err);

/* Applies the model's chat template to messages (with the assistant's turn opened), as a chat
 * request would: output as sh_detokenize's. SH_EUNSUPPORTED: the model has no template. */
sh_err sh_chat_apply(sh_engine *eng, const sh_chat_message *messages, int32_t n, char *text,
                     size_t cap, size_t *len, sh_error *err);

/* ---- Metrics ----------------------------------------------------------------------------- */

typedef struct sh_engine_stats {
    int32_t pending; /* requests not over */
    int32_t running; /* sequences being decoded */
    int32_t queued;  /* requests waiting */
    uint64_t requests_total, tokens_generated_total, prompt_tokens_total;
    int32_t kv_blocks_total, kv_blocks_used;
} sh_engine_stats;

sh_err sh_engine_stats_get(sh_engine *eng, sh_engine_stats *out);

/* Every metric of the engine in Prometheus' text format (what `shoal serve` shows on /metrics).
 * Output as sh_detokenize's. */
sh_err sh_metrics_snapshot(sh_engine *eng, char *text, size_t cap, size_t *len);

/* ---- Fault injection (for test harnesses) ------------------------------------------------ */

struct sh_fault;

/* The engine's fault layer (include/shoal/fault.h: sh_fault_rule_add, sh_fault_heal, ...),
 * created with the engine. It acts on the messages this engine's runtime sends to other nodes,
 * so it matters for an engine opened on a cluster script (a model run in this process sends
 * nothing over the network). Owned by the engine: valid until sh_engine_close(), never destroyed
 * by the caller. NULL for a NULL engine. */
struct sh_fault *sh_engine_fault(sh_engine *eng);

#ifdef __cplusplus
}
#endif

#endif
