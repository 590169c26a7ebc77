/* `shoal bench`'s HTTP/1.1 client: keep-alive connections on a libuv loop, responses read with
 * http-parser (Content-Length, chunked or close-delimited), server-sent events reassembled. */
#include <ctype.h>
#include <errno.h>
#include <http_parser.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "shoal.h"
#include "tools/bench.h"

#define READ_BUF (64 << 10)
#define MAX_BODY_OK (64u << 20)  /* a non-streamed 2xx body */
#define MAX_BODY_ERR (64u << 10) /* an error body: only its start is reported */
#define MAX_SSE_LINE (16u << 20)
#define DONE_GRACE_MS 1000 /* after `data: [DONE]`, how long to wait for the end of the body */

/* One TCP connection. It is separate from sh__bench_conn so that a connection being closed
 * (uv_close is asynchronous) never delays the next one: a detached socket has conn == NULL and
 * its late callbacks are ignored; it frees itself in its close callback. */
typedef struct sock {
    uv_tcp_t tcp;
    uv_connect_t creq;
    sh__bench_conn *conn;
    uint32_t n_done; /* complete exchanges on this socket */
    char rbuf[READ_BUF];
} sock;

/* A growable byte buffer; always NUL-terminated once anything was appended. */
typedef struct buf {
    char *p;
    size_t len, cap;
} buf;

struct sh__bench_conn {
    uv_loop_t *loop;
    const sh__bench_http_cfg *cfg;
    sock *s;            /* NULL while disconnected */
    uv_timer_t timer;   /* timeout, [DONE] grace, deferred failure */
    sh__bench_xfer *x;  /* in flight, or NULL */
    http_parser parser; /* data = this connection */
    bool complete;      /* the parser reached the end of the response */
    bool abort;         /* an event callback rejected the stream */
    bool got_bytes;     /* any of the response arrived */
    bool got_done;      /* `data: [DONE]` was read */
    bool retried;       /* the exchange was resent once on a fresh socket */
    bool in_ctype;      /* the header being read is Content-Type */
    bool field_done;    /* the previous header callback was a value */
    char field[16];     /* the start of the header name being read */
    size_t field_len;
    char ctype[64]; /* the start of the Content-Type value */
    size_t ctype_len;
    char pending[160]; /* a failure to report from the timer ("" for none) */
    buf body;          /* a body not read as events */
    buf line;          /* bytes of the event stream not yet split into lines */
    buf event;         /* the data lines of the event being read */
};

static bool buf_append(buf *b, const char *p, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q)
            return false;
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = '\0';
    return true;
}

static void buf_free(buf *b)
{
    free(b->p);
    *b = (buf){0};
}

/* --- URL and address --- */

bool sh__bench_http_parse_url(const char *s, sh__bench_url *u, char *err, size_t errcap)
{
    memset(u, 0, sizeof *u);
    if (strncmp(s, "https://", 8) == 0) {
        snprintf(err, errcap, "https is not supported (use plain http://): %s", s);
        return false;
    }
    if (strncmp(s, "http://", 7) != 0) {
        snprintf(err, errcap, "URL must start with http://: %s", s);
        return false;
    }
    const char *h = s + 7, *path = strchr(h, '/');
    size_t hp_len = path ? (size_t)(path - h) : strlen(h);
    if (hp_len == 0 || hp_len >= sizeof u->host_header) {
        snprintf(err, errcap, "URL has no host or a host too long: %s", s);
        return false;
    }
    memcpy(u->host_header, h, hp_len);
    const char *port = NULL, *end = h + hp_len;
    size_t host_len;
    if (*h == '[') { // an IPv6 literal: [::1]:8080
        const char *rb = memchr(h, ']', hp_len);
        if (!rb || (rb + 1 < end && rb[1] != ':')) {
            snprintf(err, errcap, "bad IPv6 host in URL: %s", s);
            return false;
        }
        host_len = (size_t)(rb - h - 1);
        memcpy(u->host, h + 1, host_len);
        port = rb + 1 < end ? rb + 2 : NULL;
    } else {
        const char *colon = memchr(h, ':', hp_len);
        host_len = colon ? (size_t)(colon - h) : hp_len;
        memcpy(u->host, h, host_len);
        port = colon ? colon + 1 : NULL;
    }
    if (host_len == 0 || host_len >= sizeof u->host || memchr(h, '@', hp_len)) {
        snprintf(err, errcap, "bad host in URL: %s", s);
        return false;
    }
    if (port) {
        size_t n = (size_t)(end - port);
        long v = 0;
        for (size_t i = 0; i < n && v >= 0; i++)
            v = isdigit((unsigned char)port[i]) && n <= 5 ? v * 10 + (port[i] - '0') : -1;
        if (n == 0 || v < 1 || v > 65535) {
            snprintf(err, errcap, "bad port in URL: %s", s);
            return false;
        }
        snprintf(u->port, sizeof u->port, "%ld", v);
    } else {
        strcpy(u->port, "80");
    }
    if (path) {
        size_t n = strlen(path);
        while (n > 0 && path[n - 1] == '/')
            n--;
        if (n >= sizeof u->base || memchr(path, '?', n) || memchr(path, '#', n)) {
            snprintf(err, errcap, "URL path must be a plain prefix: %s", s);
            return false;
        }
        memcpy(u->base, path, n);
    }
    return true;
}

