/* Internal interfaces of `shoal chaos` (docs/chaos.md): options, the bounded load with its
 * reference outputs, the timeline of fault and recovery events, and the report. */
#ifndef SH_TOOLS_CMD_CHAOS_H
#define SH_TOOLS_CMD_CHAOS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "lua/config.h"
#include "runtime/fault_scenario.h"

typedef struct sh__chaos_opts {
    const char *scenario, *cluster, *attach, *bin, *pid_dir, *epoch_file, *log_path, *api_key;
    const char *threads;
    char
        *script_key; /* the cluster script's first key as a client sends it (api_key points here) */
    int64_t requests;
    int32_t concurrency, max_tokens, prompts, prompt_words;
    uint64_t seed;
    double duration_s, timeout_s, up_timeout_s;
    bool json, keep;
    bool engine; /* --engine: the front is an embedding engine in this process (sh_engine_open) */
} sh__chaos_opts;

/* How one request of the load ended. */
typedef enum sh__chaos_outcome {
    SH__CHAOS_OK,    /* complete, and equal to the reference */
    SH__CHAOS_WRONG, /* complete, but its text or length differs from the reference */
    SH__CHAOS_ERROR, /* ended with a clear error: an HTTP error status, an SSE error event, or a
                        finish_reason other than length/stop */
    SH__CHAOS_LOST,  /* no complete answer: the connection broke or the request hung */
} sh__chaos_outcome;

typedef struct sh__chaos_req {
    int64_t index;
    int32_t prompt;
    bool stream;
    double t_start, t_end; /* seconds from the epoch */
    int status;
    sh__chaos_outcome outcome;
    char err[200];
} sh__chaos_req;

/* One line of the cluster's history: from GET /admin/status's events or its log lines. */
typedef struct sh__chaos_mark {
    double t;      /* seconds from the epoch */
    char kind[16]; /* "dead", "resumed", ... as actors/cluster_events.h, or "exited" (supervisor) */
    char node[64]; /* "" when none */
    int32_t replica;
    char msg[160];
} sh__chaos_mark;

typedef struct sh__chaos_marks {
    sh__chaos_mark *v;
    size_t n, cap;
} sh__chaos_marks;

/* Appends a mark; false when out of memory. */
bool sh__chaos_marks_add(sh__chaos_marks *m, const sh__chaos_mark *mk);

/* Reads the lines of the cluster log that say a node was lost or a replica resumed, stamping
 * each with t (the caller polls the log often). */
void sh__chaos_marks_from_line(sh__chaos_marks *m, const char *line, double t);

/* Replaces m's content with the events of a GET /admin/status document (its "events" array),
 * times relative to epoch_unix_ms. Returns false (m untouched) when the document has none. */
bool sh__chaos_marks_from_status(sh__chaos_marks *m, const char *body, size_t len,
                                 uint64_t epoch_unix_ms);

struct sh_engine;

/* The load (tools/cmd_chaos_load.c over HTTP, tools/cmd_chaos_engine.c through the C API). */
typedef struct sh__chaos_load {
    const sh__chaos_opts *o;
    const char *url;   /* http://host:port */
    const char *model; /* the model id requests name */
    char **prompts;    /* (o->prompts) */
    char **reference;  /* (o->prompts) the undisturbed greedy texts, filled by the reference run */
    sh__chaos_req *reqs;
    int64_t n_reqs;
    /* Called every 10 ms during the load with the seconds since the epoch; returns nothing. */
    void (*tick)(void *ud, double t);
    void *ud;
    double load_end_s; /* the load keeps starting requests until at least this (from the epoch) */
    /* --engine: the requests go to this engine (sh_submit, polled on the calling thread) instead
     * of url; its callbacks' state lives in engine_reqs until sh__chaos_engine_reqs_free. */
    struct sh_engine *eng;
    void *engine_reqs;
} sh__chaos_load;

/* Runs each prompt once, one at a time per connection, into l->reference. Returns 0, or 1 with
 * an error line. */
int sh__chaos_load_reference(sh__chaos_load *l);

/* Runs the load from now (the epoch): at least o->requests requests and until l->load_end_s,
 * o->concurrency at a time, alternating streaming and not, each checked against the reference.
 * Fills l->reqs. Returns 0, or 1 with an error line (out of memory, a bad URL). */
int sh__chaos_load_run(sh__chaos_load *l);

/* Judges a complete answer against the reference: SH__CHAOS_OK when text equals ref, else
 * SH__CHAOS_WRONG with both texts (shortened) in q->err. */
void sh__chaos_judge_text(sh__chaos_req *q, const char *text, const char *ref);

/* The load through the engine (tools/cmd_chaos_engine.c): what sh__chaos_load_reference and
 * sh__chaos_load_run do when l->eng is set, with a request that has no final callback within
 * o->timeout_s counted lost (and cancelled). Returns 0, or 1 with an error line. */
int sh__chaos_engine_load(sh__chaos_load *l, bool ref);

/* Frees the requests' callback state; after the engine is closed (its last callbacks ran). */
void sh__chaos_engine_reqs_free(sh__chaos_load *l);

/* --engine's front: an engine opened on the cluster script, its log lines appended to a log
 * file (one write each, "[engine] LINE"), and a fault runner that applies the scenario's link
 * events to the links leaving it, as `shoal serve -c --fault-scenario` does for its own. */
typedef struct sh__chaos_front {
    struct sh_engine *eng;
    int logfd; /* O_APPEND; owned while opened */
    bool opened;
    sh_fault_runner *runner; /* or NULL */
    sh_fault_host host;
    sh_scenario sc; /* the link events (events owned) */
} sh__chaos_front;

/* Opens the engine on o->cluster (its workers must be running), its log appended to log_path.
 * Returns 0, or 1 with an error line. */
int sh__chaos_front_open(sh__chaos_front *f, const sh__chaos_opts *o, const char *log_path);

/* Starts applying sc's link events on the engine's links, times from epoch_unix_ms. Returns 0, or
 * 1 with an error line. */
int sh__chaos_front_faults(sh__chaos_front *f, const sh_scenario *sc, const sh_cluster_config *c,
                           uint64_t epoch_unix_ms);

/* Stops the runner and closes the engine (its open requests end with on_error). Accepts a
 * zeroed f (nothing to do); returns the close's sh_err as an int (0: clean). */
int sh__chaos_front_close(sh__chaos_front *f);

/* GET path on url into a malloc'd NUL-terminated body (caller frees); the status in *status (0:
 * no answer). NULL when there was no answer. */
char *sh__chaos_http_get(const char *url, const char *path, const char *api_key, int *status);

/* The report (tools/cmd_chaos_report.c). */
typedef struct sh__chaos_event_result {
    const sh_fault_event *ev;
    double detect_s, recover_s; /* from the event; NAN when not seen */
} sh__chaos_event_result;

typedef struct sh__chaos_report {
    const sh__chaos_opts *o;
    const sh_scenario *sc;
    const sh__chaos_req *reqs;
    int64_t n_reqs;
    sh__chaos_event_result *events; /* (sc->n_events) */
    const sh__chaos_marks *marks;
    const char *marks_source;        /* "admin/status" or "log" */
    double window_start, window_end; /* the fault window, seconds from the epoch */
    const char *log_path;
    int64_t counts[4]; /* by outcome */
} sh__chaos_report;

/* Fills events' detection and recovery times and the window from the marks, and the counts. */
void sh__chaos_report_compute(sh__chaos_report *r);

void sh__chaos_report_text(FILE *f, const sh__chaos_report *r);
json_t *sh__chaos_report_json(const sh__chaos_report *r);

#endif
