/*
 * tagc_cuda.h - the TAGC gradient codec on CUDA.  Same ops, same spec and
 * same status codes as csrc/tagc.h, with these differences, all of which
 * exist so that nothing here ever waits for the GPU:
 *
 * - Every launcher takes a cudaStream_t last and only enqueues work on it.
 *   It returns as soon as the work is queued; a TAGC_OK return means the
 *   arguments were valid and every launch was accepted, not that the kernels
 *   have run.  All pointers named as data are DEVICE pointers (including the
 *   scalar outputs tau, counts and status words); the caller keeps them alive
 *   until the stream has passed this work.
 * - Errors that depend only on the arguments (ARG, RANGE, CAPACITY, DTYPE)
 *   are returned synchronously exactly as by the C op, before anything is
 *   enqueued.  A failing CUDA call (launch, memset) returns TAGC_ERR_CUDA
 *   (checked with cudaGetLastError after every launch); work enqueued before
 *   the failure may still run.
 * - Errors that depend on the DATA (NaN/Inf in a gradient, an index or offset
 *   out of range) cannot be returned without a host sync.  They are reported
 *   on the device instead, as documented per function: a NaN threshold, and
 *   an optional int32 device status word `dev_status` (may be NULL) into
 *   which the first data error's tagc_status code is stored (atomic
 *   compare-and-swap from 0; the caller zeroes it beforehand).
 * - Scratch memory comes from a caller-provided device workspace: call
 *   tagc_cuda_<op>_workspace_size(...) for the byte count, pass a buffer of
 *   at least that many bytes (any alignment: the launchers align it
 *   themselves).  Ops without a size query need no workspace.  A workspace
 *   must not be shared by two launches that may run concurrently.
 *   Launchers never allocate, free or synchronize.
 *
 * Every kernel is named *_kernel and lives in the .cu file of its op; the
 * hashing, lane layout, bf16 rounding, peeling rule and median are those of
 * csrc/tagc_portable.h, compiled for the device, so CPU tests of the C codec
 * cover them.  This header is plain C and usable from a C compiler.
 */
#ifndef TAGC_CUDA_H
#define TAGC_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "../csrc/tagc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Default bound on peeling rounds for tagc_cuda_peel_decode (see there). */
#define TAGC_CUDA_PEEL_ROUNDS 96

/*
 * tagc_cuda_select_kth - radix select of the k-th largest |x_i| on the float
 *   bit pattern (sign cleared): one histogram pass per 11/10/10-bit digit,
 *   each followed by a one-block scan, all stream-ordered (no host sync).
 *   Writes *tau (device float) = the k-th largest magnitude; k == 0 writes
 *   +INFINITY.  When x holds NaN/Inf (the C op's NONFINITE), *tau = NaN.
 *   Bounds and synchronous errors as tagc_select_kth (ARG, RANGE, DTYPE),
 *   plus CAPACITY (workspace too small) and CUDA.
 */
