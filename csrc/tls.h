/*
 * tls.h - the arithmetic of the ternary code with two-level log scales
 * (tagc.h's tagc_tls_*), shared verbatim by csrc/tls.c and cuda/tls.cu so
 * that both write the same bytes: a block's raw scale, the group and block
 * scale codes (found by comparisons with constant thresholds, no libm
 * call), the scales they decode to, the layout's offsets and the argument
 * checks.  Internal: not installed, not part of the contract.
 */
#ifndef TAGC_TLS_H
#define TAGC_TLS_H

#include <stdint.h>

#include "tagc.h"
#include "tagc_portable.h"

/* The fp32 constants of the scale codes: float(2^(-k/16)) and the
 * geometric midpoints float(2^((k + 0.5)/16)) of a group code's octave,
 * float(2^(-k/3)) and float(2^((k + 0.5)/3)) of a block code's.  The
 * values, not how a compiler would compute them, define the format. */
#define TAGC_TLS_G16(k)                                                                   \
    ((k) == 0 ? 0x1p+0f : (k) == 1 ? 0x1.ea4afap-1f : (k) == 2 ? 0x1.d5818ep-1f           \
     : (k) == 3 ? 0x1.c199bep-1f : (k) == 4 ? 0x1.ae89fap-1f : (k) == 5 ? 0x1.9c4918p-1f  \
     : (k) == 6 ? 0x1.8ace54p-1f : (k) == 7 ? 0x1.7a1148p-1f : (k) == 8 ? 0x1.6a09e6p-1f  \
     : (k) == 9 ? 0x1.5ab07ep-1f : (k) == 10 ? 0x1.4bfdaep-1f : (k) == 11 ? 0x1.3dea64p-1f \
     : (k) == 12 ? 0x1.306fep-1f : (k) == 13 ? 0x1.2387a6p-1f : (k) == 14 ? 0x1.172b84p-1f \
     : 0x1.0b5586p-1f)

/* The block codes' constants: the midpoints float(2^((k + 0.5)/3)) of an
 * octave's three steps (k = 0, 1, 2) and the steps float(2^(-k/3)) (k = 1, 2). */
#define TAGC_TLS_BMID0 0x1.1f59acp+0f
#define TAGC_TLS_BMID1 0x1.6a09e6p+0f
#define TAGC_TLS_BMID2 0x1.c823e0p+0f
#define TAGC_TLS_BSTEP1 0x1.965feap-1f
#define TAGC_TLS_BSTEP2 0x1.428a30p-1f

/* x = y 2^e for x >= 0: returns e (the exponent field less 127; below -126
 * for 0 and subnormals) and sets y in [1, 2) (x's significand). */
TAGC_HD int tagc_tls_octave(float x, float *y)
{
    union { float f; uint32_t u; } p;
    p.f = x;
    int e = (int)(p.u >> 23) - 127;
    p.u = (p.u & 0x7fffffu) | 0x3f800000u;
    *y = p.f;
    return e;
}

/* Group code of a ratio x = R / S in (0, 1] (R a group's largest raw
 * scale, S the message's): the g in [0, 254] nearest to -16 log2 x, i.e.
 * x = y 2^E with y in [1, 2) and g = -16 E minus the number of midpoints
 * 2^((k + 0.5)/16) at or below y; x below FLT_MIN (2^-126, beyond the
 * code's 15.9 octaves) gives 254. */
TAGC_HD int tagc_tls_group_code(float x)
{
    float y;
    int e = tagc_tls_octave(x, &y);
    if (e < -126)
        return 254;
    int c = (y >= 0x1.059b0ep+0f) + (y >= 0x1.11301ep+0f) + (y >= 0x1.1d4874p+0f) +
            (y >= 0x1.29e9e0p+0f) + (y >= 0x1.371a74p+0f) + (y >= 0x1.44e086p+0f) +
            (y >= 0x1.5342b6p+0f) + (y >= 0x1.6247ecp+0f) + (y >= 0x1.71f75ep+0f) +
            (y >= 0x1.82589ap+0f) + (y >= 0x1.93737cp+0f) + (y >= 0x1.a5503cp+0f) +
            (y >= 0x1.b7f770p+0f) + (y >= 0x1.cb720ep+0f) + (y >= 0x1.dfc974p+0f) +
            (y >= 0x1.f50766p+0f);
    int g = -16 * e - c;
    return g < 0 ? 0 : g > 254 ? 254 : g;
}

/* Block code of a ratio z = r / M > 0 (r a block's raw scale, M its
 * group's decoded scale; z may exceed 1 by the group code's rounding): the
 * b in [0, 14] nearest to -3 log2 z, clamped (a block more than 14/3
 * octaves below its group's scale is coded at that floor). */
