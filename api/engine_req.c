/* Requests of the embedding API (include/shoal.h): sh_submit and sh_cancel send SUBMIT and CANCEL
 * to the batcher as the engine's "api" actor; that actor copies each TOKEN, DONE and FAIL into a
 * queue and signals the eventfd; sh_poll drains the queue on the host's thread and runs the
 * callbacks, outside the lock, so that they may submit and cancel. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "actors/actor_util.h"
#include "api/engine_int.h"
#include "base/error.h"
#include "model/grammar.h"
#include "model/sampler.h"
#include "net/json_schema.h"

#define PENALTY_WINDOW 64 /* tokens the penalties look back over, as the gateway */
#define MAX_STOP 4

/* ---- the request table (under mu) ---------------------------------------------------------- */

static sh_api_req **slot(sh_engine *eng, uint64_t id)
{
    sh_api_req **pp = &eng->table[sh__act_hash_u64(id) % SH_API_BUCKETS];
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->next;
    return pp;
}

static void req_free(sh_api_req *q)
{
    sh__engine_tools_free(q->tools);
    free(q);
}

static sh_api_req *unlink_req(sh_engine *eng, uint64_t id)
{
    sh_api_req **pp = slot(eng, id), *r = *pp;
    if (r) {
        *pp = r->next;
        eng->pending--;
    }
    return r;
}

/* ---- UTF-8 and chat messages --------------------------------------------------------------- */

bool sh__engine_utf8_valid(const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned cp, min;
        if (c >= 0xC2 && c <= 0xDF)
            n = 1, cp = c & 0x1F, min = 0x80;
        else if (c >= 0xE0 && c <= 0xEF)
            n = 2, cp = c & 0x0F, min = 0x800;
        else if (c >= 0xF0 && c <= 0xF4)
            n = 3, cp = c & 0x07, min = 0x10000;
        else
            return false;
        if (len - i <= n)
            return false;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += n + 1;
    }
    return true;
}

static bool utf8_str(const char *s) { return sh__engine_utf8_valid(s, strlen(s)); }

sh_err sh__engine_chat_msgs(const sh_chat_message *in, int32_t n, sh_chat_msg *msgs, const char *fn,
                            sh_error *e)
{
    for (int32_t i = 0; i < n; i++) {
        const char *role = in[i].role, *content = in[i].content;
        if (!role || !content)
            return sh__error_set(e, SH_EINVAL, "%s: messages[%d].%s is NULL", fn, (int)i,
                                 role ? "content" : "role");
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant"))
            return sh__error_set(e, SH_EINVAL,
                                 "%s: messages[%d].role must be \"system\", \"user\" or "
                                 "\"assistant\"",
                                 fn, (int)i);
        if (!utf8_str(content))
            return sh__error_set(e, SH_EINVAL, "%s: messages[%d].content is not valid UTF-8", fn,
                                 (int)i);
        msgs[i] = (sh_chat_msg){role, content};
    }
    return SH_OK;
}

static sh_api_ev *ev_new(uint32_t type, uint64_t id, int32_t n, bool lp, int32_t top_n,
                         const char *text, size_t text_len);
static void ev_queue(sh_engine *eng, sh_api_ev *ev);
static void ev_signal(sh_engine *eng);

/* ---- sh_submit ----------------------------------------------------------------------------- */

static bool in_range(float v, float lo, float hi) { return !isnan(v) && v >= lo && v <= hi; }

