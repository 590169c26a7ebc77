/* Log tests: the exact key=value line format, levels, the callback and FILE sinks. */
#include <pthread.h>

#include "runtime/log.h"
#include "sh_test.h"

static size_t fmt(char *buf, size_t cap, uint64_t us, sh_log_level lvl, const char *actor,
                  uint32_t id, const char *event, const char *f, ...) SH_PRINTF(8, 9);
static size_t fmt(char *buf, size_t cap, uint64_t us, sh_log_level lvl, const char *actor,
                  uint32_t id, const char *event, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    size_t n = sh__log_format(buf, cap, us, lvl, "w0", actor, id, event, f, ap);
    va_end(ap);
    return n;
}

static void test_format_exact(void)
{
    char buf[256];
    size_t n = fmt(buf, sizeof buf, 1718000000123456ull, SH_LOG_LEVEL_WARN, "batcher", 3,
                   "mailbox_overload", "depth=%d threshold=%u", 10001, 10000u);
    CHECK_STR_EQ(buf, "ts=1718000000.123456 level=warn node=w0 actor=batcher#3 "
                      "event=mailbox_overload depth=10001 threshold=10000");
    CHECK_UINT_EQ(n, strlen(buf));
    fmt(buf, sizeof buf, 5, SH_LOG_LEVEL_ERROR, NULL, 0, "runtime_stop", "a=%d", 1);
    CHECK_STR_EQ(buf, "ts=0.000005 level=error node=w0 event=runtime_stop a=1");
    fmt(buf, sizeof buf, 0, SH_LOG_LEVEL_TRACE, NULL, 0, "x", "%s", "");
    CHECK_STR_EQ(buf, "ts=0.000000 level=trace node=w0 event=x "); /* an empty tail */
    /* Cut to the buffer, still terminated. */
    n = fmt(buf, 20, 0, SH_LOG_LEVEL_INFO, NULL, 0, "x", "k=%s", "long value here");
    CHECK_UINT_EQ(n, 19);
    CHECK_STR_EQ(buf, "ts=0.000000 level=i");
    CHECK_STR_EQ(sh__log_level_name(SH_LOG_LEVEL_DEBUG), "debug");
    CHECK_STR_EQ(sh__log_level_name((sh_log_level)9), "?");
}

typedef struct cap {
    char line[512];
    int n;
    sh_log_level level;
} cap;

static void capture(void *ud, sh_log_level level, const char *line, size_t len)
{
    cap *c = ud;
    snprintf(c->line, sizeof c->line, "%.*s", (int)len, line);
    c->level = level;
    c->n++;
}

static void test_runtime_log(void)
{
    cap c = {0};
    sh_runtime_stats fin;
    sh_runtime_opts o = {.node_id = 9,
                         .name = "edge",
                         .log_level = SH_LOG_LEVEL_INFO,
                         .log_fn = capture,
                         .log_ud = &c,
                         .final_stats = &fin};
    sh_runtime *rt = NULL;
    CHECK_OK(sh_runtime_create(&o, &rt, NULL));
    int before = c.n;
    sh_runtime_log(rt, SH_LOG_LEVEL_DEBUG, "hidden", "a=%d", 1); /* above the level */
    CHECK_INT_EQ(c.n, before);
    sh_runtime_log(rt, SH_LOG_LEVEL_INFO, "hello", "who=\"%s\" n=%d", "a b", 2);
    CHECK_INT_EQ(c.n, before + 1);
    CHECK_INT_EQ(c.level, SH_LOG_LEVEL_INFO);
    const char *sp = strchr(c.line, ' ');
    CHECK(strncmp(c.line, "ts=", 3) == 0 && sp != NULL);
    CHECK_STR_EQ(sp, " level=info node=edge event=hello who=\"a b\" n=2");
    sh_runtime_destroy(rt);
    CHECK_UINT_EQ(fin.allocs_live, 0);
}

static void test_file_sink(void)
{
    FILE *f = tmpfile();
    CHECK(f != NULL);
    if (!f)
        return;
    sh__log lg;
    sh__log_init(&lg, SH_LOG_LEVEL_WARN, NULL, NULL, f, "n1");
    sh__log_emit(&lg, SH_LOG_LEVEL_WARN, "kv", 2, "e1", "k=%d", 1);
    sh__log_emit(&lg, SH_LOG_LEVEL_INFO, "kv", 2, "e2", "k=%d", 2); /* below the level */
    sh__log_emit(&lg, SH_LOG_LEVEL_ERROR, NULL, 0, "e3", NULL);     /* no tail at all */
    rewind(f);
    char line[256] = {0};
    CHECK(fgets(line, sizeof line, f) != NULL);
    const char *sp = strchr(line, ' ');
    CHECK(sp != NULL);
    if (sp)
        CHECK_STR_EQ(sp, " level=warn node=n1 actor=kv#2 event=e1 k=1\n");
    CHECK(fgets(line, sizeof line, f) != NULL);
    sp = strchr(line, ' ');
    CHECK(sp != NULL);
    if (sp)
        CHECK_STR_EQ(sp, " level=error node=n1 event=e3\n");
    CHECK(fgets(line, sizeof line, f) == NULL);
    fclose(f);
}

static const sh_test_case tests[] = {
    {"format_exact", test_format_exact},
    {"runtime_log", test_runtime_log},
    {"file_sink", test_file_sink},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
