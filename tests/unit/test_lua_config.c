/* Unit tests of cluster.lua evaluation (the DESIGN example, defaults, layer splits, every error
 * class with its file:line) and of the sandbox (escapes, time and memory limits, print). */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lua/config.h"
#include "sh_test.h"
#include "shoal.h"

static sh_err load_str(const char *src, const sh_lua_limits *lim, sh_cluster_config **c,
                       sh_error *e)
{
    return sh_config_load_string(src, strlen(src), "bad.lua", lim, c, e);
}

static void test_demo(void)
{
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_config_load_file(sh_test_path("lua/examples/cluster-demo.lua"), NULL, &c, &e));
    if (!c) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    CHECK_INT_EQ(c->n_nodes, 4);
    CHECK_STR_EQ(c->nodes[0].name, "front");
    CHECK_STR_EQ(c->nodes[0].listen, "ipc:///tmp/shoal-demo/front");
    CHECK_STR_EQ(c->nodes[2].listen, "tcp://127.0.0.1:7102");
    CHECK(!c->nodes[2].standby);
    CHECK_STR_EQ(c->nodes[3].name, "spare");
    CHECK(c->nodes[3].standby);
    CHECK_INT_EQ(c->n_models, 1);
    CHECK_STR_EQ(c->models[0].name, "smollm2");
    /* Relative to the script's directory: lua/examples/../../models is the repository's. */
    CHECK_STR_EQ(c->models[0].path,
                 sh_test_path("lua/examples/../../models/smollm2-135m-instruct-q4_1.gguf"));
    CHECK_INT_EQ(c->models[0].n_layers, 0);
    CHECK_INT_EQ(c->gateway.node, 0);
    CHECK_STR_EQ(c->gateway.http, "127.0.0.1:8080");
    CHECK_INT_EQ(c->gateway.n_api_keys, 0);
    CHECK_INT_EQ(c->n_replicas, 1);
    const sh_config_replica *r = &c->replicas[0];
    CHECK_INT_EQ(r->model, 0);
    CHECK_INT_EQ(r->tp, 1);
    CHECK_INT_EQ(r->n_stages, 2);
    CHECK_INT_EQ(r->stages[0].node, 1);
    CHECK_INT_EQ(r->stages[1].node, 2);
    CHECK_INT_EQ(r->stages[0].first_layer, -1); /* layer count unknown: resolved at load */
    CHECK_INT_EQ(r->stages[1].last_layer, -1);
    CHECK_INT_EQ(r->drafter_node, -1); /* no drafter */
    CHECK(r->drafter_path == NULL);
    CHECK_INT_EQ(c->batcher.max_step_tokens, 4096);
    CHECK_INT_EQ(c->batcher.max_seqs, 64);
    CHECK_INT_EQ(c->batcher.max_wait_ms, 50);
    CHECK_INT_EQ(c->batcher.spec, 0); /* speculative decoding off by default */
    CHECK_INT_EQ(c->batcher.spec_k, 8);
    CHECK_INT_EQ(c->kv.block_tokens, 16);
    CHECK(c->kv.prefix_cache);
    CHECK_UINT_EQ(c->kv.memory_bytes, 0);
    CHECK(!c->kv.f32); /* kv.type: F16 by default */
    CHECK_INT_EQ(c->watchdog.heartbeat_ms, 100);
    CHECK_INT_EQ(c->watchdog.dead_after, 3);
    CHECK_STR_EQ(c->watchdog.policy, "lua/policy/default.lua"); /* the built-in: not resolved */
    CHECK(c->watchdog.policy_given);
    CHECK_INT_EQ(c->watchdog.hold_ms, 5000);
    CHECK_INT_EQ(c->watchdog.degrade_max_tokens, 64);
    CHECK(c->watchdog.fallback == NULL);
    CHECK_INT_EQ(c->watchdog.shed_priority, 1);
    CHECK_INT_EQ(sh_config_find_node(c, "w1"), 2);
    CHECK_INT_EQ(sh_config_find_node(c, "nope"), -1);
    sh_config_destroy(c);
    sh_config_destroy(NULL);
}

static void test_defaults_and_layers(void)
{
    const char *src =
        "local m = model { name = 'tiny', path = 'm.gguf', layers = 30 }\n"
        "local ws = {}\n"
        "for i = 0, 3 do ws[#ws + 1] = node { name = 'w' .. i, listen = 'tcp://[::1]:' .. (7000 + "
        "i) } end\n"
        "local names = {}\n"
        "for _, n in ipairs(ws) do names[#names + 1] = n.name end\n"
        "return cluster {\n"
        "  nodes = ws,\n"
        "  models = { model { name = 'other', path = 'o.gguf' } },\n"
        "  gateway = { node = 'w0', http = '*:80', api_keys = { 'k1', 'k2' } },\n"
        "  replicas = {\n"
        "    replica { model = m, stages = pipeline(m, names) },\n"
        "    replica { model = 'other', stages = pipeline('other', { 'w1', 'w2' }, 5), tp = 2,\n"
        "      link_dtype = 'int8' },\n"
        "    { model = m, stages = { { node = 'w3', first_layer = 0, last_layer = 30 } },\n"
        "      link_dtype = 'f16' },\n"
        "  },\n"
        "  kv = { memory = '1.5 GiB', type = 'f32' },\n"
        "}\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(load_str(src, NULL, &c, &e));
    if (!c) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    CHECK_INT_EQ(c->n_models, 2);
    CHECK_STR_EQ(c->models[0].name, "other");
    CHECK_INT_EQ(c->models[1].n_layers, 30);
    CHECK_INT_EQ(c->gateway.n_api_keys, 2);
    CHECK_STR_EQ(c->gateway.api_keys[1], "k2");
    const sh_config_replica *r = &c->replicas[0];
    CHECK_INT_EQ(r->model, 1);
    CHECK_INT_EQ(r->n_stages, 4);
    CHECK_UINT_EQ(r->link_dtype, 0); /* F32 by default */
    int32_t expect[5] = {0, 7, 15, 22, 30};
    for (int i = 0; i < 4 && i < r->n_stages; i++) {
        CHECK_INT_EQ(r->stages[i].node, i);
        CHECK_INT_EQ(r->stages[i].first_layer, expect[i]);
        CHECK_INT_EQ(r->stages[i].last_layer, expect[i + 1]);
    }
    r = &c->replicas[1];
    CHECK_INT_EQ(r->model, 0);
    CHECK_INT_EQ(r->tp, 2);                      /* w1 and w2 are one stage's group */
    CHECK_UINT_EQ(r->link_dtype, 24);            /* I8 */
    CHECK_UINT_EQ(c->replicas[2].link_dtype, 1); /* F16 */
    CHECK_INT_EQ(r->n_stages, 1);
    CHECK_INT_EQ(r->stages[0].tp, 2);
    CHECK_INT_EQ(r->stages[0].node, 1);
    CHECK_INT_EQ(r->stages[0].ranks[1], 2);
    CHECK_INT_EQ(r->stages[0].first_layer, 0);
    CHECK_INT_EQ(r->stages[0].last_layer, 5);
    CHECK_INT_EQ(c->replicas[2].stages[0].node, 3);
    CHECK_INT_EQ(c->replicas[2].stages[0].last_layer, 30);
    CHECK_UINT_EQ(c->kv.memory_bytes, 3ull << 29);
    CHECK(c->kv.f32);
    CHECK_INT_EQ(c->batcher.max_seqs, 64);
    CHECK_INT_EQ(c->watchdog.dead_after, 3);
    CHECK_STR_EQ(c->watchdog.policy, "lua/policy/default.lua");
    sh_config_destroy(c);
}

