/* The stream engine's URLs, socket addresses, listening sockets and frame headers. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/error.h"
#include "runtime/transport_endpoint.h"

#define SUN_PATH_MAX (sizeof(((struct sockaddr_un *)0)->sun_path) - 1)
#define IPC_SNDBUF (1 << 20)

typedef struct scheme {
    const char *prefix;
    int family; /* AF_UNIX, or the address family to resolve (AF_UNSPEC: either) */
} scheme;

static const scheme schemes[] = {
    {"ipc://", AF_UNIX},
    {"tcp://", AF_UNSPEC},
    {"tcp4://", AF_INET},
    {"tcp6://", AF_INET6},
};

static const scheme *scheme_of(const char *url)
{
    for (size_t i = 0; url && i < sizeof schemes / sizeof schemes[0]; i++)
        if (strncmp(url, schemes[i].prefix, strlen(schemes[i].prefix)) == 0)
            return &schemes[i];
    return NULL;
}

bool sh__endpoint_handles(const char *url) { return scheme_of(url) != NULL; }

static sh_err parse_unix(const char *url, const char *path, sh__endpoint *ep, sh_error *e)
{
    size_t n = strlen(path);
    if (n == 0 || n > SUN_PATH_MAX)
        return sh__error_set(e, SH_EINVAL, "transport: %s: an ipc:// path of 1 to %zu bytes needed",
                             url, SUN_PATH_MAX);
    struct sockaddr_un *sa = (struct sockaddr_un *)&ep->sa;
    sa->sun_family = AF_UNIX;
    memcpy(sa->sun_path, path, n + 1);
    ep->sa_len = sizeof *sa;
    ep->head_len = 9;
    ep->unix_path = true;
    return SH_OK;
}

/* host:port, [v6]:port; an empty host or "*" means any address (listening only). `lazy`: a host
 * name is kept for the dial to resolve (ep->named) rather than resolved here. */
static sh_err parse_inet(const char *url, const char *rest, int family, bool listen, bool lazy,
                         sh__endpoint *ep, sh_error *e)
{
    char host[256];
    const char *colon = strrchr(rest, ':');
    if (!colon)
        return sh__error_set(e, SH_EINVAL, "transport: %s: host:port needed", url);
    size_t hn = (size_t)(colon - rest);
    const char *h = rest;
    if (hn >= 2 && rest[0] == '[' && rest[hn - 1] == ']') {
        h++;
        hn -= 2;
    }
    if (hn >= sizeof host)
        return sh__error_set(e, SH_EINVAL, "transport: %s: host name too long", url);
    memcpy(host, h, hn);
    host[hn] = '\0';
    char *end = NULL;
    errno = 0;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (!colon[1] || *end || errno || port > 65535 || (port == 0 && !listen))
        return sh__error_set(e, SH_EINVAL, "transport: %s: bad port '%s'", url, colon + 1);
    bool any = hn == 0 || strcmp(host, "*") == 0;
    if (any && !listen)
        return sh__error_set(e, SH_EINVAL, "transport: %s: a host to dial is needed", url);
    struct addrinfo hints = {.ai_family = family,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (any ? AI_PASSIVE : 0) |
                                         (lazy ? AI_NUMERICHOST : 0)};
    char ps[8];
    snprintf(ps, sizeof ps, "%lu", port);
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(any ? NULL : host, ps, &hints, &res);
    if (lazy && rc == EAI_NONAME) { /* a name: resolved before each dial */
        ep->named = true;
        ep->family = family;
        memcpy(ep->host, host, hn + 1);
        memcpy(ep->port, ps, sizeof ps);
        ep->head_len = 8;
        ep->unix_path = false;
        return SH_OK;
    }
    if (rc != 0 || !res) {
        if (res)
            freeaddrinfo(res);
        return sh__error_set(e, SH_ENOTFOUND, "transport: %s: cannot resolve '%s': %s", url, host,
                             gai_strerror(rc));
    }
    memcpy(&ep->sa, res->ai_addr, res->ai_addrlen);
    ep->sa_len = res->ai_addrlen;
    freeaddrinfo(res);
    ep->head_len = 8;
    ep->unix_path = false;
    return SH_OK;
}

