/* cluster.lua: the constructors model{}, node{}, replica{}, pipeline() and cluster{}, which check
 * their arguments where they are called (so errors carry that file:line) and copy the topology
 * into an sh_cluster_config. */
#include <lauxlib.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "lua/sandbox.h"

#define DEF_MEMORY ((size_t)64 << 20)
#define DEF_TIME_MS 2000
#define MAX_NODES 1024
#define MAX_REPLICAS 256
#define MAX_STAGES 256
#define MAX_LAYERS 65536
#define MAX_KEYS 64
#define WHERE_MAX (LUA_IDSIZE + 24)
#define MAX_MEMORY ((uint64_t)1 << 50) /* kv.memory: 1 PiB, beyond any machine's KV budget */

enum { K_NODE = 1, K_MODEL, K_REPLICA, K_STAGE, K_CLUSTER };

/* Configs built by cluster{} calls in this evaluation. The builder owns them until the script's
 * result is chosen, so an error half-way through a conversion leaks nothing. */
typedef struct builder {
    sh_cluster_config **built;
    int32_t n, cap;
    int64_t result;
} builder;

static uint64_t parse_memory(lua_State *L, int idx, const char *what, const char *where);

static const sh__lua_field node_fields[] = {
    {"name", SH__LUA_STR, true},      {"listen", SH__LUA_STR, true},
    {"standby", SH__LUA_BOOL, false}, {"tls_cert", SH__LUA_STR, false},
    {"tls_key", SH__LUA_STR, false},  {"memory_budget", SH__LUA_ANY, false},
    {"preload", SH__LUA_STR, false},  {NULL, 0, false}};
static const sh__lua_field model_fields[] = {{"name", SH__LUA_STR, true},
                                             {"path", SH__LUA_STR, true},
                                             {"layers", SH__LUA_INT, false},
                                             {NULL, 0, false}};
static const sh__lua_field replica_fields[] = {
    {"model", SH__LUA_ANY, true},      {"stages", SH__LUA_TABLE, true},
    {"tp", SH__LUA_INT, false},        {"link_dtype", SH__LUA_STR, false},
    {"tp_link", SH__LUA_STR, false},   {"tp_compress", SH__LUA_STR, false},
    {"drafter", SH__LUA_TABLE, false}, {NULL, 0, false}};
static const sh__lua_field drafter_fields[] = {{"node", SH__LUA_STR, true},
                                               {"model", SH__LUA_STR, false},
                                               {"self", SH__LUA_ANY, false},
                                               {NULL, 0, false}};
static const sh__lua_field stage_fields[] = {{"node", SH__LUA_STR, false},
                                             {"nodes", SH__LUA_TABLE, false},
                                             {"first_layer", SH__LUA_INT, false},
                                             {"last_layer", SH__LUA_INT, false},
                                             {NULL, 0, false}};
static const sh__lua_field cluster_fields[] = {
    {"nodes", SH__LUA_TABLE, true},
    {"gateway", SH__LUA_TABLE, true},
    {"replicas", SH__LUA_TABLE, true},
    {"models", SH__LUA_TABLE, false},
    {"batcher", SH__LUA_TABLE, false},
    {"kv", SH__LUA_TABLE, false},
    {"watchdog", SH__LUA_TABLE, false},
    {"key_file", SH__LUA_STR, false},
    {"tls_ca", SH__LUA_STR, false},
    {"routing", SH__LUA_TABLE, false},
    {NULL, 0, false},
};
static const sh__lua_field routing_fields[] = {
    {"long_prompt", SH__LUA_INT, false}, {"route", SH__LUA_ANY, false}, {NULL, 0, false}};
static const sh__lua_field gateway_fields[] = {{"node", SH__LUA_STR, true},
                                               {"http", SH__LUA_STR, true},
                                               {"api_keys", SH__LUA_TABLE, false},
                                               {NULL, 0, false}};
static const sh__lua_field batcher_fields[] = {
    {"max_step_tokens", SH__LUA_INT, false}, {"max_seqs", SH__LUA_INT, false},
    {"max_wait_ms", SH__LUA_INT, false},     {"spec", SH__LUA_STR, false},
    {"spec_k", SH__LUA_INT, false},          {NULL, 0, false}};
static const sh__lua_field kv_fields[] = {{"block_tokens", SH__LUA_INT, false},
                                          {"prefix_cache", SH__LUA_BOOL, false},
                                          {"memory", SH__LUA_ANY, false},
                                          {"type", SH__LUA_STR, false},
                                          {NULL, 0, false}};
static const sh__lua_field watchdog_fields[] = {{"heartbeat_ms", SH__LUA_INT, false},
                                                {"dead_after", SH__LUA_INT, false},
                                                {"policy", SH__LUA_STR, false},
                                                {"hold_s", SH__LUA_NUM, false},
                                                {"degrade_max_tokens", SH__LUA_INT, false},
                                                {"fallback", SH__LUA_STR, false},
                                                {"shed_priority", SH__LUA_INT, false},
                                                {NULL, 0, false}};

/* Node and model names travel in frames and logs: keep them short and plain. */
static bool name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 63)
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_' || *s == '.' || *s == '-'))
            return false;
    return true;
}

/* "host:port" with a non-empty host (a name, an address, [ipv6] or *) and a port 1..65535. */
static const char *hostport_error(const char *s)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s)
        return "expected host:port";
    if (s[0] == '[' ? colon[-1] != ']' : memchr(s, ':', (size_t)(colon - s)) != NULL)
        return "an IPv6 host must be written in brackets";
    for (const char *p = s; p < colon; p++)
        if ((unsigned char)*p <= ' ' || *p == '/' || *p == '@')
            return "bad character in the host";
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (colon[1] < '0' || colon[1] > '9' || *end || port < 1 || port > 65535)
        return "port must be 1..65535";
    return NULL;
}

/* NNG addresses: inproc://name, ipc://path, tcp://host:port, tls+tcp://host:port. */
static const char *url_error(const char *s)
{
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p <= ' ')
            return "spaces and control characters are not allowed";
    static const char *const plain[] = {"inproc://", "ipc://"};
    for (int i = 0; i < 2; i++)
        if (strncmp(s, plain[i], strlen(plain[i])) == 0)
            return s[strlen(plain[i])] ? NULL : "empty address after the scheme";
    if (strncmp(s, "tcp://", 6) == 0)
        return hostport_error(s + 6);
    if (strncmp(s, "tls+tcp://", 10) == 0)
        return hostport_error(s + 10);
    return "scheme must be inproc://, ipc://, tcp:// or tls+tcp://";
}

static void check_name(lua_State *L, const char *what, const char *name, const char *where)
{
    if (!name_ok(name))
        sh__lua_fail(L, SH_EINVAL, where,
                     "%s: name '%.40s' must be 1-63 characters of A-Z a-z 0-9 _ . -", what, name);
}

/* Pushes t[key] without metamethods: plain tables from scripts may carry an __index. */
static int raw_field(lua_State *L, int idx, const char *key)
{
    idx = lua_absindex(L, idx);
    lua_pushstring(L, key);
    return lua_rawget(L, idx);
}

static void validate_node(lua_State *L, int idx, const char *where)
{
    sh__lua_check_fields(L, idx, node_fields, "node", where);
    check_name(L, "node", sh__lua_get_str(L, idx, "name"), where);
    const char *url = sh__lua_get_str(L, idx, "listen");
    const char *why = url_error(url);
    if (why)
        sh__lua_fail(L, SH_EINVAL, where, "node '%s': bad listen URL '%.80s': %s",
                     sh__lua_get_str(L, idx, "name"), url, why);
    static const char *const tls_keys[2] = {"tls_cert", "tls_key"};
    for (int k = 0; k < 2; k++) {
        const char *v = sh__lua_get_str(L, idx, tls_keys[k]);
        if (v && !*v)
            sh__lua_fail(L, SH_EINVAL, where, "node '%s': field '%s' is empty",
                         sh__lua_get_str(L, idx, "name"), tls_keys[k]);
    }
}

