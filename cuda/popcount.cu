/*
 * popcount.cu - tagc_cuda_popcount: set bits among the first n bits of a
 * bitmap, summed per block then atomically into the device int64.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void popcount_kernel(unsigned long long *count,
                                       const uint8_t *bitmap, int64_t n)
{
    int64_t nb = (n + 7) >> 3, stride = (int64_t)gridDim.x * blockDim.x;
    unsigned local = 0;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < nb;
         j += stride) {
        unsigned byte = bitmap[j];
        if (j == nb - 1 && (n & 7))
            byte &= (1u << (n & 7)) - 1u;
        local += (unsigned)__popc(byte);
    }
    for (int o = 16; o > 0; o >>= 1)
        local += __shfl_down_sync(TAGC_FULL_MASK, local, o);
    if ((threadIdx.x & 31u) == 0 && local != 0)
        atomicAdd(count, (unsigned long long)local);
}

extern "C" tagc_status tagc_cuda_popcount(int64_t *count, const uint8_t *bitmap,
                                          int64_t n, cudaStream_t stream)
{
    tagc_status s = tagc_check_popcount(count, bitmap, n);
    if (s != TAGC_OK)
        return s;
    TAGC_CUDA_TRY(cudaMemsetAsync(count, 0, sizeof *count, stream));
    if (n == 0)
        return TAGC_OK;
    int64_t nb = (n + 7) >> 3;
    popcount_kernel<<<tagc_grid(nb, TAGC_THREADS * 8), TAGC_THREADS, 0, stream>>>(
        (unsigned long long *)count, bitmap, n);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
