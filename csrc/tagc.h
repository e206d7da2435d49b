/*
 * tagc.h - the TAGC gradient codec (CPU).  docs/DESIGN.md section 3.
 *
 * One shard of a unit's flat gradient is n values; a rank keeps exactly k of
 * them (the k largest magnitudes, ties broken by lower position), sends their
 * positions as a bitmap or as (offset, value) pairs, and their values as a
 * count sketch of m = 3*t buckets, which the owner of the shard peels.
 *
 * Conventions: argument order (dst, dst_capacity, src, n, params...); sizes
 * and capacities are counts of elements of the pointed-to type unless named
 * *_bytes; every function validates its arguments and returns a tagc_status
 * without writing anything when it fails (unless said otherwise); no function
 * prints, exits, or keeps state between calls.  Functions are thread-safe.
 * Positions inside a shard are int32, so n < 2^31.
 */
#ifndef TAGC_H
#define TAGC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    TAGC_OK = 0,
    TAGC_ERR_ARG = 1,       /* NULL pointer where data is needed, bad enum */
    TAGC_ERR_RANGE = 2,     /* a size or parameter out of its documented range */
    TAGC_ERR_CAPACITY = 3,  /* a destination is smaller than required */
    TAGC_ERR_NOMEM = 4,     /* scratch allocation failed */
    TAGC_ERR_NONFINITE = 5, /* NaN or Inf in a value that must be finite */
    TAGC_ERR_CORRUPT = 6,   /* decoder input inconsistent (offset out of range...) */
    TAGC_ERR_DTYPE = 7,     /* dtype not supported by this function */
    TAGC_ERR_CUDA = 8       /* a CUDA call failed (cuda/ launchers only) */
} tagc_status;

typedef enum {
    TAGC_F32 = 0,
    TAGC_BF16 = 1
} tagc_dtype;

/* Largest n accepted by every function (positions are int32). */
#define TAGC_MAX_N ((int64_t)INT32_MAX)

/* Human-readable name of a status ("ok", "invalid argument", ...); static storage. */
const char *tagc_status_str(tagc_status s);

/* Bytes of one element of a dtype (4 or 2), 0 for an unknown dtype. */
size_t tagc_dtype_size(tagc_dtype d);

/*
 * Buffer sizes, for callers sizing what the functions below write or read
 * (as ZSTD_compressBound): exact sizes, the same rules the functions check.
 * Each returns -1 for an argument outside its bounds.
 *   tagc_bitmap_bytes(n)        bytes of an n-position bitmap: ceil(n/8);
 *                               0 <= n <= TAGC_MAX_N
 *   tagc_lanes_bytes(n, bits)   bytes of n lanes of `bits` bits: ceil(n*bits/8);
 *                               bits in {1, 2, 4, 8}
 *   tagc_sketch_buckets(t)      buckets of a sketch of t per table: TAGC_TABLES*t;
 *                               1 <= t < 2^32
 *   tagc_sparse_bytes(k, d)     bytes of k (offset, value) pairs: k*(4 + size of d);
 *                               0 <= k <= INT64_MAX/8, d a tagc_dtype
 *   tagc_quant_bytes(n, f, b)   see the block quantization section below
 *   tagc_wq_bytes(seg, ns, f, b) see the quantized weight gather section
 *   tagc_wq_delta_bytes(...)    see the weights' change section
 *   tagc_fp4_bytes(n, b)        see the 4-bit codes section
 *   tagc_tls_bytes(n)           see the two-level ternary section
 */
int64_t tagc_bitmap_bytes(int64_t n);
int64_t tagc_lanes_bytes(int64_t n, int bits);
int64_t tagc_sketch_buckets(int64_t t);
int64_t tagc_sparse_bytes(int64_t k, tagc_dtype value_dtype);

/*
 * tagc_select_kth - exact k-th largest magnitude of x[0..n).
 *   Writes *tau = the k-th largest |x_i| (k = 1: the maximum); x is not modified.
 *   Bounds: 0 <= n <= TAGC_MAX_N, 1 <= k <= n.  k == 0 writes +INFINITY.
 *   Errors: ARG (NULL), RANGE (k, n), DTYPE, NONFINITE (x has NaN/Inf), NOMEM.
 */
tagc_status tagc_select_kth(float *tau, const void *x, tagc_dtype x_dtype,
                            int64_t n, int64_t k);

/*
 * tagc_sparsify - fused error feedback + exact top-k + bitmap, one shard.
 *   v = grad + residual (residual may be NULL: no error feedback).  Keeps
 *   exactly k positions: every |v| > tau plus the lowest positions with
 *   |v| == tau, tau being the k-th largest |v|.  Writes
 *     idx[0..k)     kept positions, ascending;
 *     val[0..k)     v at those positions, rounded to val_dtype;
 *     bitmap        ceil(n/8) bytes, bit p set iff p kept (tail bits 0);
 *     residual      (if not NULL, in place) v where dropped, v - val where
 *                   kept (the val_dtype rounding error is fed back too);
 *     *tau          the threshold (+INFINITY when k == 0).
 *   Capacities: idx_capacity and val_capacity >= k, bitmap_capacity >= ceil(n/8).
 *   Bounds: 0 <= k <= n <= TAGC_MAX_N.
 *   Errors: ARG, RANGE, CAPACITY, DTYPE, NOMEM; NONFINITE when v has NaN/Inf,
 *   in which case nothing (residual included) has been written.
 */
