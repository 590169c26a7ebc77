/* What the `shoal` Lua module's files share (api/lua/shoal_lua.c, shoal_lua_chat.c). */
#ifndef SH_API_LUA_SHOAL_LUA_INT_H
#define SH_API_LUA_SHOAL_LUA_INT_H

#include <lua.h>

#include "shoal.h"

/* Reads the "messages" field of the request table at req into r: {role=, content=} tables as
 * r->messages, or, when a message carries tool_calls (JSON text, as done's info gives it, or a
 * table written as JSON) or
 * tool_call_id, or has the role "tool", the whole chat as OpenAI's messages JSON in
 * r->messages_json. What r points into is left on the stack (one or two values). Raises a Lua
 * error naming the message on a wrong shape. */
void sh_lua_messages(lua_State *L, int req, sh_request_opts *r);

/* The option key of the request table at req as JSON text in *out (left alone when nil): a
 * string is taken as it is (JSON text); a table is written as JSON (a sequence 1..n is an array,
 * other tables objects with string keys, an empty table {}). What *out points at is left on the
 * stack. Raises a Lua error naming the option on a value JSON cannot hold. */
void sh_lua_json_opt(lua_State *L, int req, const char *key, const char **out);

/* The n {role=, content=} tables of the table at mt as sh_chat_message, in a userdata left on the
 * stack; what prefixes the error naming a bad message ("" or "chat_apply: "). */
sh_chat_message *sh_lua_chat_messages(lua_State *L, int mt, lua_Integer n, const char *what);

#endif