/* pipeline(m, nodes, { weights = ... }): resolved by the loader when the layer count is known,
 * else by sh_config_replica_layers() with the same rule. */
static void test_weights(void)
{
    const char *src = "local m = model { name = 'm', path = 'm.gguf', layers = 30 }\n"
                      "local u = model { name = 'u', path = 'u.gguf' }\n"
                      "return cluster {\n"
                      "  nodes = { node { name = 'f', listen = 'ipc:///f' },\n"
                      "    node { name = 'a', listen = 'ipc:///a' },\n"
                      "    node { name = 'b', listen = 'ipc:///b' } },\n"
                      "  gateway = { node = 'f', http = 'h:80' },\n"
                      "  replicas = {\n"
                      "    replica { model = m, stages = pipeline(m, { 'a', 'b' }, { weights = "
                      "{ 2, 1 } }) },\n"
                      "    replica { model = u, stages = pipeline(u, { 'a', 'b', 'a' }, { weights "
                      "= { 1, 2.5, 1 } }) },\n"
                      "    replica { model = u, stages = pipeline(u, { 'a', 'b' }, {}) },\n"
                      "  },\n"
                      "}\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(load_str(src, NULL, &c, &e));
    if (!c) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    const sh_config_replica *r = &c->replicas[0];
    CHECK_INT_EQ(r->n_stages, 2);
    CHECK_INT_EQ(r->stages[0].first_layer, 0);
    CHECK_INT_EQ(r->stages[0].last_layer, 20);
    CHECK_INT_EQ(r->stages[1].first_layer, 20);
    CHECK_INT_EQ(r->stages[1].last_layer, 30);
    CHECK(r->stages[0].weight == 2.0 && r->stages[1].weight == 1.0);
    int32_t first[3], last[3];
    /* Resolved ranges come back as they are. */
    CHECK_OK(sh_config_replica_layers(r, 30, first, last, &e));
    CHECK_INT_EQ(first[1], 20);
    CHECK_INT_EQ(last[1], 30);

    /* Unknown layer count: left for the plan, weights kept. 1 : 2.5 : 1 over 9 layers gives
     * boundaries round(9 / 4.5) = 2 and round(9 * 3.5 / 4.5) = round(7) = 7. */
    r = &c->replicas[1];
    CHECK_INT_EQ(r->stages[0].first_layer, -1);
    CHECK_INT_EQ(r->stages[2].last_layer, -1);
    CHECK(r->stages[1].weight == 2.5);
    CHECK_OK(sh_config_replica_layers(r, 9, first, last, &e));
    int32_t want9[4] = {0, 2, 7, 9};
    for (int i = 0; i < 3; i++) {
        CHECK_INT_EQ(first[i], want9[i]);
        CHECK_INT_EQ(last[i], want9[i + 1]);
    }
    /* Every stage keeps a layer: over 3 layers the shares (0.67, 1.67, 0.67) would leave the
     * first empty; the clamp gives one each. */
    CHECK_OK(sh_config_replica_layers(r, 3, first, last, &e));
    int32_t want3[4] = {0, 1, 2, 3};
    for (int i = 0; i < 3; i++) {
        CHECK_INT_EQ(first[i], want3[i]);
        CHECK_INT_EQ(last[i], want3[i + 1]);
    }
    /* Halves round up: 1 : 2.5 : 1 over 5 layers is 1.11 -> 1, 3.89 -> 4. */
    CHECK_OK(sh_config_replica_layers(r, 5, first, last, &e));
    CHECK_INT_EQ(last[0], 1);
    CHECK_INT_EQ(last[1], 4);
    CHECK_INT_EQ(sh_config_replica_layers(r, 2, first, last, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "3 stages for a model of 2 layers") != NULL);

    /* An empty options table is an even split, as without it. */
    r = &c->replicas[2];
    CHECK(r->stages[0].weight == 0.0);
    CHECK_OK(sh_config_replica_layers(r, 7, first, last, &e));
    CHECK_INT_EQ(last[0], 3);
    CHECK_INT_EQ(first[1], 3);
    CHECK_INT_EQ(last[1], 7);
    sh_config_destroy(c);

    /* One heavy stage never takes the layers the others need. */
    const char *heavy = "local m = model { name = 'm', path = 'm.gguf', layers = 4 }\n"
                        "return cluster { nodes = { node { name = 'f', listen = 'ipc:///f' },\n"
                        "  node { name = 'a', listen = 'ipc:///a' } },\n"
                        "  gateway = { node = 'f', http = 'h:80' },\n"
                        "  replicas = { replica { model = m, stages = pipeline(m, { 'a', 'a', "
                        "'a' }, { weights = { 1e6, 1, 1 } }) } } }\n";
    CHECK_OK(load_str(heavy, NULL, &c, &e));
    if (!c)
        return;
    r = &c->replicas[0];
    CHECK_INT_EQ(r->stages[0].last_layer, 2);
    CHECK_INT_EQ(r->stages[1].last_layer, 3);
    CHECK_INT_EQ(r->stages[2].last_layer, 4);
    sh_config_destroy(c);
}

/* Tensor-parallel groups: per-stage nodes lists, pipeline()'s groups and replica{ tp } over
 * pipeline()'s nodes, composed with stages (docs/cluster.md, "Tensor parallelism"). */
