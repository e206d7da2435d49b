/*
 * quant_unit.cu - tagc_cuda_quant_unit_encode / tagc_cuda_quant_unit_decode:
 * the quant transport of one unit with a coded residual, each side in one
 * launcher call (csrc/quant.c's tagc_quant_unit_*).  The host cost of a unit
 * is what the hook pays per call on a host-bound step (docs/gpu), so: two
 * kernels to encode, one to decode, no workspace allocation, no memset.
 *
 * Encode: a guard kernel ORs "a residual value decodes to NaN/Inf" into
 * flags[0]; the encode kernel gives each residual record to one warp, which
 * decodes it, adds the gradient, writes the message record (scale, codes),
 * updates the residual and writes it back as codes over the record it read.
 * The values are never stored: each pass recomputes them from the same
 * inputs with the same _rn arithmetic, so they are the same bits every time
 * and the same as csrc/quant.c's.  The last block to finish counts the call
 * (and a reset) and leaves flags at zero for the next call on the stream.
 */
#include <float.h>

#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

#define UNIT_WARPS (TAGC_THREADS / 32)

/* What one warp needs to know about its residual record. */
typedef struct {
    const uint8_t *codes; /* the record's codes (old ones until this warp writes) */
    float scale;          /* its old scale */
    int format;
    float factor;
    int zero; /* the guard fired: the residual counts as 0 */
} unit_res;

/* Value i of the working residual: 0 + q * s (decode_add into zeros), times
 * factor unless it is 1; 0 after a reset. */
static __device__ __forceinline__ float unit_w(const unit_res *w, int64_t i)
{
    if (w->zero)
        return 0.0f;
    int per = tagc_q_per_byte(w->format), ignored = 0;
    int q = tagc_q_decode(w->format, w->codes[i / per], (int)(i % per), &ignored);
    float x = __fadd_rn(0.0f, __fmul_rn((float)q, w->scale));
    return w->factor != 1.0f ? __fmul_rn(x, w->factor) : x;
}

/* Value i of the residual after the message: v - q s with v = g + w, or w
 * itself for the own shard (g NULL). */
static __device__ __forceinline__ float unit_after(const unit_res *w, const void *g, int gd,
                                                   int64_t i, int fmt, float s, float inv)
{
    float x = unit_w(w, i);
    if (g == NULL)
        return x;
    float v = __fadd_rn(tagc_ld(g, gd, i), x);
    int q = tagc_q_code(fmt, v, inv);
    return __fsub_rn(v, __fmul_rn((float)q, s));
}

/* The scale of `len` values x(i) for `format`, in quant.c's order: lane j
 * sums |x(j)|, |x(j + 32)|, ... in double, then the shuffle tree.  Every
 * lane returns it. */
template <typename X>
static __device__ float unit_scale(X x, int64_t len, int format)
{
    double acc = 0.0;
    float m = 0.0f;
    for (int64_t i = threadIdx.x & 31u; i < len; i += 32) {
        float a = fabsf(x(i));
        m = a > m ? a : m;
        if (tagc_q_uses_sum(format))
            acc += (double)a;
    }
    return tagc_warp_q_scale(acc, m, format, len);
}

/* The `len` codes of x(i) under scale s into codes[], one lane per byte;
 * lane k reads only the values of the bytes it writes. */
template <typename X>
static __device__ void unit_codes(uint8_t *codes, X x, int64_t len, int format, float inv)
{
    int per = tagc_q_per_byte(format);
    int64_t nbytes = tagc_ceil_div(len, per);
    for (int64_t cb = threadIdx.x & 31u; cb < nbytes; cb += 32) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++) {
            int64_t i = cb * per + j;
            unsigned digit = tagc_q_pad_digit(format);
            if (i < len)
                digit = tagc_q_digit(format, tagc_q_code(format, x(i), inv));
            byte += digit * tagc_q_weight(format, j);
        }
        codes[cb] = (uint8_t)byte;
    }
}

/* flags[0] |= some residual value decodes to NaN/Inf.  Only a scale above
 * FLT_MAX / 127 can overflow a product, so only such records' codes are
 * read (one thread per record). */
