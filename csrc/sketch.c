/*
 * sketch.c - count-sketch encode over the kept entries and the owner's peel
 * decode (docs/DESIGN.md section 3).  Hash, bucket, sign and the peeling rule come
 * from tagc_portable.h so the CUDA kernels compute the same sketch.
 */
#include <stdlib.h>

#include "tagc_checks.h"
#include "tagc_internal.h"

tagc_status tagc_sketch_encode(void *sketch, tagc_dtype sketch_dtype,
                               int64_t sketch_capacity,
                               const int32_t *idx, const void *val,
                               tagc_dtype val_dtype, int64_t k,
                               int64_t n, int64_t t, uint64_t seed)
{
    tagc_status st = tagc_check_sketch_encode(sketch, (int)sketch_dtype, sketch_capacity,
                                              idx, val, (int)val_dtype, k, n, t);
    if (st != TAGC_OK)
        return st;
    int64_t m = TAGC_TABLES * t;
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
        /* hashing is cheap next to a cache miss on a large sketch: hash an
         * entry a few ahead twice, once to prefetch its buckets */
        if (j + 8 < k)
            for (int i = 0; i < TAGC_TABLES; i++)
                __builtin_prefetch(&acc[tagc_bucket(tagc_hash((uint64_t)idx[j + 8], ts[i]), i, t)],
                                   1);
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
    uint32_t cnt;  /* unresolved union entries hashing here */
    uint32_t rxor; /* xor of their ranks (the rank itself when cnt == 1) */
} bucket_t;

/* One union position, by rank (its index among the union's positions in
 * ascending order): its buckets within each table and their sign bits, hashed
 * once.  Peeling works on ranks so that everything it touches is a few
 * compact arrays (cache-resident for realistic unions) instead of the n-long
 * output, which is written once, in position order, at the end. */
typedef struct {
    uint32_t off[TAGC_TABLES]; /* bucket within its table, < t */
    uint32_t neg;              /* bit i set: sign of table i is -1 */
} entry_t;

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

TAGC_AI float entry_sign(const entry_t *e, int i)
{
    return (e->neg >> i) & 1u ? -1.0f : 1.0f;
}

/* The decoder's scratch: a slot per bucket (m = 3t) and per union rank (u). */
typedef struct {
    bucket_t *bk;   /* m */
    int64_t *queue; /* m + 1: the branch-free push always stores one slot past the end */
    int32_t *pos;   /* u: the position of each rank */
    entry_t *ent;   /* u */
    float *vals;    /* u: the peeled value of each rank */
    uint8_t *done;  /* u: 1 once a rank is peeled */
} peel_ws;

/* All the scratch or TAGC_ERR_NOMEM; peel_free() releases it either way. */
static tagc_status peel_alloc(peel_ws *w, int64_t m, int64_t u)
{
    size_t ua = (size_t)(u > 0 ? u : 1);
    w->bk = malloc((size_t)m * sizeof *w->bk);
    w->queue = malloc((size_t)(m + 1) * sizeof *w->queue);
    w->pos = malloc(ua * sizeof *w->pos);
    w->ent = malloc(ua * sizeof *w->ent);
    w->vals = malloc(ua * sizeof *w->vals);
    w->done = calloc(ua, 1);
    if (w->bk == NULL || w->queue == NULL || w->pos == NULL || w->ent == NULL ||
        w->vals == NULL || w->done == NULL)
        return TAGC_ERR_NOMEM;
    return TAGC_OK;
}

static void peel_free(peel_ws *w)
{
    free(w->bk);
    free(w->queue);
    free(w->pos);
    free(w->ent);
    free(w->vals);
    free(w->done);
}

/* pos[r] and ent[r] of every union rank r: each position hashed once. */
static void peel_hash_union(peel_ws *w, const uint8_t *bitmap, int64_t n, int64_t t,
                            uint64_t seed)
{
    uint64_t ts[TAGC_TABLES];
    for (int i = 0; i < TAGC_TABLES; i++)
        ts[i] = tagc_table_seed(seed, i);
    entry_t *ent = w->ent;
    int32_t *pos = w->pos;
    int64_t r = 0;
    FOR_EACH_BIT(bitmap, n, p, {
        entry_t *e = &ent[r];
        e->neg = 0;
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h = tagc_hash((uint64_t)p, ts[i]);
            e->off[i] = (uint32_t)(tagc_bucket(h, i, t) - i * t);
            e->neg |= (uint32_t)(h & 1u) << i;
        }
        pos[r++] = (int32_t)p;
    });
}

/* Every bucket's starting state: the sketch's sum, and the count and rank
 * xor of the union entries hashing there.  Counts and xors come from the
 * union bitmap itself, so they are consistent whatever it holds: a count-1
 * bucket always names a rank < u that is still unresolved. */
static void peel_fill_buckets(peel_ws *w, const void *sketch, tagc_dtype sketch_dtype,
                              int64_t t, int64_t u)
{
    bucket_t *bk = w->bk;
    const entry_t *ent = w->ent;
    for (int64_t b = 0; b < TAGC_TABLES * t; b++) {
        bk[b].sum = ld_val(sketch, sketch_dtype, b);
        bk[b].cnt = 0;
        bk[b].rxor = 0;
    }
    /* Separate from hashing so the random bucket updates can be prefetched
     * a few entries ahead. */
    for (int64_t j = 0; j < u; j++) {
        if (j + 16 < u)
            for (int i = 0; i < TAGC_TABLES; i++)
                __builtin_prefetch(&bk[i * t + ent[j + 16].off[i]], 1);
        for (int i = 0; i < TAGC_TABLES; i++) {
            bucket_t *c = &bk[i * t + ent[j].off[i]];
            c->cnt++;
            c->rxor ^= (uint32_t)j;
        }
    }
}

