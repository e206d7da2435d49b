/*
 * quant.cu - tagc_cuda_quant_encode / tagc_cuda_quant_decode_add: block
 * quantization with error feedback (the `quant` transport), one warp per
 * block of values.  Scales, codes and digits are tagc_portable.h's, and a
 * block's sum of |v| runs in the order csrc/quant.c takes it (32 strided
 * double partial sums, then a shuffle tree), so both write the same bytes.
 * Products and differences use the _rn intrinsics: a fused multiply-add
 * would round differently from the C op.
 */
#include <float.h>

#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

#define QUANT_WARPS (TAGC_THREADS / 32)

/* Scale of the block [o, o + len) for the calling warp; *bad when the block
 * holds NaN/Inf.  Every lane returns the same values. */
static __device__ float quant_block_scale(tagc_gr gr, int64_t o, int64_t len, int format,
                                          int *bad)
{
    double acc = 0.0;
    float m = 0.0f;
    int finite = 1;
    for (int64_t i = threadIdx.x & 31u; i < len; i += 32) {
        float a = fabsf(tagc_gr_load(gr, o + i));
        finite &= a <= FLT_MAX; /* false for NaN too */
        m = a > m ? a : m;
        if (tagc_q_uses_sum(format))
            acc += (double)a;
    }
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_down_sync(TAGC_FULL_MASK, acc, off);
        float other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
        m = other > m ? other : m;
    }
    acc = __shfl_sync(TAGC_FULL_MASK, acc, 0);
    m = __shfl_sync(TAGC_FULL_MASK, m, 0);
    *bad = !__all_sync(TAGC_FULL_MASK, finite);
    return tagc_q_scale(format, acc, m, len);
}

/* Pass 1: every block's scale into its record; any NaN/Inf sets *nonfinite. */
static __global__ void quant_scale_kernel(uint8_t *dst, int32_t *nonfinite, tagc_gr gr,
                                          int64_t n, int format, int64_t block)
{
    int64_t rec = tagc_q_record_bytes(block, format);
    int64_t nb = tagc_ceil_div(n, block);
    int64_t stride = (int64_t)gridDim.x * QUANT_WARPS;
    for (int64_t b = (int64_t)blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o = b * block, len = n - o < block ? n - o : block;
        int bad = 0;
        float s = quant_block_scale(gr, o, len, format, &bad);
        if ((threadIdx.x & 31u) == 0) {
            tagc_st_scale(dst + b * rec, s);
            if (bad)
                atomicCAS((int *)nonfinite, 0, 1);
        }
    }
}

/* Pass 2: codes and residual.  After a NaN/Inf anywhere: NaN scales and
 * zero codes everywhere, residual untouched (tagc_cuda.h). */
static __global__ void quant_encode_kernel(uint8_t *dst, const int32_t *nonfinite,
                                           tagc_gr gr, void *res, int64_t n, int format,
                                           int64_t block)
{
    int64_t rec = tagc_q_record_bytes(block, format);
    int64_t nb = tagc_ceil_div(n, block);
    int64_t stride = (int64_t)gridDim.x * QUANT_WARPS;
    int per = tagc_q_per_byte(format);
    int poisoned = *nonfinite != 0;
    unsigned lane = threadIdx.x & 31u;
    for (int64_t b = (int64_t)blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o = b * block, len = n - o < block ? n - o : block;
        uint8_t *p = dst + b * rec;
        float s = poisoned ? __uint_as_float(0x7fc00000u) : tagc_ld_scale(p);
        float inv = tagc_q_inv(s);
        int64_t nbytes = tagc_ceil_div(len, per);
        for (int64_t cb = lane; cb < nbytes; cb += 32) {
            unsigned byte = 0;
            for (int j = 0; j < per; j++) {
                int64_t i = cb * per + j;
                unsigned digit = tagc_q_pad_digit(format);
                if (i < len && !poisoned) {
                    float v = tagc_gr_load(gr, o + i);
                    int q = tagc_q_code(format, v, inv);
                    if (res != NULL)
                        tagc_st(res, gr.rd, o + i, __fsub_rn(v, __fmul_rn((float)q, s)));
                    digit = tagc_q_digit(format, q);
                }
                byte += digit * tagc_q_weight(format, j);
            }
            p[4 + cb] = (uint8_t)byte;
        }
        __syncwarp();
        if (poisoned && lane == 0)
            tagc_st_scale(p, s);
    }
}

