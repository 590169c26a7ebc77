/* Internal: the sandboxed Lua state (memory and time limits, safe libraries, protected calls with
 * error mapping) and the validation helpers the script kinds share. */
#ifndef SH_LUA_SANDBOX_H
#define SH_LUA_SANDBOX_H

#include <lua.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/error.h"
#include "lua/config.h"

/* Why the current evaluation stopped early. */
enum { SH__LUA_HIT_NONE, SH__LUA_HIT_TIME };

/* One sandboxed state. Heap-allocated because the allocator and the hook find it through the
 * state (lua_getallocf), so its address must not change. */
typedef struct sh__lua_box {
    lua_State *L;
    size_t used;  /* bytes the state holds now */
    size_t limit; /* allocation beyond this fails, which Lua reports as a memory error */
    uint32_t time_ms;
    int64_t deadline_ns; /* monotonic; 0 while no evaluation runs */
    int hit;             /* SH__LUA_HIT_* of the current evaluation */
    bool starved;        /* the allocator saw the deadline pass: it refuses every growth */
    uint32_t n_growths;  /* allocations that grew, counted to pace the allocator's clock reads */
    sh_err fail_code;    /* set by sh__lua_fail: a validation error, reported without traceback */
    char name[128];      /* the script's name for messages without a line */
    /* Where the script was last seen while it held more than half its memory limit ("f.lua:12"),
     * for the memory error, which Lua raises with no line; "" if nowhere yet this evaluation.
     * near: the state crossed half its limit and the hook is asked to look at the next
     * instruction (its count set to 1 once). */
    char where[160];
    bool near, hook_fast;
    sh_lua_log_fn log;
    void *log_ud;
    void *host; /* the script kind's builder (cluster, scenario), reachable from C functions */
} sh__lua_box;

/* Creates a state with base (without dofile, loadfile, warn; load only for text into the sandbox;
 * pcall and xpcall that cannot swallow a limit; setmetatable refusing __gc; collectgarbage limited
 * to collect/step/count; print routed to the log), string (without dump; patterns and rep guarded
 * against super-linear work), table (move bounded), math and utf8. Zero fields of `lim` take
 * def_memory / def_ms. SH_ENOMEM when the state cannot be built within the limit. */
sh_err sh__lua_box_create(const sh_lua_limits *lim, size_t def_memory, uint32_t def_ms,
                          sh__lua_box **out, sh_error *e);

/* Closes the state and frees the box; accepts NULL. */
void sh__lua_box_destroy(sh__lua_box *b);

/* The box a state belongs to. */
sh__lua_box *sh__lua_box_of(lua_State *L);

/* Reads a script file (at most 4 MiB) and pushes its compiled chunk, named "@path" so messages
 * say path:line. SH_EIO, SH_ELUA (syntax) or SH_ENOMEM; nothing pushed on failure. */
sh_err sh__lua_load_file(sh__lua_box *b, const char *path, sh_error *e);

/* The same for text held in memory, named `name` (default "string") in messages. */
sh_err sh__lua_load_string(sh__lua_box *b, const char *src, size_t len, const char *name,
                           sh_error *e);

/* Calls the function below `nargs` arguments on the stack under the time limit with a traceback
 * handler, leaving `nresults` results. On failure pops the function and arguments, fills e (the
 * message names file:line) and returns SH_ELUA, SH_ETIMEDOUT, SH_ENOMEM or the code given to
 * sh__lua_fail; after a limit the state is collected and stays usable. */
sh_err sh__lua_call(sh__lua_box *b, int nargs, int nresults, sh_error *e);

/* Writes "file:line" of the innermost Lua function on the call stack (the script line that called
 * the running C function) into buf. */
void sh__lua_where(lua_State *L, char *buf, size_t n);

/* Raises a validation error "where: message" that sh__lua_call reports as `code` without a
 * traceback. Never returns. */
int sh__lua_fail(lua_State *L, sh_err code, const char *where, const char *fmt, ...)
    SH_PRINTF(4, 5);

/* ---- Validation of tables coming from scripts (raw access only: no metamethods run) ---------- */

enum { SH__LUA_STR, SH__LUA_INT, SH__LUA_NUM, SH__LUA_BOOL, SH__LUA_TABLE, SH__LUA_ANY };

typedef struct sh__lua_field {
    const char *name;
    int type; /* SH__LUA_* */
    bool required;
} sh__lua_field;

/* Checks that the value at idx is a table whose keys are all named in `fields` (a list ended by a
 * NULL name) with values of the declared types, and that required fields are present. `what`
 * names the table in messages ("node", "cluster.batcher"). */
void sh__lua_check_fields(lua_State *L, int idx, const sh__lua_field *fields, const char *what,
                          const char *where);

/* Checks that the value at idx is a proper list (keys 1..n only) of at most max items; returns n.
 */
int32_t sh__lua_check_list(lua_State *L, int idx, const char *what, int32_t max, const char *where);

/* Raw reads of a checked field of the table at idx (which may be nil: an absent optional
 * table). Absent fields give the default (or NULL). */
const char *sh__lua_get_str(lua_State *L, int idx, const char *key);
int64_t sh__lua_get_int(lua_State *L, int idx, const char *key, int64_t def);
double sh__lua_get_num(lua_State *L, int idx, const char *key, double def);
bool sh__lua_get_bool(lua_State *L, int idx, const char *key, bool def);

/* Integer field within [lo, hi], else a validation error naming what.key. */
int64_t sh__lua_get_int_range(lua_State *L, int idx, const char *key, int64_t def, int64_t lo,
                              int64_t hi, const char *what, const char *where);

/* ---- Read-only objects made by constructors (node{}, model{}, ...) --------------------------- */

/* Pops the table on top and pushes a read-only proxy of it tagged with `kind`, the location of
 * the constructor call and an integer payload. Scripts read fields through the proxy but cannot
 * change them, reach the table, or forge the tag. */
void sh__lua_obj_new(lua_State *L, int kind, const char *where, int64_t payload);

/* If the value at idx is a proxy, pushes its data table and returns its kind (copying its
 * location into where and its payload into *payload when not NULL); else pushes nothing and
 * returns -1. */
int sh__lua_obj_get(lua_State *L, int idx, char *where, size_t n, int64_t *payload);

#endif
