/*
 * lanes_unpack.cu - tagc_cuda_lanes_unpack: lanes (possibly SUM-reduced) ->
 * bitmap, bit p set iff lane p is non-zero; one thread per bitmap byte.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void lanes_unpack_kernel(uint8_t *bitmap, int64_t nb,
                                           const uint8_t *lanes, int64_t n,
                                           int bits)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb;
         b += stride) {
        unsigned byte = 0;
        for (int j = 0; j < 8; j++)
            if (8 * b + j < n && tagc_lane_get(lanes, 8 * b + j, bits))
                byte |= 1u << j;
        bitmap[b] = (uint8_t)byte;
    }
}

extern "C" tagc_status tagc_cuda_lanes_unpack(uint8_t *bitmap,
                                              int64_t bitmap_capacity,
                                              const uint8_t *lanes,
                                              int64_t lanes_bytes, int64_t n,
                                              int bits, cudaStream_t stream)
{
    tagc_status s = tagc_check_lanes_unpack(bitmap, bitmap_capacity, lanes,
                                            lanes_bytes, n, bits);
    int64_t nb = (n + 7) >> 3;
    if (s != TAGC_OK || nb == 0)
        return s;
    lanes_unpack_kernel<<<tagc_grid(nb, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        bitmap, nb, lanes, n, bits);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
