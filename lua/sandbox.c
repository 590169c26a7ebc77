/* The sandboxed Lua state: a counting allocator, a wall-clock instruction hook, the safe subset of
 * the standard libraries and protected calls whose errors become sh_error text with file:line. */
#include "lua/sandbox.h"

#include <lauxlib.h>
#include <lualib.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/file.h"

#define HOOK_EVERY 1000                  /* VM instructions between two clock reads */
#define ALLOC_CLOCK_EVERY 256            /* allocations that grow between two clock reads */
#define MAX_SCRIPT (4u << 20)            /* bytes of script text we agree to compile */
#define PATTERN_BUDGET (1u << 24)        /* worst-case matcher steps a pattern call may cost */
#define MOVE_MAX ((lua_Unsigned)1 << 22) /* table.move iterations (it runs without the hook) */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

sh__lua_box *sh__lua_box_of(lua_State *L)
{
    void *ud = NULL;
    lua_getallocf(L, &ud);
    return ud;
}

/* True once the running evaluation is past its deadline: the allocator's view of the clock. */
static bool alloc_late(sh__lua_box *b)
{
    if (b->deadline_ns == 0)
        return false;
    if (!b->starved && now_ns() < b->deadline_ns)
        return false;
    b->hit = SH__LUA_HIT_TIME;
    b->starved = true;
    return true;
}

/* Counts every byte of the state. When ptr is NULL, osize encodes the object type, not a size.
 * Refusing a growth makes Lua collect garbage and retry once, then raise a memory error.
 *
 * The allocator also watches the clock, because time can pass between two hook calls: near the
 * memory limit every refused growth costs Lua a full emergency collection, and some refusals
 * (the string table's) are swallowed, so `t[tostring(i)] = true` in a loop runs one collection
 * of the whole heap per new string, with few VM instructions between. It reads the clock at
 * every refusal (already the slow path) and every ALLOC_CLOCK_EVERY growths (about a
 * nanosecond each, amortized); once it has seen the deadline pass it refuses every growth, so
 * the script ends with a memory error that sh__lua_call reports as the time limit. (The hook's
 * own time error does not starve the state: unwinding it calls the message handler, which needs
 * memory.) */
static void box_hook(lua_State *L, lua_Debug *ar);

static void *box_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    sh__lua_box *b = ud;
    size_t old = ptr ? osize : 0;
    if (nsize == 0) {
        free(ptr);
        b->used -= old;
        if (b->near && b->used <= b->limit / 2)
            b->near = false;
        return NULL;
    }
    if (nsize > old) {
        bool over = nsize - old > b->limit || b->used + (nsize - old) > b->limit;
        if ((over || b->starved || (++b->n_growths % ALLOC_CLOCK_EVERY) == 0) && alloc_late(b))
            return NULL;
        if (over)
            return NULL;
    }
    void *p = realloc(ptr, nsize);
    if (p)
        b->used = b->used - old + nsize;
    /* Past half the limit during an evaluation: the hook looks at the very next instruction, so
     * that a memory error a few instructions later can name its line (a doubling string crosses
     * half and then fails within one loop turn, between two regular hook calls). lua_sethook
     * only writes the state's hook fields, which is safe from here. */
    if (p && !b->near && b->deadline_ns && b->used > b->limit / 2) {
        b->near = b->hook_fast = true;
        lua_sethook(b->L, box_hook, LUA_MASKCOUNT, 1);
    }
    return p;
}

/* Records where the running script is (the function the hook fired in) into b->where. */
static void note_where(sh__lua_box *b, lua_State *L, lua_Debug *ar)
{
    if (lua_getinfo(L, "Sl", ar) && ar->currentline > 0)
        snprintf(b->where, sizeof b->where, "%s:%d", ar->short_src, ar->currentline);
}

/* Raised every HOOK_EVERY instructions once the deadline has passed; it keeps firing, so a script
 * that catches the error only runs until the next check. */
static void box_hook(lua_State *L, lua_Debug *ar)
{
    sh__lua_box *b = sh__lua_box_of(L);
    if (b->hook_fast) { /* asked by the allocator for one look: back to the usual pace */
        b->hook_fast = false;
        lua_sethook(b->L, box_hook, LUA_MASKCOUNT, HOOK_EVERY);
    }
    if (b->used > b->limit / 2)
        note_where(b, L, ar);
    if (b->deadline_ns == 0 || now_ns() < b->deadline_ns)
        return;
    /* The allocator's clock is off while the message is made: were it to see the deadline now,
     * it would refuse the message its memory. */
    int64_t deadline = b->deadline_ns;
    b->deadline_ns = 0;
    if (lua_getinfo(L, "Sl", ar) && ar->currentline > 0)
        lua_pushfstring(L, "%s:%d: time limit of %d ms exceeded", ar->short_src, ar->currentline,
                        (int)b->time_ms);
    else
        lua_pushfstring(L, "%s: time limit of %d ms exceeded", b->name, (int)b->time_ms);
    b->deadline_ns = deadline;
    b->hit = SH__LUA_HIT_TIME;
    lua_error(L);
}