TAGC_HD int tagc_tls_block_code(float z)
{
    float y;
    int e = tagc_tls_octave(z, &y);
    if (e < -126)
        return 14;
    int c = (y >= TAGC_TLS_BMID0) + (y >= TAGC_TLS_BMID1) + (y >= TAGC_TLS_BMID2);
    int b = -3 * e - c;
    return b < 0 ? 0 : b > 14 ? 14 : b;
}

/* f times 2^-sh (0 <= sh <= 15), exact unless the result is below
 * FLT_MIN, which gives 0 (so a decoded scale is 0 or normal, on every
 * device, with or without flush-to-zero). */
TAGC_HD float tagc_tls_shift(float f, int sh)
{
    union { float f; uint32_t u; } p;
    p.u = (uint32_t)(127 - sh) << 23;
#if defined(__CUDA_ARCH__)
    float r = __fmul_rn(f, p.f);
#else
    float r = f * p.f;
#endif
    return r < 1.17549435e-38f ? 0.0f : r;
}

/* The decoded scale of group code g under the message scale S (255: 0). */
TAGC_HD float tagc_tls_group_scale(float S, int g)
{
    if (g >= 255)
        return 0.0f;
#if defined(__CUDA_ARCH__)
    float m = __fmul_rn(S, TAGC_TLS_G16(g & 15));
#else
    float m = S * TAGC_TLS_G16(g & 15);
#endif
    return tagc_tls_shift(m, g >> 4);
}

/* The decoded scale of block code b under its group's scale M (15: 0). */
TAGC_HD float tagc_tls_block_scale(float M, int b)
{
    if (b >= 15)
        return 0.0f;
    const float t = b % 3 == 0 ? 1.0f : b % 3 == 1 ? TAGC_TLS_BSTEP1 : TAGC_TLS_BSTEP2;
#if defined(__CUDA_ARCH__)
    float m = __fmul_rn(M, t);
#else
    float m = M * t;
#endif
    return tagc_tls_shift(m, b / 3);
}

/* Blocks and groups of n values. */
TAGC_HD int64_t tagc_tls_blocks(int64_t n)
{
    return (n + TAGC_TLS_BLOCK - 1) / TAGC_TLS_BLOCK;
}

TAGC_HD int64_t tagc_tls_groups(int64_t n)
{
    return (tagc_tls_blocks(n) + TAGC_TLS_GROUP - 1) / TAGC_TLS_GROUP;
}

/* Offsets of the layout's sections in a message of n > 0 values. */
TAGC_HD int64_t tagc_tls_block_codes_at(int64_t n)
{
    return 4 + tagc_tls_groups(n);
}

TAGC_HD int64_t tagc_tls_trits_at(int64_t n)
{
    return tagc_tls_block_codes_at(n) + (tagc_tls_blocks(n) + 1) / 2;
}

/* The message's size (tagc_tls_bytes); -1 for n outside [0, TAGC_MAX_N]. */
TAGC_HD int64_t tagc_tls_size(int64_t n)
{
    if (n < 0 || n > TAGC_MAX_N)
        return -1;
    return n == 0 ? 0 : tagc_tls_trits_at(n) + (n + 4) / 5;
}

/* The message scale's bits are valid: +0, positive and finite, or NaN (a
 * CUDA encoder's mark of a non-finite input); -0, negatives and Inf are not. */
TAGC_HD int tagc_tls_header_ok(uint32_t bits)
{
    return bits < 0x7f800000u || (bits & 0x7fffffffu) > 0x7f800000u;
}

/* ---- argument checks, shared by the C ops and the CUDA launchers ---- */

static inline tagc_status tagc_tls_check_encode(const uint8_t *dst, int64_t dst_capacity,
                                                const void *residual, int residual_dtype,
                                                const void *grad, int grad_dtype, int64_t n)
{
    if (n > 0 && (dst == NULL || grad == NULL))
        return TAGC_ERR_ARG;
    if ((grad_dtype != TAGC_F32 && grad_dtype != TAGC_BF16) ||
        (residual != NULL && residual_dtype != TAGC_F32 && residual_dtype != TAGC_BF16))
        return TAGC_ERR_DTYPE;
    int64_t need = tagc_tls_size(n);
    if (need < 0)
        return TAGC_ERR_RANGE;
    return dst_capacity < need ? TAGC_ERR_CAPACITY : TAGC_OK;
}

static inline tagc_status tagc_tls_check_decode(const float *out, int64_t n, const uint8_t *src,
                                                int64_t src_bytes)
{
    if (n > 0 && (out == NULL || src == NULL))
        return TAGC_ERR_ARG;
    int64_t need = tagc_tls_size(n);
    if (need < 0 || src_bytes != need)
        return TAGC_ERR_RANGE;
    return TAGC_OK;
}

#endif /* TAGC_TLS_H */
