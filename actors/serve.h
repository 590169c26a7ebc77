/* The serving actors of one replica (DESIGN.md sections 4 and 5): gateway, batcher, kvmgr and
 * stage, and what each is spawned with. They talk only through runtime messages:
 *
 *   gateway --SUBMIT/CANCEL--> batcher --STEP--> stage --STEP_DONE--> batcher --TOKEN/DONE/FAIL-->
 *   gateway;   batcher <--KV_ALLOC/KV_FORK (request/reply), KV_FREE (one-way)--> kvmgr.
 *
 * With a pipeline: batcher --STEP--> stage 0 --ACT--> stage 1 ... --ACT--> last stage
 * --STEP_DONE--> batcher.
 *
 * Every kind is registered with sh__serve_register(). Arguments are borrowed by init (copied
 * where needed); the objects they point to (model, tokenizer, context) must outlive the runtime. */
#ifndef SH_ACTORS_SERVE_H
#define SH_ACTORS_SERVE_H

#include <stdbool.h>
#include <stdint.h>

#include "actors/kvmgr_core.h"
#include "model/chat.h"
#include "model/llama.h"
#include "model/spec.h"
#include "model/tokenizer.h"
#include "net/openai.h"
#include "net/openai_tools.h"
#include "shoal/runtime.h"

/* ---- kvmgr ------------------------------------------------------------------------------ */

/* Kind "kvmgr": owns the replica's block table (actors/kvmgr_core.h).
 *
 * KV_ALLOC (a request; the reply is a KV_ALLOC with the same session):
 *   - computed > 0: positions [0, computed) of seq now hold KV (sh_kv_mark_computed) - applied
 *     first, so finished blocks enter the prefix cache;
 *   - an unknown seq is created: with prefix caching on and tokens given, tokens is the whole
 *     token list known so far (prompt, plus generated tokens when resuming) and the cached prefix
 *     is adopted (reply.cached positions); then min(n_tokens, tokens.n - cached) positions are
 *     reserved with ids tokens[cached ...]. Without tokens, n_tokens positions with unknown ids.
 *     When the reservation fails the new sequence is freed again (nothing stays allocated).
 *   - a known seq first gives back its positions from `keep` on when keep > 0 (reserved, never
 *     computed: a speculative step's rejected drafts; sh_kv_truncate), then reserves n_tokens
 *     positions; tokens, when given, holds exactly their ids.
 *   - reply: seq, n_tokens (as asked), blocks = the sequence's whole block table after the call,
 *     cached (new sequences only), appended (positions reserved), status (0, SH_EBUSY when the
 *     pool is short, SH_ERANGE beyond max_blocks_per_seq, SH_EINVAL), available (free plus
 *     evictable blocks after the call).
 * KV_FORK (a request): child (a new id) shares the first n_tokens of seq (fork at a block
 *   boundary, so no copy-on-write copy is ever needed); the reply carries the child's table and
 *   status.
 * KV_FREE (one-way): computed as in KV_ALLOC, then every block of seq is released. An unknown
 *   seq is ignored.
 * CONTROL op RESET (one-way; the batcher sends it when paused, below): the pool becomes as after
 *   init (the manager is created again with the same configuration): every sequence and every
 *   prefix-cache entry is dropped and every block is free; gauges follow, counters go on. Later
 *   messages naming an old seq treat it as unknown. Other CONTROL ops are ignored.
 * Metrics (runtime registry): shoal_kv_blocks_total, shoal_kv_blocks_used,
 *   shoal_kv_blocks_cached (gauges), shoal_prefix_cache_query_tokens_total,
 *   shoal_prefix_cache_hit_tokens_total, shoal_kv_evictions_total (counters). */
typedef struct sh_kvmgr_args {
    sh_kv_config cfg;  /* n_blocks from the stage's pool, max_seqs, window */
    bool prefix_cache; /* false: never look up or adopt cached blocks */
    /* When set (e.g. `replica="1"`), labels every series this kvmgr registers; several kvmgrs
     * without labels sum into the same series. */
    const char *metric_labels;
} sh_kvmgr_args;

/* ---- stage ------------------------------------------------------------------------------ */

