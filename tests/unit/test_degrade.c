/* The degradation ladder (actors/degrade.h) in a real runtime: metrics read from the registry
 * (the series the batcher, kvmgr and gateway register), level(m) with hysteresis on a simulated
 * clock, bad policies that keep the level and log once, reloads that keep the old script, the
 * effects on parsed requests, and the "degrade" actor ticking on its own. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actors/degrade.h"
#include "test_runtime_util.h"

/* ---- a log that the test can read ---------------------------------------------------------- */

typedef struct logbuf {
    pthread_mutex_t mu;
    char text[1 << 16];
    size_t len;
} logbuf;

static logbuf LOG = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void log_fn(void *ud, sh_log_level level, const char *line, size_t len)
{
    (void)ud;
    (void)level;
    pthread_mutex_lock(&LOG.mu);
    if (LOG.len + len + 2 < sizeof LOG.text) {
        memcpy(LOG.text + LOG.len, line, len);
        LOG.len += len;
        LOG.text[LOG.len++] = '\n';
        LOG.text[LOG.len] = '\0';
    }
    pthread_mutex_unlock(&LOG.mu);
}

static void log_clear(void)
{
    pthread_mutex_lock(&LOG.mu);
    LOG.len = 0;
    LOG.text[0] = '\0';
    pthread_mutex_unlock(&LOG.mu);
}

static int log_count(const char *needle)
{
    int n = 0;
    pthread_mutex_lock(&LOG.mu);
    for (const char *p = LOG.text; (p = strstr(p, needle)); p++)
        n++;
    pthread_mutex_unlock(&LOG.mu);
    return n;
}

/* ---- fixtures ------------------------------------------------------------------------------ */

typedef struct fixture {
    test_rt t;
    sh_gauge *waiting, *running, *kv_total, *kv_used, *paused[2];
    sh_histogram *ttft, *qwait;
    char path[64];
    sh_degrade *d;
    char notes[16][240];
    char kinds[16][16];
    int n_notes;
} fixture;

static void note(void *user, const char *kind, const char *msg)
{
    fixture *f = user;
    if (f->n_notes < 16) {
        snprintf(f->kinds[f->n_notes], sizeof f->kinds[0], "%s", kind);
        snprintf(f->notes[f->n_notes++], sizeof f->notes[0], "%s", msg);
    }
}

static void write_policy(const char *path, const char *src)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(src, f);
        fclose(f);
    }
}

/* A runtime whose registry holds two replicas' worth of the series the ladder reads, and the
 * ladder with `src` as its policy (NULL: the built-in default). */
static void setup(fixture *f, const char *src, uint32_t hold_ms)
{
    memset(f, 0, sizeof *f);
    log_clear();
    sh_runtime_opts o = {.log_fn = log_fn};
    rt_start(&f->t, 1, 1, &o);
    sh_metrics *mx = sh_runtime_metrics(f->t.rt);
    CHECK_OK(sh_metrics_gauge(mx, "shoal_requests_waiting", "", "replica=\"0\"", &f->waiting));
    CHECK_OK(sh_metrics_gauge(mx, "shoal_requests_running", "", "replica=\"0\"", &f->running));
    CHECK_OK(sh_metrics_gauge(mx, "shoal_kv_blocks_total", "", NULL, &f->kv_total));
    CHECK_OK(sh_metrics_gauge(mx, "shoal_kv_blocks_used", "", NULL, &f->kv_used));
    CHECK_OK(sh_metrics_gauge(mx, "shoal_batcher_paused", "", "replica=\"0\"", &f->paused[0]));
    CHECK_OK(sh_metrics_gauge(mx, "shoal_batcher_paused", "", "replica=\"1\"", &f->paused[1]));
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                                 1,     1.5,  2,     3,    5,     7.5, 10,   20,  40,  80};
    CHECK_OK(sh_metrics_histogram(mx, "shoal_time_to_first_token_seconds", "", NULL, lat,
                                  sizeof lat / sizeof lat[0], &f->ttft));
    CHECK_OK(sh_metrics_histogram(mx, "shoal_queue_wait_seconds", "", "replica=\"0\"", lat,
                                  sizeof lat / sizeof lat[0], &f->qwait));
    sh_gauge_set(f->kv_total, 100);
    const char *policy = NULL;
    if (src) {
        snprintf(f->path, sizeof f->path, "/tmp/sh_test_degrade_%d.lua", (int)getpid());
        write_policy(f->path, src);
        policy = f->path;
    }
    sh_degrade_opts d = {.policy = policy,
                         .hold_ms = hold_ms,
                         .max_tokens = 16,
                         .fallback = "light",
                         .shed_priority = 2,
                         .rt = f->t.rt,
                         .note = note,
                         .note_user = f};
    sh_error e = {0};
    sh_err err = sh__degrade_create(&d, &f->d, &e);
    if (err)
        fprintf(stderr, "create: %s\n", e.msg);
    CHECK_OK(err);
}

