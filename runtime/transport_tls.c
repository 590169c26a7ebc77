/* NNG error mapping and TLS configuration (certificates from PEM files or strings). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "runtime/transport.h"

/* NNG errors at the boundary: what a caller can act on, the NNG text kept in the message. */
sh_err sh__transport_map(int rv)
{
    switch (rv) {
    case 0:
        return SH_OK;
    case NNG_ENOMEM:
        return SH_ENOMEM;
    case NNG_EINVAL:
    case NNG_EADDRINVAL:
    case NNG_EBADTYPE:
        return SH_EINVAL;
    case NNG_ETIMEDOUT:
        return SH_ETIMEDOUT;
    case NNG_EAGAIN:
    case NNG_EADDRINUSE:
    case NNG_EBUSY:
        return SH_EBUSY;
    case NNG_ECLOSED:
    case NNG_ECONNREFUSED:
    case NNG_ECONNRESET:
    case NNG_ECONNSHUT:
    case NNG_ECONNABORTED:
    case NNG_ESTATE:
        return SH_ECLOSED;
    case NNG_ECANCELED:
        return SH_ECANCELED;
    case NNG_ENOTSUP:
    case NNG_ENOENT:
        return rv == NNG_ENOTSUP ? SH_EUNSUPPORTED : SH_ENOTFOUND;
    case NNG_EMSGSIZE:
        return SH_ERANGE;
    case NNG_EPROTO:
    case NNG_ECRYPTO:
    case NNG_EPEERAUTH:
        return SH_EPROTO;
    default:
        return SH_EIO;
    }
}

sh_err sh__transport_nng_error(sh_error *e, int rv, const char *what, const char *url)
{
    return sh__error_set(e, sh__transport_map(rv), "transport: %s %s: %s (nng %d)", what,
                         url ? url : "", nng_strerror(rv), rv);
}

int sh__transport_is_tls(const char *url) { return url && strncmp(url, "tls+", 4) == 0; }

/* Reads a whole PEM file (at most 1 MiB: certificates are small) into a NUL-terminated buffer. */
static sh_err read_pem(const char *path, char **out, sh_error *e)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return sh__error_set(e, SH_EIO, "transport: tls: cannot open %s: %s", path,
                             strerror(errno));
    size_t cap = 1u << 20, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        fclose(f);
        return sh__error_set(e, SH_ENOMEM, "transport: tls: out of memory reading %s", path);
    }
    n = fread(buf, 1, cap, f);
    int bad = ferror(f) || (n == cap && fgetc(f) != EOF);
    fclose(f);
    if (bad) {
        free(buf);
        return sh__error_set(e, SH_EIO, "transport: tls: cannot read %s (error or over 1 MiB)",
                             path);
    }
    buf[n] = '\0';
    *out = buf;
    return SH_OK;
}

/* One configuration for `mode` with our certificate, the CA and mutual verification. */
static sh_err make_config(nng_tls_mode mode, const char *cert, const char *key, const char *ca,
                          const sh_transport_tls *tls, nng_tls_config **out, sh_error *e)
{
    nng_tls_config *c = NULL;
    int rv = nng_tls_config_alloc(&c, mode);
    if (rv == NNG_ENOTSUP)
        return sh__error_set(e, SH_EUNSUPPORTED,
                             "transport: tls+tcp:// needs NNG built with TLS (mbedTLS): %s",
                             nng_strerror(rv));
    if (rv)
        return sh__transport_nng_error(e, rv, "tls config", NULL);
    const char *step = "tls auth mode";
    rv = nng_tls_config_auth_mode(c, NNG_TLS_AUTH_MODE_REQUIRED);
    if (!rv) {
        step = "tls CA chain";
        rv = nng_tls_config_ca_chain(c, ca, NULL);
    }
    if (!rv) {
        step = "tls own certificate";
        rv = nng_tls_config_own_cert(c, cert, key, tls->key_password);
    }
    if (!rv && mode == NNG_TLS_MODE_CLIENT && tls->server_name) {
        step = "tls server name";
        rv = nng_tls_config_server_name(c, tls->server_name);
    }
    if (rv) {
        nng_tls_config_free(c);
        sh__transport_nng_error(e, rv, step, NULL);
        /* NNG reports bad PEM as a crypto error; to the caller it is an invalid option. */
        if (e && (rv == NNG_ECRYPTO || rv == NNG_EINVAL))
            e->code = SH_EINVAL;
        return rv == NNG_ECRYPTO ? SH_EINVAL : sh__transport_map(rv);
    }
    *out = c;
    return SH_OK;
}

sh_err sh__transport_tls_configs(const sh_transport_tls *tls, nng_tls_config **server,
                                 nng_tls_config **client, sh_error *e)
{
    char *owned[3] = {NULL, NULL, NULL};
    const char *files[3] = {tls->cert_file, tls->key_file, tls->ca_file};
    const char *pems[3] = {tls->cert_pem, tls->key_pem, tls->ca_pem};
    static const char *const names[3] = {"certificate", "key", "CA"};
    sh_err err = SH_OK;
    for (int i = 0; i < 3 && !err; i++) {
        if (files[i])
            err = read_pem(files[i], &owned[i], e);
        else if (!pems[i])
            err = sh__error_set(e, SH_EINVAL, "transport: tls: no %s (file or PEM)", names[i]);
    }
    const char *cert = owned[0] ? owned[0] : pems[0];
    const char *key = owned[1] ? owned[1] : pems[1];
    const char *ca = owned[2] ? owned[2] : pems[2];
    *server = *client = NULL;
    if (!err)
        err = make_config(NNG_TLS_MODE_SERVER, cert, key, ca, tls, server, e);
    if (!err && (err = make_config(NNG_TLS_MODE_CLIENT, cert, key, ca, tls, client, e)) != SH_OK) {
        nng_tls_config_free(*server);
        *server = NULL;
    }
    for (int i = 0; i < 3; i++)
        free(owned[i]);
    return err;
}
