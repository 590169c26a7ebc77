/* OpenAI's Responses API (POST /v1/responses), stateless: a request's input items, instructions,
 * function tools and text.format turned into the request /v1/chat/completions takes (so one path
 * renders the chat template and the tools and builds the grammar), and the response object and
 * its typed stream events written back. Pure functions, no I/O; any thread. */
#ifndef SH_NET_OPENAI_RESPONSES_H
#define SH_NET_OPENAI_RESPONSES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "net/openai.h"
#include "net/strbuf.h"

/* --- the request --- */

/* Parses and validates the body of POST /v1/responses into the chat request it amounts to (kind
 * SH_OPENAI_CHAT, n 1; limits as sh_openai_request_parse takes them, NULL for the defaults):
 * - "input": a string (one user message) or a list of items: messages (role user, system,
 *   developer or assistant; content a string or a list of input_text / output_text parts),
 *   function_call items (an assistant's tool call) and function_call_output items (its result,
 *   a tool message); "instructions" is a system message ahead of them;
 * - "tools": function tools in the Responses form ({"type": "function", "name", "description",
 *   "parameters", "strict"}); "tool_choice": "auto", "none", "required" or {"type": "function",
 *   "name"}; "parallel_tool_calls";
 * - "text": {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema",
 *   "strict"}} as response_format is on chat; "max_output_tokens" as max_completion_tokens;
 * - "temperature", "top_p", "stream", "user", "metadata" (at most 16 string pairs), and the
 *   sampling extensions chat takes (seed, top_k, min_p, stop, grammar, ...).
 * Refused with a 400 naming the field: what needs stored state (previous_response_id,
 * conversation, store true, background true), built-in tools (web_search, file_search, ...),
 * non-text inputs, include, prompt, reasoning, truncation "auto", top_logprobs above 0, and
 * chat's own names (messages, max_tokens, response_format, n above 1, ...). service_tier,
 * prompt_cache_key, safety_identifier, max_tool_calls and stream_options change nothing and are
 * accepted. The request's resp_echo holds what the response object repeats (instructions,
 * max_output_tokens, metadata, parallel_tool_calls, temperature, text, tool_choice, tools,
 * top_p, user). Errors as sh_openai_request_parse's, with param naming the Responses field
 * ("input[2].call_id", "text.format.schema", "tools[0].parameters", "max_output_tokens"). */
sh_err sh_openai_responses_parse(const char *body, size_t len, const sh_openai_limits *limits,
                                 sh_openai_request **out, sh_openai_error *err);

/* --- the response --- */

/* A response object being built: its output items (one message of output_text, then the
 * function calls) and, when streamed, the events that tell them. Each call that writes events
 * leaves them in ev (replacing the previous call's): "event: <type>\ndata: <json>\n\n" each,
 * with sequence_number counting from 0. */
typedef struct sh_openai_resp {
    char id[64]; /* "resp_..." */
    int64_t created_at;
    char model[128];
    void *echo_;     /* json_t object: the request fields repeated */
    void *output_;   /* json_t array: the items closed so far */
    int64_t seq;     /* the next sequence_number */
    sh_strbuf text;  /* the open message's text */
    bool msg_open;   /* a message item was added and not closed */
    int32_t n_calls; /* function_call items so far */
    char cut[4];     /* the start of a UTF-8 character a piece ended inside, held back */
    size_t n_cut;
    sh_strbuf ev; /* the last call's events */
} sh_openai_resp;

/* Starts a response: id (copied, "resp_..."), its creation time, the model's name and echo (the
 * request's resp_echo; NULL: an empty object). Returns SH_OK, or SH_ENOMEM (s left zeroed);
 * s is finished with sh_openai_resp_fini either way. */
sh_err sh_openai_resp_init(sh_openai_resp *s, const char *id, int64_t created_at, const char *model,
                           const char *echo);
/* Frees s's memory; a zeroed s is fine. */
void sh_openai_resp_fini(sh_openai_resp *s);

/* Each of these returns the events it wrote (in s->ev, valid until the next call on s; "" for
 * none), or NULL when out of memory (the response is then incomplete). */

/* response.created and response.in_progress (status "in_progress", no output yet). */
const char *sh_openai_resp_start(sh_openai_resp *s);
/* Generated text [t, t + n): the message item and its output_text part are opened on the first
 * text (output_item.added, content_part.added), then one response.output_text.delta. Bytes of a
 * UTF-8 character cut at the end of t wait for the next piece. An empty piece writes nothing. */
const char *sh_openai_resp_text(sh_openai_resp *s, const char *t, size_t n);
/* Function calls: calls_json is a JSON array of chat tool calls (net/openai_tools.h's whole
 * "tool_calls" or its stream deltas: {"id", "function": {"name", "arguments"}}). The open
 * message is closed first; each call is then an output item of type function_call (call_id the
 * call's id) told by output_item.added, function_call_arguments.delta and .done and
 * output_item.done. NULL calls_json writes nothing. */
const char *sh_openai_resp_calls(sh_openai_resp *s, const char *calls_json);
/* The end: the open message closed (output_text.done, content_part.done, output_item.done), then
 * response.completed, or response.incomplete (status "incomplete", incomplete_details.reason
 * "max_output_tokens" for SH_OPENAI_FINISH_LENGTH, "timeout" for SH_OPENAI_FINISH_TIMEOUT),
 * carrying the whole response with usage. */
const char *sh_openai_resp_end(sh_openai_resp *s, sh_openai_finish finish,
                               const sh_openai_usage *usage);
/* A failure mid-stream: an error event ({"type": "error", "code", "message", "param"}) and
 * response.failed (status "failed", error {"code": "server_error" or "rate_limit_exceeded",
 * "message"}). */
const char *sh_openai_resp_fail(sh_openai_resp *s, const sh_openai_error *e);

/* The whole response object (not streamed: feed the text and calls first, their events
 * unused), as sh_openai_resp_end's final event carries it; malloc'd, NULL when out of memory. */
char *sh_openai_resp_json(sh_openai_resp *s, sh_openai_finish finish, const sh_openai_usage *usage);

#endif
