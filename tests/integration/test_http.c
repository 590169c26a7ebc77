/* The HTTP server on 127.0.0.1 driven by curl and raw sockets: JSON, keep-alive, pipelining, SSE,
 * limits (413, 503, 431), slow-loris, timeouts from accept, idle connections shed at the limit,
 * disconnect mid-stream, malformed requests, draining. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "net/http.h"
#include "sh_test.h"
#include "shoal/err.h"

static uv_loop_t loop;
static uv_async_t stop_async, drain_async;
static sh_http_server *srv;
static atomic_int port, ready, closed_done, aborts, held, handled, fd_logs;

typedef struct stream_ctx {
    uv_timer_t t;
    sh_http_req *req;
    int n, limit; /* limit < 0: forever */
} stream_ctx;

static void ctx_free(uv_handle_t *h) { free(h->data); }

static void stream_abort(sh_http_req *req, void *arg)
{
    stream_ctx *c = arg;
    atomic_fetch_add(&aborts, 1);
    CHECK(!sh_http_req_alive(req));
    CHECK_INT_EQ(sh_http_stream_write(req, "x", 1), SH_ECLOSED);
    CHECK_INT_EQ(sh_http_stream_end(req), SH_ECLOSED);
    c->req = NULL;
    uv_close((uv_handle_t *)&c->t, ctx_free);
}

static void stream_tick(uv_timer_t *t)
{
    stream_ctx *c = t->data;
    char ev[64];
    if (c->limit >= 0 && c->n >= c->limit) {
        sh_http_stream_write(c->req, "data: [DONE]\n\n", 14);
        sh_http_stream_end(c->req);
        c->req = NULL;
        uv_close((uv_handle_t *)t, ctx_free);
        return;
    }
    int len = snprintf(ev, sizeof ev, "data: {\"n\":%d}\n\n", c->n++);
    sh_http_stream_write(c->req, ev, (size_t)len);
}

static void hold_abort(sh_http_req *req, void *arg)
{
    atomic_fetch_add(&aborts, 1);
    atomic_fetch_sub(&held, 1);
    CHECK_INT_EQ(sh_http_respond(req, 200, "text/plain", "late", 4), SH_ECLOSED);
}

static void handler(sh_http_req *req, void *user)
{
    const char *path = sh_http_req_path(req);
    atomic_fetch_add(&handled, 1);
    if (strcmp(path, "/echo") == 0) {
        size_t len;
        const char *body = sh_http_req_body(req, &len);
        const char *ct = sh_http_req_header(req, "CONTENT-type");
        sh_http_req_add_header(req, "X-Query", sh_http_req_query(req));
        CHECK_INT_EQ(sh_http_req_add_header(req, "Bad", "a\r\nb"), SH_EINVAL);
        sh_http_respond(req, 200, ct ? ct : "application/octet-stream", body, len);
    } else if (strcmp(path, "/hello") == 0) {
        sh_http_respond(req, 200, "text/plain", "hello", 5);
    } else if (strcmp(path, "/sse") == 0 || strcmp(path, "/forever") == 0) {
        stream_ctx *c = calloc(1, sizeof *c);
        c->req = req;
        c->limit = path[1] == 's' ? 5 : -1;
        uv_timer_init(&loop, &c->t);
        c->t.data = c;
        sh_http_req_on_abort(req, stream_abort, c);
        sh_http_stream_start(req, 200, "text/event-stream", true);
        uv_timer_start(&c->t, stream_tick, 5, 20);
    } else if (strcmp(path, "/hold") == 0) {
        atomic_fetch_add(&held, 1);
        sh_http_req_on_abort(req, hold_abort, NULL);
    } else {
        static const char nf[] = "{\"error\":{\"message\":\"not found\"}}";
        sh_http_respond(req, 404, "application/json", nf, sizeof nf - 1);
    }
}

static void on_closed(void *arg) { atomic_store(&closed_done, 1); }

static void on_log(void *user, const char *event, const char *detail)
{
    (void)user;
    fprintf(stderr, "server log: %s: %s\n", event, detail);
    if (strcmp(event, "fd_limit") == 0)
        atomic_fetch_add(&fd_logs, 1);
}

static void on_drain(uv_async_t *a);

static void on_stop(uv_async_t *a)
{
    sh_http_server_close(srv, true, on_closed, NULL);
    uv_close((uv_handle_t *)a, NULL);
    if (!uv_is_closing((uv_handle_t *)&drain_async))
        uv_close((uv_handle_t *)&drain_async, NULL);
}

