/*
 * wq_blocks.h - the per-block passes of a wq message (tagc.h's tagc_wq_*),
 * shared by csrc/wq.c (the weights) and csrc/wq_delta.c (the weights'
 * change): the block iterator, the records' encoder and the message check.
 * Internal: not installed, not part of the contract.
 */
#ifndef TAGC_WQ_BLOCKS_H
#define TAGC_WQ_BLOCKS_H

#include <string.h>

#include "quant_avx2.h"
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

#ifdef TAGC_Q_AVX2
/* Eight values of what is coded (val_at), from index i. */
TAGC_AVX2 __m256 val8(const void *src, const void *base, int sd, int64_t i)
{
    __m256 v = ld8(src, sd, i);
    return base != NULL ? _mm256_sub_ps(v, ld8(base, sd, i)) : v;
}

/* Values of a block whose differences encode_block_avx2 keeps between its
 * passes (the gathers' blocks are at most 256); a longer block computes
 * them again. */
#define WQ_KEEP 256

/* encode_block with AVX2, the same bytes: the max of the magnitude patterns
 * as integers (block_max_bits), then the codes 32 a step, packed as encode32
 * packs them; the block's last values (fewer than 32) through block_codes.
 * A code is cvtps's conversion of v * inv, which rounds half to even in the
 * default rounding mode as tagc_wq_code's magic number does (neither
 * clamps: see tagc_wq_code).  The second pass reads the block from the
 * cache, or its differences from a buffer. */
TAGC_AVX2 void encode_block_avx2(uint8_t *rec, const void *src, const void *base, int sd,
                                 int64_t o, int64_t len, int format)
{
    __m256i mx = _mm256_setzero_si256();
    float t[WQ_KEEP];
    const int keep = base != NULL && len <= WQ_KEEP;
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        for (int k = 0; k < 4; k++) {
            __m256 v = val8(src, base, sd, o + i + 8 * k);
            if (keep)
                _mm256_storeu_ps(t + i + 8 * k, v);
            mx = _mm256_max_epu32(mx, mag8(v));
        }
    }
    uint32_t m = hmax8(mx), tail = block_max_bits(src, base, sd, o + i, len - i);
    uint32_t bits = tagc_wq_scale_bits(format, m > tail ? m : tail);
    float s;
    memcpy(rec, &bits, 4);
    if (bits == TAGC_WQ_NONFINITE) {
        memset(rec + 4, tagc_wq_zero_byte(format), (size_t)(tagc_q_record_bytes(len, format) - 4));
        return;
    }
    memcpy(&s, &bits, 4);
    const float inv = tagc_q_inv(s);
    const __m256 vinv = _mm256_set1_ps(inv);
    uint8_t *codes = rec + 4;
    for (i = 0; i + 32 <= len; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(keep ? _mm256_loadu_ps(t + i + 8 * k)
                                                         : val8(src, base, sd, o + i + 8 * k),
                                                    vinv));
        __m256i b = bytes32(q[0], q[1], q[2], q[3]);
        if (format == TAGC_Q_INT8) {
            _mm256_storeu_si256((__m256i *)(codes + i), b);
        } else {
            _mm_storeu_si128((__m128i *)(codes + i / 2), int4_bytes16(b));
        }
    }
    if (i < len)
        block_codes(codes + i / tagc_q_per_byte(format), src, base, sd, o + i, len - i, inv,
                    format);
}
#endif

/* sent = src up to byte `end` (of the shard), from byte *done on; the
 * generic encoder's copy, block by block (`last` changes nothing here). */
TAGC_AI void copy_upto(char *sent, const char *src, size_t *done, size_t end, int last)
{
    (void)last;
    memcpy(sent + *done, src + *done, end - *done);
    *done = end;
}

#ifdef TAGC_Q_AVX2
/* copy_upto with non-temporal stores, up to the last 32-byte boundary of
 * sent at or before `end` (all of it when `end` is the shard's end): the
 * copy is read back at the next step's compare only, long after the cache
 * has turned over, so its lines need not be read for ownership first (that
 * read made the copy cost as much as the rest of the encode at 2^24 fp32
 * values).  The lines of one block end in the next one's, so the stream
 * runs across blocks and only the shard's first and last partial pieces
 * are plain stores.  The caller fences once after the last copy. */
