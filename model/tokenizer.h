/* Tokenizers: SentencePiece-style ("llama") and byte-level BPE ("gpt2") vocabularies read from GGUF
 * metadata or from a llama2.c tokenizer.bin, with encode, decode and a streaming UTF-8 decoder. */
#ifndef SH_MODEL_TOKENIZER_H
#define SH_MODEL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"
#include "shoal/err.h"

/* Threading: a tokenizer is immutable once created. Every function below that takes a
 * `const sh_tokenizer *` may be called from any number of threads at once on the same tokenizer;
 * encode allocates its scratch per call. A stream decoder (sh_tokenizer_stream) belongs to one
 * thread at a time. The tokenizer must outlive its streams.
 *
 * Compatibility: the encoders reproduce llama.cpp's tokenizers (the test vectors in
 * tests/data/vocab come from it), with these documented differences:
 *  - special tokens are found leftmost-longest in one pass; llama.cpp searches the longest token
 *    text first across the whole input, which differs only when two special texts overlap;
 *  - byte-level BPE keeps invalid UTF-8 bytes as bytes (llama.cpp replaces them with U+FFFD), so
 *    decode(encode(x)) == x for any bytes x the vocabulary has characters for (many lack the bytes
 *    that never occur in UTF-8, C0, C1 and F5-FF; those are dropped, as in llama.cpp);
 *  - SPM text never merges into a CONTROL, UNKNOWN or BYTE token (typing "<s>" or "<0x41>" gives
 *    ordinary pieces), as in SentencePiece; llama.cpp allows those merges;
 *  - per-token lstrip/rstrip attributes that llama.cpp attaches by model name (phi-3) are not
 *    applied. */

typedef struct sh_tokenizer sh_tokenizer;

typedef enum sh_tokenizer_kind {
    SH_TOKENIZER_SPM = 1, /* SentencePiece-style: scores, U+2581 for spaces, <0xNN> byte fallback */
    SH_TOKENIZER_BPE = 2, /* byte-level BPE: merge ranks, GPT-2 byte map, regex pre-tokenizer */
} sh_tokenizer_kind;

/* Token types, numbered as in tokenizer.ggml.token_type. */
typedef enum sh_token_type {
    SH_TOKEN_UNDEFINED = 0,
    SH_TOKEN_NORMAL = 1,
    SH_TOKEN_UNKNOWN = 2,
    SH_TOKEN_CONTROL = 3,
    SH_TOKEN_USER_DEFINED = 4,
    SH_TOKEN_UNUSED = 5,
    SH_TOKEN_BYTE = 6,
} sh_token_type;

/* Builds a tokenizer from the metadata of an open GGUF file: tokenizer.ggml.model ("llama" or
 * "gpt2"), tokens, scores, token_type, merges, pre, the special token ids and the add_bos_token /
 * add_eos_token / add_space_prefix flags. Everything needed is copied: `g` may be closed right
 * after. An unknown tokenizer.ggml.pre is accepted and tokenizes with llama.cpp's "default" rules;
 * sh_tokenizer_pre_known() then returns false so the caller can warn.
 * Returns SH_ENOTFOUND (no tokenizer.ggml.model or tokens), SH_EUNSUPPORTED (another tokenizer
 * model), SH_EFORMAT (arrays of the wrong type or length, ids out of range, a malformed merge),
 * SH_ENOMEM; fills e and leaves *out NULL on failure. Any thread. */
sh_err sh_tokenizer_create_gguf(const sh_gguf *g, sh_tokenizer **out, sh_error *e);

/* Builds a SentencePiece-style tokenizer from a llama2.c tokenizer.bin: int32 max_token_length,
 * then per token float32 score, int32 length and that many bytes. `n_vocab` comes from the
 * checkpoint header; the file must hold at least that many tokens. Token 0 is <unk>, 1 BOS, 2 EOS
 * (their texts are normalised to "<unk>", "<s>", "</s>"), "<0xNN>" texts are byte tokens, spaces
 * in token texts are stored as U+2581 as in GGUF vocabularies. Returns SH_EIO, SH_EFORMAT,
 * SH_EINVAL (n_vocab < 3) or SH_ENOMEM; fills e and leaves *out NULL on failure. Any thread. */
sh_err sh_tokenizer_create_llama2c(const char *path, int32_t n_vocab, sh_tokenizer **out,
                                   sh_error *e);

/* Frees the tokenizer; accepts NULL. No stream may still use it. */
void sh_tokenizer_destroy(sh_tokenizer *t);

sh_tokenizer_kind sh_tokenizer_get_kind(const sh_tokenizer *t);
/* The pre-tokenizer name from tokenizer.ggml.pre ("default" when absent; "llama2c" for a
 * tokenizer.bin). The string lives as long as the tokenizer. */
const char *sh_tokenizer_pre(const sh_tokenizer *t);
/* False when tokenizer.ggml.pre named a pre-tokenizer we do not know (the default was used). */
bool sh_tokenizer_pre_known(const sh_tokenizer *t);
int32_t sh_tokenizer_n_vocab(const sh_tokenizer *t);