static void validate_model(lua_State *L, int idx, const char *where)
{
    sh__lua_check_fields(L, idx, model_fields, "model", where);
    check_name(L, "model", sh__lua_get_str(L, idx, "name"), where);
    if (!*sh__lua_get_str(L, idx, "path"))
        sh__lua_fail(L, SH_EINVAL, where, "model: field 'path' is empty");
    sh__lua_get_int_range(L, idx, "layers", 1, 1, MAX_LAYERS, "model", where);
}

/* replica{ link_dtype = ... }: the GGUF type id of the name, or -1 when it is not one. */
static int32_t link_dtype_of(const char *s)
{
    if (!s || !strcmp(s, "f32"))
        return 0; /* SH_DTYPE_F32 */
    if (!strcmp(s, "f16"))
        return 1; /* SH_DTYPE_F16 */
    if (!strcmp(s, "int8"))
        return 24; /* SH_DTYPE_I8 */
    return -1;
}

/* replica{ tp_compress = ... }: 0 none, 1 f16, 2 int8 (sh_coll_compress), or -1. */
static int32_t tp_compress_of(const char *s)
{
    if (!s || !strcmp(s, "none"))
        return 0;
    if (!strcmp(s, "f16"))
        return 1;
    if (!strcmp(s, "int8"))
        return 2;
    return -1;
}

/* replica{ drafter = {...} } at idx: a node and exactly one of a draft model's file (model) and
 * the replica's own first layers (self, a whole number; its upper bound is the model's layer
 * count, checked where that is known). */
static void validate_drafter(lua_State *L, int idx, const char *where)
{
    sh__lua_check_fields(L, idx, drafter_fields, "replica.drafter", where);
    const char *model = sh__lua_get_str(L, idx, "model");
    int t = raw_field(L, idx, "self");
    if (lua_rawlen(L, idx) > 0 || (model && t != LUA_TNIL) || (!model && t == LUA_TNIL))
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica.drafter: give exactly one of model = \"draft.gguf\" (a draft "
                     "model's file) and self = LAYERS (the model's own first layers and its "
                     "output head)%s",
                     model && t != LUA_TNIL ? ", not both" : "");
    if (model && !*model)
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica.drafter: model must name the draft model's GGUF file");
    if (t != LUA_TNIL) {
        int isint = 0;
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        const char *q = t == LUA_TSTRING ? "\"" : "";
        if (t != LUA_TNUMBER || !isint || v < 1 || v >= MAX_LAYERS)
            sh__lua_fail(L, SH_EINVAL, where,
                         "replica.drafter: self = %s%.40s%s must be a whole number of layers, "
                         "from 1 to one less than the model's",
                         q, luaL_tolstring(L, -1, NULL), q);
    }
    lua_pop(L, 1);
}

static void validate_replica(lua_State *L, int idx, const char *where)
{
    sh__lua_check_fields(L, idx, replica_fields, "replica", where);
    int t = raw_field(L, idx, "model");
    if (t != LUA_TSTRING && t != LUA_TTABLE)
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica: field 'model' must be a model{} or a model name, got %s",
                     luaL_typename(L, -1));
    lua_pop(L, 1);
    if (raw_field(L, idx, "tp") != LUA_TNIL) {
        int isint = 0;
        lua_Integer tp = lua_tointegerx(L, -1, &isint);
        if (!isint || tp < 1 || tp > SH_CONFIG_MAX_TP)
            sh__lua_fail(L, SH_EINVAL, where,
                         "replica: tp = %s: the ranks of each stage's tensor-parallel group must "
                         "be a whole number from 1 to %d",
                         luaL_tolstring(L, -1, NULL), SH_CONFIG_MAX_TP);
    }
    lua_pop(L, 1);
    const char *tl = sh__lua_get_str(L, idx, "tp_link");
    if (tl && strcmp(tl, "auto") != 0 && strcmp(tl, "net") != 0 && strcmp(tl, "hier") != 0)
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica: tp_link '%.40s' must be \"auto\", \"net\" or \"hier\"", tl);
    // Only the network collective compresses (over two levels, the hosts' leaders' links); a
    // group on shared memory would ignore it.
    const char *tc = sh__lua_get_str(L, idx, "tp_compress");
    if (tp_compress_of(tc) < 0)
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica: tp_compress '%.40s' must be \"none\", \"f16\" or \"int8\"", tc);
    if (tp_compress_of(tc) > 0 && !(tl && (!strcmp(tl, "net") || !strcmp(tl, "hier"))))
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica: tp_compress = \"%s\" needs tp_link = \"net\" or \"hier\" (only "
                     "the network collective compresses; a group on shared memory exchanges f32)",
                     tc);
    const char *ld = sh__lua_get_str(L, idx, "link_dtype");
    if (link_dtype_of(ld) < 0)
        sh__lua_fail(L, SH_EINVAL, where,
                     "replica: link_dtype '%.40s' must be \"f32\", \"f16\" or \"int8\"", ld);
    if (raw_field(L, idx, "drafter") != LUA_TNIL)
        validate_drafter(L, lua_gettop(L), where);
    lua_pop(L, 1);
}

/* Pushes the data table of an object of `kind` at idx, or validates a plain table in its place
 * (located at the enclosing constructor). Copies the location into owhere. */
static void coerce(lua_State *L, int idx, int kind, const char *what, const char *where,
                   char *owhere)
{
    idx = lua_absindex(L, idx);
    int k = sh__lua_obj_get(L, idx, owhere, WHERE_MAX, NULL);
    if (k == kind)
        return;
    if (k >= 0)
        sh__lua_fail(L, SH_EINVAL, where, "expected %s, got another kind of object", what);
    snprintf(owhere, WHERE_MAX, "%s", where);
    if (kind == K_NODE)
        validate_node(L, idx, where);
    else if (kind == K_MODEL)
        validate_model(L, idx, where);
    else if (kind == K_REPLICA)
        validate_replica(L, idx, where);
    else
        sh__lua_check_fields(L, idx, stage_fields, "stage", where);
    lua_pushvalue(L, idx);
}

static int ctor(lua_State *L, int kind, void (*validate)(lua_State *, int, const char *))
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    validate(L, 1, where);
    lua_settop(L, 1);
    /* Copy the argument so later changes to the script's table cannot bypass the checks. */
    lua_newtable(L);
    lua_pushnil(L);
    while (lua_next(L, 1)) {
        lua_pushvalue(L, -2);
        lua_insert(L, -2);
        lua_rawset(L, 2);
    }
    sh__lua_obj_new(L, kind, where, 0);
    return 1;
}

static int l_node(lua_State *L) { return ctor(L, K_NODE, validate_node); }
static int l_model(lua_State *L) { return ctor(L, K_MODEL, validate_model); }
static int l_replica(lua_State *L) { return ctor(L, K_REPLICA, validate_replica); }

/* The boundary before stage k (0 <= k <= n_stages) of a split of n_layers over n_stages stages
 * (n_stages <= n_layers). Without weights the split is even, floor(k * n_layers / n_stages), as
 * it always was. With weights, the boundary is the cumulative share rounded to the nearest layer
 * (halves up), floor(n_layers * (w_0 + ... + w_{k-1}) / (w_0 + ... + w_{n-1}) + 0.5), clamped
 * into [boundary k-1 + 1, n_layers - (n_stages - k)] so that every stage keeps at least one
 * layer and enough are left for the stages after it. */
