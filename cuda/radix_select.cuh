/*
 * radix_select.cuh - the stream-ordered radix select shared by select.cu and
 * sparsify.cu.  The key of a value is its 31-bit magnitude pattern (order of
 * |v| for finite v); three digits of 11, 10 and 10 bits, high first.  Each
 * digit is one histogram pass over the entries whose higher digits match the
 * prefix found so far, then a one-block scan that picks the bin holding the
 * k-th largest and narrows k.  The device state carries prefix and k between
 * kernels, so nothing returns to the host.
 *
 * The second pass also appends the keys it histograms (those matching the
 * first digit: typically well under 1% of the entries for gradients) to a
 * candidate buffer; if they fit, the third pass reads only them instead of
 * the whole input, so the select reads its input twice, not three times.
 * For sparsify the second pass also counts, per tile of TAGC_TILE entries,
 * the entries whose first digit is above the chosen bin (certainly kept),
 * and keeps the candidates' positions, so that the per-tile kept/tie counts
 * the compaction needs come from the candidates alone, without another pass
 * over the input.
 */
#ifndef TAGC_RADIX_SELECT_CUH
#define TAGC_RADIX_SELECT_CUH

#include "tagc_cuda_common.cuh"

#define TAGC_SEL_BINS 2048
#define TAGC_NONFINITE_KEY 0x7f800000u
/* Key above every finite key: nothing compares >= to it (k == 0). */
#define TAGC_KEY_NONE 0xffffffffu

typedef struct {
    uint32_t prefix;    /* high digits found so far; the k-th key when done */
    uint32_t k_rem;     /* rank still to find among entries matching prefix;
                         * at the end: how many entries equal to the key to
                         * keep (ties, taken in position order) */
    uint32_t nonfinite; /* some entry is NaN/Inf */
    uint32_t done;      /* nonfinite or k == 0: later passes skip */
    uint32_t ncand;     /* keys appended by the second pass (may exceed cap) */
} tagc_sel_state;

enum { TAGC_SEL_FULL = 0, TAGC_SEL_WRITE_CAND = 1, TAGC_SEL_READ_CAND = 2 };

/* Candidate keys kept for the third pass: enough for any gradient-like
 * distribution; beyond it the third pass falls back to the full input. */
static inline int64_t tagc_sel_cand_cap(int64_t n)
{
    int64_t cap = n / 16;
    return cap < 4096 ? 4096 : cap;
}

/* Digit d (0, 1, 2) covers bits [shift, shift + width). */
static inline int tagc_sel_shift(int d)
{
    return d == 0 ? 20 : (d == 1 ? 10 : 0);
}

static inline int tagc_sel_width(int d)
{
    return d == 0 ? 11 : 10;
}

static __global__ void select_init_kernel(tagc_sel_state *st, uint32_t *hist,
                                          int64_t k)
{
    for (int i = threadIdx.x; i < TAGC_SEL_BINS; i += blockDim.x)
        hist[i] = 0;
    if (threadIdx.x == 0) {
        st->prefix = 0;
        st->k_rem = (uint32_t)k;
        st->nonfinite = 0;
        st->done = 0;
        st->ncand = 0;
    }
}

static __global__ void select_hist_kernel(tagc_gr src, int64_t n, int shift,
                                          int width, tagc_sel_state *st,
                                          uint32_t *hist, uint32_t *cand,
                                          int32_t *cand_pos, uint32_t cap,
                                          int cand_mode, uint32_t *tile_above)
{
    __shared__ uint32_t sh[TAGC_SEL_BINS];
    if (st->done)
        return; /* uniform: every thread of every block returns */
    int nbins = 1 << width, hi = shift + width;
    for (int i = threadIdx.x; i < nbins; i += blockDim.x)
        sh[i] = 0;
    __syncthreads();
    uint32_t want = hi >= 32 ? 0u : st->prefix >> hi;
    int first = hi >= 31;
    int bad = 0;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t mask = (uint32_t)(nbins - 1);
    if (cand_mode == TAGC_SEL_READ_CAND && st->ncand <= cap) {
        int64_t nc = st->ncand;
        for (int64_t i = i0; i < nc; i += stride) {
            uint32_t key = cand[i];
            if ((key >> hi) == want)
                atomicAdd(&sh[(key >> shift) & mask], 1u);
        }
    } else if (cand_mode == TAGC_SEL_WRITE_CAND && tile_above != NULL) {
        /* Tile order (blockDim == TAGC_THREADS): per-tile counts too. */
        int64_t ntiles = tagc_ceil_div(n, TAGC_TILE);
        for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            uint32_t above = 0;
            for (int c = 0; c < TAGC_TILE_CHUNKS; c++) {
                int64_t p = tile * TAGC_TILE + (int64_t)c * TAGC_THREADS + threadIdx.x;
                uint32_t key = p < n ? tagc_mag_key(tagc_gr_load(src, p)) : 0u;
                if (p < n && (key >> hi) == want) {
                    atomicAdd(&sh[(key >> shift) & mask], 1u);
                    uint32_t slot = atomicAdd(&st->ncand, 1u);
                    if (slot < cap) {
                        cand[slot] = key;
                        cand_pos[slot] = (int32_t)p;
                    }
                }
                above += (uint32_t)__syncthreads_count(p < n && (key >> hi) > want);
            }
            if (threadIdx.x == 0)
                tile_above[tile] = above;
        }
    } else {
        for (int64_t i = i0; i < n; i += stride) {
            uint32_t key = tagc_mag_key(tagc_gr_load(src, i));
            if (first)
                bad |= key >= TAGC_NONFINITE_KEY;
            if (first || (key >> hi) == want) {
                atomicAdd(&sh[(key >> shift) & mask], 1u);
                if (cand_mode == TAGC_SEL_WRITE_CAND) {
                    uint32_t slot = atomicAdd(&st->ncand, 1u);
                    if (slot < cap) {
                        cand[slot] = key;
                        cand_pos[slot] = (int32_t)i;
                    }
                }
            }
        }
    }
    if (first && __syncthreads_or(bad) && threadIdx.x == 0)
        st->nonfinite = 1;
    __syncthreads();
    for (int i = threadIdx.x; i < nbins; i += blockDim.x)
        if (sh[i] != 0)
            atomicAdd(&hist[i], sh[i]);
}