/* Kind "stage": layers [model->first, model->last) of a model on the CPU backend, one stage of a
 * replica's pipeline (a replica of one stage holds the whole model). Each STEP (first stage) or
 * ACT (the others) runs on the stage's worker thread as ONE sh_llama_forward over all its
 * sequences; messages arriving while one runs queue and run in arrival order.
 *
 * First stage (first == 0) takes STEP; any other takes ACT. A STEP to a later stage or an ACT to
 * the first is answered with a failed STEP_DONE (SH_EINVAL).
 *
 * A stage that is not the last (last < n_layers) sends ACT to `next`: the same step id, deadline
 * and per-sequence entries (ids, tokens, positions, block tables, sample flags, sampling
 * parameters, history) and its output rows as `hidden`, a (rows, dim) tensor of link_dtype:
 * F32 as computed, F16 rounded to nearest even, or I8 with one F32 scale per row in `scales`
 * (symmetric: scale = max|x| / 127, q = round(x / scale); an all-zero row has scale 0). A stage
 * takes ACT in any of the three dtypes, whatever its own link_dtype, and widens F16 and I8 rows
 * into an F32 buffer it keeps before its forward pass. reply_to is where STEP_DONE must go (the
 * STEP's sender, copied from stage to stage) and compute_us the time spent so far. The envelope
 * keeps the STEP's trace id and carries the step id as its session, so an ACT that cannot be
 * delivered comes back as an ERROR, which the stage turns into a failed
 * STEP_DONE for that step (it remembers the reply address of its last 16 forwarded steps). The
 * frame is built in a buffer the stage keeps and sent from the runtime's message pools: nothing
 * is allocated per step once the largest step has been seen.
 *
 * Metrics (runtime registry), per link, labelled with the first layer of the receiving stage and
 * the dtype (`layer="15",dtype="int8"`): shoal_act_bytes_total, the bytes of the ACT bodies sent
 * (hidden rows, scales and the sequences' metadata), and shoal_act_hidden_bytes_total, those of
 * the hidden rows and scales alone.
 *
 * The last stage (last == n_layers) samples the sequences whose `sample` is true and answers
 * STEP_DONE to the STEP's sender (one stage) or the ACT's reply_to: one step_out per step_seq in
 * the same order (token -1 when not sampled), logprob/logprob_raw of the token, and
 * top_tokens/top_logprobs when sampling.n_logprobs > 0; compute_us summed over the stages
 * (plus the STEP's own compute_us: a drafter's time before the first stage, actors/drafter.c).
 *
 * Speculative steps (issue 27): a sequence whose step_seq.draft is d > 0 carries its last
 * accepted token then d drafted tokens (d < tokens.n; it must sample, and ask for no top
 * logprobs: the stage refuses such a step with SH_EINVAL naming the sequence, as it refuses other
 * bad steps). The last stage asks the forward pass for its last d + 1 rows of logits and verifies
 * the drafts with sh_spec_verify (model/spec.h) and the sequence's sampler: token, logprob and
 * logprob_raw are the first verified token's (logprob under the final distribution, logprob_raw
 * the raw one, as for a one-token step), more/more_lp/more_lp_raw the rest in order; every token
 * but the last of token, more... is an accepted draft, the last the target's own. The sampler's
 * penalty window takes exactly those tokens; `history` (sent with a sequence's first sampled
 * step) must hold its accepted tokens, never drafts. A tensor-parallel group's greedy head
 * compares each row's top-1 with the draft instead. The rows of logits of a step (one per
 * sampled sequence, d + 1 for a drafted one) must fit the last stage's context
 * (sh_llama_ctx_opts.max_logits: sh_stage_max_logits gives what a replica that may speculate
 * sizes it with); a step wanting more is refused with SH_EINVAL. Middle stages carry `draft` on
 * in their ACT unchanged.
 *
 * Epochs: a STEP carries its batcher's epoch (raised at every PAUSE) and ACT carries it on; a
 * stage remembers the newest it has seen and drops, unanswered, a STEP or ACT of an older one,
 * so a step abandoned at a pause never writes KV after the resume.
 *
 * Failure: whichever stage fails a step (a bad step, a forward error, bad sampling parameters,
 * hidden states that are not (rows, dim), a next stage that cannot be reached) answers
 * STEP_DONE with status (an sh_err), message and no seqs straight to the reply address, and the
 * later stages never see the step; so every STEP gets exactly one STEP_DONE. An ACT that cannot
 * be decoded has no readable reply address: its failed STEP_DONE (SH_EPROTO, step = the
 * envelope's session) goes to `batcher` when set, else it is only logged. A step that fails on a
 * later stage has written the KV rows of the earlier stages; the batcher fails its sequences.
 * An empty step is answered by the first stage at once.
 *
 * Each stage owns the KV pool of its own layers (its ctx); block tables are the kvmgr's and
 * shared, so every stage's pool must have the same block count. Samplers live on the last stage:
 * one per sequence id, created the first time that id samples (from its sampling parameters,
 * accepting each id of `history` for the penalties), then accepting every token it samples; kept
 * in a table of 2 * max_seqs entries, least recently used evicted. The batcher never reuses a
 * sequence id. Nothing is allocated per step or per token after a sequence's first sample.
 *
 * Stages are joined by ACT in one runtime, or across runtimes wherever the transport reaches
 * (`shoal node` workers and a `shoal serve -c` front, docs/cluster.md). With max_inflight set to
 * the number of stages the batcher keeps a step in flight for every stage, so the stages of a
 * pipeline overlap instead of taking turns. */
