/*
 * fp4.c - 4-bit block codes (E2M1 values, E8M0 block scales) with error
 * feedback and the optional seeded block Hadamard rotation (tagc.h,
 * tagc_fp4_* and tagc_rht).  The per-value arithmetic is fp4.h's, shared
 * with cuda/fp4.cu; the butterflies are each one fp32 add or subtract, so
 * any order within a stage gives the same bits, on the CPU and the GPU.
 */
#include <string.h>

#include "fp4.h"
#include "tagc_internal.h"

/* Magnitude patterns above these are refused as NONFINITE: FLT_MAX, and
 * just below 2^100 when rotating (a rotation multiplies magnitudes by at
 * most sqrt(block) <= 16, and its butterflies by at most block). */
#define FP4_MAX_BITS 0x7f7fffffu
#define FP4_MAX_BITS_ROTATED 0x717fffffu

/* The fast Walsh-Hadamard transform of x[0..len), len a power of two. */
TAGC_AI void fwht(float *x, int len)
{
    for (int h = 1; h < len; h <<= 1)
        for (int j = 0; j < len; j += 2 * h)
            for (int i = j; i < j + h; i++) {
                float a = x[i], b = x[i + h];
                x[i] = a + b;
                x[i + h] = a - b;
            }
}

/* x[i] *= the sign of position o + i (tagc_fp4_flip_bit), i < len: one hash
 * per 64 positions. */
TAGC_AI void flip_signs(float *x, int64_t o, int len, uint64_t seed)
{
    const uint64_t ts = tagc_table_seed(seed, TAGC_FP4_SIGN_STREAM);
    for (int i = 0; i < len;) {
        int64_t p = o + i;
        int at = (int)(p & 63), cnt = 64 - at < len - i ? 64 - at : len - i;
        uint64_t h = tagc_hash((uint64_t)p >> 6, ts) >> at;
        for (int j = 0; j < cnt; j++)
            x[i + j] = tagc_fp4_xor_sign(x[i + j], (uint32_t)(h >> j) & 1u);
        i += cnt;
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
        fwht(x, len);
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
 * at the block's first byte), its scale byte (returned), and the residual. */
TAGC_AI uint32_t encode_block(uint8_t *codes, const void *g, int gd, void *r, int rd,
                              int64_t o, int len, int l, unsigned flags, uint64_t seed)
{
    float v[TAGC_FP4_BLOCK_MAX], w[TAGC_FP4_BLOCK_MAX];
    uint8_t c[TAGC_FP4_BLOCK_MAX + 1];
    for (int i = 0; i < len; i++)
        v[i] = w[i] = load_v(g, gd, r, rd, o + i);
    if (flags & TAGC_FP4_ROTATE)
        rotate(w, o, len, l, seed, 0);
    uint32_t sb = tagc_fp4_scale_byte(max_bits(w, len));
    const float inv = tagc_fp4_inv(sb), s = tagc_fp4_scale(sb);
    if (flags & TAGC_FP4_STOCHASTIC) {
        for (int i = 0; i < len; i++)
            c[i] = (uint8_t)tagc_fp4_code(w[i], inv, 1, tagc_fp4_uniform(seed, o + i));
    } else {
        for (int i = 0; i < len; i++)
            c[i] = (uint8_t)tagc_fp4_code(w[i], inv, 0, 0.0f);
    }
    c[len] = 0; /* the pad nibble of an odd last block */
    for (int i = 0; i < len; i += 2)
        codes[i >> 1] = (uint8_t)(c[i] | c[i + 1] << 4);
    if (rd == DT_NONE)
        return sb;
    for (int i = 0; i < len; i++)
        w[i] = tagc_fp4_value(c[i]) * s;
    if (flags & TAGC_FP4_ROTATE)
        rotate(w, o, len, l, seed, 1);
    for (int i = 0; i < len; i++)
        st_val(r, rd, o + i, v[i] - w[i]);
    return sb;
}

/* Both passes for constant dtypes (G, R) and block 1 << L (L == 0: any,
 * from l); 0 when pass 1 refuses v. */
TAGC_AI int encode_all(uint8_t *dst, const void *g, int gd, void *r, int rd, int64_t n,
                       int l, unsigned flags, uint64_t seed)
{
    const uint32_t limit = (flags & TAGC_FP4_ROTATE) ? FP4_MAX_BITS_ROTATED : FP4_MAX_BITS;
    if (!all_below(g, gd, r, rd, n, limit))
        return 0;
    const int64_t block = (int64_t)1 << l, code_bytes = (n + 1) / 2;
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int len = n - o < block ? (int)(n - o) : (int)block;
        dst[code_bytes + b] = (uint8_t)encode_block(dst + (o >> 1), g, gd, r, rd, o, len, l,
                                                    flags, seed);
    }
    return 1;
}

/* One test per (grad, residual) dtype pair and the common blocks, each
 * case inlining the loops for constants. */
#define FP4_DT_CASE(g0, r0, call) \
    if (gd == (g0) && rd == (r0)) { enum { G = g0, R = r0 }; call; }
#define FP4_BY_DTYPES(call)                                                        \
    FP4_DT_CASE(TAGC_F32, DT_NONE, call) FP4_DT_CASE(TAGC_F32, TAGC_F32, call)     \
    FP4_DT_CASE(TAGC_F32, TAGC_BF16, call) FP4_DT_CASE(TAGC_BF16, DT_NONE, call)   \
    FP4_DT_CASE(TAGC_BF16, TAGC_F32, call) FP4_DT_CASE(TAGC_BF16, TAGC_BF16, call)
#define FP4_BY_LOG2(l, call)                     \
    switch (l) {                                 \
    case 4: { enum { L = 4 }; call; } break;     \
    case 5: { enum { L = 5 }; call; } break;     \
    default: { const int L = l; call; } break;   \
    }

TAGC_HOT_CLONES static int encode_dispatch(uint8_t *dst, const void *g, int gd, void *r, int rd,
                                           int64_t n, int l, unsigned flags, uint64_t seed)
{
    FP4_BY_DTYPES(FP4_BY_LOG2(l, return encode_all(dst, g, G, r, R, n, L, flags, seed)));
    return 0; /* unreachable: the dtypes were checked */
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
    for (int i = 0; i < len; i++)
        w[i] = tagc_fp4_value((unsigned)(codes[i >> 1] >> (4 * (i & 1))) & 15u) * s;
    if (flags & TAGC_FP4_ROTATE)
        rotate(w, o, len, l, seed, 1);
    for (int i = 0; i < len; i++)
        out[o + i] += w[i];
}

TAGC_AI void decode_all(float *out, int64_t n, const uint8_t *src, int l, unsigned flags,
                        uint64_t seed)
{
    const int64_t block = (int64_t)1 << l, code_bytes = (n + 1) / 2;
    for (int64_t o = 0, b = 0; o < n; o += block, b++) {
        int len = n - o < block ? (int)(n - o) : (int)block;
        decode_block(out, src + (o >> 1), src[code_bytes + b], o, len, l, flags, seed);
    }
}

TAGC_HOT_CLONES static void decode_dispatch(float *out, int64_t n, const uint8_t *src, int l,
                                            unsigned flags, uint64_t seed)
{
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
