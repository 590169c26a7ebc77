/* The embedding engine as the front of a real cluster whose replica drafts on a node of its own
 * (replica{ drafter = ... }, docs/cluster.md): `shoal node` worker processes hold the model's two
 * pipeline stages and the drafter, over ipc://. Greedy outputs of several prompts, one by one and
 * all at once, equal the same cluster's without a drafter token for token, with a draft model file
 * (the model drafting for itself) and with self-speculation (self = 3: the model's first 3 of 5
 * layers and its head); the front's batcher counts drafted and accepted tokens. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sh_test.h"
#include "shoal.h"

#define MODEL "tests/data/stories260K/stories260K.gguf"
#define N_PROMPTS 4
#define MAX_TOKENS 48
#define MAX_IDS 256

static const char *const PROMPTS[N_PROMPTS] = {"Once upon a time",
                                               "The little dog ran to the park and",
                                               "Lily and Tom were friends.", "One day, a big bird"};

typedef struct seen {
    int32_t ids[MAX_IDS];
    int32_t n_ids;
    int n_done, n_error;
    char msg[256];
} seen;

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
    (void)info;
    ((seen *)user)->n_done++;
}

static void on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    seen *s = user;
    s->n_error++;
    snprintf(s->msg, sizeof s->msg, "%s (%s)", msg, sh_strerror(code));
}

static const sh_callbacks CB = {on_token, on_done, on_error};

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* A worker node of the script: a real `shoal node` process, its output in dir/name.log. */
static pid_t start_node(const char *dir, const char *path, const char *name)
{
    const char *shoal = getenv("SH_SHOAL");
    char log[160];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(shoal, shoal, "node", "-c", path, "--name", name, "-t", "1", (char *)NULL);
        _exit(127);
    }
    CHECK(pid > 0);
    return pid;
}

/* SIGTERM; the node must exit 0. */
static void stop_node(pid_t pid, const char *dir, const char *name)
{
    if (pid <= 0)
        return;
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    char log[160];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || sh_test_failures_) {
        char line[512];
        FILE *f = fopen(log, "r");
        fprintf(stderr, "  node %s's log:\n", name);
        while (f && fgets(line, sizeof line, f))
            fprintf(stderr, "    %s", line);
        if (f)
            fclose(f);
    }
    unlink(log);
}

/* The value of the first series of metric `name` in a Prometheus text, or -1. */
static double metric(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n) {
        if ((p != text && p[-1] != '\n') || (p[n] != ' ' && p[n] != '{'))
            continue;
        const char *v = strchr(p, ' ');
        return v ? atof(v + 1) : -1;
    }
    return -1;
}

static void submit(sh_engine *eng, const char *prompt, seen *s)
{
    memset(s, 0, sizeof *s);
    sh_request_opts r = sh_request_opts_default();
    r.prompt = prompt;
    r.max_tokens = MAX_TOKENS;
    r.ignore_eos = true;
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, &r, &CB, s, &id, &e);
    if (rc)
        fprintf(stderr, "submit: %s\n", e.msg);
    CHECK_OK(rc);
}

static void run_all(sh_engine *eng)
{
    for (int i = 0; i < 12000 && sh_pending(eng) > 0; i++) /* 10 ms each: 120 s */
        CHECK_OK(sh_poll(eng, 10, NULL));
    CHECK_INT_EQ(sh_pending(eng), 0);
}

/* Runs a cluster of front, w0, w1 (two pipeline stages) and, with drafter (the replica's
 * drafter = {...} fields), the drafter node d0: each prompt alone, then all at once, into
 * one[] and many[]. With drafter, the front's batcher must have drafted and had drafts accepted.
 * Returns whether the engine opened. */
