/*
 * tls.cu - tagc_cuda_tls_encode / tagc_cuda_tls_decode_add: ternary codes
 * with two-level log scales (the `tls` code), the C op's bytes, residual and
 * decoded values bit for bit.  Encode runs the C op's two passes as three
 * kernels: the raw scales (one warp per block of 32, its sum of |v| in
 * csrc/tls.c's lane order, the message scale S by an atomic max), the group
 * and block codes (one thread per group, which owns its blocks' nibble
 * bytes), then the codes and residual (one thread per code byte: a byte's
 * five values may straddle two blocks, so each looks its scale up in the
 * workspace).  The scale arithmetic is csrc/tls.h's; divisions and products
 * use the _rn intrinsics so that nvcc neither fuses nor approximates them.
 */
#include <float.h>

#include "tagc_cuda_common.cuh"
#include "../csrc/tls.h"

#define TLS_WARPS (TAGC_THREADS / 32)

/* The five ternary digits of padding (q = 0): a code byte that decodes to 0. */
#define TLS_ZERO_BYTE (1u + 3u + 9u + 27u + 81u)

/* IEEE a / b rounded to nearest, as the C op divides; the emulated build
 * (no __CUDA_ARCH__) has no __fdiv_rn and divides on the host anyway. */
static __device__ __forceinline__ float tls_div(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/* *p = max(*p, v) for the bit patterns of non-negative floats, which order
 * as the floats do; a CAS loop because the emulation has no atomicMax. */
static __device__ void tls_max_bits(int32_t *p, int32_t v)
{
    int old = *(volatile int *)p;
    while (old < v) {
        int seen = atomicCAS((int *)p, old, (int)v);
        if (seen == old)
            break;
        old = seen;
    }
}

/* Pass 1: block b's raw scale into sc[b], the largest into *S (its bits),
 * and any NaN/Inf sets *nonfinite.  Lane j holds |v_j| (0 past a short
 * last block) and the shuffle tree adds lane j + off into lane j for off =
 * 16..1, the C op's sum to the last bit. */
static __global__ void tls_raw_kernel(float *sc, int32_t *S, int32_t *nonfinite, tagc_gr gr,
                                      int64_t n)
{
    __shared__ uint32_t wmax[TLS_WARPS];
    __shared__ int wbad[TLS_WARPS];
    const int64_t nb = tagc_tls_blocks(n);
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    uint32_t big = 0;
    int bad = 0;
    for (int64_t b = (int64_t)blockIdx.x * TLS_WARPS + wid; b < nb;
         b += (int64_t)gridDim.x * TLS_WARPS) {
        const int64_t o = b * TAGC_TLS_BLOCK;
        const int len = n - o < TAGC_TLS_BLOCK ? (int)(n - o) : TAGC_TLS_BLOCK;
        const float a = (int)lane < len ? fabsf(tagc_gr_load(gr, o + lane)) : 0.0f;
        const int finite = a <= FLT_MAX; /* false for NaN too */
        double acc = (double)a;
        float m = a;
        for (int off = 16; off > 0; off >>= 1) {
            acc += __shfl_down_sync(TAGC_FULL_MASK, acc, off);
            float other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
            m = other > m ? other : m;
        }
        const int block_bad = !__all_sync(TAGC_FULL_MASK, finite);
        if (lane == 0) {
            const float r = block_bad ? 0.0f : tagc_q_scale(TAGC_Q_TERNARY, acc, m, len);
            sc[b] = r;
            bad |= block_bad;
            big = __float_as_uint(r) > big ? __float_as_uint(r) : big;
        }
    }
    if (lane == 0) {
        wmax[wid] = big;
        wbad[wid] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < TLS_WARPS; w++) {
            big = wmax[w] > big ? wmax[w] : big;
            bad |= wbad[w];
        }
        if (big > 0)
            tls_max_bits(S, (int32_t)big);
        if (bad)
            atomicCAS((int *)nonfinite, 0, 1);
    }
}

/* Pass 2a: the header, and for group k its code byte, its blocks' nibbles
 * and sc[j] turned from block j's raw scale into its decoded one.  Nibble
 * byte j/2 holds blocks j and j + 1 of the same group (16 is even), so no
 * two threads share a byte.  After NaN/Inf: a NaN header over a zero
 * message (every code valid), which every decoder turns into NaN. */
