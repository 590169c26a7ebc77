/* The `shoal` Lua module's chat messages (api/lua/shoal_lua.c's eng:submit and eng:chat_apply):
 * {role=, content=} tables read into sh_chat_message, or, for a chat that carries tool calls and
 * tool results, written as OpenAI's messages JSON (sh_request_opts.messages_json). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

/* JSON text built in a userdata that stays at stack slot `slot` (a Lua error frees it with the
 * rest of the stack; growing replaces it there). */
typedef struct jbuf {
    int slot;
    char *p;
    size_t len, cap;
} jbuf;

static void jb_init(lua_State *L, jbuf *b)
{
    b->cap = 256;
    b->len = 0;
    b->p = (char *)lua_newuserdatauv(L, b->cap, 0);
    b->slot = lua_gettop(L);
}

static void jb_add(lua_State *L, jbuf *b, const char *s, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap;
        while (cap < b->len + n) {
            if (cap > ((size_t)64 << 20))
                luaL_error(L, "shoal: JSON text over 64 MiB");
            cap *= 2;
        }
        char *p = (char *)lua_newuserdatauv(L, cap, 0);
        memcpy(p, b->p, b->len);
        lua_replace(L, b->slot);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void jb_str(lua_State *L, jbuf *b, const char *s) { jb_add(L, b, s, strlen(s)); }

/* s[0, n) as a JSON string (quotes and escapes; UTF-8 passes as it is, checked by sh_submit). */
static void jb_json_string(lua_State *L, jbuf *b, const char *s, size_t n)
{
    jb_add(L, b, "\"", 1);
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)s[k];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            jb_add(L, b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            jb_add(L, b, esc, 6);
        } else {
            jb_add(L, b, (const char *)&s[k], 1);
        }
    }
    jb_add(L, b, "\"", 1);
}

typedef struct jkey {
    const char *s;
    size_t n;
} jkey;

static int jkey_cmp(const void *a, const void *b)
{
    const jkey *x = a, *y = b;
    int c = memcmp(x->s, y->s, x->n < y->n ? x->n : y->n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

/* The Lua value at idx as JSON (what: the option's name, for errors): a string, number, boolean,
 * or a table: a sequence 1..n (n > 0) is an array, anything else an object with string keys in
 * byte order (an empty table is {}). */
static void jb_value(lua_State *L, jbuf *b, int idx, const char *what, int depth)
{
    if (depth > 64)
        luaL_error(L, "shoal: option '%s' nests deeper than 64 tables (a cycle?)", what);
    luaL_checkstack(L, 4, "shoal: JSON nesting"); /* a key, a value, a grown buffer */
    idx = lua_absindex(L, idx);
    char num[64];
    switch (lua_type(L, idx)) {
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        jb_json_string(L, b, s, n);
        return;
    }
    case LUA_TBOOLEAN:
        jb_str(L, b, lua_toboolean(L, idx) ? "true" : "false");
        return;
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) {
            snprintf(num, sizeof num, "%lld", (long long)lua_tointeger(L, idx));
        } else {
            lua_Number v = lua_tonumber(L, idx);
            if (v != v || v - v != 0)
                luaL_error(L, "shoal: option '%s' holds a number JSON cannot hold", what);
            snprintf(num, sizeof num, "%.17g", (double)v);
        }
        jb_str(L, b, num);
        return;
    case LUA_TTABLE:
        break;
    default:
        luaL_error(L, "shoal: option '%s' holds a %s, which JSON cannot hold", what,
                   luaL_typename(L, idx));
        return;
    }
    lua_Integer n = (lua_Integer)lua_rawlen(L, idx), count = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        count++;
        lua_pop(L, 1);
    }
    if (n > 0 && count == n) {
        jb_add(L, b, "[", 1);
        for (lua_Integer i = 1; i <= n; i++) {
            if (i > 1)
                jb_add(L, b, ",", 1);
            lua_rawgeti(L, idx, i);
            jb_value(L, b, -1, what, depth + 1);
            lua_pop(L, 1);
        }
        jb_add(L, b, "]", 1);
        return;
    }
    // An object, its keys in byte order (Lua's own order changes from run to run, and the key
    // order is the rendered prompt's and a schema's property order).
    jkey *keys = (jkey *)lua_newuserdatauv(L, (size_t)(count ? count : 1) * sizeof *keys, 0);
    lua_Integer nk = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING)
            luaL_error(L,
                       "shoal: option '%s' has a table with both list items and keys, or a "
                       "key that is not a string",
                       what);
        keys[nk].s = lua_tolstring(L, -1, &keys[nk].n); /* the table holds the key */
        nk++;
    }
    qsort(keys, (size_t)nk, sizeof *keys, jkey_cmp);
    jb_add(L, b, "{", 1);
    for (lua_Integer i = 0; i < nk; i++) {
        if (i)
            jb_add(L, b, ",", 1);
        jb_json_string(L, b, keys[i].s, keys[i].n);
        jb_add(L, b, ":", 1);
        lua_pushlstring(L, keys[i].s, keys[i].n);
        lua_rawget(L, idx);
        jb_value(L, b, -1, what, depth + 1);
        lua_pop(L, 1);
    }
    lua_pop(L, 1); /* the keys */
    jb_add(L, b, "}", 1);
}

