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
 *
 * tagc_sparsify on large shards skips that histogram (a scattered increment
 * per entry, the slowest part): a sample guesses a narrow bracket of
 * patterns, one branch-free counting pass checks it and saves the v inside
 * it, the k-th is resolved from those, and one more pass writes everything.
 */
#include <math.h>
#include <stdlib.h>

#include "tagc_checks.h"
#include "tagc_internal.h"

/* The two passes over the shard are compute-bound with SSE2: both get an
 * AVX2 clone (TAGC_HOT_CLONES). */
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

/* Shards of at least this size find the bracket of the k-th largest from a
 * sample (below it the histogram's fixed cost is small and a sample would
 * be most of the shard). */
#define SAMPLE_MIN_N (1 << 15)
#define SAMPLE_M 16384
/* Entries per block of the branch-free loops (one uint64_t of flags). */
#define WBLOCK 64

/* The pattern of the r-th largest |x| (1 <= r <= m): radix select on the
 * 31-bit pattern, 11 + 10 + 10 bits, with a histogram small enough for L1. */
static uint32_t kth_mag(const float *x, int64_t m, int64_t r)
{
    static const int shift[3] = {20, 10, 0};
    uint32_t h[2048], prefix = 0, fixed = 0;
    for (int lv = 0; lv < 3; lv++) {
        uint32_t bins = lv == 0 ? 2048u : 1024u;
        memset(h, 0, bins * sizeof *h);
        for (int64_t i = 0; i < m; i++) {
            uint32_t u = mag_bits(x[i]);
            if ((u & fixed) == prefix)
                h[(u >> shift[lv]) & (bins - 1)]++;
        }
        int64_t above;
        uint32_t b = (uint32_t)find_bin(h, bins, r, &above);
        r -= above;
        prefix |= b << shift[lv];
        fixed |= (bins - 1) << shift[lv];
    }
    return prefix;
}

/* SAMPLE_M values of v, one per stride of the shard at a hashed offset in
 * it, so that a period in the data (rows, heads) cannot alias the stride. */
TAGC_AI void sample_v(float *s, const void *g, int gd, const void *r, int rd, int64_t n)
{
    int64_t step = n / SAMPLE_M;
    for (int64_t i = 0; i < SAMPLE_M; i++) {
        uint64_t h = ((uint32_t)i * 2654435761u) >> 8; /* 24 bits */
        s[i] = load_v(g, gd, r, rd, i * step + (int64_t)((h * (uint64_t)step) >> 24));
    }
}

static void sample_dispatch(float *s, const void *g, int gd, const void *r, int rd, int64_t n)
{
#define SV(G, R) if (gd == (G) && rd == (R)) { sample_v(s, g, G, r, R, n); return; }
    SV(TAGC_F32, DT_NONE); SV(TAGC_F32, TAGC_F32); SV(TAGC_F32, TAGC_BF16);
    SV(TAGC_BF16, DT_NONE); SV(TAGC_BF16, TAGC_F32); SV(TAGC_BF16, TAGC_BF16);
#undef SV
}

/* A bracket [lo, hi] from the sample: its order statistics some 4 standard
 * deviations (binomial, k/n of SAMPLE_M) either side of where the k-th
 * largest should fall.  Only a guess, which the caller checks by counting;
 * returns about how many entries of the shard it should hold. */
static int64_t sample_bracket(uint32_t *lo, uint32_t *hi, const float *s, int64_t n, int64_t k)
{
    double p = (double)k / (double)n, mean = p * SAMPLE_M;
    double margin = 4.0 * sqrt(mean * (1.0 - p)) + 8.0;
    double rh = floor(mean - margin), rl = ceil(mean + margin);
    *hi = rh >= 1.0 ? kth_mag(s, SAMPLE_M, (int64_t)rh) : 0x7fffffffu;
    *lo = rl <= SAMPLE_M ? kth_mag(s, SAMPLE_M, (int64_t)rl) : 0u;
    return (int64_t)((rl - rh + 1.0) * (double)(n / SAMPLE_M + 1));
}

