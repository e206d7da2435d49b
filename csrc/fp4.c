/*
 * fp4.c - 4-bit block codes (E2M1 values, E8M0 block scales) with error
 * feedback and the optional seeded block Hadamard rotation (tagc.h,
 * tagc_fp4_* and tagc_rht).  The per-value arithmetic is fp4.h's, shared
 * with cuda/fp4.cu; the butterflies are each one fp32 add or subtract, so
 * any order within a stage gives the same bits, on the CPU and the GPU.
 */
#include <string.h>

#include "fp4.h"
#include "quant_avx2.h"
#include "tagc_internal.h"

/* The fast Walsh-Hadamard transform of x[0..len), len a power of two:
 * strides 1, 2, 4 written out per group of 8 (straight-line code the
 * compiler keeps in registers), then the wider strides, whose runs of
 * butterflies are contiguous and vectorize.  The same butterflies as one
 * loop per stride: each a + b or a - b of the same two values. */
TAGC_AI void fwht(float *x, int len)
{
    int h = 1;
    if (len >= 8) {
        for (int j = 0; j < len; j += 8) {
            float *y = x + j;
            float a0 = y[0] + y[1], a1 = y[0] - y[1], a2 = y[2] + y[3], a3 = y[2] - y[3];
            float a4 = y[4] + y[5], a5 = y[4] - y[5], a6 = y[6] + y[7], a7 = y[6] - y[7];
            float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
            float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
            y[0] = b0 + b4, y[4] = b0 - b4, y[1] = b1 + b5, y[5] = b1 - b5;
            y[2] = b2 + b6, y[6] = b2 - b6, y[3] = b3 + b7, y[7] = b3 - b7;
        }
        h = 8;
    }
    for (; h < len; h <<= 1)
        for (int j = 0; j < len; j += 2 * h)
            for (int i = j; i < j + h; i++) {
                float a = x[i], b = x[i + h];
                x[i] = a + b;
                x[i + h] = a - b;
            }
}

/* x[i] *= the sign of position o + i (tagc_fp4_flip_bit), i < len, 32 at a
 * time from 32-bit words of the hashes (o is a multiple of the block, so a
 * step never crosses a hash's 64 positions). */
TAGC_AI void flip_signs(float *x, int64_t o, int len, uint64_t seed)
{
    const uint64_t ts = tagc_table_seed(seed, TAGC_FP4_SIGN_STREAM);
    for (int i = 0; i < len; i += 32) {
        int64_t p = o + i;
        uint32_t word = (uint32_t)(tagc_hash((uint64_t)p >> 6, ts) >> (p & 63));
        int cnt = len - i < 32 ? len - i : 32;
        for (int j = 0; j < cnt; j++)
            x[i + j] = u2f(f2u(x[i + j]) ^ ((word >> j) & 1u) << 31);
    }
}

/* The rotation of the block [o, o + len) held in x (len == 1 << l: whole;
 * shorter: the signs only), forward or inverse. */
TAGC_AI void rotate(float *x, int64_t o, int len, int l, uint64_t seed, int inverse)
{
    const int whole = len == 1 << l;
    const float norm = tagc_fp4_norm(l);
    if (!inverse)
        flip_signs(x, o, len, seed);
    if (whole) {
        fwht(x, 1 << l);
        for (int i = 0; i < len; i++)
            x[i] *= norm;
    }
    if (inverse)
        flip_signs(x, o, len, seed);
}

