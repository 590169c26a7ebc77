/* End-to-end tests of `shoal bench` as a real process (SH_SHOAL): bad options give exit code 2;
 * a port where nothing listens fails every request quickly (exit 1); runs against a small
 * OpenAI-compatible responder in this file check the report's counts and its JSON.
 *
 * Each run against a server goes through check_run(), which takes the server's URL, so that a
 * case against the real `shoal serve` (start it, wait for its port, check_run, stop it) can sit
 * next to the fixture's cases. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sh_test.h"

#define RUN_LIMIT_S 30 /* any one shoal run; past it the test kills the process and fails */

static char out_buf[1 << 16], err_buf[1 << 16];
static char tmpdir[256];
static double last_run_s; /* wall time of the latest shoal() */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = 0;
    if (f) {
        n = fread(buf, 1, cap - 1, f);
        fclose(f);
    }
    buf[n] = '\0';
    return n;
}

/* Runs `shoal bench ARGS` (args NULL-terminated, without "bench"), stdout and stderr captured
 * into out_buf / err_buf. Returns the exit code; -1 when it did not exit by itself within
 * RUN_LIMIT_S (it is then killed). */
static int shoal(const char *const *args)
{
    const char *bin = getenv("SH_SHOAL");
    char out_path[300], err_path[300];
    snprintf(out_path, sizeof out_path, "%s/out", tmpdir);
    snprintf(err_path, sizeof err_path, "%s/err", tmpdir);
    const char *argv[48];
    int n = 0;
    argv[n++] = bin;
    argv[n++] = "bench";
    for (int i = 0; args[i] && n < 47; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    double t0 = now_s();
    pid_t pid = fork();
    if (pid == 0) {
        int fi = open("/dev/null", O_RDONLY);
        int fo = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fe = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fi < 0 || fo < 0 || fe < 0)
            _exit(127);
        dup2(fi, 0);
        dup2(fo, 1);
        dup2(fe, 2);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    if (pid < 0)
        return -1;
    int status = 0;
    bool exited = false;
    while (!exited && now_s() - t0 < RUN_LIMIT_S) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        exited = r == pid;
        if (!exited)
            usleep(10000);
    }
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        SH_FAIL_("shoal bench ran past %d s", RUN_LIMIT_S);
    }
    last_run_s = now_s() - t0;
    slurp(out_path, out_buf, sizeof out_buf);
    slurp(err_path, err_buf, sizeof err_buf);
    return exited && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

#define CHECK_CONTAINS(hay, needle)                                                                \
    do {                                                                                           \
        if (!strstr((hay), (needle)))                                                              \
            SH_FAIL_("\"%s\" not found in:\n%s", (needle), (hay));                                 \
    } while (0)

/* Exit code 2 and stderr exactly one line starting with "error: ". */
#define CHECK_USAGE_ERROR(...)                                                                     \
    do {                                                                                           \
        const char *args_[] = {__VA_ARGS__, NULL};                                                 \
        int rc_ = shoal(args_);                                                                    \
        CHECK_INT_EQ(rc_, 2);                                                                      \
        if (strncmp(err_buf, "error: ", 7) != 0 || count_lines(err_buf) != 1)                      \
            SH_FAIL_("stderr is not one error line: \"%s\"", err_buf);                             \
    } while (0)

/* ---------------------------------------------------------------------------------------------
 * The fixture: an OpenAI-compatible responder on 127.0.0.1, a thread per connection, keep-alive.
 * Completions and chat stream `max_tokens` events of one word each (every event split across
 * two chunks and two writes, so the client has to reassemble it), then a usage event and
 * `data: [DONE]`; without "stream" it answers one JSON body with Content-Length.
 * ------------------------------------------------------------------------------------------- */

enum fx_mode {
    FX_CHUNKED = 0, /* chunked event stream */
    FX_CLOSE,       /* event stream delimited by closing the connection (no length, no chunks) */
    FX_HANGUP,      /* two events, then the connection is closed mid-stream */
    FX_STALL,       /* reads the request and never answers */
    FX_ONESHOT,     /* chunked event stream; the connection's next request closes it unanswered */
};

static int fx_fd = -1, fx_port;
static pthread_t fx_thread;
static atomic_int fx_mode, fx_fail_every, fx_no_usage, fx_requests, fx_conns, fx_stop;

