/* `shoal chaos SCENARIO.lua -c CLUSTER.lua`: starts a local cluster (`shoal cluster up`) or
 * attaches to one, computes the undisturbed greedy outputs, runs a bounded load while the
 * scenario's events happen, and reports lost and wrong requests, detection and recovery times
 * and latency by phase (docs/chaos.md). With --engine the front is an embedding engine in this
 * process (tools/cmd_chaos_engine.c) and only the workers are child processes. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "tools/bench.h"
#include "tools/cmd.h"
#include "tools/cmd_chaos.h"
#include "tools/cmd_util.h"

#define STOP_WAIT_S 60.0

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: shoal chaos SCENARIO.lua -c CLUSTER.lua [--requests N] [--concurrency C]\n"
        "                   [--max-tokens T] [--prompts P] [--prompt-words W] [--json]\n"
        "                   [--seed S] [--duration S]\n"
        "                   [--timeout S] [-t THREADS] [--bin PATH] [--log FILE] [--keep]\n"
        "                   [--attach URL [--pid-dir DIR] [--epoch-file FILE]] [--api-key KEY]\n"
        "                   [--engine]\n\n"
        "Starts the cluster of CLUSTER.lua on this machine (`shoal cluster up`, every node a\n"
        "child process), sends each of P prompts once to record the undisturbed greedy output,\n"
        "then runs a bounded load (alternately streaming and not, temperature 0) while the\n"
        "scenario's events happen at their times (seconds from the start of the load):\n"
        "kill (SIGKILL), stop/cont (SIGSTOP/SIGCONT) and stall of a node are sent to its\n"
        "process by this command; delay, drop, duplicate, corrupt, partition, heal and leak are\n"
        "applied by the worker nodes themselves (`shoal node --fault-scenario --fault-epoch`).\n"
        "Then it stops the cluster and prints a report: requests accepted, completed, ended\n"
        "with a clear error, lost (no complete answer) and wrong (different from the reference),\n"
        "detection and recovery time per event, latency percentiles before, during and after\n"
        "the faults. See docs/chaos.md.\n\n"
        "  -c CLUSTER.lua     the cluster script (node names of the scenario are checked in it)\n"
        "  --requests N       at least N requests (default 200)\n"
        "  --concurrency C    requests at once (default 8)\n"
        "  --max-tokens T     tokens per request, generated whatever the model says (default 16)\n"
        "  --prompts P        distinct prompts, reused in turn (default 32)\n"
        "  --prompt-words W   words per prompt (default 8 to 16, by prompt)\n"
        "  --duration S       go on starting requests until S seconds after the start of the\n"
        "                     load (default: 2 s after the scenario's last event has ended)\n"
        "  --timeout S        a request with no complete answer after S seconds is lost\n"
        "                     (default 60)\n"
        "  --seed S           the prompts' seed (default 1)\n"
        "  --json             print the report as one JSON object\n"
        "  -t THREADS         compute threads per worker node (default 1)\n"
        "  --bin PATH         the shoal binary for the cluster (default: this one)\n"
        "  --log FILE         the cluster's output (default: a file in a temporary directory,\n"
        "                     named in the report)\n"
        "  --keep             keep the temporary directory\n"
        "  --attach URL       use a running cluster instead: process events need --pid-dir DIR\n"
        "                     (its `cluster up --pid-dir`), link and leak events need its nodes\n"
        "                     started with --fault-scenario SCENARIO --fault-epoch @FILE and\n"
        "                     --epoch-file FILE here; times then come from GET /admin/status only\n"
        "  --api-key KEY      bearer key (default: the script's first api key, if any)\n"
        "  --engine           the front is not `shoal serve -c` but an embedding engine in\n"
        "                     this process (sh_engine_open on CLUSTER.lua, include/shoal.h):\n"
        "                     only the workers run as children (`cluster up --no-front`), the\n"
        "                     load goes through sh_submit (every request streams through\n"
        "                     on_token), link events on the front's links are applied to the\n"
        "                     engine's fault layer, and times come from the engine's log\n"
        "                     lines; events that kill, stop, stall or leak the front are\n"
        "                     refused\n\n"
        "Exit status: 0 when no request was lost and none differed from the reference, 1 when\n"
        "one did or the run failed, 2 for bad usage or a bad script (nothing is started).\n");
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A signal this command sends to a node's process at a time. */
typedef struct action {
    double t;
    int sig; /* SIGKILL, SIGSTOP, SIGCONT */
    char node[SH_FAULT_NAME_MAX];
    int line;
    bool done;
} action;

