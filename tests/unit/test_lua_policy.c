/* Unit tests of degradation policies: the default script, result validation, time and memory
 * limits with recovery, and reloads that keep the old script when the new one fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lua/config.h"
#include "sh_test.h"
#include "shoal.h"

static sh_err load(sh_policy *p, const char *src, sh_error *e)
{
    return sh_policy_load_string(p, src, strlen(src), "pol.lua", e);
}

static int32_t level_of(sh_policy *p, double x)
{
    sh_policy_metric m[] = {{"x", x}};
    int32_t level = -1;
    sh_error e = {0};
    if (sh_policy_level_pairs(p, m, 1, &level, &e) != SH_OK)
        fprintf(stderr, "level_of: %s\n", e.msg);
    return level;
}

static void test_default(void)
{
    sh_policy *p = NULL;
    sh_error e = {0};
    CHECK_OK(sh_policy_create(NULL, &p, &e));
    CHECK_OK(sh_policy_load_file(p, sh_test_path("lua/policy/default.lua"), &e));
    static const struct {
        double wait, kv;
        int32_t level;
    } cases[] = {{0, 0, 0},    {501, 0.5, 1}, {1500, 0, 2},  {2500, 0, 3},
                 {6000, 0, 4}, {10, 0.99, 4}, {500, 0.98, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sh_policy_metrics m = {.queue_wait_p99_ms = cases[i].wait, .kv_used = cases[i].kv};
        int32_t level = -1;
        CHECK_OK(sh_policy_level(p, &m, &level, &e));
        CHECK_INT_EQ(level, cases[i].level);
    }
    sh_policy_destroy(p);
    sh_policy_destroy(NULL);
}

static void test_results(void)
{
    sh_policy *p = NULL;
    sh_error e = {0};
    int32_t level = -1;
    CHECK_OK(sh_policy_create(NULL, &p, &e));
    CHECK_INT_EQ(sh_policy_level_pairs(p, NULL, 0, &level, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "no policy") != NULL);
    CHECK_OK(load(p,
                  "local bad = { [1] = 2.5, [2] = 7, [3] = 'x', [4] = -1 }\n"
                  "function level(m)\n"
                  "  if (m.x or 0) == 0 then return 0 end\n"
                  "  if m.x == 5 then return 2.0 end\n"
                  "  if m.x == 6 then error('policy failed') end\n"
                  "  return bad[m.x]\n"
                  "end\n",
                  &e));
    static const struct {
        double x;
        sh_err code;
        const char *text;
    } cases[] = {
        {1, SH_EINVAL, "pol.lua:2: level(m) returned a non-integer number"},
        {2, SH_ERANGE, "pol.lua:2: level(m) returned 7, expected 0..4"},
        {3, SH_EINVAL, "returned string"},
        {4, SH_ERANGE, "returned -1"},
        {9, SH_EINVAL, "returned nil"},
        {6, SH_ELUA, "pol.lua:5: policy failed (traceback: pol.lua:5: in function 'level')"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sh_policy_metric m[] = {{"x", cases[i].x}};
        level = 99;
        sh_err err = sh_policy_level_pairs(p, m, 1, &level, &e);
        if (err != cases[i].code || !strstr(e.msg, cases[i].text) || level != 99)
            SH_FAIL_("case %zu: %s \"%s\"", i, sh_strerror(err), e.msg);
    }
    CHECK_INT_EQ(level_of(p, 5), 2);
    sh_policy_destroy(p);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void test_limits(void)
{
    sh_lua_limits lim = {.memory_bytes = 2u << 20, .time_ms = 30};
    sh_policy *p = NULL;
    sh_error e = {0};
    CHECK_OK(sh_policy_create(&lim, &p, &e));
    CHECK_OK(load(p,
                  "calls = 0\n"
                  "function level(m)\n"
                  "  calls = calls + 1\n"
                  "  if m.x == 1 then while true do end end\n"
                  "  if m.x == 2 then local t = {} for i = 1, 1e9 do t[i] = i end end\n"
                  "  return calls % 5\n"
                  "end\n",
                  &e));
    CHECK_INT_EQ(level_of(p, 0), 2); /* the trial call was the first */
    for (int round = 0; round < 3; round++) {
        sh_policy_metric loop[] = {{"x", 1}}, hog[] = {{"x", 2}};
        int32_t level = -1;
        double t0 = now_s();
        CHECK_INT_EQ(sh_policy_level_pairs(p, loop, 1, &level, &e), SH_ETIMEDOUT);
        double dt = now_s() - t0;
        CHECK(strstr(e.msg, "pol.lua:4: time limit of 30 ms exceeded") != NULL);
        CHECK(dt < 0.5);
        CHECK_INT_EQ(sh_policy_level_pairs(p, hog, 1, &level, &e), SH_ENOMEM);
        CHECK(strstr(e.msg, "pol.lua:5: memory limit of 2097152 bytes exceeded") != NULL);
        /* The host and the state carry on: the next good call works. */
        CHECK_INT_EQ(level_of(p, 0), (3 + 3 * round + 2) % 5);
    }
    sh_policy_destroy(p);
}