/* The peeling loop is bound by cache misses on bk and ent (random by design
 * of the hash).  A three-stage software pipeline overlaps them: the bucket
 * of a queue entry far ahead, then its entry, then that entry's other
 * buckets.  Early reads may be stale (counts still change); a stale
 * prefetch only costs a wasted hint, and every index stays in bounds. */
TAGC_AI void peel_prefetch(const peel_ws *w, int64_t qh, int64_t qn, int64_t t, int64_t u)
{
    const bucket_t *bk = w->bk;
    const int64_t *queue = w->queue;
    const entry_t *ent = w->ent;
    if (qh + 24 < qn)
        __builtin_prefetch(&bk[queue[qh + 24]]);
    if (qh + 12 < qn) {
        uint32_t r2 = bk[queue[qh + 12]].rxor;
        if (r2 < (uint64_t)u)
            __builtin_prefetch(&ent[r2]);
    }
    if (qh + 4 < qn) {
        uint32_t r3 = bk[queue[qh + 4]].rxor;
        if (r3 < (uint64_t)u)
            for (int i = 0; i < TAGC_TABLES; i++)
                __builtin_prefetch(&bk[i * t + ent[r3].off[i]], 1);
    }
}

/* Peels to completion: a count-1 bucket names its one unresolved rank,
 * whose value is taken out of its other buckets, which may drop to count 1
 * in turn.  vals[r] and done[r] of every rank peeled. */
static void peel_run(peel_ws *w, int64_t t, int64_t u)
{
    /* Locals, not w->: a store through done (uint8_t) may alias anything,
     * and would make the compiler reload w's fields in the loop. */
    bucket_t *bk = w->bk;
    int64_t *queue = w->queue;
    const entry_t *ent = w->ent;
    float *vals = w->vals;
    uint8_t *done = w->done;
    /* A count only falls, so each bucket enters the queue at most once. */
    int64_t qn = 0, qh = 0;
    for (int64_t b = 0; b < TAGC_TABLES * t; b++)
        if (bk[b].cnt == 1)
            queue[qn++] = b;
    while (qh < qn) {
        peel_prefetch(w, qh, qn, t, u);
        int64_t b = queue[qh++];
        if (bk[b].cnt != 1)
            continue;
        uint32_t rk = bk[b].rxor;
        const entry_t *e = &ent[rk];
        int table = (int)(b / t);
        float v = entry_sign(e, table) * bk[b].sum; /* tagc_peel_value's rule */
        vals[rk] = v;
        done[rk] = 1;
        for (int i = 0; i < TAGC_TABLES; i++) {
            int64_t c = i * t + e->off[i];
            bk[c].sum -= entry_sign(e, i) * v;
            bk[c].rxor ^= rk;
            /* branch-free push: a mispredicted branch here would serialise
             * the cache misses the out-of-order core otherwise overlaps */
            queue[qn] = c;
            qn += --bk[c].cnt == 1;
        }
    }
}

/* One streaming pass over out: zeros between union positions, the peeled
 * values, and for each rank left the median estimate of its three buckets
 * (or 0), its position listed in unpeeled while capacity lasts.  Returns
 * how many were left. */
static int64_t peel_write(float *out, int32_t *unpeeled, int64_t unpeeled_capacity,
                          const peel_ws *w, int64_t n, int64_t t, int64_t u, int estimate)
{
    int64_t nleft = 0, next = 0;
    for (int64_t j = 0; j < u; j++) {
        int64_t p = w->pos[j];
        if (p > next)
            memset(out + next, 0, (size_t)(p - next) * sizeof *out);
        next = p + 1;
        if (w->done[j]) {
            out[p] = w->vals[j];
            continue;
        }
        if (nleft < unpeeled_capacity)
            unpeeled[nleft] = (int32_t)p;
        nleft++;
        out[p] = 0.0f;
        if (estimate) {
            const entry_t *e = &w->ent[j];
            float est[TAGC_TABLES];
            for (int i = 0; i < TAGC_TABLES; i++)
                est[i] = entry_sign(e, i) * w->bk[i * t + e->off[i]].sum;
            out[p] = tagc_median3(est[0], est[1], est[2]);
        }
    }
    if (n > next)
        memset(out + next, 0, (size_t)(n - next) * sizeof *out);
    return nleft;
}

tagc_status tagc_peel_decode(float *out, int64_t out_capacity,
                             int32_t *unpeeled, int64_t unpeeled_capacity,
                             int64_t *unpeeled_count,
                             const void *sketch, tagc_dtype sketch_dtype,
                             const uint8_t *bitmap, int64_t n,
                             int64_t t, uint64_t seed, int estimate)
{
    /* No round bound here: this decoder peels to completion (1 always passes). */
    tagc_status st = tagc_check_peel_decode(out, out_capacity, unpeeled,
                                            unpeeled_capacity, unpeeled_count, sketch,
                                            (int)sketch_dtype, bitmap, n, t, 1);
    if (st != TAGC_OK)
        return st;
    int64_t u = 0;
    FOR_EACH_BIT(bitmap, n, p, { (void)p; u++; });
    peel_ws w;
    st = peel_alloc(&w, TAGC_TABLES * t, u);
    if (st == TAGC_OK) {
        peel_hash_union(&w, bitmap, n, t, seed);
        peel_fill_buckets(&w, sketch, sketch_dtype, t, u);
        peel_run(&w, t, u);
        *unpeeled_count = peel_write(out, unpeeled, unpeeled_capacity, &w, n, t, u, estimate);
    }
    peel_free(&w);
    return st;
}