static void test_tp_groups(void)
{
    const char *src =
        "local m = model { name = 'm', path = 'm.gguf', layers = 30 }\n"
        "local u = model { name = 'u', path = 'u.gguf' }\n"
        "local ns = { node { name = 'f', listen = 'ipc:///f' } }\n"
        "for _, n in ipairs { 'a', 'b', 'c', 'd', 'e', 'g', 'h', 'i' } do\n"
        "  ns[#ns + 1] = node { name = n, listen = 'ipc:///' .. n } end\n"
        "return cluster { nodes = ns, gateway = { node = 'f', http = 'h:80' },\n"
        "  replicas = {\n"
        "    replica { model = m, stages = pipeline(m, { 'a', 'b', 'c', 'd' }), tp = 2 },\n"
        "    replica { model = u, stages = pipeline(u, { { 'e', 'g' }, { 'h', 'i' } }) },\n"
        "    replica { model = m, stages = { { nodes = { 'e', 'g', 'h' }, first_layer = 0,\n"
        "      last_layer = 10 }, { node = 'i', first_layer = 10, last_layer = 30 } } },\n"
        "    replica { model = m, stages = pipeline(m, { 'a' }), tp = 1 },\n"
        "    replica { model = u, stages = pipeline(u, { 'a', 'b' }), tp = 2, tp_link = 'net',\n"
        "      tp_compress = 'int8' },\n"
        "    replica { model = u, stages = pipeline(u, { 'c', 'd' }), tp = 2, tp_link = 'net',\n"
        "      tp_compress = 'f16' },\n"
        "    replica { model = u, stages = pipeline(u, { 'e', 'g' }), tp = 2, tp_link = 'net',\n"
        "      tp_compress = 'none' },\n"
        "  } }\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(load_str(src, NULL, &c, &e));
    if (!c) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    CHECK_INT_EQ(c->n_replicas, 7);
    const sh_config_replica *r = &c->replicas[0]; /* 2 stages x 2 ranks, split over the groups */
    CHECK_INT_EQ(r->tp, 2);
    CHECK_INT_EQ(r->n_stages, 2);
    CHECK_INT_EQ(r->stages[0].tp, 2);
    CHECK_INT_EQ(r->stages[0].node, 1);
    CHECK_INT_EQ(r->stages[0].ranks[0], 1);
    CHECK_INT_EQ(r->stages[0].ranks[1], 2);
    CHECK_INT_EQ(r->stages[1].ranks[0], 3);
    CHECK_INT_EQ(r->stages[1].ranks[1], 4);
    CHECK_INT_EQ(r->stages[0].first_layer, 0);
    CHECK_INT_EQ(r->stages[0].last_layer, 15);
    CHECK_INT_EQ(r->stages[1].first_layer, 15);
    CHECK_INT_EQ(r->stages[1].last_layer, 30);
    r = &c->replicas[1]; /* groups written in pipeline(); the layers wait for the model */
    CHECK_INT_EQ(r->tp, 2);
    CHECK_INT_EQ(r->n_stages, 2);
    CHECK_INT_EQ(r->stages[1].ranks[0], 7);
    CHECK_INT_EQ(r->stages[1].ranks[1], 8);
    CHECK_INT_EQ(r->stages[1].first_layer, -1);
    int32_t first[2], last[2];
    CHECK_OK(sh_config_replica_layers(r, 6, first, last, &e));
    CHECK_INT_EQ(last[0], 3);
    CHECK_INT_EQ(first[1], 3);
    r = &c->replicas[2]; /* groups of different sizes; tp is the largest */
    CHECK_INT_EQ(r->tp, 3);
    CHECK_INT_EQ(r->stages[0].tp, 3);
    CHECK_INT_EQ(r->stages[0].ranks[2], 7);
    CHECK_INT_EQ(r->stages[1].tp, 1);
    CHECK_INT_EQ(r->stages[1].ranks[0], 8);
    CHECK_INT_EQ(r->stages[1].node, 8);
    r = &c->replicas[3];
    CHECK_INT_EQ(r->tp, 1);
    CHECK_INT_EQ(r->stages[0].tp, 1);
    CHECK_INT_EQ(r->stages[0].last_layer, 30);
    r = &c->replicas[4]; /* the shorthand without a layer count */
    CHECK(r->tp_net);
    CHECK(!c->replicas[0].tp_net);
    CHECK_INT_EQ(r->tp_compress, 2);             /* int8 */
    CHECK_INT_EQ(c->replicas[5].tp_compress, 1); /* f16 */
    CHECK_INT_EQ(c->replicas[6].tp_compress, 0); /* "none", written out */
    CHECK_INT_EQ(c->replicas[0].tp_compress, 0); /* none by default */
    CHECK_INT_EQ(r->n_stages, 1);
    CHECK_INT_EQ(r->stages[0].tp, 2);
    CHECK_INT_EQ(r->stages[0].first_layer, -1);
    sh_config_destroy(c);
}

/* Every error names bad.lua and the line of the offending constructor call. */
static const char *const head =
    "local m = model { name = 'm', path = 'm.gguf' }\n"                                 /* line 1 */
    "local function nodes(extra) return { node { name = 'a', listen = 'tcp://h:1' },\n" /* 2 */
    "  node { name = 'b', listen = 'tcp://h:2' }, extra } end\n";                       /* 3 */

