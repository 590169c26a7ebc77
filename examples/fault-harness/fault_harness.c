/* A fault-injection harness, the template for a user's own chaos test: it starts a local
 * cluster (two `shoal node` workers holding a 2-stage pipeline, over ipc:// in a temporary
 * folder), opens an engine on the cluster script (the engine is the cluster's front: gateway,
 * batcher and KV manager run in this process), and runs the same greedy requests twice:
 *
 *   1. on clean links, recording every answer;
 *   2. with faults injected through the engine's fault layer (sh_engine_fault(), include/
 *      shoal/fault.h): messages from this front to the workers dropped with probability --drop
 *      (0.1) and delayed --delay-ms (20) with probability 0.5; the workers run a scenario
 *      dropping --worker-drop (0.02) of their own messages (`shoal node --fault-scenario`).
 *
 * Asserted: every submitted id gets exactly one final callback (none lost, none doubled); with
 * the batcher's retries every request finishes (on_done, never on_error) with the clean run's
 * text and token count; and the fault layer really dropped messages (else the run proves
 * nothing). Exit 0 when all hold, 1 otherwise, 2 on bad usage, 77 when the library cannot open
 * an engine on a cluster script (reported as such, not as a pass).
 *
 * A lost STEP, ACT or STEP_DONE makes the batcher send the step again; a step that fails every
 * try within the step timeout (30 s) ends its requests with an error (SH_ETIMEDOUT), which this
 * harness counts as a failure: at 20% drops on every link that happened (a step needs three
 * messages through, 0.8^3 = 0.51 a try), so the defaults stay where retries recover.
 *
 * Usage: fault_harness --shoal PATH/bin/shoal -m MODEL [--requests N] [--max-tokens T]
 *                      [--drop P] [--worker-drop P] [--delay-ms D] [--seed S] [--keep DIR] */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <shoal.h>
#include <shoal/fault.h>

#define MAX_REQ 64
#define N_WORKERS 2

typedef struct req {
    uint64_t id;
    int finals; /* final callbacks seen (must end at exactly 1) */
    int ok;     /* ended with on_done */
    int tokens; /* completion tokens */
    char text[2048];
    size_t len;
    char error[200];
} req;

typedef struct run {
    req r[MAX_REQ];
    int n;
    int unknown; /* callbacks for ids this run never submitted */
} run;

static req *find(run *rn, uint64_t id)
{
    for (int i = 0; i < rn->n; i++)
        if (rn->r[i].id == id)
            return &rn->r[i];
    return NULL;
}

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    run *rn = (run *)user;
    req *q = find(rn, id);
    if (!q) {
        rn->unknown++;
        return;
    }
    size_t room = sizeof q->text - 1 - q->len, n = ev->text_len < room ? ev->text_len : room;
    memcpy(q->text + q->len, ev->text, n);
    q->len += n;
    q->text[q->len] = '\0';
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    run *rn = (run *)user;
    req *q = find(rn, id);
    if (!q) {
        rn->unknown++;
        return;
    }
    q->finals++;
    q->ok = 1;
    q->tokens = info->completion_tokens;
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    run *rn = (run *)user;
    req *q = find(rn, id);
    if (!q) {
        rn->unknown++;
        return;
    }
    q->finals++;
    snprintf(q->error, sizeof q->error, "%s: %s", sh_strerror(code), message);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *const subjects[] = {"a dragon",          "the old lighthouse", "a lost key",
                                       "the winter market", "a talking cat",      "the last train"};

/* Submits n greedy requests and polls until each has had its final callback or `limit_s`
 * passed. Returns 0 when every request got a final callback. */
static int run_requests(sh_engine *eng, run *rn, int n, int max_tokens, double limit_s)
{
    memset(rn, 0, sizeof *rn);
    sh_callbacks cb = {on_token, on_done, on_error};
    for (int i = 0; i < n; i++) {
        char prompt[160];
        snprintf(prompt, sizeof prompt, "Write one sentence about %s.",
                 subjects[i % (int)(sizeof subjects / sizeof subjects[0])]);
        sh_request_opts r = sh_request_opts_default();
        r.prompt = prompt;
        r.max_tokens = max_tokens;
        r.ignore_eos = true;
        sh_error err;
        /* Register the slot before submitting: no callback runs before the next sh_poll. */
        if (sh_submit(eng, &r, &cb, rn, &rn->r[rn->n].id, &err) != SH_OK) {
            fprintf(stderr, "fault_harness: submit %d: %s\n", i, err.msg);
            return -1;
        }
        rn->n++;
    }
    double deadline = now_s() + limit_s;
    while (sh_pending(eng) > 0 && now_s() < deadline)
        sh_poll(eng, 100, NULL);
    sh_poll(eng, 0, NULL);
    for (int i = 0; i < rn->n; i++)
        if (rn->r[i].finals != 1)
            return -1;
    return 0;
}

