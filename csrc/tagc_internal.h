/*
 * tagc_internal.h - helpers private to the C codec (the csrc C files).  Not installed,
 * not part of the contract; everything here is static.
 */
#ifndef TAGC_INTERNAL_H
#define TAGC_INTERNAL_H

#include <float.h>
#include <math.h>
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

/* The block codes' generic encoder pieces (quant.c's, and tls.c's under its own
 * scales; quant_avx2.h has their AVX2 forms). */
/* Scale of the block [o, o + len) of v; returns 0 when v holds NaN/Inf there.
 * The sum of |v| runs in 32 strided partial sums (double), then a pairwise
 * tree: what a warp does with one lane per partial sum and shuffles.  (The
 * inner loop over 32 lanes vectorizes.) */
TAGC_AI int block_scale(float *scale, const void *g, int gd, const void *r, int rd,
                        int64_t o, int64_t len, int format)
{
    double lane[32] = {0};
    float m = 0.0f;
    int finite = 1;
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        for (int j = 0; j < 32; j++) {
            float a = fabsf(load_v(g, gd, r, rd, o + i + j));
            finite &= a <= FLT_MAX; /* false for NaN too */
            m = a > m ? a : m;
            if (tagc_q_uses_sum(format))
                lane[j] += (double)a;
        }
    }
    for (; i < len; i++) {
        float a = fabsf(load_v(g, gd, r, rd, o + i));
        finite &= a <= FLT_MAX;
        m = a > m ? a : m;
        if (tagc_q_uses_sum(format))
            lane[i & 31] += (double)a;
    }
    if (!finite)
        return 0;
    for (int off = 16; off > 0; off >>= 1)
        for (int j = 0; j < off; j++)
            lane[j] += lane[j + off];
    *scale = tagc_q_scale(format, lane[0], m, len);
    return 1;
}

/* Codes of the n values [o, o + n) under scale s (inv = tagc_q_inv(s)) as
 * digits (tagc_q_digit) into d, and the residual v - q * s (what the owner
 * does not get) back in place.  Elementwise: the loop vectorizes. */
TAGC_AI void encode_digits(uint8_t *d, float s, float inv, const void *g, int gd, void *r,
                           int rd, int64_t o, int n, int format)
{
    for (int i = 0; i < n; i++) {
        float v = load_v(g, gd, r, rd, o + i);
        int qi = tagc_q_code(format, v, inv);
        d[i] = (uint8_t)tagc_q_digit(format, qi);
        if (rd != DT_NONE)
            st_val(r, rd, o + i, v - (float)qi * s);
    }
}

/* The bytes of n digits into out (the first digit starts a byte), the last
 * byte's unused positions padded. */
TAGC_AI void pack_digits(uint8_t *out, const uint8_t *d, int n, int format)
{
    const int per = tagc_q_per_byte(format);
    int full = n / per, b = 0;
    for (; b < full; b++) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += d[b * per + j] * tagc_q_weight(format, j);
        out[b] = (uint8_t)byte;
    }
    if (b * per < n) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++)
            byte += (b * per + j < n ? d[b * per + j] : tagc_q_pad_digit(format)) *
                    tagc_q_weight(format, j);
        out[b] = (uint8_t)byte;
    }
}

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
