/*
 * wq_common.cuh - what the two wq launcher files share (cuda/wq.cu, the
 * weights; cuda/wq_delta.cu, the weights' change): the workspace, the
 * one-block prefix kernel that turns the device segment table into
 * per-segment offsets and checks it, the block lookup, the record writer,
 * the message check and the host-side start of every launcher.  Internal to
 * cuda/; everything is static (each .cu file gets its own copy).
 */
#ifndef TAGC_WQ_COMMON_CUH
#define TAGC_WQ_COMMON_CUH

#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

#define WQ_WARPS (TAGC_THREADS / 32)

/* The workspace: for segment i, the wire index of its first block, its
 * first value and its first byte (nseg + 1 entries each, the totals last),
 * and the flags the kernels pass on. */
typedef struct {
    int64_t *blk, *val, *byte;
    int32_t *err;      /* the table's error (RANGE, CAPACITY), 0 if it is valid */
    int32_t *corrupt;  /* decode: a scale or code no encoder writes */
    int32_t *sentinel; /* decode: a record holds TAGC_WQ_NONFINITE */
    int32_t *changed;  /* delta encode: src differs from sent somewhere */
} wq_ws;

static inline size_t wq_layout(tagc_carver *c, int64_t nseg, wq_ws *w)
{
    size_t table = (size_t)(nseg + 1) * sizeof(int64_t);
    w->blk = (int64_t *)tagc_carve(c, table);
    w->val = (int64_t *)tagc_carve(c, table);
    w->byte = (int64_t *)tagc_carve(c, table);
    w->err = (int32_t *)tagc_carve(c, 4 * sizeof(int32_t));
    w->corrupt = w->err == NULL ? NULL : w->err + 1;
    w->sentinel = w->err == NULL ? NULL : w->err + 2;
    w->changed = w->err == NULL ? NULL : w->err + 3;
    return tagc_carved_size(c);
}

/* One block of TAGC_THREADS: the offsets of every segment and the table's
 * verdict.  Thread t sums a contiguous run of segments, thread 0 turns the
 * runs' sums into their starts (a serial pass over TAGC_THREADS entries),
 * then each thread writes its segments' offsets.  A length outside
 * [0, TAGC_MAX_N] counts as 0 and makes the table invalid, so no sum can
 * overflow.  need_exact: the message must be `bytes` long (decode), else at
 * most (encode).  The other flags start at 0 here, so no launcher needs a
 * memset of its own. */
static __global__ void wq_prefix_kernel(wq_ws w, const int64_t *seg, int64_t nseg, int64_t n,
                                        int64_t bytes, int need_exact, int format,
                                        int64_t block)
{
    __shared__ int64_t sh_blk[TAGC_THREADS], sh_val[TAGC_THREADS], sh_byte[TAGC_THREADS];
    __shared__ int32_t sh_bad;
    int64_t run = tagc_ceil_div(nseg, TAGC_THREADS);
    int64_t lo = (int64_t)threadIdx.x * run, hi = lo + run;
    lo = lo < nseg ? lo : nseg;
    hi = hi < nseg ? hi : nseg;
    int64_t b = 0, v = 0, y = 0;
    int bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        int64_t len = seg[i];
        bad |= len < 0 || len > TAGC_MAX_N;
        len = len < 0 || len > TAGC_MAX_N ? 0 : len;
        b += tagc_ceil_div(len, block);
        v += len;
        y += tagc_q_bytes(len, format, block);
    }
    sh_blk[threadIdx.x] = b;
    sh_val[threadIdx.x] = v;
    sh_byte[threadIdx.x] = y;
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        int64_t cb = 0, cv = 0, cy = 0;
        for (int t = 0; t < TAGC_THREADS; t++) {
            int64_t tb = sh_blk[t], tv = sh_val[t], ty = sh_byte[t];
            sh_blk[t] = cb;
            sh_val[t] = cv;
            sh_byte[t] = cy;
            cb += tb;
            cv += tv;
            cy += ty;
        }
        w.blk[nseg] = cb;
        w.val[nseg] = cv;
        w.byte[nseg] = cy;
        int32_t e = 0;
        if (bad || cv != n || (need_exact && cy != bytes))
            e = TAGC_ERR_RANGE;
        else if (cy > bytes)
            e = TAGC_ERR_CAPACITY;
        *w.err = e;
        *w.corrupt = 0;
        *w.sentinel = 0;
        *w.changed = 0;
        sh_bad = e;
    }
    __syncthreads();
    if (sh_bad)
        return;
    b = sh_blk[threadIdx.x];
    v = sh_val[threadIdx.x];
    y = sh_byte[threadIdx.x];
    for (int64_t i = lo; i < hi; i++) {
        w.blk[i] = b;
        w.val[i] = v;
        w.byte[i] = y;
        b += tagc_ceil_div(seg[i], block);
        v += seg[i];
        y += tagc_q_bytes(seg[i], format, block);
    }
}

