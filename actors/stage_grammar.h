/* Constrained decoding at the sampling stage (the last stage, or a tensor-parallel group's
 * leader): each sequence with a grammar (sh_proto_sampling.grammar) keeps a matcher
 * (model/grammar.h) beside its sampler. Parsed grammars are cached by their text's hash and shared
 * by the sequences that use them; the vocabulary's index is built once, at the first grammar.
 *
 * A step's sampled token is checked first (sh_gmatch_token_ok); only when the grammar refuses it
 * is the full mask built and the row sampled again with every refused token at -inf (logprobs are
 * then those of the masked row). An end-of-generation token is allowed only where the grammar can
 * end, so a sequence whose grammar is complete samples one and stops. Worker thread, except
 * sh__sgram_sample, which the sampling helper also runs (each thread its own scratch, `th`). */
#ifndef SH_ACTORS_STAGE_GRAMMAR_H
#define SH_ACTORS_STAGE_GRAMMAR_H

#include <stdbool.h>
#include <stdint.h>

#include "model/grammar.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "runtime/proto.h"
#include "shoal/err.h"

typedef struct sh_sgram sh_sgram;

/* A sequence's place in its grammar: the matcher after its first n generated tokens. */
typedef struct sh_sgram_seq {
    sh_gmatch *gm; /* NULL: none yet */
    int32_t entry; /* its grammar's cache entry */
    uint64_t hash; /* of the grammar text */
    uint32_t len;  /* and its length */
    int64_t n;     /* generated tokens the matcher took */
} sh_sgram_seq;

/* The cache for a stage whose model has n_vocab logits, holding up to `n_seqs` sequences'
 * matchers at once. SH_OK or SH_ENOMEM. */
sh_err sh__sgram_create(const sh_llama *model, int32_t n_vocab, int32_t n_seqs, sh_sgram **out,
                        sh_error *e);
void sh__sgram_free(sh_sgram *g); /* NULL is fine; every sequence cleared first */

/* The hash by which a step names a grammar it does not carry (step_seq.gram_hash): the first 8
 * bytes of HMAC-SHA256 over the text under a fixed key, so that two grammars with one hash cannot
 * be made cheaply. Any thread. */
uint64_t sh__sgram_text_hash(sh_strv text);

/* Brings s to its sequence's grammar after n_gen generated tokens. With the text (a sequence's
 * first sampling step after an admission), gen holds those tokens: s is kept when it stands there
 * already, otherwise made anew (the grammar parsed or found in the cache) and the tokens
 * replayed. With only the grammar's hash (text empty, gen empty), s must stand there already, or
 * n_gen be 0 and the grammar be in the cache. SH_OK; SH_ENOTFOUND (only the hash came and the
 * matcher is not here: the batcher sends the text again); SH_EINVAL (a bad grammar, a generated
 * token outside it, a model without a tokenizer index); SH_ERANGE (the matcher passed its bounds
 * while replaying); SH_EBUSY, SH_ENOMEM; e names the sequence `seq` and the cause. */
sh_err sh__sgram_seq_sync(sh_sgram *g, sh_sgram_seq *s, sh_strv text, uint64_t hash, sh_i32s gen,
                          uint32_t n_gen, uint64_t seq, sh_error *e);
/* Drops s's matcher. */
void sh__sgram_seq_clear(sh_sgram *g, sh_sgram_seq *s);

/* Samples `row` (n_vocab logits) with smp under s's grammar into *out, as sh_sampler_sample does;
 * mask_first: build the mask before sampling (the top logprobs must be those of the masked row).
 * th: 0 on the worker thread, 1 on the sampling helper. Returns SH_OK; SH_ERANGE with e saying
 * which: the matcher passed its bounds (its parse stacks or states: the grammar is too ambiguous
 * for the output so far), or every token is banned (the grammar, with the logit biases and the
 * step's bans, leaves none); SH_ENOMEM. */
sh_err sh__sgram_sample(sh_sgram *g, sh_sgram_seq *s, sh_sampler *smp, const float *row, int th,
                        bool mask_first, sh_sample *out, sh_error *e);
/* Takes the sampled token tok into s (one more generated token). */
void sh__sgram_seq_accept(sh_sgram *g, sh_sgram_seq *s, int32_t tok);

#endif