typedef struct chaos {
    sh__chaos_opts o;
    sh_cluster_config *c;
    sh_scenario *sc;
    char dir[64];   /* the temporary directory */
    char pids[128]; /* pid directory */
    char epoch[128];
    char log[4096];
    char url[300];
    pid_t up; /* `cluster up`; 0 when attached */
    int logfd;
    off_t log_off;
    char line[4096];
    size_t line_len;
    action *acts;
    size_t n_acts;
    sh__chaos_marks marks;
    double load_t0;        /* mono_s() at the epoch */
    sh__chaos_front front; /* --engine */
} chaos;

static int parse_opts(int argc, char **argv, sh__chaos_opts *o)
{
    *o = (sh__chaos_opts){.requests = 200,
                          .concurrency = 8,
                          .max_tokens = 16,
                          .prompts = 32,
                          .seed = 1,
                          .duration_s = -1,
                          .timeout_s = 60,
                          .up_timeout_s = 120,
                          .threads = "1",
                          .bin = "/proc/self/exe"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--json")) {
            o->json = true;
            continue;
        }
        if (!strcmp(a, "--keep")) {
            o->keep = true;
            continue;
        }
        if (!strcmp(a, "--engine")) {
            o->engine = true;
            continue;
        }
        if (a[0] != '-') {
            if (o->scenario)
                return sh__cmd_fail("unexpected argument '%s' (see shoal chaos --help)", a);
            o->scenario = a;
            continue;
        }
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value (see shoal chaos --help)", a);
        const char *v = argv[++i];
        int64_t n;
        double d;
        if (!strcmp(a, "-c"))
            o->cluster = v;
        else if (!strcmp(a, "--attach"))
            o->attach = v;
        else if (!strcmp(a, "--pid-dir"))
            o->pid_dir = v;
        else if (!strcmp(a, "--epoch-file"))
            o->epoch_file = v;
        else if (!strcmp(a, "--bin"))
            o->bin = v;
        else if (!strcmp(a, "--log"))
            o->log_path = v;
        else if (!strcmp(a, "--api-key"))
            o->api_key = v;
        else if (!strcmp(a, "-t")) {
            if (!sh__cmd_parse_i64(v, 1, 1024, &n))
                return sh__cmd_fail("bad value '%s' for -t: want a whole number from 1 to 1024", v);
            o->threads = v;
        } else if (!strcmp(a, "--requests") || !strcmp(a, "--concurrency") ||
                   !strcmp(a, "--max-tokens") || !strcmp(a, "--prompts") ||
                   !strcmp(a, "--prompt-words") || !strcmp(a, "--seed")) {
            int64_t hi = !strcmp(a, "--requests") ? 10000000
                         : !strcmp(a, "--seed")   ? INT64_MAX
                                                  : 4096;
            if (!sh__cmd_parse_i64(v, !strcmp(a, "--seed") ? 0 : 1, hi, &n))
                return sh__cmd_fail("bad value '%s' for %s: want a whole number from %d to %lld", v,
                                    a, strcmp(a, "--seed") ? 1 : 0, (long long)hi);
            if (!strcmp(a, "--requests"))
                o->requests = n;
            else if (!strcmp(a, "--concurrency"))
                o->concurrency = (int32_t)n;
            else if (!strcmp(a, "--max-tokens"))
                o->max_tokens = (int32_t)n;
            else if (!strcmp(a, "--prompts"))
                o->prompts = (int32_t)n;
            else if (!strcmp(a, "--prompt-words"))
                o->prompt_words = (int32_t)n;
            else
                o->seed = (uint64_t)n;
        } else if (!strcmp(a, "--duration") || !strcmp(a, "--timeout")) {
            char *end;
            errno = 0;
            d = strtod(v, &end);
            if (errno || end == v || *end || !(d > 0 && d <= 86400))
                return sh__cmd_fail("bad value '%s' for %s: want seconds, > 0 and <= 86400", v, a);
            if (!strcmp(a, "--duration"))
                o->duration_s = d;
            else
                o->timeout_s = d;
        } else {
            return sh__cmd_fail("unknown option '%s' (see shoal chaos --help)", a);
        }
    }
    if (!o->scenario || !o->cluster)
        return sh__cmd_fail("shoal chaos needs SCENARIO.lua and -c CLUSTER.lua (see shoal chaos "
                            "--help)");
    if (o->engine && o->attach)
        return sh__cmd_fail("--engine starts its own front: it does not go with --attach");
    if (o->engine && o->api_key)
        return sh__cmd_fail("--engine sends no HTTP request: --api-key has nothing to do");
    return 0;
}

