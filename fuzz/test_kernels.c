/*
 * test_kernels.c - C-level tests of the codec kernels (csrc/tagc.h), built by
 * scripts/tools/sanitize.sh with ASan + UBSan so every kernel path runs under the
 * sanitizers.  Exits non-zero on the first failed check.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tagc.h"
#include "tagc_portable.h"

static int failures = 0;

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                     \
            return;                                                         \
        }                                                                   \
    } while (0)

static uint64_t rng_state = 88172645463325252ULL;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static float frand(void)
{
    return (float)((double)(rng() >> 11) / (double)(1ULL << 53)) * 2.0f - 1.0f;
}

typedef struct {
    float mag;
    int32_t pos;
} entry_t;

/* Larger magnitude first, then lower position: the documented keep order. */
static int by_keep_order(const void *a, const void *b)
{
    const entry_t *x = a, *y = b;
    if (x->mag != y->mag)
        return x->mag > y->mag ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static void test_sparsify_case(int64_t n, int64_t k, int mode)
{
    float *grad = malloc((size_t)(n ? n : 1) * 4), *res = malloc((size_t)(n ? n : 1) * 4);
    float *v = malloc((size_t)(n ? n : 1) * 4);
    int32_t *idx = malloc((size_t)(k ? k : 1) * 4);
    float *val = malloc((size_t)(k ? k : 1) * 4);
    uint8_t *bm = malloc((size_t)((n + 7) / 8 + 1));
    entry_t *e = malloc((size_t)(n ? n : 1) * sizeof *e);
    for (int64_t i = 0; i < n; i++) {
        grad[i] = mode == 0 ? frand() : mode == 1 ? 0.0f : (float)(int)(rng() % 5) - 2.0f;
        res[i] = mode == 0 ? 0.1f * frand() : 0.0f;
        v[i] = grad[i] + res[i];
        e[i].mag = fabsf(v[i]);
        e[i].pos = (int32_t)i;
    }
    qsort(e, (size_t)n, sizeof *e, by_keep_order);
    float tau = 0;
    tagc_status st = tagc_sparsify(idx, k, val, TAGC_F32, k, bm, (n + 7) / 8, res, TAGC_F32,
                                   grad, TAGC_F32, n, k, &tau);
    CHECK(st == TAGC_OK);
    CHECK(k == 0 ? isinf(tau) : tau == e[k - 1].mag);
    uint8_t *want = calloc((size_t)((n + 7) / 8 + 1), 1);
    for (int64_t j = 0; j < k; j++)
        want[e[j].pos >> 3] |= (uint8_t)(1u << (e[j].pos & 7));
    CHECK(memcmp(want, bm, (size_t)((n + 7) / 8)) == 0);
    int64_t w = 0;
    for (int64_t p = 0; p < n; p++) {
        if (tagc_bit_get(want, p)) {
            CHECK(idx[w] == p && val[w] == v[p] && res[p] == 0.0f);
            w++;
        } else {
            CHECK(res[p] == v[p]);
        }
    }
    CHECK(w == k);
    free(want);
    free(grad);
    free(res);
    free(v);
    free(idx);
    free(val);
    free(bm);
    free(e);
}

static void test_sparsify(void)
{
    int64_t sizes[] = {0, 1, 2, 7, 8, 9, 100, 1001, 70000};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        int64_t n = sizes[s];
        int64_t ks[] = {0, 1, n / 2, (n + 79) / 80, n};
        for (int mode = 0; mode < 3; mode++)
            for (size_t j = 0; j < 5; j++)
                if (ks[j] <= n)
                    test_sparsify_case(n, ks[j], mode);
    }
}

