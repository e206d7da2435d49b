/*
 * tagc_checks.h - argument validation of each op, shared by the C codec
 * (the csrc C files) and the CUDA launchers (the cuda .cu files) so both
 * return the same status for the same bad call.  Host-only, plain C11 that
 * also compiles as C++ under nvcc and g++ (the emulated build).  Not
 * installed, not part of the contract.
 *
 * Each check returns TAGC_OK or the first error in the order the contract
 * (tagc.h) implies: ARG, then DTYPE, then RANGE, then CAPACITY.  Checks that
 * read the data (index bounds, finiteness) stay in the ops: the CUDA side
 * does them on the device.
 */
#ifndef TAGC_CHECKS_H
#define TAGC_CHECKS_H

#include <float.h>
#include <stddef.h>
#include <stdint.h>

#include "tagc.h"
#include "tagc_portable.h"

/* Sketch width bound: bucket indices are computed in 32 bits. */
#define TAGC_T_LIMIT ((int64_t)1 << 32)

static inline int tagc_check_dtype_ok(int d)
{
    return d == TAGC_F32 || d == TAGC_BF16;
}

static inline int64_t tagc_check_dtype_size(int d)
{
    return d == TAGC_F32 ? 4 : 2;
}

static inline int tagc_check_bits_ok(int bits)
{
    return bits == 1 || bits == 2 || bits == 4 || bits == 8;
}

/* ---- the size rules of every buffer (exported by csrc/sizes.c: tagc.h) ----
 * Each returns -1 for arguments outside the op's bounds. */

static inline int64_t tagc_check_bitmap_bytes(int64_t n)
{
    return n < 0 || n > TAGC_MAX_N ? -1 : (n + 7) >> 3;
}

static inline int64_t tagc_check_lanes_bytes(int64_t n, int bits)
{
    return n < 0 || n > TAGC_MAX_N || !tagc_check_bits_ok(bits) ? -1 : tagc_lane_bytes(n, bits);
}

static inline int64_t tagc_check_sketch_buckets(int64_t t)
{
    return t < 1 || t >= TAGC_T_LIMIT ? -1 : TAGC_TABLES * t;
}

/* k <= INT64_MAX / 8 keeps k * (4 + value size) from overflowing. */
static inline int64_t tagc_check_sparse_bytes(int64_t k, int val_dtype)
{
    if (k < 0 || k > INT64_MAX / 8 || !tagc_check_dtype_ok(val_dtype))
        return -1;
    return k * (4 + tagc_check_dtype_size(val_dtype));
}