/* The bracket from the whole shard (k >= 1): the bin of the high-half
 * histogram that holds the k-th largest; *band: the entries in it. */
static tagc_status hist_bracket(uint32_t *lo, uint32_t *hi, int64_t *band, const void *g,
                                int gd, const void *r, int rd, int64_t n, int64_t k)
{
    uint32_t *h = calloc(4 * HI_BINS, sizeof *h);
    if (h == NULL)
        return TAGC_ERR_NOMEM;
    tagc_status st = TAGC_OK;
    if (hist_hi_dispatch(h, g, gd, r, rd, n)) {
        st = TAGC_ERR_NONFINITE;
    } else {
        int64_t above;
        uint32_t bin = (uint32_t)find_bin(h, HI_BINS, k, &above);
        *band = h[bin];
        *lo = bin << 16;
        *hi = *lo | 0xffffu;
    }
    free(h);
    return st;
}

/* Eight 0/1 flag bytes to the bits of one byte, flag j to bit j: the
 * multiplier puts a copy of byte j's bit at bit 56 + j, and no two of its
 * partial products share a bit, so nothing carries. */
TAGC_AI uint64_t pack8(const uint8_t *f)
{
    return (load_le(f, 8) * 0x0102040810204080ull) >> 56;
}

TAGC_AI uint64_t pack64(const uint8_t *f)
{
    uint64_t m = 0;
    for (int b = 0; b < WBLOCK / 8; b++)
        m |= pack8(f + 8 * b) << (8 * b);
    return m;
}

/* Pass 1: *gt = #(pattern > hi), *band = #(lo <= pattern <= hi), and the v
 * of the band saved to cval while it fits in cap; returns non-zero if any v
 * is NaN/Inf.  Blocks of 64 go through a branch-free loop that vectorises
 * (patterns are < 2^31: signed compares, which SSE2 has) and the band, a
 * few percent of the shard, is picked from its packed flags bit by bit. */
TAGC_AI int scan_pass(int64_t *gt, int64_t *band, float *cval, int64_t cap,
                      const void *g, int gd, const void *r, int rd, int64_t n,
                      uint32_t lo, uint32_t hi)
{
    /* u >= lo as u > lo - 1 (lo - 1 >= -1), u <= hi as !(u > hi): the one
     * compare serves the count too.  u >= 0x7f800000 (NaN/Inf) iff
     * u + 0x00800000 has its sign bit: an add and an OR per entry. */
    int32_t slo1 = (int32_t)lo - 1, shi = (int32_t)hi;
    int64_t cgt = 0, c = 0, base = 0;
    int32_t bad = 0;
    for (; base + WBLOCK <= n; base += WBLOCK) {
        uint8_t bf[WBLOCK];
        int32_t a = 0;
        for (int j = 0; j < WBLOCK; j++) {
            uint32_t uu = mag_bits(load_v(g, gd, r, rd, base + j));
            int32_t u = (int32_t)uu, above = u > shi;
            a += above;
            bad |= (int32_t)(uu + 0x00800000u);
            bf[j] = (uint8_t)((u > slo1) & !above);
        }
        cgt += a;
        for (uint64_t bm = pack64(bf); bm != 0; bm &= bm - 1, c++)
            if (c < cap) /* v again: cheaper than keeping all 64 for a few */
                cval[c] = load_v(g, gd, r, rd, base + __builtin_ctzll(bm));
    }
    for (; base < n; base++) {
        float v = load_v(g, gd, r, rd, base);
        uint32_t u = mag_bits(v);
        bad |= (int32_t)(u + 0x00800000u);
        cgt += u > hi;
        if (u >= lo && u <= hi) {
            if (c < cap)
                cval[c] = v;
            c++;
        }
    }
    *gt = cgt;
    *band = c;
    return bad < 0;
}

