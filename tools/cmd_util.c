/* Helpers the subcommands share. */
#include "tools/cmd_util.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "model/gguf.h"
#include "model/llama.h"

int sh__cmd_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

int sh__cmd_report(int rc, const sh_error *e)
{
    if (rc)
        sh__cmd_fail("%s", e->msg);
    return rc;
}

void sh__cmd_note(void *ud, const char *line)
{
    (void)ud;
    fprintf(stderr, "shoal: %s\n", line);
    fflush(stderr);
}

char *sh__cmd_key_bare(const char *item, size_t n)
{
    char *k = n ? strndup(item, n) : NULL;
    char *colon = k ? strrchr(k, ':') : NULL;
    if (colon && !strcmp(colon + 1, "admin")) {
        *colon = '\0';
        colon = strrchr(k, ':');
    }
    if (colon && colon[1] && strspn(colon + 1, "0123456789") == strlen(colon + 1))
        *colon = '\0';
    return k;
}

char *sh__cmd_env_key(void)
{
    const char *env = getenv("SHOAL_API_KEY");
    if (!env)
        return NULL;
    while (*env == ' ' || *env == ',')
        env++;
    size_t n = strcspn(env, ",");
    while (n && (env[n - 1] == ' ' || env[n - 1] == '\t'))
        n--;
    return sh__cmd_key_bare(env, n);
}

bool sh__cmd_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

bool sh__cmd_parse_f64(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

bool sh__cmd_is_flag(const char *flags, const char *flag)
{
    char key[64];
    if (flag[0] != '-' || (size_t)snprintf(key, sizeof key, " %s ", flag) >= sizeof key)
        return false;
    return strstr(flags, key) != NULL;
}

bool sh__cmd_parse_f32(const char *s, float lo, float hi, float *out)
{
    double v;
    if (!sh__cmd_parse_f64(s, lo, hi, &v))
        return false;
    *out = (float)v;
    return true;
}

void sh__cmd_block_signals(sigset_t *sigs, int extra)
{
    sigemptyset(sigs);
    sigaddset(sigs, SIGINT);
    sigaddset(sigs, SIGTERM);
    sigaddset(sigs, SIGHUP);
    if (extra)
        sigaddset(sigs, extra);
    pthread_sigmask(SIG_BLOCK, sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
}

sh_log_level sh__cmd_log_level(const char *s)
{
    static const struct {
        const char *name;
        sh_log_level level;
    } names[] = {{"error", SH_LOG_LEVEL_ERROR},
                 {"warn", SH_LOG_LEVEL_WARN},
                 {"debug", SH_LOG_LEVEL_DEBUG},
                 {"trace", SH_LOG_LEVEL_TRACE}};
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name))
            return names[i].level;
    return SH_LOG_LEVEL_INFO;
}

void sh__cmd_prio_apply(int32_t gap, const char *who, bool compute, sh_cmd_prio *out)
{
    bool asked = gap >= 0; /* the operator gave --control-nice */
    if (!asked)
        gap = SH_CMD_CONTROL_NICE_DEFAULT;
    errno = 0;
    int orig = getpriority(PRIO_PROCESS, 0); /* Linux: the calling thread's */
    if (errno)
        orig = 0;
    *out = (sh_cmd_prio){.control = orig, .compute = orig, .compute_add = 0};
    const char *what = compute ? "" : "; no compute threads in this process";
    if (gap <= 0) {
        fprintf(stderr,
                "shoal: %s: priorities: every thread at nice %d (--control-nice 0: the control "
                "path has no priority over compute)\n",
                who, orig);
        return;
    }
    int want = orig - gap < -20 ? -20 : orig - gap;
    errno = 0;
    if (want < orig && setpriority(PRIO_PROCESS, 0, want) == 0) {
        out->control = want;
        out->compute = orig;
        out->compute_add = orig - want;
        if (compute)
            fprintf(stderr,
                    "shoal: %s: priorities: control threads (loops, network, heartbeats) at nice "
                    "%d, compute threads at nice %d (--control-nice %d)\n",
                    who, want, orig, (int)gap);
        else
            fprintf(stderr,
                    "shoal: %s: priorities: control threads (loops, network, heartbeats) at nice "
                    "%d (--control-nice %d%s)\n",
                    who, want, (int)gap, what);
        return;
    }
    // Not allowed to raise (no root, CAP_SYS_NICE or RLIMIT_NICE). Lowering is always allowed,
    // but lowered compute threads also yield to every other program on the machine, a cost the
    // default does not impose: only an operator who asked for the gap gets it that way.
    const char *why = errno ? strerror(errno) : "already at the highest priority";
    if (!asked) {
        fprintf(stderr,
                "shoal: %s: priorities: cannot raise the control threads above nice %d (%s; "
                "needs root, CAP_SYS_NICE or RLIMIT_NICE); every thread at nice %d (pass "
                "--control-nice N to lower the compute threads by N instead%s)\n",
                who, orig, why, orig, what);
        return;
    }
    out->compute = orig + gap > 19 ? 19 : orig + gap;
    out->compute_add = out->compute - orig;
    if (compute)
        fprintf(stderr,
                "shoal: %s: priorities: cannot raise the control threads above nice %d (%s; "
                "needs root, CAP_SYS_NICE or RLIMIT_NICE), so the compute threads run lower, "
                "at nice %d (--control-nice %d)\n",
                who, orig, why, out->compute, (int)gap);
    else
        fprintf(stderr,
                "shoal: %s: priorities: cannot raise the control threads above nice %d (%s; "
                "needs root, CAP_SYS_NICE or RLIMIT_NICE); every thread at nice %d "
                "(--control-nice %d%s)\n",
                who, orig, why, orig, (int)gap, what);
}

