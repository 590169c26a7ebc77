/* The HTTP server's listener and connections: accept, parse with http-parser, limits, timers. */
#include <dirent.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>

#include "net/http_internal.h"

/* How long a closing connection keeps reading (and discarding) after its last response, so that
 * unread request bytes do not turn the close into a reset that destroys the response. */
#define LINGER_MS 2000

enum { PHASE_IDLE, PHASE_HEADERS, PHASE_BODY, PHASE_ACTIVE, PHASE_LINGER };

static void conn_process(sh__http_conn *c);
static void conn_arm_timer(sh__http_conn *c);
static void conn_read_start(sh__http_conn *c);

bool sh__http_buf_add(sh__http_buf *b, const void *p, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return false;
        b->data = d;
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0'; /* always terminated, so text buffers are C strings */
    return true;
}

void sh__http_buf_free(sh__http_buf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

static void req_free(sh_http_req *r)
{
    if (!r)
        return;
    sh__http_buf_free(&r->url);
    sh__http_buf_free(&r->hdrs);
    sh__http_buf_free(&r->body);
    sh__http_buf_free(&r->extra);
    free(r);
}

static void server_maybe_done(sh_http_server *s)
{
    if (!s->closing || s->refs > 0)
        return;
    sh_http_closed_fn done = s->done;
    void *arg = s->done_arg;
    free(s);
    if (done)
        done(arg);
}

static void conn_unref(sh__http_conn *c)
{
    if (--c->refs > 0)
        return;
    sh_http_server *s = c->srv;
    sh__http_buf_free(&c->rbuf);
    free(c);
    s->refs--;
    server_maybe_done(s);
}

static void on_handle_closed(uv_handle_t *h) { conn_unref(h->data); }

void sh__http_conn_close(sh__http_conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    sh_http_server *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    if (c->rejecting)
        s->n_rejecting--;
    else
        s->n_conns--;
    req_free(c->parsing);
    c->parsing = NULL;
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
    if (c->active) {
        /* The handler still holds the request: tell it from the next loop iteration (never from
         * inside a call it is making), and keep the timer until the request is completed. */
        c->active->aborted = true;
        conn_arm_timer(c);
    } else {
        uv_close((uv_handle_t *)&c->timer, on_handle_closed);
    }
}

static void on_shutdown(uv_shutdown_t *sr, int status)
{
    sh__http_conn *c = sr->data;
    if (status < 0)
        sh__http_conn_close(c);
}

/* The last response is out: half-close and drain the input for a moment, then close. */
static void conn_linger(sh__http_conn *c)
{
    if (c->closing || c->phase == PHASE_LINGER)
        return;
    c->phase = PHASE_LINGER;
    c->phase_start = uv_now(c->srv->loop);
    c->shutdown.data = c;
    if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        sh__http_conn_close(c);
        return;
    }
    if (!c->reading) {
        /* conn_process restarts reading only for live phases; lingering needs it too. */
        c->reading = true;
        conn_read_start(c);
    }
    conn_arm_timer(c);
}

typedef struct wreq {
    uv_write_t w;
    size_t n;
    char data[];
} wreq;

static void on_write(uv_write_t *w, int status)
{
    wreq *wr = (wreq *)w;
    sh__http_conn *c = w->data;
    c->queued -= wr->n;
    c->pending_writes--;
    free(wr);
    if (status < 0) {
        sh__http_conn_close(c);
        return;
    }
    if (c->closing)
        return;
    if (c->close_after_write && c->pending_writes == 0 && !c->active) {
        conn_linger(c);
        return;
    }
    sh_http_req *r = c->active;
    if (r && r->want_writable && c->queued < c->srv->opts.write_high_water / 2) {
        r->want_writable = false;
        if (r->on_writable)
            r->on_writable(r, r->writable_arg);
    }
}

