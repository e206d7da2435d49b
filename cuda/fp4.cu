/*
 * fp4.cu - tagc_cuda_fp4_encode / tagc_cuda_fp4_decode_add / tagc_cuda_rht:
 * 4-bit block codes (E2M1 values, E8M0 scales) with error feedback and the
 * seeded block Hadamard rotation, one warp per block of values.  A warp
 * stages its block in shared memory, where the butterflies of a stage are
 * spread over the lanes (each butterfly one fp32 add or subtract: any order
 * gives the C op's bits); scale bytes, codes and hashes are csrc/fp4.h's.
 * The _rn intrinsics keep nvcc from fusing a product into an add.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/fp4.h"

#define FP4_WARPS (TAGC_THREADS / 32)

/* x[i] gets the sign flip of position o + i, for the lane's i < len. */
static __device__ void fp4_flip(float *x, int64_t o, int len, uint64_t seed, unsigned lane)
{
    for (int i = (int)lane; i < len; i += 32)
        x[i] = tagc_fp4_xor_sign(x[i], tagc_fp4_flip_bit(seed, o + i));
}

/* The rotation of a warp's block [o, o + len) staged in x (whole when len ==
 * 1 << l, else the signs only), forward or inverse, as csrc/fp4.c's
 * rotate().  Called by the whole warp; x is synchronized on return. */
static __device__ void fp4_rotate(float *x, int64_t o, int len, int l, uint64_t seed,
                                  int inverse, unsigned lane)
{
    __syncwarp();
    if (!inverse)
        fp4_flip(x, o, len, seed, lane);
    __syncwarp();
    if (len == 1 << l) {
        for (int h = 1; h < len; h <<= 1) {
            for (int t = (int)lane; t < len / 2; t += 32) {
                int i = ((t & ~(h - 1)) << 1) + (t & (h - 1));
                float a = x[i], b = x[i + h];
                x[i] = __fadd_rn(a, b);
                x[i + h] = __fsub_rn(a, b);
            }
            __syncwarp();
        }
        const float norm = tagc_fp4_norm(l);
        for (int i = (int)lane; i < len; i += 32)
            x[i] = __fmul_rn(x[i], norm);
        __syncwarp();
    }
    if (inverse)
        fp4_flip(x, o, len, seed, lane);
    __syncwarp();
}

/* Encode step 1: *bad = 1 when a |v| has a pattern above `limit`. */
static __global__ void fp4_check_kernel(int32_t *bad, tagc_gr gr, int64_t n, uint32_t limit)
{
    int found = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        found |= tagc_mag_key(tagc_gr_load(gr, i)) > limit;
    if (__syncthreads_or(found) && threadIdx.x == 0)
        *bad = 1;
}

/* Encode step 2: codes, scale bytes and residual; after step 1 found a bad
 * value, scale bytes 255 and codes 0 everywhere, residual untouched. */
static __global__ void fp4_encode_kernel(uint8_t *dst, const int32_t *bad, tagc_gr gr,
                                         void *res, int64_t n, int l, unsigned flags,
                                         uint64_t seed)
{
    __shared__ float sv[FP4_WARPS][TAGC_FP4_BLOCK_MAX];
    __shared__ float sw[FP4_WARPS][TAGC_FP4_BLOCK_MAX];
    const int64_t block = (int64_t)1 << l, nb = tagc_ceil_div(n, block),
                  code_bytes = (n + 1) / 2;
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    const int poisoned = *bad != 0, sr = (flags & TAGC_FP4_STOCHASTIC) != 0;
    float *v = sv[wid], *w = sw[wid];
    for (int64_t b = (int64_t)blockIdx.x * FP4_WARPS + wid; b < nb;
         b += (int64_t)gridDim.x * FP4_WARPS) {
        const int64_t o = b * block;
        const int len = n - o < block ? (int)(n - o) : (int)block;
        uint8_t *codes = dst + (o >> 1);
        if (poisoned) {
            for (int cb = (int)lane; cb < (len + 1) / 2; cb += 32)
                codes[cb] = 0;
            if (lane == 0)
                dst[code_bytes + b] = 255;
            continue;
        }
        for (int i = (int)lane; i < len; i += 32) {
            float x = tagc_gr_load(gr, o + i);
            v[i] = x;
            w[i] = x;
        }
        if (flags & TAGC_FP4_ROTATE)
            fp4_rotate(w, o, len, l, seed, 0, lane);
        uint32_t m = 0;
        for (int i = (int)lane; i < len; i += 32) {
            uint32_t a = tagc_mag_key(w[i]);
            m = a > m ? a : m;
        }
        for (int off = 16; off > 0; off >>= 1) {
            uint32_t other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
            m = other > m ? other : m;
        }
        const uint32_t sb = tagc_fp4_scale_byte(__shfl_sync(TAGC_FULL_MASK, m, 0));
        const float inv = tagc_fp4_inv(sb), s = tagc_fp4_scale(sb);
        __syncwarp();
        for (int cb = (int)lane; cb < (len + 1) / 2; cb += 32) {
            unsigned byte = 0;
            for (int j = 0; j < 2; j++) {
                int i = 2 * cb + j;
                if (i >= len)
                    break;
                unsigned c = tagc_fp4_code(w[i], inv, sr, sr ? tagc_fp4_uniform(seed, o + i)
                                                              : 0.0f);
                byte |= c << (4 * j);
                w[i] = __fmul_rn(tagc_fp4_value(c), s);
            }
            codes[cb] = (uint8_t)byte;
        }
        if (lane == 0)
            dst[code_bytes + b] = (uint8_t)sb;
        if (res != NULL) {
            if (flags & TAGC_FP4_ROTATE)
                fp4_rotate(w, o, len, l, seed, 1, lane);
            else
                __syncwarp();
            for (int i = (int)lane; i < len; i += 32)
                tagc_st(res, gr.rd, o + i, __fsub_rn(v[i], w[i]));
        }
        __syncwarp(); /* the next block reuses v and w */
    }
}

