/*
 * bitmap_or.cu - tagc_cuda_bitmap_or: OR of `count` bitmaps of nbytes bytes
 * laid end to end (what an all-to-all of bitmaps delivers to the owner).
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void bitmap_or_kernel(uint8_t *dst, const uint8_t *src,
                                        int64_t nbytes, int64_t count)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < nbytes;
         j += stride) {
        unsigned acc = 0;
        for (int64_t r = 0; r < count; r++)
            acc |= src[r * nbytes + j];
        dst[j] = (uint8_t)acc;
    }
}

extern "C" tagc_status tagc_cuda_bitmap_or(uint8_t *dst, int64_t dst_capacity,
                                           const uint8_t *src, int64_t nbytes,
                                           int64_t count, cudaStream_t stream)
{
    tagc_status s = tagc_check_bitmap_or(dst, dst_capacity, src, nbytes, count);
    if (s != TAGC_OK || nbytes == 0)
        return s;
    if (count == 0) {
        TAGC_CUDA_TRY(cudaMemsetAsync(dst, 0, (size_t)nbytes, stream));
        return TAGC_OK;
    }
    bitmap_or_kernel<<<tagc_grid(nbytes, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        dst, src, nbytes, count);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
