/* The front's ring of fault and recovery events (actors/cluster_events.h). */
#include "actors/cluster_events.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

void sh__cluster_events_init(sh_cluster_events *ev)
{
    memset(ev, 0, sizeof *ev);
    pthread_mutex_init(&ev->mu, NULL);
}

void sh__cluster_events_fini(sh_cluster_events *ev) { pthread_mutex_destroy(&ev->mu); }

uint64_t sh__cluster_events_add(sh_cluster_events *ev, const char *kind, int32_t node,
                                int32_t replica, const char *fmt, ...)
{
    if (!ev)
        return 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    sh_cluster_event e = {.unix_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000,
                          .node = node,
                          .replica = replica};
    snprintf(e.kind, sizeof e.kind, "%s", kind);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg, sizeof e.msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&ev->mu);
    e.seq = ++ev->total;
    ev->ring[(e.seq - 1) % SH_CLUSTER_EVENTS_MAX] = e;
    pthread_mutex_unlock(&ev->mu);
    return e.seq;
}

size_t sh__cluster_events_copy(sh_cluster_events *ev, uint64_t after, sh_cluster_event *out,
                               size_t cap, uint64_t *total)
{
    pthread_mutex_lock(&ev->mu);
    uint64_t last = ev->total;
    uint64_t first = last > SH_CLUSTER_EVENTS_MAX ? last - SH_CLUSTER_EVENTS_MAX + 1 : 1;
    if (first <= after)
        first = after + 1;
    if (last >= first && last - first + 1 > cap)
        first = last - cap + 1;
    size_t n = 0;
    for (uint64_t s = first; s <= last && n < cap; s++)
        out[n++] = ev->ring[(s - 1) % SH_CLUSTER_EVENTS_MAX];
    pthread_mutex_unlock(&ev->mu);
    if (total)
        *total = last;
    return n;
}
