/*
 * tls.c - ternary codes with two-level log scales, with error feedback
 * (tagc.h, tagc_tls_*).  The scale arithmetic is tls.h's, shared with
 * cuda/tls.cu; a block's raw scale is tagc_quant_encode's ternary block scale
 * and its codes are that encoder's digits (block_scale, encode_digits and
 * pack_digits of tagc_internal.h), so both write the same bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "quant_avx2.h"
#include "tls.h"
#include "tagc_internal.h"

/* Pass 1: every block's raw scale into sc[0..nb) and the largest into *S;
 * 0 on NaN/Inf (nothing else written). */
TAGC_AI int raw_scales(float *sc, float *S, const void *g, int gd, const void *res, int rd,
                       int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n);
    float big = 0.0f;
    for (int64_t j = 0; j < nb; j++) {
        int64_t o = j * TAGC_TLS_BLOCK;
        int len = n - o < TAGC_TLS_BLOCK ? (int)(n - o) : TAGC_TLS_BLOCK;
        if (!block_scale(&sc[j], g, gd, res, rd, o, len, TAGC_Q_TERNARY))
            return 0;
        big = sc[j] > big ? sc[j] : big;
    }
    *S = big;
    return 1;
}

/* Group code of a group whose largest raw block scale is R under the message
 * scale S, and its decoded scale in *M (a group whose scale underflows sends
 * nothing: 255, M = 0). */
TAGC_AI int group_code(float R, float S, float *M)
{
    int gc = R > 0.0f ? tagc_tls_group_code(R / S) : 255;
    *M = tagc_tls_group_scale(S, gc);
    return *M == 0.0f ? 255 : gc;
}

/* The codes of blocks [j0, j1) (one group's, or its tail) under the group's
 * decoded scale M into their nibbles of bcodes (zeroed first), and sc[j]
 * from block j's raw scale to its decoded one. */
TAGC_AI void block_codes(uint8_t *bcodes, float *sc, float M, int64_t j0, int64_t j1)
{
    for (int64_t j = j0; j < j1; j++) {
        int bc = M > 0.0f && sc[j] > 0.0f ? tagc_tls_block_code(sc[j] / M) : 15;
        sc[j] = tagc_tls_block_scale(M, bc);
        bcodes[j >> 1] = (uint8_t)((j & 1 ? bcodes[j >> 1] : 0) | bc << (4 * (j & 1)));
    }
}

/* The largest of sc[j0, j1). */
TAGC_AI float max_of(const float *sc, int64_t j0, int64_t j1)
{
    float R = 0.0f;
    for (int64_t j = j0; j < j1; j++)
        R = sc[j] > R ? sc[j] : R;
    return R;
}

/* The group and block codes of groups [k0, ng) into dst, and sc[j] from
 * block j's raw scale to its decoded one. */
TAGC_AI void scale_codes(uint8_t *dst, float *sc, float S, int64_t n, int64_t k0)
{
    const int64_t nb = tagc_tls_blocks(n), ng = tagc_tls_groups(n);
    uint8_t *gcodes = dst + 4, *bcodes = dst + tagc_tls_block_codes_at(n);
    for (int64_t k = k0; k < ng; k++) {
        const int64_t j0 = k * TAGC_TLS_GROUP;
        const int64_t j1 = j0 + TAGC_TLS_GROUP < nb ? j0 + TAGC_TLS_GROUP : nb;
        float M;
        gcodes[k] = (uint8_t)group_code(max_of(sc, j0, j1), S, &M);
        block_codes(bcodes, sc, M, j0, j1);
    }
}

/* Values per chunk of pass 2: five blocks, whose codes fill 32 whole bytes. */
#define CHUNK (5 * TAGC_TLS_BLOCK)

/* Pass 2's codes of the values [o, o + len) (o a multiple of CHUNK, len <= CHUNK):
 * value i's ternary digit under its block's decoded scale, five per byte, and the
 * residual v - q s.  Digits first (elementwise, per block: the loop vectorizes),
 * then the packing. */
