/* `shoal cluster up`: runs every node of a cluster script whose URLs are local as child
 * processes of one command, supervises them (restarts with backoff) and stops them all on exit
 * (docs/cluster.md, "One machine, one command"). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "actors/cluster.h"
#include "actors/cluster_key.h"
#include "lua/config.h"
#include "tools/cluster_status.h"
#include "tools/cmd.h"
#include "tools/cmd_cluster_manifest.h"
#include "tools/cmd_cluster_policy.h"
#include "tools/cmd_util.h"

#define BACKOFF_FIRST_S 0.5
#define BACKOFF_MAX_S 10.0
#define BACKOFF_RESET_S 30.0 /* up this long: the next failure starts the backoff again */
#define QUICK_FAILS_MAX 5    /* exits in a row before the node was ready: give up */
#define LOST_GRACE_S 5.0     /* a front that lost a worker must fail-stop within this */
#define FRONT_STOP_S 60.0    /* a front's drain (30 s by default) plus slack, then SIGKILL */
#define WORKER_STOP_S 15.0   /* a worker's stop, then SIGKILL */
#define NOT_UP_STOP_S 3.0    /* the same for a node that is not up yet */
#define LINE_MAX_BYTES 4096
#define RECOVER_TIMEOUT "30" /* the front's --recover-timeout: seconds for a worker to return */

static void usage(FILE *f)
{
    fprintf(
        f, "usage: shoal cluster up CLUSTER.lua [--bin PATH] [-t THREADS] [--no-front]\n"
           "                        [--cluster-key-file FILE] [--pid-dir DIR] [--control-nice N]\n"
           "                        [--fault-scenario FILE [--fault-epoch E]] [-- SERVE FLAGS]\n"
           "       shoal cluster status [URL] [--api-key KEY] [--json] [--timeout S]\n"
           "       shoal cluster policy reload [URL] [--api-key KEY] [--timeout S]\n"
           "       shoal cluster manifest k8s|slurm CLUSTER.lua [options]\n\n"
           "Runs every node of a cluster script on this machine: each worker node as a child\n"
           "`shoal node -c CLUSTER.lua --name NAME`, and the gateway's node as a child\n"
           "`shoal serve -c CLUSTER.lua --recover-timeout " RECOVER_TIMEOUT " SERVE FLAGS`. Every\n"
           "node's URL must be local (ipc://, or tcp:// or tls+tcp:// on 127.x, localhost\n"
           "or [::1]). Each child's output is prefixed with its node's name. A node that\n"
           "exits is restarted with backoff (0.5 s doubling to 10 s). A worker lost while\n"
           "the front serves is restarted alone: the front pauses its replica, greets it\n"
           "when it is back and resumes every request by recompute. A front that exits\n"
           "(it gave up on a worker: status 3) restarts every node. A worker the front asked\n"
           "to restart (over its memory_budget: status 75) is restarted at once.\n"
           "A node that exits 5 times in a row before it is up, or exits 2 (bad input), stops\n"
           "the cluster. SIGINT/SIGTERM stop the front (it drains), then the workers.\n\n"
           "  --bin PATH    the shoal binary for the children (default: this one)\n"
           "  -t THREADS    compute threads of each worker node (shoal node -t)\n"
           "  --no-front    run the worker nodes only: the front runs elsewhere (an\n"
           "                embedding engine opened on the same script, as `shoal chaos\n"
           "                --engine` does); prints `cluster: up ...` once every worker\n"
           "                serves, and restarts a worker that exits as above\n"
           "  --cluster-key-file FILE\n"
           "                the cluster key every node proves in HELLO, passed to the children\n"
           "                as SHOAL_CLUSTER_KEY_FILE (see docs/cluster.md)\n"
           "  --pid-dir DIR write DIR/NAME.pid with each node's pid at every (re)start and\n"
           "                remove it when the node exits (for `shoal chaos`)\n"
           "  --fault-scenario FILE, --fault-epoch E\n"
           "                passed to every node (`shoal node` and `shoal serve`): each applies\n"
           "                the scenario's link events on the links leaving it (and its leak\n"
           "                events), times counted from E (UNIX_MS or @FILE; docs/chaos.md)\n"
           "  --control-nice N\n"
           "                passed to every node: the control path's nice steps above the\n"
           "                compute threads (default 10; 0: none; see shoal node --help)\n"
           "  -- FLAGS      the rest goes to `shoal serve` (e.g. -- --port 0)\n\n"
           "Prints `cluster: up ...` when the front listens. Exit status: 0 after a clean stop,\n"
           "2 for a bad script or a node that is not local, 1 when a node kept failing.\n\n"
           "`shoal cluster status [URL]` prints a running cluster's nodes, links, stages and\n"
           "load (URL defaults to http://127.0.0.1:8080; see shoal cluster status --help).\n"
           "`shoal cluster manifest k8s|slurm CLUSTER.lua` writes Kubernetes manifests or a\n"
           "Slurm job's copy of the script (see shoal cluster manifest --help).\n");
}