/* Largest magnitude pattern of x[0..len). */
TAGC_AI uint32_t max_bits(const float *x, int len)
{
    uint32_t m = 0;
    for (int i = 0; i < len; i++) {
        uint32_t a = f2u(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* Pass 1: whether every |v| has a pattern <= limit (NaN's are above). */
TAGC_AI int all_below(const void *g, int gd, const void *r, int rd, int64_t n, uint32_t limit)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = f2u(load_v(g, gd, r, rd, i)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m <= limit;
}

/* One block [o, o + len) of v: its codes (nibbles into codes, which starts
 * at the block's first byte), its scale byte (returned), and the residual;
 * -1 (nothing written) when a |v| is above `limit`. */
TAGC_AI int encode_block(uint8_t *codes, const void *g, int gd, void *r, int rd, int64_t o,
                         int len, int l, unsigned flags, uint64_t seed, uint32_t limit)
{
    float v[TAGC_FP4_BLOCK_MAX], w[TAGC_FP4_BLOCK_MAX];
    uint32_t c[TAGC_FP4_BLOCK_MAX + 1];
    for (int i = 0; i < len; i++)
        v[i] = w[i] = load_v(g, gd, r, rd, o + i);
    uint32_t mx = max_bits(v, len);
    if (mx > limit)
        return -1;
    if (flags & TAGC_FP4_ROTATE) {
        rotate(w, o, len, l, seed, 0);
        mx = max_bits(w, len);
    }
    uint32_t sb = tagc_fp4_scale_byte(mx);
    const float inv = tagc_fp4_inv(sb), s = tagc_fp4_scale(sb);
    if (flags & TAGC_FP4_STOCHASTIC) {
        for (int i = 0; i < len; i++)
            c[i] = tagc_fp4_code(w[i], inv, 1, tagc_fp4_uniform(seed, o + i));
    } else {
        for (int i = 0; i < len; i++)
            c[i] = tagc_fp4_code(w[i], inv, 0, 0.0f);
    }
    c[len] = 0; /* the pad nibble of an odd last block */
    for (int i = 0; i < len; i += 2)
        codes[i >> 1] = (uint8_t)(c[i] | c[i + 1] << 4);
    if (rd == DT_NONE)
        return (int)sb;
    for (int i = 0; i < len; i++)
        w[i] = tagc_fp4_value(c[i]) * s;
    if (flags & TAGC_FP4_ROTATE)
        rotate(w, o, len, l, seed, 1);
    for (int i = 0; i < len; i++)
        st_val(r, rd, o + i, v[i] - w[i]);
    return (int)sb;
}

/* The encoding for constant dtypes (G, R); 0 when v is refused.  With a
 * residual, pass 1 checks all of v before pass 2 writes anything; without
 * one, a single pass checks each block as it goes (dst is unspecified after
 * a refusal).  Defined once with the generic loops and once with the AVX2
 * ones below (S: the suffix of all_below and encode_block for the whole
 * blocks, FN: the attributes); a last partial block takes the generic code. */
#define DEFINE_ENCODE_ALL(S, FN)                                                                 \
    FN int encode_all##S(uint8_t *dst, const void *g, int gd, void *r, int rd, int64_t n, int l, \
                         unsigned flags, uint64_t seed)                                          \
    {                                                                                            \
        const uint32_t limit = TAGC_FP4_MAX_BITS;                                                \
        if (rd != DT_NONE && !all_below##S(g, gd, r, rd, n, limit))                              \
            return 0;                                                                            \
        const int64_t block = (int64_t)1 << l, code_bytes = (n + 1) / 2;                         \
        int64_t o = 0, b = 0;                                                                    \
        int sb = 0;                                                                              \
        for (; o + block <= n && sb >= 0; o += block, b++) {                                     \
            sb = encode_block##S(dst + (o >> 1), g, gd, r, rd, o, 1 << l, l, flags, seed, limit); \
            dst[code_bytes + b] = (uint8_t)sb;                                                   \
        }                                                                                        \
        if (o < n && sb >= 0) {                                                                  \
            sb = encode_block(dst + (o >> 1), g, gd, r, rd, o, (int)(n - o), l, flags, seed,     \
                              limit);                                                            \
            dst[code_bytes + b] = (uint8_t)sb;                                                   \
        }                                                                                        \
        return sb >= 0;                                                                          \
    }

DEFINE_ENCODE_ALL(, TAGC_AI)

#ifdef TAGC_Q_AVX2
/*
 * The code of blocks of 32 or more with AVX2, rotated or not (round to
 * nearest), picked at run time when the CPU has it (as quant.c's encoder;
 * -DTAGC_QUANT_NO_AVX2 builds the generic loops only).  The generic loops'
 * arithmetic in their order, eight values a vector, so the bytes and the
 * residual are theirs bit for bit: the max of the magnitude patterns as
 * integers, the rotation's sign flips as xors of the hash's bits, each
 * butterfly the same a + b or a - b of the same two values, the product by
 * the norm after the butterflies, the code's index as the count of the
 * midpoints of tagc_fp4_code that y = |v| * inv passes (exact: inv is a
 * power of two), the decoded value as the index's E2M1 magnitude times the
 * scale with the code's sign (the generic multiplies the signed magnitude by
 * s: the same product), the residual v - w stored by st8.  Stochastic codes,
 * blocks under 32 and a last partial block take the generic loops.
 */

/* Lane j of row i: bit j of i moved to the sign. */
#define FM(i, j) ((((i) >> (j)) & 1u) << 31)
#define FROW(i) {FM(i, 0), FM(i, 1), FM(i, 2), FM(i, 3), FM(i, 4), FM(i, 5), FM(i, 6), FM(i, 7)}
#define FROW4(i) FROW(i), FROW((i) + 1), FROW((i) + 2), FROW((i) + 3)
#define FROW16(i) FROW4(i), FROW4((i) + 4), FROW4((i) + 8), FROW4((i) + 12)
#define FROW64(i) FROW16(i), FROW16((i) + 16), FROW16((i) + 32), FROW16((i) + 48)
/* The sign masks of eight lanes for each byte of flip bits (8 KiB). */
static const uint32_t flip_masks[256][8] __attribute__((aligned(32))) = {
    FROW64(0), FROW64(64), FROW64(128), FROW64(192)};
#undef FROW64
#undef FROW16
#undef FROW4
#undef FROW
#undef FM

/* The sign flips of 32 values in x[0..4) from the 32 bits of `word`: bit
 * 8 k + j to lane j's sign in vector k, one byte's masks from a table. */
TAGC_AVX2 void flip_signs_word(__m256 *x, uint32_t word)
{
    for (int j = 0; j < 4; j++)
        x[j] = _mm256_xor_ps(x[j],
                             _mm256_load_ps((const float *)flip_masks[(word >> 8 * j) & 255]));
}

/* The sign flips of the block's values at [o, o + 8 nv) held in x (nv a
 * multiple of 4): flip_signs' 32 bits of a hash per four vectors. */
TAGC_AVX2 void flip_signs_avx2(__m256 *x, int64_t o, int nv, uint64_t seed)
{
    const uint64_t ts = tagc_table_seed(seed, TAGC_FP4_SIGN_STREAM);
    for (int k = 0; k < nv; k += 4) {
        int64_t p = o + 8 * k;
        flip_signs_word(x + k, (uint32_t)(tagc_hash((uint64_t)p >> 6, ts) >> (p & 63)));
    }
}

/* One butterfly of the vectors a and b: a + b into a, a - b into b. */
#define FP4_BFLY(a, b)                 \
    do {                               \
        __m256 t_ = (a);               \
        (a) = _mm256_add_ps(t_, (b));  \
        (b) = _mm256_sub_ps(t_, (b));  \
    } while (0)

/* fwht of the 8 nv values in x (nv a multiple of 4), then each times norm:
 * strides 1, 2 and 4 within a vector, 8 and 16 between the four vectors of
 * a group of 32 values (in registers), the wider ones between groups.
 * Within a vector each lane gets its partner swapped in; with `finite`
 * (every value finite, as the encoder's are) the lane that takes a - b adds
 * its own value negated to the partner a (a + (-b): the same IEEE result);
 * otherwise a + b and a - b are both computed in the generic loops' operand
 * order and the lanes blended, so that a NaN comes out as theirs does (the
 * decoder's NaN scales). */
TAGC_AVX2 void fwht_avx2(__m256 *x, int nv, float norm, int finite)
{
#define NEG(a, b, c, d, e, f, g, h) \
    _mm256_castsi256_ps(_mm256_setr_epi32(a, b, c, d, e, f, g, h))
    const int m = (int)0x80000000u;
    const __m256 n1 = NEG(0, m, 0, m, 0, m, 0, m), n2 = NEG(0, 0, m, m, 0, 0, m, m),
                 n4 = NEG(0, 0, 0, 0, m, m, m, m);
#undef NEG
    const __m256 vn = _mm256_set1_ps(norm);
    const int last = nv == 4; /* no stride between groups: the norm now */
    for (int k = 0; k < nv; k += 4) {
        __m256 y[4];
        for (int j = 0; j < 4; j++) {
            __m256 v = x[k + j], a, b;
            if (finite) {
                v = _mm256_add_ps(_mm256_permute_ps(v, 0xb1), _mm256_xor_ps(v, n1));
                v = _mm256_add_ps(_mm256_permute_ps(v, 0x4e), _mm256_xor_ps(v, n2));
                y[j] = _mm256_add_ps(_mm256_permute2f128_ps(v, v, 1), _mm256_xor_ps(v, n4));
                continue;
            }
            a = _mm256_moveldup_ps(v), b = _mm256_movehdup_ps(v);
            v = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0xaa);
            a = _mm256_permute_ps(v, 0x44), b = _mm256_permute_ps(v, 0xee);
            v = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0xcc);
            a = _mm256_permute2f128_ps(v, v, 0x00), b = _mm256_permute2f128_ps(v, v, 0x11);
            y[j] = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0xf0);
        }
        FP4_BFLY(y[0], y[1]);
        FP4_BFLY(y[2], y[3]);
        FP4_BFLY(y[0], y[2]);
        FP4_BFLY(y[1], y[3]);
        for (int j = 0; j < 4; j++)
            x[k + j] = last ? _mm256_mul_ps(y[j], vn) : y[j];
    }
    if (last)
        return;
    for (int h = 4; h < nv; h <<= 1)
        for (int j = 0; j < nv; j += 2 * h)
            for (int i = j; i < j + h; i++)
                FP4_BFLY(x[i], x[i + h]);
    for (int k = 0; k < nv; k++)
        x[k] = _mm256_mul_ps(x[k], vn);
}

/* all_below with AVX2. */
TAGC_AVX2 int all_below_avx2(const void *g, int gd, const void *r, int rd, int64_t n,
                             uint32_t limit)
{
    __m256i mx = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            mx = _mm256_max_epu32(mx, mag8(ldv8(g, gd, r, rd, i + 8 * k)));
    uint32_t m = hmax8(mx);
    for (; i < n; i++) {
        uint32_t a = f2u(load_v(g, gd, r, rd, i)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m <= limit;
}

/* 4 tagc_fp4_inv(sb) = 2^(129 - sb), a float for sb >= 2; 0 for the two smallest
 * scales (blocks of subnormal size), which the generic loops code.  |v| inv4 equals
 * (|v| inv) 4 bit for bit: both scale |v| by powers of two without overflow, and
 * where |v| inv underflows y4 is below 1, code 0 either way. */
TAGC_AVX2 float fp4_inv4(uint32_t sb)
{
    return sb >= 2 ? tagc_fp4_inv(sb - 2) : 0.0f;
}

/* The 16 code bytes of the 32 values v0..v3 under inv4 = 4 inv (fp4_inv4; times the
 * norm for the gathers' loop's rotated blocks), without a residual: the midpoints
 * counted in bytes.  With y4 = |v| inv4 = 4 |v| inv (exact) the midpoints are the
 * integers 1, 3, 5, 7, 10, 14, 20; y passes a midpoint m taken with >= (3, 7, 14) when
 * floor(y4) >= m and one taken with > (1, 5, 10, 20) when ceil(y4) >= m + 1, so the
 * index is FLOOR_PASSED[floor(y4)] + CEIL_PASSED[ceil(y4)]: pshufb lookups of floor
 * and ceil capped at 15 (y4 <= 24, and no midpoint lies in 15..19), plus a compare for
 * the midpoint 20.  The same codes as tagc_fp4_code. */
TAGC_AVX2 void encode_group_avx2(uint8_t *codes, __m256 v0, __m256 v1, __m256 v2, __m256 v3,
                                __m256 inv4)
{
#define T16(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p) \
    _mm256_setr_epi8(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, \
                     a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p)
    /* [f >= 3] + [f >= 7] + [f >= 14] of min(f, 15) */
    const __m256i fl = T16(0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3);
    /* [c >= 2] + [c >= 6] + [c >= 11] of min(c, 15); [c >= 21] is a compare */
    const __m256i cl = T16(0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3);
#undef T16
    const __m256i fifteen = _mm256_set1_epi8(15), twenty = _mm256_set1_epi8(20),
                  eight = _mm256_set1_epi8(8);
    const __m256 v[4] = {v0, v1, v2, v3};
    __m256i f[4], c[4];
    for (int j = 0; j < 4; j++) {
        __m256 y4 = _mm256_mul_ps(_mm256_castsi256_ps(mag8(v[j])), inv4);
        f[j] = _mm256_cvttps_epi32(y4);
        c[j] = _mm256_cvttps_epi32(_mm256_round_ps(y4, _MM_FROUND_TO_POS_INF |
                                                           _MM_FROUND_NO_EXC));
    }
    __m256i fb = packs32(f[0], f[1], f[2], f[3]), cb = packs32(c[0], c[1], c[2], c[3]);
    __m256i idx = _mm256_add_epi8(
        _mm256_shuffle_epi8(fl, _mm256_min_epu8(fb, fifteen)),
        _mm256_sub_epi8(_mm256_shuffle_epi8(cl, _mm256_min_epu8(cb, fifteen)),
                        _mm256_cmpgt_epi8(cb, twenty)));
    /* bytes in the packs' order until the nibbles (each step is bytewise); the
     * values' bit patterns packed with signed saturation keep their signs */
    __m256i neg = _mm256_cmpgt_epi8(_mm256_setzero_si256(),
                                    packs32(_mm256_castps_si256(v0), _mm256_castps_si256(v1),
                                            _mm256_castps_si256(v2), _mm256_castps_si256(v3)));
    /* the sign bit where v < 0 and the index is not 0 (never -0) */
    __m256i s = _mm256_andnot_si256(_mm256_cmpeq_epi8(idx, _mm256_setzero_si256()), neg);
    idx = _mm256_or_si256(idx, _mm256_and_si256(s, eight));
    _mm_storeu_si128((__m128i *)codes, nibbles16(packs32_in_order(idx)));
}

/* encode_block for a block of len values (a multiple of 32, at most
 * TAGC_FP4_BLOCK_MAX, whole: len == 1 << l) without TAGC_FP4_STOCHASTIC. */
TAGC_AVX2 int encode_block_avx2(uint8_t *codes, const void *g, int gd, void *r, int rd,
                                int64_t o, int len, int l, unsigned flags, uint64_t seed,
                                uint32_t limit)
{
    const int nv = len / 8, rot = (flags & TAGC_FP4_ROTATE) != 0;
    const float norm = tagc_fp4_norm(l);
    __m256i mx = _mm256_setzero_si256();
    __m256 v[TAGC_FP4_BLOCK_MAX / 8], w[TAGC_FP4_BLOCK_MAX / 8];
    for (int k = 0; k < nv; k++) {
        v[k] = w[k] = ldv8(g, gd, r, rd, o + 8 * k);
        mx = _mm256_max_epu32(mx, mag8(v[k]));
    }
    uint32_t m = hmax8(mx);
    if (m > limit)
        return -1;
    if (rot) {
        flip_signs_avx2(w, o, nv, seed);
        fwht_avx2(w, nv, norm, 1);
        mx = _mm256_setzero_si256();
        for (int k = 0; k < nv; k++)
            mx = _mm256_max_epu32(mx, mag8(w[k]));
        m = hmax8(mx);
    }
    const uint32_t sb = tagc_fp4_scale_byte(m);
    if (rd == DT_NONE) {
        const float inv4 = fp4_inv4(sb);
        if (inv4 == 0.0f)
            return encode_block(codes, g, gd, r, rd, o, len, l, flags, seed, limit);
        for (int k = 0; k < nv; k += 4)
            encode_group_avx2(codes + 4 * k, w[k], w[k + 1], w[k + 2], w[k + 3],
                              _mm256_set1_ps(inv4));
        return (int)sb;
    }
    const __m256 inv = _mm256_set1_ps(tagc_fp4_inv(sb)), s = _mm256_set1_ps(tagc_fp4_scale(sb));
    const __m256 mag = _mm256_setr_ps(tagc_fp4_value(0), tagc_fp4_value(1), tagc_fp4_value(2),
                                      tagc_fp4_value(3), tagc_fp4_value(4), tagc_fp4_value(5),
                                      tagc_fp4_value(6), tagc_fp4_value(7));
    const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int k = 0; k < nv; k += 4) {
        __m256i q[4];
        for (int j = 0; j < 4; j++) {
            __m256 x = w[k + j];
            __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(mag8(x)), inv);
            /* each passed midpoint's mask is -1: the index is minus their sum */
#define PASSED(k, pred) _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(TAGC_FP4_MID##k), pred))
            __m256i t = _mm256_add_epi32(
                _mm256_add_epi32(_mm256_add_epi32(PASSED(0, _CMP_GT_OQ), PASSED(1, _CMP_GE_OQ)),
                                 _mm256_add_epi32(PASSED(2, _CMP_GT_OQ), PASSED(3, _CMP_GE_OQ))),
                _mm256_add_epi32(_mm256_add_epi32(PASSED(4, _CMP_GT_OQ), PASSED(5, _CMP_GE_OQ)),
                                 PASSED(6, _CMP_GT_OQ)));
#undef PASSED
            __m256i idx = _mm256_sub_epi32(_mm256_setzero_si256(), t);
            /* the sign bit where v < 0 and the index is not 0 (never -0) */
            __m256i neg = _mm256_andnot_si256(_mm256_cmpeq_epi32(idx, _mm256_setzero_si256()),
                                              _mm256_castps_si256(_mm256_cmp_ps(x, zero,
                                                                                _CMP_LT_OQ)));
            q[j] = _mm256_or_si256(idx, _mm256_and_si256(neg, _mm256_set1_epi32(8)));
            __m256 d = _mm256_mul_ps(_mm256_permutevar8x32_ps(mag, idx), s);
            d = _mm256_xor_ps(d, _mm256_and_ps(_mm256_castsi256_ps(neg), sign));
            /* rotated: the decoded value in w's place (its code is taken) until
             * the block is unrotated; else the residual at once (x is v) */
            if (rot)
                w[k + j] = d;
            else
                st8(r, rd, o + 8 * (k + j), _mm256_sub_ps(x, d));
        }
        _mm_storeu_si128((__m128i *)(codes + 4 * k), nibbles16(bytes32(q[0], q[1], q[2], q[3])));
    }
    if (rot) {
        fwht_avx2(w, nv, norm, 1);
        flip_signs_avx2(w, o, nv, seed);
        for (int k = 0; k < nv; k++)
            st8(r, rd, o + 8 * k, _mm256_sub_ps(v[k], w[k]));
    }
    return (int)sb;
}

DEFINE_ENCODE_ALL(_avx2, TAGC_AVX2)

/*
 * Gathers' form (blocks of 32, no residual, round to nearest) with FMA as well: the
 * refusal decided once from the running maximum of every block's magnitudes (dst is
 * unspecified after a refusal, as the single pass above leaves it), and each
 * in-vector butterfly one fused v * (+-1) + partner: the product is exact, so the sum
 * is rounded once, the a + b or a + (-b) of fwht_avx2's finite form (signed zeros
 * included).  The same bytes.
 */
#define TAGC_AVX2_FMA static inline __attribute__((always_inline, target("avx2,fma")))

/* fwht_avx2 (finite) of one group of 32 values in x[0..4), without the norm. */
TAGC_AVX2_FMA void fwht32_fma(__m256 *x)
{
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1),
                 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1),
                 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (int j = 0; j < 4; j++) {
        __m256 v = x[j];
        v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xb1));
        v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4e));
        x[j] = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 1));
    }
    FP4_BFLY(x[0], x[1]);
    FP4_BFLY(x[2], x[3]);
    FP4_BFLY(x[0], x[2]);
    FP4_BFLY(x[1], x[3]);
}