static void teardown(fixture *f)
{
    rt_finish(&f->t);
    sh__degrade_destroy(f->d);
    sh__degrade_destroy(NULL);
    if (f->path[0])
        unlink(f->path);
}

static int64_t gauge_of(fixture *f, const char *name)
{
    sh_gauge *g = NULL;
    sh_metrics_gauge(sh_runtime_metrics(f->t.rt), name, "", NULL, &g);
    return g ? sh_gauge_value(g) : -1;
}

static uint64_t counter_of(fixture *f, const char *name, const char *labels)
{
    sh_counter *c = NULL;
    sh_metrics_counter(sh_runtime_metrics(f->t.rt), name, "", labels, &c);
    return c ? sh_counter_value(c) : 0;
}

/* ---- cases --------------------------------------------------------------------------------- */

/* Up at once; down only after hold_ms of lower answers, to the highest of them; an answer at the
 * level in force interrupts the hold. */
static void test_hysteresis(void)
{
    fixture f;
    setup(&f, "function level(m) return math.min(4, math.floor(m.queue_depth)) end\n", 1000);
    uint64_t t = 10000;
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    sh_gauge_set(f.waiting, 3);
    sh__degrade_tick(f.d, t);
    CHECK_INT_EQ(sh__degrade_level(f.d), 3);
    CHECK_INT_EQ(gauge_of(&f, "shoal_degradation_level"), 3);
    CHECK_INT_EQ(log_count("event=degradation_level from=0 to=3 why=\"up\""), 1);
    CHECK_INT_EQ(log_count("queue_depth=3 "), 1);
    sh_gauge_set(f.waiting, 1);
    for (uint64_t dt = 100; dt <= 900; dt += 100) /* 900 ms below: not yet */
        sh__degrade_tick(f.d, t + dt);
    CHECK_INT_EQ(sh__degrade_level(f.d), 3);
    sh_gauge_set(f.waiting, 3); /* back at 3: the hold starts over */
    sh__degrade_tick(f.d, t + 1000);
    sh_gauge_set(f.waiting, 0);
    sh__degrade_tick(f.d, t + 1100);
    sh_gauge_set(f.waiting, 2);
    sh__degrade_tick(f.d, t + 1500);
    sh_gauge_set(f.waiting, 0);
    sh__degrade_tick(f.d, t + 2000);
    CHECK_INT_EQ(sh__degrade_level(f.d), 3);
    sh__degrade_tick(f.d, t + 2100); /* 1000 ms below since t + 1100; the highest answer was 2 */
    CHECK_INT_EQ(sh__degrade_level(f.d), 2);
    CHECK_INT_EQ(gauge_of(&f, "shoal_degradation_level"), 2);
    sh__degrade_tick(f.d, t + 2200);
    sh__degrade_tick(f.d, t + 3150);
    CHECK_INT_EQ(sh__degrade_level(f.d), 2);
    sh__degrade_tick(f.d, t + 3200);
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    CHECK_INT_EQ(log_count("event=degradation_level"), 3);
    sh_gauge_set(f.waiting, 9); /* clamped by the script to 4, at once */
    sh__degrade_tick(f.d, t + 3300);
    CHECK_INT_EQ(sh__degrade_level(f.d), 4);
    CHECK(f.n_notes == 4 && !strcmp(f.kinds[0], "level") && !strncmp(f.notes[0], "0 -> 3", 6));
    teardown(&f);
}

