/* The HTTP server's request accessors and response writers: full, chunked and SSE streams. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "net/http_internal.h"

const char *sh_http_status_text(int status)
{
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 413:
        return "Payload Too Large";
    case 414:
        return "URI Too Long";
    case 417:
        return "Expectation Failed";
    case 422:
        return "Unprocessable Entity";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Unknown";
    }
}

const char *sh_http_req_method(const sh_http_req *req) { return req->method; }
const char *sh_http_req_path(const sh_http_req *req) { return req->path; }
const char *sh_http_req_query(const sh_http_req *req) { return req->query; }

const char *sh_http_req_header(const sh_http_req *req, const char *name)
{
    for (int i = 0; i < req->n_hdrs; i++) {
        if (req->value_off[i] == SIZE_MAX)
            continue; /* still being parsed */
        if (strcasecmp(req->hdrs.data + req->name_off[i], name) == 0)
            return req->hdrs.data + req->value_off[i];
    }
    return NULL;
}

const char *sh_http_req_body(const sh_http_req *req, size_t *len)
{
    if (len)
        *len = req->body.len;
    return req->body.data ? req->body.data : "";
}

bool sh_http_req_alive(const sh_http_req *req)
{
    return !req->aborted && !req->conn->closing && req->state != SH__HTTP_DONE;
}

bool sh_http_req_writable(const sh_http_req *req)
{
    return sh_http_req_alive(req) && req->conn->queued < req->conn->srv->opts.write_high_water;
}

void sh_http_req_on_writable(sh_http_req *req, sh_http_writable_fn fn, void *arg)
{
    req->on_writable = fn;
    req->writable_arg = arg;
}

static bool has_crlf(const char *s) { return strpbrk(s, "\r\n") != NULL; }

sh_err sh_http_req_add_header(sh_http_req *req, const char *name, const char *value)
{
    if (req->state != SH__HTTP_HANDLING || !*name || has_crlf(name) || has_crlf(value) ||
        strchr(name, ':'))
        return SH_EINVAL;
    sh__http_buf *b = &req->extra;
    if (!sh__http_buf_add(b, name, strlen(name)) || !sh__http_buf_add(b, ": ", 2) ||
        !sh__http_buf_add(b, value, strlen(value)) || !sh__http_buf_add(b, "\r\n", 2))
        return SH_ENOMEM;
    return SH_OK;
}

