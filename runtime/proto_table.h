/* The message table: every message type and body field of the wire protocol, described once. */
#ifndef SH_RUNTIME_PROTO_TABLE_H
#define SH_RUNTIME_PROTO_TABLE_H

/* This file is the protocol's single description. runtime/msg.h turns SH_PROTO_MESSAGES into the
 * sh_msg_type enum; runtime/proto.h turns each SH_PROTO_FIELDS_<name> into a C struct
 * sh_proto_<name> (and sh_proto_<name>_list); runtime/proto.c turns the same lists into the field
 * descriptors that one generic encoder and one generic decoder walk. Adding a field is one line
 * here; nothing else needs to change.
 *
 * Rules that keep old and new nodes talking (within one SH_PROTO_VERSION):
 *   - a message id or a body key is never reused for something else;
 *   - new fields are OPT, so an older sender that omits them is still understood;
 *   - receivers skip keys they do not know, so a newer sender's extra fields are harmless.
 * Anything else (a field changing type, a new REQ field) needs a new SH_PROTO_VERSION.
 *
 * SH_PROTO_MESSAGES(X): X(NAME, wire id, body struct).
 * SH_PROTO_STRUCTS(X):  X(struct, has a cross-field check in proto.c), in dependency order.
 * SH_PROTO_FIELDS_<struct>(F, S): F(S, member, "key", KIND, SUB, REQ|OPT, lo, hi).
 *
 * Kinds, their C type (runtime/proto.h) and wire form (DESIGN.md section 3):
 *   BOOL bool, U8 uint8_t, U32 uint32_t, U64 uint64_t, ADDR sh_addr, I32 int32_t, I64 int64_t:
 *        msgpack bool / int in its shortest form; decoding accepts any integer encoding whose
 *        value fits the C type. [lo, hi] bounds the value when either is non-zero.
 *   F32 float, F64 double: written as float32 / float64; decoding accepts either.
 *   STR  sh_strv: str, a view into the frame (not NUL-terminated, not checked as UTF-8); at most
 *        hi bytes.
 *   I32S sh_i32s, F32S sh_f32s, U64S sh_u64s, F64S sh_f64s: a bin of packed little-endian
 *        elements, a view into the frame; at most hi elements. One bin instead of an array of
 *        ints keeps token ids and block tables zero-copy and 4 bytes per id (an array would cost
 *        up to 5 bytes per element and a copy to decode).
 *   STRS sh_strv_list: array of str; the sh_strv entries go to the decode arena, the bytes stay
 *        in the frame; at most hi entries of at most SH_PROTO_MAX_STR_ITEM bytes.
 *   TENSOR sh_proto_tensor: map {"dt": dtype, "sh": [dims], "d": bin}; "d" absent means the data
 *        travels out of band (kept for a device path such as NCCL, which does not exist yet;
 *        today every tensor travels in "d"). The bin's length must equal the shape's element
 *        count times the dtype's size; it is never copied.
 *   STRUCT sh_proto_<SUB>: a nested map.
 *   LIST sh_proto_<SUB>_list: array of maps, decoded into the arena; at most hi entries.
 * REQ fields must be present; OPT fields absent decode as zero / empty. The encoder writes every
 * field in table order, so decoding a frame and encoding it again gives the same bytes. */

#include <stdint.h>

/* Bounds shared by several fields. They are generous sanity limits against absurd counts; the
 * actors apply their own, tighter, configured limits. */
#define SH_PROTO_MAX_TOKENS (1 << 20) /* token ids in one array */
#define SH_PROTO_MAX_SEQS 4096        /* sequences in one STEP, ACT or STEP_DONE */
#define SH_PROTO_MAX_BLOCKS (1 << 20) /* KV block ids or prefix hashes in one array */
#define SH_PROTO_MAX_TEXT (1 << 20)   /* bytes of generated text in one TOKEN or DONE */
#define SH_PROTO_MAX_MSG 4096         /* bytes of an error message or an argument */
#define SH_PROTO_MAX_NAME 256         /* bytes of a metric name */
#define SH_PROTO_MAX_STOP 16          /* stop strings per request */
#define SH_PROTO_MAX_STR_ITEM 1024    /* bytes of one STRS entry (a stop string) */
#define SH_PROTO_MAX_BAN 64           /* ids banned in one step_seq (end-of-sequence tokens) */
#define SH_PROTO_MAX_BIAS 300         /* logit-bias entries (OpenAI's limit, as the sampler) */
#define SH_PROTO_MAX_LOGPROBS 20      /* top logprobs per token (OpenAI's limit) */
#define SH_PROTO_MAX_DRAFT 16         /* drafted tokens of one sequence in a step (SH_SPEC_MAX_K) */
#define SH_PROTO_MAX_POS (1 << 30)    /* token positions */
#define SH_PROTO_MAX_GRAMMAR (1 << 18) /* bytes of a request's GBNF grammar text */

