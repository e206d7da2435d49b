/*
 * lanes_pack.cu - tagc_cuda_lanes_pack: bitmap -> `bits`-bit lanes (layout of
 * tagc_portable.h), one thread per output byte.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void lanes_pack_kernel(uint8_t *lanes, int64_t out_bytes,
                                         const uint8_t *bitmap, int64_t n,
                                         int bits)
{
    int per_byte = 8 / bits;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
         b < out_bytes; b += stride) {
        int64_t p0 = b * per_byte;
        unsigned byte = 0;
        for (int j = 0; j < per_byte; j++)
            if (p0 + j < n && tagc_bit_get(bitmap, p0 + j))
                byte |= 1u << (j * bits);
        lanes[b] = (uint8_t)byte;
    }
}

extern "C" tagc_status tagc_cuda_lanes_pack(uint8_t *lanes, int64_t lanes_capacity,
                                            const uint8_t *bitmap, int64_t n,
                                            int bits, cudaStream_t stream)
{
    tagc_status s = tagc_check_lanes_pack(lanes, lanes_capacity, bitmap, n, bits);
    if (s != TAGC_OK)
        return s;
    int64_t out = tagc_lane_bytes(n, bits);
    if (out == 0)
        return TAGC_OK;
    lanes_pack_kernel<<<tagc_grid(out, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        lanes, out, bitmap, n, bits);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
