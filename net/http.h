/* A small HTTP/1.1 server on a caller's libuv loop: keep-alive, pipelining, limits, streaming. */
#ifndef SH_NET_HTTP_H
#define SH_NET_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "shoal/err.h"

/* Threading: every function here is for the thread that runs the server's uv loop, and every
 * callback runs on it. The server starts no thread and no loop of its own.
 *
 * Requests on one connection are handled strictly in order: after a request is parsed the
 * connection stops parsing (later pipelined bytes stay buffered, up to a cap) until that request's
 * response is complete. A request handle is given to the handler once and must be completed by
 * exactly one call of sh_http_respond() or sh_http_stream_end(), now or later, even after the
 * client went away (those calls then return SH_ECLOSED and still release the handle). The
 * connection and the server stay allocated until every handle given out is completed.
 *
 * Request bodies: Content-Length and chunked transfer coding are both accepted (http-parser
 * decodes chunks); max_body_bytes applies to the decoded body. `Expect: 100-continue` is answered
 * with 100 Continue once the headers pass the limits (413 otherwise); any other expectation gets
 * 417. An EOF from the client while its request is being answered counts as a disconnect (the
 * abort callback fires): streaming clients that half-close are not supported. */

typedef struct sh_http_server sh_http_server;
typedef struct sh_http_req sh_http_req;

/* Called once per complete request. The handler owns `req` until it completes it (see above);
 * it may complete it before returning or later from any callback on the same loop. */
typedef void (*sh_http_handler_fn)(sh_http_req *req, void *user);

/* Called at most once when the client disconnects (or the server aborts the connection) before
 * the request was completed: the handler should cancel its work and then complete the handle
 * (sh_http_respond / sh_http_stream_end return SH_ECLOSED and release it). */
typedef void (*sh_http_abort_fn)(sh_http_req *req, void *arg);

/* Called when a stream that had hit the write high-water mark drained below half of it. */
typedef void (*sh_http_writable_fn)(sh_http_req *req, void *arg);

/* Called once when a closed server has released every handle; the server is freed after it. */
typedef void (*sh_http_closed_fn)(void *arg);

/* Called for conditions an operator should see (the server out of file descriptors, idle
 * connections shed at a limit). `event` is a short key ("fd_limit", "conn_limit"), `detail` one
 * line of text. The server calls it at most once per event key per minute, with the count of
 * occurrences since the previous call in the text, never once per connection. */
typedef void (*sh_http_log_fn)(void *user, const char *event, const char *detail);

/* Connection limits and shedding. A connection is "idle" when it has no request being answered
 * and nothing left to write: waiting for its first request, between keep-alive requests, part
 * way through request headers, or lingering after its last response. When a new connection
 * would exceed max_conns, max_conns_per_ip or the file-descriptor budget, the idle connection
 * that has waited longest (of that address, for the per-address limit) is closed to make room;
 * only when none is idle is the new one answered 503 (429 for the per-address limit) and closed.
 * The file-descriptor budget is RLIMIT_NOFILE less the descriptors open elsewhere in the process
 * (counted at creation, and again at most once a second while connections are at the budget)
 * less a reserve (8 + limit/64, at most 64), so accepting does not run the process out of
 * descriptors (libuv's own answer to EMFILE is to accept and close every pending connection).
 * When descriptors are short anyway (opened elsewhere in between: an accepted descriptor number
 * falls inside the reserve, or accept fails), idle connections are shed, oldest first, until
 * half the reserve is free, and the budget drops to the connections still open. */
typedef struct sh_http_opts {
    const char *host;            /* IPv4 or IPv6 literal to bind; NULL: "127.0.0.1" */
    int port;                    /* 0: an ephemeral port (see sh_http_server_port) */
    uint32_t max_conns;          /* open connections (default 1024); see above */
    uint32_t max_conns_per_ip;   /* open connections from one client address (0: no limit) */
    uint32_t max_header_bytes;   /* request line + header names/values (default 16384) -> 431 */
    uint64_t max_body_bytes;     /* decoded body (default 1 MiB) -> 413 */
    uint32_t header_timeout_ms;  /* to the end of a request's headers (default 10000): counted from
                                    accept for a connection's first request (a connection that
                                    sends nothing is closed silently after it), from the first
                                    byte for later keep-alive requests; late headers get 408 */
    uint32_t request_timeout_ms; /* to the end of the body, counted like header_timeout_ms
                                    (default 30000) -> 408 */
    uint32_t idle_timeout_ms;    /* keep-alive wait for the next request after a response
                                    (default 60000); then closed silently */
    size_t write_high_water;     /* queued response bytes before a stream is not writable
                                    (default 1 MiB) */
    sh_http_handler_fn handler;  /* required */
    void *user;                  /* passed to handler and log */
    sh_http_log_fn log;          /* optional */
} sh_http_opts;

/* Binds, listens and starts accepting on `loop`. Zero option fields take their defaults.
 * Returns SH_EINVAL (no handler, bad host literal), SH_EIO (bind/listen failed: address in use,
 * permission; the libuv text is in e), SH_ENOMEM; nothing is left open on failure. */