size_t tagc_cuda_select_kth_workspace_size(int64_t n);
tagc_status tagc_cuda_select_kth(float *tau, const void *x, tagc_dtype x_dtype,
                                 int64_t n, int64_t k,
                                 void *workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

/*
 * tagc_cuda_sparsify - fused error feedback + exact top-k + bitmap +
 *   compaction, one shard; the output of tagc_sparsify, bit for bit:
 *   v = grad + residual (fp32), the k largest |v| kept with ties at tau
 *   broken by lower position (exactly k kept), idx ascending, val rounded to
 *   val_dtype, residual (in place, may be NULL) = v - val where kept, v where
 *   dropped, bitmap ceil(n/8) bytes with tail bits 0, *tau (device float).
 *   NaN/Inf in v (the C op's NONFINITE): *tau = NaN and the residual is left
 *   untouched; so that whatever the caller enqueued after this still reads
 *   defined, in-bounds data, the outputs then hold positions 0..k-1 with NaN
 *   values (idx[j] = j, val[j] = NaN, bitmap bits 0..k-1): the NaN reaches
 *   the owner's decoded shard, where AMP's GradScaler sees it.
 *   Bounds and synchronous errors as tagc_sparsify, plus CAPACITY
 *   (workspace) and CUDA.
 */
size_t tagc_cuda_sparsify_workspace_size(int64_t n);
tagc_status tagc_cuda_sparsify(int32_t *idx, int64_t idx_capacity,
                               void *val, tagc_dtype val_dtype,
                               int64_t val_capacity,
                               uint8_t *bitmap, int64_t bitmap_capacity,
                               void *residual, tagc_dtype residual_dtype,
                               const void *grad, tagc_dtype grad_dtype,
                               int64_t n, int64_t k, float *tau,
                               void *workspace, size_t workspace_bytes,
                               cudaStream_t stream);

/* tagc_cuda_lanes_pack - as tagc_lanes_pack. */
tagc_status tagc_cuda_lanes_pack(uint8_t *lanes, int64_t lanes_capacity,
                                 const uint8_t *bitmap, int64_t n, int bits,
                                 cudaStream_t stream);

/* tagc_cuda_lanes_unpack - as tagc_lanes_unpack. */
tagc_status tagc_cuda_lanes_unpack(uint8_t *bitmap, int64_t bitmap_capacity,
                                   const uint8_t *lanes, int64_t lanes_bytes,
                                   int64_t n, int bits, cudaStream_t stream);

/* tagc_cuda_bitmap_or - as tagc_bitmap_or. */
tagc_status tagc_cuda_bitmap_or(uint8_t *dst, int64_t dst_capacity,
                                const uint8_t *src, int64_t nbytes,
                                int64_t count, cudaStream_t stream);

/* tagc_cuda_popcount - as tagc_popcount; *count is a device int64. */
tagc_status tagc_cuda_popcount(int64_t *count, const uint8_t *bitmap,
                               int64_t n, cudaStream_t stream);

/*
 * tagc_cuda_sketch_encode - as tagc_sketch_encode: zero the 3t buckets, then
 *   one thread per kept pair adds sign_i * value to its three buckets with
 *   fp32 atomicAdd (so the summation order, and the last bits of a bucket
 *   shared by several pairs, may differ from the C op), then rounds once to
 *   sketch_dtype.  An idx outside [0, n) (the C op's RANGE) is skipped and
 *   TAGC_ERR_RANGE stored in *dev_status (if not NULL).
 *   Workspace: 3t fp32 accumulators when sketch_dtype is bf16, none for fp32
 *   (the size query says 0 then and workspace may be NULL).
 */
size_t tagc_cuda_sketch_encode_workspace_size(int64_t t, tagc_dtype sketch_dtype);
tagc_status tagc_cuda_sketch_encode(void *sketch, tagc_dtype sketch_dtype,
                                    int64_t sketch_capacity,
                                    const int32_t *idx, const void *val,
                                    tagc_dtype val_dtype, int64_t k,
                                    int64_t n, int64_t t, uint64_t seed,
                                    int32_t *dev_status,
                                    void *workspace, size_t workspace_bytes,
                                    cudaStream_t stream);

/*
 * tagc_cuda_peel_decode - as tagc_peel_decode, peeling in rounds: the union
 *   positions are compacted (ascending), per-bucket counts built with
 *   atomics, then each round is two kernels: detect (every unresolved
 *   position with a count-1 bucket reads its value, tagc_peel_value) and
 *   apply (those positions subtract themselves from their three buckets).
 *   max_rounds rounds (>= 1; TAGC_CUDA_PEEL_ROUNDS is a good default) are
 *   enqueued at once; a device-side progress flag per round makes every
 *   kernel after the first round without progress exit at once, so there is
 *   no host round-trip per round.  Positions still unresolved after that get
 *   the median of their three signed buckets (estimate != 0) or 0, and are
 *   listed ascending in unpeeled[0..min(count, capacity)) and counted in
 *   *unpeeled_count (device int64).  Peeling is order-independent, so the
 *   set of peeled positions equals the C op's unless max_rounds ran out
 *   while rounds still made progress; values agree up to fp32 rounding of
 *   the bucket subtractions (atomics, different order).
 *   Bounds and synchronous errors as tagc_peel_decode, plus RANGE
 *   (max_rounds < 1), CAPACITY (workspace) and CUDA.
 */
size_t tagc_cuda_peel_decode_workspace_size(int64_t n, int64_t t,
                                            int max_rounds);
tagc_status tagc_cuda_peel_decode(float *out, int64_t out_capacity,
                                  int32_t *unpeeled, int64_t unpeeled_capacity,
                                  int64_t *unpeeled_count,
                                  const void *sketch, tagc_dtype sketch_dtype,
                                  const uint8_t *bitmap, int64_t n,
                                  int64_t t, uint64_t seed, int estimate,
                                  int max_rounds,
                                  void *workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

/* tagc_cuda_sparse_pack - as tagc_sparse_pack (buf may have any alignment). */
tagc_status tagc_cuda_sparse_pack(uint8_t *buf, int64_t buf_capacity,
                                  const int32_t *idx, const void *val,
                                  tagc_dtype val_dtype, int64_t k,
                                  cudaStream_t stream);

/*
 * tagc_cuda_sparse_unpack - as tagc_sparse_unpack: a first kernel checks
 *   every offset; if one is outside [0, n) (the C op's CORRUPT) out is left
 *   untouched and TAGC_ERR_CORRUPT is stored in *dev_status (if not NULL),
 *   otherwise a second kernel scatter-adds with fp32 atomicAdd.
 */
size_t tagc_cuda_sparse_unpack_workspace_size(void);
tagc_status tagc_cuda_sparse_unpack(float *out, int64_t n,
                                    const uint8_t *buf, int64_t buf_bytes,
                                    int64_t k, tagc_dtype val_dtype,
                                    int32_t *dev_status,
                                    void *workspace, size_t workspace_bytes,
                                    cudaStream_t stream);

/*
 * tagc_cuda_pairs_pack - as tagc_pairs_pack, the same bytes (dst at any
 *   alignment, written bytewise): the bit array (bitmap or EF upper vector,
 *   or the whole message for DENSE) is zeroed, then one kernel with a
 *   thread per pair (value, and the bit array byte of which it is the first
 *   pair) and per EF low-bits byte.  Positions not strictly ascending in
 *   [0, n) (the C op's RANGE): dst is left with unspecified bytes (none
 *   outside it written) and TAGC_ERR_RANGE stored in *dev_status (if not
 *   NULL).  Needs no scratch: the size query says 0 and workspace may be
 *   NULL.
 */
size_t tagc_cuda_pairs_pack_workspace_size(void);
tagc_status tagc_cuda_pairs_pack(uint8_t *dst, int64_t dst_capacity,
                                 const int32_t *idx, const void *val, tagc_dtype val_dtype,
                                 int64_t k, int64_t n, tagc_coding coding,
                                 int32_t *dev_status,
                                 void *workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

/*
 * tagc_cuda_pairs_unpack_add - as tagc_pairs_unpack_add, the same sums
 *   (positions are distinct within a message: no atomics needed).  BITMAP
 *   and EF: set bits counted per tile of the bit array, a tile scan gives
 *   every set bit its rank (its value's index, and for EF its low part and
 *   high part b - rank), a check kernel validates the whole message as the
 *   C op (count, padding bits, EF positions < n and ascending) into a
 *   device flag, and the add kernel does nothing once it is set.  A message
 *   the C op calls CORRUPT leaves out untouched and stores TAGC_ERR_CORRUPT
 *   in *dev_status (if not NULL).  DENSE adds all n values, no check.
 *   Workspace (any coding of this (n, k)): a flag, a 64-bit count and two
 *   uint32 per 8192 bits of the longer bit array.
 */
size_t tagc_cuda_pairs_unpack_add_workspace_size(int64_t n, int64_t k);
tagc_status tagc_cuda_pairs_unpack_add(float *out, int64_t n,
                                       const uint8_t *src, int64_t src_bytes,
                                       int64_t k, tagc_dtype val_dtype, tagc_coding coding,
                                       int32_t *dev_status,
                                       void *workspace, size_t workspace_bytes,
                                       cudaStream_t stream);

/*
 * tagc_cuda_quant_encode - as tagc_quant_encode, the same bytes and the same
 *   residual bit for bit (one warp per block; the block sums run in the C
 *   op's order).  NaN/Inf in v (the C op's NONFINITE): every record gets a
 *   NaN scale and zero codes and the residual is left untouched, so the NaN
 *   reaches the owner's decoded shard, where AMP's GradScaler sees it.
 *   Two kernels (scales, then codes and residual) and a flag in the workspace.
 */
size_t tagc_cuda_quant_encode_workspace_size(void);
tagc_status tagc_cuda_quant_encode(uint8_t *dst, int64_t dst_capacity,
                                   void *residual, tagc_dtype residual_dtype,
                                   const void *grad, tagc_dtype grad_dtype,
                                   int64_t n, tagc_qformat format, int64_t block,
                                   void *workspace, size_t workspace_bytes,
                                   cudaStream_t stream);

/*
 * tagc_cuda_quant_decode_add - as tagc_quant_decode_add: a first kernel
 *   checks every code; if one is invalid (the C op's CORRUPT) out is left
 *   untouched and TAGC_ERR_CORRUPT is stored in *dev_status (if not NULL),
 *   otherwise a second kernel adds q * s to out (no atomics: each value once).
 */
size_t tagc_cuda_quant_decode_add_workspace_size(void);
tagc_status tagc_cuda_quant_decode_add(float *out, int64_t n,
                                       const uint8_t *src, int64_t src_bytes,
                                       tagc_qformat format, int64_t block,
                                       int32_t *dev_status,
                                       void *workspace, size_t workspace_bytes,
                                       cudaStream_t stream);

/*
 * tagc_cuda_quant_unit_encode - as tagc_quant_unit_encode, the same bytes
 *   and residual codes, in two kernels (cuda/quant_unit.cu) with no
 *   workspace and no memset:
 *     counts  DEVICE int64[5], added to: [0] += 1 for a call that encoded,
 *             [1] += 1 for a poisoned one, [2] += 1 when the residual was
 *             reset, [3] and [4] += shard for a call that encoded (the hook's
 *             counters, union size and shard slots among them, kept without a
 *             kernel of their own and not counting a poisoned call);
 *     vote    DEVICE float or NULL: the ranks' summed finite votes, 0 when
 *             every rank's gradient is finite; anything else (NaN) poisons
 *             the call: every message record gets a NaN scale and zero
 *             codes, as tagc_cuda_quant_encode gives a poisoned shard, and
 *             rcodes is left as it was (a reset is still counted).  Read
 *             here so that the hook enqueues no comparison of its own;
 *     flags   DEVICE int32[2], zero before the call and left zero after it
 *             (the guard's verdict and the blocks' finishing count): one per
 *             stream, as calls on a stream never overlap.
 *   Unlike the C op it cannot refuse data: codes of rcodes are not checked
 *   (they are this rank's own state), and a NaN/Inf in grad + residual
 *   reaches the message (callers poison through `vote` instead).
 */
tagc_status tagc_cuda_quant_unit_encode(uint8_t *dst, int64_t dst_capacity,
                                        uint8_t *rcodes, int64_t rcodes_bytes,
                                        const void *grad, tagc_dtype grad_dtype,
                                        int64_t shard, int64_t world, int64_t rank,
                                        tagc_qformat format, tagc_qformat residual_format,
                                        int64_t block, float factor, int64_t *counts,
                                        const float *vote, int32_t *flags,
                                        cudaStream_t stream);

/*
 * tagc_cuda_quant_unit_decode - as tagc_quant_unit_decode, the same values
 *   (one kernel, a thread per value, the same rank order), except that a
 *   code outside the format decodes to NaN instead of refusing the call.
 */
tagc_status tagc_cuda_quant_unit_decode(void *out, tagc_dtype out_dtype, int64_t shard,
                                        const uint8_t *src, int64_t src_bytes,
                                        const void *own, tagc_dtype own_dtype,
                                        int64_t world, int64_t rank,
                                        tagc_qformat format, int64_t block, float divisor,
                                        cudaStream_t stream);

/*
 * tagc_cuda_wq_encode / tagc_cuda_wq_decode - as tagc_wq_encode /
 *   tagc_wq_decode, the same bytes and values (one warp per block; codes and
 *   scales from tagc_portable.h).  The segment table seg[0..nseg) is a
 *   DEVICE int64 array: a one-block prefix kernel turns it into per-segment
 *   offsets (blocks, values, bytes) in the workspace and checks it there,
 *   and every later kernel finds its block's segment by binary search, so
 *   nothing waits for the host.  Only nseg == 0 is decided on the host.
 *   Table errors the C op returns synchronously (a negative or too long
 *   segment, sum != n: RANGE; encode: dst_capacity below the message size:
 *   CAPACITY; decode: src_bytes != the message size: RANGE) are stored in
 *   *dev_status (if not NULL) and nothing is written.
 *   Encode: a block with NaN/Inf gets the sentinel record, as the C op.
 *   Decode: a check kernel validates the whole message into device flags
 *   first; if a code or scale is invalid (the C op's CORRUPT) out is left
 *   untouched and TAGC_ERR_CORRUPT stored in *dev_status.  Unlike the C op,
 *   a record with the TAGC_WQ_NONFINITE sentinel does not leave out
 *   untouched: its block's values are written as NaN (every other block is
 *   decoded) and TAGC_ERR_NONFINITE is stored in *dev_status, so on CUDA a
 *   non-finite weight makes the forward NaN, loudly, instead of the CPU's
 *   exact re-gather (deciding that would need a host sync).
 *   Workspace: three int64 tables of nseg + 1 entries and four flags.
 */
size_t tagc_cuda_wq_encode_workspace_size(int64_t nseg);
tagc_status tagc_cuda_wq_encode(uint8_t *dst, int64_t dst_capacity,
                                const void *src, tagc_dtype src_dtype, int64_t n,
                                const int64_t *seg, int64_t nseg,
                                tagc_qformat format, int64_t block,
                                int32_t *dev_status,
                                void *workspace, size_t workspace_bytes,
                                cudaStream_t stream);
size_t tagc_cuda_wq_decode_workspace_size(int64_t nseg);
tagc_status tagc_cuda_wq_decode(void *out, tagc_dtype out_dtype, int64_t n,
                                const uint8_t *src, int64_t src_bytes,
                                const int64_t *seg, int64_t nseg,
                                tagc_qformat format, int64_t block,
                                int32_t *dev_status,
                                void *workspace, size_t workspace_bytes,
                                cudaStream_t stream);

/*
 * tagc_cuda_wq_delta_encode / tagc_cuda_wq_delta_decode - as
 *   tagc_wq_delta_encode / tagc_wq_delta_decode, the same bytes and values,
 *   on tagc_cuda_wq_*'s device segment table, prefix kernel and records
 *   (see there; seg is a DEVICE array, table errors go to *dev_status and
 *   nothing is written).  src, sent, base, out and ref are device arrays of
 *   n values of dtype.  nseg == 0 is decided on the host (n must be 0): the
 *   message is the flag byte alone.
 *   Encode: a compare kernel tests src against sent bit for bit into a
 *   device flag; the encode kernel then writes either the records of
 *   d = src - base (fp32) and copies src into sent, or zeros over the whole
 *   message, and the flag byte 1 or 0.  CAPACITY (dst_capacity below
 *   tagc_wq_delta_bytes()) is a table error: in *dev_status.
 *   Decode: src_bytes != tagc_wq_delta_bytes() is RANGE in *dev_status.  The
 *   check kernel reads the flag byte: 0 means out = ref (no code read), a
 *   value above 1 is CORRUPT, 1 validates every record as
 *   tagc_cuda_wq_decode; CORRUPT leaves out and ref untouched.  Then
 *   ref = dtype(ref + q * s) and out = ref (out may be ref).  As in
 *   tagc_cuda_wq_decode and unlike the C op, a TAGC_WQ_NONFINITE record does
 *   not leave out and ref untouched: its block is written as NaN into both
 *   (every other block gets its change) and TAGC_ERR_NONFINITE is stored in
 *   *dev_status, so the non-finite change reaches the forward loudly.
 *   Synchronous errors as the C op's (ARG, DTYPE, RANGE) where the host can
 *   decide them (a NULL pointer with an invalid device table is ARG here,
 *   RANGE in the C op), plus ARG / CAPACITY (workspace) and CUDA.  A NaN
 *   written into ref stays there, so every later change adds to it until
 *   the caller rebuilds ref (an exact gather).  Workspace: as tagc_cuda_wq_*.
 */
size_t tagc_cuda_wq_delta_encode_workspace_size(int64_t nseg);
tagc_status tagc_cuda_wq_delta_encode(uint8_t *dst, int64_t dst_capacity,
                                      const void *src, void *sent, const void *base,
                                      tagc_dtype dtype, int64_t n,
                                      const int64_t *seg, int64_t nseg,
                                      tagc_qformat format, int64_t block,
                                      int32_t *dev_status,
                                      void *workspace, size_t workspace_bytes,
                                      cudaStream_t stream);
size_t tagc_cuda_wq_delta_decode_workspace_size(int64_t nseg);
tagc_status tagc_cuda_wq_delta_decode(void *out, void *ref, tagc_dtype dtype, int64_t n,
                                      const uint8_t *src, int64_t src_bytes,
                                      const int64_t *seg, int64_t nseg,
                                      tagc_qformat format, int64_t block,
                                      int32_t *dev_status,
                                      void *workspace, size_t workspace_bytes,
                                      cudaStream_t stream);

/*
 * tagc_cuda_fp4_encode / tagc_cuda_fp4_decode_add / tagc_cuda_rht - as
 *   tagc_fp4_encode, tagc_fp4_decode_add and tagc_rht: the same bytes,
 *   residual and values bit for bit (one warp per block, the block staged
 *   in shared memory for the butterflies; the arithmetic is csrc/fp4.h's).
 *   Encode: a first kernel checks v (the C op's NONFINITE: NaN/Inf, or a
 *   |v| >= 2^100) into a flag in the workspace; if set,
 *   every scale byte is 255 (NaN) and every code 0, and the residual is left
 *   untouched, so the NaN reaches the owner's decoded shard.  Decode and
 *   rht need no workspace (nothing to validate but sizes).
 */
size_t tagc_cuda_fp4_encode_workspace_size(void);
tagc_status tagc_cuda_fp4_encode(uint8_t *dst, int64_t dst_capacity,
                                 void *residual, tagc_dtype residual_dtype,
                                 const void *grad, tagc_dtype grad_dtype,
                                 int64_t n, int64_t block, unsigned flags, uint64_t seed,
                                 void *workspace, size_t workspace_bytes,
                                 cudaStream_t stream);
tagc_status tagc_cuda_fp4_decode_add(float *out, int64_t n,
                                     const uint8_t *src, int64_t src_bytes,
                                     int64_t block, unsigned flags, uint64_t seed,
                                     cudaStream_t stream);
tagc_status tagc_cuda_rht(float *dst, int64_t dst_capacity, const float *src, int64_t n,
                          int64_t block, uint64_t seed, int inverse, cudaStream_t stream);

/*
 * tagc_cuda_tls_encode / tagc_cuda_tls_decode_add - as tagc_tls_encode and
 *   tagc_tls_decode_add: the same bytes, residual and values bit for bit
 *   (one warp per block of 32 for the raw scales, summed in the C op's
 *   order; the scale codes and their decoded scales are csrc/tls.h's).
 *   Encode: NaN/Inf in v (the C op's NONFINITE) sets a flag in the
 *   workspace; the message is then a NaN scale (0x7fc00000) over zero
 *   codes (every group 255, every block 15, every value 0) and the residual
 *   is left untouched, so the NaN reaches the owner's decoded shard (the C
 *   decoder and this one add NaN to every value).  Workspace: one float
 *   per block of 32 and two words.
 *   Decode: a first kernel checks the message scale's bits and every code
 *   byte; a corrupt message (the C op's CORRUPT) leaves out untouched and
 *   stores TAGC_ERR_CORRUPT in *dev_status (if not NULL).  A NaN message
 *   scale adds NaN to every value (a device NaN: its bits may differ from
 *   the C op's).  Workspace: one flag.
 *   Synchronous errors as the C ops' (ARG, DTYPE, RANGE, CAPACITY), plus
 *   ARG / CAPACITY (workspace) and CUDA.
 */
size_t tagc_cuda_tls_encode_workspace_size(int64_t n);
tagc_status tagc_cuda_tls_encode(uint8_t *dst, int64_t dst_capacity,
                                 void *residual, tagc_dtype residual_dtype,
                                 const void *grad, tagc_dtype grad_dtype, int64_t n,
                                 void *workspace, size_t workspace_bytes,
                                 cudaStream_t stream);
size_t tagc_cuda_tls_decode_add_workspace_size(void);
tagc_status tagc_cuda_tls_decode_add(float *out, int64_t n,
                                     const uint8_t *src, int64_t src_bytes,
                                     int32_t *dev_status,
                                     void *workspace, size_t workspace_bytes,
                                     cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TAGC_CUDA_H */