/* Pushes b's text as a string in place of its userdata and returns it. */
static const char *jb_finish(lua_State *L, jbuf *b)
{
    lua_pushlstring(L, b->p, b->len);
    lua_replace(L, b->slot);
    lua_settop(L, b->slot);
    return lua_tostring(L, b->slot);
}

void sh_lua_json_opt(lua_State *L, int req, const char *key, const char **out)
{
    luaL_checkstack(L, 4, "shoal: request options");
    int t = lua_getfield(L, req, key);
    if (t == LUA_TNIL) {
        lua_pop(L, 1);
        return;
    }
    if (t == LUA_TSTRING) {
        size_t n;
        const char *s = lua_tolstring(L, -1, &n);
        if (strlen(s) != n)
            luaL_error(L, "shoal: option '%s' holds a NUL byte", key);
        *out = s; /* stays on the stack */
        return;
    }
    if (t != LUA_TTABLE)
        luaL_error(L, "shoal: option '%s' must be a string (JSON text) or a table, not %s", key,
                   lua_typename(L, t));
    int v = lua_gettop(L);
    jbuf b;
    jb_init(L, &b);
    jb_value(L, &b, v, key, 0);
    *out = jb_finish(L, &b); /* the table and the text stay on the stack */
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
    jbuf b;
    jb_init(L, &b);
    jb_add(L, &b, "[", 1);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_rawgeti(L, mt, i);
        int m = lua_gettop(L);
        size_t rl = 0, cl = 0, il = 0;
        const char *role = field_str(L, m, "role", "", i, &rl);
        const char *content = field_str(L, m, "content", "", i, &cl);
        const char *call_id = field_str(L, m, "tool_call_id", "", i, &il);
        int tc = lua_getfield(L, m, "tool_calls");
        if (tc != LUA_TNIL && tc != LUA_TSTRING && tc != LUA_TTABLE)
            luaL_error(L, "shoal: messages[%I].tool_calls must be JSON text or a table", i);
        if (!role || (!content && tc == LUA_TNIL))
            luaL_error(L, "shoal: messages[%I] needs a string role and content (or tool_calls)", i);
        jb_str(L, &b, i > 1 ? ",{\"role\":" : "{\"role\":");
        jb_json_string(L, &b, role, rl);
        jb_str(L, &b, ",\"content\":");
        if (content)
            jb_json_string(L, &b, content, cl);
        else
            jb_str(L, &b, "null");
        if (tc == LUA_TSTRING) { /* JSON text, as done's info gave it: sh_submit parses it */
            size_t tl;
            const char *calls = lua_tolstring(L, -1, &tl);
            jb_str(L, &b, ",\"tool_calls\":");
            jb_add(L, &b, calls, tl);
        } else if (tc == LUA_TTABLE) {
            jb_str(L, &b, ",\"tool_calls\":");
            jb_value(L, &b, -1, "tool_calls", 0);
        }
        if (call_id) {
            jb_str(L, &b, ",\"tool_call_id\":");
            jb_json_string(L, &b, call_id, il);
        }
        jb_add(L, &b, "}", 1);
        lua_pop(L, 2); /* tool_calls and the message (alive in the messages table) */
    }
    jb_add(L, &b, "]", 1);
    jb_finish(L, &b);
}

void sh_lua_messages(lua_State *L, int req, sh_request_opts *r)
{
    luaL_checkstack(L, 6, "shoal: request messages");
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