TAGC_AI void chunk_codes(uint8_t *trits, const float *sc, const void *g, int gd, void *res,
                         int rd, int64_t o, int len)
{
    uint8_t d[CHUNK];
    for (int b = 0; b * TAGC_TLS_BLOCK < len; b++) {
        const float s = sc[o / TAGC_TLS_BLOCK + b];
        const int j0 = b * TAGC_TLS_BLOCK;
        const int j1 = len < j0 + TAGC_TLS_BLOCK ? len : j0 + TAGC_TLS_BLOCK;
        encode_digits(d + j0, s, tagc_q_inv(s), g, gd, res, rd, o + j0, j1 - j0,
                      TAGC_Q_TERNARY);
    }
    pack_digits(trits, d, len, TAGC_Q_TERNARY);
}

TAGC_AI void value_codes(uint8_t *trits, const float *sc, const void *g, int gd, void *res,
                         int rd, int64_t n)
{
    for (int64_t o = 0; o < n; o += CHUNK) {
        int len = n - o < CHUNK ? (int)(n - o) : CHUNK;
        chunk_codes(trits + o / 5, sc, g, gd, res, rd, o, len);
    }
}

TAGC_AI void encode_all(uint8_t *dst, float *sc, float S, const void *g, int gd, void *res,
                        int rd, int64_t n)
{
    memcpy(dst, &S, 4);
    scale_codes(dst, sc, S, n, 0);
    value_codes(dst + tagc_tls_trits_at(n), sc, g, gd, res, rd, n);
}

static int encode_dtypes(uint8_t *dst, float *sc, const void *g, int gd, void *res, int rd,
                         int64_t n)
{
    float S = 0.0f;
    BY_DTYPES(if (!raw_scales(sc, &S, g, G, res, R, n)) return 0;
                  encode_all(dst, sc, S, g, G, res, R, n); return 1);
    return 0; /* unreachable: the dtypes were checked */
}

#ifdef TAGC_Q_AVX2
/* The two passes with AVX2, the generic loops' arithmetic in their order.
 * Pass 1 takes eight blocks a step, one vector lane per block at the end:
 * each block's sum of |v| in block_scale's tree (the lanes of a block's four
 * loads, then across its two halves) and its max, then the eight scales at
 * once.  The scale codes take a group's sixteen blocks in two vectors (the
 * division, octave and comparisons of tagc_tls_block_code and the product
 * of tagc_tls_block_scale, lane by lane, with each block's reciprocal for
 * pass 2).  Pass 2 codes whole chunks of five blocks 32 values at a time
 * (encode32: digits and residual under one scale) and packs their 160
 * digits 40 at a time.  Tails (blocks past a multiple of eight, a last
 * partial group or chunk) go through the generic code. */

/* Lanes 0-3 and 4-7 of |v| (bit patterns a) as doubles. */
TAGC_AVX2 __m256d lo4(__m256i a)
{
    return _mm256_cvtps_pd(_mm256_castps256_ps128(_mm256_castsi256_ps(a)));
}

TAGC_AVX2 __m256d hi4(__m256i a)
{
    return _mm256_cvtps_pd(_mm256_extractf128_ps(_mm256_castsi256_ps(a), 1));
}

/* The block of 32 values at p: *mx gets the max pattern of its lanes and the
 * return value its four partial sums, block_scale's tree down to four lanes
 * (lane j += lane j + 16, then + 8, then + 4: values j, j + 4, ..., j + 28). */
