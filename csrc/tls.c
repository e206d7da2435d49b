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

/* The group and block codes into dst, and sc[j] from block j's raw scale
 * to its decoded one. */
TAGC_AI void scale_codes(uint8_t *dst, float *sc, float S, int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n), ng = tagc_tls_groups(n);
    uint8_t *gcodes = dst + 4, *bcodes = dst + tagc_tls_block_codes_at(n);
    memset(bcodes, 0, (size_t)((nb + 1) / 2));
    for (int64_t k = 0; k < ng; k++) {
        const int64_t j0 = k * TAGC_TLS_GROUP;
        const int64_t j1 = j0 + TAGC_TLS_GROUP < nb ? j0 + TAGC_TLS_GROUP : nb;
        float R = 0.0f;
        for (int64_t j = j0; j < j1; j++)
            R = sc[j] > R ? sc[j] : R;
        int gc = R > 0.0f ? tagc_tls_group_code(R / S) : 255;
        float M = tagc_tls_group_scale(S, gc);
        if (M == 0.0f)
            gc = 255; /* a group whose scale underflows sends nothing */
        gcodes[k] = (uint8_t)gc;
        for (int64_t j = j0; j < j1; j++) {
            int bc = M > 0.0f && sc[j] > 0.0f ? tagc_tls_block_code(sc[j] / M) : 15;
            sc[j] = tagc_tls_block_scale(M, bc);
            bcodes[j >> 1] |= (uint8_t)(bc << (4 * (j & 1)));
        }
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
    scale_codes(dst, sc, S, n);
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
/* The two passes with quant_avx2.h's pieces, the generic loops' arithmetic in
 * their order: pass 1 takes each block's raw scale as tagc_quant_encode's
 * ternary block scale (block_scale_avx2); pass 2 codes whole chunks of five
 * blocks 32 values at a time (encode32: digits and residual under one
 * scale) and packs their 160 digits 40 at a time, a last partial chunk going
 * through the generic code. */
TAGC_AVX2 int raw_scales_avx2(float *sc, float *S, const void *g, int gd, const void *res,
                              int rd, int64_t n)
{
    const int64_t nb = tagc_tls_blocks(n);
    float big = 0.0f;
    for (int64_t j = 0; j < nb; j++) {
        int64_t o = j * TAGC_TLS_BLOCK;
        int64_t len = n - o < TAGC_TLS_BLOCK ? n - o : TAGC_TLS_BLOCK;
        if (!block_scale_avx2(&sc[j], g, gd, res, rd, o, len, TAGC_Q_TERNARY))
            return 0;
        big = sc[j] > big ? sc[j] : big;
    }
    *S = big;
    return 1;
}

TAGC_AVX2 void value_codes_avx2(uint8_t *trits, const float *sc, const void *g, int gd,
                                void *res, int rd, int64_t n)
{
    uint8_t d[CHUNK];
    int64_t o = 0;
    for (; o + CHUNK <= n; o += CHUNK) {
        for (int b = 0; b < CHUNK / TAGC_TLS_BLOCK; b++) {
            const float s = sc[o / TAGC_TLS_BLOCK + b];
            encode32(trits, d, TAGC_TLS_BLOCK * b, _mm256_set1_ps(s),
                     _mm256_set1_ps(tagc_q_inv(s)), g, gd, res, rd, o + TAGC_TLS_BLOCK * b,
                     TAGC_Q_TERNARY);
        }
        for (int k = 0; k < CHUNK / 40; k++)
            ternary_bytes8(trits + o / 5 + 8 * k, d + 40 * k);
    }
    if (o < n)
        chunk_codes(trits + o / 5, sc, g, gd, res, rd, o, (int)(n - o));
}

__attribute__((target("avx2"))) static int encode_dtypes_avx2(uint8_t *dst, float *sc,
                                                               const void *g, int gd,
                                                               void *res, int rd, int64_t n)
{
    float S = 0.0f;
    BY_DTYPES(if (!raw_scales_avx2(sc, &S, g, G, res, R, n)) return 0;
                  memcpy(dst, &S, 4); scale_codes(dst, sc, S, n);
                  value_codes_avx2(dst + tagc_tls_trits_at(n), sc, g, G, res, R, n); return 1);
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
    float *sc = malloc((size_t)tagc_tls_blocks(n) * sizeof *sc);
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
