// Device discovery and a first kernel: proves the CUDA toolchain, runtime and launches work.
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cuda.h"

#define SH_CUDA_TRY(call)                                                                          \
    do {                                                                                           \
        cudaError_t rc_ = (call);                                                                  \
        if (rc_ != cudaSuccess) {                                                                  \
            if (e) {                                                                               \
                e->code = SH_EDEVICE;                                                              \
                snprintf(e->msg, sizeof e->msg, "%s:%d: %s: %s", __FILE__, __LINE__, #call,        \
                         cudaGetErrorString(rc_));                                                 \
            }                                                                                      \
            err = SH_EDEVICE;                                                                      \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

extern "C" sh_err sh__cuda_device_count(int *n, char *name, size_t name_len)
{
    *n = 0;
    if (name && name_len)
        name[0] = '\0';
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError(); // no driver or no device: clear the sticky error and report none
        return SH_OK;
    }
    *n = count;
    if (count > 0 && name && name_len) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
            snprintf(name, name_len, "%s", prop.name);
    }
    return SH_OK;
}

static __global__ void saxpy_kernel(float a, const float *x, float *y, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}

extern "C" sh_err sh__cuda_saxpy(float a, const float *x, float *y, size_t n, sh_error *e)
{
    sh_err err = SH_OK;
    float *dx = NULL, *dy = NULL;
    const unsigned threads = 256;
    const unsigned blocks = (unsigned)((n + threads - 1) / threads);
    SH_CUDA_TRY(cudaMalloc(&dx, n * sizeof(float)));
    SH_CUDA_TRY(cudaMalloc(&dy, n * sizeof(float)));
    SH_CUDA_TRY(cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice));
    SH_CUDA_TRY(cudaMemcpy(dy, y, n * sizeof(float), cudaMemcpyHostToDevice));
    saxpy_kernel<<<blocks, threads>>>(a, dx, dy, n);
    SH_CUDA_TRY(cudaGetLastError());
    SH_CUDA_TRY(cudaMemcpy(y, dy, n * sizeof(float), cudaMemcpyDeviceToHost));
out:
    cudaFree(dx);
    cudaFree(dy);
    return err;
}