static void test_sparsify_errors(void)
{
    float g[4] = {1, 2, NAN, 4}, r[4] = {9, 9, 9, 9}, tau, val[2] = {7, 7};
    int32_t idx[2] = {-1, -1};
    uint8_t bm[1] = {0x5a};
    CHECK(tagc_sparsify(idx, 2, val, TAGC_F32, 2, bm, 1, r, TAGC_F32, g, TAGC_F32, 4, 2, &tau)
          == TAGC_ERR_NONFINITE);
    CHECK(r[0] == 9 && r[3] == 9 && idx[0] == -1 && val[0] == 7 && bm[0] == 0x5a);
    g[2] = 3;
    CHECK(tagc_sparsify(idx, 1, val, TAGC_F32, 2, bm, 1, r, TAGC_F32, g, TAGC_F32, 4, 2, &tau)
          == TAGC_ERR_CAPACITY);
    CHECK(tagc_sparsify(idx, 2, val, TAGC_F32, 2, bm, 1, r, TAGC_F32, g, TAGC_F32, 4, 5, &tau)
          == TAGC_ERR_RANGE);
    CHECK(tagc_sparsify(idx, 2, val, TAGC_F32, 2, bm, 1, r, TAGC_F32, g, (tagc_dtype)9, 4, 2,
                        &tau) == TAGC_ERR_DTYPE);
    CHECK(tagc_sparsify(idx, 2, val, TAGC_F32, 2, bm, 1, r, TAGC_F32, NULL, TAGC_F32, 4, 2,
                        &tau) == TAGC_ERR_ARG);
    CHECK(tagc_select_kth(&tau, g, TAGC_F32, 4, 5) == TAGC_ERR_RANGE);
    CHECK(tagc_select_kth(&tau, g, TAGC_F32, 4, 1) == TAGC_OK && tau == 4.0f);
}

static void test_lanes(void)
{
    for (int64_t n = 0; n < 200; n++) {
        for (int bits = 1; bits <= 8; bits <<= 1) {
            int64_t nb = (n + 7) / 8, lb = tagc_lane_bytes(n, bits);
            uint8_t *bm = malloc((size_t)(nb ? nb : 1)), *back = malloc((size_t)(nb ? nb : 1));
            uint8_t *lanes = malloc((size_t)(lb ? lb : 1));
            for (int64_t j = 0; j < nb; j++)
                bm[j] = (uint8_t)rng();
            CHECK(tagc_lanes_pack(lanes, lb, bm, n, bits) == TAGC_OK);
            CHECK(tagc_lanes_unpack(back, nb, lanes, lb, n, bits) == TAGC_OK);
            for (int64_t p = 0; p < n; p++)
                CHECK(tagc_bit_get(back, p) == tagc_bit_get(bm, p) &&
                      tagc_lane_get(lanes, p, bits) == tagc_bit_get(bm, p));
            if (n % 8)
                CHECK((back[nb - 1] >> (n % 8)) == 0);
            int64_t c1 = -1, c2 = -1;
            CHECK(tagc_popcount(&c1, back, n) == TAGC_OK && tagc_popcount(&c2, bm, n) == TAGC_OK);
            CHECK(c1 == c2);
            CHECK(tagc_lanes_pack(lanes, lb - 1, bm, n, bits) == TAGC_ERR_CAPACITY);
            CHECK(tagc_lanes_pack(lanes, lb, bm, n, 3) == TAGC_ERR_RANGE);
            free(bm);
            free(back);
            free(lanes);
        }
    }
}

/* N ranks encode disjoint-or-overlapping sparse vectors; the sum of their
 * sketches peels back to the sum of the vectors. */
