/*
 * pairs.c - coded pairs, the `auto` transport's wire format (tagc.h): a
 * rank's k kept (position, value) pairs of a shard as Elias-Fano positions,
 * a bitmap, or a dense vector, whichever is smallest for (n, k, dtype).
 *
 * Every buffer here may come off the network at any alignment, so values
 * are moved with memcpy and bit arrays are read a byte at a time.
 */
#include "tagc_checks.h"
#include "tagc_internal.h"

/* A value of dtype vd at byte address p (any alignment), as fp32. */
TAGC_AI float ld_raw(const uint8_t *p, int vd)
{
    if (vd == TAGC_F32) {
        float v;
        memcpy(&v, p, 4);
        return v;
    }
    uint16_t b;
    memcpy(&b, p, 2);
    return tagc_bf16_to_f32(b);
}

static tagc_status check_positions(const int32_t *idx, int64_t k, int64_t n)
{
    for (int64_t j = 0; j < k; j++)
        if (idx[j] < 0 || idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
            return TAGC_ERR_RANGE;
    return TAGC_OK;
}

/* EF: the low l bits of each position back to back, then the upper
 * bitvector (bit (p >> l) + j for the j-th position). */
static void ef_pack(uint8_t *dst, const int32_t *idx, int64_t k, int64_t n, int l)
{
    uint8_t *o = dst;
    if (l > 0) {
        uint64_t acc = 0, mask = ((uint64_t)1 << l) - 1;
        int nb = 0;
        for (int64_t j = 0; j < k; j++) {
            acc |= ((uint64_t)idx[j] & mask) << nb;
            nb += l;
            while (nb >= 8) {
                *o++ = (uint8_t)acc;
                acc >>= 8;
                nb -= 8;
            }
        }
        if (nb > 0)
            *o++ = (uint8_t)acc;
    }
    int64_t up_bytes = (k + ((n - 1) >> l) + 1 + 7) >> 3;
    memset(o, 0, (size_t)up_bytes);
    for (int64_t j = 0; j < k; j++) {
        int64_t b = ((int64_t)idx[j] >> l) + j;
        o[b >> 3] |= (uint8_t)(1u << (b & 7));
    }
}

tagc_status tagc_pairs_pack(uint8_t *dst, int64_t dst_capacity,
                            const int32_t *idx, const void *val, tagc_dtype val_dtype,
                            int64_t k, int64_t n, tagc_coding coding)
{
    tagc_status st = tagc_check_pairs_pack(dst, dst_capacity, idx, val, (int)val_dtype, k, n,
                                           (int)coding);
    if (st != TAGC_OK || k == 0)
        return st;
    st = check_positions(idx, k, n);
    if (st != TAGC_OK)
        return st;
    size_t vs = tagc_dtype_size(val_dtype);
    int64_t total = tagc_check_pairs_bytes(n, k, (int)val_dtype, (int)coding);
    if (coding == TAGC_PAIRS_DENSE) {
        memset(dst, 0, (size_t)total);
        for (int64_t j = 0; j < k; j++)
            memcpy(dst + (size_t)idx[j] * vs, (const uint8_t *)val + (size_t)j * vs, vs);
        return TAGC_OK;
    }
    if (coding == TAGC_PAIRS_BITMAP) {
        memset(dst, 0, (size_t)bitmap_bytes(n));
        for (int64_t j = 0; j < k; j++)
            dst[idx[j] >> 3] |= (uint8_t)(1u << (idx[j] & 7));
    } else {
        ef_pack(dst, idx, k, n, tagc_check_ef_low_bits(n, k));
    }
    memcpy(dst + total - (int64_t)vs * k, val, (size_t)k * vs);
    return TAGC_OK;
}

/* Sequential reader of the l-bit low parts (l <= 30: at most 37 bits held). */
typedef struct {
    const uint8_t *p;
    int64_t left;
    uint64_t buf;
    int nb;
} bits_in;

TAGC_AI uint32_t bits_get(bits_in *r, int l)
{
    while (r->nb < l) {
        uint64_t byte = r->left > 0 ? *r->p : 0;
        r->p++;
        r->left--;
        r->buf |= byte << r->nb;
        r->nb += 8;
    }
    uint32_t v = (uint32_t)(r->buf & (((uint64_t)1 << l) - 1));
    r->buf >>= l;
    r->nb -= l;
    return v;
}

/* One walk of an EF message: with add == 0 it only validates (returns
 * CORRUPT at the first inconsistency), with add == 1 it scatter-adds (the
 * message having been validated).  Upper bits are read 8 bytes at a time;
 * each set bit at b is the j-th position's high part b - j. */
TAGC_AI tagc_status ef_walk(float *out, const uint8_t *src, int64_t n, int64_t k, int l,
                            int vd, int add)
{
    int64_t lo_bytes = (k * l + 7) >> 3;
    int64_t up_bits = k + ((n - 1) >> l) + 1;
    int64_t up_bytes = (up_bits + 7) >> 3;
    const uint8_t *up = src + lo_bytes, *vals = up + up_bytes;
    int64_t vs = vd == TAGC_F32 ? 4 : 2;
    if (!add && ((k * l) & 7) && (src[lo_bytes - 1] >> ((k * l) & 7)) != 0)
        return TAGC_ERR_CORRUPT; /* padding of the low bits */
    bits_in lr = {src, lo_bytes, 0, 0};
    int64_t j = 0, prev = -1;
    for (int64_t off = 0; off < up_bytes; off += 8) {
        uint64_t w = load_le(up + off, up_bytes - off);
        while (w) {
            int64_t b = off * 8 + __builtin_ctzll(w);
            w &= w - 1;
            if (!add && (j >= k || b >= up_bits))
                return TAGC_ERR_CORRUPT; /* too many ones, or padding set */
            uint32_t low = l > 0 ? bits_get(&lr, l) : 0;
            int64_t p = ((b - j) << l) | low;
            if (!add && (p >= n || p <= prev))
                return TAGC_ERR_CORRUPT;
            if (add)
                out[p] += ld_raw(vals + j * vs, vd);
            prev = p;
            j++;
        }
    }
    return j == k ? TAGC_OK : TAGC_ERR_CORRUPT;
}

/* BITMAP: exactly k set bits, none past n; positions come out ascending. */
static tagc_status bitmap_check(const uint8_t *bm, int64_t n, int64_t k)
{
    int64_t nb = bitmap_bytes(n), ones = 0;
    for (int64_t off = 0; off < nb; off += 8)
        ones += __builtin_popcountll(load_le(bm + off, nb - off));
    if ((n & 7) && (bm[nb - 1] >> (n & 7)) != 0)
        return TAGC_ERR_CORRUPT;
    return ones == k ? TAGC_OK : TAGC_ERR_CORRUPT;
}

TAGC_AI void bitmap_add(float *out, const uint8_t *bm, int64_t n, const uint8_t *vals, int vd)
{
    int64_t nb = bitmap_bytes(n), j = 0, vs = vd == TAGC_F32 ? 4 : 2;
    for (int64_t off = 0; off < nb; off += 8) {
        uint64_t w = load_le(bm + off, nb - off);
        while (w) {
            out[off * 8 + __builtin_ctzll(w)] += ld_raw(vals + j * vs, vd);
            w &= w - 1;
            j++;
        }
    }
}

TAGC_AI void dense_add(float *out, const uint8_t *vals, int64_t n, int vd)
{
    int64_t vs = vd == TAGC_F32 ? 4 : 2;
    for (int64_t i = 0; i < n; i++)
        out[i] += ld_raw(vals + i * vs, vd);
}

tagc_status tagc_pairs_unpack_add(float *out, int64_t n,
                                  const uint8_t *src, int64_t src_bytes,
                                  int64_t k, tagc_dtype val_dtype, tagc_coding coding)
{
    tagc_status st = tagc_check_pairs_unpack(out, n, src, src_bytes, k, (int)val_dtype,
                                             (int)coding);
    if (st != TAGC_OK || k == 0)
        return st;
    int vd = (int)val_dtype;
    if (coding == TAGC_PAIRS_DENSE) {
        if (vd == TAGC_F32)
            dense_add(out, src, n, TAGC_F32);
        else
            dense_add(out, src, n, TAGC_BF16);
        return TAGC_OK;
    }
    if (coding == TAGC_PAIRS_BITMAP) {
        st = bitmap_check(src, n, k);
        if (st != TAGC_OK)
            return st;
        const uint8_t *vals = src + bitmap_bytes(n);
        if (vd == TAGC_F32)
            bitmap_add(out, src, n, vals, TAGC_F32);
        else
            bitmap_add(out, src, n, vals, TAGC_BF16);
        return TAGC_OK;
    }
    int l = tagc_check_ef_low_bits(n, k);
    st = ef_walk(NULL, src, n, k, l, vd, 0);
    if (st != TAGC_OK)
        return st;
    if (vd == TAGC_F32)
        return ef_walk(out, src, n, k, l, TAGC_F32, 1);
    return ef_walk(out, src, n, k, l, TAGC_BF16, 1);
}
