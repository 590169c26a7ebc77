/* Helpers the subcommands share: the one-line error and strict number parsing. */
#ifndef SH_TOOLS_CMD_UTIL_H
#define SH_TOOLS_CMD_UTIL_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/error.h"
#include "shoal/runtime.h"

/* Prints one `error: ...` line on stderr and returns 2, the exit code for bad usage or input. */
int sh__cmd_fail(const char *fmt, ...) SH_PRINTF(1, 2);

/* Prints e's line as sh__cmd_fail does when rc is not 0 (a library call that reports through an
 * sh_error, e.g. actors/cluster.h); returns rc. */
int sh__cmd_report(int rc, const sh_error *e);

/* Prints a progress line of the library as "shoal: LINE" on stderr (an sh_cluster_note_fn). */
void sh__cmd_note(void *ud, const char *line);

/* Whole-string decimal parses within [lo, hi]; false (out untouched) for anything else. */
/* A key as a client sends it: the first n bytes of item (KEY[:P][:admin], as the server reads
 * keys) without a final ":admin" and then a numeric ":P", malloc'd (NULL when n is 0 or out of
 * memory). */
char *sh__cmd_key_bare(const char *item, size_t n);

/* The first key of SHOAL_API_KEY (KEY[:P][:admin] items separated by commas, blanks around an
 * item ignored) as sh__cmd_key_bare gives it; NULL when the variable is unset or holds none.
 * For the client commands that send one key. */
char *sh__cmd_env_key(void);

bool sh__cmd_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
bool sh__cmd_parse_f64(const char *s, double lo, double hi, double *out);
bool sh__cmd_parse_f32(const char *s, float lo, float hi, float *out);

/* The runtime log level a --log-level value names ("error", "warn", "info", "debug", "trace");
 * NULL or anything else is info. */
sh_log_level sh__cmd_log_level(const char *s);

/* Blocks SIGINT, SIGTERM and SIGHUP (plus `extra` when it is not 0) in the calling thread, so that
 * every thread started afterwards inherits the mask and the caller takes them with sigwait or a
 * signalfd; fills *sigs with that set. Ignores SIGPIPE. Call before any thread starts. */
void sh__cmd_block_signals(sigset_t *sigs, int extra);

/* Whether flag is one of `flags`, a space-separated list that starts and ends with a space. */
bool sh__cmd_is_flag(const char *flags, const char *flag);

#endif
