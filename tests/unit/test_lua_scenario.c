/* Unit tests of fault scenarios: the shipped demo, ordering, links, checks against a cluster and
 * validation errors with file:line. */
#include <time.h>

#include "lua/config.h"
#include "runtime/fault_scenario.h"
#include "sh_test.h"
#include "shoal.h"

static sh_err load(const char *src, sh_scenario **s, sh_error *e)
{
    return sh_scenario_load_string(src, strlen(src), "chaos.lua", NULL, s, e);
}

static void test_demo(void)
{
    sh_scenario *s = NULL;
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(sh_scenario_load_file(sh_test_path("lua/examples/scenario-demo.lua"), NULL, &s, &e));
    CHECK_OK(sh_config_load_file(sh_test_path("lua/examples/cluster-demo.lua"), NULL, &c, &e));
    if (!s || !c) {
        fprintf(stderr, "%s\n", e.msg);
        sh_scenario_destroy(s);
        sh_config_destroy(c);
        return;
    }
    CHECK_INT_EQ(s->n_events, 11);
    const sh_fault_event *ev = s->events;
    CHECK_INT_EQ(ev[0].kind, SH_FAULT_KILL);
    CHECK_NEAR(ev[0].time_s, 2.0, 0);
    CHECK_STR_EQ(ev[0].from, "w1");
    CHECK_INT_EQ(ev[0].line, 2);
    CHECK_INT_EQ(ev[1].kind, SH_FAULT_DELAY);
    CHECK_STR_EQ(ev[1].from, "w0");
    CHECK_STR_EQ(ev[1].to, "w1");
    CHECK_NEAR(ev[1].ms, 50, 0);
    CHECK_NEAR(ev[1].lasting_s, 5, 0);
    CHECK_INT_EQ(ev[2].kind, SH_FAULT_DROP);
    CHECK_STR_EQ(ev[2].from, "*");
    CHECK_STR_EQ(ev[2].to, "*");
    CHECK_NEAR(ev[2].p, 0.01, 0);
    CHECK_INT_EQ(ev[3].kind, SH_FAULT_DUPLICATE); /* same time as corrupt: script order */
    CHECK_STR_EQ(ev[3].from, "front");
    CHECK_NEAR(ev[3].lasting_s, 0, 0);
    CHECK_INT_EQ(ev[4].kind, SH_FAULT_CORRUPT);
    CHECK_INT_EQ(ev[4].bytes, 4);
    CHECK_INT_EQ(ev[5].kind, SH_FAULT_STALL);
    CHECK_STR_EQ(ev[5].from, "w0/stage0");
    CHECK_NEAR(ev[5].ms, 300, 0);
    CHECK_INT_EQ(ev[6].kind, SH_FAULT_PARTITION);
    CHECK_STR_EQ(ev[6].to, "w1");
    CHECK_NEAR(ev[9].time_s, 14, 0);
    CHECK_INT_EQ(ev[9].line, 11);
    CHECK_INT_EQ(ev[10].kind, SH_FAULT_HEAL);
    CHECK_STR_EQ(sh_scenario_kind_name(ev[10].kind), "heal");
    CHECK_OK(sh_scenario_check(s, c, &e));
    sh_scenario_destroy(s);

    CHECK_OK(load("at(1, stall { actor = 'w9/batcher', ms = 5 })", &s, &e));
    CHECK_INT_EQ(sh_scenario_check(s, c, &e), SH_ENOTFOUND);
    CHECK(strstr(e.msg, "chaos.lua:1: stall: unknown node 'w9/batcher'") != NULL);
    sh_scenario_destroy(s);
    sh_config_destroy(c);
    sh_scenario_destroy(NULL);
}

