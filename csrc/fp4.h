/*
 * fp4.h - the arithmetic of the 4-bit codes (tagc.h's tagc_fp4_* and
 * tagc_rht), shared verbatim by csrc/fp4.c and cuda/fp4.cu so that both
 * write the same bytes: the E8M0 block scale, the E2M1 code of a value
 * (round to nearest, ties to even, or stochastic), the sign-flip and
 * stochastic-rounding hashes, the Hadamard normalisation, and the argument
 * checks.  Internal: not installed, not part of the contract.
 */
#ifndef TAGC_FP4_H
#define TAGC_FP4_H

#include <stdint.h>

#include "tagc.h"
#include "tagc_portable.h"

/* The known flag bits of tagc_fp4_encode / tagc_fp4_decode_add. */
#define TAGC_FP4_FLAGS_ALL (TAGC_FP4_ROTATE | TAGC_FP4_STOCHASTIC)

/* Magnitude patterns above this (just below 2^100) are refused as
 * NONFINITE: far from overflow whatever happens next (a rotation multiplies
 * magnitudes by at most sqrt(block) <= 16, its butterflies by at most
 * block, and a code rounds up by at most 4/3, while near FLT_MAX a block's
 * top code times its scale could overflow). */
#define TAGC_FP4_MAX_BITS 0x717fffffu

/* Seed streams of the sign flips and of stochastic rounding: sub-seeds
 * derived from the call seed like the sketch's tables (none of which uses
 * these numbers). */
#define TAGC_FP4_SIGN_STREAM 16
#define TAGC_FP4_SR_STREAM 17

/* log2 of a valid block (a power of two in [2, TAGC_FP4_BLOCK_MAX]), or -1. */
TAGC_HD int tagc_fp4_log2(int64_t block)
{
    if (block < 2 || block > TAGC_FP4_BLOCK_MAX || (block & (block - 1)) != 0)
        return -1;
    int l = 0;
    while (((int64_t)1 << l) < block)
        l++;
    return l;
}

/* ceil(n / 2) code bytes, then ceil(n / block) scale bytes; -1 when invalid. */
TAGC_HD int64_t tagc_fp4_size(int64_t n, int64_t block)
{
    if (n < 0 || n > TAGC_MAX_N || tagc_fp4_log2(block) < 0)
        return -1;
    return (n + 1) / 2 + (n + block - 1) / block;
}

/* 1 / sqrt(block) as a float, block = 2^l: a power of two for even l, else
 * the float of 1/sqrt(2) times one (an exact product). */
TAGC_HD float tagc_fp4_norm(int l)
{
    union { uint32_t u; float f; } p;
    p.u = (uint32_t)(127 - l / 2) << 23; /* 2^-(l/2) */
    return (l & 1) ? 0.70710678118654752f * p.f : p.f;
}

/* Whether element i's sign is flipped by the rotation under `seed`: bit
 * i % 64 of the hash of i / 64 (one hash per 64 elements). */
TAGC_HD uint32_t tagc_fp4_flip_bit(uint64_t seed, int64_t i)
{
    uint64_t h = tagc_hash((uint64_t)i >> 6, tagc_table_seed(seed, TAGC_FP4_SIGN_STREAM));
    return (uint32_t)(h >> (i & 63)) & 1u;
}

/* v with its sign bit xor-ed with `bit` (exact). */
TAGC_HD float tagc_fp4_xor_sign(float v, uint32_t bit)
{
    union { uint32_t u; float f; } p;
    p.f = v;
    p.u ^= bit << 31;
    return p.f;
}

/* The uniform in [0, 1) (24 bits) that stochastic rounding of element i
 * compares with: 32 bits of the hash of i / 2 each. */
TAGC_HD float tagc_fp4_uniform(uint64_t seed, int64_t i)
{
    uint64_t h = tagc_hash((uint64_t)i >> 1, tagc_table_seed(seed, TAGC_FP4_SR_STREAM));
    uint32_t w = (uint32_t)(h >> (32 * (i & 1)));
    return (float)(w >> 8) * 5.9604644775390625e-8f; /* 2^-24 */
}

/* The E8M0 scale byte of a block whose largest magnitude has the pattern
 * `max_bits` (finite): the smallest power of two s with max <= 6 s, the
 * byte holding log2(s) + 127, clamped at 0 (s = 2^-127: a block that small
 * codes to zeros and stays in the residual).  max = m 2^E, m in [1, 2):
 * s = 2^(E - 2) when m <= 1.5, else 2^(E - 1). */
TAGC_HD uint32_t tagc_fp4_scale_byte(uint32_t max_bits)
{
    int e = (int)(max_bits >> 23);
    if (e == 0)
        return 0u;
    int b = e - 2 + ((max_bits & 0x7fffffu) > 0x400000u ? 1 : 0);
    return b < 0 ? 0u : (uint32_t)b;
}

/* The scale of a scale byte: 2^(b - 127); 255 is NaN (E8M0's NaN). */
TAGC_HD float tagc_fp4_scale(uint32_t b)
{
    union { uint32_t u; float f; } p;
    p.u = b == 255u ? 0x7fc00000u : b == 0u ? 0x00400000u : b << 23;
    return p.f;
}