static bool is_link_or_leak(const sh_fault_event *ev)
{
    return (ev->kind >= SH_FAULT_DELAY && ev->kind <= SH_FAULT_HEAL) || ev->kind == SH_FAULT_LEAK;
}

static void push(chaos *ch, double t, int sig, const char *node, int line)
{
    action *a = &ch->acts[ch->n_acts++];
    *a = (action){.t = t, .sig = sig, .line = line};
    snprintf(a->node, sizeof a->node, "%s", node);
}

/* Loads and checks everything before anything starts. Returns 0 or 2 with an error line. */
static int prepare(chaos *ch)
{
    sh__chaos_opts *o = &ch->o;
    sh_error e = {0};
    if (sh_config_load_file(o->cluster, NULL, &ch->c, &e))
        return sh__cmd_fail("%s", e.msg);
    if (!o->attach && sh__cmd_report(sh__cluster_check(ch->c, o->cluster, &e), &e))
        return 2; /* what `cluster up` would refuse, before anything starts */
    if (sh_scenario_load_file(o->scenario, NULL, &ch->sc, &e) ||
        sh_scenario_check(ch->sc, ch->c, &e))
        return sh__cmd_fail("%s", e.msg);
    ch->acts = calloc(2 * ch->sc->n_events + 1, sizeof *ch->acts);
    if (!ch->acts)
        return sh__cmd_fail("out of memory");
    bool links = false, procs = false;
    for (size_t i = 0; i < ch->sc->n_events; i++) {
        const sh_fault_event *ev = &ch->sc->events[i];
        int line = (int)ev->line;
        links |= is_link_or_leak(ev);
        switch (ev->kind) {
        case SH_FAULT_KILL:
            push(ch, ev->time_s, SIGKILL, ev->from, line);
            break;
        case SH_FAULT_STOP:
            push(ch, ev->time_s, SIGSTOP, ev->from, line);
            if (ev->lasting_s > 0)
                push(ch, ev->time_s + ev->lasting_s, SIGCONT, ev->from, line);
            break;
        case SH_FAULT_CONT:
            push(ch, ev->time_s, SIGCONT, ev->from, line);
            break;
        case SH_FAULT_STALL:
            if (strchr(ev->from, '/'))
                return sh__cmd_fail("%s:%d: stall: shoal chaos stalls whole nodes (SIGSTOP for "
                                    "ms), not one actor: write stall { actor = \"%.*s\", ms = %g }",
                                    ch->sc->source, line, (int)strcspn(ev->from, "/"), ev->from,
                                    ev->ms);
            push(ch, ev->time_s, SIGSTOP, ev->from, line);
            push(ch, ev->time_s + ev->ms / 1000.0, SIGCONT, ev->from, line);
            break;
        default:
            break;
        }
        bool proc = ev->kind == SH_FAULT_KILL || ev->kind == SH_FAULT_STOP ||
                    ev->kind == SH_FAULT_CONT || ev->kind == SH_FAULT_STALL;
        procs |= proc;
        if (o->engine && (proc || ev->kind == SH_FAULT_LEAK) &&
            sh_config_find_node(ch->c, ev->from) == ch->c->gateway.node)
            return sh__cmd_fail("%s:%d: %s \"%s\": with --engine the front '%s' is this process "
                                "(an embedding engine), which shoal chaos does not %s",
                                ch->sc->source, line, sh_scenario_kind_name(ev->kind), ev->from,
                                ev->from, ev->kind == SH_FAULT_LEAK ? "make leak" : "signal");
    }
    // Actions in time order (stable: script order among equal times).
    for (size_t i = 1; i < ch->n_acts; i++)
        for (size_t j = i; j > 0 && ch->acts[j - 1].t > ch->acts[j].t; j--) {
            action t = ch->acts[j];
            ch->acts[j] = ch->acts[j - 1];
            ch->acts[j - 1] = t;
        }
    if (o->attach) {
        if (procs && !o->pid_dir)
            return sh__cmd_fail("%s: kill, stop, cont and stall need --pid-dir with --attach",
                                o->scenario);
        if (links && !o->epoch_file)
            return sh__cmd_fail("%s: link and leak events need --epoch-file with --attach (the "
                                "nodes' --fault-epoch @FILE)",
                                o->scenario);
    } else if (o->pid_dir || o->epoch_file) {
        return sh__cmd_fail("--pid-dir and --epoch-file go with --attach");
    }
    if (!o->api_key && ch->c->gateway.n_api_keys > 0) {
        const char *k0 = ch->c->gateway.api_keys[0]; /* KEY[:P][:admin], as shoal serve reads it */
        if (!(o->script_key = sh__cmd_key_bare(k0, strlen(k0))))
            return sh__cmd_fail("out of memory");
        o->api_key = o->script_key;
    }
    if (o->duration_s < 0) {
        double end = 0;
        for (size_t i = 0; i < ch->sc->n_events; i++) {
            const sh_fault_event *ev = &ch->sc->events[i];
            double t = ev->time_s + (ev->kind == SH_FAULT_STALL ? ev->ms / 1000.0 : ev->lasting_s);
            end = t > end ? t : end;
        }
        o->duration_s = end + 2.0;
    }
    return 0;
}

