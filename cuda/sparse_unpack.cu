/*
 * sparse_unpack.cu - tagc_cuda_sparse_unpack: check every offset first (a
 * device flag in the workspace), then scatter-add only if all were in range,
 * so corrupt input leaves out untouched as in the C op.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

static __global__ void sparse_check_kernel(int32_t *bad, int32_t *dev_status,
                                           const uint8_t *buf, int64_t k,
                                           int64_t n)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int found = 0;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < k;
         j += stride) {
        int64_t off = (int32_t)tagc_ld_le(buf + 4 * j, 4);
        found |= off < 0 || off >= n;
    }
    if (__syncthreads_or(found) && threadIdx.x == 0) {
        *bad = 1;
        tagc_dev_fail(dev_status, TAGC_ERR_CORRUPT);
    }
}

static __global__ void sparse_unpack_kernel(float *out, const uint8_t *buf,
                                            int64_t k, int es,
                                            const int32_t *bad)
{
    if (*bad)
        return;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < k;
         j += stride) {
        int32_t off = (int32_t)tagc_ld_le(buf + 4 * j, 4);
        uint32_t bits = (uint32_t)tagc_ld_le(buf + 4 * k + es * j, es);
        float v = es == 4 ? __uint_as_float(bits) : tagc_bf16_to_f32((uint16_t)bits);
        atomicAdd(&out[off], v);
    }
}

static size_t sparse_unpack_layout(tagc_carver *c, int32_t **bad)
{
    *bad = (int32_t *)tagc_carve(c, sizeof(int32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_sparse_unpack_workspace_size(void)
{
    tagc_carver c = {NULL, 0};
    int32_t *bad;
    return sparse_unpack_layout(&c, &bad);
}

extern "C" tagc_status tagc_cuda_sparse_unpack(float *out, int64_t n,
                                               const uint8_t *buf,
                                               int64_t buf_bytes, int64_t k,
                                               tagc_dtype val_dtype,
                                               int32_t *dev_status,
                                               void *workspace,
                                               size_t workspace_bytes,
                                               cudaStream_t stream)
{
    tagc_status s = tagc_check_sparse_unpack(out, n, buf, buf_bytes, k, val_dtype);
    if (s != TAGC_OK)
        return s;
    int64_t es = tagc_check_dtype_size(val_dtype);
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes,
                                 tagc_cuda_sparse_unpack_workspace_size());
    if (s != TAGC_OK || k == 0)
        return s;
    int32_t *bad;
    sparse_unpack_layout(&c, &bad);
    TAGC_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof *bad, stream));
    unsigned grid = tagc_grid(k, TAGC_THREADS);
    sparse_check_kernel<<<grid, TAGC_THREADS, 0, stream>>>(bad, dev_status, buf,
                                                           k, n);
    TAGC_CUDA_LAUNCHED();
    sparse_unpack_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, buf, k, (int)es,
                                                            bad);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
