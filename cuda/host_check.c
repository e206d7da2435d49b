/*
 * host_check.c - built and run by scripts/tools/check_cuda.sh with a plain C11
 * compiler: proves tagc_cuda.h is usable from C, that every launcher links,
 * that argument errors come back synchronously with the C codec's codes
 * before any CUDA call, and that without a usable GPU a valid call reports
 * TAGC_ERR_CUDA instead of crashing.  Fake device pointers are never
 * dereferenced: every call below either fails validation or (no GPU) fails
 * in its first CUDA call.  The binding's CUDA glue, a layer above this
 * one, has its own check (tagc/_ext/cuda_module_check.c).
 */
#include <stdio.h>

#include "tagc_cuda.h"

static int passed, failed;

static void expect(const char *what, long got, long want)
{
    if (got == want) {
        passed++;
    } else {
        failed++;
        fprintf(stderr, "FAIL %s: got %ld, want %ld\n", what, got, want);
    }
}

#define EXPECT(call, want) expect(#call, (long)(call), (long)(want))

int main(void)
{
    /* Fake device addresses: only ever compared with NULL here. */
    void *d = (void *)(uintptr_t)0x100000;
    float *tau = (float *)d;
    int32_t *idx = (int32_t *)d;
    uint8_t *bm = (uint8_t *)d;
    int64_t *cnt = (int64_t *)d;
    char ws_small[8];
    cudaStream_t s = 0;

    /* Workspace queries: the sizes grow with the problem and are never 0
     * where scratch is needed. */
    size_t sel = tagc_cuda_select_kth_workspace_size(1000);
    EXPECT(sel > 2048 * 4, 1);
    EXPECT(tagc_cuda_sparsify_workspace_size(1 << 24) >
               tagc_cuda_sparsify_workspace_size(1000), 1);
    EXPECT(tagc_cuda_sketch_encode_workspace_size(1000, TAGC_F32), 0);
    EXPECT(tagc_cuda_sketch_encode_workspace_size(1000, TAGC_BF16) >= 3000 * 4, 1);
    EXPECT(tagc_cuda_peel_decode_workspace_size(1 << 20, 1000, 96) >=
               (size_t)(1 << 20) * 9 + 3000 * 8, 1);
    EXPECT(tagc_cuda_sparse_unpack_workspace_size() >= 4, 1);

    /* Argument errors, synchronously, with the C op's codes. */
    EXPECT(tagc_cuda_select_kth(NULL, d, TAGC_F32, 10, 1, d, sel, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_select_kth(tau, d, (tagc_dtype)9, 10, 1, d, sel, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_select_kth(tau, d, TAGC_F32, 10, 11, d, sel, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_select_kth(tau, d, TAGC_F32, 10, -1, d, sel, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_select_kth(tau, d, TAGC_F32, 10, 1, ws_small, sizeof ws_small, s),
           TAGC_ERR_CAPACITY);
    size_t sp = tagc_cuda_sparsify_workspace_size(100);
    EXPECT(tagc_cuda_sparsify(idx, 5, d, TAGC_F32, 5, bm, 13, NULL, TAGC_F32, d,
                              TAGC_F32, 100, 6, tau, d, sp, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_sparsify(idx, 5, d, TAGC_F32, 5, bm, 12, NULL, TAGC_F32, d,
                              TAGC_F32, 100, 5, tau, d, sp, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_sparsify(idx, 5, d, TAGC_F32, 5, bm, 13, d, (tagc_dtype)3, d,
                              TAGC_F32, 100, 5, tau, d, sp, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_sparsify(NULL, 5, d, TAGC_F32, 5, bm, 13, NULL, TAGC_F32, d,
                              TAGC_F32, 100, 5, tau, d, sp, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_lanes_pack(bm, 100, bm, 100, 3, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_lanes_pack(bm, 49, bm, 100, 4, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_lanes_unpack(bm, 13, bm, 24, 100, 2, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_lanes_unpack(bm, 12, bm, 25, 100, 2, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_bitmap_or(bm, 9, bm, 10, 2, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_bitmap_or(bm, 10, bm, -1, 2, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_popcount(NULL, bm, 10, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_popcount(cnt, bm, -1, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_sketch_encode(d, TAGC_F32, 29, idx, d, TAGC_F32, 3, 100, 10,
                                   1, NULL, NULL, 0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_sketch_encode(d, TAGC_F32, 30, idx, d, TAGC_F32, 3, 100, 0,
                                   1, NULL, NULL, 0, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_sketch_encode(d, TAGC_BF16, 30, idx, d, TAGC_F32, 3, 100, 10,
                                   1, NULL, NULL, 0, s), TAGC_ERR_ARG);
    size_t pd = tagc_cuda_peel_decode_workspace_size(100, 10, 8);
    EXPECT(tagc_cuda_peel_decode(tau, 99, idx, 4, cnt, d, TAGC_F32, bm, 100, 10, 1,
                                 1, 8, d, pd, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_peel_decode(tau, 100, idx, 4, cnt, d, TAGC_F32, bm, 100, 10, 1,
                                 1, 0, d, pd, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_peel_decode(tau, 100, idx, 4, cnt, d, TAGC_F32, bm, 100, 10, 1,
                                 1, 8, d, pd - 1, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_peel_decode(tau, 100, NULL, 4, cnt, d, TAGC_F32, bm, 100, 10, 1,
                                 1, 8, d, pd, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_sparse_pack(bm, 47, idx, d, TAGC_BF16, 8, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_sparse_pack(bm, 48, idx, d, (tagc_dtype)2, 8, s), TAGC_ERR_DTYPE);
    /* k * 6 would overflow int64: refused before any size arithmetic, as in C */
    EXPECT(tagc_cuda_sparse_pack(bm, INT64_MAX, idx, d, TAGC_BF16, INT64_MAX / 4, s),
           TAGC_ERR_RANGE);
    size_t su = tagc_cuda_sparse_unpack_workspace_size();
    EXPECT(tagc_cuda_sparse_unpack(tau, 100, bm, INT64_MAX, INT64_MAX / 4, TAGC_BF16,
                                   NULL, d, su, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_sparse_unpack(tau, 100, bm, 47, 8, TAGC_BF16, NULL, d, su, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_sparse_unpack(tau, 100, bm, 48, 8, TAGC_BF16, NULL, NULL, 0, s),
           TAGC_ERR_ARG);
    size_t sq = tagc_cuda_quant_encode_workspace_size();
    EXPECT(sq >= 4 && tagc_cuda_quant_decode_add_workspace_size() >= 4, 1);
    /* 100 int4 values in blocks of 64: 2 records, 4 + 32 and 4 + 18 bytes */
    EXPECT(tagc_cuda_quant_encode(bm, 57, NULL, TAGC_F32, d, TAGC_F32, 100, TAGC_Q_INT4, 64,
                                  d, sq, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_quant_encode(bm, 58, NULL, TAGC_F32, d, TAGC_F32, 100,
                                  (tagc_qformat)3, 64, d, sq, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_quant_encode(bm, 58, NULL, TAGC_F32, d, TAGC_F32, 100, TAGC_Q_INT4, 0,
                                  d, sq, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_quant_encode(bm, 58, d, (tagc_dtype)4, d, TAGC_F32, 100, TAGC_Q_INT4, 64,
                                  d, sq, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_quant_encode(NULL, 58, NULL, TAGC_F32, d, TAGC_F32, 100, TAGC_Q_INT4, 64,
                                  d, sq, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_quant_encode(bm, 58, NULL, TAGC_F32, d, TAGC_F32, 100, TAGC_Q_INT4, 64,
                                  ws_small, 0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_quant_decode_add(tau, 100, bm, 57, TAGC_Q_INT4, 64, NULL, d, sq, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_quant_decode_add(tau, 100, bm, 58, TAGC_Q_INT4, 64, NULL, NULL, 0, s),
           TAGC_ERR_ARG);
    /* one unit of 2 shards of 64 int4 values: rows of 4 + 32 bytes, residual codes 72 */
#define UNIT_ENC(cap, rbytes, shard, block, factor, counts)                                 \
    tagc_cuda_quant_unit_encode(bm, cap, bm, rbytes, d, TAGC_F32, shard, 2, 0, TAGC_Q_INT4, \
                                TAGC_Q_INT4, block, factor, counts, NULL, idx, s)
    EXPECT(UNIT_ENC(71, 72, 64, 64, 0.5f, cnt), TAGC_ERR_CAPACITY);
    EXPECT(UNIT_ENC(72, 71, 64, 64, 0.5f, cnt), TAGC_ERR_RANGE);
    EXPECT(UNIT_ENC(72, 72, 64, 48, 0.5f, cnt), TAGC_ERR_RANGE);
    EXPECT(UNIT_ENC(72, 72, 64, 64, 1.5f, cnt), TAGC_ERR_RANGE);
    EXPECT(UNIT_ENC(72, 72, 64, 64, 0.5f, NULL), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_quant_unit_decode(tau, TAGC_F32, 64, bm, 71, d, TAGC_F32, 2, 0,
                                       TAGC_Q_INT4, 64, 1.0f, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_quant_unit_decode(tau, TAGC_F32, 64, bm, 72, d, TAGC_F32, 2, 0,
                                       TAGC_Q_INT4, 64, 0.0f, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_quant_unit_decode(tau, TAGC_F32, 64, bm, 72, d, TAGC_F32, 2, 2,
                                       TAGC_Q_INT4, 64, 1.0f, s), TAGC_ERR_RANGE);
    /* wq: 100 values in one segment (a device table: never read here) */
    int64_t *segs = cnt;
    size_t sw = tagc_cuda_wq_encode_workspace_size(1);
    EXPECT(sw >= 24 && tagc_cuda_wq_decode_workspace_size(1 << 20) > sw, 1);
    EXPECT(tagc_cuda_wq_encode(bm, 58, d, TAGC_F32, 100, segs, 1, TAGC_Q_TERNARY, 64, NULL,
                               d, sw, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_wq_encode(bm, 58, d, TAGC_F32, 100, segs, 1, TAGC_Q_INT4, 0, NULL, d, sw,
                               s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_wq_encode(bm, 58, d, TAGC_F32, 100, NULL, 1, TAGC_Q_INT4, 64, NULL, d,
                               sw, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_encode(bm, 58, d, (tagc_dtype)2, 100, segs, 1, TAGC_Q_INT4, 64, NULL,
                               d, sw, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_wq_encode(bm, 58, d, TAGC_F32, 100, segs, 0, TAGC_Q_INT4, 64, NULL, d,
                               sw, s), TAGC_ERR_RANGE); /* an empty table sums to 0 */
    EXPECT(tagc_cuda_wq_decode(tau, TAGC_F32, 100, bm, 58, segs, 1, TAGC_Q_INT8, 64, NULL,
                               NULL, 0, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_decode(tau, TAGC_F32, 100, bm, 58, segs, 1, TAGC_Q_INT8, 64, NULL,
                               ws_small, 0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_wq_decode(tau, TAGC_F32, 0, NULL, 0, NULL, 0, TAGC_Q_INT8, 64, NULL, d,
                               sw, s), TAGC_OK); /* nothing to enqueue */
    /* wq_delta: wq's checks, and the pointers it adds (sent, base; ref) */
    size_t se = tagc_cuda_wq_delta_encode_workspace_size(1);
    size_t sd = tagc_cuda_wq_delta_decode_workspace_size(1);
    EXPECT(se >= 24 && sd >= 24, 1);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, d, TAGC_F32, 100, segs, 1, TAGC_Q_TERNARY,
                                     64, NULL, d, se, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, NULL, d, TAGC_F32, 100, segs, 1, TAGC_Q_INT4,
                                     64, NULL, d, se, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, NULL, TAGC_F32, 100, segs, 1, TAGC_Q_INT4,
                                     64, NULL, d, se, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_delta_encode(NULL, 1, NULL, NULL, NULL, TAGC_F32, 0, NULL, 0,
                                     TAGC_Q_INT4, 64, NULL, d, se, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, d, (tagc_dtype)2, 100, segs, 1, TAGC_Q_INT4,
                                     64, NULL, d, se, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, d, TAGC_F32, 100, segs, 0, TAGC_Q_INT4, 64,
                                     NULL, d, se, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, d, TAGC_F32, 100, segs, 1, TAGC_Q_INT4, 64,
                                     NULL, ws_small, 0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_wq_delta_decode(tau, NULL, TAGC_F32, 100, bm, 59, segs, 1, TAGC_Q_INT4,
                                     64, NULL, d, sd, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_delta_decode(tau, tau, TAGC_F32, 0, NULL, 1, NULL, 0, TAGC_Q_INT4, 64,
                                     NULL, d, sd, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_wq_delta_decode(tau, tau, TAGC_F32, 100, bm, 59, segs, 1, TAGC_Q_INT8, 0,
                                     NULL, d, sd, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_wq_delta_decode(tau, tau, TAGC_F32, 100, bm, 59, segs, 1, TAGC_Q_INT4,
                                     64, NULL, ws_small, 0, s), TAGC_ERR_CAPACITY);
    /* 2 coded pairs of 10: EF (l = 2) 1 + 1 + 8 bytes, bitmap 2 + 8 */
    EXPECT(tagc_cuda_pairs_pack_workspace_size(), 0);
    size_t pu = tagc_cuda_pairs_unpack_add_workspace_size(10, 2);
    EXPECT(pu >= 16 && tagc_cuda_pairs_unpack_add_workspace_size(1 << 24, 1 << 20) > pu, 1);
    EXPECT(tagc_cuda_pairs_pack(bm, 9, idx, d, TAGC_F32, 2, 10, TAGC_PAIRS_EF, NULL, NULL, 0,
                                s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_pairs_pack(bm, 10, idx, d, TAGC_F32, 2, 10, (tagc_coding)4, NULL, NULL,
                                0, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_pairs_pack(bm, 10, idx, d, (tagc_dtype)2, 2, 10, TAGC_PAIRS_EF, NULL,
                                NULL, 0, s), TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_pairs_pack(bm, 10, NULL, d, TAGC_F32, 2, 10, TAGC_PAIRS_EF, NULL, NULL,
                                0, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_pairs_unpack_add(tau, 10, bm, 11, 2, TAGC_F32, TAGC_PAIRS_BITMAP, NULL,
                                      d, pu, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_pairs_unpack_add(tau, 10, bm, 10, 2, TAGC_F32, TAGC_PAIRS_EF, NULL, d,
                                      pu - 1, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_pairs_unpack_add(tau, 10, bm, 10, 2, TAGC_F32, TAGC_PAIRS_EF, NULL, NULL,
                                      0, s), TAGC_ERR_ARG);

    size_t sf = tagc_cuda_fp4_encode_workspace_size();
    EXPECT(sf >= 4, 1);
    EXPECT(tagc_cuda_fp4_encode(bm, 53, NULL, TAGC_F32, d, TAGC_F32, 100, 32, 0, 1, d, sf, s),
           TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_fp4_encode(bm, 54, NULL, TAGC_F32, d, TAGC_F32, 100, 24, 0, 1, d, sf, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_fp4_encode(bm, 54, NULL, TAGC_F32, d, TAGC_F32, 100, 32, 8, 1, d, sf, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_fp4_encode(bm, 54, NULL, TAGC_F32, d, TAGC_F32, 100, 32, 0, 1, ws_small,
                                0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_fp4_decode_add(tau, 100, bm, 53, 32, TAGC_FP4_ROTATE, 1, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_rht(tau, 99, tau, 100, 32, 1, 0, s), TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_rht(NULL, 100, tau, 100, 32, 1, 0, s), TAGC_ERR_ARG);
    /* tls: 100 values are 4 blocks in 1 group, 4 + 1 + 2 + 20 = 27 bytes */
    size_t st = tagc_cuda_tls_encode_workspace_size(100);
    size_t sl = tagc_cuda_tls_decode_add_workspace_size();
    EXPECT(st >= 8 + 4 * 4 && sl >= 4, 1);
    EXPECT(tagc_cuda_tls_encode_workspace_size(1 << 20) >= 8 + ((size_t)1 << 15) * 4, 1);
    EXPECT(tagc_cuda_tls_encode(bm, 26, NULL, TAGC_F32, d, TAGC_F32, 100, d, st, s),
           TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_tls_encode(bm, 27, NULL, TAGC_F32, d, (tagc_dtype)5, 100, d, st, s),
           TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_tls_encode(bm, 27, d, (tagc_dtype)3, d, TAGC_F32, 100, d, st, s),
           TAGC_ERR_DTYPE);
    EXPECT(tagc_cuda_tls_encode(NULL, 27, NULL, TAGC_F32, d, TAGC_F32, 100, d, st, s),
           TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_encode(bm, 27, NULL, TAGC_F32, NULL, TAGC_F32, 100, d, st, s),
           TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_encode(bm, INT64_MAX, NULL, TAGC_F32, d, TAGC_F32, TAGC_MAX_N + 1,
                                d, st, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_tls_encode(bm, 27, NULL, TAGC_F32, d, TAGC_F32, -1, d, st, s),
           TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_tls_encode(bm, 27, NULL, TAGC_F32, d, TAGC_F32, 100, ws_small, 0, s),
           TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_tls_encode(bm, 27, NULL, TAGC_F32, d, TAGC_F32, 100, NULL, st, s),
           TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_encode(NULL, 0, NULL, TAGC_F32, NULL, TAGC_F32, 0, d, st, s),
           TAGC_OK); /* nothing to enqueue */
    EXPECT(tagc_cuda_tls_decode_add(tau, 100, bm, 26, NULL, d, sl, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_tls_decode_add(tau, 100, bm, 28, NULL, d, sl, s), TAGC_ERR_RANGE);
    EXPECT(tagc_cuda_tls_decode_add(NULL, 100, bm, 27, NULL, d, sl, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_decode_add(tau, 100, NULL, 27, NULL, d, sl, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_decode_add(tau, 100, bm, 27, NULL, ws_small, 0, s),
           TAGC_ERR_CAPACITY);
    EXPECT(tagc_cuda_tls_decode_add(tau, 100, bm, 27, NULL, NULL, 0, s), TAGC_ERR_ARG);
    EXPECT(tagc_cuda_tls_decode_add(NULL, 0, NULL, 0, NULL, d, sl, s), TAGC_OK);

    /* No usable GPU: a valid call must fail cleanly in its first CUDA call. */
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess)
        devices = 0;
    if (devices == 0) {
        EXPECT(tagc_cuda_popcount(cnt, bm, 100, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_select_kth(tau, d, TAGC_F32, 10, 1, d, sel, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_lanes_pack(bm, 100, bm, 100, 8, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_peel_decode(tau, 100, idx, 4, cnt, d, TAGC_F32, bm, 100, 10,
                                     1, 1, 8, d, pd, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_quant_encode(bm, 58, NULL, TAGC_F32, d, TAGC_F32, 100, TAGC_Q_INT4,
                                      64, d, sq, s), TAGC_ERR_CUDA);
        EXPECT(UNIT_ENC(72, 72, 64, 64, 0.5f, cnt), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_quant_unit_decode(tau, TAGC_F32, 64, bm, 72, d, TAGC_F32, 2, 0,
                                           TAGC_Q_INT4, 64, 1.0f, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_pairs_pack(bm, 10, idx, d, TAGC_F32, 2, 10, TAGC_PAIRS_EF, NULL,
                                    NULL, 0, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_wq_encode(bm, 58, d, TAGC_F32, 100, segs, 1, TAGC_Q_INT4, 64, NULL,
                                   d, sw, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_pairs_unpack_add(tau, 10, bm, 10, 2, TAGC_F32, TAGC_PAIRS_EF, NULL,
                                          d, pu, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_fp4_encode(bm, 54, NULL, TAGC_F32, d, TAGC_F32, 100, 32,
                                    TAGC_FP4_ROTATE, 1, d, sf, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_fp4_decode_add(tau, 100, bm, 54, 32, 0, 1, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_rht(tau, 100, tau, 100, 32, 1, 0, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_tls_encode(bm, 27, d, TAGC_BF16, d, TAGC_F32, 100, d, st, s),
               TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_tls_decode_add(tau, 100, bm, 27, NULL, d, sl, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_wq_delta_encode(bm, 59, d, d, d, TAGC_F32, 100, segs, 1, TAGC_Q_INT4,
                                         64, NULL, d, se, s), TAGC_ERR_CUDA);
        EXPECT(tagc_cuda_wq_delta_decode(tau, tau, TAGC_F32, 0, bm, 1, NULL, 0, TAGC_Q_INT4,
                                         64, NULL, d, sd, s), TAGC_ERR_CUDA);
    } else {
        printf("host_check: %d CUDA device(s) present, no-GPU checks skipped\n",
               devices);
    }
    printf("host_check: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
