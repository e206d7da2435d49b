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

/* One test per (grad, residual) dtype pair: each case inlines the call for
 * constant dtypes G and R, as BY_QFORMAT does for the format. */
#define DT_CASE(g0, r0, call) \
    if (gd == (g0) && rd == (r0)) { enum { G = g0, R = r0 }; call; }
#define BY_DTYPES(call)                                                  \
    DT_CASE(TAGC_F32, DT_NONE, call) DT_CASE(TAGC_F32, TAGC_F32, call)   \
    DT_CASE(TAGC_F32, TAGC_BF16, call) DT_CASE(TAGC_BF16, DT_NONE, call) \
    DT_CASE(TAGC_BF16, TAGC_F32, call) DT_CASE(TAGC_BF16, TAGC_BF16, call)

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
#if defined(__x86_64__) && defined(__GNUC__) && !defined(TAGC_QUANT_NO_AVX2)
#include <immintrin.h>

#define TAGC_AVX2 static inline __attribute__((always_inline, target("avx2")))

/* Eight values of p (dtype d) from index i, as floats. */
TAGC_AVX2 __m256 ld8(const void *p, int d, int64_t i)
{
    if (d == TAGC_F32)
        return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* load_v of eight values. */
TAGC_AVX2 __m256 ldv8(const void *g, int gd, const void *r, int rd, int64_t i)
{
    __m256 v = ld8(g, gd, i);
    return rd != DT_NONE ? _mm256_add_ps(v, ld8(r, rd, i)) : v;
}

/* st_val of eight values (tagc_f32_to_bf16 for bf16). */
TAGC_AVX2 void st8(void *p, int d, int64_t i, __m256 v)
{
    if (d == TAGC_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i one = _mm256_set1_epi32(1);
    __m256i u = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i even = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, one));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, even), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i b = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

/* Values ahead of the loops that prefetch32 asks the cache for: with the
 * hardware prefetcher alone both passes wait on memory longer (the encode
 * took 4-12% longer without it at 2^24 values; 64 or 256 ahead did no
 * better than 128). */
#define AHEAD 128

/* Hint the lines of values [p + AHEAD, p + AHEAD + 32) of an array of dtype
 * d into the cache (the address is computed as an integer: it may be past
 * the array, which a prefetch ignores). */
TAGC_AVX2 void prefetch32(const void *a, int d, int64_t p)
{
    int size = d == TAGC_F32 ? 4 : 2;
    const char *c = (const char *)((uintptr_t)a + (uintptr_t)((p + AHEAD) * size));
    _mm_prefetch(c, _MM_HINT_T0);
    if (size == 4)
        _mm_prefetch(c + 64, _MM_HINT_T0);
}

/* Eight |v| into the max of patterns *mx and, for the formats that use the
 * sum, lanes 0-3 into *lo and 4-7 into *hi. */
