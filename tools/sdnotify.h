/* systemd's service notifications (sd_notify(3)) without libsystemd: READY=1 when a node has
 * joined its front or the front serves, STATUS= lines, WATCHDOG=1 from a runtime loop and
 * STOPPING=1 on a drain (docs/deploy.md, "systemd"). Nothing is sent when NOTIFY_SOCKET is not
 * set. */
#ifndef SH_TOOLS_SDNOTIFY_H
#define SH_TOOLS_SDNOTIFY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "base/error.h"
#include "shoal/runtime.h"

typedef struct sh_sdnotify {
    int fd; /* a datagram socket to the manager; -1: notifications off */
    struct sockaddr_un sa;
    socklen_t sa_len;
    uint32_t watchdog_ms;  /* WATCHDOG=1 every this many ms (WATCHDOG_USEC / 2); 0: none */
    uint32_t front;        /* a worker's front (node id): READY=1 once it greeted this node */
    char ready_status[96]; /* the STATUS= sent with READY=1 */
} sh_sdnotify;

/* Reads NOTIFY_SOCKET (an absolute path, or "@name" for the abstract namespace), WATCHDOG_USEC
 * and WATCHDOG_PID (the pings are for this process only when it is unset or this process's id)
 * and unsets the three, so that no child process (`shoal cluster up`'s nodes) speaks for this
 * one. Without NOTIFY_SOCKET, or with one that is not a Unix socket address (a line on stderr
 * says so), n is off and every other call does nothing. Never fails. Main thread, before any
 * thread starts (it changes the environment). */
void sh__sdnotify_open(sh_sdnotify *n);

/* Sends one notification (a newline-separated list of VAR=VALUE, e.g. "STOPPING=1\nSTATUS=...")
 * as one datagram, without blocking; failures are ignored (the manager may be gone). Any
 * thread. */
void sh__sdnotify_send(const sh_sdnotify *n, const char *fmt, ...) SH_PRINTF(2, 3);

/* Starts the notifier on rt's loop 0 (the loop that answers the front's heartbeats): WATCHDOG=1
 * every watchdog_ms from that loop, so that a stuck loop stops the pings and the manager
 * restarts the process; and with `front` (a worker's front's node id; 0 for the front itself),
 * STATUS= saying it waits for the front at once, and READY=1 with STATUS=ready_status (copied) once
 * the front's connection has proved its node in HELLO (the node joined), again after the front
 * was lost and came back. A front sends its own READY=1 (sh__sdnotify_send) once it serves. Spawn
 * it after every actor whose id the cluster computes (it takes the next actor id). n must
 * outlive rt. Does nothing when n is off, or when there is neither a watchdog nor a front to
 * wait for. Returns 0, or 1 after an error line. Not on a loop thread. */
int sh__sdnotify_start(sh_sdnotify *n, sh_runtime *rt, uint32_t front, const char *ready_status);

/* Closes the socket; n is off afterwards. After the runtime is destroyed. */
void sh__sdnotify_close(sh_sdnotify *n);

#endif
