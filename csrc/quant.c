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

/* Values per chunk of block_encode: a multiple of every format's codes per
 * byte (8, 5, 2, 1), so each chunk's codes start on a byte boundary. */
#define CHUNK 320

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

/* encode_pass##S: both passes for one (grad, residual) dtype pair with
 * block_scale##S and block_encode##S, returning 0 on NaN/Inf (pass 1 finds
 * every scale before the residual changes, so NaN/Inf anywhere leaves it
 * untouched); encode_dtypes##S: its specialisation for the dtypes at hand.
 * Defined once for the generic loops and once for the AVX2 ones. */
#define DEFINE_ENCODE(S, INLINE, FN)                                                    \
    INLINE int encode_pass##S(uint8_t *dst, const void *g, int gd, void *r, int rd,    \
                              int64_t n, int format, int64_t block)                    \
    {                                                                                   \
        int64_t rec = tagc_q_record_bytes(block, format);                               \
        for (int64_t o = 0, b = 0; o < n; o += block, b++) {                            \
            int64_t len = n - o < block ? n - o : block;                                \
            float s = 0.0f;                                                             \
            int ok = 0;                                                                 \
            BY_QFORMAT(format, ok = block_scale##S(&s, g, gd, r, rd, o, len, F));        \
            if (!ok)                                                                    \
                return 0;                                                               \
            memcpy(dst + b * rec, &s, 4); /* little-endian hosts: the wire layout */    \
        }                                                                               \
        for (int64_t o = 0, b = 0; o < n; o += block, b++) {                            \
            int64_t len = n - o < block ? n - o : block;                                \
            float s;                                                                    \
            memcpy(&s, dst + b * rec, 4);                                               \
            BY_QFORMAT(format,                                                           \
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

/*
 * The encoder with AVX2, picked at run time when the CPU has it (GCC/clang on
 * x86-64; -DTAGC_QUANT_NO_AVX2 builds the generic loops only, e.g. to test
 * them on an AVX2 machine).  target_clones (select.c) recompiles one C body
 * per target; these loops are written with intrinsics instead, because the
 * compiler did not vectorize the generic ones well (0.1-0.2 of memcpy's
 * speed, mostly scalar code and per-value branches).  The same two passes,
 * eight values per vector, the same arithmetic in the same order, so the
 * bytes and the residual are bit-for-bit the generic loops' (and
 * cuda/quant.cu's):
 *   - pass 1: |v| is v's pattern with the sign bit cleared; for v >= 0 the
 *     order of the patterns read as integers is the order of the values, so
 *     an integer max gives max |v| and finiteness at once (a pattern above
 *     FLT_MAX's is NaN/Inf).  Partial sum j (of 32) is lane j % 4 of
 *     accumulator j / 4 (4 doubles each), added to in block_scale's order,
 *     and the tree adds the same pairs;
 *   - pass 2: tagc_q_code's product, rounding half to even and clamps (see
 *     code8), the residual v - (float)q * s as a product then a difference
 *     (no FMA), tagc_f32_to_bf16's rounding for a bf16 residual, and the
 *     digits packed with tagc_q_weight's weights; a chunk's values past its
 *     last whole 32 go through the generic code.
 * Both passes prefetch ahead (prefetch32).  The generic loops are the
 * reference: tests/test_quant.py and the CUDA-emulation tests check this
 * path's bytes on an AVX2 machine.
 */
#include "quant_avx2.h"

#ifdef TAGC_Q_AVX2
/* block_encode with AVX2: per CHUNK, 32 values a step, the chunk's last
 * values (fewer than 32) through the generic code; ternary's digits are
 * packed after the chunk, 40 a step, the last step ending on the chunk's
 * last byte (the record ends there, the next one's scale follows). */
TAGC_AVX2 void block_encode_avx2(uint8_t *codes, float s, const void *g, int gd, void *r,
                             int rd, int64_t o, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    const float inv = tagc_q_inv(s);
    const __m256 vs = _mm256_set1_ps(s), vinv = _mm256_set1_ps(inv);
    uint8_t d[CHUNK + 4];
    for (int64_t c = 0; c < len; c += CHUNK) {
        int n = len - c < CHUNK ? (int)(len - c) : CHUNK, i = 0;
        uint8_t *out = codes + c / per;
        for (; i + 32 <= n; i += 32)
            encode32(out, d, i, vs, vinv, g, gd, r, rd, o + c + i, format);
        if (i < n)
            encode_digits(d + (format == TAGC_Q_TERNARY ? i : 0), s, inv, g, gd, r, rd,
                          o + c + i, n - i, format);
        if (format != TAGC_Q_TERNARY) {
            if (i < n)
                pack_digits(out + i / per, d, n - i, format);
            continue;
        }
        int bytes = (n + 4) / 5, b = 0;
        for (int j = n; j < 5 * bytes; j++)
            d[j] = (uint8_t)tagc_q_pad_digit(format);
        if (bytes < 8) {
            pack_digits(out, d, n, format);
            continue;
        }
        for (; b + 8 <= bytes; b += 8)
            ternary_bytes8(out + b, d + 5 * b);
        if (b < bytes) /* the last 8 bytes, again in part */
            ternary_bytes8(out + bytes - 8, d + 5 * (bytes - 8));
    }
}

DEFINE_ENCODE(_avx2, TAGC_AVX2, __attribute__((target("avx2"))) static)
#endif

/* The encoder for the dtypes at hand and this CPU. */
static int encode_dispatch(uint8_t *dst, const void *g, int gd, void *r, int rd,
                           int64_t n, int format, int64_t block)
{
#ifdef TAGC_Q_AVX2
    if (__builtin_cpu_supports("avx2"))
        return encode_dtypes_avx2(dst, g, gd, r, rd, n, format, block);
#endif
    return encode_dtypes(dst, g, gd, r, rd, n, format, block);
}

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
    if (!encode_dispatch(dst, grad, (int)grad_dtype, residual, rd, n, (int)format, block))
        return TAGC_ERR_NONFINITE;
    return TAGC_OK;
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
        BY_QFORMAT(fmt, ok = q_codes_valid(src + b * rec + 4, len, F));
        if (!ok)
            return TAGC_ERR_CORRUPT; /* checked in full before out is written */
    }
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int64_t len = n - o < block ? n - o : block;
        BY_QFORMAT(fmt, q_record_out(out, TAGC_F32, 1, o, src + b * rec, len, F));
    }
    return TAGC_OK;
}
