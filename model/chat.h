/* Chat templates: the prompt formats of the model families we load (ChatML, Llama 2, Llama 3,
 * Zephyr, Gemma, Phi-3), picked from the GGUF's tokenizer.chat_template text. */
#ifndef SH_MODEL_CHAT_H
#define SH_MODEL_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "model/tokenizer.h"
#include "shoal/err.h"

typedef enum sh_chat_template {
    SH_CHAT_CHATML = 1, /* <|im_start|>role\ncontent<|im_end|>\n (SmolLM, Qwen); the default */
    SH_CHAT_LLAMA2,     /* [INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s><s>[INST] */
    SH_CHAT_LLAMA3,     /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    SH_CHAT_ZEPHYR,     /* <|role|>\ncontent</s>\n (TinyLlama chat) */
    SH_CHAT_GEMMA,      /* <start_of_turn>user\ncontent<end_of_turn>\n, the assistant's role named
                           "model"; a system prompt opens the first turn, followed by a blank
                           line (Gemma has no system role) */
    SH_CHAT_PHI3,       /* <|role|>\ncontent<|end|>\n (Phi-3) */
} sh_chat_template;

typedef struct sh_chat_msg {
    const char *role; /* "system", "user" or "assistant" */
    const char *content;
} sh_chat_msg;

/* Picks the template whose marker tokens appear in a Jinja chat template text (tmpl may be NULL
 * or empty: ChatML, as llama.cpp does for models without one). Never fails. */
sh_chat_template sh_chat_detect(const char *tmpl, size_t len);

/* The template for a model: its file's template text when it has one (sh_chat_detect), else the
 * native format of its architecture (`arch` from general.architecture; gemma3: Gemma's turns),
 * else ChatML. Never fails. */
sh_chat_template sh_chat_for_model(const char *tmpl, size_t len, const char *arch);

/* "chatml", "llama2", "llama3", "zephyr", "gemma", "phi3". */
const char *sh_chat_name(sh_chat_template t);

/* Copies into buf the default system prompt a template inserts when the conversation has none
 * (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."): the text between
 * "<|im_start|>system" + newline and "<|im_end|>" inside the template, with "\n" escapes turned
 * into newlines. Returns false (buf[0] = 0 when cap > 0) when there is none or it does not fit. */
bool sh_chat_default_system(const char *tmpl, size_t len, char *buf, size_t cap);

/* Renders messages as the model's prompt text. `default_system` (may be NULL) is used when the
 * first message is not a system message. With add_assistant the text ends with the opening of an
 * assistant turn, ready for generation. The text holds special-token texts (<|im_start|>, </s>,
 * ...); it never starts with a BOS text: the caller adds BOS when the tokenizer wants it. Message
 * contents may hold the same texts, so tokenize it with sh_chat_tokenize (or with the spans of
 * sh_chat_render_spans), never with SH_TOKENIZE_PARSE_SPECIAL over the whole text, or a user can
 * end their turn and forge another role's. On success writes *len bytes plus a NUL to buf and
 * returns SH_OK; when cap is too small returns SH_ERANGE with *len the bytes needed (without the
 * NUL). SH_EINVAL (e filled) for a NULL role or content or an unknown template. Pure function;
 * any thread. */
sh_err sh_chat_render(sh_chat_template t, const sh_chat_msg *msgs, size_t n,
                      const char *default_system, bool add_assistant, char *buf, size_t cap,
                      size_t *len, sh_error *e);

/* sh_chat_render that also lists where the template's own text lies in buf: its markers, role
 * names and separators, as sorted, disjoint byte ranges (adjacent pieces merged). Message contents
 * and the system prompt lie outside every range. These are the ranges in which special tokens may
 * be recognised (sh_tokenize_opts.special). spans may be NULL with span_cap 0. SH_ERANGE when buf
 * or spans is too small, with *len and *n_spans the sizes needed; otherwise as sh_chat_render. */
sh_err sh_chat_render_spans(sh_chat_template t, const sh_chat_msg *msgs, size_t n,
                            const char *default_system, bool add_assistant, char *buf, size_t cap,
                            size_t *len, sh_tokenizer_span *spans, size_t span_cap, size_t *n_spans,
                            sh_error *e);

/* Renders messages (as sh_chat_render) and tokenizes the text so that only the template's own
 * markers become special tokens: every content is plain text, whatever it holds. Adds BOS when
 * the tokenizer wants it. max_ids as in sh_tokenize_opts (0: no limit). *ids is malloc'd (room
 * for one more id), the caller frees it. Returns SH_OK; SH_ERANGE with *n_ids = max_ids + 1 when
 * the prompt needs more than max_ids ids; SH_EINVAL, SH_ENOMEM (e filled; *ids NULL). Any
 * thread. */
sh_err sh_chat_tokenize(const sh_tokenizer *tok, sh_chat_template t, const sh_chat_msg *msgs,
                        size_t n, const char *default_system, bool add_assistant, size_t max_ids,
                        int32_t **ids, size_t *n_ids, sh_error *e);

#endif
