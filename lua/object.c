/* Validation of script tables (known keys, types, ranges, lists) and the read-only tagged objects
 * that constructors such as node{} return. Raw access only, so no script metamethod runs here. */
#include <lauxlib.h>
#include <stdio.h>
#include <string.h>

#include "lua/sandbox.h"

/* Addresses used as registry-free keys in an object's metatable. Scripts cannot make light
 * userdata, so they can neither read nor forge these entries. Constant: no shared state. */
static const char kind_key = 'k', where_key = 'w', payload_key = 'p';

static const char *const type_names[] = {
    [SH__LUA_STR] = "a string",   [SH__LUA_INT] = "an integer", [SH__LUA_NUM] = "a number",
    [SH__LUA_BOOL] = "a boolean", [SH__LUA_TABLE] = "a table",  [SH__LUA_ANY] = "any value",
};

static bool type_ok(lua_State *L, int idx, int type)
{
    int isnum = 0;
    switch (type) {
    case SH__LUA_STR:
        return lua_type(L, idx) == LUA_TSTRING;
    case SH__LUA_INT:
        if (lua_type(L, idx) != LUA_TNUMBER)
            return false;
        lua_tointegerx(L, idx, &isnum);
        return isnum != 0;
    case SH__LUA_NUM:
        return lua_type(L, idx) == LUA_TNUMBER;
    case SH__LUA_BOOL:
        return lua_type(L, idx) == LUA_TBOOLEAN;
    case SH__LUA_TABLE:
        return lua_type(L, idx) == LUA_TTABLE;
    default:
        return true;
    }
}

/* A value's type for messages; numbers say whether they are integers. */
static const char *value_kind(lua_State *L, int idx)
{
    if (lua_type(L, idx) == LUA_TNUMBER)
        return lua_isinteger(L, idx) ? "an integer" : "a float";
    return luaL_typename(L, idx);
}

void sh__lua_check_fields(lua_State *L, int idx, const sh__lua_field *fields, const char *what,
                          const char *where)
{
    idx = lua_absindex(L, idx);
    if (lua_type(L, idx) != LUA_TTABLE)
        sh__lua_fail(L, SH_EINVAL, where, "%s: expected a table, got %s", what, value_kind(L, idx));
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (lua_type(L, -2) != LUA_TSTRING)
            sh__lua_fail(L, SH_EINVAL, where, "%s: unexpected %s key (fields have names)", what,
                         value_kind(L, -2));
        const char *k = lua_tostring(L, -2);
        const sh__lua_field *f = fields;
        while (f->name && strcmp(f->name, k) != 0)
            f++;
        if (!f->name) {
            char known[160] = "";
            for (const sh__lua_field *g = fields; g->name; g++) {
                size_t used = strlen(known);
                snprintf(known + used, sizeof known - used, "%s%s", used ? ", " : "", g->name);
            }
            sh__lua_fail(L, SH_EINVAL, where, "%s: unknown key '%.40s' (known: %s)", what, k,
                         known);
        }
        if (!type_ok(L, -1, f->type))
            sh__lua_fail(L, SH_EINVAL, where, "%s: field '%s' must be %s, got %s", what, f->name,
                         type_names[f->type], value_kind(L, -1));
        lua_pop(L, 1);
    }
    for (const sh__lua_field *f = fields; f->name; f++) {
        if (!f->required)
            continue;
        lua_pushstring(L, f->name);
        if (lua_rawget(L, idx) == LUA_TNIL)
            sh__lua_fail(L, SH_EINVAL, where, "%s: missing required field '%s'", what, f->name);
        lua_pop(L, 1);
    }
}

int32_t sh__lua_check_list(lua_State *L, int idx, const char *what, int32_t max, const char *where)
{
    idx = lua_absindex(L, idx);
    if (lua_type(L, idx) != LUA_TTABLE)
        sh__lua_fail(L, SH_EINVAL, where, "%s must be a list, got %s", what, value_kind(L, idx));
    lua_Unsigned n = lua_rawlen(L, idx), count = 0;
    if (n > (lua_Unsigned)max)
        sh__lua_fail(L, SH_EINVAL, where, "%s has more than %d items", what, (int)max);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        int isint = 0;
        lua_Integer k = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
        if (!isint || k < 1 || (lua_Unsigned)k > n)
            sh__lua_fail(L, SH_EINVAL, where, "%s must be a list (items 1..n only)", what);
        count++;
    }
    if (count != n)
        sh__lua_fail(L, SH_EINVAL, where, "%s must be a list without holes", what);
    return (int32_t)n;
}