bool sh__bench_http_resolve(uv_loop_t *loop, const sh__bench_url *u, struct sockaddr_storage *addr,
                            char *err, size_t errcap)
{
    uv_getaddrinfo_t req;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    int rc = uv_getaddrinfo(loop, &req, NULL, u->host, u->port, &hints); // NULL cb: synchronous
    if (rc < 0) {
        snprintf(err, errcap, "cannot resolve %s: %s", u->host, uv_strerror(rc));
        return false;
    }
    // Servers often listen on 127.0.0.1 only while "localhost" resolves to ::1 first.
    const struct addrinfo *pick = req.addrinfo;
    for (const struct addrinfo *a = req.addrinfo; a; a = a->ai_next)
        if (a->ai_family == AF_INET) {
            pick = a;
            break;
        }
    bool ok = pick && pick->ai_addrlen <= sizeof *addr;
    if (ok) {
        memset(addr, 0, sizeof *addr);
        memcpy(addr, pick->ai_addr, pick->ai_addrlen);
    } else {
        snprintf(err, errcap, "cannot resolve %s: no address", u->host);
    }
    uv_freeaddrinfo(req.addrinfo);
    return ok;
}

/* --- connection life --- */

static void on_sock_close(uv_handle_t *h) { free(h->data); }

/* Detaches and closes the socket; its remaining callbacks are ignored. */
static void close_sock(sh__bench_conn *c)
{
    sock *s = c->s;
    if (!s)
        return;
    c->s = NULL;
    s->conn = NULL;
    uv_close((uv_handle_t *)&s->tcp, on_sock_close);
}

/* Ends the exchange in flight and hands it back; always the last thing its caller does, because
 * on_done may start the next exchange on c. */
static void finish(sh__bench_conn *c)
{
    sh__bench_xfer *x = c->x;
    uv_timer_stop(&c->timer);
    c->x = NULL;
    if (!x->t_end)
        x->t_end = uv_hrtime();
    x->resp = c->body.p ? c->body.p : "";
    x->resp_len = c->body.len;
    x->on_done(x);
}

/* Ends the exchange as failed with the message already in x->err. */
static void end_failed(sh__bench_conn *c)
{
    c->x->failed = true;
    c->x->t_end = uv_hrtime();
    close_sock(c);
    finish(c);
}

static void fail(sh__bench_conn *c, const char *fmt, ...) SH_PRINTF(2, 3);
static void fail(sh__bench_conn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->x->err, sizeof c->x->err, fmt, ap);
    va_end(ap);
    end_failed(c);
}

static void on_timer(uv_timer_t *t);

/* Reports a failure from the timer, so that sh__bench_http_start never calls on_done itself. */
static void fail_later(sh__bench_conn *c, const char *fmt, ...) SH_PRINTF(2, 3);
static void fail_later(sh__bench_conn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->pending, sizeof c->pending, fmt, ap);
    va_end(ap);
    close_sock(c);
    uv_timer_start(&c->timer, on_timer, 0, 0);
}

static void open_sock(sh__bench_conn *c);