/* Special token ids, or -1 when the vocabulary has none. EOT comes from tokenizer.ggml.eot_token_id
 * or, when absent, from a token with a well-known end-of-turn text (<|eot_id|>, <|im_end|>,
 * <|end|>, <end_of_turn>, <|endoftext|>, <EOT>). */
int32_t sh_tokenizer_bos(const sh_tokenizer *t);
int32_t sh_tokenizer_eos(const sh_tokenizer *t);
int32_t sh_tokenizer_eot(const sh_tokenizer *t);
int32_t sh_tokenizer_unk(const sh_tokenizer *t);
/* True when id ends generation: EOS, EOT or EOM (tokenizer.ggml.eom_token_id). */
bool sh_tokenizer_is_eog(const sh_tokenizer *t, int32_t id);
/* Whether the vocabulary asks for a BOS (tokenizer.ggml.add_bos_token; default true for SPM and
 * false for BPE) and an EOS (add_eos_token, default false) around a prompt. */
bool sh_tokenizer_wants_bos(const sh_tokenizer *t);
bool sh_tokenizer_wants_eos(const sh_tokenizer *t);

/* The vocabulary text of a token as stored (U+2581 for spaces in SPM, the GPT-2 byte map in BPE),
 * NUL-terminated, with its length in *len when len is not NULL; owned by the tokenizer. NULL (and
 * *len = 0) when id is out of range. */
const char *sh_tokenizer_token_text(const sh_tokenizer *t, int32_t id, size_t *len);
/* The type of a token; SH_TOKEN_UNDEFINED when id is out of range. */
sh_token_type sh_tokenizer_token_type(const sh_tokenizer *t, int32_t id);
/* CONTROL or UNKNOWN: never produced from plain text, rendered only with SH_DECODE_SPECIAL. */
bool sh_tokenizer_is_control(const sh_tokenizer *t, int32_t id);
/* CONTROL, UNKNOWN or USER_DEFINED: the tokens matched as whole texts before the model's own
 * algorithm runs (see SH_TOKENIZE_PARSE_SPECIAL). */
bool sh_tokenizer_is_special(const sh_tokenizer *t, int32_t id);
/* The id whose vocabulary text is exactly text[0, len), or -1. */
int32_t sh_tokenizer_find(const sh_tokenizer *t, const char *text, size_t len);

/* Encode flags. */
enum {
    /* Prepend the BOS token (SH_EINVAL when the vocabulary has none). Callers that follow the
     * model's wishes set it when sh_tokenizer_wants_bos() is true. */
    SH_TOKENIZE_ADD_BOS = 1u << 0,
    /* Recognise CONTROL and UNKNOWN token texts (BOS, EOS, <|im_start|>, ...) in the input as
     * single tokens. Without it they are tokenized as plain text, so user input cannot inject
     * them. USER_DEFINED tokens (added tokens that are part of ordinary text, e.g. MPT's runs of
     * spaces) are recognised in both modes, as llama.cpp and Hugging Face tokenizers do. */
    SH_TOKENIZE_PARSE_SPECIAL = 1u << 1,
};

/* Encodes text[0, len) (any bytes; NUL is an ordinary byte) into token ids. On success writes the
 * ids to ids[0, *n_ids) and returns SH_OK. When cap is too small (ids may be NULL with cap 0)
 * returns SH_ERANGE with *n_ids set to the number needed and ids[0, cap) unspecified, so a caller
 * can retry. SPM vocabularies prefix a space (U+2581) to the text and to each text fragment that
 * follows a special token when add_space_prefix is on (the default). Other errors: SH_EINVAL (text
 * NULL with len > 0, ADD_BOS without a BOS, len above 512 MiB), SH_ENOMEM, SH_ERANGE from the
 * regex engine's limits; e is filled. Scratch is allocated per call; any thread. */
sh_err sh_tokenizer_encode(const sh_tokenizer *t, const char *text, size_t len, uint32_t flags,
                           int32_t *ids, size_t cap, size_t *n_ids, sh_error *e);

/* A byte range [off, off + len) of an encode input. */
typedef struct sh_tokenizer_span {
    size_t off, len;
} sh_tokenizer_span;

/* Options of sh_tokenizer_encode_opts; zero-initialise (all off). */
typedef struct sh_tokenize_opts {
    uint32_t flags; /* SH_TOKENIZE_* */
    /* With SH_TOKENIZE_PARSE_SPECIAL and n_special > 0: CONTROL and UNKNOWN texts are recognised
     * only where they lie wholly inside one of these ranges (sorted by offset, not overlapping,
     * inside the text); everywhere else the text is plain, as without the flag. A chat template's
     * own markers are special, the message contents between them are not (model/chat.h). The
     * fragments between special tokens are encoded exactly as by sh_tokenizer_encode, so a text
     * with no special text outside the ranges encodes to the same ids as with the flag alone. */
    const sh_tokenizer_span *special;
    size_t n_special;
    /* > 0: the caller wants at most this many ids (BOS included) and encoding stops as soon as
     * the text is known to need more: right away when its byte length alone needs more (no token
     * covers more input bytes than the longest vocabulary text, or 4, has; bytes a vocabulary
     * drops, see the compatibility notes, are counted as if they made tokens), else when the
     * count passes the limit. */
    size_t max_ids;
} sh_tokenize_opts;