typedef struct sh_stage_args {
    const sh_llama *model; /* loaded with the stage's layer range */
    sh_llama_ctx *ctx;     /* borrowed; used by the worker thread only */
    int32_t max_seqs;
    int32_t max_blocks_per_seq; /* block-table length per sequence (with a sliding window it may
                                 * exceed the pool: released entries are -1); 0: the pool's */
    sh_addr next;               /* the next stage; SH_ADDR_NONE exactly when last == n_layers */
    sh_addr batcher;            /* optional: where the failure of an undecodable ACT goes */
    uint32_t link_dtype;        /* how this stage SENDS hidden rows to `next`: SH_PROTO_DTYPE_F32
                                 * (0, the default), _F16 or _I8 (runtime/proto.h) */
    /* Optional (a cluster node with a key): STEP and ACT from a node that has not proved the
     * cluster key in HELLO are dropped and logged (sh__hello_auth_allows, actors/hello.h). */
    struct sh_hello_auth *auth;
    /* The node (id) whose CONTROL op REROUTE with one target moves `next` there (the front, when
     * a standby took over the next stage; actors/watchdog.h); 0: CONTROL is dropped. */
    uint32_t control_node;
    /* The node (id) of a drafter in front of this first stage on another node than the front
     * (a cluster replica's drafter, docs/cluster.md): its STEPs are taken like the front's (they
     * may raise the epoch), and answered at their reply_to. 0: none. */
    uint32_t drafter_node;
    /* Tensor parallelism (docs/cluster.md): this actor is rank tp_rank of a group of tp_size
     * ranks (0 or 1: no group), tp_ranks[r] (tp_size entries, copied) being rank r's stage actor.
     * Rank 0, the leader, takes STEP or ACT as a stage does and sends every one it runs, as it
     * came, to each other rank (the envelope's session carries the group's epoch); the others
     * take STEP and ACT from the leader only (anything else is dropped and counted as
     * shoal_frames_refused_total{reason="tp_not_leader"}) and send nothing. Every rank checks
     * the step, then all agree on it over the group (one all-gather of each rank's verdict,
     * which fails within coll.timeout_ms when a rank is dead or stopped), then run the forward
     * pass; only the leader samples, forwards ACT and answers STEP_DONE. The group (coll_kind
     * with coll's shm_name, urls, key: borrowed, outliving the actor; rank, size, epoch and
     * max_bytes are set here) and the context over it (ctx must be NULL: the worker creates it
     * from be and ctx_opts, with n_blocks blocks) are created at the first step, and again after
     * a failed step or a new batcher epoch with a new group epoch. tp_ranks[tp_rank] may be
     * anything (the actor's own address is used); coll's urls are copied.
     * CONTROL op REGROUP from control_node (a standby took a rank's place: SH_PROTO_CONTROL_OP_
     * REGROUP in runtime/proto.h) gives every rank's address and, over the network, URL anew:
     * the next step forms the group with them (the leader with a new epoch). */
    int32_t tp_rank, tp_size;
    const sh_addr *tp_ranks;
    int32_t coll_kind; /* sh_coll_kind (runtime/coll.h) */
    const struct sh_coll_opts *coll;
    sh_backend *be;
    const sh_llama_ctx_opts *ctx_opts;
    int32_t n_blocks;
} sh_stage_args;

/* Rows of logits a last stage's context allows beyond one per sequence, for drafted tokens
 * (4 * SH_SPEC_MAX_K): 4 sequences drafting 16 tokens each, or 32 drafting 2, in one step. A row
 * of logits is n_vocab floats (192 KiB for a vocabulary of 49152, 12 MiB for these 64 rows; a
 * tensor-parallel rank also gathers every rank's share of them). */
#define SH_STAGE_SPEC_ROWS (4 * SH_SPEC_MAX_K) /* 64 */

/* The max_logits a replica that may speculate gives its stages' contexts
 * (sh_llama_ctx_opts.max_logits): max_seqs + SH_STAGE_SPEC_ROWS, at most max_tokens (the
 * context's limit). A batcher keeps a step's rows of logits (one per sampled sequence, plus each
 * sequence's drafts) within it. */
