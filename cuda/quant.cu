/*
 * quant.cu - tagc_cuda_quant_encode / tagc_cuda_quant_decode_add: block
 * quantization with error feedback (the `quant` transport), one warp per
 * block of values.  Scales, codes and digits are tagc_portable.h's, and a
 * block's sum of |v| runs in the order csrc/quant.c takes it (32 strided
 * double partial sums, then a shuffle tree), so both write the same bytes.
 * Products and differences use the _rn intrinsics: a fused multiply-add
 * would round differently from the C op.
 *
 * The vector route: int4 and int8 take max |v| as their scale, which any
 * order of reading gives, so where the gradient and residual are fp32 and
 * 16-byte aligned, the codes 4-byte aligned and a block a multiple of 8, each
 * lane reads 8 consecutive values as two float4 and writes their codes as one
 * (int4) or two (int8) 32-bit words; decoding into a 16-byte aligned sum reads
 * them back the same way.  On an H200 (docs/gpu) the element-wise
 * route reached 36% of a device copy: one scalar load per lane in flight and
 * byte stores left the memory system idle.
 */
#include <float.h>

#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

#define QUANT_WARPS (TAGC_THREADS / 32)
/* Values per lane and step on the vector route. */
#define QUANT_VEC 8

/* The 8 values gr holds at [i, i + 8): fp32 gradient plus the fp32 residual
 * if any, the sum tagc_gr_load takes. */