static int get_raw(lua_State *L, int idx, const char *key)
{
    idx = lua_absindex(L, idx);
    if (lua_type(L, idx) != LUA_TTABLE) {
        lua_pushnil(L); /* an absent optional table: every field takes its default */
        return LUA_TNIL;
    }
    lua_pushstring(L, key);
    return lua_rawget(L, idx);
}

const char *sh__lua_get_str(lua_State *L, int idx, const char *key)
{
    /* The table keeps the string alive after the pop. */
    const char *s = get_raw(L, idx, key) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    lua_pop(L, 1);
    return s;
}

int64_t sh__lua_get_int(lua_State *L, int idx, const char *key, int64_t def)
{
    int isnum = 0;
    lua_Integer v = get_raw(L, idx, key) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isnum) : 0;
    lua_pop(L, 1);
    return isnum ? (int64_t)v : def;
}

double sh__lua_get_num(lua_State *L, int idx, const char *key, double def)
{
    double v = get_raw(L, idx, key) == LUA_TNUMBER ? (double)lua_tonumber(L, -1) : def;
    lua_pop(L, 1);
    return v;
}

bool sh__lua_get_bool(lua_State *L, int idx, const char *key, bool def)
{
    bool v = get_raw(L, idx, key) == LUA_TBOOLEAN ? lua_toboolean(L, -1) != 0 : def;
    lua_pop(L, 1);
    return v;
}

int64_t sh__lua_get_int_range(lua_State *L, int idx, const char *key, int64_t def, int64_t lo,
                              int64_t hi, const char *what, const char *where)
{
    int64_t v = sh__lua_get_int(L, idx, key, def);
    if (v < lo || v > hi)
        sh__lua_fail(L, SH_EINVAL, where, "%s: field '%s' must be within %lld..%lld, got %lld",
                     what, key, (long long)lo, (long long)hi, (long long)v);
    return v;
}

static int obj_readonly(lua_State *L)
{
    return luaL_error(L, "objects made by constructors are read-only");
}

void sh__lua_obj_new(lua_State *L, int kind, const char *where, int64_t payload)
{
    int data = lua_gettop(L);
    lua_createtable(L, 0, 0);
    lua_createtable(L, 0, 6);
    lua_pushvalue(L, data);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, obj_readonly);
    lua_setfield(L, -2, "__newindex");
    lua_pushliteral(L, "locked");
    lua_setfield(L, -2, "__metatable");
    lua_pushinteger(L, kind);
    lua_rawsetp(L, -2, &kind_key);
    lua_pushstring(L, where);
    lua_rawsetp(L, -2, &where_key);
    lua_pushinteger(L, (lua_Integer)payload);
    lua_rawsetp(L, -2, &payload_key);
    lua_setmetatable(L, -2);
    lua_replace(L, data);
}

int sh__lua_obj_get(lua_State *L, int idx, char *where, size_t n, int64_t *payload)
{
    idx = lua_absindex(L, idx);
    if (lua_type(L, idx) != LUA_TTABLE || !lua_getmetatable(L, idx))
        return -1;
    if (lua_rawgetp(L, -1, &kind_key) != LUA_TNUMBER) {
        lua_pop(L, 2);
        return -1;
    }
    int kind = (int)lua_tointeger(L, -1);
    lua_pop(L, 1);
    if (where && n) {
        lua_rawgetp(L, -1, &where_key);
        snprintf(where, n, "%s", lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "?");
        lua_pop(L, 1);
    }
    if (payload) {
        lua_rawgetp(L, -1, &payload_key);
        *payload = (int64_t)lua_tointeger(L, -1);
        lua_pop(L, 1);
    }
    lua_pushliteral(L, "__index");
    lua_rawget(L, -2);
    lua_remove(L, -2);
    return kind;
}