sh_err sh__http_conn_write(sh__http_conn *c, const void *p, size_t n)
{
    if (c->closing)
        return SH_ECLOSED;
    wreq *wr = malloc(sizeof *wr + n);
    if (!wr) {
        sh__http_conn_close(c);
        return SH_ENOMEM;
    }
    memcpy(wr->data, p, n);
    wr->n = n;
    wr->w.data = c;
    uv_buf_t b = uv_buf_init(wr->data, (unsigned)n);
    if (uv_write(&wr->w, (uv_stream_t *)&c->tcp, &b, 1, on_write) < 0) {
        free(wr);
        sh__http_conn_close(c);
        return SH_ECLOSED;
    }
    c->queued += n;
    c->pending_writes++;
    return SH_OK;
}

void sh__http_conn_error(sh__http_conn *c, int status, const char *json_body)
{
    char head[512];
    size_t blen = strlen(json_body);
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Connection: close\r\n\r\n",
                      status, sh_http_status_text(status), blen);
    req_free(c->parsing);
    c->parsing = NULL;
    c->close_after_write = true;
    if (sh__http_conn_write(c, head, (size_t)hl) == SH_OK &&
        sh__http_conn_write(c, json_body, blen) == SH_OK)
        c->phase = PHASE_ACTIVE; /* no read timeouts while the error drains */
}

/* A JSON error body in OpenAI's shape, for errors the server produces itself. */
static void conn_fail(sh__http_conn *c, int status, const char *msg)
{
    char body[384];
    snprintf(body, sizeof body,
             "{\"error\":{\"message\":\"%s\",\"type\":\"%s\",\"param\":null,\"code\":null}}", msg,
             status >= 500 ? "server_error" : "invalid_request_error");
    sh__http_conn_error(c, status, body);
}

void sh__http_conn_req_done(sh__http_conn *c, sh_http_req *req)
{
    bool keep = req->keep_alive && !c->srv->closing && !c->srv->draining;
    c->srv->n_active--;
    req->state = SH__HTTP_DONE;
    req_free(req);
    c->active = NULL;
    c->refs--; /* the request's reference; the handles still hold theirs */
    if (c->closing) {
        if (!uv_is_closing((uv_handle_t *)&c->timer))
            uv_close((uv_handle_t *)&c->timer, on_handle_closed);
        return;
    }
    if (!keep) {
        c->close_after_write = true;
        if (c->pending_writes == 0)
            conn_linger(c);
        return;
    }
    c->phase = PHASE_IDLE;
    c->phase_start = uv_now(c->srv->loop);
    /* Parse pipelined input from the next loop iteration, not from inside the caller's call. */
    c->resume_pending = true;
    conn_arm_timer(c);
}

/* --- timers --- */

/* How long the connection may stay in its current phase (ms), or 0 when no timer applies. */
static uint64_t phase_limit(const sh__http_conn *c)
{
    const sh_http_opts *o = &c->srv->opts;
    switch (c->phase) {
    case PHASE_IDLE:
        /* A connection that has not started its first request gets the header timeout from
         * accept: idle sockets opened and never used must not hold descriptors for a minute. */
        return c->fresh ? o->header_timeout_ms : o->idle_timeout_ms;
    case PHASE_HEADERS:
        return o->header_timeout_ms;
    case PHASE_BODY:
        return o->request_timeout_ms;
    case PHASE_LINGER:
        return LINGER_MS;
    default:
        return 0;
    }
}

static void on_timer(uv_timer_t *t)
{
    sh__http_conn *c = t->data;
    if (c->closing) {
        sh_http_req *r = c->active;
        if (r && !r->abort_notified && r->on_abort) {
            r->abort_notified = true;
            r->on_abort(r, r->abort_arg);
        }
        return;
    }
    if (c->resume_pending) {
        c->resume_pending = false;
        conn_process(c);
        if (c->closing)
            return;
    }
    uint64_t now = uv_now(c->srv->loop), limit = phase_limit(c);
    if (limit == 0)
        return;
    if (now - c->phase_start < limit) {
        conn_arm_timer(c);
        return;
    }
    if (c->phase == PHASE_HEADERS || c->phase == PHASE_BODY)
        conn_fail(c, 408, "the request was not received in time");
    else
        sh__http_conn_close(c);
}