/* out[o, o + len) += the decoded values, one warp per block. */
static __global__ void fp4_decode_kernel(float *out, const uint8_t *src, int64_t n, int l,
                                         unsigned flags, uint64_t seed)
{
    __shared__ float sw[FP4_WARPS][TAGC_FP4_BLOCK_MAX];
    const int64_t block = (int64_t)1 << l, nb = tagc_ceil_div(n, block),
                  code_bytes = (n + 1) / 2;
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    float *w = sw[wid];
    for (int64_t b = (int64_t)blockIdx.x * FP4_WARPS + wid; b < nb;
         b += (int64_t)gridDim.x * FP4_WARPS) {
        const int64_t o = b * block;
        const int len = n - o < block ? (int)(n - o) : (int)block;
        const uint8_t *codes = src + (o >> 1);
        const float s = tagc_fp4_scale(src[code_bytes + b]);
        for (int i = (int)lane; i < len; i += 32)
            w[i] = __fmul_rn(tagc_fp4_value((unsigned)(codes[i >> 1] >> (4 * (i & 1))) & 15u),
                             s);
        if (flags & TAGC_FP4_ROTATE)
            fp4_rotate(w, o, len, l, seed, 1, lane);
        for (int i = (int)lane; i < len; i += 32)
            out[o + i] = __fadd_rn(out[o + i], w[i]);
        __syncwarp();
    }
}

/* dst = the rotation of src (or its inverse), one warp per block. */
static __global__ void fp4_rht_kernel(float *dst, const float *src, int64_t n, int l,
                                      uint64_t seed, int inverse)
{
    __shared__ float sw[FP4_WARPS][TAGC_FP4_BLOCK_MAX];
    const int64_t block = (int64_t)1 << l, nb = tagc_ceil_div(n, block);
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    float *w = sw[wid];
    for (int64_t b = (int64_t)blockIdx.x * FP4_WARPS + wid; b < nb;
         b += (int64_t)gridDim.x * FP4_WARPS) {
        const int64_t o = b * block;
        const int len = n - o < block ? (int)(n - o) : (int)block;
        for (int i = (int)lane; i < len; i += 32)
            w[i] = src[o + i];
        fp4_rotate(w, o, len, l, seed, inverse, lane);
        for (int i = (int)lane; i < len; i += 32)
            dst[o + i] = w[i];
        __syncwarp();
    }
}

static size_t fp4_layout(tagc_carver *c, int32_t **flag)
{
    *flag = (int32_t *)tagc_carve(c, sizeof(int32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_fp4_encode_workspace_size(void)
{
    tagc_carver c = {NULL, 0};
    int32_t *flag;
    return fp4_layout(&c, &flag);
}

extern "C" tagc_status tagc_cuda_fp4_encode(uint8_t *dst, int64_t dst_capacity,
                                            void *residual, tagc_dtype residual_dtype,
                                            const void *grad, tagc_dtype grad_dtype,
                                            int64_t n, int64_t block, unsigned flags,
                                            uint64_t seed, void *workspace,
                                            size_t workspace_bytes, cudaStream_t stream)
{
    tagc_status s = tagc_fp4_check_encode(dst, dst_capacity, residual, (int)residual_dtype,
                                          grad, (int)grad_dtype, n, block, flags);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes, tagc_cuda_fp4_encode_workspace_size());
    if (s != TAGC_OK || n == 0)
        return s;
    int32_t *flag;
    fp4_layout(&c, &flag);
    TAGC_CUDA_TRY(cudaMemsetAsync(flag, 0, sizeof *flag, stream));
    tagc_gr gr = {grad, residual, (int)grad_dtype,
                  residual != NULL ? (int)residual_dtype : TAGC_DT_NONE};
    fp4_check_kernel<<<tagc_grid(n, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(flag, gr, n,
                                                                              TAGC_FP4_MAX_BITS);
    TAGC_CUDA_LAUNCHED();
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), FP4_WARPS);
    fp4_encode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, flag, gr, residual, n,
                                                         tagc_fp4_log2(block), flags, seed);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_fp4_decode_add(float *out, int64_t n, const uint8_t *src,
                                                int64_t src_bytes, int64_t block,
                                                unsigned flags, uint64_t seed,
                                                cudaStream_t stream)
{
    tagc_status s = tagc_fp4_check_decode(out, n, src, src_bytes, block, flags);
    if (s != TAGC_OK || n == 0)
        return s;
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), FP4_WARPS);
    fp4_decode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, src, n, tagc_fp4_log2(block),
                                                         flags, seed);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_rht(float *dst, int64_t dst_capacity, const float *src,
                                     int64_t n, int64_t block, uint64_t seed, int inverse,
                                     cudaStream_t stream)
{
    tagc_status s = tagc_fp4_check_rht(dst, dst_capacity, src, n, block);
    if (s != TAGC_OK || n == 0)
        return s;
    unsigned grid = tagc_grid(tagc_ceil_div(n, block), FP4_WARPS);
    fp4_rht_kernel<<<grid, TAGC_THREADS, 0, stream>>>(dst, src, n, tagc_fp4_log2(block), seed,
                                                      inverse != 0);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