static void test_roundtrip(void)
{
    const int64_t n = 200000, k = 2500, ranks = 3, t = (int64_t)(1.3 * ranks * k / 3) + 1;
    float *truth = calloc((size_t)n, 4), *out = malloc((size_t)n * 4);
    float *total = calloc((size_t)(3 * t), 4), *sk = malloc((size_t)(3 * t) * 4);
    uint8_t *uni = calloc((size_t)((n + 7) / 8), 1);
    int32_t *idx = malloc((size_t)k * 4);
    float *val = malloc((size_t)k * 4);
    uint64_t seed = tagc_seed_derive(1, 2, 3);
    for (int64_t r = 0; r < ranks; r++) {
        for (int64_t j = 0; j < k; j++) {
            idx[j] = (int32_t)(rng() % (uint64_t)n);
            val[j] = frand();
        }
        /* duplicate positions within a rank simply add up */
        CHECK(tagc_sketch_encode(sk, TAGC_F32, 3 * t, idx, val, TAGC_F32, k, n, t, seed) == TAGC_OK);
        for (int64_t b = 0; b < 3 * t; b++)
            total[b] += sk[b];
        for (int64_t j = 0; j < k; j++) {
            truth[idx[j]] += val[j];
            uni[idx[j] >> 3] |= (uint8_t)(1u << (idx[j] & 7));
        }
    }
    int64_t left = -1;
    CHECK(tagc_peel_decode(out, n, NULL, 0, &left, total, TAGC_F32, uni, n, t, seed, 1) == TAGC_OK);
    CHECK(left == 0);
    for (int64_t p = 0; p < n; p++)
        CHECK(fabsf(out[p] - truth[p]) <= 1e-4f);
    /* too small a sketch: reported, and never out of bounds */
    int32_t unp[4];
    CHECK(tagc_peel_decode(out, n, unp, 4, &left, total, TAGC_F32, uni, n, t / 4, seed, 1)
          == TAGC_OK);
    CHECK(left > 0 && unp[0] < unp[1]);
    CHECK(tagc_sketch_encode(sk, TAGC_F32, 3 * t - 1, idx, val, TAGC_F32, k, n, t, seed)
          == TAGC_ERR_CAPACITY);
    idx[3] = (int32_t)n;
    CHECK(tagc_sketch_encode(sk, TAGC_F32, 3 * t, idx, val, TAGC_F32, k, n, t, seed)
          == TAGC_ERR_RANGE);
    free(truth);
    free(out);
    free(total);
    free(sk);
    free(uni);
    free(idx);
    free(val);
}

/* One position, one bucket per table: every bucket is queued at once, the
 * smallest queue there is. */
static void test_peel_tiny(void)
{
    int32_t idx[1] = {0};
    float val[1] = {2.5f}, sk[3], out[1] = {9};
    uint8_t bm[1] = {1};
    int64_t left = -1;
    CHECK(tagc_sketch_encode(sk, TAGC_F32, 3, idx, val, TAGC_F32, 1, 1, 1, 5) == TAGC_OK);
    CHECK(tagc_peel_decode(out, 1, NULL, 0, &left, sk, TAGC_F32, bm, 1, 1, 5, 1) == TAGC_OK);
    CHECK(left == 0 && out[0] == 2.5f);
}

static void test_sparse(void)
{
    int32_t idx[3] = {4, 0, 4};
    float val[3] = {1.5f, -2.0f, 0.25f}, out[5] = {0};
    uint8_t buf[24];
    CHECK(tagc_sparse_pack(buf, 24, idx, val, TAGC_F32, 3) == TAGC_OK);
    CHECK(tagc_sparse_pack(buf, 23, idx, val, TAGC_F32, 3) == TAGC_ERR_CAPACITY);
    CHECK(tagc_sparse_unpack(out, 5, buf, 24, 3, TAGC_F32) == TAGC_OK);
    CHECK(out[0] == -2.0f && out[4] == 1.75f);
    CHECK(tagc_sparse_unpack(out, 4, buf, 24, 3, TAGC_F32) == TAGC_ERR_CORRUPT);
    CHECK(out[0] == -2.0f && out[3] == 0.0f);
    CHECK(tagc_sparse_unpack(out, 5, buf, 23, 3, TAGC_F32) == TAGC_ERR_RANGE);
}

/* Hand-checked Elias-Fano bytes: n = 20, k = 3, l = 2 (3 * 8 > 20); lows
 * 01 01 11 LSB-first = 0x35; highs 0, 2, 4 set bits 0, 3, 6 = 0x49. */