static sh_err parse(const char *url, bool listen, bool lazy, sh__endpoint *ep, sh_error *e)
{
    memset(ep, 0, sizeof *ep);
    const scheme *s = scheme_of(url);
    if (!s)
        return sh__error_set(e, SH_EINVAL, "transport: %s: not an ipc:// or tcp:// URL",
                             url ? url : "(null)");
    const char *rest = url + strlen(s->prefix);
    if (s->family == AF_UNIX)
        return parse_unix(url, rest, ep, e);
    return parse_inet(url, rest, s->family, listen, lazy, ep, e);
}

sh_err sh__endpoint_parse(const char *url, bool listen, sh__endpoint *ep, sh_error *e)
{
    return parse(url, listen, false, ep, e);
}

sh_err sh__endpoint_parse_dial(const char *url, sh__endpoint *ep, sh_error *e)
{
    return parse(url, false, true, ep, e);
}

int sh__endpoint_socket(const sh__endpoint *ep)
{
    int fd = socket(ep->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && !ep->unix_path) {
        /* Frames are written whole: Nagle's delay would only add latency (NNG sets it too). */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    } else if (fd >= 0) {
        /* A Unix stream socket holds at most the sender's buffer (208 KiB by default), so an
         * 8 MiB activation needs some 40 sleep/wake-up rounds between the two processes; 1 MiB
         * (the kernel caps it at net.core.wmem_max) cuts that fivefold: 8 MiB frames went from
         * 0.79-0.90 of a plain socket loop to 1.04-1.07 here. TCP keeps its own autotuning. */
        int sz = IPC_SNDBUF;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    }
    return fd;
}

/* True when something accepts connections at a Unix socket path (not a stale file). */
static bool unix_live(const sh__endpoint *ep)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return true; /* cannot tell: do not remove it */
    int rc = connect(fd, (const struct sockaddr *)&ep->sa, ep->sa_len);
    int err = errno;
    close(fd);
    return rc == 0 || err != ECONNREFUSED;
}

/* The URL as bound: for tcp, the port the kernel chose replaces the one asked for. */
static void bound_url(int fd, const sh__endpoint *ep, const char *url, char *out, size_t cap)
{
    snprintf(out, cap, "%s", url);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (ep->unix_path || getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
        return;
    unsigned port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                             : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    const char *colon = strrchr(url, ':');
    if (colon)
        snprintf(out, cap, "%.*s:%u", (int)(colon - url), url, port);
}

sh_err sh__endpoint_listen(const sh__endpoint *ep, const char *url, int *fd_out, char *bound,
                           size_t cap, sh_error *e)
{
    int fd = sh__endpoint_socket(ep);
    if (fd < 0)
        return sh__error_set(e, SH_EIO, "transport: socket for %s: %s", url, strerror(errno));
    if (!ep->unix_path) {
        int one = 1; /* a restarted node gets its port back while old connections linger */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    }
    int rc = bind(fd, (const struct sockaddr *)&ep->sa, ep->sa_len);
    if (rc != 0 && errno == EADDRINUSE && ep->unix_path) {
        /* A socket file left by a process that died is removed, as NNG does; a live one is
         * somebody else's address. */
        const char *path = ((const struct sockaddr_un *)&ep->sa)->sun_path;
        struct stat st;
        if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode) && !unix_live(ep) && unlink(path) == 0)
            rc = bind(fd, (const struct sockaddr *)&ep->sa, ep->sa_len);
        else
            errno = EADDRINUSE;
    }
    if (rc == 0 && listen(fd, SOMAXCONN) == 0) {
        *fd_out = fd;
        bound_url(fd, ep, url, bound, cap);
        return SH_OK;
    }
    int en = errno;
    close(fd);
    sh_err code = en == EADDRINUSE                                       ? SH_EBUSY
                  : en == ENOENT || en == ENOTDIR || en == EADDRNOTAVAIL ? SH_EINVAL
                                                                         : SH_EIO;
    return sh__error_set(e, code, "transport: listen on %s: %s", url, strerror(en));
}

static void put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (56 - 8 * i));
}

static uint64_t get_be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

size_t sh__endpoint_head(uint8_t head_len, uint8_t *out, uint64_t len)
{
    if (head_len == 9)
        *out++ = 1;
    put_be64(out, len);
    return head_len;
}

bool sh__endpoint_head_read(uint8_t head_len, const uint8_t *p, uint64_t *len)
{
    if (head_len == 9 && *p++ != 1)
        return false;
    *len = get_be64(p);
    return true;
}
