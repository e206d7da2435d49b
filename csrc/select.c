/*
 * select.c - exact k-th largest magnitude (tagc_select_kth) and the fused
 * error-feedback sparsifier (tagc_sparsify).
 *
 * For finite floats the order of |x| is the order of the 31-bit pattern
 * bits(x) & 0x7fffffff read as an unsigned integer, so selection is a radix
 * select on that pattern: a histogram of its high 16 bits (fits in L2) finds
 * the bin holding the k-th largest, and a second histogram of the low 16 bits
 * of the (usually few) entries of that bin finds its exact pattern.  Both are
 * O(n) with no data-dependent recursion, and ties are exact because equal
 * magnitudes have equal patterns.
 */
#include <math.h>
#include <stdlib.h>

#include "tagc_internal.h"

/* Patterns of NaN/Inf are >= 0x7f800000; their high half is < 0x8000 too, so
 * a histogram of 0x8000 bins is safe to fill before finiteness is known. */
#define HI_BINS 0x8000
#define LO_BINS 0x10000
#define NONFINITE_BITS 0x7f800000u

TAGC_AI float load_v(const void *g, int gd, const void *r, int rd, int64_t i)
{
    float v = ld_val(g, gd, i);
    if (rd != DT_NONE)
        v += ld_val(r, rd, i);
    return v;
}

TAGC_AI uint32_t mag_bits(float v)
{
    return f2u(v) & 0x7fffffffu;
}

/* Pass 1: histogram of the high half of |v|; returns non-zero if any v is
 * NaN/Inf.  Two interleaved histograms halve the store-to-load stalls when
 * neighbouring entries fall in the same bin. */
TAGC_AI int hist_hi(uint32_t *h0, uint32_t *h1, const void *g, int gd,
                    const void *r, int rd, int64_t n)
{
    uint32_t worst = 0;
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        uint32_t a = mag_bits(load_v(g, gd, r, rd, i));
        uint32_t b = mag_bits(load_v(g, gd, r, rd, i + 1));
        worst = a > worst ? a : worst;
        worst = b > worst ? b : worst;
        h0[a >> 16]++;
        h1[b >> 16]++;
    }
    for (; i < n; i++) {
        uint32_t a = mag_bits(load_v(g, gd, r, rd, i));
        worst = a > worst ? a : worst;
        h0[a >> 16]++;
    }
    return worst >= NONFINITE_BITS;
}

static int hist_hi_dispatch(uint32_t *h0, uint32_t *h1, const void *g, int gd,
                            const void *r, int rd, int64_t n)
{
#define HH(G, R) if (gd == (G) && rd == (R)) return hist_hi(h0, h1, g, G, r, R, n)
    HH(TAGC_F32, DT_NONE); HH(TAGC_F32, TAGC_F32); HH(TAGC_F32, TAGC_BF16);
    HH(TAGC_BF16, DT_NONE); HH(TAGC_BF16, TAGC_F32); HH(TAGC_BF16, TAGC_BF16);
#undef HH
    return -1;
}

/* Walk bins from the top until the running count reaches `need`; returns the
 * bin and the number of entries in bins strictly above it. */
static int64_t find_bin(const uint32_t *h, int64_t bins, int64_t need,
                        int64_t *above)
{
    int64_t cum = 0;
    for (int64_t b = bins - 1; b >= 0; b--) {
        if (cum + h[b] >= need) {
            *above = cum;
            return b;
        }
        cum += h[b];
    }
    *above = cum;
    return 0; /* unreachable when need <= total */
}