/* Checks a request's values (everything but the prompt's tokens). */
static sh_err check_request(const sh_request_opts *r, sh_error *e)
{
    int forms = (r->prompt != NULL) + (r->prompt_tokens != NULL || r->n_prompt_tokens != 0) +
                (r->messages != NULL || r->n_messages != 0) + (r->messages_json != NULL);
    if (forms != 1)
        return sh__error_set(e, SH_EINVAL,
                             forms ? "sh_submit: give exactly one of prompt, prompt_tokens, "
                                     "messages and messages_json"
                                   : "sh_submit: no prompt (prompt, prompt_tokens, messages or "
                                     "messages_json)");
    if ((r->prompt_tokens != NULL) != (r->n_prompt_tokens > 0))
        return sh__error_set(e, SH_EINVAL, "sh_submit: prompt_tokens %s with n_prompt_tokens %d",
                             r->prompt_tokens ? "given" : "NULL", (int)r->n_prompt_tokens);
    if ((r->messages != NULL) != (r->n_messages > 0))
        return sh__error_set(e, SH_EINVAL, "sh_submit: messages %s with n_messages %d",
                             r->messages ? "given" : "NULL", (int)r->n_messages);
    if (r->max_tokens < 0)
        return sh__error_set(e, SH_EINVAL, "sh_submit: max_tokens = %d is negative",
                             (int)r->max_tokens);
    if (!in_range(r->temperature, 0, 2))
        return sh__error_set(e, SH_EINVAL, "sh_submit: temperature = %g: must be 0 to 2",
                             (double)r->temperature);
    if (!in_range(r->top_p, 0, 1))
        return sh__error_set(e, SH_EINVAL, "sh_submit: top_p = %g: must be 0 to 1",
                             (double)r->top_p);
    if (r->top_k < 0)
        return sh__error_set(e, SH_EINVAL, "sh_submit: top_k = %d is negative", (int)r->top_k);
    if (!in_range(r->min_p, 0, 1))
        return sh__error_set(e, SH_EINVAL, "sh_submit: min_p = %g: must be 0 to 1",
                             (double)r->min_p);
    if (!in_range(r->presence_penalty, -2, 2) || !in_range(r->frequency_penalty, -2, 2))
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: presence_penalty = %g, frequency_penalty = %g: each "
                             "must be -2 to 2",
                             (double)r->presence_penalty, (double)r->frequency_penalty);
    if (!in_range(r->repeat_penalty, 0, 100))
        return sh__error_set(e, SH_EINVAL, "sh_submit: repeat_penalty = %g: must be 0 to 100",
                             (double)r->repeat_penalty);
    if (!in_range(r->typical_p, 0, 1))
        return sh__error_set(e, SH_EINVAL, "sh_submit: typical_p = %g: must be 0 to 1",
                             (double)r->typical_p);
    if (r->repeat_last_n < -1)
        return sh__error_set(e, SH_EINVAL, "sh_submit: repeat_last_n = %d: must be -1 or more",
                             (int)r->repeat_last_n);
    if (r->min_tokens < 0 || r->min_tokens > (1 << 20))
        return sh__error_set(e, SH_EINVAL, "sh_submit: min_tokens = %d: must be 0 to %d",
                             (int)r->min_tokens, 1 << 20);
    if (r->n_stop < 0 || r->n_stop > MAX_STOP || (r->n_stop > 0 && !r->stop))
        return sh__error_set(e, SH_EINVAL, "sh_submit: n_stop = %d: must be 0 to %d, with stop set",
                             (int)r->n_stop, MAX_STOP);
    for (int32_t i = 0; i < r->n_stop; i++) {
        if (!r->stop[i] || !r->stop[i][0])
            return sh__error_set(e, SH_EINVAL, "sh_submit: stop[%d] is %s", (int)i,
                                 r->stop[i] ? "empty" : "NULL");
        if (strlen(r->stop[i]) > 1024 || !utf8_str(r->stop[i]))
            return sh__error_set(e, SH_EINVAL,
                                 "sh_submit: stop[%d] is not valid UTF-8 of at most 1024 bytes",
                                 (int)i);
    }
    if (r->priority < 0 || r->priority > 255)
        return sh__error_set(e, SH_EINVAL, "sh_submit: priority = %d: must be 0 to 255",
                             (int)r->priority);
    if (r->top_logprobs < 0 || r->top_logprobs > 20)
        return sh__error_set(e, SH_EINVAL, "sh_submit: top_logprobs = %d: must be 0 to 20",
                             (int)r->top_logprobs);
    if (r->spec_n_max < 0 || r->spec_n_max > SH_PROTO_MAX_DRAFT)
        return sh__error_set(e, SH_EINVAL, "sh_submit: spec_n_max = %d: must be 0 to %d",
                             (int)r->spec_n_max, SH_PROTO_MAX_DRAFT);
    if (r->prompt && !utf8_str(r->prompt))
        return sh__error_set(e, SH_EINVAL, "sh_submit: the prompt is not valid UTF-8");
    return SH_OK;
}

/* The prompt's token ids (malloc'd into *ids), at most n_ctx - 1 of them. A chat with tools
 * (api/engine_tools.c) may set *gram (when NULL: the grammar forcing a call) and *tools. */