static void conn_arm_timer(sh__http_conn *c)
{
    if (c->closing) {
        if (c->active && !c->active->abort_notified && c->active->on_abort)
            uv_timer_start(&c->timer, on_timer, 0, 0);
        return;
    }
    if (c->resume_pending) {
        uv_timer_start(&c->timer, on_timer, 0, 0);
        return;
    }
    uint64_t limit = phase_limit(c);
    if (limit == 0) {
        uv_timer_stop(&c->timer);
        return;
    }
    uint64_t now = uv_now(c->srv->loop), end = c->phase_start + limit;
    uv_timer_start(&c->timer, on_timer, end > now ? end - now : 0, 0);
}

void sh_http_req_on_abort(sh_http_req *req, sh_http_abort_fn fn, void *arg)
{
    req->on_abort = fn;
    req->abort_arg = arg;
    if (req->aborted && !req->abort_notified)
        conn_arm_timer(req->conn);
}

/* --- parser callbacks --- */

static int header_limit(sh__http_conn *c, size_t n)
{
    c->header_bytes += (uint32_t)(n > UINT32_MAX / 2 ? UINT32_MAX / 2 : n);
    if (c->header_bytes > c->srv->opts.max_header_bytes) {
        c->err_status = 431;
        return 1;
    }
    return 0;
}

static int on_message_begin(http_parser *p)
{
    sh__http_conn *c = p->data;
    req_free(c->parsing);
    c->parsing = calloc(1, sizeof *c->parsing);
    if (!c->parsing) {
        c->err_status = 503;
        return 1;
    }
    c->parsing->conn = c;
    c->parsing->last_was_value = true;
    c->header_bytes = 0;
    c->phase = PHASE_HEADERS;
    if (!c->fresh) /* the first request's clock started at accept */
        c->phase_start = uv_now(c->srv->loop);
    c->fresh = false;
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t n)
{
    sh__http_conn *c = p->data;
    if (header_limit(c, n)) {
        c->err_status = 414;
        return 1;
    }
    return sh__http_buf_add(&c->parsing->url, at, n) ? 0 : (c->err_status = 503, 1);
}

static int on_header_field(http_parser *p, const char *at, size_t n)
{
    sh__http_conn *c = p->data;
    sh_http_req *r = c->parsing;
    if (header_limit(c, n + 4))
        return 1;
    if (r->last_was_value) {
        if (r->n_hdrs == SH_HTTP_MAX_HEADERS) {
            c->err_status = 431;
            return 1;
        }
        if (r->n_hdrs > 0 && !sh__http_buf_add(&r->hdrs, "", 1))
            return c->err_status = 503, 1;
        r->name_off[r->n_hdrs] = r->hdrs.len;
        r->value_off[r->n_hdrs] = SIZE_MAX; /* no value yet */
        r->n_hdrs++;
        r->last_was_value = false;
    }
    return sh__http_buf_add(&r->hdrs, at, n) ? 0 : (c->err_status = 503, 1);
}

static int on_header_value(http_parser *p, const char *at, size_t n)
{
    sh__http_conn *c = p->data;
    sh_http_req *r = c->parsing;
    if (header_limit(c, n))
        return 1;
    if (!r->last_was_value) {
        if (!sh__http_buf_add(&r->hdrs, "", 1))
            return c->err_status = 503, 1;
        r->value_off[r->n_hdrs - 1] = r->hdrs.len;
        r->last_was_value = true;
    }
    return sh__http_buf_add(&r->hdrs, at, n) ? 0 : (c->err_status = 503, 1);
}