static void on_sock_error(sh__bench_conn *c, int uverr)
{
    // A keep-alive connection the server closed while idle shows up as a reset or EOF on the
    // next request: resend once on a fresh connection if nothing of the response came back.
    bool reused = c->s && c->s->n_done > 0;
    if (reused && !c->got_bytes && !c->retried) {
        c->retried = true;
        close_sock(c);
        http_parser_init(&c->parser, HTTP_RESPONSE);
        c->parser.data = c;
        open_sock(c);
        return;
    }
    if (uverr == UV_EOF)
        fail(c, "connection closed by the server before the response was complete");
    else
        fail(c, "connection error: %s", uv_strerror(uverr));
}

static void on_write(uv_write_t *w, int status)
{
    sock *s = w->data;
    free(w);
    if (status < 0 && s->conn && s->conn->x)
        on_sock_error(s->conn, status);
}

static void send_request(sh__bench_conn *c)
{
    sh__bench_xfer *x = c->x;
    char head[2048];
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: shoal-bench/%s\r\n"
                     "Accept: %s\r\n%s%s%s",
                     x->method, x->path, c->cfg->host_header, SH_VERSION_STRING,
                     x->stream ? "text/event-stream" : "application/json",
                     c->cfg->api_key ? "Authorization: Bearer " : "",
                     c->cfg->api_key ? c->cfg->api_key : "", c->cfg->api_key ? "\r\n" : "");
    if (n < 0 || (size_t)n >= sizeof head - 100) {
        fail_later(c, "request head longer than %zu bytes", sizeof head - 100);
        return;
    }
    if (x->body)
        n += snprintf(head + n, sizeof head - (size_t)n,
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n", x->body_len);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    size_t body_len = x->body ? x->body_len : 0;
    uv_write_t *w = malloc(sizeof *w + (size_t)n + body_len);
    if (!w) {
        fail_later(c, "out of memory");
        return;
    }
    char *p = (char *)(w + 1);
    memcpy(p, head, (size_t)n);
    if (body_len)
        memcpy(p + n, x->body, body_len);
    w->data = c->s;
    uv_buf_t b = uv_buf_init(p, (unsigned)((size_t)n + body_len));
    int rc = uv_write(w, (uv_stream_t *)&c->s->tcp, &b, 1, on_write);
    if (rc < 0) {
        free(w);
        fail_later(c, "write: %s", uv_strerror(rc));
    }
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *b)
{
    sock *s = h->data;
    *b = uv_buf_init(s->rbuf, sizeof s->rbuf);
}

static const http_parser_settings parser_settings;

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b)
{
    sock *s = st->data;
    sh__bench_conn *c = s->conn;
    if (!c || nread == 0)
        return;
    if (!c->x) { // idle: the server closed the connection, or sent what nobody asked for
        close_sock(c);
        return;
    }
    // At EOF the parser is told the stream ended: that completes a close-delimited body.
    size_t len = nread > 0 ? (size_t)nread : 0, used = 0;
    if (nread > 0) {
        c->got_bytes = true;
        used = http_parser_execute(&c->parser, &parser_settings, b->base, len);
    } else if (nread == UV_EOF && c->got_bytes) {
        http_parser_execute(&c->parser, &parser_settings, NULL, 0);
    }
    enum http_errno pe = HTTP_PARSER_ERRNO(&c->parser);
    if (c->abort) {
        end_failed(c);
        return;
    }
    if (c->complete) {
        if (nread < 0 || used != len || !http_should_keep_alive(&c->parser))
            close_sock(c);
        else
            c->s->n_done++;
        finish(c);
        return;
    }
    if (nread < 0) {
        if (c->got_done) { // the stream was over; only the end of the body is missing
            close_sock(c);
            finish(c);
            return;
        }
        on_sock_error(c, (int)nread);
        return;
    }
    if (pe != HPE_OK && pe != HPE_PAUSED)
        fail(c, "bad HTTP response: %s", http_errno_description(pe));
}

static void on_connect(uv_connect_t *req, int status)
{
    sock *s = req->handle->data;
    sh__bench_conn *c = s->conn;
    if (!c)
        return;
    if (status < 0) {
        fail(c, "connect to %s: %s", c->cfg->host_header, uv_strerror(status));
        return;
    }
    int rc = uv_read_start((uv_stream_t *)&s->tcp, on_alloc, on_read);
    if (rc < 0) {
        fail(c, "read: %s", uv_strerror(rc));
        return;
    }
    send_request(c);
}

