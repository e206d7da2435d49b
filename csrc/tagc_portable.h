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

#include <stdint.h>

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

#endif /* TAGC_PORTABLE_H */