TAGC_HOT_CLONES static int scan_dispatch(int64_t *gt, int64_t *band, float *cval, int64_t cap,
                         const void *g, int gd, const void *r, int rd, int64_t n,
                         uint32_t lo, uint32_t hi)
{
#define SP(G, R) \
    if (gd == (G) && rd == (R)) return scan_pass(gt, band, cval, cap, g, G, r, R, n, lo, hi)
    SP(TAGC_F32, DT_NONE); SP(TAGC_F32, TAGC_F32); SP(TAGC_F32, TAGC_BF16);
    SP(TAGC_BF16, DT_NONE); SP(TAGC_BF16, TAGC_F32); SP(TAGC_BF16, TAGC_BF16);
#undef SP
    return -1;
}

/* Pass 2, given the exact k-th pattern: keeps every pattern > kth and the
 * first eq_left entries equal to it, writing idx, val, bitmap and residual
 * in one go.  Blocks of 64: a branch-free loop that vectorises (v, flags,
 * residual), then the keeps are walked bit by bit from the packed flags; at
 * theta 0.9 most blocks hold a keep, so a per-entry branch would mispredict
 * constantly, while the walk costs at most one mispredict per block. */
TAGC_AI void write_pass(int32_t *idx, void *val, int vd, uint8_t *bitmap, void *res, int rd,
                        const void *g, int gd, int64_t n, uint32_t kth, int64_t eq_left)
{
    int32_t sk = (int32_t)kth;
    int64_t w = 0, base = 0;
    for (; base + WBLOCK <= n; base += WBLOCK) {
        float v[WBLOCK];
        uint8_t kf[WBLOCK], ef[WBLOCK];
        for (int j = 0; j < WBLOCK; j++) {
            v[j] = load_v(g, gd, res, rd, base + j);
            int32_t u = (int32_t)mag_bits(v[j]);
            kf[j] = u > sk;
        }
        uint64_t km = pack64(kf);
        if (eq_left > 0) { /* ties of the k-th: the lowest positions win */
            for (int j = 0; j < WBLOCK; j++)
                ef[j] = mag_bits(v[j]) == kth;
            for (uint64_t em = pack64(ef); em != 0 && eq_left > 0; em &= em - 1, eq_left--) {
                int j = __builtin_ctzll(em);
                kf[j] = 1;
                km |= 1ull << j;
            }
        }
        if (rd != DT_NONE)
            for (int j = 0; j < WBLOCK; j++)
                st_val(res, rd, base + j, kf[j] ? v[j] - round_to(vd, v[j]) : v[j]);
        for (int b = 0; b < WBLOCK / 8; b++)
            bitmap[(base >> 3) + b] = (uint8_t)(km >> (8 * b));
        for (; km != 0; km &= km - 1) {
            int j = __builtin_ctzll(km);
            idx[w] = (int32_t)(base + j);
            st_val(val, vd, w, round_to(vd, v[j]));
            w++;
        }
    }
    for (; base < n; base += 8) {
        unsigned byte = 0;
        int64_t end = base + 8 < n ? base + 8 : n;
        for (int64_t p = base; p < end; p++) {
            float v = load_v(g, gd, res, rd, p);
            uint32_t u = mag_bits(v);
            int keep = u > kth || (u == kth && eq_left > 0);
            eq_left -= u == kth && keep;
            float q = keep ? round_to(vd, v) : 0.0f;
            if (rd != DT_NONE)
                st_val(res, rd, p, keep ? v - q : v);
            if (keep) {
                idx[w] = (int32_t)p;
                st_val(val, vd, w, q);
                w++;
            }
            byte |= (unsigned)keep << (p - base);
        }
        bitmap[base >> 3] = (uint8_t)byte;
    }
}

