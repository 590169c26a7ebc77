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

/* Brings s to the grammar `text` after the generated tokens `gen`: kept when it is there already,
 * otherwise made anew (the grammar parsed or found in the cache) and the tokens replayed. SH_OK;
 * SH_EINVAL (a bad grammar, a generated token outside it, a model without a tokenizer index),
 * SH_ERANGE, SH_ENOMEM, with e naming the sequence `seq`. */
sh_err sh__sgram_seq_sync(sh_sgram *g, sh_sgram_seq *s, sh_strv text, sh_i32s gen, uint64_t seq,
                          sh_error *e);
/* Drops s's matcher. */
void sh__sgram_seq_clear(sh_sgram *g, sh_sgram_seq *s);

/* Samples `row` (n_vocab logits) with smp under s's grammar into *out, as sh_sampler_sample does;
 * mask_first: build the mask before sampling (the top logprobs must be those of the masked row).
 * th: 0 on the worker thread, 1 on the sampling helper. Returns sh_sampler_sample's error, or the
 * matcher's (its bounds passed). */
sh_err sh__sgram_sample(sh_sgram *g, sh_sgram_seq *s, sh_sampler *smp, const float *row, int th,
                        bool mask_first, sh_sample *out);
/* Takes the sampled token tok into s (one more generated token). */
void sh__sgram_seq_accept(sh_sgram *g, sh_sgram_seq *s, int32_t tok);

#endif