/* One line of the supervisor's own log, prefixed `cluster: `, written in one write(). */
static void say(const char *fmt, ...) SH_PRINTF(1, 2);
static void say(const char *fmt, ...)
{
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "cluster: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct child {
    const char *name;
    bool front;
    char **argv; /* (NULL-terminated), owned by the supervisor */
    pid_t pid;   /* 0 when not running */
    int out;     /* read end of the child's stdout+stderr pipe, -1 when none */
    char line[LINE_MAX_BYTES];
    size_t line_len;
    double started;    /* when the running process was started */
    bool ready;        /* it printed its ready line */
    bool stop_sent;    /* this supervisor asked it to stop */
    double kill_at;    /* SIGKILL after this, once stop_sent */
    double delay;      /* the next restart's backoff */
    int quick_fails;   /* exits in a row before it was ready */
    double restart_at; /* > 0: start it again at this time (not while the cluster restarts) */
    int status;        /* the last wait status */
} child;

typedef struct sup {
    const char *script;
    const char *bin;
    const char *pid_dir; /* --pid-dir, or NULL */
    child *kids;         /* workers first, the front last */
    int n;
    int sfd;
    bool stopping;   /* shutting down for good */
    int stop_signal; /* what to forward: SIGINT or SIGTERM */
    int exit_code;   /* when stopping for a failure */
    bool restarting; /* every node is being restarted */
    double restart_all_at;
    double lost_deadline;   /* restarting: SIGTERM the front if it is still up by then */
    bool workers_signalled; /* stopping: the workers were sent stop_signal */
    bool no_front;          /* --no-front: the front's child is never started */
    bool announced;         /* --no-front: the `up` line was printed */
} sup;

static child *front_of(sup *s) { return &s->kids[s->n - 1]; }

/* --pid-dir: DIR/NAME.pid holds the running process's pid (written whole by a rename), and is
 * gone while the node is down. */
static void pid_file(const sup *s, const child *k, pid_t pid)
{
    if (!s->pid_dir)
        return;
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s.pid", s->pid_dir, k->name);
    if (!pid) {
        unlink(path);
        return;
    }
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", (int)pid) < 0 || fclose(f) != 0 || rename(tmp, path) != 0)
        say("--pid-dir: cannot write %s: %s", path, strerror(errno));
}

static void describe(const child *k, int status, char *buf, size_t cap)
{
    if (WIFSIGNALED(status))
        snprintf(buf, cap, "signal %d: %s", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else if (k->front && WEXITSTATUS(status) == SH_CLUSTER_EXIT_LOST)
        snprintf(buf, cap, "status %d: it lost a worker node", WEXITSTATUS(status));
    else if (!k->front && WEXITSTATUS(status) == SH_NODE_EXIT_RESTART)
        snprintf(buf, cap, "status %d: the front asked it to restart", WEXITSTATUS(status));
    else
        snprintf(buf, cap, "status %d", WEXITSTATUS(status));
}

/* Writes one line of a child's output with its node's name in front. */
static void emit(child *k, const char *text, size_t len)
{
    char buf[LINE_MAX_BYTES + 80];
    int n = snprintf(buf, sizeof buf, "[%s] ", k->name);
    if (len > sizeof buf - (size_t)n - 1)
        len = sizeof buf - (size_t)n - 1;
    memcpy(buf + n, text, len);
    buf[(size_t)n + len] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n + len + 1);
    (void)w;
}