tagc_status tagc_sparsify(int32_t *idx, int64_t idx_capacity,
                          void *val, tagc_dtype val_dtype, int64_t val_capacity,
                          uint8_t *bitmap, int64_t bitmap_capacity,
                          void *residual, tagc_dtype residual_dtype,
                          const void *grad, tagc_dtype grad_dtype,
                          int64_t n, int64_t k, float *tau);

/*
 * tagc_lanes_pack - bitmap -> lanes of `bits` bits per position (1, 2, 4, 8),
 *   layout of tagc_portable.h; a kept position's lane holds 1, others 0.
 *   Writes tagc_lanes_bytes(n, bits) bytes.  Errors: ARG, RANGE (bits, n), CAPACITY.
 */
tagc_status tagc_lanes_pack(uint8_t *lanes, int64_t lanes_capacity,
                            const uint8_t *bitmap, int64_t n, int bits);

/*
 * tagc_lanes_unpack - lanes (possibly SUM-reduced, carries and all) -> bitmap:
 *   bit p set iff lane p is non-zero.  Writes ceil(n/8) bytes (tail bits 0).
 *   Reads exactly tagc_lanes_bytes(n, bits) bytes of lanes (lanes_bytes must be
 *   at least that).  Errors: ARG, RANGE, CAPACITY.
 */
tagc_status tagc_lanes_unpack(uint8_t *bitmap, int64_t bitmap_capacity,
                              const uint8_t *lanes, int64_t lanes_bytes,
                              int64_t n, int bits);

/*
 * tagc_bitmap_or - dst[j] = OR over r < count of src[r * nbytes + j], j < nbytes.
 *   count >= 1 (count == 0 writes zeros).  Errors: ARG, RANGE, CAPACITY.
 */
tagc_status tagc_bitmap_or(uint8_t *dst, int64_t dst_capacity,
                           const uint8_t *src, int64_t nbytes, int64_t count);

/*
 * tagc_popcount - number of set bits among the first n bits of bitmap.
 *   Errors: ARG, RANGE.
 */
tagc_status tagc_popcount(int64_t *count, const uint8_t *bitmap, int64_t n);

/*
 * tagc_sketch_encode - count sketch of k (position, value) pairs.
 *   Overwrites sketch[0..3t): zero, then for each pair and each table i adds
 *   sign_i(p) * value to bucket h_i(p) (tagc_portable.h hash with
 *   tagc_table_seed(seed, i)).  Accumulates in fp32, rounds once to
 *   sketch_dtype.  Only the k pairs are visited (not the n positions).
 *   Bounds: 1 <= t < 2^32, 0 <= idx[j] < n <= TAGC_MAX_N.
 *   Errors: ARG, RANGE (t, n, an idx out of [0, n)), CAPACITY (< 3t), DTYPE,
 *   NOMEM.
 */
tagc_status tagc_sketch_encode(void *sketch, tagc_dtype sketch_dtype,
                               int64_t sketch_capacity,
                               const int32_t *idx, const void *val,
                               tagc_dtype val_dtype, int64_t k,
                               int64_t n, int64_t t, uint64_t seed);

/*
 * tagc_peel_decode - owner side: recover the values of the positions set in
 *   bitmap (the union index, n bits) from a sketch of 3t buckets (the sum of
 *   every rank's sketch).  Per-bucket count and xor of positions are computed
 *   locally from the bitmap.  Writes out[0..n): decoded value at every union
 *   position, 0 elsewhere.  Positions that peeling cannot resolve get the
 *   median of their three signed buckets if estimate != 0, else 0; their
 *   positions are written ascending to unpeeled[0..min(count, capacity)) when
 *   unpeeled is not NULL, and their number to *unpeeled_count.
 *   Never reads or writes out of bounds, whatever the bitmap and sketch hold.
 *   Bounds: 1 <= t < 2^32, n <= TAGC_MAX_N.
 *   Errors: ARG, RANGE, CAPACITY (out_capacity < n), DTYPE, NOMEM.
 */
tagc_status tagc_peel_decode(float *out, int64_t out_capacity,
                             int32_t *unpeeled, int64_t unpeeled_capacity,
                             int64_t *unpeeled_count,
                             const void *sketch, tagc_dtype sketch_dtype,
                             const uint8_t *bitmap, int64_t n,
                             int64_t t, uint64_t seed, int estimate);

/*
 * tagc_sparse_pack - wire format of k (offset, value) pairs:
 *   k little-endian int32 offsets, then k values of val_dtype.  Writes
 *   tagc_sparse_bytes(k, val_dtype) bytes.  Errors: ARG, DTYPE, RANGE
 *   (k < 0 or k > INT64_MAX / 8), CAPACITY.
 */
tagc_status tagc_sparse_pack(uint8_t *buf, int64_t buf_capacity,
                             const int32_t *idx, const void *val,
                             tagc_dtype val_dtype, int64_t k);

