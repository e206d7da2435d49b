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

#include "tagc_checks.h"
#include "tagc_internal.h"

/* Patterns of NaN/Inf are >= 0x7f800000; their high half is < 0x8000 too, so
 * a histogram of 0x8000 bins is safe to fill before finiteness is known. */
#define HI_BINS 0x8000
#define LO_BINS 0x10000
#define NONFINITE_BITS 0x7f800000u

TAGC_AI uint32_t mag_bits(float v)
{
    return f2u(v) & 0x7fffffffu;
}

/* Pass 1: histogram of the high half of |v|; returns non-zero if any v is
 * NaN/Inf.  Four interleaved histograms (merged by the caller) cut the
 * store-to-load stalls when neighbouring entries fall in the same bin, which
 * gradients (many magnitudes of one scale) do constantly. */
TAGC_AI int hist_hi(uint32_t *h, const void *g, int gd, const void *r, int rd, int64_t n)
{
    uint32_t worst = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32_t a = mag_bits(load_v(g, gd, r, rd, i));
        uint32_t b = mag_bits(load_v(g, gd, r, rd, i + 1));
        uint32_t c = mag_bits(load_v(g, gd, r, rd, i + 2));
        uint32_t d = mag_bits(load_v(g, gd, r, rd, i + 3));
        uint32_t ab = a > b ? a : b, cd = c > d ? c : d, m = ab > cd ? ab : cd;
        worst = m > worst ? m : worst;
        h[a >> 16]++;
        h[HI_BINS + (b >> 16)]++;
        h[2 * HI_BINS + (c >> 16)]++;
        h[3 * HI_BINS + (d >> 16)]++;
    }
    for (; i < n; i++) {
        uint32_t a = mag_bits(load_v(g, gd, r, rd, i));
        worst = a > worst ? a : worst;
        h[a >> 16]++;
    }
    for (int64_t b = 0; b < HI_BINS; b++)
        h[b] += h[HI_BINS + b] + h[2 * HI_BINS + b] + h[3 * HI_BINS + b];
    return worst >= NONFINITE_BITS;
}

static int hist_hi_dispatch(uint32_t *h, const void *g, int gd, const void *r, int rd,
                            int64_t n)
{
#define HH(G, R) if (gd == (G) && rd == (R)) return hist_hi(h, g, G, r, R, n)
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

/* Histogram of the low half of the |x| patterns whose high half is `bin`. */
TAGC_AI void hist_lo(uint32_t *lo, const void *x, int xd, int64_t n, uint32_t bin)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = mag_bits(ld_val(x, xd, i));
        if ((u >> 16) == bin)
            lo[u & 0xffffu]++;
    }
}

tagc_status tagc_select_kth(float *tau, const void *x, tagc_dtype x_dtype,
                            int64_t n, int64_t k)
{
    tagc_status st = tagc_check_select_kth(tau, x, (int)x_dtype, n, k);
    if (st != TAGC_OK)
        return st;
    uint32_t *h = calloc(4 * HI_BINS + LO_BINS, sizeof *h);
    if (h == NULL)
        return TAGC_ERR_NOMEM;
    uint32_t *lo = h + 4 * HI_BINS;
    if (hist_hi_dispatch(h, x, x_dtype, NULL, DT_NONE, n)) {
        st = TAGC_ERR_NONFINITE;
        goto done;
    }
    if (k == 0) {
        *tau = INFINITY;
        goto done;
    }
    int64_t above, above_lo;
    uint32_t bin = (uint32_t)find_bin(h, HI_BINS, k, &above);
    if (x_dtype == TAGC_F32)
        hist_lo(lo, x, TAGC_F32, n, bin);
    else
        hist_lo(lo, x, TAGC_BF16, n, bin);
    uint32_t low = (uint32_t)find_bin(lo, LO_BINS, k - above, &above_lo);
    *tau = u2f((bin << 16) | low);
done:
    free(h);
    return st;
}

/* One entry outside the bulk path of write_pass: kept (above the bin) or a
 * candidate of the bin (its v saved, its residual written later). */
TAGC_AI void write_rare(int64_t p, float v, uint32_t hi, int32_t *idx, void *val, int vd,
                        void *res, int rd, int64_t *w, int32_t *cand, float *cval,
                        int64_t *c, unsigned *byte, int bit)
{
    if (mag_bits(v) > hi) {
        float q = round_to(vd, v);
        idx[*w] = (int32_t)p;
        st_val(val, vd, *w, q);
        (*w)++;
        if (rd != DT_NONE)
            st_val(res, rd, p, v - q);
        *byte |= 1u << bit;
    } else {
        cand[*c] = (int32_t)p;
        cval[*c] = v;
        (*c)++;
    }
}

/* Pass 2 of sparsify, given patterns lo <= hi that bracket the k-th largest
 * (lo <= 0x7fffffff): every entry's residual becomes v, and the few entries
 * with pattern >= lo (about 1.25% at theta 0.9875) take the rare path: kept
 * above hi, remembered as candidates (position and v) in [lo, hi].  Blocks
 * of 16 are first scanned with a branch-free, vectorisable loop; most hold
 * no rare entry and cost just that loop.  Returns the number of definite
 * keeps. */
