/* The Lua 5.4 module `shoal`: include/shoal.h for a host's own Lua (require "shoal").
 *
 * An engine is a full userdata holding the sh_engine pointer; its user value is a table mapping
 * request ids to the Lua callback tables of the requests in flight, so those functions stay
 * reachable for as long as the C side may call them.
 *
 * Callbacks run inside sh_poll() (and sh_engine_close()), so they always run on the Lua thread
 * that called eng:poll() or eng:close(); that thread is kept in the engine while the C call
 * lasts. A Lua callback runs under lua_pcall: an error in it never unwinds through the library.
 * The first such error is kept and raised again by eng:poll() (or eng:close()) once the C call
 * has returned; later ones in the same call are dropped.
 *
 * Errors: misuse (a wrong argument type, an unknown option, a closed engine) raises a Lua error;
 * failures the C API reports (a bad value, a full queue, a file that does not load) return
 * nil, message, code-name ("EINVAL", "EBUSY", ...). */
#include <stdint.h>
#include <string.h>

#include <lauxlib.h>
#include <lua.h>

#include "shoal.h"
#include "shoal_lua_int.h"

#define ENGINE_MT "shoal.engine"

typedef struct lengine {
    sh_engine *eng;   /* NULL once closed */
    lua_State *L;     /* the thread inside poll/close, where callbacks run; NULL otherwise */
    int engine_index; /* stack index of the engine userdata on L while L is set */
    int cb_error_ref; /* LUA_NOREF, or a registry ref to the first callback error */
    int finalizing;   /* in __gc: close without calling Lua */
} lengine;

/* Names of sh_err codes, as Lua sees them. */
static const char *const err_names[SH_ERR_COUNT_] = {
    "OK",        "EINVAL",  "ENOMEM", "EIO",       "EFORMAT", "EUNSUPPORTED", "ENOTFOUND", "ERANGE",
    "ETIMEDOUT", "ECLOSED", "EBUSY",  "ECANCELED", "EPROTO",  "ELUA",         "EDEVICE",
};

static const char *err_name(sh_err e)
{
    return (e >= 0 && e < SH_ERR_COUNT_) ? err_names[e] : "EUNKNOWN";
}

static const char *const finish_names[] = {"stop", "length", "cancel", "deadline", "tool_calls"};

/* Pushes nil, message, code-name and returns 3 (the module's failure return). */
static int push_fail(lua_State *L, sh_err code, const char *msg)
{
    lua_pushnil(L);
    lua_pushstring(L, (msg && msg[0]) ? msg : sh_strerror(code));
    lua_pushstring(L, err_name(code));
    return 3;
}

static lengine *check_engine(lua_State *L, int idx)
{
    return (lengine *)luaL_checkudata(L, idx, ENGINE_MT);
}

static lengine *check_open(lua_State *L, int idx)
{
    lengine *e = check_engine(L, idx);
    if (!e->eng)
        luaL_error(L, "shoal: the engine is closed");
    return e;
}

/* ---- Reading option tables ------------------------------------------------------------- */

/* The string at idx (which must be one) as a C string: one holding a NUL byte raises, since
 * everything past it would be dropped without a word ("m.gguf\0.txt" would open m.gguf, a
 * prompt would be cut). The message names option `key`, or `what` when key is NULL. */
static const char *c_string(lua_State *L, int idx, const char *what, const char *key)
{
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    size_t at = strlen(s);
    if (at != len) {
        if (key)
            luaL_error(L, "shoal: option '%s' holds a NUL byte (at byte %d of %d)", key, (int)at,
                       (int)len);
        luaL_error(L, "shoal: %s holds a NUL byte (at byte %d of %d)", what, (int)at, (int)len);
    }
    return s;
}

/* Every key of the table at idx must be one of `known` (NULL-terminated): a typo is an error,
 * not a silently ignored option. */
static void check_keys(lua_State *L, int idx, const char *what, const char *const *known)
{
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING)
            luaL_error(L, "shoal: %s: keys must be strings", what);
        const char *k = c_string(L, -1, "an option's name", NULL);
        int ok = 0;
        for (const char *const *p = known; *p; p++)
            if (strcmp(*p, k) == 0)
                ok = 1;
        if (!ok)
            luaL_error(L, "shoal: %s: unknown option '%s'", what, k);
    }
}

/* Field getters: absent (nil) leaves *out alone; a wrong type raises. */
static int opt_integer(lua_State *L, int idx, const char *key, lua_Integer lo, lua_Integer hi,
                       lua_Integer *out)
{
    int t = lua_getfield(L, idx, key);
    if (t == LUA_TNIL) {
        lua_pop(L, 1);
        return 0;
    }
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    if (!isint)
        luaL_error(L, "shoal: option '%s' must be an integer, not %s", key, luaL_typename(L, -1));
    if (v < lo || v > hi)
        luaL_error(L, "shoal: option '%s' is %I, outside %I..%I", key, v, lo, hi);
    lua_pop(L, 1);
    *out = v;
    return 1;
}

static void opt_i32(lua_State *L, int idx, const char *key, int32_t *out)
{
    lua_Integer v;
    if (opt_integer(L, idx, key, INT32_MIN, INT32_MAX, &v))
        *out = (int32_t)v;
}