static void test_pairs(void)
{
    int32_t idx[3] = {1, 9, 19}, bad[3] = {1, 9, 9};
    float val[3] = {1.5f, -2.0f, 0.25f}, out[20] = {0};
    uint8_t buf[80];
    CHECK(tagc_ef_low_bits(20, 3) == 2 && tagc_ef_low_bits(3, 4) == -1);
    CHECK(tagc_pairs_bytes(20, 3, TAGC_F32, TAGC_PAIRS_EF) == 14);
    CHECK(tagc_pairs_bytes(20, 3, TAGC_F32, TAGC_PAIRS_BITMAP) == 15);
    CHECK(tagc_pairs_bytes(20, 3, TAGC_F32, TAGC_PAIRS_DENSE) == 80);
    CHECK(tagc_pairs_cheapest(20, 3, TAGC_F32) == TAGC_PAIRS_EF);
    CHECK(tagc_pairs_cheapest(20, 20, TAGC_F32) == TAGC_PAIRS_DENSE);
    CHECK(tagc_pairs_pack(buf, 14, idx, val, TAGC_F32, 3, 20, TAGC_PAIRS_EF) == TAGC_OK);
    CHECK(buf[0] == 0x35 && buf[1] == 0x49 && memcmp(buf + 2, val, 12) == 0);
    CHECK(tagc_pairs_pack(buf, 13, idx, val, TAGC_F32, 3, 20, TAGC_PAIRS_EF) ==
          TAGC_ERR_CAPACITY);
    CHECK(tagc_pairs_pack(buf, 14, bad, val, TAGC_F32, 3, 20, TAGC_PAIRS_EF) ==
          TAGC_ERR_RANGE);
    CHECK(tagc_pairs_unpack_add(out, 20, buf, 14, 3, TAGC_F32, TAGC_PAIRS_EF) == TAGC_OK);
    CHECK(out[1] == 1.5f && out[9] == -2.0f && out[19] == 0.25f && out[0] == 0.0f);
    buf[1] = 0x4b; /* a fourth set bit: corrupt, out untouched */
    CHECK(tagc_pairs_unpack_add(out, 20, buf, 14, 3, TAGC_F32, TAGC_PAIRS_EF) ==
          TAGC_ERR_CORRUPT);
    CHECK(out[1] == 1.5f && out[3] == 0.0f);
    CHECK(tagc_pairs_unpack_add(out, 20, buf, 15, 3, TAGC_F32, TAGC_PAIRS_EF) ==
          TAGC_ERR_RANGE);
}

/* Hand-checked bytes of each format, and the error cases. */
static void test_quant(void)
{
    const float v[6] = {1.0f, -2.0f, 0.5f, 0.0f, 4.0f, -4.0f};
    float res[6] = {0}, out[6] = {0};
    uint8_t buf[16];
    /* int8, one block of 6: s = 4/127; max |v| goes out exactly */
    CHECK(tagc_quant_bytes(6, TAGC_Q_INT8, 6) == 10);
    CHECK(tagc_quant_encode(buf, 10, res, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_INT8, 6) == TAGC_OK);
    CHECK((int8_t)buf[4 + 4] == 127 && (int8_t)buf[4 + 5] == -127 && buf[4 + 3] == 0);
    CHECK(tagc_quant_decode_add(out, 6, buf, 10, TAGC_Q_INT8, 6) == TAGC_OK);
    CHECK(out[4] == 4.0f && out[5] == -4.0f && res[4] == 0.0f);
    for (int i = 0; i < 6; i++)
        CHECK(fabsf(out[i] + res[i] - v[i]) <= 1e-6f);
    /* sign, blocks of 4: s = mean |v| = 0.875, then 4; bits LSB first */
    CHECK(tagc_quant_bytes(6, TAGC_Q_SIGN, 4) == 10);
    CHECK(tagc_quant_encode(buf, 10, NULL, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_SIGN, 4) == TAGC_OK);
    float s0, s1;
    memcpy(&s0, buf, 4);
    memcpy(&s1, buf + 5, 4);
    CHECK(s0 == 0.875f && s1 == 4.0f && buf[4] == 0x0d && buf[9] == 0x01);
    /* ternary, one block: s = min(2.5 * 11.5 / 6, 4) = 4; |v| > 2 goes out
     * (-2 / 4 = -0.5 rounds half to even: 0) */
    CHECK(tagc_quant_encode(buf, 16, NULL, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_TERNARY, 6) ==
          TAGC_OK);
    /* digits q+1 = 1,1,1,1,2 -> 1 + 3 + 9 + 27 + 162 = 202; then 0 and four
     * pad digits 1 -> 3 + 9 + 27 + 81 = 120 */
    CHECK(buf[4] == 202 && buf[5] == 120);
    buf[5] = 243;
    memset(out, 0, sizeof out);
    CHECK(tagc_quant_decode_add(out, 6, buf, 6, TAGC_Q_TERNARY, 6) == TAGC_ERR_CORRUPT);
    CHECK(out[0] == 0.0f);
    /* errors */
    const float bad[2] = {1.0f, NAN};
    float r2[2] = {0.5f, 0.5f};
    CHECK(tagc_quant_encode(buf, 16, r2, TAGC_F32, bad, TAGC_F32, 2, TAGC_Q_INT4, 8) ==
          TAGC_ERR_NONFINITE);
    CHECK(r2[0] == 0.5f && r2[1] == 0.5f);
    CHECK(tagc_quant_encode(buf, 4, NULL, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_INT4, 8) ==
          TAGC_ERR_CAPACITY);
    CHECK(tagc_quant_encode(buf, 16, NULL, TAGC_F32, v, TAGC_F32, 6, (tagc_qformat)3, 8) ==
          TAGC_ERR_RANGE);
    CHECK(tagc_quant_encode(buf, 16, NULL, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_INT4, 0) ==
          TAGC_ERR_RANGE);
    CHECK(tagc_quant_encode(NULL, 16, NULL, TAGC_F32, v, TAGC_F32, 6, TAGC_Q_INT4, 8) ==
          TAGC_ERR_ARG);
    CHECK(tagc_quant_encode(buf, 16, NULL, TAGC_F32, v, (tagc_dtype)5, 6, TAGC_Q_INT4, 8) ==
          TAGC_ERR_DTYPE);
    CHECK(tagc_quant_bytes(-1, TAGC_Q_INT4, 8) == -1 && tagc_quant_bytes(0, TAGC_Q_INT4, 8) == 0);
    CHECK(tagc_quant_decode_add(out, 6, buf, 9, TAGC_Q_TERNARY, 6) == TAGC_ERR_RANGE);
}

