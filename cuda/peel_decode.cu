/*
 * peel_decode.cu - tagc_cuda_peel_decode: owner-side decode of a summed
 * sketch in rounds, and the median estimate of what peeling leaves.
 *
 * Stream order (no host round-trip anywhere):
 *   1. compact the union bitmap into pos[0..u) ascending (tile counts, tile
 *      scan, tile writes); u stays on the device;
 *   2. buckets: B = sketch in fp32, cnt = number of union positions hashing
 *      there (atomics);
 *   3. max_rounds x (detect, apply).  detect: every unresolved position with
 *      a count-1 bucket reads its value from that bucket (the bucket holds
 *      only it).  apply: those positions leave their three buckets.  Two
 *      kernels per round because a position must not read a bucket while
 *      another position of the same round is still subtracting from it.
 *      progress[r] is set by detect r; a kernel of a later round exits at
 *      once when the round before it made no progress;
 *   4. estimate_kernel: positions still unresolved get the median of their
 *      three signed buckets (or 0) and are listed ascending (second
 *      compaction over pos order).
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

typedef struct {
    uint64_t s[TAGC_TABLES];
} peel_seeds;

typedef struct {
    uint32_t u;     /* union positions */
    uint32_t nleft; /* unresolved after the last round */
} peel_state;

enum { PEEL_OPEN = 0, PEEL_DONE = 1, PEEL_NOW = 2 };

typedef struct {
    peel_state *st;
    uint32_t *progress;  /* max_rounds flags */
    uint32_t *tile_cnt, *tile_off;
    int32_t *pos;        /* n */
    float *pval;         /* n: value found by detect */
    uint8_t *status;     /* n: PEEL_* */
    float *bsum;         /* 3t */
    uint32_t *bcnt;      /* 3t */
} peel_ws;

static __device__ __forceinline__ int64_t peel_bucket(int64_t p, int i,
                                                      const peel_seeds *ts,
                                                      int64_t t, uint64_t *h)
{
    *h = tagc_hash((uint64_t)p, ts->s[i]);
    return tagc_bucket(*h, i, t);
}

static __global__ void peel_count_kernel(uint32_t *tile_cnt, const uint8_t *bitmap,
                                         int64_t n)
{
    int64_t ntiles = tagc_ceil_div(n, TAGC_TILE);
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        uint32_t c = 0;
        for (int k = 0; k < TAGC_TILE_CHUNKS; k++) {
            int64_t p = tile * TAGC_TILE + (int64_t)k * TAGC_THREADS + threadIdx.x;
            c += (uint32_t)__syncthreads_count(p < n && tagc_bit_get(bitmap, p));
        }
        if (threadIdx.x == 0)
            tile_cnt[tile] = c;
    }
}

static __global__ void peel_list_kernel(int32_t *pos, uint8_t *status,
                                        const uint8_t *bitmap, int64_t n,
                                        const uint32_t *tile_off)
{
    __shared__ uint32_t sh[32];
    int64_t ntiles = tagc_ceil_div(n, TAGC_TILE);
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        uint32_t run = tile_off[tile];
        for (int k = 0; k < TAGC_TILE_CHUNKS; k++) {
            int64_t p = tile * TAGC_TILE + (int64_t)k * TAGC_THREADS + threadIdx.x;
            int set = p < n && tagc_bit_get(bitmap, p);
            uint32_t tot, m, before = tagc_block_flag_prefix(set, sh, &tot, &m);
            if (set) {
                pos[run + before] = (int32_t)p;
                status[run + before] = PEEL_OPEN;
            }
            run += tot;
        }
    }
}

static __global__ void peel_init_kernel(float *bsum, uint32_t *bcnt,
                                        const void *sketch, int sd, int64_t m)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < m;
         b += stride) {
        bsum[b] = tagc_ld(sketch, sd, b);
        bcnt[b] = 0;
    }
}

static __global__ void peel_hash_kernel(uint32_t *bcnt, const int32_t *pos,
                                        const peel_state *st, peel_seeds ts,
                                        int64_t t)
{
    int64_t u = st->u, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < u;
         j += stride) {
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h;
            atomicAdd(&bcnt[peel_bucket(pos[j], i, &ts, t, &h)], 1u);
        }
    }
}

