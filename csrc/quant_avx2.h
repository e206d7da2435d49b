/*
 * quant_avx2.h - the AVX2 pieces of the block codes' encoders (quant.c's,
 * tls.c's, fp4.c's and wq_blocks.h's): loads and stores of eight values in
 * either dtype, magnitude patterns and their max, a block's scale
 * statistics in block_scale's order, tagc_q_code of eight values, the
 * digits' packing (nibbles, ternary) and the codes and residual of 32
 * values under one scale.  Each is the generic loops' arithmetic in the
 * same order, so both paths write the same bits (quant.c's comment before
 * its AVX2 encoder says how).  TAGC_Q_AVX2 is defined where they exist (GCC/clang on x86-64,
 * unless -DTAGC_QUANT_NO_AVX2).  Internal: included by those files only.
 */
#ifndef TAGC_QUANT_AVX2_H
#define TAGC_QUANT_AVX2_H

#include <string.h>

#include "tagc_internal.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(TAGC_QUANT_NO_AVX2)
#define TAGC_Q_AVX2 1
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

/* |v|'s pattern of eight values: for finite values their order as integers
 * is the order of |v|, and a pattern above FLT_MAX's is NaN or Inf. */
TAGC_AVX2 __m256i mag8(__m256 v)
{
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

/* The largest of eight patterns. */
TAGC_AVX2 uint32_t hmax8(__m256i mx)
{
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(m4);
}

/* The max pattern of each of eight vectors, as lanes 0-7. */
TAGC_AVX2 __m256i max8x8(const __m256i *m)
{
    __m256i q[4], h[2];
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]),
                                _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        h[k] = _mm256_max_epu32(_mm256_unpacklo_epi64(q[2 * k], q[2 * k + 1]),
                                _mm256_unpackhi_epi64(q[2 * k], q[2 * k + 1]));
    return _mm256_max_epu32(_mm256_permute2x128_si256(h[0], h[1], 0x20),
                            _mm256_permute2x128_si256(h[0], h[1], 0x31));
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
    __m256i a = mag8(v);
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
    uint32_t mb = hmax8(mx);
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

/* 32 integers (each in -128..127, values in order in q0..q3) as 32 bytes in
 * the packs' order: they work per 128-bit half, so the dwords (four values
 * each) come out as q0 lo, q1 lo, q2 lo, q3 lo | q0 hi, q1 hi, q2 hi, q3 hi. */
TAGC_AVX2 __m256i packs32(__m256i q0, __m256i q1, __m256i q2, __m256i q3)
{
    return _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
}

/* packs32's bytes in value order. */
TAGC_AVX2 __m256i packs32_in_order(__m256i b)
{
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 integers (each in -128..127, values in order in q0..q3) as 32 bytes. */
TAGC_AVX2 __m256i bytes32(__m256i q0, __m256i q1, __m256i q2, __m256i q3)
{
    return packs32_in_order(packs32(q0, q1, q2, q3));
}

/* 32 nibbles (bytes, each 0..15) as 16 bytes of pairs, the even value's in
 * the low nibble: each byte pair d0, d1 becomes the 16-bit d0 + 16 d1 (one
 * pmaddubsw, no saturation below 256), packed to bytes. */
TAGC_AVX2 __m128i nibbles16(__m256i b)
{
    b = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
    b = _mm256_permute4x64_epi64(_mm256_packus_epi16(b, b), 0x08); /* qwords 0 and 2 */
    return _mm256_castsi256_si128(b);
}

/* 32 int4 codes (bytes32's bytes, each in -7..7) as their 16 bytes: digits
 * q + 7 in nibble pairs. */
TAGC_AVX2 __m128i int4_bytes16(__m256i b)
{
    return nibbles16(_mm256_add_epi8(b, _mm256_set1_epi8(7)));
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
 * int8: the bytes; int4: nibble pairs (int4_bytes16). */
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
        _mm_storeu_si128((__m128i *)(out + i / 2), int4_bytes16(b));
    }
}

#endif /* TAGC_Q_AVX2's condition */

#endif /* TAGC_QUANT_AVX2_H */
