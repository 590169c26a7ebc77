/* A fault scenario against this process's own links (tools/cmd_fault.h). */
#include "tools/cmd_fault.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tools/cmd_util.h"

#define CHUNK_BYTES ((size_t)1 << 20)
#define LEAK_TICK_MS 50
#define EPOCH_POLL_MS 20

static uint32_t node_id(void *ud, const char *name)
{
    const sh_cmd_fault *cf = ud;
    int32_t i = sh_config_find_node(cf->c, name);
    return i < 0 ? 0 : (uint32_t)i + 1;
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Waits ms on cf's condition; returns true when the fault layer is stopping. */
static bool wait_stop(sh_cmd_fault *cf, uint64_t ms)
{
    uv_mutex_lock(&cf->mu);
    if (!cf->stop)
        (void)uv_cond_timedwait(&cf->cv, &cf->mu, ms * 1000000u);
    bool stop = cf->stop;
    uv_mutex_unlock(&cf->mu);
    return stop;
}

/* One leak: 1 MiB blocks allocated and written at the event's rate until it ends, kept in cf. */
static void leak_main(void *arg)
{
    sh_cmd_fault_leak *lk = arg;
    sh_cmd_fault *cf = lk->cf;
    uint64_t t0 = mono_ms(), end = t0 + (uint64_t)(lk->lasting_s * 1000);
    double done = 0;
    for (uint64_t now = t0; now < end; now = mono_ms()) {
        double due = lk->mb_per_s * (double)(now - t0) / 1000.0;
        for (; done + 1 <= due; done += 1) {
            void *p = malloc(CHUNK_BYTES);
            if (!p)
                break;
            memset(p, 0xa5, CHUNK_BYTES); /* touched: resident, not just reserved */
            uv_mutex_lock(&cf->mu);
            if (cf->n_chunks == cf->cap_chunks) {
                size_t cap = cf->cap_chunks ? cf->cap_chunks * 2 : 256;
                void **q = realloc(cf->chunks, cap * sizeof *q);
                if (q) {
                    cf->chunks = q;
                    cf->cap_chunks = cap;
                }
            }
            if (cf->n_chunks < cf->cap_chunks)
                cf->chunks[cf->n_chunks++] = p;
            else
                free(p);
            uv_mutex_unlock(&cf->mu);
        }
        if (wait_stop(cf, LEAK_TICK_MS))
            break;
    }
    fprintf(stderr, "shoal: fault: leak done: %.0f MiB held\n", done);
    fflush(stderr);
}

static sh_err leak(void *ud, const char *node, double mb_per_s, double lasting_s)
{
    sh_cmd_fault *cf = ud;
    if (node_id(cf, node) != cf->self)
        return SH_OK; /* another node's */
    uv_mutex_lock(&cf->mu);
    sh_cmd_fault_leak *lk = cf->n_leaks < SH_CMD_FAULT_LEAKS_MAX ? &cf->leaks[cf->n_leaks++] : NULL;
    uv_mutex_unlock(&cf->mu);
    if (!lk)
        return SH_EBUSY;
    *lk = (sh_cmd_fault_leak){.cf = cf, .mb_per_s = mb_per_s, .lasting_s = lasting_s};
    if (uv_thread_create(&lk->thread, leak_main, lk))
        return SH_EIO;
    lk->started = true;
    fprintf(stderr, "shoal: fault: leak %.0f MiB/s for %.1f s\n", mb_per_s, lasting_s);
    fflush(stderr);
    return SH_OK;
}

/* Whether this process applies the event: link events and its own leaks; kill, stop, cont and
 * stall belong to whoever holds the processes (`shoal chaos`). */
static bool applies_here(const sh_fault_event *ev)
{
    return (ev->kind >= SH_FAULT_DELAY && ev->kind <= SH_FAULT_HEAL) || ev->kind == SH_FAULT_LEAK;
}

static bool parse_ms(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    while (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t')
        end++;
    if (errno || end == s || *end || s[0] == '-' || v == 0)
        return false;
    *out = (uint64_t)v;
    return true;
}

static int start_runner(sh_cmd_fault *cf, uint64_t epoch_ms)
{
    sh_fault *layers[1] = {cf->f};
    sh_error e = {0};
    sh_err err =
        epoch_ms ? sh_fault_runner_start_at(cf->sc, layers, 1, &cf->host, epoch_ms, &cf->run, &e)
                 : sh_fault_runner_start(cf->sc, layers, 1, &cf->host, &cf->run, &e);
    if (err)
        return (sh__cmd_fail("--fault-scenario: %s", e.msg), 1);
    return 0;
}

/* --fault-epoch @FILE: polls for the file, then starts the runner from its instant. */
static void epoch_main(void *arg)
{
    sh_cmd_fault *cf = arg;
    for (;;) {
        FILE *f = fopen(cf->epoch_file, "r");
        if (f) {
            char buf[64] = "";
            size_t n = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
            buf[n] = '\0';
            uint64_t ms;
            if (parse_ms(buf, &ms)) {
                fprintf(stderr, "shoal: fault scenario: epoch %" PRIu64 " from %s\n", ms,
                        cf->epoch_file);
                fflush(stderr);
                start_runner(cf, ms);
                return;
            }
        }
        if (wait_stop(cf, EPOCH_POLL_MS))
            return;
    }
}

int sh__cmd_fault_epoch_check(const char *epoch)
{
    uint64_t ms;
    if (!epoch || (epoch[0] == '@' && epoch[1]) || parse_ms(epoch, &ms))
        return 0;
    return sh__cmd_fail("bad value '%s' for --fault-epoch: want UNIX_MS (milliseconds since 1970) "
                        "or @FILE",
                        epoch);
}

int sh__cmd_fault_start_epoch(sh_cmd_fault *cf, const char *path, const char *epoch,
                              const sh_cluster_config *c, sh_runtime *rt, sh_transport *tp)
{
    memset(cf, 0, sizeof *cf);
    if (sh__cmd_fault_epoch_check(epoch))
        return 2;
    if (epoch && epoch[0] == '@' && strlen(epoch + 1) >= sizeof cf->epoch_file)
        return sh__cmd_fail("--fault-epoch: file name too long");
    cf->c = c;
    cf->self = sh_runtime_node(rt);
    sh_error e = {0};
    sh_scenario *all = NULL;
    if (sh_scenario_load_file(path, NULL, &all, &e) || sh_scenario_check(all, c, &e)) {
        sh_scenario_destroy(all);
        return sh__cmd_fail("--fault-scenario: %s", e.msg);
    }
    // Keep the events this process applies (the runner counts the rest as failed otherwise).
    size_t kept = 0;
    for (size_t i = 0; i < all->n_events; i++)
        if (applies_here(&all->events[i]))
            all->events[kept++] = all->events[i];
    size_t n_all = all->n_events;
    all->n_events = kept;
    cf->sc = all;
    sh_transport_hooks next;
    sh_transport_hooks_get(tp, &next);
    sh_fault_opts fo = {.seed = 1, .next = &next};
    if (sh_fault_create(rt, &fo, &cf->f, &e))
        return (sh__cmd_fail("--fault-scenario: %s", e.msg), 1);
    uv_mutex_init(&cf->mu);
    uv_cond_init(&cf->cv);
    cf->host = (sh_fault_host){.ud = cf, .node_id = node_id, .leak = leak};
    fprintf(stderr, "shoal: fault scenario %s: %zu events (%zu for this process)\n", path, n_all,
            kept);
    fflush(stderr);
    if (epoch && epoch[0] == '@') {
        snprintf(cf->epoch_file, sizeof cf->epoch_file, "%s", epoch + 1);
        if (uv_thread_create(&cf->waiter, epoch_main, cf))
            return (sh__cmd_fail("--fault-epoch: cannot start a thread"), 1);
        cf->waiting = true;
        return 0;
    }
    uint64_t ms = 0;
    if (epoch)
        parse_ms(epoch, &ms);
    return start_runner(cf, ms);
}

int sh__cmd_fault_start(sh_cmd_fault *cf, const char *path, const sh_cluster_config *c,
                        sh_runtime *rt, sh_transport *tp)
{
    return sh__cmd_fault_start_epoch(cf, path, NULL, c, rt, tp);
}

void sh__cmd_fault_stop(sh_cmd_fault *cf)
{
    if (cf->f) {
        uv_mutex_lock(&cf->mu);
        cf->stop = true;
        uv_cond_broadcast(&cf->cv);
        uv_mutex_unlock(&cf->mu);
        if (cf->waiting)
            uv_thread_join(&cf->waiter);
    }
    sh_fault_runner_destroy(cf->run); /* no new leak starts after this */
    for (int i = 0; i < cf->n_leaks; i++)
        if (cf->leaks[i].started)
            uv_thread_join(&cf->leaks[i].thread);
    for (size_t i = 0; i < cf->n_chunks; i++)
        free(cf->chunks[i]);
    free(cf->chunks);
    if (cf->f) {
        uv_cond_destroy(&cf->cv);
        uv_mutex_destroy(&cf->mu);
        sh_fault_stats st;
        sh_fault_stats_get(cf->f, &st);
        fprintf(stderr,
                "shoal: fault layer: %llu messages seen, %llu dropped, %llu duplicated, "
                "%llu delayed, %llu corrupted, %llu partitioned\n",
                (unsigned long long)st.seen, (unsigned long long)st.dropped,
                (unsigned long long)st.duplicated, (unsigned long long)st.delayed,
                (unsigned long long)st.corrupted, (unsigned long long)st.partitioned);
    }
    sh_fault_destroy(cf->f);
    sh_scenario_destroy(cf->sc);
    memset(cf, 0, sizeof *cf);
}