/* encode_block of the whole block of 32 at o without a residual: the gathers'
 * loop's blocks of extreme scales, out of line. */
__attribute__((noinline)) static void encode_block_generic(uint8_t *codes, const void *g,
                                                           int gd, int64_t o, unsigned flags,
                                                           uint64_t seed)
{
    encode_block(codes, g, gd, NULL, DT_NONE, o, 32, 5, flags, seed, TAGC_FP4_MAX_BITS);
}

/* tagc_fp4_scale_byte of eight patterns (finite ones: a refused call's bytes
 * are unspecified). */
TAGC_AVX2 __m256i scale_bytes8(__m256i bits)
{
    __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)),
                                    _mm256_set1_epi32(0x400000));
    __m256i b = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23),
                                                  _mm256_set1_epi32(2)), up);
    return _mm256_max_epi32(b, _mm256_setzero_si256());
}

/*
 * The gathers' loop codes groups of eight blocks in two passes: the first loads
 * each block (rotated: flips its signs and applies the butterflies) into u and
 * keeps its largest magnitude; the eight are reduced, and their scale bytes and
 * multipliers computed, as vectors; the second codes each block from u.  So a
 * block's codes do not wait on its own chain of load, rotation, horizontal
 * maximum and scale, which bounds a loop of one block at a time by its latency.
 *
 * A rotated block is kept without the norm: y4 = |u| (norm inv4) is fl(|u| norm)
 * inv4 (inv4 a power of two) where the product is normal, and where fl(|u| norm)
 * is subnormal both are below 1 (code 0) for scale bytes of 3 and more; the
 * block's largest fl(|u| norm) is fl(max |u| norm) (rounding is monotonic).
 * Blocks of the extreme scale bytes (multiplier 0 here) go to the generic loops.
 */
