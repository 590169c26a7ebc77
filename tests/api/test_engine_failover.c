/* The embedding engine as the front of a real cluster that loses a worker (issue 25): `shoal node`
 * worker processes hold the model's two pipeline stages, one is killed with SIGKILL while requests
 * generate, and the engine's supervisor recovers as `shoal serve -c` does: a standby takes the
 * dead node's place, or the node restarted rejoins: no request is lost and every greedy output
 * equals the undisturbed run's. When nothing replaces it, every request ends with on_error
 * (SH_EIO) after the wait (opts.recover_timeout_ms) and new ones are refused. After a recovery
 * the front computes an embedding (sh_request_opts.embed: the last stage's node pools) equal to
 * the one the model in this process gives, within 1e-5. */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sh_test.h"
#include "shoal.h"

#define MODEL "tests/data/stories260K/stories260K.gguf"
#define N_REQ 4
#define MAX_TOKENS 96
#define MAX_IDS 512
#define EMB_TEXT "Once upon a time there was a little dog who liked the park"
#define EMB_MAX 256
#define RUN_ALL_POLLS 12000 /* 10 ms each: 120 s, past the front's 30 s wait for a lost node */

typedef struct seen {
    int32_t ids[MAX_IDS];
    int32_t n_ids;
    int n_done, n_error;
    sh_err code;
    char msg[256];
    float emb[EMB_MAX];
    int32_t n_emb;
} seen;

static seen emb_want; /* the embedding of EMB_TEXT by the model in this process */

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    (void)id;
    seen *s = user;
    for (int32_t i = 0; i < ev->n_ids && s->n_ids < MAX_IDS; i++)
        s->ids[s->n_ids++] = ev->ids[i];
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    (void)id;
    seen *s = user;
    s->n_done++;
    if (info->embedding && info->n_embedding <= EMB_MAX) {
        memcpy(s->emb, info->embedding, (size_t)info->n_embedding * sizeof(float));
        s->n_emb = info->n_embedding;
    }
}

static void on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    seen *s = user;
    s->n_error++;
    s->code = code;
    snprintf(s->msg, sizeof s->msg, "%s", msg);
}

static const sh_callbacks CB = {on_token, on_done, on_error};

/* The engine's log lines, kept to find the supervisor's (any thread writes them). */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_text[1 << 16];
static size_t log_len;

static void log_line(void *user, int level, const char *line)
{
    (void)user;
    (void)level;
    pthread_mutex_lock(&log_mu);
    int n = snprintf(log_text + log_len, sizeof log_text - log_len, "%s\n", line);
    if (n > 0 && log_len + (size_t)n < sizeof log_text)
        log_len += (size_t)n;
    pthread_mutex_unlock(&log_mu);
}

static bool log_has(const char *what)
{
    pthread_mutex_lock(&log_mu);
    bool has = strstr(log_text, what) != NULL;
    pthread_mutex_unlock(&log_mu);
    return has;
}

static void submit(sh_engine *eng, seen *s)
{
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = MAX_TOKENS;
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, &r, &CB, s, &id, &e);
    if (rc)
        fprintf(stderr, "submit: %s\n", e.msg);
    CHECK_OK(rc);
}

/* Polls until every request of eng is over (or 120 s pass). */
static void run_all(sh_engine *eng)
{
    for (int i = 0; i < RUN_ALL_POLLS && sh_pending(eng) > 0; i++)
        CHECK_OK(sh_poll(eng, 10, NULL));
    CHECK_INT_EQ(sh_pending(eng), 0);
}

static void submit_embed(sh_engine *eng, seen *s)
{
    sh_request_opts r = sh_request_opts_default();
    r.prompt = EMB_TEXT;
    r.embed = true;
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, &r, &CB, s, &id, &e);
    if (rc)
        fprintf(stderr, "submit (embed): %s\n", e.msg);
    CHECK_OK(rc);
}

/* The undisturbed run: the model in this process (and its embedding of EMB_TEXT). */
static bool reference(seen *want)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = 1;
    sh_engine *eng = NULL;
    CHECK_OK(sh_engine_open(&o, &eng, NULL));
    if (!eng)
        return false;
    memset(want, 0, sizeof *want);
    submit(eng, want);
    memset(&emb_want, 0, sizeof emb_want);
    submit_embed(eng, &emb_want);
    run_all(eng);
    CHECK_INT_EQ(emb_want.n_done, 1);
    CHECK_INT_EQ(emb_want.n_emb, 64);
    CHECK_OK(sh_engine_close(eng));
    CHECK_INT_EQ(want->n_done, 1);
    CHECK(want->n_ids > 8);
    return want->n_done == 1 && want->n_ids > 8;
}