static void opt_u64(lua_State *L, int idx, const char *key, uint64_t *out)
{
    lua_Integer v;
    if (opt_integer(L, idx, key, 0, LUA_MAXINTEGER, &v))
        *out = (uint64_t)v;
}

static void opt_float(lua_State *L, int idx, const char *key, float *out)
{
    int t = lua_getfield(L, idx, key);
    if (t != LUA_TNIL) {
        if (t != LUA_TNUMBER)
            luaL_error(L, "shoal: option '%s' must be a number, not %s", key, lua_typename(L, t));
        *out = (float)lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
}

static void opt_bool(lua_State *L, int idx, const char *key, bool *out)
{
    int t = lua_getfield(L, idx, key);
    if (t != LUA_TNIL) {
        if (t != LUA_TBOOLEAN)
            luaL_error(L, "shoal: option '%s' must be a boolean, not %s", key, lua_typename(L, t));
        *out = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
}

/* The request option speculative = true | false | {n_max = N}: false, or N = 0, never drafts for
 * the request; N (1..16) caps its drafted tokens a step (sh_request_opts.no_spec, spec_n_max); a
 * wrong type or another key raises, N out of range is sh_submit's SH_EINVAL. */
static void opt_spec(lua_State *L, int idx, sh_request_opts *r)
{
    static const char *const keys[] = {"n_max", NULL};
    int t = lua_getfield(L, idx, "speculative");
    if (t == LUA_TBOOLEAN) {
        r->no_spec = !lua_toboolean(L, -1);
    } else if (t == LUA_TTABLE) {
        int at = lua_gettop(L);
        check_keys(L, at, "option 'speculative'", keys);
        lua_Integer n;
        if (opt_integer(L, at, "n_max", INT32_MIN, INT32_MAX, &n)) {
            r->no_spec = n == 0;
            r->spec_n_max = (int32_t)n; /* outside 0..16: sh_submit's SH_EINVAL */
        }
    } else if (t != LUA_TNIL) {
        luaL_error(L,
                   "shoal: option 'speculative' must be a boolean or a table {n_max = N}, not %s",
                   lua_typename(L, t));
    }
    lua_pop(L, 1);
}

/* A string option; the pointer stays valid while the table at idx holds the string. */
static void opt_string(lua_State *L, int idx, const char *key, const char **out)
{
    int t = lua_getfield(L, idx, key);
    if (t != LUA_TNIL) {
        if (t != LUA_TSTRING)
            luaL_error(L, "shoal: option '%s' must be a string, not %s", key, lua_typename(L, t));
        *out = c_string(L, -1, NULL, key);
    }
    lua_pop(L, 1);
}

/* ---- shoal.open ------------------------------------------------------------------------- */

static const char *const open_keys[] = {"model",
                                        "cluster",
                                        "threads",
                                        "memory_budget",
                                        "kv_bytes",
                                        "n_ctx",
                                        "max_seqs",
                                        "max_queue",
                                        "cpu_mask",
                                        "sched",
                                        "nice",
                                        "no_spin",
                                        "recover_timeout_ms",
                                        "spec",
                                        "spec_k",
                                        NULL};

/* shoal.open{model=PATH | cluster=SCRIPT, threads=, memory_budget=, kv_bytes=, n_ctx=,
 * max_seqs=, max_queue=, cpu_mask=, sched="normal"|"batch"|"idle", nice=, no_spin=,
 * recover_timeout_ms=, spec="off"|"ngram", spec_k=} -> engine | nil, msg, code. Blocks while
 * the model loads. */
static int l_open(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    check_keys(L, 1, "shoal.open", open_keys);
    sh_engine_opts o = sh_engine_opts_default();
    opt_string(L, 1, "model", &o.model_path);
    opt_string(L, 1, "cluster", &o.cluster_script);
    opt_i32(L, 1, "threads", &o.threads);
    opt_u64(L, 1, "memory_budget", &o.memory_budget);
    opt_u64(L, 1, "kv_bytes", &o.kv_bytes);
    opt_i32(L, 1, "n_ctx", &o.n_ctx);
    opt_i32(L, 1, "max_seqs", &o.max_seqs);
    opt_i32(L, 1, "max_queue", &o.max_queue);
    opt_u64(L, 1, "cpu_mask", &o.cpu_mask);
    opt_i32(L, 1, "nice", &o.nice);
    opt_i32(L, 1, "recover_timeout_ms", &o.recover_timeout_ms);
    opt_i32(L, 1, "spec_k", &o.spec_k);
    const char *spec = NULL;
    opt_string(L, 1, "spec", &spec);
    if (spec) {
        if (!strcmp(spec, "ngram"))
            o.spec = SH_ENGINE_SPEC_NGRAM;
        else if (strcmp(spec, "off") != 0)
            return luaL_error(L, "shoal: option 'spec' is '%s': off or ngram", spec);
    }
    bool no_spin = false;
    opt_bool(L, 1, "no_spin", &no_spin);
    o.no_spin = no_spin;
    const char *sched = NULL;
    opt_string(L, 1, "sched", &sched);
    if (sched) {
        if (!strcmp(sched, "normal"))
            o.sched = SH_ENGINE_SCHED_NORMAL;
        else if (!strcmp(sched, "batch"))
            o.sched = SH_ENGINE_SCHED_BATCH;
        else if (!strcmp(sched, "idle"))
            o.sched = SH_ENGINE_SCHED_IDLE;
        else
            return luaL_error(L, "shoal: option 'sched' is '%s': normal, batch or idle", sched);
    }

    /* The userdata first, so that a failed allocation raises before the engine exists. */
    lengine *e = (lengine *)lua_newuserdatauv(L, sizeof *e, 1);
    memset(e, 0, sizeof *e);
    e->cb_error_ref = LUA_NOREF;
    luaL_setmetatable(L, ENGINE_MT);
    lua_newtable(L); /* request id -> callback table */
    lua_setiuservalue(L, -2, 1);

    sh_error err;
    memset(&err, 0, sizeof err);
    sh_err rc = sh_engine_open(&o, &e->eng, &err);
    if (rc != SH_OK) {
        e->eng = NULL;
        return push_fail(L, rc, err.msg);
    }
    return 1;
}

/* ---- Callbacks (run inside sh_poll / sh_engine_close on e->L) ---------------------------- */

/* Pushes the callback table of request id onto e->L, or returns 0 (nothing pushed) when there
 * is none or Lua must not be called now. */
static int push_request(lengine *e, uint64_t id)
{
    lua_State *L = e->L;
    if (!L || e->finalizing || !lua_checkstack(L, 12))
        return 0;
    lua_getiuservalue(L, e->engine_index, 1);
    lua_rawgeti(L, -1, (lua_Integer)id);
    lua_remove(L, -2);
    if (lua_type(L, -1) != LUA_TTABLE) {
        lua_pop(L, 1);
        return 0;
    }
    return 1;
}

static void forget_request(lengine *e, uint64_t id)
{
    lua_State *L = e->L;
    if (!L)
        return;
    lua_getiuservalue(L, e->engine_index, 1);
    lua_pushnil(L);
    lua_rawseti(L, -2, (lua_Integer)id);
    lua_pop(L, 1);
}

/* Calls field `name` of the callback table on top of e->L with nargs arguments pushed above
 * it; pops the arguments (and keeps the table). Errors are kept for poll to raise. */
static void call_field(lengine *e, const char *name, int nargs)
{
    lua_State *L = e->L;
    int tbl = lua_gettop(L) - nargs;
    if (lua_getfield(L, tbl, name) != LUA_TFUNCTION) {
        lua_pop(L, 1 + nargs);
        return;
    }
    lua_insert(L, tbl + 1);
    if (lua_pcall(L, nargs, 0, 0) != LUA_OK) {
        if (e->cb_error_ref == LUA_NOREF)
            e->cb_error_ref = luaL_ref(L, LUA_REGISTRYINDEX);
        else
            lua_pop(L, 1);
    }
}

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    lengine *e = (lengine *)user;
    if (!push_request(e, id))
        return;
    lua_State *L = e->L;
    lua_pushlstring(L, ev->text ? ev->text : "", ev->text ? ev->text_len : 0);
    lua_createtable(L, ev->n_ids, 0);
    for (int32_t i = 0; i < ev->n_ids; i++) {
        lua_pushinteger(L, ev->ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushinteger(L, (lua_Integer)id);
    if (ev->logprobs) {
        lua_createtable(L, ev->n_ids, 0);
        for (int32_t i = 0; i < ev->n_ids; i++) {
            lua_pushnumber(L, ev->logprobs[i]);
            lua_rawseti(L, -2, i + 1);
        }
    } else {
        lua_pushnil(L);
    }
    call_field(e, "token", 4);
    lua_pop(L, 1);
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    lengine *e = (lengine *)user;
    if (!push_request(e, id))
        return;
    lua_State *L = e->L;
    forget_request(e, id); /* the request is over whatever its callback does */
    lua_createtable(L, 0, 4);
    int f = (int)info->finish;
    lua_pushstring(L, (f >= 0 && f < 5) ? finish_names[f] : "unknown");
    lua_setfield(L, -2, "finish");
    lua_pushinteger(L, info->prompt_tokens);
    lua_setfield(L, -2, "prompt_tokens");
    lua_pushinteger(L, info->completion_tokens);
    lua_setfield(L, -2, "completion_tokens");
    lua_pushinteger(L, info->cached_tokens);
    lua_setfield(L, -2, "cached_tokens");
    if (info->embedding && info->n_embedding > 0) { /* submit{embed=true}: the unit vector */
        lua_createtable(L, info->n_embedding, 0);
        for (int32_t j = 0; j < info->n_embedding; j++) {
            lua_pushnumber(L, (lua_Number)info->embedding[j]);
            lua_rawseti(L, -2, (lua_Integer)j + 1);
        }
        lua_setfield(L, -2, "embedding");
    }
    if (info->tool_calls) { /* a chat with tools: the calls, as JSON text */
        lua_pushstring(L, info->tool_calls);
        lua_setfield(L, -2, "tool_calls");
    }
    lua_pushinteger(L, (lua_Integer)id);
    call_field(e, "done", 2);
    lua_pop(L, 1);
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    lengine *e = (lengine *)user;
    if (!push_request(e, id))
        return;
    lua_State *L = e->L;
    forget_request(e, id);
    lua_pushstring(L, err_name(code));
    lua_pushstring(L, message ? message : sh_strerror(code));
    lua_pushinteger(L, (lua_Integer)id);
    call_field(e, "error", 3);
    lua_pop(L, 1);
}

/* Raises the callback error kept during the last C call, if any. */
static void raise_cb_error(lua_State *L, lengine *e)
{
    if (e->cb_error_ref == LUA_NOREF)
        return;
    lua_rawgeti(L, LUA_REGISTRYINDEX, e->cb_error_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, e->cb_error_ref);
    e->cb_error_ref = LUA_NOREF;
    lua_error(L);
}

/* ---- eng:submit ------------------------------------------------------------------------- */

static const char *const req_keys[] = {"prompt",
                                       "prompt_tokens",
                                       "messages",
                                       "max_tokens",
                                       "temperature",
                                       "top_p",
                                       "top_k",
                                       "min_p",
                                       "presence_penalty",
                                       "frequency_penalty",
                                       "repeat_penalty",
                                       "stop",
                                       "seed",
                                       "priority",
                                       "top_logprobs",
                                       "logprobs",
                                       "ignore_eos",
                                       "timeout_ms",
                                       "speculative",
                                       "typical_p",
                                       "repeat_last_n",
                                       "min_tokens",
                                       "grammar",
                                       "response_format",
                                       "embed",
                                       "messages_json",
                                       "tools",
                                       "tool_choice",
                                       "parallel_tool_calls",
                                       NULL};

static const char *const cb_keys[] = {"token", "done", "error", NULL};

#define MAX_STOP 4

/* eng:submit(request, callbacks) -> id | nil, msg, code. request: {prompt= | prompt_tokens= |
 * messages={{role=,content=},...}, max_tokens=, temperature=, top_p=, top_k=, min_p=,
 * presence_penalty=, frequency_penalty=, repeat_penalty=, stop=STRING|{...}, seed=, priority=,
 * logprobs=, top_logprobs=, ignore_eos=, timeout_ms=, speculative=true|false|{n_max=N},
 * typical_p=, repeat_last_n=, min_tokens=, grammar=GBNF, response_format=JSON, embed=true,
 * messages_json=JSON text, tools=JSON, tool_choice=STRING|JSON, parallel_tool_calls=false}
 * (JSON: JSON text, or a table written as JSON);
 * callbacks:
 * {token=function(text, ids, id, logprobs), done=function(info, id), error=function(code, message,
 * id)}, each optional. With embed=true nothing is generated and done's info carries `embedding`,
 * the pooled unit vector as a table of the model's width of numbers. With tools, done's info
 * carries `tool_calls` (JSON text) when the model called any, and finish "tool_calls"; a message
 * may carry tool_calls (that JSON text) and tool_call_id (role "tool"). */
static int l_submit(lua_State *L)
{
    lengine *e = check_open(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    if (lua_isnoneornil(L, 3)) {
        lua_settop(L, 2);
        lua_newtable(L);
    }
    luaL_checktype(L, 3, LUA_TTABLE);
    lua_settop(L, 3);
    check_keys(L, 2, "submit request", req_keys);
    check_keys(L, 3, "submit callbacks", cb_keys);
    for (const char *const *k = cb_keys; *k; k++) {
        int t = lua_getfield(L, 3, *k);
        if (t != LUA_TNIL && t != LUA_TFUNCTION)
            luaL_error(L, "shoal: callback '%s' must be a function, not %s", *k,
                       lua_typename(L, t));
        lua_pop(L, 1);
    }

    sh_request_opts r = sh_request_opts_default();
    opt_string(L, 2, "prompt", &r.prompt);
    opt_i32(L, 2, "max_tokens", &r.max_tokens);
    opt_float(L, 2, "temperature", &r.temperature);
    opt_float(L, 2, "top_p", &r.top_p);
    opt_i32(L, 2, "top_k", &r.top_k);
    opt_float(L, 2, "min_p", &r.min_p);
    opt_float(L, 2, "presence_penalty", &r.presence_penalty);
    opt_float(L, 2, "frequency_penalty", &r.frequency_penalty);
    opt_float(L, 2, "repeat_penalty", &r.repeat_penalty);
    opt_float(L, 2, "typical_p", &r.typical_p);
    opt_i32(L, 2, "repeat_last_n", &r.repeat_last_n);
    opt_i32(L, 2, "min_tokens", &r.min_tokens);
    opt_u64(L, 2, "seed", &r.seed);
    opt_i32(L, 2, "priority", &r.priority);
    opt_i32(L, 2, "top_logprobs", &r.top_logprobs);
    opt_bool(L, 2, "logprobs", &r.logprobs);
    opt_bool(L, 2, "ignore_eos", &r.ignore_eos);
    opt_bool(L, 2, "embed", &r.embed);
    opt_spec(L, 2, &r);
    opt_string(L, 2, "grammar", &r.grammar);
    sh_lua_json_opt(L, 2, "response_format", &r.response_format);
    opt_string(L, 2, "messages_json", &r.messages_json);
    sh_lua_json_opt(L, 2, "tools", &r.tools);
    sh_lua_json_opt(L, 2, "tool_choice", &r.tool_choice);
    bool parallel = true;
    opt_bool(L, 2, "parallel_tool_calls", &parallel);
    r.no_parallel_tool_calls = !parallel;
    lua_Integer tmo;
    if (opt_integer(L, 2, "timeout_ms", 0, UINT32_MAX, &tmo))
        r.timeout_ms = (uint32_t)tmo;

    /* Arrays live in userdata on the stack (index 4, 5, ...) until sh_submit has copied them. */
    int t = lua_getfield(L, 2, "prompt_tokens");
    if (t != LUA_TNIL) {
        if (t != LUA_TTABLE)
            luaL_error(L, "shoal: option 'prompt_tokens' must be a table of integers");
        lua_Integer n = luaL_len(L, -1);
        if (n > INT32_MAX / 4)
            luaL_error(L, "shoal: option 'prompt_tokens' is too long");
        int32_t *ids = (int32_t *)lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *ids, 0);
        for (lua_Integer i = 1; i <= n; i++) {
            lua_rawgeti(L, -2, i);
            int isint = 0;
            lua_Integer v = lua_tointegerx(L, -1, &isint);
            if (!isint || v < INT32_MIN || v > INT32_MAX)
                luaL_error(L, "shoal: prompt_tokens[%I] is not a 32-bit integer", i);
            ids[i - 1] = (int32_t)v;
            lua_pop(L, 1);
        }
        r.prompt_tokens = ids;
        r.n_prompt_tokens = (int32_t)n;
    }
    /* The prompt_tokens table (or nil) and its userdata stay on the stack. */

    sh_lua_messages(L, 2, &r); /* the messages (or their JSON) stay on the stack */

    const char *stops[MAX_STOP];
    t = lua_getfield(L, 2, "stop");
    if (t == LUA_TSTRING) {
        stops[0] = c_string(L, -1, NULL, "stop");
        r.stop = stops;
        r.n_stop = 1;
    } else if (t == LUA_TTABLE) {
        int st = lua_gettop(L);
        lua_Integer n = luaL_len(L, st);
        if (n > MAX_STOP)
            return push_fail(L, SH_EINVAL, "stop: at most 4 stop strings");
        for (lua_Integer i = 1; i <= n; i++) {
            if (lua_rawgeti(L, st, i) != LUA_TSTRING)
                luaL_error(L, "shoal: stop[%I] must be a string", i);
            stops[i - 1] = c_string(L, -1, "a stop string", NULL);
            lua_pop(L, 1);
        }
        r.stop = stops;
        r.n_stop = (int32_t)n;
    } else if (t != LUA_TNIL) {
        luaL_error(L, "shoal: option 'stop' must be a string or a table of strings");
    }

    sh_callbacks cb = {on_token, on_done, on_error};
    uint64_t id = 0;
    sh_error err;
    memset(&err, 0, sizeof err);
    sh_err rc = sh_submit(e->eng, &r, &cb, e, &id, &err);
    if (rc != SH_OK)
        return push_fail(L, rc, err.msg);
    /* No callback can run before the next sh_poll, so registering after the submit is safe. */
    lua_getiuservalue(L, 1, 1);
    lua_pushvalue(L, 3);
    lua_rawseti(L, -2, (lua_Integer)id);
    lua_pushinteger(L, (lua_Integer)id);
    return 1;
}

/* eng:embed's callbacks: each keeps what it is given in the result table, upvalue 1. */
static int embed_on_done(lua_State *L)
{
    lua_settop(L, 1);
    lua_setfield(L, lua_upvalueindex(1), "info");
    return 0;
}

static int embed_on_error(lua_State *L)
{
    lua_settop(L, 2);
    lua_setfield(L, lua_upvalueindex(1), "message");
    lua_setfield(L, lua_upvalueindex(1), "code");
    return 0;
}

static int l_poll(lua_State *L);

/* eng:embed(text | {token ids}[, {priority=, timeout_ms=}]) -> {numbers}, prompt_tokens |
 * nil, msg, code. A blocking eng:submit{embed=true} that polls the engine until its end: the
 * callbacks of other requests in flight run meanwhile (an error one of them raises is raised
 * here, the embedding cancelled). From inside a callback it submits nothing and answers nil,
 * msg, "EBUSY". */
static int l_embed(lua_State *L)
{
    static const char *const keys[] = {"priority", "timeout_ms", NULL};
    lengine *e = check_open(L, 1);
    if (e->L) /* inside poll or close: it could not poll, so it submits nothing */
        return push_fail(L, SH_EBUSY, "eng:embed: called from a callback (it polls the engine)");
    int t = lua_type(L, 2);
    luaL_argexpected(L, t == LUA_TSTRING || t == LUA_TTABLE, 2, "string or table of token ids");
    if (!lua_isnoneornil(L, 3)) {
        luaL_checktype(L, 3, LUA_TTABLE);
        check_keys(L, 3, "embed options", keys);
    }
    lua_settop(L, 3);
    lua_createtable(L, 0, 4); /* 4: the request */
    lua_pushvalue(L, 2);
    lua_setfield(L, 4, t == LUA_TSTRING ? "prompt" : "prompt_tokens");
    lua_pushboolean(L, 1);
    lua_setfield(L, 4, "embed");
    for (const char *const *k = keys; *k && lua_istable(L, 3); k++) {
        lua_getfield(L, 3, *k);
        lua_setfield(L, 4, *k);
    }
    lua_newtable(L);          /* 5: the result */
    lua_createtable(L, 0, 2); /* 6: the callbacks */
    lua_pushvalue(L, 5);
    lua_pushcclosure(L, embed_on_done, 1);
    lua_setfield(L, 6, "done");
    lua_pushvalue(L, 5);
    lua_pushcclosure(L, embed_on_error, 1);
    lua_setfield(L, 6, "error");
    lua_pushcfunction(L, l_submit);
    lua_pushvalue(L, 1);
    lua_pushvalue(L, 4);
    lua_pushvalue(L, 6);
    lua_call(L, 3, 3);
    if (lua_isnil(L, -3))
        return 3;
    lua_Integer id = lua_tointeger(L, -3);
    lua_settop(L, 6);
    for (;;) {
        lua_getfield(L, 5, "info");
        lua_getfield(L, 5, "code");
        bool over = !lua_isnil(L, -1) || !lua_isnil(L, -2);
        lua_pop(L, 2);
        if (over)
            break;
        lua_pushcfunction(L, l_poll);
        lua_pushvalue(L, 1);
        lua_pushinteger(L, -1);
        int st = lua_pcall(L, 2, 3, 0);
        if (st != LUA_OK || lua_isnil(L, -3)) { /* the request must not outlive the call */
            sh_error err;
            memset(&err, 0, sizeof err);
            if (e->eng)
                sh_cancel(e->eng, (uint64_t)id, &err);
            if (st != LUA_OK)
                return lua_error(L);
            return 3;
        }
        lua_pop(L, 3);
    }
    if (lua_getfield(L, 5, "code") != LUA_TNIL) {
        lua_pushnil(L);
        lua_getfield(L, 5, "message");
        lua_getfield(L, 5, "code");
        return 3;
    }
    lua_getfield(L, 5, "info");
    if (lua_getfield(L, -1, "embedding") == LUA_TNIL)
        return push_fail(L, SH_EPROTO, "eng:embed: the engine answered no embedding");
    lua_getfield(L, -2, "prompt_tokens");
    return 2;
}

/* eng:cancel(id) -> true | nil, msg, code ("ENOTFOUND", "ECANCELED"). */
static int l_cancel(lua_State *L)
{
    lengine *e = check_open(L, 1);
    lua_Integer id = luaL_checkinteger(L, 2);
    sh_error err;
    memset(&err, 0, sizeof err);
    sh_err rc = sh_cancel(e->eng, (uint64_t)id, &err);
    if (rc != SH_OK)
        return push_fail(L, rc, err.msg);
    lua_pushboolean(L, 1);
    return 1;
}

/* eng:poll([timeout_ms]) -> callbacks run | nil, msg, code ("EBUSY" from a callback). Raises
 * the first error a Lua callback raised during the call. */
static int l_poll(lua_State *L)
{
    lengine *e = check_open(L, 1);
    lua_Integer tmo = luaL_optinteger(L, 2, 0);
    luaL_argcheck(L, tmo >= -1 && tmo <= INT32_MAX, 2, "timeout must be -1 or 0..2^31-1 ms");
    lua_State *saved_L = e->L;
    int saved_idx = e->engine_index;
    lua_settop(L, 2);
    e->L = L;
    e->engine_index = 1;
    uint32_t ran = 0;
    sh_err rc = sh_poll(e->eng, (int32_t)tmo, &ran);
    e->L = saved_L;
    e->engine_index = saved_idx;
    raise_cb_error(L, e);
    if (rc != SH_OK)
        return push_fail(L, rc,
                         rc == SH_EBUSY ? "sh_poll: already polling (from a callback or "
                                          "another thread)"
                                        : NULL);
    lua_pushinteger(L, ran);
    return 1;
}

/* Closes the engine on L (error callbacks of requests in flight run here). */
static sh_err close_engine(lua_State *L, lengine *e, int idx)
{
    lua_State *saved_L = e->L;
    int saved_idx = e->engine_index;
    e->L = L;
    e->engine_index = idx;
    sh_err rc = sh_engine_close(e->eng);
    e->L = saved_L;
    e->engine_index = saved_idx;
    if (rc == SH_OK) {
        e->eng = NULL;
        lua_newtable(L);
        lua_setiuservalue(L, idx, 1);
    }
    return rc;
}

/* eng:close() -> true | nil, msg, code ("EBUSY" from a callback). Closing a closed engine is
 * fine. Requests in flight end with their error callback ("ECLOSED") before it returns. */
static int l_close(lua_State *L)
{
    lengine *e = check_engine(L, 1);
    lua_settop(L, 1);
    if (!e->eng) {
        lua_pushboolean(L, 1);
        return 1;
    }
    sh_err rc = close_engine(L, e, 1);
    raise_cb_error(L, e);
    if (rc != SH_OK)
        return push_fail(L, rc, rc == SH_EBUSY ? "close: not from a callback" : NULL);
    lua_pushboolean(L, 1);
    return 1;
}

/* __gc: the engine became garbage, so no Lua code can see its callbacks any more: close it
 * without calling Lua. */
static int l_gc(lua_State *L)
{
    lengine *e = check_engine(L, 1);
    if (e->eng) {
        e->finalizing = 1;
        if (sh_engine_close(e->eng) == SH_OK)
            e->eng = NULL;
    }
    if (e->cb_error_ref != LUA_NOREF) {
        luaL_unref(L, LUA_REGISTRYINDEX, e->cb_error_ref);
        e->cb_error_ref = LUA_NOREF;
    }
    return 0;
}

/* __close (local eng <close> = ...): as eng:close(), raising on failure. */
static int l_tbc_close(lua_State *L)
{
    lengine *e = check_engine(L, 1);
    lua_settop(L, 1);
    if (!e->eng)
        return 0;
    sh_err rc = close_engine(L, e, 1);
    raise_cb_error(L, e);
    if (rc != SH_OK)
        return luaL_error(L, "shoal: close: %s", sh_strerror(rc));
    return 0;
}

/* eng:fd() -> descriptor readable while callbacks are due. */
static int l_fd(lua_State *L)
{
    lengine *e = check_open(L, 1);
    lua_pushinteger(L, sh_fd(e->eng));
    return 1;
}

/* eng:pending() -> requests not over. */
static int l_pending(lua_State *L)
{
    lengine *e = check_open(L, 1);
    lua_pushinteger(L, sh_pending(e->eng));
    return 1;
}

/* eng:tokenize(text [, add_special [, parse_special]]) -> {ids} | nil, msg, code. */
static int l_tokenize(lua_State *L)
{
    lengine *e = check_open(L, 1);
    size_t len;
    const char *s = luaL_checklstring(L, 2, &len);
    bool add = lua_toboolean(L, 3), parse = lua_toboolean(L, 4);
    sh_error err;
    memset(&err, 0, sizeof err);
    int32_t n = 0;
    sh_err rc = sh_tokenize(e->eng, s, len, add, parse, NULL, 0, &n, &err);
    if (rc != SH_OK && rc != SH_ERANGE)
        return push_fail(L, rc, err.msg);
    int32_t *ids = (int32_t *)lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *ids, 0);
    int32_t n2 = 0;
    rc = sh_tokenize(e->eng, s, len, add, parse, ids, n, &n2, &err);
    if (rc != SH_OK)
        return push_fail(L, rc, err.msg);
    lua_createtable(L, n2, 0);
    for (int32_t i = 0; i < n2; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* Calls a text-producing API function twice: once to size, once to fill a Lua buffer. */
typedef sh_err (*text_fn)(lengine *e, void *arg, char *text, size_t cap, size_t *len,
                          sh_error *err);

static int push_text(lua_State *L, lengine *e, text_fn fn, void *arg)
{
    sh_error err;
    memset(&err, 0, sizeof err);
    size_t len = 0;
    char one[1];
    sh_err rc = fn(e, arg, one, 0, &len, &err);
    if (rc != SH_OK && rc != SH_ERANGE)
        return push_fail(L, rc, err.msg);
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, len + 1);
    size_t len2 = 0;
    rc = fn(e, arg, p, len + 1, &len2, &err);
    if (rc != SH_OK)
        return push_fail(L, rc, err.msg);
    luaL_pushresultsize(&b, len2);
    return 1;
}

typedef struct id_list {
    const int32_t *ids;
    int32_t n;
} id_list;

static sh_err detok_fn(lengine *e, void *arg, char *text, size_t cap, size_t *len, sh_error *err)
{
    id_list *l = (id_list *)arg;
    return sh_detokenize(e->eng, l->ids, l->n, text, cap, len, err);
}

/* eng:detokenize({ids}) -> text | nil, msg, code. */
static int l_detokenize(lua_State *L)
{
    lengine *e = check_open(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 2);
    luaL_argcheck(L, n >= 0 && n <= INT32_MAX / 4, 2, "too many ids");
    int32_t *ids = (int32_t *)lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *ids, 0);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_rawgeti(L, 2, i);
        int isint = 0;
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < INT32_MIN || v > INT32_MAX)
            luaL_error(L, "shoal: detokenize: ids[%I] is not a 32-bit integer", i);
        ids[i - 1] = (int32_t)v;
        lua_pop(L, 1);
    }
    id_list l = {ids, (int32_t)n};
    return push_text(L, e, detok_fn, &l);
}

