/*
 * sparsify.cu - tagc_cuda_sparsify: fused error feedback + exact top-k +
 * bitmap + compaction.  Stream order: radix select of tau on v = g + r (read
 * on the fly, nothing written; its second pass also counts per tile the
 * entries certainly above tau and keeps the few candidates near it), per-tile
 * counts of |v| > tau and |v| == tau completed from the candidates (or, if
 * they overflowed their buffer, by a full counting pass), two tile scans,
 * then one write pass in which every tile knows how many entries before it
 * are kept, so idx/val come out ascending and exactly the first
 * (k - #{|v| > tau}) ties are kept.  The input is read three times in the
 * common case (two select passes, the write pass), four on overflow.
 */
#include "radix_select.cuh"
#include "../csrc/tagc_checks.h"

/* Completes the per-tile counts from the candidates (entries in tau's
 * first-digit bin); tile_gt already holds the entries above that bin. */
static __global__ void sparsify_cand_count_kernel(const tagc_sel_state *st,
                                                  const uint32_t *cand,
                                                  const int32_t *cand_pos,
                                                  uint32_t cap, uint32_t *tile_gt,
                                                  uint32_t *tile_eq)
{
    if (st->nonfinite || st->ncand > cap)
        return;
    uint32_t tau_key = st->prefix;
    int64_t nc = st->ncand, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < nc;
         j += stride) {
        int64_t tile = cand_pos[j] / TAGC_TILE;
        if (cand[j] > tau_key)
            atomicAdd(&tile_gt[tile], 1u);
        else if (cand[j] == tau_key)
            atomicAdd(&tile_eq[tile], 1u);
    }
}

/* Fallback when the candidates overflowed: count everything again. */
static __global__ void sparsify_count_kernel(tagc_gr src, int64_t n,
                                             const tagc_sel_state *st,
                                             uint32_t cap, uint32_t *tile_gt,
                                             uint32_t *tile_eq)
{
    if (st->nonfinite || st->ncand <= cap)
        return;
    uint32_t tau_key = st->prefix;
    int64_t ntiles = tagc_ceil_div(n, TAGC_TILE);
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int64_t base = tile * TAGC_TILE;
        uint32_t gt = 0, eq = 0;
        for (int c = 0; c < TAGC_TILE_CHUNKS; c++) {
            int64_t p = base + (int64_t)c * TAGC_THREADS + threadIdx.x;
            uint32_t key = p < n ? tagc_mag_key(tagc_gr_load(src, p)) : 0u;
            gt += (uint32_t)__syncthreads_count(p < n && key > tau_key);
            eq += (uint32_t)__syncthreads_count(p < n && key == tau_key);
        }
        if (threadIdx.x == 0) {
            tile_gt[tile] = gt;
            tile_eq[tile] = eq;
        }
    }
}

typedef struct {
    int32_t *idx;
    void *val;
    uint8_t *bitmap;
    void *res;
    int vd;
} sparsify_out;

static __global__ void sparsify_write_kernel(sparsify_out o, tagc_gr src,
                                             int64_t n, int64_t k,
                                             const tagc_sel_state *st,
                                             const uint32_t *gt_off,
                                             const uint32_t *eq_off)
{
    __shared__ uint32_t sh[32];
    int64_t ntiles = tagc_ceil_div(n, TAGC_TILE), nbytes = (n + 7) >> 3;
    if (st->nonfinite) {
        /* Defined, in-bounds output carrying NaN; the residual is kept. */
        for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            for (int c = 0; c < TAGC_TILE_CHUNKS; c++) {
                int64_t p = tile * TAGC_TILE + (int64_t)c * TAGC_THREADS +
                            threadIdx.x;
                int keep = p < k;
                uint32_t m = __ballot_sync(TAGC_FULL_MASK, keep);
                tagc_store_ballot(o.bitmap, (p - (threadIdx.x & 31u)) >> 3,
                                  nbytes, m);
                if (keep) {
                    o.idx[p] = (int32_t)p;
                    tagc_st(o.val, o.vd, p, __uint_as_float(0x7fc00000u));
                }
            }
        }
        return;
    }
    uint32_t tau_key = st->prefix, eq_keep = st->k_rem;
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int64_t base = tile * TAGC_TILE;
        uint32_t run_eq = eq_off[tile];
        uint32_t run_kept = gt_off[tile] + (run_eq < eq_keep ? run_eq : eq_keep);
        for (int c = 0; c < TAGC_TILE_CHUNKS; c++) {
            int64_t p = base + (int64_t)c * TAGC_THREADS + threadIdx.x;
            int inb = p < n;
            float v = inb ? tagc_gr_load(src, p) : 0.0f;
            uint32_t key = tagc_mag_key(v), tot, m;
            int eq = inb && key == tau_key;
            uint32_t eq_before = run_eq + tagc_block_flag_prefix(eq, sh, &tot, &m);
            run_eq += tot;
            int keep = (inb && key > tau_key) || (eq && eq_before < eq_keep);
            uint32_t kept_before = tagc_block_flag_prefix(keep, sh, &tot, &m);
            tagc_store_ballot(o.bitmap, (p - (threadIdx.x & 31u)) >> 3, nbytes, m);
            float q = 0.0f;
            if (keep) {
                int64_t j = (int64_t)run_kept + kept_before;
                q = tagc_round_to(o.vd, v);
                o.idx[j] = (int32_t)p;
                tagc_st(o.val, o.vd, j, q);
            }
            run_kept += tot;
            if (inb && src.rd != TAGC_DT_NONE)
                tagc_st(o.res, src.rd, p, v - q);
        }
    }
}