static sh_err prompt_ids(sh_engine *eng, const sh_request_opts *r, int32_t **ids, size_t *n,
                         char **gram, sh_api_tools **tools, sh_error *e)
{
    size_t max_ids = eng->n_ctx > 1 ? (size_t)eng->n_ctx - 1 : 1;
    sh_err rc;
    if (r->prompt_tokens) {
        for (int32_t i = 0; i < r->n_prompt_tokens; i++)
            if (r->prompt_tokens[i] < 0 || r->prompt_tokens[i] >= eng->m->hp.n_vocab)
                return sh__error_set(e, SH_EINVAL,
                                     "sh_submit: prompt_tokens[%d] = %d is outside the "
                                     "vocabulary of %d",
                                     (int)i, (int)r->prompt_tokens[i], (int)eng->m->hp.n_vocab);
        if ((size_t)r->n_prompt_tokens > max_ids)
            return sh__error_set(e, SH_EINVAL,
                                 "sh_submit: the prompt has %d tokens; the context holds %d "
                                 "(prompt and at least one generated token)",
                                 (int)r->n_prompt_tokens, (int)eng->n_ctx);
        if (!(*ids = malloc((size_t)r->n_prompt_tokens * sizeof **ids)))
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        memcpy(*ids, r->prompt_tokens, (size_t)r->n_prompt_tokens * sizeof **ids);
        *n = (size_t)r->n_prompt_tokens;
        return SH_OK;
    }
    if (sh__engine_tools_wanted(r)) {
        rc = sh__engine_tools_prompt(eng, r, max_ids, ids, n, gram, tools, e);
    } else if (r->prompt) {
        sh_tokenize_opts o = {.max_ids = max_ids};
        if (sh_tokenizer_wants_bos(eng->tok) && sh_tokenizer_bos(eng->tok) >= 0)
            o.flags |= SH_TOKENIZE_ADD_BOS;
        rc = sh_tokenizer_encode_opts(eng->tok, r->prompt, strlen(r->prompt), &o, ids, n, e);
    } else {
        if (!eng->has_template)
            return sh__error_set(e, SH_EINVAL,
                                 "sh_submit: %s has no chat template: give a prompt, not "
                                 "messages",
                                 eng->name);
        sh_chat_msg *msgs = calloc((size_t)r->n_messages, sizeof *msgs);
        if (!msgs)
            return sh__error_set(e, SH_ENOMEM, "out of memory");
        rc = sh__engine_chat_msgs(r->messages, r->n_messages, msgs, "sh_submit", e);
        if (!rc)
            rc = sh_chat_tokenize(eng->tok, eng->chat, msgs, (size_t)r->n_messages,
                                  eng->has_system ? eng->system : NULL, true, max_ids, ids, n, e);
        free(msgs);
    }
    if (rc == SH_ERANGE && *n > max_ids)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: the prompt has more than %zu tokens; the context holds "
                             "%d (prompt and at least one generated token)",
                             max_ids, (int)eng->n_ctx);
    if (rc)
        return rc;
    if (*n == 0) {
        free(*ids);
        *ids = NULL;
        sh__engine_tools_free(*tools);
        *tools = NULL;
        return sh__error_set(e, SH_EINVAL, "sh_submit: the prompt is empty");
    }
    return SH_OK;
}

/* The request's grammar text (malloc'd into *out, NULL for none): `grammar` as it is, or the
 * grammar of `response_format` (JSON text, net/json_schema.h); parsed here, so that a bad one
 * fails sh_submit with its line and column before anything is queued. */
static sh_err request_grammar(const sh_request_opts *r, char **out, sh_error *e)
{
    *out = NULL;
    if (r->grammar && r->response_format)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: grammar and response_format cannot be given together");
    if (r->grammar) {
        if (!(*out = strdup(r->grammar)))
            return sh__error_set(e, SH_ENOMEM, "out of memory");
    } else if (r->response_format) {
        json_error_t je;
        json_t *rf = json_loads(r->response_format, JSON_REJECT_DUPLICATES, &je);
        if (!rf)
            return sh__error_set(e, SH_EINVAL,
                                 "sh_submit: response_format is not JSON (line %d, column %d: %s)",
                                 je.line, je.column, je.text);
        char param[64] = "";
        sh_error ce = {0};
        sh_err rc = sh_json_schema_response_format(rf, out, param, &ce);
        json_decref(rf);
        if (rc)
            return sh__error_set(e, rc, "sh_submit: %s: %s", param[0] ? param : "response_format",
                                 ce.msg);
        if (!*out)
            return SH_OK; /* {"type": "text"}: no constraint */
    } else {
        return SH_OK;
    }
    size_t len = strlen(*out);
    sh_grammar *g = NULL;
    sh_error ge = {0};
    sh_err rc = len > SH_PROTO_MAX_GRAMMAR ? sh__error_set(&ge, SH_EINVAL, "%zu bytes, at most %d",
                                                           len, SH_PROTO_MAX_GRAMMAR)
                                           : sh_grammar_parse(*out, len, &g, &ge);
    sh_grammar_free(g);
    if (rc) {
        free(*out);
        *out = NULL;
        return sh__error_set(e, rc == SH_ENOMEM ? rc : SH_EINVAL, "sh_submit: %s: %s",
                             r->grammar ? "grammar" : "response_format's grammar", ge.msg);
    }
    return SH_OK;
}