typedef struct msg_list {
    const sh_chat_message *m;
    int32_t n;
} msg_list;

static sh_err chat_fn(lengine *e, void *arg, char *text, size_t cap, size_t *len, sh_error *err)
{
    msg_list *l = (msg_list *)arg;
    return sh_chat_apply(e->eng, l->m, l->n, text, cap, len, err);
}

/* eng:chat_apply({{role=, content=}, ...}) -> text | nil, msg, code. */
static int l_chat_apply(lua_State *L)
{
    lengine *e = check_open(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 2);
    luaL_argcheck(L, n >= 0 && n <= 4096, 2, "at most 4096 messages");
    sh_chat_message *m = sh_lua_chat_messages(L, 2, n, "chat_apply: ");
    msg_list l = {m, (int32_t)n};
    return push_text(L, e, chat_fn, &l);
}

static void set_int(lua_State *L, const char *k, lua_Integer v)
{
    lua_pushinteger(L, v);
    lua_setfield(L, -2, k);
}

/* eng:info() -> table of sh_model_info's fields | nil, msg, code. */
static int l_info(lua_State *L)
{
    lengine *e = check_open(L, 1);
    sh_model_info mi;
    memset(&mi, 0, sizeof mi);
    sh_err rc = sh_model_info_get(e->eng, &mi);
    if (rc != SH_OK)
        return push_fail(L, rc, NULL);
    lua_createtable(L, 0, 14);
    lua_pushstring(L, mi.name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, mi.arch);
    lua_setfield(L, -2, "arch");
    lua_pushstring(L, mi.weight_type);
    lua_setfield(L, -2, "weight_type");
    set_int(L, "n_vocab", mi.n_vocab);
    set_int(L, "n_ctx", mi.n_ctx);
    set_int(L, "n_ctx_train", mi.n_ctx_train);
    set_int(L, "n_layers", mi.n_layers);
    set_int(L, "dim", mi.dim);
    set_int(L, "n_params", (lua_Integer)mi.n_params);
    set_int(L, "weight_bytes", (lua_Integer)mi.weight_bytes);
    set_int(L, "kv_bytes", (lua_Integer)mi.kv_bytes);
    set_int(L, "bos", mi.bos);
    set_int(L, "eos", mi.eos);
    lua_pushboolean(L, mi.has_chat_template);
    lua_setfield(L, -2, "has_chat_template");
    return 1;
}

