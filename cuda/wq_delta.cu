/*
 * wq_delta.cu - tagc_cuda_wq_delta_encode / tagc_cuda_wq_delta_decode: the
 * weights' change as a wq message, csrc/wq_delta.c's bytes.  The records are
 * wq.cu's (wq_common.cuh: prefix kernel, block lookup, record writer,
 * message check) over d = src - base; the flag byte after them says whether
 * the shard changed.  Whether it did is a device-side compare, so the encode
 * kernel learns it from a flag in the workspace and writes either the
 * records or zeros: nothing waits for the host.  Differences and sums use
 * the _rn intrinsics, as the C op's plain fp32 arithmetic rounds.
 */
#include "wq_common.cuh"

/* What a delta record codes: the fp32 difference of the dtype's values. */
struct wq_change {
    const void *src, *base;
    int sd;
    __device__ float operator()(int64_t i) const
    {
        return __fsub_rn(tagc_ld(src, sd, i), tagc_ld(base, sd, i));
    }
};

/* Encode step 1: src against sent, bit for bit (-0 != +0, a NaN equals
 * itself, as the C op's memcmp), into w.changed. */
static __global__ void wq_delta_compare_kernel(wq_ws w, const void *src, const void *sent,
                                               int sd, int64_t n)
{
    if (*w.err != 0)
        return;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int diff = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (sd == TAGC_F32)
            diff |= ((const uint32_t *)src)[i] != ((const uint32_t *)sent)[i];
        else
            diff |= ((const uint16_t *)src)[i] != ((const uint16_t *)sent)[i];
    }
    if (__syncthreads_or(diff) && threadIdx.x == 0)
        *w.changed = 1;
}

/* Encode step 2, one warp per block: the block's record of the change and
 * its values copied into sent (bit patterns: the next compare is bitwise),
 * or zeros over the record when nothing changed.  The first block writes the
 * flag byte, or reports the table's error (then nothing is written). */
static __global__ void wq_delta_encode_kernel(uint8_t *dst, wq_ws w, wq_change v, void *sent,
                                              int64_t nseg, int format, int64_t block,
                                              int32_t *dev_status)
{
    int32_t err = *w.err;
    if (blockIdx.x == 0 && threadIdx.x == 0 && err != 0)
        tagc_dev_fail(dev_status, err);
    if (err != 0)
        return;
    int changed = *w.changed;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        dst[w.byte[nseg]] = (uint8_t)(changed != 0);
    int64_t nb = w.blk[nseg];
    int64_t stride = (int64_t)gridDim.x * WQ_WARPS;
    unsigned lane = threadIdx.x & 31u;
    for (int64_t b = (int64_t)blockIdx.x * WQ_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o, len;
        uint8_t *p = dst + wq_locate(w, nseg, b, format, block, &o, &len);
        if (!changed) {
            int64_t rec = tagc_q_record_bytes(len, format);
            for (int64_t i = lane; i < rec; i += 32)
                p[i] = 0;
            continue;
        }
        wq_put_record(p, o, len, format, v);
        for (int64_t i = lane; i < len; i += 32) {
            if (v.sd == TAGC_F32)
                ((uint32_t *)sent)[o + i] = ((const uint32_t *)v.src)[o + i];
            else
                ((uint16_t *)sent)[o + i] = ((const uint16_t *)v.src)[o + i];
        }
    }
}

/* ref[i] = dtype(ref[i] + x) (NaN over a sentinel block) and out[i] = ref[i]:
 * stored once per array, tagc_st rounds to the dtype, as the C op. */
struct wq_add {
    void *out, *ref;
    int d;
    __device__ void operator()(int64_t i, float x) const
    {
        float r = x != x ? x : __fadd_rn(tagc_ld(ref, d, i), x);
        tagc_st(ref, d, i, r);
        if (out != ref)
            tagc_st(out, d, i, r);
    }
};

/* Decode step 2 (step 1 is wq_check_kernel with its delta flag): nothing
 * when the table or the message is invalid; flag 0: out = ref; flag 1:
 * ref = dtype(ref + q * s) and out = ref, NaN over a sentinel block.  The
 * first block reports the verdict. */
static __global__ void wq_delta_decode_kernel(void *out, void *ref, int d, wq_ws w,
                                              const uint8_t *src, int64_t nseg, int format,
                                              int64_t block, int32_t *dev_status)
{
    if (!wq_decode_verdict(w, dev_status))
        return;
    if (src[w.byte[nseg]] == 0) { /* the check kernel let only 0 and 1 through */
        if (out == ref)
            return;
        int64_t n = w.val[nseg], stride = (int64_t)gridDim.x * blockDim.x;
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            if (d == TAGC_F32)
                ((uint32_t *)out)[i] = ((const uint32_t *)ref)[i];
            else
                ((uint16_t *)out)[i] = ((const uint16_t *)ref)[i];
        }
        return;
    }
    wq_decode_records(w, src, nseg, format, block, wq_add{out, ref, d});
}