/* Reads what the cluster wrote since the last call, one line at a time. */
static void poll_log(chaos *ch, double t)
{
    if (ch->logfd < 0)
        return;
    char buf[8192];
    for (;;) {
        ssize_t r = pread(ch->logfd, buf, sizeof buf, ch->log_off);
        if (r <= 0)
            return;
        ch->log_off += r;
        for (ssize_t i = 0; i < r; i++) {
            if (buf[i] == '\n' || ch->line_len == sizeof ch->line - 1) {
                ch->line[ch->line_len] = '\0';
                sh__chaos_marks_from_line(&ch->marks, ch->line, t);
                ch->line_len = 0;
                if (buf[i] == '\n')
                    continue;
            }
            ch->line[ch->line_len++] = buf[i];
        }
    }
}

static pid_t node_pid(const chaos *ch, const char *node)
{
    char path[600], buf[32] = "";
    snprintf(path, sizeof path, "%s/%s.pid", ch->o.pid_dir ? ch->o.pid_dir : ch->pids, node);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    long v = strtol(buf, NULL, 10);
    return v > 1 ? (pid_t)v : 0;
}

static void tick(void *ud, double t)
{
    chaos *ch = ud;
    for (size_t i = 0; i < ch->n_acts; i++) {
        action *a = &ch->acts[i];
        if (a->done || a->t > t)
            continue;
        a->done = true;
        pid_t pid = node_pid(ch, a->node);
        const char *what = a->sig == SIGKILL ? "kill" : a->sig == SIGSTOP ? "stop" : "cont";
        if (!pid || kill(pid, a->sig) != 0)
            fprintf(stderr, "chaos: %.3f s: %s %s (line %d): the node is not running\n", t, what,
                    a->node, a->line);
        else
            fprintf(stderr, "chaos: %.3f s: %s %s (pid %d, line %d)\n", t, what, a->node, (int)pid,
                    a->line);
    }
    poll_log(ch, t);
}