/* Encodes text[0, len) like sh_tokenizer_encode with the options above (o NULL: none) into a
 * malloc'd array the caller frees: *ids (room for one more id than *n_ids; never NULL on
 * success, even for 0 ids). Returns SH_OK; SH_ERANGE with *n_ids = o->max_ids + 1 and *ids NULL
 * when the text needs more than o->max_ids ids (a lower bound: the exact count is not known);
 * SH_EINVAL (as sh_tokenizer_encode, or spans out of order or outside the text), SH_ENOMEM,
 * SH_ERANGE from the regex engine's limits (*n_ids 0); *ids NULL and e filled on failure. Any
 * thread. */
sh_err sh_tokenizer_encode_opts(const sh_tokenizer *t, const char *text, size_t len,
                                const sh_tokenize_opts *o, int32_t **ids, size_t *n_ids,
                                sh_error *e);

/* Decode flags. */
enum {
    /* Render CONTROL and UNKNOWN tokens as their vocabulary text (e.g. "<|im_end|>"); without it
     * they produce no bytes. */
    SH_DECODE_SPECIAL = 1u << 0,
    /* SPM with add_space_prefix only: drop one leading space from the first piece that is not
     * BOS, undoing the space the encoder prefixed (SentencePiece's rule; llama.cpp's older
     * detokenizer did the same). With it, decode(encode(x)) == x for SPM as for BPE. Use it when
     * decoding a whole prompt, not for a continuation. */
    SH_DECODE_STRIP_SPACE = 1u << 1,
};

/* The bytes one token decodes to: U+2581 turned back into spaces and <0xNN> into its byte (SPM),
 * the GPT-2 byte map reversed (BPE), USER_DEFINED texts as they are, CONTROL/UNKNOWN texts only
 * with SH_DECODE_SPECIAL, UNUSED/UNDEFINED nothing. Sets *piece to bytes owned by the tokenizer
 * (not NUL-terminated; may be NULL when the length is 0) and returns the length; returns 0 with
 * *piece NULL when id is out of range. */
size_t sh_tokenizer_piece(const sh_tokenizer *t, int32_t id, uint32_t flags, const char **piece);
/* The longest piece any token decodes to (with SH_DECODE_SPECIAL). */
size_t sh_tokenizer_max_piece(const sh_tokenizer *t);

/* Decodes ids[0, n) into buf: the concatenated pieces, raw bytes (not validated as UTF-8).
 * On success writes *len bytes plus a NUL when there is room for it (cap > *len) and returns
 * SH_OK; when cap is too small returns SH_ERANGE with *len set to the bytes needed (without the
 * NUL). SH_EINVAL (e filled) for an id out of range. Any thread. */
sh_err sh_tokenizer_decode(const sh_tokenizer *t, const int32_t *ids, size_t n, uint32_t flags,
                           char *buf, size_t cap, size_t *len, sh_error *e);

/* A streaming decoder: fed one token at a time, it returns only whole UTF-8 characters, holding
 * back the bytes of a character split across tokens until it completes. Bytes that cannot start
 * or continue a valid UTF-8 sequence (overlong forms, surrogates, > U+10FFFF, a sequence cut by
 * another start byte) come out as U+FFFD, one per maximal invalid subpart, as the Unicode standard
 * recommends; the output is therefore always valid UTF-8 and equals the concatenated pieces when
 * those are valid. */
typedef struct sh_tokenizer_stream sh_tokenizer_stream;

/* Creates a stream over t with decode flags (SH_DECODE_*; STRIP_SPACE applies to the first
 * non-BOS token fed after creation or reset). Its output buffer is sized once here, so feeding
 * never allocates. Returns SH_ENOMEM or SH_EINVAL (t NULL); *out NULL on failure. */
sh_err sh_tokenizer_stream_create(const sh_tokenizer *t, uint32_t flags, sh_tokenizer_stream **out,
                                  sh_error *e);
/* Frees the stream; accepts NULL. */
void sh_tokenizer_stream_destroy(sh_tokenizer_stream *s);
/* Feeds one token. Sets *text and *len to the newly completed text (possibly empty), which the
 * stream owns and which stays valid until the next call on this stream. SH_EINVAL for an id out of
 * range (the stream is unchanged). */
sh_err sh_tokenizer_stream_feed(sh_tokenizer_stream *s, int32_t id, const char **text, size_t *len);
/* Ends the text: any held-back incomplete character comes out as U+FFFD. The stream is then as
 * after reset. Same output convention as feed. */
void sh_tokenizer_stream_flush(sh_tokenizer_stream *s, const char **text, size_t *len);
/* Drops held-back bytes and restarts the STRIP_SPACE rule. */
void sh_tokenizer_stream_reset(sh_tokenizer_stream *s);

#endif
