/*
 * fuzz_decoder.c - libFuzzer target over what a decoder reads from other
 * machines: peel_decode (sketch + union bitmap), lanes_unpack (SUM-reduced
 * lanes), sparse_unpack (received pairs), pairs_unpack_add (coded pairs: Elias-Fano,
 * bitmap, dense), wq_decode and wq_delta_decode (quantized weights and their
 * change), fp4_decode_add (4-bit codes), tls_decode_add (ternary codes
 * under two-level scales), plus fp4_encode, tls_encode, sketch_encode,
 * sparsify and wq_encode on hostile values.  Every buffer is allocated at
 * exactly the size the call is told, so ASan flags any read or write past it.
 * The first input byte picks the operation; the next bytes are its
 * parameters; the rest is the payload.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tagc.h"
#include "tagc_portable.h"

/* An abort is what libFuzzer and the sanitizers report as a finding. */
#define REQUIRE(c) do { if (!(c)) abort(); } while (0)

typedef struct {
    const uint8_t *p;
    size_t left;
} input_t;

static uint32_t take_u32(input_t *in)
{
    uint32_t v = 0;
    size_t n = in->left < 4 ? in->left : 4;
    memcpy(&v, in->p, n);
    in->p += n;
    in->left -= n;
    return v;
}

/* A heap buffer of exactly `bytes` bytes filled from the input (zeros once it
 * runs out); never NULL so that zero-size calls still get a valid pointer. */
static uint8_t *take_buf(input_t *in, size_t bytes)
{
    uint8_t *b = malloc(bytes ? bytes : 1);
    REQUIRE(b != NULL);
    size_t n = in->left < bytes ? in->left : bytes;
    memcpy(b, in->p, n);
    memset(b + n, 0, bytes - n);
    in->p += n;
    in->left -= n;
    return b;
}

static int64_t popcount_n(const uint8_t *bm, int64_t n)
{
    int64_t c = -1;
    REQUIRE(tagc_popcount(&c, bm, n) == TAGC_OK);
    return c;
}

static void fuzz_peel(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in), c = take_u32(in);
    int64_t n = a % 4097, t = 1 + b % 300, cap = c % 9;
    tagc_dtype sd = (c >> 8) & 1 ? TAGC_BF16 : TAGC_F32;
    int estimate = (c >> 9) & 1;
    uint64_t seed = take_u32(in);
    float *out = (float *)take_buf(in, (size_t)n * 4);
    int32_t *unp = (int32_t *)take_buf(in, (size_t)cap * 4);
    uint8_t *sk = take_buf(in, (size_t)(3 * t) * tagc_dtype_size(sd));
    uint8_t *bm = take_buf(in, (size_t)(n + 7) / 8);
    int64_t left = -1;
    REQUIRE(tagc_peel_decode(out, n, cap ? unp : NULL, cap, &left, sk, sd, bm, n, t, seed,
                             estimate) == TAGC_OK);
    REQUIRE(left >= 0 && left <= popcount_n(bm, n));
    for (int64_t i = 0; i < left && i < cap; i++)
        REQUIRE(unp[i] >= 0 && unp[i] < n && tagc_bit_get(bm, unp[i]));
    REQUIRE(tagc_peel_decode(out, n - 1, NULL, 0, &left, sk, sd, bm, n, t, seed, 1) ==
            TAGC_ERR_CAPACITY);
    free(out);
    free(unp);
    free(sk);
    free(bm);
}