TAGC_AVX2_FMA int encode_gather32(uint8_t *dst, const void *g, int gd, int64_t n, int rot,
                                  uint64_t seed)
{
    const float norm = tagc_fp4_norm(5);
    const unsigned flags = rot ? TAGC_FP4_ROTATE : 0u;
    const uint64_t ts = tagc_table_seed(seed, TAGC_FP4_SIGN_STREAM);
    const int64_t code_bytes = (n + 1) / 2, blocks = n / 32;
    __m256i all = _mm256_setzero_si256();
    uint64_t h = 0;
    for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
        const int nb = blocks - b0 < 8 ? (int)(blocks - b0) : 8;
        __m256 u[8][4];
        __m256i mx[8];
        for (int i = 0; i < 8; i++)
            mx[i] = _mm256_setzero_si256();
        for (int i = 0; i < nb; i++) {
            const int64_t o = 32 * (b0 + i);
            for (int k = 0; k < 4; k++)
                u[i][k] = ld8(g, gd, o + 8 * k);
            if (rot) {
                if (!(o & 32)) /* one hash per 64 values */
                    h = tagc_hash((uint64_t)o >> 6, ts);
                flip_signs_word(u[i], (uint32_t)(h >> (o & 32)));
                fwht32_fma(u[i]);
            }
            mx[i] = _mm256_max_epu32(_mm256_max_epu32(mag8(u[i][0]), mag8(u[i][1])),
                                     _mm256_max_epu32(mag8(u[i][2]), mag8(u[i][3])));
        }
        const __m256i m = max8x8(mx);
        all = _mm256_max_epu32(all, m);
        __m256i sb;
        __m256 inv4, ok;
        if (rot) {
            sb = scale_bytes8(_mm256_castps_si256(
                _mm256_mul_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(norm))));
            ok = _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_cmpgt_epi32(sb, _mm256_set1_epi32(2)),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(251), sb)));
        } else {
            sb = scale_bytes8(m);
            ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(sb, _mm256_set1_epi32(1)));
        }
        /* fp4_inv4: 2^(129 - sb) */
        inv4 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(256), sb), 23));
        inv4 = _mm256_and_ps(rot ? _mm256_mul_ps(inv4, _mm256_set1_ps(norm)) : inv4, ok);
        float inv[8];
        _mm256_storeu_ps(inv, inv4);
        __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(sb), _mm256_extracti128_si256(sb, 1));
        uint8_t sbs[16];
        _mm_storeu_si128((__m128i *)sbs, _mm_packus_epi16(s16, s16));
        memcpy(dst + code_bytes + b0, sbs, (size_t)nb);
        for (int i = 0; i < nb; i++)
            encode_group_avx2(dst + 16 * (b0 + i), u[i][0], u[i][1], u[i][2], u[i][3],
                              _mm256_broadcast_ss(&inv[i]));
        unsigned rare = ~(unsigned)_mm256_movemask_ps(ok) & ((1u << nb) - 1);
        for (; rare; rare &= rare - 1) {
            const int64_t b = b0 + __builtin_ctz(rare);
            encode_block_generic(dst + 16 * b, g, gd, 32 * b, flags, seed);
        }
    }
    /* Rotated, all holds the largest unnormed |H D v|, which bounds every |v|
     * (v = D H (H D v) / 32): below half the limit (a margin over the
     * butterflies' rounding) nothing is refused; above, the input decides. */
    const uint32_t m = hmax8(all);
    const int64_t o = 32 * blocks;
    if (rot ? m > TAGC_FP4_MAX_BITS - (1u << 23) && !all_below_avx2(g, gd, NULL, DT_NONE, o,
                                                                   TAGC_FP4_MAX_BITS)
            : m > TAGC_FP4_MAX_BITS)
        return 0;
    if (o == n)
        return 1;
    int sb = encode_block(dst + (o >> 1), g, gd, NULL, DT_NONE, o, (int)(n - o), 5, flags,
                          seed, TAGC_FP4_MAX_BITS);
    dst[code_bytes + blocks] = (uint8_t)sb;
    return sb >= 0;
}