static const struct bad_case {
    const char *body; /* appended to head; its first line is line 4 */
    sh_err code;
    const char *where;
    const char *text;
} bad_cases[] = {
    {"return cluster {\n", SH_ELUA, "bad.lua:5", "unexpected symbol"},
    {"local function f() error('boom') end\nlocal function g() f() end\ng()\n", SH_ELUA,
     "bad.lua:4: boom", "traceback: bad.lua:4: in"},
    {"local x = nil\nreturn x.y\n", SH_ELUA, "bad.lua:5", "attempt to index a nil value"},
    {"local n = node { name = 'c', listen = 'tcp://h:3', stanby = true }\n", SH_EINVAL, "bad.lua:4",
     "unknown key 'stanby'"},
    {"local n = node { name = 'c', listen = 5 }\n", SH_EINVAL, "bad.lua:4",
     "field 'listen' must be a string, got an integer"},
    {"local n = node { name = 'c', standby = 'yes', listen = 'ipc:///x' }\n", SH_EINVAL,
     "bad.lua:4", "field 'standby' must be a boolean, got string"},
    {"\nlocal n = node { name = 'c' }\n", SH_EINVAL, "bad.lua:5",
     "missing required field 'listen'"},
    {"local n = node { name = 'c', listen = 'http://h:80' }\n", SH_EINVAL, "bad.lua:4",
     "scheme must be"},
    {"local n = node { name = 'c', listen = 'tcp://h' }\n", SH_EINVAL, "bad.lua:4",
     "expected host:port"},
    {"local n = node { name = 'c', listen = 'tcp://h:99999' }\n", SH_EINVAL, "bad.lua:4",
     "port must be"},
    {"local n = node { name = 'bad name', listen = 'ipc:///x' }\n", SH_EINVAL, "bad.lua:4",
     "name 'bad name'"},
    {"return cluster { nodes = nodes(node { name = 'a', listen = 'tcp://h:9' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "duplicate node name 'a'"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m,\n"
     "     stages = pipeline(m, { 'a', 'w9' }) } } }\n",
     SH_ENOTFOUND, "bad.lua:7", "replica 1 stage 2: unknown node 'w9'"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'zz', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_ENOTFOUND, "bad.lua:4", "cluster.gateway: unknown node 'zz'"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = 'nope', stages = pipeline(m, { 'a' }) } } }\n",
     SH_ENOTFOUND, "bad.lua:6", "unknown model 'nope'"},
    {"return cluster { nodes = nodes(node { name = 's', listen = 'ipc:///s', standby = true }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 's' }) } } }\n",
     SH_EINVAL, "bad.lua:6", "is a standby"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, batcher = { max_seqs = 0 },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "cluster.batcher: field 'max_seqs' must be within 1..65536"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, batcher = { spec = 'draft:x.gguf' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "field 'spec' must be \"off\" or \"ngram\""},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'zz', model = 'd.gguf' } } } }\n",
     SH_ENOTFOUND, "bad.lua:5", "replica 1: drafter: unknown node 'zz'"},
    {"return cluster { nodes = nodes(node { name = 's', listen = 'ipc:///s', standby = true }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 's', model = 'd.gguf' } } } }\n",
     SH_EINVAL, "bad.lua:6", "replica 1: drafter: node 's' is a standby"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b' } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica.drafter: give exactly one of model"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', model = 'd.gguf', self = 2 } } } }\n",
     SH_EINVAL, "bad.lua:5", "(the model's own first layers and its output head), not both"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', self = 0 } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica.drafter: self = 0 must be a whole number of layers"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', self = 2.5 } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica.drafter: self = 2.5 must be a whole number"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', self = '3' } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica.drafter: self = \"3\" must be a whole number"},
    {"local q = model { name = 'q', path = 'q.gguf', layers = 4 }\n"
     "return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = q, stages = pipeline(q, { 'a' }),\n"
     "    drafter = { node = 'b', self = 4 } } } }\n",
     SH_EINVAL, "bad.lua:6", "replica 1: drafter self = 4: the draft's layers must be from 1 to 3"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', model = '' } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica.drafter: model must name the draft model's GGUF file"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
     "    drafter = { node = 'b', model = 'd.gguf', k = 4 } } } }\n",
     SH_EINVAL, "bad.lua:5", "unknown key 'k'"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, batcher = { spec = 'ngram', spec_k = 0 },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "cluster.batcher: field 'spec_k' must be within 1..16"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { block_tokens = 16.5 },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "field 'block_tokens' must be an integer, got a float"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { node = 'a', first_layer = 1,\n"
     "  last_layer = 4 } } } } }\n",
     SH_EINVAL, "bad.lua:5", "do not continue from layer 0"},
    {"local p = pipeline(model { name = 'x', path = 'x', layers = 2 }, { 'a', 'b', 'a' })\n",
     SH_EINVAL, "bad.lua:4", "3 stages for 2 layers"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { memory = '999999TiB' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4",
     "field 'memory' is too large (\"999999TiB\"): the maximum is \"1024TiB\" "
     "(1125899906842624 bytes)"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { memory = 2^60 },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "is too large (1.15292e+18 bytes): the maximum is \"1024TiB\""},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { memory = '12 parsecs' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "must be bytes or a size like \"512MiB\""},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { type = 'bf16' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "cluster.kv: type 'bf16' must be \"f32\" or \"f16\""},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { type = 'F32' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "type 'F32' must be"},
    {"return cluster { nodes = nodes(),\n"
     "  gateway = { node = 'a', http = 'h:80' }, kv = { type = 32 },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "field 'type' must be a string"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), link_dtype = 'fp8' }\n",
     SH_EINVAL, "bad.lua:4", "replica: link_dtype 'fp8' must be \"f32\", \"f16\" or \"int8\""},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { { model = m, stages = pipeline(m, { 'a' }), link_dtype = 'F16' } } }\n",
     SH_EINVAL, "bad.lua:4", "link_dtype 'F16' must be"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), link_dtype = 16 }\n", SH_EINVAL,
     "bad.lua:4", "field 'link_dtype' must be a string"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = { 2, 1, 1 } })\n", SH_EINVAL, "bad.lua:4",
     "pipeline: weights has 3 entries for 2 nodes"},
    {"\nlocal p = pipeline(m, { 'a', 'b' }, { weights = { 2, 0 } })\n", SH_EINVAL, "bad.lua:5",
     "pipeline: weights[2] must be a positive number (at most 1e9), got 0"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = { -1, 1 } })\n", SH_EINVAL, "bad.lua:4",
     "weights[1] must be a positive number (at most 1e9), got -1"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = { 1, 'x' } })\n", SH_EINVAL, "bad.lua:4",
     "weights[2] must be a positive number (at most 1e9), got a string"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = { 1, 0/0 } })\n", SH_EINVAL, "bad.lua:4",
     "weights[2] must be a positive number"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = { 1, math.huge } })\n", SH_EINVAL,
     "bad.lua:4", "weights[2] must be a positive number (at most 1e9), got inf"},
    {"local p = pipeline(m, { 'a', 'b' }, { weights = 2 })\n", SH_EINVAL, "bad.lua:4",
     "field 'weights' must be a table"},
    {"local p = pipeline(m, { 'a', 'b' }, { weigths = { 1, 1 } })\n", SH_EINVAL, "bad.lua:4",
     "unknown key 'weigths'"},
    {"local p = pipeline(m, { 'a', 'b' }, 'x')\n", SH_EINVAL, "bad.lua:4",
     "third argument must be a layer count"},
    {"local p = pipeline(model { name = 'x', path = 'x', layers = 2 }, { 'a', 'b', 'a' },\n"
     "  { weights = { 1, 1, 1 } })\n",
     SH_EINVAL, "bad.lua:4", "pipeline: 3 stages for 2 layers"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { pipeline(m, { 'a' }, { weights = { 1 } "
     "})[1],\n"
     "    pipeline(m, { 'b' })[1] } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica 1: either every stage has a weight or none has"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' }, key_file = '',\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "cluster: field 'key_file' is empty"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' }, key_file = 5,\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } } }\n",
     SH_EINVAL, "bad.lua:4", "field 'key_file' must be a string"},
    {"local n = node { name = 'c', listen = 'tls+tcp://h:1', tls_cert = '' }\n", SH_EINVAL,
     "bad.lua:4", "node 'c': field 'tls_cert' is empty"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp = 0 }\n", SH_EINVAL,
     "bad.lua:4",
     "replica: tp = 0: the ranks of each stage's tensor-parallel group must be a "
     "whole number from 1 to 64"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp = -2 }\n", SH_EINVAL,
     "bad.lua:4", "replica: tp = -2:"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp_link = 'tcp' }\n", SH_EINVAL,
     "bad.lua:4", "replica: tp_link 'tcp' must be \"auto\", \"net\" or \"hier\""},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp_link = 'net',\n"
     "  tp_compress = 'fp8' }\n",
     SH_EINVAL, "bad.lua:4", "replica: tp_compress 'fp8' must be \"none\", \"f16\" or \"int8\""},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp_compress = 'F16',\n"
     "  tp_link = 'net' }\n",
     SH_EINVAL, "bad.lua:4", "replica: tp_compress 'F16' must be"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp_compress = 16 }\n",
     SH_EINVAL, "bad.lua:4", "replica: field 'tp_compress' must be a string"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp_compress = 'f16' }\n",
     SH_EINVAL, "bad.lua:4",
     "replica: tp_compress = \"f16\" needs tp_link = \"net\" or \"hier\" (only the network "
     "collective compresses; a group on shared memory exchanges f32)"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { { model = m, stages = pipeline(m, { 'a' }), tp_link = 'auto',\n"
     "    tp_compress = 'int8' } } }\n",
     SH_EINVAL, "bad.lua:4", "replica: tp_compress = \"int8\" needs tp_link = \"net\""},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp = 65 }\n", SH_EINVAL,
     "bad.lua:4", "replica: tp = 65: the ranks"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp = 1.5 }\n", SH_EINVAL,
     "bad.lua:4", "replica: field 'tp' must be an integer, got a float"},
    {"local r = replica { model = m, stages = pipeline(m, { 'a' }), tp = 'two' }\n", SH_EINVAL,
     "bad.lua:4", "replica: field 'tp' must be an integer, got string"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { { 'b', 'b' } }) } } }\n",
     SH_EINVAL, "bad.lua:5",
     "replica 1 stage 1: node 'b' is named twice in the group (ranks 0 and 1)"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'b', 'b' }), tp = 2 } } }\n",
     SH_EINVAL, "bad.lua:5", "replica 1 stage 1 (tp = 2): node 'b' is named twice in the group"},
    {"return cluster { nodes = nodes(node { name = 's', listen = 'tcp://h:3', standby = true }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { { 'b', 's' } }) } } }\n",
     SH_EINVAL, "bad.lua:6", "replica 1 stage 1: node 's' is a standby and cannot serve"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'ipc:///c' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { nodes = { 'b', 'c' } } } } } }\n",
     SH_EINVAL, "bad.lua:6",
     "replica 1 stage 1: rank 0 'b' listens on tcp://h:2 and rank 1 'c' on ipc:///c: the ranks "
     "of a group exchange over one kind of link"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'ipc:///c' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'c', 'b' }), tp = 2 } } }\n",
     SH_EINVAL, "bad.lua:6", "rank 0 'c' listens on ipc:///c and rank 1 'b' on tcp://h:2"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { nodes = { 'b', 'zz' } } } } } }\n",
     SH_ENOTFOUND, "bad.lua:5", "replica 1 stage 1: unknown node 'zz'"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { nodes = { } } } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica 1 stage 1: nodes is empty"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { node = 'b', nodes = { 'b' } } } } } }\n",
     SH_EINVAL, "bad.lua:5", "give either node = \"NAME\" or nodes = { ... }"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { first_layer = 0, last_layer = 2 } } } } }\n",
     SH_EINVAL, "bad.lua:5", "not neither"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = { { nodes = { 'b', 7 } } } } } }\n",
     SH_EINVAL, "bad.lua:5", "replica 1 stage 1: nodes[2] must be a node name, got number"},
    {"local p = pipeline(m, { 'a', 5 })\n", SH_EINVAL, "bad.lua:4",
     "pipeline: node 2 must be a node name or a list of node names"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'tcp://h:3' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'b', 'c', 'b' }), tp = 2 } } }\n",
     SH_EINVAL, "bad.lua:6",
     "replica 1: tp = 2 groups the stages' 3 nodes by 2, which leaves 1 over"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'tcp://h:3' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { { 'b', 'c' } }), tp = 3 } } }\n",
     SH_EINVAL, "bad.lua:6", "replica 1: tp = 3 but stage 1's group has 2 ranks"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'tcp://h:3' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, tp = 2,\n"
     "    stages = pipeline(m, { 'b', 'c' }, { weights = { 1, 2 } }) } } }\n",
     SH_EINVAL, "bad.lua:6",
     "replica 1: tp = 2 groups pipeline()'s nodes, but the stages have "
     "weights"},
    {"return cluster { nodes = nodes(node { name = 'c', listen = 'tcp://h:3' }),\n"
     "  gateway = { node = 'a', http = 'h:80' },\n"
     "  replicas = { replica { model = m, tp = 2, stages = { { node = 'b', first_layer = 0,\n"
     "    last_layer = 1 }, { node = 'c', first_layer = 1, last_layer = 2 } } } } }\n",
     SH_EINVAL, "bad.lua:6", "but the stages have layer ranges written out"},
    {"return 42\n", SH_EINVAL, "bad.lua", "must return cluster{...}, got number"},
    {"m.name = 'x'\n", SH_ELUA, "bad.lua:4", "read-only"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
     "  watchdog = { policy = 'p.lua', hold_s = -1 } }\n",
     SH_EINVAL, "bad.lua:4", "field 'hold_s' must be within 0..3600"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
     "  watchdog = { shed_priority = 300 } }\n",
     SH_EINVAL, "bad.lua:4", "field 'shed_priority' must be within 0..256"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
     "  routing = { long_prompt = -1 } }\n",
     SH_EINVAL, "bad.lua:4", "cluster.routing: field 'long_prompt' must be within 0..1073741824"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
     "  routing = { route = 'first' } }\n",
     SH_EINVAL, "bad.lua:4",
     "cluster.routing: field 'route' must be a function(req, replicas), got string"},
    {"return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
     "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) } },\n"
     "  routing = { long = 5 } }\n",
     SH_EINVAL, "bad.lua:4", "unknown key 'long'"},
};