static void fuzz_lanes(input_t *in)
{
    uint32_t a = take_u32(in);
    int64_t n = (a >> 2) % 5000;
    int bits = 1 << (a & 3);
    int64_t lb = tagc_lane_bytes(n, bits), nb = (n + 7) / 8;
    uint8_t *lanes = take_buf(in, (size_t)lb);
    uint8_t *bm = malloc((size_t)(nb ? nb : 1)), *again = malloc((size_t)(lb ? lb : 1));
    REQUIRE(bm != NULL && again != NULL);
    REQUIRE(tagc_lanes_unpack(bm, nb, lanes, lb, n, bits) == TAGC_OK);
    for (int64_t p = 0; p < n; p++)
        REQUIRE(tagc_bit_get(bm, p) == tagc_lane_get(lanes, p, bits));
    REQUIRE(tagc_lanes_pack(again, lb, bm, n, bits) == TAGC_OK);
    for (int64_t p = 0; p < n; p++)
        REQUIRE(tagc_lane_get(again, p, bits) == tagc_bit_get(bm, p));
    REQUIRE(tagc_lanes_unpack(bm, nb, lanes, lb - 1, n, bits) ==
            (lb > 0 ? TAGC_ERR_CAPACITY : TAGC_ERR_RANGE));
    free(lanes);
    free(bm);
    free(again);
}

static void fuzz_sparse(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    int64_t n = a % 2000, k = b % 600;
    tagc_dtype vd = (b >> 16) & 1 ? TAGC_BF16 : TAGC_F32;
    int64_t bytes = k * (int64_t)(4 + tagc_dtype_size(vd));
    uint8_t *buf = take_buf(in, (size_t)bytes);
    float *out = calloc((size_t)(n ? n : 1), 4);
    REQUIRE(out != NULL);
    tagc_status st = tagc_sparse_unpack(out, n, buf, bytes, k, vd);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_CORRUPT);
    if (st == TAGC_ERR_CORRUPT)
        for (int64_t i = 0; i < n; i++)
            REQUIRE(out[i] == 0.0f);
    free(buf);
    free(out);
}

static void fuzz_encode(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    int64_t n = a % 3000, k = b % 300, t = 1 + (b >> 12) % 64;
    tagc_dtype sd = (a >> 20) & 1 ? TAGC_BF16 : TAGC_F32;
    tagc_dtype vd = (a >> 21) & 1 ? TAGC_BF16 : TAGC_F32;
    int32_t *idx = (int32_t *)take_buf(in, (size_t)k * 4);
    uint8_t *val = take_buf(in, (size_t)k * tagc_dtype_size(vd));
    uint8_t *sk = malloc((size_t)(3 * t) * tagc_dtype_size(sd));
    REQUIRE(sk != NULL);
    tagc_status st = tagc_sketch_encode(sk, sd, 3 * t, idx, val, vd, k, n, t, a);
    int in_range = 1;
    for (int64_t j = 0; j < k; j++)
        in_range &= idx[j] >= 0 && idx[j] < n;
    REQUIRE(st == (in_range ? TAGC_OK : TAGC_ERR_RANGE));
    free(idx);
    free(val);
    free(sk);
}

static void fuzz_sparsify(input_t *in)
{
    uint32_t a = take_u32(in);
    tagc_dtype gd = a & 1 ? TAGC_BF16 : TAGC_F32, vd = a & 2 ? TAGC_BF16 : TAGC_F32;
    tagc_dtype rd = a & 4 ? TAGC_BF16 : TAGC_F32;
    int use_res = (a >> 3) & 1;
    int64_t n = (int64_t)(in->left / (tagc_dtype_size(gd) + (use_res ? tagc_dtype_size(rd) : 0)));
    if (n > 20000)
        n = 20000;
    int64_t k = n ? (int64_t)((a >> 4) % (uint32_t)(n + 1)) : 0;
    uint8_t *grad = take_buf(in, (size_t)n * tagc_dtype_size(gd));
    uint8_t *res = use_res ? take_buf(in, (size_t)n * tagc_dtype_size(rd)) : NULL;
    int32_t *idx = malloc((size_t)(k ? k : 1) * 4);
    uint8_t *val = malloc((size_t)(k ? k : 1) * tagc_dtype_size(vd));
    uint8_t *bm = malloc((size_t)((n + 7) / 8 ? (n + 7) / 8 : 1));
    REQUIRE(idx != NULL && val != NULL && bm != NULL);
    float tau;
    tagc_status st = tagc_sparsify(idx, k, val, vd, k, bm, (n + 7) / 8, res, rd, grad, gd,
                                   n, k, &tau);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_NONFINITE);
    if (st == TAGC_OK) {
        REQUIRE(popcount_n(bm, n) == k);
        for (int64_t j = 0; j < k; j++)
            REQUIRE(idx[j] >= 0 && idx[j] < n && (j == 0 || idx[j] > idx[j - 1]) &&
                    tagc_bit_get(bm, idx[j]));
    }
    free(grad);
    free(res);
    free(idx);
    free(val);
    free(bm);
}

