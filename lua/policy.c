/* Degradation policies: a script defining level(m), called with the watchdog's metrics under the
 * sandbox limits; reloads replace the script only after it compiles and passes a trial call. */
#include <lauxlib.h>
#include <stdlib.h>
#include <string.h>

#include "lua/sandbox.h"

#define DEF_MEMORY ((size_t)8 << 20)
#define DEF_TIME_MS 50

struct sh_policy {
    sh_lua_limits limits;
    sh__lua_box *box; /* the script in force; NULL before the first successful load */
    /* The metrics of the last call, used for the trial call of a reload. */
    char **names;
    double *values;
    size_t n;
};

typedef struct call_args {
    const sh_policy_metric *m;
    size_t n;
    int32_t level;
} call_args;

/* Runs in protected mode: fetches level, builds the metrics table, calls, checks the result. */
static int call_level(lua_State *L)
{
    call_args *a = lua_touserdata(L, 1);
    sh__lua_box *b = sh__lua_box_of(L);
    lua_pushglobaltable(L);
    lua_pushliteral(L, "level");
    if (lua_rawget(L, -2) != LUA_TFUNCTION)
        sh__lua_fail(L, SH_EINVAL, b->name, "the script does not define a function level(m)");
    lua_Debug ar;
    char where[LUA_IDSIZE + 24];
    lua_pushvalue(L, -1);
    lua_getinfo(L, ">S", &ar);
    snprintf(where, sizeof where, "%s:%d", ar.short_src, ar.linedefined);
    lua_createtable(L, 0, (int)a->n);
    for (size_t i = 0; i < a->n; i++) {
        lua_pushstring(L, a->m[i].name);
        lua_pushnumber(L, (lua_Number)a->m[i].value);
        lua_rawset(L, -3);
    }
    lua_call(L, 1, 1);
    int isint = 0;
    lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
    if (!isint)
        sh__lua_fail(L, SH_EINVAL, where, "level(m) returned %s, expected an integer 0..%d",
                     lua_type(L, -1) == LUA_TNUMBER ? "a non-integer number" : luaL_typename(L, -1),
                     SH_POLICY_LEVEL_MAX);
    if (v < 0 || v > SH_POLICY_LEVEL_MAX)
        sh__lua_fail(L, SH_ERANGE, where, "level(m) returned %lld, expected 0..%d", (long long)v,
                     SH_POLICY_LEVEL_MAX);
    a->level = (int32_t)v;
    return 0;
}

static sh_err run_level(sh__lua_box *b, const sh_policy_metric *m, size_t n, int32_t *level,
                        sh_error *e)
{
    call_args a = {m, n, 0};
    lua_pushcfunction(b->L, call_level);
    lua_pushlightuserdata(b->L, &a);
    sh_err err = sh__lua_call(b, 1, 0, e);
    if (!err)
        *level = a.level;
    return err;
}

/* The struct's fields as name/value pairs, in the order of the struct. */
static void struct_pairs(const sh_policy_metrics *m, sh_policy_metric out[8])
{
    out[0] = (sh_policy_metric){"queue_wait_p99_ms", m->queue_wait_p99_ms};
    out[1] = (sh_policy_metric){"step_latency_p99_ms", m->step_latency_p99_ms};
    out[2] = (sh_policy_metric){"kv_used", m->kv_used};
    out[3] = (sh_policy_metric){"tokens_per_s", m->tokens_per_s};
    out[4] = (sh_policy_metric){"queue_depth", m->queue_depth};
    out[5] = (sh_policy_metric){"running_seqs", m->running_seqs};
    out[6] = (sh_policy_metric){"nodes_dead", m->nodes_dead};
    out[7] = (sh_policy_metric){"level", m->level};
}

static void forget(sh_policy *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->names[i]);
    free(p->names);
    free(p->values);
    p->names = NULL;
    p->values = NULL;
    p->n = 0;
}

/* Keeps a copy of the metrics for the next reload's trial call. Best effort: without memory the
 * trial falls back to zeros. */
static void remember(sh_policy *p, const sh_policy_metric *m, size_t n)
{
    bool same = n == p->n;
    for (size_t i = 0; same && i < n; i++)
        same = strcmp(p->names[i], m[i].name) == 0;
    if (!same) {
        forget(p);
        p->names = calloc(n ? n : 1, sizeof *p->names);
        p->values = calloc(n ? n : 1, sizeof *p->values);
        if (!p->names || !p->values) {
            forget(p);
            return;
        }
        for (; p->n < n; p->n++) {
            if (!(p->names[p->n] = strdup(m[p->n].name))) {
                forget(p);
                return;
            }
        }
    }
    for (size_t i = 0; i < n; i++)
        p->values[i] = m[i].value;
}