tagc_status tagc_select_kth(float *tau, const void *x, tagc_dtype x_dtype,
                            int64_t n, int64_t k)
{
    if (tau == NULL || (x == NULL && n > 0))
        return TAGC_ERR_ARG;
    if (!dtype_valid(x_dtype))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > n)
        return TAGC_ERR_RANGE;
    uint32_t *h = calloc(2 * HI_BINS + LO_BINS, sizeof *h);
    if (h == NULL)
        return TAGC_ERR_NOMEM;
    uint32_t *h1 = h + HI_BINS, *lo = h + 2 * HI_BINS;
    tagc_status st = TAGC_OK;
    if (hist_hi_dispatch(h, h1, x, x_dtype, NULL, DT_NONE, n)) {
        st = TAGC_ERR_NONFINITE;
        goto done;
    }
    if (k == 0) {
        *tau = INFINITY;
        goto done;
    }
    for (int64_t b = 0; b < HI_BINS; b++)
        h[b] += h1[b];
    int64_t above, above_lo;
    uint32_t bin = (uint32_t)find_bin(h, HI_BINS, k, &above);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = mag_bits(ld_val(x, x_dtype, i));
        if ((u >> 16) == bin)
            lo[u & 0xffffu]++;
    }
    uint32_t low = (uint32_t)find_bin(lo, LO_BINS, k - above, &above_lo);
    *tau = u2f((bin << 16) | low);
done:
    free(h);
    return st;
}

/* Pass 2 of sparsify: decide every entry outside the threshold bin, write its
 * residual, bitmap bit, and (kept) idx/val; remember the entries of the bin
 * as candidates, leaving their residual untouched so v can be recomputed.
 * Returns the number of definite keeps written to idx/val. */
TAGC_AI int64_t write_pass(int32_t *idx, void *val, int vd, uint8_t *bitmap,
                           void *res, int rd, const void *g, int gd,
                           int64_t n, uint32_t bin, int32_t *cand)
{
    int64_t w = 0, c = 0;
    for (int64_t base = 0; base < n; base += 8) {
        int64_t end = base + 8 < n ? base + 8 : n;
        unsigned byte = 0;
        for (int64_t p = base; p < end; p++) {
            float v = load_v(g, gd, res, rd, p);
            uint32_t hb = mag_bits(v) >> 16;
            if (hb < bin) {
                if (rd != DT_NONE)
                    st_val(res, rd, p, v);
            } else if (hb > bin) {
                float q = round_to(vd, v);
                idx[w] = (int32_t)p;
                st_val(val, vd, w, q);
                w++;
                if (rd != DT_NONE)
                    st_val(res, rd, p, v - q);
                byte |= 1u << (p - base);
            } else {
                cand[c++] = (int32_t)p;
            }
        }
        bitmap[base >> 3] = (uint8_t)byte;
    }
    return w;
}

static int64_t write_dispatch(int32_t *idx, void *val, int vd, uint8_t *bitmap,
                              void *res, int rd, const void *g, int gd,
                              int64_t n, uint32_t bin, int32_t *cand)
{
#define WP(V, R, G) \
    if (vd == (V) && rd == (R) && gd == (G)) \
        return write_pass(idx, val, V, bitmap, res, R, g, G, n, bin, cand)
    WP(TAGC_F32, DT_NONE, TAGC_F32); WP(TAGC_F32, TAGC_F32, TAGC_F32);
    WP(TAGC_F32, TAGC_BF16, TAGC_F32); WP(TAGC_F32, DT_NONE, TAGC_BF16);
    WP(TAGC_F32, TAGC_F32, TAGC_BF16); WP(TAGC_F32, TAGC_BF16, TAGC_BF16);
    WP(TAGC_BF16, DT_NONE, TAGC_F32); WP(TAGC_BF16, TAGC_F32, TAGC_F32);
    WP(TAGC_BF16, TAGC_BF16, TAGC_F32); WP(TAGC_BF16, DT_NONE, TAGC_BF16);
    WP(TAGC_BF16, TAGC_F32, TAGC_BF16); WP(TAGC_BF16, TAGC_BF16, TAGC_BF16);
#undef WP
    return -1;
}

static void copy_elem(void *dst, int64_t di, const void *src, int64_t si,
                      size_t es)
{
    memcpy((uint8_t *)dst + di * es, (const uint8_t *)src + si * es, es);
}