static void open_sock(sh__bench_conn *c)
{
    sock *s = calloc(1, sizeof *s);
    if (!s) {
        fail_later(c, "out of memory");
        return;
    }
    int rc = uv_tcp_init(c->loop, &s->tcp);
    if (rc < 0) {
        free(s);
        fail_later(c, "socket: %s", uv_strerror(rc));
        return;
    }
    s->tcp.data = s;
    s->conn = c;
    c->s = s;
    uv_tcp_nodelay(&s->tcp, 1);
    rc = uv_tcp_connect(&s->creq, &s->tcp, (const struct sockaddr *)&c->cfg->addr, on_connect);
    if (rc < 0)
        fail_later(c, "connect to %s: %s", c->cfg->host_header, uv_strerror(rc));
}

static void on_timer(uv_timer_t *t)
{
    sh__bench_conn *c = t->data;
    if (!c->x)
        return;
    if (c->pending[0]) {
        fail(c, "%s", c->pending);
    } else if (c->got_done) { // the stream ended but the body did not: give up on the socket
        close_sock(c);
        finish(c);
    } else {
        fail(c, "timed out after %.3g s", (double)c->cfg->timeout_ms / 1000.0);
    }
}

/* --- response parsing --- */

static void set_abort(sh__bench_conn *c, const char *fmt, ...) SH_PRINTF(2, 3);
static void set_abort(sh__bench_conn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->x->err, sizeof c->x->err, fmt, ap);
    va_end(ap);
    c->abort = true;
    http_parser_pause(&c->parser, 1);
}

static void dispatch_event(sh__bench_conn *c)
{
    if (c->event.len == 0 || c->got_done) {
        c->event.len = 0;
        return;
    }
    uint64_t now = uv_hrtime();
    if (strcmp(c->event.p, "[DONE]") == 0) {
        c->got_done = true;
        c->x->t_end = now;
        uv_timer_start(&c->timer, on_timer, DONE_GRACE_MS, 0);
    } else if (!c->x->on_event(c->x, c->event.p, c->event.len, now)) {
        c->abort = true;
        http_parser_pause(&c->parser, 1);
    }
    c->event.len = 0;
}

/* One line of the event stream (without its end of line): `field: value`, a comment, or the
 * blank line that ends an event. */
static void sse_line(sh__bench_conn *c, const char *p, size_t n)
{
    if (n == 0) {
        dispatch_event(c);
        return;
    }
    if (p[0] == ':')
        return;
    const char *colon = memchr(p, ':', n);
    size_t fn = colon ? (size_t)(colon - p) : n;
    const char *v = colon ? colon + 1 : p + n;
    if (v < p + n && *v == ' ')
        v++;
    size_t vn = (size_t)(p + n - v);
    if (fn == 4 && memcmp(p, "data", 4) == 0) {
        if ((c->event.len && !buf_append(&c->event, "\n", 1)) || !buf_append(&c->event, v, vn))
            set_abort(c, "out of memory");
    } else if (fn == 5 && memcmp(p, "error", 5) == 0) { // llama.cpp's in-stream errors
        set_abort(c, "error event: %.*s", (int)(vn > 200 ? 200 : vn), v);
    }
}

static void sse_feed(sh__bench_conn *c, const char *p, size_t n)
{
    if (!buf_append(&c->line, p, n)) {
        set_abort(c, "out of memory");
        return;
    }
    size_t start = 0;
    for (;;) {
        char *nl = memchr(c->line.p + start, '\n', c->line.len - start);
        if (!nl)
            break;
        size_t end = (size_t)(nl - c->line.p), len = end - start;
        if (len > 0 && c->line.p[end - 1] == '\r')
            len--;
        sse_line(c, c->line.p + start, len);
        start = end + 1;
        if (c->abort)
            return;
    }
    memmove(c->line.p, c->line.p + start, c->line.len - start);
    c->line.len -= start;
    if (c->line.len > MAX_SSE_LINE)
        set_abort(c, "server-sent event line longer than %u bytes", MAX_SSE_LINE);
}