static int on_headers_complete(http_parser *p)
{
    sh__http_conn *c = p->data;
    sh_http_req *r = c->parsing;
    /* Terminate the last header; a header without a value gets an empty one. */
    if (r->n_hdrs > 0 && r->value_off[r->n_hdrs - 1] == SIZE_MAX) {
        if (!sh__http_buf_add(&r->hdrs, "", 1))
            return c->err_status = 503, -1;
        r->value_off[r->n_hdrs - 1] = r->hdrs.len;
    }
    if (!sh__http_buf_add(&r->hdrs, "", 1) || !sh__http_buf_add(&r->url, "", 0))
        return c->err_status = 503, -1;
    char *u = r->url.data ? r->url.data : (char *)"";
    char *hash = strchr(u, '#');
    if (hash)
        *hash = '\0';
    char *q = strchr(u, '?');
    if (q)
        *q++ = '\0';
    r->path = u;
    r->query = q ? q : u + strlen(u); /* "" */
    snprintf(r->method, sizeof r->method, "%s", http_method_str((enum http_method)p->method));
    if (p->http_major != 1) {
        c->err_status = 505; /* HTTP/0.9 and HTTP/2+ are not spoken here */
        return -1;
    }
    r->http10 = p->http_major == 0 || (p->http_major == 1 && p->http_minor == 0);
    r->head = p->method == HTTP_HEAD;
    c->phase = PHASE_BODY;
    bool has_length = p->content_length != ULLONG_MAX && p->content_length > 0;
    bool has_body = has_length || (p->flags & F_CHUNKED);
    if (has_length && p->content_length > c->srv->opts.max_body_bytes) {
        c->err_status = 413;
        return -1;
    }
    const char *expect = sh_http_req_header(r, "expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") != 0) {
            c->err_status = 417;
            return -1;
        }
        if (has_body && !r->http10 && !c->sent_continue) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            if (sh__http_conn_write(c, cont, sizeof cont - 1) != SH_OK)
                return c->err_status = 503, -1;
        }
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n)
{
    sh__http_conn *c = p->data;
    sh_http_req *r = c->parsing;
    if (r->body.len + n > c->srv->opts.max_body_bytes) {
        c->err_status = 413;
        return 1;
    }
    return sh__http_buf_add(&r->body, at, n) ? 0 : (c->err_status = 503, 1);
}

static int on_message_complete(http_parser *p)
{
    sh__http_conn *c = p->data;
    sh_http_req *r = c->parsing;
    if (!sh__http_buf_add(&r->body, "", 0))
        return c->err_status = 503, 1;
    r->keep_alive =
        http_should_keep_alive(p) && !c->srv->closing && !c->srv->draining && !p->upgrade;
    /* Stop here: the next pipelined request waits until this one is answered. */
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

/* --- reading --- */

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    sh__http_conn *c = h->data;
    size_t want = 16 * 1024;
    if (c->rbuf.cap < c->rbuf.len + want + 1) {
        size_t cap = c->rbuf.len + want + 1;
        char *d = realloc(c->rbuf.data, cap);
        if (!d) {
            *buf = uv_buf_init(NULL, 0); /* libuv reports UV_ENOBUFS; the connection closes */
            return;
        }
        c->rbuf.data = d;
        c->rbuf.cap = cap;
    }
    *buf = uv_buf_init(c->rbuf.data + c->rbuf.len, (unsigned)want);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    sh__http_conn *c = st->data;
    if (nread < 0) {
        sh__http_conn_close(c);
        return;
    }
    if (nread == 0 || c->closing)
        return;
    if (c->phase == PHASE_LINGER || c->close_after_write)
        return; /* discarded: the connection is on its way out */
    c->rbuf.len += (size_t)nread;
    conn_process(c);
}

static void conn_read_start(sh__http_conn *c)
{
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0)
        sh__http_conn_close(c);
}

static void dispatch(sh__http_conn *c)
{
    sh_http_req *r = c->parsing;
    c->parsing = NULL;
    c->active = r;
    c->refs++;
    c->phase = PHASE_ACTIVE;
    c->srv->n_active++;
    r->state = SH__HTTP_HANDLING;
    c->srv->opts.handler(r, c->srv->opts.user);
}

