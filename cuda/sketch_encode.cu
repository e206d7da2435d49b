/*
 * sketch_encode.cu - tagc_cuda_sketch_encode: count sketch of the kept pairs
 * only (one thread per pair, three fp32 atomicAdds), then one rounding to
 * bf16 if asked.  Hash, bucket and sign are tagc_portable.h's.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

typedef struct {
    uint64_t s[TAGC_TABLES];
} sketch_seeds;

static __global__ void sketch_encode_kernel(float *acc, const int32_t *idx,
                                            const void *val, int vd, int64_t k,
                                            int64_t n, int64_t t,
                                            sketch_seeds ts, int32_t *dev_status)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < k;
         j += stride) {
        int64_t p = idx[j];
        if (p < 0 || p >= n) {
            tagc_dev_fail(dev_status, TAGC_ERR_RANGE);
            continue;
        }
        float v = tagc_ld(val, vd, j);
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h = tagc_hash((uint64_t)p, ts.s[i]);
            atomicAdd(&acc[tagc_bucket(h, i, t)], tagc_sign(h) * v);
        }
    }
}

static __global__ void sketch_round_kernel(uint16_t *sketch, const float *acc,
                                           int64_t m)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < m;
         b += stride)
        sketch[b] = tagc_f32_to_bf16(acc[b]);
}

static size_t sketch_layout(tagc_carver *c, int64_t t, tagc_dtype sd, float **acc)
{
    if (sd == TAGC_F32) {
        *acc = NULL;
        return 0;
    }
    *acc = (float *)tagc_carve(c, (size_t)(TAGC_TABLES * t) * sizeof(float));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_sketch_encode_workspace_size(int64_t t,
                                                         tagc_dtype sketch_dtype)
{
    tagc_carver c = {NULL, 0};
    float *acc;
    return sketch_layout(&c, t > 0 ? t : 0, sketch_dtype, &acc);
}

extern "C" tagc_status tagc_cuda_sketch_encode(void *sketch, tagc_dtype sketch_dtype,
                                               int64_t sketch_capacity,
                                               const int32_t *idx, const void *val,
                                               tagc_dtype val_dtype, int64_t k,
                                               int64_t n, int64_t t, uint64_t seed,
                                               int32_t *dev_status,
                                               void *workspace,
                                               size_t workspace_bytes,
                                               cudaStream_t stream)
{
    /* The idx[j] < n bound is checked on the device (dev_status). */
    tagc_status st = tagc_check_sketch_encode(sketch, (int)sketch_dtype, sketch_capacity,
                                              idx, val, (int)val_dtype, k, n, t);
    if (st != TAGC_OK)
        return st;
    int64_t m = TAGC_TABLES * t;
    float *acc = (float *)sketch;
    if (sketch_dtype != TAGC_F32) {
        tagc_carver c;
        tagc_status s = tagc_ws_open(
            &c, workspace, workspace_bytes,
            tagc_cuda_sketch_encode_workspace_size(t, sketch_dtype));
        if (s != TAGC_OK)
            return s;
        sketch_layout(&c, t, sketch_dtype, &acc);
    }
    TAGC_CUDA_TRY(cudaMemsetAsync(acc, 0, (size_t)m * sizeof(float), stream));
    sketch_seeds ts;
    for (int i = 0; i < TAGC_TABLES; i++)
        ts.s[i] = tagc_table_seed(seed, i);
    if (k > 0) {
        sketch_encode_kernel<<<tagc_grid(k, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
            acc, idx, val, (int)val_dtype, k, n, t, ts, dev_status);
        TAGC_CUDA_LAUNCHED();
    }
    if (sketch_dtype != TAGC_F32) {
        sketch_round_kernel<<<tagc_grid(m, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
            (uint16_t *)sketch, acc, m);
        TAGC_CUDA_LAUNCHED();
    }
    return TAGC_OK;
}