static void test_reload(void)
{
    sh_lua_limits lim = {.time_ms = 30};
    sh_policy *p = NULL;
    sh_error e = {0};
    CHECK_OK(sh_policy_create(&lim, &p, &e));
    CHECK_OK(load(p, "function level(m) return 1 end", &e));
    CHECK_INT_EQ(level_of(p, 0), 1);
    static const struct {
        const char *src;
        sh_err code;
        const char *text;
    } broken[] = {
        {"function level(m) return 1", SH_ELUA, "pol.lua:1:"},
        {"function levels(m) return 1 end", SH_EINVAL, "does not define a function level(m)"},
        {"level = 3", SH_EINVAL, "does not define"},
        {"function level(m) return 9 end", SH_ERANGE, "returned 9"},
        {"function level(m) return m.x + m.missing end", SH_ELUA, "field 'missing'"},
        {"while true do end", SH_ETIMEDOUT, "time limit"},
        {"function level(m) while true do end end", SH_ETIMEDOUT, "time limit"},
        {"error('no')", SH_ELUA, "pol.lua:1: no"},
    };
    for (size_t i = 0; i < sizeof broken / sizeof broken[0]; i++) {
        sh_err err = load(p, broken[i].src, &e);
        if (err != broken[i].code || !strstr(e.msg, broken[i].text))
            SH_FAIL_("reload %zu: %s \"%s\"", i, sh_strerror(err), e.msg);
        CHECK_INT_EQ(level_of(p, 0), 1);
    }
    /* The trial call uses the last metrics, so a script may rely on names the struct lacks. */
    CHECK_OK(load(p, "function level(m) return m.x + 2 end", &e));
    CHECK_INT_EQ(level_of(p, 1), 3);
    CHECK_INT_EQ(sh_policy_load_file(p, "/nonexistent.lua", &e), SH_EIO);
    CHECK_INT_EQ(level_of(p, 0), 2);
    sh_policy_destroy(p);
}

/* The built-in copy (what `--policy default` loads) is the file, byte for byte, and loads. */
static void test_builtin(void)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = fopen(sh_test_path("lua/policy/default.lua"), "rb");
    CHECK(f != NULL);
    if (f) {
        fseek(f, 0, SEEK_END);
        len = (size_t)ftell(f);
        rewind(f);
        text = malloc(len + 1);
        CHECK(text && fread(text, 1, len, f) == len);
        fclose(f);
    }
    CHECK_UINT_EQ(len, strlen(sh_policy_default_lua));
    CHECK(text && memcmp(text, sh_policy_default_lua, len) == 0);
    free(text);
    sh_policy *p = NULL;
    sh_error e = {0};
    CHECK_OK(sh_policy_create(NULL, &p, &e));
    CHECK_OK(sh_policy_load_default(p, &e));
    sh_policy_metrics m = {.queue_wait_p99_ms = 1500};
    int32_t level = -1;
    CHECK_OK(sh_policy_level(p, &m, &level, &e));
    CHECK_INT_EQ(level, 2);
    sh_policy_destroy(p);
}

static const sh_test_case tests[] = {
    {"default", test_default}, {"builtin", test_builtin}, {"results", test_results},
    {"limits", test_limits},   {"reload", test_reload},   {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
