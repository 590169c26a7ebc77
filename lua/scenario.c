/* Fault scenarios: at(t, action) with kill, stop, cont, leak, stall, delay, drop, duplicate,
 * corrupt, partition and heal, evaluated into a time-sorted array of sh_fault_event. The runtime
 * (link events, leak) and `shoal chaos` (process signals) execute them. */
#include <lauxlib.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lua/sandbox.h"
#include "shoal/fault.h"

#define DEF_MEMORY ((size_t)64 << 20)
#define DEF_TIME_MS 2000
#define MAX_EVENTS 100000
#define MAX_TIME_S 1e6
#define FAULT_MT "shoal.fault"
#define WHERE_MAX (LUA_IDSIZE + 24)

typedef struct builder {
    sh_fault_event *events;
    size_t n, cap;
} builder;

static const sh__lua_field stall_fields[] = {
    {"actor", SH__LUA_STR, true}, {"ms", SH__LUA_NUM, true}, {NULL, 0, false}};
static const sh__lua_field delay_fields[] = {
    {"link", SH__LUA_STR, false}, {"from", SH__LUA_STR, false},    {"to", SH__LUA_STR, false},
    {"ms", SH__LUA_NUM, true},    {"lasting", SH__LUA_NUM, false}, {NULL, 0, false}};
static const sh__lua_field drop_fields[] = {{"link", SH__LUA_STR, false},
                                            {"from", SH__LUA_STR, false},
                                            {"to", SH__LUA_STR, false},
                                            {"p", SH__LUA_NUM, false},
                                            {"lasting", SH__LUA_NUM, false},
                                            {"coll", SH__LUA_BOOL, false},
                                            {NULL, 0, false}};
static const sh__lua_field corrupt_fields[] = {{"link", SH__LUA_STR, false},
                                               {"from", SH__LUA_STR, false},
                                               {"to", SH__LUA_STR, false},
                                               {"bytes", SH__LUA_INT, true},
                                               {"p", SH__LUA_NUM, false},
                                               {"lasting", SH__LUA_NUM, false},
                                               {NULL, 0, false}};
static const sh__lua_field partition_fields[] = {{"a", SH__LUA_STR, true},
                                                 {"b", SH__LUA_STR, true},
                                                 {"lasting", SH__LUA_NUM, false},
                                                 {NULL, 0, false}};
static const sh__lua_field heal_fields[] = {
    {"link", SH__LUA_STR, false}, {"from", SH__LUA_STR, false}, {"to", SH__LUA_STR, false},
    {"a", SH__LUA_STR, false},    {"b", SH__LUA_STR, false},    {NULL, 0, false}};
static const sh__lua_field kill_fields[] = {{"node", SH__LUA_STR, true}, {NULL, 0, false}};
static const sh__lua_field stop_fields[] = {
    {"node", SH__LUA_STR, true}, {"lasting", SH__LUA_NUM, false}, {NULL, 0, false}};
static const sh__lua_field leak_fields[] = {{"node", SH__LUA_STR, true},
                                            {"mb_per_s", SH__LUA_NUM, true},
                                            {"lasting", SH__LUA_NUM, true},
                                            {NULL, 0, false}};

static const char *const kind_names[] = {
    [SH_FAULT_KILL] = "kill",           [SH_FAULT_STALL] = "stall",
    [SH_FAULT_DELAY] = "delay",         [SH_FAULT_DROP] = "drop",
    [SH_FAULT_DUPLICATE] = "duplicate", [SH_FAULT_CORRUPT] = "corrupt",
    [SH_FAULT_PARTITION] = "partition", [SH_FAULT_HEAL] = "heal",
    [SH_FAULT_STOP] = "stop",           [SH_FAULT_CONT] = "cont",
    [SH_FAULT_LEAK] = "leak",
};

const char *sh_scenario_kind_name(sh_fault_kind k)
{
    return (unsigned)k < sizeof kind_names / sizeof kind_names[0] ? kind_names[k] : "unknown";
}