static void log_line(sh__lua_box *b, const char *s)
{
    if (b->log)
        b->log(b->log_ud, s);
}

/* Lua warnings come in pieces (tocont set on all but the last); we log each piece as it comes. */
static void box_warn(void *ud, const char *msg, int tocont)
{
    (void)tocont;
    log_line(ud, msg);
}

/* ---- Replacements for the unsafe parts of base, string and table ------------------------------
 */

static int sb_print(lua_State *L)
{
    int n = lua_gettop(L);
    luaL_Buffer buf;
    luaL_buffinit(L, &buf);
    for (int i = 1; i <= n; i++) {
        if (i > 1)
            luaL_addchar(&buf, '\t');
        luaL_tolstring(L, i, NULL);
        luaL_addvalue(&buf);
    }
    luaL_pushresult(&buf);
    log_line(sh__lua_box_of(L), lua_tostring(L, -1));
    return 0;
}

/* load(text [, chunkname [, mode [, env]]]): text only (no reader functions, no bytecode). */
static int sb_load(lua_State *L)
{
    size_t len;
    const char *s = luaL_checklstring(L, 1, &len);
    const char *name = luaL_optstring(L, 2, "=(load)");
    const char *mode = luaL_optstring(L, 3, "t");
    if (strcmp(mode, "t") != 0)
        return luaL_error(L, "load: only text chunks (mode \"t\") are allowed in the sandbox");
    int has_env = !lua_isnone(L, 4);
    if (luaL_loadbufferx(L, s, len, name, "t") != LUA_OK) {
        lua_pushnil(L);
        lua_insert(L, -2);
        return 2;
    }
    if (has_env) {
        lua_pushvalue(L, 4);
        if (!lua_setupvalue(L, -2, 1))
            lua_pop(L, 1);
    }
    return 1;
}

/* A limit error must end the evaluation, so the protected calls rethrow it. */
static int finish_pcall(lua_State *L, int status, int base)
{
    sh__lua_box *b = sh__lua_box_of(L);
    if (status == LUA_ERRMEM || b->hit != SH__LUA_HIT_NONE)
        return lua_error(L);
    if (status != LUA_OK) {
        lua_pushboolean(L, 0);
        lua_insert(L, -2);
        return 2;
    }
    lua_pushboolean(L, 1);
    lua_insert(L, base);
    return lua_gettop(L) - base + 1;
}

static int sb_pcall(lua_State *L)
{
    luaL_checkany(L, 1);
    int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
    return finish_pcall(L, status, 1);
}

/* Lua runs a message handler for an error raised in a hook with hooks still disabled, so a
 * script's handler would run unbounded after a time limit: skip it for limit errors. */
static int xpcall_handler(lua_State *L)
{
    if (sh__lua_box_of(L)->hit != SH__LUA_HIT_NONE)
        return 1;
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, 1);
    return 1;
}

static int sb_xpcall(lua_State *L)
{
    int n = lua_gettop(L);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    lua_pushvalue(L, 2);
    lua_pushcclosure(L, xpcall_handler, 1);
    lua_replace(L, 2);
    lua_pushvalue(L, 1); /* stack: f, handler, args..., f */
    lua_rotate(L, 3, 1); /* f, handler, f, args... */
    int status = lua_pcall(L, n - 2, LUA_MULTRET, 2);
    return finish_pcall(L, status, 3);
}

/* Finalizers run with hooks off (lgc.c), so a __gc loop could hang the host: refuse them. */
static int sb_setmetatable(lua_State *L)
{
    lua_settop(L, 2);
    if (lua_type(L, 2) == LUA_TTABLE) {
        lua_pushliteral(L, "__gc");
        if (lua_rawget(L, 2) != LUA_TNIL)
            return luaL_error(L, "setmetatable: __gc is not allowed in the sandbox");
        lua_pop(L, 1);
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, 2, 1);
    return 1;
}

static int sb_collectgarbage(lua_State *L)
{
    static const char *const ok[] = {"collect", "step", "count", "isrunning", NULL};
    luaL_checkoption(L, 1, "collect", ok);
    int n = lua_gettop(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, n, LUA_MULTRET);
    return lua_gettop(L);
}