/* 1 / scale, exact: 2^(127 - b) for b <= 253 (what the encoder writes). */
TAGC_HD float tagc_fp4_inv(uint32_t b)
{
    union { uint32_t u; float f; } p;
    p.u = (254u - b) << 23;
    return p.f;
}

/* Twice the magnitude of E2M1 index k (0..7): 0, 1, 2, 3, 4, 6, 8, 12. */
TAGC_HD int tagc_fp4_level2(int k)
{
    return k + (k > 4 ? k - 4 : 0) + (k == 7 ? 2 : 0);
}

/* The value of a 4-bit code (bit 3 the sign, bits 0-2 the index). */
TAGC_HD float tagc_fp4_value(unsigned c)
{
    float m = 0.5f * (float)tagc_fp4_level2((int)(c & 7u));
    return (c & 8u) ? -m : m;
}

/* The midpoints between neighbouring E2M1 magnitudes: y above midpoint k
 * rounds to index k + 1, and y equal to it to the even one of k and k + 1
 * (up for k = 1, 3, 5: hence >= there and > at the others). */
#define TAGC_FP4_MID0 0.25f
#define TAGC_FP4_MID1 0.75f
#define TAGC_FP4_MID2 1.25f
#define TAGC_FP4_MID3 1.75f
#define TAGC_FP4_MID4 2.5f
#define TAGC_FP4_MID5 3.5f
#define TAGC_FP4_MID6 5.0f

/* Code of v under inv = tagc_fp4_inv(scale byte), |v| * inv <= 6: the
 * nearest E2M1 value, ties to the even index (mantissa bit 0, as IEEE);
 * stochastic (u in [0, 1)): the magnitude just below y = |v| * inv rounded
 * up when y - below > u * (above - below).  Zero is always code 0 (no -0). */
TAGC_HD unsigned tagc_fp4_code(float v, float inv, int stochastic, float u)
{
#if defined(__CUDA_ARCH__)
    float y = __fmul_rn(fabsf(v), inv);
#else
    float y = fabsf(v) * inv;
#endif
    int k;
    if (!stochastic) {
        k = (y > TAGC_FP4_MID0) + (y >= TAGC_FP4_MID1) + (y > TAGC_FP4_MID2) +
            (y >= TAGC_FP4_MID3) + (y > TAGC_FP4_MID4) + (y >= TAGC_FP4_MID5) +
            (y > TAGC_FP4_MID6);
    } else {
        k = (y >= 0.5f) + (y >= 1.0f) + (y >= 1.5f) + (y >= 2.0f) + (y >= 3.0f) +
            (y >= 4.0f) + (y >= 6.0f);
        float lo = 0.5f * (float)tagc_fp4_level2(k);
        float hi = 0.5f * (float)tagc_fp4_level2(k < 7 ? k + 1 : 7);
#if defined(__CUDA_ARCH__)
        k += __fsub_rn(y, lo) > __fmul_rn(u, __fsub_rn(hi, lo));
#else
        k += (y - lo) > u * (hi - lo);
#endif
    }
    return (unsigned)k | ((unsigned)(v < 0.0f) & (unsigned)(k > 0)) << 3;
}

/* ---- argument checks, shared by the C ops and the CUDA launchers ---- */

static inline tagc_status tagc_fp4_check_encode(const uint8_t *dst, int64_t dst_capacity,
                                                const void *residual, int residual_dtype,
                                                const void *grad, int grad_dtype, int64_t n,
                                                int64_t block, unsigned flags)
{
    if (n > 0 && (dst == NULL || grad == NULL))
        return TAGC_ERR_ARG;
    if ((grad_dtype != TAGC_F32 && grad_dtype != TAGC_BF16) ||
        (residual != NULL && residual_dtype != TAGC_F32 && residual_dtype != TAGC_BF16))
        return TAGC_ERR_DTYPE;
    int64_t need = tagc_fp4_size(n, block);
    if (need < 0 || (flags & ~(unsigned)TAGC_FP4_FLAGS_ALL) != 0)
        return TAGC_ERR_RANGE;
    return dst_capacity < need ? TAGC_ERR_CAPACITY : TAGC_OK;
}

static inline tagc_status tagc_fp4_check_decode(const float *out, int64_t n, const uint8_t *src,
                                                int64_t src_bytes, int64_t block,
                                                unsigned flags)
{
    if (n > 0 && (out == NULL || src == NULL))
        return TAGC_ERR_ARG;
    int64_t need = tagc_fp4_size(n, block);
    if (need < 0 || src_bytes != need || (flags & ~(unsigned)TAGC_FP4_FLAGS_ALL) != 0)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

static inline tagc_status tagc_fp4_check_rht(const float *dst, int64_t dst_capacity,
                                             const float *src, int64_t n, int64_t block)
{
    if (n > 0 && (dst == NULL || src == NULL))
        return TAGC_ERR_ARG;
    if (n < 0 || n > TAGC_MAX_N || tagc_fp4_log2(block) < 0)
        return TAGC_ERR_RANGE;
    return dst_capacity < n ? TAGC_ERR_CAPACITY : TAGC_OK;
}

#endif /* TAGC_FP4_H */