#define WBLOCK 16
TAGC_AI int64_t write_pass(int32_t *idx, void *val, int vd, uint8_t *bitmap,
                           void *res, int rd, const void *g, int gd,
                           int64_t n, uint32_t lo, uint32_t hi, int32_t *cand, float *cval)
{
    int64_t w = 0, c = 0, base = 0;
    int32_t slo = (int32_t)lo; /* patterns are < 2^31: signed compares vectorise on SSE2 */
    for (; base + WBLOCK <= n; base += WBLOCK) {
        float v[WBLOCK];
        int32_t any = 0;
        for (int j = 0; j < WBLOCK; j++) {
            v[j] = load_v(g, gd, res, rd, base + j);
            any |= (int32_t)mag_bits(v[j]) >= slo;
        }
        if (rd != DT_NONE)
            for (int j = 0; j < WBLOCK; j++)
                st_val(res, rd, base + j, v[j]);
        unsigned byte0 = 0, byte1 = 0;
        if (any) {
            for (int j = 0; j < WBLOCK; j++)
                if ((int32_t)mag_bits(v[j]) >= slo)
                    write_rare(base + j, v[j], hi, idx, val, vd, res, rd, &w, cand, cval, &c,
                               j < 8 ? &byte0 : &byte1, j & 7);
        }
        bitmap[base >> 3] = (uint8_t)byte0;
        bitmap[(base >> 3) + 1] = (uint8_t)byte1;
    }
    for (; base < n; base += 8) {
        unsigned byte = 0;
        int64_t end = base + 8 < n ? base + 8 : n;
        for (int64_t p = base; p < end; p++) {
            float v = load_v(g, gd, res, rd, p);
            if (rd != DT_NONE)
                st_val(res, rd, p, v);
            if (mag_bits(v) >= lo)
                write_rare(p, v, hi, idx, val, vd, res, rd, &w, cand, cval, &c, &byte,
                           (int)(p - base));
        }
        bitmap[base >> 3] = (uint8_t)byte;
    }
    return w;
}

static int64_t write_dispatch(int32_t *idx, void *val, int vd, uint8_t *bitmap,
                              void *res, int rd, const void *g, int gd,
                              int64_t n, uint32_t lo, uint32_t hi, int32_t *cand,
                              float *cval)
{
#define WP(V, R, G) \
    if (vd == (V) && rd == (R) && gd == (G)) \
        return write_pass(idx, val, V, bitmap, res, R, g, G, n, lo, hi, cand, cval)
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
    tagc_status st = tagc_check_sparsify(idx, idx_capacity, val, (int)val_dtype,
                                         val_capacity, bitmap, bitmap_capacity,
                                         residual, (int)residual_dtype, grad,
                                         (int)grad_dtype, n, k, tau);
    if (st != TAGC_OK)
        return st;

    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    uint32_t *h = calloc(4 * HI_BINS + LO_BINS, sizeof *h);
    if (h == NULL)
        return TAGC_ERR_NOMEM;
    int32_t *cand = NULL;
    float *cval = NULL;

    if (hist_hi_dispatch(h, grad, grad_dtype, residual, rd, n)) {
        st = TAGC_ERR_NONFINITE; /* nothing written yet */
        goto done;
    }
    /* [lo, hi]: the |v| patterns of the bin holding the k-th largest; above
     * hi is kept, below lo dropped.  k == 0: lo above every finite pattern. */
    uint32_t lo = 0x7fffffffu, hi = 0x7fffffffu;
    int64_t above = 0, ncand = 0;
    if (k > 0) {
        uint32_t bin = (uint32_t)find_bin(h, HI_BINS, k, &above);
        ncand = h[bin];
        lo = bin << 16;
        hi = lo | 0xffffu;
    }
    memset(h, 0, (HI_BINS + LO_BINS) * sizeof *h);
    cand = malloc((size_t)(ncand > 0 ? ncand : 1) * sizeof *cand);
    cval = malloc((size_t)(ncand > 0 ? ncand : 1) * sizeof *cval);
    if (cand == NULL || cval == NULL) {
        st = TAGC_ERR_NOMEM;
        goto done;
    }
    int64_t w = write_dispatch(idx, val, val_dtype, bitmap, residual, rd, grad,
                               grad_dtype, n, lo, hi, cand, cval);
    if (k == 0) {
        *tau = INFINITY;
        goto done;
    }

    /* Resolve the bracket exactly: the need-th largest candidate pattern by
     * a histogram of its high half then of its low half, then keep its ties
     * in position order (candidates are ascending). */
    int64_t need = k - above, above_hi, above_lo;
    uint32_t *lh = h + HI_BINS;
    for (int64_t j = 0; j < ncand; j++)
        h[mag_bits(cval[j]) >> 16]++;
    uint32_t bin = (uint32_t)find_bin(h, HI_BINS, need, &above_hi);
    for (int64_t j = 0; j < ncand; j++) {
        uint32_t u = mag_bits(cval[j]);
        if ((u >> 16) == bin)
            lh[u & 0xffffu]++;
    }
    uint32_t low = (uint32_t)find_bin(lh, LO_BINS, need - above_hi, &above_lo);
    uint32_t kth = (bin << 16) | low;
    int64_t eq_left = need - above_hi - above_lo, nkeep = 0;
    for (int64_t j = 0; j < ncand; j++) {
        int32_t p = cand[j];
        float v = cval[j];
        uint32_t u = mag_bits(v);
        int keep = u > kth || (u == kth && eq_left-- > 0);
        if (keep) {
            float q = round_to(val_dtype, v);
            if (residual != NULL) /* the write pass left v there */
                st_val(residual, rd, p, v - q);
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
    *tau = u2f(kth);
done:
    free(h);
    free(cand);
    free(cval);
    return st;
}