/* A received coded-pairs message (any bytes): added or refused as CORRUPT with
 * out untouched; a valid one re-packs to the same position bytes. */
static void fuzz_pairs(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    int64_t n = a % 5000, k = n ? (int64_t)(b % (uint32_t)(n + 1)) : 0;
    tagc_dtype vd = (a >> 16) & 1 ? TAGC_BF16 : TAGC_F32;
    tagc_coding c = (tagc_coding)(TAGC_PAIRS_EF + (int)((a >> 17) % 3));
    int64_t bytes = tagc_pairs_bytes(n, k, vd, c);
    REQUIRE(bytes >= 0);
    uint8_t *msg = take_buf(in, (size_t)bytes);
    float *out = calloc((size_t)(n ? n : 1), 4);
    REQUIRE(out != NULL);
    tagc_status st = tagc_pairs_unpack_add(out, n, msg, bytes, k, vd, c);
    REQUIRE(st == TAGC_OK || (st == TAGC_ERR_CORRUPT && c != TAGC_PAIRS_DENSE));
    if (st == TAGC_ERR_CORRUPT)
        for (int64_t i = 0; i < n; i++)
            REQUIRE(out[i] == 0.0f);
    if (bytes > 0)
        REQUIRE(tagc_pairs_unpack_add(out, n, msg, bytes - 1, k, vd, c) == TAGC_ERR_RANGE);
    if (st == TAGC_OK && c != TAGC_PAIRS_DENSE && k > 0) {
        /* decode the positions by marking them with distinct values, re-pack */
        int32_t *idx = malloc((size_t)k * 4);
        float *ones = malloc((size_t)k * 4), *mark = calloc((size_t)n, 4);
        REQUIRE(idx != NULL && ones != NULL && mark != NULL);
        for (int64_t j = 0; j < k; j++)
            ones[j] = 1.0f;
        int64_t vb = k * (int64_t)tagc_dtype_size(TAGC_F32);
        int64_t fb = tagc_pairs_bytes(n, k, TAGC_F32, c);
        uint8_t *m32 = malloc((size_t)fb), *again = malloc((size_t)fb);
        REQUIRE(m32 != NULL && again != NULL);
        memcpy(m32, msg, (size_t)(bytes - k * (int64_t)tagc_dtype_size(vd)));
        memcpy(m32 + fb - vb, ones, (size_t)vb);
        REQUIRE(tagc_pairs_unpack_add(mark, n, m32, fb, k, TAGC_F32, c) == TAGC_OK);
        int64_t j = 0;
        for (int64_t p = 0; p < n; p++)
            if (mark[p] != 0.0f) {
                REQUIRE(mark[p] == 1.0f && j < k);
                idx[j++] = (int32_t)p;
            }
        REQUIRE(j == k);
        REQUIRE(tagc_pairs_pack(again, fb, idx, ones, TAGC_F32, k, n, c) == TAGC_OK);
        REQUIRE(memcmp(again, m32, (size_t)(fb - vb)) == 0);
        free(idx);
        free(ones);
        free(mark);
        free(again);
        free(m32);
    }
    free(msg);
    free(out);
}

static const tagc_qformat QFORMATS[4] = {TAGC_Q_SIGN, TAGC_Q_TERNARY, TAGC_Q_INT4,
                                          TAGC_Q_INT8};

/* A received quant message (any bytes): decoded or refused as CORRUPT with out
 * untouched; then encoding hostile values: OK (sent + residual == v) or
 * NONFINITE with the residual untouched. */
