/*
 * tagc_portable.h - logic shared verbatim by the C codec (csrc/) and the CUDA
 * kernels (cuda/): seed derivation, the sketch hash, lane layout and the
 * per-bucket peeling rule.  Everything here is a pure function of its
 * arguments so that a CPU test of the C codec also tests what the GPU runs.
 *
 * Compiled by gcc (static inline) and by nvcc (__host__ __device__).
 */
#ifndef TAGC_PORTABLE_H
#define TAGC_PORTABLE_H

#include <math.h>
#include <stdint.h>

#include "tagc.h" /* TAGC_WQ_NONFINITE, the wire's sentinel */

#if defined(__CUDACC__)
#define TAGC_HD static __host__ __device__ __forceinline__
#else
#define TAGC_HD static inline
#endif

/* Number of partitioned hash tables of a sketch (m = TAGC_TABLES * t). */
#define TAGC_TABLES 3

/* Golden-ratio increment of splitmix64: spreads consecutive inputs. */
#define TAGC_GOLDEN 0x9e3779b97f4a7c15ULL

/* splitmix64 finalizer: a bijection on 64 bits with full avalanche, so
 * consecutive positions land in unrelated buckets. */
TAGC_HD uint64_t tagc_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* Per-call seed from (config seed, unit, step).  Every rank computes the same
 * value from the same three integers, so encoders and the decoder agree on the
 * hash without communicating; the step term changes the hash every step so a
 * pathological collision pattern cannot repeat across steps. */
TAGC_HD uint64_t tagc_seed_derive(uint64_t seed, uint64_t unit, uint64_t step)
{
    uint64_t h = tagc_mix64(seed + TAGC_GOLDEN);
    h = tagc_mix64(h ^ (unit + TAGC_GOLDEN));
    return tagc_mix64(h ^ (step + 2 * TAGC_GOLDEN));
}

/* Seed of sub-table i (0 <= i < TAGC_TABLES) derived from the call seed. */
TAGC_HD uint64_t tagc_table_seed(uint64_t seed, int table)
{
    return tagc_mix64(seed + (uint64_t)(table + 1) * TAGC_GOLDEN);
}

/* 64-bit hash of position p under a table seed. */
TAGC_HD uint64_t tagc_hash(uint64_t p, uint64_t table_seed)
{
    return tagc_mix64(table_seed + p * TAGC_GOLDEN);
}

/* Bucket of a hash in sub-table i of t buckets: i*t + fastrange(high 32 bits, t).
 * fastrange (Lemire) maps uniformly without a division; t < 2^32. */
TAGC_HD int64_t tagc_bucket(uint64_t h, int table, int64_t t)
{
    return (int64_t)table * t + (int64_t)(((h >> 32) * (uint64_t)t) >> 32);
}

/* Sign (+1/-1) of a hash: its lowest bit, independent of the bucket bits. */
TAGC_HD float tagc_sign(uint64_t h)
{
    return (h & 1u) ? -1.0f : 1.0f;
}

/* Lane layout (paper's SUM-as-OR index): position p owns `bits` bits
 * (1, 2, 4 or 8) starting at bit (p*bits) & 7 of byte (p*bits) >> 3, LSB
 * first.  A packed lane holds 1 for a kept position; after a SUM all-reduce of
 * uint8 bytes a lane may hold a count or carries from its neighbour, and any
 * non-zero lane reads back as "kept". */
TAGC_HD int64_t tagc_lane_bytes(int64_t n, int bits)
{
    return (n * bits + 7) >> 3;
}

TAGC_HD int tagc_lane_get(const uint8_t *lanes, int64_t p, int bits)
{
    int64_t bit = p * bits;
    unsigned mask = (1u << bits) - 1u;
    return ((lanes[bit >> 3] >> (bit & 7)) & mask) != 0;
}

/* 1-bit bitmap (the local index): bit p & 7 of byte p >> 3. */
TAGC_HD int tagc_bit_get(const uint8_t *bitmap, int64_t p)
{
    return (bitmap[p >> 3] >> (p & 7)) & 1;
}

/* bfloat16 <-> float.  Round to nearest even; NaN stays NaN. */
TAGC_HD float tagc_bf16_to_f32(uint16_t b)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

