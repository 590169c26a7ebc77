/* Internal helpers for filling an sh_error and for panicking on broken invariants. */
#ifndef SH_BASE_ERROR_H
#define SH_BASE_ERROR_H

#include "shoal/err.h"

#if defined(__GNUC__)
#define SH_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define SH_NORETURN __attribute__((noreturn))
#else
#define SH_PRINTF(f, a)
#define SH_NORETURN
#endif

/* Sets e->code and a formatted message (when e is not NULL) and returns code, so a caller can
 * write `return sh__error_set(e, SH_EFORMAT, "bad magic %08x", m);`. */
sh_err sh__error_set(sh_error *e, sh_err code, const char *fmt, ...) SH_PRINTF(3, 4);

/* Prefixes e->msg with "prefix: " (e.g. a file name); no-op when e is NULL or has no error. */
void sh__error_prefix(sh_error *e, const char *prefix);

/* For broken invariants only (never for anything input, peers or memory pressure can cause):
 * prints file, line and message to stderr and aborts. */
SH_NORETURN void sh__panic_at(const char *file, int line, const char *fmt, ...) SH_PRINTF(3, 4);
#define sh_panic(...) sh__panic_at(__FILE__, __LINE__, __VA_ARGS__)

#endif
