/*
 * wq.c - quantized weight gather (tagc.h, tagc_wq_*): one rank's shard of
 * parameters as int8/int4 block records, segment by segment, decoded by
 * every rank.  The per-block arithmetic (scale bits and the sentinel, codes,
 * digits, what a receiver accepts as a scale) is tagc_portable.h's, shared
 * with cuda/wq.cu, so both write the same bytes.
 */
#include "wq_blocks.h"

TAGC_AI void write_pass(void *out, int od, const uint8_t *src, const int64_t *seg,
                        int64_t nseg, int format, int64_t block)
{
    int64_t o, len;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        q_record_out(out, od, 0, o, src, len, format);
        src += tagc_q_record_bytes(len, format);
    }
}

/* The decoder's passes over the shard, dispatched once per call (AVX2
 * clones; the encoder's dispatch is wq_blocks.h's encode_records). */
TAGC_HOT_CLONES static int check_all(const uint8_t *src, const int64_t *seg, int64_t nseg,
                                     int format, int64_t block)
{
    int kind = 0;
    BY_WQ(format, TAGC_F32, kind = check_pass(src, seg, nseg, F, block));
    return kind;
}

TAGC_HOT_CLONES static void write_all(void *out, int od, const uint8_t *src,
                                      const int64_t *seg, int64_t nseg, int format,
                                      int64_t block)
{
    BY_WQ(format, od, write_pass(out, D, src, seg, nseg, F, block));
}

tagc_status tagc_wq_encode(uint8_t *dst, int64_t dst_capacity,
                           const void *src, tagc_dtype src_dtype, int64_t n,
                           const int64_t *seg, int64_t nseg,
                           tagc_qformat format, int64_t block)
{
    int64_t need = 0;
    tagc_status st = tagc_check_wq(dst, src, (int)src_dtype, n, seg, nseg, (int)format, block,
                                   &need);
    if (st == TAGC_OK && dst_capacity < need)
        st = TAGC_ERR_CAPACITY;
    if (st != TAGC_OK || n == 0)
        return st;
    encode_records(dst, src, NULL, NULL, (int)src_dtype, seg, nseg, (int)format, block);
    return TAGC_OK;
}

tagc_status tagc_wq_decode(void *out, tagc_dtype out_dtype, int64_t n,
                           const uint8_t *src, int64_t src_bytes,
                           const int64_t *seg, int64_t nseg,
                           tagc_qformat format, int64_t block)
{
    int64_t need = 0;
    tagc_status st = tagc_check_wq(out, src, (int)out_dtype, n, seg, nseg, (int)format, block,
                                   &need);
    if (st == TAGC_OK && src_bytes != need)
        st = TAGC_ERR_RANGE;
    if (st != TAGC_OK || n == 0)
        return st;
    int kind = check_all(src, seg, nseg, (int)format, block);
    if (kind != 0) /* every receiver sees these bytes: all refuse alike */
        return kind < 0 ? TAGC_ERR_CORRUPT : TAGC_ERR_NONFINITE;
    write_all(out, (int)out_dtype, src, seg, nseg, (int)format, block);
    return TAGC_OK;
}
