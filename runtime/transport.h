/* Internal helpers of the NNG transport: NNG error mapping and TLS configuration. */
#ifndef SH_RUNTIME_TRANSPORT_H
#define SH_RUNTIME_TRANSPORT_H

#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>

#include "shoal/transport.h"

/* Maps an NNG error code to sh_err (see the table in transport_tls.c). */
sh_err sh__transport_map(int rv);

/* Fills e with the mapped code and "<what>: <nng_strerror(rv)>" and returns the code. */
sh_err sh__transport_nng_error(sh_error *e, int rv, const char *what, const char *url);

/* True for a tls+tcp:// (or tls+tcp4/6) URL. */
int sh__transport_is_tls(const char *url);

/* Builds the server (listener) and client (dialer) TLS configurations from `tls`: own
 * certificate and key, the CA chain, mutual verification required. On success the caller owns
 * both (nng_tls_config_free). Returns SH_EUNSUPPORTED when NNG was built without TLS, SH_EIO for
 * an unreadable file, SH_EINVAL for PEM data NNG refuses, SH_ENOMEM; nothing is left allocated
 * on failure. Any thread. */
sh_err sh__transport_tls_configs(const sh_transport_tls *tls, nng_tls_config **server,
                                 nng_tls_config **client, sh_error *e);

#endif