__attribute__((target("avx2,fma"))) static int encode_gather32_dtypes(uint8_t *dst,
                                                                      const void *g, int gd,
                                                                      int64_t n, int rot,
                                                                      uint64_t seed)
{
    if (gd == TAGC_F32)
        return rot ? encode_gather32(dst, g, TAGC_F32, n, 1, seed)
                   : encode_gather32(dst, g, TAGC_F32, n, 0, seed);
    return rot ? encode_gather32(dst, g, TAGC_BF16, n, 1, seed)
               : encode_gather32(dst, g, TAGC_BF16, n, 0, seed);
}

__attribute__((target("avx2"))) static int encode_dtypes_avx2(uint8_t *dst, const void *g,
                                                              int gd, void *r, int rd,
                                                              int64_t n, int l, unsigned flags,
                                                              uint64_t seed)
{
    BY_DTYPES(return encode_all_avx2(dst, g, G, r, R, n, l, flags, seed));
    return 0; /* unreachable: the dtypes were checked */
}
#endif

/* The encoder is inlined per dtype pair (BY_DTYPES); the block stays a
 * variable: constant blocks as well made this file most of a build's time and
 * the encoder no faster. */
/* The decoder's common blocks as constants (the inverse rotation's
 * butterflies unrolled: twice the speed at 32). */