/* A request older than this header's fields reads as the defaults for what it lacks. */
static sh_err copy_request(const sh_request_opts *in, sh_request_opts *r, sh_error *e)
{
    *r = sh_request_opts_default();
    if (in->struct_size == 0)
        return sh__error_set(e, SH_EINVAL,
                             "sh_submit: req->struct_size is 0: initialise the request with "
                             "sh_request_opts_default()");
    memcpy(r, in, in->struct_size < sizeof *r ? in->struct_size : sizeof *r);
    r->struct_size = sizeof *r;
    return SH_OK;
}

sh_err sh_submit(sh_engine *eng, const sh_request_opts *req, const sh_callbacks *cb, void *user,
                 uint64_t *id, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (id)
        *id = 0;
    if (eng && !sh__engine_live(eng))
        return sh__error_set(e, SH_EINVAL, "sh_submit: eng is not an open engine (closed)");
    if (!eng || !req || !cb || !id)
        return sh__error_set(e, SH_EINVAL, "sh_submit: %s is NULL",
                             !eng   ? "eng"
                             : !req ? "req"
                             : !cb  ? "cb"
                                    : "id");
    sh_request_opts r;
    sh_err rc = copy_request(req, &r, e);
    if (!rc)
        rc = check_request(&r, e);
    if (!rc && r.embed && !eng->pooling)
        rc = sh__error_set(e, SH_EUNSUPPORTED,
                           "sh_submit: this engine's model has no pooling for embeddings");
    int32_t *ids = NULL;
    size_t n_ids = 0;
    char *gram = NULL;
    if (!rc && !r.embed)
        rc = request_grammar(&r, &gram, e);
    sh_api_tools *tools = NULL;
    if (!rc)
        rc = prompt_ids(eng, &r, &ids, &n_ids, &gram, &tools, e);
    if (rc) {
        free(gram);
        return rc;
    }
    sh_api_req *q = calloc(1, sizeof *q);
    if (!q) {
        free(ids);
        free(gram);
        sh__engine_tools_free(tools);
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    }
    q->tools = tools;
    q->cb = *cb;
    q->user = user;
    q->logprobs = r.logprobs;
    q->n_prompt = (int32_t)n_ids;
    // Generation never runs past the context window.
    int32_t max_tokens = r.max_tokens ? r.max_tokens : 256;
    if ((int64_t)n_ids + max_tokens > eng->n_ctx)
        max_tokens = eng->n_ctx - (int32_t)n_ids;
    sh_strv stops[MAX_STOP];
    for (int32_t i = 0; i < r.n_stop; i++)
        stops[i] = (sh_strv){r.stop[i], (uint32_t)strlen(r.stop[i])};
    sh_proto_submit sub = {
        .prompt = {ids, (uint32_t)n_ids},
        .sampling = {.temperature = r.temperature,
                     .top_k = r.top_k,
                     .top_p = r.top_p > 0 ? r.top_p : 1.0f,
                     .min_p = r.min_p,
                     .repeat_penalty = r.repeat_penalty > 0 ? r.repeat_penalty : 1.0f,
                     .frequency_penalty = r.frequency_penalty,
                     .presence_penalty = r.presence_penalty,
                     .penalty_last_n = r.repeat_last_n < 0 || r.repeat_last_n > eng->n_ctx
                                           ? eng->n_ctx
                                       : r.repeat_last_n > 0 ? r.repeat_last_n
                                                             : PENALTY_WINDOW,
                     .typical_p = r.typical_p > 0 && r.typical_p < 1 ? r.typical_p : 0.0f,
                     .seed = r.seed,
                     .max_tokens = (uint32_t)max_tokens,
                     .n_logprobs = r.logprobs ? r.top_logprobs : 0,
                     .logprobs_mode = SH_LOGPROBS_RAW,
                     .stop = {stops, (uint32_t)r.n_stop},
                     // A sequence with a grammar takes no drafts (as the gateway's).
                     .no_spec = r.no_spec || gram,
                     .spec_max = (uint8_t)r.spec_n_max,
                     .grammar = {gram, gram ? (uint32_t)strlen(gram) : 0},
                     .gram_lp = gram && r.logprobs},
        .priority = (uint8_t)r.priority,
        .deadline_ms = r.timeout_ms ? sh__act_unix_ms() + r.timeout_ms : 0,
        .reply_to = eng->self,
        .min_tokens = r.ignore_eos ? (uint32_t)max_tokens : (uint32_t)r.min_tokens,
        .min_mask = r.ignore_eos ? 0 : (uint32_t)r.min_tokens,
    };
    if (r.embed) { /* a prefill with no decode (actors/batcher_embed.c) */
        sub.sampling = (sh_proto_sampling){
            .top_p = 1.0f, .repeat_penalty = 1.0f, .max_tokens = 1, .no_spec = true};
        sub.min_tokens = 0;
        sub.embed = eng->pooling;
    }
    // The send happens under the lock: close cannot take the runtime away meanwhile, and a
    // CANCEL of this id (after it is in the table) always follows its SUBMIT.
    pthread_mutex_lock(&eng->mu);
    if (eng->closing)
        rc = sh__error_set(e, SH_ECLOSED, "sh_submit: the engine is closing");
    else if (eng->failed[0])
        rc = sh__error_set(e, SH_EIO, "sh_submit: the cluster cannot serve: %s", eng->failed);
    else if (eng->pending >= eng->limit)
        rc = sh__error_set(e, SH_EBUSY,
                           "sh_submit: %d requests are pending: max_seqs running and max_queue "
                           "waiting (%d in all)",
                           (int)eng->pending, (int)eng->limit);
    if (!rc) {
        q->id = ++eng->next_id;
        sub.req = q->id;
        sh_api_req **pp = slot(eng, q->id);
        *pp = q;
        eng->pending++;
        rc = sh__act_send(eng->rt, eng->self, eng->batcher, SH_MSG_SUBMIT, q->id, &sub, e);
        if (rc) {
            unlink_req(eng, q->id);
        } else {
            eng->requests_total++;
            eng->prompt_tokens_total += n_ids;
            *id = q->id;
        }
    }
    pthread_mutex_unlock(&eng->mu);
    free(ids);
    free(gram); /* SUBMIT's copy is the batcher's */
    if (rc)
        req_free(q);
    return rc;
}