static pid_t start_node(const char *shoal, const char *script, const char *name,
                        const char *scenario, const char *log)
{
    /* Flushed first, or a child would write the parent's buffered lines again when it
     * redirects its stdout. */
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid != 0)
        return pid; /* the parent, or -1 */
    FILE *f = freopen(log, "w", stdout);
    if (f)
        dup2(fileno(stdout), STDERR_FILENO);
    if (scenario)
        execl(shoal, shoal, "node", "-c", script, "--name", name, "-t", "1", "--fault-scenario",
              scenario, (char *)NULL);
    else
        execl(shoal, shoal, "node", "-c", script, "--name", name, "-t", "1", (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", shoal, strerror(errno));
    _exit(127);
}

static void stop_nodes(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++)
        if (pids[i] > 0)
            kill(pids[i], SIGTERM);
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) {
            int st;
            waitpid(pids[i], &st, 0);
            pids[i] = 0;
        }
}

static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "fault_harness: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *shoal = NULL, *model = getenv("SHOAL_MODEL"), *keep = NULL;
    int n_req = 8, max_tokens = 16;
    double drop = 0.1, worker_drop = 0.02;
    int delay_ms = 20;
    unsigned long long seed = 7;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "fault_harness: option '%s' needs a value\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--shoal") == 0)
            shoal = v;
        else if (strcmp(argv[i], "-m") == 0)
            model = v;
        else if (strcmp(argv[i], "--requests") == 0)
            n_req = atoi(v);
        else if (strcmp(argv[i], "--max-tokens") == 0)
            max_tokens = atoi(v);
        else if (strcmp(argv[i], "--drop") == 0)
            drop = atof(v);
        else if (strcmp(argv[i], "--worker-drop") == 0)
            worker_drop = atof(v);
        else if (strcmp(argv[i], "--delay-ms") == 0)
            delay_ms = atoi(v);
        else if (strcmp(argv[i], "--seed") == 0)
            seed = strtoull(v, NULL, 10);
        else if (strcmp(argv[i], "--keep") == 0)
            keep = v;
        else {
            fprintf(stderr, "fault_harness: unknown option '%s'\n", argv[i]);
            return 2;
        }
        i++;
    }
    if (!shoal || !model || model[0] != '/' || n_req < 1 || n_req > MAX_REQ || max_tokens < 1 ||
        drop < 0 || drop > 0.5 || worker_drop < 0 || worker_drop > 0.5 || delay_ms < 0) {
        fprintf(stderr, "usage: fault_harness --shoal PATH/bin/shoal -m /ABSOLUTE/MODEL.gguf "
                        "[--requests 1-64] [--max-tokens T] [--drop 0-0.5] [--worker-drop 0-0.5] "
                        "[--delay-ms D] "
                        "[--seed S] [--keep DIR]\n");
        return 2;
    }

    char dir[256], path[512], scenario[512], text[2048];
    if (keep) {
        snprintf(dir, sizeof dir, "%s", keep);
    } else {
        snprintf(dir, sizeof dir, "/tmp/shoal-harness.XXXXXX");
        if (!mkdtemp(dir)) {
            perror("fault_harness: mkdtemp");
            return 1;
        }
    }
    snprintf(path, sizeof path, "%s/cluster.lua", dir);
    snprintf(text, sizeof text,
             "local m = model { path = '%s', name = 'harness' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'front', listen = 'ipc://%s/front.sock' },\n"
             "            node { name = 'w0', listen = 'ipc://%s/w0.sock' },\n"
             "            node { name = 'w1', listen = 'ipc://%s/w1.sock' } },\n"
             "  gateway = { node = 'front', http = '127.0.0.1:%d' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) } },\n"
             "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
             "  kv = { memory = '64MiB' },\n"
             "}\n",
             model, dir, dir, dir, 20000 + (int)(getpid() % 20000));
    snprintf(scenario, sizeof scenario, "%s/workers.lua", dir);
    char scen[256];
    snprintf(scen, sizeof scen, "at(0, drop { link = \"*\", p = %g })\n", worker_drop);
    if (write_file(path, text) || write_file(scenario, scen))
        return 1;

    /* Phase 1 on clean links, phase 2 with faults: each with its own workers, since the
     * workers' scenario is given at their start. */
    static run clean, faulty;
    pid_t pids[N_WORKERS] = {0, 0};
    int rc = 0;
    for (int phase = 1; phase <= 2 && rc == 0; phase++) {
        const char *names[N_WORKERS] = {"w0", "w1"};
        for (int w = 0; w < N_WORKERS; w++) {
            char log[600];
            snprintf(log, sizeof log, "%s/%s.phase%d.log", dir, names[w], phase);
            pids[w] = start_node(shoal, path, names[w], phase == 2 ? scenario : NULL, log);
            if (pids[w] < 0) {
                perror("fault_harness: fork");
                rc = 1;
            }
        }
        sh_engine_opts o = sh_engine_opts_default();
        o.cluster_script = path;
        sh_engine *eng = NULL;
        sh_error err;
        if (rc == 0 && sh_engine_open(&o, &eng, &err) != SH_OK) {
            fprintf(stderr, "fault_harness: cannot open an engine on the cluster script: %s: %s\n",
                    sh_strerror(err.code), err.msg);
            rc = (err.code == SH_EUNSUPPORTED || err.code == SH_EINVAL) ? 77 : 1;
        }
        if (rc == 0 && phase == 2) {
            sh_fault *f = sh_engine_fault(eng);
            sh_fault_rule r;
            memset(&r, 0, sizeof r);
            r.action = SH_FAULT_ACTION_DROP;
            r.p = drop;
            uint64_t rid;
            if (!f || sh_fault_rule_add(f, &r, &rid, &err) != SH_OK) {
                fprintf(stderr, "fault_harness: adding the drop rule: %s\n",
                        f ? err.msg : "no fault layer");
                rc = 1;
            }
            memset(&r, 0, sizeof r);
            r.action = SH_FAULT_ACTION_DELAY;
            r.p = 0.5;
            r.delay_ms = (uint32_t)delay_ms;
            if (rc == 0 && sh_fault_rule_add(f, &r, &rid, &err) != SH_OK) {
                fprintf(stderr, "fault_harness: adding the delay rule: %s\n", err.msg);
                rc = 1;
            }
            if (rc == 0)
                sh_fault_reseed(f, seed);
        }
        if (rc == 0) {
            run *rn = phase == 1 ? &clean : &faulty;
            double t0 = now_s();
            int lost = run_requests(eng, rn, n_req, max_tokens, 300.0);
            printf("phase %d (%s): %d requests in %.1f s\n", phase,
                   phase == 1 ? "clean links" : "faults", rn->n, now_s() - t0);
            if (lost) {
                for (int i = 0; i < rn->n; i++)
                    if (rn->r[i].finals != 1)
                        fprintf(stderr, "FAIL: request %llu had %d final callbacks\n",
                                (unsigned long long)rn->r[i].id, rn->r[i].finals);
                rc = 1;
            }
            if (rn->unknown) {
                fprintf(stderr, "FAIL: %d callbacks for unknown ids\n", rn->unknown);
                rc = 1;
            }
            for (int i = 0; i < rn->n; i++)
                if (rn->r[i].finals == 1 && !rn->r[i].ok) {
                    fprintf(stderr, "FAIL: request %llu ended with an error: %s\n",
                            (unsigned long long)rn->r[i].id, rn->r[i].error);
                    rc = 1;
                }
            if (phase == 2) {
                sh_fault_stats st;
                sh_fault_stats_get(sh_engine_fault(eng), &st);
                printf("front's fault layer: %llu messages seen, %llu dropped, %llu delayed\n",
                       (unsigned long long)st.seen, (unsigned long long)st.dropped,
                       (unsigned long long)st.delayed);
                if (st.dropped == 0 && drop > 0) {
                    fprintf(stderr, "FAIL: no message was dropped: the run proves nothing "
                                    "(raise --drop or --requests)\n");
                    rc = 1;
                }
                for (int i = 0; i < rn->n && i < clean.n; i++) {
                    const req *a = &clean.r[i], *b = &rn->r[i];
                    if (strcmp(a->text, b->text) != 0 || a->tokens != b->tokens) {
                        fprintf(stderr,
                                "FAIL: request %d differs under faults:\n  clean: %s\n"
                                "  fault: %s\n",
                                i, a->text, b->text);
                        rc = 1;
                    }
                }
            }
        }
        sh_err crc = sh_engine_close(eng);
        if (crc != SH_OK) {
            fprintf(stderr, "fault_harness: close: %s\n", sh_strerror(crc));
            rc = rc ? rc : 1;
        }
        stop_nodes(pids, N_WORKERS);
    }
    if (rc == 0)
        printf("fault_harness: every request got exactly one final callback and finished with "
               "the clean run's text\n");
    else if (rc != 77)
        fprintf(stderr, "fault_harness: logs in %s\n", dir);
    if (!keep && (rc == 0 || rc == 77)) {
        const char *files[] = {"cluster.lua",   "workers.lua",   "w0.phase1.log",
                               "w1.phase1.log", "w0.phase2.log", "w1.phase2.log"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, files[i]);
            unlink(path);
        }
        rmdir(dir);
    }
    return rc;
}