static void conn_process(sh__http_conn *c)
{
    if (c->in_process)
        return;
    c->in_process = true;
    while (!c->closing && !c->active && !c->close_after_write && c->roff < c->rbuf.len) {
        size_t avail = c->rbuf.len - c->roff;
        size_t n = http_parser_execute(&c->parser, &settings, c->rbuf.data + c->roff, avail);
        c->roff += n;
        enum http_errno err = HTTP_PARSER_ERRNO(&c->parser);
        if (err == HPE_PAUSED) {
            http_parser_pause(&c->parser, 0);
            dispatch(c);
            continue;
        }
        if (err != HPE_OK || n < avail) {
            int st = c->err_status ? c->err_status : 400;
            if (err == HPE_HEADER_OVERFLOW)
                st = 431;
            conn_fail(c, st,
                      st == 413   ? "the request body is too large"
                      : st == 431 ? "the request headers are too large"
                      : st == 414 ? "the request URL is too long"
                      : st == 417 ? "unsupported Expect header"
                      : st == 505 ? "only HTTP/1.0 and HTTP/1.1 are supported"
                      : st == 503 ? "out of memory"
                                  : "malformed HTTP request");
            break;
        }
    }
    if (c->roff > 0) {
        memmove(c->rbuf.data, c->rbuf.data + c->roff, c->rbuf.len - c->roff);
        c->rbuf.len -= c->roff;
        c->roff = 0;
    }
    if (!c->closing && c->phase != PHASE_LINGER) {
        /* Keep reading while a request is answered (to see a disconnect) unless too much
         * pipelined input is waiting. */
        bool want = !(c->active && c->rbuf.len >= SH_HTTP_PIPELINE_CAP) && !c->close_after_write;
        if (want && !c->reading) {
            c->reading = true;
            conn_read_start(c);
        } else if (!want && c->reading) {
            c->reading = false;
            uv_read_stop((uv_stream_t *)&c->tcp);
        }
    }
    c->in_process = false;
    if (!c->closing)
        conn_arm_timer(c);
}

/* --- the listener --- */

/* Calls the log callback for event ev at most once a minute, with the count since the last call
 * and the text of fmt appended. */
static void server_log(sh_http_server *s, int ev, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void server_log(sh_http_server *s, int ev, const char *key, const char *fmt, ...)
{
    s->log_count[ev]++;
    uint64_t now = uv_now(s->loop) + 1; /* + 1: 0 means never */
    if (!s->opts.log || (s->log_at[ev] && now - s->log_at[ev] < 60000))
        return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof msg && s->log_count[ev] > 1)
        snprintf(msg + n, sizeof msg - (size_t)n, " (%llu times since the last report)",
                 (unsigned long long)s->log_count[ev]);
    s->log_at[ev] = now;
    s->log_count[ev] = 0;
    s->opts.log(s->opts.user, key, msg);
}

static bool same_ip(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                      &((const struct sockaddr_in6 *)b)->sin6_addr, 16) == 0;
    return false;
}

/* Whether c may be closed to make room: no request being answered, nothing left to write, not
 * part way through a request body (an upload in progress is work, not idleness). */
static bool conn_idle(const sh__http_conn *c)
{
    if (c->closing || c->active || c->rejecting || c->pending_writes > 0)
        return false;
    if (c->phase == PHASE_LINGER)
        return true; /* its last response is out */
    return !c->close_after_write && c->phase != PHASE_BODY && c->phase != PHASE_ACTIVE;
}

/* The idle connection that has been in its state longest (of peer's address when peer is set),
 * or NULL. */
static sh__http_conn *oldest_idle(sh_http_server *s, const struct sockaddr_storage *peer)
{
    sh__http_conn *best = NULL;
    for (sh__http_conn *c = s->conns; c; c = c->next) {
        if (!conn_idle(c) || (peer && (!c->has_peer || !same_ip(&c->peer, peer))))
            continue;
        if (!best || c->phase_start < best->phase_start)
            best = c;
    }
    return best;
}

