/*
 * wq_blocks.h - the per-block passes of a wq message (tagc.h's tagc_wq_*),
 * shared by csrc/wq.c (the weights) and csrc/wq_delta.c (the weights'
 * change): the block iterator, the records' encoder and the message check.
 * Internal: not installed, not part of the contract.
 */
#ifndef TAGC_WQ_BLOCKS_H
#define TAGC_WQ_BLOCKS_H

#include <string.h>

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

/* Value i of what is coded: src_i, or (base != NULL, the weights' change)
 * src_i - base_i in fp32. */
TAGC_AI float val_at(const void *src, const void *base, int sd, int64_t i)
{
    float v = ld_val(src, sd, i);
    return base != NULL ? v - ld_val(base, sd, i) : v;
}

/* Magnitude pattern of value i (< TAGC_WQ_INF_BITS iff finite), read as an
 * integer: an integer max vectorizes where a float one needs fast-math. */
TAGC_AI int32_t mag_at(const void *src, const void *base, int sd, int64_t i)
{
    uint32_t u;
    if (base != NULL) {
        float v = val_at(src, base, sd, i);
        memcpy(&u, &v, 4);
    } else if (sd == TAGC_F32) {
        memcpy(&u, (const float *)src + i, 4);
    } else {
        u = (uint32_t)((const uint16_t *)src)[i] << 16;
    }
    return (int32_t)(u & 0x7fffffffu);
}

TAGC_AI uint32_t block_max_bits(const void *src, const void *base, int sd, int64_t o,
                                int64_t len)
{
    int32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        int32_t a = mag_at(src, base, sd, o + i);
        m = a > m ? a : m;
    }
    return (uint32_t)m;
}

/* Digit of value i's code under inv = 1 / s. */
TAGC_AI unsigned digit_at(const void *src, const void *base, int sd, int64_t i, float inv,
                          int format)
{
    return tagc_q_digit(format, tagc_wq_code(val_at(src, base, sd, i), inv));
}

/* The packed codes of the block [o, o + len) under inv; a last byte's unused
 * nibble gets the pad digit (the code of 0). */
TAGC_AI void block_codes(uint8_t *codes, const void *src, const void *base, int sd, int64_t o,
                         int64_t len, float inv, int format)
{
    const int per = tagc_q_per_byte(format);
    int64_t full = len / per, b = 0;
    for (; b < full; b++) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += digit_at(src, base, sd, o + b * per + j, inv, format) *
                    tagc_q_weight(format, j);
        codes[b] = (uint8_t)byte;
    }
    if (b * per < len) /* int4, odd len: one value and a pad nibble */
        codes[b] = (uint8_t)(digit_at(src, base, sd, o + b * per, inv, format) +
                             tagc_q_pad_digit(format) * tagc_q_weight(format, 1));
}

/* One record: a max pass for the scale (or the sentinel), then the codes. */
TAGC_AI void encode_block(uint8_t *rec, const void *src, const void *base, int sd, int64_t o,
                          int64_t len, int format)
{
    uint32_t bits = tagc_wq_scale_bits(format, block_max_bits(src, base, sd, o, len));
    float s;
    memcpy(rec, &bits, 4); /* little-endian hosts: the wire layout */
    if (bits == TAGC_WQ_NONFINITE) {
        memset(rec + 4, tagc_wq_zero_byte(format), (size_t)(tagc_q_record_bytes(len, format) - 4));
        return;
    }
    memcpy(&s, &bits, 4);
    block_codes(rec + 4, src, base, sd, o, len, tagc_q_inv(s), format);
}

/* Every record; with sent != NULL each block's values are also copied
 * there once coded (while they are in cache). */
TAGC_AI void encode_pass(uint8_t *dst, const void *src, const void *base, void *sent, int sd,
                         const int64_t *seg, int64_t nseg, int format, int64_t block)
{
    const size_t es = sd == TAGC_F32 ? 4 : 2;
    int64_t o, len;
    for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {
        encode_block(dst, src, base, sd, o, len, format);
        if (sent != NULL)
            memcpy((char *)sent + o * es, (const char *)src + o * es, (size_t)len * es);
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

#endif /* TAGC_WQ_BLOCKS_H */