static __global__ void peel_detect_kernel(peel_ws w, peel_seeds ts, int64_t t,
                                          int round)
{
    if (round > 0 && w.progress[round - 1] == 0)
        return;
    int64_t u = w.st->u, stride = (int64_t)gridDim.x * blockDim.x;
    int found = 0;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < u;
         j += stride) {
        if (w.status[j] != PEEL_OPEN)
            continue;
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h;
            int64_t b = peel_bucket(w.pos[j], i, &ts, t, &h);
            if (w.bcnt[b] == 1) {
                w.pval[j] = tagc_peel_value(w.bsum[b], h);
                w.status[j] = PEEL_NOW;
                found = 1;
                break;
            }
        }
    }
    if (__syncthreads_or(found) && threadIdx.x == 0)
        w.progress[round] = 1;
}

static __global__ void peel_apply_kernel(float *out, peel_ws w, peel_seeds ts,
                                         int64_t t, int round)
{
    if (w.progress[round] == 0)
        return;
    int64_t u = w.st->u, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < u;
         j += stride) {
        if (w.status[j] != PEEL_NOW)
            continue;
        int64_t p = w.pos[j];
        float v = w.pval[j];
        out[p] = v;
        w.status[j] = PEEL_DONE;
        for (int i = 0; i < TAGC_TABLES; i++) {
            uint64_t h;
            int64_t b = peel_bucket(p, i, &ts, t, &h);
            atomicAdd(&w.bsum[b], -tagc_sign(h) * v);
            atomicSub(&w.bcnt[b], 1u);
        }
    }
}

static __global__ void peel_left_count_kernel(uint32_t *tile_cnt, peel_ws w,
                                              int64_t ntiles)
{
    int64_t u = w.st->u;
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        uint32_t c = 0;
        for (int k = 0; k < TAGC_TILE_CHUNKS; k++) {
            int64_t j = tile * TAGC_TILE + (int64_t)k * TAGC_THREADS + threadIdx.x;
            c += (uint32_t)__syncthreads_count(j < u && w.status[j] == PEEL_OPEN);
        }
        if (threadIdx.x == 0)
            tile_cnt[tile] = c;
    }
}

/* The paper's fallback for what peeling left: median of the three signed
 * buckets, which have had every peeled value subtracted. */
static __global__ void estimate_kernel(float *out, int32_t *unpeeled,
                                       int64_t unpeeled_capacity,
                                       int64_t *unpeeled_count, peel_ws w,
                                       peel_seeds ts, int64_t t, int estimate,
                                       int64_t ntiles)
{
    __shared__ uint32_t sh[32];
    int64_t u = w.st->u;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *unpeeled_count = (int64_t)w.st->nleft;
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        uint32_t run = w.tile_off[tile];
        for (int k = 0; k < TAGC_TILE_CHUNKS; k++) {
            int64_t j = tile * TAGC_TILE + (int64_t)k * TAGC_THREADS + threadIdx.x;
            int left = j < u && w.status[j] == PEEL_OPEN;
            uint32_t tot, m, before = tagc_block_flag_prefix(left, sh, &tot, &m);
            if (left) {
                int64_t p = w.pos[j], slot = (int64_t)run + before;
                if (slot < unpeeled_capacity)
                    unpeeled[slot] = (int32_t)p;
                if (estimate) {
                    float e[TAGC_TABLES];
                    for (int i = 0; i < TAGC_TABLES; i++) {
                        uint64_t h;
                        int64_t b = peel_bucket(p, i, &ts, t, &h);
                        e[i] = tagc_peel_value(w.bsum[b], h);
                    }
                    out[p] = tagc_median3(e[0], e[1], e[2]);
                }
            }
            run += tot;
        }
    }
}

