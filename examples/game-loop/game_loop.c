/* A fixed 60 Hz game loop that asks Shoal for NPC lines while it ticks, and measures how much the
 * generation disturbs the ticks. Builds as C99 and as C++17 (the same file).
 *
 * Each tick: a simulated world update that burns a fixed amount of CPU (--work-ms of this
 * thread's CPU time, so being preempted makes the tick longer, as it would for real work), then
 * sh_poll(eng, 0) to run the callbacks that are due (never waiting), then a new NPC request when
 * fewer than --inflight are running; then the loop sleeps until the next tick's start.
 *
 * Figures printed at the end, over all ticks:
 *   tick     the tick's own duration (update + poll + submit), from its start to its end;
 *   late     how long after its scheduled start the tick started (sleep wake-up lateness);
 *   overrun  how much later than ideal the tick ended: (end - scheduled start) - work,
 *            i.e. everything the tick lost to lateness, preemption, polling and submitting;
 *   engine   the part of the tick spent in sh_poll() and sh_submit();
 *   missed   ticks that ended after their 16.7 ms slot.
 *
 * Usage: game_loop -m MODEL [--seconds S] [--threads N] [--no-generate] [--work-ms W]
 *                  [--inflight K] [--max-tokens T] [--min-lines N] [--quiet]
 *                  [--engine-nice N] [--game-nice N] [--rt] [--no-pin] [--engine-idle]
 *                  [--engine-cpus MASK]
 * (--min-lines N: keep ticking past --seconds, at most 120 s more, until N lines finished.
 * --engine-nice N: the engine's threads at nice N, --game-nice N: the game thread at nice N
 * (negative values need privileges); --rt: the game thread alone under SCHED_FIFO (needs
 * CAP_SYS_NICE). Linux only, for machines where other processes compete for the cores.
 * By default, with 2 CPUs or more, the engine's threads run on every CPU but the last and the
 * game thread alone on the last, so the scheduler never puts the compute thread on the game
 * thread's CPU (no privileges needed; Linux); --no-pin leaves placement to the scheduler.
 * --engine-idle: no split; instead the engine's own options put its compute threads under
 * SCHED_IDLE and stop them spinning between ops (sh_engine_opts.sched, .no_spin), so the game
 * thread, under the normal policy, wins its CPU back; --engine-cpus MASK: no split by the
 * example; the engine's own option keeps its compute threads on the CPUs of MASK (bit i: CPU i),
 * while the game thread stays free to run anywhere.) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#endif

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/resource.h>
#include <unistd.h>

#include <shoal.h>

#define TICK_NS 16666667LL /* 60 Hz */

typedef struct game {
    sh_engine *eng;
    int inflight;     /* requests in flight */
    int max_inflight; /* --inflight */
    int max_tokens;   /* --max-tokens */
    int quiet;        /* --quiet: no NPC lines printed */
    long submitted;   /* requests submitted */
    long finished;    /* requests ended with on_done */
    long failed;      /* requests ended with on_error, except by the close */
    long closed;      /* requests the close ended (SH_ECLOSED) */
    long tokens;      /* tokens received */
    unsigned npc;     /* next NPC to ask */
    char line[512];   /* the NPC line being received (one request at a time is printed) */
    size_t line_len;
    uint64_t line_id; /* the request whose text goes into line */
} game;

static const char *const npcs[][2] = {
    {"a blacksmith", "A traveller asks if her sword can be repaired by tonight."},
    {"a town guard", "A stranger asks why the north gate is closed."},
    {"an innkeeper", "A tired merchant asks for the cheapest room."},
    {"a fisherman", "A child asks what the biggest fish he ever caught was."},
    {"a wizard's apprentice", "A farmer asks for help with the crows in his field."},
    {"a bard", "A noble asks for a song about the old king."},
};
#define N_NPCS (sizeof npcs / sizeof npcs[0])

