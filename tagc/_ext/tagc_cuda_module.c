/*
 * tagc_cuda_module.c - device selection and stream-ordered workspaces for
 * the CPython module's CUDA path (tagc_cuda_module.h).  Plain C over the
 * CUDA runtime API, compiled by the C compiler.
 */
#include <stdint.h>

#include "tagc_cuda_module.h"

/* Devices whose default pool already keeps freed memory; racing threads may
 * both set it, which is harmless. */
#define TAGC_MAX_DEVICES 64
static volatile int pool_ready[TAGC_MAX_DEVICES];

int tagc_cudamod_available(void)
{
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

static void keep_pool(int device)
{
    if (device < 0 || device >= TAGC_MAX_DEVICES || pool_ready[device])
        return;
    cudaMemPool_t pool;
    uint64_t keep = UINT64_MAX;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) ==
            cudaSuccess)
        pool_ready[device] = 1;
    (void)cudaGetLastError(); /* a failure here only costs speed */
}

tagc_status tagc_cudamod_begin(int device, size_t ws_bytes, cudaStream_t stream,
                               void **ws, int *prev_device)
{
    *ws = NULL;
    if (cudaGetDevice(prev_device) != cudaSuccess)
        return TAGC_ERR_CUDA;
    if (*prev_device != device && cudaSetDevice(device) != cudaSuccess)
        return TAGC_ERR_CUDA;
    keep_pool(device);
    if (ws_bytes == 0)
        return TAGC_OK;
    cudaError_t e = cudaMallocAsync(ws, ws_bytes, stream);
    if (e != cudaSuccess) {
        *ws = NULL;
        (void)cudaGetLastError(); /* not sticky: clear it for the next call */
        if (*prev_device != device)
            (void)cudaSetDevice(*prev_device);
        return e == cudaErrorMemoryAllocation ? TAGC_ERR_NOMEM : TAGC_ERR_CUDA;
    }
    return TAGC_OK;
}

tagc_status tagc_cudamod_end(void *ws, cudaStream_t stream, int prev_device)
{
    tagc_status st = TAGC_OK;
    if (ws != NULL && cudaFreeAsync(ws, stream) != cudaSuccess)
        st = TAGC_ERR_CUDA;
    int cur = prev_device;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_device &&
        cudaSetDevice(prev_device) != cudaSuccess)
        st = TAGC_ERR_CUDA;
    return st;
}