TAGC_AVX2 __m256d block_sums(__m256i *mx, const void *g, int gd, const void *r, int rd,
                             int64_t p)
{
    prefetch32(g, gd, p);
    if (rd != DT_NONE)
        prefetch32(r, rd, p);
    __m256i a0 = mag8(ldv8(g, gd, r, rd, p)), a1 = mag8(ldv8(g, gd, r, rd, p + 8));
    __m256i a2 = mag8(ldv8(g, gd, r, rd, p + 16)), a3 = mag8(ldv8(g, gd, r, rd, p + 24));
    *mx = _mm256_max_epu32(_mm256_max_epu32(a0, a1), _mm256_max_epu32(a2, a3));
    __m256d l0 = _mm256_add_pd(lo4(a0), lo4(a2)), l1 = _mm256_add_pd(hi4(a0), hi4(a2));
    __m256d l2 = _mm256_add_pd(lo4(a1), lo4(a3)), l3 = _mm256_add_pd(hi4(a1), hi4(a3));
    return _mm256_add_pd(_mm256_add_pd(l0, l2), _mm256_add_pd(l1, l3));
}

/* Lanes (x0 + x2) + (x1 + x3) of the four-lane sums of blocks x and y, z
 * and w, as (x, z, y, w): block_scale's last two steps. */
TAGC_AVX2 __m256d finish4(__m256d x, __m256d y, __m256d z, __m256d w)
{
    __m256d xy = _mm256_add_pd(_mm256_permute2f128_pd(x, y, 0x20),
                               _mm256_permute2f128_pd(x, y, 0x31));
    __m256d zw = _mm256_add_pd(_mm256_permute2f128_pd(z, w, 0x20),
                               _mm256_permute2f128_pd(z, w, 0x31));
    return _mm256_hadd_pd(xy, zw);
}

/* Ternary scales (tagc_q_scale) of four full blocks from their sums and max
 * |v|: min(2.5 sum / 32, max) is at most a float's max, so the clamp to
 * FLT_MAX and the nudge for the top code never act; then 0 below FLT_MIN. */
TAGC_AVX2 __m128 scales4(__m256d sum, __m128 mx)
{
    __m256d s = _mm256_div_pd(_mm256_mul_pd(_mm256_set1_pd(TAGC_TERNARY_LEVEL), sum),
                              _mm256_set1_pd((double)TAGC_TLS_BLOCK));
    __m128 f = _mm256_cvtpd_ps(_mm256_min_pd(s, _mm256_cvtps_pd(mx)));
    return _mm_andnot_ps(_mm_cmplt_ps(f, _mm_set1_ps(1.17549435e-38f)), f);
}

/* Raw scales of the eight full blocks at o into sc; 0 on NaN/Inf. */
TAGC_AVX2 int scales8(float *sc, __m256 *big, const void *g, int gd, const void *r, int rd,
                      int64_t o)
{
    __m256d s[8];
    __m256i m[8];
    for (int b = 0; b < 8; b++)
        s[b] = block_sums(&m[b], g, gd, r, rd, o + TAGC_TLS_BLOCK * b);
    __m256i mx = max8x8(m);
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(mx, _mm256_set1_epi32(0x7f7fffff))))
        return 0; /* above FLT_MAX: NaN or Inf */
    /* (0, 2, 1, 3) and (4, 6, 5, 7) back to block order */
    __m256d s03 = _mm256_permute4x64_pd(finish4(s[0], s[1], s[2], s[3]), 0xd8);
    __m256d s47 = _mm256_permute4x64_pd(finish4(s[4], s[5], s[6], s[7]), 0xd8);
    __m256 mf = _mm256_castsi256_ps(mx);
    __m256 v = _mm256_set_m128(scales4(s47, _mm256_extractf128_ps(mf, 1)),
                               scales4(s03, _mm256_castps256_ps128(mf)));
    _mm256_storeu_ps(sc, v);
    *big = _mm256_max_ps(*big, v);
    return 1;
}