/* Calls the original library function (upvalue 1) with all arguments. */
static int call_original(lua_State *L)
{
    int n = lua_gettop(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, n, LUA_MULTRET);
    return lua_gettop(L);
}

/* Pattern functions run in C where the hook cannot stop them. Bound their worst case: every start
 * position (n + 1) times the pattern (m + 1), times n for each backtracking item (a quantifier or
 * %b). Plain find is memchr/memcmp: (n + 1) * (m + 1). Refuse calls above the budget. */
static int sb_pattern(lua_State *L)
{
    size_t n, m;
    luaL_checklstring(L, 1, &n);
    const char *p = luaL_checklstring(L, 2, &m);
    int q = 0;
    bool plain = lua_toboolean(L, 4) && lua_tocfunction(L, lua_upvalueindex(2)) != NULL;
    for (size_t i = 0; !plain && i < m; i++) {
        if (p[i] == '%')
            q += ++i < m && p[i] == 'b';
        else if (p[i] == '*' || p[i] == '+' || p[i] == '-' || p[i] == '?')
            q++;
    }
    double cost = (double)(q + 1) * log2((double)n + 2) + log2((double)m + 2);
    if (cost > log2((double)PATTERN_BUDGET))
        return luaL_error(L,
                          "pattern of %d bytes with %d repetitions is too costly for a %d-byte "
                          "subject in the sandbox",
                          (int)(m > 0x7fffffff ? 0x7fffffff : m), q,
                          (int)(n > 0x7fffffff ? 0x7fffffff : n));
    return call_original(L);
}

/* table.insert and table.remove loop in C up to #t; a __len metamethod could claim any length. */
static int sb_shift(lua_State *L)
{
    if (luaL_getmetafield(L, 1, "__len") != LUA_TNIL)
        return luaL_error(L, "table.insert/remove on a table with __len is not allowed in the "
                             "sandbox");
    return call_original(L);
}

/* string.rep of an empty string with an empty separator loops n times producing nothing. */
static int sb_rep(lua_State *L)
{
    size_t l, lsep;
    luaL_checklstring(L, 1, &l);
    lua_Integer n = luaL_checkinteger(L, 2);
    luaL_optlstring(L, 3, "", &lsep);
    if (n <= 0 || (l == 0 && lsep == 0)) {
        lua_pushliteral(L, "");
        return 1;
    }
    /* One allocation that cannot fit: the memory error it is about to raise names this line. */
    sh__lua_box *b = sh__lua_box_of(L);
    double want = ((double)l + (double)lsep) * (double)n;
    if (want > (double)(b->limit - (b->used < b->limit ? b->used : b->limit)))
        sh__lua_where(L, b->where, sizeof b->where);
    return call_original(L);
}

static int sb_move(lua_State *L)
{
    lua_Integer f = luaL_checkinteger(L, 2), t = luaL_checkinteger(L, 3);
    if (t >= f && (lua_Unsigned)t - (lua_Unsigned)f >= MOVE_MAX)
        return luaL_error(L, "table.move: range too large for the sandbox");
    return call_original(L);
}

/* Replaces lib[name] (lib at idx) with fn closed over the original. */
static void wrap(lua_State *L, int idx, const char *name, lua_CFunction fn)
{
    lua_getfield(L, idx, name);
    lua_pushcclosure(L, fn, 1);
    lua_setfield(L, idx, name);
}

static void drop(lua_State *L, int idx, const char *name)
{
    lua_pushnil(L);
    lua_setfield(L, idx, name);
}