int32_t sh_stage_max_logits(int32_t max_seqs, int32_t max_tokens);

/* ---- drafter ---------------------------------------------------------------------------- */

/* Kind "drafter" (actors/drafter.c): speculative decoding's draft model in serving (`shoal serve
 * --spec draft:PATH|self:LAYERS`), between a batcher and its first stage. The batcher sends its
 * STEP here; the drafter records every sequence's tokens (a sequence's history: its tokens
 * [0, pos) from earlier steps, or from the step's prior, then this step's), appends up to
 * want_draft greedy drafts of its model (sh_spec_drafts_step) to each sequence that asks and may
 * take them (it samples, asks for no top logprobs, carries no drafts yet, and its block table
 * has room), sets that sequence's draft to how many it appended (0 is fine: drafting is
 * best-effort), clears want_draft and prior, adds its time to the STEP's compute_us (less the
 * catch-up over a sequence's history beyond one row each, sh_spec_drafts_extra_us), and sends
 * the STEP on to `stage` under the STEP's own sender and trace id, so that the stage answers
 * STEP_DONE to the batcher directly. A STEP from another node (a cluster replica's drafter on a
 * node of its own, docs/cluster.md) goes on under the drafter's own address with the sender's in
 * its reply_to, where the stages answer (the stage's sh_stage_args.drafter_node names this node).
 * A STEP it cannot decode goes on unchanged (the stage answers it); from another node it is
 * dropped and logged (the batcher retries it). Greedy drafts depend only on a sequence's history,
 * so a retried STEP gets the same drafts. STEPs are drafted on the drafter's worker thread, one at
 * a time, in arrival order; other messages are dropped. Metrics (runtime registry, labelled with
 * metric_labels): shoal_drafter_steps_total, shoal_drafter_tokens_total (drafts appended),
 * shoal_drafter_compute_us_total. */
typedef struct sh_drafter_args {
    struct sh_spec_drafts *drafts; /* borrowed; used by the worker thread only */
    sh_addr stage;                 /* the first stage */
    int32_t max_seqs;              /* sequences of one STEP it records (the batcher's max_seqs) */
    int32_t block_tokens;          /* KV block size (0: SH_KV_DEFAULT_BLOCK_TOKENS) */
    const char *metric_labels;
    /* Optional (a cluster node with a key): STEPs from a node that has not proved the cluster key
     * in HELLO are dropped and logged (sh__hello_auth_allows, actors/hello.h). */
    struct sh_hello_auth *auth;
} sh_drafter_args;

/* The drafter of a replica in one process (`shoal serve` with spec->kind SH_SPEC_DRAFT or
 * SH_SPEC_SELF): spec's draft file or layers over target (loaded whole, with its tokenizer and
 * backend, which must outlive it), sized for the replica: max_seqs sequences a step (twice as
 * many kept), n_ctx positions each, passes of step_tokens rows, and a pool of as many positions
 * as the target's (n_blocks blocks), of F32 or F16 like it. Returns sh_spec_drafts_create's
 * errors (a draft with another vocabulary, bad layers, a missing or broken file: e says which),
 * SH_EINVAL for another kind; *out NULL then. Any thread. */
sh_err sh__serve_drafts_create(const sh_llama *target, const sh_tokenizer *tok, sh_backend *be,
                               const sh_spec_opts *spec, int32_t n_ctx, int32_t max_seqs,
                               int32_t step_tokens, int64_t n_blocks, bool kv_f32,
                               struct sh_spec_drafts **out, sh_error *e);

/* A cluster replica's drafter on a node of its own (replica{ drafter = ... }, docs/cluster.md):
 * replica k of plan (its config, plan->c) drafts with a draft model file or with the first
 * drafter_self layers of its own model; loads that model's file into *target (with *tok) and
 * makes the drafts as sh__serve_drafts_create does, sized like the replica's stages. With a draft
 * file the target is loaded whole and prefaulted (the draft's vocabulary is checked against it);
 * with self-speculation the file is mapped whole but only what the draft runs is read: the
 * embedding, layers [0, drafter_self) and the output head (prefaulted here,
 * sh_llama_load_opts.prefault_layers; prepared by the drafting context). On success the caller
 * owns *target, *tok and *out and destroys *out first. Returns, with e saying which replica and
 * why and every out-parameter NULL: the loader's errors (SH_EIO, SH_EFORMAT, SH_EUNSUPPORTED),
 * SH_EINVAL (a draft of another vocabulary, bad layers, a path too long), SH_ENOMEM or a backend
 * error. Any thread. */