sh_err sh_cancel(sh_engine *eng, uint64_t id, sh_error *err)
{
    sh_error local = {0}, *e = err ? err : &local;
    *e = (sh_error){0};
    if (!sh__engine_live(eng))
        return sh__error_set(e, SH_EINVAL, "sh_cancel: eng is not an open engine (NULL or closed)");
    sh_err rc = SH_OK;
    pthread_mutex_lock(&eng->mu);
    sh_api_req *q = *slot(eng, id);
    if (!q) {
        rc = sh__error_set(e, SH_ENOTFOUND,
                           "sh_cancel: no request %" PRIu64 " (never submitted, "
                           "or over)",
                           id);
    } else if (q->cancelling) {
        rc = sh__error_set(e, SH_ECANCELED,
                           "sh_cancel: request %" PRIu64 " is already being "
                           "cancelled",
                           id);
    } else if (eng->closing) {
        q->cancelling = true; /* it ends with on_error(SH_ECLOSED) anyway */
    } else {
        // The batcher ends a cancelled request silently (no more TOKEN, no DONE): the request
        // ends with the event queued here, after every event queued before it. A DONE or FAIL
        // queued earlier ends it first ("as it would have"), and this event is then dropped.
        sh_api_ev *ev = ev_new(SH_MSG_CANCEL, id, 0, false, 0, NULL, 0);
        sh_proto_cancel c = {.req = id, .reason = {"cancelled", 9}};
        if (!ev)
            rc = sh__error_set(e, SH_ENOMEM, "out of memory");
        else if (!(rc = sh__act_send(eng->rt, eng->self, eng->batcher, SH_MSG_CANCEL, id, &c, e)))
            q->cancelling = true;
        if (rc) {
            free(ev); /* a cancel's end: no embedding */
        } else {
            ev->finish = SH_FINISH_CANCEL;
            ev_queue(eng, ev);
        }
    }
    pthread_mutex_unlock(&eng->mu);
    return rc;
}

int32_t sh_pending(sh_engine *eng)
{
    if (!sh__engine_live(eng))
        return 0;
    pthread_mutex_lock(&eng->mu);
    int32_t n = eng->pending;
    pthread_mutex_unlock(&eng->mu);
    return n;
}

int sh_fd(sh_engine *eng) { return sh__engine_live(eng) ? eng->efd : -1; }

/* ---- the "api" actor: messages from the batcher become events ----------------------------- */

typedef struct api_actor {
    sh_engine *eng;
    sh_act_decoder dec;
} api_actor;

static sh_err api_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    (void)ctx;
    api_actor *a = state;
    a->eng = arg;
    sh_err rc = sh__act_decoder_init(&a->dec, 1 << 16);
    if (!rc)
        atomic_store(&a->eng->started, 1);
    return rc;
}