/*
 * tagc_sparse_unpack - scatter-add k received pairs into out[0..n):
 *   out[offset_j] += value_j.  All offsets are checked first: an offset
 *   outside [0, n) returns CORRUPT with out untouched.  buf_bytes must equal
 *   tagc_sparse_bytes(k, val_dtype).  Errors: ARG, RANGE, CORRUPT, DTYPE.
 */
tagc_status tagc_sparse_unpack(float *out, int64_t n,
                               const uint8_t *buf, int64_t buf_bytes,
                               int64_t k, tagc_dtype val_dtype);

/*
 * Coded pairs (the `auto` transport, docs/DESIGN.md section 4): one rank's k
 * kept (position, value) pairs of a shard of n, positions strictly
 * ascending, in one of three codings whose size depends only on (n, k,
 * value dtype), so every rank knows every message size before any data
 * moves and no size needs to be exchanged:
 */
typedef enum {
    /* Elias-Fano positions, then the k values.  With l = tagc_ef_low_bits(n,
     * k): the low l bits of each position, packed LSB-first one after the
     * other (ceil(k*l/8) bytes), then the upper bitvector of k + ((n-1) >> l)
     * + 1 bits (LSB-first bytes) in which bit (p_j >> l) + j is set for
     * every j; 2 + log2(n/k) bits per position at most, against 32 for
     * int32 offsets and the log2 C(n, k) / k ~ log2(n/k) + 1.44 of the
     * information itself. */
    TAGC_PAIRS_EF = 1,
    /* An n-bit bitmap (ceil(n/8) bytes, LSB-first, tail bits 0), then the k
     * values in position order: cheaper than EF above about 25% density. */
    TAGC_PAIRS_BITMAP = 2,
    /* n values, the kept ones at their positions and 0 elsewhere: the
     * cheapest when nearly everything is kept (and never more than a plain
     * exchange of n values of the same dtype). */
    TAGC_PAIRS_DENSE = 3
} tagc_coding;

/* Low bits per position of the EF coding: the largest l with k * 2^l <= n
 * (0 when k == 0 or k > n / 2); -1 for n, k outside 0 <= k <= n <= TAGC_MAX_N. */
int tagc_ef_low_bits(int64_t n, int64_t k);

/*
 * tagc_pairs_bytes - exact size of k pairs of a shard of n in a coding:
 *   EF ceil(k*l/8) + ceil((k + ((n-1) >> l) + 1) / 8) + k*v, BITMAP
 *   ceil(n/8) + k*v, DENSE n*v (v: bytes of a value); 0 when k == 0 (nothing
 *   is sent).  Returns -1 for an invalid argument (0 <= k <= n <= TAGC_MAX_N,
 *   known dtype and coding).
 */
int64_t tagc_pairs_bytes(int64_t n, int64_t k, tagc_dtype value_dtype, tagc_coding coding);

/*
 * tagc_pairs_cheapest - the coding of fewest bytes for (n, k, value dtype),
 *   ties to the earlier of EF, BITMAP, DENSE; 0 for an invalid argument.
 */
tagc_coding tagc_pairs_cheapest(int64_t n, int64_t k, tagc_dtype value_dtype);

/*
 * tagc_pairs_pack - write k pairs (idx ascending, in [0, n); val of
 *   val_dtype) in `coding`: tagc_pairs_bytes(n, k, val_dtype, coding)
 *   bytes of dst (any alignment).  Errors: ARG, DTYPE, RANGE (n, k, coding,
 *   an idx outside [0, n) or not strictly ascending: nothing written),
 *   CAPACITY.
 */
tagc_status tagc_pairs_pack(uint8_t *dst, int64_t dst_capacity,
                            const int32_t *idx, const void *val, tagc_dtype val_dtype,
                            int64_t k, int64_t n, tagc_coding coding);

/*
 * tagc_pairs_unpack_add - owner side: out[p_j] += value_j for the k pairs
 *   of src (received; any alignment), positions ascending.  The whole
 *   message is checked first: a position outside [0, n) or not strictly
 *   ascending, a bitvector with other than k set bits or with set padding
 *   bits returns CORRUPT with out untouched.  DENSE adds all n values
 *   (x + 0 == x: the same sums as the other codings).  Values are data:
 *   NaN/Inf reach out.
 *   Bounds: src_bytes == tagc_pairs_bytes(n, k, val_dtype, coding), else RANGE.
 *   Errors: ARG, DTYPE, RANGE, CORRUPT.
 */
tagc_status tagc_pairs_unpack_add(float *out, int64_t n,
                                  const uint8_t *src, int64_t src_bytes,
                                  int64_t k, tagc_dtype val_dtype, tagc_coding coding);

/*
 * Block quantization (the `quant` transport, docs/DESIGN.md section 3).  A vector
 * of n values is cut into blocks of `block` consecutive values (the last one
 * may be shorter); each block is sent as one record: its scale s (float32,
 * little-endian, 4 bytes) followed by one integer code q per value, packed
 * into bytes, values in order.  A value decodes to q * s (fp32 product).
 * Records follow each other with no gap, so the size depends only on
 * (n, format, block): tagc_quant_bytes().  Codes and scales per format:
 */