static pid_t start_node(const char *path, const char *name)
{
    const char *shoal = getenv("SH_SHOAL");
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execl(shoal, shoal, "node", "-c", path, "--name", name, "-t", "1", (char *)NULL);
        _exit(127);
    }
    CHECK(pid > 0);
    return pid;
}

static void stop_node(pid_t pid)
{
    if (pid <= 0)
        return;
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The nodes front, w0 and w1 (the pipeline's two stages) and, with standby, a hot standby
 * "spare" preloading w1's stage. Workers are started, the engine opened on the script (with
 * recover_ms as opts.recover_timeout_ms); once the first tokens came, w1 is killed with SIGKILL
 * (and with restart, started again); every request must then end with on_done and the
 * reference's tokens, and the log must say how it recovered (`expect`). With want NULL, nothing
 * replaces w1: after the wait every request must end with on_error SH_EIO and a new one be
 * refused with SH_EIO; returns the seconds from the kill to the last request's end. */
static double failover(const seen *want, bool standby, bool restart, int32_t recover_ms,
                       const char *expect)
{
    double took = -1;
    char dir[] = "/tmp/shoal-engine-failover-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[128], src[2048];
    snprintf(path, sizeof path, "%s/c.lua", dir);
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'front', listen = 'ipc://%s/front' },\n"
             "            node { name = 'w0', listen = 'ipc://%s/w0' },\n"
             "            node { name = 'w1', listen = 'ipc://%s/w1' }%s%s%s },\n"
             "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) } },\n"
             "  batcher = { max_seqs = 4 },\n"
             "  kv = { memory = '4MiB' },\n"
             "}\n",
             sh_test_path(MODEL), dir, dir, dir,
             standby ? ",\n            node { name = 'spare', listen = 'ipc://" : "",
             standby ? dir : "", standby ? "/spare', standby = true, preload = 'w1' }" : "");
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f)
        return took;
    fputs(src, f);
    fclose(f);
    pid_t w0 = start_node(path, "w0"), w1 = start_node(path, "w1");
    pid_t spare = standby ? start_node(path, "spare") : 0;
    pthread_mutex_lock(&log_mu);
    log_len = 0;
    log_text[0] = '\0';
    pthread_mutex_unlock(&log_mu);
    sh_engine_opts o = sh_engine_opts_default();
    o.cluster_script = path;
    o.log = log_line;
    o.recover_timeout_ms = recover_ms;
    sh_engine *eng = NULL;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s\n", e.msg);
    CHECK_OK(rc);
    if (eng) {
        static seen s[N_REQ];
        for (int i = 0; i < N_REQ; i++) {
            memset(&s[i], 0, sizeof s[i]);
            submit(eng, &s[i]);
        }
        // The kill comes while every request still generates: after the first tokens.
        int got = 0;
        for (int i = 0; i < 3000 && !got; i++) {
            CHECK_OK(sh_poll(eng, 10, NULL));
            for (int j = 0; j < N_REQ; j++)
                got |= s[j].n_ids > 0;
        }
        CHECK(got);
        int over = 0;
        for (int j = 0; j < N_REQ; j++)
            over += s[j].n_done + s[j].n_error;
        CHECK_INT_EQ(over, 0); /* else the kill tests nothing */
        kill(w1, SIGKILL);
        double t_kill = mono_s();
        int st = 0;
        waitpid(w1, &st, 0);
        w1 = 0;
        if (restart) {
            sleep_ms(300); /* judged dead first: the new process is another one */
            w1 = start_node(path, "w1");
        }
        run_all(eng);
        took = mono_s() - t_kill;
        for (int j = 0; !want && j < N_REQ; j++) {
            CHECK_INT_EQ(s[j].n_done, 0);
            CHECK_INT_EQ(s[j].n_error, 1);
            CHECK_INT_EQ(s[j].code, SH_EIO);
            CHECK(strstr(s[j].msg, "node w1") != NULL);
        }
        if (!want) {
            sh_request_opts r = sh_request_opts_default();
            r.prompt = "Once upon a time";
            uint64_t id = 0;
            sh_error e2 = {0};
            CHECK_INT_EQ(sh_submit(eng, &r, &CB, &s[0], &id, &e2), SH_EIO);
            CHECK(strstr(e2.msg, expect) != NULL);
        }
        for (int j = 0; want && j < N_REQ; j++) {
            if (s[j].n_error)
                fprintf(stderr, "request %d: error %d: %s\n", j, (int)s[j].code, s[j].msg);
            CHECK_INT_EQ(s[j].n_done, 1);
            CHECK_INT_EQ(s[j].n_ids, want->n_ids);
            CHECK(memcmp(s[j].ids, want->ids, (size_t)want->n_ids * 4) == 0);
        }
        if (want) { /* the recovered front embeds as the model in this process */
            static seen es;
            memset(&es, 0, sizeof es);
            submit_embed(eng, &es);
            run_all(eng);
            CHECK_INT_EQ(es.n_done, 1);
            CHECK_INT_EQ(es.n_emb, emb_want.n_emb);
            double worst = 0;
            for (int32_t j = 0; j < es.n_emb && j < emb_want.n_emb; j++)
                worst = fmax(worst, fabs((double)es.emb[j] - (double)emb_want.emb[j]));
            fprintf(stderr, "embedding through the front: largest |diff| %.3g\n", worst);
            CHECK(worst <= 1e-5);
        }
        if (!log_has(expect)) {
            pthread_mutex_lock(&log_mu);
            fprintf(stderr, "log lacks \"%s\":\n%s", expect, log_text);
            pthread_mutex_unlock(&log_mu);
        }
        CHECK(log_has(expect));
        CHECK_OK(sh_engine_close(eng));
    }
    stop_node(w0);
    stop_node(w1);
    stop_node(spare);
    unlink(path);
    static const char *const names[] = {"front", "w0", "w1", "spare"};
    for (int i = 0; i < 4; i++) {
        char sock[160];
        snprintf(sock, sizeof sock, "%s/%s", dir, names[i]);
        unlink(sock);
    }
    rmdir(dir);
    return took;
}

