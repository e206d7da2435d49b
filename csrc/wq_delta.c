/*
 * wq_delta.c - the weights' change as a wq message (tagc.h, tagc_wq_delta_*):
 * the owner codes src - base and remembers what it sent in the same pass;
 * a receiver adds the decoded change to its held weights and writes FSDP's
 * output in the same pass.  One pass each instead of the separate subtract,
 * encode, copy, decode, add and copy that the torch composition needs
 * (tagc/gather.py's `gather_delta`, measured on the 124M step).
 */
#include "wq_blocks.h"

/* Value i: ref_i += x (fp32 sum, one rounding to dtype d), and out_i too
 * when `copy`. */
TAGC_AI void add_one(void *restrict ref, void *restrict out, int d, int copy, int64_t i,
                     float x)
{
    float r = round_to(d, ld_val(ref, d, i) + x);
    st_val(ref, d, i, r);
    if (copy)
        st_val(out, d, i, r);
}

/* ref[o..o + len) += the record's values q * s (the fp32 product), laid out
 * as q_record_out's loops so that they vectorize; out gets them too when
 * `copy` (a constant once inlined: no per-value branch). */
TAGC_AI void record_add(void *restrict ref, void *restrict out, int d, int copy, int64_t o,
                        const uint8_t *restrict rec, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    const uint8_t *codes = rec + 4;
    int ignored = 0;
    float s;
    memcpy(&s, rec, 4); /* src comes off the network: no alignment assumed */
    int64_t full = len / per, b = 0;
    for (; b < full; b++)
        for (int j = 0; j < per; j++)
            add_one(ref, out, d, copy, o + b * per + j,
                    (float)tagc_q_decode(format, codes[b], j, &ignored) * s);
    for (int j = 0; b * per + j < len; j++)
        add_one(ref, out, d, copy, o + b * per + j,
                (float)tagc_q_decode(format, codes[b], j, &ignored) * s);
}

TAGC_AI void add_pass(void *ref, void *out, int d, int copy, const uint8_t *src,
                      const int64_t *seg, int64_t nseg, int format, int64_t block)
{
    int64_t o, len;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        record_add(ref, out, d, copy, o, src, len, format);
        src += tagc_q_record_bytes(len, format);
    }
}

TAGC_HOT_CLONES static void delta_add_all(void *ref, void *out, int d, const uint8_t *src,
                                          const int64_t *seg, int64_t nseg, int format,
                                          int64_t block)
{
    if (out == ref)
        BY_WQ(format, d, add_pass(ref, NULL, D, 0, src, seg, nseg, F, block));
    else
        BY_WQ(format, d, add_pass(ref, out, D, 1, src, seg, nseg, F, block));
}

TAGC_HOT_CLONES static int delta_check_all(const uint8_t *src, const int64_t *seg,
                                           int64_t nseg, int format, int64_t block)
{
    int kind = 0;
    BY_WQ(format, TAGC_F32, kind = check_pass(src, seg, nseg, F, block));
    return kind;
}

int64_t tagc_wq_delta_bytes(const int64_t *seg, int64_t nseg, tagc_qformat format,
                            int64_t block)
{
    int64_t b = tagc_wq_bytes(seg, nseg, format, block);
    return b < 0 ? -1 : b + 1;
}

tagc_status tagc_wq_delta_encode(uint8_t *dst, int64_t dst_capacity,
                                 const void *src, void *sent, const void *base,
                                 tagc_dtype dtype, int64_t n,
                                 const int64_t *seg, int64_t nseg,
                                 tagc_qformat format, int64_t block)
{
    int64_t need = 0;
    tagc_status st = tagc_check_wq(dst, src, (int)dtype, n, seg, nseg, (int)format, block,
                                   &need);
    if (st == TAGC_OK && n > 0 && (sent == NULL || base == NULL))
        st = TAGC_ERR_ARG;
    if (st == TAGC_OK && dst == NULL)
        st = TAGC_ERR_ARG; /* the flag byte is written even for n == 0 */
    if (st == TAGC_OK && dst_capacity < need + 1)
        st = TAGC_ERR_CAPACITY;
    if (st != TAGC_OK)
        return st;
    size_t nbytes = (size_t)n * tagc_dtype_size(dtype);
    if (n == 0 || memcmp(src, sent, nbytes) == 0) {
        /* the message still travels (its size is fixed): zeros, not stale memory */
        memset(dst, 0, (size_t)need + 1);
        return TAGC_OK;
    }
    encode_records(dst, src, base, sent, (int)dtype, seg, nseg, (int)format, block);
    dst[need] = 1;
    return TAGC_OK;
}

tagc_status tagc_wq_delta_decode(void *out, void *ref, tagc_dtype dtype, int64_t n,
                                 const uint8_t *src, int64_t src_bytes,
                                 const int64_t *seg, int64_t nseg,
                                 tagc_qformat format, int64_t block)
{
    int64_t need = 0;
    tagc_status st = tagc_check_wq(out, src, (int)dtype, n, seg, nseg, (int)format, block,
                                   &need);
    if (st == TAGC_OK && ((n > 0 && ref == NULL) || src == NULL))
        st = TAGC_ERR_ARG;
    if (st == TAGC_OK && src_bytes != need + 1)
        st = TAGC_ERR_RANGE;
    if (st != TAGC_OK)
        return st;
    uint8_t flag = src[need];
    if (flag > 1)
        return TAGC_ERR_CORRUPT;
    if (n == 0)
        return TAGC_OK;
    if (flag == 0) {
        if (out != ref)
            memcpy(out, ref, (size_t)n * tagc_dtype_size(dtype));
        return TAGC_OK;
    }
    int kind = delta_check_all(src, seg, nseg, (int)format, block);
    if (kind != 0) /* every receiver sees these bytes: all refuse alike */
        return kind < 0 ? TAGC_ERR_CORRUPT : TAGC_ERR_NONFINITE;
    delta_add_all(ref, out, (int)dtype, src, seg, nseg, (int)format, block);
    return TAGC_OK;
}