static bool fx_send(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static bool fx_sendf(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fx_sendf(int fd, const char *fmt, ...)
{
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return n > 0 && (size_t)n < sizeof buf && fx_send(fd, buf, (size_t)n);
}

/* One piece of the body: a chunk in chunked mode, raw bytes otherwise. */
static bool fx_piece(int fd, bool chunked, const char *p, size_t n)
{
    if (chunked && !fx_sendf(fd, "%zx\r\n", n))
        return false;
    return fx_send(fd, p, n) && (!chunked || fx_send(fd, "\r\n", 2));
}

static int count_words(const char *s)
{
    int n = 0;
    for (bool in = false; s && *s; s++) {
        bool space = *s == ' ';
        n += !space && !in;
        in = !space;
    }
    return n;
}

/* Answers one request; returns false when the connection is to be closed. */
static bool fx_answer(int fd, const char *method, const char *path, const char *body, size_t len)
{
    if (!strcmp(method, "GET") && !strcmp(path, "/v1/models")) {
        const char *j =
            "{\"object\":\"list\",\"data\":[{\"id\":\"fake-model\",\"object\":\"model\"}]}";
        return fx_sendf(fd,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        "Content-Length: %zu\r\n\r\n%s",
                        strlen(j), j);
    }
    bool chat = !strcmp(path, "/v1/chat/completions");
    if (strcmp(method, "POST") != 0 || (!chat && strcmp(path, "/v1/completions") != 0)) {
        const char *j = "{\"error\":{\"message\":\"no such route\"}}";
        return fx_sendf(fd, "HTTP/1.1 404 Not Found\r\nContent-Length: %zu\r\n\r\n%s", strlen(j),
                        j);
    }
    json_t *req = json_loadb(body, len, 0, NULL);
    int max_tokens = (int)json_integer_value(json_object_get(req, "max_tokens"));
    bool stream = json_is_true(json_object_get(req, "stream"));
    int prompt_tokens = count_words(json_string_value(json_object_get(req, "prompt")));
    json_t *msgs = json_object_get(req, "messages");
    for (size_t i = 0; i < json_array_size(msgs); i++)
        prompt_tokens +=
            count_words(json_string_value(json_object_get(json_array_get(msgs, i), "content")));
    json_decref(req);
    int k = atomic_fetch_add(&fx_requests, 1) + 1, mode = atomic_load(&fx_mode);
    int fail_every = atomic_load(&fx_fail_every);
    if (fail_every && k % fail_every == 0) {
        const char *j = "{\"error\":{\"message\":\"fake overload\",\"type\":\"server_error\"}}";
        return fx_sendf(fd,
                        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        "Content-Length: %zu\r\n\r\n%s",
                        strlen(j), j);
    }
    if (mode == FX_STALL) {
        char c;
        while (recv(fd, &c, 1, 0) > 0) // until the client gives up
            ;
        return false;
    }
    char usage[160];
    snprintf(usage, sizeof usage,
             "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}",
             prompt_tokens, max_tokens, prompt_tokens + max_tokens);
    if (!stream) {
        char j[8192];
        int n = snprintf(j, sizeof j,
                         "{\"id\":\"x\",\"choices\":[{\"index\":0,%s,\"finish_reason\":"
                         "\"length\"}],%s}",
                         chat ? "\"message\":{\"role\":\"assistant\",\"content\":\"w\"}"
                              : "\"text\":\"w\"",
                         usage);
        return fx_sendf(fd,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        "Content-Length: %d\r\n\r\n%s",
                        n, j);
    }
    bool chunked = mode != FX_CLOSE;
    if (!fx_sendf(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%s\r\n",
                  chunked ? "Transfer-Encoding: chunked\r\n" : "Connection: close\r\n"))
        return false;
    char ev[512];
    // A comment, and (chat) a role-only delta: neither carries a token.
    int n = snprintf(ev, sizeof ev, ": ping\n\n");
    if (chat)
        n += snprintf(ev + n, sizeof ev - (size_t)n,
                      "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n");
    if (!fx_piece(fd, chunked, ev, (size_t)n))
        return false;
    for (int i = 0; i < max_tokens; i++) {
        if (mode == FX_HANGUP && i == 2)
            return false;
        n = snprintf(ev, sizeof ev, "data: {\"id\":\"x\",\"choices\":[{\"index\":0,%s}]}\r\n\r\n",
                     chat ? "\"delta\":{\"content\":\" w\"}" : "\"text\":\" w\"");
        size_t half = (size_t)n / 2;
        if (!fx_piece(fd, chunked, ev, half))
            return false;
        usleep(1000);
        if (!fx_piece(fd, chunked, ev + half, (size_t)n - half))
            return false;
    }
    if (!atomic_load(&fx_no_usage)) {
        n = snprintf(ev, sizeof ev, "data: {\"choices\":[],%s}\n\n", usage);
        if (!fx_piece(fd, chunked, ev, (size_t)n))
            return false;
    }
    if (!fx_piece(fd, chunked, "data: [DONE]\n\n", 14))
        return false;
    return chunked && fx_send(fd, "0\r\n\r\n", 5);
}

static void *fx_conn_main(void *arg)
{
    int fd = (int)(intptr_t)arg;
    enum { CAP = 1 << 20 };
    char *buf = malloc(CAP);
    size_t len = 0;
    int answered = 0;
    if (!buf)
        goto out;
    for (;;) {
        char *end;
        while (!(end = memmem(buf, len, "\r\n\r\n", 4))) {
            ssize_t r = len < CAP - 1 ? recv(fd, buf + len, CAP - 1 - len, 0) : 0;
            if (r <= 0)
                goto out;
            len += (size_t)r;
        }
        size_t head = (size_t)(end + 4 - buf), body_len = 0;
        buf[head - 1] = '\0';
        for (char *p = buf; (p = strchr(p, '\n')) != NULL; p++)
            if (strncasecmp(p + 1, "content-length:", 15) == 0)
                body_len = (size_t)strtoul(p + 16, NULL, 10);
        if (head + body_len >= CAP)
            goto out;
        while (len < head + body_len) {
            ssize_t r = recv(fd, buf + len, CAP - 1 - len, 0);
            if (r <= 0)
                goto out;
            len += (size_t)r;
        }
        char method[8] = "", path[128] = "";
        if (sscanf(buf, "%7s %127s", method, path) != 2)
            goto out;
        if (atomic_load(&fx_mode) == FX_ONESHOT && answered > 0)
            goto out; // the client sent on a connection the server had given up on
        if (!fx_answer(fd, method, path, buf + head, body_len))
            goto out;
        answered++;
        memmove(buf, buf + head + body_len, len - head - body_len);
        len -= head + body_len;
    }
out:
    free(buf);
    close(fd);
    return NULL;
}

static void *fx_accept_main(void *arg)
{
    (void)arg;
    while (!atomic_load(&fx_stop)) {
        struct pollfd p = {.fd = fx_fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0)
            continue;
        int fd = accept(fx_fd, NULL, NULL);
        if (fd < 0)
            continue;
        atomic_fetch_add(&fx_conns, 1);
        int one = 1; // small writes go out at once, as a real server's tokens do
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_t t;
        if (pthread_create(&t, NULL, fx_conn_main, (void *)(intptr_t)fd) == 0)
            pthread_detach(t);
        else
            close(fd);
    }
    return NULL;
}

/* A socket bound to 127.0.0.1 on a free port; *port gets the port. */
static int bind_loopback(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &al) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

static bool fx_start(void)
{
    fx_fd = bind_loopback(&fx_port);
    if (fx_fd < 0 || listen(fx_fd, 64) != 0)
        return false;
    atomic_store(&fx_stop, 0);
    return pthread_create(&fx_thread, NULL, fx_accept_main, NULL) == 0;
}

static void fx_stop_all(void)
{
    if (fx_fd < 0)
        return;
    atomic_store(&fx_stop, 1);
    pthread_join(fx_thread, NULL);
    close(fx_fd);
    fx_fd = -1;
}

/* Resets the fixture's behaviour and counters between runs. */
static void fx_set(int mode, int fail_every, bool no_usage)
{
    atomic_store(&fx_mode, mode);
    atomic_store(&fx_fail_every, fail_every);
    atomic_store(&fx_no_usage, no_usage);
    atomic_store(&fx_requests, 0);
    atomic_store(&fx_conns, 0);
}

/* ------------------------------------------------------------------------------------------ */

/* What a run is expected to report. */
typedef struct expect {
    int rc;
    int64_t ok, failed;
    int64_t output_tokens, prompt_tokens; /* -1: not checked */
    const char *source;                   /* tokens.source, or NULL */
    const char *error;                    /* in the text report, or NULL */
} expect;

/* Runs `shoal bench --url URL EXTRA... --json FILE --quiet` and checks the exit code, the text
 * report and the JSON report against e. Returns the parsed JSON (caller decrefs) or NULL. */
static json_t *check_run(const char *url, const char *const *extra, const expect *e)
{
    char json_path[300];
    snprintf(json_path, sizeof json_path, "%s/report.json", tmpdir);
    unlink(json_path);
    const char *args[40];
    int n = 0;
    args[n++] = "--url";
    args[n++] = url;
    for (int i = 0; extra[i] && n < 34; i++)
        args[n++] = extra[i];
    args[n++] = "--json";
    args[n++] = json_path;
    args[n++] = "--quiet";
    args[n] = NULL;
    int rc = shoal(args);
    CHECK_INT_EQ(rc, e->rc);
    char line[128];
    snprintf(line, sizeof line, "requests:        %lld ok, %lld failed\n", (long long)e->ok,
             (long long)e->failed);
    CHECK_CONTAINS(out_buf, line);
    if (e->output_tokens >= 0) {
        snprintf(line, sizeof line, "output tokens:   %lld", (long long)e->output_tokens);
        CHECK_CONTAINS(out_buf, line);
    }
    if (e->error)
        CHECK_CONTAINS(out_buf, e->error);
    json_error_t je;
    json_t *j = json_load_file(json_path, 0, &je);
    if (!j) {
        SH_FAIL_("%s does not parse: %s (line %d)\nstdout:\n%s\nstderr:\n%s", json_path, je.text,
                 je.line, out_buf, err_buf);
        return NULL;
    }
    json_t *req = json_object_get(j, "requests"), *tok = json_object_get(j, "tokens");
    CHECK_INT_EQ(json_integer_value(json_object_get(req, "ok")), e->ok);
    CHECK_INT_EQ(json_integer_value(json_object_get(req, "failed")), e->failed);
    if (e->output_tokens >= 0)
        CHECK_INT_EQ(json_integer_value(json_object_get(tok, "output")), e->output_tokens);
    if (e->prompt_tokens >= 0)
        CHECK_INT_EQ(json_integer_value(json_object_get(tok, "prompt")), e->prompt_tokens);
    if (e->source)
        CHECK_STR_EQ(json_string_value(json_object_get(tok, "source")), e->source);
    if (e->ok > 0) {
        static const char *const keys[] = {"ttft_ms", "tpot_ms", "latency_ms"};
        for (int i = 0; i < 3; i++) {
            json_t *s = json_object_get(j, keys[i]);
            CHECK(json_is_number(json_object_get(s, "p50")));
            CHECK(json_is_number(json_object_get(s, "p90")));
            CHECK(json_is_number(json_object_get(s, "p99")));
            CHECK(json_is_number(json_object_get(s, "mean")));
        }
        json_t *tp = json_object_get(j, "throughput");
        CHECK(json_real_value(json_object_get(tp, "output_tokens_per_s")) > 0);
        CHECK(json_real_value(json_object_get(tp, "requests_per_s")) > 0);
        CHECK(json_real_value(json_object_get(j, "duration_s")) > 0);
    }
    return j;
}

static void test_bad_options(void)
{
    CHECK_USAGE_ERROR("--bogus");
    CHECK_USAGE_ERROR("extra");
    CHECK_USAGE_ERROR("-c");
    CHECK_USAGE_ERROR("-c", "0");
    CHECK_USAGE_ERROR("-n", "abc");
    CHECK_USAGE_ERROR("--prompt-tokens", "9:3");
    CHECK_USAGE_ERROR("--prompt-tokens", "0");
    CHECK_USAGE_ERROR("--output-tokens", "4:");
    CHECK_USAGE_ERROR("--endpoint", "embeddings");
    CHECK_USAGE_ERROR("--temperature", "-1");
    CHECK_USAGE_ERROR("--timeout", "0");
    CHECK_USAGE_ERROR("--url", "https://127.0.0.1:8080");
    CHECK_USAGE_ERROR("--url", "127.0.0.1:8080");
    CHECK_USAGE_ERROR("--url", "http://127.0.0.1:99999");
    CHECK_USAGE_ERROR("--no-stream=1");
    CHECK_CONTAINS(err_buf, "--no-stream");
    CHECK_USAGE_ERROR("--concurrency=x");
    CHECK_CONTAINS(err_buf, "--concurrency");
    const char *help[] = {"--help", NULL};
    CHECK_INT_EQ(shoal(help), 0);
    CHECK_CONTAINS(out_buf, "usage: shoal bench");
    CHECK_CONTAINS(out_buf, "--shared-prefix");
}

/* Nothing listens: every request fails with the reason, quickly, and the exit code is 1. */
static void test_refused(void)
{
    int port = 0, fd = bind_loopback(&port); // bound, never listening: connections are refused
    CHECK(fd >= 0);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    const char *extra[] = {"--model", "m", "-n", "10", "-c", "3", "--timeout", "20", NULL};
    expect e = {.rc = 1,
                .ok = 0,
                .failed = 10,
                .output_tokens = 0,
                .prompt_tokens = 0,
                .error = "10 x connect to 127.0.0.1:"};
    json_decref(check_run(url, extra, &e));
    CHECK_CONTAINS(out_buf, "connection refused");
    CHECK(last_run_s < 10);
    // Without --model the model list cannot be read either: one error line, exit 1.
    const char *a[] = {"--url", url, NULL};
    CHECK_INT_EQ(shoal(a), 1);
    CHECK(strncmp(err_buf, "error: cannot list the models", 29) == 0);
    CHECK_CONTAINS(err_buf, "--model");
    close(fd);
}

static void fx_url(char *url, size_t cap) { snprintf(url, cap, "http://127.0.0.1:%d", fx_port); }

/* Streaming completions, model from /v1/models, keep-alive: one connection per stream. */
static void test_fixture_stream(void)
{
    char url[64];
    fx_url(url, sizeof url);
    fx_set(FX_CHUNKED, 0, false);
    const char *extra[] = {"-c", "3", "-n", "9", "--prompt-tokens", "7", "--output-tokens",
                           "5",  NULL};
    expect e = {
        .rc = 0, .ok = 9, .failed = 0, .output_tokens = 45, .prompt_tokens = 63, .source = "usage"};
    json_t *j = check_run(url, extra, &e);
    CHECK_STR_EQ(json_string_value(json_object_get(j, "model")), "fake-model");
    // The five events of a request are ~2 ms apart: TPOT and inter-token gaps see it.
    json_t *tpot = json_object_get(j, "tpot_ms"), *itl = json_object_get(j, "itl_ms");
    double tpot_p50 = json_real_value(json_object_get(tpot, "p50"));
    if (!(tpot_p50 >= 1.0))
        SH_FAIL_("tpot p50 %.3f ms, expected >= 1 ms:\n%s", tpot_p50, out_buf);
    CHECK_INT_EQ(json_integer_value(json_object_get(itl, "samples")), 9 * 4);
    json_decref(j);
    CHECK_INT_EQ(atomic_load(&fx_requests), 9);
    CHECK_INT_EQ(atomic_load(&fx_conns), 1 + 3); // the model list's, then one per stream
    // Warmup requests are sent but not counted; the shared prefix adds its words to every prompt.
    fx_set(FX_CHUNKED, 0, false);
    const char *extra2[] = {"--model",
                            "fake-model",
                            "-c",
                            "2",
                            "-n",
                            "4",
                            "--warmup",
                            "2",
                            "--shared-prefix",
                            "10",
                            "--prompt-tokens",
                            "3:6",
                            "--output-tokens",
                            "2",
                            NULL};
    expect e2 = {
        .rc = 0, .ok = 4, .failed = 0, .output_tokens = 8, .prompt_tokens = -1, .source = "usage"};
    j = check_run(url, extra2, &e2);
    int64_t prompt = json_integer_value(json_object_get(json_object_get(j, "tokens"), "prompt"));
    CHECK(prompt >= 4 * 13 && prompt <= 4 * 16);
    json_decref(j);
    CHECK_INT_EQ(atomic_load(&fx_requests), 6);
}

/* Chat streaming, non-streaming and an event stream without usage or framing. */
static void test_fixture_variants(void)
{
    char url[64];
    fx_url(url, sizeof url);
    fx_set(FX_CHUNKED, 0, false);
    const char *chat[] = {"--model",         "m", "--endpoint",      "chat", "-c", "2", "-n", "4",
                          "--prompt-tokens", "5", "--output-tokens", "3",    NULL};
    expect e = {
        .rc = 0, .ok = 4, .failed = 0, .output_tokens = 12, .prompt_tokens = 20, .source = "usage"};
    json_decref(check_run(url, chat, &e));

    fx_set(FX_CHUNKED, 0, false);
    const char *whole[] = {"--model",         "m", "--no-stream",     "-c", "2", "-n", "6",
                           "--prompt-tokens", "4", "--output-tokens", "7",  NULL};
    expect e2 = {
        .rc = 0, .ok = 6, .failed = 0, .output_tokens = 42, .prompt_tokens = 24, .source = "usage"};
    json_decref(check_run(url, whole, &e2));
    CHECK_INT_EQ(atomic_load(&fx_conns), 2);

    // No usage: output tokens are the token-bearing events; the stream ends with the connection.
    fx_set(FX_CLOSE, 0, true);
    const char *bare[] = {"--model",         "m", "-c", "2", "-n", "4", "--prompt-tokens", "6",
                          "--output-tokens", "3", NULL};
    expect e3 = {.rc = 0,
                 .ok = 4,
                 .failed = 0,
                 .output_tokens = 12,
                 .prompt_tokens = 24,
                 .source = "estimate"};
    json_decref(check_run(url, bare, &e3));
    CHECK_INT_EQ(atomic_load(&fx_conns), 4);

    // A server that gives up keep-alive connections without saying so: the client resends a
    // request that met a closed connection once, on a new one.
    fx_set(FX_ONESHOT, 0, false);
    const char *oneshot[] = {"--model", "m", "-c", "2", "-n", "8", "--output-tokens", "2", NULL};
    expect e4 = {
        .rc = 0, .ok = 8, .failed = 0, .output_tokens = 16, .prompt_tokens = -1, .source = "usage"};
    json_decref(check_run(url, oneshot, &e4));
    CHECK_INT_EQ(atomic_load(&fx_requests), 8);
    CHECK_INT_EQ(atomic_load(&fx_conns), 8);
}

/* Failures are counted with their message, and the run goes on. */
static void test_fixture_failures(void)
{
    char url[64];
    fx_url(url, sizeof url);
    fx_set(FX_CHUNKED, 3, false);
    const char *some[] = {"--model", "m", "-c", "2", "-n", "9", "--output-tokens", "2", NULL};
    expect e = {.rc = 0,
                .ok = 6,
                .failed = 3,
                .output_tokens = 12,
                .prompt_tokens = -1,
                .error = "3 x HTTP 503: fake overload"};
    json_t *j = check_run(url, some, &e);
    json_t *err0 = json_array_get(json_object_get(j, "errors"), 0);
    CHECK_INT_EQ(json_integer_value(json_object_get(err0, "status")), 503);
    CHECK_INT_EQ(json_integer_value(json_object_get(err0, "count")), 3);
    json_decref(j);

    fx_set(FX_HANGUP, 0, false);
    const char *hang[] = {"--model", "m", "-c", "2", "-n", "3", "--output-tokens", "5", NULL};
    expect e2 = {.rc = 1,
                 .ok = 0,
                 .failed = 3,
                 .output_tokens = 0,
                 .prompt_tokens = -1,
                 .error = "connection closed by the server before the response was complete"};
    json_decref(check_run(url, hang, &e2));

    fx_set(FX_STALL, 0, false);
    const char *stall[] = {"--model", "m", "-c", "2", "-n", "2", "--timeout", "0.5", NULL};
    expect e3 = {.rc = 1,
                 .ok = 0,
                 .failed = 2,
                 .output_tokens = 0,
                 .prompt_tokens = -1,
                 .error = "2 x timed out after 0.5 s"};
    json_decref(check_run(url, stall, &e3));
    CHECK(last_run_s < 5);
}

static const sh_test_case tests[] = {
    {"bad_options", test_bad_options},           {"refused", test_refused},
    {"fixture_stream", test_fixture_stream},     {"fixture_variants", test_fixture_variants},
    {"fixture_failures", test_fixture_failures}, {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (!getenv("SH_SHOAL")) {
        fprintf(stderr, "skip: SH_SHOAL is not set\n");
        return SH_TEST_SKIP;
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal-bench-cli-XXXXXX");
    if (!mkdtemp(tmpdir))
        return 1;
    if (!fx_start()) {
        fprintf(stderr, "cannot start the fixture server\n");
        return 1;
    }
    int rc = sh_test_main(argc, argv, tests);
    fx_stop_all();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        rc = rc ? rc : 1;
    return rc;
}