/* Block b of the message (b < w.blk[nseg]): its values [*o, *o + *len) and
 * the byte its record starts at.  The segment is the last i with
 * blk[i] <= b: empty segments share their start with the next one, and the
 * last of them is the one holding b. */
static __device__ int64_t wq_locate(const wq_ws &w, int64_t nseg, int64_t b, int format,
                                    int64_t block, int64_t *o, int64_t *len)
{
    int64_t lo = 0, hi = nseg; /* blk[lo] <= b < blk[hi] */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (w.blk[mid] <= b)
            lo = mid;
        else
            hi = mid;
    }
    int64_t j = b - w.blk[lo];
    *o = w.val[lo] + j * block;
    *len = w.val[lo + 1] - *o < block ? w.val[lo + 1] - *o : block;
    return w.byte[lo] + j * tagc_q_record_bytes(block, format);
}

/* One warp writes the record at p of the values val(o), ..., val(o + len - 1)
 * (val: a functor of the index giving the fp32 value to code): a max pass
 * over their magnitude patterns (a shuffle max across the lanes) for the
 * scale or the sentinel, then one packed byte of codes per lane.  Every lane
 * of the warp calls it. */
template <class Val>
static __device__ __forceinline__ void wq_put_record(uint8_t *p, int64_t o, int64_t len,
                                                     int format, const Val &val)
{
    int per = tagc_q_per_byte(format);
    unsigned lane = threadIdx.x & 31u;
    uint32_t m = 0;
    for (int64_t i = lane; i < len; i += 32) {
        uint32_t a = __float_as_uint(val(o + i)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    for (int off = 16; off > 0; off >>= 1) {
        uint32_t other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
        m = other > m ? other : m;
    }
    uint32_t bits = tagc_wq_scale_bits(format, __shfl_sync(TAGC_FULL_MASK, m, 0));
    int sentinel = bits == TAGC_WQ_NONFINITE;
    float inv = tagc_q_inv(__uint_as_float(bits));
    int64_t nbytes = tagc_ceil_div(len, per);
    for (int64_t cb = lane; cb < nbytes; cb += 32) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++) {
            int64_t i = cb * per + j;
            unsigned digit = tagc_q_pad_digit(format); /* the code of 0 */
            if (i < len && !sentinel)
                digit = tagc_q_digit(format, tagc_wq_code(val(o + i), inv));
            byte += digit * tagc_q_weight(format, j);
        }
        p[4 + cb] = (uint8_t)byte;
    }
    if (lane == 0)
        tagc_st_scale(p, __uint_as_float(bits));
}

/* Decode step 1: every scale and code of the message, into the flags.
 * delta: the message ends in the weights' change flag byte; 0 there means
 * no codes are read (the C op reads none), anything but 0 or 1 is corrupt. */
static __global__ void wq_check_kernel(wq_ws w, const uint8_t *src, int64_t nseg, int format,
                                       int64_t block, int delta)
{
    if (*w.err != 0)
        return;
    if (delta) {
        uint8_t flag = src[w.byte[nseg]];
        if (flag > 1 && blockIdx.x == 0 && threadIdx.x == 0)
            *w.corrupt = 1;
        if (flag != 1)
            return;
    }
    int64_t nb = w.blk[nseg];
    int64_t stride = (int64_t)gridDim.x * WQ_WARPS;
    int per = tagc_q_per_byte(format);
    unsigned lane = threadIdx.x & 31u;
    int found = 0, sentinel = 0;
    for (int64_t b = (int64_t)blockIdx.x * WQ_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o, len;
        const uint8_t *p = src + wq_locate(w, nseg, b, format, block, &o, &len);
        if (lane == 0) {
            int kind = tagc_wq_scale_kind(format, (uint32_t)tagc_ld_le(p, 4));
            found |= kind < 0;
            sentinel |= kind > 0;
        }
        for (int64_t i = lane; i < len; i += 32)
            (void)tagc_q_decode(format, p[4 + i / per], (int)(i % per), &found);
    }
    if (__syncthreads_or(found) && threadIdx.x == 0)
        *w.corrupt = 1;
    if (__syncthreads_or(sentinel) && threadIdx.x == 0)
        *w.sentinel = 1;
}

