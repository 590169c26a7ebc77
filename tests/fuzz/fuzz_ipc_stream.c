/* libFuzzer target for the stream engine's ipc:// parser: arbitrary bytes on a real connection
 * to a listening node (after a valid push0 handshake when the first byte is odd). The node must
 * answer with its handshake, consume everything, close the connection when the input ends or
 * breaks the framing, and keep serving the next connection. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "shoal/runtime.h"
#include "shoal/transport.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static sh_runtime *rt;
static sh_transport *tp;
static struct sockaddr_un addr;

static void setup(void)
{
    static char dir[64] = "/tmp/shoal-fuzz-ipc-XXXXXX";
    char url[128];
    if (!mkdtemp(dir))
        abort();
    snprintf(url, sizeof url, "ipc://%s/n", dir);
    sh_runtime_opts ro = {.node_id = 2, .log_level = SH_LOG_LEVEL_ERROR};
    sh_transport_opts to = {.listen_url = url, .max_frame = 1 << 20};
    if (sh_runtime_create(&ro, &rt, NULL) || sh_transport_create(rt, &to, &tp, NULL))
        abort();
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s/n", dir);
}

static bool send_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false; /* the node closed on broken framing: fine */
        p += w;
        n -= (size_t)w;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!rt)
        setup();
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        __builtin_trap(); /* the node stopped accepting */
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    static const uint8_t hs[8] = {0, 'S', 'P', 0, 0x00, 0x50, 0, 0};
    bool ok = true;
    if (size > 0 && (data[0] & 1)) {
        ok = send_all(fd, hs, sizeof hs);
        data++, size--;
    }
    if (ok)
        send_all(fd, data, size);
    shutdown(fd, SHUT_WR);
    /* The node's handshake, then end of file once it has read everything or given up. */
    uint8_t buf[64];
    size_t got = 0;
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r == 0)
            break;
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == ECONNRESET || errno == EPIPE))
            break;
        if (r < 0)
            __builtin_trap(); /* no end of file within 5 s: the node hangs on this input */
        if (got < 8 && memcmp(buf, "\0SP\0\0\x51\0\0", 8 - got < (size_t)r ? 8 - got : (size_t)r))
            __builtin_trap(); /* not a pull0 handshake */
        got += (size_t)r;
    }
    close(fd);
    return 0;
}