static void *server_main(void *arg)
{
    uv_loop_init(&loop);
    uv_async_init(&loop, &stop_async, on_stop);
    uv_async_init(&loop, &drain_async, on_drain);
    sh_http_opts o = {.host = "127.0.0.1",
                      .port = 0,
                      .max_conns = 4,
                      .max_header_bytes = 2048,
                      .max_body_bytes = 1024,
                      .header_timeout_ms = 400,
                      .request_timeout_ms = 1500,
                      .idle_timeout_ms = 3000,
                      .handler = handler,
                      .log = on_log};
    sh_error e = {0};
    if (sh_http_server_create(&loop, &o, &srv, &e) != SH_OK) {
        fprintf(stderr, "server: %s\n", e.msg);
        atomic_store(&ready, -1);
        return NULL;
    }
    atomic_store(&port, sh_http_server_port(srv));
    atomic_store(&ready, 1);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK_INT_EQ(uv_loop_close(&loop), 0); /* every handle was closed */
    return NULL;
}

/* --- clients --- */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int dial(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        SH_FAIL_("connect: %s", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static void send_str(int fd, const char *s)
{
    if (send(fd, s, strlen(s), MSG_NOSIGNAL) != (ssize_t)strlen(s))
        SH_FAIL_("send: %s", strerror(errno));
}

/* Reads until `needle` appears (NULL: until EOF) or timeout; returns bytes read, and sets *eof. */
static size_t recv_until(int fd, char *buf, size_t cap, const char *needle, int timeout_ms,
                         bool *eof)
{
    size_t n = 0;
    double end = now_ms() + timeout_ms;
    *eof = false;
    buf[0] = '\0';
    while (n + 1 < cap) {
        if (needle && strstr(buf, needle))
            break;
        int left = (int)(end - now_ms());
        if (left <= 0)
            break;
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, left) <= 0)
            continue;
        ssize_t k = recv(fd, buf + n, cap - 1 - n, 0);
        if (k <= 0) {
            *eof = true;
            break;
        }
        n += (size_t)k;
        buf[n] = '\0';
    }
    return n;
}

static int count(const char *hay, const char *needle)
{
    int c = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        c++;
    return c;
}

/* Runs a shell command and returns its stdout (static buffer). */
static const char *sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const char *sh(const char *fmt, ...)
{
    static char out[16384];
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *f = popen(cmd, "r");
    size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
    out[n] = '\0';
    if (f)
        pclose(f);
    return out;
}

static bool wait_for(atomic_int *v, int want, int ms)
{
    double end = now_ms() + ms;
    while (atomic_load(v) != want && now_ms() < end)
        usleep(5000);
    return atomic_load(v) == want;
}

static void test_curl_json(void)
{
    const char *o = sh("curl -s -i -X POST -H 'Content-Type: application/json' "
                       "--data '{\"a\":[1,2]}' 'http://127.0.0.1:%d/echo?x=1#frag'",
                       (int)port);
    CHECK(strncmp(o, "HTTP/1.1 200 OK\r\n", 17) == 0);
    CHECK(strstr(o, "Content-Type: application/json\r\n") != NULL);
    CHECK(strstr(o, "Content-Length: 11\r\n") != NULL);
    CHECK(strstr(o, "X-Query: x=1\r\n") != NULL);
    CHECK(strstr(o, "\r\n\r\n{\"a\":[1,2]}") != NULL);
    o = sh("curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/nope", (int)port);
    CHECK_STR_EQ(o, "404");
}

static void test_keepalive_and_pipelining(void)
{
    char buf[8192];
    bool eof;
    int fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "hello", 2000, &eof);
    CHECK(strstr(buf, "Connection: keep-alive") != NULL);
    CHECK(!eof);
    /* The same connection serves two more, pipelined in one write; the last asks to close. */
    send_str(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                 "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(eof);
    CHECK_INT_EQ(count(buf, "HTTP/1.1 200 OK"), 2);
    char *a = strstr(buf, "abc"), *h = strstr(buf, "hello");
    CHECK(a && h && a < h); /* answered in order */
    CHECK(strstr(buf, "Connection: close") != NULL);
    close(fd);
    /* A chunked request body is decoded; Expect: 100-continue is answered first. */
    fd = dial();
    send_str(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 "Expect: 100-continue\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "\r\n\r\n", 2000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 100 Continue\r\n\r\n", 25) == 0);
    send_str(fd, "3\r\nfoo\r\n4\r\nbar!\r\n0\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "foobar!", 2000, &eof);
    CHECK(strstr(buf, "Content-Length: 7\r\n") != NULL);
    close(fd);
}