typedef struct {
    tagc_sel_ws sel;
    uint32_t *tile_gt, *tile_eq, *gt_off, *eq_off;
} sparsify_ws;

static size_t sparsify_layout(tagc_carver *c, int64_t n, sparsify_ws *w)
{
    size_t tiles = (size_t)tagc_ceil_div(n > 0 ? n : 1, TAGC_TILE);
    tagc_sel_carve(c, n, &w->sel);
    w->tile_gt = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->tile_eq = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->gt_off = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->eq_off = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    return tagc_carved_size(c);
}

extern "C" size_t tagc_cuda_sparsify_workspace_size(int64_t n)
{
    tagc_carver c = {NULL, 0};
    sparsify_ws w;
    return sparsify_layout(&c, n, &w);
}

extern "C" tagc_status tagc_cuda_sparsify(int32_t *idx, int64_t idx_capacity,
                                          void *val, tagc_dtype val_dtype,
                                          int64_t val_capacity,
                                          uint8_t *bitmap, int64_t bitmap_capacity,
                                          void *residual, tagc_dtype residual_dtype,
                                          const void *grad, tagc_dtype grad_dtype,
                                          int64_t n, int64_t k, float *tau,
                                          void *workspace, size_t workspace_bytes,
                                          cudaStream_t stream)
{
    tagc_status s = tagc_check_sparsify(idx, idx_capacity, val, (int)val_dtype,
                                        val_capacity, bitmap, bitmap_capacity, residual,
                                        (int)residual_dtype, grad, (int)grad_dtype, n, k,
                                        tau);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes, tagc_cuda_sparsify_workspace_size(n));
    if (s != TAGC_OK)
        return s;
    sparsify_ws w;
    sparsify_layout(&c, n, &w);

    tagc_gr src = {grad, residual, (int)grad_dtype,
                   residual != NULL ? (int)residual_dtype : TAGC_DT_NONE};
    int64_t ntiles = tagc_ceil_div(n > 0 ? n : 1, TAGC_TILE);
    /* Zero counts stand for "nothing kept" when the select stops early. */
    TAGC_CUDA_TRY(cudaMemsetAsync(w.tile_gt, 0, (size_t)ntiles * sizeof(uint32_t), stream));
    TAGC_CUDA_TRY(cudaMemsetAsync(w.tile_eq, 0, (size_t)ntiles * sizeof(uint32_t), stream));
    s = tagc_sel_enqueue(src, n, k, &w.sel, tau, w.tile_gt, stream);
    if (s != TAGC_OK)
        return s;
    if (n == 0)
        return TAGC_OK;
    unsigned grid = tagc_grid(ntiles, 1);
    sparsify_cand_count_kernel<<<tagc_grid(w.sel.cap, TAGC_THREADS), TAGC_THREADS, 0,
                                 stream>>>(w.sel.st, w.sel.cand, w.sel.cand_pos,
                                           w.sel.cap, w.tile_gt, w.tile_eq);
    TAGC_CUDA_LAUNCHED();
    sparsify_count_kernel<<<grid, TAGC_THREADS, 0, stream>>>(src, n, w.sel.st, w.sel.cap,
                                                             w.tile_gt, w.tile_eq);
    TAGC_CUDA_LAUNCHED();
    if ((s = tagc_tile_scan(w.gt_off, w.tile_gt, ntiles, NULL, stream)) != TAGC_OK ||
        (s = tagc_tile_scan(w.eq_off, w.tile_eq, ntiles, NULL, stream)) != TAGC_OK)
        return s;
    sparsify_out o = {idx, val, bitmap, residual, (int)val_dtype};
    sparsify_write_kernel<<<grid, TAGC_THREADS, 0, stream>>>(o, src, n, k, w.sel.st,
                                                             w.gt_off, w.eq_off);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