static uint32_t conns_from(const sh_http_server *s, const struct sockaddr_storage *peer)
{
    uint32_t n = 0;
    for (const sh__http_conn *c = s->conns; c; c = c->next)
        if (!c->closing && !c->rejecting && c->has_peer && same_ip(&c->peer, peer))
            n++;
    return n;
}

/* Closes idle connections, oldest first, until at most `keep` are open; returns how many. */
static uint32_t shed_to(sh_http_server *s, uint32_t keep)
{
    uint32_t n = 0;
    while (s->n_conns > keep) {
        sh__http_conn *v = oldest_idle(s, NULL);
        if (!v)
            break;
        sh__http_conn_close(v); /* libuv closes the descriptor now, not in the callback */
        n++;
    }
    s->stats.shed += n;
    return n;
}

/* Descriptors open in this process now. */
static uint32_t count_open_fds(uint64_t limit)
{
    uint32_t n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)))
            if (de->d_name[0] != '.')
                n++;
        closedir(d);
        return n > 0 ? n - 1 : 0; /* less the directory's own descriptor */
    }
    for (uint64_t fd = 0; fd < limit && fd < 65536; fd++)
        if (fcntl((int)fd, F_GETFD) != -1)
            n++;
    return n;
}

/* Sets the descriptor budget (see http.h) from the limit and the descriptors open now, the
 * server's own connections not counted as used elsewhere. At most once a second at run time. */
static void fd_budget_refresh(sh_http_server *s)
{
    struct rlimit rl;
    uint64_t lim = 1u << 20;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        lim = (uint64_t)rl.rlim_cur;
    uint64_t reserve = 8 + lim / 64;
    if (reserve > 64)
        reserve = 64;
    uint64_t used = count_open_fds(lim), mine = s->n_conns + s->n_rejecting;
    used = used > mine ? used - mine : 0;
    uint64_t budget = lim > used + reserve + 4 ? lim - used - reserve : 4;
    s->fd_limit = lim;
    s->fd_reserve = (uint32_t)reserve;
    s->fd_budget = budget > UINT32_MAX ? UINT32_MAX : (uint32_t)budget;
    s->fd_budget_at = uv_now(s->loop);
}

/* Descriptors are short: a connection just accepted got a descriptor number inside the reserve
 * (the lowest free number: at least that many are open), or accept failed with EMFILE/ENFILE
 * (libuv reports that only when it could not drop the pending connections with a descriptor of
 * its own). Opened elsewhere in the process, or the limit was lowered, descriptors are fewer
 * than the budget assumed: the budget drops to the connections open now and idle ones are shed,
 * oldest first, until half the reserve is free again (the budget is recounted a second later
 * and grows back once descriptors are free). */
static void on_fd_short(sh_http_server *s, const char *why)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        s->fd_limit = (uint64_t)rl.rlim_cur;
        uint64_t reserve = 8 + s->fd_limit / 64;
        s->fd_reserve = reserve > 64 ? 64 : (uint32_t)reserve;
    }
    uint32_t open = s->n_conns, margin = s->fd_reserve / 2 + 1;
    if (s->fd_budget <= open && uv_now(s->loop) - s->fd_budget_at < 1000)
        return; /* already handled just now */
    uint32_t shed = shed_to(s, open > margin ? open - margin : 0);
    s->fd_budget = open > 1 ? open : 1;
    s->fd_budget_at = uv_now(s->loop);
    server_log(s, SH__HTTP_LOG_FD, "fd_limit",
               "%s (RLIMIT_NOFILE %llu): out of file descriptors; %u connections were open, %u "
               "idle ones closed, at most %u from now on",
               why, (unsigned long long)s->fd_limit, open, shed, s->fd_budget);
}

