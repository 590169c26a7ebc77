/* Speculative decoding's model drafter for many sequences at once (the serving drafter,
 * actors/drafter.c): the draft model of model/spec_draft.h (a draft file, or the target's first
 * layers), one paged KV pool shared by the sequences, and greedy drafts for every sequence of a
 * step in k batched forward passes (one catch-up pass, then one row per drafting sequence). */
#ifndef SH_MODEL_SPEC_DRAFT_BATCH_H
#define SH_MODEL_SPEC_DRAFT_BATCH_H

#include <stdint.h>

#include "model/spec_draft.h"

typedef struct sh_spec_drafts sh_spec_drafts;

typedef struct sh_spec_drafts_opts {
    /* The draft (path or self_layers, l2c_tokenizer, kv_type, prefault) as for
     * sh_spec_draft_create; kv_tokens is the pool's capacity, shared by every sequence (rounded up
     * to whole blocks), max_tokens the most rows of one forward pass (a longer catch-up takes
     * several; at least max_seqs). */
    sh_spec_draft_opts draft;
    int32_t max_seqs;   /* requests in one sh_spec_drafts_step (at least 1) */
    int32_t max_slots;  /* sequences whose history and cache are kept (at least max_seqs) */
    int32_t seq_tokens; /* positions one sequence may reach, drafts included (its context) */
} sh_spec_drafts_opts;

/* Makes a batched drafter for a target loaded whole with its tokenizer, on the target's backend
 * (which, with the target and its tokenizer, must outlive it). Returns what
 * sh_spec_draft_create returns for the same draft (another vocabulary, bad self layers, a
 * missing or broken file: e names it), or SH_EINVAL for a bad size, SH_ENOMEM; *out NULL then.
 * Any thread; the drafter then belongs to one thread at a time. */
sh_err sh_spec_drafts_create(const sh_llama *target, const sh_tokenizer *target_tok, sh_backend *be,
                             const sh_spec_drafts_opts *o, sh_spec_drafts **out, sh_error *e);

/* Frees the drafter and the draft model it loaded; accepts NULL. */
void sh_spec_drafts_destroy(sh_spec_drafts *d);

/* Layers run per drafted token (sh_spec_draft_layers). */
int32_t sh_spec_drafts_layers(const sh_spec_drafts *d);

/* One sequence's part of a step: its tokens at positions pos .. pos + n_tokens - 1, and how many
 * drafts to follow them. */
typedef struct sh_spec_drafts_req {
    uint64_t id;           /* the sequence (never 0); its history is kept between calls */
    const int32_t *prior;  // (n_prior) its tokens [0, n_prior) when known (NULL: none)
    int32_t n_prior;       /* tokens of prior that precede pos (at most pos) */
    int32_t pos;           /* where tokens start */
    const int32_t *tokens; // (n_tokens)
    int32_t n_tokens;
    int32_t k;     /* drafts wanted after the last token (0..SH_SPEC_MAX_K; 0: record only) */
    int32_t *out;  // (k) written: the drafts
    int32_t n_out; /* set: how many drafts out holds (0..k) */
} sh_spec_drafts_req;

/* Records each request's tokens as its sequence's tokens [pos, pos + n_tokens), those before pos
 * being what earlier calls (or prior) recorded, the drafts of its last call included (so a step
 * after a verification, which starts at the first position not accepted, finds the accepted
 * drafts there and rewrites the rest), then drafts greedily: one forward pass
 * over every drafting sequence's tokens missing from its cache (in passes of max_tokens rows;
 * rejected drafts of earlier calls are overwritten), giving each its first draft, then one pass
 * per further draft with a row for each sequence still drafting. A sequence whose tokens before
 * pos are not known (an id first seen past position 0 without prior, a history longer than what
 * was recorded, one whose state was evicted for room) gets no drafts until a call gives them;
 * nor does one the pool has no blocks for (sequences not in the call are evicted, least recently
 * used first, to make room) or whose context is full. At most max_seqs requests, distinct ids.
 * Returns SH_OK (each n_out set), SH_EINVAL (too many requests, id 0, k out of range: nothing
 * done), or a forward pass's error with e filled (every n_out 0, the caches of that call's
 * sequences are recomputed next time). */
sh_err sh_spec_drafts_step(sh_spec_drafts *d, sh_spec_drafts_req *r, int32_t n, sh_error *e);

/* Microseconds of the last sh_spec_drafts_step's catch-up passes spent on rows beyond one per
 * sequence (the share of each pass's time those rows make): the history sequences brought (a
 * prompt, a resumed sequence), as opposed to drafting, which costs the same whatever the history.
 * A serving drafter leaves it out of the step time that draft lengths are weighed against. */
uint64_t sh_spec_drafts_extra_us(const sh_spec_drafts *d);

/* Forgets a sequence (its blocks return to the pool); an unknown id is ignored. */
void sh_spec_drafts_forget(sh_spec_drafts *d, uint64_t id);

#endif
