/* sizes.c - the buffer size rules of tagc.h, exported (the rules themselves are
 * tagc_checks.h's, which every op and CUDA launcher checks against). */
#include "tagc_checks.h"

int64_t tagc_bitmap_bytes(int64_t n)
{
    return tagc_check_bitmap_bytes(n);
}

int64_t tagc_lanes_bytes(int64_t n, int bits)
{
    return tagc_check_lanes_bytes(n, bits);
}

int64_t tagc_sketch_buckets(int64_t t)
{
    return tagc_check_sketch_buckets(t);
}

int64_t tagc_sparse_bytes(int64_t k, tagc_dtype value_dtype)
{
    return tagc_check_sparse_bytes(k, (int)value_dtype);
}

int64_t tagc_quant_bytes(int64_t n, tagc_qformat format, int64_t block)
{
    return tagc_check_quant_bytes(n, (int)format, block);
}

int tagc_ef_low_bits(int64_t n, int64_t k)
{
    return tagc_check_ef_low_bits(n, k);
}

int64_t tagc_pairs_bytes(int64_t n, int64_t k, tagc_dtype value_dtype, tagc_coding coding)
{
    return tagc_check_pairs_bytes(n, k, (int)value_dtype, (int)coding);
}

tagc_coding tagc_pairs_cheapest(int64_t n, int64_t k, tagc_dtype value_dtype)
{
    return (tagc_coding)tagc_check_pairs_cheapest(n, k, (int)value_dtype);
}

int64_t tagc_wq_bytes(const int64_t *seg, int64_t nseg, tagc_qformat format, int64_t block)
{
    int64_t total;
    return tagc_check_wq_table(seg, nseg, (int)format, block, &total);
}