#define SH_PROTO_MESSAGES(X)                                                                       \
    X(SUBMIT, 1, submit)        /* gateway/router -> batcher: a new (or resumed) request */        \
    X(CANCEL, 2, cancel)        /* gateway/router -> batcher: stop a request */                    \
    X(TOKEN, 3, token)          /* batcher -> gateway: newly generated tokens */                   \
    X(DONE, 4, done)            /* batcher -> gateway: the request finished */                     \
    X(FAIL, 5, fail)            /* batcher -> gateway: the request failed */                       \
    X(STEP, 6, step)            /* batcher -> first stage: one batched forward step */             \
    X(ACT, 7, act)              /* stage i -> stage i+1: hidden states of a step */                \
    X(STEP_DONE, 8, step_done)  /* last stage -> batcher: sampled tokens of a step */              \
    X(KV_ALLOC, 9, kv_alloc)    /* batcher <-> kvmgr: blocks for a sequence's tokens */            \
    X(KV_FREE, 10, kv_free)     /* batcher -> kvmgr: release a sequence's blocks */                \
    X(KV_FORK, 11, kv_fork)     /* batcher <-> kvmgr: share a prefix with a new sequence */        \
    X(KV_PREFIX, 12, kv_prefix) /* batcher <-> kvmgr: look up cached prefix blocks */              \
    X(PING, 13, ping)           /* watchdog -> anyone: heartbeat */                                \
    X(PONG, 14, pong)           /* anyone -> watchdog: heartbeat answer with health figures */     \
    X(METRICS, 15, metrics)     /* anyone -> watchdog: counters, gauges, histograms */             \
    X(CONTROL, 16, control)     /* watchdog -> actors: pause, resume, reroute, degrade, stop */    \
    X(FAULT, 17, fault)         /* chaos driver -> runtime: fault-injection rules */               \
    X(ERROR, 18, error)         /* runtime -> requester: the request could not be delivered */     \
    X(HELLO, 19, hello)         /* front <-> worker node: identity check before serving */

/* Sub-structures first: a struct may only use those listed before it. */
#define SH_PROTO_STRUCTS(X)                                                                        \
    X(logit_bias, 0)                                                                               \
    X(sampling, 0)                                                                                 \
    X(step_seq, 0)                                                                                 \
    X(step_out, 1)                                                                                 \
    X(metric, 0)                                                                                   \
    X(histogram, 1)                                                                                \
    X(fault_rule, 0)                                                                               \
    X(submit, 0)                                                                                   \
    X(cancel, 0)                                                                                   \
    X(token, 1)                                                                                    \
    X(done, 0)                                                                                     \
    X(fail, 0)                                                                                     \
    X(step, 0)                                                                                     \
    X(act, 1)                                                                                      \
    X(step_done, 0)                                                                                \
    X(kv_alloc, 0)                                                                                 \
    X(kv_free, 0)                                                                                  \
    X(kv_fork, 0)                                                                                  \
    X(kv_prefix, 0)                                                                                \
    X(ping, 0)                                                                                     \
    X(pong, 0)                                                                                     \
    X(metrics, 0)                                                                                  \
    X(control, 0)                                                                                  \
    X(fault, 0)                                                                                    \
    X(error, 0)                                                                                    \
    X(hello, 0)

/* One logit-bias entry: bias is added to the token's logit; -inf bans it. */
#define SH_PROTO_FIELDS_logit_bias(F, S)                                                           \
    F(S, id, "i", I32, _, REQ, 0, INT32_MAX)                                                       \
    F(S, bias, "b", F32, _, REQ, 0, 0)