static void cont_all(const chaos *ch)
{
    for (int32_t i = 0; i < ch->c->n_nodes; i++) {
        pid_t pid = node_pid(ch, ch->c->nodes[i].name);
        if (pid)
            kill(pid, SIGCONT);
    }
}

/* Starts `cluster up` with its output in the log; waits for its "up" line. Returns 0 or 1. */
static int start_cluster(chaos *ch)
{
    const sh__chaos_opts *o = &ch->o;
    char epoch_arg[200];
    snprintf(epoch_arg, sizeof epoch_arg, "@%s", ch->epoch);
    bool links = false;
    for (size_t i = 0; i < ch->sc->n_events; i++)
        links |= is_link_or_leak(&ch->sc->events[i]);
    char *args[20];
    int n = 0;
    args[n++] = "shoal";
    args[n++] = "cluster";
    args[n++] = "up";
    args[n++] = (char *)o->cluster;
    args[n++] = "-t";
    args[n++] = (char *)o->threads;
    args[n++] = "--pid-dir";
    args[n++] = ch->pids;
    if (o->engine)
        args[n++] = "--no-front"; /* the front is this process's engine */
    if (links) {
        args[n++] = "--fault-scenario";
        args[n++] = (char *)o->scenario;
        args[n++] = "--fault-epoch";
        args[n++] = epoch_arg;
    }
    if (!o->engine) {
        args[n++] = "--";
        args[n++] = "--port";
        args[n++] = "0";
    }
    args[n] = NULL;
    // Appending: with --engine this process writes the engine's lines into the same file.
    int fd = open(ch->log, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return (sh__cmd_fail("--log %s: %s", ch->log, strerror(errno)), 1);
    ch->logfd = open(ch->log, O_RDONLY | O_CLOEXEC);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(fd);
        return (sh__cmd_fail("fork: %s", strerror(errno)), 1);
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* it stops its nodes when this command dies */
        if (getppid() != parent)
            _exit(127);
        setpgid(0, 0);
        int in = open("/dev/null", O_RDONLY);
        if (in >= 0)
            dup2(in, STDIN_FILENO);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        execv(o->bin, args);
        static const char msg[] = "error: cannot run the shoal binary (exec failed)\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        _exit(127);
    }
    close(fd);
    ch->up = pid;
    fprintf(stderr, "chaos: started `shoal cluster up %s` (pid %d), its output in %s\n", o->cluster,
            (int)pid, ch->log);
    double deadline = mono_s() + o->up_timeout_s;
    off_t off = 0;
    char buf[65536];
    size_t have = 0;
    for (;;) {
        ssize_t r = pread(ch->logfd, buf + have, sizeof buf - 1 - have, off);
        if (r > 0) {
            off += r;
            have += (size_t)r;
            buf[have] = '\0';
            const char *up = strstr(buf, "cluster: up: ");
            if (up && o->engine && strchr(up, '\n'))
                return 0; /* every worker serves; the front is opened next */
            const char *at = up ? strstr(up, "listening on http://") : NULL;
            if (at && strchr(at, '\n')) {
                at += 13;
                size_t len = strcspn(at, " \n");
                snprintf(ch->url, sizeof ch->url, "%.*s", (int)len, at);
                return 0;
            }
            if (have > sizeof buf / 2) { /* keep the tail: the line may straddle */
                memmove(buf, buf + have - 4096, 4096);
                have = 4096;
            }
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            ch->up = 0;
            return (sh__cmd_fail("shoal cluster up exited (status %d) before the cluster was up; "
                                 "its output: %s",
                                 WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), ch->log),
                    1);
        }
        if (mono_s() > deadline)
            return (sh__cmd_fail("the cluster was not up within %.0f s; its output: %s",
                                 o->up_timeout_s, ch->log),
                    1);
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
    }
}