TAGC_AVX2 int raw_scales_avx2(float *sc, float *S, const void *g, int gd, const void *res,
                              int rd, int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n);
    __m256 big8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; (j + 8) * TAGC_TLS_BLOCK <= n; j += 8)
        if (!scales8(sc + j, &big8, g, gd, res, rd, j * TAGC_TLS_BLOCK))
            return 0;
    float m8[8], big = 0.0f;
    _mm256_storeu_ps(m8, big8);
    for (int k = 0; k < 8; k++)
        big = m8[k] > big ? m8[k] : big;
    for (; j < nb; j++) {
        int64_t o = j * TAGC_TLS_BLOCK;
        int64_t len = n - o < TAGC_TLS_BLOCK ? n - o : TAGC_TLS_BLOCK;
        if (!block_scale_avx2(&sc[j], g, gd, res, rd, o, len, TAGC_Q_TERNARY))
            return 0;
        big = sc[j] > big ? sc[j] : big;
    }
    *S = big;
    return 1;
}

/* tagc_tls_block_code and tagc_tls_block_scale of eight blocks with raw
 * scales r > 0 under a group scale M > 0 (a lane with r = 0 gets 15 and 0):
 * the codes as 32-bit lanes, the decoded scales into *s. */
TAGC_AVX2 __m256i codes8(__m256 r, __m256 M, __m256 *s)
{
    const __m256i one = _mm256_set1_epi32(1);
    __m256i zb = _mm256_castps_si256(_mm256_div_ps(r, M));
    __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(zb, 23), _mm256_set1_epi32(127));
    __m256 y = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(zb, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x3f800000)));
    /* each comparison true is -1: b = -3 e - (number of midpoints at or below y) */
    __m256i c = _mm256_add_epi32(
        _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(TAGC_TLS_BMID0), _CMP_GE_OQ)),
        _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(TAGC_TLS_BMID1), _CMP_GE_OQ)));
    c = _mm256_add_epi32(
        c, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(TAGC_TLS_BMID2), _CMP_GE_OQ)));
    __m256i b = _mm256_add_epi32(_mm256_mullo_epi32(e, _mm256_set1_epi32(-3)), c);
    b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(14));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(14),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), e));
    __m256i zero = _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_EQ_OQ));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(15), zero);
    /* b / 3 as (11 b) >> 5 (exact for b <= 15) and the step within the octave */
    __m256i sh = _mm256_srli_epi32(_mm256_mullo_epi32(b, _mm256_set1_epi32(11)), 5);
    __m256i st = _mm256_sub_epi32(b, _mm256_mullo_epi32(sh, _mm256_set1_epi32(3)));
    __m256 t = _mm256_blendv_ps(_mm256_set1_ps(TAGC_TLS_BSTEP2), _mm256_set1_ps(TAGC_TLS_BSTEP1),
                                _mm256_castsi256_ps(_mm256_cmpeq_epi32(st, one)));
    t = _mm256_blendv_ps(t, _mm256_set1_ps(1.0f),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(st, _mm256_setzero_si256())));
    __m256 p = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), sh), 23));
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(M, t), p);
    __m256 drop = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(1.17549435e-38f), _CMP_LT_OQ),
                               _mm256_castsi256_ps(zero));
    *s = _mm256_andnot_ps(drop, v);
    return b;
}

/* The largest of the 16 block scales at x (non-negative: their patterns order
 * as integers; max_of's value). */
TAGC_AVX2 float max16(const float *x)
{
    __m256i m = _mm256_max_epu32(_mm256_loadu_si256((const __m256i *)x),
                                 _mm256_loadu_si256((const __m256i *)(x + 8)));
    union { uint32_t u; float f; } r = {hmax8(m)};
    return r.f;
}

/* scale_codes with every full group's sixteen blocks in two vectors, and
 * inv[j] = tagc_q_inv(sc[j]) for every block.  The group codes of all full
 * groups first (their decoded scales parked in inv, free until the end), then
 * the block codes, so that these do not wait on their group's maximum, division
 * and comparisons: that chain bounds one loop of both by its latency. */
