/*
 * lanes.c - bitmap <-> 1/2/4/8-bit lanes (the paper's SUM-as-OR index), OR of
 * N bitmaps, popcount.  Lane layout: tagc_portable.h.
 */
#include "tagc_checks.h"
#include "tagc_internal.h"

/* Byte j of the bitmap with the bits at positions >= n cleared. */
static unsigned bitmap_byte(const uint8_t *bitmap, int64_t j, int64_t n)
{
    unsigned b = bitmap[j];
    int64_t rem = n - 8 * j;
    if (rem < 8)
        b &= (1u << rem) - 1u;
    return b;
}

/* The 8 lanes of one bitmap byte as a little-endian word of `bits` bytes. */
static uint64_t spread(unsigned byte, int bits)
{
    uint64_t w = 0;
    for (int q = 0; q < 8; q++)
        if (byte & (1u << q))
            w |= (uint64_t)1 << (q * bits);
    return w;
}

tagc_status tagc_lanes_pack(uint8_t *lanes, int64_t lanes_capacity,
                            const uint8_t *bitmap, int64_t n, int bits)
{
    tagc_status st = tagc_check_lanes_pack(lanes, lanes_capacity, bitmap, n, bits);
    if (st != TAGC_OK)
        return st;
    int64_t out = tagc_lane_bytes(n, bits);
    if (bits == 8 || bits == 4 || bits == 2) {
        /* One bitmap byte becomes `bits` lane bytes; the table keeps the
         * loop free of per-bit work. */
        uint64_t table[256];
        for (unsigned b = 0; b < 256; b++)
            table[b] = spread(b, bits);
        int64_t nb = bitmap_bytes(n);
        for (int64_t j = 0; j < nb; j++) {
            uint64_t w = table[bitmap_byte(bitmap, j, n)];
            int64_t at = j * bits, len = out - at < bits ? out - at : bits;
            for (int64_t q = 0; q < len; q++)
                lanes[at + q] = (uint8_t)(w >> (8 * q));
        }
    } else {
        int64_t nb = bitmap_bytes(n);
        for (int64_t j = 0; j < nb; j++)
            lanes[j] = (uint8_t)bitmap_byte(bitmap, j, n);
    }
    return TAGC_OK;
}

/* Bit q set iff lane q (of `bits` bits) of w is non-zero, q < 8. */
static unsigned gather(uint64_t w, int bits)
{
    /* Fold every lane onto its lowest bit, then collect those bits. */
    for (int s = 1; s < bits; s <<= 1)
        w |= w >> s;
    unsigned byte = 0;
    for (int q = 0; q < 8; q++)
        byte |= (unsigned)((w >> (q * bits)) & 1u) << q;
    return byte;
}

tagc_status tagc_lanes_unpack(uint8_t *bitmap, int64_t bitmap_capacity,
                              const uint8_t *lanes, int64_t lanes_bytes,
                              int64_t n, int bits)
{
    tagc_status st = tagc_check_lanes_unpack(bitmap, bitmap_capacity, lanes,
                                             lanes_bytes, n, bits);
    if (st != TAGC_OK)
        return st;
    int64_t in = tagc_lane_bytes(n, bits), nb = bitmap_bytes(n);
    for (int64_t j = 0; j < nb; j++) {
        int64_t at = j * bits, len = in - at < bits ? in - at : bits;
        unsigned byte = gather(load_le(lanes + at, len), bits);
        int64_t rem = n - 8 * j;
        if (rem < 8)
            byte &= (1u << rem) - 1u;
        bitmap[j] = (uint8_t)byte;
    }
    return TAGC_OK;
}

tagc_status tagc_bitmap_or(uint8_t *dst, int64_t dst_capacity,
                           const uint8_t *src, int64_t nbytes, int64_t count)
{
    tagc_status st = tagc_check_bitmap_or(dst, dst_capacity, src, nbytes, count);
    if (st != TAGC_OK || nbytes == 0)
        return st;
    if (count == 0) {
        memset(dst, 0, (size_t)nbytes);
        return TAGC_OK;
    }
    /* dst may alias src's first row, so it is written only after row 0 is read. */
    for (int64_t j = 0; j < nbytes; j++) {
        uint8_t b = src[j];
        for (int64_t r = 1; r < count; r++)
            b |= src[r * nbytes + j];
        dst[j] = b;
    }
    return TAGC_OK;
}

tagc_status tagc_popcount(int64_t *count, const uint8_t *bitmap, int64_t n)
{
    tagc_status st = tagc_check_popcount(count, bitmap, n);
    if (st != TAGC_OK)
        return st;
    int64_t full = n >> 3, total = 0, j = 0;
    for (; j + 8 <= full; j += 8)
        total += __builtin_popcountll(load_le(bitmap + j, 8));
    for (; j < full; j++)
        total += __builtin_popcount(bitmap[j]);
    if (n & 7)
        total += __builtin_popcount(bitmap_byte(bitmap, full, n));
    *count = total;
    return TAGC_OK;
}
