/* The front's log of faults and recoveries: a small ring of timestamped events that the watchdog,
 * the recovery code and the degradation ladder write and GET /admin/status (and `shoal chaos`,
 * which measures detection and recovery times from it) read. */
#ifndef SH_ACTORS_CLUSTER_EVENTS_H
#define SH_ACTORS_CLUSTER_EVENTS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define SH_CLUSTER_EVENTS_MAX 128 /* the ring keeps the last this many */

/* One event. kind is one short word from this list (the status page colours by it):
 *   "dead"      a node missed its heartbeats or its link broke (node set; msg says which);
 *   "alive"     a node answers heartbeats again (node set);
 *   "paused"    a replica stopped taking steps (replica set);
 *   "resumed"   a replica runs again, its interrupted sequences recomputed (replica set);
 *   "promoted"  a standby node took over a dead node's stages (node = the standby);
 *   "restarted" a node came back as a new process and rejoined (node set);
 *   "removed"   a replica left routing for good (replica set);
 *   "drain"     a node above its memory budget is drained for a restart (node set);
 *   "level"     the degradation level changed (msg: "0 -> 2", and why);
 *   "policy"    the policy script was reloaded or failed to (msg says which);
 *   "fault"     anything else worth showing (msg). */
typedef struct sh_cluster_event {
    uint64_t seq;     /* 1, 2, ... over the life of the process */
    uint64_t unix_ms; /* wall clock, so other processes (shoal chaos) can compare */
    char kind[16];
    int32_t node;    /* the script's node index, or -1 */
    int32_t replica; /* 0-based replica index, or -1 */
    char msg[240];
} sh_cluster_event;

typedef struct sh_cluster_events {
    pthread_mutex_t mu;
    uint64_t total; /* events ever added; ring[(seq - 1) % MAX] holds event seq */
    sh_cluster_event ring[SH_CLUSTER_EVENTS_MAX];
} sh_cluster_events;

/* Embedded object: init before use, fini after the last reader. */
void sh__cluster_events_init(sh_cluster_events *ev);
void sh__cluster_events_fini(sh_cluster_events *ev);

/* Appends an event (kind truncated to 15 bytes, the message to 239) and returns its seq. ev may
 * be NULL (nothing happens, returns 0). Any thread; never blocks for long (one mutex). */
uint64_t sh__cluster_events_add(sh_cluster_events *ev, const char *kind, int32_t node,
                                int32_t replica, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Copies the events with seq > after, oldest first, up to cap of them (the newest cap when more
 * are there) into out; returns how many were copied. *total (may be NULL) gets the total added so
 * far. Any thread. */
size_t sh__cluster_events_copy(sh_cluster_events *ev, uint64_t after, sh_cluster_event *out,
                               size_t cap, uint64_t *total);

#endif