sh_err sh_policy_create(const sh_lua_limits *limits, sh_policy **out, sh_error *e)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return sh__error_set(e, SH_ENOMEM, "cannot allocate a policy");
    if (limits)
        (*out)->limits = *limits;
    return SH_OK;
}

static sh_err load(sh_policy *p, const char *path, const char *src, size_t len, const char *name,
                   sh_error *e)
{
    sh__lua_box *b;
    sh_err err = sh__lua_box_create(&p->limits, DEF_MEMORY, DEF_TIME_MS, &b, e);
    if (err)
        return err;
    err = path ? sh__lua_load_file(b, path, e) : sh__lua_load_string(b, src, len, name, e);
    if (!err)
        err = sh__lua_call(b, 0, 0, e);
    if (!err) {
        sh_policy_metric zeros[8], *trial = zeros;
        sh_policy_metrics z = {0};
        size_t n = 8;
        struct_pairs(&z, zeros);
        if (p->n) {
            trial = malloc(p->n * sizeof *trial);
            if (!trial) {
                sh__lua_box_destroy(b);
                return sh__error_set(e, SH_ENOMEM, "cannot allocate the trial metrics");
            }
            for (size_t i = 0; i < p->n; i++)
                trial[i] = (sh_policy_metric){p->names[i], p->values[i]};
            n = p->n;
        }
        int32_t level;
        err = run_level(b, trial, n, &level, e);
        if (trial != zeros)
            free(trial);
    }
    if (err) {
        sh__lua_box_destroy(b);
        return err;
    }
    sh__lua_box_destroy(p->box);
    p->box = b;
    return SH_OK;
}

/* lua/policy/default.lua, byte for byte (tests/unit/test_lua_policy.c compares them), so that
 * a binary copied away from its source tree still has the default policy. */
const char sh_policy_default_lua[] =
    "-- Default degradation policy (DESIGN.md section 7): level(m) maps the metrics\n"
    "-- to a level, 0 (normal) to 4 (shed load). `shoal serve --policy default` (or a\n"
    "-- cluster script's watchdog = { policy = 'default' }) evaluates it every tick.\n"
    "-- shoal carries a copy of this file (lua/policy.c; test_lua_policy checks that\n"
    "-- they are equal), so an installed binary needs no file. docs/serving.md tells\n"
    "-- what each level does.\n"
    "function level(m)\n"
    "  if m.queue_wait_p99_ms > 5000 or m.kv_used > 0.98 then return 4 end -- shed\n"
    "  if m.queue_wait_p99_ms > 2000 then return 3 end -- route to the light model\n"
    "  if m.queue_wait_p99_ms > 1000 then return 2 end -- cap max_tokens\n"
    "  if m.queue_wait_p99_ms > 500 then return 1 end -- no logprobs\n"
    "  return 0\n"
    "end\n";

sh_err sh_policy_load_default(sh_policy *p, sh_error *e)
{
    return load(p, NULL, sh_policy_default_lua, sizeof sh_policy_default_lua - 1,
                "lua/policy/default.lua (built in)", e);
}

sh_err sh_policy_load_file(sh_policy *p, const char *path, sh_error *e)
{
    return load(p, path, NULL, 0, NULL, e);
}

sh_err sh_policy_load_string(sh_policy *p, const char *src, size_t len, const char *name,
                             sh_error *e)
{
    return load(p, NULL, src, len, name, e);
}

sh_err sh_policy_set_trial(sh_policy *p, const sh_policy_metric *m, size_t n, sh_error *e)
{
    for (size_t i = 0; i < n; i++)
        if (!m[i].name)
            return sh__error_set(e, SH_EINVAL, "metric %zu has no name", i);
    remember(p, m, n);
    if (p->n != n)
        return sh__error_set(e, SH_ENOMEM, "cannot allocate the trial metrics");
    return SH_OK;
}

sh_err sh_policy_level_pairs(sh_policy *p, const sh_policy_metric *m, size_t n, int32_t *level,
                             sh_error *e)
{
    if (!p->box)
        return sh__error_set(e, SH_EINVAL, "no policy script is loaded");
    for (size_t i = 0; i < n; i++)
        if (!m[i].name)
            return sh__error_set(e, SH_EINVAL, "metric %zu has no name", i);
    sh_err err = run_level(p->box, m, n, level, e);
    if (!err)
        remember(p, m, n);
    return err;
}

sh_err sh_policy_level(sh_policy *p, const sh_policy_metrics *m, int32_t *level, sh_error *e)
{
    sh_policy_metric pairs[8];
    struct_pairs(m, pairs);
    return sh_policy_level_pairs(p, pairs, 8, level, e);
}

void sh_policy_destroy(sh_policy *p)
{
    if (!p)
        return;
    sh__lua_box_destroy(p->box);
    forget(p);
    free(p);
}
