/*
 * tagc_cuda_module.h - what _tagcmodule.c (beside it) needs to run a tagc_cuda_*
 * launcher for CUDA tensors: device detection, and a begin/end pair that
 * makes the tensors' device current and gives the launcher a stream-ordered
 * workspace (cudaMallocAsync on the caller's stream, cudaFreeAsync after the
 * launch, so nothing waits).  Only compiled into CUDA builds
 * (TAGC_WITH_CUDA).
 */
#ifndef TAGC_CUDA_MODULE_H
#define TAGC_CUDA_MODULE_H

#include "tagc_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the CUDA runtime loads, finds a driver and sees at least one
 * device; 0 otherwise (no driver, no device, driver older than the
 * runtime).  Never fails: the answer to "may CUDA tensors be passed". */
int tagc_cudamod_available(void);

/* Makes `device` current (remembering the previous one in *prev_device) and
 * allocates ws_bytes of workspace in stream order on `stream` (*ws = NULL
 * when ws_bytes == 0).  The first call per device raises the release
 * threshold of its default memory pool so that freed workspaces stay
 * cached instead of going back to the driver at every synchronization.
 * Errors: CUDA (no such device, driver), NOMEM (allocation). */
tagc_status tagc_cudamod_begin(int device, size_t ws_bytes, cudaStream_t stream,
                               void **ws, int *prev_device);

/* Frees ws in stream order and restores the previous device. */
tagc_status tagc_cudamod_end(void *ws, cudaStream_t stream, int prev_device);

#ifdef __cplusplus
}
#endif

#endif /* TAGC_CUDA_MODULE_H */