static void test_errors(void)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const struct bad_case *b = &bad_cases[i];
        char src[2048];
        snprintf(src, sizeof src, "%s%s", head, b->body);
        sh_cluster_config *c = (sh_cluster_config *)1;
        sh_error e = {0};
        sh_err err = load_str(src, NULL, &c, &e);
        CHECK(c == NULL);
        if (err != b->code || !strstr(e.msg, b->where) || !strstr(e.msg, b->text))
            SH_FAIL_("case %zu: got %s \"%s\", want %s with \"%s\" and \"%s\"", i, sh_strerror(err),
                     e.msg, sh_strerror(b->code), b->where, b->text);
    }
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(sh_config_load_file("/nonexistent/cluster.lua", NULL, &c, &e), SH_EIO);
    CHECK(strstr(e.msg, "/nonexistent/cluster.lua") != NULL);
}

/* Scripts that try to leave the sandbox; each must fail with the given text. */
static const struct escape {
    const char *src;
    const char *text;
} escapes[] = {
    {"io.open('/etc/passwd')", "global 'io'"},
    {"os.exit(1)", "global 'os'"},
    {"require('io')", "global 'require'"},
    {"dofile('/etc/passwd')", "global 'dofile'"},
    {"loadfile('/etc/passwd')", "global 'loadfile'"},
    {"debug.getinfo(1)", "global 'debug'"},
    {"package.loadlib('x', 'y')", "global 'package'"},
    {"string.dump(print)", "field 'dump'"},
    {"local f = assert(load(string.char(27) .. 'LuaT\\0\\25\\147\\r\\n\\26\\n'))", "binary chunk"},
    {"local f = load('return 1', 'x', 'b')", "only text chunks"},
    {"local f = load('return 1', 'x', 'bt')", "only text chunks"},
    {"collectgarbage('stop')", "invalid option 'stop'"},
    {"setmetatable({}, { __gc = function() end })", "__gc is not allowed"},
    {"getmetatable('').__index.dump(print)", "field 'dump'"},
    {"coroutine.wrap(print)", "global 'coroutine'"},
    {"warn('@on')", "global 'warn'"},
    {"local s = string.rep('a', 20000); s:find('.-.-.-b')", "too costly"},
    {"table.move({}, 1, 1e12, 1, {})", "range too large"},
    {"local t = setmetatable({}, { __len = function() return 1e15 end }); table.insert(t, 1, 1)",
     "with __len is not allowed"},
    {"local s = string.rep('a', 4e6); s:find(string.rep('a', 1e5) .. 'b', 1, true)", "too costly"},
    {"local s = string.rep('(', 1e5); s:find('%b()')", "too costly"},
    {"local m = model { name = 'm', path = 'p' }; setmetatable(m, {})", "protected metatable"},
    {"local m = model { name = 'm', path = 'p' }; error(getmetatable(m))", "locked"},
};