static void on_line(sup *s, child *k, const char *text, size_t len)
{
    emit(k, text, len);
    char l[LINE_MAX_BYTES + 1];
    memcpy(l, text, len);
    l[len] = '\0';
    if (k->ready)
        return;
    if (k->front) {
        const char *at = strstr(l, "listening on ");
        if (!at)
            return;
        k->ready = true;
        int nw = s->n - 1;
        say("up: %d worker node%s and the front (%s), %s", nw, nw == 1 ? "" : "s", k->name, at);
    } else {
        char want[128];
        snprintf(want, sizeof want, "node %s serving", k->name);
        if (strstr(l, want))
            k->ready = true;
        int ready = 0;
        for (int i = 0; i < s->n - 1; i++)
            ready += s->kids[i].ready;
        if (s->no_front && !s->announced && ready == s->n - 1) {
            s->announced = true;
            say("up: %d worker node%s (no front: it runs elsewhere)", ready, ready == 1 ? "" : "s");
        }
    }
}

/* Reads what the child wrote; at EOF (or final) flushes a partial line and closes the pipe. */
static void drain(sup *s, child *k, bool final)
{
    while (k->out >= 0) {
        char buf[4096];
        ssize_t r = read(k->out, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            if (r < 0 && errno == EAGAIN && !final)
                return;
            if (k->line_len)
                on_line(s, k, k->line, k->line_len);
            k->line_len = 0;
            close(k->out);
            k->out = -1;
            return;
        }
        for (ssize_t i = 0; i < r; i++) {
            if (buf[i] == '\n' || k->line_len == sizeof k->line) {
                on_line(s, k, k->line, k->line_len);
                k->line_len = 0;
                if (buf[i] == '\n')
                    continue;
            }
            k->line[k->line_len++] = buf[i];
        }
    }
}

static int start(sup *s, child *k)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        say("cannot start node %s: pipe: %s", k->name, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        say("cannot start node %s: fork: %s", k->name, strerror(errno));
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        // The child: only async-signal-safe calls until exec. It dies with the supervisor
        // (PR_SET_PDEATHSIG; the getppid() check closes the race with a supervisor that died
        // before the prctl), and sits in its own process group so that a terminal's Ctrl-C
        // reaches the supervisor alone, which stops the front before the workers.
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        setpgid(0, 0);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        int in = open("/dev/null", O_RDONLY);
        if (in >= 0)
            dup2(in, STDIN_FILENO);
        dup2(p[1], STDOUT_FILENO);
        dup2(p[1], STDERR_FILENO);
        execv(s->bin, k->argv);
        static const char msg[] = "error: cannot run the shoal binary (exec failed)\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        _exit(127);
    }
    close(p[1]);
    fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
    k->out = p[0];
    k->line_len = 0;
    k->pid = pid;
    k->started = now_s();
    k->ready = false;
    k->stop_sent = false;
    k->restart_at = 0;
    pid_file(s, k, pid);
    say("started node %s (%s, pid %d)", k->name, k->front ? "front" : "worker", (int)pid);
    return 0;
}

static void send_stop(child *k, int sig, double within)
{
    if (!k->pid || k->stop_sent)
        return;
    kill(k->pid, sig);
    k->stop_sent = true;
    // A node not up yet has nothing to drain, and may take signals only once it is up (the
    // front while it waits for the workers to join): it gets a short grace.
    k->kill_at = now_s() + (k->ready ? within : NOT_UP_STOP_S);
}

/* Stops the cluster for good (a signal, or a node that keeps failing): the front first. */
static void begin_stop(sup *s, int sig, int code)
{
    if (s->stopping)
        return;
    s->stopping = true;
    s->stop_signal = sig;
    s->exit_code = code;
    s->restarting = false;
    for (int i = 0; i < s->n; i++)
        s->kids[i].restart_at = 0;
    // A child stopping for a restart keeps going; a running front gets the signal now.
    send_stop(front_of(s), sig, FRONT_STOP_S);
}

/* Every node restarts, the front having lost its replica (or died): once the front is down the
 * workers are stopped, and once all are down they start again no sooner than `at`. */
static void begin_restart(sup *s, double at)
{
    if (!s->restarting) {
        s->restarting = true;
        s->restart_all_at = at;
        s->lost_deadline = now_s() + LOST_GRACE_S;
    } else if (at > s->restart_all_at) {
        s->restart_all_at = at;
    }
    for (int i = 0; i < s->n; i++)
        s->kids[i].restart_at = 0;
}

/* The backoff for a node that exited by itself: returns the delay before its restart, or -1
 * when it failed QUICK_FAILS_MAX times in a row before it was up. */