static bool run_cluster(const char *drafter, seen *one, seen *many)
{
    char dir[] = "/tmp/shoal-engine-drafter-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[128], dnode[160] = "", dfield[160] = "", src[2048];
    snprintf(path, sizeof path, "%s/c.lua", dir);
    if (drafter) {
        snprintf(dnode, sizeof dnode, ",\n            node { name = 'd0', listen = 'ipc://%s/d0' }",
                 dir);
        snprintf(dfield, sizeof dfield, ",\n    drafter = { node = 'd0', %s }", drafter);
    }
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'front', listen = 'ipc://%s/front' },\n"
             "            node { name = 'w0', listen = 'ipc://%s/w0' },\n"
             "            node { name = 'w1', listen = 'ipc://%s/w1' }%s },\n"
             "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' })%s } },\n"
             "  batcher = { max_seqs = 8, spec_k = 4 },\n"
             "  kv = { memory = '4MiB' },\n"
             "}\n",
             sh_test_path(MODEL), dir, dir, dir, dnode, dfield);
    write_text(path, src);
    static const char *const names[] = {"w0", "w1", "d0"};
    int n_nodes = drafter ? 3 : 2;
    pid_t pids[3] = {0};
    for (int i = 0; i < n_nodes; i++)
        pids[i] = start_node(dir, path, names[i]);
    sh_engine_opts o = sh_engine_opts_default();
    o.cluster_script = path;
    sh_engine *eng = NULL;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s\n", e.msg);
    CHECK_OK(rc);
    if (eng) {
        for (int i = 0; i < N_PROMPTS; i++) {
            submit(eng, PROMPTS[i], &one[i]);
            run_all(eng);
        }
        for (int i = 0; i < N_PROMPTS; i++)
            submit(eng, PROMPTS[i], &many[i]);
        run_all(eng);
        for (int i = 0; i < N_PROMPTS; i++) {
            CHECK_INT_EQ(one[i].n_done + many[i].n_done, 2);
            CHECK_INT_EQ(one[i].n_error + many[i].n_error, 0);
            if (one[i].n_error + many[i].n_error)
                fprintf(stderr, "  prompt %d: %s%s\n", i, one[i].msg, many[i].msg);
            CHECK_INT_EQ(one[i].n_ids, MAX_TOKENS);
        }
        static char text[1 << 17];
        size_t len = 0;
        CHECK_OK(sh_metrics_snapshot(eng, text, sizeof text, &len));
        double drafted = metric(text, "shoal_spec_draft_tokens_total");
        double accepted = metric(text, "shoal_spec_accepted_tokens_total");
        fprintf(stderr, "  %s: %.0f tokens drafted, %.0f accepted\n",
                drafter ? drafter : "no drafter", drafted, accepted);
        if (drafter) {
            CHECK(drafted > 0);
            CHECK(accepted > 0);
        } else {
            CHECK(drafted <= 0); /* absent or 0 */
        }
        CHECK_OK(sh_engine_close(eng));
    }
    for (int i = 0; i < n_nodes; i++)
        stop_node(pids[i], dir, names[i]);
    unlink(path);
    char sock[160];
    static const char *const socks[] = {"front", "w0", "w1", "d0"};
    for (int i = 0; i < 4; i++) {
        snprintf(sock, sizeof sock, "%s/%s", dir, socks[i]);
        unlink(sock);
    }
    rmdir(dir);
    return eng != NULL;
}

static void check_same(const seen *want, const seen *got, const char *what)
{
    for (int i = 0; i < N_PROMPTS; i++) {
        CHECK_INT_EQ(got[i].n_ids, want[i].n_ids);
        bool same = got[i].n_ids == want[i].n_ids &&
                    memcmp(got[i].ids, want[i].ids, (size_t)want[i].n_ids * 4) == 0;
        if (!same) {
            fprintf(stderr,
                    "  %s, prompt %d (%s): the tokens differ from the cluster's without "
                    "a drafter\n",
                    what, i, PROMPTS[i]);
            for (int32_t j = 0; j < want[i].n_ids && j < got[i].n_ids; j++)
                if (want[i].ids[j] != got[i].ids[j]) {
                    fprintf(stderr, "    first at %d: %d vs %d\n", (int)j, (int)want[i].ids[j],
                            (int)got[i].ids[j]);
                    break;
                }
        }
        CHECK(same);
    }
}

static seen want_one[N_PROMPTS], want_many[N_PROMPTS];
static bool have_want;

static bool reference(void)
{
    if (!have_want) {
        have_want = run_cluster(NULL, want_one, want_many);
        // Alone or beside others, a greedy sequence's tokens are the same.
        if (have_want)
            check_same(want_one, want_many, "no drafter, all at once");
    }
    return have_want;
}

static void drafter_case(const char *drafter)
{
    if (!reference())
        return;
    static seen one[N_PROMPTS], many[N_PROMPTS];
    if (!run_cluster(drafter, one, many))
        return;
    check_same(want_one, one, "one by one");
    check_same(want_one, many, "all at once");
}

/* The model's own file as the draft: every draft it makes is the target's pick. */
static void test_draft_file(void)
{
    char f[512];
    snprintf(f, sizeof f, "model = '%s'", sh_test_path(MODEL));
    drafter_case(f);
}

/* Self-speculation: the first 3 of the model's 5 layers and its head draft. */
static void test_self(void) { drafter_case("self = 3"); }

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
    static const sh_test_case tests[] = {
        {"draft_file", test_draft_file}, {"self", test_self}, {NULL, NULL}};
    return sh_test_main(argc, argv, tests);
}