static int64_t now_ns(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The world update: burns `work_ns` of this thread's CPU time. */
static void world_update(int64_t work_ns)
{
    volatile double x = 0.0;
    int64_t start = now_ns(CLOCK_THREAD_CPUTIME_ID);
    while (now_ns(CLOCK_THREAD_CPUTIME_ID) - start < work_ns) {
        for (int i = 0; i < 200; i++)
            x = x * 0.999 + 1.0;
    }
    (void)x;
}

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    game *g = (game *)user;
    g->tokens += ev->n_ids;
    if (id == g->line_id) {
        size_t room = sizeof g->line - 1 - g->line_len;
        size_t n = ev->text_len < room ? ev->text_len : room;
        memcpy(g->line + g->line_len, ev->text, n);
        g->line_len += n;
    }
}

static void end_request(game *g, uint64_t id)
{
    g->inflight--;
    if (id == g->line_id) {
        g->line[g->line_len] = '\0';
        for (size_t i = 0; i < g->line_len; i++)
            if (g->line[i] == '\n')
                g->line[i] = ' ';
        if (!g->quiet)
            printf("npc line %llu: %s\n", (unsigned long long)id, g->line);
        g->line_id = 0;
    }
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    game *g = (game *)user;
    (void)info;
    g->finished++;
    end_request(g, id);
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    game *g = (game *)user;
    if (code == SH_ECLOSED) {
        g->closed++; /* still running when the loop ended */
        g->inflight--;
        return;
    }
    g->failed++;
    fprintf(stderr, "game_loop: request %llu failed: %s: %s\n", (unsigned long long)id,
            sh_strerror(code), message);
    end_request(g, id);
}

/* Asks the next NPC for a line. Returns 0 on success. */
static int ask_npc(game *g)
{
    char system[256];
    const char *const *npc = npcs[g->npc % N_NPCS];
    snprintf(system, sizeof system,
             "You are %s in a small fantasy town. Answer in one short sentence.", npc[0]);
    sh_chat_message msgs[2];
    msgs[0].role = "system";
    msgs[0].content = system;
    msgs[1].role = "user";
    msgs[1].content = npc[1];
    sh_request_opts r = sh_request_opts_default();
    r.messages = msgs;
    r.n_messages = 2;
    r.max_tokens = g->max_tokens;
    r.temperature = 0.8f;
    r.top_p = 0.95f;
    r.seed = 1000u + g->npc;
    sh_callbacks cb;
    cb.on_token = on_token;
    cb.on_done = on_done;
    cb.on_error = on_error;
    uint64_t id = 0;
    sh_error err;
    if (sh_submit(g->eng, &r, &cb, g, &id, &err) != SH_OK) {
        fprintf(stderr, "game_loop: submit: %s\n", err.msg);
        return -1;
    }
    g->npc++;
    g->submitted++;
    g->inflight++;
    if (g->line_id == 0) {
        g->line_id = id;
        g->line_len = 0;
    }
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The p-th percentile (0..100) of n sorted values, nearest rank. */
static double pct_ms(const int64_t *sorted, size_t n, double p)
{
    if (n == 0)
        return 0.0;
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    if (k < 1)
        k = 1;
    if (k > n)
        k = n;
    return (double)sorted[k - 1] / 1e6;
}

static void print_row(const char *name, int64_t *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_i64);
    printf("%-8s p50 %7.3f  p90 %7.3f  p99 %7.3f  p99.9 %7.3f  max %7.3f ms\n", name,
           pct_ms(v, n, 50), pct_ms(v, n, 90), pct_ms(v, n, 99), pct_ms(v, n, 99.9),
           pct_ms(v, n, 100));
}

/* Linux: sets the nice value of every thread of this process but the calling (main) one, that
 * is of the engine's threads, so that on a busy machine the game thread wins the CPU over them
 * (--engine-nice). On Linux setpriority(PRIO_PROCESS, tid) acts on one thread. Returns how many
 * threads were changed, -1 where /proc/self/task does not exist. */
static int renice_engine_threads(int nice_value)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        long tid = atol(de->d_name);
        if (tid <= 0 || tid == (long)getpid())
            continue;
        if (setpriority(PRIO_PROCESS, (id_t)tid, nice_value) == 0)
            n++;
        else
            fprintf(stderr, "game_loop: setpriority(thread %ld, %d): %s\n", tid, nice_value,
                    strerror(errno));
    }
    closedir(d);
    return n;
}