static void fuzz_quant(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    tagc_qformat fmt = QFORMATS[a & 3];
    int64_t n = (a >> 2) % 3000, block = 1 + (int64_t)(b % 700);
    int64_t bytes = tagc_quant_bytes(n, fmt, block);
    REQUIRE(bytes >= 0);
    uint8_t *msg = take_buf(in, (size_t)bytes);
    float *out = calloc((size_t)(n ? n : 1), 4);
    REQUIRE(out != NULL);
    tagc_status st = tagc_quant_decode_add(out, n, msg, bytes, fmt, block);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_CORRUPT);
    if (st == TAGC_ERR_CORRUPT)
        for (int64_t i = 0; i < n; i++)
            REQUIRE(out[i] == 0.0f);
    REQUIRE(tagc_quant_decode_add(out, n, msg, bytes + 1, fmt, block) == TAGC_ERR_RANGE);

    tagc_dtype gd = (b >> 16) & 1 ? TAGC_BF16 : TAGC_F32;
    uint8_t *grad = take_buf(in, (size_t)n * tagc_dtype_size(gd));
    float *res = (float *)take_buf(in, (size_t)n * 4);
    float *res0 = malloc((size_t)(n ? n : 1) * 4);
    uint8_t *enc = malloc((size_t)(bytes ? bytes : 1));
    REQUIRE(res0 != NULL && enc != NULL);
    memcpy(res0, res, (size_t)n * 4);
    st = tagc_quant_encode(enc, bytes, res, TAGC_F32, grad, gd, n, fmt, block);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_NONFINITE);
    if (st == TAGC_ERR_NONFINITE) {
        REQUIRE(memcmp(res, res0, (size_t)n * 4) == 0);
    } else {
        memset(out, 0, (size_t)(n ? n : 1) * 4);
        REQUIRE(tagc_quant_decode_add(out, n, enc, bytes, fmt, block) == TAGC_OK);
        for (int64_t i = 0; i < n; i++) /* every sent value and residual finite */
            REQUIRE(isfinite(out[i]) && isfinite(res[i]));
    }
    if (n > 0)
        REQUIRE(tagc_quant_encode(enc, bytes - 1, res, TAGC_F32, grad, gd, n, fmt, block) ==
                TAGC_ERR_CAPACITY);
    free(msg);
    free(out);
    free(grad);
    free(res);
    free(res0);
    free(enc);
}

/* A received fp4 message (any bytes: every code is valid): decoded (NaN
 * scale bytes give NaN); then encoding hostile values, with a residual or
 * without: OK (decoded values and residual finite) or NONFINITE with the
 * residual untouched. */
static void fuzz_fp4(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in), seed = take_u32(in);
    int64_t n = (a >> 2) % 3000, block = (int64_t)2 << (b % 8);
    unsigned flags = a & 3u;
    int64_t bytes = tagc_fp4_bytes(n, block);
    REQUIRE(bytes >= 0);
    uint8_t *msg = take_buf(in, (size_t)bytes);
    float *out = calloc((size_t)(n ? n : 1), 4);
    REQUIRE(out != NULL);
    REQUIRE(tagc_fp4_decode_add(out, n, msg, bytes, block, flags, seed) == TAGC_OK);
    REQUIRE(tagc_fp4_decode_add(out, n, msg, bytes + 1, block, flags, seed) == TAGC_ERR_RANGE);

    tagc_dtype gd = (b >> 16) & 1 ? TAGC_BF16 : TAGC_F32;
    uint8_t *grad = take_buf(in, (size_t)n * tagc_dtype_size(gd));
    /* b's bit 17: no residual, the gathers' form (blocks of 32: a loop of its own) */
    const int with_res = !((b >> 17) & 1);
    float *res = (float *)take_buf(in, (size_t)n * 4);
    float *res0 = malloc((size_t)(n ? n : 1) * 4);
    uint8_t *enc = malloc((size_t)(bytes ? bytes : 1));
    REQUIRE(res0 != NULL && enc != NULL);
    memcpy(res0, res, (size_t)n * 4);
    tagc_status st = tagc_fp4_encode(enc, bytes, with_res ? res : NULL, TAGC_F32, grad, gd, n,
                                     block, flags, seed);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_NONFINITE);
    if (st == TAGC_ERR_NONFINITE) {
        REQUIRE(memcmp(res, res0, (size_t)n * 4) == 0);
    } else {
        memset(out, 0, (size_t)(n ? n : 1) * 4);
        REQUIRE(tagc_fp4_decode_add(out, n, enc, bytes, block, flags, seed) == TAGC_OK);
        for (int64_t i = 0; i < n; i++)
            REQUIRE(isfinite(out[i]) && (!with_res || isfinite(res[i])));
    }
    if (n > 0)
        REQUIRE(tagc_fp4_encode(enc, bytes - 1, res, TAGC_F32, grad, gd, n, block, flags,
                                seed) == TAGC_ERR_CAPACITY);
    free(msg);
    free(out);
    free(grad);
    free(res);
    free(res0);
    free(enc);
}