#define FP4_BY_LOG2(l, call)                     \
    switch (l) {                                 \
    case 4: { enum { L = 4 }; call; } break;     \
    case 5: { enum { L = 5 }; call; } break;     \
    default: { const int L = l; call; } break;   \
    }

TAGC_HOT_CLONES static int encode_dtypes(uint8_t *dst, const void *g, int gd, void *r, int rd,
                                         int64_t n, int l, unsigned flags, uint64_t seed)
{
    BY_DTYPES(return encode_all(dst, g, G, r, R, n, l, flags, seed));
    return 0; /* unreachable: the dtypes were checked */
}

/* The encoder for the flags, block and dtypes at hand and this CPU. */
static int encode_dispatch(uint8_t *dst, const void *g, int gd, void *r, int rd, int64_t n,
                           int l, unsigned flags, uint64_t seed)
{
#ifdef TAGC_Q_AVX2
    if (!(flags & TAGC_FP4_STOCHASTIC) && l >= 5 && __builtin_cpu_supports("avx2")) {
        if (l == 5 && rd == DT_NONE && __builtin_cpu_supports("fma"))
            return encode_gather32_dtypes(dst, g, gd, n, (flags & TAGC_FP4_ROTATE) != 0, seed);
        return encode_dtypes_avx2(dst, g, gd, r, rd, n, l, flags, seed);
    }
#endif
    return encode_dtypes(dst, g, gd, r, rd, n, l, flags, seed);
}