/* node{ memory_budget, standby, preload }: parsed and checked (issue 12). */
/* replica{ drafter = { self = LAYERS } }: no file, the layers and the replica's line kept. */
static void test_drafter_self(void)
{
    const char *src = "local m = model { name = 'm', path = '/m.gguf' }\n"
                      "return cluster {\n"
                      "  nodes = { node { name = 'a', listen = 'ipc:///a' },\n"
                      "            node { name = 'd', listen = 'ipc:///d' } },\n"
                      "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
                      "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
                      "               drafter = { node = 'd', self = 12 } } } }\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_config_load_string(src, strlen(src), "ok.lua", NULL, &c, &e));
    if (c) {
        CHECK_INT_EQ(c->replicas[0].drafter_node, 1);
        CHECK(c->replicas[0].drafter_path == NULL);
        CHECK_INT_EQ(c->replicas[0].drafter_self, 12);
        CHECK_STR_EQ(c->replicas[0].drafter_where, "ok.lua:6");
    }
    sh_config_destroy(c);
}

static void test_node_budget_standby(void)
{
    const char *src =
        "local m = model { name = 'm', path = 'm.gguf' }\n"
        "return cluster { nodes = {\n"
        "  node { name = 'f', listen = 'ipc:///f' },\n"
        "  node { name = 'w', listen = 'ipc:///w', memory_budget = '1.5 GiB' },\n"
        "  node { name = 'x', listen = 'ipc:///x', memory_budget = 4096 },\n"
        "  node { name = 's', listen = 'ipc:///s', standby = true, preload = 'w' } },\n"
        "  gateway = { node = 'f', http = 'h:80' },\n"
        "  replicas = { replica { model = m, stages = pipeline(m, { 'w', 'x' }) } } }\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(load_str(src, NULL, &c, &e));
    if (!c) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    CHECK_INT_EQ((int64_t)c->nodes[0].memory_budget, 0);
    CHECK_INT_EQ((int64_t)c->nodes[1].memory_budget, (int64_t)3 << 29);
    CHECK_INT_EQ((int64_t)c->nodes[2].memory_budget, 4096);
    CHECK(c->nodes[3].standby);
    CHECK_STR_EQ(c->nodes[3].preload, "w");
    CHECK(c->nodes[1].preload == NULL);
    sh_config_destroy(c);
    static const struct {
        const char *node, *want;
    } bad[] = {
        {"node { name = 'w', listen = 'ipc:///w', memory_budget = 'lots' }",
         "node: field 'memory_budget' must be bytes or a size like \"512MiB\""},
        {"node { name = 'w', listen = 'ipc:///w', memory_budget = 0 }",
         "node: field 'memory_budget' must be bytes"},
        {"node { name = 'w', listen = 'ipc:///w', preload = 'x' }",
         "node 'w': preload is for a standby node"},
        {"node { name = 'w', listen = 'ipc:///w', preload = 3 }",
         "field 'preload' must be a string"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char buf[1024];
        snprintf(buf, sizeof buf,
                 "local m = model { name = 'm', path = 'm.gguf' }\n"
                 "local n = %s\n"
                 "return cluster { nodes = { node { name = 'f', listen = 'ipc:///f' }, n },\n"
                 "  gateway = { node = 'f', http = 'h:80' },\n"
                 "  replicas = { replica { model = m, stages = pipeline(m, { 'w' }) } } }\n",
                 bad[i].node);
        c = NULL;
        e = (sh_error){0};
        CHECK(load_str(buf, NULL, &c, &e) == SH_EINVAL);
        CHECK(c == NULL);
        if (!strstr(e.msg, bad[i].want) || !strstr(e.msg, "bad.lua:2"))
            fprintf(stderr, "case %zu: got '%s', want bad.lua:2 and '%s'\n", i, e.msg, bad[i].want);
        CHECK(strstr(e.msg, bad[i].want) != NULL);
        CHECK(strstr(e.msg, "bad.lua:2") != NULL);
    }
}

static void test_sandbox_escapes(void)
{
    for (size_t i = 0; i < sizeof escapes / sizeof escapes[0]; i++) {
        sh_cluster_config *c = NULL;
        sh_error e = {0};
        sh_err err = load_str(escapes[i].src, NULL, &c, &e);
        if (err == SH_OK || !strstr(e.msg, escapes[i].text))
            SH_FAIL_("escape %zu: got %s \"%s\", want \"%s\"", i, sh_strerror(err), e.msg,
                     escapes[i].text);
        sh_config_destroy(c);
    }
    /* What the sandbox keeps working: text load with an environment, pcall, patterns on short
     * strings, string.rep of nothing, utf8 and math. */
    const char *ok = "local f = load('return x', 'chunk', 't', { x = 5 })\n"
                     "assert(f() == 5)\n"
                     "assert(not pcall(error, 'x'))\n"
                     "assert(('k=v'):match('(%w+)=(%w+)') == 'k')\n"
                     "assert(string.rep('', 1e15) == '')\n"
                     "assert(utf8.len('h\\u{e9}') == 2 and math.max(1, 2) == 2)\n"
                     "assert(collectgarbage('count') > 0)\n"
                     "error('reached the end')\n";
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(load_str(ok, NULL, &c, &e), SH_ELUA);
    CHECK(strstr(e.msg, "bad.lua:8: reached the end") != NULL);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Relative model paths in a script file are relative to the script's directory, not to the
 * current one; absolute paths and scripts given as strings are unchanged. */
static void test_script_relative_paths(void)
{
    char dir[] = "/tmp/sh_lua_paths_XXXXXX", sub[64], script[96];
    if (!mkdtemp(dir)) {
        SH_FAIL_("mkdtemp: %s", strerror(errno));
        return;
    }
    snprintf(sub, sizeof sub, "%s/conf", dir);
    CHECK_INT_EQ(mkdir(sub, 0700), 0);
    snprintf(script, sizeof script, "%s/cluster.lua", sub);
    const char *src = "local m = model { name = 'm', path = 'm.gguf' }\n"
                      "return cluster {\n"
                      "  nodes = { node { name = 'a', listen = 'inproc://a',\n"
                      "    tls_cert = 'certs/a.pem', tls_key = '/keys/a.key' } },\n"
                      "  models = { model { name = 'up', path = '../w/up.gguf' },\n"
                      "             model { name = 'abs', path = '/srv/models/abs.gguf' } },\n"
                      "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
                      "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }),\n"
                      "               drafter = { node = 'a', model = 'd/draft.gguf' } } },\n"
                      "  key_file = 'keys/cluster.key', tls_ca = 'certs/ca.pem',\n"
                      "  watchdog = { policy = 'pol/p.lua', hold_s = 2.5, degrade_max_tokens = 8,\n"
                      "               fallback = 'up', shed_priority = 3 },\n"
                      "}\n";
    write_text(script, src);
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_config_load_file(script, NULL, &c, &e));
    if (c) {
        char want[160];
        CHECK_INT_EQ(c->n_models, 3);
        snprintf(want, sizeof want, "%s/../w/up.gguf", sub);
        CHECK_STR_EQ(c->models[0].path, want);
        CHECK_STR_EQ(c->models[1].path, "/srv/models/abs.gguf");
        snprintf(want, sizeof want, "%s/m.gguf", sub);
        CHECK_STR_EQ(c->models[2].path, want);
        CHECK_INT_EQ(c->replicas[0].drafter_node, 0);
        snprintf(want, sizeof want, "%s/d/draft.gguf", sub);
        CHECK_STR_EQ(c->replicas[0].drafter_path, want);
        snprintf(want, sizeof want, "%s/keys/cluster.key", sub);
        CHECK_STR_EQ(c->key_file, want);
        snprintf(want, sizeof want, "%s/certs/ca.pem", sub);
        CHECK_STR_EQ(c->tls_ca, want);
        snprintf(want, sizeof want, "%s/certs/a.pem", sub);
        CHECK_STR_EQ(c->nodes[0].tls_cert, want);
        CHECK_STR_EQ(c->nodes[0].tls_key, "/keys/a.key");
        snprintf(want, sizeof want, "%s/pol/p.lua", sub);
        CHECK_STR_EQ(c->watchdog.policy, want);
        CHECK(c->watchdog.policy_given);
        CHECK_INT_EQ(c->watchdog.hold_ms, 2500);
        CHECK_INT_EQ(c->watchdog.degrade_max_tokens, 8);
        CHECK_STR_EQ(c->watchdog.fallback, "up");
        CHECK_INT_EQ(c->watchdog.shed_priority, 3);
        sh_config_destroy(c);
    }
    c = NULL;
    CHECK_OK(sh_config_load_string(src, strlen(src), script, NULL, &c, &e));
    if (c) {
        CHECK_STR_EQ(c->models[0].path, "../w/up.gguf");
        CHECK_STR_EQ(c->models[2].path, "m.gguf");
        CHECK_STR_EQ(c->key_file, "keys/cluster.key");
        CHECK_STR_EQ(c->nodes[0].tls_cert, "certs/a.pem");
        sh_config_destroy(c);
    }
    unlink(script);
    rmdir(sub);
    rmdir(dir);

    /* The shipped examples name the repository's model from wherever they are loaded. */
    static const char *const examples[] = {"lua/examples/single-node.lua",
                                           "lua/examples/cluster-demo.lua"};
    for (size_t i = 0; i < sizeof examples / sizeof examples[0]; i++) {
        c = NULL;
        CHECK_OK(sh_config_load_file(sh_test_path(examples[i]), NULL, &c, &e));
        if (!c)
            continue;
        char real_model[PATH_MAX], real_want[PATH_MAX];
        const char *want = sh_test_path("models/smollm2-135m-instruct-q4_1.gguf");
        if (access(want, R_OK) == 0) {
            if (!realpath(c->models[0].path, real_model) || !realpath(want, real_want) ||
                strcmp(real_model, real_want) != 0)
                SH_FAIL_("%s: model path %s is not %s", examples[i], c->models[0].path, want);
        } else {
            fprintf(stderr, "(no %s: example paths checked by text only)\n", want);
            CHECK(strstr(c->models[0].path, "/../../models/smollm2") != NULL);
        }
        sh_config_destroy(c);
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void test_limits(void)
{
    sh_lua_limits lim = {.memory_bytes = 4u << 20, .time_ms = 100};
    static const char *const loops[] = {
        "while true do end",
        "while true do pcall(function() while true do end end) end",
        ("while true do xpcall(function() while true do end end, function(e) while true do end "
         "end) end"),
        "local function f() return f() end f()",
    };
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        sh_cluster_config *c = NULL;
        sh_error e = {0};
        double t0 = now_s();
        sh_err err = load_str(loops[i], &lim, &c, &e);
        double dt = now_s() - t0;
        if (err != SH_ETIMEDOUT || !strstr(e.msg, "time limit of 100 ms") || dt > 2.0)
            SH_FAIL_("loop %zu: %s \"%s\" after %.3f s", i, sh_strerror(err), e.msg, dt);
    }
    static const char *const hogs[] = {
        "local t = {} for i = 1, 1e9 do t[i] = i end",
        "local t = {} while true do pcall(function() t[#t + 1] = string.rep('x', 1000) end) end",
        "local s = string.rep('x', 1e9)",
        "local s = 'x' while true do s = s .. s end",
    };
    /* The hogs get a generous clock so that only the memory limit can stop them: on a slow
     * (sanitizer, loaded) build 100 ms may run out before 4 MiB is allocated. */
    sh_lua_limits mem_lim = {.memory_bytes = 4u << 20, .time_ms = 20000};
    for (size_t i = 0; i < sizeof hogs / sizeof hogs[0]; i++) {
        sh_cluster_config *c = NULL;
        sh_error e = {0};
        sh_err err = load_str(hogs[i], &mem_lim, &c, &e);
        if (err != SH_ENOMEM || !strstr(e.msg, "bad.lua:1: memory limit of 4194304 bytes"))
            SH_FAIL_("hog %zu: %s \"%s\"", i, sh_strerror(err), e.msg);
    }
    /* Allocation-heavy loops stop on time too. Near the memory limit each new string makes Lua
     * try to grow its string table, fail, and collect the whole heap, with few VM instructions
     * between: the instruction hook alone let this run 8-9 s under a 2 s limit. Either limit may
     * stop it (on a slow build 64 MiB may not fill in 2 s), but not much after 2 s. */
    {
        sh_lua_limits def = {.memory_bytes = 64u << 20, .time_ms = 2000};
        sh_cluster_config *c = NULL;
        sh_error e = {0};
        double t0 = now_s();
        sh_err err =
            load_str("local t = {} for i = 1, 1e9 do t[tostring(i)] = true end", &def, &c, &e);
        double dt = now_s() - t0;
        if ((err != SH_ETIMEDOUT && err != SH_ENOMEM) || dt > 3.5)
            SH_FAIL_("string-key hog: %s \"%s\" after %.3f s (limit 2 s)", sh_strerror(err), e.msg,
                     dt);
        if (err == SH_ETIMEDOUT && !strstr(e.msg, "time limit of 2000 ms"))
            SH_FAIL_("string-key hog: \"%s\"", e.msg);
    }
    /* A tiny limit fails cleanly when the state cannot even be built. */
    sh_lua_limits tiny = {.memory_bytes = 1000};
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(load_str("return 1", &tiny, &c, &e), SH_ENOMEM);
}

static void collect(void *ud, const char *line)
{
    char *buf = ud;
    size_t n = strlen(buf);
    snprintf(buf + n, 256 - n, "[%s]", line);
}

static void test_print_log(void)
{
    char buf[256] = "";
    sh_lua_limits lim = {.log = collect, .log_ud = buf};
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    load_str("print('hello', 42, nil) print() return 1", &lim, &c, &e);
    CHECK_STR_EQ(buf, "[hello\t42\tnil][]");
    /* Without a callback print is silent. */
    CHECK_INT_EQ(load_str("print('dropped') return 1", NULL, &c, &e), SH_EINVAL);
}

/* cluster{ routing = ... }: the threshold's default, and route() called in the kept sandbox:
 * nil, an index, every kind of failure (each leaving the state usable), state kept between calls,
 * cluster{} refused from it. */
static void test_routing(void)
{
    static const char *const base =
        "return cluster { nodes = nodes(), gateway = { node = 'a', http = '127.0.0.1:1' },\n"
        "  replicas = { replica { model = m, stages = pipeline(m, { 'a' }) },\n"
        "               replica { model = m, stages = pipeline(m, { 'b' }) } }%s }\n";
    char src[4096], body[2048];
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    snprintf(body, sizeof body, base, "");
    snprintf(src, sizeof src, "%s%s", head, body);
    CHECK_INT_EQ(load_str(src, NULL, &c, &e), SH_OK);
    CHECK_INT_EQ(c->routing.long_prompt, 512);
    CHECK(c->routing.route == NULL);
    sh_config_destroy(c);

    snprintf(body, sizeof body, base,
             ",\n  routing = { long_prompt = 0, route = function(req, reps)\n"
             "    calls = (calls or 0) + 1\n"
             "    if req.max_tokens == 1 then error('boom') end\n"
             "    if req.max_tokens == 2 then return 'x' end\n"
             "    if req.max_tokens == 3 then return 7 end\n"
             "    if req.max_tokens == 4 then while true do end end\n"
             "    if req.max_tokens == 5 then return cluster {} end\n"
             "    if req.max_tokens == 6 then return 1.5 end\n"
             "    if req.model ~= 'm' or req.priority ~= 3 or #reps ~= 2 then return nil end\n"
             "    if req.max_tokens == 8 then return calls end\n"
             "    for _, r in ipairs(reps) do\n"
             "      if r.tp == 2 and r.stages == 1 and r.healthy and r.load == 2.5 then\n"
             "        return r.index end end\n"
             "  end }");
    snprintf(src, sizeof src, "%s%s", head, body);
    sh_err err0 = load_str(src, NULL, &c, &e);
    if (err0)
        SH_FAIL_("%s: %s", sh_strerror(err0), e.msg);
    CHECK_INT_EQ(c->routing.long_prompt, 0);
    CHECK(c->routing.route != NULL);
    sh_route_replica reps[2] = {{.index = 0, .tp = 1, .stages = 1, .load = 1, .healthy = true},
                                {.index = 1, .tp = 2, .stages = 1, .load = 2.5, .healthy = true}};
    sh_route_req q = {.prompt_tokens = 100, .max_tokens = 16, .priority = 3, .model = "m"};
    int32_t choice = -2;
    CHECK_INT_EQ(sh_config_route_call(c->routing.route, &q, reps, 2, &choice, &e), SH_OK);
    CHECK_INT_EQ(choice, 1);
    q.model = "other"; /* nil: the default rule */
    CHECK_INT_EQ(sh_config_route_call(c->routing.route, &q, reps, 2, &choice, &e), SH_OK);
    CHECK_INT_EQ(choice, -1);
    q.model = "m";
    static const struct {
        int32_t max_tokens;
        sh_err code;
        const char *text;
    } fails[] = {
        {1, SH_ELUA, "bad.lua:9: boom"},
        {2, SH_EINVAL, "route(req, replicas) returned string, expected a replica's index or nil"},
        {3, SH_EINVAL, "returned 7, not the index of one of the model's replicas"},
        {4, SH_ETIMEDOUT, ""},
        {5, SH_EINVAL, "cluster{} can only be called while the script runs"},
        {6, SH_EINVAL, "returned a non-integer number"},
    };
    for (size_t i = 0; i < sizeof fails / sizeof fails[0]; i++) {
        q.max_tokens = fails[i].max_tokens;
        choice = -2;
        sh_err err = sh_config_route_call(c->routing.route, &q, reps, 2, &choice, &e);
        if (err != fails[i].code || !strstr(e.msg, fails[i].text))
            SH_FAIL_("max_tokens %d: got %s \"%s\", want %s with \"%s\"", (int)fails[i].max_tokens,
                     sh_strerror(err), e.msg, sh_strerror(fails[i].code), fails[i].text);
        CHECK_INT_EQ(choice, -2);
    }
    /* The state survived every failure and keeps its globals: this is the 9th call, returned as
     * an index, which names the replica listed as 9. */
    reps[1].index = 9;
    q.max_tokens = 8;
    CHECK_INT_EQ(sh_config_route_call(c->routing.route, &q, reps, 2, &choice, &e), SH_OK);
    CHECK_INT_EQ(choice, 9);
    sh_config_destroy(c);
}

static const sh_test_case tests[] = {
    {"demo", test_demo},
    {"defaults_and_layers", test_defaults_and_layers},
    {"weights", test_weights},
    {"tp_groups", test_tp_groups},
    {"errors", test_errors},
    {"node_budget_standby", test_node_budget_standby},
    {"drafter_self", test_drafter_self},
    {"sandbox_escapes", test_sandbox_escapes},
    {"script_relative_paths", test_script_relative_paths},
    {"limits", test_limits},
    {"print_log", test_print_log},
    {"routing", test_routing},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