typedef enum {
    /* q in {-1, +1}: 8 codes per byte, bit j of a byte = value j, 1 means +1;
     * s = mean |v| over the block (the L1-optimal scale for signs). */
    TAGC_Q_SIGN = 1,
    /* q in {-1, 0, +1}: 5 codes per byte, the byte is sum_j (q_j + 1) * 3^j
     * (always < 243; 1.6 bits per value); s = min(TAGC_TERNARY_LEVEL *
     * mean |v|, max |v|), so q = round(v / s) sends the entries above 1.25
     * mean |v|, and always the largest. */
    TAGC_Q_TERNARY = 2,
    /* q in -7..7: 2 codes per byte, nibble q + 7 (15 is invalid), value 2j in
     * the low nibble; s = max |v| / 7. */
    TAGC_Q_INT4 = 4,
    /* q in -127..127: one int8 per value (-128 is invalid); s = max |v| / 127. */
    TAGC_Q_INT8 = 8
} tagc_qformat;

/* The byte layout of every code this library writes (block codes, sparse messages),
 * one number: raised whenever a layout changes, so that stored codes (a checkpoint's
 * coded residuals) of another layout are refused instead of decoded wrongly. */
#define TAGC_FORMAT_VERSION 1

/* Largest block accepted by the tagc_quant_* functions. */
#define TAGC_QBLOCK_MAX ((int64_t)1 << 16)

/*
 * tagc_quant_bytes - exact size in bytes of tagc_quant_encode's output for
 *   n values (the wire size of one shard; every rank computes it alone).
 *   Returns 0 for n == 0 and -1 for an invalid argument (n outside
 *   [0, TAGC_MAX_N], unknown format, block outside [1, TAGC_QBLOCK_MAX]).
 */
int64_t tagc_quant_bytes(int64_t n, tagc_qformat format, int64_t block);

/*
 * tagc_quant_encode - fused error feedback + block quantization, one shard.
 *   v = grad + residual (residual may be NULL: no error feedback).  Writes
 *     dst[0..tagc_quant_bytes(n, format, block))   the records (scales
 *                  from the block statistics above, q = round-half-even of
 *                  v / s clamped to the format's range, 0 where s == 0);
 *     residual     (if not NULL, in place) v - q * s: exactly what the owner
 *                  does not receive, rounding included, stays for the next step.
 *   Per block, sums of |v| are taken in one fixed order (32 strided partial
 *   sums in double, then a pairwise tree) shared with the CUDA kernel, so
 *   both produce the same bytes.  Every format sends the largest |v| of a
 *   block (at its level), so |v - q s| < |v| wherever q != 0.  Padding codes of a block's last byte
 *   encode 0 (sign: bit 0).
 *   Bounds: 0 <= n <= TAGC_MAX_N, 1 <= block <= TAGC_QBLOCK_MAX.
 *   Errors: ARG, DTYPE, RANGE (n, block, format), CAPACITY (dst_capacity <
 *   tagc_quant_bytes); NONFINITE when v has NaN/Inf, in which case the
 *   residual is untouched and dst holds unspecified bytes.
 */
tagc_status tagc_quant_encode(uint8_t *dst, int64_t dst_capacity,
                              void *residual, tagc_dtype residual_dtype,
                              const void *grad, tagc_dtype grad_dtype,
                              int64_t n, tagc_qformat format, int64_t block);

/*
 * tagc_quant_decode_add - owner side: out[i] += q_i * s for the n values of
 *   src (tagc_quant_encode's output, received from another rank).  Every
 *   code is checked first: a code outside the format (ternary byte >= 243,
 *   int4 nibble 15, int8 -128) returns CORRUPT with out untouched.  A
 *   non-finite scale is data, not corruption: it reaches out (that is how a
 *   NaN gradient on CUDA reaches the owner).
 *   Bounds: src_bytes == tagc_quant_bytes(n, format, block), else RANGE.
 *   Errors: ARG, RANGE, CORRUPT.
 */
tagc_status tagc_quant_decode_add(float *out, int64_t n,
                                  const uint8_t *src, int64_t src_bytes,
                                  tagc_qformat format, int64_t block);

/*
 * One unit at a time: the hook's quant transport for a unit of `world` shards
 * of `shard` values with the residual kept as codes (residual_code), each side
 * in one call instead of a decode, a multiply, world - 1 encodes and a re-code
 * (encode) or a zero fill, world - 1 decode-adds, an add, a divide and a copy
 * (decode).  Same bytes and values as those calls in that order.
 *
 * tagc_quant_unit_encode - with w the unit's residual (world * shard values):
 *     w = 0 + decode(rcodes), all zeros if any of them is NaN/Inf (then
 *         *reset = 1, else 0; reset may be NULL), times factor unless it is 1
 *     for r != rank, in order: row r of dst = tagc_quant_encode(grad_r + w_r)
 *         on (format, block), w_r updated in place, where x_r is values
 *         [r * shard, (r + 1) * shard) of x and row r is bytes
 *         [r * nb, (r + 1) * nb) of dst, nb = tagc_quant_bytes(shard, format, block)
 *     rcodes = tagc_quant_encode(w, no residual) on (residual_format, block)
 *   Row `rank` of dst is not written (the own shard never leaves the rank).
 *   Blocks are streamed one at a time: no unit-sized working copy.
 *   Bounds: world >= 1, 0 <= rank < world, shard >= 0, world * shard <=
 *   TAGC_MAX_N, 1 <= block <= TAGC_QBLOCK_MAX, shard % block == 0 (every
 *   residual record lies inside one shard), 0 <= factor <= 1 (so the own
 *   shard's residual stays finite).
 *   Errors: ARG, DTYPE, RANGE (also rcodes_bytes != tagc_quant_bytes(world *
 *   shard, residual_format, block)), CAPACITY (dst_capacity < world * nb),
 *   NOMEM; CORRUPT (a code of rcodes outside its format) and NONFINITE
 *   (grad_r + w_r holds NaN/Inf) with rcodes untouched and dst unspecified.
 */