/* SIGTERM to `cluster up` (it stops the front, then the workers); SIGKILL after a while. */
/* The sum over every series of a Prometheus counter `name` in a /metrics body (labels or none),
 * or -1 when the body has none. */
static double metric_sum(const char *body, const char *name)
{
    const size_t n = strlen(name);
    double sum = -1.0;
    for (const char *l = body; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, name, n) != 0 || (l[n] != ' ' && l[n] != '{'))
            continue;
        const char *v = l + n;
        if (*v == '{' && !(v = strchr(v, '}')))
            continue;
        char *end = NULL;
        double x = strtod(v + 1, &end);
        if (end != v + 1 && isfinite(x))
            sum = (sum < 0.0 ? 0.0 : sum) + x;
    }
    return sum;
}

static int stop_cluster(chaos *ch)
{
    if (ch->o.pid_dir)
        cont_all(ch); /* attached: nothing stays stopped */
    if (!ch->up)
        return -1;
    cont_all(ch);
    kill(ch->up, SIGTERM);
    double deadline = mono_s() + STOP_WAIT_S;
    int st = 0;
    while (waitpid(ch->up, &st, WNOHANG) != ch->up) {
        if (mono_s() > deadline) {
            fprintf(stderr, "chaos: the cluster did not stop within %.0f s; killing it\n",
                    STOP_WAIT_S);
            kill(ch->up, SIGKILL);
            waitpid(ch->up, &st, 0);
            break;
        }
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    ch->up = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char *make_prompt(const sh__chaos_opts *o, int32_t i, uint64_t *seed)
{
    char *words = sh__bench_prompt_words(o->prompt_words > 5 ? o->prompt_words - 4
                                         : o->prompt_words   ? 1
                                                             : 4 + i % 9,
                                         seed);
    if (!words)
        return NULL;
    size_t n = strlen(words) + 64;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "Once upon a time %s", words);
    free(words);
    return p;
}

static int run(chaos *ch)
{
    sh__chaos_opts *o = &ch->o;
    int rc = prepare(ch);
    if (rc)
        return rc;
    if (!o->attach) {
        snprintf(ch->dir, sizeof ch->dir, "/tmp/shoal-chaos-XXXXXX");
        if (!mkdtemp(ch->dir))
            return (sh__cmd_fail("mkdtemp: %s", strerror(errno)), 1);
        snprintf(ch->pids, sizeof ch->pids, "%s/pids", ch->dir);
        snprintf(ch->epoch, sizeof ch->epoch, "%s/epoch", ch->dir);
        snprintf(ch->log, sizeof ch->log, "%s", o->log_path ? o->log_path : "");
        if (!o->log_path)
            snprintf(ch->log, sizeof ch->log, "%s/cluster.log", ch->dir);
        if (mkdir(ch->pids, 0700) != 0)
            return (sh__cmd_fail("mkdir %s: %s", ch->pids, strerror(errno)), 1);
        if ((rc = start_cluster(ch)) != 0)
            return rc;
        if (o->engine) {
            if ((rc = sh__chaos_front_open(&ch->front, o, ch->log)) != 0) {
                stop_cluster(ch);
                return rc;
            }
            snprintf(ch->url, sizeof ch->url, "the engine on %s", o->cluster);
        }
    } else {
        snprintf(ch->url, sizeof ch->url, "%s", o->attach);
        if (o->epoch_file)
            snprintf(ch->epoch, sizeof ch->epoch, "%s", o->epoch_file);
    }
    // The load's prompts and their undisturbed outputs.
    const char *model = ch->c->models[ch->c->replicas[0].model].name;
    sh__chaos_load l = {
        .o = o, .url = ch->url, .model = model, .tick = tick, .ud = ch, .eng = ch->front.eng};
    l.prompts = calloc((size_t)o->prompts, sizeof *l.prompts);
    l.reference = calloc((size_t)o->prompts, sizeof *l.reference);
    uint64_t seed = o->seed;
    for (int32_t i = 0; l.prompts && i < o->prompts; i++)
        if (!(l.prompts[i] = make_prompt(o, i, &seed)))
            break;
    if (!l.prompts || !l.reference || !l.prompts[o->prompts - 1]) {
        rc = (sh__cmd_fail("out of memory"), 1);
        goto out;
    }
    fprintf(stderr, "chaos: cluster at %s; reference run of %d prompts\n", ch->url,
            (int)o->prompts);
    double t_ref = mono_s();
    l.tick = NULL;
    if ((rc = sh__chaos_load_reference(&l)) != 0)
        goto out;
    l.tick = tick;
    fprintf(stderr, "chaos: reference done in %.2f s; load of %lld requests for at least %.1f s\n",
            mono_s() - t_ref, (long long)o->requests, o->duration_s);
    // The epoch: the nodes' link and leak events count from this instant.
    uint64_t epoch = wall_ms();
    poll_log(ch, -1); /* lines from before the load carry negative times */
    if (ch->epoch[0]) {
        char tmp[200];
        snprintf(tmp, sizeof tmp, "%s.tmp", ch->epoch);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%llu\n", (unsigned long long)epoch) < 0 || fclose(f) != 0 ||
            rename(tmp, ch->epoch) != 0) {
            rc =
                (sh__cmd_fail("cannot write the epoch file %s: %s", ch->epoch, strerror(errno)), 1);
            goto out;
        }
    }
    if (o->engine && (rc = sh__chaos_front_faults(&ch->front, ch->sc, ch->c, epoch)) != 0)
        goto out;
    ch->load_t0 = mono_s();
    l.load_end_s = o->duration_s;
    if ((rc = sh__chaos_load_run(&l)) != 0)
        goto out;
    double t_end = mono_s() - ch->load_t0;
    tick(ch, t_end);
    // Precise times from the front's event ring when it serves them; the log's otherwise.
    const char *source = ch->up ? "log" : "none";
    int status = 0;
    char *body =
        o->engine ? NULL : sh__chaos_http_get(ch->url, "/admin/status", o->api_key, &status);
    if (body && status == 200 && sh__chaos_marks_from_status(&ch->marks, body, strlen(body), epoch))
        source = "admin/status";
    free(body);
    /* Speculative decoding's counters, when the replica drafts (cluster scripts' batcher.spec):
     * a scenario run during speculation shows that drafts were verified and accepted. */
    double spec_drafts = -1.0, spec_accepted = -1.0;
    body = o->engine ? NULL : sh__chaos_http_get(ch->url, "/metrics", o->api_key, &status);
    if (body && status == 200) {
        spec_drafts = metric_sum(body, "shoal_spec_drafts_total");
        spec_accepted = metric_sum(body, "shoal_spec_accepted_tokens_total");
    }
    free(body);
    sh__chaos_event_result *ers = calloc(ch->sc->n_events + 1, sizeof *ers);
    if (!ers) {
        rc = (sh__cmd_fail("out of memory"), 1);
        goto out;
    }
    sh__chaos_report rep = {.o = o,
                            .sc = ch->sc,
                            .reqs = l.reqs,
                            .n_reqs = l.n_reqs,
                            .events = ers,
                            .marks = &ch->marks,
                            .marks_source = source,
                            .log_path = ch->up ? ch->log : NULL};
    sh__chaos_report_compute(&rep);
    bool pass = rep.counts[SH__CHAOS_LOST] == 0 && rep.counts[SH__CHAOS_WRONG] == 0;
    if (pass && !o->keep && !o->log_path)
        rep.log_path = NULL; /* removed below */
    // The engine first (it is the front: its close ends what it still holds), then the workers.
    int close_rc = sh__chaos_front_close(&ch->front);
    if (close_rc)
        fprintf(stderr, "chaos: sh_engine_close: %s\n", sh_strerror((sh_err)close_rc));
    int up_rc = stop_cluster(ch);
    if (up_rc > 0)
        fprintf(stderr, "chaos: shoal cluster up exited with status %d (see %s)\n", up_rc, ch->log);
    if (o->json) {
        json_t *j = sh__chaos_report_json(&rep);
        if (j) {
            json_object_set_new(j, "cluster_exit", json_integer(up_rc));
            json_object_set_new(j, "front", json_string(o->engine ? "engine" : "shoal serve"));
            if (o->engine)
                json_object_set_new(j, "engine_close", json_integer(close_rc));
            if (spec_drafts >= 0.0)
                json_object_set_new(j, "spec",
                                    json_pack("{s:f, s:f}", "drafts", spec_drafts, "accepted",
                                              spec_accepted < 0.0 ? 0.0 : spec_accepted));
            json_dumpf(j, stdout, JSON_COMPACT);
        }
        printf("\n");
        json_decref(j);
    } else {
        sh__chaos_report_text(stdout, &rep);
        if (spec_drafts >= 0.0)
            printf("speculation: %.0f drafting steps, %.0f drafted tokens accepted\n", spec_drafts,
                   spec_accepted < 0.0 ? 0.0 : spec_accepted);
    }
    fflush(stdout);
    rc = pass ? 0 : 1;
    free(ers);
out:
    sh__chaos_front_close(&ch->front);
    sh__chaos_engine_reqs_free(&l);
    stop_cluster(ch);
    for (int32_t i = 0; l.prompts && i < o->prompts; i++)
        free(l.prompts[i]);
    for (int32_t i = 0; l.reference && i < o->prompts; i++)
        free(l.reference[i]);
    free(l.prompts);
    free(l.reference);
    free(l.reqs);
    return rc;
}

