/* The embedding engine's state (include/shoal.h), shared by api/engine.c (open, close, model,
 * tokenizer, metrics) and api/engine_req.c (requests, the "api" actor, sh_poll). */
#ifndef SH_API_ENGINE_INT_H
#define SH_API_ENGINE_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "actors/cluster.h"
#include "actors/replica.h"
#include "actors/serve.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "shoal.h"
#include "shoal/fault.h"
#include "shoal/runtime.h"

#define SH_API_BUCKETS 1024 /* request table buckets (chained; requests are few hundred) */

/* A chat request's tool calls as they stream (api/engine_tools.c). */
typedef struct sh_api_tools sh_api_tools;

/* One request submitted and not yet over. Owned by the table until its final callback. */
typedef struct sh_api_req {
    uint64_t id;
    sh_callbacks cb;
    void *user;
    bool cancelling;
    bool logprobs;           /* on_token carries log-probabilities */
    int32_t n_prompt, n_gen; /* prompt tokens; tokens passed to on_token so far */
    sh_api_tools *tools;     /* a chat with tools: its calls are taken out (NULL: none) */
    struct sh_api_req *next; /* bucket chain */
} sh_api_req;

/* One event for sh_poll: a TOKEN, DONE or FAIL the batcher sent, copied out of its message in
 * one allocation (arrays first, then the text and its NUL). */
typedef struct sh_api_ev {
    struct sh_api_ev *next;
    uint32_t type; /* SH_MSG_TOKEN, SH_MSG_DONE, SH_MSG_FAIL, or SH_MSG_CANCEL: sh_cancel's end */
    uint64_t id;
    int32_t index, n_ids, top_n;
    int32_t *ids;     /* (n_ids) */
    float *lp;        /* (n_ids) or NULL */
    int32_t *top_ids; /* (n_ids * top_n) */
    float *top_lp;    /* (n_ids * top_n) */
    char *text;       /* text_len bytes and a NUL; the error message for FAIL */
    size_t text_len;
    sh_finish finish;
    int32_t n_prompt, n_gen, n_cached;
    sh_err code;
    float *emb; /* DONE of an embedding: n_emb floats, owned (freed with the event) */
    int32_t n_emb;
} sh_api_ev;

struct sh_engine {
    /* Fixed from open to close. */
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
    sh_llama_ctx *ctx;
    sh_runtime *rt;
    sh_addr batcher, self; /* the batcher and the "api" actor */
    sh_chat_template chat;
    bool has_template, has_system;
    char system[1024];
    char name[128];
    int32_t n_ctx, max_seqs;
    uint8_t pooling; /* sh_llama_pooling of the model (here or on the workers); 0: none */
    int32_t limit;   /* requests pending before SH_EBUSY: max_queue waiting plus those running */
    int64_t n_blocks;
    uint64_t kv_bytes, weight_bytes;
    int efd; /* eventfd: readable while events are queued */
    sh_engine_log_fn log;
    void *log_user;
    /* The placement options (cpu_mask, sched, nice) every runtime thread applies first
     * (sh__engine_thread_start), as the CPU backend's threads do. */
    sh__cpu_thread_opts place;
    /* An engine that fronts worker nodes (api/engine_front.c); NULL for a model run here. */
    sh_cluster_front *front;
    sh_replica_set *replicas;     /* what serves its requests (actors/replica.h) */
    struct sh_supervisor *sup;    /* its watchdog and recovery (actors/supervisor.h) */
    sh_cluster_config *front_cfg; /* its script, which front->plan points into */

    /* Under mu. */
    pthread_mutex_t mu;
    bool closing;
    uint64_t next_id;
    int32_t pending;
    sh_api_req *table[SH_API_BUCKETS];
    sh_api_ev *head, *tail;
    uint64_t requests_total, tokens_total, prompt_tokens_total;
    sh_fault *fault;  /* created on first use */
    char failed[640]; /* a cluster front that must stop: why (empty: serving) */

    /* Held by the thread inside sh_poll() or sh_engine_close(). */
    atomic_int busy;
    atomic_int started; /* the api actor's init ran (open waits for it) */
};

/* api/engine_front.c: opens the front of a cluster script with worker nodes: joins them and
 * spawns a kvmgr and batcher per replica (a router before several; actors/replica.h) and the api
 * actor, on eng->rt (created here, node id gateway.node + 1). The script is cfg, loaded from
 * `script`. Returns SH_OK, or an error with e filled (what it built is freed by the engine's
 * free, sh__replica_teardown). */
sh_err sh__engine_front_open(sh_engine *eng, const sh_engine_opts *o, const char *script,
                             const sh_cluster_config *cfg, sh_error *e);

/* api/engine.c */
void sh__engine_log_sink(void *ud, sh_log_level level, const char *line, size_t len);
sh_err sh__engine_wait_started(sh_engine *eng, sh_error *e);

/* sh_runtime_opts.thread_start of the engine's runtimes (ud: the engine): places the thread as
 * eng->place says. */
void sh__engine_thread_start(void *ud);

/* True when eng is an engine that sh_engine_open returned and sh_engine_close has not finished
 * closing (false for NULL). Any thread. */
bool sh__engine_live(const sh_engine *eng);

/* api/engine_req.c */
extern const sh_actor_vtable sh__engine_api_vtable;
/* Frees every queued event (close, after the runtime is gone). */
void sh__engine_events_free(sh_engine *eng);
/* A cluster front lost its workers for good (what: why): every request in the table ends with
 * on_error(SH_EIO), queued for sh_poll, and sh_submit refuses new ones. Any thread. */
void sh__engine_front_failed(sh_engine *eng, const char *what);
/* Ends every request still in the table with on_error(SH_ECLOSED), on the calling thread. */
void sh__engine_fail_all(sh_engine *eng);
/* Checks n host messages (roles, UTF-8) and points msgs at them; SH_EINVAL naming what (fn
 * prefixes the message). */
sh_err sh__engine_chat_msgs(const sh_chat_message *in, int32_t n, sh_chat_msg *msgs, const char *fn,
                            sh_error *e);
/* api/engine_tools.c */
/* Whether r is a chat that goes through the tools path (messages_json, tools or tool_choice). */
bool sh__engine_tools_wanted(const sh_request_opts *r);
/* r's chat checked as POST /v1/chat/completions checks it, its tools rendered in the model's
 * tool syntax and tokenized into *ids (at most max_ids; SH_ERANGE with *n past it); *gram, when
 * NULL, gets the grammar forcing a call (tool_choice "required" or named); *out the state that
 * takes the calls out of the text when tools are active (NULL otherwise). SH_EINVAL naming the
 * field, SH_ENOMEM. */
sh_err sh__engine_tools_prompt(sh_engine *eng, const sh_request_opts *r, size_t max_ids,
                               int32_t **ids, size_t *n, char **gram, sh_api_tools **out,
                               sh_error *e);
/* The next generated text (last: the request ended): *content is what to pass on (NULL: none),
 * valid until the next call; calls go to sh__engine_tools_calls. SH_OK or SH_ENOMEM. */
sh_err sh__engine_tools_feed(sh_api_tools *t, const char *piece, size_t len, bool last,
                             const char **content);
/* The calls so far as a JSON array text (owned by t), NULL when none. */
const char *sh__engine_tools_calls(sh_api_tools *t);
void sh__engine_tools_free(sh_api_tools *t);
/* Whether text[0, len) is valid UTF-8 (no overlong forms, surrogates or code points past
 * U+10FFFF). */
bool sh__engine_utf8_valid(const char *text, size_t len);

#endif