struct sh_cluster_plan;
sh_err sh__serve_node_drafts_create(const struct sh_cluster_plan *plan, int32_t k, sh_backend *be,
                                    sh_llama **target, sh_tokenizer **tok,
                                    struct sh_spec_drafts **out, sh_error *e);

/* ---- batcher ---------------------------------------------------------------------------- */

/* Kind "batcher" (actors/batcher.c): continuous batching for one replica. Takes SUBMIT and
 * CANCEL (from the gateway or a router), answers each request's sender with TOKEN, DONE or FAIL,
 * asks `kvmgr` for blocks and sends STEP to `stage` (the first stage). A CANCEL with withdraw
 * removes a request only when none of its sequences was ever granted KV (still queued, nothing
 * computed or generated): silently, with FAIL SH_EBUSY (retryable, 503, "withdrawn") to its
 * sender; any other request is left alone and nothing is answered. Metrics (runtime registry,
 * each labelled with metric_labels): docs/serving.md.
 *
 * CONTROL (from anyone; the front, when a stage node of the replica died and until it is back):
 *   - op PAUSE (idempotent): every step in flight is abandoned (its slot freed: its STEP_DONE,
 *     late or duplicated, is an unknown step id and ignored; its step timeout no longer runs);
 *     every running sequence returns to the queue keeping its tokens, as a preempted one does,
 *     its KV forgotten without a KV_FREE; then `kvmgr` gets one CONTROL op RESET (after every KV
 *     message sent before it) and the replies still due to earlier KV requests are absorbed.
 *     While paused no STEP and no KV request is sent; SUBMIT, CANCEL (a cancelled request ends at
 *     once), deadlines and the METRICS reports go on. shoal_batcher_paused is 1.
 *   - op RESUME (nothing when not paused): planning starts again; each sequence is admitted with
 *     its whole token list (prompt and generated), recomputed, and its stream goes on with the
 *     next token: TOKEN indices stay contiguous, none repeated or missing, and a greedy request's
 *     output equals an undisturbed run's.
 *   Other ops are ignored. */
typedef struct sh_batcher_args {
    sh_addr kvmgr, stage;
    const sh_tokenizer *tok; /* detokenizes for stop strings and TOKEN text */
    int32_t n_vocab;
    int32_t n_ctx;           /* positions per sequence (prompt + generated) */
    int32_t max_step_tokens; /* token budget per step (default 4096) */
    int32_t max_seqs;        /* running sequences (default 64) */
    int32_t max_wait_ms;     /* wait to form a batch when idle (default 50) */
    int32_t max_queue;       /* requests held, running and waiting, before SUBMIT gets 429 (1024) */
    int32_t block_tokens;    /* KV block size (16) */
    int32_t n_blocks;        /* blocks in the KV pool (admission control) */
    int32_t seq_blocks;      /* KV blocks one sequence can hold at once: the pool, or its block
                              * table when shorter. A request whose prompt and max_tokens (within
                              * n_ctx) need more is refused at SUBMIT with 503. 0: not known (a
                              * sliding window bounds what a sequence holds), no such check */
    bool llama2c;            /* the model delimits texts with BOS: treat BOS as end */
    uint32_t step_timeout_ms; /* a step not answered (STEP_DONE) within this fails: the requests
                               * of its sequences get 503 naming the step, and batching goes on
                               * (checked every 100 ms; each step in flight has its own clock).
                               * For stages on other nodes, where a dead node's step is never
                               * answered. 0: wait for ever (one process) */
    /* Lost steps are retried (only with step_timeout_ms): a step whose STEP_DONE has not come by
     * its retry deadline is sent again under a fresh step id, its sequences' tokens, positions,
     * block tables and sampling seeds unchanged (KV rows are written by position, so a stage that
     * ran the lost try rewrites the same values), and the first answer to any of its tries is
     * taken, later ones ignored: a request's output is an undisturbed run's (the last stage gives
     * a step run again the draw it made: actors/stage.c). The deadline
     * is max(step_retry_ms, 4 x the latency expected of a step of its size, from a moving average
     * of answered steps; 1 s before any), or step_retry_ms / 4 once a step sent after it was
     * answered (stages answer in order), doubled at each retry. After step_retries retries, or
     * step_timeout_ms after the first try, the step fails as above. A failed STEP_DONE for a
     * link's reasons (SH_EIO, SH_EBUSY, SH_ETIMEDOUT, SH_ECLOSED) is sent again at once.
     * step_retry_ms 0: 200; step_retries 0: 5 (at most 15), below 0: no retries. */
    uint32_t step_retry_ms;
    int32_t step_retries;
    /* Pipelining: up to max_inflight steps in flight at once (at most 64), on disjoint groups of
     * sequences: a sequence is in one step at a time and is never preempted while it is; each
     * step takes an equal share of the sequences to run and the whole max_step_tokens budget.
     * A P-stage pipeline keeps every stage busy with P. 0 or 1: one step at a time. */
    int32_t max_inflight;
    /* Replicas behind a router (actors/router.c). When router is not SH_ADDR_NONE (0), at init
     * and then every report_ms (0: 1000) the batcher sends it a METRICS message with its load
     * and what it measured (the names are in actors/router.h). metric_labels, when set (e.g.
     * `replica="1"`), labels every series the batcher registers, so that several batchers share
     * one registry. */
    sh_addr router;
    uint32_t report_ms;
    const char *metric_labels;
    /* Speculative decoding (model/spec.h, docs/serving.md): SH_SPEC_NGRAM drafts up to spec_k
     * (1..SH_SPEC_MAX_K; 0: SH_SPEC_DEFAULT_K) tokens per decode step of a sequence from an
     * n-gram lookup in its own tokens and a pool shared by the replica's requests; the stage
     * verifies them in the step (step_seq.draft) and answers the accepted ones and its own token
     * (step_out.more). Each sequence's draft length follows its acceptance and the measured cost
     * of a step's rows, so that speculation stops by itself where it does not pay (large
     * batches). Never for a request with top logprobs or sampling.no_spec. SH_SPEC_OFF (0): no
     * drafts. SH_SPEC_DRAFT and SH_SPEC_SELF: a drafter actor in front of the first stage (`stage`
     * is then the drafter's address) drafts instead: the batcher asks for k drafts
     * (step_seq.want_draft), reserves their positions (without ids: the prefix cache then stops
     * at a drafting sequence's output), sends a sequence's tokens before the step's start
     * (step_seq.prior) until its first sample, and takes what the answer's more lists accept. */
    sh_spec_kind spec;
    int32_t spec_k;
    /* The rows of logits one step may ask of the last stage (its context's max_logits): one per
     * sampled sequence plus every drafted token; drafts are left out of a step beyond it. 0:
     * max_seqs (a context's default), which leaves drafts only the rows that the step's sampled
     * sequences do not take. */
    int32_t max_logits;
} sh_batcher_args;

