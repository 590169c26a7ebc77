/* Internal interfaces of `shoal bench`: options, the HTTP/1.1 client, prompts and the report. */
#ifndef SH_TOOLS_BENCH_H
#define SH_TOOLS_BENCH_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <uv.h>

/* --- options (tools/bench_opts.c) --- */

/* A length distribution: lo == hi for a fixed length, else uniform over [lo, hi]. */
typedef struct sh__bench_dist {
    int32_t lo, hi;
} sh__bench_dist;

typedef struct sh__bench_opts {
    const char *url, *model, *api_key, *json_path;
    bool chat, stream, ignore_eos, quiet;
    int32_t concurrency;
    int64_t requests, warmup;
    sh__bench_dist prompt_tokens, output_tokens;
    int32_t shared_prefix; /* words before the unique part of every prompt; 0 for none */
    uint64_t seed;
    double temperature, timeout_s;
} sh__bench_opts;

/* Prints the usage text of `shoal bench`. */
void sh__bench_opts_usage(FILE *f);

/* Fills o from the arguments after the subcommand (argv[0] is "bench"). Returns 0 to go on, 1
 * after --help was printed (exit 0), 2 after one `error: ...` line on stderr (bad usage). */
int sh__bench_opts_parse(int argc, char **argv, sh__bench_opts *o);

/* --- HTTP/1.1 client (tools/bench_http.c) --- */

/* A parsed `http://HOST[:PORT][/PREFIX]` URL. */
typedef struct sh__bench_url {
    char host[256];        /* without the brackets of an IPv6 literal */
    char port[8];          /* "80" when the URL gives none */
    char host_header[300]; /* the Host header's value: as written in the URL */
    char base[256];        /* path prefix without a trailing slash ("" for none) */
} sh__bench_url;

/* Parses s into u. Returns false with a message in err (errcap bytes) for anything but an
 * http:// URL with a host and a valid port. */
bool sh__bench_http_parse_url(const char *s, sh__bench_url *u, char *err, size_t errcap);

/* Resolves u's host and port (blocking, once, before the benchmark starts), preferring an IPv4
 * address. Returns false with a message in err. */
bool sh__bench_http_resolve(uv_loop_t *loop, const sh__bench_url *u, struct sockaddr_storage *addr,
                            char *err, size_t errcap);

/* What every connection of a run shares; must outlive the connections. */
typedef struct sh__bench_http_cfg {
    struct sockaddr_storage addr;
    const char *host_header;
    const char *api_key; /* sent as `Authorization: Bearer KEY`; NULL for none */
    uint64_t timeout_ms; /* per exchange, from the first byte written to the last byte read */
} sh__bench_http_cfg;

typedef struct sh__bench_xfer sh__bench_xfer;

/* One request and its response. The caller fills the request half and the callbacks; the
 * connection fills the response half. Both callbacks run on the loop's thread. */
struct sh__bench_xfer {
    const char *method; /* "GET" or "POST" */
    const char *path;   /* e.g. "/v1/completions"; borrowed until on_done */
    const char *body;   /* Content-Length body, or NULL; borrowed until on_done */
    size_t body_len;
    bool stream; /* ask for server-sent events; a 2xx response is read by its Content-Type */
    /* Each SSE event's data (not "[DONE]", which ends the stream), NUL-terminated, and the time it
     * was read (uv_hrtime ns). Returns false to abort the exchange; it then sets err. */
    bool (*on_event)(sh__bench_xfer *x, const char *data, size_t len, uint64_t t_ns);
    /* The exchange is over (response complete, or failed). The callback may start another
     * exchange on the same connection. */
    void (*on_done)(sh__bench_xfer *x);
    void *user;

    uint64_t t_start, t_end; /* uv_hrtime ns: first byte queued; end of stream or failure */
    int status;              /* HTTP status; 0 when no response head arrived */
    bool sse;                /* the response was read as server-sent events */
    bool failed;             /* no complete response: err says why */
    char err[256];
    /* The body of a response not read as events (capped); owned by the connection, valid
     * during on_done only. NUL-terminated. */
    const char *resp;
    size_t resp_len;
};

typedef struct sh__bench_conn sh__bench_conn;

/* A keep-alive HTTP/1.1 connection that runs one exchange at a time; it connects when the first
 * exchange starts and reconnects when the server has closed it. Returns false when out of memory.
 * Loop thread only. */
bool sh__bench_http_conn_create(uv_loop_t *loop, const sh__bench_http_cfg *cfg,
                                sh__bench_conn **out);

/* Starts x on c, which must be idle. x is borrowed until its on_done, which always comes
 * later (never from inside this call). */
void sh__bench_http_start(sh__bench_conn *c, sh__bench_xfer *x);

/* Closes c's handles (asynchronously: run the loop afterwards); an exchange in flight is dropped
 * without its on_done. Accepts NULL. */
void sh__bench_http_conn_destroy(sh__bench_conn *c);

/* --- prompts and request bodies (tools/bench_prompt.c) --- */

/* splitmix64: the next value of the sequence whose state is *s. */
uint64_t sh__bench_prompt_rand(uint64_t *s);

/* A uniform draw from d. */
int32_t sh__bench_prompt_draw(const sh__bench_dist *d, uint64_t *s);

/* n_words words of the fixed vocabulary drawn with *s, separated by single spaces (malloc'd,
 * caller frees; NULL when out of memory). Each word is one token in common BPE tokenizers. */
char *sh__bench_prompt_words(int32_t n_words, uint64_t *s);

/* The JSON body of request `index` of the run (malloc'd, caller frees; NULL when out of memory).
 * The prompt is `prefix` (may be NULL) then the request's own words; *prompt_words gets the
 * number of words sent, the fallback estimate of its prompt tokens. */
char *sh__bench_prompt_body(const sh__bench_opts *o, const char *model, const char *prefix,
                            int64_t index, int64_t *prompt_words);

/* --- results and the report (tools/bench_report.c) --- */

typedef struct sh__bench_result {
    bool ok;
    bool usage;    /* token counts come from the server's usage */
    int status;    /* HTTP status; 0 when no response */
    double ttft_s; /* to the first token-bearing event (the whole latency without streaming) */
    double latency_s;
    int64_t prompt_tokens, output_tokens;
} sh__bench_result;

/* A distinct failure message and how often it happened. */
typedef struct sh__bench_error {
    char msg[256];
    int status;
    int64_t count;
} sh__bench_error;

typedef struct sh__bench_run {
    const sh__bench_opts *o;
    const char *model;
    const sh__bench_result *results; /* completed requests, in completion order */
    int64_t n_results;
    const double *itl_s; /* gaps between successive token-bearing events of ok requests */
    size_t n_itl;
    double duration_s; /* from the first measured request to the last completion */
    const sh__bench_error *errors;
    int n_errors;
    bool interrupted;
} sh__bench_run;

/* The p-th percentile (0..100) of v[0..n) with linear interpolation; v is sorted in place.
 * NAN when n is 0. */
double sh__bench_report_percentile(double *v, size_t n, double p);

/* Prints the human-readable report. */
void sh__bench_report_text(FILE *f, const sh__bench_run *r);

/* The report as JSON (new reference), or NULL when out of memory. */
json_t *sh__bench_report_json(const sh__bench_run *r);

#endif