/* A node name, "*" where allowed, or for actors "node/actor". */
static bool name_ok(const char *s, bool star, bool actor)
{
    size_t n = strlen(s);
    if (star && strcmp(s, "*") == 0)
        return true;
    if (n == 0 || n >= SH_FAULT_NAME_MAX || s[0] == '/' || s[n - 1] == '/')
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_' || *s == '.' || *s == '-' || (actor && *s == '/')))
            return false;
    return true;
}

static void set_name(lua_State *L, char *dst, const char *s, const char *what, const char *where)
{
    if (!name_ok(s, true, false))
        sh__lua_fail(L, SH_EINVAL, where, "%s: '%.40s' is not a node name or \"*\"", what, s);
    strcpy(dst, s);
}

/* link = "*" | "a->b" (either side may be "*"), or from/to; the default is every link. */
static void set_link(lua_State *L, sh_fault_event *ev, const char *what, const char *where)
{
    const char *link = sh__lua_get_str(L, 1, "link");
    const char *from = sh__lua_get_str(L, 1, "from"), *to = sh__lua_get_str(L, 1, "to");
    if (link && (from || to))
        sh__lua_fail(L, SH_EINVAL, where, "%s: give either link or from/to, not both", what);
    if (link && strcmp(link, "*") != 0) {
        const char *arrow = strstr(link, "->");
        if (!arrow || (size_t)(arrow - link) >= SH_FAULT_NAME_MAX)
            sh__lua_fail(L, SH_EINVAL, where,
                         "%s: link '%.60s' must be \"*\" or \"from->to\" (e.g. \"w0->w1\")", what,
                         link);
        char left[SH_FAULT_NAME_MAX];
        memcpy(left, link, (size_t)(arrow - link));
        left[arrow - link] = '\0';
        set_name(L, ev->from, left, what, where);
        set_name(L, ev->to, arrow + 2, what, where);
    }
    if (from)
        set_name(L, ev->from, from, what, where);
    if (to)
        set_name(L, ev->to, to, what, where);
}

static double get_num(lua_State *L, const char *key, double def, double lo, double hi, bool lo_open,
                      const char *what, const char *where)
{
    double v = sh__lua_get_num(L, 1, key, def);
    if (!(v >= lo && v <= hi) || (lo_open && v == lo))
        sh__lua_fail(L, SH_EINVAL, where, "%s: field '%s' must be %s %g and <= %g, got %g", what,
                     key, lo_open ? ">" : ">=", lo, hi, v);
    return v;
}

/* Pushes a fresh event userdata: "*" links, p = 1, no end. */
static sh_fault_event *new_event(lua_State *L, sh_fault_kind kind)
{
    sh_fault_event *ev = lua_newuserdatauv(L, sizeof *ev, 0);
    memset(ev, 0, sizeof *ev);
    ev->kind = kind;
    ev->p = 1;
    strcpy(ev->from, "*");
    strcpy(ev->to, "*");
    luaL_setmetatable(L, FAULT_MT);
    return ev;
}

/* kill, stop and cont: `kind "node"` or `kind{ node = "node" }` (stop also takes lasting). */
static int node_action(lua_State *L, sh_fault_kind kind, const sh__lua_field *fields)
{
    char where[WHERE_MAX];
    const char *what = kind_names[kind];
    sh__lua_where(L, where, sizeof where);
    const char *node;
    double lasting = INFINITY;
    if (lua_type(L, 1) == LUA_TSTRING) {
        node = lua_tostring(L, 1);
    } else {
        sh__lua_check_fields(L, 1, fields, what, where);
        node = sh__lua_get_str(L, 1, "node");
        if (kind == SH_FAULT_STOP)
            lasting = get_num(L, "lasting", INFINITY, 0, INFINITY, true, what, where);
    }
    if (!name_ok(node, false, false))
        sh__lua_fail(L, SH_EINVAL, where, "%s: '%.40s' is not a node name", what, node);
    sh_fault_event *ev = new_event(L, kind);
    strcpy(ev->from, node);
    ev->lasting_s = isinf(lasting) ? 0 : lasting;
    return 1;
}