/* A received tls message (any bytes): decoded, or refused as CORRUPT with out
 * untouched; then encoding hostile values: OK (decoded values and residual
 * finite, decoded + residual the input to fp32 rounding) or NONFINITE with the
 * residual untouched. */
static void fuzz_tls(input_t *in)
{
    uint32_t a = take_u32(in);
    int64_t n = (a >> 1) % 3000;
    int64_t bytes = tagc_tls_bytes(n);
    REQUIRE(bytes >= 0);
    uint8_t *msg = take_buf(in, (size_t)bytes);
    float *out = calloc((size_t)(n ? n : 1), 4);
    REQUIRE(out != NULL);
    tagc_status st = tagc_tls_decode_add(out, n, msg, bytes);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_CORRUPT);
    if (st == TAGC_ERR_CORRUPT)
        for (int64_t i = 0; i < n; i++)
            REQUIRE(out[i] == 0.0f);
    REQUIRE(tagc_tls_decode_add(out, n, msg, bytes + 1) == TAGC_ERR_RANGE);

    tagc_dtype gd = a & 1 ? TAGC_BF16 : TAGC_F32;
    uint8_t *grad = take_buf(in, (size_t)n * tagc_dtype_size(gd));
    float *res = (float *)take_buf(in, (size_t)n * 4);
    float *res0 = malloc((size_t)(n ? n : 1) * 4);
    uint8_t *enc = malloc((size_t)(bytes ? bytes : 1));
    REQUIRE(res0 != NULL && enc != NULL);
    memcpy(res0, res, (size_t)n * 4);
    st = tagc_tls_encode(enc, bytes, res, TAGC_F32, grad, gd, n);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_NONFINITE);
    if (st == TAGC_ERR_NONFINITE) {
        REQUIRE(memcmp(res, res0, (size_t)n * 4) == 0);
    } else {
        memset(out, 0, (size_t)(n ? n : 1) * 4);
        REQUIRE(tagc_tls_decode_add(out, n, enc, bytes) == TAGC_OK);
        for (int64_t i = 0; i < n; i++)
            REQUIRE(isfinite(out[i]) && isfinite(res[i]));
    }
    if (n > 0)
        REQUIRE(tagc_tls_encode(enc, bytes - 1, res, TAGC_F32, grad, gd, n) ==
                TAGC_ERR_CAPACITY);
    free(msg);
    free(out);
    free(grad);
    free(res);
    free(res0);
    free(enc);
}