static void api_stop(sh_actor_ctx *ctx, void *state)
{
    (void)ctx;
    sh__act_decoder_fini(&((api_actor *)state)->dec);
}

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* One event with room for n ids (and their logprobs and top alternatives) and text_len bytes. */
static sh_api_ev *ev_new(uint32_t type, uint64_t id, int32_t n, bool lp, int32_t top_n,
                         const char *text, size_t text_len)
{
    size_t ids_b = align8((size_t)n * 4), lp_b = lp ? align8((size_t)n * 4) : 0;
    size_t top_b = align8((size_t)n * (size_t)top_n * 4);
    sh_api_ev *ev = malloc(sizeof *ev + ids_b + lp_b + 2 * top_b + text_len + 1);
    if (!ev)
        return NULL;
    memset(ev, 0, sizeof *ev);
    char *p = (char *)(ev + 1);
    ev->type = type;
    ev->id = id;
    ev->n_ids = n;
    ev->top_n = top_n;
    ev->ids = (int32_t *)(void *)p;
    p += ids_b;
    if (lp) {
        ev->lp = (float *)(void *)p;
        p += lp_b;
    }
    ev->top_ids = (int32_t *)(void *)p;
    p += top_b;
    ev->top_lp = (float *)(void *)p;
    p += top_b;
    ev->text = p;
    ev->text_len = text_len;
    if (text_len)
        memcpy(p, text, text_len);
    p[text_len] = '\0';
    return ev;
}

/* Appends ev to the queue and makes sh_fd readable. Under mu: drain() reads the eventfd and
 * takes the queue under it too, so the descriptor is readable exactly while events are queued. */
static void ev_queue(sh_engine *eng, sh_api_ev *ev)
{
    if (eng->tail)
        eng->tail->next = ev;
    else
        eng->head = ev;
    eng->tail = ev;
    ev_signal(eng);
}

/* Makes sh_fd readable. */
static void ev_signal(sh_engine *eng)
{
    uint64_t one = 1;
    ssize_t w;
    do
        w = write(eng->efd, &one, sizeof one);
    while (w < 0 && errno == EINTR);
}

/* Queues ev and wakes sh_fd's watchers. */
static void ev_push(sh_engine *eng, sh_api_ev *ev, int32_t n_tokens)
{
    pthread_mutex_lock(&eng->mu);
    ev_queue(eng, ev);
    eng->tokens_total += (uint64_t)n_tokens;
    pthread_mutex_unlock(&eng->mu);
}

static sh_api_ev *ev_from_token(const sh_proto_token *t)
{
    int32_t n = (int32_t)t->tokens.n;
    int32_t top_n = t->top_n;
    if ((uint64_t)t->top_tokens.n != (uint64_t)n * (uint64_t)top_n ||
        t->top_logprobs.n != t->top_tokens.n)
        top_n = 0;
    bool lp = t->logprobs.n == (uint32_t)n;
    sh_api_ev *ev = ev_new(SH_MSG_TOKEN, t->req, n, lp, top_n, t->text.ptr, t->text.len);
    if (!ev)
        return NULL;
    ev->index = (int32_t)t->index;
    for (int32_t i = 0; i < n; i++) {
        ev->ids[i] = sh_i32s_at(t->tokens, (uint32_t)i);
        if (lp)
            ev->lp[i] = sh_f32s_at(t->logprobs, (uint32_t)i);
    }
    for (int32_t i = 0; i < n * top_n; i++) {
        ev->top_ids[i] = sh_i32s_at(t->top_tokens, (uint32_t)i);
        ev->top_lp[i] = sh_f32s_at(t->top_logprobs, (uint32_t)i);
    }
    return ev;
}

static sh_msg_fate api_handle(sh_actor_ctx *ctx, void *state, sh_msg *msg)
{
    api_actor *a = state;
    sh_engine *eng = a->eng;
    const sh_msg_hdr *h = sh_msg_header(msg);
    sh_proto_body pb;
    sh_error e = {0};
    if (h->type != SH_MSG_TOKEN && h->type != SH_MSG_DONE && h->type != SH_MSG_FAIL)
        return SH_MSG_FATE_DONE; /* ERROR answers to our one-way sends: nothing waits on them */
    if (sh__act_decode(&a->dec, msg, &pb, &e)) {
        sh_actor_log(ctx, SH_LOG_LEVEL_WARN, "bad_message", "type=%u err=\"%s\"", (unsigned)h->type,
                     e.msg);
        return SH_MSG_FATE_DONE;
    }
    sh_api_ev *ev = NULL;
    int32_t n_tokens = 0;
    if (h->type == SH_MSG_TOKEN) {
        // The batcher always sends log-probabilities; sh_poll passes them on only when the
        // request asked for them (it holds the request).
        ev = ev_from_token(&pb.token);
        n_tokens = (int32_t)pb.token.tokens.n;
    } else if (h->type == SH_MSG_DONE) {
        ev = ev_new(SH_MSG_DONE, pb.done.req, 0, false, 0, pb.done.text.ptr, pb.done.text.len);
        if (ev) {
            ev->finish = (sh_finish)pb.done.finish;
            ev->n_prompt = (int32_t)pb.done.n_prompt;
            ev->n_gen = (int32_t)pb.done.n_generated;
            ev->n_cached = (int32_t)pb.done.n_cached;
            if (pb.done.embedding.n && (ev->emb = malloc(pb.done.embedding.n * sizeof(float)))) {
                memcpy(ev->emb, pb.done.embedding.ptr, pb.done.embedding.n * sizeof(float));
                ev->n_emb = (int32_t)pb.done.embedding.n;
            }
        }
    } else {
        ev =
            ev_new(SH_MSG_FAIL, pb.fail.req, 0, false, 0, pb.fail.message.ptr, pb.fail.message.len);
        if (ev)
            ev->code = (sh_err)pb.fail.code;
    }
    if (!ev) {
        sh_actor_log(ctx, SH_LOG_LEVEL_ERROR, "event_lost", "type=%u err=\"out of memory\"",
                     (unsigned)h->type);
        return SH_MSG_FATE_DONE;
    }
    ev_push(eng, ev, n_tokens);
    return SH_MSG_FATE_DONE;
}