static __global__ void quant_unit_guard_kernel(int32_t *flags, const uint8_t *rc,
                                               int64_t nrec, int rfmt, int64_t block)
{
    int64_t rr = tagc_q_record_bytes(block, rfmt);
    int per = tagc_q_per_byte(rfmt), bad = 0;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nrec;
         b += (int64_t)gridDim.x * blockDim.x) {
        const uint8_t *rec = rc + b * rr;
        float s = tagc_ld_scale(rec);
        if (fabsf(s) <= FLT_MAX / 127.0f)
            continue;
        int ignored = 0;
        for (int64_t i = 0; i < block && !bad; i++) {
            int q = tagc_q_decode(rfmt, rec[4 + i / per], (int)(i % per), &ignored);
            bad = !(fabsf(__fmul_rn((float)q, s)) <= FLT_MAX);
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        atomicCAS((int *)flags, 0, 1);
}

/* One warp per residual record u of the unit (shard r = u / per). */
static __global__ void quant_unit_encode_kernel(uint8_t *dst, int64_t nb, uint8_t *rc,
                                                const void *grad, int gd, int64_t shard,
                                                int64_t world, int64_t rank, int fmt,
                                                int rfmt, int64_t block, float factor,
                                                const float *vote, int32_t *flags,
                                                int64_t *counts)
{
    const int64_t per = shard / block, nrec = world * per;
    const int64_t rg = tagc_q_record_bytes(block, fmt), rr = tagc_q_record_bytes(block, rfmt);
    const int zero = flags[0] != 0, poisoned = vote != NULL && !(*vote == 0.0f);
    const unsigned lane = threadIdx.x & 31u;
    for (int64_t u = (int64_t)blockIdx.x * UNIT_WARPS + (threadIdx.x >> 5); u < nrec;
         u += (int64_t)gridDim.x * UNIT_WARPS) {
        int64_t r = u / per, b = u % per;
        uint8_t *rrec = rc + u * rr;
        unit_res w = {rrec + 4, tagc_ld_scale(rrec), rfmt, factor, zero};
        const void *g = NULL;
        float s = 0.0f, inv = 0.0f;
        if (r != rank) {
            uint8_t *mrec = dst + r * nb + b * rg;
            if (poisoned) {
                /* what a poisoned shard's encode sends (tagc_cuda_quant_encode):
                 * a NaN scale and zero codes; the residual is left as it was */
                int pper = tagc_q_per_byte(fmt);
                unsigned pad = 0;
                for (int j = 0; j < pper; j++)
                    pad += tagc_q_pad_digit(fmt) * tagc_q_weight(fmt, j);
                for (int64_t cb = lane; cb < tagc_ceil_div(block, pper); cb += 32)
                    mrec[4 + cb] = (uint8_t)pad;
                if (lane == 0)
                    tagc_st_scale(mrec, __uint_as_float(0x7fc00000u));
                continue;
            }
            g = (const uint8_t *)grad + u * block * (gd == TAGC_F32 ? 4 : 2);
            const void *gb = g;
            auto v = [=](int64_t i) { return __fadd_rn(tagc_ld(gb, gd, i), unit_w(&w, i)); };
            s = unit_scale(v, block, fmt);
            inv = tagc_q_inv(s);
            unit_codes(mrec + 4, v, block, fmt, inv);
            if (lane == 0)
                tagc_st_scale(mrec, s);
        } else if (poisoned) {
            continue;
        }
        auto after = [=](int64_t i) { return unit_after(&w, g, gd, i, fmt, s, inv); };
        float s2 = unit_scale(after, block, rfmt);
        /* every lane has read the old codes it needed but those of the bytes
         * it now writes, which it reads before writing them */
        __syncwarp();
        unit_codes(rrec + 4, after, block, rfmt, tagc_q_inv(s2));
        __syncwarp();
        if (lane == 0)
            tagc_st_scale(rrec, s2);
    }
    /* the last block out counts the call and clears flags */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd((unsigned *)&flags[1], 1u) == gridDim.x - 1) {
            counts[poisoned ? 1 : 0] += 1;
            counts[2] += zero;
            if (!poisoned) {
                counts[3] += shard;
                counts[4] += shard;
            }
            flags[0] = 0;
            flags[1] = 0;
        }
    }
}