/* Removes the temporary directory's known files (never a recursive delete). */
static void cleanup(chaos *ch)
{
    if (!ch->dir[0] || ch->o.keep)
        return;
    char p[600];
    for (int32_t i = 0; ch->c && i < ch->c->n_nodes; i++) {
        snprintf(p, sizeof p, "%s/%s.pid", ch->pids, ch->c->nodes[i].name);
        unlink(p);
    }
    rmdir(ch->pids);
    unlink(ch->epoch);
    if (!ch->o.log_path)
        unlink(ch->log);
    rmdir(ch->dir);
}

int sh__cmd_chaos(int argc, char **argv)
{
    chaos ch = {.logfd = -1};
    int rc = parse_opts(argc, argv, &ch.o);
    if (rc)
        return rc == 1 ? 0 : 2;
    signal(SIGPIPE, SIG_IGN);
    rc = run(&ch);
    // A failing run keeps its directory so that the cluster's log can be read.
    if (rc == 0)
        cleanup(&ch);
    else if (ch.dir[0])
        fprintf(stderr, "chaos: kept %s\n", ch.dir);
    if (ch.logfd >= 0)
        close(ch.logfd);
    free(ch.acts);
    free(ch.marks.v);
    free(ch.o.script_key);
    sh_scenario_destroy(ch.sc);
    sh_config_destroy(ch.c);
    return rc;
}