static int32_t bound(int32_t n_layers, int32_t n_stages, const double *w, double total, double cum,
                     int32_t k, int32_t prev)
{
    if (k == 0)
        return 0;
    if (k == n_stages)
        return n_layers;
    if (!w)
        return (int32_t)((int64_t)k * n_layers / n_stages);
    double x = floor((double)n_layers * (cum / total) + 0.5);
    int32_t lo = prev + 1, hi = n_layers - (n_stages - k);
    return x < lo ? lo : x > hi ? hi : (int32_t)x;
}

/* Fills first[i], last[i] for n stages with optional weights w (n of them, all > 0). */
static void split_layers(int32_t n_layers, int32_t n, const double *w, int32_t *first,
                         int32_t *last)
{
    double total = 0, cum = 0;
    for (int32_t i = 0; w && i < n; i++)
        total += w[i];
    int32_t b = 0;
    for (int32_t i = 0; i < n; i++) {
        first[i] = b;
        cum += w ? w[i] : 0;
        b = bound(n_layers, n, w, total, cum, i + 1, b);
        last[i] = b;
    }
}

sh_err sh_config_replica_layers(const sh_config_replica *r, int32_t n_layers, int32_t *first,
                                int32_t *last, sh_error *e)
{
    if (r->n_stages < 1 || r->n_stages > n_layers)
        return sh__error_set(e, SH_EINVAL, "%d stages for a model of %d layers", (int)r->n_stages,
                             (int)n_layers);
    bool weighted = false;
    for (int32_t i = 0; i < r->n_stages; i++) {
        if (r->stages[i].first_layer >= 0) { /* written out, or resolved by the loader */
            first[i] = r->stages[i].first_layer;
            last[i] = r->stages[i].last_layer;
            continue;
        }
        weighted |= r->stages[i].weight > 0;
    }
    if (r->stages[0].first_layer >= 0)
        return SH_OK;
    double w[MAX_STAGES];
    for (int32_t i = 0; weighted && i < r->n_stages && i < MAX_STAGES; i++)
        w[i] = r->stages[i].weight > 0 ? r->stages[i].weight : 1.0;
    split_layers(n_layers, r->n_stages, weighted ? w : NULL, first, last);
    return SH_OK;
}