static void test_order(void)
{
    sh_scenario *s = NULL;
    sh_error e = {0};
    CHECK_OK(load("at(3, kill 'c')\nat(1, kill { node = 'a' })\nat(3, heal { a = 'x' })\n"
                  "at(0.5, partition { a = 'a', b = '*' })\n",
                  &s, &e));
    if (!s)
        return;
    CHECK_INT_EQ(s->n_events, 4);
    CHECK_INT_EQ(s->events[0].kind, SH_FAULT_PARTITION);
    CHECK_STR_EQ(s->events[1].from, "a");
    CHECK_STR_EQ(s->events[2].from, "c");
    CHECK_INT_EQ(s->events[3].kind, SH_FAULT_HEAL);
    CHECK_STR_EQ(s->events[3].from, "x");
    CHECK_STR_EQ(s->events[3].to, "*");
    sh_scenario_destroy(s);
    /* coll = true: the rule hits a group's collective frames alone. */
    CHECK_OK(load("at(1, drop { link = 'a->b', p = 0.01, coll = true })\n"
                  "at(2, duplicate { link = 'b->a', coll = true })\nat(3, drop { coll = false })\n",
                  &s, &e));
    if (!s)
        return;
    CHECK_INT_EQ(s->n_events, 3);
    CHECK_UINT_EQ(s->events[0].type, SH_FAULT_TYPE_COLL);
    CHECK_UINT_EQ(s->events[1].type, SH_FAULT_TYPE_COLL);
    CHECK_UINT_EQ(s->events[2].type, 0);
    sh_scenario_destroy(s);
    CHECK_OK(load("-- nothing happens", &s, &e));
    CHECK_INT_EQ(s ? s->n_events : 99, 0);
    sh_scenario_destroy(s);
}

static const struct bad_case {
    const char *src;
    const char *text;
} bad_cases[] = {
    {"at(1, drop { link = '*', p = 2 })", "chaos.lua:1: drop: field 'p' must be >= 0"},
    {"at(1, delay { link = '*', ms = 5, coll = true })", "delay: unknown key 'coll'"},
    {"at(1, drop { coll = 'yes' })", "field 'coll' must be a boolean"},
    {"\nat(1, drop { lnk = '*' })", "chaos.lua:2: drop: unknown key 'lnk'"},
    {"at(1, delay { from = 'a', to = 'b' })", "chaos.lua:1: delay: missing required field 'ms'"},
    {"at(1, delay { from = 'a', ms = '5' })", "field 'ms' must be a number, got string"},
    {"at(1, drop { link = 'a-b' })", "must be \"*\" or \"from->to\""},
    {"at(1, drop { link = 'a->b', from = 'a' })", "either link or from/to"},
    {"at(1, drop { from = 'a b' })", "not a node name"},
    {"at(1, corrupt { link = '*' })", "missing required field 'bytes'"},
    {"at(1, corrupt { link = '*', bytes = 0 })", "field 'bytes' must be within 1..16"},
    /* The fault layer's own limits (issue 25): a rule it would refuse is refused at load. */
    {"at(1, corrupt { link = '*', bytes = 1000 })", "field 'bytes' must be within 1..16, got 1000"},
    {"at(1, delay { link = '*', ms = 600001 })", "field 'ms' must be >= 0 and <= 600000"},
    {"at(1, stall { actor = 'w0', ms = 0 })", "field 'ms' must be > 0"},
    {"at(1, partition { a = 'x' })", "missing required field 'b'"},
    {"at(1, drop { p = 0.5, lasting = 0 })", "field 'lasting' must be > 0"},
    {"at(1, heal { a = 'x', link = '*' })", "a/b or a link"},
    {"at(1, kill(5))", "kill: expected a table, got an integer"},
    {"at(1, kill '*')", "not a node name"},
    {"at(-1, kill 'a')", "chaos.lua:1: at: time must be within"},
    {"at('soon', kill 'a')", "time must be a number"},
    {"at(1, 'kill a')", "must be an action"},
    {"at(1, { kind = 'kill' })", "must be an action"},
    {"at(1, nuke 'a')", "global 'nuke'"},
    {"at(1, stop '*')", "stop: '*' is not a node name"},
    {"at(1, stop { node = 'w0', lasting = 0 })", "stop: field 'lasting' must be > 0"},
    {"at(1, stop { node = 'w0', ms = 5 })", "stop: unknown key 'ms'"},
    {"at(1, cont { node = 'w0', lasting = 1 })", "cont: unknown key 'lasting'"},
    {"at(1, cont(7))", "cont: expected a table"},
    {"\n\nat(1, leak { node = 'w0', lasting = 5 })",
     "chaos.lua:3: leak: missing required field 'mb_per_s'"},
    {"at(1, leak { node = 'w0', mb_per_s = 50 })", "leak: missing required field 'lasting'"},
    {"at(1, leak { node = 'w0', mb_per_s = 0, lasting = 1 })",
     "leak: field 'mb_per_s' must be > 0"},
    {"at(1, leak { node = 'w0', mb_per_s = 1e6, lasting = 1 })",
     "leak: field 'mb_per_s' must be > 0 and <= 65536"},
    {"at(1, leak { node = 'w0', mb_per_s = 5, lasting = -1 })",
     "leak: field 'lasting' must be > 0"},
    {"at(1, leak { node = '*', mb_per_s = 5, lasting = 1 })", "leak: '*' is not a node name"},
    {"at(1, leak 'w0')", "leak: expected a table"},
};

