/*
 * sketch.c - count-sketch encode over the kept entries and the owner's peel
 * decode (DESIGN.md section 3).  Hash, bucket, sign and the peeling rule come
 * from tagc_portable.h so the CUDA kernels compute the same sketch.
 */
#include <stdlib.h>

#include "tagc_internal.h"

#define T_LIMIT ((int64_t)1 << 32)

tagc_status tagc_sketch_encode(void *sketch, tagc_dtype sketch_dtype,
                               int64_t sketch_capacity,
                               const int32_t *idx, const void *val,
                               tagc_dtype val_dtype, int64_t k,
                               int64_t n, int64_t t, uint64_t seed)
{
    if (sketch == NULL || ((idx == NULL || val == NULL) && k > 0))
        return TAGC_ERR_ARG;
    if (!dtype_valid(sketch_dtype) || !dtype_valid(val_dtype))
        return TAGC_ERR_DTYPE;
    if (t < 1 || t >= T_LIMIT || n < 0 || n > TAGC_MAX_N || k < 0)
        return TAGC_ERR_RANGE;
    int64_t m = TAGC_TABLES * t;
    if (sketch_capacity < m)
        return TAGC_ERR_CAPACITY;
    for (int64_t j = 0; j < k; j++)
        if (idx[j] < 0 || idx[j] >= n)
            return TAGC_ERR_RANGE;
    float *acc = sketch_dtype == TAGC_F32 ? (float *)sketch
                                          : malloc((size_t)m * sizeof *acc);
    if (acc == NULL)
        return TAGC_ERR_NOMEM;
    memset(acc, 0, (size_t)m * sizeof *acc);
    uint64_t ts[TAGC_TABLES];
    for (int i = 0; i < TAGC_TABLES; i++)
        ts[i] = tagc_table_seed(seed, i);
    for (int64_t j = 0; j < k; j++) {
        uint64_t p = (uint64_t)idx[j];
        float v = ld_val(val, val_dtype, j);
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h = tagc_hash(p, ts[i]);
            acc[tagc_bucket(h, i, t)] += tagc_sign(h) * v;
        }
    }
    if (sketch_dtype != TAGC_F32) {
        for (int64_t b = 0; b < m; b++)
            st_val(sketch, sketch_dtype, b, acc[b]);
        free(acc);
    }
    return TAGC_OK;
}

/* One bucket's state while peeling: kept together so that touching a bucket
 * costs one cache miss, not three. */
typedef struct {
    float sum;     /* sketch value minus what peeling has subtracted */
    uint32_t cnt;  /* unresolved union positions hashing here */
    uint32_t pxor; /* xor of those positions (the position when cnt == 1) */
} bucket_t;

/* Calls body(p) for every set bit p < n of bitmap, ascending. */
#define FOR_EACH_BIT(bitmap, n, p, body)                                    \
    do {                                                                    \
        int64_t nb_ = ((n) + 7) >> 3;                                       \
        for (int64_t j_ = 0; j_ < nb_; j_ += 8) {                           \
            int64_t len_ = nb_ - j_ < 8 ? nb_ - j_ : 8;                     \
            uint64_t w_ = load_le((bitmap) + j_, len_);                     \
            int64_t rem_ = (n) - 8 * j_;                                    \
            if (rem_ < 64)                                                  \
                w_ &= ((uint64_t)1 << rem_) - 1u;                           \
            while (w_) {                                                    \
                int64_t p = 8 * j_ + __builtin_ctzll(w_);                   \
                w_ &= w_ - 1;                                               \
                body;                                                       \
            }                                                               \
        }                                                                   \
    } while (0)