TAGC_AVX2 void scale_codes_avx2(uint8_t *dst, float *sc, float *inv, float S, int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n), full = nb / TAGC_TLS_GROUP;
    uint8_t *gcodes = dst + 4, *bcodes = dst + tagc_tls_block_codes_at(n);
    for (int64_t k = 0; k < full; k++)
        gcodes[k] = (uint8_t)group_code(max16(sc + k * TAGC_TLS_GROUP), S, &inv[k]);
    for (int64_t k = 0; k < full; k++) {
        float *x = sc + k * TAGC_TLS_GROUP;
        const float M = inv[k];
        __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + 8);
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;
        __m256i b0 = _mm256_set1_epi32(15), b1 = b0;
        if (M > 0.0f) {
            b0 = codes8(r0, _mm256_set1_ps(M), &s0);
            b1 = codes8(r1, _mm256_set1_ps(M), &s1);
        }
        _mm256_storeu_ps(x, s0);
        _mm256_storeu_ps(x + 8, s1);
        int32_t bc[TAGC_TLS_GROUP];
        _mm256_storeu_si256((__m256i *)bc, b0);
        _mm256_storeu_si256((__m256i *)(bc + 8), b1);
        uint8_t *out = bcodes + k * TAGC_TLS_GROUP / 2;
        for (int i = 0; i < TAGC_TLS_GROUP / 2; i++)
            out[i] = (uint8_t)(bc[2 * i] | bc[2 * i + 1] << 4);
    }
    scale_codes(dst, sc, S, n, full);
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) {
        __m256 s = _mm256_loadu_ps(sc + j);
        __m256 q = _mm256_div_ps(_mm256_set1_ps(1.0f), s);
        _mm256_storeu_ps(inv + j, _mm256_and_ps(q, _mm256_cmp_ps(s, _mm256_setzero_ps(),
                                                                 _CMP_GT_OQ)));
    }
    for (; j < nb; j++)
        inv[j] = tagc_q_inv(sc[j]);
}

TAGC_AVX2 void value_codes_avx2(uint8_t *trits, const float *sc, const float *inv,
                                const void *g, int gd, void *res, int rd, int64_t n)
{
    uint8_t d[CHUNK];
    int64_t o = 0;
    for (; o + CHUNK <= n; o += CHUNK) {
        for (int b = 0; b < CHUNK / TAGC_TLS_BLOCK; b++) {
            const int64_t j = o / TAGC_TLS_BLOCK + b;
            encode32(trits, d, TAGC_TLS_BLOCK * b, _mm256_set1_ps(sc[j]),
                     _mm256_set1_ps(inv[j]), g, gd, res, rd, o + TAGC_TLS_BLOCK * b,
                     TAGC_Q_TERNARY);
        }
        for (int k = 0; k < CHUNK / 40; k++)
            ternary_bytes8(trits + o / 5 + 8 * k, d + 40 * k);
    }
    if (o < n)
        chunk_codes(trits + o / 5, sc, g, gd, res, rd, o, (int)(n - o));
}

/* sc holds two arrays of tagc_tls_blocks(n) floats: the scales, then their
 * reciprocals. */
__attribute__((target("avx2"))) static int encode_dtypes_avx2(uint8_t *dst, float *sc,
                                                               const void *g, int gd,
                                                               void *res, int rd, int64_t n)
{
    float S = 0.0f, *inv = sc + tagc_tls_blocks(n);
    BY_DTYPES(if (!raw_scales_avx2(sc, &S, g, G, res, R, n)) return 0;
                  memcpy(dst, &S, 4); scale_codes_avx2(dst, sc, inv, S, n);
                  value_codes_avx2(dst + tagc_tls_trits_at(n), sc, inv, g, G, res, R, n);
                  return 1);
    return 0; /* unreachable: the dtypes were checked */
}
#endif

/* The encoder for the dtypes at hand and this CPU. */
static int encode_dispatch(uint8_t *dst, float *sc, const void *g, int gd, void *res, int rd,
                           int64_t n)
{
#ifdef TAGC_Q_AVX2
    if (__builtin_cpu_supports("avx2"))
        return encode_dtypes_avx2(dst, sc, g, gd, res, rd, n);
#endif
    return encode_dtypes(dst, sc, g, gd, res, rd, n);
}