/* stop, cont and leak: parsed into their events, and their nodes checked against a cluster. */
static void test_process_events(void)
{
    sh_scenario *s = NULL;
    sh_cluster_config *c = NULL;
    sh_error e = {0};
    CHECK_OK(load("at(2, stop 'w0')\nat(4, cont { node = 'w0' })\n"
                  "at(1, stop { node = 'w1', lasting = 2.5 })\n"
                  "at(3, leak { node = 'w1', mb_per_s = 50, lasting = 5 })\n",
                  &s, &e));
    if (!s) {
        fprintf(stderr, "%s\n", e.msg);
        return;
    }
    CHECK_INT_EQ(s->n_events, 4);
    const sh_fault_event *ev = s->events;
    CHECK_INT_EQ(ev[0].kind, SH_FAULT_STOP);
    CHECK_STR_EQ(ev[0].from, "w1");
    CHECK_NEAR(ev[0].lasting_s, 2.5, 0);
    CHECK_INT_EQ(ev[0].line, 3);
    CHECK_INT_EQ(ev[1].kind, SH_FAULT_STOP);
    CHECK_STR_EQ(ev[1].from, "w0");
    CHECK_NEAR(ev[1].lasting_s, 0, 0);
    CHECK_INT_EQ(ev[2].kind, SH_FAULT_LEAK);
    CHECK_STR_EQ(ev[2].from, "w1");
    CHECK_NEAR(ev[2].mb_per_s, 50, 0);
    CHECK_NEAR(ev[2].lasting_s, 5, 0);
    CHECK_INT_EQ(ev[3].kind, SH_FAULT_CONT);
    CHECK_STR_EQ(ev[3].from, "w0");
    CHECK_STR_EQ(sh_scenario_kind_name(SH_FAULT_STOP), "stop");
    CHECK_STR_EQ(sh_scenario_kind_name(SH_FAULT_CONT), "cont");
    CHECK_STR_EQ(sh_scenario_kind_name(SH_FAULT_LEAK), "leak");
    CHECK_OK(sh_config_load_file(sh_test_path("lua/examples/cluster-demo.lua"), NULL, &c, &e));
    if (c) {
        CHECK_OK(sh_scenario_check(s, c, &e));
        static const char *const unknown[] = {
            "at(1, stop 'nope')", "at(1, cont 'nope')",
            "at(1, leak { node = 'nope', mb_per_s = 1, lasting = 1 })", "at(1, kill 'nope')"};
        for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
            sh_scenario *u = NULL;
            CHECK_OK(load(unknown[i], &u, &e));
            if (!u)
                continue;
            CHECK_INT_EQ(sh_scenario_check(u, c, &e), SH_ENOTFOUND);
            CHECK(strstr(e.msg, "chaos.lua:1: ") != NULL && strstr(e.msg, "unknown node 'nope'"));
            sh_scenario_destroy(u);
        }
    }
    sh_config_destroy(c);
    sh_scenario_destroy(s);
}

