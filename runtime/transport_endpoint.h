/* Socket addresses of the stream engine's URLs (ipc://, tcp://, tcp4://, tcp6://), listening
 * sockets, and the SP frame header of each scheme. */
#ifndef SH_RUNTIME_TRANSPORT_ENDPOINT_H
#define SH_RUNTIME_TRANSPORT_ENDPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "shoal/err.h"

/* Where to connect or listen, and how frames are headed there. NNG's ipc transport heads every
 * message with a type byte (1) and an 8-byte big-endian length; its tcp transport with the
 * length alone. The handshake is the same 8 bytes on both. */
typedef struct sh__endpoint {
    struct sockaddr_storage sa;
    socklen_t sa_len;
    uint8_t head_len; /* 9 (ipc) or 8 (tcp) */
    bool unix_path;   /* AF_UNIX: sa holds a filesystem path */
    /* A dialled tcp:// URL whose host is a name, not a numeric address: it is resolved before
     * each dial (sh__stream_conn_dial), into sa; host, port and family are what to resolve. */
    bool named;
    int family;
    char host[256];
    char port[8];
} sh__endpoint;

#define SH__ENDPOINT_HEAD_MAX 9

/* True for the URL schemes the stream engine serves. */
bool sh__endpoint_handles(const char *url);

/* Parses url. For listening, the host may be empty or "*" and the port 0 (any address, any
 * port). Host names are resolved here, on the calling thread (getaddrinfo). Returns SH_EINVAL
 * (malformed, or an ipc:// path longer than a Unix socket allows), SH_ENOTFOUND (the host does
 * not resolve); e names the URL. */
sh_err sh__endpoint_parse(const char *url, bool listen, sh__endpoint *ep, sh_error *e);

/* Parses a URL to dial as sh__endpoint_parse does, except that a host name is not resolved: ep
 * is `named` and its sa is empty until the dial resolves it. A numeric address is filled in at
 * once. Returns SH_EINVAL (malformed). */
sh_err sh__endpoint_parse_dial(const char *url, sh__endpoint *ep, sh_error *e);

/* A non-blocking socket of ep's family: TCP_NODELAY for tcp. -1 with errno on failure. */
int sh__endpoint_socket(const sh__endpoint *ep);

/* A non-blocking listening socket bound to ep (a stale Unix socket file left by a dead process
 * is replaced; a live listener's is SH_EBUSY). On success *fd is set and `bound` gets the URL
 * as bound (the port chosen for port 0). Returns SH_EBUSY, SH_EINVAL, SH_EIO. */
sh_err sh__endpoint_listen(const sh__endpoint *ep, const char *url, int *fd, char *bound,
                           size_t cap, sh_error *e);

/* Writes the frame header of a `len`-byte frame; returns ep->head_len bytes. */
size_t sh__endpoint_head(uint8_t head_len, uint8_t *out, uint64_t len);

/* Reads a frame header of head_len bytes: the length, or false when it is not a message. */
bool sh__endpoint_head_read(uint8_t head_len, const uint8_t *p, uint64_t *len);

#endif