static double backoff(child *k, double t)
{
    if (t - k->started >= BACKOFF_RESET_S) {
        k->delay = BACKOFF_FIRST_S;
        k->quick_fails = 0;
    }
    if (k->ready)
        k->quick_fails = 0;
    else if (++k->quick_fails >= QUICK_FAILS_MAX)
        return -1;
    double d = k->delay;
    k->delay = k->delay * 2 > BACKOFF_MAX_S ? BACKOFF_MAX_S : k->delay * 2;
    return d;
}

static void on_exit_of(sup *s, child *k, int status)
{
    drain(s, k, true);
    double t = now_s();
    bool asked = k->stop_sent;
    pid_file(s, k, 0);
    k->pid = 0;
    k->status = status;
    k->ready = false;
    char how[160];
    describe(k, status, how, sizeof how);
    if (s->stopping) {
        bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        say("node %s stopped (%s)", k->name, how);
        if (!clean && s->exit_code == 0)
            s->exit_code = 1;
        return;
    }
    if (asked || (s->restarting && k->front)) {
        // Stopped for the restart, or the front failing stop as expected after a lost worker.
        say("node %s stopped for the restart (%s)", k->name, how);
        return;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 2) {
        say("node %s exited (%s: bad input, see its error above); stopping the cluster", k->name,
            how);
        begin_stop(s, SIGTERM, 2);
        return;
    }
    child *fr = front_of(s);
    if (!k->front && WIFEXITED(status) && WEXITSTATUS(status) == SH_NODE_EXIT_RESTART &&
        !s->restarting && ((fr->pid && fr->ready) || s->no_front)) {
        // Drained by the front's watchdog (over its memory budget): a clean restart it asked
        // for, not a failure, so at once and without backoff; the front resumes its replica.
        say("node %s exited (%s); restarting it now", k->name, how);
        k->quick_fails = 0;
        k->restart_at = t;
        return;
    }
    double d = backoff(k, t);
    if (d < 0) {
        say("node %s failed %d times in a row before it was up (last: %s); stopping the "
            "cluster",
            k->name, QUICK_FAILS_MAX, how);
        begin_stop(s, SIGTERM, 1);
        return;
    }
    child *f = front_of(s);
    if (k->front) {
        say("node %s exited (%s); restarting every node in %.1f s", k->name, how, d);
        begin_restart(s, t + d);
    } else if (!s->restarting && f->pid && f->ready) {
        // The front (started with --recover-timeout) pauses the replicas with a stage there,
        // greets the node when it is back and resumes them by recompute. Should it give up, it
        // exits 3 and every node restarts (above).
        say("node %s exited (%s); restarting it in %.1f s (the front pauses its replica and "
            "resumes it once the node is back)",
            k->name, how, d);
        k->restart_at = t + d;
    } else if (s->restarting) {
        say("node %s exited (%s); restarting every node in %.1f s", k->name, how, d);
        begin_restart(s, t + d);
    } else {
        say("node %s exited (%s); restarting in %.1f s", k->name, how, d);
        k->restart_at = t + d;
    }
}

static void reap(sup *s)
{
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            return;
        for (int i = 0; i < s->n; i++)
            if (s->kids[i].pid == pid)
                on_exit_of(s, &s->kids[i], status);
    }
}

static bool any_running(const sup *s, bool workers_only)
{
    for (int i = 0; i < s->n; i++)
        if (s->kids[i].pid && !(workers_only && s->kids[i].front))
            return true;
    return false;
}

/* Timers: restarts, the restart's and the stop's sequence, SIGKILL past a stop's deadline. */
static void tick(sup *s)
{
    double t = now_s();
    child *f = front_of(s);
    for (int i = 0; i < s->n; i++) {
        child *k = &s->kids[i];
        if (k->pid && k->stop_sent && t >= k->kill_at && k->kill_at > 0) {
            say("node %s did not stop in time; killing it", k->name);
            kill(k->pid, SIGKILL);
            k->kill_at = 0;
        }
    }
    if (s->stopping) {
        if (!f->pid && !s->workers_signalled) {
            s->workers_signalled = true;
            for (int i = 0; i < s->n - 1; i++)
                send_stop(&s->kids[i], s->stop_signal, WORKER_STOP_S);
        }
        return;
    }
    if (s->restarting) {
        if (f->pid) {
            if (!f->stop_sent && t >= s->lost_deadline) {
                say("node %s did not stop after it lost a worker; stopping it", f->name);
                send_stop(f, SIGTERM, FRONT_STOP_S);
            }
            return;
        }
        for (int i = 0; i < s->n - 1; i++)
            send_stop(&s->kids[i], SIGTERM, WORKER_STOP_S);
        if (any_running(s, true) || t < s->restart_all_at)
            return;
        s->restarting = false;
        say("restarting %d nodes", s->n);
        for (int i = 0; i < s->n; i++)
            if (start(s, &s->kids[i]) != 0)
                begin_stop(s, SIGTERM, 1);
        return;
    }
    for (int i = 0; i < s->n; i++) {
        child *k = &s->kids[i];
        if (!k->pid && k->restart_at > 0 && t >= k->restart_at && start(s, k) != 0)
            begin_stop(s, SIGTERM, 1);
    }
}

