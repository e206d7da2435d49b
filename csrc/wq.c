/*
 * wq.c - quantized weight gather (tagc.h, tagc_wq_*): one rank's shard of
 * parameters as int8/int4 block records, segment by segment, decoded by
 * every rank.  The per-block arithmetic (scale bits and the sentinel, codes,
 * digits, what a receiver accepts as a scale) is tagc_portable.h's, shared
 * with cuda/wq.cu, so both write the same bytes.
 */
#include "tagc_checks.h"
#include "tagc_internal.h"

/* The blocks of a message in wire order: segment by segment, blocks of
 * `block` values, the last one of a segment possibly shorter, empty
 * segments skipped.  Per-segment work, so the per-value loops see plain
 * (offset, length) pairs. */
typedef struct {
    const int64_t *seg;
    int64_t nseg, next_seg, o, end, block;
} blocks_t;

TAGC_AI blocks_t blocks_start(const int64_t *seg, int64_t nseg, int64_t block)
{
    blocks_t it = {seg, nseg, 0, 0, 0, block};
    return it;
}

/* The next block [*o, *o + *len); 0 after the last one. */
TAGC_AI int blocks_next(blocks_t *it, int64_t *o, int64_t *len)
{
    while (it->o == it->end) {
        if (it->next_seg == it->nseg)
            return 0;
        it->end += it->seg[it->next_seg++];
    }
    *o = it->o;
    *len = it->end - it->o < it->block ? it->end - it->o : it->block;
    it->o += *len;
    return 1;
}

/* Magnitude pattern of value i (< TAGC_WQ_INF_BITS iff finite), read as an
 * integer: an integer max vectorizes where a float one needs fast-math. */
TAGC_AI int32_t mag_at(const void *src, int sd, int64_t i)
{
    uint32_t u;
    if (sd == TAGC_F32)
        memcpy(&u, (const float *)src + i, 4);
    else
        u = (uint32_t)((const uint16_t *)src)[i] << 16;
    return (int32_t)(u & 0x7fffffffu);
}

TAGC_AI uint32_t block_max_bits(const void *src, int sd, int64_t o, int64_t len)
{
    int32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        int32_t a = mag_at(src, sd, o + i);
        m = a > m ? a : m;
    }
    return (uint32_t)m;
}

/* Digit of value i's code under inv = 1 / s. */
TAGC_AI unsigned digit_at(const void *src, int sd, int64_t i, float inv, int format)
{
    return tagc_q_digit(format, tagc_wq_code(ld_val(src, sd, i), inv));
}

/* The packed codes of the block [o, o + len) under inv; a last byte's unused
 * nibble gets the pad digit (the code of 0). */
TAGC_AI void block_codes(uint8_t *codes, const void *src, int sd, int64_t o, int64_t len,
                         float inv, int format)
{
    const int per = tagc_q_per_byte(format);
    int64_t full = len / per, b = 0;
    for (; b < full; b++) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += digit_at(src, sd, o + b * per + j, inv, format) * tagc_q_weight(format, j);
        codes[b] = (uint8_t)byte;
    }
    if (b * per < len) /* int4, odd len: one value and a pad nibble */
        codes[b] = (uint8_t)(digit_at(src, sd, o + b * per, inv, format) +
                             tagc_q_pad_digit(format) * tagc_q_weight(format, 1));
}

/* One record: a max pass for the scale (or the sentinel), then the codes. */
TAGC_AI void encode_block(uint8_t *rec, const void *src, int sd, int64_t o, int64_t len,
                          int format)
{
    uint32_t bits = tagc_wq_scale_bits(format, block_max_bits(src, sd, o, len));
    float s;
    memcpy(rec, &bits, 4); /* little-endian hosts: the wire layout */
    if (bits == TAGC_WQ_NONFINITE) {
        memset(rec + 4, tagc_wq_zero_byte(format), (size_t)(tagc_q_record_bytes(len, format) - 4));
        return;
    }
    memcpy(&s, &bits, 4);
    block_codes(rec + 4, src, sd, o, len, tagc_q_inv(s), format);
}

TAGC_AI void encode_pass(uint8_t *dst, const void *src, int sd, const int64_t *seg,
                         int64_t nseg, int format, int64_t block)
{
    int64_t o, len;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        encode_block(dst, src, sd, o, len, format);
        dst += tagc_q_record_bytes(len, format);
    }
}

/* The whole message before anything is written: -1 corrupt (a bad scale or
 * code anywhere), 1 valid but holding the sentinel, 0 valid. */
TAGC_AI int check_pass(const uint8_t *src, const int64_t *seg, int64_t nseg, int format,
                       int64_t block)
{
    int64_t o, len;
    int sentinel = 0;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        uint32_t bits;
        memcpy(&bits, src, 4);
        int kind = tagc_wq_scale_kind(format, bits);
        if (kind < 0 || !q_codes_valid(src + 4, len, format))
            return -1;
        sentinel |= kind;
        src += tagc_q_record_bytes(len, format);
    }
    return sentinel;
}

TAGC_AI void write_pass(void *out, int od, const uint8_t *src, const int64_t *seg,
                        int64_t nseg, int format, int64_t block)
{
    int64_t o, len;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        q_record_out(out, od, 0, o, src, len, format);
        src += tagc_q_record_bytes(len, format);
    }
}

/* One instance of `call` per (format, dtype) pair, both constants in it (F, D). */
#define BY_WQ(format, dtype, call)                                                     \
    do {                                                                               \
        if ((format) == TAGC_Q_INT8 && (dtype) == TAGC_F32) {                          \
            enum { F = TAGC_Q_INT8, D = TAGC_F32 }; call;                              \
        } else if ((format) == TAGC_Q_INT8) {                                          \
            enum { F = TAGC_Q_INT8, D = TAGC_BF16 }; call;                             \
        } else if ((dtype) == TAGC_F32) {                                              \
            enum { F = TAGC_Q_INT4, D = TAGC_F32 }; call;                              \
        } else {                                                                       \
            enum { F = TAGC_Q_INT4, D = TAGC_BF16 }; call;                             \
        }                                                                              \
    } while (0)

/* The passes over the shard, dispatched once per call (AVX2 clones: the
 * code pass is compute-bound with SSE2). */
TAGC_HOT_CLONES static void encode_all(uint8_t *dst, const void *src, int sd,
                                       const int64_t *seg, int64_t nseg, int format,
                                       int64_t block)
{
    BY_WQ(format, sd, encode_pass(dst, src, D, seg, nseg, F, block));
}

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
    encode_all(dst, src, (int)src_dtype, seg, nseg, (int)format, block);
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
