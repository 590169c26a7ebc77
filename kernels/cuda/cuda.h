/* Entry points of the CUDA backend that C code may call (SH_CUDA builds only). */
#ifndef SH_KERNELS_CUDA_H
#define SH_KERNELS_CUDA_H

#include <stddef.h>

#include "shoal/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible to this process; 0 (and SH_OK) when the driver or devices are
 * missing, so callers can skip cleanly. The name of device 0 goes to name (may be NULL). */
sh_err sh__cuda_device_count(int *n, char *name, size_t name_len);

/* y[i] = a * x[i] + y[i] for n floats, computed on device 0 and copied back: a round trip through
 * the toolchain, the runtime and a kernel launch. SH_EDEVICE on any CUDA failure (text in e). */
sh_err sh__cuda_saxpy(float a, const float *x, float *y, size_t n, sh_error *e);

#ifdef __cplusplus
}
#endif

#endif