/* Value i of a buffer of dtype d, as fp32. */
static float value_at(const uint8_t *p, tagc_dtype d, int64_t i)
{
    if (d == TAGC_BF16) {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        return tagc_bf16_to_f32(b);
    }
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

/* A received wq message (any bytes, a random segment table): decoded, or
 * refused (CORRUPT, NONFINITE) with out untouched.  Then hostile weights:
 * encoded (always OK), decoded to NONFINITE exactly when some value is
 * NaN/Inf, else to within half a step of every value, and re-encoded from
 * the fp32 decode to the same bytes. */
static void fuzz_wq(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    tagc_qformat fmt = a & 1 ? TAGC_Q_INT4 : TAGC_Q_INT8;
    tagc_dtype od = (a >> 1) & 1 ? TAGC_BF16 : TAGC_F32, sd = (a >> 2) & 1 ? TAGC_BF16 : TAGC_F32;
    int64_t nseg = (a >> 3) % 9, block = 1 + (int64_t)(b % 700), seg[8], n = 0;
    for (int64_t k = 0; k < nseg; k++) {
        uint32_t c = take_u32(in);
        seg[k] = c & 1 ? 0 : (int64_t)((c >> 1) % 700);
        n += seg[k];
    }
    int64_t bytes = tagc_wq_bytes(seg, nseg, fmt, block);
    REQUIRE(bytes >= 0);
    size_t ob = (size_t)n * tagc_dtype_size(od);
    uint8_t *msg = take_buf(in, (size_t)bytes), *out = malloc(ob ? ob : 1),
            *out0 = malloc(ob ? ob : 1);
    REQUIRE(out != NULL && out0 != NULL);
    memset(out, 0x5a, ob);
    memcpy(out0, out, ob);
    tagc_status st = tagc_wq_decode(out, od, n, msg, bytes, seg, nseg, fmt, block);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_CORRUPT || st == TAGC_ERR_NONFINITE);
    if (st != TAGC_OK)
        REQUIRE(memcmp(out, out0, ob) == 0);
    REQUIRE(tagc_wq_decode(out, od, n, msg, bytes + 1, seg, nseg, fmt, block) == TAGC_ERR_RANGE);
    REQUIRE(tagc_wq_decode(out, od, n + 1, msg, bytes, seg, nseg, fmt, block) == TAGC_ERR_RANGE);

    uint8_t *src = take_buf(in, (size_t)n * tagc_dtype_size(sd));
    size_t eb = (size_t)(bytes ? bytes : 1);
    uint8_t *enc = malloc(eb), *again = malloc(eb);
    float *dec = malloc((size_t)(n ? n : 1) * 4);
    REQUIRE(enc != NULL && again != NULL && dec != NULL);
    REQUIRE(tagc_wq_encode(enc, bytes, src, sd, n, seg, nseg, fmt, block) == TAGC_OK);
    if (bytes > 0)
        REQUIRE(tagc_wq_encode(enc, bytes - 1, src, sd, n, seg, nseg, fmt, block) ==
                TAGC_ERR_CAPACITY);
    int finite = 1, huge = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = value_at(src, sd, i);
        finite &= isfinite(v);
        huge |= fabsf(v) > 1e38f; /* where the scale may be nudged below max / qmax */
    }
    st = tagc_wq_decode(dec, TAGC_F32, n, enc, bytes, seg, nseg, fmt, block);
    REQUIRE(st == (finite ? TAGC_OK : TAGC_ERR_NONFINITE));
    if (st == TAGC_OK) {
        const uint8_t *rec = enc;
        for (int64_t k = 0, o = 0; k < nseg; k++) {
            for (int64_t end = o + seg[k]; o < end;) {
                int64_t len = end - o < block ? end - o : block;
                float s;
                memcpy(&s, rec, 4);
                for (int64_t i = o; i < o + len; i++) /* half a step, up to fp32 rounding */
                    REQUIRE(fabsf(dec[i] - value_at(src, sd, i)) <=
                            (s > 0 ? 0.50001f * s : 127 * 1.2e-38f));
                rec += 4 + (fmt == TAGC_Q_INT4 ? (len + 1) / 2 : len);
                o += len;
            }
        }
        REQUIRE(rec == enc + bytes);
        REQUIRE(tagc_wq_encode(again, bytes, dec, TAGC_F32, n, seg, nseg, fmt, block) == TAGC_OK);
        if (!huge)
            REQUIRE(memcmp(again, enc, (size_t)bytes) == 0);
    }
    free(msg);
    free(out);
    free(out0);
    free(src);
    free(enc);
    free(again);
    free(dec);
}

