/* Host names in node URLs: resolving one now, and waiting while DNS is not ready yet. */
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "base/error.h"
#include "runtime/transport_resolve.h"

typedef struct scheme {
    const char *prefix;
    int family;
} scheme;

static const scheme schemes[] = {
    {"tcp://", AF_UNSPEC},     {"tcp4://", AF_INET},     {"tcp6://", AF_INET6},
    {"tls+tcp://", AF_UNSPEC}, {"tls+tcp4://", AF_INET}, {"tls+tcp6://", AF_INET6},
};

bool sh__transport_url_host(const char *url, char *host, size_t hcap, char *port, size_t pcap,
                            int *family)
{
    const scheme *s = NULL;
    for (size_t i = 0; url && !s && i < sizeof schemes / sizeof schemes[0]; i++)
        if (!strncmp(url, schemes[i].prefix, strlen(schemes[i].prefix)))
            s = &schemes[i];
    if (!s)
        return false;
    const char *rest = url + strlen(s->prefix);
    const char *colon = strrchr(rest, ':');
    if (!colon)
        return false;
    const char *h = rest;
    size_t hn = (size_t)(colon - rest);
    if (hn >= 2 && rest[0] == '[' && rest[hn - 1] == ']') {
        h++;
        hn -= 2;
    }
    size_t pn = strlen(colon + 1);
    if (hn == 0 || hn >= hcap || pn == 0 || pn >= pcap || (hn == 1 && h[0] == '*'))
        return false;
    memcpy(host, h, hn);
    host[hn] = '\0';
    memcpy(port, colon + 1, pn + 1);
    *family = s->family;
    return true;
}

sh_err sh__transport_resolve(const char *url, sh_error *e)
{
    char host[256], port[16];
    int family;
    if (!sh__transport_url_host(url, host, sizeof host, port, sizeof port, &family))
        return SH_OK;
    struct addrinfo hints = {.ai_family = family, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (res)
        freeaddrinfo(res);
    if (rc == 0)
        return SH_OK;
    return sh__error_set(e, SH_ENOTFOUND, "host %.200s did not resolve (%s)", host,
                         gai_strerror(rc));
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

sh_err sh__transport_resolve_wait(const char *url, uint32_t wait_ms, sh_error *e)
{
    uint64_t deadline = mono_ms() + wait_ms;
    sh_error last = {0};
    for (;;) {
        if (sh__transport_resolve(url, &last) == SH_OK)
            return SH_OK;
        if (mono_ms() >= deadline)
            break;
        struct timespec ts = {0, 250 * 1000000};
        nanosleep(&ts, NULL);
    }
    char host[256], port[16];
    int family;
    sh__transport_url_host(url, host, sizeof host, port, sizeof port, &family);
    const char *why = strchr(last.msg, '(');
    return sh__error_set(e, SH_ENOTFOUND, "host %.200s did not resolve within %.1f s %s", host,
                         wait_ms / 1000.0, why ? why : "");
}