/* Sampling parameters (model/sampler.h gives each one's meaning and neutral value). */
#define SH_PROTO_FIELDS_sampling(F, S)                                                             \
    F(S, temperature, "temp", F32, _, REQ, 0, 0)                                                   \
    F(S, top_k, "top_k", I32, _, REQ, 0, 0)                                                        \
    F(S, top_p, "top_p", F32, _, REQ, 0, 0)                                                        \
    F(S, min_p, "min_p", F32, _, REQ, 0, 0)                                                        \
    F(S, repeat_penalty, "rep", F32, _, REQ, 0, 0)                                                 \
    F(S, frequency_penalty, "freq", F32, _, REQ, 0, 0)                                             \
    F(S, presence_penalty, "pres", F32, _, REQ, 0, 0)                                              \
    F(S, penalty_last_n, "pen_n", I32, _, REQ, 0, SH_PROTO_MAX_TOKENS)                             \
    F(S, seed, "seed", U64, _, REQ, 0, 0)                                                          \
    F(S, max_tokens, "max", U32, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                   \
    F(S, n_logprobs, "lp", I32, _, REQ, 0, SH_PROTO_MAX_LOGPROBS)                                  \
    F(S, logprobs_mode, "lp_mode", U8, _, OPT, 0, 1) /* sh_logprobs_mode */                        \
    F(S, stop, "stop", STRS, _, OPT, 0, SH_PROTO_MAX_STOP)                                         \
    F(S, bias, "bias", LIST, logit_bias, OPT, 0, SH_PROTO_MAX_BIAS)                                \
    F(S, no_spec, "nspec", BOOL, _, OPT, 0, 0) /* never draft for this request (opt-out) */        \
    F(S, spec_max, "nsmax", U8, _, OPT, 0, SH_PROTO_MAX_DRAFT) /* drafts a step at most; 0: any */ \
    F(S, typical_p, "typ", F32, _, OPT, 0, 0) /* typical sampling; 0 (absent), >= 1: off */        \
    F(S, grammar, "gram", STR, _, OPT, 0, SH_PROTO_MAX_GRAMMAR) /* GBNF the output must follow */  \
    F(S, gram_lp, "gram_lp", BOOL, _, OPT, 0, 0) /* logprobs asked: mask before every sample */

/* One sequence of a STEP (and of the ACT messages that continue it). Its tokens sit at positions
 * pos .. pos + tokens.n - 1: a prefill chunk or a decode step is always contiguous, so a start
 * position replaces a positions array. want_draft and prior are for a drafter in front of the
 * first stage (actors/drafter.c): it appends up to want_draft greedy drafts to tokens (their
 * positions reserved by the batcher), sets draft to how many, and clears both; prior, sent with a
 * sequence's first step when that starts past position 0, holds its tokens [0, pos).
 * A sequence with a grammar carries its text (sampling.grammar) and its generated tokens (gen)
 * only on its first sampling step after each admission; its later steps carry the text's hash
 * (gram_hash, sh__sgram_text_hash) instead, and always the count of generated tokens (n_gen),
 * which is where the last stage's matcher must stand. A stage that does not hold the matcher
 * answers the sequence with status SH_ENOTFOUND, and the batcher sends the text again. */
#define SH_PROTO_FIELDS_step_seq(F, S)                                                             \
    F(S, seq, "id", U64, _, REQ, 0, 0)                                                             \
    F(S, tokens, "tok", I32S, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                      \
    F(S, pos, "pos", U32, _, REQ, 0, SH_PROTO_MAX_POS)                                             \
    F(S, blocks, "blk", I32S, _, REQ, 0, SH_PROTO_MAX_BLOCKS) /* block table */                    \
    F(S, sample, "smp", BOOL, _, REQ, 0, 0) /* false: a prefill chunk that is not the last */      \
    F(S, sampling, "samp", STRUCT, sampling, REQ, 0, 0)                                            \
    F(S, history, "hist", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* recent tokens, penalties */     \
    F(S, draft, "drf", U32, _, OPT, 0, SH_PROTO_MAX_DRAFT) /* the last `draft` tokens are drafted  \
                                                            */                                     \
    F(S, want_draft, "wdr", U32, _, OPT, 0, SH_PROTO_MAX_DRAFT) /* drafts a drafter may append */  \
    F(S, prior, "pri", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* tokens [0, pos), for a drafter */  \
    F(S, ban, "ban", I32S, _, OPT, 0, SH_PROTO_MAX_BAN) /* ids masked (EOS before min_tokens) */   \
    F(S, embed, "emb", U8, _, OPT, 0, 3) /* embedding pooling (SUBMIT's embed); never samples */   \
    F(S, gen, "gen", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* with a grammar: tokens generated */  \
    F(S, gram_hash, "gram_h", U64, _, OPT, 0, 0) /* grammar sent as its hash (see below) */        \
    F(S, n_gen, "ngen", U32, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* with a grammar: generated count */

/* One sequence's result in STEP_DONE; top_tokens and top_logprobs have equal lengths. A
 * speculative step (its sequence had `draft` drafted tokens) answers the first verified token in
 * token/logprob/logprob_raw and the rest, in order, in more/more_lp/more_lp_raw (equal lengths,
 * at most draft): every token but the last of token, more... is an accepted draft, the last is the
 * target's own (the token replacing the first rejected draft, or the one after the last draft).
 * drafted is the sequence's step_seq.draft as the last stage saw it: how many drafts a drafter
 * actually appended, which the batcher does not otherwise learn (a stage older than the field
 * omits it, and it decodes as 0). A non-zero status fails this sequence alone (its grammar's
 * matcher passed its bounds, every token was banned, ...) with message saying why; the step's
 * other sequences are answered as usual. */
#define SH_PROTO_FIELDS_step_out(F, S)                                                             \
    F(S, seq, "id", U64, _, REQ, 0, 0)                                                             \
    F(S, token, "tok", I32, _, REQ, -1, INT32_MAX) /* -1: not sampled (prefill chunk) */           \
    F(S, logprob, "lp", F32, _, REQ, 0, 0)                                                         \
    F(S, logprob_raw, "lp_raw", F32, _, REQ, 0, 0)                                                 \
    F(S, top_tokens, "top_tok", I32S, _, OPT, 0, SH_PROTO_MAX_LOGPROBS)                            \
    F(S, top_logprobs, "top_lp", F32S, _, OPT, 0, SH_PROTO_MAX_LOGPROBS)                           \
    F(S, more, "more", I32S, _, OPT, 0, SH_PROTO_MAX_DRAFT)                                        \
    F(S, more_lp, "more_lp", F32S, _, OPT, 0, SH_PROTO_MAX_DRAFT)                                  \
    F(S, more_lp_raw, "more_lr", F32S, _, OPT, 0, SH_PROTO_MAX_DRAFT)                              \
    F(S, drafted, "drf", U32, _, OPT, 0, SH_PROTO_MAX_DRAFT)                                       \
    F(S, embd, "emb", F32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* embed: the chunk's pooled part */   \
    F(S, status, "st", I32, _, OPT, 0, 255) /* 0, or the sh_err that failed this sequence alone */ \
    F(S, message, "msg", STR, _, OPT, 0, SH_PROTO_MAX_MSG) /* with status: why */

/* A counter (kind 0) or gauge (kind 1). A node's runtime series travel with their labels in
 * the name, as Prometheus writes them (`shoal_act_bytes_total{layer="15",dtype="int8"}`), and
 * with their help text. */
#define SH_PROTO_FIELDS_metric(F, S)                                                               \
    F(S, name, "n", STR, _, REQ, 0, SH_PROTO_MAX_NAME)                                             \
    F(S, kind, "k", U8, _, REQ, 0, 1)                                                              \
    F(S, value, "v", F64, _, REQ, 0, 0)                                                            \
    F(S, help, "hp", STR, _, OPT, 0, SH_PROTO_MAX_MSG)

/* A histogram: counts has one more entry than bounds (the +Inf bucket); each count is its own
 * bucket's, not cumulative. Name and help as in a metric. */
#define SH_PROTO_FIELDS_histogram(F, S)                                                            \
    F(S, name, "n", STR, _, REQ, 0, SH_PROTO_MAX_NAME)                                             \
    F(S, bounds, "b", F64S, _, REQ, 0, 256)                                                        \
    F(S, counts, "c", U64S, _, REQ, 1, 257)                                                        \
    F(S, sum, "s", F64, _, REQ, 0, 0)                                                              \
    F(S, help, "hp", STR, _, OPT, 0, SH_PROTO_MAX_MSG)

/* One fault-injection rule (sh_proto_fault_action; sh_fault_rule in shoal/fault.h says what each
 * field does); zero src, dst or type matches any. */
#define SH_PROTO_FIELDS_fault_rule(F, S)                                                           \
    F(S, action, "a", U8, _, REQ, 0, 4)                                                            \
    F(S, src, "s", ADDR, _, REQ, 0, 0)                                                             \
    F(S, dst, "d", ADDR, _, REQ, 0, 0)                                                             \
    F(S, type, "ty", U32, _, REQ, 0, 255)                                                          \
    F(S, prob, "p", F32, _, REQ, 0, 0)                                                             \
    F(S, delay_ms, "ms", U32, _, OPT, 0, 0)                                                        \
    F(S, count, "n", U32, _, OPT, 0, 0)       /* matches before it expires; 0: no limit */         \
    F(S, bytes, "b", U32, _, OPT, 0, 16)      /* CORRUPT: bytes flipped */                         \
    F(S, lasting_s, "for", F64, _, OPT, 0, 0) /* seconds until it expires; 0: never */

/* SUBMIT. deadline_ms is Unix time in milliseconds (0: none), comparable across nodes whose
 * clocks are synchronised; generated carries the tokens produced before a failure, so the
 * batcher resumes by recomputing prompt + generated. reply_to receives TOKEN/DONE/FAIL. */
#define SH_PROTO_FIELDS_submit(F, S)                                                               \
    F(S, req, "req", U64, _, REQ, 0, 0)                                                            \
    F(S, prompt, "tok", I32S, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                      \
    F(S, generated, "gen", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS)                                   \
    F(S, sampling, "samp", STRUCT, sampling, REQ, 0, 0)                                            \
    F(S, priority, "prio", U8, _, REQ, 0, 0) /* class; lower runs first */                         \
    F(S, deadline_ms, "dl", U64, _, REQ, 0, 0)                                                     \
    F(S, reply_to, "to", ADDR, _, REQ, 0, 0)                                                       \
    F(S, n, "n", U32, _, OPT, 0, 128) /* choices sharing the prompt (0 means 1) */                 \
    F(S, min_tokens, "min", U32, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* EOS ignored before these */    \
    F(S, min_mask, "minm", U32, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* EOS masked, stops off before */ \
    F(S, embed, "emb", U8, _, OPT, 0, 3) /* an embedding: pooling 1 mean, 2 cls, 3 last; 0 none */

/* CANCEL with withdraw (a router moving a request to another replica): only a request none of
 * whose sequences was ever admitted is removed, silently, and answered with FAIL code SH_EBUSY
 * (retryable, message "withdrawn"); any other request is left alone and nothing is answered. */
#define SH_PROTO_FIELDS_cancel(F, S)                                                               \
    F(S, req, "req", U64, _, REQ, 0, 0)                                                            \
    F(S, reason, "why", STR, _, OPT, 0, SH_PROTO_MAX_MSG)                                          \
    F(S, withdraw, "wd", BOOL, _, OPT, 0, 0)

/* TOKEN: tokens[i] is the (index + i)-th generated token, so a duplicate is recognised; logprobs
 * is empty or one per token; top_* hold top_n entries per token, token-major. */
#define SH_PROTO_FIELDS_token(F, S)                                                                \
    F(S, req, "req", U64, _, REQ, 0, 0)                                                            \
    F(S, index, "at", U32, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                         \
    F(S, tokens, "tok", I32S, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                      \
    F(S, text, "text", STR, _, REQ, 0, SH_PROTO_MAX_TEXT) /* the decoded text delta */             \
    F(S, logprobs, "lp", F32S, _, OPT, 0, SH_PROTO_MAX_TOKENS)                                     \
    F(S, top_n, "top_n", U8, _, OPT, 0, SH_PROTO_MAX_LOGPROBS)                                     \
    F(S, top_tokens, "top_tok", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS)                              \
    F(S, top_logprobs, "top_lp", F32S, _, OPT, 0, SH_PROTO_MAX_TOKENS)                             \
    F(S, choice, "ix", U32, _, OPT, 0, 128) /* which of the request's n choices */

/* DONE: finish is an sh_proto_finish; text flushes what the stream decoder still held. */
#define SH_PROTO_FIELDS_done(F, S)                                                                 \
    F(S, req, "req", U64, _, REQ, 0, 0)                                                            \
    F(S, finish, "fin", U8, _, REQ, 0, 3)                                                          \
    F(S, n_prompt, "np", U32, _, REQ, 0, 0)                                                        \
    F(S, n_generated, "ng", U32, _, REQ, 0, 0)                                                     \
    F(S, n_cached, "nc", U32, _, OPT, 0, 0) /* prompt tokens served from the prefix cache */       \
    F(S, text, "text", STR, _, OPT, 0, SH_PROTO_MAX_TEXT)                                          \
    F(S, choice, "ix", U32, _, OPT, 0, 128)                                                        \
    F(S, embedding, "emb", F32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* embed: the pooled vector */

/* FAIL: code is an sh_err; retryable says whether resubmitting may succeed. */
#define SH_PROTO_FIELDS_fail(F, S)                                                                 \
    F(S, req, "req", U64, _, REQ, 0, 0)                                                            \
    F(S, code, "code", I32, _, REQ, 1, 255)                                                        \
    F(S, message, "msg", STR, _, REQ, 0, SH_PROTO_MAX_MSG)                                         \
    F(S, retryable, "retry", BOOL, _, OPT, 0, 0)                                                   \
    F(S, status_http, "http", U32, _, OPT, 0, 599) /* the HTTP status a gateway should answer */

/* STEP: deadline_ms as in SUBMIT; a stage drops a step past it. epoch: the batcher's epoch,
 * raised at every PAUSE (never lower than any earlier one, also across a restarted front); a
 * stage drops a STEP or ACT of an epoch older than one that has reached it (run, or only
 * queued), so a step abandoned at a pause does not run once a step of the resume arrived, and
 * one that was running then is not passed on. retry_of: set on a retry (a try sent again
 * because its answer was late), the step id of the first try; a first stage that answered (or
 * forwarded) an earlier try after this one arrived drops it unanswered, since that answer is on
 * its way.
 * reply_to: set by a drafter on another node than its batcher (actors/drafter.c), which sends
 * the STEP under its own address: the batcher's, where the stages answer instead of the sender. */
#define SH_PROTO_FIELDS_step(F, S)                                                                 \
    F(S, step, "step", U64, _, REQ, 0, 0)                                                          \
    F(S, deadline_ms, "dl", U64, _, OPT, 0, 0)                                                     \
    F(S, seqs, "seqs", LIST, step_seq, REQ, 0, SH_PROTO_MAX_SEQS)                                  \
    F(S, epoch, "ep", U64, _, OPT, 0, 0)                                                           \
    F(S, retry_of, "rof", U64, _, OPT, 0, 0) /* a retry: the step id of its first try (0: none) */ \
    F(S, compute_us, "us", U64, _, OPT, 0, 0) /* time spent before the first stage (a drafter) */  \
    F(S, reply_to, "to", ADDR, _, OPT, 0, 0)  /* where STEP_DONE goes (0: the STEP's sender) */

/* ACT: hidden is (n_tokens, d_model) with n_tokens the sum of the sequences' token counts, rows
 * in sequence order, as F32, F16 or I8 (the script's link_dtype, docs/cluster.md). I8 rows are
 * symmetric: element j of row r is hidden[r][j] * scales[r], with one F32 scale per row in
 * `scales` (exactly n_tokens of them); any other dtype has no scales (checked when decoding).
 * reply_to is where the last stage answers STEP_DONE (the STEP's sender, the batcher);
 * compute_us the time the step spent on the stages before this one. */
#define SH_PROTO_FIELDS_act(F, S)                                                                  \
    F(S, step, "step", U64, _, REQ, 0, 0)                                                          \
    F(S, deadline_ms, "dl", U64, _, OPT, 0, 0)                                                     \
    F(S, seqs, "seqs", LIST, step_seq, REQ, 0, SH_PROTO_MAX_SEQS)                                  \
    F(S, hidden, "h", TENSOR, _, REQ, 0, 0)                                                        \
    F(S, reply_to, "to", ADDR, _, OPT, 0, 0)                                                       \
    F(S, compute_us, "us", U64, _, OPT, 0, 0)                                                      \
    F(S, epoch, "ep", U64, _, OPT, 0, 0)                     /* the STEP's epoch */                \
    F(S, scales, "hs", F32S, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* I8 hidden: one scale per row */

#define SH_PROTO_FIELDS_step_done(F, S)                                                            \
    F(S, step, "step", U64, _, REQ, 0, 0)                                                          \
    F(S, seqs, "seqs", LIST, step_out, REQ, 0, SH_PROTO_MAX_SEQS)                                  \
    F(S, compute_us, "us", U64, _, OPT, 0, 0) /* time the step spent on the stages */              \
    F(S, status, "st", I32, _, OPT, 0, 255)   /* 0, or the sh_err that failed the whole step */    \
    F(S, message, "msg", STR, _, OPT, 0, SH_PROTO_MAX_MSG)

/* KV_ALLOC request: seq needs room for n_tokens more tokens; tokens (optional) lets the kvmgr
 * match cached prefix blocks. Reply (same type and session): blocks appended to the table,
 * cached tokens found in the prefix cache, status 0 or an sh_err (SH_EBUSY: out of blocks). */
#define SH_PROTO_FIELDS_kv_alloc(F, S)                                                             \
    F(S, seq, "id", U64, _, REQ, 0, 0)                                                             \
    F(S, n_tokens, "n", U32, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                       \
    F(S, tokens, "tok", I32S, _, OPT, 0, SH_PROTO_MAX_TOKENS)                                      \
    F(S, blocks, "blk", I32S, _, OPT, 0, SH_PROTO_MAX_BLOCKS)                                      \
    F(S, cached, "hit", U32, _, OPT, 0, 0)                                                         \
    F(S, status, "st", I32, _, OPT, 0, 255)                                                        \
    F(S, computed, "cmp", U32, _, OPT, 0, SH_PROTO_MAX_POS) /* request: [0, computed) hold KV */   \
    F(S, appended, "app", U32, _, OPT, 0, SH_PROTO_MAX_TOKENS) /* reply: positions reserved */     \
    F(S, available, "free", U32, _, OPT, 0, 0) /* reply: free + evictable blocks after it */       \
    F(S, keep, "keep", U32, _, OPT, 0, SH_PROTO_MAX_POS) /* request: drop positions [keep, ..)     \
                                                            first (rejected drafts); 0: none */

/* KV_FREE: release the listed blocks (a sliding window), or all of the sequence's when empty. */
#define SH_PROTO_FIELDS_kv_free(F, S)                                                              \
    F(S, seq, "id", U64, _, REQ, 0, 0)                                                             \
    F(S, blocks, "blk", I32S, _, OPT, 0, SH_PROTO_MAX_BLOCKS)                                      \
    F(S, computed, "cmp", U32, _, OPT, 0, SH_PROTO_MAX_POS) /* [0, computed) hold KV */

/* KV_FORK: child shares the parent's first n_tokens; the reply carries the child's table. */
#define SH_PROTO_FIELDS_kv_fork(F, S)                                                              \
    F(S, seq, "id", U64, _, REQ, 0, 0)                                                             \
    F(S, child, "new", U64, _, REQ, 0, 0)                                                          \
    F(S, n_tokens, "n", U32, _, REQ, 0, SH_PROTO_MAX_TOKENS)                                       \
    F(S, blocks, "blk", I32S, _, OPT, 0, SH_PROTO_MAX_BLOCKS)                                      \
    F(S, status, "st", I32, _, OPT, 0, 255)

/* KV_PREFIX: hashes is the hash chain over a prompt's full token blocks; the reply says how many
 * leading hashes hit and their blocks. */
#define SH_PROTO_FIELDS_kv_prefix(F, S)                                                            \
    F(S, hashes, "h", U64S, _, REQ, 0, SH_PROTO_MAX_BLOCKS)                                        \
    F(S, hits, "hit", U32, _, OPT, 0, 0)                                                           \
    F(S, blocks, "blk", I32S, _, OPT, 0, SH_PROTO_MAX_BLOCKS)

/* PING / PONG: seq numbers the heartbeat; sent_us is the pinger's clock, echoed back. */
#define SH_PROTO_FIELDS_ping(F, S)                                                                 \
    F(S, seq, "n", U64, _, REQ, 0, 0)                                                              \
    F(S, sent_us, "t", U64, _, REQ, 0, 0)

#define SH_PROTO_FIELDS_pong(F, S)                                                                 \
    F(S, seq, "n", U64, _, REQ, 0, 0)                                                              \
    F(S, sent_us, "t", U64, _, REQ, 0, 0)                                                          \
    F(S, health, "ok", U8, _, REQ, 0, 2) /* sh_proto_health */                                     \
    F(S, queue_depth, "q", U32, _, REQ, 0, 0)                                                      \
    F(S, mem_bytes, "mem", U64, _, REQ, 0, 0)                                                      \
    F(S, step_us, "lat", U64, _, OPT, 0, 0) /* last step's latency */

#define SH_PROTO_FIELDS_metrics(F, S)                                                              \
    F(S, at_us, "t", U64, _, REQ, 0, 0)                                                            \
    F(S, values, "m", LIST, metric, REQ, 0, 4096)                                                  \
    F(S, hists, "h", LIST, histogram, OPT, 0, 1024)

/* CONTROL: op is an sh_proto_control_op; targets are the new addresses of a reroute (of a
 * group's ranks for REGROUP). */
#define SH_PROTO_FIELDS_control(F, S)                                                              \
    F(S, op, "op", U8, _, REQ, 0, 9)                                                               \
    F(S, level, "lvl", I32, _, OPT, 0, 0) /* degradation level; NODE_*: node */                    \
    F(S, targets, "to", U64S, _, OPT, 0, 1024)                                                     \
    F(S, arg, "arg", STR, _, OPT, 0, SH_PROTO_MAX_MSG)

/* FAULT: clear drops the existing rules before adding these; seed seeds the fault RNG. */
#define SH_PROTO_FIELDS_fault(F, S)                                                                \
    F(S, seed, "seed", U64, _, REQ, 0, 0)                                                          \
    F(S, clear, "clr", BOOL, _, OPT, 0, 0)                                                         \
    F(S, rules, "r", LIST, fault_rule, REQ, 0, 256)

/* ERROR: the answer to an undeliverable or undecodable request, with the request's session. */
#define SH_PROTO_FIELDS_error(F, S)                                                                \
    F(S, code, "code", I32, _, REQ, 1, 255)                                                        \
    F(S, message, "msg", STR, _, REQ, 0, SH_PROTO_MAX_MSG)                                         \
    F(S, type, "ty", U32, _, OPT, 0, 255) /* the request's type, 0 when unknown */

/* HELLO: a node's identity, sent by the front to each worker (a request) and answered by the
 * worker with its own; the front refuses a worker whose build, protocol, model file or stage
 * settings differ. model_hash hashes the GGUF header and tensor table (model/gguf.h). With a
 * cluster key, the greeting carries a nonce, the answer a nonce and a proof, and a second
 * request (phase 1) the greeting node's proof, answered with auth_ok (actors/hello.h); the key
 * itself never travels. Nonces and proofs are 32 bytes as 64 hex digits. */
#define SH_PROTO_FIELDS_hello(F, S)                                                                \
    F(S, node, "n", STR, _, REQ, 0, SH_PROTO_MAX_NAME)                                             \
    F(S, version, "v", STR, _, REQ, 0, SH_PROTO_MAX_NAME)                                          \
    F(S, proto, "pv", U32, _, REQ, 0, 0)                                                           \
    F(S, model_size, "msz", U64, _, OPT, 0, 0)                                                     \
    F(S, model_hash, "mh", U64, _, OPT, 0, 0)                                                      \
    F(S, n_blocks, "kvb", I32, _, OPT, 0, 0)    /* KV blocks of each stage's pool */               \
    F(S, max_seqs, "ms", I32, _, OPT, 0, 0)     /* sequences per step the stages take */           \
    F(S, max_tokens, "mt", I32, _, OPT, 0, 0)   /* rows per step the stages take */                \
    F(S, seq_blocks, "sb", I32, _, OPT, 0, 0)   /* block-table length per sequence */              \
    F(S, stages, "st", U64S, _, OPT, 0, 1024)   /* the node's stage addresses, in script order */  \
    F(S, slices, "sl", U64S, _, OPT, 0, 1024)   /* per stage: layers, tp and rank (hello.h) */     \
    F(S, link_dtype, "ld", U32, _, OPT, 0, 255) /* the dtype its stages send ACT hidden rows in */ \
    F(S, kv_dtype, "kvt", U32, _, OPT, 0, 1)    /* its stages' KV cache type: 0 F32, 1 F16 */      \
    F(S, keyed, "ky", BOOL, _, OPT, 0, 0)       /* the sender holds a cluster key */               \
    F(S, phase, "ph", U32, _, OPT, 0, 1)       /* 1: the greeting node's proof (and its answer) */ \
    F(S, nonce, "nc", STR, _, OPT, 0, 64)      /* the sender's challenge */                        \
    F(S, peer_nonce, "pn", STR, _, OPT, 0, 64) /* phase 1: the answering node's nonce, echoed */   \
    F(S, proof, "pf", STR, _, OPT, 0, 64)      /* HMAC proof of the key (base/auth.h) */           \
    F(S, auth_ok, "ok", BOOL, _, OPT, 0, 0)    /* answer to phase 1: the proof checked */

#endif