tagc_status tagc_peel_decode(float *out, int64_t out_capacity,
                             int32_t *unpeeled, int64_t unpeeled_capacity,
                             int64_t *unpeeled_count,
                             const void *sketch, tagc_dtype sketch_dtype,
                             const uint8_t *bitmap, int64_t n,
                             int64_t t, uint64_t seed, int estimate)
{
    if (unpeeled_count == NULL || sketch == NULL ||
        ((out == NULL || bitmap == NULL) && n > 0) ||
        (unpeeled == NULL && unpeeled_capacity > 0))
        return TAGC_ERR_ARG;
    if (!dtype_valid(sketch_dtype))
        return TAGC_ERR_DTYPE;
    if (t < 1 || t >= T_LIMIT || n < 0 || n > TAGC_MAX_N || unpeeled_capacity < 0)
        return TAGC_ERR_RANGE;
    if (out_capacity < n)
        return TAGC_ERR_CAPACITY;

    int64_t m = TAGC_TABLES * t, nb = bitmap_bytes(n);
    bucket_t *bk = malloc((size_t)m * sizeof *bk);
    int64_t *queue = malloc((size_t)m * sizeof *queue);
    uint8_t *left = malloc((size_t)(nb > 0 ? nb : 1));
    if (bk == NULL || queue == NULL || left == NULL) {
        free(bk);
        free(queue);
        free(left);
        return TAGC_ERR_NOMEM;
    }
    uint64_t ts[TAGC_TABLES];
    for (int i = 0; i < TAGC_TABLES; i++)
        ts[i] = tagc_table_seed(seed, i);
    for (int64_t b = 0; b < m; b++) {
        bk[b].sum = ld_val(sketch, sketch_dtype, b);
        bk[b].cnt = 0;
        bk[b].pxor = 0;
    }
    if (nb > 0) {
        memcpy(left, bitmap, (size_t)nb);
        if (n & 7)
            left[nb - 1] &= (uint8_t)((1u << (n & 7)) - 1u);
        memset(out, 0, (size_t)n * sizeof *out);
    }
    /* Counts and xors come from the union bitmap itself, so they are
     * consistent whatever it holds: a count-1 bucket always names a position
     * < n that is still unresolved. */
    FOR_EACH_BIT(left, n, p, {
        for (int i = 0; i < TAGC_TABLES; i++) {
            int64_t b = tagc_bucket(tagc_hash((uint64_t)p, ts[i]), i, t);
            bk[b].cnt++;
            bk[b].pxor ^= (uint32_t)p;
        }
    });
    /* A count only falls, so each bucket enters the queue at most once. */
    int64_t qn = 0, qh = 0;
    for (int64_t b = 0; b < m; b++)
        if (bk[b].cnt == 1)
            queue[qn++] = b;
    while (qh < qn) {
        int64_t b = queue[qh++];
        if (bk[b].cnt != 1)
            continue;
        int64_t p = bk[b].pxor;
        int table = (int)(b / t);
        float v = tagc_peel_value(bk[b].sum, tagc_hash((uint64_t)p, ts[table]));
        out[p] = v;
        left[p >> 3] &= (uint8_t)~(1u << (p & 7));
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h = tagc_hash((uint64_t)p, ts[i]);
            int64_t c = tagc_bucket(h, i, t);
            bk[c].sum -= tagc_sign(h) * v;
            bk[c].pxor ^= (uint32_t)p;
            if (--bk[c].cnt == 1)
                queue[qn++] = c;
        }
    }
    int64_t nleft = 0;
    FOR_EACH_BIT(left, n, p, {
        if (nleft < unpeeled_capacity)
            unpeeled[nleft] = (int32_t)p;
        nleft++;
        if (estimate) {
            float e[TAGC_TABLES];
            for (int i = 0; i < TAGC_TABLES; i++) {
                uint64_t h = tagc_hash((uint64_t)p, ts[i]);
                e[i] = tagc_peel_value(bk[tagc_bucket(h, i, t)].sum, h);
            }
            out[p] = tagc_median3(e[0], e[1], e[2]);
        }
    });
    *unpeeled_count = nleft;
    free(bk);
    free(queue);
    free(left);
    return TAGC_OK;
}