/* Hand-checked wq messages: bytes, the sentinel, refusals and size rules. */
static void test_wq(void)
{
    const float v[4] = {127.0f, -63.5f, 0.5f, -1.0f};
    const int64_t seg3[1] = {3}, seg31[2] = {3, 1};
    uint8_t buf[16];
    float out[4] = {0};
    uint16_t bout[3];
    /* int8, blocks of 2: s = 1, q = 127, -64 (half to even); then s = 0.5/127, q = 127 */
    CHECK(tagc_wq_bytes(seg3, 1, TAGC_Q_INT8, 2) == 11);
    CHECK(tagc_wq_encode(buf, 11, v, TAGC_F32, 3, seg3, 1, TAGC_Q_INT8, 2) == TAGC_OK);
    const uint8_t head[6] = {0x00, 0x00, 0x80, 0x3f, 0x7f, 0xc0};
    float s2 = 0.5f / 127.0f;
    CHECK(memcmp(buf, head, 6) == 0 && memcmp(buf + 6, &s2, 4) == 0 && buf[10] == 0x7f);
    CHECK(tagc_wq_decode(out, TAGC_F32, 3, buf, 11, seg3, 1, TAGC_Q_INT8, 2) == TAGC_OK);
    CHECK(out[0] == 127.0f && out[1] == -64.0f && out[2] == 127.0f * s2);
    CHECK(tagc_wq_decode(bout, TAGC_BF16, 3, buf, 11, seg3, 1, TAGC_Q_INT8, 2) == TAGC_OK);
    CHECK(bout[0] == 0x42fe && bout[1] == 0xc280);
    /* int4, segments (3, 1), blocks of 4 (none crosses the segments): s = 7/7,
     * q = 7, -4 (half to even), 0 and a pad nibble; then s = 1/7, q = -7, pad.
     * Nibbles q + 7, value 2j low. */
    CHECK(tagc_wq_bytes(seg31, 2, TAGC_Q_INT4, 4) == 11);
    const float w[4] = {7.0f, -3.5f, 0.0f, -1.0f};
    CHECK(tagc_wq_encode(buf, 11, w, TAGC_F32, 4, seg31, 2, TAGC_Q_INT4, 4) == TAGC_OK);
    const uint8_t int4_head[6] = {0x00, 0x00, 0x80, 0x3f, 0x3e, 0x77};
    float s7 = 1.0f / 7.0f;
    CHECK(memcmp(buf, int4_head, 6) == 0 && memcmp(buf + 6, &s7, 4) == 0 && buf[10] == 0x70);
    buf[10] = 0x7f; /* a nibble 15: corrupt, out untouched */
    out[0] = 9.0f;
    CHECK(tagc_wq_decode(out, TAGC_F32, 4, buf, 11, seg31, 2, TAGC_Q_INT4, 4) ==
          TAGC_ERR_CORRUPT);
    CHECK(out[0] == 9.0f);
    buf[10] = 0xf0; /* the pad nibble is not a code */
    CHECK(tagc_wq_decode(out, TAGC_F32, 4, buf, 11, seg31, 2, TAGC_Q_INT4, 4) == TAGC_OK);
    CHECK(out[3] == -7.0f * s7);
    /* NaN in the second block: the sentinel (bytes ee ff c0 7f), codes 0 */
    const float nan_v[3] = {1.0f, 2.0f, NAN};
    const int64_t seg12[2] = {1, 2};
    CHECK(tagc_wq_encode(buf, 11, nan_v, TAGC_F32, 3, seg12, 2, TAGC_Q_INT8, 2) == TAGC_OK);
    const uint8_t sentinel[6] = {0xee, 0xff, 0xc0, 0x7f, 0x00, 0x00};
    CHECK(tagc_wq_bytes(seg12, 2, TAGC_Q_INT8, 2) == 11 && memcmp(buf + 5, sentinel, 6) == 0);
    out[0] = 9.0f;
    CHECK(tagc_wq_decode(out, TAGC_F32, 3, buf, 11, seg12, 2, TAGC_Q_INT8, 2) ==
          TAGC_ERR_NONFINITE);
    CHECK(out[0] == 9.0f);
    buf[4] = 0x80; /* and an int8 -128 elsewhere: corrupt first */
    CHECK(tagc_wq_decode(out, TAGC_F32, 3, buf, 11, seg12, 2, TAGC_Q_INT8, 2) ==
          TAGC_ERR_CORRUPT);
    /* size rules and errors */
    const int64_t neg[2] = {3, -1}, big[2] = {INT32_MAX, 1}, empty[3] = {0, 0, 0};
    CHECK(tagc_wq_bytes(NULL, 0, TAGC_Q_INT8, 2) == 0);
    CHECK(tagc_wq_bytes(empty, 3, TAGC_Q_INT4, 9) == 0);
    CHECK(tagc_wq_bytes(seg3, -1, TAGC_Q_INT8, 2) == -1);
    CHECK(tagc_wq_bytes(NULL, 1, TAGC_Q_INT8, 2) == -1);
    CHECK(tagc_wq_bytes(neg, 2, TAGC_Q_INT8, 2) == -1);
    CHECK(tagc_wq_bytes(big, 2, TAGC_Q_INT8, 2) == -1);
    CHECK(tagc_wq_bytes(seg3, 1, TAGC_Q_TERNARY, 2) == -1);
    CHECK(tagc_wq_bytes(seg3, 1, TAGC_Q_INT8, 0) == -1);
    CHECK(tagc_wq_bytes(seg3, 1, TAGC_Q_INT8, TAGC_QBLOCK_MAX + 1) == -1);
    CHECK(tagc_wq_encode(buf, 11, v, TAGC_F32, 4, seg3, 1, TAGC_Q_INT8, 2) == TAGC_ERR_RANGE);
    CHECK(tagc_wq_encode(buf, 10, v, TAGC_F32, 3, seg3, 1, TAGC_Q_INT8, 2) == TAGC_ERR_CAPACITY);
    CHECK(tagc_wq_encode(buf, 11, v, (tagc_dtype)2, 3, seg3, 1, TAGC_Q_INT8, 2) == TAGC_ERR_DTYPE);
    CHECK(tagc_wq_encode(buf, 11, v, TAGC_F32, 3, NULL, 1, TAGC_Q_INT8, 2) == TAGC_ERR_ARG);
    CHECK(tagc_wq_encode(buf, 11, v, TAGC_F32, 3, seg3, 1, TAGC_Q_SIGN, 2) == TAGC_ERR_RANGE);
    CHECK(tagc_wq_decode(out, TAGC_F32, 3, buf, 10, seg3, 1, TAGC_Q_INT8, 2) == TAGC_ERR_RANGE);
    CHECK(tagc_wq_decode(out, TAGC_F32, 4, buf, 11, seg3, 1, TAGC_Q_INT8, 2) == TAGC_ERR_RANGE);
}