static void test_sse(void)
{
    const char *o = sh("curl -sN -i http://127.0.0.1:%d/sse", (int)port);
    CHECK(strstr(o, "Content-Type: text/event-stream\r\n") != NULL);
    CHECK(strstr(o, "Cache-Control: no-cache\r\n") != NULL);
    CHECK(strstr(o, "Transfer-Encoding: chunked\r\n") != NULL);
    CHECK_INT_EQ(count(o, "data: {\"n\":"), 5);
    CHECK(strstr(o, "data: {\"n\":4}\n\ndata: [DONE]\n\n") != NULL);
    /* An HTTP/1.0 client gets a close-delimited stream. */
    o = sh("curl -sN -i --http1.0 http://127.0.0.1:%d/sse", (int)port);
    CHECK(strstr(o, "Transfer-Encoding") == NULL);
    CHECK(strstr(o, "data: [DONE]\n\n") != NULL);
}

static void test_limits(void)
{
    const char *o = sh("head -c 2000 /dev/zero | tr '\\0' a | curl -s -o /dev/null -w "
                       "'%%{http_code}' --data-binary @- http://127.0.0.1:%d/echo",
                       (int)port);
    CHECK_STR_EQ(o, "413");
    char buf[8192];
    bool eof;
    /* A chunked body that grows past the limit. */
    int fd = dial();
    send_str(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    char chunk[700];
    memset(chunk, 'b', sizeof chunk);
    snprintf(chunk, 8, "%x\r\n", 600);
    memcpy(chunk + 5 + 600, "\r\n", 2);
    send(fd, chunk, 607, MSG_NOSIGNAL);
    send(fd, chunk, 607, MSG_NOSIGNAL);
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 413 ", 13) == 0);
    CHECK(strstr(buf, "\"error\"") != NULL);
    CHECK(eof);
    close(fd);
    /* Headers over the limit. */
    fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nX-Big: ");
    char big[3000];
    memset(big, 'h', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    send_str(fd, big);
    send_str(fd, "\r\n\r\n");
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 431 ", 13) == 0);
    close(fd);
}

static void test_slowloris(void)
{
    char buf[4096];
    bool eof = false;
    int fd = dial();
    const char *req = "GET /hello HTTP/1.1\r\nHost: example\r\nX-Pad: aaaaaaaaaaaaaaaa\r\n\r\n";
    double t0 = now_ms();
    for (const char *p = req; *p && !eof; p++) {
        if (send(fd, p, 1, MSG_NOSIGNAL) != 1)
            break;
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 60) > 0) {
            recv_until(fd, buf, sizeof buf, NULL, 1000, &eof);
            break;
        }
    }
    double dt = now_ms() - t0;
    CHECK(eof);
    CHECK(strncmp(buf, "HTTP/1.1 408 ", 13) == 0);
    CHECK(dt > 300 && dt < 2500);
    close(fd);
    /* A connection that never sends a byte is closed silently after the header timeout,
     * counted from accept (not after the idle timeout, which is for keep-alive). */
    fd = dial();
    t0 = now_ms();
    size_t n = recv_until(fd, buf, sizeof buf, NULL, 5000, &eof);
    dt = now_ms() - t0;
    CHECK(eof);
    CHECK_INT_EQ(n, 0);
    if (!(dt > 300 && dt < 1500))
        SH_FAIL_("a silent connection closed after %.0f ms (header timeout 400)", dt);
    close(fd);
    /* Headers that start late must still end by the deadline counted from accept. The first
     * bytes must reach the server before that deadline: on a loaded machine the 300 ms sleep
     * has overrun it (the server then closes silently, as above), so such a try is repeated. */
    for (int tries = 0;; tries++) {
        fd = dial();
        t0 = now_ms();
        usleep(300 * 1000);
        send_str(fd, "GET /hello HTTP/1.1\r\n");
        if (now_ms() - t0 < 360 || tries == 4)
            break;
        close(fd);
    }
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    dt = now_ms() - t0;
    CHECK(strncmp(buf, "HTTP/1.1 408 ", 13) == 0);
    if (!(dt < 650))
        SH_FAIL_("408 came %.0f ms after accept; the header timeout is 400 from accept", dt);
    close(fd);
    /* A keep-alive connection is closed after the idle timeout (3000). */
    fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "hello", 2000, &eof);
    t0 = now_ms();
    recv_until(fd, buf, sizeof buf, NULL, 6000, &eof);
    dt = now_ms() - t0;
    CHECK(eof);
    if (!(dt > 2500 && dt < 4500))
        SH_FAIL_("an idle keep-alive connection closed after %.0f ms (idle timeout 3000)", dt);
    close(fd);
}

