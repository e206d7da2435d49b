/*
 * tagc_internal.h - helpers private to the C codec (the csrc C files).  Not installed,
 * not part of the contract; everything here is static.
 */
#ifndef TAGC_INTERNAL_H
#define TAGC_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "tagc.h"
#include "tagc_portable.h"

/* Forced inlining lets one generic loop be specialised per dtype combination
 * by constant propagation instead of being written out once per combination. */
#define TAGC_AI static inline __attribute__((always_inline))

/* "No residual" marker for the dtype-specialised loops. */
#define DT_NONE (-1)

TAGC_AI int dtype_valid(int d)
{
    return d == TAGC_F32 || d == TAGC_BF16;
}

TAGC_AI float ld_val(const void *p, int d, int64_t i)
{
    if (d == TAGC_F32)
        return ((const float *)p)[i];
    return tagc_bf16_to_f32(((const uint16_t *)p)[i]);
}

TAGC_AI void st_val(void *p, int d, int64_t i, float v)
{
    if (d == TAGC_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = tagc_f32_to_bf16(v);
}

/* v = grad + residual of error feedback, in fp32 (rd == DT_NONE: no residual). */
TAGC_AI float load_v(const void *g, int gd, const void *r, int rd, int64_t i)
{
    float v = ld_val(g, gd, i);
    if (rd != DT_NONE)
        v += ld_val(r, rd, i);
    return v;
}

/* What a value becomes once stored in dtype d and read back. */
TAGC_AI float round_to(int d, float v)
{
    return d == TAGC_F32 ? v : tagc_bf16_to_f32(tagc_f32_to_bf16(v));
}

TAGC_AI uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

TAGC_AI float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

TAGC_AI int64_t bitmap_bytes(int64_t n)
{
    return (n + 7) >> 3;
}

/* Up to 8 bytes of p as a little-endian word (bytes past `len` read as 0);
 * never touches memory past p + len. */
TAGC_AI uint64_t load_le(const uint8_t *p, int64_t len)
{
    uint64_t w = 0;
    if (len >= 8) {
        memcpy(&w, p, 8);
    } else {
        for (int64_t i = 0; i < len; i++)
            w |= (uint64_t)p[i] << (8 * i);
    }
    return w;
}

#endif /* TAGC_INTERNAL_H */