TAGC_HD uint16_t tagc_f32_to_bf16(float f)
{
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* Peeling rule: a bucket holding exactly one unresolved position (count 1)
 * holds sign(p) * value(p); the position is the xor of its positions, which
 * for count 1 is p itself.  Returns the recovered value. */
TAGC_HD float tagc_peel_value(float bucket, uint64_t h)
{
    return tagc_sign(h) * bucket;
}

/* Median of three (the paper's estimate for positions left unpeeled). */
TAGC_HD float tagc_median3(float a, float b, float c)
{
    float lo = a < b ? a : b, hi = a < b ? b : a;
    return c < lo ? lo : (c > hi ? hi : c);
}

/* ---- block quantization (tagc.h's tagc_quant_*; values = tagc_qformat) ---- */

/* Ternary level in units of the block's mean |v|, capped at max |v|.  With
 * q = round(v / s) a value is sent when |v| > s/2 = 1.25 mean |v|: about a
 * fifth to a third of the entries of a gradient block, the rest waits in the
 * residual.  Levels from 1.5 to 2.5 rms gave the same loss in our ablation;
 * 1.2 rms (the Lloyd-Max level of a Gaussian, densest) was worse: see
 * docs/DESIGN.md.  The cap makes the largest |v| of every block go out (a
 * block of equal magnitudes would otherwise never send anything), which
 * keeps the compressor contractive: |v - q s| < |v| for every sent value. */
#define TAGC_TERNARY_LEVEL 2.5

/* Codes per byte: sign 8, ternary 5, int4 2, int8 1; 0 for an unknown format. */
TAGC_HD int tagc_q_per_byte(int format)
{
    switch (format) {
    case 1: return 8;
    case 2: return 5;
    case 4: return 2;
    case 8: return 1;
    }
    return 0;
}

/* Largest |q| of a format (sign: 1). */
TAGC_HD int tagc_q_max(int format)
{
    return format == 4 ? 7 : format == 8 ? 127 : 1;
}

/* Whether the format's scale needs the sum of |v| (sign, ternary); every
 * format but sign needs max |v|. */
TAGC_HD int tagc_q_uses_sum(int format)
{
    return format == 1 || format == 2;
}

/* Bytes of one record of len values: the scale, then the codes. */
TAGC_HD int64_t tagc_q_record_bytes(int64_t len, int format)
{
    int per = tagc_q_per_byte(format);
    return 4 + (len + per - 1) / per;
}

/* Bytes of the records of n values in blocks of `block`, the last one
 * possibly shorter: a quant message, or one segment of a wq message.  The
 * caller has checked the arguments. */
TAGC_HD int64_t tagc_q_bytes(int64_t n, int format, int64_t block)
{
    int64_t full = n / block, tail = n % block;
    return full * tagc_q_record_bytes(block, format) +
           (tail ? tagc_q_record_bytes(tail, format) : 0);
}

/* Scale of a block of len > 0 values from its sum of |v| (double, fixed
 * order) and its max |v|.  Clamped to FLT_MAX so a finite block always has
 * a finite scale; a scale below FLT_MIN counts as 0 (nothing of the block is
 * sent, it stays in the residual), so that 1/s is always finite. */
TAGC_HD float tagc_q_scale(int format, double sum_abs, float max_abs, int64_t len)
{
    double s;
    float f;
    if (format == 1) {
        s = sum_abs / (double)len;
    } else if (format == 2) {
        s = TAGC_TERNARY_LEVEL * sum_abs / (double)len;
        s = s < (double)max_abs ? s : (double)max_abs;
    } else {
        s = (double)max_abs / (double)tagc_q_max(format);
    }
    f = s > 3.4028234663852886e38 ? 3.4028234663852886e38f : (float)s;
    /* the top code times the scale must stay finite: q * s <= FLT_MAX */
    if ((double)f * tagc_q_max(format) > 3.4028234663852886e38)
        f = nextafterf(f, 0.0f);
    return f < 1.17549435e-38f ? 0.0f : f;
}

/* The reciprocal tagc_q_code multiplies by (0 for s == 0). */
TAGC_HD float tagc_q_inv(float s)
{
#if defined(__CUDA_ARCH__)
    return s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
#else
    return s > 0.0f ? 1.0f / s : 0.0f;
#endif
}

/* Code of v: the sign of v for `sign` (v >= 0 gives +1), else v * inv
 * rounded half to even and clamped to +-tagc_q_max (inv = tagc_q_inv(s); 0
 * when s == 0).  The rounding adds and subtracts 1.5 * 2^23, exact and
 * half-even in float for |y| < 2^22, which the clamp to +-(max + 1)
 * guarantees: no libm call, the same bits on the CPU and the GPU (the _rn
 * intrinsics keep nvcc from fusing).  The caller passes finite v. */
TAGC_HD int tagc_q_code(int format, float v, float inv)
{
    if (format == 1)
        return v >= 0.0f ? 1 : -1;
    const float lim = (float)tagc_q_max(format), magic = 12582912.0f;
#if defined(__CUDA_ARCH__)
    float y = __fmul_rn(v, inv);
#else
    float y = v * inv;
#endif
    /* clamps written as (a < b ? a : b): the form SIMD min/max compute */
    y = y < lim + 1.0f ? y : lim + 1.0f;
    y = y > -lim - 1.0f ? y : -lim - 1.0f;
#if defined(__CUDA_ARCH__)
    float r = __fsub_rn(__fadd_rn(y, magic), magic);
#else
    float r = (y + magic) - magic;
#endif
    r = r < lim ? r : lim;
    r = r > -lim ? r : -lim;
    return (int)r;
}

/* Digit of code q in its byte, and the weight of position j (0-based) in the
 * byte: sign bit, base-3 ternary digit, int4 nibble, int8 two's complement. */
TAGC_HD unsigned tagc_q_digit(int format, int q)
{
    switch (format) {
    case 1: return q > 0 ? 1u : 0u;
    case 2: return (unsigned)(q + 1);
    case 4: return (unsigned)(q + 7);
    }
    return (unsigned)(uint8_t)(int8_t)q;
}

TAGC_HD unsigned tagc_q_weight(int format, int j)
{
    switch (format) {
    case 1: return 1u << j;
    case 2: return j == 0 ? 1u : j == 1 ? 3u : j == 2 ? 9u : j == 3 ? 27u : 81u;
    case 4: return 1u << (4 * j);
    }
    return 1u;
}

/* Digit that pads a byte's unused positions (the code of 0; sign has none). */
TAGC_HD unsigned tagc_q_pad_digit(int format)
{
    return format == 2 ? 1u : format == 4 ? 7u : 0u;
}

/* Code at position j of a byte; *bad |= 1 when it is not a valid code. */
TAGC_HD int tagc_q_decode(int format, unsigned byte, int j, int *bad)
{
    switch (format) {
    case 1:
        return ((byte >> j) & 1u) ? 1 : -1;
    case 2:
        *bad |= byte >= 243u;
        return (int)((byte / tagc_q_weight(2, j)) % 3u) - 1;
    case 4: {
        unsigned nib = (byte >> (4 * j)) & 15u;
        *bad |= nib == 15u;
        return (int)nib - 7;
    }
    }
    *bad |= byte == 0x80u;
    return (int)(int8_t)(uint8_t)byte;
}

/* ---- quantized weight gather (tagc.h's tagc_wq_*; int8 and int4 only) ---- */

/* Magnitude patterns (bits & 0x7fffffff) at or above this are NaN/Inf; below
 * it their integer order is the order of |v|, so one integer max over a
 * block gives both its max |v| and whether it is finite. */
#define TAGC_WQ_INF_BITS 0x7f800000u

/* Scale bits of a block from the largest magnitude pattern in it: the
 * sentinel TAGC_WQ_NONFINITE for NaN/Inf, else tagc_q_scale's max|v| / qmax. */
TAGC_HD uint32_t tagc_wq_scale_bits(int format, uint32_t max_bits)
{
    union { uint32_t u; float f; } v;
    if (max_bits >= TAGC_WQ_INF_BITS)
        return TAGC_WQ_NONFINITE;
    v.u = max_bits;
    v.f = tagc_q_scale(format, 0.0, v.f, 1);
    return v.u;
}

/* Code of a value of a wq block under inv = tagc_q_inv(s): tagc_q_code
 * (round half to even, the same magic-number rounding) without its clamps,
 * which never bind here and cost most of the code pass.  The scale comes from
 * the block's own largest magnitude m: s = RN(m / qmax) (or one step below,
 * near FLT_MAX), inv = RN(1 / s), so |v * inv| <= qmax (1 + 2^-21) <
 * qmax + 1/2 for every |v| <= m; and inv = 0 when s = 0. */
TAGC_HD int tagc_wq_code(float v, float inv)
{
    const float magic = 12582912.0f;
#if defined(__CUDA_ARCH__)
    return (int)__fsub_rn(__fadd_rn(__fmul_rn(v, inv), magic), magic);
#else
    return (int)((v * inv + magic) - magic);
#endif
}

/* What a receiver makes of a record's scale bits: 1 the sentinel, 0 a scale
 * it may use (finite, >= 0, qmax * s <= FLT_MAX, so every product is
 * finite), -1 anything else (corrupt; NaN fails both comparisons). */
TAGC_HD int tagc_wq_scale_kind(int format, uint32_t bits)
{
    union { uint32_t u; float f; } v;
    if (bits == TAGC_WQ_NONFINITE)
        return 1;
    v.u = bits;
    return v.f >= 0.0f && (double)v.f * tagc_q_max(format) <= 3.4028234663852886e38 ? 0 : -1;
}

/* A byte of codes 0: what a sentinel record's codes are (int8 0, int4 0x77). */
TAGC_HD uint8_t tagc_wq_zero_byte(int format)
{
    unsigned byte = 0;
    for (int j = 0; j < tagc_q_per_byte(format); j++)
        byte += tagc_q_digit(format, 0) * tagc_q_weight(format, j);
    return (uint8_t)byte;
}

#endif /* TAGC_PORTABLE_H */