tagc_status tagc_sparsify(int32_t *idx, int64_t idx_capacity,
                          void *val, tagc_dtype val_dtype, int64_t val_capacity,
                          uint8_t *bitmap, int64_t bitmap_capacity,
                          void *residual, tagc_dtype residual_dtype,
                          const void *grad, tagc_dtype grad_dtype,
                          int64_t n, int64_t k, float *tau)
{
    if (tau == NULL || (grad == NULL && n > 0) || (bitmap == NULL && n > 0) ||
        ((idx == NULL || val == NULL) && k > 0))
        return TAGC_ERR_ARG;
    if (!dtype_valid(val_dtype) || !dtype_valid(grad_dtype) ||
        (residual != NULL && !dtype_valid(residual_dtype)))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > n)
        return TAGC_ERR_RANGE;
    if (idx_capacity < k || val_capacity < k || bitmap_capacity < bitmap_bytes(n))
        return TAGC_ERR_CAPACITY;

    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    uint32_t *h = calloc(2 * HI_BINS + LO_BINS, sizeof *h);
    if (h == NULL)
        return TAGC_ERR_NOMEM;
    uint32_t *h1 = h + HI_BINS, *lo = h + 2 * HI_BINS;
    int32_t *cand = NULL;
    float *cval = NULL;
    tagc_status st = TAGC_OK;

    if (hist_hi_dispatch(h, h1, grad, grad_dtype, residual, rd, n)) {
        st = TAGC_ERR_NONFINITE; /* nothing written yet */
        goto done;
    }
    /* k == 0: a bin above every finite pattern keeps nothing and has no
     * candidates. */
    uint32_t bin = HI_BINS;
    int64_t above = 0, ncand = 0;
    if (k > 0) {
        for (int64_t b = 0; b < HI_BINS; b++)
            h[b] += h1[b];
        bin = (uint32_t)find_bin(h, HI_BINS, k, &above);
        ncand = h[bin];
    }
    cand = malloc((size_t)(ncand > 0 ? ncand : 1) * sizeof *cand);
    cval = malloc((size_t)(ncand > 0 ? ncand : 1) * sizeof *cval);
    if (cand == NULL || cval == NULL) {
        st = TAGC_ERR_NOMEM;
        goto done;
    }
    int64_t w = write_dispatch(idx, val, val_dtype, bitmap, residual, rd, grad,
                               grad_dtype, n, bin, cand);
    if (k == 0) {
        *tau = INFINITY;
        goto done;
    }

    /* Resolve the threshold bin: exact low half of the k-th pattern, then
     * keep its ties in position order (candidates are ascending). */
    int64_t need = k - above, above_lo;
    for (int64_t j = 0; j < ncand; j++) {
        float v = load_v(grad, grad_dtype, residual, rd, cand[j]);
        lo[mag_bits(v) & 0xffffu]++;
    }
    uint32_t low = (uint32_t)find_bin(lo, LO_BINS, need, &above_lo);
    int64_t eq_left = need - above_lo, nkeep = 0;
    for (int64_t j = 0; j < ncand; j++) {
        int32_t p = cand[j];
        float v = load_v(grad, grad_dtype, residual, rd, p);
        uint32_t l = mag_bits(v) & 0xffffu;
        int keep = l > low || (l == low && eq_left-- > 0);
        float q = keep ? round_to(val_dtype, v) : 0.0f;
        if (residual != NULL)
            st_val(residual, rd, p, v - q);
        if (keep) {
            bitmap[p >> 3] |= (uint8_t)(1u << (p & 7));
            cand[nkeep] = p; /* nkeep <= j: compaction in place */
            cval[nkeep] = q;
            nkeep++;
        }
    }
    /* Merge the definite keeps idx[0..w) with the bin's keeps, from the back
     * so idx/val can be merged in place. */
    size_t es = tagc_dtype_size(val_dtype);
    int64_t a = w - 1, b = nkeep - 1;
    for (int64_t o = k - 1; o >= 0; o--) {
        if (b < 0 || (a >= 0 && idx[a] > cand[b])) {
            idx[o] = idx[a];
            copy_elem(val, o, val, a, es);
            a--;
        } else {
            idx[o] = cand[b];
            st_val(val, val_dtype, o, cval[b]);
            b--;
        }
    }
    *tau = u2f((bin << 16) | low);
done:
    free(h);
    free(cand);
    free(cval);
    return st;
}