/* Linux: restricts the calling thread to CPUs [first, last]. Threads it starts afterwards inherit
 * the mask: that is how the engine's threads, started by sh_engine_open(), stay off the game
 * thread's CPU (--pin). Returns 0 or -1 with errno. */
static int pin_self(int first, int last)
{
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c = first; c <= last; c++)
        CPU_SET(c, &set);
    return sched_setaffinity(0, sizeof set, &set);
#else
    (void)first;
    (void)last;
    errno = ENOSYS;
    return -1;
#endif
}

/* Linux: every thread of this process with the CPU seconds it used (from /proc/self/task), so a
 * run shows how many threads the engine really runs and which of them burn CPU. Elsewhere it
 * prints nothing. */
static void report_threads(double elapsed)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return;
    long hz = 100; /* USER_HZ: clock ticks in /proc are 1/100 s on Linux */
    struct dirent *de;
    printf("threads (name: CPU seconds, share of the run):");
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char path[300], buf[1024];
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        /* pid (comm) state ppid ... field 14 utime, 15 stime; comm may hold spaces. */
        char *lp = strchr(buf, '('), *rp = strrchr(buf, ')');
        if (!lp || !rp)
            continue;
        *rp = '\0';
        unsigned long long ut = 0, st = 0;
        if (sscanf(rp + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
            continue;
        double cpu = (double)(ut + st) / (double)hz;
        printf(" %s: %.2f (%.0f%%);", lp + 1, cpu, 100.0 * cpu / elapsed);
    }
    printf("\n");
    closedir(d);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: game_loop -m MODEL [--seconds S] [--threads N] [--no-generate] "
               "[--work-ms W] [--inflight K] [--max-tokens T] [--min-lines N] [--engine-nice N] "
               "[--game-nice N] [--rt] [--no-pin] [--engine-idle] [--engine-cpus MASK] "
               "[--quiet]\n");
}