static __device__ __forceinline__ void quant_load8(float v[QUANT_VEC], tagc_gr gr, int64_t i)
{
    const float4 *g = (const float4 *)((const float *)gr.g + i);
    float4 a = g[0], b = g[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    if (gr.rd != TAGC_DT_NONE) {
        const float4 *r = (const float4 *)((const float *)gr.r + i);
        float4 c = r[0], d = r[1];
        v[0] += c.x, v[1] += c.y, v[2] += c.z, v[3] += c.w;
        v[4] += d.x, v[5] += d.y, v[6] += d.z, v[7] += d.w;
    }
}

/* max |v| of a whole block on the vector route (int4, int8); *bad as
 * quant_block_scale's. */
static __device__ float quant_block_scale_vec(tagc_gr gr, int64_t o, int64_t len, int format,
                                              int *bad)
{
    float m = 0.0f;
    int finite = 1;
    for (int64_t c = threadIdx.x & 31u; c < len / QUANT_VEC; c += 32) {
        float v[QUANT_VEC];
        quant_load8(v, gr, o + c * QUANT_VEC);
        for (int j = 0; j < QUANT_VEC; j++) {
            float a = fabsf(v[j]);
            finite &= a <= FLT_MAX;
            m = a > m ? a : m;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
        m = other > m ? other : m;
    }
    m = __shfl_sync(TAGC_FULL_MASK, m, 0);
    *bad = !__all_sync(TAGC_FULL_MASK, finite);
    return tagc_q_scale(format, 0.0, m, len);
}

/* Codes and residual of a whole block on the vector route (no NaN/Inf). */
static __device__ void quant_encode_block_vec(uint8_t *codes, tagc_gr gr, float *res,
                                              int64_t o, int64_t len, int format, float s,
                                              float inv)
{
    for (int64_t c = threadIdx.x & 31u; c < len / QUANT_VEC; c += 32) {
        float v[QUANT_VEC];
        quant_load8(v, gr, o + c * QUANT_VEC);
        uint32_t w[2] = {0u, 0u};
        for (int j = 0; j < QUANT_VEC; j++) {
            int q = tagc_q_code(format, v[j], inv);
            uint32_t d = tagc_q_digit(format, q);
            if (format == TAGC_Q_INT4)
                w[0] |= d << (4 * j);
            else
                w[j >> 2] |= d << (8 * (j & 3));
            v[j] = __fsub_rn(v[j], __fmul_rn((float)q, s));
        }
        if (res != NULL) {
            float4 *r = (float4 *)(res + o + c * QUANT_VEC);
            r[0] = make_float4(v[0], v[1], v[2], v[3]);
            r[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
        /* little-endian words: digit j of a word is its byte j (int8) or
         * nibble j (int4), the byte order tagc_q_weight gives */
        uint32_t *out = (uint32_t *)codes;
        if (format == TAGC_Q_INT4) {
            out[c] = w[0];
        } else {
            out[2 * c] = w[0];
            out[2 * c + 1] = w[1];
        }
    }
}

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
    *bad = !__all_sync(TAGC_FULL_MASK, finite);
    return tagc_warp_q_scale(acc, m, format, len);
}

/* Pass 1: every block's scale into its record; any NaN/Inf sets *nonfinite. */
static __global__ void quant_scale_kernel(uint8_t *dst, int32_t *nonfinite, tagc_gr gr,
                                          int64_t n, int format, int64_t block, int vec)
{
    int64_t rec = tagc_q_record_bytes(block, format);
    int64_t nb = tagc_ceil_div(n, block);
    int64_t stride = (int64_t)gridDim.x * QUANT_WARPS;
    for (int64_t b = (int64_t)blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o = b * block, len = n - o < block ? n - o : block;
        int bad = 0;
        float s = vec && len == block ? quant_block_scale_vec(gr, o, len, format, &bad)
                                      : quant_block_scale(gr, o, len, format, &bad);
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
                                           int64_t block, int vec)
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
        if (vec && len == block && !poisoned) {
            quant_encode_block_vec(p + 4, gr, (float *)res, o, len, format, s, inv);
            continue;
        }
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

/* out[o, o + len) += q * s for a whole block on the vector route: 8 codes as
 * one or two 32-bit words, the 8 sums as two float4. */
static __device__ void quant_decode_block_vec(float *out, const uint8_t *codes, int64_t o,
                                              int64_t len, int format, float s)
{
    const uint32_t *in = (const uint32_t *)codes;
    for (int64_t c = threadIdx.x & 31u; c < len / QUANT_VEC; c += 32) {
        uint32_t w[2];
        w[0] = format == TAGC_Q_INT4 ? in[c] : in[2 * c];
        w[1] = format == TAGC_Q_INT4 ? 0u : in[2 * c + 1];
        float4 *acc = (float4 *)(out + o + c * QUANT_VEC);
        float4 a = acc[0], b = acc[1];
        float v[QUANT_VEC] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int ignored = 0;
        for (int j = 0; j < QUANT_VEC; j++) {
            /* byte j / 2 holding nibble j % 2 (int4), byte j (int8) */
            unsigned byte = format == TAGC_Q_INT4 ? (w[0] >> (8 * (j >> 1))) & 0xffu
                                                  : (w[j >> 2] >> (8 * (j & 3))) & 0xffu;
            int q = tagc_q_decode(format, byte, format == TAGC_Q_INT4 ? (j & 1) : 0, &ignored);
            v[j] = __fadd_rn(v[j], __fmul_rn((float)q, s));
        }
        acc[0] = make_float4(v[0], v[1], v[2], v[3]);
        acc[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

/* Decode step 2: out += q * s, skipped entirely when step 1 found a bad code. */
static __global__ void quant_decode_kernel(float *out, const uint8_t *src, const int32_t *bad,
                                           int64_t n, int format, int64_t block, int vec)
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
        if (vec && len == block) {
            quant_decode_block_vec(out, p + 4, o, len, format, s);
            continue;
        }
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
    int vec = (format == TAGC_Q_INT4 || format == TAGC_Q_INT8) && block % QUANT_VEC == 0 &&
              grad_dtype == TAGC_F32 && (uintptr_t)grad % 16 == 0 &&
              (residual == NULL || (residual_dtype == TAGC_F32 && (uintptr_t)residual % 16 == 0)) &&
              (uintptr_t)dst % 4 == 0;
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), QUANT_WARPS);
    quant_scale_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, flag, gr, n, (int)format,
                                                          block, vec);
    TAGC_CUDA_LAUNCHED();
    quant_encode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, flag, gr, residual, n,
                                                           (int)format, block, vec);
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
    int vec = (format == TAGC_Q_INT4 || format == TAGC_Q_INT8) && block % QUANT_VEC == 0 &&
              (uintptr_t)out % 16 == 0 && (uintptr_t)src % 4 == 0;
    quant_decode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, src, bad, n, (int)format,
                                                           block, vec);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