/* ---- gateway ---------------------------------------------------------------------------- */

/* One model a gateway serves (several behind one cluster front, issue 11): the name requests
 * give in "model", its tokenizer, chat template and context, and where its requests go (its only
 * replica's batcher, or the router of its replicas). Borrowed like the rest of the arguments. */
typedef struct sh_gateway_model {
    const char *name;
    sh_addr batcher;
    const sh_tokenizer *tok;
    sh_chat_template chat;
    const char *default_system; /* NULL: none */
    int32_t n_vocab, n_ctx;
    int32_t n_ctx_train;                /* the model's training context (/v1/models); 0: unknown */
    const sh_openai_sampling *sampling; /* what absent sampling fields take; NULL: OpenAI's */
    /* POST /v1/embeddings: the model's width and pooling (sh_llama_pooling); embd_dim 0: not
     * served (501) */
    int32_t embd_dim;
    uint8_t pooling;
} sh_gateway_model;

#define SH_GATEWAY_MAX_MODELS 16

typedef struct sh_gateway_args {
    /* The one model served, unless `models` is given (then these are ignored). */
    sh_addr batcher;
    const sh_tokenizer *tok;
    sh_chat_template chat;
    const char *default_system; /* the template's default system prompt, or NULL */
    const char *model_name;     /* the id /v1/models lists and requests must name */
    int32_t n_vocab, n_ctx;
    int32_t n_ctx_train;                /* 0: unknown */
    const sh_openai_sampling *sampling; /* what absent sampling fields take; NULL: OpenAI's
                                         * (sh_openai_sampling_neutral). /v1/models lists it. */
    int32_t embd_dim;                   /* as sh_gateway_model's */
    uint8_t pooling;
    /* Optional: n_models (1 to SH_GATEWAY_MAX_MODELS) models, copied at init. /v1/models lists
     * them in this order; a request's "model" picks one (an unknown name is a 404 naming them;
     * without "model" a request is a 400 when there are several). */
    const sh_gateway_model *models;
    int32_t n_models;
    const char *host; /* default 127.0.0.1 */
    int port;         /* 0: ephemeral */
    uint64_t max_body_bytes;
    uint32_t max_conns;
    uint32_t header_timeout_ms; /* slow clients: first byte to end of headers (default 10000) */
    int32_t max_tokens;         /* largest max_tokens */
    int32_t max_n;
    const sh_openai_key *keys; /* bearer keys; n_keys 0: open */
    int32_t n_keys;
    uint32_t request_timeout_ms; /* a request still running after this finishes with "timeout"
                                  * (0: none) */
    int *bound_port;             /* when set, init writes the port it listens on */
    uint32_t idle_timeout_ms;    /* keep-alive wait for the next request (default 60000) */
    uint32_t max_conns_per_ip;   /* open connections per client address (0: no limit) */
    bool metrics_public;         /* /metrics answers without a key even when keys are set */
    /* CORS (--cors-origin): origins ("https://host[:port]", or "*" for any) whose pages may call
     * the API, NULL-terminated; preflights are answered before the keys. Borrowed; NULL or an
     * empty list: off. */
    const char *const *cors_origins;
    uint32_t drain_timeout_ms;  /* after sh__gateway_ctl_drain: how long in-flight requests may
                                 * still finish before they are ended with an error (0: none) */
    struct sh_gateway_ctl *ctl; /* optional: drain and key reloads from another thread */
    /* Optional: GET /admin/cluster answers 200 with the JSON document this returns (the
     * topology and load of the cluster this process fronts; tools/cluster_status.h), or 500 when
     * it returns NULL. Called on the gateway's loop thread with cluster_user: it must not block.
     * The gateway frees the string. Behind the API keys when keys are set (--metrics-public
     * does not open it); answered while draining too. NULL: /admin/cluster is 404. */
    char *(*cluster_json)(void *user);
    void *cluster_user;
    /* Optional: GET /admin/status answers 200 with the JSON document this returns (a superset
     * of cluster_json's with health, degradation level and the last events;
     * tools/cluster_status.h), and GET /admin/ with the status page that draws it
     * (net/admin_page.h). Called like cluster_json, with cluster_user. Behind the API keys
     * when keys are set (the page also takes the key as ?key=); answered while draining too.
     * NULL: both are 404. */
    char *(*status_json)(void *user);
    /* Optional: renders GET /metrics in place of sh_metrics_render() of the runtime's registry
     * m, with the contract of sh_metrics_render() (*len the full length; SH_ERANGE: the gateway
     * grows buf and calls again; any other error answers 500). A cluster front renders every
     * worker node's series beside its own (actors/node_metrics.h). Called on the gateway's loop
     * thread with metrics_user: it must not block (a short lock is fine). The gateway appends
     * its derived gauges (shoal_kv_usage_ratio, shoal_http_*) after it, so it must not render
     * those families. NULL: the registry alone. */
    sh_err (*metrics_render)(void *user, sh_metrics *m, char *buf, size_t cap, size_t *len);
    void *metrics_user;
    /* Optional: the degradation ladder (actors/degrade.h). Every request gets the effects of the
     * level in force (the header X-Shoal-Degraded says which; level 4 answers 503 with
     * Retry-After), and POST /admin/policy/reload reloads its policy (200, or 422 with the
     * script's error and the old policy kept; 409 without a ladder), behind the API keys when
     * keys are set. Borrowed; must outlive the gateway. */
    struct sh_degrade *degrade;
} sh_gateway_args;