static int supervise(sup *s)
{
    for (int i = 0; i < s->n && !s->stopping; i++)
        if (!(s->no_front && s->kids[i].front) && start(s, &s->kids[i]) != 0)
            begin_stop(s, SIGTERM, 1);
    int signals = 0;
    while (s->stopping ? any_running(s, false) : true) {
        struct pollfd pf[SH_CLUSTER_MAX_STAGES + 2];
        child *who[SH_CLUSTER_MAX_STAGES + 2];
        int np = 0;
        pf[np++] = (struct pollfd){.fd = s->sfd, .events = POLLIN};
        for (int i = 0; i < s->n; i++)
            if (s->kids[i].out >= 0) {
                who[np] = &s->kids[i];
                pf[np++] = (struct pollfd){.fd = s->kids[i].out, .events = POLLIN};
            }
        int r = poll(pf, (nfds_t)np, 100);
        if (r < 0 && errno != EINTR) {
            say("poll: %s", strerror(errno));
            begin_stop(s, SIGTERM, 1);
        }
        for (int i = 1; r > 0 && i < np; i++)
            if (pf[i].revents)
                drain(s, who[i], false);
        if (r > 0 && pf[0].revents) {
            struct signalfd_siginfo si;
            while (read(s->sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                int sig = (int)si.ssi_signo;
                if (sig == SIGCHLD)
                    continue;
                if (sig == SIGHUP)
                    continue;
                signals++;
                if (signals == 1) {
                    say("%s: stopping %s", sig == SIGINT ? "interrupted" : "terminated",
                        s->no_front ? "the workers" : "the front, then the workers");
                    begin_stop(s, sig, 0);
                } else {
                    say("signalled again: killing every node");
                    for (int i = 0; i < s->n; i++)
                        if (s->kids[i].pid)
                            kill(s->kids[i].pid, SIGKILL);
                    if (s->exit_code == 0)
                        s->exit_code = 1;
                }
            }
        }
        reap(s);
        tick(s);
    }
    for (int i = 0; i < s->n; i++)
        if (s->kids[i].out >= 0)
            drain(s, &s->kids[i], true);
    if (s->exit_code == 0)
        say("stopped: every node exited cleanly");
    else
        say("stopped (exit status %d)", s->exit_code);
    return s->exit_code;
}

/* Whether a node URL is on this machine: ipc://, or tcp:// on a loopback host. */
static bool is_local(const char *url)
{
    if (!strncmp(url, "ipc://", 6))
        return true;
    if (!strncmp(url, "tls+tcp://", 10))
        url += 4; /* the same host rule */
    if (strncmp(url, "tcp://", 6))
        return false;
    const char *h = url + 6;
    const char *end;
    if (*h == '[') {
        end = strchr(h, ']');
        return end && end - h == 4 && !strncmp(h, "[::1]", 5);
    }
    end = strrchr(h, ':');
    size_t len = end ? (size_t)(end - h) : strlen(h);
    if (len == 9 && !strncmp(h, "localhost", 9))
        return true;
    if (len < 4 || strncmp(h, "127.", 4))
        return false;
    for (size_t i = 4; i < len; i++)
        if (!(h[i] == '.' || (h[i] >= '0' && h[i] <= '9')))
            return false;
    return true;
}

static char **argv_make(int n, ...)
{
    char **v = calloc((size_t)n + 1, sizeof *v);
    if (!v)
        return NULL;
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++)
        v[i] = va_arg(ap, char *);
    va_end(ap);
    return v;
}