/* eng:stats() -> table of sh_engine_stats's fields | nil, msg, code. */
static int l_stats(lua_State *L)
{
    lengine *e = check_open(L, 1);
    sh_engine_stats st;
    memset(&st, 0, sizeof st);
    sh_err rc = sh_engine_stats_get(e->eng, &st);
    if (rc != SH_OK)
        return push_fail(L, rc, NULL);
    lua_createtable(L, 0, 8);
    set_int(L, "pending", st.pending);
    set_int(L, "running", st.running);
    set_int(L, "queued", st.queued);
    set_int(L, "requests_total", (lua_Integer)st.requests_total);
    set_int(L, "tokens_generated_total", (lua_Integer)st.tokens_generated_total);
    set_int(L, "prompt_tokens_total", (lua_Integer)st.prompt_tokens_total);
    set_int(L, "kv_blocks_total", st.kv_blocks_total);
    set_int(L, "kv_blocks_used", st.kv_blocks_used);
    return 1;
}

static sh_err metrics_fn(lengine *e, void *arg, char *text, size_t cap, size_t *len, sh_error *err)
{
    (void)arg;
    sh_err rc = sh_metrics_snapshot(e->eng, text, cap, len);
    if (err)
        err->code = rc;
    return rc;
}

/* eng:metrics() -> Prometheus text | nil, msg, code. */
static int l_metrics(lua_State *L)
{
    lengine *e = check_open(L, 1);
    return push_text(L, e, metrics_fn, NULL);
}

