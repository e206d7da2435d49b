/*
 * quant.c - block quantization with error feedback (tagc.h, tagc_quant_*),
 * the codec of the `quant` transport.  The per-value arithmetic (scale, code,
 * digit, validity) is tagc_portable.h's, shared with cuda/quant.cu, and the
 * per-block sum of |v| is taken in the order the CUDA kernel's warp takes it,
 * so both write the same bytes.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

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

/* Whether every code of the message src (n values in records of `block`) is
 * inside format: read in full before an op writes anything. */
static int message_valid(const uint8_t *src, int64_t n, int format, int64_t block)
{
    const int64_t rec = tagc_q_record_bytes(block, format);
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int64_t len = n - o < block ? n - o : block;
        int ok = 0;
        BY_QFORMAT(format, ok = q_codes_valid(src + b * rec + 4, len, F));
        if (!ok)
            return 0;
    }
    return 1;
}

/* ---- one unit at a time (tagc_quant_unit_encode / _decode) ---- */

/* w[0..len) = the hook's working copy of one residual record: 0 + q * s
 * (decode_add into zeros), or zeros after a reset, times factor unless it
 * is 1 (the hook skips that multiply). */
TAGC_AI void unit_residual(float *w, const uint8_t *rec, int64_t len, int rfmt, float factor,
                           int zero)
{
    memset(w, 0, (size_t)len * sizeof *w);
    if (!zero)
        BY_QFORMAT(rfmt, q_record_out(w, TAGC_F32, 1, 0, rec, len, F));
    if (factor != 1.0f)
        for (int64_t i = 0; i < len; i++)
            w[i] *= factor;
}

/* unit_pass##S: tagc_quant_unit_encode's two passes for grad dtype G with
 * block_scale##S / block_encode##S; 0 on NaN/Inf.  Pass 1 writes every scale
 * of the messages (finding NaN/Inf before rcodes changes); pass 2 streams
 * each block: its residual decoded again, its codes, its
 * residual re-coded over its own record.  Defined once for the generic
 * loops and once for the AVX2 ones. */
#define DEFINE_UNIT(S, INLINE, FN)                                                      \
    INLINE int unit_pass##S(uint8_t *dst, int64_t nb, uint8_t *rc, const char *g, int G,  \
                            int64_t shard, int64_t world, int64_t rank, int fmt,          \
                            int rfmt, int64_t block, float factor, int zero, float *w)    \
    {                                                                                   \
        const int64_t per = shard / block, es = G == TAGC_F32 ? 4 : 2;                  \
        const int64_t rg = tagc_q_record_bytes(block, fmt);                             \
        const int64_t rr = tagc_q_record_bytes(block, rfmt);                            \
        for (int64_t u = 0; u < world * per; u++) {                                     \
            int64_t r = u / per, b = u % per;                                           \
            unit_residual(w, rc + u * rr, block, rfmt, factor, zero);                   \
            if (r == rank)                                                              \
                continue;                                                               \
            float s = 0.0f;                                                             \
            int ok = 0;                                                                 \
            BY_QFORMAT(fmt, ok = block_scale##S(&s, g + u * block * es, G, w, TAGC_F32, \
                                                0, block, F));                          \
            if (!ok)                                                                    \
                return 0;                                                               \
            memcpy(dst + r * nb + b * rg, &s, 4);                                       \
        }                                                                               \
        for (int64_t u = 0; u < world * per; u++) {                                     \
            int64_t r = u / per, b = u % per;                                           \
            unit_residual(w, rc + u * rr, block, rfmt, factor, zero);                   \
            if (r != rank) {                                                            \
                uint8_t *rec = dst + r * nb + b * rg;                                   \
                float s;                                                                \
                memcpy(&s, rec, 4);                                                     \
                BY_QFORMAT(fmt, block_encode##S(rec + 4, s, g + u * block * es, G, w,   \
                                                TAGC_F32, 0, block, F));                \
            }                                                                           \
            /* w is finite: v and q * s are (own shard: the guard's, times <= 1) */     \
            float s2 = 0.0f;                                                            \
            BY_QFORMAT(rfmt, (void)block_scale##S(&s2, w, TAGC_F32, NULL, DT_NONE, 0,   \
                                                  block, F));                           \
            memcpy(rc + u * rr, &s2, 4);                                                \
            BY_QFORMAT(rfmt, block_encode##S(rc + u * rr + 4, s2, w, TAGC_F32, NULL,    \
                                             DT_NONE, 0, block, F));                    \
        }                                                                               \
        return 1;                                                                       \
    }                                                                                   \
    FN int unit_dtypes##S(uint8_t *dst, int64_t nb, uint8_t *rc, const void *g, int gd,   \
                          int64_t shard, int64_t world, int64_t rank, int fmt, int rfmt,  \
                          int64_t block, float factor, int zero, float *w)                \
    {                                                                                   \
        if (gd == TAGC_F32)                                                             \
            return unit_pass##S(dst, nb, rc, g, TAGC_F32, shard, world, rank, fmt, rfmt, \
                                block, factor, zero, w);                                \
        return unit_pass##S(dst, nb, rc, g, TAGC_BF16, shard, world, rank, fmt, rfmt,   \
                            block, factor, zero, w);                                    \
    }

DEFINE_UNIT(, TAGC_AI, static)
#ifdef TAGC_Q_AVX2
DEFINE_UNIT(_avx2, TAGC_AVX2, __attribute__((target("avx2"))) static)
#endif

