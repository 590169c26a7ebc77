/* `shoal chaos --engine`: the front is an embedding engine in this process (include/shoal.h,
 * sh_engine_open on the cluster script, whose supervisor recovers as `shoal serve -c` does), and
 * the load goes through sh_submit instead of HTTP: the reference run, the bounded load with each
 * answer checked against the undisturbed greedy text, and the front's share of the link faults. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/fault_scenario.h"
#include "shoal.h"
#include "tools/cmd_chaos.h"
#include "tools/cmd_util.h"

#define TICK_MS 10
#define TEXT_MAX (1 << 20)
#define DRAIN_MS 5000 /* after the load: time given to abandoned requests' cancels */

/* One request's callback state; lives until sh__chaos_engine_reqs_free (after the engine's
 * close, whose on_error may still reach an abandoned one). */
typedef struct ereq {
    struct eload *L;
    struct ereq *next; /* every request of the run */
    int64_t req;       /* index into reqs (load) or the prompt (reference) */
    int32_t slot;      /* its place among those in flight; -1 once over or abandoned */
    double t_start;    /* seconds from the load's start */
    uint64_t id;
    char *text;
    size_t len, cap;
    bool too_long;
} ereq;

typedef struct eload {
    sh__chaos_load *l;
    bool ref;
    ereq **slots; /* (concurrency) the requests in flight, NULL where free */
    int32_t n_slots, in_flight;
    int64_t next, cap_reqs;
    double t0;
    bool oom;
    char fail[300]; /* reference: the first failure */
} eload;

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double now_s(const eload *L) { return mono_s() - L->t0; }

/* The request is over for the load (final callback, or abandoned): its slot is free. */
static void leave_slot(ereq *q)
{
    if (q->slot < 0)
        return;
    q->L->slots[q->slot] = NULL;
    q->L->in_flight--;
    q->slot = -1;
}

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    (void)id;
    ereq *q = user;
    if (q->slot < 0 || q->too_long || !ev->text_len)
        return;
    if (q->len + ev->text_len + 1 > q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 256;
        while (cap < q->len + ev->text_len + 1)
            cap *= 2;
        char *t = cap <= TEXT_MAX ? realloc(q->text, cap) : NULL;
        if (!t) {
            q->too_long = true;
            return;
        }
        q->text = t;
        q->cap = cap;
    }
    memcpy(q->text + q->len, ev->text, ev->text_len);
    q->len += ev->text_len;
    q->text[q->len] = '\0';
}

static const char *finish_name(sh_finish f)
{
    static const char *const names[] = {"stop", "length", "cancel", "deadline", "tool_calls"};
    return (unsigned)f < sizeof names / sizeof names[0] ? names[f] : "unknown";
}

/* A final callback: done (info) or an error (code, msg). */
static void finish(ereq *q, const sh_done_info *info, sh_err code, const char *msg)
{
    eload *L = q->L;
    if (q->slot < 0) /* abandoned: counted lost already */
        return;
    if (!msg)
        msg = "";
    leave_slot(q);
    const char *text = q->text ? q->text : "";
    bool complete = info && (info->finish == SH_FINISH_STOP || info->finish == SH_FINISH_LENGTH);
    if (L->ref) {
        if (!complete || q->too_long) {
            if (!L->fail[0])
                snprintf(L->fail, sizeof L->fail, "prompt %d: %s%s%.200s", (int)q->req,
                         info ? "finish_reason " : sh_strerror(code), info ? "" : ": ",
                         info ? finish_name(info->finish) : msg);
        } else if (!(L->l->reference[q->req] = strdup(text))) {
            L->oom = true;
        }
        return;
    }
    sh__chaos_req *r = &L->l->reqs[q->req];
    r->t_end = now_s(L);
    if (!info) {
        r->outcome = SH__CHAOS_ERROR;
        snprintf(r->err, sizeof r->err, "%s: %.170s", sh_strerror(code), msg);
    } else if (!complete) {
        r->outcome = SH__CHAOS_ERROR;
        snprintf(r->err, sizeof r->err, "finish_reason \"%s\"", finish_name(info->finish));
    } else if (q->too_long) {
        r->outcome = SH__CHAOS_ERROR;
        snprintf(r->err, sizeof r->err, "response text too long");
    } else {
        r->status = 200;
        sh__chaos_judge_text(r, text, L->l->reference[r->prompt]);
    }
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    (void)id;
    finish(user, info, SH_OK, NULL);
}

static void on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    finish(user, NULL, code, msg);
}

static const sh_callbacks CB = {on_token, on_done, on_error};

/* Whether another request should start now. */
static bool more(const eload *L)
{
    const sh__chaos_opts *o = L->l->o;
    if (L->oom || (L->ref && L->fail[0]))
        return false;
    return L->ref ? L->next < o->prompts : L->next < o->requests || now_s(L) < L->l->load_end_s;
}