/* A hot standby replaces the killed last stage's node. */
static void test_standby(void)
{
    seen want;
    if (reference(&want))
        failover(&want, true, false, 0, "node w1 was replaced by standby spare in");
}

/* Nothing replaces the killed node: the front fails stop after its wait, here 2 s
 * (opts.recover_timeout_ms): well before the default 30 s. */
static void test_fail_stop(void)
{
    double took = failover(NULL, false, false, 2000,
                           "did not come back within 2.0 s (opts.recover_timeout_ms)");
    fprintf(stderr, "fail_stop: the requests failed %.2f s after the kill\n", took);
    CHECK(took >= 1.5);
    CHECK(took < 15.0);
}

/* recover_timeout_ms -1: no wait; the requests fail as soon as the death is seen. */
static void test_no_wait(void)
{
    double took = failover(NULL, false, false, -1, "was lost");
    fprintf(stderr, "no_wait: the requests failed %.2f s after the kill\n", took);
    CHECK(took >= 0);
    CHECK(took < 1.5);
}

/* Values out of range fail the open with SH_EINVAL naming the option (checked before any node
 * is contacted), for a cluster script and for a model alike. */
static void test_bad_recover_timeout(void)
{
    static const int32_t bad[] = {-2, 3600001, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sh_engine_opts o = sh_engine_opts_default();
        o.cluster_script = "/nonexistent/cluster.lua";
        o.recover_timeout_ms = bad[i];
        sh_engine *eng = (sh_engine *)&o;
        sh_error e = {0};
        CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_EINVAL);
        CHECK(eng == NULL);
        CHECK_INT_EQ(e.code, SH_EINVAL);
        CHECK(strstr(e.msg, "opts.recover_timeout_ms") != NULL);
        o.cluster_script = NULL;
        o.model_path = sh_test_path(MODEL);
        CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "opts.recover_timeout_ms") != NULL);
    }
}

/* Without a standby the replica waits for the node; restarted, it rejoins as a new process. */
static void test_rejoin(void)
{
    seen want;
    if (reference(&want))
        failover(&want, false, true, 0, "node w1 came back");
}

int main(int argc, char **argv)
{
    FILE *f = fopen(sh_test_path(MODEL), "rb");
    if (!f || !getenv("SH_SHOAL")) {
        if (f)
            fclose(f);
        fprintf(stderr, "skipped: %s absent or SH_SHOAL unset\n", MODEL);
        return SH_TEST_SKIP;
    }
    fclose(f);
    signal(SIGPIPE, SIG_IGN);
    static const sh_test_case tests[] = {{"standby", test_standby},
                                         {"rejoin", test_rejoin},
                                         {"fail_stop", test_fail_stop},
                                         {"no_wait", test_no_wait},
                                         {"bad_recover_timeout", test_bad_recover_timeout},
                                         {NULL, NULL}};
    return sh_test_main(argc, argv, tests);
}
