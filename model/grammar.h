/* Constrained decoding: GBNF grammars (llama.cpp's dialect), a pushdown matcher over UTF-8 and
 * a per-step mask of the vocabulary's tokens that keep the output inside the grammar.
 *
 * The dialect: rules `name ::= alternatives` (names of letters, digits, '-' and '_'), one rule
 * per line (newlines are allowed after `::=`, after `|` and inside parentheses), `|`,
 * sequences, string literals "..." and character classes [a-z0-9_] / [^"\\] with the escapes
 * \n \r \t \\ \" \[ \] \- \^ \xHH \uHHHH \UHHHHHHHH, `.` (any character), groups ( ),
 * repetition * + ? {m} {m,} {m,n}, comments from '#' to the end of the line, rule references,
 * and `root` as the start rule.
 *
 * Bounds (a hostile grammar is refused, never run out of time or memory): the text at most
 * SH_GRAMMAR_MAX_TEXT bytes, SH_GRAMMAR_MAX_RULES rules (the ones generated for groups and
 * repetitions included), SH_GRAMMAR_MAX_ELEMENTS elements after repetitions are expanded,
 * parentheses nested SH_GRAMMAR_MAX_DEPTH deep, repetition counts up to SH_GRAMMAR_MAX_REPEAT.
 * A matcher keeps at most SH_GRAMMAR_MAX_STACKS parse stacks at once and bounded caches; past
 * that it fails (sh_gmatch_error says why) rather than growing. */
#ifndef SH_MODEL_GRAMMAR_H
#define SH_MODEL_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

#define SH_GRAMMAR_MAX_TEXT (1u << 20)
#define SH_GRAMMAR_MAX_RULES 65536
#define SH_GRAMMAR_MAX_ELEMENTS (1u << 20)
#define SH_GRAMMAR_MAX_DEPTH 100
#define SH_GRAMMAR_MAX_REPEAT 10000
#define SH_GRAMMAR_MAX_STACKS 16384

typedef struct sh_grammar sh_grammar; /* immutable after parse; shareable across threads */

/* Parses GBNF text (len bytes, need not be NUL-terminated); the start rule is "root". On success
 * sets *out (free with sh_grammar_free) and returns SH_OK. Errors, each with *out NULL and e
 * filled: SH_EINVAL for a syntax error ("line L, column C: what"), an undefined rule (the line
 * and column of its first use), a rule defined twice, a missing root, a left-recursive rule
 * (`a ::= a "x" | ...`, which a top-down matcher cannot run) or a root whose language is empty
 * (no finite sentence: `root ::= root2 "a"` with `root2 ::= "b" root2`); SH_ERANGE when a bound
 * above is passed; SH_ENOMEM. Any thread. */
sh_err sh_grammar_parse(const char *text, size_t len, sh_grammar **out, sh_error *e);
/* Frees g (NULL is fine). No matcher of g may be used afterwards. */
void sh_grammar_free(sh_grammar *g);
/* The number of rules, generated ones included (for tests and logs). */
int32_t sh_grammar_n_rules(const sh_grammar *g);

typedef struct sh_gmatch sh_gmatch; /* one sequence's position in the grammar; one thread at a
                                       time */

/* A matcher at the start of g (g must outlive it). SH_OK; SH_ERANGE (the start state alone
 * passes the bounds) or SH_ENOMEM with *out NULL and e filled. */
sh_err sh_gmatch_create(const sh_grammar *g, sh_gmatch **out, sh_error *e);
/* An independent copy of m at the same position (caches included). SH_OK or SH_ENOMEM. */
sh_err sh_gmatch_clone(const sh_gmatch *m, sh_gmatch **out, sh_error *e);
/* Frees m (NULL is fine). */
void sh_gmatch_free(sh_gmatch *m);
/* Advances over bytes (UTF-8; a partial code point at the end is kept pending and completed by
 * the next call). Returns true and advances when the grammar allows all of them; false and m
 * unchanged when it does not (or when m has failed: see sh_gmatch_error). */
bool sh_gmatch_accept_bytes(sh_gmatch *m, const char *bytes, size_t n);
/* True when the input so far is a full sentence of the grammar (no partial code point pending). */
bool sh_gmatch_can_end(const sh_gmatch *m);
/* SH_OK, or the error that made m fail for good: SH_ERANGE when the grammar's states passed the
 * bounds (too many simultaneous parse stacks), SH_ENOMEM; e filled with what happened. A failed
 * matcher accepts nothing and its mask is an error. */
sh_err sh_gmatch_error(const sh_gmatch *m, sh_error *e);

/* The vocabulary as the grammar sees it: each token's raw bytes (as the model emits them, e.g.
 * byte-level BPE already mapped back to bytes), indexed in a trie. Built once per model,
 * immutable, shareable across threads. */
typedef struct sh_gvocab sh_gvocab;

/* Builds the index of n tokens: bytes[i] / lens[i] are token i's raw bytes; special[i] (NULL:
 * none) marks control tokens, which are never allowed by a mask, except the end tokens
 * eos[0, n_eos) (ids in [0, n)), allowed exactly when the matcher can end. Tokens with no bytes
 * are never allowed. Copies what it needs. SH_OK; SH_EINVAL (n <= 0, an id out of range),
 * SH_ENOMEM; *out NULL and e filled on failure. */
sh_err sh_gvocab_create(const char *const *bytes, const size_t *lens, int32_t n,
                        const bool *special, const int32_t *eos, int32_t n_eos, sh_gvocab **out,
                        sh_error *e);
/* The same from a tokenizer: each token's bytes as sh_tokenizer_piece() gives them without
 * SH_DECODE_SPECIAL (byte-level BPE mapped back to raw bytes, SPM's U+2581 to spaces and <0xNN>
 * to bytes), CONTROL and UNKNOWN tokens left out, and every end-of-generation token (EOS, EOT,
 * EOM) as an end token. Same returns. */
struct sh_tokenizer;
sh_err sh_gvocab_create_tokenizer(const struct sh_tokenizer *t, sh_gvocab **out, sh_error *e);
void sh_gvocab_free(sh_gvocab *v); /* NULL is fine */
int32_t sh_gvocab_n_vocab(const sh_gvocab *v);

/* Whether token tok may come next: its bytes are accepted from m's position, or it is an end
 * token and m can end. The fast path: check the sampled token before building a mask. */
bool sh_gmatch_token_ok(sh_gmatch *m, const sh_gvocab *v, int32_t tok);
/* Writes the allowed tokens as bits (bit i of bits[i / 64] for token i; n_vocab bits rounded up
 * to whole words, all written). SH_OK; the matcher's error when it has failed or fails now (a
 * bound passed). Takes m non-const because its caches grow, though its position does not move.
 * The mask can be all zeros only where the grammar has ended and the vocabulary has no end
 * token, or no token continues a pending partial code point. Cost: one walk over the
 * vocabulary's trie (most of it skipped inside strings), cached per automaton state. */
sh_err sh_gmatch_mask(sh_gmatch *m, const sh_gvocab *v, uint64_t *bits);
/* Advances over token tok: true when it was allowed (an end token: true exactly when m can end,
 * and m stays where it is: generation stops there), false with m unchanged otherwise. */
bool sh_gmatch_accept_token(sh_gmatch *m, const sh_gvocab *v, int32_t tok);

#endif
