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

/* The control path's priority over the compute threads (--control-nice; docs/cluster.md,
 * "Heartbeats under load"). The heartbeats (the watchdog's PING and the hello actor's PONG), the
 * runtime's loops and NNG's I/O threads must not wait behind the model's compute threads, or a
 * busy node misses its beats and is judged dead. Linux keeps a niceness per thread and a new
 * thread inherits its creator's, so one change on the main thread before any thread starts
 * reaches every thread of the process; the CPU backend's compute threads then lower themselves
 * by compute_add (sh_backend_cpu_opts.nice). */
#define SH_CMD_CONTROL_NICE_DEFAULT 10
#define SH_CMD_CONTROL_NICE_HELP                                                                   \
    "  --control-nice N    run the control path (loops, network, heartbeats) N nice\n"             \
    "                      steps above the compute threads, 0 to 19 (default 10; 0:\n"             \
    "                      all threads alike): raised by N where the OS allows it\n"               \
    "                      (root, CAP_SYS_NICE or RLIMIT_NICE); else, when given,\n"               \
    "                      the compute threads are lowered by N (docs/cluster.md)\n"

typedef struct sh_cmd_prio {
    int32_t control;     /* the control threads' nice value */
    int32_t compute;     /* the compute threads' nice value */
    int32_t compute_add; /* for sh_backend_cpu_opts.nice: compute minus control */
} sh_cmd_prio;

/* Sets the priorities for a gap of `gap` nice steps (0 to 19; 0: leaves every thread as it is;
 * negative: the flag was not given, the default gap): raises the calling thread's priority by gap
 * (nice minus gap, at least -20) when the OS allows it, so that the compute threads, lowered by
 * compute_add, run at the process's original nice; else, when the flag was given, keeps it and
 * lowers the compute threads by gap (at most to 19), and without the flag changes nothing. Prints
 * one line "shoal: WHO: priorities: ..." on stderr saying what it chose (compute: whether this
 * process has compute threads). Call on the main thread before any thread starts. Never fails. */
void sh__cmd_prio_apply(int32_t gap, const char *who, bool compute, sh_cmd_prio *out);

/* The sampling a model file recommends: llama.cpp's general.sampling.* keys (temp, top_k, top_p,
 * min_p, penalty_repeat, penalty_last_n), any numeric type. Each key present and in range is
 * written to its out-pointer (any may be NULL) and its SH_CMD_SAMP_* bit set in the result; a key
 * out of range is left out with a warning on stderr. m may have no GGUF (none then). */
#define SH_CMD_SAMP_TEMP 1u
#define SH_CMD_SAMP_TOP_K 2u
#define SH_CMD_SAMP_TOP_P 4u
#define SH_CMD_SAMP_MIN_P 8u
#define SH_CMD_SAMP_REPEAT 16u
#define SH_CMD_SAMP_LAST_N 32u
struct sh_llama;
uint32_t sh__cmd_model_sampling(const struct sh_llama *m, float *temp, int32_t *top_k, float *top_p,
                                float *min_p, float *repeat_penalty, int32_t *repeat_last_n);

/* Whether flag is one of `flags`, a space-separated list that starts and ends with a space. */
bool sh__cmd_is_flag(const char *flags, const char *flag);

#endif