static int on_header_field(http_parser *p, const char *at, size_t n)
{
    sh__bench_conn *c = p->data;
    if (c->field_done) {
        c->field_len = 0;
        c->field_done = false;
    }
    for (size_t i = 0; i < n && c->field_len < sizeof c->field - 1; i++)
        c->field[c->field_len++] = (char)tolower((unsigned char)at[i]);
    c->field[c->field_len] = '\0';
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t n)
{
    sh__bench_conn *c = p->data;
    if (!c->field_done) {
        c->field_done = true;
        c->in_ctype = strcmp(c->field, "content-type") == 0;
        if (c->in_ctype)
            c->ctype_len = 0;
    }
    for (size_t i = 0; c->in_ctype && i < n && c->ctype_len < sizeof c->ctype - 1; i++)
        c->ctype[c->ctype_len++] = (char)tolower((unsigned char)at[i]);
    c->ctype[c->ctype_len] = '\0';
    return 0;
}

static int on_headers_complete(http_parser *p)
{
    sh__bench_conn *c = p->data;
    sh__bench_xfer *x = c->x;
    x->status = (int)p->status_code;
    // Trust the Content-Type over what was asked for: a server that ignores "stream" answers
    // with one JSON body, or streams events anyway.
    bool json = strncmp(c->ctype, "application/json", 16) == 0;
    bool events = strncmp(c->ctype, "text/event-stream", 17) == 0;
    x->sse = x->status / 100 == 2 && (events || (x->stream && !json));
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n)
{
    sh__bench_conn *c = p->data;
    if (c->x->sse) {
        sse_feed(c, at, n);
        return 0;
    }
    size_t cap = c->x->status / 100 == 2 ? MAX_BODY_OK : MAX_BODY_ERR;
    if (c->body.len + n > cap) {
        if (cap == MAX_BODY_ERR) { // keep the start of an error body, drop the rest
            n = cap - c->body.len;
        } else {
            set_abort(c, "response body larger than %u bytes", MAX_BODY_OK);
            return 0;
        }
    }
    if (n && !buf_append(&c->body, at, n))
        set_abort(c, "out of memory");
    return 0;
}

static int on_message_complete(http_parser *p)
{
    sh__bench_conn *c = p->data;
    if (c->x->sse && !c->abort) {
        if (c->line.len) // a last line without its end of line
            sse_line(c, c->line.p, c->line.len);
        if (!c->abort)
            dispatch_event(c);
    }
    c->complete = true;
    http_parser_pause(p, 1); // one response per exchange; anything after it is not ours
    return 0;
}

static const http_parser_settings parser_settings = {
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

/* --- public --- */

bool sh__bench_http_conn_create(uv_loop_t *loop, const sh__bench_http_cfg *cfg,
                                sh__bench_conn **out)
{
    sh__bench_conn *c = calloc(1, sizeof *c);
    if (!c)
        return false;
    c->loop = loop;
    c->cfg = cfg;
    uv_timer_init(loop, &c->timer);
    c->timer.data = c;
    *out = c;
    return true;
}

void sh__bench_http_start(sh__bench_conn *c, sh__bench_xfer *x)
{
    if (c->x)
        sh_panic("bench: exchange started on a busy connection");
    c->x = x;
    x->t_start = uv_hrtime();
    x->t_end = 0;
    x->status = 0;
    x->sse = x->failed = false;
    x->err[0] = '\0';
    x->resp = NULL;
    x->resp_len = 0;
    c->complete = c->abort = c->got_bytes = c->got_done = c->retried = false;
    c->in_ctype = c->field_done = false;
    c->field_len = c->ctype_len = 0;
    c->ctype[0] = '\0';
    c->pending[0] = '\0';
    c->body.len = c->line.len = c->event.len = 0;
    if (c->body.p)
        c->body.p[0] = '\0';
    http_parser_init(&c->parser, HTTP_RESPONSE);
    c->parser.data = c;
    uv_timer_start(&c->timer, on_timer, c->cfg->timeout_ms, 0);
    if (c->s)
        send_request(c);
    else
        open_sock(c);
}

static void on_timer_close(uv_handle_t *h)
{
    sh__bench_conn *c = h->data;
    buf_free(&c->body);
    buf_free(&c->line);
    buf_free(&c->event);
    free(c);
}

void sh__bench_http_conn_destroy(sh__bench_conn *c)
{
    if (!c)
        return;
    c->x = NULL;
    close_sock(c);
    uv_close((uv_handle_t *)&c->timer, on_timer_close);
}
