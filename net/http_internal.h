/* Internal structures shared by the HTTP server's connection code and its response writer. */
#ifndef SH_NET_HTTP_INTERNAL_H
#define SH_NET_HTTP_INTERNAL_H

#include <http_parser.h>

#include "net/http.h"

/* Bytes of pipelined input buffered while a request is being answered before reading stops. */
#define SH_HTTP_PIPELINE_CAP (64 * 1024)
#define SH_HTTP_MAX_HEADERS 100

typedef struct sh__http_conn sh__http_conn;

/* The rate-limited log events of a server (see sh_http_log_fn). */
enum { SH__HTTP_LOG_FD, SH__HTTP_LOG_CONNS, SH__HTTP_LOG_PER_IP, SH__HTTP_N_LOG };

typedef enum req_state {
    SH__HTTP_PARSING = 0, /* being parsed */
    SH__HTTP_HANDLING,    /* given to the handler, no response started */
    SH__HTTP_STREAMING,   /* a stream response started */
    SH__HTTP_DONE,        /* completed: the handle is being freed */
} sh__http_req_state;

/* A growable byte buffer. */
typedef struct sh__http_buf {
    char *data;
    size_t len, cap;
} sh__http_buf;

struct sh_http_req {
    sh__http_conn *conn;
    sh__http_req_state state;
    char method[24];
    char *path, *query;                   /* into url */
    sh__http_buf url;                     /* "path\0query\0" once headers are complete */
    sh__http_buf hdrs;                    /* "name\0value\0..." */
    size_t name_off[SH_HTTP_MAX_HEADERS]; /* offsets into hdrs */
    size_t value_off[SH_HTTP_MAX_HEADERS];
    int n_hdrs;
    bool last_was_value; /* header callback state */
    sh__http_buf body;
    sh__http_buf extra; /* response headers added by the handler */
    bool keep_alive, http10, head, chunked_out, close_delimited;
    bool aborted, abort_notified;
    sh_http_abort_fn on_abort;
    void *abort_arg;
    sh_http_writable_fn on_writable;
    void *writable_arg;
    bool want_writable;
};

struct sh__http_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t shutdown;
    sh_http_server *srv;
    sh__http_conn *prev, *next;
    http_parser parser;
    sh__http_buf rbuf;
    size_t roff;
    sh_http_req *parsing; /* the request being parsed (NULL between requests) */
    sh_http_req *active;  /* the request handed to the handler and not completed */
    int phase;            /* 0 idle, 1 headers, 2 body, 3 active, 4 lingering close */
    uint64_t phase_start; /* uv_now at the start of the request or of idleness */
    uint32_t header_bytes;
    int err_status; /* a status chosen by a parser callback that failed */
    size_t queued;  /* bytes written and not yet confirmed */
    int pending_writes;
    int refs; /* open libuv handles (2) + requests not completed */
    bool closing, close_after_write, reading, resume_pending, in_process, rejecting;
    bool sent_continue;
    bool fresh;                   /* no request has started yet: timeouts count from accept */
    bool has_peer;                /* peer holds the client's address */
    struct sockaddr_storage peer; /* for the per-address limit */
};

struct sh_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    sh_http_opts opts;
    int port;
    uint32_t n_conns, n_rejecting;
    sh__http_conn *conns; /* a doubly linked list of every open connection */
    bool closing, aborting, listener_open, draining;
    uint32_t n_active;     /* requests handed to the handler and not completed */
    uint32_t fd_budget;    /* connections the descriptor budget allows (see http.h) */
    uint32_t fd_reserve;   /* descriptors kept free below RLIMIT_NOFILE */
    uint64_t fd_limit;     /* RLIMIT_NOFILE when the budget was last set */
    uint64_t fd_budget_at; /* uv_now when the budget was last set */
    sh_http_stats stats;
    uint64_t log_at[SH__HTTP_N_LOG];    /* uv_now of the last log call per event (0: never) */
    uint64_t log_count[SH__HTTP_N_LOG]; /* occurrences since that call */
    int refs;                           /* 1 for the listener + 1 per connection not yet freed */
    sh_http_closed_fn done;
    void *done_arg;
};

/* Appends bytes; returns false on allocation failure. */
bool sh__http_buf_add(sh__http_buf *b, const void *p, size_t n);
void sh__http_buf_free(sh__http_buf *b);

/* Queues bytes on the connection (copied). Returns SH_OK, SH_ECLOSED or SH_ENOMEM (the
 * connection is then closed). */
sh_err sh__http_conn_write(sh__http_conn *c, const void *p, size_t n);
/* Closes the connection (idempotent); an active request is marked aborted and told so. */
void sh__http_conn_close(sh__http_conn *c);
/* The active request of c finished: release it and resume parsing or close. */
void sh__http_conn_req_done(sh__http_conn *c, sh_http_req *req);
/* Writes a small complete response (used by the server itself for errors) and closes after it. */
void sh__http_conn_error(sh__http_conn *c, int status, const char *json_body);

#endif