/* out[i] = (0 + the rank-ordered terms) / divisor, one thread per value. */
static __global__ void quant_unit_decode_kernel(void *out, int od, int64_t shard,
                                                const uint8_t *src, int64_t nb,
                                                const void *own, int gd, int64_t world,
                                                int64_t rank, int fmt, int64_t block,
                                                float divisor)
{
    const int64_t rg = tagc_q_record_bytes(block, fmt);
    const int per = tagc_q_per_byte(fmt);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < shard;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i / block, j = i % block;
        float acc = 0.0f;
        for (int64_t r = 0; r < world; r++) {
            if (r == rank) {
                acc = __fadd_rn(acc, tagc_ld(own, gd, i));
                continue;
            }
            const uint8_t *rec = src + r * nb + b * rg;
            int bad = 0;
            int q = tagc_q_decode(fmt, rec[4 + j / per], (int)(j % per), &bad);
            /* no host to refuse a corrupt message to: its value becomes NaN */
            float x = bad ? __uint_as_float(0x7fc00000u)
                          : __fmul_rn((float)q, tagc_ld_scale(rec));
            acc = __fadd_rn(acc, x);
        }
        if (divisor != 1.0f)
            acc = __fdiv_rn(acc, divisor);
        tagc_st(out, od, i, acc);
    }
}

extern "C" tagc_status tagc_cuda_quant_unit_encode(uint8_t *dst, int64_t dst_capacity,
                                                   uint8_t *rcodes, int64_t rcodes_bytes,
                                                   const void *grad, tagc_dtype grad_dtype,
                                                   int64_t shard, int64_t world, int64_t rank,
                                                   tagc_qformat format,
                                                   tagc_qformat residual_format, int64_t block,
                                                   float factor, int64_t *counts,
                                                   const float *vote, int32_t *flags,
                                                   cudaStream_t stream)
{
    if (counts == NULL || flags == NULL)
        return TAGC_ERR_ARG;
    int64_t nb = 0;
    tagc_status st = tagc_check_quant_unit_encode(dst, dst_capacity, rcodes, rcodes_bytes, grad,
                                                  (int)grad_dtype, shard, world, rank,
                                                  (int)format, (int)residual_format, block,
                                                  factor, &nb);
    if (st != TAGC_OK)
        return st;
    int64_t nrec = world * shard / block; /* 0: the kernels still run, to count the call */
    quant_unit_guard_kernel<<<tagc_grid(nrec, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        flags, rcodes, nrec, (int)residual_format, block);
    TAGC_CUDA_LAUNCHED();
    quant_unit_encode_kernel<<<tagc_grid(nrec, UNIT_WARPS), TAGC_THREADS, 0, stream>>>(
        dst, nb, rcodes, grad, (int)grad_dtype, shard, world, rank, (int)format,
        (int)residual_format, block, factor, vote, flags, counts);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

extern "C" tagc_status tagc_cuda_quant_unit_decode(void *out, tagc_dtype out_dtype,
                                                   int64_t shard, const uint8_t *src,
                                                   int64_t src_bytes, const void *own,
                                                   tagc_dtype own_dtype, int64_t world,
                                                   int64_t rank, tagc_qformat format,
                                                   int64_t block, float divisor,
                                                   cudaStream_t stream)
{
    int64_t nb = 0;
    tagc_status st = tagc_check_quant_unit_decode(out, (int)out_dtype, shard, src, src_bytes, own,
                                                  (int)own_dtype, world, rank, (int)format,
                                                  block, divisor, &nb);
    if (st != TAGC_OK || shard == 0)
        return st;
    quant_unit_decode_kernel<<<tagc_grid(shard, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        out, (int)out_dtype, shard, src, nb, own, (int)own_dtype, world, rank, (int)format,
        block, divisor);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