static __global__ void tls_scale_kernel(uint8_t *dst, float *sc, const int32_t *S_bits,
                                        const int32_t *nonfinite, int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n), ng = tagc_tls_groups(n);
    const int poisoned = *nonfinite != 0;
    const float S = __uint_as_float((uint32_t)*S_bits);
    uint8_t *gcodes = dst + 4, *bcodes = dst + tagc_tls_block_codes_at(n);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        tagc_st_scale(dst, poisoned ? __uint_as_float(0x7fc00000u) : S);
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < ng;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j0 = k * TAGC_TLS_GROUP;
        const int64_t j1 = j0 + TAGC_TLS_GROUP < nb ? j0 + TAGC_TLS_GROUP : nb;
        float R = 0.0f;
        for (int64_t j = j0; j < j1 && !poisoned; j++)
            R = sc[j] > R ? sc[j] : R;
        int gc = R > 0.0f ? tagc_tls_group_code(tls_div(R, S)) : 255;
        const float M = tagc_tls_group_scale(S, gc);
        if (M == 0.0f)
            gc = 255; /* a group whose scale underflows sends nothing */
        gcodes[k] = (uint8_t)gc;
        for (int64_t j = j0; j < j1; j += 2) {
            unsigned byte = 0;
            for (int64_t h = j; h < j + 2 && h < j1; h++) {
                const float r = poisoned ? 0.0f : sc[h];
                const int bc = M > 0.0f && r > 0.0f ? tagc_tls_block_code(tls_div(r, M)) : 15;
                sc[h] = tagc_tls_block_scale(M, bc);
                byte |= (unsigned)bc << (4 * (h & 1));
            }
            bcodes[j >> 1] = (uint8_t)byte;
        }
    }
}

/* Pass 2b: code byte k's five digits under their blocks' decoded scales,
 * and the residual v - q s.  After NaN/Inf: zero codes, residual untouched. */
static __global__ void tls_code_kernel(uint8_t *dst, const float *sc, const int32_t *nonfinite,
                                       tagc_gr gr, void *res, int64_t n)
{
    const int poisoned = *nonfinite != 0;
    const int64_t nbytes = (n + 4) / 5;
    uint8_t *trits = dst + tagc_tls_trits_at(n);
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < nbytes;
         k += (int64_t)gridDim.x * blockDim.x) {
        if (poisoned) {
            trits[k] = (uint8_t)TLS_ZERO_BYTE;
            continue;
        }
        unsigned byte = 0;
        int64_t cached = -1;
        float s = 0.0f, inv = 0.0f;
        for (int j = 0; j < 5; j++) {
            const int64_t i = 5 * k + j;
            int q = 0;
            if (i < n) {
                if (i / TAGC_TLS_BLOCK != cached) {
                    cached = i / TAGC_TLS_BLOCK;
                    s = sc[cached];
                    inv = tagc_q_inv(s);
                }
                const float v = tagc_gr_load(gr, i);
                q = tagc_q_code(TAGC_Q_TERNARY, v, inv);
                if (res != NULL)
                    tagc_st(res, gr.rd, i, __fsub_rn(v, __fmul_rn((float)q, s)));
            }
            byte += tagc_q_digit(TAGC_Q_TERNARY, q) * tagc_q_weight(TAGC_Q_TERNARY, j);
        }
        trits[k] = (uint8_t)byte;
    }
}

/* Decode step 1: a header the C op refuses (negative, -0, Inf) or a code
 * byte >= 243 sets *bad and CORRUPT in dev_status. */
static __global__ void tls_check_kernel(int32_t *bad, int32_t *dev_status, const uint8_t *src,
                                        int64_t n)
{
    const int64_t nbytes = (n + 4) / 5;
    const uint8_t *trits = src + tagc_tls_trits_at(n);
    int found = blockIdx.x == 0 && threadIdx.x == 0 &&
                !tagc_tls_header_ok((uint32_t)tagc_ld_le(src, 4));
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < nbytes;
         k += (int64_t)gridDim.x * blockDim.x)
        found |= trits[k] >= 243u;
    if (__syncthreads_or(found) && threadIdx.x == 0) {
        *bad = 1;
        tagc_dev_fail(dev_status, TAGC_ERR_CORRUPT);
    }
}

/* Decode step 2: out[i] += q s (s from its group's and block's codes, as
 * the C op), or += S everywhere for a NaN header; nothing after step 1
 * found the message corrupt. */