/* The status line and headers. length < 0: a stream (chunked or close-delimited). */
static bool build_head(sh_http_req *r, sh__http_buf *b, int status, const char *ctype,
                       long long length, bool sse)
{
    char line[256];
    char date[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", &tm);
    if (r->conn->srv->closing || r->conn->srv->draining)
        r->keep_alive = false;
    int n = snprintf(line, sizeof line, "HTTP/1.1 %d %s\r\nDate: %s\r\n", status,
                     sh_http_status_text(status), date);
    bool ok = sh__http_buf_add(b, line, (size_t)n);
    if (ctype && *ctype && !has_crlf(ctype)) {
        n = snprintf(line, sizeof line, "Content-Type: %.200s\r\n", ctype);
        ok = ok && sh__http_buf_add(b, line, (size_t)n);
    }
    if (status == 204) {
        n = 0; /* no body, and RFC 9110 forbids Content-Length on a 204 */
    } else if (length >= 0) {
        n = snprintf(line, sizeof line, "Content-Length: %lld\r\n", length);
    } else if (r->http10) {
        /* HTTP/1.0 has no chunked coding: the end of the body is the end of the connection. */
        r->close_delimited = true;
        r->keep_alive = false;
        n = 0;
    } else {
        r->chunked_out = true;
        n = snprintf(line, sizeof line, "Transfer-Encoding: chunked\r\n");
    }
    ok = ok && sh__http_buf_add(b, line, (size_t)n);
    if (sse) {
        static const char h[] = "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n";
        ok = ok && sh__http_buf_add(b, h, sizeof h - 1);
    }
    n = snprintf(line, sizeof line, "Connection: %s\r\n", r->keep_alive ? "keep-alive" : "close");
    ok = ok && sh__http_buf_add(b, line, (size_t)n);
    if (r->extra.len)
        ok = ok && sh__http_buf_add(b, r->extra.data, r->extra.len);
    return ok && sh__http_buf_add(b, "\r\n", 2);
}

sh_err sh_http_respond(sh_http_req *req, int status, const char *content_type, const void *body,
                       size_t len)
{
    if (req->state != SH__HTTP_HANDLING)
        return SH_EINVAL;
    sh__http_conn *c = req->conn;
    if (req->aborted || c->closing) {
        sh__http_conn_req_done(c, req);
        return SH_ECLOSED;
    }
    sh__http_buf b = {0};
    bool ok = build_head(req, &b, status, content_type, (long long)len, false);
    if (ok && !req->head && len)
        ok = sh__http_buf_add(&b, body, len);
    sh_err rc = ok ? sh__http_conn_write(c, b.data, b.len) : SH_ENOMEM;
    sh__http_buf_free(&b);
    if (rc == SH_ENOMEM && !c->closing)
        sh__http_conn_close(c);
    sh__http_conn_req_done(c, req);
    return rc == SH_OK ? SH_OK : SH_ECLOSED;
}

sh_err sh_http_stream_start(sh_http_req *req, int status, const char *content_type, bool sse)
{
    if (req->state != SH__HTTP_HANDLING)
        return SH_EINVAL;
    sh__http_conn *c = req->conn;
    req->state = SH__HTTP_STREAMING;
    if (req->aborted || c->closing)
        return SH_ECLOSED;
    sh__http_buf b = {0};
    bool ok = build_head(req, &b, status, content_type, -1, sse);
    sh_err rc = ok ? sh__http_conn_write(c, b.data, b.len) : SH_ENOMEM;
    sh__http_buf_free(&b);
    if (rc == SH_ENOMEM && !c->closing)
        sh__http_conn_close(c);
    return rc == SH_OK ? SH_OK : SH_ECLOSED;
}

sh_err sh_http_stream_write(sh_http_req *req, const void *data, size_t len)
{
    if (req->state != SH__HTTP_STREAMING)
        return SH_EINVAL;
    sh__http_conn *c = req->conn;
    if (req->aborted || c->closing)
        return SH_ECLOSED;
    if (len == 0 || req->head)
        return SH_OK; /* an empty chunk would end a chunked body */
    sh_err rc;
    if (req->chunked_out) {
        char pre[32];
        int n = snprintf(pre, sizeof pre, "%zx\r\n", len);
        sh__http_buf b = {0};
        bool ok = sh__http_buf_add(&b, pre, (size_t)n) && sh__http_buf_add(&b, data, len) &&
                  sh__http_buf_add(&b, "\r\n", 2);
        rc = ok ? sh__http_conn_write(c, b.data, b.len) : SH_ENOMEM;
        sh__http_buf_free(&b);
        if (rc == SH_ENOMEM && !c->closing)
            sh__http_conn_close(c);
    } else {
        rc = sh__http_conn_write(c, data, len);
    }
    if (rc != SH_OK)
        return rc;
    if (c->queued >= c->srv->opts.write_high_water) {
        req->want_writable = true;
        return SH_EBUSY;
    }
    return SH_OK;
}

sh_err sh_http_stream_end(sh_http_req *req)
{
    if (req->state == SH__HTTP_HANDLING)
        return sh_http_respond(req, 500, NULL, NULL, 0);
    sh__http_conn *c = req->conn;
    sh_err rc = SH_OK;
    if (req->aborted || c->closing)
        rc = SH_ECLOSED;
    else if (req->chunked_out && !req->head)
        rc = sh__http_conn_write(c, "0\r\n\r\n", 5) == SH_OK ? SH_OK : SH_ECLOSED;
    sh__http_conn_req_done(c, req);
    return rc;
}