/* A numeric GGUF value as a double; false for any other type. */
static bool gguf_number(const sh_gguf *g, const char *key, double *out)
{
    const sh_gguf_value *v = sh_gguf_find(g, key);
    if (!v)
        return false;
    switch (v->type) {
    case SH_GGUF_UINT8:
    case SH_GGUF_UINT16:
    case SH_GGUF_UINT32:
    case SH_GGUF_UINT64:
        *out = (double)v->v.u;
        return true;
    case SH_GGUF_INT8:
    case SH_GGUF_INT16:
    case SH_GGUF_INT32:
    case SH_GGUF_INT64:
        *out = (double)v->v.i;
        return true;
    case SH_GGUF_FLOAT32:
    case SH_GGUF_FLOAT64:
        *out = v->v.f;
        return true;
    default:
        fprintf(stderr, "shoal: warning: model file: %s is a %s, not a number; ignored\n", key,
                sh_gguf_type_name(v->type));
        return false;
    }
}

uint32_t sh__cmd_model_sampling(const struct sh_llama *m, float *temp, int32_t *top_k, float *top_p,
                                float *min_p, float *repeat_penalty, int32_t *repeat_last_n)
{
    static const struct {
        const char *key;
        double lo, hi;
        uint32_t bit;
    } keys[] = {
        {"general.sampling.temp", 0, 2, SH_CMD_SAMP_TEMP},
        {"general.sampling.top_k", 0, INT32_MAX, SH_CMD_SAMP_TOP_K},
        {"general.sampling.top_p", 0, 1, SH_CMD_SAMP_TOP_P},
        {"general.sampling.min_p", 0, 1, SH_CMD_SAMP_MIN_P},
        {"general.sampling.penalty_repeat", 0.01, 100, SH_CMD_SAMP_REPEAT},
        {"general.sampling.penalty_last_n", -1, 1 << 20, SH_CMD_SAMP_LAST_N},
    };
    uint32_t got = 0;
    if (!m || !m->gguf)
        return 0;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        double d;
        if (!gguf_number(m->gguf, keys[i].key, &d))
            continue;
        if (!(d >= keys[i].lo && d <= keys[i].hi)) {
            fprintf(stderr, "shoal: warning: model file: %s = %g is not in [%g, %g]; ignored\n",
                    keys[i].key, d, keys[i].lo, keys[i].hi);
            continue;
        }
        uint32_t b = keys[i].bit;
        if (b == SH_CMD_SAMP_TEMP && temp)
            *temp = (float)d;
        else if (b == SH_CMD_SAMP_TOP_K && top_k)
            *top_k = (int32_t)d;
        else if (b == SH_CMD_SAMP_TOP_P && top_p)
            *top_p = (float)d;
        else if (b == SH_CMD_SAMP_MIN_P && min_p)
            *min_p = (float)d;
        else if (b == SH_CMD_SAMP_REPEAT && repeat_penalty)
            *repeat_penalty = (float)d;
        else if (b == SH_CMD_SAMP_LAST_N && repeat_last_n)
            *repeat_last_n = (int32_t)d;
        else
            continue;
        got |= b;
    }
    return got;
}