static __global__ void tls_decode_kernel(float *out, const uint8_t *src, const int32_t *bad,
                                         int64_t n)
{
    if (*bad)
        return;
    const float S = tagc_ld_scale(src);
    const uint8_t *gcodes = src + 4, *bcodes = src + tagc_tls_block_codes_at(n);
    const uint8_t *trits = src + tagc_tls_trits_at(n);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (S != S) {
            out[i] = __fadd_rn(out[i], S);
            continue;
        }
        const int64_t j = i / TAGC_TLS_BLOCK;
        const float M = tagc_tls_group_scale(S, gcodes[j / TAGC_TLS_GROUP]);
        const float s = tagc_tls_block_scale(M, (bcodes[j >> 1] >> (4 * (j & 1))) & 15);
        int ignored = 0;
        const int q = tagc_q_decode(TAGC_Q_TERNARY, trits[i / 5], (int)(i % 5), &ignored);
        out[i] = __fadd_rn(out[i], __fmul_rn((float)q, s));
    }
}

/* Encode workspace: S's bits and the NaN/Inf flag (zeroed by one memset),
 * then one float per block (its raw, then its decoded scale). */
static size_t tls_encode_layout(tagc_carver *c, int64_t n, int32_t **words, float **sc)
{
    const int64_t nb = n > 0 && n <= TAGC_MAX_N ? tagc_tls_blocks(n) : 0;
    *words = (int32_t *)tagc_carve(c, 2 * sizeof(int32_t));
    *sc = (float *)tagc_carve(c, (size_t)nb * sizeof(float));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_tls_encode_workspace_size(int64_t n)
{
    tagc_carver c = {NULL, 0};
    int32_t *words;
    float *sc;
    return tls_encode_layout(&c, n, &words, &sc);
}

static size_t tls_decode_layout(tagc_carver *c, int32_t **bad)
{
    *bad = (int32_t *)tagc_carve(c, sizeof(int32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_tls_decode_add_workspace_size(void)
{
    tagc_carver c = {NULL, 0};
    int32_t *bad;
    return tls_decode_layout(&c, &bad);
}

extern "C" tagc_status tagc_cuda_tls_encode(uint8_t *dst, int64_t dst_capacity,
                                            void *residual, tagc_dtype residual_dtype,
                                            const void *grad, tagc_dtype grad_dtype,
                                            int64_t n, void *workspace, size_t workspace_bytes,
                                            cudaStream_t stream)
{
    tagc_status s = tagc_tls_check_encode(dst, dst_capacity, residual, (int)residual_dtype,
                                          grad, (int)grad_dtype, n);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes, tagc_cuda_tls_encode_workspace_size(n));
    if (s != TAGC_OK || n == 0)
        return s;
    int32_t *words;
    float *sc;
    tls_encode_layout(&c, n, &words, &sc);
    TAGC_CUDA_TRY(cudaMemsetAsync(words, 0, 2 * sizeof *words, stream));
    tagc_gr gr = {grad, residual, (int)grad_dtype,
                  residual != NULL ? (int)residual_dtype : TAGC_DT_NONE};
    tls_raw_kernel<<<tagc_grid(tagc_tls_blocks(n), TLS_WARPS), TAGC_THREADS, 0, stream>>>(
        sc, &words[0], &words[1], gr, n);
    TAGC_CUDA_LAUNCHED();
    tls_scale_kernel<<<tagc_grid(tagc_tls_groups(n), TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        dst, sc, &words[0], &words[1], n);
    TAGC_CUDA_LAUNCHED();
    tls_code_kernel<<<tagc_grid((n + 4) / 5, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        dst, sc, &words[1], gr, residual, n);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_tls_decode_add(float *out, int64_t n, const uint8_t *src,
                                                int64_t src_bytes, int32_t *dev_status,
                                                void *workspace, size_t workspace_bytes,
                                                cudaStream_t stream)
{
    tagc_status s = tagc_tls_check_decode(out, n, src, src_bytes);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes, tagc_cuda_tls_decode_add_workspace_size());
    if (s != TAGC_OK || n == 0)
        return s;
    int32_t *bad;
    tls_decode_layout(&c, &bad);
    TAGC_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof *bad, stream));
    tls_check_kernel<<<tagc_grid((n + 4) / 5, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        bad, dev_status, src, n);
    TAGC_CUDA_LAUNCHED();
    tls_decode_kernel<<<tagc_grid(n, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(out, src, bad,
                                                                               n);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