/* A received delta message (any bytes, flag byte included): decoded into
 * ref and out, or refused (CORRUPT, NONFINITE) with both untouched; a flag
 * of 0 copies ref.  In place (out == ref) gives the same ref. */
static void fuzz_wq_delta(input_t *in)
{
    uint32_t a = take_u32(in), b = take_u32(in);
    tagc_qformat fmt = a & 1 ? TAGC_Q_INT4 : TAGC_Q_INT8;
    tagc_dtype dt = (a >> 1) & 1 ? TAGC_BF16 : TAGC_F32;
    int64_t nseg = (a >> 3) % 9, block = 1 + (int64_t)(b % 700), seg[8], n = 0;
    for (int64_t k = 0; k < nseg; k++) {
        uint32_t c = take_u32(in);
        seg[k] = c & 1 ? 0 : (int64_t)((c >> 1) % 700);
        n += seg[k];
    }
    int64_t bytes = tagc_wq_delta_bytes(seg, nseg, fmt, block);
    REQUIRE(bytes == tagc_wq_bytes(seg, nseg, fmt, block) + 1);
    size_t vb = (size_t)n * tagc_dtype_size(dt);
    uint8_t *msg = take_buf(in, (size_t)bytes), *ref = take_buf(in, vb);
    uint8_t *ref0 = malloc(vb ? vb : 1), *out = malloc(vb ? vb : 1), *out0 = malloc(vb ? vb : 1),
            *ref2 = malloc(vb ? vb : 1);
    REQUIRE(ref0 != NULL && out != NULL && out0 != NULL && ref2 != NULL);
    if ((a >> 2) & 1) /* a valid flag half of the time */
        msg[bytes - 1] &= 1;
    memcpy(ref0, ref, vb);
    memcpy(ref2, ref, vb);
    memset(out, 0x5a, vb);
    memcpy(out0, out, vb);
    tagc_status st = tagc_wq_delta_decode(out, ref, dt, n, msg, bytes, seg, nseg, fmt, block);
    REQUIRE(st == TAGC_OK || st == TAGC_ERR_CORRUPT || st == TAGC_ERR_NONFINITE);
    REQUIRE(st != TAGC_OK || msg[bytes - 1] <= 1);
    if (st != TAGC_OK) {
        REQUIRE(memcmp(out, out0, vb) == 0 && memcmp(ref, ref0, vb) == 0);
    } else {
        REQUIRE(memcmp(out, ref, vb) == 0);
        if (msg[bytes - 1] == 0)
            REQUIRE(memcmp(ref, ref0, vb) == 0);
    }
    tagc_status st2 = tagc_wq_delta_decode(ref2, ref2, dt, n, msg, bytes, seg, nseg, fmt, block);
    REQUIRE(st2 == st);
    REQUIRE(memcmp(ref2, ref, vb) == 0);
    REQUIRE(tagc_wq_delta_decode(out, ref, dt, n, msg, bytes - 1, seg, nseg, fmt, block) ==
            TAGC_ERR_RANGE);
    free(msg);
    free(ref);
    free(ref0);
    free(ref2);
    free(out);
    free(out0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    input_t in = {data + 1, size - 1};
    switch (data[0] % 11) {
    case 0: fuzz_peel(&in); break;
    case 1: fuzz_lanes(&in); break;
    case 2: fuzz_sparse(&in); break;
    case 3: fuzz_encode(&in); break;
    case 4: fuzz_quant(&in); break;
    case 5: fuzz_pairs(&in); break;
    case 6: fuzz_wq(&in); break;
    case 7: fuzz_fp4(&in); break;
    case 8: fuzz_wq_delta(&in); break;
    case 9: fuzz_tls(&in); break;
    default: fuzz_sparsify(&in); break;
    }
    return 0;
}