int64_t tagc_tls_bytes(int64_t n)
{
    return tagc_tls_size(n);
}

tagc_status tagc_tls_encode(uint8_t *dst, int64_t dst_capacity,
                            void *residual, tagc_dtype residual_dtype,
                            const void *grad, tagc_dtype grad_dtype, int64_t n)
{
    tagc_status st = tagc_tls_check_encode(dst, dst_capacity, residual, (int)residual_dtype,
                                           grad, (int)grad_dtype, n);
    if (st != TAGC_OK || n == 0)
        return st;
    /* the block scales, and room for the AVX2 encoder's reciprocals after them */
    float *sc = malloc(2 * (size_t)tagc_tls_blocks(n) * sizeof *sc);
    if (sc == NULL)
        return TAGC_ERR_NOMEM;
    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    int ok = encode_dispatch(dst, sc, grad, (int)grad_dtype, residual, rd, n);
    free(sc);
    return ok ? TAGC_OK : TAGC_ERR_NONFINITE;
}

/* out[o, o + len) += the chunk's values (o a multiple of CHUNK, len <= CHUNK), the
 * block scales of its five blocks in s. */
TAGC_AI void chunk_add(float *out, const uint8_t *trits, const float *s, int64_t o, int len)
{
    int8_t q[CHUNK + 4];
    for (int k = 0; 5 * k < len; k++) {
        unsigned b = trits[k];
        for (int j = 0; j < 5; j++, b /= 3)
            q[5 * k + j] = (int8_t)((int)(b % 3) - 1);
    }
    for (int b = 0; b * TAGC_TLS_BLOCK < len; b++) {
        const int j0 = b * TAGC_TLS_BLOCK;
        const int j1 = len < j0 + TAGC_TLS_BLOCK ? len : j0 + TAGC_TLS_BLOCK;
        for (int j = j0; j < j1; j++)
            out[o + j] += (float)q[j] * s[b];
    }
}

TAGC_HOT_CLONES static void decode_all(float *out, int64_t n, const uint8_t *src, float S)
{
    const int64_t nb = tagc_tls_blocks(n);
    const uint8_t *gcodes = src + 4, *bcodes = src + tagc_tls_block_codes_at(n);
    const uint8_t *trits = src + tagc_tls_trits_at(n);
    float s[CHUNK / TAGC_TLS_BLOCK];
    for (int64_t o = 0; o < n; o += CHUNK) {
        for (int b = 0; b < CHUNK / TAGC_TLS_BLOCK; b++) {
            int64_t j = o / TAGC_TLS_BLOCK + b;
            s[b] = j < nb ? tagc_tls_block_scale(
                                tagc_tls_group_scale(S, gcodes[j / TAGC_TLS_GROUP]),
                                (bcodes[j >> 1] >> (4 * (j & 1))) & 15)
                          : 0.0f;
        }
        chunk_add(out, trits + o / 5, s, o, n - o < CHUNK ? (int)(n - o) : CHUNK);
    }
}

tagc_status tagc_tls_decode_add(float *out, int64_t n,
                                const uint8_t *src, int64_t src_bytes)
{
    tagc_status st = tagc_tls_check_decode(out, n, src, src_bytes);
    if (st != TAGC_OK || n == 0)
        return st;
    uint32_t bits;
    memcpy(&bits, src, 4);
    if (!tagc_tls_header_ok(bits))
        return TAGC_ERR_CORRUPT;
    const uint8_t *trits = src + tagc_tls_trits_at(n);
    uint8_t worst = 0;
    for (int64_t k = 0; k < (n + 4) / 5; k++)
        worst = trits[k] > worst ? trits[k] : worst;
    if (worst >= 243)
        return TAGC_ERR_CORRUPT; /* checked in full before out is written */
    float S;
    memcpy(&S, &bits, 4);
    if (S != S) {
        for (int64_t i = 0; i < n; i++)
            out[i] += S;
        return TAGC_OK;
    }
    decode_all(out, n, src, S);
    return TAGC_OK;
}