static size_t peel_layout(tagc_carver *c, int64_t n, int64_t t, int max_rounds,
                          peel_ws *w)
{
    size_t nn = (size_t)(n > 0 ? n : 1), m = (size_t)(TAGC_TABLES * t);
    size_t tiles = (size_t)tagc_ceil_div((int64_t)nn, TAGC_TILE);
    w->st = (peel_state *)tagc_carve(c, sizeof(peel_state));
    w->progress = (uint32_t *)tagc_carve(c, (size_t)max_rounds * sizeof(uint32_t));
    w->tile_cnt = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->tile_off = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->pos = (int32_t *)tagc_carve(c, nn * sizeof(int32_t));
    w->pval = (float *)tagc_carve(c, nn * sizeof(float));
    w->status = (uint8_t *)tagc_carve(c, nn);
    w->bsum = (float *)tagc_carve(c, m * sizeof(float));
    w->bcnt = (uint32_t *)tagc_carve(c, m * sizeof(uint32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_peel_decode_workspace_size(int64_t n, int64_t t,
                                                       int max_rounds)
{
    tagc_carver c = {NULL, 0};
    peel_ws w;
    return peel_layout(&c, n > 0 ? n : 0, t > 0 ? t : 0,
                       max_rounds > 0 ? max_rounds : 1, &w);
}

extern "C" tagc_status tagc_cuda_peel_decode(float *out, int64_t out_capacity,
                                             int32_t *unpeeled,
                                             int64_t unpeeled_capacity,
                                             int64_t *unpeeled_count,
                                             const void *sketch,
                                             tagc_dtype sketch_dtype,
                                             const uint8_t *bitmap, int64_t n,
                                             int64_t t, uint64_t seed,
                                             int estimate, int max_rounds,
                                             void *workspace,
                                             size_t workspace_bytes,
                                             cudaStream_t stream)
{
    tagc_status s = tagc_check_peel_decode(out, out_capacity, unpeeled,
                                           unpeeled_capacity, unpeeled_count, sketch,
                                           (int)sketch_dtype, bitmap, n, t, max_rounds);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes,
                                 tagc_cuda_peel_decode_workspace_size(n, t,
                                                                      max_rounds));
    if (s != TAGC_OK)
        return s;
    peel_ws w;
    peel_layout(&c, n, t, max_rounds, &w);

    int64_t m = TAGC_TABLES * t, ntiles = tagc_ceil_div(n > 0 ? n : 1, TAGC_TILE);
    peel_seeds ts;
    for (int i = 0; i < TAGC_TABLES; i++)
        ts.s[i] = tagc_table_seed(seed, i);
    TAGC_CUDA_TRY(cudaMemsetAsync(w.st, 0, sizeof(peel_state), stream));
    TAGC_CUDA_TRY(cudaMemsetAsync(w.progress, 0,
                                  (size_t)max_rounds * sizeof(uint32_t), stream));
    TAGC_CUDA_TRY(cudaMemsetAsync(w.tile_cnt, 0, (size_t)ntiles * sizeof(uint32_t),
                                  stream));
    if (n > 0)
        TAGC_CUDA_TRY(cudaMemsetAsync(out, 0, (size_t)n * sizeof(float), stream));
    unsigned tgrid = tagc_grid(ntiles, 1);
    if (n > 0) {
        peel_count_kernel<<<tgrid, TAGC_THREADS, 0, stream>>>(w.tile_cnt, bitmap, n);
        TAGC_CUDA_LAUNCHED();
    }
    if ((s = tagc_tile_scan(w.tile_off, w.tile_cnt, ntiles, &w.st->u, stream)) !=
        TAGC_OK)
        return s;
    if (n > 0) {
        peel_list_kernel<<<tgrid, TAGC_THREADS, 0, stream>>>(w.pos, w.status,
                                                             bitmap, n, w.tile_off);
        TAGC_CUDA_LAUNCHED();
    }
    peel_init_kernel<<<tagc_grid(m, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        w.bsum, w.bcnt, sketch, (int)sketch_dtype, m);
    TAGC_CUDA_LAUNCHED();
    /* u is only known on the device: size the position loops for n. */
    unsigned pgrid = tagc_grid(n, TAGC_THREADS * 4);
    peel_hash_kernel<<<pgrid, TAGC_THREADS, 0, stream>>>(w.bcnt, w.pos, w.st, ts, t);
    TAGC_CUDA_LAUNCHED();
    for (int r = 0; r < max_rounds; r++) {
        peel_detect_kernel<<<pgrid, TAGC_THREADS, 0, stream>>>(w, ts, t, r);
        TAGC_CUDA_LAUNCHED();
        peel_apply_kernel<<<pgrid, TAGC_THREADS, 0, stream>>>(out, w, ts, t, r);
        TAGC_CUDA_LAUNCHED();
    }
    peel_left_count_kernel<<<tgrid, TAGC_THREADS, 0, stream>>>(w.tile_cnt, w, ntiles);
    TAGC_CUDA_LAUNCHED();
    if ((s = tagc_tile_scan(w.tile_off, w.tile_cnt, ntiles, &w.st->nleft, stream)) !=
        TAGC_OK)
        return s;
    estimate_kernel<<<tgrid, TAGC_THREADS, 0, stream>>>(
        out, unpeeled, unpeeled_capacity, unpeeled_count, w, ts, t, estimate, ntiles);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
