/* The one error enum of Shoal, its text, and the error detail filled in by fallible calls. */
#ifndef SHOAL_ERR_H
#define SHOAL_ERR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every fallible function returns one of these. SH_OK is zero so `if (err)` tests for failure. */
typedef enum sh_err {
    SH_OK = 0,
    SH_EINVAL,       /* an argument or input value is invalid */
    SH_ENOMEM,       /* an allocation failed */
    SH_EIO,          /* a read, write, open or mmap failed (errno text in the detail) */
    SH_EFORMAT,      /* a file or frame is malformed: bad magic, truncated, out of bounds */
    SH_EUNSUPPORTED, /* well-formed but not supported: version, tensor type, architecture */
    SH_ENOTFOUND,    /* a key, tensor, file or actor does not exist */
    SH_ERANGE,       /* a value is outside what the caller or the format allows */
    SH_ETIMEDOUT,    /* a deadline passed */
    SH_ECLOSED,      /* the object or peer is closed */
    SH_EBUSY,        /* try again later: a queue or pool is full */
    SH_ECANCELED,    /* the operation was cancelled */
    SH_EPROTO,       /* a peer broke the protocol */
    SH_ELUA,         /* a Lua script failed */
    SH_EDEVICE,      /* a CUDA, cuBLAS or NCCL call failed */
    SH_ERR_COUNT_
} sh_err;

/* A static, human-readable name of the code ("invalid argument"); never NULL. Any thread. */
const char *sh_strerror(sh_err err);

/* Detail of a failed call: the code and one line naming the offending field and value.
 * Functions that take an `sh_error *` accept NULL when the caller wants the code only. */
typedef struct sh_error {
    sh_err code;
    char msg[320];
} sh_error;

#ifdef __cplusplus
}
#endif

#endif
