/* Structured, levelled log lines (key=value) for one runtime; no global logger. */
#ifndef SH_RUNTIME_LOG_H
#define SH_RUNTIME_LOG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "shoal/runtime.h"

/* One runtime's logger. Immutable after sh__log_init, so any thread may log without a lock:
 * each line is formatted on the caller's stack and handed to the sink in one call (one fwrite,
 * which stdio serialises per FILE). */
typedef struct sh__log {
    sh_log_level level;
    sh_log_fn fn;
    void *ud;
    FILE *file;
    char node[64];
} sh__log;

#define SH__LOG_LINE_MAX 1024

void sh__log_init(sh__log *lg, sh_log_level level, sh_log_fn fn, void *ud, FILE *file,
                  const char *node);

/* "error", "warn", "info", "debug", "trace"; "?" otherwise. */
const char *sh__log_level_name(sh_log_level level);

/* Formats one line into buf (cap bytes, NUL-terminated, cut to fit) and returns its length:
 *   ts=<unix_us/1e6 with 6 decimals> level=<lvl> node=<node>[ actor=<actor>#<actor_id>]
 *   event=<event>[ <fmt tail>]
 * `actor` NULL leaves the actor field out. Pure: the tests check it byte for byte. */
size_t sh__log_format(char *buf, size_t cap, uint64_t unix_us, sh_log_level level, const char *node,
                      const char *actor, uint32_t actor_id, const char *event, const char *fmt,
                      va_list ap) SH_PRINTF(9, 0);

/* Formats with the current time and hands the line to the sink when level <= lg->level. */
void sh__log_vemit(const sh__log *lg, sh_log_level level, const char *actor, uint32_t actor_id,
                   const char *event, const char *fmt, va_list ap) SH_PRINTF(6, 0);
void sh__log_emit(const sh__log *lg, sh_log_level level, const char *actor, uint32_t actor_id,
                  const char *event, const char *fmt, ...) SH_PRINTF(6, 7);

#endif