/* Commands to a running gateway from any thread (the serving process's signal thread): the
 * gateway registers itself in init and unregisters in stop; commands given while no gateway is
 * registered are kept for the next one (a drain) or dropped (keys, which init takes from args).
 *
 * Drain (graceful shutdown): keep-alive ends, /health answers 503 {"status":"draining"}, new
 * requests get 503, requests in flight go on. When none is left, or drain_timeout_ms after the
 * command, drained() turns true; at that deadline every request still open is cancelled and
 * ended: a stream with an error event and `data: [DONE]`, anything else with a 503 error. */
typedef struct sh_gateway_ctl sh_gateway_ctl;

/* Returns SH_OK or SH_ENOMEM. destroy accepts NULL; call it after the runtime is destroyed. */
sh_err sh__gateway_ctl_create(sh_gateway_ctl **out);
void sh__gateway_ctl_destroy(sh_gateway_ctl *ctl);
/* Starts draining (idempotent). Any thread. */
void sh__gateway_ctl_drain(sh_gateway_ctl *ctl);
/* Fail-stop (a cluster front that lost a worker node): a drain whose deadline is now, also when
 * a drain is already under way. /health and new requests answer 503 as while draining; every
 * open request is cancelled and ended at once with a 503 error of code "replica_failed" and
 * message msg (copied, up to 255 bytes; the first call's wins): a started stream with an error
 * event and `data: [DONE]`. drained() turns true once that is done. Any thread. */