/* Runs in protected mode: building the libraries allocates. */
static int open_sandbox(lua_State *L)
{
    static const luaL_Reg libs[] = {
        {LUA_GNAME, luaopen_base},       {LUA_STRLIBNAME, luaopen_string},
        {LUA_TABLIBNAME, luaopen_table}, {LUA_MATHLIBNAME, luaopen_math},
        {LUA_UTF8LIBNAME, luaopen_utf8}, {NULL, NULL}};
    for (const luaL_Reg *l = libs; l->name; l++) {
        luaL_requiref(L, l->name, l->func, 1);
        lua_pop(L, 1);
    }
    lua_pushglobaltable(L);
    int g = lua_gettop(L);
    drop(L, g, "dofile");
    drop(L, g, "loadfile");
    drop(L, g, "warn");
    lua_pushcfunction(L, sb_load);
    lua_setfield(L, g, "load");
    lua_pushcfunction(L, sb_print);
    lua_setfield(L, g, "print");
    lua_pushcfunction(L, sb_pcall);
    lua_setfield(L, g, "pcall");
    lua_pushcfunction(L, sb_xpcall);
    lua_setfield(L, g, "xpcall");
    wrap(L, g, "setmetatable", sb_setmetatable);
    wrap(L, g, "collectgarbage", sb_collectgarbage);

    lua_getfield(L, g, LUA_STRLIBNAME);
    int s = lua_gettop(L);
    drop(L, s, "dump");
    lua_getfield(L, s, "find"); /* find alone takes a plain flag: upvalue 2 says so */
    lua_pushcfunction(L, sb_pattern);
    lua_pushcclosure(L, sb_pattern, 2);
    lua_setfield(L, s, "find");
    wrap(L, s, "match", sb_pattern);
    wrap(L, s, "gmatch", sb_pattern);
    wrap(L, s, "gsub", sb_pattern);
    wrap(L, s, "rep", sb_rep);
    lua_getfield(L, g, LUA_TABLIBNAME);
    int t = lua_gettop(L);
    wrap(L, t, "move", sb_move);
    wrap(L, t, "insert", sb_shift);
    wrap(L, t, "remove", sb_shift);
    lua_settop(L, 0);
    return 0;
}

sh_err sh__lua_box_create(const sh_lua_limits *lim, size_t def_memory, uint32_t def_ms,
                          sh__lua_box **out, sh_error *e)
{
    *out = NULL;
    sh__lua_box *b = calloc(1, sizeof *b);
    if (!b)
        return sh__error_set(e, SH_ENOMEM, "cannot allocate a Lua sandbox");
    b->limit = lim && lim->memory_bytes ? lim->memory_bytes : def_memory;
    b->time_ms = lim && lim->time_ms ? lim->time_ms : def_ms;
    b->log = lim ? lim->log : NULL;
    b->log_ud = lim ? lim->log_ud : NULL;
    snprintf(b->name, sizeof b->name, "lua");
    b->L = lua_newstate(box_alloc, b);
    if (!b->L) {
        free(b);
        return sh__error_set(e, SH_ENOMEM, "cannot create a Lua state");
    }
    lua_setwarnf(b->L, box_warn, b);
    lua_pushcfunction(b->L, open_sandbox);
    if (lua_pcall(b->L, 0, 0, 0) != LUA_OK) {
        sh__lua_box_destroy(b);
        return sh__error_set(e, SH_ENOMEM, "Lua sandbox does not fit its memory limit");
    }
    *out = b;
    return SH_OK;
}

void sh__lua_box_destroy(sh__lua_box *b)
{
    if (!b)
        return;
    if (b->L)
        lua_close(b->L);
    free(b);
}

static sh_err load_status(sh__lua_box *b, int st, sh_error *e)
{
    if (st == LUA_OK)
        return SH_OK;
    sh_err code = st == LUA_ERRMEM ? SH_ENOMEM : SH_ELUA;
    if (st == LUA_ERRMEM)
        sh__error_set(e, code, "%s: memory limit of %zu bytes exceeded while compiling", b->name,
                      b->limit);
    else
        sh__error_set(e, code, "%s",
                      lua_type(b->L, -1) == LUA_TSTRING ? lua_tostring(b->L, -1)
                                                        : "cannot compile");
    lua_pop(b->L, 1);
    return code;
}

sh_err sh__lua_load_string(sh__lua_box *b, const char *src, size_t len, const char *name,
                           sh_error *e)
{
    char chunk[sizeof b->name + 1];
    snprintf(b->name, sizeof b->name, "%s", name && *name ? name : "string");
    snprintf(chunk, sizeof chunk, "=%s", b->name);
    if (len > MAX_SCRIPT)
        return sh__error_set(e, SH_EINVAL, "%s: script larger than %u bytes", b->name, MAX_SCRIPT);
    return load_status(b, luaL_loadbufferx(b->L, src ? src : "", len, chunk, "t"), e);
}

sh_err sh__lua_load_file(sh__lua_box *b, const char *path, sh_error *e)
{
    sh_file_map m;
    sh_err err = sh__file_map(path, 0, &m, e);
    if (err)
        return err;
    char chunk[1024];
    snprintf(b->name, sizeof b->name, "%s", path);
    snprintf(chunk, sizeof chunk, "@%s", path);
    if (m.size > MAX_SCRIPT) {
        sh__file_unmap(&m);
        return sh__error_set(e, SH_EINVAL, "%s: script larger than %u bytes", path, MAX_SCRIPT);
    }
    err = load_status(b,
                      luaL_loadbufferx(b->L, (const char *)(m.data ? m.data : (const uint8_t *)""),
                                       m.size, chunk, "t"),
                      e);
    sh__file_unmap(&m);
    return err;
}