/* At max_conns, a new connection closes the longest-idle one instead of getting 503. */
static void test_shed_idle(void)
{
    char buf[4096];
    bool eof;
    int fds[4];
    for (int i = 0; i < 4; i++) {
        fds[i] = dial();
        send_str(fds[i], "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        recv_until(fds[i], buf, sizeof buf, "hello", 2000, &eof);
        CHECK(!eof);
        usleep(20 * 1000); /* distinct idle ages: fds[0] has waited longest */
    }
    int fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 200 ", 13) == 0);
    close(fd);
    recv_until(fds[0], buf, sizeof buf, NULL, 1000, &eof);
    CHECK(eof); /* the longest idle made room */
    for (int i = 1; i < 4; i++) {
        send_str(fds[i], "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        recv_until(fds[i], buf, sizeof buf, "hello", 2000, &eof);
        if (!strstr(buf, "hello"))
            SH_FAIL_("idle connection %d was closed although it was not the oldest", i);
    }
    sh_http_stats st;
    sh_http_server_stats(srv, &st); /* racy read of counters, fine for a >= check */
    CHECK(st.shed >= 1);
    for (int i = 0; i < 4; i++)
        close(fds[i]);
    usleep(50 * 1000);
}

/* Descriptors run out behind the server's back (this process opens all but a few after the
 * server counted them): the server notices on the next accept, sheds its idle connections
 * (oldest first) for new ones, logs it once however long it lasts, and every client is served. */
static void test_fd_short(void)
{
    /* Connections of earlier tests (lingering, keep-alive) would free descriptors later. */
    for (int i = 0; i < 300 && sh_http_server_conns(srv) > 0; i++)
        usleep(10 * 1000);
    CHECK_INT_EQ(sh_http_server_conns(srv), 0);
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    size_t cap = rl.rlim_cur < 100000 ? (size_t)rl.rlim_cur : 100000;
    int *hog = malloc(cap * sizeof *hog);
    size_t n = 0;
    while (n < cap && (hog[n] = open("/dev/null", O_RDONLY)) >= 0)
        n++;
    CHECK(n > 8);
    for (int i = 0; i < 5 && n > 0; i++)
        close(hog[--n]); /* 5 free: two connections (both ends) and one spare */
    int before = atomic_load(&fd_logs);
    char buf[4096];
    bool eof;
    int prev = -1;
    for (int k = 0; k < 8; k++) {
        int fd = dial();
        if (fd < 0)
            break;
        send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        recv_until(fd, buf, sizeof buf, "hello", 2000, &eof);
        if (!strstr(buf, "hello"))
            SH_FAIL_("connection %d with descriptors short: '%.60s'", k, buf);
        if (prev >= 0) {
            /* The idle one before it made room (its descriptor is still held here). */
            recv_until(prev, buf, sizeof buf, NULL, 2000, &eof);
            if (!eof)
                SH_FAIL_("connection %d was not shed for connection %d", k - 1, k);
            close(prev);
        }
        prev = fd;
    }
    close(prev);
    while (n > 0)
        close(hog[--n]);
    free(hog);
    sh_http_stats st;
    sh_http_server_stats(srv, &st);
    CHECK(st.fd_short >= 1);
    CHECK_INT_EQ(atomic_load(&fd_logs) - before, 1); /* once, not per connection */
    usleep(1100 * 1000); /* the budget is recounted (grows back) a second later */
}

static void on_drain(uv_async_t *a)
{
    sh_http_server_drain(srv);
    uv_close((uv_handle_t *)a, NULL);
}

/* Draining: idle keep-alive connections close, a response in flight says Connection: close,
 * new connections are still answered (then closed). Runs last: keep-alive is over after it. */
static void test_drain(void)
{
    char buf[4096];
    bool eof;
    int idle = dial();
    send_str(idle, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(idle, buf, sizeof buf, "hello", 2000, &eof);
    int busy = dial();
    send_str(busy, "GET /sse HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(busy, buf, sizeof buf, "\r\n\r\n", 2000, &eof);
    CHECK(strstr(buf, "Connection: keep-alive") != NULL); /* started before the drain */
    uv_async_send(&drain_async);
    recv_until(idle, buf, sizeof buf, NULL, 1000, &eof);
    CHECK(eof);
    recv_until(busy, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strstr(buf, "data: [DONE]") != NULL);
    CHECK(eof); /* closed after its response */
    close(idle);
    close(busy);
    int fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 200 ", 13) == 0);
    CHECK(strstr(buf, "Connection: close") != NULL);
    CHECK(eof);
    close(fd);
}

static void test_disconnect_mid_stream(void)
{
    char buf[4096];
    bool eof;
    int before = atomic_load(&aborts);
    int fd = dial();
    send_str(fd, "GET /forever HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "{\"n\":2}", 2000, &eof);
    CHECK(strstr(buf, "{\"n\":2}") != NULL);
    struct linger lg = {1, 0}; /* an abrupt close: RST */
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
    CHECK(wait_for(&aborts, before + 1, 3000));
    /* Also a polite close (FIN) mid-stream. */
    fd = dial();
    send_str(fd, "GET /forever HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, "{\"n\":1}", 2000, &eof);
    close(fd);
    CHECK(wait_for(&aborts, before + 2, 3000));
    const char *o = sh("curl -s http://127.0.0.1:%d/hello", (int)port);
    CHECK_STR_EQ(o, "hello");
}

static void test_too_many_connections(void)
{
    int fds[4];
    int before = atomic_load(&aborts);
    for (int i = 0; i < 4; i++) {
        fds[i] = dial();
        send_str(fds[i], "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    }
    CHECK(wait_for(&held, 4, 3000));
    char buf[4096];
    bool eof;
    int fd = dial();
    send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(strncmp(buf, "HTTP/1.1 503 ", 13) == 0);
    CHECK(strstr(buf, "{\"error\":{\"message\":") != NULL);
    CHECK(eof);
    close(fd);
    for (int i = 0; i < 4; i++)
        close(fds[i]);
    CHECK(wait_for(&held, 0, 3000));
    CHECK(wait_for(&aborts, before + 4, 3000));
    /* Capacity is back. */
    const char *o = sh("curl -s http://127.0.0.1:%d/hello", (int)port);
    CHECK_STR_EQ(o, "hello");
}

static void test_malformed(void)
{
    const char *bad[] = {"GARBAGE\r\n\r\n", "GET / HTTP/9.9\r\n\r\n",
                         "GET /hello HTTP/1.1\r\nBad Header\r\n\r\n",
                         ("POST /echo HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: "
                          "chunked\r\n\r\n0\r\n\r\n"),
                         "POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char buf[4096];
        bool eof;
        int fd = dial();
        send_str(fd, bad[i]);
        recv_until(fd, buf, sizeof buf, NULL, 3000, &eof);
        const char *want = i == 1 ? "HTTP/1.1 505 " : "HTTP/1.1 400 ";
        if (strncmp(buf, want, 13) != 0)
            SH_FAIL_("request %zu: got '%.40s'", i, buf);
        CHECK(eof);
        close(fd);
    }
}

static const sh_test_case tests[] = {
    {"curl_json", test_curl_json},
    {"keepalive_and_pipelining", test_keepalive_and_pipelining},
    {"sse", test_sse},
    {"limits", test_limits},
    {"slowloris", test_slowloris},
    {"disconnect_mid_stream", test_disconnect_mid_stream},
    {"too_many_connections", test_too_many_connections},
    {"shed_idle", test_shed_idle},
    {"fd_short", test_fd_short},
    {"malformed", test_malformed},
    {"drain", test_drain},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    if (system("curl --version > /dev/null 2>&1") != 0) {
        fprintf(stderr, "curl is not installed\n");
        return SH_TEST_SKIP;
    }
    pthread_t th;
    pthread_create(&th, NULL, server_main, NULL);
    while (atomic_load(&ready) == 0)
        usleep(1000);
    if (atomic_load(&ready) < 0)
        return 1;
    int rc = sh_test_main(argc, argv, tests);
    uv_async_send(&stop_async);
    pthread_join(th, NULL);
    if (!atomic_load(&closed_done)) {
        fprintf(stderr, "the server did not report closing\n");
        rc = 1;
    }
    return rc;
}