tagc_status tagc_quant_unit_encode(uint8_t *dst, int64_t dst_capacity,
                                   uint8_t *rcodes, int64_t rcodes_bytes,
                                   const void *grad, tagc_dtype grad_dtype,
                                   int64_t shard, int64_t world, int64_t rank,
                                   tagc_qformat format, tagc_qformat residual_format,
                                   int64_t block, float factor, int *reset);

/*
 * tagc_quant_unit_decode - the owner's sum of one unit's shard: for each of
 *   the `shard` values, acc = 0, then for r = 0 .. world - 1 in order acc +=
 *   own (r == rank, the own shard of the unit's gradient) or the value row r
 *   of src decodes to (tagc_quant_decode_add's product); acc / divisor unless
 *   divisor is 1; stored into out as out_dtype (bf16: round to nearest even).
 *   Rows as tagc_quant_unit_encode's dst; row `rank` is not read.  Every
 *   other row's codes are checked first (CORRUPT: out untouched).
 *   Bounds: world >= 1, 0 <= rank < world, 0 <= shard <= TAGC_MAX_N, block
 *   as tagc_quant_bytes, src_bytes == world * tagc_quant_bytes(shard, format,
 *   block) (else RANGE), divisor finite and nonzero.
 *   Errors: ARG, DTYPE, RANGE, NOMEM, CORRUPT.
 */
tagc_status tagc_quant_unit_decode(void *out, tagc_dtype out_dtype, int64_t shard,
                                   const uint8_t *src, int64_t src_bytes,
                                   const void *own, tagc_dtype own_dtype,
                                   int64_t world, int64_t rank,
                                   tagc_qformat format, int64_t block, float divisor);

/*
 * Quantized weight gather (the `wq` codec: ZeRO++'s qwZ for FSDP's parameter
 * all-gather).  A rank's flat shard of n values is the concatenation of
 * nseg segments, one per parameter (seg[0..nseg), sum n; every rank has the
 * same lengths).  Each segment is cut into blocks of `block` values, the
 * last one of each segment possibly shorter (blocks never cross a segment,
 * so a parameter's blocks never mix in its neighbour's scale), and every
 * block is one record of the block quantization layout above: the fp32
 * little-endian scale, then the codes packed as that format says.  Records
 * follow each other segment by segment with no gap, so the size depends only
 * on (seg, format, block): tagc_wq_bytes().  Formats: TAGC_Q_INT8 and
 * TAGC_Q_INT4 only (weights are not sent again: no error feedback, no
 * sign/ternary).  Scale s = max |v| / qmax (tagc_q_scale), code q =
 * round-half-even of v times the fp32 1 / s, clamped to +-qmax (tagc_q_code;
 * the clamp never binds here, tagc_wq_code): deterministic, so the same
 * weights always give the same bytes, and a value decodes to the fp32
 * product q * s.  Re-encoding decoded fp32 values gives the same bytes
 * again (s = RN(m / qmax) of a float m makes RN(qmax * s) = m, the block's
 * largest value; except for the scales nudged down near FLT_MAX), and so
 * does re-encoding bf16 weights decoded into bf16; fp32 weights decoded into
 * bf16 re-encode once to other scales (bf16 rounds the block's largest
 * value), and from then on to the same bytes.
 *
 * A block holding NaN/Inf is not quantized: its record carries the scale bit
 * pattern TAGC_WQ_NONFINITE (a quiet NaN no arithmetic produces) and all
 * codes 0.  The message itself tells every receiver, which all see the same
 * bytes and so take the same decision (tagc_wq_decode: NONFINITE, gather
 * that unit exactly).
 */
#define TAGC_WQ_NONFINITE 0x7fc0ffeeu

/*
 * tagc_wq_bytes - exact size in bytes of a message of segments seg[0..nseg):
 *   the sum over segments of tagc_quant_bytes(seg[i], format, block).
 *   Returns 0 when every segment is empty, and -1 for an invalid argument:
 *   nseg outside [0, TAGC_MAX_N], seg NULL with nseg > 0, a negative segment,
 *   a total above TAGC_MAX_N, a format other than INT8/INT4, block outside
 *   [1, TAGC_QBLOCK_MAX].
 */