TAGC_AVX2 void stats8(__m256 v, __m256i *mx, __m256d *lo, __m256d *hi, int format)
{
    __m256i a = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
    *mx = _mm256_max_epu32(*mx, a);
    if (tagc_q_uses_sum(format)) {
        __m256 f = _mm256_castsi256_ps(a);
        *lo = _mm256_add_pd(*lo, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
        *hi = _mm256_add_pd(*hi, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
    }
}

/* block_scale with AVX2: 32 values a step, a last partial step through a
 * buffer (the lanes past the end get +0, which leaves a sum as it is). */
TAGC_AVX2 int block_scale_avx2(float *scale, const void *g, int gd, const void *r, int rd,
                           int64_t o, int64_t len, int format)
{
    __m256d l0 = _mm256_setzero_pd(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0, l6 = l0,
            l7 = l0;
    __m256i mx = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        prefetch32(g, gd, o + i);
        if (rd != DT_NONE)
            prefetch32(r, rd, o + i);
        stats8(ldv8(g, gd, r, rd, o + i), &mx, &l0, &l1, format);
        stats8(ldv8(g, gd, r, rd, o + i + 8), &mx, &l2, &l3, format);
        stats8(ldv8(g, gd, r, rd, o + i + 16), &mx, &l4, &l5, format);
        stats8(ldv8(g, gd, r, rd, o + i + 24), &mx, &l6, &l7, format);
    }
    if (i < len) {
        float t[32] = {0};
        for (int j = 0; j < len - i; j++)
            t[j] = load_v(g, gd, r, rd, o + i + j);
        stats8(_mm256_loadu_ps(t), &mx, &l0, &l1, format);
        stats8(_mm256_loadu_ps(t + 8), &mx, &l2, &l3, format);
        stats8(_mm256_loadu_ps(t + 16), &mx, &l4, &l5, format);
        stats8(_mm256_loadu_ps(t + 24), &mx, &l6, &l7, format);
    }
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    uint32_t mb = (uint32_t)_mm_cvtsi128_si32(m4);
    if (mb > 0x7f7fffffu) /* above FLT_MAX: NaN or Inf */
        return 0;
    /* the tree: lane j += lane j + off for off = 16, 8, 4, 2, 1 */
    l0 = _mm256_add_pd(l0, l4);
    l1 = _mm256_add_pd(l1, l5);
    l2 = _mm256_add_pd(l2, l6);
    l3 = _mm256_add_pd(l3, l7);
    l0 = _mm256_add_pd(l0, l2);
    l1 = _mm256_add_pd(l1, l3);
    l0 = _mm256_add_pd(l0, l1);
    __m128d p = _mm_add_pd(_mm256_castpd256_pd128(l0), _mm256_extractf128_pd(l0, 1));
    double sum = _mm_cvtsd_f64(p) + _mm_cvtsd_f64(_mm_unpackhi_pd(p, p));
    *scale = tagc_q_scale(format, sum, u2f(mb), len);
    return 1;
}

/* tagc_q_code of eight values (not sign), as integers; *qf gets them as
 * floats.  Rounding half to even with roundps instead of the magic number
 * needs no clamp before it (it is exact for any |y|; rounding is monotonic,
 * so the clamp after it gives the same code); a -0 it may give is 0 once
 * converted. */
TAGC_AVX2 __m256i code8(__m256 v, __m256 inv, int format, __m256 *qf)
{
    const __m256 lim = _mm256_set1_ps((float)tagc_q_max(format));
    __m256 y = _mm256_round_ps(_mm256_mul_ps(v, inv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    y = _mm256_min_ps(y, lim);
    y = _mm256_max_ps(y, _mm256_sub_ps(_mm256_setzero_ps(), lim));
    __m256i q = _mm256_cvttps_epi32(y);
    *qf = _mm256_cvtepi32_ps(q);
    return q;
}

/* 32 integers (each in -128..127, values in order in q0..q3) as 32 bytes. */
TAGC_AVX2 __m256i bytes32(__m256i q0, __m256i q1, __m256i q2, __m256i q3)
{
    /* the packs work per 128-bit half: dwords come out as q0 lo, q1 lo, q2
     * lo, q3 lo | q0 hi, q1 hi, q2 hi, q3 hi, hence the permutation */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 40 ternary digits d[0..40) as their 8 bytes (tagc_q_weight's base 3).
 * Two loads, at d and d + 8, hold groups (of 5 digits) 0-1 and 4-5, 2-3 and
 * 6-7 in their halves; each group is spread to 8 bytes, multiplied by (1, 3,
 * 9, 27, 81, 0, 0, 0) and summed by pmaddubsw, pmaddwd and phaddd. */
TAGC_AVX2 void ternary_bytes8(uint8_t *out, const uint8_t *d)
{
    const __m256i w = _mm256_setr_epi8(1, 3, 9, 27, 81, 0, 0, 0, 1, 3, 9, 27, 81, 0, 0, 0,
                                       1, 3, 9, 27, 81, 0, 0, 0, 1, 3, 9, 27, 81, 0, 0, 0);
    const __m256i ones = _mm256_set1_epi16(1);
#define G5(at) at, at + 1, at + 2, at + 3, at + 4, -1, -1, -1
    /* d[0..32): groups 0, 1 at 0, 5; groups 4, 5 at 20 - 16, 25 - 16 */
    __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)d),
                                    _mm256_setr_epi8(G5(0), G5(5), G5(4), G5(9)));
    /* d[8..40): groups 2, 3 at 10 - 8, 15 - 8; groups 6, 7 at 30 - 24, 35 - 24 */
    __m256i y = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(d + 8)),
                                    _mm256_setr_epi8(G5(2), G5(7), G5(6), G5(11)));
#undef G5
    x = _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones);
    y = _mm256_madd_epi16(_mm256_maddubs_epi16(y, w), ones);
    __m256i h = _mm256_hadd_epi32(x, y); /* groups 0-3 | 4-7, one per dword */
    h = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                                -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i *)out,
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* 32 values from index p (i of the chunk's codes at out; ternary: digits at
 * d + i): codes, and the residual.  sign: the compare results are the bits;
 * int8: the bytes; int4: nibble pairs from 16-bit words d0 | d1 << 8. */
TAGC_AVX2 void encode32(uint8_t *out, uint8_t *d, int i, __m256 vs, __m256 vinv,
                        const void *g, int gd, void *r, int rd, int64_t p, int format)
{
    __m256i q[4];
    uint32_t bits = 0;
    prefetch32(g, gd, p);
    if (rd != DT_NONE)
        prefetch32(r, rd, p);
    for (int k = 0; k < 4; k++) {
        __m256 v = ldv8(g, gd, r, rd, p + 8 * k), qf;
        if (format == TAGC_Q_SIGN) {
            __m256 ge = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
            qf = _mm256_blendv_ps(_mm256_set1_ps(-1.0f), _mm256_set1_ps(1.0f), ge);
            bits |= (uint32_t)_mm256_movemask_ps(ge) << (8 * k);
        } else {
            q[k] = code8(v, vinv, format, &qf);
        }
        if (rd != DT_NONE)
            st8(r, rd, p + 8 * k, _mm256_sub_ps(v, _mm256_mul_ps(qf, vs)));
    }
    if (format == TAGC_Q_SIGN) {
        memcpy(out + i / 8, &bits, 4);
        return;
    }
    __m256i b = bytes32(q[0], q[1], q[2], q[3]);
    if (format == TAGC_Q_INT8) {
        _mm256_storeu_si256((__m256i *)(out + i), b);
    } else if (format == TAGC_Q_TERNARY) {
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_add_epi8(b, _mm256_set1_epi8(1)));
    } else {
        b = _mm256_add_epi8(b, _mm256_set1_epi8(7));
        b = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xff));
        b = _mm256_permute4x64_epi64(_mm256_packus_epi16(b, b), 0x08); /* qwords 0 and 2 */
        _mm_storeu_si128((__m128i *)(out + i / 2), _mm256_castsi256_si128(b));
    }
}

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
#define TAGC_QUANT_AVX2 1
#endif

/* The encoder for the dtypes at hand and this CPU. */
static int encode_dispatch(uint8_t *dst, const void *g, int gd, void *r, int rd,
                           int64_t n, int format, int64_t block)
{
#ifdef TAGC_QUANT_AVX2
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
