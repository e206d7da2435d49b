/*
 * quant.c - block quantization with error feedback (tagc.h, tagc_quant_*),
 * the codec of the `quant` transport.  The per-value arithmetic (scale, code,
 * digit, validity) is tagc_portable.h's, shared with cuda/quant.cu, and the
 * per-block sum of |v| is taken in the order the CUDA kernel's warp takes it,
 * so both write the same bytes.
 */
#include <float.h>
#include <math.h>

#include "tagc_checks.h"
#include "tagc_internal.h"

/* Scale of the block [o, o + len) of v; returns 0 when v holds NaN/Inf there.
 * The sum of |v| runs in 32 strided partial sums (double), then a pairwise
 * tree: what a warp does with one lane per partial sum and shuffles.  (The
 * inner loop over 32 lanes vectorizes.) */
TAGC_AI int block_scale(float *scale, const void *g, int gd, const void *r, int rd,
                        int64_t o, int64_t len, int format)
{
    double lane[32] = {0};
    float m = 0.0f;
    int finite = 1;
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        for (int j = 0; j < 32; j++) {
            float a = fabsf(load_v(g, gd, r, rd, o + i + j));
            finite &= a <= FLT_MAX; /* false for NaN too */
            m = a > m ? a : m;
            if (tagc_q_uses_sum(format))
                lane[j] += (double)a;
        }
    }
    for (; i < len; i++) {
        float a = fabsf(load_v(g, gd, r, rd, o + i));
        finite &= a <= FLT_MAX;
        m = a > m ? a : m;
        if (tagc_q_uses_sum(format))
            lane[i & 31] += (double)a;
    }
    if (!finite)
        return 0;
    for (int off = 16; off > 0; off >>= 1)
        for (int j = 0; j < off; j++)
            lane[j] += lane[j + off];
    *scale = tagc_q_scale(format, lane[0], m, len);
    return 1;
}

/* Values per chunk of block_encode: a multiple of every format's codes per
 * byte (8, 5, 2, 1), so each chunk's codes start on a byte boundary. */
#define CHUNK 320

/* Codes of the n values [o, o + n) under scale s (inv = tagc_q_inv(s)) as
 * digits (tagc_q_digit) into d, and the residual v - q * s (what the owner
 * does not get) back in place.  Elementwise: the loop vectorizes. */
TAGC_AI void encode_digits(uint8_t *d, float s, float inv, const void *g, int gd, void *r,
                           int rd, int64_t o, int n, int format)
{
    for (int i = 0; i < n; i++) {
        float v = load_v(g, gd, r, rd, o + i);
        int qi = tagc_q_code(format, v, inv);
        d[i] = (uint8_t)tagc_q_digit(format, qi);
        if (rd != DT_NONE)
            st_val(r, rd, o + i, v - (float)qi * s);
    }
}

/* The bytes of n digits into out (the first digit starts a byte), the last
 * byte's unused positions padded. */
TAGC_AI void pack_digits(uint8_t *out, const uint8_t *d, int n, int format)
{
    const int per = tagc_q_per_byte(format);
    int full = n / per, b = 0;
    for (; b < full; b++) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += d[b * per + j] * tagc_q_weight(format, j);
        out[b] = (uint8_t)byte;
    }
    if (b * per < n) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += (b * per + j < n ? d[b * per + j] : tagc_q_pad_digit(format)) *
                    tagc_q_weight(format, j);
        out[b] = (uint8_t)byte;
    }
}

/* Codes of the block [o, o + len) under scale s into `codes`, and the
 * residual back in place: per chunk, the digits then the packing. */
TAGC_AI void block_encode(uint8_t *codes, float s, const void *g, int gd, void *r,
                          int rd, int64_t o, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    const float inv = tagc_q_inv(s);
    uint8_t d[CHUNK];
    for (int64_t c = 0; c < len; c += CHUNK) {
        int n = len - c < CHUNK ? (int)(len - c) : CHUNK;
        encode_digits(d, s, inv, g, gd, r, rd, o + c, n, format);
        pack_digits(codes + c / per, d, n, format);
    }
}

/* One switch per block: each case inlines the loops above for a constant
 * format, so the per-value division by the codes per byte is a constant. */
#define BY_FORMAT(format, call)          \
    switch (format) {                    \
    case TAGC_Q_SIGN: { enum { F = TAGC_Q_SIGN }; call; } break;       \
    case TAGC_Q_TERNARY: { enum { F = TAGC_Q_TERNARY }; call; } break; \
    case TAGC_Q_INT4: { enum { F = TAGC_Q_INT4 }; call; } break;       \
    default: { enum { F = TAGC_Q_INT8 }; call; } break;                \
    }

/* One test per (grad, residual) dtype pair: each case inlines the call for
 * constant dtypes G and R, as BY_FORMAT does for the format. */
#define DT_CASE(g0, r0, call) \
    if (gd == (g0) && rd == (r0)) { enum { G = g0, R = r0 }; call; }