static int l_kill(lua_State *L) { return node_action(L, SH_FAULT_KILL, kill_fields); }
static int l_stop(lua_State *L) { return node_action(L, SH_FAULT_STOP, stop_fields); }
static int l_cont(lua_State *L) { return node_action(L, SH_FAULT_CONT, kill_fields); }

static int l_leak(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    sh__lua_check_fields(L, 1, leak_fields, "leak", where);
    const char *node = sh__lua_get_str(L, 1, "node");
    if (!name_ok(node, false, false))
        sh__lua_fail(L, SH_EINVAL, where, "leak: '%.40s' is not a node name", node);
    double rate = get_num(L, "mb_per_s", 0, 0, 65536, true, "leak", where);
    double lasting = get_num(L, "lasting", 0, 0, 3600, true, "leak", where);
    sh_fault_event *ev = new_event(L, SH_FAULT_LEAK);
    strcpy(ev->from, node);
    ev->mb_per_s = rate;
    ev->lasting_s = lasting;
    return 1;
}

static int l_stall(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    sh__lua_check_fields(L, 1, stall_fields, "stall", where);
    const char *actor = sh__lua_get_str(L, 1, "actor");
    if (!name_ok(actor, false, true))
        sh__lua_fail(L, SH_EINVAL, where, "stall: '%.40s' is not an actor (\"node/actor\")", actor);
    double ms = get_num(L, "ms", 0, 0, 3.6e6, true, "stall", where);
    sh_fault_event *ev = new_event(L, SH_FAULT_STALL);
    strcpy(ev->from, actor);
    ev->ms = ms;
    return 1;
}

/* delay, drop, duplicate and corrupt share their shape. */
static int link_action(lua_State *L, sh_fault_kind kind)
{
    char where[WHERE_MAX];
    const char *what = kind_names[kind];
    sh__lua_where(L, where, sizeof where);
    sh__lua_check_fields(L, 1,
                         kind == SH_FAULT_DELAY     ? delay_fields
                         : kind == SH_FAULT_CORRUPT ? corrupt_fields
                                                    : drop_fields,
                         what, where);
    lua_settop(L, 1);
    sh_fault_event *ev = new_event(L, kind);
    set_link(L, ev, what, where);
    // The bounds are the fault layer's own (sh_fault_rule_add): a rule it would refuse is refused
    // here, before anything runs, rather than dropped by every node at its time.
    if (kind == SH_FAULT_DELAY)
        ev->ms = get_num(L, "ms", 0, 0, SH_FAULT_DELAY_MAX_MS, false, what, where);
    else
        ev->p = get_num(L, "p", 1, 0, 1, false, what, where);
    if (kind == SH_FAULT_CORRUPT)
        ev->bytes =
            (int32_t)sh__lua_get_int_range(L, 1, "bytes", 1, 1, SH_FAULT_FLIPS_MAX, what, where);
    ev->lasting_s = get_num(L, "lasting", INFINITY, 0, INFINITY, true, what, where);
    if (isinf(ev->lasting_s))
        ev->lasting_s = 0;
    // drop and duplicate { coll = true }: only the frames of the tensor-parallel groups'
    // network collectives on the link, not the nodes' messages.
    if ((kind == SH_FAULT_DROP || kind == SH_FAULT_DUPLICATE) &&
        sh__lua_get_bool(L, 1, "coll", false))
        ev->type = SH_FAULT_TYPE_COLL;
    return 1;
}

static int l_delay(lua_State *L) { return link_action(L, SH_FAULT_DELAY); }
static int l_drop(lua_State *L) { return link_action(L, SH_FAULT_DROP); }
static int l_duplicate(lua_State *L) { return link_action(L, SH_FAULT_DUPLICATE); }
static int l_corrupt(lua_State *L) { return link_action(L, SH_FAULT_CORRUPT); }