int64_t tagc_fp4_bytes(int64_t n, int64_t block)
{
    return tagc_fp4_size(n, block);
}

tagc_status tagc_fp4_encode(uint8_t *dst, int64_t dst_capacity,
                            void *residual, tagc_dtype residual_dtype,
                            const void *grad, tagc_dtype grad_dtype,
                            int64_t n, int64_t block, unsigned flags, uint64_t seed)
{
    tagc_status st = tagc_fp4_check_encode(dst, dst_capacity, residual, (int)residual_dtype,
                                           grad, (int)grad_dtype, n, block, flags);
    if (st != TAGC_OK || n == 0)
        return st;
    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    if (!encode_dispatch(dst, grad, (int)grad_dtype, residual, rd, n, tagc_fp4_log2(block),
                         flags, seed))
        return TAGC_ERR_NONFINITE;
    return TAGC_OK;
}

/* out[o, o + len) += the decoded block whose codes start at `codes`. */
TAGC_AI void decode_block(float *out, const uint8_t *codes, uint32_t sb, int64_t o, int len,
                          int l, unsigned flags, uint64_t seed)
{
    float w[TAGC_FP4_BLOCK_MAX];
    const float s = tagc_fp4_scale(sb);
    for (int j = 0; j < len / 2; j++) {
        w[2 * j] = tagc_fp4_value(codes[j] & 15u) * s;
        w[2 * j + 1] = tagc_fp4_value((unsigned)codes[j] >> 4) * s;
    }
    if (len & 1)
        w[len - 1] = tagc_fp4_value(codes[len >> 1] & 15u) * s;
    if (flags & TAGC_FP4_ROTATE)
        rotate(w, o, len, l, seed, 1);
    for (int i = 0; i < len; i++)
        out[o + i] += w[i];
}

/* The decoding of n values: whole blocks by decode_block##S, a last partial
 * block by the generic decode_block.  Defined once with the generic loop and
 * once with the AVX2 one below (FN: the attributes). */