/* The registry's figures as level(m) sees them, and the built-in default policy on them. */
static void test_metrics(void)
{
    fixture f;
    setup(&f, NULL, 0);
    uint64_t t = 50000;
    sh__degrade_tick(f.d, t);
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    for (int i = 0; i < 100; i++)
        sh_histogram_observe(f.qwait, 1.2); /* queue wait p99 in (1, 1.5] s: level 2 */
    sh__degrade_tick(f.d, t + 500);
    CHECK_INT_EQ(sh__degrade_level(f.d), 2);
    sh_gauge_set(f.kv_used, 99); /* kv_used 0.99 > 0.98: level 4 */
    sh__degrade_tick(f.d, t + 1000);
    CHECK_INT_EQ(sh__degrade_level(f.d), 4);
    sh_gauge_set(f.kv_used, 10);
    // The window is 5 s: once the observations are older, p99 is 0 and the level drops (hold 0).
    sh__degrade_tick(f.d, t + 1500);
    CHECK_INT_EQ(sh__degrade_level(f.d), 2);
    for (uint64_t dt = 2000; dt <= 7000; dt += 500)
        sh__degrade_tick(f.d, t + dt);
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    teardown(&f);

    // Every name, read back through a script that checks them.
    setup(
        &f,
        "function level(m)\n"
        "  if m.queue_depth ~= 5 or m.running_seqs ~= 7 or m.requests ~= 12 then return 1 end\n"
        "  if m.kv_used ~= 0.25 then return 2 end\n"
        "  if m.replicas ~= 2 or m.healthy_replicas ~= 1 then return 3 end\n"
        "  if m.queue_wait_p99_ms < 300 or m.queue_wait_p99_ms > 500 then return 4 end\n"
        "  if m.ttft_p99_ms < 75 or m.ttft_p99_ms > 100 or m.front_rss_mb <= 0 then return 4 end\n"
        "  if m.tokens_per_s ~= 0 or m.level == nil then return 4 end\n"
        "  return 0\n"
        "end\n",
        0);
    sh_gauge_set(f.waiting, 5);
    sh_gauge_set(f.running, 7);
    sh_gauge_set(f.kv_used, 25);
    sh_gauge_set(f.paused[1], 1);
    sh__degrade_tick(f.d, 900); /* the window's start */
    for (int i = 0; i < 10; i++) {
        sh_histogram_observe(f.qwait, 0.4);
        sh_histogram_observe(f.ttft, 0.09);
    }
    sh__degrade_tick(f.d, 1000);
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    CHECK_UINT_EQ(counter_of(&f, "shoal_policy_errors_total", NULL), 0);
    sh_gauge_set(f.paused[1], 0); /* two healthy replicas: the script answers 3 */
    sh__degrade_tick(f.d, 1100);
    CHECK_INT_EQ(sh__degrade_level(f.d), 3);
    teardown(&f);
}