TAGC_HOT_CLONES static void write_dispatch(int32_t *idx, void *val, int vd, uint8_t *bitmap, void *res, int rd,
                           const void *g, int gd, int64_t n, uint32_t kth, int64_t eq_left)
{
#define WP(V, R, G) \
    if (vd == (V) && rd == (R) && gd == (G)) { \
        write_pass(idx, val, V, bitmap, res, R, g, G, n, kth, eq_left); \
        return; \
    }
    WP(TAGC_F32, DT_NONE, TAGC_F32); WP(TAGC_F32, TAGC_F32, TAGC_F32);
    WP(TAGC_F32, TAGC_BF16, TAGC_F32); WP(TAGC_F32, DT_NONE, TAGC_BF16);
    WP(TAGC_F32, TAGC_F32, TAGC_BF16); WP(TAGC_F32, TAGC_BF16, TAGC_BF16);
    WP(TAGC_BF16, DT_NONE, TAGC_F32); WP(TAGC_BF16, TAGC_F32, TAGC_F32);
    WP(TAGC_BF16, TAGC_BF16, TAGC_F32); WP(TAGC_BF16, DT_NONE, TAGC_BF16);
    WP(TAGC_BF16, TAGC_F32, TAGC_BF16); WP(TAGC_BF16, TAGC_BF16, TAGC_BF16);
#undef WP
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

    /* Find a bracket [lo, hi] of patterns holding the k-th largest |v| and
     * the band of v inside it, resolve the k-th exactly from the band, then
     * write everything in one pass.  Nothing is written before the second
     * pass, so NaN/Inf (seen by the first) leaves the outputs alone. */
    int rd = residual != NULL ? (int)residual_dtype : DT_NONE;
    uint32_t lo = 0x7fffffffu, hi = 0x7fffffffu; /* k == 0: an empty band */
    int64_t gt = 0, band = 0, cap = 0;
    float *cval = NULL;
    int valid = 0;
    if (k == 0 || n >= SAMPLE_MIN_N) {
        if (k > 0) {
            float *s = malloc(SAMPLE_M * sizeof *s);
            if (s == NULL)
                return TAGC_ERR_NOMEM;
            sample_dispatch(s, grad, grad_dtype, residual, rd, n);
            cap = sample_bracket(&lo, &hi, s, n, k);
            free(s);
            cap = 2 * cap < n ? 2 * cap : n; /* twice the guess: rarely short */
            cval = malloc((size_t)cap * sizeof *cval);
            if (cval == NULL)
                return TAGC_ERR_NOMEM;
        }
        if (scan_dispatch(&gt, &band, cval, cap, grad, grad_dtype, residual, rd, n, lo, hi)) {
            st = TAGC_ERR_NONFINITE;
            goto done;
        }
        valid = k == 0 || (gt < k && k <= gt + band);
    }
    if (!valid) { /* small shard, or the sample misled: histogram of it all */
        st = hist_bracket(&lo, &hi, &band, grad, grad_dtype, residual, rd, n, k);
        if (st != TAGC_OK)
            goto done;
    }
    if (!valid || band > cap) { /* (re)scan, the band's size now known */
        free(cval);
        cap = band;
        cval = malloc((size_t)(cap > 0 ? cap : 1) * sizeof *cval);
        if (cval == NULL) {
            st = TAGC_ERR_NOMEM;
            goto done;
        }
        scan_dispatch(&gt, &band, cval, cap, grad, grad_dtype, residual, rd, n, lo, hi);
    }
    uint32_t kth = 0x7fffffffu;
    int64_t eq_left = 0;
    if (k > 0) {
        int64_t need = k - gt, larger = 0;
        kth = kth_mag(cval, band, need);
        for (int64_t j = 0; j < band; j++)
            larger += mag_bits(cval[j]) > kth;
        eq_left = need - larger;
    }
    write_dispatch(idx, val, val_dtype, bitmap, residual, rd, grad, grad_dtype, n, kth,
                   eq_left);
    *tau = k > 0 ? u2f(kth) : INFINITY;
done:
    free(cval);
    return st;
}