/* A decode kernel's start, after wq_check_kernel: the first block reports
 * the verdict (the table's error, CORRUPT, else NONFINITE when a record holds
 * the sentinel); whether the kernel may write (not when the table or the
 * message is invalid). */
static __device__ __forceinline__ int wq_decode_verdict(const wq_ws &w, int32_t *dev_status)
{
    int32_t err = *w.err, corrupt = *w.corrupt;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        tagc_dev_fail(dev_status, err != 0 ? err
                                  : corrupt ? TAGC_ERR_CORRUPT
                                  : *w.sentinel ? TAGC_ERR_NONFINITE : 0);
    return err == 0 && !corrupt;
}

/* Every value of a checked message, one warp per block: put(i, x) with x the
 * fp32 product q * s of value i, or NaN (0x7fc00000) over a sentinel block,
 * the only NaN it passes (a valid scale is finite). */
template <class Put>
static __device__ __forceinline__ void wq_decode_records(const wq_ws &w, const uint8_t *src,
                                                         int64_t nseg, int format,
                                                         int64_t block, Put put)
{
    int64_t nb = w.blk[nseg];
    int64_t stride = (int64_t)gridDim.x * WQ_WARPS;
    int per = tagc_q_per_byte(format);
    for (int64_t b = (int64_t)blockIdx.x * WQ_WARPS + (threadIdx.x >> 5); b < nb;
         b += stride) {
        int64_t o, len;
        const uint8_t *p = src + wq_locate(w, nseg, b, format, block, &o, &len);
        uint32_t bits = (uint32_t)tagc_ld_le(p, 4);
        float s = __uint_as_float(bits);
        int ignored = 0;
        for (int64_t i = threadIdx.x & 31u; i < len; i += 32) {
            int q = tagc_q_decode(format, p[4 + i / per], (int)(i % per), &ignored);
            put(o + i, bits == TAGC_WQ_NONFINITE ? __uint_as_float(0x7fc00000u)
                                                 : __fmul_rn((float)q, s));
        }
    }
}

static inline size_t wq_workspace_size(int64_t nseg)
{
    tagc_carver c = {NULL, 0};
    wq_ws w;
    return wq_layout(&c, nseg > 0 ? nseg : 0, &w);
}

/* At most n / block full blocks, plus one short block per non-empty segment. */
static inline unsigned wq_grid(int64_t n, int64_t nseg, int64_t block)
{
    return tagc_grid(n / block + (nseg < n ? nseg : n), WQ_WARPS);
}

/* What every wq launcher does first: the host-side checks, the workspace,
 * and the prefix kernel (bytes: the records' size or capacity, need_exact
 * as there).  *ran = 0 when nothing was enqueued: nseg == 0, an empty table
 * the host decides on as the C op does. */
static inline tagc_status wq_begin(wq_ws *w, int *ran, const void *data, const void *msg,
                                   int dtype, int64_t n, const int64_t *seg, int64_t nseg,
                                   int64_t bytes, int need_exact, int format, int64_t block,
                                   void *workspace, size_t workspace_bytes,
                                   cudaStream_t stream)
{
    tagc_carver c;
    *ran = 0;
    tagc_status s = tagc_check_wq_args(data, msg, dtype, n, seg, nseg, format, block);
    if (s != TAGC_OK)
        return s;
    s = tagc_ws_open(&c, workspace, workspace_bytes, wq_workspace_size(nseg));
    if (s != TAGC_OK)
        return s;
    if (nseg == 0)
        return n != 0 || (need_exact && bytes != 0) ? TAGC_ERR_RANGE
               : bytes < 0                         ? TAGC_ERR_CAPACITY
                                                   : TAGC_OK;
    wq_layout(&c, nseg, w);
    wq_prefix_kernel<<<1, TAGC_THREADS, 0, stream>>>(*w, seg, nseg, n, bytes, need_exact,
                                                     format, block);
    TAGC_CUDA_LAUNCHED();
    *ran = 1;
    return TAGC_OK;
}

#endif /* TAGC_WQ_COMMON_CUH */
