/* The `shoal` Lua module's chat messages (api/lua/shoal_lua.c's eng:submit and eng:chat_apply):
 * {role=, content=} tables read into sh_chat_message, or, for a chat that carries tool calls and
 * tool results, written as OpenAI's messages JSON (sh_request_opts.messages_json). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <lauxlib.h>
#include <lua.h>

#include "shoal.h"
#include "shoal_lua_int.h"

/* The string field key of the table at idx (NULL when nil; a string holding a NUL or another
 * type raises, naming what). The pointer stays valid while the table holds the string. */
static const char *field_str(lua_State *L, int idx, const char *key, const char *what,
                             lua_Integer i, size_t *len)
{
    int t = lua_getfield(L, idx, key);
    const char *s = NULL;
    size_t n = 0;
    if (t == LUA_TSTRING) {
        s = lua_tolstring(L, -1, &n);
        if (strlen(s) != n)
            luaL_error(L, "shoal: %smessages[%I].%s holds a NUL byte", what, i, key);
    } else if (t != LUA_TNIL) {
        luaL_error(L, "shoal: %smessages[%I].%s must be a string, not %s", what, i, key,
                   lua_typename(L, t));
    }
    lua_pop(L, 1);
    if (len)
        *len = n;
    return s;
}

/* s[0, n) as a JSON string (quotes and escapes; UTF-8 passes as it is, checked by sh_submit). */
static void add_json_string(luaL_Buffer *b, const char *s, size_t n)
{
    luaL_addchar(b, '"');
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)s[k];
        if (c == '"' || c == '\\') {
            luaL_addchar(b, '\\');
            luaL_addchar(b, (char)c);
        } else if (c < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\u%04x", c);
            luaL_addstring(b, esc);
        } else {
            luaL_addchar(b, (char)c);
        }
    }
    luaL_addchar(b, '"');
}

/* Whether message table mt carries a tool field, or is a tool's result. */
static bool has_tool_fields(lua_State *L, int mt)
{
    bool tool = lua_getfield(L, mt, "tool_calls") != LUA_TNIL;
    tool |= lua_getfield(L, mt, "tool_call_id") != LUA_TNIL;
    if (lua_getfield(L, mt, "role") == LUA_TSTRING)
        tool |= strcmp(lua_tostring(L, -1), "tool") == 0;
    lua_pop(L, 3);
    return tool;
}

/* The messages table at mt (n of them) as OpenAI's messages JSON, pushed as a string. */
static void push_messages_json(lua_State *L, int mt, lua_Integer n)
{
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    luaL_addchar(&b, '[');
    for (lua_Integer i = 1; i <= n; i++) {
        // The stack is balanced between buffer calls: each field is read and popped first.
        lua_rawgeti(L, mt, i);
        int m = lua_gettop(L);
        size_t rl = 0, cl = 0, tl = 0, il = 0;
        const char *role = field_str(L, m, "role", "", i, &rl);
        const char *content = field_str(L, m, "content", "", i, &cl);
        const char *calls = field_str(L, m, "tool_calls", "", i, &tl);
        const char *call_id = field_str(L, m, "tool_call_id", "", i, &il);
        lua_pop(L, 1); /* the message stays alive in the messages table */
        if (!role || (!content && !calls))
            luaL_error(L, "shoal: messages[%I] needs a string role and content (or tool_calls)",
                       i);
        luaL_addstring(&b, i > 1 ? ",{\"role\":" : "{\"role\":");
        add_json_string(&b, role, rl);
        luaL_addstring(&b, ",\"content\":");
        if (content)
            add_json_string(&b, content, cl);
        else
            luaL_addstring(&b, "null");
        if (calls) { /* JSON text, as done's info gave it: sh_submit parses it */
            luaL_addstring(&b, ",\"tool_calls\":");
            luaL_addlstring(&b, calls, tl);
        }
        if (call_id) {
            luaL_addstring(&b, ",\"tool_call_id\":");
            add_json_string(&b, call_id, il);
        }
        luaL_addchar(&b, '}');
    }
    luaL_addchar(&b, ']');
    luaL_pushresult(&b);
}

void sh_lua_messages(lua_State *L, int req, sh_request_opts *r)
{
    int t = lua_getfield(L, req, "messages");
    if (t == LUA_TNIL)
        return;
    if (t != LUA_TTABLE)
        luaL_error(L, "shoal: option 'messages' must be a table of {role=, content=}");
    int mt = lua_gettop(L);
    lua_Integer n = luaL_len(L, mt);
    if (n > 4096)
        luaL_error(L, "shoal: option 'messages' has more than 4096 messages");
    bool tools = false;
    for (lua_Integer i = 1; i <= n; i++) {
        if (lua_rawgeti(L, mt, i) != LUA_TTABLE)
            luaL_error(L, "shoal: messages[%I] must be a table {role=, content=}", i);
        tools |= has_tool_fields(L, lua_gettop(L));
        lua_pop(L, 1);
    }
    if (tools) {
        push_messages_json(L, mt, n);
        r->messages_json = lua_tostring(L, -1); /* the string stays on the stack */
        return;
    }
    r->messages = sh_lua_chat_messages(L, mt, n, "");
    r->n_messages = (int32_t)n;
}

sh_chat_message *sh_lua_chat_messages(lua_State *L, int mt, lua_Integer n, const char *what)
{
    sh_chat_message *msgs =
        (sh_chat_message *)lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *msgs, 0);
    for (lua_Integer i = 1; i <= n; i++) {
        if (lua_rawgeti(L, mt, i) != LUA_TTABLE)
            luaL_error(L, "shoal: %smessages[%I] must be a table {role=, content=}", what, i);
        int m = lua_gettop(L);
        msgs[i - 1].role = field_str(L, m, "role", what, i, NULL);
        msgs[i - 1].content = field_str(L, m, "content", what, i, NULL);
        if (!msgs[i - 1].role || !msgs[i - 1].content)
            luaL_error(L, "shoal: %smessages[%I] needs string role and content", what, i);
        lua_pop(L, 1); /* the message table stays alive in the messages table */
    }
    return msgs;
}