static int l_partition(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    sh__lua_check_fields(L, 1, partition_fields, "partition", where);
    lua_settop(L, 1);
    sh_fault_event *ev = new_event(L, SH_FAULT_PARTITION);
    set_name(L, ev->from, sh__lua_get_str(L, 1, "a"), "partition", where);
    set_name(L, ev->to, sh__lua_get_str(L, 1, "b"), "partition", where);
    ev->lasting_s = get_num(L, "lasting", INFINITY, 0, INFINITY, true, "partition", where);
    if (isinf(ev->lasting_s))
        ev->lasting_s = 0;
    return 1;
}

static int l_heal(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    if (lua_isnoneornil(L, 1)) {
        lua_settop(L, 0);
        lua_newtable(L);
    }
    sh__lua_check_fields(L, 1, heal_fields, "heal", where);
    lua_settop(L, 1);
    sh_fault_event *ev = new_event(L, SH_FAULT_HEAL);
    const char *a = sh__lua_get_str(L, 1, "a"), *b = sh__lua_get_str(L, 1, "b");
    if (a || b) {
        if (sh__lua_get_str(L, 1, "link") || sh__lua_get_str(L, 1, "from") ||
            sh__lua_get_str(L, 1, "to"))
            sh__lua_fail(L, SH_EINVAL, where, "heal: give a/b or a link, not both");
        if (a)
            set_name(L, ev->from, a, "heal", where);
        if (b)
            set_name(L, ev->to, b, "heal", where);
    } else {
        set_link(L, ev, "heal", where);
    }
    return 1;
}

static int l_at(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    if (lua_type(L, 1) != LUA_TNUMBER)
        sh__lua_fail(L, SH_EINVAL, where, "at: time must be a number of seconds, got %s",
                     luaL_typename(L, 1));
    double t = lua_tonumber(L, 1);
    if (!(t >= 0 && t <= MAX_TIME_S))
        sh__lua_fail(L, SH_EINVAL, where, "at: time must be within 0..%g seconds, got %g",
                     MAX_TIME_S, t);
    const sh_fault_event *ev = luaL_testudata(L, 2, FAULT_MT);
    if (!ev)
        sh__lua_fail(L, SH_EINVAL, where,
                     "at: second argument must be an action such as kill \"w1\", got %s",
                     luaL_typename(L, 2));
    builder *bd = sh__lua_box_of(L)->host;
    if (bd->n == MAX_EVENTS)
        sh__lua_fail(L, SH_EINVAL, where, "at: more than %d events", MAX_EVENTS);
    if (bd->n == bd->cap) {
        size_t cap = bd->cap ? bd->cap * 2 : 16;
        sh_fault_event *p = realloc(bd->events, cap * sizeof *p);
        if (!p)
            sh__lua_fail(L, SH_ENOMEM, where, "out of memory");
        bd->events = p;
        bd->cap = cap;
    }
    sh_fault_event *d = &bd->events[bd->n++];
    *d = *ev;
    d->time_s = t;
    const char *colon = strrchr(where, ':');
    d->line = colon ? atoi(colon + 1) : 0;
    return 0;
}

static int run_scenario(lua_State *L)
{
    static const luaL_Reg fns[] = {{"at", l_at},
                                   {"kill", l_kill},
                                   {"stall", l_stall},
                                   {"delay", l_delay},
                                   {"drop", l_drop},
                                   {"duplicate", l_duplicate},
                                   {"corrupt", l_corrupt},
                                   {"partition", l_partition},
                                   {"heal", l_heal},
                                   {"stop", l_stop},
                                   {"cont", l_cont},
                                   {"leak", l_leak},
                                   {NULL, NULL}};
    luaL_newmetatable(L, FAULT_MT);
    lua_pushliteral(L, "locked");
    lua_setfield(L, -2, "__metatable");
    lua_pop(L, 1);
    lua_pushglobaltable(L);
    luaL_setfuncs(L, fns, 0);
    lua_pop(L, 1);
    lua_pushvalue(L, 1);
    lua_call(L, 0, 0);
    return 0;
}

