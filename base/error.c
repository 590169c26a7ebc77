/* The error enum's text, sh_error helpers and sh_panic. */
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shoal/version.h"

static const char *const err_names[SH_ERR_COUNT_] = {
    [SH_OK] = "success",
    [SH_EINVAL] = "invalid argument",
    [SH_ENOMEM] = "out of memory",
    [SH_EIO] = "input/output error",
    [SH_EFORMAT] = "malformed data",
    [SH_EUNSUPPORTED] = "not supported",
    [SH_ENOTFOUND] = "not found",
    [SH_ERANGE] = "value out of range",
    [SH_ETIMEDOUT] = "timed out",
    [SH_ECLOSED] = "closed",
    [SH_EBUSY] = "busy",
    [SH_ECANCELED] = "cancelled",
    [SH_EPROTO] = "protocol error",
    [SH_ELUA] = "Lua error",
    [SH_EDEVICE] = "device error",
};

const char *sh_strerror(sh_err err)
{
    if ((unsigned)err >= SH_ERR_COUNT_ || !err_names[err])
        return "unknown error";
    return err_names[err];
}

const char *sh_version(void) { return SH_VERSION_STRING; }

sh_err sh__error_set(sh_error *e, sh_err code, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        e->code = code;
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

void sh__error_prefix(sh_error *e, const char *prefix)
{
    if (!e || e->code == SH_OK || !prefix)
        return;
    /* Shift the message right and put "prefix: " in front, truncating the tail if needed. */
    size_t cap = sizeof e->msg - 1, plen = strlen(prefix) + 2, mlen = strlen(e->msg);
    if (plen >= cap)
        return;
    if (mlen > cap - plen)
        mlen = cap - plen;
    memmove(e->msg + plen, e->msg, mlen);
    e->msg[plen + mlen] = '\0';
    memcpy(e->msg, prefix, plen - 2);
    e->msg[plen - 2] = ':';
    e->msg[plen - 1] = ' ';
}

void sh__panic_at(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "shoal: panic at %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}
