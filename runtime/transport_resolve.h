/* Host names in node URLs (tcp://shoal-1.shoal:7000, tls+tcp://...): whether one resolves now,
 * and waiting for a listening URL's host while DNS is not ready yet (a Kubernetes pod's name
 * appears in its headless Service's records only after the pod starts). */
#ifndef SH_RUNTIME_TRANSPORT_RESOLVE_H
#define SH_RUNTIME_TRANSPORT_RESOLVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

/* The host and port of a tcp://, tcp4://, tcp6:// or tls+tcp:// (tls+tcp4/6) URL, brackets of a
 * [v6] host removed, and the address family its scheme asks for (AF_UNSPEC, AF_INET, AF_INET6).
 * False for other schemes, a URL without host:port, an empty or "*" host, or one that does not
 * fit (host at most hcap - 1 bytes, port pcap - 1). Any thread. */
bool sh__transport_url_host(const char *url, char *host, size_t hcap, char *port, size_t pcap,
                            int *family);

/* Resolves url's host now (getaddrinfo: blocks for as long as the resolver takes; not on a loop
 * thread). SH_OK when it resolves or the URL names no host (ipc://, inproc://, "*"); SH_ENOTFOUND
 * with "host H did not resolve (WHY)" in e otherwise. */
sh_err sh__transport_resolve(const char *url, sh_error *e);

/* sh__transport_resolve every 250 ms until url's host resolves or wait_ms pass; SH_ENOTFOUND
 * with "host H did not resolve within S s (WHY)" then. wait_ms 0: one try. Not on a loop
 * thread. */
sh_err sh__transport_resolve_wait(const char *url, uint32_t wait_ms, sh_error *e);

#endif