static void on_connection(uv_stream_t *ls, int status)
{
    sh_http_server *s = ls->data;
    if (status == UV_EMFILE || status == UV_ENFILE) {
        s->stats.accept_errors++;
        if (!s->closing)
            on_fd_short(s, uv_strerror(status));
        return;
    }
    if (status < 0 || s->closing)
        return;
    sh__http_conn *c = calloc(1, sizeof *c);
    if (!c)
        return; /* the pending connection stays in the backlog until memory is back */
    c->srv = s;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    c->tcp.data = c;
    c->timer.data = c;
    c->refs = 2;
    s->refs++;
    bool accepted = uv_accept(ls, (uv_stream_t *)&c->tcp) == 0;
    if (accepted) {
        int len = sizeof c->peer;
        c->has_peer = uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->peer, &len) == 0;
        s->stats.accepted++;
        uv_os_fd_t fd;
        if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0 &&
            (uint64_t)fd + s->fd_reserve >= s->fd_limit) {
            s->stats.fd_short++;
            on_fd_short(s, "accepted a descriptor inside the reserve");
        }
    }
    /* Room for it: at a limit, the longest-idle connection makes way (of the same address for
     * the per-address limit); only when nothing is idle is the new one turned away. This is
     * decided before c joins the list, so it is never its own victim. */
    int reject = 0;
    if (accepted && s->opts.max_conns_per_ip && c->has_peer &&
        conns_from(s, &c->peer) >= s->opts.max_conns_per_ip) {
        sh__http_conn *v = oldest_idle(s, &c->peer);
        server_log(s, SH__HTTP_LOG_PER_IP, "conn_limit",
                   "a client address reached --max-conns-per-ip %u: %s", s->opts.max_conns_per_ip,
                   v ? "closing its longest-idle connection" : "refusing new ones (429)");
        if (v) {
            sh__http_conn_close(v);
            s->stats.shed++;
        } else {
            reject = 429;
        }
    }
    uint32_t limit = s->opts.max_conns < s->fd_budget ? s->opts.max_conns : s->fd_budget;
    if (accepted && !reject && s->n_conns >= limit && limit < s->opts.max_conns &&
        uv_now(s->loop) - s->fd_budget_at >= 1000) {
        fd_budget_refresh(s); /* descriptors may have come free since it was last counted */
        limit = s->opts.max_conns < s->fd_budget ? s->opts.max_conns : s->fd_budget;
    }
    if (accepted && !reject && s->n_conns >= limit) {
        bool fd = s->fd_budget <= s->opts.max_conns;
        uint32_t shed = shed_to(s, limit - 1);
        if (fd)
            server_log(s, SH__HTTP_LOG_FD, "fd_limit",
                       "%u connections reach the file-descriptor budget (RLIMIT_NOFILE %llu, %u "
                       "kept in reserve): %s",
                       s->n_conns + shed, (unsigned long long)s->fd_limit, s->fd_reserve,
                       shed ? "closing the longest-idle connections for new ones"
                            : "none is idle, refusing new ones (503)");
        else
            server_log(s, SH__HTTP_LOG_CONNS, "conn_limit", "%u connections reach --max-conns: %s",
                       s->n_conns + shed,
                       shed ? "closing the longest-idle connections for new ones"
                            : "none is idle, refusing new ones (503)");
        if (!shed)
            reject = 503;
    }
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    c->rejecting = reject != 0;
    if (reject)
        s->n_rejecting++;
    else
        s->n_conns++;
    if (!accepted) {
        sh__http_conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->phase = PHASE_IDLE;
    c->fresh = true;
    c->phase_start = uv_now(s->loop);
    if (reject) {
        s->stats.rejected++;
        /* Answers take descriptors from the reserve: only a few at a time, the rest of a flood
         * is closed without one. */
        if (s->n_rejecting > s->fd_reserve / 2 + 1) {
            sh__http_conn_close(c);
            return;
        }
        conn_fail(c, reject,
                  reject == 429 ? "too many connections from this address; retry later"
                                : "the server has too many connections; retry later");
        return;
    }
    c->reading = true;
    conn_read_start(c);
    conn_arm_timer(c);
}

static void on_listener_closed(uv_handle_t *h)
{
    sh_http_server *s = h->data;
    s->refs--;
    server_maybe_done(s);
}