typedef struct order {
    double t;
    size_t i;
} order;

static int cmp_order(const void *a, const void *b)
{
    const order *x = a, *y = b;
    if (x->t != y->t)
        return x->t < y->t ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Sorts by time, keeping script order among equal times (qsort is not stable by itself). */
static sh_err sort_events(builder *bd, sh_error *e)
{
    order *o = malloc((bd->n ? bd->n : 1) * sizeof *o);
    sh_fault_event *sorted = malloc((bd->n ? bd->n : 1) * sizeof *sorted);
    if (!o || !sorted) {
        free(o);
        free(sorted);
        return sh__error_set(e, SH_ENOMEM, "cannot sort the scenario");
    }
    for (size_t i = 0; i < bd->n; i++)
        o[i] = (order){bd->events[i].time_s, i};
    qsort(o, bd->n, sizeof *o, cmp_order);
    for (size_t i = 0; i < bd->n; i++)
        sorted[i] = bd->events[o[i].i];
    free(o);
    free(bd->events);
    bd->events = sorted;
    return SH_OK;
}

static sh_err load(const char *path, const char *src, size_t len, const char *name,
                   const sh_lua_limits *limits, sh_scenario **out, sh_error *e)
{
    *out = NULL;
    sh__lua_box *b;
    sh_err err = sh__lua_box_create(limits, DEF_MEMORY, DEF_TIME_MS, &b, e);
    if (err)
        return err;
    builder bd = {0};
    b->host = &bd;
    err = path ? sh__lua_load_file(b, path, e) : sh__lua_load_string(b, src, len, name, e);
    if (!err) {
        lua_pushcfunction(b->L, run_scenario);
        lua_insert(b->L, -2);
        err = sh__lua_call(b, 1, 0, e);
    }
    sh_scenario *s = NULL;
    if (!err)
        err = sort_events(&bd, e);
    if (!err && !(s = calloc(1, sizeof *s)))
        err = sh__error_set(e, SH_ENOMEM, "cannot allocate a scenario");
    if (!err) {
        snprintf(s->source, sizeof s->source, "%s", b->name);
        s->events = bd.events;
        s->n_events = bd.n;
        bd.events = NULL;
        *out = s;
    }
    free(bd.events);
    sh__lua_box_destroy(b);
    return err;
}

sh_err sh_scenario_load_file(const char *path, const sh_lua_limits *limits, sh_scenario **out,
                             sh_error *e)
{
    return load(path, NULL, 0, NULL, limits, out, e);
}

sh_err sh_scenario_load_string(const char *src, size_t len, const char *name,
                               const sh_lua_limits *limits, sh_scenario **out, sh_error *e)
{
    return load(NULL, src, len, name, limits, out, e);
}

static bool known(const sh_cluster_config *c, const char *name, bool actor)
{
    if (strcmp(name, "*") == 0)
        return true;
    char node[SH_FAULT_NAME_MAX];
    snprintf(node, sizeof node, "%s", name);
    char *slash = actor ? strchr(node, '/') : NULL;
    if (slash)
        *slash = '\0';
    return sh_config_find_node(c, node) >= 0;
}

sh_err sh_scenario_check(const sh_scenario *s, const sh_cluster_config *c, sh_error *e)
{
    for (size_t i = 0; i < s->n_events; i++) {
        const sh_fault_event *ev = &s->events[i];
        bool actor = ev->kind == SH_FAULT_STALL;
        const char *bad = !known(c, ev->from, actor) ? ev->from
                          : !known(c, ev->to, false) ? ev->to
                                                     : NULL;
        if (bad)
            return sh__error_set(e, SH_ENOTFOUND, "%s:%d: %s: unknown node '%s'", s->source,
                                 (int)ev->line, sh_scenario_kind_name(ev->kind), bad);
    }
    return SH_OK;
}

void sh_scenario_destroy(sh_scenario *s)
{
    if (!s)
        return;
    free(s->events);
    free(s);
}