#define DEFINE_DECODE_ALL(S, FN)                                                          \
    FN void decode_all##S(float *out, int64_t n, const uint8_t *src, int l, unsigned flags, \
                          uint64_t seed)                                                  \
    {                                                                                     \
        const int64_t block = (int64_t)1 << l, code_bytes = (n + 1) / 2;                  \
        int64_t o = 0, b = 0;                                                             \
        for (; o + block <= n; o += block, b++)                                           \
            decode_block##S(out, src + (o >> 1), src[code_bytes + b], o, 1 << l, l, flags, \
                            seed);                                                        \
        if (o < n)                                                                        \
            decode_block(out, src + (o >> 1), src[code_bytes + b], o, (int)(n - o), l,   \
                         flags, seed);                                                    \
    }

DEFINE_DECODE_ALL(, TAGC_AI)

#ifdef TAGC_Q_AVX2
/* decode_block for a whole block of len values (a multiple of 32, at most
 * TAGC_FP4_BLOCK_MAX), eight values a vector: each nibble's signed E2M1
 * value from two tables (the sign bit picks), times the scale (the generic
 * product, NaN scales alike), the inverse rotation as the encoder's. */
TAGC_AVX2 void decode_block_avx2(float *out, const uint8_t *codes, uint32_t sb, int64_t o,
                                 int len, int l, unsigned flags, uint64_t seed)
{
    const int nv = len / 8;
    const __m256 s = _mm256_set1_ps(tagc_fp4_scale(sb));
    const __m256 pos = _mm256_setr_ps(tagc_fp4_value(0), tagc_fp4_value(1), tagc_fp4_value(2),
                                      tagc_fp4_value(3), tagc_fp4_value(4), tagc_fp4_value(5),
                                      tagc_fp4_value(6), tagc_fp4_value(7));
    const __m256 neg = _mm256_setr_ps(tagc_fp4_value(8), tagc_fp4_value(9), tagc_fp4_value(10),
                                      tagc_fp4_value(11), tagc_fp4_value(12), tagc_fp4_value(13),
                                      tagc_fp4_value(14), tagc_fp4_value(15));
    const __m128i low = _mm_set1_epi8(15);
    __m256 w[TAGC_FP4_BLOCK_MAX / 8];
    for (int k = 0; k < nv; k++) {
        uint32_t four;
        memcpy(&four, codes + 4 * k, sizeof four);
        __m128i b = _mm_cvtsi32_si128((int)four);
        __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, low),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), low));
        __m256i c = _mm256_cvtepu8_epi32(nib);
        __m256 m = _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, c),
                                    _mm256_permutevar8x32_ps(neg, c),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
        w[k] = _mm256_mul_ps(m, s);
    }
    if (flags & TAGC_FP4_ROTATE) {
        /* below the scale byte 245 no sum of up to 256 values of at most 6 s reaches
         * FLT_MAX: every value stays finite and the butterflies take fwht_avx2's
         * finite form (the same bits); above, Inf - Inf and NaN scales make NaNs */
        _Static_assert(TAGC_FP4_BLOCK_MAX <= 256, "the finite form's bound assumes 256");
        fwht_avx2(w, nv, tagc_fp4_norm(l), sb < 245);
        flip_signs_avx2(w, o, nv, seed);
    }
    for (int k = 0; k < nv; k++)
        _mm256_storeu_ps(out + o + 8 * k, _mm256_add_ps(_mm256_loadu_ps(out + o + 8 * k), w[k]));
}

/* decode_all with the whole blocks' AVX2 loop (l >= 5). */
DEFINE_DECODE_ALL(_avx2, __attribute__((target("avx2"))) static)
#endif

TAGC_HOT_CLONES static void decode_dispatch(float *out, int64_t n, const uint8_t *src, int l,
                                            unsigned flags, uint64_t seed)
{
#ifdef TAGC_Q_AVX2
    if (l >= 5 && __builtin_cpu_supports("avx2")) {
        decode_all_avx2(out, n, src, l, flags, seed);
        return;
    }
#endif
    FP4_BY_LOG2(l, decode_all(out, n, src, L, flags, seed));
}

tagc_status tagc_fp4_decode_add(float *out, int64_t n,
                                const uint8_t *src, int64_t src_bytes,
                                int64_t block, unsigned flags, uint64_t seed)
{
    tagc_status st = tagc_fp4_check_decode(out, n, src, src_bytes, block, flags);
    if (st != TAGC_OK || n == 0)
        return st;
    decode_dispatch(out, n, src, tagc_fp4_log2(block), flags, seed);
    return TAGC_OK;
}

tagc_status tagc_rht(float *dst, int64_t dst_capacity, const float *src, int64_t n,
                     int64_t block, uint64_t seed, int inverse)
{
    tagc_status st = tagc_fp4_check_rht(dst, dst_capacity, src, n, block);
    if (st != TAGC_OK || n == 0)
        return st;
    const int l = tagc_fp4_log2(block);
    float w[TAGC_FP4_BLOCK_MAX];
    for (int64_t o = 0; o < n; o += block) {
        int len = n - o < block ? (int)(n - o) : (int)block;
        memcpy(w, src + o, (size_t)len * sizeof *w);
        rotate(w, o, len, l, seed, inverse != 0);
        memcpy(dst + o, w, (size_t)len * sizeof *w);
    }
    return TAGC_OK;
}
