/*
 * wq.cu - tagc_cuda_wq_encode / tagc_cuda_wq_decode: the quantized weight
 * gather, csrc/wq.c's bytes, one warp per block.  The segment table is in
 * device memory, so a one-block prefix kernel turns it into per-segment
 * offsets in the workspace (and checks it against n and the message size
 * there); every later kernel finds its block's segment by binary search over
 * those offsets.  These two, the record writer and the message check are
 * wq_common.cuh's, shared with wq_delta.cu.  Scale bits, codes and the
 * scales a receiver accepts are tagc_portable.h's; products use the _rn
 * intrinsics, as the C op's plain fp32 arithmetic rounds.
 */
#include "wq_common.cuh"

/* The weights themselves: what a record codes. */
struct wq_values {
    const void *src;
    int sd;
    __device__ float operator()(int64_t i) const { return tagc_ld(src, sd, i); }
};

/* Records of the message, one warp per block. */
static __global__ void wq_encode_kernel(uint8_t *dst, wq_ws w, wq_values v, int64_t nseg,
                                        int format, int64_t block, int32_t *dev_status)
{
    int32_t err = *w.err;
    if (blockIdx.x == 0 && threadIdx.x == 0 && err != 0)
        tagc_dev_fail(dev_status, err);
    if (err != 0)
        return;
    int64_t nb = w.blk[nseg];
    int64_t stride = (int64_t)gridDim.x * WQ_WARPS;
    for (int64_t b = (int64_t)blockIdx.x * WQ_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o, len;
        uint8_t *p = dst + wq_locate(w, nseg, b, format, block, &o, &len);
        wq_put_record(p, o, len, format, v);
    }
}

/* out[i] = x in dtype od. */
struct wq_store {
    void *out;
    int od;
    __device__ void operator()(int64_t i, float x) const { tagc_st(out, od, i, x); }
};

/* Decode step 2: out = q * s, NaN over a sentinel block; nothing at all when
 * the table or the message is invalid.  The first block reports the verdict. */
static __global__ void wq_decode_kernel(void *out, int od, wq_ws w, const uint8_t *src,
                                        int64_t nseg, int format, int64_t block,
                                        int32_t *dev_status)
{
    if (wq_decode_verdict(w, dev_status))
        wq_decode_records(w, src, nseg, format, block, wq_store{out, od});
}

extern "C" size_t tagc_cuda_wq_encode_workspace_size(int64_t nseg)
{
    return wq_workspace_size(nseg);
}

extern "C" size_t tagc_cuda_wq_decode_workspace_size(int64_t nseg)
{
    return wq_workspace_size(nseg);
}

extern "C" tagc_status tagc_cuda_wq_encode(uint8_t *dst, int64_t dst_capacity,
                                           const void *src, tagc_dtype src_dtype, int64_t n,
                                           const int64_t *seg, int64_t nseg,
                                           tagc_qformat format, int64_t block,
                                           int32_t *dev_status,
                                           void *workspace, size_t workspace_bytes,
                                           cudaStream_t stream)
{
    wq_ws w;
    int ran;
    tagc_status s = wq_begin(&w, &ran, dst, src, (int)src_dtype, n, seg, nseg, dst_capacity, 0,
                             (int)format, block, workspace, workspace_bytes, stream);
    if (s != TAGC_OK || !ran)
        return s;
    wq_values v = {src, (int)src_dtype};
    wq_encode_kernel<<<wq_grid(n, nseg, block), TAGC_THREADS, 0, stream>>>(
        dst, w, v, nseg, (int)format, block, dev_status);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_wq_decode(void *out, tagc_dtype out_dtype, int64_t n,
                                           const uint8_t *src, int64_t src_bytes,
                                           const int64_t *seg, int64_t nseg,
                                           tagc_qformat format, int64_t block,
                                           int32_t *dev_status,
                                           void *workspace, size_t workspace_bytes,
                                           cudaStream_t stream)
{
    wq_ws w;
    int ran;
    tagc_status s = wq_begin(&w, &ran, out, src, (int)out_dtype, n, seg, nseg, src_bytes, 1,
                             (int)format, block, workspace, workspace_bytes, stream);
    if (s != TAGC_OK || !ran)
        return s;
    unsigned grid = wq_grid(n, nseg, block);
    wq_check_kernel<<<grid, TAGC_THREADS, 0, stream>>>(w, src, nseg, (int)format, block, 0);
    TAGC_CUDA_LAUNCHED();
    wq_decode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, (int)out_dtype, w, src, nseg,
                                                        (int)format, block, dev_status);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