#define BY_DTYPES(call)                                                  \
    DT_CASE(TAGC_F32, DT_NONE, call) DT_CASE(TAGC_F32, TAGC_F32, call)   \
    DT_CASE(TAGC_F32, TAGC_BF16, call) DT_CASE(TAGC_BF16, DT_NONE, call) \
    DT_CASE(TAGC_BF16, TAGC_F32, call) DT_CASE(TAGC_BF16, TAGC_BF16, call)

/* encode_pass##S: both passes for one (grad, residual) dtype pair with
 * block_scale##S and block_encode##S, returning 0 on NaN/Inf (pass 1 finds
 * every scale before the residual changes, so NaN/Inf anywhere leaves it
 * untouched); encode_dtypes##S: its specialisation for the dtypes at hand. */
#define DEFINE_ENCODE(S, INLINE, FN)                                                    \
    INLINE int encode_pass##S(uint8_t *dst, const void *g, int gd, void *r, int rd,    \
                              int64_t n, int format, int64_t block)                    \
    {                                                                                   \
        int64_t rec = tagc_q_record_bytes(block, format);                               \
        for (int64_t o = 0, b = 0; o < n; o += block, b++) {                            \
            int64_t len = n - o < block ? n - o : block;                                \
            float s = 0.0f;                                                             \
            int ok = 0;                                                                 \
            BY_FORMAT(format, ok = block_scale##S(&s, g, gd, r, rd, o, len, F));        \
            if (!ok)                                                                    \
                return 0;                                                               \
            memcpy(dst + b * rec, &s, 4); /* little-endian hosts: the wire layout */    \
        }                                                                               \
        for (int64_t o = 0, b = 0; o < n; o += block, b++) {                            \
            int64_t len = n - o < block ? n - o : block;                                \
            float s;                                                                    \
            memcpy(&s, dst + b * rec, 4);                                               \
            BY_FORMAT(format,                                                           \
                      block_encode##S(dst + b * rec + 4, s, g, gd, r, rd, o, len, F));  \
        }                                                                               \
        return 1;                                                                       \
    }                                                                                   \
    FN int encode_dtypes##S(uint8_t *dst, const void *g, int gd, void *r, int rd,      \
                            int64_t n, int format, int64_t block)                      \
    {                                                                                   \
        BY_DTYPES(return encode_pass##S(dst, g, G, r, R, n, format, block));             \
        return 0; /* unreachable: the dtypes were checked */                            \
    }

DEFINE_ENCODE(, TAGC_AI, static)


tagc_status tagc_quant_encode(uint8_t *dst, int64_t dst_capacity,
                              void *residual, tagc_dtype residual_dtype,
                              const void *grad, tagc_dtype grad_dtype,
                              int64_t n, tagc_qformat format, int64_t block)
{
    tagc_status st = tagc_check_quant_encode(dst, dst_capacity, residual,
                                             (int)residual_dtype, grad, (int)grad_dtype,
                                             n, (int)format, block);
    if (st != TAGC_OK || n == 0)
        return st;
    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    if (!encode_dtypes(dst, grad, (int)grad_dtype, residual, rd, n, (int)format, block))
        return TAGC_ERR_NONFINITE;
    return TAGC_OK;
}

/* Whether the len codes of one record are valid (reads only).  Byte by byte
 * with the position in the byte a constant once the loop unrolls. */
TAGC_AI int record_valid(const uint8_t *codes, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    int bad = 0;
    int64_t full = len / per, b = 0;
    for (; b < full; b++)
        for (int j = 0; j < per; j++)
            (void)tagc_q_decode(format, codes[b], j, &bad);
    for (int j = 0; b * per + j < len; j++)
        (void)tagc_q_decode(format, codes[b], j, &bad);
    return !bad;
}

/* out[0..len) += the record's values. */
TAGC_AI void record_add(float *out, const uint8_t *rec, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    const uint8_t *codes = rec + 4;
    int ignored = 0;
    float s;
    memcpy(&s, rec, 4); /* src comes off the network: no alignment assumed */
    int64_t full = len / per, b = 0;
    for (; b < full; b++)
        for (int j = 0; j < per; j++)
            out[b * per + j] += (float)tagc_q_decode(format, codes[b], j, &ignored) * s;
    for (int j = 0; b * per + j < len; j++)
        out[b * per + j] += (float)tagc_q_decode(format, codes[b], j, &ignored) * s;
}

tagc_status tagc_quant_decode_add(float *out, int64_t n,
                                  const uint8_t *src, int64_t src_bytes,
                                  tagc_qformat format, int64_t block)
{
    tagc_status st = tagc_check_quant_decode(out, n, src, src_bytes, (int)format, block);
    if (st != TAGC_OK || n == 0)
        return st;
    int fmt = (int)format;
    int64_t rec = tagc_q_record_bytes(block, fmt);
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int64_t len = n - o < block ? n - o : block;
        int ok = 0;
        BY_FORMAT(fmt, ok = record_valid(src + b * rec + 4, len, F));
        if (!ok)
            return TAGC_ERR_CORRUPT; /* checked in full before out is written */
    }
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int64_t len = n - o < block ? n - o : block;
        BY_FORMAT(fmt, record_add(out + o, src + b * rec, len, F));
    }
    return TAGC_OK;
}