static void test_errors(void)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        sh_scenario *s = (sh_scenario *)1;
        sh_error e = {0};
        sh_err err = load(bad_cases[i].src, &s, &e);
        CHECK(s == NULL);
        if (err == SH_OK || !strstr(e.msg, bad_cases[i].text))
            SH_FAIL_("case %zu: %s \"%s\", want \"%s\"", i, sh_strerror(err), e.msg,
                     bad_cases[i].text);
    }
}

/* What the runner handed to the host, in order. */
typedef struct calls {
    char log[256];
    double t_last; /* seconds from the runner's start to the last call */
    struct timespec t0;
} calls;

static double since(const struct timespec *t0)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)(ts.tv_sec - t0->tv_sec) + (double)(ts.tv_nsec - t0->tv_nsec) * 1e-9;
}

static sh_err on_stop_cont(void *ud, const char *node, sh_fault_kind kind, double lasting_s)
{
    calls *c = ud;
    size_t n = strlen(c->log);
    snprintf(c->log + n, sizeof c->log - n, "%s %s %g;", sh_scenario_kind_name(kind), node,
             lasting_s);
    c->t_last = since(&c->t0);
    return SH_OK;
}

static sh_err on_leak(void *ud, const char *node, double mb_per_s, double lasting_s)
{
    calls *c = ud;
    size_t n = strlen(c->log);
    snprintf(c->log + n, sizeof c->log - n, "leak %s %g %g;", node, mb_per_s, lasting_s);
    c->t_last = since(&c->t0);
    return SH_OK;
}

/* sh_fault_runner_start_at with an epoch 10 s ago: events already due run at once in order, a
 * leak that began more than a second before the start is skipped, a later one waits its time;
 * without callbacks, stop/cont/leak fail (counted). */
static void test_runner_epoch(void)
{
    sh_scenario *s = NULL;
    sh_error e = {0};
    CHECK_OK(load("at(0, leak { node = 'a', mb_per_s = 1, lasting = 1 })\n"
                  "at(0, stop 'a')\n"
                  "at(9.5, leak { node = 'b', mb_per_s = 2, lasting = 3 })\n"
                  "at(9.9, cont 'a')\n"
                  "at(10.3, stop { node = 'b', lasting = 1 })\n",
                  &s, &e));
    if (!s)
        return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t epoch = (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000 - 10000;
    calls c;
    memset(&c, 0, sizeof c);
    clock_gettime(CLOCK_MONOTONIC, &c.t0);
    sh_fault_host host = {.ud = &c, .stop_cont = on_stop_cont, .leak = on_leak};
    sh_fault_runner *r = NULL;
    CHECK_OK(sh_fault_runner_start_at(s, NULL, 0, &host, epoch, &r, &e));
    if (r) {
        CHECK_OK(sh_fault_runner_wait(r, 5000));
        size_t applied = 0, failed = 0;
        sh_fault_runner_counts(r, &applied, &failed);
        CHECK_INT_EQ(applied, 5);
        CHECK_INT_EQ(failed, 0);
        sh_fault_runner_destroy(r);
    }
    CHECK_STR_EQ(c.log, "stop a 0;leak b 2 3;cont a 0;stop b 1;");
    CHECK(c.t_last >= 0.2 && c.t_last < 2.0);
    // No callbacks: the process events fail, the runner goes on.
    sh_fault_host none = {0};
    r = NULL;
    CHECK_OK(sh_fault_runner_start_at(s, NULL, 0, &none, epoch - 2000, &r, &e));
    if (r) {
        CHECK_OK(sh_fault_runner_wait(r, 5000));
        size_t applied = 0, failed = 0;
        sh_fault_runner_counts(r, &applied, &failed);
        CHECK_INT_EQ(applied, 5);
        CHECK_INT_EQ(failed, 3); /* stop a, cont a, stop b; both leaks began long before */
        sh_fault_runner_destroy(r);
    }
    sh_scenario_destroy(s);
}

static const sh_test_case tests[] = {
    {"demo", test_demo},
    {"order", test_order},
    {"errors", test_errors},
    {"process_events", test_process_events},
    {"runner_epoch", test_runner_epoch},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