TAGC_AVX2 void copy_upto_avx2(char *sent, const char *src, size_t *done, size_t end, int last)
{
    size_t i = *done, head = (size_t)(-(uintptr_t)sent & 31u);
    if (i < head) { /* plain stores up to sent's first 32-byte boundary */
        size_t e = head < end ? head : end;
        memcpy(sent + i, src + i, e - i);
        i = e;
    }
    for (; i + 32 <= end; i += 32)
        _mm256_stream_si256((__m256i *)(sent + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    if (last) {
        memcpy(sent + i, src + i, end - i);
        i = end;
    }
    *done = i;
}
#endif

/* Every record; with sent != NULL the shard is also copied there as its
 * blocks are coded (while they are in cache).  Defined once with
 * encode_block and copy_upto and once with their AVX2 forms (S: the
 * suffix, FN: the attributes). */
#define DEFINE_ENCODE_PASS(S, FN)                                                              \
    FN void encode_pass##S(uint8_t *dst, const void *src, const void *base, void *sent,       \
                           int sd, const int64_t *seg, int64_t nseg, int format,              \
                           int64_t block)                                                     \
    {                                                                                         \
        const size_t es = sd == TAGC_F32 ? 4 : 2;                                             \
        size_t done = 0, end = 0;                                                             \
        int64_t o, len;                                                                       \
        for (blocks_t it = blocks_start(seg, nseg, block); blocks_next(&it, &o, &len);) {     \
            encode_block##S(dst, src, base, sd, o, len, format);                              \
            end = (size_t)(o + len) * es;                                                     \
            if (sent != NULL)                                                                 \
                copy_upto##S((char *)sent, (const char *)src, &done, end, 0);                 \
            dst += tagc_q_record_bytes(len, format);                                          \
        }                                                                                     \
        if (sent != NULL)                                                                     \
            copy_upto##S((char *)sent, (const char *)src, &done, end, 1);                     \
    }

DEFINE_ENCODE_PASS(, TAGC_AI)
#ifdef TAGC_Q_AVX2
DEFINE_ENCODE_PASS(_avx2, TAGC_AVX2)
#endif

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

/* The encoder, one instance per (format, dtype) pair and path: AVX2 where
 * the CPU has it, the generic loops otherwise (the same bytes; no AVX2
 * clone of them, which only a CPU without AVX2 runs). */
static void encode_generic(uint8_t *dst, const void *src, const void *base, void *sent,
                           int sd, const int64_t *seg, int64_t nseg, int format,
                           int64_t block)
{
    BY_WQ(format, sd, encode_pass(dst, src, base, sent, D, seg, nseg, F, block));
}

#ifdef TAGC_Q_AVX2
__attribute__((target("avx2"))) static void encode_avx2(uint8_t *dst, const void *src,
                                                        const void *base, void *sent, int sd,
                                                        const int64_t *seg, int64_t nseg,
                                                        int format, int64_t block)
{
    BY_WQ(format, sd, encode_pass_avx2(dst, src, base, sent, D, seg, nseg, F, block));
    if (sent != NULL)
        _mm_sfence(); /* the copy's streaming stores before anything after the call */
}
#endif

/* Every record of src (base != NULL: of src - base; sent != NULL: sent =
 * src), with the encoder for this CPU. */
static void encode_records(uint8_t *dst, const void *src, const void *base, void *sent,
                           int sd, const int64_t *seg, int64_t nseg, int format, int64_t block)
{
#ifdef TAGC_Q_AVX2
    if (__builtin_cpu_supports("avx2")) {
        encode_avx2(dst, src, base, sent, sd, seg, nseg, format, block);
        return;
    }
#endif
    encode_generic(dst, src, base, sent, sd, seg, nseg, format, block);
}

#endif /* TAGC_WQ_BLOCKS_H */
