/* Structured, levelled log lines (key=value) for one runtime, to a FILE or a callback. */
#include "runtime/log.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

void sh__log_init(sh__log *lg, sh_log_level level, sh_log_fn fn, void *ud, FILE *file,
                  const char *node)
{
    lg->level = level;
    lg->fn = fn;
    lg->ud = ud;
    lg->file = file ? file : stderr;
    snprintf(lg->node, sizeof lg->node, "%s", node ? node : "?");
}

const char *sh__log_level_name(sh_log_level level)
{
    switch (level) {
    case SH_LOG_LEVEL_ERROR:
        return "error";
    case SH_LOG_LEVEL_WARN:
        return "warn";
    case SH_LOG_LEVEL_INFO:
        return "info";
    case SH_LOG_LEVEL_DEBUG:
        return "debug";
    case SH_LOG_LEVEL_TRACE:
        return "trace";
    }
    return "?";
}

/* snprintf into the rest of buf, keeping *n <= cap - 1 (snprintf reports what it would have
 * written; a cut line must still end inside the buffer). */
static void put(char *buf, size_t cap, size_t *n, int w)
{
    if (w > 0)
        *n += (size_t)w;
    if (*n >= cap)
        *n = cap - 1;
    (void)buf;
}

size_t sh__log_format(char *buf, size_t cap, uint64_t unix_us, sh_log_level level, const char *node,
                      const char *actor, uint32_t actor_id, const char *event, const char *fmt,
                      va_list ap)
{
    if (cap == 0)
        return 0;
    size_t n = 0;
    buf[0] = 0;
    put(buf, cap, &n,
        snprintf(buf + n, cap - n, "ts=%llu.%06llu level=%s node=%s",
                 (unsigned long long)(unix_us / 1000000u), (unsigned long long)(unix_us % 1000000u),
                 sh__log_level_name(level), node ? node : "?"));
    if (actor)
        put(buf, cap, &n, snprintf(buf + n, cap - n, " actor=%s#%u", actor, (unsigned)actor_id));
    put(buf, cap, &n, snprintf(buf + n, cap - n, " event=%s", event ? event : "log"));
    if (fmt && fmt[0]) {
        put(buf, cap, &n, snprintf(buf + n, cap - n, " "));
        put(buf, cap, &n, vsnprintf(buf + n, cap - n, fmt, ap));
    }
    return n;
}

void sh__log_vemit(const sh__log *lg, sh_log_level level, const char *actor, uint32_t actor_id,
                   const char *event, const char *fmt, va_list ap)
{
    if (!lg || level > lg->level)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t us = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    char line[SH__LOG_LINE_MAX + 1];
    size_t n = sh__log_format(line, SH__LOG_LINE_MAX, us, level, lg->node, actor, actor_id, event,
                              fmt, ap);
    if (lg->fn) {
        lg->fn(lg->ud, level, line, n);
        return;
    }
    line[n] = '\n';
    fwrite(line, 1, n + 1, lg->file);
}

void sh__log_emit(const sh__log *lg, sh_log_level level, const char *actor, uint32_t actor_id,
                  const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sh__log_vemit(lg, level, actor, actor_id, event, fmt, ap);
    va_end(ap);
}