/* Hand-checked delta messages: the change coded, the flag, sent remembered,
 * an unchanged shard sent as zeros, ref += change, refusals untouched. */
static void test_wq_delta(void)
{
    const int64_t seg[1] = {2};
    float src[2] = {1.5f, -2.0f}, sent[2] = {0}, base[2] = {1.0f, -1.0f};
    uint8_t buf[7];
    /* int8, one block: d = (0.5, -1), s = 1/127, q = 64 (63.5 half to even), -127 */
    CHECK(tagc_wq_delta_bytes(seg, 1, TAGC_Q_INT8, 2) == 7);
    CHECK(tagc_wq_delta_encode(buf, 6, src, sent, base, TAGC_F32, 2, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_ERR_CAPACITY);
    CHECK(sent[0] == 0.0f);
    CHECK(tagc_wq_delta_encode(buf, 7, src, sent, base, TAGC_F32, 2, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_OK);
    float s = 1.0f / 127.0f;
    CHECK(memcmp(buf, &s, 4) == 0 && buf[4] == 64 && buf[5] == 0x81 && buf[6] == 1);
    CHECK(sent[0] == 1.5f && sent[1] == -2.0f);
    float ref[2] = {1.0f, -1.0f}, out[2] = {0};
    CHECK(tagc_wq_delta_decode(out, ref, TAGC_F32, 2, buf, 7, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_OK);
    CHECK(ref[0] == 1.0f + 64.0f * s && ref[1] == -2.0f && out[0] == ref[0] && out[1] == ref[1]);
    buf[6] = 2; /* no encoder writes this flag */
    CHECK(tagc_wq_delta_decode(out, ref, TAGC_F32, 2, buf, 7, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_ERR_CORRUPT);
    CHECK(ref[1] == -2.0f);
    CHECK(tagc_wq_delta_encode(buf, 7, src, sent, base, TAGC_F32, 2, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_OK);
    for (int i = 0; i < 7; i++)
        CHECK(buf[i] == 0);
    out[0] = 9.0f;
    CHECK(tagc_wq_delta_decode(out, ref, TAGC_F32, 2, buf, 7, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_OK);
    CHECK(out[0] == ref[0] && ref[1] == -2.0f);
    CHECK(tagc_wq_delta_decode(out, ref, TAGC_F32, 2, buf, 6, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_ERR_RANGE);
    CHECK(tagc_wq_delta_decode(out, NULL, TAGC_F32, 2, buf, 7, seg, 1, TAGC_Q_INT8, 2) ==
          TAGC_ERR_ARG);
    CHECK(tagc_wq_delta_encode(NULL, 1, NULL, NULL, NULL, TAGC_F32, 0, NULL, 0, TAGC_Q_INT8,
                               2) == TAGC_ERR_ARG);
    CHECK(tagc_wq_delta_encode(buf, 1, NULL, NULL, NULL, TAGC_F32, 0, NULL, 0, TAGC_Q_INT8,
                               2) == TAGC_OK && buf[0] == 0);
}

static void test_misc(void)
{
    uint8_t src[6] = {1, 2, 4, 8, 16, 32}, dst[3] = {0};
    CHECK(tagc_bitmap_or(dst, 3, src, 3, 2) == TAGC_OK);
    CHECK(dst[0] == 9 && dst[1] == 18 && dst[2] == 36);
    CHECK(tagc_bitmap_or(dst, 2, src, 3, 2) == TAGC_ERR_CAPACITY);
    CHECK(strcmp(tagc_status_str(TAGC_OK), "ok") == 0);
    CHECK(tagc_dtype_size(TAGC_BF16) == 2 && tagc_dtype_size((tagc_dtype)7) == 0);
    CHECK(tagc_f32_to_bf16(1.0f) == 0x3f80 && tagc_bf16_to_f32(0x3f80) == 1.0f);
    CHECK(tagc_median3(3, 1, 2) == 2 && tagc_median3(1, 2, 3) == 2);
}

int main(void)
{
    test_sparsify();
    test_sparsify_errors();
    test_lanes();
    test_roundtrip();
    test_peel_tiny();
    test_sparse();
    test_pairs();
    test_quant();
    test_wq();
    test_wq_delta();
    test_misc();
    if (failures) {
        fprintf(stderr, "test_kernels: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_kernels: all checks passed\n");
    return 0;
}
