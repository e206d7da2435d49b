/*
 * sparse_pack.cu - tagc_cuda_sparse_pack: k little-endian int32 offsets then
 * k raw values.  Byte stores, because a rank's slice of an all-to-all buffer
 * of bf16 pairs (6 bytes each) need not be 4-byte aligned.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void sparse_pack_kernel(uint8_t *buf, const int32_t *idx,
                                          const void *val, int es, int64_t k)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < k;
         j += stride) {
        uint32_t off = (uint32_t)idx[j];
        uint32_t bits = es == 4 ? ((const uint32_t *)val)[j]
                                : ((const uint16_t *)val)[j];
        uint8_t *o = buf + 4 * j, *v = buf + 4 * k + es * j;
        for (int b = 0; b < 4; b++)
            o[b] = (uint8_t)(off >> (8 * b));
        for (int b = 0; b < es; b++)
            v[b] = (uint8_t)(bits >> (8 * b));
    }
}

extern "C" tagc_status tagc_cuda_sparse_pack(uint8_t *buf, int64_t buf_capacity,
                                             const int32_t *idx, const void *val,
                                             tagc_dtype val_dtype, int64_t k,
                                             cudaStream_t stream)
{
    tagc_status s = tagc_check_sparse_pack(buf, buf_capacity, idx, val, val_dtype, k);
    if (s != TAGC_OK)
        return s;
    int64_t es = tagc_check_dtype_size(val_dtype);
    if (k == 0)
        return TAGC_OK;
    sparse_pack_kernel<<<tagc_grid(k, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        buf, idx, val, (int)es, k);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