/* Submits the next request into free slot i. */
static void start_next(eload *L, int32_t i)
{
    sh__chaos_load *l = L->l;
    const sh__chaos_opts *o = l->o;
    int32_t prompt;
    if (!L->ref && L->next == L->cap_reqs) {
        int64_t cap = L->cap_reqs * 2;
        sh__chaos_req *r = realloc(l->reqs, (size_t)cap * sizeof *r);
        if (!r) {
            L->oom = true;
            return;
        }
        l->reqs = r;
        L->cap_reqs = cap;
    }
    ereq *q = calloc(1, sizeof *q);
    if (!q) {
        L->oom = true;
        return;
    }
    int64_t n = L->next++;
    *q = (ereq){.L = L, .next = l->engine_reqs, .req = n, .slot = i, .t_start = now_s(L)};
    l->engine_reqs = q;
    prompt = L->ref ? (int32_t)n : (int32_t)(n % o->prompts);
    if (!L->ref) {
        sh__chaos_req *r = &l->reqs[n];
        // One way of delivery through the C API: every request streams its tokens to on_token.
        *r = (sh__chaos_req){.index = n, .prompt = prompt, .stream = true, .t_start = q->t_start};
        l->n_reqs = L->next;
    }
    L->slots[i] = q;
    L->in_flight++;
    sh_request_opts ro = sh_request_opts_default();
    ro.prompt = l->prompts[prompt];
    ro.max_tokens = o->max_tokens;
    ro.ignore_eos = true; /* max_tokens whatever the model says; sampling fields 0: greedy */
    sh_error e = {0};
    sh_err rc = sh_submit(l->eng, &ro, &CB, q, &q->id, &e);
    if (rc)
        finish(q, NULL, rc, e.msg[0] ? e.msg : "sh_submit refused the request");
}

/* A request with no final callback after --timeout is lost: cancelled, its slot freed, and its
 * later callbacks ignored. */
static void expire(eload *L)
{
    const sh__chaos_opts *o = L->l->o;
    double t = now_s(L);
    for (int32_t i = 0; i < L->n_slots; i++) {
        ereq *q = L->slots[i];
        if (!q)
            continue;
        if (t - q->t_start < o->timeout_s)
            continue;
        if (L->ref) {
            if (!L->fail[0])
                snprintf(L->fail, sizeof L->fail, "prompt %d: no answer within %.0f s", (int)q->req,
                         o->timeout_s);
        } else {
            sh__chaos_req *r = &L->l->reqs[q->req];
            r->t_end = t;
            r->outcome = SH__CHAOS_LOST;
            snprintf(r->err, sizeof r->err, "no final callback within %.0f s", o->timeout_s);
        }
        leave_slot(q);
        (void)sh_cancel(L->l->eng, q->id, NULL);
    }
}

int sh__chaos_engine_load(sh__chaos_load *l, bool ref)
{
    const sh__chaos_opts *o = l->o;
    eload L = {.l = l, .ref = ref, .n_slots = o->concurrency, .cap_reqs = o->requests + 64};
    L.slots = calloc((size_t)L.n_slots, sizeof *L.slots);
    if (!ref && L.slots && !(l->reqs = calloc((size_t)L.cap_reqs, sizeof *l->reqs)))
        L.oom = true;
    if (!L.slots || L.oom) {
        free(L.slots);
        return (sh__cmd_fail("out of memory"), 1);
    }
    L.t0 = mono_s();
    double last_tick = -1;
    for (;;) {
        for (int32_t i = 0; i < L.n_slots && more(&L); i++)
            if (!L.slots[i])
                start_next(&L, i);
        if (!L.in_flight && !more(&L))
            break;
        sh_err rc = sh_poll(l->eng, TICK_MS, NULL);
        if (rc) {
            snprintf(L.fail, sizeof L.fail, "sh_poll: %s", sh_strerror(rc));
            L.oom = L.oom || rc == SH_ENOMEM;
            break;
        }
        double t = now_s(&L);
        if (l->tick && t - last_tick >= TICK_MS / 1000.0) {
            l->tick(l->ud, t);
            last_tick = t;
        }
        expire(&L);
    }
    // What is still in flight (sh_poll failed) is abandoned; cancelled requests get their last
    // callbacks here, or at the engine's close.
    for (int32_t i = 0; i < L.n_slots; i++)
        if (L.slots[i]) {
            (void)sh_cancel(l->eng, L.slots[i]->id, NULL);
            if (!ref) {
                sh__chaos_req *r = &l->reqs[L.slots[i]->req];
                r->outcome = SH__CHAOS_LOST;
                snprintf(r->err, sizeof r->err, "%.190s", L.fail);
            }
            leave_slot(L.slots[i]);
        }
    double until = mono_s() + DRAIN_MS / 1000.0;
    while (sh_pending(l->eng) > 0 && mono_s() < until)
        if (sh_poll(l->eng, TICK_MS, NULL))
            break;
    free(L.slots);
    if (L.oom)
        return (sh__cmd_fail("out of memory"), 1);
    if (ref && L.fail[0])
        return (sh__cmd_fail("the reference run (before any fault) failed: %s", L.fail), 1);
    if (!ref && L.fail[0])
        return (sh__cmd_fail("the load stopped: %s", L.fail), 1);
    return 0;
}