void sh__gateway_ctl_fail(sh_gateway_ctl *ctl, const char *msg);
/* Whether a drain finished (every request answered, or the deadline passed). Any thread. */
bool sh__gateway_ctl_drained(sh_gateway_ctl *ctl);
/* Replaces the gateway's API keys (copied; n_keys 0 turns authentication off). Returns SH_OK,
 * SH_ECLOSED (no gateway running: nothing changed), SH_ENOMEM. Any thread. */
sh_err sh__gateway_ctl_set_keys(sh_gateway_ctl *ctl, const sh_openai_key *keys, int32_t n_keys);

/* ---- sizing (actors/serve.c) -------------------------------------------------------------- */

/* What a replica in one process is asked for (`shoal serve`'s flags, sh_engine_opts); zero
 * fields take the defaults. */
typedef struct sh_serve_size_opts {
    int32_t n_ctx;       /* 0: the trained context, at most 8192 (at least 16) */
    int32_t max_seqs;    /* 0: 64 */
    int32_t step_tokens; /* 0: 4096 (at least max_seqs) */
    int64_t kv_blocks;   /* 0: from kv_mem */
    uint64_t kv_mem;     /* 0: sh__serve_default_kv_mem() */
    bool kv_f32;         /* KV in F32 (default F16) */
} sh_serve_size_opts;

typedef struct sh_serve_size {
    int32_t n_ctx, max_seqs, step_tokens;
    int64_t n_blocks;         /* KV blocks of SH_KV_DEFAULT_BLOCK_TOKENS, 1 .. 2^22 */
    uint64_t bytes_per_block; /* K and V of one block in every layer */
} sh_serve_size;

/* 1 GiB, or a quarter of the memory available now when that is less. Any thread. */
uint64_t sh__serve_default_kv_mem(void);

/* Fills *out for a model with hyper-parameters hp. SH_ENOMEM (e filled) when the KV budget holds
 * no block. Pure; any thread. */
sh_err sh__serve_size(const sh_llama_hparams *hp, const sh_serve_size_opts *o, sh_serve_size *out,
                      sh_error *e);

/* The block-table length of one sequence (sh_kv_config.max_blocks_per_seq) for n_ctx positions
 * over a pool of n_blocks. */
int32_t sh__serve_seq_blocks(const sh_llama_hparams *hp, int32_t n_ctx, int32_t n_blocks);

/* The rows of logits per step a replica's last stage context is created with
 * (sh_llama_ctx_opts.max_logits, sh_batcher_args.max_logits): one per sequence, at most
 * step_tokens; with speculative decoding sh_stage_max_logits (SH_STAGE_SPEC_ROWS more). */
int32_t sh__serve_max_logits(int32_t max_seqs, int32_t step_tokens, bool spec);

/* A model's chat template (from its GGUF's tokenizer.chat_template, else its architecture's) and
 * the template's default system prompt, written into sys (cap bytes); *has_sys says whether there
 * is one. Any thread. */
sh_chat_template sh__serve_model_chat(const sh_llama *m, char *sys, size_t cap, bool *has_sys);

/* The gateway's embeddings (POST /v1/embeddings) of model m: its width and pooling. With worker
 * nodes too: their last stage pools (step_out.embd) and the front's batcher combines the parts;
 * a worker older than that field answers none, which fails the input with a 500 naming it. */
void sh__serve_gateway_embed(sh_gateway_args *ga, const sh_llama *m);

/* The model's name as served when none is given: path's file name without directories and
 * without .gguf, written into buf (cap bytes). */
void sh__serve_base_name(const char *path, char *buf, size_t cap);

/* The kinds' vtables (actors/kvmgr.c, stage.c, batcher.c, gateway.c). */
extern const sh_actor_vtable sh__kvmgr_vtable;
extern const sh_actor_vtable sh__stage_vtable;
extern const sh_actor_vtable sh__batcher_vtable;
extern const sh_actor_vtable sh__gateway_vtable;
extern const sh_actor_vtable sh__drafter_vtable;

/* Registers the five kinds (kvmgr, stage, batcher, gateway, drafter) with rt, and the per-node
 * metrics collector and reporter (actors/node_metrics.h). Returns as sh_runtime_register(). Defined
 * in actors/serve.c. */
sh_err sh__serve_register(sh_runtime *rt, sh_error *e);

/* The tool syntax of a chat template (net/openai_tools.h): the gateway's and the embedding
 * API's (actors/gateway_tok.c). */
sh_openai_tool_style sh__serve_tool_style(sh_chat_template t);

#endif