static int l_tostring(lua_State *L)
{
    lengine *e = check_engine(L, 1);
    lua_pushfstring(L, "shoal.engine (%s)", e->eng ? "open" : "closed");
    return 1;
}

/* shoal.strerror(code-name) -> text. */
static int l_strerror(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TSTRING);
    const char *name = c_string(L, 1, "the error code name", NULL);
    for (int i = 0; i < SH_ERR_COUNT_; i++)
        if (strcmp(err_names[i], name) == 0) {
            lua_pushstring(L, sh_strerror((sh_err)i));
            return 1;
        }
    return luaL_error(L, "shoal: unknown error code name '%s'", name);
}

static const luaL_Reg engine_methods[] = {{"submit", l_submit},
                                          {"cancel", l_cancel},
                                          {"embed", l_embed},
                                          {"poll", l_poll},
                                          {"fd", l_fd},
                                          {"pending", l_pending},
                                          {"tokenize", l_tokenize},
                                          {"detokenize", l_detokenize},
                                          {"chat_apply", l_chat_apply},
                                          {"info", l_info},
                                          {"stats", l_stats},
                                          {"metrics", l_metrics},
                                          {"close", l_close},
                                          {NULL, NULL}};

static const luaL_Reg engine_meta[] = {
    {"__gc", l_gc}, {"__close", l_tbc_close}, {"__tostring", l_tostring}, {NULL, NULL}};

static const luaL_Reg module_funcs[] = {{"open", l_open}, {"strerror", l_strerror}, {NULL, NULL}};

/* The module's only exported symbol. */
int luaopen_shoal(lua_State *L);

int luaopen_shoal(lua_State *L)
{
    luaL_checkversion(L);
    luaL_newmetatable(L, ENGINE_MT);
    luaL_setfuncs(L, engine_meta, 0);
    luaL_newlib(L, engine_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newlib(L, module_funcs);
    lua_pushstring(L, sh_version());
    lua_setfield(L, -2, "version");
    return 1;
}