/* One block of 1024 threads, two bins each, bins walked from the top. */
static __global__ void select_scan_kernel(tagc_sel_state *st, uint32_t *hist,
                                          int shift, int width, int last,
                                          float *tau)
{
    __shared__ uint32_t sh[32];
    if (st->done)
        return;
    if (st->nonfinite || st->k_rem == 0) {
        /* Decided by the first pass; both end the select. */
        __syncthreads();
        if (threadIdx.x == 0) {
            if (st->nonfinite)
                *tau = __uint_as_float(0x7fc00000u);
            else
                *tau = __uint_as_float(0x7f800000u);
            st->prefix = TAGC_KEY_NONE;
            st->k_rem = 0;
            st->done = 1;
        }
        for (int i = threadIdx.x; i < TAGC_SEL_BINS; i += blockDim.x)
            hist[i] = 0;
        return;
    }
    int nbins = 1 << width;
    int q0 = 2 * threadIdx.x; /* q-th bin from the top */
    uint32_t c0 = q0 < nbins ? hist[nbins - 1 - q0] : 0u;
    uint32_t c1 = q0 + 1 < nbins ? hist[nbins - 2 - q0] : 0u;
    uint32_t total, incl = tagc_block_incl_scan(c0 + c1, sh, &total);
    uint32_t before = incl - c0 - c1, k = st->k_rem;
    __syncthreads(); /* every thread has read st->k_rem and its bins */
    int pick = -1;
    uint32_t above = 0;
    if (before < k && k <= before + c0) {
        pick = q0;
        above = before;
    } else if (before + c0 < k && k <= incl) {
        pick = q0 + 1;
        above = before + c0;
    }
    if (pick >= 0) {
        uint32_t bin = (uint32_t)(nbins - 1 - pick);
        uint32_t prefix = st->prefix | (bin << shift);
        st->prefix = prefix;
        st->k_rem = k - above;
        if (last) {
            *tau = __uint_as_float(prefix);
            st->done = 1;
        }
    }
    for (int i = threadIdx.x; i < nbins; i += blockDim.x)
        hist[i] = 0;
}

/* Workspace of the select: its state, one histogram, the candidates. */
typedef struct {
    tagc_sel_state *st;
    uint32_t *hist;
    uint32_t *cand;    /* keys */
    int32_t *cand_pos; /* their positions */
    uint32_t cap;
} tagc_sel_ws;

static inline void tagc_sel_carve(tagc_carver *c, int64_t n, tagc_sel_ws *w)
{
    w->cap = (uint32_t)tagc_sel_cand_cap(n);
    w->st = (tagc_sel_state *)tagc_carve(c, sizeof(tagc_sel_state));
    w->hist = (uint32_t *)tagc_carve(c, TAGC_SEL_BINS * sizeof(uint32_t));
    w->cand = (uint32_t *)tagc_carve(c, (size_t)w->cap * sizeof(uint32_t));
    w->cand_pos = (int32_t *)tagc_carve(c, (size_t)w->cap * sizeof(int32_t));
}

/* Enqueues the whole select of the k-th largest |v|; 0 <= k <= n.
 * tile_above (may be NULL): per tile, the entries above the first digit's bin. */
static inline tagc_status tagc_sel_enqueue(tagc_gr src, int64_t n, int64_t k,
                                           const tagc_sel_ws *w, float *tau,
                                           uint32_t *tile_above, cudaStream_t stream)
{
    tagc_sel_state *st = w->st;
    uint32_t *hist = w->hist;
    select_init_kernel<<<1, TAGC_THREADS, 0, stream>>>(st, hist, k);
    TAGC_CUDA_LAUNCHED();
    unsigned grid = tagc_grid(n, (int64_t)TAGC_THREADS * 8);
    for (int d = 0; d < 3; d++) {
        int shift = tagc_sel_shift(d), width = tagc_sel_width(d);
        int mode = d == 1 ? TAGC_SEL_WRITE_CAND
                          : (d == 2 ? TAGC_SEL_READ_CAND : TAGC_SEL_FULL);
        select_hist_kernel<<<grid, TAGC_THREADS, 0, stream>>>(
            src, n, shift, width, st, hist, w->cand, w->cand_pos, w->cap, mode,
            tile_above);
        TAGC_CUDA_LAUNCHED();
        select_scan_kernel<<<1, 1024, 0, stream>>>(st, hist, shift, width,
                                                   d == 2, tau);
        TAGC_CUDA_LAUNCHED();
    }
    return TAGC_OK;
}

#endif /* TAGC_RADIX_SELECT_CUH */
