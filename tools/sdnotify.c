/* systemd's notification protocol, spoken directly: one datagram of VAR=VALUE lines to the
 * Unix socket named by NOTIFY_SOCKET (tools/sdnotify.h). */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/peers.h"
#include "tools/cmd_util.h"
#include "tools/sdnotify.h"

#define FRONT_POLL_MS 100 /* how often a worker looks whether its front greeted it */

void sh__sdnotify_open(sh_sdnotify *n)
{
    memset(n, 0, sizeof *n);
    n->fd = -1;
    const char *path = getenv("NOTIFY_SOCKET");
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    char *end = NULL;
    unsigned long long us = usec ? strtoull(usec, &end, 10) : 0;
    bool mine = !pid || strtol(pid, NULL, 10) == (long)getpid();
    if (usec && (!*usec || *end || us == 0))
        fprintf(stderr,
                "shoal: WATCHDOG_USEC=%.40s is not a whole number of microseconds; no "
                "watchdog pings\n",
                usec);
    else if (usec && mine)
        n->watchdog_ms = us < 2000                ? 1
                         : us / 2000 > UINT32_MAX ? UINT32_MAX
                                                  : (uint32_t)(us / 2000);
    size_t len = path ? strlen(path) : 0;
    bool ok = len >= 2 && len < sizeof n->sa.sun_path && (path[0] == '/' || path[0] == '@');
    if (path && !ok)
        fprintf(stderr,
                "shoal: NOTIFY_SOCKET=%.100s is not a Unix socket path or @name; no "
                "service notifications\n",
                path);
    if (ok) {
        n->sa.sun_family = AF_UNIX;
        memcpy(n->sa.sun_path, path, len);
        if (path[0] == '@') /* the abstract namespace: a leading NUL, no terminating one */
            n->sa.sun_path[0] = '\0';
        n->sa_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (path[0] == '/'));
        n->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (n->fd < 0)
            fprintf(stderr, "shoal: NOTIFY_SOCKET: socket: %s; no service notifications\n",
                    strerror(errno));
    }
    if (n->fd < 0)
        n->watchdog_ms = 0;
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
}

void sh__sdnotify_send(const sh_sdnotify *n, const char *fmt, ...)
{
    if (!n || n->fd < 0)
        return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (len <= 0)
        return;
    if ((size_t)len >= sizeof buf)
        len = (int)sizeof buf - 1;
    (void)sendto(n->fd, buf, (size_t)len, MSG_NOSIGNAL | MSG_DONTWAIT,
                 (const struct sockaddr *)&n->sa, n->sa_len);
}

/* ---- The notifier actor: on loop 0, a timer and no messages ------------------------------- */

typedef struct notifier {
    sh_sdnotify *n;
    uint64_t last_ping_ms;
    bool joined; /* the front's connection proved its node */
} notifier;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void notifier_tick(sh_actor_ctx *ctx, void *state, uint64_t tag)
{
    (void)tag;
    notifier *s = state;
    const sh_sdnotify *n = s->n;
    uint64_t now = mono_ms();
    if (n->watchdog_ms && now - s->last_ping_ms >= n->watchdog_ms) {
        sh__sdnotify_send(n, "WATCHDOG=1");
        s->last_ping_ms = now;
    }
    if (!n->front)
        return;
    bool bound = sh__peers_node_bound(sh_actor_runtime(ctx), n->front);
    if (bound && !s->joined)
        sh__sdnotify_send(n, "READY=1\nSTATUS=%s", n->ready_status);
    else if (!bound && s->joined)
        sh__sdnotify_send(n, "STATUS=the front's connection is gone; waiting for it to greet "
                             "this node again");
    s->joined = bound;
}

static sh_err notifier_init(sh_actor_ctx *ctx, void *state, void *arg)
{
    notifier *s = state;
    s->n = arg;
    uint32_t ms = s->n->watchdog_ms;
    if (s->n->front && (ms == 0 || ms > FRONT_POLL_MS))
        ms = FRONT_POLL_MS;
    s->last_ping_ms = 0;
    notifier_tick(ctx, state, 0);
    return sh_actor_timer_start(ctx, ms, ms, 0, NULL);
}

static sh_msg_fate notifier_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    (void)ctx, (void)state, (void)m; /* nobody writes to it */
    return SH_MSG_FATE_DONE;
}

static const sh_actor_vtable notifier_vt = {.name = "sdnotify",
                                            .state_size = sizeof(notifier),
                                            .init = notifier_init,
                                            .handle = notifier_handle,
                                            .timer = notifier_tick};

int sh__sdnotify_start(sh_sdnotify *n, sh_runtime *rt, uint32_t front, const char *ready_status)
{
    n->front = front;
    snprintf(n->ready_status, sizeof n->ready_status, "%s", ready_status ? ready_status : "");
    if (n->fd < 0 || (!n->watchdog_ms && !n->front))
        return 0;
    if (front)
        sh__sdnotify_send(n, "STATUS=serving; waiting for the front to greet this node");
    sh_error e = {0};
    sh_addr addr = 0;
    if (sh_runtime_register(rt, &notifier_vt, &e) ||
        sh_actor_spawn(rt, "sdnotify", n, 0, &addr, &e))
        return (sh__cmd_fail("service notifications: %s", e.msg), 1);
    return 0;
}

void sh__sdnotify_close(sh_sdnotify *n)
{
    if (n->fd >= 0)
        close(n->fd);
    n->fd = -1;
    n->watchdog_ms = 0;
}