static inline tagc_status tagc_check_lanes_pack(const uint8_t *lanes,
                                                int64_t lanes_capacity,
                                                const uint8_t *bitmap, int64_t n,
                                                int bits)
{
    if (!tagc_check_bits_ok(bits))
        return TAGC_ERR_RANGE;
    if (n < 0 || n > TAGC_MAX_N)
        return TAGC_ERR_RANGE;
    if (n > 0 && (lanes == NULL || bitmap == NULL))
        return TAGC_ERR_ARG;
    if (lanes_capacity < tagc_check_lanes_bytes(n, bits))
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

static inline tagc_status tagc_check_lanes_unpack(const uint8_t *bitmap,
                                                  int64_t bitmap_capacity,
                                                  const uint8_t *lanes,
                                                  int64_t lanes_bytes, int64_t n,
                                                  int bits)
{
    if (!tagc_check_bits_ok(bits))
        return TAGC_ERR_RANGE;
    if (n < 0 || n > TAGC_MAX_N || lanes_bytes < 0)
        return TAGC_ERR_RANGE;
    if (n > 0 && (lanes == NULL || bitmap == NULL))
        return TAGC_ERR_ARG;
    if (lanes_bytes < tagc_check_lanes_bytes(n, bits) ||
        bitmap_capacity < tagc_check_bitmap_bytes(n))
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

static inline tagc_status tagc_check_bitmap_or(const uint8_t *dst,
                                               int64_t dst_capacity,
                                               const uint8_t *src, int64_t nbytes,
                                               int64_t count)
{
    if (nbytes < 0 || count < 0)
        return TAGC_ERR_RANGE;
    if (nbytes > 0 && (dst == NULL || (src == NULL && count > 0)))
        return TAGC_ERR_ARG;
    if (dst_capacity < nbytes)
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

static inline tagc_status tagc_check_popcount(const int64_t *count,
                                              const uint8_t *bitmap, int64_t n)
{
    if (count == NULL || (bitmap == NULL && n > 0))
        return TAGC_ERR_ARG;
    if (n < 0 || n > TAGC_MAX_N)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

static inline tagc_status tagc_check_select_kth(const float *tau, const void *x,
                                                int x_dtype, int64_t n, int64_t k)
{
    if (tau == NULL || (x == NULL && n > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(x_dtype))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > n)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

static inline tagc_status tagc_check_sparsify(const int32_t *idx, int64_t idx_capacity,
                                              const void *val, int val_dtype,
                                              int64_t val_capacity,
                                              const uint8_t *bitmap,
                                              int64_t bitmap_capacity,
                                              const void *residual, int residual_dtype,
                                              const void *grad, int grad_dtype,
                                              int64_t n, int64_t k, const float *tau)
{
    if (tau == NULL || (grad == NULL && n > 0) || (bitmap == NULL && n > 0) ||
        ((idx == NULL || val == NULL) && k > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(val_dtype) || !tagc_check_dtype_ok(grad_dtype) ||
        (residual != NULL && !tagc_check_dtype_ok(residual_dtype)))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > n)
        return TAGC_ERR_RANGE;
    if (idx_capacity < k || val_capacity < k || bitmap_capacity < tagc_check_bitmap_bytes(n))
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

/* The idx[j] < n bound reads idx, so it is not checked here. */
static inline tagc_status tagc_check_sketch_encode(const void *sketch, int sketch_dtype,
                                                   int64_t sketch_capacity,
                                                   const int32_t *idx, const void *val,
                                                   int val_dtype, int64_t k,
                                                   int64_t n, int64_t t)
{
    if (sketch == NULL || ((idx == NULL || val == NULL) && k > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(sketch_dtype) || !tagc_check_dtype_ok(val_dtype))
        return TAGC_ERR_DTYPE;
    if (t < 1 || t >= TAGC_T_LIMIT || n < 0 || n > TAGC_MAX_N || k < 0)
        return TAGC_ERR_RANGE;
    if (sketch_capacity < tagc_check_sketch_buckets(t))
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

/* max_rounds bounds the CUDA decoder's fixed round count; the C decoder peels
 * to completion and passes 1, which always passes. */
static inline tagc_status tagc_check_peel_decode(const float *out, int64_t out_capacity,
                                                 const int32_t *unpeeled,
                                                 int64_t unpeeled_capacity,
                                                 const int64_t *unpeeled_count,
                                                 const void *sketch, int sketch_dtype,
                                                 const uint8_t *bitmap, int64_t n,
                                                 int64_t t, int max_rounds)
{
    if (unpeeled_count == NULL || sketch == NULL ||
        ((out == NULL || bitmap == NULL) && n > 0) ||
        (unpeeled == NULL && unpeeled_capacity > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(sketch_dtype))
        return TAGC_ERR_DTYPE;
    if (t < 1 || t >= TAGC_T_LIMIT || n < 0 || n > TAGC_MAX_N ||
        unpeeled_capacity < 0 || max_rounds < 1)
        return TAGC_ERR_RANGE;
    if (out_capacity < n)
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

static inline tagc_status tagc_check_sparse_pack(const uint8_t *buf, int64_t buf_capacity,
                                                 const int32_t *idx, const void *val,
                                                 int val_dtype, int64_t k)
{
    if (k > 0 && (buf == NULL || idx == NULL || val == NULL))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(val_dtype))
        return TAGC_ERR_DTYPE;
    if (k < 0 || k > INT64_MAX / 8)
        return TAGC_ERR_RANGE;
    if (buf_capacity < tagc_check_sparse_bytes(k, val_dtype))
        return TAGC_ERR_CAPACITY;
    return TAGC_OK;
}

static inline tagc_status tagc_check_sparse_unpack(const float *out, int64_t n,
                                                   const uint8_t *buf, int64_t buf_bytes,
                                                   int64_t k, int val_dtype)
{
    if ((out == NULL && n > 0) || (buf == NULL && k > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(val_dtype))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > INT64_MAX / 8)
        return TAGC_ERR_RANGE;
    if (buf_bytes != tagc_check_sparse_bytes(k, val_dtype))
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

/* A destination of `capacity` for a size rule's result `need` (-1: out of range). */
static inline tagc_status tagc_check_room(int64_t need, int64_t capacity)
{
    if (need < 0)
        return TAGC_ERR_RANGE;
    return capacity < need ? TAGC_ERR_CAPACITY : TAGC_OK;
}

static inline int tagc_check_coding_ok(int c)
{
    return c == TAGC_PAIRS_EF || c == TAGC_PAIRS_BITMAP || c == TAGC_PAIRS_DENSE;
}

static inline int tagc_check_ef_low_bits(int64_t n, int64_t k)
{
    if (k < 0 || n < k || n > TAGC_MAX_N)
        return -1;
    int l = 0;
    while (k > 0 && (k << (l + 1)) <= n)
        l++;
    return l;
}

/* The one size rule of the coded pairs (tagc_pairs_bytes). */
static inline int64_t tagc_check_pairs_bytes(int64_t n, int64_t k, int val_dtype, int coding)
{
    if (k < 0 || n < k || n > TAGC_MAX_N || !tagc_check_dtype_ok(val_dtype) ||
        !tagc_check_coding_ok(coding))
        return -1;
    if (k == 0)
        return 0;
    int64_t vs = tagc_check_dtype_size(val_dtype);
    if (coding == TAGC_PAIRS_DENSE)
        return n * vs;
    if (coding == TAGC_PAIRS_BITMAP)
        return ((n + 7) >> 3) + k * vs;
    int l = tagc_check_ef_low_bits(n, k);
    return ((k * l + 7) >> 3) + ((k + ((n - 1) >> l) + 1 + 7) >> 3) + k * vs;
}

static inline int tagc_check_pairs_cheapest(int64_t n, int64_t k, int val_dtype)
{
    int best = 0;
    int64_t best_bytes = -1;
    for (int c = TAGC_PAIRS_EF; c <= TAGC_PAIRS_DENSE; c++) {
        int64_t b = tagc_check_pairs_bytes(n, k, val_dtype, c);
        if (b < 0)
            return 0;
        if (best == 0 || b < best_bytes) {
            best = c;
            best_bytes = b;
        }
    }
    return best;
}

static inline tagc_status tagc_check_pairs_pack(const uint8_t *dst, int64_t dst_capacity,
                                                const int32_t *idx, const void *val,
                                                int val_dtype, int64_t k, int64_t n,
                                                int coding)
{
    if (k > 0 && (dst == NULL || idx == NULL || val == NULL))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(val_dtype))
        return TAGC_ERR_DTYPE;
    int64_t need = tagc_check_pairs_bytes(n, k, val_dtype, coding);
    return tagc_check_room(need, dst_capacity);
}

static inline tagc_status tagc_check_pairs_unpack(const float *out, int64_t n,
                                                  const uint8_t *src, int64_t src_bytes,
                                                  int64_t k, int val_dtype, int coding)
{
    if ((out == NULL && n > 0) || (src == NULL && k > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(val_dtype))
        return TAGC_ERR_DTYPE;
    int64_t need = tagc_check_pairs_bytes(n, k, val_dtype, coding);
    if (need < 0 || src_bytes != need)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

static inline int tagc_check_qformat_ok(int format)
{
    return format == TAGC_Q_SIGN || format == TAGC_Q_TERNARY || format == TAGC_Q_INT4 ||
           format == TAGC_Q_INT8;
}

/* The one size rule of the quant wire format (tagc_quant_bytes). */
static inline int64_t tagc_check_quant_bytes(int64_t n, int format, int64_t block)
{
    if (n < 0 || n > TAGC_MAX_N || !tagc_check_qformat_ok(format) || block < 1 ||
        block > TAGC_QBLOCK_MAX)
        return -1;
    return tagc_q_bytes(n, format, block);
}

static inline tagc_status tagc_check_quant_encode(const uint8_t *dst, int64_t dst_capacity,
                                                  const void *residual, int residual_dtype,
                                                  const void *grad, int grad_dtype,
                                                  int64_t n, int format, int64_t block)
{
    if (n > 0 && (dst == NULL || grad == NULL))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(grad_dtype) ||
        (residual != NULL && !tagc_check_dtype_ok(residual_dtype)))
        return TAGC_ERR_DTYPE;
    int64_t need = tagc_check_quant_bytes(n, format, block);
    return tagc_check_room(need, dst_capacity);
}

static inline tagc_status tagc_check_quant_decode(const float *out, int64_t n,
                                                  const uint8_t *src, int64_t src_bytes,
                                                  int format, int64_t block)
{
    if (n > 0 && (out == NULL || src == NULL))
        return TAGC_ERR_ARG;
    int64_t need = tagc_check_quant_bytes(n, format, block);
    if (need < 0 || src_bytes != need)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

/* tagc_quant_unit_encode's arguments; the bytes of one message row in *nb. */
static inline tagc_status tagc_check_quant_unit_encode(const uint8_t *dst, int64_t dst_capacity,
                                                       const uint8_t *rcodes,
                                                       int64_t rcodes_bytes, const void *grad,
                                                       int grad_dtype, int64_t shard,
                                                       int64_t world, int64_t rank, int format,
                                                       int residual_format, int64_t block,
                                                       float factor, int64_t *nb)
{
    if (shard > 0 && (dst == NULL || rcodes == NULL || grad == NULL))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(grad_dtype))
        return TAGC_ERR_DTYPE;
    if (world < 1 || rank < 0 || rank >= world || shard < 0 || shard > TAGC_MAX_N / world ||
        block < 1 || shard % block != 0 || !(factor >= 0.0f && factor <= 1.0f))
        return TAGC_ERR_RANGE;
    *nb = tagc_check_quant_bytes(shard, format, block);
    int64_t need = tagc_check_quant_bytes(world * shard, residual_format, block);
    if (*nb < 0 || need < 0 || rcodes_bytes != need)
        return TAGC_ERR_RANGE;
    return dst_capacity < world * *nb ? TAGC_ERR_CAPACITY : TAGC_OK;
}

/* tagc_quant_unit_decode's arguments; the bytes of one message row in *nb. */
static inline tagc_status tagc_check_quant_unit_decode(const void *out, int out_dtype,
                                                       int64_t shard, const uint8_t *src,
                                                       int64_t src_bytes, const void *own,
                                                       int own_dtype, int64_t world,
                                                       int64_t rank, int format, int64_t block,
                                                       float divisor, int64_t *nb)
{
    if (shard > 0 && (out == NULL || own == NULL || (world > 1 && src == NULL)))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(out_dtype) || !tagc_check_dtype_ok(own_dtype))
        return TAGC_ERR_DTYPE;
    if (world < 1 || rank < 0 || rank >= world || !(divisor >= -FLT_MAX && divisor <= FLT_MAX) ||
        divisor == 0.0f)
        return TAGC_ERR_RANGE;
    *nb = tagc_check_quant_bytes(shard, format, block);
    if (*nb < 0 || *nb > INT64_MAX / world || src_bytes != world * *nb)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

static inline int tagc_check_wq_format_ok(int format)
{
    return format == TAGC_Q_INT4 || format == TAGC_Q_INT8;
}

/* The arguments of a wq op that do not read the segment table: all that the
 * CUDA launchers can check on the host (their table is in device memory).
 * data: dst or out; msg: src (encode: the values; decode: the message). */
static inline tagc_status tagc_check_wq_args(const void *data, const void *msg, int dtype,
                                             int64_t n, const int64_t *seg, int64_t nseg,
                                             int format, int64_t block)
{
    if ((n > 0 && (data == NULL || msg == NULL)) || (seg == NULL && nseg > 0))
        return TAGC_ERR_ARG;
    if (!tagc_check_dtype_ok(dtype))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || nseg < 0 || nseg > TAGC_MAX_N ||
        !tagc_check_wq_format_ok(format) || block < 1 || block > TAGC_QBLOCK_MAX)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

/* The one size rule of a wq message (tagc_wq_bytes), reading the table:
 * -1 when it is invalid, else the bytes, with the number of values in
 * *total.  Each length is checked against what is left of TAGC_MAX_N
 * before it is added, so nothing overflows. */
static inline int64_t tagc_check_wq_table(const int64_t *seg, int64_t nseg, int format,
                                          int64_t block, int64_t *total)
{
    int64_t values = 0, bytes = 0;
    if (nseg < 0 || nseg > TAGC_MAX_N || (seg == NULL && nseg > 0) ||
        !tagc_check_wq_format_ok(format) || block < 1 || block > TAGC_QBLOCK_MAX)
        return -1;
    for (int64_t i = 0; i < nseg; i++) {
        if (seg[i] < 0 || seg[i] > TAGC_MAX_N - values)
            return -1;
        values += seg[i];
        bytes += tagc_q_bytes(seg[i], format, block);
    }
    *total = values;
    return bytes;
}

/* All of a wq op's checks but the message size, which is *need then (the
 * arguments of tagc_check_wq_args, then the table: RANGE when it is invalid
 * or does not sum to n). */
static inline tagc_status tagc_check_wq(const void *data, const void *msg, int dtype, int64_t n,
                                        const int64_t *seg, int64_t nseg, int format,
                                        int64_t block, int64_t *need)
{
    int64_t total = -1;
    tagc_status st = tagc_check_wq_args(data, msg, dtype, n, seg, nseg, format, block);
    if (st != TAGC_OK)
        return st;
    *need = tagc_check_wq_table(seg, nseg, format, block, &total);
    return *need < 0 || total != n ? TAGC_ERR_RANGE : TAGC_OK;
}

#endif /* TAGC_CHECKS_H */