static int cluster_up(int argc, char **argv)
{
    const char *script = NULL, *bin = "/proc/self/exe", *threads = NULL, *key_file = NULL;
    const char *pid_dir = NULL, *fault = NULL, *epoch = NULL, *control_nice = NULL;
    bool no_front = false;
    int extra = argc; // index of the first serve flag
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--")) {
            extra = i + 1;
            break;
        }
        if (!strcmp(a, "--no-front")) {
            no_front = true;
            continue;
        }
        if (!strcmp(a, "--bin") || !strcmp(a, "-t") || !strcmp(a, "--cluster-key-file") ||
            !strcmp(a, "--pid-dir") || !strcmp(a, "--fault-scenario") ||
            !strcmp(a, "--fault-epoch") || !strcmp(a, "--control-nice")) {
            if (i + 1 >= argc)
                return sh__cmd_fail("option '%s' needs a value (see shoal cluster up --help)", a);
            const char *v = argv[++i];
            int64_t t;
            if (!strcmp(a, "--bin"))
                bin = v;
            else if (!strcmp(a, "--cluster-key-file"))
                key_file = v;
            else if (!strcmp(a, "--pid-dir"))
                pid_dir = v;
            else if (!strcmp(a, "--fault-scenario"))
                fault = v;
            else if (!strcmp(a, "--fault-epoch"))
                epoch = v;
            else if (!strcmp(a, "--control-nice")) {
                if (!sh__cmd_parse_i64(v, 0, 19, &t))
                    return sh__cmd_fail("bad value '%s' for --control-nice: want a whole number "
                                        "from 0 to 19",
                                        v);
                control_nice = v;
            } else if (!sh__cmd_parse_i64(v, 1, 1024, &t))
                return sh__cmd_fail("bad value '%s' for -t: want a whole number from 1 to 1024", v);
            else
                threads = v;
            continue;
        }
        if (a[0] == '-' || script)
            return sh__cmd_fail("unknown argument '%s' (serve flags go after --; see shoal "
                                "cluster up --help)",
                                a);
        script = a;
    }
    if (!script)
        return sh__cmd_fail("shoal cluster up needs a cluster script (see shoal cluster up "
                            "--help)");
    if (access(bin, X_OK) != 0)
        return sh__cmd_fail("--bin %s: %s", bin, strerror(errno));
    if (pid_dir && access(pid_dir, W_OK) != 0)
        return sh__cmd_fail("--pid-dir %s: %s", pid_dir, strerror(errno));
    if (epoch && !fault)
        return sh__cmd_fail("--fault-epoch needs --fault-scenario");
    if (fault && access(fault, R_OK) != 0)
        return sh__cmd_fail("--fault-scenario %s: %s", fault, strerror(errno));
    sh_error e = {0};
    sh_cluster_config *c = NULL;
    if (sh_config_load_file(script, NULL, &c, &e))
        return sh__cmd_fail("%s", e.msg);
    for (int32_t i = 0; i < c->n_nodes; i++)
        if (!is_local(c->nodes[i].listen)) {
            int rc = sh__cmd_fail("%s: node '%s' listens on %s, which is not on this machine: "
                                  "shoal cluster up starts only local nodes (ipc://, or tcp:// "
                                  "or tls+tcp:// on 127.x, localhost or [::1]); start it with "
                                  "`shoal node` "
                                  "on its own machine",
                                  script, c->nodes[i].name, c->nodes[i].listen);
            sh_config_destroy(c);
            return rc;
        }
    sh_error ce = {0};
    int rc = sh__cmd_report(sh__cluster_check(c, script, &ce), &ce);
    // A bad key stops the cluster before anything starts; a good one reaches every child (they
    // inherit the environment and run in this directory).
    sh_auth_key key;
    if (!rc)
        rc = sh__cmd_report(sh__cluster_key_load(key_file, c, &key, &ce), &ce);
    if (!rc && key_file && setenv(SH_CLUSTER_KEY_ENV, key_file, 1) != 0)
        rc = sh__cmd_fail("setenv: %s", strerror(errno));
    if (rc) {
        sh_config_destroy(c);
        return rc;
    }
    int n_extra = argc - extra;
    if (no_front && c->n_nodes < 2) {
        sh_config_destroy(c);
        return sh__cmd_fail("%s: --no-front: the script has no worker node to run", script);
    }
    if (no_front && extra < argc) {
        sh_config_destroy(c);
        return sh__cmd_fail(
            "--no-front starts no `shoal serve`: flags after -- have nowhere to go");
    }
    sup s = {.script = script, .bin = bin, .sfd = -1, .pid_dir = pid_dir, .no_front = no_front};
    s.n = c->n_nodes;
    if (s.n > SH_CLUSTER_MAX_STAGES + 1) {
        sh_config_destroy(c);
        return sh__cmd_fail("%s: %d nodes, at most %d", script, (int)s.n,
                            SH_CLUSTER_MAX_STAGES + 1);
    }
    s.kids = calloc((size_t)s.n, sizeof *s.kids);
    if (!s.kids) {
        sh_config_destroy(c);
        return (fprintf(stderr, "error: out of memory\n"), 1);
    }
    // Workers in script order, then the front.
    int w = 0;
    bool oom = false;
    for (int32_t i = 0; i < c->n_nodes; i++) {
        child *k = i == c->gateway.node ? &s.kids[s.n - 1] : &s.kids[w++];
        k->name = c->nodes[i].name;
        k->front = i == c->gateway.node;
        k->out = -1;
        k->delay = BACKOFF_FIRST_S;
        if (k->front) {
            // The front waits for a lost worker to come back (this supervisor restarts it) and
            // resumes its requests; flags after `--` come later and win.
            k->argv = calloc((size_t)n_extra + 13, sizeof *k->argv);
            if (k->argv) {
                int j = 0;
                k->argv[j++] = "shoal";
                k->argv[j++] = "serve";
                k->argv[j++] = "-c";
                k->argv[j++] = (char *)script;
                k->argv[j++] = "--recover-timeout";
                k->argv[j++] = RECOVER_TIMEOUT;
                if (fault) {
                    k->argv[j++] = "--fault-scenario";
                    k->argv[j++] = (char *)fault;
                }
                if (epoch) {
                    k->argv[j++] = "--fault-epoch";
                    k->argv[j++] = (char *)epoch;
                }
                if (control_nice) {
                    k->argv[j++] = "--control-nice";
                    k->argv[j++] = (char *)control_nice;
                }
                for (int x = 0; x < n_extra; x++)
                    k->argv[j++] = argv[extra + x];
            }
        } else {
            k->argv = argv_make(6, "shoal", "node", "-c", script, "--name", k->name);
            char **v = k->argv ? realloc(k->argv, 15 * sizeof *v) : NULL;
            if (v) {
                int j = 6;
                if (threads) {
                    v[j++] = "-t";
                    v[j++] = (char *)threads;
                }
                if (fault) {
                    v[j++] = "--fault-scenario";
                    v[j++] = (char *)fault;
                }
                if (epoch) {
                    v[j++] = "--fault-epoch";
                    v[j++] = (char *)epoch;
                }
                if (control_nice) {
                    v[j++] = "--control-nice";
                    v[j++] = (char *)control_nice;
                }
                v[j] = NULL;
            } else {
                free(k->argv);
            }
            k->argv = v;
        }
        oom |= !k->argv;
    }
    if (!oom) {
        // Every node is named by --name; SHOAL_NODE in this environment would make the front
        // check it against the gateway's node (docs/deploy.md).
        unsetenv("SHOAL_NODE");
        sigset_t sigs;
        sh__cmd_block_signals(&sigs, SIGCHLD);
        s.sfd = signalfd(-1, &sigs, SFD_NONBLOCK | SFD_CLOEXEC);
        if (s.sfd < 0) {
            fprintf(stderr, "error: signalfd: %s\n", strerror(errno));
            rc = 1;
        } else {
            say("%s: %d worker node%s and %s '%s' on this machine", script, s.n - 1,
                s.n == 2 ? "" : "s", no_front ? "not the front" : "the front", front_of(&s)->name);
            rc = supervise(&s);
            close(s.sfd);
        }
    } else {
        fprintf(stderr, "error: out of memory\n");
        rc = 1;
    }
    for (int i = 0; i < s.n; i++)
        free(s.kids[i].argv);
    free(s.kids);
    sh_config_destroy(c);
    return rc;
}

int sh__cmd_cluster(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        usage(stdout);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "up"))
        return cluster_up(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "status"))
        return sh__cmd_cluster_status(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "policy"))
        return sh__cmd_cluster_policy(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "manifest"))
        return sh__cmd_cluster_manifest(argc - 1, argv + 1);
    return sh__cmd_fail("usage: shoal cluster up CLUSTER.lua [--bin PATH] [-t THREADS] "
                        "[-- SERVE FLAGS], or shoal cluster status [URL] (see shoal cluster "
                        "--help)");
}