/* The residual's records (n values, n % block == 0): CORRUPT for a code
 * outside rfmt; *zero = 1 when a value decodes to NaN/Inf (the hook's
 * guard).  Only a scale above FLT_MAX / 127 can make a product overflow, so
 * only such a record's codes are multiplied out. */
static tagc_status unit_guard(const uint8_t *rc, int64_t n, int rfmt, int64_t block, int *zero)
{
    const int64_t rr = tagc_q_record_bytes(block, rfmt);
    const int per = tagc_q_per_byte(rfmt);
    *zero = 0;
    if (!message_valid(rc, n, rfmt, block))
        return TAGC_ERR_CORRUPT;
    for (int64_t b = 0; b < n / block && !*zero; b++) {
        const uint8_t *rec = rc + b * rr;
        float s;
        memcpy(&s, rec, 4);
        if (fabsf(s) <= FLT_MAX / 127.0f)
            continue;
        int ignored = 0;
        for (int64_t i = 0; i < block && !*zero; i++) {
            float x = (float)tagc_q_decode(rfmt, rec[4 + i / per], (int)(i % per), &ignored) * s;
            *zero = !(fabsf(x) <= FLT_MAX);
        }
    }
    return TAGC_OK;
}

tagc_status tagc_quant_unit_encode(uint8_t *dst, int64_t dst_capacity,
                                   uint8_t *rcodes, int64_t rcodes_bytes,
                                   const void *grad, tagc_dtype grad_dtype,
                                   int64_t shard, int64_t world, int64_t rank,
                                   tagc_qformat format, tagc_qformat residual_format,
                                   int64_t block, float factor, int *reset)
{
    if (reset != NULL)
        *reset = 0;
    int64_t nb = 0;
    tagc_status st = tagc_check_quant_unit_encode(dst, dst_capacity, rcodes, rcodes_bytes, grad,
                                                  (int)grad_dtype, shard, world, rank,
                                                  (int)format, (int)residual_format, block,
                                                  factor, &nb);
    if (st != TAGC_OK)
        return st;
    int64_t n = world * shard;
    if (n == 0)
        return TAGC_OK;
    int zero = 0;
    st = unit_guard(rcodes, n, (int)residual_format, block, &zero);
    if (st != TAGC_OK)
        return st;
    float *w = malloc((size_t)block * sizeof *w);
    if (w == NULL)
        return TAGC_ERR_NOMEM;
    int ok;
#ifdef TAGC_Q_AVX2
    if (__builtin_cpu_supports("avx2"))
        ok = unit_dtypes_avx2(dst, nb, rcodes, grad, (int)grad_dtype, shard, world, rank,
                              (int)format, (int)residual_format, block, factor, zero, w);
    else
#endif
        ok = unit_dtypes(dst, nb, rcodes, grad, (int)grad_dtype, shard, world, rank,
                         (int)format, (int)residual_format, block, factor, zero, w);
    free(w);
    if (!ok)
        return TAGC_ERR_NONFINITE;
    if (reset != NULL)
        *reset = zero;
    return TAGC_OK;
}

tagc_status tagc_quant_unit_decode(void *out, tagc_dtype out_dtype, int64_t shard,
                                   const uint8_t *src, int64_t src_bytes,
                                   const void *own, tagc_dtype own_dtype,
                                   int64_t world, int64_t rank,
                                   tagc_qformat format, int64_t block, float divisor)
{
    int64_t nb = 0;
    tagc_status st = tagc_check_quant_unit_decode(out, (int)out_dtype, shard, src, src_bytes, own,
                                                  (int)own_dtype, world, rank, (int)format,
                                                  block, divisor, &nb);
    if (st != TAGC_OK || shard == 0)
        return st;
    const int fmt = (int)format;
    const int64_t rec = tagc_q_record_bytes(block, fmt);
    for (int64_t r = 0; r < world; r++)
        if (r != rank && !message_valid(src + r * nb, shard, fmt, block))
            return TAGC_ERR_CORRUPT; /* checked in full before out is written */
    float *acc = malloc((size_t)(shard < block ? shard : block) * sizeof *acc);
    if (acc == NULL)
        return TAGC_ERR_NOMEM;
    for (int64_t o = 0, b = 0; o < shard; o += block, b++) {
        int64_t len = shard - o < block ? shard - o : block;
        memset(acc, 0, (size_t)len * sizeof *acc);
        for (int64_t r = 0; r < world; r++) {
            if (r == rank) {
                for (int64_t i = 0; i < len; i++)
                    acc[i] += ld_val(own, (int)own_dtype, o + i);
                continue;
            }
            BY_QFORMAT(fmt, q_record_out(acc, TAGC_F32, 1, 0, src + r * nb + b * rec, len, F));
        }
        if (divisor != 1.0f)
            for (int64_t i = 0; i < len; i++)
                acc[i] /= divisor;
        for (int64_t i = 0; i < len; i++)
            st_val(out, (int)out_dtype, o + i, acc[i]);
    }
    free(acc);
    return TAGC_OK;
}

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
    if (!message_valid(src, n, fmt, block))
        return TAGC_ERR_CORRUPT; /* checked in full before out is written */
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int64_t len = n - o < block ? n - o : block;
        BY_QFORMAT(fmt, q_record_out(out, TAGC_F32, 1, o, src + b * rec, len, F));
    }
    return TAGC_OK;
}