/* An empty table (nseg == 0): the message is the flag byte alone, which a
 * receiver still checks as the C op does. */
static __global__ void wq_delta_flag_kernel(const uint8_t *flag, int32_t *dev_status)
{
    if (threadIdx.x == 0 && *flag > 1)
        tagc_dev_fail(dev_status, TAGC_ERR_CORRUPT);
}

extern "C" size_t tagc_cuda_wq_delta_encode_workspace_size(int64_t nseg)
{
    return wq_workspace_size(nseg);
}

extern "C" size_t tagc_cuda_wq_delta_decode_workspace_size(int64_t nseg)
{
    return wq_workspace_size(nseg);
}

/* The records' size or capacity from the message's (the flag byte last);
 * -1 below one byte, which no table fits. */
static inline int64_t wq_delta_records(int64_t message_bytes)
{
    return message_bytes < 1 ? -1 : message_bytes - 1;
}

extern "C" tagc_status tagc_cuda_wq_delta_encode(uint8_t *dst, int64_t dst_capacity,
                                                 const void *src, void *sent,
                                                 const void *base, tagc_dtype dtype,
                                                 int64_t n, const int64_t *seg, int64_t nseg,
                                                 tagc_qformat format, int64_t block,
                                                 int32_t *dev_status,
                                                 void *workspace, size_t workspace_bytes,
                                                 cudaStream_t stream)
{
    tagc_status s = tagc_check_wq_args(dst, src, (int)dtype, n, seg, nseg, (int)format, block);
    if (s != TAGC_OK)
        return s;
    if (nseg == 0 && n != 0) /* the C op's table check, before its pointer checks */
        return TAGC_ERR_RANGE;
    if ((n > 0 && (sent == NULL || base == NULL)) || dst == NULL)
        return TAGC_ERR_ARG; /* dst: the flag byte is written even for n == 0 */
    wq_ws w;
    int ran;
    s = wq_begin(&w, &ran, dst, src, (int)dtype, n, seg, nseg, wq_delta_records(dst_capacity),
                 0, (int)format, block, workspace, workspace_bytes, stream);
    if (s != TAGC_OK)
        return s;
    if (!ran) {
        TAGC_CUDA_TRY(cudaMemsetAsync(dst, 0, 1, stream));
        return TAGC_OK;
    }
    wq_delta_compare_kernel<<<tagc_grid(n, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        w, src, sent, (int)dtype, n);
    TAGC_CUDA_LAUNCHED();
    wq_change v = {src, base, (int)dtype};
    wq_delta_encode_kernel<<<wq_grid(n, nseg, block), TAGC_THREADS, 0, stream>>>(
        dst, w, v, sent, nseg, (int)format, block, dev_status);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_wq_delta_decode(void *out, void *ref, tagc_dtype dtype,
                                                 int64_t n, const uint8_t *src,
                                                 int64_t src_bytes, const int64_t *seg,
                                                 int64_t nseg, tagc_qformat format,
                                                 int64_t block, int32_t *dev_status,
                                                 void *workspace, size_t workspace_bytes,
                                                 cudaStream_t stream)
{
    tagc_status s = tagc_check_wq_args(out, src, (int)dtype, n, seg, nseg, (int)format, block);
    if (s != TAGC_OK)
        return s;
    if (nseg == 0 && n != 0)
        return TAGC_ERR_RANGE;
    if ((n > 0 && ref == NULL) || src == NULL)
        return TAGC_ERR_ARG; /* src: the flag byte is read even for n == 0 */
    wq_ws w;
    int ran;
    s = wq_begin(&w, &ran, out, src, (int)dtype, n, seg, nseg, wq_delta_records(src_bytes), 1,
                 (int)format, block, workspace, workspace_bytes, stream);
    if (s != TAGC_OK)
        return s;
    if (!ran) {
        wq_delta_flag_kernel<<<1, 32, 0, stream>>>(src, dev_status);
        TAGC_CUDA_LAUNCHED();
        return TAGC_OK;
    }
    unsigned grid = wq_grid(n, nseg, block);
    wq_check_kernel<<<grid, TAGC_THREADS, 0, stream>>>(w, src, nseg, (int)format, block, 1);
    TAGC_CUDA_LAUNCHED();
    wq_delta_decode_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, ref, (int)dtype, w, src,
                                                              nseg, (int)format, block,
                                                              dev_status);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
