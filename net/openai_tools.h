/* OpenAI tool calls on /v1/chat/completions: the request's tools and tool messages rendered into
 * the prompt in a model family's tool syntax, the generated text parsed back into tool calls
 * (whole, or as a stream), and the grammar that forces a call for tool_choice "required" or a
 * named function. Pure functions, no I/O; any thread. The fields they read are parsed and
 * validated by sh_openai_request_parse (net/openai.h). */
#ifndef SH_NET_OPENAI_TOOLS_H
#define SH_NET_OPENAI_TOOLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "net/openai.h"

/* A model family's tool syntax (the chat template picks it: see docs/serving.md, "Tool calls"). */
typedef enum sh_openai_tool_style {
    /* The generic form (Zephyr, Gemma, Phi-3 templates): the Hermes syntax below. */
    SH_OPENAI_TOOLS_GENERIC = 0,
    /* ChatML (Hermes 2 Pro, Qwen 2.5): the tools as JSON lines inside <tools></tools> in the
     * system message; a call is <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>;
     * tool results are user turns holding <tool_response>\n...\n</tool_response>. */
    SH_OPENAI_TOOLS_HERMES,
    /* Llama 3.1/3.2 JSON tool calling: the tools in the first user message; a call is
     * {"name": ..., "parameters": {...}}; tool results are "ipython" turns. */
    SH_OPENAI_TOOLS_LLAMA3,
    /* Mistral ([INST] templates): [AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS] before the last user
     * message; calls are [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]; results are
     * [TOOL_RESULTS] {"call_id": ..., "content": ...}[/TOOL_RESULTS]. */
    SH_OPENAI_TOOLS_MISTRAL,
} sh_openai_tool_style;

/* "generic", "hermes", "llama3", "mistral". */
const char *sh_openai_tool_style_name(sh_openai_tool_style s);

/* True when the model's output is parsed for tool calls: tools given and tool_choice not "none". */
bool sh_openai_tools_active(const sh_openai_request *r);

/* --- the prompt --- */

/* One message as the chat template renders it. */
typedef struct sh_openai_text_msg {
    const char *role; /* "system", "user", "assistant", or "ipython" (llama3 tool results) */
    const char *content;
} sh_openai_text_msg;

typedef struct sh_openai_chat_text {
    sh_openai_text_msg *msgs;
    int32_t n;
    char **owned_; /* the contents written here */
    int32_t n_owned_;
} sh_openai_chat_text;

/* r's messages with the tools (unless tool_choice is "none"), the assistants' tool_calls and the
 * tool results written in style's syntax. default_system (may be NULL) is the template's system
 * prompt, kept ahead of the tools text when the conversation has no system message. Returns
 * SH_OK (free *out with sh_openai_chat_text_fini), SH_ENOMEM. */
sh_err sh_openai_tools_render(const sh_openai_request *r, sh_openai_tool_style style,
                              const char *default_system, sh_openai_chat_text *out);

/* Frees what sh_openai_tools_render filled; a zeroed struct is fine. */
void sh_openai_chat_text_fini(sh_openai_chat_text *t);

/* --- the output --- */

/* Parses a whole generated text for tool calls in style's syntax. *calls_json gets a JSON array
 * (malloc'd) of {"id": "call_...", "type": "function", "function": {"name", "arguments"}}
 * (arguments a JSON text), or NULL when no call was found; *content the text outside the calls,
 * trimmed (malloc'd), or NULL when empty. A call that does not parse (bad JSON, no name) is left
 * in the content. Call ids are "call_" and hex digits drawn from seed and the call's index.
 * Returns SH_OK or SH_ENOMEM (both outputs NULL). */
sh_err sh_openai_tools_parse(sh_openai_tool_style style, const char *text, size_t len,
                             uint64_t seed, char **content, char **calls_json);

/* Tool calls over a stream of generated text. Hermes and generic: content streams as it comes,
 * except a possible "<tool_call>" start, held back until it is known; a call is buffered from its
 * marker to "</tool_call>" and comes out whole. Llama 3 and Mistral: an output that starts like a
 * call ("{", "[", "<|python_tag|>", "[TOOL_CALLS]" after whitespace) is buffered to the end,
 * anything else streams as content. */
typedef struct sh_openai_toolstream {
    sh_openai_tool_style style;
    uint64_t seed;
    int32_t n_calls; /* calls emitted so far */
    int mode;        /* internal */
    char *buf;       /* text not yet emitted */
    size_t len, cap;
    char *content; /* the last call's content out (owned) */
    char *deltas;  /* the last call's tool_calls delta (owned) */
} sh_openai_toolstream;

void sh_openai_toolstream_init(sh_openai_toolstream *s, sh_openai_tool_style style, uint64_t seed);
void sh_openai_toolstream_fini(sh_openai_toolstream *s);

/* Feeds the next piece (last: the generation ended, flush everything). *content is the text to
 * send as content now (NULL for none), *deltas a JSON array of tool_calls delta items as OpenAI
 * streams them ({"index", "id", "type": "function", "function": {"name", "arguments"}}, the
 * whole arguments in one item), NULL for none. Both stay valid until the next call. Returns SH_OK
 * or SH_ENOMEM. */
sh_err sh_openai_toolstream_feed(sh_openai_toolstream *s, const char *piece, size_t len, bool last,
                                 const char **content, const char **deltas);

/* --- forcing a call --- */

/* For tool_choice "required" (one call; one or more with parallel_tool_calls) or a named function
 * (one call of it): the GBNF grammar (malloc'd in *gbnf) whose sentences are exactly such calls
 * in style's syntax, each function's arguments following its parameters schema (strict). *gbnf
 * NULL when the request forces nothing. Returns SH_OK; SH_EINVAL (e filled) when a grammar
 * cannot be built (past the converter's bounds); SH_ENOMEM. */
sh_err sh_openai_tools_grammar(const sh_openai_request *r, sh_openai_tool_style style, char **gbnf,
                               sh_error *e);

/* --- for net/openai_req.c --- */

/* Checks a chat message's tool fields (msg an object, role its valid role): an assistant's
 * "tool_calls" ([{"id","type":"function","function":{"name","arguments": string}}]), a tool
 * message's "tool_call_id"; false with a 400 naming the field. */
bool sh__openai_tools_check_message(const void *msg, size_t i, const char *role,
                                    sh_openai_error *err);

/* Parses and validates "tools", "tool_choice" and "parallel_tool_calls" of a request object
 * (root, a json_t) into r; false with err filled (400 naming the field, 500 out of memory). */
bool sh__openai_tools_parse_request(const void *root, sh_openai_request *r, sh_openai_error *err);

#endif