const sh_actor_vtable sh__engine_api_vtable = {.name = "api",
                                               .state_size = sizeof(api_actor),
                                               .init = api_init,
                                               .handle = api_handle,
                                               .stop = api_stop};

/* ---- sh_poll ------------------------------------------------------------------------------- */

/* Runs one event's callbacks; returns how many ran. */
static uint32_t dispatch(sh_engine *eng, sh_api_ev *ev)
{
    bool final = ev->type != SH_MSG_TOKEN;
    pthread_mutex_lock(&eng->mu);
    sh_api_req *q = final ? unlink_req(eng, ev->id) : *slot(eng, ev->id);
    sh_callbacks cb = q ? q->cb : (sh_callbacks){0};
    bool want_lp = q && q->logprobs;
    void *user = q ? q->user : NULL;
    if (q && ev->type == SH_MSG_TOKEN)
        q->n_gen += ev->n_ids;
    if (q && ev->type == SH_MSG_CANCEL) {
        ev->n_prompt = q->n_prompt;
        ev->n_gen = q->n_gen;
    }
    pthread_mutex_unlock(&eng->mu);
    if (!q)
        return 0; /* over already: a cancel's end after its DONE, or the reverse */
    uint32_t ran = 0;
    const char *text = ev->text;
    size_t text_len = ev->text_len;
    if (q->tools && (ev->type == SH_MSG_TOKEN || ev->type == SH_MSG_DONE)) {
        // Tool calls are taken out of the text (held until they are whole); the rest passes.
        const char *content = NULL;
        if (sh__engine_tools_feed(q->tools, text, text_len, ev->type == SH_MSG_DONE, &content)) {
            if (cb.on_error)
                cb.on_error(user, ev->id, SH_ENOMEM, "out of memory taking tool calls out");
            if (!final) { /* it is over for the host: cancel it and drop what follows */
                pthread_mutex_lock(&eng->mu);
                unlink_req(eng, ev->id);
                pthread_mutex_unlock(&eng->mu);
                sh_proto_cancel c = {.req = ev->id, .reason = {"out of memory", 13}};
                sh_error ce = {0};
                (void)sh__act_send(eng->rt, eng->self, eng->batcher, SH_MSG_CANCEL, ev->id, &c,
                                   &ce);
            }
            req_free(q);
            return cb.on_error ? 1 : 0;
        }
        text = content ? content : "";
        text_len = strlen(text);
    }
    if (ev->type == SH_MSG_TOKEN || (ev->type == SH_MSG_DONE && text_len)) {
        sh_token_event te = {.text = text, .text_len = text_len, .index = ev->index};
        if (ev->type == SH_MSG_TOKEN) {
            te.ids = ev->ids;
            te.n_ids = ev->n_ids;
            te.logprobs = want_lp ? ev->lp : NULL;
            te.top_n = want_lp ? ev->top_n : 0;
            te.top_ids = te.top_n ? ev->top_ids : NULL;
            te.top_logprobs = te.top_n ? ev->top_lp : NULL;
        } else {
            te.index = ev->n_gen; /* text the decoder held back: no new ids */
        }
        if (cb.on_token) {
            cb.on_token(user, ev->id, &te);
            ran++;
        }
    }
    if ((ev->type == SH_MSG_DONE || ev->type == SH_MSG_CANCEL) && cb.on_done) {
        sh_done_info di = {.finish = ev->finish,
                           .prompt_tokens = ev->n_prompt,
                           .completion_tokens = ev->n_gen,
                           .cached_tokens = ev->n_cached,
                           .embedding = ev->emb,
                           .n_embedding = ev->n_emb,
                           .tool_calls = q->tools ? sh__engine_tools_calls(q->tools) : NULL};
        if (di.tool_calls && di.finish == SH_FINISH_STOP)
            di.finish = SH_FINISH_TOOL_CALLS;
        cb.on_done(user, ev->id, &di);
        ran++;
    } else if (ev->type == SH_MSG_FAIL && cb.on_error) {
        cb.on_error(user, ev->id, ev->code, ev->text);
        ran++;
    }
    if (final)
        req_free(q);
    return ran;
}

