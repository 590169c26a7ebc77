/* route(req, replicas): a cluster script's routing function, kept in the sandbox the script ran
 * in and called by a model's router for each new request (docs/cluster.md, "Length-aware
 * routing"). */
#include <lauxlib.h>
#include <stdio.h>
#include <stdlib.h>

#include "lua/sandbox.h"

struct sh_config_route {
    sh__lua_box *box; /* registry["shoal.route.fn"] is the function */
};

sh_err sh__config_route_keep(sh_cluster_config *c, sh__lua_box *b, sh_error *e)
{
    struct sh_config_route *r = calloc(1, sizeof *r);
    if (!r) {
        sh__lua_box_destroy(b);
        return sh__error_set(e, SH_ENOMEM, "cannot keep the script's route()");
    }
    b->time_ms = SH_ROUTE_TIME_MS; /* per call, as a policy's level() */
    r->box = b;
    c->routing.route = r;
    return SH_OK;
}

void sh__config_route_destroy(struct sh_config_route *r)
{
    if (!r)
        return;
    sh__lua_box_destroy(r->box);
    free(r);
}

typedef struct call_args {
    const sh_route_req *q;
    const sh_route_replica *reps;
    int32_t n;
    int32_t choice;
} call_args;

/* Runs in protected mode: builds req and replicas, calls route, checks what it returned. */
static int call_route(lua_State *L)
{
    call_args *a = lua_touserdata(L, 1);
    if (lua_getfield(L, LUA_REGISTRYINDEX, "shoal.route.fn") != LUA_TFUNCTION)
        sh__lua_fail(L, SH_EINVAL, sh__lua_box_of(L)->name, "the script's route() is gone");
    lua_Debug ar;
    char where[LUA_IDSIZE + 24];
    lua_pushvalue(L, -1);
    lua_getinfo(L, ">S", &ar);
    snprintf(where, sizeof where, "%s:%d", ar.short_src, ar.linedefined);
    lua_createtable(L, 0, 4);
    lua_pushinteger(L, a->q->prompt_tokens);
    lua_setfield(L, -2, "prompt_tokens");
    lua_pushinteger(L, a->q->max_tokens);
    lua_setfield(L, -2, "max_tokens");
    lua_pushinteger(L, a->q->priority);
    lua_setfield(L, -2, "priority");
    lua_pushstring(L, a->q->model ? a->q->model : "");
    lua_setfield(L, -2, "model");
    lua_createtable(L, a->n, 0);
    for (int32_t i = 0; i < a->n; i++) {
        const sh_route_replica *p = &a->reps[i];
        lua_createtable(L, 0, 5);
        lua_pushinteger(L, p->index);
        lua_setfield(L, -2, "index");
        lua_pushinteger(L, p->tp);
        lua_setfield(L, -2, "tp");
        lua_pushinteger(L, p->stages);
        lua_setfield(L, -2, "stages");
        lua_pushnumber(L, p->load);
        lua_setfield(L, -2, "load");
        lua_pushboolean(L, p->healthy);
        lua_setfield(L, -2, "healthy");
        lua_rawseti(L, -2, i + 1);
    }
    lua_call(L, 2, 1);
    if (lua_isnil(L, -1)) {
        a->choice = -1;
        return 0;
    }
    int isint = 0;
    lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
    if (!isint)
        sh__lua_fail(L, SH_EINVAL, where,
                     "route(req, replicas) returned %s, expected a replica's index or nil",
                     lua_type(L, -1) == LUA_TNUMBER ? "a non-integer number"
                                                    : luaL_typename(L, -1));
    for (int32_t i = 0; i < a->n; i++)
        if (a->reps[i].index == v) {
            a->choice = (int32_t)v;
            return 0;
        }
    return sh__lua_fail(L, SH_EINVAL, where,
                        "route(req, replicas) returned %lld, not the index of one of the "
                        "model's replicas",
                        (long long)v);
}

sh_err sh_config_route_call(struct sh_config_route *r, const sh_route_req *q,
                            const sh_route_replica *reps, int32_t n, int32_t *choice, sh_error *e)
{
    if (!r)
        return sh__error_set(e, SH_EINVAL, "the script gives no route()");
    call_args a = {q, reps, n, -1};
    lua_pushcfunction(r->box->L, call_route);
    lua_pushlightuserdata(r->box->L, &a);
    sh_err err = sh__lua_call(r->box, 1, 0, e);
    if (!err)
        *choice = a.choice;
    return err;
}