sh_err sh_http_server_create(uv_loop_t *loop, const sh_http_opts *opts, sh_http_server **out,
                             sh_error *e);

/* The bound port (useful with port 0). */
int sh_http_server_port(const sh_http_server *srv);

/* Open connections, for tests and metrics. */
uint32_t sh_http_server_conns(const sh_http_server *srv);

/* Requests given to the handler and not completed yet. */
uint32_t sh_http_server_active(const sh_http_server *srv);

/* Counters since creation, for metrics. */
typedef struct sh_http_stats {
    uint64_t accepted;      /* connections accepted */
    uint64_t shed;          /* idle connections closed to make room for new ones */
    uint64_t rejected;      /* new connections answered 503/429 or closed at a limit */
    uint64_t accept_errors; /* accepts that failed with EMFILE/ENFILE */
    uint64_t fd_short;      /* accepts that found descriptors short (see above) */
    uint32_t fd_budget;     /* connections the descriptor budget allows now */
} sh_http_stats;
void sh_http_server_stats(const sh_http_server *srv, sh_http_stats *out);

/* Starts draining for a graceful shutdown: keep-alive ends (idle connections close now, every
 * later response says Connection: close and its connection closes after it), while the listener
 * stays open so that new clients still get an answer (the handler decides which: a 503, say).
 * Idempotent. */
void sh_http_server_drain(sh_http_server *srv);

/* Stops accepting and closes the server. Graceful (abort false): idle connections close now,
 * requests being answered finish and their connections close after the response. Abort: every
 * connection closes now and outstanding requests get their abort callback. `done` (may be NULL)
 * runs once every handle is completed and every libuv handle is closed; the server is then
 * freed. Calling it twice with abort true upgrades a graceful close; otherwise a no-op. */
void sh_http_server_close(sh_http_server *srv, bool abort, sh_http_closed_fn done, void *arg);

/* --- the request (valid until completed) --- */

const char *sh_http_req_method(const sh_http_req *req); /* "GET", "POST", ... */
const char *sh_http_req_path(const sh_http_req *req);   /* "/v1/models", not percent-decoded */
const char *sh_http_req_query(const sh_http_req *req);  /* after '?', without '#...'; "" */
/* The first header of that name, compared case-insensitively, or NULL. */
const char *sh_http_req_header(const sh_http_req *req, const char *name);
/* The body (NUL-terminated for convenience; *len excludes the NUL; "" when none). */
const char *sh_http_req_body(const sh_http_req *req, size_t *len);
/* Whether the client is still connected and the request not completed. */
bool sh_http_req_alive(const sh_http_req *req);

/* Sets the abort callback (see sh_http_abort_fn); replaces a previous one. When the client is
 * already gone the callback runs from the next loop iteration, never from inside this call. */
void sh_http_req_on_abort(sh_http_req *req, sh_http_abort_fn fn, void *arg);
void sh_http_req_on_writable(sh_http_req *req, sh_http_writable_fn fn, void *arg);

/* Adds a response header line (copied) before the response starts. Returns SH_EINVAL (CR/LF in
 * name or value, or the response already started), SH_ENOMEM. */
sh_err sh_http_req_add_header(sh_http_req *req, const char *name, const char *value);

/* Sends a complete response with Content-Length (body copied; HEAD gets no body) and completes
 * the request. Returns SH_OK, SH_ECLOSED (client gone; handle released anyway), SH_EINVAL
 * (already started a stream: the handle is NOT released; use sh_http_stream_end). */
sh_err sh_http_respond(sh_http_req *req, int status, const char *content_type, const void *body,
                       size_t len);

/* Starts a streaming response: chunked transfer coding for HTTP/1.1 clients (the connection
 * stays reusable), a close-delimited body for HTTP/1.0 ones. sse adds Cache-Control: no-cache
 * and X-Accel-Buffering: no. Returns SH_OK, SH_ECLOSED, SH_EINVAL (already started). */
sh_err sh_http_stream_start(sh_http_req *req, int status, const char *content_type, bool sse);

/* Queues bytes of a started stream (copied; an empty write is a no-op). Returns SH_OK, SH_EBUSY
 * (queued, but the write queue is now above the high-water mark: stop producing until the
 * writable callback), SH_ECLOSED (client gone; bytes dropped), SH_EINVAL (no stream started),
 * SH_ENOMEM (bytes dropped, connection closed). */
sh_err sh_http_stream_write(sh_http_req *req, const void *data, size_t len);

/* Whether the write queue is below the high-water mark (false when the client is gone). */
bool sh_http_req_writable(const sh_http_req *req);

/* Ends a stream (or, when no response was started, sends an empty 500) and completes the
 * request. Returns SH_OK or SH_ECLOSED; the handle is released in both cases. */
sh_err sh_http_stream_end(sh_http_req *req);

/* The reason phrase of a status code ("Not Found"; "Unknown" for others). */
const char *sh_http_status_text(int status);

#endif