/* Message handler: appends a traceback to runtime errors; validation and limit errors already
 * name their line and would only gain noise. */
static int msgh(lua_State *L)
{
    sh__lua_box *b = sh__lua_box_of(L);
    if (b->fail_code != SH_OK || b->hit != SH__LUA_HIT_NONE)
        return 1;
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
            msg = lua_tostring(L, -1);
        else
            msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* "msg\nstack traceback:\n\tf:3: in ...\n\t[C]: in ?" -> "msg (traceback: f:3: in ...)", keeping
 * only frames in scripts so that the line fits sh_error. */
static void compact(char *dst, size_t n, const char *src)
{
    const char *tb = strstr(src, "\nstack traceback:");
    size_t len = tb ? (size_t)(tb - src) : strlen(src);
    snprintf(dst, n, "%.*s", (int)len, src);
    if (!tb)
        return;
    const char *sep = " (traceback: ";
    int frames = 0;
    for (const char *l = strchr(tb + 1, '\n'); l; l = strchr(l + 1, '\n')) {
        const char *s = l + 1 + (l[1] == '\t');
        const char *end = strchr(s, '\n');
        size_t fl = end ? (size_t)(end - s) : strlen(s);
        if (fl == 0 || strncmp(s, "[C]", 3) == 0 || strncmp(s, "(...tail", 8) == 0)
            continue;
        size_t used = strlen(dst);
        snprintf(dst + used, n - used, "%s%.*s", sep, (int)fl, s);
        sep = "; ";
        frames++;
    }
    if (frames) {
        size_t used = strlen(dst);
        snprintf(dst + used, n - used, ")");
    }
}

sh_err sh__lua_call(sh__lua_box *b, int nargs, int nresults, sh_error *e)
{
    lua_State *L = b->L;
    int base = lua_gettop(L) - nargs;
    lua_pushcfunction(L, msgh);
    lua_insert(L, base);
    b->hit = SH__LUA_HIT_NONE;
    b->starved = false;
    b->fail_code = SH_OK;
    b->where[0] = '\0';
    b->near = b->hook_fast = false;
    b->deadline_ns = now_ns() + (int64_t)b->time_ms * 1000000;
    lua_sethook(L, box_hook, LUA_MASKCOUNT, HOOK_EVERY);
    int st = lua_pcall(L, nargs, nresults, base);
    lua_sethook(L, NULL, 0, 0);
    b->deadline_ns = 0;
    lua_remove(L, base);
    if (st == LUA_OK)
        return SH_OK;
    const char *msg = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "error";
    const char *where = b->where[0] ? b->where : b->name;
    sh_err code;
    if (b->hit == SH__LUA_HIT_TIME) {
        /* A handler that failed after the deadline replaces the hook's message, and a growth
         * the allocator refused after it raises a memory error: say the time limit again. */
        if (strstr(msg, "time limit"))
            code = sh__error_set(e, SH_ETIMEDOUT, "%s", msg);
        else
            code = sh__error_set(e, SH_ETIMEDOUT, "%s: time limit of %d ms exceeded", where,
                                 (int)b->time_ms);
    } else if (st == LUA_ERRMEM) {
        code =
            sh__error_set(e, SH_ENOMEM, "%s: memory limit of %zu bytes exceeded", where, b->limit);
    } else if (b->fail_code != SH_OK) {
        code = sh__error_set(e, b->fail_code, "%s", msg);
    } else {
        code = SH_ELUA;
        if (e) {
            e->code = code;
            compact(e->msg, sizeof e->msg, msg);
            if (st == LUA_ERRERR)
                snprintf(e->msg, sizeof e->msg, "%s: error in the error handler", b->name);
        }
    }
    lua_pop(L, 1);
    /* Whatever the script built before it failed is garbage now; give the memory back so the
     * next call starts with the full budget. No finalizer can run (__gc is refused). */
    lua_gc(L, LUA_GCCOLLECT);
    return code;
}

void sh__lua_where(lua_State *L, char *buf, size_t n)
{
    lua_Debug ar;
    for (int level = 1; lua_getstack(L, level, &ar); level++) {
        if (lua_getinfo(L, "Sl", &ar) && ar.currentline > 0) {
            snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
            return;
        }
    }
    snprintf(buf, n, "%s", sh__lua_box_of(L)->name);
}

int sh__lua_fail(lua_State *L, sh_err code, const char *where, const char *fmt, ...)
{
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sh__lua_box_of(L)->fail_code = code;
    lua_pushfstring(L, "%s: %s", where, msg);
    return lua_error(L);
}