/* Decode step 1: any invalid code sets *bad (and CORRUPT in dev_status). */
static __global__ void quant_check_kernel(int32_t *bad, int32_t *dev_status,
                                          const uint8_t *src, int64_t n, int format,
                                          int64_t block)
{
    int64_t rec = tagc_q_record_bytes(block, format);
    int64_t nb = tagc_ceil_div(n, block);
    int64_t stride = (int64_t)gridDim.x * QUANT_WARPS;
    int per = tagc_q_per_byte(format);
    int found = 0;
    for (int64_t b = (int64_t)blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o = b * block, len = n - o < block ? n - o : block;
        const uint8_t *codes = src + b * rec + 4;
        for (int64_t i = threadIdx.x & 31u; i < len; i += 32)
            (void)tagc_q_decode(format, codes[i / per], (int)(i % per), &found);
    }
    if (__syncthreads_or(found) && threadIdx.x == 0) {
        *bad = 1;
        tagc_dev_fail(dev_status, TAGC_ERR_CORRUPT);
    }
}

/* Decode step 2: out += q * s, skipped entirely when step 1 found a bad code. */
static __global__ void quant_decode_kernel(float *out, const uint8_t *src, const int32_t *bad,
                                           int64_t n, int format, int64_t block)
{
    if (*bad)
        return;
    int64_t rec = tagc_q_record_bytes(block, format);
    int64_t nb = tagc_ceil_div(n, block);
    int64_t stride = (int64_t)gridDim.x * QUANT_WARPS;
    int per = tagc_q_per_byte(format);
    for (int64_t b = (int64_t)blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o = b * block, len = n - o < block ? n - o : block;
        const uint8_t *p = src + b * rec;
        float s = tagc_ld_scale(p);
        int ignored = 0;
        for (int64_t i = threadIdx.x & 31u; i < len; i += 32) {
            int q = tagc_q_decode(format, p[4 + i / per], (int)(i % per), &ignored);
            out[o + i] = __fadd_rn(out[o + i], __fmul_rn((float)q, s));
        }
    }
}

static size_t quant_layout(tagc_carver *c, int32_t **flag)
{
    *flag = (int32_t *)tagc_carve(c, sizeof(int32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_quant_encode_workspace_size(void)
{
    tagc_carver c = {NULL, 0};
    int32_t *flag;
    return quant_layout(&c, &flag);
}

extern "C" size_t tagc_cuda_quant_decode_add_workspace_size(void)
{
    return tagc_cuda_quant_encode_workspace_size();
}

/* Opens the workspace and zeroes its flag; *flag NULL when there is no work. */
static tagc_status quant_begin(int32_t **flag, int64_t n, void *workspace,
                               size_t workspace_bytes, cudaStream_t stream)
{
    tagc_carver c;
    *flag = NULL;
    tagc_status s = tagc_ws_open(&c, workspace, workspace_bytes,
                                 tagc_cuda_quant_encode_workspace_size());
    if (s != TAGC_OK || n == 0)
        return s;
    quant_layout(&c, flag);
    TAGC_CUDA_TRY(cudaMemsetAsync(*flag, 0, sizeof **flag, stream));
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_quant_encode(uint8_t *dst, int64_t dst_capacity,
                                              void *residual, tagc_dtype residual_dtype,
                                              const void *grad, tagc_dtype grad_dtype,
                                              int64_t n, tagc_qformat format, int64_t block,
                                              void *workspace, size_t workspace_bytes,
                                              cudaStream_t stream)
{
    tagc_status s = tagc_check_quant_encode(dst, dst_capacity, residual, (int)residual_dtype,
                                            grad, (int)grad_dtype, n, (int)format, block);
    if (s != TAGC_OK)
        return s;
    int32_t *flag;
    s = quant_begin(&flag, n, workspace, workspace_bytes, stream);
    if (s != TAGC_OK || flag == NULL)
        return s;
    tagc_gr gr = {grad, residual, (int)grad_dtype,
                  residual != NULL ? (int)residual_dtype : TAGC_DT_NONE};
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), QUANT_WARPS);
    quant_scale_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, flag, gr, n, (int)format,
                                                          block);
    TAGC_CUDA_LAUNCHED();
    quant_encode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, flag, gr, residual, n,
                                                           (int)format, block);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_quant_decode_add(float *out, int64_t n,
                                                  const uint8_t *src, int64_t src_bytes,
                                                  tagc_qformat format, int64_t block,
                                                  int32_t *dev_status, void *workspace,
                                                  size_t workspace_bytes, cudaStream_t stream)
{
    tagc_status s = tagc_check_quant_decode(out, n, src, src_bytes, (int)format, block);
    if (s != TAGC_OK)
        return s;
    int32_t *bad;
    s = quant_begin(&bad, n, workspace, workspace_bytes, stream);
    if (s != TAGC_OK || bad == NULL)
        return s;
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), QUANT_WARPS);
    quant_check_kernel<<<grid, TAGC_THREADS, 0, stream>>>(bad, dev_status, src, n,
                                                          (int)format, block);
    TAGC_CUDA_LAUNCHED();
    quant_decode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, src, bad, n, (int)format,
                                                           block);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