/* pipeline()'s third argument: the weights (when given) into w, the layer count into *layers. */
static bool pipeline_opts(lua_State *L, int32_t n, double *w, int64_t *layers, const char *where)
{
    if (lua_isnoneornil(L, 3))
        return false;
    if (lua_type(L, 3) != LUA_TTABLE) {
        int isint = 0;
        lua_Integer v = lua_tointegerx(L, 3, &isint);
        if (!isint || v < 1 || v > MAX_LAYERS)
            sh__lua_fail(L, SH_EINVAL, where,
                         "pipeline: third argument must be a layer count 1..%d or a table "
                         "{ weights = {...} }",
                         MAX_LAYERS);
        if (*layers && *layers != v)
            sh__lua_fail(L, SH_EINVAL, where, "pipeline: %lld layers given but the model has %lld",
                         (long long)v, (long long)*layers);
        *layers = v;
        return false;
    }
    static const sh__lua_field opt_fields[] = {{"weights", SH__LUA_TABLE, false}, {NULL, 0, false}};
    sh__lua_check_fields(L, 3, opt_fields, "pipeline options", where);
    if (raw_field(L, 3, "weights") == LUA_TNIL) {
        lua_pop(L, 1);
        return false;
    }
    int32_t k = sh__lua_check_list(L, lua_gettop(L), "pipeline weights", MAX_STAGES, where);
    if (k != n)
        sh__lua_fail(L, SH_EINVAL, where,
                     "pipeline: weights has %d entr%s for %d node%s: give one weight per stage",
                     (int)k, k == 1 ? "y" : "ies", (int)n, n == 1 ? "" : "s");
    for (int32_t i = 0; i < n; i++) {
        int t = lua_rawgeti(L, -1, i + 1);
        double v = t == LUA_TNUMBER ? lua_tonumber(L, -1) : -1;
        if (t != LUA_TNUMBER || !(v > 0) || !isfinite(v) || v > 1e9) {
            char got[64];
            if (t == LUA_TNUMBER)
                snprintf(got, sizeof got, "%.6g", v);
            else
                snprintf(got, sizeof got, "a %s", luaL_typename(L, -1));
            sh__lua_fail(L, SH_EINVAL, where,
                         "pipeline: weights[%d] must be a positive number (at most 1e9), got %s",
                         (int)i + 1, got);
        }
        w[i] = v;
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    return true;
}

/* pipeline(m, { "w0", "w1" } [, layers | { weights = { 2, 1 } }]): one stage per node in order,
 * layers split evenly or by weight when the count is known (from model{ layers = n } or the
 * third argument), else left to whoever loads the model (sh_config_replica_layers). */
static int l_pipeline(lua_State *L)
{
    char where[WHERE_MAX], mwhere[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    int64_t layers = 0;
    if (lua_type(L, 1) != LUA_TSTRING) {
        if (sh__lua_obj_get(L, 1, mwhere, sizeof mwhere, NULL) != K_MODEL)
            sh__lua_fail(L, SH_EINVAL, where,
                         "pipeline: first argument must be a model{} or a model name");
        layers = sh__lua_get_int(L, -1, "layers", 0);
        lua_pop(L, 1);
    }
    int32_t n = sh__lua_check_list(L, 2, "pipeline nodes", MAX_STAGES, where);
    if (n == 0)
        sh__lua_fail(L, SH_EINVAL, where, "pipeline: needs at least one node");
    double w[MAX_STAGES];
    bool weighted = pipeline_opts(L, n, w, &layers, where);
    if (layers && n > layers)
        sh__lua_fail(L, SH_EINVAL, where, "pipeline: %d stages for %lld layers", (int)n,
                     (long long)layers);
    int32_t first[MAX_STAGES], last[MAX_STAGES];
    if (layers)
        split_layers((int32_t)layers, n, weighted ? w : NULL, first, last);
    lua_createtable(L, n, 0);
    int out = lua_gettop(L);
    for (int32_t i = 0; i < n; i++) {
        int t = lua_rawgeti(L, 2, i + 1);
        if (t != LUA_TSTRING && t != LUA_TTABLE)
            sh__lua_fail(L, SH_EINVAL, where,
                         "pipeline: node %d must be a node name or a list of node names (a "
                         "tensor-parallel group), got %s",
                         (int)i + 1, luaL_typename(L, -1));
        lua_createtable(L, 0, 6);
        lua_insert(L, -2);
        if (t == LUA_TTABLE) { /* a group: its names are checked with the stage (fill_stages) */
            lua_newtable(L);
            int32_t g = sh__lua_check_list(L, -2, "pipeline group", SH_CONFIG_MAX_TP, where);
            for (int32_t j = 0; j < g; j++) {
                lua_rawgeti(L, -2, j + 1);
                lua_rawseti(L, -2, j + 1);
            }
            lua_setfield(L, -3, "nodes");
            lua_pop(L, 1);
        } else {
            check_name(L, "pipeline", lua_tostring(L, -1), where);
            lua_setfield(L, -2, "node");
        }
        if (layers) {
            lua_pushinteger(L, first[i]);
            lua_setfield(L, -2, "first_layer");
            lua_pushinteger(L, last[i]);
            lua_setfield(L, -2, "last_layer");
            lua_pushboolean(L, 1); /* pipeline's split, not the script's: replica{ tp } redoes it */
            lua_setfield(L, -2, "split");
        }
        if (weighted) {
            lua_pushnumber(L, w[i]);
            lua_setfield(L, -2, "weight");
        }
        sh__lua_obj_new(L, K_STAGE, where, 0);
        lua_rawseti(L, out, i + 1);
    }
    return 1;
}

/* ---- cluster{}: conversion into C ------------------------------------------------------------ */

static char *dup(lua_State *L, const char *s, const char *where)
{
    char *d = strdup(s);
    if (!d)
        sh__lua_fail(L, SH_ENOMEM, where, "out of memory");
    return d;
}

static void *zalloc(lua_State *L, size_t n, size_t size, const char *where)
{
    void *p = calloc(n ? n : 1, size);
    if (!p)
        sh__lua_fail(L, SH_ENOMEM, where, "out of memory");
    return p;
}

/* Pushes cluster.<key> (nil when absent) and returns its index. */
static int field(lua_State *L, const char *key)
{
    raw_field(L, 1, key);
    return lua_gettop(L);
}

static int32_t node_index(lua_State *L, const sh_cluster_config *c, const char *name,
                          const char *what, const char *where)
{
    int32_t i = sh_config_find_node(c, name);
    if (i < 0)
        sh__lua_fail(L, SH_ENOTFOUND, where, "%s: unknown node '%.63s'", what, name);
    if (c->nodes[i].standby)
        sh__lua_fail(L, SH_EINVAL, where, "%s: node '%s' is a standby and cannot serve", what,
                     name);
    return i;
}

static void fill_nodes(lua_State *L, sh_cluster_config *c, const char *where)
{
    int idx = field(L, "nodes");
    int32_t n = sh__lua_check_list(L, idx, "cluster.nodes", MAX_NODES, where);
    if (n == 0)
        sh__lua_fail(L, SH_EINVAL, where, "cluster.nodes is empty");
    c->nodes = zalloc(L, (size_t)n, sizeof *c->nodes, where);
    for (int32_t i = 0; i < n; i++) {
        char nwhere[WHERE_MAX];
        lua_rawgeti(L, idx, i + 1);
        coerce(L, -1, K_NODE, "node{...}", where, nwhere);
        const char *name = sh__lua_get_str(L, -1, "name");
        const char *listen = sh__lua_get_str(L, -1, "listen");
        for (int32_t j = 0; j < i; j++) {
            if (strcmp(c->nodes[j].name, name) == 0)
                sh__lua_fail(L, SH_EINVAL, nwhere, "duplicate node name '%s'", name);
            if (strcmp(c->nodes[j].listen, listen) == 0)
                sh__lua_fail(L, SH_EINVAL, nwhere, "node '%s' listens on '%.80s' like node '%s'",
                             name, listen, c->nodes[j].name);
        }
        sh_config_node *d = &c->nodes[c->n_nodes++];
        d->standby = sh__lua_get_bool(L, -1, "standby", false);
        d->name = dup(L, name, where);
        d->listen = dup(L, listen, where);
        const char *cert = sh__lua_get_str(L, -1, "tls_cert"),
                   *key = sh__lua_get_str(L, -1, "tls_key");
        d->tls_cert = cert ? dup(L, cert, where) : NULL;
        d->tls_key = key ? dup(L, key, where) : NULL;
        raw_field(L, -1, "memory_budget");
        if (!lua_isnil(L, -1))
            d->memory_budget = parse_memory(L, -1, "node: field 'memory_budget'", nwhere);
        lua_pop(L, 1);
        const char *preload = sh__lua_get_str(L, -1, "preload");
        if (preload && !d->standby)
            sh__lua_fail(L, SH_EINVAL, nwhere,
                         "node '%s': preload is for a standby node (standby = true)", name);
        d->preload = preload ? dup(L, preload, where) : NULL;
        lua_pop(L, 2);
    }
    lua_pop(L, 1);
}

/* Adds the model whose data table is on top (or finds the one of that name) and returns its
 * index. Two model{} with one name must describe the same file. */
static int32_t add_model(lua_State *L, sh_cluster_config *c, const char *mwhere)
{
    const char *name = sh__lua_get_str(L, -1, "name"), *path = sh__lua_get_str(L, -1, "path");
    int32_t layers = (int32_t)sh__lua_get_int(L, -1, "layers", 0);
    for (int32_t j = 0; j < c->n_models; j++) {
        sh_config_model *m = &c->models[j];
        if (strcmp(m->name, name) != 0)
            continue;
        if (strcmp(m->path, path) != 0 || m->n_layers != layers)
            sh__lua_fail(L, SH_EINVAL, mwhere, "duplicate model name '%s' for a different model",
                         name);
        return j;
    }
    sh_config_model *m = &c->models[c->n_models++];
    m->n_layers = layers;
    m->name = dup(L, name, mwhere);
    m->path = dup(L, path, mwhere);
    return c->n_models - 1;
}

/* The scheme of a listen URL, as the length of its "scheme://" prefix (0: none). */
static size_t scheme_len(const char *url)
{
    const char *p = strstr(url, "://");
    return p ? (size_t)(p - url) + 3 : 0;
}

/* A group's ranks are distinct nodes that listen on one scheme (their collective links are of one
 * kind: ipc:// reaches only the same host, tls+tcp:// needs TLS on both ends). */
static void check_group(lua_State *L, const sh_cluster_config *c, const sh_config_stage *s,
                        const char *what, const char *where)
{
    for (int32_t j = 1; j < s->tp; j++) {
        for (int32_t q = 0; q < j; q++)
            if (s->ranks[q] == s->ranks[j])
                sh__lua_fail(L, SH_EINVAL, where,
                             "%s: node '%s' is named twice in the group (ranks %d and %d): each "
                             "rank needs a node of its own",
                             what, c->nodes[s->ranks[j]].name, (int)q, (int)j);
        const char *u0 = c->nodes[s->ranks[0]].listen, *u = c->nodes[s->ranks[j]].listen;
        size_t l0 = scheme_len(u0);
        if (l0 != scheme_len(u) || strncmp(u0, u, l0) != 0)
            sh__lua_fail(L, SH_EINVAL, where,
                         "%s: rank 0 '%s' listens on %s and rank %d '%s' on %s: the ranks of a "
                         "group exchange over one kind of link; give them the same scheme",
                         what, c->nodes[s->ranks[0]].name, u0, (int)j, c->nodes[s->ranks[j]].name,
                         u);
    }
}

/* Reads the stage on top of the stack's node or nodes into s (its group's ranks), checking each
 * node and the group: 1..SH_CONFIG_MAX_TP distinct nodes, none a standby, on one URL scheme. */
static void read_ranks(lua_State *L, const sh_cluster_config *c, sh_config_stage *s,
                       const char *what, const char *swhere)
{
    const char *one = sh__lua_get_str(L, -1, "node");
    int t = raw_field(L, -1, "nodes");
    if ((one != NULL) == (t != LUA_TNIL))
        sh__lua_fail(L, SH_EINVAL, swhere,
                     "%s: give either node = \"NAME\" or nodes = { ... } (a tensor-parallel "
                     "group), not %s",
                     what, one ? "both" : "neither");
    if (one) {
        lua_pop(L, 1);
        s->tp = 1;
        s->node = s->ranks[0] = node_index(L, c, one, what, swhere);
        return;
    }
    char lwhat[64];
    snprintf(lwhat, sizeof lwhat, "%s nodes", what);
    int32_t g = sh__lua_check_list(L, -1, lwhat, SH_CONFIG_MAX_TP, swhere);
    if (g == 0)
        sh__lua_fail(L, SH_EINVAL, swhere, "%s: nodes is empty: a group needs at least one node",
                     what);
    for (int32_t j = 0; j < g; j++) {
        if (lua_rawgeti(L, -1, j + 1) != LUA_TSTRING)
            sh__lua_fail(L, SH_EINVAL, swhere, "%s: nodes[%d] must be a node name, got %s", what,
                         (int)j + 1, luaL_typename(L, -1));
        s->ranks[j] = node_index(L, c, lua_tostring(L, -1), what, swhere);
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    s->tp = g;
    s->node = s->ranks[0];
    check_group(L, c, s, what, swhere);
}

/* replica{ tp = T }: a shorthand for pipeline()'s single nodes, whose consecutive runs of T form
 * each stage's group (the layers are then split over the groups); otherwise every stage's group
 * must have T ranks. Sets r->tp (the largest group). Returns true when it regrouped. */
static bool group_stages(lua_State *L, const sh_cluster_config *c, sh_config_replica *r,
                         int32_t tp_given, int rep, bool split_by_pipeline, bool weighted,
                         bool resolved, const char *rwhere)
{
    int32_t n = r->n_stages, widest = 1;
    bool singles = true;
    for (int32_t i = 0; i < n; i++) {
        singles &= r->stages[i].tp == 1;
        widest = r->stages[i].tp > widest ? r->stages[i].tp : widest;
    }
    r->tp = widest;
    if (tp_given == 0 || (tp_given == 1 && singles))
        return false;
    if (!singles) {
        for (int32_t i = 0; i < n; i++)
            if (r->stages[i].tp != tp_given)
                sh__lua_fail(L, SH_EINVAL, rwhere,
                             "replica %d: tp = %d but stage %d's group has %d rank%s", rep,
                             (int)tp_given, (int)i + 1, (int)r->stages[i].tp,
                             r->stages[i].tp == 1 ? "" : "s");
        return false;
    }
    if (n % tp_given)
        sh__lua_fail(L, SH_EINVAL, rwhere,
                     "replica %d: tp = %d groups the stages' %d nodes by %d, which leaves %d "
                     "over: give a multiple of %d nodes (or each stage's nodes = { ... })",
                     rep, (int)tp_given, (int)n, (int)tp_given, (int)(n % tp_given), (int)tp_given);
    if (weighted || (resolved && !split_by_pipeline))
        sh__lua_fail(L, SH_EINVAL, rwhere,
                     "replica %d: tp = %d groups pipeline()'s nodes, but the stages have %s: "
                     "write each stage's group instead, e.g. pipeline(m, { { \"w0\", \"w1\" }, "
                     "... }%s)",
                     rep, (int)tp_given, weighted ? "weights" : "layer ranges written out",
                     weighted ? ", { weights = ... }" : "");
    int32_t m = n / tp_given;
    // pipeline() split its layer count over every node: split it over the groups instead.
    int32_t layers = split_by_pipeline ? r->stages[n - 1].last_layer : 0;
    if (layers > 0 && m > layers)
        sh__lua_fail(L, SH_EINVAL, rwhere, "replica %d: %d stages for %d layers", rep, (int)m,
                     (int)layers);
    int32_t first[MAX_STAGES], last[MAX_STAGES];
    if (layers > 0)
        split_layers(layers, m, NULL, first, last);
    for (int32_t i = 0; i < m; i++) {
        sh_config_stage g = {.node = r->stages[i * tp_given].node,
                             .first_layer = -1,
                             .last_layer = -1,
                             .tp = tp_given};
        for (int32_t j = 0; j < tp_given; j++)
            g.ranks[j] = r->stages[i * tp_given + j].node;
        char what[64];
        snprintf(what, sizeof what, "replica %d stage %d (tp = %d)", rep, (int)i + 1,
                 (int)tp_given);
        check_group(L, c, &g, what, rwhere);
        if (layers > 0) {
            g.first_layer = first[i];
            g.last_layer = last[i];
        }
        r->stages[i] = g;
    }
    r->n_stages = m;
    r->tp = tp_given;
    return true;
}

static void fill_stages(lua_State *L, sh_cluster_config *c, sh_config_replica *r, int rep,
                        int32_t tp_given, const char *rwhere)
{
    char what[48];
    snprintf(what, sizeof what, "replica %d stages", rep);
    int32_t n = sh__lua_check_list(L, lua_gettop(L), what, MAX_STAGES, rwhere);
    if (n == 0)
        sh__lua_fail(L, SH_EINVAL, rwhere, "replica %d has no stages", rep);
    int idx = lua_gettop(L);
    r->stages = zalloc(L, (size_t)n, sizeof *r->stages, rwhere);
    int resolved = 0, weighted = 0, split = 0;
    for (int32_t i = 0; i < n; i++) {
        char swhere[WHERE_MAX];
        lua_rawgeti(L, idx, i + 1);
        coerce(L, -1, K_STAGE, "a stage (from pipeline())", rwhere, swhere);
        snprintf(what, sizeof what, "replica %d stage %d", rep, (int)i + 1);
        sh_config_stage *s = &r->stages[r->n_stages++];
        read_ranks(L, c, s, what, swhere);
        if (raw_field(L, -1, "split") == LUA_TBOOLEAN) /* only pipeline() sets it */
            split++;
        lua_pop(L, 1);
        s->first_layer =
            (int32_t)sh__lua_get_int_range(L, -1, "first_layer", -1, -1, MAX_LAYERS, what, swhere);
        s->last_layer =
            (int32_t)sh__lua_get_int_range(L, -1, "last_layer", -1, -1, MAX_LAYERS, what, swhere);
        if ((s->first_layer < 0) != (s->last_layer < 0))
            sh__lua_fail(L, SH_EINVAL, swhere, "%s: give both first_layer and last_layer", what);
        if (raw_field(L, -1, "weight") == LUA_TNUMBER) /* only pipeline() sets it, checked */
            s->weight = lua_tonumber(L, -1);
        lua_pop(L, 1);
        resolved += s->first_layer >= 0;
        weighted += s->weight > 0;
        lua_pop(L, 2);
    }
    int32_t layers = c->models[r->model].n_layers;
    if (group_stages(L, c, r, tp_given, rep, split == n, weighted > 0, resolved > 0, rwhere)) {
        n = r->n_stages;
        resolved = r->stages[0].first_layer >= 0 ? n : 0;
        weighted = 0;
    }
    if (weighted && weighted != n)
        sh__lua_fail(L, SH_EINVAL, rwhere,
                     "replica %d: either every stage has a weight or none has (one pipeline() "
                     "call per replica)",
                     rep);
    if (resolved == 0) {
        if (layers && n > layers)
            sh__lua_fail(L, SH_EINVAL, rwhere, "replica %d: %d stages for %d layers", rep, (int)n,
                         (int)layers);
        if (layers) {
            int32_t first[MAX_STAGES], last[MAX_STAGES];
            sh_error e = {0};
            (void)sh_config_replica_layers(r, layers, first, last, &e);
            for (int32_t i = 0; i < n; i++) {
                r->stages[i].first_layer = first[i];
                r->stages[i].last_layer = last[i];
            }
        }
        return;
    }
    if (resolved != n)
        sh__lua_fail(L, SH_EINVAL, rwhere,
                     "replica %d: either every stage has a layer range or "
                     "none has",
                     rep);
    for (int32_t i = 0; i < n; i++) {
        const sh_config_stage *s = &r->stages[i];
        int32_t expect = i ? r->stages[i - 1].last_layer : 0;
        if (s->first_layer != expect || s->last_layer <= s->first_layer)
            sh__lua_fail(L, SH_EINVAL, rwhere,
                         "replica %d stage %d: layers [%d, %d) do not continue from layer %d", rep,
                         (int)i + 1, (int)s->first_layer, (int)s->last_layer, (int)expect);
    }
    if (layers && r->stages[n - 1].last_layer != layers)
        sh__lua_fail(L, SH_EINVAL, rwhere,
                     "replica %d: stages end at layer %d but the model has %d", rep,
                     (int)r->stages[n - 1].last_layer, (int)layers);
}

static void fill_models_replicas(lua_State *L, sh_cluster_config *c, const char *where)
{
    int midx = field(L, "models");
    int32_t nm = lua_isnil(L, midx) ? 0 : sh__lua_check_list(L, midx, "cluster.models", 256, where);
    int ridx = field(L, "replicas");
    int32_t nr = sh__lua_check_list(L, ridx, "cluster.replicas", MAX_REPLICAS, where);
    if (nr == 0)
        sh__lua_fail(L, SH_EINVAL, where, "cluster.replicas is empty");
    c->models = zalloc(L, (size_t)(nm + nr), sizeof *c->models, where);
    for (int32_t i = 0; i < nm; i++) {
        char mwhere[WHERE_MAX];
        lua_rawgeti(L, midx, i + 1);
        coerce(L, -1, K_MODEL, "model{...}", where, mwhere);
        add_model(L, c, mwhere);
        lua_pop(L, 2);
    }
    c->replicas = zalloc(L, (size_t)nr, sizeof *c->replicas, where);
    for (int32_t i = 0; i < nr; i++) {
        char rwhere[WHERE_MAX], mwhere[WHERE_MAX];
        lua_rawgeti(L, ridx, i + 1);
        coerce(L, -1, K_REPLICA, "replica{...}", where, rwhere);
        sh_config_replica *r = &c->replicas[c->n_replicas++];
        int32_t tp_given = (int32_t)sh__lua_get_int(L, -1, "tp", 0);
        r->link_dtype = (uint32_t)link_dtype_of(sh__lua_get_str(L, -1, "link_dtype"));
        const char *tl = sh__lua_get_str(L, -1, "tp_link");
        r->tp_net = tl && !strcmp(tl, "net");
        r->tp_compress = tp_compress_of(sh__lua_get_str(L, -1, "tp_compress"));
        r->tp_hier = tl && !strcmp(tl, "hier");
        r->drafter_node = -1;
        if (raw_field(L, -1, "drafter") != LUA_TNIL) {
            int d = lua_gettop(L);
            char what[48];
            snprintf(what, sizeof what, "replica %d: drafter", (int)i + 1);
            r->drafter_node = node_index(L, c, sh__lua_get_str(L, d, "node"), what, rwhere);
            const char *dm = sh__lua_get_str(L, d, "model");
            r->drafter_path = dm ? dup(L, dm, rwhere) : NULL;
            r->drafter_self = (int32_t)sh__lua_get_int(L, d, "self", 0);
            r->drafter_where = dup(L, rwhere, rwhere);
        }
        lua_pop(L, 1);
        if (raw_field(L, -1, "model") == LUA_TSTRING) {
            const char *name = lua_tostring(L, -1);
            r->model = -1;
            for (int32_t j = 0; j < c->n_models; j++)
                if (strcmp(c->models[j].name, name) == 0)
                    r->model = j;
            if (r->model < 0)
                sh__lua_fail(L, SH_ENOTFOUND, rwhere, "replica %d: unknown model '%.63s'",
                             (int)i + 1, name);
        } else {
            coerce(L, -1, K_MODEL, "model{...}", rwhere, mwhere);
            r->model = add_model(L, c, mwhere);
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
        int32_t nl = c->models[r->model].n_layers; /* 0: the file will say */
        if (r->drafter_self && nl && r->drafter_self >= nl)
            sh__lua_fail(L, SH_EINVAL, rwhere,
                         "replica %d: drafter self = %d: the draft's layers must be from 1 to %d "
                         "(model '%s' has %d)",
                         (int)i + 1, (int)r->drafter_self, (int)nl - 1, c->models[r->model].name,
                         (int)nl);
        raw_field(L, -1, "stages");
        fill_stages(L, c, r, (int)i + 1, tp_given, rwhere);
        lua_pop(L, 3);
    }
    lua_pop(L, 2);
}

static void fill_gateway(lua_State *L, sh_cluster_config *c, const char *where)
{
    int idx = field(L, "gateway");
    sh__lua_check_fields(L, idx, gateway_fields, "cluster.gateway", where);
    c->gateway.node = node_index(L, c, sh__lua_get_str(L, idx, "node"), "cluster.gateway", where);
    const char *http = sh__lua_get_str(L, idx, "http"), *why = hostport_error(http);
    if (why)
        sh__lua_fail(L, SH_EINVAL, where, "cluster.gateway: bad http address '%.80s': %s", http,
                     why);
    c->gateway.http = dup(L, http, where);
    raw_field(L, idx, "api_keys");
    int kidx = lua_gettop(L);
    if (!lua_isnil(L, kidx)) {
        int32_t n = sh__lua_check_list(L, kidx, "cluster.gateway.api_keys", MAX_KEYS, where);
        c->gateway.api_keys = zalloc(L, (size_t)n, sizeof(char *), where);
        for (int32_t i = 0; i < n; i++) {
            if (lua_rawgeti(L, kidx, i + 1) != LUA_TSTRING || lua_rawlen(L, -1) == 0 ||
                lua_rawlen(L, -1) > 256)
                sh__lua_fail(L, SH_EINVAL, where,
                             "cluster.gateway.api_keys[%d] must be a string of 1-256 bytes",
                             (int)i + 1);
            c->gateway.api_keys[c->gateway.n_api_keys++] = dup(L, lua_tostring(L, -1), where);
            lua_pop(L, 1);
        }
    }
    lua_pop(L, 2);
}

/* A memory size (kv.memory, node.memory_budget, named `what` in errors): bytes as an integer,
 * or a string such as "512MiB" or "2 GiB" (powers of 1024). */
static uint64_t parse_memory(lua_State *L, int idx, const char *what, const char *where)
{
    static const struct {
        const char *unit;
        double scale;
    } units[] = {{"", 1},
                 {"b", 1},
                 {"k", 1024.0},
                 {"kib", 1024.0},
                 {"m", 1048576.0},
                 {"mib", 1048576.0},
                 {"g", 1073741824.0},
                 {"gib", 1073741824.0},
                 {"t", 1099511627776.0},
                 {"tib", 1099511627776.0}};
    double v = -1;
    if (lua_type(L, idx) == LUA_TNUMBER) {
        v = lua_tonumber(L, idx);
    } else if (lua_type(L, idx) == LUA_TSTRING) {
        const char *s = lua_tostring(L, idx);
        char *end;
        double x = strtod(s, &end);
        while (*end == ' ')
            end++;
        for (size_t i = 0; end != s && i < sizeof units / sizeof units[0]; i++)
            if (strcasecmp(end, units[i].unit) == 0)
                v = x * units[i].scale;
    }
    if (v > (double)MAX_MEMORY) {
        char given[64];
        if (lua_type(L, idx) == LUA_TSTRING)
            snprintf(given, sizeof given, "\"%.40s\"", lua_tostring(L, idx));
        else
            snprintf(given, sizeof given, "%.6g bytes", v);
        sh__lua_fail(L, SH_EINVAL, where,
                     "%s is too large (%s): the maximum is \"1024TiB\" (%llu bytes)", what, given,
                     (unsigned long long)MAX_MEMORY);
    }
    if (!(v >= 1))
        sh__lua_fail(L, SH_EINVAL, where, "%s must be bytes or a size like \"512MiB\"", what);
    return (uint64_t)v;
}

static void fill_tunables(lua_State *L, sh_cluster_config *c, const char *where)
{
    int idx = field(L, "batcher");
    if (!lua_isnil(L, idx))
        sh__lua_check_fields(L, idx, batcher_fields, "cluster.batcher", where);
    const char *w = "cluster.batcher";
    c->batcher.max_step_tokens =
        (int32_t)sh__lua_get_int_range(L, idx, "max_step_tokens", 4096, 1, 1 << 20, w, where);
    c->batcher.max_seqs =
        (int32_t)sh__lua_get_int_range(L, idx, "max_seqs", 64, 1, 65536, w, where);
    c->batcher.max_wait_ms =
        (int32_t)sh__lua_get_int_range(L, idx, "max_wait_ms", 50, 0, 60000, w, where);
    // Speculative decoding: "off" or "ngram" (what `shoal serve --spec` serves), spec_k 1..16.
    const char *spec = lua_isnil(L, idx) ? NULL : sh__lua_get_str(L, idx, "spec");
    c->batcher.spec_k = (int32_t)sh__lua_get_int_range(L, idx, "spec_k", SH_CONFIG_SPEC_DEFAULT_K,
                                                       1, SH_CONFIG_SPEC_MAX_K, w, where);
    if (spec && strcmp(spec, "off") != 0 && strcmp(spec, "ngram") != 0)
        sh__lua_fail(L, SH_EINVAL, where,
                     "%s: field 'spec' must be \"off\" or \"ngram\" (a draft model drafts "
                     "for a replica with replica{ drafter = {...} }), got \"%.40s\"",
                     w, spec);
    c->batcher.spec = spec && !strcmp(spec, "ngram") ? SH_CONFIG_SPEC_NGRAM : SH_CONFIG_SPEC_OFF;
    lua_pop(L, 1);

    idx = field(L, "kv");
    if (!lua_isnil(L, idx))
        sh__lua_check_fields(L, idx, kv_fields, "cluster.kv", where);
    c->kv.block_tokens =
        (int32_t)sh__lua_get_int_range(L, idx, "block_tokens", 16, 1, 4096, "cluster.kv", where);
    c->kv.prefix_cache = sh__lua_get_bool(L, idx, "prefix_cache", true);
    if (!lua_isnil(L, idx)) {
        raw_field(L, idx, "memory");
        if (!lua_isnil(L, -1))
            c->kv.memory_bytes = parse_memory(L, -1, "cluster.kv: field 'memory'", where);
        lua_pop(L, 1);
        const char *kt = sh__lua_get_str(L, idx, "type");
        if (kt && strcmp(kt, "f32") != 0 && strcmp(kt, "f16") != 0)
            sh__lua_fail(L, SH_EINVAL, where, "cluster.kv: type '%.40s' must be \"f32\" or \"f16\"",
                         kt);
        c->kv.f32 = kt && !strcmp(kt, "f32");
    }
    lua_pop(L, 1);

    idx = field(L, "watchdog");
    if (!lua_isnil(L, idx))
        sh__lua_check_fields(L, idx, watchdog_fields, "cluster.watchdog", where);
    w = "cluster.watchdog";
    c->watchdog.heartbeat_ms =
        (int32_t)sh__lua_get_int_range(L, idx, "heartbeat_ms", 100, 1, 60000, w, where);
    c->watchdog.dead_after =
        (int32_t)sh__lua_get_int_range(L, idx, "dead_after", 3, 1, 1000, w, where);
    const char *policy = lua_isnil(L, idx) ? NULL : sh__lua_get_str(L, idx, "policy");
    if (policy && !*policy)
        sh__lua_fail(L, SH_EINVAL, where, "cluster.watchdog: field 'policy' is empty");
    c->watchdog.policy = dup(L, policy ? policy : "lua/policy/default.lua", where);
    c->watchdog.policy_given = policy != NULL;
    double hold = lua_isnil(L, idx) ? 5 : sh__lua_get_num(L, idx, "hold_s", 5);
    if (!(hold >= 0 && hold <= 3600))
        sh__lua_fail(L, SH_EINVAL, where, "%s: field 'hold_s' must be within 0..3600, got %g", w,
                     hold);
    c->watchdog.hold_ms = (int32_t)(hold * 1000 + 0.5);
    c->watchdog.degrade_max_tokens =
        (int32_t)sh__lua_get_int_range(L, idx, "degrade_max_tokens", 64, 1, 1 << 20, w, where);
    c->watchdog.shed_priority =
        (int32_t)sh__lua_get_int_range(L, idx, "shed_priority", 1, 0, 256, w, where);
    const char *fallback = lua_isnil(L, idx) ? NULL : sh__lua_get_str(L, idx, "fallback");
    if (fallback)
        c->watchdog.fallback = dup(L, fallback, where);
    lua_pop(L, 1);
}

/* cluster.routing (docs/cluster.md, "Length-aware routing"): the threshold into c, and route()
 * into the registry table "shoal.route" under the config's index, where load() finds it. */
static void fill_routing(lua_State *L, sh_cluster_config *c, int32_t index, const char *where)
{
    int idx = field(L, "routing");
    if (!lua_isnil(L, idx))
        sh__lua_check_fields(L, idx, routing_fields, "cluster.routing", where);
    c->routing.long_prompt = (int32_t)sh__lua_get_int_range(L, idx, "long_prompt", 512, 0, 1 << 30,
                                                            "cluster.routing", where);
    if (!lua_isnil(L, idx) && raw_field(L, idx, "route") != LUA_TNIL) {
        if (!lua_isfunction(L, -1))
            sh__lua_fail(L, SH_EINVAL, where,
                         "cluster.routing: field 'route' must be a function(req, replicas), got %s",
                         luaL_typename(L, -1));
        if (lua_getfield(L, LUA_REGISTRYINDEX, "shoal.route") != LUA_TTABLE) {
            lua_pop(L, 1);
            lua_newtable(L);
            lua_pushvalue(L, -1);
            lua_setfield(L, LUA_REGISTRYINDEX, "shoal.route");
        }
        lua_pushvalue(L, -2);
        lua_rawseti(L, -2, index);
        lua_pop(L, 1);
    }
    if (!lua_isnil(L, idx))
        lua_pop(L, 1);
    lua_pop(L, 1);
}

static int l_cluster(lua_State *L)
{
    char where[WHERE_MAX];
    sh__lua_where(L, where, sizeof where);
    builder *bd = sh__lua_box_of(L)->host;
    if (!bd) /* called from route() after the script ran */
        sh__lua_fail(L, SH_EINVAL, where, "cluster{} can only be called while the script runs");
    sh__lua_check_fields(L, 1, cluster_fields, "cluster", where);
    lua_settop(L, 1);
    if (bd->n == bd->cap) {
        int32_t cap = bd->cap ? bd->cap * 2 : 2;
        sh_cluster_config **p = realloc(bd->built, (size_t)cap * sizeof *p);
        if (!p)
            sh__lua_fail(L, SH_ENOMEM, where, "out of memory");
        bd->built = p;
        bd->cap = cap;
    }
    sh_cluster_config *c = zalloc(L, 1, sizeof *c, where);
    bd->built[bd->n++] = c;
    fill_nodes(L, c, where);
    fill_models_replicas(L, c, where);
    fill_gateway(L, c, where);
    fill_tunables(L, c, where);
    const char *key_file = sh__lua_get_str(L, 1, "key_file");
    if (key_file && !*key_file)
        sh__lua_fail(L, SH_EINVAL, where, "cluster: field 'key_file' is empty");
    if (key_file)
        c->key_file = dup(L, key_file, where);
    const char *tls_ca = sh__lua_get_str(L, 1, "tls_ca");
    if (tls_ca && !*tls_ca)
        sh__lua_fail(L, SH_EINVAL, where, "cluster: field 'tls_ca' is empty");
    if (tls_ca)
        c->tls_ca = dup(L, tls_ca, where);
    fill_routing(L, c, bd->n - 1, where);
    lua_newtable(L);
    sh__lua_obj_new(L, K_CLUSTER, where, bd->n - 1);
    return 1;
}

/* Runs the chunk (argument 1) with the constructors in its globals; checks what it returns. */
static int run_cluster(lua_State *L)
{
    static const luaL_Reg ctors[] = {{"node", l_node},       {"model", l_model},
                                     {"replica", l_replica}, {"pipeline", l_pipeline},
                                     {"cluster", l_cluster}, {NULL, NULL}};
    lua_pushglobaltable(L);
    luaL_setfuncs(L, ctors, 0);
    lua_pop(L, 1);
    lua_pushvalue(L, 1);
    lua_call(L, 0, 1);
    int64_t idx = -1;
    if (sh__lua_obj_get(L, -1, NULL, 0, &idx) != K_CLUSTER) {
        sh__lua_box *b = sh__lua_box_of(L);
        sh__lua_fail(L, SH_EINVAL, b->name, "the script must return cluster{...}, got %s",
                     luaL_typename(L, -1));
    }
    ((builder *)sh__lua_box_of(L)->host)->result = idx;
    return 0;
}

/* Prefixes *path with the script's directory (dir bytes of script) unless it is absolute. */
static sh_err resolve_path(char **path, const char *script, size_t dir, sh_error *e)
{
    if (!*path || (*path)[0] == '/')
        return SH_OK;
    size_t n = strlen(*path);
    char *p = malloc(dir + n + 1);
    if (!p)
        return sh__error_set(e, SH_ENOMEM, "%s: out of memory", script);
    memcpy(p, script, dir);
    memcpy(p + dir, *path, n + 1);
    free(*path);
    *path = p;
    return SH_OK;
}

/* A relative model path (or key_file) in a script file names a file beside the script, wherever
 * the program runs from: prefix it with the script's directory (as the script path spells it).
 * Absolute paths stay as they are, and so does everything in a script without a directory
 * part. */
static sh_err resolve_model_paths(sh_cluster_config *c, const char *script, sh_error *e)
{
    const char *slash = strrchr(script, '/');
    if (!slash)
        return SH_OK;
    size_t dir = (size_t)(slash - script) + 1;
    for (int32_t i = 0; i < c->n_models; i++) {
        sh_err err = resolve_path(&c->models[i].path, script, dir, e);
        if (err)
            return err;
    }
    for (int32_t i = 0; i < c->n_replicas; i++) {
        sh_err err = resolve_path(&c->replicas[i].drafter_path, script, dir, e);
        if (err)
            return err;
    }
    for (int32_t i = 0; i < c->n_nodes; i++) {
        sh_err err = resolve_path(&c->nodes[i].tls_cert, script, dir, e);
        if (!err)
            err = resolve_path(&c->nodes[i].tls_key, script, dir, e);
        if (err)
            return err;
    }
    // A policy the script names sits beside it too; "default" and "lua/policy/default.lua" name
    // the built-in copy.
    sh_err err = SH_OK;
    if (c->watchdog.policy_given && strcmp(c->watchdog.policy, "default") != 0 &&
        strcmp(c->watchdog.policy, "lua/policy/default.lua") != 0)
        err = resolve_path(&c->watchdog.policy, script, dir, e);
    if (!err)
        err = resolve_path(&c->tls_ca, script, dir, e);
    return err ? err : resolve_path(&c->key_file, script, dir, e);
}

static sh_err load(const char *path, const char *src, size_t len, const char *name,
                   const sh_lua_limits *limits, sh_cluster_config **out, sh_error *e)
{
    *out = NULL;
    sh__lua_box *b;
    sh_err err = sh__lua_box_create(limits, DEF_MEMORY, DEF_TIME_MS, &b, e);
    if (err)
        return err;
    builder bd = {.result = -1};
    b->host = &bd;
    err = path ? sh__lua_load_file(b, path, e) : sh__lua_load_string(b, src, len, name, e);
    if (!err) {
        lua_pushcfunction(b->L, run_cluster);
        lua_insert(b->L, -2);
        err = sh__lua_call(b, 1, 0, e);
    }
    if (!err && bd.result >= 0 && bd.result < bd.n) {
        if (path)
            err = resolve_model_paths(bd.built[bd.result], path, e);
        if (!err) {
            *out = bd.built[bd.result];
            bd.built[bd.result] = NULL;
        }
    }
    for (int32_t i = 0; i < bd.n; i++)
        sh_config_destroy(bd.built[i]);
    free(bd.built);
    b->host = NULL;
    // A route() given by the chosen cluster{} keeps the state it lives in (lua/route.c).
    bool route = false;
    if (*out && lua_getfield(b->L, LUA_REGISTRYINDEX, "shoal.route") == LUA_TTABLE &&
        lua_rawgeti(b->L, -1, bd.result) == LUA_TFUNCTION) {
        lua_setfield(b->L, LUA_REGISTRYINDEX, "shoal.route.fn");
        route = true;
    }
    lua_settop(b->L, 0);
    if (route) {
        err = sh__config_route_keep(*out, b, e);
        if (err) {
            sh_config_destroy(*out);
            *out = NULL;
        }
        return err;
    }
    sh__lua_box_destroy(b);
    return err;
}

sh_err sh_config_load_file(const char *path, const sh_lua_limits *limits, sh_cluster_config **out,
                           sh_error *e)
{
    return load(path, NULL, 0, NULL, limits, out, e);
}

sh_err sh_config_load_string(const char *src, size_t len, const char *name,
                             const sh_lua_limits *limits, sh_cluster_config **out, sh_error *e)
{
    return load(NULL, src, len, name, limits, out, e);
}

int32_t sh_config_find_node(const sh_cluster_config *c, const char *name)
{
    for (int32_t i = 0; c && name && i < c->n_nodes; i++)
        if (c->nodes[i].name && strcmp(c->nodes[i].name, name) == 0)
            return i;
    return -1;
}

bool sh_config_has_workers(const sh_cluster_config *c)
{
    if (c->n_nodes > 1 || c->n_replicas != 1)
        return true;
    const sh_config_replica *r = &c->replicas[0];
    return r->n_stages != 1 || r->stages[0].node != c->gateway.node;
}

void sh_config_destroy(sh_cluster_config *c)
{
    if (!c)
        return;
    for (int32_t i = 0; i < c->n_nodes; i++) {
        free(c->nodes[i].name);
        free(c->nodes[i].listen);
        free(c->nodes[i].tls_cert);
        free(c->nodes[i].tls_key);
        free(c->nodes[i].preload);
    }
    free(c->nodes);
    for (int32_t i = 0; i < c->n_models; i++) {
        free(c->models[i].name);
        free(c->models[i].path);
    }
    free(c->models);
    for (int32_t i = 0; i < c->n_replicas; i++) {
        free(c->replicas[i].stages);
        free(c->replicas[i].drafter_path);
        free(c->replicas[i].drafter_where);
    }
    free(c->replicas);
    free(c->gateway.http);
    for (int32_t i = 0; i < c->gateway.n_api_keys; i++)
        free(c->gateway.api_keys[i]);
    free(c->gateway.api_keys);
    free(c->watchdog.policy);
    free(c->watchdog.fallback);
    free(c->key_file);
    free(c->tls_ca);
    sh__config_route_destroy(c->routing.route);
    free(c);
}