sh_err sh_http_server_create(uv_loop_t *loop, const sh_http_opts *opts, sh_http_server **out,
                             sh_error *e)
{
    *out = NULL;
    if (!loop || !opts || !opts->handler) {
        if (e)
            *e = (sh_error){SH_EINVAL, "http: loop, options and handler are required"};
        return SH_EINVAL;
    }
    sh_http_server *s = calloc(1, sizeof *s);
    if (!s)
        return SH_ENOMEM;
    s->loop = loop;
    s->opts = *opts;
    sh_http_opts *o = &s->opts;
    if (!o->host)
        o->host = "127.0.0.1";
    o->max_conns = o->max_conns ? o->max_conns : 1024;
    o->max_header_bytes = o->max_header_bytes ? o->max_header_bytes : 16384;
    o->max_body_bytes = o->max_body_bytes ? o->max_body_bytes : 1u << 20;
    o->header_timeout_ms = o->header_timeout_ms ? o->header_timeout_ms : 10000;
    o->request_timeout_ms = o->request_timeout_ms ? o->request_timeout_ms : 30000;
    o->idle_timeout_ms = o->idle_timeout_ms ? o->idle_timeout_ms : 60000;
    o->write_high_water = o->write_high_water ? o->write_high_water : 1u << 20;
    struct sockaddr_storage ss;
    if (uv_ip4_addr(o->host, o->port, (struct sockaddr_in *)&ss) != 0 &&
        uv_ip6_addr(o->host, o->port, (struct sockaddr_in6 *)&ss) != 0) {
        if (e) {
            e->code = SH_EINVAL;
            snprintf(e->msg, sizeof e->msg, "http: host '%.200s' is not an IP literal", o->host);
        }
        free(s);
        return SH_EINVAL;
    }
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    int rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&ss, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
    if (rc == 0) {
        struct sockaddr_storage got;
        int len = sizeof got;
        rc = uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len);
        if (rc == 0)
            s->port = got.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&got)->sin6_port)
                                                : ntohs(((struct sockaddr_in *)&got)->sin_port);
    }
    if (rc < 0) {
        if (e) {
            e->code = SH_EIO;
            snprintf(e->msg, sizeof e->msg, "http: listen on %.200s:%d: %s", o->host, o->port,
                     uv_strerror(rc));
        }
        /* Close the listener and free the server from its close callback. */
        s->closing = true;
        s->refs = 1;
        uv_close((uv_handle_t *)&s->listener, on_listener_closed);
        return SH_EIO;
    }
    s->refs = 1;
    s->listener_open = true;
    fd_budget_refresh(s);
    *out = s;
    return SH_OK;
}

int sh_http_server_port(const sh_http_server *srv) { return srv->port; }

uint32_t sh_http_server_conns(const sh_http_server *srv) { return srv->n_conns; }

uint32_t sh_http_server_active(const sh_http_server *srv) { return srv->n_active; }

void sh_http_server_stats(const sh_http_server *srv, sh_http_stats *out)
{
    *out = srv->stats;
    out->fd_budget = srv->fd_budget;
}

void sh_http_server_drain(sh_http_server *s)
{
    if (!s || s->draining || s->closing)
        return;
    s->draining = true;
    for (sh__http_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->active)
            c->active->keep_alive = false;
        else if (conn_idle(c) && c->phase == PHASE_IDLE)
            sh__http_conn_close(c); /* between requests (or before the first): nothing is lost */
    }
}

void sh_http_server_close(sh_http_server *s, bool abort, sh_http_closed_fn done, void *arg)
{
    if (!s)
        return;
    if (!s->closing) {
        s->closing = true;
        s->done = done;
        s->done_arg = arg;
        s->listener_open = false;
        uv_close((uv_handle_t *)&s->listener, on_listener_closed);
    } else if (!abort || s->aborting) {
        return;
    }
    s->aborting = abort;
    for (sh__http_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (abort || !c->active)
            sh__http_conn_close(c);
        else
            c->active->keep_alive = false;
    }
}