void sh__chaos_engine_reqs_free(sh__chaos_load *l)
{
    for (ereq *q = l->engine_reqs, *next; q; q = next) {
        next = q->next;
        free(q->text);
        free(q);
    }
    l->engine_reqs = NULL;
}

/* ---- the front ------------------------------------------------------------------------------ */

/* The engine's log lines, appended whole to the run's log (any thread). */
static void log_line(void *user, int level, const char *line)
{
    (void)level;
    sh__chaos_front *f = user;
    char buf[4200];
    int n = snprintf(buf, sizeof buf, "[engine] %s\n", line);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof buf) {
        n = (int)sizeof buf - 1;
        buf[n - 1] = '\n';
    }
    ssize_t w = write(f->logfd, buf, (size_t)n);
    (void)w;
}

int sh__chaos_front_open(sh__chaos_front *f, const sh__chaos_opts *o, const char *log_path)
{
    memset(f, 0, sizeof *f);
    f->logfd = open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (f->logfd < 0)
        return (sh__cmd_fail("%s: cannot append the engine's log", log_path), 1);
    f->opened = true;
    sh_engine_opts eo = sh_engine_opts_default();
    eo.cluster_script = o->cluster;
    eo.log = log_line;
    eo.log_user = f;
    eo.log_level = SH_ENGINE_LOG_WARN; /* the watchdog's node_dead, the supervisor's lines */
    sh_error e = {0};
    if (sh_engine_open(&eo, &f->eng, &e)) {
        close(f->logfd);
        f->opened = false;
        return (sh__cmd_fail("sh_engine_open %s: %s", o->cluster, e.msg), 1);
    }
    return 0;
}

/* Node ids as the cluster script numbers them (index + 1). */
static uint32_t node_id(void *ud, const char *name)
{
    int32_t i = sh_config_find_node(ud, name);
    return i < 0 ? 0 : (uint32_t)i + 1;
}

int sh__chaos_front_faults(sh__chaos_front *f, const sh_scenario *sc, const sh_cluster_config *c,
                           uint64_t epoch_unix_ms)
{
    size_t n = 0;
    for (size_t i = 0; i < sc->n_events; i++)
        n += sc->events[i].kind >= SH_FAULT_DELAY && sc->events[i].kind <= SH_FAULT_HEAL;
    if (!n)
        return 0;
    f->sc = (sh_scenario){.n_events = 0, .events = calloc(n, sizeof *f->sc.events)};
    if (!f->sc.events)
        return (sh__cmd_fail("out of memory"), 1);
    snprintf(f->sc.source, sizeof f->sc.source, "%s", sc->source);
    for (size_t i = 0; i < sc->n_events; i++)
        if (sc->events[i].kind >= SH_FAULT_DELAY && sc->events[i].kind <= SH_FAULT_HEAL)
            f->sc.events[f->sc.n_events++] = sc->events[i];
    f->host = (sh_fault_host){.ud = (void *)c, .node_id = node_id};
    sh_fault *layers[1] = {sh_engine_fault(f->eng)};
    sh_error e = {0};
    if (!layers[0] ||
        sh_fault_runner_start_at(&f->sc, layers, 1, &f->host, epoch_unix_ms, &f->runner, &e))
        return (sh__cmd_fail("the engine's fault layer: %s", layers[0] ? e.msg : "none"), 1);
    return 0;
}

int sh__chaos_front_close(sh__chaos_front *f)
{
    if (f->runner) {
        size_t applied = 0, failed = 0;
        sh_fault_runner_counts(f->runner, &applied, &failed);
        fprintf(stderr,
                "chaos: the engine applied %zu of %zu link events on its links (%zu failed)\n",
                applied, f->sc.n_events, failed);
    }
    sh_fault_runner_destroy(f->runner);
    f->runner = NULL;
    int rc = f->eng ? (int)sh_engine_close(f->eng) : 0;
    f->eng = NULL;
    free(f->sc.events);
    f->sc.events = NULL;
    if (f->opened)
        close(f->logfd);
    f->opened = false;
    return rc;
}