int main(int argc, char **argv)
{
    const char *model = getenv("SHOAL_MODEL");
    double seconds = 10.0, work_ms = 4.0;
    int threads = 1, generate = 1, max_inflight = 1, max_tokens = 48, quiet = 0;
    long min_lines = 0;
    int engine_nice = 0, game_nice = 0, set_engine_nice = 0, set_game_nice = 0, rt = 0, pin = 1;
    int engine_idle = 0;
    unsigned long long engine_cpus = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if ((strcmp(a, "-m") == 0 || strcmp(a, "--model") == 0) && v) {
            model = v;
            i++;
        } else if (strcmp(a, "--seconds") == 0 && v) {
            seconds = atof(v);
            i++;
        } else if (strcmp(a, "--threads") == 0 && v) {
            threads = atoi(v);
            i++;
        } else if (strcmp(a, "--work-ms") == 0 && v) {
            work_ms = atof(v);
            i++;
        } else if (strcmp(a, "--inflight") == 0 && v) {
            max_inflight = atoi(v);
            i++;
        } else if (strcmp(a, "--max-tokens") == 0 && v) {
            max_tokens = atoi(v);
            i++;
        } else if (strcmp(a, "--min-lines") == 0 && v) {
            min_lines = atol(v);
            i++;
        } else if (strcmp(a, "--engine-nice") == 0 && v) {
            engine_nice = atoi(v);
            set_engine_nice = 1;
            i++;
        } else if (strcmp(a, "--game-nice") == 0 && v) {
            game_nice = atoi(v);
            set_game_nice = 1;
            i++;
        } else if (strcmp(a, "--rt") == 0) {
            rt = 1;
        } else if (strcmp(a, "--no-pin") == 0) {
            pin = 0;
        } else if (strcmp(a, "--engine-cpus") == 0 && v) {
            engine_cpus = strtoull(v, NULL, 0);
            pin = 0; /* the engine's options replace the split */
            i++;
        } else if (strcmp(a, "--engine-idle") == 0) {
            engine_idle = 1;
            pin = 0; /* the engine's options replace the split */
        } else if (strcmp(a, "--no-generate") == 0) {
            generate = 0;
        } else if (strcmp(a, "--quiet") == 0) {
            quiet = 1;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "game_loop: unknown or incomplete option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!model || seconds <= 0 || seconds > 3600 || threads < 0 || work_ms < 0 || work_ms > 16 ||
        max_inflight < 1 || max_tokens < 1) {
        usage(stderr);
        fprintf(stderr, "game_loop: need -m MODEL (or SHOAL_MODEL), 0 < seconds <= 3600, "
                        "0 <= work-ms <= 16, inflight >= 1, max-tokens >= 1\n");
        return 2;
    }

    game g;
    memset(&g, 0, sizeof g);
    g.max_inflight = max_inflight;
    g.max_tokens = max_tokens;
    g.quiet = quiet;

    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = model;
    o.threads = threads;
    if (engine_idle) {
        o.sched = SH_ENGINE_SCHED_IDLE;
        o.no_spin = 1;
    }
    o.cpu_mask = engine_cpus;
    sh_error err;
    long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (pin && n_cpu < 2)
        pin = 0; /* one CPU: nothing to keep apart */
    if (pin && pin_self(0, (int)n_cpu - 2) != 0) {
        fprintf(stderr, "game_loop: sched_setaffinity: %s (--no-pin runs without)\n",
                strerror(errno));
        return 1;
    }
    int64_t t_open = now_ns(CLOCK_MONOTONIC);
    if (sh_engine_open(&o, &g.eng, &err) != SH_OK) {
        fprintf(stderr, "game_loop: cannot open %s: %s\n", model, err.msg);
        return 1;
    }
    if (pin) {
        if (pin_self((int)n_cpu - 1, (int)n_cpu - 1) != 0) {
            fprintf(stderr, "game_loop: sched_setaffinity: %s\n", strerror(errno));
            sh_engine_close(g.eng);
            return 1;
        }
        printf("game_loop: engine threads on CPUs 0-%ld, the game thread on CPU %ld\n", n_cpu - 2,
               n_cpu - 1);
    }
    printf("game_loop: %s loaded in %.2f s; %d compute thread(s); %s; %.1f ms of work per "
           "tick at 60 Hz for %.0f s\n",
           model, (double)(now_ns(CLOCK_MONOTONIC) - t_open) / 1e9, threads,
           generate ? "generating NPC lines" : "not generating", work_ms, seconds);
    if (set_engine_nice) {
        int n = renice_engine_threads(engine_nice);
        printf("game_loop: engine threads at nice %d: %d thread(s)\n", engine_nice, n);
    }
    if (set_game_nice) {
        /* The main thread's id is the process id; a negative value needs CAP_SYS_NICE. */
        if (setpriority(PRIO_PROCESS, (id_t)getpid(), game_nice) != 0) {
            fprintf(stderr, "game_loop: setpriority(game thread, %d): %s\n", game_nice,
                    strerror(errno));
            sh_engine_close(g.eng);
            return 1;
        }
        printf("game_loop: game thread at nice %d\n", game_nice);
    }
    if (rt) {
        /* SCHED_FIFO for the game thread only (Linux: pid 0 is the calling thread); the engine's
         * threads, started by the open, keep the normal policy. Needs CAP_SYS_NICE. */
        struct sched_param sp;
        memset(&sp, 0, sizeof sp);
        sp.sched_priority = 10;
        if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0) {
            fprintf(stderr, "game_loop: SCHED_FIFO for the game thread: %s\n", strerror(errno));
            sh_engine_close(g.eng);
            return 1;
        }
        printf("game_loop: game thread SCHED_FIFO priority 10\n");
    }
    fflush(stdout);

    /* --min-lines: go on past --seconds (at most 120 s more) until that many lines finished. */
    size_t n_ticks = (size_t)(seconds * 60.0 + 0.5);
    size_t n_max = n_ticks + (min_lines > 0 ? 120 * 60 : 0);
    int64_t *tick = (int64_t *)malloc(n_max * sizeof *tick);
    int64_t *late = (int64_t *)malloc(n_max * sizeof *late);
    int64_t *over = (int64_t *)malloc(n_max * sizeof *over);
    int64_t *engine = (int64_t *)malloc(n_max * sizeof *engine);
    if (!tick || !late || !over || !engine) {
        fprintf(stderr, "game_loop: out of memory\n");
        free(tick);
        free(late);
        free(over);
        free(engine);
        sh_engine_close(g.eng);
        return 1;
    }
    int64_t work_ns = (int64_t)(work_ms * 1e6);
    long missed = 0, poll_errors = 0;
    int64_t poll_max = 0, submit_max = 0; /* the longest sh_poll(eng, 0) and submit */
    int64_t start = now_ns(CLOCK_MONOTONIC) + TICK_NS;
    int64_t t_begin = start;
    size_t k;
    for (k = 0; k < n_ticks || (g.finished < min_lines && k < n_max); k++) {
        int64_t sched = start + (int64_t)k * TICK_NS;
        struct timespec ts;
        ts.tv_sec = (time_t)(sched / 1000000000LL);
        ts.tv_nsec = (long)(sched % 1000000000LL);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        int64_t t0 = now_ns(CLOCK_MONOTONIC);

        world_update(work_ns);
        int64_t te = now_ns(CLOCK_MONOTONIC);
        if (sh_poll(g.eng, 0, NULL) != SH_OK)
            poll_errors++;
        int64_t tp = now_ns(CLOCK_MONOTONIC);
        if (tp - te > poll_max)
            poll_max = tp - te;
        if (generate && g.inflight < g.max_inflight) {
            ask_npc(&g);
            int64_t ts_end = now_ns(CLOCK_MONOTONIC);
            if (ts_end - tp > submit_max)
                submit_max = ts_end - tp;
        }

        int64_t t1 = now_ns(CLOCK_MONOTONIC);
        engine[k] = t1 - te;
        tick[k] = t1 - t0;
        late[k] = t0 > sched ? t0 - sched : 0;
        int64_t o_ns = (t1 - sched) - work_ns;
        over[k] = o_ns > 0 ? o_ns : 0;
        if (t1 > sched + TICK_NS)
            missed++;
    }
    n_ticks = k;
    double elapsed = (double)(now_ns(CLOCK_MONOTONIC) - t_begin) / 1e9;

    /* The close ends the requests still running (on_error with SH_ECLOSED, on this thread). */
    report_threads(elapsed);
    sh_err rc = sh_engine_close(g.eng);

    printf("ticks %zu in %.2f s; missed (ended past their 16.7 ms slot) %ld; poll errors %ld\n",
           n_ticks, elapsed, missed, poll_errors);
    printf("requests submitted %ld, finished %ld, failed %ld, ended by the close %ld; tokens %ld "
           "(%.1f tokens/s)\n",
           g.submitted, g.finished, g.failed, g.closed, g.tokens, (double)g.tokens / elapsed);
    print_row("tick", tick, n_ticks);
    print_row("late", late, n_ticks);
    print_row("overrun", over, n_ticks);
    print_row("engine", engine, n_ticks);
    printf("longest sh_poll(eng, 0) %.3f ms, longest submit %.3f ms\n", (double)poll_max / 1e6,
           (double)submit_max / 1e6);
    printf("overrun_p99_ms %.3f\n", pct_ms(over, n_ticks, 99));
    free(tick);
    free(late);
    free(over);
    free(engine);
    if (rc != SH_OK) {
        fprintf(stderr, "game_loop: close: %s\n", sh_strerror(rc));
        return 1;
    }
    /* A clean run: no poll error, no failed request (those in flight at the end are ended by
     * the close with SH_ECLOSED, which is expected), and when generating at least one line. */
    if (poll_errors || g.failed)
        return 1;
    if (generate && g.finished == 0) {
        fprintf(stderr, "game_loop: no NPC line finished in %.0f s\n", seconds);
        return 1;
    }
    return 0;
}
