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

/* For passes that are compute-bound with SSE2 (the x86-64 baseline): where
 * the toolchain and the loader can (GCC/clang, x86-64 ELF, glibc's ifunc;
 * musl has none), an AVX2 clone too, picked once at load time by the CPU.
 * Put on the non-inline function that inlines the loops. */
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && defined(__GLIBC__)
#define TAGC_HOT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TAGC_HOT_CLONES
#endif

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

/* ---- block quantization records (quant.c, wq.c) ---- */

/* One switch per block: each case inlines the loops of its call for a
 * constant format, so the per-value division by the codes per byte is a
 * constant. */
#define BY_QFORMAT(format, call)                                       \
    switch (format) {                                                  \
    case TAGC_Q_SIGN: { enum { F = TAGC_Q_SIGN }; call; } break;       \
    case TAGC_Q_TERNARY: { enum { F = TAGC_Q_TERNARY }; call; } break; \
    case TAGC_Q_INT4: { enum { F = TAGC_Q_INT4 }; call; } break;       \
    default: { enum { F = TAGC_Q_INT8 }; call; } break;                \
    }

/* One test per (grad, residual) dtype pair of an encoder (gd, rd in scope):
 * each case inlines `call` for constant dtypes G and R, as BY_QFORMAT does
 * for the format. */
#define DT_CASE(g0, r0, call) \
    if (gd == (g0) && rd == (r0)) { enum { G = g0, R = r0 }; call; }
#define BY_DTYPES(call)                                                  \
    DT_CASE(TAGC_F32, DT_NONE, call) DT_CASE(TAGC_F32, TAGC_F32, call)   \
    DT_CASE(TAGC_F32, TAGC_BF16, call) DT_CASE(TAGC_BF16, DT_NONE, call) \
    DT_CASE(TAGC_BF16, TAGC_F32, call) DT_CASE(TAGC_BF16, TAGC_BF16, call)

/* Whether the len codes of one record are valid (reads only).  Byte by byte
 * with the position in the byte a constant once the loop unrolls; the
 * verdict is gathered in a byte, so the vectorized loop compares 32 code
 * bytes per AVX2 vector instead of widening them to int lanes. */
TAGC_AI int q_codes_valid(const uint8_t *codes, int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    uint8_t any = 0;
    int bad = 0;
    int64_t full = len / per, b = 0;
    for (; b < full; b++) {
        int byte_bad = 0;
        for (int j = 0; j < per; j++)
            (void)tagc_q_decode(format, codes[b], j, &byte_bad);
        any |= (uint8_t)byte_bad;
    }
    for (int j = 0; b * per + j < len; j++)
        (void)tagc_q_decode(format, codes[b], j, &bad);
    return !(any | bad);
}

/* x into out[i]: added to fp32 (add != 0), or stored in dtype od. */
TAGC_AI void q_put(void *out, int od, int add, int64_t i, float x)
{
    if (add)
        ((float *)out)[i] += x;
    else
        st_val(out, od, i, x);
}

/* out[o..o + len) gets the values q * s of the record at rec, added or
 * written (q_put).  The scale is the one the record holds. */
TAGC_AI void q_record_out(void *out, int od, int add, int64_t o, const uint8_t *rec,
                          int64_t len, int format)
{
    const int per = tagc_q_per_byte(format);
    const uint8_t *codes = rec + 4;
    int ignored = 0;
    float s;
    memcpy(&s, rec, 4); /* src comes off the network: no alignment assumed */
    int64_t full = len / per, b = 0;
    for (; b < full; b++)
        for (int j = 0; j < per; j++)
            q_put(out, od, add, o + b * per + j,
                  (float)tagc_q_decode(format, codes[b], j, &ignored) * s);
    for (int j = 0; b * per + j < len; j++)
        q_put(out, od, add, o + b * per + j,
              (float)tagc_q_decode(format, codes[b], j, &ignored) * s);
}

#endif /* TAGC_INTERNAL_H */