int64_t tagc_wq_bytes(const int64_t *seg, int64_t nseg, tagc_qformat format, int64_t block);

/*
 * tagc_wq_encode - one rank's shard src[0..n) (fp32 or bf16, read only) as
 *   a wq message: writes dst[0..tagc_wq_bytes(seg, nseg, format, block)),
 *   one record per block as above.  A block with NaN/Inf gets the scale
 *   TAGC_WQ_NONFINITE and all codes 0 (int4: nibbles 7) and the call still
 *   returns OK.  Padding nibbles (int4, odd block) encode 0.
 *   Bounds: n == sum of seg (else RANGE), as tagc_wq_bytes otherwise.
 *   Errors: ARG (NULL), DTYPE, RANGE, CAPACITY (dst_capacity < the size).
 */
tagc_status tagc_wq_encode(uint8_t *dst, int64_t dst_capacity,
                           const void *src, tagc_dtype src_dtype, int64_t n,
                           const int64_t *seg, int64_t nseg,
                           tagc_qformat format, int64_t block);

/*
 * tagc_wq_decode - receiver side: out[i] = q_i * s (fp32 product, written,
 *   not added; rounded to nearest even when out is bf16) for the n values of
 *   a wq message src (any alignment).  The whole message is checked before
 *   anything is written: a code outside the format (int8 -128, int4 nibble
 *   15) or a scale that is neither the exact TAGC_WQ_NONFINITE pattern nor
 *   finite, >= 0 (-0 included) and such that qmax * s <= FLT_MAX returns
 *   CORRUPT; else a record with TAGC_WQ_NONFINITE returns NONFINITE; out is
 *   untouched on both.  Padding nibbles are not checked.
 *   Bounds: n == sum of seg, src_bytes == tagc_wq_bytes(seg, nseg, format,
 *   block) (else RANGE), as tagc_wq_bytes otherwise.
 *   Errors: ARG, DTYPE, RANGE, CORRUPT, NONFINITE.
 */
tagc_status tagc_wq_decode(void *out, tagc_dtype out_dtype, int64_t n,
                           const uint8_t *src, int64_t src_bytes,
                           const int64_t *seg, int64_t nseg,
                           tagc_qformat format, int64_t block);

/*
 * The weights' change (SDP4Bit's weight differences as a closed loop, the
 * `gather_delta` of tagc/gather.py): every rank holds `ref`, the unit's
 * weights as all ranks reconstructed them (the same bytes everywhere), and
 * the owner of a shard also holds `sent`, the shard it last coded.  A delta
 * message is a wq message of the change src - ref[own] (fp32 differences of
 * the dtype's values), then one flag byte: 1 when the shard changed since
 * `sent` (the codes follow the wq layout above), 0 when it did not (every
 * byte of the message is 0 then, and receivers leave their `ref` as it is).
 * A receiver adds the decoded change to its `ref` in fp32 and rounds the sum
 * to the dtype once, as the owner does for its own slice, so every rank's
 * `ref` stays the same bytes.  The unchanged message is what lets FSDP's
 * backward re-gather hand back the forward's weights bit for bit.
 */

/*
 * tagc_wq_delta_bytes - exact size of a delta message: tagc_wq_bytes() + 1
 *   (the flag byte, last).  -1 when tagc_wq_bytes() is -1.
 */
int64_t tagc_wq_delta_bytes(const int64_t *seg, int64_t nseg, tagc_qformat format,
                            int64_t block);

/*
 * tagc_wq_delta_encode - the owner's side.  If src[0..n) has the bit
 *   pattern of sent[0..n) (a memcmp: -0 and +0 differ, a NaN equals itself)
 *   writes 0 to every byte of dst[0..tagc_wq_delta_bytes()) and touches
 *   nothing else.  Otherwise writes the wq records of d_i = src_i - base_i
 *   (both read in dtype, subtracted in fp32; a block whose d holds NaN/Inf
 *   gets the TAGC_WQ_NONFINITE record), then the flag byte 1, and copies
 *   src into sent.  src, sent and base are n values of `dtype` (fp32 or
 *   bf16) and overlap neither each other nor dst.
 *   Bounds: as tagc_wq_encode.  Errors: ARG (NULL), DTYPE, RANGE, CAPACITY
 *   (dst_capacity < tagc_wq_delta_bytes()); nothing is written on an error.
 */
tagc_status tagc_wq_delta_encode(uint8_t *dst, int64_t dst_capacity,
                                 const void *src, void *sent, const void *base,
                                 tagc_dtype dtype, int64_t n,
                                 const int64_t *seg, int64_t nseg,
                                 tagc_qformat format, int64_t block);

/*
 * tagc_wq_delta_decode - a receiver's side (the owner's too, for its own
 *   slice): flag byte 0: out[0..n) = ref[0..n), the codes are not read.
 *   Flag 1: the whole message is checked as tagc_wq_decode checks it, then
 *   ref_i = dtype(ref_i + q_i * s) (the fp32 product, then the fp32 sum,
 *   rounded to nearest even once when dtype is bf16) and out_i = ref_i.
 *   out may be ref itself (the change is added in place); otherwise the two
 *   do not overlap.  A flag other than 0 or 1 is CORRUPT.
 *   Bounds: n == sum of seg, src_bytes == tagc_wq_delta_bytes() (else
 *   RANGE), as tagc_wq_bytes otherwise.
 *   Errors: ARG, DTYPE, RANGE, CORRUPT (a flag, code or scale no encoder
 *   writes), NONFINITE (a TAGC_WQ_NONFINITE record); out and ref are
 *   untouched on every error.
 */
