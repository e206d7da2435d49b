/*
 * sparse.c - the `sparse` transport's wire format: k little-endian int32
 * offsets followed by k values, and the owner's scatter-add.
 */
#include "tagc_checks.h"
#include "tagc_internal.h"

tagc_status tagc_sparse_pack(uint8_t *buf, int64_t buf_capacity,
                             const int32_t *idx, const void *val,
                             tagc_dtype val_dtype, int64_t k)
{
    tagc_status s = tagc_check_sparse_pack(buf, buf_capacity, idx, val, val_dtype, k);
    if (s != TAGC_OK)
        return s;
    size_t es = tagc_dtype_size(val_dtype);
    if (k == 0)
        return TAGC_OK;
    /* The codec only targets little-endian hosts (x86-64, aarch64), whose
     * int32 layout is the wire layout. */
    memcpy(buf, idx, (size_t)k * 4);
    memcpy(buf + (size_t)k * 4, val, (size_t)k * es);
    return TAGC_OK;
}

tagc_status tagc_sparse_unpack(float *out, int64_t n,
                               const uint8_t *buf, int64_t buf_bytes,
                               int64_t k, tagc_dtype val_dtype)
{
    tagc_status s = tagc_check_sparse_unpack(out, n, buf, buf_bytes, k, val_dtype);
    if (s != TAGC_OK)
        return s;
    /* buf comes off the network and need not be aligned: read with memcpy. */
    for (int64_t j = 0; j < k; j++) {
        int32_t off;
        memcpy(&off, buf + 4 * j, 4);
        if (off < 0 || off >= n)
            return TAGC_ERR_CORRUPT;
    }
    const uint8_t *vals = buf + 4 * k;
    for (int64_t j = 0; j < k; j++) {
        int32_t off;
        memcpy(&off, buf + 4 * j, 4);
        float v;
        if (val_dtype == TAGC_F32) {
            memcpy(&v, vals + 4 * j, 4);
        } else {
            uint16_t b;
            memcpy(&b, vals + 2 * j, 2);
            v = tagc_bf16_to_f32(b);
        }
        out[off] += v;
    }
    return TAGC_OK;
}