/* A script that fails at run time keeps the level in force and logs each distinct error once. */
static void test_bad_policies(void)
{
    static const struct {
        const char *bad, *logged;
    } cases[] = {
        {"error('policy broke')", "policy broke"},
        {"while true do end", "time"},
        {"return 'three'", "returned string"},
        {"return 7", "returned 7"},
        {"return 2.5", "non-integer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char src[512];
        // Fine for its first three calls (the trial call at load is the first), then broken.
        snprintf(src, sizeof src,
                 "calls = 0\nfunction level(m)\n  calls = calls + 1\n"
                 "  if calls <= 3 then return 3 end\n  %s\nend\n",
                 cases[i].bad);
        fixture f;
        setup(&f, src, 0);
        uint64_t t = 1000;
        sh__degrade_tick(f.d, t);
        sh__degrade_tick(f.d, t + 100);
        CHECK_INT_EQ(sh__degrade_level(f.d), 3);
        int n = i == 1 ? 3 : 20; /* each run-away call takes its 50 ms */
        for (int k = 0; k < n; k++)
            sh__degrade_tick(f.d, t + 200 + 100 * (uint64_t)k);
        CHECK_INT_EQ(sh__degrade_level(f.d), 3);
        CHECK_INT_EQ(gauge_of(&f, "shoal_degradation_level"), 3);
        CHECK_UINT_EQ(counter_of(&f, "shoal_policy_errors_total", NULL), (uint64_t)n);
        if (log_count("event=policy_error") != 1 || log_count(cases[i].logged) < 1)
            SH_FAIL_("case %zu: want one policy_error line with '%s' in:\n%s", i, cases[i].logged,
                     LOG.text);
        CHECK_INT_EQ(log_count("level=3 kept=true"), 1);
        teardown(&f);
    }
}

/* A reload replaces the script only when the new one loads and passes its trial call. */
static void test_reload(void)
{
    fixture f;
    setup(&f, "function level(m) return 1 end\n", 0);
    char msg[512];
    sh__degrade_tick(f.d, 1000);
    CHECK_INT_EQ(sh__degrade_level(f.d), 1);
    write_policy(f.path, "function level(m) return 2\n"); /* syntax error */
    CHECK(sh__degrade_reload(f.d, msg, sizeof msg) == SH_ELUA);
    CHECK(strstr(msg, "not reloaded") && strstr(msg, f.path) && strstr(msg, ":2:"));
    sh__degrade_tick(f.d, 1100);
    CHECK_INT_EQ(sh__degrade_level(f.d), 1);                    /* the old script still answers */
    write_policy(f.path, "function level(m) return 'x' end\n"); /* fails its trial call */
    CHECK(sh__degrade_reload(f.d, msg, sizeof msg) != SH_OK);
    unlink(f.path);
    CHECK(sh__degrade_reload(f.d, msg, sizeof msg) == SH_EIO);
    write_policy(f.path, "function level(m) return 2 end\n");
    CHECK_OK(sh__degrade_reload(f.d, msg, sizeof msg));
    CHECK(strstr(msg, "reloaded") != NULL);
    sh__degrade_tick(f.d, 1200);
    CHECK_INT_EQ(sh__degrade_level(f.d), 2);
    CHECK_UINT_EQ(counter_of(&f, "shoal_policy_reloads_total", "result=\"ok\""), 1);
    CHECK_UINT_EQ(counter_of(&f, "shoal_policy_reloads_total", "result=\"error\""), 3);
    CHECK_INT_EQ(log_count("event=policy_reload"), 4);
    int policy_notes = 0;
    for (int i = 0; i < f.n_notes; i++)
        policy_notes += !strcmp(f.kinds[i], "policy");
    CHECK_INT_EQ(policy_notes, 4);
    teardown(&f);
}

static sh_openai_request *parse(const char *body)
{
    sh_openai_request *q = NULL;
    sh_openai_error err;
    static const char *const models[] = {"main", "light"};
    sh_openai_limits lim = {.models = models, .n_models = 2, .max_n = 4};
    if (sh_openai_request_parse(SH_OPENAI_COMPLETION, body, strlen(body), &lim, &q, &err))
        fprintf(stderr, "parse: %s\n", err.message);
    CHECK(q != NULL);
    return q;
}

/* What each level does to a request, and only what changes it counts. */
static void test_apply(void)
{
    fixture f;
    setup(&f, "function level(m) return LEVEL or 0 end\n", 0);
    const char *lp = "{\"model\":\"main\",\"prompt\":\"hi\",\"max_tokens\":100,\"logprobs\":2}";
    const char *plain = "{\"model\":\"main\",\"prompt\":\"hi\",\"max_tokens\":8}";
    const char *ids = "{\"model\":\"main\",\"prompt\":[1,2,3],\"max_tokens\":100,\"priority\":5}";
    sh_degrade_effect ef;
    sh_openai_request *q = parse(lp);
    sh__degrade_apply(f.d, q, 0, "light", &ef);
    CHECK(ef.what == 0 && ef.header[0] == '\0' && q->logprobs && q->max_tokens == 100);
    sh_openai_request_free(q);
    sh__degrade_apply(NULL, q = parse(lp), 0, "light", &ef); /* no ladder */
    CHECK(ef.what == 0 && q->logprobs);
    sh_openai_request_free(q);
    for (int level = 1; level <= 4; level++) {
        char src[64];
        snprintf(src, sizeof src, "function level(m) return %d end\n", level);
        write_policy(f.path, src);
        char msg[256];
        CHECK_OK(sh__degrade_reload(f.d, msg, sizeof msg));
        sh__degrade_tick(f.d, 1000 + (uint64_t)level);
        CHECK_INT_EQ(sh__degrade_level(f.d), level);
        q = parse(lp); /* priority 0 (key 1): below shed_priority 2, never shed */
        sh__degrade_apply(f.d, q, 1, "light", &ef);
        CHECK_INT_EQ(ef.level, level);
        CHECK(!q->logprobs && q->top_logprobs == 0);
        CHECK_INT_EQ(q->max_tokens, level >= 2 ? 16 : 100);
        CHECK_STR_EQ(q->model, level >= 3 ? "light" : "main");
        CHECK_STR_EQ(ef.header, level == 1   ? "logprobs"
                                : level == 2 ? "logprobs, max_tokens=16"
                                             : "logprobs, max_tokens=16, model=light");
        sh_openai_request_free(q);
        q = parse(plain); /* nothing to drop or cap */
        sh__degrade_apply(f.d, q, 0, "light", &ef);
        CHECK(!(ef.what & (SH_DEGRADE_LOGPROBS | SH_DEGRADE_MAX_TOKENS)));
        CHECK_INT_EQ(q->max_tokens, 8);
        sh_openai_request_free(q);
        q = parse(ids); /* priority 5: shed at 4; token ids never go to the fallback */
        sh__degrade_apply(f.d, q, 0, "light", &ef);
        CHECK_INT_EQ(ef.priority, 5);
        if (level == 4) {
            CHECK(ef.what == SH_DEGRADE_SHED && ef.retry_after_s >= 1);
            CHECK_STR_EQ(ef.header, "shed");
        } else {
            CHECK(!(ef.what & (SH_DEGRADE_FALLBACK | SH_DEGRADE_SHED)));
            CHECK_STR_EQ(q->model, "main");
        }
        sh_openai_request_free(q);
    }
    q = parse(lp); /* a key of priority 2 sheds even a request that does not ask for one */
    sh__degrade_apply(f.d, q, 2, "light", &ef);
    CHECK(ef.what == SH_DEGRADE_SHED && q->logprobs);
    sh_openai_request_free(q);
    q = parse(lp); /* without a fallback served, level 3 changes no model */
    sh__degrade_apply(f.d, q, 0, NULL, &ef);
    CHECK_STR_EQ(q->model, "main");
    sh_openai_request_free(q);
    CHECK_UINT_EQ(counter_of(&f, "shoal_degraded_requests_total", "effect=\"logprobs\""), 5);
    CHECK_UINT_EQ(counter_of(&f, "shoal_degraded_requests_total", "effect=\"max_tokens\""), 6);
    CHECK_UINT_EQ(counter_of(&f, "shoal_degraded_requests_total", "effect=\"fallback\""), 4);
    CHECK_UINT_EQ(counter_of(&f, "shoal_degraded_requests_total", "effect=\"shed\""), 2);
    teardown(&f);
}

/* The "degrade" actor ticks on its own: the level follows the registry within a few ticks. */
static void test_actor(void)
{
    fixture f;
    setup(&f, "function level(m) if m.queue_depth > 0 then return 1 end return 0 end\n", 0);
    sh_error e = {0};
    sh_addr a;
    CHECK_OK(sh_runtime_register(f.t.rt, &sh__degrade_vtable, &e));
    CHECK_OK(sh_actor_spawn(f.t.rt, "degrade", f.d, 0, &a, &e));
    sh_gauge_set(f.waiting, 2);
    for (int i = 0; i < 200 && sh__degrade_level(f.d) != 1; i++)
        sleep_ms(10);
    CHECK_INT_EQ(sh__degrade_level(f.d), 1);
    sh_gauge_set(f.waiting, 0);
    for (int i = 0; i < 200 && sh__degrade_level(f.d) != 0; i++)
        sleep_ms(10);
    CHECK_INT_EQ(sh__degrade_level(f.d), 0);
    teardown(&f);
}

static void test_create_errors(void)
{
    test_rt t;
    rt_start(&t, 1, 1, NULL);
    sh_degrade *d = (sh_degrade *)1;
    sh_error e = {0};
    sh_degrade_opts o = {.policy = "/nonexistent/policy.lua", .rt = t.rt};
    CHECK_INT_EQ(sh__degrade_create(&o, &d, &e), SH_EIO);
    CHECK(d == NULL && strstr(e.msg, "/nonexistent/policy.lua"));
    o = (sh_degrade_opts){.shed_priority = 300, .rt = t.rt};
    CHECK_INT_EQ(sh__degrade_create(&o, &d, &e), SH_EINVAL);
    o = (sh_degrade_opts){.policy = "default"};
    CHECK_INT_EQ(sh__degrade_create(&o, &d, &e), SH_EINVAL);
    rt_finish(&t);
    // The first load's trial call passes every name a tick does, so a script may compare them.
    fixture f;
    setup(&f,
          "function level(m)\n"
          "  if m.requests >= 1 or m.healthy_replicas < 0 or m.ttft_p99_ms > 1 then return 1 end\n"
          "  if m.front_rss_mb < 0 or m.tokens_per_s < 0 or m.running_seqs < 0 then return 1 end\n"
          "  return 0\n"
          "end\n",
          0);
    CHECK(f.d != NULL);
    teardown(&f);
}

static const sh_test_case tests[] = {
    {"hysteresis", test_hysteresis},
    {"metrics", test_metrics},
    {"bad_policies", test_bad_policies},
    {"reload", test_reload},
    {"apply", test_apply},
    {"actor", test_actor},
    {"create_errors", test_create_errors},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