tagc_status tagc_wq_delta_decode(void *out, void *ref, tagc_dtype dtype, int64_t n,
                                 const uint8_t *src, int64_t src_bytes,
                                 const int64_t *seg, int64_t nseg,
                                 tagc_qformat format, int64_t block);

/*
 * 4-bit codes (MXFP4-style): each value is one E2M1 code, a 4-bit float of
 * magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit (bit 3), times the
 * power-of-two scale of its block of `block` consecutive values (the last
 * block may be shorter).  A block's scale is E8M0: one byte b, the scale
 * 2^(b - 127) (255 is NaN), chosen as the smallest power of two s with
 * max |v| <= 6 s, so no value of a block is clipped (OCP's MX rule takes
 * 2^(floor(log2 max) - 2), which clips the top of the range to 6 s; this
 * one spends up to a bit of range to never clip).  A scale below 2^-127 is
 * 2^-127.  Codes: round to nearest, ties to the even index (0.25 s -> 0,
 * 0.75 s -> 1 s, 2.5 s -> 2 s, 5 s -> 4 s, as IEEE's ties-to-even), or,
 * with TAGC_FP4_STOCHASTIC, stochastic rounding between the two
 * neighbouring magnitudes, from a hash of (seed, position); zero is always
 * code 0 (never -0).  Block sizes: a power of two in [2, TAGC_FP4_BLOCK_MAX]
 * (32 is MXFP4's).
 *
 * Wire layout (tagc_fp4_bytes): ceil(n/2) code bytes, value i in byte i/2,
 * the low nibble for even i (a last odd value's high nibble is 0), then
 * ceil(n/block) scale bytes, one per block in order: 4 + 8/block bits per
 * value (4.25 at block 32).  Every nibble is a valid code, so a decoder
 * has nothing to refuse but a size.
 *
 * Rotation (TAGC_FP4_ROTATE, tagc_rht): before coding, each whole block x
 * becomes H D x / sqrt(block), D a diagonal of signs from a hash of
 * (seed, position) (bit i % 64 of the hash of i / 64), H the Walsh-Hadamard
 * matrix of the block (the fast transform, butterflies a + b, a - b over
 * strides 1, 2, 4, ...), and the division a product by the float of
 * 1/sqrt(block) after the butterflies; the decoder undoes it (D H y /
 * sqrt(block): butterflies, product, signs).  It spreads a block's outliers
 * over the block, so the scale fits the bulk.  A shorter last block gets
 * the sign flips only.  Rotating then unrotating gives x back up to float
 * rounding (the butterflies round).  The seed is the caller's:
 * every rank must use the same one for a unit and step (tagc_seed_derive).
 */
#define TAGC_FP4_ROTATE 1u     /* rotate each block before coding (undone on decode) */
#define TAGC_FP4_STOCHASTIC 2u /* stochastic rounding instead of round to nearest */

/* Largest block of the tagc_fp4_* functions and tagc_rht. */
#define TAGC_FP4_BLOCK_MAX ((int64_t)256)

/*
 * tagc_fp4_bytes - exact size in bytes of tagc_fp4_encode's output for n
 *   values: ceil(n/2) + ceil(n/block).  0 for n == 0, -1 for n outside
 *   [0, TAGC_MAX_N] or a block that is not a power of two in
 *   [2, TAGC_FP4_BLOCK_MAX].
 */
int64_t tagc_fp4_bytes(int64_t n, int64_t block);

/*
 * tagc_fp4_encode - fused error feedback + 4-bit block coding, one shard.
 *   v = grad + residual (residual may be NULL: no error feedback; fp32 sum).
 *   Writes dst[0..tagc_fp4_bytes(n, block)) (layout above; with
 *   TAGC_FP4_ROTATE the codes are those of the rotated blocks) and, if
 *   residual is not NULL, residual = v - what tagc_fp4_decode_add adds for
 *   the same flags and seed (rounding included), in place.  flags: an OR of
 *   TAGC_FP4_ROTATE and TAGC_FP4_STOCHASTIC; seed drives both.
 *   Bounds: as tagc_fp4_bytes.  Errors: ARG, DTYPE, RANGE (n, block, an
 *   unknown flag), CAPACITY; NONFINITE when v holds NaN/Inf or a |v| >=
 *   2^100 (so that neither a rotation nor a code rounded up can overflow):
 *   the residual is then untouched and dst holds unspecified bytes.
 */
tagc_status tagc_fp4_encode(uint8_t *dst, int64_t dst_capacity,
                            void *residual, tagc_dtype residual_dtype,
                            const void *grad, tagc_dtype grad_dtype,
                            int64_t n, int64_t block, unsigned flags, uint64_t seed);