/* Takes every queued event and runs it; returns the callbacks run. */
static uint32_t drain(sh_engine *eng)
{
    uint64_t cnt;
    pthread_mutex_lock(&eng->mu);
    while (read(eng->efd, &cnt, sizeof cnt) < 0 && errno == EINTR)
        ;
    sh_api_ev *ev = eng->head;
    eng->head = eng->tail = NULL;
    pthread_mutex_unlock(&eng->mu);
    uint32_t ran = 0;
    while (ev) {
        sh_api_ev *next = ev->next;
        ran += dispatch(eng, ev);
        free(ev->emb);
        free(ev);
        ev = next;
    }
    return ran;
}

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

sh_err sh_poll(sh_engine *eng, int32_t timeout_ms, uint32_t *ran)
{
    if (ran)
        *ran = 0;
    if (!sh__engine_live(eng))
        return SH_EINVAL;
    int idle = 0;
    if (!atomic_compare_exchange_strong(&eng->busy, &idle, 1))
        return SH_EBUSY; /* another thread polls, or a callback of this engine calls */
    int64_t deadline = timeout_ms > 0 ? mono_ms() + timeout_ms : 0;
    uint32_t n = 0;
    for (;;) {
        n += drain(eng);
        if (n > 0 || timeout_ms == 0)
            break;
        int wait = -1;
        if (timeout_ms > 0) {
            int64_t left = deadline - mono_ms();
            if (left <= 0)
                break;
            wait = left > INT32_MAX ? INT32_MAX : (int)left;
        }
        struct pollfd p = {.fd = eng->efd, .events = POLLIN};
        int rc = poll(&p, 1, wait);
        if (rc < 0 && errno != EINTR)
            break;
    }
    atomic_store(&eng->busy, 0);
    if (ran)
        *ran = n;
    return SH_OK;
}

/* ---- a cluster front's fail-stop ---------------------------------------------------------- */

void sh__engine_front_failed(sh_engine *eng, const char *what)
{
    char msg[768];
    int n = snprintf(msg, sizeof msg,
                     "%s: the cluster cannot continue (a stage node was lost and not replaced); "
                     "restart it",
                     what);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1;
    pthread_mutex_lock(&eng->mu);
    snprintf(eng->failed, sizeof eng->failed, "%s", what[0] ? what : "a worker node was lost");
    // A FAIL per request, after the events queued before it; a DONE or FAIL the batcher queued
    // earlier ends the request first and this one is then dropped (dispatch).
    for (int i = 0; i < SH_API_BUCKETS; i++)
        for (sh_api_req *q = eng->table[i]; q; q = q->next) {
            sh_api_ev *ev = ev_new(SH_MSG_FAIL, q->id, 0, false, 0, msg, len);
            if (!ev)
                continue; /* out of memory: it ends at close (SH_ECLOSED) */
            ev->code = SH_EIO;
            ev_queue(eng, ev);
        }
    pthread_mutex_unlock(&eng->mu);
}

/* ---- close ---------------------------------------------------------------------------------- */

void sh__engine_events_free(sh_engine *eng)
{
    pthread_mutex_lock(&eng->mu);
    sh_api_ev *ev = eng->head;
    eng->head = eng->tail = NULL;
    pthread_mutex_unlock(&eng->mu);
    while (ev) {
        sh_api_ev *next = ev->next;
        free(ev->emb);
        free(ev);
        ev = next;
    }
}

void sh__engine_fail_all(sh_engine *eng)
{
    for (;;) {
        sh_api_req *q = NULL;
        pthread_mutex_lock(&eng->mu);
        for (int i = 0; i < SH_API_BUCKETS && !q; i++)
            if (eng->table[i])
                q = unlink_req(eng, eng->table[i]->id);
        pthread_mutex_unlock(&eng->mu);
        if (!q)
            return;
        if (q->cb.on_error)
            q->cb.on_error(q->user, q->id, SH_ECLOSED, "the engine was closed");
        req_free(q);
    }
}