/*
 * tagc_fp4_decode_add - owner side: out[i] += the decoded value i of src
 *   (tagc_fp4_encode's output, any alignment): code times scale, unrotated
 *   when flags has TAGC_FP4_ROTATE (the encoder's flags and seed;
 *   TAGC_FP4_STOCHASTIC changes nothing here).  A NaN scale byte (255) is
 *   data: its block adds NaN.
 *   Bounds: src_bytes == tagc_fp4_bytes(n, block), else RANGE; an unknown
 *   flag: RANGE.  Errors: ARG, RANGE.
 */
tagc_status tagc_fp4_decode_add(float *out, int64_t n,
                                const uint8_t *src, int64_t src_bytes,
                                int64_t block, unsigned flags, uint64_t seed);

/*
 * tagc_rht - the rotation above alone, fp32: dst[0..n) = the blockwise
 *   rotation of src[0..n) under seed (inverse != 0: its inverse).  dst may
 *   equal src (in place); other overlaps are undefined.
 *   Errors: ARG, RANGE (n, block), CAPACITY (dst_capacity < n).
 */
tagc_status tagc_rht(float *dst, int64_t dst_capacity, const float *src, int64_t n,
                     int64_t block, uint64_t seed, int inverse);

/*
 * Ternary codes with two-level log scales (the `tls` code, a sub-1-bit
 * gradient code at N = 2).  Blocks of TAGC_TLS_BLOCK values, groups of
 * TAGC_TLS_GROUP blocks, the last of each possibly shorter.  A block's raw
 * scale r is the ternary format's (min(2.5 mean |v|, max |v|), its sum of
 * |v| in tagc_quant_encode's order, 0 below FLT_MIN).  The message sends
 * S, the largest r, as fp32; each group one byte g, its largest r as the
 * nearest (in log2) of S 2^(-g/16), g in [0, 254] (255: a zero group);
 * each block one nibble b, its r as the nearest of M 2^(-b/3), b in
 * [0, 14] clamped (15: a zero block), M its group's decoded scale.  The
 * decoded scales are fp32 products of S and constants (tls.h), rounded
 * once, then exact powers of two; a scale below FLT_MIN is 0.  A value's
 * code is tagc_quant_encode's ternary code under its block's decoded
 * scale s (q = round-half-even of v / s clamped to -1..1), and it decodes
 * to q * s.  Why two levels: a gradient's neighbouring rows (a layer's
 * neurons) differ by orders of magnitude; a scale per 256 values zeroes
 * the small rows, a byte of scale per 32 costs 0.25 bits more per value.
 *
 * Wire layout (tagc_tls_bytes): S (fp32, little endian), then one byte per
 * group, then the block nibbles (block i in byte i/2, the low nibble for
 * even i; an odd count's last high nibble 0), then the codes as ternary
 * digits q + 1, five per byte across the whole message (value i at weight
 * 3^(i % 5) of byte i / 5; padding digits encode 0): 1.6 + 4/32 + 8/512 =
 * 1.74 bits per value, plus 32 per message.
 */
#define TAGC_TLS_BLOCK 32 /* values per block scale */
#define TAGC_TLS_GROUP 16 /* blocks per group scale */

/*
 * tagc_tls_bytes - exact size in bytes of tagc_tls_encode's output for n
 *   values: 4 + ceil(nb/16) + ceil(nb/2) + ceil(n/5), nb = ceil(n/32); 0
 *   for n == 0, -1 for n outside [0, TAGC_MAX_N].
 */
int64_t tagc_tls_bytes(int64_t n);

/*
 * tagc_tls_encode - fused error feedback + the tls code, one shard.
 *   v = grad + residual (residual may be NULL: no error feedback; fp32
 *   sum).  Writes dst[0..tagc_tls_bytes(n)) (layout above) and, if
 *   residual is not NULL, residual = v - q s in place: exactly what
 *   tagc_tls_decode_add does not add.  Deterministic: the same v always
 *   gives the same bytes, on the CPU and the GPU.
 *   Bounds: as tagc_tls_bytes.  Errors: ARG, DTYPE, RANGE, CAPACITY;
 *   NONFINITE when v holds NaN/Inf: the residual is then untouched and dst
 *   holds unspecified bytes.
 */
tagc_status tagc_tls_encode(uint8_t *dst, int64_t dst_capacity,
                            void *residual, tagc_dtype residual_dtype,
                            const void *grad, tagc_dtype grad_dtype, int64_t n);

/*
 * tagc_tls_decode_add - owner side: out[i] += q_i s_i for the n values of
 *   src (tagc_tls_encode's output, any alignment).  The whole message is
 *   checked first: a code byte >= 243 or a message scale that is negative,
 *   -0 or infinite returns CORRUPT with out untouched.  A NaN message scale
 *   is data (how a CUDA encoder marks NaN/Inf input): every out[i] += NaN.
 *   Bounds: src_bytes == tagc_tls_bytes(n), else RANGE.
 *   Errors: ARG, RANGE, CORRUPT.
 */
tagc_status tagc_tls_decode_add(float *out, int64_t n,
                                const uint8_t *src, int64_t src_bytes);

#ifdef __cplusplus
}
#endif

#endif /* TAGC_H */
